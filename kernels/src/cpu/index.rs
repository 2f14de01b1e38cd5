//! The indexing family ([`ir::IndexOp`]) on the CPU, every dtype the op accepts.
//!
//! Gathers and scatters first turn their indices into flat element offsets ([`nd_offsets`],
//! [`elements_offsets`]), checking every index against its dim: these plans are shared with the
//! CUDA kernels, which upload them, so both backends reject the same indices with the same
//! message. Scatters apply their updates in index order, so duplicate targets end with the last
//! update (reduction none) or fold in that order (the others), on both backends.
//!
//! Sums (CumSum) run sequentially in the element type, as numpy's `cumsum` does.

use super::{strides, tensor};
use crate::Error;
use ir::{Data, IndexOp, ScatterReduction, Tensor};

fn bad(op: &'static str, message: String) -> Error {
    Error::BadInput { op, message }
}

/// An index into a dim of size `d`, negative ones counted from the end; out of range is an error.
/// `what` names the dim for the error; it is only called on one (a message per index would cost
/// more than the scatter itself).
fn norm_index(op: &'static str, i: i64, d: usize, what: impl Fn() -> String) -> Result<usize, Error> {
    let j = if i < 0 { i as i128 + d as i128 } else { i as i128 };
    if j < 0 || j >= d as i128 {
        return Err(bad(op, format!("index {i} is out of range for {} of size {d}", what())));
    }
    Ok(j as usize)
}

/// `GatherND`/`ScatterND` plan: for each index tuple (in order) the flat offset of the slice it
/// addresses in data, and the slice length.
pub(crate) fn nd_offsets(
    op: &'static str,
    data: &[usize],
    idx: &[i64],
    idx_shape: &[usize],
    batch_dims: usize,
) -> Result<(Vec<usize>, usize), Error> {
    let (q, slice) = ir::ops::index::nd_parts(op, data, idx_shape, batch_dims).map_err(|m| bad(op, m))?;
    let slice_len: usize = slice.iter().product();
    let tuples: usize = idx_shape[..idx_shape.len() - 1].iter().product();
    let per_batch: usize = idx_shape[batch_dims..idx_shape.len() - 1].iter().product();
    let batch_block: usize = data[batch_dims..].iter().product();
    let dst = strides(&data[batch_dims..]);
    let mut offs = Vec::with_capacity(tuples);
    for t in 0..tuples {
        let mut off = t.checked_div(per_batch).map_or(0, |b| b * batch_block);
        for j in 0..q {
            let d = data[batch_dims + j];
            off += norm_index(op, idx[t * q + j], d, || format!("dim {}", batch_dims + j))? * dst[j];
        }
        offs.push(off);
    }
    Ok((offs, slice_len))
}

/// `GatherElements`/`ScatterElements` plan: for each element of the indices (in order) the flat
/// offset it addresses in data.
pub(crate) fn elements_offsets(
    op: &'static str,
    data: &[usize],
    idx: &[i64],
    idx_shape: &[usize],
    axis: usize,
) -> Result<Vec<usize>, Error> {
    let (ds, is) = (strides(data), strides(idx_shape));
    let mut offs = Vec::with_capacity(idx.len());
    for (p, &i) in idx.iter().enumerate() {
        let mut off = 0;
        for k in 0..data.len() {
            let c = if k == axis {
                norm_index(op, i, data[axis], || format!("axis {axis}"))?
            } else {
                p / is[k] % idx_shape[k]
            };
            off += c * ds[k];
        }
        offs.push(off);
    }
    Ok(offs)
}

/// A scatter plan as the CUDA kernels run it: the distinct targets in first-seen order, and for
/// each (`start[t]..start[t + 1]`) the update slices that land on it, in index order. With
/// reduction none only the last one is kept (it is the one that stays).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn scatter_lists(targets: &[usize], reduction: ScatterReduction) -> (Vec<usize>, Vec<usize>, Vec<usize>) {
    let mut slot: std::collections::HashMap<usize, usize> = std::collections::HashMap::new();
    let mut uniq = Vec::new();
    let mut lists: Vec<Vec<usize>> = Vec::new();
    for (s, &t) in targets.iter().enumerate() {
        let k = *slot.entry(t).or_insert_with(|| {
            uniq.push(t);
            lists.push(Vec::new());
            uniq.len() - 1
        });
        if reduction == ScatterReduction::None {
            lists[k].clear();
        }
        lists[k].push(s);
    }
    let mut start = vec![0];
    let mut src = Vec::with_capacity(targets.len());
    for l in lists {
        src.extend(l);
        start.push(src.len());
    }
    (uniq, start, src)
}

