//! Gradients of the convolution family (`vjp` dispatches here), and of `ConvInputGrad` as a
//! forward op.

use super::*;

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

/// Input gradients of a single-output conv op `op` (node `n`) given its output gradient `dy`,
/// written into `out` (one entry per input; entries of inputs with `want[i] == false` may stay
/// `None`).
pub(super) fn vjp(
    b: &mut Builder,
    n: NodeIndex,
    op: Op,
    ins: &[Value],
    dy: Value,
    want: &[bool],
    out: &mut [Option<Value>],
) -> Result<(), AutodiffError> {
    let y = Value::new(n, 0);
    let k = ins.len();
    let w = |i: usize| want.get(i).copied().unwrap_or(false);
    let sh = |b: &Builder, i: usize| b.shape(ins[i]);
    match op {
        Op::Conv(attrs) => {
            if w(0) {
                let shape = sh(b, 0);
                out[0] = Some(b.op("dx", Op::ConvInputGrad { attrs: attrs.clone(), shape }, &[dy, ins[1]])?);
            }
            if w(1) {
                let shape = sh(b, 1);
                out[1] = Some(b.op("dw", Op::ConvWeightGrad { attrs, shape }, &[ins[0], dy])?);
            }
            if k > 2 && w(2) {
                out[2] = Some(b.reduce_sum("db", dy, vec![0, 2, 3], false)?);
            }
        }
        Op::MaxPool(a) => out[0] = Some(b.op("dx", Op::MaxPoolGrad(a), &[ins[0], dy])?),
        Op::AveragePool(attrs) => {
            let shape = sh(b, 0);
            out[0] = Some(b.op("dx", Op::AveragePoolGrad { attrs, shape }, &[dy])?);
        }
        Op::GlobalAveragePool => {
            let shape = sh(b, 0);
            let area: usize = shape[2..].iter().product();
            let t = b.scale("dx.scale", dy, 1.0 / area as f32)?;
            out[0] = Some(b.expand("dx", t, &shape)?);
        }
        Op::GlobalMaxPool => {
            let m = b.bin("mask", BinaryOp::Equal, ins[0], y)?;
            out[0] = Some(b.mask("dx", m, dy, true)?);
        }
        Op::ConvInputGrad { attrs, .. } => conv_input_grad(b, &attrs, ins, dy, want, out)?,
        // `super::vjp` sends only the ops above here.
        _ => return Err(no_rule(b, n)),
    }
    Ok(())
}
