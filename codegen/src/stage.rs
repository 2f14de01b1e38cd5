//! Pipeline stages: a plan whose mesh's outermost axis is cut into stages, each stage an SPMD
//! program over the other axes running its part of the training graph, its microbatches in
//! the order of a schedule ([`crate::schedule`]).
//!
//! [`stage`] takes a plan made on the mesh with axis 0 of size 1 (every layout is then one of
//! the stage's submesh, and never splits over the stage axis) and places it on the whole mesh:
//!
//! 1. **Forward cut.** The forward nodes (the ancestors of the outputs) that are not sources are
//!    cut, in the plan's topological order, into contiguous ranges of equal estimated seconds:
//!    one per stage, or with the interleaved schedule `chunks` per stage (virtual stage `v` is
//!    chunk `v / S` of stage `v % S`). A forward op weighs its own seconds and those of the
//!    gradient ops derived from it (named `grad/<op>/…` by the training graph) and of the
//!    updates of the parameters it is the first to read. A cut moves by up to a tenth of a
//!    stage's seconds to where at most half the bytes cross it (a transformer's layer boundary
//!    rather than inside its attention: every microbatch sends and holds what crosses).
//! 2. **The rest follows.** A gradient op runs with the forward op it was derived from (its
//!    activations are there); another backward node with its earliest backward input (a sum of
//!    gradients, where the gradient goes next), else its earliest computed input. An optimizer
//!    update runs on its parameter's stage (the next step's storage is there); sources and
//!    nodes reading only sources go where they are first read in the order a microbatch runs.
//! 3. **Phases.** Forward nodes run in the forward phase, the rest of the microbatch part in
//!    the backward; the update part (optimizer updates and the batch-independent values only
//!    they read; `crate::microbatch`) runs once per step. For ZB-H1, a stage's backward keeps
//!    only what the gradients it sends to earlier stages need (the input gradients); the rest
//!    is its weight gradients ([`Phase::Weight`]).
//! 4. **Transfers.** A conversion runs with the op it converts for. A value read on a stage
//!    that does not hold it is sent there, in its layout, before the first reader
//!    ([`Instr::Transfer`]): towards later stages in the producer's phase, towards earlier ones
//!    in the reader's (at most the backward); the graph's outputs go to every stage in the update
//!    phase, so every rank returns them.
//! 5. **Order.** The instructions are sorted (stably) into the order one microbatch runs them:
//!    forward by virtual stage, then backward and weight gradients by virtual stage from last
//!    to first, then the update; nothing reads a later phase or virtual stage, so each value's
//!    writer stays before its readers, and each stage's code is contiguous segments
//!    ([`crate::plan::Segment`]). Frees are placed per stage, in the segment of the last read.
//! 6. **Schedule and estimate.** The schedule's steps come from each stage's forward, backward
//!    and weight-gradient seconds; `plan::schedule::timeline` plays them (an error if they
//!    deadlock) for the step's seconds and the bubble, and `plan::memory::simulate_steps`
//!    walks each stage's steps for its peak, which must fit the budget.
//!
//! Any placement computes the same values (transfers move blocks unchanged); the cut only
//! decides how balanced the stages are, the schedule how long they wait.

use std::collections::{HashMap, HashSet};

use ir::{NodeIndex, Op};
use sharding::{DeviceMesh, ShardingSpec};

use crate::schedule::StepSeconds;
use crate::{Error, Result, fmt_bytes};
use ::plan::{
    Instr, MeshInfo, ParamShard, Phase, Pipeline, Plan, Recompute, Schedule, ScheduleKind, Segment, StageEstimate,
    ValueRef,
};

/// The mesh a pipelined plan is solved on: `mesh` with axis 0 of size 1.
pub fn stage_mesh(mesh: &DeviceMesh, stages: usize) -> Result<DeviceMesh> {
    let bad = |why: String| Error::Pipeline(why);
    if stages < 2 {
        return Err(bad(format!("{stages} stages: a pipeline has at least 2")));
    }
    if mesh.shape().first() != Some(&stages) {
        return Err(bad(format!(
            "{stages} stages on mesh {mesh}: the stages are the coordinates of the outermost mesh axis, so it must \
             have size {stages} (e.g. --mesh {stages}x2 for {stages} stages of 2 devices)"
        )));
    }
    let mut shape = mesh.shape().to_vec();
    shape[0] = 1;
    Ok(DeviceMesh::new(shape, mesh.names().to_vec(), mesh.links().to_vec())?)
}

