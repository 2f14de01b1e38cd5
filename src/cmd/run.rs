//! `autopar run`: executes a plan's training steps on N ranks.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use codegen::{Plan, fmt_bytes};
use runtime::dist::{FirstOf, ParamSource, Program, RankState, SeededInit};
use runtime::launch::{CheckpointOptions, Fault, RunOptions, StepReport};

use super::common;

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
    /// same batch is used at every step.
    #[arg(long = "feed", value_name = "NAME=FILE.npy")]
    pub feeds: Vec<String>,
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
    /// Seed of the deterministic initialisation of parameters without data (`--init auto`) or of
    /// every parameter (`--init random`).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
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
    /// After the last step, write the full parameters (assembled from every rank) to DIR/params.npz.
    #[arg(long, value_name = "DIR")]
    pub save: Option<PathBuf>,
    /// Kernel threads per rank.
    #[arg(long, default_value = "1", value_parser = common::parse_threads)]
    pub threads_per_rank: usize,
    /// How matrix products accumulate: f32 (fast) or f64.
    #[arg(long, value_enum, default_value = "f32")]
    pub accumulate: common::AccumulateKind,
    /// The float type of the whole step: f32 (the plan's), or f64 on CPU ranks (`threads`,
    /// `mpi`): the same plan with every float tensor in f64 (weights and feeds widened on load),
    /// for checking it against `autopar train --precision f64`. Memory is then twice the plan's
    /// estimate.
    #[arg(long, value_enum, default_value = "f32")]
    pub precision: common::Precision,
    /// Seconds a rank waits in a collective before the run fails (a rank stopped responding).
    #[arg(long, value_name = "SECONDS", default_value = "600", value_parser = common::parse_seconds)]
    pub timeout: Duration,
    /// One JSON object per line: `{"step":i,"loss":x,"ms":t,...}` per step, then a summary.
    #[arg(long)]
    pub json: bool,
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

/// What to say when the model cannot be used.
const RANDOM_HINT: &str = "pass --init random --seed N to train from random weights instead";

/// The model file: `--model`, or the plan's source (a relative one, from plans written before
/// sources were recorded absolute, is relative to the plan file's directory). It must exist.
fn model_path(a: &RunArgs, plan: &Plan) -> Result<PathBuf> {
    if let Some(m) = &a.model {
        if !m.exists() {
            bail!("--model {} does not exist", m.display());
        }
        return Ok(m.clone());
    }
    let Some(src) = plan.model.source.as_deref() else {
        bail!("the plan records no model file; pass --model MODEL.onnx, or {RANDOM_HINT}");
    };
    let src = Path::new(src);
    let path = if src.is_absolute() { src.to_path_buf() } else { a.plan.parent().unwrap_or(Path::new("")).join(src) };
    if !path.exists() {
        bail!(
            "the plan's model file {} does not exist (moved or deleted?); pass --model MODEL.onnx, or {RANDOM_HINT}",
            path.display()
        );
    }
    Ok(path)
}

/// Refuses a model file whose bytes (with its external data) are not those the plan was made
/// from. A plan from an older autopar records no hash: then a warning (when `warn`).
fn check_model_hash(plan: &Plan, path: &Path, index: &tracer::InitializerIndex, warn: bool) -> Result<()> {
    let Some(want) = plan.model.source_hash.as_deref() else {
        if warn {
            eprintln!(
                "warning: the plan records no hash of its model file (an older plan); {} is used unchecked",
                path.display()
            );
        }
        return Ok(());
    };
    let got = common::model_hash(path, index)?;
    if got != want {
        bail!(
            "{} is not the model the plan was made from (its hash is {got}, the plan's {want}); plan again, or {RANDOM_HINT}",
            path.display()
        );
    }
    Ok(())
}

/// Refuses an injected fault that could never fire: a rank outside the plan, or a step outside
/// `start + 1..=until` (a fault silently ignored would pass a failure-handling test for nothing).
fn check_fault(opts: &RunOptions, ranks: usize, start: u64) -> Result<()> {
    let Some(f) = opts.fault else { return Ok(()) };
    let what = format!("injected fault (--inject-fault or AUTOPAR_INJECT_FAULT) rank={},step={}", f.rank, f.step);
    if f.rank >= ranks {
        bail!("{what}: the plan has {ranks} ranks (0 to {})", ranks - 1);
    }
    if f.step <= start || f.step > opts.until_step {
        bail!("{what}: this run trains steps {} to {}", start + 1, opts.until_step);
    }
    Ok(())
}

