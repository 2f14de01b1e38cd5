//! `autopar autoparallelize` (alias `plan`) and `autopar explain`.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use codegen::{Baseline, PlanOptions};
use ir::autodiff::LossSpec;
use sharding::DeviceProfile;

use super::common;

/// Arguments of `autopar autoparallelize`.
#[derive(clap::Args, Debug)]
pub struct PlanArgs {
    /// The ONNX model.
    pub model: PathBuf,
    /// Device mesh: `2x4` (axis 0 outermost, across machines) or `data=2,tensor=4`.
    ///
    /// Each axis's link comes from the device profile: within one machine when the axis and the
    /// axes inside it fit in one (NVLink on the GPU profiles), else across machines (InfiniBand).
    /// Named axes may state their own: `node=8:ib,gpu=8:nvlink` (intra/nvlink, inter/ib), or a
    /// bandwidth and latency for a third tier: `pod=4:25GB/s+30us,node=8,gpu=8`.
    #[arg(long, value_parser = common::parse_mesh)]
    pub mesh: String,
    /// Memory budget per device, e.g. `16GiB`, `512MiB`, `80GB`.
    #[arg(long, value_name = "SIZE", value_parser = common::parse_memory)]
    pub memory: u64,
    /// Device profile: cpu, a100-80g, h100-sxm, h200, or a JSON file (`autopar profile` writes one).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Measured alpha/beta per mesh axis (JSON `{"axes": [{"alpha": s, "beta": s_per_byte}, ...]}`).
    #[arg(long, value_name = "FILE")]
    pub mesh_profile: Option<String>,
    /// auto (the solver chooses; also compares the manual ones and keeps the best), or a manual
    /// baseline priced by the same model: dp, megatron, zero; or a manual layout with one role
    /// per mesh axis, outermost first: `dp` (batch split, parameters replicated), `zero` (batch
    /// split, parameters and optimizer state sharded), `tp` (tensor parallel: batch whole,
    /// parameters split as the solver finds cheapest), `sp` (sequence parallel: inputs split
    /// along the sequence, parameters replicated; attention by heads after an all-to-all or in
    /// query blocks against gathered keys), `pp` (the pipeline stages, outermost, with
    /// --pipeline). E.g. Megatron's TP 8, PP 2, DP 32 on 512 GPUs: `--mesh
    /// pipe=2,data=32,tensor=8 --pipeline 2 --strategy pp,dp,tp`.
    #[arg(long, value_name = "STRATEGY", default_value = "auto")]
    pub strategy: String,
    /// The loss (`mse:OUT:TARGET`, `ce:OUT:LABELS`, `ce-next:OUT:IDS`); default: ce-next on the
    /// first output with an `input_ids` input, else mse on the first output.
    #[arg(long, value_name = "SPEC")]
    pub loss: Option<String>,
    /// Optimizer settings.
    #[command(flatten)]
    pub opt: common::OptimizerArgs,
    /// Bind an input's shape, e.g. `input_ids=8x1024` (the global batch).
    #[arg(long = "input", value_name = "NAME=DIMS")]
    pub inputs: Vec<String>,
    /// Parameters not to train (repeatable; exact initializer names), as `train --freeze`: no
    /// gradient, no update, no optimizer state.
    #[arg(long = "freeze", value_name = "PARAM")]
    pub freeze: Vec<String>,
    /// Largest constant the importer may compute (folded shape arithmetic, ConstantOfShape,
    /// Range), in bytes; parameters and activations are shapes only and not bounded by it.
    #[arg(long, value_name = "BYTES", default_value_t = tracer::DEFAULT_MAX_CONSTANT_BYTES)]
    pub max_constant_bytes: usize,
    /// Time limit for planning after import, in seconds: building the training graph and the
    /// problem, every solve, every `--pipeline auto` candidate and every round count against
    /// it. The baselines compared with the auto plan get small shares of what is left and are
    /// skipped (the report names them) when their solves could not fit; stage counts share what
    /// is left equally, and one that cannot start is skipped and named. The best plan found is
    /// returned with its gap to a lower bound for the whole search. `plan.json` records where
    /// the time went (`solver.timings`).
    #[arg(long, value_name = "SECONDS", default_value = "2", value_parser = common::parse_seconds)]
    pub time_limit: Duration,
    /// With --strategy auto: keep the cheapest manual baseline (dp, megatron, zero) unless the
    /// solver's own plan is estimated at least this many percent of the step faster. The cost
    /// model is good to several percent (BENCHMARKS.md), so a smaller gain is not one to count
    /// on, and the baseline's layout is the familiar one. With --pipeline auto (any strategy),
    /// likewise the plan without stages is kept unless one with stages is this much faster.
    /// 0 keeps the cheapest plan.
    #[arg(long, value_name = "PERCENT", default_value = "1", value_parser = parse_percent)]
    pub min_gain: f64,
    /// Solver threads.
    #[arg(long, default_value = "1", value_parser = common::parse_threads)]
    pub threads: usize,
    /// Tie repeated layers: the same op of every transformer block shares one decision in the
    /// solver (the default).
    #[arg(long, overrides_with = "no_tie_layers")]
    pub tie_layers: bool,
    /// Activation recomputation during the backward: `auto` (searched with the layouts: each
    /// plan is also solved as if every layer were recomputed, so that layouts holding more
    /// activations but moving less data are priced with the recomputation that makes them fit;
    /// the cheapest wins and recomputes only what it needs), `fit` (only what makes the
    /// plan fit, after its layouts are chosen), `full` (every layer, as Megatron's
    /// `--recompute-granularity full`: the forward runs twice), or `off`.
    #[arg(long, value_name = "MODE", default_value = "auto", value_parser = parse_recompute)]
    pub recompute: codegen::Recompute,
    /// Never recompute activations (the same as --recompute off).
    #[arg(long)]
    pub no_checkpoint: bool,
    /// Solve every layer's ops separately (for comparison).
    #[arg(long)]
    pub no_tie_layers: bool,
    /// Which follow ops (elementwise, reshape, ...) join their producers' decisions: `proven`
    /// (where that provably keeps the optimum), `off`, or `cheapest` (all, each with its cheapest
    /// response, as Alpa does; smaller problems, worse plans). For comparison.
    #[arg(long, default_value = "proven", value_name = "MODE")]
    pub merge: String,
    /// Pipeline stages: cut the model into N stages over the outermost mesh axis (which must
    /// have N devices, e.g. `--mesh 2x4 --pipeline 2`: 2 stages of 4 devices). Each stage runs
    /// its part of forward and backward as an SPMD program over the other axes; values crossing
    /// stages are sent point to point. Layouts are solved on one stage's devices, then the
    /// stages cut by estimated time, and solved again with less room (recomputing activations
    /// during the backward where that helps) while a stage does not fit. The stages run the
    /// microbatches (--microbatches) in the order --schedule gives.
    /// `auto` searches the number of stages (every divisor of the outermost axis, that axis
    /// split into stages of sub-axes) and the schedule, keeping the fastest plan that fits.
    #[arg(long, value_name = "N|auto", default_value = "1", value_parser = parse_pipeline)]
    pub pipeline: Stages,
    /// The pipeline schedule: `1f1b` (one forward one backward: stage i runs S-1-i forwards
    /// ahead, then alternates; holds at most S-i microbatches), `gpipe` (all forwards, then all
    /// backwards), `interleaved` (1F1B over --chunks model chunks per stage; microbatches a
    /// multiple of the stages), `zb-h1` (zero bubble: weight gradients split from the backward
    /// fill the waits), or `sequential` (one microbatch at a time).
    #[arg(long, value_name = "KIND", default_value = "1f1b")]
    pub schedule: String,
    /// Model chunks per stage for `--schedule interleaved` (virtual stages).
    #[arg(long, value_name = "V", default_value_t = 2, value_parser = clap::value_parser!(u32).range(2..=64))]
    pub chunks: u32,
    /// Microbatches per step (gradient accumulation): the model's batch is one microbatch, a
    /// step trains on M of them (feeds hold M times the model's batch along their first dim),
    /// summing their gradients (each scaled by 1/M: the gradient of the mean loss) and updating
    /// once. With --pipeline, the stages overlap them as --schedule says. The gradient sums held
    /// across microbatches count against --memory.
    #[arg(long, value_name = "M", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub microbatches: u32,
    /// The float precision of the step: `f32`, or mixed precision `bf16` / `fp16` (16-bit
    /// activations and matrix products priced at the device's 16-bit rate, f32 parameters and
    /// optimizer state; see `train --help`). Default: bf16 on devices whose 16-bit rate is
    /// at least 1.5x their f32 one (the GPU profiles), f32 otherwise (cpu, measured profiles).
    #[arg(long, value_enum)]
    pub precision: Option<common::Precision>,
    /// With mixed precision: the type parameter gradients are kept, summed and reduced in
    /// (`f32`, or `low` for the 16-bit type).
    #[arg(long, value_enum, default_value = "f32")]
    pub grad_reduce: common::GradReduce,
    /// Seed of the dropout masks (training-mode Dropout), recorded in the plan: `autopar run`
    /// draws from it unless given its own --seed. Masks do not depend on the plan's layouts,
    /// stages or microbatches, so the run equals `autopar train --seed N`.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Whether the estimate overlaps communication with compute, as Megatron-LM and PyTorch
    /// DDP/FSDP do on GPUs: `on` puts data-parallel gradient reductions and the prologue's weight
    /// gathers on a second stream beside the backward and forward, and pipeline transfers beside
    /// the stages' work; tensor-parallel collectives stay on the critical path. `off` sums
    /// everything. Default: on for devices whose 16-bit rate is at least 1.5x their f32 one (the
    /// GPU profiles), off otherwise (cpu: the threads runtime runs collectives blocking). The
    /// program and what it computes do not change.
    #[arg(long, value_name = "on|off", value_parser = parse_on_off)]
    pub overlap: Option<bool>,
    /// Where to write the plan.
    #[arg(short = 'o', long, default_value = "plan.json")]
    pub out: PathBuf,
}

