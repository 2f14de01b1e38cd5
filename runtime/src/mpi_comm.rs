//! The `mpi` back end: one process per rank under `mpirun`, through the `mpi` crate (Open MPI).
//!
//! [`MpiWorld::init`] initialises MPI once per process; [`MpiWorld::comm`] gives this rank's
//! [`Communicator`]. A collective over a group of ranks runs on a sub-communicator of that group,
//! created by `MPI_Comm_split` before the first step ([`Communicator::prepare`]: every rank
//! splits for the same axis sets in the same order, so the splits, collectives over the world,
//! meet even when pipeline stages run different programs), or else the first time the group
//! is used: every rank of an SPMD program reaches its first collective over a given set of mesh
//! axes at the same instruction. Pipeline transfers are point to point on the world, buffered
//! (`MPI_Bsend` into a buffer sized for a step's sends), so a send never waits. Sub-communicators rank
//! their members in group order, so blocks come back in the order [`Communicator::exchange`]
//! promises and reductions stay deterministic.
//!
//! Blocks travel as bytes (a small header with the dtype and shape, then the little-endian
//! elements) through `MPI_Allgather` of the lengths and `MPI_Allgatherv` of the bytes.
//!
//! Faults: [`Communicator::abort`] prints nothing itself and calls `MPI_Abort`, which makes
//! `mpirun` stop every process of the job; the caller prints the cause first.

use std::collections::HashMap;
use std::sync::Arc;

use ir::{DType, Data, Tensor, TensorMeta};
use mpi::collective::{CommunicatorCollectives as _, SystemOperation};
use mpi::datatype::{Partition, PartitionMut};
use mpi::point_to_point::{Destination as _, Source as _};
use mpi::topology::Communicator as _;
use mpi::topology::{Color, SimpleCommunicator};

use sharding::ReduceKind;

use crate::comm::{CommError, Communicator, chunked_all_reduce};

/// MPI, initialised for this process (finalised when dropped).
pub struct MpiWorld {
    universe: mpi::environment::Universe,
}

impl MpiWorld {
    /// Initialises MPI. Fails if it was initialised before in this process.
    pub fn init() -> Result<MpiWorld, CommError> {
        let universe = mpi::initialize()
            .ok_or_else(|| CommError::Bad { rank: 0, why: "MPI was already initialised in this process".into() })?;
        Ok(MpiWorld { universe })
    }

    /// This process's communicator.
    pub fn comm(&self) -> MpiComm {
        let world = self.universe.world();
        let rank = world.rank() as usize;
        let size = world.size() as usize;
        MpiComm { world, rank, size, subs: HashMap::new() }
    }

    /// Attaches a buffer of `bytes` for this process's point-to-point sends (every send of a
    /// step: [`crate::Program::send_bytes`]), so that a send never waits for its receive. At
    /// most 2 GiB (MPI counts in a C int): a larger need is an error.
    pub fn reserve_sends(&mut self, bytes: usize) -> Result<(), CommError> {
        if bytes == 0 {
            return Ok(());
        }
        let rank = self.universe.world().rank() as usize;
        if bytes > i32::MAX as usize {
            return Err(CommError::Bad {
                rank,
                why: format!("a step sends {bytes} bytes between pipeline stages; MPI buffers at most 2 GiB"),
            });
        }
        self.universe.set_buffer_size(bytes);
        Ok(())
    }
}

/// One rank's communicator over MPI (see the module docs).
pub struct MpiComm {
    world: SimpleCommunicator,
    rank: usize,
    size: usize,
    subs: HashMap<Vec<usize>, SimpleCommunicator>,
}

/// The MPI tag of a block's tag (MPI promises tags up to 32767).
fn mpi_tag(tag: u64) -> i32 {
    (tag % 32768) as i32
}

