//! Tests of the `autopar` binary: `inspect` and `infer` on the bundled models
//! (`tests/data/models`), and bad input of every kind.
//!
//! Bad input never panics: each bad case must exit non-zero with exactly one line on stderr that
//! starts with `error:`, names the problem (a key phrase is asserted) and has no panic text.
//! The hand-made bad models in `tests/data/bad` are built by `tests/examples/make_bad_models.rs`;
//! files that need no ONNX encoder (truncated, random bytes, `.npy` feeds) are made here in a
//! temporary directory.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use npyz::WriterBuilder;

/// Largest allowed `max|a - b| / max|b|` between an `infer` output and PyTorch's.
const MAX_REL_ERR: f32 = 1e-4;

fn data(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(rel)
}

fn model(name: &str) -> String {
    data("models").join(name).display().to_string()
}

fn autopar(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_autopar"))
        .args(args)
        .env_remove("AUTOPAR_LOG")
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("running the autopar binary")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Asserts a success and returns stdout.
fn ok(args: &[&str]) -> String {
    let out = autopar(args);
    assert!(out.status.success(), "autopar {} failed ({}):\n{}", args.join(" "), out.status, stderr(&out));
    stdout(&out)
}

/// Asserts a clean failure: non-zero exit, one `error:` line on stderr containing every phrase,
/// no panic. Returns the line.
fn fails(args: &[&str], phrases: &[&str]) -> String {
    let out = autopar(args);
    let err = stderr(&out);
    let cmd = format!("autopar {}", args.join(" "));
    assert!(!out.status.success(), "{cmd} succeeded; stdout:\n{}", stdout(&out));
    assert!(out.status.code().is_some(), "{cmd} was killed by a signal ({})", out.status);
    assert!(!err.contains("panicked"), "{cmd} panicked:\n{err}");
    // Warnings (tied parameters, say) may precede the error.
    let lines: Vec<&str> = err.lines().filter(|l| !l.starts_with("warning:")).collect();
    assert_eq!(lines.len(), 1, "{cmd}: expected one error line on stderr, got:\n{err}");
    assert!(lines[0].starts_with("error: "), "{cmd}: stderr does not start with `error: `: {err}");
    for p in phrases {
        assert!(lines[0].contains(p), "{cmd}: the error does not mention `{p}`: {err}");
    }
    lines[0].to_string()
}

fn inspect_json(model_path: &str) -> serde_json::Value {
    let out = ok(&["inspect", model_path, "--json"]);
    serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("inspect --json printed invalid JSON ({e}):\n{out}"))
}

fn max_rel_err(got: &ir::Tensor, want: &ir::Tensor) -> f32 {
    let (Some(a), Some(b)) = (got.as_f32(), want.as_f32()) else {
        return f32::INFINITY;
    };
    if got.shape() != want.shape() || a.iter().chain(b).any(|x| !x.is_finite()) {
        return f32::INFINITY;
    }
    let max_diff = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max);
    max_diff / b.iter().map(|y| y.abs()).fold(0.0, f32::max)
}

