//! Sharding strategies per op, derived from the op's axes and expanded over the mesh.
//!
//! Each op family has a rule ([`rule`]): its *logical dims* (an einsum-like description: for
//! `matmul` `bmk,bkn->bmn`, the dims b, m, n, k), and for every logical dim which input dim and
//! which output dim it is. A logical dim that an output lacks is summed over for that output
//! (matmul's k): splitting it leaves that output `Partial`. Dims an op cannot split locally
//! (softmax's axis, a convolution's spatial dims, a layer norm's normalised dims) are left out.
//! Ops that are linear in some inputs also accept those inputs as `Partial` and give a `Partial`
//! output (DTensor's linearity rule).
//!
//! [`expand`] assigns every mesh axis (of size > 1) either nothing, one logical dim, or one
//! linear set, by product over the axes: several axes on one logical dim split it in mesh-axis
//! order (`S01`). Every combination that divides evenly is a [`Strategy`], priced in seconds
//! (compute by roofline on the local shapes, plus the collectives the op itself needs) and bytes
//! per rank.
//!
//! Two strategies need more than "the same op on local blocks" ([`Local`]): the vocabulary-
//! parallel embedding (gather from a table split along its gathered axis: out-of-range rows give
//! zeros, the output is partial) and the softmax over a split axis (all-reduce of the row max and
//! of the row sum of exponentials, as Megatron's vocabulary-parallel cross-entropy does).

mod attention;
mod conv;
mod elementwise;
mod index;
mod linalg;
mod moe;
mod norm;
mod reduce;
mod resize;
mod shape;
mod training;

use crate::collective::{Collective, ReduceKind};
use crate::mesh::{DeviceMesh, DeviceProfile};
use crate::spec::ShardingSpec;
use crate::{Error, Result};
use ir::{Graph, NodeIndex, Op, ReduceOp, TensorMeta};
use serde::Serialize;

/// How one input relates to a logical dim.
#[derive(Clone, Debug, PartialEq)]
pub enum InMap {
    /// The input's dim.
    Dim(usize),
    /// The input does not have the dim: replicated along the axis.
    Replicate,
    /// The input is added to a sum over the dim (Gemm's C under a split k): partial along the axis.
    Partial,
}

/// One logical dim of an op (see the module docs).
#[derive(Clone, Debug)]
pub struct LogicalDim {
    /// Name used in strategy names (`m`, `n`, `k`, `batch`, `d0`, ...).
    pub name: String,
    /// Size.
    pub size: usize,
    /// Per input.
    pub ins: Vec<InMap>,
    /// Per output: its dim, or `None` when the output sums over this dim.
    pub outs: Vec<Option<usize>>,
    /// Splitting this dim needs a special local computation.
    pub special: Option<SpecialKind>,
}

/// Local computations other than "the op on local blocks".
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SpecialKind {
    /// Gather from a table split along the gathered axis.
    MaskedGather,
    /// Softmax / log-softmax over a split axis.
    SplitSoftmax,
    /// Scatter-add (gather's gradient) into a table split along the gathered axis.
    MaskedScatter,
    /// Causal attention (or its gradient) on a block of query rows.
    QueryBlocks,
}

/// The sharding rule of one op: logical dims and linear input sets.
#[derive(Clone, Debug)]
pub struct Rule {
    /// Logical dims that can be split.
    pub dims: Vec<LogicalDim>,
    /// Sets of inputs the op is jointly linear in: all of them partial gives partial outputs.
    pub linear: Vec<Vec<usize>>,
}

