//! The cost of each op family, fitted to measured training steps (`autopar profile`).
//!
//! A datasheet roofline prices an op by its FLOPs and bytes alone. On a CPU rank running small
//! tensors, most of an op's time is elsewhere: dispatch, allocating its output, index arithmetic
//! of broadcasts and transposes, one small product per group of a depthwise convolution. So the
//! profile times every instruction of a few generated training steps ([`models`]: a
//! GPT-2-style and a LLaMA-style decoder, a small CNN with depthwise and dense convolutions, a
//! graph of elementwise ops and a wide MLP, each at two sizes or more; none of them is a model
//! the cost model is judged on) and fits, per op family ([`sharding::cost_family`]),
//! `fixed + per_byte * bytes + per_flop * flops` with non-negative coefficients, minimising the
//! squared error relative to each time's square root (between the absolute error, which only
//! the largest ops would steer, and the relative one, which only the many small ones would).
//!
//! The fit says how a step's time splits over its instructions; the untimed steps say what the
//! whole costs. Time no instruction is charged for (frees, the executor's loop) and the fit's
//! lean towards the many small instructions leave a small model's step priced high and a large
//! one's low, so every family's fixed part and its per-byte/per-FLOP part are scaled by the two
//! factors that best price the untimed steps ([`step_scales`]). With threads and a core per
//! rank, `autopar profile` then runs these models' data-parallel and Megatron plans on the
//! profiled mesh as `autopar run` would, fits every family again on their instructions' times
//! (the executor's own work per instruction included: a reshape there costs several times what
//! it does in a single-device step), takes the latency their small collectives had beyond the
//! link sweep's lines (waiting for the slower rank among it) into the links, and scales the fit the
//! same way to the plans' measured steps, which also have frees.
//!
//! Every copy runs on its own thread, as many copies at once as the mesh has ranks on this
//! machine, kept in step (every step starts on all copies at once), so the caches and memory
//! bandwidth are shared much as in a run of the plan. Each instruction's time is the median over
//! a few steps, and the median of three rounds of all the models: a shared machine's slow
//! spells meet a plan's run as often as they meet the rounds, so the estimate is of the machine
//! as it typically runs.

use std::collections::BTreeMap;
use std::time::Instant;

use ir::autodiff::{LossSpec, Optimizer, TrainOptions};
use ir::{ConvAttrs, DType, Graph, Op, Tensor, TensorMeta};
use runtime::Cpu;
use sharding::OpCost;

use runtime::RunError;

/// What [`calibrate`] fitted.
#[derive(Clone, Debug)]
pub struct Calibration {
    /// The fitted cost per op family.
    pub op_costs: BTreeMap<String, OpCost>,
    /// Seconds per instruction for a family none of the steps ran: the median fixed cost.
    pub op_seconds: f64,
    /// Per family, the median relative error of the fit over its instructions.
    pub errors: BTreeMap<String, f64>,
    /// Median relative error of the whole steps as the fit prices them, per model.
    pub step_errors: Vec<(String, f64)>,
    /// The factors the fixed and the per-byte/per-FLOP parts of every family were scaled by,
    /// so that the fit prices the untimed steps.
    pub step_scales: (f64, f64),
}

/// A timed instruction: family, seconds, bytes, FLOPs.
type Sample = (String, f64, f64, f64);

/// One calibration model: its name, training graph (SGD), parameters and feeds.
pub struct Model {
    /// What it is and its size, e.g. `gpt h48 s24 b2`.
    pub name: String,
    /// The training graph.
    pub tg: ir::autodiff::TrainingGraph,
    /// Every parameter's value.
    pub params: BTreeMap<String, Tensor>,
    /// Every input's value (the same batch each step).
    pub feeds: BTreeMap<String, Tensor>,
}

fn fail(what: &str, e: impl std::fmt::Display) -> RunError {
    RunError::Kernel { node: format!("calibration {what}"), op: "profile", message: e.to_string() }
}

/// Deterministic small values in [-0.05, 0.05) (a hash of the index).
fn values(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let h = (i.wrapping_add(seed.wrapping_mul(7919))).wrapping_mul(2_654_435_761) % 1000;
            (h as f32 / 1000.0 - 0.5) * 0.1
        })
        .collect()
}

fn ids(batch: usize, seq: usize, vocab: usize) -> Tensor {
    Tensor::i64(vec![batch, seq], (0..batch * seq).map(|i| ((i * 37 + 11) % vocab) as i64).collect())
}

