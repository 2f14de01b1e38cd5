//! Sharding rules of the training family ([`super::rule`] dispatches here).

use super::*;

/// The sharding rule of a training op (see [`super::rule`]).
pub(super) fn rule(op: &Op, ins: &[TensorMeta], outs: &[TensorMeta]) -> Option<Rule> {
    use Op::*;
    let r = |dims: Vec<LogicalDim>, linear: Vec<Vec<usize>>| Some(Rule { dims, linear });
    match op {
        SgdUpdate { .. } | AdamWUpdate { .. } => r(elementwise(ins, outs, &[]), vec![]),
        // `super::rule` sends only the ops above here.
        _ => None,
    }
}
