//! The distributed plan format: `plan.json`, the artifact between the planner and the runtime.
//!
//! A [`Plan`] is one SPMD program that every rank of a device mesh runs on its own blocks, with
//! what it needs to run: the training graph it was lowered from, the mesh, where each parameter
//! and optimizer state lives ([`ParamShard`]), and for people the estimates and the solver's
//! report. This crate is the format only: typed, serde-derived structs with a [`VERSION`], a
//! JSON Schema generated from them ([`json_schema`], committed as `plan.schema.json`), and the
//! validating loader. It depends on `ir` and `sharding` (specs, collectives, their geometry),
//! never on the planner or the solver, so the runtime reads plans without them.
//!
//! Invariants:
//! - [`Plan::from_json`] returns only plans that [`Plan::validate`] accepts: the version is this
//!   crate's, every field has its type and form (value references are typed, [`ValueRef`]),
//!   and every field the runtime reads is consistent (mesh, graph, layouts, collectives, value
//!   lifetimes, parameter layouts, optimizer hyper-parameters; see [`validate`]). Nothing a
//!   rank needs is left to re-derive: the graph is structured JSON (`ir`'s JSON form, read
//!   without a text parse), every op instruction holds the local op it runs.
//! - The file is written with short arrays on one line (`pretty`), and reads back to an equal
//!   plan.
//! - Loading a plan of another version is an error naming both versions; writing one that is
//!   not representable as JSON (a NaN estimate) is an error, never a partial file.
#![warn(missing_docs)]

mod error;
mod form;
pub mod memory;
pub mod overlap;
mod pretty;
pub mod schedule;
mod sums;
pub mod validate;
mod value;

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use sharding::{Collective, DeviceMesh, Link, Local, ShardingSpec};

pub use error::{Error, Result};
pub use validate::{Location, Problem, Problems, Valid};
pub use value::{BadValueRef, ValueRef};

/// The plan format's version. 7: `options.precision` is one of `f32`, `f64`, `bf16`, `fp16`
/// ([`Precision`], was any string; the spellings are the same, so version 6 plans still read). 6: each instruction's `phase` (forward, backward, weight
/// gradient, update) and model `chunk`, and a pipeline's `schedule` (the order of every stage's
/// microbatch steps); `update_from` is gone (the update phase says it). 5: pipeline stages (`pipeline`, each instruction's and
/// parameter's `stage`, `transfer` instructions between stages). 4: the graph is JSON (nodes with typed ops, read without a text
/// parse) and each `op` instruction holds the local op it runs, attributes resolved for the
/// rank's blocks (was the op's name; the runtime re-derived the attributes). 3: the solver's
/// status is `optimal`, `within_gap` or `feasible` (was a Rust debug string).
pub const VERSION: u32 = 7;

/// The oldest format version this crate reads (a plan of it is read as this version).
pub const OLDEST_READ: u32 = 6;

/// Which strategies a plan may use.
///
/// Written in `plan.json` as its command-line name: `auto`, `dp`, `megatron`, `zero`, or a role
/// per mesh axis such as `pp,dp,tp` ([`AxisRoles`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(into = "String", try_from = "String")]
#[schemars(with = "String")]
pub enum Baseline {
    /// Any strategy: the solver chooses.
    Auto,
    /// Data parallel: the batch split over every mesh axis it divides; parameters, gradients'
    /// updates and optimizer state replicated.
    Dp,
    /// Megatron: the batch split over the outer axes (data parallel), parameters replicated over
    /// them and free (tensor parallel) on the innermost axis.
    Megatron,
    /// ZeRO: data parallel with parameters, their updates and optimizer state sharded over the
    /// data axes.
    Zero,
    /// A manual layout given per mesh axis (as ColossalAI's parallel config or Megatron's
    /// `--tensor/--pipeline-model-parallel-size` do): `dp,tp` on a 2-D mesh is Megatron's layout.
    Axes(AxisRoles),
}

/// What one mesh axis does in a manual layout ([`Baseline::Axes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AxisRole {
    /// Data parallel: the batch is split over the axis; parameters and optimizer state are
    /// replicated over it.
    Dp,
    /// ZeRO (stage 3, as [`Baseline::Zero`]): the batch is split over the axis; parameters,
    /// their updates and optimizer state are sharded over it when they divide.
    Zero,
    /// Tensor parallel: the batch is not split over the axis; parameters may be split over it
    /// as the solver finds cheapest (Megatron's column and row splits among them).
    Tp,
    /// Pipeline stages: the outermost axis, with `--pipeline` as many stages as its size.
    Pp,
    /// Sequence parallel: every input's second dimension (the sequence of `[batch, seq, ...]`
    /// inputs) is split over the axis when it divides; parameters and optimizer state are
    /// replicated over it, their gradients summed over it. The solver chooses how each op
    /// meets the split: attention by heads after an all-to-all (DeepSpeed-Ulysses), the
    /// sequence gathered, or kept split through token-wise ops.
    Sp,
}

impl AxisRole {
    /// Name as on the command line.
    pub fn name(self) -> &'static str {
        match self {
            AxisRole::Dp => "dp",
            AxisRole::Zero => "zero",
            AxisRole::Tp => "tp",
            AxisRole::Pp => "pp",
            AxisRole::Sp => "sp",
        }
    }
}

/// Most mesh axes a manual layout names.
pub const MAX_AXES: usize = 8;

/// One [`AxisRole`] per mesh axis, outermost first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AxisRoles {
    roles: [AxisRole; MAX_AXES],
    len: u8,
}

