//! The graph container and its builder API.

use std::collections::{BTreeMap, HashMap};

use petgraph::Direction;
use petgraph::stable_graph::{NodeIndex, StableGraph};
use petgraph::visit::EdgeRef;

use crate::op::Op;
use crate::tensor::{DType, Tensor, TensorMeta};

/// One output of one node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Value {
    /// Producer.
    pub node: NodeIndex,
    /// Output slot of the producer.
    pub slot: usize,
}

impl Value {
    /// Output `slot` of `node`.
    pub fn new(node: NodeIndex, slot: usize) -> Value {
        Value { node, slot }
    }
}

/// Edge weight: which producer output feeds which consumer input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Edge {
    /// Producer output slot.
    pub src_slot: usize,
    /// Consumer input slot.
    pub dst_slot: usize,
}

/// An operator instance.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    /// Unique, human-readable name (from the ONNX node where there is one).
    pub name: String,
    /// The operator.
    pub op: Op,
    /// Metas of the outputs, one per output slot.
    pub outputs: Vec<TensorMeta>,
}

/// Building a graph with inconsistent pieces: a user-input problem when it comes from a model.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GraphError {
    /// Shape or dtype inference rejected a node.
    #[error("node {node} ({op}): {message}")]
    Infer {
        /// Node name.
        node: String,
        /// Op name.
        op: &'static str,
        /// What is wrong.
        message: String,
    },
    /// A value refers to a node or slot that does not exist.
    #[error("node {node}: input {slot} refers to a missing value")]
    MissingValue {
        /// Node name.
        node: String,
        /// Input slot.
        slot: usize,
    },
}

/// A static-shape dataflow graph.
#[derive(Clone, Debug, Default)]
pub struct Graph {
    /// Model name.
    pub name: String,
    /// The nodes and edges.
    pub g: StableGraph<Node, Edge>,
    /// Graph inputs in declaration order (each an [`Op::Input`] node).
    pub inputs: Vec<NodeIndex>,
    /// Parameters in declaration order (each an [`Op::Param`] node).
    pub params: Vec<NodeIndex>,
    /// Named graph outputs in declaration order.
    pub outputs: Vec<(String, Value)>,
    /// Parameter data by name; a parameter without an entry is weight-free (shape only).
    pub param_data: BTreeMap<String, Tensor>,
    /// Persistent state in declaration order (each an [`Op::State`] node; training graphs only).
    pub states: Vec<NodeIndex>,
    /// Storage updates of a training step: after each run, the storage behind the source node
    /// (a [`Op::Param`] or [`Op::State`]) takes the value. A parameter and its updated value are
    /// the same storage, so later stages tie their layouts.
    pub updates: Vec<(NodeIndex, Value)>,
    /// How many nodes carry each name, kept by [`Graph::add_node_raw`] and the removal methods
    /// so that naming a new node is a hash lookup, not a scan of the graph.
    names: HashMap<String, usize>,
    /// Per base name, the next numeric suffix [`Graph::unique_name`] tries.
    next_suffix: HashMap<String, usize>,
}

impl Graph {
    /// An empty graph.
    pub fn new(name: impl Into<String>) -> Graph {
        Graph { name: name.into(), ..Default::default() }
    }

    fn unique_name(&mut self, base: &str) -> String {
        // Names only need to be unique for people and the text form; a suffix keeps them so.
        // Both lookups are hashed and each base remembers the next suffix to try, so naming
        // stays O(1) amortised however many nodes share a base (import was quadratic).
        if !self.names.contains_key(base) {
            return base.to_string();
        }
        let next = self.next_suffix.entry(base.to_string()).or_insert(1);
        loop {
            let cand = format!("{base}.{next}");
            *next += 1;
            if !self.names.contains_key(&cand) {
                return cand;
            }
        }
    }

    /// Counts `name` as used (nodes are added only through [`Graph::add_node_raw`]).
    fn name_added(&mut self, name: &str) {
        *self.names.entry(name.to_string()).or_insert(0) += 1;
    }

    /// Forgets one use of the name of node `n`, before it is removed.
    fn name_removed(&mut self, n: NodeIndex) {
        let Some(node) = self.g.node_weight(n) else { return };
        if let Some(c) = self.names.get_mut(&node.name) {
            *c -= 1;
            if *c == 0 {
                self.names.remove(&node.name);
            }
        }
    }

