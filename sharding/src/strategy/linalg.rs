//! Sharding rules of the linalg family ([`super::rule`] dispatches here).

use super::*;

/// The sharding rule of a linalg op (see [`super::rule`]).
pub(super) fn rule(op: &Op, ins: &[TensorMeta], outs: &[TensorMeta]) -> Option<Rule> {
    use Op::*;
    let (ni, no) = (ins.len(), outs.len());
    let r = |dims: Vec<LogicalDim>, linear: Vec<Vec<usize>>| Some(Rule { dims, linear });
    match op {
        MatMul => matmul_rule(ins, outs),
        Gemm { trans_a, trans_b, .. } => {
            let (a, b) = (&ins[0].shape, &ins[1].shape);
            let (m, k) = if *trans_a { (a[1], a[0]) } else { (a[0], a[1]) };
            let n = if *trans_b { b[0] } else { b[1] };
            let out = &outs[0].shape;
            let cmap = ins.get(2).map(|c| broadcast_map(out, &c.shape));
            let mut dm = ldim("m", m, ni, no);
            dm.ins[0] = InMap::Dim(usize::from(*trans_a));
            dm.outs[0] = Some(0);
            let mut dn = ldim("n", n, ni, no);
            dn.ins[1] = InMap::Dim(usize::from(!*trans_b));
            dn.outs[0] = Some(1);
            let mut dk = ldim("k", k, ni, no);
            dk.ins[0] = InMap::Dim(usize::from(!*trans_a));
            dk.ins[1] = InMap::Dim(usize::from(*trans_b));
            if let Some(cm) = &cmap {
                dm.ins[2] = cm[0].map_or(InMap::Replicate, InMap::Dim);
                dn.ins[2] = cm[1].map_or(InMap::Replicate, InMap::Dim);
                dk.ins[2] = InMap::Partial;
            }
            let linear = if ni > 2 { vec![vec![0, 2], vec![1, 2]] } else { vec![vec![0], vec![1]] };
            r(vec![dm, dn, dk], linear)
        }
        // `super::rule` sends only the ops above here.
        _ => None,
    }
}
