//! Data movement: Transpose, Expand, Concat, Split, Slice, Gather, Pad. All dtypes.

use super::{CpuContext, strides, tensor};
use crate::Error;
use ir::{Data, SliceAxis, Tensor};

/// Applies the same generic expression to whichever element vector `data` holds.
macro_rules! each_dtype {
    ($data:expr, $v:ident => $e:expr) => {
        match $data {
            Data::F32($v) => Data::F32($e),
            Data::F64($v) => Data::F64($e),
            Data::BF16($v) => Data::BF16($e),
            Data::F16($v) => Data::F16($e),
            Data::I64($v) => Data::I64($e),
            Data::Bool($v) => Data::Bool($e),
        }
    };
}

/// Merges adjacent dims that are walked contiguously and drops size-1 dims.
fn collapse(dims: &[usize], st: &[isize]) -> (Vec<usize>, Vec<isize>) {
    let (mut d, mut s): (Vec<usize>, Vec<isize>) = (Vec::new(), Vec::new());
    for (&n, &k) in dims.iter().zip(st) {
        if n == 1 {
            continue;
        }
        match (d.last_mut(), s.last_mut()) {
            (Some(ld), Some(ls)) if *ls == k * n as isize => {
                *ld *= n;
                *ls = k;
            }
            _ => {
                d.push(n);
                s.push(k);
            }
        }
    }
    if d.is_empty() {
        d.push(1);
        s.push(0);
    }
    (d, s)
}

/// `out[i0, i1, ..] = x[base + i0 * st[0] + i1 * st[1] + ..]` over `dims`. Callers derive
/// `dims`/`st` from inferred shapes; the output size and the range of indices reached are still
/// checked here (in i128, O(rank)), so a walk that would leave `x` is an error, never a panic.
fn strided<T: Copy + Send + Sync + Default>(
    ctx: &CpuContext,
    op: &'static str,
    x: &[T],
    base: isize,
    dims: &[usize],
    st: &[isize],
) -> Result<Vec<T>, Error> {
    let bad = |message: String| Error::BadInput { op, message };
    let n = ir::shape::checked_numel(dims)
        .filter(|_| ir::shape::checked_bytes(dims, ir::DType::Bool).is_some())
        .ok_or_else(|| bad(format!("output shape {dims:?} overflows")))?;
    if n == 0 {
        return Ok(Vec::new());
    }
    let (mut lo, mut hi) = (base as i128, base as i128);
    for (&d, &k) in dims.iter().zip(st) {
        let reach = (d as i128 - 1) * k as i128;
        if reach < 0 {
            lo += reach;
        } else {
            hi += reach;
        }
    }
    if lo < 0 || hi >= x.len() as i128 {
        return Err(bad(format!("a walk over {dims:?} reads outside its input of {} elements", x.len())));
    }
    let mut out = ir::alloc::try_filled(n, T::default()).map_err(|e| Error::out_of_memory(op, e))?;
    let (cd, cs) = collapse(dims, st);
    let len = *cd.last().expect("collapse keeps one dim");
    let s = *cs.last().expect("collapse keeps one dim");
    ctx.for_rows(&mut out, len, |r, row| {
        let (mut off, mut rr) = (base, r);
        for d in (0..cd.len() - 1).rev() {
            off += (rr % cd[d]) as isize * cs[d];
            rr /= cd[d];
        }
        if s == 1 {
            row.copy_from_slice(&x[off as usize..off as usize + len]);
        } else {
            for (j, o) in row.iter_mut().enumerate() {
                *o = x[(off + j as isize * s) as usize];
            }
        }
    });
    Ok(out)
}

