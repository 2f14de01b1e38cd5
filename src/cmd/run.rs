//! `autopar run`: executes a plan's training steps on N ranks.

use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use runtime::launch::{CheckpointOptions, Event, Fault, Init, Job, NcclOptions, RunOptions};
use runtime::program::Program;

use super::common;
use super::run_report::{Info, Reporter, explain, on_event, save_params};

/// Where ranks run.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Ranks as threads of this process (no setup).
    Threads,
    /// One process per rank under mpirun (build with `--features mpi`).
    Mpi,
    /// One process per GPU with NCCL (build with `--features cuda`).
    Nccl,
}

/// Arguments of `autopar run`.
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// A plan written by `autopar autoparallelize`.
    pub plan: PathBuf,
    /// Feed the global batch of an input from a .npy file: `NAME=FILE.npy` (model inputs and the
    /// loss's targets or labels). Each rank takes its block as the plan's input layout says; the
    /// same batch is used at every step (--data streams a new one).
    #[arg(long = "feed", value_name = "NAME=FILE.npy")]
    pub feeds: Vec<String>,
    /// Datasets streamed into inputs, a new global batch every step: each rank reads only the
    /// rows its block of the input needs, and checkpoints record the position.
    #[command(flatten)]
    pub data: super::data::DataArgs,
    /// Train until this step (a resumed run continues from its checkpoint's step).
    #[arg(long, default_value = "10", value_parser = common::parse_steps)]
    pub steps: u64,
    /// Where the ranks run.
    #[arg(long, value_enum, default_value = "threads")]
    pub backend: Backend,
    /// The ONNX model to read parameter blocks from (default: the file the plan was made from).
    #[arg(long, value_name = "MODEL.onnx")]
    pub model: Option<PathBuf>,
    /// Parameters: `model` (every one from the ONNX file), `auto` (from the file where it has
    /// data, the rest from --seed: weight-free models), or `random` (every one from --seed; the
    /// file is not read; `seed` is another name for it). With `model` and `auto` the file must
    /// exist and be the one the plan was made from (the plan records its hash).
    #[arg(long, default_value = "model", value_parser = ["model", "auto", "random", "seed"])]
    pub init: String,
    /// Seed of the run: of its dropout masks (default: the plan's, `plan --seed`; a resumed
    /// run needs its checkpoint's), and of the deterministic initialisation of parameters
    /// without data (`--init auto`) or of every parameter (`--init random`; default 0).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Drop nothing: every training-mode Dropout keeps every element, as `train --no-dropout`
    /// (the deterministic part of a model exported with dropout, to compare with a framework's
    /// run of it without dropout).
    #[arg(long)]
    pub no_dropout: bool,
    /// Write sharded checkpoints into this directory (after the last step, and every
    /// --checkpoint-every steps).
    #[arg(long, value_name = "DIR")]
    pub checkpoint: Option<PathBuf>,
    /// Checkpoint every K steps.
    #[arg(long, value_name = "K", requires = "checkpoint", value_parser = common::parse_steps)]
    pub checkpoint_every: Option<u64>,
    /// Continue from the newest checkpoint in --checkpoint DIR.
    #[arg(long, requires = "checkpoint")]
    pub resume: bool,
    /// After the last step, write the full parameters (assembled from every rank) to DIR/params.npz
    /// and DIR/model.safetensors (keyed by ONNX initializer name; loads with safetensors.torch).
    #[arg(long, value_name = "DIR")]
    pub save: Option<PathBuf>,
    /// After the last step, write the model with its trained parameters (assembled from every
    /// rank) as initializers to this ONNX file (runs on any ONNX runtime).
    #[arg(long, value_name = "OUT.onnx")]
    pub export_onnx: Option<PathBuf>,
    /// Kernel threads per rank.
    #[arg(long, default_value = "1", value_parser = common::parse_threads)]
    pub threads_per_rank: usize,
    /// How matrix products accumulate: f32 (fast) or f64.
    #[arg(long, value_enum, default_value = "f32")]
    pub accumulate: common::AccumulateKind,
    /// The float type of the step. By default the plan's: f32, or the bf16/fp16 mixed
    /// precision it was made with (`plan --precision`); naming it checks the plan is that.
    /// `f64` runs an f32 plan on CPU ranks (`threads`, `mpi`) with every float tensor in f64
    /// (weights and feeds widened on load), for checking it against `autopar train --precision
    /// f64`; memory is then twice the plan's estimate.
    #[arg(long, value_enum)]
    pub precision: Option<common::Precision>,
    /// Seconds a rank waits in a collective before the run fails (a rank stopped responding).
    #[arg(long, value_name = "SECONDS", default_value = "600", value_parser = common::parse_seconds)]
    pub timeout: Duration,
    /// One JSON object per line: `{"step":i,"loss":x,"ms":t,...}` per step, then a summary.
    #[arg(long)]
    pub json: bool,
    /// Time every instruction on every rank (compute, collectives with their waiting, transfers)
    /// and the bytes held after each, and write them to FILE (the first step is left out as a
    /// warm-up when there are more); `autopar explain PLAN --measured FILE` compares them with
    /// the plan's estimates.
    #[arg(long, value_name = "FILE")]
    pub profile_ops: Option<PathBuf>,
    /// `--backend nccl`: this process's rank (default: from mpirun's OMPI_COMM_WORLD_RANK or
    /// PMI_RANK, else 0).
    #[arg(long, value_name = "R", requires = "world")]
    pub rank: Option<usize>,
    /// `--backend nccl`: the number of processes (default: from OMPI_COMM_WORLD_SIZE or
    /// PMI_SIZE, else 1).
    #[arg(long, value_name = "N", requires = "rank", value_parser = common::parse_ranks)]
    pub world: Option<usize>,
    /// `--backend nccl`: the CUDA device of this rank (default: rank modulo the device count).
    #[arg(long, value_name = "ORDINAL")]
    pub gpu: Option<usize>,
    /// `--backend nccl`: directory where the ranks share NCCL ids (every rank must see the same
    /// one; default: a directory in the temp dir named after the plan's hash, the world size and
    /// mpirun's job id). Ranks started by hand should get a fresh one per run: an id file left by
    /// a failed run would be read as this run's.
    #[arg(long, value_name = "DIR")]
    pub nccl_dir: Option<PathBuf>,
    /// Inject a fault, for testing failure handling: `rank=R,step=S[,kind=error|panic|hang|exit-in-checkpoint|abort-process]`
    /// (also read from the AUTOPAR_INJECT_FAULT environment variable).
    #[arg(long, value_name = "SPEC", hide = true)]
    pub inject_fault: Option<String>,
}

