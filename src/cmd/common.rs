//! Helpers shared by subcommands: model loading, `--input` and `--feed` parsing.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use ir::autodiff::{LossSpec, LrDecay, LrSchedule, Optimizer, TrainOptions};

/// Parses `NAME=DIMS` bindings into the importer's options, with the ceiling on constants
/// computed at import (`--max-constant-bytes`).
pub fn import_options(
    inputs: &[String],
    load_weights: bool,
    max_constant_bytes: usize,
) -> Result<tracer::ImportOptions> {
    let mut opts = tracer::ImportOptions { load_weights, max_constant_bytes, ..Default::default() };
    for s in inputs {
        let (name, dims) = tracer::parse_input_binding(s).map_err(anyhow::Error::msg)?;
        // The element count must fit with room for 8-byte elements: larger counts wrap in the
        // size arithmetic downstream.
        let elements = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d as u64));
        if elements.is_none_or(|n| n > MAX_BYTES / 8) {
            bail!("--input {s}: more than 2^57 elements");
        }
        opts.input_shapes.insert(name, dims);
    }
    Ok(opts)
}

/// Imports a model, with the file named in any error.
pub fn load_model(path: &Path, opts: &tracer::ImportOptions) -> Result<ir::Graph> {
    Ok(load_model_noted(path, opts)?.0)
}

/// [`load_model`], with the initializers the import held as constants.
pub fn load_model_noted(path: &Path, opts: &tracer::ImportOptions) -> Result<(ir::Graph, tracer::ImportNotes)> {
    if !path.exists() {
        bail!("model file {} does not exist", path.display());
    }
    let (mut g, notes) =
        tracer::import_file_noted(path, opts).with_context(|| format!("importing {}", path.display()))?;
    ir::passes::canonicalize(&mut g)?;
    Ok((g, notes))
}

/// The lines saying which initializers are read and never trained (issue 50): the running
/// statistics of inference-form BatchNormalization (parameters of the graph, held), and the
/// exporter's numbers the import read as constants. Each line starts with `what`.
pub fn held_lines(statistics: &[String], constants: &[String]) -> Vec<String> {
    let list = |v: &[String]| {
        let shown: Vec<&str> = v.iter().take(6).map(String::as_str).collect();
        format!(
            "{}{}",
            shown.join(", "),
            if v.len() > 6 { format!(", ... ({} more)", v.len() - 6) } else { String::new() }
        )
    };
    let mut out = vec![];
    if !statistics.is_empty() {
        out.push(format!(
            "{} initializer(s) held as running statistics (BatchNormalization mean and variance: read, never trained, \
             as PyTorch's buffers): {}",
            statistics.len(),
            list(statistics)
        ));
    }
    if !constants.is_empty() {
        out.push(format!(
            "{} initializer(s) held as constants (one element and no state-dict name: an exporter's numbers, not \
             weights): {}",
            constants.len(),
            list(constants)
        ));
    }
    out
}

/// Prints `g` on stdout in the IR text form (or, with `json`, its JSON form) as it is written: a
/// graph holding gigabytes of constants is never held as text in memory.
pub fn print_graph(g: &ir::Graph, json: bool) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    if json {
        serde_json::to_writer(&mut out, g).context("writing the graph")?;
        writeln!(out).context("writing the graph")?;
    } else {
        g.write_text_to(&mut out).context("writing the graph")?;
    }
    out.flush().context("writing the graph")
}

/// Warns (once, on stderr) about parameters read in the same role by several nodes, which an
/// eval-mode export's merging of equal initializers leaves (issue 16 item 6): training such a
/// file silently differs from training the PyTorch module. `inspect` lists them on stdout.
pub fn warn_shared_parameters(g: &ir::Graph) {
    let shared = tracer::shared_parameters(g);
    if let Some(first) = shared.first() {
        eprintln!(
            "warning: {} parameter(s) are shared by nodes in the same role, e.g. {first} (`autopar inspect` lists \
             them); {}",
            shared.len(),
            tracer::TIED_ADVICE
        );
    }
}

/// The largest plan.json read (a plan for a 48-layer GPT is a few megabytes).
const MAX_PLAN_BYTES: u64 = 1 << 30;

