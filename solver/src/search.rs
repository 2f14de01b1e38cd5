//! Large-scale heuristic search: Lagrangian construction, greedy memory repair, then local search
//! with node moves and exact dynamic programming over random induced trees, under a deadline,
//! keeping the best feasible solution found (anytime).
//!
//! The search only ever reports solutions whose memory feasibility was checked at every maximal
//! time step (see [`crate::model`]); costs are tracked in floating point and recomputed exactly by
//! the caller.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::ilp::MipBackend;
use crate::model::{CostSum, Model};
use crate::segtree::SegTree;

/// The state of one search thread.
pub(crate) struct State<'m> {
    m: &'m Model,
    pub x: Vec<usize>,
    seg: SegTree,
    /// `sum.value()`, kept up to date by [`State::set`].
    pub cost: f64,
    sum: CostSum,
    buf: Vec<f64>,
}

impl<'m> State<'m> {
    pub fn new(m: &'m Model, x: Vec<usize>) -> State<'m> {
        let seg = SegTree::new(&m.usage_profile(&x));
        let sum = m.cost_sum(&x);
        State { m, x, seg, cost: sum.value(), sum, buf: Vec::new() }
    }

    /// Recomputes the cost from scratch.
    pub fn resync(&mut self) {
        self.sum = self.m.cost_sum(&self.x);
        self.cost = self.sum.value();
    }

    /// Largest usage over the compressed steps `[l, r)`.
    pub fn usage_max(&self, l: usize, r: usize) -> i64 {
        self.seg.max(l, r)
    }

    pub fn feasible(&self) -> bool {
        self.m.nsteps() == 0 || self.seg.global_max() <= self.m.limit
    }

    /// Local cost of every strategy of `i` given its neighbours: node cost plus edge costs.
    fn local_into(m: &Model, x: &[usize], i: usize, out: &mut Vec<f64>) {
        out.clear();
        out.extend_from_slice(m.costs(i));
        for a in m.adj(i) {
            let row = m.row(i, a, x[a.other]);
            for (o, r) in out.iter_mut().zip(row) {
                *o += r;
            }
        }
    }

    /// Sets node `i` to strategy `s`, keeping cost and usage up to date.
    pub fn set(&mut self, i: usize, s: usize) {
        let old = self.x[i];
        if old == s {
            return;
        }
        let m = self.m;
        let sum = &mut self.sum;
        sum.add(m.cost[m.off[i] + s]);
        sum.sub(m.cost[m.off[i] + old]);
        for a in m.adj(i) {
            let row = m.row(i, a, self.x[a.other]);
            sum.add(row[s]);
            sum.sub(row[old]);
        }
        self.cost = sum.value();
        for p in m.pieces(i) {
            let du = m.pusage[p.u + s] - m.pusage[p.u + old];
            if du != 0 {
                self.seg.add(p.l, p.r, du);
            }
        }
        self.x[i] = s;
    }

    /// Whether node `i` can take strategy `s` without any step going over the limit.
    fn fits(&self, i: usize, s: usize) -> bool {
        let m = self.m;
        let cur = self.x[i];
        m.pieces(i).iter().all(|p| {
            let du = m.pusage[p.u + s] - m.pusage[p.u + cur];
            du <= 0 || self.seg.max(p.l, p.r) + du <= m.limit
        })
    }

    /// Whether node `i` can take strategy `s` without going over the limit at any of its steps
    /// outside the piece that holds step `t`.
    fn fits_elsewhere(&self, i: usize, s: usize, t: usize) -> bool {
        let m = self.m;
        let cur = self.x[i];
        m.pieces(i).iter().filter(|p| !(p.l <= t && t < p.r)).all(|p| {
            let du = m.pusage[p.u + s] - m.pusage[p.u + cur];
            du <= 0 || self.seg.max(p.l, p.r) + du <= m.limit
        })
    }

    /// One sweep of best-improvement node moves on `cost + pen * usage` (`pen` per strategy, see
    /// [`penalties`]), with the memory limit enforced when `feasible_only`. Returns the number of
    /// moves.
    pub fn sweep(&mut self, order: &[usize], pen: Option<&[f64]>, feasible_only: bool) -> usize {
        let m = self.m;
        let mut moves = 0;
        let mut buf = std::mem::take(&mut self.buf);
        for &i in order {
            if m.k[i] < 2 {
                continue;
            }
            Self::local_into(m, &self.x, i, &mut buf);
            let cur = self.x[i];
            if let Some(p) = pen {
                for (b, &q) in buf.iter_mut().zip(&p[m.off[i]..m.off[i + 1]]) {
                    *b += q;
                }
            }
            // With one piece, the room left at its busiest step decides every strategy at once.
            let ps = m.pieces(i);
            let one = (ps.len() == 1).then(|| {
                let p = ps[0];
                (p, m.limit - self.seg.max(p.l, p.r) + m.pusage[p.u + cur])
            });
            let mut best = cur;
            let mut best_v = buf[cur];
            for (s, &v) in buf.iter().enumerate() {
                if v < best_v - 1e-9 * best_v.abs().max(1.0) {
                    let ok = !feasible_only
                        || match one {
                            Some((p, head)) => m.pusage[p.u + s] <= head,
                            None => self.fits(i, s),
                        };
                    if ok {
                        best = s;
                        best_v = v;
                    }
                }
            }
            if best != cur {
                self.set(i, best);
                moves += 1;
            }
        }
        self.buf = buf;
        moves
    }

    /// Memory-coupled pair move: try every usage-increasing strategy of `i` that the limit
    /// blocks, together with a usage-decreasing strategy of some node live at the blocking step.
    /// Keeps the first combination that lowers the cost. For small problems, where single-node
    /// and tree moves cannot trade memory between unconnected nodes.
    pub fn pair_move(&mut self, i: usize) -> bool {
        let m = self.m;
        if m.pieces(i).is_empty() || m.k[i] < 2 {
            return false;
        }
        let before = self.cost;
        let tol = 1e-9 * before.abs().max(1.0);
        let cur = self.x[i];
        for s in 0..m.k[i] {
            // Strategies that use more memory somewhere (the others are plain node moves).
            if s == cur || m.pieces(i).iter().all(|p| m.pusage[p.u + s] <= m.pusage[p.u + cur]) {
                continue;
            }
            self.set(i, s);
            if self.feasible() {
                if self.cost < before - tol {
                    return true;
                }
                self.set(i, cur);
                continue;
            }
            let t = self.seg.argmax();
            for j in 0..m.n {
                if j == i || m.k[j] < 2 {
                    continue;
                }
                let Some(uj) = m.usage_at(j, t) else { continue };
                let old = self.x[j];
                for s2 in 0..m.k[j] {
                    if uj[s2] >= uj[old] {
                        continue;
                    }
                    self.set(j, s2);
                    if self.feasible() && self.cost < before - tol {
                        return true;
                    }
                    self.set(j, old);
                }
            }
            self.set(i, cur);
        }
        false
    }

    /// Greedy memory repair: while some step is over the limit, take the step with the largest
    /// excess and apply the usage-reducing move with the best cost per unit of usage removed.
    /// Returns false when no move can reduce the excess (cannot happen on a feasible problem).
    pub fn repair(&mut self, pen: Option<&[f64]>, deadline: Instant) -> bool {
        let m = self.m;
        let mut buf = Vec::new();
        let mut iter = 0usize;
        while !self.feasible() {
            iter += 1;
            if iter.is_multiple_of(64) && Instant::now() > deadline {
                return false;
            }
            let t = self.seg.argmax();
            let excess = self.seg.global_max() - m.limit;
            let mut best: Option<(f64, usize, usize)> = None;
            for i in 0..m.n {
                if m.k[i] < 2 {
                    continue;
                }
                let Some(us) = m.usage_at(i, t) else { continue };
                let cur = self.x[i];
                if us.iter().all(|&u| u >= us[cur]) {
                    continue;
                }
                Self::local_into(m, &self.x, i, &mut buf);
                let o = m.off[i];
                for s in 0..m.k[i] {
                    // Less memory here, and not over the limit at the node's other steps (a
                    // node with several pieces could otherwise move the excess back and forth).
                    if us[s] >= us[cur] || !self.fits_elsewhere(i, s, t) {
                        continue;
                    }
                    let gain = (us[cur] - us[s]).min(excess) as f64;
                    let dc = (buf[s] - buf[cur]) + pen.map_or(0.0, |p| p[o + s] - p[o + cur]);
                    if dc >= 1e17 {
                        continue; // would break a hard edge
                    }
                    let ratio = dc / gain;
                    if best.is_none_or(|b| ratio < b.0) {
                        best = Some((ratio, i, s));
                    }
                }
            }
            match best {
                Some((_, i, s)) => self.set(i, s),
                None => return false,
            }
        }
        true
    }

    /// Dynamic programming over `tree` on `cost + scale * pen` (`pen` per strategy), where edges to nodes
    /// outside the tree, and non-tree edges inside it, are conditioned on the current strategies
    /// (exact when the tree is induced). Applies the result when `accept` allows it.
    /// Returns true if the accepted objective strictly decreased.
    pub fn tree_move(&mut self, tree: &Tree, pen: &[f64], scale: f64, accept: Accept, ws: &mut TreeWork) -> bool {
        let m = self.m;
        let nt = tree.nodes.len();
        if nt == 0 {
            return false;
        }
        ws.off.clear();
        let mut acc = 0;
        for &v in &tree.nodes {
            ws.off.push(acc);
            acc += m.k[v];
        }
        ws.total.clear();
        ws.total.resize(acc, 0.0);
        ws.parent_adj.clear();
        ws.parent_adj.resize(nt, usize::MAX);
        for (j, &v) in tree.nodes.iter().enumerate() {
            let o = ws.off[j];
            let kv = m.k[v];
            let tot = &mut ws.total[o..o + kv];
            tot.copy_from_slice(m.costs(v));
            let pv = tree.parent[j];
            for (ai, a) in m.adj(v).iter().enumerate() {
                let w = a.other;
                if tree.contains(w) {
                    let pw = tree.parent[tree.pos[w]];
                    if pv != usize::MAX && tree.nodes[pv] == w {
                        ws.parent_adj[j] = m.adj_start[v] + ai;
                        continue;
                    }
                    if pw == j {
                        continue; // child edge: handled by the child's message
                    }
                }
                let row = m.row(v, a, self.x[w]);
                for (t, r) in tot.iter_mut().zip(row) {
                    *t += r;
                }
            }
            if scale != 0.0 {
                for (t, &q) in tot.iter_mut().zip(&pen[m.off[v]..m.off[v + 1]]) {
                    *t += scale * q;
                }
            }
        }
        ws.arg.clear();
        ws.arg_off.clear();
        ws.arg_off.resize(nt, 0);
        for j in (1..nt).rev() {
            let v = tree.nodes[j];
            let pj = tree.parent[j];
            if pj == usize::MAX {
                continue; // another root of the forest
            }
            let kv = m.k[v];
            let kp = m.k[tree.nodes[pj]];
            let a = m.adj[ws.parent_adj[j]];
            let start = ws.arg.len();
            ws.arg_off[j] = start;
            let ov = ws.off[j];
            let op = ws.off[pj];
            for sp in 0..kp {
                let row = &m.mats[a.mat + sp * kv..a.mat + (sp + 1) * kv];
                let mut best = f64::INFINITY;
                let mut arg = 0u32;
                for (sv, (&t, &r)) in ws.total[ov..ov + kv].iter().zip(row).enumerate() {
                    let val = t + r;
                    if val < best {
                        best = val;
                        arg = sv as u32;
                    }
                }
                ws.arg.push(arg);
                ws.total[op + sp] += best;
            }
        }
        ws.choice.clear();
        ws.choice.resize(nt, 0);
        // Roots: the first node, and any node whose parent is MAX (forest).
        for j in 0..nt {
            if tree.parent[j] == usize::MAX {
                let o = ws.off[j];
                let mut best = f64::INFINITY;
                for s in 0..m.k[tree.nodes[j]] {
                    if ws.total[o + s] < best {
                        best = ws.total[o + s];
                        ws.choice[j] = s;
                    }
                }
            } else {
                let sp = ws.choice[tree.parent[j]];
                ws.choice[j] = ws.arg[ws.arg_off[j] + sp] as usize;
            }
        }
        let before = self.cost;
        ws.old.clear();
        let mut changed = false;
        let mut dpen = 0.0;
        for (j, &v) in tree.nodes.iter().enumerate() {
            ws.old.push(self.x[v]);
            if self.x[v] != ws.choice[j] {
                changed = true;
                dpen += scale * (pen[m.off[v] + ws.choice[j]] - pen[m.off[v] + self.x[v]]);
                self.set(v, ws.choice[j]);
            }
        }
        if !changed {
            return false;
        }
        let tol = 1e-9 * before.abs().max(1.0);
        let delta = self.cost - before;
        let ok = match accept {
            Accept::Feasible => delta <= tol && self.feasible(),
            Accept::Penalized => delta + dpen <= tol,
        };
        if ok {
            return match accept {
                Accept::Penalized => delta + dpen < -tol,
                _ => delta < -tol,
            };
        }
        for (j, &v) in tree.nodes.iter().enumerate() {
            self.set(v, ws.old[j]);
        }
        false
    }
}

/// A group of nodes tied by bijective hard edges (each strategy of one allows exactly one of the
/// other): choosing the root's strategy fixes every member's.
pub(crate) struct Group {
    /// `(node, position of its parent in the group, perm)` with `perm[s_parent] = s_node`; the
    /// root comes first with an empty perm.
    members: Vec<(usize, usize, Vec<u32>)>,
    /// Nodes outside the group adjacent to it (with at least two strategies).
    nbrs: Vec<usize>,
}

/// The groups with at least two members.
pub(crate) fn tie_groups(m: &Model) -> Vec<Group> {
    // perm of the edge seen from `i` (oriented [s_other][s_i]): Some(perm[s_other] = s_i).
    let bijection = |i: usize, a: &crate::model::Adj| -> Option<Vec<u32>> {
        let (ki, ko) = (m.k[i], m.k[a.other]);
        if !a.hard || ki != ko {
            return None;
        }
        let mut perm = vec![u32::MAX; ko];
        let mut seen = vec![false; ki];
        for (so, p) in perm.iter_mut().enumerate() {
            let row = &m.mats[a.mat + so * ki..a.mat + (so + 1) * ki];
            let mut fin = row.iter().enumerate().filter(|(_, c)| **c < 1e17);
            let (si, _) = fin.next()?;
            if fin.next().is_some() || seen[si] {
                return None;
            }
            seen[si] = true;
            *p = si as u32;
        }
        Some(perm)
    };
    let mut done = vec![false; m.n];
    let mut groups = Vec::new();
    for r in 0..m.n {
        if done[r] || m.k[r] < 2 {
            continue;
        }
        done[r] = true;
        let mut members = vec![(r, usize::MAX, Vec::new())];
        let mut head = 0;
        while head < members.len() {
            let v = members[head].0;
            for a in m.adj(v) {
                let w = a.other;
                if done[w] || m.k[w] < 2 {
                    continue;
                }
                // Seen from w, the neighbour is v: the adjacency entry of w for v.
                let Some(aw) = m.adj(w).iter().find(|b| b.other == v) else {
                    continue;
                };
                if let Some(perm) = bijection(w, aw) {
                    done[w] = true;
                    members.push((w, head, perm));
                }
            }
            head += 1;
        }
        if members.len() >= 2 {
            let mut nbrs: Vec<usize> = members
                .iter()
                .flat_map(|t| m.adj(t.0).iter().map(|a| a.other))
                .filter(|&w| m.k[w] >= 2 && !members.iter().any(|t| t.0 == w))
                .collect();
            nbrs.sort_unstable();
            nbrs.dedup();
            groups.push(Group { members, nbrs });
        }
    }
    groups
}

impl State<'_> {
    /// Path relinking towards `guide`: the nodes where the two differ split into connected
    /// blocks, first over the graph's edges, then finer over its hard edges only (nodes tied by
    /// forbidden pairs move together); each block that lowers the cost when it takes the
    /// guide's strategies, and keeps memory feasible, is adopted. Repeats until no block helps.
    /// Returns true if the cost decreased.
    pub fn relink(&mut self, guide: &[usize]) -> bool {
        let start_cost = self.cost;
        for _ in 0..4 {
            let mut moved = false;
            for hard_only in [false, true] {
                moved |= self.relink_blocks(guide, hard_only);
            }
            if !moved {
                break;
            }
        }
        self.cost < start_cost - 1e-9 * start_cost.abs().max(1.0)
    }