    /// Adds a node without inference (used by the parser and passes that know the metas).
    pub fn add_node_raw(
        &mut self,
        name: impl Into<String>,
        op: Op,
        inputs: &[Value],
        outputs: Vec<TensorMeta>,
    ) -> NodeIndex {
        let name = name.into();
        self.name_added(&name);
        let idx = self.g.add_node(Node { name, op, outputs });
        for (i, v) in inputs.iter().enumerate() {
            self.g.add_edge(v.node, idx, Edge { src_slot: v.slot, dst_slot: i });
        }
        match &self.g[idx].op {
            Op::Input { .. } => self.inputs.push(idx),
            Op::Param { .. } => self.params.push(idx),
            Op::State { .. } => self.states.push(idx),
            _ => {}
        }
        idx
    }

    /// Declares a graph input.
    pub fn input(&mut self, name: &str, meta: TensorMeta) -> Value {
        let n = self.unique_name(name);
        Value::new(self.add_node_raw(n, Op::Input { name: name.to_string() }, &[], vec![meta]), 0)
    }

    /// Declares a parameter, with its data when known.
    pub fn param(&mut self, name: &str, meta: TensorMeta, data: Option<Tensor>) -> Value {
        let n = self.unique_name(name);
        if let Some(t) = data {
            self.param_data.insert(name.to_string(), t);
        }
        Value::new(self.add_node_raw(n, Op::Param { name: name.to_string() }, &[], vec![meta]), 0)
    }

    /// Declares persistent state (zero-initialised by the runtime).
    pub fn state(&mut self, name: &str, meta: TensorMeta) -> Value {
        let n = self.unique_name(name);
        Value::new(self.add_node_raw(n, Op::State { name: name.to_string() }, &[], vec![meta]), 0)
    }

    /// Adds a constant.
    pub fn constant(&mut self, name: &str, t: Tensor) -> Value {
        let meta = t.meta();
        let n = self.unique_name(name);
        Value::new(self.add_node_raw(n, Op::Constant(t), &[], vec![meta]), 0)
    }

    /// Adds an op node, inferring its output metas. Returns one value per output.
    pub fn add_op(&mut self, name: &str, op: Op, inputs: &[Value]) -> Result<Vec<Value>, GraphError> {
        let mut metas = Vec::with_capacity(inputs.len());
        for (slot, v) in inputs.iter().enumerate() {
            let m = self
                .g
                .node_weight(v.node)
                .and_then(|n| n.outputs.get(v.slot))
                .ok_or_else(|| GraphError::MissingValue { node: name.to_string(), slot })?;
            metas.push(m.clone());
        }
        let outs =
            op.infer(&metas).map_err(|message| GraphError::Infer { node: name.to_string(), op: op.name(), message })?;
        let n = outs.len();
        let name = self.unique_name(name);
        let idx = self.add_node_raw(name, op, inputs, outs);
        Ok((0..n).map(|s| Value::new(idx, s)).collect())
    }

    /// Adds a single-output op node and returns its value.
    pub fn add1(&mut self, name: &str, op: Op, inputs: &[Value]) -> Result<Value, GraphError> {
        Ok(self.add_op(name, op, inputs)?[0])
    }

    /// Names a value as a graph output.
    pub fn set_output(&mut self, name: &str, v: Value) {
        self.outputs.push((name.to_string(), v));
    }

    /// Meta of a value. Panics on a dangling value (an internal bug, not user input).
    pub fn meta(&self, v: Value) -> &TensorMeta {
        &self.g[v.node].outputs[v.slot]
    }

    /// The node behind an index.
    pub fn node(&self, n: NodeIndex) -> &Node {
        &self.g[n]
    }

    /// Inputs of a node, ordered by input slot.
    pub fn node_inputs(&self, n: NodeIndex) -> Vec<Value> {
        let mut es: Vec<(usize, Value)> = self
            .g
            .edges_directed(n, Direction::Incoming)
            .map(|e| (e.weight().dst_slot, Value::new(e.source(), e.weight().src_slot)))
            .collect();
        es.sort_by_key(|(s, _)| *s);
        es.into_iter().map(|(_, v)| v).collect()
    }

