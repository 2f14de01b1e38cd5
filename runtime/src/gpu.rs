//! Executing a distributed plan on GPUs (feature `cuda`): the `nccl` back end.
//!
//! One process (or thread) per rank, each on its own GPU. A [`GpuRank`] walks the same
//! compiled [`Program`] as the CPU executor ([`Program::step`]), in the same order, with
//! [`CudaTensor`] values: kernels through [`kernels::cuda::eval`], the plan's collectives through
//! NCCL on the sub-communicator of their group ([`NcclGroups`]), frees by dropping the device
//! tensors.
//!
//! The rank's host state comes from the CPU path unchanged ([`Program::init_rank`] or a
//! checkpoint through [`Program::empty_rank`]), and is uploaded once by [`GpuRank::new`]:
//! parameters, optimizer state, constants and feeds stay on the device between steps. Each step
//! downloads only the graph outputs (the loss); [`GpuRank::host_state`] downloads the
//! parameters and optimizer state for checkpoints and `--save`.
//!
//! Mapping of the plan's collectives (groups of one rank are no-ops, so a one-rank run needs no
//! NCCL library at all):
//! - `AllReduce` is an NCCL all-reduce (sum or max); `Broadcast` an NCCL broadcast from member 0;
//! - `AllGather` / `ReduceScatter` along dim `d`: NCCL works on dim 0, so `d` is transposed to
//!   the front and back around the call;
//! - `AllToAll`: an all-gather of the whole blocks, then each member keeps its piece of every
//!   sender and concatenates them (correct, not bandwidth-optimal: `n` times the data moves);
//! - `Slice` and `MakePartial` are local (a slice kernel, a zero tensor).
//!
//! The three special local computations of [`sharding::Local`] (masked gather and scatter over a
//! split table, a softmax split over ranks) run on the host through the CPU executor's code, on
//! downloaded inputs, with their collectives through NCCL ([`NcclHost`]): correct first; they
//! appear only in vocabulary-parallel plans.
//!
//! Invariants:
//! - Every rank runs the same instructions in the same order, so NCCL calls meet; communicators
//!   are made lazily, the first time a group is used, which every member does at the same
//!   instruction.
//! - A group's NCCL id is shared through a file in one directory ([`NcclGroups::new`]) and the
//!   file is removed once the communicator exists (every member has read it by then), so a
//!   later run in the same directory never reads a stale id.
//! - The measured peak of a step is the device context's peak bytes during the step
//!   ([`CudaContext::peak_bytes`]): everything the rank held on its GPU, resident state and
//!   kernel scratch included.
//! - NCCL has no abort: a rank that fails exits its process, and the launcher (mpirun) ends the
//!   others; ranks started by hand must be stopped by hand.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::cpu::Cpu;
use ir::{Op, SliceAxis, Tensor, TensorMeta};
use kernels::cuda::nccl::{NcclComm, Reduction, group_id_path};
use kernels::cuda::{self, CudaContext, CudaTensor};
use sharding::{Collective, DeviceMesh, ReduceKind, sim};

use crate::checkpoint;
use crate::comm::{CommError, Communicator};
use crate::cpu::run_kernel;
use crate::error::DistError;
use crate::program::{Kernel, KernelFailure, Program, RankState, StepResult};
use crate::rank::StepReport;

/// The NCCL communicators of one rank, one per group of global ranks, made on first use.
pub struct NcclGroups {
    rank: usize,
    world: usize,
    dir: PathBuf,
    timeout: Duration,
    comms: HashMap<Vec<usize>, NcclComm>,
}

impl NcclGroups {
    /// Rank `rank` of `world`; groups meet through id files in `dir` (created if missing; it
    /// must be the same directory, on a shared file system, for every rank), waiting at most
    /// `timeout` for a group's first rank.
    pub fn new(rank: usize, world: usize, dir: PathBuf, timeout: Duration) -> NcclGroups {
        NcclGroups { rank, world, dir, timeout, comms: HashMap::new() }
    }

