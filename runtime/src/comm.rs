//! Communication between ranks: the [`Communicator`] trait and its `threads` back end.
//!
//! A collective runs over a *group* of ranks (the ranks that differ only along some mesh axes,
//! ordered as [`sharding::DeviceMesh::group_of`] orders them). Every member calls the same
//! collectives on the same group in the same order (SPMD), so the n-th call on a group of one
//! rank meets the n-th call of the others.
//!
//! Results are deterministic: reductions add the members' blocks in group order on every member,
//! so replicas stay bitwise identical and runs are reproducible.
//!
//! Faults: a rank that fails calls [`Communicator::abort`] with its cause; every rank waiting in
//! (or later entering) a collective gets [`CommError::Aborted`] naming that rank and cause, and a
//! wait longer than the world's timeout is [`CommError::Timeout`]. Nothing hangs.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use ir::{Tensor, TensorMeta};
use sharding::{Collective, DeviceMesh, ReduceKind};

/// Why a collective failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CommError {
    /// Another rank (or this one) aborted the run.
    #[error("rank {rank} failed: {cause}")]
    Aborted {
        /// The rank that failed first.
        rank: usize,
        /// Its message.
        cause: String,
    },
    /// Some member did not arrive in time.
    #[error("rank {rank}: collective on ranks {group:?} timed out after {seconds:.1} s (a rank stopped or diverged)")]
    Timeout {
        /// The waiting rank.
        rank: usize,
        /// The group.
        group: Vec<usize>,
        /// The timeout.
        seconds: f64,
    },
    /// The communication library failed (NCCL or CUDA, in the `nccl` back end).
    #[error("rank {rank}: {message}")]
    Backend {
        /// The rank.
        rank: usize,
        /// The library's message.
        message: String,
    },
    /// Blocks that do not fit the collective (a bug in the plan or the caller).
    #[error("rank {rank}: bad collective input: {why}")]
    Bad {
        /// The rank.
        rank: usize,
        /// What is wrong.
        why: String,
    },
}

/// Collectives over groups of ranks.
pub trait Communicator {
    /// This rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn size(&self) -> usize;
    /// Every member gets the group's blocks, in group order (this rank's included): an
    /// all-gather.
    fn exchange(&mut self, group: &[usize], block: Arc<Tensor>) -> Result<Vec<Arc<Tensor>>, CommError>;
    /// Every member sends `pieces[j]` to the `j`-th member of the group and gets, in group
    /// order, the piece each member sent it: an all-to-all.
    fn exchange_pieces(&mut self, group: &[usize], pieces: Vec<Tensor>) -> Result<Vec<Tensor>, CommError>;
    /// Every member gets the members' blocks combined by `op` in group order. By default as a
    /// ring moves data: a reduce-scatter of contiguous chunks, then an all-gather of the reduced
    /// chunks (so its cost follows the ring formula the planner prices it with).
    fn all_reduce(&mut self, group: &[usize], block: &Tensor, op: ReduceKind) -> Result<Tensor, CommError> {
        chunked_all_reduce(self, group, block, op)
    }
    /// Every member gets the members' blocks concatenated along `dim` in group order. By
    /// default through [`Communicator::exchange`].
    fn all_gather(&mut self, group: &[usize], block: &Tensor, dim: usize) -> Result<Tensor, CommError> {
        let rank = self.rank();
        let all = self.exchange(group, Arc::new(block.clone()))?;
        concat(&all, dim).map_err(|why| CommError::Bad { rank, why })
    }
    /// Sends `block` to rank `to`, which takes it with [`Communicator::recv`] of the same
    /// `tag` (blocks of one tag between two ranks meet in the order sent). By default a
    /// rendezvous of the two ranks through [`Communicator::exchange`] (the receiver puts an
    /// empty block), which ignores the tag: the n-th send meets the n-th receive.
    fn send(&mut self, to: usize, tag: u64, block: &Tensor) -> Result<(), CommError> {
        let _ = tag;
        let group = pair(self.rank(), to).map_err(|why| CommError::Bad { rank: self.rank(), why })?;
        self.exchange(&group, Arc::new(block.clone()))?;
        Ok(())
    }
    /// Receives the block rank `from` sends with [`Communicator::send`] and `tag`; it must be a
    /// tensor of `meta`.
    fn recv(&mut self, from: usize, tag: u64, meta: &TensorMeta) -> Result<Tensor, CommError> {
        let _ = tag;
        let rank = self.rank();
        let group = pair(rank, from).map_err(|why| CommError::Bad { rank, why })?;
        let empty = Tensor::empty(meta.dtype);
        let all = self.exchange(&group, Arc::new(empty))?;
        let i = usize::from(from > rank);
        received(rank, from, meta, all.get(i).map(|t| (**t).clone()))
    }
    /// Makes ready the groups this rank will use (`groups`: every rank lists its own group of
    /// each set of mesh axes the program uses, the sets in the same order). A back end whose
    /// groups are made by a call over every rank (MPI's communicator split) makes them here,
    /// where every rank is, and not at first use, which pipeline stages reach at different
    /// points. By default nothing.
    fn prepare(&mut self, _groups: &[Vec<usize>]) -> Result<(), CommError> {
        Ok(())
    }
    /// Stops every rank: their pending and future collectives fail with this rank and cause.
    fn abort(&self, cause: &str);
    /// Fails when some rank has aborted (cheap; called between instructions so a failure stops
    /// every rank promptly, not only at its next collective).
    fn check(&self) -> Result<(), CommError> {
        Ok(())
    }

