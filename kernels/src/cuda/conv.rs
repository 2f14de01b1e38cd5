//! 2-D convolution (im2col + cuBLAS strided-batched SGEMM over groups, one image at a time;
//! 1x1 stride-1 unpadded convolutions skip im2col), its input and weight gradients, and max /
//! average pooling with their gradients, NCHW.
//!
//! Gradients that scatter on the CPU (col2im, pooling gradients) gather here: each input cell
//! sums the contributions of the windows that cover it, in the CPU's order, so results are
//! deterministic and need no atomics. Pooling uses the CPU's window rules: padding cells never
//! win a max, the first maximal cell (a NaN wins) takes the gradient, and the average divisor
//! counts in-image cells (or, with `count_include_pad`, cells inside the padded input).

use super::device::{CudaContext, Family, grid};
use super::linalg::{Product, sgemm};
use super::tensor::CudaTensor;
use crate::Error;
use cudarc::driver::DeviceRepr;
use ir::{ConvAttrs, PoolAttrs, TensorMeta};

pub(crate) const SRC: &str = r#"
struct Geom {
    i64 planes, h, w, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw, peh, pew, include_pad;
};

// col[(c, i, j), (oy, ox)] = x[c, oy*sh - ph + i*dh, ox*sw - pw + j*dw] (0 outside), c < planes.
extern "C" __global__ void im2col(float* col, const float* x, Geom g) {
    i64 p = g.oh * g.ow;
    FOR_EACH(i, g.planes * g.kh * g.kw * p) {
        i64 q = i % p, r = i / p;
        i64 j = r % g.kw, ii = (r / g.kw) % g.kh, c = r / (g.kw * g.kh);
        i64 oy = q / g.ow, ox = q % g.ow;
        i64 iy = oy * g.sh - g.ph + ii * g.dh, ix = ox * g.sw - g.pw + j * g.dw;
        col[i] = (iy >= 0 && iy < g.h && ix >= 0 && ix < g.w) ? x[(c * g.h + iy) * g.w + ix] : 0.f;
    }
}

// The adjoint of im2col, gathering: dx[c, y, x] = sum of the col entries that read it.
extern "C" __global__ void col2im(float* dx, const float* col, Geom g) {
    i64 p = g.oh * g.ow;
    FOR_EACH(i, g.planes * g.h * g.w) {
        i64 ix = i % g.w, iy = (i / g.w) % g.h, c = i / (g.w * g.h);
        float acc = 0.f;
        for (i64 ii = 0; ii < g.kh; ++ii) {
            i64 ty = iy + g.ph - ii * g.dh;
            if (ty < 0 || ty % g.sh != 0 || ty / g.sh >= g.oh) continue;
            i64 oy = ty / g.sh;
            for (i64 j = 0; j < g.kw; ++j) {
                i64 tx = ix + g.pw - j * g.dw;
                if (tx < 0 || tx % g.sw != 0 || tx / g.sw >= g.ow) continue;
                acc += col[((c * g.kh + ii) * g.kw + j) * p + oy * g.ow + tx / g.sw];
            }
        }
        dx[i] = acc;
    }
}

// out[i] = bias[(i / p) % m].
extern "C" __global__ void bias_fill(float* out, const float* bias, i64 n, i64 m, i64 p) {
    FOR_EACH(i, n) { out[i] = bias[(i / p) % m]; }
}

// First maximal in-image cell of window (oy, ox), NaN winning; -1 when the window is all padding.
__device__ i64 window_argmax(const float* plane, const Geom& g, i64 oy, i64 ox) {
    float best = -F_INF;
    i64 at = -1;
    i64 y0 = oy * g.sh - g.ph, x0 = ox * g.sw - g.pw;
    for (i64 i = 0; i < g.kh; ++i) {
        i64 y = y0 + i * g.dh;
        if (y < 0 || y >= g.h) continue;
        for (i64 j = 0; j < g.kw; ++j) {
            i64 x = x0 + j * g.dw;
            if (x < 0 || x >= g.w) continue;
            float v = plane[y * g.w + x];
            if (v > best || is_nan(v) || at < 0) { best = v; at = y * g.w + x; }
        }
    }
    return at;
}

__device__ i64 in_range(i64 start, i64 k, i64 d, i64 len) {
    i64 c = 0;
    for (i64 i = 0; i < k; ++i) { i64 y = start + i * d; if (y >= 0 && y < len) ++c; }
    return c;
}