/// Shapes `inner` (a plan of one microbatch on `sub`, lowered with whatever recomputation made
/// it fit there) into its step: split into `microbatches` and, with `pipeline`, staged on
/// `mesh` (`sub` is then one stage's submesh); then recomputes what the step needs: the inner
/// recomputation is dropped, then (with `Fit`/`Auto`) while a stage is over `budget`, the
/// cheapest chain stages on it whose activations, times the microbatches it holds in flight,
/// cover its excess are recomputed ([`crate::checkpoint::knapsack`]), and the plan shaped
/// again; `Full` recomputes every chain stage, `Off` none. A plan still over the budget is
/// returned as it is (its estimate says so).
pub(crate) fn staged(
    inner: Plan,
    sub: &DeviceMesh,
    mesh: &DeviceMesh,
    pipeline: Option<&PipelineOptions>,
    budget: u64,
    policy: Recompute,
    microbatches: usize,
) -> Result<Plan> {
    let g = &inner.graph;
    let keep = crate::checkpoint::kept_to_the_end(g);
    let r = crate::checkpoint::Recomputable::new(g, &inner.program)?;
    let every = policy == Recompute::Full;
    let mut chosen: Vec<usize> = if every { (0..r.len()).collect() } else { vec![] };
    let before = inner.estimate.checkpoint.peak_before;
    let mut last = None;
    // Per stage, the excess before the last pick and the saving predicted for it: what the
    // walk then showed corrects the next pick's target (a saving times the microbatches in
    // flight overstates what the stage's peak loses when its chunks' flights do not peak at
    // once; without the correction each round took a fixed fraction of the excess and six
    // left LLaMA-3 405B's stages 5-10% over).
    let mut picked: HashMap<usize, (u64, u64)> = HashMap::new();
    const ROUNDS: usize = 6;
    for round in 0..ROUNDS {
        let mut p = inner.clone();
        p.program = r.program(&chosen, &keep);
        let after = crate::memory::simulate(g, sub, &p.program)?.peak;
        p.estimate.checkpoint = r.report(&chosen, before, after);
        p.estimate.recompute_seconds = p.estimate.checkpoint.extra_seconds;
        p.estimate.peak_bytes_per_rank = after;
        let p = match pipeline {
            Some(how) => place(crate::microbatch::microbatched(p, sub, microbatches)?, mesh, how)?,
            None => crate::microbatch::split(p, sub, microbatches)?,
        };
        let over: Vec<(usize, u64)> = match &p.pipeline {
            Some(pp) => pp
                .per_stage
                .iter()
                .enumerate()
                .filter(|(_, st)| st.peak_bytes > budget)
                .map(|(s, st)| (s, st.peak_bytes - budget))
                .collect(),
            None if p.estimate.peak_bytes_per_rank > budget => vec![(0, p.estimate.peak_bytes_per_rank - budget)],
            None => vec![],
        };
        if over.is_empty() || policy == Recompute::Off || chosen.len() == r.len() || round + 1 == ROUNDS {
            return Ok(p);
        }
        // Where each chain stage runs, and how many microbatches its stage holds in flight.
        let mut place_of: HashMap<usize, (usize, usize)> = HashMap::new();
        for ins in &p.program {
            if let Instr::Op { node, stage, chunk, recompute: false, .. } = ins {
                place_of.insert(*node, (*stage, *chunk));
            }
        }
        let flight = in_flight(&p);
        let mut added = false;
        for (stage, excess) in over {
            let cands: Vec<usize> = (0..r.len())
                .filter(|c| !chosen.contains(c))
                .filter(|&c| r.node(c).and_then(|n| place_of.get(&n)).is_some_and(|&(s, _)| s == stage))
                .collect();
            let save: Vec<u64> = cands
                .iter()
                .map(|&c| {
                    let at = r.node(c).and_then(|n| place_of.get(&n)).copied().unwrap_or((stage, 0));
                    r.saving(c).saturating_mul(flight.get(&at).copied().unwrap_or(1).max(1) as u64)
                })
                .collect();
            let cost: Vec<f64> = cands.iter().map(|&c| r.cost(c)).collect();
            // The share of the predicted saving the last pick delivered (at least a tenth).
            let delivered = picked.get(&stage).map_or(1.0, |&(was, predicted)| {
                (was.saturating_sub(excess) as f64 / predicted.max(1) as f64).clamp(0.1, 1.0)
            });
            let need = ((excess + excess / 10) as f64 / delivered).min(u64::MAX as f64) as u64;
            // The last pick recomputes every candidate of a stage still over: `fit` then fits
            // wherever recomputing everything does.
            let pick = match crate::checkpoint::knapsack(&save, &cost, need) {
                Some(pick) if round + 2 < ROUNDS => pick,
                _ => (0..cands.len()).collect(),
            };
            picked.insert(stage, (excess, pick.iter().map(|&i| save[i]).sum()));
            added |= !pick.is_empty();
            chosen.extend(pick.into_iter().map(|i| cands[i]));
        }
        chosen.sort_unstable();
        chosen.dedup();
        last = Some(p);
        if !added {
            break;
        }
    }
    last.ok_or_else(|| Error::Internal("shaping the step: no plan".into()))
}

