//! Memory of a lowered program on one rank: the liveness walk behind the plan's estimate.
//!
//! The walk follows the program exactly as the runtime executes it, with the same accounting:
//! - parameters, optimizer state and constants (their local blocks) are resident when the step
//!   starts;
//! - an `op` instruction adds the bytes of its outputs (an `input` adds its local batch block;
//!   sources that are resident add nothing), a `collective` adds the bytes of the converted copy
//!   it writes, and a `free` subtracts the bytes of the values it names (a parameter or state
//!   freed after its last read gives its storage up to its updated value);
//! - the peak is taken after every instruction that adds bytes, i.e. while an op's inputs and
//!   outputs are both held.
//!
//! Every rank holds blocks of the same shapes (uneven splits are rejected), so one walk gives
//! the figure of every rank of a stage. With pipeline stages a stage's walk takes its own
//! instructions only: a transfer adds the bytes of the value it receives (a send adds nothing;
//! the sender frees the value after its last read, the send included). Kernel scratch space (e.g. a convolution's column buffer) is outside
//! this accounting, on both sides.

use std::collections::HashMap;

use ir::{Graph, NodeIndex, Op};
use sharding::DeviceMesh;

use crate::{Error, Instr, Location, Phase, Plan, Problem, Problems, Result, Segment, ValueRef};

/// The memory profile of a program (bytes per rank).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryProfile {
    /// Parameters, optimizer state and constants held when the step starts.
    pub resident: u64,
    /// The largest number of bytes held at once.
    pub peak: u64,
    /// Index of the instruction at which the peak is first reached (`None`: before the first).
    pub peak_at: Option<usize>,
}

/// Walks `program` (see the module docs) on every stage and returns the profile of the stage
/// with the highest peak. `graph` is the plan's graph (node `%i` is index `i`).
pub fn simulate(graph: &Graph, mesh: &DeviceMesh, program: &[Instr]) -> Result<MemoryProfile> {
    let stages: std::collections::BTreeSet<usize> = program
        .iter()
        .flat_map(|i| match i {
            Instr::Op { stage, .. } | Instr::Collective { stage, .. } | Instr::Free { stage, .. } => [*stage, *stage],
            Instr::Transfer { from, to, .. } => [*from, *to],
        })
        .collect();
    let mut best: Option<MemoryProfile> = None;
    for s in stages {
        let m = simulate_stage(graph, mesh, program, s)?;
        if best.as_ref().is_none_or(|b| m.peak > b.peak) {
            best = Some(m);
        }
    }
    Ok(best.unwrap_or(MemoryProfile { resident: 0, peak: 0, peak_at: None }))
}

/// Walks the instructions of one pipeline stage (see the module docs); instruction indices
/// are the program's.
pub fn simulate_stage(graph: &Graph, mesh: &DeviceMesh, program: &[Instr], stage: usize) -> Result<MemoryProfile> {
    let bad = |k: usize, why: String| Error::Invalid(Problems(vec![Problem { at: Location::Instr(k), why }]));
    let mut bytes: HashMap<ValueRef, u64> = HashMap::new();
    let mut resident = 0u64;
    let program: Vec<(usize, &Instr)> = program.iter().enumerate().filter(|(_, i)| i.runs_on(stage)).collect();
    for &(_, ins) in &program {
        if let Instr::Op { node, outputs, local_shapes, .. } = ins {
            let n = graph.g.node_weight(NodeIndex::new(*node));
            if let Some(n) = n
                && matches!(n.op, Op::Param { .. } | Op::State { .. } | Op::Constant(_))
            {
                for (o, shape) in outputs.iter().zip(local_shapes) {
                    let b = (shape.iter().product::<usize>() * n.outputs[0].dtype.size()) as u64;
                    resident += b;
                    bytes.insert(*o, b);
                }
            }
        }
    }
    let (mut live, mut peak, mut peak_at) = (resident, resident, None);
    for &(k, ins) in &program {
        let added = match ins {
            Instr::Op { node, outputs, local_shapes, .. } => {
                let n = graph.g.node_weight(NodeIndex::new(*node)).ok_or_else(|| bad(k, format!("no node %{node}")))?;
                if matches!(n.op, Op::Param { .. } | Op::State { .. } | Op::Constant(_)) {
                    0
                } else {
                    let mut sum = 0;
                    for ((o, shape), m) in outputs.iter().zip(local_shapes).zip(&n.outputs) {
                        let b = (shape.iter().product::<usize>() * m.dtype.size()) as u64;
                        bytes.insert(*o, b);
                        sum += b;
                    }
                    sum
                }
            }
            Instr::Collective { input, output, to, .. } => {
                let m = graph
                    .g
                    .node_weight(NodeIndex::new(input.node))
                    .and_then(|x| x.outputs.get(input.slot))
                    .ok_or_else(|| bad(k, format!("unknown value {input}")))?;
                let b = (to.local_shape(&m.shape, mesh).iter().product::<usize>() * m.dtype.size()) as u64;
                bytes.insert(*output, b);
                b
            }
            Instr::Transfer { value, spec, to, .. } if *to == stage => {
                let m = graph
                    .g
                    .node_weight(NodeIndex::new(value.node))
                    .and_then(|x| x.outputs.get(value.slot))
                    .ok_or_else(|| bad(k, format!("unknown value {value}")))?;
                let b = (spec.local_shape(&m.shape, mesh).iter().product::<usize>() * m.dtype.size()) as u64;
                bytes.insert(*value, b);
                b
            }
            Instr::Transfer { .. } => 0,
            Instr::Free { values, .. } => {
                for v in values {
                    let b = bytes.remove(v).ok_or_else(|| bad(k, format!("frees {v}, which is not held")))?;
                    if !is_constant(graph, v) {
                        live = live.saturating_sub(b);
                    }
                }
                0
            }
        };
        if added > 0 {
            live += added;
            if live > peak {
                peak = live;
                peak_at = Some(k);
            }
        }
    }
    Ok(MemoryProfile { resident, peak, peak_at })
}