/// What every back end needs: the plan, its program, the feeds and the run options.
struct Prepared {
    plan: Plan,
    program: Program,
    feeds: BTreeMap<String, ir::Tensor>,
    opts: RunOptions,
}

fn prepare(a: &RunArgs) -> Result<Prepared> {
    let plan = common::read_valid_plan(&a.plan)?;
    let program = Program::from_valid(&plan, a.precision.dtype())?;
    let plan = plan.into_plan();
    let feeds = common::read_feeds(&a.feeds)?;
    let fault: Option<Fault> = match a.inject_fault.clone().or_else(|| std::env::var("AUTOPAR_INJECT_FAULT").ok()) {
        Some(s) => Some(s.parse().map_err(anyhow::Error::msg)?),
        None => None,
    };
    let opts = RunOptions {
        until_step: a.steps,
        threads_per_rank: a.threads_per_rank,
        accumulation: a.accumulate.mode(),
        timeout: a.timeout,
        checkpoint: a.checkpoint.as_ref().map(|dir| CheckpointOptions { dir: dir.clone(), every: a.checkpoint_every }),
        fault,
        run_id: format!(
            "{}-{}",
            std::process::id(),
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0)
        ),
    };
    // Checked again against the checkpoint's step once it is read (--resume).
    check_fault(&opts, program.ranks(), 0)?;
    if let Some(dir) = &a.checkpoint {
        std::fs::create_dir_all(dir).with_context(|| format!("--checkpoint {}", dir.display()))?;
    }
    Ok(Prepared { plan, program, feeds, opts })
}

/// Prints the run for people (progress bar on a terminal, a line per step otherwise) or as JSON
/// lines, and the summary at the end.
struct Reporter<'a> {
    a: &'a RunArgs,
    plan: &'a Plan,
    ranks: usize,
    batch: f64,
    bar: Option<indicatif::ProgressBar>,
    reports: Vec<StepReport>,
    print_err: Option<std::io::Error>,
}