    /// The communicator of `group` (global ranks in group order, this rank among them).
    fn get(&mut self, ctx: &CudaContext, group: &[usize]) -> Result<&NcclComm, CommError> {
        let rank = self.rank;
        if !self.comms.contains_key(group) {
            let fail = |message: String| CommError::Backend { rank, message };
            std::fs::create_dir_all(&self.dir)
                .map_err(|e| fail(format!("cannot create the NCCL id directory {}: {e}", self.dir.display())))?;
            let comm = NcclComm::for_group(ctx, rank, group, &self.dir, self.timeout)
                .map_err(|e| fail(format!("NCCL communicator of ranks {group:?}: {e}")))?;
            if comm.rank() == 0 {
                // Every member has joined, so every member has read the id.
                std::fs::remove_file(group_id_path(&self.dir, group)).ok();
            }
            self.comms.insert(group.to_vec(), comm);
        }
        self.comms
            .get(group)
            .ok_or_else(|| CommError::Backend { rank, message: format!("no communicator for {group:?}") })
    }
}

/// A [`Communicator`] on host tensors through NCCL: tensors are uploaded, gathered or reduced on
/// the device, and downloaded. For the few host-side exchanges of a GPU run (the loss, the step
/// report, checkpoint sums, `--save`) and the host-side special kernels; blocks exchanged in one
/// call must have equal metas on every member (they do in SPMD plans).
pub struct NcclHost<'a> {
    ctx: &'a CudaContext,
    groups: &'a mut NcclGroups,
}

impl<'a> NcclHost<'a> {
    /// Host collectives of `groups` on `ctx`'s device.
    pub fn new(ctx: &'a CudaContext, groups: &'a mut NcclGroups) -> NcclHost<'a> {
        NcclHost { ctx, groups }
    }

    /// Maps a CUDA or NCCL failure of this rank (a function, not a method: it is used while a
    /// communicator borrows the groups).
    fn fail(&self) -> impl Fn(kernels::Error) -> CommError + use<> {
        let rank = self.groups.rank;
        move |e| CommError::Backend { rank, message: e.to_string() }
    }

    /// Every member's `t` (equal metas), in group order.
    fn gather(&mut self, group: &[usize], t: &Tensor) -> Result<Vec<Tensor>, CommError> {
        let n = group.len();
        if n == 1 {
            return Ok(vec![t.clone()]);
        }
        let (ctx, fail) = (self.ctx, self.fail());
        let flat = t.clone().reshaped(vec![t.numel()]).map_err(|e| self.bad(e.to_string()))?;
        let d = CudaTensor::upload(ctx, &flat).map_err(&fail)?;
        let comm = self.groups.get(ctx, group)?;
        let all = comm.all_gather(ctx, &d).and_then(|g| g.download(ctx)).map_err(&fail)?;
        let all = all.reshaped(vec![n, t.numel()]).map_err(|e| self.bad(e.to_string()))?;
        (0..n)
            .map(|j| {
                let row = sim::checked_block(&all, &[j, 0], &[1, t.numel()]).map_err(|e| self.bad(e.to_string()))?;
                row.reshaped(t.shape().to_vec()).map_err(|e| self.bad(e.to_string()))
            })
            .collect()
    }

    fn bad(&self, why: String) -> CommError {
        CommError::Bad { rank: self.groups.rank, why }
    }
}

impl Communicator for NcclHost<'_> {
    fn rank(&self) -> usize {
        self.groups.rank
    }
    fn size(&self) -> usize {
        self.groups.world
    }
    fn exchange(&mut self, group: &[usize], block: Arc<Tensor>) -> Result<Vec<Arc<Tensor>>, CommError> {
        Ok(self.gather(group, &block)?.into_iter().map(Arc::new).collect())
    }
    fn exchange_pieces(&mut self, group: &[usize], pieces: Vec<Tensor>) -> Result<Vec<Tensor>, CommError> {
        // Everyone gathers every piece, then keeps the ones addressed to it.
        let me = group.iter().position(|&r| r == self.groups.rank).ok_or_else(|| self.bad("not in group".into()))?;
        let first = pieces.first().ok_or_else(|| self.bad("no pieces".into()))?.meta();
        if pieces.len() != group.len() || pieces.iter().any(|p| p.meta() != first) {
            return Err(self.bad("the nccl back end exchanges pieces of equal metas only".into()));
        }
        // Round j gathers every member's piece for member j: all members take part in every
        // round, and member j keeps round j.
        let mut received = vec![];
        for (j, t) in pieces.iter().enumerate() {
            let all = self.gather(group, t)?;
            if j == me {
                received = all;
            }
        }
        Ok(received)
    }
    fn all_reduce(&mut self, group: &[usize], block: &Tensor, op: ReduceKind) -> Result<Tensor, CommError> {
        if group.len() == 1 {
            return Ok(block.clone());
        }
        let (ctx, fail) = (self.ctx, self.fail());
        let d = CudaTensor::upload(ctx, block).map_err(&fail)?;
        let comm = self.groups.get(ctx, group)?;
        comm.all_reduce(ctx, &d, reduction(op)).and_then(|y| y.download(ctx)).map_err(&fail)
    }
    /// NCCL has no abort: the failing process exits and its launcher stops the others.
    fn abort(&self, _cause: &str) {}
}