    fn relink_blocks(&mut self, guide: &[usize], hard_only: bool) -> bool {
        let m = self.m;
        let mut block_of = vec![usize::MAX; m.n];
        let mut blocks: Vec<Vec<usize>> = Vec::new();
        for r in 0..m.n {
            if self.x[r] == guide[r] || block_of[r] != usize::MAX {
                continue;
            }
            let b = blocks.len();
            let mut nodes = vec![r];
            block_of[r] = b;
            let mut head = 0;
            while head < nodes.len() {
                let v = nodes[head];
                head += 1;
                for a in m.adj(v) {
                    let w = a.other;
                    if (a.hard || !hard_only) && self.x[w] != guide[w] && block_of[w] == usize::MAX {
                        block_of[w] = b;
                        nodes.push(w);
                    }
                }
            }
            blocks.push(nodes);
        }
        let mut moved = false;
        let mut old = Vec::new();
        for nodes in &blocks {
            let before = self.cost;
            old.clear();
            old.extend(nodes.iter().map(|&v| self.x[v]));
            for &v in nodes {
                self.set(v, guide[v]);
            }
            if self.cost < before - 1e-9 * before.abs().max(1.0) && self.feasible() {
                moved = true;
            } else {
                for (&v, &s) in nodes.iter().zip(&old) {
                    self.set(v, s);
                }
            }
        }
        moved
    }