/// How every rank computes its blocks.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, serde::Deserialize, schemars::JsonSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Local {
    /// The op itself on the local blocks (shape attributes made local by [`local_op`]).
    Same,
    /// Gather from a table whose gathered axis is split over `axes`: rank `r` holds rows
    /// `[i*len, (i+1)*len)` (`i` its index in the group); indices outside give zero rows. The
    /// output is partial over `axes`.
    MaskedGather {
        /// Mesh axes splitting the table's axis.
        axes: Vec<usize>,
    },
    /// Softmax (or log-softmax) along an axis split over `axes`: local row max, all-reduce(max),
    /// local sum of `exp(x - max)`, all-reduce(sum), then the local normalisation.
    SplitSoftmax {
        /// Mesh axes splitting the softmax axis.
        axes: Vec<usize>,
    },
    /// Gather's gradient into a table whose gathered axis is split over `axes`: rank `r` keeps
    /// rows `[i*len, (i+1)*len)`; indices outside them (and their rows of `dy`) are skipped.
    MaskedScatter {
        /// Mesh axes splitting the table's axis.
        axes: Vec<usize>,
    },
    /// Causal attention (or its gradient) with its query rows split over `axes` and the keys
    /// whole (context parallelism, keys and values gathered): the rank of index `i` in the group
    /// holds queries `[i*rows, (i+1)*rows)`, so its causal frontier moves `i*rows` keys on
    /// ([`shift_queries`]).
    QueryBlocks {
        /// Mesh axes splitting the query rows.
        axes: Vec<usize>,
    },
}

/// `op` (causal `Attention` or `AttentionGrad`) for a block of query rows starting at row
/// `first`: its causal offset grows by `first`. Other ops are returned as they are.
pub fn shift_queries(op: &Op, first: usize) -> Op {
    match op {
        Op::Attention(a) => Op::Attention(ir::AttentionAttrs { offset: a.offset + first, ..*a }),
        Op::AttentionGrad(a) => Op::AttentionGrad(ir::AttentionAttrs { offset: a.offset + first, ..*a }),
        other => other.clone(),
    }
}

/// One way to run an op on the mesh.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Strategy {
    /// Which logical dim each mesh axis splits, e.g. `m@0 n@1`; `P(0)@1` for a linear set;
    /// `replicate` when nothing is split.
    pub name: String,
    /// What experts call it: `dp`, `megatron-col`, `megatron-row`, `zero`, `vocab-parallel`, ...
    pub tags: Vec<&'static str>,
    /// Spec of each input.
    pub inputs: Vec<ShardingSpec>,
    /// Spec of each output.
    pub outputs: Vec<ShardingSpec>,
    /// How each rank computes.
    pub local: Local,
    /// Collectives the op runs itself (not layout conversions), with the bytes they move.
    pub collectives: Vec<(Collective, usize)>,
    /// Compute seconds per rank (roofline of local FLOPs and bytes).
    pub compute_seconds: f64,
    /// Seconds of the op's own collectives.
    pub comm_seconds: f64,
    /// Bytes of the outputs per rank.
    pub memory_bytes: u64,
}

impl Strategy {
    /// Compute plus communication seconds.
    pub fn seconds(&self) -> f64 {
        self.compute_seconds + self.comm_seconds
    }
}

/// What a generator knows about an op's surroundings.
#[derive(Clone, Debug, Default)]
pub struct OpContext {
    /// Inputs that are parameters (weights), for naming strategies.
    pub param_inputs: Vec<bool>,
}

fn ldim(name: impl Into<String>, size: usize, n_in: usize, n_out: usize) -> LogicalDim {
    LogicalDim { name: name.into(), size, ins: vec![InMap::Replicate; n_in], outs: vec![None; n_out], special: None }
}

/// For each output dim, the dim of `input` broadcast to it (right-aligned, equal size), if any.
fn broadcast_map(out: &[usize], input: &[usize]) -> Vec<Option<usize>> {
    let off = out.len() as isize - input.len() as isize;
    (0..out.len())
        .map(|d| {
            let i = d as isize - off;
            (i >= 0 && input[i as usize] == out[d]).then_some(i as usize)
        })
        .collect()
}

