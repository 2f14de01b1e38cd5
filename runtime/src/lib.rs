//! Executes autopar graphs.
//!
//! [`Interpreter`] runs an [`ir::Graph`] on one CPU device: nodes in the graph's topological
//! order, each through [`kernels::cpu::eval`], every intermediate freed right after its last
//! use. It reports the peak bytes it held (inputs and intermediates; parameters are counted
//! separately because they stay resident).
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
//! with the CUDA kernels and NCCL collectives (the `nccl` back end).
//!
//! Invariants: feeds must match the graph inputs' metas exactly; a parameter without data is an
//! error (weight-free models can be planned, not run, until they are initialised).
#![warn(missing_docs)]

pub mod checkpoint;
pub mod comm;
pub mod dist;
mod exec;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod launch;
#[cfg(feature = "mpi")]
pub mod mpi_comm;
pub mod npy;
pub mod profile;
pub mod train;

use std::collections::{BTreeMap, HashMap};

use ir::{DType, Graph, NodeIndex, Op, Tensor, Value};
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

/// A single-device interpreter with a fixed schedule.
pub struct Interpreter<'g> {
    graph: &'g Graph,
    order: Vec<NodeIndex>,
    /// For each value, the schedule position of its last reader (`usize::MAX`: a graph output).
    last_use: HashMap<Value, usize>,
    inputs: HashMap<NodeIndex, Vec<Value>>,
    profile: bool,
}

enum Held<'a> {
    Borrowed(&'a Tensor),
    Owned(Tensor),
}

impl Held<'_> {
    fn get(&self) -> &Tensor {
        match self {
            Held::Borrowed(t) => t,
            Held::Owned(t) => t,
        }
    }
}

impl<'g> Interpreter<'g> {
    /// Schedules `graph` (topological order) and computes last uses.
    pub fn new(graph: &'g Graph) -> Result<Self, RunError> {
        let order = graph.topo_order().map_err(|n| RunError::Cycle(graph.node(n).name.clone()))?;
        let mut last_use = HashMap::new();
        let mut inputs = HashMap::new();
        for (pos, &n) in order.iter().enumerate() {
            let ins = graph.node_inputs(n);
            for &v in &ins {
                last_use.insert(v, pos);
            }
            inputs.insert(n, ins);
        }
        for (_, v) in &graph.outputs {
            last_use.insert(*v, usize::MAX);
        }
        for (_, v) in &graph.updates {
            last_use.insert(*v, usize::MAX);
        }
        Ok(Interpreter { graph, order, last_use, inputs, profile: false })
    }

    /// Also time every kernel ([`RunReport::node_seconds`]).
    pub fn with_profiling(mut self, on: bool) -> Self {
        self.profile = on;
        self
    }

    /// True when node `n` (at schedule position `pos`) has one input, held as an owned tensor
    /// that no later node or output reads.
    fn is_last_owned_use(&self, vals: &HashMap<Value, Held>, n: NodeIndex, pos: usize) -> bool {
        match self.inputs[&n].as_slice() {
            [v] => self.last_use.get(v) == Some(&pos) && matches!(vals.get(v), Some(Held::Owned(_))),
            _ => false,
        }
    }

    /// The schedule.
    pub fn order(&self) -> &[NodeIndex] {
        &self.order
    }

    /// Runs the graph on `feeds` (by input name) with the graph's own parameter data.
    pub fn run(&self, ctx: &CpuContext, feeds: &BTreeMap<String, Tensor>) -> Result<RunReport, RunError> {
        self.run_with_params(ctx, feeds, &self.graph.param_data)
    }