/// Arguments of `autopar explain`.
#[derive(clap::Args, Debug)]
pub struct ExplainArgs {
    /// A plan written by `autopar autoparallelize` (optional with --run).
    #[arg(required_unless_present = "run")]
    pub plan: Option<PathBuf>,
    /// A training run's `--json` log (`autopar run --json` or `autopar train --json` output):
    /// summarised, and with --html or --svg drawn as curves (loss and evaluation loss,
    /// learning rate, gradient norm, throughput).
    #[arg(long, value_name = "LOG.jsonl")]
    pub run: Option<PathBuf>,
    /// With --run: a dashed reference line on the loss chart, `VALUE[:LABEL]` (e.g. the
    /// data's unigram entropy, `3.318:unigram entropy`); repeatable.
    #[arg(long, value_name = "VALUE[:LABEL]", requires = "run", value_parser = super::run_log::parse_reference)]
    pub reference: Vec<(f64, String)>,
    /// Measurements of a run of the plan (`autopar run --profile-ops FILE`): each op family's
    /// and instruction's measured time beside its estimate, and (with --html) drawn in the
    /// memory and time-per-family figures.
    #[arg(long, value_name = "FILE", requires = "plan")]
    pub measured: Option<PathBuf>,
    /// With --run: write the loss chart alone as an SVG file.
    #[arg(long, value_name = "FILE", requires = "run")]
    pub svg: Option<PathBuf>,
    /// Also write the program as a Graphviz graph, coloured by layout.
    #[arg(long, value_name = "FILE")]
    pub dot: Option<PathBuf>,
    /// Also write a standalone HTML page: the summary, figures (SVG: memory over the step per
    /// rank, time per op family, the mesh with the layout of the largest parameters, the
    /// pipeline schedule as a timeline; with --measured, the measurements beside the
    /// estimates), parameter layouts and the program.
    #[arg(long, value_name = "FILE")]
    pub html: Option<PathBuf>,
}

