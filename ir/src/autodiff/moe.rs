//! Gradient of routed experts (`vjp` dispatches here): one [`Op::MoeGrad`] node that recomputes
//! the routing and the experts' hidden activations from the forward's inputs, so nothing of
//! size tokens x top_k x ffn is kept between the passes.

use super::*;

/// Input gradients of a MoE node (inputs x, the router and the expert weights) given the
/// gradients of its outputs (y and the auxiliary loss; either may be absent, read as zero).
pub(super) fn vjp(
    b: &mut Builder,
    attrs: crate::MoeAttrs,
    ins: &[Value],
    dys: &[Option<Value>],
    want: &[bool],
) -> Result<Vec<Option<Value>>, AutodiffError> {
    let mut out = vec![None; ins.len()];
    let dy = dys.first().copied().flatten();
    let daux = dys.get(1).copied().flatten();
    if (dy.is_none() && daux.is_none()) || !want.iter().any(|&w| w) {
        return Ok(out);
    }
    let dy = match dy {
        Some(d) => d,
        None => {
            let shape = b.shape(ins[0]);
            b.zeros("dy", &shape, ins[0])?
        }
    };
    let daux = match daux {
        Some(d) => d,
        None => b.zeros("daux", &[], ins[0])?,
    };
    let mut gins = ins.to_vec();
    gins.extend([dy, daux]);
    let g = b.ops("d", Op::MoeGrad(attrs), &gins)?;
    for (o, d) in out.iter_mut().zip(g) {
        *o = Some(d);
    }
    Ok(out)
}
