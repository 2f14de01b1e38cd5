//! Solves IOPDDL instances and prints cost against the best known.
//!
//! `cargo run --release -p solver --example iopddl -- [DIR] [SECONDS] [THREADS] [INSTANCES]`
//! (defaults: `../shared/iopddl`, 60 s, all cores, `BGKPV`).

use std::time::Duration;

use solver::{Problem, SolveOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir = args.first().cloned().unwrap_or("../shared/iopddl".into());
    let secs: f64 = args.get(1).map_or(Ok(60.0), |s| s.parse())?;
    let threads: usize = args.get(2).map_or(Ok(2), |s| s.parse())?;
    let which = args.get(3).cloned().unwrap_or("BGKPV".into());
    let best = [('B', 532_843u128), ('G', 217_039), ('K', 2_274_276_676), ('P', 651_833_115_436), ('V', 1_632_051)];
    for (name, best) in best {
        if !which.contains(name) {
            continue;
        }
        let path = format!("{dir}/asplos-2025-iopddl-{name}.json.gz");
        let p = Problem::read(&path)?;
        let opts = SolveOptions {
            time_limit: Duration::from_secs_f64(secs),
            threads,
            reduce: std::env::var_os("NO_REDUCE").is_none(),
            method: match std::env::var("METHOD").as_deref() {
                Ok("ilp") => solver::Method::Ilp,
                Ok("search") => solver::Method::Search,
                _ => solver::Method::Auto,
            },
            ilp_max_vars: std::env::var("ILP_MAX").map_or(300_000, |v| v.parse().unwrap_or(0)),
            ..SolveOptions::default()
        };
        let r = solver::solve(&p, &opts)?;
        if let Ok(dir) = std::env::var("OUT") {
            solver::write_solution(format!("{dir}/{name}.json"), &r.solution)?;
        }
        println!(
            "{name}: cost {} best {best} ratio {:.4} bound {} time {:.1}s {:?} via {} ({:?})",
            r.cost,
            r.cost as f64 / best as f64,
            r.lower_bound,
            r.elapsed.as_secs_f64(),
            r.status,
            r.method,
            r.reduction
        );
    }
    Ok(())
}