fn reduction(op: ReduceKind) -> Reduction {
    match op {
        ReduceKind::Sum => Reduction::Sum,
        ReduceKind::Max => Reduction::Max,
    }
}

/// One rank's blocks on its GPU and its communicators (see the module docs).
pub struct GpuRank {
    /// The rank.
    pub rank: usize,
    /// Steps run so far (including those of a loaded checkpoint).
    pub steps_done: u64,
    ctx: CudaContext,
    groups: NcclGroups,
    /// Host context for the special kernels that run on the host.
    host: Cpu,
    storage: BTreeMap<String, CudaTensor>,
    constants: Vec<CudaTensor>,
    feeds: Vec<CudaTensor>,
}

impl GpuRank {
    /// Uploads a rank's host state (from [`Program::init_rank`] or a checkpoint) to `ctx`'s
    /// device; collectives go through `groups`. `host` runs the host-side special kernels.
    pub fn new(ctx: CudaContext, groups: NcclGroups, host: Cpu, st: RankState) -> Result<GpuRank, DistError> {
        let rank = st.rank;
        let up = |t: &Tensor| CudaTensor::upload(&ctx, t).map_err(|e| DistError::Data { rank, message: e.to_string() });
        let storage = st.storage.iter().map(|(k, t)| Ok((k.clone(), up(t)?))).collect::<Result<_, DistError>>()?;
        let constants = st.constants.iter().map(|t| up(t)).collect::<Result<_, _>>()?;
        let feeds = st.feeds.iter().map(|t| up(t)).collect::<Result<_, _>>()?;
        Ok(GpuRank { rank, steps_done: st.steps_done, ctx, groups, host, storage, constants, feeds })
    }

    /// The device context.
    pub fn context(&self) -> &CudaContext {
        &self.ctx
    }

    /// A host communicator over this rank's NCCL groups (every rank must call the same
    /// collectives on it).
    pub fn host_comm(&mut self) -> NcclHost<'_> {
        NcclHost::new(&self.ctx, &mut self.groups)
    }

    /// The parameters and optimizer state downloaded into a host [`RankState`] (no constants or
    /// feeds), for checkpoints and saving.
    pub fn host_state(&self) -> Result<RankState, DistError> {
        let storage = self
            .storage
            .iter()
            .map(|(k, t)| {
                let h =
                    t.download(&self.ctx).map_err(|e| DistError::Data { rank: self.rank, message: e.to_string() })?;
                Ok((k.clone(), h))
            })
            .collect::<Result<_, DistError>>()?;
        Ok(RankState {
            rank: self.rank,
            storage,
            constants: vec![],
            feeds: vec![],
            steps_done: self.steps_done,
            profile: None,
        })
    }

    /// The loss on this rank's feeds with `blocks` (host blocks, uploaded) in their places,
    /// forward only: nothing is updated ([`Program::eval`]).
    pub fn eval(
        &mut self,
        program: &Program,
        blocks: Vec<(usize, std::sync::Arc<Tensor>)>,
    ) -> Result<StepResult, DistError> {
        self.ctx.reset_peak();
        let rank = self.rank;
        let mut up: BTreeMap<usize, CudaTensor> = BTreeMap::new();
        for (k, t) in blocks {
            up.insert(
                k,
                CudaTensor::upload(&self.ctx, &t).map_err(|e| DistError::Data { rank, message: e.to_string() })?,
            );
        }
        let GpuRank { ctx, groups, host, storage, constants, feeds, .. } = self;
        let feeds: Vec<&CudaTensor> = feeds.iter().enumerate().map(|(k, t)| up.get(&k).unwrap_or(t)).collect();
        let constants: Vec<&CudaTensor> = constants.iter().collect();
        let mut b = GpuExec { rank, ctx, groups, host: host.context() };
        let mut scratch = BTreeMap::new();
        let storage = crate::exec::Storage::Borrowed { params: storage, updates: &mut scratch };
        crate::exec::step(program, &mut b, storage, &feeds, &constants, false, crate::exec::Mode::Eval)
    }

    /// Runs one training step of `program` (see the module docs).
    pub fn step(&mut self, program: &Program, profile: bool) -> Result<StepResult, DistError> {
        self.ctx.reset_peak();
        let GpuRank { rank, steps_done, ctx, groups, host, storage, constants, feeds } = self;
        let feeds: Vec<&CudaTensor> = feeds.iter().collect();
        let constants: Vec<&CudaTensor> = constants.iter().collect();
        let mut b = GpuExec { rank: *rank, ctx, groups, host: host.context() };
        let storage = crate::exec::Storage::Owned(storage);
        let mode = crate::exec::Mode::Train(program.step_key(*steps_done));
        let r = crate::exec::step(program, &mut b, storage, &feeds, &constants, profile, mode)?;
        *steps_done += 1;
        Ok(r)
    }
}

