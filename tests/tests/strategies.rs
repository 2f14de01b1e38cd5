//! Strategy validation by execution (issue 4, acceptance 3; the idea of DTensor's
//! `strategy_validation.py`).
//!
//! Small training graphs (forward, loss, backward and optimizer update, built by
//! `ir::autodiff::training_graph`) cover every op family of the forward and training graphs. For
//! every non-source node and every strategy `sharding::strategies` claims for it on the meshes
//! 1x2, 2x2 and 2x4, the test
//! 1. draws random global inputs and distributes them into per-rank blocks by the strategy's input
//!    specs (a partial input is split into random addends, not "all on member 0"),
//! 2. runs the strategy on every rank: the op on local blocks through the CPU kernels
//!    (`sharding::strategy::local_op` makes shape attributes local) or the strategy's special local
//!    computation with its collectives executed by `sharding::sim`,
//! 3. reassembles each output by its output spec (replicas must agree) and compares it with the
//!    single-device result of the same op on the global inputs.
//!
//! Training-mode dropout runs with a step's draw on both sides: the single device over the
//! whole tensor, each rank over its block at the offsets its output spec gives it, so a
//! strategy whose blocks drew other masks than the whole tensor's would differ (O(1)).
//!
//! Tolerance: norm-wise relative error `||sharded - single|| / max(||single||, 1e-6) <= 1e-5` for
//! f32 (a split sum adds the same terms in another order: errors of a few f32 ulps of the sum,
//! ~1e-7 relative at these sizes), exact for i64 and bool. A false claim (wrong spec, a dim that is
//! not really splittable) gives O(1) errors. The test prints how many strategies were validated.

use std::collections::BTreeMap;

use anyhow::{Context, Result, bail, ensure};
use ir::autodiff::{LossSpec, Optimizer, TrainOptions, training_graph};
use ir::{
    BinaryOp, ConvAttrs, DType, Data, Graph, Op, PoolAttrs, ReduceOp, SliceAxis, Tensor, TensorMeta, UnaryOp, Value,
};
use kernels::cpu::{CpuContext, eval};
use sharding::collective::{Collective, ReduceKind};
use sharding::strategy::{Local, local_op};
use sharding::{DeviceMesh, DeviceProfile, ShardingSpec, Strategy, sim};

const TOL: f64 = 1e-5;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn f32m(shape: &[usize]) -> TensorMeta {
    TensorMeta::new(DType::F32, shape.to_vec())
}

fn param(g: &mut Graph, name: &str, shape: &[usize]) -> Value {
    g.param(name, f32m(shape), None)
}

fn op(g: &mut Graph, name: &str, o: Op, ins: &[Value]) -> Result<Value> {
    g.add1(name, o, ins).with_context(|| format!("building {name}"))
}

fn conv_attrs(pads: [usize; 4], group: usize) -> ConvAttrs {
    ConvAttrs { strides: [1, 1], pads, dilations: [1, 1], group }
}

fn pool(k: usize) -> PoolAttrs {
    PoolAttrs {
        kernel: [k, k],
        strides: [k, k],
        pads: [0; 4],
        dilations: [1, 1],
        ceil_mode: false,
        count_include_pad: false,
    }
}

