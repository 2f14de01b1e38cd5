//! The exact integer program and the MIP back ends behind [`MipBackend`].
//!
//! Formulation (Alpa's): a binary `x[i][s]` per node strategy with `sum_s x[i][s] = 1`; a
//! continuous `y[e][a][b] in [0, 1]` per edge entry with `sum_b y[e][a][b] = x[u][a]` and
//! `sum_a y[e][a][b] = x[v][b]`, which forces `y` to the product of the one-hot rows; objective
//! `sum c x + sum E y`; and at every maximal time step where the limit could be exceeded,
//! `sum usage * x <= limit` over the live nodes whose usage depends on their strategy (the others
//! move to the right-hand side). Entries at or above [`INFINITE_COST`] are fixed to zero instead
//! of entering the objective, which keeps the LP numerically sane.

use std::time::Duration;

use good_lp::solvers::coin_cbc::coin_cbc;
use good_lp::{
    Expression, ProblemVariables, ResolutionError, Solution, SolverModel, Variable, WithInitialSolution, WithTimeLimit,
    variable,
};

use crate::error::{Error, Result};
use crate::model::Model;

/// Costs at or above this are treated as forbidden by the ILP (IOPDDL uses 10^18).
pub const INFINITE_COST: f64 = 1e17;

/// A variable of a [`Mip`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum VarKind {
    /// 0 or 1.
    Binary,
    /// A real number within bounds.
    Continuous {
        /// Lower bound.
        lo: f64,
        /// Upper bound.
        hi: f64,
    },
}

/// A linear constraint `lo <= sum coef * var <= hi`.
#[derive(Clone, Debug, PartialEq)]
pub struct Constraint {
    /// `(variable index, coefficient)` terms.
    pub terms: Vec<(usize, f64)>,
    /// Lower bound (`f64::NEG_INFINITY` for none).
    pub lo: f64,
    /// Upper bound (`f64::INFINITY` for none).
    pub hi: f64,
}

/// A mixed-integer program to minimise, independent of any back end.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Mip {
    /// Variables.
    pub vars: Vec<VarKind>,
    /// Objective terms (minimised).
    pub objective: Vec<(usize, f64)>,
    /// Constraints.
    pub constraints: Vec<Constraint>,
    /// A feasible starting point for the back end, if known.
    pub initial: Option<Vec<f64>>,
}

/// Termination of a MIP solve.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MipStatus {
    /// Proven optimal.
    Optimal,
    /// The time limit was reached; `values` may hold an incumbent.
    TimeLimit,
    /// Proven infeasible.
    Infeasible,
}

/// What a back end returns.
#[derive(Clone, Debug, PartialEq)]
pub struct MipOutcome {
    /// How it ended.
    pub status: MipStatus,
    /// Variable values of the best solution, if one was found.
    pub values: Option<Vec<f64>>,
    /// Best proven lower bound on the objective (`-inf` if unknown).
    pub bound: f64,
}

/// A MIP solver.
pub trait MipBackend: Send + Sync {
    /// Short name for messages.
    fn name(&self) -> &'static str;
    /// Minimises `mip` within `time_limit`.
    fn solve(&self, mip: &Mip, time_limit: Duration) -> Result<MipOutcome>;
}

/// Serialises every use of CBC in the process (see [`Cbc`]'s `solve`).
static CBC_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Roughly what CBC needs per variable to get through the root of a model given a starting point
/// (measured: 17 µs and 32 µs on planning problems of 228k and 117k variables on a 2-core
/// machine). CBC checks its clock between branch-and-bound nodes, not inside the root LP, so a
/// model it cannot get through in its time limit overruns it several times over: callers don't
/// start one with less time than this per variable.
pub(crate) const TIME_PER_VAR: Duration = Duration::from_micros(10);

/// COIN-OR CBC through good_lp.
#[derive(Clone, Copy, Debug, Default)]
pub struct Cbc {
    /// Turn CBC's (Cgl) preprocessing off. Debian's CBC 2.10 can crash in
    /// `CglPreProcess::postProcess` on small, nearly-solved models with a starting point, which
    /// is what large-neighbourhood search produces.
    pub no_preprocess: bool,
    /// With `Some(gap)`: no cut generation and no heuristics, and stop within this relative gap.
    /// For models given a near-optimal starting point, whose root LP bound usually settles them
    /// (on tied transformer problems it halves CBC's time); not for hard instances.
    pub quick: Option<f64>,
}