/// Reads and validates a plan file (a regular file of at most [`MAX_PLAN_BYTES`]).
pub fn read_plan(path: &Path) -> Result<codegen::Plan> {
    Ok(read_valid_plan(path)?.into_plan())
}

/// Reads and validates a plan file, keeping what validation parsed (for the runtime).
pub fn read_valid_plan(path: &Path) -> Result<plan::Valid> {
    let text = ir::files::read_regular_to_string(path, MAX_PLAN_BYTES)
        .with_context(|| format!("reading {}", path.display()))?;
    plan::Valid::from_json(&text).with_context(|| path.display().to_string())
}

/// The hash a plan records of its model ([`codegen::ModelInfo::file_hash`]): the model file, then
/// the external data files it reads parameters from.
pub fn model_hash(model: &Path, index: &tracer::InitializerIndex) -> Result<String> {
    let files = std::iter::once(model).chain(index.external_files());
    codegen::ModelInfo::file_hash(files).with_context(|| format!("hashing {}", model.display()))
}

/// Opens an ONNX file's initializers as the runtime's model parameters (`run --init model`).
pub fn open_onnx_params(path: &Path) -> std::result::Result<Box<dyn ir::params::ModelParams>, String> {
    Ok(Box::new(tracer::InitializerIndex::open(path).map_err(|e| e.to_string())?))
}

/// Parses `NAME=FILE.npy` feeds and reads them.
pub fn read_feeds(feeds: &[String]) -> Result<BTreeMap<String, ir::Tensor>> {
    let mut out = BTreeMap::new();
    for s in feeds {
        let Some((name, file)) = s.split_once('=') else {
            bail!("--feed `{s}` is not NAME=FILE.npy");
        };
        let t = runtime::npy::read_npy(&PathBuf::from(file)).with_context(|| format!("--feed {name}"))?;
        if out.insert(name.to_string(), t).is_some() {
            bail!("--feed {name} is given twice");
        }
    }
    Ok(out)
}

/// Optimizer names for `--optimizer`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptimizerKind {
    /// Stochastic gradient descent (torch.optim.SGD).
    Sgd,
    /// Adam with decoupled weight decay (torch.optim.AdamW).
    Adamw,
}

/// The optimizer flags shared by `train`, `strategies` and planning.
#[derive(clap::Args, Debug)]
pub struct OptimizerArgs {
    /// The optimizer.
    #[arg(long, value_enum, default_value = "adamw")]
    pub optimizer: OptimizerKind,
    /// Learning rate, > 0 (default: 1e-3 for AdamW, 0.01 for SGD).
    #[arg(long, value_parser = parse_lr)]
    pub lr: Option<f32>,
    /// SGD momentum, from 0 to 1.
    #[arg(long, default_value = "0", value_parser = parse_momentum)]
    pub momentum: f32,
    /// Weight decay, >= 0 (default: 0.01 for AdamW, decoupled; 0 for SGD, added to the gradient).
    #[arg(long, value_parser = parse_weight_decay)]
    pub weight_decay: Option<f32>,
    /// AdamW betas as `B1,B2`, each in [0, 1).
    #[arg(long, default_value = "0.9,0.999", value_name = "B1,B2", value_parser = parse_betas)]
    pub betas: Betas,
    /// AdamW epsilon, > 0.
    #[arg(long, default_value = "1e-8", value_parser = parse_eps)]
    pub eps: f32,
    /// Learning-rate schedule after the warmup: `constant`; `cosine` (decay over --decay-steps
    /// to --min-lr, then held there: torch's CosineAnnealingLR); `step` (times --gamma every
    /// --step-size steps: StepLR). Computed in the training graph from the optimizer's step
    /// count, so checkpoints resume it; `--json` lines show each step's `lr`.
    #[arg(long, value_enum, default_value = "constant", value_name = "KIND")]
    pub lr_schedule: LrScheduleKind,
    /// Linear warmup: the lr of step k (from 0) is lr * (k+1)/W for the first W steps, then the
    /// schedule starts (`LambdaLR(lambda k: min(1, (k+1)/W))`, then SequentialLR).
    #[arg(long, value_name = "W", default_value = "0", value_parser = parse_schedule_steps)]
    pub warmup_steps: u64,
    /// With --lr-schedule cosine: steps from lr down to --min-lr (after the warmup).
    #[arg(long, value_name = "T", value_parser = parse_steps)]
    pub decay_steps: Option<u64>,
    /// With --lr-schedule cosine: the floor of the learning rate, from 0 to --lr (default 0).
    #[arg(long, value_name = "LR", value_parser = parse_min_lr)]
    pub min_lr: Option<f32>,
    /// With --lr-schedule step: steps between two decays.
    #[arg(long, value_name = "S", value_parser = parse_steps)]
    pub step_size: Option<u64>,
    /// With --lr-schedule step: the factor of each decay, > 0 (default 0.1).
    #[arg(long, value_name = "G", value_parser = parse_gamma)]
    pub gamma: Option<f32>,
    /// Clip the gradients to this global L2 norm before each update
    /// (`torch.nn.utils.clip_grad_norm_`; after fp16's unscaling); `--json` lines show each
    /// step's `grad_norm` (before clipping).
    #[arg(long, value_name = "MAX", value_parser = parse_clip)]
    pub clip_grad_norm: Option<f32>,
}

