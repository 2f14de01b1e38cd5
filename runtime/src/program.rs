//! Executing a distributed plan: one SPMD [`Program`] run by every rank on its own blocks.
//!
//! [`Program::new`] compiles a validated [`Plan`] once: value ids become slots, every `op`
//! instruction gets the op with its shape attributes made local (or one of the special local
//! computations of [`sharding::Local`]), every value its local byte size. A rank's state
//! ([`RankState`]) holds only its own blocks: parameters and optimizer state (read by
//! [`Program::init_rank`] from a [`crate::params::ParamSource`] block by block), constants, and its block of
//! every fed input. [`Program::step`] then runs the program on that state through a
//! [`Communicator`]: kernels, collectives and frees in the plan's order, the updated parameters
//! becoming the storage of the next step. The walk itself is the runtime's one executor
//! ([`crate::exec`]), shared with the GPU ranks of `gpu`: each back end only says how its
//! tensors are computed, communicated and measured.
//!
//! Invariants:
//! - Every rank runs the same instructions in the same order, so their collectives meet.
//! - Memory is accounted as [`plan::memory::simulate`] estimates it: resident blocks from the
//!   start, outputs added when written, values subtracted when freed; the measured peak is the
//!   bytes of tensors this rank actually held.
//! - A step that fails leaves the rank's storage unusable (its parameters moved into the step):
//!   the run stops, and only checkpoints written between steps are ever read back.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use ir::{DType, NodeIndex, Op, Tensor, TensorMeta};
use plan::{Plan, ValueRef};
use sharding::{Collective, DeviceMesh, ShardingSpec, sim};

use crate::comm::CommError;
pub use crate::error::DistError;
use crate::params::ParamSource;
pub use kernels::random::{StepKey, Stream};

/// `t` cut into `m` equal pieces along its first dim (`t` itself when `m` is 1).
fn microbatch_pieces(t: &Tensor, m: usize) -> Vec<Tensor> {
    if m <= 1 {
        return vec![t.clone()];
    }
    let rows = t.shape().first().copied().unwrap_or(0) / m;
    (0..m)
        .map(|k| {
            let mut offsets = vec![0; t.shape().len()];
            offsets[0] = k * rows;
            let mut size = t.shape().to_vec();
            size[0] = rows;
            sim::checked_block(t, &offsets, &size).unwrap_or_else(|_| t.clone())
        })
        .collect()
}

/// Local computation of one op instruction: what a [`crate::Backend`] evaluates.
#[derive(Clone, Debug)]
pub enum Kernel {
    /// The op (shape attributes local) on the local blocks.
    Same(Op),
    /// Gather from a table split along `axis` over `axes` (see [`sharding::Local::MaskedGather`]):
    /// each rank gathers the rows it holds, zeros elsewhere.
    MaskedGather {
        /// The gather (on the local table).
        op: Op,
        /// The table's split axis.
        axis: usize,
        /// The mesh axes it is split over.
        axes: Vec<usize>,
        /// Rows of the local block.
        rows: usize,
        /// Rows of the whole table.
        total: usize,
    },
    /// Gather's gradient into a table split along its axis over `axes`.
    MaskedScatter {
        /// The gather's gradient op.
        op: Op,
        /// The mesh axes the table is split over.
        axes: Vec<usize>,
        /// Rows of the local block.
        rows: usize,
        /// Rows of the whole table.
        total: usize,
        /// Product of the table's dims before the split axis.
        pre: usize,
    },
    /// Softmax or log-softmax along `axis` split over `axes`.
    SplitSoftmax {
        /// The softmax axis.
        axis: usize,
        /// Log-softmax.
        log: bool,
        /// The mesh axes `axis` is split over.
        axes: Vec<usize>,
    },
    /// Causal attention or its gradient on a block of `rows` query rows split over `axes` (see
    /// [`sharding::Local::QueryBlocks`]): `op` with its causal frontier moved by the rank's
    /// index in the group times `rows`.
    QueryBlock {
        /// The op (on local blocks, as the plan gives it).
        op: Op,
        /// The mesh axes the query rows are split over.
        axes: Vec<usize>,
        /// Query rows of the local block.
        rows: usize,
    },
    /// Training-mode dropout of a block of its output's layout `spec` in a tensor of global
    /// `shape` (one microbatch's): the rank's offsets in it key the mask (`ir::ops::random`).
    Dropout {
        /// The dropout's attributes.
        attrs: ir::DropoutAttrs,
        /// The global shape.
        shape: Vec<usize>,
        /// The output's layout.
        spec: ShardingSpec,
    },
}

