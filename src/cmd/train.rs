//! `autopar train`.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use ir::autodiff::{LossSpec, Optimizer};

use super::common;

/// Arguments of `autopar train`.
#[derive(clap::Args, Debug)]
pub struct TrainArgs {
    /// The ONNX model.
    pub model: PathBuf,
    /// Feed a tensor from a .npy file: `NAME=FILE.npy`. Model inputs and the loss's targets or
    /// labels are fed this way or by --data; a fed batch is used at every step.
    #[arg(long = "feed", value_name = "NAME=FILE.npy")]
    pub feeds: Vec<String>,
    /// Datasets streamed into inputs, a new batch every step (see `--data`).
    #[command(flatten)]
    pub data: super::data::DataArgs,
    /// Bind an input's shape, e.g. `input_ids=2x128` (default: the shapes of the feeds).
    #[arg(long = "input", value_name = "NAME=DIMS")]
    pub inputs: Vec<String>,
    /// Largest constant the importer may compute (folded shape arithmetic, ConstantOfShape,
    /// Range), in bytes; parameters and activations are shapes only and not bounded by it.
    #[arg(long, value_name = "BYTES", default_value_t = tracer::DEFAULT_MAX_CONSTANT_BYTES)]
    pub max_constant_bytes: usize,
    /// The loss: `mse:OUTPUT:TARGET` (mean squared error), `ce:OUTPUT:LABELS` (cross-entropy,
    /// class dim last, i64 labels) or `ce-next:OUTPUT:INPUT_IDS` (next-token LM loss).
    #[arg(long, value_name = "SPEC")]
    pub loss: String,
    /// Optimizer settings.
    #[command(flatten)]
    pub opt: common::OptimizerArgs,
    /// Number of steps.
    #[arg(long, default_value = "10", value_parser = common::parse_steps)]
    pub steps: u64,
    /// Parameters not to train (repeatable; exact initializer names).
    #[arg(long = "freeze", value_name = "PARAM")]
    pub freeze: Vec<String>,
    /// Save parameters and optimizer state here after the last step (params.npz, state.npz,
    /// trainer.json), and the parameters as model.safetensors for other tools.
    #[arg(long, value_name = "DIR")]
    pub save: Option<PathBuf>,
    /// After the last step, write the model with its trained parameters as initializers to
    /// this ONNX file (runs on any ONNX runtime; the graph is the original file's).
    #[arg(long, value_name = "OUT.onnx")]
    pub export_onnx: Option<PathBuf>,
    /// Start from parameters and optimizer state saved with --save.
    #[arg(long, value_name = "DIR")]
    pub load: Option<PathBuf>,
    /// Seed of the dropout masks (training-mode Dropout). A mask is a function of the seed, the
    /// step and each element's place in the batch only, so `autopar run` of any plan made with
    /// `plan --seed N` (or run with `--seed N`) draws the same masks as `train --seed N`; a run
    /// continued with --load counts its steps on and needs the same seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Drop nothing: every training-mode Dropout keeps every element, as in inference. Trains
    /// the deterministic part of a model exported with dropout, to compare with a framework's
    /// run of it without dropout.
    #[arg(long)]
    pub no_dropout: bool,
    /// How matrix products (matmul, gemm, convolutions) accumulate: f32 (fast) or f64 (about 2x
    /// slower products; sums that cancel keep their exact sign).
    #[arg(long, value_enum, default_value = "f32")]
    pub accumulate: common::AccumulateKind,
    /// The float type of the step: f32; f64 (parameters, activations, gradients and optimizer
    /// state; f32 weights and feeds are widened on load); or mixed precision, bf16 or fp16
    /// (16-bit activations and matrix products, f32 parameters and optimizer state).
    #[arg(long, value_enum, default_value = "f32")]
    pub precision: common::Precision,
    /// With --precision bf16/fp16: the type parameter gradients are kept, summed and reduced in
    /// (`f32`, or `low` for the 16-bit type).
    #[arg(long, value_enum, default_value = "f32")]
    pub grad_reduce: common::GradReduce,
    /// CPU threads for the kernels.
    #[arg(long, default_value = "2", value_parser = common::parse_threads)]
    pub threads: usize,
    /// After the last step, print where its time went: seconds per op kind and phase.
    #[arg(long)]
    pub profile: bool,
    /// Print the training graph (IR text) and exit.
    #[arg(long)]
    pub graph: bool,
    /// One JSON object per line: `{"step":i,"loss":x,...}` per step.
    #[arg(long)]
    pub json: bool,
    /// Make the gradients of step N non-finite (for testing fp16 loss scaling: the step is
    /// skipped).
    #[arg(long, value_name = "N", hide = true)]
    pub inject_nonfinite: Option<u64>,
    /// Exit (code 137) once --save has written its files, before they replace the directory, as
    /// a kill mid-save would (for testing that saves are atomic).
    #[arg(long, hide = true)]
    pub inject_exit_in_save: bool,
}

