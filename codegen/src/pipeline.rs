//! Pipeline search (`--pipeline auto`): every stage count the outermost mesh axis allows
//! planned ([`crate::plan`]'s solve, stage, schedule and recompute passes) and the fastest
//! plan that fits kept. The stage pass itself is [`crate::stage`] (re-exported here).

use ::plan::{Plan, ScheduleKind};
use sharding::DeviceMesh;

pub use crate::stage::{PipelineOptions, stage, stage_mesh};

use crate::plan::{PlanOptions, plan_inner, planning_mesh, stage_candidates};
use crate::stage::check_budget;
use crate::{Error, Result};

/// `--pipeline auto`: every number of stages `S` dividing the outermost mesh axis (the axis cut
/// into `S` stages of `axis/S` coordinates each, a new outermost axis `stage` with its link),
/// each priced by the intra-op ILP on its stage's submesh, then staged under each overlapping
/// schedule that applies (1F1B, ZB-H1, and interleaved over 2 chunks, and over `--chunks` when more, when the microbatches are
/// a multiple of `S`; 1F1B first, then the least idle, `ideal_bubble`) with the recomputation each stage's microbatches in flight need
/// ([`crate::stage::staged`]); `S = 1` is the plan without stages. The plan with the shortest estimated step
/// that fits the budget wins, but the plan without stages is kept unless that one is more than
/// [`PlanOptions::min_gain`] of its step faster (as auto's own plan against the
/// baselines: a smaller gain is under the cost model's error, and stages bring a schedule,
/// transfers and a bubble the plan without them does not have).
///
/// Stage counts above the microbatch count are searched only when no plan with fewer fits (their
/// bubble is over half the step). The stage counts share the time limit, the most stages first (the smallest problems): each
/// gets an equal share of what is left when it starts, and one that cannot start (no time
/// left) is skipped and named in `solver.skipped`. `solver.compared` lists every candidate (`None`: it does not fit),
/// `options.min_gain` the threshold and `solver.timings` the search.
pub fn search(
    graph: &ir::Graph,
    mesh: &DeviceMesh,
    profile: &sharding::DeviceProfile,
    opts: &PlanOptions,
) -> Result<Plan> {
    let t0 = std::time::Instant::now();
    let (mesh, baseline) = planning_mesh(mesh, opts.baseline, 1);
    let opts = &PlanOptions { baseline, ..opts.started() };
    let mesh = &mesh;
    let outer = mesh.shape().first().copied().unwrap_or(1);
    let mut best: Option<Plan> = None;
    let mut unstaged: Option<Plan> = None;
    let mut compared: Vec<(String, Option<f64>)> = vec![];
    let mut skipped: Vec<String> = vec![];
    let mut last_err = None;
    // Whether the last error said the budget is too small.
    let memory = std::cell::Cell::new(false);
    let mut consider = |name: String, p: Result<Plan>, best: &mut Option<Plan>| match p {
        Ok(p) => {
            compared.push((name, Some(p.estimate.step_seconds)));
            if best.as_ref().is_none_or(|b| p.estimate.step_seconds < b.estimate.step_seconds) {
                *best = Some(p);
            }
        }
        Err(Error::OutOfTime(_)) => skipped.push(name),
        Err(e) => {
            compared.push((name, None));
            memory.set(matches!(e, Error::Infeasible { .. } | Error::Pipeline(_)));
            last_err = Some(e);
        }
    };
    // The most stages first: their problems are one stage's submesh, the smallest, so the
    // quick candidates finish before the time is spent, and the plan without stages (the
    // largest problem) gets all that is left. A small model solves every candidate anyway.
    // More stages than microbatches leave every stage idle for over half the step (the bubble
    // of S stages and M microbatches is (S-1)/(M+S-1) of it), so those counts are searched
    // only when nothing with fewer fits, fewest first, after the plan without stages.
    let divisors: Vec<usize> = (1..=outer).rev().filter(|s| outer.is_multiple_of(*s)).collect();
    let many = opts.microbatches.max(1);
    let mut counts: Vec<usize> = divisors.iter().copied().filter(|&s| s <= many).collect();
    let beyond: Vec<usize> = divisors.iter().rev().copied().filter(|&s| s > many).collect();
    let searched = counts.len();
    counts.extend(&beyond);
    for (i, &s) in counts.iter().enumerate() {
        if i >= searched && (best.is_some() || unstaged.is_some()) {
            // A plan with no more stages than microbatches fits: the idle ones are not tried.
            break;
        }
        let left = opts.left();
        // The first candidate always runs, and so does the plan without stages while no
        // candidate has given a plan (a plan is owed); the others only with time left. Once
        // the time is spent and a candidate has shown that the budget is too small, that is
        // the answer: the error paths keep the time limit too, naming what was not tried.
        let owed = i == 0
            || ((s == 1 && best.is_none()) || (i == searched && best.is_none() && unstaged.is_none()))
                && !(memory.get() && left.is_zero());
        if !owed && left.is_zero() {
            let name = if s == 1 { "no stages".to_string() } else { format!("{s} stages") };
            consider(name, Err(Error::OutOfTime(String::new())), &mut best);
            continue;
        }
        // Later candidates are given up when their share runs out (their problem alone may
        // take longer to build than is left).
        let share = PlanOptions {
            abandon_late: !owed,
            ..opts.within(left / (if i < searched { searched } else { counts.len() } - i) as u32)
        };
        if s == 1 {
            let one = PlanOptions { stages: 1, ..share };
            let mut kept = None;
            consider("no stages".into(), plan_inner(graph, mesh, profile, &one), &mut kept);
            unstaged = kept;
            continue;
        }
        let staged_mesh = split_outer(mesh, s)?;
        let mut kinds = vec![(ScheduleKind::OneFOneB, 1), (ScheduleKind::ZbH1, 1)];
        if opts.microbatches.is_multiple_of(s) {
            // Two chunks per stage, and as many as --chunks asks for.
            kinds.push((ScheduleKind::Interleaved, 2));
            if opts.chunks > 2 {
                kinds.push((ScheduleKind::Interleaved, opts.chunks));
            }
        }
        // 1F1B first, the schedule holding the fewest activations (the likeliest to fit), then
        // the least idle: once one gives a plan, the others are given up when the share runs
        // out (16 stages over 16 microbatches idle 48% of the step under 1F1B, 10% interleaved
        // over 8 chunks, but on LLaMA-3 405B the interleaved stages did not fit where 1F1B's did).
        kinds[1..].sort_by(|a, b| ideal_bubble(*a, s, many).total_cmp(&ideal_bubble(*b, s, many)));
        match stage_candidates(graph, &staged_mesh, profile, &share, s, &kinds) {
            Ok(plans) => {
                for (name, p) in plans {
                    consider(format!("{s} stages, {name}"), p.and_then(|p| check_budget(p, opts.budget)), &mut best);
                }
            }
            Err(e) => consider(format!("{s} stages"), Err(e), &mut best),
        }
    }
    let margin = opts.min_gain.clamp(0.0, 1.0);
    let mut best = match (unstaged, best) {
        // On a tie the plan without stages: it has no schedule, transfers or bubble.
        (Some(u), Some(b)) if b.estimate.step_seconds >= u.estimate.step_seconds * (1.0 - margin) => u,
        (u, b) => b.or(u).ok_or_else(|| match last_err {
            Some(e) if !skipped.is_empty() => untried(e, &skipped),
            Some(e) => e,
            None => Error::Pipeline("no stage count to search".into()),
        })?,
    };
    best.options.min_gain = margin;
    best.solver.compared.extend(compared.into_iter().map(|(k, v)| (format!("pipeline: {k}"), v)));
    best.solver.skipped.extend(skipped.into_iter().map(|k| format!("pipeline: {k} (out of time)")));
    best.solver.timings.insert("pipeline search".into(), t0.elapsed().as_secs_f64());
    crate::bound::certify(&mut best, profile)?;
    Ok(best)
}

