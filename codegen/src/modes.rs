//! One solve-and-lower run ([`plan_modes`]): the problem built, solved under each restriction
//! compared and each recomputation model asked for, every solution lowered, and the best that
//! fits kept; solved again with a tighter budget while none fits.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use ::plan::{AxisRole, Baseline, Plan, Recompute, SolveStatus, SolverInfo};
use ir::Graph;
use sharding::{DeviceMesh, DeviceProfile};

use crate::lower::{Recomputation, lower};
use crate::options::PlanOptions;
use crate::problem::{Built, FORBIDDEN};
use crate::solve::{Solved, canonical, infeasible, map_solution, solve_one, weigh_update_part};
use crate::{Error, Result, fmt_bytes};

/// The most solver rounds [`plan_modes`] runs, tightening the solver's budget while no plan fits.
const MAX_ROUNDS: usize = 4;

/// One restriction solved in [`plan_modes`]: a baseline (or the strategy asked for), and
/// whether its layouts are solved as if every layer were recomputed.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Entry {
    baseline: Baseline,
    assumed: bool,
}

impl Entry {
    fn name(&self) -> String {
        if self.assumed { format!("{}, recomputed", self.baseline.name()) } else { self.baseline.name() }
    }
}

/// Plans `graph` on `mesh` without stages or microbatches: builds the problem, solves it under
/// each recomputation model `opts.recompute` asks for (with `Auto`, as it is and, when memory
/// binds or `both`, as if every layer were recomputed: [`Built::assume_recompute`]) and each
/// restriction compared (`Auto` also solves the baselines), lowers every solution and keeps,
/// per model, the best that fits. Returns one plan per model that found one, with whether it
/// was solved as recomputed.
pub(crate) fn plan_modes(
    graph: &Graph,
    mesh: &DeviceMesh,
    profile: &DeviceProfile,
    opts: &PlanOptions,
    both: bool,
) -> Result<Vec<(bool, Plan)>> {
    let opts = &opts.started();
    let mut run = Run::new(graph, mesh, profile, opts, both)?;
    loop {
        run.rounds += 1;
        let round_start = Instant::now();
        run.cut = false;
        let round = run.round()?;
        let out = run.keep(round);
        if !out.is_empty() {
            return Ok(out);
        }
        if !run.tighten(round_start) {
            break;
        }
    }
    let min_peak = run.smallest.as_ref().map_or(run.floor, |(s, _, _)| *s);
    Err(infeasible(&run.main, &run.g, opts.budget, min_peak as u128, run.cut.then_some(run.floor)))
}

/// A run of [`plan_modes`]: the problems solved, the restrictions and models solved in each
/// round, and what the rounds found so far.
struct Run<'a> {
    mesh: &'a DeviceMesh,
    profile: &'a DeviceProfile,
    opts: &'a PlanOptions,
    both: bool,
    deadline: Instant,
    /// The deadline when a late candidate is given up ([`PlanOptions::abandon_late`]).
    hard: Option<Instant>,
    t0: Instant,
    timings: BTreeMap<String, f64>,
    last_lap: Instant,
    /// The canonical graph.
    g: Graph,
    /// The problem as built, with the accumulated update part weighed.
    main: Built,
    /// The problem solved as if every layer were recomputed, when a model needs it.
    main_assumed: Option<Built>,
    entries: Vec<Entry>,
    /// Under `Full`, every restriction is solved as recomputed.
    full: bool,
    /// The least budget the solver is given (see [`Run::new`]).
    floor: u64,
    solver_budget: u64,
    /// The plan with the smallest peak of those over the budget: its peak, its peak in the
    /// model it was solved in, the plan.
    smallest: Option<(u64, u64, Plan)>,
    rounds: usize,
    skipped: Vec<String>,
    /// Whether the search ended without a proof: the last round's own solve at its time limit,
    /// or the rounds (their number or time) before the budget reached the floor.
    cut: bool,
}

/// What one round found.
#[derive(Default)]
struct Round {
    candidates: Vec<(Entry, Plan)>,
    compared: BTreeMap<String, Option<f64>>,
    /// The own restriction's solve per model (whether solved as recomputed).
    first: BTreeMap<bool, Solved>,
    /// What a baseline's solve is expected to take beyond its search time, once measured.
    overhead: Option<Duration>,
    /// What copying and folding a restriction takes, as the own solve measured it.
    fold_seconds: Option<Duration>,
}

