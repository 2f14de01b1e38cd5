//! Import of the activation family (`ir::ops::activation`): the parametric activations with
//! ONNX's attribute defaults, the math functions, PRelu, the bitwise ops and Hardmax.

use super::{Importer, N, V, norm_axis};
use ir::ops::activation::{SELU_ALPHA, SELU_GAMMA};
use ir::{BinaryOp, Op, UnaryOp};

impl Importer<'_> {
    /// Translates a node whose op type is of the activation family in `src/ops.rs`.
    pub(super) fn translate_activation(&mut self, n: &N, op_type: &str) -> Result<Vec<Option<V>>, String> {
        let nm = n.name.clone();
        let binary = match op_type {
            "PRelu" => Some(BinaryOp::PRelu),
            "BitwiseAnd" => Some(BinaryOp::BitwiseAnd),
            "BitwiseOr" => Some(BinaryOp::BitwiseOr),
            "BitwiseXor" => Some(BinaryOp::BitwiseXor),
            _ => None,
        };
        if let Some(b) = binary {
            let (x, y) = (self.need(n, 0)?, self.need(n, 1)?);
            return Ok(vec![Some(self.emit1(&nm, Op::Binary(b), &[x, y])?)]);
        }
        if op_type == "Hardmax" {
            return self.hardmax(n);
        }
        let f = |k: &str, d: f32| n.float(k, d);
        let u = match op_type {
            "HardSigmoid" => UnaryOp::HardSigmoid { alpha: f("alpha", 0.2), beta: f("beta", 0.5) },
            "HardSwish" => UnaryOp::HardSwish,
            "LeakyRelu" => UnaryOp::LeakyRelu { alpha: f("alpha", 0.01) },
            "Elu" => UnaryOp::Elu { alpha: f("alpha", 1.0) },
            "Selu" => UnaryOp::Selu { alpha: f("alpha", SELU_ALPHA), gamma: f("gamma", SELU_GAMMA) },
            "Celu" => {
                let alpha = f("alpha", 1.0);
                if alpha == 0.0 {
                    return Err("alpha must not be 0".into());
                }
                UnaryOp::Celu { alpha }
            }
            "Softplus" => UnaryOp::Softplus,
            "Softsign" => UnaryOp::Softsign,
            "Mish" => UnaryOp::Mish,
            "ThresholdedRelu" => UnaryOp::ThresholdedRelu { alpha: f("alpha", 1.0) },
            "Shrink" => UnaryOp::Shrink { bias: f("bias", 0.0), lambd: f("lambd", 0.5) },
            "Round" => UnaryOp::Round,
            "IsNaN" => UnaryOp::IsNaN,
            "IsInf" => UnaryOp::IsInf {
                negative: n.int("detect_negative", 1) != 0,
                positive: n.int("detect_positive", 1) != 0,
            },
            "Tan" => UnaryOp::Tan,
            "Acos" => UnaryOp::Acos,
            "Asin" => UnaryOp::Asin,
            "Atan" => UnaryOp::Atan,
            "Sinh" => UnaryOp::Sinh,
            "Cosh" => UnaryOp::Cosh,
            "Asinh" => UnaryOp::Asinh,
            "Acosh" => UnaryOp::Acosh,
            "Atanh" => UnaryOp::Atanh,
            "BitwiseNot" => UnaryOp::BitwiseNot,
            other => return Err(format!("{other} is not an activation (importer bug)")),
        };
        let x = self.need(n, 0)?;
        Ok(vec![Some(self.emit1(&nm, Op::Unary(u), &[x])?)])
    }

    /// Hardmax: along `axis` from opset 13; before, over the 2-D flattening at `axis` (as
    /// Softmax), which is a reshape around a Hardmax of the flattened row.
    fn hardmax(&mut self, n: &N) -> Result<Vec<Option<V>>, String> {
        let nm = n.name.clone();
        let x = self.need(n, 0)?;
        let m = self.meta(&x);
        let r = m.rank();
        if self.opset >= 13 {
            let axis = norm_axis(n.int("axis", -1), r)?;
            return Ok(vec![Some(self.emit1(&nm, Op::Hardmax { axis }, &[x])?)]);
        }
        let axis = norm_axis(n.int("axis", 1), r + 1).map_err(|_| format!("axis out of range for rank {r}"))?;
        if axis + 1 == r {
            return Ok(vec![Some(self.emit1(&nm, Op::Hardmax { axis }, &[x])?)]);
        }
        let outer: usize = m.shape[..axis].iter().product();
        let inner: usize = m.shape[axis..].iter().product();
        let flat = self.emit1(&format!("{nm}.flat"), Op::Reshape { shape: vec![outer, inner] }, &[x])?;
        let y = self.emit1(&nm, Op::Hardmax { axis: 1 }, &[flat])?;
        Ok(vec![Some(self.emit1(&format!("{nm}.unflat"), Op::Reshape { shape: m.shape.clone() }, &[y])?)])
    }
}

impl Importer<'_> {
    /// `Swish` (opset 24): `x * sigmoid(alpha * x)`, as `Mul`s and a `Sigmoid`.
    pub(super) fn swish(&mut self, n: &N) -> Result<Vec<Option<V>>, String> {
        let nm = n.name.clone();
        let x = self.need(n, 0)?;
        let alpha = n.float("alpha", 1.0);
        let m = self.meta(&x);
        let scaled = if alpha == 1.0 {
            x.clone()
        } else {
            let a = V::C(std::rc::Rc::new(ir::Tensor::f32(Vec::<usize>::new(), vec![alpha]).with_float_type(m.dtype)));
            self.emit1(&format!("{nm}.scaled"), Op::Binary(BinaryOp::Mul), &[x.clone(), a])?
        };
        let s = self.emit1(&format!("{nm}.sigmoid"), Op::Unary(UnaryOp::Sigmoid), &[scaled])?;
        Ok(vec![Some(self.emit1(&nm, Op::Binary(BinaryOp::Mul), &[x, s])?)])
    }
}