/// A transformer-like block: layer norm, MLP with gelu, residual, attention matmuls, softmax, gemm.
fn block() -> Result<(Graph, LossSpec, Optimizer)> {
    let mut g = Graph::new("block");
    let x = g.input("x", f32m(&[4, 8, 16]));
    let (ls, lb) = (param(&mut g, "ln.g", &[16]), param(&mut g, "ln.b", &[16]));
    let ln = op(&mut g, "ln", Op::LayerNorm { axis: 2, epsilon: 1e-5 }, &[x, ls, lb])?;
    let w1 = param(&mut g, "fc1.w", &[16, 32]);
    let b1 = param(&mut g, "fc1.b", &[32]);
    let h = op(&mut g, "fc1", Op::MatMul, &[ln, w1])?;
    let h = op(&mut g, "fc1.bias", Op::Binary(BinaryOp::Add), &[h, b1])?;
    let a = op(&mut g, "gelu", Op::Unary(UnaryOp::Gelu), &[h])?;
    let w2 = param(&mut g, "fc2.w", &[32, 16]);
    let o = op(&mut g, "fc2", Op::MatMul, &[a, w2])?;
    let r = op(&mut g, "residual", Op::Binary(BinaryOp::Add), &[o, x])?;
    let q = op(&mut g, "heads", Op::Reshape { shape: vec![4, 8, 2, 8] }, &[r])?;
    let q = op(&mut g, "heads.t", Op::Transpose { perm: vec![0, 2, 1, 3] }, &[q])?;
    let kt = op(&mut g, "k.t", Op::Transpose { perm: vec![0, 1, 3, 2] }, &[q])?;
    let s = op(&mut g, "scores", Op::MatMul, &[q, kt])?;
    let sc = g.constant("scale", Tensor::scalar_f32(0.35));
    let s = op(&mut g, "scaled", Op::Binary(BinaryOp::Mul), &[s, sc])?;
    let p = op(&mut g, "softmax", Op::Softmax { axis: 3 }, &[s])?;
    let c = op(&mut g, "context", Op::MatMul, &[p, q])?;
    let c = op(&mut g, "merge.t", Op::Transpose { perm: vec![0, 2, 1, 3] }, &[c])?;
    let c = op(&mut g, "merge", Op::Reshape { shape: vec![32, 16] }, &[c])?;
    let t = op(&mut g, "tanh", Op::Unary(UnaryOp::Tanh), &[c])?;
    let w3 = param(&mut g, "out.w", &[8, 16]);
    let b3 = param(&mut g, "out.b", &[8]);
    let y = op(&mut g, "out", Op::Gemm { alpha: 1.0, beta: 1.0, trans_a: false, trans_b: true }, &[t, w3, b3])?;
    g.set_output("y", y);
    let loss = LossSpec::Mse { output: "y".into(), target: "target".into() };
    Ok((g, loss, Optimizer::AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.999, epsilon: 1e-8, weight_decay: 0.01 }))
}

/// Embedding, log-softmax cross-entropy on next tokens (gather, slices, scatter-add gradient).
fn lm() -> Result<(Graph, LossSpec, Optimizer)> {
    let mut g = Graph::new("lm");
    let ids = g.input("ids", TensorMeta::new(DType::I64, vec![4, 9]));
    let table = param(&mut g, "wte", &[16, 8]);
    let e = op(&mut g, "embed", Op::Gather { axis: 0 }, &[table, ids])?;
    let w = param(&mut g, "head", &[8, 16]);
    let logits = op(&mut g, "logits", Op::MatMul, &[e, w])?;
    g.set_output("logits", logits);
    let loss = LossSpec::NextTokenCe { output: "logits".into(), input_ids: "ids".into() };
    Ok((g, loss, Optimizer::Sgd { lr: 0.1, momentum: 0.9, weight_decay: 0.01 }))
}

/// Convolutions (with and without bias, grouped, transposed), batch norm, pooling, resize, LRN,
/// global pooling, gemm.
fn cnn() -> Result<(Graph, LossSpec, Optimizer)> {
    let mut g = Graph::new("cnn");
    let x = g.input("x", f32m(&[4, 4, 8, 8]));
    let w = param(&mut g, "c1.w", &[8, 4, 3, 3]);
    let b = param(&mut g, "c1.b", &[8]);
    let h = op(&mut g, "c1", Op::Conv(conv_attrs([1; 4], 1)), &[x, w, b])?;
    let bn: Vec<Value> = ["bn.s", "bn.b", "bn.m", "bn.v"].iter().map(|n| param(&mut g, n, &[8])).collect();
    let mut ins = vec![h];
    ins.extend(bn);
    let h = op(&mut g, "bn", Op::BatchNorm { epsilon: 1e-5 }, &ins)?;
    let h = op(&mut g, "relu", Op::Unary(UnaryOp::Relu), &[h])?;
    let h = op(&mut g, "maxpool", Op::MaxPool(pool(2)), &[h])?;
    let w2 = param(&mut g, "c2.w", &[8, 8, 3, 3]);
    let h = op(&mut g, "c2", Op::Conv(conv_attrs([1; 4], 1)), &[h, w2])?;
    let wd = param(&mut g, "dw.w", &[8, 1, 3, 3]);
    let h = op(&mut g, "depthwise", Op::Conv(conv_attrs([1; 4], 8)), &[h, wd])?;
    // A transposed convolution (ONNX ConvTranspose) up 2x, then a linear Resize down 2x.
    let wt = param(&mut g, "deconv.w", &[8, 8, 2, 2]);
    let deconv =
        Op::ConvInputGrad { attrs: ConvAttrs { strides: [2, 2], ..conv_attrs([0; 4], 1) }, shape: vec![4, 8, 8, 8] };
    let h = op(&mut g, "deconv", deconv, &[h, wt])?;
    let down = |axis| ir::ResizeAxis { axis, size: 4, scale: 0.5 };
    let resize = ir::ResizeAttrs {
        axes: vec![down(2), down(3)],
        mode: ir::ResizeMode::Linear,
        coord: ir::CoordTransform::HalfPixel,
        nearest_mode: ir::NearestMode::RoundPreferFloor,
        cubic_a: -0.75,
        exclude_outside: false,
    };
    let h = op(&mut g, "resize", Op::Resize(resize), &[h])?;
    let h = op(&mut g, "avgpool", Op::AveragePool(pool(2)), &[h])?;
    let h = op(&mut g, "lrn", Op::Lrn { size: 3, alpha: 0.5, beta: 0.75, bias: 1.0 }, &[h])?;
    let gmax = op(&mut g, "gmp", Op::GlobalMaxPool, &[h])?;
    let h = op(&mut g, "gap", Op::GlobalAveragePool, &[h])?;
    let h = op(&mut g, "pools", Op::Binary(BinaryOp::Add), &[h, gmax])?;
    let h = op(&mut g, "flatten", Op::Reshape { shape: vec![4, 8] }, &[h])?;
    let fw = param(&mut g, "fc.w", &[8, 4]);
    let y = op(&mut g, "fc", Op::Gemm { alpha: 1.0, beta: 0.0, trans_a: false, trans_b: false }, &[h, fw])?;
    g.set_output("y", y);
    let loss = LossSpec::CrossEntropy { output: "y".into(), labels: "labels".into() };
    Ok((g, loss, Optimizer::Sgd { lr: 0.1, momentum: 0.0, weight_decay: 0.0 }))
}

