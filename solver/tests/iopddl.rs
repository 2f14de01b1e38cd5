//! Solves the IOPDDL instances B and G (copies in tests/data) and checks feasibility and a cost
//! bound of 1.5x the best known, to catch regressions. The exact ILP usually proves optimality.

use std::time::Duration;

use solver::{Problem, SolveOptions};

fn check(name: &str, best_known: u128, seconds: u64) {
    let path = format!("{}/tests/data/asplos-2025-iopddl-{name}.json.gz", env!("CARGO_MANIFEST_DIR"));
    let p = Problem::read(&path).unwrap();
    let opts = SolveOptions { time_limit: Duration::from_secs(seconds), ..SolveOptions::default() };
    let r = solver::solve(&p, &opts).unwrap();
    let ev = p.evaluate(&r.solution).unwrap();
    assert!(ev.feasible(), "{name}: infeasible at {:?}", ev.first_violation);
    assert_eq!(ev.cost, r.cost);
    assert!(r.lower_bound <= r.cost);
    let ratio = r.cost as f64 / best_known as f64;
    eprintln!("{name}: cost {} ratio {ratio:.4} status {:?} in {:?}", r.cost, r.status, r.elapsed);
    assert!(ratio <= 1.5, "{name}: cost {} is {ratio:.3}x the best known {best_known}", r.cost);
}

#[test]
fn iopddl_b() {
    check("B", 532_843, 30);
}

#[test]
fn iopddl_g() {
    check("G", 217_039, 30);
}