/// One compiled instruction.
// Instructions are compiled once and walked every step: the op variant stays inline rather than
// boxed (one indirection per instruction per step for a few hundred bytes per instruction).
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
pub(crate) enum Exec {
    /// A parameter or optimizer state: its storage becomes the slot's value.
    Storage { slot: usize, name: String },
    /// This rank's block of a fed input.
    Input { slot: usize, index: usize },
    /// This rank's block of a constant.
    Constant { slot: usize, index: usize },
    /// A kernel, and the local shape of each of its outputs.
    Op {
        /// Program node id.
        id: usize,
        node: String,
        op: &'static str,
        kernel: Kernel,
        inputs: Vec<usize>,
        outputs: Vec<usize>,
        shapes: Vec<Vec<usize>>,
    },
    /// A reshape of a value read for the last time: the output takes over its buffer.
    View { id: usize, node: String, input: usize, output: usize, shape: Vec<usize> },
    /// A collective.
    Collective { input: usize, output: usize, c: Collective },
    /// This rank's block sent to its peer on pipeline stage `to` (the rank there at the same
    /// coordinates of the other mesh axes).
    Send { slot: usize, to: usize, id: u64 },
    /// The block of the peer on pipeline stage `from`, a tensor of `meta`.
    Recv { slot: usize, from: usize, meta: TensorMeta, id: u64 },
    /// Values no longer needed.
    Free { slots: Vec<usize> },
}

/// A parameter or optimizer-state tensor of the plan.
#[derive(Clone, Debug)]
pub struct Resident {
    /// Storage name (initializer name, or the state's name).
    pub name: String,
    /// Global meta.
    pub meta: TensorMeta,
    /// Layout.
    pub spec: ShardingSpec,
    /// True for optimizer state (initialised to zeros), false for parameters.
    pub is_state: bool,
    /// The pipeline stage whose ranks hold it (0 without stages).
    pub stage: usize,
}

/// A graph input of the plan.
#[derive(Clone, Debug)]
pub struct InputInfo {
    /// Input name.
    pub name: String,
    /// Global meta (the global batch).
    pub meta: TensorMeta,
    /// Layout.
    pub spec: ShardingSpec,
}

/// A plan compiled for execution (see the module docs). Shared read-only by all ranks.
#[derive(Debug)]
pub struct Program {
    pub(crate) mesh: DeviceMesh,
    /// Pipeline stages (1: none): stage `s` is run by the ranks whose first mesh coordinate is
    /// `s`.
    pub(crate) stages: usize,
    /// The code of each stage (one without stages).
    pub(crate) code: Vec<Vec<Exec>>,
    /// Microbatches per step: each stage runs its `steps`, a segment of its code for one
    /// microbatch each, then its update segment once.
    pub(crate) microbatches: usize,
    /// Per stage, where each segment of its code is (its instructions are in segment order).
    pub(crate) segments: Vec<HashMap<plan::Segment, std::ops::Range<usize>>>,
    /// Per stage, the plan instruction (index in `plan.program`) each code instruction comes
    /// from (empty for a program not compiled from a plan).
    pub origin: Vec<Vec<usize>>,
    /// Per stage, the schedule's steps.
    pub(crate) steps: Vec<Vec<plan::Step>>,
    /// The pipeline's schedule, if any, and whether its transfers between two ranks are
    /// received in the order sent ([`plan::schedule::Timeline::in_order`]).
    pub(crate) schedule: Option<(plan::ScheduleKind, bool)>,
    /// Per stage, the bytes a rank of it sends in one step, with room for each message's
    /// header (a buffer that holds every send of a step lets sends never wait).
    pub(crate) send_bytes: Vec<usize>,
    /// Slots summed over microbatches (the accumulated values and the graph's outputs).
    pub(crate) accumulate: Vec<usize>,
    /// Per stage and step, the positions in `accumulate` of what the step's microbatch adds
    /// into the sums when the step ends (what its last step leaves is added then).
    pub(crate) summed_after: Vec<Vec<Vec<usize>>>,
    pub(crate) slot_names: Vec<ValueRef>,
    /// Whether each slot holds a constant (borrowed from the rank's constants: freeing it
    /// releases nothing).
    pub(crate) constant_slot: Vec<bool>,
    /// Parameters and optimizer state, in plan order.
    pub resident: Vec<Resident>,
    /// Constants: global value and layout.
    pub(crate) constants: Vec<(Tensor, ShardingSpec)>,
    /// Graph inputs.
    pub inputs: Vec<InputInfo>,
    /// Graph outputs: name, slot, layout, global shape.
    pub(crate) outputs: Vec<(String, usize, ShardingSpec, Vec<usize>)>,
    /// Storage name and slot of each updated value, by stage.
    pub(crate) updates: Vec<Vec<(String, usize)>>,
    /// Parameters read but never updated (frozen): their slot goes back to storage; by stage.
    pub(crate) kept: Vec<Vec<(String, usize)>>,
    /// The plan's estimate of the peak bytes per rank.
    pub estimated_peak: u64,
    /// The plan's model hash.
    pub model_hash: String,
    /// What a checkpoint's blocks depend on, hashed: the model hash, the mesh, and every
    /// parameter and state's name, dtype, shape and layout. Two plans that agree on it store
    /// the same blocks on the same ranks; checkpoint shards carry it.
    pub plan_hash: String,
    /// Inputs a dataset feeds before each step ([`Program::stream_inputs`]): a rank without
    /// their blocks holds empty placeholders until [`Program::data_blocks`] reads them.
    pub(crate) streamed: std::collections::BTreeSet<String>,
    /// [`Program::eval_marks`], computed on first use.
    pub(crate) eval_marks: std::sync::OnceLock<Vec<Vec<bool>>>,
    /// The inputs whose values index a table (token ids, labels), checked in every rank's feeds
    /// and data blocks ([`crate::bounds`]).
    pub bounds: Vec<crate::bounds::IndexBound>,
    /// The seed of the run's random ops (dropout): the plan's, or [`Program::set_seed`]'s.
    pub(crate) seed: u64,
    /// Whether training steps drop ([`Program::set_dropout`]; `true` unless turned off).
    pub(crate) dropout: bool,
}

