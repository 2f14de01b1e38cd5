//! The compiled form of a [`Problem`] that the search, the ILP and the bounds work on.
//!
//! Invariants: parallel edges are merged (one matrix per unordered node pair) and self-loops are
//! folded into node costs, so the adjacency is simple; time is compressed to the *maximal* steps,
//! the starts of segments whose live set is not contained in a neighbouring segment's (a step
//! where some interval starts and after which some interval ends). A node's memory is a list of
//! disjoint, sorted [`Piece`]s of those steps, each with a usage per strategy: one piece for an
//! IOPDDL node (its interval), several for a node with several live intervals (where intervals
//! overlap, their usages add up). Checking usage at these steps is exactly checking it at every
//! time step. When the limit cannot bind at all ([`Problem::memory_may_bind`]), there are no
//! steps and no pieces.

use std::collections::HashMap;

use crate::problem::Problem;

/// An entry of a node's adjacency list.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Adj {
    /// The neighbour.
    pub other: usize,
    /// Offset in `Model::mats` of the matrix oriented `[s_other][s_self]` (row-major), so the
    /// row for the neighbour's current strategy is a contiguous slice over our strategies.
    pub mat: usize,
    /// The edge forbids some pairs (entries of 10^17 or more): the two nodes must move together.
    pub hard: bool,
}

/// A merged edge `(u, v)` with `u < v` and its matrix `[s_u][s_v]` at offset `mat`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MEdge {
    pub u: usize,
    pub v: usize,
    pub mat: usize,
}

/// Costs at or above this are forbidden entries (IOPDDL uses 10^18).
pub(crate) const HARD: f64 = 1e17;

/// A running cost kept exact: the finite entries are integers, whose `f64` sums are exact below
/// 2^53, and forbidden entries are counted apart. Adding and removing a 10^18 entry in one `f64`
/// sum would instead round away the small costs (the ulp of 10^18 is 128) and let the search
/// accept moves that make the true cost worse.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct CostSum {
    pub finite: f64,
    pub hard: i64,
}

impl CostSum {
    #[inline]
    pub fn add(&mut self, c: f64) {
        if c >= HARD {
            self.hard += 1;
        } else {
            self.finite += c;
        }
    }

    #[inline]
    pub fn sub(&mut self, c: f64) {
        if c >= HARD {
            self.hard -= 1;
        } else {
            self.finite -= c;
        }
    }

    /// One number for comparisons: every forbidden entry counts 10^18.
    #[inline]
    pub fn value(&self) -> f64 {
        if self.hard == 0 { self.finite } else { self.finite + self.hard as f64 * 1e18 }
    }
}

/// Compressed steps `[l, r)` over which a node uses `Model::pusage[u + s]` under strategy `s`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Piece {
    pub l: usize,
    pub r: usize,
    pub u: usize,
}

pub(crate) struct Model {
    pub n: usize,
    pub k: Vec<usize>,
    pub off: Vec<usize>,
    pub cost: Vec<f64>,
    /// Per strategy, the largest usage over the node's pieces: a summary for heuristics (exact
    /// for a node with one piece). Feasibility always goes through the pieces.
    pub usage: Vec<i64>,
    /// Node `i`'s pieces are `pieces[piece_start[i]..piece_start[i + 1]]` (disjoint, sorted;
    /// none when the node is never live at a maximal step).
    pub pieces: Vec<Piece>,
    pub piece_start: Vec<usize>,
    /// Usages of the pieces, `k[i]` per piece.
    pub pusage: Vec<i64>,
    /// The original time of each compressed step.
    pub steps: Vec<u64>,
    pub limit: i64,
    pub adj_start: Vec<usize>,
    pub adj: Vec<Adj>,
    pub mats: Vec<f64>,
    pub edges: Vec<MEdge>,
}

