//! Running a plan for several steps: the launchers, and the per-rank loop shared by every back
//! end.
//!
//! A launcher starts the ranks of a [`Job`] (a compiled plan, its feeds, where parameters come
//! from, the run options), runs them to the requested step and tells its caller what happens
//! through [`Event`]s: [`threads`] (ranks as threads of this process), `mpi` (feature `mpi`: one
//! process per rank under mpirun) and `nccl` (feature `cuda`: one process per GPU). A caller
//! (the CLI, a library user) only chooses the launcher and prints the events.
//!
//! [`rank_loop`] runs steps on one rank until the requested step, writes checkpoints when due,
//! and after every step all-gathers a small report (peak bytes, seconds, collective seconds), so
//! every rank holds the [`StepReport`] of the whole mesh. Any failure on a rank aborts the
//! communicator, so every other rank stops at its next instruction with an error naming the
//! failing rank; [`run_threads`] returns the failing rank's own error.

use std::path::PathBuf;
use std::sync::mpsc;
use std::time::Duration;

use crate::cpu::{Accumulation, Cpu};
use ir::Tensor;

use crate::comm::{Communicator, ThreadWorld};
use crate::error::DistError;
pub use crate::program::RankProfile;
use crate::program::{Program, RankState};
pub use crate::rank::{CpuRank, Rank, StepReport};

mod init;
#[cfg(feature = "mpi")]
mod mpi;
#[cfg(feature = "cuda")]
mod nccl;

pub use init::{Init, model_file};
#[cfg(feature = "mpi")]
pub use mpi::mpi;
#[cfg(feature = "cuda")]
pub use nccl::nccl;
pub use nccl_options::NcclOptions;

/// The `mpi` launcher of a build without MPI: an error saying so.
#[cfg(not(feature = "mpi"))]
pub fn mpi(_: &mut dyn FnMut() -> Result<Job, String>, _: &mut OnEvent<'_>) -> Result<Finished, LaunchError> {
    Err(LaunchError::Setup(
        "--backend mpi: this autopar was built without MPI support (rebuild with --features mpi)".into(),
    ))
}

/// The `nccl` launcher of a build without CUDA: an error saying so.
#[cfg(not(feature = "cuda"))]
pub fn nccl(_: &mut Job, _: &str, _: &NcclOptions, _: &mut OnEvent<'_>) -> Result<Finished, LaunchError> {
    Err(LaunchError::Setup(
        "--backend nccl: this autopar was built without CUDA support (rebuild with --features cuda)".into(),
    ))
}

mod nccl_options {
    use std::path::PathBuf;

    /// Where this process runs in an `nccl` job.
    #[derive(Clone, Debug, Default)]
    pub struct NcclOptions {
        /// This process's rank and the number of ranks; `None`: mpirun's variables (Open MPI,
        /// then PMI), else rank 0 of 1.
        pub rank_world: Option<(usize, usize)>,
        /// The GPU; `None`: the rank modulo the GPUs of the machine.
        pub gpu: Option<usize>,
        /// Where the ranks exchange NCCL's unique ids; `None`: a directory in the system's
        /// temporary directory named by the plan, the world size and the launcher's job id.
        pub dir: Option<PathBuf>,
    }
}

/// Why a launch failed. `Run` is a rank's failure while training; the others happen before the
/// first step.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// A rank failed during the run (the first failing rank's own error; in the message, not
    /// as a `source`, so that a chain of causes prints it once).
    #[error("the run stopped: {0}")]
    Run(DistError),
    /// The ranks could not be set up (a checkpoint, feeds, the mesh, the caller's setup).
    #[error("{0}")]
    Setup(String),
    /// The model file lacks data for a parameter.
    #[error("{} has no data for parameter {param} ({with_data} of {params} parameters have data)", model.display())]
    MissingData {
        /// The model file.
        model: PathBuf,
        /// The first parameter without data.
        param: String,
        /// Parameters with data.
        with_data: usize,
        /// Parameters in all.
        params: usize,
    },
    /// An external data file of the model is missing.
    #[error("{}: the external data file {} of parameter {param} does not exist", model.display(), file.display())]
    MissingExternal {
        /// The model file.
        model: PathBuf,
        /// The missing file.
        file: PathBuf,
        /// A parameter stored in it.
        param: String,
    },
    /// The plan records no model file (planned from a graph in memory).
    #[error("the plan records no model file")]
    NoModel,
    /// The model file the plan records is gone.
    #[error("the plan's model file {} does not exist (moved or deleted?)", .0.display())]
    ModelGone(PathBuf),
    /// The model file is not the one the plan was made from.
    #[error("{} is not the model the plan was made from (its hash is {got}, the plan's {want})", model.display())]
    ModelChanged {
        /// The model file.
        model: PathBuf,
        /// Its hash now.
        got: String,
        /// The plan's record.
        want: String,
    },
}

