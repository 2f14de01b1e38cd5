//! Planning: solving the problem and lowering the chosen strategies into one SPMD program, a
//! [`Plan`] of the `plan` crate (the format, re-exported here), which checks what it holds.

use ::plan::{AxisRole, AxisRoles};
use ir::Graph;
use sharding::{DeviceMesh, DeviceProfile};

pub use ::plan::{
    Baseline, CheckpointReport, CollectiveSummary, Estimate, Instr, Location, MeshInfo, ModelInfo, OpCost, OptionsInfo,
    ParamShard, Phase, Pipeline, Plan, Problem, Problems, Recompute, Schedule, ScheduleKind, Segment, Size,
    SolveStatus, SolverInfo, StageEstimate, Step, VERSION, ValueRef,
};

pub use crate::lower::precision_of;
pub use crate::modes::role_baselines;
pub use crate::options::{DEFAULT_MIN_GAIN, PlanOptions};
pub use crate::solve::canonical;

use crate::modes::plan_modes;
use crate::solve::within_budget;
use crate::stage::{PipelineOptions, check_budget, stage_mesh, staged};
use crate::{Error, Result, fmt_bytes};

/// Plans `graph` (a training graph) on `mesh`: builds the problem, solves it (and, with `Auto`,
/// the manual baselines), and lowers the best solution.
pub fn plan(graph: &Graph, mesh: &DeviceMesh, profile: &DeviceProfile, opts: &PlanOptions) -> Result<Plan> {
    let (mesh, baseline) = planning_mesh(mesh, opts.baseline, usize::from(opts.stages > 1));
    let opts = &PlanOptions { baseline, ..opts.clone() };
    let mut p = plan_inner(graph, &mesh, profile, opts)?;
    crate::bound::certify(&mut p, profile)?;
    Ok(p)
}

/// Most mesh axes of more than one device the search works on as they are.
pub const MAX_SEARCHED_AXES: usize = 3;

/// The mesh a search works on: `mesh`, or, when it has more than [`MAX_SEARCHED_AXES`] axes of
/// more than one device and no layout is pinned per axis, `mesh` with adjacent axes of the same
/// link merged from axis `keep` on ([`DeviceMesh::merged_same_links`]; the pipeline's stage
/// axis is kept apart). Every strategy enumerates splits over each axis and their products:
/// a 4-D mesh of 16,384 GPUs gives tens of millions of strategies, and two axes over the same
/// links price alike when split together; the plan then names the merged axis (`pod+data`).
///
/// A layout pinned per axis merges only adjacent axes of the same link and the same role (two
/// data-parallel axes over one link are one data-parallel axis); the roles are merged alike.
pub fn planning_mesh(mesh: &DeviceMesh, baseline: Baseline, keep: usize) -> (DeviceMesh, Baseline) {
    let wide = mesh.shape().iter().filter(|&&s| s > 1).count();
    if wide <= MAX_SEARCHED_AXES {
        return (mesh.clone(), baseline);
    }
    let Baseline::Axes(roles) = baseline else { return (mesh.merged_same_links(keep), baseline) };
    let r = roles.roles();
    if r.len() != mesh.ndim() {
        return (mesh.clone(), baseline);
    }
    let joins = |a: usize, b: usize| r[a] == r[b];
    let merged = mesh.merged_where(keep, joins);
    // The roles of the merged mesh: one per run of joined axes, as the mesh merged them.
    let mut kept = vec![r[0]];
    for (a, &role) in r.iter().enumerate().skip(1) {
        if !(a > keep && mesh.links()[a] == mesh.links()[a - 1] && joins(a - 1, a)) {
            kept.push(role);
        }
    }
    match AxisRoles::new(&kept) {
        Ok(roles) if kept.len() == merged.ndim() => (merged, Baseline::Axes(roles)),
        _ => (mesh.clone(), baseline),
    }
}

/// [`plan()`] without its bound (a candidate of a larger search, which certifies its result).
pub(crate) fn plan_inner(
    graph: &Graph,
    mesh: &DeviceMesh,
    profile: &DeviceProfile,
    opts: &PlanOptions,
) -> Result<Plan> {
    let mut p = plan_unlabelled(graph, mesh, profile, opts)?;
    label(&mut p)?;
    Ok(p)
}

/// Fills what a finished plan states about itself: its precision (from the graph's types) and
/// the per-rank memory [`::plan::memory::Breakdown`], on the plan's own mesh (a pipeline search
/// may have cut the outermost axis into stages of sub-axes: the specs index that mesh, not the
/// one asked for).
pub fn label(p: &mut Plan) -> Result<()> {
    let mesh = p.device_mesh()?;
    p.options.precision = precision_of(&p.graph);
    p.estimate.memory = ::plan::memory::breakdown(p, &mesh)?;
    p.estimate.memory.activations_at_peak =
        p.estimate.peak_bytes_per_rank.saturating_sub(p.estimate.resident_bytes_per_rank);
    Ok(())
}

