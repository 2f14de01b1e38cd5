//! Hostile inputs: flags (see main.rs). Every number a flag takes is checked before any work:
//! one `error:` line naming the flag, a non-zero exit, never a panic (`--time-limit 1e308` and
//! `--threads 100000` panicked), a wrap, or a value silently ignored (NaN learning rates, a fault
//! injected at a rank that does not exist).

use crate::common::*;

fn problem() -> String {
    data("fuzz/iopddl/example.json").display().to_string()
}

/// Asserts `fails` for each `(extra args, phrases)` case appended to `base`. Negative values are
/// written `--flag=-1`: clap reads `--flag -1` as a flag without its value.
fn each(base: &[&str], cases: &[(&[&str], &[&str])]) {
    for (extra, phrases) in cases {
        let args: Vec<&str> = base.iter().chain(extra.iter()).copied().collect();
        let line = fails(&args, phrases);
        println!("{:<60} -> {line}", extra.join(" "));
    }
}

#[test]
fn durations_are_finite_and_in_range() {
    let p = problem();
    each(
        &["solve", &p],
        &[
            (&["--time-limit", "1e308"], &["--time-limit", "out of range"]),
            (&["--time-limit", "1e19"], &["--time-limit", "out of range"]),
            (&["--time-limit", "NaN"], &["--time-limit", "out of range"]),
            (&["--time-limit", "inf"], &["--time-limit", "out of range"]),
            (&["--time-limit", "0"], &["--time-limit", "out of range"]),
            (&["--time-limit=-5"], &["--time-limit", "out of range"]),
            (&["--time-limit", "soon"], &["--time-limit", "not a number of seconds"]),
        ],
    );
    let m = model("mlp.onnx");
    each(
        &["plan", &m, "--mesh", "2", "--memory", "1GiB"],
        &[(&["--time-limit", "1e308"], &["--time-limit"]), (&["--time-limit", "1e-9"], &["--time-limit"])],
    );
    // Checked before the plan file is read: the same line whatever the plan.
    each(&["run", "no-such-plan.json"], &[(&["--timeout", "1e19"], &["--timeout", "out of range"])]);
}

#[test]
fn thread_counts_are_bounded() {
    let p = problem();
    let m = model("mlp.onnx");
    each(
        &["solve", &p],
        &[
            (&["--threads", "100000"], &["--threads", "out of range", "1024"]),
            (&["--threads", "0"], &["--threads", "out of range"]),
            (&["--threads=-1"], &["--threads"]),
        ],
    );
    each(&["infer", &m], &[(&["--threads", "100000"], &["--threads"]), (&["--threads", "0"], &["--threads"])]);
    each(&["train", &m, "--loss", "mse:y:t"], &[(&["--threads", "4096"], &["--threads"])]);
    each(&["plan", &m, "--mesh", "2", "--memory", "1GiB"], &[(&["--threads", "0"], &["--threads"])]);
    each(&["run", "no-such-plan.json"], &[(&["--threads-per-rank", "0"], &["--threads-per-rank"])]);
}

