//! What a planning run is asked for ([`PlanOptions`]), and the deadline every pass of the run
//! shares. Read by every pass; depends on none of them.

use std::time::{Duration, Instant};

use ::plan::{Baseline, Recompute, ScheduleKind};

use crate::problem::Merge;

/// Options of [`crate::plan()`].
#[derive(Clone, Debug)]
pub struct PlanOptions {
    /// Memory budget per rank, bytes.
    pub budget: u64,
    /// Which strategies are allowed.
    pub baseline: Baseline,
    /// Wall-clock budget of the whole planning run from [`crate::plan()`]'s start: building the problem
    /// and every solve count against it (a stage-two round gets it afresh). The baselines
    /// compared with `Auto` get a third of what is left and are skipped ([`::plan::SolverInfo::skipped`])
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
    /// Estimate with communication overlapped with compute ([`::plan::overlap`]): gradient
    /// reductions and the prologue's weight gathers on a second stream, pipeline transfers
    /// beside the stages' work. Off by default (the threads runtime runs collectives blocking);
    /// `autopar plan` turns it on for the GPU profiles.
    pub overlap: bool,
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
            overlap: false,
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