impl AxisRoles {
    /// Roles from a list (1 to [`MAX_AXES`] of them).
    pub fn new(roles: &[AxisRole]) -> std::result::Result<AxisRoles, String> {
        if roles.is_empty() || roles.len() > MAX_AXES {
            return Err(format!("a layout names 1 to {MAX_AXES} mesh axes, not {}", roles.len()));
        }
        let mut all = [AxisRole::Dp; MAX_AXES];
        all[..roles.len()].copy_from_slice(roles);
        Ok(AxisRoles { roles: all, len: roles.len() as u8 })
    }

    /// The roles, outermost axis first.
    pub fn roles(&self) -> &[AxisRole] {
        &self.roles[..self.len as usize]
    }
}

impl Baseline {
    /// The named baselines.
    pub const ALL: [Baseline; 4] = [Baseline::Auto, Baseline::Dp, Baseline::Megatron, Baseline::Zero];
    /// Name as on the command line (`dp,tp` for a layout per axis).
    pub fn name(self) -> String {
        match self {
            Baseline::Auto => "auto".into(),
            Baseline::Dp => "dp".into(),
            Baseline::Megatron => "megatron".into(),
            Baseline::Zero => "zero".into(),
            Baseline::Axes(a) => a.roles().iter().map(|r| r.name()).collect::<Vec<_>>().join(","),
        }
    }

    /// The role of every mesh axis of a mesh with `ndim` axes: what the named baselines mean
    /// per axis (`dp` and `zero` on every axis, `megatron` data parallel on all but the
    /// innermost of `sizes`' axes larger than 1, tensor parallel on it); `None` for `auto`.
    pub fn roles(self, sizes: &[usize]) -> Option<Vec<AxisRole>> {
        let n = sizes.len();
        match self {
            Baseline::Auto => None,
            Baseline::Dp => Some(vec![AxisRole::Dp; n]),
            Baseline::Zero => Some(vec![AxisRole::Zero; n]),
            Baseline::Megatron => {
                let mut r = vec![AxisRole::Dp; n];
                if let Some(inner) = (0..n).rev().find(|&a| sizes[a] > 1) {
                    r[inner] = AxisRole::Tp;
                }
                Some(r)
            }
            Baseline::Axes(a) => Some(a.roles().to_vec()),
        }
    }
}

impl std::fmt::Display for Baseline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

impl From<Baseline> for String {
    fn from(b: Baseline) -> String {
        b.name()
    }
}

impl TryFrom<String> for Baseline {
    type Error = String;
    fn try_from(s: String) -> std::result::Result<Baseline, String> {
        s.parse()
    }
}

impl std::str::FromStr for Baseline {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Baseline, String> {
        if let Some(b) = Baseline::ALL.into_iter().find(|b| b.name() == s) {
            return Ok(b);
        }
        if !s.contains(',') && !matches!(s, "tp" | "pp" | "sp") {
            return Err(format!(
                "unknown strategy `{s}` (auto, dp, megatron, zero, or a role per mesh axis such as `dp,tp` or `pp,dp,tp`)"
            ));
        }
        let roles = s
            .split(',')
            .map(|r| match r.trim() {
                "dp" => Ok(AxisRole::Dp),
                "zero" => Ok(AxisRole::Zero),
                "tp" => Ok(AxisRole::Tp),
                "pp" => Ok(AxisRole::Pp),
                "sp" => Ok(AxisRole::Sp),
                other => Err(format!("unknown axis role `{other}` in `{s}` (dp, zero, tp, sp, pp: one per mesh axis)")),
            })
            .collect::<std::result::Result<Vec<_>, String>>()?;
        Ok(Baseline::Axes(AxisRoles::new(&roles)?))
    }
}

/// Whether the solver proved its plan optimal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum SolveStatus {
    /// No plan is cheaper in the cost model (the objective meets the lower bound).
    Optimal,
    /// Within the solver's relative gap (0.001%) of its lower bound: optimal for any purpose.
    WithinGap,
    /// The best plan found in the time limit; the lower bound says how far from optimal it
    /// may be.
    Feasible,
}

impl std::fmt::Display for SolveStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SolveStatus::Optimal => "optimal",
            SolveStatus::WithinGap => "optimal within 0.001%",
            SolveStatus::Feasible => "feasible (not proven optimal)",
        })
    }
}

/// The size of a problem as the solver saw it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Size {
    /// Nodes.
    pub nodes: usize,
    /// Edges between distinct nodes, parallel edges counted once.
    pub edges: usize,
    /// Strategies over all nodes.
    pub strategies: usize,
    /// Variables of the exact ILP: one per strategy and one per finite entry of every edge.
    pub variables: usize,
}

/// What activation checkpointing did.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct CheckpointReport {
    /// Stages of the forward chain.
    pub stages: usize,
    /// Stages recomputed during backward (named by their last node).
    pub recomputed: Vec<String>,
    /// Seconds the recomputation adds to a step.
    pub extra_seconds: f64,
    /// Peak bytes per rank without recomputation.
    pub peak_before: u64,
    /// Peak bytes per rank with it.
    pub peak_after: u64,
    /// Wall seconds this stage of planning took.
    pub seconds: f64,
}

/// Most ranks whose parameter offsets a plan lists ([`ParamShard::offsets`]).
pub const MAX_LISTED_RANKS: usize = 64;

/// The offsets a plan lists for a parameter laid out as `spec` on `mesh`: every rank's, or none
/// on a mesh of more than [`MAX_LISTED_RANKS`] ranks.
pub fn listed_offsets(spec: &sharding::ShardingSpec, shape: &[usize], mesh: &sharding::DeviceMesh) -> Vec<Vec<usize>> {
    if mesh.size() > MAX_LISTED_RANKS {
        return vec![];
    }
    (0..mesh.size()).map(|r| spec.offsets(shape, mesh, r)).collect()
}

