//! Mixed precision: the casts of automatic mixed precision, made explicit in the graph.
//!
//! [`autocast`] rewrites a forward graph (model and loss) so that it computes in a 16-bit float
//! type where PyTorch's `torch.autocast` would (its CUDA op lists), keeping parameters in f32
//! (the master copy the optimizer updates). Every op falls in one of three classes
//! ([`policy`]):
//!
//! - **low**: matrix products, convolutions and fused attention (`matmul`, `gemm`, `conv`,
//!   `attention`): every float input is cast to the low type, the result is low (attention's
//!   row log-sum-exp stays f32, as flash attention keeps it);
//! - **f32**: ops whose accuracy needs the range or the precision: normalisations (layer, batch,
//!   LRN), softmax and log-softmax, `exp`, `log`, `reciprocal`, `pow`, sums and products
//!   (`reduce_sum`, `reduce_prod`, sums of squares, L2), cumulative sums: every float input is cast
//!   to f32, the result is f32;
//! - **promote**: everything else (elementwise, shape and indexing ops) computes in the widest
//!   type among its *computed* float inputs (values produced by ops, and graph inputs).
//!   Parameters and constants are weak: they take that type (a bias added to a low matmul result
//!   is low, as in PyTorch's `linear`). An op whose only float inputs are parameters and constants
//!   (an embedding lookup) stays in their type.
//!
//! Explicit `cast` ops of the model are kept as written. A cast of a constant is folded (the
//! constant is stored rounded); a value is cast once per type and the cast shared by its users.
//!
//! The gradient of a cast is the cast back ([`crate::autodiff`]), so the backward computes in
//! the type of each forward value, and a parameter's gradient arrives in f32 through the cast of
//! its low copy.

use std::collections::HashMap;

use petgraph::Direction;
use petgraph::visit::EdgeRef;

use crate::NodeIndex;
use crate::graph::{Edge, Graph, GraphError, Value};
use crate::op::*;
use crate::tensor::DType;

/// How an op's float inputs are typed under mixed precision (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Inputs cast to the low type.
    Low,
    /// Inputs cast to f32.
    F32,
    /// Inputs promoted to the widest computed float input's type.
    Promote,
    /// Left as written (explicit casts).
    Keep,
}

