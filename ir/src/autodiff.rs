//! Reverse-mode differentiation: a forward graph, a loss and an optimizer become one training
//! graph (forward, loss, backward, optimizer update) in ordinary IR.
//!
//! [`training_graph`] appends to a copy of the forward graph:
//! - the loss ([`LossSpec`]) as ordinary ops, ending in an f32 scalar output named `loss`;
//! - a vector-Jacobian product for every op on a path from a trainable parameter to the loss,
//!   with gradient contributions summed on fan-out and broadcasts undone by summing
//!   ([`Op::Reduce`] + [`Op::Reshape`]); integer and boolean values (indices, masks) carry no
//!   gradient, nor do piecewise-constant ops (floor, ceil, sign);
//! - per trainable parameter, an optimizer update node ([`Op::SgdUpdate`], [`Op::AdamWUpdate`])
//!   whose state tensors are [`Op::State`] nodes, and a [`Graph::updates`] entry tying the
//!   parameter to its updated value. Without an optimizer the gradients become graph outputs
//!   named `grad/<param>` instead;
//! - with [`TrainOptions::clip_grad_norm`], the gradients clipped by their global norm before the
//!   updates (output `grad_norm`), and with a [`LrSchedule`], the learning rate of the step as a
//!   factor every update op reads (output `lr`): see the `optim` submodule. Every node of the
//!   update phase is named `update/…` ([`runs_once_per_step`]).
//!
//! Semantics follow ONNX: the parameters are the graph's [`Op::Param`]s, and a parameter read by
//! several ops gets the sum of the gradients through every use. A trainable parameter with no
//! path to the loss gets an explicit zero gradient (so AdamW still decays it, as PyTorch does
//! with a materialised zero gradient). Two kinds of parameter are never trained: those the loss
//! does not read at all, and running statistics ([`running_statistics`]: the mean and variance
//! an inference-form `BatchNormalization` reads, which PyTorch holds as buffers). Neither gets a
//! gradient, an update or optimizer state; [`TrainingGraph::statistics`] lists the second kind.
//!
//! Invariant: the result passes [`crate::verify`]; node names say where they come from (`loss/…`,
//! `grad/<forward node>/…`, `update/<param>`), and [`TrainingGraph::phases`] records it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::str::FromStr;

use crate::graph::{Graph, GraphError, Value};
use crate::op::*;
use crate::tensor::{DType, Tensor, TensorMeta};
use crate::{NodeIndex, VerifyErrors};

pub use optim::{CLIP_EPSILON, LrDecay, LrSchedule, SGD_STEP_STATE, UPDATE_PREFIX, runs_once_per_step};

mod activation;
mod attention;
mod conv;
mod elementwise;
mod index;
mod linalg;
mod moe;
mod norm;
mod optim;
mod reduce;
mod resize;
mod shape;

/// The loss a training graph minimises, as written on the command line (`--loss SPEC`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LossSpec {
    /// `mse:OUTPUT:TARGET`: mean over all elements of `(output - target)^2`; the target is fed
    /// under its name with the output's shape.
    Mse {
        /// Graph output.
        output: String,
        /// Name of the fed target.
        target: String,
    },
    /// `ce:OUTPUT:LABELS`: cross-entropy with the class dim last and i64 labels (fed under their
    /// name, shape = output shape without its last dim), mean over the labels.
    CrossEntropy {
        /// Graph output (logits).
        output: String,
        /// Name of the fed labels.
        labels: String,
    },
    /// `ce-next:OUTPUT:INPUT_IDS`: next-token LM loss, `ce(output[:, :-1], input_ids[:, 1:])`,
    /// where `input_ids` is the model's own `[batch, seq]` input.
    NextTokenCe {
        /// Graph output (logits `[batch, seq, vocab]`).
        output: String,
        /// The model input holding the token ids.
        input_ids: String,
    },
}

impl LossSpec {
    /// The graph output the loss reads.
    pub fn output(&self) -> &str {
        match self {
            LossSpec::Mse { output, .. }
            | LossSpec::CrossEntropy { output, .. }
            | LossSpec::NextTokenCe { output, .. } => output,
        }
    }
}

impl FromStr for LossSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let parts: Vec<&str> = s.split(':').collect();
        let usage = "expected mse:OUTPUT:TARGET, ce:OUTPUT:LABELS or ce-next:OUTPUT:INPUT_IDS";
        let [kind, a, b] = parts.as_slice() else {
            return Err(format!("loss {s:?}: {usage}"));
        };
        if a.is_empty() || b.is_empty() {
            return Err(format!("loss {s:?}: empty name; {usage}"));
        }
        let (output, other) = (a.to_string(), b.to_string());
        match *kind {
            "mse" => Ok(LossSpec::Mse { output, target: other }),
            "ce" => Ok(LossSpec::CrossEntropy { output, labels: other }),
            "ce-next" => Ok(LossSpec::NextTokenCe { output, input_ids: other }),
            k => Err(format!("loss {s:?}: unknown kind {k:?}; {usage}")),
        }
    }
}

impl fmt::Display for LossSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LossSpec::Mse { output, target } => write!(f, "mse:{output}:{target}"),
            LossSpec::CrossEntropy { output, labels } => write!(f, "ce:{output}:{labels}"),
            LossSpec::NextTokenCe { output, input_ids } => write!(f, "ce-next:{output}:{input_ids}"),
        }
    }
}

/// An optimizer, with PyTorch's definitions (`torch.optim.SGD`, `torch.optim.AdamW`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Optimizer {
    /// SGD with optional momentum and L2 weight decay.
    Sgd {
        /// Learning rate.
        lr: f32,
        /// Momentum (0: none).
        momentum: f32,
        /// L2 penalty added to the gradient.
        weight_decay: f32,
    },
    /// AdamW: decoupled weight decay, bias-corrected moments.
    AdamW {
        /// Learning rate.
        lr: f32,
        /// First-moment decay.
        beta1: f32,
        /// Second-moment decay.
        beta2: f32,
        /// Added to the denominator.
        epsilon: f32,
        /// Decoupled weight decay.
        weight_decay: f32,
    },
}

impl Optimizer {
    /// SGD without momentum or weight decay.
    pub fn sgd(lr: f32) -> Optimizer {
        Optimizer::Sgd { lr, momentum: 0.0, weight_decay: 0.0 }
    }
    /// AdamW with PyTorch's defaults (betas 0.9/0.999, eps 1e-8, weight decay 0.01).
    pub fn adamw(lr: f32) -> Optimizer {
        Optimizer::AdamW { lr, beta1: 0.9, beta2: 0.999, epsilon: 1e-8, weight_decay: 0.01 }
    }
    /// The (base) learning rate.
    pub fn lr(&self) -> f32 {
        match self {
            Optimizer::Sgd { lr, .. } | Optimizer::AdamW { lr, .. } => *lr,
        }
    }
}