/// `--lr-schedule`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum LrScheduleKind {
    /// The learning rate of --lr at every step (after any warmup).
    #[default]
    Constant,
    /// Cosine decay to --min-lr over --decay-steps.
    Cosine,
    /// Times --gamma every --step-size steps.
    Step,
}

impl OptimizerArgs {
    /// The optimizer these flags describe.
    pub fn optimizer(&self) -> Result<Optimizer> {
        let a = self;
        Ok(match a.optimizer {
            OptimizerKind::Sgd => Optimizer::Sgd {
                lr: a.lr.unwrap_or(0.01),
                momentum: a.momentum,
                weight_decay: a.weight_decay.unwrap_or(0.0),
            },
            OptimizerKind::Adamw => {
                let Betas(beta1, beta2) = a.betas;
                if a.momentum != 0.0 {
                    bail!("--momentum applies to --optimizer sgd only");
                }
                Optimizer::AdamW {
                    lr: a.lr.unwrap_or(1e-3),
                    beta1,
                    beta2,
                    epsilon: a.eps,
                    weight_decay: a.weight_decay.unwrap_or(0.01),
                }
            }
        })
    }

    /// The learning-rate schedule these flags describe (a flag of another schedule is an error).
    pub fn schedule(&self) -> Result<LrSchedule> {
        use clap::ValueEnum;
        let a = self;
        let name = |k: LrScheduleKind| k.to_possible_value().map(|v| v.get_name().to_string()).unwrap_or_default();
        let (cosine, step) = (LrScheduleKind::Cosine, LrScheduleKind::Step);
        for (flag, given, kind) in [
            ("--decay-steps", a.decay_steps.is_some(), cosine),
            ("--min-lr", a.min_lr.is_some(), cosine),
            ("--step-size", a.step_size.is_some(), step),
            ("--gamma", a.gamma.is_some(), step),
        ] {
            if given && a.lr_schedule != kind {
                bail!("{flag} applies to --lr-schedule {}, not {}", name(kind), name(a.lr_schedule));
            }
        }
        let decay = match a.lr_schedule {
            LrScheduleKind::Constant => LrDecay::Constant,
            LrScheduleKind::Cosine => {
                let Some(steps) = a.decay_steps else { bail!("--lr-schedule cosine needs --decay-steps T") };
                let min_lr = a.min_lr.unwrap_or(0.0);
                let lr = self.optimizer()?.lr();
                if min_lr > lr {
                    bail!("--min-lr {min_lr} is above --lr {lr}: the cosine decays from --lr down to --min-lr");
                }
                LrDecay::Cosine { steps, min_lr }
            }
            LrScheduleKind::Step => {
                let Some(step_size) = a.step_size else { bail!("--lr-schedule step needs --step-size S") };
                LrDecay::Step { step_size, gamma: a.gamma.unwrap_or(0.1) }
            }
        };
        Ok(LrSchedule { warmup_steps: a.warmup_steps, decay })
    }

    /// The training options of `loss` with these flags' optimizer, schedule and clipping.
    pub fn train_options(&self, loss: LossSpec, frozen: Vec<String>) -> Result<TrainOptions> {
        Ok(TrainOptions {
            frozen,
            schedule: self.schedule()?,
            clip_grad_norm: self.clip_grad_norm,
            ..TrainOptions::new(loss, Some(self.optimizer()?))
        })
    }
}

