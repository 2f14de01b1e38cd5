//! Gradients of the norm family (`vjp` dispatches here).

use super::*;

/// Input gradients of a single-output norm op `op` (node `n`) given its output gradient `dy`,
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
        Op::BatchNorm { epsilon } => batchnorm_vjp(b, ins, dy, epsilon, want, out)?,
        Op::LayerNorm { axis, epsilon } => {
            let g3 = b.ops("d", Op::LayerNormGrad { axis, epsilon }, &[ins[0], ins[1], dy])?;
            out[0] = Some(g3[0]);
            if w(1) {
                let s = sh(b, 1);
                out[1] = Some(b.sum_to("dscale", g3[1], &s)?);
            }
            if k > 2 && w(2) {
                let s = sh(b, 2);
                out[2] = Some(b.sum_to("dbias", g3[2], &s)?);
            }
        }
        Op::BatchNormTrain { epsilon } => {
            // The full gradient, through the batch mean and variance (one fused op).
            let g3 = b.ops("d", Op::BatchNormTrainGrad { epsilon }, &[ins[0], ins[1], dy])?;
            out[0] = Some(g3[0]);
            out[1] = Some(g3[1]);
            out[2] = Some(g3[2]);
        }
        Op::Lrn { size, alpha, beta, bias } => {
            out[0] = Some(b.op("dx", Op::LrnGrad { size, alpha, beta, bias }, &[ins[0], dy])?)
        }
        Op::Softmax { axis } => out[0] = Some(b.op("dx", Op::SoftmaxGrad { axis, log: false }, &[y, dy])?),
        Op::LogSoftmax { axis } => out[0] = Some(b.op("dx", Op::SoftmaxGrad { axis, log: true }, &[y, dy])?),
        // `super::vjp` sends only the ops above here.
        _ => return Err(no_rule(b, n)),
    }
    Ok(())
}
