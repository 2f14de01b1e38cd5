//! Normalisations and their gradients: Softmax / LogSoftmax (+ grad), LayerNorm (+ grad),
//! BatchNorm (inference, and training with batch statistics + grad), LRN (+ grad).
//!
//! Same statistics as the CPU kernels: row max in f32 (NaN ignored, a non-finite max shifts by
//! 0), sums and layer-norm moments in f64, LRN windows `[c - floor((size-1)/2),
//! c + ceil((size-1)/2)]`, layer-norm parameter gradients summed in f32 over rows in order.

use super::device::{CudaContext, DeviceBuf, Family, grid, per_block};
use super::shape::broadcast_f32;
use super::tensor::CudaTensor;
use crate::Error;

pub(crate) const SRC: &str = r#"
#define RB 256
// Block-wide sum and max (blockDim.x a power of two, at most RB); every thread gets the result.
__device__ double block_sum(double v, double* sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
        __syncthreads();
    }
    double r = sh[0];
    __syncthreads();
    return r;
}
// Max ignoring NaN (as Rust's f32::max).
__device__ double block_max(double v, double* sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) sh[threadIdx.x] = fmax(sh[threadIdx.x], sh[threadIdx.x + s]);
        __syncthreads();
    }
    double r = sh[0];
    __syncthreads();
    return r;
}

// One block per row of `len` contiguous elements.
extern "C" __global__ void softmax_rows(float* out, const float* x, i64 len, int lg) {
    __shared__ double sh[RB];
    const float* v = x + (i64)blockIdx.x * len;
    float* o = out + (i64)blockIdx.x * len;
    double mx = -D_INF;
    for (i64 k = threadIdx.x; k < len; k += blockDim.x) mx = fmax(mx, (double)v[k]);
    mx = block_max(mx, sh);
    float m = is_finite(mx) ? (float)mx : 0.f;
    double s = 0.0;
    for (i64 k = threadIdx.x; k < len; k += blockDim.x) s += (double)expf(v[k] - m);
    s = block_sum(s, sh);
    if (lg) {
        float ls = logf((float)s);
        for (i64 k = threadIdx.x; k < len; k += blockDim.x) o[k] = v[k] - m - ls;
    } else {
        float inv = 1.f / (float)s;
        for (i64 k = threadIdx.x; k < len; k += blockDim.x) o[k] = expf(v[k] - m) * inv;
    }
}

// One thread per (outer, inner) column of `len` elements `inner` apart.
extern "C" __global__ void softmax_cols(float* out, const float* x, i64 outer, i64 len, i64 inner, int lg) {
    FOR_EACH(i, outer * inner) {
        i64 base = (i / inner) * len * inner + i % inner;
        float m = -F_INF;
        for (i64 k = 0; k < len; ++k) m = fmaxf(m, x[base + k * inner]);
        if (!is_finite(m)) m = 0.f;
        float s = 0.f;
        for (i64 k = 0; k < len; ++k) s += expf(x[base + k * inner] - m);
        if (lg) {
            float ls = logf(s);
            for (i64 k = 0; k < len; ++k) out[base + k * inner] = x[base + k * inner] - m - ls;
        } else {
            float inv = 1.f / s;
            for (i64 k = 0; k < len; ++k) out[base + k * inner] = expf(x[base + k * inner] - m) * inv;
        }
    }
}

// Softmax: dx = y (dy - sum(dy y)); log-softmax: dx = dy - exp(y) sum(dy). One thread per column.
extern "C" __global__ void softmax_grad(float* out, const float* y, const float* dy, i64 outer, i64 len, i64 inner, int lg) {
    FOR_EACH(i, outer * inner) {
        i64 base = (i / inner) * len * inner + i % inner;
        double s = 0.0;
        for (i64 k = 0; k < len; ++k) {
            i64 j = base + k * inner;
            s += lg ? (double)dy[j] : (double)(dy[j] * y[j]);
        }
        float sf = (float)s;
        for (i64 k = 0; k < len; ++k) {
            i64 j = base + k * inner;
            out[j] = lg ? dy[j] - expf(y[j]) * sf : y[j] * (dy[j] - sf);
        }
    }
}