fn training(name: &str, mut g: Graph, loss: &str, feeds: BTreeMap<String, Tensor>) -> Result<Model, RunError> {
    let loss: LossSpec = loss.parse().map_err(|e| fail(name, e))?;
    let opt = Optimizer::Sgd { lr: 1e-4, momentum: 0.0, weight_decay: 0.0 };
    let mut params = std::mem::take(&mut g.param_data);
    for (k, &p) in g.params.iter().enumerate() {
        if let Op::Param { name } = &g.node(p).op
            && !params.contains_key(name)
        {
            let meta = &g.node(p).outputs[0];
            let t = if meta.dtype == DType::F32 {
                Tensor::f32(meta.shape.clone(), values(meta.numel(), k))
            } else {
                Tensor::zeros(meta).map_err(|e| fail(name, e))?
            };
            params.insert(name.clone(), t);
        }
    }
    let tg = ir::autodiff::training_graph(&g, &TrainOptions::new(loss, Some(opt))).map_err(|e| fail(name, e))?;
    Ok(Model { name: name.to_string(), tg, params, feeds })
}

fn import(name: &str, bytes: Result<Vec<u8>, String>) -> Result<Graph, RunError> {
    let bytes = bytes.map_err(|e| fail(name, e))?;
    tracer::import_bytes(&bytes, name, name, None, &tracer::ImportOptions::default()).map_err(|e| fail(name, e))
}

fn gpt(layers: usize, hidden: usize, seq: usize, vocab: usize, batch: usize) -> Result<Model, RunError> {
    let c = tracer::generate::GptConfig { layers, hidden, heads: 4, seq, vocab, batch };
    let name = format!("gpt h{hidden} s{seq} b{batch}");
    let g = import(&name, tracer::generate::gpt(&c))?;
    training(&name, g, "ce-next:logits:input_ids", BTreeMap::from([("input_ids".into(), ids(batch, seq, vocab))]))
}

fn llama(hidden: usize, seq: usize, vocab: usize, batch: usize) -> Result<Model, RunError> {
    let c =
        tracer::generate::LlamaConfig { layers: 2, hidden, heads: 4, kv_heads: 2, ffn: 2 * hidden, seq, vocab, batch };
    let name = format!("llama h{hidden} s{seq} b{batch}");
    let g = import(&name, tracer::generate::llama(&c))?;
    let pos = Tensor::i64(vec![batch, seq], (0..batch * seq).map(|i| (i % seq) as i64).collect());
    let feeds = BTreeMap::from([("input_ids".into(), ids(batch, seq, vocab)), ("position_ids".into(), pos)]);
    training(&name, g, "ce-next:logits:input_ids", feeds)
}

/// Builds a calibration graph with deterministic parameters.
struct Builder {
    g: Graph,
    seed: usize,
    k: usize,
}

impl Builder {
    fn param(&mut self, shape: Vec<usize>) -> ir::Value {
        self.seed += 1;
        let numel = shape.iter().product();
        let t = Tensor::f32(shape.clone(), values(numel, self.seed));
        self.g.param(&format!("p{}", self.seed), TensorMeta::new(DType::F32, shape), Some(t))
    }
    fn op(&mut self, op: Op, ins: &[ir::Value]) -> Result<ir::Value, RunError> {
        self.k += 1;
        let name = format!("{}{}", op.name(), self.k);
        self.g.add_op(&name, op, ins).map(|v| v[0]).map_err(|e| fail(&name, e))
    }
    fn unary(&mut self, u: ir::UnaryOp, x: ir::Value) -> Result<ir::Value, RunError> {
        self.op(Op::Unary(u), &[x])
    }
    fn bin(&mut self, b: ir::BinaryOp, x: ir::Value, y: ir::Value) -> Result<ir::Value, RunError> {
        self.op(Op::Binary(b), &[x, y])
    }
    fn scalar(&mut self, v: f32) -> ir::Value {
        self.k += 1;
        self.g.constant(&format!("c{}", self.k), Tensor::scalar_f32(v))
    }
    fn conv(&mut self, x: ir::Value, out: usize, k: usize, stride: usize, group: usize) -> Result<ir::Value, RunError> {
        let c = self.g.meta(x).shape[1];
        let w = self.param(vec![out, c / group, k, k]);
        let attrs = ConvAttrs { strides: [stride, stride], pads: [k / 2; 4], dilations: [1, 1], group };
        self.op(Op::Conv(attrs), &[x, w])
    }
    fn bn(&mut self, x: ir::Value) -> Result<ir::Value, RunError> {
        let c = self.g.meta(x).shape[1];
        let (scale, bias) = (self.param(vec![c]), self.param(vec![c]));
        self.op(Op::BatchNormTrain { epsilon: 1e-5 }, &[x, scale, bias])
    }
    /// GELU as exports spell it: x * 0.5 * (1 + erf(x / sqrt 2)).
    fn gelu(&mut self, x: ir::Value) -> Result<ir::Value, RunError> {
        let r = self.scalar(std::f32::consts::FRAC_1_SQRT_2);
        let (half, one) = (self.scalar(0.5), self.scalar(1.0));
        let t = self.bin(ir::BinaryOp::Mul, x, r)?;
        let t = self.unary(ir::UnaryOp::Erf, t)?;
        let t = self.bin(ir::BinaryOp::Add, t, one)?;
        let t = self.bin(ir::BinaryOp::Mul, t, half)?;
        self.bin(ir::BinaryOp::Mul, x, t)
    }
}

