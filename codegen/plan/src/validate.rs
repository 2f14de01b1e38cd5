//! [`Plan::validate`]: every field of a plan the runtime reads, checked before any rank starts.
//!
//! A plan is the user's input (a file that may be edited, truncated or stale), and every rank
//! trusts it: an axis out of range panics a rank's thread, a repeated axis makes a collective's
//! group list a rank twice so it never completes, a spec that does not match what an op computes
//! gives a wrong result without any error. So the loader checks, in this order:
//!
//! 1. **Whole plan** (fatal: nothing else can be checked without them): the mesh (axis sizes
//!    `>= 1`, their product not overflowing, one name and link per axis), the graph (read with
//!    the plan, so well formed; verifies; its fingerprint is the model hash).
//! 2. **Optimizer hyper-parameters** of the graph's update nodes: finite, and in the ranges
//!    PyTorch's optimizers accept (`lr`, `momentum`, `weight_decay`, `epsilon` `>= 0`, betas in
//!    `[0, 1)`).
//! 3. **The program**, walked in order with the layout of every live value:
//!    - values ([`crate::ValueRef`]: well formed when parsed) are written before they are read,
//!      not written while live, freed only while live;
//!    - an `op` instruction names a graph node with its name, runs the node's op made local for
//!      its layouts (`sharding::strategy::local_op`: the attributes the rank's blocks need), reads exactly the node's
//!      graph inputs (or converted copies of them) in the layouts they have, writes the node's
//!      outputs, its specs fit the tensors on the mesh, its local shapes are the specs' splits
//!      of the global shapes, and its layouts and local computation are one of the op's
//!      strategies (so what each rank computes is what the layouts claim); a recomputation
//!      repeats the node as it first ran;
//!    - a `collective` names distinct mesh axes and tensor dims in range, reads its input in
//!      the layout `from`, turns `from` into exactly `to`, writes a converted copy of the same
//!      value, and its `bytes` are what the collective moves;
//!    - with pipeline stages (`pipeline`: at least two, the size of mesh axis 0), every
//!      instruction runs on a stage in range and never uses the stage axis, values are live per
//!      stage, and a `transfer` sends a value the sending stage holds in its `spec` to a stage
//!      that does not hold it; without stages every instruction is on stage 0 and there are no
//!      transfers;
//!    - at the end, the graph's outputs are live (on every stage), updated values and frozen
//!      parameters are live on their parameter's stage, and every updated value has its
//!      parameter's layout (it is the next step's storage).
//! 4. **Parameter layouts** (`params`): one entry per parameter and optimizer state, naming its
//!    node, shape and dtype, with the layout the program gives it, and the local shape and every
//!    rank's offsets that layout implies (one offset per rank of the mesh), on the stage the
//!    program reads it.
//!
//! Every problem is collected with its location (as Cranelift's verifier does), so one run names
//! all of them; [`Problems`] prints the first few on one line.

use std::collections::{HashMap, HashSet};
use std::fmt;

use ir::{Graph, NodeIndex, Op, TensorMeta};
use sharding::{AxisState, Collective, DeviceMesh, DeviceProfile, ReduceKind, ShardingSpec};

use crate::{Error, Instr, Plan, Result, ValueRef};

/// Where a problem of a plan is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Location {
    /// The plan as a whole (version, mesh, graph, model hash).
    Plan,
    /// A node of the graph, by name (optimizer hyper-parameters).
    Node(String),
    /// Instruction `k` of the program (0-based).
    Instr(usize),
    /// The end of the program (values that must be live then).
    End,
    /// An entry of `params`, by name.
    Param(String),
}

/// One problem [`Plan::validate`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// Where.
    pub at: Location,
    /// What is wrong.
    pub why: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.at {
            Location::Plan => write!(f, "{}", self.why),
            Location::Node(n) => write!(f, "node {n}: {}", self.why),
            Location::Instr(k) => write!(f, "instruction {k}: {}", self.why),
            Location::End => write!(f, "at the end of the program: {}", self.why),
            Location::Param(p) => write!(f, "parameter {p}: {}", self.why),
        }
    }
}

/// Every problem of a plan (never empty in an error), in the order found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problems(pub Vec<Problem>);

/// How many problems [`Problems`] prints; the rest are counted.
const SHOWN: usize = 3;

impl fmt::Display for Problems {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shown: Vec<String> = self.0.iter().take(SHOWN).map(|p| p.to_string()).collect();
        f.write_str(&shown.join("; "))?;
        if self.0.len() > SHOWN {
            write!(f, "; and {} more", self.0.len() - SHOWN)?;
        }
        Ok(())
    }
}

