//! Gradient kernels (the vector-Jacobian products autodiff emits as single ops) and optimizer
//! updates.
//!
//! Each gradient kernel matches its forward kernel's conventions exactly (same window rules,
//! same tie-breaking, same statistics), so that the pair is the derivative of what the forward
//! kernel computes; the finite-difference tests in `tests/tests/autodiff_fd.rs` check that.

use super::elementwise::{exp_fast, with_simd};
use super::linalg::{View, product_f32};
use super::{Accumulation, CpuContext, conv, elementwise::broadcast_f32, floats, strides, tensor};
use super::{F, Float};
use crate::Error;
use ir::{ConvAttrs, PoolAttrs, SliceAxis, Tensor, UnaryOp};

fn bad(op: &'static str, message: String) -> Error {
    Error::BadInput { op, message }
}

/// `dx = dy * f'(x)`; `x` is the forward output for the ops of `ir::unary_grad_from_output`.
pub(crate) fn unary_grad(ctx: &CpuContext, u: UnaryOp, x: &Tensor, dy: &Tensor) -> Result<Tensor, Error> {
    if ir::ops::activation::is_activation(u) {
        return super::activation::unary_grad(ctx, u, x, dy);
    }
    let op = ir::unary_grad_name(u);
    let (xv, dv) = (floats(op, x)?, floats(op, dy)?);
    use super::consts::{FRAC_1_SQRT_2, PI};
    let mut out = vec![0.0; xv.len()];
    let row = 4096.min(xv.len().max(1));
    // A macro rather than a `fn` pointer: each derivative is inlined into its own loop, which
    // then vectorises (with AVX2 where the CPU has it).
    macro_rules! apply {
        ($d:expr) => {{
            let d = $d;
            ctx.for_rows_weighted(&mut out, row, 8, |r, o| {
                let s = r * row;
                with_simd(|| {
                    for ((o, &x), &g) in o.iter_mut().zip(&xv[s..]).zip(&dv[s..]) {
                        *o = g * d(x);
                    }
                })
            })
        }};
    }
    match u {
        UnaryOp::Relu => apply!(|x: F| if x > 0.0 { 1.0 } else { 0.0 }),
        UnaryOp::Gelu => apply!(|x: F| {
            let cdf = 0.5 * Float::erfc(-x * FRAC_1_SQRT_2);
            let pdf = (-0.5 * x * x).exp() / (2.0 * PI).sqrt();
            cdf + x * pdf
        }),
        UnaryOp::GeluTanh => apply!(|x: F| {
            const C: F = F::SQRT_2_OVER_PI;
            let t = super::elementwise::tanh(C * (x + 0.044715 * x * x * x));
            0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * C * (1.0 + 3.0 * 0.044715 * x * x)
        }),
        // These read the forward output y (see `ir::unary_grad_from_output`).
        UnaryOp::Tanh => apply!(|y: F| 1.0 - y * y),
        UnaryOp::Erf => apply!(|x: F| 2.0 / PI.sqrt() * (-x * x).exp()),
        UnaryOp::Sigmoid => apply!(|y: F| y * (1.0 - y)),
        UnaryOp::Exp => apply!(|y: F| y),
        UnaryOp::Log => apply!(|x: F| 1.0 / x),
        UnaryOp::Sqrt => apply!(|y: F| 0.5 / y),
        UnaryOp::Neg => apply!(|_: F| -1.0),
        UnaryOp::Reciprocal => apply!(|y: F| -y * y),
        UnaryOp::Abs => apply!(|x: F| {
            if x > 0.0 {
                1.0
            } else if x < 0.0 {
                -1.0
            } else {
                0.0
            }
        }),
        UnaryOp::Sin => apply!(F::cos),
        UnaryOp::Cos => apply!(|x: F| -x.sin()),
        // Every kind is named (no wildcard): the piecewise-constant kinds have no gradient, and the activations are sent to their own file above.
        UnaryOp::Not
        | UnaryOp::Floor
        | UnaryOp::Ceil
        | UnaryOp::Sign
        | UnaryOp::HardSigmoid { .. }
        | UnaryOp::HardSwish
        | UnaryOp::LeakyRelu { .. }
        | UnaryOp::Elu { .. }
        | UnaryOp::Selu { .. }
        | UnaryOp::Celu { .. }
        | UnaryOp::Softplus
        | UnaryOp::Softsign
        | UnaryOp::Mish
        | UnaryOp::ThresholdedRelu { .. }
        | UnaryOp::Shrink { .. }
        | UnaryOp::Round
        | UnaryOp::IsNaN
        | UnaryOp::IsInf { .. }
        | UnaryOp::Tan
        | UnaryOp::Acos
        | UnaryOp::Asin
        | UnaryOp::Atan
        | UnaryOp::Sinh
        | UnaryOp::Cosh
        | UnaryOp::Asinh
        | UnaryOp::Acosh
        | UnaryOp::Atanh
        | UnaryOp::BitwiseNot => return Err(bad(op, "op has no gradient kernel".into())),
    }
    tensor(op, x.shape(), F::data(out))
}