/// The output an evaluation step computes (and the only one).
pub const EVAL_OUTPUT: &str = "loss";

/// Per slot, whether some stage's code puts a constant in it.
pub(crate) fn constant_slots(codes: &[Vec<Exec>], slots: usize) -> Vec<bool> {
    let mut v = vec![false; slots];
    for ins in codes.iter().flatten() {
        if let Exec::Constant { slot, .. } = ins {
            v[*slot] = true;
        }
    }
    v
}

/// One rank's blocks (see the module docs).
#[derive(Debug)]
pub struct RankState {
    /// The rank.
    pub rank: usize,
    /// Local blocks of parameters and optimizer state, by storage name.
    pub storage: BTreeMap<String, Tensor>,
    pub(crate) constants: Vec<Arc<Tensor>>,
    pub(crate) feeds: Vec<Arc<Tensor>>,
    /// Steps run so far (including those of a loaded checkpoint).
    pub steps_done: u64,
    /// The rank's measured profile of its last run (`RunOptions::profile_ops`).
    pub profile: Option<RankProfile>,
}

/// What one step did on one rank.
#[derive(Debug, Clone)]
pub struct StepResult {
    /// Graph outputs (the loss), assembled from every rank's blocks.
    pub outputs: BTreeMap<String, Tensor>,
    /// Peak bytes this rank held during the step.
    pub peak_bytes: u64,
    /// Seconds of the step on this rank.
    pub seconds: f64,
    /// Seconds spent in collectives (waiting included).
    pub comm_seconds: f64,
    /// Bytes of the storage and constants the step read (resident throughout).
    pub resident_bytes: u64,
    /// Seconds of each op, by program node id, in program order (only when profiled).
    pub op_seconds: Vec<(usize, f64)>,
    /// Each instruction run (only when profiled): its place in the stage's code, its seconds
    /// (waiting in collectives included) and the bytes the rank held after it.
    pub instr_profile: Vec<(usize, f64, u64)>,
    /// Bytes this rank has read from a dataset so far (set by the launcher's loop).
    pub data_bytes: u64,
    /// Seconds this rank spent reading the step's data and setting its feeds (before the step).
    pub data_seconds: f64,
    /// [`crate::data::Dataset::fingerprint`] of the data this rank read (0 without any): every
    /// rank's must agree.
    pub data_hash: i64,
}

impl Program {
    /// Compiles a plan, once [`Plan::validate`] passes (every back end compiles the plan
    /// before it starts a rank, so no rank ever runs an invalid one).
    pub fn new(plan: &Plan) -> Result<Program, DistError> {
        Program::with_float_type(plan, DType::F32)
    }

    /// Compiles a plan to compute in float type `float`: with `F64`, the plan's graph is made
    /// f64 ([`Graph::with_float_type`]) and parameters and feeds are converted as they are
    /// loaded, so the same plan runs in double precision: the way to check a plan on a model
    /// whose f32 results depend on summation order. Memory then is twice the plan's estimate.
    pub fn with_float_type(plan: &Plan, float: DType) -> Result<Program, DistError> {
        let mesh = plan.validated_mesh().map_err(|e| DistError::InvalidPlan(e.to_string()))?;
        Program::compile(plan, mesh, float)
    }