/// A GPU rank as the executor's back end: device tensors, kernels on `ctx`, collectives
/// through NCCL, the special kernels on the host (`host`).
struct GpuExec<'a> {
    rank: usize,
    ctx: &'a CudaContext,
    groups: &'a mut NcclGroups,
    host: &'a kernels::cpu::CpuContext,
}

impl crate::exec::Backend for GpuExec<'_> {
    type T = CudaTensor;
    fn rank(&self) -> usize {
        self.rank
    }
    fn bytes(t: &CudaTensor) -> u64 {
        t.bytes() as u64
    }
    fn shape(t: &CudaTensor) -> &[usize] {
        t.shape()
    }
    fn eval(
        &mut self,
        k: &Kernel,
        ins: &[&CudaTensor],
        mesh: &DeviceMesh,
        stream: Option<&crate::program::Stream>,
    ) -> Result<(Vec<CudaTensor>, f64), KernelFailure> {
        let fail = |e: kernels::Error| KernelFailure::Kernel(e.to_string());
        match k {
            Kernel::Same(op) => Ok((cuda::eval(self.ctx, op, ins).map_err(fail)?, 0.0)),
            Kernel::QueryBlock { op, axes, rows } => {
                let op = sharding::shift_queries(op, mesh.index_in_group(self.rank, axes) * rows);
                Ok((cuda::eval(self.ctx, &op, ins).map_err(fail)?, 0.0))
            }
            Kernel::Dropout { attrs, shape, spec } => {
                let Some(&x) = ins.first() else {
                    return Err(KernelFailure::Kernel(format!("dropout of {} inputs", ins.len())));
                };
                let draw = stream.map(|s| crate::cpu::dropout_draw(s, shape, spec, mesh, self.rank));
                Ok((cuda::dropout(self.ctx, attrs, x, draw.as_ref()).map_err(fail)?, 0.0))
            }
            special => {
                let t1 = Instant::now();
                let outs = self.on_host(special, ins, mesh)?;
                Ok((outs, t1.elapsed().as_secs_f64()))
            }
        }
    }
    fn sync(&mut self) -> Result<(), DistError> {
        self.ctx.synchronize().map_err(|e| self.comm_err(e))
    }
    fn collective(&mut self, c: &Collective, mesh: &DeviceMesh, x: &CudaTensor) -> Result<CudaTensor, DistError> {
        let y = GpuExec::collective(self, c, mesh, x)?;
        // Collectives are queued on the stream: wait, so the time is theirs.
        self.ctx.synchronize().map_err(|e| self.comm_err(e))?;
        Ok(y)
    }
    fn gather_output(&mut self, everyone: &[usize], x: &CudaTensor) -> Result<Vec<Tensor>, DistError> {
        let rank = self.rank;
        let x = x.download(self.ctx).map_err(|e| DistError::Data { rank, message: e.to_string() })?;
        let mut comm = NcclHost::new(self.ctx, &mut *self.groups);
        Ok(comm.exchange(everyone, Arc::new(x))?.iter().map(|t| (**t).clone()).collect())
    }
    fn download(&mut self, x: CudaTensor) -> Result<Tensor, DistError> {
        let rank = self.rank;
        x.download(self.ctx).map_err(|e| DistError::Data { rank, message: e.to_string() })
    }
    /// On the communicator of the two ranks (made on first use by both), NCCL's send.
    /// NCCL has no tags: blocks meet in the order sent (the launcher runs only plans whose
    /// transfers between two ranks are received in that order).
    fn send(&mut self, to: usize, _tag: u64, x: &CudaTensor) -> Result<(), DistError> {
        let rank = self.rank;
        let pair = crate::comm::pair(rank, to).map_err(|why| CommError::Bad { rank, why })?;
        let err = |e: kernels::Error| DistError::Comm(CommError::Backend { rank, message: e.to_string() });
        let comm = self.groups.get(self.ctx, &pair)?;
        comm.send(x, usize::from(to > rank)).map_err(err)?;
        self.ctx.synchronize().map_err(err)
    }
    fn recv(&mut self, from: usize, _tag: u64, meta: &TensorMeta) -> Result<CudaTensor, DistError> {
        let rank = self.rank;
        let pair = crate::comm::pair(rank, from).map_err(|why| CommError::Bad { rank, why })?;
        let err = |e: kernels::Error| DistError::Comm(CommError::Backend { rank, message: e.to_string() });
        let comm = self.groups.get(self.ctx, &pair)?;
        let y = comm.recv(self.ctx, meta, usize::from(from > rank)).map_err(err)?;
        self.ctx.synchronize().map_err(err)?;
        Ok(y)
    }
    fn peak_bytes(&self, _counted: u64) -> u64 {
        self.ctx.peak_bytes() as u64
    }
}