fn read_npy(path: &Path) -> ir::Tensor {
    runtime::npy::read_npy(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

fn write_npy(path: &Path, t: &ir::Tensor) -> String {
    runtime::npy::write_npy(path, t).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
    path.display().to_string()
}

fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().expect("creating a temporary directory")
}

// ---------------------------------------------------------------------------------------------
// inspect

#[test]
fn inspect_mlp_reports_parameters() {
    let out = ok(&["inspect", &model("mlp.onnx")]);
    assert!(out.contains("1575680 parameters"), "inspect mlp:\n{out}");
    assert!(out.contains("x") && out.contains("f32[32,256]"), "inspect mlp lists the input:\n{out}");
    let j = inspect_json(&model("mlp.onnx"));
    assert_eq!(j["params"], 1_575_680, "{j}");
    assert_eq!(j["inputs"][0]["name"], "x", "{j}");
    assert_eq!(j["outputs"][0]["name"], "y", "{j}");
}

#[test]
fn inspect_ops_lists_supported_ops() {
    let out = ok(&["inspect", "--ops"]);
    for op in ["MatMul", "Gemm", "Conv", "LayerNormalization", "Softmax", "Gather"] {
        assert!(out.contains(op), "inspect --ops does not list {op}:\n{out}");
    }
    assert!(!out.contains("NonZero"), "NonZero is listed but unsupported:\n{out}");
}

#[test]
fn inspect_gpt2_small_without_weights() {
    let out = ok(&["inspect", &model("gpt2-small-graph-only.onnx")]);
    assert!(out.contains("162922752 parameters"), "inspect gpt2-small:\n{out}");
    let params = inspect_json(&model("gpt2-small-graph-only.onnx"))["params"].as_u64().expect("params");
    assert!((162_000_000..=164_000_000).contains(&params), "gpt2-small has {params} parameters, expected ~163M");
}

#[test]
fn inspect_light_cnns() {
    for (file, params) in [("light/light_resnet50.onnx", 25_610_152), ("light/light_vgg19.onnx", 143_667_240)] {
        let j = inspect_json(&model(file));
        assert_eq!(j["params"], params, "{file}: {j}");
        assert_eq!(j["outputs"][0]["type"], "f32[1,1000]", "{file}: {j}");
    }
}

#[test]
fn inspect_binds_a_dynamic_dim() {
    let out = ok(&["inspect", &data("bad/dynamic_dim.onnx").display().to_string(), "--input", "x=3x4"]);
    assert!(out.contains("f32[3,4]"), "inspect dynamic_dim --input x=3x4:\n{out}");
}

// ---------------------------------------------------------------------------------------------
// infer: every bundled model reproduces PyTorch's outputs

fn infer_matches_pytorch(name: &str, inputs: &[&str], outputs: &[&str]) {
    let dir = tempdir();
    let feeds: Vec<String> = inputs.iter().map(|i| format!("{i}={}", model(&format!("{name}.{i}.npy")))).collect();
    let mut args = vec!["infer", &*model(&format!("{name}.onnx"))].into_iter().map(String::from).collect::<Vec<_>>();
    for f in &feeds {
        args.extend(["--feed".to_string(), f.clone()]);
    }
    args.extend(["--out".to_string(), dir.path().display().to_string()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    ok(&args);
    for out in outputs {
        let got = read_npy(&dir.path().join(format!("{out}.npy")));
        let want = read_npy(&data("models").join(format!("{name}.{out}.npy")));
        let err = max_rel_err(&got, &want);
        assert!(
            err <= MAX_REL_ERR,
            "{name}: {out}: max relative error {err:e} > {MAX_REL_ERR:e} ({} vs {})",
            got.meta(),
            want.meta()
        );
    }
}

#[test]
fn infer_mlp_matches_pytorch() {
    infer_matches_pytorch("mlp", &["x"], &["y"]);
}

#[test]
fn infer_gpt2_tiny_matches_pytorch() {
    infer_matches_pytorch("gpt2-tiny", &["input_ids"], &["logits"]);
}

#[test]
fn infer_bert_tiny_matches_pytorch() {
    infer_matches_pytorch("bert-tiny", &["input_ids", "attention_mask"], &["last_hidden_state", "pooler_output"]);
}

#[test]
fn infer_resnet18_matches_pytorch() {
    infer_matches_pytorch("resnet18", &["input"], &["logits"]);
}

#[test]
fn infer_binds_dynamic_dims_from_feeds() {
    let dir = tempdir();
    let x = write_npy(&dir.path().join("x.npy"), &ir::Tensor::f32([3, 4], (0..12).map(|i| i as f32 - 6.0).collect()));
    let out = dir.path().join("out");
    ok(&[
        "infer",
        &data("bad/dynamic_dim.onnx").display().to_string(),
        "--feed",
        &format!("x={x}"),
        "--out",
        &out.display().to_string(),
    ]);
    let y = read_npy(&out.join("y.npy"));
    assert_eq!(y.shape(), [3, 4]);
    assert_eq!(y.as_f32().expect("f32"), (0..12).map(|i| (i as f32 - 6.0).max(0.0)).collect::<Vec<_>>());
}

// ---------------------------------------------------------------------------------------------
// bad model files

#[test]
fn truncated_model() {
    let dir = tempdir();
    let bytes = std::fs::read(model("mlp.onnx")).expect("reading mlp.onnx");
    let path = dir.path().join("truncated.onnx");
    std::fs::write(&path, &bytes[..1000]).expect("writing");
    let p = path.display().to_string();
    fails(&["inspect", &p], &["truncated.onnx", "is not a valid ONNX model"]);
    fails(&["infer", &p, "--feed", &format!("x={}", model("mlp.x.npy"))], &["is not a valid ONNX model"]);
}

#[test]
fn random_bytes_model() {
    let dir = tempdir();
    // xorshift64: the same "random" bytes on every run.
    let mut s = 0x9E37_79B9_7F4A_7C15_u64;
    let bytes: Vec<u8> = (0..4096)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 24) as u8
        })
        .collect();
    let path = dir.path().join("random.onnx");
    std::fs::write(&path, bytes).expect("writing");
    fails(&["inspect", &path.display().to_string()], &["random.onnx", "is not a valid ONNX model"]);
}

#[test]
fn empty_model_file() {
    let dir = tempdir();
    let path = dir.path().join("empty.onnx");
    std::fs::write(&path, b"").expect("writing");
    fails(&["inspect", &path.display().to_string()], &["empty.onnx", "is not a valid ONNX model"]);
}

#[test]
fn nonexistent_model() {
    fails(&["inspect", "no/such/model.onnx"], &["no/such/model.onnx", "does not exist"]);
    fails(
        &["infer", "no/such/model.onnx", "--feed", &format!("x={}", model("mlp.x.npy"))],
        &["no/such/model.onnx", "does not exist"],
    );
}

#[test]
fn unsupported_op() {
    let p = data("bad/unsupported_op.onnx").display().to_string();
    // NonZero's output size depends on the values: the error says why and what to export instead.
    fails(
        &["inspect", &p],
        &["nonzero_0", "NonZero", "depends on the input values", "torch.where", "one-hot dispatch"],
    );
}

#[test]
fn unbound_dynamic_dim() {
    let p = data("bad/dynamic_dim.onnx").display().to_string();
    fails(&["inspect", &p], &["input x", "batch", "--input x="]);
}

#[test]
fn shape_mismatch_in_graph() {
    let p = data("bad/shape_mismatch.onnx").display().to_string();
    fails(&["inspect", &p], &["matmul_0", "MatMul"]);
}