/// The spec `c` turns `from` into, as the runtime executes it ([`sharding::sim::apply`]'s
/// semantics; the transforms of [`sharding::convert`]), or why it cannot run on `from`.
fn spec_after(c: &Collective, from: &ShardingSpec, mesh: &DeviceMesh) -> std::result::Result<ShardingSpec, String> {
    let axes = c.axes();
    mesh.check_axes(axes)?;
    let rank = from.rank();
    let dim_ok = |d: usize| {
        if d < rank { Ok(()) } else { Err(format!("dim {d} does not exist (the tensor has {rank} dims)")) }
    };
    let replicated = || match axes.iter().find(|&&a| from.axis_state(a) != AxisState::Replicate) {
        Some(a) => Err(format!("mesh axis {a} is not replicated in `{from}`")),
        None => Ok(()),
    };
    let partial = || match axes.iter().find(|a| !from.partial().contains(a)) {
        Some(a) => Err(format!("mesh axis {a} does not hold partial sums in `{from}`")),
        None => Ok(from.partial().iter().copied().filter(|a| !axes.contains(a)).collect::<Vec<_>>()),
    };
    // The axes a gather removes must be the innermost ones splitting the dim (a contiguous block).
    let gathered = |d: usize| {
        let split = &from.dims()[d];
        if split.ends_with(axes) {
            Ok(split[..split.len() - axes.len()].to_vec())
        } else {
            Err(format!("mesh axes {axes:?} are not the innermost axes splitting dim {d} of `{from}`"))
        }
    };
    let appended = |d: usize| {
        let mut v = from.dims()[d].clone();
        v.extend_from_slice(axes);
        v
    };
    match c {
        Collective::AllGather { dim, .. } => {
            dim_ok(*dim)?;
            Ok(from.clone().with_dim(*dim, gathered(*dim)?))
        }
        Collective::AllToAll { split_dim, concat_dim, .. } => {
            dim_ok(*split_dim)?;
            dim_ok(*concat_dim)?;
            if split_dim == concat_dim {
                return Err(format!("splits and concatenates the same dim {split_dim}"));
            }
            let head = gathered(*concat_dim)?;
            let to = appended(*split_dim);
            Ok(from.clone().with_dim(*concat_dim, head).with_dim(*split_dim, to))
        }
        Collective::Slice { dim, .. } => {
            dim_ok(*dim)?;
            replicated()?;
            Ok(from.clone().with_dim(*dim, appended(*dim)))
        }
        Collective::MakePartial { .. } => {
            replicated()?;
            let mut p = from.partial().to_vec();
            p.extend_from_slice(axes);
            Ok(from.clone().with_partial(p))
        }
        Collective::AllReduce { op: ReduceKind::Sum, .. } => Ok(from.clone().with_partial(partial()?)),
        Collective::AllReduce { op: ReduceKind::Max, .. } => {
            Err("a max all-reduce does not convert layouts (partial values are sums)".into())
        }
        Collective::ReduceScatter { dim, .. } => {
            dim_ok(*dim)?;
            let rest = partial()?;
            Ok(from.clone().with_partial(rest).with_dim(*dim, appended(*dim)))
        }
        Collective::Broadcast { .. } => {
            replicated()?;
            Ok(from.clone())
        }
    }
}

/// The mesh axes a strategy uses: those of its specs and of its local computation.
fn used_axes<'a>(specs: impl Iterator<Item = &'a ShardingSpec>, local: &sharding::Local) -> Vec<usize> {
    let mut v: Vec<usize> = specs.flat_map(|s| s.used_axes()).collect();
    match local {
        sharding::Local::Same => {}
        sharding::Local::MaskedGather { axes }
        | sharding::Local::SplitSoftmax { axes }
        | sharding::Local::MaskedScatter { axes }
        | sharding::Local::QueryBlocks { axes } => v.extend_from_slice(axes),
    }
    v.sort_unstable();
    v.dedup();
    v
}

/// The most microbatches a plan may ask for.
const MAX_MICROBATCHES: usize = 1 << 20;

/// Strategy enumerations larger than this are not attempted (the planner could not have made
/// such a plan either: it enumerates the same assignments).
const MAX_ASSIGNMENTS: f64 = (1u64 << 20) as f64;

/// Checks that an op instruction's layouts and local computation are a strategy of its node:
/// the strategies of the node on the mesh with every axis the instruction does not use made
/// of size 1, so only assignments of the used axes are enumerated.
/// The layouts and local computation of each strategy of one op on one sub-mesh.
type Layouts = Vec<(Vec<ShardingSpec>, Vec<ShardingSpec>, sharding::Local)>;

/// Strategies enumerated so far, by op, tensor metas and sub-mesh: a repeated layer's ops are
/// enumerated once (the enumeration is most of a plan's validation time).
type Known = HashMap<String, std::rc::Rc<Layouts>>;