/// The class of `op` under mixed precision.
pub fn policy(op: &Op) -> Policy {
    use crate::ops::index::IndexOp;
    // Every op and every unary, binary, reduce and indexing kind is named (no wildcard), so a new
    // one does not compile until it is given a class.
    match op {
        Op::MatMul | Op::Gemm { .. } | Op::Conv(_) | Op::Attention(_) => Policy::Low,
        Op::LayerNorm { .. }
        | Op::BatchNorm { .. }
        | Op::BatchNormTrain { .. }
        | Op::Lrn { .. }
        | Op::Softmax { .. }
        | Op::LogSoftmax { .. }
        // The router's softmax and top-k are computed in f32 (as HF's Mixtral does).
        | Op::Moe(_)
        | Op::MoeGrad(_) => Policy::F32,
        Op::Unary(u) => match u {
            UnaryOp::Exp | UnaryOp::Log | UnaryOp::Reciprocal => Policy::F32,
            UnaryOp::Relu
            | UnaryOp::Gelu
            | UnaryOp::GeluTanh
            | UnaryOp::Tanh
            | UnaryOp::Erf
            | UnaryOp::Sigmoid
            | UnaryOp::Sqrt
            | UnaryOp::Neg
            | UnaryOp::Abs
            | UnaryOp::Not
            | UnaryOp::Floor
            | UnaryOp::Ceil
            | UnaryOp::Sin
            | UnaryOp::Cos
            | UnaryOp::Sign
            | UnaryOp::HardSigmoid { .. }
            | UnaryOp::HardSwish
            | UnaryOp::LeakyRelu { .. }
            | UnaryOp::Elu { .. }
            | UnaryOp::Selu { .. }
            | UnaryOp::Celu { .. }
            | UnaryOp::Softplus
            | UnaryOp::Softsign
            | UnaryOp::Mish
            | UnaryOp::ThresholdedRelu { .. }
            | UnaryOp::Shrink { .. }
            | UnaryOp::Round
            | UnaryOp::IsNaN
            | UnaryOp::IsInf { .. }
            | UnaryOp::Tan
            | UnaryOp::Acos
            | UnaryOp::Asin
            | UnaryOp::Atan
            | UnaryOp::Sinh
            | UnaryOp::Cosh
            | UnaryOp::Asinh
            | UnaryOp::Acosh
            | UnaryOp::Atanh
            | UnaryOp::BitwiseNot => Policy::Promote,
        },
        Op::Binary(b) => match b {
            BinaryOp::Pow => Policy::F32,
            BinaryOp::Add
            | BinaryOp::Sub
            | BinaryOp::Mul
            | BinaryOp::Div
            | BinaryOp::Max
            | BinaryOp::Min
            | BinaryOp::Equal
            | BinaryOp::Less
            | BinaryOp::LessOrEqual
            | BinaryOp::Greater
            | BinaryOp::GreaterOrEqual
            | BinaryOp::And
            | BinaryOp::Or
            | BinaryOp::Xor
            | BinaryOp::PRelu
            | BinaryOp::BitwiseAnd
            | BinaryOp::BitwiseOr
            | BinaryOp::BitwiseXor
            | BinaryOp::Mod
            | BinaryOp::Fmod => Policy::Promote,
        },
        Op::Reduce { op, .. } => match op {
            ReduceOp::Mean | ReduceOp::Max | ReduceOp::Min => Policy::Promote,
            ReduceOp::Sum
            | ReduceOp::Prod
            | ReduceOp::SumSquare
            | ReduceOp::L2
            | ReduceOp::L1
            | ReduceOp::LogSum
            | ReduceOp::LogSumExp => Policy::F32,
        },
        Op::Index(x) => match x {
            IndexOp::CumSum { .. } => Policy::F32,
            IndexOp::Trilu { .. }
            | IndexOp::ScatterNd { .. }
            | IndexOp::GatherNd { .. }
            | IndexOp::GatherElements { .. }
            | IndexOp::ScatterElements { .. }
            | IndexOp::ArgMax { .. }
            | IndexOp::ArgMin { .. }
            | IndexOp::TopK { .. } => Policy::Promote,
        },
        Op::Cast { .. } => Policy::Keep,
        Op::Input { .. }
        | Op::Param { .. }
        | Op::Constant(_)
        | Op::Where
        | Op::Identity
        | Op::MaxPool(_)
        | Op::AveragePool(_)
        | Op::GlobalAveragePool
        | Op::GlobalMaxPool
        | Op::Reshape { .. }
        | Op::Transpose { .. }
        | Op::Expand { .. }
        | Op::Concat { .. }
        | Op::Split { .. }
        | Op::Slice { .. }
        | Op::Gather { .. }
        | Op::Pad { .. }
        | Op::State { .. }
        | Op::UnaryGrad(_)
        | Op::SoftmaxGrad { .. }
        | Op::LayerNormGrad { .. }
        | Op::LrnGrad { .. }
        | Op::ConvInputGrad { .. }
        | Op::ConvWeightGrad { .. }
        | Op::MaxPoolGrad(_)
        | Op::AveragePoolGrad { .. }
        | Op::GatherGrad { .. }
        | Op::SliceGrad { .. }
        | Op::SgdUpdate { .. }
        | Op::AdamWUpdate { .. }
        | Op::Resize(_)
        | Op::ResizeGrad { .. }
        | Op::BatchNormTrainGrad { .. }
        | Op::AttentionGrad(_)
        | Op::Hardmax { .. }
        | Op::Dropout(_) => Policy::Promote,
    }
}

