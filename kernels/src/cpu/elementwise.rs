//! Unary, binary (numpy broadcasting), `Where` and `Cast`.

use super::{CpuContext, floats, tensor};
use super::{F, Float};
use crate::Error;
use ir::{BinaryOp, DType, Data, Tensor, UnaryOp};

/// A broadcast view: for each input, its stride along every (collapsed) output dim; 0 where the
/// input is broadcast.
pub(crate) struct Broadcast {
    /// Collapsed output dims (at least one).
    pub dims: Vec<usize>,
    /// Per input, one stride per collapsed dim.
    pub strides: Vec<Vec<usize>>,
}

impl Broadcast {
    /// Views inputs of `shapes` broadcast to `out`, merging adjacent dims that every input walks
    /// contiguously (so `[B,S,H] + [H]` becomes `[B*S, H]` with strides `[0, 1]`).
    pub fn new(shapes: &[&[usize]], out: &[usize]) -> Broadcast {
        let r = out.len();
        let full: Vec<Vec<usize>> = shapes
            .iter()
            .map(|s| {
                let mut st = vec![0; r];
                let mut acc = 1;
                for i in (0..s.len()).rev() {
                    let o = i + r - s.len();
                    st[o] = if s[i] == 1 { 0 } else { acc };
                    acc *= s[i];
                }
                st
            })
            .collect();
        let mut dims: Vec<usize> = Vec::new();
        let mut strides: Vec<Vec<usize>> = vec![Vec::new(); shapes.len()];
        for d in 0..r {
            if out[d] == 1 {
                continue;
            }
            let mergeable = !dims.is_empty()
                && full.iter().zip(&strides).all(|(f, s)| {
                    let last = *s.last().expect("non-empty with dims");
                    last == f[d] * out[d]
                });
            if mergeable {
                *dims.last_mut().expect("non-empty") *= out[d];
                for (s, f) in strides.iter_mut().zip(&full) {
                    *s.last_mut().expect("non-empty") = f[d];
                }
            } else {
                dims.push(out[d]);
                for (s, f) in strides.iter_mut().zip(&full) {
                    s.push(f[d]);
                }
            }
        }
        if dims.is_empty() {
            dims.push(1);
            for s in &mut strides {
                s.push(0);
            }
        }
        Broadcast { dims, strides }
    }

    /// Length of the innermost (collapsed) dim: one row of output.
    pub fn row_len(&self) -> usize {
        *self.dims.last().expect("at least one dim")
    }

    /// Offset of row `r` (index over all dims but the last) in input `i`.
    pub fn row_offset(&self, i: usize, mut r: usize) -> usize {
        let st = &self.strides[i];
        let mut off = 0;
        for d in (0..self.dims.len() - 1).rev() {
            off += (r % self.dims[d]) * st[d];
            r /= self.dims[d];
        }
        off
    }

    /// Calls `f(row, start, segment)` for pieces of rows covering `out` (the output of this
    /// broadcast): `segment` is `out[row * row_len + start..][..segment.len()]` and never crosses a
    /// row. Long rows are cut so that the work splits over the pool even when there is one row.
    pub fn for_segments<T: Send>(
        &self,
        ctx: &CpuContext,
        out: &mut [T],
        f: impl Fn(usize, usize, &mut [T]) + Sync + Send,
    ) {
        const BLOCK: usize = 8192;
        let len = self.row_len();
        if len == 0 || out.is_empty() {
            return;
        }
        ctx.for_rows(out, BLOCK.min(out.len()), |b, block| {
            let mut pos = b * BLOCK;
            let mut rest = block;
            while !rest.is_empty() {
                let (r, j) = (pos / len, pos % len);
                let take = (len - j).min(rest.len());
                let (seg, tail) = rest.split_at_mut(take);
                f(r, j, seg);
                rest = tail;
                pos += take;
            }
        })
    }

    /// Stride of input `i` along the row.
    pub fn inner_stride(&self, i: usize) -> usize {
        *self.strides[i].last().expect("at least one dim")
    }
}