/// The idle fraction of a schedule's step when every microbatch's forward, backward and
/// weight gradient take the same time on every stage (Narayanan et al. 2021 for 1F1B and
/// interleaved over `chunks` chunks; ZB-H1 fills about two thirds of 1F1B's bubble, Qi et al.
/// 2024): the order schedules are tried in, not their price (staging prices each).
fn ideal_bubble((kind, chunks): (ScheduleKind, usize), stages: usize, microbatches: usize) -> f64 {
    let idle = (stages - 1) as f64;
    let (idle, work) = match kind {
        ScheduleKind::ZbH1 => (idle / 3.0, microbatches as f64),
        ScheduleKind::Interleaved => (idle, (microbatches * chunks.max(1)) as f64),
        _ => (idle, microbatches as f64),
    };
    idle / (work + idle)
}

/// `mesh` with its outermost axis as `stages` stages of `axis / stages` coordinates: a new
/// outermost axis `stage` with that axis's link (the mesh itself when the axis is the stages).
fn split_outer(mesh: &DeviceMesh, stages: usize) -> Result<DeviceMesh> {
    let outer = mesh.shape().first().copied().unwrap_or(1);
    if stages == outer {
        return Ok(mesh.clone());
    }
    let mut shape = vec![stages, outer / stages];
    shape.extend_from_slice(&mesh.shape()[1..]);
    let mut names = vec!["stage".to_string()];
    names.extend(mesh.names().iter().cloned());
    let mut links = vec![mesh.links()[0].clone()];
    links.extend(mesh.links().iter().cloned());
    Ok(DeviceMesh::new(shape, names, links)?)
}

/// `e`, the last candidate's error, saying which stage counts the time limit left untried.
fn untried(e: Error, skipped: &[String]) -> Error {
    let note = format!("{} not tried in the time limit: a longer --time-limit may find a plan", skipped.join(", "));
    match e {
        Error::Infeasible { budget, min_peak, suggest, dominant, min_peak_bytes, proven } => Error::Infeasible {
            budget,
            min_peak,
            suggest: format!("{suggest} ({note})"),
            dominant,
            min_peak_bytes,
            proven,
        },
        Error::Pipeline(m) => Error::Pipeline(format!("{m} ({note})")),
        e => e,
    }
}
