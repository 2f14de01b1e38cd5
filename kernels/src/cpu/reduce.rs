//! Reductions over a set of axes (floats for every kind; i64 for Sum, Prod, Max, Min).
//!
//! The reduced axes are brought into one contiguous run (by a transpose when they are not
//! adjacent), so every reduction is `[outer, red, inner] -> [outer, inner]`. Float sums accumulate
//! in f64.

use super::{CpuContext, elementwise::with_simd, shape::transpose, tensor};
use super::{F, Float};
use crate::Error;
use ir::{Data, ReduceOp, Tensor};

fn nan_max(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() { f64::NAN } else { a.max(b) }
}

fn nan_min(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() { f64::NAN } else { a.min(b) }
}

/// Initial value, per-element map and combine of a kind (LogSumExp is handled separately).
/// Initial accumulator, per-element map, combine.
type Parts = (f64, fn(f64) -> f64, fn(f64, f64) -> f64);

fn parts(op: ReduceOp) -> Parts {
    use ReduceOp::*;
    let id: fn(f64) -> f64 = |x| x;
    let add: fn(f64, f64) -> f64 = |a, b| a + b;
    match op {
        Sum | Mean | LogSum | LogSumExp => (0.0, id, add),
        Max => (f64::NEG_INFINITY, id, nan_max),
        Min => (f64::INFINITY, id, nan_min),
        Prod => (1.0, id, |a, b| a * b),
        SumSquare | L2 => (0.0, |x| x * x, add),
        L1 => (0.0, f64::abs, add),
    }
}

fn finish(op: ReduceOp, acc: f64, red: usize) -> f64 {
    match op {
        ReduceOp::Mean => acc / red as f64,
        ReduceOp::L2 => acc.sqrt(),
        ReduceOp::LogSum => acc.ln(),
        _ => acc,
    }
}

fn reduce_f32(ctx: &CpuContext, op: ReduceOp, x: &[F], outer: usize, red: usize, inner: usize) -> Vec<F> {
    let mut out = vec![0.0; outer * inner];
    if out.is_empty() {
        return out;
    }
    let (init, map, comb) = parts(op);
    if inner == 1 {
        // Each output reduces one contiguous run (a reduction over the trailing axes, e.g.
        // the gradient of a squeeze-excitation scale summing NCHW over H, W): no per-output
        // accumulators to allocate, which cost more than a short run's adds.
        ctx.for_rows_weighted(&mut out, 1, red.max(1), |o, row| {
            let block = &x[o * red..(o + 1) * red];
            row[0] = match op {
                ReduceOp::Sum | ReduceOp::Mean => finish(op, lane_sum_f64(block), red) as F,
                ReduceOp::LogSumExp => {
                    let m = block.iter().fold(f64::NEG_INFINITY, |m, &v| nan_max(m, v as f64));
                    let m = if m.is_infinite() { 0.0 } else { m };
                    (m + block.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln()) as F
                }
                _ => finish(op, block.iter().fold(init, |a, &v| comb(a, map(v as f64))), red) as F,
            };
        });
        return out;
    }
    ctx.for_rows_weighted(&mut out, inner, red.max(1), |o, row| {
        let block = &x[o * red * inner..(o + 1) * red * inner];
        let mut shift = vec![0f64; inner];
        if op == ReduceOp::LogSumExp {
            shift.fill(f64::NEG_INFINITY);
            for k in 0..red {
                for (m, &v) in shift.iter_mut().zip(&block[k * inner..(k + 1) * inner]) {
                    *m = nan_max(*m, v as f64);
                }
            }
            shift.iter_mut().for_each(|m| {
                if m.is_infinite() {
                    *m = 0.0
                }
            });
        }
        let mut acc = vec![init; inner];
        for k in 0..red {
            let src = &block[k * inner..(k + 1) * inner];
            if matches!(op, ReduceOp::Sum | ReduceOp::Mean) {
                // The common case without the `fn` pointers, so it vectorises.
                for (a, &v) in acc.iter_mut().zip(src) {
                    *a += v as f64;
                }
            } else if op == ReduceOp::LogSumExp {
                for ((a, &v), &m) in acc.iter_mut().zip(src).zip(&shift) {
                    *a += (v as f64 - m).exp();
                }
            } else {
                for (a, &v) in acc.iter_mut().zip(src) {
                    *a = comb(*a, map(v as f64));
                }
            }
        }
        for ((y, &a), &m) in row.iter_mut().zip(&acc).zip(&shift) {
            *y = if op == ReduceOp::LogSumExp { (m + a.ln()) as F } else { finish(op, a, red) as F };
        }
    });
    out
}