/// Runs `autopar train`.
pub fn run(a: &TrainArgs) -> Result<()> {
    let loss: LossSpec = a.loss.parse().map_err(anyhow::Error::msg)?;
    let opt = a.opt.optimizer()?;
    let topts = a.opt.train_options(loss, a.freeze.clone())?;
    let feeds = common::read_feeds(&a.feeds)?;
    let mut opts = common::import_options(&a.inputs, true, a.max_constant_bytes)?;
    for (name, t) in &feeds {
        opts.feed_shapes.insert(name.clone(), t.shape().to_vec());
    }
    let (g, notes) = common::load_model_noted(&a.model, &opts)?;
    common::warn_shared_parameters(&g);
    let tg = ir::autodiff::training_graph_with(&g, &topts, a.precision.mixed(a.grad_reduce))?;
    let tg = match a.precision {
        common::Precision::F64 => tg.with_float_type(ir::DType::F64)?,
        _ => tg,
    };
    if a.graph {
        return common::print_graph(&tg.graph, false);
    }
    let ctx =
        runtime::Cpu::new(a.threads).context("starting the CPU thread pool")?.with_accumulation(a.accumulate.mode());
    let inputs = super::data::graph_inputs(&tg.graph);
    let data = a.data.open(&inputs, &feeds)?;
    let mut trainer = runtime::train::Trainer::new(&tg, &g.param_data)?
        .with_profiling(a.profile)
        .with_seed(a.seed)
        .with_dropout(!a.no_dropout);
    if let Some(dir) = &a.load {
        trainer.load(dir).with_context(|| format!("--load {}", dir.display()))?;
        super::data::check_position(dir, data.as_ref(), trainer.steps_done())?;
    }
    // Every output is checked before step 1: a run that cannot save its weights fails now, not
    // after its last step.
    let (_, param_bytes) = g.param_stats();
    let state_bytes: usize = tg.graph.states.iter().map(|&s| tg.graph.node(s).outputs[0].bytes()).sum();
    if let Some(dir) = &a.save {
        // params.npz, model.safetensors, state.npz and small files, next to the previous save.
        let bytes = (2 * param_bytes + state_bytes) as u64 + (1 << 20);
        runtime::outputs::check_dir("--save", dir, bytes)?;
    }
    if let Some(file) = &a.export_onnx {
        let model_bytes = std::fs::metadata(&a.model).map_or(0, |m| m.len());
        runtime::outputs::check_file("--export-onnx", file, model_bytes + param_bytes as u64)?;
    }
    let mut reader = data.as_ref().map(|d| d.reader());
    // The step the run starts after (a loaded state's): --steps more follow.
    let first = trainer.steps_done();
    // Samples per step (the inputs' first dim) and, for a language model, tokens per sample.
    let batch = inputs.first().and_then(|(_, m)| m.shape.first().copied()).unwrap_or(1);
    let tokens_per_sample = data
        .as_ref()
        .and_then(|d| d.tokens_per_sample())
        .or_else(|| inputs.iter().find(|(n, m)| n == "input_ids" && m.shape.len() == 2).map(|(_, m)| m.shape[1]));
    let eval = a.data.open_eval(&inputs)?;
    let mut held_out = eval.as_ref().map(|e| e.data.reader());
    let saved = trainer.saved_for_backward();
    let saved_bytes: usize = saved.iter().map(|s| s.meta.bytes()).sum();
    if !a.json {
        let (np, pb) = g.param_stats();
        println!(
            "training {} ({} trainable of {} parameter tensors, {np} parameters, {:.2} MiB) with {}{} on {} thread(s){}",
            g.name,
            tg.trainable.len(),
            g.params.len(),
            pb as f64 / 1048576.0,
            describe(&opt),
            describe_schedule(&topts),
            ctx.threads(),
            match a.precision {
                common::Precision::F32 => String::new(),
                common::Precision::F64 => ", in f64".to_string(),
                p => format!(", mixed precision {} (f32 parameters)", p.name()),
            }
        );
        for line in common::held_lines(&tg.statistics, &notes.constants) {
            println!("held: {line}");
        }
        println!(
            "graph: {} nodes; {} activations kept for backward ({:.2} MiB)",
            tg.graph.node_count(),
            saved.len(),
            saved_bytes as f64 / 1048576.0
        );
        if let Some(d) = &data {
            println!("{}", super::data::describe(d));
        }
    }
    let mut out = std::io::stdout().lock();
    let mut times = Vec::new();
    let mut last = None;
    let bar = common::step_bar(a.steps, a.json);
    for _ in 0..a.steps {
        if a.inject_nonfinite == Some(trainer.steps_done() + 1)
            && !trainer.set(ir::autodiff::LOSS_SCALE_POISON, ir::Tensor::scalar_f32(f32::INFINITY))
        {
            bail!("--inject-nonfinite needs loss scaling (--precision fp16)");
        }
        let t0 = std::time::Instant::now();
        let streamed;
        let step_feeds = match reader.as_mut() {
            Some(r) => {
                let mut f = r.batch(trainer.steps_done(), &inputs)?;
                f.extend(feeds.iter().map(|(k, v)| (k.clone(), v.clone())));
                streamed = f;
                &streamed
            }
            None => &feeds,
        };
        let rep = trainer.step(&ctx, step_feeds)?;
        let dt = t0.elapsed().as_secs_f64();
        times.push(dt);
        if !rep.loss.is_finite() {
            eprintln!("warning: step {}: loss is {} (diverged; try a smaller --lr)", rep.step, rep.loss);
        }
        let mut eval_loss = None;
        if let (Some(e), Some(r)) = (&eval, held_out.as_mut())
            && e.due(rep.step, first + a.steps)
        {
            let mut sum = 0.0;
            for b in 0..e.batches {
                let mut f = r.batch(b, &inputs)?;
                for (k, v) in step_feeds {
                    f.entry(k.clone()).or_insert_with(|| v.clone());
                }
                sum += trainer.eval(&ctx, &f)? as f64;
            }
            eval_loss = Some(sum / e.batches as f64);
        }
        // The schedule's learning rate and the gradient norm before clipping, when the graph
        // computes them.
        let lr = rep.outputs.get("lr").map(runtime::scalar_f32);
        let grad_norm = rep.outputs.get("grad_norm").map(runtime::scalar_f32);
        if a.json {
            let mut line = serde_json::json!({
                "step": rep.step, "loss": rep.loss, "ms": dt * 1e3, "peak_bytes": rep.peak_bytes,
                "samples_per_s": batch as f64 / dt.max(1e-12),
            });
            if let Some(t) = tokens_per_sample {
                line["tokens_per_s"] = serde_json::json!((batch * t) as f64 / dt.max(1e-12));
            }
            if let Some(lr) = lr {
                line["lr"] = lr.into();
            }
            if let Some(n) = grad_norm {
                line["grad_norm"] = n.into();
            }
            if let Some(l) = eval_loss {
                line["eval_loss"] = serde_json::json!(l);
            }
            writeln!(out, "{line}")?;
        } else {
            let extra = lr.map(|x| format!("  lr {x:.4e}")).unwrap_or_default()
                + &grad_norm.map(|x| format!("  grad norm {x:.6}")).unwrap_or_default()
                + &eval_loss.map(|l| format!("  eval loss {l:.8}")).unwrap_or_default();
            let line = format!("step {:>4}  loss {:<12.8}  {:>8.1} ms{extra}", rep.step, rep.loss, dt * 1e3);
            match &bar {
                Some(b) => {
                    b.set_message(format!("loss {:.6}  {:.1} ms/step", rep.loss, dt * 1e3));
                    b.inc(1);
                    b.println(line);
                }
                None => writeln!(out, "{line}")?,
            }
        }
        out.flush()?;
        last = Some(rep);
    }
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    if let Some(dir) = &a.save {
        // Written into a staging directory that replaces DIR whole (a kill midway leaves the
        // previous save).
        let ctx = || format!("--save {}", dir.display());
        let staged = runtime::outputs::SaveDir::new(dir).with_context(ctx)?;
        trainer.save_into(staged.path()).with_context(ctx)?;
        super::data::save_position(staged.path(), data.as_ref(), trainer.steps_done())?;
        common::write_torch_names(&a.model, staged.path(), &trainer.params())?;
        if a.inject_exit_in_save {
            eprintln!("injected fault: exiting while {} is being saved", dir.display());
            std::process::exit(137);
        }
        staged.commit().with_context(ctx)?;
    }
    if let Some(file) = &a.export_onnx {
        trainer.check_finite().with_context(|| format!("--export-onnx {}", file.display()))?;
        common::export_onnx(&a.model, file, &trainer.params())?;
        if !a.json {
            writeln!(out, "wrote the trained model to {}", file.display())?;
        }
    }
    if !a.json
        && let Some(rep) = last
    {
        let mut sorted = times.clone();
        sorted.sort_by(f64::total_cmp);
        writeln!(
            out,
            "median step {:.1} ms; peak activations {:.2} MiB; parameters + optimizer state {:.2} MiB",
            sorted[sorted.len() / 2] * 1e3,
            rep.peak_bytes as f64 / 1048576.0,
            rep.resident_bytes as f64 / 1048576.0
        )?;
        if let Some(dir) = &a.save {
            writeln!(out, "saved parameters and optimizer state to {}", dir.display())?;
        }
        if a.profile {
            print_profile(&mut out, &tg, &rep.node_seconds)?;
        }
    }
    Ok(())
}