/// Elementwise rule over the output's dims; inputs broadcast; `skip` dims are not splittable.
fn elementwise(ins: &[TensorMeta], outs: &[TensorMeta], skip: &[usize]) -> Vec<LogicalDim> {
    let out = &outs[0].shape;
    let maps: Vec<Vec<Option<usize>>> = ins.iter().map(|m| broadcast_map(out, &m.shape)).collect();
    (0..out.len())
        .filter(|d| !skip.contains(d) && out[*d] > 1)
        .map(|d| {
            let mut l = ldim(format!("d{d}"), out[d], ins.len(), outs.len());
            for (i, m) in maps.iter().enumerate() {
                l.ins[i] = m[d].map_or(InMap::Replicate, InMap::Dim);
            }
            for (j, o) in outs.iter().enumerate() {
                l.outs[j] = (o.shape.len() == out.len() && o.shape[d] == out[d]).then_some(d);
            }
            l
        })
        .collect()
}

/// The sharding rule of an op for its input and output metas, or `None` when it has none.
///
/// One arm per variant, no wildcard: a new [`Op`] does not compile until it names the family
/// file with its rule. Each family's rule ends in a `_ => None` arm this match never reaches.
pub fn rule(op: &Op, ins: &[TensorMeta], outs: &[TensorMeta]) -> Option<Rule> {
    use Op::*;
    let r = |dims: Vec<LogicalDim>, linear: Vec<Vec<usize>>| Some(Rule { dims, linear });
    match op {
        Input { .. } | Param { .. } | State { .. } | Constant(_) => r(elementwise(&[], outs, &[]), vec![]),
        Unary(_) | Binary(_) | Where | Identity | Cast { .. } | UnaryGrad(_) | Dropout(_) => {
            elementwise::rule(op, ins, outs)
        }
        SgdUpdate { .. } | AdamWUpdate { .. } => training::rule(op, ins, outs),
        Expand { .. }
        | Reshape { .. }
        | Transpose { .. }
        | Concat { .. }
        | Split { .. }
        | Slice { .. }
        | SliceGrad { .. }
        | Pad { .. }
        | Gather { .. }
        | GatherGrad { .. } => shape::rule(op, ins, outs),
        MatMul | Gemm { .. } => linalg::rule(op, ins, outs),
        Conv(_)
        | ConvInputGrad { .. }
        | ConvWeightGrad { .. }
        | MaxPool(_)
        | AveragePool(_)
        | GlobalAveragePool
        | GlobalMaxPool
        | MaxPoolGrad(_)
        | AveragePoolGrad { .. } => conv::rule(op, ins, outs),
        Lrn { .. }
        | LrnGrad { .. }
        | BatchNorm { .. }
        | BatchNormTrain { .. }
        | BatchNormTrainGrad { .. }
        | LayerNorm { .. }
        | LayerNormGrad { .. }
        | Softmax { .. }
        | LogSoftmax { .. }
        | SoftmaxGrad { .. }
        | Hardmax { .. } => norm::rule(op, ins, outs),
        Resize(_) | ResizeGrad { .. } => resize::rule(op, ins, outs),
        Reduce { .. } => reduce::rule(op, ins, outs),
        Index(x) => index::rule(x, ins, outs),
        Attention(_) | AttentionGrad(_) => attention::rule(op, ins, outs),
        Moe(_) | MoeGrad(_) => moe::rule(op),
    }
}

/// Dims `keep` of an NCHW op, the same in every input and output (pooling and its gradients).
fn channel_dims(ins: &[TensorMeta], outs: &[TensorMeta], keep: &[usize]) -> Vec<LogicalDim> {
    keep.iter()
        .filter(|&&d| outs[0].shape[d] > 1)
        .map(|&d| {
            let mut l = ldim(if d == 0 { "batch" } else { "channel" }, outs[0].shape[d], ins.len(), outs.len());
            l.ins = ins.iter().map(|m| if m.rank() > d { InMap::Dim(d) } else { InMap::Replicate }).collect();
            l.outs = vec![Some(d); outs.len()];
            l
        })
        .collect()
}