/// Applies the updates in order: slice `s` of `upd` (length `len`) combines into `out` at
/// `targets[s]`.
fn scatter_into<T: Copy>(out: &mut [T], targets: &[usize], len: usize, upd: &[T], f: impl Fn(T, T) -> T) {
    for (s, &t) in targets.iter().enumerate() {
        for q in 0..len {
            out[t + q] = f(out[t + q], upd[s * len + q]);
        }
    }
}

fn scatter(
    op: &'static str,
    data: &Tensor,
    targets: &[usize],
    len: usize,
    upd: &Tensor,
    r: ScatterReduction,
) -> Result<Tensor, Error> {
    use ScatterReduction as R;
    macro_rules! num {
        ($x:expr, $u:expr, $v:ident, $add:expr, $mul:expr) => {{
            let mut o = $x.clone();
            match r {
                R::None => scatter_into(&mut o, targets, len, $u, |_, b| b),
                R::Add => scatter_into(&mut o, targets, len, $u, $add),
                R::Mul => scatter_into(&mut o, targets, len, $u, $mul),
                R::Max => scatter_into(&mut o, targets, len, $u, |a, b| if b > a { b } else { a }),
                R::Min => scatter_into(&mut o, targets, len, $u, |a, b| if b < a { b } else { a }),
            }
            Data::$v(o)
        }};
    }
    let d = match (data.data(), upd.data()) {
        (Data::F32(x), Data::F32(u)) => num!(x, u, F32, |a, b| a + b, |a, b| a * b),
        (Data::F64(x), Data::F64(u)) => num!(x, u, F64, |a, b| a + b, |a, b| a * b),
        (Data::I64(x), Data::I64(u)) => num!(x, u, I64, i64::wrapping_add, i64::wrapping_mul),
        (Data::Bool(x), Data::Bool(u)) if r == R::None => {
            let mut o = x.clone();
            scatter_into(&mut o, targets, len, u, |_, b| b);
            Data::Bool(o)
        }
        _ => return Err(bad(op, format!("no {} scatter of {} into {}", r.name(), upd.dtype(), data.dtype()))),
    };
    tensor(op, data.shape(), d)
}

/// `out[s * len + q] = x[offs[s] + q]`, any dtype.
fn take(op: &'static str, x: &Tensor, offs: &[usize], len: usize, out_shape: &[usize]) -> Result<Tensor, Error> {
    fn go<T: Copy>(v: &[T], offs: &[usize], len: usize) -> Vec<T> {
        let mut o = Vec::with_capacity(offs.len() * len);
        for &t in offs {
            o.extend_from_slice(&v[t..t + len]);
        }
        o
    }
    let d = match x.data() {
        Data::F32(v) => Data::F32(go(v, offs, len)),
        Data::F64(v) => Data::F64(go(v, offs, len)),
        Data::BF16(v) => Data::BF16(go(v, offs, len)),
        Data::F16(v) => Data::F16(go(v, offs, len)),
        Data::I64(v) => Data::I64(go(v, offs, len)),
        Data::Bool(v) => Data::Bool(go(v, offs, len)),
    };
    tensor(op, out_shape, d)
}

fn indices<'a>(op: &'static str, t: &'a Tensor) -> Result<&'a [i64], Error> {
    t.as_i64().ok_or_else(|| bad(op, format!("indices must be i64, got {}", t.dtype())))
}

/// `(outer, dim, inner)` of `shape` around `axis`.
pub(crate) fn around(shape: &[usize], axis: usize) -> (usize, usize, usize) {
    (shape[..axis].iter().product(), shape[axis], shape[axis + 1..].iter().product())
}

/// True when `a` comes before `b` in top-k / arg-max order: larger (or smaller) first, NaN
/// beyond every number.
fn ahead<T: PartialOrd + Copy>(a: T, b: T, largest: bool) -> bool {
    #[allow(clippy::eq_op)]
    let (an, bn) = (a != a, b != b);
    match (an, bn) {
        (true, true) => false,
        (true, false) => largest,
        (false, true) => !largest,
        _ => {
            if largest {
                a > b
            } else {
                a < b
            }
        }
    }
}

