//! Data movement, all dtypes: strided copies (Transpose, Expand, Slice), Concat, Split,
//! Gather, Pad, and the scatters of SliceGrad and GatherGrad.
//!
//! GatherGrad is deterministic: instead of atomics, the indices are read back to the host,
//! which validates them and builds, per target row, the list of source rows in ascending
//! order; each output element then sums its sources in exactly the CPU's order.

use super::device::{CudaContext, DeviceBuf, Family, MAX_RANK, Strided, broadcast_strides, contiguous, grid};
use super::tensor::{Buf, CudaTensor};
use crate::Error;
use ir::{SliceAxis, TensorMeta};

pub(crate) const SRC: &str = r#"
#define COPY(NAME, T) \
extern "C" __global__ void NAME(T* out, const T* x, Strided s, i64 n) { \
    FOR_EACH(i, n) { i64 o[1]; offsets(s, 1, i, o); out[i] = x[o[0]]; } \
}
COPY(copy_f32, float)
COPY(copy_i64, i64)
COPY(copy_u8, u8)

// The inverse walk: element i of x goes to its strided place in out.
extern "C" __global__ void scatter_f32(float* out, const float* x, Strided s, i64 n) {
    FOR_EACH(i, n) { i64 o[1]; offsets(s, 1, i, o); out[o[0]] = x[i]; }
}

// dst[r * dst_row + dst_off + c] = src[r * src_row + src_off + c] for r < rows, c < cols.
#define COPY2D(NAME, T) \
extern "C" __global__ void NAME(T* dst, const T* src, i64 rows, i64 cols, i64 dst_row, i64 dst_off, \
                                i64 src_row, i64 src_off) { \
    FOR_EACH(i, rows * cols) { \
        i64 r = i / cols, c = i % cols; \
        dst[r * dst_row + dst_off + c] = src[r * src_row + src_off + c]; \
    } \
}
COPY2D(copy2d_f32, float)
COPY2D(copy2d_i64, i64)
COPY2D(copy2d_u8, u8)

// out[o, j, q] = x[o, idx[j] (negative wraps), q]; indices were validated by the caller.
#define GATHER(NAME, T) \
extern "C" __global__ void NAME(T* out, const T* x, const i64* idx, i64 outer, i64 ni, i64 d, i64 inner) { \
    FOR_EACH(i, outer * ni * inner) { \
        i64 q = i % inner, t = i / inner; \
        i64 j = t % ni, o = t / ni; \
        i64 p = idx[j]; \
        if (p < 0) p += d; \
        out[i] = x[(o * d + p) * inner + q]; \
    } \
}
GATHER(gather_f32, float)
GATHER(gather_i64, i64)
GATHER(gather_u8, u8)

// out[p, j, q] = sum over k in start[j]..start[j+1] of dy[p, pos[k], q], in list order.
extern "C" __global__ void gather_grad_f32(float* out, const float* dy, const i64* start, const i64* pos,
                                           i64 pre, i64 dim, i64 post, i64 ni) {
    FOR_EACH(i, pre * dim * post) {
        i64 q = i % post, t = i / post;
        i64 j = t % dim, p = t / dim;
        float acc = 0.f;
        for (i64 k = start[j]; k < start[j + 1]; ++k) acc += dy[(p * ni + pos[k]) * post + q];
        out[i] = acc;
    }
}

// s.dims: output dims; s.st[0]: input strides; s.st[1]: pads before; s.st[2]: input dims.
#define PAD(NAME, T) \
extern "C" __global__ void NAME(T* out, const T* x, Strided s, i64 n, T fill) { \
    FOR_EACH(i, n) { \
        i64 rem = i, off = 0; \
        bool inside = true; \
        for (int d = (int)s.rank - 1; d >= 0; --d) { \
            i64 q = rem % s.dims[d]; \
            rem /= s.dims[d]; \
            i64 c = q - s.st[1][d]; \
            if (c < 0 || c >= s.st[2][d]) inside = false; else off += c * s.st[0][d]; \
        } \
        out[i] = inside ? x[off] : fill; \
    } \
}
PAD(pad_f32, float)
PAD(pad_i64, i64)
PAD(pad_u8, u8)
"#;

