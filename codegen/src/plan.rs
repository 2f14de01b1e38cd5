//! Planning: solving the problem and lowering the chosen strategies into one SPMD program, a
//! [`Plan`] of the `plan` crate (the format, re-exported here), which checks what it holds.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use ::plan::{AxisRole, AxisRoles};
use ir::{Graph, NodeIndex, Op};
use sharding::{DeviceMesh, DeviceProfile, ShardingSpec};

pub use ::plan::{
    Baseline, CheckpointReport, CollectiveSummary, Estimate, Instr, Location, MeshInfo, ModelInfo, OpCost, OptionsInfo,
    ParamShard, Phase, Pipeline, Plan, Problem, Problems, Recompute, Schedule, ScheduleKind, Segment, Size,
    SolveStatus, SolverInfo, StageEstimate, Step, VERSION, ValueRef,
};

use crate::problem::{Built, FORBIDDEN, Grouping, Merge};
use crate::{Error, Result, fmt_bytes};

/// Options of [`plan()`].
#[derive(Clone, Debug)]
pub struct PlanOptions {
    /// Memory budget per rank, bytes.
    pub budget: u64,
    /// Which strategies are allowed.
    pub baseline: Baseline,
    /// Wall-clock budget of the whole planning run from [`plan()`]'s start: building the problem
    /// and every solve count against it (a stage-two round gets it afresh). The baselines
    /// compared with `Auto` get a third of what is left and are skipped ([`SolverInfo::skipped`])
    /// when their solves could not fit; the auto solve gets the rest, at least a quarter of it.
    pub time_limit: Duration,
    /// Solver threads.
    pub threads: usize,
    /// With `Auto`, also solve the manual baselines and keep the best plan (each is a feasible
    /// plan of the unrestricted problem), so the result is never worse than those solved.
    pub compare_baselines: bool,
    /// With `Auto` comparing the baselines: auto's own plan is chosen only when it is estimated
    /// at least this fraction of the step faster than the cheapest baseline's; otherwise that
    /// baseline is (its status then says `feasible`, with auto's bound; the solve's status on an
    /// exact tie). The cost model is good
    /// to several percent (BENCHMARKS.md), so a smaller gain is not one to count on, and on a
    /// near tie two different programs measure apart by noise alone; the baseline's layout is
    /// the familiar one. 0: the cheapest, auto's on a tie. The stage search
    /// ([`crate::pipeline::search`]) keeps the plan without stages by the same rule.
    pub min_gain: f64,
    /// Activation recomputation ([`Recompute`]; [`crate::checkpoint`] rewrites the program).
    pub recompute: Recompute,
    /// When the whole planning run must end: every nested solve, round and candidate shares
    /// this one deadline. `None`: [`PlanOptions::time_limit`] from the call (the entry points
    /// set it, so nested calls inherit it).
    pub deadline: Option<Instant>,
    /// Give up with [`Error::OutOfTime`] once the deadline passes (a search's candidates after
    /// its first: the search keeps what it has). Otherwise the deadline only cuts solves short,
    /// and a plan is always made.
    pub abandon_late: bool,
    /// Problems built so far in this run (see [`crate::problem::Cache`]).
    pub cache: crate::problem::Cache,
    /// Repeated layers (the same ops in every transformer block) share one decision per op in
    /// the solver's problem (see [`crate::problem`]): the solver sees one layer whatever the
    /// depth. On by default (BENCHMARKS.md: same or better plans, much faster).
    pub tie_layers: bool,
    /// Which follow ops (elementwise, reshape, ...) join their producers' decisions; by default
    /// those where that provably keeps the optimum (see [`crate::problem`]).
    pub merge: Merge,
    /// Pipeline stages over the outermost mesh axis (1: none; see [`crate::pipeline`]). The
    /// layouts are solved on one stage's submesh with the whole graph against `stages` times
    /// the budget, then the stages are cut and each is checked against the budget (solved again
    /// with less room while one does not fit: `within_budget`).
    pub stages: usize,
    /// Microbatches per step (gradient accumulation; see [`crate::microbatch`]): `graph` is
    /// one microbatch's training graph with its gradients scaled by 1/`microbatches`. The
    /// gradient sums count against the budget (solved again with less room while they do not
    /// fit).
    pub microbatches: usize,
    /// How many times the pass being solved runs per update (set by the microbatch and
    /// pipeline paths to their microbatches when they solve one microbatch): the update part
    /// (the optimizer and the conversions of its inputs, [`crate::microbatch`]) runs once per
    /// step, so its costs weigh `1/accumulated` against the pass's. A gradient's reduction
    /// then waits for the summed gradients where that is cheaper per step.
    pub accumulated: usize,
    /// The pipeline schedule (with `stages > 1`; see [`crate::schedule`]).
    pub schedule: ScheduleKind,
    /// Model chunks per stage for the interleaved schedule (at least 2 there; 1 otherwise).
    pub chunks: usize,
}

