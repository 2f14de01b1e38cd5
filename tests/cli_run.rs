//! Tests of `autopar run` (issue 7): PyTorch's references reproduced through a planned run on a
//! 2x2 mesh, checkpoints that resume bit-for-bit and survive a kill mid-write, and rank failures
//! that end the whole run promptly with a message naming the rank.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn data(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(rel)
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

fn autopar(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_autopar"))
        .args(args)
        .env_remove("AUTOPAR_LOG")
        .env_remove("AUTOPAR_INJECT_FAULT")
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("running the autopar binary")
}

fn ok(args: &[&str]) -> String {
    let out = autopar(args);
    assert!(
        out.status.success(),
        "autopar {} failed ({}):\n{}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The `{"step": i, "loss": x}` lines of a `--json` run.
fn losses(stdout: &str) -> Vec<(u64, f64)> {
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| Some((v.get("step")?.as_u64()?, v.get("loss")?.as_f64()?)))
        .collect()
}

fn norm(v: &[f32]) -> f64 {
    v.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>().sqrt()
}

struct Model {
    name: &'static str,
    loss: &'static str,
    feeds: &'static [(&'static str, &'static str)],
    accumulate: &'static str,
}

const MODELS: [Model; 4] = [
    Model {
        name: "mlp",
        loss: "mse:y:target",
        feeds: &[("x", "models/mlp.x.npy"), ("target", "refgrad/mlp/mlp.target.npy")],
        accumulate: "f32",
    },
    Model {
        name: "gpt2-tiny",
        loss: "ce-next:logits:input_ids",
        feeds: &[("input_ids", "models/gpt2-tiny.input_ids.npy")],
        accumulate: "f32",
    },
    Model {
        name: "bert-tiny",
        loss: "mse:last_hidden_state:target",
        feeds: &[
            ("input_ids", "models/bert-tiny.input_ids.npy"),
            ("attention_mask", "models/bert-tiny.attention_mask.npy"),
            ("target", "refgrad/bert-tiny/bert-tiny.target.npy"),
        ],
        accumulate: "f32",
    },
    // One ReLU input of resnet18 is within f32 rounding of zero (tests/tests/refgrad.rs): with f64
    // sums in its convolutions every tensor matches PyTorch to 1e-4.
    Model {
        name: "resnet18",
        loss: "ce:logits:labels",
        feeds: &[("input", "models/resnet18.input.npy"), ("labels", "refgrad/resnet18/resnet18.labels.npy")],
        accumulate: "f64",
    },
];

fn feed_args(m: &Model) -> Vec<String> {
    m.feeds.iter().flat_map(|(n, f)| ["--feed".to_string(), format!("{n}={}", s(&data(f)))]).collect()
}

/// Plans `m` on `mesh` with SGD (lr 0.1, as tests/data/refgrad's one-step references) into `dir`.
fn plan(m: &Model, mesh: &str, optimizer: &[&str], dir: &Path) -> PathBuf {
    let out = dir.join(format!("{}-{mesh}.json", m.name));
    let model = s(&data(&format!("models/{}.onnx", m.name)));
    let mut args = vec!["plan", &model, "--mesh", mesh, "--memory", "4GiB", "--loss", m.loss, "--time-limit", "1"];
    args.extend_from_slice(optimizer);
    let o = s(&out);
    args.extend_from_slice(&["-o", &o]);
    ok(&args);
    out
}

/// Acceptance 2: PyTorch's loss and parameters after one SGD step, through `autopar run` on 2x2.
#[test]
fn run_reproduces_pytorch_on_2x2() {
    let dir = tempfile::tempdir().unwrap();
    for m in &MODELS {
        let p = plan(m, "2x2", &["--optimizer", "sgd", "--lr", "0.1"], dir.path());
        let save = dir.path().join(format!("{}-saved", m.name));
        let mut args: Vec<String> = vec!["run".into(), s(&p), "--steps".into(), "1".into(), "--json".into()];
        args.extend(feed_args(m));
        args.extend(["--accumulate".into(), m.accumulate.into(), "--save".into(), s(&save)]);
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = ok(&argv);
        let refs = data(&format!("refgrad/{}", m.name));
        let want: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(refs.join("loss.json")).unwrap()).unwrap();
        let want = want["loss"].as_f64().unwrap();
        let got = losses(&out);
        assert_eq!(got.len(), 1, "{}: {out}", m.name);
        let e = (got[0].1 - want).abs() / want.abs();
        assert!(e <= 1e-4, "{}: loss {} vs PyTorch {want} ({e:.2e})", m.name, got[0].1);
        let params = runtime::npy::read_npz(&save.join("params.npz")).unwrap();
        let want_params = runtime::npy::read_npz(&refs.join("params_after_sgd.npz")).unwrap();
        assert!(!want_params.is_empty());
        let mut worst: f64 = 0.0;
        for (name, w) in &want_params {
            let g = params.get(name).unwrap_or_else(|| panic!("{}: no parameter {name} saved", m.name));
            assert_eq!(g.shape(), w.shape(), "{}: {name}", m.name);
            let (a, b) = (g.to_f32_vec(), w.to_f32_vec());
            let d: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x - y).collect();
            let e = norm(&d) / norm(&b).max(1e-12);
            assert!(e <= 1e-4, "{}: parameter {name} after one SGD step differs from PyTorch by {e:.2e}", m.name);
            worst = worst.max(e);
        }
        println!(
            "{} on 2x2: loss {:.8} (PyTorch {want:.8}), {} parameters after one SGD step, worst relative error {worst:.1e}",
            m.name,
            got[0].1,
            want_params.len()
        );
    }
}

/// `--precision f64` on both sides: resnet18's 1x2 data-parallel plan, where an f32 run flips one
/// ReLU against single-device f32 training in step 2 (`examples/resnet18_flip.rs`), trains the
/// same model as `autopar train --precision f64`: losses and parameters after 3 steps within 1e-5.
#[test]
fn f64_run_equals_f64_train() {
    let dir = tempfile::tempdir().unwrap();
    let m = &MODELS[3];
    let sgd = ["--optimizer", "sgd", "--lr", "1e-4", "--momentum", "0.9"];
    let p = plan(m, "1x2", &[&sgd[..], &["--strategy", "dp"]].concat(), dir.path());
    let (run_dir, train_dir) = (dir.path().join("run"), dir.path().join("train"));
    let mut run: Vec<String> = vec!["run".into(), s(&p), "--steps".into(), "3".into(), "--json".into()];
    run.extend(feed_args(m));
    let exported = dir.path().join("run.onnx");
    run.extend(["--precision".into(), "f64".into(), "--save".into(), s(&run_dir)]);
    run.extend(["--export-onnx".into(), s(&exported)]);
    let model = s(&data("models/resnet18.onnx"));
    let mut train: Vec<String> = vec!["train".into(), model, "--loss".into(), m.loss.into()];
    train.extend(sgd.iter().map(|x| x.to_string()));
    train.extend(feed_args(m));
    train.extend(["--steps", "3", "--json", "--precision", "f64", "--save"].map(String::from));
    train.push(s(&train_dir));
    let (got, want) = (losses(&run_ok(&run)), losses(&run_ok(&train)));
    assert_eq!(got.len(), 3, "{got:?}");
    for ((_, a), (_, b)) in got.iter().zip(&want) {
        assert!((a - b).abs() <= 1e-5 * b.abs(), "loss {a} (run) vs {b} (train)");
    }
    let a = runtime::npy::read_npz(&run_dir.join("params.npz")).unwrap();
    let b = runtime::npy::read_npz(&train_dir.join("params.npz")).unwrap();
    assert_eq!(a.len(), b.len());
    let mut worst: f64 = 0.0;
    for (name, w) in &b {
        let g = &a[name];
        assert_eq!(g.meta(), w.meta(), "{name}");
        assert_eq!(g.dtype(), ir::DType::F64, "{name}");
        let (x, y) = (g.to_f64_vec(), w.to_f64_vec());
        let d: f64 = x.iter().zip(&y).map(|(p, q)| (p - q) * (p - q)).sum::<f64>().sqrt();
        let e = d / y.iter().map(|q| q * q).sum::<f64>().sqrt().max(1e-12);
        assert!(e <= 1e-5, "parameter {name}: run and train differ by {e:.2e}");
        worst = worst.max(e);
    }
    println!("resnet18 1x2 dp in f64: 3 losses equal to train's, parameters within {worst:.1e}");
    // The same parameters as safetensors (issue 23), keyed by ONNX initializer name, in f64.
    for d in [&run_dir, &train_dir] {
        let st = runtime::weights::read_safetensors(&d.join("model.safetensors")).unwrap();
        let npz = runtime::npy::read_npz(&d.join("params.npz")).unwrap();
        assert!(st == npz, "{}: model.safetensors differs from params.npz", d.display());
    }
    // `run --export-onnx`: the model with the run's parameters, rounded to its f32 initializers.
    let back = tracer::import_file(&exported, &Default::default()).unwrap();
    assert_eq!(back.param_data.len(), a.len());
    for (name, t) in &a {
        let want: Vec<f32> = t.to_f64_vec().iter().map(|&x| x as f32).collect();
        assert_eq!(back.param_data[name].to_f32_vec(), want, "{name}");
    }
}