fn cumsum<T: Copy + Default>(
    v: &[T],
    shape: &[usize],
    axis: usize,
    excl: bool,
    rev: bool,
    add: fn(T, T) -> T,
) -> Vec<T> {
    let (outer, d, inner) = around(shape, axis);
    let mut o = vec![T::default(); v.len()];
    for a in 0..outer {
        for c in 0..inner {
            let mut acc = T::default();
            for j in 0..d {
                let j = if rev { d - 1 - j } else { j };
                let p = (a * d + j) * inner + c;
                if excl {
                    o[p] = acc;
                    acc = add(acc, v[p]);
                } else {
                    acc = add(acc, v[p]);
                    o[p] = acc;
                }
            }
        }
    }
    o
}

fn arg<T: PartialOrd + Copy>(v: &[T], shape: &[usize], axis: usize, largest: bool, last: bool) -> Vec<i64> {
    let (outer, d, inner) = around(shape, axis);
    let mut o = Vec::with_capacity(outer * inner);
    for a in 0..outer {
        for c in 0..inner {
            let at = |j: usize| v[(a * d + j) * inner + c];
            let mut best = 0;
            for j in 1..d {
                if ahead(at(j), at(best), largest) || (last && !ahead(at(best), at(j), largest)) {
                    best = j;
                }
            }
            o.push(best as i64);
        }
    }
    o
}

fn topk<T: PartialOrd + Copy + Default>(
    v: &[T],
    shape: &[usize],
    axis: usize,
    k: usize,
    largest: bool,
) -> (Vec<T>, Vec<i64>) {
    let (outer, d, inner) = around(shape, axis);
    let (mut vals, mut idx) = (vec![T::default(); outer * k * inner], vec![0i64; outer * k * inner]);
    let mut order: Vec<usize> = Vec::with_capacity(d);
    for a in 0..outer {
        for c in 0..inner {
            let at = |j: usize| v[(a * d + j) * inner + c];
            order.clear();
            order.extend(0..d);
            // Stable: equal values keep ascending indices.
            order.sort_by(|&x, &y| {
                if ahead(at(x), at(y), largest) {
                    std::cmp::Ordering::Less
                } else if ahead(at(y), at(x), largest) {
                    std::cmp::Ordering::Greater
                } else {
                    std::cmp::Ordering::Equal
                }
            });
            for (r, &j) in order.iter().take(k).enumerate() {
                let p = (a * k + r) * inner + c;
                vals[p] = at(j);
                idx[p] = j as i64;
            }
        }
    }
    (vals, idx)
}

fn trilu<T: Copy + Default>(v: &[T], shape: &[usize], upper: bool, k: i64) -> Vec<T> {
    let (r, c) = (shape[shape.len() - 2], shape[shape.len() - 1]);
    v.iter()
        .enumerate()
        .map(|(p, &x)| {
            let (i, j) = ((p / c.max(1) % r.max(1)) as i128, (p % c.max(1)) as i128);
            let keep = if upper { j - i >= k as i128 } else { j - i <= k as i128 };
            if keep { x } else { T::default() }
        })
        .collect()
}

