//! NCCL collectives on [`CudaTensor`]s: one process (or thread) per GPU, one communicator per
//! rank group.
//!
//! Setting up: the ranks of a group share one [`NcclId`], made by the group's first rank and
//! passed to the others out of band. [`share_id_through_file`] does that through a file (the
//! first rank writes it atomically, the others poll for it with a timeout); the runtime can
//! pass the bytes ([`NcclId::as_bytes`], [`NcclId::from_bytes`]) through MPI instead. Each rank
//! then calls [`NcclComm::new`] with its rank in the group; the call blocks until every rank of
//! the group has joined.
//!
//! Sub-communicators (a mesh axis, a data-parallel group) are communicators of their own, each
//! made from its own id: cudarc 0.19 does not expose `ncclCommSplit` for the CUDA version this
//! crate is built against. [`NcclComm::for_group`] derives a per-group id file name from the
//! group's global ranks, so every group of a mesh can meet in one directory.
//!
//! Semantics, for callers arranging tensors:
//! - every call is collective over the communicator's ranks, with tensors of equal metas;
//! - `all_gather` concatenates the ranks' tensors along dim 0 in rank order (NCCL gathers
//!   contiguous blocks); gathering along another dim means transposing it to the front first;
//! - `reduce_scatter` reduces, then leaves rank `r` the `r`-th of `world` equal blocks along dim
//!   0 (dim 0 must divide by the world size);
//! - results are new tensors (inputs are never written), queued on the context's stream like
//!   any op. Bool tensors travel as bytes: only `Max` (logical or) and `Min` (and) reduce them.
//!
//! A communicator holds a raw NCCL handle and is neither `Send` nor `Sync`: use it on the thread
//! that made it. cudarc loads `libnccl.so` (or `.so.{12,11,10,9,1}`), not `libnccl.so.2`; see
//! the [backend docs](super) for the symlink.

use super::device::{CudaContext, DeviceBuf, cuda_err};
use super::tensor::{Buf, CudaTensor};
use crate::Error;
use cudarc::nccl::{Comm, Id, NcclType, ReduceOp};
use ir::{DType, TensorMeta};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Bytes of an NCCL unique id.
pub const ID_BYTES: usize = 128;

/// The unique id all ranks of one communicator are created from.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclId([u8; ID_BYTES]);

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclId({:02x}{:02x}{:02x}{:02x}..)", self.0[0], self.0[1], self.0[2], self.0[3])
    }
}

fn nccl_err(op: &'static str, e: cudarc::nccl::result::NcclError) -> Error {
    Error::Cuda { op, message: format!("NCCL {:?}", e.0) }
}

/// Errors unless the NCCL library can be loaded.
fn nccl_present() -> Result<(), Error> {
    // SAFETY: only tries to open the shared library by name.
    if unsafe { cudarc::nccl::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(Error::NoCudaDevice(
            "libnccl.so not found (install libnccl-dev, or link libnccl.so to libnccl.so.2)".into(),
        ))
    }
}

impl NcclId {
    /// A fresh id (call on one rank of the group, then share it).
    pub fn new() -> Result<NcclId, Error> {
        nccl_present()?;
        let id = Id::new().map_err(|e| nccl_err("nccl_id", e))?;
        Ok(NcclId(id.internal().map(|c| c as u8)))
    }

    /// The id from the bytes another rank sent.
    pub fn from_bytes(bytes: &[u8]) -> Result<NcclId, Error> {
        let b: [u8; ID_BYTES] = bytes
            .try_into()
            .map_err(|_| Error::Rendezvous(format!("an NCCL id has {ID_BYTES} bytes, got {}", bytes.len())))?;
        Ok(NcclId(b))
    }

    /// The bytes to send to the other ranks.
    pub fn as_bytes(&self) -> &[u8; ID_BYTES] {
        &self.0
    }

    fn to_nccl(self) -> Id {
        Id::uninit(self.0.map(|b| b as std::ffi::c_char))
    }
}