impl MipBackend for Cbc {
    fn name(&self) -> &'static str {
        "cbc"
    }

    /// Runs CBC on its own thread and waits at most the time limit plus a grace of
    /// max(10%, 0.1 s). CBC checks its clock between branch-and-bound nodes, not inside the
    /// root LP, so a model whose root it cannot get through overruns its limit several times
    /// over; such a solve is abandoned (it finishes in the background, holding the lock that
    /// serialises CBC) and reported as a time limit without a solution, so that the planner's
    /// `--time-limit` holds.
    fn solve(&self, mip: &Mip, time_limit: Duration) -> Result<MipOutcome> {
        let (tx, rx) = std::sync::mpsc::channel();
        let (cbc, mip) = (*self, mip.clone());
        let started = std::time::Instant::now();
        std::thread::Builder::new()
            .name("cbc".into())
            .spawn(move || {
                // The receiver may have given up: the result is then dropped.
                let _ = tx.send(cbc.solve_here(&mip, time_limit, started));
            })
            .map_err(|e| Error::Backend { backend: "cbc", message: format!("cannot start its thread: {e}") })?;
        let grace = (time_limit / 10).max(Duration::from_millis(100));
        match rx.recv_timeout(time_limit + grace) {
            Ok(out) => out,
            Err(_) => {
                tracing::debug!("cbc: abandoned after {:?} (limit {time_limit:?})", started.elapsed());
                Ok(MipOutcome { status: MipStatus::TimeLimit, values: None, bound: f64::NEG_INFINITY })
            }
        }
    }
}

impl Cbc {
    /// [`MipBackend::solve`] on the calling thread; the limit counts from `started`.
    fn solve_here(&self, mip: &Mip, time_limit: Duration, started: std::time::Instant) -> Result<MipOutcome> {
        // CBC's solve entry point (`Cbc_solve` -> `CbcMain1`) parses its parameters through
        // process-wide static state, so two solves running at once in one process corrupt each
        // other's settings (time limit, presolve, log level...) and can return wrong column values.
        // good_lp only locks when its `singlethread-cbc` feature is on: serialise here, for the
        // model's whole life (creation, solve, reading values, deletion).
        let waiting = started;
        let _guard = CBC_LOCK.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // Time spent waiting for another solve (or an abandoned one) counts against this one's
        // limit.
        let time_limit = time_limit.saturating_sub(waiting.elapsed());
        let mut pv = ProblemVariables::new();
        let vars: Vec<Variable> = mip
            .vars
            .iter()
            .map(|k| match *k {
                VarKind::Binary => pv.add(variable().binary()),
                VarKind::Continuous { lo, hi } => pv.add(variable().min(lo).max(hi)),
            })
            .collect();
        let mut objective = Expression::with_capacity(mip.objective.len());
        for &(v, c) in &mip.objective {
            objective.add_mul(c, vars[v]);
        }
        let mut model = pv.minimise(objective).using(coin_cbc).with_time_limit(time_limit.as_secs_f64().max(0.01));
        model.set_parameter("logLevel", "0");
        // Count wall-clock time: CPU time runs slow on a loaded machine and overshoots.
        model.set_parameter("timeMode", "elapsed");
        if self.no_preprocess {
            model.set_parameter("preprocess", "off");
            // With a starting point, a problem solved in presolve can come back without its
            // column values: keep presolve off too.
            model.set_parameter("presolve", "off");
        }
        if let Some(gap) = self.quick {
            model.set_parameter("cuts", "off");
            model.set_parameter("heuristics", "off");
            model.set_parameter("ratioGap", &gap.to_string());
        }
        if let Some(init) = &mip.initial {
            model = model.with_initial_solution(vars.iter().copied().zip(init.iter().copied()));
        }
        for c in &mip.constraints {
            let mut e = Expression::with_capacity(c.terms.len());
            for &(v, coef) in &c.terms {
                e.add_mul(coef, vars[v]);
            }
            if c.lo == c.hi {
                model.add_constraint(e.eq(c.lo));
            } else {
                if c.hi.is_finite() {
                    model.add_constraint(e.clone().leq(c.hi));
                }
                if c.lo.is_finite() {
                    model.add_constraint(e.geq(c.lo));
                }
            }
        }
        let t_build = waiting.elapsed();
        let solved = model.solve();
        if tracing::enabled!(tracing::Level::DEBUG) {
            tracing::debug!(
                "cbc: {} vars {} rows {} nonzeros, built in {:?}, solved in {:?} (limit {:?})",
                mip.vars.len(),
                mip.constraints.len(),
                mip.constraints.iter().map(|c| c.terms.len()).sum::<usize>(),
                t_build,
                waiting.elapsed() - t_build,
                time_limit
            );
        }
        match solved {
            Ok(sol) => {
                let status = match sol.status() {
                    good_lp::SolutionStatus::Optimal => MipStatus::Optimal,
                    _ => MipStatus::TimeLimit,
                };
                let bound = sol.model().best_possible_value();
                let values: Vec<f64> = vars.iter().map(|&v| sol.value(v)).collect();
                Ok(MipOutcome { status, values: Some(values), bound })
            }
            Err(ResolutionError::Infeasible) => {
                Ok(MipOutcome { status: MipStatus::Infeasible, values: None, bound: f64::INFINITY })
            }
            Err(e) => Err(Error::Backend { backend: "cbc", message: e.to_string() }),
        }
    }
}

/// The ILP of a compiled problem, with the index of each node's first `x` variable.
pub(crate) struct Formulation {
    pub mip: Mip,
    pub x_start: Vec<usize>,
}