// Same, one block per contiguous row.
extern "C" __global__ void softmax_grad_rows(float* out, const float* y, const float* dy, i64 len, int lg) {
    __shared__ double sh[RB];
    i64 base = (i64)blockIdx.x * len;
    double s = 0.0;
    for (i64 k = threadIdx.x; k < len; k += blockDim.x) {
        i64 j = base + k;
        s += lg ? (double)dy[j] : (double)(dy[j] * y[j]);
    }
    float sf = (float)block_sum(s, sh);
    for (i64 k = threadIdx.x; k < len; k += blockDim.x) {
        i64 j = base + k;
        out[j] = lg ? dy[j] - expf(y[j]) * sf : y[j] * (dy[j] - sf);
    }
}

// Row mean and 1/std (f64 moments), as the CPU computes them.
__device__ void row_stats(const float* v, i64 d, float eps, double* sh, float* mean_out, float* inv_out) {
    double s = 0.0;
    for (i64 k = threadIdx.x; k < d; k += blockDim.x) s += (double)v[k];
    double mean = block_sum(s, sh) / (double)d;
    double q = 0.0;
    for (i64 k = threadIdx.x; k < d; k += blockDim.x) { double t = (double)v[k] - mean; q += t * t; }
    double var = block_sum(q, sh) / (double)d;
    *mean_out = (float)mean;
    *inv_out = (float)(1.0 / sqrt(var + (double)eps));
}

// One block per row of d; scale and bias (if has_bias) already broadcast to d.
extern "C" __global__ void layernorm(float* out, const float* x, const float* scale, const float* bias, i64 d, float eps, int has_bias) {
    __shared__ double sh[RB];
    const float* v = x + (i64)blockIdx.x * d;
    float* o = out + (i64)blockIdx.x * d;
    float mean, inv;
    row_stats(v, d, eps, sh, &mean, &inv);
    for (i64 k = threadIdx.x; k < d; k += blockDim.x) {
        float r = (v[k] - mean) * inv * scale[k];
        o[k] = has_bias ? r + bias[k] : r;
    }
}

// dx per row (one block per row); also stores the row's mean and 1/std in stats[2r], stats[2r+1].
extern "C" __global__ void layernorm_grad_rows(float* dx, float* stats, const float* x, const float* scale, const float* dy, i64 d, float eps) {
    __shared__ double sh[RB];
    i64 r = blockIdx.x;
    const float* v = x + r * d;
    const float* g = dy + r * d;
    float mean, inv;
    row_stats(v, d, eps, sh, &mean, &inv);
    double sg = 0.0, sgx = 0.0;
    for (i64 k = threadIdx.x; k < d; k += blockDim.x) {
        double gs = (double)(g[k] * scale[k]);
        sg += gs;
        sgx += gs * (double)((v[k] - mean) * inv);
    }
    float mg = (float)(block_sum(sg, sh) / (double)d);
    float mgx = (float)(block_sum(sgx, sh) / (double)d);
    for (i64 k = threadIdx.x; k < d; k += blockDim.x) {
        float xhat = (v[k] - mean) * inv;
        dx[r * d + k] = inv * (g[k] * scale[k] - mg - xhat * mgx);
    }
    if (threadIdx.x == 0) { stats[2 * r] = mean; stats[2 * r + 1] = inv; }
}

// dscale and dbias: one thread per normalised element, rows summed in order in f32.
extern "C" __global__ void layernorm_grad_params(float* dscale, float* dbias, const float* stats, const float* x, const float* dy, i64 rows, i64 d) {
    FOR_EACH(j, d) {
        float ds = 0.f, db = 0.f;
        for (i64 r = 0; r < rows; ++r) {
            float gg = dy[r * d + j];
            ds += gg * (x[r * d + j] - stats[2 * r]) * stats[2 * r + 1];
            db += gg;
        }
        dscale[j] = ds;
        dbias[j] = db;
    }
}

extern "C" __global__ void batchnorm(float* out, const float* x, const float* scale, const float* bias,
                                     const float* mean, const float* var, i64 n, i64 c, i64 sp, float eps) {
    FOR_EACH(i, n) {
        i64 ch = (i / sp) % c;
        float mul = scale[ch] / sqrtf(var[ch] + eps);
        float add = bias[ch] - mean[ch] * mul;
        out[i] = x[i] * mul + add;
    }
}

