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
use sharding::fx::FxMap;

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

/// Walks one stage's instructions in the order its steps run them (its prologue on the shared
/// values, [`Plan::steps`], then the update phase), with the runtime's accounting of
/// microbatches: each microbatch in flight
/// holds its own values; parameters, optimizer state and constants are resident and read by
/// every microbatch; once a microbatch is done with an accumulated value (or an output, with
/// more than one microbatch: [`Plan::summed_after_steps`]), it is added into one sum (the first
/// becomes the sum; a later one holds the new sum next to the old and the addend for a moment),
/// and when its last step on the stage ends, what else it still holds replaces the previous
/// microbatch's copy, for the update phase to read. With one microbatch and no stages this is [`simulate_stage`]'s walk.
///
/// The result is [`simulate_steps_exact`]'s, in time linear in the steps plus the program
/// rather than their product: every microbatch runs the same segments in the same order on
/// its own values, so each segment is walked once, for one microbatch, and summarised (its net
/// bytes, its highest point above its start and where, its lowest point), and the summaries are
/// replayed step by step. Where the summary would not be exact (the microbatches' segment
/// orders differ, a microbatch frees a value it does not hold, a count would go below zero),
/// this is the exact walk.
pub fn simulate_steps(plan: &Plan, mesh: &DeviceMesh, stage: usize) -> Result<MemoryProfile> {
    match simulate_steps_summarised(plan, mesh, stage) {
        Some(m) => Ok(m),
        None => simulate_steps_exact(plan, mesh, stage),
    }
}

/// [`simulate_steps`] by walking every instruction of every step (time in microbatches times
/// program): the reference the summarised walk is checked against.
pub fn simulate_steps_exact(plan: &Plan, mesh: &DeviceMesh, stage: usize) -> Result<MemoryProfile> {
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

/// A count of bytes held, as the walks keep it.
trait Count {
    fn add(&mut self, b: u64);
    fn sub(&mut self, b: u64);
}

/// The exact walk's count: subtractions stop at zero.
impl Count for u64 {
    fn add(&mut self, b: u64) {
        *self += b;
    }
    fn sub(&mut self, b: u64) {
        *self = self.saturating_sub(b);
    }
}

/// A count relative to a segment's start, with its lowest point.
#[derive(Default)]
struct Relative {
    now: i128,
    low: i128,
}

impl Count for Relative {
    fn add(&mut self, b: u64) {
        self.now += b as i128;
    }
    fn sub(&mut self, b: u64) {
        self.now -= b as i128;
        self.low = self.low.min(self.now);
    }
}

/// The prologue's segment: run once, on the shared values, before the first microbatch.
const PROLOGUE: Segment = Segment { phase: Phase::Prologue, chunk: 0 };

/// What a stage's walk needs from the plan.
struct Walk<'a> {
    /// Each segment's instructions on the stage, with their program indices.
    segs: FxMap<Segment, Vec<(usize, &'a Instr)>>,
    /// Parameters and optimizer state (not constants) with their bytes.
    shared: FxMap<ValueRef, u64>,
    /// Bytes resident when the step starts.
    resident: u64,
    /// For each step, those its microbatch adds into their sums when it ends
    /// ([`Plan::summed_after_steps`]).
    sum_after: Vec<Vec<ValueRef>>,
    /// The stage's steps.
    steps: Vec<crate::Step>,
}

fn bad(k: usize, why: String) -> Error {
    Error::Invalid(Problems(vec![Problem { at: Location::Instr(k), why }]))
}

fn prepare<'a>(plan: &'a Plan, stage: usize) -> Result<Walk<'a>> {
    let graph = &plan.graph;
    let mut segs: FxMap<Segment, Vec<(usize, &Instr)>> = FxMap::default();
    let mut shared: FxMap<ValueRef, u64> = FxMap::default();
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
    let sum_after = plan.summed_after_steps(stage, &plan.summed());
    let steps = match &plan.pipeline {
        Some(p) => p.schedule.steps.get(stage).cloned().unwrap_or_default(),
        None => plan.steps().into_iter().nth(stage).unwrap_or_default(),
    };
    Ok(Walk { segs, shared, resident, sum_after, steps })
}