/// What to build.
#[derive(Clone, Debug)]
pub struct TrainOptions {
    /// The loss.
    pub loss: LossSpec,
    /// The optimizer; `None` outputs the gradients (`grad/<param>`) instead of updating.
    pub optimizer: Option<Optimizer>,
    /// Parameters that are not trained (no gradient, no update).
    pub frozen: Vec<String>,
    /// The learning-rate schedule (the default: none, the optimizer's lr at every step).
    pub schedule: LrSchedule,
    /// Clip the gradients to this global norm (`torch.nn.utils.clip_grad_norm_`), > 0.
    pub clip_grad_norm: Option<f32>,
}

impl TrainOptions {
    /// Training with `optimizer` (or none: gradients out), nothing frozen, no schedule, no
    /// clipping.
    pub fn new(loss: LossSpec, optimizer: Option<Optimizer>) -> TrainOptions {
        TrainOptions { loss, optimizer, frozen: vec![], schedule: LrSchedule::default(), clip_grad_norm: None }
    }
}

/// Mixed-precision training ([`crate::autocast`]): forward and backward in a 16-bit float type,
/// parameters and optimizer state in f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MixedPrecision {
    /// The 16-bit type (bf16 or f16).
    pub low: DType,
    /// The type parameter gradients are kept in until the optimizer reads them: `low` casts each
    /// gradient to f32 in the update phase (gradients held, summed over microbatches and reduced
    /// in 16 bits), f32 casts it where the backward computes it (PyTorch autocast's f32
    /// gradients).
    pub grads: DType,
    /// Dynamic loss scaling (for f16, whose range small gradients underflow), as PyTorch's
    /// `GradScaler`: see [`LOSS_SCALE_STATE`].
    pub loss_scaling: bool,
}

/// The state holding log2 of the loss scale minus 16 (i64; 0 at the start: a scale of 2^16, as
/// `torch.amp.GradScaler`'s default). The backward starts from the scale instead of 1; the
/// gradients are divided by it before the optimizer reads them. A step whose gradients hold an
/// inf or a NaN on any rank (their sum is reduced over every shard, so every rank sees it) is
/// skipped: parameters and optimizer state keep their values, the scale halves. After
/// [`LOSS_SCALE_GROWTH_INTERVAL`] steps in a row without one, it doubles. Scale and count are
/// optimizer state: checkpoints keep them.
pub const LOSS_SCALE_STATE: &str = "amp/scale_log2";
/// The state counting the steps since the scale last changed (i64).
pub const LOSS_SCALE_GOOD_STEPS: &str = "amp/good_steps";
/// A scalar f32 state added to the backward's seed and reset to 0 by every step: 0 unless a
/// fault is injected (`run --inject-fault kind=nonfinite`, `train --inject-nonfinite`), which
/// puts an inf there on one rank to test that every rank skips the step.
pub const LOSS_SCALE_POISON: &str = "amp/poison";
/// Steps without an inf or NaN after which the loss scale doubles (GradScaler's default).
pub const LOSS_SCALE_GROWTH_INTERVAL: i64 = 2000;

/// Which part of the training step a node belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// The model's own forward ops (and its inputs and params).
    Forward,
    /// The loss ops appended after the model output.
    Loss,
    /// Gradient ops.
    Backward,
    /// Optimizer updates and their state.
    Update,
}

/// A training graph and what the stages after it need to know about it.
#[derive(Clone, Debug)]
pub struct TrainingGraph {
    /// Forward + loss + backward (+ update) as one graph; output `loss` is the scalar loss (f32,
    /// or f64 after [`TrainingGraph::with_float_type`]).
    pub graph: Graph,
    /// The loss value.
    pub loss: Value,
    /// Gradient of every trainable parameter, by parameter name.
    pub grads: BTreeMap<String, Value>,
    /// Trainable parameters in the graph's parameter order.
    pub trainable: Vec<String>,
    /// Parameters held as running statistics ([`running_statistics`]): read, never trained.
    pub statistics: Vec<String>,
    /// The phase of every node.
    pub phases: HashMap<NodeIndex, Phase>,
    /// The constant the reverse sweep starts from (d loss / d loss, 1).
    pub seed: NodeIndex,
}

impl TrainingGraph {
    /// The same training step computing in float type `to` ([`Graph::with_float_type`]): node
    /// ids, phases and gradient values are unchanged.
    pub fn with_float_type(&self, to: DType) -> Result<TrainingGraph, crate::GraphError> {
        Ok(TrainingGraph { graph: self.graph.with_float_type(to)?, ..self.clone() })
    }

    /// The same step with every gradient scaled by `scale` (the reverse sweep starts from
    /// `scale` instead of 1); the loss is unchanged. With `1/M`, gradients of M microbatches
    /// sum to the gradient of their mean loss.
    pub fn with_gradient_scale(&self, scale: f32) -> TrainingGraph {
        let mut t = self.clone();
        if let Some(n) = t.graph.g.node_weight_mut(t.seed)
            && let Op::Constant(c) = &mut n.op
        {
            *c = Tensor::scalar_f32(scale);
        }
        t
    }

    /// Values computed in the forward or loss phase and read by the backward phase: the
    /// activations a training step keeps for backward (parameters and constants excluded).
    pub fn saved_for_backward(&self) -> Vec<Value> {
        let g = &self.graph;
        let mut out = HashSet::new();
        for (&n, &ph) in &self.phases {
            if ph != Phase::Backward {
                continue;
            }
            for v in g.node_inputs(n) {
                let src = &g.node(v.node).op;
                let fwd = matches!(self.phases.get(&v.node), Some(Phase::Forward | Phase::Loss));
                if fwd && !matches!(src, Op::Param { .. } | Op::Constant(_)) {
                    out.insert(v);
                }
            }
        }
        let mut v: Vec<Value> = out.into_iter().collect();
        v.sort();
        v
    }
}