/// A small CNN with the blocks of today's vision models: a strided 7x7 stem with batch norm
/// and max pooling and three stages of bottlenecks (ResNet; the middle one's 3x3 grouped, as
/// ResNeXt's), inverted residuals with a
/// depthwise convolution, hard-swish and squeeze-excitation (MobileNetV3), a ConvNeXt block
/// (depthwise 7x7, channels-last layer norm, GELU MLP) and a linear classifier.
fn cnn(batch: usize, size: usize, c: usize) -> Result<Model, RunError> {
    use ir::BinaryOp::{Add, Mul};
    use ir::UnaryOp::{HardSigmoid, HardSwish, Relu};
    let name = format!("cnn c{c} {size}x{size} b{batch}");
    let mut b = Builder { g: Graph::new(&name), seed: 0, k: 0 };
    let x = b.g.input("x", TensorMeta::new(DType::F32, [batch, 3, size, size]));
    b.g.input("labels", TensorMeta::new(DType::I64, [batch]));
    let h = b.conv(x, c, 7, 2, 1)?;
    let h = b.bn(h)?;
    let h = b.unary(Relu, h)?;
    let pool = ir::PoolAttrs {
        kernel: [3, 3],
        strides: [2, 2],
        pads: [1; 4],
        dilations: [1, 1],
        ceil_mode: false,
        count_include_pad: false,
    };
    let mut h = b.op(Op::MaxPool(pool), &[h])?;
    // Inverted residuals with depthwise 3x3 and 5x5 convolutions.
    for k in [3, 5] {
        let y = b.conv(h, 2 * c, 1, 1, 1)?;
        let y = b.bn(y)?;
        let y = b.unary(HardSwish, y)?;
        let y = b.conv(y, 2 * c, k, 1, 2 * c)?;
        let y = b.bn(y)?;
        let s = b.op(Op::GlobalAveragePool, &[y])?;
        let s = b.conv(s, c / 2, 1, 1, 1)?;
        let s = b.unary(Relu, s)?;
        let s = b.conv(s, 2 * c, 1, 1, 1)?;
        let s = b.unary(HardSigmoid { alpha: 1.0 / 6.0, beta: 0.5 }, s)?;
        let y = b.bin(Mul, y, s)?;
        let y = b.conv(y, c, 1, 1, 1)?;
        let y = b.bn(y)?;
        h = b.bin(Add, h, y)?;
    }
    // A ConvNeXt block.
    let y = b.conv(h, c, 7, 1, c)?;
    let y = b.op(Op::Transpose { perm: vec![0, 2, 3, 1] }, &[y])?;
    let (scale, bias) = (b.param(vec![c]), b.param(vec![c]));
    let y = b.op(Op::LayerNorm { axis: 3, epsilon: 1e-6 }, &[y, scale, bias])?;
    let w1 = b.param(vec![c, 4 * c]);
    let y = b.op(Op::MatMul, &[y, w1])?;
    let y = b.gelu(y)?;
    let w2 = b.param(vec![4 * c, c]);
    let y = b.op(Op::MatMul, &[y, w2])?;
    let y = b.op(Op::Transpose { perm: vec![0, 3, 1, 2] }, &[y])?;
    h = b.bin(Add, h, y)?;
    // ResNet stages of bottlenecks: 1x1, 3x3 (strided from the second stage on), 1x1, with a
    // strided 1x1 projection where the shape changes; down to 2x2 pixels at the smaller size.
    let mut c = c;
    for stage in 0..3 {
        let stride = if stage == 0 { 1 } else { 2 };
        let out = if stage == 0 { c } else { 2 * c };
        let y = b.conv(h, out / 2, 1, 1, 1)?;
        let y = b.bn(y)?;
        let y = b.unary(Relu, y)?;
        // The middle stage's 3x3 grouped, as ResNeXt's (4 groups): a small product per group.
        let y = b.conv(y, out / 2, 3, stride, if stage == 1 { 4 } else { 1 })?;
        let y = b.bn(y)?;
        let y = b.unary(Relu, y)?;
        let y = b.conv(y, out, 1, 1, 1)?;
        let y = b.bn(y)?;
        let short = if stride == 1 && out == c {
            h
        } else {
            let s = b.conv(h, out, 1, stride, 1)?;
            b.bn(s)?
        };
        h = b.bin(Add, short, y)?;
        h = b.unary(Relu, h)?;
        c = out;
    }
    let h = b.op(Op::GlobalAveragePool, &[h])?;
    let h = b.op(Op::Reshape { shape: vec![batch, c] }, &[h])?;
    let w = b.param(vec![c, 10]);
    let h = b.op(Op::MatMul, &[h, w])?;
    let bias = b.param(vec![10]);
    let logits = b.bin(Add, h, bias)?;
    b.g.set_output("logits", logits);
    let xs = Tensor::f32(vec![batch, 3, size, size], values(batch * 3 * size * size, 99));
    let ls = Tensor::i64(vec![batch], (0..batch as i64).map(|i| i % 10).collect());
    training(&name, b.g, "ce:logits:labels", BTreeMap::from([("x".into(), xs), ("labels".into(), ls)]))
}

