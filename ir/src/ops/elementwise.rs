//! Elementwise ops: `Unary` (math; the activations delegate to `activation`), `Binary` with numpy
//! broadcasting, `Where`, `Cast`, `Identity`, and `UnaryGrad`.
//!
//! [`crate::Op::infer`] dispatches the family's ops here. Its other stages: gradients in
//! `autodiff/elementwise.rs`, import in `tracer/src/import/elementwise.rs`, sharding rules in
//! `sharding/src/strategy/elementwise.rs`, kernels in `kernels/src/{cpu,cuda}/elementwise.rs`.

use crate::op::{
    BinaryOp, InferError, Op, UnaryOp, broadcast, float_of, unary_differentiable, unary_name, want_dtype, want_float,
    want_inputs,
};
use crate::tensor::{DType, TensorMeta};
/// Shape inference of the elementwise family's forward ops.
pub(crate) fn infer(op: &Op, ins: &[TensorMeta]) -> Result<Vec<TensorMeta>, InferError> {
    use Op::*;
    let n = op.name();
    let one = |m: TensorMeta| Ok(vec![m]);
    match op {
        Unary(u) => {
            want_inputs(n, ins, 1, 1)?;
            match u {
                UnaryOp::Not => want_dtype(n, &ins[0], DType::Bool, "input")?,
                UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Sign => {
                    if ins[0].dtype == DType::Bool {
                        return Err(format!("{n}: input must be numeric, got bool"));
                    }
                }
                u if crate::ops::activation::is_activation(*u) => {
                    return one(crate::ops::activation::infer(n, *u, &ins[0])?);
                }
                _ => want_float(n, &ins[0])?,
            }
            one(ins[0].clone())
        }
        Binary(b) => {
            want_inputs(n, ins, 2, 2)?;
            if matches!(b, BinaryOp::PRelu) || b.is_bitwise() {
                return one(crate::ops::activation::infer_binary(n, *b, &ins[0], &ins[1])?);
            }
            if ins[0].dtype != ins[1].dtype {
                return Err(format!("{n}: input dtypes differ ({} vs {})", ins[0].dtype, ins[1].dtype));
            }
            if b.is_logical() {
                want_dtype(n, &ins[0], DType::Bool, "inputs")?;
            } else if ins[0].dtype == DType::Bool && !matches!(b, BinaryOp::Equal) {
                return Err(format!("{n}: inputs must be numeric, got bool"));
            }
            let shape = broadcast(&ins[0].shape, &ins[1].shape).map_err(|e| format!("{n}: {e}"))?;
            let dtype = if b.is_comparison() { DType::Bool } else { ins[0].dtype };
            one(TensorMeta { shape, dtype })
        }
        Where => {
            want_inputs(n, ins, 3, 3)?;
            want_dtype(n, &ins[0], DType::Bool, "condition")?;
            if ins[1].dtype != ins[2].dtype {
                return Err(format!("{n}: branch dtypes differ ({} vs {})", ins[1].dtype, ins[2].dtype));
            }
            let s = broadcast(&ins[0].shape, &ins[1].shape).map_err(|e| format!("{n}: {e}"))?;
            let s = broadcast(&s, &ins[2].shape).map_err(|e| format!("{n}: {e}"))?;
            one(TensorMeta { shape: s, dtype: ins[1].dtype })
        }
        Cast { to } => {
            want_inputs(n, ins, 1, 1)?;
            one(TensorMeta { shape: ins[0].shape.clone(), dtype: *to })
        }
        Identity => {
            want_inputs(n, ins, 1, 1)?;
            one(ins[0].clone())
        }
        _ => Err(format!("{n} is not a elementwise op (dispatch bug)")),
    }
}

/// Shape inference of the elementwise family's gradient and update ops.
pub(crate) fn infer_grad(op: &Op, ins: &[TensorMeta]) -> Result<Vec<TensorMeta>, InferError> {
    use Op::*;
    let n = op.name();
    let f32s = |ins: &[TensorMeta]| float_of(n, ins).map(|_| ());
    let same = |a: &TensorMeta, b: &TensorMeta, what: &str| {
        if a.shape != b.shape {
            return Err(format!("{n}: {what} shapes differ: {:?} vs {:?}", a.shape, b.shape));
        }
        Ok(())
    };
    match op {
        UnaryGrad(u) => {
            want_inputs(n, ins, 2, 2)?;
            f32s(ins)?;
            if !unary_differentiable(*u) {
                return Err(format!("{n}: {} has no gradient op", unary_name(*u)));
            }
            same(&ins[0], &ins[1], "x and dy")?;
            Ok(vec![ins[0].clone()])
        }
        _ => Err(format!("{n} is not a elementwise gradient op (dispatch bug)")),
    }
}
