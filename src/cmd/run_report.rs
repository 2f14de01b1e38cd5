//! What `autopar run` prints and says: the run's header, a line (or a progress bar) per step,
//! the summary of measured time and memory against the plan's estimate, and its errors with
//! what to do about them in its flags.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::io::Write;

use anyhow::{Context, Result};
use codegen::{Plan, fmt_bytes};
use runtime::launch::{Event, LaunchError, StepReport};

use super::common;
use super::run::RunArgs;

/// What the reporter needs of the job (the job itself moves into the launcher).
pub struct Info {
    /// The plan (for its name, mesh, choice and estimates).
    pub plan: Plan,
    /// Ranks.
    pub ranks: usize,
    /// Global batch (samples per step).
    pub batch: usize,
    /// Kernel threads per rank.
    pub threads_per_rank: usize,
    /// The dataset: its line ([`super::data::describe`]) and the bytes of one step's batch.
    pub data: Option<(String, u64)>,
    /// Tokens in a sample, for a language model (throughput is also given in tokens/s).
    pub tokens_per_sample: Option<usize>,
}

/// Prints the run for people (progress bar on a terminal, a line per step otherwise) or as JSON
/// lines, and the summary at the end.
pub struct Reporter<'a> {
    a: &'a RunArgs,
    info: Info,
    ranks: usize,
    batch: f64,
    pub(crate) bar: Option<indicatif::ProgressBar>,
    reports: Vec<StepReport>,
    print_err: Option<std::io::Error>,
}

