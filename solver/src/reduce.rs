//! Reductions that keep the optimum: a smaller problem plus the means to map its solutions back.
//!
//! In order:
//! 1. self-loops are folded into node costs and parallel edges merged;
//! 2. strategies costing [`INFINITE`] or more are removed where the node has a finite one (kept
//!    only if removing them would make the memory limit unreachable);
//! 3. dominated strategies are removed: `s` is dominated by `s'` when `s'` costs no more, uses no
//!    more memory, and costs no more on every incident edge against every neighbour strategy;
//! 4. edges to single-strategy nodes are folded into the neighbour's costs;
//! 5. nodes whose memory does not depend on their strategy are eliminated when they have one
//!    neighbour (their best response is folded into the neighbour's costs) or two (a new edge
//!    between the two neighbours holds the best response to each pair), until nothing changes;
//! 6. nodes left with no edges and irrelevant memory take their cheapest strategy.
//!
//! When the usage limit cannot bind (every node at its largest usage still fits, or there is no
//! limit), memory plays no part: every node counts as memory-free in steps 3 and 5.
//!
//! Node indices are kept: an eliminated node stays as a single-strategy node with cost 0 and its
//! (fixed) usage, so intervals and time steps are untouched. For every solution `x` of the
//! reduced problem, `expand(x)` is a solution of the original with exactly the same cost and
//! (when memory can bind) the same usage profile, and the optimum is preserved.
//!
//! Cost of the reductions themselves: edge matrices are shared with the input (`Arc`) until a
//! reduction changes them, and read in place where their orientation allows (rows of the lower
//! node); the dominance test visits strategies by their sums of costs, so that each is compared
//! only with the undominated strategies before it (every dominator comes first), cheapest
//! checks first.

use std::borrow::Cow;
use std::sync::Arc;

use crate::problem::{Edge, Live, Node, Problem};

/// Node and edge costs at or above this are treated as forbidden.
pub const INFINITE: u64 = 100_000_000_000_000_000;

/// How an eliminated node picks its strategy back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Recover {
    /// Fixed strategy.
    Fixed { node: usize, s: usize },
    /// Best response to one neighbour: `table[s_nb]`.
    One { node: usize, nb: usize, table: Vec<u32> },
    /// Best response to two neighbours: `table[s_a * k_b + s_b]`.
    Two { node: usize, a: usize, b: usize, kb: usize, table: Vec<u32> },
}

/// A reduced problem and the map back to the original.
#[derive(Clone, Debug)]
pub struct Reduction {
    /// The reduced problem (same node count and intervals as the original).
    pub problem: Problem,
    /// For each node, the original index of each kept strategy.
    pub(crate) keep: Vec<Vec<usize>>,
    /// Eliminations in the order they were made.
    pub(crate) steps: Vec<Recover>,
    /// Statistics for messages.
    pub stats: ReductionStats,
}

/// What the reductions removed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReductionStats {
    /// Strategies removed as infinite or dominated.
    pub strategies_removed: usize,
    /// Nodes eliminated (degree 0, 1 or 2) or left with one strategy.
    pub nodes_eliminated: usize,
    /// Edges left.
    pub edges_left: usize,
}

impl Reduction {
    /// Maps a solution of the reduced problem to one of the original with the same cost.
    pub fn expand(&self, reduced: &[usize]) -> Vec<usize> {
        let mut x: Vec<usize> = reduced.to_vec();
        for step in self.steps.iter().rev() {
            match step {
                Recover::Fixed { node, s } => x[*node] = *s,
                Recover::One { node, nb, table } => x[*node] = table[x[*nb]] as usize,
                Recover::Two { node, a, b, kb, table } => x[*node] = table[x[*a] * kb + x[*b]] as usize,
            }
        }
        x.iter().enumerate().map(|(i, &s)| self.keep[i].get(s).copied().unwrap_or(0)).collect()
    }
}

/// An edge matrix: the input's own (shared) until a reduction changes it.
enum Mat {
    Shared(Arc<[u64]>),
    Owned(Vec<u64>),
}