    /// Sets tie group `g` to root strategy `s` (and its members accordingly), then lets the
    /// group's neighbours take their best responses (memory unchecked).
    pub fn kick_group(&mut self, g: &Group, s: usize) {
        let m = self.m;
        let mut choice = vec![s; g.members.len()];
        for j in 1..g.members.len() {
            let (_, p, perm) = &g.members[j];
            choice[j] = perm[choice[*p]] as usize;
        }
        for (j, t) in g.members.iter().enumerate() {
            self.set(t.0, choice[j]);
        }
        let mut buf = std::mem::take(&mut self.buf);
        for &w in &g.nbrs {
            Self::local_into(m, &self.x, w, &mut buf);
            let best = (0..m.k[w]).min_by(|&a, &b| buf[a].total_cmp(&buf[b])).unwrap_or(self.x[w]);
            self.set(w, best);
        }
        self.buf = buf;
    }

    /// Moves a whole tie group to the root strategy that minimises the (penalised) cost, keeping
    /// memory feasible when `feasible_only`. Returns true if it moved.
    pub fn group_move(&mut self, g: &Group, pen: Option<&[f64]>, feasible_only: bool) -> bool {
        let m = self.m;
        let root = g.members[0].0;
        let old: Vec<usize> = g.members.iter().map(|t| self.x[t.0]).collect();
        let old_nb: Vec<usize> = g.nbrs.iter().map(|&w| self.x[w]).collect();
        let mut buf = std::mem::take(&mut self.buf);
        // Best responses of the neighbours to the group's new strategies.
        let respond = |st: &mut State, buf: &mut Vec<f64>| {
            for &w in &g.nbrs {
                Self::local_into(m, &st.x, w, buf);
                let q = |s: usize| pen.map_or(0.0, |p| p[m.off[w] + s]);
                let mut best = st.x[w];
                let mut bv = buf[best] + q(best);
                for s in 0..m.k[w] {
                    let v = buf[s] + q(s);
                    if v < bv {
                        bv = v;
                        best = s;
                    }
                }
                st.set(w, best);
            }
        };
        let penalty_nb =
            |st: &State| -> f64 { pen.map_or(0.0, |p| g.nbrs.iter().map(|&w| p[m.off[w] + st.x[w]]).sum()) };
        let cur_s = old[0];
        let penalty =
            |st: &State| -> f64 { pen.map_or(0.0, |p| g.members.iter().map(|t| p[m.off[t.0] + st.x[t.0]]).sum()) };
        let base = self.cost + penalty(self) + penalty_nb(self);
        let mut best: Option<(f64, usize)> = None;
        let mut choice = vec![0usize; g.members.len()];
        for s in 0..m.k[root] {
            if s == cur_s {
                continue;
            }
            choice[0] = s;
            for j in 1..g.members.len() {
                let (_, p, perm) = &g.members[j];
                choice[j] = perm[choice[*p]] as usize;
            }
            for (j, t) in g.members.iter().enumerate() {
                self.set(t.0, choice[j]);
            }
            respond(self, &mut buf);
            let val = self.cost + penalty(self) + penalty_nb(self);
            let ok = !feasible_only || self.feasible();
            if ok && val < base - 1e-9 * base.abs().max(1.0) && best.is_none_or(|b| val < b.0) {
                best = Some((val, s));
            }
            for (j, &w) in g.nbrs.iter().enumerate() {
                self.set(w, old_nb[j]);
            }
        }
        match best {
            Some((_, s)) => {
                choice[0] = s;
                for j in 1..g.members.len() {
                    let (_, p, perm) = &g.members[j];
                    choice[j] = perm[choice[*p]] as usize;
                }
                for (j, t) in g.members.iter().enumerate() {
                    self.set(t.0, choice[j]);
                }
                respond(self, &mut buf);
                self.buf = buf;
                true
            }
            None => {
                for (j, t) in g.members.iter().enumerate() {
                    self.set(t.0, old[j]);
                }
                self.buf = buf;
                false
            }
        }
    }
}

/// When [`State::tree_move`] keeps its result.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Accept {
    /// If memory stays feasible and the true cost does not increase.
    Feasible,
    /// If the penalised objective does not increase (memory unchecked).
    Penalized,
}

