//! Finite-difference checks of autodiff (issue 3, acceptance 1).
//!
//! For every differentiable forward op, each test builds a tiny graph whose differentiable inputs
//! are parameters with random data (deterministic seeds; non-differentiable inputs such as
//! indices and boolean conditions are constants), takes the `mse:y:t` training graph of
//! [`ir::autodiff::training_graph`] against a random target, runs it once for the autodiff
//! gradients `grad/<param>`, and compares them with central finite differences
//! `(L(p + eps e_i) - L(p - eps e_i)) / (2 eps)` for every element `i` of every parameter (a random
//! subset of [`SUBSET`] elements when a parameter has more than [`FULL_MAX`]).
//!
//! The gradient ops of the IR are exercised through the forward ops whose VJP emits them, named
//! in the case lists below: `UnaryGrad` (every differentiable unary op; `Neg` differentiates to a
//! `Neg`, so `unary_grad_kernels` checks that kernel directly), `SoftmaxGrad` (`log` false and
//! true), `LayerNormGrad`, `BatchNormTrainGrad`, `LrnGrad`, `ConvInputGrad`, `ConvWeightGrad`,
//! `MaxPoolGrad`, `AveragePoolGrad`, `ResizeGrad`, `GatherGrad` (scatter-add, with repeated and
//! negative indices) and
//! `SliceGrad` (non-unit and negative steps; unit-step slices differentiate to a `Pad`), plus the
//! compositions: un-broadcasting (`ReduceSum` + `Reshape`), `Where` masks for `Max`/`Min`,
//! `Expand` for reductions, `Concat`/`Split`, `Slice` for `Pad`, fan-out accumulation, and the
//! mse loss itself. Training-mode `Dropout` differentiates to itself: its case runs every loss
//! and gradient as one training step, so one mask holds throughout.
//!
//! Precision and tolerance. The perturbed losses are evaluated in f64 from the f32 model output
//! `y` (`mean((y - t)^2)`, the same formula as the IR loss, which is checked against the training
//! graph's own `loss` at the base point), so the only rounding left in a difference quotient is
//! that of the f32 kernels: about `|y| * 6e-8 / eps = 6e-5 |y|` per output element with
//! `eps = 1e-3`; the quotient divides by the step actually taken in f32 (`(p + eps) - (p - eps)`
//! rounded). Truncation is `O(eps^2 f''') ~ 1e-6` relative for the smooth ops; inputs are kept
//! at least 0.05 away from kinks, ties and domain edges (positive inputs for log, sqrt,
//! reciprocal, pow bases, divisors, products, L2 and log-sum; distinct values on a shuffled grid
//! of spacing 0.1 for relu, abs, max/min, max pooling and max/min/L1 reductions), so no
//! perturbation crosses one. Each parameter is compared norm-wise:
//! `||ad - fd||_2 / max(||fd||_2, 1e-3) <= TOL = 1e-2`: ten times the worst error seen (1.0e-3,
//! a log-sum-exp reduced to a scalar, where no averaging over outputs damps the noise; almost all
//! cases stay below 3e-4; each family prints its worst case with `--nocapture`), and far below
//! what a wrong VJP (a missing term, a transposed product, a wrong un-broadcast) produces, which
//! is O(1): scaling every autodiff gradient by 1.02 already fails every case.

use std::collections::BTreeMap;

use anyhow::{Context, Result, bail, ensure};
use ir::autodiff::{LossSpec, TrainOptions, training_graph};
use ir::{BinaryOp, ConvAttrs, DType, Graph, Op, PoolAttrs, ReduceOp, SliceAxis, Tensor, TensorMeta, UnaryOp, Value};
use runtime::Cpu;
use runtime::Interpreter;

/// Finite-difference step (absolute, in parameter units).
const EPS: f64 = 1e-3;
/// Norm-wise relative tolerance per parameter (see the module docs).
const TOL: f64 = 1e-2;
/// Floor of the reference norm in the relative error.
const NORM_FLOOR: f64 = 1e-3;
/// Parameters with at most this many elements are checked at every element.
const FULL_MAX: usize = 100;
/// Elements checked (a random subset) in larger parameters.
const SUBSET: usize = 40;

// ---------------------------------------------------------------------------------------------
// Random numbers: xorshift64*, seeded per case from its name.

struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng((seed ^ 0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.unit() as f32
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i + 1);
            v.swap(i, j);
        }
    }
}

fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// How a parameter is initialised.
#[derive(Clone, Copy, Debug)]
enum Init {
    /// Uniform in `[lo, hi)`.
    U(f32, f32),
    /// Distinct values `(i - n/2) * 0.1 + offset`, shuffled: any two differ by >= 0.1, and with
    /// offset 0.05 every value is >= 0.05 away from zero (and from any `Grid(0.0)` value).
    Grid(f32),
}

const SMOOTH: Init = Init::U(-2.0, 2.0);
const POS: Init = Init::U(0.5, 2.0);