// ---------------------------------------------------------------------------------------------
// bad options and feeds

#[test]
fn malformed_input_binding() {
    let m = model("mlp.onnx");
    fails(&["inspect", &m, "--input", "x32x256"], &["x32x256", "NAME=DIMS"]);
    fails(&["inspect", &m, "--input", "x=32xab"], &["ab", "not a dimension"]);
    fails(&["inspect", &m, "--input", "=32x256"], &["no input name"]);
    fails(&["inspect", &m, "--input", "z=32x256"], &["--input z", "no input of that name", "inputs: x"]);
    fails(&["inspect", &m, "--input", "x=2x3x4"], &["--input x", "rank 2"]);
}

#[test]
fn missing_feed() {
    let dir = tempdir();
    let out = dir.path().display().to_string();
    fails(&["infer", &model("mlp.onnx"), "--out", &out], &["missing feed for input x", "--feed x="]);
    let ids = format!("input_ids={}", model("bert-tiny.input_ids.npy"));
    fails(
        &["infer", &model("bert-tiny.onnx"), "--feed", &ids, "--out", &out],
        &["missing feed for input attention_mask"],
    );
}

#[test]
fn malformed_or_unknown_feed() {
    let m = model("mlp.onnx");
    fails(&["infer", &m, "--feed", "x.npy"], &["--feed `x.npy`", "NAME=FILE.npy"]);
    fails(
        &["infer", &m, "--feed", &format!("z={}", model("mlp.x.npy"))],
        &["--feed z", "no input of that name", "inputs: x"],
    );
    fails(&["infer", &m, "--feed", "x=no/such/x.npy"], &["--feed x", "no/such/x.npy"]);
    fails(&["infer", &m, "--feed", &format!("x={m}")], &["--feed x", "not a valid .npy file"]);
}

#[test]
fn feed_of_wrong_dtype() {
    let dir = tempdir();
    let out = dir.path().join("out").display().to_string();
    // float64 data for an f32 model: a dtype mismatch (f64 files are read, for the checkpoints of
    // `--precision f64` runs, but never rounded to f32 silently).
    let x64 = dir.path().join("x64.npy");
    let file = std::fs::File::create(&x64).expect("creating x64.npy");
    let mut w =
        npyz::WriteOptions::new().default_dtype().shape(&[32, 256]).writer(file).begin_nd().expect("npy header");
    w.extend(std::iter::repeat_n(0.5f64, 32 * 256)).expect("npy data");
    w.finish().expect("npy finish");
    fails(
        &["infer", &model("mlp.onnx"), "--feed", &format!("x={}", x64.display()), "--out", &out],
        &["feed x", "f64[32,256]", "f32[32,256]"],
    );
    // float32 token ids for an int64 input.
    let ids = write_npy(&dir.path().join("ids.npy"), &ir::Tensor::f32([2, 64], vec![1.0; 128]));
    fails(
        &["infer", &model("gpt2-tiny.onnx"), "--feed", &format!("input_ids={ids}"), "--out", &out],
        &["input_ids", "f32[2,64]", "i64[2,64]"],
    );
}

#[test]
fn feed_of_wrong_shape() {
    let dir = tempdir();
    let out = dir.path().join("out").display().to_string();
    let m = model("mlp.onnx");
    // mlp's x is f32[32,256]: a feed that contradicts a static dim or the rank names the feed.
    let x = write_npy(&dir.path().join("x.npy"), &ir::Tensor::f32([32, 255], vec![0.0; 32 * 255]));
    fails(&["infer", &m, "--feed", &format!("x={x}"), "--out", &out], &["feed x", "f32[32,255]", "f32[32,256]"]);
    let x3 = write_npy(&dir.path().join("x3.npy"), &ir::Tensor::f32([2, 32, 256], vec![0.0; 2 * 32 * 256]));
    fails(&["infer", &m, "--feed", &format!("x={x3}"), "--out", &out], &["feed x", "f32[2,32,256]", "f32[32,256]"]);
    let ids = write_npy(&dir.path().join("ids.npy"), &ir::Tensor::i64([2, 65], vec![1; 130]));
    let gpt2 = model("gpt2-tiny.onnx");
    let feed = format!("input_ids={ids}");
    fails(&["infer", &gpt2, "--feed", &feed, "--out", &out], &["feed input_ids", "i64[2,65]", "i64[2,64]"]);
    // With --input, the binding is what the feed must match.
    fails(
        &["infer", &gpt2, "--input", "input_ids=2x64", "--feed", &feed, "--out", &out],
        &["feed input_ids", "i64[2,65]", "i64[2,64]"],
    );
    // A feed of the wrong rank for a dynamic input.
    fails(
        &["infer", &data("bad/dynamic_dim.onnx").display().to_string(), "--feed", &format!("x={x3}"), "--out", &out],
        &["x"],
    );
}

#[test]
fn infer_input_overrides_static_dims() {
    // `--input` may rebind a static dim (here mlp's batch of 32) when the feed agrees.
    let dir = tempdir();
    let x = write_npy(&dir.path().join("x.npy"), &ir::Tensor::f32([16, 256], vec![0.25; 16 * 256]));
    let out = dir.path().join("out");
    ok(&[
        "infer",
        &model("mlp.onnx"),
        "--input",
        "x=16x256",
        "--feed",
        &format!("x={x}"),
        "--out",
        &out.display().to_string(),
    ]);
    assert_eq!(read_npy(&out.join("y.npy")).shape(), [16, 256]);
}