/// The job of the flags, and what the reporter prints of it.
fn prepare(a: &RunArgs) -> Result<(Job, Info)> {
    let plan = common::read_valid_plan(&a.plan)?;
    let planned = plan.options.precision;
    match a.precision {
        Some(common::Precision::F64) if planned != plan::Precision::F32 => {
            bail!("--precision f64 runs f32 plans in double precision; {} is a {planned} plan", a.plan.display())
        }
        Some(p) if p != common::Precision::F64 && p.plan() != planned => bail!(
            "{} is a {planned} plan, not {}: make the plan with `autopar plan --precision {}`",
            a.plan.display(),
            p.name(),
            p.name()
        ),
        _ => {}
    }
    let float = a.precision.map_or(ir::DType::F32, |p| p.dtype());
    let mut program = Program::from_valid(&plan, float)?;
    if let Some(seed) = a.seed {
        program.set_seed(seed);
    }
    program.set_dropout(!a.no_dropout);
    let init_seed = a.seed.unwrap_or(0);
    let plan = plan.into_plan();
    let feeds = common::read_feeds(&a.feeds)?;
    let data = a.data.open(&program.feed_metas(), &feeds)?;
    if let Some(d) = &data {
        program.stream_inputs(d.names());
    }
    let fault: Option<Fault> = match a.inject_fault.clone().or_else(|| std::env::var("AUTOPAR_INJECT_FAULT").ok()) {
        Some(s) => Some(s.parse().map_err(anyhow::Error::msg)?),
        None => None,
    };
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let opts = RunOptions {
        until_step: a.steps,
        threads_per_rank: a.threads_per_rank,
        accumulation: a.accumulate.mode(),
        timeout: a.timeout,
        checkpoint: a.checkpoint.as_ref().map(|dir| CheckpointOptions { dir: dir.clone(), every: a.checkpoint_every }),
        fault,
        run_id: format!("{}-{now}", std::process::id()),
        data: None,
        profile_ops: a.profile_ops.is_some(),
        eval: a.data.open_eval(&program.feed_metas())?,
    };
    // Checked again against the checkpoint's step once it is read (--resume).
    runtime::launch::check_fault(&opts, program.ranks(), 0).map_err(explain)?;
    check_outputs(a, &program)?;
    if let Some(dir) = &a.checkpoint {
        std::fs::create_dir_all(dir).with_context(|| format!("--checkpoint {}", dir.display()))?;
    }
    let init = if a.resume {
        Init::Resume { dir: a.checkpoint.clone().context("--resume needs --checkpoint DIR")? }
    } else if matches!(a.init.as_str(), "random" | "seed") {
        Init::Seed { seed: init_seed }
    } else {
        let path = match &a.model {
            Some(m) if !m.exists() => bail!("--model {} does not exist", m.display()),
            Some(m) => m.clone(),
            None => runtime::launch::model_file(&plan, a.plan.parent().unwrap_or(Path::new(""))).map_err(explain)?,
        };
        Init::Model {
            path,
            open: common::open_onnx_params,
            all: a.init == "model",
            seed: init_seed,
            hash: plan.model.source_hash.clone(),
        }
    };
    let info = Info {
        ranks: program.ranks(),
        batch: program.batch(),
        threads_per_rank: a.threads_per_rank,
        plan,
        data: data.as_ref().map(|d| (super::data::describe(d), d.bytes_per_step())),
        tokens_per_sample: data.as_ref().and_then(|d| d.tokens_per_sample()).or_else(|| {
            // A language model fed by --feed: its input_ids' sequence length.
            program.inputs.iter().find(|i| i.name == "input_ids" && i.meta.shape.len() == 2).map(|i| i.meta.shape[1])
        }),
    };
    let mut opts = opts;
    opts.data = data.map(std::sync::Arc::new);
    Ok((Job { program, feeds, init, opts, gather: a.save.is_some() || a.export_onnx.is_some() }, info))
}