__device__ i64 avg_divisor(const Geom& g, i64 oy, i64 ox) {
    i64 y0 = oy * g.sh - g.ph, x0 = ox * g.sw - g.pw;
    if (!g.include_pad) return in_range(y0, g.kh, g.dh, g.h) * in_range(x0, g.kw, g.dw, g.w);
    i64 cy = 0, cx = 0;
    for (i64 i = 0; i < g.kh; ++i) if (y0 + i * g.dh < g.h + g.peh) ++cy;
    for (i64 j = 0; j < g.kw; ++j) if (x0 + j * g.dw < g.w + g.pew) ++cx;
    return cy * cx;
}

extern "C" __global__ void maxpool(float* out, const float* x, Geom g) {
    FOR_EACH(i, g.planes * g.oh * g.ow) {
        i64 ox = i % g.ow, oy = (i / g.ow) % g.oh, r = i / (g.ow * g.oh);
        const float* plane = x + r * g.h * g.w;
        i64 at = window_argmax(plane, g, oy, ox);
        out[i] = at < 0 ? -F_INF : plane[at];
    }
}

extern "C" __global__ void avgpool(float* out, const float* x, Geom g) {
    FOR_EACH(i, g.planes * g.oh * g.ow) {
        i64 ox = i % g.ow, oy = (i / g.ow) % g.oh, r = i / (g.ow * g.oh);
        const float* plane = x + r * g.h * g.w;
        i64 y0 = oy * g.sh - g.ph, x0 = ox * g.sw - g.pw;
        float sum = 0.f;
        for (i64 a = 0; a < g.kh; ++a) {
            i64 y = y0 + a * g.dh;
            if (y < 0 || y >= g.h) continue;
            for (i64 b = 0; b < g.kw; ++b) {
                i64 xx = x0 + b * g.dw;
                if (xx >= 0 && xx < g.w) sum += plane[y * g.w + xx];
            }
        }
        i64 cnt = avg_divisor(g, oy, ox);
        out[i] = cnt == 0 ? 0.f : sum / (float)cnt;
    }
}

// Outputs along one dim whose window may cover input index y: [lo, hi).
__device__ void covering(i64 y, i64 p, i64 k, i64 d, i64 s, i64 o, i64* lo, i64* hi) {
    i64 a = y + p - (k - 1) * d;
    *lo = a <= 0 ? 0 : (a + s - 1) / s;
    i64 b = (y + p) / s + 1;
    *hi = b < o ? b : o;
}

// dx[cell] = sum, over outputs in order, of dy where the output's argmax is the cell.
extern "C" __global__ void maxpool_grad(float* dx, const float* x, const float* dy, Geom g) {
    FOR_EACH(i, g.planes * g.h * g.w) {
        i64 cell = i % (g.h * g.w), r = i / (g.h * g.w);
        i64 y = cell / g.w, xx = cell % g.w;
        const float* plane = x + r * g.h * g.w;
        const float* d = dy + r * g.oh * g.ow;
        i64 ylo, yhi, xlo, xhi;
        covering(y, g.ph, g.kh, g.dh, g.sh, g.oh, &ylo, &yhi);
        covering(xx, g.pw, g.kw, g.dw, g.sw, g.ow, &xlo, &xhi);
        float acc = 0.f;
        for (i64 oy = ylo; oy < yhi; ++oy)
            for (i64 ox = xlo; ox < xhi; ++ox)
                if (window_argmax(plane, g, oy, ox) == cell) acc += d[oy * g.ow + ox];
        dx[i] = acc;
    }
}

// dx[cell] = sum, over outputs whose window holds the cell, of dy / divisor.
extern "C" __global__ void avgpool_grad(float* dx, const float* dy, Geom g) {
    FOR_EACH(i, g.planes * g.h * g.w) {
        i64 cell = i % (g.h * g.w), r = i / (g.h * g.w);
        i64 y = cell / g.w, xx = cell % g.w;
        const float* d = dy + r * g.oh * g.ow;
        i64 ylo, yhi, xlo, xhi;
        covering(y, g.ph, g.kh, g.dh, g.sh, g.oh, &ylo, &yhi);
        covering(xx, g.pw, g.kw, g.dw, g.sw, g.ow, &xlo, &xhi);
        float acc = 0.f;
        for (i64 oy = ylo; oy < yhi; ++oy) {
            i64 ty = y + g.ph - oy * g.sh;
            if (ty < 0 || ty % g.dh != 0 || ty / g.dh >= g.kh) continue;
            for (i64 ox = xlo; ox < xhi; ++ox) {
                i64 tx = xx + g.pw - ox * g.sw;
                if (tx < 0 || tx % g.dw != 0 || tx / g.dw >= g.kw) continue;
                i64 cnt = avg_divisor(g, oy, ox);
                if (cnt > 0) acc += d[oy * g.ow + ox] / (float)cnt;
            }
        }
        dx[i] = acc;
    }
}
"#;

