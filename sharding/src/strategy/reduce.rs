//! Sharding rules of the reduce family ([`super::rule`] dispatches here).

use super::*;

/// The sharding rule of a reduce op (see [`super::rule`]).
pub(super) fn rule(op: &Op, ins: &[TensorMeta], outs: &[TensorMeta]) -> Option<Rule> {
    use Op::*;
    let (ni, no) = (ins.len(), outs.len());
    let r = |dims: Vec<LogicalDim>, linear: Vec<Vec<usize>>| Some(Rule { dims, linear });
    match op {
        Reduce { op: rop, axes, keepdims } => {
            let x = &ins[0].shape;
            let summing = matches!(rop, ReduceOp::Sum | ReduceOp::SumSquare | ReduceOp::L1);
            let mut dims = vec![];
            let mut o = 0;
            for (d, &size) in x.iter().enumerate() {
                let reduced = axes.contains(&d);
                let out_dim = if reduced && !keepdims { None } else { Some(o) };
                if !reduced || *keepdims {
                    o += 1;
                }
                if size <= 1 || (reduced && !summing) {
                    continue;
                }
                let mut l = ldim(format!("d{d}"), size, ni, no);
                l.ins[0] = InMap::Dim(d);
                l.outs[0] = if reduced { None } else { out_dim };
                dims.push(l);
            }
            let linear = if matches!(rop, ReduceOp::Sum | ReduceOp::Mean) { vec![vec![0]] } else { vec![] };
            r(dims, linear)
        }
        // `super::rule` sends only the ops above here.
        _ => None,
    }
}
