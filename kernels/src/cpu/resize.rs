//! Resize and its gradient: each resized axis is a one-axis linear map given by its taps
//! (`ir::ResizeAttrs::taps`), applied axis by axis; the gradient applies the transposed maps in
//! reverse order. Sums run in the element type, in tap order.

use super::{CpuContext, F, Float, floats, tensor};
use crate::Error;
use ir::{ResizeAttrs, Tensor};

/// Applies the map with rows `start`/`index`/`weight` (compressed rows, one per output position)
/// along `axis` of `x` (shape `shape`), giving `out_len` positions on that axis.
#[allow(clippy::too_many_arguments)]
fn axis_map(
    ctx: &CpuContext,
    x: &[F],
    shape: &[usize],
    axis: usize,
    out_len: usize,
    start: &[usize],
    index: &[usize],
    weight: &[f64],
) -> Vec<F> {
    let in_len = shape[axis];
    let inner: usize = shape[axis + 1..].iter().product();
    let outer: usize = shape[..axis].iter().product();
    let mut out = vec![0.0 as F; outer * out_len * inner];
    let taps = index.len().max(1) / out_len.max(1);
    ctx.for_rows_weighted(&mut out, (out_len * inner).max(1), taps, |o, row| {
        let src = &x[o * in_len * inner..(o + 1) * in_len * inner];
        for (j, dst) in row.chunks_mut(inner.max(1)).enumerate() {
            for t in start[j]..start[j + 1] {
                let w = weight[t] as F;
                let s = &src[index[t] * inner..(index[t] + 1) * inner];
                for (d, &v) in dst.iter_mut().zip(s) {
                    *d += w * v;
                }
            }
        }
    });
    out
}

/// `Resize`: the input resampled along each resized axis in turn.
pub(crate) fn resize(ctx: &CpuContext, a: &ResizeAttrs, x: &Tensor, out_shape: &[usize]) -> Result<Tensor, Error> {
    let mut cur = floats("resize", x)?.to_vec();
    let mut shape = x.shape().to_vec();
    for (k, ax) in a.axes.iter().enumerate() {
        if cur.is_empty() {
            break;
        }
        let taps = a.taps(k, shape[ax.axis]);
        let start: Vec<usize> = (0..=ax.size).map(|j| j * taps.width).collect();
        cur = axis_map(ctx, &cur, &shape, ax.axis, ax.size, &start, &taps.index, &taps.weight);
        shape[ax.axis] = ax.size;
    }
    if cur.is_empty() {
        cur = vec![0.0; out_shape.iter().product()];
    }
    tensor("resize", out_shape, F::data(cur))
}

/// `ResizeGrad`: dy mapped back through the transposed per-axis maps, last axis first.
pub(crate) fn resize_grad(ctx: &CpuContext, a: &ResizeAttrs, dy: &Tensor, shape: &[usize]) -> Result<Tensor, Error> {
    // The forward shapes before each axis step.
    let mut shapes = vec![shape.to_vec()];
    for ax in &a.axes {
        let mut s = shapes[shapes.len() - 1].clone();
        s[ax.axis] = ax.size;
        shapes.push(s);
    }
    let mut cur = floats("resize_grad", dy)?.to_vec();
    for (k, ax) in a.axes.iter().enumerate().rev() {
        let in_len = shapes[k][ax.axis];
        if cur.is_empty() || shapes[k].contains(&0) {
            cur = vec![0.0; shapes[k].iter().product()];
            continue;
        }
        let (start, index, weight) = a.taps(k, in_len).transpose(in_len);
        cur = axis_map(ctx, &cur, &shapes[k + 1], ax.axis, in_len, &start, &index, &weight);
    }
    tensor("resize_grad", shape, F::data(cur))
}
