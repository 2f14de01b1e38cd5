//! A lower bound on the step of every plan of a training graph, and its model FLOPs.
//!
//! [`floor`] prices every op of the training graph whole, on one device of the profile (its
//! compute seconds under the cost model: a roofline, or a family's fit), and divides the work of
//! one step by the number of devices: the pass's ops once per microbatch, the update part once.
//!
//! Why it bounds every plan, whatever its layouts, stages, schedule, microbatching or
//! recomputation: every op runs on at least the devices of one stage holding all of its
//! output, each computing a block at least its share of the whole, so the devices together
//! spend at least the whole op's seconds on it (true of a roofline at peak, whose seconds are
//! linear in FLOPs and bytes, and of any fit whose seconds grow no faster than linearly in
//! size, which a fixed cost per op and a rate that improves with size give); collectives,
//! transfers, waiting in a pipeline's bubble and recomputation only add; and a step lasts at
//! least as long as its busiest device, which is at least the average. The bound ignores
//! communication entirely, so its gap is also what the plan spends beyond perfectly divided
//! compute.

use ir::{Graph, NodeIndex, Op};
use sharding::{DeviceMesh, DeviceProfile};

use crate::Result;

/// [`floor`]'s result.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Floor {
    /// Seconds no plan's step can beat on the given number of devices.
    pub seconds: f64,
    /// FLOPs of one step's training graph (no recomputation), the numerator of MFU.
    pub flops: f64,
}

/// The floor of the training graph `g` (one microbatch's, its update part once per step) run
/// `microbatches` times per step on `devices` devices of `profile` (see the module docs).
pub fn floor(g: &Graph, devices: usize, profile: &DeviceProfile, microbatches: usize) -> Result<Floor> {
    let one = DeviceMesh::uniform(&[1])?;
    let (_, update) = crate::microbatch::update_part(g);
    let mut out = Floor::default();
    let m = microbatches.max(1) as f64;
    for n in g.g.node_indices() {
        let node = g.node(n);
        if node.op.is_source() || matches!(node.op, Op::Constant(_)) {
            continue;
        }
        let times = if update.get(n.index()).copied().unwrap_or(false) { 1.0 } else { m };
        let seconds =
            sharding::strategies(g, n, &one, profile)?.iter().map(|s| s.compute_seconds).fold(f64::INFINITY, f64::min);
        if seconds.is_finite() {
            out.seconds += seconds * times;
        }
        let ins: Vec<ir::TensorMeta> = g.node_inputs(n).iter().map(|v| g.meta(*v).clone()).collect();
        out.flops += node.op.flops(&ins, &node.outputs) as f64 * times;
    }
    out.seconds /= devices.max(1) as f64;
    Ok(out)
}

/// Writes the floor of `plan`'s step into it (`solver.plan_bound_seconds`) with its model FLOPs
/// and estimated MFU (`estimate.model_flops`, `estimate.mfu`: the FLOPs over the step times the
/// devices' peak rate at the plan's precision).
pub fn certify(plan: &mut ::plan::Plan, profile: &DeviceProfile) -> Result<()> {
    let devices = plan.mesh.shape.iter().product::<usize>();
    let g = &plan.graph;
    // The graph is canonical (node `i` at index `i`): update_part indexes by node index.
    debug_assert!(g.g.node_indices().enumerate().all(|(i, n)| n == NodeIndex::new(i)));
    let f = floor(g, devices, profile, plan.microbatches)?;
    plan.solver.plan_bound_seconds = f.seconds.min(plan.estimate.step_seconds);
    plan.estimate.model_flops = f.flops;
    let peak =
        if crate::lower::precision_of(g) == ::plan::Precision::F32 { profile.f32_flops } else { profile.bf16_flops };
    let step = plan.estimate.step_seconds;
    plan.estimate.mfu = if step > 0.0 && peak > 0.0 { f.flops / (step * devices as f64 * peak) } else { 0.0 };
    Ok(())
}