fn gpt2_run_args(plan: &Path, steps: u64, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = vec!["run".into(), s(plan), "--steps".into(), steps.to_string(), "--json".into()];
    a.extend(feed_args(&MODELS[1]));
    a.extend(extra.iter().map(|x| x.to_string()));
    a
}

fn run_ok(args: &[String]) -> String {
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    ok(&argv)
}

/// Acceptance 4: a run stopped after step k and resumed reproduces the uninterrupted run's losses
/// bit-for-bit (AdamW, so optimizer state and its step counter go through the checkpoint too).
#[test]
fn resume_reproduces_the_uninterrupted_run_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let p = plan(&MODELS[1], "2x2", &["--optimizer", "adamw", "--lr", "1e-3"], dir.path());
    let full = losses(&run_ok(&gpt2_run_args(&p, 5, &[])));
    assert_eq!(full.len(), 5);
    let ck = s(&dir.path().join("ckpt"));
    let first = losses(&run_ok(&gpt2_run_args(&p, 2, &["--checkpoint", &ck])));
    let rest = losses(&run_ok(&gpt2_run_args(&p, 5, &["--checkpoint", &ck, "--resume"])));
    assert_eq!(first, full[..2].to_vec());
    assert_eq!(rest.iter().map(|x| x.0).collect::<Vec<_>>(), vec![3, 4, 5]);
    for (a, b) in rest.iter().zip(&full[2..]) {
        assert_eq!(a.1.to_bits(), b.1.to_bits(), "step {}: resumed loss {} vs uninterrupted {}", a.0, a.1, b.1);
    }
}

/// Acceptance 4: a run killed while writing a checkpoint leaves the previous one intact and
/// loadable; resuming from it continues exactly as the uninterrupted run.
#[test]
fn a_kill_mid_write_leaves_the_previous_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let p = plan(&MODELS[1], "2x2", &["--optimizer", "adamw", "--lr", "1e-3"], dir.path());
    let full = losses(&run_ok(&gpt2_run_args(&p, 4, &[])));
    let ckdir = dir.path().join("ckpt");
    let ck = s(&ckdir);
    let args = gpt2_run_args(
        &p,
        4,
        &["--checkpoint", &ck, "--checkpoint-every", "1", "--inject-fault", "rank=1,step=2,kind=exit-in-checkpoint"],
    );
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = autopar(&argv);
    assert_eq!(out.status.code(), Some(137), "{}", String::from_utf8_lossy(&out.stderr));
    let latest = std::fs::read_to_string(ckdir.join("LATEST")).unwrap();
    assert!(latest.starts_with("ckpt-00000001-"), "LATEST = {latest}");
    let names: Vec<String> =
        std::fs::read_dir(&ckdir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(names.iter().any(|n| n.starts_with(".tmp-ckpt-00000002-")), "no unfinished step-2 directory: {names:?}");
    let rest = losses(&run_ok(&gpt2_run_args(&p, 4, &["--checkpoint", &ck, "--resume"])));
    assert_eq!(rest.iter().map(|x| x.0).collect::<Vec<_>>(), vec![2, 3, 4]);
    for (a, b) in rest.iter().zip(&full[1..]) {
        assert_eq!(a.1.to_bits(), b.1.to_bits(), "step {}: resumed loss {} vs uninterrupted {}", a.0, a.1, b.1);
    }
    // The resumed run cleaned up the unfinished directory and now points at step 4.
    let names: Vec<String> =
        std::fs::read_dir(&ckdir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(!names.iter().any(|n| n.starts_with(".tmp-")), "{names:?}");
    assert!(std::fs::read_to_string(ckdir.join("LATEST")).unwrap().starts_with("ckpt-00000004-"));
    // A corrupted rank file is refused with a clear error.
    let latest = std::fs::read_to_string(ckdir.join("LATEST")).unwrap();
    let f = ckdir.join(latest.trim()).join("rank-00002.npz");
    let mut bytes = std::fs::read(&f).unwrap();
    let k = bytes.len() / 2;
    bytes[k] ^= 0xff;
    std::fs::write(&f, bytes).unwrap();
    let args = gpt2_run_args(&p, 6, &["--checkpoint", &ck, "--resume"]);
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = autopar(&argv);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("corrupt") && err.contains("rank-00002.npz"), "{err}");
}

/// Acceptance 5: an injected rank failure ends the whole run with a non-zero exit within 10 s,
/// naming the rank and the cause (error, panic, and a rank that stops responding).
#[test]
fn a_failing_rank_stops_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    let p = plan(&MODELS[1], "2x2", &["--optimizer", "adamw"], dir.path());
    for (fault, phrases) in [
        ("rank=2,step=2", vec!["rank 2", "injected fault at step 2"]),
        ("rank=3,step=1,kind=panic", vec!["rank 3 panicked", "injected panic"]),
        ("rank=1,step=2,kind=hang", vec!["timed out"]),
    ] {
        let args = gpt2_run_args(&p, 4, &["--inject-fault", fault, "--timeout", "3"]);
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        let t0 = Instant::now();
        let out = autopar(&argv);
        let took = t0.elapsed();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{fault}: the run succeeded");
        assert!(out.status.code().is_some(), "{fault}: killed by a signal");
        assert!(took < Duration::from_secs(10), "{fault}: took {took:?}");
        let line =
            err.lines().find(|l| l.starts_with("error: ")).unwrap_or_else(|| panic!("{fault}: no error line: {err}"));
        for ph in phrases {
            assert!(line.contains(ph), "{fault}: `{ph}` not in: {line}");
        }
        println!("{fault}: exit {:?} after {:.2} s: {line}", out.status.code(), took.as_secs_f64());
    }
    // The environment variable works too.
    let args = gpt2_run_args(&p, 3, &[]);
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = Command::new(env!("CARGO_BIN_EXE_autopar"))
        .args(&argv)
        .env("AUTOPAR_INJECT_FAULT", "rank=0,step=1")
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("rank 0: injected fault at step 1"));
}

