//! Gradients of the shape family (`vjp` dispatches here).

use super::*;

/// Input gradients of a single-output shape op `op` (node `n`) given its output gradient `dy`,
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
    let k = ins.len();
    let w = |i: usize| want.get(i).copied().unwrap_or(false);
    let sh = |b: &Builder, i: usize| b.shape(ins[i]);
    match op {
        Op::Reshape { .. } => {
            let s = sh(b, 0);
            out[0] = Some(b.reshape("dx", dy, &s)?);
        }
        Op::Transpose { perm } => {
            let mut inv = vec![0; perm.len()];
            for (i, &p) in perm.iter().enumerate() {
                inv[p] = i;
            }
            out[0] = Some(b.transpose("dx", dy, inv)?);
        }
        Op::Expand { .. } => {
            let s = sh(b, 0);
            out[0] = Some(b.sum_to("dx", dy, &s)?);
        }
        Op::Concat { axis } => {
            let sizes: Vec<usize> = (0..k).map(|i| sh(b, i)[axis]).collect();
            let parts = if k == 1 { vec![dy] } else { b.ops("dx", Op::Split { axis, sizes }, &[dy])? };
            for (i, p) in parts.into_iter().enumerate() {
                if w(i) {
                    out[i] = Some(p);
                }
            }
        }
        Op::Slice { axes } => {
            let shape = sh(b, 0);
            out[0] = Some(if axes.iter().all(|a| a.step == 1) {
                let r = shape.len();
                let mut pads = vec![0; 2 * r];
                for a in &axes {
                    pads[a.axis] = a.start as usize;
                    pads[a.axis + r] = shape[a.axis] - a.start as usize - a.len;
                }
                b.op("dx", Op::Pad { pads, value: 0.0 }, &[dy])?
            } else {
                b.op("dx", Op::SliceGrad { axes, shape }, &[dy])?
            });
        }
        Op::Gather { axis } => {
            let shape = sh(b, 0);
            out[0] = Some(b.op("dx", Op::GatherGrad { axis, shape }, &[ins[1], dy])?);
        }
        Op::Pad { pads, .. } => {
            let shape = sh(b, 0);
            let r = shape.len();
            let axes: Vec<SliceAxis> = (0..r)
                .filter(|&d| pads[d] != 0 || pads[d + r] != 0)
                .map(|d| SliceAxis { axis: d, start: pads[d] as i64, len: shape[d], step: 1 })
                .collect();
            out[0] = Some(if axes.is_empty() { dy } else { b.op("dx", Op::Slice { axes }, &[dy])? });
        }
        // `super::vjp` sends only the ops above here.
        _ => return Err(no_rule(b, n)),
    }
    Ok(())
}