/// Whether `v` is a constant's value (its block stays with the rank's constants when freed).
fn is_constant(graph: &Graph, v: &ValueRef) -> bool {
    graph.g.node_weight(NodeIndex::new(v.node)).is_some_and(|n| matches!(n.op, Op::Constant(_)))
}

/// The peak of the stage with the highest one under the plan's steps ([`simulate_steps`]).
pub fn simulate_plan(plan: &Plan, mesh: &DeviceMesh) -> Result<MemoryProfile> {
    let mut best: Option<MemoryProfile> = None;
    for s in 0..plan.stages() {
        let m = simulate_steps(plan, mesh, s)?;
        if best.as_ref().is_none_or(|b| m.peak > b.peak) {
            best = Some(m);
        }
    }
    Ok(best.unwrap_or(MemoryProfile { resident: 0, peak: 0, peak_at: None }))
}

/// Walks one stage's instructions in the order its steps run them ([`Plan::steps`], then the
/// update phase), with the runtime's accounting of microbatches: each microbatch in flight
/// holds its own values; parameters, optimizer state and constants are resident and read by
/// every microbatch; when a microbatch's last step on the stage ends, its accumulated values
/// (and the outputs, with more than one microbatch) are added into one sum each (the first
/// becomes the sum; a later one holds the new sum next to the old and the addend for a moment),
/// and what else it still holds replaces the previous microbatch's copy, for the update phase
/// to read. With one microbatch and no stages this is [`simulate_stage`]'s walk.
pub fn simulate_steps(plan: &Plan, mesh: &DeviceMesh, stage: usize) -> Result<MemoryProfile> {
    walk_steps(plan, mesh, stage, &mut |_, _| {})
}

/// The bytes one rank of `stage` holds after each instruction, in the order
/// [`simulate_steps`] runs them (program index, bytes): its walk, recorded; an instruction
/// appears once per microbatch that runs it. For drawing the memory over the step.
pub fn trace_steps(plan: &Plan, mesh: &DeviceMesh, stage: usize) -> Result<Vec<(usize, u64)>> {
    let mut trace = vec![];
    walk_steps(plan, mesh, stage, &mut |k, live| trace.push((k, live)))?;
    Ok(trace)
}