impl Model {
    pub fn new(p: &Problem) -> Model {
        let n = p.nodes.len();
        // Clamp usages so that no sum over all nodes can overflow an i64.
        let cap = (i64::MAX as u64 / 4) / (n as u64 + 1);
        let k: Vec<usize> = p.nodes.iter().map(|x| x.strategies()).collect();
        let mut off = Vec::with_capacity(n + 1);
        let mut acc = 0;
        for &ki in &k {
            off.push(acc);
            acc += ki;
        }
        off.push(acc);
        let mut cost: Vec<f64> = Vec::with_capacity(acc);
        for node in &p.nodes {
            cost.extend(node.costs.iter().map(|&c| c as f64));
        }
        // When the limit cannot bind, memory is left out altogether.
        let (steps, pieces, piece_start, pusage) = if p.memory_may_bind() {
            compress_time(p, cap)
        } else {
            (Vec::new(), Vec::new(), vec![0; n + 1], Vec::new())
        };
        let mut usage: Vec<i64> = Vec::with_capacity(acc);
        for (i, node) in p.nodes.iter().enumerate() {
            let ps = &pieces[piece_start[i]..piece_start[i + 1]];
            if ps.is_empty() {
                usage.extend(node.usages.iter().map(|&u| u.min(cap) as i64));
            } else {
                usage.extend((0..k[i]).map(|s| ps.iter().map(|pc| pusage[pc.u + s]).max().unwrap_or(0)));
            }
        }
        let limit = p.usage_limit.map_or(i64::MAX / 2, |l| l.min(i64::MAX as u64 / 2) as i64);

        // Merge parallel edges (one matrix per pair, in order of first appearance, its entries
        // summed in edge order); fold self-loops.
        let mut pair_index: HashMap<(usize, usize), usize> = HashMap::new();
        let mut pairs: Vec<(usize, usize, Vec<usize>)> = Vec::new();
        for (x, e) in p.edges.iter().enumerate() {
            let (a, b) = e.nodes;
            if a == b {
                let ka = k[a];
                for s in 0..ka {
                    cost[off[a] + s] += e.costs[s * ka + s] as f64;
                }
                continue;
            }
            let (u, v) = (a.min(b), a.max(b));
            let idx = *pair_index.entry((u, v)).or_insert_with(|| {
                pairs.push((u, v, Vec::new()));
                pairs.len() - 1
            });
            pairs[idx].2.push(x);
        }
        // Each pair's matrix [s_u][s_v], then its transpose [s_v][s_u], written in place.
        let total: usize = pairs.iter().map(|(u, v, _)| 2 * k[*u] * k[*v]).sum();
        let mut mats = vec![0.0f64; total];
        let mut edges = Vec::with_capacity(pairs.len());
        let mut deg = vec![0usize; n];
        let mut entries: Vec<(usize, Adj)> = Vec::with_capacity(2 * pairs.len());
        let mut base = 0;
        for (u, v, list) in pairs {
            let (ku, kv) = (k[u], k[v]);
            let (m, t) = mats[base..base + 2 * ku * kv].split_at_mut(ku * kv);
            for &x in &list {
                let e = &p.edges[x];
                if e.nodes.0 == u {
                    for (c, &a) in m.iter_mut().zip(e.costs.iter()) {
                        *c += a as f64;
                    }
                } else {
                    // [s_v][s_u] onto [s_u][s_v].
                    for sv in 0..kv {
                        for su in 0..ku {
                            m[su * kv + sv] += e.costs[sv * ku + su] as f64;
                        }
                    }
                }
            }
            transpose(m, ku, kv, t);
            edges.push(MEdge { u, v, mat: base });
            let hard = m.iter().any(|&c| c >= 1e17);
            // For v the neighbour is u: oriented [s_u][s_v] = m.
            entries.push((v, Adj { other: u, mat: base, hard }));
            // For u the neighbour is v: oriented [s_v][s_u] = transpose.
            entries.push((u, Adj { other: v, mat: base + ku * kv, hard }));
            deg[u] += 1;
            deg[v] += 1;
            base += 2 * ku * kv;
        }
        let mut adj_start = vec![0; n + 1];
        for i in 0..n {
            adj_start[i + 1] = adj_start[i] + deg[i];
        }
        let mut fill = adj_start.clone();
        let mut adj = vec![Adj { other: 0, mat: 0, hard: false }; entries.len()];
        for (i, a) in entries {
            adj[fill[i]] = a;
            fill[i] += 1;
        }

        Model { n, k, off, cost, usage, pieces, piece_start, pusage, steps, limit, adj_start, adj, mats, edges }
    }

