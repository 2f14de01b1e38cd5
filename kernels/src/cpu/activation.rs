//! The activation family (`ir::ops::activation`): the newer unary activations and math
//! functions, their derivatives, PRelu, the bitwise ops and Hardmax.
//!
//! Every formula avoids overflow where the naive one has it (softplus, mish) and lets NaN
//! through the piecewise ops the way ONNX's reference does (a NaN input gives a NaN output,
//! except for the tests IsNaN/IsInf and ThresholdedRelu's `x > alpha`).

use super::elementwise::{map2, with_simd};
use super::{CpuContext, F, floats, tensor};
use crate::Error;
use ir::{BinaryOp, Data, Tensor, UnaryOp};

fn bad(op: &'static str, message: String) -> Error {
    Error::BadInput { op, message }
}

/// `min(max(t, 0), 1)`, NaN kept.
fn clamp01(t: F) -> F {
    t.clamp(0.0, 1.0)
}

/// `ln(1 + e^x)` without overflow.
fn softplus(x: F) -> F {
    if x > 0.0 { x + (-x).exp().ln_1p() } else { x.exp().ln_1p() }
}

fn sigmoid(x: F) -> F {
    super::elementwise::sigmoid(x)
}

/// Maps `v` through `f` in rows of 4096 over the pool.
fn map(ctx: &CpuContext, v: &[F], f: impl Fn(F) -> F + Sync + Send) -> Vec<F> {
    let mut out = vec![0.0; v.len()];
    ctx.for_rows_weighted(&mut out, 4096.min(v.len().max(1)), 8, |r, row| {
        let src = &v[r * 4096..r * 4096 + row.len()];
        with_simd(|| {
            for (o, &x) in row.iter_mut().zip(src) {
                *o = f(x);
            }
        })
    });
    out
}

/// Applies one of the family's unary ops (`ir::ops::activation::is_activation`).
pub(crate) fn unary(ctx: &CpuContext, u: UnaryOp, x: &Tensor) -> Result<Tensor, Error> {
    use UnaryOp::*;
    let op = ir::unary_name(u);
    if u == BitwiseNot {
        let v = x.as_i64().ok_or_else(|| bad(op, format!("input must be i64, got {}", x.dtype())))?;
        return tensor(op, x.shape(), Data::I64(v.iter().map(|a| !a).collect()));
    }
    let v = floats(op, x)?;
    let out = match u {
        IsNaN => return tensor(op, x.shape(), Data::Bool(v.iter().map(|a| a.is_nan()).collect())),
        IsInf { negative, positive } => {
            let f = |a: &F| a.is_infinite() && if *a > 0.0 { positive } else { negative };
            return tensor(op, x.shape(), Data::Bool(v.iter().map(f).collect()));
        }
        HardSigmoid { alpha, beta } => {
            let (a, b) = (alpha as F, beta as F);
            map(ctx, v, |x| clamp01(a * x + b))
        }
        HardSwish => map(ctx, v, |x| x * clamp01(x * (1.0 / 6.0) + 0.5)),
        LeakyRelu { alpha } => {
            let a = alpha as F;
            map(ctx, v, |x| if x < 0.0 { a * x } else { x })
        }
        Elu { alpha } => {
            let a = alpha as F;
            map(ctx, v, |x| if x < 0.0 { a * x.exp_m1() } else { x })
        }
        Selu { alpha, gamma } => {
            let (a, g) = (alpha as F, gamma as F);
            map(ctx, v, |x| if x > 0.0 { g * x } else { g * a * x.exp_m1() })
        }
        Celu { alpha } => {
            let a = alpha as F;
            map(ctx, v, |x| if x.is_nan() { x } else { x.max(0.0) + (a * (x / a).exp_m1()).min(0.0) })
        }
        Softplus => map(ctx, v, softplus),
        Softsign => map(ctx, v, |x| x / (1.0 + x.abs())),
        Mish => map(ctx, v, |x| x * softplus(x).tanh()),
        ThresholdedRelu { alpha } => {
            let a = alpha as F;
            map(ctx, v, |x| if x > a { x } else { 0.0 })
        }
        Shrink { bias, lambd } => {
            let (b, l) = (bias as F, lambd as F);
            map(ctx, v, |x| {
                if x < -l {
                    x + b
                } else if x > l {
                    x - b
                } else if x.is_nan() {
                    x
                } else {
                    0.0
                }
            })
        }
        Round => map(ctx, v, F::round_ties_even),
        Tan => map(ctx, v, F::tan),
        Acos => map(ctx, v, F::acos),
        Asin => map(ctx, v, F::asin),
        Atan => map(ctx, v, F::atan),
        Sinh => map(ctx, v, F::sinh),
        Cosh => map(ctx, v, F::cosh),
        Asinh => map(ctx, v, F::asinh),
        Acosh => map(ctx, v, F::acosh),
        Atanh => map(ctx, v, F::atanh),
        // Every kind is named (no wildcard): the basic ones are not this file's, BitwiseNot is handled above.
        Relu | Gelu | GeluTanh | Tanh | Erf | Sigmoid | Exp | Log | Sqrt | Neg | Reciprocal | Abs | Not | Floor
        | Ceil | Sin | Cos | Sign | BitwiseNot => return Err(bad(op, "not an op of the activation family".into())),
    };
    tensor(op, x.shape(), super::Float::data(out))
}

