//! The CPU back end: [`Cpu`], the device a CPU rank (and the single-device interpreter) computes
//! on, and the executor's [`Backend`] over host tensors, CPU kernels and a
//! [`Communicator`]. Callers build a [`Cpu`] and pass it to [`Program::step`],
//! [`crate::Interpreter::run`] or [`crate::train::Trainer::step`]; the kernels library behind it
//! is this module's business.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use ir::{BinaryOp, Op, ReduceOp, Tensor, TensorMeta, UnaryOp};
use kernels::cpu::CpuContext;
use sharding::{Collective, DeviceMesh, ReduceKind, ShardingSpec};

pub use ir::Accumulation;

use crate::comm::Communicator;
use crate::error::DistError;
use crate::exec::{Backend, Mode, Storage};
use crate::program::{Kernel, KernelFailure, Program, RankState, StepResult, Stream, set_blocks};

/// The CPU a rank computes on: a pool of kernel threads of its own (no global pool: two
/// [`Cpu`]s never share workers) and how matrix products accumulate.
#[derive(Debug)]
pub struct Cpu {
    ctx: CpuContext,
}

/// The CPU's thread pool could not be started.
#[derive(Debug, thiserror::Error)]
#[error("starting {threads} CPU kernel threads: {message}")]
pub struct CpuError {
    /// The threads asked for.
    pub threads: usize,
    /// Why it failed.
    pub message: String,
}

impl Cpu {
    /// A CPU computing on `threads` worker threads (0: one per available core; 1: every kernel
    /// on the caller's thread), accumulating in f32.
    pub fn new(threads: usize) -> Result<Cpu, CpuError> {
        let ctx = CpuContext::new(threads).map_err(|e| CpuError { threads, message: e.to_string() })?;
        Ok(Cpu { ctx })
    }

    /// The same CPU with matrix products accumulating as `accumulation` says.
    pub fn with_accumulation(self, accumulation: Accumulation) -> Cpu {
        Cpu { ctx: self.ctx.with_accumulation(accumulation) }
    }

    /// Number of worker threads.
    pub fn threads(&self) -> usize {
        self.ctx.threads()
    }

    /// How matrix products accumulate.
    pub fn accumulation(&self) -> Accumulation {
        self.ctx.accumulation()
    }

    /// The kernels' context, for a library above the runtime that calls kernels itself (the
    /// cost-model measurement).
    pub fn context(&self) -> &CpuContext {
        &self.ctx
    }
}

/// A CPU rank as the executor's back end: host tensors, kernels on `ctx`, collectives
/// through `comm`.
pub(crate) struct CpuBackend<'a> {
    pub(crate) rank: usize,
    pub(crate) ctx: &'a CpuContext,
    pub(crate) comm: &'a mut dyn Communicator,
}

impl Backend for CpuBackend<'_> {
    type T = Tensor;
    fn rank(&self) -> usize {
        self.rank
    }
    fn bytes(t: &Tensor) -> u64 {
        t.bytes() as u64
    }
    fn shape(t: &Tensor) -> &[usize] {
        t.shape()
    }
    fn check(&mut self) -> Result<(), DistError> {
        Ok(self.comm.check()?)
    }
    fn eval(
        &mut self,
        k: &Kernel,
        ins: &[&Tensor],
        mesh: &DeviceMesh,
        stream: Option<&Stream>,
    ) -> Result<(Vec<Tensor>, f64), KernelFailure> {
        run_kernel(self.ctx, k, ins, mesh, self.comm, self.rank, stream)
    }
    fn collective(&mut self, c: &Collective, mesh: &DeviceMesh, x: &Tensor) -> Result<Tensor, DistError> {
        Ok(self.comm.run(c, mesh, x)?)
    }
    fn gather_output(&mut self, everyone: &[usize], x: &Tensor) -> Result<Vec<Tensor>, DistError> {
        Ok(self.comm.exchange(everyone, Arc::new(x.clone()))?.iter().map(|t| (**t).clone()).collect())
    }
    fn prepare(&mut self, groups: &[Vec<usize>]) -> Result<(), DistError> {
        Ok(self.comm.prepare(groups)?)
    }
    fn send(&mut self, to: usize, tag: u64, x: &Tensor) -> Result<(), DistError> {
        Ok(self.comm.send(to, tag, x)?)
    }
    fn recv(&mut self, from: usize, tag: u64, meta: &TensorMeta) -> Result<Tensor, DistError> {
        Ok(self.comm.recv(from, tag, meta)?)
    }
    fn download(&mut self, x: Tensor) -> Result<Tensor, DistError> {
        Ok(x)
    }
    fn reshape(&mut self, x: Tensor, shape: &[usize], _: &DeviceMesh) -> Result<Tensor, KernelFailure> {
        x.reshaped(shape.to_vec()).map_err(|e| KernelFailure::Kernel(e.to_string()))
    }
    fn copy(&mut self, x: &Tensor) -> Result<Tensor, String> {
        x.try_clone().map_err(|e| format!("a copy of {}: {e}", x.meta()))
    }
}

