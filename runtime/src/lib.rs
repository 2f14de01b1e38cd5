//! Executes autopar graphs.
//!
//! One executor runs everything: `exec::step` walks a compiled [`dist::Program`] over a back end
//! (host tensors and CPU kernels, or device tensors, CUDA kernels and NCCL). A distributed plan
//! compiles to one program per mesh; a bare graph compiles to the one-rank program, which is
//! what [`Interpreter`] runs on one CPU device: nodes in the graph's topological order, each
//! through [`kernels::cpu::eval`], every intermediate freed right after its last use, a reshape
//! of a value read for the last time made a view of it. It reports the peak bytes it held
//! (inputs and intermediates; parameters and constants are counted separately because they
//! stay resident).
//!
//! Training graphs run the same way: their [`ir::Op::State`] nodes read the same name-keyed map as
//! parameters, and the new values of [`ir::Graph::updates`] come back in [`RunReport::updates`];
//! [`train::Trainer`] keeps them between steps.
//!
//! Distributed execution: [`dist`] compiles a plan (the `plan` crate's format; this crate never
//! links the planner or the solver) into a per-rank [`dist::Program`] and runs
//! its steps; [`comm`] has the [`comm::Communicator`] trait and its `threads` back end (ranks as
//! threads, deterministic reductions, abort and timeout instead of hangs), `mpi_comm` the `mpi`
//! one (feature `mpi`); [`launch`] runs steps on every rank with checkpoints ([`checkpoint`]) and
//! fault handling. `gpu` (feature `cuda`) runs the same compiled program on one GPU per rank,
//! with the CUDA kernels and NCCL collectives (the `nccl` back end). [`data`] streams datasets
//! into the inputs: before each step every rank reads only the rows of its input blocks, in an
//! epoch order that is a function of the step and a seed (so checkpoints resume it exactly).
//! An evaluation step runs only the instructions the `loss` output depends on, with the
//! parameters borrowed, so held-out losses come from the same plan without an update.
//!
//! Invariants: feeds must match the graph inputs' metas exactly; a parameter without data is an
//! error (weight-free models can be planned, not run, until they are initialised).
//!
//! # Adding a back end
//!
//! A back end is a transport for host tensors (a [`comm::Communicator`], as `mpi`), or a
//! device with its own tensors (an `exec` `Backend` and a [`launch::Rank`], as `nccl`'s GPU
//! ranks). Either way the ranks run the one walk, `exec::step`, and the one loop,
//! [`launch::rank_loop`]; never fork them:
//!
//! | step | file | what to do | what checks it |
//! |---|---|---|---|
//! | transport | `runtime/src/comm.rs` | implement `Communicator`: `rank`, `size`, `exchange`, `exchange_pieces`, `abort`; override `all_reduce`, `all_gather`, tagged `send` / `recv`, `prepare`, `check` where the library does better (as `MpiComm`, `runtime/src/mpi_comm.rs`); `CpuBackend` and `CpuRank` then run it unchanged | `comm::tests::threads_match_the_simulation`, `comm::tests::abort_reaches_every_rank` (their pattern) |
//! | device | `runtime/src/exec.rs` | implement the crate-private `Backend` trait: `T`, `eval`, `collective`, `gather_output`, `send` / `recv`, `download`, and `reshape`, `copy`, `sync`, `peak_bytes` where the device differs; models: `CpuBackend` (`runtime/src/dist.rs`), `GpuExec` (`runtime/src/gpu.rs`) | `one_rank_on_a_device_matches_threads` (`tests/cli_gpu.rs`) |
//! | rank | `runtime/src/launch/mod.rs` | implement `Rank` (`step`, `report`, `checkpoint`, `eval`, `set_feed_blocks`, `poison`) as `CpuRank` and `gpu::GpuRank` do | `a_resumed_run_continues_bit_exactly` (`runtime/tests/launch.rs`) |
//! | launcher | `runtime/src/launch/<name>.rs`, `runtime/src/launch/mod.rs` | a function beside `threads`, `mpi` (`runtime/src/launch/mpi.rs`), `nccl` (`runtime/src/launch/nccl.rs`) that starts the ranks and returns `Finished` or a `LaunchError`, with a stub under `#[cfg(not(feature = ...))]` saying how to rebuild; refuse what it cannot run before any rank starts (`Program::needs_buffered_sends`, as `nccl` does) | `a_failing_rank_stops_the_run_with_its_own_error`, `invalid_plans_are_refused_before_any_rank_starts` (`runtime/tests/launch.rs`) |
//! | feature | `runtime/Cargo.toml`, `Cargo.toml`, `runtime/src/lib.rs`, `scripts/test` | a feature in both manifests (as `mpi`, `cuda`), the module behind `#[cfg(feature = ...)]`, its clippy and test lines in `scripts/test`; no model reader among the dependencies | the `cargo tree -p runtime` check in `scripts/test` |
//! | CLI | `src/cmd/run.rs`, `src/cmd/profile.rs` | a variant of the `Backend` enum (`--backend`, a clap `ValueEnum`), its arm in `run`'s `match a.backend` in both files (`profile` may refuse, as it does `nccl`) | `mpi_runs_equal_single_device` (`tests/cli_mpi.rs`), `two_ranks_on_two_gpus_match_threads` (`tests/cli_gpu.rs`): a `[[test]]` of its own with `required-features` in `Cargo.toml` |
#![warn(missing_docs)]