impl Mat {
    fn get(&self) -> &[u64] {
        match self {
            Mat::Shared(m) => m,
            Mat::Owned(m) => m,
        }
    }

    fn to_mut(&mut self) -> &mut Vec<u64> {
        if let Mat::Shared(m) = self {
            *self = Mat::Owned(m.to_vec());
        }
        match self {
            Mat::Owned(m) => m,
            Mat::Shared(_) => unreachable!("made owned above"),
        }
    }

    fn into_arc(self) -> Arc<[u64]> {
        match self {
            Mat::Shared(m) => m,
            Mat::Owned(m) => m.into(),
        }
    }
}

/// An edge `(u, v)` with `u < v` and its matrix `[s_u][s_v]`.
struct WEdge {
    u: usize,
    v: usize,
    m: Mat,
}

struct Work<'a> {
    costs: Vec<Vec<u64>>,
    usages: Vec<Vec<u64>>,
    intervals: Vec<(u64, u64)>,
    /// Further live intervals of each node (see [`Node::extra`]), the input's until changed.
    extra: Vec<Cow<'a, [Live]>>,
    /// The usage limit cannot bind: every node is memory-free.
    no_memory: bool,
    /// Edges by id (`None` once removed).
    edges: Vec<Option<WEdge>>,
    /// Each node's neighbours in increasing order, with the id of the edge to each.
    nbrs: Vec<Vec<(usize, usize)>>,
}