impl<'a> Reporter<'a> {
    fn new(a: &'a RunArgs, p: &'a Prepared, start: u64, how: &str, source_note: &str) -> Result<Reporter<'a>> {
        let (plan, n) = (&p.plan, p.program.ranks());
        let est = &plan.estimate;
        if !a.json {
            let mut out = std::io::stdout().lock();
            writeln!(
                out,
                "running {} on mesh {} ({n} ranks {how}, {} kernel thread(s) each), steps {}..{}; {source_note}",
                plan.model.name,
                plan.mesh.shape.iter().map(|s| s.to_string()).collect::<Vec<_>>().join("x"),
                p.opts.threads_per_rank,
                start + 1,
                a.steps
            )?;
            writeln!(
                out,
                "plan: {} (chosen {}), estimated step {:.3} ms on {}, peak {} per rank",
                plan.options.strategy.name(),
                plan.solver.chosen.name(),
                est.step_seconds * 1e3,
                plan.device,
                fmt_bytes(est.peak_bytes_per_rank)
            )?;
            if a.precision == common::Precision::F64 {
                writeln!(out, "precision: f64 (every float twice as wide as the plan's f32 estimates)")?;
            }
        }
        let bar = (!a.json && std::io::stderr().is_terminal()).then(|| {
            let b = indicatif::ProgressBar::new(a.steps - start);
            b.set_style(
                indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} steps  {msg}")
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            b
        });
        Ok(Reporter { a, plan, ranks: n, batch: p.program.batch() as f64, bar, reports: vec![], print_err: None })
    }

    fn step(&mut self, r: &StepReport) {
        let sps = self.batch / r.seconds.max(1e-12);
        let comm = r.comm_seconds.iter().copied().fold(0.0, f64::max);
        let line = if self.a.json {
            serde_json::json!({
                "step": r.step, "loss": r.loss, "ms": r.seconds * 1e3, "samples_per_s": sps,
                "comm_ms": comm * 1e3, "peak_bytes": r.peak_bytes.iter().max(),
                "checkpoint": r.checkpoint.as_ref().map(|p| p.display().to_string()),
            })
            .to_string()
        } else {
            format!(
                "step {:>4}  loss {:<12.8}  {:>8.1} ms  {:>8.1} samples/s  collectives {:>6.1} ms{}",
                r.step,
                r.loss,
                r.seconds * 1e3,
                sps,
                comm * 1e3,
                r.checkpoint.as_ref().map(|p| format!("  checkpoint {}", p.display())).unwrap_or_default()
            )
        };
        if !r.loss.is_finite() {
            eprintln!("warning: step {}: loss is {} (diverged; try a smaller --lr when planning)", r.step, r.loss);
        }
        match &self.bar {
            Some(b) => {
                b.set_message(format!("loss {:.6}  {:.1} ms/step  {:.1} samples/s", r.loss, r.seconds * 1e3, sps));
                b.inc(1);
                b.println(line);
            }
            None => {
                let mut out = std::io::stdout().lock();
                if let Err(e) = writeln!(out, "{line}").and_then(|_| out.flush()) {
                    self.print_err.get_or_insert(e);
                }
            }
        }
        self.reports.push(r.clone());
    }

    fn finish(&mut self) -> Result<()> {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
        if let Some(e) = self.print_err.take() {
            return Err(e.into());
        }
        let (n, est, reports) = (self.ranks, &self.plan.estimate, &self.reports);
        let mut out = std::io::stdout().lock();
        let peaks: Vec<u64> = (0..n).map(|r| reports.iter().map(|x| x.peak_bytes[r]).max().unwrap_or(0)).collect();
        let max_peak = peaks.iter().copied().max().unwrap_or(0);
        // The plan estimates f32 tensors; in f64 every float is twice as wide.
        let wide = if self.a.precision == common::Precision::F64 { 2 } else { 1 };
        let estimate = est.peak_bytes_per_rank * wide;
        let dev = 100.0 * (max_peak as f64 - estimate as f64) / (estimate.max(1) as f64);
        let mut secs: Vec<f64> = reports.iter().map(|r| r.seconds).collect();
        secs.sort_by(f64::total_cmp);
        let median = secs.get(secs.len() / 2).copied().unwrap_or(0.0);
        // The median step's counterpart: the median over steps of the ranks' mean collective time
        // (a mean over steps would let one descheduled step outweigh the rest).
        let mut comms: Vec<f64> = reports.iter().map(|r| r.comm_seconds.iter().sum::<f64>() / n as f64).collect();
        comms.sort_by(f64::total_cmp);
        let comm = comms.get(comms.len() / 2).copied().unwrap_or(0.0);
        if self.a.json {
            let line = serde_json::json!({
                "summary": true, "median_ms": median * 1e3, "comm_ms": comm * 1e3,
                "measured_peak_bytes": peaks, "estimated_peak_bytes": est.peak_bytes_per_rank,
                "precision": if wide == 2 { "f64" } else { "f32" },
                "estimated_step_ms": est.step_seconds * 1e3,
            });
            writeln!(out, "{line}")?;
        } else {
            writeln!(
                out,
                "median step {:.1} ms ({:.1} samples/s); collectives {:.1} ms per step per rank (median; {:.0}%)",
                median * 1e3,
                self.batch / median.max(1e-12),
                comm * 1e3,
                100.0 * comm / median.max(1e-12)
            )?;
            let all_same = peaks.iter().all(|&p| p == max_peak);
            writeln!(
                out,
                "memory: measured peak {} per rank{} (plan estimate {}{}, {dev:+.1}%)",
                fmt_bytes(max_peak),
                if all_same { String::new() } else { format!(" at most; per rank {:?}", peaks) },
                fmt_bytes(est.peak_bytes_per_rank),
                if wide == 2 { format!(" in f32, {} in f64", fmt_bytes(estimate)) } else { String::new() }
            )?;
        }
        Ok(())
    }
}

fn save_params(a: &RunArgs, params: &BTreeMap<String, ir::Tensor>) -> Result<()> {
    let Some(dir) = &a.save else { return Ok(()) };
    std::fs::create_dir_all(dir).with_context(|| format!("--save {}", dir.display()))?;
    let file = dir.join("params.npz");
    runtime::npy::write_npz(&file, params).with_context(|| format!("--save {}", file.display()))?;
    if !a.json {
        println!("saved the parameters ({} tensors) to {}", params.len(), file.display());
    }
    Ok(())
}