/// Why a training graph cannot be built.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AutodiffError {
    /// The loss names a tensor the model does not have (or has with the wrong type).
    #[error("--loss {spec}: {message}")]
    Loss {
        /// The loss spec.
        spec: String,
        /// What is wrong.
        message: String,
    },
    /// A frozen name is not a parameter.
    #[error("cannot freeze {name}: the model has no parameter of that name")]
    UnknownParam {
        /// The name given.
        name: String,
    },
    /// No parameter is left to train.
    #[error("nothing to train: every parameter is frozen or the model has none")]
    NothingToTrain,
    /// An op on the path from a parameter to the loss has no gradient rule.
    #[error("node {node} ({op}): no gradient rule for this op")]
    NoGradient {
        /// Node name.
        node: String,
        /// Op name.
        op: &'static str,
    },
    /// Building a node failed (an internal inconsistency, reported with its node).
    #[error(transparent)]
    Graph(#[from] GraphError),
    /// The result does not verify (an internal bug, reported rather than hidden).
    #[error("the training graph does not verify: {0}")]
    Verify(#[from] VerifyErrors),
    /// The learning-rate schedule or the clipping cannot be built as given (the user's input).
    #[error("{0}")]
    Options(String),
}

/// Builds the training graph of `forward` (see the module docs).
pub fn training_graph(forward: &Graph, opts: &TrainOptions) -> Result<TrainingGraph, AutodiffError> {
    training_graph_with(forward, opts, None)
}

/// [`training_graph`], in mixed precision when `mixed` is given: the forward and the loss go
/// through [`crate::autocast::autocast`] before the backward is derived.
pub fn training_graph_with(
    forward: &Graph,
    opts: &TrainOptions,
    mixed: Option<MixedPrecision>,
) -> Result<TrainingGraph, AutodiffError> {
    check_options(opts)?;
    let mut g = forward.clone();
    let mut phases: HashMap<NodeIndex, Phase> = g.g.node_indices().map(|n| (n, Phase::Forward)).collect();
    let mark = |g: &Graph, phases: &mut HashMap<NodeIndex, Phase>, ph: Phase| {
        phases.retain(|n, _| g.g.contains_node(*n));
        for n in g.g.node_indices() {
            phases.entry(n).or_insert(ph);
        }
    };

    // Loss.
    let loss = build_loss(&mut g, &opts.loss)?;
    g.outputs = vec![("loss".to_string(), loss)];
    g.remove_dead();
    if let Some(mp) = mixed {
        phases.retain(|n, _| g.g.contains_node(*n));
        let made = crate::autocast::autocast(&mut g, mp.low)?;
        for (cast, user) in made.casts {
            if let Some(&ph) = phases.get(&user) {
                phases.insert(cast, ph);
            }
        }
    }
    mark(&g, &mut phases, Phase::Loss);

    // Trainable parameters.
    let mut param_of: BTreeMap<String, NodeIndex> = BTreeMap::new();
    for &p in &g.params {
        if let Op::Param { name } = &g.node(p).op {
            param_of.insert(name.clone(), p);
        }
    }
    for f in &opts.frozen {
        if !param_of.contains_key(f) && !forward_has_param(forward, f) {
            return Err(AutodiffError::UnknownParam { name: f.clone() });
        }
    }
    // A parameter the loss does not read is not trained: its gradient would be zero, and weight
    // decay would still move it where PyTorch skips it (no `.grad`). Training-mode BatchNorm's
    // running statistics are such (state the batch-statistics forward does not read). The
    // inference form's statistics are read, but they are buffers, not weights: held.
    let statistics = running_statistics(forward);
    let trainable: Vec<(String, NodeIndex)> = g
        .params
        .iter()
        .filter_map(|&p| match &g.node(p).op {
            Op::Param { name }
                if !opts.frozen.contains(name)
                    && !statistics.contains(name)
                    && g.node(p).outputs[0].dtype.is_float()
                    && !g.users(Value::new(p, 0)).is_empty() =>
            {
                Some((name.clone(), p))
            }
            _ => None,
        })
        .collect();
    if trainable.is_empty() {
        return Err(AutodiffError::NothingToTrain);
    }

    // Which values depend on a trainable parameter through differentiable ops.
    let order = g.topo_order().map_err(|n| GraphError::Infer {
        node: g.node(n).name.clone(),
        op: g.node(n).op.name(),
        message: "graph has a cycle".into(),
    })?;
    let mut needs: HashSet<Value> = trainable.iter().map(|(_, p)| Value::new(*p, 0)).collect();
    for &n in &order {
        let node = g.node(n);
        if node.op.is_source() || !differentiable(&node.op) {
            continue;
        }
        if g.node_inputs(n).iter().any(|v| needs.contains(v)) {
            for (s, m) in node.outputs.iter().enumerate() {
                if m.dtype.is_float() {
                    needs.insert(Value::new(n, s));
                }
            }
        }
    }

    // Reverse sweep.
    let mut contribs: HashMap<Value, Vec<Value>> = HashMap::new();
    let one = g.constant("grad/seed", Tensor::scalar_f32(1.0));
    let scaling = match mixed {
        Some(mp) if mp.loss_scaling => Some(LossScale::new(&mut g, one)?),
        _ => None,
    };
    contribs.insert(loss, vec![scaling.as_ref().map_or(one, |s| s.seed)]);
    for &n in order.iter().rev() {
        let node = g.node(n);
        if node.op.is_source() {
            continue;
        }
        let outs = node.outputs.len();
        let name = node.name.clone();
        let mut dys = Vec::with_capacity(outs);
        for s in 0..outs {
            let v = Value::new(n, s);
            dys.push(match contribs.remove(&v) {
                Some(cs) => Some(sum_all(&mut g, &format!("grad/{name}/sum{s}"), cs)?),
                None => None,
            });
        }
        if dys.iter().all(Option::is_none) {
            continue;
        }
        let ins = g.node_inputs(n);
        let want: Vec<bool> = ins.iter().map(|v| needs.contains(v)).collect();
        if !want.iter().any(|&w| w) {
            continue;
        }
        let mut b = Builder { g: &mut g, prefix: format!("grad/{name}") };
        let dins = vjp(&mut b, n, &ins, &dys, &want)?;
        for ((v, d), w) in ins.iter().zip(dins).zip(&want) {
            if let (Some(d), true) = (d, w) {
                contribs.entry(*v).or_default().push(d);
            }
        }
    }
    let mut grads = BTreeMap::new();
    for (name, p) in &trainable {
        let v = Value::new(*p, 0);
        let grad = match contribs.remove(&v) {
            Some(cs) => sum_all(&mut g, &format!("grad/{name}"), cs)?,
            None => {
                let shape = g.meta(v).shape.clone();
                let mut b = Builder { g: &mut g, prefix: format!("grad/{name}") };
                b.zeros("zeros", &shape, v)?
            }
        };
        grads.insert(name.clone(), grad);
    }
    mark(&g, &mut phases, Phase::Backward);
    // Gradients kept in 16 bits: the optimizer reads the 16-bit gradient of the parameter's
    // 16-bit copy (its kernel widens it), instead of the cast of it to f32.
    if let Some(mp) = mixed
        && mp.grads.is_half()
    {
        for v in grads.values_mut() {
            let src = g.node_inputs(v.node);
            if matches!(g.node(v.node).op, Op::Cast { to: DType::F32 })
                && src.len() == 1
                && g.meta(src[0]).dtype.is_half()
                && g.users(*v).is_empty()
            {
                let cast = v.node;
                *v = src[0];
                g.remove_node(cast);
                phases.remove(&cast);
            }
        }
    }

    // Optimizer: gradients unscaled (loss scaling), clipped, then the updates (PyTorch's order:
    // `scaler.unscale_`, `clip_grad_norm_`, `scaler.step`).
    match opts.optimizer {
        None => {
            for (name, v) in &grads {
                g.set_output(&format!("grad/{name}"), *v);
            }
        }
        Some(opt) => {
            let (finite, unscaled) = match &scaling {
                Some(ls) => {
                    let (finite, unscaled) = ls.check(&mut g, &grads)?;
                    (Some(finite), unscaled)
                }
                None => (None, grads.clone()),
            };
            let clipped = match opts.clip_grad_norm {
                Some(max_norm) => {
                    let (clipped, norm) = optim::clip_grad_norm(&mut g, &unscaled, max_norm)?;
                    g.set_output("grad_norm", norm);
                    clipped
                }
                None => unscaled,
            };
            let before = g.updates.len();
            if let Some(lr) = add_updates(&mut g, &opt, &opts.schedule, &trainable, &clipped)? {
                g.set_output("lr", lr);
            }
            if let (Some(ls), Some(finite)) = (&scaling, finite) {
                ls.skip_unless(&mut g, finite, before)?;
            }
        }
    }
    mark(&g, &mut phases, Phase::Update);

    crate::verify(&g)?;
    Ok(TrainingGraph {
        graph: g,
        loss,
        grads,
        trainable: trainable.into_iter().map(|(n, _)| n).collect(),
        statistics,
        phases,
        seed: one.node,
    })
}

/// The parameters of `g` that are running statistics, in the graph's parameter order: those an
/// inference-form [`Op::BatchNorm`] reads as its mean or variance (inputs 3 and 4; ONNX
/// `BatchNormalization` with `training_mode=0` calls them "running (training) or estimated
/// (testing)" statistics). PyTorch holds them as buffers, which an optimizer never sees, so a
/// training step reads them and never changes them. A parameter that also fills another role
/// elsewhere (an eval-mode export can merge equal initializers: a variance of ones with a
/// LayerNorm scale of ones) is still held: training a variance can drive it to zero or below.
/// Training-mode BatchNorm's running statistics are not listed: its forward does not read them,
/// so they are not trained either (see [`training_graph`]).
pub fn running_statistics(g: &Graph) -> Vec<String> {
    let mut held = HashSet::new();
    for n in g.g.node_indices() {
        if matches!(g.node(n).op, Op::BatchNorm { .. }) {
            held.extend(g.node_inputs(n).iter().skip(3).map(|v| v.node));
        }
    }
    g.params
        .iter()
        .filter(|p| held.contains(p))
        .filter_map(|&p| match &g.node(p).op {
            Op::Param { name } => Some(name.clone()),
            _ => None,
        })
        .collect()
}

fn forward_has_param(g: &Graph, name: &str) -> bool {
    g.params.iter().any(|&p| matches!(&g.node(p).op, Op::Param { name: n } if n == name))
}

/// False for ops whose outputs never carry a gradient.
fn differentiable(op: &Op) -> bool {
    match op {
        Op::Unary(u) => unary_differentiable(*u),
        Op::Binary(b) => {
            !b.is_comparison() && !b.is_logical() && !b.is_bitwise() && !matches!(b, BinaryOp::Mod | BinaryOp::Fmod)
        }
        Op::Index(x) => x.differentiable(),
        Op::Cast { to } => to.is_float(),
        Op::State { .. }
        | Op::UnaryGrad(_)
        | Op::SoftmaxGrad { .. }
        | Op::LayerNormGrad { .. }
        | Op::BatchNormTrainGrad { .. }
        | Op::LrnGrad { .. }
        | Op::ConvWeightGrad { .. }
        | Op::MaxPoolGrad(_)
        | Op::AveragePoolGrad { .. }
        | Op::GatherGrad { .. }
        | Op::SliceGrad { .. }
        | Op::SgdUpdate { .. }
        | Op::AdamWUpdate { .. }
        | Op::ResizeGrad { .. }
        | Op::AttentionGrad(_)
        | Op::MoeGrad(_)
        | Op::Hardmax { .. } => false,
        // Listed one by one (no wildcard), so a new op decides here whether gradients pass it.
        Op::Input { .. }
        | Op::Param { .. }
        | Op::Constant(_)
        | Op::Where
        | Op::Identity
        | Op::MatMul
        | Op::Gemm { .. }
        | Op::Conv(_)
        | Op::MaxPool(_)
        | Op::AveragePool(_)
        | Op::GlobalAveragePool
        | Op::GlobalMaxPool
        | Op::BatchNorm { .. }
        | Op::LayerNorm { .. }
        | Op::Lrn { .. }
        | Op::Softmax { .. }
        | Op::LogSoftmax { .. }
        | Op::Reshape { .. }
        | Op::Transpose { .. }
        | Op::Expand { .. }
        | Op::Concat { .. }
        | Op::Split { .. }
        | Op::Slice { .. }
        | Op::Gather { .. }
        | Op::Reduce { .. }
        | Op::Pad { .. }
        | Op::ConvInputGrad { .. }
        | Op::Resize(_)
        | Op::BatchNormTrain { .. }
        | Op::Attention(_)
        | Op::Moe(_)
        | Op::Dropout(_) => true,
    }
}

fn sum_all(g: &mut Graph, name: &str, mut cs: Vec<Value>) -> Result<Value, AutodiffError> {
    let mut acc = cs.remove(0);
    for c in cs {
        acc = g.add1(name, Op::Binary(BinaryOp::Add), &[acc, c])?;
    }
    Ok(acc)
}

/// Adds nodes named `<prefix>/<what>`.
struct Builder<'a> {
    g: &'a mut Graph,
    prefix: String,
}