/// `f(a, b)` elementwise with numpy broadcasting to `out_shape`.
pub(crate) fn map2<A, B, O>(
    ctx: &CpuContext,
    a: &[A],
    ash: &[usize],
    b: &[B],
    bsh: &[usize],
    out_shape: &[usize],
    f: impl Fn(A, B) -> O + Sync + Send,
) -> Vec<O>
where
    A: Copy + Sync,
    B: Copy + Sync,
    O: Copy + Send + Default,
{
    let n: usize = out_shape.iter().product();
    let mut out = vec![O::default(); n];
    if n == 0 {
        return out;
    }
    let bc = Broadcast::new(&[ash, bsh], out_shape);
    let (sa, sb) = (bc.inner_stride(0), bc.inner_stride(1));
    bc.for_segments(ctx, &mut out, |r, j, seg| {
        let (oa, ob) = (bc.row_offset(0, r) + j * sa, bc.row_offset(1, r) + j * sb);
        let len = seg.len();
        match (sa, sb) {
            (1, 1) => {
                for ((o, &x), &y) in seg.iter_mut().zip(&a[oa..oa + len]).zip(&b[ob..ob + len]) {
                    *o = f(x, y);
                }
            }
            (1, 0) => {
                let y = b[ob];
                for (o, &x) in seg.iter_mut().zip(&a[oa..oa + len]) {
                    *o = f(x, y);
                }
            }
            (0, 1) => {
                let x = a[oa];
                for (o, &y) in seg.iter_mut().zip(&b[ob..ob + len]) {
                    *o = f(x, y);
                }
            }
            _ => {
                for (k, o) in seg.iter_mut().enumerate() {
                    *o = f(a[oa + k * sa], b[ob + k * sb]);
                }
            }
        }
    });
    out
}

/// Applies a unary op.
pub(crate) fn unary(ctx: &CpuContext, u: UnaryOp, x: &Tensor) -> Result<Tensor, Error> {
    if ir::ops::activation::is_activation(u) {
        return super::activation::unary(ctx, u, x);
    }
    let op = ir::unary_name(u);
    if let Some(v) = F::view(x) {
        return tensor(op, x.shape(), F::data(float_unary(ctx, op, u, v)?));
    }
    let data = match (x.data(), u) {
        (Data::I64(v), UnaryOp::Neg) => Data::I64(v.iter().map(|x| x.wrapping_neg()).collect()),
        (Data::I64(v), UnaryOp::Abs) => Data::I64(v.iter().map(|x| x.wrapping_abs()).collect()),
        (Data::I64(v), UnaryOp::Sign) => Data::I64(v.iter().map(|x| x.signum()).collect()),
        (Data::Bool(v), UnaryOp::Not) => Data::Bool(v.iter().map(|x| !x).collect()),
        (d, _) => return Err(bad(op, &format!("no kernel for {}", d.dtype()))),
    };
    tensor(op, x.shape(), data)
}

/// [`unary`] on the elements of a float tensor of this module's type.
fn float_unary(ctx: &CpuContext, op: &'static str, u: UnaryOp, v: &[F]) -> Result<Vec<F>, Error> {
    let mut out = vec![0.0; v.len()];
    let weight = match u {
        UnaryOp::Relu | UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Floor | UnaryOp::Ceil | UnaryOp::Sign => 1,
        _ => 8,
    };
    macro_rules! apply {
        ($f:expr) => {{
            let f = $f;
            ctx.for_rows_weighted(&mut out, 4096.min(v.len().max(1)), weight, |r, row| {
                let src = &v[r * 4096..r * 4096 + row.len()];
                with_simd(|| {
                    for (o, &x) in row.iter_mut().zip(src) {
                        *o = f(x);
                    }
                })
            })
        }};
    }
    match u {
        UnaryOp::Relu => apply!(|x: F| if x > 0.0 || x.is_nan() { x } else { 0.0 }),
        UnaryOp::Gelu => apply!(gelu),
        UnaryOp::GeluTanh => apply!(gelu_tanh),
        UnaryOp::Tanh => apply!(tanh),
        UnaryOp::Erf => apply!(Float::erf),
        UnaryOp::Sigmoid => apply!(sigmoid),
        UnaryOp::Exp => apply!(F::exp),
        UnaryOp::Log => apply!(F::ln),
        UnaryOp::Sqrt => apply!(F::sqrt),
        UnaryOp::Neg => apply!(|x: F| -x),
        UnaryOp::Reciprocal => apply!(|x: F| 1.0 / x),
        UnaryOp::Abs => apply!(F::abs),
        UnaryOp::Floor => apply!(F::floor),
        UnaryOp::Ceil => apply!(F::ceil),
        UnaryOp::Sin => apply!(F::sin),
        UnaryOp::Cos => apply!(F::cos),
        UnaryOp::Sign => apply!(|x: F| if x > 0.0 {
            1.0
        } else if x < 0.0 {
            -1.0
        } else {
            x
        }),
        UnaryOp::Not => return Err(bad(op, "not takes bool")),
        // Every kind is named (no wildcard); `unary` sends the activations to their own file.
        UnaryOp::HardSigmoid { .. }
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
        | UnaryOp::BitwiseNot => return Err(bad(op, "an activation reached the basic unary kernel")),
    }
    Ok(out)
}