fn bad(op: &'static str, message: String) -> Error {
    Error::BadInput { op, message }
}

/// `out[i] = x[base + sum_d idx_d(i) * st[d]]` over `out_shape`, any dtype.
pub(crate) fn strided_copy(
    ctx: &CudaContext,
    op: &'static str,
    x: &CudaTensor,
    out_shape: &[usize],
    base: isize,
    st: &[isize],
) -> Result<CudaTensor, Error> {
    let n: usize = out_shape.iter().product();
    let n64 = n as i64;
    let s = Strided::new(op, out_shape, &[(base, st)])?;
    let (fam, cfg) = (Family::Shape, grid(n));
    let buf = match x.buf() {
        Buf::Half(_) => return Err(super::tensor::unwidened(op)),
        Buf::F32(v) => {
            let mut out = ctx.alloc::<f32>(op, n)?;
            if n > 0 {
                launch!(ctx, op, fam, "copy_f32", cfg; &mut out.s, &v.s, &s, &n64)?;
            }
            Buf::F32(out)
        }
        Buf::I64(v) => {
            let mut out = ctx.alloc::<i64>(op, n)?;
            if n > 0 {
                launch!(ctx, op, fam, "copy_i64", cfg; &mut out.s, &v.s, &s, &n64)?;
            }
            Buf::I64(out)
        }
        Buf::Bool(v) => {
            let mut out = ctx.alloc::<u8>(op, n)?;
            if n > 0 {
                launch!(ctx, op, fam, "copy_u8", cfg; &mut out.s, &v.s, &s, &n64)?;
            }
            Buf::Bool(out)
        }
    };
    Ok(CudaTensor::new(TensorMeta::new(x.dtype(), out_shape.to_vec()), buf))
}

/// Output dim `i` is input dim `perm[i]`.
pub(crate) fn transpose(ctx: &CudaContext, x: &CudaTensor, perm: &[usize]) -> Result<CudaTensor, Error> {
    let s = x.shape();
    let ist = contiguous(s);
    let dims: Vec<usize> = perm.iter().map(|&p| s[p]).collect();
    let st: Vec<isize> = perm.iter().map(|&p| ist[p]).collect();
    strided_copy(ctx, "transpose", x, &dims, 0, &st)
}

/// Numpy broadcast of `x` to `shape` (checked by inference).
pub(crate) fn expand(
    ctx: &CudaContext,
    op: &'static str,
    x: &CudaTensor,
    shape: &[usize],
) -> Result<CudaTensor, Error> {
    let st = broadcast_strides(x.shape(), shape.len());
    strided_copy(ctx, op, x, shape, 0, &st)
}

/// An f32 tensor broadcast (numpy rules) to `shape`, materialised; rejects shapes that do not
/// broadcast to exactly `shape`.
pub(crate) fn broadcast_f32(
    ctx: &CudaContext,
    op: &'static str,
    t: &CudaTensor,
    shape: &[usize],
) -> Result<CudaTensor, Error> {
    t.f32s(op)?;
    let b = ir::broadcast_shapes(t.shape(), shape).map_err(|m| bad(op, m))?;
    if b != shape {
        return Err(bad(op, format!("{:?} does not broadcast to {shape:?}", t.shape())));
    }
    if t.shape() == shape {
        return Ok(t.clone());
    }
    expand(ctx, op, t, shape)
}

/// [`broadcast_f32`] into a new buffer the caller may write (a GEMM's C, a convolution's bias).
pub(crate) fn broadcast_f32_buf(
    ctx: &CudaContext,
    op: &'static str,
    t: &CudaTensor,
    shape: &[usize],
) -> Result<DeviceBuf<f32>, Error> {
    let v = t.f32s(op)?;
    let b = ir::broadcast_shapes(t.shape(), shape).map_err(|m| bad(op, m))?;
    if b != shape {
        return Err(bad(op, format!("{:?} does not broadcast to {shape:?}", t.shape())));
    }
    let n: usize = shape.iter().product();
    let mut out = ctx.alloc::<f32>(op, n)?;
    if n > 0 {
        let n64 = n as i64;
        let st = broadcast_strides(t.shape(), shape.len());
        let s = Strided::new(op, shape, &[(0, &st)])?;
        launch!(ctx, op, Family::Shape, "copy_f32", grid(n); &mut out.s, &v.s, &s, &n64)?;
    }
    Ok(out)
}