impl Builder<'_> {
    fn op(&mut self, what: &str, op: Op, ins: &[Value]) -> Result<Value, AutodiffError> {
        Ok(self.g.add1(&format!("{}/{what}", self.prefix), op, ins)?)
    }
    fn ops(&mut self, what: &str, op: Op, ins: &[Value]) -> Result<Vec<Value>, AutodiffError> {
        Ok(self.g.add_op(&format!("{}/{what}", self.prefix), op, ins)?)
    }
    fn shape(&self, v: Value) -> Vec<usize> {
        self.g.meta(v).shape.clone()
    }
    /// A scalar constant of `like`'s float type.
    fn scalar(&mut self, what: &str, x: f32, like: Value) -> Value {
        let dt = self.g.meta(like).dtype;
        self.g.constant(&format!("{}/{what}", self.prefix), Tensor::scalar_f32(x).with_float_type(dt))
    }
    fn bin(&mut self, what: &str, b: BinaryOp, x: Value, y: Value) -> Result<Value, AutodiffError> {
        self.op(what, Op::Binary(b), &[x, y])
    }
    fn mul(&mut self, what: &str, x: Value, y: Value) -> Result<Value, AutodiffError> {
        self.bin(what, BinaryOp::Mul, x, y)
    }
    fn scale(&mut self, what: &str, x: Value, c: f32) -> Result<Value, AutodiffError> {
        if c == 1.0 {
            return Ok(x);
        }
        let c = self.scalar(&format!("{what}.c"), c, x);
        self.mul(what, x, c)
    }
    fn neg(&mut self, what: &str, x: Value) -> Result<Value, AutodiffError> {
        self.op(what, Op::Unary(UnaryOp::Neg), &[x])
    }
    fn reshape(&mut self, what: &str, x: Value, shape: &[usize]) -> Result<Value, AutodiffError> {
        if self.shape(x) == shape {
            return Ok(x);
        }
        self.op(what, Op::Reshape { shape: shape.to_vec() }, &[x])
    }
    fn expand(&mut self, what: &str, x: Value, shape: &[usize]) -> Result<Value, AutodiffError> {
        if self.shape(x) == shape {
            return Ok(x);
        }
        self.op(what, Op::Expand { shape: shape.to_vec() }, &[x])
    }
    fn transpose(&mut self, what: &str, x: Value, perm: Vec<usize>) -> Result<Value, AutodiffError> {
        self.op(what, Op::Transpose { perm }, &[x])
    }
    /// Zeros of `shape` and `like`'s float type.
    fn zeros(&mut self, what: &str, shape: &[usize], like: Value) -> Result<Value, AutodiffError> {
        let z = self.scalar(&format!("{what}.0"), 0.0, like);
        if shape.is_empty() {
            return Ok(z);
        }
        self.op(what, Op::Expand { shape: shape.to_vec() }, &[z])
    }
    fn reduce_sum(&mut self, what: &str, x: Value, axes: Vec<usize>, keepdims: bool) -> Result<Value, AutodiffError> {
        if axes.is_empty() {
            return Ok(x);
        }
        self.op(what, Op::Reduce { op: ReduceOp::Sum, axes, keepdims }, &[x])
    }
    /// Sums a broadcast gradient back to `target` (undoes numpy broadcasting).
    fn sum_to(&mut self, what: &str, x: Value, target: &[usize]) -> Result<Value, AutodiffError> {
        let s = self.shape(x);
        if s == target {
            return Ok(x);
        }
        let lead = s.len() - target.len();
        let axes: Vec<usize> = (0..s.len()).filter(|&i| i < lead || (target[i - lead] == 1 && s[i] != 1)).collect();
        let r = self.reduce_sum(what, x, axes, false)?;
        self.reshape(&format!("{what}.shape"), r, target)
    }
    /// `where(cond, x, 0)` or `where(cond, 0, x)`.
    fn mask(&mut self, what: &str, cond: Value, x: Value, keep_when: bool) -> Result<Value, AutodiffError> {
        let z = self.scalar(&format!("{what}.0"), 0.0, x);
        let ins = if keep_when { [cond, x, z] } else { [cond, z, x] };
        self.op(what, Op::Where, &ins)
    }
}