/// Checks a manual layout per mesh axis against the mesh and the pipeline: one role per axis,
/// `pp` only on the outermost axis and exactly when it holds the stages.
pub fn check_layout(b: Baseline, mesh: &DeviceMesh, stages: usize) -> Result<()> {
    let Baseline::Axes(roles) = b else { return Ok(()) };
    let roles = roles.roles();
    let bad = |why: String| Error::Layout { layout: b.name(), mesh: mesh.to_string(), why };
    if roles.len() != mesh.ndim() {
        return Err(bad(format!(
            "{} roles for {} mesh axes: give one per axis, outermost first",
            roles.len(),
            mesh.ndim()
        )));
    }
    if let Some(a) = roles.iter().skip(1).position(|&r| r == AxisRole::Pp) {
        return Err(bad(format!("`pp` on axis {}: the pipeline stages are the outermost axis", a + 1)));
    }
    let size = mesh.shape()[0];
    match (roles[0] == AxisRole::Pp, stages > 1) {
        (true, false) if size > 1 => Err(bad(format!("`pp` on an axis of {size}: add --pipeline {size}"))),
        (false, true) => {
            Err(bad(format!("{stages} pipeline stages: the outermost axis holds them, so its role is `pp`")))
        }
        _ => Ok(()),
    }
}

fn plan_unlabelled(graph: &Graph, mesh: &DeviceMesh, profile: &DeviceProfile, opts: &PlanOptions) -> Result<Plan> {
    check_layout(opts.baseline, mesh, opts.stages)?;
    // One deadline for the whole run: every nested solve, round and candidate shares it.
    let opts = &opts.started();
    if opts.stages > 1 {
        return plan_stages(graph, mesh, profile, opts, opts.stages, opts.schedule, opts.chunks);
    }
    if opts.microbatches > 1 {
        // The gradient sums are held while later microbatches run: solved again with less room
        // while the step does not fit, and recomputation covers what it can first (`pipeline::staged`).
        let (mut p, peak) = within_budget(opts, opts.budget, opts.budget, |budget, share| {
            let one = PlanOptions { microbatches: 1, accumulated: opts.microbatches, budget, ..share.clone() };
            let inner = plan_inner(graph, mesh, profile, &one)?;
            let solved = inner.estimate.peak_bytes_per_rank;
            let p = staged(inner, mesh, mesh, None, opts.budget, opts.recompute, opts.microbatches)?;
            let peak = p.estimate.peak_bytes_per_rank;
            Ok((p, peak, solved))
        })?;
        if peak > opts.budget {
            return Err(Error::Pipeline(format!(
                "with {} microbatches the step needs {} per rank (the gradient sums are held while later microbatches \
                 run), over the budget of {}; use --memory {} or a larger mesh",
                opts.microbatches,
                fmt_bytes(peak),
                fmt_bytes(opts.budget),
                fmt_bytes(peak + peak / 100 + 1)
            )));
        }
        p.options.budget_bytes = opts.budget;
        return Ok(p);
    }
    let plans = plan_modes(graph, mesh, profile, opts, false)?;
    // The cheapest of the recomputation models; on a tie the one solved as it is.
    let mut best: Option<Plan> = None;
    for (_, p) in plans {
        if best.as_ref().is_none_or(|b| p.estimate.step_seconds < b.estimate.step_seconds) {
            best = Some(p);
        }
    }
    best.ok_or_else(|| Error::Internal("planning returned no plan".into()))
}

/// Plans `stages` pipeline stages over the outermost axis of `mesh` (which must have that
/// size) under one schedule: the best plan of [`stage_candidates`], or why none fits.
pub(crate) fn plan_stages(
    graph: &ir::Graph,
    mesh: &DeviceMesh,
    profile: &sharding::DeviceProfile,
    opts: &PlanOptions,
    stages: usize,
    schedule: ScheduleKind,
    chunks: usize,
) -> Result<Plan> {
    let mut best: Option<Plan> = None;
    let mut err = None;
    for (_, p) in stage_candidates(graph, mesh, profile, opts, stages, &[(schedule, chunks)])? {
        match p.and_then(|p| check_budget(p, opts.budget)) {
            Ok(p) if best.as_ref().is_none_or(|b| p.estimate.step_seconds < b.estimate.step_seconds) => best = Some(p),
            Ok(_) => {}
            Err(e) => err = Some(e),
        }
    }
    best.ok_or_else(|| err.unwrap_or_else(|| Error::Pipeline("no pipelined plan".into())))
}

