//! Activation checkpointing after sharding: which forward activations a plan recomputes during
//! backward instead of keeping, so that the program fits its memory budget.
//!
//! It works on the lowered program (strategies and conversions fixed), before frees are placed:
//!
//! 1. **The linearised chain.** The forward part of the graph (the ancestors of the loss) is cut
//!    into *stages* at its articulation values: points of the forward order where exactly one
//!    value computed from parameters is still to be read by later forward ops (a transformer
//!    block's residual stream, a ResNet block's output, an MLP layer's activation). Values that
//!    depend on no parameter (inputs, masks derived from them) are available everywhere and never
//!    recomputed.
//! 2. **Costs.** A stage's *saving* is the bytes per rank of its activations read by backward
//!    (its boundary value excluded: boundaries stay); its *cost* is the seconds of re-running
//!    the forward instructions those activations need (ops and their input conversions).
//! 3. **Choice.** A 0/1 knapsack by dynamic programming over the chain's stages (memory in 1,024
//!    buckets) picks the cheapest set of stages whose savings cover the excess; the transformed
//!    program's peak is then measured by the exact liveness walk ([`crate::memory::simulate`])
//!    and, while it is still above the budget, the shortfall is added to the requirement and the
//!    choice repeated (the additive model ignores that a recomputed stage is briefly whole again).
//! 4. **Rewrite.** A recomputed stage's instructions are re-emitted (marked `recompute`) right
//!    before the first backward unit (an op and its input conversions) that reads one of its
//!    activations, so that every unit stays whole; [`insert_frees`] then frees every definition
//!    of a value after its last read, so the forward copies die after their last forward read
//!    and the recomputed ones after their last backward read.
//!
//! Invariant: the rewritten program computes exactly what the original computes (the same ops
//! on the same blocks); only when values are held changes.

use std::collections::{HashMap, HashSet};

use ir::{Graph, NodeIndex, Op};
use sharding::DeviceMesh;

use crate::memory::simulate;
use crate::{Error, Result};
use ::plan::{Instr, ValueRef};

pub use ::plan::CheckpointReport;

/// The values a step keeps to its end (never freed): the graph's outputs, updated values,
/// constants, and parameters and state nobody updates (frozen). An updated parameter or state
/// gives its storage up after its last read: its new value (kept, as nothing reads it) becomes
/// the storage of the next step.
pub fn kept_to_the_end(g: &Graph) -> HashSet<ValueRef> {
    let updated: HashSet<NodeIndex> = g.updates.iter().map(|(p, _)| *p).collect();
    g.outputs
        .iter()
        .map(|(_, v)| ValueRef::of(*v))
        .chain(g.updates.iter().map(|(_, v)| ValueRef::of(*v)))
        .chain(g.g.node_indices().filter_map(|n| match g.node(n).op {
            Op::Param { .. } | Op::State { .. } if !updated.contains(&n) => Some(ValueRef::new(n.index(), 0)),
            Op::Constant(_) => Some(ValueRef::new(n.index(), 0)),
            _ => None,
        }))
        .collect()
}