/// Softmax: `dx = y * (dy - sum(dy * y))`; log-softmax: `dx = dy - exp(y) * sum(dy)`.
pub(crate) fn softmax_grad(ctx: &CpuContext, y: &Tensor, dy: &Tensor, axis: usize, log: bool) -> Result<Tensor, Error> {
    let op = if log { "log_softmax_grad" } else { "softmax_grad" };
    let (yv, dv) = (floats(op, y)?, floats(op, dy)?);
    let s = y.shape();
    let len = s[axis];
    let inner: usize = s[axis + 1..].iter().product();
    let block = len * inner;
    let mut out = vec![0.0; yv.len()];
    if block == 0 {
        return tensor(op, s, F::data(out));
    }
    ctx.for_rows_weighted(&mut out, block, 4, |r, o| {
        let (yb, db) = (&yv[r * block..(r + 1) * block], &dv[r * block..(r + 1) * block]);
        if inner == 1 {
            // Contiguous axis: the f64 sum as below, then a loop that vectorises.
            let sum: f64 = if log {
                super::reduce::lane_sum_f64(db)
            } else {
                db.iter().zip(yb).map(|(&d, &y)| (d * y) as f64).sum()
            };
            let sum = sum as F;
            with_simd(|| {
                for ((o, &y), &d) in o.iter_mut().zip(yb).zip(db) {
                    *o = if log { d - exp_fast(y) * sum } else { y * (d - sum) };
                }
            });
            return;
        }
        for j in 0..inner {
            let at = |i: usize| i * inner + j;
            let sum: f64 = if log {
                (0..len).map(|i| db[at(i)] as f64).sum()
            } else {
                (0..len).map(|i| (db[at(i)] * yb[at(i)]) as f64).sum()
            };
            let sum = sum as F;
            for i in 0..len {
                let k = at(i);
                o[k] = if log { db[k] - exp_fast(yb[k]) * sum } else { yb[k] * (db[k] - sum) };
            }
        }
    });
    tensor(op, s, F::data(out))
}