impl From<DistError> for LaunchError {
    fn from(e: DistError) -> LaunchError {
        LaunchError::Run(e)
    }
}

/// What a launcher runs.
pub struct Job {
    /// The compiled plan.
    pub program: Program,
    /// The global batch of every input (each rank takes its block).
    pub feeds: std::collections::BTreeMap<String, Tensor>,
    /// Where parameters and optimizer state come from.
    pub init: Init,
    /// Steps, threads, checkpoints, faults.
    pub opts: RunOptions,
    /// Assemble the trained parameters at the end ([`Finished::params`]).
    pub gather: bool,
}

/// What a launcher tells its caller, in order, on the process that reports (rank 0's).
#[derive(Debug)]
pub enum Event<'a> {
    /// Something is used unchecked (an older plan).
    Warning(String),
    /// The ranks are set up; steps `start + 1 ..= until` follow.
    Started {
        /// Steps already done (a resumed run's checkpoint).
        start: u64,
        /// How the ranks run (`as threads`, ...).
        how: String,
        /// Where the parameters came from.
        source: String,
    },
    /// A step ended (the whole mesh's figures).
    Step(&'a StepReport),
}

/// What a finished launch hands back.
#[derive(Debug, Default)]
pub struct Finished {
    /// The trained parameters assembled from every rank's blocks, when [`Job::gather`] asked
    /// for them and this process reports.
    pub params: Option<std::collections::BTreeMap<String, Tensor>>,
    /// This process's ranks' final states: every rank's with `threads`, this rank's with `mpi`,
    /// none with `nccl` (its blocks are on the GPU).
    pub states: Vec<RankState>,
    /// Every rank's measured profile, in rank order, with [`RunOptions::profile_ops`].
    pub profiles: Vec<RankProfile>,
}

/// The callback that hears a launch's [`Event`]s; an error from it stops the run.
pub type OnEvent<'a> = dyn FnMut(Event<'_>) -> Result<(), String> + 'a;

/// Refuses an injected fault that could never fire: a rank outside the plan, or a step outside
/// `start + 1..=until` (a fault silently ignored would pass a failure-handling test for nothing).
pub fn check_fault(opts: &RunOptions, ranks: usize, start: u64) -> Result<(), LaunchError> {
    let Some(f) = opts.fault else { return Ok(()) };
    let what = format!("injected fault (--inject-fault or AUTOPAR_INJECT_FAULT) rank={},step={}", f.rank, f.step);
    if f.rank >= ranks {
        return Err(LaunchError::Setup(format!("{what}: the plan has {ranks} ranks (0 to {})", ranks - 1)));
    }
    if f.step <= start || f.step > opts.until_step {
        return Err(LaunchError::Setup(format!("{what}: this run trains steps {} to {}", start + 1, opts.until_step)));
    }
    Ok(())
}

/// Refuses a run with nothing to do (a checkpoint at or past the last step asked for).
fn check_start(start: u64, opts: &RunOptions) -> Result<(), LaunchError> {
    if start >= opts.until_step {
        return Err(LaunchError::Setup(format!(
            "the checkpoint is at step {start}; ask for more with --steps (it is the step to train until)"
        )));
    }
    Ok(())
}

/// Tells the caller of a process-per-rank launcher that its rank is set up (on the reporting
/// process only).
#[cfg(any(feature = "mpi", feature = "cuda"))]
fn announce(on: &mut OnEvent<'_>, reports: bool, warnings: Vec<String>, started: Event<'_>) -> Result<(), LaunchError> {
    if reports {
        for w in warnings {
            on(Event::Warning(w)).map_err(LaunchError::Setup)?;
        }
        on(started).map_err(LaunchError::Setup)?;
    }
    Ok(())
}

