//! Unary, binary (numpy broadcasting through strided indices), `Where` and `Cast`, with the
//! CPU kernels' exact rules: NaN-propagating max/min, wrapping i64 arithmetic, i64 division
//! truncating toward zero, saturating f32 -> i64 casts.

use super::device::{CudaContext, Family, Strided, broadcast_strides, grid};
use super::tensor::{Buf, CudaTensor};
use crate::Error;
use ir::{BinaryOp, DType, TensorMeta, UnaryOp};

pub(crate) const SRC: &str = r#"
__device__ __forceinline__ float sigmoid_f(float x) {
    if (x >= 0.f) return 1.f / (1.f + expf(-x));
    float e = expf(x);
    return e / (1.f + e);
}
__device__ __forceinline__ float gelu_f(float x) { return 0.5f * x * erfcf(-x * 0.70710678118654752f); }
__device__ __forceinline__ float gelu_tanh_f(float x) {
    const float C = 0.7978846f;
    return 0.5f * x * (1.f + tanhf(C * (x + 0.044715f * x * x * x)));
}

// 16-bit floats are stored as their bits (unsigned short) and computed in f32: these convert,
// rounding to nearest even as the CPU (the `half` crate) does.
__device__ __forceinline__ float bf16_to_f32(unsigned short h) { return __int_as_float((int)((unsigned int)h << 16)); }
__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
    unsigned int b = (unsigned int)__float_as_int(f);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((b >> 16) | 0x40u);
    return (unsigned short)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ float f16_to_f32(unsigned short h) {
    unsigned int sign = ((unsigned int)h & 0x8000u) << 16;
    unsigned int e = ((unsigned int)h >> 10) & 0x1fu;
    unsigned int m = (unsigned int)h & 0x3ffu;
    if (e == 0) {
        float v = (float)m * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    if (e == 31) return __int_as_float((int)(sign | 0x7f800000u | (m << 13)));
    return __int_as_float((int)(sign | ((e + 112u) << 23) | (m << 13)));
}
__device__ __forceinline__ unsigned short f32_to_f16(float f) {
    unsigned int x = (unsigned int)__float_as_int(f);
    unsigned int sign = (x >> 16) & 0x8000u;
    unsigned int ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (unsigned short)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
    if (ax >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);
    if (ax < 0x38800000u) {
        float q = __int_as_float((int)ax) * 16777216.0f;
        return (unsigned short)(sign | (unsigned int)rintf(q));
    }
    unsigned int r = ax - 0x38000000u;
    r = r + 0xfffu + ((r >> 13) & 1u);
    return (unsigned short)(sign | (r >> 13));
}
extern "C" __global__ void widen_bf16(float* out, const unsigned short* x, i64 n) {
    FOR_EACH(i, n) { out[i] = bf16_to_f32(x[i]); }
}
extern "C" __global__ void widen_f16(float* out, const unsigned short* x, i64 n) {
    FOR_EACH(i, n) { out[i] = f16_to_f32(x[i]); }
}
extern "C" __global__ void narrow_bf16(unsigned short* out, const float* x, i64 n) {
    FOR_EACH(i, n) { out[i] = f32_to_bf16(x[i]); }
}
extern "C" __global__ void narrow_f16(unsigned short* out, const float* x, i64 n) {
    FOR_EACH(i, n) { out[i] = f32_to_f16(x[i]); }
}

extern "C" __global__ void unary_f32(float* out, const float* x, i64 n, int code) {
    FOR_EACH(i, n) {
        float v = x[i];
        float r;
        switch (code) {
            case 0: r = (v > 0.f || is_nan(v)) ? v : 0.f; break;
            case 1: r = gelu_f(v); break;
            case 2: r = gelu_tanh_f(v); break;
            case 3: r = tanhf(v); break;
            case 4: r = erff(v); break;
            case 5: r = sigmoid_f(v); break;
            case 6: r = expf(v); break;
            case 7: r = logf(v); break;
            case 8: r = sqrtf(v); break;
            case 9: r = -v; break;
            case 10: r = 1.f / v; break;
            case 11: r = fabsf(v); break;
            case 12: r = floorf(v); break;
            case 13: r = ceilf(v); break;
            case 14: r = sinf(v); break;
            case 15: r = cosf(v); break;
            default: r = v > 0.f ? 1.f : (v < 0.f ? -1.f : v); break;
        }
        out[i] = r;
    }
}

extern "C" __global__ void unary_i64(i64* out, const i64* x, i64 n, int code) {
    FOR_EACH(i, n) {
        i64 v = x[i];
        i64 r;
        switch (code) {
            case 0: r = wrap_sub(0, v); break;
            case 1: r = v < 0 ? wrap_sub(0, v) : v; break;
            default: r = v > 0 ? 1 : (v < 0 ? -1 : 0); break;
        }
        out[i] = r;
    }
}

extern "C" __global__ void not_u8(u8* out, const u8* x, i64 n) {
    FOR_EACH(i, n) { out[i] = x[i] ? 0 : 1; }
}

__device__ __forceinline__ float pow_f(float a, float b) {
    if (b == 2.f) return a * a;
    if (b == 3.f) return a * a * a;
    if (b == 1.f) return a;
    if (b == 0.5f) return sqrtf(a);
    return powf(a, b);
}

// Wrapping power; negative exponents truncate toward zero like 1 / a^-b.
__device__ i64 pow_i(i64 a, i64 b) {
    if (b < 0) {
        if (a == 1) return 1;
        if (a == -1) return (b % 2 == 0) ? 1 : -1;
        return 0;
    }
    i64 base = a, acc = 1;
    u64 e = (u64)b;
    while (e > 0) {
        if (e & 1) acc = wrap_mul(acc, base);
        base = wrap_mul(base, base);
        e >>= 1;
    }
    return acc;
}

extern "C" __global__ void binary_f32(float* out, const float* a, const float* b, Strided s, i64 n, int code) {
    FOR_EACH(i, n) {
        i64 o[2];
        offsets(s, 2, i, o);
        float x = a[o[0]], y = b[o[1]];
        float r;
        switch (code) {
            case 0: r = x + y; break;
            case 1: r = x - y; break;
            case 2: r = x * y; break;
            case 3: r = x / y; break;
            case 4: r = pow_f(x, y); break;
            case 5: r = nan_max(x, y); break;
            case 6: r = nan_min(x, y); break;
            // Remainders: C's (fmod, 8) and the divisor's sign (mod, 7).
            default: {
                float m = fmodf(x, y);
                r = (code == 7 && m != 0.f && ((m < 0.f) != (y < 0.f))) ? m + y : m;
                break;
            }
        }
        out[i] = r;
    }
}

// The caller has checked that no divisor is 0.
extern "C" __global__ void binary_i64(i64* out, const i64* a, const i64* b, Strided s, i64 n, int code) {
    FOR_EACH(i, n) {
        i64 o[2];
        offsets(s, 2, i, o);
        i64 x = a[o[0]], y = b[o[1]];
        i64 r;
        switch (code) {
            case 0: r = wrap_add(x, y); break;
            case 1: r = wrap_sub(x, y); break;
            case 2: r = wrap_mul(x, y); break;
            case 3: r = (y == -1) ? wrap_sub(0, x) : x / y; break;
            case 4: r = pow_i(x, y); break;
            case 5: r = x > y ? x : y; break;
            case 6: r = x < y ? x : y; break;
            // Remainders: C's (fmod, 8) and the divisor's sign (mod, 7); y == -1 cannot overflow.
            default: {
                i64 m = (y == -1) ? 0 : x % y;
                r = (code == 7 && m != 0 && ((m < 0) != (y < 0))) ? wrap_add(m, y) : m;
                break;
            }
        }
        out[i] = r;
    }
}

#define COMPARE(NAME, T) \
extern "C" __global__ void NAME(u8* out, const T* a, const T* b, Strided s, i64 n, int code) { \
    FOR_EACH(i, n) { \
        i64 o[2]; \
        offsets(s, 2, i, o); \
        T x = a[o[0]], y = b[o[1]]; \
        bool r; \
        switch (code) { \
            case 0: r = x == y; break; \
            case 1: r = x < y; break; \
            case 2: r = x <= y; break; \
            case 3: r = x > y; break; \
            default: r = x >= y; break; \
        } \
        out[i] = r ? 1 : 0; \
    } \
}
COMPARE(compare_f32, float)
COMPARE(compare_i64, i64)

extern "C" __global__ void binary_u8(u8* out, const u8* a, const u8* b, Strided s, i64 n, int code) {
    FOR_EACH(i, n) {
        i64 o[2];
        offsets(s, 2, i, o);
        u8 x = a[o[0]] != 0, y = b[o[1]] != 0;
        u8 r;
        switch (code) {
            case 0: r = x == y; break;
            case 1: r = x & y; break;
            case 2: r = x | y; break;
            default: r = x ^ y; break;
        }
        out[i] = r;
    }
}

#define WHERE(NAME, T) \
extern "C" __global__ void NAME(T* out, const u8* c, const T* a, const T* b, Strided s, i64 n) { \
    FOR_EACH(i, n) { \
        i64 o[3]; \
        offsets(s, 3, i, o); \
        out[i] = c[o[0]] ? a[o[1]] : b[o[2]]; \
    } \
}
WHERE(where_f32, float)
WHERE(where_i64, i64)
WHERE(where_u8, u8)

__device__ __forceinline__ i64 f32_to_i64(float x) {
    if (is_nan(x)) return 0;
    if (x >= 9.2233720368547758e18f) return (i64)0x7fffffffffffffffLL;
    if (x <= -9.2233720368547758e18f) return (i64)0x8000000000000000ULL;
    return (i64)x;
}
extern "C" __global__ void cast_f32_i64(i64* out, const float* x, i64 n) { FOR_EACH(i, n) { out[i] = f32_to_i64(x[i]); } }
extern "C" __global__ void cast_f32_u8(u8* out, const float* x, i64 n) { FOR_EACH(i, n) { out[i] = x[i] != 0.f; } }
extern "C" __global__ void cast_i64_f32(float* out, const i64* x, i64 n) { FOR_EACH(i, n) { out[i] = (float)x[i]; } }
extern "C" __global__ void cast_i64_u8(u8* out, const i64* x, i64 n) { FOR_EACH(i, n) { out[i] = x[i] != 0; } }
extern "C" __global__ void cast_u8_f32(float* out, const u8* x, i64 n) { FOR_EACH(i, n) { out[i] = x[i] ? 1.f : 0.f; } }
extern "C" __global__ void cast_u8_i64(i64* out, const u8* x, i64 n) { FOR_EACH(i, n) { out[i] = x[i] ? 1 : 0; } }

// Sets *flag when some element is 0 (every writer writes the same value).
extern "C" __global__ void any_zero_i64(int* flag, const i64* x, i64 n) {
    FOR_EACH(i, n) { if (x[i] == 0) *flag = 1; }
}
"#;

fn bad(op: &'static str, message: &str) -> Error {
    Error::BadInput { op, message: message.to_string() }
}

fn unary_code(u: UnaryOp) -> i32 {
    use UnaryOp::*;
    match u {
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
        Floor => 12,
        Ceil => 13,
        Sin => 14,
        Cos => 15,
        Sign => 16,
        // Every kind is named (no wildcard): the activations are sent to their own file, and `not` has a bool kernel.
        Not
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
        | BitwiseNot => -1,
    }
}

/// Applies a unary op.
pub(crate) fn unary(ctx: &CudaContext, u: UnaryOp, x: &CudaTensor) -> Result<CudaTensor, Error> {
    if ir::ops::activation::is_activation(u) {
        return super::activation::unary(ctx, u, x);
    }
    let op = ir::unary_name(u);
    let n = x.numel();
    let n64 = n as i64;
    let fam = Family::Elementwise;
    let buf = match (x.buf(), u) {
        (Buf::F32(v), _) if u != UnaryOp::Not => {
            let mut out = ctx.alloc::<f32>(op, n)?;
            let code = unary_code(u);
            if n > 0 {
                launch!(ctx, op, fam, "unary_f32", grid(n); &mut out.s, &v.s, &n64, &code)?;
            }
            Buf::F32(out)
        }
        (Buf::I64(v), UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Sign) => {
            let mut out = ctx.alloc::<i64>(op, n)?;
            let code: i32 = match u {
                UnaryOp::Neg => 0,
                UnaryOp::Abs => 1,
                _ => 2,
            };
            if n > 0 {
                launch!(ctx, op, fam, "unary_i64", grid(n); &mut out.s, &v.s, &n64, &code)?;
            }
            Buf::I64(out)
        }
        (Buf::Bool(v), UnaryOp::Not) => {
            let mut out = ctx.alloc::<u8>(op, n)?;
            if n > 0 {
                launch!(ctx, op, fam, "not_u8", grid(n); &mut out.s, &v.s, &n64)?;
            }
            Buf::Bool(out)
        }
        _ => return Err(bad(op, &format!("no kernel for {}", x.dtype()))),
    };
    Ok(CudaTensor::new(x.meta().clone(), buf))
}

fn binary_code(b: BinaryOp) -> i32 {
    use BinaryOp::*;
    match b {
        Add | Equal => 0,
        Sub | Less | And => 1,
        Mul | LessOrEqual | Or => 2,
        Div | Greater | Xor => 3,
        Pow | GreaterOrEqual => 4,
        Max => 5,
        Min => 6,
        PRelu | BitwiseAnd | BitwiseOr | BitwiseXor => -1,
        Mod => 7,
        Fmod => 8,
    }
}

/// True when some element of an i64 tensor is 0 (reads one flag back: synchronises).
pub(crate) fn any_zero_i64(ctx: &CudaContext, op: &'static str, x: &CudaTensor) -> Result<bool, Error> {
    let n = x.numel();
    if n == 0 {
        return Ok(false);
    }
    let v = x.i64s(op)?;
    let mut flag = ctx.zeros::<i32>(op, 1)?;
    let n64 = n as i64;
    launch!(ctx, op, Family::Elementwise, "any_zero_i64", grid(n); &mut flag.s, &v.s, &n64)?;
    Ok(ctx.download_slice(op, &flag, 1)?[0] != 0)
}

/// Applies a binary op with numpy broadcasting to `out_shape`.
pub(crate) fn binary(
    ctx: &CudaContext,
    b: BinaryOp,
    x: &CudaTensor,
    y: &CudaTensor,
    out_shape: &[usize],
) -> Result<CudaTensor, Error> {
    if b == BinaryOp::PRelu || b.is_bitwise() {
        return super::activation::binary(ctx, b, x, y, out_shape);
    }
    let op = ir::binary_name(b);
    let n: usize = out_shape.iter().product();
    let n64 = n as i64;
    let r = out_shape.len();
    let (sx, sy) = (broadcast_strides(x.shape(), r), broadcast_strides(y.shape(), r));
    let s = Strided::new(op, out_shape, &[(0, &sx), (0, &sy)])?;
    let code = binary_code(b);
    let fam = Family::Elementwise;
    let cfg = grid(n);
    let buf = match (x.buf(), y.buf()) {
        (Buf::F32(p), Buf::F32(q)) if !b.is_logical() => {
            if b.is_comparison() {
                let mut out = ctx.alloc::<u8>(op, n)?;
                if n > 0 {
                    launch!(ctx, op, fam, "compare_f32", cfg; &mut out.s, &p.s, &q.s, &s, &n64, &code)?;
                }
                Buf::Bool(out)
            } else {
                let mut out = ctx.alloc::<f32>(op, n)?;
                if n > 0 {
                    launch!(ctx, op, fam, "binary_f32", cfg; &mut out.s, &p.s, &q.s, &s, &n64, &code)?;
                }
                Buf::F32(out)
            }
        }
        (Buf::I64(p), Buf::I64(q)) if !b.is_logical() => {
            if b.is_comparison() {
                let mut out = ctx.alloc::<u8>(op, n)?;
                if n > 0 {
                    launch!(ctx, op, fam, "compare_i64", cfg; &mut out.s, &p.s, &q.s, &s, &n64, &code)?;
                }
                Buf::Bool(out)
            } else {
                if matches!(b, BinaryOp::Div | BinaryOp::Mod | BinaryOp::Fmod) && any_zero_i64(ctx, op, y)? {
                    return Err(bad(op, "integer division by zero"));
                }
                let mut out = ctx.alloc::<i64>(op, n)?;
                if n > 0 {
                    launch!(ctx, op, fam, "binary_i64", cfg; &mut out.s, &p.s, &q.s, &s, &n64, &code)?;
                }
                Buf::I64(out)
            }
        }
        (Buf::Bool(p), Buf::Bool(q)) => {
            if !(b.is_logical() || b == BinaryOp::Equal) {
                return Err(bad(op, "arithmetic and ordering ops take numeric inputs"));
            }
            let mut out = ctx.alloc::<u8>(op, n)?;
            if n > 0 {
                launch!(ctx, op, fam, "binary_u8", cfg; &mut out.s, &p.s, &q.s, &s, &n64, &code)?;
            }
            Buf::Bool(out)
        }
        (Buf::F32(_), Buf::F32(_)) | (Buf::I64(_), Buf::I64(_)) => {
            return Err(bad(op, "logical ops take bool inputs"));
        }
        _ => return Err(bad(op, &format!("input dtypes differ ({} vs {})", x.dtype(), y.dtype()))),
    };
    let dtype = if b.is_comparison() { DType::Bool } else { x.dtype() };
    Ok(CudaTensor::new(TensorMeta::new(dtype, out_shape.to_vec()), buf))
}

/// `cond ? a : b` with broadcasting of all three.
pub(crate) fn where_(
    ctx: &CudaContext,
    c: &CudaTensor,
    x: &CudaTensor,
    y: &CudaTensor,
    out_shape: &[usize],
) -> Result<CudaTensor, Error> {
    let op = "where";
    let cb = c.bools(op)?;
    let n: usize = out_shape.iter().product();
    let n64 = n as i64;
    let r = out_shape.len();
    let (sc, sx, sy) =
        (broadcast_strides(c.shape(), r), broadcast_strides(x.shape(), r), broadcast_strides(y.shape(), r));
    let s = Strided::new(op, out_shape, &[(0, &sc), (0, &sx), (0, &sy)])?;
    let fam = Family::Elementwise;
    let cfg = grid(n);
    let buf = match (x.buf(), y.buf()) {
        (Buf::F32(p), Buf::F32(q)) => {
            let mut out = ctx.alloc::<f32>(op, n)?;
            if n > 0 {
                launch!(ctx, op, fam, "where_f32", cfg; &mut out.s, &cb.s, &p.s, &q.s, &s, &n64)?;
            }
            Buf::F32(out)
        }
        (Buf::I64(p), Buf::I64(q)) => {
            let mut out = ctx.alloc::<i64>(op, n)?;
            if n > 0 {
                launch!(ctx, op, fam, "where_i64", cfg; &mut out.s, &cb.s, &p.s, &q.s, &s, &n64)?;
            }
            Buf::I64(out)
        }
        (Buf::Bool(p), Buf::Bool(q)) => {
            let mut out = ctx.alloc::<u8>(op, n)?;
            if n > 0 {
                launch!(ctx, op, fam, "where_u8", cfg; &mut out.s, &cb.s, &p.s, &q.s, &s, &n64)?;
            }
            Buf::Bool(out)
        }
        _ => return Err(bad(op, "branch dtypes differ")),
    };
    Ok(CudaTensor::new(TensorMeta::new(x.dtype(), out_shape.to_vec()), buf))
}

/// Converts element types with the CPU's rules: f32 -> i64 truncates toward zero (saturating,
/// NaN -> 0), anything -> bool is `!= 0`, bool -> number is 0/1.
pub(crate) fn cast(ctx: &CudaContext, x: &CudaTensor, to: DType) -> Result<CudaTensor, Error> {
    let op = "cast";
    if x.dtype() == to {
        return Ok(x.clone());
    }
    // 16-bit floats go through f32.
    if x.dtype().is_half() {
        return cast(ctx, &widen(ctx, x)?, to);
    }
    if to.is_half() {
        let wide = if x.dtype() == DType::F32 { x.clone() } else { cast(ctx, x, DType::F32)? };
        return narrow(ctx, &wide, to);
    }
    let n = x.numel();
    let n64 = n as i64;
    let fam = Family::Elementwise;
    let cfg = grid(n);
    macro_rules! conv {
        ($src:expr, $t:ty, $variant:ident, $name:literal) => {{
            let mut out = ctx.alloc::<$t>(op, n)?;
            if n > 0 {
                launch!(ctx, op, fam, $name, cfg; &mut out.s, &$src.s, &n64)?;
            }
            Buf::$variant(out)
        }};
    }
    let buf = match (x.buf(), to) {
        (Buf::F32(v), DType::I64) => conv!(v, i64, I64, "cast_f32_i64"),
        (Buf::F32(v), DType::Bool) => conv!(v, u8, Bool, "cast_f32_u8"),
        (Buf::I64(v), DType::F32) => conv!(v, f32, F32, "cast_i64_f32"),
        (Buf::I64(v), DType::Bool) => conv!(v, u8, Bool, "cast_i64_u8"),
        (Buf::Bool(v), DType::F32) => conv!(v, f32, F32, "cast_u8_f32"),
        (Buf::Bool(v), DType::I64) => conv!(v, i64, I64, "cast_u8_i64"),
        _ => return Ok(x.clone()),
    };
    Ok(CudaTensor::new(TensorMeta::new(to, x.shape().to_vec()), buf))
}

/// A 16-bit float tensor's values in f32 (exact); any other tensor as it is.
pub(crate) fn widen(ctx: &CudaContext, x: &CudaTensor) -> Result<CudaTensor, Error> {
    let op = "widen";
    let Buf::Half(bits) = x.buf() else { return Ok(x.clone()) };
    let n = x.numel();
    let mut out = ctx.alloc::<f32>(op, n)?;
    if n > 0 {
        let name = if x.dtype() == DType::BF16 { "widen_bf16" } else { "widen_f16" };
        let n64 = n as i64;
        launch!(ctx, op, Family::Elementwise, name, grid(n); &mut out.s, &bits.s, &n64)?;
    }
    Ok(CudaTensor::from_f32(x.shape(), out))
}

/// An f32 tensor rounded to the 16-bit float type `to` (to nearest, ties to even).
pub(crate) fn narrow(ctx: &CudaContext, x: &CudaTensor, to: DType) -> Result<CudaTensor, Error> {
    let op = "narrow";
    let src = x.f32s(op)?;
    let n = x.numel();
    let mut out = ctx.alloc::<u8>(op, 2 * n)?;
    if n > 0 {
        let name = if to == DType::BF16 { "narrow_bf16" } else { "narrow_f16" };
        let n64 = n as i64;
        launch!(ctx, op, Family::Elementwise, name, grid(n); &mut out.s, &src.s, &n64)?;
    }
    Ok(CudaTensor::new(TensorMeta::new(to, x.shape().to_vec()), Buf::Half(out)))
}