    /// Consumers of a value as (node, input slot), in a deterministic order.
    pub fn users(&self, v: Value) -> Vec<(NodeIndex, usize)> {
        let mut us: Vec<(NodeIndex, usize)> = self
            .g
            .edges_directed(v.node, Direction::Outgoing)
            .filter(|e| e.weight().src_slot == v.slot)
            .map(|e| (e.target(), e.weight().dst_slot))
            .collect();
        us.sort();
        us
    }

    /// Makes every consumer of `old` (and graph outputs naming it) read `new` instead.
    pub fn replace_all_uses(&mut self, old: Value, new: Value) {
        let edges: Vec<_> = self
            .g
            .edges_directed(old.node, Direction::Outgoing)
            .filter(|e| e.weight().src_slot == old.slot)
            .map(|e| (e.id(), e.target(), e.weight().dst_slot))
            .collect();
        for (id, target, dst_slot) in edges {
            self.g.remove_edge(id);
            self.g.add_edge(new.node, target, crate::Edge { src_slot: new.slot, dst_slot });
        }
        for (_, v) in &mut self.outputs {
            if *v == old {
                *v = new;
            }
        }
        for (_, v) in &mut self.updates {
            if *v == old {
                *v = new;
            }
        }
    }

    /// Removes a node and its edges (and from the input/param lists).
    pub fn remove_node(&mut self, n: NodeIndex) {
        self.inputs.retain(|&i| i != n);
        self.params.retain(|&i| i != n);
        self.states.retain(|&i| i != n);
        self.updates.retain(|&(s, v)| s != n && v.node != n);
        self.name_removed(n);
        self.g.remove_node(n);
    }

    /// Removes nodes that no graph output or update depends on (inputs, params and states are
    /// kept).
    pub fn remove_dead(&mut self) -> usize {
        let mut live = HashMap::new();
        let mut stack: Vec<NodeIndex> = self.outputs.iter().map(|(_, v)| v.node).collect();
        stack.extend(self.updates.iter().map(|(_, v)| v.node));
        stack.extend(self.inputs.iter().copied());
        stack.extend(self.params.iter().copied());
        stack.extend(self.states.iter().copied());
        while let Some(n) = stack.pop() {
            if live.insert(n, ()).is_none() {
                stack.extend(self.g.neighbors_directed(n, Direction::Incoming));
            }
        }
        let dead: Vec<_> = self.g.node_indices().filter(|n| !live.contains_key(n)).collect();
        if dead.is_empty() {
            return 0;
        }
        for &n in &dead {
            self.name_removed(n);
        }
        // One rebuild (indices kept), not a `remove_node` per dead node: a removal walks the
        // edge list of every neighbour, so removing the many readers of one shared constant
        // one by one was quadratic.
        let g = std::mem::take(&mut self.g);
        self.g = g.filter_map_owned(|n, w| live.contains_key(&n).then_some(w), |_, e| Some(e));
        dead.len()
    }

    /// Nodes in a topological order that follows insertion order where the edges allow it
    /// (so the schedule is deterministic and close to the model's own order).
    pub fn topo_order(&self) -> Result<Vec<NodeIndex>, NodeIndex> {
        let mut indeg: HashMap<NodeIndex, usize> = HashMap::new();
        for n in self.g.node_indices() {
            indeg.insert(n, self.g.neighbors_directed(n, Direction::Incoming).count());
        }
        // Min-heap on index keeps insertion order among ready nodes.
        let mut ready: std::collections::BinaryHeap<std::cmp::Reverse<NodeIndex>> =
            indeg.iter().filter(|(_, d)| **d == 0).map(|(n, _)| std::cmp::Reverse(*n)).collect();
        let mut order = Vec::with_capacity(indeg.len());
        while let Some(std::cmp::Reverse(n)) = ready.pop() {
            order.push(n);
            for e in self.g.edges_directed(n, Direction::Outgoing) {
                let d = indeg.get_mut(&e.target()).expect("edge target is a node");
                *d -= 1;
                if *d == 0 {
                    ready.push(std::cmp::Reverse(e.target()));
                }
            }
        }
        if order.len() != indeg.len() {
            let stuck = indeg.into_iter().filter(|(_, d)| *d > 0).map(|(n, _)| n).min().expect("a node on the cycle");
            return Err(stuck);
        }
        Ok(order)
    }

