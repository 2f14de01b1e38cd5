//! Reductions (`Reduce` over sorted, distinct axes, with or without kept dims).
//!
//! [`crate::Op::infer`] dispatches the family's ops here. Its other stages: gradients in
//! `autodiff/reduce.rs`, import in `tracer/src/import/reduce.rs`, sharding rules in
//! `sharding/src/strategy/reduce.rs`, kernels in `kernels/src/{cpu,cuda}/reduce.rs`.

use crate::op::{InferError, Op, ReduceOp, reduced_shape, want_float, want_inputs};
use crate::tensor::{DType, TensorMeta};
/// Shape inference of the reduce family's forward ops.
pub(crate) fn infer(op: &Op, ins: &[TensorMeta]) -> Result<Vec<TensorMeta>, InferError> {
    use Op::*;
    let n = op.name();
    let one = |m: TensorMeta| Ok(vec![m]);
    match op {
        Reduce { axes, keepdims, op } => {
            want_inputs(n, ins, 1, 1)?;
            let x = &ins[0];
            if matches!(op, ReduceOp::Max | ReduceOp::Min) {
                // On bool, max is `any` and min is `all` (ONNX opset 20).
            } else if matches!(op, ReduceOp::Sum | ReduceOp::Prod) {
                if x.dtype == DType::Bool {
                    return Err(format!("{n}: input must be numeric"));
                }
            } else {
                want_float(n, x)?;
            }
            if axes.iter().any(|&a| a >= x.rank()) || axes.windows(2).any(|w| w[0] >= w[1]) {
                return Err(format!("{n}: axes {axes:?} must be sorted, unique and < {}", x.rank()));
            }
            let s = reduced_shape(&x.shape, axes, *keepdims);
            one(TensorMeta { shape: s, dtype: x.dtype })
        }
        _ => Err(format!("{n} is not a reduce op (dispatch bug)")),
    }
}
