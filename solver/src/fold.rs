//! Folding: nodes that share one decision variable become one node of a smaller problem.
//!
//! A group lists [`Member`]s: original nodes, each with the map from the group's strategies to
//! its own (`map[s]` is the member's strategy when the group takes `s`). Merging an op into its
//! producer (the producer's strategy fixes the follower's) and tying the same op of every
//! repeated layer (identity maps) are both groups. [`fold`] builds the problem with one node per
//! group:
//!
//! - the node's cost for `s` is the sum of its members' costs at `map[s]`, plus the entries of
//!   every edge between two members (an edge inside a group is a diagonal: a node cost);
//! - an edge between two groups sums the entries of the original edges between their members,
//!   one matrix per pair of groups;
//! - memory keeps every member's live intervals, each with the member's usages under the map
//!   ([`crate::Node::extra`]); intervals that coincide are summed into one.
//!
//! So for every solution `x` of the folded problem, [`Folded::expand`]`(x)` is a solution of the
//! original with exactly the same cost and the same usage at every time step; the folded
//! optimum is the original optimum over solutions that respect the groups. Sums saturate, and a
//! sum involving a forbidden entry stays forbidden (at least [`FORBIDDEN`]).

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::problem::{Edge, Live, Node, Problem};

/// IOPDDL's forbidden cost: folded sums of forbidden entries are clamped here.
pub const FORBIDDEN: u64 = 1_000_000_000_000_000_000;

/// A node of a group: when the group takes strategy `s`, `node` takes `map[s]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// The original node.
    pub node: usize,
    /// Its strategy for each strategy of the group.
    pub map: Vec<usize>,
}

/// A problem folded by groups, and the way back.
#[derive(Clone, Debug)]
pub struct Folded {
    /// One node per group, ordered by each group's smallest original node.
    pub problem: Problem,
    /// Members of each folded node.
    groups: Vec<Vec<Member>>,
    /// Nodes of the original problem.
    original_nodes: usize,
}

/// `a + b`, saturating, where a sum with a forbidden entry stays forbidden but no larger than
/// the larger of [`FORBIDDEN`] and its terms.
fn add(a: u64, b: u64) -> u64 {
    let s = a.saturating_add(b);
    if s >= FORBIDDEN { s.min(FORBIDDEN.max(a).max(b)) } else { s }
}

/// `c` added to itself `n` times with [`add`]: the exact product below [`FORBIDDEN`], else
/// what the repeated sum gives (the largest operand, at least [`FORBIDDEN`]).
fn times(c: u64, n: u64) -> u64 {
    let t = c.saturating_mul(n);
    if t < FORBIDDEN { t } else { c.max(FORBIDDEN) }
}