/// Scratch buffers for [`State::tree_move`].
#[derive(Default)]
pub(crate) struct TreeWork {
    off: Vec<usize>,
    total: Vec<f64>,
    arg: Vec<u32>,
    arg_off: Vec<usize>,
    choice: Vec<usize>,
    old: Vec<usize>,
    parent_adj: Vec<usize>,
}

/// A tree (or forest) of nodes in BFS order: `parent[j]` is the position of node `nodes[j]`'s
/// parent, `usize::MAX` for a root; parents always come before children.
pub(crate) struct Tree {
    pub nodes: Vec<usize>,
    pub parent: Vec<usize>,
    pos: Vec<usize>,
    mark: Vec<u32>,
    stamp: u32,
    queue_head: usize,
}

impl Tree {
    pub fn new(n: usize) -> Tree {
        Tree { nodes: Vec::new(), parent: Vec::new(), pos: vec![0; n], mark: vec![0; n], stamp: 0, queue_head: 0 }
    }

    #[inline]
    pub fn contains(&self, v: usize) -> bool {
        self.mark[v] == self.stamp
    }

    pub fn clear(&mut self) {
        self.nodes.clear();
        self.parent.clear();
        self.queue_head = 0;
        self.stamp = self.stamp.wrapping_add(1);
        if self.stamp == 0 {
            self.mark.fill(0);
            self.stamp = 1;
        }
    }

    fn push(&mut self, v: usize, parent: usize) {
        self.mark[v] = self.stamp;
        self.pos[v] = self.nodes.len();
        self.nodes.push(v);
        self.parent.push(parent);
    }

    /// Grows a BFS tree from `root` up to `max` nodes with at least two strategies. Nodes joined
    /// by hard edges (forbidden pairs) are pulled in together first, so that tied nodes move
    /// together. With `induced`, a node joins only if exactly one of its edges leads into the
    /// tree, so the induced subgraph is a tree and the DP is exact.
    pub fn grow(&mut self, m: &Model, root: usize, max: usize, induced: bool, rng: &mut SmallRng) {
        if self.contains(root) || m.k[root] < 2 {
            return;
        }
        let first = self.nodes.len();
        self.push(root, usize::MAX);
        let mut stack = Vec::new();
        self.hard_closure(m, first, max, induced, &mut stack);
        let mut head = first;
        while head < self.nodes.len() && self.nodes.len() < max {
            let v = self.nodes[head];
            let adj = m.adj(v);
            let n = adj.len();
            if n > 0 {
                let start = rng.random_range(0..n);
                for t in 0..n {
                    let w = adj[(start + t) % n].other;
                    if self.try_push(m, w, head, induced) {
                        let pos = self.nodes.len() - 1;
                        self.hard_closure(m, pos, max, induced, &mut stack);
                    }
                    if self.nodes.len() >= max {
                        break;
                    }
                }
            }
            head += 1;
        }
        self.queue_head = head;
    }

    fn try_push(&mut self, m: &Model, w: usize, parent: usize, induced: bool) -> bool {
        if self.contains(w) || m.k[w] < 2 {
            return false;
        }
        if induced {
            let links = m.adj(w).iter().filter(|a| self.contains(a.other)).count();
            if links != 1 {
                return false;
            }
        }
        self.push(w, parent);
        true
    }

    /// Adds, depth first, the nodes reachable from position `pos` over hard edges.
    fn hard_closure(&mut self, m: &Model, pos: usize, max: usize, induced: bool, stack: &mut Vec<usize>) {
        stack.clear();
        stack.push(pos);
        while let Some(p) = stack.pop() {
            let v = self.nodes[p];
            for a in m.adj(v) {
                if self.nodes.len() >= max.saturating_mul(2) {
                    return;
                }
                if a.hard && self.try_push(m, a.other, p, induced) {
                    stack.push(self.nodes.len() - 1);
                }
            }
        }
    }

    /// A maximum spanning forest of the nodes with at least two strategies, by edge importance
    /// (hard edges first, then the spread of the edge's costs) with random jitter, so that the
    /// DP sees the edges that matter most and conditions only the cheap ones on the incumbent.
    pub fn max_spanning_forest(&mut self, m: &Model, weight: &[f64], rng: &mut SmallRng) {
        self.clear();
        let mut order: Vec<(f64, usize)> = m
            .edges
            .iter()
            .enumerate()
            .filter(|(_, e)| m.k[e.u] >= 2 && m.k[e.v] >= 2)
            .map(|(i, _)| (weight[i] * rng.random_range(0.5..1.5), i))
            .collect();
        order.sort_unstable_by(|a, b| b.0.total_cmp(&a.0));
        let n = m.n;
        let mut uf: Vec<usize> = (0..n).collect();
        fn find(uf: &mut [usize], mut x: usize) -> usize {
            while uf[x] != x {
                uf[x] = uf[uf[x]];
                x = uf[x];
            }
            x
        }
        let mut tadj: Vec<Vec<usize>> = vec![Vec::new(); n];
        for &(_, ei) in &order {
            let e = m.edges[ei];
            let (a, b) = (find(&mut uf, e.u), find(&mut uf, e.v));
            if a != b {
                uf[a] = b;
                tadj[e.u].push(e.v);
                tadj[e.v].push(e.u);
            }
        }
        let mut roots: Vec<usize> = (0..n).filter(|&i| m.k[i] >= 2).collect();
        for i in (1..roots.len()).rev() {
            let j = rng.random_range(0..=i);
            roots.swap(i, j);
        }
        for r in roots {
            if self.contains(r) {
                continue;
            }
            let first = self.nodes.len();
            self.push(r, usize::MAX);
            let mut head = first;
            while head < self.nodes.len() {
                let v = self.nodes[head];
                for &w in &tadj[v] {
                    if !self.contains(w) {
                        self.push(w, head);
                    }
                }
                head += 1;
            }
        }
    }
}

/// Options of one search run.
pub(crate) struct SearchConfig<'a> {
    pub deadline: Instant,
    pub seed: u64,
    /// Stop early when this cost is reached (a proven lower bound).
    pub target: f64,
    /// Also stop when the best cost is within this relative gap of the best lower bound
    /// (`target` or a Lagrangian bound of any thread): `cost - bound <= gap * cost`.
    pub gap: f64,
    /// Re-optimise regions with this MIP back end (large-neighbourhood search).
    pub lns: Option<&'a dyn MipBackend>,
    /// Best solution shared between threads.
    pub shared: &'a Mutex<Option<(Vec<usize>, f64)>>,
    /// Skip construction and start from this feasible solution.
    pub start: Option<Vec<usize>>,
    /// Best lower bound found by any thread (Lagrangian TRW-S bounds), raised with `max`.
    pub bound: &'a Mutex<f64>,
}

/// The best feasible solution found so far and its cost.
type Best = Option<(Vec<usize>, f64)>;

/// Runs the whole search; returns the best feasible solution found (if any) and its cost.
///
/// The phases: construction on Lagrangian memory prices ([`Search::construct`]), a fallback that
/// always fits if construction found nothing ([`Search::fallback`]), then local search from the
/// best solution ([`Search::improve`]).
pub(crate) fn run(m: &Model, cfg: &SearchConfig) -> Best {
    let rng = SmallRng::seed_from_u64(cfg.seed);
    let start = Instant::now();
    let order: Vec<usize> = (0..m.n).filter(|&i| m.k[i] >= 2).collect();
    if order.is_empty() {
        // Every node has a single strategy: nothing to choose.
        let mut best = None;
        consider(&mut State::new(m, cheapest_labelling(m)), &mut best);
        return best;
    }
    let mut s = Search::new(m, cfg, rng, start, order);
    if let Some(x) = &cfg.start {
        consider(&mut State::new(m, x.clone()), &mut s.best);
    }
    let mut prices = Prices::new(m, start + s.total.mul_f64(0.25));
    if cfg.start.is_none() && s.construct(&mut prices) {
        s.publish();
        return s.best;
    }
    penalties(m, &prices.best_lambda, &mut s.pen);
    if s.best.is_none() {
        s.fallback();
    }
    s.publish();
    let (bx, _) = s.best.clone()?;
    s.improve(State::new(m, bx))
}

