//! Sharding rules of the shape family ([`super::rule`] dispatches here).

use super::*;

/// The sharding rule of a shape op (see [`super::rule`]).
pub(super) fn rule(op: &Op, ins: &[TensorMeta], outs: &[TensorMeta]) -> Option<Rule> {
    use Op::*;
    let (ni, no) = (ins.len(), outs.len());
    let r = |dims: Vec<LogicalDim>, linear: Vec<Vec<usize>>| Some(Rule { dims, linear });
    match op {
        Expand { .. } => r(elementwise(ins, outs, &[]), vec![vec![0]]),
        Reshape { .. } => r(reshape_dims(&ins[0].shape, &outs[0].shape), vec![vec![0]]),
        Transpose { perm } => {
            let dims = perm
                .iter()
                .enumerate()
                .filter(|(d, _)| outs[0].shape[*d] > 1)
                .map(|(d, &p)| {
                    let mut l = ldim(format!("d{p}"), outs[0].shape[d], ni, no);
                    l.ins[0] = InMap::Dim(p);
                    l.outs[0] = Some(d);
                    l
                })
                .collect();
            r(dims, vec![vec![0]])
        }
        Concat { axis } => r(elementwise(ins, outs, &[*axis]), vec![(0..ni).collect()]),
        Split { axis, .. } => {
            let mut dims = elementwise(ins, &outs[..1], &[*axis]);
            for l in &mut dims {
                l.outs = vec![l.outs[0]; no];
            }
            r(dims, vec![vec![0]])
        }
        Slice { axes } | SliceGrad { axes, .. } => {
            let skip: Vec<usize> = axes.iter().map(|a| a.axis).collect();
            r(elementwise(ins, outs, &skip), vec![vec![0]])
        }
        Pad { pads, value } => {
            let rank = outs[0].rank();
            let skip: Vec<usize> = (0..rank).filter(|&d| pads[d] != 0 || pads[d + rank] != 0).collect();
            r(elementwise(ins, outs, &skip), if *value == 0.0 { vec![vec![0]] } else { vec![] })
        }
        Gather { axis } => {
            let (data, idx) = (&ins[0].shape, &ins[1].shape);
            let mut dims = vec![];
            for (d, &size) in data.iter().enumerate() {
                let mut l = ldim(if d == *axis { "vocab".to_string() } else { format!("d{d}") }, size, ni, no);
                l.ins[0] = InMap::Dim(d);
                if d == *axis {
                    l.special = Some(SpecialKind::MaskedGather);
                } else {
                    l.outs[0] = Some(if d < *axis { d } else { d - 1 + idx.len() });
                }
                dims.push(l);
            }
            for (d, &size) in idx.iter().enumerate() {
                let mut l = ldim(format!("i{d}"), size, ni, no);
                l.ins[1] = InMap::Dim(d);
                l.outs[0] = Some(axis + d);
                dims.push(l);
            }
            r(dims.into_iter().filter(|l| l.size > 1).collect(), vec![vec![0]])
        }
        GatherGrad { axis, shape } => {
            let (idx, dy) = (&ins[0].shape, &ins[1].shape);
            let mut dims = vec![];
            for (d, &size) in shape.iter().enumerate() {
                if d == *axis {
                    let mut l = ldim("vocab", size, ni, no);
                    l.outs[0] = Some(d);
                    l.special = Some(SpecialKind::MaskedScatter);
                    dims.push(l);
                    continue;
                }
                let mut l = ldim(format!("d{d}"), size, ni, no);
                l.ins[1] = InMap::Dim(if d < *axis { d } else { d - 1 + idx.len() });
                l.outs[0] = Some(d);
                dims.push(l);
            }
            for (d, &size) in idx.iter().enumerate() {
                let mut l = ldim(format!("i{d}"), size, ni, no);
                l.ins[0] = InMap::Dim(d);
                l.ins[1] = InMap::Dim(axis + d);
                dims.push(l);
            }
            debug_assert!(dy.len() == shape.len() - 1 + idx.len());
            r(dims.into_iter().filter(|l| l.size > 1).collect(), vec![vec![1]])
        }
        // `super::rule` sends only the ops above here.
        _ => None,
    }
}
