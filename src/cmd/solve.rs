//! `autopar solve`: solve (or check a solution of) a sharding cost-graph problem in the IOPDDL
//! JSON format.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use solver::{Method, Problem, SolveOptions};

/// Arguments of `autopar solve`.
///
/// Reads PROBLEM (IOPDDL JSON, optionally gzipped), picks one strategy per node minimising node
/// plus edge costs under the memory limit, and prints cost, feasibility, lower bound, gap and time.
/// Small problems are solved exactly with an ILP (CBC); large ones with a parallel anytime search
/// that returns its best solution at the time limit (status TimeLimit, with the gap to a bound).
///
/// Example: autopar solve asplos-2025-iopddl-B.json.gz --time-limit 60 --out solution.json
#[derive(clap::Args, Debug)]
pub struct SolveArgs {
    /// Problem file in the IOPDDL format (`.json` or `.json.gz`).
    #[arg(value_name = "PROBLEM")]
    pub problem: PathBuf,

    /// Wall-clock budget in seconds; the best solution found by then is returned.
    #[arg(long, value_name = "SECONDS", default_value = "60", value_parser = super::common::parse_seconds)]
    pub time_limit: Duration,

    /// Write the solution as a JSON list of strategy indices, one per node.
    #[arg(long, short = 'o', value_name = "SOLUTION.json")]
    pub out: Option<PathBuf>,

    /// Search threads (default: all cores).
    #[arg(long, value_name = "N", value_parser = super::common::parse_threads)]
    pub threads: Option<usize>,

    /// Algorithm: `auto` (exact ILP when small enough, otherwise search), `ilp` or `search`.
    #[arg(long, value_name = "METHOD", default_value = "auto", value_parser = ["auto", "ilp", "search"])]
    pub method: String,

    /// Random seed of the search (runs are repeatable up to timing).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Skip the optimum-preserving reductions (for comparison).
    #[arg(long)]
    pub no_reduce: bool,

    /// Do not solve: evaluate this solution file (a JSON list of strategy indices) instead.
    #[arg(long, value_name = "SOLUTION.json", conflicts_with = "out")]
    pub check: Option<PathBuf>,

    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// A number for JSON: exact when it fits in u64.
fn num(x: u128) -> serde_json::Value {
    match u64::try_from(x) {
        Ok(v) => v.into(),
        Err(_) => (x as f64).into(),
    }
}

/// Runs `autopar solve`.
pub fn run(a: &SolveArgs) -> Result<()> {
    let problem = Problem::read(&a.problem)?;
    let limit = problem.usage_limit.map_or("none".to_string(), |l| l.to_string());

    if let Some(path) = &a.check {
        let sol = solver::read_solution(path)?;
        let ev = problem.evaluate(&sol).with_context(|| format!("checking {}", path.display()))?;
        if a.json {
            let v = serde_json::json!({
                "problem": problem.name,
                "cost": num(ev.cost),
                "feasible": ev.feasible(),
                "peak_usage": num(ev.peak_usage),
                "peak_time": ev.peak_time,
                "first_violation": ev.first_violation,
                "usage_limit": problem.usage_limit,
            });
            println!("{v}");
        } else {
            println!("problem   {}", problem.name);
            println!("cost      {}", ev.cost);
            match ev.first_violation {
                None => println!("feasible  yes (peak usage {} at t={}, limit {limit})", ev.peak_usage, ev.peak_time),
                Some(t) => println!(
                    "feasible  NO: usage exceeds the limit {limit} first at t={t} (peak {} at t={})",
                    ev.peak_usage, ev.peak_time
                ),
            }
        }
        return Ok(());
    }

    let opts = SolveOptions {
        time_limit: a.time_limit,
        threads: a.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
        seed: a.seed,
        method: match a.method.as_str() {
            "ilp" => Method::Ilp,
            "search" => Method::Search,
            _ => Method::Auto,
        },
        reduce: !a.no_reduce,
        ..SolveOptions::default()
    };
    tracing::info!(problem = %a.problem.display(), nodes = problem.nodes.len(), edges = problem.edges.len(), "solving");
    let r = solver::solve(&problem, &opts)?;
    if let Some(out) = &a.out {
        solver::write_solution(out, &r.solution)?;
    }
    let status = format!("{:?}", r.status);
    if a.json {
        let v = serde_json::json!({
            "problem": problem.name,
            "nodes": problem.nodes.len(),
            "edges": problem.edges.len(),
            "status": status,
            "cost": num(r.cost),
            "lower_bound": num(r.lower_bound),
            "gap": r.gap(),
            "feasible": r.evaluation.feasible(),
            "peak_usage": num(r.evaluation.peak_usage),
            "peak_time": r.evaluation.peak_time,
            "usage_limit": problem.usage_limit,
            "time_s": r.elapsed.as_secs_f64(),
            "method": r.method,
            "out": a.out,
        });
        println!("{v}");
    } else {
        println!(
            "problem   {} ({} nodes, {} edges, usage limit {limit})",
            problem.name,
            problem.nodes.len(),
            problem.edges.len()
        );
        println!("status    {status} (via {})", r.method);
        println!("cost      {}", r.cost);
        println!("bound     {} (gap {:.2}%)", r.lower_bound, 100.0 * r.gap());
        println!("feasible  yes (peak usage {} at t={})", r.evaluation.peak_usage, r.evaluation.peak_time);
        println!("time      {:.2} s", r.elapsed.as_secs_f64());
        if let Some(out) = &a.out {
            println!("solution  {}", out.display());
        }
    }
    Ok(())
}