/// Places `free` instructions: every definition of a value is freed right after its last read
/// before the value is defined again (or right after it is written, when nothing reads it),
/// except values in `keep`, which live to the end, and what a stage's prologue wrote or stores
/// (parameters, state) and its microbatches read, which is freed in the stage's update phase. Existing frees are dropped
/// first.
pub fn insert_frees(program: Vec<Instr>, keep: &HashSet<ValueRef>) -> Vec<Instr> {
    let program: Vec<Instr> = program.into_iter().filter(|i| !matches!(i, Instr::Free { .. })).collect();
    // Values are held per pipeline stage: a transfer reads its value on the sending stage and
    // writes it on the receiving one.
    type Held = (usize, ValueRef);
    // For each instruction, the values whose current definition it reads for the last time.
    let mut last_read: HashMap<Held, usize> = HashMap::new();
    let mut frees_after: Vec<Vec<Held>> = vec![vec![]; program.len()];
    let mut defined_at: HashMap<Held, usize> = HashMap::new();
    // What a stage's prologue writes, and its storage, is read by every microbatch: freed in its
    // update phase (after the phase's first instruction on the stage), or kept when it has none
    // (an updated state that only microbatches read, such as fp16's poison, is freed there).
    // Storage is freed in place when the stage has no update phase: its program runs once.
    let mut shared: HashSet<Held> = HashSet::new();
    let mut stored: HashSet<Held> = HashSet::new();
    let mut first_update: HashMap<usize, usize> = HashMap::new();
    for (k, ins) in program.iter().enumerate() {
        match (ins.phase(), ins) {
            (::plan::Phase::Prologue, Instr::Op { outputs, stage, .. }) => {
                shared.extend(outputs.iter().map(|v| (*stage, *v)))
            }
            (::plan::Phase::Prologue, Instr::Collective { output, stage, .. }) => {
                shared.insert((*stage, *output));
            }
            (::plan::Phase::Update, Instr::Op { stage, .. } | Instr::Collective { stage, .. }) => {
                first_update.entry(*stage).or_insert(k);
            }
            _ => {}
        }
        // A parameter or state (storage: not remade by each microbatch) is read by every
        // microbatch too.
        if let Instr::Op { op: ir::Op::Param { .. } | ir::Op::State { .. }, outputs, stage, .. } = ins {
            stored.extend(outputs.iter().map(|v| (*stage, *v)));
        }
    }
    let in_step = |k: usize| !matches!(program[k].phase(), ::plan::Phase::Prologue | ::plan::Phase::Update);
    let close = |v: Held, at: Option<usize>, def: usize, frees_after: &mut Vec<Vec<Held>>| {
        if keep.contains(&v.1) {
            return;
        }
        let at = at.unwrap_or(def);
        if (shared.contains(&v) || stored.contains(&v)) && in_step(at) {
            match first_update.get(&v.0) {
                Some(&u) => frees_after[u.max(at)].push(v),
                None if !shared.contains(&v) => frees_after[at].push(v),
                None => {}
            }
            return;
        }
        frees_after[at].push(v);
    };
    for (k, ins) in program.iter().enumerate() {
        let (reads, writes): (Vec<Held>, Vec<Held>) = match ins {
            Instr::Op { inputs, outputs, stage, .. } => {
                (inputs.iter().map(|v| (*stage, *v)).collect(), outputs.iter().map(|v| (*stage, *v)).collect())
            }
            Instr::Collective { input, output, stage, .. } => (vec![(*stage, *input)], vec![(*stage, *output)]),
            Instr::Transfer { value, from, to, .. } => (vec![(*from, *value)], vec![(*to, *value)]),
            Instr::Free { .. } => (vec![], vec![]),
        };
        for r in reads {
            last_read.insert(r, k);
        }
        for w in writes {
            if let Some(def) = defined_at.insert(w, k) {
                // Redefined: the previous definition ends at its last read before now.
                let at = last_read.remove(&w).filter(|&r| r >= def);
                close(w, at, def, &mut frees_after);
            }
        }
    }
    for (v, def) in defined_at {
        let at = last_read.get(&v).copied().filter(|&r| r >= def);
        close(v, at, def, &mut frees_after);
    }
    let mut out = Vec::with_capacity(program.len() * 2);
    for (ins, mut f) in program.into_iter().zip(frees_after) {
        f.sort();
        f.dedup();
        // One free per stage, stages in order, in the segment the last reader runs in.
        let mut rest = &f[..];
        let segs: Vec<Option<::plan::Segment>> = f.iter().map(|(s, _)| ins.segment_on(*s)).collect();
        out.push(ins);
        let mut at = 0;
        while let Some(&(stage, _)) = rest.first() {
            let n = rest.iter().take_while(|(s, _)| *s == stage).count();
            let seg = segs[at].unwrap_or(::plan::Segment { phase: ::plan::Phase::Forward, chunk: 0 });
            at += n;
            out.push(Instr::Free {
                values: rest[..n].iter().map(|(_, v)| *v).collect(),
                stage,
                phase: seg.phase,
                chunk: seg.chunk,
            });
            rest = &rest[n..];
        }
    }
    out
}

