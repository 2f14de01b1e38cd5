//! Helpers shared by subcommands: model loading, `--input` and `--feed` parsing.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use ir::autodiff::Optimizer;

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
        opts.input_shapes.insert(name, dims);
    }
    Ok(opts)
}

/// Imports a model, with the file named in any error.
pub fn load_model(path: &Path, opts: &tracer::ImportOptions) -> Result<ir::Graph> {
    if !path.exists() {
        bail!("model file {} does not exist", path.display());
    }
    let mut g = tracer::import_file(path, opts).with_context(|| format!("importing {}", path.display()))?;
    ir::passes::canonicalize(&mut g)?;
    Ok(g)
}

/// The largest plan.json read (a plan for a 48-layer GPT is a few megabytes).
const MAX_PLAN_BYTES: u64 = 1 << 30;

/// Reads and validates a plan file (a regular file of at most [`MAX_PLAN_BYTES`]).
pub fn read_plan(path: &Path) -> Result<codegen::Plan> {
    let text = ir::files::read_regular_to_string(path, MAX_PLAN_BYTES)
        .with_context(|| format!("reading {}", path.display()))?;
    codegen::Plan::from_json(&text).with_context(|| path.display().to_string())
}

/// The hash a plan records of its model ([`codegen::ModelInfo::file_hash`]): the model file, then
/// the external data files it reads parameters from.
pub fn model_hash(model: &Path, index: &tracer::InitializerIndex) -> Result<String> {
    let files = std::iter::once(model).chain(index.external_files());
    codegen::ModelInfo::file_hash(files).with_context(|| format!("hashing {}", model.display()))
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
    /// Learning rate (default: 1e-3 for AdamW, 0.01 for SGD).
    #[arg(long)]
    pub lr: Option<f32>,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.0)]
    pub momentum: f32,
    /// Weight decay (default: 0.01 for AdamW, decoupled; 0 for SGD, added to the gradient).
    #[arg(long)]
    pub weight_decay: Option<f32>,
    /// AdamW betas as `B1,B2`.
    #[arg(long, default_value = "0.9,0.999", value_name = "B1,B2")]
    pub betas: String,
    /// AdamW epsilon.
    #[arg(long, default_value_t = 1e-8)]
    pub eps: f32,
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
                let betas: Vec<f32> = a
                    .betas
                    .split(',')
                    .map(|s| s.trim().parse::<f32>())
                    .collect::<Result<_, _>>()
                    .with_context(|| format!("--betas {}: expected two numbers like 0.9,0.999", a.betas))?;
                let [beta1, beta2] = betas[..] else {
                    bail!("--betas {}: expected two numbers like 0.9,0.999", a.betas)
                };
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
}

impl Precision {
    /// The float dtype.
    pub fn dtype(self) -> ir::DType {
        match self {
            Precision::F32 => ir::DType::F32,
            Precision::F64 => ir::DType::F64,
        }
    }
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
    pub fn mode(self) -> kernels::cpu::Accumulation {
        match self {
            AccumulateKind::F32 => kernels::cpu::Accumulation::F32,
            AccumulateKind::F64 => kernels::cpu::Accumulation::F64,
        }
    }
}
