//! Unary gradients (`dx = dy * f'(x)`, from the forward output for the ops of
//! `ir::unary_grad_from_output`) and the optimizer updates, with the CPU's arithmetic: AdamW's
//! bias corrections are computed on the host in f64 and applied as f32 scalars.

use super::device::{CudaContext, Family, grid};
use super::tensor::CudaTensor;
use crate::Error;
use ir::UnaryOp;

pub(crate) const SRC: &str = r#"
// Derivative factor of unary op `code` at v (v is the forward output y for tanh, sigmoid, exp,
// sqrt and reciprocal).
__device__ __forceinline__ float unary_deriv(int code, float v) {
    const float PI = 3.14159265358979323846f;
    switch (code) {
        case 0: return v > 0.f ? 1.f : 0.f;
        case 1: {
            float cdf = 0.5f * erfcf(-v * 0.70710678118654752f);
            float pdf = expf(-0.5f * v * v) / sqrtf(2.f * PI);
            return cdf + v * pdf;
        }
        case 2: {
            const float C = 0.7978846f;
            float t = tanhf(C * (v + 0.044715f * v * v * v));
            return 0.5f * (1.f + t) + 0.5f * v * (1.f - t * t) * C * (1.f + 3.f * 0.044715f * v * v);
        }
        case 3: return 1.f - v * v;
        case 4: return 2.f / sqrtf(PI) * expf(-v * v);
        case 5: return v * (1.f - v);
        case 6: return v;
        case 7: return 1.f / v;
        case 8: return 0.5f / v;
        case 9: return -1.f;
        case 10: return -v * v;
        case 11: return v > 0.f ? 1.f : (v < 0.f ? -1.f : 0.f);
        case 12: return cosf(v);
        default: return -sinf(v);
    }
}

extern "C" __global__ void unary_grad(float* out, const float* x, const float* dy, i64 n, int code) {
    FOR_EACH(i, n) { out[i] = dy[i] * unary_deriv(code, x[i]); }
}

// g' = g + wd p; without momentum p' = p - lr g'.
extern "C" __global__ void sgd(float* np, const float* p, const float* g, i64 n, float lr, float wd) {
    FOR_EACH(i, n) { np[i] = p[i] - lr * (g[i] + wd * p[i]); }
}

// With momentum: buf' = momentum buf + g'; p' = p - lr buf'.
extern "C" __global__ void sgd_momentum(float* np, float* nb, const float* p, const float* g, const float* buf,
                                        i64 n, float lr, float momentum, float wd) {
    FOR_EACH(i, n) {
        float d = g[i] + wd * p[i];
        float b = momentum * buf[i] + d;
        nb[i] = b;
        np[i] = p[i] - lr * b;
    }
}

extern "C" __global__ void adamw(float* np, float* nm, float* nv, const float* p, const float* g, const float* m,
                                 const float* v, i64 n, float decay, float w1, float beta2, float w2,
                                 float bc2_sqrt, float eps, float step_size) {
    FOR_EACH(i, n) {
        float pp = p[i] * decay;
        float mi = m[i] + w1 * (g[i] - m[i]);
        float vi = v[i] * beta2 + w2 * g[i] * g[i];
        float denom = sqrtf(vi) / bc2_sqrt + eps;
        np[i] = pp - step_size * (mi / denom);
        nm[i] = mi;
        nv[i] = vi;
    }
}
"#;

fn grad_code(u: UnaryOp) -> Option<i32> {
    use UnaryOp::*;
    Some(match u {
        Relu => 0,
        Gelu => 1,
        GeluTanh => 2,
        Tanh => 3,
        Erf => 4,
        Sigmoid => 5,
        Exp => 6,
        Log => 7,
        Sqrt => 8,
        Neg => 9,
        Reciprocal => 10,
        Abs => 11,
        Sin => 12,
        Cos => 13,
        // Every kind is named (no wildcard): the activations have their own gradient kernel, the others none.
        Not
        | Floor
        | Ceil
        | Sign
        | HardSigmoid { .. }
        | HardSwish
        | LeakyRelu { .. }
        | Elu { .. }
        | Selu { .. }
        | Celu { .. }
        | Softplus
        | Softsign
        | Mish
        | ThresholdedRelu { .. }
        | Shrink { .. }
        | Round
        | IsNaN
        | IsInf { .. }
        | Tan
        | Acos
        | Asin
        | Atan
        | Sinh
        | Cosh
        | Asinh
        | Acosh
        | Atanh
        | BitwiseNot => return None,
    })
}

