//! The activation family (`ir::ops::activation`) on the device, with the CPU kernels' formulas
//! (`cpu/activation.rs`): the newer unary activations and math functions and their
//! derivatives, IsNaN/IsInf, PRelu, the bitwise ops and Hardmax.

use super::device::{CudaContext, Family, Strided, broadcast_strides, grid};
use super::tensor::{Buf, CudaTensor};
use crate::Error;
use ir::{BinaryOp, DType, TensorMeta, UnaryOp};

pub(crate) const SRC: &str = r#"
__device__ __forceinline__ float clamp01_f(float t) { return t < 0.f ? 0.f : (t > 1.f ? 1.f : t); }
__device__ __forceinline__ float softplus_f(float x) { return x > 0.f ? x + log1pf(expf(-x)) : log1pf(expf(x)); }
__device__ __forceinline__ float sigmoid_a(float x) {
    if (x >= 0.f) return 1.f / (1.f + expf(-x));
    float e = expf(x);
    return e / (1.f + e);
}

// `a` and `b` are the op's attributes (see act_code on the host).
extern "C" __global__ void act_f32(float* out, const float* x, i64 n, int code, float a, float b) {
    FOR_EACH(i, n) {
        float v = x[i];
        float r;
        switch (code) {
            case 0: r = clamp01_f(a * v + b); break;
            case 1: r = v * clamp01_f(v * (1.f / 6.f) + 0.5f); break;
            case 2: r = v < 0.f ? a * v : v; break;
            case 3: r = v < 0.f ? a * expm1f(v) : v; break;
            case 4: r = v > 0.f ? b * v : b * a * expm1f(v); break;
            case 5: r = is_nan(v) ? v : fmaxf(v, 0.f) + fminf(a * expm1f(v / a), 0.f); break;
            case 6: r = softplus_f(v); break;
            case 7: r = v / (1.f + fabsf(v)); break;
            case 8: r = v * tanhf(softplus_f(v)); break;
            case 9: r = v > a ? v : 0.f; break;
            case 10: r = v < -b ? v + a : (v > b ? v - a : (is_nan(v) ? v : 0.f)); break;
            case 11: r = rintf(v); break;
            case 12: r = tanf(v); break;
            case 13: r = acosf(v); break;
            case 14: r = asinf(v); break;
            case 15: r = atanf(v); break;
            case 16: r = sinhf(v); break;
            case 17: r = coshf(v); break;
            case 18: r = asinhf(v); break;
            case 19: r = acoshf(v); break;
            default: r = atanhf(v); break;
        }
        out[i] = r;
    }
}

// Derivative factor of act_f32's op `code` at x (PyTorch's choices at the kinks).
__device__ __forceinline__ float act_deriv(int code, float v, float a, float b) {
    switch (code) {
        case 0: { float t = a * v + b; return (t > 0.f && t < 1.f) ? a : 0.f; }
        case 1: return v < -3.f ? 0.f : (v <= 3.f ? v / 3.f + 0.5f : 1.f);
        case 2: return v > 0.f ? 1.f : a;
        case 3: return v > 0.f ? 1.f : a * expf(v);
        case 4: return v > 0.f ? b : b * a * expf(v);
        case 5: return v > 0.f ? 1.f : expf(v / a);
        case 6: return sigmoid_a(v);
        case 7: { float d = 1.f + fabsf(v); return 1.f / (d * d); }
        case 8: { float t = tanhf(softplus_f(v)); return t + v * sigmoid_a(v) * (1.f - t * t); }
        case 9: return v > a ? 1.f : 0.f;
        case 10: return (v < -b || v > b) ? 1.f : 0.f;
        case 12: { float c = cosf(v); return 1.f / (c * c); }
        case 13: return -1.f / sqrtf(1.f - v * v);
        case 14: return 1.f / sqrtf(1.f - v * v);
        case 15: return 1.f / (1.f + v * v);
        case 16: return coshf(v);
        case 17: return sinhf(v);
        case 18: return 1.f / sqrtf(v * v + 1.f);
        case 19: return 1.f / sqrtf(v * v - 1.f);
        default: return 1.f / (1.f - v * v);
    }
}

extern "C" __global__ void act_grad_f32(float* out, const float* x, const float* dy, i64 n, int code, float a, float b) {
    FOR_EACH(i, n) { out[i] = dy[i] * act_deriv(code, x[i], a, b); }
}

// IsNaN (nan = 1) or IsInf with the signs it detects.
extern "C" __global__ void act_test_f32(u8* out, const float* x, i64 n, int nan, int neg, int pos) {
    FOR_EACH(i, n) {
        float v = x[i];
        bool r = nan ? is_nan(v) : (is_inf(v) && (v > 0.f ? pos : neg));
        out[i] = r ? 1 : 0;
    }
}