/// Shape and reduction ops: split, concat, strided slice, pad, expand, reductions, where, div,
/// sqrt, log-softmax.
fn shapes() -> Result<(Graph, LossSpec, Optimizer)> {
    let mut g = Graph::new("shapes");
    let x = param(&mut g, "x", &[8, 16]);
    let parts = g.add_op("split", Op::Split { axis: 1, sizes: vec![8, 8] }, &[x])?;
    let c = op(&mut g, "concat", Op::Concat { axis: 0 }, &[parts[0], parts[1]])?;
    let s = op(&mut g, "slice", Op::Slice { axes: vec![SliceAxis { axis: 0, start: 0, len: 8, step: 2 }] }, &[c])?;
    let p = op(&mut g, "pad", Op::Pad { pads: vec![0, 0, 0, 8], value: 0.0 }, &[s])?;
    let v = param(&mut g, "v", &[8, 1]);
    let e = op(&mut g, "expand", Op::Expand { shape: vec![8, 16] }, &[v])?;
    let m = op(&mut g, "mul", Op::Binary(BinaryOp::Mul), &[p, e])?;
    let rs = op(&mut g, "rsum", Op::Reduce { op: ReduceOp::Sum, axes: vec![1], keepdims: true }, &[m])?;
    let rm = op(&mut g, "rmax", Op::Reduce { op: ReduceOp::Max, axes: vec![1], keepdims: true }, &[m])?;
    let d = op(&mut g, "div", Op::Binary(BinaryOp::Div), &[m, rs])?;
    let d = op(&mut g, "sub", Op::Binary(BinaryOp::Sub), &[d, rm])?;
    let cond = g.constant("cond", Tensor::bool(vec![8, 16], (0..128).map(|i| i % 3 == 0).collect()));
    let w = op(&mut g, "where", Op::Where, &[cond, d, m])?;
    let sq = op(&mut g, "square", Op::Binary(BinaryOp::Mul), &[w, w])?;
    let eps = g.constant("eps", Tensor::scalar_f32(1.0));
    let sq = op(&mut g, "shift", Op::Binary(BinaryOp::Add), &[sq, eps])?;
    let r = op(&mut g, "sqrt", Op::Unary(UnaryOp::Sqrt), &[sq])?;
    let l = op(&mut g, "logsoftmax", Op::LogSoftmax { axis: 1 }, &[r])?;
    let l = op(&mut g, "identity", Op::Identity, &[l])?;
    let k = g.constant("k", Tensor::i64(vec![16], (0..16).collect()));
    let k = op(&mut g, "cast", Op::Cast { to: DType::F32 }, &[k])?;
    let l = op(&mut g, "scale", Op::Binary(BinaryOp::Mul), &[l, k])?;
    let ss = op(&mut g, "sumsq", Op::Reduce { op: ReduceOp::SumSquare, axes: vec![1], keepdims: true }, &[l])?;
    let l = op(&mut g, "plus_sumsq", Op::Binary(BinaryOp::Add), &[l, ss])?;
    let y = op(&mut g, "mean", Op::Reduce { op: ReduceOp::Mean, axes: vec![0], keepdims: false }, &[l])?;
    g.set_output("y", y);
    let loss = LossSpec::Mse { output: "y".into(), target: "t".into() };
    Ok((g, loss, Optimizer::AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.999, epsilon: 1e-8, weight_decay: 0.0 }))
}