/// Makes `st`'s labelling the best if it is feasible and cheaper; says whether it did.
fn consider(st: &mut State, best: &mut Best) -> bool {
    st.resync();
    if st.feasible() && best.as_ref().is_none_or(|b| st.cost < b.1) {
        *best = Some((st.x.clone(), st.cost));
        true
    } else {
        false
    }
}

/// Each node's cheapest strategy, ties to smaller usage.
fn cheapest_labelling(m: &Model) -> Vec<usize> {
    (0..m.n)
        .map(|i| {
            let cs = m.costs(i);
            let us = m.usages(i);
            (0..m.k[i]).min_by(|&a, &b| cs[a].total_cmp(&cs[b]).then(us[a].cmp(&us[b]))).unwrap_or(0)
        })
        .collect()
}

/// Each node's smallest-usage strategy, ties to smaller cost.
fn smallest_labelling(m: &Model) -> Vec<usize> {
    (0..m.n)
        .map(|i| {
            let us = m.usages(i);
            let cs = m.costs(i);
            (0..m.k[i]).min_by(|&a, &b| us[a].cmp(&us[b]).then(cs[a].total_cmp(&cs[b]))).unwrap_or(0)
        })
        .collect()
}

/// One search thread: what its phases share.
struct Search<'a> {
    m: &'a Model,
    cfg: &'a SearchConfig<'a>,
    rng: SmallRng,
    /// When the search started, and the time it had from then to the deadline.
    start: Instant,
    total: Duration,
    /// The nodes with at least two strategies (never empty), reshuffled now and then.
    order: Vec<usize>,
    best: Best,
    tree: Tree,
    /// [`edge_weights`], for the spanning forests.
    weight: Vec<f64>,
    groups: Vec<Group>,
    ws: TreeWork,
    /// Memory prices of the strategies ([`penalties`] of the Lagrangian prices).
    pen: Vec<f64>,
    /// The TRW-S labelling without prices (memory ignored): a start for relinking guides.
    free_start: Vec<usize>,
}

/// The Lagrangian construction's state: a price per time step on memory over the limit.
struct Prices {
    trws: crate::trws::Trws,
    /// Construction stops here (a quarter of the time).
    deadline: Instant,
    lambda: Vec<f64>,
    /// The prices under which the best solution was found.
    best_lambda: Vec<f64>,
    seed_price: f64,
    iter: usize,
    /// The iteration at which the best cost last changed, and that cost.
    improved_at: usize,
    last_best: Option<f64>,
    // Price step: factors are clamped to [1 / (1 + delta), 1 + delta]; delta shrinks whenever the
    // priced labelling crosses the limit (feasible after infeasible or back), so the prices
    // settle where the labelling just fits instead of oscillating by factors of two.
    delta: f64,
    was_over: Option<bool>,
    /// Every priced labelling so far: guides for path relinking.
    guides: Vec<Vec<usize>>,
}

impl Prices {
    fn new(m: &Model, deadline: Instant) -> Prices {
        let lambda = vec![0.0f64; m.nsteps()];
        Prices {
            trws: crate::trws::Trws::new(m),
            deadline,
            best_lambda: lambda.clone(),
            lambda,
            seed_price: price_scale(m),
            iter: 0,
            improved_at: 0,
            last_best: None,
            delta: 1.0,
            was_over: None,
            guides: Vec::new(),
        }
    }

    /// Multiplicative price updates by relative excess: prices of steps far below the limit
    /// fall fast, those above it rise; the two threads use different step sizes.
    fn update(&mut self, m: &Model, prof: &[i64], seed: u64) {
        let kappa = if seed.is_multiple_of(2) { 20.0 } else { 8.0 };
        let limit = m.limit.max(1) as f64;
        for (t, &u) in prof.iter().enumerate() {
            let rel = (u as f64 - limit) / limit;
            if u > m.limit && self.lambda[t] == 0.0 {
                self.lambda[t] = self.seed_price;
            } else {
                self.lambda[t] *= (kappa * rel).exp().clamp(1.0 / (1.0 + self.delta), 1.0 + self.delta);
            }
        }
    }
}

/// The local search's state.
struct Local<'a> {
    st: State<'a>,
    since_improve: usize,
    rounds: usize,
    /// The size (ILP variables) region solves aim at, adapted to how they go.
    region_vars: usize,
    /// How many times over its limit the back end has run (at most 16): scales limits down.
    overrun: f64,
    in_region: Vec<bool>,
    lns_solves: usize,
    /// How long the last region solve took.
    last_region: Duration,
}