#[allow(clippy::too_many_arguments)]
fn is_strategy(
    g: &Graph,
    n: NodeIndex,
    mesh: &DeviceMesh,
    profile: &DeviceProfile,
    ins: &[ShardingSpec],
    outs: &[ShardingSpec],
    local: &sharding::Local,
    known: &mut Known,
) -> std::result::Result<(), String> {
    let used = used_axes(ins.iter().chain(outs), local);
    mesh.check_axes(&used)?;
    let node = g.node(n);
    let in_metas: Vec<ir::TensorMeta> = g.node_inputs(n).iter().map(|v| g.meta(*v).clone()).collect();
    let rule = sharding::strategy::rule(&node.op, &in_metas, &node.outputs)
        .ok_or_else(|| format!("{} has no sharding rule", node.op.name()))?;
    let choices = (1 + rule.dims.len() + rule.linear.len()) as f64;
    if choices.powi(used.len() as i32) > MAX_ASSIGNMENTS {
        return Err(format!("uses {} mesh axes, too many to check its strategy", used.len()));
    }
    let shape: Vec<usize> = (0..mesh.ndim()).map(|a| if used.contains(&a) { mesh.shape()[a] } else { 1 }).collect();
    // What the enumeration reads ([`sharding::strategies`]): the op, the metas, which inputs
    // are parameters, and the mesh.
    let params: Vec<bool> = g.node_inputs(n).iter().map(|v| matches!(g.node(v.node).op, Op::Param { .. })).collect();
    let key = format!("{:?}|{in_metas:?}|{:?}|{params:?}|{shape:?}", node.op, node.outputs);
    let all = match known.get(&key) {
        Some(all) => all.clone(),
        None => {
            let sub =
                DeviceMesh::new(shape, mesh.names().to_vec(), mesh.links().to_vec()).map_err(|e| e.to_string())?;
            let all = sharding::strategies(g, n, &sub, profile).map_err(|e| e.to_string())?;
            let all: std::rc::Rc<Layouts> =
                std::rc::Rc::new(all.into_iter().map(|s| (s.inputs, s.outputs, s.local)).collect());
            known.insert(key, all.clone());
            all
        }
    };
    if all.iter().any(|(i, o, l)| i == ins && o == outs && l == local) {
        return Ok(());
    }
    let text = |v: &[ShardingSpec]| v.iter().map(|s| format!("`{s}`")).collect::<Vec<_>>().join(", ");
    Err(format!(
        "inputs {} to outputs {} ({local:?}) is not a way to run {} (not one of its {} strategies on these axes)",
        text(ins),
        text(outs),
        node.op.name(),
        all.len()
    ))
}

/// Checks an optimizer node's hyper-parameters (see the module docs).
fn check_hyper(op: &Op) -> std::result::Result<(), String> {
    let (lr, rest): (f32, Vec<(&str, f32, bool)>) = match op {
        // (name, value, is a beta in [0, 1))
        Op::SgdUpdate { lr, momentum, weight_decay } => {
            (*lr, vec![("momentum", *momentum, false), ("weight_decay", *weight_decay, false)])
        }
        Op::AdamWUpdate { lr, beta1, beta2, epsilon, weight_decay } => (
            *lr,
            vec![
                ("beta1", *beta1, true),
                ("beta2", *beta2, true),
                ("epsilon", *epsilon, false),
                ("weight_decay", *weight_decay, false),
            ],
        ),
        _ => return Ok(()),
    };
    for (name, v, beta) in std::iter::once(("lr", lr, false)).chain(rest) {
        if !v.is_finite() {
            return Err(format!("{} {name} is {v}: it must be a finite number", op.name()));
        }
        if v < 0.0 || (beta && v >= 1.0) {
            let range = if beta { "in [0, 1)" } else { ">= 0" };
            return Err(format!("{} {name} is {v}: it must be {range}", op.name()));
        }
    }
    Ok(())
}

/// A plan that [`Plan::validate`] accepted, with the graph and mesh validation parsed: what the
/// runtime compiles without checking or parsing again. Read-only (it derefs to the [`Plan`]), so
/// it stays what was checked.
#[derive(Clone, Debug)]
pub struct Valid {
    plan: Plan,
    mesh: DeviceMesh,
}

impl Valid {
    /// Reads and validates a plan ([`Plan::from_json`]), keeping the parsed graph and mesh.
    pub fn from_json(text: &str) -> Result<Valid> {
        Plan::parse(text)?.into_valid()
    }

    /// The plan.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The plan's training graph (node `%i` is index `i`).
    pub fn graph(&self) -> &Graph {
        &self.plan.graph
    }

    /// The plan's mesh.
    pub fn mesh(&self) -> &DeviceMesh {
        &self.mesh
    }

    /// The plan, to edit (it is no longer known to be valid).
    pub fn into_plan(self) -> Plan {
        self.plan
    }
}

impl std::ops::Deref for Valid {
    type Target = Plan;
    fn deref(&self) -> &Plan {
        &self.plan
    }
}

/// What the walk knows about one graph node's first execution.
struct Ran<'a> {
    stage: usize,
    ins: &'a [ShardingSpec],
    outs: &'a [ShardingSpec],
    local: &'a sharding::Local,
}

impl Plan {
    /// Checks every field the runtime reads (see [`crate::validate`]); the error lists every
    /// problem found.
    pub fn validate(&self) -> Result<()> {
        let problems = self.problems();
        if problems.is_empty() { Ok(()) } else { Err(Error::Invalid(Problems(problems))) }
    }

    /// Every problem of the plan, in the order found (empty for a valid plan).
    pub fn problems(&self) -> Vec<Problem> {
        self.check().0
    }

    /// Validates the plan, returning the mesh validation built (what [`Valid`] keeps, for a
    /// borrowed plan).
    pub fn validated_mesh(&self) -> Result<DeviceMesh> {
        match self.check() {
            (problems, Some(parts)) if problems.is_empty() => Ok(parts),
            (problems, _) => Err(Error::Invalid(Problems(problems))),
        }
    }