/// [`PlanOptions::min_gain`]'s default: 1% of the step.
pub const DEFAULT_MIN_GAIN: f64 = 0.01;

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            budget: 16 << 30,
            baseline: Baseline::Auto,
            time_limit: Duration::from_secs(5),
            threads: 1,
            compare_baselines: true,
            min_gain: DEFAULT_MIN_GAIN,
            recompute: Recompute::Auto,
            deadline: None,
            abandon_late: false,
            cache: Default::default(),
            tie_layers: true,
            merge: Merge::Proven,
            stages: 1,
            microbatches: 1,
            accumulated: 1,
            schedule: ScheduleKind::OneFOneB,
            chunks: 1,
        }
    }
}

impl PlanOptions {
    /// These options with the deadline set: the one given, else [`PlanOptions::time_limit`]
    /// from now.
    pub fn started(&self) -> PlanOptions {
        match self.deadline {
            Some(_) => self.clone(),
            // A run starts: its deadline, and a cache of its own.
            None => PlanOptions {
                deadline: Some(Instant::now() + self.time_limit),
                cache: Default::default(),
                ..self.clone()
            },
        }
    }

    /// Time left before the deadline (the whole limit when none is set yet).
    pub fn left(&self) -> Duration {
        self.deadline.map_or(self.time_limit, |d| d.saturating_duration_since(Instant::now()))
    }

    /// These options with the deadline `left` from now, at most the current one: a share of
    /// the run for one candidate.
    pub fn within(&self, left: Duration) -> PlanOptions {
        let d = Instant::now() + left;
        PlanOptions { deadline: Some(self.deadline.map_or(d, |x| x.min(d))), ..self.clone() }
    }
}

/// How lowering recomputes activations ([`crate::checkpoint::fit`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Recomputation {
    /// Never.
    Never,
    /// What makes the program fit the budget.
    ToFit,
    /// Every chain stage.
    Every,
}

/// The graph with node `i` at index `i` in topological order (the numbering of the plan's
/// graph), without parameter data ([`Graph::renumbered`]).
pub fn canonical(g: &Graph) -> Result<Graph> {
    g.renumbered().map_err(|n| Error::Graph(format!("the training graph has a cycle through {}", g.node(n).name)))
}

struct Solved {
    solution: Vec<usize>,
    status: SolveStatus,
    bound: u128,
    /// Problem sizes by stage (see [`SolverInfo::sizes`]).
    sizes: BTreeMap<String, Size>,
    /// Nodes sharing a repeated layer's decision.
    tied: usize,
    /// How long folding took.
    folded_in: Duration,
    /// The solution's peak in the solver's model (set once priced).
    peak: u64,
    /// Whether its lowered program recomputes (set once lowered).
    recomputed: bool,
}

/// Solves stop once within this relative gap of their lower bound (0.001%).
const GAP: f64 = 1e-5;

