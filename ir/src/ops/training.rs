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
    // Mixed precision keeps gradients in 16 bits until the update: the gradient may be a 16-bit
    // float where the parameter is f32 (the kernel widens it).
    let grad = |ins: &[TensorMeta]| {
        let (p, g) = (ins[0].dtype, ins[1].dtype);
        if g == p || (g.is_half() && p == DType::F32) {
            Ok(())
        } else {
            Err(format!("{n}: gradient is {g}, parameter {p}"))
        }
    };
    // The optional trailing lr factor (a schedule's value): a scalar of the parameter's type.
    let factor = |ins: &[TensorMeta], at: usize| {
        let Some(f) = ins.get(at) else { return Ok(()) };
        want_dtype(n, f, ins[0].dtype, "lr factor")?;
        if !f.shape.is_empty() {
            return Err(format!("{n}: the lr factor must be a scalar, got {:?}", f.shape));
        }
        Ok(())
    };
    match op {
        SgdUpdate { momentum, .. } => {
            let k = if *momentum != 0.0 { 3 } else { 2 };
            want_inputs(n, ins, k, k + 1)?;
            let mut rest = vec![ins[0].clone()];
            rest.extend(ins[2..k].iter().cloned());
            f32s(&rest)?;
            grad(ins)?;
            for m in &ins[1..k] {
                same(&ins[0], m, "parameter and gradient/state")?;
            }
            factor(ins, k)?;
            Ok(vec![ins[0].clone(); k - 1])
        }
        AdamWUpdate { .. } => {
            want_inputs(n, ins, 5, 6)?;
            f32s(&[ins[0].clone(), ins[2].clone(), ins[3].clone()])?;
            grad(ins)?;
            for m in &ins[1..4] {
                same(&ins[0], m, "parameter and gradient/state")?;
            }
            want_dtype(n, &ins[4], DType::I64, "step")?;
            if !ins[4].shape.is_empty() {
                return Err(format!("{n}: step must be a scalar, got {:?}", ins[4].shape));
            }
            factor(ins, 5)?;
            Ok(vec![ins[0].clone(); 3])
        }
        _ => Err(format!("{n} is not a training gradient op (dispatch bug)")),
    }
}
