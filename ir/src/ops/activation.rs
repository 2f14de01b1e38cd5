//! Activations and elementwise math beyond the original unary set: the [`UnaryOp`] variants after
//! `Sign` (HardSigmoid, HardSwish, LeakyRelu, Elu, Selu, Celu, Softplus, Softsign, Mish,
//! ThresholdedRelu, Shrink, Round, IsNaN, IsInf, the trigonometric and hyperbolic functions and
//! their inverses, BitwiseNot), the [`BinaryOp`]s PRelu and BitwiseAnd/Or/Xor, and
//! [`crate::Op::Hardmax`].
//!
//! They are ordinary `Unary`/`Binary` ops everywhere else (elementwise sharding, `UnaryGrad`
//! gradients, cost); this file holds what is particular to them: dtype rules, names, the
//! attributes the text form prints, and the list of their default-attribute forms.
//!
//! The derivatives at the kinks are PyTorch's (so training matches a PyTorch module's): LeakyRelu
//! and PRelu take the slope for x <= 0, Elu/Selu/Celu the exponential side for x <= 0,
//! HardSigmoid is flat outside its open ramp, HardSwish has slope x/3 + 1/2 on [-3, 3],
//! ThresholdedRelu slope 1 only for x > alpha, Shrink 1 outside the closed band [-lambd, lambd].

use crate::op::{BinaryOp, InferError, UnaryOp, broadcast_shapes};
use crate::tensor::{DType, TensorMeta};

/// Default Selu alpha (ONNX's, the f32 nearest to 1.6732632423543772).
pub const SELU_ALPHA: f32 = 1.673_263_2;
/// Default Selu gamma (ONNX's, the f32 nearest to 1.0507009873554805).
pub const SELU_GAMMA: f32 = 1.050_701;

/// The unary ops of this file with ONNX's default attributes, in enum order (for parsing and
/// listing: the text form names an op by its kind, then reads its attributes).
pub const OPS: [UnaryOp; 24] = {
    use UnaryOp::*;
    [
        HardSigmoid { alpha: 0.2, beta: 0.5 },
        HardSwish,
        LeakyRelu { alpha: 0.01 },
        Elu { alpha: 1.0 },
        Selu { alpha: SELU_ALPHA, gamma: SELU_GAMMA },
        Celu { alpha: 1.0 },
        Softplus,
        Softsign,
        Mish,
        ThresholdedRelu { alpha: 1.0 },
        Shrink { bias: 0.0, lambd: 0.5 },
        Round,
        IsNaN,
        IsInf { negative: true, positive: true },
        Tan,
        Acos,
        Asin,
        Atan,
        Sinh,
        Cosh,
        Asinh,
        Acosh,
        Atanh,
        BitwiseNot,
    ]
};

/// True for the unary ops this file describes.
pub fn is_activation(u: UnaryOp) -> bool {
    use UnaryOp::*;
    // Every variant is named (no wildcard), so a new unary op says which file describes it.
    match u {
        Relu | Gelu | GeluTanh | Tanh | Erf | Sigmoid | Exp | Log | Sqrt | Neg | Reciprocal | Abs | Not | Floor
        | Ceil | Sin | Cos | Sign => false,
        HardSigmoid { .. }
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
        | BitwiseNot => true,
    }
}

/// Text-form name of one of this file's unary ops (`""` for the others).
pub fn name(u: UnaryOp) -> &'static str {
    use UnaryOp::*;
    match u {
        HardSigmoid { .. } => "hard_sigmoid",
        HardSwish => "hard_swish",
        LeakyRelu { .. } => "leaky_relu",
        Elu { .. } => "elu",
        Selu { .. } => "selu",
        Celu { .. } => "celu",
        Softplus => "softplus",
        Softsign => "softsign",
        Mish => "mish",
        ThresholdedRelu { .. } => "thresholded_relu",
        Shrink { .. } => "shrink",
        Round => "round",
        IsNaN => "is_nan",
        IsInf { .. } => "is_inf",
        Tan => "tan",
        Acos => "acos",
        Asin => "asin",
        Atan => "atan",
        Sinh => "sinh",
        Cosh => "cosh",
        Asinh => "asinh",
        Acosh => "acosh",
        Atanh => "atanh",
        BitwiseNot => "bitwise_not",
        _ => "",
    }
}