    /// The single-device program of a graph (the one-rank plan, without a planner): its nodes in
    /// `order`, each op on whole tensors, every intermediate freed after its last read, and a
    /// reshape of a value read for the last time made a view of it. Parameters, state and
    /// constants are never freed (they are the caller's). Constants are read from
    /// `Exec::Constant` indices into the returned list of constant nodes.
    pub(crate) fn single(g: &ir::Graph, order: &[NodeIndex]) -> (Program, Vec<NodeIndex>) {
        let mesh = DeviceMesh::uniform(&[1]).expect("a one-device mesh");
        let pos: HashMap<NodeIndex, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        let id = |n: NodeIndex| pos[&n];
        let mut slots: HashMap<ir::Value, usize> = HashMap::new();
        let mut slot_names = vec![];
        let mut slot_of = |v: ir::Value| -> usize {
            *slots.entry(v).or_insert_with(|| {
                slot_names.push(ValueRef::new(id(v.node), v.slot));
                slot_names.len() - 1
            })
        };
        // The schedule position of each value's last reader; values read at the end never die.
        let mut last: HashMap<ir::Value, usize> = HashMap::new();
        let inputs_of: Vec<Vec<ir::Value>> = order.iter().map(|&n| g.node_inputs(n)).collect();
        for (p, ins) in inputs_of.iter().enumerate() {
            for &v in ins {
                last.insert(v, p);
            }
        }
        for v in g.outputs.iter().map(|(_, v)| *v).chain(g.updates.iter().map(|(_, v)| *v)) {
            last.insert(v, usize::MAX);
        }
        let kept_source = |n: NodeIndex| matches!(g.node(n).op, Op::Param { .. } | Op::State { .. } | Op::Constant(_));
        let (mut code, mut resident, mut inputs, mut constants) = (vec![], vec![], vec![], vec![]);
        let replicated = |m: &TensorMeta| ShardingSpec::replicated(m.shape.len());
        for (p, &n) in order.iter().enumerate() {
            let node = g.node(n);
            let out0 = ir::Value::new(n, 0);
            let ins = &inputs_of[p];
            match &node.op {
                Op::Param { name } | Op::State { name } => {
                    let meta = node.outputs[0].clone();
                    let spec = replicated(&meta);
                    let is_state = matches!(node.op, Op::State { .. });
                    resident.push(Resident { name: name.clone(), meta, spec, is_state, stage: 0 });
                    code.push(Exec::Storage { slot: slot_of(out0), name: name.clone() });
                }
                Op::Input { name } => {
                    let meta = node.outputs[0].clone();
                    inputs.push(InputInfo { name: name.clone(), spec: replicated(&meta), meta });
                    code.push(Exec::Input { slot: slot_of(out0), index: inputs.len() - 1 });
                }
                Op::Constant(_) => {
                    constants.push(n);
                    code.push(Exec::Constant { slot: slot_of(out0), index: constants.len() - 1 });
                }
                Op::Reshape { shape }
                    if ins.len() == 1 && last.get(&ins[0]) == Some(&p) && !g.node(ins[0].node).op.is_source() =>
                {
                    let (input, output) = (slot_of(ins[0]), slot_of(out0));
                    code.push(Exec::View { id: id(n), node: node.name.clone(), input, output, shape: shape.clone() });
                }
                op => {
                    let kernel = match op {
                        Op::Dropout(attrs) => {
                            let meta = &node.outputs[0];
                            Kernel::Dropout { attrs: *attrs, shape: meta.shape.clone(), spec: replicated(meta) }
                        }
                        op => Kernel::Same(op.clone()),
                    };
                    code.push(Exec::Op {
                        id: id(n),
                        node: node.name.clone(),
                        op: op.name(),
                        kernel,
                        inputs: ins.iter().map(|&v| slot_of(v)).collect(),
                        outputs: (0..node.outputs.len()).map(|k| slot_of(ir::Value::new(n, k))).collect(),
                        shapes: node.outputs.iter().map(|m| m.shape.clone()).collect(),
                    });
                }
            }
            // Free what this node read for the last time (a view's input is moved, not freed),
            // and outputs nobody reads.
            let viewed = matches!(code.last(), Some(Exec::View { .. }));
            let mut dead: Vec<ir::Value> = ins
                .iter()
                .copied()
                .filter(|v| last.get(v) == Some(&p) && !kept_source(v.node) && !viewed)
                .chain(
                    (0..node.outputs.len())
                        .map(|k| ir::Value::new(n, k))
                        .filter(|v| !last.contains_key(v) && !kept_source(n)),
                )
                .collect();
            dead.sort();
            dead.dedup();
            if !dead.is_empty() {
                code.push(Exec::Free { slots: dead.into_iter().map(&mut slot_of).collect() });
            }
        }
        let outputs = g
            .outputs
            .iter()
            .map(|(name, v)| {
                let m = g.meta(*v);
                (name.clone(), slot_of(*v), replicated(m), m.shape.clone())
            })
            .collect();
        let (updates, kept) = single_returns(g, &pos, &mut slot_of);
        let program = Program {
            seed: 0,
            dropout: true,
            plan_hash: String::new(),
            // The interpreter checks its feeds itself.
            bounds: vec![],
            streamed: Default::default(),
            origin: vec![],
            eval_marks: Default::default(),
            mesh,
            stages: 1,
            microbatches: 1,
            segments: vec![HashMap::from([(plan::Segment { phase: plan::Phase::Forward, chunk: 0 }, 0..code.len())])],
            steps: vec![plan::schedule::sequential(1, 1, false)],
            send_bytes: vec![0],
            schedule: None,
            accumulate: vec![],
            summed_after: vec![],
            constant_slot: constant_slots(std::slice::from_ref(&code), slot_names.len()),
            code: vec![code],
            slot_names,
            resident,
            constants: vec![],
            inputs,
            outputs,
            updates: vec![updates],
            kept: vec![kept],
            estimated_peak: 0,
            model_hash: String::new(),
        };
        (program, constants)
    }

    /// Compiles a plan already validated (as [`Program::with_float_type`]), without checking or
    /// parsing it again.
    pub fn from_valid(plan: &plan::Valid, float: DType) -> Result<Program, DistError> {
        Program::compile(plan.plan(), plan.mesh().clone(), float)
    }

    /// The mesh.
    pub fn mesh(&self) -> &DeviceMesh {
        &self.mesh
    }

    /// Number of ranks.
    pub fn ranks(&self) -> usize {
        self.mesh.size()
    }

    /// Number of pipeline stages (1: none).
    pub fn stages(&self) -> usize {
        self.stages
    }

    /// The pipeline stage of `rank` (its first mesh coordinate; 0 without stages).
    pub fn stage_of(&self, rank: usize) -> usize {
        if self.stages <= 1 { 0 } else { rank / self.per_stage() }
    }