pub mod bounds;
pub mod checkpoint;
pub mod comm;
pub mod data;
pub mod dist;
mod exec;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod launch;
#[cfg(feature = "mpi")]
pub mod mpi_comm;
pub mod npy;
pub mod outputs;
pub mod params;
pub mod train;
pub mod weights;

use std::collections::BTreeMap;

use ir::{DType, Graph, NodeIndex, Op, Tensor};
use kernels::cpu::CpuContext;

/// True when data of `from` is taken, widened, where `to` is expected: f32 weights and feed files
/// for a graph made f64 (`--precision f64`). Never the reverse: an f64 file for an f32 model is a
/// mismatch, not a silent rounding.
pub(crate) fn widens(from: DType, to: DType) -> bool {
    from == DType::F32 && to == DType::F64
}

/// The first element of a float scalar (the loss) as f32; NaN for anything else.
pub fn scalar_f32(t: &Tensor) -> f32 {
    match t.data() {
        ir::Data::F32(v) => v.first().copied().unwrap_or(f32::NAN),
        ir::Data::F64(v) => v.first().map(|&x| x as f32).unwrap_or(f32::NAN),
        _ => f32::NAN,
    }
}

/// Why a run failed. Feed and parameter problems are the user's input; `Kernel` names the node.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// A graph input was not fed.
    #[error("missing feed for input {name} (expects {expected}); pass it with --feed {name}=FILE.npy")]
    MissingFeed {
        /// Input name.
        name: String,
        /// Its meta.
        expected: String,
    },
    /// A feed names no graph input.
    #[error("--feed {name}: the model has no input of that name (inputs: {inputs})")]
    UnknownFeed {
        /// Feed name.
        name: String,
        /// The graph's input names.
        inputs: String,
    },
    /// A feed's dtype or shape differs from the input's.
    #[error("feed {name} is {got} but the input expects {expected}")]
    FeedMismatch {
        /// Input name.
        name: String,
        /// What was fed.
        got: String,
        /// What the input expects.
        expected: String,
    },
    /// A parameter has no data (weight-free model).
    #[error("parameter {name} has no data (the model is weight-free); it can be planned but not run")]
    MissingParam {
        /// Parameter name.
        name: String,
    },
    /// A state tensor (optimizer moment, step counter) has no value.
    #[error("state {name} has no value")]
    MissingState {
        /// State name.
        name: String,
    },
    /// A kernel failed.
    #[error("node {node} ({op}): {message}")]
    Kernel {
        /// Node name.
        node: String,
        /// Op name.
        op: &'static str,
        /// Kernel message.
        message: String,
    },
    /// Fed data that cannot be right: a token id or label outside the table or classes it
    /// indexes, a NaN in a training batch ([`bounds`]). Names the input and the value.
    #[error("{0}")]
    BadData(String),
    /// Memory the graph sizes (a parameter, an optimizer state, a feed's copy) that the system
    /// refused.
    #[error("{what}: {error}")]
    Alloc {
        /// What was allocated (names the tensor).
        what: String,
        /// The bytes refused.
        error: ir::AllocError,
    },
    /// The graph has a cycle (it was not verified).
    #[error("graph has a cycle through node {0}")]
    Cycle(String),
}