/// Folds `p` by `groups` (see the module docs). Nodes in no group stay alone (identity map).
///
/// Errors ([`Error::InvalidProblem`]): a node in two groups or out of range, an empty group,
/// members of one group with maps of different lengths (or empty), or a map entry that is not a
/// strategy of its member.
pub fn fold(p: &Problem, groups: &[Vec<Member>]) -> Result<Folded> {
    p.validate()?;
    let n = p.nodes.len();
    let bad = |m: String| Error::InvalidProblem(format!("folding: {m}"));
    let mut group_of = vec![usize::MAX; n];
    let mut all: Vec<Vec<Member>> = Vec::with_capacity(groups.len());
    for (g, members) in groups.iter().enumerate() {
        let Some(first) = members.first() else { return Err(bad(format!("group {g} is empty"))) };
        let k = first.map.len();
        if k == 0 {
            return Err(bad(format!("group {g} has no strategies")));
        }
        for m in members {
            if m.node >= n {
                return Err(bad(format!("group {g} names node {} of {n}", m.node)));
            }
            if group_of[m.node] != usize::MAX {
                return Err(bad(format!("node {} is in two groups", m.node)));
            }
            if m.map.len() != k {
                return Err(bad(format!("group {g}: node {} maps {} strategies, not {k}", m.node, m.map.len())));
            }
            let kn = p.nodes[m.node].strategies();
            if let Some(&s) = m.map.iter().find(|&&s| s >= kn) {
                return Err(bad(format!("group {g}: node {} has no strategy {s} (it has {kn})", m.node)));
            }
            group_of[m.node] = usize::MAX - 1;
        }
        all.push(members.clone());
    }
    for (i, node) in p.nodes.iter().enumerate() {
        if group_of[i] == usize::MAX {
            all.push(vec![Member { node: i, map: (0..node.strategies()).collect() }]);
        }
    }
    // Folded nodes in the order of their first original node (keeps a topological order).
    all.sort_by_key(|members| members.iter().map(|m| m.node).min().unwrap_or(usize::MAX));
    for (g, members) in all.iter().enumerate() {
        for m in members {
            group_of[m.node] = g;
        }
    }
    // Member of each original node: (group, index of the member in the group).
    let mut member_of = vec![(0usize, 0usize); n];
    for (g, members) in all.iter().enumerate() {
        for (j, m) in members.iter().enumerate() {
            member_of[m.node] = (g, j);
        }
    }
    let k: Vec<usize> = all.iter().map(|members| members[0].map.len()).collect();
    let mut nodes: Vec<Node> = all
        .iter()
        .map(|members| {
            let kg = members[0].map.len();
            let mut costs = vec![0u64; kg];
            // Intervals in order of first appearance, coinciding ones summed.
            let mut lives: Vec<Live> = Vec::new();
            let mut at: HashMap<(u64, u64), usize> = HashMap::new();
            for m in members {
                let node = &p.nodes[m.node];
                for (c, &s) in costs.iter_mut().zip(&m.map) {
                    *c = add(*c, node.costs[s]);
                }
                for (iv, us) in node.lives() {
                    let idx = *at.entry(iv).or_insert_with(|| {
                        lives.push(Live { interval: iv, usages: vec![0; kg] });
                        lives.len() - 1
                    });
                    for (u, &s) in lives[idx].usages.iter_mut().zip(&m.map) {
                        *u = u.saturating_add(us[s]);
                    }
                }
            }
            let mut lives = lives.into_iter();
            let primary = lives.next().unwrap_or_default();
            Node { interval: primary.interval, costs, usages: primary.usages, extra: lives.collect() }
        })
        .collect();
    // Edges: inside a group onto the node's costs, between groups summed per pair.
    // Equal contributions (a shared matrix between members with the same maps in the same
    // groups: every repeated layer's edge once layers are tied) are added once, times their count.
    let mut map_id: HashMap<&[usize], usize> = HashMap::new();
    let mut mid = vec![0usize; n];
    for members in &all {
        for m in members {
            let next = map_id.len();
            mid[m.node] = *map_id.entry(m.map.as_slice()).or_insert(next);
        }
    }
    let mut seen: HashMap<(usize, usize, usize, usize, usize, usize), usize> = HashMap::new();
    let mut uses: Vec<(usize, u64)> = Vec::new();
    for (i, e) in p.edges.iter().enumerate() {
        let (a, b) = e.nodes;
        let key = (e.costs.as_ptr() as usize, p.nodes[b].strategies(), member_of[a].0, member_of[b].0, mid[a], mid[b]);
        match seen.entry(key) {
            std::collections::hash_map::Entry::Occupied(o) => uses[*o.get()].1 += 1,
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(uses.len());
                uses.push((i, 1));
            }
        }
    }
    let mut pair: HashMap<(usize, usize), usize> = HashMap::new();
    let mut edges: Vec<((usize, usize), Vec<u64>)> = Vec::new();
    for (i, count) in uses {
        let e = &p.edges[i];
        let (a, b) = e.nodes;
        let kb = p.nodes[b].strategies();
        let ((ga, ja), (gb, jb)) = (member_of[a], member_of[b]);
        let (ma, mb) = (&all[ga][ja].map, &all[gb][jb].map);
        if ga == gb {
            for (s, c) in nodes[ga].costs.iter_mut().enumerate() {
                *c = add(*c, times(e.costs[ma[s] * kb + mb[s]], count));
            }
            continue;
        }
        let (lo, hi) = (ga.min(gb), ga.max(gb));
        let idx = *pair.entry((lo, hi)).or_insert_with(|| {
            edges.push(((lo, hi), vec![0; k[lo] * k[hi]]));
            edges.len() - 1
        });
        let m = &mut edges[idx].1;
        let khi = k[hi];
        for sa in 0..k[ga] {
            let row = &e.costs[ma[sa] * kb..(ma[sa] + 1) * kb];
            for sb in 0..k[gb] {
                let c = times(row[mb[sb]], count);
                let at = if ga == lo { sa * khi + sb } else { sb * khi + sa };
                m[at] = add(m[at], c);
            }
        }
    }
    let edges = edges.into_iter().map(|(nodes, costs)| Edge { nodes, costs: costs.into() }).collect();
    let problem = Problem { name: p.name.clone(), nodes, edges, usage_limit: p.usage_limit };
    problem.validate()?;
    Ok(Folded { problem, groups: all, original_nodes: n })
}

