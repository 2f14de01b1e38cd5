//! Sharding rule of routed experts and their gradient ([`super::rule`] dispatches here).
//!
//! For now the op is replicated only: every rank computes the whole layer. A split of the
//! tokens (data parallelism) is right for y, dx and the weight gradients (partial sums) but not
//! for the auxiliary load-balancing loss, which multiplies two means over all tokens (the
//! fraction routed to each expert and its mean probability): a per-rank loss summed over ranks
//! is not the global one, and its gradient needs the global counts. Expert parallelism (the
//! experts split over an axis with all-to-all dispatch and combine) is issue 47's next slice.

use super::*;

/// The sharding rule of `Moe` or `MoeGrad`: no splittable dim, so only the replicated
/// strategy.
pub(super) fn rule(op: &Op) -> Option<Rule> {
    match op {
        Op::Moe(_) | Op::MoeGrad(_) => Some(Rule { dims: vec![], linear: vec![] }),
        // `super::rule` sends only the ops above here.
        _ => None,
    }
}
