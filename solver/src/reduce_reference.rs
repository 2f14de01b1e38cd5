//! The reductions of [`crate::reduce`] as first written, kept as the oracle its tests compare
//! with: the faster implementation must give exactly the same reduced problem, strategy maps and
//! eliminations.

use std::collections::{BTreeMap, BTreeSet};

use crate::problem::{Edge, Live, Node, Problem};

use crate::reduce::{INFINITE, Recover, Reduction, ReductionStats};

struct Work {
    costs: Vec<Vec<u64>>,
    usages: Vec<Vec<u64>>,
    intervals: Vec<(u64, u64)>,
    /// Further live intervals of each node (see [`Node::extra`]).
    extra: Vec<Vec<Live>>,
    /// The usage limit cannot bind: every node is memory-free.
    no_memory: bool,
    /// Edge matrices keyed by `(u, v)` with `u < v`, oriented `[s_u][s_v]`.
    edges: BTreeMap<(usize, usize), Vec<u64>>,
    nbrs: Vec<BTreeSet<usize>>,
}

impl Work {
    fn k(&self, i: usize) -> usize {
        self.costs[i].len()
    }

    /// Edge cost between `i` at `si` and `j` at `sj`.
    fn cost(&self, i: usize, si: usize, j: usize, sj: usize) -> u64 {
        if i < j { self.edges[&(i, j)][si * self.k(j) + sj] } else { self.edges[&(j, i)][sj * self.k(i) + si] }
    }

    /// The edge matrix between `a` and `b` oriented `[s_a][s_b]` (one row per strategy of `a`).
    fn matrix(&self, a: usize, b: usize) -> Vec<u64> {
        let (ka, kb) = (self.k(a), self.k(b));
        let m = &self.edges[&(a.min(b), a.max(b))];
        if a < b { m.clone() } else { (0..ka).flat_map(|sa| (0..kb).map(move |sb| m[sb * ka + sa])).collect() }
    }

    fn add_edge(&mut self, i: usize, j: usize, f: impl Fn(usize, usize) -> u64) {
        let (u, v) = (i.min(j), i.max(j));
        let (ku, kv) = (self.k(u), self.k(v));
        let m = self.edges.entry((u, v)).or_insert_with(|| vec![0; ku * kv]);
        for su in 0..ku {
            for sv in 0..kv {
                let c = if u == i { f(su, sv) } else { f(sv, su) };
                m[su * kv + sv] = m[su * kv + sv].saturating_add(c);
            }
        }
        self.nbrs[u].insert(v);
        self.nbrs[v].insert(u);
    }

    fn remove_edge(&mut self, i: usize, j: usize) {
        self.edges.remove(&(i.min(j), i.max(j)));
        self.nbrs[i].remove(&j);
        self.nbrs[j].remove(&i);
    }

    fn memory_free(&self, i: usize) -> bool {
        if self.no_memory {
            return true;
        }
        let (s, e) = self.intervals[i];
        (s >= e || self.usages[i].iter().all(|&u| u == self.usages[i][0]))
            && self.extra[i].iter().all(|l| l.interval.0 >= l.interval.1 || l.usages.iter().all(|&u| u == l.usages[0]))
    }

    /// Usage of node `i` at strategy `t` compared with `s` over all its live intervals: `Less`
    /// if no more anywhere and less somewhere, `Equal` if the same everywhere, `Greater` if more
    /// somewhere.
    fn usage_cmp(&self, i: usize, t: usize, s: usize) -> std::cmp::Ordering {
        use std::cmp::Ordering::*;
        let mut out = Equal;
        for us in std::iter::once(&self.usages[i]).chain(self.extra[i].iter().map(|l| &l.usages)) {
            match us[t].cmp(&us[s]) {
                Greater => return Greater,
                Less => out = Less,
                Equal => {}
            }
        }
        out
    }