/// The indexing family (`ir::IndexOp`) and the scatters, gathers and cumulative sums its
/// gradients emit. Indexed dims have at least 4 elements: random indices are drawn below 4.
fn indexing() -> Result<(Graph, LossSpec, Optimizer)> {
    use ir::{IndexOp, ScatterReduction as R};
    let mut g = Graph::new("indexing");
    let ix = |o: IndexOp| Op::Index(o);
    let x = param(&mut g, "x", &[8, 4]);
    let u = param(&mut g, "u", &[8, 4]);
    let t = op(&mut g, "tril", ix(IndexOp::Trilu { upper: false, k: 0 }), &[x])?;
    let c = op(&mut g, "cumsum", ix(IndexOp::CumSum { axis: 1, exclusive: false, reverse: true }), &[t])?;
    let ie = g.constant("ie", Tensor::i64(vec![8, 4], (0..32).map(|i| (i * 5 % 4) as i64).collect()));
    let ge = op(&mut g, "gather_elements", ix(IndexOp::GatherElements { axis: 1 }), &[c, ie])?;
    let se = ix(IndexOp::ScatterElements { axis: 1, reduction: R::None });
    let se = op(&mut g, "scatter_elements", se, &[ge, ie, u])?;
    let rows = g.constant("rows", Tensor::i64(vec![3, 1], vec![1, 6, 1]));
    let gn = op(&mut g, "gather_nd", ix(IndexOp::GatherNd { batch_dims: 0 }), &[se, rows])?;
    let sn = op(&mut g, "scatter_nd", ix(IndexOp::ScatterNd { reduction: R::Add }), &[x, rows, gn])?;
    let sn = op(&mut g, "sum", Op::Binary(BinaryOp::Add), &[sn, se])?;
    let tk = g.add_op("topk", ix(IndexOp::TopK { axis: 1, k: 2, largest: true }), &[sn])?;
    let am = op(&mut g, "argmax", ix(IndexOp::ArgMax { axis: 1, keepdims: true, select_last: false }), &[sn])?;
    let am = op(&mut g, "cast", Op::Cast { to: DType::F32 }, &[am])?;
    let y = op(&mut g, "scale", Op::Binary(BinaryOp::Mul), &[tk[0], am])?;
    let y = op(&mut g, "mean", Op::Reduce { op: ReduceOp::Mean, axes: vec![0], keepdims: false }, &[y])?;
    g.set_output("y", y);
    let loss = LossSpec::Mse { output: "y".into(), target: "t".into() };
    Ok((g, loss, Optimizer::Sgd { lr: 0.1, momentum: 0.0, weight_decay: 0.0 }))
}

/// Dropouts (training mode, with and without the mask output), their mask read by the model,
/// and their gradients (the same op on the output gradient).
fn dropout() -> Result<(Graph, LossSpec, Optimizer)> {
    let mut g = Graph::new("dropout");
    let x = param(&mut g, "x", &[4, 8, 6]);
    let d = g.add_op("drop", Op::Dropout(ir::DropoutAttrs { ratio: 0.3, id: 0, mask: true }), &[x])?;
    let m = op(&mut g, "mask", Op::Cast { to: DType::F32 }, &[d[1]])?;
    let z = op(&mut g, "plus_mask", Op::Binary(BinaryOp::Add), &[d[0], m])?;
    let z = op(&mut g, "drop2", Op::Dropout(ir::DropoutAttrs { ratio: 0.5, id: 1, mask: false }), &[z])?;
    let y = op(&mut g, "mean", Op::Reduce { op: ReduceOp::Mean, axes: vec![0], keepdims: false }, &[z])?;
    g.set_output("y", y);
    let loss = LossSpec::Mse { output: "y".into(), target: "t".into() };
    Ok((g, loss, Optimizer::Sgd { lr: 0.1, momentum: 0.0, weight_decay: 0.0 }))
}