    /// Number of nodes.
    pub fn node_count(&self) -> usize {
        self.g.node_count()
    }

    /// Total elements and bytes of all parameters (saturating: each is representable, their sum
    /// need not be).
    pub fn param_stats(&self) -> (usize, usize) {
        self.params
            .iter()
            .map(|&p| &self.g[p].outputs[0])
            .fold((0, 0), |(n, b), m| (n.saturating_add(m.numel()), b.saturating_add(m.bytes())))
    }

    /// Finds the node with this name.
    pub fn find(&self, name: &str) -> Option<NodeIndex> {
        self.g.node_indices().find(|&n| self.g[n].name == name)
    }

    /// The same graph computing in floating-point type `to` (`F32` or `F64`): every float input,
    /// parameter, state, constant and cast target, and the parameter data, converted; integer
    /// and bool values unchanged. Node ids and names are kept, so a plan made for this graph
    /// applies to the result. Op attributes (learning rates, epsilons) stay as they are.
    pub fn with_float_type(&self, to: DType) -> Result<Graph, GraphError> {
        if !to.is_float() {
            return Err(GraphError::Infer {
                node: self.name.clone(),
                op: "with_float_type",
                message: format!("{to} is not a float type"),
            });
        }
        let mut g = self.clone();
        let conv = |m: &mut TensorMeta| {
            if m.dtype.is_float() {
                m.dtype = to;
            }
        };
        for n in g.g.node_weights_mut() {
            n.op = std::mem::replace(&mut n.op, Op::Identity).with_float_type(to);
            if n.op.is_source() {
                n.outputs.iter_mut().for_each(conv);
            }
        }
        for t in g.param_data.values_mut() {
            *t = std::mem::replace(t, Tensor::scalar_f32(0.0)).with_float_type(to);
        }
        g.reinfer()?;
        Ok(g)
    }

    /// The graph with node `i` at index `i` of its topological order ([`Graph::topo_order`]),
    /// the numbering of the text and JSON forms; inputs, parameters and state are listed in that
    /// order. Parameter data is not copied (like those forms, the result is the structure).
    /// Fails with a node on a cycle.
    pub fn renumbered(&self) -> Result<Graph, NodeIndex> {
        let order = self.topo_order()?;
        let mut g = Graph::new(self.name.clone());
        let mut map: HashMap<NodeIndex, NodeIndex> = HashMap::with_capacity(order.len());
        for &n in &order {
            let node = &self.g[n];
            let ins: Vec<Value> = self.node_inputs(n).into_iter().map(|v| Value::new(map[&v.node], v.slot)).collect();
            let idx = g.add_node_raw(node.name.clone(), node.op.clone(), &ins, node.outputs.clone());
            map.insert(n, idx);
        }
        g.outputs = self.outputs.iter().map(|(k, v)| (k.clone(), Value::new(map[&v.node], v.slot))).collect();
        g.updates = self.updates.iter().map(|&(t, v)| (map[&t], Value::new(map[&v.node], v.slot))).collect();
        Ok(g)
    }

    /// Re-infers the output metas of every node in topological order, reporting the first
    /// inconsistency (used after passes that rewire edges).
    pub fn reinfer(&mut self) -> Result<(), GraphError> {
        let order = self.topo_order().map_err(|n| GraphError::Infer {
            node: self.g[n].name.clone(),
            op: self.g[n].op.name(),
            message: "graph has a cycle".into(),
        })?;
        for n in order {
            if self.g[n].op.is_source() {
                continue;
            }
            let ins: Vec<TensorMeta> = self.node_inputs(n).iter().map(|&v| self.meta(v).clone()).collect();
            let node = &self.g[n];
            let outs = node.op.infer(&ins).map_err(|message| GraphError::Infer {
                node: node.name.clone(),
                op: node.op.name(),
                message,
            })?;
            self.g[n].outputs = outs;
        }
        Ok(())
    }
}
