//! Gradient of fused attention (`vjp` dispatches here): one [`Op::AttentionGrad`] node that
//! recomputes the scores from Q, K and the forward's row log-sum-exp, as flash attention's
//! backward does, so no `S x T` tensor is kept between the passes.

use super::*;

/// Input gradients of attention node `n` (inputs Q, K, V and an optional mask) given the
/// gradients of its outputs (Y and the row statistic). The mask has no gradient: a mask that
/// depends on a trained parameter (a learned bias) is refused rather than given zero, and so is
/// a gradient arriving through the row statistic (which only [`Op::AttentionGrad`] reads).
pub(super) fn vjp(
    b: &mut Builder,
    n: NodeIndex,
    attrs: crate::AttentionAttrs,
    ins: &[Value],
    dys: &[Option<Value>],
    want: &[bool],
) -> Result<Vec<Option<Value>>, AutodiffError> {
    let mut out = vec![None; ins.len()];
    if want.get(3).copied().unwrap_or(false) || dys.get(1).is_some_and(Option::is_some) {
        return Err(no_rule(b, n));
    }
    let Some(Some(dy)) = dys.first() else { return Ok(out) };
    if !want.iter().take(3).any(|&w| w) {
        return Ok(out);
    }
    let mut gins = vec![ins[0], ins[1], ins[2], Value::new(n, 0), Value::new(n, 1), *dy];
    gins.extend(ins.get(3));
    let g = b.ops("d", Op::AttentionGrad(attrs), &gins)?;
    for (o, d) in out.iter_mut().zip(g) {
        *o = Some(d);
    }
    Ok(out)
}