/// Bad input is one clear line: a corrupt plan, a missing feed, a feed of the wrong shape, an
/// unknown back end, resuming without a checkpoint.
#[test]
fn run_rejects_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    let p = plan(&MODELS[1], "1x2", &["--optimizer", "sgd"], dir.path());
    let ids = s(&data("models/gpt2-tiny.input_ids.npy"));
    let x = s(&data("models/mlp.x.npy"));
    let feed = format!("input_ids={ids}");
    let wrong = format!("input_ids={x}");
    let bad_plan = dir.path().join("bad.json");
    std::fs::write(&bad_plan, "{\"version\": 2}").unwrap();
    let none = s(&dir.path().join("none"));
    for (args, phrase) in [
        (vec!["run", &s(&bad_plan), "--feed", &feed], "invalid plan"),
        (vec!["run", &s(&p)], "missing feed for input input_ids"),
        (vec!["run", &s(&p), "--feed", &wrong], "feed input_ids is f32[32,256]"),
        (vec!["run", &s(&p), "--feed", &feed, "--backend", "mpi"], "MPI"),
        (vec!["run", &s(&p), "--feed", &feed, "--backend", "nccl", "--precision", "f64"], "CPU ranks only"),
        (vec!["run", &s(&p), "--feed", &feed, "--checkpoint", &none, "--resume"], "no checkpoint"),
        (vec!["run", &s(&p), "--feed", &feed, "--init", "model", "--model", &x], "mlp.x.npy"),
    ] {
        let out = autopar(&args);
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
        let lines: Vec<&str> = err.lines().collect();
        assert_eq!(lines.len(), 1, "{args:?}: {err}");
        assert!(lines[0].starts_with("error: ") && lines[0].contains(phrase), "{args:?}: `{phrase}` not in {err}");
    }
}

/// `autopar profile` measures both axes of a 2x2 mesh of threads, writes a profile whose per-axis
/// links `plan --device FILE` takes for a mesh of that shape, and prints the model's error for
/// every point of the sweep. (How close the fit is depends on the machine's load, so the 20%
/// figure is a benchmark in BENCHMARKS.md, not an assertion here.)
#[test]
fn profile_writes_a_device_profile_that_plan_uses() {
    let dir = tempfile::tempdir().unwrap();
    let prof = dir.path().join("p.json");
    let out = ok(&["profile", "--mesh", "2x2", "--max-bytes", "64KiB", "--reps", "2", "-o", &s(&prof)]);
    // Sizes 1 KiB to 64 KiB doubling (7), all-reduce and all-gather, on both axes.
    let rows = out.lines().filter(|l| l.starts_with("all-reduce") || l.starts_with("all-gather")).count();
    assert_eq!(rows, 28, "{out}");
    assert!(out.contains("fit       the model reproduces every measured time within"), "{out}");
    let p: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&prof).unwrap()).unwrap();
    assert_eq!(p["name"], "measured-threads");
    assert!(p["f32_flops"].as_f64().unwrap() > 1e8 && p["memory_bandwidth"].as_f64().unwrap() > 1e8, "{p}");
    // The cost per instruction of ops no family fit covers, and a convolution's rate.
    let per_op = p["op_seconds"].as_f64().unwrap();
    assert!(per_op > 1e-9 && per_op < 1e-3, "{p}");
    assert!(p["conv_flops"].as_f64().unwrap() > 1e8, "{p}");
    assert!(out.contains("us per instruction (the median fixed cost)"), "{out}");
    // Every op family of the generated calibration steps is fitted, products among them.
    assert!(out.contains("op families fitted on timed single-device training steps"), "{out}");
    // Fitted again on the data-parallel and Megatron plans of those models run on the mesh, when
    // this machine has a core per rank.
    assert!(
        out.contains(
            "families fitted again on the instructions of the models' data-parallel and Megatron plans run on 2x2"
        ) || out.contains("plans     not run (the mesh has more ranks than this machine has cores)"),
        "{out}"
    );
    for family in ["matmul", "conv", "conv/1x1", "conv/grouped", "conv/depthwise", "transpose", "sgd_update"] {
        let c = &p["op_costs"][family];
        assert!(c["fixed"].as_f64().unwrap() >= 0.0 && c["samples"].as_u64().unwrap() > 0, "{family}: {p}");
    }
    let links = p["mesh_axes"]["links"].as_array().unwrap().clone();
    assert_eq!(links.len(), 2);
    assert_eq!(p["mesh_axes"]["shape"], serde_json::json!([2, 2]));
    // A plan on a 2x2 mesh uses the measured links of each axis.
    let m = &MODELS[0];
    let plan = dir.path().join("plan.json");
    let mut args: Vec<String> = ["plan", &s(&data(&format!("models/{}.onnx", m.name))), "--mesh", "2x2"]
        .iter()
        .map(|a| a.to_string())
        .collect();
    let (prof, plan_out) = (s(&prof), s(&plan));
    args.extend(
        ["--memory", "1GiB", "--loss", m.loss, "--time-limit", "1", "--device", &prof, "-o", &plan_out]
            .map(String::from),
    );
    let out = ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(out.contains("device measured-threads"), "{out}");
    let plan: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&plan).unwrap()).unwrap();
    let got = plan["mesh"]["links"].as_array().unwrap();
    assert_eq!(got.len(), 2);
    for (g, w) in got.iter().zip(&links) {
        // The all-reduce line and the all-gather one (measured apart).
        for (g, w) in [(g, w), (&g["gather"], &w["gather"])] {
            for k in ["alpha", "beta"] {
                let (g, w) = (g[k].as_f64().unwrap(), w[k].as_f64().unwrap());
                // The JSON round trip may move the last digit.
                assert!((g - w).abs() <= 1e-12 * w.abs(), "{k}: plan {g} vs profile {w}");
            }
        }
        let segments = |l: &serde_json::Value| l["segments"].as_array().map_or(0, Vec::len);
        assert_eq!(segments(g), segments(w), "plan {g} vs profile {w}");
    }
    // A mesh with no axis to measure is an error.
    let bad = autopar(&["profile", "--mesh", "1x1", "-o", &s(&dir.path().join("q.json"))]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("nothing to measure"));
}

/// On a mesh with a core per rank, `autopar profile` also runs the data-parallel and Megatron
/// plans of its generated models on threads, fits the op families again on their instructions'
/// times and scales the fit to their measured steps, and adds the latency their collectives had
/// beyond the sweep's lines to the profile's links; it says so, and the profile prices ops and
/// collectives by that fit.
#[test]
fn profile_scales_the_fit_to_plans_run_on_the_mesh() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cores < 2 {
        eprintln!("skipped: this machine has {cores} core; the plans' runs need a core per rank of a 2-rank mesh");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let prof = dir.path().join("p.json");
    let out = ok(&["profile", "--mesh", "2", "--max-bytes", "4KiB", "--reps", "2", "--json", "-o", &s(&prof)]);
    let line: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    // Every calibration model's plans were run and priced: data-parallel and Megatron.
    let errors = line["plan_errors"].as_array().unwrap_or_else(|| panic!("{line}"));
    assert!(errors.len() >= 16, "{line}");
    assert!(errors.iter().any(|e| e[0].as_str().unwrap().ends_with(" megatron")), "{line}");
    for e in errors {
        assert!(e[1].as_f64().unwrap().is_finite(), "{e}");
    }
    let scales = line["plan_step_scales"].as_array().unwrap();
    assert!(scales.iter().all(|x| x.as_f64().unwrap().is_finite()), "{line}");
    // The profile prices the families the plans ran by the plans' fit: it is not the
    // single-device one.
    let families: Vec<&str> = line["plan_families"].as_array().unwrap().iter().map(|f| f.as_str().unwrap()).collect();
    assert!(families.contains(&"reshape") && families.contains(&"matmul"), "{line}");
    let p: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&prof).unwrap()).unwrap();
    // The collectives' latency in the plans' runs is added to every line of the measured links.
    // (A measured time: only its sign and finiteness are checked, as load on the machine
    // stretches it; a bound of 1 ms failed under a parallel build.)
    let latency = line["plan_collective_latency"].as_f64().unwrap_or_else(|| panic!("{line}"));
    assert!(latency >= 0.0 && latency.is_finite(), "{line}");
    let (swept, priced) = (&line["links"][0], &p["mesh_axes"]["links"][0]);
    for (w, g) in [(swept, priced), (&swept["gather"], &priced["gather"])] {
        let (w, g) = (w["alpha"].as_f64().unwrap(), g["alpha"].as_f64().unwrap());
        assert!((g - w - latency).abs() <= 1e-12, "alpha: profile {g}, sweep {w}, latency {latency}");
    }
    for family in ["matmul", "conv", "reshape", "sgd_update"] {
        let (c, single) = (&p["op_costs"][family], &line["single_device_op_costs"][family]);
        assert!(c["fixed"].as_f64().unwrap() >= 0.0 && c["samples"].as_u64().unwrap() > 0, "{family}: {p}");
        assert_ne!(c, single, "{family}: the profile keeps the single-device fit");
    }
}