    /// Ranks per pipeline stage.
    fn per_stage(&self) -> usize {
        (self.mesh.size() / self.stages.max(1)).max(1)
    }

    /// The rank of stage `stage` at `rank`'s coordinates on the other mesh axes.
    pub fn peer(&self, rank: usize, stage: usize) -> usize {
        if self.stages <= 1 { rank } else { stage * self.per_stage() + rank % self.per_stage() }
    }

    /// The ranks of `rank`'s stage, in rank order (every rank without stages).
    pub fn stage_ranks(&self, rank: usize) -> Vec<usize> {
        let s = self.stage_of(rank);
        (0..self.mesh.size()).filter(|&r| self.stage_of(r) == s).collect()
    }

    /// The mesh of one stage's ranks: the plan's mesh with axis 0 of size 1 (the mesh itself
    /// without stages). Layouts never split over axis 0, so they hold on it unchanged.
    pub fn stage_mesh(&self) -> DeviceMesh {
        if self.stages <= 1 {
            return self.mesh.clone();
        }
        let mut shape = self.mesh.shape().to_vec();
        shape[0] = 1;
        DeviceMesh::new(shape, self.mesh.names().to_vec(), self.mesh.links().to_vec())
            .unwrap_or_else(|_| self.mesh.clone())
    }

    /// Every group of ranks `rank` runs collectives over, one per set of mesh axes the plan's
    /// collectives (and special kernels, and the gathering of outputs) use, the sets in a
    /// fixed order: what [`Communicator::prepare`] makes ready.
    pub fn groups_of(&self, rank: usize) -> Vec<Vec<usize>> {
        let mut sets: Vec<Vec<usize>> = vec![];
        for code in &self.code {
            for e in code {
                match e {
                    Exec::Collective { c, .. } => sets.push(c.axes().to_vec()),
                    Exec::Op { kernel: Kernel::MaskedGather { axes, .. }, .. }
                    | Exec::Op { kernel: Kernel::MaskedScatter { axes, .. }, .. }
                    | Exec::Op { kernel: Kernel::SplitSoftmax { axes, .. }, .. } => sets.push(axes.clone()),
                    _ => {}
                }
            }
        }
        sets.sort();
        sets.dedup();
        let mut groups: Vec<Vec<usize>> = sets.iter().map(|a| self.mesh.group_of(rank, a)).collect();
        groups.push(self.stage_ranks(rank));
        groups.retain(|g| g.len() > 1);
        groups
    }

    /// Why a back end whose sends wait for their receives cannot run this program (a schedule
    /// where two stages send to each other at once: 1F1B, interleaved, zero bubble); `None`
    /// when it can.
    pub fn needs_buffered_sends(&self) -> Option<String> {
        let (kind, in_order) = self.schedule?;
        match kind {
            plan::ScheduleKind::Sequential | plan::ScheduleKind::Gpipe if in_order => None,
            plan::ScheduleKind::Sequential | plan::ScheduleKind::Gpipe => Some(format!(
                "under this plan's {kind} schedule, blocks between two ranks are not received in the order they are \
                 sent, and this back end has no tags to tell them apart"
            )),
            _ => Some(format!(
                "the {kind} schedule has stages send to each other at once, and this back end's sends wait for their \
                 receives; plan with --schedule gpipe"
            )),
        }
    }

    /// The bytes rank `rank` sends in one step, headers included (see `send_bytes`).
    pub fn send_bytes(&self, rank: usize) -> usize {
        self.send_bytes.get(self.stage_of(rank)).copied().unwrap_or(0)
    }

    /// The global batch size (first dim of the first input, times the microbatches), for
    /// samples per second.
    pub fn batch(&self) -> usize {
        self.inputs.first().and_then(|i| i.meta.shape.first().copied()).unwrap_or(1) * self.microbatches
    }

    /// Rank `rank`'s state: its parameter blocks from `params` (every parameter must be
    /// found), zero optimizer state, its constant blocks and its blocks of `feeds` (global
    /// tensors by input name).
    pub fn init_rank(
        &self,
        rank: usize,
        params: &dyn ParamSource,
        feeds: &BTreeMap<String, Tensor>,
    ) -> Result<RankState, DistError> {
        let data = |message: String| DistError::Data { rank, message };
        let mut storage = BTreeMap::new();
        let stage = self.stage_of(rank);
        for r in self.resident.iter().filter(|r| r.stage == stage) {
            let offsets = r.spec.offsets(&r.meta.shape, &self.mesh, rank);
            let size = r.spec.local_shape(&r.meta.shape, &self.mesh);
            let t = if r.is_state {
                Tensor::zeros(&TensorMeta::new(r.meta.dtype, size))
                    .map_err(|e| data(format!("optimizer state {}: {e}", r.name)))?
            } else if r.meta.dtype == DType::F64 {
                // Weights are f32 (ONNX initializers, seeded init): read them so and widen.
                let meta = TensorMeta::new(DType::F32, r.meta.shape.clone());
                params
                    .block(&r.name, &meta, &offsets, &size)
                    .map_err(data)?
                    .ok_or_else(|| data(format!("no data for parameter {}", r.name)))?
                    .with_float_type(DType::F64)
            } else {
                params
                    .block(&r.name, &r.meta, &offsets, &size)
                    .map_err(data)?
                    .ok_or_else(|| data(format!("no data for parameter {}", r.name)))?
            };
            storage.insert(r.name.clone(), t);
        }
        let mut st = self.empty_rank(rank, feeds)?;
        st.storage = storage;
        Ok(st)
    }

