//! The top-level solver: reductions, then the exact ILP or the parallel anytime search.

use std::time::{Duration, Instant};

use crate::bound::edge_charged_bound;
use crate::error::{Error, Result};
use crate::eval::Evaluation;
use crate::ilp::{self, Cbc, MipBackend, MipStatus};
use crate::model::Model;
use crate::problem::Problem;
use crate::reduce::{self, ReductionStats};
use crate::search;

/// Which algorithm [`solve`] uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Method {
    /// The ILP when the reduced problem is small enough, then the search with what time is left.
    #[default]
    Auto,
    /// Only the ILP (falls back to the search only if the ILP finds no solution in time).
    Ilp,
    /// Only the heuristic search.
    Search,
}

/// Options of [`solve`].
#[derive(Clone, Debug)]
pub struct SolveOptions {
    /// Wall-clock budget for the whole solve.
    pub time_limit: Duration,
    /// Search threads (independent runs with different seeds; the best wins).
    pub threads: usize,
    /// Seed of the first search thread (thread `t` uses `seed + t`).
    pub seed: u64,
    /// Algorithm.
    pub method: Method,
    /// Apply the optimum-preserving reductions first.
    pub reduce: bool,
    /// `Auto` tries the ILP when it has at most this many variables.
    pub ilp_max_vars: usize,
    /// Let one search thread re-optimise regions with the ILP (large-neighbourhood search).
    pub lns: bool,
    /// Stop once the best cost is within this relative gap of a proven lower bound
    /// (`cost - bound <= gap * cost`; 0 = only at a proven optimum or the time limit).
    pub gap: f64,
}

impl Default for SolveOptions {
    fn default() -> Self {
        SolveOptions {
            time_limit: Duration::from_secs(60),
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            seed: 0,
            method: Method::Auto,
            reduce: true,
            ilp_max_vars: 300_000,
            lns: true,
            gap: 0.0,
        }
    }
}

/// How a solve ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Status {
    /// The solution is proven optimal (ILP, or the cost meets the lower bound).
    Optimal,
    /// The budget was reached: the solution is the best found, with a lower bound and gap.
    TimeLimit,
    /// Stopped with the cost within [`SolveOptions::gap`] of the lower bound.
    WithinGap,
}

/// The result of [`solve`]: always a feasible solution of the original problem.
#[derive(Clone, Debug)]
pub struct SolveResult {
    /// One strategy index per node.
    pub solution: Vec<usize>,
    /// Exact cost of `solution`.
    pub cost: u128,
    /// A lower bound on the optimal cost.
    pub lower_bound: u128,
    /// Optimal or time limit.
    pub status: Status,
    /// Exact evaluation of `solution` (peak usage and where).
    pub evaluation: Evaluation,
    /// The method that found `solution` (`"ilp"` or `"search"`).
    pub method: &'static str,
    /// Wall-clock time.
    pub elapsed: Duration,
    /// What the reductions removed.
    pub reduction: ReductionStats,
}

impl SolveResult {
    /// Relative gap `(cost - bound) / cost` (0 when optimal or cost is 0).
    pub fn gap(&self) -> f64 {
        if self.cost == 0 { 0.0 } else { (self.cost.saturating_sub(self.lower_bound)) as f64 / self.cost as f64 }
    }
}

/// CBC spends its first tens of milliseconds building the model whatever its time limit: below
/// this much time left, the ILP is not started.
const MIN_ILP_TIME: Duration = Duration::from_millis(50);