/// `--precision`: the float type training computes in.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Precision {
    /// f32 everywhere (the model's own type).
    #[default]
    F32,
    /// Every float tensor (parameters, activations, gradients, optimizer state, collectives) in
    /// f64, on CPU ranks only: about twice the time and memory. For checking a plan against
    /// single-device training on models whose f32 results depend on summation order.
    F64,
    /// Mixed precision in bfloat16: forward and backward compute and activations in bf16 where
    /// PyTorch's autocast would (matrix products, convolutions, and the elementwise ops after
    /// them), normalisations, softmax, exponentials and the loss in f32; parameters, their
    /// gradients (see --grad-reduce) and the optimizer state in f32.
    Bf16,
    /// Mixed precision in IEEE half (f16), as bf16, with dynamic loss scaling.
    #[value(alias = "f16")]
    Fp16,
}

impl Precision {
    /// The float type of the whole step: f64 for `f64`, else f32 (mixed precision keeps f32
    /// parameters; its 16-bit values are in the graph, see [`Precision::mixed`]).
    pub fn dtype(self) -> ir::DType {
        match self {
            Precision::F64 => ir::DType::F64,
            _ => ir::DType::F32,
        }
    }
    /// The 16-bit type of a mixed-precision step.
    pub fn low(self) -> Option<ir::DType> {
        match self {
            Precision::Bf16 => Some(ir::DType::BF16),
            Precision::Fp16 => Some(ir::DType::F16),
            _ => None,
        }
    }
    /// The mixed-precision options of the training graph, with gradients kept as `grads` says.
    pub fn mixed(self, grads: GradReduce) -> Option<ir::autodiff::MixedPrecision> {
        self.low().map(|low| ir::autodiff::MixedPrecision {
            low,
            grads: match grads {
                GradReduce::Low => low,
                GradReduce::F32 => ir::DType::F32,
            },
            loss_scaling: low == ir::DType::F16,
        })
    }
    /// The plan format's precision of the same name (a plan records it typed).
    pub fn plan(self) -> plan::Precision {
        match self {
            Precision::F32 => plan::Precision::F32,
            Precision::F64 => plan::Precision::F64,
            Precision::Bf16 => plan::Precision::Bf16,
            Precision::Fp16 => plan::Precision::Fp16,
        }
    }
    /// The name written in plans and reports.
    pub fn name(self) -> &'static str {
        self.plan().name()
    }
}

/// `--grad-reduce`: the type parameter gradients of a mixed-precision step are kept in.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum GradReduce {
    /// f32: each gradient is cast to f32 where the backward computes it (as PyTorch autocast
    /// does: parameters are f32, so are their gradients), summed over microbatches in f32.
    #[default]
    F32,
    /// The 16-bit type (`bf16`/`fp16`): gradients stay 16-bit up to the optimizer, which
    /// reads them widened (half the bytes held and reduced).
    #[value(name = "low", alias = "bf16", alias = "fp16", alias = "f16")]
    Low,
}

/// `--accumulate`: how matrix products accumulate.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum AccumulateKind {
    /// f32 with fused multiply-adds (fast; the usual BLAS behaviour).
    #[default]
    F32,
    /// f64, rounded to f32 once: about twice the time in matrix products, results independent of
    /// summation order at the f32 level.
    F64,
}

impl AccumulateKind {
    /// The kernels' accumulation mode.
    pub fn mode(self) -> runtime::Accumulation {
        match self {
            AccumulateKind::F32 => runtime::Accumulation::F32,
            AccumulateKind::F64 => runtime::Accumulation::F64,
        }
    }
}

// Flag values. Every number a flag takes is checked by one of these clap `value_parser`s, so a
// bad value fails before any work with one line naming the flag and the accepted range, instead
// of panicking later (a `Duration` out of range, a thread pool that cannot start), wrapping, or
// being silently ignored (a NaN learning rate trains to NaN with exit 0).