impl<'a> Search<'a> {
    fn new(m: &'a Model, cfg: &'a SearchConfig<'a>, rng: SmallRng, start: Instant, order: Vec<usize>) -> Search<'a> {
        let total = cfg.deadline.saturating_duration_since(start);
        let tree = Tree::new(m.n);
        let weight = edge_weights(m);
        let groups = tie_groups(m);
        if debug() {
            let big = groups.iter().map(|g| g.members.len()).max().unwrap_or(0);
            tracing::debug!("{} tie groups, largest {big}", groups.len());
        }
        Search {
            m,
            cfg,
            rng,
            start,
            total,
            order,
            best: None,
            tree,
            weight,
            groups,
            ws: TreeWork::default(),
            pen: vec![0.0f64; m.cost.len()],
            free_start: Vec::new(),
        }
    }

    /// Offers the best solution to the other threads.
    fn publish(&self) {
        if let Some((x, c)) = &self.best
            && let Ok(mut g) = self.cfg.shared.lock()
            && g.as_ref().is_none_or(|b| *c < b.1)
        {
            *g = Some((x.clone(), *c));
        }
    }

    /// The best solution of any thread.
    fn shared_best(&self) -> Best {
        self.cfg.shared.lock().ok().and_then(|g| g.clone())
    }

    /// The cost is close enough to the best bound known.
    fn done(&self, cost: f64) -> bool {
        let cfg = self.cfg;
        let bound = cfg.bound.lock().map_or(cfg.target, |b| b.max(cfg.target));
        cost <= bound + 1e-9 * bound.abs().max(1.0) || (cfg.gap > 0.0 && cost - bound <= cfg.gap * cost.abs())
    }

    /// A random node with at least two strategies.
    fn random_node(&mut self) -> usize {
        self.order[self.rng.random_range(0..self.order.len())]
    }

    /// Grows `self.tree` from a random node to one of `sizes`, induced or not, at random.
    fn random_tree(&mut self, sizes: &[usize]) {
        let root = self.random_node();
        let size = sizes[self.rng.random_range(0..sizes.len())];
        let induced = self.rng.random_bool(0.5);
        self.tree.clear();
        self.tree.grow(self.m, root, size, induced, &mut self.rng);
    }

    /// Sweeps `st` with node moves on the true cost until none pays (at most `max` times).
    fn sweep_feasible(&self, st: &mut State, max: usize) {
        for k in 0..max {
            // Past the deadline (a solve that must still answer), one sweep does.
            if st.sweep(&self.order, None, true) == 0 || (k > 0 && self.late()) {
                break;
            }
        }
    }

    /// Whether the deadline has passed: the construction then does the least that still gives
    /// a repaired labelling (the first trees and sweeps), as a solve with no time left must
    /// answer at once.
    fn late(&self) -> bool {
        Instant::now() > self.cfg.deadline
    }

    /// Construction: whole-graph TRW-S, tree DP and node sweeps on Lagrangian prices, each
    /// priced labelling repaired into a feasible solution, until the prices settle or a quarter
    /// of the time is gone. True when the best is within the gap of the bound (the search is
    /// over).
    fn construct(&mut self, p: &mut Prices) -> bool {
        let m = self.m;
        loop {
            let prof = self.lagrangian_step(p);
            // Stop when out of time, when the best is within the gap of the bound, or when the
            // best has not improved for a while.
            if self.best.as_ref().is_some_and(|b| self.done(b.1)) {
                return true;
            }
            let over = prof.iter().any(|&u| u > m.limit);
            if p.was_over.is_some_and(|w| w != over) {
                p.delta = (p.delta * 0.6).max(0.01);
            }
            p.was_over = Some(over);
            if Instant::now() > p.deadline
                || p.lambda.is_empty()
                || (self.best.is_some() && p.iter >= p.improved_at + 8 && p.delta <= 0.05)
            {
                return false;
            }
            p.update(m, &prof, self.cfg.seed);
            penalties(m, &p.lambda, &mut self.pen);
        }
    }

    /// One construction step on the current prices; returns the priced labelling's memory
    /// usage per time step.
    fn lagrangian_step(&mut self, p: &mut Prices) -> Vec<i64> {
        let m = self.m;
        p.iter += 1;
        order_shuffle(&mut self.order, &mut self.rng);
        let t0 = Instant::now();
        let (tx, tc) = p.trws.run(m, &self.pen, if p.iter == 1 { 30 } else { 10 }, p.deadline);
        // Lagrangian dual value: min of the priced energy minus the prices times the limit.
        let lb = p.trws.lower_bound(m, &self.pen) - m.limit as f64 * p.lambda.iter().sum::<f64>();
        if let Ok(mut b) = self.cfg.bound.lock()
            && lb > *b
        {
            *b = lb;
        }
        if debug() {
            let prof = m.usage_profile(&tx);
            tracing::debug!(
                "[{:.1}s] trws {} in {:.2}s: cost {tc:.0} max usage {} limit {} bound {lb:.0}",
                self.start.elapsed().as_secs_f64(),
                p.iter,
                t0.elapsed().as_secs_f64(),
                prof.iter().max().copied().unwrap_or(0),
                m.limit
            );
        }
        if p.iter == 1 {
            self.free_start.clone_from(&tx);
        }
        let st = self.priced_descent(tx);
        let prof = m.usage_profile(&st.x);
        // Feasible copy: repair then improve with the true cost.
        let mut fx = State::new(m, st.x.clone());
        if fx.repair(Some(&self.pen), self.cfg.deadline) {
            self.sweep_feasible(&mut fx, 10);
            if consider(&mut fx, &mut self.best) {
                p.best_lambda.clone_from(&p.lambda);
            }
        }
        self.relink_guides(p, &st.x);
        if debug() {
            let over = prof.iter().filter(|&&u| u > m.limit).count();
            tracing::debug!(
                "[{:.1}s] lagr {}: cost {:.0} over-steps {over} max {} limit {} | repaired {:.0} | best {:?}",
                self.start.elapsed().as_secs_f64(),
                p.iter,
                m.total_cost(&st.x),
                prof.iter().max().copied().unwrap_or(0),
                m.limit,
                fx.cost,
                self.best.as_ref().map(|b| b.1)
            );
        }
        let now_best = self.best.as_ref().map(|b| b.1);
        if now_best != p.last_best {
            p.improved_at = p.iter;
            p.last_best = now_best;
        }
        prof
    }

    /// From the TRW-S labelling `x` on the priced costs, exact DP over random trees and node
    /// and group sweeps on the same (memory unchecked).
    fn priced_descent(&mut self, x: Vec<usize>) -> State<'a> {
        let mut st = State::new(self.m, x);
        for k in 0..40 {
            // Past the deadline, eight trees (one of the whole graph is a dynamic programme over
            // every matrix: on a large problem 40 of them cost a third of a second).
            if k >= 8 && self.late() {
                break;
            }
            self.random_tree(&[16usize, 64, 256, 1024, usize::MAX]);
            st.tree_move(&self.tree, &self.pen, 1.0, Accept::Penalized, &mut self.ws);
        }
        for k in 0..10 {
            let mut moved = st.sweep(&self.order, Some(&self.pen), false);
            for g in &self.groups {
                moved += st.group_move(g, Some(&self.pen), false) as usize;
            }
            if moved == 0 || (k > 0 && self.late()) {
                break;
            }
        }
        st
    }

    /// Path relinking: the best feasible solution takes over, one connected block at a time,
    /// the priced labellings' choices (`x` and the earlier ones) where that pays and fits.
    fn relink_guides(&mut self, p: &mut Prices, x: &[usize]) {
        p.guides.push(x.to_vec());
        if let Some((bx, _)) = &self.best {
            let mut rx = State::new(self.m, bx.clone());
            let mut gained = false;
            for g in p.guides.iter().rev() {
                gained |= rx.relink(g);
            }
            if gained {
                self.sweep_feasible(&mut rx, 10);
                if consider(&mut rx, &mut self.best) {
                    p.best_lambda.clone_from(&p.lambda);
                }
            }
        }
    }

    /// Out of time before the first repair: the smallest usages always fit (the caller checked
    /// the minimum peak), whatever they cost.
    fn fallback(&mut self) {
        let mut s0 = State::new(self.m, smallest_labelling(self.m));
        consider(&mut s0, &mut self.best);
    }

    /// Local search from `st` (the best feasible solution) until the deadline or the bound;
    /// returns the best solution.
    fn improve(mut self, st: State<'a>) -> Best {
        let mut l = Local {
            st,
            since_improve: 0,
            rounds: 0,
            region_vars: 20_000,
            overrun: 1.0,
            in_region: vec![false; self.m.n],
            lns_solves: 0,
            last_region: Duration::ZERO,
        };
        if self.cfg.lns.is_some() && self.solve_whole(&mut l) {
            // The whole problem is solved: nothing left to search.
            consider(&mut l.st, &mut self.best);
            self.publish();
            return self.best;
        }
        while Instant::now() < self.cfg.deadline && !self.order.is_empty() {
            if !self.round(&mut l) {
                break;
            }
        }
        if debug() {
            tracing::debug!("lns: {} region solves, final region size {}", l.lns_solves, l.region_vars);
        }
        consider(&mut l.st, &mut self.best);
        self.publish();
        if debug() {
            tracing::debug!("search: {} rounds, best {:?}", l.rounds, self.best.as_ref().map(|b| b.1));
        }
        self.best
    }