/// Solves `problem` within `opts.time_limit`.
///
/// Errors: [`Error::Infeasible`] when no solution fits the usage limit (with the minimum peak and
/// where it occurs); [`Error::InvalidProblem`] for an inconsistent problem.
pub fn solve(problem: &Problem, opts: &SolveOptions) -> Result<SolveResult> {
    let start = Instant::now();
    // Keep a little time for expanding and checking the solution on the original problem.
    let deadline = start + opts.time_limit.saturating_sub((opts.time_limit / 50).min(Duration::from_secs(1)));
    problem.validate()?;
    if let Some(limit) = problem.usage_limit {
        let (min_peak, time) = problem.min_peak_usage();
        if min_peak > limit as u128 {
            return Err(Error::Infeasible { min_peak, time, limit });
        }
    }
    let t = Instant::now();
    // With no time left (a solve that must still give a solution), the reductions are skipped:
    // on a large problem they take longer than the one round of search that follows.
    let red =
        if opts.reduce && !opts.time_limit.is_zero() { reduce::reduce(problem) } else { reduce::identity(problem) };
    let t_reduce = t.elapsed();
    let m = Model::new(&red.problem);
    let t_model = t.elapsed();
    let mut bound = edge_charged_bound(&m);
    tracing::debug!(
        "min peak {:?}, reduce {t_reduce:?}, model {:?}, bound {:?}",
        t - start,
        t_model - t_reduce,
        t.elapsed() - t_model
    );
    let ilp_size = ilp::size(&m);
    if tracing::enabled!(tracing::Level::DEBUG) {
        tracing::debug!("reduced and compiled in {:?}: {} steps, ilp size {ilp_size}", start.elapsed(), m.nsteps());
    }
    let mut candidates: Vec<(Vec<usize>, &'static str)> = Vec::new();
    let mut proven = false;
    // A candidate is within the requested gap of the bound: nothing more to search.
    let mut settled = false;

    let try_ilp = match opts.method {
        Method::Ilp => true,
        Method::Search => false,
        Method::Auto => ilp_size <= opts.ilp_max_vars,
    };
    if try_ilp && opts.method == Method::Auto {
        // A quick search gives CBC a starting point (it may find none on its own in time),
        // then the whole problem is one "region" of the ILP.
        let left = deadline.saturating_duration_since(Instant::now());
        let quick = Instant::now() + (left / 10).min(Duration::from_secs(3));
        let quick = run_search(&m, opts, quick, &mut bound, None);
        let close = |c: f64| opts.gap > 0.0 && c - bound <= opts.gap * c.abs();
        // CBC checks its clock between branch-and-bound nodes, not inside the root LP: a model
        // it cannot get through in the time left would overrun the limit several times over.
        let left = deadline.saturating_duration_since(Instant::now());
        let short = left < MIN_ILP_TIME || left < ilp::TIME_PER_VAR * ilp_size.min(u32::MAX as usize) as u32;
        if let Some((x0, c0)) = quick.as_ref().filter(|q| close(q.1) || short) {
            // Within the gap already (no ILP needed), or no time left for one.
            settled = close(*c0);
            candidates.push((x0.clone(), "search"));
        } else if let Some((x0, _)) = quick {
            let budget = deadline.saturating_duration_since(Instant::now()).mul_f64(0.85);
            let mut st = search::State::new(&m, x0);
            let region: Vec<usize> = (0..m.n).filter(|&i| m.k[i] >= 2).collect();
            let in_region: Vec<bool> = (0..m.n).map(|i| m.k[i] >= 2).collect();
            if tracing::enabled!(tracing::Level::DEBUG) {
                tracing::debug!("ilp from a search start, budget {budget:?}");
            }
            // With a gap to stop at (planning), the start is usually near-optimal: a quick CBC.
            let cbc = Cbc { no_preprocess: true, quick: (opts.gap > 0.0).then_some(opts.gap) };
            let out = crate::lns::solve_region(&m, &mut st, &region, &in_region, &cbc, budget)?;
            if out.bound.is_finite() {
                bound = bound.max(out.bound);
            }
            proven = out.optimal;
            candidates.push((st.x.clone(), "ilp"));
        }
    } else if try_ilp {
        let budget = match opts.method {
            Method::Ilp => deadline.saturating_duration_since(Instant::now()),
            // The ILP is far stronger than the search when it fits: give it most of the time,
            // keeping some for the search in case CBC stops without a solution.
            _ => deadline.saturating_duration_since(Instant::now()).mul_f64(0.85),
        };
        let f = ilp::formulate(&m);
        if tracing::enabled!(tracing::Level::DEBUG) {
            tracing::debug!(
                "ilp: {} variables, {} constraints, budget {budget:?}",
                f.mip.vars.len(),
                f.mip.constraints.len()
            );
        }
        let out = Cbc::default().solve(&f.mip, budget)?;
        match out.status {
            MipStatus::Infeasible => {}
            status => {
                if out.bound.is_finite() {
                    bound = bound.max(out.bound);
                }
                if let Some(values) = &out.values {
                    let x = ilp::extract(&m, &f, values);
                    // CBC may return a non-solution on time limit; only keep checked ones.
                    if red.problem.evaluate(&x).is_ok_and(|e| e.feasible()) {
                        proven = status == MipStatus::Optimal;
                        candidates.push((x, "ilp"));
                    }
                }
            }
        }
    }
    let need_search = !proven && !settled && (opts.method != Method::Ilp || candidates.is_empty());
    if need_search {
        let small_graph = (0..m.n).filter(|&i| m.k[i] >= 2).count() <= 5000;
        let restricted = opts.method == Method::Auto && opts.lns && small_graph && !try_ilp;
        // With a restricted ILP in the middle: search 30%, ILP up to 40%, search the rest.
        let first_deadline = if restricted {
            Instant::now() + deadline.saturating_duration_since(Instant::now()).mul_f64(0.3)
        } else {
            deadline
        };
        // Start from the ILP's incumbent when it stopped on time without a proof.
        let ilp_start = candidates.first().map(|c| c.0.clone());
        let mut incumbent = run_search(&m, opts, first_deadline, &mut bound, ilp_start);
        if restricted && let Some((x, _)) = &incumbent {
            let left = deadline.saturating_duration_since(Instant::now());
            let until = Instant::now() + left.mul_f64(0.6);
            let mut cur = x.clone();
            // Rounds: each re-selects strategies around the new incumbent.
            let mut round = 0;
            loop {
                let left = until.saturating_duration_since(Instant::now());
                if left < Duration::from_secs(1) {
                    break;
                }
                let budget = left.min(Duration::from_secs(20));
                let Some(y) = restricted_ilp(&red.problem, &m, &cur, budget, round) else {
                    break;
                };
                round += 1;
                if m.total_cost(&y) < m.total_cost(&cur) {
                    cur = y;
                } else if round > 3 {
                    break;
                }
            }
            if m.total_cost(&cur) < m.total_cost(x) {
                candidates.push((cur.clone(), "restricted ilp"));
                incumbent = Some((cur, 0.0));
            }
            let start = incumbent.as_ref().map(|b| b.0.clone());
            if let Some(x) = &incumbent {
                candidates.push((x.0.clone(), "search"));
            }
            incumbent = run_search(&m, opts, deadline, &mut bound, start);
        }
        if let Some((x, _)) = incumbent {
            candidates.push((x, "search"));
        }
    }
    if candidates.is_empty() && !proven {
        // No search found a solution that fits (greedy repair can fail when nodes have several
        // live intervals): the exact ILP decides, with at least a second.
        let f = ilp::formulate(&m);
        let budget = deadline.saturating_duration_since(Instant::now()).max(Duration::from_secs(1));
        let out = Cbc::default().solve(&f.mip, budget)?;
        if let Some(values) = out.values.filter(|_| out.status != MipStatus::Infeasible) {
            let x = ilp::extract(&m, &f, &values);
            if red.problem.evaluate(&x).is_ok_and(|e| e.feasible()) {
                proven = out.status == MipStatus::Optimal;
                candidates.push((x, "ilp"));
            }
        }
    }
    // Exact evaluation on the original problem; keep the cheapest feasible.
    let mut best: Option<(Vec<usize>, Evaluation, &'static str)> = None;
    for (x, method) in candidates {
        let full = red.expand(&x);
        let ev = problem.evaluate(&full)?;
        if !ev.feasible() {
            return Err(Error::Internal(format!(
                "{method} returned a solution over the usage limit at time {:?}",
                ev.first_violation
            )));
        }
        if best.as_ref().is_none_or(|b| ev.cost < b.1.cost) {
            best = Some((full, ev, method));
        }
    }
    let Some((solution, evaluation, method)) = best else {
        return Err(Error::Internal("no feasible solution found although the minimum peak fits the limit".into()));
    };
    let lower_bound = if proven { evaluation.cost } else { (bound.max(0.0).floor() as u128).min(evaluation.cost) };
    let within = |cost: u128| opts.gap > 0.0 && (cost - lower_bound) as f64 <= opts.gap * cost as f64;
    let status = if proven || lower_bound == evaluation.cost {
        Status::Optimal
    } else if within(evaluation.cost) {
        Status::WithinGap
    } else {
        Status::TimeLimit
    };
    Ok(SolveResult {
        cost: evaluation.cost,
        solution,
        lower_bound,
        status,
        evaluation,
        method,
        elapsed: start.elapsed(),
        reduction: red.stats,
    })
}

/// Runs the search threads until `deadline` (thread 0 also does ILP large-neighbourhood search);
/// all threads start from `start` when given. `bound` (a lower bound, where the search may stop)
/// is raised to the Lagrangian bounds the search proves.
fn run_search(
    m: &Model,
    opts: &SolveOptions,
    deadline: Instant,
    bound: &mut f64,
    start: Option<Vec<usize>>,
) -> Option<(Vec<usize>, f64)> {
    let target = *bound;
    let threads = opts.threads.max(1);
    let shared = std::sync::Mutex::new(None);
    let lagrangian = std::sync::Mutex::new(f64::NEG_INFINITY);
    let cbc = Cbc { no_preprocess: true, quick: None };
    let results: Vec<Option<(Vec<usize>, f64)>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let shared = &shared;
                let lagrangian = &lagrangian;
                let cbc = &cbc;
                let start = start.clone();
                let cfg = search::SearchConfig {
                    deadline,
                    seed: opts.seed.wrapping_add(t as u64),
                    target,
                    gap: opts.gap,
                    // CBC runs one solve at a time per process: one LNS thread.
                    lns: (t == 0 && opts.lns).then_some(cbc as &dyn MipBackend),
                    shared,
                    start,
                    bound: lagrangian,
                };
                scope.spawn(move || search::run(m, &cfg))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or(None)).collect()
    });
    if let Ok(b) = lagrangian.lock() {
        *bound = bound.max(*b);
    }
    results.into_iter().flatten().min_by(|a, b| a.1.total_cmp(&b.1))
}