    /// Keeps only strategies `keep` (indices into the current list) of node `i`.
    fn restrict(&mut self, i: usize, keep: &[usize]) {
        let ki = self.k(i);
        self.costs[i] = keep.iter().map(|&s| self.costs[i][s]).collect();
        self.usages[i] = keep.iter().map(|&s| self.usages[i][s]).collect();
        for l in &mut self.extra[i] {
            l.usages = keep.iter().map(|&s| l.usages[s]).collect();
        }
        let nk = keep.len();
        for &j in &self.nbrs[i].clone() {
            let kj = self.k(j);
            let key = (i.min(j), i.max(j));
            let old = &self.edges[&key];
            let new: Vec<u64> = if i < j {
                keep.iter().flat_map(|&s| old[s * kj..(s + 1) * kj].iter().copied()).collect()
            } else {
                (0..kj).flat_map(|t| keep.iter().map(move |&s| old[t * ki + s])).collect()
            };
            debug_assert_eq!(new.len(), nk * kj);
            self.edges.insert(key, new);
        }
    }

    fn min_peak_ok(&self, limit: Option<u64>) -> bool {
        let Some(limit) = limit else { return true };
        let p = Problem {
            name: String::new(),
            nodes: (0..self.costs.len())
                .map(|i| Node {
                    interval: self.intervals[i],
                    costs: vec![0],
                    usages: vec![self.usages[i].iter().copied().min().unwrap_or(0)],
                    extra: self.extra[i]
                        .iter()
                        .map(|l| Live {
                            interval: l.interval,
                            usages: vec![l.usages.iter().copied().min().unwrap_or(0)],
                        })
                        .collect(),
                })
                .collect(),
            edges: vec![],
            usage_limit: Some(limit),
        };
        p.min_peak_usage().0 <= limit as u128
    }
}