/// Model identity.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ModelInfo {
    /// Graph name.
    pub name: String,
    /// The training graph's fingerprint ([`ir::Graph::fingerprint`]: FNV-1a of its text form, constants
    /// hashed by their bits).
    pub hash: String,
    /// The ONNX file the plan was made from (where `autopar run` reads each rank's parameter
    /// blocks): an absolute path in plans written by `autopar plan`; a relative one (older
    /// plans) is relative to the plan file's directory. `None` when planned from a graph in
    /// memory.
    #[serde(default)]
    pub source: Option<String>,
    /// [`ModelInfo::file_hash`] of `source` and its external data files when planned, so that
    /// `autopar run` can refuse a model file that changed since; `None` in older plans.
    #[serde(default)]
    pub source_hash: Option<String>,
}

impl ModelInfo {
    /// The hash recorded in [`ModelInfo::source_hash`]: SHA-256 of the bytes of `files` one
    /// after the other (the model file, then its external data files in a fixed order), written
    /// `sha256:<64 hex digits>`. Only regular files are read. (A cryptographic hash because it is
    /// also fast: about 1.5 GB/s with the SHA instructions of current x86 and ARM cores.)
    pub fn file_hash<'a>(files: impl IntoIterator<Item = &'a std::path::Path>) -> std::io::Result<String> {
        use sha2::Digest;
        use std::io::Read;
        let mut h = sha2::Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        for path in files {
            let at = |e: std::io::Error| std::io::Error::new(e.kind(), format!("{}: {e}", path.display()));
            let mut f = ir::files::open_regular(path).map_err(at)?;
            loop {
                let n = f.read(&mut buf).map_err(at)?;
                if n == 0 {
                    break;
                }
                h.update(&buf[..n]);
            }
        }
        let hex: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
        Ok(format!("sha256:{hex}"))
    }
}

/// The mesh as planned.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct MeshInfo {
    /// Axis sizes, outermost first.
    pub shape: Vec<usize>,
    /// Axis names.
    pub names: Vec<String>,
    /// Link of each axis.
    pub links: Vec<Link>,
}

/// Planning options as used.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct OptionsInfo {
    /// Memory budget per rank, bytes.
    pub budget_bytes: u64,
    /// Requested strategy.
    pub strategy: Baseline,
    /// Solver time limit, seconds.
    pub time_limit_seconds: f64,
    /// The float precision of the training step: `f32`, or `bf16`/`fp16` for mixed precision
    /// (16-bit values in the graph, f32 parameters and optimizer state).
    #[serde(default, skip_serializing_if = "Precision::is_f32")]
    pub precision: Precision,
    /// With `auto`: the fraction of the step by which auto's own plan had to be estimated
    /// faster than the cheapest baseline compared to be chosen over it; of a stage search
    /// (`--pipeline auto`): by which a plan with stages had to be faster than the one without
    /// (0 in plans made before it existed: the cheapest was chosen).
    #[serde(default, skip_serializing_if = "no_gain")]
    pub min_gain: f64,
    /// Activation recomputation as asked (`--recompute`; `auto` in plans made before it
    /// existed, which recomputed only what made them fit).
    #[serde(default)]
    pub recompute: Recompute,
    /// The seed the run's random ops draw from (dropout masks, `plan --seed`): `autopar run`
    /// uses it unless given `--seed`. Masks depend on it, the step and each element's global
    /// index only, never on the layouts, so `run` of any plan with this seed equals `train
    /// --seed` with it. 0 when not written (and in plans made before it existed).
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub seed: u64,
    /// Whether the estimate overlaps communication with compute (`plan --overlap`, see
    /// [`overlap`]): gradient reductions and the prologue's gathers on a second stream,
    /// pipeline transfers beside the stages' work. It changes the estimate only, never the
    /// program. Off when not written (and in plans made before it existed).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub overlap: bool,
}

fn is_zero_f64(x: &f64) -> bool {
    *x == 0.0
}

fn is_zero_u64(x: &u64) -> bool {
    *x == 0
}

/// Activation recomputation: which forward activations a plan recomputes during the backward
/// instead of holding them, and whether the layouts are chosen knowing it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    /// Searched with the layouts: every plan is solved as it is and, where memory can bind,
    /// also as if every layer were recomputed (so that layouts which hold more activations per
    /// rank, but need fewer collectives, are priced with the recomputation that makes them
    /// fit); the cheapest wins, recomputing only what it needs to fit.
    #[default]
    Auto,
    /// Only what makes the plan fit, chosen after its layouts (which do not count on it).
    Fit,
    /// Every layer (Megatron's full, uniform recomputation): only each layer's input is held,
    /// the forward runs again during the backward; the layouts are chosen knowing it.
    Full,
    /// Never: a plan whose activations do not fit is not accepted.
    Off,
}

impl Recompute {
    /// Name as on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Recompute::Auto => "auto",
            Recompute::Fit => "fit",
            Recompute::Full => "full",
            Recompute::Off => "off",
        }
    }
}

impl std::fmt::Display for Recompute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Recompute {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Recompute, String> {
        match s {
            "auto" => Ok(Recompute::Auto),
            "fit" => Ok(Recompute::Fit),
            "full" => Ok(Recompute::Full),
            "off" => Ok(Recompute::Off),
            _ => Err(format!("unknown recomputation `{s}` (auto, fit, full, off)")),
        }
    }
}

fn no_gain(x: &f64) -> bool {
    *x == 0.0
}