/// Runs instruction `k` against `table` (the values of the microbatch running it, or the
/// update's), counting in `live`; a freed value missing from `table` is taken from `shared`
/// (with `None`, that is an error). Whether the instruction added bytes (the peak is read after
/// those).
#[allow(clippy::too_many_arguments)]
fn run(
    graph: &Graph,
    mesh: &DeviceMesh,
    stage: usize,
    k: usize,
    ins: &Instr,
    table: &mut FxMap<ValueRef, u64>,
    shared: Option<&mut FxMap<ValueRef, u64>>,
    live: &mut impl Count,
) -> Result<bool> {
    let meta_of = |v: &ValueRef| {
        graph
            .g
            .node_weight(NodeIndex::new(v.node))
            .and_then(|x| x.outputs.get(v.slot))
            .ok_or_else(|| bad(k, format!("unknown value {v}")))
    };
    let mut write = |v: ValueRef, b: u64, table: &mut FxMap<ValueRef, u64>| {
        live.add(b);
        if let Some(old) = table.insert(v, b) {
            live.sub(old);
        }
    };
    let size = |shape: &[usize], m: &ir::TensorMeta| (shape.iter().product::<usize>() * m.dtype.size()) as u64;
    Ok(match ins {
        Instr::Op { node, outputs, local_shapes, .. } => {
            let n = graph.g.node_weight(NodeIndex::new(*node)).ok_or_else(|| bad(k, format!("no node %{node}")))?;
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
                        write(*o, size(shape, m), table);
                    }
                    true
                }
            }
        }
        Instr::Collective { input, output, to, .. } => {
            let m = meta_of(input)?;
            write(*output, size(&to.local_shape(&m.shape, mesh), m), table);
            true
        }
        Instr::Transfer { value, spec, to, .. } if *to == stage => {
            let m = meta_of(value)?;
            write(*value, size(&spec.local_shape(&m.shape, mesh), m), table);
            true
        }
        Instr::Transfer { .. } => false,
        Instr::Free { values, .. } => {
            let mut shared = shared;
            for v in values {
                let b = match table.remove(v) {
                    Some(b) => b,
                    None => shared
                        .as_deref_mut()
                        .and_then(|s| s.remove(v))
                        .ok_or_else(|| bad(k, format!("frees {v}, which is not held")))?,
                };
                live.sub(b);
            }
            false
        }
    })
}