/// The pipelined plans of `stages` stages on `mesh` under each of `kinds` (schedule, chunks),
/// named by schedule (and recomputation model): the whole graph solved on one stage's submesh
/// ([`solve_stage`]: as it is and, with `Recompute::Auto`, also as if every layer were
/// recomputed), each solution staged under each schedule with the recomputation its stages'
/// microbatches in flight need ([`staged`]). While none fits, solved again with less room
/// ([`crate::solve::within_budget`]). A plan may still exceed the budget (its estimate says by
/// how much).
pub(crate) fn stage_candidates(
    graph: &ir::Graph,
    mesh: &DeviceMesh,
    profile: &sharding::DeviceProfile,
    opts: &PlanOptions,
    stages: usize,
    kinds: &[(ScheduleKind, usize)],
) -> Result<Vec<(String, Result<Plan>)>> {
    let sub = stage_mesh(mesh, stages)?;
    // The stages hold more than one microbatch's activations, and values they exchange:
    // solved again with less room while the stages do not fit.
    let start = opts.budget.saturating_mul(stages as u64);
    let (plans, _) = within_budget(opts, opts.budget, start, |budget, share| {
        let (mut inners, solved) = solve_stage(graph, &sub, profile, share, stages, budget)?;
        // A model whose solution is the other's (the same layouts) is staged once.
        let same = |a: &Plan, b: &Plan| {
            a.estimate.per_op.iter().map(|o| &o.strategy).eq(b.estimate.per_op.iter().map(|o| &o.strategy))
        };
        if inners.len() == 2 && same(&inners[0].1, &inners[1].1) {
            inners.truncate(1);
        }
        let mut plans = vec![];
        for (k, (assumed, inner)) in inners.iter().enumerate() {
            for (j, &(kind, chunks)) in kinds.iter().enumerate() {
                // Past the deadline, a later candidate of a search is not begun, nor a later
                // schedule or layout of this stage count once one of them gave a plan (each
                // costs a placement and a memory walk of every stage: seconds at scale).
                let kind_name = if chunks > 1 { format!("{kind} x{chunks}") } else { kind.to_string() };
                let name = if *assumed { format!("{kind_name}, layouts for recomputation") } else { kind_name };
                let have_one = plans.iter().any(|(_, p): &(String, Result<Plan>)| p.is_ok());
                if (opts.abandon_late || have_one) && (k, j) != (0, 0) && share.left().is_zero() {
                    plans.push((name, Err(Error::OutOfTime("staging".into()))));
                    continue;
                }
                let how = PipelineOptions { stages, schedule: kind, chunks, budget: opts.budget };
                let p = staged(inner.clone(), &sub, mesh, Some(&how), opts.budget, opts.recompute, opts.microbatches);
                plans.push((name, p));
            }
        }
        let least = plans.iter().filter_map(|(_, p)| p.as_ref().ok()).map(|p| p.estimate.peak_bytes_per_rank).min();
        Ok((plans, least.unwrap_or(u64::MAX), solved))
    })?;
    Ok(plans)
}

/// The plans `stages` stages are made from: the whole graph solved on one stage's submesh `sub`
/// against `budget` (per rank of the submesh: about `stages` times a stage's), one per
/// recomputation model solved ([`crate::modes::plan_modes`]; the one solved as if every layer
/// were recomputed says `Recompute::Full` in its options). Also returns the least of their own
/// peaks (what [`crate::solve::within_budget`] lowers). A budget no plan fits is said per rank
/// of a stage.
pub(crate) fn solve_stage(
    graph: &ir::Graph,
    sub: &DeviceMesh,
    profile: &sharding::DeviceProfile,
    opts: &PlanOptions,
    stages: usize,
    budget: u64,
) -> Result<(Vec<(bool, Plan)>, u64)> {
    let one = PlanOptions { stages: 1, microbatches: 1, accumulated: opts.microbatches, budget, ..opts.clone() };
    let s = stages as u64;
    let plans = plan_modes(graph, sub, profile, &one, true).map_err(|e| match e {
        Error::Infeasible { min_peak_bytes, .. } => Error::Pipeline(format!(
            "no plan fits {} per rank in {stages} stages: the whole model on one stage's devices needs at least {} \
             per rank, about {} per rank once cut into {stages} stages; use --memory {} or more, more stages or a \
             larger mesh per stage",
            fmt_bytes(opts.budget),
            fmt_bytes(min_peak_bytes),
            fmt_bytes(min_peak_bytes / s),
            fmt_bytes((min_peak_bytes / s) * 11 / 10),
        )),
        e => e,
    })?;
    let solved = plans.iter().map(|(_, p)| p.estimate.peak_bytes_per_rank).min().unwrap_or(u64::MAX);
    Ok((plans, solved))
}