/// Writes `id` to `path` atomically (a temporary file in the same directory, then a rename), so
/// that a reader never sees a partial id.
pub fn write_id_file(path: &Path, id: &NcclId) -> Result<(), Error> {
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    let fail = |what: &str, e: std::io::Error| Error::Rendezvous(format!("{what} {}: {e}", path.display()));
    std::fs::write(&tmp, id.as_bytes()).map_err(|e| fail("cannot write the NCCL id to", e))?;
    std::fs::rename(&tmp, path).map_err(|e| fail("cannot move the NCCL id into place at", e))
}

/// Polls `path` until an id written by [`write_id_file`] appears, or `timeout` passes.
pub fn read_id_file(path: &Path, timeout: Duration) -> Result<NcclId, Error> {
    let start = Instant::now();
    loop {
        // Only a regular file of at most an id's size is read: a path naming a device or a FIFO,
        // or a huge file, is an error rather than an endless read.
        match ir::files::read_regular(path, ID_BYTES as u64) {
            Ok(bytes) if bytes.len() == ID_BYTES => return NcclId::from_bytes(&bytes),
            Ok(bytes) => {
                return Err(Error::Rendezvous(format!(
                    "{} holds {} bytes, not an NCCL id of {ID_BYTES}",
                    path.display(),
                    bytes.len()
                )));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::Rendezvous(format!("cannot read {}: {e}", path.display()))),
        }
        if start.elapsed() >= timeout {
            return Err(Error::Rendezvous(format!(
                "no NCCL id at {} after {:.1} s (did the group's first rank start?)",
                path.display(),
                timeout.as_secs_f64()
            )));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The id of a group shared through `path`: the group's rank 0 makes it and writes it, the
/// others wait for it (at most `timeout`). Use a path unique to the run: a file left by an
/// earlier run would be read as this run's id.
pub fn share_id_through_file(path: &Path, rank: usize, timeout: Duration) -> Result<NcclId, Error> {
    if rank == 0 {
        let id = NcclId::new()?;
        write_id_file(path, &id)?;
        Ok(id)
    } else {
        read_id_file(path, timeout)
    }
}

/// The id file of the group of global `ranks` inside `dir`: `nccl-id-<r0>-<r1>-...`.
pub fn group_id_path(dir: &Path, ranks: &[usize]) -> PathBuf {
    let names: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
    dir.join(format!("nccl-id-{}", names.join("-")))
}

/// How a collective combines the ranks' elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduction {
    /// Sum (numeric tensors).
    Sum,
    /// Maximum (logical or on bool).
    Max,
    /// Minimum (logical and on bool).
    Min,
}

impl Reduction {
    fn nccl(self) -> ReduceOp {
        match self {
            Reduction::Sum => ReduceOp::Sum,
            Reduction::Max => ReduceOp::Max,
            Reduction::Min => ReduceOp::Min,
        }
    }
}

/// One rank's end of an NCCL communicator, bound to a [`CudaContext`]'s device and stream.
#[derive(Debug)]
pub struct NcclComm {
    comm: Comm,
    rank: usize,
    world: usize,
}

impl NcclComm {
    /// Joins the communicator of `world` ranks made from `id`, as `rank`; blocks until all
    /// ranks have joined. Collectives run on `ctx`'s stream.
    pub fn new(ctx: &CudaContext, rank: usize, world: usize, id: &NcclId) -> Result<NcclComm, Error> {
        nccl_present()?;
        if world == 0 || rank >= world || i32::try_from(world).is_err() {
            return Err(Error::BadInput { op: "nccl", message: format!("rank {rank} of a world of {world}") });
        }
        // NCCL picks its device from the thread's current CUDA context.
        ctx.stream().context().bind_to_thread().map_err(|e| cuda_err("nccl_init", e))?;
        let comm =
            Comm::from_rank(ctx.stream().clone(), rank, world, id.to_nccl()).map_err(|e| nccl_err("nccl_init", e))?;
        Ok(NcclComm { comm, rank, world })
    }

    /// Joins the communicator of the group of global ranks `group` (in group order) as global
    /// rank `me`, meeting the others through an id file in `dir` ([`group_id_path`]).
    pub fn for_group(
        ctx: &CudaContext,
        me: usize,
        group: &[usize],
        dir: &Path,
        timeout: Duration,
    ) -> Result<NcclComm, Error> {
        let rank = group
            .iter()
            .position(|&r| r == me)
            .ok_or_else(|| Error::BadInput { op: "nccl", message: format!("rank {me} is not in group {group:?}") })?;
        let id = share_id_through_file(&group_id_path(dir, group), rank, timeout)?;
        NcclComm::new(ctx, rank, group.len(), &id)
    }

    /// This rank's index in the communicator.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Every rank receives the element-wise reduction of all ranks' `x`.
    pub fn all_reduce(&self, ctx: &CudaContext, x: &CudaTensor, r: Reduction) -> Result<CudaTensor, Error> {
        let op = "all_reduce";
        check_reduction(op, x, r)?;
        if x.dtype().is_half() {
            // Reduced in f32 (each sum rounded once), then rounded back.
            let sum = self.all_reduce(ctx, &super::elementwise::widen(ctx, x)?, r)?;
            return super::elementwise::narrow(ctx, &sum, x.dtype());
        }
        let n = x.numel();
        let red = r.nccl();
        let buf = match x.buf() {
            Buf::F32(s) => Buf::F32(self.collect(ctx, op, s, n, n, |c, a, b| c.all_reduce(a, b, &red))?),
            Buf::I64(s) => Buf::I64(self.collect(ctx, op, s, n, n, |c, a, b| c.all_reduce(a, b, &red))?),
            Buf::Bool(s) => Buf::Bool(self.collect(ctx, op, s, n, n, |c, a, b| c.all_reduce(a, b, &red))?),
            Buf::Half(_) => return Err(super::tensor::no_f64(op)),
        };
        Ok(CudaTensor::new(x.meta().clone(), buf))
    }

    /// The ranks' `x` concatenated along dim 0 in rank order (a scalar becomes a vector).
    pub fn all_gather(&self, ctx: &CudaContext, x: &CudaTensor) -> Result<CudaTensor, Error> {
        let op = "all_gather";
        let n = x.numel();
        let total = n * self.world;
        let buf = match x.buf() {
            Buf::F32(s) => Buf::F32(self.collect(ctx, op, s, n, total, |c, a, b| c.all_gather(a, b))?),
            Buf::I64(s) => Buf::I64(self.collect(ctx, op, s, n, total, |c, a, b| c.all_gather(a, b))?),
            Buf::Bool(s) => Buf::Bool(self.collect(ctx, op, s, n, total, |c, a, b| c.all_gather(a, b))?),
            Buf::Half(s) => Buf::Half(self.collect(ctx, op, s, 2 * n, 2 * total, |c, a, b| c.all_gather(a, b))?),
        };
        let mut shape = x.shape().to_vec();
        match shape.first_mut() {
            Some(d0) => *d0 *= self.world,
            None => shape.push(self.world),
        }
        Ok(CudaTensor::new(TensorMeta::new(x.dtype(), shape), buf))
    }

    /// Reduces all ranks' `x`, leaving this rank block `rank` of `world` equal blocks along
    /// dim 0.
    pub fn reduce_scatter(&self, ctx: &CudaContext, x: &CudaTensor, r: Reduction) -> Result<CudaTensor, Error> {
        let op = "reduce_scatter";
        check_reduction(op, x, r)?;
        if x.dtype().is_half() {
            let part = self.reduce_scatter(ctx, &super::elementwise::widen(ctx, x)?, r)?;
            return super::elementwise::narrow(ctx, &part, x.dtype());
        }
        let d0 = x.shape().first().copied().unwrap_or(0);
        if x.shape().is_empty() || d0 % self.world != 0 {
            return Err(Error::BadInput {
                op,
                message: format!("dim 0 of {:?} does not split into {} equal blocks", x.shape(), self.world),
            });
        }
        let n = x.numel();
        let part = n / self.world;
        let red = r.nccl();
        let buf = match x.buf() {
            Buf::F32(s) => Buf::F32(self.collect(ctx, op, s, n, part, |c, a, b| c.reduce_scatter(a, b, &red))?),
            Buf::I64(s) => Buf::I64(self.collect(ctx, op, s, n, part, |c, a, b| c.reduce_scatter(a, b, &red))?),
            Buf::Bool(s) => Buf::Bool(self.collect(ctx, op, s, n, part, |c, a, b| c.reduce_scatter(a, b, &red))?),
            Buf::Half(_) => return Err(super::tensor::no_f64(op)),
        };
        let mut shape = x.shape().to_vec();
        shape[0] = d0 / self.world;
        Ok(CudaTensor::new(TensorMeta::new(x.dtype(), shape), buf))
    }

    /// Every rank receives `root`'s tensor. `x` is the root's tensor (ignored elsewhere, where
    /// it may be `None`); `meta` is its meta, known to every rank.
    pub fn broadcast(
        &self,
        ctx: &CudaContext,
        x: Option<&CudaTensor>,
        meta: &TensorMeta,
        root: usize,
    ) -> Result<CudaTensor, Error> {
        let op = "broadcast";
        if root >= self.world {
            return Err(Error::BadInput { op, message: format!("root {root} of a world of {}", self.world) });
        }
        let src = if self.rank == root {
            let x = x.ok_or_else(|| Error::BadInput { op, message: "the root must pass its tensor".into() })?;
            if x.meta() != meta {
                return Err(Error::BadInput {
                    op,
                    message: format!("tensor {} is not the announced {meta}", x.meta()),
                });
            }
            Some(x)
        } else {
            None
        };
        let n = meta.numel();
        let root = root as i32;
        let buf = match meta.dtype {
            DType::F64 => return Err(super::tensor::no_f64(op)),
            DType::BF16 | DType::F16 => {
                Buf::Half(self.broadcast_one(ctx, op, src.map(|t| t.halves(op)).transpose()?, 2 * n, root)?)
            }
            DType::F32 => Buf::F32(self.broadcast_one(ctx, op, src.map(|t| t.f32s(op)).transpose()?, n, root)?),
            DType::I64 => Buf::I64(self.broadcast_one(ctx, op, src.map(|t| t.i64s(op)).transpose()?, n, root)?),
            DType::Bool => Buf::Bool(self.broadcast_one(ctx, op, src.map(|t| t.bools(op)).transpose()?, n, root)?),
        };
        Ok(CudaTensor::new(meta.clone(), buf))
    }

    /// Sends `x` to rank `peer`, which must call [`Self::recv`] with the same meta.
    pub fn send(&self, x: &CudaTensor, peer: usize) -> Result<(), Error> {
        let op = "send";
        let n = x.numel();
        let peer = self.peer(op, peer)?;
        if n == 0 {
            return Ok(());
        }
        let r = match x.buf() {
            Buf::F32(s) => self.comm.send(&s.s.slice(..n), peer),
            Buf::I64(s) => self.comm.send(&s.s.slice(..n), peer),
            Buf::Bool(s) => self.comm.send(&s.s.slice(..n), peer),
            Buf::Half(s) => self.comm.send(&s.s.slice(..2 * n), peer),
        };
        r.map_err(|e| nccl_err(op, e))
    }

    /// Receives a tensor of `meta` sent by rank `peer`.
    pub fn recv(&self, ctx: &CudaContext, meta: &TensorMeta, peer: usize) -> Result<CudaTensor, Error> {
        let op = "recv";
        let peer = self.peer(op, peer)?;
        let n = meta.numel();
        if n == 0 {
            return CudaTensor::zeros(ctx, meta);
        }
        fn go<T: NcclType + cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
            c: &Comm,
            ctx: &CudaContext,
            n: usize,
            peer: i32,
        ) -> Result<DeviceBuf<T>, Error> {
            let mut b = ctx.zeros::<T>("recv", n)?;
            c.recv(&mut b.s.slice_mut(..n), peer).map_err(|e| nccl_err("recv", e))?;
            Ok(b)
        }
        let buf = match meta.dtype {
            DType::F64 => return Err(super::tensor::no_f64("recv")),
            DType::BF16 | DType::F16 => Buf::Half(go(&self.comm, ctx, 2 * n, peer)?),
            DType::F32 => Buf::F32(go(&self.comm, ctx, n, peer)?),
            DType::I64 => Buf::I64(go(&self.comm, ctx, n, peer)?),
            DType::Bool => Buf::Bool(go(&self.comm, ctx, n, peer)?),
        };
        Ok(CudaTensor::new(meta.clone(), buf))
    }

    /// Sends `x` to `to` and receives a tensor of `meta` from `from` in one NCCL group, so that
    /// ranks exchanging in a ring do not deadlock.
    pub fn send_recv(
        &self,
        ctx: &CudaContext,
        x: &CudaTensor,
        to: usize,
        meta: &TensorMeta,
        from: usize,
    ) -> Result<CudaTensor, Error> {
        cudarc::nccl::group_start().map_err(|e| nccl_err("send_recv", e))?;
        let sent = self.send(x, to);
        let received = self.recv(ctx, meta, from);
        let ended = cudarc::nccl::group_end().map_err(|e| nccl_err("send_recv", e));
        sent?;
        let out = received?;
        ended?;
        Ok(out)
    }

    fn peer(&self, op: &'static str, peer: usize) -> Result<i32, Error> {
        if peer >= self.world || peer == self.rank {
            return Err(Error::BadInput {
                op,
                message: format!("peer {peer} from rank {} of {}", self.rank, self.world),
            });
        }
        Ok(peer as i32)
    }

    /// Runs collective `f` from the first `n` elements of `src` into a new buffer of `out_n`.
    fn collect<T: NcclType + cudarc::driver::DeviceRepr>(
        &self,
        ctx: &CudaContext,
        op: &'static str,
        src: &DeviceBuf<T>,
        n: usize,
        out_n: usize,
        f: impl FnOnce(
            &Comm,
            &cudarc::driver::CudaView<'_, T>,
            &mut cudarc::driver::CudaViewMut<'_, T>,
        ) -> Result<cudarc::nccl::result::NcclStatus, cudarc::nccl::result::NcclError>,
    ) -> Result<DeviceBuf<T>, Error> {
        let mut out = ctx.alloc::<T>(op, out_n)?;
        if n > 0 && out_n > 0 {
            f(&self.comm, &src.s.slice(..n), &mut out.s.slice_mut(..out_n)).map_err(|e| nccl_err(op, e))?;
        }
        Ok(out)
    }

    fn broadcast_one<T: NcclType + cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        ctx: &CudaContext,
        op: &'static str,
        src: Option<&DeviceBuf<T>>,
        n: usize,
        root: i32,
    ) -> Result<DeviceBuf<T>, Error> {
        let mut out = ctx.alloc::<T>(op, n)?;
        if n > 0 {
            let view = src.map(|s| s.s.slice(..n));
            self.comm.broadcast(view.as_ref(), &mut out.s.slice_mut(..n), root).map_err(|e| nccl_err(op, e))?;
        }
        Ok(out)
    }
}

fn check_reduction(op: &'static str, x: &CudaTensor, r: Reduction) -> Result<(), Error> {
    if x.dtype() == DType::Bool && r == Reduction::Sum {
        return Err(Error::BadInput { op, message: "bool tensors reduce with Max (or) and Min (and) only".into() });
    }
    Ok(())
}