/// Result of one forward run.
#[derive(Debug)]
pub struct RunReport {
    /// Graph outputs by name.
    pub outputs: BTreeMap<String, Tensor>,
    /// Peak bytes of inputs and intermediates held at once.
    pub peak_bytes: usize,
    /// Bytes of the parameters and state (resident throughout).
    pub param_bytes: usize,
    /// New values of the updated params and states ([`ir::Graph::updates`]), by storage name.
    pub updates: BTreeMap<String, Tensor>,
    /// Seconds spent in each node's kernel, in schedule order (only with
    /// [`Interpreter::with_profiling`]).
    pub node_seconds: Vec<(NodeIndex, f64)>,
}

/// A single-device interpreter with a fixed schedule: the graph compiled as the one-rank
/// program ([`dist::Program`]) and run by the executor every back end shares.
pub struct Interpreter<'g> {
    graph: &'g Graph,
    order: Vec<NodeIndex>,
    program: dist::Program,
    /// The constant nodes, in the order the program reads them.
    constants: Vec<NodeIndex>,
    /// The inputs whose values index a table, checked on every feed ([`bounds`]).
    bounds: Vec<bounds::IndexBound>,
    profile: bool,
}

impl<'g> Interpreter<'g> {
    /// Schedules `graph` (topological order) and compiles it.
    pub fn new(graph: &'g Graph) -> Result<Self, RunError> {
        let order = graph.topo_order().map_err(|n| RunError::Cycle(graph.node(n).name.clone()))?;
        let (program, constants) = dist::Program::single(graph, &order);
        let bounds = bounds::index_bounds(graph);
        Ok(Interpreter { graph, order, program, constants, bounds, profile: false })
    }

    /// Also time every kernel ([`RunReport::node_seconds`]).
    pub fn with_profiling(mut self, on: bool) -> Self {
        self.profile = on;
        self
    }

    /// The schedule.
    pub fn order(&self) -> &[NodeIndex] {
        &self.order
    }

    /// Runs the graph on `feeds` (by input name) with the graph's own parameter data.
    pub fn run(&self, ctx: &CpuContext, feeds: &BTreeMap<String, Tensor>) -> Result<RunReport, RunError> {
        self.run_with_params(ctx, feeds, &self.graph.param_data)
    }

    /// Runs the graph with parameters taken from `params` (by parameter name). Nothing random
    /// is drawn: dropout keeps everything, as in inference ([`Interpreter::run_step`] trains).
    pub fn run_with_params(
        &self,
        ctx: &CpuContext,
        feeds: &BTreeMap<String, Tensor>,
        params: &BTreeMap<String, Tensor>,
    ) -> Result<RunReport, RunError> {
        self.run_mode(ctx, feeds, params, exec::Mode::Train(None))
    }

    /// [`Interpreter::run_with_params`] as training step `key.step` of a run with seed
    /// `key.seed`: dropout draws its masks from that step's stream (`ir::ops::random`), the
    /// same masks any plan of the graph draws at that step.
    pub fn run_step(
        &self,
        ctx: &CpuContext,
        feeds: &BTreeMap<String, Tensor>,
        params: &BTreeMap<String, Tensor>,
        key: dist::StepKey,
    ) -> Result<RunReport, RunError> {
        self.run_mode(ctx, feeds, params, exec::Mode::Train(Some(key)))
    }