/// Evaluates an indexing-family op; `outs` are the inferred output shapes.
pub(crate) fn eval(op: &IndexOp, inputs: &[&Tensor], outs: &[Vec<usize>]) -> Result<Vec<Tensor>, Error> {
    let name = op.name();
    let x = inputs[0];
    let shape = x.shape();
    let numeric = |what: &str| bad(name, format!("{what} of {} is not supported", x.dtype()));
    let one = |d: Data| Ok(vec![tensor(name, &outs[0], d)?]);
    match op {
        IndexOp::Trilu { upper, k } => one(match x.data() {
            Data::F32(v) => Data::F32(trilu(v, shape, *upper, *k)),
            Data::F64(v) => Data::F64(trilu(v, shape, *upper, *k)),
            Data::BF16(v) => Data::BF16(trilu(v, shape, *upper, *k)),
            Data::F16(v) => Data::F16(trilu(v, shape, *upper, *k)),
            Data::I64(v) => Data::I64(trilu(v, shape, *upper, *k)),
            Data::Bool(v) => Data::Bool(trilu(v, shape, *upper, *k)),
        }),
        IndexOp::GatherNd { batch_dims } => {
            let (offs, len) = nd_offsets(name, shape, indices(name, inputs[1])?, inputs[1].shape(), *batch_dims)?;
            Ok(vec![take(name, x, &offs, len, &outs[0])?])
        }
        IndexOp::GatherElements { axis } => {
            let offs = elements_offsets(name, shape, indices(name, inputs[1])?, inputs[1].shape(), *axis)?;
            Ok(vec![take(name, x, &offs, 1, &outs[0])?])
        }
        IndexOp::ScatterNd { reduction } => {
            let (offs, len) = nd_offsets(name, shape, indices(name, inputs[1])?, inputs[1].shape(), 0)?;
            Ok(vec![scatter(name, x, &offs, len, inputs[2], *reduction)?])
        }
        IndexOp::ScatterElements { axis, reduction } => {
            let offs = elements_offsets(name, shape, indices(name, inputs[1])?, inputs[1].shape(), *axis)?;
            Ok(vec![scatter(name, x, &offs, 1, inputs[2], *reduction)?])
        }
        IndexOp::CumSum { axis, exclusive: e, reverse: r } => one(match x.data() {
            Data::F32(v) => Data::F32(cumsum(v, shape, *axis, *e, *r, |a, b| a + b)),
            Data::F64(v) => Data::F64(cumsum(v, shape, *axis, *e, *r, |a, b| a + b)),
            Data::I64(v) => Data::I64(cumsum(v, shape, *axis, *e, *r, i64::wrapping_add)),
            Data::Bool(_) | Data::BF16(_) | Data::F16(_) => return Err(numeric("a cumulative sum")),
        }),
        IndexOp::ArgMax { axis, select_last, .. } | IndexOp::ArgMin { axis, select_last, .. } => {
            let largest = matches!(op, IndexOp::ArgMax { .. });
            one(Data::I64(match x.data() {
                Data::F32(v) => arg(v, shape, *axis, largest, *select_last),
                Data::F64(v) => arg(v, shape, *axis, largest, *select_last),
                Data::I64(v) => arg(v, shape, *axis, largest, *select_last),
                Data::Bool(_) | Data::BF16(_) | Data::F16(_) => return Err(numeric("an arg-reduction")),
            }))
        }
        IndexOp::TopK { axis, k, largest } => {
            let (vals, idx) = match x.data() {
                Data::F32(v) => {
                    let (a, b) = topk(v, shape, *axis, *k, *largest);
                    (Data::F32(a), b)
                }
                Data::F64(v) => {
                    let (a, b) = topk(v, shape, *axis, *k, *largest);
                    (Data::F64(a), b)
                }
                Data::I64(v) => {
                    let (a, b) = topk(v, shape, *axis, *k, *largest);
                    (Data::I64(a), b)
                }
                Data::Bool(_) | Data::BF16(_) | Data::F16(_) => return Err(numeric("top-k")),
            };
            Ok(vec![tensor(name, &outs[0], vals)?, tensor(name, &outs[1], Data::I64(idx))?])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::{CpuContext, eval as cpu_eval};
    use ir::{BinaryOp, Op};

    fn run(op: IndexOp, ins: &[&Tensor]) -> Result<Vec<Tensor>, Error> {
        cpu_eval(&CpuContext::new(1).unwrap(), &Op::Index(op), ins)
    }

    #[test]
    fn scatters_apply_updates_in_index_order() {
        let data = Tensor::f32([4], vec![1.0, 2.0, 3.0, 4.0]);
        let idx = Tensor::i64([3, 1], vec![1, -1, 1]);
        let upd = Tensor::f32([3], vec![10.0, 20.0, 30.0]);
        let none = run(IndexOp::ScatterNd { reduction: ScatterReduction::None }, &[&data, &idx, &upd]).unwrap();
        assert_eq!(none[0].as_f32().unwrap(), &[1.0, 30.0, 3.0, 20.0]);
        let add = run(IndexOp::ScatterNd { reduction: ScatterReduction::Add }, &[&data, &idx, &upd]).unwrap();
        assert_eq!(add[0].as_f32().unwrap(), &[1.0, 42.0, 3.0, 24.0]);
        let (uniq, start, src) = scatter_lists(&[1, 3, 1], ScatterReduction::None);
        assert_eq!((uniq, start, src), (vec![1, 3], vec![0, 1, 2], vec![2, 1]));
        let bad = Tensor::i64([3, 1], vec![1, 4, 0]);
        let e = run(IndexOp::ScatterNd { reduction: ScatterReduction::None }, &[&data, &bad, &upd]).unwrap_err();
        assert!(e.to_string().contains("index 4 is out of range"), "{e}");
    }

    #[test]
    fn top_k_and_arg_max_break_ties_by_index_and_put_nan_first() {
        let x = Tensor::f32([5], vec![1.0, 3.0, f32::NAN, 3.0, 0.0]);
        let t = run(IndexOp::TopK { axis: 0, k: 3, largest: true }, &[&x]).unwrap();
        assert!(t[0].as_f32().unwrap()[0].is_nan());
        assert_eq!(&t[0].as_f32().unwrap()[1..], &[3.0, 3.0]);
        assert_eq!(t[1].as_i64().unwrap(), &[2, 1, 3]);
        let s = run(IndexOp::TopK { axis: 0, k: 2, largest: false }, &[&x]).unwrap();
        assert_eq!(s[1].as_i64().unwrap(), &[4, 0]);
        let y = Tensor::i64([2, 3], vec![5, 1, 5, 2, 2, 0]);
        let first = run(IndexOp::ArgMax { axis: 1, keepdims: false, select_last: false }, &[&y]).unwrap();
        assert_eq!(first[0].as_i64().unwrap(), &[0, 0]);
        let last = run(IndexOp::ArgMax { axis: 1, keepdims: true, select_last: true }, &[&y]).unwrap();
        assert_eq!((last[0].shape(), last[0].as_i64().unwrap()), (&[2, 1][..], &[2, 1][..]));
        let min = run(IndexOp::ArgMin { axis: 0, keepdims: false, select_last: false }, &[&y]).unwrap();
        assert_eq!(min[0].as_i64().unwrap(), &[1, 0, 1]);
    }

    #[test]
    fn cumsum_trilu_and_remainders() {
        let x = Tensor::i64([2, 3], vec![1, 2, 3, 4, 5, 6]);
        let c = run(IndexOp::CumSum { axis: 1, exclusive: true, reverse: true }, &[&x]).unwrap();
        assert_eq!(c[0].as_i64().unwrap(), &[5, 3, 0, 11, 6, 0]);
        let t = run(IndexOp::Trilu { upper: false, k: 0 }, &[&x]).unwrap();
        assert_eq!(t[0].as_i64().unwrap(), &[1, 0, 0, 4, 5, 0]);
        let t = run(IndexOp::Trilu { upper: true, k: 1 }, &[&x]).unwrap();
        assert_eq!(t[0].as_i64().unwrap(), &[0, 2, 3, 0, 0, 6]);
        let ctx = CpuContext::new(1).unwrap();
        let a = Tensor::i64([4], vec![-7, 7, -7, 7]);
        let b = Tensor::i64([4], vec![3, -3, -3, 3]);
        let m = cpu_eval(&ctx, &Op::Binary(BinaryOp::Mod), &[&a, &b]).unwrap();
        assert_eq!(m[0].as_i64().unwrap(), &[2, -2, -1, 1]);
        let m = cpu_eval(&ctx, &Op::Binary(BinaryOp::Fmod), &[&a, &b]).unwrap();
        assert_eq!(m[0].as_i64().unwrap(), &[-1, 1, -1, 1]);
        let z = Tensor::i64([4], vec![1, 0, 1, 1]);
        assert!(cpu_eval(&ctx, &Op::Binary(BinaryOp::Mod), &[&a, &z]).is_err());
        let fa = Tensor::f32([2], vec![-7.5, 7.5]);
        let fb = Tensor::f32([2], vec![2.0, -2.0]);
        let m = cpu_eval(&ctx, &Op::Binary(BinaryOp::Mod), &[&fa, &fb]).unwrap();
        assert_eq!(m[0].as_f32().unwrap(), &[0.5, -0.5]);
    }
}
