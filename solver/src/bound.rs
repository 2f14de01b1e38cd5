//! Cheap lower bounds.
//!
//! Each edge is charged to one endpoint (the one with more strategies), and every node then
//! picks independently the strategy minimising its own cost plus, for each edge charged to it,
//! the smallest entry of that edge's row. Any solution costs at least this much, because the
//! true cost of every node-with-its-edges group is at least that group's minimum.

use crate::model::Model;

/// A lower bound on the cost of every solution, ignoring memory.
pub(crate) fn edge_charged_bound(m: &Model) -> f64 {
    let mut extra = vec![0.0f64; m.cost.len()];
    for e in &m.edges {
        let (ku, kv) = (m.k[e.u], m.k[e.v]);
        // Charge to the endpoint with more strategies: its per-strategy minimum is tighter.
        if ku >= kv {
            for su in 0..ku {
                let row = &m.mats[e.mat + su * kv..e.mat + (su + 1) * kv];
                let mn = row.iter().copied().fold(f64::INFINITY, f64::min);
                extra[m.off[e.u] + su] += mn;
            }
        } else {
            let t = e.mat + ku * kv;
            for sv in 0..kv {
                let row = &m.mats[t + sv * ku..t + (sv + 1) * ku];
                let mn = row.iter().copied().fold(f64::INFINITY, f64::min);
                extra[m.off[e.v] + sv] += mn;
            }
        }
    }
    let mut total = 0.0;
    for i in 0..m.n {
        let o = m.off[i];
        let mut best = f64::INFINITY;
        for s in 0..m.k[i] {
            best = best.min(m.cost[o + s] + extra[o + s]);
        }
        total += best;
    }
    total
}