    /// Rank `rank`'s state without parameters or optimizer state (to be loaded from a
    /// checkpoint), with its constant blocks and its blocks of `feeds`.
    pub fn empty_rank(&self, rank: usize, feeds: &BTreeMap<String, Tensor>) -> Result<RankState, DistError> {
        let data = |message: String| DistError::Data { rank, message };
        let constants = self
            .constants
            .iter()
            .map(|(t, s)| sim::local_block(t, s, &self.mesh, rank).map(Arc::new).map_err(|e| data(e.to_string())))
            .collect::<Result<_, _>>()?;
        let mut st =
            RankState { rank, storage: BTreeMap::new(), constants, feeds: vec![], steps_done: 0, profile: None };
        self.set_feeds(&mut st, feeds)?;
        Ok(st)
    }

    /// The global parameters (no optimizer state) from every rank's blocks (`states` in rank
    /// order). Replicas must agree exactly: the runtime's reductions are deterministic.
    pub fn assemble_params(&self, states: &[RankState]) -> Result<BTreeMap<String, Tensor>, DistError> {
        self.assemble(states, false)
    }

    /// The global optimizer state from every rank's blocks.
    pub fn assemble_state(&self, states: &[RankState]) -> Result<BTreeMap<String, Tensor>, DistError> {
        self.assemble(states, true)
    }

    fn assemble(&self, states: &[RankState], state: bool) -> Result<BTreeMap<String, Tensor>, DistError> {
        if states.len() != self.mesh.size() {
            return Err(DistError::Plan(format!("{} rank states for {} ranks", states.len(), self.mesh.size())));
        }
        let mut out = BTreeMap::new();
        for r in self.resident.iter().filter(|r| r.is_state == state) {
            // A pipelined rank holds only its stage's storage: every rank's block is the one
            // its peer on the holding stage has.
            let blocks: Vec<Tensor> = (0..states.len())
                .map(|k| {
                    let s = &states[self.peer(k, r.stage)];
                    s.storage
                        .get(&r.name)
                        .cloned()
                        .ok_or_else(|| DistError::Data { rank: s.rank, message: format!("no block of {}", r.name) })
                })
                .collect::<Result<_, _>>()?;
            let t = sim::assemble(&blocks, &r.spec, &r.meta.shape, &self.mesh, 0.0)
                .map_err(|e| DistError::Plan(format!("assembling {}: {e}", r.name)))?;
            out.insert(r.name.clone(), t);
        }
        Ok(out)
    }

    /// Replaces a rank's input blocks with its blocks of `feeds` (global tensors by input name).
    pub fn set_feeds(&self, st: &mut RankState, feeds: &BTreeMap<String, Tensor>) -> Result<(), DistError> {
        let data = |message: String| DistError::Data { rank: st.rank, message };
        let names: Vec<&str> = self.inputs.iter().map(|i| i.name.as_str()).collect();
        if let Some(extra) = feeds.keys().find(|k| !names.contains(&k.as_str())) {
            return Err(data(format!(
                "--feed {extra}: the plan has no input of that name (inputs: {})",
                names.join(", ")
            )));
        }
        // With microbatches, each feed holds all of them along its first dim: microbatch m's
        // blocks are `feeds[m * inputs + i]`.
        let m = self.microbatches;
        let mut blocks: Vec<Vec<Arc<Tensor>>> = vec![vec![]; m];
        for i in &self.inputs {
            if !feeds.contains_key(&i.name) && self.streamed.contains(&i.name) {
                // Read before each step (`data_blocks`).
                let empty = Arc::new(Tensor::empty(i.meta.dtype));
                for b in &mut blocks {
                    b.push(empty.clone());
                }
                continue;
            }
            let t = feeds.get(&i.name).ok_or_else(|| {
                data(format!(
                    "missing feed for input {} (expects {}); pass it with --feed {}=FILE.npy",
                    i.name,
                    self.global_meta(i),
                    i.name
                ))
            })?;
            let widen = crate::values::widens(t.dtype(), i.meta.dtype);
            if t.shape() != self.global_meta(i).shape.as_slice() || (t.dtype() != i.meta.dtype && !widen) {
                let per = if m > 1 { format!(" ({m} microbatches of {})", i.meta) } else { String::new() };
                return Err(data(format!(
                    "feed {} is {} but the plan expects {}{per}",
                    i.name,
                    t.meta(),
                    self.global_meta(i)
                )));
            }
            crate::bounds::check_all(&self.bounds, [(i.name.as_str(), t)]).map_err(data)?;
            crate::bounds::check_no_nan(&i.name, t).map_err(data)?;
            for (k, piece) in microbatch_pieces(t, m).into_iter().enumerate() {
                let block = sim::local_block(&piece, &i.spec, &self.mesh, st.rank).map_err(|e| data(e.to_string()))?;
                blocks[k].push(Arc::new(if widen { block.with_float_type(i.meta.dtype) } else { block }));
            }
        }
        st.feeds = blocks.into_iter().flatten().collect();
        Ok(())
    }