/// [`rank_loop`] with every step's report passed to `on` on the reporting process; the first
/// error of `on` ends the run once the loop is done (the other ranks are mid-step).
#[cfg(any(feature = "mpi", feature = "cuda"))]
fn run_reporting(
    program: &Program,
    rank: &mut dyn Rank,
    opts: &RunOptions,
    reports: bool,
    on: &mut OnEvent<'_>,
) -> Result<Option<RankProfile>, LaunchError> {
    let mut failed: Option<String> = None;
    let prof = rank_loop(program, rank, opts, &mut |r| {
        if reports
            && failed.is_none()
            && let Err(e) = on(Event::Step(&r))
        {
            failed = Some(e);
        }
    })?;
    failed.map_or(Ok(prof), |e| Err(LaunchError::Setup(e)))
}

/// Every rank's profile on every rank, gathered through `comm` (every rank calls it).
#[cfg(any(feature = "mpi", feature = "cuda"))]
fn gather_profiles(
    comm: &mut dyn Communicator,
    ranks: usize,
    mine: Option<RankProfile>,
) -> Result<Vec<RankProfile>, LaunchError> {
    let Some(mine) = mine else { return Ok(vec![]) };
    let words = mine.to_words();
    let everyone: Vec<usize> = (0..ranks).collect();
    let all = comm
        .exchange(&everyone, std::sync::Arc::new(Tensor::i64(vec![words.len()], words)))
        .map_err(|e| LaunchError::Run(e.into()))?;
    all.iter()
        .map(|t| RankProfile::from_words(&t.to_i64_vec()))
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| LaunchError::Setup("a rank's profile did not arrive whole".into()))
}

/// Runs `job` with every rank a thread of this process (see the module docs).
pub fn threads(job: &Job, on: &mut OnEvent<'_>) -> Result<Finished, LaunchError> {
    let program = &job.program;
    let all: Vec<usize> = (0..program.ranks()).collect();
    let mut warnings = vec![];
    let (states, source) =
        init::states(&job.init, program, &job.feeds, job.opts.data.as_deref(), &all, &mut |w| warnings.push(w))?;
    let setup = |e: String| LaunchError::Setup(e);
    for w in warnings {
        on(Event::Warning(w)).map_err(setup)?;
    }
    let start = states.first().map_or(0, |s| s.steps_done);
    check_start(start, &job.opts)?;
    check_fault(&job.opts, program.ranks(), start)?;
    on(Event::Started { start, how: "as threads".into(), source }).map_err(setup)?;
    let mut failed: Option<String> = None;
    let states = run_threads(program, states, &job.opts, &mut |r| {
        if failed.is_none()
            && let Err(e) = on(Event::Step(r))
        {
            failed = Some(e);
        }
    })?;
    if let Some(e) = failed {
        return Err(LaunchError::Setup(e));
    }
    let params = if job.gather { Some(program.assemble_params(&states)?) } else { None };
    let profiles = states.iter().filter_map(|s| s.profile.clone()).collect();
    Ok(Finished { params, states, profiles })
}

/// A step of [`threads_in_turns`]: which job ran it, in which turn, and where in the job's turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Turn {
    /// The job (index into the jobs given).
    pub job: usize,
    /// The turn (0-based).
    pub turn: usize,
    /// The first step of the job's turn (run right after another job's turn, with that job's
    /// data in the caches).
    pub first: bool,
    /// The last step of the job's turn.
    pub last: bool,
}

/// Why [`threads_in_turns`] failed, and in which job when it was one job's.
#[derive(Debug)]
pub struct TurnsError {
    /// The job (index into the jobs given) whose setup or step failed; `None`: none in particular.
    pub job: Option<usize>,
    /// What failed.
    pub error: LaunchError,
}

impl std::fmt::Display for TurnsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.job {
            Some(j) => write!(f, "job {j}: {}", self.error),
            None => self.error.fmt(f),
        }
    }
}