#[test]
fn weight_free_model_cannot_run() {
    let dir = tempdir();
    let ids = write_npy(&dir.path().join("ids.npy"), &ir::Tensor::i64([1, 128], vec![0; 128]));
    let out = dir.path().join("out").display().to_string();
    fails(
        &["infer", &model("gpt2-small-graph-only.onnx"), "--feed", &format!("input_ids={ids}"), "--out", &out],
        &["has no data", "weight-free"],
    );
}

/// An I/O error's cause appears once in the error line.
#[test]
fn io_errors_are_not_repeated() {
    let dir = tempdir();
    let line = fails(&["inspect", &dir.path().display().to_string()], &["cannot read"]);
    assert_eq!(line.matches("not a regular file (a directory)").count(), 1, "{line}");
    let line = fails(&["infer", &model("mlp.onnx"), "--feed", "x=no/such/x.npy"], &["no/such/x.npy"]);
    assert_eq!(line.matches("os error").count(), 1, "{line}");
}

#[test]
fn closed_stdout_is_not_a_panic() {
    // `autopar inspect model | head -1`: once the reader is gone, printing fails with EPIPE.
    let (reader, writer) = std::io::pipe().expect("creating a pipe");
    drop(reader);
    let out = Command::new(env!("CARGO_BIN_EXE_autopar"))
        .args(["inspect", &model("mlp.onnx")])
        .env("RUST_BACKTRACE", "0")
        .stdout(writer)
        .stderr(std::process::Stdio::piped())
        .output()
        .expect("running the autopar binary");
    let err = stderr(&out);
    assert!(!err.contains("panicked"), "inspect into a closed pipe panicked:\n{err}");
    assert!(err.lines().count() <= 1, "{err}");
}

// ---------------------------------------------------------------------------------------------
// train

/// Runs `autopar train ... --json` and returns the loss of every step.
fn train_losses(args: &[&str]) -> Vec<f64> {
    let mut all = vec!["train"];
    all.extend_from_slice(args);
    all.push("--json");
    let out = ok(&all);
    out.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("bad JSON line ({e}): {l}"));
            v["loss"].as_f64().unwrap_or_else(|| panic!("no loss in {l}"))
        })
        .collect()
}

/// Issue 3, acceptance 3: AdamW on a repeated batch drives gpt2-tiny's next-token loss down.
#[test]
fn train_gpt2_tiny_adamw_loss_falls() {
    let ids = format!("input_ids={}", data("models/gpt2-tiny.input_ids.npy").display());
    let args =
        ["--feed", &ids, "--loss", "ce-next:logits:input_ids", "--optimizer", "adamw", "--lr", "1e-3", "--steps", "50"];
    let losses = train_losses(&[&[model("gpt2-tiny.onnx").as_str()][..], &args[..]].concat());
    assert_eq!(losses.len(), 50);
    // PyTorch's loss at the initial weights (tests/data/refgrad/gpt2-tiny/loss.json).
    assert!((losses[0] - 6.93473053).abs() < 1e-4 * 6.93473053, "first loss {}", losses[0]);
    let last = *losses.last().unwrap();
    assert!(last < 0.5 * losses[0], "loss did not fall enough: {losses:?}");
    // Mostly monotone: the last ten losses are below the first ten.
    let mean = |s: &[f64]| s.iter().sum::<f64>() / s.len() as f64;
    assert!(mean(&losses[40..]) < mean(&losses[..10]), "{losses:?}");
}