/// Output dim `i` is input dim `perm[i]`.
pub(crate) fn transpose(ctx: &CpuContext, x: &Tensor, perm: &[usize]) -> Result<Tensor, Error> {
    let s = x.shape();
    let ist = strides(s);
    let dims: Vec<usize> = perm.iter().map(|&p| s[p]).collect();
    let st: Vec<isize> = perm.iter().map(|&p| ist[p] as isize).collect();
    let data = each_dtype!(x.data(), v => strided(ctx, "transpose", v, 0, &dims, &st)?);
    tensor("transpose", &dims, data)
}

/// Numpy broadcast of `x` to `shape`.
pub(crate) fn expand(ctx: &CpuContext, x: &Tensor, shape: &[usize]) -> Result<Tensor, Error> {
    let s = x.shape();
    let ist = strides(s);
    let r = shape.len();
    if s.len() > r {
        return Err(Error::BadInput { op: "expand", message: format!("cannot expand {s:?} to fewer dims {shape:?}") });
    }
    let mut st = vec![0isize; r];
    for i in 0..s.len() {
        st[i + r - s.len()] = if s[i] == 1 { 0 } else { ist[i] as isize };
    }
    let data = each_dtype!(x.data(), v => strided(ctx, "expand", v, 0, shape, &st)?);
    tensor("expand", shape, data)
}

/// Strided slice (negative steps walk backwards; bounds were checked by inference).
pub(crate) fn slice(ctx: &CpuContext, x: &Tensor, axes: &[SliceAxis], out_shape: &[usize]) -> Result<Tensor, Error> {
    let (base, st) = crate::geometry::slice_walk(x.shape(), axes, out_shape);
    let data = each_dtype!(x.data(), v => strided(ctx, "slice", v, base, out_shape, &st)?);
    tensor("slice", out_shape, data)
}

fn concat_vec<T: Copy>(parts: &[&[T]], chunks: &[usize], outer: usize) -> Result<Vec<T>, Error> {
    let n = chunks.iter().sum::<usize>().saturating_mul(outer);
    let mut out = ir::alloc::try_vec(n).map_err(|e| Error::out_of_memory("concat", e))?;
    for o in 0..outer {
        for (p, &c) in parts.iter().zip(chunks) {
            out.extend_from_slice(&p[o * c..(o + 1) * c]);
        }
    }
    Ok(out)
}

/// Concatenation along `axis`.
pub(crate) fn concat(inputs: &[&Tensor], axis: usize, out_shape: &[usize]) -> Result<Tensor, Error> {
    let outer: usize = out_shape[..axis].iter().product();
    let inner: usize = out_shape[axis + 1..].iter().product();
    let chunks: Vec<usize> = inputs.iter().map(|t| t.shape()[axis] * inner).collect();
    macro_rules! cat {
        ($variant:ident, $get:ident) => {{
            let parts: Option<Vec<_>> = inputs.iter().map(|t| t.$get()).collect();
            let parts = parts.ok_or_else(|| Error::BadInput { op: "concat", message: "input dtypes differ".into() })?;
            Data::$variant(concat_vec(&parts, &chunks, outer)?)
        }};
    }
    let data = match inputs[0].data() {
        Data::F32(_) => cat!(F32, as_f32),
        Data::F64(_) => cat!(F64, as_f64),
        Data::BF16(_) | Data::F16(_) => return Err(super::wrong_float("concat", inputs[0].dtype())),
        Data::I64(_) => cat!(I64, as_i64),
        Data::Bool(_) => cat!(Bool, as_bool),
    };
    tensor("concat", out_shape, data)
}

/// Splits along `axis` into pieces of `sizes`.
pub(crate) fn split(x: &Tensor, axis: usize, sizes: &[usize]) -> Result<Vec<Tensor>, Error> {
    let s = x.shape();
    let outer: usize = s[..axis].iter().product();
    let inner: usize = s[axis + 1..].iter().product();
    let row = s[axis] * inner;
    let mut outs = Vec::with_capacity(sizes.len());
    let mut at = 0;
    for &sz in sizes {
        let (lo, hi) = (at * inner, (at + sz) * inner);
        let data = each_dtype!(x.data(), v => (0..outer).flat_map(|o| v[o * row + lo..o * row + hi].iter().copied()).collect());
        let mut shape = s.to_vec();
        shape[axis] = sz;
        outs.push(tensor("split", &shape, data)?);
        at += sz;
    }
    Ok(outs)
}