/// Layer-norm gradient: dx, and dscale/dbias over the normalised shape.
pub(crate) fn layer_norm_grad(
    ctx: &CpuContext,
    inputs: &[&Tensor],
    axis: usize,
    eps: f32,
) -> Result<Vec<Tensor>, Error> {
    let eps = eps as F;
    let op = "layernorm_grad";
    let (x, dy) = (floats(op, inputs[0])?, floats(op, inputs[2])?);
    let s = inputs[0].shape();
    let norm_shape = &s[axis..];
    let d: usize = norm_shape.iter().product();
    let scale = broadcast_f32(ctx, op, inputs[1], norm_shape)?;
    let rows = x.len().checked_div(d).unwrap_or(0);
    // Per-row mean and 1/std, as the forward kernel computes them.
    let mut stats = vec![0.0; 2 * rows];
    ctx.for_rows_weighted(&mut stats, 2, 2 * d, |r, st| {
        let v = &x[r * d..(r + 1) * d];
        let mean = v.iter().map(|&a| a as f64).sum::<f64>() / d as f64;
        let var = v.iter().map(|&a| (a as f64 - mean).powi(2)).sum::<f64>() / d as f64;
        st[0] = mean as F;
        st[1] = (1.0 / (var + eps as f64).sqrt()) as F;
    });
    let mut dx = vec![0.0; x.len()];
    ctx.for_rows_weighted(&mut dx, d.max(1), 6, |r, o| {
        let (mean, inv) = (stats[2 * r], stats[2 * r + 1]);
        let v = &x[r * d..(r + 1) * d];
        let g = &dy[r * d..(r + 1) * d];
        let (mut sg, mut sgx) = (0f64, 0f64);
        for ((&a, &gg), &sc) in v.iter().zip(g).zip(&scale) {
            let gs = (gg * sc) as f64;
            sg += gs;
            sgx += gs * ((a - mean) * inv) as f64;
        }
        let (mg, mgx) = ((sg / d as f64) as F, (sgx / d as f64) as F);
        for (((o, &a), &gg), &sc) in o.iter_mut().zip(v).zip(g).zip(&scale) {
            let xhat = (a - mean) * inv;
            *o = inv * (gg * sc - mg - xhat * mgx);
        }
    });
    let mut dscale = vec![0.0; d];
    let mut dbias = vec![0.0; d];
    for r in 0..rows {
        let (mean, inv) = (stats[2 * r], stats[2 * r + 1]);
        let v = &x[r * d..(r + 1) * d];
        let g = &dy[r * d..(r + 1) * d];
        for (((ds, db), &a), &gg) in dscale.iter_mut().zip(dbias.iter_mut()).zip(v).zip(g) {
            *ds += gg * (a - mean) * inv;
            *db += gg;
        }
    }
    Ok(vec![
        tensor(op, s, F::data(dx))?,
        tensor(op, norm_shape, F::data(dscale))?,
        tensor(op, norm_shape, F::data(dbias))?,
    ])
}

/// LRN gradient (same window as the forward kernel):
/// `dx_k = dy_k s_k^-beta - 2 alpha beta / size * x_k * sum_{i: k in W(i)} dy_i x_i s_i^(-beta-1)`.
pub(crate) fn lrn_grad(
    ctx: &CpuContext,
    x: &Tensor,
    dy: &Tensor,
    size: usize,
    alpha: f32,
    beta: f32,
    bias: f32,
) -> Result<Tensor, Error> {
    let (alpha, beta, bias) = (alpha as F, beta as F, bias as F);
    let op = "lrn_grad";
    let (xv, dv) = (floats(op, x)?, floats(op, dy)?);
    let s = x.shape();
    let c = s[1];
    let sp: usize = s[2..].iter().product();
    let (before, after) = ((size - 1) / 2, (size - 1).div_ceil(2));
    let mut out = vec![0.0; xv.len()];
    let img = (c * sp).max(1);
    ctx.for_rows_weighted(&mut out, img, 2 * size, |n, o| {
        let xb = &xv[n * c * sp..(n + 1) * c * sp];
        let db = &dv[n * c * sp..(n + 1) * c * sp];
        let mut sum = vec![0.0; c];
        let mut t = vec![0.0; c];
        for i in 0..sp {
            for (ch, sv) in sum.iter_mut().enumerate() {
                let (lo, hi) = (ch.saturating_sub(before), (ch + after).min(c - 1));
                let sq: F = (lo..=hi).map(|k| xb[k * sp + i] * xb[k * sp + i]).sum();
                *sv = bias + alpha / size as F * sq;
            }
            for ch in 0..c {
                t[ch] = db[ch * sp + i] * xb[ch * sp + i] * sum[ch].powf(-beta - 1.0);
            }
            for k in 0..c {
                // Channels i whose window contains k: i in [k - after, k + before].
                let (lo, hi) = (k.saturating_sub(after), (k + before).min(c - 1));
                let acc: F = t[lo..=hi].iter().sum();
                o[k * sp + i] =
                    db[k * sp + i] * sum[k].powf(-beta) - 2.0 * alpha * beta / size as F * xb[k * sp + i] * acc;
            }
        }
    });
    tensor(op, s, F::data(out))
}

