//! One rank's executor as the launcher's loop drives it ([`Rank`]), and the report of a step of
//! the whole mesh ([`StepReport`]). A back end with its own devices implements [`Rank`] (as
//! `gpu::GpuRank`); the CPU's is [`CpuRank`].

use std::path::{Path, PathBuf};

use ir::Tensor;

use crate::checkpoint;
use crate::comm::Communicator;
use crate::cpu::Cpu;
use crate::error::DistError;
use crate::program::{Program, RankState, StepResult, set_blocks};

/// One step of the whole mesh.
#[derive(Clone, Debug)]
pub struct StepReport {
    /// Step number (1-based, continuing after a resumed checkpoint).
    pub step: u64,
    /// The loss.
    pub loss: f32,
    /// The step's learning rate, when the plan's graph has a schedule (output `lr`).
    pub lr: Option<f32>,
    /// The gradients' global norm before clipping, when the plan's graph clips them (output
    /// `grad_norm`).
    pub grad_norm: Option<f32>,
    /// Wall seconds of the step (the slowest rank).
    pub seconds: f64,
    /// Seconds in collectives, per rank.
    pub comm_seconds: Vec<f64>,
    /// Peak bytes held, per rank.
    pub peak_bytes: Vec<u64>,
    /// A checkpoint written after this step.
    pub checkpoint: Option<PathBuf>,
    /// Bytes each rank has read from the dataset so far (zeros without one).
    pub data_bytes: Vec<u64>,
    /// Seconds the slowest rank spent reading this step's data before it (not in `seconds`).
    pub data_seconds: f64,
    /// The mean loss over the held-out batches, when this step was followed by an evaluation.
    pub eval_loss: Option<f64>,
}

/// The report of `step`: every rank's peak and times, exchanged so every rank has them.
pub(crate) fn step_report(
    comm: &mut dyn Communicator,
    everyone: &[usize],
    step: u64,
    r: &StepResult,
) -> Result<StepReport, DistError> {
    let loss = r.outputs.get("loss").map(crate::values::scalar_f32).unwrap_or(f32::NAN);
    let ns = |s: f64| (s * 1e9) as i64;
    let mine = Tensor::i64(
        vec![6],
        vec![
            r.peak_bytes as i64,
            ns(r.seconds),
            ns(r.comm_seconds),
            r.data_bytes as i64,
            ns(r.data_seconds),
            r.data_hash,
        ],
    );
    let all: Vec<Vec<i64>> =
        comm.exchange(everyone, std::sync::Arc::new(mine))?.iter().map(|t| t.to_i64_vec()).collect();
    // Processes on other machines open their own copies of the data: the same files, or the
    // replicas of a block would silently differ.
    if let Some(k) = all.iter().position(|v| v[5] != r.data_hash) {
        let me = comm.rank();
        return Err(DistError::Data {
            rank: me,
            message: format!(
                "rank {k} reads other data than rank {me} (its files, sizes, seed or order differ): every process \
                 needs the same --data and --eval-data"
            ),
        });
    }
    Ok(StepReport {
        step,
        loss,
        lr: r.outputs.get("lr").map(crate::values::scalar_f32),
        grad_norm: r.outputs.get("grad_norm").map(crate::values::scalar_f32),
        seconds: all.iter().map(|v| v[1] as f64 * 1e-9).fold(0.0, f64::max),
        comm_seconds: all.iter().map(|v| v[2] as f64 * 1e-9).collect(),
        peak_bytes: all.iter().map(|v| v[0] as u64).collect(),
        checkpoint: None,
        data_bytes: all.iter().map(|v| v[3] as u64).collect(),
        data_seconds: all.iter().map(|v| v[4] as f64 * 1e-9).fold(0.0, f64::max),
        eval_loss: None,
    })
}