/// [`simulate_steps`]'s walk, calling `after(k, live)` after each instruction it runs.
fn walk_steps(
    plan: &Plan,
    mesh: &DeviceMesh,
    stage: usize,
    after: &mut dyn FnMut(usize, u64),
) -> Result<MemoryProfile> {
    let graph = &plan.graph;
    let Walk { segs, mut shared, resident, sum_after, steps } = prepare(plan, stage)?;
    let mut last_step: FxMap<usize, usize> = FxMap::default();
    for (i, st) in steps.iter().enumerate() {
        last_step.insert(st.microbatch, i);
    }
    let (mut live, mut peak, mut peak_at) = (resident, resident, None);
    // The prologue, once, on the shared values.
    for &(k, ins) in segs.get(&PROLOGUE).map(Vec::as_slice).unwrap_or(&[]) {
        if run(graph, mesh, stage, k, ins, &mut shared, None, &mut live)? && live > peak {
            peak = live;
            peak_at = Some(k);
        }
        after(k, live);
    }
    let mut tables: FxMap<usize, FxMap<ValueRef, u64>> = FxMap::default();
    let mut sums: FxMap<ValueRef, u64> = FxMap::default();
    let update = Segment { phase: Phase::Update, chunk: 0 };
    let runs = steps.iter().map(|st| (Some(st.microbatch), st.segment())).chain(std::iter::once((None, update)));
    for (i, (mb, seg)) in runs.enumerate() {
        if mb.is_none() {
            // The sums are what the update phase reads.
            shared.extend(sums.drain());
        }
        for &(k, ins) in segs.get(&seg).map(Vec::as_slice).unwrap_or(&[]) {
            let added = match mb {
                Some(m) => {
                    let mut table = tables.remove(&m).unwrap_or_default();
                    let added = run(graph, mesh, stage, k, ins, &mut table, Some(&mut shared), &mut live)?;
                    tables.insert(m, table);
                    added
                }
                None => {
                    let mut table = std::mem::take(&mut shared);
                    let added = run(graph, mesh, stage, k, ins, &mut table, None, &mut live)?;
                    shared = table;
                    added
                }
            };
            if added && live > peak {
                peak = live;
                peak_at = Some(k);
            }
            after(k, live);
        }
        let Some(m) = mb else { continue };
        // What the microbatch is done with joins the sums.
        let mut table = tables.remove(&m).unwrap_or_default();
        for v in &sum_after[i] {
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
        // Its last step on the stage: what else it holds is what the update reads.
        if last_step.get(&m) == Some(&i) {
            for (v, b) in table {
                if let Some(old) = shared.insert(v, b) {
                    live = live.saturating_sub(old);
                }
            }
        } else {
            tables.insert(m, table);
        }
    }
    Ok(MemoryProfile { resident, peak, peak_at })
}

/// A stretch of the walk summarised relative to the count at its start.
#[derive(Clone, Copy, Debug, Default)]
struct Summary {
    /// The count at its end.
    net: i128,
    /// Its lowest point (at most 0).
    low: i128,
    /// Its highest point where the peak is read, and the instruction reaching it first (`None`
    /// for the sums' moments, which move the peak but not where it is said to be).
    high: Option<(i128, Option<usize>)>,
}

impl Summary {
    /// Plays the stretch from `live`: `None` where a subtraction would have stopped at zero.
    fn play(&self, live: &mut u64, peak: &mut u64, peak_at: &mut Option<usize>) -> Option<()> {
        let at = *live as i128;
        if at + self.low < 0 {
            return None;
        }
        if let Some((h, k)) = self.high
            && at + h > *peak as i128
        {
            *peak = u64::try_from(at + h).ok()?;
            if k.is_some() {
                *peak_at = k;
            }
        }
        *live = u64::try_from(at + self.net).ok()?;
        Some(())
    }
}

/// [`simulate_steps`] by summaries (see there), or `None` where they would not be exact (an
/// error of the walk included: the exact walk names it).
pub fn simulate_steps_summarised(plan: &Plan, mesh: &DeviceMesh, stage: usize) -> Option<MemoryProfile> {
    let graph = &plan.graph;
    let Walk { segs, mut shared, resident, sum_after, steps } = prepare(plan, stage).ok()?;
    let update = Segment { phase: Phase::Update, chunk: 0 };
    // The segments of one microbatch in order: the same for every microbatch.
    let first = steps.first().map(|s| s.microbatch);
    let template: Vec<Segment> = steps.iter().filter(|s| Some(s.microbatch) == first).map(|s| s.segment()).collect();
    if template.contains(&update) {
        return None;
    }
    let bound = steps.iter().map(|s| s.microbatch).max().map_or(0, |m| m + 1);
    if bound > 2 * steps.len() + 16 {
        return None;
    }
    let mut next = vec![0usize; bound];
    let mut position = Vec::with_capacity(steps.len());
    for st in &steps {
        let j = &mut next[st.microbatch];
        if template.get(*j) != Some(&st.segment()) {
            return None;
        }
        position.push(*j);
        *j += 1;
    }
    if next.iter().any(|&j| j != 0 && j != template.len()) {
        return None;
    }
    // One microbatch's walk, segment by segment, on its own values only. A lone microbatch may
    // also free shared values (nothing after it reads them): its summaries are played once, in
    // the order they were made, so that is the exact walk.
    let alone = bound == 1;
    let mut table: FxMap<ValueRef, u64> = FxMap::default();
    let mut summaries = Vec::with_capacity(template.len());
    for seg in &template {
        let mut count = Relative::default();
        let mut high: Option<(i128, Option<usize>)> = None;
        for &(k, ins) in segs.get(seg).map(Vec::as_slice).unwrap_or(&[]) {
            let from = if alone { Some(&mut shared) } else { None };
            let added = run(graph, mesh, stage, k, ins, &mut table, from, &mut count).ok()?;
            if added && high.is_none_or(|(h, _)| count.now > h) {
                high = Some((count.now, Some(k)));
            }
        }
        summaries.push(Summary { net: count.now, low: count.low, high });
    }
    // The sums after each of a microbatch's segments: the first microbatch's values become
    // the sums; each later one adds into them (the new sum beside the old and the addend for a
    // moment). Then, at its end, the rest of what the first holds goes to the shared values and
    // each later one's replaces the previous one's.
    let template_sums: Vec<&[ValueRef]> =
        steps.iter().zip(&sum_after).filter(|(s, _)| Some(s.microbatch) == first).map(|(_, a)| a.as_slice()).collect();
    let mut sums: FxMap<ValueRef, u64> = FxMap::default();
    let mut later_sums = Vec::with_capacity(template.len());
    for values in &template_sums {
        let mut later = Relative::default();
        let mut high: Option<(i128, Option<usize>)> = None;
        for v in *values {
            let Some(x) = table.remove(v) else { continue };
            sums.insert(*v, x);
            later.add(x);
            if high.is_none_or(|(h, _)| later.now > h) {
                high = Some((later.now, None));
            }
            later.sub(x + x);
        }
        later_sums.push(Summary { net: later.now, low: later.low, high });
    }
    let (mut first_end, mut later_end) = (Relative::default(), Relative::default());
    for (v, b) in table {
        later_end.sub(b);
        if let Some(old) = shared.insert(v, b) {
            first_end.sub(old);
        }
    }
    let first_end = Summary { net: first_end.now, low: first_end.low, high: None };
    let later_end = Summary { net: later_end.now, low: later_end.low, high: None };

    let (mut live, mut peak, mut peak_at) = (resident, resident, None);
    for &(k, ins) in segs.get(&PROLOGUE).map(Vec::as_slice).unwrap_or(&[]) {
        if run(graph, mesh, stage, k, ins, &mut shared, None, &mut live).ok()? && live > peak {
            peak = live;
            peak_at = Some(k);
        }
    }
    let mut played = vec![0usize; template.len()];
    for &j in &position {
        summaries[j].play(&mut live, &mut peak, &mut peak_at)?;
        if played[j] > 0 {
            later_sums[j].play(&mut live, &mut peak, &mut peak_at)?;
        }
        if j + 1 == template.len() {
            if played[j] == 0 { &first_end } else { &later_end }.play(&mut live, &mut peak, &mut peak_at)?;
        }
        played[j] += 1;
    }
    // The update, as the exact walk runs it.
    shared.extend(sums.drain());
    for &(k, ins) in segs.get(&update).map(Vec::as_slice).unwrap_or(&[]) {
        if run(graph, mesh, stage, k, ins, &mut shared, None, &mut live).ok()? && live > peak {
            peak = live;
            peak_at = Some(k);
        }
    }
    Some(MemoryProfile { resident, peak, peak_at })
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