fn init_values(rng: &mut Rng, n: usize, init: Init) -> Vec<f32> {
    match init {
        Init::U(lo, hi) => (0..n).map(|_| rng.uniform(lo, hi)).collect(),
        Init::Grid(offset) => {
            let mut v: Vec<f32> = (0..n).map(|i| (i as f32 - (n / 2) as f32) * 0.1 + offset).collect();
            rng.shuffle(&mut v);
            v
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Case builder and checker.

/// A forward graph under construction.
struct Case {
    g: Graph,
    rng: Rng,
    /// The training step every run of the case draws its dropout masks from (`None`: no draw,
    /// dropout keeps everything): one fixed mask for the gradient and every perturbed loss.
    key: Option<runtime::program::StepKey>,
}

impl Case {
    fn param(&mut self, name: &str, shape: &[usize], init: Init) -> Value {
        let n = shape.iter().product();
        let data = init_values(&mut self.rng, n, init);
        self.g.param(name, TensorMeta::new(DType::F32, shape), Some(Tensor::f32(shape, data)))
    }
    fn constant(&mut self, name: &str, t: Tensor) -> Value {
        self.g.constant(name, t)
    }
    fn random_bool(&mut self, shape: &[usize]) -> Tensor {
        let n: usize = shape.iter().product();
        Tensor::bool(shape, (0..n).map(|_| self.rng.below(2) == 1).collect())
    }
    fn op(&mut self, op: Op, ins: &[Value]) -> Result<Value> {
        let name = op.name();
        Ok(self.g.add1(name, op, ins)?)
    }
    fn ops(&mut self, op: Op, ins: &[Value]) -> Result<Vec<Value>> {
        let name = op.name();
        Ok(self.g.add_op(name, op, ins)?)
    }
}

/// What one checked case found.
struct Checked {
    /// One message per parameter over tolerance.
    failures: Vec<String>,
    /// Largest relative error over the parameters.
    worst: f64,
    /// Autodiff gradients by parameter name.
    grads: BTreeMap<String, Tensor>,
    /// Names of the training graph's outputs.
    outputs: Vec<String>,
}

fn mse(y: &[f32], t: &[f32]) -> f64 {
    y.iter().zip(t).map(|(&a, &b)| (a as f64 - b as f64).powi(2)).sum::<f64>() / y.len().max(1) as f64
}

fn run_y(
    interp: &Interpreter,
    ctx: &Cpu,
    params: &BTreeMap<String, Tensor>,
    key: Option<runtime::program::StepKey>,
) -> Result<Vec<f32>> {
    let none = BTreeMap::new();
    let rep = match key {
        Some(k) => interp.run_step(ctx, &none, params, k)?,
        None => interp.run_with_params(ctx, &none, params)?,
    };
    Ok(rep.outputs["y"].as_f32().context("y is f32")?.to_vec())
}

/// Builds the training graph of `c` with output `y`, and compares the autodiff gradient of every
/// trainable parameter with central differences.
fn check(ctx: &Cpu, label: &str, mut c: Case, y: Value, frozen: &[&str]) -> Result<Checked> {
    c.g.set_output("y", y);
    let fwd = c.g;
    let params = fwd.param_data.clone();
    let ymeta = fwd.meta(y).clone();
    ensure!(ymeta.dtype == DType::F32, "output is {ymeta}");

    let interp = Interpreter::new(&fwd)?;
    let y0 = run_y(&interp, ctx, &params, c.key)?;
    let target: Vec<f32> = y0.iter().map(|&v| v + c.rng.uniform(-1.0, 1.0)).collect();
    let opts = TrainOptions {
        loss: LossSpec::Mse { output: "y".into(), target: "t".into() },
        optimizer: None,
        frozen: frozen.iter().map(|s| s.to_string()).collect(),
        schedule: Default::default(),
        clip_grad_norm: None,
    };
    let tg = training_graph(&fwd, &opts).context("training graph")?;
    let tinterp = Interpreter::new(&tg.graph)?;
    let feeds = BTreeMap::from([("t".to_string(), Tensor::f32(ymeta.shape.clone(), target.clone()))]);
    let rep = match c.key {
        Some(k) => tinterp.run_step(ctx, &feeds, &params, k),
        None => tinterp.run_with_params(ctx, &feeds, &params),
    }
    .context("training graph run")?;
    let loss = rep.outputs["loss"].as_f32().context("loss is f32")?[0] as f64;
    let l0 = mse(&y0, &target);
    ensure!((loss - l0).abs() <= 1e-5 * l0.max(1e-3), "{label}: training-graph loss {loss} vs f64 mse {l0}");

    let mut out = Checked {
        failures: Vec::new(),
        worst: 0.0,
        grads: BTreeMap::new(),
        outputs: rep.outputs.keys().cloned().collect(),
    };
    let mut work = params.clone();
    for (name, p) in &params {
        if frozen.contains(&name.as_str()) {
            continue;
        }
        let Some(ad_t) = rep.outputs.get(&format!("grad/{name}")) else {
            // A parameter nothing reads is not trained (no gradient output); any other must have one.
            ensure!(name == "unused", "no grad/{name}");
            continue;
        };
        ensure!(ad_t.shape() == p.shape(), "grad/{name} is {:?}, param {:?}", ad_t.shape(), p.shape());
        let ad_all = ad_t.as_f32().context("grad is f32")?;
        let base = p.as_f32().context("param is f32")?.to_vec();
        let n = base.len();
        let idx: Vec<usize> = if n <= FULL_MAX {
            (0..n).collect()
        } else {
            let mut all: Vec<usize> = (0..n).collect();
            c.rng.shuffle(&mut all);
            let mut s = all[..SUBSET].to_vec();
            s.sort();
            s
        };
        let mut fd = Vec::with_capacity(idx.len());
        for &i in &idx {
            let plus = (base[i] as f64 + EPS) as f32;
            let minus = (base[i] as f64 - EPS) as f32;
            let mut v = base.clone();
            v[i] = plus;
            work.insert(name.clone(), Tensor::f32(p.shape(), v.clone()));
            let lp = mse(&run_y(&interp, ctx, &work, c.key)?, &target);
            v[i] = minus;
            work.insert(name.clone(), Tensor::f32(p.shape(), v));
            let lm = mse(&run_y(&interp, ctx, &work, c.key)?, &target);
            fd.push((lp - lm) / (plus as f64 - minus as f64));
        }
        work.insert(name.clone(), p.clone());
        let ad: Vec<f64> = idx.iter().map(|&i| ad_all[i] as f64).collect();
        let diff = ad.iter().zip(&fd).map(|(a, f)| (a - f).powi(2)).sum::<f64>().sqrt();
        let norm = fd.iter().map(|f| f * f).sum::<f64>().sqrt();
        let rel = diff / norm.max(NORM_FLOOR);
        ensure!(rel.is_finite(), "{label}: param {name}: relative error is {rel}");
        out.worst = out.worst.max(rel);
        if rel > TOL {
            let mut order: Vec<usize> = (0..idx.len()).collect();
            order.sort_by(|&a, &b| (ad[b] - fd[b]).abs().total_cmp(&(ad[a] - fd[a]).abs()));
            let worst: Vec<String> =
                order.iter().take(6).map(|&k| format!("[{}] ad={:.6e} fd={:.6e}", idx[k], ad[k], fd[k])).collect();
            out.failures.push(format!(
                "{label}: param {name} {:?}: ||ad-fd||/||fd|| = {rel:.3e} > TOL {TOL:.0e} (||fd|| = {norm:.3e}, \
                 {} of {n} elements); worst: {}",
                p.shape(),
                idx.len(),
                worst.join(", ")
            ));
        }
        out.grads.insert(name.clone(), ad_t.clone());
    }
    Ok(out)
}

/// Finite-difference step of [`check_f64`].
const EPS_F64: f64 = 1e-5;
/// Norm-wise relative tolerance of [`check_f64`]: truncation (`O(EPS_F64^2)`, about 1e-10
/// relative) and f64 rounding (about `1e-16 / EPS_F64`) leave the exact gradient's error far
/// below it, while a gradient off by a part in 10^6 already fails. The worst error seen, 3.0e-8,
/// is not the recurrent ops': it is the mean's `1/n` in the loss's backward (`n` = 12 or 24,
/// output elements), made as an f32 constant before the graph is widened (1/12 rounds to f32 with
/// relative error 2.98e-8); cases with a power-of-two `n` stay below 5e-10.
const TOL_F64: f64 = 1e-6;

/// [`check`] with the forward and training graphs computing in f64 ([`Graph::with_float_type`]):
/// the perturbed losses come from f64 kernels, so the step can be small ([`EPS_F64`]) and the
/// tolerance tight ([`TOL_F64`]), and an error in a gradient that f32 noise would hide shows.
/// No dropout key and no frozen parameters: the cases that use it have neither.
fn check_f64(ctx: &Cpu, label: &str, mut c: Case, y: Value) -> Result<Checked> {
    c.g.set_output("y", y);
    let fwd32 = c.g;
    let ymeta = fwd32.meta(y).clone();
    ensure!(ymeta.dtype == DType::F32, "output is {ymeta}");
    let opts = TrainOptions {
        loss: LossSpec::Mse { output: "y".into(), target: "t".into() },
        optimizer: None,
        frozen: Default::default(),
        schedule: Default::default(),
        clip_grad_norm: None,
    };
    let tg = training_graph(&fwd32, &opts).context("training graph")?;
    let tg = tg.with_float_type(DType::F64).context("training graph in f64")?;
    let fwd = fwd32.with_float_type(DType::F64).context("forward graph in f64")?;
    let params = fwd.param_data.clone();
    let interp = Interpreter::new(&fwd)?;
    let none = BTreeMap::new();
    let run = |params: &BTreeMap<String, Tensor>| -> Result<Vec<f64>> {
        let rep = interp.run_with_params(ctx, &none, params)?;
        Ok(rep.outputs["y"].as_f64().context("y is f64")?.to_vec())
    };
    let mse64 =
        |y: &[f64], t: &[f64]| y.iter().zip(t).map(|(a, b)| (a - b).powi(2)).sum::<f64>() / y.len().max(1) as f64;

    let y0 = run(&params)?;
    let target: Vec<f64> = y0.iter().map(|&v| v + c.rng.uniform(-1.0, 1.0) as f64).collect();
    let tinterp = Interpreter::new(&tg.graph)?;
    let feeds = BTreeMap::from([("t".to_string(), Tensor::f64(ymeta.shape.clone(), target.clone()))]);
    let rep = tinterp.run_with_params(ctx, &feeds, &params).context("training graph run")?;
    let loss = rep.outputs["loss"].as_f64().context("loss is f64")?[0];
    let l0 = mse64(&y0, &target);
    ensure!((loss - l0).abs() <= 1e-12 * l0.max(1e-3), "{label}: training-graph loss {loss} vs mse {l0}");

    let mut out = Checked {
        failures: Vec::new(),
        worst: 0.0,
        grads: BTreeMap::new(),
        outputs: rep.outputs.keys().cloned().collect(),
    };
    let mut work = params.clone();
    for (name, p) in &params {
        let ad_t = rep.outputs.get(&format!("grad/{name}")).with_context(|| format!("no grad/{name}"))?;
        ensure!(ad_t.shape() == p.shape(), "grad/{name} is {:?}, param {:?}", ad_t.shape(), p.shape());
        let ad = ad_t.as_f64().context("grad is f64")?.to_vec();
        let base = p.as_f64().context("param is f64")?.to_vec();
        let mut fd = Vec::with_capacity(base.len());
        for i in 0..base.len() {
            let mut v = base.clone();
            v[i] = base[i] + EPS_F64;
            work.insert(name.clone(), Tensor::f64(p.shape(), v.clone()));
            let lp = mse64(&run(&work)?, &target);
            v[i] = base[i] - EPS_F64;
            work.insert(name.clone(), Tensor::f64(p.shape(), v));
            let lm = mse64(&run(&work)?, &target);
            fd.push((lp - lm) / (2.0 * EPS_F64));
        }
        work.insert(name.clone(), p.clone());
        let diff = ad.iter().zip(&fd).map(|(a, f)| (a - f).powi(2)).sum::<f64>().sqrt();
        let norm = fd.iter().map(|f| f * f).sum::<f64>().sqrt();
        let rel = diff / norm.max(NORM_FLOOR);
        ensure!(rel.is_finite(), "{label}: param {name}: relative error is {rel}");
        out.worst = out.worst.max(rel);
        if rel > TOL_F64 {
            let mut order: Vec<usize> = (0..ad.len()).collect();
            order.sort_by(|&a, &b| (ad[b] - fd[b]).abs().total_cmp(&(ad[a] - fd[a]).abs()));
            let worst: Vec<String> =
                order.iter().take(6).map(|&k| format!("[{k}] ad={:.9e} fd={:.9e}", ad[k], fd[k])).collect();
            out.failures.push(format!(
                "{label}: param {name} {:?}: ||ad-fd||/||fd|| = {rel:.3e} > TOL_F64 {TOL_F64:.0e} (||fd|| = {norm:.3e}); \
                 worst: {}",
                p.shape(),
                worst.join(", ")
            ));
        }
        out.grads.insert(name.clone(), ad_t.clone());
    }
    Ok(out)
}

/// The cases of one op family; failures are collected and reported together at the end.
struct Suite {
    family: &'static str,
    ctx: Cpu,
    failures: Vec<String>,
    cases: usize,
    worst: (f64, String),
}

impl Suite {
    fn new(family: &'static str) -> Suite {
        Suite::with_threads(family, 1)
    }

    fn with_threads(family: &'static str, threads: usize) -> Suite {
        let ctx = Cpu::new(threads).expect("a CPU context");
        Suite { family, ctx, failures: Vec::new(), cases: 0, worst: (0.0, String::new()) }
    }

    /// Checks one case: `build` adds params, constants and ops, and returns the output `y`.
    fn case(&mut self, name: &str, build: impl FnOnce(&mut Case) -> Result<Value>) {
        self.case_in(name, false, build)
    }

    /// [`Suite::case`] with `f64` true: checked in f64 by [`check_f64`] (label `<name>/f64`).
    fn case_in(&mut self, name: &str, f64: bool, build: impl FnOnce(&mut Case) -> Result<Value>) {
        let label = if f64 { format!("{}/{name}/f64", self.family) } else { format!("{}/{name}", self.family) };
        let mut c = Case { g: Graph::new(&label), rng: Rng::new(fnv(&label)), key: None };
        self.cases += 1;
        let checked = build(&mut c)
            .and_then(|y| if f64 { check_f64(&self.ctx, &label, c, y) } else { check(&self.ctx, &label, c, y, &[]) });
        match checked {
            Ok(r) => {
                println!("{label}: max rel err {:.2e}", r.worst);
                if r.worst > self.worst.0 {
                    self.worst = (r.worst, label);
                }
                self.failures.extend(r.failures);
            }
            Err(e) => self.failures.push(format!("{label}: error: {e:#}")),
        }
    }

    fn finish(self) {
        println!("{}: {} cases, worst {:.2e} ({})", self.family, self.cases, self.worst.0, self.worst.1);
        assert!(
            self.failures.is_empty(),
            "{}: {} parameter checks over {} cases fail the finite-difference check (TOL {TOL:.0e}):\n{}",
            self.family,
            self.failures.len(),
            self.cases,
            self.failures.join("\n")
        );
    }
}

fn sl(axis: usize, start: i64, len: usize, step: i64) -> SliceAxis {
    SliceAxis { axis, start, len, step }
}

fn conv_attrs(strides: [usize; 2], pads: [usize; 4], dilations: [usize; 2], group: usize) -> ConvAttrs {
    ConvAttrs { strides, pads, dilations, group }
}

fn pool(kernel: [usize; 2], strides: [usize; 2], pads: [usize; 4], ceil_mode: bool, cip: bool) -> PoolAttrs {
    PoolAttrs { kernel, strides, pads, dilations: [1, 1], ceil_mode, count_include_pad: cip }
}

// ---------------------------------------------------------------------------------------------
// Elementwise ops.

const UNARY: [UnaryOp; 34] = {
    use UnaryOp::*;
    [
        Relu,
        Gelu,
        GeluTanh,
        Tanh,
        Erf,
        Sigmoid,
        Exp,
        Log,
        Sqrt,
        Neg,
        Reciprocal,
        Abs,
        Sin,
        Cos,
        // The activation family, with attributes other than ONNX's defaults where it has them.
        HardSigmoid { alpha: 0.3, beta: 0.4 },
        HardSwish,
        LeakyRelu { alpha: 0.2 },
        Elu { alpha: 0.7 },
        Selu { alpha: 1.5, gamma: 1.2 },
        Celu { alpha: 2.0 },
        Softplus,
        Softsign,
        Mish,
        ThresholdedRelu { alpha: 0.3 },
        Shrink { bias: 0.1, lambd: 0.3 },
        Tan,
        Acos,
        Asin,
        Atan,
        Sinh,
        Cosh,
        Asinh,
        Acosh,
        Atanh,
    ]
};

/// Inputs away from each op's kinks and inside its domain. Grid(0.05) values are multiples of 0.1
/// plus 0.05: never within 0.05 of 0, ±0.3 (Shrink, ThresholdedRelu) or HardSigmoid's ramp ends
/// (-4/3 and 2).
fn unary_domain(u: UnaryOp) -> Init {
    use UnaryOp::*;
    match u {
        Log | Sqrt | Reciprocal => Init::U(0.3, 2.0),
        Relu | Abs | HardSigmoid { .. } | LeakyRelu { .. } | Elu { .. } | Selu { .. } | Celu { .. } => Init::Grid(0.05),
        ThresholdedRelu { .. } | Shrink { .. } => Init::Grid(0.05),
        Exp => Init::U(-1.5, 1.5),
        // Across both ends of the ramp at ±3.
        HardSwish => Init::U(-4.5, 4.5),
        Tan => Init::U(-1.2, 1.2),
        Acos | Asin | Atanh => Init::U(-0.9, 0.9),
        Acosh => Init::U(1.2, 3.0),
        _ => SMOOTH,
    }
}

/// Unary ops (gradient op `UnaryGrad(u)`; `Neg` differentiates to `Neg`).
#[test]
fn unary() {
    let mut s = Suite::new("unary");
    for u in UNARY {
        for shape in [&[][..], &[7], &[3, 4], &[2, 3, 4]] {
            s.case(&format!("{}_grad/{shape:?}", ir::unary_name(u)), |c| {
                let x = c.param("x", shape, unary_domain(u));
                c.op(Op::Unary(u), &[x])
            });
        }
    }
    s.finish();
}

/// Every `UnaryGrad` kernel (including `Neg`'s, which autodiff never emits) against central
/// differences of its forward kernel: `dx = dy * (f(x + h) - f(x - h)) / 2h`, h = 1e-3.
#[test]
fn unary_grad_kernels() -> Result<()> {
    let ctx = Cpu::new(1)?;
    let mut rng = Rng::new(fnv("unary_grad_kernels"));
    for u in UNARY {
        let n = 32;
        let x = init_values(&mut rng, n, unary_domain(u));
        let dy: Vec<f32> = (0..n).map(|_| rng.uniform(-1.0, 1.0)).collect();
        let (xt, dyt) = (Tensor::f32([n], x.clone()), Tensor::f32([n], dy.clone()));
        // Some gradients read the forward output instead of the input.
        let from = if ir::unary_grad_from_output(u) {
            kernels::cpu::eval(ctx.context(), &Op::Unary(u), &[&xt])?.remove(0)
        } else {
            xt.clone()
        };
        let got = kernels::cpu::eval(ctx.context(), &Op::UnaryGrad(u), &[&from, &dyt])?.remove(0).to_f32_vec();
        let f = |v: Vec<f32>| -> Result<Vec<f32>> {
            Ok(kernels::cpu::eval(ctx.context(), &Op::Unary(u), &[&Tensor::f32([n], v)])?.remove(0).to_f32_vec())
        };
        let plus: Vec<f32> = x.iter().map(|&v| (v as f64 + EPS) as f32).collect();
        let minus: Vec<f32> = x.iter().map(|&v| (v as f64 - EPS) as f32).collect();
        let (fp, fm) = (f(plus.clone())?, f(minus.clone())?);
        let fd: Vec<f64> =
            (0..n).map(|i| dy[i] as f64 * (fp[i] as f64 - fm[i] as f64) / (plus[i] as f64 - minus[i] as f64)).collect();
        let diff = got.iter().zip(&fd).map(|(&a, f)| (a as f64 - f).powi(2)).sum::<f64>().sqrt();
        let norm = fd.iter().map(|f| f * f).sum::<f64>().sqrt();
        let rel = diff / norm.max(NORM_FLOOR);
        println!("{}: max rel err {rel:.2e}", ir::unary_grad_name(u));
        ensure!(rel <= TOL, "{}: kernel vs finite differences: {rel:.3e} > {TOL:.0e}", ir::unary_grad_name(u));
    }
    Ok(())
}

/// Binary ops with numpy broadcasting (un-broadcast by `ReduceSum` + `Reshape`; `Max`/`Min`
/// through `Where` masks).
#[test]
fn binary() {
    let mut s = Suite::new("binary");
    let shapes: [(&str, &[usize], &[usize]); 5] = [
        ("same", &[3, 4], &[3, 4]),
        ("bcast_rhs_trailing", &[2, 3, 4], &[4]),
        ("bcast_both", &[3, 1], &[1, 4]),
        ("bcast_lhs_scalar", &[], &[2, 3]),
        ("bcast_lhs_middle", &[2, 1, 4], &[2, 3, 4]),
    ];
    use BinaryOp::*;
    for op in [Add, Sub, Mul, Div, Pow, Max, Min] {
        let (ia, ib) = match op {
            Div => (SMOOTH, POS),
            Pow => (POS, Init::U(-1.5, 2.0)),
            Max | Min => (Init::Grid(0.0), Init::Grid(0.05)),
            _ => (SMOOTH, SMOOTH),
        };
        for (name, sa, sb) in shapes {
            s.case(&format!("{}/{name}", ir::binary_name(op)), |c| {
                let a = c.param("a", sa, ia);
                let b = c.param("b", sb, ib);
                c.op(Op::Binary(op), &[a, b])
            });
        }
    }
    // A divisor that is negative, and the same value on both sides (fan-out into one op).
    s.case("div/negative_divisor", |c| {
        let a = c.param("a", &[3, 4], SMOOTH);
        let b = c.param("b", &[4], Init::U(-2.0, -0.5));
        c.op(Op::Binary(Div), &[a, b])
    });
    s.case("mul/same_value_both_sides", |c| {
        let a = c.param("a", &[2, 3], SMOOTH);
        c.op(Op::Binary(Mul), &[a, a])
    });
    s.finish();
}

/// PRelu: gradients to x and to the slope, which broadcasts to x (per channel, scalar, full).
#[test]
fn prelu() {
    let mut s = Suite::new("prelu");
    let slopes: [(&str, &[usize]); 4] =
        [("channel", &[3, 1]), ("trailing", &[4]), ("scalar", &[]), ("full", &[2, 3, 4])];
    for (name, ss) in slopes {
        s.case(&format!("prelu/{name}"), |c| {
            let x = c.param("x", &[2, 3, 4], Init::Grid(0.05));
            let slope = c.param("slope", ss, Init::U(0.05, 0.5));
            c.op(Op::Binary(BinaryOp::PRelu), &[x, slope])
        });
    }
    s.finish();
}

/// `Where` with a constant boolean condition, broadcasting in all three inputs.
#[test]
fn where_() {
    let mut s = Suite::new("where");
    type WhereCase<'a> = (&'a str, &'a [usize], &'a [usize], &'a [usize]);
    let shapes: [WhereCase; 4] = [
        ("same", &[3, 4], &[3, 4], &[3, 4]),
        ("bcast_a_b", &[3, 4], &[4], &[3, 1]),
        ("bcast_cond_scalar_b", &[2, 1, 4], &[3, 1], &[]),
        ("bcast_cond_only", &[4], &[2, 3, 4], &[2, 3, 1]),
    ];
    for (name, sc, sa, sb) in shapes {
        s.case(name, |c| {
            let cond = c.random_bool(sc);
            let cond = c.constant("cond", cond);
            let a = c.param("a", sa, SMOOTH);
            let b = c.param("b", sb, SMOOTH);
            c.op(Op::Where, &[cond, a, b])
        });
    }
    s.finish();
}

/// `Cast` to f32 (of f32: the identity; of a constant i64: no gradient path) and `Identity`.
#[test]
fn cast_identity() {
    let mut s = Suite::new("cast_identity");
    for shape in [&[5][..], &[2, 3], &[2, 2, 3]] {
        s.case(&format!("cast_f32/{shape:?}"), |c| {
            let x = c.param("x", shape, SMOOTH);
            c.op(Op::Cast { to: DType::F32 }, &[x])
        });
        s.case(&format!("identity/{shape:?}"), |c| {
            let x = c.param("x", shape, SMOOTH);
            c.op(Op::Identity, &[x])
        });
        s.case(&format!("cast_i64_const_times_param/{shape:?}"), |c| {
            let n: usize = shape.iter().product();
            let k = c.constant("k", Tensor::i64(shape, (0..n as i64).map(|i| i % 3 - 1).collect()));
            let kf = c.op(Op::Cast { to: DType::F32 }, &[k])?;
            let x = c.param("x", shape, SMOOTH);
            let x = c.op(Op::Cast { to: DType::F32 }, &[x])?;
            c.op(Op::Binary(BinaryOp::Mul), &[x, kf])
        });
    }
    s.finish();
}

// ---------------------------------------------------------------------------------------------
// Matrix products.

/// `MatMul` with numpy semantics: 2-D, batched, batch broadcasting, 1-D operands.
#[test]
fn matmul() {
    let mut s = Suite::new("matmul");
    let shapes: [(&str, &[usize], &[usize]); 10] = [
        ("2d", &[3, 4], &[4, 5]),
        ("batch_a_matrix_b", &[2, 3, 4], &[4, 5]),
        ("vec_a", &[4], &[4, 5]),
        ("vec_b", &[3, 4], &[4]),
        ("vec_vec", &[5], &[5]),
        ("batch_both", &[2, 3, 4], &[2, 4, 3]),
        ("batch_bcast_4d_3d", &[2, 1, 3, 4], &[3, 4, 2]),
        ("matrix_a_batch_b", &[3, 4], &[2, 4, 5]),
        ("vec_a_batch_b", &[4], &[2, 4, 3]),
        ("batch_a_vec_b", &[2, 3, 4], &[4]),
    ];
    for (name, sa, sb) in shapes {
        s.case(name, |c| {
            let a = c.param("a", sa, SMOOTH);
            let b = c.param("b", sb, SMOOTH);
            c.op(Op::MatMul, &[a, b])
        });
    }
    s.finish();
}

/// `Gemm`: all four transpose combinations, C of shape [n], [m,n], [1,n], [m,1], [] or absent,
/// alpha and beta != 1.
#[test]
fn gemm() {
    let mut s = Suite::new("gemm");
    type GemmCase<'a> = (&'a str, bool, bool, f32, f32, Option<&'a [usize]>);
    let (m, k, n) = (3, 4, 5);
    let cases: [GemmCase; 7] = [
        ("nn_c[n]", false, false, 1.0, 1.0, Some(&[5])),
        ("tn_c[m,n]", true, false, 1.0, 1.0, Some(&[3, 5])),
        ("nt_c[1,n]_alpha_beta", false, true, 0.5, 2.0, Some(&[1, 5])),
        ("tt_no_c_alpha", true, true, 1.5, 1.0, None),
        ("nn_c[m,1]_neg_alpha", false, false, -0.7, 0.3, Some(&[3, 1])),
        ("tt_c_scalar_neg_beta", true, true, 1.0, -1.5, Some(&[])),
        ("tn_no_c", true, false, 2.0, 1.0, None),
    ];
    for (name, ta, tb, alpha, beta, cshape) in cases {
        s.case(name, |c| {
            let (sa, sb) = (if ta { [k, m] } else { [m, k] }, if tb { [n, k] } else { [k, n] });
            let a = c.param("a", &sa, SMOOTH);
            let b = c.param("b", &sb, SMOOTH);
            let mut ins = vec![a, b];
            if let Some(cs) = cshape {
                ins.push(c.param("c", cs, SMOOTH));
            }
            c.op(Op::Gemm { alpha, beta, trans_a: ta, trans_b: tb }, &ins)
        });
    }
    s.finish();
}

// ---------------------------------------------------------------------------------------------
// Convolution and pooling.

/// `Conv` (gradient ops `ConvInputGrad`, `ConvWeightGrad`; the bias by `ReduceSum`).
#[test]
fn conv() {
    let mut s = Suite::new("conv");
    type ConvCase<'a> = (&'a str, &'a [usize], &'a [usize], bool, ConvAttrs);
    let cases: [ConvCase; 6] = [
        ("3x3_bias", &[1, 2, 5, 5], &[3, 2, 3, 3], true, conv_attrs([1, 1], [0; 4], [1, 1], 1)),
        ("3x3_stride2_pad1", &[2, 2, 5, 5], &[2, 2, 3, 3], false, conv_attrs([2, 2], [1; 4], [1, 1], 1)),
        (
            "group2_dilation2_asym_pads_bias",
            &[1, 4, 5, 5],
            &[4, 2, 3, 3],
            true,
            conv_attrs([1, 1], [1, 0, 2, 1], [2, 2], 2),
        ),
        ("1x1_direct_bias", &[2, 3, 3, 3], &[4, 3, 1, 1], true, conv_attrs([1, 1], [0; 4], [1, 1], 1)),
        ("depthwise_stride_1x2", &[1, 3, 4, 4], &[3, 1, 2, 2], true, conv_attrs([1, 2], [0; 4], [1, 1], 3)),
        ("stride3_skips_cells", &[1, 1, 6, 7], &[2, 1, 2, 2], false, conv_attrs([3, 3], [0; 4], [1, 1], 1)),
    ];
    for (name, xs, ws, bias, attrs) in cases {
        s.case(name, |c| {
            let x = c.param("x", xs, SMOOTH);
            let w = c.param("w", ws, SMOOTH);
            let mut ins = vec![x, w];
            if bias {
                ins.push(c.param("bias", &[ws[0]], SMOOTH));
            }
            c.op(Op::Conv(attrs), &ins)
        });
    }
    s.finish();
}

/// `Conv` on a two-thread context: with `batch * group >= 2 * threads` the input gradient runs
/// one task per (image, group) on the pool, a path the one-thread cases do not take.
#[test]
fn conv_two_threads() {
    let mut s = Suite::with_threads("conv_2threads", 2);
    type ConvCase<'a> = (&'a str, &'a [usize], &'a [usize], ConvAttrs);
    let cases: [ConvCase; 3] = [
        ("batch2_group2", &[2, 4, 4, 4], &[4, 2, 3, 3], conv_attrs([1, 1], [1; 4], [1, 1], 2)),
        ("batch4_stride2", &[4, 1, 5, 5], &[2, 1, 3, 3], conv_attrs([2, 2], [0, 1, 1, 0], [1, 1], 1)),
        ("batch2_depthwise_1x1", &[2, 3, 3, 3], &[3, 1, 1, 1], conv_attrs([1, 1], [0; 4], [1, 1], 3)),
    ];
    for (name, xs, ws, attrs) in cases {
        s.case(name, |c| {
            let x = c.param("x", xs, SMOOTH);
            let w = c.param("w", ws, SMOOTH);
            let bias = c.param("bias", &[ws[0]], SMOOTH);
            c.op(Op::Conv(attrs), &[x, w, bias])
        });
    }
    s.finish();
}

/// `ConvInputGrad` as a forward op (ONNX `ConvTranspose` imports as one): its gradients are a
/// `Conv` of dy (input) and a `ConvWeightGrad` with image and output gradient swapped (weight).
#[test]
fn conv_transpose() {
    let mut s = Suite::new("conv_transpose");
    type Case<'a> = (&'a str, &'a [usize], &'a [usize], Vec<usize>, ConvAttrs);
    let cases: [Case; 4] = [
        ("3x3_stride1", &[1, 2, 3, 3], &[2, 3, 3, 3], vec![1, 3, 5, 5], conv_attrs([1, 1], [0; 4], [1, 1], 1)),
        // Stride 2 with output_padding 1 (an output row and column no window covers) and pads.
        ("stride2_pad1_outpad1", &[2, 2, 3, 3], &[2, 2, 3, 3], vec![2, 2, 6, 6], conv_attrs([2, 2], [1; 4], [1, 1], 1)),
        ("group2_dilation2", &[1, 4, 3, 2], &[4, 1, 2, 2], vec![1, 2, 5, 4], conv_attrs([1, 1], [0; 4], [2, 2], 2)),
        // A 1-D transposed convolution as autopar imports it: unit height.
        ("1d_stride3", &[2, 2, 1, 4], &[2, 3, 1, 2], vec![2, 3, 1, 11], conv_attrs([1, 3], [0; 4], [1, 1], 1)),
    ];
    for (name, xs, ws, shape, attrs) in cases {
        s.case(name, |c| {
            let x = c.param("x", xs, SMOOTH);
            let w = c.param("w", ws, SMOOTH);
            c.op(Op::ConvInputGrad { attrs, shape }, &[x, w])
        });
    }
    s.finish();
}

