//! Gradients of the convolution family beyond `Conv` itself.

use super::{AutodiffError, Builder};
use crate::graph::Value;
use crate::op::{ConvAttrs, Op};

/// Gradients of [`Op::ConvInputGrad`] as a forward op (ONNX `ConvTranspose` imports as one):
/// `y = A_W^T x` where `A_W` is the convolution by `W`, so `dx = A_W dy` (a `Conv` of dy) and
/// `dW` is the weight gradient of that convolution with the roles of image and output swapped
/// (`ConvWeightGrad` of image dy and output gradient x).
pub(super) fn conv_input_grad(
    b: &mut Builder,
    attrs: &ConvAttrs,
    ins: &[Value],
    dy: Value,
    want: &[bool],
    out: &mut [Option<Value>],
) -> Result<(), AutodiffError> {
    if want.first().copied().unwrap_or(false) {
        out[0] = Some(b.op("dx", Op::Conv(attrs.clone()), &[dy, ins[1]])?);
    }
    if want.get(1).copied().unwrap_or(false) {
        let shape = b.shape(ins[1]);
        out[1] = Some(b.op("dw", Op::ConvWeightGrad { attrs: attrs.clone(), shape }, &[dy, ins[0]])?);
    }
    Ok(())
}