/// Window geometry passed to the kernels by value; layout matches `Geom` in [`SRC`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct Geom {
    planes: i64,
    h: i64,
    w: i64,
    oh: i64,
    ow: i64,
    kh: i64,
    kw: i64,
    sh: i64,
    sw: i64,
    ph: i64,
    pw: i64,
    dh: i64,
    dw: i64,
    peh: i64,
    pew: i64,
    include_pad: i64,
}

// SAFETY: `repr(C)`, only i64 fields, field for field the `Geom` struct of `SRC`.
unsafe impl DeviceRepr for Geom {}

impl Geom {
    #[allow(clippy::too_many_arguments)]
    fn conv(planes: usize, h: usize, w: usize, oh: usize, ow: usize, kh: usize, kw: usize, a: &ConvAttrs) -> Geom {
        let v = |x: usize| x as i64;
        Geom {
            planes: v(planes),
            h: v(h),
            w: v(w),
            oh: v(oh),
            ow: v(ow),
            kh: v(kh),
            kw: v(kw),
            sh: v(a.strides[0]),
            sw: v(a.strides[1]),
            ph: v(a.pads[0]),
            pw: v(a.pads[1]),
            dh: v(a.dilations[0]),
            dw: v(a.dilations[1]),
            peh: v(a.pads[2]),
            pew: v(a.pads[3]),
            include_pad: 0,
        }
    }
    fn pool(a: &PoolAttrs, x: &[usize], oh: usize, ow: usize) -> Geom {
        let v = |x: usize| x as i64;
        Geom {
            planes: v(x[0] * x[1]),
            h: v(x[2]),
            w: v(x[3]),
            oh: v(oh),
            ow: v(ow),
            kh: v(a.kernel[0]),
            kw: v(a.kernel[1]),
            sh: v(a.strides[0]),
            sw: v(a.strides[1]),
            ph: v(a.pads[0]),
            pw: v(a.pads[1]),
            dh: v(a.dilations[0]),
            dw: v(a.dilations[1]),
            peh: v(a.pads[2]),
            pew: v(a.pads[3]),
            include_pad: a.count_include_pad as i64,
        }
    }
}

/// True for 1x1 convolutions with stride 1 and no padding, whose im2col is the input itself.
fn is_direct(a: &ConvAttrs, kh: usize, kw: usize) -> bool {
    kh == 1 && kw == 1 && a.strides == [1, 1] && a.pads == [0, 0, 0, 0]
}

fn zeros(ctx: &CudaContext, shape: &[usize]) -> Result<CudaTensor, Error> {
    CudaTensor::zeros(ctx, &TensorMeta::new(ir::DType::F32, shape.to_vec()))
}