/// `Resize` (gradient op `ResizeGrad`) in every mode, up and down, one and two axes.
#[test]
fn resize() {
    use ir::{CoordTransform, NearestMode, ResizeAttrs, ResizeAxis, ResizeMode};
    let mut s = Suite::new("resize");
    let forms = [
        ("nearest_floor_asymmetric", ResizeMode::Nearest, CoordTransform::Asymmetric, NearestMode::Floor, false),
        ("nearest_half_pixel", ResizeMode::Nearest, CoordTransform::HalfPixel, NearestMode::RoundPreferFloor, false),
        ("linear_half_pixel", ResizeMode::Linear, CoordTransform::HalfPixel, NearestMode::RoundPreferFloor, false),
        (
            "linear_align_corners",
            ResizeMode::Linear,
            CoordTransform::AlignCorners,
            NearestMode::RoundPreferFloor,
            false,
        ),
        ("cubic_exclude_outside", ResizeMode::Cubic, CoordTransform::HalfPixel, NearestMode::RoundPreferFloor, true),
    ];
    for (name, mode, coord, nearest_mode, exclude_outside) in forms {
        let two = vec![ResizeAxis { axis: 2, size: 5, scale: 5.0 / 3.0 }, ResizeAxis { axis: 3, size: 2, scale: 0.5 }];
        let one = vec![ResizeAxis { axis: 1, size: 6, scale: 3.0 }];
        for (tag, axes) in [("hw", two), ("c", one)] {
            let a = ResizeAttrs { axes, mode, coord, nearest_mode, cubic_a: -0.75, exclude_outside };
            s.case(&format!("{name}/{tag}"), |c| {
                let x = c.param("x", &[1, 2, 3, 4], SMOOTH);
                c.op(Op::Resize(a), &[x])
            });
        }
    }
    s.finish();
}