/// Solves `b` folded by the groups `opts` asks for, and expands the solution to every node.
/// With `report`, also measures the problem's size at every stage. `Ok(Err(expected))` when it
/// is a baseline (`!report`) whose reduction would take it past `limit`: `expected` is what the
/// whole solve was expected to take.
fn solve_one(
    b: &Built,
    g: &Graph,
    opts: &PlanOptions,
    limit: Duration,
    report: bool,
) -> Result<std::result::Result<Solved, Duration>> {
    let start = Instant::now();
    // Infeasibility is decided on the problem as built (its minimum peak is exact).
    if let Some(cap) = b.problem.usage_limit {
        let (min_peak, time) = b.problem.min_peak_usage();
        if min_peak > cap as u128 {
            return Err(solver::Error::Infeasible { min_peak, time, limit: cap }.into());
        }
    }
    let how = Grouping { merge: opts.merge, tie_layers: opts.tie_layers };
    let folding = b.fold(g, how)?;
    let folded_in = start.elapsed();
    tracing::debug!("folded in {folded_in:?}: {} nodes", folding.folded.problem.nodes.len());
    // Reducing and compiling the folded problem cannot be interrupted: a baseline (`!report`)
    // whose problem would take it past its limit is not solved.
    let entries: usize = folding.folded.problem.edges.iter().map(|e| e.costs.len()).sum();
    let expected = folded_in + Duration::from_nanos(REDUCE_NANOS_PER_ENTRY * entries as u64);
    if !report && expected > limit {
        tracing::debug!("not solved: {entries} edge entries would take about {expected:?} of {limit:?}");
        return Ok(Err(expected));
    }
    // A later candidate of a search is not solved past its share either (a plan is owed only
    // by the first).
    if report && opts.abandon_late && expected > limit {
        return Err(Error::OutOfTime(format!(
            "solving {entries} edge entries would take about {expected:?} of {limit:?}"
        )));
    }
    let mut sizes = BTreeMap::new();
    if report {
        sizes.insert("built".to_string(), size(b.problem.size()));
        tracing::debug!("measured in {:?}", start.elapsed() - folded_in);
        if how.tie_layers {
            // The size before tying needs a second fold: measured only when folding is cheap
            // against the time limit.
            // Only a measurement: a problem too large to fold untied is left out.
            if folded_in * 20 <= limit
                && let Ok(merged) = b.fold(g, Grouping { tie_layers: false, ..how })
            {
                sizes.insert("merged".into(), size(merged.folded.problem.size()));
            }
            sizes.insert("tied".into(), size(folding.folded.problem.size()));
        } else {
            sizes.insert("merged".into(), size(folding.folded.problem.size()));
        }
    }
    // Folding (and measuring) counts against the limit.
    let so = solver::SolveOptions {
        time_limit: limit.saturating_sub(start.elapsed()),
        threads: opts.threads.max(1),
        gap: GAP,
        ..Default::default()
    };
    let folded = &folding.folded;
    let grouped = folded.problem.nodes.len() < b.problem.nodes.len();
    let (solution, r) = match solver::solve(&folded.problem, &so) {
        Ok(r) => (folded.expand(&r.solution)?, r),
        // Sharing decisions can rule out every plan that fits (the folded problem's minimum
        // peak is only a bound): solve the problem as built in the time left.
        // Its shared matrices would each be copied by the solve: a problem that holds more
        // than the limit once copied is solved with only the repeated layers untied.
        Err(e @ (solver::Error::Infeasible { .. } | solver::Error::Internal(_))) if grouped => {
            let left = limit.saturating_sub(start.elapsed()).max(limit / 4);
            let so = solver::SolveOptions { time_limit: left, ..so };
            let entries: u64 = b.problem.edges.iter().map(|x| x.costs.len() as u64).sum();
            if entries <= crate::problem::MAX_EDGE_ENTRIES {
                let r = solver::solve(&b.problem, &so)?;
                (r.solution.clone(), r)
            } else if how.tie_layers
                && let Ok(untied) = b.fold(g, Grouping { tie_layers: false, ..how })
            {
                let r = solver::solve(&untied.folded.problem, &so)?;
                (untied.folded.expand(&r.solution)?, r)
            } else {
                return Err(e.into());
            }
        }
        Err(e) => return Err(e.into()),
    };
    if b.problem.evaluate(&solution)?.cost >= FORBIDDEN as u128 {
        return Err(Error::Internal("the solver's plan breaks a parameter/update tie".into()));
    }
    let status = match r.status {
        solver::Status::Optimal => SolveStatus::Optimal,
        solver::Status::WithinGap => SolveStatus::WithinGap,
        solver::Status::TimeLimit => SolveStatus::Feasible,
    };
    Ok(Ok(Solved {
        solution,
        status,
        bound: r.lower_bound,
        sizes,
        tied: folding.tied,
        folded_in,
        peak: 0,
        recomputed: false,
    }))
}