impl std::error::Error for TurnsError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// Runs several jobs with the same number of ranks as threads of this process, taking turns:
/// in each of `turns` turns, every job `j` runs `steps[j]` steps, one job after another (turn `t`
/// starts with job `t` modulo their number, so no job always follows the same one), each rank's
/// blocks of every job held from the start. The jobs' steps then share this machine's changes of
/// speed, which separate runs one after another do not (a comparison of plans by their step
/// times: `autopar bench`). Every step's report goes to `on` with its [`Turn`].
///
/// The jobs must agree on kernel threads per rank and accumulation (one kernel context per rank
/// serves them all); their `until_step` and `gather` are not used. Checkpoints, injected faults,
/// streamed data, evaluation and per-instruction profiles are not part of such a run: jobs that
/// ask for them are refused.
pub fn threads_in_turns(
    jobs: &[Job],
    steps: &[u64],
    turns: usize,
    warn: &mut dyn FnMut(String),
    on: &mut dyn FnMut(Turn, &StepReport),
) -> Result<(), TurnsError> {
    let setup = |job: Option<usize>, e: String| TurnsError { job, error: LaunchError::Setup(e) };
    let Some(first) = jobs.first() else { return Ok(()) };
    let n = first.program.ranks();
    if steps.len() != jobs.len() {
        return Err(setup(None, format!("{} step counts for {} jobs", steps.len(), jobs.len())));
    }
    for (j, job) in jobs.iter().enumerate() {
        if job.program.ranks() != n {
            return Err(setup(
                Some(j),
                format!(
                    "{} ranks where job 0 has {n}: jobs that take turns run on the same ranks",
                    job.program.ranks()
                ),
            ));
        }
        if steps[j] == 0 {
            return Err(setup(Some(j), "no steps in a turn".into()));
        }
        let o = &job.opts;
        if o.checkpoint.is_some() || o.fault.is_some() || o.data.is_some() || o.eval.is_some() || o.profile_ops {
            return Err(setup(
                Some(j),
                "jobs that take turns run with their feeds only (no checkpoints, faults, streamed data, evaluation \
                 or per-op profiles)"
                    .into(),
            ));
        }
        if o.threads_per_rank != first.opts.threads_per_rank || o.accumulation != first.opts.accumulation {
            return Err(setup(
                Some(j),
                "its kernel threads per rank or accumulation differ from job 0's: jobs that take turns share \
                 each rank's kernels"
                    .into(),
            ));
        }
    }
    let all: Vec<usize> = (0..n).collect();
    // Per rank: its state and communicator of every job.
    let mut per_rank: Vec<Vec<(RankState, crate::comm::ThreadComm)>> = (0..n).map(|_| vec![]).collect();
    for (j, job) in jobs.iter().enumerate() {
        let (states, _) = init::states(&job.init, &job.program, &job.feeds, None, &all, warn)
            .map_err(|error| TurnsError { job: Some(j), error })?;
        for ((st, comm), mine) in states.into_iter().zip(ThreadWorld::new(n, job.opts.timeout)).zip(&mut per_rank) {
            mine.push((st, comm));
        }
    }
    let opts = &first.opts;
    let mut bodies: Vec<RankThread<'_, (), (Turn, StepReport)>> = vec![];
    for (rank, mut mine) in per_rank.into_iter().enumerate() {
        let aborts: Vec<_> = mine.iter().map(|(_, c)| c.abort_handle()).collect();
        let abort_all = move |cause: &str| aborts.iter().for_each(|a| a(cause));
        let spawn_aborts: Vec<_> = mine.iter().map(|(_, c)| c.abort_handle()).collect();
        let body = move |tx: mpsc::Sender<(Turn, StepReport)>| -> Result<(), (Option<usize>, DistError)> {
            let mut at = None;
            let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> Result<(), DistError> {
                let cpu = Cpu::new(opts.threads_per_rank.max(1))
                    .map_err(|e| DistError::Data { rank, message: e.to_string() })?
                    .with_accumulation(opts.accumulation);
                let m = mine.len();
                for turn in 0..turns {
                    // Each turn starts with the next job, so no job always follows the same one.
                    for j in (0..m).map(|k| (k + turn) % m) {
                        at = Some(j);
                        let (st, comm) = &mut mine[j];
                        let o = RunOptions { until_step: st.steps_done + steps[j], ..jobs[j].opts.clone() };
                        let (start, until) = (st.steps_done + 1, o.until_step);
                        let mut send = |r: StepReport| {
                            if rank == 0 {
                                let t = Turn { job: j, turn, first: r.step == start, last: r.step == until };
                                let _ = tx.send((t, r));
                            }
                        };
                        rank_loop(&jobs[j].program, &mut CpuRank { st, cpu: &cpu, comm }, &o, &mut send)?;
                    }
                }
                Ok(())
            }));
            let r = run.unwrap_or_else(|p| Err(DistError::Panic { rank, message: panic_message(&*p) }));
            if let Err(e) = &r
                && !e.is_secondary()
            {
                abort_all(&e.to_string());
            }
            r.map_err(|e| (at, e))
        };
        let abort: Abort = Box::new(move |cause: &str| spawn_aborts.iter().for_each(|a| a(cause)));
        bodies.push((Box::new(body), abort));
    }
    let results = rank_threads(bodies, &mut |(t, rep)| on(t, &rep));
    first_failure(results).map(|_| ()).map_err(|(job, e)| TurnsError { job, error: e.into() })
}