    /// Runs one collective of a plan on this rank's block. Reductions add the members' blocks
    /// in group order, exactly as [`sharding::sim::apply`] does: a reduce-scatter sends each
    /// member only the piece it reduces; an all-reduce is [`Communicator::all_reduce`].
    fn run(&mut self, c: &Collective, mesh: &DeviceMesh, block: &Tensor) -> Result<Tensor, CommError> {
        let rank = self.rank();
        let bad = |why: String| CommError::Bad { rank, why };
        let (group, i) = group_of(c, mesh, rank, block.shape()).map_err(bad)?;
        let n = group.len();
        if n == 1 {
            return Ok(block.clone());
        }
        match c {
            Collective::Slice { dim, .. } => Ok(piece(block, *dim, n, i)),
            Collective::MakePartial { .. } if i == 0 => Ok(block.clone()),
            Collective::MakePartial { .. } => {
                Tensor::zeros(&block.meta()).map_err(|e| bad(format!("zeros of {}: {e}", block.meta())))
            }
            Collective::AllGather { dim, .. } => self.all_gather(&group, block, *dim),
            Collective::ReduceScatter { dim, .. } => {
                let mine = self.exchange_pieces(&group, (0..n).map(|j| piece(block, *dim, n, j)).collect())?;
                reduce(mine.iter(), ReduceKind::Sum).map_err(bad)
            }
            Collective::AllReduce { op, .. } => self.all_reduce(&group, block, *op),
            Collective::AllToAll { split_dim, concat_dim, .. } => {
                let got = self.exchange_pieces(&group, (0..n).map(|j| piece(block, *split_dim, n, j)).collect())?;
                let got: Vec<Box<Tensor>> = got.into_iter().map(Box::new).collect();
                concat(&got, *concat_dim).map_err(bad)
            }
            Collective::Broadcast { .. } => {
                let all = self.exchange(&group, Arc::new(block.clone()))?;
                Ok((*all[0]).clone())
            }
        }
    }
}

/// The group of a point-to-point transfer: the two ranks, in rank order.
pub(crate) fn pair(a: usize, b: usize) -> Result<Vec<usize>, String> {
    if a == b {
        return Err(format!("rank {a} sends to itself"));
    }
    Ok(vec![a.min(b), a.max(b)])
}

/// A received block, checked against the meta the plan expects.
pub(crate) fn received(rank: usize, from: usize, meta: &TensorMeta, got: Option<Tensor>) -> Result<Tensor, CommError> {
    match got {
        Some(t) if t.meta() == *meta => Ok(t),
        Some(t) => {
            Err(CommError::Bad { rank, why: format!("received {} from rank {from}, expected {meta}", t.meta()) })
        }
        None => Err(CommError::Bad { rank, why: format!("rank {from} sent nothing") }),
    }
}