    /// Runs the graph with parameters taken from `params` (by parameter name).
    pub fn run_with_params(
        &self,
        ctx: &CpuContext,
        feeds: &BTreeMap<String, Tensor>,
        params: &BTreeMap<String, Tensor>,
    ) -> Result<RunReport, RunError> {
        let g = self.graph;
        let input_names: Vec<String> = g
            .inputs
            .iter()
            .filter_map(|&i| match &g.node(i).op {
                Op::Input { name } => Some(name.clone()),
                _ => None,
            })
            .collect();
        for name in feeds.keys() {
            if !input_names.contains(name) {
                return Err(RunError::UnknownFeed { name: name.clone(), inputs: input_names.join(", ") });
            }
        }
        let mut vals: HashMap<Value, Held> = HashMap::new();
        let mut live = 0usize;
        let mut peak = 0usize;
        let mut param_bytes = 0usize;
        let mut node_seconds = Vec::new();
        for (pos, &n) in self.order.iter().enumerate() {
            let node = g.node(n);
            let out: Vec<Held> = match &node.op {
                Op::Input { name } => {
                    let expected = &node.outputs[0];
                    let t = feeds
                        .get(name)
                        .ok_or_else(|| RunError::MissingFeed { name: name.clone(), expected: expected.to_string() })?;
                    let widen = widens(t.dtype(), expected.dtype);
                    if t.shape() != expected.shape.as_slice() || (t.dtype() != expected.dtype && !widen) {
                        return Err(RunError::FeedMismatch {
                            name: name.clone(),
                            got: t.meta().to_string(),
                            expected: expected.to_string(),
                        });
                    }
                    live += expected.bytes();
                    if widen {
                        vec![Held::Owned(t.clone().with_float_type(expected.dtype))]
                    } else {
                        vec![Held::Borrowed(t)]
                    }
                }
                Op::Param { name } => {
                    let t = params.get(name).ok_or_else(|| RunError::MissingParam { name: name.clone() })?;
                    param_bytes += t.bytes();
                    vec![Held::Borrowed(t)]
                }
                Op::State { name } => {
                    let t = params.get(name).ok_or_else(|| RunError::MissingState { name: name.clone() })?;
                    param_bytes += t.bytes();
                    vec![Held::Borrowed(t)]
                }
                Op::Constant(t) => vec![Held::Borrowed(t)],
                Op::Reshape { shape } if self.is_last_owned_use(&vals, n, pos) => {
                    // A view: reuse the buffer of an input nobody reads after this node.
                    let v = self.inputs[&n][0];
                    let Some(Held::Owned(t)) = vals.remove(&v) else { unreachable!("checked by is_last_owned_use") };
                    let t = t.reshaped(shape.clone()).map_err(|e| RunError::Kernel {
                        node: node.name.clone(),
                        op: "reshape",
                        message: e.to_string(),
                    })?;
                    vec![Held::Owned(t)]
                }
                op => {
                    let ins = &self.inputs[&n];
                    let ts: Vec<&Tensor> = ins.iter().map(|v| vals[v].get()).collect();
                    let t0 = self.profile.then(std::time::Instant::now);
                    let outs = kernels::cpu::eval(ctx, op, &ts).map_err(|e| RunError::Kernel {
                        node: node.name.clone(),
                        op: op.name(),
                        message: e.to_string(),
                    })?;
                    if let Some(t0) = t0 {
                        node_seconds.push((n, t0.elapsed().as_secs_f64()));
                    }
                    for t in &outs {
                        live += t.bytes();
                    }
                    outs.into_iter().map(Held::Owned).collect()
                }
            };
            for (slot, h) in out.into_iter().enumerate() {
                vals.insert(Value::new(n, slot), h);
            }
            peak = peak.max(live);
            // Free what this node read for the last time, and outputs nobody reads.
            let mut dead: Vec<Value> =
                self.inputs[&n].iter().copied().filter(|v| self.last_use.get(v) == Some(&pos)).collect();
            dead.extend((0..node.outputs.len()).map(|s| Value::new(n, s)).filter(|v| !self.last_use.contains_key(v)));
            dead.sort();
            dead.dedup();
            for v in dead {
                if let Some(h) = vals.remove(&v) {
                    let is_param_or_const =
                        matches!(g.node(v.node).op, Op::Param { .. } | Op::State { .. } | Op::Constant(_));
                    if !is_param_or_const {
                        live -= h.get().bytes();
                    }
                }
            }
        }
        // Hand results over without copying: a value read once more is cloned, the last read moves.
        let mut reads: HashMap<Value, usize> = HashMap::new();
        for v in g.outputs.iter().map(|(_, v)| v).chain(g.updates.iter().map(|(_, v)| v)) {
            *reads.entry(*v).or_default() += 1;
        }
        let mut take = |v: Value, node: &str, what: &'static str| -> Result<Tensor, RunError> {
            let left = reads.get_mut(&v).expect("counted above");
            *left -= 1;
            let missing =
                || RunError::Kernel { node: node.to_string(), op: what, message: "value was not computed".into() };
            if *left > 0 {
                return vals.get(&v).map(|h| h.get().clone()).ok_or_else(missing);
            }
            match vals.remove(&v).ok_or_else(missing)? {
                Held::Owned(t) => Ok(t),
                Held::Borrowed(t) => Ok(t.clone()),
            }
        };
        let mut outputs = BTreeMap::new();
        for (name, v) in &g.outputs {
            outputs.insert(name.clone(), take(*v, name, "output")?);
        }
        let mut updates = BTreeMap::new();
        for &(src, v) in &g.updates {
            if let Op::Param { name } | Op::State { name } = &g.node(src).op {
                updates.insert(name.clone(), take(v, &g.node(src).name, "update")?);
            }
        }
        Ok(RunReport { outputs, peak_bytes: peak, param_bytes, updates, node_seconds })
    }
}