/// The float precision of a plan's training step, as its graph's types say.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// f32 everywhere (the model's own type).
    #[default]
    F32,
    /// Every float in f64 (a graph made f64 before planning).
    F64,
    /// Mixed precision in bfloat16: 16-bit values in the graph, f32 parameters and optimizer
    /// state.
    Bf16,
    /// Mixed precision in IEEE half, with dynamic loss scaling.
    Fp16,
}

impl Precision {
    /// Its spelling in plans and on the command line (`f32`, `f64`, `bf16`, `fp16`).
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::F64 => "f64",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        }
    }

    /// Mixed precision (16-bit values, f32 parameters).
    pub fn is_mixed(self) -> bool {
        matches!(self, Precision::Bf16 | Precision::Fp16)
    }

    fn is_f32(&self) -> bool {
        *self == Precision::F32
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Where one parameter (or optimizer state) lives.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ParamShard {
    /// Initializer or state name.
    pub name: String,
    /// Program node id.
    pub node: usize,
    /// Global shape.
    pub shape: Vec<usize>,
    /// Element type.
    pub dtype: String,
    /// Layout.
    pub spec: ShardingSpec,
    /// Shape of each rank's block.
    pub local_shape: Vec<usize>,
    /// Offset of each rank's block (index = rank; in a pipelined plan only the ranks of its
    /// stage hold it), for people reading the plan: listed on meshes of at most
    /// [`MAX_LISTED_RANKS`] ranks, empty on larger ones (the runtime derives every block from
    /// `spec`; a list of every rank's offsets of every parameter would grow the plan with the
    /// square of the cluster: 300 MB for a 405B model on 16,384 GPUs).
    #[serde(default)]
    pub offsets: Vec<Vec<usize>>,
    /// The pipeline stage holding it (0 without stages).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub stage: usize,
}

fn is_zero(x: &usize) -> bool {
    *x == 0
}

fn is_one(x: &usize) -> bool {
    *x == 1
}

fn one() -> usize {
    1
}

/// One instruction of the SPMD program: every rank of its stage runs it on its blocks (without
/// pipeline stages, every rank runs every instruction).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Instr {
    /// Run node `node` of `graph` on local blocks.
    Op {
        /// Program node id (`%node` in `graph`).
        node: usize,
        /// Node name.
        name: String,
        /// The op each rank runs on its blocks: the node's op with its attributes for the local
        /// shapes (a reshape's target is the block's shape), resolved when the plan was lowered.
        /// A constant is written `"const"` (its value is the graph's; [`Plan::parse`] puts it
        /// back).
        #[schemars(with = "form::OpForm")]
        #[serde(with = "instr_op")]
        op: ir::Op,
        /// Strategy name.
        strategy: String,
        /// Values read: the node's graph inputs, or converted copies of them.
        inputs: Vec<ValueRef>,
        /// Their specs.
        input_specs: Vec<ShardingSpec>,
        /// Values written: the node's outputs, in order.
        outputs: Vec<ValueRef>,
        /// Their specs.
        output_specs: Vec<ShardingSpec>,
        /// Local shape of each output.
        local_shapes: Vec<Vec<usize>>,
        /// How the rank computes.
        local: Local,
        /// Estimated seconds (compute + the op's own collectives).
        seconds: f64,
        /// A re-execution during backward of a forward op whose output was not kept
        /// (activation checkpointing).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        recompute: bool,
        /// The pipeline stage whose ranks run it (0 without stages).
        #[serde(default, skip_serializing_if = "is_zero")]
        stage: usize,
        /// The part of a step it belongs to.
        #[serde(default, skip_serializing_if = "Phase::is_forward")]
        phase: Phase,
        /// The model chunk of its stage it belongs to (interleaved schedules; 0 otherwise).
        #[serde(default, skip_serializing_if = "is_zero")]
        chunk: usize,
    },
    /// A layout conversion step of a value.
    Collective {
        /// Value read.
        input: ValueRef,
        /// Value written (a converted copy of the same graph value).
        output: ValueRef,
        /// The collective.
        collective: Collective,
        /// Spec before.
        from: ShardingSpec,
        /// Spec after.
        to: ShardingSpec,
        /// Bytes as nccl-tests counts them.
        bytes: usize,
        /// Estimated seconds.
        seconds: f64,
        /// The pipeline stage whose ranks run it (0 without stages).
        #[serde(default, skip_serializing_if = "is_zero")]
        stage: usize,
        /// See [`Instr::Op`].
        #[serde(default, skip_serializing_if = "Phase::is_forward")]
        phase: Phase,
        /// See [`Instr::Op`].
        #[serde(default, skip_serializing_if = "is_zero")]
        chunk: usize,
    },
    /// Values no longer needed (on the ranks of `stage`).
    Free {
        /// The values.
        values: Vec<ValueRef>,
        /// The pipeline stage whose ranks free them (0 without stages).
        #[serde(default, skip_serializing_if = "is_zero")]
        stage: usize,
        /// See [`Instr::Op`].
        #[serde(default, skip_serializing_if = "Phase::is_forward")]
        phase: Phase,
        /// See [`Instr::Op`].
        #[serde(default, skip_serializing_if = "is_zero")]
        chunk: usize,
    },
    /// A value sent from the ranks of stage `from` to those of stage `to`: each sender sends
    /// its block to the rank of stage `to` at the same coordinates on the other mesh axes, so
    /// the value keeps its layout (`spec`, which never splits over the stage axis). Both
    /// stages run it, at the same point of their programs.
    Transfer {
        /// The value.
        value: ValueRef,
        /// Its layout on both stages.
        spec: ShardingSpec,
        /// Sending stage.
        from: usize,
        /// Receiving stage.
        to: usize,
        /// Bytes of each rank's block.
        bytes: usize,
        /// Estimated seconds.
        seconds: f64,
        /// The part of a step both stages run it in.
        #[serde(default, skip_serializing_if = "Phase::is_forward")]
        phase: Phase,
        /// The sender's model chunk.
        #[serde(default, skip_serializing_if = "is_zero")]
        from_chunk: usize,
        /// The receiver's model chunk.
        #[serde(default, skip_serializing_if = "is_zero")]
        to_chunk: usize,
    },
}