impl Program {
    /// Runs one training step on a rank (the executor every back end shares): kernels on `cpu`, collectives
    /// through `comm`.
    pub fn step(&self, st: &mut RankState, cpu: &Cpu, comm: &mut dyn Communicator) -> Result<StepResult, DistError> {
        self.step_profiled(st, cpu, comm, false)
    }

    /// [`Program::step`], timing every instruction with `profile` ([`StepResult::instr_profile`]).
    pub fn step_profiled(
        &self,
        st: &mut RankState,
        cpu: &Cpu,
        comm: &mut dyn Communicator,
        profile: bool,
    ) -> Result<StepResult, DistError> {
        let RankState { rank, storage, constants, feeds, steps_done, .. } = st;
        let feeds: Vec<&Tensor> = feeds.iter().map(|t| &**t).collect();
        let constants: Vec<&Tensor> = constants.iter().map(|t| &**t).collect();
        let b = &mut CpuBackend { rank: *rank, ctx: &cpu.ctx, comm };
        let key = self.step_key(*steps_done);
        let r = crate::exec::step(self, b, Storage::Owned(storage), &feeds, &constants, profile, Mode::Train(key))?;
        *steps_done += 1;
        Ok(r)
    }

    /// The loss of a rank's parameters on its feeds with `blocks` in place of theirs
    /// ([`Program::data_blocks`] of held-out data), forward only: nothing is updated, and
    /// [`EVAL_OUTPUT`] is the only output.
    pub fn eval(
        &self,
        st: &RankState,
        cpu: &Cpu,
        comm: &mut dyn Communicator,
        blocks: Vec<(usize, Arc<Tensor>)>,
    ) -> Result<StepResult, DistError> {
        let mut feeds = st.feeds.clone();
        set_blocks(&mut feeds, blocks, st.rank)?;
        let feeds: Vec<&Tensor> = feeds.iter().map(|t| &**t).collect();
        let constants: Vec<&Tensor> = st.constants.iter().map(|t| &**t).collect();
        let b = &mut CpuBackend { rank: st.rank, ctx: &cpu.ctx, comm };
        let mut scratch = BTreeMap::new();
        let storage = Storage::Borrowed { params: &st.storage, updates: &mut scratch };
        crate::exec::step(self, b, storage, &feeds, &constants, false, Mode::Eval)
    }
}

fn eval1(ctx: &CpuContext, op: &Op, ins: &[&Tensor]) -> Result<Tensor, KernelFailure> {
    kernels::cpu::eval(ctx, op, ins).map(|mut v| v.swap_remove(0)).map_err(|e| KernelFailure::Kernel(e.to_string()))
}

/// Indices normalised into `[0, total)` (negative ones count from the end, as the whole gather's
/// kernel takes them), whether each falls in this rank's rows `[off, off + rows)`, and the local
/// index (0 outside). An index outside `[-total, total)` is an error, as on one device: no rank
/// holds its row, and masking it would make it a row of zeros. (Ids fed from data were checked
/// against `[0, total)` before the step: [`crate::bounds`].)
fn local_indices(idx: &Tensor, off: usize, rows: usize, total: usize) -> Result<(Tensor, Vec<bool>), String> {
    let (off, rows, total) = (off as i64, rows as i64, total as i64);
    let v = idx.as_i64().ok_or_else(|| format!("indices must be i64, not {}", idx.dtype()))?;
    if let Some((at, i)) = v.iter().enumerate().find(|(_, i)| **i < -total || **i >= total) {
        return Err(format!("index {i} (element {at}) is out of range for a table of {total} rows"));
    }
    let norm: Vec<i64> = v.iter().map(|&i| if i < 0 { i + total } else { i }).collect();
    let inside: Vec<bool> = norm.iter().map(|&i| i >= off && i < off + rows).collect();
    let local: Vec<i64> = norm.iter().zip(&inside).map(|(&i, &ok)| if ok { i - off } else { 0 }).collect();
    Ok((Tensor::i64(idx.shape().to_vec(), local), inside))
}

/// `t` with every element `e` for which `keep(e)` is false set to zero (float tensors only).
fn zero_outside(t: Tensor, keep: impl Fn(usize) -> bool) -> Result<Tensor, String> {
    fn go<T: Copy + Default>(v: &mut [T], keep: impl Fn(usize) -> bool) {
        v.iter_mut().enumerate().filter(|(e, _)| !keep(*e)).for_each(|(_, x)| *x = T::default());
    }
    let shape = t.shape().to_vec();
    let mut data = t.into_data();
    match &mut data {
        ir::Data::F32(v) => go(v, keep),
        ir::Data::F64(v) => go(v, keep),
        d => return Err(format!("masking a {} tensor: only floats carry gathered rows", d.dtype())),
    }
    Tensor::new(shape, data).map_err(|e| e.to_string())
}