    /// Per stage, whether each instruction runs in an evaluation step: those the
    /// [`EVAL_OUTPUT`] depends on (through transfers between stages too), and every `Free` (of
    /// what is there). The same on every rank of a stage, so collectives still meet.
    pub(crate) fn eval_marks(&self) -> &[Vec<bool>] {
        self.eval_marks.get_or_init(|| {
            let seeds: HashSet<usize> = self.outputs.iter().filter(|o| o.0 == EVAL_OUTPUT).map(|o| o.1).collect();
            let mut need: Vec<HashSet<usize>> = vec![seeds; self.code.len()];
            let mut ids: HashSet<u64> = HashSet::new();
            let mut marks: Vec<Vec<bool>> = self.code.iter().map(|c| vec![false; c.len()]).collect();
            // A pass walks each stage's code backwards (writers come before readers); passes
            // repeat until the transfers between stages add nothing.
            loop {
                let before = (ids.len(), need.iter().map(HashSet::len).sum::<usize>());
                for (s, code) in self.code.iter().enumerate() {
                    let n = &mut need[s];
                    for (k, ins) in code.iter().enumerate().rev() {
                        let on = match ins {
                            Exec::Op { inputs, outputs, .. } => {
                                let on = outputs.iter().any(|o| n.contains(o));
                                if on {
                                    n.extend(inputs.iter().copied());
                                }
                                on
                            }
                            Exec::View { input, output, .. } | Exec::Collective { input, output, .. } => {
                                let on = n.contains(output);
                                if on {
                                    n.insert(*input);
                                }
                                on
                            }
                            Exec::Storage { slot, .. } | Exec::Input { slot, .. } | Exec::Constant { slot, .. } => {
                                n.contains(slot)
                            }
                            Exec::Recv { slot, id, .. } => {
                                let on = n.contains(slot);
                                if on {
                                    ids.insert(*id);
                                }
                                on
                            }
                            Exec::Send { slot, id, .. } => {
                                let on = ids.contains(id);
                                if on {
                                    n.insert(*slot);
                                }
                                on
                            }
                            Exec::Free { .. } => true,
                        };
                        marks[s][k] |= on;
                    }
                }
                if (ids.len(), need.iter().map(HashSet::len).sum::<usize>()) == before {
                    break;
                }
            }
            marks
        })
    }

    /// Marks `names` as inputs a dataset feeds before every step: ranks are set up without
    /// their blocks, and [`Program::data_blocks`] reads them.
    pub fn stream_inputs<'n>(&mut self, names: impl IntoIterator<Item = &'n str>) {
        self.streamed = names.into_iter().map(str::to_string).collect();
    }

    /// Rank `rank`'s blocks of the inputs `reader` binds at step `step` (0-based): each with
    /// its place in the rank's feeds (microbatch-major, as [`Program::set_feeds`] orders them).
    pub fn data_blocks(
        &self,
        rank: usize,
        reader: &mut crate::data::Reader<'_>,
        step: u64,
    ) -> Result<Vec<(usize, Arc<Tensor>)>, DistError> {
        let data = |message: String| DistError::Data { rank, message };
        // A pipeline stage reads only the inputs its code reads (the others keep placeholders).
        let stage = self.stage_of(rank);
        let read: HashSet<usize> = self
            .code
            .get(stage)
            .map(|c| {
                c.iter().filter_map(|e| if let Exec::Input { index, .. } = e { Some(*index) } else { None }).collect()
            })
            .unwrap_or_default();
        let mut out = vec![];
        for (k, i) in self.inputs.iter().enumerate() {
            if !reader.binds(&i.name) || !read.contains(&k) {
                continue;
            }
            let shape = &i.meta.shape;
            let offsets = i.spec.offsets(shape, &self.mesh, rank);
            let size = i.spec.local_shape(shape, &self.mesh);
            let zero = self.mesh.index_in_group(rank, i.spec.partial()) != 0;
            let rows = shape.first().copied().unwrap_or(0);
            for m in 0..self.microbatches {
                let block = if zero {
                    Tensor::zeros(&TensorMeta::new(i.meta.dtype, size.clone()))
                        .map_err(|e| data(format!("input {}: {e}", i.name)))?
                } else {
                    let mut at = offsets.clone();
                    if let Some(r) = at.first_mut() {
                        *r += m * rows;
                    }
                    let b = reader.block(&i.name, step, &at, &size).map_err(|e| data(e.to_string()))?;
                    crate::bounds::check_all(&self.bounds, [(i.name.as_str(), &b)]).map_err(data)?;
                    crate::bounds::check_no_nan(&i.name, &b).map_err(data)?;
                    b
                };
                out.push((m * self.inputs.len() + k, Arc::new(block)));
            }
        }
        Ok(out)
    }

    /// Each input's name and the meta one step's feed of it has (every microbatch's rows).
    pub fn feed_metas(&self) -> Vec<(String, TensorMeta)> {
        self.inputs.iter().map(|i| (i.name.clone(), self.global_meta(i))).collect()
    }

    /// The meta a feed of input `i` has: the microbatches' blocks one after the other.
    fn global_meta(&self, i: &InputInfo) -> TensorMeta {
        let mut shape = i.meta.shape.clone();
        if let Some(d) = shape.first_mut() {
            *d *= self.microbatches;
        }
        TensorMeta::new(i.meta.dtype, shape)
    }

    /// Microbatches per step.
    pub fn microbatches(&self) -> usize {
        self.microbatches
    }

    /// The seed the run's dropout masks are drawn from: the plan's (`plan --seed`), unless
    /// [`Program::set_seed`] replaced it.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Draws the run's dropout masks from `seed` (`run --seed`).
    pub fn set_seed(&mut self, seed: u64) {
        self.seed = seed;
    }

    /// With `false`, training steps drop nothing (`run --no-dropout`): every training-mode
    /// dropout keeps every element, as `train --no-dropout` does (the deterministic part of a
    /// model, to compare with a framework's run without dropout).
    pub fn set_dropout(&mut self, on: bool) {
        self.dropout = on;
    }

    /// The key of training step `step`'s random draws: `None` when dropout is off.
    pub fn step_key(&self, step: u64) -> Option<StepKey> {
        self.dropout.then_some(StepKey { seed: self.seed, step })
    }

    /// Whether the program draws random numbers (it has a training-mode dropout): only then
    /// does the seed change what it computes.
    pub fn draws(&self) -> bool {
        self.code.iter().flatten().any(|e| matches!(e, Exec::Op { kernel: Kernel::Dropout { .. }, .. }))
    }
}

