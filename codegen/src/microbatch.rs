//! Microbatches: a step that runs the forward and backward of M microbatches one after the
//! other, sums their gradients, and updates once (gradient accumulation).
//!
//! [`split`] rewrites a lowered program (made for one microbatch, from a training graph whose
//! gradients are scaled by 1/M: `ir::autodiff::TrainingGraph::with_gradient_scale`):
//!
//! 1. **The update part** is the optimizer's update ops, the sources and values only they read
//!    that do not depend on the batch (optimizer state, the step counter and its increment),
//!    the nodes the training graph names as running once per step
//!    (`ir::autodiff::runs_once_per_step`: gradient clipping, which must see the summed
//!    gradients, and the learning-rate schedule), and the conversions of their inputs. It
//!    moves, in order, to the end of the program (`update_from`): nothing before reads it.
//! 2. **Accumulated values** are the batch-dependent values the update part reads (the
//!    gradients, in the layouts the pass writes them): the runtime sums them over the
//!    microbatches before the update part runs once.
//! 3. Frees are placed again; the update part's instructions are in [`Phase::Update`]. The
//!    memory estimate is the walk of the microbatches one after the other with the runtime's
//!    accounting (`plan::memory::simulate_steps`: the sums held while later microbatches run).
//!
//! Invariant: with M microbatches of the graph's batch, a step computes the gradient of the
//! mean of their losses (each microbatch's mean loss, scaled by 1/M) and applies it once.

use std::collections::HashSet;

use ir::{NodeIndex, Op};
use sharding::DeviceMesh;

use crate::{Error, Result};
use ::plan::{Instr, Phase, Plan, ValueRef};

/// Rewrites `plan` (lowered for one microbatch) to run `microbatches` of
/// them per step (see the module docs).
pub fn split(plan: Plan, mesh: &DeviceMesh, microbatches: usize) -> Result<Plan> {
    if microbatches <= 1 {
        return Ok(plan);
    }
    split_at_update(plan, mesh, microbatches)
}

/// Moves the update part of `plan` (one microbatch) to its end in [`Phase::Update`], as
/// [`split`] does for one microbatch (pipeline stages run it after their steps).
pub fn update_phase(plan: Plan, mesh: &DeviceMesh) -> Result<Plan> {
    split_at_update(plan, mesh, 1)
}

/// Which nodes of `g` depend on the batch, and which form its update part (see the module
/// docs), by node index.
pub(crate) fn update_part(g: &ir::Graph) -> (Vec<bool>, Vec<bool>) {
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
    // Besides the update ops, the nodes the training graph names as running once per step
    // (gradient clipping, the learning-rate schedule) when nothing else reads them.
    let mut update = vec![false; n];
    for i in (0..n).rev() {
        let all_update = consumers[i].iter().all(|&c| update[c]);
        update[i] = matches!(node(i).op, Op::SgdUpdate { .. } | Op::AdamWUpdate { .. })
            || (ir::autodiff::runs_once_per_step(&node(i).name) && all_update)
            || (!batch[i] && !consumers[i].is_empty() && all_update);
    }
    (batch, update)
}

fn split_at_update(mut plan: Plan, mesh: &DeviceMesh, microbatches: usize) -> Result<Plan> {
    let g = &plan.graph;
    let (batch, update) = update_part(g);
    if !update.iter().any(|&u| u) {
        if microbatches == 1 {
            return Ok(plan);
        }
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
    if microbatches == 1 {
        accumulate.clear();
    }
    let mut reordered: Vec<Instr> = Vec::with_capacity(program.len());
    let mut last: Vec<Instr> = vec![];
    for (mut ins, o) in program.into_iter().zip(once) {
        if o {
            ins.set_phase(Phase::Update);
            last.push(ins)
        } else {
            reordered.push(ins)
        }
    }
    reordered.extend(last);
    let keep = crate::checkpoint::kept_to_the_end(g);
    plan.program = crate::checkpoint::insert_frees(reordered, &keep);
    plan.microbatches = microbatches;
    plan.accumulate = accumulate;
    // Memory under the runtime's accounting of microbatches (the accumulators included).
    plan.estimate.peak_bytes_per_rank = crate::memory::simulate_plan(&plan, mesh)?.peak;
    // The microbatch part runs once per microbatch: its compute and its communication each
    // count M times, the update part's once (the two are scaled apart: a step whose update is
    // all communication, a data-parallel gradient reduction, keeps it as communication).
    let seconds = |update: bool, comm: bool| -> f64 {
        plan.program
            .iter()
            .filter(|i| (i.phase() == Phase::Update) == update)
            .map(|i| match i {
                Instr::Op { seconds, .. } if !comm => *seconds,
                Instr::Collective { seconds, .. } if comm => *seconds,
                _ => 0.0,
            })
            .sum()
    };
    let (pass_compute, pass_comm) = (seconds(false, false), seconds(false, true));
    let (pass, once) = (pass_compute + pass_comm, seconds(true, false) + seconds(true, true));
    let m = microbatches as f64;
    let e = &mut plan.estimate;
    // The pass's instructions include its recomputation (ops and their conversions, in the
    // pass's proportions), which runs once per microbatch and is reported apart.
    let rec = e.recompute_seconds.min(pass);
    let share = |part: f64| if pass > 0.0 { part / pass } else { 0.0 };
    e.compute_seconds = m * (pass_compute - rec * share(pass_compute)) + seconds(true, false);
    e.comm_seconds = m * (pass_comm - rec * share(pass_comm)) + seconds(true, true);
    e.recompute_seconds = m * rec;
    e.step_seconds = m * pass + once;
    Ok(plan)
}

/// `plan` (one microbatch's) split into `microbatches` ([`crate::microbatch::split`]), or with
/// one, its update part moved to the update phase: what pipeline stages take.
pub(crate) fn microbatched(plan: Plan, mesh: &DeviceMesh, microbatches: usize) -> Result<Plan> {
    if microbatches > 1 { split(plan, mesh, microbatches) } else { update_phase(plan, mesh) }
}