/// Runs `autopar run`.
pub fn run(a: &RunArgs) -> Result<()> {
    if a.precision == common::Precision::F64 && a.backend == Backend::Nccl {
        bail!("--precision f64 runs on CPU ranks only (--backend threads or mpi); the GPU kernels are f32");
    }
    match a.backend {
        Backend::Threads => run_threads(a),
        Backend::Mpi => run_mpi(a),
        Backend::Nccl => run_nccl(a),
    }
}

fn run_threads(a: &RunArgs) -> Result<()> {
    let p = prepare(a)?;
    let all: Vec<usize> = (0..p.program.ranks()).collect();
    let (states, source_note) = init_states(a, &p.plan, &p.program, &p.feeds, &all)?;
    let start = states[0].steps_done;
    if start >= a.steps {
        bail!("the checkpoint is at step {start}; ask for more with --steps (it is the step to train until)");
    }
    check_fault(&p.opts, p.program.ranks(), start)?;
    let mut rep = Reporter::new(a, &p, start, "as threads", &source_note)?;
    let result = runtime::launch::run_threads(&p.program, states, &p.opts, &mut |r| rep.step(r));
    if let Some(b) = &rep.bar {
        b.finish_and_clear();
    }
    let states = result.context("the run stopped")?;
    rep.finish()?;
    save_params(a, &p.program.assemble_params(&states)?)
}

#[cfg(not(feature = "mpi"))]
fn run_mpi(_: &RunArgs) -> Result<()> {
    bail!("--backend mpi: this autopar was built without MPI support (rebuild with --features mpi)")
}