/// Saving after 2 steps and resuming for 1 gives exactly the 3-step run (parameters, AdamW
/// moments and its step counter are all restored).
#[test]
fn train_save_and_load_resume_exactly() {
    let dir = tempdir();
    let ckpt = dir.path().join("ckpt").display().to_string();
    let x = format!("x={}", data("models/mlp.x.npy").display());
    let t = format!("target={}", data("refgrad/mlp/mlp.target.npy").display());
    let m = model("mlp.onnx");
    let base = ["--feed", &x, "--feed", &t, "--loss", "mse:y:target", "--optimizer", "adamw", "--lr", "1e-3"];
    let with = |extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = vec![m.clone()];
        v.extend(base.iter().map(|s| s.to_string()));
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let three = train_losses(&with(&["--steps", "3"]).iter().map(String::as_str).collect::<Vec<_>>());
    let two = train_losses(&with(&["--steps", "2", "--save", &ckpt]).iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(two, three[..2]);
    for f in ["params.npz", "state.npz", "trainer.json"] {
        assert!(dir.path().join("ckpt").join(f).exists(), "--save did not write {f}");
    }
    let mut args = vec!["train".to_string()];
    args.extend(with(&["--steps", "1", "--load", &ckpt, "--json"]));
    let out = ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let line: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON line");
    assert_eq!(line["step"], 3, "{out}");
    assert_eq!(line["loss"].as_f64(), Some(three[2]), "{out}");
}

#[test]
fn train_prints_losses_and_graph() {
    let x = format!("x={}", data("models/mlp.x.npy").display());
    let t = format!("target={}", data("refgrad/mlp/mlp.target.npy").display());
    let m = model("mlp.onnx");
    let args = ["train", &m, "--feed", &x, "--feed", &t, "--loss", "mse:y:target", "--optimizer", "sgd", "--lr", "0.1"];
    let out = ok(&[&args[..], &["--steps", "2"]].concat());
    assert!(out.contains("step    1  loss 2.0155"), "{out}");
    assert!(out.contains("activations kept for backward"), "{out}");
    let text = ok(&[&args[..], &["--graph"]].concat());
    assert!(text.contains("sgd_update") && text.contains("update %"), "{text}");
    let g = ir::Graph::parse(&text).expect("train --graph prints parseable IR");
    ir::verify(&g).expect("the printed training graph verifies");
}

#[test]
fn train_bad_input() {
    let m = model("mlp.onnx");
    let x = format!("x={}", data("models/mlp.x.npy").display());
    let t = format!("target={}", data("refgrad/mlp/mlp.target.npy").display());
    fails(&["train", &m, "--feed", &x, "--loss", "l1:y:target"], &["unknown kind", "mse:OUTPUT:TARGET"]);
    fails(&["train", &m, "--feed", &x, "--loss", "mse:y"], &["mse:y", "expected"]);
    fails(&["train", &m, "--feed", &x, "--feed", &t, "--loss", "mse:logits:target"], &["no output logits", "y"]);
    fails(&["train", &m, "--feed", &x, "--loss", "mse:y:target"], &["missing feed for input target"]);
    fails(&["train", &m, "--feed", &x, "--feed", &t, "--loss", "ce:y:target"], &["target", "i64"]);
    fails(
        &["train", &m, "--feed", &x, "--feed", &t, "--loss", "mse:y:target", "--freeze", "nope"],
        &["cannot freeze nope"],
    );
    fails(
        &["train", &m, "--feed", &x, "--feed", &t, "--loss", "mse:y:target", "--load", "/no/such/ckpt"],
        &["--load", "params.npz"],
    );
    let ids = format!("input_ids={}", data("models/gpt2-tiny.input_ids.npy").display());
    fails(
        &["train", &model("gpt2-tiny.onnx"), "--feed", &ids, "--loss", "ce-next:logits:tokens"],
        &["no input tokens"],
    );
}

// ---------------------------------------------------------------------------------------------
// solve

fn solver_data(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("solver/tests/data").join(name).display().to_string()
}

#[test]
fn solve_example_writes_solution() {
    let dir = tempdir();
    let out = dir.path().join("sol.json").display().to_string();
    let text = ok(&["solve", &solver_data("example.json"), "--time-limit", "10", "--out", &out]);
    assert!(text.contains("cost      445") && text.contains("Optimal"), "{text}");
    let sol: Vec<usize> = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(sol.len(), 5);
    // --check evaluates a given solution with the same semantics.
    let json = ok(&["solve", &solver_data("example.json"), "--check", &out, "--json"]);
    let v: serde_json::Value = serde_json::from_str(json.trim()).unwrap();
    assert_eq!(v["cost"], 445, "{json}");
    assert_eq!(v["feasible"], true, "{json}");
}

#[test]
fn solve_bad_problems() {
    let dir = tempdir();
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "{\"problem\": [").unwrap();
    fails(&["solve", &bad.display().to_string()], &["bad.json", "not a valid IOPDDL file"]);
    let text = std::fs::read_to_string(solver_data("example.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["problem"]["usage_limit"] = 10.into();
    let inf = dir.path().join("inf.json");
    std::fs::write(&inf, v.to_string()).unwrap();
    fails(&["solve", &inf.display().to_string()], &["infeasible", "minimum possible peak usage is 50", "time step"]);
    fails(&["solve", "no/such/problem.json"], &["no/such/problem.json"]);
}

/// Compares `text` with the golden file `tests/data/golden/NAME` (rewritten when `BLESS=1`).
fn golden(name: &str, text: &str) {
    let path = data("golden").join(name);
    if std::env::var("BLESS").is_ok_and(|v| v == "1") {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, text).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run with BLESS=1 to create it)", path.display()));
    if want != text {
        let first = want.lines().zip(text.lines()).position(|(a, b)| a != b).unwrap_or(0);
        panic!(
            "{} differs at line {} (BLESS=1 rewrites it):\n  want: {}\n  got:  {}",
            path.display(),
            first + 1,
            want.lines().nth(first).unwrap_or("<end>"),
            text.lines().nth(first).unwrap_or("<end>")
        );
    }
}

/// Issue 4, acceptance 4: the strategies of the MLP's linear pair and of one AdamW update on a
/// 2x4 mesh include data parallel, Megatron column and row, and ZeRO, with seconds and bytes.
#[test]
fn strategies_mlp_golden() {
    let out = autopar(&[
        "strategies",
        &model("mlp.onnx"),
        "--mesh",
        "2x4",
        "--loss",
        "mse:y:t",
        "--node",
        "/fc1/Gemm",
        "--node",
        "/fc2/Gemm",
        "--node",
        "update/fc1.weight",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    for tag in ["[dp]", "megatron-col", "megatron-row", "[zero]", " s  comm ", " B"] {
        assert!(text.contains(tag), "no `{tag}` in\n{text}");
    }
    golden("strategies_mlp_2x4.txt", &text);
}

/// Issue 4, acceptance 4: one gpt2-tiny block on 2x4 (attention and MLP linears, attention
/// matmul and softmax, layer norm, embedding, the loss's log-softmax, a ZeRO-able update).
#[test]
fn strategies_gpt2_block_golden() {
    let mut args = vec!["strategies".to_string(), model("gpt2-tiny.onnx")];
    args.extend(["--mesh", "2x4", "--loss", "ce-next:logits:input_ids"].map(String::from));
    for n in [
        "/m/transformer/wte/Gather",
        "/m/transformer/h.0/ln_1/LayerNormalization",
        "/m/transformer/h.0/attn/c_attn/Gemm",
        "/m/transformer/h.0/attn/MatMul",
        "/m/transformer/h.0/attn/Softmax",
        "/m/transformer/h.0/attn/c_proj/Gemm",
        "/m/transformer/h.0/mlp/c_fc/Gemm",
        "/m/transformer/h.0/mlp/c_proj/Gemm",
        "loss/log_softmax",
        "update/m.transformer.h.0.mlp.c_fc.weight",
    ] {
        args.extend(["--node".to_string(), n.to_string()]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = autopar(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    for tag in ["[dp]", "megatron-col", "megatron-row", "zero", "vocab-parallel", "head-parallel", "sequence-parallel"]
    {
        assert!(text.contains(tag), "no `{tag}` in the listing");
    }
    golden("strategies_gpt2_block_2x4.txt", &text);
}

/// Issue 4, acceptance 5: `autopar reshard` prints the collectives and their cost; a malformed
/// spec or an indivisible shape is a one-line error.
#[test]
fn reshard_prints_path_and_rejects_bad_specs() {
    let out = autopar(&["reshard", "--mesh", "2x4", "--shape", "8x16x32", "S0 R R", "R S01 R"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("all-to-all") && text.contains("total "), "{text}");
    let out = autopar(&["reshard", "--mesh", "2x4", "--shape", "8x16x32", "R R R | P1", "R S1 R"]);
    assert!(stdout(&out).contains("reduce-scatter"), "{}", stdout(&out));
    for (args, phrase) in [
        (vec!["--shape", "8x16x32", "S0 Q R", "R S01 R"], "malformed sharding spec"),
        (vec!["--shape", "8x16x32", "S0 R", "R S01 R"], "has 2 dims, the tensor 3"),
        (vec!["--shape", "6x16x32", "S01 R R", "R R R"], "not divisible by 8"),
        (vec!["--shape", "8x16x32", "S0 R S0", "R R R"], "appears twice"),
        (vec!["--shape", "8x16x32", "S2 R R", "R R R"], "mesh axis 2 does not exist"),
        (vec!["--shape", "8xa", "R R", "R R"], "--shape"),
    ] {
        let mut full = vec!["reshard", "--mesh", "2x4"];
        full.extend(args);
        let out = autopar(&full);
        assert!(!out.status.success());
        let err = stderr(&out);
        assert!(
            err.starts_with("error:") && err.trim().lines().count() == 1 && err.contains(phrase),
            "{phrase}: {err}"
        );
    }
    let out = autopar(&["reshard", "--mesh", "2y4", "--shape", "8", "R", "R"]);
    assert!(stderr(&out).contains("invalid mesh"), "{}", stderr(&out));
}

/// `--accumulate f64` trains the same model: its losses agree with f32 accumulation to 1e-5.
#[test]
fn train_with_f64_accumulation() {
    let x = format!("x={}", data("models/mlp.x.npy").display());
    let t = format!("target={}", data("refgrad/mlp/mlp.target.npy").display());
    let m = model("mlp.onnx");
    let base = [m.as_str(), "--feed", &x, "--feed", &t, "--loss", "mse:y:target", "--optimizer", "sgd", "--steps", "3"];
    let f32_losses = train_losses(&base);
    let f64_losses = train_losses(&[&base[..], &["--accumulate", "f64"][..]].concat());
    for (a, b) in f32_losses.iter().zip(&f64_losses) {
        assert!((a - b).abs() <= 1e-5 * b.abs(), "{f32_losses:?} vs {f64_losses:?}");
    }
}

/// Issue 6: `autopar autoparallelize` (and its alias `plan`) writes a plan and prints the
/// one-screen summary; `explain` reads it back and renders DOT and HTML; bad input is one line.
#[test]
fn autoparallelize_and_explain() {
    let dir = tempdir();
    let plan = dir.path().join("plan.json").display().to_string();
    let m = model("mlp.onnx");
    let out = ok(&[
        "autoparallelize",
        &m,
        "--mesh",
        "2x2",
        "--memory",
        "1GiB",
        "--loss",
        "mse:y:t",
        "--time-limit",
        "2",
        "-o",
        &plan,
    ]);
    for k in ["step ", "memory ", "comms ", "params ", "solver ", "wrote "] {
        assert!(out.lines().any(|l| l.starts_with(k)), "no `{k}` line in\n{out}");
    }
    // `--min-gain` is a percentage; plan.json records it as a fraction (1% by default).
    let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&plan).unwrap()).unwrap();
    assert_eq!(doc["options"]["min_gain"], 0.01, "{}", doc["options"]);
    let html = dir.path().join("plan.html").display().to_string();
    let dot = dir.path().join("plan.dot").display().to_string();
    let out = ok(&["explain", &plan, "--html", &html, "--dot", &dot]);
    assert!(out.contains("plan      mlp on mesh 2x2"), "{out}");
    let page = std::fs::read_to_string(&html).unwrap();
    assert!(page.contains("<h2>Program</h2>"));
    // Its figures, found by id; no pipeline stages, so no timeline; SPMD, so one memory line.
    for id in ["memory", "families", "mesh"] {
        assert!(page.contains(&format!("<figure id=\"{id}\">\n<svg")), "no figure {id}");
    }
    assert!(!page.contains("<figure id=\"timeline\">") && page.contains("estimated (every rank)"));
    assert!(std::fs::read_to_string(&dot).unwrap().starts_with("digraph plan"));
    // The alias, a manual baseline.
    let out = ok(&[
        "plan",
        &m,
        "--mesh",
        "2x2",
        "--memory",
        "1GiB",
        "--loss",
        "mse:y:t",
        "--strategy",
        "megatron",
        "-o",
        &plan,
    ]);
    assert!(out.contains("strategy megatron"), "{out}");
    fails(
        &["plan", &m, "--mesh", "2x2", "--memory", "1KiB", "--loss", "mse:y:t", "-o", &plan],
        &["no plan fits 1.00 KiB per rank", "use --memory"],
    );
    fails(&["plan", &m, "--mesh", "2x2", "--memory", "lots", "-o", &plan], &["--memory", "lots"]);
    fails(
        &["plan", &m, "--mesh", "2x2", "--memory", "1GiB", "--min-gain", "150", "-o", &plan],
        &["--min-gain", "`150` is not a percentage from 0 to 100"],
    );
    fails(
        &["plan", &m, "--mesh", "2x2", "--memory", "1GiB", "--strategy", "fsdp", "-o", &plan],
        &["unknown strategy `fsdp`"],
    );
    std::fs::write(&plan, "{\"version\": 1}").unwrap();
    fails(&["explain", &plan], &["invalid plan"]);
}

/// Issue 6: `autopar gen gpt` writes a weight-free GPT that imports with the parameter count it
/// reports and can be planned; bad sizes are one-line errors.
#[test]
fn gen_gpt_then_plan() {
    let dir = tempdir();
    let m = dir.path().join("gpt.onnx").display().to_string();
    let out = ok(&[
        "gen", "gpt", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "32", "--vocab", "128", "--batch",
        "4", "-o", &m,
    ]);
    assert!(out.contains("GPT with 2 layers"), "{out}");
    let inspect = ok(&["inspect", &m]);
    // 128*64 + 32*64 + 2 * (blocks) + final LN + head, as GptConfig::parameters computes.
    let block = 2 * 64 + (64 * 192 + 192) + (64 * 64 + 64) + 2 * 64 + (64 * 256 + 256) + (256 * 64 + 64);
    let params = 128 * 64 + 32 * 64 + 2 * block + 2 * 64 + 64 * 128;
    assert!(inspect.contains(&format!("({params} parameters")), "{inspect}");
    let plan = dir.path().join("plan.json").display().to_string();
    let out = ok(&["plan", &m, "--mesh", "2x2", "--memory", "1GiB", "--time-limit", "2", "-o", &plan]);
    assert!(out.contains("plan      gpt on mesh 2x2"), "{out}");
    fails(
        &["gen", "gpt", "--layers", "2", "--hidden", "64", "--heads", "5", "-o", &m],
        &["--heads 5 does not divide --hidden 64"],
    );
}

/// Issue 20: a cluster mesh with a link per axis (a third tier by bandwidth, a named one, the
/// profile's default) plans, and `plan.json` records each axis's link; a bad link is one clear
/// line.
#[test]
fn cluster_meshes_state_their_links_per_axis() {
    let dir = tempdir();
    let plan = dir.path().join("plan.json").display().to_string();
    let m = model("mlp.onnx");
    let mesh = "pod=2:25GB/s+30us,node=2:ib,gpu=2";
    ok(&["plan", &m, "--mesh", mesh, "--memory", "1GiB", "--device", "h100", "--loss", "mse:y:t", "-o", &plan]);
    let p: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&plan).unwrap()).unwrap();
    let links = &p["mesh"]["links"];
    assert_eq!(p["mesh"]["names"], serde_json::json!(["pod", "node", "gpu"]));
    assert_eq!(links[0]["alpha"].as_f64(), Some(30e-6), "{links}");
    assert_eq!(links[0]["beta"].as_f64(), Some(1.0 / 25e9), "{links}");
    // `ib` is the H100 profile's 50 GB/s across machines; the innermost axis fits in a node.
    assert_eq!(links[1]["beta"].as_f64(), Some(1.0 / 50e9), "{links}");
    assert_eq!(links[2]["beta"].as_f64(), Some(1.0 / 450e9), "{links}");
    fails(&["plan", &m, "--mesh", "a=2:fast,b=2", "--memory", "1GiB", "--loss", "mse:y:t"], &["`fast` is not a link"]);
    // Measured links replace every axis's: links in the mesh text beside them are refused.
    let measured = dir.path().join("mesh.json");
    std::fs::write(&measured, r#"{"axes": [{"alpha": 1e-5, "beta": 1e-10}, {"alpha": 1e-5, "beta": 1e-10}]}"#).unwrap();
    let measured = measured.display().to_string();
    let args =
        ["plan", &m, "--mesh", "a=2:ib,b=2", "--mesh-profile", &measured, "--memory", "1GiB", "--loss", "mse:y:t"];
    fails(&args, &["give one of them"]);
}

/// Issue 23: `train --save` also writes the parameters as `model.safetensors`, and
/// `--export-onnx` writes the model with its trained initializers: the exported file imports
/// with exactly the trained parameters (not the original ones), and `infer` runs it.
#[test]
fn trained_weights_leave_as_safetensors_and_onnx() {
    let dir = tempdir();
    let save = dir.path().join("saved");
    let onnx = dir.path().join("trained.onnx");
    let (x, t) = (format!("x={}", model("mlp.x.npy")), format!("t={}", model("mlp.y.npy")));
    let (save_s, onnx_s) = (save.display().to_string(), onnx.display().to_string());
    let m = model("mlp.onnx");
    let args = [
        "train",
        &m,
        "--loss",
        "mse:y:t",
        "--steps",
        "2",
        "--feed",
        &x,
        "--feed",
        &t,
        "--save",
        &save_s,
        "--export-onnx",
        &onnx_s,
    ];
    let out = ok(&args);
    assert!(out.contains("wrote the trained model to"), "{out}");
    let st = runtime::weights::read_safetensors(&save.join("model.safetensors")).unwrap();
    let npz = runtime::npy::read_npz(&save.join("params.npz")).unwrap();
    assert!(st == npz, "model.safetensors differs from params.npz");
    // The mlp's initializers are its PyTorch names.
    let names: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(save.join("names.json")).unwrap()).unwrap();
    let params = names["params"].as_object().unwrap();
    assert_eq!(params.keys().collect::<Vec<_>>(), st.keys().collect::<Vec<_>>());
    assert!(params.iter().all(|(k, v)| v[0]["name"] == k.as_str() && v[0]["transposed"] == false), "{names}");
    let trained = tracer::import_file(&onnx, &Default::default()).unwrap();
    let original = tracer::import_file(Path::new(&m), &Default::default()).unwrap();
    assert_eq!(trained.param_data.keys().collect::<Vec<_>>(), st.keys().collect::<Vec<_>>());
    assert!(trained.param_data == st, "the exported initializers are not the trained parameters");
    assert!(original.param_data != st, "training changed nothing");
    let out_dir = dir.path().join("out").display().to_string();
    ok(&["infer", &onnx_s, "--feed", &x, "--out", &out_dir]);
    assert!(dir.path().join("out/y.npy").exists());
    fails(
        &[
            "train",
            &m,
            "--loss",
            "mse:y:t",
            "--steps",
            "1",
            "--feed",
            &x,
            "--feed",
            &t,
            "--export-onnx",
            "/nonexistent/dir/m.onnx",
        ],
        &["--export-onnx /nonexistent/dir/m.onnx: the directory /nonexistent/dir does not exist"],
    );
}

#[test]
fn explain_draws_a_run_log_as_curves() {
    // A `train --json` log with evaluations: the summary, a page of SVG charts, the loss chart
    // alone; other lines (a run's summary) are skipped.
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("run.jsonl");
    let mut text = String::new();
    for s in 1..=20 {
        let eval = if s % 5 == 0 { format!(",\"eval_loss\":{}", 4.0 - s as f64 / 10.0) } else { String::new() };
        text += &format!(
            "{{\"step\":{s},\"loss\":{},\"ms\":10.0,\"samples_per_s\":800.0,\"lr\":{}{eval}}}\n",
            5.0 - s as f64 / 10.0,
            1e-3 * s as f64 / 20.0
        );
    }
    text += "{\"summary\":true,\"median_ms\":10.0}\n";
    std::fs::write(&log, text).unwrap();
    let (html, svg) = (dir.path().join("run.html"), dir.path().join("loss.svg"));
    let out = autopar(&[
        "explain",
        "--run",
        &log.display().to_string(),
        "--html",
        &html.display().to_string(),
        "--svg",
        &svg.display().to_string(),
        "--reference",
        "3.3:unigram entropy",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let o = stdout(&out);
    assert!(o.contains("20 steps (1 to 20); loss 4.9000 -> 3.0000") && o.contains("4 evaluations"), "{o}");
    let page = std::fs::read_to_string(&html).unwrap();
    // Loss (training and evaluation), learning rate and throughput.
    assert_eq!(page.matches("<svg").count(), 3, "{page}");
    assert_eq!(page.matches("<polyline").count(), 4);
    assert!(page.contains("unigram entropy") && page.contains("Learning rate"));
    let alone = std::fs::read_to_string(&svg).unwrap();
    assert!(alone.starts_with("<svg") && alone.matches("<polyline").count() == 2);
    // A file without step lines, and nothing to explain, are clear errors.
    std::fs::write(&log, "{\"summary\":true}\n").unwrap();
    let out = autopar(&["explain", "--run", &log.display().to_string()]);
    assert!(!out.status.success() && stderr(&out).contains("has no step lines"), "{}", stderr(&out));
    let out = autopar(&["explain"]);
    assert!(!out.status.success());
}