fn encode(t: &Tensor) -> Vec<u8> {
    let mut out = Vec::with_capacity(t.bytes() + 16 + 8 * t.shape().len());
    out.push(match t.dtype() {
        DType::F32 => 0u8,
        DType::I64 => 1,
        DType::Bool => 2,
        DType::F64 => 3,
        DType::BF16 => 4,
        DType::F16 => 5,
    });
    out.extend((t.shape().len() as u32).to_le_bytes());
    for &d in t.shape() {
        out.extend((d as u64).to_le_bytes());
    }
    // Element by element into a buffer of the final length: the compiler turns these loops into
    // plain copies (an `extend` per element costs several times more on megabyte blocks).
    let head = out.len();
    out.resize(head + t.bytes(), 0);
    let body = &mut out[head..];
    match t.data() {
        Data::F32(v) => body.chunks_exact_mut(4).zip(v).for_each(|(c, x)| c.copy_from_slice(&x.to_le_bytes())),
        Data::I64(v) => body.chunks_exact_mut(8).zip(v).for_each(|(c, x)| c.copy_from_slice(&x.to_le_bytes())),
        Data::Bool(v) => body.iter_mut().zip(v).for_each(|(c, &b)| *c = u8::from(b)),
        Data::F64(v) => body.chunks_exact_mut(8).zip(v).for_each(|(c, x)| c.copy_from_slice(&x.to_le_bytes())),
        Data::BF16(v) => body.chunks_exact_mut(2).zip(v).for_each(|(c, x)| c.copy_from_slice(&x.to_le_bytes())),
        Data::F16(v) => body.chunks_exact_mut(2).zip(v).for_each(|(c, x)| c.copy_from_slice(&x.to_le_bytes())),
    }
    out
}

fn decode(b: &[u8]) -> Result<Tensor, String> {
    let take = |at: usize, n: usize| b.get(at..at + n).ok_or_else(|| "truncated block".to_string());
    let dtype = *b.first().ok_or("empty block")?;
    let nd = u32::from_le_bytes(take(1, 4)?.try_into().map_err(|_| "bad header")?) as usize;
    let mut shape = Vec::with_capacity(nd);
    for i in 0..nd {
        shape.push(u64::from_le_bytes(take(5 + 8 * i, 8)?.try_into().map_err(|_| "bad header")?) as usize);
    }
    let body = &b[(5 + 8 * nd).min(b.len())..];
    let data = match dtype {
        0 => Data::F32(body.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()),
        1 => Data::I64(body.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).collect()),
        2 => Data::Bool(body.iter().map(|&x| x != 0).collect()),
        3 => Data::F64(body.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).collect()),
        4 => Data::BF16(body.chunks_exact(2).map(|c| ir::half::bf16::from_le_bytes([c[0], c[1]])).collect()),
        5 => Data::F16(body.chunks_exact(2).map(|c| ir::half::f16::from_le_bytes([c[0], c[1]])).collect()),
        d => return Err(format!("unknown dtype tag {d}")),
    };
    Tensor::new(shape, data).map_err(|e| e.to_string())
}

impl MpiComm {
    /// The communicator of `group` (created on first use; see the module docs).
    fn group_comm(&mut self, group: &[usize]) -> &SimpleCommunicator {
        if group.len() == self.size && group.iter().enumerate().all(|(i, &r)| i == r) {
            return &self.world;
        }
        if !self.subs.contains_key(group) {
            let color = *group.iter().min().unwrap_or(&0) as i32;
            let key = group.iter().position(|&r| r == self.rank).unwrap_or(0) as i32;
            // Every rank is in some group of this shape, so every rank gets a communicator.
            if let Some(c) = self.world.split_by_color_with_key(Color::with_value(color), key) {
                self.subs.insert(group.to_vec(), c);
            }
        }
        self.subs.get(group).unwrap_or(&self.world)
    }

    /// The communicator of `group`, which must contain this rank.
    fn checked(&mut self, group: &[usize]) -> Result<&SimpleCommunicator, CommError> {
        let rank = self.rank;
        if !group.contains(&rank) {
            return Err(CommError::Bad { rank, why: format!("not a member of group {group:?}") });
        }
        let comm = self.group_comm(group);
        if comm.size() as usize != group.len() {
            return Err(CommError::Bad {
                rank,
                why: format!("the communicator of group {group:?} has {} ranks", comm.size()),
            });
        }
        Ok(comm)
    }
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn exchange(&mut self, group: &[usize], block: Arc<Tensor>) -> Result<Vec<Arc<Tensor>>, CommError> {
        let rank = self.rank;
        if !group.contains(&rank) {
            return Err(CommError::Bad { rank, why: format!("not a member of group {group:?}") });
        }
        let n = group.len();
        let comm = self.group_comm(group);
        if comm.size() as usize != n {
            return Err(CommError::Bad {
                rank,
                why: format!("the communicator of group {group:?} has {} ranks", comm.size()),
            });
        }
        let bytes = encode(&block);
        let len = bytes.len() as i32;
        let mut lens = vec![0i32; n];
        comm.all_gather_into(&len, &mut lens[..]);
        let displs: Vec<i32> = lens
            .iter()
            .scan(0i32, |acc, &x| {
                let d = *acc;
                *acc += x;
                Some(d)
            })
            .collect();
        let total: usize = lens.iter().map(|&x| x as usize).sum();
        let mut buf = vec![0u8; total];
        {
            let mut part = PartitionMut::new(&mut buf[..], &lens[..], &displs[..]);
            comm.all_gather_varcount_into(&bytes[..], &mut part);
        }
        lens.iter()
            .zip(&displs)
            .map(|(&l, &d)| {
                decode(&buf[d as usize..(d + l) as usize]).map(Arc::new).map_err(|why| CommError::Bad { rank, why })
            })
            .collect()
    }

