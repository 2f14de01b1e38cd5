//! Sharding rules of the conv family ([`super::rule`] dispatches here).

use super::*;

/// The sharding rule of a conv op (see [`super::rule`]).
pub(super) fn rule(op: &Op, ins: &[TensorMeta], outs: &[TensorMeta]) -> Option<Rule> {
    use Op::*;
    let (ni, no) = (ins.len(), outs.len());
    let r = |dims: Vec<LogicalDim>, linear: Vec<Vec<usize>>| Some(Rule { dims, linear });
    match op {
        Conv(a) => {
            let (x, w) = (&ins[0].shape, &ins[1].shape);
            let mut dn = ldim("batch", x[0], ni, no);
            dn.ins[0] = InMap::Dim(0);
            dn.outs[0] = Some(0);
            let mut dims = vec![dn];
            if a.group == 1 {
                let mut dm = ldim("out_ch", w[0], ni, no);
                dm.ins[1] = InMap::Dim(0);
                if ni > 2 {
                    dm.ins[2] = InMap::Dim(0);
                }
                dm.outs[0] = Some(1);
                let mut dc = ldim("in_ch", x[1], ni, no);
                dc.ins[0] = InMap::Dim(1);
                dc.ins[1] = InMap::Dim(1);
                if ni > 2 {
                    dc.ins[2] = InMap::Partial;
                }
                dims.extend([dm, dc]);
            }
            r(dims, if ni > 2 { vec![] } else { vec![vec![0], vec![1]] })
        }
        ConvInputGrad { attrs, .. } => {
            let (dy, w) = (&ins[0].shape, &ins[1].shape);
            let mut dn = ldim("batch", dy[0], ni, no);
            dn.ins[0] = InMap::Dim(0);
            dn.outs[0] = Some(0);
            let mut dims = vec![dn];
            if attrs.group == 1 {
                let mut dm = ldim("out_ch", w[0], ni, no);
                dm.ins[0] = InMap::Dim(1);
                dm.ins[1] = InMap::Dim(0);
                let mut dc = ldim("in_ch", w[1], ni, no);
                dc.ins[1] = InMap::Dim(1);
                dc.outs[0] = Some(1);
                dims.extend([dm, dc]);
            }
            r(dims, vec![vec![0], vec![1]])
        }
        ConvWeightGrad { attrs, .. } => {
            let (x, dy) = (&ins[0].shape, &ins[1].shape);
            let mut dn = ldim("batch", x[0], ni, no);
            dn.ins = vec![InMap::Dim(0), InMap::Dim(0)];
            let mut dims = vec![dn];
            if attrs.group == 1 {
                let mut dm = ldim("out_ch", dy[1], ni, no);
                dm.ins[1] = InMap::Dim(1);
                dm.outs[0] = Some(0);
                let mut dc = ldim("in_ch", x[1], ni, no);
                dc.ins[0] = InMap::Dim(1);
                dc.outs[0] = Some(1);
                dims.extend([dm, dc]);
            }
            r(dims, vec![vec![0], vec![1]])
        }
        MaxPool(_) | AveragePool(_) | GlobalAveragePool | GlobalMaxPool => {
            let linear = if matches!(op, AveragePool(_) | GlobalAveragePool) { vec![vec![0]] } else { vec![] };
            r(channel_dims(ins, outs, &[0, 1]), linear)
        }
        MaxPoolGrad(_) => r(channel_dims(ins, outs, &[0, 1]), vec![vec![1]]),
        AveragePoolGrad { .. } => r(channel_dims(ins, outs, &[0, 1]), vec![vec![0]]),
        // `super::rule` sends only the ops above here.
        _ => None,
    }
}