/// x·Φ(x) with the exact normal CDF, written with erfc so the negative tail keeps its relative
/// accuracy (`1 + erf(x)` cancels there).
pub(crate) fn gelu(x: F) -> F {
    0.5 * x * Float::erfc(-x * super::consts::FRAC_1_SQRT_2)
}

/// The tanh approximation of GELU.
pub(crate) fn gelu_tanh(x: F) -> F {
    const C: F = F::SQRT_2_OVER_PI;
    0.5 * x * (1.0 + tanh(C * (x + 0.044715 * x * x * x)))
}

/// tanh, branch-free for f32 (see [`Float::tanh_fast`]).
#[inline(always)]
pub(crate) fn tanh(x: F) -> F {
    Float::tanh_fast(x)
}

/// `e^x`, branch-free for f32 (see [`Float::exp_fast`]).
#[inline(always)]
pub(crate) fn exp_fast(x: F) -> F {
    Float::exp_fast(x)
}

/// Runs `f` compiled for AVX2 and FMA when the CPU has them (the loops `f` inlines then vectorise
/// 8 lanes wide; the build's baseline is SSE2), on the same arithmetic either way.
#[inline(always)]
pub(crate) fn with_simd<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has the features the function is compiled for.
            return unsafe { avx2(f) };
        }
    }
    f()
}

/// 1 / (1 + e^-x), branch-free so that loops over it vectorise ([`exp_fast`]). In f32, e^-x
/// overflows to +inf below x of about -88.4 and the result is 0 (the exact one is under 1e-38;
/// in f64 the same below about -709.8); NaN stays NaN. Through libm's `exp` and a branch per sign it
/// cost 7 ns an element (EfficientNet's SiLUs were a sixth of its step).
#[inline(always)]
pub(crate) fn sigmoid(x: F) -> F {
    1.0 / (1.0 + exp_fast(-x))
}

fn bad(op: &'static str, message: &str) -> Error {
    Error::BadInput { op, message: message.to_string() }
}

fn nan_max(a: F, b: F) -> F {
    if a.is_nan() || b.is_nan() { F::NAN } else { a.max(b) }
}

fn nan_min(a: F, b: F) -> F {
    if a.is_nan() || b.is_nan() { F::NAN } else { a.min(b) }
}

fn pow_f32(a: F, b: F) -> F {
    if b == 2.0 {
        a * a
    } else if b == 3.0 {
        a * a * a
    } else if b == 1.0 {
        a
    } else if b == 0.5 {
        a.sqrt()
    } else {
        a.powf(b)
    }
}

/// Integer power with wrapping overflow; negative exponents truncate toward zero like `1 / a^-b`.
fn pow_i64(a: i64, b: i64) -> i64 {
    if b < 0 {
        return match a {
            1 => 1,
            -1 => {
                if b % 2 == 0 {
                    1
                } else {
                    -1
                }
            }
            _ => 0,
        };
    }
    let (mut base, mut e, mut acc) = (a, b as u64, 1i64);
    while e > 0 {
        if e & 1 == 1 {
            acc = acc.wrapping_mul(base);
        }
        base = base.wrapping_mul(base);
        e >>= 1;
    }
    acc
}