/// The most solver rounds [`plan_modes`] runs, tightening the solver's budget while no plan fits.
const MAX_ROUNDS: usize = 4;

/// What reducing and compiling a folded problem takes per edge entry on the development host
/// (unet on 2x2x2: 14 M entries in 0.75-0.9 s; LLaMA-3 70B on 8x8x8: 8.3 M in 0.6 s).
const REDUCE_NANOS_PER_ENTRY: u64 = 70;

fn size(s: solver::Size) -> Size {
    Size { nodes: s.nodes, edges: s.edges, strategies: s.strategies, variables: s.variables }
}

/// Maps a solution of a restricted problem onto the unrestricted one (strategies are subsets).
fn map_solution(from: &Built, to: &Built, sol: &[usize]) -> Option<Vec<usize>> {
    sol.iter()
        .enumerate()
        .map(|(i, &s)| {
            let want = &from.strategies[i][s];
            to.strategies[i]
                .iter()
                .position(|x| x.inputs == want.inputs && x.outputs == want.outputs && x.local == want.local)
        })
        .collect()
}

/// The "no plan fits" error. `searched` is `Some(the least peak any plan could reach)` when
/// `min_peak` is the least of the plans found in the time limit rather than that minimum.
fn infeasible(b: &Built, g: &Graph, budget: u64, min_peak: u128, searched: Option<u64>) -> Error {
    let resident: u64 = b
        .nodes
        .iter()
        .enumerate()
        .filter(|(_, n)| matches!(g.node(**n).op, Op::Param { .. } | Op::State { .. } | Op::Constant(_)))
        .map(|(i, _)| b.problem.nodes[i].usages.iter().copied().min().unwrap_or(0))
        .sum();
    let peak = min_peak.min(u64::MAX as u128) as u64;
    let biggest = b
        .nodes
        .iter()
        .enumerate()
        .max_by_key(|(i, _)| b.problem.nodes[*i].usages.iter().copied().min().unwrap_or(0))
        .map(|(i, &n)| (g.node(n).name.clone(), b.problem.nodes[i].usages.iter().copied().min().unwrap_or(0)));
    let dominant = if resident * 2 >= peak {
        format!(
            ", dominated by parameters, optimizer state and constants ({} at their smallest split)",
            fmt_bytes(resident)
        )
    } else {
        let big = biggest.map(|(n, u)| format!("; the largest is {n} ({})", fmt_bytes(u))).unwrap_or_default();
        format!(
            ", dominated by activations ({} beside {} resident){big}",
            fmt_bytes(peak - resident),
            fmt_bytes(resident)
        )
    };
    let suggest = peak + peak / 100 + 1;
    let hint = searched
        .map(|floor| {
            format!(
                "; the solver's time limit ended its search before a proof (the layouts alone go down to {} before \
                 recomputation): a longer --time-limit may find a plan that fits",
                fmt_bytes(floor)
            )
        })
        .unwrap_or_default();
    Error::Infeasible {
        budget: fmt_bytes(budget),
        min_peak: fmt_bytes(peak),
        suggest: format!("{} or more, or a larger mesh{hint}", fmt_bytes(suggest)),
        dominant,
        min_peak_bytes: peak,
        proven: searched.is_none(),
    }
}

/// `plan` (one microbatch's) split into `microbatches` ([`crate::microbatch::split`]), or with
/// one, its update part moved to the update phase: what pipeline stages take.
pub(crate) fn microbatched(plan: Plan, mesh: &DeviceMesh, microbatches: usize) -> Result<Plan> {
    if microbatches > 1 {
        crate::microbatch::split(plan, mesh, microbatches)
    } else {
        crate::microbatch::update_phase(plan, mesh)
    }
}