fn default_loss(g: &ir::Graph) -> Result<LossSpec> {
    let Some((out, _)) = g.outputs.first() else { bail!("the model has no outputs") };
    let ids = g.inputs.iter().map(|&n| g.node(n).name.clone()).find(|n| n == "input_ids");
    Ok(match ids {
        Some(ids) => LossSpec::NextTokenCe { output: out.clone(), input_ids: ids },
        None => LossSpec::Mse { output: out.clone(), target: format!("{out}_target") },
    })
}

/// Runs `autopar autoparallelize`: plans, writes the plan to `--out` and prints its summary.
pub fn run(a: &PlanArgs) -> Result<()> {
    let plan = plan(a)?;
    std::fs::write(&a.out, plan.to_json()?).with_context(|| format!("writing {}", a.out.display()))?;
    print!("{}", codegen::explain::summary(&plan));
    println!("wrote     {}", a.out.display());
    Ok(())
}

/// Plans as `autopar autoparallelize` does (everything but writing `--out` and printing): the
/// Python package's `plan_onnx` calls this too.
pub fn plan(a: &PlanArgs) -> Result<codegen::Plan> {
    let budget = a.memory;
    let baseline: Baseline = a.strategy.parse().map_err(anyhow::Error::msg)?;
    if let (Stages::Auto, Baseline::Axes(roles)) = (a.pipeline, baseline) {
        let stages = if roles.roles().contains(&::plan::AxisRole::Pp) {
            "its `pp` axis fixes the stage count"
        } else {
            "with no `pp` axis it has no stages"
        };
        bail!(
            "--strategy {baseline} gives every mesh axis a role, so {stages} and --pipeline auto has nothing to \
             search: give --pipeline N with `pp` on the outermost axis (of size N), or --strategy auto (or dp, \
             megatron, zero) to search stages and layouts"
        )
    }
    let profile = DeviceProfile::load(&a.device)?;
    let mesh = common::mesh(&a.mesh, &profile, a.mesh_profile.as_deref())?;
    if let Stages::Count(n) = a.pipeline {
        codegen::check_layout(baseline, &mesh, n as usize)?;
    }
    let opts = common::import_options(&a.inputs, false, a.max_constant_bytes)?;
    let forward = common::load_model(&a.model, &opts)?;
    let started = std::time::Instant::now();
    common::warn_shared_parameters(&forward);
    let loss = match &a.loss {
        Some(s) => s.parse().map_err(anyhow::Error::msg)?,
        None => default_loss(&forward)?,
    };
    // Progress on a terminal only: scripts and tests see the summary and at most one error line.
    let progress = std::io::stderr().is_terminal();
    if progress {
        eprintln!("building the training graph ({loss}) ...");
    }
    // Mixed precision by default where 16-bit products are clearly faster (twice on the GPU
    // profiles); a CPU computes bf16 in f32, and a measured bf16 rate a few percent above the f32
    // one is noise that would only add casts.
    let precision = a.precision.unwrap_or(if profile.bf16_flops > 1.5 * profile.f32_flops {
        common::Precision::Bf16
    } else {
        common::Precision::F32
    });
    if precision == common::Precision::F64 {
        bail!("plans are made in f32 or mixed precision; run an f32 plan in f64 with `autopar run --precision f64`");
    }
    if precision == common::Precision::Fp16 && !matches!(a.pipeline, Stages::Count(1)) {
        bail!(
            "fp16's loss scaling with pipeline stages is not built yet (each stage would need the other stages' \
             check of their gradients): use --precision bf16 (no loss scaling needed) with --pipeline"
        );
    }
    let topts = a.opt.train_options(loss, a.freeze.clone())?;
    let mut tg = ir::autodiff::training_graph_with(&forward, &topts, precision.mixed(a.grad_reduce))?;
    if a.microbatches > 1 {
        tg = tg.with_gradient_scale(1.0 / a.microbatches as f32);
    }
    if progress {
        eprintln!(
            "planning {} nodes on mesh {mesh} with {} per rank (solver limit {} s) ...",
            tg.graph.node_count(),
            codegen::fmt_bytes(budget),
            a.time_limit.as_secs_f64()
        );
    }
    let popts = PlanOptions {
        budget,
        baseline,
        time_limit: a.time_limit,
        threads: a.threads,
        compare_baselines: true,
        min_gain: a.min_gain / 100.0,
        recompute: if a.no_checkpoint { codegen::Recompute::Off } else { a.recompute },
        // The limit bounds the whole run after import: building the training graph above
        // counts too.
        deadline: Some(started + a.time_limit),
        abandon_late: false,
        cache: Default::default(),
        tie_layers: (PlanOptions::default().tie_layers || a.tie_layers) && !a.no_tie_layers,
        merge: a.merge.parse().map_err(anyhow::Error::msg)?,
        stages: match a.pipeline {
            Stages::Auto => 1,
            Stages::Count(n) => n as usize,
        },
        microbatches: a.microbatches as usize,
        accumulated: 1,
        schedule: a.schedule.parse().map_err(anyhow::Error::msg)?,
        chunks: a.chunks as usize,
        overlap: a.overlap.unwrap_or(profile.bf16_flops > 1.5 * profile.f32_flops),
    };
    let mut plan = match a.pipeline {
        Stages::Count(_) => codegen::plan(&tg.graph, &mesh, &profile, &popts)?,
        // `--strategy` per axis with `--pipeline auto` is refused above.
        Stages::Auto => codegen::pipeline::search(&tg.graph, &mesh, &profile, &popts)?,
    };
    codegen::label(&mut plan)?;
    plan.options.seed = a.seed;
    // Absolute, so that `autopar run` finds it from any directory; hashed, so that it refuses a
    // file that changed since.
    let source = a.model.canonicalize().with_context(|| format!("resolving {}", a.model.display()))?;
    let index = tracer::InitializerIndex::open(&source).with_context(|| format!("indexing {}", source.display()))?;
    plan.model.source_hash = Some(common::model_hash(&source, &index)?);
    plan.model.source = Some(source.display().to_string());
    Ok(plan)
}