/// Applies a binary op with numpy broadcasting.
pub(crate) fn binary(ctx: &CpuContext, op: BinaryOp, a: &Tensor, b: &Tensor, out: &[usize]) -> Result<Tensor, Error> {
    use BinaryOp::*;
    if op == PRelu || op.is_bitwise() {
        return super::activation::binary(ctx, op, a, b, out);
    }
    let name = ir::binary_name(op);
    let (ash, bsh) = (a.shape(), b.shape());
    // Macros rather than closures taking `fn` pointers: each op's body must be monomorphised into
    // `map2` so the loops inline and vectorise (a `fn` pointer costs an indirect call per element).
    macro_rules! m {
        ($x:expr, $y:expr, Float, $f:expr) => {
            F::data(map2(ctx, $x, ash, $y, bsh, out, $f))
        };
        ($x:expr, $y:expr, $v:ident, $f:expr) => {
            Data::$v(map2(ctx, $x, ash, $y, bsh, out, $f))
        };
    }
    let data = if let (Some(x), Some(y)) = (F::view(a), F::view(b)) {
        match op {
            Add => m!(x, y, Float, |a: F, b: F| a + b),
            Sub => m!(x, y, Float, |a: F, b: F| a - b),
            Mul => m!(x, y, Float, |a: F, b: F| a * b),
            Div => m!(x, y, Float, |a: F, b: F| a / b),
            Pow => m!(x, y, Float, pow_f32),
            Max => m!(x, y, Float, nan_max),
            Min => m!(x, y, Float, nan_min),
            Equal => m!(x, y, Bool, |a: F, b: F| a == b),
            Less => m!(x, y, Bool, |a: F, b: F| a < b),
            LessOrEqual => m!(x, y, Bool, |a: F, b: F| a <= b),
            Greater => m!(x, y, Bool, |a: F, b: F| a > b),
            GreaterOrEqual => m!(x, y, Bool, |a: F, b: F| a >= b),
            Mod => m!(x, y, Float, |a: F, b: F| {
                let r = a % b;
                if r != 0.0 && (r < 0.0) != (b < 0.0) { r + b } else { r }
            }),
            Fmod => m!(x, y, Float, |a: F, b: F| a % b),
            And | Or | Xor => return Err(bad(name, "logical ops take bool inputs")),
            PRelu | BitwiseAnd | BitwiseOr | BitwiseXor => unreachable!("dispatched above"),
        }
    } else {
        match (a.data(), b.data()) {
            (Data::I64(x), Data::I64(y)) => match op {
                Add => m!(x, y, I64, i64::wrapping_add),
                Sub => m!(x, y, I64, i64::wrapping_sub),
                Mul => m!(x, y, I64, i64::wrapping_mul),
                Div => {
                    if y.contains(&0) {
                        return Err(bad(name, "integer division by zero"));
                    }
                    m!(x, y, I64, i64::wrapping_div)
                }
                Pow => m!(x, y, I64, pow_i64),
                Max => m!(x, y, I64, |a: i64, b: i64| a.max(b)),
                Min => m!(x, y, I64, |a: i64, b: i64| a.min(b)),
                Equal => m!(x, y, Bool, |a: i64, b: i64| a == b),
                Less => m!(x, y, Bool, |a: i64, b: i64| a < b),
                LessOrEqual => m!(x, y, Bool, |a: i64, b: i64| a <= b),
                Greater => m!(x, y, Bool, |a: i64, b: i64| a > b),
                GreaterOrEqual => m!(x, y, Bool, |a: i64, b: i64| a >= b),
                Mod | Fmod if y.contains(&0) => return Err(bad(name, "integer division by zero")),
                Mod => m!(x, y, I64, |a: i64, b: i64| {
                    let r = a.wrapping_rem(b);
                    if r != 0 && (r < 0) != (b < 0) { r.wrapping_add(b) } else { r }
                }),
                Fmod => m!(x, y, I64, i64::wrapping_rem),
                And | Or | Xor => return Err(bad(name, "logical ops take bool inputs")),
                PRelu | BitwiseAnd | BitwiseOr | BitwiseXor => unreachable!("dispatched above"),
            },
            (Data::Bool(x), Data::Bool(y)) => {
                let c = |f: fn(bool, bool) -> bool| Data::Bool(map2(ctx, x, ash, y, bsh, out, f));
                match op {
                    Equal => c(|a, b| a == b),
                    And => c(|a, b| a & b),
                    Or => c(|a, b| a | b),
                    Xor => c(|a, b| a ^ b),
                    _ => return Err(bad(name, "arithmetic and ordering ops take numeric inputs")),
                }
            }
            (x, y) => {
                return Err(bad(name, &format!("input dtypes differ ({} vs {})", x.dtype(), y.dtype())));
            }
        }
    };
    tensor(name, out, data)
}