/// Adds the columns `col` (`[cg*kh*kw, oh*ow]`) back into the image `dx` (`[cg, h, w]`): the
/// adjoint of im2col.
#[allow(clippy::too_many_arguments)]
fn col2im(
    ctx: Option<&CpuContext>,
    col: &[F],
    h: usize,
    w: usize,
    kh: usize,
    kw: usize,
    a: &ConvAttrs,
    oh: usize,
    ow: usize,
    dx: &mut [F],
) {
    let p = oh * ow;
    if p == 0 || kh * kw == 0 {
        return;
    }
    let taps = conv::taps(h, w, kh, kw, a, oh, ow);
    // Each tap adds its row back over the output rows and columns whose input lies inside the
    // image (`Tap`'s ranges), in the order of the per-element bounds test it replaces.
    let plane_fn = |c: usize, plane: &mut [F]| {
        for (t, tap) in taps.iter().enumerate() {
            let row = &col[(c * taps.len() + t) * p..(c * taps.len() + t + 1) * p];
            let ((ylo, yhi), (xlo, xhi)) = (tap.rows, tap.cols);
            if xlo == xhi {
                continue;
            }
            let x0 = ((xlo * a.strides[1]) as isize + tap.offx) as usize;
            for oy in ylo..yhi {
                let iy = ((oy * a.strides[0]) as isize + tap.offy) as usize;
                let dst = &mut plane[iy * w + x0..(iy + 1) * w];
                let src = &row[oy * ow + xlo..oy * ow + xhi];
                for (o, &v) in dst.iter_mut().step_by(a.strides[1]).zip(src) {
                    *o += v;
                }
            }
        }
    };
    match ctx {
        Some(ctx) => ctx.for_rows_weighted(dx, (h * w).max(1), kh * kw, plane_fn),
        None => dx.chunks_mut((h * w).max(1)).enumerate().for_each(|(c, pl)| plane_fn(c, pl)),
    }
}

/// Convolution gradient with respect to its input: `W^T @ dy` per group, then col2im.
pub(crate) fn conv_input_grad(
    ctx: &CpuContext,
    a: &ConvAttrs,
    dy: &Tensor,
    w: &Tensor,
    shape: &[usize],
) -> Result<Tensor, Error> {
    let op = "conv_input_grad";
    let (dv, wv) = (floats(op, dy)?, floats(op, w)?);
    let (n, c, h, wd) = (shape[0], shape[1], shape[2], shape[3]);
    let ws = w.shape();
    let (m, cg, kh, kw) = (ws[0], ws[1], ws[2], ws[3]);
    let (oh, ow) = (dy.shape()[2], dy.shape()[3]);
    let g = a.group;
    let mg = m / g;
    let kk = cg * kh * kw;
    let p = oh * ow;
    let plane = h * wd;
    let mut dx = vec![0.0; n * c * plane];
    if dx.is_empty() || p == 0 {
        return tensor(op, shape, F::data(dx));
    }
    if cg == 1 && conv::is_depthwise(ctx, a, c, m) {
        let d = conv::Depthwise { n, c, h, w: wd, kh, kw, oh, ow };
        conv::depthwise_input_grad(ctx, a, d, dv, wv, &mut dx);
        return tensor(op, shape, F::data(dx));
    }
    let direct = conv::is_direct(a, kh, kw);
    if !direct
        && cg >= mg
        && let Some(full) = as_forward(a, kh, kw)
    {
        // With stride 1, dx is the forward convolution of dy (padded by dilation * (k - 1) less
        // the forward pads) with the kernel flipped and its channel axes swapped per group: a
        // deep product (depth mg * kh * kw) instead of a depth-mg one whose kh * kw times larger
        // result is scattered back (that took 1.2-4.5x the forward convolution's time; BENCHMARKS.md).
        // Not when the convolution widens its channels (cg < mg): there the product has only cg
        // rows against the im2col of the wider dy, and the scatter measured faster (8 to 64
        // channels, 3x3 at 32x32: 141 against 287 us).
        let mut flipped = vec![0.0; wv.len()];
        let taps = kh * kw;
        // In blocks of 16 output channels, so that each input channel's writes are one run of
        // 16 kernels: one channel at a time wrote a kernel every mg * kh * kw elements, 2-3 ms
        // for the 512-channel 3x3 kernels of resnet18 (as long as the convolution itself).
        for gi in 0..g {
            for m0 in (0..mg).step_by(16) {
                for ci in 0..cg {
                    for mi in m0..(m0 + 16).min(mg) {
                        let from = ((gi * mg + mi) * cg + ci) * taps;
                        let to = ((gi * cg + ci) * mg + mi) * taps;
                        for (o, &v) in flipped[to..to + taps].iter_mut().zip(wv[from..from + taps].iter().rev()) {
                            *o = v;
                        }
                    }
                }
            }
        }
        let flipped = tensor(op, &[c, mg, kh, kw], F::data(flipped))?;
        return conv::conv(ctx, &full, &[dy, &flipped], shape);
    }
    let run = |t: usize, dxg: &mut [F], col: &mut Vec<F>, inner: Option<&CpuContext>| -> Result<(), Error> {
        let (ni, gi) = (t / g, t % g);
        let dyg = &dv[(ni * m + gi * mg) * p..(ni * m + (gi + 1) * mg) * p];
        let wg = &wv[gi * mg * kk..(gi + 1) * mg * kk];
        if direct {
            // dx [cg, p] = W^T [cg, mg] @ dy [mg, p]
            return super::linalg::gemm_with(inner, ctx.accumulation(), kk, p, mg, wg, true, dyg, false, dxg, 1.0, 0.0);
        }
        col.resize(kk * p, 0.0);
        super::linalg::gemm_with(inner, ctx.accumulation(), kk, p, mg, wg, true, dyg, false, col, 1.0, 0.0)?;
        col2im(inner, col, h, wd, kh, kw, a, oh, ow, dxg);
        Ok(())
    };
    conv::per_group(ctx, &mut dx, cg * plane, mg * kk * p, run)?;
    tensor(op, shape, F::data(dx))
}