/// Longest duration a flag accepts, in seconds (a year): far above any real limit, far below
/// what `Duration` and `Instant + Duration` overflow at.
pub const MAX_SECONDS: f64 = 365.0 * 24.0 * 3600.0;
/// Shortest duration a flag accepts, in seconds: below it a limit is no limit but an error.
pub const MIN_SECONDS: f64 = 1e-3;
/// Most threads a flag accepts (per pool): thread counts beyond it only fail to start.
pub const MAX_THREADS: usize = 1024;
/// Most steps a run or training accepts (and the largest checkpoint interval).
pub const MAX_STEPS: u64 = 1_000_000_000;
/// Most ranks a mesh may have (planning at scale; a million devices).
pub const MAX_RANKS: usize = 1 << 20;
/// Largest memory size a flag accepts (1 EiB): sums of a few stay far from `u64` overflow.
pub const MAX_BYTES: u64 = 1 << 60;

/// A number of seconds in [[`MIN_SECONDS`], [`MAX_SECONDS`]] (`--time-limit`, `--timeout`).
pub fn parse_seconds(s: &str) -> Result<std::time::Duration, String> {
    let v: f64 = s.trim().parse().map_err(|_| "not a number of seconds".to_string())?;
    if !(MIN_SECONDS..=MAX_SECONDS).contains(&v) {
        return Err(format!("out of range (from {MIN_SECONDS} to {MAX_SECONDS} seconds, a year)"));
    }
    std::time::Duration::try_from_secs_f64(v).map_err(|e| e.to_string())
}

/// A thread count in 1..=[`MAX_THREADS`].
pub fn parse_threads(s: &str) -> Result<usize, String> {
    parse_int_in(s, 1, MAX_THREADS as u64).map(|v| v as usize)
}

/// A step count (or interval) in 1..=[`MAX_STEPS`].
pub fn parse_steps(s: &str) -> Result<u64, String> {
    parse_int_in(s, 1, MAX_STEPS)
}

/// An integer in `lo..=hi`.
pub fn parse_int_in(s: &str, lo: u64, hi: u64) -> Result<u64, String> {
    let v: u64 = s.trim().parse().map_err(|_| format!("not a whole number from {lo} to {hi}"))?;
    if !(lo..=hi).contains(&v) {
        return Err(format!("out of range (from {lo} to {hi})"));
    }
    Ok(v)
}

/// A finite float.
fn parse_finite(s: &str) -> Result<f64, String> {
    let v: f64 = s.trim().parse().map_err(|_| "not a number".to_string())?;
    if !v.is_finite() {
        return Err("not a finite number".to_string());
    }
    Ok(v)
}

/// An f32 flag value: finite as an f32 too (`1e39` is finite as f64 only).
fn to_f32(v: f64) -> Result<f32, String> {
    let x = v as f32;
    if !x.is_finite() {
        return Err("too large for a 32-bit float".to_string());
    }
    Ok(x)
}

/// A learning rate: finite and > 0.
pub fn parse_lr(s: &str) -> Result<f32, String> {
    let v = parse_finite(s)?;
    let x = to_f32(v)?;
    if x <= 0.0 {
        return Err("a learning rate must be > 0".to_string());
    }
    Ok(x)
}

/// A schedule's step count (warmup): 0 to [`MAX_STEPS`].
pub fn parse_schedule_steps(s: &str) -> Result<u64, String> {
    parse_int_in(s, 0, MAX_STEPS)
}

/// A learning-rate floor: finite and >= 0.
pub fn parse_min_lr(s: &str) -> Result<f32, String> {
    let v = parse_finite(s)?;
    if v < 0.0 {
        return Err("a learning rate floor must be >= 0".to_string());
    }
    to_f32(v)
}

/// A step decay's factor: finite and > 0.
pub fn parse_gamma(s: &str) -> Result<f32, String> {
    let x = to_f32(parse_finite(s)?)?;
    if x <= 0.0 {
        return Err("gamma must be > 0".to_string());
    }
    Ok(x)
}

/// A gradient norm to clip to: finite and > 0.
pub fn parse_clip(s: &str) -> Result<f32, String> {
    let x = to_f32(parse_finite(s)?)?;
    if x <= 0.0 {
        return Err("the norm to clip to must be > 0".to_string());
    }
    Ok(x)
}

/// SGD momentum: finite, in [0, 1].
pub fn parse_momentum(s: &str) -> Result<f32, String> {
    let v = parse_finite(s)?;
    if !(0.0..=1.0).contains(&v) {
        return Err("momentum must be from 0 to 1".to_string());
    }
    to_f32(v)
}