/// `rank`'s group for collective `c` on a block of `shape`, and its index in the group, once
/// the collective is checked to run there: distinct mesh axes in range (a repeated axis would
/// list ranks twice in the group, whose rendezvous then never completes), tensor dims in range,
/// and dims that are split divisible by the group size. A validated plan ([`plan::Plan::validate`])
/// passes; this keeps anything else a clean error instead of a panic or a hang.
pub(crate) fn group_of(
    c: &Collective,
    mesh: &DeviceMesh,
    rank: usize,
    shape: &[usize],
) -> Result<(Vec<usize>, usize), String> {
    let axes = c.axes();
    mesh.check_axes(axes).map_err(|why| format!("{c}: {why}"))?;
    if rank >= mesh.size() {
        return Err(format!("rank {rank} is not in mesh {mesh}"));
    }
    let n = mesh.group_size(axes);
    let dim_ok = |d: usize| {
        if d < shape.len() { Ok(()) } else { Err(format!("{c}: the block {shape:?} has no dim {d}")) }
    };
    let split_ok = |d: usize| {
        dim_ok(d)?;
        if shape[d].is_multiple_of(n) {
            Ok(())
        } else {
            Err(format!("{c}: dim {d} of the block {shape:?} does not split into {n} pieces"))
        }
    };
    match c {
        Collective::AllGather { dim, .. } => dim_ok(*dim)?,
        Collective::Slice { dim, .. } | Collective::ReduceScatter { dim, .. } => split_ok(*dim)?,
        Collective::AllToAll { split_dim, concat_dim, .. } => {
            split_ok(*split_dim)?;
            dim_ok(*concat_dim)?;
        }
        Collective::AllReduce { .. } | Collective::Broadcast { .. } | Collective::MakePartial { .. } => {}
    }
    Ok((mesh.group_of(rank, axes), mesh.index_in_group(rank, axes)))
}

/// [`Communicator::all_reduce`]'s default: a reduce-scatter of contiguous chunks through
/// `exchange_pieces`, then an all-gather of the reduced chunks through `exchange`.
pub(crate) fn chunked_all_reduce<C: Communicator + ?Sized>(
    comm: &mut C,
    group: &[usize],
    block: &Tensor,
    op: ReduceKind,
) -> Result<Tensor, CommError> {
    let rank = comm.rank();
    let bad = |why: String| CommError::Bad { rank, why };
    let mine = comm.exchange_pieces(group, flat_chunks(block, group.len()))?;
    let reduced = reduce(mine.iter(), op).map_err(bad)?;
    let all = comm.exchange(group, Arc::new(reduced))?;
    concat_flat(&all, block.shape()).map_err(bad)
}

/// `t`'s elements in `n` contiguous 1-D chunks (the first `len % n` one element longer).
fn flat_chunks(t: &Tensor, n: usize) -> Vec<Tensor> {
    use ir::Data;
    let len = t.numel();
    let bounds: Vec<usize> = (0..=n).map(|k| k * len / n).collect();
    (0..n)
        .map(|k| {
            let (a, b) = (bounds[k], bounds[k + 1]);
            let data = match t.data() {
                Data::F32(v) => Data::F32(ir::to_vec_fast(&v[a..b])),
                Data::F64(v) => Data::F64(ir::to_vec_fast(&v[a..b])),
                Data::BF16(v) => Data::BF16(ir::to_vec_fast(&v[a..b])),
                Data::F16(v) => Data::F16(ir::to_vec_fast(&v[a..b])),
                Data::I64(v) => Data::I64(ir::to_vec_fast(&v[a..b])),
                Data::Bool(v) => Data::Bool(ir::to_vec_fast(&v[a..b])),
            };
            Tensor::new(vec![b - a], data).unwrap_or_else(|_| Tensor::f32(vec![0], vec![]))
        })
        .collect()
}

/// The chunks of [`flat_chunks`] put back together with `shape`.
fn concat_flat(parts: &[Arc<Tensor>], shape: &[usize]) -> Result<Tensor, String> {
    use ir::Data;
    let first = parts.first().ok_or("no chunks")?;
    let mut data = match first.data() {
        Data::F32(_) => Data::F32(vec![]),
        Data::F64(_) => Data::F64(vec![]),
        Data::BF16(_) => Data::BF16(vec![]),
        Data::F16(_) => Data::F16(vec![]),
        Data::I64(_) => Data::I64(vec![]),
        Data::Bool(_) => Data::Bool(vec![]),
    };
    for p in parts {
        match (&mut data, p.data()) {
            (Data::F32(a), Data::F32(x)) => ir::extend_fast(a, x),
            (Data::F64(a), Data::F64(x)) => ir::extend_fast(a, x),
            (Data::BF16(a), Data::BF16(x)) => ir::extend_fast(a, x),
            (Data::F16(a), Data::F16(x)) => ir::extend_fast(a, x),
            (Data::I64(a), Data::I64(x)) => ir::extend_fast(a, x),
            (Data::Bool(a), Data::Bool(x)) => ir::extend_fast(a, x),
            _ => return Err("chunks of different dtypes".into()),
        }
    }
    Tensor::new(shape.to_vec(), data).map_err(|e| e.to_string())
}