/// The attributes of the forward convolution that computes the input gradient of a stride-1
/// convolution `a` with a `kh x kw` kernel: pads of `dilation * (k - 1)` less the forward ones
/// (`None` when a forward pad is larger, or a stride is not 1).
fn as_forward(a: &ConvAttrs, kh: usize, kw: usize) -> Option<ConvAttrs> {
    if a.strides != [1, 1] || kh == 0 || kw == 0 {
        return None;
    }
    let reach = [a.dilations[0] * (kh - 1), a.dilations[1] * (kw - 1)];
    let pad = |i: usize| reach[i % 2].checked_sub(a.pads[i]);
    Some(ConvAttrs { pads: [pad(0)?, pad(1)?, pad(2)?, pad(3)?], ..a.clone() })
}

/// Convolution gradient with respect to its weight: `sum_n dy_n @ im2col(x_n)^T` per group.
pub(crate) fn conv_weight_grad(
    ctx: &CpuContext,
    a: &ConvAttrs,
    x: &Tensor,
    dy: &Tensor,
    shape: &[usize],
) -> Result<Tensor, Error> {
    let op = "conv_weight_grad";
    let (xv, dv) = (floats(op, x)?, floats(op, dy)?);
    let xs = x.shape();
    let (n, c, h, wd) = (xs[0], xs[1], xs[2], xs[3]);
    let (m, cg, kh, kw) = (shape[0], shape[1], shape[2], shape[3]);
    let (oh, ow) = (dy.shape()[2], dy.shape()[3]);
    let g = a.group;
    let mg = m / g;
    let kk = cg * kh * kw;
    let p = oh * ow;
    let plane = h * wd;
    let mut dw = vec![0.0; m * kk];
    if dw.is_empty() || p == 0 {
        return tensor(op, shape, F::data(dw));
    }
    if cg == 1 && conv::is_depthwise(ctx, a, c, m) {
        let d = conv::Depthwise { n, c, h, w: wd, kh, kw, oh, ow };
        conv::depthwise_weight_grad(ctx, a, d, xv, dv, &mut dw);
        return tensor(op, shape, F::data(dw));
    }
    let direct = conv::is_direct(a, kh, kw);
    let threads = ctx.threads();
    let f32_sums = ctx.accumulation() == Accumulation::F32;
    let taps = conv::taps(h, wd, kh, kw, a, oh, ow);
    // Deep blocks: each block's product is stored into dW once (the tiled products of few
    // channels store their results element by element).
    let block = conv::block_rows(kk, oh, ow, 1024);
    let dw_addr = dw.as_mut_ptr() as usize;
    // dW[group rows, lo..hi] (+)= dy [mg, output rows oy0..oy1] @ their patches^T, the patches
    // of im2col rows lo..hi built in `col` first (or read from `x` for 1x1 convolutions).
    let add_block =
        |par, gi: usize, ni: usize, (lo, hi): (usize, usize), (oy0, oy1): (usize, usize), col: &mut Vec<F>| {
            let xin = &xv[(ni * c + gi * cg) * plane..(ni * c + (gi + 1) * cg) * plane];
            let dyg = &dv[(ni * m + gi * mg) * p..(ni * m + (gi + 1) * mg) * p];
            let cols = (oy1 - oy0) * ow;
            let rows: View = if direct {
                View { ptr: xin[lo * p + oy0 * ow..].as_ptr(), rs: 1, cs: p as isize }
            } else {
                col.resize((hi - lo) * cols, 0.0);
                conv::im2col_block(xin, (h, wd), &taps, a, ow, (oy0, oy1), lo, col);
                View { ptr: col.as_ptr(), rs: 1, cs: cols as isize }
            };
            let dyv = View { ptr: dyg[oy0 * ow..].as_ptr(), rs: p as isize, cs: 1 };
            let beta = if ni == 0 && oy0 == 0 { 0.0 } else { 1.0 };
            let out = (dw_addr as *mut F).wrapping_add(gi * mg * kk + lo);
            // SAFETY: `out` with row stride kk covers rows gi*mg..(gi+1)*mg, columns lo..hi of dW,
            // which only this caller writes; the views cover dy's block (mg x cols) and the
            // patches' (cols x (hi - lo)).
            unsafe { product_f32(par, mg, hi - lo, cols, dyv, rows, out, kk, 1.0, beta) };
        };
    if threads > 1 && f32_sums && kk >= 2 * 16 {
        // Each thread owns a block of dW's columns (rows of im2col): it builds only those rows,
        // image after image, and accumulates its block; no reduction and no shared buffer.
        let per = kk.div_ceil(threads);
        ctx.run(kk.div_ceil(per), |t| {
            let (lo, hi) = (t * per, ((t + 1) * per).min(kk));
            let mut col = Vec::new();
            let block = conv::block_rows(hi - lo, oh, ow, 1024);
            for gi in 0..g {
                for ni in 0..n {
                    for oy0 in (0..oh).step_by(block) {
                        add_block(None, gi, ni, (lo, hi), (oy0, (oy0 + block).min(oh)), &mut col);
                    }
                }
            }
        });
        return tensor(op, shape, F::data(dw));
    }
    let mut col = Vec::new();
    if f32_sums {
        for gi in 0..g {
            for ni in 0..n {
                for oy0 in (0..oh).step_by(block) {
                    add_block(Some(ctx), gi, ni, (0, kk), (oy0, (oy0 + block).min(oh)), &mut col);
                }
            }
        }
        return tensor(op, shape, F::data(dw));
    }
    for gi in 0..g {
        let dwg = &mut dw[gi * mg * kk..(gi + 1) * mg * kk];
        for ni in 0..n {
            let xin = &xv[(ni * c + gi * cg) * plane..(ni * c + (gi + 1) * cg) * plane];
            let dyg = &dv[(ni * m + gi * mg) * p..(ni * m + (gi + 1) * mg) * p];
            let colv: &[F] = if direct {
                xin
            } else {
                col.resize(kk * p, 0.0);
                conv::im2col(Some(ctx), xin, h, wd, kh, kw, a, oh, ow, &mut col);
                &col
            };
            let beta = if ni == 0 { 0.0 } else { 1.0 };
            // dW [mg, kk] += dy [mg, p] @ col^T [p, kk]
            super::linalg::gemm_with(Some(ctx), ctx.accumulation(), mg, kk, p, dyg, false, colv, true, dwg, 1.0, beta)?;
        }
    }
    tensor(op, shape, F::data(dw))
}

