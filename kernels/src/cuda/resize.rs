//! Resize and its gradient on the device: the CPU's per-axis linear maps (`ir::ResizeAttrs::taps`,
//! computed on the host and uploaded as compressed rows), one kernel launch per resized axis.
//! Each output element sums its row's taps in the CPU's order, so the gradient (the transposed
//! rows) gathers instead of scattering: deterministic, no atomics.

use super::device::{CudaContext, DeviceBuf, Family, grid};
use super::tensor::CudaTensor;
use crate::Error;
use ir::ResizeAttrs;

pub(crate) const SRC: &str = r#"
// out[o, j, i] = sum over t in start[j]..start[j+1] of w[t] * x[o, idx[t], i]
// (x is [outer, in_len, inner], out is [outer, out_len, inner]).
extern "C" __global__ void axis_map(float* out, const float* x, const i64* start, const i64* idx,
                                    const float* w, i64 outer, i64 in_len, i64 out_len, i64 inner) {
    FOR_EACH(e, outer * out_len * inner) {
        i64 i = e % inner, j = (e / inner) % out_len, o = e / (inner * out_len);
        float acc = 0.f;
        for (i64 t = start[j]; t < start[j + 1]; ++t) acc += w[t] * x[(o * in_len + idx[t]) * inner + i];
        out[e] = acc;
    }
}
"#;

/// Applies the compressed rows `start`/`index`/`weight` (one row per output position) along
/// `axis` of `x` (shape `shape`), giving `out_len` positions on that axis.
#[allow(clippy::too_many_arguments)]
fn axis_map(
    ctx: &CudaContext,
    op: &'static str,
    x: &DeviceBuf<f32>,
    shape: &[usize],
    axis: usize,
    out_len: usize,
    start: &[usize],
    index: &[usize],
    weight: &[f64],
) -> Result<DeviceBuf<f32>, Error> {
    let inner: usize = shape[axis + 1..].iter().product();
    let outer: usize = shape[..axis].iter().product();
    let n = outer * out_len * inner;
    let mut out = ctx.alloc::<f32>(op, n)?;
    if n > 0 {
        let start: Vec<i64> = start.iter().map(|&v| v as i64).collect();
        let index: Vec<i64> = index.iter().map(|&v| v as i64).collect();
        let weight: Vec<f32> = weight.iter().map(|&v| v as f32).collect();
        let (sd, id, wd) =
            (ctx.upload_slice(op, &start)?, ctx.upload_slice(op, &index)?, ctx.upload_slice(op, &weight)?);
        let a = [outer, shape[axis], out_len, inner].map(|v| v as i64);
        launch!(ctx, op, Family::Resize, "axis_map", grid(n);
            &mut out.s, &x.s, &sd.s, &id.s, &wd.s, &a[0], &a[1], &a[2], &a[3])?;
    }
    Ok(out)
}

/// `Resize`: the input resampled along each resized axis in turn.
pub(crate) fn resize(
    ctx: &CudaContext,
    a: &ResizeAttrs,
    x: &CudaTensor,
    out_shape: &[usize],
) -> Result<CudaTensor, Error> {
    let op = "resize";
    let xv = x.f32s(op)?;
    if a.axes.is_empty() {
        return Ok(x.clone());
    }
    let mut shape = x.shape().to_vec();
    let mut cur: Option<DeviceBuf<f32>> = None;
    for (k, ax) in a.axes.iter().enumerate() {
        let taps = a.taps(k, shape[ax.axis]);
        let start: Vec<usize> = (0..=ax.size).map(|j| j * taps.width).collect();
        let src = cur.as_ref().unwrap_or(xv);
        let next = axis_map(ctx, op, src, &shape, ax.axis, ax.size, &start, &taps.index, &taps.weight)?;
        cur = Some(next);
        shape[ax.axis] = ax.size;
    }
    let out = cur.ok_or_else(|| Error::BadInput { op, message: "no resized axis".into() })?;
    Ok(CudaTensor::from_f32(out_shape, out))
}

/// `ResizeGrad`: dy mapped back through the transposed per-axis maps, last axis first.
pub(crate) fn resize_grad(
    ctx: &CudaContext,
    a: &ResizeAttrs,
    dy: &CudaTensor,
    shape: &[usize],
) -> Result<CudaTensor, Error> {
    let op = "resize_grad";
    let dv = dy.f32s(op)?;
    if a.axes.is_empty() {
        return Ok(dy.clone());
    }
    let mut shapes = vec![shape.to_vec()];
    for ax in &a.axes {
        let mut s = shapes[shapes.len() - 1].clone();
        s[ax.axis] = ax.size;
        shapes.push(s);
    }
    let mut cur: Option<DeviceBuf<f32>> = None;
    for (k, ax) in a.axes.iter().enumerate().rev() {
        let in_len = shapes[k][ax.axis];
        let (start, index, weight) = a.taps(k, in_len).transpose(in_len);
        let src = cur.as_ref().unwrap_or(dv);
        let next = axis_map(ctx, op, src, &shapes[k + 1], ax.axis, in_len, &start, &index, &weight)?;
        cur = Some(next);
    }
    let out = cur.ok_or_else(|| Error::BadInput { op, message: "no resized axis".into() })?;
    Ok(CudaTensor::from_f32(shape, out))
}