extern "C" __global__ void bitwise_not_i64(i64* out, const i64* x, i64 n) {
    FOR_EACH(i, n) { out[i] = ~x[i]; }
}

extern "C" __global__ void prelu_f32(float* out, const float* x, const float* s, Strided st, i64 n) {
    FOR_EACH(i, n) {
        i64 o[2];
        offsets(st, 2, i, o);
        float v = x[o[0]];
        out[i] = v < 0.f ? s[o[1]] * v : v;
    }
}

extern "C" __global__ void bitwise_i64(i64* out, const i64* a, const i64* b, Strided st, i64 n, int code) {
    FOR_EACH(i, n) {
        i64 o[2];
        offsets(st, 2, i, o);
        i64 x = a[o[0]], y = b[o[1]];
        out[i] = code == 0 ? (x & y) : (code == 1 ? (x | y) : (x ^ y));
    }
}

// One thread per (outer, inner) column: 1 at the first maximum along the axis, 0 elsewhere.
extern "C" __global__ void hardmax_f32(float* out, const float* x, i64 outer, i64 len, i64 inner) {
    FOR_EACH(c, outer * inner) {
        i64 o = c / inner, in = c % inner;
        const float* p = x + o * len * inner + in;
        float* q = out + o * len * inner + in;
        i64 best = 0;
        for (i64 k = 1; k < len; ++k) {
            if (p[k * inner] > p[best * inner]) best = k;
        }
        for (i64 k = 0; k < len; ++k) q[k * inner] = k == best ? 1.f : 0.f;
    }
}
"#;

fn bad(op: &'static str, message: String) -> Error {
    Error::BadInput { op, message }
}

/// The `act_f32` / `act_grad_f32` code of `u` and its two attributes.
fn act_code(u: UnaryOp) -> Option<(i32, f32, f32)> {
    use UnaryOp::*;
    Some(match u {
        HardSigmoid { alpha, beta } => (0, alpha, beta),
        HardSwish => (1, 0.0, 0.0),
        LeakyRelu { alpha } => (2, alpha, 0.0),
        Elu { alpha } => (3, alpha, 0.0),
        Selu { alpha, gamma } => (4, alpha, gamma),
        Celu { alpha } => (5, alpha, 0.0),
        Softplus => (6, 0.0, 0.0),
        Softsign => (7, 0.0, 0.0),
        Mish => (8, 0.0, 0.0),
        ThresholdedRelu { alpha } => (9, alpha, 0.0),
        Shrink { bias, lambd } => (10, bias, lambd),
        Round => (11, 0.0, 0.0),
        Tan => (12, 0.0, 0.0),
        Acos => (13, 0.0, 0.0),
        Asin => (14, 0.0, 0.0),
        Atan => (15, 0.0, 0.0),
        Sinh => (16, 0.0, 0.0),
        Cosh => (17, 0.0, 0.0),
        Asinh => (18, 0.0, 0.0),
        Acosh => (19, 0.0, 0.0),
        Atanh => (20, 0.0, 0.0),
        // Every kind is named (no wildcard): the basic ones are not this file's; BitwiseNot, IsNaN and
        // IsInf have kernels of their own.
        Relu
        | Gelu
        | GeluTanh
        | Tanh
        | Erf
        | Sigmoid
        | Exp
        | Log
        | Sqrt
        | Neg
        | Reciprocal
        | Abs
        | Not
        | Floor
        | Ceil
        | Sin
        | Cos
        | Sign
        | IsNaN
        | IsInf { .. }
        | BitwiseNot => return None,
    })
}

/// Applies one of the family's unary ops.
pub(crate) fn unary(ctx: &CudaContext, u: UnaryOp, x: &CudaTensor) -> Result<CudaTensor, Error> {
    let op = ir::unary_name(u);
    let n = x.numel();
    let n64 = n as i64;
    let fam = Family::Activation;
    let buf = match u {
        UnaryOp::BitwiseNot => {
            let v = x.i64s(op)?;
            let mut out = ctx.alloc::<i64>(op, n)?;
            if n > 0 {
                launch!(ctx, op, fam, "bitwise_not_i64", grid(n); &mut out.s, &v.s, &n64)?;
            }
            Buf::I64(out)
        }
        UnaryOp::IsNaN | UnaryOp::IsInf { .. } => {
            let v = x.f32s(op)?;
            let (nan, neg, pos) = match u {
                UnaryOp::IsInf { negative, positive } => (0i32, negative as i32, positive as i32),
                _ => (1, 0, 0),
            };
            let mut out = ctx.alloc::<u8>(op, n)?;
            if n > 0 {
                launch!(ctx, op, fam, "act_test_f32", grid(n); &mut out.s, &v.s, &n64, &nan, &neg, &pos)?;
            }
            return Ok(CudaTensor::new(TensorMeta::new(DType::Bool, x.shape().to_vec()), Buf::Bool(out)));
        }
        _ => {
            let (code, a, b) = act_code(u).ok_or_else(|| bad(op, "not an op of the activation family".into()))?;
            let v = x.f32s(op)?;
            let mut out = ctx.alloc::<f32>(op, n)?;
            if n > 0 {
                launch!(ctx, op, fam, "act_f32", grid(n); &mut out.s, &v.s, &n64, &code, &a, &b)?;
            }
            Buf::F32(out)
        }
    };
    Ok(CudaTensor::new(x.meta().clone(), buf))
}