/// The error for node `n`, whose op (or form of it) has no gradient rule.
fn no_rule(b: &Builder, n: NodeIndex) -> AutodiffError {
    AutodiffError::NoGradient { node: b.g.node(n).name.clone(), op: b.g.node(n).op.name() }
}

/// Input gradients of node `n` given its output gradients (`None`: zero). Returns one entry per
/// input; entries for inputs with `want[i] == false` may be `None`.
fn vjp(
    b: &mut Builder,
    n: NodeIndex,
    ins: &[Value],
    dys: &[Option<Value>],
    want: &[bool],
) -> Result<Vec<Option<Value>>, AutodiffError> {
    let op = b.g.node(n).op.clone();
    let k = ins.len();
    let mut out: Vec<Option<Value>> = vec![None; k];
    let sh = |b: &Builder, i: usize| b.shape(ins[i]);
    // Single-output ops: the output gradient.
    let dy = match dys.first() {
        Some(Some(d)) => Some(*d),
        _ => None,
    };
    // The rule of each op, in one match over every variant (no wildcard): a new op does not
    // compile until it names its family's rule here, or says it has none. The family functions
    // end in a `no_rule` arm that this match never sends them to.
    let family: Option<FamilyVjp> = match &op {
        // Ops with several outputs (or outputs that may carry no gradient) take them all.
        Op::Split { axis, sizes } => {
            let mut parts = Vec::with_capacity(dys.len());
            for (s, d) in dys.iter().enumerate() {
                parts.push(match d {
                    Some(d) => *d,
                    None => {
                        let mut shape = sh(b, 0);
                        shape[*axis] = sizes[s];
                        b.zeros(&format!("zeros{s}"), &shape, ins[0])?
                    }
                });
            }
            out[0] = Some(b.op("dx", Op::Concat { axis: *axis }, &parts)?);
            return Ok(out);
        }
        Op::Index(x) => return index::vjp(b, n, x, ins, dys, want),
        Op::Dropout(a) => {
            out[0] = elementwise::dropout_vjp(b, *a, dy)?;
            return Ok(out);
        }
        Op::Attention(a) => return attention::vjp(b, n, *a, ins, dys, want),
        Op::Moe(a) => return moe::vjp(b, *a, ins, dys, want),
        // Single-output ops, by family.
        Op::Identity | Op::Cast { .. } | Op::Unary(_) | Op::Binary(_) | Op::Where => Some(elementwise::vjp),
        Op::MatMul | Op::Gemm { .. } => Some(linalg::vjp),
        Op::Conv(_)
        | Op::MaxPool(_)
        | Op::AveragePool(_)
        | Op::GlobalAveragePool
        | Op::GlobalMaxPool
        | Op::ConvInputGrad { .. } => Some(conv::vjp),
        Op::BatchNorm { .. }
        | Op::LayerNorm { .. }
        | Op::BatchNormTrain { .. }
        | Op::Lrn { .. }
        | Op::Softmax { .. }
        | Op::LogSoftmax { .. } => Some(norm::vjp),
        Op::Reshape { .. }
        | Op::Transpose { .. }
        | Op::Expand { .. }
        | Op::Concat { .. }
        | Op::Slice { .. }
        | Op::Gather { .. }
        | Op::Pad { .. } => Some(shape::vjp),
        Op::Reduce { .. } => Some(reduce::vjp),
        Op::Resize(_) => Some(resize::vjp),
        // No gradient rule: sources, state, the gradient and update ops themselves (but
        // `ConvInputGrad`, which is a convolution), and Hardmax (piecewise constant). Their
        // outputs carry no gradient ([`differentiable`]), so a gradient reaching one is an error.
        Op::Input { .. }
        | Op::Param { .. }
        | Op::Constant(_)
        | Op::State { .. }
        | Op::UnaryGrad(_)
        | Op::SoftmaxGrad { .. }
        | Op::LayerNormGrad { .. }
        | Op::LrnGrad { .. }
        | Op::ConvWeightGrad { .. }
        | Op::MaxPoolGrad(_)
        | Op::AveragePoolGrad { .. }
        | Op::GatherGrad { .. }
        | Op::SliceGrad { .. }
        | Op::SgdUpdate { .. }
        | Op::AdamWUpdate { .. }
        | Op::ResizeGrad { .. }
        | Op::BatchNormTrainGrad { .. }
        | Op::AttentionGrad(_)
        | Op::MoeGrad(_)
        | Op::Hardmax { .. } => None,
    };
    // Every other op has one output.
    if dys.len() > 1 {
        return Err(no_rule(b, n));
    }
    let Some(dy) = dy else { return Ok(out) };
    let Some(family) = family else { return Err(no_rule(b, n)) };
    family(b, n, op, ins, dy, want, &mut out)?;
    Ok(out)
}