/// Token ids (vocabulary 50) and positions `[batch, seq]` for a generated LLaMA, as .npy files
/// in `dir`.
fn llama_feeds(dir: &Path, batch: usize, seq: usize) -> (PathBuf, PathBuf) {
    let ids: Vec<i64> = (0..batch * seq).map(|i| ((i * 7 + 3) % 50) as i64).collect();
    let pos: Vec<i64> = (0..batch * seq).map(|i| (i % seq) as i64).collect();
    let (idf, posf) = (dir.join("ids.npy"), dir.join("pos.npy"));
    runtime::npy::write_npy(&idf, &ir::Tensor::i64(vec![batch, seq], ids)).unwrap();
    runtime::npy::write_npy(&posf, &ir::Tensor::i64(vec![batch, seq], pos)).unwrap();
    (idf, posf)
}

/// The losses of 3 steps of `plan` (a generated LLaMA's) from seeded random weights, in f64.
fn llama_losses(plan: &str, idf: &Path, posf: &Path) -> Vec<(u64, f64)> {
    let (ids, pos) = (format!("input_ids={}", s(idf)), format!("position_ids={}", s(posf)));
    let args = ["run", plan, "--feed", &ids, "--feed", &pos, "--init", "random", "--seed", "3", "--steps", "3"];
    let out = ok(&[&args[..], &["--precision", "f64", "--json"]].concat());
    let l = losses(&out);
    assert_eq!(l.len(), 3, "{plan}: {out}");
    l
}

/// Every run's losses (after the first, one device's) equal the first's within 1e-9 relative.
fn assert_same_losses(runs: &[(&str, Vec<(u64, f64)>)], what: &str) {
    let one = &runs[0].1;
    for (mesh, l) in &runs[1..] {
        for ((_, a), (_, b)) in l.iter().zip(one) {
            assert!((a - b).abs() <= 1e-9 * b.abs(), "{what} {mesh}: loss {a} vs one device {b}");
        }
    }
}

/// A generated LLaMA (RMSNorm, rotary embeddings from `position_ids`, grouped-query attention
/// with fewer key/value heads than shards, SwiGLU, untied head) from seeded parameters: its 2x2
/// and 1x4 plans train as its one-device plan does. In f64 on every side, so that summation
/// order does not matter: losses within 1e-9 relative over 3 steps.
#[test]
fn generated_llama_plans_train_as_one_device() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("llama.onnx");
    let m = s(&model);
    let args = [
        "gen",
        "llama",
        "--layers",
        "2",
        "--hidden",
        "32",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--ffn",
        "48",
        "--seq",
        "8",
        "--vocab",
        "50",
        "--batch",
        "4",
        "-o",
        &m,
    ];
    ok(&args);
    let (idf, posf) = llama_feeds(dir.path(), 4, 8);
    let mut runs = vec![];
    for mesh in ["1", "2x2", "1x4"] {
        let p = s(&dir.path().join(format!("plan-{mesh}.json")));
        ok(&["plan", &m, "--mesh", mesh, "--memory", "1GiB", "--loss", "ce-next:logits:input_ids", "-o", &p]);
        runs.push((mesh, llama_losses(&p, &idf, &posf)));
    }
    let one = &runs[0].1;
    assert!(one[2].1 < one[0].1, "training lowers the loss: {one:?}");
    assert_same_losses(&runs, "");
}

/// Sequence and context parallelism (issue 47, item 4): a 1,024-token LLaMA with the sequence
/// pinned split over 4 ranks (`--strategy sp` on 4, `dp,sp` on 1x4, and on 2x2 with the batch
/// split too)
/// trains as one device does (f64, 1e-9 relative on the losses). Written as separate ops, the
/// solver meets the split at attention with all-to-alls (heads against sequence, as
/// DeepSpeed-Ulysses); written as one fused causal attention on 4 ranks, it splits the queries
/// in blocks against gathered keys and values, each block with its own causal frontier (context
/// parallelism).
#[test]
fn sequence_parallel_plans_train_as_one_device() {
    let dir = tempfile::tempdir().unwrap();
    let (idf, posf) = llama_feeds(dir.path(), 2, 1024);
    for attention in ["unfused", "fused"] {
        let m = s(&dir.path().join(format!("llama-{attention}.onnx")));
        let generate = [
            "gen",
            "llama",
            "--layers",
            "2",
            "--hidden",
            "32",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--ffn",
            "48",
            "--seq",
            "1024",
            "--vocab",
            "50",
            "--batch",
            "2",
            "--attention",
            attention,
            "-o",
            &m,
        ];
        ok(&generate);
        let mut runs = vec![];
        for (mesh, strategy) in [("1", "auto"), ("4", "sp"), ("1x4", "dp,sp"), ("2x2", "dp,sp")] {
            let p = s(&dir.path().join(format!("plan-{attention}-{mesh}.json")));
            let loss = "ce-next:logits:input_ids";
            ok(&["plan", &m, "--mesh", mesh, "--memory", "1GiB", "--strategy", strategy, "--loss", loss, "-o", &p]);
            let plan: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
            let program = plan["program"].as_array().unwrap();
            if strategy != "auto" {
                let ids_spec = &program.iter().find(|i| i["name"] == "input_ids").unwrap()["output_specs"][0];
                let want = match mesh {
                    "4" => "R S0",
                    "1x4" => "R S1",
                    _ => "S0 S1",
                };
                assert_eq!(ids_spec, want, "{mesh}: the sequence is split");
            }
            if (attention, mesh) == ("unfused", "4") {
                let exchanges = program
                    .iter()
                    .filter(|i| i["kind"] == "collective" && i["collective"]["kind"] == "all_to_all")
                    .count();
                assert!(exchanges > 0, "{attention} {mesh}: no all-to-all between sequence and heads");
            }
            if (attention, mesh) == ("fused", "4") {
                let blocks = program.iter().filter(|i| i["local"]["kind"] == "query_blocks").count();
                assert_eq!(blocks, 4, "{attention} {mesh}: attention and its gradient in query blocks, 2 layers");
            }
            runs.push((mesh, llama_losses(&p, &idf, &posf)));
        }
        assert_same_losses(&runs, attention);
    }
}