/// Time of the last step by op kind (with its phase), largest first.
fn print_profile(out: &mut impl Write, tg: &ir::autodiff::TrainingGraph, times: &[(ir::NodeIndex, f64)]) -> Result<()> {
    let mut by: std::collections::BTreeMap<(String, String), (f64, usize)> = Default::default();
    let total: f64 = times.iter().map(|t| t.1).sum();
    for &(n, s) in times {
        let phase = format!("{:?}", tg.phases.get(&n).copied().unwrap_or(ir::autodiff::Phase::Forward)).to_lowercase();
        let e = by.entry((tg.graph.node(n).op.name().to_string(), phase)).or_default();
        e.0 += s;
        e.1 += 1;
    }
    let mut rows: Vec<_> = by.into_iter().collect();
    rows.sort_by(|a, b| b.1.0.total_cmp(&a.1.0));
    writeln!(out, "profile of the last step ({:.1} ms in kernels):", total * 1e3)?;
    writeln!(out, "  {:<22} {:<9} {:>6} {:>10} {:>6}", "op", "phase", "nodes", "ms", "share")?;
    for ((op, phase), (s, k)) in rows {
        writeln!(out, "  {op:<22} {phase:<9} {k:>6} {:>10.2} {:>5.1}%", s * 1e3, 100.0 * s / total.max(1e-12))?;
    }
    Ok(())
}

