//! Sharding rules of the elementwise family ([`super::rule`] dispatches here).

use super::*;

/// The sharding rule of a elementwise op (see [`super::rule`]).
pub(super) fn rule(op: &Op, ins: &[TensorMeta], outs: &[TensorMeta]) -> Option<Rule> {
    use Op::*;
    let r = |dims: Vec<LogicalDim>, linear: Vec<Vec<usize>>| Some(Rule { dims, linear });
    match op {
        Unary(u) => {
            use ir::UnaryOp::*;
            // Every kind is named (no wildcard), so a new unary op decides its linearity here.
            let linear = match u {
                Neg => vec![vec![0]],
                Relu
                | Gelu
                | GeluTanh
                | Tanh
                | Erf
                | Sigmoid
                | Exp
                | Log
                | Sqrt
                | Reciprocal
                | Abs
                | Not
                | Floor
                | Ceil
                | Sin
                | Cos
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
                | BitwiseNot => vec![],
            };
            r(elementwise(ins, outs, &[]), linear)
        }
        Binary(b) => {
            use ir::BinaryOp::*;
            let linear = match b {
                Add | Sub => vec![vec![0, 1]],
                Mul => vec![vec![0], vec![1]],
                Div => vec![vec![0]],
                // Every kind is named (no wildcard), so a new binary op decides here.
                Pow | Max | Min | Equal | Less | LessOrEqual | Greater | GreaterOrEqual | And | Or | Xor | PRelu
                | BitwiseAnd | BitwiseOr | BitwiseXor | Mod | Fmod => vec![],
            };
            r(elementwise(ins, outs, &[]), linear)
        }
        Where => r(elementwise(ins, outs, &[]), vec![vec![1, 2]]),
        Identity | Cast { .. } => r(elementwise(ins, outs, &[]), vec![vec![0]]),
        UnaryGrad(_) => r(elementwise(ins, outs, &[]), vec![vec![1]]),
        // Any split: each rank draws its block's mask from the global indices of its elements
        // (`ir::ops::random`), which the runtime derives from the output's spec. Linear in x
        // (the mask does not depend on it), so a partial input gives a partial output; not
        // with the bool mask output, which is no sum of anything.
        Dropout(a) => r(elementwise(ins, outs, &[]), if a.mask { vec![] } else { vec![vec![0]] }),
        // `super::rule` sends only the ops above here.
        _ => None,
    }
}