/// One process per rank under mpirun: this process runs its own rank; rank 0 reports.
#[cfg(feature = "mpi")]
fn run_mpi(a: &RunArgs) -> Result<()> {
    use runtime::comm::Communicator;
    let world = runtime::mpi_comm::MpiWorld::init()?;
    let mut comm = world.comm();
    let (rank, size) = (comm.rank(), comm.size());
    // Every failure from here on stops the whole job, with the cause printed by the rank that saw it.
    let fail = |comm: &runtime::mpi_comm::MpiComm, e: anyhow::Error| -> ! {
        let msg = format!("{e:#}").replace('\n', " ");
        eprintln!("error: rank {rank}: {msg}");
        comm.abort(&msg);
        std::process::exit(1)
    };
    let mut p = match prepare(a) {
        Ok(p) => p,
        Err(e) => fail(&comm, e),
    };
    if p.program.ranks() != size {
        let e = anyhow::anyhow!(
            "the plan is for {} ranks but mpirun started {size}; run with mpirun -np {}",
            p.program.ranks(),
            p.program.ranks()
        );
        fail(&comm, e);
    }
    // The run id (names temporary checkpoint directories) is rank 0's.
    let id = ir::Tensor::i64(vec![1], vec![std::process::id() as i64]);
    let everyone: Vec<usize> = (0..size).collect();
    match comm.exchange(&everyone, std::sync::Arc::new(id)) {
        Ok(ids) => p.opts.run_id = format!("mpi-{}", ids[0].to_i64_vec()[0]),
        Err(e) => fail(&comm, e.into()),
    }
    let (mut states, source_note) = match init_states(a, &p.plan, &p.program, &p.feeds, &[rank]) {
        Ok(x) => x,
        Err(e) => fail(&comm, e),
    };
    let mut st = states.remove(0);
    let start = st.steps_done;
    if start >= a.steps {
        fail(&comm, anyhow::anyhow!("the checkpoint is at step {start}; ask for more with --steps"));
    }
    if let Err(e) = check_fault(&p.opts, size, start) {
        fail(&comm, e);
    }
    let mut rep = if rank == 0 {
        match Reporter::new(a, &p, start, "as MPI processes", &source_note) {
            Ok(r) => Some(r),
            Err(e) => fail(&comm, e),
        }
    } else {
        None
    };
    let ctx = match kernels::cpu::CpuContext::new(p.opts.threads_per_rank) {
        Ok(c) => c.with_accumulation(p.opts.accumulation),
        Err(e) => fail(&comm, e.into()),
    };
    let r = runtime::launch::rank_loop(&p.program, &mut st, &ctx, &mut comm, &p.opts, &mut |r| {
        if let Some(rep) = rep.as_mut() {
            rep.step(&r);
        }
    });
    if let Err(e) = r {
        fail(&comm, anyhow::Error::new(e).context("the run stopped"));
    }
    if let Some(rep) = rep.as_mut()
        && let Err(e) = rep.finish()
    {
        fail(&comm, e);
    }
    if a.save.is_some() {
        match runtime::launch::gather_params(&p.program, &st, &mut comm) {
            Ok(params) if rank == 0 => {
                if let Err(e) = save_params(a, &params) {
                    fail(&comm, e);
                }
            }
            Ok(_) => {}
            Err(e) => fail(&comm, e.into()),
        }
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn run_nccl(_: &RunArgs) -> Result<()> {
    bail!("--backend nccl: this autopar was built without CUDA support (rebuild with --features cuda)")
}

/// This process's rank and the world size: `--rank/--world`, else mpirun's variables (Open MPI,
/// then PMI), else rank 0 of 1.
#[cfg(feature = "cuda")]
fn rank_and_world(a: &RunArgs) -> Result<(usize, usize)> {
    if let (Some(r), Some(w)) = (a.rank, a.world) {
        return Ok((r, w));
    }
    for (rank, size) in [("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE")] {
        if let (Ok(r), Ok(w)) = (std::env::var(rank), std::env::var(size)) {
            let parse = |name: &str, v: &str| v.trim().parse::<usize>().with_context(|| format!("{name}={v}"));
            return Ok((parse(rank, &r)?, parse(size, &w)?));
        }
    }
    Ok((0, 1))
}

/// One process per GPU (under mpirun, or started by hand with --rank/--world): this process runs
/// its rank on its GPU, collectives through NCCL; rank 0 reports. A failure ends this process
/// with one line naming the rank; under mpirun that ends the job (NCCL has no abort).
#[cfg(feature = "cuda")]
fn run_nccl(a: &RunArgs) -> Result<()> {
    use runtime::comm::Communicator;
    use runtime::gpu::{GpuRank, NcclGroups};
    let (rank, world) = rank_and_world(a)?;
    if world == 0 || rank >= world {
        bail!("--backend nccl: rank {rank} of a world of {world}");
    }
    let r = (|| -> Result<()> {
        let mut p = prepare(a)?;
        if p.program.ranks() != world {
            bail!(
                "the plan is for {} ranks but this is rank {rank} of {world}; run with mpirun -np {}",
                p.program.ranks(),
                p.program.ranks()
            );
        }
        let gpu = match a.gpu {
            Some(g) => g,
            None => rank % kernels::cuda::device_count()?.max(1),
        };
        let ctx = kernels::cuda::CudaContext::new(gpu)?;
        let hash: String = p.plan.model.hash.chars().filter(char::is_ascii_alphanumeric).take(16).collect();
        // One id directory per job: the launcher's job id when there is one, so that the ranks
        // of a job meet and concurrent jobs of the same plan do not.
        let job = ["PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid"]
            .iter()
            .find_map(|v| std::env::var(v).ok())
            .map(|j| format!("-{}", j.replace(|c: char| !c.is_ascii_alphanumeric(), "_")))
            .unwrap_or_default();
        let dir = a
            .nccl_dir
            .clone()
            .unwrap_or_else(|| std::env::temp_dir().join(format!("autopar-nccl-{hash}-{world}{job}")));
        let (mut states, source_note) = init_states(a, &p.plan, &p.program, &p.feeds, &[rank])?;
        let host = kernels::cpu::CpuContext::new(p.opts.threads_per_rank)?.with_accumulation(p.opts.accumulation);
        let groups = NcclGroups::new(rank, world, dir, p.opts.timeout);
        let mut st = GpuRank::new(ctx, groups, host, states.remove(0))?;
        let start = st.steps_done;
        if start >= a.steps {
            bail!("the checkpoint is at step {start}; ask for more with --steps (it is the step to train until)");
        }
        check_fault(&p.opts, world, start)?;
        // The run id (names temporary checkpoint directories) is rank 0's.
        let id = std::sync::Arc::new(ir::Tensor::i64(vec![1], vec![std::process::id() as i64]));
        let everyone: Vec<usize> = (0..world).collect();
        p.opts.run_id = format!("nccl-{}", st.host_comm().exchange(&everyone, id)?[0].to_i64_vec()[0]);
        let how = format!("as processes on GPUs with NCCL, rank 0 on {}", st.context().device_name());
        let mut rep = if rank == 0 { Some(Reporter::new(a, &p, start, &how, &source_note)?) } else { None };
        let r = runtime::gpu::rank_loop(&p.program, &mut st, &p.opts, &mut |r| {
            if let Some(rep) = rep.as_mut() {
                rep.step(&r);
            }
        });
        if let Some(b) = rep.as_ref().and_then(|r| r.bar.as_ref()) {
            b.finish_and_clear();
        }
        r.context("the run stopped")?;
        if let Some(rep) = rep.as_mut() {
            rep.finish()?;
        }
        if a.save.is_some() {
            let host = st.host_state()?;
            let params = runtime::launch::gather_params(&p.program, &host, &mut st.host_comm())?;
            if rank == 0 {
                save_params(a, &params)?;
            }
        }
        Ok(())
    })();
    if world > 1 { r.with_context(|| format!("rank {rank}")) } else { r }
}

/// Every rank's blocks: from the checkpoint (`--resume`), or from the model file and the seed;
/// and a line saying where they came from.
fn init_states(
    a: &RunArgs,
    plan: &Plan,
    program: &Program,
    feeds: &BTreeMap<String, ir::Tensor>,
    ranks: &[usize],
) -> Result<(Vec<RankState>, String)> {
    let mut states: Vec<RankState> = Vec::with_capacity(ranks.len());
    let note = if a.resume {
        let dir = a.checkpoint.as_ref().context("--resume needs --checkpoint DIR")?;
        for &r in ranks {
            let mut st = program.empty_rank(r, feeds)?;
            runtime::checkpoint::load(dir, program, &mut st)
                .with_context(|| format!("--resume from {}", dir.display()))?;
            states.push(st);
        }
        format!("resumed from {} at step {}", dir.display(), states[0].steps_done)
    } else {
        let seeded = SeededInit { seed: a.seed };
        let index = match a.init.as_str() {
            "random" | "seed" => None,
            _ => {
                let p = model_path(a, plan)?;
                let ix = tracer::InitializerIndex::open(&p)
                    .with_context(|| format!("reading parameters from {}", p.display()))?;
                Some((ix, p))
            }
        };
        let params: Vec<&str> = program.resident.iter().filter(|r| !r.is_state).map(|r| r.name.as_str()).collect();
        let from_file = index.as_ref().map_or(0, |(ix, _)| params.iter().filter(|p| ix.get(p).is_some()).count());
        if let Some((ix, path)) = &index {
            if a.init == "model"
                && let Some(missing) = params.iter().find(|p| ix.get(p).is_none())
            {
                match ix.absent_file(missing) {
                    Some(f) => bail!(
                        "{}: the external data file {} of parameter {missing} does not exist; {RANDOM_HINT}",
                        path.display(),
                        f.display()
                    ),
                    None => bail!(
                        "{} has no data for parameter {missing} ({from_file} of {} parameters have data); pass --init auto to initialise the others from --seed, or {RANDOM_HINT}",
                        path.display(),
                        params.len()
                    ),
                }
            }
            check_model_hash(plan, path, ix, ranks.contains(&0))?;
        }
        let mut sources: Vec<&dyn ParamSource> = vec![];
        if let Some((ix, _)) = &index {
            sources.push(ix);
        }
        sources.push(&seeded);
        let source = FirstOf(sources);
        for &r in ranks {
            states.push(program.init_rank(r, &source, feeds)?);
        }
        match &index {
            Some((_, p)) if from_file == params.len() => format!("parameters from {}", p.display()),
            Some((_, p)) => format!(
                "parameters: {from_file} from {}, {} from seed {}",
                p.display(),
                params.len() - from_file,
                a.seed
            ),
            None => format!("parameters from seed {} ({} tensors)", a.seed, params.len()),
        }
    };
    Ok((states, note))
}