/// A multi-layer perceptron as `torch.nn.Linear` exports it: layer norm, then Gemm layers with
/// transposed weights and ReLU between them (the large products of a wide model).
fn mlp(batch: usize, width: usize, hidden: usize) -> Result<Model, RunError> {
    let name = format!("mlp {batch}x{width}x{hidden}");
    let mut b = Builder { g: Graph::new(&name), seed: 0, k: 0 };
    let x = b.g.input("x", TensorMeta::new(DType::F32, [batch, width]));
    b.g.input("target", TensorMeta::new(DType::F32, [batch, width]));
    let (scale, bias) = (b.param(vec![width]), b.param(vec![width]));
    let mut h = b.op(Op::LayerNorm { axis: 1, epsilon: 1e-5 }, &[x, scale, bias])?;
    let gemm = Op::Gemm { alpha: 1.0, beta: 1.0, trans_a: false, trans_b: true };
    for (i, (from, to)) in [(width, hidden), (hidden, hidden), (hidden, width)].into_iter().enumerate() {
        let (w, bias) = (b.param(vec![to, from]), b.param(vec![to]));
        h = b.op(gemm.clone(), &[h, w, bias])?;
        if i < 2 {
            h = b.unary(ir::UnaryOp::Relu, h)?;
        }
    }
    b.g.set_output("y", h);
    let n = batch * width;
    let feeds = BTreeMap::from([
        ("x".into(), Tensor::f32(vec![batch, width], values(n, 5))),
        ("target".into(), Tensor::f32(vec![batch, width], values(n, 6))),
    ]);
    training(&name, b.g, "mse:y:target", feeds)
}

/// The elementwise ops exports are made of (activations spelled out, normalisations and masks
/// in pieces), each on an activation `[batch, seq, width]` and broadcast against a row.
fn elementwise(batch: usize, seq: usize, width: usize) -> Result<Model, RunError> {
    use ir::BinaryOp::{Add, Div, Max, Min, Mul, Pow, Sub};
    use ir::UnaryOp::*;
    let name = format!("elementwise {batch}x{seq}x{width}");
    let mut b = Builder { g: Graph::new(&name), seed: 0, k: 0 };
    let x = b.g.input("x", TensorMeta::new(DType::F32, [batch, seq, width]));
    b.g.input("target", TensorMeta::new(DType::F32, [batch, seq, width]));
    let w = b.param(vec![width]);
    let h = b.bin(Mul, x, w)?;
    let one = b.scalar(1.0);
    let sq = b.bin(Mul, h, h)?;
    let pos = b.bin(Add, sq, one)?;
    let mut acc = h;
    for u in [Tanh, Sigmoid, Erf, Neg, Cos, Sin, Exp, Softplus, Abs, Relu] {
        let y = b.unary(u, h)?;
        acc = b.bin(Add, acc, y)?;
    }
    for u in [Sqrt, Log, Reciprocal] {
        let y = b.unary(u, pos)?;
        acc = b.bin(Add, acc, y)?;
    }
    let two = b.scalar(2.0);
    let p = b.bin(Pow, h, two)?;
    let zero = b.scalar(0.0);
    let mx = b.bin(Max, h, zero)?;
    let mn = b.bin(Min, h, zero)?;
    let d = b.bin(Div, h, pos)?;
    let v = b.param(vec![width]);
    let s = b.bin(Sub, h, v)?;
    for y in [p, mx, mn, d, s] {
        acc = b.bin(Add, acc, y)?;
    }
    let mean = b.op(Op::Reduce { op: ir::ReduceOp::Mean, axes: vec![2], keepdims: true }, &[acc])?;
    let c = b.bin(Sub, acc, mean)?;
    let sum = b.op(Op::Reduce { op: ir::ReduceOp::Sum, axes: vec![2], keepdims: true }, &[c])?;
    let c = b.bin(Add, c, sum)?;
    let sm = b.op(Op::Softmax { axis: 2 }, &[c])?;
    let y = b.bin(Add, c, sm)?;
    b.g.set_output("y", y);
    let n = batch * seq * width;
    let feeds = BTreeMap::from([
        ("x".into(), Tensor::f32(vec![batch, seq, width], values(n, 7))),
        ("target".into(), Tensor::f32(vec![batch, seq, width], values(n, 8))),
    ]);
    training(&name, b.g, "mse:y:target", feeds)
}