impl GpuExec<'_> {
    fn comm_err(&self, e: kernels::Error) -> DistError {
        DistError::Comm(CommError::Backend { rank: self.rank, message: e.to_string() })
    }

    /// A special kernel on the host: inputs downloaded, the CPU executor's code, outputs
    /// uploaded.
    fn on_host(
        &mut self,
        k: &Kernel,
        ins: &[&CudaTensor],
        mesh: &DeviceMesh,
    ) -> Result<Vec<CudaTensor>, KernelFailure> {
        let fail = |e: kernels::Error| KernelFailure::Kernel(e.to_string());
        let host: Vec<Tensor> = ins.iter().map(|t| t.download(self.ctx)).collect::<Result<_, _>>().map_err(fail)?;
        let refs: Vec<&Tensor> = host.iter().collect();
        let rank = self.rank;
        let mut comm = NcclHost::new(self.ctx, &mut *self.groups);
        let (outs, _) = run_kernel(self.host, k, &refs, mesh, &mut comm, rank, None)?;
        outs.iter().map(|t| CudaTensor::upload(self.ctx, t).map_err(fail)).collect()
    }

    /// One plan collective on the device (see the module docs for the mapping).
    fn collective(&mut self, c: &Collective, mesh: &DeviceMesh, x: &CudaTensor) -> Result<CudaTensor, DistError> {
        let rank = self.rank;
        let (group, i) = crate::comm::group_of(c, mesh, rank, x.shape())
            .map_err(|why| DistError::Comm(CommError::Bad { rank, why }))?;
        let n = group.len();
        if n == 1 {
            return Ok(x.clone());
        }
        let ctx = self.ctx;
        let fail = |e: kernels::Error| DistError::Comm(CommError::Backend { rank, message: e.to_string() });
        let eval1 = |op: Op, t: &CudaTensor| cuda::eval(ctx, &op, &[t]).map(|mut v| v.swap_remove(0)).map_err(fail);
        // Piece `j` of `n` along `dim`.
        let piece = |t: &CudaTensor, dim: usize, j: usize| {
            let len = t.shape()[dim] / n;
            eval1(Op::Slice { axes: vec![SliceAxis { axis: dim, start: (j * len) as i64, len, step: 1 }] }, t)
        };
        // Dim `d` moved to the front, and back.
        let front = |t: &CudaTensor, d: usize| {
            if d == 0 {
                return Ok(t.clone());
            }
            let mut perm: Vec<usize> = vec![d];
            perm.extend((0..t.shape().len()).filter(|&k| k != d));
            eval1(Op::Transpose { perm }, t)
        };
        let back = |t: &CudaTensor, d: usize| {
            if d == 0 {
                return Ok(t.clone());
            }
            let perm = (0..t.shape().len())
                .map(|k| {
                    if k < d {
                        k + 1
                    } else if k == d {
                        0
                    } else {
                        k
                    }
                })
                .collect();
            eval1(Op::Transpose { perm }, t)
        };
        match c {
            Collective::Slice { dim, .. } => piece(x, *dim, i),
            Collective::MakePartial { .. } => {
                if i == 0 {
                    Ok(x.clone())
                } else {
                    CudaTensor::zeros(ctx, x.meta()).map_err(fail)
                }
            }
            Collective::AllReduce { op, .. } => {
                let comm = self.groups.get(ctx, &group)?;
                comm.all_reduce(ctx, x, reduction(*op)).map_err(fail)
            }
            Collective::Broadcast { .. } => {
                let comm = self.groups.get(ctx, &group)?;
                comm.broadcast(ctx, Some(x), x.meta(), 0).map_err(fail)
            }
            Collective::AllGather { dim, .. } => {
                let t = front(x, *dim)?;
                let comm = self.groups.get(ctx, &group)?;
                let g = comm.all_gather(ctx, &t).map_err(fail)?;
                back(&g, *dim)
            }
            Collective::ReduceScatter { dim, .. } => {
                let t = front(x, *dim)?;
                let comm = self.groups.get(ctx, &group)?;
                let r = comm.reduce_scatter(ctx, &t, Reduction::Sum).map_err(fail)?;
                back(&r, *dim)
            }
            Collective::AllToAll { split_dim, concat_dim, .. } => {
                // Gather every member's whole block as [n, ...], keep our piece of each along
                // the split dim, then merge the member axis into the concat dim (member-major).
                let mut shape1 = vec![1];
                shape1.extend_from_slice(x.shape());
                let u = eval1(Op::Reshape { shape: shape1 }, x)?;
                let comm = self.groups.get(ctx, &group)?;
                let g = comm.all_gather(ctx, &u).map_err(fail)?;
                let p = piece(&g, split_dim + 1, i)?;
                let r = x.shape().len();
                let mut perm: Vec<usize> = (1..=*concat_dim).collect();
                perm.push(0);
                perm.extend(concat_dim + 1..=r);
                let t = eval1(Op::Transpose { perm }, &p)?;
                let mut merged: Vec<usize> = p.shape()[1..].to_vec();
                merged[*concat_dim] *= n;
                eval1(Op::Reshape { shape: merged }, &t)
            }
        }
    }
}

