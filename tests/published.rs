//! Issue 21, item 1: published GPT training runs as tests of the cost model.
//!
//! `scripts/bench-published` prices each run of `tests/data/published/runs.json` (Megatron-LM's
//! SC'21 weak-scaling table and its GPT-3 175B example, with their tensor / pipeline / data
//! parallel layouts pinned per mesh axis) with the built-in `a100-80g` profile: datasheet
//! bandwidths, products at the published maximum achievable matmul rate. Nothing in that profile
//! is fitted to these runs. The rows marked `checked` must be estimated within 20% of their
//! published step time; the others are printed (BENCHMARKS.md says why they miss).

use std::process::Command;

#[test]
fn published_runs_are_priced_within_20_percent() {
    let root = env!("CARGO_MANIFEST_DIR");
    let spec: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(format!("{root}/tests/data/published/runs.json")).unwrap())
            .unwrap();
    let checked: Vec<&str> = spec["runs"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["checked"] == true)
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert!(checked.len() >= 3, "at least three published runs are checked");
    let mut cmd = Command::new("python3");
    cmd.arg(format!("{root}/scripts/bench-published")).env("AUTOPAR", env!("CARGO_BIN_EXE_autopar"));
    for name in &checked {
        cmd.args(["--only", name]);
    }
    let out = cmd.output().expect("python3 runs scripts/bench-published");
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}");
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    for name in checked {
        let row =
            text.lines().find(|l| l.starts_with(&format!("| {name} |"))).unwrap_or_else(|| panic!("{name}: no row"));
        let error: f64 = row
            .split('|')
            .map(str::trim)
            .find_map(|c| c.strip_suffix('%').and_then(|x| x.parse().ok()))
            .unwrap_or_else(|| panic!("{name} was not planned: {row}"));
        assert!(error.abs() <= 20.0, "{name}: estimated {error:+.1}% off the published step time: {row}");
    }
}

fn autopar(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_autopar")).args(args).output().unwrap()
}

/// `--strategy` with one role per mesh axis: `dp,tp` is Megatron's layout (the same plan as
/// `megatron`), `pp` names the stage axis, and layouts that do not fit the mesh are one-line errors.
#[test]
fn layouts_per_axis_pin_the_parallelism() {
    let dir = tempfile::tempdir().unwrap();
    let root = env!("CARGO_MANIFEST_DIR");
    let m = format!("{root}/tests/data/models/gpt2-tiny.onnx");
    let step = |strategy: &str, extra: &[&str]| -> String {
        let plan = dir.path().join("plan.json").display().to_string();
        let mut args = vec!["plan", &m, "--memory", "1GiB", "--strategy", strategy, "-o", &plan];
        args.extend_from_slice(extra);
        let out = autopar(&args);
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(out.status.success(), "{strategy}: {text}{}", String::from_utf8_lossy(&out.stderr));
        let p: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&plan).unwrap()).unwrap();
        assert_eq!(p["options"]["strategy"], strategy, "plan.json records the layout");
        text.lines().find(|l| l.starts_with("step")).unwrap().to_string()
    };
    assert_eq!(step("dp,tp", &["--mesh", "2x2"]), step("megatron", &["--mesh", "2x2"]));
    assert_eq!(step("dp,dp", &["--mesh", "2x2"]), step("dp", &["--mesh", "2x2"]));
    let piped = step("pp,dp,tp", &["--mesh", "2x2x2", "--pipeline", "2", "--microbatches", "2"]);
    assert!(piped.contains("over its 2 stages"), "{piped}");
    for (strategy, mesh, extra, why) in [
        ("dp,tp", "2x2x2", "", "2 roles for 3 mesh axes"),
        ("dp,pp", "2x2", "", "`pp` on axis 1: the pipeline stages are the outermost axis"),
        ("pp,tp", "2x2", "", "`pp` on an axis of 2: add --pipeline 2"),
        ("dp,tp", "2x2", "--pipeline=2", "its role is `pp`"),
        ("dp,xp", "2x2", "", "unknown axis role `xp`"),
        ("dp,tp", "2x2", "--pipeline=auto", "with no `pp` axis it has no stages"),
        ("pp,tp", "2x2", "--pipeline=auto", "its `pp` axis fixes the stage count"),
    ] {
        let mut args = vec!["plan", &m, "--memory", "1GiB", "--mesh", mesh, "--strategy", strategy];
        if !extra.is_empty() {
            args.push(extra);
        }
        let out = autopar(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(why), "{strategy} on {mesh}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    }
}