/// Per (stage, chunk): the most microbatches whose activations it holds at once under the
/// plan's schedule (forwards run and not yet their backward).
fn in_flight(p: &Plan) -> HashMap<(usize, usize), usize> {
    let mut most = HashMap::new();
    for (s, steps) in p.steps().iter().enumerate() {
        let mut open: HashMap<usize, usize> = HashMap::new();
        for st in steps {
            let n = open.entry(st.chunk).or_insert(0);
            match st.phase {
                Phase::Forward => *n += 1,
                Phase::Backward => *n = n.saturating_sub(1),
                _ => {}
            }
            let m = most.entry((s, st.chunk)).or_insert(0);
            *m = (*m).max(*n);
        }
    }
    most
}

/// How to pipeline a plan.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PipelineOptions {
    /// Pipeline stages (the size of mesh axis 0).
    pub stages: usize,
    /// The schedule.
    pub schedule: ScheduleKind,
    /// Model chunks per stage (interleaved schedules; 1 otherwise).
    pub chunks: usize,
    /// Memory budget per rank, bytes.
    pub budget: u64,
}

/// A node's place in the pipelined program: virtual stage (`chunk * stages + stage`) and
/// phase.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Place {
    vstage: usize,
    phase: Phase,
}

impl Place {
    const START: Place = Place { vstage: 0, phase: Phase::Forward };

    /// Its rank in the order a microbatch runs (virtual stage, phase) in (a stage's segment
    /// order over its chunks is this order over the virtual stages).
    fn key(self, vstages: usize) -> (u8, usize) {
        Segment { phase: self.phase, chunk: self.vstage }.rank(vstages)
    }

    /// Device stage and model chunk (the update phase is one segment per stage: chunk 0).
    fn device(self, stages: usize) -> (usize, usize) {
        (self.vstage % stages, if self.phase == Phase::Update { 0 } else { self.vstage / stages })
    }
}

/// Places `plan` (made on [`stage_mesh`]) on `mesh` as pipeline stages (see the module docs);
/// every stage's peak under the schedule must fit the budget.
pub fn stage(plan: Plan, mesh: &DeviceMesh, opts: &PipelineOptions) -> Result<Plan> {
    let plan = if plan.program.iter().any(|i| i.phase() == Phase::Update) {
        plan
    } else {
        crate::microbatch::update_phase(plan, &stage_mesh(mesh, opts.stages)?)?
    };
    check_budget(place(plan, mesh, opts)?, opts.budget)
}

/// `plan` if its stages' peaks fit `budget`, else the error naming the stage.
pub(crate) fn check_budget(plan: Plan, budget: u64) -> Result<Plan> {
    let peak = plan.estimate.peak_bytes_per_rank;
    if peak <= budget {
        return Ok(plan);
    }
    let (worst, kind) = match &plan.pipeline {
        Some(pp) => (pp.per_stage.iter().position(|s| s.peak_bytes == peak).unwrap_or(0), pp.schedule.kind.to_string()),
        None => (0, String::new()),
    };
    Err(Error::Pipeline(format!(
        "stage {worst} needs {} per rank under the {kind} schedule, over the budget of {}; use more stages, a larger mesh \
         per stage, another schedule or --memory {}",
        fmt_bytes(peak),
        fmt_bytes(budget),
        fmt_bytes(peak + peak / 100 + 1)
    )))
}

/// [`stage`] without the budget check (the estimates say the peak), of a plan whose update part
/// is in the update phase: the nodes placed ([`Nodes::place`]), the program placed with its
/// transfers ([`place_program`]), the schedule made ([`schedule_of`]) and played for the
/// estimates ([`estimate`]).
pub(crate) fn place(plan: Plan, mesh: &DeviceMesh, opts: &PipelineOptions) -> Result<Plan> {
    let stages = opts.stages;
    let chunks = if opts.schedule == ScheduleKind::Interleaved { opts.chunks.max(2) } else { 1 };
    let nodes = Nodes::new(&plan.graph, &plan.program)?;
    let place = nodes.place(&plan.program, stages, chunks)?;
    let microbatches = plan.microbatches;
    let program = place_program(plan.program, &plan.graph, mesh, &place, stages, chunks, opts.schedule)?;
    let program = crate::microbatch::prologue(&plan.graph, plan.solver.chosen, mesh.shape(), microbatches, program);
    let schedule = schedule_of(&program, opts.schedule, stages, microbatches, chunks)?;
    let params = plan
        .params
        .into_iter()
        .map(|p| ParamShard {
            offsets: ::plan::listed_offsets(&p.spec, &p.shape, mesh),
            stage: place[p.node].device(stages).0,
            ..p
        })
        .collect();
    let shown: Vec<bool> = (0..nodes.len()).map(|i| nodes.forward[i] && !nodes.is_source(i)).collect();
    let mut options = plan.options;
    options.budget_bytes = opts.budget;
    let out = Plan {
        mesh: MeshInfo { shape: mesh.shape().to_vec(), names: mesh.names().to_vec(), links: mesh.links().to_vec() },
        options,
        pipeline: Some(Pipeline { stages, microbatches, per_stage: vec![], schedule }),
        params,
        program,
        ..plan
    };
    estimate(out, mesh, &shown, stages, microbatches)
}