impl crate::rank::Rank for GpuRank {
    fn rank(&self) -> usize {
        self.rank
    }
    fn steps_done(&self) -> u64 {
        self.steps_done
    }
    // No abort to wait for in NCCL: a hang is a hang.
    fn check(&mut self) -> Result<(), DistError> {
        Ok(())
    }
    fn step(&mut self, program: &Program, profile: bool) -> Result<StepResult, DistError> {
        GpuRank::step(self, program, profile)
    }
    fn report(&mut self, everyone: &[usize], step: u64, r: &StepResult) -> Result<StepReport, DistError> {
        crate::rank::step_report(&mut self.host_comm(), everyone, step, r)
    }
    // Written from downloaded blocks.
    fn checkpoint(
        &mut self,
        program: &Program,
        dir: &std::path::Path,
        run_id: &str,
        data: Option<&crate::data::Position>,
        exit: bool,
    ) -> Result<PathBuf, DistError> {
        let host = self.host_state()?;
        checkpoint::write(dir, run_id, program, &host, &mut self.host_comm(), data, exit)
    }
    fn eval(
        &mut self,
        program: &Program,
        blocks: Vec<(usize, std::sync::Arc<Tensor>)>,
    ) -> Result<StepResult, DistError> {
        GpuRank::eval(self, program, blocks)
    }
    fn set_feed_blocks(&mut self, blocks: Vec<(usize, std::sync::Arc<Tensor>)>) -> Result<(), DistError> {
        let rank = self.rank;
        let up = blocks
            .into_iter()
            .map(|(k, t)| {
                let d =
                    CudaTensor::upload(&self.ctx, &t).map_err(|e| DistError::Data { rank, message: e.to_string() })?;
                Ok((k, d))
            })
            .collect::<Result<Vec<_>, DistError>>()?;
        crate::program::set_blocks(&mut self.feeds, up, rank)
    }
    fn poison(&mut self) -> Result<(), DistError> {
        let name = ir::autodiff::LOSS_SCALE_POISON;
        if !self.storage.contains_key(name) {
            return Err(DistError::Plan(format!(
                "rank {}: an injected non-finite gradient needs a plan with loss scaling (--precision fp16)",
                self.rank
            )));
        }
        let inf = CudaTensor::upload(&self.ctx, &Tensor::scalar_f32(f32::INFINITY))
            .map_err(|e| DistError::Plan(format!("rank {}: {e}", self.rank)))?;
        self.storage.insert(name.to_string(), inf);
        Ok(())
    }
}