/// Strided slice (negative steps walk backwards; bounds were checked by inference).
pub(crate) fn slice(
    ctx: &CudaContext,
    x: &CudaTensor,
    axes: &[SliceAxis],
    out_shape: &[usize],
) -> Result<CudaTensor, Error> {
    let (base, st) = crate::geometry::slice_walk(x.shape(), axes, out_shape);
    strided_copy(ctx, "slice", x, out_shape, base, &st)
}

/// Slice gradient: dy written back at the sliced positions of zeros of `shape` (f32, as the
/// CPU kernel).
pub(crate) fn slice_grad(
    ctx: &CudaContext,
    dy: &CudaTensor,
    axes: &[SliceAxis],
    shape: &[usize],
) -> Result<CudaTensor, Error> {
    let op = "slice_grad";
    let d = dy.f32s(op)?;
    let mut out = ctx.zeros::<f32>(op, shape.iter().product())?;
    let (base, st) = crate::geometry::slice_walk(shape, axes, dy.shape());
    let n = dy.numel();
    if n > 0 {
        let n64 = n as i64;
        let s = Strided::new(op, dy.shape(), &[(base, &st)])?;
        launch!(ctx, op, Family::Shape, "scatter_f32", grid(n); &mut out.s, &d.s, &s, &n64)?;
    }
    Ok(CudaTensor::from_f32(shape, out))
}

/// `dst[r * dst_row + dst_off + c] = src[r * src_row + src_off + c]` for `r < rows`, `c < cols`.
#[allow(clippy::too_many_arguments)]
fn copy2d(
    ctx: &CudaContext,
    op: &'static str,
    dst: &mut Buf,
    src: &Buf,
    rows: usize,
    cols: usize,
    dst_row: usize,
    dst_off: usize,
    src_row: usize,
    src_off: usize,
) -> Result<(), Error> {
    let n = rows * cols;
    if n == 0 {
        return Ok(());
    }
    let a = [rows, cols, dst_row, dst_off, src_row, src_off].map(|v| v as i64);
    let (fam, cfg) = (Family::Shape, grid(n));
    match (dst, src) {
        (Buf::F32(d), Buf::F32(s)) => {
            launch!(ctx, op, fam, "copy2d_f32", cfg; &mut d.s, &s.s, &a[0], &a[1], &a[2], &a[3], &a[4], &a[5])
        }
        (Buf::I64(d), Buf::I64(s)) => {
            launch!(ctx, op, fam, "copy2d_i64", cfg; &mut d.s, &s.s, &a[0], &a[1], &a[2], &a[3], &a[4], &a[5])
        }
        (Buf::Bool(d), Buf::Bool(s)) => {
            launch!(ctx, op, fam, "copy2d_u8", cfg; &mut d.s, &s.s, &a[0], &a[1], &a[2], &a[3], &a[4], &a[5])
        }
        _ => Err(bad(op, "input dtypes differ".into())),
    }
}

/// An uninitialised buffer of `n` elements of `like`'s dtype.
fn alloc_like(ctx: &CudaContext, op: &'static str, like: &CudaTensor, n: usize) -> Result<Buf, Error> {
    Ok(match like.buf() {
        Buf::Half(_) => return Err(super::tensor::unwidened(op)),
        Buf::F32(_) => Buf::F32(ctx.alloc(op, n)?),
        Buf::I64(_) => Buf::I64(ctx.alloc(op, n)?),
        Buf::Bool(_) => Buf::Bool(ctx.alloc(op, n)?),
    })
}

