//! Gradients of the indexing family ([`IndexOp`]), built from the family's own ops: a gather's
//! gradient scatter-adds into zeros, a scatter's masks the data's gradient where it wrote and
//! gathers the updates' gradient, a cumulative sum's is the cumulative sum the other way, a
//! triangle's is the same triangle, top-k's scatters the values' gradient back to their indices.
//! Indices never get a gradient; arg-reductions and scatters with a multiplicative or max/min
//! reduction are not differentiable ([`IndexOp::differentiable`] keeps them off gradient paths).

use super::{AutodiffError, Builder, no_rule};
use crate::NodeIndex;
use crate::graph::Value;
use crate::op::Op;
use crate::ops::index::{IndexOp, ScatterReduction};

/// Input gradients of node `n` (an [`Op::Index`]) given its output gradients, as `vjp` returns
/// them: one entry per input, `None` where no gradient flows or none is wanted.
pub(super) fn vjp(
    b: &mut Builder,
    n: NodeIndex,
    op: &IndexOp,
    ins: &[Value],
    dys: &[Option<Value>],
    want: &[bool],
) -> Result<Vec<Option<Value>>, AutodiffError> {
    let mut out: Vec<Option<Value>> = vec![None; ins.len()];
    let w = |i: usize| want.get(i).copied().unwrap_or(false);
    // Only the first output (the values; top-k's second output is its i64 indices) carries one.
    let Some(Some(dy)) = dys.first().copied() else { return Ok(out) };
    let idx = |op: IndexOp| Op::Index(op);
    match op.clone() {
        IndexOp::Trilu { .. } => out[0] = Some(b.op("dx", idx(op.clone()), &[dy])?),
        IndexOp::CumSum { axis, exclusive, reverse } => {
            out[0] = Some(b.op("dx", idx(IndexOp::CumSum { axis, exclusive, reverse: !reverse }), &[dy])?)
        }
        IndexOp::GatherNd { batch_dims: 0 } if w(0) => {
            let z = b.zeros("dx.zeros", &b.shape(ins[0]), ins[0])?;
            let scatter = IndexOp::ScatterNd { reduction: ScatterReduction::Add };
            out[0] = Some(b.op("dx", idx(scatter), &[z, ins[1], dy])?);
        }
        IndexOp::GatherElements { axis } if w(0) => {
            let z = b.zeros("dx.zeros", &b.shape(ins[0]), ins[0])?;
            let scatter = IndexOp::ScatterElements { axis, reduction: ScatterReduction::Add };
            out[0] = Some(b.op("dx", idx(scatter), &[z, ins[1], dy])?);
        }
        IndexOp::ScatterNd { reduction } | IndexOp::ScatterElements { reduction, .. }
            if matches!(reduction, ScatterReduction::None | ScatterReduction::Add) =>
        {
            let gather = match op {
                IndexOp::ScatterElements { axis, .. } => IndexOp::GatherElements { axis: *axis },
                _ => IndexOp::GatherNd { batch_dims: 0 },
            };
            if w(0) {
                // Replaced targets do not see the old data; added ones do.
                out[0] = Some(if reduction == ScatterReduction::None {
                    let z = b.zeros("ddata.zeros", &b.shape(ins[2]), ins[2])?;
                    b.op("ddata", idx(op.clone()), &[dy, ins[1], z])?
                } else {
                    dy
                });
            }
            if w(2) {
                out[2] = Some(b.op("dupdates", idx(gather), &[dy, ins[1]])?);
            }
        }
        IndexOp::TopK { axis, .. } if w(0) => {
            let z = b.zeros("dx.zeros", &b.shape(ins[0]), ins[0])?;
            let scatter = IndexOp::ScatterElements { axis, reduction: ScatterReduction::Add };
            let picked = Value::new(n, 1);
            out[0] = Some(b.op("dx", idx(scatter), &[z, picked, dy])?);
        }
        IndexOp::GatherNd { .. } | IndexOp::GatherElements { .. } | IndexOp::TopK { .. } if !w(0) => {}
        // No rule: GatherND with batch dims, scatters that multiply or take a max or min, and the
        // arg-reductions. Every variant is named (no wildcard; the arms above with guards
        // reappear here), so a new indexing op decides its gradient here.
        IndexOp::GatherNd { .. }
        | IndexOp::GatherElements { .. }
        | IndexOp::TopK { .. }
        | IndexOp::ScatterNd { .. }
        | IndexOp::ScatterElements { .. }
        | IndexOp::ArgMax { .. }
        | IndexOp::ArgMin { .. } => return Err(no_rule(b, n)),
    }
    Ok(out)
}