/// `MaxPool` (gradient op `MaxPoolGrad`), `AveragePool` (`AveragePoolGrad`), and the global pools.
#[test]
fn pooling() {
    let mut s = Suite::new("pooling");
    let mut dilated = pool([2, 3], [2, 1], [0; 4], true, false);
    dilated.dilations = [2, 1];
    let max_cases: [(&str, &[usize], PoolAttrs); 4] = [
        ("2x2_stride2", &[1, 2, 4, 4], pool([2, 2], [2, 2], [0; 4], false, false)),
        ("3x3_overlapping_pad1", &[1, 1, 5, 5], pool([3, 3], [1, 1], [1; 4], false, false)),
        ("2x3_dilated_ceil", &[2, 1, 5, 6], dilated),
        ("2x2_ceil_partial_windows", &[1, 2, 5, 5], pool([2, 2], [2, 2], [0; 4], true, false)),
    ];
    for (name, xs, attrs) in max_cases {
        s.case(&format!("maxpool_grad/{name}"), |c| {
            let x = c.param("x", xs, Init::Grid(0.0));
            c.op(Op::MaxPool(attrs), &[x])
        });
    }
    let avg_cases: [(&str, &[usize], PoolAttrs); 4] = [
        ("2x2_stride2", &[1, 2, 4, 4], pool([2, 2], [2, 2], [0; 4], false, false)),
        ("3x3_pad1_exclude_pad", &[1, 1, 5, 5], pool([3, 3], [1, 1], [1; 4], false, false)),
        ("3x3_stride2_pad1_include_pad_ceil", &[1, 2, 5, 6], pool([3, 3], [2, 2], [1; 4], true, true)),
        ("2x2_ceil_partial_windows", &[1, 1, 5, 5], pool([2, 2], [2, 2], [0; 4], true, false)),
    ];
    for (name, xs, attrs) in avg_cases {
        s.case(&format!("avgpool_grad/{name}"), |c| {
            let x = c.param("x", xs, SMOOTH);
            c.op(Op::AveragePool(attrs), &[x])
        });
    }
    for xs in [&[1, 2, 3, 3][..], &[2, 3, 2, 4], &[2, 2, 5]] {
        s.case(&format!("global_avgpool/{xs:?}"), |c| {
            let x = c.param("x", xs, SMOOTH);
            c.op(Op::GlobalAveragePool, &[x])
        });
        s.case(&format!("global_maxpool/{xs:?}"), |c| {
            let x = c.param("x", xs, Init::Grid(0.0));
            c.op(Op::GlobalMaxPool, &[x])
        });
    }
    s.finish();
}