/// `dx = dy * f'(x)` for the family's differentiable ops.
pub(crate) fn unary_grad(ctx: &CudaContext, u: UnaryOp, x: &CudaTensor, dy: &CudaTensor) -> Result<CudaTensor, Error> {
    let op = ir::unary_grad_name(u);
    let (xv, dv) = (x.f32s(op)?, dy.f32s(op)?);
    let (code, a, b) = act_code(u)
        .filter(|_| ir::unary_differentiable(u))
        .ok_or_else(|| bad(op, "op has no gradient kernel".into()))?;
    let n = x.numel();
    let mut out = ctx.alloc::<f32>(op, n)?;
    if n > 0 {
        let n64 = n as i64;
        launch!(ctx, op, Family::Activation, "act_grad_f32", grid(n); &mut out.s, &xv.s, &dv.s, &n64, &code, &a, &b)?;
    }
    Ok(CudaTensor::from_f32(x.shape(), out))
}

/// PRelu (f32) or a bitwise op (i64) with numpy broadcasting to `out_shape`.
pub(crate) fn binary(
    ctx: &CudaContext,
    b: BinaryOp,
    x: &CudaTensor,
    y: &CudaTensor,
    out_shape: &[usize],
) -> Result<CudaTensor, Error> {
    let op = ir::binary_name(b);
    let n: usize = out_shape.iter().product();
    let n64 = n as i64;
    let r = out_shape.len();
    let (sx, sy) = (broadcast_strides(x.shape(), r), broadcast_strides(y.shape(), r));
    let s = Strided::new(op, out_shape, &[(0, &sx), (0, &sy)])?;
    let fam = Family::Activation;
    let buf = if b == BinaryOp::PRelu {
        let (p, q) = (x.f32s(op)?, y.f32s(op)?);
        let mut out = ctx.alloc::<f32>(op, n)?;
        if n > 0 {
            launch!(ctx, op, fam, "prelu_f32", grid(n); &mut out.s, &p.s, &q.s, &s, &n64)?;
        }
        Buf::F32(out)
    } else {
        let code: i32 = match b {
            BinaryOp::BitwiseAnd => 0,
            BinaryOp::BitwiseOr => 1,
            BinaryOp::BitwiseXor => 2,
            // Every kind is named (no wildcard): PRelu is handled above, the rest are not this file's.
            BinaryOp::Add
            | BinaryOp::Sub
            | BinaryOp::Mul
            | BinaryOp::Div
            | BinaryOp::Pow
            | BinaryOp::Max
            | BinaryOp::Min
            | BinaryOp::Equal
            | BinaryOp::Less
            | BinaryOp::LessOrEqual
            | BinaryOp::Greater
            | BinaryOp::GreaterOrEqual
            | BinaryOp::And
            | BinaryOp::Or
            | BinaryOp::Xor
            | BinaryOp::PRelu
            | BinaryOp::Mod
            | BinaryOp::Fmod => return Err(bad(op, "not an op of the activation family".into())),
        };
        let (p, q) = (x.i64s(op)?, y.i64s(op)?);
        let mut out = ctx.alloc::<i64>(op, n)?;
        if n > 0 {
            launch!(ctx, op, fam, "bitwise_i64", grid(n); &mut out.s, &p.s, &q.s, &s, &n64, &code)?;
        }
        Buf::I64(out)
    };
    Ok(CudaTensor::new(TensorMeta::new(x.dtype(), out_shape.to_vec()), buf))
}

/// One-hot of the first maximum along `axis`.
pub(crate) fn hardmax(ctx: &CudaContext, x: &CudaTensor, axis: usize) -> Result<CudaTensor, Error> {
    let op = "hardmax";
    let v = x.f32s(op)?;
    let s = x.shape();
    if axis >= s.len() {
        return Err(bad(op, format!("axis {axis} out of range for {s:?}")));
    }
    let (outer, len, inner): (usize, usize, usize) =
        (s[..axis].iter().product(), s[axis], s[axis + 1..].iter().product());
    let mut out = ctx.alloc::<f32>(op, x.numel())?;
    if x.numel() > 0 {
        let a = [outer, len, inner].map(|v| v as i64);
        launch!(ctx, op, Family::Activation, "hardmax_f32", grid(outer * inner); &mut out.s, &v.s, &a[0], &a[1], &a[2])?;
    }
    Ok(CudaTensor::from_f32(s, out))
}