/// Max-pool gradient: each window's dy goes to the cell the forward kernel picked
/// ([`conv::window_argmax`]).
pub(crate) fn max_pool_grad(ctx: &CpuContext, a: &PoolAttrs, x: &Tensor, dy: &Tensor) -> Result<Tensor, Error> {
    let op = "maxpool_grad";
    let (xv, dv) = (floats(op, x)?, floats(op, dy)?);
    let (h, w) = (x.shape()[2], x.shape()[3]);
    let (oh, ow) = (dy.shape()[2], dy.shape()[3]);
    let mut dx = vec![0.0; xv.len()];
    let xr = conv::column_ranges(a, w, ow);
    ctx.for_rows_weighted(&mut dx, (h * w).max(1), a.kernel[0] * a.kernel[1], |r, plane_dx| {
        let plane = &xv[r * h * w..(r + 1) * h * w];
        let d = &dv[r * oh * ow..(r + 1) * oh * ow];
        conv::plane_argmax(a, plane, h, w, oh, ow, &xr, |o, k| {
            if let Some(k) = k {
                plane_dx[k] += d[o];
            }
        });
    });
    tensor(op, x.shape(), F::data(dx))
}

/// Average-pool gradient: each window's dy is spread over its cells with the forward divisor.
pub(crate) fn avg_pool_grad(ctx: &CpuContext, a: &PoolAttrs, dy: &Tensor, shape: &[usize]) -> Result<Tensor, Error> {
    let op = "avgpool_grad";
    let dv = floats(op, dy)?;
    let (h, w) = (shape[2], shape[3]);
    let (oh, ow) = (dy.shape()[2], dy.shape()[3]);
    let mut dx = vec![0.0; shape.iter().product()];
    ctx.for_rows_weighted(&mut dx, (h * w).max(1), a.kernel[0] * a.kernel[1], |r, plane_dx| {
        let d = &dv[r * oh * ow..(r + 1) * oh * ow];
        for oy in 0..oh {
            for ox in 0..ow {
                let cnt = conv::avg_divisor(a, h, w, oy, ox);
                if cnt > 0 {
                    let share = d[oy * ow + ox] / cnt as F;
                    conv::window_cells(a, h, w, oy, ox, |k| plane_dx[k] += share);
                }
            }
        }
    });
    tensor(op, shape, F::data(dx))
}