/// Where rank `rank`'s block of a dropout's output (layout `spec`, global `shape`) lies, drawing
/// from `stream`: its offsets from the layout and the rank's mesh coordinate.
pub(crate) fn dropout_draw(
    stream: &Stream,
    shape: &[usize],
    spec: &ShardingSpec,
    mesh: &DeviceMesh,
    rank: usize,
) -> kernels::random::Draw {
    kernels::random::Draw { stream: *stream, shape: shape.to_vec(), offsets: spec.offsets(shape, mesh, rank) }
}

/// Runs one compiled kernel on this rank; returns the outputs and the seconds spent in the
/// kernel's own collectives.
pub(crate) fn run_kernel(
    ctx: &CpuContext,
    k: &Kernel,
    ins: &[&Tensor],
    mesh: &DeviceMesh,
    comm: &mut dyn Communicator,
    rank: usize,
    stream: Option<&Stream>,
) -> Result<(Vec<Tensor>, f64), KernelFailure> {
    let kfail = |e: kernels::Error| KernelFailure::Kernel(e.to_string());
    match k {
        Kernel::Same(op) => Ok((kernels::cpu::eval(ctx, op, ins).map_err(kfail)?, 0.0)),
        Kernel::Dropout { attrs, shape, spec } => {
            let Some(&x) = ins.first() else {
                return Err(KernelFailure::Kernel(format!("dropout of {} inputs", ins.len())));
            };
            let draw = stream.map(|s| dropout_draw(s, shape, spec, mesh, rank));
            Ok((kernels::cpu::random::dropout(ctx, attrs, x, draw.as_ref()).map_err(kfail)?, 0.0))
        }
        Kernel::QueryBlock { op, axes, rows } => {
            let op = sharding::shift_queries(op, mesh.index_in_group(rank, axes) * rows);
            Ok((kernels::cpu::eval(ctx, &op, ins).map_err(kfail)?, 0.0))
        }
        Kernel::MaskedGather { op, axis, axes, rows, total } => {
            let (Some(&table), Some(&idx)) = (ins.first(), ins.get(1)) else {
                return Err(KernelFailure::Kernel(format!("masked gather of {} inputs", ins.len())));
            };
            let off = mesh.index_in_group(rank, axes) * rows;
            let (li, inside) = local_indices(idx, off, *rows, *total).map_err(KernelFailure::Kernel)?;
            let out = eval1(ctx, op, &[table, &li])?;
            let inner: usize = table.shape().get(axis + 1..).unwrap_or(&[]).iter().product();
            let n = inside.len().max(1);
            let out = zero_outside(out, |e| inside[(e / inner.max(1)) % n]).map_err(KernelFailure::Kernel)?;
            Ok((vec![out], 0.0))
        }
        Kernel::MaskedScatter { op, axes, rows, total, pre, .. } => {
            let (Some(&idx), Some(&dy)) = (ins.first(), ins.get(1)) else {
                return Err(KernelFailure::Kernel(format!("masked scatter of {} inputs", ins.len())));
            };
            let off = mesh.index_in_group(rank, axes) * rows;
            let (li, inside) = local_indices(idx, off, *rows, *total).map_err(KernelFailure::Kernel)?;
            let n = inside.len().max(1);
            let inner: usize = dy.numel() / (*pre).max(1) / n;
            let dy = zero_outside(dy.clone(), |e| inside[(e / inner.max(1)) % n]).map_err(KernelFailure::Kernel)?;
            Ok((kernels::cpu::eval(ctx, op, &[&li, &dy]).map_err(kfail)?, 0.0))
        }
        Kernel::SplitSoftmax { axis, log, axes } => {
            let red = |k| Op::Reduce { op: k, axes: vec![*axis], keepdims: true };
            let Some(&x) = ins.first() else {
                return Err(KernelFailure::Kernel("split softmax of no input".into()));
            };
            let mut waited = 0.0;
            let mut all = |t: &Tensor, op: ReduceKind| -> Result<Tensor, KernelFailure> {
                let t0 = Instant::now();
                let r =
                    comm.run(&Collective::AllReduce { axes: axes.clone(), op }, mesh, t).map_err(KernelFailure::Comm);
                waited += t0.elapsed().as_secs_f64();
                r
            };
            let m = eval1(ctx, &red(ReduceOp::Max), &[x])?;
            let m = all(&m, ReduceKind::Max)?;
            let z = eval1(ctx, &Op::Binary(BinaryOp::Sub), &[x, &m])?;
            let e = eval1(ctx, &Op::Unary(UnaryOp::Exp), &[&z])?;
            let s = eval1(ctx, &red(ReduceOp::Sum), &[&e])?;
            let s = all(&s, ReduceKind::Sum)?;
            let y = if *log {
                let ls = eval1(ctx, &Op::Unary(UnaryOp::Log), &[&s])?;
                eval1(ctx, &Op::Binary(BinaryOp::Sub), &[&z, &ls])?
            } else {
                eval1(ctx, &Op::Binary(BinaryOp::Div), &[&e, &s])?
            };
            Ok((vec![y], waited))
        }
    }
}