    /// Validates the plan and keeps what validation parsed (see [`Valid`]).
    pub fn into_valid(self) -> Result<Valid> {
        match self.check() {
            (problems, Some(mesh)) if problems.is_empty() => Ok(Valid { plan: self, mesh }),
            (problems, _) => Err(Error::Invalid(Problems(problems))),
        }
    }

    /// Every problem, and the mesh when the whole-plan checks pass.
    fn check(&self) -> (Vec<Problem>, Option<DeviceMesh>) {
        let mut out = vec![];
        let plan = |why: String| (vec![Problem { at: Location::Plan, why }], None);
        let mesh = match self.device_mesh() {
            Ok(m) => m,
            Err(e) => return plan(e.to_string()),
        };
        let g = &self.graph;
        if let Err(e) = ir::verify(g) {
            return plan(format!("graph: {e}"));
        }
        if g.fingerprint() != self.model.hash {
            return plan("the graph does not match the model hash (edited?)".into());
        }
        for (a, l) in self.mesh.links.iter().enumerate() {
            if let Err(why) = l.validate() {
                out.push(Problem { at: Location::Plan, why: format!("mesh axis {a}'s link: {why}") });
            }
        }
        for n in g.g.node_indices() {
            let node = g.node(n);
            if let Err(why) = check_hyper(&node.op) {
                out.push(Problem { at: Location::Node(node.name.clone()), why });
            }
        }
        let why = if self.microbatches == 0 || self.microbatches > MAX_MICROBATCHES {
            Some(format!("{} microbatches (1 to {MAX_MICROBATCHES})", self.microbatches))
        } else if self.microbatches == 1 && !self.accumulate.is_empty() {
            Some("values to accumulate over one microbatch".into())
        } else {
            None
        };
        if let Some(why) = why {
            return (vec![Problem { at: Location::Plan, why }], None);
        }
        if let Some(p) = &self.pipeline {
            let why = if p.stages < 2 {
                Some(format!("{} pipeline stages (a pipeline has at least 2)", p.stages))
            } else if self.mesh.shape.first() != Some(&p.stages) {
                Some(format!(
                    "{} pipeline stages on mesh {mesh}: the stages are the coordinates of mesh axis 0",
                    p.stages
                ))
            } else if p.microbatches != self.microbatches {
                Some(format!("the pipeline has {} microbatches, the plan {}", p.microbatches, self.microbatches))
            } else if p.per_stage.len() != p.stages {
                Some(format!("{} stage estimates for {} stages", p.per_stage.len(), p.stages))
            } else if p.schedule.chunks == 0 || p.schedule.chunks > crate::schedule::MAX_CHUNKS {
                Some(format!("{} model chunks per stage (1 to {})", p.schedule.chunks, crate::schedule::MAX_CHUNKS))
            } else if p.schedule.steps.len() != p.stages {
                Some(format!("the schedule has steps for {} stages, the plan {}", p.schedule.steps.len(), p.stages))
            } else {
                None
            };
            if let Some(why) = why {
                return (vec![Problem { at: Location::Plan, why }], None);
            }
        }
        let ran = self.walk(g, &mesh, &mut out);
        self.check_params(g, &mesh, &ran, &mut out);
        drop(ran);
        self.check_phases(g, &mut out);
        if out.is_empty() && self.pipeline.is_some() {
            let steps = crate::schedule::check_steps(self);
            let bad = !steps.is_empty();
            out.extend(steps.into_iter().map(|why| Problem { at: Location::Plan, why }));
            if !bad && let Err(why) = crate::schedule::timeline(self) {
                out.push(Problem { at: Location::Plan, why });
            }
        }
        (out, Some(mesh))
    }