// bias + alpha / size * (sum of squares over channel ch's window) at image nn, position q.
__device__ __forceinline__ float lrn_sum(const float* x, i64 nn, i64 ch, i64 q, i64 c, i64 sp, i64 before, i64 after,
                                         float alpha, float bias, i64 size) {
    i64 lo = ch - before < 0 ? 0 : ch - before;
    i64 hi = ch + after > c - 1 ? c - 1 : ch + after;
    float sq = 0.f;
    for (i64 k = lo; k <= hi; ++k) { float t = x[(nn * c + k) * sp + q]; sq += t * t; }
    return bias + alpha / (float)size * sq;
}

extern "C" __global__ void lrn(float* out, const float* x, i64 n, i64 c, i64 sp, i64 size, float alpha, float beta, float bias) {
    i64 before = (size - 1) / 2, after = size / 2;
    FOR_EACH(i, n) {
        i64 q = i % sp, t = i / sp;
        i64 ch = t % c, nn = t / c;
        out[i] = x[i] / powf(lrn_sum(x, nn, ch, q, c, sp, before, after, alpha, bias, size), beta);
    }
}

extern "C" __global__ void lrn_grad(float* out, const float* x, const float* dy, i64 n, i64 c, i64 sp, i64 size,
                                    float alpha, float beta, float bias) {
    i64 before = (size - 1) / 2, after = size / 2;
    FOR_EACH(i, n) {
        i64 q = i % sp, t = i / sp;
        i64 k = t % c, nn = t / c;
        // Channels whose window contains k: [k - after, k + before].
        i64 lo = k - after < 0 ? 0 : k - after;
        i64 hi = k + before > c - 1 ? c - 1 : k + before;
        float acc = 0.f;
        for (i64 ch = lo; ch <= hi; ++ch) {
            i64 j = (nn * c + ch) * sp + q;
            acc += dy[j] * x[j] * powf(lrn_sum(x, nn, ch, q, c, sp, before, after, alpha, bias, size), -beta - 1.f);
        }
        float sk = lrn_sum(x, nn, k, q, c, sp, before, after, alpha, bias, size);
        out[i] = dy[i] * powf(sk, -beta) - 2.f * alpha * beta / (float)size * x[i] * acc;
    }
}

// Training batch norm: one block per channel ch of x [n, c, sp]; stats[2ch] = batch mean,
// stats[2ch+1] = 1/sqrt(population var + eps), moments in f64 as the CPU computes them.
extern "C" __global__ void bn_train_stats(float* stats, const float* x, i64 n, i64 c, i64 sp, float eps) {
    __shared__ double sh[RB];
    i64 ch = blockIdx.x, m = n * sp;
    double s = 0.0;
    for (i64 k = threadIdx.x; k < m; k += blockDim.x) s += (double)x[((k / sp) * c + ch) * sp + k % sp];
    double mean = block_sum(s, sh) / (double)(m > 0 ? m : 1);
    double q = 0.0;
    for (i64 k = threadIdx.x; k < m; k += blockDim.x) {
        double t = (double)x[((k / sp) * c + ch) * sp + k % sp] - mean;
        q += t * t;
    }
    double var = block_sum(q, sh) / (double)(m > 0 ? m : 1);
    if (threadIdx.x == 0) { stats[2 * ch] = (float)mean; stats[2 * ch + 1] = (float)(1.0 / sqrt(var + (double)eps)); }
}

extern "C" __global__ void bn_train_apply(float* out, const float* x, const float* stats, const float* scale,
                                          const float* bias, i64 total, i64 c, i64 sp) {
    FOR_EACH(i, total) {
        i64 ch = (i / sp) % c;
        float mul = stats[2 * ch + 1] * scale[ch];
        float add = bias[ch] - stats[2 * ch] * mul;
        out[i] = x[i] * mul + add;
    }
}

