//! A reference simulation of sharded tensors: distributing a global tensor into per-rank blocks,
//! executing collectives on those blocks with their exact semantics, and reassembling the global
//! tensor. Tests use it to check layout conversions and strategies by execution; the runtime uses
//! [`local_block`] to load a rank's parameter shard.
//!
//! Reductions add the group's blocks in group order, so every rank of a group computes bitwise the
//! same sum (replicas stay identical).

use crate::collective::{Collective, ReduceKind};
use crate::mesh::DeviceMesh;
use crate::spec::ShardingSpec;
use crate::{Error, Result};
use ir::{Data, Tensor};

fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// Checks that a block of `size` at `offsets` lies inside `shape` (same rank, every
/// `offset + size <= dim`), which keeps every linear index [`for_block`] computes in range.
fn check_block(shape: &[usize], offsets: &[usize], size: &[usize]) -> Result<()> {
    let fits = shape.len() == offsets.len()
        && shape.len() == size.len()
        && (0..shape.len()).all(|d| offsets[d].checked_add(size[d]).is_some_and(|e| e <= shape[d]));
    if fits {
        Ok(())
    } else {
        Err(Error::Sim(format!("a block of {size:?} at {offsets:?} does not lie inside shape {shape:?}")))
    }
}

/// Visits every index of a block of `size`, giving the linear offsets in `a` (at `a_off`) and `b`.
/// Both blocks must lie inside their shapes ([`check_block`]).
fn for_block(
    size: &[usize],
    a_shape: &[usize],
    a_off: &[usize],
    b_shape: &[usize],
    b_off: &[usize],
    mut f: impl FnMut(usize, usize),
) {
    if size.contains(&0) {
        return;
    }
    let (sa, sb) = (strides(a_shape), strides(b_shape));
    let mut idx = vec![0usize; size.len()];
    loop {
        let ia: usize = (0..size.len()).map(|d| (idx[d] + a_off[d]) * sa[d]).sum();
        let ib: usize = (0..size.len()).map(|d| (idx[d] + b_off[d]) * sb[d]).sum();
        f(ia, ib);
        let mut d = size.len();
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < size[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// The block of `t` at `offsets` with shape `size`. Panics when the block does not lie inside
/// `t`; [`checked_block`] is the same with an error instead, for offsets from outside.
pub fn block(t: &Tensor, offsets: &[usize], size: &[usize]) -> Tensor {
    checked_block(t, offsets, size).expect("the block lies inside the tensor")
}

/// The block of `t` at `offsets` with shape `size`, or an error when it does not lie inside `t`.
pub fn checked_block(t: &Tensor, offsets: &[usize], size: &[usize]) -> Result<Tensor> {
    check_block(t.shape(), offsets, size)?;
    t.block(offsets, size).ok_or_else(|| Error::Internal(format!("a block of {size:?} at {offsets:?}")))
}

/// How [`put_block`] combines a block with what is there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Combine {
    Assign,
    Reduce(ReduceKind),
}

fn put_block(dst: &mut Tensor, src: &Tensor, offsets: &[usize], how: Combine) -> Result<()> {
    check_block(dst.shape(), offsets, src.shape())?;
    let shape = dst.shape().to_vec();
    let zero = vec![0; shape.len()];
    let size = src.shape().to_vec();
    let data = std::mem::replace(dst, Tensor::scalar_f32(0.0)).into_data();
    let data = match (data, src.data()) {
        (Data::F32(mut d), Data::F32(s)) => {
            put_numbers(&mut d, s, &size, &shape, offsets, &zero, how, f32::max);
            Data::F32(d)
        }
        (Data::F64(mut d), Data::F64(s)) => {
            put_numbers(&mut d, s, &size, &shape, offsets, &zero, how, f64::max);
            Data::F64(d)
        }
        (Data::BF16(mut d), Data::BF16(s)) => {
            put_numbers(&mut d, s, &size, &shape, offsets, &zero, how, ir::half::bf16::max);
            Data::BF16(d)
        }
        (Data::F16(mut d), Data::F16(s)) => {
            put_numbers(&mut d, s, &size, &shape, offsets, &zero, how, ir::half::f16::max);
            Data::F16(d)
        }
        (Data::I64(mut d), Data::I64(s)) => {
            put_numbers(&mut d, s, &size, &shape, offsets, &zero, how, i64::max);
            Data::I64(d)
        }
        (Data::Bool(mut d), Data::Bool(s)) => {
            for_block(&size, &shape, offsets, &size, &zero, |id, is| match how {
                Combine::Assign => d[id] = s[is],
                Combine::Reduce(_) => d[id] |= s[is],
            });
            Data::Bool(d)
        }
        (d, s) => return Err(Error::Internal(format!("combining {:?} with {:?}", d.dtype(), s.dtype()))),
    };
    *dst = Tensor::new(shape, data).map_err(|e| Error::Internal(e.to_string()))?;
    Ok(())
}

/// [`put_block`] for numbers: assign, add, or take `max` (the type's own, so float NaN rules hold).
#[allow(clippy::too_many_arguments)]
fn put_numbers<T: Copy + std::ops::AddAssign>(
    d: &mut [T],
    s: &[T],
    size: &[usize],
    shape: &[usize],
    offsets: &[usize],
    zero: &[usize],
    how: Combine,
    max: fn(T, T) -> T,
) {
    for_block(size, shape, offsets, size, zero, |id, is| match how {
        Combine::Assign => d[id] = s[is],
        Combine::Reduce(ReduceKind::Sum) => d[id] += s[is],
        Combine::Reduce(ReduceKind::Max) => d[id] = max(d[id], s[is]),
    });
}

/// Zeros of `t`'s dtype, allocated fallibly (an assembled output or a gathered block is sized by
/// the plan).
fn zeros_like(shape: &[usize], t: &Tensor) -> Result<Tensor> {
    Tensor::zeros(&ir::TensorMeta::new(t.dtype(), shape.to_vec()))
        .map_err(|e| Error::Sim(format!("a block of {shape:?}: {e}")))
}

/// Concatenation along `dim`.
pub fn concat(parts: &[Tensor], dim: usize) -> Result<Tensor> {
    let first = parts.first().ok_or_else(|| Error::Internal("concat of nothing".into()))?;
    let mut shape = first.shape().to_vec();
    if dim >= shape.len() {
        return Err(Error::Sim(format!("concatenation along dim {dim} of rank-{} blocks", shape.len())));
    }
    // Each part must then fit its place ([`put_block`] checks); the total must not overflow.
    shape[dim] = parts
        .iter()
        .try_fold(0usize, |a, p| p.shape().get(dim).and_then(|&d| a.checked_add(d)))
        .ok_or_else(|| Error::Sim(format!("concatenating {} blocks along dim {dim} overflows", parts.len())))?;
    if ir::shape::checked_bytes(&shape, first.dtype()).is_none() {
        return Err(Error::Sim(ir::shape::too_large(&shape, first.dtype())));
    }
    let mut out = zeros_like(&shape, first)?;
    let mut off = vec![0; shape.len()];
    for p in parts {
        put_block(&mut out, p, &off, Combine::Assign)?;
        off[dim] += p.shape()[dim];
    }
    Ok(out)
}

/// `n` equal pieces along `dim` (`n` must divide the dim: a remainder would be dropped).
pub fn split(t: &Tensor, dim: usize, n: usize) -> Result<Vec<Tensor>> {
    let mut size = t.shape().to_vec();
    if dim >= size.len() || n == 0 || !size[dim].is_multiple_of(n) {
        return Err(Error::Sim(format!("cannot split shape {size:?} into {n} equal pieces along dim {dim}")));
    }
    size[dim] /= n;
    (0..n)
        .map(|i| {
            let mut off = vec![0; size.len()];
            off[dim] = i * size[dim];
            checked_block(t, &off, &size)
        })
        .collect()
}

fn reduce(parts: &[&Tensor], op: ReduceKind) -> Result<Tensor> {
    let mut acc = parts[0].clone();
    let zero = vec![0; acc.shape().len()];
    for p in &parts[1..] {
        put_block(&mut acc, p, &zero, Combine::Reduce(op))?;
    }
    Ok(acc)
}

/// Rank `rank`'s block of `global` under `spec`. Partial axes: member 0 of the partial group holds
/// the block, the others zeros (their sum is the tensor).
pub fn local_block(global: &Tensor, spec: &ShardingSpec, mesh: &DeviceMesh, rank: usize) -> Result<Tensor> {
    spec.check(global.shape(), mesh)?;
    let local = spec.local_shape(global.shape(), mesh);
    let b = checked_block(global, &spec.offsets(global.shape(), mesh, rank), &local)?;
    if mesh.index_in_group(rank, spec.partial()) == 0 { Ok(b) } else { zeros_like(&local, global) }
}

/// Every rank's block of `global` under `spec` (see [`local_block`]).
pub fn distribute(global: &Tensor, spec: &ShardingSpec, mesh: &DeviceMesh) -> Result<Vec<Tensor>> {
    (0..mesh.size()).map(|r| local_block(global, spec, mesh, r)).collect()
}

/// The global tensor from every rank's block: partial groups are summed (in group order), shards
/// placed at their offsets. Replicas must agree within `tol` (absolute, on floats; exact otherwise),
/// else this is an error naming the ranks.
pub fn assemble(
    locals: &[Tensor],
    spec: &ShardingSpec,
    global_shape: &[usize],
    mesh: &DeviceMesh,
    tol: f32,
) -> Result<Tensor> {
    let err = |why: String| Error::Shards { spec: spec.to_string(), why };
    if locals.len() != mesh.size() {
        return Err(err(format!("{} blocks for {} ranks", locals.len(), mesh.size())));
    }
    spec.check(global_shape, mesh)?;
    let local = spec.local_shape(global_shape, mesh);
    for (r, l) in locals.iter().enumerate() {
        if l.shape() != local.as_slice() {
            return Err(err(format!("rank {r} holds shape {:?}, the spec gives {local:?}", l.shape())));
        }
    }
    // The reduced value at each rank (sum over its partial group).
    let reduced: Vec<Tensor> = (0..mesh.size())
        .map(|r| {
            let g: Vec<&Tensor> = mesh.group_of(r, spec.partial()).iter().map(|&m| &locals[m]).collect();
            reduce(&g, ReduceKind::Sum)
        })
        .collect::<Result<_>>()?;
    let used = spec.used_axes();
    let replica_axes: Vec<usize> = (0..mesh.ndim()).filter(|a| !used.contains(a)).collect();
    let mut out = zeros_like(global_shape, &locals[0])?;
    for r in 0..mesh.size() {
        let rep = mesh.group_of(r, &replica_axes);
        if rep[0] == r {
            for &o in &rep[1..] {
                if let Some(why) = differs(&reduced[r], &reduced[o], tol) {
                    return Err(err(format!("replicas on ranks {r} and {o} differ: {why}")));
                }
            }
        }
        let partial_root = mesh.group_of(r, spec.partial())[0] == r;
        if rep[0] == r && partial_root {
            put_block(&mut out, &reduced[r], &spec.offsets(global_shape, mesh, r), Combine::Assign)?;
        }
    }
    Ok(out)
}

fn differs(a: &Tensor, b: &Tensor, tol: f32) -> Option<String> {
    match (a.data(), b.data()) {
        (Data::F32(x), Data::F32(y)) => {
            let worst = x.iter().zip(y).map(|(p, q)| (p - q).abs()).fold(0.0f32, f32::max);
            (worst > tol || x.iter().zip(y).any(|(p, q)| p.is_nan() != q.is_nan()))
                .then(|| format!("max |a-b| = {worst}"))
        }
        (Data::F64(x), Data::F64(y)) => {
            let worst = x.iter().zip(y).map(|(p, q)| (p - q).abs()).fold(0.0f64, f64::max);
            (worst > tol as f64 || x.iter().zip(y).any(|(p, q)| p.is_nan() != q.is_nan()))
                .then(|| format!("max |a-b| = {worst}"))
        }
        (x, y) => (x != y).then(|| "values differ".to_string()),
    }
}

/// Executes one collective on every rank's block (index = rank) and returns the new blocks.
pub fn apply(c: &Collective, locals: &[Tensor], mesh: &DeviceMesh) -> Result<Vec<Tensor>> {
    if locals.len() != mesh.size() {
        return Err(Error::Sim(format!("{} blocks for {} ranks", locals.len(), mesh.size())));
    }
    let axes = c.axes();
    let n = mesh.group_size(axes);
    let mut out: Vec<Option<Tensor>> = vec![None; locals.len()];
    for group in mesh.groups(axes) {
        let members: Vec<&Tensor> = group.iter().map(|&r| &locals[r]).collect();
        for (i, &r) in group.iter().enumerate() {
            let t = match c {
                Collective::AllGather { dim, .. } => {
                    concat(&members.iter().map(|t| (*t).clone()).collect::<Vec<_>>(), *dim)?
                }
                Collective::AllReduce { op, .. } => reduce(&members, *op)?,
                Collective::ReduceScatter { dim, .. } => {
                    split(&reduce(&members, ReduceKind::Sum)?, *dim, n)?.swap_remove(i)
                }
                Collective::AllToAll { split_dim, concat_dim, .. } => {
                    let pieces = members
                        .iter()
                        .map(|t| split(t, *split_dim, n).map(|mut p| p.swap_remove(i)))
                        .collect::<Result<Vec<Tensor>>>()?;
                    concat(&pieces, *concat_dim)?
                }
                Collective::Broadcast { .. } => members[0].clone(),
                Collective::Slice { dim, .. } => split(members[i], *dim, n)?.swap_remove(i),
                Collective::MakePartial { .. } => {
                    if i == 0 {
                        members[0].clone()
                    } else {
                        zeros_like(members[i].shape(), members[i])?
                    }
                }
            };
            out[r] = Some(t);
        }
    }
    out.into_iter().map(|t| t.ok_or_else(|| Error::Internal("a rank outside every group".into()))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iota(shape: &[usize]) -> Tensor {
        let n: usize = shape.iter().product();
        Tensor::f32(shape.to_vec(), (0..n).map(|i| i as f32).collect())
    }

    #[test]
    fn distribute_assemble_round_trip() {
        let m = DeviceMesh::uniform(&[2, 2]).unwrap();
        let t = iota(&[4, 6]);
        for s in ["S01 R", "S10 R", "R S1 | P0", "S1 S0", "R R | P01"] {
            let spec: ShardingSpec = s.parse().unwrap();
            let l = distribute(&t, &spec, &m).unwrap();
            assert_eq!(assemble(&l, &spec, &[4, 6], &m, 0.0).unwrap(), t, "{s}");
        }
    }

    #[test]
    fn gather_and_reduce_scatter() {
        let m = DeviceMesh::uniform(&[2, 2]).unwrap();
        let t = iota(&[4, 2]);
        let s: ShardingSpec = "S01 R".parse().unwrap();
        let l = distribute(&t, &s, &m).unwrap();
        let g = apply(&Collective::AllGather { axes: vec![1], dim: 0 }, &l, &m).unwrap();
        let s0: ShardingSpec = "S0 R".parse().unwrap();
        assert_eq!(assemble(&g, &s0, &[4, 2], &m, 0.0).unwrap(), t);
        let p: ShardingSpec = "R R | P1".parse().unwrap();
        let l = distribute(&t, &p, &m).unwrap();
        let rs = apply(&Collective::ReduceScatter { axes: vec![1], dim: 1 }, &l, &m).unwrap();
        assert_eq!(assemble(&rs, &"R S1".parse().unwrap(), &[4, 2], &m, 0.0).unwrap(), t);
    }
}