/// Reshape: an input dim and an output dim with the same product of the dims before them split
/// into the same contiguous blocks.
fn reshape_dims(a: &[usize], b: &[usize]) -> Vec<LogicalDim> {
    let prefix = |s: &[usize]| -> Vec<usize> {
        let mut p = vec![1; s.len()];
        for i in 1..s.len() {
            p[i] = p[i - 1] * s[i - 1];
        }
        p
    };
    let (pa, pb) = (prefix(a), prefix(b));
    let mut dims = vec![];
    for i in 0..a.len() {
        for j in 0..b.len() {
            if pa[i] == pb[j] && a[i] > 1 && b[j] > 1 {
                let mut l = ldim(format!("d{i}"), gcd(a[i], b[j]), 1, 1);
                l.ins[0] = InMap::Dim(i);
                l.outs[0] = Some(j);
                dims.push(l);
            }
        }
    }
    dims
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

fn matmul_rule(ins: &[TensorMeta], outs: &[TensorMeta]) -> Option<Rule> {
    let (a, b, out) = (&ins[0].shape, &ins[1].shape, &outs[0].shape);
    if a.len() < 2 || b.len() < 2 {
        // 1-D operands: replicated only.
        return Some(Rule { dims: vec![], linear: vec![vec![0], vec![1]] });
    }
    let r = out.len();
    let mut dims = vec![];
    let amap = broadcast_map(&out[..r - 2], &a[..a.len() - 2]);
    let bmap = broadcast_map(&out[..r - 2], &b[..b.len() - 2]);
    for d in 0..r - 2 {
        if out[d] <= 1 {
            continue;
        }
        let mut l = ldim(if d == 0 { "batch".to_string() } else { format!("b{d}") }, out[d], 2, 1);
        l.ins[0] = amap[d].map_or(InMap::Replicate, InMap::Dim);
        l.ins[1] = bmap[d].map_or(InMap::Replicate, InMap::Dim);
        l.outs[0] = Some(d);
        dims.push(l);
    }
    let mut m = ldim("m", a[a.len() - 2], 2, 1);
    m.ins[0] = InMap::Dim(a.len() - 2);
    m.outs[0] = Some(r - 2);
    let mut n = ldim("n", b[b.len() - 1], 2, 1);
    n.ins[1] = InMap::Dim(b.len() - 1);
    n.outs[0] = Some(r - 1);
    let mut k = ldim("k", a[a.len() - 1], 2, 1);
    k.ins[0] = InMap::Dim(a.len() - 1);
    k.ins[1] = InMap::Dim(b.len() - 2);
    dims.extend([m, n, k]);
    Some(Rule { dims, linear: vec![vec![0], vec![1]] })
}

/// What one mesh axis does in a strategy.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Choice {
    Nothing,
    Dim(usize),
    Linear(usize),
}

