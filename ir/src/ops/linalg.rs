//! Matrix products: `MatMul` (numpy batch broadcasting, 1-D operands) and `Gemm`.
//!
//! [`crate::Op::infer`] dispatches the family's ops here. Its other stages: gradients in
//! `autodiff/linalg.rs`, import in `tracer/src/import/linalg.rs`, sharding rules in
//! `sharding/src/strategy/linalg.rs`, kernels in `kernels/src/{cpu,cuda}/linalg.rs`.

use crate::op::{InferError, Op, broadcast, float_of, matmul_shape, want_inputs};
use crate::tensor::TensorMeta;
/// Shape inference of the linalg family's forward ops.
pub(crate) fn infer(op: &Op, ins: &[TensorMeta]) -> Result<Vec<TensorMeta>, InferError> {
    use Op::*;
    let n = op.name();
    let one = |m: TensorMeta| Ok(vec![m]);
    match op {
        MatMul => {
            want_inputs(n, ins, 2, 2)?;
            let dt = float_of(n, ins)?;
            matmul_shape(&ins[0].shape, &ins[1].shape).map(|s| vec![TensorMeta::new(dt, s)])
        }
        Gemm { trans_a, trans_b, .. } => {
            want_inputs(n, ins, 2, 3)?;
            let dt = float_of(n, ins)?;
            let (a, b) = (&ins[0].shape, &ins[1].shape);
            if a.len() != 2 || b.len() != 2 {
                return Err(format!("{n}: A and B must be 2-D, got {a:?} and {b:?}"));
            }
            let (m, k) = if *trans_a { (a[1], a[0]) } else { (a[0], a[1]) };
            let (k2, nn) = if *trans_b { (b[1], b[0]) } else { (b[0], b[1]) };
            if k != k2 {
                return Err(format!("{n}: inner dims differ: A{a:?} B{b:?} (trans_a={trans_a}, trans_b={trans_b})"));
            }
            if let Some(c) = ins.get(2) {
                let bc = broadcast(&[m, nn], &c.shape).map_err(|e| format!("{n}: C: {e}"))?;
                if bc != [m, nn] {
                    return Err(format!("{n}: C {:?} does not broadcast to [{m}, {nn}]", c.shape));
                }
            }
            one(TensorMeta::new(dt, vec![m, nn]))
        }
        _ => Err(format!("{n} is not a linalg op (dispatch bug)")),
    }
}
