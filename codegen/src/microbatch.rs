//! Microbatches: a step that runs the forward and backward of M microbatches one after the
//! other, sums their gradients, and updates once (gradient accumulation).
//!
//! [`split`] rewrites a lowered program (made for one microbatch, from a training graph whose
//! gradients are scaled by 1/M: `ir::autodiff::TrainingGraph::with_gradient_scale`):
//!
//! 1. **The update part** is the optimizer's update ops, the sources and values only they read
//!    that do not depend on the batch (optimizer state, the step counter and its increment),
//!    and the conversions of their inputs. It moves, in order, to the end of the program
//!    (`update_from`): nothing before reads it.
//! 2. **Accumulated values** are the batch-dependent values the update part reads (the
//!    gradients, in the layouts the pass writes them): the runtime sums them over the
//!    microbatches before the update part runs once.
//! 3. Frees are placed again; the memory estimate is the larger of the whole walk's peak and
//!    the microbatch part's peak plus one accumulator of those values (held while the next
//!    microbatch runs) and the largest of them (a sum being formed).
//!
//! Invariant: with M microbatches of the graph's batch, a step computes the gradient of the
//! mean of their losses (each microbatch's mean loss, scaled by 1/M) and applies it once.

use std::collections::HashSet;

use ir::{NodeIndex, Op};
use sharding::DeviceMesh;

use crate::plan::{Instr, Plan, ValueRef};
use crate::{Error, Result};

/// Rewrites `plan` (lowered for one microbatch, checkpointing off) to run `microbatches` of
/// them per step (see the module docs).
pub fn split(mut plan: Plan, mesh: &DeviceMesh, microbatches: usize) -> Result<Plan> {
    if microbatches <= 1 {
        return Ok(plan);
    }
    let g = &plan.graph;
    let n = g.g.node_count();
    let node = |i: usize| g.node(NodeIndex::new(i));
    let inputs_of: Vec<Vec<usize>> =
        (0..n).map(|i| g.node_inputs(NodeIndex::new(i)).iter().map(|v| v.node.index()).collect()).collect();
    let mut consumers: Vec<Vec<usize>> = vec![vec![]; n];
    for (i, ins) in inputs_of.iter().enumerate() {
        for &j in ins {
            consumers[j].push(i);
        }
    }
    // Program node ids are topological.
    let mut batch = vec![false; n];
    for i in 0..n {
        batch[i] = matches!(node(i).op, Op::Input { .. }) || inputs_of[i].iter().any(|&j| batch[j]);
    }
    let mut update = vec![false; n];
    for i in (0..n).rev() {
        update[i] = matches!(node(i).op, Op::SgdUpdate { .. } | Op::AdamWUpdate { .. })
            || (!batch[i] && !consumers[i].is_empty() && consumers[i].iter().all(|&c| update[c]));
    }
    if !update.iter().any(|&u| u) {
        return Err(Error::Pipeline("microbatches need an optimizer: the graph has no update ops".into()));
    }
    // Conversions belong to the op they convert for (they come right before it).
    let program: Vec<Instr> = plan.program.drain(..).filter(|i| !matches!(i, Instr::Free { .. })).collect();
    let mut once = vec![false; program.len()];
    let mut next = false;
    for (k, ins) in program.iter().enumerate().rev() {
        match ins {
            Instr::Op { node, .. } => {
                next = update[*node];
                once[k] = next;
            }
            _ => once[k] = next,
        }
    }
    let written_before: HashSet<ValueRef> = program
        .iter()
        .zip(&once)
        .filter(|(_, o)| !**o)
        .flat_map(|(i, _)| match i {
            Instr::Op { outputs, .. } => outputs.clone(),
            Instr::Collective { output, .. } => vec![*output],
            _ => vec![],
        })
        .collect();
    let mut accumulate: Vec<ValueRef> = program
        .iter()
        .zip(&once)
        .filter(|(_, o)| **o)
        .flat_map(|(i, _)| match i {
            Instr::Op { inputs, .. } => inputs.clone(),
            Instr::Collective { input, .. } => vec![*input],
            _ => vec![],
        })
        .filter(|v| written_before.contains(v) && batch[v.node])
        .collect();
    accumulate.sort();
    accumulate.dedup();
    let mut reordered: Vec<Instr> = Vec::with_capacity(program.len());
    let mut last: Vec<Instr> = vec![];
    for (ins, o) in program.into_iter().zip(once) {
        if o { last.push(ins) } else { reordered.push(ins) }
    }
    let update_from = reordered.len();
    reordered.extend(last);
    let keep = crate::checkpoint::kept_to_the_end(g);
    let freed = crate::checkpoint::insert_frees(reordered, &keep);
    plan.update_from = position_of_nth_non_free(&freed, update_from);
    plan.program = freed;
    plan.microbatches = microbatches;
    // One accumulator, and one sum being formed (the largest value) when a microbatch ends.
    let acc_bytes = accumulated_bytes(&plan, mesh, &accumulate) + largest_accumulated(&plan, mesh, &accumulate);
    plan.accumulate = accumulate;
    // The accumulator is held while a microbatch runs; the update part reads the sums.
    let mem = crate::memory::simulate(&plan.graph, mesh, &plan.program)?;
    let pass = crate::memory::simulate(&plan.graph, mesh, &plan.program[..plan.update_from])?;
    plan.estimate.peak_bytes_per_rank = mem.peak.max(pass.peak + acc_bytes);
    // The microbatch part runs once per microbatch.
    let seconds = |range: &[Instr]| -> f64 {
        range
            .iter()
            .map(|i| match i {
                Instr::Op { seconds, .. } | Instr::Collective { seconds, .. } => *seconds,
                _ => 0.0,
            })
            .sum()
    };
    let (pass, once) = plan.program.split_at(plan.update_from);
    let total = seconds(pass) + seconds(once);
    let step = microbatches as f64 * seconds(pass) + seconds(once);
    let e = &mut plan.estimate;
    if total > 0.0 {
        e.compute_seconds *= step / total;
        e.comm_seconds *= step / total;
    }
    e.step_seconds = step + e.recompute_seconds;
    Ok(plan)
}