/// The stream every dropout of the test draws from.
const STREAM: kernels::random::Stream = kernels::random::Stream { seed: 5, step: 3, microbatch: 1 };

/// Dropout `a` of a block `x` at `offsets` of a tensor of `shape`, drawing from [`STREAM`].
fn dropout_at(
    ctx: &CpuContext,
    a: &ir::DropoutAttrs,
    x: &Tensor,
    shape: &[usize],
    offsets: Vec<usize>,
) -> Result<Vec<Tensor>> {
    let draw = kernels::random::Draw { stream: STREAM, shape: shape.to_vec(), offsets };
    Ok(kernels::cpu::random::dropout(ctx, a, x, Some(&draw))?)
}

/// Random inputs for a node: f32 in [0.2, 1.2) (positive: valid for sqrt/log/var), i64 indices
/// within the gathered axis, the AdamW step 2, random booleans.
fn random_inputs(rng: &mut Rng, o: &Op, ins: &[TensorMeta]) -> Vec<Tensor> {
    ins.iter()
        .enumerate()
        .map(|(i, m)| {
            let n = m.numel();
            match m.dtype {
                DType::F32 => Tensor::f32(m.shape.clone(), (0..n).map(|_| 0.2 + rng.unit()).collect()),
                DType::F64 => Tensor::f64(m.shape.clone(), (0..n).map(|_| 0.2 + rng.unit() as f64).collect()),
                DType::BF16 | DType::F16 => {
                    Tensor::f32(m.shape.clone(), (0..n).map(|_| 0.2 + rng.unit()).collect()).with_float_type(m.dtype)
                }
                DType::Bool => Tensor::bool(m.shape.clone(), (0..n).map(|_| rng.below(2) == 1).collect()),
                DType::I64 => {
                    let bound = match o {
                        Op::Gather { axis } if i == 1 => ins[0].shape[*axis],
                        Op::GatherGrad { axis, shape } if i == 0 => shape[*axis],
                        Op::AdamWUpdate { .. } => return Tensor::i64(m.shape.clone(), vec![2; n]),
                        _ => 4,
                    };
                    Tensor::i64(m.shape.clone(), (0..n).map(|_| rng.below(bound) as i64).collect())
                }
            }
        })
        .collect()
}

/// Per-rank blocks of `t` under `spec`; a partial group's members get random addends (the same on
/// replicas, as replicas of a partial value hold the same addends).
fn distribute(rng: &mut Rng, t: &Tensor, spec: &ShardingSpec, mesh: &DeviceMesh) -> Result<Vec<Tensor>> {
    let mut blocks = sim::distribute(t, spec, mesh)?;
    if spec.is_partial() {
        let mut noise: BTreeMap<(usize, Vec<usize>), Vec<f32>> = BTreeMap::new();
        for (r, b) in blocks.iter().enumerate() {
            let i = mesh.index_in_group(r, spec.partial());
            let key = (i, spec.offsets(t.shape(), mesh, r));
            let n = b.numel();
            noise.entry(key).or_insert_with(|| (0..n).map(|_| rng.unit() - 0.5).collect());
        }
        for (r, b) in blocks.iter_mut().enumerate() {
            let off = spec.offsets(t.shape(), mesh, r);
            let i = mesh.index_in_group(r, spec.partial());
            let v: Vec<f32> = if i == 0 {
                let mut v = b.to_f32_vec();
                for j in 1..mesh.group_size(spec.partial()) {
                    for (x, e) in v.iter_mut().zip(&noise[&(j, off.clone())]) {
                        *x -= e;
                    }
                }
                v
            } else {
                noise[&(i, off)].clone()
            };
            *b = Tensor::f32(b.shape().to_vec(), v);
        }
    }
    Ok(blocks)
}

fn eval1(ctx: &CpuContext, o: Op, ins: &[&Tensor]) -> Result<Tensor> {
    Ok(eval(ctx, &o, ins)?.swap_remove(0))
}