    fn exchange_pieces(&mut self, group: &[usize], pieces: Vec<Tensor>) -> Result<Vec<Tensor>, CommError> {
        let rank = self.rank;
        let n = group.len();
        if pieces.len() != n || !group.contains(&rank) {
            return Err(CommError::Bad { rank, why: format!("{} pieces for group {group:?}", pieces.len()) });
        }
        let comm = self.group_comm(group);
        let encoded: Vec<Vec<u8>> = pieces.iter().map(encode).collect();
        let send_counts: Vec<i32> = encoded.iter().map(|e| e.len() as i32).collect();
        let mut recv_counts = vec![0i32; n];
        comm.all_to_all_into(&send_counts[..], &mut recv_counts[..]);
        let offsets = |c: &[i32]| -> Vec<i32> {
            c.iter()
                .scan(0i32, |acc, &x| {
                    let d = *acc;
                    *acc += x;
                    Some(d)
                })
                .collect()
        };
        let (send_displs, recv_displs) = (offsets(&send_counts), offsets(&recv_counts));
        let send: Vec<u8> = encoded.concat();
        let mut recv = vec![0u8; recv_counts.iter().map(|&x| x as usize).sum()];
        {
            let sp = Partition::new(&send[..], &send_counts[..], &send_displs[..]);
            let mut rp = PartitionMut::new(&mut recv[..], &recv_counts[..], &recv_displs[..]);
            comm.all_to_all_varcount_into(&sp, &mut rp);
        }
        recv_counts
            .iter()
            .zip(&recv_displs)
            .map(|(&l, &d)| decode(&recv[d as usize..(d + l) as usize]).map_err(|why| CommError::Bad { rank, why }))
            .collect()
    }

    /// f32 blocks travel as raw elements: no headers, no exchange of counts, no encoding. Two
    /// members use `MPI_Allreduce` (one commutative operation per element, so the group-order
    /// result); more use `MPI_Alltoall` and `MPI_Allgather` of equal chunks (the last padded),
    /// each member reducing the chunk it owns in group order as the default does. Either way
    /// the bits equal the `threads` back end's. Every member holds a block of the same shape
    /// (the plan is SPMD), so the chunk length is known everywhere. Other dtypes take the
    /// default path.
    fn all_reduce(&mut self, group: &[usize], block: &Tensor, op: ReduceKind) -> Result<Tensor, CommError> {
        let rank = self.rank;
        let Data::F32(v) = block.data() else {
            return chunked_all_reduce(self, group, block, op);
        };
        let n = group.len();
        let comm = self.checked(group)?;
        let len = v.len();
        if n == 2 {
            // Each element is one addition (or maximum) of the two members' values, which is
            // commutative: MPI's own algorithm gives exactly the group-order result.
            let mut out = vec![0f32; len];
            let sop = match op {
                ReduceKind::Sum => SystemOperation::sum(),
                ReduceKind::Max => SystemOperation::max(),
            };
            comm.all_reduce_into(&v[..], &mut out[..], sop);
            return Tensor::new(block.shape().to_vec(), Data::F32(out))
                .map_err(|e| CommError::Bad { rank, why: e.to_string() });
        }
        let chunk = len.div_ceil(n).max(1);
        let padded;
        let send: &[f32] = if chunk * n == len {
            v
        } else {
            padded = {
                let mut p = Vec::with_capacity(chunk * n);
                ir::extend_fast(&mut p, v);
                p.resize(chunk * n, 0.0);
                p
            };
            &padded
        };
        let mut got = vec![0f32; chunk * n];
        comm.all_to_all_into(send, &mut got[..]);
        let (mine, rest) = got.split_at_mut(chunk);
        for other in rest.chunks_exact(chunk) {
            match op {
                ReduceKind::Sum => mine.iter_mut().zip(other).for_each(|(a, x)| *a += x),
                ReduceKind::Max => mine.iter_mut().zip(other).for_each(|(a, x)| *a = a.max(*x)),
            }
        }
        let mut all = vec![0f32; chunk * n];
        comm.all_gather_into(&mine[..], &mut all[..]);
        all.truncate(len);
        Tensor::new(block.shape().to_vec(), Data::F32(all)).map_err(|e| CommError::Bad { rank, why: e.to_string() })
    }