/// The part of a training step an instruction belongs to. With microbatches, each stage runs
/// its prologue once, then the forward, backward and weight-gradient parts of every microbatch
/// (in the order of the pipeline's [`Schedule`]), and the update part once after all of them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// Work that does not depend on the batch, once per step before the first microbatch:
    /// the parameters' 16-bit copies and their gathers (ZeRO's all-gathers), read by every
    /// microbatch and held until the update phase, as Megatron's distributed optimizer holds
    /// the gathered weights. Only plans of several microbatches have one.
    Prologue,
    /// The forward pass (and everything not split further, in a plan without phases).
    #[default]
    Forward,
    /// The backward pass: with a zero-bubble schedule, only what computes the gradients other
    /// stages wait for (the input gradients); otherwise all of it.
    Backward,
    /// Weight gradients that no other stage waits for (zero-bubble schedules).
    Weight,
    /// The optimizer's update, once per step on the gradients summed over the microbatches.
    Update,
}

impl Phase {
    /// Whether it is [`Phase::Forward`] (the default, not written).
    pub fn is_forward(&self) -> bool {
        *self == Phase::Forward
    }
    /// The letter of a schedule step (`F`, `B`, `W`, `U`; `P` for the prologue).
    pub fn letter(self) -> char {
        match self {
            Phase::Prologue => 'P',
            Phase::Forward => 'F',
            Phase::Backward => 'B',
            Phase::Weight => 'W',
            Phase::Update => 'U',
        }
    }
}

/// Where an instruction runs in a stage's step: its phase and model chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Segment {
    /// The phase.
    pub phase: Phase,
    /// The model chunk.
    pub chunk: usize,
}

impl Segment {
    /// The order of segments within one microbatch on a stage with `chunks` model chunks: the
    /// prologue, the forward chunks first to last, then the backward and weight-gradient
    /// chunks last to first, then the update.
    pub fn rank(self, chunks: usize) -> (u8, usize) {
        let back = chunks.saturating_sub(1).saturating_sub(self.chunk);
        match self.phase {
            Phase::Prologue => (0, 0),
            Phase::Forward => (1, self.chunk),
            Phase::Backward => (2, back),
            Phase::Weight => (3, back),
            Phase::Update => (4, 0),
        }
    }
}

impl Instr {
    /// The segment it runs in on the ranks of `stage` (`None` when they do not run it).
    pub fn segment_on(&self, stage: usize) -> Option<Segment> {
        match self {
            Instr::Op { stage: s, phase, chunk, .. }
            | Instr::Collective { stage: s, phase, chunk, .. }
            | Instr::Free { stage: s, phase, chunk, .. } => {
                (*s == stage).then_some(Segment { phase: *phase, chunk: *chunk })
            }
            Instr::Transfer { from, to, phase, from_chunk, to_chunk, .. } => {
                if *from == stage {
                    Some(Segment { phase: *phase, chunk: *from_chunk })
                } else if *to == stage {
                    Some(Segment { phase: *phase, chunk: *to_chunk })
                } else {
                    None
                }
            }
        }
    }

    /// Sets its phase.
    pub fn set_phase(&mut self, to: Phase) {
        match self {
            Instr::Op { phase, .. }
            | Instr::Collective { phase, .. }
            | Instr::Free { phase, .. }
            | Instr::Transfer { phase, .. } => *phase = to,
        }
    }

    /// Sets its model chunk (a transfer's on both sides).
    pub fn set_chunk(&mut self, to: usize) {
        match self {
            Instr::Op { chunk, .. } | Instr::Collective { chunk, .. } | Instr::Free { chunk, .. } => *chunk = to,
            Instr::Transfer { from_chunk, to_chunk, .. } => (*from_chunk, *to_chunk) = (to, to),
        }
    }

    /// Whether it runs once per step (in the [`Phase::Prologue`] or the [`Phase::Update`]),
    /// not once per microbatch.
    pub fn once_per_step(&self) -> bool {
        matches!(self.phase(), Phase::Prologue | Phase::Update)
    }

    /// Its phase.
    pub fn phase(&self) -> Phase {
        match self {
            Instr::Op { phase, .. }
            | Instr::Collective { phase, .. }
            | Instr::Free { phase, .. }
            | Instr::Transfer { phase, .. } => *phase,
        }
    }

    /// Whether the ranks of `stage` run it (a transfer: as sender or receiver).
    pub fn runs_on(&self, stage: usize) -> bool {
        match self {
            Instr::Op { stage: s, .. } | Instr::Collective { stage: s, .. } | Instr::Free { stage: s, .. } => {
                *s == stage
            }
            Instr::Transfer { from, to, .. } => *from == stage || *to == stage,
        }
    }
}

/// Pipeline stages: the outermost mesh axis is the stage axis; stage `s` is run by the ranks
/// whose first mesh coordinate is `s`, each an SPMD program over the other axes. Layouts never
/// split over the stage axis; values crossing stages move by [`Instr::Transfer`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Pipeline {
    /// Number of stages (the size of mesh axis 0).
    pub stages: usize,
    /// Microbatches per step (the batch is split into this many, gradients accumulate).
    pub microbatches: usize,
    /// Per stage, what it runs and holds.
    pub per_stage: Vec<StageEstimate>,
    /// The order in which each stage runs its microbatches' phases.
    pub schedule: Schedule,
}