/// An instruction unit: an op and the conversions of its inputs emitted right before it.
struct Unit {
    /// Index range in the program (collectives first, the op last).
    range: std::ops::Range<usize>,
    node: usize,
}

struct Stage {
    /// Units of the stage's nodes, in program order.
    units: Vec<usize>,
    /// The boundary value that ends it (kept).
    boundary: Option<ValueRef>,
    /// Name of its last node.
    name: String,
}

/// The chain of a program (see the module docs).
struct Chain {
    units: Vec<Unit>,
    stages: Vec<Stage>,
    /// Per stage: values it may drop (read by backward), their bytes, and the units needed to
    /// recompute them.
    drops: Vec<(Vec<ValueRef>, u64, Vec<usize>)>,
    /// Per stage: seconds to recompute.
    cost: Vec<f64>,
    /// Per stage: where the first backward unit reading a dropped value starts (its first
    /// conversion, else its op).
    first_use: Vec<usize>,
}

fn id(node: usize, slot: usize) -> ValueRef {
    ValueRef::new(node, slot)
}

/// The forward chain over nodes in program order (see the module docs, step 1).
struct Cut {
    /// The ancestors of the loss (itself included).
    forward: HashSet<usize>,
    /// Chain stages; their `units` index the node list the cut was made over.
    stages: Vec<Stage>,
}

/// Cuts the forward part of `nodes` (graph node indices in program order, each once) into
/// chain stages at its articulation values.
fn cut(g: &Graph, nodes: &[usize]) -> Result<Cut> {
    let node = |i: usize| g.g.node_weight(NodeIndex::new(i));
    let Some(loss) = g.outputs.iter().find(|(n, _)| n == "loss").or(g.outputs.first()).map(|(_, v)| v.node) else {
        return Ok(Cut { forward: HashSet::new(), stages: vec![] });
    };
    // Forward = ancestors of the loss (itself included).
    let mut forward: HashSet<usize> = HashSet::new();
    let mut stack = vec![loss];
    while let Some(n) = stack.pop() {
        if forward.insert(n.index()) {
            stack.extend(g.node_inputs(n).into_iter().map(|v| v.node));
        }
    }
    // Static values: no parameter or state among their ancestors.
    let order = g.topo_order().map_err(|_| Error::Graph("cycle".into()))?;
    let mut param_dep: HashSet<usize> = HashSet::new();
    for &n in &order {
        let nd = g.node(n);
        if matches!(nd.op, Op::Param { .. } | Op::State { .. })
            || g.node_inputs(n).iter().any(|v| param_dep.contains(&v.node.index()))
        {
            param_dep.insert(n.index());
        }
    }
    let is_src =
        |n: usize| node(n).is_some_and(|x| matches!(x.op, Op::Param { .. } | Op::State { .. } | Op::Constant(_)));
    // Forward readers left of every forward, parameter-dependent value.
    let mut fwd_reads: HashMap<ValueRef, usize> = HashMap::new();
    for &n in nodes {
        if !forward.contains(&n) {
            continue;
        }
        for v in g.node_inputs(NodeIndex::new(n)) {
            if param_dep.contains(&v.node.index()) && !is_src(v.node.index()) {
                *fwd_reads.entry(id(v.node.index(), v.slot)).or_default() += 1;
            }
        }
    }
    // Stages: cut where exactly one such value is open.
    let mut stages: Vec<Stage> = vec![];
    let mut open: HashMap<ValueRef, usize> = HashMap::new();
    let mut cur: Vec<usize> = vec![];
    for (ui, &n) in nodes.iter().enumerate() {
        if !forward.contains(&n) || is_src(n) || !param_dep.contains(&n) {
            continue;
        }
        cur.push(ui);
        for v in g.node_inputs(NodeIndex::new(n)) {
            let k = id(v.node.index(), v.slot);
            if let Some(c) = open.get_mut(&k) {
                *c -= 1;
                if *c == 0 {
                    open.remove(&k);
                }
            }
        }
        let nd = g.node(NodeIndex::new(n));
        for s in 0..nd.outputs.len() {
            let k = id(n, s);
            if let Some(&c) = fwd_reads.get(&k) {
                open.insert(k, c);
            }
        }
        if open.len() == 1 {
            let b = open.keys().next().cloned();
            stages.push(Stage { units: std::mem::take(&mut cur), boundary: b, name: nd.name.clone() });
        }
    }
    if let Some(&last) = cur.last() {
        let name = g.node(NodeIndex::new(nodes[last])).name.clone();
        stages.push(Stage { units: cur, boundary: None, name });
    }
    Ok(Cut { forward, stages })
}

