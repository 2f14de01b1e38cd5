//! The single-device interpreter: a bare graph compiled as the one-rank [`Program`] and run
//! by the executor every back end shares, on the CPU back end ([`crate::cpu`]).

use std::collections::BTreeMap;

use ir::{Graph, NodeIndex, Op, Tensor};

use crate::cpu::{Cpu, CpuBackend};
use crate::error::DistError;
use crate::program::{Program, StepKey};
use crate::values::widens;
use crate::{bounds, comm, exec};

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
/// program ([`Program`]) and run by the executor every back end shares.
pub struct Interpreter<'g> {
    graph: &'g Graph,
    order: Vec<NodeIndex>,
    program: Program,
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
        let (program, constants) = Program::single(graph, &order);
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
    pub fn run(&self, cpu: &Cpu, feeds: &BTreeMap<String, Tensor>) -> Result<RunReport, RunError> {
        self.run_with_params(cpu, feeds, &self.graph.param_data)
    }

    /// Runs the graph with parameters taken from `params` (by parameter name). Nothing random
    /// is drawn: dropout keeps everything, as in inference ([`Interpreter::run_step`] trains).
    pub fn run_with_params(
        &self,
        cpu: &Cpu,
        feeds: &BTreeMap<String, Tensor>,
        params: &BTreeMap<String, Tensor>,
    ) -> Result<RunReport, RunError> {
        self.run_mode(cpu, feeds, params, exec::Mode::Train(None))
    }

    /// [`Interpreter::run_with_params`] as training step `key.step` of a run with seed
    /// `key.seed`: dropout draws its masks from that step's stream (`ir::ops::random`), the
    /// same masks any plan of the graph draws at that step.
    pub fn run_step(
        &self,
        cpu: &Cpu,
        feeds: &BTreeMap<String, Tensor>,
        params: &BTreeMap<String, Tensor>,
        key: StepKey,
    ) -> Result<RunReport, RunError> {
        self.run_mode(cpu, feeds, params, exec::Mode::Train(Some(key)))
    }

    /// Only what the graph's `loss` output depends on, with parameters from `params`: the loss
    /// of a training graph without its backward pass and update (no updates come back).
    pub fn eval_with_params(
        &self,
        cpu: &Cpu,
        feeds: &BTreeMap<String, Tensor>,
        params: &BTreeMap<String, Tensor>,
    ) -> Result<RunReport, RunError> {
        self.run_mode(cpu, feeds, params, exec::Mode::Eval)
    }

    fn run_mode(
        &self,
        cpu: &Cpu,
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
        let mut b = CpuBackend { rank: 0, ctx: cpu.context(), comm: &mut solo };
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
    fn run_error(&self, e: DistError) -> RunError {
        match e {
            DistError::Kernel { node, message, .. } => {
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
