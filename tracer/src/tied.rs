//! Parameters an exporter may have tied: one initializer in the same role of several nodes.
//!
//! `torch.onnx.export` in eval mode merges initializers with equal values: every LayerNorm scale
//! of a freshly initialised model (all ones) becomes one tensor, every bias of zeros another. The
//! file is then a different model to train: autopar trains it faithfully, and one update moves
//! all those scales together. [`shared_parameters`] finds a parameter in the same weight role
//! (operand 1 or later of a LayerNorm, BatchNorm, Conv, Gemm or MatMul) of several nodes of one
//! op (the scale of three LayerNorms, a zero bias of every Gemm), which is what that merge
//! leaves; ties PyTorch really has (GPT-2's embedding read by its Gather and its output MatMul,
//! T5's by two Gathers) are in other roles and are not reported. Models that share layers on purpose (ALBERT)
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
     training=torch.onnx.TrainingMode.TRAINING (see docs/export.md)";

/// Parameters of `g` read in the same weight role (see the module docs) by two or more nodes of
/// one op.
pub fn shared_parameters(g: &Graph) -> Vec<SharedParameter> {
    let mut out = Vec::new();
    for &p in &g.params {
        let Op::Param { name } = &g.node(p).op else { continue };
        let mut roles: BTreeMap<(&str, usize), Vec<String>> = BTreeMap::new();
        for (user, slot) in g.users(ir::Value::new(p, 0)) {
            let n = g.node(user);
            // Only the roles of a layer's own weights: an embedding table read twice (T5's
            // encoder and decoder) or a tensor fed to elementwise and view ops is a tie models
            // make on purpose, and graph passes duplicate such reads.
            if !matches!(n.op, Op::LayerNorm { .. } | Op::BatchNorm { .. } | Op::Conv(_) | Op::Gemm { .. } | Op::MatMul)
                || slot == 0
            {
                continue;
            }
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