// ---------------------------------------------------------------------------------------------
// Normalisation and softmax.

/// `BatchNorm` (inference form), every input differentiated. A parameter the op reads directly
/// as its mean or variance is a running statistic, never trained
/// (`ir::autodiff::running_statistics`); read through an `Identity`, they are values like any
/// other, so the rule's mean and variance gradients are checked too.
#[test]
fn batchnorm() {
    let mut s = Suite::new("batchnorm");
    for xs in [&[2, 3, 2, 2][..], &[4, 3], &[2, 2, 3]] {
        s.case(&format!("{xs:?}"), |c| {
            let ch = xs[1];
            let x = c.param("x", xs, SMOOTH);
            let scale = c.param("scale", &[ch], Init::U(0.5, 1.5));
            let bias = c.param("bias", &[ch], SMOOTH);
            let mean = c.param("mean", &[ch], Init::U(-1.0, 1.0));
            let var = c.param("var", &[ch], POS);
            let mean = c.op(Op::Identity, &[mean])?;
            let var = c.op(Op::Identity, &[var])?;
            c.op(Op::BatchNorm { epsilon: 1e-5 }, &[x, scale, bias, mean, var])
        });
    }
    s.finish();
}

/// `BatchNormTrain` (gradient op `BatchNormTrainGrad`): batch statistics, so the gradient runs
/// through the per-channel mean and variance; 2-D, 3-D and 4-D inputs, one and several spatial
/// positions, and a batch of one.
#[test]
fn batchnorm_train() {
    let mut s = Suite::new("batchnorm_train");
    for xs in [&[2, 3, 2, 2][..], &[4, 3], &[2, 2, 3], &[1, 2, 5]] {
        s.case(&format!("{xs:?}"), |c| {
            let ch = xs[1];
            let x = c.param("x", xs, SMOOTH);
            let scale = c.param("scale", &[ch], Init::U(0.5, 1.5));
            let bias = c.param("bias", &[ch], SMOOTH);
            c.op(Op::BatchNormTrain { epsilon: 1e-5 }, &[x, scale, bias])
        });
    }
    s.finish();
}

/// `LayerNorm` (gradient op `LayerNormGrad`), scale and bias full, broadcast or absent.
#[test]
fn layernorm() {
    let mut s = Suite::new("layernorm");
    type LnCase<'a> = (&'a str, &'a [usize], usize, &'a [usize], Option<&'a [usize]>);
    let cases: [LnCase; 5] = [
        ("[3,8]/axis1/scale_bias", &[3, 8], 1, &[8], Some(&[8])),
        ("[2,3,4]/axis1/scale[3,4]_no_bias", &[2, 3, 4], 1, &[3, 4], None),
        ("[2,3,4]/axis2/scale[1]_bias[4]", &[2, 3, 4], 2, &[1], Some(&[4])),
        ("[2,3,4]/axis1/scale[4]_bias[1,4]", &[2, 3, 4], 1, &[4], Some(&[1, 4])),
        ("[2,5]/axis0/scale[1,5]_bias[2,1]", &[2, 5], 0, &[1, 5], Some(&[2, 1])),
    ];
    for (name, xs, axis, ss, bs) in cases {
        s.case(name, |c| {
            let x = c.param("x", xs, SMOOTH);
            let scale = c.param("scale", ss, Init::U(0.5, 1.5));
            let mut ins = vec![x, scale];
            if let Some(bs) = bs {
                ins.push(c.param("bias", bs, SMOOTH));
            }
            c.op(Op::LayerNorm { axis, epsilon: 1e-5 }, &ins)
        });
    }
    s.finish();
}

/// `Lrn` (gradient op `LrnGrad`), odd and even windows.
#[test]
fn lrn() {
    let mut s = Suite::new("lrn");
    type LrnCase<'a> = (&'a str, &'a [usize], usize, f32, f32, f32);
    let cases: [LrnCase; 4] = [
        ("[1,5,2,2]/size3", &[1, 5, 2, 2], 3, 0.5, 0.75, 1.0),
        ("[2,4,3]/size2", &[2, 4, 3], 2, 1.0, 0.75, 1.5),
        ("[1,6,2,3]/size5", &[1, 6, 2, 3], 5, 1.0, 0.5, 2.0),
        ("[2,3]/size4", &[2, 3], 4, 0.8, 1.2, 1.0),
    ];
    for (name, xs, size, alpha, beta, bias) in cases {
        s.case(name, |c| {
            let x = c.param("x", xs, SMOOTH);
            c.op(Op::Lrn { size, alpha, beta, bias }, &[x])
        });
    }
    s.finish();
}

/// `Softmax` and `LogSoftmax` (gradient op `SoftmaxGrad`, `log` false and true) on every axis
/// position.
#[test]
fn softmax() {
    let mut s = Suite::new("softmax");
    let cases: [(&[usize], usize); 4] = [(&[6], 0), (&[3, 5], 1), (&[2, 4, 3], 1), (&[3, 4], 0)];
    for (xs, axis) in cases {
        s.case(&format!("softmax_grad/{xs:?}/axis{axis}"), |c| {
            let x = c.param("x", xs, SMOOTH);
            c.op(Op::Softmax { axis }, &[x])
        });
        s.case(&format!("log_softmax_grad/{xs:?}/axis{axis}"), |c| {
            let x = c.param("x", xs, SMOOTH);
            c.op(Op::LogSoftmax { axis }, &[x])
        });
    }
    s.finish();
}

// ---------------------------------------------------------------------------------------------
// Shape ops.

/// `Reshape`, `Transpose`, `Expand`, `Pad`.
#[test]
fn shape_ops() {
    let mut s = Suite::new("shape");
    let reshapes: [(&[usize], &[usize]); 3] = [(&[2, 6], &[3, 4]), (&[24], &[2, 3, 4]), (&[2, 3, 4], &[6, 4])];
    for (xs, to) in reshapes {
        s.case(&format!("reshape/{xs:?}->{to:?}"), |c| {
            let x = c.param("x", xs, SMOOTH);
            c.op(Op::Reshape { shape: to.to_vec() }, &[x])
        });
    }
    let transposes: [(&[usize], &[usize]); 3] =
        [(&[2, 3], &[1, 0]), (&[2, 3, 4], &[2, 0, 1]), (&[2, 3, 2, 2], &[0, 2, 3, 1])];
    for (xs, perm) in transposes {
        s.case(&format!("transpose/{xs:?}/{perm:?}"), |c| {
            let x = c.param("x", xs, SMOOTH);
            c.op(Op::Transpose { perm: perm.to_vec() }, &[x])
        });
    }
    let expands: [(&[usize], &[usize]); 5] =
        [(&[3, 1], &[3, 4]), (&[4], &[2, 3, 4]), (&[], &[2, 2]), (&[2, 1, 3], &[2, 4, 3]), (&[1, 3], &[2, 2, 3])];
    for (xs, to) in expands {
        s.case(&format!("expand/{xs:?}->{to:?}"), |c| {
            let x = c.param("x", xs, SMOOTH);
            c.op(Op::Expand { shape: to.to_vec() }, &[x])
        });
    }
    let pads: [(&[usize], &[usize], f32); 4] = [
        (&[2, 3], &[1, 0, 0, 2], 0.5),
        (&[2, 3, 4], &[0, 1, 2, 1, 0, 1], 0.0),
        (&[4], &[0, 0], 1.0),
        (&[3], &[2, 1], -1.0),
    ];
    for (xs, p, value) in pads {
        s.case(&format!("pad/{xs:?}/{p:?}"), |c| {
            let x = c.param("x", xs, SMOOTH);
            c.op(Op::Pad { pads: p.to_vec(), value }, &[x])
        });
    }
    s.finish();
}