    /// Step 3 of the module docs; returns how each node first ran.
    fn walk<'a>(&'a self, g: &Graph, mesh: &DeviceMesh, out: &mut Vec<Problem>) -> HashMap<NodeIndex, Ran<'a>> {
        // Strategies only need a profile for their costs, which are not compared.
        let profile = DeviceProfile::builtin("cpu");
        let mut known = Known::new();
        // The layout of every live value, by stage.
        let mut live: HashMap<(usize, ValueRef), &ShardingSpec> = HashMap::new();
        let mut ran: HashMap<NodeIndex, Ran> = HashMap::new();
        let stages = self.stages();
        // A stage index in range, and (with stages) no use of the stage axis.
        let staged = |stage: usize, axes: &[usize]| -> Option<String> {
            if stage >= stages {
                Some(if stages == 1 {
                    format!("runs on stage {stage}, but the plan has no pipeline stages")
                } else {
                    format!("runs on stage {stage}, but the plan has {stages} stages")
                })
            } else if stages > 1 && axes.contains(&0) {
                Some("uses mesh axis 0, the pipeline's stage axis (layouts never split over it)".into())
            } else {
                None
            }
        };
        // The accumulated values are live where the microbatches end.
        let update_from =
            self.program.iter().position(|i| i.phase() == crate::Phase::Update).unwrap_or(self.program.len());
        let check_accumulated = |live: &HashMap<(usize, ValueRef), &ShardingSpec>, out: &mut Vec<Problem>| {
            for v in &self.accumulate {
                if !(0..stages).any(|s| live.contains_key(&(s, *v))) {
                    out.push(Problem {
                        at: Location::Instr(update_from),
                        why: format!("accumulates {v}, which is not live where the microbatches end"),
                    });
                }
            }
        };
        for (k, ins) in self.program.iter().enumerate() {
            if k == update_from && self.microbatches > 1 {
                check_accumulated(&live, out);
            }
            let mut bad = |why: String| out.push(Problem { at: Location::Instr(k), why });
            match ins {
                Instr::Op {
                    node,
                    name,
                    op,
                    inputs,
                    input_specs,
                    outputs,
                    output_specs,
                    local_shapes,
                    local,
                    stage,
                    ..
                } => {
                    let stage = *stage;
                    if let Some(why) = staged(stage, &used_axes(input_specs.iter().chain(output_specs), local)) {
                        bad(why);
                        continue;
                    }
                    let idx = NodeIndex::new(*node);
                    let Some(n) = g.g.node_weight(idx) else {
                        bad(format!("no node %{node} in the graph"));
                        continue;
                    };
                    if name != &n.name || op.name() != n.op.name() {
                        bad(format!("node %{node} is {} ({}), not {name} ({})", n.name, n.op.name(), op.name()));
                    }
                    let graph_ins = g.node_inputs(idx);
                    if inputs.len() != graph_ins.len() || input_specs.len() != graph_ins.len() {
                        bad(format!(
                            "{} reads {} values with {} specs; the node has {} inputs",
                            n.name,
                            inputs.len(),
                            input_specs.len(),
                            graph_ins.len()
                        ));
                        continue;
                    }
                    if outputs.len() != n.outputs.len()
                        || output_specs.len() != n.outputs.len()
                        || local_shapes.len() != n.outputs.len()
                    {
                        bad(format!(
                            "{} writes {} values with {} specs and {} local shapes; the node has {} outputs",
                            n.name,
                            outputs.len(),
                            output_specs.len(),
                            local_shapes.len(),
                            n.outputs.len()
                        ));
                        continue;
                    }
                    let mut fits = true;
                    for (j, ((id, spec), v)) in inputs.iter().zip(input_specs).zip(&graph_ins).enumerate() {
                        let meta = g.meta(*v);
                        if let Err(e) = spec.check(&meta.shape, mesh) {
                            bad(format!("input {j} ({id}): {e}"));
                            fits = false;
                        }
                        if id.value() != *v {
                            bad(format!(
                                "input {j} is {id}, but the graph's input {j} of {} is {}",
                                n.name,
                                ValueRef::of(*v)
                            ));
                        } else {
                            match live.get(&(stage, *id)) {
                                None => bad(if stages > 1 {
                                    format!("reads {id} before it is written or after it is freed (on stage {stage})")
                                } else {
                                    format!("reads {id} before it is written or after it is freed")
                                }),
                                Some(&have) if have != spec => bad(format!(
                                    "reads {id} as `{spec}`, but it is laid out as `{have}` (a conversion is missing)"
                                )),
                                Some(_) => {}
                            }
                        }
                    }
                    for (s, ((id, spec), (meta, local_shape))) in
                        outputs.iter().zip(output_specs).zip(n.outputs.iter().zip(local_shapes)).enumerate()
                    {
                        let want = ValueRef::new(*node, s);
                        if *id != want {
                            bad(format!("output {s} of %{node} is written as `{id}`, not {want}"));
                        }
                        match spec.check(&meta.shape, mesh) {
                            Err(e) => {
                                bad(format!("output {s} ({id}): {e}"));
                                fits = false;
                            }
                            Ok(()) => {
                                let split = spec.local_shape(&meta.shape, mesh);
                                if &split != local_shape {
                                    bad(format!(
                                        "output {s} ({id}): local shape {local_shape:?}, but `{spec}` splits {:?} into {split:?}",
                                        meta.shape
                                    ));
                                }
                            }
                        }
                    }
                    if fits && op.name() == n.op.name() {
                        // The op each rank runs is the node's op made local for these layouts
                        // (NaN attributes compare by their text).
                        let local_ins: Vec<TensorMeta> = input_specs
                            .iter()
                            .zip(&graph_ins)
                            .map(|(spec, v)| {
                                let m = g.meta(*v);
                                TensorMeta::new(m.dtype, spec.local_shape(&m.shape, mesh))
                            })
                            .collect();
                        let want = sharding::strategy::local_op(&n.op, &local_ins, local_shapes);
                        let same = match (&want, op) {
                            (Op::Constant(_), Op::Constant(_)) => true,
                            (w, o) => w == o || format!("{w:?}") == format!("{o:?}"),
                        };
                        if !same {
                            let show = |o: &Op| serde_json::to_string(o).unwrap_or_else(|e| e.to_string());
                            bad(format!(
                                "runs `{}` on its blocks, but {} with these layouts runs `{}`",
                                show(op),
                                n.name,
                                show(&want)
                            ));
                        }
                    }
                    match ran.get(&idx) {
                        Some(_) if matches!(n.op, Op::Param { .. } | Op::State { .. }) => {
                            bad(format!("reads the storage of {} a second time", n.name));
                        }
                        Some(first) => {
                            if first.ins != input_specs.as_slice()
                                || first.outs != output_specs.as_slice()
                                || first.local != local
                            {
                                bad(format!("recomputes {} with other layouts than it first ran with", n.name));
                            }
                        }
                        None => {
                            if fits
                                && let Some(p) = &profile
                                && let Err(why) =
                                    is_strategy(g, idx, mesh, p, input_specs, output_specs, local, &mut known)
                            {
                                bad(format!("{}: {why}", n.name));
                            }
                            ran.insert(idx, Ran { stage, ins: input_specs, outs: output_specs, local });
                        }
                    }
                    for (id, spec) in outputs.iter().zip(output_specs) {
                        if live.insert((stage, *id), spec).is_some() {
                            bad(format!("writes {id} while it is live (free it first)"));
                        }
                    }
                }
                Instr::Collective { input, output, collective, from, to, bytes, stage, .. } => {
                    let stage = *stage;
                    if let Some(why) = staged(stage, collective.axes()) {
                        bad(why);
                        continue;
                    }
                    if output.base() != input.base() || output.copy.is_none() {
                        bad(format!("writes `{output}`, which is not a converted copy of {}", input.base()));
                    }
                    let Some(meta) =
                        g.g.node_weight(NodeIndex::new(input.node)).and_then(|n| n.outputs.get(input.slot))
                    else {
                        bad(format!("converts {input}, which the graph does not have"));
                        continue;
                    };
                    match live.get(&(stage, *input)) {
                        None => bad(format!("converts {input} before it is written or after it is freed")),
                        Some(&have) if have != from => {
                            bad(format!("converts {input} from `{from}`, but it is laid out as `{have}`"))
                        }
                        Some(_) => {}
                    }
                    let checked = from.check(&meta.shape, mesh).and_then(|_| to.check(&meta.shape, mesh));
                    match checked {
                        Err(e) => bad(format!("{collective} of {input}: {e}")),
                        Ok(()) => match spec_after(collective, from, mesh) {
                            Err(why) => bad(format!("{collective} of {input} (`{from}`): {why}")),
                            Ok(after) if &after != to => {
                                bad(format!("{collective} turns `{from}` into `{after}`, not `{to}`"))
                            }
                            Ok(_) => {
                                let want =
                                    collective.bytes(from.local_bytes(&meta.shape, mesh, meta.dtype.size()), mesh);
                                if *bytes != want {
                                    bad(format!("{collective} of {input}: {bytes} bytes, but it moves {want}"));
                                }
                            }
                        },
                    }
                    if live.insert((stage, *output), to).is_some() {
                        bad(format!("writes {output} while it is live (free it first)"));
                    }
                }
                Instr::Free { values, stage, .. } => {
                    if let Some(why) = staged(*stage, &[]) {
                        bad(why);
                        continue;
                    }
                    for v in values {
                        if live.remove(&(*stage, *v)).is_none() {
                            bad(format!("frees {v}, which is not live"));
                        }
                    }
                }
                Instr::Transfer { value, spec, from, to, bytes, .. } => {
                    if stages == 1 {
                        bad("a transfer between stages in a plan without pipeline stages".into());
                        continue;
                    }
                    if let Some(why) = staged(*from, &spec.used_axes()).or_else(|| staged(*to, &[])) {
                        bad(why);
                        continue;
                    }
                    if from == to {
                        bad(format!("transfers {value} from stage {from} to itself"));
                        continue;
                    }
                    let Some(meta) =
                        g.g.node_weight(NodeIndex::new(value.node)).and_then(|n| n.outputs.get(value.slot))
                    else {
                        bad(format!("transfers {value}, which the graph does not have"));
                        continue;
                    };
                    match live.get(&(*from, *value)) {
                        None => bad(format!("sends {value}, which stage {from} does not hold")),
                        Some(&have) if have != spec => {
                            bad(format!("sends {value} as `{spec}`, but stage {from} holds it as `{have}`"))
                        }
                        Some(_) => {}
                    }
                    match spec.check(&meta.shape, mesh) {
                        Err(e) => bad(format!("transfer of {value}: {e}")),
                        Ok(()) => {
                            let want = spec.local_bytes(&meta.shape, mesh, meta.dtype.size());
                            if *bytes != want {
                                bad(format!("transfer of {value}: {bytes} bytes, but its blocks are {want}"));
                            }
                        }
                    }
                    if live.insert((*to, *value), spec).is_some() {
                        bad(format!("stage {to} receives {value} while it holds it (free it first)"));
                    }
                }
            }
        }
        if update_from == self.program.len() && self.microbatches > 1 {
            check_accumulated(&live, out);
        }
        // What the step hands back: the outputs, and the next step's storage.
        let updated: HashSet<NodeIndex> = g.updates.iter().map(|(p, _)| *p).collect();
        let mut end = |why: String| out.push(Problem { at: Location::End, why });
        for (name, v) in &g.outputs {
            // Every stage returns the outputs.
            if let Some(s) = (0..stages).find(|&s| !live.contains_key(&(s, ValueRef::of(*v)))) {
                let on = if stages > 1 { format!(" on stage {s}") } else { String::new() };
                end(format!("output {name} ({}) is not live{on}", ValueRef::of(*v)));
            }
        }
        for (p, v) in &g.updates {
            let id = ValueRef::of(*v);
            let pname = &g.node(*p).name;
            match (live.get(&(ran.get(p).map_or(0, |r| r.stage), id)), ran.get(p)) {
                (None, _) => end(format!("the update of {pname} ({id}) is not live")),
                (Some(_), None) => end(format!("{pname} is updated but never read")),
                (Some(&s), Some(r)) if Some(s) != r.outs.first() => end(format!(
                    "the update of {pname} ({id}) is laid out as `{s}`, but {pname} as `{}` (the next step reads it so)",
                    r.outs.first().map_or(String::new(), |x| x.to_string())
                )),
                _ => {}
            }
        }
        for &p in g.params.iter().chain(&g.states).filter(|p| !updated.contains(p)) {
            let id = ValueRef::new(p.index(), 0);
            if let Some(r) = ran.get(&p)
                && !live.contains_key(&(r.stage, id))
            {
                end(format!("the frozen parameter {} ({id}) is freed: the next step needs it", g.node(p).name));
            }
        }
        ran
    }

    /// Step 4 of the module docs.
    /// Phases and chunks: the update phase last, each stage's instructions in segment order
    /// (the order a microbatch runs them; [`crate::Segment::rank`]), chunks in range, the
    /// prologue reading only what it wrote, and no parameter or optimizer state (or value the
    /// prologue wrote) freed before the update phase when later microbatches read it again.
    fn check_phases(&self, g: &Graph, out: &mut Vec<Problem>) {
        let chunks = self.chunks();
        let stages = self.stages();
        let mut seen_update = false;
        let mut last: Vec<Option<crate::Segment>> = vec![None; stages];
        let mut prologue: std::collections::HashSet<(usize, ValueRef)> = std::collections::HashSet::new();
        for (k, ins) in self.program.iter().enumerate() {
            let mut bad = |why: String| out.push(Problem { at: Location::Instr(k), why });
            let update = ins.phase() == crate::Phase::Update;
            if seen_update && !update {
                bad(format!("runs in the {:?} phase after the update phase began", ins.phase()).to_lowercase());
                continue;
            }
            seen_update |= update;
            for (s, last) in last.iter_mut().enumerate() {
                let Some(seg) = ins.segment_on(s) else { continue };
                if seg.chunk >= chunks {
                    bad(format!("runs in model chunk {} of stage {s}, which has {chunks}", seg.chunk));
                    continue;
                }
                if let Some(prev) = *last
                    && prev.rank(chunks) > seg.rank(chunks)
                {
                    bad(format!(
                        "runs in {:?} of chunk {} on stage {s} after its {:?} of chunk {} (a stage's instructions are in \
                         the order a microbatch runs them)",
                        seg.phase, seg.chunk, prev.phase, prev.chunk
                    ));
                }
                *last = Some(seg);
            }
            // The prologue reads only what its stage's prologue wrote; what it writes is read
            // by every microbatch, so no microbatch frees it.
            let (reads, writes, stage) = match ins {
                Instr::Op { inputs, outputs, stage, .. } => (inputs.clone(), outputs.clone(), *stage),
                Instr::Collective { input, output, stage, .. } => (vec![*input], vec![*output], *stage),
                Instr::Free { values, stage, .. } => (values.clone(), vec![], *stage),
                Instr::Transfer { value, to, .. } => (vec![], vec![*value], *to),
            };
            match ins.phase() {
                crate::Phase::Prologue if matches!(ins, Instr::Transfer { .. }) => {
                    bad("is a transfer in the prologue, which only computes and converts".into())
                }
                crate::Phase::Prologue if matches!(ins, Instr::Free { .. }) => {}
                crate::Phase::Prologue => {
                    for v in reads.iter().filter(|v| !prologue.contains(&(stage, **v))) {
                        bad(format!("reads {v} in the prologue, before any microbatch could write it"));
                    }
                    prologue.extend(writes.iter().map(|v| (stage, *v)));
                }
                crate::Phase::Update => {}
                _ => {
                    if let Instr::Free { .. } = ins {
                        for v in reads.iter().filter(|v| prologue.contains(&(stage, **v))) {
                            bad(format!(
                                "frees {v}, which the prologue wrote, before the update phase: later microbatches read it"
                            ));
                        }
                    }
                }
            }
            if self.microbatches > 1
                && let Instr::Free { values, stage, .. } = ins
                && !update
            {
                // On the stage that stores it (another stage frees the copy it received).
                let home = |v: &ValueRef| self.params.iter().find(|p| p.node == v.node).map_or(0, |p| p.stage);
                for v in values.iter().filter(|v| v.copy.is_none() && home(v) == *stage) {
                    if let Some(n) = g.g.node_weight(NodeIndex::new(v.node))
                        && matches!(n.op, Op::Param { .. } | Op::State { .. })
                    {
                        bad(format!(
                            "frees {} ({v}) before the update phase: the next microbatch reads it again",
                            n.name
                        ));
                    }
                }
            }
        }
    }

    fn check_params(&self, g: &Graph, mesh: &DeviceMesh, ran: &HashMap<NodeIndex, Ran>, out: &mut Vec<Problem>) {
        let mut seen: HashSet<usize> = HashSet::new();
        for p in &self.params {
            let mut bad = |why: String| out.push(Problem { at: Location::Param(p.name.clone()), why });
            let idx = NodeIndex::new(p.node);
            let n = g.g.node_weight(idx);
            let storage = n.and_then(|n| match &n.op {
                Op::Param { name } | Op::State { name } => Some(name),
                _ => None,
            });
            let Some(n) = n.filter(|_| storage == Some(&p.name)) else {
                bad(format!("node %{} is not the parameter or state {}", p.node, p.name));
                continue;
            };
            if !seen.insert(p.node) {
                bad("listed twice".into());
            }
            let Some(meta) = n.outputs.first() else { continue };
            if p.shape != meta.shape || p.dtype != meta.dtype.name() {
                bad(format!("{:?} {} in params, {meta} in the graph", p.shape, p.dtype));
                continue;
            }
            if let Err(e) = p.spec.check(&p.shape, mesh) {
                bad(e.to_string());
                continue;
            }
            if let Some(r) = ran.get(&idx)
                && r.stage != p.stage
            {
                bad(format!("on stage {}, but the program reads it on stage {}", p.stage, r.stage));
            }
            match ran.get(&idx).and_then(|r| r.outs.first()) {
                Some(s) if s == &p.spec => {}
                Some(s) => bad(format!("laid out as `{}`, but the program holds it as `{s}`", p.spec)),
                None => bad("the program never reads it".into()),
            }
            let local = p.spec.local_shape(&p.shape, mesh);
            if p.local_shape != local {
                bad(format!("local shape {:?}, but `{}` splits {:?} into {local:?}", p.local_shape, p.spec, p.shape));
            }
            // Every rank's, or (on a mesh too large to list them) none.
            let unlisted = p.offsets.is_empty() && mesh.size() > crate::MAX_LISTED_RANKS;
            if unlisted {
            } else if p.offsets.len() != mesh.size() {
                bad(format!("{} offsets for the {} ranks of mesh {mesh}", p.offsets.len(), mesh.size()));
            } else if let Some(r) = (0..mesh.size()).find(|&r| p.offsets[r] != p.spec.offsets(&p.shape, mesh, r)) {
                bad(format!(
                    "rank {r}'s offsets are {:?}, but `{}` puts its block at {:?}",
                    p.offsets[r],
                    p.spec,
                    p.spec.offsets(&p.shape, mesh, r)
                ));
            }
        }
        for &n in g.params.iter().chain(&g.states) {
            if !seen.contains(&n.index())
                && let Op::Param { name } | Op::State { name } = &g.node(n).op
            {
                out.push(Problem { at: Location::Param(name.clone()), why: "missing from params".into() });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every one-step transform the layout converter emits (and so every collective a planner's
    /// program holds) turns its spec into the converter's `after`, as [`spec_after`] computes it.
    #[test]
    fn spec_after_agrees_with_the_converter() {
        for shape in [vec![2usize, 2], vec![2, 2, 2]] {
            let mesh = DeviceMesh::uniform(&shape).unwrap();
            let tensor = [8usize, 8, 4];
            let target: ShardingSpec = if shape.len() == 2 { "R R R | P01" } else { "R R R | P012" }.parse().unwrap();
            let mut seen: HashSet<ShardingSpec> = HashSet::new();
            let mut todo = vec![ShardingSpec::replicated(3), target.clone()];
            let mut steps = 0;
            while let Some(spec) = todo.pop() {
                if !seen.insert(spec.clone()) {
                    continue;
                }
                for st in sharding::convert::neighbours(&spec, &target, &tensor, 4, &mesh) {
                    assert_eq!(
                        spec_after(&st.collective, &spec, &mesh).as_ref(),
                        Ok(&st.after),
                        "{} on `{spec}`",
                        st.collective
                    );
                    steps += 1;
                    todo.push(st.after);
                }
            }
            assert!(steps > 100, "only {steps} transforms on {shape:?}");
        }
        // What the converter never emits is refused.
        let mesh = DeviceMesh::uniform(&[2, 2]).unwrap();
        let s: ShardingSpec = "S01 R".parse().unwrap();
        let gather = |axes: Vec<usize>, dim| Collective::AllGather { axes, dim };
        assert!(spec_after(&gather(vec![0], 0), &s, &mesh).unwrap_err().contains("innermost"));
        assert!(spec_after(&gather(vec![1, 1], 0), &s, &mesh).unwrap_err().contains("twice"));
        assert!(spec_after(&gather(vec![2], 0), &s, &mesh).unwrap_err().contains("does not exist"));
        assert!(spec_after(&gather(vec![1], 2), &s, &mesh).unwrap_err().contains("dim 2"));
        let max = Collective::AllReduce { axes: vec![0], op: ReduceKind::Max };
        assert!(spec_after(&max, &"R R | P0".parse().unwrap(), &mesh).is_err());
        let slice = Collective::Slice { axes: vec![0], dim: 1 };
        assert!(spec_after(&slice, &s, &mesh).unwrap_err().contains("not replicated"));
    }
}