/// What recomputing every chain stage changes, by graph node: the values dropped after the
/// forward (read by the backward, not a stage's boundary) and the nodes run again to remake
/// them. `nodes` are graph node indices in program order. What [`crate::problem::Built`]'s
/// full-recomputation model prices before any layout is chosen.
pub(crate) struct FullRecompute {
    /// Values held only until their last forward reader.
    pub dropped: HashSet<ValueRef>,
    /// Nodes whose op (and input conversions) run twice.
    pub rerun: HashSet<usize>,
    /// The forward nodes.
    pub forward: HashSet<usize>,
}

/// [`FullRecompute`] of the program order `nodes`.
pub(crate) fn full_recompute(g: &Graph, nodes: &[usize]) -> Result<FullRecompute> {
    let cut = cut(g, nodes)?;
    let mut dropped = HashSet::new();
    let mut rerun = HashSet::new();
    for st in &cut.stages {
        let members: HashSet<usize> = st.units.iter().map(|&u| nodes[u]).collect();
        let mut stage_dropped = vec![];
        for &n in &members {
            for s in 0..g.node(NodeIndex::new(n)).outputs.len() {
                let v = id(n, s);
                if Some(&v) == st.boundary.as_ref() {
                    continue;
                }
                let read_later = g
                    .users(ir::Value::new(NodeIndex::new(n), s))
                    .into_iter()
                    .any(|(u, _)| !cut.forward.contains(&u.index()));
                if read_later {
                    stage_dropped.push(v);
                }
            }
        }
        let mut stack: Vec<usize> = stage_dropped.iter().map(|v| v.node).collect();
        while let Some(n) = stack.pop() {
            if !members.contains(&n) || !rerun.insert(n) {
                continue;
            }
            stack.extend(g.node_inputs(NodeIndex::new(n)).iter().map(|v| v.node.index()));
        }
        dropped.extend(stage_dropped);
    }
    Ok(FullRecompute { dropped, rerun, forward: cut.forward })
}