/// The calibration models, smallest of each kind first.
pub fn models() -> Result<Vec<Model>, RunError> {
    Ok(vec![
        gpt(2, 48, 24, 160, 2)?,
        gpt(1, 128, 64, 512, 4)?,
        llama(48, 24, 160, 2)?,
        llama(96, 48, 256, 2)?,
        cnn(2, 32, 16)?,
        cnn(4, 64, 32)?,
        cnn(8, 96, 48)?,
        // ResNet-sized convolutions (64 channels at 56x56 after the stem): a product of 100+
        // MFLOP runs near the device's peak, which the fit on small maps alone overprices.
        cnn(2, 224, 64)?,
        elementwise(2, 16, 32)?,
        elementwise(4, 64, 128)?,
        mlp(8, 192, 768)?,
        mlp(48, 320, 1280)?,
    ])
}

/// The upper median (0 for none); sorts `v`.
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() { 0.0 } else { v[v.len() / 2] }
}

/// Timed steps per model after the warm-up ones: `STEPS`, or fewer (at least `MIN_STEPS`) once
/// the model's round has taken `MODEL_SECONDS`.
const STEPS: usize = 8;
const MIN_STEPS: usize = 3;
const MODEL_SECONDS: f64 = 0.1;
const WARM_UP: usize = 2;
/// Rounds of every model's steps; each instruction keeps its median round.
const ROUNDS: usize = 3;

/// What one copy measured: the samples of every model (by the model's index; each
/// instruction's median over the steps), and per model its name and median untimed step.
struct Measured {
    samples: Vec<(usize, Sample)>,
    names: Vec<String>,
    steps: Vec<f64>,
}

/// Keeps the copies in step, as the ranks of a plan are: every step starts on all of them at
/// once, and the first copy decides for all when a model has had its share of time. A copy that
/// stops (an error, a panic) aborts it, and every copy waiting in it or arriving later fails
/// instead of waiting for good.
struct Lockstep {
    copies: usize,
    /// Copies arrived at the current barrier, the barrier's generation, aborted.
    state: std::sync::Mutex<(usize, u64, bool)>,
    turn: std::sync::Condvar,
    stop: std::sync::atomic::AtomicBool,
}

impl Lockstep {
    fn new(copies: usize) -> Self {
        Lockstep {
            copies,
            state: std::sync::Mutex::new((0, 0, false)),
            turn: std::sync::Condvar::new(),
            stop: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Waits until every copy has arrived.
    fn wait(&self) -> Result<(), RunError> {
        let aborted = || fail("lockstep", "another copy of the calibration stopped");
        let mut g = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if g.2 {
            return Err(aborted());
        }
        let generation = g.1;
        g.0 += 1;
        if g.0 == self.copies {
            (g.0, g.1) = (0, g.1 + 1);
            self.turn.notify_all();
            return Ok(());
        }
        while g.1 == generation && !g.2 {
            g = self.turn.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        if g.1 == generation { Err(aborted()) } else { Ok(()) }
    }

    fn abort(&self) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).2 = true;
        self.turn.notify_all();
    }

    /// The leader's `stop`, agreed by every copy.
    fn agree(&self, leader: bool, stop: bool) -> Result<bool, RunError> {
        use std::sync::atomic::Ordering::SeqCst;
        if leader {
            self.stop.store(stop, SeqCst);
        }
        self.wait()?;
        let stop = self.stop.load(SeqCst);
        // No copy may store the next decision before every copy has read this one.
        self.wait()?;
        Ok(stop)
    }
}

/// Aborts the lockstep when dropped armed: a copy that returns early or panics.
struct AbortOnDrop<'a>(&'a Lockstep, bool);

impl Drop for AbortOnDrop<'_> {
    fn drop(&mut self) {
        if self.1 {
            self.0.abort();
        }
    }
}