/// Why a local computation failed.
#[derive(Debug)]
pub enum KernelFailure {
    /// The kernel refused its inputs (the message says why); the executor names the node.
    Kernel(String),
    /// A collective of the kernel's own failed.
    Comm(CommError),
}

/// One rank's measured profile of a run's steps (`--profile-ops`): the first step is left out
/// as a warm-up when there are more.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RankProfile {
    /// The rank.
    pub rank: usize,
    /// Steps measured.
    pub steps: u64,
    /// Mean seconds per step of each plan instruction the rank runs (index in the plan's
    /// program; summed over microbatches; waiting in collectives included).
    pub seconds: BTreeMap<usize, f64>,
    /// The bytes held after each instruction of the last measured step, in the order run (plan
    /// instruction index, bytes).
    pub memory: Vec<(usize, u64)>,
    /// The median step's seconds.
    pub step_seconds: f64,
}

impl RankProfile {
    /// As i64 words, for gathering through a communicator.
    pub fn to_words(&self) -> Vec<i64> {
        let mut w = vec![self.rank as i64, self.steps as i64, (self.step_seconds * 1e9) as i64];
        w.push(self.seconds.len() as i64);
        for (&k, &v) in &self.seconds {
            w.extend([k as i64, (v * 1e9) as i64]);
        }
        w.push(self.memory.len() as i64);
        for &(k, b) in &self.memory {
            w.extend([k as i64, b as i64]);
        }
        w
    }

    /// From [`RankProfile::to_words`] (`None`: not such words).
    pub fn from_words(w: &[i64]) -> Option<RankProfile> {
        let mut it = w.iter().map(|&x| x.max(0) as u64);
        let mut next = || it.next();
        let (rank, steps, step_ns) = (next()? as usize, next()?, next()?);
        let mut seconds = BTreeMap::new();
        for _ in 0..next()? {
            seconds.insert(next()? as usize, next()? as f64 * 1e-9);
        }
        let mut memory = vec![];
        for _ in 0..next()? {
            memory.push((next()? as usize, next()?));
        }
        Some(RankProfile { rank, steps, seconds, memory, step_seconds: step_ns as f64 * 1e-9 })
    }
}

/// Puts `blocks` at their places of `feeds`.
pub(crate) fn set_blocks<T>(feeds: &mut [T], blocks: Vec<(usize, T)>, rank: usize) -> Result<(), DistError> {
    for (k, t) in blocks {
        let n = feeds.len();
        *feeds.get_mut(k).ok_or_else(|| DistError::Data { rank, message: format!("feed {k} of {n}") })? = t;
    }
    Ok(())
}

/// Storage names with slots.
type Named = Vec<(String, usize)>;

/// What a single-device program hands back to storage: the updated parameters and state with
/// the slots of their new values, and the frozen ones (read, never updated) with their slots.
fn single_returns(
    g: &ir::Graph,
    pos: &HashMap<NodeIndex, usize>,
    slot_of: &mut impl FnMut(ir::Value) -> usize,
) -> (Named, Named) {
    let storage_name = |n: NodeIndex| match &g.node(n).op {
        Op::Param { name } | Op::State { name } => Some(name.clone()),
        _ => None,
    };
    let mut updates = vec![];
    for &(t, v) in &g.updates {
        if let Some(name) = storage_name(t) {
            updates.push((name, slot_of(v)));
        }
    }
    let updated: std::collections::HashSet<&String> = updates.iter().map(|(n, _)| n).collect();
    let kept: Vec<(String, usize)> = g
        .params
        .iter()
        .chain(&g.states)
        .filter(|n| pos.contains_key(n))
        .filter_map(|&n| storage_name(n).map(|name| (name, n)))
        .filter(|(name, _)| !updated.contains(name))
        .map(|(name, n)| (name, slot_of(ir::Value::new(n, 0))))
        .collect();
    (updates, kept)
}