    /// Small enough for one region: solves the whole problem exactly; true if it proved `l.st`
    /// optimal (and feasible).
    fn solve_whole(&mut self, l: &mut Local) -> bool {
        let m = self.m;
        let all_vars: usize =
            self.order.iter().map(|&v| m.k[v] * (1 + m.adj(v).iter().map(|a| m.k[a.other]).sum::<usize>())).sum();
        let left = self.cfg.deadline.saturating_duration_since(Instant::now());
        if all_vars > l.region_vars || left.is_zero() {
            return false;
        }
        for &v in &self.order {
            l.in_region[v] = true;
        }
        let limit = left - left / 8;
        // CBC with its default pre-processing, whatever the back end: on tiny models without
        // it, CBC can report optimal with column values that are not the optimum.
        let cbc = crate::ilp::Cbc::default();
        let out = crate::lns::solve_region(m, &mut l.st, &self.order, &l.in_region, &cbc, limit);
        for &v in &self.order {
            l.in_region[v] = false;
        }
        l.lns_solves += 1;
        out.is_ok_and(|o| o.optimal) && l.st.feasible()
    }

    /// One round of local search: a region solve, tree and node moves, and a kick when stuck.
    /// False when the search is over.
    fn round(&mut self, l: &mut Local<'a>) -> bool {
        l.rounds += 1;
        if self.done(l.st.cost) {
            return false;
        }
        let before = l.st.cost;
        if let Some(backend) = self.cfg.lns
            && let Some(limit) = self.lns_limit(l)
            && self.lns_step(l, backend, limit)
        {
            return false;
        }
        self.descend(l);
        if consider(&mut l.st, &mut self.best) {
            self.publish();
        }
        if l.st.cost < before - 1e-9 * before.abs().max(1.0) {
            l.since_improve = 0;
        } else {
            l.since_improve += 1;
        }
        // Kicks: tie groups (nodes that can only move together) are where single-node and tree
        // moves get stuck, so most kicks switch a whole group; a few randomise a small region.
        let patience = if self.groups.is_empty() { 30 } else { 3 };
        if l.since_improve > patience && self.cfg.lns.is_none() {
            l.since_improve = 0;
            self.kick(l);
        }
        true
    }

    /// The time limit of this round's region solve, or `None` when there is no time for one.
    fn lns_limit(&self, l: &Local) -> Option<Duration> {
        let left = self.cfg.deadline.saturating_duration_since(Instant::now());
        // CBC can overrun its limit several times over (it checks the clock between
        // branch-and-bound nodes, not inside the root LP): keep a margin and ask for a fifth
        // of what is left, scaled down by the overruns seen so far.
        let margin = (left / 4).min(Duration::from_millis(700));
        let lns_limit = (left.saturating_sub(margin) / 5).min(Duration::from_secs(6)).div_f64(l.overrun);
        // No region solves in the last 15% of the time: a late overrun would miss the deadline.
        // Nor below 50 ms (CBC's root LP alone takes longer), nor when the last region solve
        // took longer than the time left.
        let lns_open = left > self.total.mul_f64(0.15)
            && lns_limit >= Duration::from_millis(50)
            && left.saturating_sub(margin) >= l.last_region;
        lns_open.then_some(lns_limit)
    }

    /// Large-neighbourhood search: re-optimises a random region with `backend` within
    /// `lns_limit`, adapting the region size to how the solve went. True when the region held
    /// every free node and was solved to optimality (the problem is solved).
    fn lns_step(&mut self, l: &mut Local<'a>, backend: &dyn MipBackend, lns_limit: Duration) -> bool {
        let m = self.m;
        // Adopt a better solution from another thread.
        if let Some((x, c)) = self.shared_best()
            && c < l.st.cost - 1e-9 * c.abs().max(1.0)
        {
            l.st = State::new(m, x);
        }
        let region = self.random_region(l);
        let t0 = Instant::now();
        let out = crate::lns::solve_region(m, &mut l.st, &region, &l.in_region, backend, lns_limit);
        l.last_region = t0.elapsed();
        if debug() {
            tracing::debug!(
                "[{:.1}s] lns took {:.2}s of {:.2}s",
                self.start.elapsed().as_secs_f64(),
                t0.elapsed().as_secs_f64(),
                lns_limit.as_secs_f64()
            );
        }
        for &v in &region {
            l.in_region[v] = false;
        }
        l.lns_solves += 1;
        // A region that holds every free node, solved to optimality, solves the problem.
        if region.len() >= self.order.len() && out.as_ref().is_ok_and(|o| o.optimal) && l.st.feasible() {
            return true;
        }
        let took = t0.elapsed();
        if took > lns_limit.mul_f64(1.5) {
            l.overrun = (l.overrun * took.as_secs_f64() / lns_limit.as_secs_f64().max(1e-3)).min(16.0);
            l.region_vars = (l.region_vars / 2).max(500);
        }
        match out {
            Ok(o) => {
                if o.optimal && took < lns_limit / 4 {
                    l.region_vars = (l.region_vars * 5 / 4).min(60_000);
                } else if !o.optimal {
                    l.region_vars = (l.region_vars * 3 / 4).max(500);
                }
            }
            Err(_) => l.region_vars = (l.region_vars / 2).max(500),
        }
        false
    }

    /// A region of about `l.region_vars` ILP variables, marked in `l.in_region`: a ball around a
    /// random node, and since memory couples components, more balls when its component is
    /// exhausted.
    fn random_region(&mut self, l: &mut Local) -> Vec<usize> {
        let m = self.m;
        let root = self.random_node();
        let mut region = grow_region(m, root, l.region_vars, &mut self.rng, &mut l.in_region);
        for _ in 0..32 {
            let vars: usize = region.iter().map(|&v| m.k[v] * (1 + m.adj(v).len())).sum();
            if vars >= l.region_vars || region.len() >= self.order.len() {
                break;
            }
            let r = self.random_node();
            if !l.in_region[r] {
                let more = grow_region(m, r, l.region_vars - vars, &mut self.rng, &mut l.in_region);
                region.extend(more);
            }
        }
        region
    }

    /// Descent on the true cost keeping memory feasible: spanning-forest and random-tree DP,
    /// node, group and pair moves.
    fn descend(&mut self, l: &mut Local) {
        let deadline = self.cfg.deadline;
        if l.rounds.is_multiple_of(2) {
            self.tree.max_spanning_forest(self.m, &self.weight, &mut self.rng);
            let scale = [0.0, 0.5, 1.0, 2.0][self.rng.random_range(0..4)];
            l.st.tree_move(&self.tree, &self.pen, scale, Accept::Feasible, &mut self.ws);
        }
        for _ in 0..50 {
            if Instant::now() > deadline {
                break;
            }
            self.random_tree(&[4usize, 16, 64, 256, 1024, usize::MAX]);
            let scale = [0.0, 0.5, 1.0, 2.0][self.rng.random_range(0..4)];
            l.st.tree_move(&self.tree, &self.pen, scale, Accept::Feasible, &mut self.ws);
        }
        if l.rounds.is_multiple_of(8) && Instant::now() < deadline {
            order_shuffle(&mut self.order, &mut self.rng);
            l.st.sweep(&self.order, None, true);
        }
        if l.rounds.is_multiple_of(4) && Instant::now() < deadline {
            for g in &self.groups {
                l.st.group_move(g, None, true);
            }
        }
        if self.order.len() <= 300 {
            // A node's pair moves re-price memory for each of its strategies: on a folded
            // problem with thousands of steps, a sweep of them takes seconds, so the deadline is
            // checked per node.
            for &i in &self.order {
                if Instant::now() > deadline {
                    break;
                }
                l.st.pair_move(i);
            }
        }
    }