impl Folded {
    /// The solution of the original problem that `x` (a solution of the folded one) stands for.
    /// Errors when `x` does not fit the folded problem.
    pub fn expand(&self, x: &[usize]) -> Result<Vec<usize>> {
        self.problem.check_solution(x)?;
        let mut out = vec![0; self.original_nodes];
        for (members, &s) in self.groups.iter().zip(x) {
            for m in members {
                out[m.node] = m.map[s];
            }
        }
        Ok(out)
    }

    /// Members of each folded node.
    pub fn groups(&self) -> &[Vec<Member>] {
        &self.groups
    }
}

/// The size of a problem as the solver sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Size {
    /// Nodes.
    pub nodes: usize,
    /// Edges between distinct nodes, parallel edges counted once.
    pub edges: usize,
    /// Strategies over all nodes.
    pub strategies: usize,
    /// Variables of the exact ILP ([`crate::ilp`]): one per strategy and one per finite entry
    /// of every (merged) edge.
    pub variables: usize,
}

impl Problem {
    /// Nodes, edges, strategies and ILP variables (before reductions).
    pub fn size(&self) -> Size {
        let k = |i: usize| self.nodes[i].strategies();
        // Edges grouped by node pair; a pair's entry is finite when every parallel edge's is.
        let mut order: Vec<usize> =
            (0..self.edges.len()).filter(|&e| self.edges[e].nodes.0 != self.edges[e].nodes.1).collect();
        let pair = |e: usize| {
            let (a, b) = self.edges[e].nodes;
            (a.min(b), a.max(b))
        };
        order.sort_by_key(|&e| pair(e));
        let (mut edges, mut finite) = (0, 0);
        // Finite entries of each shared matrix, counted once.
        let mut counted: HashMap<usize, usize> = HashMap::new();
        let mut at = 0;
        while at < order.len() {
            let (lo, hi) = pair(order[at]);
            let end = at + order[at..].iter().take_while(|&&e| pair(e) == (lo, hi)).count();
            edges += 1;
            if end == at + 1 {
                let costs = &self.edges[order[at]].costs;
                finite += *counted
                    .entry(costs.as_ptr() as usize)
                    .or_insert_with(|| costs.iter().filter(|&&c| c < crate::reduce::INFINITE).count());
            } else {
                let khi = k(hi);
                let mut ok = vec![true; k(lo) * khi];
                for &e in &order[at..end] {
                    let (a, b) = self.edges[e].nodes;
                    let kb = k(b);
                    for (j, &c) in self.edges[e].costs.iter().enumerate() {
                        if c >= crate::reduce::INFINITE {
                            let (sa, sb) = (j / kb, j % kb);
                            ok[if a == lo { sa * khi + sb } else { sb * khi + sa }] = false;
                        }
                    }
                }
                finite += ok.iter().filter(|&&f| f).count();
            }
            at = end;
        }
        let strategies = self.total_strategies();
        Size { nodes: self.nodes.len(), edges, strategies, variables: strategies + finite }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// A random problem; some nodes have extra live intervals, some edges forbidden entries.
    fn random(rng: &mut rand::rngs::SmallRng, n: usize) -> Problem {
        let nodes: Vec<Node> = (0..n)
            .map(|_| {
                let k = rng.random_range(1..=4);
                let start = rng.random_range(0..8);
                let mut node = Node::new(
                    (start, start + rng.random_range(0..6)),
                    (0..k).map(|_| rng.random_range(0..50)).collect(),
                    (0..k).map(|_| rng.random_range(0..10)).collect(),
                );
                if rng.random_bool(0.3) {
                    let s = rng.random_range(0..8);
                    node.extra.push(Live {
                        interval: (s, s + rng.random_range(0..6)),
                        usages: (0..k).map(|_| rng.random_range(0..10)).collect(),
                    });
                }
                node
            })
            .collect();
        let edges = (0..2 * n)
            .map(|_| {
                let (a, b) = (rng.random_range(0..n), rng.random_range(0..n));
                let kk = nodes[a].strategies() * nodes[b].strategies();
                let costs =
                    (0..kk).map(|_| if rng.random_bool(0.05) { FORBIDDEN } else { rng.random_range(0..40) }).collect();
                Edge { nodes: (a, b), costs }
            })
            .collect();
        Problem { name: "random".into(), nodes, edges, usage_limit: Some(rng.random_range(5..40)) }
    }

    /// Random groups: disjoint sets of nodes, random maps onto the first member's strategies.
    fn random_groups(rng: &mut rand::rngs::SmallRng, p: &Problem) -> Vec<Vec<Member>> {
        let n = p.nodes.len();
        let mut order: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            order.swap(i, rng.random_range(0..=i));
        }
        let mut groups = vec![];
        let mut it = order.into_iter().peekable();
        while it.peek().is_some() {
            let size = rng.random_range(1..=3);
            let members: Vec<usize> = it.by_ref().take(size).collect();
            let k = rng.random_range(1..=4);
            groups.push(
                members
                    .into_iter()
                    .map(|node| {
                        let kn = p.nodes[node].strategies();
                        Member { node, map: (0..k).map(|_| rng.random_range(0..kn)).collect() }
                    })
                    .collect(),
            );
        }
        groups
    }