/// Gather gradient: scatter-adds dy rows into zeros of the data's shape.
pub(crate) fn gather_grad(idx: &Tensor, dy: &Tensor, axis: usize, shape: &[usize]) -> Result<Tensor, Error> {
    let op = "gather_grad";
    let iv = idx.as_i64().ok_or_else(|| bad(op, format!("indices must be i64, got {}", idx.dtype())))?;
    let dv = floats(op, dy)?;
    let pre: usize = shape[..axis].iter().product();
    let dim = shape[axis];
    let post: usize = shape[axis + 1..].iter().product();
    let ni = iv.len();
    let mut out = vec![0.0; shape.iter().product()];
    for p in 0..pre {
        for (i, &ix) in iv.iter().enumerate() {
            let j = if ix < 0 { ix + dim as i64 } else { ix };
            if j < 0 || j >= dim as i64 {
                return Err(bad(op, format!("index {ix} out of range for axis of size {dim}")));
            }
            let dst = &mut out[(p * dim + j as usize) * post..(p * dim + j as usize + 1) * post];
            let src = &dv[(p * ni + i) * post..(p * ni + i + 1) * post];
            for (o, &s) in dst.iter_mut().zip(src) {
                *o += s;
            }
        }
    }
    tensor(op, shape, F::data(out))
}