/// What [`autocast`] inserted.
#[derive(Clone, Debug, Default)]
pub struct Autocast {
    /// Each cast node added, with the first node that reads it.
    pub casts: Vec<(NodeIndex, NodeIndex)>,
    /// Ops computing in the low type afterwards.
    pub low_ops: usize,
    /// Ops computing in f32 afterwards (float ops only).
    pub f32_ops: usize,
}

/// Rewrites `g` in place for mixed precision in `low` (bf16 or f16); see the module docs.
pub fn autocast(g: &mut Graph, low: DType) -> Result<Autocast, GraphError> {
    if !low.is_half() {
        return Err(GraphError::Infer {
            node: g.name.clone(),
            op: "autocast",
            message: format!("mixed precision needs a 16-bit float type, not {low}"),
        });
    }
    let order = g.topo_order().map_err(|n| GraphError::Infer {
        node: g.node(n).name.clone(),
        op: g.node(n).op.name(),
        message: "graph has a cycle".into(),
    })?;
    let mut made: HashMap<(Value, DType), Value> = HashMap::new();
    let mut out = Autocast::default();
    for n in order {
        if g.node(n).op.is_source() {
            continue;
        }
        let ins = g.node_inputs(n);
        let target = match policy(&g.node(n).op) {
            Policy::Low => Some(low),
            Policy::F32 => Some(DType::F32),
            Policy::Keep => None,
            Policy::Promote => {
                let strong: Vec<DType> = ins
                    .iter()
                    .filter(|v| !matches!(g.node(v.node).op, Op::Param { .. } | Op::Constant(_)))
                    .map(|&v| g.meta(v).dtype)
                    .filter(|d| d.is_float())
                    .collect();
                if strong.iter().any(|d| !d.is_half()) { Some(DType::F32) } else { strong.first().copied() }
            }
        };
        if let Some(to) = target {
            for (slot, &v) in ins.iter().enumerate() {
                let dt = g.meta(v).dtype;
                if !dt.is_float() || dt == to {
                    continue;
                }
                let c = match made.get(&(v, to)) {
                    Some(&c) => c,
                    None => {
                        let c = cast_of(g, v, to)?;
                        out.casts.push((c.node, n));
                        made.insert((v, to), c);
                        c
                    }
                };
                rewire(g, n, slot, c);
            }
        }
        let metas: Vec<_> = g.node_inputs(n).iter().map(|&v| g.meta(v).clone()).collect();
        let node = g.node(n);
        let outs = node.op.infer(&metas).map_err(|message| GraphError::Infer {
            node: node.name.clone(),
            op: node.op.name(),
            message,
        })?;
        if let Some(d) = outs.iter().map(|m| m.dtype).find(|d| d.is_float()) {
            if d.is_half() {
                out.low_ops += 1;
            } else {
                out.f32_ops += 1;
            }
        }
        g.g[n].outputs = outs;
    }
    Ok(out)
}

/// `v` in type `to`: a rounded copy of a constant, or a cast node.
fn cast_of(g: &mut Graph, v: Value, to: DType) -> Result<Value, GraphError> {
    let name = format!("{}.{to}", g.node(v.node).name);
    if let Op::Constant(t) = &g.node(v.node).op {
        let t = t.clone().with_float_type(to);
        return Ok(g.constant(&name, t));
    }
    g.add1(&name, Op::Cast { to }, &[v])
}

/// Makes input `slot` of node `n` read `v`.
fn rewire(g: &mut Graph, n: NodeIndex, slot: usize, v: Value) {
    let old: Vec<_> =
        g.g.edges_directed(n, Direction::Incoming).filter(|e| e.weight().dst_slot == slot).map(|e| e.id()).collect();
    for e in old {
        g.g.remove_edge(e);
    }
    g.g.add_edge(v.node, n, Edge { src_slot: v.slot, dst_slot: slot });
}