/// Which pipeline schedule a plan uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum ScheduleKind {
    /// Each microbatch's forward and backward before the next microbatch starts (no overlap).
    #[serde(rename = "sequential")]
    Sequential,
    /// All forwards, then all backwards (Huang et al. 2019).
    #[serde(rename = "gpipe")]
    Gpipe,
    /// One forward one backward: stage `i` starts `S-1-i` forwards ahead, then alternates
    /// (PipeDream-Flush; Narayanan et al. 2021).
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// 1F1B over several model chunks per stage (virtual stages; Narayanan et al. 2021).
    #[serde(rename = "interleaved")]
    Interleaved,
    /// Zero bubble H1: the backward split into input and weight gradients, the weight
    /// gradients filling the bubbles (Qi et al. 2024).
    #[serde(rename = "zb-h1")]
    ZbH1,
}

impl ScheduleKind {
    /// All of them.
    pub const ALL: [ScheduleKind; 5] = [
        ScheduleKind::Sequential,
        ScheduleKind::Gpipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved,
        ScheduleKind::ZbH1,
    ];
    /// Name as on the command line.
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::Sequential => "sequential",
            ScheduleKind::Gpipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved => "interleaved",
            ScheduleKind::ZbH1 => "zb-h1",
        }
    }
}

impl std::fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for ScheduleKind {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<ScheduleKind, String> {
        ScheduleKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| format!("unknown schedule `{s}` (sequential, gpipe, 1f1b, interleaved, zb-h1)"))
    }
}

/// One step of a stage's schedule: one microbatch's phase of one model chunk. Written `F3`
/// (forward of microbatch 3), `B3`, `W3`, with the chunk after a colon when there are several
/// (`F3:1`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Step {
    /// The microbatch.
    pub microbatch: usize,
    /// The model chunk.
    pub chunk: usize,
    /// The phase (never [`Phase::Update`], which runs once after the steps).
    pub phase: Phase,
}

impl Step {
    /// Its segment.
    pub fn segment(self) -> Segment {
        Segment { phase: self.phase, chunk: self.chunk }
    }
}

impl std::fmt::Display for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}{}", self.phase.letter(), self.microbatch)?;
        if self.chunk > 0 {
            write!(f, ":{}", self.chunk)?;
        }
        Ok(())
    }
}

impl std::str::FromStr for Step {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Step, String> {
        let bad = || format!("`{s}` is not a schedule step (F3, B3, W3, or F3:1 with a chunk)");
        let mut chars = s.chars();
        let phase = match chars.next() {
            Some('F') => Phase::Forward,
            Some('B') => Phase::Backward,
            Some('W') => Phase::Weight,
            _ => return Err(bad()),
        };
        let rest = chars.as_str();
        let (mb, chunk) = match rest.split_once(':') {
            Some((m, c)) => (m, c.parse::<usize>().map_err(|_| bad())?),
            None => (rest, 0),
        };
        if mb.is_empty() || !mb.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        Ok(Step { microbatch: mb.parse().map_err(|_| bad())?, chunk, phase })
    }
}

impl Serialize for Step {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Step {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Step, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl JsonSchema for Step {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Step".into()
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "string",
            "pattern": "^[FBW][0-9]+(:[0-9]+)?$",
            "description": "A microbatch's phase: F3 (forward of microbatch 3), B3 (backward), W3 (weight gradients), with the model chunk after a colon (F3:1)"
        })
    }
}

/// The order of every stage's steps, which the runtime follows exactly.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Schedule {
    /// Which schedule.
    pub kind: ScheduleKind,
    /// Model chunks per stage (more than one: interleaved).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub chunks: usize,
    /// Per stage, its steps in order: every microbatch's forward, backward (and weight
    /// gradient) of every chunk, once. The update phase runs after them.
    pub steps: Vec<Vec<Step>>,
    /// Estimated seconds of the microbatch steps (the first start to the last end over the
    /// stages; [`crate::schedule::timeline`]).
    pub seconds: f64,
    /// Estimated idle fraction of the stages over those seconds (the bubble).
    pub bubble: f64,
}

/// One pipeline stage's share of the plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct StageEstimate {
    /// Op instructions it runs.
    pub ops: usize,
    /// The first and last forward node it runs (by topological order).
    pub first: String,
    /// See `first`.
    pub last: String,
    /// Compute seconds.
    pub compute_seconds: f64,
    /// Seconds of its collectives and conversions.
    pub comm_seconds: f64,
    /// Seconds of the transfers it receives.
    pub transfer_seconds: f64,
    /// Peak bytes per rank of the stage ([`crate::memory::simulate_stage`]).
    pub peak_bytes: u64,
    /// Parameter, optimizer-state and constant bytes per rank of the stage.
    pub resident_bytes: u64,
}

/// Cost of one op in the estimate.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct OpCost {
    /// Node name.
    pub node: String,
    /// Op name.
    pub op: String,
    /// Strategy name.
    pub strategy: String,
    /// Compute seconds.
    pub compute_seconds: f64,
    /// Seconds of its own collectives and of converting its inputs.
    pub comm_seconds: f64,
}

/// Collectives of one kind.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct CollectiveSummary {
    /// Kind (`all-reduce`, ...).
    pub kind: String,
    /// How many.
    pub count: usize,
    /// Bytes in total.
    pub bytes: usize,
    /// Seconds in total.
    pub seconds: f64,
}