/// The op with its shape attributes made local.
pub fn local_op(op: &Op, local_ins: &[TensorMeta], local_outs: &[Vec<usize>]) -> Op {
    let mut op = op.clone();
    match &mut op {
        Op::Reshape { shape } | Op::Expand { shape } => *shape = local_outs[0].clone(),
        Op::ConvInputGrad { shape, .. }
        | Op::ConvWeightGrad { shape, .. }
        | Op::AveragePoolGrad { shape, .. }
        | Op::SliceGrad { shape, .. }
        | Op::ResizeGrad { shape, .. } => *shape = local_outs[0].clone(),
        // With a split gathered axis (`MaskedScatter`) the local table has the local rows.
        Op::GatherGrad { shape, .. } => *shape = local_outs[0].clone(),
        Op::Split { sizes, axis } => {
            let _ = local_ins;
            *sizes = local_outs.iter().map(|s| s[*axis]).collect();
        }
        // No attribute sizes a dim that [`rule`] lets split (axes, pads, windows and slices are
        // on whole dims). Listed one by one (no wildcard), so a new op decides here.
        Op::Input { .. }
        | Op::Param { .. }
        | Op::Constant(_)
        | Op::Unary(_)
        | Op::Binary(_)
        | Op::Where
        | Op::Cast { .. }
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
        | Op::Transpose { .. }
        | Op::Concat { .. }
        | Op::Slice { .. }
        | Op::Gather { .. }
        | Op::Reduce { .. }
        | Op::Pad { .. }
        | Op::State { .. }
        | Op::UnaryGrad(_)
        | Op::SoftmaxGrad { .. }
        | Op::LayerNormGrad { .. }
        | Op::LrnGrad { .. }
        | Op::MaxPoolGrad(_)
        | Op::SgdUpdate { .. }
        | Op::AdamWUpdate { .. }
        | Op::Resize(_)
        | Op::BatchNormTrain { .. }
        | Op::BatchNormTrainGrad { .. }
        | Op::Hardmax { .. }
        | Op::Index(_)
        | Op::Attention(_)
        | Op::AttentionGrad(_)
        | Op::Moe(_)
        | Op::MoeGrad(_)
        | Op::Dropout(_) => {}
    }
    op
}