fn measure(models: &[Model], sync: &Lockstep, leader: bool) -> Result<Measured, RunError> {
    let ctx = Cpu::new(1).map_err(|e| fail("context", e))?;
    let mut samples = vec![];
    let mut steps = vec![];
    for (k, m) in models.iter().enumerate() {
        let g = &m.tg.graph;
        let mut timed = runtime::train::Trainer::new(&m.tg, &m.params)?.with_profiling(true);
        let mut plain = runtime::train::Trainer::new(&m.tg, &m.params)?;
        let mut per_node: BTreeMap<ir::NodeIndex, Vec<f64>> = BTreeMap::new();
        let mut walls = vec![];
        let start = Instant::now();
        for s in 0..WARM_UP + STEPS {
            // A large model stops after a few timed steps once it has had its share of time.
            let done = s >= WARM_UP + MIN_STEPS && start.elapsed().as_secs_f64() > MODEL_SECONDS;
            if sync.agree(leader, done)? {
                break;
            }
            let rep = timed.step(&ctx, &m.feeds)?;
            sync.wait()?;
            let t0 = Instant::now();
            plain.step(&ctx, &m.feeds)?;
            let wall = t0.elapsed().as_secs_f64();
            if s >= WARM_UP {
                walls.push(wall);
                for (n, t) in rep.node_seconds {
                    per_node.entry(n).or_default().push(t);
                }
            }
        }
        steps.push(median(&mut walls));
        for (n, mut ts) in per_node {
            let node = g.node(n);
            if node.op.is_source() {
                continue;
            }
            let ins: Vec<TensorMeta> = g.node_inputs(n).iter().map(|&v| g.meta(v).clone()).collect();
            let (flops, bytes) = sharding::op_work(&node.op, &ins, &node.outputs);
            samples.push((k, (sharding::cost_family(&node.op, &ins), median(&mut ts), bytes, flops)));
        }
    }
    Ok(Measured { samples, names: models.iter().map(|m| m.name.clone()).collect(), steps })
}

/// Weighted least squares of `t ~ c . x` over the columns in `cols`, with weights `w`; `None`
/// when singular or a coefficient is negative.
fn solve(xs: &[[f64; 3]], ts: &[f64], w: &[f64], cols: &[usize]) -> Option<[f64; 3]> {
    let n = cols.len();
    let mut a = vec![vec![0.0; n + 1]; n];
    for ((x, &t), &wi) in xs.iter().zip(ts).zip(w) {
        for (i, &ci) in cols.iter().enumerate() {
            for (j, &cj) in cols.iter().enumerate() {
                a[i][j] += wi * x[ci] * x[cj];
            }
            a[i][n] += wi * x[ci] * t;
        }
    }
    // Gauss-Jordan with partial pivoting on the n x n system; a pivot this small against the
    // diagonal means dependent columns (bytes proportional to FLOPs): that subset is left to
    // the smaller ones.
    let scale = (0..n).map(|i| a[i][i].abs()).fold(0.0, f64::max);
    for i in 0..n {
        let p = (i..n).max_by(|&r, &s| a[r][i].abs().total_cmp(&a[s][i].abs()))?;
        a.swap(i, p);
        if a[i][i].abs() <= 1e-12 * scale {
            return None;
        }
        let pivot = a[i].clone();
        for (r, row) in a.iter_mut().enumerate() {
            if r != i {
                let f = row[i] / pivot[i];
                for (x, p) in row.iter_mut().zip(&pivot).skip(i) {
                    *x -= f * p;
                }
            }
        }
    }
    let mut c = [0.0; 3];
    for (i, &ci) in cols.iter().enumerate() {
        c[ci] = a[i][n] / a[i][i];
        if !c[ci].is_finite() || c[ci] < 0.0 {
            return None;
        }
    }
    Some(c)
}

/// The non-negative fit of `t = fixed + per_byte * bytes + per_flop * flops` to `(t, bytes,
/// flops)` samples, minimising `sum (pred - t)^2 / t` (every subset of the terms is tried; the
/// best one with no negative coefficient wins).
pub fn fit_family(samples: &[(f64, f64, f64)]) -> OpCost {
    // Columns scaled to at most 1 keep the normal equations well conditioned.
    let scale = |k: usize| samples.iter().map(|s| [1.0, s.1, s.2][k]).fold(0.0, f64::max).max(f64::MIN_POSITIVE);
    let sc = [scale(0), scale(1), scale(2)];
    let xs: Vec<[f64; 3]> = samples.iter().map(|s| [1.0 / sc[0], s.1 / sc[1], s.2 / sc[2]]).collect();
    let ts: Vec<f64> = samples.iter().map(|s| s.0).collect();
    let w: Vec<f64> = ts.iter().map(|t| 1.0 / t.max(1e-9)).collect();
    let mut best: Option<([f64; 3], f64)> = None;
    for cols in [&[0][..], &[1], &[2], &[0, 1], &[0, 2], &[1, 2], &[0, 1, 2]] {
        let Some(c) = solve(&xs, &ts, &w, cols) else { continue };
        let loss: f64 = xs
            .iter()
            .zip(&ts)
            .zip(&w)
            .map(|((x, t), wi)| {
                let p: f64 = (0..3).map(|k| c[k] * x[k]).sum();
                wi * (p - t) * (p - t)
            })
            .sum();
        if best.is_none_or(|(_, l)| loss < l) {
            best = Some((c, loss));
        }
    }
    let c = best.map_or([0.0; 3], |(c, _)| c);
    OpCost { fixed: c[0] / sc[0], per_byte: c[1] / sc[1], per_flop: c[2] / sc[2], samples: samples.len() }
}