/// One rank's executor as [`rank_loop`] drives it: a CPU rank ([`CpuRank`]) and a GPU rank
/// (`gpu::GpuRank`, feature `cuda`) implement it, so every back end runs the same loop.
pub trait Rank {
    /// This rank.
    fn rank(&self) -> usize;
    /// Steps done so far (the next is `steps_done() + 1`).
    fn steps_done(&self) -> u64;
    /// An error when another rank has aborted the run (`Ok` on a transport without abort).
    fn check(&mut self) -> Result<(), DistError>;
    /// Runs one training step of `program`, timing every instruction with `profile`
    /// ([`StepResult::instr_profile`]).
    fn step(&mut self, program: &Program, profile: bool) -> Result<StepResult, DistError>;
    /// The report of `step`: every rank's figures, exchanged through the host communicator.
    fn report(&mut self, everyone: &[usize], step: u64, r: &StepResult) -> Result<StepReport, DistError>;
    /// Writes this rank's part of a checkpoint ([`checkpoint::write`]), with where the run is
    /// in its dataset.
    fn checkpoint(
        &mut self,
        program: &Program,
        dir: &Path,
        run_id: &str,
        data: Option<&crate::data::Position>,
        exit: bool,
    ) -> Result<PathBuf, DistError>;
    /// The loss on the rank's feeds with `blocks` in their places, forward only
    /// ([`Program::eval`]).
    fn eval(
        &mut self,
        program: &Program,
        blocks: Vec<(usize, std::sync::Arc<Tensor>)>,
    ) -> Result<StepResult, DistError>;
    /// Replaces feeds of the rank by place ([`Program::data_blocks`]).
    fn set_feed_blocks(&mut self, blocks: Vec<(usize, std::sync::Arc<Tensor>)>) -> Result<(), DistError>;
    /// Puts an inf in this rank's loss-scaling poison state ([`FaultKind::NonFinite`]).
    fn poison(&mut self) -> Result<(), DistError>;
}

/// A rank on the CPU: its state, kernels and communicator.
pub struct CpuRank<'a> {
    /// The rank's blocks.
    pub st: &'a mut RankState,
    /// Its kernels.
    pub cpu: &'a Cpu,
    /// Its communicator.
    pub comm: &'a mut dyn Communicator,
}

impl Rank for CpuRank<'_> {
    fn rank(&self) -> usize {
        self.st.rank
    }
    fn steps_done(&self) -> u64 {
        self.st.steps_done
    }
    fn check(&mut self) -> Result<(), DistError> {
        Ok(self.comm.check()?)
    }
    fn step(&mut self, program: &Program, profile: bool) -> Result<StepResult, DistError> {
        program.step_profiled(self.st, self.cpu, self.comm, profile)
    }
    fn report(&mut self, everyone: &[usize], step: u64, r: &StepResult) -> Result<StepReport, DistError> {
        step_report(self.comm, everyone, step, r)
    }
    fn checkpoint(
        &mut self,
        program: &Program,
        dir: &Path,
        run_id: &str,
        data: Option<&crate::data::Position>,
        exit: bool,
    ) -> Result<PathBuf, DistError> {
        checkpoint::write(dir, run_id, program, self.st, self.comm, data, exit)
    }
    fn set_feed_blocks(&mut self, blocks: Vec<(usize, std::sync::Arc<Tensor>)>) -> Result<(), DistError> {
        set_blocks(&mut self.st.feeds, blocks, self.st.rank)
    }
    fn eval(
        &mut self,
        program: &Program,
        blocks: Vec<(usize, std::sync::Arc<Tensor>)>,
    ) -> Result<StepResult, DistError> {
        program.eval(self.st, self.cpu, self.comm, blocks)
    }
    fn poison(&mut self) -> Result<(), DistError> {
        let name = ir::autodiff::LOSS_SCALE_POISON;
        match self.st.storage.get_mut(name) {
            Some(t) => {
                *t = Tensor::scalar_f32(f32::INFINITY);
                Ok(())
            }
            None => Err(DistError::Plan(format!(
                "rank {}: an injected non-finite gradient needs a plan with loss scaling (--precision fp16); \
                 this plan has no {name} state",
                self.st.rank
            ))),
        }
    }
}