/// A family's rule for single-output ops: input gradients of `op` (node `n`) given its output
/// gradient, written into the last argument (one entry per input).
type FamilyVjp =
    fn(&mut Builder, NodeIndex, Op, &[Value], Value, &[bool], &mut [Option<Value>]) -> Result<(), AutodiffError>;

/// Gradients of a numpy matmul.
fn matmul_vjp(
    b: &mut Builder,
    a: Value,
    c: Value,
    dy: Value,
    want_a: bool,
    want_c: bool,
) -> Result<(Option<Value>, Option<Value>), AutodiffError> {
    let (sa, sc) = (b.shape(a), b.shape(c));
    // Promote 1-D operands to matrices, as numpy does.
    let pa = if sa.len() == 1 { vec![1, sa[0]] } else { sa.clone() };
    let pc = if sc.len() == 1 { vec![sc[0], 1] } else { sc.clone() };
    let a2 = b.reshape("a.2d", a, &pa)?;
    let c2 = b.reshape("b.2d", c, &pc)?;
    let py = matmul_shape(&pa, &pc).map_err(|message| GraphError::Infer {
        node: b.prefix.clone(),
        op: "matmul",
        message,
    })?;
    let dy2 = b.reshape("dy.2d", dy, &py)?;
    let (k, n) = (pc[pc.len() - 2], pc[pc.len() - 1]);
    let mut da = None;
    let mut dc = None;
    if pc.len() == 2 {
        // B is a matrix: fold A's batch dims into rows and use 2-D products.
        let rows: usize = pa[..pa.len() - 1].iter().product();
        let dyf = b.reshape("dy.rows", dy2, &[rows, n])?;
        if want_a {
            let t = b.op("da.gemm", Op::Gemm { alpha: 1.0, beta: 0.0, trans_a: false, trans_b: true }, &[dyf, c2])?;
            let t = b.reshape("da.shape", t, &pa)?;
            da = Some(b.reshape("da", t, &sa)?);
        }
        if want_c {
            let af = b.reshape("a.rows", a2, &[rows, k])?;
            let t = b.op("db.gemm", Op::Gemm { alpha: 1.0, beta: 0.0, trans_a: true, trans_b: false }, &[af, dyf])?;
            dc = Some(b.reshape("db", t, &sc)?);
        }
    } else {
        let last2 = |r: usize| -> Vec<usize> {
            let mut p: Vec<usize> = (0..r).collect();
            p.swap(r - 2, r - 1);
            p
        };
        if want_a {
            let ct = b.transpose("b.t", c2, last2(pc.len()))?;
            let t = b.op("da.matmul", Op::MatMul, &[dy2, ct])?;
            let t = b.sum_to("da.sum", t, &pa)?;
            da = Some(b.reshape("da", t, &sa)?);
        }
        if want_c {
            let at = b.transpose("a.t", a2, last2(pa.len()))?;
            let t = b.op("db.matmul", Op::MatMul, &[at, dy2])?;
            let t = b.sum_to("db.sum", t, &pc)?;
            dc = Some(b.reshape("db", t, &sc)?);
        }
    }
    Ok((da, dc))
}

/// Gradients of inference batch norm `y = (x - mean) / sqrt(var + eps) * scale + bias`.
fn batchnorm_vjp(
    b: &mut Builder,
    ins: &[Value],
    dy: Value,
    eps: f32,
    want: &[bool],
    out: &mut [Option<Value>],
) -> Result<(), AutodiffError> {
    let (x, scale, mean, var) = (ins[0], ins[1], ins[3], ins[4]);
    let xs = b.shape(x);
    let c = xs[1];
    let mut cshape = vec![c];
    cshape.extend(std::iter::repeat_n(1, xs.len() - 2));
    let others: Vec<usize> = (0..xs.len()).filter(|&d| d != 1).collect();
    let e = b.scalar("eps", eps, var);
    let ve = b.bin("var.eps", BinaryOp::Add, var, e)?;
    let sd = b.op("std", Op::Unary(UnaryOp::Sqrt), &[ve])?;
    let inv = b.op("inv", Op::Unary(UnaryOp::Reciprocal), &[sd])?;
    let dsum = b.reduce_sum("dy.sum", dy, others.clone(), false)?;
    let si = b.mul("scale.inv", scale, inv)?;
    if want[0] {
        let f = b.reshape("scale.inv.c", si, &cshape)?;
        out[0] = Some(b.mul("dx", dy, f)?);
    }
    let need_xc = want[1] || want[4];
    let dxc = if need_xc {
        let mc = b.reshape("mean.c", mean, &cshape)?;
        let xc = b.bin("xc", BinaryOp::Sub, x, mc)?;
        let t = b.mul("dy.xc", dy, xc)?;
        Some(b.reduce_sum("dy.xc.sum", t, others, false)?)
    } else {
        None
    };
    if let (true, Some(d)) = (want[1], dxc) {
        out[1] = Some(b.mul("dscale", d, inv)?);
    }
    if want[2] {
        out[2] = Some(dsum);
    }
    if want[3] {
        let t = b.mul("dmean.mul", dsum, si)?;
        out[3] = Some(b.neg("dmean", t)?);
    }
    if let (true, Some(d)) = (want[4], dxc) {
        // d/dvar = sum(dy*(x-mean)) * scale * -0.5 * inv^3
        let i2 = b.mul("inv2", inv, inv)?;
        let i3 = b.mul("inv3", i2, si)?;
        let t = b.mul("dvar.mul", d, i3)?;
        out[4] = Some(b.scale("dvar", t, -0.5)?);
    }
    Ok(())
}