/// Weight decay: finite and >= 0.
pub fn parse_weight_decay(s: &str) -> Result<f32, String> {
    let v = parse_finite(s)?;
    if v < 0.0 {
        return Err("weight decay must be >= 0".to_string());
    }
    to_f32(v)
}

/// AdamW epsilon: finite and > 0 (as an f32: `1e-50` would round to 0).
pub fn parse_eps(s: &str) -> Result<f32, String> {
    let x = to_f32(parse_finite(s)?)?;
    if x <= 0.0 {
        return Err("epsilon must be > 0 (and representable as a 32-bit float)".to_string());
    }
    Ok(x)
}

/// AdamW betas `B1,B2`, each in [0, 1).
pub fn parse_betas(s: &str) -> Result<Betas, String> {
    let usage = || "not two numbers like 0.9,0.999".to_string();
    let v: Vec<f64> = s.split(',').map(|x| x.trim().parse::<f64>()).collect::<Result<_, _>>().map_err(|_| usage())?;
    let [b1, b2] = v[..] else { return Err(usage()) };
    // Checked as f32, the type they train in: 0.99999999 rounds to 1.
    let (b1, b2) = (b1 as f32, b2 as f32);
    if ![b1, b2].iter().all(|b| (0.0..1.0).contains(b)) {
        return Err("each beta must be in [0, 1) (as a 32-bit float)".to_string());
    }
    Ok(Betas(b1, b2))
}

/// AdamW's two decay rates, as `--betas` gives them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Betas(pub f32, pub f32);

/// A tolerance: finite and >= 0.
pub fn parse_tolerance(s: &str) -> Result<f64, String> {
    let v = parse_finite(s)?;
    if v < 0.0 {
        return Err("a tolerance must be >= 0".to_string());
    }
    Ok(v)
}

/// A memory size like `16GiB`, `512MiB` or `80GB`, from 1 byte to [`MAX_BYTES`].
pub fn parse_memory(s: &str) -> Result<u64, String> {
    let b = codegen::parse_bytes(s).ok_or_else(|| "not a size like 16GiB, 512MiB or 80GB".to_string())?;
    if b == 0 {
        return Err("zero bytes: no memory at all".to_string());
    }
    if b > MAX_BYTES {
        return Err("more than the largest size accepted (1 EiB)".to_string());
    }
    Ok(b)
}

/// A mesh spec (`2x4` or `data=2,tensor=4`) with at most [`MAX_RANKS`] ranks; the rest of its
/// grammar (names, sizes >= 1, axes) is `sharding::DeviceMesh::parse`'s, which sees the text.
pub fn parse_mesh(s: &str) -> Result<String, String> {
    let t = s.trim();
    let sizes: Vec<&str> = if t.contains('=') {
        t.split(',').filter_map(|p| p.split_once('=').map(|(_, v)| v.split(':').next().unwrap_or(v))).collect()
    } else {
        t.split(['x', 'X']).collect()
    };
    let mut ranks: u64 = 1;
    for v in sizes {
        // Malformed sizes are left to the mesh parser, which names the bad part.
        let Ok(n) = v.trim().parse::<u64>() else { continue };
        ranks = ranks.saturating_mul(n);
    }
    if ranks > MAX_RANKS as u64 {
        return Err(format!("more than {MAX_RANKS} ranks"));
    }
    Ok(s.to_string())
}

/// Tensor dims `8x16x32` whose element count times `elem_bytes` fits in [`MAX_BYTES`].
pub fn parse_dims(s: &str, elem_bytes: usize) -> Result<Vec<usize>, String> {
    let dims: Vec<usize> = s
        .split(['x', 'X'])
        .map(|d| d.trim().parse::<usize>())
        .collect::<Result<_, _>>()
        .map_err(|_| format!("`{s}` is not sizes like 8x16x32"))?;
    let bytes = dims.iter().try_fold(elem_bytes as u64, |acc, &d| acc.checked_mul(d as u64));
    if bytes.is_none_or(|b| b > MAX_BYTES) {
        return Err(format!("{s}: the tensor would exceed 1 EiB"));
    }
    Ok(dims)
}