/// [`simulate_steps`]'s walk, calling `after(k, live)` after each instruction it runs.
fn walk_steps(
    plan: &Plan,
    mesh: &DeviceMesh,
    stage: usize,
    after: &mut dyn FnMut(usize, u64),
) -> Result<MemoryProfile> {
    let graph = &plan.graph;
    let bad = |k: usize, why: String| Error::Invalid(Problems(vec![Problem { at: Location::Instr(k), why }]));
    let meta_of = |k: usize, v: &ValueRef| {
        graph
            .g
            .node_weight(NodeIndex::new(v.node))
            .and_then(|x| x.outputs.get(v.slot))
            .ok_or_else(|| bad(k, format!("unknown value {v}")))
    };
    let mut segs: HashMap<Segment, Vec<(usize, &Instr)>> = HashMap::new();
    let mut shared: HashMap<ValueRef, u64> = HashMap::new();
    let mut resident = 0u64;
    for (k, ins) in plan.program.iter().enumerate() {
        let Some(seg) = ins.segment_on(stage) else { continue };
        segs.entry(seg).or_default().push((k, ins));
        if let Instr::Op { node, outputs, local_shapes, .. } = ins {
            let n = graph.g.node_weight(NodeIndex::new(*node)).ok_or_else(|| bad(k, format!("no node %{node}")))?;
            if matches!(n.op, Op::Param { .. } | Op::State { .. } | Op::Constant(_)) {
                for (o, shape) in outputs.iter().zip(local_shapes) {
                    let b = (shape.iter().product::<usize>() * n.outputs[0].dtype.size()) as u64;
                    resident += b;
                    if !matches!(n.op, Op::Constant(_)) {
                        shared.insert(*o, b);
                    }
                }
            }
        }
    }
    let microbatches = plan.microbatches.max(1);
    let mut accumulate: Vec<ValueRef> = plan.accumulate.clone();
    if microbatches > 1 {
        // Outputs of the update phase (the learning rate, the gradient norm) are computed once.
        let once: std::collections::HashSet<usize> = plan
            .program
            .iter()
            .filter_map(|i| match i {
                Instr::Op { node, phase: Phase::Update, .. } => Some(*node),
                _ => None,
            })
            .collect();
        accumulate.extend(
            graph.outputs.iter().filter(|(_, v)| !once.contains(&v.node.index())).map(|(_, v)| ValueRef::of(*v)),
        );
    }
    accumulate.sort();
    accumulate.dedup();
    let steps = plan.steps().into_iter().nth(stage).unwrap_or_default();
    let mut last_step: HashMap<usize, usize> = HashMap::new();
    for (i, st) in steps.iter().enumerate() {
        last_step.insert(st.microbatch, i);
    }
    let (mut live, mut peak, mut peak_at) = (resident, resident, None);
    let mut tables: HashMap<usize, HashMap<ValueRef, u64>> = HashMap::new();
    let mut sums: HashMap<ValueRef, u64> = HashMap::new();
    let update = Segment { phase: Phase::Update, chunk: 0 };
    let runs = steps.iter().map(|st| (Some(st.microbatch), st.segment())).chain(std::iter::once((None, update)));
    for (i, (mb, seg)) in runs.enumerate() {
        if mb.is_none() {
            // The sums are what the update phase reads.
            shared.extend(sums.drain());
        }
        for &(k, ins) in segs.get(&seg).map(Vec::as_slice).unwrap_or(&[]) {
            let mut table = match mb {
                Some(m) => tables.remove(&m).unwrap_or_default(),
                None => std::mem::take(&mut shared),
            };
            let mut write = |v: ValueRef, b: u64, table: &mut HashMap<ValueRef, u64>| {
                live += b;
                if let Some(old) = table.insert(v, b) {
                    live = live.saturating_sub(old);
                }
            };
            let size = |shape: &[usize], m: &ir::TensorMeta| (shape.iter().product::<usize>() * m.dtype.size()) as u64;
            let added = match ins {
                Instr::Op { node, outputs, local_shapes, .. } => {
                    let n = graph.node(NodeIndex::new(*node));
                    match n.op {
                        Op::Param { .. } | Op::State { .. } => false,
                        Op::Constant(_) => {
                            for o in outputs {
                                table.insert(*o, 0);
                            }
                            false
                        }
                        _ => {
                            for ((o, shape), m) in outputs.iter().zip(local_shapes).zip(&n.outputs) {
                                write(*o, size(shape, m), &mut table);
                            }
                            true
                        }
                    }
                }
                Instr::Collective { input, output, to, .. } => {
                    let m = meta_of(k, input)?;
                    write(*output, size(&to.local_shape(&m.shape, mesh), m), &mut table);
                    true
                }
                Instr::Transfer { value, spec, to, .. } if *to == stage => {
                    let m = meta_of(k, value)?;
                    write(*value, size(&spec.local_shape(&m.shape, mesh), m), &mut table);
                    true
                }
                Instr::Transfer { .. } => false,
                Instr::Free { values, .. } => {
                    for v in values {
                        let b = match table.remove(v) {
                            Some(b) => b,
                            None => shared.remove(v).ok_or_else(|| bad(k, format!("frees {v}, which is not held")))?,
                        };
                        live = live.saturating_sub(b);
                    }
                    false
                }
            };
            match mb {
                Some(m) => {
                    tables.insert(m, table);
                }
                None => shared = table,
            }
            if added && live > peak {
                peak = live;
                peak_at = Some(k);
            }
            after(k, live);
        }
        // A microbatch's last step on the stage: its sums, and what the update reads.
        if let Some(m) = mb
            && last_step.get(&m) == Some(&i)
        {
            let mut table = tables.remove(&m).unwrap_or_default();
            for v in &accumulate {
                let Some(x) = table.remove(v) else { continue };
                match sums.get(v) {
                    None => {
                        sums.insert(*v, x);
                    }
                    Some(&a) => {
                        live += x;
                        peak = peak.max(live);
                        live = live.saturating_sub(a + x);
                    }
                }
            }
            for (v, b) in table {
                if let Some(old) = shared.insert(v, b) {
                    live = live.saturating_sub(old);
                }
            }
        }
    }
    Ok(MemoryProfile { resident, peak, peak_at })
}

