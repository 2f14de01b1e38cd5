//! Optimizer updates (`SgdUpdate`, `AdamWUpdate`): shape checks of parameter, gradient and state.
//!
//! [`crate::Op::infer`] dispatches the family's ops here. `autodiff::training_graph` builds them
//! (nothing imports or differentiates them); sharding rules in `sharding/src/strategy/training.rs`,
//! kernels in `kernels/src/cpu/mod.rs` and `kernels/src/cuda/optim.rs`.

use crate::op::{InferError, Op, float_of, want_dtype, want_inputs};
use crate::tensor::{DType, TensorMeta};
/// Shape inference of the training family's gradient and update ops.
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
        SgdUpdate { momentum, .. } => {
            let k = if *momentum != 0.0 { 3 } else { 2 };
            want_inputs(n, ins, k, k)?;
            f32s(ins)?;
            for m in &ins[1..] {
                same(&ins[0], m, "parameter and gradient/state")?;
            }
            Ok(vec![ins[0].clone(); k - 1])
        }
        AdamWUpdate { .. } => {
            want_inputs(n, ins, 5, 5)?;
            f32s(&ins[..4])?;
            for m in &ins[1..4] {
                same(&ins[0], m, "parameter and gradient/state")?;
            }
            want_dtype(n, &ins[4], DType::I64, "step")?;
            if !ins[4].shape.is_empty() {
                return Err(format!("{n}: step must be a scalar, got {:?}", ins[4].shape));
            }
            Ok(vec![ins[0].clone(); 3])
        }
        _ => Err(format!("{n} is not a training gradient op (dispatch bug)")),
    }
}
