//! Sharding rules of the resize family ([`super::rule`] dispatches here).

use super::*;

/// The sharding rule of a resize op (see [`super::rule`]).
pub(super) fn rule(op: &Op, ins: &[TensorMeta], outs: &[TensorMeta]) -> Option<Rule> {
    use Op::*;
    let r = |dims: Vec<LogicalDim>, linear: Vec<Vec<usize>>| Some(Rule { dims, linear });
    match op {
        // Linear in its input; every axis but the resized ones splits as elementwise.
        Resize(a) | ResizeGrad { attrs: a, .. } => {
            let skip: Vec<usize> = a.axes.iter().map(|x| x.axis).collect();
            r(elementwise(ins, outs, &skip), vec![vec![0]])
        }
        // `super::rule` sends only the ops above here.
        _ => None,
    }
}