/// A rank's thread: runs the rank and sends its reports to the calling thread; an error names
/// the job it happened in, when there are several ([`threads_in_turns`]).
type RankBody<'a, T, M> = Box<dyn FnOnce(mpsc::Sender<M>) -> Result<T, (Option<usize>, DistError)> + Send + 'a>;

/// Aborts a rank's communicators (every rank then stops at its next collective).
type Abort = Box<dyn Fn(&str)>;

/// A rank's thread body, and what aborts its communicators if the thread cannot start.
type RankThread<'a, T, M> = (RankBody<'a, T, M>, Abort);

/// Runs one body per rank, in rank order, each on a thread of its own, and hands every message
/// they send to `on` on the calling thread while they run. A thread that cannot start aborts its
/// rank's communicators (the ranks already started would wait for it until the timeout) and no
/// more are started. Returns each started rank's result.
fn rank_threads<T: Send, M: Send>(
    bodies: Vec<RankThread<'_, T, M>>,
    on: &mut dyn FnMut(M),
) -> Vec<Result<T, (Option<usize>, DistError)>> {
    let (tx, rx) = mpsc::channel::<M>();
    std::thread::scope(|s| {
        let mut handles = vec![];
        for (rank, (body, abort)) in bodies.into_iter().enumerate() {
            let tx = tx.clone();
            let h = std::thread::Builder::new()
                .name(format!("autopar-rank-{rank}"))
                .stack_size(32 << 20)
                .spawn_scoped(s, move || body(tx))
                .map_err(|e| {
                    let e = DistError::Data { rank, message: format!("cannot start the rank's thread: {e}") };
                    abort(&e.to_string());
                    (None, e)
                });
            let failed = h.is_err();
            handles.push(h);
            if failed {
                break;
            }
        }
        drop(tx);
        for m in rx {
            on(m);
        }
        handles
            .into_iter()
            .map(|h| {
                h.and_then(|h| {
                    h.join().unwrap_or_else(|p| {
                        Err((None, DistError::Panic { rank: usize::MAX, message: panic_message(&*p) }))
                    })
                })
            })
            .collect()
    })
}

/// The ranks' results, or the first failing rank's own error (an error that is only the echo of
/// another rank's failure, [`DistError::is_secondary`], when there is no other).
fn first_failure<T>(results: Vec<Result<T, (Option<usize>, DistError)>>) -> Result<Vec<T>, (Option<usize>, DistError)> {
    let mut secondary = None;
    let mut out = vec![];
    for r in results {
        match r {
            Ok(t) => out.push(t),
            Err((_, e)) if e.is_secondary() => {
                secondary.get_or_insert((None, e));
            }
            Err(e) => return Err(e),
        }
    }
    secondary.map_or(Ok(out), Err)
}

/// What an injected fault does (tests of failure handling).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// The rank returns an error at the start of the step.
    Error,
    /// The rank panics at the start of the step.
    Panic,
    /// The rank stops responding at the start of the step (the others time out).
    Hang,
    /// The process exits while the rank writes the step's checkpoint (after its file is written).
    ExitInCheckpoint,
    /// The rank's process dies at the start of the step (`abort()`: SIGABRT, no cleanup), as a
    /// killed process would.
    AbortProcess,
    /// The rank's gradients of the step are made non-finite (an inf in its backward's seed,
    /// [`ir::autodiff::LOSS_SCALE_POISON`]): a plan with loss scaling (fp16) skips the step on
    /// every rank.
    NonFinite,
}

