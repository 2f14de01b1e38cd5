//! Normalisations: BatchNorm (inference), LayerNorm, LRN, Softmax and LogSoftmax.

use super::elementwise::{broadcast_f32, exp_fast, with_simd};
use super::{CpuContext, floats, tensor};
use super::{F, Float};
use crate::Error;
use ir::Tensor;

/// `(x - mean) / sqrt(var + eps) * scale + bias` per channel (dim 1).
pub(crate) fn batch_norm(ctx: &CpuContext, inputs: &[&Tensor], eps: f32) -> Result<Tensor, Error> {
    let eps = eps as F;
    let op = "batchnorm";
    let x = floats(op, inputs[0])?;
    let [scale, bias, mean, var] = [1, 2, 3, 4].map(|i| floats(op, inputs[i]));
    let (scale, bias, mean, var) = (scale?, bias?, mean?, var?);
    let s = inputs[0].shape();
    let c = s[1];
    let sp: usize = s[2..].iter().product();
    let mul: Vec<F> = (0..c).map(|i| scale[i] / (var[i] + eps).sqrt()).collect();
    let add: Vec<F> = (0..c).map(|i| bias[i] - mean[i] * mul[i]).collect();
    let mut out = vec![0.0; x.len()];
    ctx.for_rows(&mut out, sp.max(1), |r, row| {
        let ch = r % c;
        let (m, a) = (mul[ch], add[ch]);
        for (o, &v) in row.iter_mut().zip(&x[r * sp..(r + 1) * sp]) {
            *o = v * m + a;
        }
    });
    tensor(op, s, F::data(out))
}

/// Normalises over dims `axis..`, then scales and shifts (scale/bias broadcast to those dims).
pub(crate) fn layer_norm(ctx: &CpuContext, inputs: &[&Tensor], axis: usize, eps: f32) -> Result<Tensor, Error> {
    let eps = eps as F;
    let op = "layernorm";
    let x = floats(op, inputs[0])?;
    let s = inputs[0].shape();
    let norm_shape = &s[axis..];
    let d: usize = norm_shape.iter().product();
    let scale = broadcast_f32(ctx, op, inputs[1], norm_shape)?;
    let bias = match inputs.get(2) {
        Some(b) => Some(broadcast_f32(ctx, op, b, norm_shape)?),
        None => None,
    };
    let mut out = vec![0.0; x.len()];
    ctx.for_rows_weighted(&mut out, d.max(1), 4, |r, row| {
        let v = &x[r * d..(r + 1) * d];
        let mean = v.iter().map(|&a| a as f64).sum::<f64>() / d as f64;
        let var = v.iter().map(|&a| (a as f64 - mean).powi(2)).sum::<f64>() / d as f64;
        let inv = (1.0 / (var + eps as f64).sqrt()) as F;
        let mean = mean as F;
        match &bias {
            Some(b) => {
                for (((o, &a), &g), &bb) in row.iter_mut().zip(v).zip(&scale).zip(b) {
                    *o = (a - mean) * inv * g + bb;
                }
            }
            None => {
                for ((o, &a), &g) in row.iter_mut().zip(v).zip(&scale) {
                    *o = (a - mean) * inv * g;
                }
            }
        }
    });
    tensor(op, s, F::data(out))
}

/// ONNX LRN across channels (dim 1): the window of channel `c` is
/// `[c - floor((size-1)/2), c + ceil((size-1)/2)]`, and
/// `y = x / (bias + alpha / size * sum(x^2 over the window))^beta`.
pub(crate) fn lrn(
    ctx: &CpuContext,
    x: &Tensor,
    size: usize,
    alpha: f32,
    beta: f32,
    bias: f32,
) -> Result<Tensor, Error> {
    let (alpha, beta, bias) = (alpha as F, beta as F, bias as F);
    let op = "lrn";
    let xv = floats(op, x)?;
    let s = x.shape();
    let c = s[1];
    let sp: usize = s[2..].iter().product();
    let (before, after) = ((size - 1) / 2, (size - 1).div_ceil(2));
    let mut out = vec![0.0; xv.len()];
    ctx.for_rows_weighted(&mut out, sp.max(1), size, |r, row| {
        let (n, ch) = (r / c, r % c);
        let lo = ch.saturating_sub(before);
        let hi = (ch + after).min(c - 1);
        let block = &xv[n * c * sp..(n + 1) * c * sp];
        for (i, o) in row.iter_mut().enumerate() {
            let sq: F = (lo..=hi).map(|k| block[k * sp + i] * block[k * sp + i]).sum();
            *o = block[ch * sp + i] / (bias + alpha / size as F * sq).powf(beta);
        }
    });
    tensor(op, s, F::data(out))
}