/// Adds the time since the `last` lap to `stage`'s.
fn lap(timings: &mut BTreeMap<String, f64>, last: &mut Instant, stage: &str) {
    *timings.entry(stage.to_string()).or_insert(0.0) += last.elapsed().as_secs_f64();
    *last = Instant::now();
}

impl<'a> Run<'a> {
    /// Builds the problem (or takes it from the cache) and lists the restrictions to solve.
    fn new(
        graph: &Graph,
        mesh: &'a DeviceMesh,
        profile: &'a DeviceProfile,
        opts: &'a PlanOptions,
        both: bool,
    ) -> Result<Run<'a>> {
        let deadline = opts.deadline.unwrap_or_else(|| Instant::now() + opts.time_limit);
        let t0 = Instant::now();
        let mut timings = BTreeMap::new();
        let mut last_lap = Instant::now();
        let g = canonical(graph)?;
        let hard = opts.abandon_late.then_some(deadline);
        let built = opts.cache.get_or_build(graph, mesh, opts.baseline, || {
            // Past the deadline, a candidate that must give a plan prices the rest directly.
            crate::problem::build_until(&g, mesh, profile, opts.baseline, Some(opts.budget), hard, Some(deadline))
        })?;
        let mut main = (*built).clone();
        main.problem.usage_limit = Some(opts.budget);
        if opts.accumulated > 1 {
            weigh_update_part(&mut main, &g, opts.accumulated);
        }
        lap(&mut timings, &mut last_lap, "build");
        let others: Vec<Baseline> =
            if opts.baseline == Baseline::Auto && opts.compare_baselines { role_baselines(mesh) } else { vec![] };
        // The baselines first (quick when the problem is small), then the strategy asked for with
        // what is left. A baseline's problem is as large as auto's (only parameters and inputs are
        // pinned): one is solved only when its share of the time left exceeds what its solve is
        // expected to take beyond its search (folding, reducing, compiling): its folding plus a
        // price per edge entry of the folded problem (`solve_one`), and no more than the last
        // baseline's overrun. Under `Full`, every restriction is solved as recomputed.
        let full = opts.recompute == Recompute::Full;
        // The strategy asked for first (it owns the plan; on large problems the baselines' copies
        // and folds alone take seconds), then the baselines, then the recomputed model.
        let mut entries: Vec<Entry> = vec![Entry { baseline: opts.baseline, assumed: full }];
        entries.extend(others.iter().map(|&b| Entry { baseline: b, assumed: full }));
        if opts.recompute == Recompute::Auto {
            entries.push(Entry { baseline: opts.baseline, assumed: true });
        }
        // The solver's model misses what the program adds (conversion copies) and what
        // recomputation removes, so every solution is lowered and its program's peak checked against
        // the budget. Stage two: when none fits, the solver goes back with its budget tightened by
        // the smallest excess seen, down to the smallest peak it can reach at all (min-memory
        // strategies everywhere), below which only recomputation helps. With the recomputed model
        // in play, its own smallest peak (which counts the recomputation) is the floor.
        let floor = main.problem.min_peak_usage().0.min(u64::MAX as u128) as u64;
        let mut run = Run {
            mesh,
            profile,
            opts,
            both,
            deadline,
            hard,
            t0,
            timings,
            last_lap,
            g,
            main,
            main_assumed: None,
            entries,
            full,
            floor,
            solver_budget: 0,
            smallest: None,
            rounds: 0,
            skipped: vec![],
            cut: false,
        };
        if full {
            run.build_assumed()?;
        }
        run.solver_budget = opts.budget.max(run.floor);
        Ok(run)
    }

    fn lap(&mut self, stage: &str) {
        lap(&mut self.timings, &mut self.last_lap, stage);
    }

    /// Prices the problem as if every layer were recomputed; its smallest peak lowers the floor.
    fn build_assumed(&mut self) -> Result<()> {
        let a = self.main.assume_recompute(&self.g)?;
        self.floor = self.floor.min(a.problem.min_peak_usage().0.min(u64::MAX as u128) as u64);
        self.main_assumed = Some(a);
        self.lap("build recomputed");
        Ok(())
    }

    /// Solves and lowers every restriction and model with the solver's current budget.
    fn round(&mut self) -> Result<Round> {
        let mut round = Round::default();
        self.skipped.clear();
        for i in 0..self.entries.len() {
            self.entry(i, &mut round)?;
        }
        Ok(round)
    }

    /// Solves entry `i` in its share of the time left, unless it is skipped, and lowers its
    /// solution unless a plan that fits is already no slower.
    fn entry(&mut self, i: usize, round: &mut Round) -> Result<()> {
        let entry = self.entries[i];
        let b = entry.baseline;
        let opts = self.opts;
        let now = Instant::now();
        let left = self.deadline.saturating_duration_since(now);
        let own = b == opts.baseline;
        // The recomputed model holds time back from the first solve only where memory is
        // expected to bind (even the smallest peak is at least half the budget, or both
        // models are asked for); otherwise it is usually skipped below, and the time it held
        // back would go unused.
        let expect_binding = self.full || self.both || self.floor.saturating_mul(2) >= self.solver_budget;
        let owns_left = self.entries[i..]
            .iter()
            .filter(|e| e.baseline == opts.baseline && (expect_binding || !e.assumed))
            .count()
            .max(1) as u32;
        // The model solved as it is comes first; the recomputed one only where the first
        // found memory binding (its plan recomputes, or its peak is near the budget), unless
        // both are asked for (pipeline stages hold several microbatches' activations).
        if own && entry.assumed && !self.full && !self.both {
            let binding = round
                .first
                .get(&false)
                .is_none_or(|f| f.peak.saturating_mul(5) >= self.solver_budget.saturating_mul(4) || f.recomputed);
            if !binding {
                return Ok(());
            }
        }
        if entry.assumed && self.main_assumed.is_none() {
            crate::problem::in_time(self.hard, "pricing layouts for recomputation")?;
            self.build_assumed()?;
        }
        let limit = self.limit(i, own, owns_left, left, round);
        tracing::debug!(
            "round {}: {} with {limit:?} of {left:?} left (solver budget {}, floor {})",
            self.rounds,
            entry.name(),
            fmt_bytes(self.solver_budget),
            fmt_bytes(self.floor)
        );
        // Only the first solve is owed; the others are begun only with time for them: a
        // baseline's copy and fold take about what the first solve's fold took (a problem
        // as large), and the recomputed model's fold as much again.
        let optional = i > 0;
        if optional
            && (limit.is_zero()
                || (!own && round.overhead.is_some_and(|o| o >= limit))
                || round.fold_seconds.is_some_and(|f| f >= limit))
        {
            self.skipped.push(entry.name());
            return Ok(());
        }
        let base = if entry.assumed { self.main_assumed.as_mut().unwrap_or(&mut self.main) } else { &mut self.main };
        // Auto's problem is the one built (no copy), with the solver's budget.
        let restricted = if b == Baseline::Auto {
            base.problem.usage_limit = Some(self.solver_budget);
            None
        } else {
            let mut r = base.restrict(&self.g, self.mesh, b)?;
            r.problem.usage_limit = Some(self.solver_budget);
            Some(r)
        };
        let solve_start = Instant::now();
        let solved = {
            let base: &Built =
                if entry.assumed { self.main_assumed.as_ref().unwrap_or(&self.main) } else { &self.main };
            let built = restricted.as_ref().unwrap_or(base);
            // Auto owed a plan with no time left searches the hand-written layouts only.
            let quick = (b == Baseline::Auto && own && limit.is_zero())
                .then(|| quick_solve(base, &self.g, self.mesh, opts))
                .flatten();
            match quick {
                Some(s) => {
                    self.skipped.push(
                        "auto over every strategy (with no time left, over those dp, megatron or zero allow)".into(),
                    );
                    Ok(Ok(s))
                }
                None => solve_one(built, &self.g, opts, limit, own),
            }
        };
        let solved = match solved {
            Ok(Err(expected)) => {
                // The next baselines' problems are about as large.
                round.overhead = Some(expected);
                self.skipped.push(entry.name());
                self.lap(&format!("solve {}", entry.name()));
                return Ok(());
            }
            Ok(Ok(s)) => Ok(s),
            Err(e) => Err(e),
        };
        if !own {
            let took = now.elapsed();
            round.overhead = Some(if took >= limit { took - limit } else { took });
        } else if round.fold_seconds.is_none() {
            round.fold_seconds = solved.as_ref().ok().map(|s| s.folded_in + (solve_start - now));
        }
        self.lap(&format!("solve {}", entry.name()));
        let solved = match solved {
            Ok(s) => s,
            // Under memory pressure the solver may find nothing in its time, or only plans
            // that break a parameter/update tie (the restriction's smallest peak ignores the
            // ties): no candidate from this restriction, this round.
            Err(Error::Solver(solver::Error::Infeasible { .. }) | Error::Internal(_)) => {
                round.compared.insert(entry.name(), None);
                return Ok(());
            }
            // A baseline (or the recomputed model) that cannot be solved is only not compared.
            Err(_) if !own || entry.assumed => {
                round.compared.insert(entry.name(), None);
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        self.candidate(entry, restricted.as_ref(), solved, round)
    }

    /// The time limit of entry `i`'s solve, of `left`: the first own solve a third of what is
    /// left when the recomputed model follows, three quarters when only baselines do (they are
    /// quick, or skipped), all of it otherwise; a baseline a small share, the recomputed model
    /// the rest. A round that has found nothing that fits keeps half its time for a tighter one
    /// (stage two, [`Run::tighten`]) while the budget can still be tightened.
    fn limit(&self, i: usize, own: bool, owns_left: u32, left: Duration, round: &Round) -> Duration {
        let again = round.candidates.is_empty() && self.rounds < MAX_ROUNDS && self.solver_budget > self.floor;
        if own {
            if i + 1 == self.entries.len() {
                if again { left / 2 } else { left }
            } else if owns_left > 1 {
                left / (owns_left + 1)
            } else {
                left / 4 * 3
            }
        } else {
            left / (2 * (self.entries.len() - i + 1)) as u32
        }
    }

    /// Prices the solution of `entry` (of the problem `restricted`, else the one built for its
    /// model) and, unless a plan that fits is already no slower, lowers it: a candidate when it
    /// fits the budget, else perhaps the smallest.
    fn candidate(
        &mut self,
        entry: Entry,
        restricted: Option<&Built>,
        mut solved: Solved,
        round: &mut Round,
    ) -> Result<()> {
        let opts = self.opts;
        let own = entry.baseline == opts.baseline;
        let base: &Built = if entry.assumed { self.main_assumed.as_ref().unwrap_or(&self.main) } else { &self.main };
        let built = restricted.unwrap_or(base);
        let main = &self.main;
        let Some(sol) = map_solution(built, main, &solved.solution) else { return Ok(()) };
        // Priced by the model it was solved in (the recomputed model's forward counts twice
        // there; the program's recomputation is priced when it is lowered).
        let ev = main.problem.evaluate(&sol)?;
        if ev.cost >= FORBIDDEN as u128 {
            round.compared.insert(entry.name(), None);
            return Ok(());
        }
        // A lowered plan costs at least its objective: one no faster than a plan that fits
        // already is not lowered (on large models lowering takes a second).
        let objective = ev.cost as f64 * 1e-12;
        let beaten = round.candidates.iter().map(|(_, p)| p.estimate.step_seconds).fold(f64::INFINITY, f64::min);
        // A baseline is kept unless auto's plan is `min_gain` faster ([`choose`]): one is
        // beaten only when even that margin would not keep it.
        let margin = if opts.baseline == Baseline::Auto { opts.min_gain.clamp(0.0, 1.0) } else { 0.0 };
        let beaten = if !own && margin >= 1.0 {
            f64::INFINITY
        } else if !own {
            beaten / (1.0 - margin)
        } else {
            beaten
        };
        if (!own || entry.assumed) && objective >= beaten {
            round.compared.insert(entry.name(), Some(objective));
            if own {
                round.first.insert(entry.assumed, solved);
            }
            return Ok(());
        }
        let info = SolverInfo {
            status: solved.status,
            // In the model it was solved in (the recomputed model counts the forward twice),
            // so that it compares with the bound.
            objective_seconds: if entry.assumed {
                built.problem.evaluate(&solved.solution)?.cost as f64 * 1e-12
            } else {
                ev.cost as f64 * 1e-12
            },
            lower_bound_seconds: solved.bound as f64 * 1e-12,
            seconds: 0.0,
            nodes: main.problem.nodes.len(),
            edges: main.problem.edges.len(),
            tied: solved.tied,
            strategies: main.problem.total_strategies(),
            chosen: entry.baseline,
            compared: BTreeMap::new(),
            skipped: vec![],
            rounds: 0,
            sizes: BTreeMap::new(),
            timings: BTreeMap::new(),
            plan_bound_seconds: 0.0,
            estimated_conversions: built.estimated_conversions,
        };
        let how = match (opts.recompute, entry.assumed) {
            (Recompute::Off, _) => Recomputation::Never,
            (Recompute::Full, _) => Recomputation::Every,
            _ => Recomputation::ToFit,
        };
        let model_peak = ev.peak_usage.min(u64::MAX as u128) as u64;
        let p = lower(&self.g, self.mesh, self.profile, opts, main, &sol, model_peak, info, how)?;
        lap(&mut self.timings, &mut self.last_lap, "lower");
        tracing::debug!(
            "{}: step {:.6} s, peak {} (budget {}), {:?} left",
            entry.name(),
            p.estimate.step_seconds,
            fmt_bytes(p.estimate.peak_bytes_per_rank),
            fmt_bytes(opts.budget),
            self.deadline.saturating_duration_since(Instant::now())
        );
        let peak = p.estimate.peak_bytes_per_rank;
        solved.peak = model_peak;
        solved.recomputed = p.estimate.recompute_seconds > 0.0;
        if peak <= opts.budget {
            round.compared.insert(entry.name(), Some(p.estimate.step_seconds));
            round.candidates.push((entry, p));
        } else {
            round.compared.insert(entry.name(), None);
            if self.smallest.as_ref().is_none_or(|(s, _, _)| peak < *s) {
                // Its peak in the model it was solved in, which the solver's budget bounds.
                let model =
                    if entry.assumed { built.problem.evaluate(&solved.solution)?.peak_usage } else { ev.peak_usage };
                self.smallest = Some((peak, model.min(u64::MAX as u128) as u64, p));
            }
        }
        if own {
            if !entry.assumed {
                self.cut = solved.status == SolveStatus::Feasible;
            }
            round.first.insert(entry.assumed, solved);
        }
        Ok(())
    }

    /// Per model, the plan kept of those that fit in `round` ([`choose`]), with the run's
    /// solver report.
    fn keep(&self, round: Round) -> Vec<(bool, Plan)> {
        let opts = self.opts;
        let mut out = vec![];
        for assumed in [false, true] {
            let mine: Vec<(Baseline, Plan)> = round
                .candidates
                .iter()
                .filter(|(e, _)| e.assumed == assumed)
                .map(|(e, p)| (e.baseline, p.clone()))
                .collect();
            let Some((b, mut p)) = choose(mine, opts) else { continue };
            let own_name = Entry { baseline: opts.baseline, assumed }.name();
            let first = round.first.get(&assumed);
            let first_bound = first.map_or(0, |f| f.bound);
            let objective = (p.solver.objective_seconds * 1e12).round() as u128;
            // A baseline kept on a tie with the restriction's own plan (`min_gain`) is as good
            // as that plan, and its status is the solve's.
            let tied = round.compared.get(&own_name).copied().flatten() == Some(p.estimate.step_seconds);
            p.solver.status = if objective <= first_bound && p.estimate.recompute_seconds == 0.0 && !assumed {
                SolveStatus::Optimal
            } else if b == opts.baseline || tied {
                first.map_or(p.solver.status, |f| f.status)
            } else {
                SolveStatus::Feasible
            };
            p.solver.lower_bound_seconds = first_bound as f64 * 1e-12;
            p.solver.seconds = self.t0.elapsed().as_secs_f64();
            p.solver.compared = round.compared.clone();
            p.solver.skipped = self.skipped.clone();
            p.solver.rounds = self.rounds;
            if let Some(f) = first {
                p.solver.sizes = f.sizes.clone();
            }
            p.solver.timings = self.timings.clone();
            out.push((assumed, p));
        }
        out
    }

    /// Nothing fits: tightens the solver's budget (stage two), while there is time for another
    /// round: to the smallest plan's own peak in the solver's model lowered by its excess and a
    /// tenth more (what the program adds on top of the model does not shrink with the budget),
    /// and in the last round there is time for, to the floor (the leanest plans the solver can
    /// reach: the most likely to fit). False when no round follows.
    fn tighten(&mut self, round_start: Instant) -> bool {
        let budget = self.opts.budget;
        let (excess, model) =
            self.smallest.as_ref().map_or((0, self.solver_budget), |(s, m, _)| (s.saturating_sub(budget), *m));
        let excess = excess.saturating_add(excess / 10).max(1);
        let took = round_start.elapsed();
        let last = self.rounds + 1 >= MAX_ROUNDS || self.deadline.saturating_duration_since(Instant::now()) < took;
        let next = if last { self.floor } else { self.solver_budget.min(model).saturating_sub(excess).max(self.floor) };
        if next >= self.solver_budget {
            return false;
        }
        if self.rounds >= MAX_ROUNDS || Instant::now() >= self.deadline {
            // The search ended before the floor: the smallest peak found is not the least.
            self.cut = true;
            return false;
        }
        self.solver_budget = next;
        true
    }
}

/// The manual layouts `auto` is compared with on `mesh` (each a feasible plan of the same
/// problem, so auto's is never worse than those solved): data parallel, Megatron (data
/// parallel outside, tensor parallel on the innermost axis), ZeRO, and on meshes of three or
/// more axes Megatron's layout with tensor parallelism over more of the inner axes (`dp,tp,tp`),
/// the layouts experts write by hand for such meshes.
pub fn role_baselines(mesh: &DeviceMesh) -> Vec<Baseline> {
    let mut out = vec![Baseline::Dp, Baseline::Megatron, Baseline::Zero];
    let n = mesh.ndim();
    if (3..=::plan::MAX_AXES).contains(&n) {
        for k in 1..n - 1 {
            let roles: Vec<AxisRole> = (0..n).map(|a| if a < k { AxisRole::Dp } else { AxisRole::Tp }).collect();
            if let Ok(r) = ::plan::AxisRoles::new(&roles) {
                out.push(Baseline::Axes(r));
            }
        }
    }
    // Megatron with its distributed optimizer: the data axes `zero` (the weights sharded over
    // them and gathered once a step, in the prologue), tensor parallel on the innermost.
    if (2..=::plan::MAX_AXES).contains(&n) && (0..n - 1).any(|a| mesh.shape()[a] > 1) {
        let roles: Vec<AxisRole> = (0..n).map(|a| if a < n - 1 { AxisRole::Zero } else { AxisRole::Tp }).collect();
        if let Ok(r) = ::plan::AxisRoles::new(&roles) {
            out.push(Baseline::Axes(r));
        }
    }
    out
}

/// The plan to keep of those that fit: the cheapest, on a tie the restriction asked for (its
/// status and bound are known); but with `Auto`, the cheapest baseline when auto's own plan is
/// not at least [`PlanOptions::min_gain`] of it faster.
fn choose(candidates: Vec<(Baseline, Plan)>, opts: &PlanOptions) -> Option<(Baseline, Plan)> {
    let step = |c: &(Baseline, Plan)| c.1.estimate.step_seconds;
    let (own, others): (Vec<_>, Vec<_>) = candidates.into_iter().partition(|c| c.0 == opts.baseline);
    let own = own.into_iter().min_by(|x, y| step(x).total_cmp(&step(y)));
    let other = others.into_iter().min_by(|x, y| step(x).total_cmp(&step(y)));
    match (own, other) {
        (Some(o), Some(b)) => {
            let margin = if opts.baseline == Baseline::Auto { opts.min_gain.clamp(0.0, 1.0) } else { 0.0 };
            Some(if step(&o) <= step(&b) * (1.0 - margin) { o } else { b })
        }
        (o, b) => o.or(b),
    }
}

/// Auto's plan when no time is left: the problem restricted to the strategies data parallelism,
/// Megatron or ZeRO allow (a few per node, so folding, compiling and one search round take a
/// fraction of what every strategy would), solved, and its solution mapped back onto `base`.
/// Its lower bound holds for the restricted problem only, so none is reported (0). `None` when
/// the restriction leaves no plan that fits (the whole problem is then solved).
fn quick_solve(base: &Built, g: &Graph, mesh: &DeviceMesh, opts: &PlanOptions) -> Option<Solved> {
    let hand = [Baseline::Dp, Baseline::Megatron, Baseline::Zero];
    let small = base.restrict_any(g, mesh, &hand).ok()?;
    let solved = solve_one(&small, g, opts, Duration::ZERO, true).ok()?.ok()?;
    let solution = map_solution(&small, base, &solved.solution)?;
    tracing::debug!("no time left: solved the hand-written layouts' strategies only");
    Some(Solved { solution, bound: 0, status: SolveStatus::Feasible, ..solved })
}