/// `dx = dy * f'(x)`; `x` is the forward output for the ops of `ir::unary_grad_from_output`.
pub(crate) fn unary_grad(ctx: &CudaContext, u: UnaryOp, x: &CudaTensor, dy: &CudaTensor) -> Result<CudaTensor, Error> {
    if ir::ops::activation::is_activation(u) {
        return super::activation::unary_grad(ctx, u, x, dy);
    }
    let op = ir::unary_grad_name(u);
    let (xv, dv) = (x.f32s(op)?, dy.f32s(op)?);
    let code = grad_code(u).ok_or_else(|| Error::BadInput { op, message: "op has no gradient kernel".into() })?;
    let n = x.numel();
    let mut out = ctx.alloc::<f32>(op, n)?;
    if n > 0 {
        let n64 = n as i64;
        launch!(ctx, op, Family::Optim, "unary_grad", grid(n); &mut out.s, &xv.s, &dv.s, &n64, &code)?;
    }
    Ok(CudaTensor::from_f32(x.shape(), out))
}

/// The optional trailing lr factor of an update at input `at` (a schedule's value, read back to
/// the host: synchronises; 1 without one), as the CPU kernel takes it.
fn lr_factor(ctx: &CudaContext, op: &'static str, inputs: &[&CudaTensor], at: usize) -> Result<f32, Error> {
    match inputs.get(at) {
        None => Ok(1.0),
        Some(t) => ctx
            .download_slice(op, t.f32s(op)?, 1)?
            .first()
            .copied()
            .ok_or_else(|| Error::BadInput { op, message: "the lr factor is empty".into() }),
    }
}

/// One SGD step; returns p' and, with momentum, the new buffer.
pub(crate) fn sgd_update(
    ctx: &CudaContext,
    inputs: &[&CudaTensor],
    lr: f32,
    momentum: f32,
    weight_decay: f32,
) -> Result<Vec<CudaTensor>, Error> {
    let op = "sgd_update";
    let lr = lr * lr_factor(ctx, op, inputs, if momentum != 0.0 { 3 } else { 2 })?;
    let (p, g) = (inputs[0].f32s(op)?, inputs[1].f32s(op)?);
    let shape = inputs[0].shape();
    let n = inputs[0].numel();
    let n64 = n as i64;
    let mut np = ctx.alloc::<f32>(op, n)?;
    if momentum != 0.0 {
        let buf = inputs[2].f32s(op)?;
        let mut nb = ctx.alloc::<f32>(op, n)?;
        if n > 0 {
            launch!(ctx, op, Family::Optim, "sgd_momentum", grid(n);
                &mut np.s, &mut nb.s, &p.s, &g.s, &buf.s, &n64, &lr, &momentum, &weight_decay)?;
        }
        return Ok(vec![CudaTensor::from_f32(shape, np), CudaTensor::from_f32(shape, nb)]);
    }
    if n > 0 {
        launch!(ctx, op, Family::Optim, "sgd", grid(n); &mut np.s, &p.s, &g.s, &n64, &lr, &weight_decay)?;
    }
    Ok(vec![CudaTensor::from_f32(shape, np)])
}

/// One AdamW step at the step number held by input 4 (read back to the host: synchronises).
pub(crate) fn adamw_update(
    ctx: &CudaContext,
    inputs: &[&CudaTensor],
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
) -> Result<Vec<CudaTensor>, Error> {
    let op = "adamw_update";
    let lr = lr * lr_factor(ctx, op, inputs, 5)?;
    let [p, g, m, v] = [0, 1, 2, 3].map(|i| inputs[i].f32s(op));
    let (p, g, m, v) = (p?, g?, m?, v?);
    let t = ctx.download_slice(op, inputs[4].i64s(op)?, 1)?[0];
    let k = crate::optim::AdamW::at(lr as f64, beta1 as f64, beta2 as f64, weight_decay as f64, t)
        .map_err(|message| Error::BadInput { op, message })?;
    let (decay, step_size, bc2_sqrt) = (k.decay as f32, k.step_size as f32, k.bc2_sqrt as f32);
    let (w1, w2) = (k.w1 as f32, k.w2 as f32);
    let shape = inputs[0].shape();
    let n = inputs[0].numel();
    let (mut np, mut nm, mut nv) = (ctx.alloc::<f32>(op, n)?, ctx.alloc::<f32>(op, n)?, ctx.alloc::<f32>(op, n)?);
    if n > 0 {
        let n64 = n as i64;
        launch!(ctx, op, Family::Optim, "adamw", grid(n);
            &mut np.s, &mut nm.s, &mut nv.s, &p.s, &g.s, &m.s, &v.s, &n64,
            &decay, &w1, &beta2, &w2, &bc2_sqrt, &eps, &step_size)?;
    }
    Ok(vec![CudaTensor::from_f32(shape, np), CudaTensor::from_f32(shape, nm), CudaTensor::from_f32(shape, nv)])
}