#[test]
fn learning_rates_and_optimizer_settings_are_finite_and_in_range() {
    let m = model("mlp.onnx");
    let base = ["train", &m, "--loss", "mse:y:t"];
    each(
        &base,
        &[
            (&["--lr", "NaN"], &["--lr", "not a finite number"]),
            (&["--lr", "inf"], &["--lr", "not a finite number"]),
            (&["--lr", "0"], &["--lr", "must be > 0"]),
            (&["--lr=-0.1"], &["--lr", "must be > 0"]),
            (&["--lr", "1e39"], &["--lr", "32-bit"]),
            (&["--lr", "1e-50"], &["--lr", "must be > 0"]),
            (&["--betas", "0.9,1"], &["--betas", "[0, 1)"]),
            (&["--betas", "0.9,0.999999999"], &["--betas", "[0, 1)"]),
            (&["--betas=-0.1,0.9"], &["--betas", "[0, 1)"]),
            (&["--betas", "0.9"], &["--betas", "two numbers"]),
            (&["--betas", "NaN,0.9"], &["--betas"]),
            (&["--eps", "0"], &["--eps", "> 0"]),
            (&["--eps", "1e-50"], &["--eps", "> 0"]),
            (&["--eps", "NaN"], &["--eps"]),
            (&["--weight-decay=-1"], &["--weight-decay", ">= 0"]),
            (&["--weight-decay", "inf"], &["--weight-decay"]),
            (&["--optimizer", "sgd", "--momentum=-0.5"], &["--momentum", "from 0 to 1"]),
            (&["--optimizer", "sgd", "--momentum", "NaN"], &["--momentum"]),
            (&["--clip-grad-norm", "0"], &["--clip-grad-norm", "> 0"]),
            (&["--clip-grad-norm", "NaN"], &["--clip-grad-norm", "not a finite number"]),
            (&["--clip-grad-norm", "1e39"], &["--clip-grad-norm", "32-bit"]),
            (&["--lr-schedule", "linear"], &["--lr-schedule"]),
            (&["--warmup-steps=-1"], &["--warmup-steps"]),
            (&["--warmup-steps", "1e12"], &["--warmup-steps"]),
            (&["--lr-schedule", "cosine"], &["--lr-schedule cosine needs --decay-steps"]),
            (&["--lr-schedule", "cosine", "--decay-steps", "0"], &["--decay-steps", "out of range"]),
            (&["--lr-schedule", "cosine", "--decay-steps", "9", "--min-lr", "1"], &["--min-lr", "above --lr"]),
            (&["--lr-schedule", "cosine", "--decay-steps", "9", "--min-lr", "NaN"], &["--min-lr"]),
            (&["--lr-schedule", "step"], &["--lr-schedule step needs --step-size"]),
            (&["--lr-schedule", "step", "--step-size", "3", "--gamma", "0"], &["--gamma", "> 0"]),
            (&["--gamma", "0.5"], &["--gamma applies to --lr-schedule step"]),
            (&["--min-lr", "0"], &["--min-lr applies to --lr-schedule cosine"]),
        ],
    );
    // The same flags of planning and `strategies`.
    each(
        &["plan", &m, "--mesh", "2", "--memory", "1GiB"],
        &[(&["--lr", "NaN"], &["--lr"]), (&["--lr-schedule", "step"], &["--step-size"])],
    );
    each(
        &["strategies", &m, "--loss", "mse:y:t"],
        &[(&["--eps=-1"], &["--eps"]), (&["--clip-grad-norm=-1"], &["--clip-grad-norm"])],
    );
}

#[test]
fn tolerances_are_finite_and_not_negative() {
    let m = model("mlp.onnx");
    each(
        &["infer", &m],
        &[
            (&["--tolerance", "NaN"], &["--tolerance", "not a finite number"]),
            (&["--tolerance=-1e-4"], &["--tolerance", ">= 0"]),
            (&["--tolerance", "inf"], &["--tolerance"]),
        ],
    );
}

#[test]
fn step_counts_are_at_least_one_and_bounded() {
    let m = model("mlp.onnx");
    each(
        &["run", "no-such-plan.json"],
        &[
            (&["--steps", "0"], &["--steps", "out of range"]),
            (&["--steps", "100000000000000000000"], &["--steps"]),
            (&["--steps=-3"], &["--steps"]),
            (&["--checkpoint", "ck", "--checkpoint-every", "0"], &["--checkpoint-every", "out of range"]),
        ],
    );
    each(&["train", &m, "--loss", "mse:y:t"], &[(&["--steps", "0"], &["--steps", "out of range"])]);
    each(&["profile"], &[(&["--reps", "0"], &["--reps"]), (&["--reps", "1000000000"], &["--reps"])]);
}

#[test]
fn memory_budgets_parse_and_are_not_zero_or_overflowing() {
    let m = model("mlp.onnx");
    each(
        &["plan", &m, "--mesh", "2"],
        &[
            (&["--memory", "0"], &["--memory", "no memory"]),
            (&["--memory", "0GiB"], &["--memory", "no memory"]),
            (&["--memory", "lots"], &["--memory", "16GiB"]),
            (&["--memory", "1e30GiB"], &["--memory"]),
            (&["--memory", "99999999999TiB"], &["--memory"]),
            (&["--memory=-1GiB"], &["--memory"]),
        ],
    );
    each(
        &["profile"],
        &[(&["--max-bytes", "1TiB"], &["--max-bytes", "1GiB"]), (&["--max-bytes", "0"], &["--max-bytes"])],
    );
}

