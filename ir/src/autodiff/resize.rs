//! Gradients of the resize family (`vjp` dispatches here).

use super::*;

/// Input gradients of a single-output resize op `op` (node `n`) given its output gradient `dy`,
/// written into `out` (one entry per input; entries of inputs with `want[i] == false` may stay
/// `None`).
pub(super) fn vjp(
    b: &mut Builder,
    n: NodeIndex,
    op: Op,
    ins: &[Value],
    dy: Value,
    _want: &[bool],
    out: &mut [Option<Value>],
) -> Result<(), AutodiffError> {
    let sh = |b: &Builder, i: usize| b.shape(ins[i]);
    match op {
        Op::Resize(attrs) => {
            let shape = sh(b, 0);
            out[0] = Some(b.op("dx", Op::ResizeGrad { attrs, shape }, &[dy])?);
        }
        // `super::vjp` sends only the ops above here.
        _ => return Err(no_rule(b, n)),
    }
    Ok(())
}
