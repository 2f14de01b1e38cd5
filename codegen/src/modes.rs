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
    let deadline = opts.deadline.unwrap_or_else(|| Instant::now() + opts.time_limit);
    let t0 = Instant::now();
    let mut timings = BTreeMap::new();
    let mut lap = {
        let mut last = Instant::now();
        move |timings: &mut BTreeMap<String, f64>, stage: &str| {
            *timings.entry(stage.to_string()).or_insert(0.0) += last.elapsed().as_secs_f64();
            last = Instant::now();
        }
    };
    let g = canonical(graph)?;
    let hard = opts.abandon_late.then_some(deadline);
    let built = opts.cache.get_or_build(graph, mesh, opts.baseline, || {
        crate::problem::build_until(&g, mesh, profile, opts.baseline, Some(opts.budget), hard)
    })?;
    let mut main = (*built).clone();
    main.problem.usage_limit = Some(opts.budget);
    if opts.accumulated > 1 {
        weigh_update_part(&mut main, &g, opts.accumulated);
    }
    lap(&mut timings, "build");
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
    let budget = opts.budget;
    // The solver's model misses what the program adds (conversion copies) and what
    // recomputation removes, so every solution is lowered and its program's peak checked against
    // the budget. Stage two: when none fits, the solver goes back with its budget tightened by
    // the smallest excess seen, down to the smallest peak it can reach at all (min-memory
    // strategies everywhere), below which only recomputation helps. With the recomputed model
    // in play, its own smallest peak (which counts the recomputation) is the floor.
    let mut floor = main.problem.min_peak_usage().0.min(u64::MAX as u128) as u64;
    // The problem solved as if every layer were recomputed, when a model needs it.
    let mut main_assumed: Option<Built> = None;
    if full {
        let a = main.assume_recompute(&g)?;
        floor = floor.min(a.problem.min_peak_usage().0.min(u64::MAX as u128) as u64);
        main_assumed = Some(a);
        lap(&mut timings, "build recomputed");
    }
    let mut solver_budget = budget.max(floor);
    let mut smallest: Option<(u64, u64, Plan)> = None;
    let mut rounds = 0;
    let mut skipped: Vec<String> = vec![];
    // Whether the search ended without a proof: the last round's own solve at its time limit, or
    // the rounds (their number or time) before the budget reached the floor.
    let mut cut;
    loop {
        rounds += 1;
        let round_start = Instant::now();
        cut = false;
        let mut candidates: Vec<(Entry, Plan)> = vec![];
        let mut compared: BTreeMap<String, Option<f64>> = BTreeMap::new();
        let mut first: BTreeMap<bool, Solved> = BTreeMap::new();
        // What a baseline's solve is expected to take beyond its search time, once measured.
        let mut overhead: Option<Duration> = None;
        // What copying and folding a restriction takes, as the own solve measured it.
        let mut fold_seconds: Option<Duration> = None;
        skipped.clear();
        for (i, &entry) in entries.iter().enumerate() {
            let b = entry.baseline;
            let now = Instant::now();
            let left = deadline.saturating_duration_since(now);
            let own = b == opts.baseline;
            // The recomputed model holds time back from the first solve only where memory is
            // expected to bind (even the smallest peak is at least half the budget, or both
            // models are asked for); otherwise it is usually skipped below, and the time it held
            // back would go unused.
            let expect_binding = full || both || floor.saturating_mul(2) >= solver_budget;
            let owns_left = entries[i..]
                .iter()
                .filter(|e| e.baseline == opts.baseline && (expect_binding || !e.assumed))
                .count()
                .max(1) as u32;
            // The model solved as it is comes first; the recomputed one only where the first
            // found memory binding (its plan recomputes, or its peak is near the budget), unless
            // both are asked for (pipeline stages hold several microbatches' activations).
            if own && entry.assumed && !full && !both {
                let binding = first
                    .get(&false)
                    .is_none_or(|f| f.peak.saturating_mul(5) >= solver_budget.saturating_mul(4) || f.recomputed);
                if !binding {
                    continue;
                }
            }
            if entry.assumed && main_assumed.is_none() {
                crate::problem::in_time(hard, "pricing layouts for recomputation")?;
                let a = main.assume_recompute(&g)?;
                floor = floor.min(a.problem.min_peak_usage().0.min(u64::MAX as u128) as u64);
                main_assumed = Some(a);
                lap(&mut timings, "build recomputed");
            }
            // The first own solve a third of what is left when the recomputed model follows,
            // three quarters when only baselines do (they are quick, or skipped), all of it
            // otherwise; a baseline a small share, the recomputed model the rest.
            // A round that has found nothing that fits keeps half its time for a tighter one
            // (stage two, below) while the budget can still be tightened.
            let again = candidates.is_empty() && rounds < MAX_ROUNDS && solver_budget > floor;
            let limit = if own {
                if i + 1 == entries.len() {
                    if again { left / 2 } else { left }
                } else if owns_left > 1 {
                    left / (owns_left + 1)
                } else {
                    left / 4 * 3
                }
            } else {
                left / (2 * (entries.len() - i + 1)) as u32
            };
            tracing::debug!(
                "round {rounds}: {} with {limit:?} of {left:?} left (solver budget {}, floor {})",
                entry.name(),
                fmt_bytes(solver_budget),
                fmt_bytes(floor)
            );
            // Only the first solve is owed; the others are begun only with time for them: a
            // baseline's copy and fold take about what the first solve's fold took (a problem
            // as large), and the recomputed model's fold as much again.
            let optional = i > 0;
            if optional
                && (limit.is_zero()
                    || (!own && overhead.is_some_and(|o| o >= limit))
                    || fold_seconds.is_some_and(|f| f >= limit))
            {
                skipped.push(entry.name());
                continue;
            }
            let base = if entry.assumed { main_assumed.as_mut().unwrap_or(&mut main) } else { &mut main };
            // Auto's problem is the one built (no copy), with the solver's budget.
            let restricted = if b == Baseline::Auto {
                base.problem.usage_limit = Some(solver_budget);
                None
            } else {
                let mut r = base.restrict(&g, mesh, b)?;
                r.problem.usage_limit = Some(solver_budget);
                Some(r)
            };
            let base: &Built = if entry.assumed { main_assumed.as_ref().unwrap_or(&main) } else { &main };
            let built = restricted.as_ref().unwrap_or(base);
            let solve_start = Instant::now();
            let solved = match solve_one(built, &g, opts, limit, own) {
                Ok(Err(expected)) => {
                    // The next baselines' problems are about as large.
                    overhead = Some(expected);
                    skipped.push(entry.name());
                    lap(&mut timings, &format!("solve {}", entry.name()));
                    continue;
                }
                Ok(Ok(s)) => Ok(s),
                Err(e) => Err(e),
            };
            if !own {
                let took = now.elapsed();
                overhead = Some(if took >= limit { took - limit } else { took });
            } else if fold_seconds.is_none() {
                fold_seconds = solved.as_ref().ok().map(|s| s.folded_in + (solve_start - now));
            }
            lap(&mut timings, &format!("solve {}", entry.name()));
            let mut solved = match solved {
                Ok(s) => s,
                // Under memory pressure the solver may find nothing in its time, or only plans
                // that break a parameter/update tie (the restriction's smallest peak ignores the
                // ties): no candidate from this restriction, this round.
                Err(Error::Solver(solver::Error::Infeasible { .. }) | Error::Internal(_)) => {
                    compared.insert(entry.name(), None);
                    continue;
                }
                // A baseline (or the recomputed model) that cannot be solved is only not compared.
                Err(_) if !own || entry.assumed => {
                    compared.insert(entry.name(), None);
                    continue;
                }
                Err(e) => return Err(e),
            };
            let Some(sol) = map_solution(built, &main, &solved.solution) else { continue };
            // Priced by the model it was solved in (the recomputed model's forward counts twice
            // there; the program's recomputation is priced when it is lowered).
            let ev = main.problem.evaluate(&sol)?;
            if ev.cost >= FORBIDDEN as u128 {
                compared.insert(entry.name(), None);
                continue;
            }
            // A lowered plan costs at least its objective: one no faster than a plan that fits
            // already is not lowered (on large models lowering takes a second).
            let objective = ev.cost as f64 * 1e-12;
            let beaten = candidates.iter().map(|(_, p)| p.estimate.step_seconds).fold(f64::INFINITY, f64::min);
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
                compared.insert(entry.name(), Some(objective));
                if own {
                    first.insert(entry.assumed, solved);
                }
                continue;
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
                chosen: b,
                compared: BTreeMap::new(),
                skipped: vec![],
                rounds: 0,
                sizes: BTreeMap::new(),
                timings: BTreeMap::new(),
                plan_bound_seconds: 0.0,
            };
            let how = match (opts.recompute, entry.assumed) {
                (Recompute::Off, _) => Recomputation::Never,
                (Recompute::Full, _) => Recomputation::Every,
                _ => Recomputation::ToFit,
            };
            let p = lower(&g, mesh, profile, opts, &main, &sol, ev.peak_usage.min(u64::MAX as u128) as u64, info, how)?;
            lap(&mut timings, "lower");
            tracing::debug!(
                "{}: step {:.6} s, peak {} (budget {}), {:?} left",
                entry.name(),
                p.estimate.step_seconds,
                fmt_bytes(p.estimate.peak_bytes_per_rank),
                fmt_bytes(budget),
                deadline.saturating_duration_since(Instant::now())
            );
            let peak = p.estimate.peak_bytes_per_rank;
            solved.peak = ev.peak_usage.min(u64::MAX as u128) as u64;
            solved.recomputed = p.estimate.recompute_seconds > 0.0;
            if peak <= budget {
                compared.insert(entry.name(), Some(p.estimate.step_seconds));
                candidates.push((entry, p));
            } else {
                compared.insert(entry.name(), None);
                if smallest.as_ref().is_none_or(|(s, _, _)| peak < *s) {
                    // Its peak in the model it was solved in, which the solver's budget bounds.
                    let model = if entry.assumed {
                        built.problem.evaluate(&solved.solution)?.peak_usage
                    } else {
                        ev.peak_usage
                    };
                    smallest = Some((peak, model.min(u64::MAX as u128) as u64, p));
                }
            }
            if own {
                if !entry.assumed {
                    cut = solved.status == SolveStatus::Feasible;
                }
                first.insert(entry.assumed, solved);
            }
        }
        let mut out = vec![];
        for assumed in [false, true] {
            let mine: Vec<(Baseline, Plan)> =
                candidates.iter().filter(|(e, _)| e.assumed == assumed).map(|(e, p)| (e.baseline, p.clone())).collect();
            let Some((b, mut p)) = choose(mine, opts) else { continue };
            let own_name = Entry { baseline: opts.baseline, assumed }.name();
            let first = first.get(&assumed);
            let first_bound = first.map_or(0, |f| f.bound);
            let objective = (p.solver.objective_seconds * 1e12).round() as u128;
            // A baseline kept on a tie with the restriction's own plan (`min_gain`) is as good
            // as that plan, and its status is the solve's.
            let tied = compared.get(&own_name).copied().flatten() == Some(p.estimate.step_seconds);
            p.solver.status = if objective <= first_bound && p.estimate.recompute_seconds == 0.0 && !assumed {
                SolveStatus::Optimal
            } else if b == opts.baseline || tied {
                first.map_or(p.solver.status, |f| f.status)
            } else {
                SolveStatus::Feasible
            };
            p.solver.lower_bound_seconds = first_bound as f64 * 1e-12;
            p.solver.seconds = t0.elapsed().as_secs_f64();
            p.solver.compared = compared.clone();
            p.solver.skipped = skipped.clone();
            p.solver.rounds = rounds;
            if let Some(f) = first {
                p.solver.sizes = f.sizes.clone();
            }
            p.solver.timings = timings.clone();
            out.push((assumed, p));
        }
        if !out.is_empty() {
            return Ok(out);
        }
        // Nothing fits: tighten the solver's budget (stage two), while there is time for
        // another round: to the smallest plan's own peak in the solver's model lowered by its
        // excess and a tenth more (what the program adds on top of the model does not shrink
        // with the budget), and in the last round there is time for, to the floor (the leanest
        // plans the solver can reach: the most likely to fit).
        let (excess, model) = smallest.as_ref().map_or((0, solver_budget), |(s, m, _)| (s.saturating_sub(budget), *m));
        let excess = excess.saturating_add(excess / 10).max(1);
        let took = round_start.elapsed();
        let last = rounds + 1 >= MAX_ROUNDS || deadline.saturating_duration_since(Instant::now()) < took;
        let next = if last { floor } else { solver_budget.min(model).saturating_sub(excess).max(floor) };
        if next >= solver_budget {
            break;
        }
        if rounds >= MAX_ROUNDS || Instant::now() >= deadline {
            // The search ended before the floor: the smallest peak found is not the least.
            cut = true;
            break;
        }
        solver_budget = next;
    }
    let min_peak = smallest.map_or(floor, |(s, _, _)| s);
    Err(infeasible(&main, &g, budget, min_peak as u128, cut.then_some(floor)))
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