/// Pipeline stages from the command line (issue 18): `plan --pipeline 2` on 2x2 writes a plan
/// whose summary lists both stages; `run` of it trains as the 2x2 plan without stages does
/// (AdamW, 1e-5 relative on losses) and, stopped after step 2 and resumed from its sharded
/// checkpoint (each stage writes its own parameters and optimizer state), reproduces its own
/// uninterrupted run bit for bit. A stage count that is not the outer axis's size is refused.
#[test]
fn pipelined_plans_run_and_resume_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let model = s(&data("models/gpt2-tiny.onnx"));
    let adamw = ["--optimizer", "adamw", "--lr", "1e-3"];
    let flat = plan(&MODELS[1], "2x2", &adamw, dir.path());
    let staged = s(&dir.path().join("staged.json"));
    let mut args =
        vec!["plan", &model, "--mesh", "2x2", "--memory", "4GiB", "--loss", MODELS[1].loss, "--pipeline", "2"];
    args.extend_from_slice(&adamw);
    args.extend_from_slice(&["-o", &staged]);
    let summary = ok(&args);
    assert!(summary.contains("stages    stage 0: ") && summary.contains("          stage 1: "), "{summary}");
    let want = losses(&run_ok(&gpt2_run_args(&flat, 4, &[])));
    let p = PathBuf::from(&staged);
    let full = losses(&run_ok(&gpt2_run_args(&p, 4, &[])));
    assert_eq!(full.len(), 4);
    for (a, b) in full.iter().zip(&want) {
        assert!((a.1 - b.1).abs() <= 1e-5 * b.1.abs(), "step {}: pipelined loss {} vs {}", a.0, a.1, b.1);
    }
    let ck = s(&dir.path().join("ckpt"));
    let first = losses(&run_ok(&gpt2_run_args(&p, 2, &["--checkpoint", &ck])));
    let rest = losses(&run_ok(&gpt2_run_args(&p, 4, &["--checkpoint", &ck, "--resume"])));
    assert_eq!(first, full[..2].to_vec());
    for (a, b) in rest.iter().zip(&full[2..]) {
        assert_eq!(a.1.to_bits(), b.1.to_bits(), "step {}: resumed loss {} vs uninterrupted {}", a.0, a.1, b.1);
    }
    let out = autopar(&["plan", &model, "--mesh", "2x2", "--memory", "4GiB", "--pipeline", "3", "-o", &staged]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("pipeline: 3 stages on mesh"), "{err}");
    let explained = ok(&["explain", &s(&p)]);
    assert!(explained.contains("stage 1: "), "{explained}");
    // The page draws the schedule: a row per stage, a box per step.
    let page = dir.path().join("staged.html");
    ok(&["explain", &s(&p), "--html", &s(&page)]);
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(html.contains("<h2>Schedule</h2>") && html.contains("<figure id=\"timeline\">"), "no timeline");
    assert!(html.contains("estimated, stage 0") && html.contains("estimated, stage 1"), "a memory line per stage");
    assert!(html.contains("<title>stage 1 F0: ") && html.contains("<title>stage 0 B0: "), "no steps drawn");
}

/// `plan --microbatches 2` (issue 18): feeds hold two microbatches of the model's batch; a feed
/// of one is refused with both shapes named, and the run trains.
#[test]
fn microbatched_plans_run_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let model = s(&data("models/mlp.onnx"));
    let p = s(&dir.path().join("mb.json"));
    let out = ok(&[
        "plan",
        &model,
        "--mesh",
        "2x2",
        "--memory",
        "4GiB",
        "--loss",
        "mse:y:target",
        "--microbatches",
        "2",
        "-o",
        &p,
    ]);
    assert!(out.contains("plan      mlp"), "{out}");
    let x = runtime::npy::read_npy(&data("models/mlp.x.npy")).unwrap();
    let t = runtime::npy::read_npy(&data("refgrad/mlp/mlp.target.npy")).unwrap();
    let twice = |a: &ir::Tensor| ir::Tensor::f32(vec![64, 256], [a.to_f32_vec(), a.to_f32_vec()].concat());
    let (xf, tf) = (dir.path().join("x64.npy"), dir.path().join("t64.npy"));
    runtime::npy::write_npy(&xf, &twice(&x)).unwrap();
    runtime::npy::write_npy(&tf, &twice(&t)).unwrap();
    let one = autopar(&["run", &p, "--steps", "1", "--feed", &format!("x={}", s(&data("models/mlp.x.npy")))]);
    let err = String::from_utf8_lossy(&one.stderr);
    assert!(!one.status.success() && err.contains("2 microbatches of f32[32,256]"), "{err}");
    let l = losses(&ok(&[
        "run",
        &p,
        "--steps",
        "2",
        "--json",
        "--feed",
        &format!("x={}", s(&xf)),
        "--feed",
        &format!("target={}", s(&tf)),
    ]));
    assert_eq!(l.len(), 2);
    // Two equal microbatches: the loss is the one-microbatch plan's.
    let single = s(&dir.path().join("one.json"));
    ok(&["plan", &model, "--mesh", "2x2", "--memory", "4GiB", "--loss", "mse:y:target", "-o", &single]);
    let want = losses(&ok(&[
        "run",
        &single,
        "--steps",
        "2",
        "--json",
        "--feed",
        &format!("x={}", s(&data("models/mlp.x.npy"))),
        "--feed",
        &format!("target={}", s(&data("refgrad/mlp/mlp.target.npy"))),
    ]));
    for (a, b) in l.iter().zip(&want) {
        assert!((a.1 - b.1).abs() <= 1e-5 * b.1.abs(), "step {}: {} vs {}", a.0, a.1, b.1);
    }
    // Two stages under the zero-bubble schedule: the summary shows each stage's steps; the run
    // trains as the one-microbatch plan does, and resumed from its checkpoint after step 2 it
    // reproduces its uninterrupted run bit for bit.
    let zb = s(&dir.path().join("zb.json"));
    let summary = ok(&[
        "plan",
        &model,
        "--mesh",
        "2x2",
        "--memory",
        "4GiB",
        "--loss",
        "mse:y:target",
        "--pipeline",
        "2",
        "--microbatches",
        "2",
        "--schedule",
        "zb-h1",
        "-o",
        &zb,
    ]);
    assert!(summary.contains("zb-h1 schedule") && summary.contains("schedule  stage 0: F0 F1 B0 W0"), "{summary}");
    let feeds = [format!("x={}", s(&xf)), format!("target={}", s(&tf))];
    let run = |steps: &str, extra: &[&str]| {
        let mut a = vec!["run", &zb, "--steps", steps, "--json", "--feed", &feeds[0], "--feed", &feeds[1]];
        a.extend_from_slice(extra);
        losses(&ok(&a))
    };
    let full = run("4", &[]);
    for (a, b) in full.iter().zip(&want) {
        assert!((a.1 - b.1).abs() <= 1e-5 * b.1.abs(), "zb-h1 step {}: {} vs {}", a.0, a.1, b.1);
    }
    let ck = s(&dir.path().join("zb-ckpt"));
    let first = run("2", &["--checkpoint", &ck]);
    let rest = run("4", &["--checkpoint", &ck, "--resume"]);
    assert_eq!(first, full[..2].to_vec());
    for (a, b) in rest.iter().zip(&full[2..]) {
        assert_eq!(a.1.to_bits(), b.1.to_bits(), "zb-h1 step {}: resumed {} vs uninterrupted {}", a.0, a.1, b.1);
    }
}

/// The mlp's samples as shards: x in two .npy files (40 and 60 rows), the targets in one, made
/// from the bundled batch (100 distinct rows).
fn mlp_dataset(dir: &Path) -> (PathBuf, PathBuf) {
    let x = runtime::npy::read_npy(&data("models/mlp.x.npy")).unwrap();
    let t = runtime::npy::read_npy(&data("refgrad/mlp/mlp.target.npy")).unwrap();
    let (xv, tv) = (x.to_f32_vec(), t.to_f32_vec());
    let width = x.shape()[1];
    // Row i: bundled row i % 32, scaled by a factor of i (distinct rows in every shard).
    let rows = |v: &[f32], range: std::ops::Range<usize>| {
        let mut out = vec![];
        for i in range.clone() {
            let r = &v[(i % 32) * width..(i % 32 + 1) * width];
            out.extend(r.iter().map(|&a| a * (1.0 + i as f32 / 50.0)));
        }
        ir::Tensor::f32(vec![range.len(), width], out)
    };
    let (xd, td) = (dir.join("x"), dir.join("t"));
    std::fs::create_dir_all(&xd).unwrap();
    std::fs::create_dir_all(&td).unwrap();
    runtime::npy::write_npy(&xd.join("shard-0.npy"), &rows(&xv, 0..40)).unwrap();
    runtime::npy::write_npy(&xd.join("shard-1.npy"), &rows(&xv, 40..100)).unwrap();
    runtime::npy::write_npy(&td.join("all.npy"), &rows(&tv, 0..100)).unwrap();
    (xd, td)
}