/// What placing needs of the plan's graph (program node ids are topological: the plan's graph
/// is canonical).
struct Nodes<'g> {
    g: &'g ir::Graph,
    inputs_of: Vec<Vec<usize>>,
    consumers: Vec<Vec<usize>>,
    /// The forward nodes: the ancestors of the outputs.
    forward: Vec<bool>,
    /// The update phase (`crate::microbatch`'s), which runs once per step.
    update: Vec<bool>,
    /// The forward ops that are not sources, by name.
    index_of: HashMap<&'g str, usize>,
}

impl<'g> Nodes<'g> {
    fn new(g: &'g ir::Graph, program: &[Instr]) -> Result<Nodes<'g>> {
        let n_nodes = g.g.node_count();
        let inputs_of: Vec<Vec<usize>> =
            (0..n_nodes).map(|i| g.node_inputs(NodeIndex::new(i)).iter().map(|v| v.node.index()).collect()).collect();
        let mut consumers: Vec<Vec<usize>> = vec![vec![]; n_nodes];
        for (i, ins) in inputs_of.iter().enumerate() {
            for &j in ins {
                consumers[j].push(i);
            }
        }
        if g.outputs.is_empty() {
            return Err(Error::Pipeline("the graph has no output to pipeline towards".into()));
        }
        let forward = crate::microbatch::forward_nodes(g);
        let mut update = vec![false; n_nodes];
        for ins in program {
            if let Instr::Op { node, phase: Phase::Update, .. } = ins {
                update[*node] = true;
            }
        }
        let index_of = (0..n_nodes)
            .filter(|&i| forward[i] && !g.node(NodeIndex::new(i)).op.is_source())
            .map(|i| (g.node(NodeIndex::new(i)).name.as_str(), i))
            .collect();
        Ok(Nodes { g, inputs_of, consumers, forward, update, index_of })
    }

    fn len(&self) -> usize {
        self.inputs_of.len()
    }

    fn node(&self, i: usize) -> &'g ir::Node {
        self.g.node(NodeIndex::new(i))
    }

    fn is_source(&self, i: usize) -> bool {
        self.node(i).op.is_source()
    }

    fn phase_of(&self, i: usize) -> Phase {
        if self.update[i] {
            Phase::Update
        } else if self.forward[i] {
            Phase::Forward
        } else {
            Phase::Backward
        }
    }

    /// Every node's place: the forward cut (1 in the module docs), then the rest (2).
    fn place(&self, program: &[Instr], stages: usize, chunks: usize) -> Result<Vec<Place>> {
        let vstages = stages * chunks;
        let mut place = self.cut_forward(program, stages, chunks)?;
        self.place_backward(&mut place);
        // What is left (sources, nodes reading only sources) runs where it is first needed, in
        // the order a microbatch runs; updates with their parameter (the next step's storage).
        self.place_by_consumers(&mut place, true, vstages);
        self.place_updates(&mut place);
        self.place_by_consumers(&mut place, false, vstages);
        Ok(place.into_iter().map(|p| p.unwrap_or(Place::START)).collect())
    }

    /// The forward ops placed by the forward cut, by estimated seconds (a floor keeps free ops
    /// from piling up); nothing else placed yet.
    fn cut_forward(&self, program: &[Instr], stages: usize, chunks: usize) -> Result<Vec<Option<Place>>> {
        let vstages = stages * chunks;
        let n_nodes = self.len();
        let forward = &self.forward;
        let mut seconds = vec![0.0f64; n_nodes];
        for ins in program {
            if let Instr::Op { node, seconds: s, .. } = ins {
                seconds[*node] += s;
            }
        }
        let fwd: Vec<usize> = (0..n_nodes).filter(|&i| forward[i] && !self.is_source(i)).collect();
        if fwd.len() < vstages {
            let what =
                if chunks > 1 { format!("{stages} stages of {chunks} chunks") } else { format!("{stages} stages") };
            return Err(Error::Pipeline(format!("the model has {} forward ops: too few for {what}", fwd.len())));
        }
        // A forward op's weight: its seconds and those of the gradient ops the training graph
        // derived from it (named `grad/<op>/...`) and of the updates of the parameters it reads
        // first, which will run on its stage.
        let mut extra = vec![0.0f64; n_nodes];
        for i in (0..n_nodes).filter(|&i| !forward[i]) {
            let name = &self.node(i).name;
            let owner = if name.starts_with("grad/") {
                self.grad_owner(i)
            } else if name.starts_with("update/") {
                self.inputs_of[i]
                    .iter()
                    .filter(|&&j| matches!(self.node(j).op, Op::Param { .. }))
                    .find_map(|&j| self.consumers[j].iter().copied().filter(|&c| forward[c]).min())
            } else {
                None
            };
            if let Some(o) = owner {
                extra[o] += seconds[i];
            }
        }
        let weight: Vec<f64> = fwd.iter().map(|&i| seconds[i] + extra[i] + 1e-9).collect();
        let bytes = |i: usize| self.node(i).outputs.iter().map(|m| m.bytes() as f64).sum();
        let starts = forward_cut(&fwd, &weight, &self.consumers, &bytes, vstages);
        let mut place: Vec<Option<Place>> = vec![None; n_nodes];
        let mut v = 0;
        for (k, &i) in fwd.iter().enumerate() {
            while v + 1 < vstages && starts[v + 1] <= k {
                v += 1;
            }
            place[i] = Some(Place { vstage: v, phase: Phase::Forward });
        }
        Ok(place)
    }

