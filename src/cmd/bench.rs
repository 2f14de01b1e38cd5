//! `autopar bench`: measures plans' steps head to head.
//!
//! Plans measured one after another in separate runs meet this machine in different states: a
//! shared machine's speed moves by several percent from one second to the next, as much as two
//! plans of one model differ. Here every plan's ranks are set up in one process and the plans take
//! turns (`runtime::launch::threads_in_turns`): each turn runs a few steps of every plan, and the
//! first step of a plan's turn, run with the previous plan's data in the caches, is left out. A
//! plan's measured step is the median over the turns of its turn's median step; beside it, the
//! median over the turns of its step against the fastest plan's in the same turn.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use runtime::launch::{Init, Job, RunOptions, Turn};
use runtime::program::Program;

use super::common;
use super::run_report::explain;

/// Arguments of `autopar bench`.
#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// Plans written by `autopar plan`, with the same number of ranks (typically one model's plans
    /// under different strategies).
    #[arg(required = true, num_args = 1..)]
    pub plans: Vec<PathBuf>,
    /// Feed the global batch of an input from a .npy file: `NAME=FILE.npy` (model inputs and the
    /// loss's targets or labels), the same for every plan and step.
    #[arg(long = "feed", value_name = "NAME=FILE.npy")]
    pub feeds: Vec<String>,
    /// Turns: each runs every plan's steps, one plan after another (each turn starts with the next
    /// plan, so no plan always follows the same one).
    #[arg(long, default_value = "10", value_parser = parse_turns)]
    pub turns: usize,
    /// Seconds of steps of each plan in a turn, by the plan's estimated step (at least
    /// --min-steps steps, at most 10000).
    #[arg(long, default_value = "0.2", value_parser = parse_turn_seconds)]
    pub seconds: f64,
    /// Fewest steps of a plan in a turn (its first is left out as the warm-up after another plan).
    #[arg(long, default_value = "3", value_parser = parse_min_steps)]
    pub min_steps: u64,
    /// Parameters: `model` (every one from the plan's ONNX file), `auto` (from the file where it
    /// has data, the rest from --seed) or `random` (every one from --seed; the file is not read).
    #[arg(long, default_value = "model", value_parser = ["model", "auto", "random"])]
    pub init: String,
    /// Seed of the parameters without data (`--init auto`) or of every one (`--init random`).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Kernel threads per rank.
    #[arg(long, default_value = "1", value_parser = common::parse_threads)]
    pub threads_per_rank: usize,
    /// One JSON object per plan: `{"plan","estimated_step_ms","median_ms","turns_ms",...}`.
    #[arg(long)]
    pub json: bool,
}

fn parse_turns(s: &str) -> Result<usize, String> {
    common::parse_int_in(s, 1, 10_000).map(|v| v as usize)
}

fn parse_min_steps(s: &str) -> Result<u64, String> {
    common::parse_int_in(s, 2, 10_000)
}

fn parse_turn_seconds(s: &str) -> Result<f64, String> {
    let v: f64 = s.trim().parse().map_err(|_| "not a number of seconds".to_string())?;
    if !(v > 0.0 && v <= 3600.0) {
        return Err("out of range (more than 0, at most 3600 seconds)".into());
    }
    Ok(v)
}

/// One plan's measurement.
struct Measured {
    estimate: f64,
    steps_per_turn: u64,
    /// Median step of each turn (seconds), its first step left out.
    turns: Vec<f64>,
}

/// The upper median, as `autopar run` reports its steps' (0 for none).
fn median(v: &[f64]) -> f64 {
    profiler::calibrate::median(&mut v.to_vec())
}

/// The job of one plan, and its estimated step (seconds).
fn job(
    a: &BenchArgs,
    path: &std::path::Path,
    feeds: &std::collections::BTreeMap<String, ir::Tensor>,
) -> Result<(Job, f64)> {
    let valid = common::read_valid_plan(path)?;
    let program = Program::from_valid(&valid, ir::DType::F32).with_context(|| path.display().to_string())?;
    let plan = valid.into_plan();
    let init = if a.init == "random" {
        Init::Seed { seed: a.seed }
    } else {
        let model = runtime::launch::model_file(&plan, path.parent().unwrap_or(std::path::Path::new("")))
            .map_err(|e| explain(e).context(path.display().to_string()))?;
        Init::Model {
            path: model,
            open: common::open_onnx_params,
            all: a.init == "model",
            seed: a.seed,
            hash: plan.model.source_hash.clone(),
        }
    };
    let opts = RunOptions { threads_per_rank: a.threads_per_rank, ..RunOptions::default() };
    let estimate = plan.estimate.step_seconds;
    Ok((Job { program, feeds: feeds.clone(), init, opts, gather: false }, estimate))
}