fn analyse(g: &Graph, program: &[Instr]) -> Result<Chain> {
    // Units.
    let mut units = vec![];
    let mut start = 0;
    for (k, ins) in program.iter().enumerate() {
        match ins {
            Instr::Op { node, .. } => {
                units.push(Unit { range: start..k + 1, node: *node });
                start = k + 1;
            }
            Instr::Free { .. } => return Err(Error::Internal("checkpointing expects a program without frees".into())),
            Instr::Transfer { .. } => {
                return Err(Error::Internal("checkpointing does not rewrite pipelined programs".into()));
            }
            Instr::Collective { .. } => {}
        }
    }
    let unit_nodes: Vec<usize> = units.iter().map(|u| u.node).collect();
    let Cut { forward, stages } = cut(g, &unit_nodes)?;
    // Backward reads: the start of the first unit outside the forward reading each value.
    let mut first_bwd: HashMap<ValueRef, usize> = HashMap::new();
    for u in &units {
        if forward.contains(&u.node) {
            continue;
        }
        for k in u.range.clone() {
            let reads: Vec<&ValueRef> = match &program[k] {
                Instr::Op { inputs, .. } => inputs.iter().collect(),
                Instr::Collective { input, .. } => vec![input],
                Instr::Free { .. } | Instr::Transfer { .. } => vec![],
            };
            // Recomputation goes before the whole unit, not between its conversions and its
            // op: a unit's conversions stay right before the op they convert for (which
            // `strip`, `crate::microbatch` and `crate::stage` rely on).
            for r in reads {
                first_bwd.entry(*r).or_insert(u.range.start);
            }
        }
    }
    let bytes_of = |v: &ValueRef| -> u64 {
        program
            .iter()
            .find_map(|i| match i {
                Instr::Op { outputs, local_shapes, node, .. } => outputs.iter().position(|o| o == v).map(|s| {
                    let dt = node_dtype(g, *node, s);
                    (local_shapes[s].iter().product::<usize>() * dt) as u64
                }),
                _ => None,
            })
            .unwrap_or(0)
    };
    let unit_of: HashMap<usize, usize> = units.iter().enumerate().map(|(i, u)| (u.node, i)).collect();
    let mut drops = vec![];
    let mut cost = vec![];
    let mut first_use = vec![];
    for st in &stages {
        let members: HashSet<usize> = st.units.iter().map(|&u| units[u].node).collect();
        let mut dropped = vec![];
        let mut bytes = 0;
        let mut first = usize::MAX;
        for &u in &st.units {
            let n = units[u].node;
            for s in 0..g.node(NodeIndex::new(n)).outputs.len() {
                let v = id(n, s);
                if Some(&v) == st.boundary.as_ref() {
                    continue;
                }
                if let Some(&k) = first_bwd.get(&v) {
                    bytes += bytes_of(&v);
                    first = first.min(k);
                    dropped.push(v);
                }
            }
        }
        // Units needed to recompute the dropped values: their ancestors inside the stage.
        let mut need: HashSet<usize> = HashSet::new();
        let mut stack: Vec<usize> = dropped.iter().map(|v: &ValueRef| v.node).collect();
        while let Some(n) = stack.pop() {
            if !members.contains(&n) || !need.insert(n) {
                continue;
            }
            stack.extend(g.node_inputs(NodeIndex::new(n)).iter().map(|v| v.node.index()));
        }
        let mut need_units: Vec<usize> = need.iter().filter_map(|n| unit_of.get(n).copied()).collect();
        need_units.sort();
        let secs: f64 = need_units
            .iter()
            .flat_map(|&u| units[u].range.clone())
            .map(|k| match &program[k] {
                Instr::Op { seconds, .. } | Instr::Collective { seconds, .. } => *seconds,
                Instr::Free { .. } | Instr::Transfer { .. } => 0.0,
            })
            .sum();
        drops.push((dropped, bytes, need_units));
        cost.push(secs);
        first_use.push(first);
    }
    Ok(Chain { units, stages, drops, cost, first_use })
}

fn node_dtype(g: &Graph, node: usize, slot: usize) -> usize {
    g.g.node_weight(NodeIndex::new(node)).and_then(|n| n.outputs.get(slot)).map_or(4, |m| m.dtype.size())
}

/// The program with stages `chosen` recomputed (see the module docs; no frees yet).
fn rewrite(program: &[Instr], chain: &Chain, chosen: &[usize]) -> Vec<Instr> {
    let mut inserts: Vec<(usize, Vec<Instr>)> = vec![];
    for &s in chosen {
        let (dropped, _, need) = &chain.drops[s];
        if dropped.is_empty() || chain.first_use[s] == usize::MAX {
            continue;
        }
        let mut seq = vec![];
        for &u in need {
            for k in chain.units[u].range.clone() {
                let mut ins = program[k].clone();
                if let Instr::Op { recompute, .. } = &mut ins {
                    *recompute = true;
                }
                seq.push(ins);
            }
        }
        inserts.push((chain.first_use[s], seq));
    }
    inserts.sort_by_key(|x| x.0);
    let mut out = Vec::with_capacity(program.len());
    let mut it = inserts.into_iter().peekable();
    for (k, ins) in program.iter().enumerate() {
        while let Some((at, _)) = it.peek() {
            if *at == k {
                out.extend(it.next().map(|x| x.1).unwrap_or_default());
            } else {
                break;
            }
        }
        out.push(ins.clone());
    }
    out
}