    /// The forward op a gradient op was derived from (named `grad/<op>/...`).
    fn grad_owner(&self, i: usize) -> Option<usize> {
        let rest = self.node(i).name.strip_prefix("grad/")?;
        rest.match_indices('/').map(|(p, _)| &rest[..p]).find_map(|cand| self.index_of.get(cand).copied())
    }

    /// Backward ops run with the forward op they were derived from (its activations are there);
    /// others with their earliest computed backward input (a sum of gradients where the
    /// gradient goes next), else their earliest computed input. (The earliest computed input
    /// alone would pull a gradient op that reads an early stage's value, a mask or a tied
    /// weight, and every op after it, to that stage.)
    fn place_backward(&self, place: &mut [Option<Place>]) {
        for i in 0..self.len() {
            if place[i].is_some() || self.is_source(i) || self.update[i] {
                continue;
            }
            let computed =
                || self.inputs_of[i].iter().filter(|&&j| !self.is_source(j)).filter_map(|&j| place[j].map(|p| (j, p)));
            let v = self
                .grad_owner(i)
                .and_then(|o| place[o])
                .map(|p| p.vstage)
                .or_else(|| computed().filter(|(j, _)| !self.forward[*j]).map(|(_, p)| p.vstage).min())
                .or_else(|| computed().map(|(_, p)| p.vstage).min());
            place[i] = v.map(|vstage| Place { vstage, phase: self.phase_of(i) });
        }
    }

    /// Unplaced nodes and sources with their first reader in the order a microbatch runs
    /// (skipping update-phase readers with `skip_updates`).
    fn place_by_consumers(&self, place: &mut [Option<Place>], skip_updates: bool, vstages: usize) {
        for i in (0..self.len()).rev() {
            if place[i].is_some() && !self.is_source(i) {
                continue;
            }
            let first = self.consumers[i]
                .iter()
                .filter(|&&c| !(skip_updates && self.update[c]))
                .filter_map(|&c| place[c])
                .min_by_key(|&p| p.key(vstages));
            if let Some(p) = first {
                // A source takes its first reader's phase (an update's: the update phase).
                let phase = if self.is_source(i) { p.phase } else { self.phase_of(i) };
                place[i] = Some(Place { vstage: p.vstage, phase });
            }
        }
    }

    /// An optimizer update runs on its parameter's stage; other update-phase ops (gradient
    /// clipping) run where their largest input is (a gradient is scaled on its stage, only the
    /// scalar norm and coefficient travel), the earliest stage on a tie.
    fn place_updates(&self, place: &mut [Option<Place>]) {
        let mut update_of_param: HashMap<usize, usize> = HashMap::new();
        for (p, v) in &self.g.updates {
            if matches!(self.node(p.index()).op, Op::Param { .. }) {
                update_of_param.insert(v.node.index(), p.index());
            }
        }
        let bytes = |j: usize| self.node(j).outputs.iter().map(|m| m.bytes()).max().unwrap_or(0);
        for i in 0..self.len() {
            if self.update[i] && !self.is_source(i) {
                let owner = update_of_param.get(&i).and_then(|&p| place[p]).map(|p| p.vstage);
                let v = owner.or_else(|| {
                    self.inputs_of[i]
                        .iter()
                        .filter_map(|&j| place[j].map(|p| (bytes(j), p.vstage)))
                        .max_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)))
                        .map(|(_, v)| v)
                });
                place[i] = Some(Place { vstage: v.unwrap_or(0), phase: Phase::Update });
            }
        }
    }
}