/// `Concat` and `Split` (one output of each split left unused: its gradient is zeros).
#[test]
fn concat_split() {
    let mut s = Suite::new("concat_split");
    s.case("concat/axis0", |c| {
        let a = c.param("a", &[2, 3], SMOOTH);
        let b = c.param("b", &[1, 3], SMOOTH);
        c.op(Op::Concat { axis: 0 }, &[a, b])
    });
    s.case("concat/axis1_three_inputs", |c| {
        let a = c.param("a", &[2, 1, 4], SMOOTH);
        let b = c.param("b", &[2, 3, 4], SMOOTH);
        let d = c.param("d", &[2, 2, 4], SMOOTH);
        c.op(Op::Concat { axis: 1 }, &[a, b, d])
    });
    s.case("concat/single_input", |c| {
        let a = c.param("a", &[3, 2], SMOOTH);
        c.op(Op::Concat { axis: 1 }, &[a])
    });
    s.case("concat/with_constant_and_repeat", |c| {
        let a = c.param("a", &[2, 2], SMOOTH);
        let k = c.constant("k", Tensor::f32([2, 3], vec![0.5, -1.0, 2.0, 0.0, 1.5, -0.5]));
        c.op(Op::Concat { axis: 1 }, &[a, k, a])
    });
    s.case("split/axis0_middle_unused", |c| {
        let x = c.param("x", &[6, 3], SMOOTH);
        let p = c.ops(Op::Split { axis: 0, sizes: vec![2, 2, 2] }, &[x])?;
        c.op(Op::Binary(BinaryOp::Mul), &[p[0], p[2]])
    });
    s.case("split/axis1_uneven", |c| {
        let x = c.param("x", &[2, 5], SMOOTH);
        let p = c.ops(Op::Split { axis: 1, sizes: vec![2, 1, 2] }, &[x])?;
        c.op(Op::Binary(BinaryOp::Mul), &[p[0], p[2]])
    });
    s.case("split/axis2_broadcast_use", |c| {
        let x = c.param("x", &[2, 3, 4], SMOOTH);
        let p = c.ops(Op::Split { axis: 2, sizes: vec![1, 3] }, &[x])?;
        c.op(Op::Binary(BinaryOp::Mul), &[p[0], p[1]])
    });
    s.case("split/first_unused", |c| {
        let x = c.param("x", &[4, 2], SMOOTH);
        let p = c.ops(Op::Split { axis: 0, sizes: vec![1, 1, 2] }, &[x])?;
        c.op(Op::Binary(BinaryOp::Add), &[p[1], p[2]])
    });
    s.finish();
}

/// `Slice` (unit steps: gradient `Pad`; other steps: gradient op `SliceGrad`) and `Gather`
/// (gradient op `GatherGrad`, a scatter-add: repeated and negative indices).
#[test]
fn slice_gather() {
    let mut s = Suite::new("slice_gather");
    let slices: [(&str, &[usize], Vec<SliceAxis>); 6] = [
        ("unit_step_pad", &[5, 4], vec![sl(0, 1, 3, 1)]),
        ("unit_step_two_axes_pad", &[4, 5, 3], vec![sl(1, 2, 2, 1), sl(2, 0, 2, 1)]),
        ("slice_grad/step2", &[6, 3], vec![sl(0, 0, 3, 2)]),
        ("slice_grad/step_minus1", &[5, 4], vec![sl(1, 3, 3, -1)]),
        ("slice_grad/step_minus2_and_unit", &[4, 5, 3], vec![sl(0, 3, 2, -2), sl(2, 1, 2, 1)]),
        ("slice_grad/step3", &[7, 2], vec![sl(0, 1, 2, 3)]),
    ];
    for (name, xs, axes) in slices {
        s.case(&format!("slice/{name}"), |c| {
            let x = c.param("x", xs, SMOOTH);
            c.op(Op::Slice { axes }, &[x])
        });
    }
    type GatherCase<'a> = (&'a str, &'a [usize], usize, &'a [usize], &'a [i64]);
    let gathers: [GatherCase; 4] = [
        ("axis0_repeat_negative", &[5, 3], 0, &[4], &[0, 2, 2, -1]),
        ("axis1_2d_indices", &[2, 4, 3], 1, &[2, 3], &[3, 0, -4, 1, 1, 2]),
        ("axis1_scalar_index", &[3, 4], 1, &[], &[-2]),
        ("1d_data_2d_indices", &[6], 0, &[3, 2], &[5, 0, 5, 5, 1, -6]),
    ];
    for (name, xs, axis, is, idx) in gathers {
        s.case(&format!("gather_grad/{name}"), |c| {
            let x = c.param("x", xs, SMOOTH);
            let i = c.constant("indices", Tensor::i64(is, idx.to_vec()));
            c.op(Op::Gather { axis }, &[x, i])
        });
    }
    s.finish();
}

/// Every reduction, over one axis, several axes and all axes, with and without kept dims.
#[test]
fn reduce() {
    let mut s = Suite::new("reduce");
    let configs: [(&[usize], &[usize], bool); 5] = [
        (&[3, 4], &[1], false),
        (&[2, 3, 4], &[0, 2], true),
        (&[2, 3, 4], &[0, 1, 2], false),
        (&[4, 5], &[0], true),
        (&[2, 3, 4], &[1], false),
    ];
    use ReduceOp::*;
    for r in [Sum, Mean, Max, Min, Prod, SumSquare, L2, L1, LogSum, LogSumExp] {
        let init = match r {
            Prod => Init::U(0.7, 1.4),
            L2 | LogSum => Init::U(0.3, 2.0),
            L1 => Init::Grid(0.05),
            Max | Min => Init::Grid(0.0),
            _ => Init::U(-1.5, 1.5),
        };
        for (xs, axes, keepdims) in configs {
            let keep = if keepdims { "keep" } else { "drop" };
            s.case(&format!("{}/{xs:?}/axes{axes:?}/{keep}", ir::reduce_name(r)), |c| {
                let x = c.param("x", xs, init);
                c.op(Op::Reduce { op: r, axes: axes.to_vec(), keepdims }, &[x])
            });
        }
    }
    s.finish();
}

// ---------------------------------------------------------------------------------------------
// Compositions and parameter handling.

/// Small models: an MLP with softmax, and a residual layer-norm block.
#[test]
fn compositions() {
    let mut s = Suite::new("composition");
    s.case("mlp_gelu_softmax", |c| {
        let x = c.constant("x", Tensor::f32([4, 3], (0..12).map(|i| (i as f32 * 0.37).sin()).collect()));
        let w1 = c.param("w1", &[3, 5], SMOOTH);
        let b1 = c.param("b1", &[5], SMOOTH);
        let w2 = c.param("w2", &[5, 2], SMOOTH);
        let b2 = c.param("b2", &[2], SMOOTH);
        let h = c.op(Op::MatMul, &[x, w1])?;
        let h = c.op(Op::Binary(BinaryOp::Add), &[h, b1])?;
        let h = c.op(Op::Unary(UnaryOp::Gelu), &[h])?;
        let z = c.op(Op::Gemm { alpha: 1.0, beta: 1.0, trans_a: false, trans_b: false }, &[h, w2, b2])?;
        c.op(Op::Softmax { axis: 1 }, &[z])
    });
    s.case("leaky_relu_via_where_of_comparison", |c| {
        // The boolean mask from a comparison of the parameter carries no gradient.
        let x = c.param("x", &[3, 5], Init::Grid(0.05));
        let zero = c.constant("zero", Tensor::scalar_f32(0.0));
        let slope = c.constant("slope", Tensor::scalar_f32(0.1));
        let m = c.op(Op::Binary(BinaryOp::Greater), &[x, zero])?;
        let neg = c.op(Op::Binary(BinaryOp::Mul), &[x, slope])?;
        c.op(Op::Where, &[m, x, neg])
    });
    s.case("integer_path_has_no_gradient", |c| {
        // y = a * (f32(i64(b)) + b): the path through the integer cast carries no gradient (nor
        // finite difference: no grid value is within eps of an integer), only the direct one.
        let a = c.param("a", &[2, 4], SMOOTH);
        let b = c.param("b", &[4], Init::Grid(0.05));
        let bi = c.op(Op::Cast { to: DType::I64 }, &[b])?;
        let bf = c.op(Op::Cast { to: DType::F32 }, &[bi])?;
        let b2 = c.op(Op::Binary(BinaryOp::Add), &[bf, b])?;
        c.op(Op::Binary(BinaryOp::Mul), &[a, b2])
    });
    s.case("residual_layernorm", |c| {
        let x = c.param("x", &[2, 3, 4], SMOOTH);
        let w = c.param("w", &[4, 4], SMOOTH);
        let g = c.param("g", &[4], Init::U(0.5, 1.5));
        let h = c.op(Op::MatMul, &[x, w])?;
        let h = c.op(Op::Unary(UnaryOp::Tanh), &[h])?;
        let h = c.op(Op::Binary(BinaryOp::Add), &[h, x])?;
        c.op(Op::LayerNorm { axis: 2, epsilon: 1e-5 }, &[h, g])
    });
    s.finish();
}