/// The ILP restricted to a few promising strategies per node (the incumbent's, the smallest
/// usage, and the best by node cost plus cheapest edges), solved from the incumbent: a
/// heuristic, since the pruned strategies are not proven useless.
fn restricted_ilp(p: &Problem, m: &Model, x: &[usize], time_limit: Duration, round: usize) -> Option<Vec<usize>> {
    let budget_vars = 250_000usize;
    // Best responses to the incumbent's neighbours.
    let local: Vec<Vec<f64>> = (0..m.n)
        .map(|i| {
            let mut v = m.costs(i).to_vec();
            for a in m.adj(i) {
                for (o, r) in v.iter_mut().zip(m.row(i, a, x[a.other])) {
                    *o += r;
                }
            }
            v
        })
        .collect();
    let mut rng_state = (round as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let scores: Vec<Vec<f64>> = (0..m.n)
        .map(|i| {
            let ki = m.k[i];
            let mut sc = m.costs(i).to_vec();
            for a in m.adj(i) {
                let kj = m.k[a.other];
                for (s, v) in sc.iter_mut().enumerate() {
                    let mut mn = f64::INFINITY;
                    for so in 0..kj {
                        mn = mn.min(m.mats[a.mat + so * ki + s]);
                    }
                    *v += mn;
                }
            }
            sc
        })
        .collect();
    let mut per_node = 24usize;
    let keep = loop {
        let keep: Vec<Vec<usize>> = (0..m.n)
            .map(|i| {
                let ki = m.k[i];
                let us = m.usages(i);
                let mut by_score: Vec<usize> = (0..ki).collect();
                by_score.sort_by(|&a, &b| scores[i][a].total_cmp(&scores[i][b]));
                let mut by_local: Vec<usize> = (0..ki).collect();
                by_local.sort_by(|&a, &b| local[i][a].total_cmp(&local[i][b]));
                let mut k: Vec<usize> = vec![x[i]];
                if let Some(lo) = (0..ki).min_by_key(|&s| (us[s], scores[i][s] as i64)) {
                    k.push(lo);
                }
                let mut a = by_score.into_iter();
                let mut b = by_local.into_iter();
                while k.len() < per_node.min(ki) {
                    // Mostly best responses, some globally cheap strategies, a few random.
                    rng_state ^= rng_state << 13;
                    rng_state ^= rng_state >> 7;
                    rng_state ^= rng_state << 17;
                    let pick = match rng_state % 8 {
                        0..=3 => b.next(),
                        4..=6 => a.next(),
                        _ => Some((rng_state >> 8) as usize % ki),
                    };
                    if let Some(s) = pick {
                        if !k.contains(&s) {
                            k.push(s);
                        }
                    } else if a.len() == 0 && b.len() == 0 {
                        break;
                    }
                }
                k.sort_unstable();
                k.dedup();
                k
            })
            .collect();
        let vars: usize = keep.iter().map(Vec::len).sum::<usize>()
            + m.edges.iter().map(|e| keep[e.u].len() * keep[e.v].len()).sum::<usize>();
        if vars <= budget_vars || per_node <= 2 {
            break keep;
        }
        per_node = per_node * 3 / 4;
    };
    let sub = Problem {
        name: p.name.clone(),
        nodes: p.nodes.iter().zip(&keep).map(|(n, k)| n.restricted(k)).collect(),
        edges: p
            .edges
            .iter()
            .map(|e| {
                let (u, v) = e.nodes;
                let kv = p.nodes[v].strategies();
                crate::problem::Edge {
                    nodes: e.nodes,
                    costs: keep[u].iter().flat_map(|&a| keep[v].iter().map(move |&b| e.costs[a * kv + b])).collect(),
                }
            })
            .collect(),
        usage_limit: p.usage_limit,
    };
    let ms = Model::new(&sub);
    let xs: Vec<usize> = (0..m.n).map(|i| keep[i].iter().position(|&s| s == x[i]).unwrap_or(0)).collect();
    let mut st = search::State::new(&ms, xs);
    let region: Vec<usize> = (0..ms.n).filter(|&i| ms.k[i] >= 2).collect();
    let in_region: Vec<bool> = (0..ms.n).map(|i| ms.k[i] >= 2).collect();
    if tracing::enabled!(tracing::Level::DEBUG) {
        tracing::debug!(
            "restricted ilp: {per_node} strategies per node, {time_limit:?}, incumbent {} = {}",
            m.total_cost(x),
            st.cost
        );
    }
    let cbc = Cbc { no_preprocess: true, quick: None };
    crate::lns::solve_region(&ms, &mut st, &region, &in_region, &cbc, time_limit).ok()?;
    Some((0..m.n).map(|i| keep[i][st.x[i]]).collect())
}

/// Exhaustive search over all solutions (for tests and tiny problems): the cheapest feasible
/// solution and its cost, or `None` if none is feasible. Refuses more than 10^7 combinations.
pub fn brute_force(problem: &Problem) -> Result<Option<(Vec<usize>, u128)>> {
    problem.validate()?;
    let combos = problem.nodes.iter().try_fold(1u64, |acc, n| acc.checked_mul(n.strategies() as u64));
    if combos.is_none_or(|c| c > 10_000_000) {
        return Err(Error::InvalidProblem("too many combinations for brute force (more than 10^7)".into()));
    }
    let n = problem.nodes.len();
    let mut x = vec![0usize; n];
    let mut best: Option<(Vec<usize>, u128)> = None;
    loop {
        let ev = problem.evaluate(&x)?;
        if ev.feasible() && best.as_ref().is_none_or(|b| ev.cost < b.1) {
            best = Some((x.clone(), ev.cost));
        }
        // Odometer increment.
        let mut i = 0;
        loop {
            if i == n {
                return Ok(best);
            }
            x[i] += 1;
            if x[i] < problem.nodes[i].strategies() {
                break;
            }
            x[i] = 0;
            i += 1;
        }
    }
}
