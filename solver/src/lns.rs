//! Large-neighbourhood search with the exact ILP: free a connected region of nodes, fix the rest
//! at the current solution, and solve the region's ILP (edges to fixed nodes become node costs,
//! fixed nodes' usage becomes the right-hand side of the memory rows). The current solution is
//! passed as the starting point, so the region's result is never worse.
//!
//! Memory rows are added lazily: the ILP is first solved without them, then with the rows its
//! solution breaks, until it breaks none (memory seldom binds at the optimum, and the rows are
//! most of the model's nonzeros). A relaxation's bound is still a bound.

use std::time::Duration;

use crate::error::Result;
use crate::ilp::{Constraint, INFINITE_COST, Mip, MipBackend, MipStatus, VarKind};
use crate::model::Model;
use crate::search::State;

/// Outcome of one region solve.
pub(crate) struct RegionOutcome {
    /// The back end proved the region optimal within its time limit.
    pub optimal: bool,
    /// A lower bound on the total cost given the fixed nodes (`-inf` if unknown).
    pub bound: f64,
}

/// Re-optimises `region` (distinct nodes) exactly, keeping everything else fixed.
pub(crate) fn solve_region(
    m: &Model,
    st: &mut State,
    region: &[usize],
    in_region: &[bool],
    backend: &dyn MipBackend,
    time_limit: Duration,
) -> Result<RegionOutcome> {
    let mut mip = Mip::default();
    let mut init = Vec::new();
    let mut x_start = Vec::with_capacity(region.len());
    let mut unary = Vec::new();
    for &i in region {
        x_start.push(mip.vars.len());
        unary.clear();
        unary.extend_from_slice(m.costs(i));
        for a in m.adj(i) {
            if !in_region[a.other] {
                let row = m.row(i, a, st.x[a.other]);
                for (u, r) in unary.iter_mut().zip(row) {
                    *u += r;
                }
            }
        }
        let mut one = Vec::with_capacity(m.k[i]);
        for (s, &c) in unary.iter().enumerate() {
            let v = mip.vars.len();
            let current = st.x[i] == s;
            if c >= INFINITE_COST && !current {
                mip.vars.push(VarKind::Continuous { lo: 0.0, hi: 0.0 });
            } else {
                mip.vars.push(VarKind::Binary);
                if c != 0.0 {
                    mip.objective.push((v, c));
                }
            }
            init.push(if current { 1.0 } else { 0.0 });
            one.push((v, 1.0));
        }
        mip.constraints.push(Constraint { terms: one, lo: 1.0, hi: 1.0 });
    }
    // Edges inside the region: each once, from its larger endpoint (whose adjacency to the
    // smaller one holds the matrix oriented [s_small][s_large]).
    let index: std::collections::HashMap<usize, usize> = region.iter().enumerate().map(|(p, &i)| (i, p)).collect();
    for (pv, &v) in region.iter().enumerate() {
        for a in m.adj(v) {
            let u = a.other;
            if u > v || !in_region[u] {
                continue;
            }
            let Some(&pu) = index.get(&u) else { continue };
            let (ku, kv) = (m.k[u], m.k[v]);
            let mut rows: Vec<Vec<(usize, f64)>> = vec![Vec::new(); ku];
            let mut cols: Vec<Vec<(usize, f64)>> = vec![Vec::new(); kv];
            for su in 0..ku {
                for sv in 0..kv {
                    let c = m.mats[a.mat + su * kv + sv];
                    let current = st.x[u] == su && st.x[v] == sv;
                    if c >= INFINITE_COST && !current {
                        continue;
                    }
                    let var = mip.vars.len();
                    mip.vars.push(VarKind::Continuous { lo: 0.0, hi: 1.0 });
                    if c != 0.0 {
                        mip.objective.push((var, c));
                    }
                    init.push(if current { 1.0 } else { 0.0 });
                    rows[su].push((var, 1.0));
                    cols[sv].push((var, 1.0));
                }
            }
            for (su, mut terms) in rows.into_iter().enumerate() {
                terms.push((x_start[pu] + su, -1.0));
                mip.constraints.push(Constraint { terms, lo: 0.0, hi: 0.0 });
            }
            for (sv, mut terms) in cols.into_iter().enumerate() {
                terms.push((x_start[pv] + sv, -1.0));
                mip.constraints.push(Constraint { terms, lo: 0.0, hi: 0.0 });
            }
        }
    }
    // Memory rows over the segments where the set of live region pieces is constant (pending:
    // added when a solution breaks them).
    let mut pending: Vec<Constraint> = Vec::new();
    let mut bounds: Vec<usize> = Vec::new();
    // Pieces of region nodes whose usage depends on the strategy: (position in region, piece).
    let mut mem_pieces = Vec::new();
    for (p, &i) in region.iter().enumerate() {
        for pc in m.pieces(i) {
            let us = m.piece_usages(i, pc);
            if us.iter().any(|&u| u != us[0]) {
                bounds.push(pc.l);
                bounds.push(pc.r);
                mem_pieces.push((p, *pc));
            }
        }
    }
    bounds.sort_unstable();
    bounds.dedup();
    for w in bounds.windows(2) {
        let (p, q) = (w[0], w[1]);
        let mut fixed_here = st.usage_max(p, q);
        let mut terms = Vec::new();
        let mut worst = 0i64;
        for &(pi, pc) in &mem_pieces {
            if !(pc.l <= p && p < pc.r) {
                continue;
            }
            let i = region[pi];
            let us = m.piece_usages(i, &pc);
            let lo = us.iter().copied().min().unwrap_or(0);
            let hi = us.iter().copied().max().unwrap_or(0);
            fixed_here -= us[st.x[i]] - lo;
            worst += hi - lo;
            for (s, &u) in us.iter().enumerate() {
                if u > lo {
                    terms.push((x_start[pi] + s, (u - lo) as f64));
                }
            }
        }
        let rhs = m.limit - fixed_here;
        if worst <= rhs || terms.is_empty() {
            continue;
        }
        pending.push(crate::ilp::memory_row(terms, rhs));
    }
    // The MIP objective leaves out what the fixed nodes cost on their own.
    let init_obj: f64 = mip.objective.iter().map(|&(v, c)| c * init[v]).sum();
    let constant = st.cost - init_obj;
    mip.initial = Some(init);
    // A model CBC cannot get through in the time given would overrun it: not started (the
    // search shrinks its next regions).
    if time_limit < crate::ilp::TIME_PER_VAR * mip.vars.len().min(u32::MAX as usize) as u32 {
        return Ok(RegionOutcome { optimal: false, bound: f64::NEG_INFINITY });
    }
    let started = std::time::Instant::now();
    loop {
        let left = time_limit.saturating_sub(started.elapsed());
        let out = backend.solve(&mip, left.max(Duration::from_millis(1)))?;
        let bound = if out.bound.is_finite() { out.bound + constant } else { f64::NEG_INFINITY };
        let Some(values) = out.values.filter(|_| out.status != MipStatus::Infeasible) else {
            return Ok(RegionOutcome { optimal: false, bound });
        };
        // Memory rows this solution breaks join the model.
        let broken = |c: &Constraint| {
            let lhs: f64 = c.terms.iter().map(|&(v, a)| a * values[v]).sum();
            lhs > c.hi + 1e-6 * c.hi.abs().max(1.0)
        };
        let (add, keep): (Vec<Constraint>, Vec<Constraint>) = pending.into_iter().partition(broken);
        pending = keep;
        if !add.is_empty() {
            if tracing::enabled!(tracing::Level::DEBUG) {
                tracing::debug!(
                    "region {} nodes: {} memory rows broken, {} pending",
                    region.len(),
                    add.len(),
                    pending.len()
                );
            }
            mip.constraints.extend(add);
            if started.elapsed() >= time_limit {
                return Ok(RegionOutcome { optimal: false, bound });
            }
            continue;
        }
        let before = st.cost;
        let old: Vec<usize> = region.iter().map(|&i| st.x[i]).collect();
        for (p, &i) in region.iter().enumerate() {
            let xs = &values[x_start[p]..x_start[p] + m.k[i]];
            // CBC occasionally returns column values that break the one-hot rows (all zeros): such
            // a node keeps its strategy.
            if let Some(s) = (0..m.k[i]).find(|&s| xs[s] > 0.5) {
                st.set(i, s);
            }
        }
        let tol = 1e-9 * before.abs().max(1.0);
        if tracing::enabled!(tracing::Level::DEBUG) {
            let obj: f64 = mip.objective.iter().map(|&(v, c)| c * values[v]).sum();
            tracing::debug!(
                "region {} nodes (mip objective at values {obj} + {constant}): {:?} bound {:.0} cost {before:.0} -> {:.0} feasible {}",
                region.len(),
                out.status,
                out.bound,
                st.cost,
                st.feasible()
            );
        }
        if st.feasible() && st.cost <= before + tol {
            return Ok(RegionOutcome { optimal: out.status == MipStatus::Optimal, bound });
        }
        for (p, &i) in region.iter().enumerate() {
            st.set(i, old[p]);
        }
        return Ok(RegionOutcome { optimal: out.status == MipStatus::Optimal, bound });
    }
}