/// The factors `(a, b)` minimising `sum ((a * fixed + b * variable + rest - wall) / wall)^2`
/// over `(fixed, variable, rest, wall)` steps. When the two cannot be told apart, or one would
/// not come out positive, one common factor for both; `(1, 1)` without steps.
pub fn step_scales(parts: &[(f64, f64, f64, f64)]) -> (f64, f64) {
    let (mut ff, mut fv, mut vv, mut fy, mut vy) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for &(f, v, rest, w) in parts.iter().filter(|p| p.3 > 0.0) {
        let (f, v, y) = (f / w, v / w, (w - rest) / w);
        ff += f * f;
        fv += f * v;
        vv += v * v;
        fy += f * y;
        vy += v * y;
    }
    let det = ff * vv - fv * fv;
    if det > 1e-9 * ff * vv {
        let (a, b) = ((fy * vv - vy * fv) / det, (vy * ff - fy * fv) / det);
        if a > 0.0 && b > 0.0 {
            return (a, b);
        }
    }
    let all = ff + 2.0 * fv + vv;
    if all > 0.0 && fy + vy > 0.0 {
        let c = (fy + vy) / all;
        (c, c)
    } else {
        (1.0, 1.0)
    }
}

/// Scales every family's fixed cost by `a` and its per-byte and per-FLOP costs by `b` (the
/// factors of [`step_scales`]).
pub fn scale(op_costs: &mut BTreeMap<String, OpCost>, (a, b): (f64, f64)) {
    for c in op_costs.values_mut() {
        c.fixed *= a;
        c.per_byte *= b;
        c.per_flop *= b;
    }
}