/// The program placed (3 and 4 in the module docs): each instruction on its node's place (a
/// conversion on the op it converts for's), the transfers a stage's reads need and the outputs'
/// to every stage, ZB-H1's weight gradients split off, sorted into the order a microbatch runs,
/// each transfer's sending segment, and frees per stage.
fn place_program(
    program: Vec<Instr>,
    g: &ir::Graph,
    mesh: &DeviceMesh,
    place: &[Place],
    stages: usize,
    chunks: usize,
    schedule: ScheduleKind,
) -> Result<Vec<Instr>> {
    let vstages = stages * chunks;
    let program: Vec<Instr> = program.into_iter().filter(|i| !matches!(i, Instr::Free { .. })).collect();
    let places = instruction_places(&program, place);
    let meta = |v: &ValueRef| g.node(NodeIndex::new(v.node)).outputs[v.slot].clone();
    let transfer = |value: ValueRef, spec: &ShardingSpec, from: usize, to: usize, phase: Phase, to_chunk: usize| {
        let m = meta(&value);
        let bytes = spec.local_bytes(&m.shape, mesh, m.dtype.size());
        let seconds = mesh.time(&[0], bytes as f64, true);
        Instr::Transfer { value, spec: spec.clone(), from, to, bytes, seconds, phase, from_chunk: 0, to_chunk }
    };
    // (instruction, its sort key)
    let mut out: Vec<(Instr, (u8, usize))> = Vec::with_capacity(program.len() * 2);
    let mut home: HashMap<ValueRef, (usize, ShardingSpec, Place)> = HashMap::new();
    let mut held: HashSet<(usize, ValueRef)> = HashSet::new();
    for (mut ins, p) in program.into_iter().zip(places) {
        let (stage, chunk) = p.device(stages);
        let reads: Vec<ValueRef> = match &ins {
            Instr::Op { inputs, .. } => inputs.clone(),
            Instr::Collective { input, .. } => vec![*input],
            Instr::Free { .. } | Instr::Transfer { .. } => unreachable!("removed or not yet placed"),
        };
        for r in reads {
            if !held.contains(&(stage, r)) {
                let (from, spec, at) = home
                    .get(&r)
                    .cloned()
                    .ok_or_else(|| Error::Internal(format!("pipelining: {r} is read before it is written")))?;
                // Forward transfers go with the microbatch's forward; those towards earlier
                // stages with the reader's phase (at most the backward, so that what flows
                // backwards is all in one phase).
                let phase = if from < stage { at.phase } else { p.phase.min(Phase::Backward).max(at.phase) };
                let to_chunk = if phase == Phase::Update { 0 } else { chunk };
                let key = Place { vstage: p.vstage, phase }.key(vstages);
                out.push((transfer(r, &spec, from, stage, phase, to_chunk), key));
                held.insert((stage, r));
            }
        }
        match &mut ins {
            Instr::Op { outputs, output_specs, stage: st, phase, chunk: c, .. } => {
                for (o, sp) in outputs.iter().zip(output_specs.iter()) {
                    home.insert(*o, (stage, sp.clone(), p));
                    held.insert((stage, *o));
                }
                (*st, *phase, *c) = (stage, p.phase, chunk);
            }
            Instr::Collective { output, to, stage: st, phase, chunk: c, .. } => {
                home.insert(*output, (stage, to.clone(), p));
                held.insert((stage, *output));
                (*st, *phase, *c) = (stage, p.phase, chunk);
            }
            _ => {}
        }
        out.push((ins, p.key(vstages)));
    }
    for (_, v) in &g.outputs {
        let r = ValueRef::of(*v);
        let (from, spec, _) =
            home.get(&r).cloned().ok_or_else(|| Error::Internal(format!("pipelining: output {r} is never written")))?;
        for to in (0..stages).filter(|&s| !held.contains(&(s, r))) {
            out.push((
                transfer(r, &spec, from, to, Phase::Update, 0),
                Place { vstage: 0, phase: Phase::Update }.key(1),
            ));
        }
    }
    // Zero bubble: a stage's backward keeps what the gradients it sends need; the rest of its
    // backward is weight gradients (W).
    if schedule == ScheduleKind::ZbH1 {
        split_weight_gradients(&mut out, stages);
    }
    // Every stage's instructions in the order a microbatch runs them (a stable sort keeps each
    // value's writer before its readers: nothing reads a later phase or virtual stage).
    out.sort_by_key(|(_, k)| *k);
    let mut program: Vec<Instr> = out.into_iter().map(|(i, _)| i).collect();
    sending_segments(&mut program, stages, chunks);
    let keep = crate::checkpoint::kept_to_the_end(g);
    Ok(crate::checkpoint::insert_frees(program, &keep))
}

/// Each instruction's place: an op's node's; a conversion's, the op it converts for.
fn instruction_places(program: &[Instr], place: &[Place]) -> Vec<Place> {
    let mut places: Vec<Place> = vec![Place::START; program.len()];
    let mut next = Place::START;
    for (k, ins) in program.iter().enumerate().rev() {
        match ins {
            // A recomputation runs where its node's activations are, for the backward that
            // reads it.
            Instr::Op { node, recompute: true, .. } => {
                next = Place { vstage: place[*node].vstage, phase: next.phase.max(Phase::Backward) }
            }
            Instr::Op { node, .. } => next = place[*node],
            _ => {}
        }
        places[k] = next;
    }
    places
}