// One block per channel: dbias = sum(dy), dscale = sum(dy * xhat), summed in f64.
extern "C" __global__ void bn_train_grad_sums(float* dscale, float* dbias, const float* stats, const float* x,
                                              const float* dy, i64 n, i64 c, i64 sp) {
    __shared__ double sh[RB];
    i64 ch = blockIdx.x, m = n * sp;
    float mean = stats[2 * ch], inv = stats[2 * ch + 1];
    double sg = 0.0, sgx = 0.0;
    for (i64 k = threadIdx.x; k < m; k += blockDim.x) {
        i64 j = ((k / sp) * c + ch) * sp + k % sp;
        sg += (double)dy[j];
        sgx += (double)dy[j] * (double)((x[j] - mean) * inv);
    }
    sg = block_sum(sg, sh);
    sgx = block_sum(sgx, sh);
    if (threadIdx.x == 0) { dbias[ch] = (float)sg; dscale[ch] = (float)sgx; }
}

// dx = scale * inv / M * (M * dy - dbias - xhat * dscale).
extern "C" __global__ void bn_train_grad_dx(float* dx, const float* stats, const float* scale, const float* dscale,
                                            const float* dbias, const float* x, const float* dy, i64 total, i64 c,
                                            i64 sp, i64 m) {
    float mf = (float)(m > 0 ? m : 1);
    FOR_EACH(i, total) {
        i64 ch = (i / sp) % c;
        float mean = stats[2 * ch], inv = stats[2 * ch + 1];
        float xhat = (x[i] - mean) * inv;
        dx[i] = scale[ch] * inv / mf * (mf * dy[i] - dbias[ch] - xhat * dscale[ch]);
    }
}
"#;

/// Rows at least this long are handled by a block per row.
const LONG_ROW: usize = 64;

/// `(outer, len, inner)` of a tensor of `shape` around `axis`.
fn around(shape: &[usize], axis: usize) -> (usize, usize, usize) {
    (shape[..axis].iter().product(), shape[axis], shape[axis + 1..].iter().product())
}

/// Softmax (or log-softmax) along `axis`, subtracting the max first.
pub(crate) fn softmax(ctx: &CudaContext, x: &CudaTensor, axis: usize, log: bool) -> Result<CudaTensor, Error> {
    let op = if log { "log_softmax" } else { "softmax" };
    let v = x.f32s(op)?;
    let (outer, len, inner) = around(x.shape(), axis);
    let mut out = ctx.alloc::<f32>(op, x.numel())?;
    let lg = log as i32;
    if x.numel() > 0 {
        if inner == 1 && len >= LONG_ROW {
            let len64 = len as i64;
            launch!(ctx, op, Family::Norm, "softmax_rows", per_block(op, outer)?; &mut out.s, &v.s, &len64, &lg)?;
        } else {
            let a = [outer, len, inner].map(|v| v as i64);
            launch!(ctx, op, Family::Norm, "softmax_cols", grid(outer * inner);
                &mut out.s, &v.s, &a[0], &a[1], &a[2], &lg)?;
        }
    }
    Ok(CudaTensor::from_f32(x.shape(), out))
}

/// Softmax: `dx = y * (dy - sum(dy * y))`; log-softmax: `dx = dy - exp(y) * sum(dy)`.
pub(crate) fn softmax_grad(
    ctx: &CudaContext,
    y: &CudaTensor,
    dy: &CudaTensor,
    axis: usize,
    log: bool,
) -> Result<CudaTensor, Error> {
    let op = if log { "log_softmax_grad" } else { "softmax_grad" };
    let (yv, dv) = (y.f32s(op)?, dy.f32s(op)?);
    let (outer, len, inner) = around(y.shape(), axis);
    let mut out = ctx.alloc::<f32>(op, y.numel())?;
    let lg = log as i32;
    if y.numel() > 0 {
        if inner == 1 && len >= LONG_ROW {
            let len64 = len as i64;
            launch!(ctx, op, Family::Norm, "softmax_grad_rows", per_block(op, outer)?;
                &mut out.s, &yv.s, &dv.s, &len64, &lg)?;
        } else {
            let a = [outer, len, inner].map(|v| v as i64);
            launch!(ctx, op, Family::Norm, "softmax_grad", grid(outer * inner);
                &mut out.s, &yv.s, &dv.s, &a[0], &a[1], &a[2], &lg)?;
        }
    }
    Ok(CudaTensor::from_f32(y.shape(), out))
}