/// An injected fault: `rank=R,step=S[,kind=error|panic|hang|exit-in-checkpoint|abort-process]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    /// The failing rank.
    pub rank: usize,
    /// The step at which it fails.
    pub step: u64,
    /// How.
    pub kind: FaultKind,
}

impl std::str::FromStr for Fault {
    type Err = String;
    fn from_str(s: &str) -> Result<Fault, String> {
        let usage = || {
            format!(
                "fault `{s}`: expected rank=R,step=S[,kind=error|panic|hang|exit-in-checkpoint|abort-process|nonfinite]"
            )
        };
        let (mut rank, mut step, mut kind) = (None, None, FaultKind::Error);
        for part in s.split(',') {
            let (k, v) = part.split_once('=').ok_or_else(usage)?;
            match k.trim() {
                "rank" => rank = Some(v.trim().parse().map_err(|_| usage())?),
                "step" => step = Some(v.trim().parse().map_err(|_| usage())?),
                "kind" => {
                    kind = match v.trim() {
                        "error" => FaultKind::Error,
                        "panic" => FaultKind::Panic,
                        "hang" => FaultKind::Hang,
                        "exit-in-checkpoint" => FaultKind::ExitInCheckpoint,
                        "abort-process" => FaultKind::AbortProcess,
                        "nonfinite" => FaultKind::NonFinite,
                        _ => return Err(usage()),
                    }
                }
                _ => return Err(usage()),
            }
        }
        Ok(Fault { rank: rank.ok_or_else(usage)?, step: step.ok_or_else(usage)?, kind })
    }
}

/// Checkpointing of a run.
#[derive(Clone, Debug)]
pub struct CheckpointOptions {
    /// The checkpoint directory.
    pub dir: PathBuf,
    /// Write one every this many steps (and after the last step); `None`: after the last only.
    pub every: Option<u64>,
}

/// Options of a run.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// Train until this step (a resumed run continues from its checkpoint's step).
    pub until_step: u64,
    /// Kernel threads of each rank.
    pub threads_per_rank: usize,
    /// How matrix products accumulate.
    pub accumulation: Accumulation,
    /// A collective waiting longer than this fails (a rank stopped without reporting).
    pub timeout: Duration,
    /// Checkpoints.
    pub checkpoint: Option<CheckpointOptions>,
    /// An injected fault (tests).
    pub fault: Option<Fault>,
    /// Names this run's temporary checkpoint directories (the same on every rank).
    pub run_id: String,
    /// The dataset that feeds the program's streamed inputs before each step
    /// ([`Program::stream_inputs`]); `None`: the feeds are the same every step.
    pub data: Option<std::sync::Arc<crate::data::Dataset>>,
    /// Evaluation on held-out data during the run.
    pub eval: Option<EvalOptions>,
    /// Time every instruction and track the bytes held ([`RankProfile`], in
    /// [`Finished::profiles`]).
    pub profile_ops: bool,
}

/// Evaluation of the loss on held-out data: forward only, with the same plan.
#[derive(Clone, Debug)]
pub struct EvalOptions {
    /// The held-out data (read in file order: every evaluation sees the same batches).
    pub data: std::sync::Arc<crate::data::Dataset>,
    /// Evaluate after every this many steps (and after the last).
    pub every: u64,
    /// Batches per evaluation (the first ones of the data).
    pub batches: u64,
}

impl EvalOptions {
    /// Whether step `step` of a run until step `until` is followed by an evaluation: every
    /// `every` steps, and after the last.
    pub fn due(&self, step: u64, until: u64) -> bool {
        step == until || (self.every > 0 && step.is_multiple_of(self.every))
    }
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            until_step: 1,
            threads_per_rank: 1,
            accumulation: Accumulation::F32,
            timeout: Duration::from_secs(600),
            checkpoint: None,
            fault: None,
            run_id: format!("{}", std::process::id()),
            data: None,
            eval: None,
            profile_ops: false,
        }
    }
}