/// The cheapest set of stages (by `cost`) whose savings reach `need` bytes: a 0/1 knapsack by
/// dynamic programming over stages, with memory in `BUCKETS` buckets. `None` when even all of
/// them save less.
pub(crate) fn knapsack(save: &[u64], cost: &[f64], need: u64) -> Option<Vec<usize>> {
    const BUCKETS: usize = 1024;
    let total: u64 = save.iter().sum();
    if total < need {
        return None;
    }
    if need == 0 {
        return Some(vec![]);
    }
    let unit = need.div_ceil(BUCKETS as u64).max(1);
    let target = need.div_ceil(unit) as usize;
    // best[m] = (cost, choice) reaching at least m buckets of savings (capped at target).
    let mut best: Vec<Option<(f64, Vec<usize>)>> = vec![None; target + 1];
    best[0] = Some((0.0, vec![]));
    for i in 0..save.len() {
        let w = (save[i] / unit) as usize;
        if save[i] == 0 {
            continue;
        }
        for m in (0..=target).rev() {
            let Some((c, ch)) = best[m].clone() else { continue };
            let to = (m + w).min(target);
            let cand = c + cost[i];
            if best[to].as_ref().is_none_or(|(bc, _)| cand < *bc) {
                let mut ch = ch;
                ch.push(i);
                best[to] = Some((cand, ch));
            }
        }
    }
    best[target].clone().map(|x| x.1).or_else(|| Some((0..save.len()).filter(|&i| save[i] > 0).collect()))
}

/// A lowered program ready to recompute any set of its chain stages: the program without frees
/// or recomputation (as lowered), and its chain.
pub(crate) struct Recomputable {
    program: Vec<Instr>,
    chain: Chain,
}

impl Recomputable {
    /// The chain of `program` (lowered, not pipelined); frees and any recomputation already in
    /// it are dropped first, so a recomputed plan can be recomputed afresh (for pipeline
    /// stages, once their microbatches in flight are known).
    pub(crate) fn new(g: &Graph, program: &[Instr]) -> Result<Recomputable> {
        let program = strip(program);
        let chain = analyse(g, &program)?;
        Ok(Recomputable { program, chain })
    }

    /// Chain stages.
    pub(crate) fn len(&self) -> usize {
        self.chain.stages.len()
    }

    /// Bytes per rank stage `s` frees between its forward and its backward.
    pub(crate) fn saving(&self, s: usize) -> u64 {
        self.chain.drops[s].1
    }

    /// Seconds recomputing stage `s` adds (per microbatch).
    pub(crate) fn cost(&self, s: usize) -> f64 {
        self.chain.cost[s]
    }

    /// A graph node of stage `s` (its last), to find where the stage runs.
    pub(crate) fn node(&self, s: usize) -> Option<usize> {
        self.chain.stages[s].units.last().map(|&u| self.chain.units[u].node)
    }

    /// The program recomputing `chosen` stages, frees placed.
    pub(crate) fn program(&self, chosen: &[usize], keep: &HashSet<ValueRef>) -> Vec<Instr> {
        insert_frees(rewrite(&self.program, &self.chain, chosen), keep)
    }

    /// The report of recomputing `chosen`: their names and seconds, with the peaks given.
    pub(crate) fn report(&self, chosen: &[usize], before: u64, after: u64) -> CheckpointReport {
        CheckpointReport {
            stages: self.len(),
            recomputed: chosen.iter().map(|&s| self.chain.stages[s].name.clone()).collect(),
            extra_seconds: chosen.iter().map(|&s| self.chain.cost[s]).sum(),
            peak_before: before,
            peak_after: after,
            seconds: 0.0,
        }
    }
}