/// Text-form name of the gradient of one of this file's unary ops (`""` for the others).
pub fn grad_name(u: UnaryOp) -> &'static str {
    use UnaryOp::*;
    match u {
        HardSigmoid { .. } => "hard_sigmoid_grad",
        HardSwish => "hard_swish_grad",
        LeakyRelu { .. } => "leaky_relu_grad",
        Elu { .. } => "elu_grad",
        Selu { .. } => "selu_grad",
        Celu { .. } => "celu_grad",
        Softplus => "softplus_grad",
        Softsign => "softsign_grad",
        Mish => "mish_grad",
        ThresholdedRelu { .. } => "thresholded_relu_grad",
        Shrink { .. } => "shrink_grad",
        Round => "round_grad",
        IsNaN => "is_nan_grad",
        IsInf { .. } => "is_inf_grad",
        Tan => "tan_grad",
        Acos => "acos_grad",
        Asin => "asin_grad",
        Atan => "atan_grad",
        Sinh => "sinh_grad",
        Cosh => "cosh_grad",
        Asinh => "asinh_grad",
        Acosh => "acosh_grad",
        Atanh => "atanh_grad",
        BitwiseNot => "bitwise_not_grad",
        _ => "",
    }
}

/// An attribute value of a unary op.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Param {
    /// A float attribute.
    F32(f32),
    /// A flag.
    Bool(bool),
}

/// The attributes of `u` by name, in a fixed order (empty for ops without any).
pub fn params(u: UnaryOp) -> Vec<(&'static str, Param)> {
    use Param::*;
    use UnaryOp::*;
    match u {
        HardSigmoid { alpha, beta } => vec![("alpha", F32(alpha)), ("beta", F32(beta))],
        LeakyRelu { alpha } | Elu { alpha } | Celu { alpha } | ThresholdedRelu { alpha } => {
            vec![("alpha", F32(alpha))]
        }
        Selu { alpha, gamma } => vec![("alpha", F32(alpha)), ("gamma", F32(gamma))],
        Shrink { bias, lambd } => vec![("bias", F32(bias)), ("lambd", F32(lambd))],
        IsInf { negative, positive } => vec![("detect_negative", Bool(negative)), ("detect_positive", Bool(positive))],
        _ => vec![],
    }
}

/// `u` with the attributes of [`params`] read through `get` (called once per attribute name,
/// with the current value as the expected kind).
pub fn with_params(
    u: UnaryOp,
    mut get: impl FnMut(&'static str, Param) -> Result<Param, String>,
) -> Result<UnaryOp, String> {
    use UnaryOp::*;
    let mut f = |k: &'static str| match get(k, Param::F32(0.0))? {
        Param::F32(x) => Ok(x),
        Param::Bool(_) => Err(format!("{}: attribute {k} must be a float", name(u))),
    };
    Ok(match u {
        HardSigmoid { .. } => HardSigmoid { alpha: f("alpha")?, beta: f("beta")? },
        LeakyRelu { .. } => LeakyRelu { alpha: f("alpha")? },
        Elu { .. } => Elu { alpha: f("alpha")? },
        Celu { .. } => Celu { alpha: f("alpha")? },
        ThresholdedRelu { .. } => ThresholdedRelu { alpha: f("alpha")? },
        Selu { .. } => Selu { alpha: f("alpha")?, gamma: f("gamma")? },
        Shrink { .. } => Shrink { bias: f("bias")?, lambd: f("lambd")? },
        IsInf { .. } => {
            let mut b = |k: &'static str| match get(k, Param::Bool(false))? {
                Param::Bool(x) => Ok(x),
                Param::F32(_) => Err(format!("{}: attribute {k} must be true or false", name(u))),
            };
            IsInf { negative: b("detect_negative")?, positive: b("detect_positive")? }
        }
        other => other,
    })
}

/// Output meta of one of this file's unary ops on `x`.
pub(crate) fn infer(op: &str, u: UnaryOp, x: &TensorMeta) -> Result<TensorMeta, InferError> {
    match u {
        UnaryOp::BitwiseNot => {
            if x.dtype != DType::I64 {
                return Err(format!("{op}: input must be i64, got {}", x.dtype));
            }
            Ok(x.clone())
        }
        UnaryOp::IsNaN | UnaryOp::IsInf { .. } => {
            want_float(op, x)?;
            Ok(TensorMeta { shape: x.shape.clone(), dtype: DType::Bool })
        }
        UnaryOp::Celu { alpha: 0.0 } => Err(format!("{op}: alpha must not be 0")),
        _ => {
            want_float(op, x)?;
            Ok(x.clone())
        }
    }
}

fn want_float(op: &str, m: &TensorMeta) -> Result<(), InferError> {
    if !m.dtype.is_float() {
        return Err(format!("{op}: input must be f32 or f64, got {}", m.dtype));
    }
    Ok(())
}

