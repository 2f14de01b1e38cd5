//! Gradients of the activation family's ops that are not a single `UnaryGrad` (see
//! [`crate::ops::activation`]).

use super::{AutodiffError, Builder};
use crate::graph::Value;
use crate::op::{BinaryOp, Op};

/// PRelu `y = x < 0 ? slope x : x`: `dx = x > 0 ? dy : slope dy`, and the slope's gradient is
/// `x > 0 ? 0 : x dy` summed back to the slope's shape (it is broadcast to x). At x = 0 the
/// slope side is taken, as PyTorch does.
pub(super) fn prelu_vjp(
    b: &mut Builder,
    x: Value,
    slope: Value,
    dy: Value,
    want: [bool; 2],
    out: &mut [Option<Value>],
) -> Result<(), AutodiffError> {
    let zero = b.scalar("zero", 0.0, x);
    let pos = b.bin("pos", BinaryOp::Greater, x, zero)?;
    if want[0] {
        let sdy = b.mul("dx.slope", dy, slope)?;
        out[0] = Some(b.op("dx", Op::Where, &[pos, dy, sdy])?);
    }
    if want[1] {
        let xdy = b.mul("dslope.mul", dy, x)?;
        let t = b.mask("dslope.where", pos, xdy, false)?;
        let shape = b.shape(slope);
        out[1] = Some(b.sum_to("dslope", t, &shape)?);
    }
    Ok(())
}
