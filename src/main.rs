//! The `autopar` command line.

use std::process::ExitCode;

use autopar::cmd;

use clap::{CommandFactory, Parser, Subcommand};

/// autopar: plan and run data/tensor-parallel training of ONNX models.
///
/// Typical flow: `autopar inspect model.onnx` to see what was imported, `autopar infer` to check
/// the forward pass on CPU, then plan and run training across a device mesh.
#[derive(Parser, Debug)]
#[command(name = "autopar", version, about, long_about = None, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Import a model and describe it: inputs, outputs, parameters, ops, FLOPs.
    #[command(
        after_help = "Examples:\n  autopar inspect model.onnx\n  autopar inspect gpt2.onnx --input input_ids=4x128 --graph\n  autopar inspect --ops"
    )]
    Inspect(cmd::inspect::InspectArgs),
    /// Run the forward pass on CPU and write every graph output as .npy.
    #[command(
        after_help = "Example:\n  autopar infer mlp.onnx --feed x=x.npy --out out/\n  (writes out/y.npy for the graph output y)"
    )]
    Infer(cmd::infer::InferArgs),
    /// Train on CPU (single device): forward, loss, backward, optimizer step; prints each loss.
    #[command(
        after_help = "Examples:\n  autopar train gpt2.onnx --feed input_ids=ids.npy --loss ce-next:logits:input_ids --optimizer adamw --lr 1e-3 --steps 50\n  autopar train mlp.onnx --feed x=x.npy --feed t=t.npy --loss mse:y:t --optimizer sgd --lr 0.1 --steps 5 --json\n  autopar train gpt2.onnx --feed input_ids=ids.npy --loss ce-next:logits:input_ids --lr 6e-4 --steps 200 \\\n    --lr-schedule cosine --warmup-steps 20 --decay-steps 180 --min-lr 6e-5 --clip-grad-norm 1.0\n  (--save DIR / --load DIR keep parameters and optimizer state between runs)"
    )]
    Train(cmd::train::TrainArgs),
    /// Solve a sharding cost-graph problem (IOPDDL JSON format).
    #[command(after_help = "Example:\n  autopar solve problem.json.gz --time-limit 60 --out solution.json")]
    Solve(cmd::solve::SolveArgs),
    /// List the sharding strategies of every op on a device mesh, with costs and expert names.
    #[command(
        after_help = "Examples:\n  autopar strategies mlp.onnx --mesh 2x4 --node /fc1/Gemm\n  autopar strategies gpt2.onnx --mesh data=2,tensor=4 --loss ce-next:logits:input_ids --node h.0/mlp\n  (tags: dp, megatron-col, megatron-row, zero, vocab-parallel, head-parallel, sequence-parallel, 2d)"
    )]
    Strategies(cmd::strategies::StrategiesArgs),
    /// Find the cheapest collectives that turn one sharding spec of a tensor into another.
    #[command(
        after_help = "Example:\n  autopar reshard --mesh 2x4 --shape 8x16x32 \"S0 R R\" \"R S01 R\"\n\nSpec grammar: one entry per tensor dim, R (replicated) or S<mesh axes> (split over those axes,\noutermost first: S01); partial-sum axes after a bar: \"R S1 | P0\"; \"-\" for a scalar."
    )]
    Reshard(cmd::reshard::ReshardArgs),
    /// Plan distributed training: choose a sharding for every op under a memory budget and write plan.json.
    #[command(
        visible_alias = "plan",
        after_help = "Examples:\n  autopar autoparallelize gpt2.onnx --mesh 2x4 --memory 16GiB -o plan.json\n  autopar plan mlp.onnx --mesh 1x2 --memory 64MiB --loss mse:y:t --strategy megatron\n  autopar plan gpt2.onnx --mesh 2x2 --memory 4GiB --lr-schedule cosine --decay-steps 1000 --clip-grad-norm 1.0 -o plan.json\n  (--strategy dp|megatron|zero prices a manual baseline with the same cost model; a schedule and\n  clipping are part of the planned step, and `run` executes them)"
    )]
    Autoparallelize(cmd::plan::PlanArgs),
    /// Execute a plan's training steps on N ranks (threads, MPI or NCCL); prints each step's loss.
    #[command(
        after_help = "Examples:\n  autopar run plan.json --feed input_ids=ids.npy --steps 20\n  autopar run plan.json --feed x=x.npy --feed t=t.npy --steps 100 --checkpoint ckpt/ --checkpoint-every 10\n  autopar run plan.json --feed x=x.npy --feed t=t.npy --steps 200 --checkpoint ckpt/ --resume\n  (parameters are read block by block from the plan's ONNX file; --json streams {\"step\",\"loss\",...},\n  with \"lr\" and \"grad_norm\" when the plan has a schedule and clipping)"
    )]
    Run(cmd::run::RunArgs),
    /// Measure the mesh's links (all-reduce / all-gather sweeps) and the device; write a profile for --device.
    #[command(
        after_help = "Examples:\n  autopar profile --mesh 2x2 -o cpu-2x2.json\n  mpirun -np 8 autopar profile --backend mpi --mesh 2x4 -o cluster.json\n  autopar plan model.onnx --mesh 2x2 --memory 8GiB --device cpu-2x2.json\n  (the fitted alpha/beta per axis are printed with how well they reproduce every measured time)"
    )]
    Profile(cmd::profile::ProfileArgs),
    /// Measure plans' steps head to head: the plans take turns in one process, so the machine's changes of speed fall on all of them.
    #[command(
        after_help = "Example:\n  autopar plan mlp.onnx --mesh 1x2 --memory 1GiB --loss mse:y:t --strategy dp -o dp.json\n  autopar plan mlp.onnx --mesh 1x2 --memory 1GiB --loss mse:y:t --strategy megatron -o megatron.json\n  autopar bench dp.json megatron.json --feed x=x.npy --feed t=t.npy --turns 10\n  (each turn runs about --seconds of steps of every plan; the first step of each is left out)"
    )]
    Bench(cmd::bench::BenchArgs),
    /// Summarise a plan; --dot and --html render it.
    #[command(after_help = "Example:\n  autopar explain plan.json --html plan.html --dot plan.dot")]
    Explain(cmd::plan::ExplainArgs),
    /// Write weight-free ONNX models with the shapes of real architectures, for planning at scale.
    #[command(
        after_help = "Example:\n  autopar gen gpt --layers 48 --hidden 4096 --heads 32 --seq 2048 --vocab 50257 --batch 8 -o gpt-48l.onnx"
    )]
    Gen(cmd::generate::GenArgs),
}