/// Appends the loss; returns the scalar loss value.
fn build_loss(g: &mut Graph, spec: &LossSpec) -> Result<Value, AutodiffError> {
    let err = |message: String| AutodiffError::Loss { spec: spec.to_string(), message };
    let outputs = g.outputs.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>().join(", ");
    let out = g
        .outputs
        .iter()
        .find(|(n, _)| n == spec.output())
        .map(|(_, v)| *v)
        .ok_or_else(|| err(format!("the model has no output {} (outputs: {outputs})", spec.output())))?;
    let om = g.meta(out).clone();
    if om.dtype != DType::F32 {
        return Err(err(format!("output {} is {om}, not f32", spec.output())));
    }
    let mut b = Builder { g, prefix: "loss".into() };
    match spec {
        LossSpec::Mse { target, .. } => {
            let t = feed(b.g, target, &om).map_err(err)?;
            let d = b.bin("diff", BinaryOp::Sub, out, t)?;
            let sq = b.mul("square", d, d)?;
            let axes: Vec<usize> = (0..om.rank()).collect();
            let l = if axes.is_empty() {
                sq
            } else {
                b.op("mean", Op::Reduce { op: ReduceOp::Mean, axes, keepdims: false }, &[sq])?
            };
            Ok(l)
        }
        LossSpec::CrossEntropy { labels, .. } => {
            if om.rank() == 0 {
                return Err(err(format!("output {} is a scalar; it needs a class dim", spec.output())));
            }
            let lm = TensorMeta::new(DType::I64, om.shape[..om.rank() - 1].to_vec());
            let l = feed(b.g, labels, &lm).map_err(err)?;
            cross_entropy(&mut b, out, l)
        }
        LossSpec::NextTokenCe { input_ids, .. } => {
            let ids =
                b.g.inputs
                    .iter()
                    .find(|&&i| matches!(&b.g.node(i).op, Op::Input { name } if name == input_ids))
                    .map(|&i| Value::new(i, 0))
                    .ok_or_else(|| err(format!("the model has no input {input_ids}")))?;
            let im = b.g.meta(ids).clone();
            if om.rank() != 3 || im.rank() != 2 || im.dtype != DType::I64 || im.shape[..] != om.shape[..2] {
                return Err(err(format!(
                    "needs logits [batch, seq, vocab] and i64 input ids [batch, seq]; got {om} and {im}"
                )));
            }
            let t = om.shape[1];
            if t < 2 {
                return Err(err(format!("sequence length {t} leaves no next token to predict")));
            }
            let z = b.op(
                "logits.head",
                Op::Slice { axes: vec![SliceAxis { axis: 1, start: 0, len: t - 1, step: 1 }] },
                &[out],
            )?;
            let l = b.op(
                "labels.next",
                Op::Slice { axes: vec![SliceAxis { axis: 1, start: 1, len: t - 1, step: 1 }] },
                &[ids],
            )?;
            cross_entropy(&mut b, z, l)
        }
    }
}

/// The graph input `name` with meta `m`, declared if the model does not have it.
fn feed(g: &mut Graph, name: &str, m: &TensorMeta) -> Result<Value, String> {
    if let Some(&i) = g.inputs.iter().find(|&&i| matches!(&g.node(i).op, Op::Input { name: n } if n == name)) {
        let have = g.node(i).outputs[0].clone();
        if &have != m {
            return Err(format!("input {name} is {have} but the loss needs {m}"));
        }
        return Ok(Value::new(i, 0));
    }
    if g.params.iter().any(|&p| matches!(&g.node(p).op, Op::Param { name: n } if n == name)) {
        return Err(format!("{name} is a parameter of the model; name the loss target differently"));
    }
    Ok(g.input(name, m.clone()))
}

/// Mean cross-entropy of logits `z` `[.., C]` against i64 labels `[..]`: `log_softmax`, pick
/// each row's label with a gather on the flattened log-probabilities, negate the mean.
fn cross_entropy(b: &mut Builder, z: Value, labels: Value) -> Result<Value, AutodiffError> {
    let zs = b.shape(z);
    let c = *zs.last().expect("rank checked by the caller");
    let rows: usize = zs[..zs.len() - 1].iter().product();
    let logp = b.op("log_softmax", Op::LogSoftmax { axis: zs.len() - 1 }, &[z])?;
    let flat = b.reshape("log_softmax.flat", logp, &[rows * c])?;
    let lf = b.reshape("labels.flat", labels, &[rows])?;
    let offsets = Tensor::i64([rows], (0..rows as i64).map(|r| r * c as i64).collect());
    let off = b.g.constant("loss/row_offsets", offsets);
    let idx = b.bin("index", BinaryOp::Add, lf, off)?;
    let picked = b.op("picked", Op::Gather { axis: 0 }, &[flat, idx])?;
    let mean = b.op("mean", Op::Reduce { op: ReduceOp::Mean, axes: vec![0], keepdims: false }, &[picked])?;
    b.neg("ce", mean)
}

/// Dynamic loss scaling's nodes (see [`LOSS_SCALE_STATE`]).
struct LossScale {
    log2: Value,
    scale: Value,
    poison: Value,
    seed: Value,
}

impl LossScale {
    /// The scale `2^(16 + log2)` and the backward's seed `scale * one + poison`.
    fn new(g: &mut Graph, one: Value) -> Result<LossScale, AutodiffError> {
        let log2 = g.state(LOSS_SCALE_STATE, TensorMeta::new(DType::I64, []));
        let lf = g.add1("amp/scale_log2.f32", Op::Cast { to: DType::F32 }, &[log2])?;
        let c16 = g.constant("amp/16", Tensor::scalar_f32(16.0));
        let e = g.add1("amp/exponent", Op::Binary(BinaryOp::Add), &[lf, c16])?;
        let two = g.constant("amp/2", Tensor::scalar_f32(2.0));
        let scale = g.add1("amp/scale", Op::Binary(BinaryOp::Pow), &[two, e])?;
        let poison = g.state(LOSS_SCALE_POISON, TensorMeta::new(DType::F32, []));
        let s = g.add1("amp/seed.scaled", Op::Binary(BinaryOp::Mul), &[scale, one])?;
        let seed = g.add1("amp/seed", Op::Binary(BinaryOp::Add), &[s, poison])?;
        Ok(LossScale { log2, scale, poison, seed })
    }