/// The `{"step": i, "eval_loss": x}` of a `--json` run's lines.
fn eval_losses(stdout: &str) -> Vec<(u64, f64)> {
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| Some((v.get("step")?.as_u64()?, v.get("eval_loss")?.as_f64()?)))
        .collect()
}

/// The `data_bytes_read` of a `--json` run's summary.
fn bytes_read(stdout: &str) -> (Vec<u64>, u64) {
    let v: serde_json::Value = stdout.lines().rev().find_map(|l| serde_json::from_str(l).ok()).unwrap();
    let read = v["data_bytes_read"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap()).collect();
    (read, v["data_bytes_of_batches"].as_u64().unwrap())
}

#[test]
fn streamed_data_trains_and_evaluates_on_2x2_as_on_one_device() {
    // 14 steps of 8 samples over 100 shuffled samples: the second epoch starts at step 13.
    let dir = tempfile::tempdir().unwrap();
    let (xd, td) = mlp_dataset(dir.path());
    let model = s(&data("models/mlp.onnx"));
    let bind = [format!("x={}", s(&xd)), format!("target={}", s(&td))];
    let opt = ["--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9"];
    let mut train = vec!["train", &model, "--loss", "mse:y:target", "--input", "x=8x256", "--steps", "14", "--json"];
    train.extend(["--data", &bind[0], "--data", &bind[1], "--data-seed", "5"]);
    // Evaluated on the first 3 batches in file order after steps 7 and 14.
    let eval = ["--eval-data", &bind[0], "--eval-data", &bind[1], "--eval-every", "7", "--eval-batches", "3"];
    train.extend(eval);
    train.extend(opt);
    let out = ok(&train);
    let want = losses(&out);
    let want_eval = eval_losses(&out);
    assert_eq!(want.len(), 14);
    assert_eq!(want_eval.len(), 2);
    // Data parallel reads a quarter of each batch per rank, tensor parallel (batch over one axis,
    // weights over the other) a half, a pipeline of 2 stages over 2 microbatches the rows of its
    // microbatch blocks; every one trains as the single device does (1e-5 relative).
    for (strategy, extra, share) in
        [("dp", &[][..], 4), ("megatron", &[][..], 2), ("auto", &["--pipeline", "2", "--microbatches", "2"][..], 0)]
    {
        let p = s(&dir.path().join(format!("{strategy}.json")));
        let mut args = vec!["plan", &model, "--input", "x=4x256", "--mesh", "2x2", "--memory", "4GiB"];
        args.extend(["--loss", "mse:y:target", "--strategy", strategy, "-o", &p]);
        if extra.is_empty() {
            args[3] = "x=8x256";
        }
        args.extend(extra);
        args.extend(opt);
        ok(&args);
        let mut run = vec!["run", &p, "--steps", "14", "--json", "--data", &bind[0], "--data", &bind[1]];
        run.extend(["--data-seed", "5"]);
        run.extend(eval);
        let out = ok(&run);
        let got = losses(&out);
        assert_eq!(got.len(), 14, "{strategy}");
        for (a, b) in got.iter().zip(&want).chain(eval_losses(&out).iter().zip(&want_eval)) {
            assert!((a.1 - b.1).abs() <= 1e-5 * b.1.abs(), "{strategy} step {}: {} vs {}", a.0, a.1, b.1);
        }
        let (read, total) = bytes_read(&out);
        assert_eq!(total, 14 * 8 * 2 * 256 * 4, "{strategy}");
        if share > 0 {
            assert!(read.iter().all(|&r| r == total / share), "{strategy}: {read:?} of {total}");
        } else {
            // A stage's ranks read only the inputs it reads: x on the first, the targets on
            // the second (half the bytes of each batch at most).
            assert!(read.iter().all(|&r| r > 0 && r <= total / 2), "{read:?} of {total}");
        }
    }
}

#[test]
fn a_run_resumed_mid_epoch_reads_the_batches_of_the_uninterrupted_run() {
    let dir = tempfile::tempdir().unwrap();
    let (xd, td) = mlp_dataset(dir.path());
    let model = s(&data("models/mlp.onnx"));
    let p = s(&dir.path().join("dp.json"));
    ok(&["plan", &model, "--input", "x=8x256", "--mesh", "2x2", "--memory", "4GiB", "--loss", "mse:y:target"]
        .into_iter()
        .chain(["--strategy", "dp", "--optimizer", "adamw", "-o", &p])
        .collect::<Vec<_>>());
    let bind = [format!("x={}", s(&xd)), format!("target={}", s(&td))];
    let ck = s(&dir.path().join("ckpt"));
    let run = |steps: &str, extra: &[&str]| {
        let mut a = vec!["run", &p, "--steps", steps, "--json", "--data", &bind[0], "--data", &bind[1]];
        a.extend_from_slice(extra);
        autopar(&a)
    };
    let full = losses(&String::from_utf8_lossy(&run("16", &[]).stdout));
    assert_eq!(full.len(), 16);
    // Killed at step 8 (a rank fails) after the checkpoint of step 5, mid-epoch (12 steps make
    // one); resumed, it runs steps 6..16 into the second epoch as the uninterrupted run did.
    let out = run("16", &["--checkpoint", &ck, "--checkpoint-every", "5", "--inject-fault", "rank=2,step=8"]);
    assert!(!out.status.success());
    let rest = losses(&String::from_utf8_lossy(&run("16", &["--checkpoint", &ck, "--resume"]).stdout));
    assert_eq!(rest, full[5..].to_vec(), "bit for bit");
    // More held-out batches than the data holds would repeat them: refused.
    let out = run("2", &["--eval-data", &bind[0], "--eval-data", &bind[1], "--eval-batches", "13"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("holds 12 batch(es) of 8"), "{err}");
    // Another seed, or other data, is another order: refused, not silently resumed.
    for (extra, says) in
        [(&["--data-seed", "1"][..], "seed 0, this run shuffled with seed 1"), (&["--no-shuffle"][..], "in file order")]
    {
        let mut a = vec!["--checkpoint", &ck, "--resume"];
        a.extend_from_slice(extra);
        let out = run("20", &a);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(says), "{err}");
    }
}

#[test]
fn token_files_feed_next_token_training() {
    // A nanoGPT-style uint16 token file into gpt2-tiny (vocabulary 1000, batches of 2 sequences
    // of 64).
    let dir = tempfile::tempdir().unwrap();
    let tokens: Vec<u8> = (0..2000u32).map(|i| ((i * 7919 + i * i) % 1000) as u16).flat_map(u16::to_le_bytes).collect();
    let bin = dir.path().join("train.bin");
    std::fs::write(&bin, tokens).unwrap();
    let model = s(&data("models/gpt2-tiny.onnx"));
    let bind = format!("input_ids={}", s(&bin));
    let loss = "ce-next:logits:input_ids";
    let mut train = vec!["train", &model, "--loss", loss, "--steps", "3", "--json"];
    train.extend(["--data", &bind, "--optimizer", "sgd"]);
    let want = losses(&ok(&train));
    let p = s(&dir.path().join("p.json"));
    // Its export fixes the batch at 2: data parallel on 2 ranks reads one sequence per rank.
    let mut plan = vec!["plan", &model, "--mesh", "2", "--memory", "4GiB"];
    plan.extend(["--loss", loss, "--strategy", "dp", "--optimizer", "sgd", "-o", &p]);
    ok(&plan);
    let out = ok(&["run", &p, "--steps", "3", "--json", "--data", &bind]);
    let got = losses(&out);
    for (a, b) in got.iter().zip(&want) {
        assert!((a.1 - b.1).abs() <= 1e-5 * b.1.abs(), "step {}: {} vs {}", a.0, a.1, b.1);
    }
    assert_eq!(bytes_read(&out), (vec![3 * 64 * 2; 2], 3 * 2 * 64 * 2));
    // A language model's throughput is also in tokens.
    let line: serde_json::Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
    let (sps, tps) = (line["samples_per_s"].as_f64().unwrap(), line["tokens_per_s"].as_f64().unwrap());
    assert!((tps - 64.0 * sps).abs() <= 1e-6 * tps, "{line}");
    // A text file as byte-level tokens (the bundled corpus; gpt2-tiny's vocabulary of 1000
    // holds every byte).
    let text = format!("input_ids={}", s(&data("corpus/shakespeare-val.txt")));
    let out = ok(&["run", &p, "--steps", "2", "--json", "--data", &text, "--token-type", "u8"]);
    assert_eq!(bytes_read(&out), (vec![2 * 64; 2], 2 * 2 * 64));
    // Bad bindings say what is wrong.
    for (binding, says) in [
        (format!("nope={}", s(&bin)), "the graph has no input nope"),
        (format!("input_ids={}", s(&dir.path().join("missing.npy"))), "missing.npy"),
        ("input_ids".to_string(), "is not NAME=PATH"),
        (format!("input_ids,input_ids={}", s(&bin)), "two different inputs"),
    ] {
        let out = autopar(&["run", &p, "--steps", "1", "--data", &binding]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(says), "{binding}: {err}");
    }
}