/// `m` (`rows x cols`, row-major) transposed into `out`, by cache-sized blocks.
fn transpose_into(m: &[u64], rows: usize, cols: usize, out: &mut Vec<u64>) {
    const B: usize = 32;
    out.clear();
    out.resize(rows * cols, 0);
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

impl Work<'_> {
    fn k(&self, i: usize) -> usize {
        self.costs[i].len()
    }

    /// The id of the edge between `i` and `j`, if any.
    fn edge_id(&self, i: usize, j: usize) -> Option<usize> {
        let l = &self.nbrs[i];
        l.binary_search_by_key(&j, |&(x, _)| x).ok().map(|p| l[p].1)
    }

    fn edge(&self, id: usize) -> &WEdge {
        self.edges[id].as_ref().expect("a live edge id")
    }

    /// Edge cost between `i` at `si` and `j` at `sj` (the edge exists).
    fn cost(&self, i: usize, si: usize, j: usize, sj: usize) -> u64 {
        let e = self.edge(self.edge_id(i, j).expect("an edge"));
        if i < j { e.m.get()[si * self.k(j) + sj] } else { e.m.get()[sj * self.k(i) + si] }
    }

    /// The edge matrix between `a` and `b` oriented `[s_a][s_b]`: the stored one when `a < b`,
    /// else its transpose in `buf`.
    fn matrix<'b>(&'b self, a: usize, b: usize, buf: &'b mut Vec<u64>) -> &'b [u64] {
        let m = self.edge(self.edge_id(a, b).expect("an edge")).m.get();
        if a < b {
            m
        } else {
            transpose_into(m, self.k(b), self.k(a), buf);
            buf
        }
    }

    /// Adds `f(s_i, s_j)` to the edge between `i` and `j` (saturating), creating it if needed.
    fn add_edge(&mut self, i: usize, j: usize, f: impl Fn(usize, usize) -> u64) {
        let (u, v) = (i.min(j), i.max(j));
        let (ku, kv) = (self.k(u), self.k(v));
        let id = match self.edge_id(u, v) {
            Some(id) => id,
            None => {
                let id = self.edges.len();
                self.edges.push(Some(WEdge { u, v, m: Mat::Owned(vec![0; ku * kv]) }));
                for (a, b) in [(u, v), (v, u)] {
                    let l = &mut self.nbrs[a];
                    let at = l.partition_point(|&(x, _)| x < b);
                    l.insert(at, (b, id));
                }
                id
            }
        };
        let m = self.edges[id].as_mut().expect("a live edge").m.to_mut();
        for su in 0..ku {
            for sv in 0..kv {
                let c = if u == i { f(su, sv) } else { f(sv, su) };
                m[su * kv + sv] = m[su * kv + sv].saturating_add(c);
            }
        }
    }

    fn remove_edge(&mut self, i: usize, j: usize) {
        if let Some(id) = self.edge_id(i, j) {
            self.edges[id] = None;
        }
        for (a, b) in [(i, j), (j, i)] {
            let l = &mut self.nbrs[a];
            if let Ok(p) = l.binary_search_by_key(&b, |&(x, _)| x) {
                l.remove(p);
            }
        }
    }

    fn memory_free(&self, i: usize) -> bool {
        if self.no_memory {
            return true;
        }
        let (s, e) = self.intervals[i];
        (s >= e || self.usages[i].iter().all(|&u| u == self.usages[i][0]))
            && self.extra[i].iter().all(|l| l.interval.0 >= l.interval.1 || l.usages.iter().all(|&u| u == l.usages[0]))
    }

    /// Keeps only strategies `keep` (indices into the current list) of node `i`.
    fn restrict(&mut self, i: usize, keep: &[usize]) {
        let ki = self.k(i);
        self.costs[i] = keep.iter().map(|&s| self.costs[i][s]).collect();
        self.usages[i] = keep.iter().map(|&s| self.usages[i][s]).collect();
        for l in self.extra[i].to_mut() {
            l.usages = keep.iter().map(|&s| l.usages[s]).collect();
        }
        let nk = keep.len();
        for a in 0..self.nbrs[i].len() {
            let (j, id) = self.nbrs[i][a];
            let kj = self.k(j);
            let e = self.edges[id].as_mut().expect("a live edge");
            let old = e.m.get();
            let mut new: Vec<u64> = Vec::with_capacity(nk * kj);
            if i < j {
                for &s in keep {
                    new.extend_from_slice(&old[s * kj..(s + 1) * kj]);
                }
            } else {
                for t in 0..kj {
                    let row = &old[t * ki..(t + 1) * ki];
                    new.extend(keep.iter().map(|&s| row[s]));
                }
            }
            e.m = Mat::Owned(new);
        }
    }

    /// Whether the smallest possible peak fits `limit` with each node restricted to
    /// `keep[i]` (all its strategies when `None`).
    fn min_peak_ok(&self, limit: Option<u64>, keep: &[Option<Vec<usize>>]) -> bool {
        let Some(limit) = limit else { return true };
        let min = |us: &[u64], i: usize| match &keep[i] {
            Some(f) => f.iter().map(|&s| us[s]).min().unwrap_or(0),
            None => us.iter().copied().min().unwrap_or(0),
        };
        let p = Problem {
            name: String::new(),
            nodes: (0..self.costs.len())
                .map(|i| Node {
                    interval: self.intervals[i],
                    costs: vec![0],
                    usages: vec![min(&self.usages[i], i)],
                    extra: self.extra[i]
                        .iter()
                        .map(|l| Live { interval: l.interval, usages: vec![min(&l.usages, i)] })
                        .collect(),
                })
                .collect(),
            edges: vec![],
            usage_limit: Some(limit),
        };
        p.min_peak_usage().0 <= limit as u128
    }

    /// The strategies of node `i` dominated by another (see the module docs): `s` is dominated
    /// by `t` when `t` costs no more, uses no more memory in any of its live intervals (when
    /// memory matters) and costs no more on every incident edge against every neighbour
    /// strategy; between equal strategies the lower index survives. This relation is a strict
    /// partial order, so the dominated strategies are exactly its non-maximal elements.
    fn dominated(&self, i: usize, bufs: &mut Vec<Vec<u64>>) -> Vec<bool> {
        let ki = self.k(i);
        let mem = !self.memory_free(i);
        let nb = &self.nbrs[i];
        if bufs.len() < nb.len() {
            bufs.resize_with(nb.len(), Vec::new);
        }
        // Each neighbour's costs as rows over our strategies: in place for a higher neighbour,
        // transposed for a lower one.
        let mut rows: Vec<(usize, &[u64])> = Vec::with_capacity(nb.len());
        for (&(j, id), buf) in nb.iter().zip(bufs.iter_mut()) {
            let kj = self.k(j);
            let m = self.edge(id).m.get();
            if i < j {
                rows.push((kj, m));
            } else {
                transpose_into(m, kj, ki, buf);
                rows.push((kj, buf));
            }
        }
        // Usages per strategy over the node's live intervals (identical lists once), contiguous.
        let mut lives: Vec<&[u64]> = Vec::new();
        if mem {
            for us in
                std::iter::once(self.usages[i].as_slice()).chain(self.extra[i].iter().map(|l| l.usages.as_slice()))
            {
                if !lives.contains(&us) {
                    lives.push(us);
                }
            }
        }
        let nl = lives.len();
        let usage: Vec<u64> = (0..ki).flat_map(|s| lives.iter().map(move |us| us[s])).collect();
        let costs = &self.costs[i];
        // Sum of each strategy's own and edge costs (and of its usages): `t` dominating `s`
        // has a sum no larger, and equal sums only if every cost is equal, when the usages
        // (then the index) decide. Visiting strategies in this order puts every dominator of
        // a strategy before it.
        let mut sums: Vec<u128> = costs.iter().map(|&c| c as u128).collect();
        for &(kj, m) in &rows {
            for (s, sum) in sums.iter_mut().enumerate() {
                *sum += m[s * kj..(s + 1) * kj].iter().map(|&c| c as u128).sum::<u128>();
            }
        }
        let total = |s: usize| -> u128 { usage[s * nl..(s + 1) * nl].iter().map(|&u| u as u128).sum() };
        let mut order: Vec<(u128, u128, usize)> = (0..ki).map(|s| (sums[s], total(s), s)).collect();
        order.sort_unstable();
        let mut dominated = vec![false; ki];
        // The undominated strategies so far, the maximal elements among those visited.
        let mut maximal: Vec<usize> = Vec::new();
        // Where a candidate last failed to dominate: tried first (failures cluster).
        let mut witness = (0usize, 0usize);
        for &(_, _, s) in &order {
            let us = &usage[s * nl..(s + 1) * nl];
            let beaten = maximal.iter().any(|&t| {
                if costs[t] > costs[s] || usage[t * nl..(t + 1) * nl].iter().zip(us).any(|(a, b)| a > b) {
                    return false;
                }
                let (r, c) = witness;
                if let Some(&(kj, m)) = rows.get(r)
                    && c < kj
                    && m[t * kj + c] > m[s * kj + c]
                {
                    return false;
                }
                for (r, &(kj, m)) in rows.iter().enumerate() {
                    let (a, b) = (&m[t * kj..(t + 1) * kj], &m[s * kj..(s + 1) * kj]);
                    if let Some(c) = a.iter().zip(b).position(|(x, y)| x > y) {
                        witness = (r, c);
                        return false;
                    }
                }
                true
            });
            if beaten {
                dominated[s] = true;
            } else {
                maximal.push(s);
            }
        }
        dominated
    }
}