/// Runs a strategy on every rank; returns each rank's outputs.
fn run_local(
    ctx: &CpuContext,
    o: &Op,
    st: &Strategy,
    ins: &[TensorMeta],
    outs: &[TensorMeta],
    blocks: &[Vec<Tensor>],
    mesh: &DeviceMesh,
) -> Result<Vec<Vec<Tensor>>> {
    let local_ins: Vec<TensorMeta> =
        st.inputs.iter().zip(ins).map(|(s, m)| TensorMeta::new(m.dtype, s.local_shape(&m.shape, mesh))).collect();
    let local_outs: Vec<Vec<usize>> = st.outputs.iter().zip(outs).map(|(s, m)| s.local_shape(&m.shape, mesh)).collect();
    let per_rank = |r: usize| -> Vec<&Tensor> { blocks.iter().map(|b| &b[r]).collect() };
    match &st.local {
        Local::Same => {
            if let Op::Dropout(a) = o {
                let shape = &outs[0].shape;
                return (0..mesh.size())
                    .map(|r| dropout_at(ctx, a, &blocks[0][r], shape, st.outputs[0].offsets(shape, mesh, r)))
                    .collect();
            }
            let lop = local_op(o, &local_ins, &local_outs);
            (0..mesh.size()).map(|r| Ok(eval(ctx, &lop, &per_rank(r))?)).collect()
        }
        Local::QueryBlocks { axes } => {
            // Each rank's block of query rows moves the causal frontier by its first row.
            let rows = local_ins[0].shape[2];
            let lop = local_op(o, &local_ins, &local_outs);
            (0..mesh.size())
                .map(|r| {
                    Ok(eval(ctx, &sharding::shift_queries(&lop, mesh.index_in_group(r, axes) * rows), &per_rank(r))?)
                })
                .collect()
        }
        Local::MaskedGather { axes } => {
            let Op::Gather { axis } = o else { bail!("masked gather on {}", o.name()) };
            let rows = local_ins[0].shape[*axis];
            let total = ins[0].shape[*axis] as i64;
            (0..mesh.size())
                .map(|r| {
                    let off = (mesh.index_in_group(r, axes) * rows) as i64;
                    let idx = blocks[1][r].to_i64_vec();
                    let norm: Vec<i64> = idx.iter().map(|&i| if i < 0 { i + total } else { i }).collect();
                    let inside: Vec<bool> = norm.iter().map(|&i| i >= off && i < off + rows as i64).collect();
                    let local_idx: Vec<i64> =
                        norm.iter().zip(&inside).map(|(&i, &ok)| if ok { i - off } else { 0 }).collect();
                    let li = Tensor::i64(blocks[1][r].shape().to_vec(), local_idx);
                    let out = eval1(ctx, o.clone(), &[&blocks[0][r], &li])?;
                    let inner: usize = local_ins[0].shape[axis + 1..].iter().product();
                    let v: Vec<f32> = out
                        .to_f32_vec()
                        .into_iter()
                        .enumerate()
                        .map(|(e, x)| if inside[(e / inner) % inside.len()] { x } else { 0.0 })
                        .collect();
                    Ok(vec![Tensor::f32(out.shape().to_vec(), v)])
                })
                .collect()
        }
        Local::MaskedScatter { axes } => {
            let Op::GatherGrad { axis, shape } = o else { bail!("masked scatter on {}", o.name()) };
            let rows = local_outs[0][*axis];
            let total = shape[*axis] as i64;
            let lop = local_op(o, &local_ins, &local_outs);
            (0..mesh.size())
                .map(|r| {
                    let off = (mesh.index_in_group(r, axes) * rows) as i64;
                    let idx = blocks[0][r].to_i64_vec();
                    let norm: Vec<i64> = idx.iter().map(|&i| if i < 0 { i + total } else { i }).collect();
                    let inside: Vec<bool> = norm.iter().map(|&i| i >= off && i < off + rows as i64).collect();
                    let local_idx: Vec<i64> =
                        norm.iter().zip(&inside).map(|(&i, &ok)| if ok { i - off } else { 0 }).collect();
                    let li = Tensor::i64(blocks[0][r].shape().to_vec(), local_idx);
                    // dy [pre, idx..., post]: zero the rows of skipped indices.
                    let dy = &blocks[1][r];
                    let pre: usize = shape[..*axis].iter().product();
                    let inner: usize = dy.numel() / pre.max(1) / inside.len().max(1);
                    let v: Vec<f32> = dy
                        .to_f32_vec()
                        .into_iter()
                        .enumerate()
                        .map(|(e, x)| if inside[(e / inner) % inside.len()] { x } else { 0.0 })
                        .collect();
                    let dy = Tensor::f32(dy.shape().to_vec(), v);
                    Ok(eval(ctx, &lop, &[&li, &dy])?)
                })
                .collect()
        }
        Local::SplitSoftmax { axes } => {
            let (axis, log) = match o {
                Op::Softmax { axis } => (*axis, false),
                Op::LogSoftmax { axis } => (*axis, true),
                _ => bail!("split softmax on {}", o.name()),
            };
            let red = |k| Op::Reduce { op: k, axes: vec![axis], keepdims: true };
            let x: Vec<&Tensor> = (0..mesh.size()).map(|r| &blocks[0][r]).collect();
            let m: Vec<Tensor> = x.iter().map(|t| eval1(ctx, red(ReduceOp::Max), &[t])).collect::<Result<_>>()?;
            let m = sim::apply(&Collective::AllReduce { axes: axes.clone(), op: ReduceKind::Max }, &m, mesh)?;
            let z: Vec<Tensor> =
                x.iter().zip(&m).map(|(t, m)| eval1(ctx, Op::Binary(BinaryOp::Sub), &[t, m])).collect::<Result<_>>()?;
            let e: Vec<Tensor> = z.iter().map(|t| eval1(ctx, Op::Unary(UnaryOp::Exp), &[t])).collect::<Result<_>>()?;
            let s: Vec<Tensor> = e.iter().map(|t| eval1(ctx, red(ReduceOp::Sum), &[t])).collect::<Result<_>>()?;
            let s = sim::apply(&Collective::AllReduce { axes: axes.clone(), op: ReduceKind::Sum }, &s, mesh)?;
            (0..mesh.size())
                .map(|r| {
                    Ok(vec![if log {
                        let ls = eval1(ctx, Op::Unary(UnaryOp::Log), &[&s[r]])?;
                        eval1(ctx, Op::Binary(BinaryOp::Sub), &[&z[r], &ls])?
                    } else {
                        eval1(ctx, Op::Binary(BinaryOp::Div), &[&e[r], &s[r]])?
                    }])
                })
                .collect()
        }
    }
}