/// `f'(x)` of the family's differentiable ops (all read the forward input x).
pub(crate) fn unary_grad(ctx: &CpuContext, u: UnaryOp, x: &Tensor, dy: &Tensor) -> Result<Tensor, Error> {
    use UnaryOp::*;
    let op = ir::unary_grad_name(u);
    let (xv, dv) = (floats(op, x)?, floats(op, dy)?);
    // A macro rather than a boxed closure: each derivative inlines into its own loop.
    macro_rules! apply {
        ($d:expr) => {{
            let d = $d;
            ctx.zip_map(xv, dv, |x, g| g * d(x))
        }};
    }
    // PyTorch's conventions at the kinks (see `ir::ops::activation`).
    let out = match u {
        HardSigmoid { alpha, beta } => {
            let (a, b) = (alpha as F, beta as F);
            apply!(move |x: F| {
                let t = a * x + b;
                if t > 0.0 && t < 1.0 { a } else { 0.0 }
            })
        }
        HardSwish => apply!(|x: F| {
            if x < -3.0 {
                0.0
            } else if x <= 3.0 {
                x / 3.0 + 0.5
            } else {
                1.0
            }
        }),
        LeakyRelu { alpha } => {
            let a = alpha as F;
            apply!(move |x: F| if x > 0.0 { 1.0 } else { a })
        }
        Elu { alpha } => {
            let a = alpha as F;
            apply!(move |x: F| if x > 0.0 { 1.0 } else { a * x.exp() })
        }
        Selu { alpha, gamma } => {
            let (a, g) = (alpha as F, gamma as F);
            apply!(move |x: F| if x > 0.0 { g } else { g * a * x.exp() })
        }
        Celu { alpha } => {
            let a = alpha as F;
            apply!(move |x: F| if x > 0.0 { 1.0 } else { (x / a).exp() })
        }
        Softplus => apply!(sigmoid),
        Softsign => apply!(|x: F| {
            let d = 1.0 + x.abs();
            1.0 / (d * d)
        }),
        Mish => apply!(|x: F| {
            let t = softplus(x).tanh();
            t + x * sigmoid(x) * (1.0 - t * t)
        }),
        ThresholdedRelu { alpha } => {
            let a = alpha as F;
            apply!(move |x: F| if x > a { 1.0 } else { 0.0 })
        }
        Shrink { lambd, .. } => {
            let l = lambd as F;
            apply!(move |x: F| if x < -l || x > l { 1.0 } else { 0.0 })
        }
        Tan => apply!(|x: F| {
            let c = x.cos();
            1.0 / (c * c)
        }),
        Acos => apply!(|x: F| -1.0 / (1.0 - x * x).sqrt()),
        Asin => apply!(|x: F| 1.0 / (1.0 - x * x).sqrt()),
        Atan => apply!(|x: F| 1.0 / (1.0 + x * x)),
        Sinh => apply!(F::cosh),
        Cosh => apply!(F::sinh),
        Asinh => apply!(|x: F| 1.0 / (x * x + 1.0).sqrt()),
        Acosh => apply!(|x: F| 1.0 / (x * x - 1.0).sqrt()),
        Atanh => apply!(|x: F| 1.0 / (1.0 - x * x)),
        // Every kind is named (no wildcard): the basic ones are not this file's, the others have no gradient.
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
        | Round
        | IsNaN
        | IsInf { .. }
        | BitwiseNot => return Err(bad(op, "op has no gradient kernel".into())),
    };
    tensor(op, x.shape(), super::Float::data(out))
}

/// PRelu on floats and the bitwise ops on i64, with numpy broadcasting to `out`.
pub(crate) fn binary(ctx: &CpuContext, b: BinaryOp, x: &Tensor, y: &Tensor, out: &[usize]) -> Result<Tensor, Error> {
    let op = ir::binary_name(b);
    let (xs, ys) = (x.shape(), y.shape());
    let data = match b {
        BinaryOp::PRelu => {
            let (xv, sv) = (floats(op, x)?, floats(op, y)?);
            super::Float::data(map2(ctx, xv, xs, sv, ys, out, |x: F, s: F| if x < 0.0 { s * x } else { x }))
        }
        _ => {
            let (Some(xv), Some(yv)) = (x.as_i64(), y.as_i64()) else {
                return Err(bad(op, format!("inputs must be i64, got {} and {}", x.dtype(), y.dtype())));
            };
            Data::I64(match b {
                BinaryOp::BitwiseAnd => map2(ctx, xv, xs, yv, ys, out, |a: i64, b: i64| a & b),
                BinaryOp::BitwiseOr => map2(ctx, xv, xs, yv, ys, out, |a: i64, b: i64| a | b),
                BinaryOp::BitwiseXor => map2(ctx, xv, xs, yv, ys, out, |a: i64, b: i64| a ^ b),
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
            })
        }
    };
    tensor(op, out, data)
}

/// One-hot of the first maximum along `axis` (NaN never wins; an all-NaN row marks its first
/// element, as numpy's argmax does not: ONNX leaves NaN rows unspecified).
pub(crate) fn hardmax(ctx: &CpuContext, x: &Tensor, axis: usize) -> Result<Tensor, Error> {
    let op = "hardmax";
    let xv = floats(op, x)?;
    let s = x.shape();
    let len = *s.get(axis).ok_or_else(|| bad(op, format!("axis {axis} out of range for {s:?}")))?;
    let block = ir::shape::checked_numel(&s[axis..]).ok_or_else(|| bad(op, format!("shape {s:?} overflows")))?;
    let inner = block.checked_div(len).unwrap_or(0);
    let mut out = vec![0.0 as F; xv.len()];
    if block == 0 {
        return tensor(op, s, super::Float::data(out));
    }
    ctx.for_rows(&mut out, block, |r, o| {
        let v = &xv[r * block..(r + 1) * block];
        for i in 0..inner {
            let mut best = 0;
            for k in 1..len {
                if v[k * inner + i] > v[best * inner + i] {
                    best = k;
                }
            }
            o[best * inner + i] = 1.0;
        }
    });
    tensor(op, s, super::Float::data(out))
}