/// What the plan is expected to cost.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Estimate {
    /// Seconds per training step: compute + communication, less what overlaps
    /// (`overlapped_comm_seconds`; with stages, the schedule's makespan).
    pub step_seconds: f64,
    /// Compute seconds.
    pub compute_seconds: f64,
    /// Communication seconds.
    pub comm_seconds: f64,
    /// Of `comm_seconds`, those hidden behind compute when the plan's estimate overlaps them
    /// ([`OptionsInfo::overlap`], [`overlap`]); the rest is exposed. 0 without overlap.
    #[serde(default, skip_serializing_if = "is_zero_f64")]
    pub overlapped_comm_seconds: f64,
    /// Seconds of recomputing activations during backward (ops and their conversions).
    #[serde(default)]
    pub recompute_seconds: f64,
    /// What activation checkpointing did.
    #[serde(default)]
    pub checkpoint: CheckpointReport,
    /// Peak bytes per rank: the liveness walk of the program ([`crate::memory::simulate`]),
    /// which is what the runtime holds (conversion copies included).
    pub peak_bytes_per_rank: u64,
    /// The peak in the solver's model (values live from producer to last reader; conversion
    /// copies not counted).
    #[serde(default)]
    pub solver_peak_bytes_per_rank: u64,
    /// Bytes per rank resident for the whole step (parameters, optimizer state, constants).
    pub resident_bytes_per_rank: u64,
    /// Parameters, their 16-bit copies, optimizer state and gradients per rank, by kind.
    #[serde(default)]
    pub memory: memory::Breakdown,
    /// Per op.
    pub per_op: Vec<OpCost>,
    /// Per collective kind.
    pub collectives: Vec<CollectiveSummary>,
    /// FLOPs of one step's training graph, without recomputation (the model FLOPs of MFU); 0
    /// in plans made before it was reported.
    #[serde(default)]
    pub model_flops: f64,
    /// Estimated model FLOPs utilisation: `model_flops` over the step seconds times the
    /// devices' peak rate at the plan's precision (the device profile's).
    #[serde(default)]
    pub mfu: f64,
}

/// How the solver did.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SolverInfo {
    /// Whether the plan is proven optimal (in the cost model).
    pub status: SolveStatus,
    /// The solver's objective, seconds.
    pub objective_seconds: f64,
    /// Its lower bound, seconds.
    pub lower_bound_seconds: f64,
    /// Wall time of all solves, seconds.
    pub seconds: f64,
    /// Problem nodes.
    pub nodes: usize,
    /// Problem edges.
    pub edges: usize,
    /// Nodes tied to the same node of the previous repeated layer.
    #[serde(default)]
    pub tied: usize,
    /// Strategies kept in the problem (after baseline pinning).
    pub strategies: usize,
    /// Which restriction gave the chosen plan (with `auto`, possibly a baseline).
    pub chosen: Baseline,
    /// Step seconds of each plan solved (auto and the baselines compared), by name; `None`
    /// for one that does not fit the budget.
    pub compared: BTreeMap<String, Option<f64>>,
    /// Baselines not solved for lack of time (`--time-limit`): their share of the time left was
    /// less than what their solve was expected to take beyond its search.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<String>,
    /// Solver rounds: more than one when stage two sent the solver back with a tighter budget.
    #[serde(default)]
    pub rounds: usize,
    /// Size of the chosen restriction's problem at each stage: `built` (one node per op),
    /// `merged` (after exact ties and follow-op merging), `tied` (after sharing repeated
    /// layers' decisions). The status and bound are over the plans the last one allows.
    #[serde(default)]
    pub sizes: BTreeMap<String, Size>,
    /// Wall seconds of each planning stage (`build`, `solve auto`, `solve dp`, ..., `lower`).
    #[serde(default)]
    pub timings: BTreeMap<String, f64>,
    /// A lower bound on the step seconds of every plan the whole search considers: each stage
    /// count, schedule, recomputation and layout it could choose, whether it was solved, cut
    /// short or skipped for lack of time (see `codegen::bound`). The plan's certified gap is
    /// `1 - plan_bound_seconds / estimate.step_seconds`. 0 in plans made before it existed.
    #[serde(default)]
    pub plan_bound_seconds: f64,
    /// Layout conversion prices (source layout, target layout, tensor) in the chosen problem
    /// that were taken from a direct path (reduce, gather, then slice: never cheaper than the
    /// search's) because building the problem ran past `--time-limit`. The plan's own
    /// conversions are still the search's; the solver's objective and bound are over these
    /// prices. 0 when every price is the search's.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub estimated_conversions: usize,
}

/// A distributed training plan (see the crate docs).
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct Plan {
    /// Format version ([`VERSION`]).
    pub version: u32,
    /// The model.
    pub model: ModelInfo,
    /// The mesh.
    pub mesh: MeshInfo,
    /// Device profile name.
    pub device: String,
    /// Options.
    pub options: OptionsInfo,
    /// The training graph (JSON form of `ir`'s graph, without parameter data); node `%i` is
    /// program node `i` (nodes are numbered in topological order).
    #[schemars(with = "form::GraphForm")]
    pub graph: ir::Graph,
    /// Microbatches per step: the graph is one microbatch's (its inputs' first dim is the
    /// microbatch), a step feeds `microbatches` of them, runs the [`Phase::Prologue`] once,
    /// the instructions of every other phase but [`Phase::Update`] once per microbatch (in the
    /// order of the pipeline's schedule, or one microbatch after the other), sums the
    /// `accumulate` values (and the outputs) over them, and then runs the update phase once. The graph's gradients are scaled by
    /// 1/`microbatches`, so the sums are the gradients of the mean loss; the outputs are
    /// averaged.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub microbatches: usize,
    /// The values summed over microbatches: written before the update phase, read in it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub accumulate: Vec<ValueRef>,
    /// Pipeline stages (`None`: one SPMD program over the whole mesh).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<Pipeline>,
    /// Parameter and optimizer-state layouts.
    pub params: Vec<ParamShard>,
    /// The SPMD program.
    pub program: Vec<Instr>,
    /// Estimates.
    pub estimate: Estimate,
    /// Solver report.
    pub solver: SolverInfo,
}