    /// Node `i`'s pieces.
    #[inline]
    pub fn pieces(&self, i: usize) -> &[Piece] {
        &self.pieces[self.piece_start[i]..self.piece_start[i + 1]]
    }

    /// Usages of node `i` over piece `p` (one of its pieces), per strategy.
    #[inline]
    pub fn piece_usages(&self, i: usize, p: &Piece) -> &[i64] {
        &self.pusage[p.u..p.u + self.k[i]]
    }

    /// Usages of node `i` at compressed step `t`, per strategy, if it is live there.
    pub fn usage_at(&self, i: usize, t: usize) -> Option<&[i64]> {
        let ps = self.pieces(i);
        let j = ps.partition_point(|p| p.r <= t);
        ps.get(j).filter(|p| p.l <= t).map(|p| self.piece_usages(i, p))
    }

    #[inline]
    pub fn adj(&self, i: usize) -> &[Adj] {
        &self.adj[self.adj_start[i]..self.adj_start[i + 1]]
    }

    #[inline]
    pub fn costs(&self, i: usize) -> &[f64] {
        &self.cost[self.off[i]..self.off[i + 1]]
    }

    #[inline]
    pub fn usages(&self, i: usize) -> &[i64] {
        &self.usage[self.off[i]..self.off[i + 1]]
    }

    /// Row of the matrix of adjacency `a` of node `i` for the neighbour's strategy `so`.
    #[inline]
    pub fn row(&self, i: usize, a: &Adj, so: usize) -> &[f64] {
        let ki = self.k[i];
        &self.mats[a.mat + so * ki..a.mat + (so + 1) * ki]
    }

    /// Number of compressed time steps.
    pub fn nsteps(&self) -> usize {
        self.steps.len()
    }

    /// Cost of `x` computed from scratch, as [`CostSum::value`].
    pub fn total_cost(&self, x: &[usize]) -> f64 {
        self.cost_sum(x).value()
    }

    /// Cost of `x` split into its finite part and its count of forbidden entries.
    pub fn cost_sum(&self, x: &[usize]) -> CostSum {
        let mut c = CostSum::default();
        for i in 0..self.n {
            c.add(self.cost[self.off[i] + x[i]]);
        }
        for e in &self.edges {
            c.add(self.mats[e.mat + x[e.u] * self.k[e.v] + x[e.v]]);
        }
        c
    }

    /// Usage at every compressed step for `x`.
    pub fn usage_profile(&self, x: &[usize]) -> Vec<i64> {
        let t = self.nsteps();
        let mut diff = vec![0i64; t + 1];
        for i in 0..self.n {
            for p in self.pieces(i) {
                let u = self.pusage[p.u + x[i]];
                diff[p.l] += u;
                diff[p.r] -= u;
            }
        }
        let mut cur = 0;
        let mut out = Vec::with_capacity(t);
        for d in diff.iter().take(t) {
            cur += d;
            out.push(cur);
        }
        out
    }
}

/// `m` (`rows x cols`, row-major) transposed into `out` (`cols x rows`), by cache-sized blocks.
fn transpose(m: &[f64], rows: usize, cols: usize, out: &mut [f64]) {
    const B: usize = 32;
    for r0 in (0..rows).step_by(B) {
        for c0 in (0..cols).step_by(B) {
            for r in r0..(r0 + B).min(rows) {
                for c in c0..(c0 + B).min(cols) {
                    out[c * rows + r] = m[r * cols + c];
                }
            }
        }
    }
}