/// Piece `i` of `n` equal pieces of `t` along `dim` (contiguous runs copied whole).
fn piece(t: &Tensor, dim: usize, n: usize, i: usize) -> Tensor {
    use ir::Data;
    let shape = t.shape();
    let outer: usize = shape[..dim].iter().product();
    let inner: usize = shape[dim + 1..].iter().product();
    let len = shape[dim] / n * inner;
    let stride = shape[dim] * inner;
    fn take<T: Copy>(v: &[T], outer: usize, stride: usize, at: usize, len: usize) -> Vec<T> {
        let mut out = Vec::with_capacity(outer * len);
        for o in 0..outer {
            ir::extend_fast(&mut out, &v[o * stride + at..o * stride + at + len]);
        }
        out
    }
    let data = match t.data() {
        Data::F32(v) => Data::F32(take(v, outer, stride, i * len, len)),
        Data::F64(v) => Data::F64(take(v, outer, stride, i * len, len)),
        Data::BF16(v) => Data::BF16(take(v, outer, stride, i * len, len)),
        Data::F16(v) => Data::F16(take(v, outer, stride, i * len, len)),
        Data::I64(v) => Data::I64(take(v, outer, stride, i * len, len)),
        Data::Bool(v) => Data::Bool(take(v, outer, stride, i * len, len)),
    };
    let mut out_shape = shape.to_vec();
    out_shape[dim] /= n;
    Tensor::new(out_shape, data).unwrap_or_else(|_| Tensor::f32(vec![0], vec![]))
}

/// Concatenation along `dim` (contiguous runs copied whole).
pub(crate) fn concat<T: std::ops::Deref<Target = Tensor>>(parts: &[T], dim: usize) -> Result<Tensor, String> {
    use ir::Data;
    let first = parts.first().ok_or("concatenating nothing")?;
    let shape = first.shape();
    if parts.iter().any(|p| p.shape().len() != shape.len() || p.dtype() != first.dtype()) {
        return Err("concatenating blocks of different ranks or dtypes".into());
    }
    if dim >= shape.len() {
        return Err(format!("concatenating blocks of shape {shape:?} along dim {dim}, which they do not have"));
    }
    let same_but_dim = |p: &[usize]| p.iter().zip(shape).enumerate().all(|(d, (a, b))| d == dim || a == b);
    if let Some(p) = parts.iter().find(|p| !same_but_dim(p.shape())) {
        return Err(format!("concatenating blocks of shapes {shape:?} and {:?} along dim {dim}", p.shape()));
    }
    let outer: usize = shape[..dim].iter().product();
    let inner: usize = shape[dim + 1..].iter().product();
    let mut out_shape = shape.to_vec();
    out_shape[dim] = parts.iter().map(|p| p.shape()[dim]).sum();
    fn join<T: Copy>(vs: &[&[T]], runs: &[usize], outer: usize) -> Vec<T> {
        let mut out = Vec::with_capacity(runs.iter().sum::<usize>() * outer);
        for o in 0..outer {
            for (v, &r) in vs.iter().zip(runs) {
                ir::extend_fast(&mut out, &v[o * r..(o + 1) * r]);
            }
        }
        out
    }
    let runs: Vec<usize> = parts.iter().map(|p| p.shape()[dim] * inner).collect();
    let data = match first.data() {
        Data::F32(_) => Data::F32(join(&parts.iter().filter_map(|p| p.as_f32()).collect::<Vec<_>>(), &runs, outer)),
        Data::F64(_) => Data::F64(join(&parts.iter().filter_map(|p| p.as_f64()).collect::<Vec<_>>(), &runs, outer)),
        Data::BF16(_) => {
            let vs: Vec<&[ir::half::bf16]> = parts
                .iter()
                .filter_map(|p| match p.data() {
                    Data::BF16(v) => Some(&v[..]),
                    _ => None,
                })
                .collect();
            Data::BF16(join(&vs, &runs, outer))
        }
        Data::F16(_) => {
            let vs: Vec<&[ir::half::f16]> = parts
                .iter()
                .filter_map(|p| match p.data() {
                    Data::F16(v) => Some(&v[..]),
                    _ => None,
                })
                .collect();
            Data::F16(join(&vs, &runs, outer))
        }
        Data::I64(_) => Data::I64(join(&parts.iter().filter_map(|p| p.as_i64()).collect::<Vec<_>>(), &runs, outer)),
        Data::Bool(_) => Data::Bool(join(&parts.iter().filter_map(|p| p.as_bool()).collect::<Vec<_>>(), &runs, outer)),
    };
    Tensor::new(out_shape, data).map_err(|e| e.to_string())
}