/// Normalises over dims `axis..`, then scales and shifts (scale/bias broadcast to those dims).
pub(crate) fn layer_norm(
    ctx: &CudaContext,
    inputs: &[&CudaTensor],
    axis: usize,
    eps: f32,
) -> Result<CudaTensor, Error> {
    let op = "layernorm";
    let x = inputs[0];
    let v = x.f32s(op)?;
    let norm_shape = &x.shape()[axis..];
    let d: usize = norm_shape.iter().product();
    let scale = broadcast_f32(ctx, op, inputs[1], norm_shape)?;
    let bias = inputs.get(2).map(|b| broadcast_f32(ctx, op, b, norm_shape)).transpose()?;
    let mut out = ctx.alloc::<f32>(op, x.numel())?;
    if x.numel() > 0 {
        let rows = x.numel() / d;
        let sc = scale.f32s(op)?;
        let (bb, has_bias) = match &bias {
            Some(b) => (b.f32s(op)?, 1i32),
            None => (sc, 0i32),
        };
        let d64 = d as i64;
        launch!(ctx, op, Family::Norm, "layernorm", per_block(op, rows)?;
            &mut out.s, &v.s, &sc.s, &bb.s, &d64, &eps, &has_bias)?;
    }
    Ok(CudaTensor::from_f32(x.shape(), out))
}

/// Layer-norm gradient: dx, and dscale/dbias over the normalised shape.
pub(crate) fn layer_norm_grad(
    ctx: &CudaContext,
    inputs: &[&CudaTensor],
    axis: usize,
    eps: f32,
) -> Result<Vec<CudaTensor>, Error> {
    let op = "layernorm_grad";
    let (x, dy) = (inputs[0], inputs[2]);
    let (xv, dv) = (x.f32s(op)?, dy.f32s(op)?);
    let norm_shape = &x.shape()[axis..];
    let d: usize = norm_shape.iter().product();
    let scale = broadcast_f32(ctx, op, inputs[1], norm_shape)?;
    let sc = scale.f32s(op)?;
    let rows = x.numel().checked_div(d).unwrap_or(0);
    let mut dx = ctx.alloc::<f32>(op, x.numel())?;
    let mut stats = ctx.alloc::<f32>(op, 2 * rows)?;
    let mut dscale = ctx.alloc::<f32>(op, d)?;
    let mut dbias = ctx.alloc::<f32>(op, d)?;
    let (d64, rows64) = (d as i64, rows as i64);
    if rows > 0 && d > 0 {
        launch!(ctx, op, Family::Norm, "layernorm_grad_rows", per_block(op, rows)?;
            &mut dx.s, &mut stats.s, &xv.s, &sc.s, &dv.s, &d64, &eps)?;
    }
    if d > 0 {
        launch!(ctx, op, Family::Norm, "layernorm_grad_params", grid(d);
            &mut dscale.s, &mut dbias.s, &stats.s, &xv.s, &dv.s, &rows64, &d64)?;
    }
    Ok(vec![
        CudaTensor::from_f32(x.shape(), dx),
        CudaTensor::from_f32(norm_shape, dscale),
        CudaTensor::from_f32(norm_shape, dbias),
    ])
}

/// `(x - mean) / sqrt(var + eps) * scale + bias` per channel (dim 1).
pub(crate) fn batch_norm(ctx: &CudaContext, inputs: &[&CudaTensor], eps: f32) -> Result<CudaTensor, Error> {
    let op = "batchnorm";
    let x = inputs[0];
    let v = x.f32s(op)?;
    let p: Vec<&DeviceBuf<f32>> = inputs[1..5].iter().map(|t| t.f32s(op)).collect::<Result<_, _>>()?;
    let s = x.shape();
    let n = x.numel();
    let mut out = ctx.alloc::<f32>(op, n)?;
    if n > 0 {
        let a = [n, s[1], s[2..].iter().product()].map(|v| v as i64);
        launch!(ctx, op, Family::Norm, "batchnorm", grid(n);
            &mut out.s, &v.s, &p[0].s, &p[1].s, &p[2].s, &p[3].s, &a[0], &a[1], &a[2], &eps)?;
    }
    Ok(CudaTensor::from_f32(s, out))
}