/// Conv: X `[N,C,H,W]`, W `[M,C/group,kh,kw]`, optional bias `[M]`.
pub(crate) fn conv(
    ctx: &CudaContext,
    a: &ConvAttrs,
    inputs: &[&CudaTensor],
    out_shape: &[usize],
) -> Result<CudaTensor, Error> {
    let op = "conv";
    let (x, w) = (inputs[0].f32s(op)?, inputs[1].f32s(op)?);
    let (xs, ws) = (inputs[0].shape(), inputs[1].shape());
    let (n, c, h, wd) = (xs[0], xs[1], xs[2], xs[3]);
    let (m, cg, kh, kw) = (ws[0], ws[1], ws[2], ws[3]);
    let (oh, ow) = (out_shape[2], out_shape[3]);
    let g = a.group;
    let (mg, kk, p) = (m / g, cg * kh * kw, oh * ow);
    let total = n * m * p;
    let mut out = ctx.alloc::<f32>(op, total)?;
    let has_bias = inputs.len() > 2;
    if total == 0 {
        return Ok(CudaTensor::from_f32(out_shape, out));
    }
    if has_bias {
        let b = inputs[2].f32s(op)?;
        let s = [total, m, p].map(|v| v as i64);
        launch!(ctx, op, Family::Conv, "bias_fill", grid(total); &mut out.s, &b.s, &s[0], &s[1], &s[2])?;
    } else if kk == 0 {
        return zeros(ctx, out_shape);
    }
    if kk == 0 {
        return Ok(CudaTensor::from_f32(out_shape, out));
    }
    let direct = is_direct(a, kh, kw);
    let geom = Geom::conv(c, h, wd, oh, ow, kh, kw, a);
    let mut col = if direct { None } else { Some(ctx.alloc::<f32>(op, g * kk * p)?) };
    let prod = Product {
        m: mg,
        n: p,
        k: kk,
        trans_a: false,
        trans_b: false,
        batch: g,
        stride_a: mg * kk,
        stride_b: kk * p,
        stride_c: mg * p,
        alpha: 1.0,
        beta: if has_bias { 1.0 } else { 0.0 },
    };
    let img = c * h * wd;
    for ni in 0..n {
        let mut dst = out.s.slice_mut(ni * m * p..(ni + 1) * m * p);
        match &mut col {
            None => sgemm(ctx, op, prod, &w.s, &x.s.slice(ni * img..(ni + 1) * img), &mut dst)?,
            Some(col) => {
                let xi = x.s.slice(ni * img..(ni + 1) * img);
                launch!(ctx, op, Family::Conv, "im2col", grid(g * kk * p); &mut col.s, &xi, &geom)?;
                sgemm(ctx, op, prod, &w.s, &col.s, &mut dst)?;
            }
        }
    }
    Ok(CudaTensor::from_f32(out_shape, out))
}

/// Convolution gradient with respect to its input: `W^T @ dy` per group, then col2im.
pub(crate) fn conv_input_grad(
    ctx: &CudaContext,
    a: &ConvAttrs,
    dy: &CudaTensor,
    w: &CudaTensor,
    shape: &[usize],
) -> Result<CudaTensor, Error> {
    let op = "conv_input_grad";
    let (dv, wv) = (dy.f32s(op)?, w.f32s(op)?);
    let (n, c, h, wd) = (shape[0], shape[1], shape[2], shape[3]);
    let ws = w.shape();
    let (m, cg, kh, kw) = (ws[0], ws[1], ws[2], ws[3]);
    let (oh, ow) = (dy.shape()[2], dy.shape()[3]);
    let g = a.group;
    let (mg, kk, p) = (m / g, cg * kh * kw, oh * ow);
    let img = c * h * wd;
    if n * img == 0 || p == 0 || mg == 0 || kk == 0 {
        return zeros(ctx, shape);
    }
    let mut dx = ctx.alloc::<f32>(op, n * img)?;
    let direct = is_direct(a, kh, kw);
    let geom = Geom::conv(c, h, wd, oh, ow, kh, kw, a);
    let mut col = if direct { None } else { Some(ctx.alloc::<f32>(op, g * kk * p)?) };
    // col [kk, p] = W_g^T [kk, mg] @ dy_g [mg, p], batched over groups.
    let prod = Product {
        m: kk,
        n: p,
        k: mg,
        trans_a: true,
        trans_b: false,
        batch: g,
        stride_a: mg * kk,
        stride_b: mg * p,
        stride_c: kk * p,
        alpha: 1.0,
        beta: 0.0,
    };
    for ni in 0..n {
        let dyi = dv.s.slice(ni * m * p..(ni + 1) * m * p);
        match &mut col {
            None => sgemm(ctx, op, prod, &wv.s, &dyi, &mut dx.s.slice_mut(ni * img..(ni + 1) * img))?,
            Some(col) => {
                sgemm(ctx, op, prod, &wv.s, &dyi, &mut col.s)?;
                let mut dst = dx.s.slice_mut(ni * img..(ni + 1) * img);
                launch!(ctx, op, Family::Conv, "col2im", grid(img); &mut dst, &col.s, &geom)?;
            }
        }
    }
    Ok(CudaTensor::from_f32(shape, dx))
}