/// Elementwise reduction of same-shaped blocks, in the order given.
fn reduce<'a>(mut blocks: impl Iterator<Item = &'a Tensor>, op: ReduceKind) -> Result<Tensor, String> {
    use ir::Data;
    let first = blocks.next().ok_or("reducing no blocks")?;
    let mut acc = first.clone().into_data();
    for b in blocks {
        if b.shape() != first.shape() {
            return Err(format!("reducing blocks of shapes {:?} and {:?}", first.shape(), b.shape()));
        }
        match (&mut acc, b.data(), op) {
            (Data::F32(a), Data::F32(x), ReduceKind::Sum) => a.iter_mut().zip(x).for_each(|(a, x)| *a += x),
            (Data::F32(a), Data::F32(x), ReduceKind::Max) => a.iter_mut().zip(x).for_each(|(a, x)| *a = a.max(*x)),
            (Data::F64(a), Data::F64(x), ReduceKind::Sum) => a.iter_mut().zip(x).for_each(|(a, x)| *a += x),
            (Data::F64(a), Data::F64(x), ReduceKind::Max) => a.iter_mut().zip(x).for_each(|(a, x)| *a = a.max(*x)),
            // Half types: each addition in f32, rounded once (as NCCL's bf16/f16 reductions).
            (Data::BF16(a), Data::BF16(x), ReduceKind::Sum) => {
                a.iter_mut().zip(x).for_each(|(a, x)| *a = ir::half::bf16::from_f32(a.to_f32() + x.to_f32()))
            }
            (Data::BF16(a), Data::BF16(x), ReduceKind::Max) => a.iter_mut().zip(x).for_each(|(a, x)| *a = a.max(*x)),
            (Data::F16(a), Data::F16(x), ReduceKind::Sum) => {
                a.iter_mut().zip(x).for_each(|(a, x)| *a = ir::half::f16::from_f32(a.to_f32() + x.to_f32()))
            }
            (Data::F16(a), Data::F16(x), ReduceKind::Max) => a.iter_mut().zip(x).for_each(|(a, x)| *a = a.max(*x)),
            (Data::I64(a), Data::I64(x), ReduceKind::Sum) => a.iter_mut().zip(x).for_each(|(a, x)| *a += x),
            (Data::I64(a), Data::I64(x), ReduceKind::Max) => a.iter_mut().zip(x).for_each(|(a, x)| *a = (*a).max(*x)),
            (Data::Bool(a), Data::Bool(x), _) => a.iter_mut().zip(x).for_each(|(a, x)| *a |= x),
            (a, x, _) => return Err(format!("reducing {:?} with {:?}", a.dtype(), x.dtype())),
        }
    }
    Tensor::new(first.shape().to_vec(), acc).map_err(|e| e.to_string())
}

#[derive(Default)]
struct Slot {
    /// What each member put: one block (`exchange`) or one piece per member (`exchange_pieces`).
    blocks: Vec<Option<Vec<Arc<Tensor>>>>,
    /// Members that have put their block.
    filled: usize,
    /// Members that have taken the result.
    read: usize,
    /// Signalled when the last member arrives (or on abort): only this collective's members wake.
    cv: Arc<Condvar>,
}

#[derive(Default)]
struct State {
    slots: HashMap<(Vec<usize>, u64), Slot>,
    /// Point-to-point blocks sent and not yet received, by (from, to), in the order sent.
    mail: HashMap<(usize, usize), std::collections::VecDeque<(u64, Tensor)>>,
    aborted: Option<(usize, String)>,
}