/// Number of variables the formulation would have (to decide whether the ILP is worth trying).
pub(crate) fn size(m: &Model) -> usize {
    let edge_vars: usize = m
        .edges
        .iter()
        .map(|e| m.mats[e.mat..e.mat + m.k[e.u] * m.k[e.v]].iter().filter(|&&c| c < INFINITE_COST).count())
        .sum();
    m.cost.len() + edge_vars
}

pub(crate) fn formulate(m: &Model) -> Formulation {
    let mut mip = Mip::default();
    let mut x_start = Vec::with_capacity(m.n);
    for i in 0..m.n {
        x_start.push(mip.vars.len());
        let cs = m.costs(i);
        let all_inf = cs.iter().all(|&c| c >= INFINITE_COST);
        let mut one = Vec::with_capacity(m.k[i]);
        for &c in cs {
            let v = mip.vars.len();
            if c >= INFINITE_COST && !all_inf {
                mip.vars.push(VarKind::Continuous { lo: 0.0, hi: 0.0 });
            } else {
                mip.vars.push(VarKind::Binary);
                if c != 0.0 {
                    mip.objective.push((v, c.min(INFINITE_COST)));
                }
            }
            one.push((v, 1.0));
        }
        mip.constraints.push(Constraint { terms: one, lo: 1.0, hi: 1.0 });
    }
    for e in &m.edges {
        let (ku, kv) = (m.k[e.u], m.k[e.v]);
        // Forbidden entries get no variable at all: the marginal rows then exclude them.
        let mut rows: Vec<Vec<(usize, f64)>> = vec![Vec::new(); ku];
        let mut cols: Vec<Vec<(usize, f64)>> = vec![Vec::new(); kv];
        for a in 0..ku {
            for b in 0..kv {
                let c = m.mats[e.mat + a * kv + b];
                if c >= INFINITE_COST {
                    continue;
                }
                let v = mip.vars.len();
                mip.vars.push(VarKind::Continuous { lo: 0.0, hi: 1.0 });
                if c != 0.0 {
                    mip.objective.push((v, c));
                }
                rows[a].push((v, 1.0));
                cols[b].push((v, 1.0));
            }
        }
        for (a, mut terms) in rows.into_iter().enumerate() {
            terms.push((x_start[e.u] + a, -1.0));
            mip.constraints.push(Constraint { terms, lo: 0.0, hi: 0.0 });
        }
        for (b, mut terms) in cols.into_iter().enumerate() {
            terms.push((x_start[e.v] + b, -1.0));
            mip.constraints.push(Constraint { terms, lo: 0.0, hi: 0.0 });
        }
    }
    // Memory: constant part and worst case per step, over every node's pieces.
    let t = m.nsteps();
    let mut base = vec![0i64; t + 1];
    let mut worst = vec![0i64; t + 1];
    // Pieces whose usage depends on the strategy: (node, piece, smallest usage).
    let mut varying = Vec::new();
    for i in 0..m.n {
        for p in m.pieces(i) {
            let us = m.piece_usages(i, p);
            let lo = us.iter().copied().min().unwrap_or(0);
            let hi = us.iter().copied().max().unwrap_or(0);
            base[p.l] += lo;
            base[p.r] -= lo;
            worst[p.l] += hi;
            worst[p.r] -= hi;
            if hi > lo {
                varying.push((i, *p, lo));
            }
        }
    }
    let (mut cb, mut cw) = (0i64, 0i64);
    for step in 0..t {
        cb += base[step];
        cw += worst[step];
        if cw <= m.limit {
            continue;
        }
        let mut terms = Vec::new();
        // A node's pieces are disjoint: at most one of them covers the step.
        for &(i, p, lo) in &varying {
            if p.l <= step && step < p.r {
                for (s, &u) in m.piece_usages(i, &p).iter().enumerate() {
                    if u > lo {
                        terms.push((x_start[i] + s, (u - lo) as f64));
                    }
                }
            }
        }
        mip.constraints.push(memory_row(terms, m.limit - cb));
    }
    Formulation { mip, x_start }
}

/// The memory row `sum terms <= rhs` (bytes) in units of its largest coefficient: rows in bytes
/// (coefficients up to 1e11, right-hand sides beyond) beside costs of order one stalled CBC's
/// LPs far past its time limit (a 4,055-variable region of a 96-layer GPT: 128 s against a 16 s
/// limit; scaled, 61 ms and the same plan).
pub(crate) fn memory_row(mut terms: Vec<(usize, f64)>, rhs: i64) -> Constraint {
    let unit = terms.iter().map(|t| t.1).fold(1.0, f64::max);
    terms.iter_mut().for_each(|t| t.1 /= unit);
    Constraint { terms, lo: f64::NEG_INFINITY, hi: rhs as f64 / unit }
}

/// Reads the chosen strategies back from MIP values (the largest `x` per node).
pub(crate) fn extract(m: &Model, f: &Formulation, values: &[f64]) -> Vec<usize> {
    (0..m.n)
        .map(|i| {
            let xs = &values[f.x_start[i]..f.x_start[i] + m.k[i]];
            (0..m.k[i]).max_by(|&a, &b| xs[a].total_cmp(&xs[b])).unwrap_or(0)
        })
        .collect()
}