/// Compressed maximal steps, and each node's pieces over them (with their usages, clamped to
/// `cap` per node and step).
#[allow(clippy::type_complexity)]
fn compress_time(p: &Problem, cap: u64) -> (Vec<u64>, Vec<Piece>, Vec<usize>, Vec<i64>) {
    let mut starts: Vec<u64> = Vec::new();
    let mut ends: Vec<u64> = Vec::new();
    for node in &p.nodes {
        for ((s, e), _) in node.lives() {
            if s < e {
                starts.push(s);
                ends.push(e);
            }
        }
    }
    starts.sort_unstable();
    starts.dedup();
    ends.sort_unstable();
    ends.dedup();
    let mut points: Vec<u64> = starts.iter().chain(&ends).copied().collect();
    points.sort_unstable();
    points.dedup();
    let mut steps = Vec::new();
    for w in points.windows(2) {
        if starts.binary_search(&w[0]).is_ok() && ends.binary_search(&w[1]).is_ok() {
            steps.push(w[0]);
        }
    }
    let range = |(s, e): (u64, u64)| -> (usize, usize) {
        if s >= e {
            return (0, 0);
        }
        (steps.partition_point(|&t| t < s), steps.partition_point(|&t| t < e))
    };
    let mut pieces = Vec::new();
    let mut piece_start = Vec::with_capacity(p.nodes.len() + 1);
    let mut pusage: Vec<i64> = Vec::new();
    for node in &p.nodes {
        piece_start.push(pieces.len());
        let k = node.strategies();
        let lives: Vec<((usize, usize), &[u64])> =
            node.lives().map(|(iv, us)| (range(iv), us)).filter(|((a, b), _)| a < b).collect();
        if let [((a, b), us)] = lives[..] {
            pieces.push(Piece { l: a, r: b, u: pusage.len() });
            pusage.extend(us.iter().map(|&u| u.min(cap) as i64));
            continue;
        }
        // Several intervals: cut at every boundary, sum the covering intervals' usages, and join
        // neighbouring pieces with equal usages.
        let mut cuts: Vec<usize> = lives.iter().flat_map(|((a, b), _)| [*a, *b]).collect();
        cuts.sort_unstable();
        cuts.dedup();
        let first = pieces.len();
        let mut sum = vec![0u64; k];
        for w in cuts.windows(2) {
            let (l, r) = (w[0], w[1]);
            sum.fill(0);
            let mut any = false;
            for ((a, b), us) in &lives {
                if *a <= l && r <= *b {
                    any = true;
                    for (t, &u) in sum.iter_mut().zip(*us) {
                        *t = t.saturating_add(u);
                    }
                }
            }
            if !any {
                continue;
            }
            if pieces.len() > first
                && let Some(last) = pieces.last_mut()
                && last.r == l
                && pusage[last.u..last.u + k].iter().zip(&sum).all(|(&a, &b)| a == b.min(cap) as i64)
            {
                last.r = r;
                continue;
            }
            pieces.push(Piece { l, r, u: pusage.len() });
            pusage.extend(sum.iter().map(|&u| u.min(cap) as i64));
        }
    }
    piece_start.push(pieces.len());
    (steps, pieces, piece_start, pusage)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::{Edge, Node};
    use rand::{Rng, SeedableRng};

    /// A random problem whose edges join nodes of different strategy counts in both
    /// orientations (`u > v` as well as `u < v`), with parallel edges and self-loops.
    fn random(rng: &mut rand::rngs::SmallRng, n: usize) -> Problem {
        let nodes: Vec<Node> = (0..n)
            .map(|_| {
                let k = rng.random_range(1..=5);
                let start = rng.random_range(0..6);
                Node::new(
                    (start, start + rng.random_range(1..5)),
                    (0..k).map(|_| rng.random_range(0..50)).collect(),
                    (0..k).map(|_| rng.random_range(0..10)).collect(),
                )
            })
            .collect();
        let edges = (0..3 * n)
            .map(|_| {
                let (a, b) = (rng.random_range(0..n), rng.random_range(0..n));
                let kk = nodes[a].strategies() * nodes[b].strategies();
                Edge { nodes: (a, b), costs: (0..kk).map(|_| rng.random_range(0..40)).collect() }
            })
            .collect();
        Problem { name: "random".into(), nodes, edges, usage_limit: Some(rng.random_range(5..40)) }
    }

    /// The compiled matrices are the problem's edges seen from each end: every adjacency row
    /// is the sum of the parallel edges' entries read through [`Edge::cost_from`] (self-loops
    /// in the node costs), and whole solutions cost what [`Problem::evaluate`] says. Edge
    /// orientation and unequal strategy counts are where a row-major index goes wrong.
    #[test]
    fn matrices_are_the_edges_seen_from_each_end() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(5);
        for case in 0..200 {
            let n = rng.random_range(2..8);
            let p = random(&mut rng, n);
            let m = Model::new(&p);
            let k: Vec<usize> = p.nodes.iter().map(Node::strategies).collect();
            for i in 0..n {
                let mut own: Vec<f64> = p.nodes[i].costs.iter().map(|&c| c as f64).collect();
                for e in p.edges.iter().filter(|e| e.nodes == (i, i)) {
                    for (s, c) in own.iter_mut().enumerate() {
                        *c += e.cost_from(i, s, s, &k) as f64;
                    }
                }
                assert_eq!(m.costs(i), &own[..], "case {case}: node {i}");
                for a in m.adj(i) {
                    let j = a.other;
                    for sj in 0..k[j] {
                        let want: Vec<f64> = (0..k[i])
                            .map(|si| {
                                p.edges
                                    .iter()
                                    .filter(|e| e.nodes == (i, j) || e.nodes == (j, i))
                                    .map(|e| e.cost_from(i, si, sj, &k) as f64)
                                    .sum()
                            })
                            .collect();
                        assert_eq!(m.row(i, a, sj), &want[..], "case {case}: edge {i}-{j} at {sj}");
                    }
                }
            }
            let r = crate::reduce::reduce(&p);
            for _ in 0..10 {
                let x: Vec<usize> = k.iter().map(|&ki| rng.random_range(0..ki)).collect();
                assert_eq!(m.total_cost(&x), p.evaluate(&x).unwrap().cost as f64, "case {case}");
                let y: Vec<usize> = r.problem.nodes.iter().map(|nd| rng.random_range(0..nd.strategies())).collect();
                assert_eq!(
                    r.problem.evaluate(&y).unwrap().cost,
                    p.evaluate(&r.expand(&y)).unwrap().cost,
                    "case {case}"
                );
            }
        }
    }

    #[test]
    fn cost_from_reads_either_end() {
        // Node 0 has 2 strategies, node 1 has 3: entry (s0, s1) is 10 * s0 + s1.
        let e = Edge { nodes: (0, 1), costs: vec![0, 1, 2, 10, 11, 12].into() };
        let k = [2, 3];
        for s0 in 0..2 {
            for s1 in 0..3 {
                assert_eq!(e.cost_from(0, s0, s1, &k), (10 * s0 + s1) as u64);
                assert_eq!(e.cost_from(1, s1, s0, &k), (10 * s0 + s1) as u64);
            }
        }
    }
}

#[cfg(test)]
mod bench {
    fn cpu() -> std::time::Duration {
        let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
        std::time::Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
    }

    /// Times reduce and compile on the problems named in `REDUCE_BENCH` (comma-separated).
    #[test]
    #[ignore]
    fn bench_reduce_compile() {
        let Ok(paths) = std::env::var("REDUCE_BENCH") else { return };
        for path in paths.split(',') {
            let p = crate::Problem::read(path).unwrap();
            for _ in 0..3 {
                let t = cpu();
                let r = crate::reduce::reduce(&p);
                let tr = cpu() - t;
                let t = cpu();
                let m = super::Model::new(&r.problem);
                let tm = cpu() - t;
                eprintln!("{path}: cpu reduce {tr:?} compile {tm:?} ({} steps, {} mats)", m.nsteps(), m.mats.len());
            }
        }
    }
}