    #[test]
    fn expanded_solutions_keep_cost_and_usage() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
        for case in 0..300 {
            let n = rng.random_range(1..9);
            let p = random(&mut rng, n);
            let groups = random_groups(&mut rng, &p);
            let f = fold(&p, &groups).unwrap();
            assert!(f.problem.nodes.len() <= p.nodes.len());
            for _ in 0..10 {
                let x: Vec<usize> = f.problem.nodes.iter().map(|nd| rng.random_range(0..nd.strategies())).collect();
                let full = f.expand(&x).unwrap();
                let (a, b) = (f.problem.evaluate(&x).unwrap(), p.evaluate(&full).unwrap());
                // Sums that hit a forbidden entry are clamped; finite ones are exact.
                if b.cost < FORBIDDEN as u128 {
                    assert_eq!(a.cost, b.cost, "case {case}: cost");
                } else {
                    assert!(a.cost >= FORBIDDEN as u128, "case {case}: a forbidden solution became allowed");
                }
                assert_eq!(a.peak_usage, b.peak_usage, "case {case}: peak");
                assert_eq!(a.feasible(), b.feasible(), "case {case}: feasibility");
            }
        }
    }

    /// The solver's optimum of the folded problem is the brute-force optimum over the solutions
    /// that respect the groups, and expands to a solution of the original with that cost.
    #[test]
    fn folded_optimum_is_the_grouped_optimum() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(11);
        let mut solved = 0;
        for _ in 0..60 {
            let n = rng.random_range(2..7);
            let p = random(&mut rng, n);
            let groups = random_groups(&mut rng, &p);
            let f = fold(&p, &groups).unwrap();
            let Some((_, best)) = crate::brute_force(&f.problem).unwrap() else { continue };
            if best >= crate::reduce::INFINITE as u128 {
                continue;
            }
            let opts = crate::SolveOptions {
                time_limit: std::time::Duration::from_secs(10),
                threads: 1,
                method: crate::Method::Ilp,
                ..Default::default()
            };
            let Ok(r) = crate::solve(&f.problem, &opts) else { continue };
            assert_eq!(r.cost, best);
            let full = f.expand(&r.solution).unwrap();
            let ev = p.evaluate(&full).unwrap();
            assert_eq!(ev.cost, best);
            assert!(ev.feasible());
            solved += 1;
        }
        assert!(solved > 20, "only {solved} cases solved");
    }

    #[test]
    fn tied_members_keep_their_own_intervals() {
        // Two identical nodes live at different times, tied: the peak is one of them, not both.
        let node = |iv| Node::new(iv, vec![5, 1], vec![1, 10]);
        let p = Problem {
            name: "tied".into(),
            nodes: vec![node((0, 2)), node((2, 4))],
            edges: vec![],
            usage_limit: Some(10),
        };
        let groups = vec![vec![Member { node: 0, map: vec![0, 1] }, Member { node: 1, map: vec![0, 1] }]];
        let f = fold(&p, &groups).unwrap();
        assert_eq!(f.problem.nodes.len(), 1);
        assert_eq!(f.problem.nodes[0].extra.len(), 1);
        let r = crate::solve(&f.problem, &crate::SolveOptions::default()).unwrap();
        assert_eq!(r.solution, vec![1]);
        assert_eq!(r.cost, 2);
        assert_eq!(f.expand(&r.solution).unwrap(), vec![1, 1]);
        // Coinciding intervals add up: tied at the same time, 2 x 10 > 10.
        let p2 = Problem { nodes: vec![node((0, 2)), node((0, 2))], ..p };
        let f2 = fold(&p2, &groups).unwrap();
        assert!(f2.problem.nodes[0].extra.is_empty());
        assert_eq!(f2.problem.nodes[0].usages, vec![2, 20]);
        assert_eq!(crate::solve(&f2.problem, &crate::SolveOptions::default()).unwrap().solution, vec![0]);
    }

    #[test]
    fn shared_matrices_fold_as_copies() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(11);
        for _ in 0..200 {
            let n = rng.random_range(2..7);
            let mut p = random(&mut rng, n);
            // Share some matrices between edges of the same shape, some of them huge.
            for i in 0..p.edges.len() {
                for j in 0..i {
                    let (a, b) = (p.edges[i].nodes, p.edges[j].nodes);
                    let k = |x: usize| p.nodes[x].strategies();
                    if k(a.0) == k(b.0) && k(a.1) == k(b.1) && rng.random_bool(0.5) {
                        p.edges[i].costs = p.edges[j].costs.clone();
                        break;
                    }
                }
                if rng.random_bool(0.1) {
                    p.edges[i].costs = p.edges[i].costs.iter().map(|&c| c.max(FORBIDDEN / 3)).collect();
                }
            }
            // Parallel copies of one matrix: the same group pair and maps, added once times 2 or 3.
            for _ in 0..rng.random_range(0..4) {
                let e = p.edges[rng.random_range(0..p.edges.len())].clone();
                p.edges.push(e);
            }
            let copied = Problem {
                edges: p.edges.iter().map(|e| Edge { nodes: e.nodes, costs: e.costs.to_vec().into() }).collect(),
                ..p.clone()
            };
            let groups = random_groups(&mut rng, &p);
            let (a, b) = (fold(&p, &groups).unwrap(), fold(&copied, &groups).unwrap());
            assert_eq!(a.problem, b.problem);
            assert_eq!(p.size(), copied.size());
        }
    }

    #[test]
    fn folded_problems_round_trip_through_json() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(3);
        let p = random(&mut rng, 8);
        let groups = random_groups(&mut rng, &p);
        let f = fold(&p, &groups).unwrap();
        assert!(f.problem.nodes.iter().any(|n| !n.extra.is_empty()));
        assert_eq!(Problem::from_json_bytes(f.problem.to_json().as_bytes()).unwrap(), f.problem);
        // IOPDDL problems are written without the extension.
        assert!(
            !Problem { nodes: vec![Node::new((0, 1), vec![1], vec![1])], ..Default::default() }
                .to_json()
                .contains("extra")
        );
    }

    #[test]
    fn bad_groups_are_errors() {
        let p = Problem { nodes: vec![Node::new((0, 1), vec![1, 2], vec![0, 0]); 2], ..Default::default() };
        let m = |node, map: Vec<usize>| Member { node, map };
        for groups in [
            vec![vec![]],
            vec![vec![m(0, vec![0]), m(0, vec![1])]],
            vec![vec![m(0, vec![0, 1]), m(1, vec![0])]],
            vec![vec![m(0, vec![2])]],
            vec![vec![m(5, vec![0])]],
        ] {
            assert!(matches!(fold(&p, &groups), Err(Error::InvalidProblem(_))));
        }
    }

    #[test]
    fn size_counts_finite_entries_of_merged_edges() {
        let p = Problem {
            nodes: vec![Node::new((0, 1), vec![1, 2], vec![0, 0]), Node::new((0, 1), vec![1, 2, 3], vec![0, 0, 0])],
            edges: vec![
                Edge { nodes: (0, 1), costs: vec![0, FORBIDDEN, 0, 0, 0, 0].into() },
                Edge { nodes: (1, 0), costs: vec![0, 0, 0, 0, FORBIDDEN, 0].into() },
                Edge { nodes: (1, 1), costs: vec![0; 9].into() },
            ],
            ..Default::default()
        };
        assert_eq!(p.size(), Size { nodes: 2, edges: 1, strategies: 5, variables: 5 + 4 });
    }
}