/// Prints a command-line error as one `error: ...` line (clap adds a usage block and tips), like
/// every other failure, and exits with clap's code 2; help and version print as usual.
fn usage_error(e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    if matches!(
        e.kind(),
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    ) {
        e.exit();
    }
    let msg = autopar::usage_message(&e);
    // Where the help is: `autopar gen gpt --help` for `autopar gen gpt --layers 0`.
    let mut command = vec!["autopar".to_string()];
    let mut cmd = Cli::command();
    for arg in std::env::args().skip(1) {
        let Some(sub) = cmd.find_subcommand(&arg).cloned() else { break };
        command.push(arg);
        cmd = sub;
    }
    eprintln!("error: {msg} (see {} --help)", command.join(" "));
    ExitCode::from(2)
}

fn main() -> ExitCode {
    // Die quietly on a closed pipe (`autopar inspect --graph | head`), as command-line tools do,
    // instead of panicking on the failed write.
    #[cfg(unix)]
    // SAFETY: called before any thread starts; restores the default disposition of one signal.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    // Training allocates the same large activations every step. glibc would serve each from
    // fresh mmap pages (and trim freed heap back to the OS), paying a page fault per 4 KiB on
    // every step; keep freed memory in the heap instead.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: called before any thread starts and before any allocation-heavy work; only tunes
    // thresholds.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TOP_PAD, 64 << 20);
    }
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("AUTOPAR_LOG"))
        .with_writer(std::io::stderr)
        .init();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage_error(e),
    };
    let res = match &cli.command {
        Command::Inspect(a) => cmd::inspect::run(a),
        Command::Infer(a) => cmd::infer::run(a),
        Command::Solve(a) => cmd::solve::run(a),
        Command::Train(a) => cmd::train::run(a),
        Command::Strategies(a) => cmd::strategies::run(a),
        Command::Reshard(a) => cmd::reshard::run(a),
        Command::Autoparallelize(a) => cmd::plan::run(a),
        Command::Explain(a) => cmd::plan::explain(a),
        Command::Run(a) => cmd::run::run(a),
        Command::Profile(a) => cmd::profile::run(a),
        Command::Bench(a) => cmd::bench::run(a),
        Command::Gen(a) => cmd::generate::run(a),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", autopar::error_line(&e));
            ExitCode::FAILURE
        }
    }
}
