//! The executor and the `threads` launcher on committed plans (`tests/data`, see its NOTICE),
//! without the planner: events in order, deterministic steps, checkpoints resumed bit-exactly,
//! failures stopping every rank with the failing rank's error, invalid plans refused before any
//! rank starts.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ir::{DType, Tensor};
use runtime::launch::{CheckpointOptions, Event, Fault, Init, Job, LaunchError, RunOptions, StepReport};
use runtime::{DistError, Program};

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(name)
}

fn load(name: &str) -> plan::Valid {
    plan::Valid::from_json(&std::fs::read_to_string(data(name)).unwrap()).unwrap()
}

/// A job of `plan` from seeded parameters, with a batch of small deterministic values (token
/// ids in range for the GPT).
fn job(plan: &plan::Valid, opts: RunOptions, init: Init) -> Job {
    let program = Program::from_valid(plan, DType::F32).unwrap();
    let feeds: BTreeMap<String, Tensor> = program
        .inputs
        .iter()
        .map(|i| {
            let n = i.meta.numel();
            let t = match i.meta.dtype {
                DType::I64 => Tensor::i64(i.meta.shape.clone(), (0..n).map(|k| (k % 7) as i64).collect()),
                _ => Tensor::f32(i.meta.shape.clone(), (0..n).map(|k| ((k % 13) as f32 - 6.0) / 8.0).collect()),
            };
            (i.name.clone(), t)
        })
        .collect();
    Job { program, feeds, init, opts, gather: true }
}

/// Runs `job` on threads; returns the events as text and the step reports.
fn run(job: &Job) -> (Result<runtime::launch::Finished, LaunchError>, Vec<String>, Vec<StepReport>) {
    let (mut events, mut steps) = (vec![], vec![]);
    let r = runtime::launch::threads(job, &mut |e| {
        match e {
            Event::Warning(w) => events.push(format!("warning {w}")),
            Event::Started { start, how, .. } => events.push(format!("started {start} {how}")),
            Event::Step(s) => {
                events.push(format!("step {}", s.step));
                steps.push(s.clone());
            }
        }
        Ok(())
    });
    (r, events, steps)
}

fn opts(until_step: u64) -> RunOptions {
    RunOptions { until_step, timeout: std::time::Duration::from_secs(60), ..Default::default() }
}

#[test]
fn threads_run_a_plan_and_report_every_step_in_order() {
    for name in ["mlp_sgd_mesh2.json", "gpt_tiny_adamw_2x2.json"] {
        let plan = load(name);
        let j = job(&plan, opts(3), Init::Seed { seed: 1 });
        let (r, events, steps) = run(&j);
        let done = r.unwrap();
        assert_eq!(events, ["started 0 as threads", "step 1", "step 2", "step 3"], "{name}");
        assert!(steps.iter().all(|s| s.loss.is_finite() && s.peak_bytes.len() == j.program.ranks()), "{name}");
        assert_eq!(done.states.len(), j.program.ranks());
        assert!(done.states.iter().all(|s| s.steps_done == 3));
        let params = done.params.unwrap();
        let names: Vec<&str> = j.program.resident.iter().filter(|r| !r.is_state).map(|r| r.name.as_str()).collect();
        assert_eq!(params.len(), names.len(), "{name}");
        // The same job again: the same losses, bit for bit (reductions in a fixed order).
        let (_, _, again) = run(&j);
        let bits = |v: &[StepReport]| v.iter().map(|s| s.loss.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&steps), bits(&again), "{name}");
    }
}

#[test]
fn a_resumed_run_continues_bit_exactly() {
    let plan = load("gpt_tiny_adamw_2x2.json");
    let dir = std::env::temp_dir().join(format!("autopar-runtime-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (whole, _, whole_steps) = run(&job(&plan, opts(4), Init::Seed { seed: 3 }));
    whole.unwrap();
    let first = RunOptions { checkpoint: Some(CheckpointOptions { dir: dir.clone(), every: None }), ..opts(2) };
    run(&job(&plan, first, Init::Seed { seed: 3 })).0.unwrap();
    let (r, events, steps) = run(&job(&plan, opts(4), Init::Resume { dir: dir.clone() }));
    r.unwrap();
    assert_eq!(events, ["started 2 as threads", "step 3", "step 4"]);
    let bits = |v: &[StepReport]| v.iter().map(|s| s.loss.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&steps), bits(&whole_steps[2..]));
    // Nothing left to do is an error, not a silent success.
    let (r, _, _) = run(&job(&plan, opts(2), Init::Resume { dir: dir.clone() }));
    assert!(r.unwrap_err().to_string().contains("the checkpoint is at step 2"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_failing_rank_stops_the_run_with_its_own_error() {
    let plan = load("mlp_sgd_mesh2.json");
    let fault = Fault { rank: 1, step: 2, kind: runtime::launch::FaultKind::Error };
    let (r, events, _) = run(&job(&plan, RunOptions { fault: Some(fault), ..opts(3) }, Init::Seed { seed: 0 }));
    match r {
        Err(LaunchError::Run(DistError::Injected { rank: 1, step: 2 })) => {}
        other => panic!("{other:?}"),
    }
    // Step 1's report may or may not reach rank 0 before the abort does (rank 1 can leave the
    // report's exchange and abort before rank 0 has read it); no later step ever runs.
    assert!(events == ["started 0 as threads", "step 1"] || events == ["started 0 as threads"], "{events:?}");
    // A fault that could never fire is refused before the run.
    let never = Fault { rank: 5, step: 2, kind: runtime::launch::FaultKind::Error };
    let (r, events, _) = run(&job(&plan, RunOptions { fault: Some(never), ..opts(3) }, Init::Seed { seed: 0 }));
    assert!(r.unwrap_err().to_string().contains("the plan has 2 ranks"));
    assert!(events.is_empty());
}

#[test]
fn invalid_plans_are_refused_before_any_rank_starts() {
    let text = std::fs::read_to_string(data("mlp_sgd_mesh2.json")).unwrap();
    // Another format version names both.
    // (The fixture's first field is its version, whichever the fixture was written in.)
    let (first, rest) = text.split_once(',').unwrap();
    assert!(first.starts_with("{\"version\":"), "{first}");
    let old = format!("{{\"version\":2,{rest}");
    let e = plan::Valid::from_json(&old).unwrap_err().to_string();
    assert!(
        e.contains("version 2") && e.contains(&format!("reads versions {} to {}", plan::OLDEST_READ, plan::VERSION)),
        "{e}"
    );
    // A malformed value reference names its instruction.
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let k = v["program"].as_array().unwrap().iter().position(|i| i["kind"] == "collective").unwrap();
    v["program"][k]["input"] = serde_json::json!("%05");
    let e = plan::Valid::from_json(&v.to_string()).unwrap_err().to_string();
    assert!(e.contains(&format!("instruction {k}: ")) && e.contains("`%05` is not a value id"), "{e}");
    // A plan edited in memory is checked by the compiler.
    let mut p = plan::Plan::from_json(&text).unwrap();
    p.params[0].offsets.clear();
    match Program::new(&p) {
        Err(DistError::InvalidPlan(m)) => assert!(m.contains("0 offsets for the 2 ranks"), "{m}"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("accepted"),
    }
}