struct Shared {
    state: Mutex<State>,
    /// Signalled when a block is sent (or on abort): receivers wake and look.
    mail: Condvar,
    /// Set once `state.aborted` is.
    aborted: AtomicBool,
    timeout: Duration,
}

/// The communicator of a one-rank world (a single-device run): every group is this rank alone.
pub struct Solo;

impl Communicator for Solo {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn exchange(&mut self, _group: &[usize], block: Arc<Tensor>) -> Result<Vec<Arc<Tensor>>, CommError> {
        Ok(vec![block])
    }
    fn exchange_pieces(&mut self, _group: &[usize], pieces: Vec<Tensor>) -> Result<Vec<Tensor>, CommError> {
        Ok(pieces)
    }
    fn abort(&self, _cause: &str) {}
}

/// The `threads` back end: ranks are threads of one process exchanging blocks through shared
/// memory. [`ThreadWorld::new`] makes one communicator per rank; move each into its thread.
pub struct ThreadComm {
    rank: usize,
    size: usize,
    shared: Arc<Shared>,
    seq: HashMap<Vec<usize>, u64>,
}

/// Constructor of a `threads` world.
pub struct ThreadWorld;

impl ThreadWorld {
    /// Communicators for `n` ranks; a collective waiting longer than `timeout` fails.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(n: usize, timeout: Duration) -> Vec<ThreadComm> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            mail: Condvar::new(),
            aborted: AtomicBool::new(false),
            timeout,
        });
        (0..n).map(|rank| ThreadComm { rank, size: n, shared: shared.clone(), seq: HashMap::new() }).collect()
    }
}

impl Communicator for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn exchange(&mut self, group: &[usize], block: Arc<Tensor>) -> Result<Vec<Arc<Tensor>>, CommError> {
        let all = self.meet(group, vec![block])?;
        Ok(all.into_iter().map(|mut v| v.swap_remove(0)).collect())
    }

    fn exchange_pieces(&mut self, group: &[usize], pieces: Vec<Tensor>) -> Result<Vec<Tensor>, CommError> {
        let me = group.iter().position(|&r| r == self.rank).unwrap_or(0);
        if pieces.len() != group.len() {
            return Err(CommError::Bad {
                rank: self.rank,
                why: format!("{} pieces for {} members", pieces.len(), group.len()),
            });
        }
        let all = self.meet(group, pieces.into_iter().map(Arc::new).collect())?;
        Ok(all.into_iter().map(|v| (*v[me]).clone()).collect())
    }

    /// In shared memory every member reads the others' blocks where they are: one rendezvous
    /// and a local reduction of the whole block (in group order, so every member gets the same
    /// bits) cost less than the ring's two rendezvous and its copies (BENCHMARKS.md, `autopar
    /// profile`).
    fn all_reduce(&mut self, group: &[usize], block: &Tensor, op: ReduceKind) -> Result<Tensor, CommError> {
        let all = self.exchange(group, Arc::new(block.clone()))?;
        reduce(all.iter().map(|t| t.as_ref()), op).map_err(|why| CommError::Bad { rank: self.rank, why })
    }

    fn abort(&self, cause: &str) {
        self.abort_world(cause)
    }

    fn check(&self) -> Result<(), CommError> {
        self.check_world()
    }

    /// Buffered: the block is queued for `to` and the sender goes on (a pipeline schedule has
    /// two stages send to each other at once); the receiver takes the first of its tag.
    fn send(&mut self, to: usize, tag: u64, block: &Tensor) -> Result<(), CommError> {
        let rank = self.rank;
        pair(rank, to).map_err(|why| CommError::Bad { rank, why })?;
        if to >= self.size {
            return Err(CommError::Bad { rank, why: format!("sends to rank {to} of {}", self.size) });
        }
        let poisoned = || CommError::Aborted { rank, cause: "a rank panicked while sending".into() };
        let mut st = self.shared.state.lock().map_err(|_| poisoned())?;
        if let Some((r, cause)) = &st.aborted {
            return Err(CommError::Aborted { rank: *r, cause: cause.clone() });
        }
        st.mail.entry((rank, to)).or_default().push_back((tag, block.clone()));
        drop(st);
        self.shared.mail.notify_all();
        Ok(())
    }

    fn recv(&mut self, from: usize, tag: u64, meta: &TensorMeta) -> Result<Tensor, CommError> {
        let rank = self.rank;
        pair(rank, from).map_err(|why| CommError::Bad { rank, why })?;
        let poisoned = || CommError::Aborted { rank, cause: "a rank panicked while receiving".into() };
        let deadline = Instant::now() + self.shared.timeout;
        let mut st = self.shared.state.lock().map_err(|_| poisoned())?;
        loop {
            if let Some((r, cause)) = &st.aborted {
                return Err(CommError::Aborted { rank: *r, cause: cause.clone() });
            }
            if let Some(q) = st.mail.get_mut(&(from, rank))
                && let Some(at) = q.iter().position(|(t, _)| *t == tag)
                && let Some((_, t)) = q.remove(at)
            {
                return received(rank, from, meta, Some(t));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(CommError::Timeout {
                    rank,
                    group: vec![from, rank],
                    seconds: self.shared.timeout.as_secs_f64(),
                });
            }
            st = self.shared.mail.wait_timeout(st, deadline - now).map_err(|_| poisoned())?.0;
        }
    }
}

