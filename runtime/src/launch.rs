//! Running a plan for several steps: the per-rank loop shared by every back end, and the
//! `threads` launcher (ranks as threads of this process).
//!
//! [`rank_loop`] runs steps on one rank until the requested step, writes checkpoints when due,
//! and after every step all-gathers a small report (peak bytes, seconds, collective seconds), so
//! every rank holds the [`StepReport`] of the whole mesh. Any failure on a rank aborts the
//! communicator, so every other rank stops at its next instruction with an error naming the
//! failing rank; [`run_threads`] returns the failing rank's own error.

use std::path::PathBuf;
use std::sync::mpsc;
use std::time::Duration;

use ir::Tensor;
use kernels::cpu::{Accumulation, CpuContext};

use crate::checkpoint;
use crate::comm::{Communicator, ThreadWorld};
use crate::dist::{DistError, Program, RankState, StepResult};

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
        let usage =
            || format!("fault `{s}`: expected rank=R,step=S[,kind=error|panic|hang|exit-in-checkpoint|abort-process]");
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
        }
    }
}

/// One step of the whole mesh.
#[derive(Clone, Debug)]
pub struct StepReport {
    /// Step number (1-based, continuing after a resumed checkpoint).
    pub step: u64,
    /// The loss.
    pub loss: f32,
    /// Wall seconds of the step (the slowest rank).
    pub seconds: f64,
    /// Seconds in collectives, per rank.
    pub comm_seconds: Vec<f64>,
    /// Peak bytes held, per rank.
    pub peak_bytes: Vec<u64>,
    /// A checkpoint written after this step.
    pub checkpoint: Option<PathBuf>,
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

/// The report of `step`: every rank's peak and times, exchanged so every rank has them.
pub(crate) fn step_report(
    comm: &mut dyn Communicator,
    everyone: &[usize],
    step: u64,
    r: &StepResult,
) -> Result<StepReport, DistError> {
    let loss = r.outputs.get("loss").map(crate::scalar_f32).unwrap_or(f32::NAN);
    let ns = |s: f64| (s * 1e9) as i64;
    let mine = Tensor::i64(vec![3], vec![r.peak_bytes as i64, ns(r.seconds), ns(r.comm_seconds)]);
    let all: Vec<Vec<i64>> =
        comm.exchange(everyone, std::sync::Arc::new(mine))?.iter().map(|t| t.to_i64_vec()).collect();
    Ok(StepReport {
        step,
        loss,
        seconds: all.iter().map(|v| v[1] as f64 * 1e-9).fold(0.0, f64::max),
        comm_seconds: all.iter().map(|v| v[2] as f64 * 1e-9).collect(),
        peak_bytes: all.iter().map(|v| v[0] as u64).collect(),
        checkpoint: None,
    })
}

/// Runs steps on one rank (see the module docs); `report` sees every step's report.
pub fn rank_loop(
    program: &Program,
    st: &mut RankState,
    ctx: &CpuContext,
    comm: &mut dyn Communicator,
    opts: &RunOptions,
    report: &mut dyn FnMut(StepReport),
) -> Result<(), DistError> {
    let everyone: Vec<usize> = (0..program.ranks()).collect();
    while st.steps_done < opts.until_step {
        let step = st.steps_done + 1;
        let fault = opts.fault.filter(|f| f.rank == st.rank && f.step == step);
        inject(fault.map(|f| f.kind), st.rank, step, || Ok(comm.check()?))?;
        let r = program.step(st, ctx, comm)?;
        let mut rep = step_report(comm, &everyone, step, &r)?;
        if let Some(c) = &opts.checkpoint {
            let due = step == opts.until_step || c.every.is_some_and(|k| k > 0 && step.is_multiple_of(k));
            if due {
                let exit = fault.is_some_and(|f| f.kind == FaultKind::ExitInCheckpoint);
                rep.checkpoint = Some(checkpoint::write(&c.dir, &opts.run_id, program, st, comm, exit)?);
            }
        }
        report(rep);
    }
    Ok(())
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
    let comms = ThreadWorld::new(n, opts.timeout);
    let (tx, rx) = mpsc::channel::<StepReport>();
    let results: Vec<Result<RankState, DistError>> = std::thread::scope(|s| {
        let mut handles = vec![];
        for (mut st, mut comm) in states.into_iter().zip(comms) {
            let tx = tx.clone();
            let rank = st.rank;
            let abort = comm.abort_handle();
            let body = move || -> Result<RankState, DistError> {
                let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> Result<(), DistError> {
                    let ctx = CpuContext::new(opts.threads_per_rank.max(1))
                        .map_err(|e| DistError::Data { rank, message: e.to_string() })?
                        .with_accumulation(opts.accumulation);
                    let mut send = |r: StepReport| {
                        if rank == 0 {
                            let _ = tx.send(r);
                        }
                    };
                    rank_loop(program, &mut st, &ctx, &mut comm, opts, &mut send)
                }));
                let r = match run {
                    Ok(r) => r,
                    Err(p) => Err(DistError::Panic { rank, message: panic_message(&*p) }),
                };
                match r {
                    Ok(()) => Ok(st),
                    Err(e) => {
                        if !e.is_secondary() {
                            comm.abort(&e.to_string());
                        }
                        Err(e)
                    }
                }
            };
            let h = std::thread::Builder::new()
                .name(format!("autopar-rank-{rank}"))
                .stack_size(32 << 20)
                .spawn_scoped(s, body)
                .map_err(|e| {
                    let e = DistError::Data { rank, message: format!("cannot start the rank's thread: {e}") };
                    // The ranks already started would wait for this one until the timeout.
                    abort(&e.to_string());
                    e
                });
            let failed = h.is_err();
            handles.push(h);
            if failed {
                break;
            }
        }
        drop(tx);
        for rep in rx {
            on_step(&rep);
        }
        handles
            .into_iter()
            .map(|h| {
                h.and_then(|h| {
                    h.join().unwrap_or_else(|p| Err(DistError::Panic { rank: usize::MAX, message: panic_message(&*p) }))
                })
            })
            .collect()
    });
    let mut primary = None;
    let mut secondary = None;
    let mut states = vec![];
    for r in results {
        match r {
            Ok(st) => states.push(st),
            Err(e) if e.is_secondary() => {
                secondary.get_or_insert(e);
            }
            Err(e) => {
                primary.get_or_insert(e);
            }
        }
    }
    match primary.or(secondary) {
        Some(e) => Err(e),
        None => Ok(states),
    }
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
        let mine = st
            .storage
            .get(&r.name)
            .cloned()
            .ok_or_else(|| DistError::Data { rank: st.rank, message: format!("no block of {}", r.name) })?;
        let blocks: Vec<Tensor> =
            comm.exchange(&everyone, std::sync::Arc::new(mine))?.iter().map(|t| (**t).clone()).collect();
        let t = sharding::sim::assemble(&blocks, &r.spec, &r.meta.shape, program.mesh(), 0.0)
            .map_err(|e| DistError::Plan(format!("assembling {}: {e}", r.name)))?;
        out.insert(r.name.clone(), t);
    }
    Ok(out)
}
