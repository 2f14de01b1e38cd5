//! Parameters an exporter may have tied: one initializer in the same role of several nodes.
//!
//! `torch.onnx.export` in eval mode merges initializers with equal values: every LayerNorm scale
//! of a freshly initialised model (all ones) becomes one tensor, every bias of zeros another. The
//! file is then a different model to train: autopar trains it faithfully, and one update moves
//! all those scales together. [`shared_parameters`] finds a parameter read in the same operand
//! slot of several nodes of one op (the scale of three LayerNorms), which is what that merge
//! leaves; a tie PyTorch really has (GPT-2's embedding read by its Gather and its output MatMul)
//! reads it in different roles and is not reported. Models that share layers on purpose (ALBERT)
//! are reported too: the warning says what it found and leaves the judgement to the user.

use std::collections::BTreeMap;
use std::fmt;

use ir::{Graph, Op};

/// A parameter read in the same role by several nodes.
#[derive(Clone, Debug, PartialEq)]
pub struct SharedParameter {
    /// Initializer name.
    pub name: String,
    /// The op reading it (autopar's op name).
    pub op: String,
    /// The operand slot it fills.
    pub slot: usize,
    /// The nodes reading it there, in graph order.
    pub nodes: Vec<String>,
}

impl fmt::Display for SharedParameter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shown: Vec<&str> = self.nodes.iter().take(3).map(String::as_str).collect();
        write!(
            f,
            "parameter {} is operand {} of {} {} nodes ({}{})",
            self.name,
            self.slot,
            self.nodes.len(),
            self.op,
            shown.join(", "),
            if self.nodes.len() > 3 { ", ..." } else { "" }
        )
    }
}

/// The advice that goes with a non-empty [`shared_parameters`] list.
pub const TIED_ADVICE: &str = "if these are separate layers in the source model, the exporter merged initializers \
     with equal values (torch.onnx.export does in eval mode) and training this file trains them as one: export with \
     training=torch.onnx.TrainingMode.TRAINING (see the README's export advice)";

/// Parameters of `g` read in the same operand slot by two or more nodes of one op.
pub fn shared_parameters(g: &Graph) -> Vec<SharedParameter> {
    let mut out = Vec::new();
    for &p in &g.params {
        let Op::Param { name } = &g.node(p).op else { continue };
        let mut roles: BTreeMap<(&str, usize), Vec<String>> = BTreeMap::new();
        for (user, slot) in g.users(ir::Value::new(p, 0)) {
            let n = g.node(user);
            roles.entry((n.op.name(), slot)).or_default().push(n.name.clone());
        }
        for ((op, slot), nodes) in roles {
            if nodes.len() >= 2 {
                out.push(SharedParameter { name: name.clone(), op: op.to_string(), slot, nodes });
            }
        }
    }
    out
}

/// Logs [`shared_parameters`] once (a `warn!` per import), for the commands that do not print it.
pub(crate) fn warn_shared(g: &Graph) {
    let shared = shared_parameters(g);
    if let Some(first) = shared.first() {
        tracing::warn!(
            "{} parameter(s) are shared by nodes in the same role, e.g. {first}; {TIED_ADVICE}",
            shared.len()
        );
    }
}