/// What one rank holds, by kind (bytes per rank of one stage): the sizes of the categories a
/// mixed-precision memory budget is reasoned about in, not a liveness peak (they are not all
/// held at once; [`MemoryProfile::peak`] is).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
pub struct Breakdown {
    /// Trainable parameters' f32 blocks (the master copy under mixed precision).
    pub parameters: u64,
    /// 16-bit copies of parameters made for the forward (mixed precision only).
    pub low_copies: u64,
    /// Optimizer state (momentum, Adam's moments; the step counter).
    pub optimizer_state: u64,
    /// Parameter gradients as the optimizer reads them (after their reduction), in the type
    /// they are held in until the update.
    pub gradients: u64,
    /// What the step holds at its peak beyond what is resident (parameters, optimizer state,
    /// constants): activations, and the 16-bit copies and gradients live at that moment
    /// ([`MemoryProfile::peak`] minus [`MemoryProfile::resident`]).
    #[serde(default)]
    pub activations_at_peak: u64,
}

/// The [`Breakdown`] of the stage of `plan` holding the most parameter bytes.
pub fn breakdown(plan: &Plan, mesh: &DeviceMesh) -> Result<Breakdown> {
    let mut best = Breakdown::default();
    for s in 0..plan.stages() {
        let b = breakdown_stage(plan, mesh, s)?;
        if b.parameters + b.low_copies + b.optimizer_state + b.gradients
            > best.parameters + best.low_copies + best.optimizer_state + best.gradients
        {
            best = b;
        }
    }
    Ok(best)
}

fn breakdown_stage(plan: &Plan, mesh: &DeviceMesh, stage: usize) -> Result<Breakdown> {
    let graph = &plan.graph;
    let node = |i: usize| graph.g.node_weight(NodeIndex::new(i));
    let mut bytes: HashMap<ValueRef, u64> = HashMap::new();
    let mut out = Breakdown::default();
    let mut updates: Vec<ValueRef> = Vec::new();
    let mut copies = std::collections::HashSet::new();
    for ins in plan.program.iter().filter(|i| i.runs_on(stage)) {
        match ins {
            Instr::Op { node: i, op, inputs, outputs, local_shapes, .. } => {
                let Some(n) = node(*i) else { continue };
                for ((o, shape), m) in outputs.iter().zip(local_shapes).zip(&n.outputs) {
                    bytes.insert(*o, (shape.iter().product::<usize>() * m.dtype.size()) as u64);
                }
                let first = outputs.first().and_then(|o| bytes.get(o)).copied().unwrap_or(0);
                match op {
                    Op::Param { .. } if n.outputs[0].dtype.is_float() => out.parameters += first,
                    Op::State { .. } => out.optimizer_state += first,
                    // Once per node: a recomputed cast writes the same copy again.
                    Op::Cast { to } if to.is_half() && copies.insert(*i) => {
                        let src = graph.node_inputs(NodeIndex::new(*i));
                        if src.first().is_some_and(|v| matches!(graph.node(v.node).op, Op::Param { .. })) {
                            out.low_copies += first;
                        }
                    }
                    Op::SgdUpdate { .. } | Op::AdamWUpdate { .. } => {
                        if let Some(g) = inputs.get(1) {
                            updates.push(*g);
                        }
                    }
                    _ => {}
                }
            }
            Instr::Collective { input, output, to, .. } => {
                if let Some(m) = node(input.node).and_then(|x| x.outputs.get(input.slot)) {
                    bytes.insert(
                        *output,
                        (to.local_shape(&m.shape, mesh).iter().product::<usize>() * m.dtype.size()) as u64,
                    );
                }
            }
            _ => {}
        }
    }
    out.gradients = updates.iter().map(|g| bytes.get(g).copied().unwrap_or(0)).sum();
    Ok(out)
}