/// Reduces a (valid) problem.
pub fn reduce(p: &Problem) -> Reduction {
    let n = p.nodes.len();
    let mut w = Work {
        costs: p.nodes.iter().map(|x| x.costs.clone()).collect(),
        usages: p.nodes.iter().map(|x| x.usages.clone()).collect(),
        intervals: p.nodes.iter().map(|x| x.interval).collect(),
        extra: p.nodes.iter().map(|x| Cow::Borrowed(x.extra.as_slice())).collect(),
        no_memory: !p.memory_may_bind(),
        edges: Vec::new(),
        nbrs: vec![Vec::new(); n],
    };
    // 1. Self-loops and parallel edges: one matrix per pair, the input's own when it is the
    // pair's only edge and oriented [s_u][s_v] with u < v.
    let mut firsts: Vec<(usize, usize, usize)> = Vec::with_capacity(p.edges.len());
    for (x, e) in p.edges.iter().enumerate() {
        let (a, b) = e.nodes;
        if a == b {
            let kb = p.nodes[b].strategies();
            for s in 0..kb {
                w.costs[a][s] = w.costs[a][s].saturating_add(e.costs[s * kb + s]);
            }
        } else {
            firsts.push((a.min(b), a.max(b), x));
        }
    }
    firsts.sort_unstable();
    let mut at = 0;
    while at < firsts.len() {
        let (u, v, _) = firsts[at];
        let end = at + firsts[at..].iter().take_while(|f| (f.0, f.1) == (u, v)).count();
        let (ku, kv) = (p.nodes[u].strategies(), p.nodes[v].strategies());
        let m = match &firsts[at..end] {
            [(_, _, x)] if p.edges[*x].nodes == (u, v) => Mat::Shared(p.edges[*x].costs.clone()),
            group => {
                let mut m = vec![0u64; ku * kv];
                for &(_, _, x) in group {
                    let e = &p.edges[x];
                    if e.nodes == (u, v) {
                        for (c, &a) in m.iter_mut().zip(e.costs.iter()) {
                            *c = c.saturating_add(a);
                        }
                    } else {
                        for sv in 0..kv {
                            for su in 0..ku {
                                let c = &mut m[su * kv + sv];
                                *c = c.saturating_add(e.costs[sv * ku + su]);
                            }
                        }
                    }
                }
                Mat::Owned(m)
            }
        };
        let id = w.edges.len();
        w.edges.push(Some(WEdge { u, v, m }));
        w.nbrs[u].push((v, id));
        w.nbrs[v].push((u, id));
        at = end;
    }
    for l in &mut w.nbrs {
        l.sort_unstable();
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
    if finite_keep.iter().any(Option::is_some) && w.min_peak_ok(p.usage_limit, &finite_keep) {
        for (i, f) in finite_keep.into_iter().enumerate() {
            if let Some(f) = f {
                stats.strategies_removed += w.k(i) - f.len();
                keep[i] = f.iter().map(|&s| keep[i][s]).collect();
                w.restrict(i, &f);
            }
        }
    }

    // 3. Dominated strategies.
    let mut bufs: Vec<Vec<u64>> = Vec::new();
    for i in 0..n {
        if w.k(i) < 2 {
            continue;
        }
        let dominated = w.dominated(i, &mut bufs);
        if dominated.iter().any(|&d| d) {
            let kept: Vec<usize> = (0..w.k(i)).filter(|&s| !dominated[s]).collect();
            stats.strategies_removed += w.k(i) - kept.len();
            keep[i] = kept.iter().map(|&s| keep[i][s]).collect();
            w.restrict(i, &kept);
        }
    }

    // 4-6. Folding and elimination, driven by a work list.
    let mut steps = Vec::new();
    let mut eliminated = vec![false; n];
    let mut queue: Vec<usize> = (0..n).collect();
    let (mut buf_a, mut buf_b) = (Vec::new(), Vec::new());
    while let Some(i) = queue.pop() {
        if eliminated[i] {
            continue;
        }
        let deg = w.nbrs[i].len();
        if w.k(i) == 1 && deg > 0 {
            // Fold edges into neighbours.
            for (j, _) in w.nbrs[i].clone() {
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
                let j = w.nbrs[i][0].0;
                let kj = w.k(j);
                let cj = w.matrix(j, i, &mut buf_a);
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
                let (a, b) = (w.nbrs[i][0].0, w.nbrs[i][1].0);
                let (ka, kb) = (w.k(a), w.k(b));
                if ka * kb > 4096 && ka * kb > ki * (ka + kb) {
                    continue;
                }
                // mat[sa][sb] = min over s of (cost[s] + ca[s][sa] + cb[s][sb]), with the first
                // s reaching it.
                let ca = w.matrix(a, i, &mut buf_a);
                let (table, mat) = if b < i {
                    // cb = [s_b][s_i]: for each (sa, sb) one contiguous pass over s.
                    eliminate_rows(&w.costs[i], ca, w.matrix(b, i, &mut buf_b), ka, kb)
                } else {
                    // The stored [s_i][s_b]: for each sa, one pass over s updating every sb.
                    let id = w.edge_id(i, b).expect("an edge");
                    eliminate_columns(&w.costs[i], ca, w.edge(id).m.get(), ka, kb)
                };
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

    let mut edges: Vec<WEdge> = w.edges.into_iter().flatten().collect();
    edges.sort_unstable_by_key(|e| (e.u, e.v));
    stats.edges_left = edges.len();
    let nodes = (0..n)
        .map(|i| Node {
            interval: w.intervals[i],
            costs: std::mem::take(&mut w.costs[i]),
            usages: std::mem::take(&mut w.usages[i]),
            extra: std::mem::take(&mut w.extra[i]).into_owned(),
        })
        .collect();
    let edges = edges.into_iter().map(|e| Edge { nodes: (e.u, e.v), costs: e.m.into_arc() }).collect();
    Reduction {
        problem: Problem { name: p.name.clone(), nodes, edges, usage_limit: p.usage_limit },
        keep,
        steps,
        stats,
    }
}

/// Eliminating a node with two neighbours `a` and `b` from `ca = [s_a][s_i]` and
/// `cb = [s_b][s_i]`: the best response `table[sa * kb + sb]` (the first cheapest strategy)
/// and its cost `mat[sa * kb + sb]`.
fn eliminate_rows(cost: &[u64], ca: &[u64], cb: &[u64], ka: usize, kb: usize) -> (Vec<u32>, Vec<u64>) {
    let ki = cost.len();
    let mut table = Vec::with_capacity(ka * kb);
    let mut mat = Vec::with_capacity(ka * kb);
    let mut row = vec![0u64; ki];
    for sa in 0..ka {
        for (s, r) in row.iter_mut().enumerate() {
            *r = cost[s].saturating_add(ca[sa * ki + s]);
        }
        for sb in 0..kb {
            let col = &cb[sb * ki..(sb + 1) * ki];
            let c = row.iter().zip(col).map(|(&x, &y)| x.saturating_add(y)).min().unwrap_or(0);
            let s = row.iter().zip(col).position(|(&x, &y)| x.saturating_add(y) == c).unwrap_or(0);
            table.push(s as u32);
            mat.push(c);
        }
    }
    (table, mat)
}

/// [`eliminate_rows`] from `ca = [s_a][s_i]` and `bi = [s_i][s_b]` (`b`'s matrix as stored
/// when `i < b`): the same table and costs, with `s` in the outer loop.
fn eliminate_columns(cost: &[u64], ca: &[u64], bi: &[u64], ka: usize, kb: usize) -> (Vec<u32>, Vec<u64>) {
    let ki = cost.len();
    let mut table = vec![0u32; ka * kb];
    let mut mat = vec![u64::MAX; ka * kb];
    for sa in 0..ka {
        let (t, m) = (&mut table[sa * kb..(sa + 1) * kb], &mut mat[sa * kb..(sa + 1) * kb]);
        for s in 0..ki {
            let r = cost[s].saturating_add(ca[sa * ki + s]);
            for ((best, arg), &y) in m.iter_mut().zip(t.iter_mut()).zip(&bi[s * kb..(s + 1) * kb]) {
                let c = r.saturating_add(y);
                // Strictly less: the first s reaching the minimum, as in `eliminate_rows`.
                if c < *best || s == 0 {
                    *best = c;
                    *arg = s as u32;
                }
            }
        }
    }
    (table, mat)
}

/// Turns node `i` into a single-strategy node with cost 0 and the usage of strategy `s`
/// (which is its usage whatever the strategy, or irrelevant).
fn make_ghost(w: &mut Work, i: usize, s: usize) {
    let u = w.usages[i].get(s).copied().unwrap_or(0);
    w.costs[i] = vec![0];
    w.usages[i] = vec![u];
    for l in w.extra[i].to_mut() {
        l.usages = vec![l.usages.get(s).copied().unwrap_or(0)];
    }
}

/// The trivial reduction (the problem itself, with self-loops and parallel edges left as they
/// are): for comparing with and without reductions.
pub fn identity(p: &Problem) -> Reduction {
    Reduction {
        problem: p.clone(),
        keep: p.nodes.iter().map(|x| (0..x.strategies()).collect()).collect(),
        steps: Vec::new(),
        stats: ReductionStats { strategies_removed: 0, nodes_eliminated: 0, edges_left: p.edges.len() },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Model;
    use rand::{Rng, SeedableRng};

    fn check(p: &Problem) {
        let r = reduce(p);
        let m = Model::new(p);
        let mr = Model::new(&r.problem);
        let mut rng = rand::rngs::SmallRng::seed_from_u64(1);
        for _ in 0..20 {
            let x: Vec<usize> = r.problem.nodes.iter().map(|n| rng.random_range(0..n.strategies())).collect();
            let full = r.expand(&x);
            let a = r.problem.evaluate(&x).unwrap();
            let b = p.evaluate(&full).unwrap();
            assert_eq!(a.cost, b.cost, "expand keeps the cost");
            if p.memory_may_bind() {
                assert_eq!(a.peak_usage, b.peak_usage, "expand keeps the usage");
            } else {
                assert!(b.feasible());
            }
            let close = |x: f64, y: u128| (x - y as f64).abs() <= 1e-9 * (y as f64).max(1.0);
            assert!(close(mr.total_cost(&x), a.cost));
            assert!(close(m.total_cost(&full), b.cost));
        }
    }

    #[test]
    fn expand_keeps_cost_on_example() {
        let p = Problem::read(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/example.json")).unwrap();
        check(&p);
    }

    #[test]
    fn expand_keeps_cost_on_b() {
        let p = Problem::read(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/asplos-2025-iopddl-B.json.gz")).unwrap();
        check(&p);
    }
    /// A random problem for comparing with the oracle: few distinct costs (so that strategies
    /// tie and dominate), infinite strategies and forbidden entries, further live intervals,
    /// parallel edges in both orientations, self-loops, and chains (so that nodes of degree one
    /// and two are eliminated); the limit absent, loose or tight.
    fn random(rng: &mut rand::rngs::SmallRng) -> Problem {
        let n = rng.random_range(1..14);
        let span = rng.random_range(1..4u64);
        let nodes: Vec<Node> = (0..n)
            .map(|_| {
                let k = rng.random_range(1..=5);
                let mut costs: Vec<u64> = (0..k).map(|_| rng.random_range(0..6 * span)).collect();
                if rng.random_bool(0.15) {
                    costs[rng.random_range(0..k)] = INFINITE + rng.random_range(0..3);
                }
                let usages: Vec<u64> = (0..k).map(|_| rng.random_range(0..4)).collect();
                let start = rng.random_range(0..6);
                let mut node = Node::new((start, start + rng.random_range(0..5)), costs, usages);
                for _ in 0..rng.random_range(0..3) {
                    let s = rng.random_range(0..8);
                    node.extra.push(Live {
                        interval: (s, s + rng.random_range(0..4)),
                        usages: (0..k).map(|_| rng.random_range(0..3)).collect(),
                    });
                }
                node
            })
            .collect();
        let mut edges = Vec::new();
        let chain = rng.random_bool(0.5);
        for e in 0..rng.random_range(0..3 * n + 1) {
            let (a, b) = if chain && e + 1 < n { (e, e + 1) } else { (rng.random_range(0..n), rng.random_range(0..n)) };
            let (a, b) = if rng.random_bool(0.3) { (b, a) } else { (a, b) };
            let (ka, kb) = (nodes[a].strategies(), nodes[b].strategies());
            let mut costs: Vec<u64> = (0..ka * kb)
                .map(|_| if rng.random_bool(0.05) { 1_000_000_000_000_000_000 } else { rng.random_range(0..5 * span) })
                .collect();
            // Equal rows make equal strategies.
            if ka > 1 && rng.random_bool(0.3) {
                let (x, y) = (rng.random_range(0..ka), rng.random_range(0..ka));
                for sb in 0..kb {
                    costs[y * kb + sb] = costs[x * kb + sb];
                }
            }
            edges.push(Edge { nodes: (a, b), costs: costs.into() });
        }
        let usage_limit = match rng.random_range(0..3) {
            0 => None,
            1 => Some(1000),
            _ => Some(rng.random_range(2..12)),
        };
        Problem { name: "random".into(), nodes, edges, usage_limit }
    }

    fn same_as_reference(p: &Problem) {
        let (r, o) = (reduce(p), crate::reduce_reference::reduce(p));
        assert_eq!(r.problem, o.problem);
        assert_eq!(r.keep, o.keep);
        assert_eq!(r.steps, o.steps);
        assert_eq!(r.stats, o.stats);
    }

    /// The reductions give exactly what the first implementation gave: the same reduced
    /// problem, strategy maps and eliminations.
    #[test]
    fn same_as_the_reference_on_random_problems() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(46);
        // Cases with strategies removed, eliminations of degree 1 and 2, and removals where
        // memory may bind.
        let mut seen = [0usize; 4];
        for case in 0..3000 {
            let p = random(&mut rng);
            if p.validate().is_err() {
                continue;
            }
            let (r, o) = (reduce(&p), crate::reduce_reference::reduce(&p));
            seen[0] += (r.stats.strategies_removed > 0) as usize;
            seen[1] += r.steps.iter().any(|s| matches!(s, Recover::One { .. })) as usize;
            seen[2] += r.steps.iter().any(|s| matches!(s, Recover::Two { .. })) as usize;
            seen[3] += (p.memory_may_bind() && r.stats.strategies_removed > 0) as usize;
            assert_eq!(r.problem, o.problem, "case {case}: {}", p.to_json());
            assert_eq!((&r.keep, &r.steps, &r.stats), (&o.keep, &o.steps, &o.stats), "case {case}");
            // (`check` compares with the search's model, which counts every entry of 10^17 or
            // more as 10^18.)
            let huge = p.nodes.iter().any(|x| x.costs.iter().any(|&c| c >= INFINITE))
                || p.edges.iter().any(|e| e.costs.iter().any(|&c| c >= INFINITE));
            if case % 10 == 0 && !huge {
                check(&p);
            }
        }
        assert!(seen.iter().all(|&c| c > 300), "{seen:?}");
    }

    #[test]
    fn same_as_the_reference_on_iopddl_b_and_the_example() {
        for f in ["example.json", "asplos-2025-iopddl-B.json.gz"] {
            same_as_reference(&Problem::read(format!("{}/tests/data/{f}", env!("CARGO_MANIFEST_DIR"))).unwrap());
        }
    }

    /// On the problems named in `REDUCE_REFERENCE` (comma-separated paths; e.g. IOPDDL's K, P
    /// and V, or problems written by a planning run), too large for a unit test's data.
    #[test]
    #[ignore]
    fn same_as_the_reference_on_files() {
        for path in std::env::var("REDUCE_REFERENCE").unwrap_or_default().split(',').filter(|s| !s.is_empty()) {
            let p = Problem::read(path).unwrap();
            let t = std::time::Instant::now();
            let r = reduce(&p);
            let fast = t.elapsed();
            let t = std::time::Instant::now();
            let o = crate::reduce_reference::reduce(&p);
            let slow = t.elapsed();
            assert_eq!(r.problem, o.problem, "{path}");
            assert_eq!((&r.keep, &r.steps, &r.stats), (&o.keep, &o.steps, &o.stats), "{path}");
            eprintln!("{path}: the same reduction ({:?}) in {fast:?}, the reference in {slow:?}", r.stats);
        }
    }
}