    /// Perturbs from the best solution any thread has found (after crossing it with this
    /// thread's best), then repairs and descends; or relinks towards a guide.
    fn kick(&mut self, l: &mut Local<'a>) {
        let m = self.m;
        self.crossover();
        if let Some((x, c)) = self.shared_best()
            && c < l.st.cost - 1e-9 * c.abs().max(1.0)
        {
            l.st = State::new(m, x);
        } else if let Some((bx, c)) = &self.best
            && *c < l.st.cost - 1e-9 * c.abs().max(1.0)
        {
            l.st = State::new(m, bx.clone());
        }
        if self.rng.random_bool(0.5) {
            self.follow_guide(l);
            return;
        } else if !self.groups.is_empty() && self.rng.random_bool(0.8) {
            let g = &self.groups[self.rng.random_range(0..self.groups.len())];
            let s = self.rng.random_range(0..m.k[g.members[0].0]);
            l.st.kick_group(g, s);
        } else {
            let root = self.random_node();
            self.tree.clear();
            self.tree.grow(m, root, self.rng.random_range(2..64), false, &mut self.rng);
            for &v in &self.tree.nodes {
                let s = self.rng.random_range(0..m.k[v]);
                if m.cost[m.off[v] + s] < 1e17 {
                    l.st.set(v, s);
                }
            }
        }
        l.st.repair(Some(&self.pen), self.cfg.deadline);
        self.sweep_feasible(&mut l.st, 5);
        if !l.st.feasible()
            && let Some((bx, _)) = &self.best
        {
            l.st = State::new(m, bx.clone());
        }
    }

    /// Crossover: each of this thread's best and the shared best relinked towards the other.
    fn crossover(&mut self) {
        if let (Some((sx, _)), Some((bx, _))) = (self.shared_best(), self.best.clone())
            && sx != bx
        {
            for (a, b) in [(&sx, &bx), (&bx, &sx)] {
                let mut cx = State::new(self.m, a.clone());
                if cx.relink(b) && consider(&mut cx, &mut self.best) {
                    self.publish();
                }
            }
        }
    }

    /// A guide: from the unpriced TRW-S labelling (or the current solution), descends ignoring
    /// memory (tree DP and node moves on the cost with small prices), then relinks `l.st`
    /// towards it.
    fn follow_guide(&mut self, l: &mut Local) {
        let from = if self.free_start.len() == self.m.n && self.rng.random_bool(0.7) {
            self.free_start.clone()
        } else {
            l.st.x.clone()
        };
        let mut gx = State::new(self.m, from);
        for _ in 0..40 {
            self.random_tree(&[16usize, 64, 256, 1024, usize::MAX]);
            let scale = [0.0, 0.1, 0.3][self.rng.random_range(0..3)];
            gx.tree_move(&self.tree, &self.pen, scale, Accept::Penalized, &mut self.ws);
        }
        for _ in 0..5 {
            if gx.sweep(&self.order, None, false) == 0 {
                break;
            }
        }
        let relinked = l.st.relink(&gx.x);
        if debug() {
            tracing::debug!(
                "[{:.1}s] guide {:.0} relinked {relinked} -> {:.0}",
                self.start.elapsed().as_secs_f64(),
                gx.cost,
                l.st.cost
            );
        }
    }
}

/// A connected region grown by BFS from `root` until its ILP would need about `budget`
/// variables; marks members in `in_region` (the caller clears the marks).
fn grow_region(m: &Model, root: usize, budget: usize, rng: &mut SmallRng, in_region: &mut [bool]) -> Vec<usize> {
    let mut region = vec![root];
    in_region[root] = true;
    let mut vars = m.k[root];
    let mut head = 0;
    while head < region.len() && vars < budget {
        let v = region[head];
        let adj = m.adj(v);
        let n = adj.len();
        if n > 0 {
            let start = rng.random_range(0..n);
            for t in 0..n {
                let w = adj[(start + t) % n].other;
                if in_region[w] || m.k[w] < 2 {
                    continue;
                }
                let mut add = m.k[w];
                for a in m.adj(w) {
                    if in_region[a.other] {
                        add += m.k[w] * m.k[a.other];
                    }
                }
                if vars + add > budget && region.len() > 1 {
                    continue;
                }
                in_region[w] = true;
                region.push(w);
                vars += add;
                // Nodes tied by hard edges come along (up to twice the budget).
                let mut stack = vec![w];
                while let Some(x) = stack.pop() {
                    for b in m.adj(x) {
                        let y = b.other;
                        if b.hard && !in_region[y] && m.k[y] >= 2 && vars < 2 * budget {
                            in_region[y] = true;
                            region.push(y);
                            vars += m.k[y] * (1 + m.k[x]);
                            stack.push(y);
                        }
                    }
                }
            }
        }
        head += 1;
    }
    region
}

/// Whether the search's progress is logged (`AUTOPAR_LOG=solver=debug`): some lines cost
/// a pass over the problem to compute.
fn debug() -> bool {
    tracing::enabled!(tracing::Level::DEBUG)
}

/// Importance of each merged edge: very large for hard edges, else the spread of its finite costs.
fn edge_weights(m: &Model) -> Vec<f64> {
    m.edges
        .iter()
        .map(|e| {
            let mat = &m.mats[e.mat..e.mat + m.k[e.u] * m.k[e.v]];
            let mut lo = f64::INFINITY;
            let mut hi = f64::NEG_INFINITY;
            let mut hard = false;
            for &c in mat {
                if c >= 1e17 {
                    hard = true;
                } else {
                    lo = lo.min(c);
                    hi = hi.max(c);
                }
            }
            if hard {
                1e30
            } else if hi > lo {
                hi - lo
            } else {
                0.0
            }
        })
        .collect()
}

fn order_shuffle(order: &mut [usize], rng: &mut SmallRng) {
    for i in (1..order.len()).rev() {
        let j = rng.random_range(0..=i);
        order.swap(i, j);
    }
}

/// Ratio of typical cost spread to typical usage spread: the unit of a memory price.
fn price_scale(m: &Model) -> f64 {
    let mut dc = 0.0;
    let mut du = 0.0;
    for i in 0..m.n {
        let cs: Vec<f64> = m.costs(i).iter().copied().filter(|&c| c < 1e17).collect();
        if cs.len() < 2 {
            continue;
        }
        let (lo, hi) = cs.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &c| (a.min(c), b.max(c)));
        dc += hi - lo;
        for p in m.pieces(i) {
            let us = m.piece_usages(i, p);
            let (ulo, uhi) = us.iter().fold((i64::MAX, i64::MIN), |(a, b), &u| (a.min(u), b.max(u)));
            du += (uhi - ulo) as f64 * (p.r - p.l) as f64;
        }
    }
    if du > 0.0 { dc / du } else { 0.0 }
}

/// The memory price of every strategy: `pen[off[i] + s]` is the sum, over node `i`'s pieces, of
/// the piece's usage under `s` times the sum of `lambda` over the piece's steps.
pub(crate) fn penalties(m: &Model, lambda: &[f64], pen: &mut [f64]) {
    let mut prefix = Vec::with_capacity(lambda.len() + 1);
    prefix.push(0.0);
    let mut acc = 0.0;
    for &l in lambda {
        acc += l;
        prefix.push(acc);
    }
    pen.fill(0.0);
    for i in 0..m.n {
        let o = m.off[i];
        for p in m.pieces(i) {
            let price = prefix[p.r] - prefix[p.l];
            if price != 0.0 {
                for (q, &u) in pen[o..o + m.k[i]].iter_mut().zip(m.piece_usages(i, p)) {
                    *q += price * u as f64;
                }
            }
        }
    }
}