/// The index in `program` of its `k`-th instruction that is not a free (its length if none).
pub(crate) fn position_of_nth_non_free(program: &[Instr], k: usize) -> usize {
    program
        .iter()
        .enumerate()
        .filter(|(_, i)| !matches!(i, Instr::Free { .. }))
        .nth(k)
        .map_or(program.len(), |(p, _)| p)
}

/// Bytes per rank of the accumulated values, in the layouts the program writes them.
pub(crate) fn accumulated_bytes(plan: &Plan, mesh: &DeviceMesh, values: &[ValueRef]) -> u64 {
    accumulated_bytes_in(&plan.graph, mesh, &plan.program, values)
}

/// The bytes per rank of the largest accumulated value.
pub(crate) fn largest_accumulated(plan: &Plan, mesh: &DeviceMesh, values: &[ValueRef]) -> u64 {
    values.iter().map(|v| accumulated_bytes(plan, mesh, std::slice::from_ref(v))).max().unwrap_or(0)
}

/// [`accumulated_bytes`] of a program of `graph`.
pub(crate) fn accumulated_bytes_in(
    graph: &ir::Graph,
    mesh: &DeviceMesh,
    program: &[Instr],
    values: &[ValueRef],
) -> u64 {
    let want: HashSet<&ValueRef> = values.iter().collect();
    let mut total = 0u64;
    for ins in program {
        let written: Vec<(ValueRef, Vec<usize>)> = match ins {
            Instr::Op { outputs, local_shapes, .. } => outputs.iter().copied().zip(local_shapes.clone()).collect(),
            Instr::Collective { output, to, input, .. } => {
                let m = &graph.node(NodeIndex::new(input.node)).outputs[input.slot];
                vec![(*output, to.local_shape(&m.shape, mesh))]
            }
            _ => vec![],
        };
        for (v, shape) in written {
            if want.contains(&v) {
                let dt = graph.node(NodeIndex::new(v.node)).outputs[v.slot].dtype.size();
                total += (shape.iter().product::<usize>() * dt) as u64;
            }
        }
    }
    total
}