    /// Only what the graph's `loss` output depends on, with parameters from `params`: the loss
    /// of a training graph without its backward pass and update (no updates come back).
    pub fn eval_with_params(
        &self,
        ctx: &CpuContext,
        feeds: &BTreeMap<String, Tensor>,
        params: &BTreeMap<String, Tensor>,
    ) -> Result<RunReport, RunError> {
        self.run_mode(ctx, feeds, params, exec::Mode::Eval)
    }

    fn run_mode(
        &self,
        ctx: &CpuContext,
        feeds: &BTreeMap<String, Tensor>,
        params: &BTreeMap<String, Tensor>,
        mode: exec::Mode,
    ) -> Result<RunReport, RunError> {
        let p = &self.program;
        for name in feeds.keys() {
            if !p.inputs.iter().any(|i| &i.name == name) {
                let inputs: Vec<&str> = p.inputs.iter().map(|i| i.name.as_str()).collect();
                return Err(RunError::UnknownFeed { name: name.clone(), inputs: inputs.join(", ") });
            }
        }
        // Feeds in the program's order; f32 data for an f64 graph is widened.
        let mut widened: Vec<Option<Tensor>> = Vec::with_capacity(p.inputs.len());
        for i in &p.inputs {
            let expected = &i.meta;
            let t = feeds
                .get(&i.name)
                .ok_or_else(|| RunError::MissingFeed { name: i.name.clone(), expected: expected.to_string() })?;
            let widen = widens(t.dtype(), expected.dtype);
            if t.shape() != expected.shape.as_slice() || (t.dtype() != expected.dtype && !widen) {
                return Err(RunError::FeedMismatch {
                    name: i.name.clone(),
                    got: t.meta().to_string(),
                    expected: expected.to_string(),
                });
            }
            widened.push(widen.then(|| t.clone().with_float_type(expected.dtype)));
        }
        let fed: Vec<&Tensor> =
            p.inputs.iter().zip(&widened).map(|(i, w)| w.as_ref().unwrap_or(&feeds[&i.name])).collect();
        bounds::check_all(&self.bounds, p.inputs.iter().map(|i| i.name.as_str()).zip(fed.iter().copied()))
            .map_err(RunError::BadData)?;
        for r in &p.resident {
            if !params.contains_key(&r.name) {
                return Err(if r.is_state {
                    RunError::MissingState { name: r.name.clone() }
                } else {
                    RunError::MissingParam { name: r.name.clone() }
                });
            }
        }
        let constants: Vec<&Tensor> = self
            .constants
            .iter()
            .map(|&n| match &self.graph.node(n).op {
                Op::Constant(t) => t,
                _ => unreachable!("constant nodes are listed by Program::single"),
            })
            .collect();
        let mut updates = BTreeMap::new();
        let storage = exec::Storage::Borrowed { params, updates: &mut updates };
        let mut solo = comm::Solo;
        let mut b = dist::CpuBackend { rank: 0, ctx, comm: &mut solo };
        let r = exec::step(p, &mut b, storage, &fed, &constants, self.profile, mode).map_err(|e| self.run_error(e))?;
        let const_bytes: u64 = constants.iter().map(|t| t.bytes() as u64).sum();
        Ok(RunReport {
            outputs: r.outputs,
            peak_bytes: r.peak_bytes.saturating_sub(r.resident_bytes) as usize,
            param_bytes: r.resident_bytes.saturating_sub(const_bytes) as usize,
            updates,
            node_seconds: r.op_seconds.into_iter().map(|(id, t)| (self.order[id], t)).collect(),
        })
    }

    /// A failed step as a run error (a kernel names its node).
    fn run_error(&self, e: dist::DistError) -> RunError {
        match e {
            dist::DistError::Kernel { node, message, .. } => {
                let op = self
                    .order
                    .iter()
                    .map(|&n| self.graph.node(n))
                    .find(|n| n.name == node)
                    .map_or("?", |n| n.op.name());
                RunError::Kernel { node, op, message }
            }
            other => RunError::Kernel { node: self.graph.name.clone(), op: "step", message: other.to_string() },
        }
    }
}