/// Concatenation along `axis`.
pub(crate) fn concat(
    ctx: &CudaContext,
    inputs: &[&CudaTensor],
    axis: usize,
    out_shape: &[usize],
) -> Result<CudaTensor, Error> {
    let op = "concat";
    let outer: usize = out_shape[..axis].iter().product();
    let inner: usize = out_shape[axis + 1..].iter().product();
    let total = out_shape[axis] * inner;
    let mut out = alloc_like(ctx, op, inputs[0], out_shape.iter().product())?;
    let mut off = 0;
    for t in inputs {
        let chunk = t.shape()[axis] * inner;
        copy2d(ctx, op, &mut out, t.buf(), outer, chunk, total, off, chunk, 0)?;
        off += chunk;
    }
    Ok(CudaTensor::new(TensorMeta::new(inputs[0].dtype(), out_shape.to_vec()), out))
}

/// Splits along `axis` into pieces of `sizes`.
pub(crate) fn split(ctx: &CudaContext, x: &CudaTensor, axis: usize, sizes: &[usize]) -> Result<Vec<CudaTensor>, Error> {
    let op = "split";
    let s = x.shape();
    let outer: usize = s[..axis].iter().product();
    let inner: usize = s[axis + 1..].iter().product();
    let row = s[axis] * inner;
    let mut outs = Vec::with_capacity(sizes.len());
    let mut at = 0;
    for &sz in sizes {
        let mut shape = s.to_vec();
        shape[axis] = sz;
        let mut buf = alloc_like(ctx, op, x, outer * sz * inner)?;
        copy2d(ctx, op, &mut buf, x.buf(), outer, sz * inner, sz * inner, 0, row, at * inner)?;
        outs.push(CudaTensor::new(TensorMeta::new(x.dtype(), shape), buf));
        at += sz;
    }
    Ok(outs)
}

/// Indices read back to the host and checked against an axis of size `d` (negative wrap);
/// returns them normalised to `0..d`.
fn checked_indices(
    ctx: &CudaContext,
    op: &'static str,
    idx: &CudaTensor,
    axis: usize,
    d: usize,
) -> Result<Vec<usize>, Error> {
    let raw = ctx.download_slice(op, idx.i64s(op)?, idx.numel())?;
    raw.iter()
        .map(|&i| {
            let j = if i < 0 { i + d as i64 } else { i };
            if j < 0 || j >= d as i64 {
                return Err(bad(op, format!("index {i} out of range for axis {axis} of size {d}")));
            }
            Ok(j as usize)
        })
        .collect()
}

/// Gathers slices of `x` along `axis` at i64 `indices` (negative indices count from the end).
/// Reads the indices back to validate them (synchronises the stream).
pub(crate) fn gather(
    ctx: &CudaContext,
    x: &CudaTensor,
    indices: &CudaTensor,
    axis: usize,
    out_shape: &[usize],
) -> Result<CudaTensor, Error> {
    let op = "gather";
    let s = x.shape();
    let d = s[axis];
    checked_indices(ctx, op, indices, axis, d)?;
    let idx = indices.i64s(op)?;
    let outer: usize = s[..axis].iter().product();
    let inner: usize = s[axis + 1..].iter().product();
    let ni = indices.numel();
    let n = outer * ni * inner;
    let a = [outer, ni, d, inner].map(|v| v as i64);
    let (fam, cfg) = (Family::Shape, grid(n));
    let buf = match x.buf() {
        Buf::Half(_) => return Err(super::tensor::unwidened(op)),
        Buf::F32(v) => {
            let mut out = ctx.alloc::<f32>(op, n)?;
            if n > 0 {
                launch!(ctx, op, fam, "gather_f32", cfg; &mut out.s, &v.s, &idx.s, &a[0], &a[1], &a[2], &a[3])?;
            }
            Buf::F32(out)
        }
        Buf::I64(v) => {
            let mut out = ctx.alloc::<i64>(op, n)?;
            if n > 0 {
                launch!(ctx, op, fam, "gather_i64", cfg; &mut out.s, &v.s, &idx.s, &a[0], &a[1], &a[2], &a[3])?;
            }
            Buf::I64(out)
        }
        Buf::Bool(v) => {
            let mut out = ctx.alloc::<u8>(op, n)?;
            if n > 0 {
                launch!(ctx, op, fam, "gather_u8", cfg; &mut out.s, &v.s, &idx.s, &a[0], &a[1], &a[2], &a[3])?;
            }
            Buf::Bool(out)
        }
    };
    Ok(CudaTensor::new(TensorMeta::new(x.dtype(), out_shape.to_vec()), buf))
}