/// Acts out an injected fault due before `step` (every kind but `ExitInCheckpoint`, which the
/// checkpoint writer acts out). A hang sleeps, calling `check` so an abort elsewhere ends it.
pub(crate) fn inject(
    kind: Option<FaultKind>,
    rank: usize,
    step: u64,
    mut check: impl FnMut() -> Result<(), DistError>,
) -> Result<(), DistError> {
    match kind {
        Some(FaultKind::Error) => Err(DistError::Injected { rank, step }),
        Some(FaultKind::Panic) => panic!("injected panic at step {step}"),
        Some(FaultKind::AbortProcess) => {
            eprintln!("rank {rank}: injected fault: the process dies at step {step}");
            std::process::abort()
        }
        Some(FaultKind::Hang) => loop {
            std::thread::sleep(Duration::from_millis(50));
            check()?;
        },
        _ => Ok(()),
    }
}

/// Runs steps on one rank until `opts.until_step` (see the module docs); `report` sees every
/// step's report (on every rank).
pub fn rank_loop(
    program: &Program,
    rank: &mut dyn Rank,
    opts: &RunOptions,
    report: &mut dyn FnMut(StepReport),
) -> Result<Option<RankProfile>, DistError> {
    let mut prof = opts.profile_ops.then(|| RankProfile { rank: rank.rank(), ..Default::default() });
    let mut step_times = vec![];
    let first = rank.steps_done() + 1;
    let everyone: Vec<usize> = (0..program.ranks()).collect();
    let mut reader = opts.data.as_deref().map(crate::data::Dataset::reader);
    let mut held_out = opts.eval.as_ref().map(|e| e.data.reader());
    // What this process reads: checked equal on every rank with the first step's report.
    let data_hash = opts.data.as_ref().map_or(0, |d| d.fingerprint())
        ^ opts.eval.as_ref().map_or(0, |e| e.data.fingerprint().rotate_left(1));
    while rank.steps_done() < opts.until_step {
        let step = rank.steps_done() + 1;
        let fault = opts.fault.filter(|f| f.rank == rank.rank() && f.step == step);
        inject(fault.map(|f| f.kind), rank.rank(), step, || rank.check())?;
        if fault.is_some_and(|f| f.kind == FaultKind::NonFinite) {
            rank.poison()?;
        }
        let t0 = std::time::Instant::now();
        if let Some(rd) = reader.as_mut() {
            let blocks = program.data_blocks(rank.rank(), rd, step - 1)?;
            rank.set_feed_blocks(blocks)?;
        }
        let data_seconds = t0.elapsed().as_secs_f64();
        let mut r = rank.step(program, prof.is_some())?;
        // The first step warms up (caches, allocations) unless it is the only one.
        if let Some(p) = prof.as_mut()
            && (step > first || step == opts.until_step)
        {
            let origin = program.origin.get(program.stage_of(rank.rank()));
            let plan_index = |at: usize| origin.and_then(|o| o.get(at)).copied().unwrap_or(at);
            p.memory.clear();
            for &(at, secs, live) in &r.instr_profile {
                *p.seconds.entry(plan_index(at)).or_default() += secs;
                p.memory.push((plan_index(at), live));
            }
            p.steps += 1;
            step_times.push(r.seconds);
        }
        r.data_bytes = reader.as_ref().map_or(0, |rd| rd.bytes_read());
        r.data_seconds = data_seconds;
        r.data_hash = data_hash;
        let mut rep = rank.report(&everyone, step, &r)?;
        if let (Some(e), Some(rd)) = (&opts.eval, held_out.as_mut())
            && e.due(step, opts.until_step)
        {
            let mut sum = 0.0;
            for b in 0..e.batches {
                let blocks = program.data_blocks(rank.rank(), rd, b)?;
                let out = rank.eval(program, blocks)?;
                sum += out
                    .outputs
                    .get(crate::program::EVAL_OUTPUT)
                    .map_or(f64::NAN, |t| crate::values::scalar_f32(t) as f64);
            }
            rep.eval_loss = Some(sum / e.batches.max(1) as f64);
        }
        if let Some(c) = &opts.checkpoint {
            let due = step == opts.until_step || c.every.is_some_and(|k| k > 0 && step.is_multiple_of(k));
            if due {
                let exit = fault.is_some_and(|f| f.kind == FaultKind::ExitInCheckpoint);
                let pos = opts
                    .data
                    .as_ref()
                    .map(|d| d.position(step))
                    .transpose()
                    .map_err(|e| DistError::Data { rank: rank.rank(), message: format!("--data: {e}") })?;
                rep.checkpoint = Some(rank.checkpoint(program, &c.dir, &opts.run_id, pos.as_ref(), exit)?);
            }
        }
        report(rep);
    }
    if let Some(p) = prof.as_mut() {
        let n = p.steps.max(1) as f64;
        p.seconds.values_mut().for_each(|v| *v /= n);
        step_times.sort_by(f64::total_cmp);
        p.step_seconds = step_times.get(step_times.len() / 2).copied().unwrap_or(0.0);
    }
    Ok(prof)
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic".into())
}