fn rel_err(a: &Tensor, b: &Tensor) -> Result<f64> {
    ensure!(a.shape() == b.shape(), "shape {:?} vs {:?}", a.shape(), b.shape());
    match (a.data(), b.data()) {
        (Data::F32(x), Data::F32(y)) => {
            let d: f64 = x.iter().zip(y).map(|(p, q)| ((p - q) as f64).powi(2)).sum::<f64>().sqrt();
            let n: f64 = y.iter().map(|q| (*q as f64).powi(2)).sum::<f64>().sqrt();
            Ok(d / n.max(1e-6))
        }
        (x, y) => Ok(if x == y { 0.0 } else { f64::INFINITY }),
    }
}

/// Validates every strategy of every non-source node of `g`; returns (strategies, nodes).
fn validate_graph(
    ctx: &CpuContext,
    g: &Graph,
    mesh: &DeviceMesh,
    counts: &mut BTreeMap<String, usize>,
) -> Result<usize> {
    let cpu = DeviceProfile::builtin("cpu").context("cpu profile")?;
    let mut rng = Rng(0x2545_F491_4F6C_DD1D);
    let mut total = 0;
    let order = g.topo_order().map_err(|n| anyhow::anyhow!("cycle at {n:?}"))?;
    for n in order {
        let node = g.node(n);
        if node.op.is_source() {
            continue;
        }
        let ins: Vec<TensorMeta> = g.node_inputs(n).iter().map(|v| g.meta(*v).clone()).collect();
        let inputs = random_inputs(&mut rng, &node.op, &ins);
        let refs: Vec<&Tensor> = inputs.iter().collect();
        let want = match &node.op {
            Op::Dropout(a) => dropout_at(ctx, a, refs[0], &node.outputs[0].shape, vec![0; node.outputs[0].rank()]),
            op => Ok(eval(ctx, op, &refs)?),
        }
        .with_context(|| format!("single-device {}", node.name))?;
        let strategies = sharding::strategies(g, n, mesh, &cpu)?;
        for st in &strategies {
            let what =
                || format!("node {} ({}) on {mesh}, strategy `{}` {:?}", node.name, node.op.name(), st.name, st.local);
            let blocks: Vec<Vec<Tensor>> = inputs
                .iter()
                .zip(&st.inputs)
                .map(|(t, s)| distribute(&mut rng, t, s, mesh))
                .collect::<Result<_>>()
                .with_context(what)?;
            let got = run_local(ctx, &node.op, st, &ins, &node.outputs, &blocks, mesh).with_context(what)?;
            for (j, (spec, meta)) in st.outputs.iter().zip(&node.outputs).enumerate() {
                let locals: Vec<Tensor> = got.iter().map(|o| o[j].clone()).collect();
                let full = sim::assemble(&locals, spec, &meta.shape, mesh, 1e-6)
                    .with_context(|| format!("{}: output {j} `{spec}`", what()))?;
                let err = rel_err(&full, &want[j])?;
                ensure!(
                    err <= TOL,
                    "false claim: {}: inputs {:?}, output {j} `{spec}` differs from single-device by {err:e}",
                    what(),
                    st.inputs.iter().map(|s| s.to_string()).collect::<Vec<_>>()
                );
            }
            total += 1;
        }
        *counts.entry(node.op.name().to_string()).or_default() += strategies.len();
    }
    Ok(total)
}