/// A number of ranks in 1..=[`MAX_RANKS`].
pub fn parse_ranks(s: &str) -> Result<usize, String> {
    parse_int_in(s, 1, MAX_RANKS as u64).map(|n| n as usize)
}

/// The mesh of `--mesh` with links from `profile`, or from `--mesh-profile` when given (which
/// replaces every axis's link, so links written in `--mesh` are refused beside it).
pub fn mesh(text: &str, profile: &sharding::DeviceProfile, mesh_profile: Option<&str>) -> Result<sharding::DeviceMesh> {
    let mut mesh = sharding::DeviceMesh::parse(text, profile)?;
    if let Some(f) = mesh_profile {
        if text.contains(':') {
            bail!("--mesh {text} states links and --mesh-profile {f} replaces every axis's link: give one of them");
        }
        mesh.apply_profile(&sharding::MeshProfile::load(f)?)?;
    }
    Ok(mesh)
}

/// Refuses parameters holding NaN or infinite values (a diverged run's), naming the first.
pub fn check_finite_params(params: &BTreeMap<String, ir::Tensor>) -> Result<()> {
    for (name, t) in params {
        let bad = t.to_f64_vec().iter().filter(|x| !x.is_finite()).count();
        if bad > 0 {
            bail!(
                "parameter {name} holds {bad} NaN or infinite value(s) of {}: the run diverged, and its parameters are \
                 not saved (try a smaller --lr, or check the input data)",
                t.numel()
            );
        }
    }
    Ok(())
}

/// Writes `model` with its initializers replaced by `params` to `out` (`--export-onnx`): the
/// trained weights in the exporter's own graph, for any ONNX runtime.
pub fn export_onnx(model: &Path, out: &Path, params: &BTreeMap<String, ir::Tensor>) -> Result<()> {
    let bytes = ir::files::read_regular(model, tracer::MAX_MODEL_BYTES)
        .with_context(|| format!("--export-onnx: reading {}", model.display()))?;
    let new = tracer::export::with_initializers(&bytes, &model.display().to_string(), params)
        .with_context(|| format!("--export-onnx {}", out.display()))?;
    std::fs::write(out, new).with_context(|| format!("--export-onnx {}", out.display()))?;
    Ok(())
}

/// Writes `DIR/names.json`: for each parameter in `params` (by ONNX initializer name, as
/// `model.safetensors` keys them), the PyTorch state-dict names the model file keeps for it
/// ([`tracer::export::torch_names`]), and the parameters it names none for. Returns how many
/// parameters have a name.
pub fn write_torch_names(model: &Path, dir: &Path, params: &BTreeMap<String, ir::Tensor>) -> Result<usize> {
    let bytes = ir::files::read_regular(model, tracer::MAX_MODEL_BYTES)
        .with_context(|| format!("reading {} for its PyTorch names", model.display()))?;
    let names = tracer::export::torch_names(&bytes, &model.display().to_string())?;
    let mut mapped = serde_json::Map::new();
    let mut unmapped = vec![];
    for p in params.keys() {
        match names.get(p) {
            Some(ns) => {
                let v: Vec<serde_json::Value> = ns
                    .iter()
                    .map(|n| serde_json::json!({"name": n.name, "transposed": n.transposed, "from": n.from}))
                    .collect();
                mapped.insert(p.clone(), v.into());
            }
            None => unmapped.push(p.clone()),
        }
    }
    let n = mapped.len();
    let doc = serde_json::json!({
        "format": "autopar-torch-names",
        "version": 1,
        "model": model.display().to_string(),
        "params": mapped,
        "unmapped": unmapped,
    });
    let file = dir.join("names.json");
    std::fs::write(&file, serde_json::to_string_pretty(&doc)? + "\n").with_context(|| file.display().to_string())?;
    Ok(n)
}

/// A progress bar over `steps` training steps with their ETA, on stderr when it is a terminal
/// (`None` otherwise, and with `--json`).
pub fn step_bar(steps: u64, json: bool) -> Option<indicatif::ProgressBar> {
    use std::io::IsTerminal;
    (!json && std::io::stderr().is_terminal()).then(|| {
        let b = indicatif::ProgressBar::new(steps);
        b.set_style(
            indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} steps  ETA {eta}  {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b
    })
}