/// Fan-out (a parameter read by several ops gets the sum of the gradients), an unused parameter
/// (not trained: no gradient output) and a frozen parameter (no gradient output).
#[test]
fn fan_out_unused_frozen() -> Result<()> {
    let ctx = Cpu::new(1)?;
    let build = |label: &str| -> Result<(Case, Value)> {
        let mut c = Case { g: Graph::new(label), rng: Rng::new(fnv(label)), key: None };
        let a = c.param("a", &[2, 3], SMOOTH);
        let b = c.param("b", &[3], SMOOTH);
        c.param("unused", &[2, 2], SMOOTH);
        // y = a*a + a + tanh(a) * b
        let aa = c.op(Op::Binary(BinaryOp::Mul), &[a, a])?;
        let y = c.op(Op::Binary(BinaryOp::Add), &[aa, a])?;
        let t = c.op(Op::Unary(UnaryOp::Tanh), &[a])?;
        let tb = c.op(Op::Binary(BinaryOp::Mul), &[t, b])?;
        let y = c.op(Op::Binary(BinaryOp::Add), &[y, tb])?;
        Ok((c, y))
    };

    let (c, y) = build("fan_out")?;
    let r = check(&ctx, "fan_out", c, y, &[])?;
    println!("fan_out: max rel err {:.2e}", r.worst);
    ensure!(r.failures.is_empty(), "{}", r.failures.join("\n"));
    // A parameter nothing reads is not trained (PyTorch leaves its `.grad` None, so neither the
    // update nor weight decay touches it): no gradient output at all.
    ensure!(!r.grads.contains_key("unused"), "the unused parameter has a gradient output");
    ensure!(r.grads["a"].to_f32_vec().iter().any(|&v| v != 0.0), "grad/a is zero");

    let (c, y) = build("frozen")?;
    let r = check(&ctx, "frozen", c, y, &["b"])?;
    println!("frozen: max rel err {:.2e}", r.worst);
    ensure!(r.failures.is_empty(), "{}", r.failures.join("\n"));
    if r.outputs.iter().any(|o| o == "grad/b") || r.grads.contains_key("b") {
        bail!("frozen parameter b has a gradient output (outputs: {:?})", r.outputs);
    }
    ensure!(r.outputs.iter().any(|o| o == "grad/a"), "grad/a missing: {:?}", r.outputs);
    Ok(())
}