/// Gather gradient: the sum, for each row of the data's shape, of the dy rows gathered from it
/// (deterministic; see the module docs).
pub(crate) fn gather_grad(
    ctx: &CudaContext,
    indices: &CudaTensor,
    dy: &CudaTensor,
    axis: usize,
    shape: &[usize],
) -> Result<CudaTensor, Error> {
    let op = "gather_grad";
    let dv = dy.f32s(op)?;
    let dim = shape[axis];
    let pos = checked_indices(ctx, op, indices, axis, dim)?;
    let pre: usize = shape[..axis].iter().product();
    let post: usize = shape[axis + 1..].iter().product();
    let ni = pos.len();
    // Counting sort of source positions by target row, ascending within a row.
    let mut start = vec![0i64; dim + 1];
    for &j in &pos {
        start[j + 1] += 1;
    }
    for j in 0..dim {
        start[j + 1] += start[j];
    }
    let mut fill: Vec<i64> = start[..dim].to_vec();
    let mut list = vec![0i64; ni];
    for (i, &j) in pos.iter().enumerate() {
        list[fill[j] as usize] = i as i64;
        fill[j] += 1;
    }
    let n = pre * dim * post;
    let mut out = ctx.alloc::<f32>(op, n)?;
    if n > 0 {
        let (start_d, list_d) = (ctx.upload_slice(op, &start)?, ctx.upload_slice(op, &list)?);
        let a = [pre, dim, post, ni].map(|v| v as i64);
        launch!(ctx, op, Family::Shape, "gather_grad_f32", grid(n);
            &mut out.s, &dv.s, &start_d.s, &list_d.s, &a[0], &a[1], &a[2], &a[3])?;
    }
    Ok(CudaTensor::from_f32(shape, out))
}

/// Constant padding: `pads` holds the begins then the ends of every dim; the fill is `value`
/// converted as the CPU converts it (`as i64` for i64, `!= 0` for bool).
pub(crate) fn pad(
    ctx: &CudaContext,
    x: &CudaTensor,
    pads: &[usize],
    value: f32,
    out_shape: &[usize],
) -> Result<CudaTensor, Error> {
    let op = "pad";
    let r = out_shape.len();
    if r > MAX_RANK {
        return Err(Error::Unsupported {
            op,
            reason: format!("rank {r} (the CUDA pad kernel takes at most {MAX_RANK})"),
        });
    }
    let n: usize = out_shape.iter().product();
    let n64 = n as i64;
    let ist = contiguous(x.shape());
    let mut s = Strided::default();
    {
        let before: Vec<isize> = pads[..r].iter().map(|&p| p as isize).collect();
        let dims: Vec<isize> = x.shape().iter().map(|&d| d as isize).collect();
        s.set_raw(out_shape, &[&ist, &before, &dims]);
    }
    let (fam, cfg) = (Family::Shape, grid(n));
    let buf = match x.buf() {
        Buf::Half(_) => return Err(super::tensor::unwidened(op)),
        Buf::F32(v) => {
            let mut out = ctx.alloc::<f32>(op, n)?;
            if n > 0 {
                launch!(ctx, op, fam, "pad_f32", cfg; &mut out.s, &v.s, &s, &n64, &value)?;
            }
            Buf::F32(out)
        }
        Buf::I64(v) => {
            let mut out = ctx.alloc::<i64>(op, n)?;
            let fill = value as i64;
            if n > 0 {
                launch!(ctx, op, fam, "pad_i64", cfg; &mut out.s, &v.s, &s, &n64, &fill)?;
            }
            Buf::I64(out)
        }
        Buf::Bool(v) => {
            let mut out = ctx.alloc::<u8>(op, n)?;
            let fill = (value != 0.0) as u8;
            if n > 0 {
                launch!(ctx, op, fam, "pad_u8", cfg; &mut out.s, &v.s, &s, &n64, &fill)?;
            }
            Buf::Bool(out)
        }
    };
    Ok(CudaTensor::new(TensorMeta::new(x.dtype(), out_shape.to_vec()), buf))
}