/// The schedule and clipping, as the header says them (empty without either).
fn describe_schedule(o: &ir::autodiff::TrainOptions) -> String {
    use ir::autodiff::LrDecay;
    let s = &o.schedule;
    let mut parts = vec![];
    if s.warmup_steps > 0 {
        parts.push(format!("linear warmup over {} steps", s.warmup_steps));
    }
    match s.decay {
        LrDecay::Constant => {}
        LrDecay::Cosine { steps, min_lr } => parts.push(format!("cosine decay over {steps} steps to {min_lr}")),
        LrDecay::Step { step_size, gamma } => parts.push(format!("times {gamma} every {step_size} steps")),
    }
    if let Some(m) = o.clip_grad_norm {
        parts.push(format!("gradients clipped to norm {m}"));
    }
    if parts.is_empty() { String::new() } else { format!(", {}", parts.join(", ")) }
}

fn describe(o: &Optimizer) -> String {
    match o {
        Optimizer::Sgd { lr, momentum, weight_decay } => {
            format!("SGD (lr {lr}, momentum {momentum}, weight decay {weight_decay})")
        }
        Optimizer::AdamW { lr, beta1, beta2, epsilon, weight_decay } => {
            format!("AdamW (lr {lr}, betas {beta1},{beta2}, eps {epsilon:e}, weight decay {weight_decay})")
        }
    }
}