/// Training-mode dropout with a fixed mask (the gradient op is the same dropout on the output
/// gradient, which must draw the forward's mask again): every run of the case, the training
/// graph's and each perturbed forward, is step 3 of seed 9, so all draw one mask. Two
/// dropouts with different ids, one before a nonlinearity, one with its mask output read by
/// the model (no gradient through it). Dropped elements have a zero gradient, and some are.
#[test]
fn dropout_with_a_fixed_mask() -> Result<()> {
    let ctx = Cpu::new(1)?;
    let label = "dropout/fixed_mask";
    let mut c = Case {
        g: Graph::new(label),
        rng: Rng::new(fnv(label)),
        key: Some(runtime::program::StepKey { seed: 9, step: 3 }),
    };
    let p = c.param("p", &[6, 7], SMOOTH);
    let q = c.param("q", &[6, 7], SMOOTH);
    let d = c.ops(Op::Dropout(ir::DropoutAttrs { ratio: 0.4, id: 0, mask: true }), &[p])?;
    let t = c.op(Op::Unary(UnaryOp::Tanh), &[d[0]])?;
    let m = c.op(Op::Cast { to: DType::F32 }, &[d[1]])?;
    let t = c.op(Op::Binary(BinaryOp::Add), &[t, m])?;
    let t = c.op(Op::Binary(BinaryOp::Mul), &[t, q])?;
    let y = c.op(Op::Dropout(ir::DropoutAttrs { ratio: 0.25, id: 1, mask: false }), &[t])?;
    let r = check(&ctx, label, c, y, &[])?;
    println!("{label}: max rel err {:.2e}", r.worst);
    ensure!(r.failures.is_empty(), "{}", r.failures.join("\n"));
    let gp = r.grads["p"].to_f32_vec();
    let zeros = gp.iter().filter(|&&v| v == 0.0).count();
    ensure!(zeros > 0 && zeros < gp.len(), "grad/p has {zeros} zeros of {}: no mask applied", gp.len());
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The indexing family (`ir::IndexOp`): gradients built from the family's own ops.

/// `Trilu` (gradient: the same triangle), `CumSum` (the reverse cumulative sum), `GatherND` and
/// `GatherElements` (scatter-add into zeros, repeated and negative indices), `ScatterND` and
/// `ScatterElements` with reduction none (data: masked where written; updates: gathered) and add,
/// and `TopK` (the values' gradient scattered back to their indices), plus non-differentiable
/// ops (`ArgMax`, `Mod`) on and off the parameter's path.
#[test]
fn indexing_family() {
    use ir::{IndexOp, ScatterReduction as R};
    let mut s = Suite::new("indexing");
    let ix = |op: IndexOp| Op::Index(op);
    for (upper, k) in [(false, 0), (true, 1), (false, -1)] {
        s.case(&format!("trilu/upper{upper}_k{k}"), |c| {
            let x = c.param("x", &[2, 3, 4], SMOOTH);
            c.op(ix(IndexOp::Trilu { upper, k }), &[x])
        });
    }
    for (axis, exclusive, reverse) in [(1, false, false), (1, true, false), (0, false, true), (0, true, true)] {
        s.case(&format!("cumsum/axis{axis}_excl{exclusive}_rev{reverse}"), |c| {
            let x = c.param("x", &[3, 4], SMOOTH);
            c.op(ix(IndexOp::CumSum { axis, exclusive, reverse }), &[x])
        });
    }
    type NdCase<'a> = (&'a str, &'a [usize], &'a [usize], &'a [i64]);
    let nds: [NdCase; 2] =
        [("rows_repeated", &[4, 3], &[3, 1], &[1, -1, 1]), ("cells", &[4, 3], &[2, 2], &[0, 1, 3, -1])];
    for (name, xs, is, idx) in nds {
        s.case(&format!("gather_nd/{name}"), |c| {
            let x = c.param("x", xs, SMOOTH);
            let i = c.constant("indices", Tensor::i64(is, idx.to_vec()));
            c.op(ix(IndexOp::GatherNd { batch_dims: 0 }), &[x, i])
        });
    }
    s.case("gather_elements/axis1_repeat_negative", |c| {
        let x = c.param("x", &[3, 4], SMOOTH);
        let i = c.constant("indices", Tensor::i64([3, 2], vec![0, 0, -1, 2, 3, 1]));
        c.op(ix(IndexOp::GatherElements { axis: 1 }), &[x, i])
    });
    for red in [R::None, R::Add] {
        s.case(&format!("scatter_nd/{}", red.name()), |c| {
            let x = c.param("x", &[4, 3], SMOOTH);
            let u = c.param("u", &[2, 3], SMOOTH);
            let idx = if red == R::Add { vec![1, 1] } else { vec![1, -1] };
            let i = c.constant("indices", Tensor::i64([2, 1], idx));
            c.op(ix(IndexOp::ScatterNd { reduction: red }), &[x, i, u])
        });
        s.case(&format!("scatter_elements/{}", red.name()), |c| {
            let x = c.param("x", &[3, 4], SMOOTH);
            let u = c.param("u", &[3, 2], SMOOTH);
            let idx = if red == R::Add { vec![0, 0, 1, -1, 2, 3] } else { vec![0, 2, 1, -1, 3, 2] };
            let i = c.constant("indices", Tensor::i64([3, 2], idx));
            c.op(ix(IndexOp::ScatterElements { axis: 1, reduction: red }), &[x, i, u])
        });
    }
    for (axis, largest) in [(1, true), (0, false)] {
        s.case(&format!("topk/axis{axis}_largest{largest}"), |c| {
            // Distinct values: no perturbation reorders them.
            let x = c.param("x", &[3, 5], Init::Grid(0.0));
            let t = c.ops(ix(IndexOp::TopK { axis, k: 2, largest }), &[x])?;
            Ok(t[0])
        });
    }
    // An arg-max of the parameter and a remainder of constants: index paths, no gradient rule needed.
    s.case("argmax_and_mod_paths", |c| {
        let x = c.param("x", &[3, 4], Init::Grid(0.0));
        let am = c.op(ix(IndexOp::ArgMax { axis: 1, keepdims: true, select_last: false }), &[x])?;
        let two = c.constant("two", Tensor::i64(Vec::<usize>::new(), vec![2]));
        let odd = c.op(Op::Binary(BinaryOp::Mod), &[am, two])?;
        let f = c.op(Op::Cast { to: DType::F32 }, &[odd])?;
        let scaled = c.op(Op::Binary(BinaryOp::Mul), &[x, f])?;
        c.op(Op::Binary(BinaryOp::Add), &[scaled, x])
    });
    s.finish();
}

// ---------------------------------------------------------------------------------------------
// Recurrent ops (`RNN`, `GRU`, `LSTM`), through their import: the tracer unrolls them into
// matrix products, activations and elementwise ops, so these cases check that the unrolled graph
// is differentiated correctly end to end (weights, recurrence weights, biases, peepholes and
// initial states, every step's state fed to the next).

/// One recurrent node whose every operand is an initializer (so a parameter of the imported
/// graph), the graph output being the node output `out` (`Y`, `Y_h` or `Y_c`).
struct Rec {
    op: &'static str,
    direction: &'static str,
    /// `(name, shape)` of every operand, in ONNX input order; `""` skips an optional slot.
    operands: Vec<(&'static str, Vec<usize>)>,
    ints: Vec<(&'static str, i64)>,
    out: &'static str,
}

fn rec_model(r: &Rec, rng: &mut Rng) -> Vec<u8> {
    use prost::Message as _;
    use tract_onnx::pb;
    use tract_onnx::pb::attribute_proto::AttributeType;
    let mut attribute = vec![pb::AttributeProto {
        name: "direction".into(),
        r#type: AttributeType::String as i32,
        s: r.direction.as_bytes().to_vec(),
        ..Default::default()
    }];
    attribute.extend(r.ints.iter().map(|(k, v)| pb::AttributeProto {
        name: k.to_string(),
        r#type: AttributeType::Int as i32,
        i: *v,
        ..Default::default()
    }));
    let node = pb::NodeProto {
        name: format!("{}_{}", r.op, r.direction),
        op_type: r.op.into(),
        input: r.operands.iter().map(|(n, _)| n.to_string()).collect(),
        output: if r.op == "LSTM" {
            vec!["Y".into(), "Y_h".into(), "Y_c".into()]
        } else {
            vec!["Y".into(), "Y_h".into()]
        },
        attribute,
        ..Default::default()
    };
    let initializer = r
        .operands
        .iter()
        .filter(|(n, _)| !n.is_empty())
        .map(|(n, s)| pb::TensorProto {
            name: n.to_string(),
            dims: s.iter().map(|&d| d as i64).collect(),
            data_type: pb::tensor_proto::DataType::Float as i32,
            float_data: init_values(rng, s.iter().product(), Init::U(-1.0, 1.0)),
            ..Default::default()
        })
        .collect();
    pb::ModelProto {
        ir_version: 8,
        opset_import: vec![pb::OperatorSetIdProto { domain: String::new(), version: 14 }],
        graph: Some(pb::GraphProto {
            name: "recurrent".into(),
            node: vec![node],
            output: vec![pb::ValueInfoProto { name: r.out.into(), ..Default::default() }],
            initializer,
            ..Default::default()
        }),
        ..Default::default()
    }
    .encode_to_vec()
}

/// Finite differences of every operand of `RNN`, `GRU` (both `linear_before_reset` forms) and
/// `LSTM` (peepholes, `input_forget`), forward, reverse and bidirectional, through each output:
/// sequence length 3, batch 2, input 3, hidden 2. Each case is checked twice: with f32 kernels
/// ([`check`], [`TOL`]) and with the graphs made f64 ([`check_f64`], [`TOL_F64`]).
#[test]
fn recurrent() {
    let mut s = Suite::new("recurrent");
    let (t, b, i, h) = (3, 2, 3, 2);
    let x = ("X", vec![t, b, i]);
    let cases: Vec<(&str, Rec)> = {
        let ops = |op: &'static str, g: usize, d: usize, state: bool, peep: bool| {
            let mut v = vec![x.clone(), ("W", vec![d, g * h, i]), ("R", vec![d, g * h, h]), ("B", vec![d, 2 * g * h])];
            if state {
                v.push(("", vec![]));
                v.push(("initial_h", vec![d, b, h]));
                if op == "LSTM" {
                    v.push(("initial_c", vec![d, b, h]));
                    if peep {
                        v.push(("P", vec![d, 3 * h]));
                    }
                }
            }
            v
        };
        let rec =
            |op, direction, operands, ints: Vec<(&'static str, i64)>, out| Rec { op, direction, operands, ints, out };
        vec![
            ("rnn_bidirectional_y", rec("RNN", "bidirectional", ops("RNN", 1, 2, true, false), vec![], "Y")),
            ("rnn_reverse_no_state_y_h", rec("RNN", "reverse", ops("RNN", 1, 1, false, false), vec![], "Y_h")),
            ("gru_forward_y", rec("GRU", "forward", ops("GRU", 3, 1, true, false), vec![], "Y")),
            (
                "gru_bidirectional_linear_before_reset_y",
                rec("GRU", "bidirectional", ops("GRU", 3, 2, true, false), vec![("linear_before_reset", 1)], "Y"),
            ),
            (
                "gru_reverse_linear_before_reset_no_state_y_h",
                rec("GRU", "reverse", ops("GRU", 3, 1, false, false), vec![("linear_before_reset", 1)], "Y_h"),
            ),
            (
                "lstm_bidirectional_peepholes_y",
                rec("LSTM", "bidirectional", ops("LSTM", 4, 2, true, true), vec![], "Y"),
            ),
            ("lstm_forward_y_c", rec("LSTM", "forward", ops("LSTM", 4, 1, true, false), vec![], "Y_c")),
            (
                "lstm_reverse_input_forget_peepholes_y_h",
                rec("LSTM", "reverse", ops("LSTM", 4, 1, true, true), vec![("input_forget", 1)], "Y_h"),
            ),
        ]
    };
    for (name, r) in &cases {
        // f32 kernels with the module's tolerance, then f64 kernels with TOL_F64.
        for f64 in [false, true] {
            s.case_in(name, f64, |c| {
                let bytes = rec_model(r, &mut c.rng);
                let opts = tracer::ImportOptions { load_weights: true, ..Default::default() };
                let g = tracer::import_bytes(&bytes, name, name, None, &opts).context("import")?;
                for (p, _) in r.operands.iter().filter(|(p, _)| !p.is_empty()) {
                    ensure!(g.param_data.contains_key(*p), "operand {p} is not a parameter of the imported graph");
                }
                let (_, y) = g.outputs.iter().find(|(o, _)| o == r.out).context("no output")?.clone();
                c.g = g;
                c.g.outputs.clear();
                Ok(y)
            });
        }
    }
    s.finish();
}

// ---------------------------------------------------------------------------------------------
// Fused attention.

/// `Attention` (flash attention's forward and its recomputing gradient `AttentionGrad`): plain,
/// causal with grouped-query heads, a boolean and an additive mask, softcap, a key length other
/// than the query length, and the same in f64 with its tight tolerance. The mask is a constant
/// (it has no gradient); every attended row keeps at least one key.
#[test]
fn attention() {
    use ir::AttentionAttrs;
    let mut s = Suite::new("attention");
    let plain = AttentionAttrs { scale: 0.35, causal: false, offset: 0, softcap: 0.0 };
    type AttnCase<'a> = (&'a str, AttentionAttrs, [usize; 4], [usize; 4], Option<&'a str>);
    let cases: [AttnCase; 6] = [
        ("plain", plain, [2, 2, 3, 4], [2, 2, 3, 4], None),
        ("causal_gqa", AttentionAttrs { causal: true, ..plain }, [1, 4, 4, 3], [1, 2, 4, 3], None),
        ("longer_keys", plain, [1, 2, 2, 3], [1, 2, 5, 3], None),
        ("bool_mask", plain, [1, 2, 3, 4], [1, 1, 4, 4], Some("bool")),
        ("additive_mask", plain, [2, 2, 3, 2], [2, 2, 3, 2], Some("float")),
        ("softcap", AttentionAttrs { softcap: 1.5, ..plain }, [1, 2, 3, 4], [1, 2, 3, 4], None),
    ];
    for f64 in [false, true] {
        for (name, attrs, qs, ks, mask) in cases {
            s.case_in(name, f64, |c| {
                let q = c.param("q", &qs, SMOOTH);
                let k = c.param("k", &ks, SMOOTH);
                let v = c.param("v", &ks, SMOOTH);
                let mut ins = vec![q, k, v];
                let (sq, t) = (qs[2], ks[2]);
                match mask {
                    Some("bool") => {
                        // Key 0 always attended, the rest drawn.
                        let n = sq * t;
                        let drawn: Vec<bool> = (0..n).map(|i| i % t == 0 || c.rng.below(2) == 1).collect();
                        ins.push(c.constant("mask", Tensor::bool([sq, t], drawn)));
                    }
                    Some(_) => {
                        let n = sq * t;
                        let vals = init_values(&mut c.rng, n, Init::U(-1.0, 1.0));
                        ins.push(c.constant("mask", Tensor::f32([sq, t], vals)));
                    }
                    None => {}
                }
                c.op(Op::Attention(attrs), &ins)
            });
        }
    }
    s.finish();
}

// ---------------------------------------------------------------------------------------------
// Routed experts.

/// `Moe` (routed experts, dropless) and its recomputing gradient `MoeGrad`: both activations,
/// top-k 1 and 2, the chosen weights renormalised or not, x of rank 2 and 3, and the auxiliary
/// load-balancing loss added to y (`y + aux`, so its gradient reaches the router too), in f32
/// (TOL) and in f64 (TOL_F64). Gradients are checked for x, the router and every expert weight.
/// Top-k is piecewise constant: the seeds give routings whose k-th and (k+1)-th probabilities
/// stay far enough apart that no perturbation (1e-3 in f32, 1e-5 in f64) swaps them.
#[test]
fn moe() {
    use ir::{MoeAct, MoeAttrs};
    let mut s = Suite::new("moe");
    let attrs = |act, top_k, normalize| MoeAttrs { experts: 4, top_k, normalize, act };
    type MoeCase<'a> = (&'a str, MoeAttrs, &'a [usize], bool);
    let cases: [MoeCase; 7] = [
        ("swiglu_top2_norm", attrs(MoeAct::Swiglu, 2, true), &[5, 4], false),
        ("swiglu_top2_plain", attrs(MoeAct::Swiglu, 2, false), &[5, 4], false),
        ("swiglu_top1", attrs(MoeAct::Swiglu, 1, false), &[2, 3, 4], false),
        ("gelu_top2_norm", attrs(MoeAct::Gelu, 2, true), &[5, 4], false),
        ("gelu_top1_norm", attrs(MoeAct::Gelu, 1, true), &[5, 4], false),
        ("swiglu_top2_aux", attrs(MoeAct::Swiglu, 2, true), &[2, 3, 4], true),
        ("gelu_top1_aux", attrs(MoeAct::Gelu, 1, false), &[6, 4], true),
    ];
    for f64 in [false, true] {
        for (name, a, xs, with_aux) in cases {
            s.case_in(name, f64, |c| {
                let (h, e, f) = (xs[xs.len() - 1], a.experts, 3);
                let x = c.param("x", xs, SMOOTH);
                let wr = c.param("router", &[h, e], SMOOTH);
                let w1 = c.param("w1", &[e, h, f], SMOOTH);
                let mut ins = vec![x, wr, w1];
                if a.act == MoeAct::Swiglu {
                    ins.push(c.param("w3", &[e, h, f], SMOOTH));
                }
                ins.push(c.param("w2", &[e, f, h], SMOOTH));
                let outs = c.ops(Op::Moe(a), &ins)?;
                if with_aux { c.op(Op::Binary(BinaryOp::Add), &[outs[0], outs[1]]) } else { Ok(outs[0]) }
            });
        }
    }
    s.finish();
}
