//! The verifier: collects every structural and typing error of a graph with its location.
//!
//! It checks that:
//! - the graph is acyclic;
//! - each node's input slots are exactly `0..n`, each fed once, from an existing output slot;
//! - source ops (`input`, `param`, `const`) have no inputs, and constants match their meta;
//! - each node's output metas equal [`crate::Op::infer`] of its input metas;
//! - every output meta is representable: its element count and byte size do not overflow
//!   ([`crate::shape`]);
//! - graph outputs name existing values, and input and param/state names are unique;
//! - updates target params or states (each once) with values of the same meta.

use std::collections::HashSet;
use std::fmt;

use petgraph::Direction;
use petgraph::visit::EdgeRef;

use crate::graph::Graph;
use crate::op::Op;

/// One problem, located at a node (or at the graph when `node` is `None`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerifierError {
    /// Name of the offending node, if any.
    pub node: Option<String>,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for VerifierError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.node {
            Some(n) => write!(f, "node {n}: {}", self.message),
            None => write!(f, "graph: {}", self.message),
        }
    }
}

/// All problems found by [`verify`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct VerifyErrors(pub Vec<VerifierError>);

impl fmt::Display for VerifyErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} verifier error(s)", self.0.len())?;
        for e in &self.0 {
            write!(f, "\n  {e}")?;
        }
        Ok(())
    }
}

/// Checks every invariant listed in the module docs, returning all violations.
pub fn verify(g: &Graph) -> Result<(), VerifyErrors> {
    let mut errs = Vec::new();
    let mut at =
        |node: Option<&str>, message: String| errs.push(VerifierError { node: node.map(str::to_string), message });

    let order = match g.topo_order() {
        Ok(o) => o,
        Err(n) => {
            at(Some(&g.g[n].name), "is on a cycle".into());
            return Err(VerifyErrors(errs));
        }
    };
    let mut names = HashSet::new();
    for &n in &order {
        let node = &g.g[n];
        let name = node.name.as_str();
        if !names.insert(name) {
            at(Some(name), "name is not unique".into());
        }
        let mut slots: Vec<usize> = g.g.edges_directed(n, Direction::Incoming).map(|e| e.weight().dst_slot).collect();
        slots.sort();
        if slots.iter().enumerate().any(|(i, &s)| i != s) {
            at(Some(name), format!("input slots {slots:?} are not 0..{}", slots.len()));
            continue;
        }
        let mut bad_edge = false;
        for e in g.g.edges_directed(n, Direction::Incoming) {
            if e.weight().src_slot >= g.g[e.source()].outputs.len() {
                at(
                    Some(name),
                    format!(
                        "input {} reads missing output {} of {}",
                        e.weight().dst_slot,
                        e.weight().src_slot,
                        g.g[e.source()].name
                    ),
                );
                bad_edge = true;
            }
        }
        if bad_edge {
            continue;
        }
        match &node.op {
            Op::Input { .. } | Op::Param { .. } | Op::State { .. } | Op::Constant(_) => {
                if !slots.is_empty() {
                    at(Some(name), format!("{} must have no inputs", node.op.name()));
                }
                if node.outputs.len() != 1 {
                    at(Some(name), "source must have exactly one output".into());
                }
                // Other nodes' outputs are checked by inference; declared ones here, so no size
                // downstream of a verified graph can overflow.
                for m in &node.outputs {
                    if m.checked_bytes().is_none() {
                        at(Some(name), crate::shape::too_large(&m.shape, m.dtype));
                    }
                }
                if let Op::Constant(t) = &node.op
                    && node.outputs.first() != Some(&t.meta())
                {
                    at(Some(name), format!("constant data is {} but the node says {:?}", t.meta(), node.outputs));
                }
            }
            op => {
                let ins: Vec<_> = g.node_inputs(n).iter().map(|&v| g.meta(v).clone()).collect();
                match op.infer(&ins) {
                    Ok(outs) if outs == node.outputs => {}
                    Ok(outs) => {
                        let show =
                            |v: &[crate::TensorMeta]| v.iter().map(|m| m.to_string()).collect::<Vec<_>>().join(", ");
                        at(
                            Some(name),
                            format!("outputs are [{}] but {} infers [{}]", show(&node.outputs), op.name(), show(&outs)),
                        )
                    }
                    Err(m) => at(Some(name), m),
                }
            }
        }
    }
    for &i in &g.inputs {
        if !matches!(g.g.node_weight(i).map(|n| &n.op), Some(Op::Input { .. })) {
            at(None, format!("input list names {i:?}, which is not an input node"));
        }
    }
    let mut seen = HashSet::new();
    for &p in &g.params {
        match g.g.node_weight(p).map(|n| &n.op) {
            Some(Op::Param { name }) => {
                if !seen.insert(name.clone()) {
                    at(None, format!("parameter {name} is declared twice"));
                }
                if let Some(t) = g.param_data.get(name)
                    && t.meta() != g.g[p].outputs[0]
                {
                    at(
                        Some(&g.g[p].name),
                        format!("parameter data is {} but the node says {}", t.meta(), g.g[p].outputs[0]),
                    );
                }
            }
            _ => at(None, format!("param list names {p:?}, which is not a param node")),
        }
    }
    for &s in &g.states {
        match g.g.node_weight(s).map(|n| &n.op) {
            Some(Op::State { name }) => {
                if !seen.insert(name.clone()) {
                    at(None, format!("state {name} has the name of another parameter or state"));
                }
            }
            _ => at(None, format!("state list names {s:?}, which is not a state node")),
        }
    }
    let mut updated = HashSet::new();
    for &(s, v) in &g.updates {
        let Some(src) = g.g.node_weight(s) else {
            at(None, format!("an update targets missing node {s:?}"));
            continue;
        };
        if !matches!(src.op, Op::Param { .. } | Op::State { .. }) {
            at(Some(&src.name), "is updated but is not a param or state".into());
        } else if !updated.insert(s) {
            at(Some(&src.name), "is updated twice".into());
        }
        match g.g.node_weight(v.node).and_then(|n| n.outputs.get(v.slot)) {
            None => at(Some(&src.name), "update names a missing value".into()),
            Some(m) if *m != src.outputs[0] => {
                at(Some(&src.name), format!("is {} but its update is {m}", src.outputs[0]))
            }
            Some(_) => {}
        }
    }
    let mut seen = HashSet::new();
    for &i in &g.inputs {
        if let Some(Op::Input { name }) = g.g.node_weight(i).map(|n| &n.op)
            && !seen.insert(name.clone())
        {
            at(None, format!("input {name} is declared twice"));
        }
    }
    let total = g.g.node_count();
    if g.inputs.len() + g.params.len() + g.states.len() > total {
        at(None, "input/param lists are longer than the graph".into());
    }
    for (name, v) in &g.outputs {
        if g.g.node_weight(v.node).is_none_or(|n| v.slot >= n.outputs.len()) {
            at(None, format!("output {name} names a missing value"));
        }
    }
    if errs.is_empty() { Ok(()) } else { Err(VerifyErrors(errs)) }
}