/// Times training steps of the calibration models on `copies` threads at once (one CPU thread
/// each) and fits every op family's cost.
pub fn calibrate(copies: usize) -> Result<Calibration, RunError> {
    let copies = copies.max(1);
    let sync = Lockstep::new(copies);
    let per_copy: Vec<Result<Measured, RunError>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..copies)
            .map(|copy| {
                let sync = &sync;
                s.spawn(move || -> Result<Measured, RunError> {
                    let leader = copy == 0;
                    let mut guard = AbortOnDrop(sync, true);
                    let ms = models()?;
                    // The median of a few rounds: this shared machine has slow spells of a
                    // second or more, and a plan's run meets them as often as the rounds do.
                    let mut rounds = vec![];
                    for _ in 0..ROUNDS {
                        rounds.push(measure(&ms, sync, leader)?);
                    }
                    let mut best = rounds.pop().ok_or_else(|| fail("rounds", "no round"))?;
                    for (i, b) in best.samples.iter_mut().enumerate() {
                        // The same instructions in the same order every round.
                        let mut ts: Vec<f64> = rounds.iter().map(|r| r.samples[i].1.1).chain([b.1.1]).collect();
                        b.1.1 = median(&mut ts);
                    }
                    for (k, b) in best.steps.iter_mut().enumerate() {
                        let mut ts: Vec<f64> = rounds.iter().map(|r| r.steps[k]).chain([*b]).collect();
                        *b = median(&mut ts);
                    }
                    guard.1 = false;
                    Ok(best)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(fail("thread", "a calibration thread panicked"))))
            .collect()
    });
    let per_copy: Vec<Measured> = per_copy.into_iter().collect::<Result<_, _>>()?;
    let names = per_copy.first().map(|m| m.names.clone()).unwrap_or_default();
    let mut by_family: BTreeMap<String, Vec<(f64, f64, f64)>> = BTreeMap::new();
    for m in &per_copy {
        for (_, (f, t, b, fl)) in &m.samples {
            by_family.entry(f.clone()).or_default().push((*t, *b, *fl));
        }
    }
    let mut op_costs: BTreeMap<String, OpCost> = by_family.iter().map(|(f, s)| (f.clone(), fit_family(s))).collect();
    let errors = by_family
        .iter()
        .map(|(f, s)| {
            let c = &op_costs[f];
            let mut e: Vec<f64> = s.iter().map(|&(t, b, fl)| ((c.seconds(b, fl) - t) / t.max(1e-9)).abs()).collect();
            (f.clone(), median(&mut e))
        })
        .collect();
    // The fit says how a step's time splits over its instructions; the untimed steps say what
    // the whole costs. Between timed instructions there is time no instruction is charged for
    // (frees, the executor's loop), and the fit over many small instructions prices a small
    // model's step high and a large one's low. So the fixed and the variable parts of every
    // family are scaled, by the two factors that best price the untimed steps of every model.
    let parts: Vec<(f64, f64, f64, f64)> = per_copy
        .iter()
        .flat_map(|m| {
            let op_costs = &op_costs;
            m.steps.iter().enumerate().map(move |(k, &wall)| {
                let (fixed, variable) = m.samples.iter().filter(|(i, _)| *i == k).fold((0.0, 0.0), |(f, v), (_, s)| {
                    let c = &op_costs[&s.0];
                    (f + c.fixed, v + c.seconds(s.2, s.3) - c.fixed)
                });
                (fixed, variable, 0.0, wall)
            })
        })
        .collect();
    let (a, b) = step_scales(&parts);
    scale(&mut op_costs, (a, b));
    let step_errors = names
        .iter()
        .enumerate()
        .map(|(k, name)| {
            let mut e: Vec<f64> = per_copy
                .iter()
                .map(|m| {
                    let est: f64 = m
                        .samples
                        .iter()
                        .filter(|(i, _)| *i == k)
                        .map(|(_, (f, _, b, fl))| op_costs[f].seconds(*b, *fl))
                        .sum();
                    (est - m.steps[k]) / m.steps[k].max(1e-9)
                })
                .collect();
            (name.clone(), median(&mut e))
        })
        .collect();
    let mut fixed: Vec<f64> = op_costs.values().map(|c| c.fixed).collect();
    let op_seconds = median(&mut fixed);
    Ok(Calibration { op_costs, op_seconds, errors, step_errors, step_scales: (a, b) })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A family whose times are exactly linear in bytes and FLOPs is fitted back.
    #[test]
    fn fit_recovers_a_linear_cost() {
        let truth = OpCost { fixed: 1e-6, per_byte: 2e-10, per_flop: 1e-11, samples: 0 };
        let s: Vec<(f64, f64, f64)> = [(1e3, 0.0), (1e4, 1e5), (1e5, 1e4), (1e6, 1e8), (3e4, 3e6)]
            .iter()
            .map(|&(b, f)| (truth.seconds(b, f), b, f))
            .collect();
        let c = fit_family(&s);
        for (got, want) in [(c.fixed, truth.fixed), (c.per_byte, truth.per_byte), (c.per_flop, truth.per_flop)] {
            assert!((got - want).abs() <= 1e-6 * want, "{c:?}");
        }
    }

    #[test]
    fn step_scales_recover_the_factors() {
        // Steps of (fixed, variable, rest) parts whose walls are 1.3 * fixed + 0.8 * variable + rest.
        let parts: Vec<(f64, f64, f64, f64)> =
            [(1e-3, 4e-3, 0.0), (5e-4, 1e-4, 1e-4), (2e-3, 1e-2, 5e-4), (1e-4, 1e-5, 0.0)]
                .iter()
                .map(|&(f, v, r)| (f, v, r, 1.3 * f + 0.8 * v + r))
                .collect();
        let (a, b) = step_scales(&parts);
        assert!((a - 1.3).abs() < 1e-9 && (b - 0.8).abs() < 1e-9, "{a} {b}");
        // Parts that cannot tell the two apart get one factor; no steps leave the fit alone.
        let same: Vec<(f64, f64, f64, f64)> = [(1e-3, 1e-3, 0.0, 3e-3), (2e-3, 2e-3, 0.0, 6e-3)].to_vec();
        let (a, b) = step_scales(&same);
        assert!((a - 1.5).abs() < 1e-9 && (b - 1.5).abs() < 1e-9, "{a} {b}");
        assert_eq!(step_scales(&[]), (1.0, 1.0));
    }

    /// A term that would come out negative is dropped, not kept below zero.
    #[test]
    fn fit_is_never_negative() {
        // Time falls with bytes: the best non-negative fit is a constant.
        let s = [(3e-6, 1e3, 0.0), (2e-6, 1e4, 0.0), (1e-6, 1e5, 0.0)];
        let c = fit_family(&s);
        assert!(c.fixed > 0.0 && c.per_byte == 0.0 && c.per_flop == 0.0, "{c:?}");
    }
}