    /// f32 blocks travel as raw elements through one `MPI_Allgather`, straight into the result
    /// when `dim` is outermost, or into a buffer the result is assembled from. Every member's
    /// block has the same shape: plans split dimensions evenly or not at all
    /// ([`sharding::ShardingSpec`] rejects uneven splits), so no counts are exchanged (blocks of
    /// different sizes would make MPI fail the job). Other dtypes take the default path.
    fn all_gather(&mut self, group: &[usize], block: &Tensor, dim: usize) -> Result<Tensor, CommError> {
        let rank = self.rank;
        let bad = |why: String| CommError::Bad { rank, why };
        let Data::F32(v) = block.data() else {
            let all = self.exchange(group, Arc::new(block.clone()))?;
            return crate::comm::concat(&all, dim).map_err(bad);
        };
        let shape = block.shape();
        if dim >= shape.len() {
            return Err(bad(format!("all-gather along dim {dim} of a block of shape {shape:?}")));
        }
        let n = group.len();
        let comm = self.checked(group)?;
        let mut buf = vec![0f32; v.len() * n];
        comm.all_gather_into(&v[..], &mut buf[..]);
        let outer: usize = shape[..dim].iter().product();
        let mut out_shape = shape.to_vec();
        out_shape[dim] *= n;
        let data = if outer <= 1 {
            buf
        } else {
            // Member k's block is `outer` runs of `run` elements; interleave them.
            let run = v.len() / outer;
            let mut out = Vec::with_capacity(buf.len());
            for o in 0..outer {
                for k in 0..n {
                    let at = k * v.len() + o * run;
                    ir::extend_fast(&mut out, &buf[at..at + run]);
                }
            }
            out
        };
        Tensor::new(out_shape, Data::F32(data)).map_err(|e| bad(e.to_string()))
    }

    /// Point to point on the world communicator (`MPI_Bsend`/`MPI_Recv` of the encoded block,
    /// after the full tag). MPI tags only go to 32767 for sure: the message's MPI tag is the tag
    /// modulo 32768, and the receiver checks the full one (two blocks whose tags wrap to the
    /// same number are received in the order sent, which a plan may not give: an error then,
    /// never a wrong block).
    fn send(&mut self, to: usize, tag: u64, block: &Tensor) -> Result<(), CommError> {
        crate::comm::pair(self.rank, to).map_err(|why| CommError::Bad { rank: self.rank, why })?;
        if to >= self.size {
            return Err(CommError::Bad { rank: self.rank, why: format!("sends to rank {to} of {}", self.size) });
        }
        // Buffered (MPI_Bsend, into the buffer `MpiWorld::reserve_sends` attached): a pipeline
        // schedule has two stages send to each other at once, and a blocking send of a large
        // block would wait for its receive forever.
        let mut msg = tag.to_le_bytes().to_vec();
        msg.extend(encode(block));
        self.world.process_at_rank(to as i32).buffered_send_with_tag(&msg[..], mpi_tag(tag));
        Ok(())
    }

    fn recv(&mut self, from: usize, tag: u64, meta: &TensorMeta) -> Result<Tensor, CommError> {
        let rank = self.rank;
        crate::comm::pair(rank, from).map_err(|why| CommError::Bad { rank, why })?;
        if from >= self.size {
            return Err(CommError::Bad { rank, why: format!("receives from rank {from} of {}", self.size) });
        }
        let (bytes, _) = self.world.process_at_rank(from as i32).receive_vec_with_tag::<u8>(mpi_tag(tag));
        let (head, body) = bytes.split_at(8.min(bytes.len()));
        let got = u64::from_le_bytes(head.try_into().unwrap_or([0xff; 8]));
        if got != tag {
            return Err(CommError::Bad {
                rank,
                why: format!(
                    "expected block {tag} from rank {from}, got block {got} (their MPI tags wrap to the same)"
                ),
            });
        }
        let t = decode(body).map_err(|why| CommError::Bad { rank, why })?;
        crate::comm::received(rank, from, meta, Some(t))
    }

    /// Splits every group's communicator now: every rank calls this with its groups of the same
    /// axis sets in the same order, so the n-th split of every rank meets (see the module docs).
    fn prepare(&mut self, groups: &[Vec<usize>]) -> Result<(), CommError> {
        for g in groups {
            self.checked(g)?;
        }
        Ok(())
    }

    fn abort(&self, _cause: &str) {
        self.world.abort(1)
    }
}