impl<'a> Reporter<'a> {
    /// Prints the header (unless `--json`) and starts the progress bar (on a terminal).
    pub fn new(a: &'a RunArgs, p: Info, start: u64, how: &str, source_note: &str) -> Result<Reporter<'a>> {
        let (plan, n) = (&p.plan, p.ranks);
        let est = &plan.estimate;
        if !a.json {
            let mut out = std::io::stdout().lock();
            writeln!(
                out,
                "running {} on mesh {} ({n} ranks {how}, {} kernel thread(s) each), steps {}..{}; {source_note}",
                plan.model.name,
                plan.mesh.shape.iter().map(|s| s.to_string()).collect::<Vec<_>>().join("x"),
                p.threads_per_rank,
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
            if let Some((line, _)) = &p.data {
                writeln!(out, "{line}")?;
            }
            if a.precision == Some(common::Precision::F64) {
                writeln!(out, "precision: f64 (every float twice as wide as the plan's f32 estimates)")?;
            } else if plan.options.precision.is_mixed() {
                writeln!(
                    out,
                    "precision: {} mixed (16-bit values stored on CPU ranks, computed in f32; f32 parameters)",
                    plan.options.precision
                )?;
            }
        }
        let bar = common::step_bar(a.steps - start, a.json);
        let batch = p.batch as f64;
        Ok(Reporter { a, info: p, ranks: n, batch, bar, reports: vec![], print_err: None })
    }

    /// The plan the run executes.
    pub fn plan(&self) -> &Plan {
        &self.info.plan
    }

    /// Prints a step.
    pub fn step(&mut self, r: &StepReport) {
        // Throughput over the whole step: reading its data, then running it.
        let sps = self.batch / (r.seconds + r.data_seconds).max(1e-12);
        let comm = r.comm_seconds.iter().copied().fold(0.0, f64::max);
        let line = if self.a.json {
            let mut line = serde_json::json!({
                "step": r.step, "loss": r.loss, "ms": r.seconds * 1e3, "samples_per_s": sps,
                "comm_ms": comm * 1e3, "peak_bytes": r.peak_bytes.iter().max(),
                "checkpoint": r.checkpoint.as_ref().map(|p| p.display().to_string()),
            });
            if let Some(t) = self.info.tokens_per_sample {
                line["tokens_per_s"] = serde_json::json!(sps * t as f64);
            }
            if self.info.data.is_some() {
                line["data_ms"] = serde_json::json!(r.data_seconds * 1e3);
            }
            // The plan's learning-rate schedule and gradient clipping, when it has them.
            for (key, v) in [("lr", r.lr), ("grad_norm", r.grad_norm)] {
                if let Some(v) = v {
                    line[key] = v.into();
                }
            }
            if let Some(l) = r.eval_loss {
                line["eval_loss"] = serde_json::json!(l);
            }
            line.to_string()
        } else {
            let metrics = r.lr.map(|x| format!("  lr {x:.4e}")).unwrap_or_default()
                + &r.grad_norm.map(|x| format!("  grad norm {x:.6}")).unwrap_or_default();
            format!(
                "step {:>4}  loss {:<12.8}  {:>8.1} ms  {:>8.1} samples/s  collectives {:>6.1} ms{metrics}{}{}",
                r.step,
                r.loss,
                r.seconds * 1e3,
                sps,
                comm * 1e3,
                r.eval_loss.map(|l| format!("  eval loss {l:.8}")).unwrap_or_default(),
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

    /// Prints the summary.
    pub fn finish(&mut self) -> Result<()> {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
        if let Some(e) = self.print_err.take() {
            return Err(e.into());
        }
        let (n, est, reports) = (self.ranks, &self.info.plan.estimate, &self.reports);
        let mut out = std::io::stdout().lock();
        let peaks: Vec<u64> = (0..n).map(|r| reports.iter().map(|x| x.peak_bytes[r]).max().unwrap_or(0)).collect();
        let max_peak = peaks.iter().copied().max().unwrap_or(0);
        // The plan estimates f32 tensors; in f64 every float is twice as wide.
        let wide = if self.a.precision == Some(common::Precision::F64) { 2 } else { 1 };
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
            let mut line = serde_json::json!({
                "summary": true, "median_ms": median * 1e3, "comm_ms": comm * 1e3,
                "measured_peak_bytes": peaks, "estimated_peak_bytes": est.peak_bytes_per_rank,
                "precision": if wide == 2 { "f64" } else { self.info.plan.options.precision.name() },
                "estimated_step_ms": est.step_seconds * 1e3,
            });
            if let (Some((_, per_step)), Some(last)) = (&self.info.data, reports.last()) {
                line["data_ms"] = serde_json::json!(median_of(reports.iter().map(|r| r.data_seconds)) * 1e3);
                line["data_bytes_read"] = serde_json::json!(last.data_bytes);
                line["data_bytes_of_batches"] = serde_json::json!(per_step * reports.len() as u64);
            }
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
            if let (Some((_, per_step)), Some(last)) = (&self.info.data, reports.last()) {
                // What each rank read against the bytes of the batches the run went through.
                let total = per_step * reports.len() as u64;
                let shares: Vec<String> = last
                    .data_bytes
                    .iter()
                    .map(|&b| format!("{} ({:.1}%)", fmt_bytes(b), 100.0 * b as f64 / total.max(1) as f64))
                    .collect();
                let ms = median_of(reports.iter().map(|r| r.data_seconds)) * 1e3;
                writeln!(
                    out,
                    "data read per rank: {} of the {} in this run's batches; reading {ms:.2} ms per step (median, slowest rank; {:.1}% of a step)",
                    shares.join(", "),
                    fmt_bytes(total),
                    100.0 * ms / (median * 1e3).max(1e-12)
                )?;
            }
        }
        Ok(())
    }
}

/// The median of some seconds (0 for none).
fn median_of(v: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = v.collect();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// What to say when the model cannot be used.
const RANDOM_HINT: &str = "pass --init random --seed N to train from random weights instead";

/// A launch error with what to do about it, in this command's flags.
pub fn explain(e: LaunchError) -> anyhow::Error {
    let hint = match &e {
        LaunchError::MissingData { .. } => {
            format!("pass --init auto to initialise the others from --seed, or {RANDOM_HINT}")
        }
        LaunchError::MissingExternal { .. } => RANDOM_HINT.to_string(),
        LaunchError::ModelChanged { .. } => format!("plan again, or {RANDOM_HINT}"),
        LaunchError::NoModel | LaunchError::ModelGone(_) => format!("pass --model MODEL.onnx, or {RANDOM_HINT}"),
        _ => return e.into(),
    };
    anyhow::anyhow!("{e}; {hint}")
}

/// The reporter as the launcher's events call it: it starts with the run, taking the job's
/// `info` (which the MPI launcher's setup fills in).
pub fn on_event<'a>(
    a: &'a RunArgs,
    info: &RefCell<Option<Info>>,
    rep: &mut Option<Reporter<'a>>,
    e: Event<'_>,
) -> Result<(), String> {
    match e {
        Event::Warning(w) => eprintln!("warning: {w}"),
        Event::Started { start, how, source } => {
            let i = info.borrow_mut().take().ok_or("the run started before its setup")?;
            *rep = Some(Reporter::new(a, i, start, &how, &source).map_err(|e| format!("{e:#}"))?);
        }
        Event::Step(r) => {
            if let Some(rep) = rep.as_mut() {
                rep.step(r);
            }
        }
    }
    Ok(())
}

/// Writes `--save DIR/params.npz` and `DIR/model.safetensors`, and `DIR/names.json` (the
/// PyTorch names) when the model file `model` is known.
pub fn save_params(a: &RunArgs, params: &BTreeMap<String, ir::Tensor>, model: Option<&std::path::Path>) -> Result<()> {
    let Some(dir) = &a.save else { return Ok(()) };
    common::check_finite_params(params).with_context(|| format!("--save {}", dir.display()))?;
    // Written into a staging directory that replaces DIR whole.
    let staged = runtime::outputs::SaveDir::new(dir).with_context(|| format!("--save {}", dir.display()))?;
    let (file, st) = (dir.join("params.npz"), dir.join("model.safetensors"));
    runtime::npy::write_npz(&staged.path().join("params.npz"), params)
        .with_context(|| format!("--save {}", file.display()))?;
    runtime::weights::write_safetensors(
        &staged.path().join("model.safetensors"),
        params,
        &runtime::weights::metadata(),
    )
    .with_context(|| format!("--save {}", st.display()))?;
    let named = match model {
        Some(m) => Some(common::write_torch_names(m, staged.path(), params)?),
        None => None,
    };
    staged.commit().with_context(|| format!("--save {}", dir.display()))?;
    if !a.json {
        println!("saved the parameters ({} tensors) to {} and {}", params.len(), file.display(), st.display());
        if let Some(n) = named {
            println!(
                "wrote their PyTorch names ({n} of {} found in the model file) to {}",
                params.len(),
                dir.join("names.json").display()
            );
        }
    }
    Ok(())
}