/// Output meta of PRelu or a bitwise op on `a` and `b`.
pub(crate) fn infer_binary(op: &str, bop: BinaryOp, a: &TensorMeta, b: &TensorMeta) -> Result<TensorMeta, InferError> {
    if a.dtype != b.dtype {
        return Err(format!("{op}: input dtypes differ ({} vs {})", a.dtype, b.dtype));
    }
    let shape = broadcast_shapes(&a.shape, &b.shape).map_err(|e| format!("{op}: {e}"))?;
    if bop == BinaryOp::PRelu {
        want_float(op, a)?;
        // The slope broadcasts to x, never x to the slope.
        if shape != a.shape {
            return Err(format!("{op}: slope {:?} does not broadcast to x {:?}", b.shape, a.shape));
        }
    } else if a.dtype != DType::I64 {
        return Err(format!("{op}: inputs must be i64, got {}", a.dtype));
    }
    Ok(TensorMeta { shape, dtype: a.dtype })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Graph, Op};

    fn f32s(shape: &[usize]) -> TensorMeta {
        TensorMeta::new(DType::F32, shape.to_vec())
    }

    #[test]
    fn every_op_and_its_attributes_round_trip_through_the_text_form() {
        let mut g = Graph::new("act");
        let x = g.input("x", f32s(&[2, 3]));
        let i = g.input("i", TensorMeta::new(DType::I64, vec![3]));
        let mut ops: Vec<UnaryOp> = OPS.to_vec();
        ops.extend([
            UnaryOp::HardSigmoid { alpha: 0.25, beta: -0.125 },
            UnaryOp::Selu { alpha: 1.5, gamma: 2.0 },
            UnaryOp::Shrink { bias: 0.1, lambd: 0.3 },
            UnaryOp::IsInf { negative: false, positive: true },
        ]);
        for (k, u) in ops.into_iter().enumerate() {
            let input = if u == UnaryOp::BitwiseNot { i } else { x };
            let y = g.add1(&format!("u{k}"), Op::Unary(u), &[input]).unwrap();
            g.set_output(&format!("y{k}"), y);
            if crate::unary_differentiable(u) {
                let d = g.add1(&format!("d{k}"), Op::UnaryGrad(u), &[x, x]).unwrap();
                g.set_output(&format!("d{k}"), d);
            }
        }
        let s = g.add1("slope", Op::Constant(crate::Tensor::f32(vec![3], vec![0.1, 0.2, 0.3])), &[]).unwrap();
        for (k, (b, ins)) in [
            (BinaryOp::PRelu, [x, s]),
            (BinaryOp::BitwiseAnd, [i, i]),
            (BinaryOp::BitwiseOr, [i, i]),
            (BinaryOp::BitwiseXor, [i, i]),
        ]
        .into_iter()
        .enumerate()
        {
            let y = g.add1(&format!("b{k}"), Op::Binary(b), &ins).unwrap();
            g.set_output(&format!("b{k}"), y);
        }
        let h = g.add1("h", Op::Hardmax { axis: 1 }, &[x]).unwrap();
        g.set_output("h", h);
        let text = g.to_text();
        assert!(text.contains("hard_sigmoid{alpha=0.25, beta=-0.125}"), "{text}");
        assert!(text.contains("is_inf{detect_negative=false, detect_positive=true}"), "{text}");
        let back = Graph::parse(&text).unwrap();
        assert_eq!(back.to_text(), text);
    }

    #[test]
    fn inference_checks_dtypes_and_prelu_broadcasting() {
        let infer = |op: Op, ins: &[TensorMeta]| op.infer(ins);
        let b = TensorMeta::new(DType::Bool, vec![2, 3]);
        let i = TensorMeta::new(DType::I64, vec![2, 3]);
        assert_eq!(infer(Op::Unary(UnaryOp::IsNaN), &[f32s(&[2, 3])]).unwrap(), vec![b.clone()]);
        assert!(infer(Op::Unary(UnaryOp::IsNaN), std::slice::from_ref(&i)).is_err());
        assert!(infer(Op::Unary(UnaryOp::Softplus), std::slice::from_ref(&i)).is_err());
        assert!(infer(Op::Unary(UnaryOp::BitwiseNot), &[f32s(&[2])]).is_err());
        assert!(infer(Op::Unary(UnaryOp::Celu { alpha: 0.0 }), &[f32s(&[2])]).unwrap_err().contains("alpha"));
        let prelu = Op::Binary(BinaryOp::PRelu);
        assert_eq!(infer(prelu.clone(), &[f32s(&[2, 3, 4]), f32s(&[3, 1])]).unwrap(), vec![f32s(&[2, 3, 4])]);
        let e = infer(prelu.clone(), &[f32s(&[3]), f32s(&[2, 3])]).unwrap_err();
        assert!(e.contains("does not broadcast to x"), "{e}");
        assert!(infer(prelu, &[i.clone(), i.clone()]).is_err());
        assert!(infer(Op::Binary(BinaryOp::BitwiseAnd), &[f32s(&[2]), f32s(&[2])]).is_err());
        assert!(infer(Op::Binary(BinaryOp::BitwiseAnd), &[i.clone(), b]).is_err());
        assert!(infer(Op::Hardmax { axis: 2 }, &[f32s(&[2, 3])]).is_err());
    }
}