/// Every strategy of an op on a mesh (see the module docs).
pub fn expand(
    op: &Op,
    ins: &[TensorMeta],
    outs: &[TensorMeta],
    ctx: &OpContext,
    mesh: &DeviceMesh,
    profile: &DeviceProfile,
) -> Option<Vec<Strategy>> {
    let rule = rule(op, ins, outs)?;
    let axes: Vec<usize> = (0..mesh.ndim()).filter(|&a| mesh.shape()[a] > 1).collect();
    let mut choices_per_axis = vec![Choice::Nothing];
    choices_per_axis.extend((0..rule.dims.len()).map(Choice::Dim));
    choices_per_axis.extend((0..rule.linear.len()).map(Choice::Linear));
    let mut out: Vec<Strategy> = vec![];
    // Assignments that give the same layouts and local computation are one strategy (the first
    // one's name is kept). A hash set: a linear scan made enumeration quadratic in the number of
    // strategies, which on meshes of 4 or more axes runs to thousands.
    let mut seen: std::collections::HashSet<(Vec<ShardingSpec>, Vec<ShardingSpec>, Local), crate::fx::BuildFx> =
        Default::default();
    let mut assign = vec![Choice::Nothing; axes.len()];
    loop {
        if let Some(s) = build(op, ins, outs, ctx, mesh, profile, &rule, &axes, &assign)
            && seen.insert((s.inputs.clone(), s.outputs.clone(), s.local.clone()))
        {
            out.push(s);
        }
        // Next assignment (odometer over axes).
        let mut i = 0;
        loop {
            if i == axes.len() {
                return Some(out);
            }
            let pos = choices_per_axis.iter().position(|c| *c == assign[i]).unwrap_or(0);
            if pos + 1 < choices_per_axis.len() {
                assign[i] = choices_per_axis[pos + 1];
                break;
            }
            assign[i] = Choice::Nothing;
            i += 1;
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn build(
    op: &Op,
    ins: &[TensorMeta],
    outs: &[TensorMeta],
    ctx: &OpContext,
    mesh: &DeviceMesh,
    profile: &DeviceProfile,
    rule: &Rule,
    axes: &[usize],
    assign: &[Choice],
) -> Option<Strategy> {
    let mut in_dims: Vec<Vec<Vec<usize>>> = ins.iter().map(|m| vec![vec![]; m.rank()]).collect();
    let mut in_partial: Vec<Vec<usize>> = vec![vec![]; ins.len()];
    let mut out_dims: Vec<Vec<Vec<usize>>> = outs.iter().map(|m| vec![vec![]; m.rank()]).collect();
    let mut out_partial: Vec<Vec<usize>> = vec![vec![]; outs.len()];
    let mut special: Option<(SpecialKind, Vec<usize>)> = None;
    let mut names = vec![];
    let mut split_of: Vec<Vec<usize>> = vec![vec![]; rule.dims.len()];
    for (&a, &c) in axes.iter().zip(assign) {
        match c {
            Choice::Nothing => {}
            Choice::Dim(k) => {
                let l = &rule.dims[k];
                split_of[k].push(a);
                names.push(format!("{}@{a}", l.name));
                if let Some(kind) = l.special {
                    match &mut special {
                        None => special = Some((kind, vec![a])),
                        Some((_, v)) => v.push(a),
                    }
                }
                for (i, m) in l.ins.iter().enumerate() {
                    match m {
                        InMap::Dim(d) => in_dims[i][*d].push(a),
                        InMap::Replicate => {}
                        InMap::Partial => in_partial[i].push(a),
                    }
                }
                for (j, m) in l.outs.iter().enumerate() {
                    match m {
                        Some(d) => out_dims[j][*d].push(a),
                        None => out_partial[j].push(a),
                    }
                }
            }
            Choice::Linear(s) => {
                names.push(format!(
                    "P({})@{a}",
                    rule.linear[s].iter().map(|i| i.to_string()).collect::<Vec<_>>().join(",")
                ));
                for &i in &rule.linear[s] {
                    in_partial[i].push(a);
                }
                for p in &mut out_partial {
                    p.push(a);
                }
            }
        }
    }
    // A special dim must be the only split of its kind, and not mixed with partial inputs.
    if special.is_some()
        && (rule.dims.iter().filter(|l| l.special.is_some()).count() > 1 || in_partial.iter().any(|p| !p.is_empty()))
    {
        return None;
    }
    for (k, l) in rule.dims.iter().enumerate() {
        if !l.size.is_multiple_of(mesh.group_size(&split_of[k])) {
            return None;
        }
    }
    let inputs: Vec<ShardingSpec> = in_dims.into_iter().zip(in_partial).map(|(d, p)| ShardingSpec::new(d, p)).collect();
    let outputs: Vec<ShardingSpec> =
        out_dims.into_iter().zip(out_partial).map(|(d, p)| ShardingSpec::new(d, p)).collect();
    let local = match &special {
        None => Local::Same,
        // The vocab dim has no output dim, so the output is already partial over `ax`.
        Some((SpecialKind::MaskedGather, ax)) => Local::MaskedGather { axes: ax.clone() },
        Some((SpecialKind::SplitSoftmax, ax)) => Local::SplitSoftmax { axes: ax.clone() },
        Some((SpecialKind::MaskedScatter, ax)) => Local::MaskedScatter { axes: ax.clone() },
        Some((SpecialKind::QueryBlocks, ax)) => Local::QueryBlocks { axes: ax.clone() },
    };
    for (s, m) in inputs.iter().zip(ins).chain(outputs.iter().zip(outs)) {
        s.check(&m.shape, mesh).ok()?;
    }
    // Integer and boolean tensors are never partial sums.
    for (s, m) in inputs.iter().zip(ins).chain(outputs.iter().zip(outs)) {
        if s.is_partial() && !m.dtype.is_float() {
            return None;
        }
    }
    let local_ins: Vec<TensorMeta> =
        inputs.iter().zip(ins).map(|(s, m)| TensorMeta::new(m.dtype, s.local_shape(&m.shape, mesh))).collect();
    let local_outs: Vec<TensorMeta> =
        outputs.iter().zip(outs).map(|(s, m)| TensorMeta::new(m.dtype, s.local_shape(&m.shape, mesh))).collect();
    // Query blocks of a causal attention differ in work: the last attends the most keys, and the
    // step waits for it.
    let priced = match &local {
        Local::QueryBlocks { axes } => {
            let rows = local_ins.first().and_then(|q| q.shape.get(2)).copied().unwrap_or(0);
            shift_queries(op, (mesh.group_size(axes) - 1) * rows)
        }
        _ => op.clone(),
    };
    let op = &priced;
    let (flops, bytes) = crate::mesh::op_work(op, &local_ins, &local_outs);
    let memory: usize = local_outs.iter().map(|m| m.bytes()).sum();
    let mut collectives = vec![];
    if let Local::SplitSoftmax { axes } = &local {
        let axis = match op {
            Op::Softmax { axis } | Op::LogSoftmax { axis } => *axis,
            _ => return None,
        };
        let row_bytes = local_outs[0].bytes() / local_outs[0].shape[axis].max(1);
        collectives.push((Collective::AllReduce { axes: axes.clone(), op: ReduceKind::Max }, row_bytes));
        collectives.push((Collective::AllReduce { axes: axes.clone(), op: ReduceKind::Sum }, row_bytes));
    }
    let comm = collectives.iter().fold(0.0, |acc, (c, b)| acc + c.cost(*b, mesh));
    let name = if names.is_empty() { "replicate".to_string() } else { names.join(" ") };
    let tags = tags(op, rule, assign, ctx, &inputs, &outputs, mesh);
    Some(Strategy {
        name,
        tags,
        inputs,
        outputs,
        local,
        collectives,
        compute_seconds: profile.op_compute_seconds(
            op,
            &local_ins,
            ins.iter().map(|m| m.dtype).find(|d| d.is_float()).unwrap_or(ir::DType::F32),
            flops,
            bytes,
        ),
        comm_seconds: comm,
        memory_bytes: memory as u64,
    })
}

/// Expert names for a strategy. The data axis is mesh axis 0 (outermost) on meshes of 2+ axes,
/// as Megatron lays out data x tensor; on a 1-D mesh, the one axis.
#[allow(clippy::too_many_arguments)]
fn tags(
    op: &Op,
    rule: &Rule,
    assign: &[Choice],
    ctx: &OpContext,
    inputs: &[ShardingSpec],
    outputs: &[ShardingSpec],
    mesh: &DeviceMesh,
) -> Vec<&'static str> {
    let mut t: Vec<&'static str> = vec![];
    let split: Vec<&str> = assign
        .iter()
        .filter_map(|c| match c {
            Choice::Dim(k) => Some(rule.dims[*k].name.as_str()),
            _ => None,
        })
        .collect();
    let has = |n: &str| split.contains(&n);
    if assign.iter().all(|c| *c == Choice::Nothing) {
        t.push("replicated");
    }
    let weight = |i: usize| ctx.param_inputs.get(i).copied().unwrap_or(false);
    match op {
        Op::MatMul | Op::Gemm { .. } if weight(1) => {
            if has("m") || has("batch") || has("b1") {
                t.push("dp");
            }
            if has("n") {
                t.push("megatron-col");
            }
            if has("k") {
                t.push("megatron-row");
            }
        }
        Op::MatMul if !weight(0) && !weight(1) => {
            if has("batch") {
                t.push("dp");
            }
            if split.iter().any(|n| n.starts_with('b') && *n != "batch") {
                t.push("head-parallel");
            }
        }
        Op::Gather { .. } => {
            if has("i0") {
                t.push("dp");
            }
            if split.iter().any(|n| n.starts_with('i') && *n != "i0") {
                t.push("sequence-parallel");
            }
            if has("vocab") {
                t.push("vocab-parallel");
            }
        }
        Op::Softmax { .. } | Op::LogSoftmax { .. } | Op::GatherGrad { .. } if has("vocab") => t.push("vocab-parallel"),
        Op::Attention(_) | Op::AttentionGrad(_) => {
            if has("batch") {
                t.push("dp");
            }
            if has("heads") {
                t.push("head-parallel");
            }
            if has("q") {
                t.push("sequence-parallel");
            }
        }
        // Replicated only for now (see `strategy/moe.rs`): "replicated" above is its name.
        Op::Moe(_) | Op::MoeGrad(_) => {}
        Op::SgdUpdate { .. } | Op::AdamWUpdate { .. } | Op::Param { .. } | Op::State { .. } => {
            let data = 0;
            if mesh.shape()[data] > 1
                && inputs.iter().chain(outputs).any(|s| s.dims().iter().any(|d| d.contains(&data)))
            {
                t.push("zero");
            }
            if inputs.iter().chain(outputs).any(|s| s.dims().iter().flatten().any(|&a| a != data)) {
                t.push("tensor-parallel");
            }
        }
        // The generic names. Every variant is listed (the guarded ones above reappear), so a
        // new op decides here whether it has names of its own.
        Op::Input { .. }
        | Op::Constant(_)
        | Op::Unary(_)
        | Op::Binary(_)
        | Op::Where
        | Op::Cast { .. }
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
        | Op::Reduce { .. }
        | Op::Pad { .. }
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
        | Op::Resize(_)
        | Op::ResizeGrad { .. }
        | Op::BatchNormTrain { .. }
        | Op::BatchNormTrainGrad { .. }
        | Op::Hardmax { .. }
        | Op::Index(_)
        | Op::Dropout(_) => {
            if has("d0") || has("batch") {
                t.push("dp");
            }
            // Transformer activations are [batch, seq, hidden].
            if outputs.first().is_some_and(|o| o.rank() == 3) && has("d1") {
                t.push("sequence-parallel");
            }
        }
    }
    let matmul_dims = ["m", "n", "k"].iter().filter(|n| has(n)).count();
    if matches!(op, Op::MatMul | Op::Gemm { .. }) && matmul_dims >= 2 {
        t.push("2d");
    }
    t
}

/// Strategies of node `n` of a graph (inputs from its producers' metas).
pub fn strategies(g: &Graph, n: NodeIndex, mesh: &DeviceMesh, profile: &DeviceProfile) -> Result<Vec<Strategy>> {
    let node = g.node(n);
    let ins: Vec<TensorMeta> = g.node_inputs(n).iter().map(|v| g.meta(*v).clone()).collect();
    let ctx = OpContext {
        param_inputs: g.node_inputs(n).iter().map(|v| matches!(g.node(v.node).op, Op::Param { .. })).collect(),
    };
    expand(&node.op, &ins, &node.outputs, &ctx, mesh, profile).ok_or_else(|| Error::NoRule {
        node: node.name.clone(),
        op: node.op.name().to_string(),
        why: "the op has no sharding rule".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir::DType;

    fn f(shape: &[usize]) -> TensorMeta {
        TensorMeta::new(DType::F32, shape.to_vec())
    }

    #[test]
    fn matmul_on_2x2() {
        let mesh = DeviceMesh::uniform(&[2, 2]).unwrap();
        let cpu = DeviceProfile::builtin("cpu").unwrap();
        let ctx = OpContext { param_inputs: vec![false, true] };
        let s = expand(&Op::MatMul, &[f(&[4, 8]), f(&[8, 6])], &[f(&[4, 6])], &ctx, &mesh, &cpu).unwrap();
        let find = |name: &str| s.iter().find(|x| x.name == name).unwrap();
        let col = find("n@1");
        assert_eq!(col.inputs[1].to_string(), "R S1");
        assert!(col.tags.contains(&"megatron-col"));
        let row = find("k@1");
        assert_eq!(row.outputs[0].to_string(), "R R | P1");
        let dp_col = find("m@0 n@1");
        assert_eq!(dp_col.outputs[0].to_string(), "S0 S1");
        assert!(s.iter().any(|x| x.name == "m@0 m@1" && x.inputs[0].to_string() == "S01 R"));
    }
}