/// Convolution gradient with respect to its weight: `sum_n dy_n @ im2col(x_n)^T` per group.
pub(crate) fn conv_weight_grad(
    ctx: &CudaContext,
    a: &ConvAttrs,
    x: &CudaTensor,
    dy: &CudaTensor,
    shape: &[usize],
) -> Result<CudaTensor, Error> {
    let op = "conv_weight_grad";
    let (xv, dv) = (x.f32s(op)?, dy.f32s(op)?);
    let xs = x.shape();
    let (n, c, h, wd) = (xs[0], xs[1], xs[2], xs[3]);
    let (m, cg, kh, kw) = (shape[0], shape[1], shape[2], shape[3]);
    let (oh, ow) = (dy.shape()[2], dy.shape()[3]);
    let g = a.group;
    let (mg, kk, p) = (m / g, cg * kh * kw, oh * ow);
    let mut dw = ctx.zeros::<f32>(op, m * kk)?;
    if m * kk == 0 || p == 0 || n == 0 {
        return Ok(CudaTensor::from_f32(shape, dw));
    }
    let direct = is_direct(a, kh, kw);
    let geom = Geom::conv(c, h, wd, oh, ow, kh, kw, a);
    let mut col = if direct { None } else { Some(ctx.alloc::<f32>(op, g * kk * p)?) };
    // dW_g [mg, kk] += dy_g [mg, p] @ col_g^T [p, kk], batched over groups, summed over images.
    let prod = Product {
        m: mg,
        n: kk,
        k: p,
        trans_a: false,
        trans_b: true,
        batch: g,
        stride_a: mg * p,
        stride_b: kk * p,
        stride_c: mg * kk,
        alpha: 1.0,
        beta: 1.0,
    };
    let img = c * h * wd;
    for ni in 0..n {
        let dyi = dv.s.slice(ni * m * p..(ni + 1) * m * p);
        let xi = xv.s.slice(ni * img..(ni + 1) * img);
        match &mut col {
            None => sgemm(ctx, op, prod, &dyi, &xi, &mut dw.s)?,
            Some(col) => {
                launch!(ctx, op, Family::Conv, "im2col", grid(g * kk * p); &mut col.s, &xi, &geom)?;
                sgemm(ctx, op, prod, &dyi, &col.s, &mut dw.s)?;
            }
        }
    }
    Ok(CudaTensor::from_f32(shape, dw))
}

/// Max (`max`) or average pooling.
pub(crate) fn pool(
    ctx: &CudaContext,
    a: &PoolAttrs,
    x: &CudaTensor,
    out_shape: &[usize],
    max: bool,
) -> Result<CudaTensor, Error> {
    let op = if max { "maxpool" } else { "avgpool" };
    let xv = x.f32s(op)?;
    let n: usize = out_shape.iter().product();
    let mut out = ctx.alloc::<f32>(op, n)?;
    if n > 0 {
        let geom = Geom::pool(a, x.shape(), out_shape[2], out_shape[3]);
        let name = if max { "maxpool" } else { "avgpool" };
        launch!(ctx, op, Family::Conv, name, grid(n); &mut out.s, &xv.s, &geom)?;
    }
    Ok(CudaTensor::from_f32(out_shape, out))
}

/// Max-pool gradient: each window's dy goes to the cell the forward kernel picked.
pub(crate) fn max_pool_grad(
    ctx: &CudaContext,
    a: &PoolAttrs,
    x: &CudaTensor,
    dy: &CudaTensor,
) -> Result<CudaTensor, Error> {
    let op = "maxpool_grad";
    let (xv, dv) = (x.f32s(op)?, dy.f32s(op)?);
    let n = x.numel();
    let mut dx = ctx.alloc::<f32>(op, n)?;
    if n > 0 {
        let geom = Geom::pool(a, x.shape(), dy.shape()[2], dy.shape()[3]);
        launch!(ctx, op, Family::Conv, "maxpool_grad", grid(n); &mut dx.s, &xv.s, &dv.s, &geom)?;
    }
    Ok(CudaTensor::from_f32(x.shape(), dx))
}

/// Average-pool gradient: each window's dy is spread over its cells with the forward divisor.
pub(crate) fn avg_pool_grad(
    ctx: &CudaContext,
    a: &PoolAttrs,
    dy: &CudaTensor,
    shape: &[usize],
) -> Result<CudaTensor, Error> {
    let op = "avgpool_grad";
    let dv = dy.f32s(op)?;
    let n: usize = shape.iter().product();
    let mut dx = ctx.alloc::<f32>(op, n)?;
    if n > 0 {
        let geom = Geom::pool(a, shape, dy.shape()[2], dy.shape()[3]);
        launch!(ctx, op, Family::Conv, "avgpool_grad", grid(n); &mut dx.s, &dv.s, &geom)?;
    }
    Ok(CudaTensor::from_f32(shape, dx))
}