/// A transfer leaves its sender in the segment the sender is in by then.
fn sending_segments(program: &mut [Instr], stages: usize, chunks: usize) {
    let mut cur: Vec<Option<Segment>> = vec![None; stages];
    for ins in program {
        match ins {
            Instr::Transfer { from, phase, from_chunk, .. } => {
                *from_chunk = match cur[*from] {
                    Some(seg) if seg.phase == *phase => seg.chunk,
                    _ if matches!(*phase, Phase::Forward | Phase::Update) => 0,
                    _ => chunks - 1,
                };
                let seg = Segment { phase: *phase, chunk: *from_chunk };
                cur[*from] = Some(seg);
            }
            _ => {
                for (s, c) in cur.iter_mut().enumerate() {
                    if let Some(seg) = ins.segment_on(s) {
                        *c = Some(seg);
                    }
                }
            }
        }
    }
}

/// The schedule (5 in the module docs), from each stage's forward, backward and
/// weight-gradient seconds; not yet played.
fn schedule_of(
    program: &[Instr],
    kind: ScheduleKind,
    stages: usize,
    microbatches: usize,
    chunks: usize,
) -> Result<Schedule> {
    let mut step_seconds = StepSeconds { per_stage: vec![[0.0; 3]; stages] };
    for ins in program {
        let (s, secs) = match ins {
            Instr::Op { stage, seconds, .. } | Instr::Collective { stage, seconds, .. } => (*stage, *seconds),
            Instr::Transfer { to, seconds, .. } => (*to, *seconds),
            Instr::Free { .. } => continue,
        };
        let p = match ins.phase() {
            Phase::Forward => 0,
            Phase::Backward => 1,
            Phase::Weight => 2,
            Phase::Prologue | Phase::Update => continue,
        };
        step_seconds.per_stage[s][p] += secs;
    }
    let steps = crate::schedule::steps(kind, stages, microbatches, chunks, &step_seconds)?;
    Ok(Schedule { kind, chunks, steps, seconds: 0.0, bubble: 0.0 })
}

/// The estimates (6 in the module docs): the schedule played, and each stage's memory under
/// it. `shown[node]`: whether a stage's first and last ops may name the node.
fn estimate(mut out: Plan, mesh: &DeviceMesh, shown: &[bool], stages: usize, microbatches: usize) -> Result<Plan> {
    let timeline = ::plan::schedule::timeline(&out).map_err(|why| Error::Internal(format!("pipelining: {why}")))?;
    let compute_of: HashMap<&str, f64> =
        out.estimate.per_op.iter().map(|o| (o.node.as_str(), o.compute_seconds)).collect();
    let mut per_stage = vec![];
    let mut transfer_total = 0.0;
    for s in 0..stages {
        let mem = crate::memory::simulate_steps(&out, mesh, s)?;
        let (mut ops, mut compute, mut comm, mut recv) = (0, 0.0, 0.0, 0.0);
        let mut names = vec![];
        for ins in &out.program {
            // The microbatch part runs once per microbatch.
            let times = if ins.once_per_step() { 1.0 } else { microbatches as f64 };
            match ins {
                Instr::Op { stage, node, name, seconds, .. } if *stage == s => {
                    ops += 1;
                    // An op's seconds are its compute and its own collectives.
                    let c = compute_of.get(name.as_str()).copied().unwrap_or(*seconds).min(*seconds);
                    compute += c * times;
                    comm += (seconds - c) * times;
                    if shown[*node] {
                        names.push(&out.graph.node(NodeIndex::new(*node)).name);
                    }
                }
                Instr::Collective { stage, seconds, .. } if *stage == s => comm += seconds * times,
                Instr::Transfer { to, seconds, .. } if *to == s => recv += seconds * times,
                _ => {}
            }
        }
        transfer_total += recv;
        per_stage.push(StageEstimate {
            ops,
            first: names.first().map_or(String::new(), |n| n.to_string()),
            last: names.last().map_or(String::new(), |n| n.to_string()),
            compute_seconds: compute,
            comm_seconds: comm,
            transfer_seconds: recv,
            peak_bytes: mem.peak,
            resident_bytes: mem.resident,
        });
    }
    let peak = per_stage.iter().map(|s| s.peak_bytes).max().unwrap_or(0);
    let overlap = out.options.overlap;
    let hidden: f64 = ::plan::schedule::hidden_seconds(&out).iter().map(|(a, b)| a + b).sum();
    let e = &mut out.estimate;
    e.step_seconds = timeline.step_seconds;
    e.comm_seconds += transfer_total;
    // With overlap, the transfers run beside the stages' work (a stage waits only for their
    // arrival), and each stage hides some of its prologue's gathers and update's reductions.
    e.overlapped_comm_seconds = if overlap { transfer_total + hidden } else { 0.0 };
    e.peak_bytes_per_rank = peak;
    e.resident_bytes_per_rank = per_stage.iter().map(|s| s.resident_bytes).max().unwrap_or(0);
    if let Some(p) = &mut out.pipeline {
        p.per_stage = per_stage;
        p.schedule.seconds = timeline.seconds;
        p.schedule.bubble = timeline.bubble;
    }
    Ok(out)
}