    /// Whether every gradient is finite (a bool scalar: the sum of `gradient * 0` over every
    /// element is 0, or NaN after an inf or a NaN), and the gradients divided by the scale (f32).
    fn check(
        &self,
        g: &mut Graph,
        grads: &BTreeMap<String, Value>,
    ) -> Result<(Value, BTreeMap<String, Value>), AutodiffError> {
        let inv = g.add1("update/amp/inv_scale", Op::Unary(UnaryOp::Reciprocal), &[self.scale])?;
        let mut total: Option<Value> = None;
        let mut unscaled = BTreeMap::new();
        for (name, &v) in grads {
            let v32 = if g.meta(v).dtype == DType::F32 {
                v
            } else {
                g.add1(&format!("update/amp/{name}/f32"), Op::Cast { to: DType::F32 }, &[v])?
            };
            let zero = g.constant(&format!("update/amp/{name}/zero"), Tensor::scalar_f32(0.0));
            let z = g.add1(&format!("update/amp/{name}/probe"), Op::Binary(BinaryOp::Mul), &[v32, zero])?;
            let axes: Vec<usize> = (0..g.meta(z).rank()).collect();
            let z = if axes.is_empty() {
                z
            } else {
                g.add1(
                    &format!("update/amp/{name}/probe.sum"),
                    Op::Reduce { op: ReduceOp::Sum, axes, keepdims: false },
                    &[z],
                )?
            };
            total = Some(match total {
                None => z,
                Some(t) => g.add1("update/amp/probe", Op::Binary(BinaryOp::Add), &[t, z])?,
            });
            unscaled.insert(
                name.clone(),
                g.add1(&format!("update/amp/{name}/unscaled"), Op::Binary(BinaryOp::Mul), &[v32, inv])?,
            );
        }
        let total = total.unwrap_or(self.scale);
        let finite = g.add1("update/amp/finite", Op::Binary(BinaryOp::Equal), &[total, total])?;
        Ok((finite, unscaled))
    }

    /// Makes the updates from index `from` of `g.updates` keep the old value unless `finite`,
    /// and adds the scale's own updates.
    fn skip_unless(&self, g: &mut Graph, finite: Value, from: usize) -> Result<(), AutodiffError> {
        for k in from..g.updates.len() {
            let (target, new) = g.updates[k];
            let name = format!("{}.kept", g.node(new.node).name);
            let kept = g.add1(&name, Op::Where, &[finite, new, Value::new(target, 0)])?;
            g.updates[k].1 = kept;
        }
        let good = g.state(LOSS_SCALE_GOOD_STEPS, TensorMeta::new(DType::I64, []));
        let one = g.constant("update/amp/one", Tensor::i64([], vec![1]));
        let zero = g.constant("update/amp/zero", Tensor::i64([], vec![0]));
        let interval = g.constant("update/amp/growth_interval", Tensor::i64([], vec![LOSS_SCALE_GROWTH_INTERVAL]));
        let good1 = g.add1("update/amp/good_steps.next", Op::Binary(BinaryOp::Add), &[good, one])?;
        let grow = g.add1("update/amp/grow", Op::Binary(BinaryOp::Equal), &[good1, interval])?;
        let up = g.add1("update/amp/scale_log2.up", Op::Binary(BinaryOp::Add), &[self.log2, one])?;
        let down = g.add1("update/amp/scale_log2.down", Op::Binary(BinaryOp::Sub), &[self.log2, one])?;
        let ok = g.add1("update/amp/scale_log2.ok", Op::Where, &[grow, up, self.log2])?;
        let log2 = g.add1("update/amp/scale_log2.next", Op::Where, &[finite, ok, down])?;
        let good_ok = g.add1("update/amp/good_steps.ok", Op::Where, &[grow, zero, good1])?;
        let good_next = g.add1("update/amp/good_steps.new", Op::Where, &[finite, good_ok, zero])?;
        let clean = g.constant("update/amp/poison.reset", Tensor::scalar_f32(0.0));
        g.updates.push((self.log2.node, log2));
        g.updates.push((good.node, good_next));
        g.updates.push((self.poison.node, clean));
        Ok(())
    }
}

/// Why the options cannot make a training graph (before anything is built).
fn check_options(opts: &TrainOptions) -> Result<(), AutodiffError> {
    let scheduled = !opts.schedule.is_constant();
    let Some(opt) = opts.optimizer else {
        if scheduled || opts.clip_grad_norm.is_some() {
            return Err(AutodiffError::Options(
                "a learning-rate schedule and gradient clipping need an optimizer".into(),
            ));
        }
        return Ok(());
    };
    opts.schedule.check(opt.lr()).map_err(|m| AutodiffError::Options(format!("learning-rate schedule: {m}")))?;
    if let Some(m) = opts.clip_grad_norm
        && !(m.is_finite() && m > 0.0)
    {
        return Err(AutodiffError::Options(format!(
            "gradient clipping to a norm of {m}: it must be a finite number > 0"
        )));
    }
    Ok(())
}

/// Appends the optimizer's updates (and its step counter, and the schedule's factor when
/// `schedule` is not constant); returns the schedule's learning rate, if any.
fn add_updates(
    g: &mut Graph,
    opt: &Optimizer,
    schedule: &LrSchedule,
    trainable: &[(String, NodeIndex)],
    grads: &BTreeMap<String, Value>,
) -> Result<Option<Value>, AutodiffError> {
    // Each update's inputs: the parameter, its gradient, and the optimizer's state for it; then
    // the schedule's factor at step k (AdamW's counter before its increment: 0 at the first step).
    let (step, counter) = match opt {
        Optimizer::AdamW { .. } => {
            let s = g.state("adamw/step", TensorMeta::new(DType::I64, []));
            let one = g.constant("update/step.one", Tensor::i64([], vec![1]));
            let s1 = g.add1("update/step", Op::Binary(BinaryOp::Add), &[s, one])?;
            g.updates.push((s.node, s1));
            (vec![s1], Some(s))
        }
        Optimizer::Sgd { .. } => (vec![], None),
    };
    let lr = opt.lr();
    let scheduled = if schedule.is_constant() {
        None
    } else {
        let k = match counter {
            Some(k) => k,
            None => optim::sgd_counter(g)?,
        };
        Some(optim::lr_factor(g, k, schedule, lr)?)
    };
    for (name, p) in trainable {
        let pv = Value::new(*p, 0);
        let meta = g.meta(pv).clone();
        let (op, state_names): (Op, &[&str]) = match *opt {
            Optimizer::Sgd { lr, momentum, weight_decay } => {
                let names: &[&str] = if momentum != 0.0 { &["momentum_buffer"] } else { &[] };
                (Op::SgdUpdate { lr, momentum, weight_decay }, names)
            }
            Optimizer::AdamW { lr, beta1, beta2, epsilon, weight_decay } => {
                (Op::AdamWUpdate { lr, beta1, beta2, epsilon, weight_decay }, &["exp_avg", "exp_avg_sq"])
            }
        };
        let states: Vec<Value> = state_names.iter().map(|s| g.state(&format!("{name}/{s}"), meta.clone())).collect();
        let mut ins = vec![pv, grads[name]];
        ins.extend(&states);
        ins.extend(&step);
        ins.extend(scheduled.map(|(factor, _)| factor));
        // Output 0 is the new parameter, then the new state in input order.
        let outs = g.add_op(&format!("update/{name}"), op, &ins)?;
        g.updates.push((*p, outs[0]));
        for (s, o) in states.iter().zip(&outs[1..]) {
            g.updates.push((s.node, *o));
        }
    }
    Ok(scheduled.map(|(_, lr)| lr))
}