/// Runs `autopar explain`.
pub fn explain(a: &ExplainArgs) -> Result<()> {
    let write = |f: &Path, text: String| -> Result<()> {
        std::fs::write(f, text).with_context(|| format!("writing {}", f.display()))?;
        println!("wrote     {}", f.display());
        Ok(())
    };
    let run = match &a.run {
        Some(log) => Some((log, super::run_log::read(log)?)),
        None => None,
    };
    let plan = match &a.plan {
        Some(p) => Some(common::read_plan(p)?),
        None => None,
    };
    let measured = match (&a.measured, &plan) {
        (Some(f), Some(plan)) => Some(super::measured::read(f, plan)?),
        _ => None,
    };
    if let Some(plan) = &plan {
        print!("{}", codegen::explain::summary(plan));
        if let Some(m) = &measured {
            print!("{}", super::measured::summary(plan, m));
        }
        if let Some(f) = &a.dot {
            write(f, codegen::explain::dot(plan))?;
        }
    } else if a.dot.is_some() {
        bail!("--dot draws a plan: name one");
    }
    if let Some((_, steps)) = &run {
        print!("{}", super::run_log::summary(steps));
        if let Some(f) = &a.svg {
            let loss = super::run_log::charts(steps, &a.reference).remove(0);
            write(f, loss.svg())?;
        }
    }
    if let Some(f) = &a.html {
        let figures = match (&plan, &measured) {
            (Some(plan), Some(m)) => Some(super::measured::figures(plan, m)),
            _ => None,
        };
        let plan_page = |plan: &codegen::Plan| codegen::explain::html_with(plan, figures.as_ref());
        let mut page = match (&plan, &run) {
            (Some(plan), None) => plan_page(plan),
            (None, Some((log, steps))) => super::run_log::html(&log.display().to_string(), steps, &a.reference),
            (Some(plan), Some((_, steps))) => {
                // The plan's page with the run's curves before its end.
                let mut page = plan_page(plan);
                let curves: String =
                    super::run_log::charts(steps, &a.reference).iter().map(codegen::svg::LineChart::svg).collect();
                let at = page.rfind("</body>").unwrap_or(page.len());
                page.insert_str(
                    at,
                    &format!("<h2>Training run</h2>\n<pre>{}</pre>\n{curves}", super::run_log::summary(steps)),
                );
                page
            }
            (None, None) => bail!("nothing to draw: name a plan or --run LOG.jsonl"),
        };
        if let (Some(plan), Some(m)) = (&plan, &measured) {
            let at = page.rfind("</body>").unwrap_or(page.len());
            // The figures draw the measurements beside the estimates; this is their text.
            let section = format!(
                "<h2>Measured</h2>\n<pre>{}</pre>\n",
                super::measured::summary(plan, m).replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
            );
            page.insert_str(at, &section);
        }
        write(f, page)?;
    }
    Ok(())
}

/// `--pipeline`: a stage count, or a search.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stages {
    /// Search the count and the schedule (`auto`).
    Auto,
    /// This many stages (1: none).
    Count(u32),
}

/// `--overlap`.
fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("`{s}`: expected on or off")),
    }
}

/// `--recompute`.
fn parse_recompute(s: &str) -> Result<codegen::Recompute, String> {
    s.parse()
}

/// A percentage from 0 to 100 (`1`, `0.5`, `2%`).
fn parse_percent(s: &str) -> Result<f64, String> {
    match s.strip_suffix('%').unwrap_or(s).trim().parse::<f64>() {
        Ok(p) if (0.0..=100.0).contains(&p) => Ok(p),
        _ => Err(format!("`{s}` is not a percentage from 0 to 100")),
    }
}

/// `--pipeline`: a stage count (1 to 4096), or `auto`.
fn parse_pipeline(s: &str) -> Result<Stages, String> {
    if s == "auto" {
        return Ok(Stages::Auto);
    }
    match s.parse::<u32>() {
        Ok(n) if (1..=4096).contains(&n) => Ok(Stages::Count(n)),
        _ => Err(format!("`{s}` is not a stage count (1 to 4096) or `auto`")),
    }
}