/// Runs `autopar bench`.
pub fn run(a: &BenchArgs) -> Result<()> {
    let feeds = common::read_feeds(&a.feeds)?;
    let mut jobs = vec![];
    let mut measured = vec![];
    for p in &a.plans {
        let (j, estimate) = job(a, p, &feeds)?;
        let steps = if estimate > 0.0 {
            ((a.seconds / estimate).round() as u64).clamp(a.min_steps, 10_000)
        } else {
            eprintln!("warning: {} has no estimated step time; it runs --min-steps steps a turn", p.display());
            a.min_steps
        };
        measured.push(Measured { estimate, steps_per_turn: steps, turns: vec![] });
        jobs.push(j);
    }
    let ranks = jobs[0].program.ranks();
    if let Some((k, j)) = jobs.iter().enumerate().find(|(_, j)| j.program.ranks() != ranks) {
        bail!(
            "{} runs on {} ranks and {} on {ranks}: plans measured together run on the same ranks",
            a.plans[k].display(),
            j.program.ranks(),
            a.plans[0].display()
        );
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if ranks * a.threads_per_rank > cores {
        eprintln!(
            "warning: {ranks} ranks x {} kernel thread(s) on {cores} cores: the ranks take turns on the cores",
            a.threads_per_rank
        );
    }
    if !a.json {
        println!(
            "bench     {} plan(s) on {ranks} rank(s) as threads, {} turn(s); each turn runs every plan's steps, one \
             plan after another (the first step of each left out)",
            a.plans.len(),
            a.turns
        );
    }
    let steps: Vec<u64> = measured.iter().map(|m| m.steps_per_turn).collect();
    let total: u64 = steps.iter().sum::<u64>() * a.turns as u64;
    let bar = common::step_bar(total, a.json);
    let mut current: Vec<Vec<f64>> = vec![vec![]; jobs.len()];
    let turns = a.turns;
    let done = runtime::launch::threads_in_turns(
        &jobs,
        &steps,
        turns,
        &mut |w| eprintln!("warning: {w}"),
        &mut |t: Turn, r| {
            if let Some(b) = &bar {
                b.inc(1);
                b.set_message(format!("turn {} of {turns}", t.turn + 1));
            }
            if !t.first {
                current[t.job].push(r.seconds);
            }
            if t.last {
                if !current[t.job].is_empty() {
                    measured[t.job].turns.push(median(&current[t.job]));
                }
                current[t.job].clear();
            }
        },
    );
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    if let Err(e) = done {
        let plan = e.job.and_then(|j| a.plans.get(j)).map(|p| p.display().to_string());
        let e = explain(e.error);
        return Err(match plan {
            Some(p) => e.context(p),
            None => e,
        });
    }
    print(a, &measured)
}

fn print(a: &BenchArgs, measured: &[Measured]) -> Result<()> {
    let medians: Vec<f64> = measured.iter().map(|m| median(&m.turns)).collect();
    let fastest = medians.iter().copied().fold(f64::INFINITY, f64::min);
    // Per turn, each plan against the fastest plan of that turn.
    let paired = |k: usize| {
        let ratios: Vec<f64> = (0..a.turns)
            .filter_map(|t| {
                let best = measured.iter().map(|m| m.turns.get(t).copied()).collect::<Option<Vec<f64>>>()?;
                Some(measured[k].turns[t] / best.into_iter().fold(f64::INFINITY, f64::min))
            })
            .collect();
        median(&ratios)
    };
    if a.json {
        for (k, m) in measured.iter().enumerate() {
            let line = serde_json::json!({
                "plan": a.plans[k].display().to_string(),
                "estimated_step_ms": m.estimate * 1e3,
                "median_ms": medians[k] * 1e3,
                "turns_ms": m.turns.iter().map(|s| s * 1e3).collect::<Vec<_>>(),
                "steps_per_turn": m.steps_per_turn,
                "vs_fastest": medians[k] / fastest,
                "vs_fastest_paired": paired(k),
            });
            println!("{line}");
        }
        return Ok(());
    }
    let width = a.plans.iter().map(|p| p.display().to_string().len()).max().unwrap_or(4).max(4);
    println!(
        "{:width$}  {:>12}  {:>12}  {:>8}  {:>10}  {:>8}  steps/turn",
        "plan", "estimated", "measured", "error", "vs fastest", "paired"
    );
    for (k, m) in measured.iter().enumerate() {
        println!(
            "{:width$}  {:>9.3} ms  {:>9.3} ms  {:>+7.1}%  {:>+9.1}%  {:>+7.1}%  {}",
            a.plans[k].display(),
            m.estimate * 1e3,
            medians[k] * 1e3,
            100.0 * (m.estimate - medians[k]) / medians[k],
            100.0 * (medians[k] / fastest - 1.0),
            100.0 * (paired(k) - 1.0),
            m.steps_per_turn
        );
    }
    println!(
        "          measured: the median over the turns of each turn's median step; paired: the median over the turns \
         of the plan's step against the turn's fastest"
    );
    Ok(())
}