/// Where each virtual stage's forward ops begin (`starts[0] == 0`, increasing, none empty),
/// as positions in `fwd` (the forward ops in topological order, of seconds `weight`).
///
/// Each cut is near where the ops before it weigh `b / vstages` of the whole, within
/// [`CUT_SLACK`] of a stage's weight, at the position where the fewest bytes cross it
/// (values made before it and read by a forward op after it; nearest the balanced point on a
/// tie) when that halves the bytes crossing at the balanced point: in a transformer, a layer's boundary (its hidden state) rather than inside attention
/// (its scores, sequence² per head), which every microbatch would send and hold.
fn forward_cut(
    fwd: &[usize],
    weight: &[f64],
    consumers: &[Vec<usize>],
    bytes: &dyn Fn(usize) -> f64,
    vstages: usize,
) -> Vec<usize> {
    let n = fwd.len();
    let pos: HashMap<usize, usize> = fwd.iter().enumerate().map(|(k, &i)| (i, k)).collect();
    // crossing[k]: bytes live across a cut before position k (a difference array over the
    // positions between each value's producer and its last forward reader).
    let mut diff = vec![0.0f64; n + 1];
    for (k, &i) in fwd.iter().enumerate() {
        if let Some(last) = consumers[i].iter().filter_map(|c| pos.get(c)).max()
            && *last > k
        {
            let b = bytes(i);
            diff[k + 1] += b;
            diff[*last + 1] -= b;
        }
    }
    let mut crossing = vec![0.0f64; n + 1];
    let mut run = 0.0;
    for k in 0..=n {
        run += diff[k];
        crossing[k] = run;
    }
    // cum[k]: the weight of the ops before position k.
    let mut cum = vec![0.0f64; n + 1];
    for k in 0..n {
        cum[k + 1] = cum[k] + weight[k];
    }
    let total = cum[n].max(f64::MIN_POSITIVE);
    let per = total / vstages as f64;
    let mut starts = vec![0usize];
    for b in 1..vstages {
        let target = per * b as f64;
        // At least one op per stage before and after.
        let (lo, hi) = (starts[b - 1] + 1, n - (vstages - b));
        if lo > hi {
            starts.push(lo.min(n - 1));
            continue;
        }
        // The balanced position: the first op whose middle is past the target starts the stage.
        let balanced =
            (lo..=hi).find(|&k| (((cum[k] + weight[k] / 2.0) / total) * vstages as f64) as usize >= b).unwrap_or(hi);
        let near = |k: usize| (cum[k] - target).abs();
        let best = (lo..=hi)
            .filter(|&k| near(k) <= CUT_SLACK * per)
            .min_by(|&a, &b| crossing[a].total_cmp(&crossing[b]).then(near(a).total_cmp(&near(b))))
            .unwrap_or(balanced);
        // Balance goes only for at most half the bytes.
        starts.push(if crossing[best] * 2.0 <= crossing[balanced] { best } else { balanced });
    }
    starts
}

/// How far from a balanced cut [`forward_cut`] may move to cross fewer bytes, as a fraction
/// of one virtual stage's seconds.
const CUT_SLACK: f64 = 0.1;

/// Marks as weight gradients ([`Phase::Weight`]) the backward instructions of each stage that
/// no transfer out of the stage needs (see [`stage`]); `program` is in program order.
fn split_weight_gradients(program: &mut [(Instr, (u8, usize))], stages: usize) {
    for s in 0..stages {
        let mut needed: HashSet<ValueRef> = HashSet::new();
        for (ins, key) in program.iter_mut().rev() {
            match ins {
                Instr::Transfer { from, value, phase: Phase::Backward, .. } if *from == s => {
                    needed.insert(*value);
                }
                Instr::Op { stage, phase: phase @ Phase::Backward, outputs, inputs, .. } if *stage == s => {
                    if outputs.iter().any(|o| needed.contains(o)) {
                        needed.extend(inputs.iter().copied());
                    } else {
                        *phase = Phase::Weight;
                        key.0 = Segment { phase: Phase::Weight, chunk: 0 }.rank(1).0;
                    }
                }
                Instr::Collective { stage, phase: phase @ Phase::Backward, output, input, .. } if *stage == s => {
                    if needed.contains(output) {
                        needed.insert(*input);
                    } else {
                        *phase = Phase::Weight;
                        key.0 = Segment { phase: Phase::Weight, chunk: 0 }.rank(1).0;
                    }
                }
                _ => {}
            }
        }
    }
}