/// Gathers slices of `x` along `axis` at i64 `indices` (negative indices count from the end).
pub(crate) fn gather(x: &Tensor, indices: &Tensor, axis: usize, out_shape: &[usize]) -> Result<Tensor, Error> {
    let idx =
        indices.as_i64().ok_or_else(|| Error::BadInput { op: "gather", message: "indices must be i64".into() })?;
    let s = x.shape();
    let d = s[axis];
    let outer: usize = s[..axis].iter().product();
    let inner: usize = s[axis + 1..].iter().product();
    let mut pos = Vec::with_capacity(idx.len());
    for &i in idx {
        let j = if i < 0 { i + d as i64 } else { i };
        if j < 0 || j >= d as i64 {
            return Err(Error::BadInput {
                op: "gather",
                message: format!("index {i} out of range for axis {axis} of size {d}"),
            });
        }
        pos.push(j as usize);
    }
    fn go<T: Copy>(v: &[T], pos: &[usize], outer: usize, d: usize, inner: usize) -> Result<Vec<T>, Error> {
        let n = outer.checked_mul(pos.len()).and_then(|n| n.checked_mul(inner)).unwrap_or(usize::MAX);
        let mut out = ir::alloc::try_vec(n).map_err(|e| Error::out_of_memory("gather", e))?;
        for o in 0..outer {
            for &p in pos {
                let at = (o * d + p) * inner;
                out.extend_from_slice(&v[at..at + inner]);
            }
        }
        Ok(out)
    }
    let data = each_dtype!(x.data(), v => go(v, &pos, outer, d, inner)?);
    tensor("gather", out_shape, data)
}

/// Constant padding: `pads` holds the begins then the ends of every dim.
pub(crate) fn pad(x: &Tensor, pads: &[usize], value: f32, out_shape: &[usize]) -> Result<Tensor, Error> {
    let s = x.shape();
    let r = s.len();
    fn go<T: Copy>(v: &[T], s: &[usize], pads: &[usize], out_shape: &[usize], fill: T) -> Result<Vec<T>, Error> {
        let n = ir::shape::checked_numel(out_shape).unwrap_or(usize::MAX);
        let mut out = ir::alloc::try_filled(n, fill).map_err(|e| Error::out_of_memory("pad", e))?;
        if v.is_empty() || s.is_empty() {
            out.iter_mut().zip(v).for_each(|(o, &x)| *o = x);
            return Ok(out);
        }
        let r = s.len();
        let ost = strides(out_shape);
        let len = s[r - 1];
        for (row, src) in v.chunks(len).enumerate() {
            let (mut rr, mut off) = (row, pads[r - 1]);
            for d in (0..r - 1).rev() {
                off += (rr % s[d] + pads[d]) * ost[d];
                rr /= s[d];
            }
            out[off..off + len].copy_from_slice(src);
        }
        Ok(out)
    }
    let _ = r;
    let data = match x.data() {
        Data::F32(v) => Data::F32(go(v, s, pads, out_shape, value)?),
        Data::F64(v) => Data::F64(go(v, s, pads, out_shape, value as f64)?),
        Data::BF16(v) => Data::BF16(go(v, s, pads, out_shape, ir::half::bf16::from_f32(value))?),
        Data::F16(v) => Data::F16(go(v, s, pads, out_shape, ir::half::f16::from_f32(value))?),
        Data::I64(v) => Data::I64(go(v, s, pads, out_shape, value as i64)?),
        Data::Bool(v) => Data::Bool(go(v, s, pads, out_shape, value != 0.0)?),
    };
    tensor("pad", out_shape, data)
}
