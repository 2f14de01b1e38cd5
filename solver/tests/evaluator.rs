//! Pins the IOPDDL cost and feasibility semantics: half-open intervals, row-major edge costs,
//! over-limit solutions, and the reader's handling of malformed files.

use solver::{Edge, Error, Node, Problem};

fn data(name: &str) -> String {
    format!("{}/tests/data/{name}", env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn example_costs_and_feasibility() {
    let p = Problem::read(data("example.json")).unwrap();
    assert_eq!(p.nodes.len(), 5);
    assert_eq!(p.edges.len(), 5);
    assert_eq!(p.usage_limit, Some(50));
    // [0, 0, 1, 0, 0]: node costs 15+55+45+85+95 = 295; edge costs 30 (0-1 at 0*2+0) + 10 (0-2 at
    // 0*3+1) + 90 (1-3 at 0*2+0) + 20 (2-4 at 1*1+0) + 70 (3-4 at 0) = 220. Live at t in [50, 70):
    // nodes 0, 1, 2 with usages 10 + 25 + 20 = 55 > 50: over the limit from t = 50.
    let ev = p.evaluate(&[0, 0, 1, 0, 0]).unwrap();
    assert_eq!(ev.cost, 515);
    assert_eq!((ev.peak_usage, ev.peak_time), (55, 50));
    assert_eq!(ev.first_violation, Some(50));
    assert!(!ev.feasible());
    // All zeros: 275 + 300, peak exactly at the limit (50 at t = 50) is feasible.
    let ev = p.evaluate(&[0, 0, 0, 0, 0]).unwrap();
    assert_eq!(ev.cost, 575);
    assert_eq!((ev.peak_usage, ev.peak_time), (50, 50));
    assert!(ev.feasible());
    // The optimum (by brute force, cross-checked by hand in Python): [0, 0, 2, 1, 0] costing 445.
    let ev = p.evaluate(&[0, 0, 2, 1, 0]).unwrap();
    assert_eq!(ev.cost, 445);
    assert!(ev.feasible());
}

#[test]
fn example_best_is_brute_force_optimum() {
    let p = Problem::read(data("example.json")).unwrap();
    let (x, cost) = solver::brute_force(&p).unwrap().unwrap();
    let ev = p.evaluate(&x).unwrap();
    assert!(ev.feasible());
    assert_eq!(ev.cost, cost);
    let r = solver::solve(&p, &solver::SolveOptions::default()).unwrap();
    assert_eq!(r.cost, cost);
    assert_eq!(cost, 445);
    assert_eq!(r.status, solver::Status::Optimal);
}

fn two_nodes(iv0: (u64, u64), iv1: (u64, u64), limit: u64) -> Problem {
    Problem {
        name: "hand".into(),
        nodes: vec![Node::new(iv0, vec![1, 2], vec![5, 1]), Node::new(iv1, vec![10, 20, 30], vec![3, 3, 3])],
        // Row-major over (s0, s1): index = s0 * 3 + s1.
        edges: vec![Edge { nodes: (0, 1), costs: vec![100, 200, 300, 400, 500, 600].into() }],
        usage_limit: Some(limit),
    }
}

#[test]
fn edge_index_is_row_major() {
    let p = two_nodes((0, 1), (1, 2), 100);
    for s0 in 0..2 {
        for s1 in 0..3 {
            let ev = p.evaluate(&[s0, s1]).unwrap();
            let node = [1, 2][s0] + [10, 20, 30][s1];
            let edge = 100 * (s0 as u128 * 3 + s1 as u128 + 1);
            assert_eq!(ev.cost, node + edge, "s0={s0} s1={s1}");
        }
    }
}

#[test]
fn intervals_are_half_open() {
    // [0,5) and [5,9) never overlap: peak is the larger single usage.
    let p = two_nodes((0, 5), (5, 9), 5);
    let ev = p.evaluate(&[0, 0]).unwrap();
    assert_eq!(ev.peak_usage, 5);
    assert!(ev.feasible());
    // [0,6) and [5,9) overlap at t = 5 only.
    let p = two_nodes((0, 6), (5, 9), 5);
    let ev = p.evaluate(&[0, 0]).unwrap();
    assert_eq!(ev.peak_usage, 8);
    assert_eq!(ev.peak_time, 5);
    assert_eq!(ev.first_violation, Some(5));
    assert!(!ev.feasible());
    // The smaller usage fits.
    assert!(p.evaluate(&[1, 0]).unwrap().feasible());
    // An empty interval [3,3) is never live.
    let p = two_nodes((3, 3), (0, 9), 3);
    assert_eq!(p.evaluate(&[0, 0]).unwrap().peak_usage, 3);
}

#[test]
fn over_limit_solution_is_reported_not_rejected() {
    let p = two_nodes((0, 6), (5, 9), 5);
    let ev = p.evaluate(&[0, 2]).unwrap();
    assert_eq!(ev.cost, 1 + 30 + 300);
    assert!(!ev.feasible());
    // The solver avoids it: node 0 must take strategy 1.
    let r = solver::solve(&p, &solver::SolveOptions::default()).unwrap();
    assert_eq!(r.solution[0], 1);
    assert!(r.evaluation.feasible());
}

#[test]
fn bad_solutions_are_errors() {
    let p = two_nodes((0, 1), (1, 2), 100);
    assert!(matches!(p.evaluate(&[0]), Err(Error::InvalidSolution(_))));
    assert!(matches!(p.evaluate(&[0, 3]), Err(Error::InvalidSolution(_))));
}

#[test]
fn infeasible_problem_names_min_peak_and_time() {
    let p = two_nodes((0, 6), (5, 9), 3);
    let err = solver::solve(&p, &solver::SolveOptions::default()).unwrap_err();
    match &err {
        Error::Infeasible { min_peak, time, limit } => {
            assert_eq!((*min_peak, *time, *limit), (4, 5, 3));
        }
        e => panic!("unexpected {e}"),
    }
    assert!(err.is_user_error());
    let msg = err.to_string();
    assert!(msg.contains("minimum possible peak usage is 4 at time step 5"), "{msg}");
}

#[test]
fn malformed_files_give_one_line_errors() {
    let cases: &[&[u8]] = &[
        b"",
        b"{",
        b"{\"problem\": {}}",
        b"{\"problem\": {\"nodes\": {\"intervals\": [[0, 1]], \"costs\": [[1]], \"usages\": []}}}",
        b"{\"problem\": {\"nodes\": {\"intervals\": [[2, 1]], \"costs\": [[1]], \"usages\": [[1]]}}}",
        b"{\"problem\": {\"nodes\": {\"intervals\": [[0, 1]], \"costs\": [[]], \"usages\": [[]]}}}",
        b"{\"problem\": {\"nodes\": {\"intervals\": [[0, 1]], \"costs\": [[1]], \"usages\": [[1]]},
            \"edges\": {\"nodes\": [[0, 7]], \"costs\": [[1]]}}}",
        b"{\"problem\": {\"nodes\": {\"intervals\": [[0, 1]], \"costs\": [[1, 2]], \"usages\": [[1, 1]]},
            \"edges\": {\"nodes\": [[0, 0]], \"costs\": [[1, 2, 3]]}}}",
        b"{\"problem\": {\"nodes\": {\"intervals\": [[-1, 1]], \"costs\": [[1]], \"usages\": [[1]]}}}",
    ];
    for c in cases {
        let e = Problem::from_json_bytes(c).unwrap_err();
        let msg = e.to_string();
        assert!(!msg.contains('\n'), "one line: {msg}");
        assert!(e.is_user_error());
    }
    let e = Problem::read(data("does-not-exist.json")).unwrap_err();
    assert!(matches!(e, Error::Io { .. }));
}

#[test]
fn json_round_trip() {
    let p = Problem::read(data("example.json")).unwrap();
    let q = Problem::from_json_bytes(p.to_json().as_bytes()).unwrap();
    assert_eq!(p, q);
    let dir = std::env::temp_dir().join(format!("solver-rt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("p.json.gz");
    p.write(&path).unwrap();
    assert_eq!(Problem::read(&path).unwrap(), p);
    std::fs::remove_dir_all(&dir).ok();
}

// Fuzzing the reader: truncations, byte flips and random bytes never panic, and every error is
// one line.
proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 256, ..Default::default() })]
    #[test]
    fn reader_never_panics(cut in 0usize..2000, flips in proptest::collection::vec((0usize..2000, 0u8..=255), 0..6),
                           noise in proptest::collection::vec(0u8..=255, 0..64)) {
        let text = std::fs::read(data("example.json")).unwrap();
        let mut bytes = text[..cut.min(text.len())].to_vec();
        for (at, b) in flips {
            if !bytes.is_empty() {
                let i = at % bytes.len();
                bytes[i] = b;
            }
        }
        bytes.extend(noise);
        if let Err(e) = Problem::from_json_bytes(&bytes) {
            proptest::prop_assert!(!e.to_string().contains('\n'), "{}", e);
        }
    }
}