/// Slice gradient: dy written back at the sliced positions of zeros of `shape`.
pub(crate) fn slice_grad(dy: &Tensor, axes: &[SliceAxis], shape: &[usize]) -> Result<Tensor, Error> {
    let op = "slice_grad";
    let dv = floats(op, dy)?;
    let ds = dy.shape();
    let st = strides(shape);
    let r = shape.len();
    let mut start = vec![0i64; r];
    let mut step = vec![1i64; r];
    for a in axes {
        start[a.axis] = a.start;
        step[a.axis] = a.step;
    }
    let mut out = vec![0.0; shape.iter().product()];
    let mut idx = vec![0usize; r];
    for &v in dv {
        let off: i64 = (0..r).map(|d| (start[d] + idx[d] as i64 * step[d]) * st[d] as i64).sum();
        out[off as usize] += v;
        for d in (0..r).rev() {
            idx[d] += 1;
            if idx[d] < ds[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    tensor(op, shape, F::data(out))
}

/// One SGD step; returns p' and, with momentum, the new buffer.
pub(crate) fn sgd_update(
    ctx: &CpuContext,
    inputs: &[&Tensor],
    lr: f32,
    momentum: f32,
    weight_decay: f32,
) -> Result<Vec<Tensor>, Error> {
    let op = "sgd_update";
    let lr = lr as F * lr_factor(op, inputs.get(if momentum != 0.0 { 3 } else { 2 }))?;
    let (momentum, weight_decay) = (momentum as F, weight_decay as F);
    let (p, g) = (floats(op, inputs[0])?, floats(op, inputs[1])?);
    let shape = inputs[0].shape();
    if momentum != 0.0 {
        let buf = floats(op, inputs[2])?;
        let mut np = vec![0.0; p.len()];
        let mut nb = vec![0.0; p.len()];
        for i in 0..p.len() {
            let d = g[i] + weight_decay * p[i];
            nb[i] = momentum * buf[i] + d;
            np[i] = p[i] - lr * nb[i];
        }
        return Ok(vec![tensor(op, shape, F::data(np))?, tensor(op, shape, F::data(nb))?]);
    }
    let np = ctx.zip_map(p, g, |pp, gg| pp - lr * (gg + weight_decay * pp));
    Ok(vec![tensor(op, shape, F::data(np))?])
}

/// The optional trailing lr factor of an update (a schedule's value; 1 without one).
fn lr_factor(op: &'static str, t: Option<&&Tensor>) -> Result<F, Error> {
    match t {
        None => Ok(1.0),
        Some(t) => floats(op, t)?.first().copied().ok_or_else(|| bad(op, "the lr factor is empty".into())),
    }
}

/// One AdamW step at step number `t` (PyTorch's arithmetic: bias corrections in f64, applied
/// as scalars of the element type).
#[allow(clippy::too_many_arguments)]
pub(crate) fn adamw_update(
    inputs: &[&Tensor],
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
) -> Result<Vec<Tensor>, Error> {
    let op = "adamw_update";
    let lr = lr as F * lr_factor(op, inputs.get(5))?;
    let (beta1, beta2, eps, weight_decay) = (beta1 as F, beta2 as F, eps as F, weight_decay as F);
    let (p, g, m, v) = (floats(op, inputs[0])?, floats(op, inputs[1])?, floats(op, inputs[2])?, floats(op, inputs[3])?);
    let t = inputs[4].as_i64().and_then(|s| s.first().copied()).ok_or_else(|| bad(op, "step must be i64".into()))?;
    let k = crate::optim::AdamW::at(lr as f64, beta1 as f64, beta2 as f64, weight_decay as f64, t)
        .map_err(|m| bad(op, m))?;
    let (decay, step_size, bc2_sqrt) = (k.decay as F, k.step_size as F, k.bc2_sqrt as F);
    let (w1, w2) = (k.w1 as F, k.w2 as F);
    let n = p.len();
    let (mut np, mut nm, mut nv) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
    for i in 0..n {
        let pp = p[i] * decay;
        let mi = m[i] + w1 * (g[i] - m[i]);
        let vi = v[i] * beta2 + w2 * g[i] * g[i];
        let denom = vi.sqrt() / bc2_sqrt + eps;
        np[i] = pp - step_size * (mi / denom);
        nm[i] = mi;
        nv[i] = vi;
    }
    let shape = inputs[0].shape();
    Ok(vec![tensor(op, shape, F::data(np))?, tensor(op, shape, F::data(nm))?, tensor(op, shape, F::data(nv))?])
}