/// Softmax (or log-softmax) along `axis`, subtracting the max first.
pub(crate) fn softmax(ctx: &CpuContext, x: &Tensor, axis: usize, log: bool) -> Result<Tensor, Error> {
    let op = if log { "log_softmax" } else { "softmax" };
    let xv = floats(op, x)?;
    let s = x.shape();
    // A tensor's shape is representable (ir::shape), so these products fit; checked anyway,
    // with the axis, so a bad call is an error and never a wrapped block size.
    let bad = |message: String| Error::BadInput { op, message };
    let len = *s.get(axis).ok_or_else(|| bad(format!("axis {axis} out of range for {s:?}")))?;
    let block = ir::shape::checked_numel(&s[axis..]).ok_or_else(|| bad(format!("shape {s:?} overflows")))?;
    let inner = block.checked_div(len).unwrap_or(0);
    let mut out = vec![0.0; xv.len()];
    if block == 0 {
        return tensor(op, s, F::data(out));
    }
    ctx.for_rows_weighted(&mut out, block, 4, |r, o| {
        let v = &xv[r * block..(r + 1) * block];
        if inner == 1 {
            with_simd(|| {
                let max = v.iter().fold(F::NEG_INFINITY, |m, &a| m.max(a));
                let max = if max.is_finite() { max } else { 0.0 };
                for (y, &a) in o.iter_mut().zip(v) {
                    *y = exp_fast(a - max);
                }
                let sum = lane_sum(o);
                if log {
                    let ls = sum.ln();
                    for (y, &a) in o.iter_mut().zip(v) {
                        *y = a - max - ls;
                    }
                } else {
                    let inv = 1.0 / sum;
                    o.iter_mut().for_each(|y| *y *= inv);
                }
            })
        } else {
            // Strided axis: work on whole rows of `inner` elements at a time.
            let mut max = vec![F::NEG_INFINITY; inner];
            for row in v.chunks(inner) {
                for (m, &a) in max.iter_mut().zip(row) {
                    *m = m.max(a);
                }
            }
            max.iter_mut().for_each(|m| {
                if !m.is_finite() {
                    *m = 0.0
                }
            });
            let mut sum = vec![0.0; inner];
            for (orow, row) in o.chunks_mut(inner).zip(v.chunks(inner)) {
                for (((y, &a), &m), s) in orow.iter_mut().zip(row).zip(&max).zip(sum.iter_mut()) {
                    *y = exp_fast(a - m);
                    *s += *y;
                }
            }
            if log {
                let ls: Vec<F> = sum.iter().map(|s| s.ln()).collect();
                for (orow, row) in o.chunks_mut(inner).zip(v.chunks(inner)) {
                    for (((y, &a), &m), &l) in orow.iter_mut().zip(row).zip(&max).zip(&ls) {
                        *y = a - m - l;
                    }
                }
            } else {
                let inv: Vec<F> = sum.iter().map(|s| 1.0 / s).collect();
                for orow in o.chunks_mut(inner) {
                    for (y, &i) in orow.iter_mut().zip(&inv) {
                        *y *= i;
                    }
                }
            }
        }
    });
    tensor(op, s, F::data(out))
}

/// Sum of `v` in 8 interleaved partial sums (so the loop vectorises), added pairwise at the end.
#[inline(always)]
pub(crate) fn lane_sum(v: &[F]) -> F {
    let mut acc = [(0 as F); 8];
    let chunks = v.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += x;
        }
    }
    let mut tail = 0.0 as F;
    for &x in rest {
        tail += x;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}