/// How long a member waiting at a rendezvous polls before it sleeps on the slot's condvar.
const SPIN: Duration = Duration::from_micros(200);

impl Shared {
    fn abort(&self, rank: usize, cause: &str) {
        if let Ok(mut st) = self.state.lock()
            && st.aborted.is_none()
        {
            st.aborted = Some((rank, cause.to_string()));
        }
        self.aborted.store(true, Ordering::SeqCst);
        if let Ok(st) = self.state.lock() {
            for slot in st.slots.values() {
                slot.cv.notify_all();
            }
        }
        self.mail.notify_all();
    }
}

impl ThreadComm {
    /// The rendezvous: puts `payload` in this group's next slot, waits for every member's, and
    /// returns them in group order.
    fn meet(&mut self, group: &[usize], payload: Vec<Arc<Tensor>>) -> Result<Vec<Vec<Arc<Tensor>>>, CommError> {
        let me = group
            .iter()
            .position(|&r| r == self.rank)
            .ok_or_else(|| CommError::Bad { rank: self.rank, why: format!("not a member of group {group:?}") })?;
        let seq = self.seq.entry(group.to_vec()).or_insert(0);
        let key = (group.to_vec(), *seq);
        *seq += 1;
        let deadline = Instant::now() + self.shared.timeout;
        let poisoned = |rank| CommError::Aborted { rank, cause: "a rank panicked while exchanging".into() };
        let mut st = self.shared.state.lock().map_err(|_| poisoned(self.rank))?;
        if let Some((rank, cause)) = &st.aborted {
            return Err(CommError::Aborted { rank: *rank, cause: cause.clone() });
        }
        let slot = st.slots.entry(key.clone()).or_insert_with(|| Slot {
            blocks: vec![None; group.len()],
            filled: 0,
            read: 0,
            cv: Arc::new(Condvar::new()),
        });
        if slot.blocks[me].replace(payload).is_none() {
            slot.filled += 1;
        }
        let cv = slot.cv.clone();
        if slot.filled == group.len() {
            cv.notify_all();
        }
        // Spin a little before sleeping: when every member has a core, the others arrive within
        // microseconds, and a futex wake-up costs tens of them (more in a VM). With more ranks
        // than cores the yields let the missing members run.
        let spin_until = Instant::now() + SPIN;
        loop {
            if let Some((rank, cause)) = &st.aborted {
                return Err(CommError::Aborted { rank: *rank, cause: cause.clone() });
            }
            let slot =
                st.slots.get_mut(&key).ok_or_else(|| CommError::Bad { rank: self.rank, why: "lost slot".into() })?;
            if slot.filled == group.len() {
                let all: Vec<Vec<Arc<Tensor>>> = slot.blocks.iter().flatten().cloned().collect();
                slot.read += 1;
                if slot.read == group.len() {
                    st.slots.remove(&key);
                }
                return Ok(all);
            }
            let now = Instant::now();
            if now < spin_until {
                drop(st);
                for _ in 0..32 {
                    std::hint::spin_loop();
                }
                std::thread::yield_now();
                st = self.shared.state.lock().map_err(|_| poisoned(self.rank))?;
                continue;
            }
            if now >= deadline {
                return Err(CommError::Timeout {
                    rank: self.rank,
                    group: group.to_vec(),
                    seconds: self.shared.timeout.as_secs_f64(),
                });
            }
            st = cv.wait_timeout(st, deadline - now).map_err(|_| poisoned(self.rank))?.0;
        }
    }

