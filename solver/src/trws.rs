//! Sequential tree-reweighted message passing (TRW-S, Kolmogorov 2006) on the cost graph,
//! ignoring the memory limit except through per-node prices on usage (Lagrangian terms).
//!
//! Spanning-tree dynamic programming conditions every non-tree edge on the incumbent, so it
//! cannot flip a large cyclic cluster of nodes (say, every operator of a layer switching its
//! sharding axis together). TRW-S passes min-sum messages over all edges at once, with the edge
//! weights of a decomposition into monotonic chains, which makes its lower bound non-decreasing;
//! its labelling is decoded greedily during each pass (every node takes the strategy minimising its
//! cost plus edges to already-decoded nodes plus messages from the others). Messages persist
//! between calls, so a run after a change of prices starts from the previous fixed point.

use crate::model::{HARD, Model};

/// Entries at or above [`HARD`] enter the messages as this value, so that sums of a few of them
/// stay finite and comparable.
const CAP: f64 = 1e18;

pub(crate) struct Trws {
    /// Processing order (a permutation of all nodes) and each node's position in it.
    order: Vec<usize>,
    pos: Vec<usize>,
    /// For adjacency entry `p` of node `i` (neighbour `j`): the entry of `j` for `i`.
    rev: Vec<usize>,
    /// Message into node `i` from the neighbour of its adjacency entry `p`: `k[i]` values at
    /// `msg_off[p]`.
    msg_off: Vec<usize>,
    msg: Vec<f64>,
    /// `1 / max(neighbours before, neighbours after)` per node.
    gamma: Vec<f64>,
    theta: Vec<f64>,
    a: Vec<f64>,
    out: Vec<f64>,
}

impl Trws {
    pub fn new(m: &Model) -> Trws {
        // Node index order: in the graphs we see it follows the program order, so the passes
        // run along the dataflow.
        let n = m.n;
        let order: Vec<usize> = (0..n).collect();
        let mut pos = vec![0; n];
        for (p, &i) in order.iter().enumerate() {
            pos[i] = p;
        }
        let mut rev = vec![0; m.adj.len()];
        for i in 0..n {
            for (p, a) in m.adj(i).iter().enumerate() {
                let j = a.other;
                let q = m.adj(j).iter().position(|b| b.other == i).unwrap_or(0);
                rev[m.adj_start[i] + p] = m.adj_start[j] + q;
            }
        }
        let mut msg_off = Vec::with_capacity(m.adj.len());
        let mut total = 0;
        for i in 0..n {
            for _ in m.adj(i) {
                msg_off.push(total);
                total += m.k[i];
            }
        }
        let gamma = (0..n)
            .map(|i| {
                let before = m.adj(i).iter().filter(|a| pos[a.other] < pos[i]).count();
                let after = m.adj(i).len() - before;
                1.0 / before.max(after).max(1) as f64
            })
            .collect();
        Trws {
            order,
            pos,
            rev,
            msg_off,
            msg: vec![0.0; total],
            gamma,
            theta: Vec::new(),
            a: Vec::new(),
            out: Vec::new(),
        }
    }

    /// Runs `iters` forward-backward sweeps with unary terms `cost + pen[i] * usage`; returns
    /// the best decoded labelling by true cost (memory is not checked) and its cost.
    pub fn run(&mut self, m: &Model, pen: &[f64], iters: usize, deadline: std::time::Instant) -> (Vec<usize>, f64) {
        let n = m.n;
        let mut x = vec![0usize; n];
        let mut best: Option<(Vec<usize>, f64)> = None;
        for it in 0..iters {
            for backward in [false, true] {
                for t in 0..n {
                    let i = if backward { self.order[n - 1 - t] } else { self.order[t] };
                    self.update(m, pen, i, backward, &mut x);
                }
                let c = m.total_cost(&x);
                if best.as_ref().is_none_or(|b| c < b.1) {
                    best = Some((x.clone(), c));
                }
            }
            if it + 1 < iters && std::time::Instant::now() > deadline {
                break;
            }
        }
        best.unwrap_or((x, f64::INFINITY))
    }

    /// Processes node `i`: decodes its label given the decoded earlier nodes, then sends
    /// messages to its later neighbours (in the pass direction).
    fn update(&mut self, m: &Model, pen: &[f64], i: usize, backward: bool, x: &mut [usize]) {
        let ki = m.k[i];
        let later = |pos: &[usize], j: usize| if backward { pos[j] < pos[i] } else { pos[j] > pos[i] };
        // Belief: unary plus all incoming messages.
        self.theta.clear();
        let p_i = pen[i];
        for (&c, &u) in m.costs(i).iter().zip(m.usages(i)) {
            self.theta.push(c.min(CAP) + p_i * u as f64);
        }
        // Decoding: unary + edges to decoded (earlier) nodes + messages from later nodes.
        self.a.clear();
        self.a.extend_from_slice(&self.theta);
        let base = m.adj_start[i];
        for (p, adj) in m.adj(i).iter().enumerate() {
            let off = self.msg_off[base + p];
            let msg = &self.msg[off..off + ki];
            for (t, &v) in self.theta.iter_mut().zip(msg) {
                *t += v;
            }
            if later(&self.pos, adj.other) {
                for (t, &v) in self.a.iter_mut().zip(msg) {
                    *t += v;
                }
            } else {
                let row = m.row(i, adj, x[adj.other]);
                for (t, &v) in self.a.iter_mut().zip(row) {
                    *t += v.min(CAP);
                }
            }
        }
        let mut bs = 0;
        for s in 1..ki {
            if self.a[s] < self.a[bs] {
                bs = s;
            }
        }
        x[i] = bs;
        if ki < 2 && m.adj(i).iter().all(|adj| m.k[adj.other] < 2) {
            return;
        }
        // Messages to later neighbours: m_ij(s_j) = min_s (gamma * belief(s) - m_ji(s) + E(s, s_j)).
        let g = self.gamma[i];
        for (p, adj) in m.adj(i).iter().enumerate() {
            let j = adj.other;
            if !later(&self.pos, j) {
                continue;
            }
            let kj = m.k[j];
            let off_in = self.msg_off[base + p];
            self.a.clear();
            for s in 0..ki {
                self.a.push(g * self.theta[s] - self.msg[off_in + s]);
            }
            // The edge seen from j: matrix oriented [s_i][s_j].
            let q = self.rev[base + p];
            let adj_j = m.adj[q];
            self.out.clear();
            self.out.resize(kj, f64::INFINITY);
            for s in 0..ki {
                let av = self.a[s];
                if av >= CAP {
                    continue;
                }
                let row = m.row(j, &adj_j, s);
                for (o, &e) in self.out.iter_mut().zip(row) {
                    let v = av + if e >= HARD { CAP } else { e };
                    if v < *o {
                        *o = v;
                    }
                }
            }
            let mn = self.out.iter().copied().fold(f64::INFINITY, f64::min);
            let off_out = self.msg_off[q];
            let dst = &mut self.msg[off_out..off_out + kj];
            if mn.is_finite() {
                for (d, &o) in dst.iter_mut().zip(&self.out) {
                    *d = (o - mn).min(CAP);
                }
            } else {
                dst.fill(0.0);
            }
        }
    }
}