/// Serde of an instruction's op: a constant's value is not repeated (see [`Instr::Op`]).
mod instr_op {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(op: &ir::Op, s: S) -> Result<S::Ok, S::Error> {
        match op {
            ir::Op::Constant(_) => s.serialize_str("const"),
            op => op.serialize(s),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<ir::Op, D::Error> {
        let v = serde_json::Value::deserialize(d)?;
        if v.as_str() == Some("const") {
            return Ok(placeholder());
        }
        serde_json::from_value(v).map_err(serde::de::Error::custom)
    }

    /// What a constant's instruction holds until its value is taken from the graph.
    pub fn placeholder() -> ir::Op {
        ir::Op::Constant(ir::Tensor::f32([0], vec![]))
    }
}

/// FNV-1a of a text, 16 hex digits (the model hash of [`ModelInfo::hash`]).
pub fn fnv(s: &str) -> String {
    let h = s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3));
    format!("{h:016x}")
}

/// Just the version, read before the rest (a plan of another version may have other fields).
#[derive(Deserialize)]
struct Versioned {
    version: Option<u64>,
}

/// Where serde stopped in a plan, as people read it: `instruction 12: inputs[0]` for
/// `program[12].inputs[0]`.
fn location(path: &serde_path_to_error::Path) -> String {
    let p = path.to_string();
    if let Some(rest) = p.strip_prefix("program[")
        && let Some((k, rest)) = rest.split_once(']')
    {
        let rest = rest.trim_start_matches('.');
        return if rest.is_empty() { format!("instruction {k}") } else { format!("instruction {k}: {rest}") };
    }
    p
}

impl Plan {
    /// The plan as pretty JSON. An error only for what JSON cannot hold (a NaN or infinite
    /// estimate).
    pub fn to_json(&self) -> Result<String> {
        pretty::to_string(self).map_err(|e| Error::Serialize(e.to_string()))
    }

    /// Reads and validates a plan (see the crate docs): the version first, then every field's
    /// type and form, then [`Plan::validate`].
    pub fn from_json(text: &str) -> Result<Plan> {
        Ok(Valid::from_json(text)?.into_plan())
    }

    /// Reads a plan without validating it (for tools that show or repair plans).
    pub fn parse(text: &str) -> Result<Plan> {
        // The version is read on its own only when the plan does not read as this version's
        // (a plan of another version may have other fields): one pass over a good plan.
        let version = || -> Result<()> {
            let v: Versioned = serde_json::from_str(text).map_err(|e| Error::NotJson(e.to_string()))?;
            match v.version {
                Some(x) if (OLDEST_READ as u64..=VERSION as u64).contains(&x) => Ok(()),
                Some(found) => Err(Error::Version { found, supported: VERSION }),
                None => Err(Error::NoVersion),
            }
        };
        let de = &mut serde_json::Deserializer::from_str(text);
        let mut plan: Plan = match serde_path_to_error::deserialize(de) {
            Ok(p) => p,
            Err(e) => {
                version()?;
                let at = location(e.path());
                let why = e.into_inner().to_string();
                // serde_json appends " at line L column C": keep it, it finds the spot in the file.
                return Err(Error::Malformed { at, why });
            }
        };
        if !(OLDEST_READ..=VERSION).contains(&plan.version) {
            return Err(Error::Version { found: plan.version as u64, supported: VERSION });
        }
        // An older plan reads as this version (their fields differ only in type, not in JSON).
        plan.version = VERSION;
        // Constants' values, written once (in the graph).
        for ins in &mut plan.program {
            if let Instr::Op { node, op: op @ ir::Op::Constant(_), .. } = ins
                && let Some(n) = plan.graph.g.node_weight(ir::NodeIndex::new(*node))
                && let ir::Op::Constant(_) = n.op
            {
                *op = n.op.clone();
            }
        }
        Ok(plan)
    }

    /// Model chunks per stage (1 without an interleaved schedule).
    pub fn chunks(&self) -> usize {
        self.pipeline.as_ref().map_or(1, |p| p.schedule.chunks.max(1))
    }

    /// Each stage's steps: the pipeline's schedule, or (without stages) the microbatches one
    /// after the other, each running its phases in segment order.
    pub fn steps(&self) -> Vec<Vec<Step>> {
        match &self.pipeline {
            Some(p) => p.schedule.steps.clone(),
            None => vec![schedule::sequential(self.microbatches, 1, true)],
        }
    }

    /// Number of pipeline stages (1 without).
    pub fn stages(&self) -> usize {
        self.pipeline.as_ref().map_or(1, |p| p.stages)
    }

    /// The stage of `rank` (0 without stages): its coordinate on mesh axis 0.
    pub fn stage_of(&self, rank: usize) -> usize {
        let s = self.stages();
        if s <= 1 { 0 } else { rank / (self.mesh.shape.iter().product::<usize>() / s).max(1) }
    }

    /// The mesh of the plan.
    pub fn device_mesh(&self) -> std::result::Result<DeviceMesh, sharding::Error> {
        DeviceMesh::new(self.mesh.shape.clone(), self.mesh.names.clone(), self.mesh.links.clone())
    }
}

/// The JSON Schema of [`Plan`] (draft 2020-12), pretty-printed: what `plan.schema.json` holds.
pub fn json_schema() -> String {
    let schema = schemars::schema_for!(Plan);
    serde_json::to_string_pretty(&schema).expect("a schema is JSON") + "\n"
}