    fn abort_world(&self, cause: &str) {
        self.shared.abort(self.rank, cause)
    }

    /// Something that aborts this rank's world without the communicator: for a launcher whose
    /// rank could not start (its communicator went with the failed start), so the ranks that did
    /// start stop instead of waiting for it until the timeout.
    pub(crate) fn abort_handle(&self) -> impl Fn(&str) + Send + Sync + 'static {
        let (rank, shared) = (self.rank, self.shared.clone());
        move |cause: &str| shared.abort(rank, cause)
    }

    fn check_world(&self) -> Result<(), CommError> {
        if !self.shared.aborted.load(Ordering::Relaxed) {
            return Ok(());
        }
        let st = self
            .shared
            .state
            .lock()
            .map_err(|_| CommError::Aborted { rank: self.rank, cause: "a rank panicked while exchanging".into() })?;
        match &st.aborted {
            Some((rank, cause)) => Err(CommError::Aborted { rank: *rank, cause: cause.clone() }),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sharding::{ShardingSpec, sim};

    fn iota(shape: &[usize]) -> Tensor {
        let n: usize = shape.iter().product();
        Tensor::f32(shape.to_vec(), (0..n).map(|i| (i % 13) as f32 - 6.0).collect())
    }

    /// Every collective on threads equals the reference simulation, on a 2x4 mesh.
    #[test]
    fn threads_match_the_simulation() {
        let mesh = DeviceMesh::uniform(&[2, 4]).unwrap();
        let t = iota(&[8, 16, 4]);
        let cases: Vec<(&str, Collective)> = vec![
            ("S01 R R", Collective::AllGather { axes: vec![1], dim: 0 }),
            ("R R R | P1", Collective::AllReduce { axes: vec![1], op: ReduceKind::Sum }),
            ("R R R | P01", Collective::AllReduce { axes: vec![0, 1], op: ReduceKind::Sum }),
            ("R R R | P0", Collective::ReduceScatter { axes: vec![0], dim: 1 }),
            ("S01 R R", Collective::AllToAll { axes: vec![0, 1], split_dim: 1, concat_dim: 0 }),
            ("R S1 R", Collective::Slice { axes: vec![0], dim: 2 }),
            ("R R R", Collective::MakePartial { axes: vec![1] }),
            ("R S1 R", Collective::Broadcast { axes: vec![0] }),
        ];
        for (spec, c) in cases {
            let spec: ShardingSpec = spec.parse().unwrap();
            let blocks = sim::distribute(&t, &spec, &mesh).unwrap();
            let want = sim::apply(&c, &blocks, &mesh).unwrap();
            let comms = ThreadWorld::new(mesh.size(), Duration::from_secs(10));
            let got: Vec<Tensor> = std::thread::scope(|s| {
                let hs: Vec<_> = comms
                    .into_iter()
                    .zip(&blocks)
                    .map(|(mut comm, b)| {
                        let (c, mesh) = (&c, &mesh);
                        s.spawn(move || comm.run(c, mesh, b).unwrap())
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            assert_eq!(got, want, "{c}");
        }
    }

    /// A rank that aborts makes the others' collectives fail with its rank and cause, promptly.
    #[test]
    fn abort_reaches_every_rank() {
        let comms = ThreadWorld::new(4, Duration::from_secs(30));
        let t0 = Instant::now();
        let errs: Vec<CommError> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .into_iter()
                .map(|mut comm| {
                    s.spawn(move || {
                        if comm.rank() == 2 {
                            comm.abort("injected fault");
                            return CommError::Aborted { rank: 2, cause: "injected fault".into() };
                        }
                        comm.exchange(&[0, 1, 2, 3], Arc::new(Tensor::scalar_f32(1.0))).unwrap_err()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for e in errs {
            assert_eq!(e, CommError::Aborted { rank: 2, cause: "injected fault".into() });
        }
        assert!(t0.elapsed() < Duration::from_secs(5));
        let mut lone = ThreadWorld::new(2, Duration::from_millis(50)).swap_remove(0);
        assert!(matches!(lone.exchange(&[0, 1], Arc::new(Tensor::scalar_f32(1.0))), Err(CommError::Timeout { .. })));
    }
}