#[test]
fn mesh_specs_have_sizes_and_bounded_products() {
    let m = model("mlp.onnx");
    each(
        &["plan", &m, "--memory", "1GiB"],
        &[
            (&["--mesh", "0x2"], &["mesh", ">= 1"]),
            (&["--mesh", "65536x65536x65536x65536x65536"], &["--mesh", "ranks"]),
            (&["--mesh", "data=4294967296,tensor=4294967296"], &["--mesh", "ranks"]),
            (&["--mesh", "99999999999999999999999"], &["mesh"]),
            (&["--mesh", ""], &["mesh"]),
        ],
    );
    each(&["strategies", &m], &[(&["--mesh", "2097152"], &["--mesh", "ranks"])]);
    each(&["reshard", "S0 R", "R S0", "--shape", "4x4"], &[(&["--mesh", "4096x4096"], &["--mesh", "ranks"])]);
    // As threads, every rank is a thread.
    each(&["profile"], &[(&["--mesh", "4096"], &["--mesh", "threads"])]);
}

#[test]
fn shapes_and_generator_sizes_do_not_overflow() {
    each(
        &["reshard", "S0 R R", "R S0 R"],
        &[
            (&["--shape", "4294967296x4294967296x4294967296"], &["--shape", "1 EiB"]),
            (&["--shape", "4x-4x4"], &["--shape"]),
        ],
    );
    // `--input` bindings: each dim parses, and their product cannot wrap.
    let m = model("mlp.onnx");
    each(
        &["plan", &m, "--mesh", "2", "--memory", "1GiB"],
        &[
            (&["--input", "x=72057594037927936x256"], &["--input", "elements"]),
            (&["--input", "x=4294967296x4294967296x4294967296"], &["--input", "elements"]),
            (&["--input", "x=99999999999999999999x2"], &["not a dimension"]),
        ],
    );
    let dir = tempdir();
    let out = dir.path().join("g.onnx").display().to_string();
    each(
        &["gen", "gpt", "-o", &out],
        &[
            (&["--layers", "0", "--hidden", "8", "--heads", "2"], &["--layers", "out of range"]),
            (&["--layers", "1", "--hidden", "99999999999", "--heads", "1"], &["--hidden", "out of range"]),
            (
                &["--layers", "1", "--hidden", "1048576", "--heads", "1", "--seq", "16777216", "--batch", "16777216"],
                &["1 EiB"],
            ),
        ],
    );
    assert!(!dir.path().join("g.onnx").exists(), "a refused model was written");
}

#[test]
fn injected_faults_must_be_able_to_fire() {
    let dir = tempdir();
    let plan = dir.path().join("p.json").display().to_string();
    ok(&["plan", &model("mlp.onnx"), "--mesh", "2", "--memory", "1GiB", "--time-limit", "1", "-o", &plan]);
    each(
        &["run", &plan, "--steps", "3"],
        &[
            (&["--inject-fault", "rank=2,step=1"], &["injected fault", "rank=2", "2 ranks"]),
            (&["--inject-fault", "rank=0,step=4"], &["injected fault", "step=4", "steps 1 to 3"]),
            (&["--inject-fault", "rank=0,step=0"], &["injected fault", "step=0"]),
            (&["--inject-fault", "rank=x"], &["fault"]),
        ],
    );
    // The environment variable is held to the same rule.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_autopar"))
        .args(["run", &plan, "--steps", "2"])
        .env("AUTOPAR_INJECT_FAULT", "rank=5,step=1")
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    let err = stderr(&out);
    assert!(!out.status.success() && err.contains("AUTOPAR_INJECT_FAULT") && err.contains("rank=5"), "{err}");
}

/// Errors of the command line itself (unknown flags, missing values) are one line too.
#[test]
fn usage_errors_are_one_line() {
    let m = model("mlp.onnx");
    fails(&["inspect", &m, "--no-such-flag"], &["--no-such-flag"]);
    fails(&["solve"], &["PROBLEM"]);
    fails(&["plan", &m, "--mesh"], &["--mesh"]);
    let help = ok(&["solve", "--help"]);
    assert!(help.contains("--time-limit"), "{help}");
}