/// Checks every output destination before the first step (a run that cannot write its results
/// fails now, not after its last step): --save and --checkpoint directories, --export-onnx and
/// --profile-ops files, each writable and with room for what it will hold.
fn check_outputs(a: &RunArgs, program: &Program) -> Result<()> {
    let params: u64 = program.resident.iter().filter(|r| !r.is_state).map(|r| r.meta.bytes() as u64).sum();
    let all: u64 = program.resident.iter().map(|r| r.meta.bytes() as u64).sum();
    if let Some(dir) = &a.save {
        runtime::outputs::check_dir("--save", dir, 2 * params + (1 << 20))?;
    }
    if let Some(dir) = &a.checkpoint {
        // The newest two checkpoints are kept, and a third is written before the oldest goes.
        runtime::outputs::check_dir("--checkpoint", dir, if a.resume { all } else { 2 * all } + (1 << 20))?;
    }
    if let Some(file) = &a.export_onnx {
        let model = a.model.as_ref().and_then(|m| std::fs::metadata(m).ok()).map_or(0, |m| m.len());
        runtime::outputs::check_file("--export-onnx", file, model + params)?;
    }
    if let Some(file) = &a.profile_ops {
        runtime::outputs::check_file("--profile-ops", file, 1 << 20)?;
    }
    Ok(())
}

/// This process's rank among the processes of a launch (mpirun's, or `--rank`); 0 alone.
fn process_rank(a: &RunArgs) -> usize {
    a.rank.unwrap_or_else(|| {
        ["OMPI_COMM_WORLD_RANK", "PMI_RANK"]
            .iter()
            .find_map(|v| std::env::var(v).ok().and_then(|s| s.parse().ok()))
            .unwrap_or(0)
    })
}

