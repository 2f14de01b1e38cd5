//! Solving (the first pass): the problem built for a graph and mesh ([`crate::problem`]) folded,
//! handed to the solver and its solution expanded to every node; and what a run needs around
//! it: the graph's canonical numbering, the "no plan fits" error, the update part's weight
//! when several passes share an update, and the rounds that solve again with less room.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use ::plan::{Size, SolveStatus};
use ir::{Graph, Op};

use crate::options::PlanOptions;
use crate::problem::{Built, FORBIDDEN, Grouping};
use crate::{Error, Result, fmt_bytes};

/// The graph with node `i` at index `i` in topological order (the numbering of the plan's
/// graph), without parameter data ([`Graph::renumbered`]).
pub fn canonical(g: &Graph) -> Result<Graph> {
    g.renumbered().map_err(|n| Error::Graph(format!("the training graph has a cycle through {}", g.node(n).name)))
}

pub(crate) struct Solved {
    pub(crate) solution: Vec<usize>,
    pub(crate) status: SolveStatus,
    pub(crate) bound: u128,
    /// Problem sizes by stage (see [`::plan::SolverInfo::sizes`]).
    pub(crate) sizes: BTreeMap<String, Size>,
    /// Nodes sharing a repeated layer's decision.
    pub(crate) tied: usize,
    /// How long folding took.
    pub(crate) folded_in: Duration,
    /// The solution's peak in the solver's model (set once priced).
    pub(crate) peak: u64,
    /// Whether its lowered program recomputes (set once lowered).
    pub(crate) recomputed: bool,
}

/// Solves stop once within this relative gap of their lower bound (0.001%).
const GAP: f64 = 1e-5;

/// Solves `b` folded by the groups `opts` asks for, and expands the solution to every node.
/// With `report`, also measures the problem's size at every stage. `Ok(Err(expected))` when it
/// is a baseline (`!report`) whose reduction would take it past `limit`: `expected` is what the
/// whole solve was expected to take.
pub(crate) fn solve_one(
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

/// What reducing and compiling a folded problem takes per edge entry on the development host
/// (unet on 2x2x2: 14 M entries in 0.75-0.9 s; LLaMA-3 70B on 8x8x8: 8.3 M in 0.6 s).
const REDUCE_NANOS_PER_ENTRY: u64 = 70;

fn size(s: solver::Size) -> Size {
    Size { nodes: s.nodes, edges: s.edges, strategies: s.strategies, variables: s.variables }
}

/// Maps a solution of a restricted problem onto the unrestricted one (strategies are subsets).
pub(crate) fn map_solution(from: &Built, to: &Built, sol: &[usize]) -> Option<Vec<usize>> {
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
pub(crate) fn infeasible(b: &Built, g: &Graph, budget: u64, min_peak: u128, searched: Option<u64>) -> Error {
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

/// Divides the costs of the update part of `built`'s graph (its nodes, and the conversions
/// into them) by `accumulated`, the passes per update (see [`PlanOptions::accumulated`]), and
/// holds what the update part reads (the gradient sums) for the whole pass.
pub(crate) fn weigh_update_part(built: &mut Built, g: &Graph, accumulated: usize) {
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