/// Reduces a (valid) problem: the reductions as first written (the test oracle).
pub(crate) fn reduce(p: &Problem) -> Reduction {
    let n = p.nodes.len();
    let mut w = Work {
        costs: p.nodes.iter().map(|x| x.costs.clone()).collect(),
        usages: p.nodes.iter().map(|x| x.usages.clone()).collect(),
        intervals: p.nodes.iter().map(|x| x.interval).collect(),
        extra: p.nodes.iter().map(|x| x.extra.clone()).collect(),
        no_memory: !p.memory_may_bind(),
        edges: BTreeMap::new(),
        nbrs: vec![BTreeSet::new(); n],
    };
    // 1. Self-loops and parallel edges.
    for e in &p.edges {
        let (a, b) = e.nodes;
        let kb = p.nodes[b].strategies();
        if a == b {
            for s in 0..kb {
                w.costs[a][s] = w.costs[a][s].saturating_add(e.costs[s * kb + s]);
            }
        } else {
            w.add_edge(a, b, |sa, sb| e.costs[sa * kb + sb]);
        }
    }
    let mut keep: Vec<Vec<usize>> = p.nodes.iter().map(|x| (0..x.strategies()).collect()).collect();
    let mut stats = ReductionStats::default();

    // 2. Infinite strategies, if memory still fits without them.
    let mut finite_keep: Vec<Option<Vec<usize>>> = vec![None; n];
    for i in 0..n {
        let fin: Vec<usize> = (0..w.k(i)).filter(|&s| w.costs[i][s] < INFINITE).collect();
        if !fin.is_empty() && fin.len() < w.k(i) {
            finite_keep[i] = Some(fin);
        }
    }
    let (saved_usages, saved_extra) = (w.usages.clone(), w.extra.clone());
    for (i, f) in finite_keep.iter().enumerate() {
        if let Some(f) = f {
            w.usages[i] = f.iter().map(|&s| saved_usages[i][s]).collect();
            for l in &mut w.extra[i] {
                l.usages = f.iter().map(|&s| l.usages[s]).collect();
            }
        }
    }
    let drop_infinite = w.min_peak_ok(p.usage_limit);
    w.usages = saved_usages;
    w.extra = saved_extra;
    if drop_infinite {
        for (i, f) in finite_keep.into_iter().enumerate() {
            if let Some(f) = f {
                stats.strategies_removed += w.k(i) - f.len();
                keep[i] = f.iter().map(|&s| keep[i][s]).collect();
                w.restrict(i, &f);
            }
        }
    }

    // 3. Dominated strategies.
    for i in 0..n {
        let ki = w.k(i);
        if ki < 2 {
            continue;
        }
        let mem = !w.memory_free(i);
        let nb: Vec<usize> = w.nbrs[i].iter().copied().collect();
        // Each neighbour's costs against each of our strategies: per neighbour `j` its `k_j` and
        // the matrix `[s_i][s_j]` (one map lookup per neighbour instead of one per entry).
        let rows: Vec<(usize, Vec<u64>)> = nb.iter().map(|&j| (w.k(j), w.matrix(i, j))).collect();
        let row = |r: &(usize, Vec<u64>), s: usize| -> std::ops::Range<usize> { s * r.0..(s + 1) * r.0 };
        // Sum of each strategy's own and edge costs: a strategy can only be dominated by one
        // with no larger sum, which rules out most pairs without reading their rows.
        let sums: Vec<u128> = (0..ki)
            .map(|s| {
                let edges: u128 = rows.iter().map(|r| r.1[row(r, s)].iter().map(|&c| c as u128).sum::<u128>()).sum();
                w.costs[i][s] as u128 + edges
            })
            .collect();
        let mut dominated = vec![false; ki];
        for s in 0..ki {
            for t in 0..ki {
                if s == t || dominated[t] {
                    continue;
                }
                // Does t dominate s? (Ties: the lower index survives.)
                if w.costs[i][t] > w.costs[i][s] || sums[t] > sums[s] {
                    continue;
                }
                let usage = if mem { w.usage_cmp(i, t, s) } else { std::cmp::Ordering::Equal };
                if usage.is_gt() {
                    continue;
                }
                let equal_node = w.costs[i][t] == w.costs[i][s] && usage.is_eq();
                let mut all_le = true;
                let mut all_eq = equal_node;
                'nb: for r in &rows {
                    for (&ct, &cs) in r.1[row(r, t)].iter().zip(&r.1[row(r, s)]) {
                        if ct > cs {
                            all_le = false;
                            break 'nb;
                        }
                        if ct != cs {
                            all_eq = false;
                        }
                    }
                }
                if all_le && (!all_eq || t < s) {
                    dominated[s] = true;
                    break;
                }
            }
        }
        if dominated.iter().any(|&d| d) {
            let kept: Vec<usize> = (0..ki).filter(|&s| !dominated[s]).collect();
            stats.strategies_removed += ki - kept.len();
            keep[i] = kept.iter().map(|&s| keep[i][s]).collect();
            w.restrict(i, &kept);
        }
    }

    // 4-6. Folding and elimination, driven by a work list.
    let mut steps = Vec::new();
    let mut eliminated = vec![false; n];
    let mut queue: Vec<usize> = (0..n).collect();
    while let Some(i) = queue.pop() {
        if eliminated[i] {
            continue;
        }
        let deg = w.nbrs[i].len();
        if w.k(i) == 1 && deg > 0 {
            // Fold edges into neighbours.
            for j in w.nbrs[i].clone() {
                let kj = w.k(j);
                let add: Vec<u64> = (0..kj).map(|sj| w.cost(i, 0, j, sj)).collect();
                for (c, a) in w.costs[j].iter_mut().zip(add) {
                    *c = c.saturating_add(a);
                }
                w.remove_edge(i, j);
                queue.push(j);
            }
            continue;
        }
        if w.k(i) == 1 || !w.memory_free(i) {
            continue;
        }
        let ki = w.k(i);
        match deg {
            0 => {
                let s = (0..ki).min_by_key(|&s| w.costs[i][s]).unwrap_or(0);
                steps.push(Recover::Fixed { node: i, s });
                let c = w.costs[i][s];
                make_ghost(&mut w, i, s);
                w.costs[i][0] = c;
                eliminated[i] = true;
            }
            1 => {
                let j = *w.nbrs[i].iter().next().unwrap_or(&i);
                let kj = w.k(j);
                let cj = w.matrix(j, i);
                let mut table = Vec::with_capacity(kj);
                let mut add = Vec::with_capacity(kj);
                for sj in 0..kj {
                    let (s, c) = cj[sj * ki..(sj + 1) * ki]
                        .iter()
                        .zip(&w.costs[i])
                        .map(|(&e, &c)| c.saturating_add(e))
                        .enumerate()
                        .min_by_key(|&(_, c)| c)
                        .unwrap_or((0, 0));
                    table.push(s as u32);
                    add.push(c);
                }
                for (c, a) in w.costs[j].iter_mut().zip(add) {
                    *c = c.saturating_add(a);
                }
                w.remove_edge(i, j);
                steps.push(Recover::One { node: i, nb: j, table });
                make_ghost(&mut w, i, 0);
                eliminated[i] = true;
                queue.push(j);
            }
            2 => {
                let mut it = w.nbrs[i].iter();
                let (a, b) = match (it.next(), it.next()) {
                    (Some(&a), Some(&b)) => (a, b),
                    _ => continue,
                };
                let (ka, kb) = (w.k(a), w.k(b));
                if ka * kb > 4096 && ka * kb > ki * (ka + kb) {
                    continue;
                }
                // mat[sa][sb] = min over s of (cost[s] + ca[s][sa] + cb[s][sb]): for each sa, one
                // contiguous pass over s per sb (cb transposed), which the compiler vectorizes.
                let ca = w.matrix(a, i);
                let cb = w.matrix(b, i);
                let mut table = Vec::with_capacity(ka * kb);
                let mut mat = Vec::with_capacity(ka * kb);
                let mut row = vec![0u64; ki];
                for sa in 0..ka {
                    for (s, r) in row.iter_mut().enumerate() {
                        *r = w.costs[i][s].saturating_add(ca[sa * ki + s]);
                    }
                    for sb in 0..kb {
                        let col = &cb[sb * ki..(sb + 1) * ki];
                        let c = row.iter().zip(col).map(|(&x, &y)| x.saturating_add(y)).min().unwrap_or(0);
                        let s = row.iter().zip(col).position(|(&x, &y)| x.saturating_add(y) == c).unwrap_or(0);
                        table.push(s as u32);
                        mat.push(c);
                    }
                }
                w.remove_edge(i, a);
                w.remove_edge(i, b);
                w.add_edge(a, b, |sa, sb| mat[sa * kb + sb]);
                steps.push(Recover::Two { node: i, a, b, kb, table });
                make_ghost(&mut w, i, 0);
                eliminated[i] = true;
                queue.push(a);
                queue.push(b);
            }
            _ => {}
        }
    }
    stats.nodes_eliminated = (0..n).filter(|&i| w.k(i) == 1).count();
    stats.edges_left = w.edges.len();

    let nodes = (0..n)
        .map(|i| Node {
            interval: w.intervals[i],
            costs: w.costs[i].clone(),
            usages: w.usages[i].clone(),
            extra: w.extra[i].clone(),
        })
        .collect();
    let edges = w.edges.iter().map(|(&(u, v), m)| Edge { nodes: (u, v), costs: m.as_slice().into() }).collect();
    Reduction {
        problem: Problem { name: p.name.clone(), nodes, edges, usage_limit: p.usage_limit },
        keep,
        steps,
        stats,
    }
}

/// Turns node `i` into a single-strategy node with cost 0 and the usage of strategy `s`
/// (which is its usage whatever the strategy, or irrelevant).
fn make_ghost(w: &mut Work, i: usize, s: usize) {
    let u = w.usages[i].get(s).copied().unwrap_or(0);
    w.costs[i] = vec![0];
    w.usages[i] = vec![u];
    for l in &mut w.extra[i] {
        l.usages = vec![l.usages.get(s).copied().unwrap_or(0)];
    }
}