#[test]
fn evaluation_is_the_next_steps_loss_on_the_same_batch() {
    // Held-out data that is the training batch itself: the evaluation after step k (forward
    // only, parameters of step k) is the loss step k + 1 computes before its update. On data
    // parallel, tensor parallel and 2-stage zero-bubble plans; and training is unchanged by it.
    let dir = tempfile::tempdir().unwrap();
    let model = s(&data("models/mlp.onnx"));
    let rows = |f: &str, name: &str| {
        let t = runtime::npy::read_npy(&data(f)).unwrap();
        let v = t.to_f32_vec()[..8 * 256].to_vec();
        let p = dir.path().join(name);
        runtime::npy::write_npy(&p, &ir::Tensor::f32(vec![8, 256], v)).unwrap();
        format!("{}={}", name.trim_end_matches(".npy"), s(&p))
    };
    let (x, t) = (rows("models/mlp.x.npy", "x.npy"), rows("refgrad/mlp/mlp.target.npy", "target.npy"));
    for (strategy, extra) in [
        ("dp", &[][..]),
        ("megatron", &[][..]),
        ("auto", &["--pipeline", "2", "--microbatches", "2", "--schedule", "zb-h1"][..]),
    ] {
        let p = s(&dir.path().join(format!("{strategy}.json")));
        let input = if extra.is_empty() { "x=8x256" } else { "x=4x256" };
        let mut args = vec!["plan", &model, "--input", input, "--mesh", "2x2", "--memory", "4GiB", "--loss"];
        args.extend(["mse:y:target", "--strategy", strategy, "--optimizer", "adamw", "-o", &p]);
        args.extend(extra);
        ok(&args);
        let run = |eval: bool| {
            let mut a = vec!["run", &p, "--steps", "4", "--json", "--feed", &x, "--feed", &t];
            if eval {
                a.extend(["--eval-data", &x, "--eval-data", &t, "--eval-every", "1"]);
            }
            let out = ok(&a);
            let lines: Vec<serde_json::Value> = out.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
            lines.into_iter().filter(|l| l.get("step").is_some()).collect::<Vec<_>>()
        };
        let with = run(true);
        let without = run(false);
        assert_eq!(with.len(), 4, "{strategy}");
        for k in 0..4 {
            assert_eq!(with[k]["loss"], without[k]["loss"], "{strategy}: evaluation changed training");
        }
        for k in 0..3 {
            let (e, next) = (with[k]["eval_loss"].as_f64().unwrap(), with[k + 1]["loss"].as_f64().unwrap());
            assert!((e - next).abs() <= 1e-6 * next.abs(), "{strategy} step {}: eval {e} vs next loss {next}", k + 1);
        }
    }
}

#[test]
fn train_resumed_with_load_continues_its_data_and_evaluates_at_its_last_step() {
    // `train --save` after 3 steps, then `--load` for 3 more: the losses of an uninterrupted
    // 6-step run, an evaluation after step 6 (the last, counted from the loaded step), and a
    // later save on fixed feeds leaves no data position behind.
    let dir = tempfile::tempdir().unwrap();
    let (xd, td) = mlp_dataset(dir.path());
    let model = s(&data("models/mlp.onnx"));
    let bind = [format!("x={}", s(&xd)), format!("target={}", s(&td))];
    let save = s(&dir.path().join("saved"));
    let train = |steps: &str, extra: &[&str]| {
        let mut a = vec!["train", &model, "--loss", "mse:y:target", "--input", "x=8x256", "--steps", steps, "--json"];
        a.extend(["--data", &bind[0], "--data", &bind[1], "--optimizer", "sgd"]);
        a.extend_from_slice(extra);
        ok(&a)
    };
    let full = losses(&train("6", &[]));
    ok(&[&["train"][..], &train_args(&model, &bind, "3")[..], &["--save", &save]].concat());
    let eval = ["--eval-data", &bind[0], "--eval-data", &bind[1], "--eval-batches", "2"];
    let rest = train("3", &[&["--load", &save][..], &eval[..]].concat());
    assert_eq!(losses(&rest), full[3..].to_vec());
    assert_eq!(eval_losses(&rest).iter().map(|e| e.0).collect::<Vec<_>>(), vec![6]);
    assert!(dir.path().join("saved/data.json").exists());
    let x = format!("x={}", s(&data("models/mlp.x.npy")));
    let t = format!("target={}", s(&data("refgrad/mlp/mlp.target.npy")));
    ok(&["train", &model, "--loss", "mse:y:target", "--steps", "1", "--feed", &x, "--feed", &t, "--save", &save]);
    assert!(!dir.path().join("saved/data.json").exists());
}

fn train_args<'a>(model: &'a str, bind: &'a [String; 2], steps: &'a str) -> Vec<&'a str> {
    let mut a = vec![model, "--loss", "mse:y:target", "--input", "x=8x256", "--steps", steps, "--json"];
    a.extend(["--data", &bind[0], "--data", &bind[1], "--optimizer", "sgd"]);
    a
}

/// The `--json` lines' step, loss, lr and grad_norm.
fn scheduled(stdout: &str) -> Vec<(u64, f64, f64, f64)> {
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| {
            Some((v.get("step")?.as_u64()?, v["loss"].as_f64()?, v["lr"].as_f64()?, v["grad_norm"].as_f64()?))
        })
        .collect()
}