/// `cond ? a : b` with broadcasting of all three.
pub(crate) fn where_(ctx: &CpuContext, cond: &Tensor, a: &Tensor, b: &Tensor, out: &[usize]) -> Result<Tensor, Error> {
    let c = cond.as_bool().ok_or_else(|| bad("where", "condition must be bool"))?;
    let bc = Broadcast::new(&[cond.shape(), a.shape(), b.shape()], out);
    let n: usize = out.iter().product();
    fn pick<T: Copy + Send + Sync + Default>(
        ctx: &CpuContext,
        bc: &Broadcast,
        n: usize,
        c: &[bool],
        x: &[T],
        y: &[T],
    ) -> Vec<T> {
        let mut o = vec![T::default(); n];
        if n == 0 {
            return o;
        }
        let (sc, sx, sy) = (bc.inner_stride(0), bc.inner_stride(1), bc.inner_stride(2));
        bc.for_segments(ctx, &mut o, |r, j, seg| {
            let (oc, ox, oy) =
                (bc.row_offset(0, r) + j * sc, bc.row_offset(1, r) + j * sx, bc.row_offset(2, r) + j * sy);
            for (k, v) in seg.iter_mut().enumerate() {
                *v = if c[oc + k * sc] { x[ox + k * sx] } else { y[oy + k * sy] };
            }
        });
        o
    }
    let data = match (a.data(), b.data()) {
        (Data::F32(x), Data::F32(y)) => Data::F32(pick(ctx, &bc, n, c, x, y)),
        (Data::F64(x), Data::F64(y)) => Data::F64(pick(ctx, &bc, n, c, x, y)),
        (Data::I64(x), Data::I64(y)) => Data::I64(pick(ctx, &bc, n, c, x, y)),
        (Data::Bool(x), Data::Bool(y)) => Data::Bool(pick(ctx, &bc, n, c, x, y)),
        _ => return Err(bad("where", "branch dtypes differ")),
    };
    tensor("where", out, data)
}

/// Converts element types: float -> i64 truncates toward zero (saturating, NaN -> 0), anything ->
/// bool is `!= 0`, bool -> number is 0/1.
/// Half-precision types round to nearest, ties to even (as PyTorch's `.to(torch.bfloat16)`).
pub(crate) fn cast(x: &Tensor, to: DType) -> Result<Tensor, Error> {
    if x.dtype().is_half() && x.dtype() != to {
        return cast(&x.clone().widened(), to);
    }
    if to.is_half() && x.dtype() != to {
        let wide = if x.dtype().is_float() { x.clone() } else { cast(x, DType::F32)? };
        return Ok(wide.with_float_type(to));
    }
    let data = match (x.data(), to) {
        (d, t) if d.dtype() == t => d.clone(),
        (Data::F32(v), DType::F64) => Data::F64(v.iter().map(|&x| x as f64).collect()),
        (Data::F64(v), DType::F32) => Data::F32(v.iter().map(|&x| x as f32).collect()),
        (Data::F32(v), DType::I64) => Data::I64(v.iter().map(|&x| x as i64).collect()),
        (Data::F64(v), DType::I64) => Data::I64(v.iter().map(|&x| x as i64).collect()),
        (Data::F32(v), DType::Bool) => Data::Bool(v.iter().map(|&x| x != 0.0).collect()),
        (Data::F64(v), DType::Bool) => Data::Bool(v.iter().map(|&x| x != 0.0).collect()),
        (Data::I64(v), DType::F32) => Data::F32(v.iter().map(|&x| x as f32).collect()),
        (Data::I64(v), DType::F64) => Data::F64(v.iter().map(|&x| x as f64).collect()),
        (Data::I64(v), DType::Bool) => Data::Bool(v.iter().map(|&x| x != 0).collect()),
        (Data::Bool(v), DType::F32) => Data::F32(v.iter().map(|&x| x as u8 as f32).collect()),
        (Data::Bool(v), DType::F64) => Data::F64(v.iter().map(|&x| x as u8 as f64).collect()),
        (Data::Bool(v), DType::I64) => Data::I64(v.iter().map(|&x| x as i64).collect()),
        (d, _) => d.clone(),
    };
    tensor("cast", x.shape(), data)
}

/// The float data of `t` broadcast (numpy rules) to `shape`, materialised.
pub(crate) fn broadcast_f32(ctx: &CpuContext, op: &'static str, t: &Tensor, shape: &[usize]) -> Result<Vec<F>, Error> {
    let v = floats(op, t)?;
    let b = ir::broadcast_shapes(t.shape(), shape).map_err(|m| bad(op, &m))?;
    if b != shape {
        return Err(bad(op, &format!("{:?} does not broadcast to {shape:?}", t.shape())));
    }
    Ok(map2(ctx, v, t.shape(), &[(0 as F)], &[], shape, |x, _| x))
}
