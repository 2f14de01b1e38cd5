//! Exact evaluation of a solution with the IOPDDL semantics.
//!
//! Cost is the sum of the chosen node costs plus, for every edge `(u, v)`, the entry
//! `costs[s_u * |strategies(v)| + s_v]`. Usage at time `t` is the sum of the chosen usages of the
//! nodes with `start <= t < end` (over every live interval of a node that has several). Sums are
//! exact (`u128`), with no overflow for any input.

use crate::error::Result;
use crate::problem::Problem;

/// The outcome of evaluating a solution.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Evaluation {
    /// Total cost (node plus edge costs).
    pub cost: u128,
    /// Largest usage over all time steps (0 when no node is ever live).
    pub peak_usage: u128,
    /// First time step where `peak_usage` is reached.
    pub peak_time: u64,
    /// First time step where the usage exceeds the limit, if any.
    pub first_violation: Option<u64>,
}

impl Evaluation {
    /// True when the usage never exceeds the limit.
    pub fn feasible(&self) -> bool {
        self.first_violation.is_none()
    }
}

impl Problem {
    /// Evaluates `solution` (one strategy index per node). Errors only when the solution does not
    /// fit the problem; an over-limit solution is evaluated and reported with `first_violation`.
    pub fn evaluate(&self, solution: &[usize]) -> Result<Evaluation> {
        self.check_solution(solution)?;
        let mut cost: u128 = 0;
        for (node, &s) in self.nodes.iter().zip(solution) {
            cost += node.costs[s] as u128;
        }
        for edge in &self.edges {
            let (u, v) = edge.nodes;
            let kv = self.nodes[v].strategies();
            cost += edge.costs[solution[u] * kv + solution[v]] as u128;
        }
        let lives = self.nodes.iter().zip(solution).flat_map(|(n, &s)| n.lives().map(move |(iv, us)| (iv, us[s])));
        let (peak_usage, peak_time, first_violation) = usage_profile(lives, self.usage_limit);
        Ok(Evaluation { cost, peak_usage, peak_time, first_violation })
    }

    /// The smallest peak usage any solution can reach (every node at its smallest usage) and a
    /// time step where it is reached. For a node with several live intervals each interval
    /// counts at its own smallest usage: a lower bound, exact when one strategy is smallest in
    /// all of them.
    pub fn min_peak_usage(&self) -> (u128, u64) {
        let lives =
            self.nodes.iter().flat_map(|n| n.lives().map(|(iv, us)| (iv, us.iter().copied().min().unwrap_or(0))));
        let (peak, time, _) = usage_profile(lives, None);
        (peak, time)
    }
}

impl Problem {
    /// The largest peak usage any solution can reach (every interval at its largest usage; an
    /// upper bound, exact when one strategy is largest in all of a node's intervals). When it is
    /// within the limit, memory cannot bind.
    pub fn max_peak_usage(&self) -> u128 {
        let lives =
            self.nodes.iter().flat_map(|n| n.lives().map(|(iv, us)| (iv, us.iter().copied().max().unwrap_or(0))));
        usage_profile(lives, None).0
    }

    /// Whether some solution could exceed the usage limit.
    pub fn memory_may_bind(&self) -> bool {
        self.usage_limit.is_some_and(|l| self.max_peak_usage() > l as u128)
    }
}

/// Sweeps the `(interval, usage)` pairs: returns (peak, first time of peak, first time above
/// `limit`).
fn usage_profile(lives: impl Iterator<Item = ((u64, u64), u64)>, limit: Option<u64>) -> (u128, u64, Option<u64>) {
    // Events at interval starts (+usage) and ends (-usage); ends sort before starts at the same
    // time because intervals are half-open.
    let mut events: Vec<(u64, bool, u64)> = Vec::new();
    for ((s, e), u) in lives {
        if s < e && u > 0 {
            events.push((s, true, u));
            events.push((e, false, u));
        }
    }
    events.sort_unstable();
    let mut cur: u128 = 0;
    let mut peak: u128 = 0;
    let mut peak_time = 0;
    let mut violation = None;
    let mut i = 0;
    while i < events.len() {
        let t = events[i].0;
        while i < events.len() && events[i].0 == t {
            let (_, start, u) = events[i];
            if start {
                cur += u as u128;
            } else {
                cur -= u as u128;
            }
            i += 1;
        }
        if cur > peak {
            peak = cur;
            peak_time = t;
        }
        if violation.is_none() && limit.is_some_and(|l| cur > l as u128) {
            violation = Some(t);
        }
    }
    (peak, peak_time, violation)
}