/// Issue 23, items 2 and 3 from the command line: a plan with a learning-rate schedule and
/// gradient clipping runs on 2x2 as `train` trains (loss, lr and grad norm in the `--json` lines
/// within 1e-5), and resumed from a checkpoint mid-schedule it continues bit for bit.
#[test]
fn scheduled_and_clipped_plans_run_as_train() {
    let dir = tempfile::tempdir().unwrap();
    let m = &MODELS[1];
    let opt = [
        "--optimizer",
        "adamw",
        "--lr",
        "1e-3",
        "--lr-schedule",
        "cosine",
        "--warmup-steps",
        "2",
        "--decay-steps",
        "3",
        "--min-lr",
        "1e-4",
        "--clip-grad-norm",
        "0.5",
    ];
    let p = plan(m, "2x2", &opt, dir.path());
    let full = scheduled(&run_ok(&gpt2_run_args(&p, 5, &[])));
    let mut train: Vec<String> =
        vec!["train".into(), s(&data("models/gpt2-tiny.onnx")), "--loss".into(), m.loss.into()];
    train.extend(opt.iter().map(|x| x.to_string()));
    train.extend(feed_args(m));
    train.extend(["--steps", "5", "--json"].map(String::from));
    let want = scheduled(&run_ok(&train));
    assert_eq!(full.len(), 5, "{full:?}");
    assert_eq!(want.len(), 5, "{want:?}");
    for (a, b) in full.iter().zip(&want) {
        for (x, y, what) in [(a.1, b.1, "loss"), (a.2, b.2, "lr"), (a.3, b.3, "grad_norm")] {
            assert!((x - y).abs() <= 1e-5 * y.abs(), "step {}: run's {what} {x} vs train's {y}", a.0);
        }
    }
    let lrs: Vec<f64> = want.iter().map(|x| x.2).collect();
    for (got, w) in lrs.iter().zip([5e-4, 1e-3, 1e-3, 7.75e-4, 3.25e-4]) {
        assert!((got - w).abs() <= 1e-7, "lrs {lrs:?}");
    }
    assert!(want.iter().any(|x| x.3 > 0.5), "clipping is never active: {want:?}");
    let ck = s(&dir.path().join("ckpt"));
    run_ok(&gpt2_run_args(&p, 3, &["--checkpoint", &ck]));
    let rest = scheduled(&run_ok(&gpt2_run_args(&p, 5, &["--checkpoint", &ck, "--resume"])));
    assert_eq!(rest.len(), 2);
    for (a, b) in rest.iter().zip(&full[3..]) {
        assert_eq!((a.1.to_bits(), a.2.to_bits(), a.3.to_bits()), (b.1.to_bits(), b.2.to_bits(), b.3.to_bits()));
    }
    // Flags of another schedule are refused with the flag named.
    let model = s(&data("models/gpt2-tiny.onnx"));
    let out = autopar(&["train", &model, "--loss", m.loss, "--lr-schedule", "step", "--decay-steps", "3"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--decay-steps applies to --lr-schedule cosine"), "{err}");
    let out = autopar(&["train", &model, "--loss", m.loss, "--lr-schedule", "cosine"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("needs --decay-steps"), "{err}");
}

#[test]
fn profiled_runs_set_measurements_beside_estimates() {
    // `run --profile-ops`: every rank's time per plan instruction and the bytes held after each;
    // `explain --measured` compares them with the plan's estimates per family and per
    // instruction, and draws the memory over the step.
    let dir = tempfile::tempdir().unwrap();
    let model = s(&data("models/mlp.onnx"));
    let p = s(&dir.path().join("dp.json"));
    ok(&["plan", &model, "--mesh", "2x2", "--memory", "4GiB", "--loss", "mse:y:target", "--strategy", "dp", "-o", &p]);
    let prof = s(&dir.path().join("prof.json"));
    let (x, t) =
        (format!("x={}", s(&data("models/mlp.x.npy"))), format!("target={}", s(&data("refgrad/mlp/mlp.target.npy"))));
    let out = ok(&["run", &p, "--steps", "3", "--json", "--feed", &x, "--feed", &t, "--profile-ops", &prof]);
    let summary: serde_json::Value = out.lines().rev().find_map(|l| serde_json::from_str(l).ok()).unwrap();
    let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&prof).unwrap()).unwrap();
    let ranks = doc["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 4);
    for (r, peak) in ranks.iter().zip(summary["measured_peak_bytes"].as_array().unwrap()) {
        // Steps 2 and 3 (the first warms up).
        assert_eq!(r["steps"], 2);
        let secs: f64 = r["seconds"].as_object().unwrap().values().map(|v| v.as_f64().unwrap()).sum();
        let step = r["step_seconds"].as_f64().unwrap();
        assert!(secs > 0.5 * step && secs <= 1.01 * step, "instructions {secs} s of a {step} s step");
        let held = r["memory"].as_array().unwrap().iter().map(|m| m[1].as_u64().unwrap()).max().unwrap();
        let peak = peak.as_u64().unwrap();
        assert!(held <= peak && held as f64 >= 0.9 * peak as f64, "held {held}, peak {peak}");
    }
    let html = s(&dir.path().join("m.html"));
    let text = ok(&["explain", &p, "--measured", &prof, "--html", &html]);
    assert!(text.contains("measured  4 rank(s), 2 step(s)") && text.contains("collective all-reduce"), "{text}");
    // The measurements drawn beside the estimates: the 4 ranks of this dp plan held the same bytes.
    let page = std::fs::read_to_string(&html).unwrap();
    assert!(page.contains("Memory over the step per rank: estimated and measured"));
    assert!(page.contains("measured, ranks 0-3") || page.contains("measured, rank 0"), "no measured memory line");
    assert!(page.contains("Time per op family: estimated and measured") && page.contains(">measured</text>"));
    // Measurements of another plan are refused.
    let other = s(&dir.path().join("megatron.json"));
    let mut args = vec!["plan", &model, "--mesh", "2x2", "--memory", "4GiB", "--loss", "mse:y:target"];
    args.extend(["--strategy", "megatron", "-o", &other]);
    ok(&args);
    let out = autopar(&["explain", &other, "--measured", &prof]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("measured on another plan"), "{err}");
}

/// `autopar bench`: plans of one model measured together, taking turns in one process.
#[test]
fn bench_measures_plans_taking_turns() {
    let dir = tempfile::tempdir().unwrap();
    let m = &MODELS[0];
    let model = s(&data(&format!("models/{}.onnx", m.name)));
    let mut plans = vec![];
    for (strategy, mesh) in [("dp", "1x2"), ("megatron", "1x2"), ("dp", "2x2")] {
        let out = s(&dir.path().join(format!("{strategy}-{mesh}.json")));
        ok(&["plan", &model, "--mesh", mesh, "--memory", "4GiB", "--loss", m.loss, "--strategy", strategy, "-o", &out]);
        plans.push(out);
    }
    let feeds = feed_args(m);
    let mut args: Vec<&str> = vec!["bench", &plans[0], &plans[1], "--turns", "3", "--seconds", "0.001", "--json"];
    args.extend(feeds.iter().map(|f| f.as_str()));
    let out = ok(&args);
    let lines: Vec<serde_json::Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 2, "{out}");
    for (l, p) in lines.iter().zip(&plans) {
        assert_eq!(l["plan"], p.as_str(), "{l}");
        // At least --min-steps (3) steps a turn; a median step per turn, the first step left out.
        assert_eq!(l["steps_per_turn"], 3, "{l}");
        let turns = l["turns_ms"].as_array().unwrap();
        assert_eq!(turns.len(), 3, "{l}");
        assert!(turns.iter().all(|t| t.as_f64().unwrap() > 0.0), "{l}");
        assert!(l["estimated_step_ms"].as_f64().unwrap() > 0.0, "{l}");
        assert!(l["vs_fastest"].as_f64().unwrap() >= 1.0 && l["vs_fastest_paired"].as_f64().unwrap() >= 1.0, "{l}");
    }
    assert!(lines.iter().any(|l| l["vs_fastest"] == 1.0), "{out}");
    // The table, with one row per plan.
    args.retain(|a| *a != "--json");
    let table = ok(&args);
    assert!(table.contains("2 plan(s) on 2 rank(s) as threads, 3 turn(s)"), "{table}");
    assert_eq!(table.lines().filter(|l| l.contains("-1x2.json")).count(), 2, "{table}");
    // Plans on different numbers of ranks cannot take turns.
    let mut args: Vec<&str> = vec!["bench", &plans[0], &plans[2], "--turns", "1"];
    args.extend(feeds.iter().map(|f| f.as_str()));
    let out = autopar(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("dp-2x2.json runs on 4 ranks") && err.contains("same ranks"),
        "{err}"
    );
    // A missing feed stops the bench with the run's error, naming the plan and the input.
    let out = autopar(&["bench", &plans[1], &plans[0], "--turns", "1", "--feed", &feeds[1]]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains(&format!("{}: ", plans[1])) && err.contains("target"), "{err}");
}