/// Runs `autopar run`: the job of the flags on the launcher of `--backend`.
pub fn run(a: &RunArgs) -> Result<()> {
    run_observed(a, &mut |_| {})
}

/// Runs `autopar run`, handing each step's report to `observe` as well (the Python package's
/// `Plan.train` collects its metrics so).
pub fn run_observed(a: &RunArgs, observe: &mut dyn FnMut(&runtime::launch::StepReport)) -> Result<()> {
    // One run per checkpoint directory (held by the first process of a launch until it exits):
    // a second run would remove the first one's files as stale.
    let _lock = match &a.checkpoint {
        Some(dir) if process_rank(a) == 0 => {
            Some(runtime::outputs::DirLock::acquire(dir).map_err(|e| anyhow::anyhow!("--checkpoint {e}"))?)
        }
        _ => None,
    };
    if a.precision == Some(common::Precision::F64) && a.backend == Backend::Nccl {
        bail!("--precision f64 runs on CPU ranks only (--backend threads or mpi); the GPU kernels are f32");
    }
    let info = RefCell::new(None);
    // The model file `--export-onnx` rewrites: --model, or the plan's.
    let model = RefCell::new(None);
    let mut rep = None;
    let mut on = |e: Event<'_>| {
        if let Event::Step(r) = &e {
            observe(r);
        }
        on_event(a, &info, &mut rep, e)
    };
    let prepared = |a: &RunArgs| -> Result<Job> {
        let (job, i) = prepare(a)?;
        if a.export_onnx.is_some() || a.save.is_some() {
            let found = match &a.model {
                Some(m) => Ok(m.clone()),
                None => runtime::launch::model_file(&i.plan, a.plan.parent().unwrap_or(Path::new(""))),
            };
            // --export-onnx needs the model; --save only names the parameters with it.
            *model.borrow_mut() = match found {
                Ok(p) => Some(p),
                Err(e) if a.export_onnx.is_some() => return Err(explain(e)),
                Err(_) => None,
            };
        }
        *info.borrow_mut() = Some(i);
        Ok(job)
    };
    let done = match a.backend {
        Backend::Threads => {
            let job = prepared(a)?;
            let threads = job.program.ranks() * a.threads_per_rank;
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            if threads > cores {
                eprintln!(
                    "warning: {} ranks x {} kernel thread(s) on {cores} cores: the ranks take turns on the cores, \
                     so the steps run slower than the plan's estimate, which gives each kernel thread a core",
                    job.program.ranks(),
                    a.threads_per_rank
                );
            }
            runtime::launch::threads(&job, &mut on)
        }
        // MPI starts before the plan is read, so that a failure in reading it stops the whole job.
        Backend::Mpi => runtime::launch::mpi(&mut || prepared(a).map_err(|e| format!("{e:#}")), &mut on),
        Backend::Nccl => {
            let o = NcclOptions { rank_world: a.rank.zip(a.world), gpu: a.gpu, dir: a.nccl_dir.clone() };
            let mut job = prepared(a)?;
            let hash = info.borrow().as_ref().map(|i| i.plan.model.hash.clone()).unwrap_or_default();
            runtime::launch::nccl(&mut job, &hash, &o, &mut on)
        }
    };
    if let Some(b) = rep.as_ref().and_then(|r: &Reporter| r.bar.as_ref()) {
        b.finish_and_clear();
    }
    let done = done.map_err(explain)?;
    if let Some(rep) = rep.as_mut() {
        rep.finish()?;
        if let Some(file) = &a.profile_ops {
            super::measured::write(file, rep.plan(), &done.profiles)?;
            if !a.json {
                println!("wrote the measured profile of every rank to {}", file.display());
            }
        }
    }
    let Some(params) = done.params else { return Ok(()) };
    save_params(a, &params, model.borrow().as_deref())?;
    if let Some(file) = &a.export_onnx {
        let model = model.borrow().clone().context("--export-onnx: the model file is unknown")?;
        common::check_finite_params(&params).with_context(|| format!("--export-onnx {}", file.display()))?;
        common::export_onnx(&model, file, &params)?;
        if !a.json {
            println!("wrote the trained model to {}", file.display());
        }
    }
    Ok(())
}