#[test]
fn every_claimed_strategy_is_correct() -> Result<()> {
    let ctx = CpuContext::new(1)?;
    let mut counts = BTreeMap::new();
    let mut grand = 0;
    for shape in [[1, 2], [2, 2], [2, 4]] {
        let mesh = DeviceMesh::uniform(&shape)?;
        let mut on_mesh = 0;
        for build in [block, lm, cnn, shapes, indexing, dropout] {
            let (g, loss, opt) = build()?;
            let tg = training_graph(&g, &TrainOptions::new(loss, Some(opt)))?;
            ir::verify(&tg.graph).map_err(|e| anyhow::anyhow!("{e}"))?;
            on_mesh +=
                validate_graph(&ctx, &tg.graph, &mesh, &mut counts).with_context(|| format!("graph {}", g.name))?;
        }
        println!("mesh {mesh}: {on_mesh} strategies validated");
        grand += on_mesh;
    }
    println!("strategies validated per op kind (all meshes): {counts:?}");
    println!("{grand} strategies validated by execution, 0 false claims");
    // Every op family the issue names is covered.
    for k in [
        "matmul",
        "gemm",
        "conv",
        "conv_input_grad",
        "conv_weight_grad",
        "layernorm",
        "layernorm_grad",
        "softmax",
        "softmax_grad",
        "log_softmax",
        "log_softmax_grad",
        "gather",
        "gather_grad",
        "maxpool",
        "maxpool_grad",
        "avgpool",
        "avgpool_grad",
        "batchnorm",
        "lrn",
        "lrn_grad",
        "reshape",
        "transpose",
        "expand",
        "concat",
        "split",
        "slice",
        "slice_grad",
        "pad",
        "where",
        "reduce_sum",
        "reduce_max",
        "reduce_mean",
        "sgd_update",
        "adamw_update",
        "relu_grad",
        "gelu",
        "global_avgpool",
        "tril",
        "cumsum",
        "gather_elements",
        "scatter_elements",
        "gather_nd",
        "scatter_nd",
        "topk",
        "argmax",
        "dropout",
    ] {
        ensure!(counts.get(k).copied().unwrap_or(0) > 0, "no strategies validated for `{k}`");
    }
    Ok(())
}

/// The cost model prices a `Gemm` the CPU kernel runs as dot products apart
/// (`sharding::cost_family`'s `gemm/tb/thin`): over every shape of a grid around the kernel's
/// thresholds, in all four transpositions, the family is `gemm/tb/thin` exactly where
/// `kernels::cpu::gemm_kernel` picks `Dots` for one thread.
#[test]
fn thin_product_family_follows_the_cpu_kernel() {
    use kernels::cpu::{ProductKernel, gemm_kernel};
    let sides = [1, 2, 8, 16, 17, 31, 32, 33, 64, 128, 255, 256, 257, 1024];
    let mut thin = 0;
    for trans_a in [false, true] {
        for trans_b in [false, true] {
            let op = Op::Gemm { alpha: 1.0, beta: 0.0, trans_a, trans_b };
            for &m in &sides {
                for &n in &sides {
                    for &k in &sides {
                        let a = if trans_a { vec![k, m] } else { vec![m, k] };
                        let b = if trans_b { vec![n, k] } else { vec![k, n] };
                        let ins = [TensorMeta::new(DType::F32, a), TensorMeta::new(DType::F32, b)];
                        let family = sharding::cost_family(&op, &ins);
                        let dots = gemm_kernel(m, n, k, trans_a, trans_b) == ProductKernel::Dots;
                        assert_eq!(family == "gemm/tb/thin", dots, "{m}x{k} @ {k}x{n}, ta {trans_a} tb {trans_b}");
                        thin += usize::from(dots);
                    }
                }
            }
        }
    }
    assert!(thin > 0);
}