/// `program` without frees and without recomputation: a recomputed op's conversions come
/// right before it ([`rewrite`] copies whole units), so they go with it.
fn strip(program: &[Instr]) -> Vec<Instr> {
    let mut out = Vec::with_capacity(program.len());
    let mut pending: Vec<Instr> = vec![];
    for ins in program {
        match ins {
            Instr::Free { .. } => {}
            Instr::Collective { .. } => pending.push(ins.clone()),
            Instr::Op { recompute: true, .. } => pending.clear(),
            _ => {
                out.append(&mut pending);
                out.push(ins.clone());
            }
        }
    }
    out.append(&mut pending);
    out
}

/// Recomputes the cheapest stages that bring `program`'s peak to `budget` bytes per rank (see
/// the module docs); with `all`, every stage whatever the budget (Megatron's full
/// recomputation). Returns the program with frees placed, and the report; when no choice of
/// stages fits, the program recomputing every stage (the smallest peak this plan can reach) and
/// a report whose `peak_after` exceeds the budget.
pub fn fit(
    g: &Graph,
    mesh: &DeviceMesh,
    program: Vec<Instr>,
    keep: &HashSet<ValueRef>,
    budget: u64,
    all: bool,
) -> Result<(Vec<Instr>, CheckpointReport)> {
    let t0 = std::time::Instant::now();
    let plain = insert_frees(program.clone(), keep);
    let before = simulate(g, mesh, &plain)?.peak;
    let mut report = CheckpointReport { peak_before: before, peak_after: before, ..Default::default() };
    if before <= budget && !all {
        report.seconds = t0.elapsed().as_secs_f64();
        return Ok((plain, report));
    }
    let r = Recomputable::new(g, &program)?;
    report.stages = r.len();
    if all {
        let chosen: Vec<usize> = (0..r.len()).collect();
        let prog = r.program(&chosen, keep);
        let peak = simulate(g, mesh, &prog)?.peak;
        let mut report = r.report(&chosen, before, peak);
        report.seconds = t0.elapsed().as_secs_f64();
        return Ok((prog, report));
    }
    let save: Vec<u64> = (0..r.len()).map(|s| r.saving(s)).collect();
    let cost: Vec<f64> = (0..r.len()).map(|s| r.cost(s)).collect();
    let mut need = before - budget;
    let mut best: Option<(Vec<Instr>, Vec<usize>, u64)> = None;
    for _ in 0..8 {
        let chosen = match knapsack(&save, &cost, need) {
            Some(c) => c,
            None => (0..save.len()).collect(),
        };
        let prog = r.program(&chosen, keep);
        let peak = simulate(g, mesh, &prog)?.peak;
        let every = chosen.len() == save.len();
        if best.as_ref().is_none_or(|b| peak < b.2 || (peak <= budget && b.2 > budget)) {
            best = Some((prog, chosen.clone(), peak));
        }
        if peak <= budget || every {
            break;
        }
        need += peak - budget;
    }
    let Some((prog, chosen, peak)) = best else { return Ok((plain, report)) };
    if peak >= before {
        report.seconds = t0.elapsed().as_secs_f64();
        return Ok((plain, report));
    }
    let mut report = r.report(&chosen, before, peak);
    report.seconds = t0.elapsed().as_secs_f64();
    Ok((prog, report))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn knapsack_picks_the_cheapest_cover() {
        // Savings 5, 4, 3 at costs 10, 3, 3: 7 bytes are cheapest as 4 + 3 (cost 6).
        assert_eq!(knapsack(&[5, 4, 3], &[10.0, 3.0, 3.0], 7), Some(vec![1, 2]));
        assert_eq!(knapsack(&[5, 4, 3], &[1.0, 3.0, 3.0], 5), Some(vec![0]));
        assert_eq!(knapsack(&[5, 4], &[1.0, 1.0], 20), None);
        assert_eq!(knapsack(&[5, 4], &[1.0, 1.0], 0), Some(vec![]));
    }
}