fn reduce_i64(op: ReduceOp, x: &[i64], outer: usize, red: usize, inner: usize) -> Result<Vec<i64>, Error> {
    let (init, comb): (i64, fn(i64, i64) -> i64) = match op {
        ReduceOp::Sum => (0, i64::wrapping_add),
        ReduceOp::Prod => (1, i64::wrapping_mul),
        ReduceOp::Max => (i64::MIN, i64::max),
        ReduceOp::Min => (i64::MAX, i64::min),
        _ => {
            return Err(Error::BadInput { op: ir::reduce_name(op), message: "this reduction takes F input".into() });
        }
    };
    let mut out = vec![init; outer * inner];
    for o in 0..outer {
        for k in 0..red {
            let src = &x[(o * red + k) * inner..(o * red + k + 1) * inner];
            for (a, &v) in out[o * inner..(o + 1) * inner].iter_mut().zip(src) {
                *a = comb(*a, v);
            }
        }
    }
    Ok(out)
}

/// Reduces `axes` (sorted, unique) of `x`.
pub(crate) fn reduce(
    ctx: &CpuContext,
    op: ReduceOp,
    x: &Tensor,
    axes: &[usize],
    keepdims: bool,
) -> Result<Tensor, Error> {
    let name = ir::reduce_name(op);
    let s = x.shape();
    let out_shape = ir::reduced_shape(s, axes, keepdims);
    let contiguous = axes.windows(2).all(|w| w[1] == w[0] + 1);
    // Kept dims forming one contiguous block between reduced ones (`[A, K, B] -> [K]`, e.g. a
    // conv bias gradient summing NCHW over N, H, W): sum without transposing.
    let kept: Vec<usize> = (0..s.len()).filter(|d| !axes.contains(d)).collect();
    if !contiguous
        && matches!(op, ReduceOp::Sum | ReduceOp::Mean)
        && !kept.is_empty()
        && kept.windows(2).all(|w| w[1] == w[0] + 1)
        && let Some(v) = F::view(x)
    {
        let (k0, k1) = (kept[0], kept[kept.len() - 1]);
        let a: usize = s[..k0].iter().product();
        let k: usize = s[k0..=k1].iter().product();
        let b: usize = s[k1 + 1..].iter().product();
        let mut out = vec![0.0; k];
        let count = (a * b).max(1) as f64;
        ctx.for_rows_weighted(&mut out, 1, a * b, |j, o| {
            let mut acc = 0f64;
            for ai in 0..a {
                acc += lane_sum_f64(&v[(ai * k + j) * b..(ai * k + j + 1) * b]);
            }
            o[0] = if op == ReduceOp::Mean { (acc / count) as F } else { acc as F };
        });
        return tensor(name, &out_shape, F::data(out));
    }
    let crate::geometry::ReduceLayout { perm, outer, red, inner } = crate::geometry::reduce_layout(s, axes);
    let moved;
    let src = match perm {
        None => x,
        Some(perm) => {
            moved = transpose(ctx, x, &perm)?;
            &moved
        }
    };
    if let Some(v) = F::view(src) {
        return tensor(name, &out_shape, F::data(reduce_f32(ctx, op, v, outer, red, inner)));
    }
    let data = match src.data() {
        d @ (Data::F32(_) | Data::F64(_) | Data::BF16(_) | Data::F16(_)) => {
            return Err(super::wrong_float(name, d.dtype()));
        }
        Data::I64(v) => Data::I64(reduce_i64(op, v, outer, red, inner)?),
        Data::Bool(v) => {
            // On bool, max is `any` and min is `all` (ONNX opset 20).
            let (init, comb): (bool, fn(bool, bool) -> bool) = match op {
                ReduceOp::Max => (false, |a, b| a || b),
                ReduceOp::Min => (true, |a, b| a && b),
                _ => {
                    return Err(Error::BadInput { op: name, message: "input must be numeric".into() });
                }
            };
            let mut out = vec![init; outer * inner];
            for o in 0..outer {
                for k in 0..red {
                    let src = &v[(o * red + k) * inner..(o * red + k + 1) * inner];
                    for (a, &b) in out[o * inner..(o + 1) * inner].iter_mut().zip(src) {
                        *a = comb(*a, b);
                    }
                }
            }
            Data::Bool(out)
        }
    };
    tensor(name, &out_shape, data)
}

/// Sum of `v` in f64, in 8 interleaved partial sums so that the loop vectorises (a single running
/// f64 sum waits on each add's latency).
pub(crate) fn lane_sum_f64(v: &[F]) -> f64 {
    with_simd(|| {
        let mut acc = [0f64; 8];
        let chunks = v.chunks_exact(8);
        let rest = chunks.remainder();
        for c in chunks {
            for (a, &x) in acc.iter_mut().zip(c) {
                *a += x as f64;
            }
        }
        let tail: f64 = rest.iter().map(|&x| x as f64).sum();
        ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
    })
}