/// Runs `round(budget)` (a plan solved against `budget`, then shaped further: staged,
/// microbatched) until the shaped plan's peak (the second value) fits `limit`: at most 4 rounds.
/// What shaping adds (in-flight microbatches' activations, gradient sums) comes on top of the
/// solved plan's own peak (the third value) about one for one, so each round solves against
/// that peak lowered by the excess and a tenth more: the solver then recomputes activations or
/// picks leaner layouts. Returns the last round's result (which may still not fit); a round
/// after the first that fails (no plan fits so little) ends the search with the previous one.
pub(crate) fn within_budget<T>(
    opts: &PlanOptions,
    limit: u64,
    start: u64,
    mut round: impl FnMut(u64, &PlanOptions) -> Result<(T, u64, u64)>,
) -> Result<(T, u64)> {
    let t = Instant::now();
    // The first round gets half the time: a second one usually settles what shaping added.
    let (mut last, mut peak, mut inner) = round(start, &opts.within(opts.left() / 2))?;
    // A later round is about as long as the first: started only when one fits in the time left.
    let took = t.elapsed();
    for _ in 1..4 {
        if peak <= limit || opts.left() < took / 2 {
            tracing::debug!(
                "within budget: peak {}, {:?} left after a round of {took:?}",
                fmt_bytes(peak),
                opts.left()
            );
            break;
        }
        let over = peak - limit;
        let Some(budget) = inner.checked_sub(over.saturating_add(over / 10)) else { break };
        tracing::debug!(
            "within budget: peak {} over {}, again with {}",
            fmt_bytes(peak),
            fmt_bytes(limit),
            fmt_bytes(budget)
        );
        match round(budget, opts) {
            Ok(r) => (last, peak, inner) = r,
            Err(_) => break,
        }
    }
    Ok((last, peak))
}

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
    p.options.precision = precision_of(&p.graph).to_string();
    p.estimate.memory = ::plan::memory::breakdown(p, &mesh)?;
    p.estimate.memory.activations_at_peak =
        p.estimate.peak_bytes_per_rank.saturating_sub(p.estimate.resident_bytes_per_rank);
    Ok(())
}

/// `bf16` or `fp16` for a mixed-precision training graph (one holding 16-bit values), else the
/// graph's float type.
pub fn precision_of(g: &Graph) -> &'static str {
    let mut wide = "f32";
    for n in g.g.node_weights() {
        for m in &n.outputs {
            match m.dtype {
                ir::DType::BF16 => return "bf16",
                ir::DType::F16 => return "fp16",
                ir::DType::F64 => wide = "f64",
                _ => {}
            }
        }
    }
    wide
}