/// ONNX LRN across channels (dim 1) (or its gradient when `dy` is given).
pub(crate) fn lrn(
    ctx: &CudaContext,
    x: &CudaTensor,
    dy: Option<&CudaTensor>,
    size: usize,
    alpha: f32,
    beta: f32,
    bias: f32,
) -> Result<CudaTensor, Error> {
    let op = if dy.is_some() { "lrn_grad" } else { "lrn" };
    let v = x.f32s(op)?;
    let s = x.shape();
    let n = x.numel();
    let mut out = ctx.alloc::<f32>(op, n)?;
    if n > 0 {
        let a = [n, s[1], s[2..].iter().product(), size].map(|v| v as i64);
        match dy {
            None => launch!(ctx, op, Family::Norm, "lrn", grid(n);
                &mut out.s, &v.s, &a[0], &a[1], &a[2], &a[3], &alpha, &beta, &bias)?,
            Some(dy) => {
                let d = dy.f32s(op)?;
                launch!(ctx, op, Family::Norm, "lrn_grad", grid(n);
                    &mut out.s, &v.s, &d.s, &a[0], &a[1], &a[2], &a[3], &alpha, &beta, &bias)?
            }
        }
    }
    Ok(CudaTensor::from_f32(s, out))
}

/// Training-mode batch norm: each channel (dim 1) normalised with the batch's statistics.
pub(crate) fn batch_norm_train(ctx: &CudaContext, inputs: &[&CudaTensor], eps: f32) -> Result<CudaTensor, Error> {
    let op = "batchnorm_train";
    let x = inputs[0];
    let (v, scale, bias) = (x.f32s(op)?, inputs[1].f32s(op)?, inputs[2].f32s(op)?);
    let s = x.shape();
    let (total, c) = (x.numel(), s[1]);
    let a = [s[0], c, s[2..].iter().product()].map(|v| v as i64);
    let mut stats = ctx.alloc::<f32>(op, 2 * c)?;
    let mut out = ctx.alloc::<f32>(op, total)?;
    if c > 0 {
        launch!(ctx, op, Family::Norm, "bn_train_stats", per_block(op, c)?;
            &mut stats.s, &v.s, &a[0], &a[1], &a[2], &eps)?;
    }
    if total > 0 {
        let t = total as i64;
        launch!(ctx, op, Family::Norm, "bn_train_apply", grid(total);
            &mut out.s, &v.s, &stats.s, &scale.s, &bias.s, &t, &a[1], &a[2])?;
    }
    Ok(CudaTensor::from_f32(s, out))
}

/// Gradient of training-mode batch norm through the batch statistics: dx, dscale, dbias.
pub(crate) fn batch_norm_train_grad(
    ctx: &CudaContext,
    inputs: &[&CudaTensor],
    eps: f32,
) -> Result<Vec<CudaTensor>, Error> {
    let op = "batchnorm_train_grad";
    let x = inputs[0];
    let (xv, scale, dv) = (x.f32s(op)?, inputs[1].f32s(op)?, inputs[2].f32s(op)?);
    let s = x.shape();
    let (total, c) = (x.numel(), s[1]);
    let sp: usize = s[2..].iter().product();
    let a = [s[0], c, sp, s[0] * sp].map(|v| v as i64);
    let mut stats = ctx.alloc::<f32>(op, 2 * c)?;
    let mut dscale = ctx.alloc::<f32>(op, c)?;
    let mut dbias = ctx.alloc::<f32>(op, c)?;
    let mut dx = ctx.alloc::<f32>(op, total)?;
    if c > 0 {
        launch!(ctx, op, Family::Norm, "bn_train_stats", per_block(op, c)?;
            &mut stats.s, &xv.s, &a[0], &a[1], &a[2], &eps)?;
        launch!(ctx, op, Family::Norm, "bn_train_grad_sums", per_block(op, c)?;
            &mut dscale.s, &mut dbias.s, &stats.s, &xv.s, &dv.s, &a[0], &a[1], &a[2])?;
    }
    if total > 0 {
        let t = total as i64;
        launch!(ctx, op, Family::Norm, "bn_train_grad_dx", grid(total);
            &mut dx.s, &stats.s, &scale.s, &dscale.s, &dbias.s, &xv.s, &dv.s, &t, &a[1], &a[2], &a[3])?;
    }
    Ok(vec![CudaTensor::from_f32(s, dx), CudaTensor::from_f32(&[c], dscale), CudaTensor::from_f32(&[c], dbias)])
}
