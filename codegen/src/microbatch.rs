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
use sharding::{Collective, DeviceMesh};

use crate::{Error, Result};
use ::plan::{Instr, Phase, Plan, ValueRef};

/// Rewrites `plan` (lowered for one microbatch) to run `microbatches` of
/// them per step (see the module docs).
pub fn split(plan: Plan, mesh: &DeviceMesh, microbatches: usize) -> Result<Plan> {
    if microbatches <= 1 {
        return Ok(plan);
    }
    split_at_update(plan, mesh, microbatches, true)
}

/// Moves the update part of `plan` (one microbatch) to its end in [`Phase::Update`], as
/// [`split`] does for one microbatch (pipeline stages run it after their steps).
pub fn update_phase(plan: Plan, mesh: &DeviceMesh) -> Result<Plan> {
    split_at_update(plan, mesh, 1, false)
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

/// With `with_prologue`, also moves the batch-independent work into the prologue ([`prologue`]:
/// pipeline stages do that once they are placed).
fn split_at_update(mut plan: Plan, mesh: &DeviceMesh, microbatches: usize, with_prologue: bool) -> Result<Plan> {
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
    if with_prologue {
        let program = std::mem::take(&mut plan.program);
        plan.program = prologue(&plan.graph, plan.solver.chosen, &plan.mesh.shape, microbatches, program);
    }
    // Memory under the runtime's accounting of microbatches (the accumulators included).
    plan.estimate.peak_bytes_per_rank = crate::memory::simulate_plan(&plan, mesh)?.peak;
    // The microbatch part runs once per microbatch: its compute and its communication each
    // count M times, the prologue's and the update part's once (the two are scaled apart: a step whose update is
    // all communication, a data-parallel gradient reduction, keeps it as communication).
    let seconds = |update: bool, comm: bool| -> f64 {
        plan.program
            .iter()
            .filter(|i| i.once_per_step() == update)
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
    // The prologue's gathers overlap the first microbatch's forward, the gradient reductions
    // of the update part the last one's backward: one pass played with both.
    if plan.options.overlap {
        let hidden = overlapped(&plan.graph, &plan.program);
        let e = &mut plan.estimate;
        e.overlapped_comm_seconds = hidden;
        e.step_seconds -= hidden;
    }
    Ok(plan)
}

/// The communication seconds of `program` (one microbatch's pass with its prologue and update
/// part) hidden behind compute ([`::plan::overlap`]): the prologue's collectives and the
/// conversions for the update part run on the communication stream, the update part's ops
/// after everything else (the optimizer steps once the backward is done, as Megatron-LM's
/// does).
pub(crate) fn overlapped(g: &ir::Graph, program: &[Instr]) -> f64 {
    let (_, update) = update_part(g);
    let is_update = |i: &Instr| match i {
        Instr::Op { node, phase, .. } => *phase == Phase::Update || update.get(*node).copied().unwrap_or(false),
        _ => false,
    };
    let marks = ::plan::overlap::on_comm_stream(program, &is_update);
    let with = |k: usize| (&program[k], marks[k]);
    let (late, early): (Vec<usize>, Vec<usize>) = (0..program.len()).partition(|&k| is_update(&program[k]));
    ::plan::overlap::play(early.into_iter().chain(late).map(with)).overlapped()
}

/// What [`prologue`] may move (see there), and the recomputations of what it would hold, by
/// program index: `data` are the axes the weights are gathered over.
/// The forward nodes of a training graph: the ancestors of its outputs (the loss and what the
/// model returns), by node index.
pub(crate) fn forward_nodes(g: &ir::Graph) -> Vec<bool> {
    let mut forward = vec![false; g.g.node_count()];
    let mut stack: Vec<usize> = g.outputs.iter().map(|(_, v)| v.node.index()).collect();
    while let Some(i) = stack.pop() {
        if !std::mem::replace(&mut forward[i], true) {
            stack.extend(g.node_inputs(NodeIndex::new(i)).iter().map(|v| v.node.index()));
        }
    }
    forward
}

fn movable(g: &ir::Graph, program: &[Instr], data: &HashSet<usize>) -> (Vec<bool>, Vec<bool>) {
    let (batch, _) = update_part(g);
    let forward = forward_nodes(g);
    // The op each conversion is for: the next op (conversions come right before it).
    let mut serves = vec![None; program.len()];
    let mut next = None;
    for (k, ins) in program.iter().enumerate().rev() {
        if let Instr::Op { node, recompute, .. } = ins {
            next = Some((*node, *recompute));
        }
        serves[k] = next;
    }
    let mut gathered: HashSet<(usize, ValueRef)> = HashSet::new();
    let mut held: HashSet<(usize, ValueRef)> = HashSet::new();
    let mut moved = vec![false; program.len()];
    let mut dropped = vec![false; program.len()];
    for (k, ins) in program.iter().enumerate() {
        if ins.phase() == Phase::Update {
            continue;
        }
        match ins {
            Instr::Op { node, inputs, outputs, stage, recompute, .. } => {
                if outputs.iter().all(|o| held.contains(&(*stage, *o))) {
                    dropped[k] = *recompute;
                    continue;
                }
                let op = &g.node(NodeIndex::new(*node)).op;
                if *recompute || batch[*node] || !forward[*node] || matches!(op, Op::Dropout(_) | Op::Input { .. }) {
                    continue;
                }
                if inputs.iter().all(|v| held.contains(&(*stage, *v))) {
                    moved[k] = true;
                    held.extend(outputs.iter().map(|o| (*stage, *o)));
                }
            }
            Instr::Collective { input, output, stage, collective, .. } => {
                if held.contains(&(*stage, *output)) {
                    dropped[k] = matches!(serves[k], Some((_, true)));
                    continue;
                }
                // For the forward or the backward (a weight's gather for the input gradient too).
                let for_step = serves[k].is_some_and(|(_, recompute)| !recompute);
                let over_data = collective.axes().iter().all(|a| data.contains(a));
                let zero = match collective {
                    Collective::AllGather { .. } | Collective::AllToAll { .. } => over_data,
                    Collective::Slice { .. } => over_data || gathered.contains(&(*stage, *input)),
                    _ => false,
                };
                if for_step && zero && held.contains(&(*stage, *input)) {
                    moved[k] = true;
                    held.insert((*stage, *output));
                    gathered.insert((*stage, *output));
                }
            }
            _ => {}
        }
    }
    (moved, dropped)
}

/// Of what may move (`cand`), what does (see [`prologue`]), and the values it writes (by
/// stage).
fn chosen(program: &[Instr], cand: &[bool]) -> (Vec<bool>, HashSet<(usize, ValueRef)>) {
    // What moves: the conversions over `zero` axes (ZeRO's gathers: they save a collective per
    // microbatch) and what they need; the slices of what they wrote. The rest of what could move
    // (a parameter's 16-bit copy that no gather reads) stays in the microbatches: held for the
    // whole step it would cost memory for a cast that takes microseconds.
    let mut moved = vec![false; program.len()];
    let mut needed: HashSet<(usize, ValueRef)> = HashSet::new();
    for (k, ins) in program.iter().enumerate().rev() {
        if !cand[k] {
            continue;
        }
        let (reads, writes, stage, root) = match ins {
            Instr::Op { inputs, outputs, stage, .. } => (inputs.clone(), outputs.clone(), *stage, false),
            Instr::Collective { input, output, stage, collective, .. } => {
                (vec![*input], vec![*output], *stage, !matches!(collective, Collective::Slice { .. }))
            }
            _ => continue,
        };
        if root || writes.iter().any(|w| needed.contains(&(stage, *w))) {
            moved[k] = true;
            needed.extend(reads.iter().map(|r| (stage, *r)));
        }
    }
    // Then what works on a gathered weight (its slices, its 16-bit copy when the gather was of
    // the f32 shard): the full-precision gathered copy is then freed in the prologue.
    let mut written: HashSet<(usize, ValueRef)> = HashSet::new();
    let mut gathered: HashSet<(usize, ValueRef)> = HashSet::new();
    for (k, ins) in program.iter().enumerate() {
        match ins {
            Instr::Collective { input, output, stage, collective, .. } if cand[k] => {
                let root = !matches!(collective, Collective::Slice { .. });
                if !moved[k] && gathered.contains(&(*stage, *input)) {
                    moved[k] = true;
                }
                if moved[k] {
                    written.insert((*stage, *output));
                    if root || gathered.contains(&(*stage, *input)) {
                        gathered.insert((*stage, *output));
                    }
                }
            }
            Instr::Op { inputs, outputs, stage, .. } if cand[k] => {
                let on_gathered = inputs.iter().all(|v| written.contains(&(*stage, *v)))
                    && inputs.iter().any(|v| gathered.contains(&(*stage, *v)));
                if !moved[k] && on_gathered {
                    moved[k] = true;
                }
                if moved[k] {
                    written.extend(outputs.iter().map(|o| (*stage, *o)));
                    if on_gathered {
                        gathered.extend(outputs.iter().map(|o| (*stage, *o)));
                    }
                }
            }
            _ => {}
        }
    }
    (moved, written)
}

/// Moves ZeRO's parameter gathers of a plan of several microbatches into each stage's
/// [`Phase::Prologue`], which runs once per step before the first microbatch, with what they
/// need (the parameters' reads, their 16-bit copies on the shards): every microbatch would
/// gather the same weights again; held from the prologue until the update phase instead, they
/// are gathered once per step, as Megatron's distributed optimizer and FSDP without resharding
/// do.
///
/// An instruction may move when it is not in the update phase and:
/// - an op of a forward node (an ancestor of an output) that does not depend on the batch and
///   draws no random numbers, every input already in the stage's prologue;
/// - or a conversion, for an op of the forward or the backward, of a value already in the
///   stage's prologue that gathers, exchanges or slices it over `zero` axes only (ZeRO's
///   gather of a parameter), or that slices what such a conversion wrote. Other conversions of
///   parameters (a tensor parallel gather, say) stay in the microbatches, transient, as the
///   solver priced them: a copy held for the whole step is memory the solver's problem does not
///   see.
///
/// Of those, the gathers and exchanges move, with what they read and what works on what they
/// wrote (slices, a 16-bit copy of a gathered f32 weight); an op no gather needs (a 16-bit copy
/// of a data-parallel parameter) stays in the microbatches, since holding it for the step would
/// cost memory to save a cast.
///
/// A recomputation of a value the prologue holds is dropped. The instructions keep their order
/// (the prologue's come first on each stage), and frees are placed again
/// ([`crate::checkpoint::insert_frees`]: the prologue's values are freed in the update phase).
///
/// Only under a layout that names `zero` axes (`layout`, the plan's strategy, on a mesh of shape
/// `mesh`), whose gathers these are: there the user asked for sharded weights, and the
/// gathered copies held for the step are Megatron's distributed optimizer's. Elsewhere the
/// program is returned as it is: a plan the solver made ZeRO-3 like to save memory gathers a
/// layer's weights when it runs and frees them after, and holding every layer's for the step
/// would undo what the layout was chosen for (the solver's problem prices neither).
pub(crate) fn prologue(
    g: &ir::Graph,
    layout: ::plan::Baseline,
    mesh: &[usize],
    microbatches: usize,
    program: Vec<Instr>,
) -> Vec<Instr> {
    let zero = layout.roles(mesh).unwrap_or_default().contains(&::plan::AxisRole::Zero);
    if microbatches <= 1 || !zero {
        return program;
    }
    let program: Vec<Instr> = program.into_iter().filter(|i| !matches!(i, Instr::Free { .. })).collect();
    // The axes the weights are gathered over: the layout's `zero` axes (of size above 1).
    let data: HashSet<usize> = layout
        .roles(mesh)
        .unwrap_or_default()
        .into_iter()
        .enumerate()
        .filter(|&(a, r)| r == ::plan::AxisRole::Zero && mesh.get(a).is_some_and(|&x| x > 1))
        .map(|(a, _)| a)
        .collect();
    let (cand, mut dropped) = movable(g, &program, &data);
    let (moved, written) = chosen(&program, &cand);
    let keep = crate::checkpoint::kept_to_the_end(g);
    // A dropped recomputation stays dropped only when the prologue holds what it wrote.
    for (k, ins) in program.iter().enumerate() {
        if dropped[k] {
            let writes: Vec<ValueRef> = match ins {
                Instr::Op { outputs, .. } => outputs.clone(),
                Instr::Collective { output, .. } => vec![*output],
                _ => vec![],
            };
            let stage = match ins {
                Instr::Op { stage, .. } | Instr::Collective { stage, .. } => *stage,
                _ => 0,
            };
            dropped[k] = writes.iter().all(|w| written.contains(&(stage, *w)));
        }
    }
    if !moved.iter().any(|&m| m) {
        return crate::checkpoint::insert_frees(program, &keep);
    }
    let mut first: Vec<Instr> = vec![];
    let mut rest: Vec<Instr> = vec![];
    for ((mut ins, m), d) in program.into_iter().zip(moved).zip(dropped) {
        if d {
            continue;
        }
        if m {
            ins.set_phase(Phase::Prologue);
            ins.set_chunk(0);
            first.push(ins);
        } else {
            rest.push(ins);
        }
    }
    first.extend(rest);
    crate::checkpoint::insert_frees(first, &keep)
}

/// `plan` (one microbatch's) split into `microbatches` ([`crate::microbatch::split`]), or with
/// one, its update part moved to the update phase: what pipeline stages take.
pub(crate) fn microbatched(plan: Plan, mesh: &DeviceMesh, microbatches: usize) -> Result<Plan> {
    if microbatches > 1 { split_at_update(plan, mesh, microbatches, false) } else { update_phase(plan, mesh) }
}