/// Divides the costs of the update part of `built`'s graph (its nodes, and the conversions
/// into them) by `accumulated`, the passes per update (see [`PlanOptions::accumulated`]), and
/// holds what the update part reads (the gradient sums) for the whole pass.
fn weigh_update_part(built: &mut Built, g: &Graph, accumulated: usize) {
    let (_, update) = crate::microbatch::update_part(g);
    let m = accumulated as u64;
    let once: Vec<bool> = built.nodes.iter().map(|n| update[n.index()]).collect();
    for (node, &o) in built.problem.nodes.iter_mut().zip(&once) {
        if o {
            for c in node.costs.iter_mut().filter(|c| **c < FORBIDDEN) {
                *c /= m;
            }
        }
    }
    // What the update part reads from the pass is summed over the microbatches: held from the
    // first microbatch to the update, so for the whole pass.
    let end = built.problem.nodes.iter().map(|n| n.interval.1).max().unwrap_or(0);
    let read: Vec<usize> =
        built.problem.edges.iter().filter(|e| once[e.nodes.1] && !once[e.nodes.0]).map(|e| e.nodes.0).collect();
    for i in read {
        built.problem.nodes[i].interval = (0, end);
    }
    // Matrices are shared between edges (repeated layers): divided once each.
    let mut done: HashMap<usize, std::sync::Arc<[u64]>> = HashMap::new();
    for e in &mut built.problem.edges {
        if once[e.nodes.1] {
            let key = e.costs.as_ptr() as usize;
            e.costs = done
                .entry(key)
                .or_insert_with(|| e.costs.iter().map(|&c| if c >= FORBIDDEN { c } else { c / m }).collect())
                .clone();
        }
    }
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
        return crate::pipeline::plan_stages(graph, mesh, profile, opts, opts.stages, opts.schedule, opts.chunks);
    }
    if opts.microbatches > 1 {
        // The gradient sums are held while later microbatches run: solved again with less room
        // while the step does not fit, and recomputation covers what it can first (`pipeline::staged`).
        let (mut p, peak) = within_budget(opts, opts.budget, opts.budget, |budget, share| {
            let one = PlanOptions { microbatches: 1, accumulated: opts.microbatches, budget, ..share.clone() };
            let inner = plan_inner(graph, mesh, profile, &one)?;
            let solved = inner.estimate.peak_bytes_per_rank;
            let p = crate::pipeline::staged(inner, mesh, mesh, None, opts.budget, opts.recompute, opts.microbatches)?;
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

#[allow(clippy::too_many_arguments)]
fn lower(
    g: &Graph,
    mesh: &DeviceMesh,
    profile: &DeviceProfile,
    opts: &PlanOptions,
    b: &Built,
    sol: &[usize],
    peak: u64,
    solver_info: SolverInfo,
    how: Recomputation,
) -> Result<Plan> {
    let pos: HashMap<NodeIndex, usize> = b.nodes.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let picked = b.chosen(sol);
    let chosen = |n: NodeIndex| picked[pos[&n]];
    let keep = crate::checkpoint::kept_to_the_end(g);
    let mut program = vec![];
    let mut per_op = vec![];
    let mut colls: BTreeMap<String, CollectiveSummary> = BTreeMap::new();
    let (mut compute, mut comm) = (0.0, 0.0);
    let mut temp = 0usize;
    for &n in &b.nodes {
        let node = g.node(n);
        let s = chosen(n);
        let mut inputs = vec![];
        let mut conv_seconds = 0.0;
        for (k, v) in g.node_inputs(n).into_iter().enumerate() {
            let from = &chosen(v.node).outputs[v.slot];
            let to = &s.inputs[k];
            let mut cur = ValueRef::of(v);
            if from != to {
                let meta = g.meta(v);
                let path = b.converter.convert(&meta.shape, meta.dtype.size(), from, to)?;
                for step in &path.steps {
                    temp += 1;
                    let out = ValueRef::of(v).with_copy(temp);
                    let e = colls.entry(step.collective.kind().to_string()).or_insert_with(|| CollectiveSummary {
                        kind: step.collective.kind().to_string(),
                        count: 0,
                        bytes: 0,
                        seconds: 0.0,
                    });
                    e.count += 1;
                    e.bytes += step.bytes;
                    e.seconds += step.cost;
                    conv_seconds += step.cost;
                    let prev_from = program_spec_before(&path.from, &path.steps, step);
                    program.push(Instr::Collective {
                        input: cur,
                        output: out,
                        collective: step.collective.clone(),
                        from: prev_from,
                        to: step.after.clone(),
                        bytes: step.bytes,
                        seconds: step.cost,
                        stage: 0,
                        phase: Phase::Forward,
                        chunk: 0,
                    });
                    cur = out;
                }
            }
            inputs.push(cur);
        }
        for (c, bytes) in &s.collectives {
            let e = colls.entry(c.kind().to_string()).or_insert_with(|| CollectiveSummary {
                kind: c.kind().to_string(),
                count: 0,
                bytes: 0,
                seconds: 0.0,
            });
            e.count += 1;
            e.bytes += bytes;
            e.seconds += c.cost(*bytes, mesh);
        }
        compute += s.compute_seconds;
        comm += s.comm_seconds + conv_seconds;
        per_op.push(OpCost {
            node: node.name.clone(),
            op: node.op.name().to_string(),
            strategy: s.name.clone(),
            compute_seconds: s.compute_seconds,
            comm_seconds: s.comm_seconds + conv_seconds,
        });
        let outputs: Vec<ValueRef> = (0..node.outputs.len()).map(|k| ValueRef::new(n.index(), k)).collect();
        let local_shapes: Vec<Vec<usize>> =
            s.outputs.iter().zip(&node.outputs).map(|(sp, m)| sp.local_shape(&m.shape, mesh)).collect();
        let local_ins: Vec<ir::TensorMeta> = s
            .inputs
            .iter()
            .zip(g.node_inputs(n))
            .map(|(sp, v)| {
                let m = g.meta(v);
                ir::TensorMeta::new(m.dtype, sp.local_shape(&m.shape, mesh))
            })
            .collect();
        program.push(Instr::Op {
            node: n.index(),
            name: node.name.clone(),
            op: sharding::strategy::local_op(&node.op, &local_ins, &local_shapes),
            strategy: s.name.clone(),
            inputs: inputs.clone(),
            input_specs: s.inputs.clone(),
            outputs,
            output_specs: s.outputs.clone(),
            local_shapes,
            local: s.local.clone(),
            seconds: s.seconds(),
            recompute: false,
            stage: 0,
            phase: Phase::Forward,
            chunk: 0,
        });
    }
    // Frees after last reads, and recomputation of activations when the plan exceeds its budget.
    let (program, checkpoint) = if how != Recomputation::Never {
        crate::checkpoint::fit(g, mesh, program, &keep, opts.budget, how == Recomputation::Every)?
    } else {
        let p = crate::checkpoint::insert_frees(program, &keep);
        let peak = ::plan::memory::simulate(g, mesh, &p)?.peak;
        (p, CheckpointReport { peak_before: peak, peak_after: peak, ..Default::default() })
    };
    let recompute_seconds = checkpoint.extra_seconds;
    let mut params = vec![];
    let mut resident = 0u64;
    for &n in &b.nodes {
        let node = g.node(n);
        let name = match &node.op {
            Op::Param { name } | Op::State { name } => name.clone(),
            Op::Constant(_) => {
                resident += chosen(n).memory_bytes;
                continue;
            }
            _ => continue,
        };
        let s = chosen(n);
        resident += s.memory_bytes;
        let m = &node.outputs[0];
        params.push(ParamShard {
            name,
            node: n.index(),
            shape: m.shape.clone(),
            dtype: m.dtype.name().to_string(),
            spec: s.outputs[0].clone(),
            local_shape: s.outputs[0].local_shape(&m.shape, mesh),
            offsets: ::plan::listed_offsets(&s.outputs[0], &m.shape, mesh),
            stage: 0,
        });
    }
    let memory = ::plan::memory::simulate(g, mesh, &program)?;
    Ok(Plan {
        version: VERSION,
        model: ModelInfo { name: g.name.clone(), hash: g.fingerprint(), source: None, source_hash: None },
        mesh: MeshInfo { shape: mesh.shape().to_vec(), names: mesh.names().to_vec(), links: mesh.links().to_vec() },
        device: profile.name.clone(),
        options: OptionsInfo {
            budget_bytes: opts.budget,
            strategy: opts.baseline,
            time_limit_seconds: opts.time_limit.as_secs_f64(),
            precision: precision_of(g).to_string(),
            min_gain: if opts.baseline == Baseline::Auto && opts.compare_baselines { opts.min_gain } else { 0.0 },
            recompute: opts.recompute,
            seed: 0,
        },
        graph: g.clone(),
        microbatches: 1,
        accumulate: vec![],
        pipeline: None,
        params,
        program,
        estimate: Estimate {
            step_seconds: compute + comm + recompute_seconds,
            compute_seconds: compute,
            comm_seconds: comm,
            recompute_seconds,
            checkpoint,
            peak_bytes_per_rank: memory.peak,
            solver_peak_bytes_per_rank: peak,
            resident_bytes_per_rank: resident,
            memory: Default::default(),
            per_op,
            collectives: colls.into_values().collect(),
            model_flops: 0.0,
            mfu: 0.0,
        },
        solver: solver_info,
    })
}

/// The spec before `step` on a conversion path.
fn program_spec_before(from: &ShardingSpec, steps: &[sharding::Step], step: &sharding::Step) -> ShardingSpec {
    let i = steps.iter().position(|s| std::ptr::eq(s, step)).unwrap_or(0);
    if i == 0 { from.clone() } else { steps[i - 1].after.clone() }
}