/// Runs `states` (one per rank, in rank order) on threads until `opts.until_step`; `on_step`
/// sees every step's report on the calling thread. Returns the ranks' final states, or the first
/// failing rank's error once every rank has stopped.
pub fn run_threads(
    program: &Program,
    states: Vec<RankState>,
    opts: &RunOptions,
    on_step: &mut dyn FnMut(&StepReport),
) -> Result<Vec<RankState>, DistError> {
    let n = program.ranks();
    if states.len() != n {
        return Err(DistError::Plan(format!("{} rank states for {n} ranks", states.len())));
    }
    if let Some((i, st)) = states.iter().enumerate().find(|(i, st)| st.rank != *i) {
        return Err(DistError::Plan(format!("the state of rank {} is in place {i}: states go in rank order", st.rank)));
    }
    let mut bodies: Vec<RankThread<'_, RankState, StepReport>> = vec![];
    for (mut st, mut comm) in states.into_iter().zip(ThreadWorld::new(n, opts.timeout)) {
        let rank = st.rank;
        let abort = comm.abort_handle();
        let body = move |tx: mpsc::Sender<StepReport>| -> Result<RankState, (Option<usize>, DistError)> {
            let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> Result<(), DistError> {
                let cpu = Cpu::new(opts.threads_per_rank.max(1))
                    .map_err(|e| DistError::Data { rank, message: e.to_string() })?
                    .with_accumulation(opts.accumulation);
                let mut send = |r: StepReport| {
                    if rank == 0 {
                        let _ = tx.send(r);
                    }
                };
                let prof =
                    rank_loop(program, &mut CpuRank { st: &mut st, cpu: &cpu, comm: &mut comm }, opts, &mut send)?;
                st.profile = prof;
                Ok(())
            }));
            let r = run.unwrap_or_else(|p| Err(DistError::Panic { rank, message: panic_message(&*p) }));
            match r {
                Ok(()) => Ok(st),
                Err(e) => {
                    if !e.is_secondary() {
                        comm.abort(&e.to_string());
                    }
                    Err((None, e))
                }
            }
        };
        bodies.push((Box::new(body), Box::new(abort)));
    }
    let results = rank_threads(bodies, &mut |r| on_step(&r));
    first_failure(results).map_err(|(_, e)| e)
}

/// The global parameters assembled from every rank's blocks through `comm` (every rank calls it;
/// every rank gets the result). Replicas must agree exactly.
pub fn gather_params(
    program: &Program,
    st: &RankState,
    comm: &mut dyn Communicator,
) -> Result<std::collections::BTreeMap<String, Tensor>, DistError> {
    let everyone: Vec<usize> = (0..program.ranks()).collect();
    let mut out = std::collections::BTreeMap::new();
    for r in program.resident.iter().filter(|r| !r.is_state) {
        // With pipeline stages only the ranks of the holding stage have a block; the others
        // put an empty one, and every rank's block is its peer's on that stage.
        let mine = match st.storage.get(&r.name) {
            Some(t) => t.clone(),
            None if program.stage_of(st.rank) != r.stage => Tensor::empty(r.meta.dtype),
            None => return Err(DistError::Data { rank: st.rank, message: format!("no block of {}", r.name) }),
        };
        let all = comm.exchange(&everyone, std::sync::Arc::new(mine))?;
        let blocks: Vec<Tensor> = (0..all.len()).map(|k| (*all[program.peer(k, r.stage)]).clone()).collect();
        let t = sharding::sim::assemble(&blocks, &r.spec, &r.meta.shape, program.mesh(), 0.0)
            .map_err(|e| DistError::Plan(format!("assembling {}: {e}", r.name)))?;
        out.insert(r.name.clone(), t);
    }
    Ok(out)
}
