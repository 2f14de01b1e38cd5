//! Hostile inputs: the findings of issue 50's reliability probe 2 (see main.rs), one test per
//! class: labels and token ids outside their bounds, a changed dataset on resume, saves killed
//! midway, outputs that cannot be written, a 64 GiB token file, measurements that do not fit
//! their plan, run logs with absurd steps or millions of lines, absurd device profiles, NaN in
//! the data or the weights, and two runs on one checkpoint directory.

use std::path::{Path, PathBuf};

use crate::common::onnx::{self, DataType};
use crate::common::*;

fn s(p: &Path) -> String {
    p.display().to_string()
}

fn write(path: &Path, bytes: Vec<u8>) -> String {
    std::fs::write(path, bytes).expect("writing a test file");
    s(path)
}

fn npy(path: &Path, t: ir::Tensor) -> String {
    runtime::npy::write_npy(path, &t).expect("writing a .npy file");
    s(path)
}

/// `logits = x @ w`: x f32[4,3], w f32[3,5] (5 classes).
fn classifier(root: &Path) -> String {
    let w: Vec<f32> = (0..15).map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.1).collect();
    write(
        &root.join("cls.onnx"),
        onnx::model(
            vec![onnx::node("head", "MatMul", &["x", "w"], &["logits"])],
            vec![onnx::floats("w", &[3, 5], &w)],
            vec![onnx::value_info("x", DataType::Float, &[4, 3])],
            vec![onnx::value_info("logits", DataType::Float, &[4, 5])],
        ),
    )
}

/// `logits = Gather(emb, ids) @ w`: ids i64[2,4], a vocabulary of 16.
fn lm(root: &Path) -> String {
    let emb: Vec<f32> = (0..128).map(|i| ((i * 5 % 13) as f32 - 6.0) * 0.05).collect();
    let w: Vec<f32> = (0..128).map(|i| ((i * 3 % 7) as f32 - 3.0) * 0.05).collect();
    write(
        &root.join("lm.onnx"),
        onnx::model(
            vec![
                onnx::node("embed", "Gather", &["emb", "ids"], &["h"]),
                onnx::node("head", "MatMul", &["h", "w"], &["logits"]),
            ],
            vec![onnx::floats("emb", &[16, 8], &emb), onnx::floats("w", &[8, 16], &w)],
            vec![onnx::value_info("ids", DataType::Int64, &[2, 4])],
            vec![onnx::value_info("logits", DataType::Float, &[2, 4, 16])],
        ),
    )
}

fn x_feed(root: &Path, name: &str, rows: usize) -> String {
    npy(&root.join(name), ir::Tensor::f32([rows, 3], (0..rows * 3).map(|i| (i % 5) as f32 * 0.3 - 0.5).collect()))
}

fn labels(root: &Path, name: &str, v: Vec<i64>) -> String {
    npy(&root.join(name), ir::Tensor::i64([v.len()], v))
}

fn ids(root: &Path, name: &str, v: [i64; 8]) -> String {
    npy(&root.join(name), ir::Tensor::i64([2, 4], v.to_vec()))
}

fn feed(name: &str, path: &str) -> String {
    format!("{name}={path}")
}

fn plan(model: &str, out: &Path, mesh: &str, strategy: &str, loss: &str) -> String {
    let p = s(out);
    ok(&["plan", model, "--mesh", mesh, "--strategy", strategy, "--memory", "1GiB", "--loss", loss, "-o", &p]);
    p
}

const TRAIN_CE: [&str; 6] = ["--loss", "ce:logits:labels", "--optimizer", "sgd", "--steps", "1"];

#[test]
fn labels_outside_the_classes_are_refused_on_every_path() {
    let dir = tempdir();
    let d = dir.path();
    let m = classifier(d);
    let x = feed("x", &x_feed(d, "x.npy", 4));
    let good = feed("labels", &labels(d, "good.npy", vec![0, 1, 4, 2]));
    let high = feed("labels", &labels(d, "high.npy", vec![0, 1, 5, 2]));
    let negative = feed("labels", &labels(d, "neg.npy", vec![0, -1, 1, 2]));
    // One device: the label 5 of 5 classes once read the next row's class 0.
    for (l, value) in [(&high, "holds 5"), (&negative, "holds -1")] {
        fails(
            &[&["train", &m, "--feed", &x, "--feed", l][..], &TRAIN_CE[..]].concat(),
            &["input labels", value, "5 classes", "[0, 5)"],
        );
    }
    ok(&[&["train", &m, "--feed", &x, "--feed", &good][..], &TRAIN_CE[..]].concat());
    // Evaluation: held-out labels are data too.
    let lfile = labels(d, "good.npy", vec![0, 1, 4, 2]);
    let xfile = x_feed(d, "x.npy", 4);
    let bad_eval = labels(d, "bad_eval.npy", vec![0, 1, 7, 2]);
    fails(
        &[
            "train",
            &m,
            "--data",
            &feed("x", &xfile),
            "--data",
            &feed("labels", &lfile),
            "--eval-data",
            &feed("labels", &bad_eval),
            "--loss",
            "ce:logits:labels",
            "--steps",
            "1",
        ],
        &["input labels holds 7", "[0, 5)"],
    );
    // A data-parallel plan: each rank checks its block of the fed labels, or of the streamed ones.
    let p = plan(&m, &d.join("dp.json"), "2", "dp", "ce:logits:labels");
    fails(&["run", &p, "--feed", &x, "--feed", &high, "--steps", "1"], &["input labels holds 5", "[0, 5)"]);
    fails(
        &["run", &p, "--data", &feed("x", &xfile), "--data", &feed("labels", &s(&d.join("high.npy"))), "--steps", "1"],
        &["input labels holds 5"],
    );
    fails(
        &[
            "run",
            &p,
            "--data",
            &feed("x", &xfile),
            "--data",
            &feed("labels", &lfile),
            "--eval-data",
            &feed("labels", &bad_eval),
            "--steps",
            "1",
        ],
        &["input labels holds 7"],
    );
    ok(&["run", &p, "--feed", &x, "--feed", &good, "--steps", "1"]);
}

#[test]
fn token_ids_outside_the_vocabulary_are_refused_on_every_path() {
    let dir = tempdir();
    let d = dir.path();
    let m = lm(d);
    let good = feed("ids", &ids(d, "good.npy", [1, 2, 3, 4, 5, 6, 7, 15]));
    let negative = feed("ids", &ids(d, "neg.npy", [1, 2, -1, 4, 5, 6, 7, 8]));
    let high = feed("ids", &ids(d, "high.npy", [1, 2, 3, 4, 5, 6, 16, 8]));
    let out = s(&d.join("out"));
    // -1 once read the last embedding row (ONNX's wrap, which is for a model's own constants).
    fails(&["infer", &m, "--feed", &negative, "--out", &out], &["input ids holds -1", "16 rows of emb", "[0, 16)"]);
    ok(&["infer", &m, "--feed", &good, "--out", &out]);
    let train = |f: &str| -> Vec<String> {
        ["train", &m, "--feed", f, "--loss", "ce-next:logits:ids", "--steps", "1"].map(String::from).to_vec()
    };
    for (f, v) in [(&negative, "holds -1"), (&high, "holds 16")] {
        let a = train(f);
        fails(&a.iter().map(String::as_str).collect::<Vec<_>>(), &["input ids", v, "[0, 16)"]);
    }
    // Megatron on 1x2 splits the table by rows: a masked gather, which once made an id outside
    // every rank's block a row of zeros.
    let p = plan(&m, &d.join("tp.json"), "1x2", "megatron", "ce-next:logits:ids");
    let text = std::fs::read_to_string(&p).expect("reading the plan");
    assert!(text.contains("masked_gather"), "the plan has no masked gather");
    for (f, v) in [(&negative, "holds -1"), (&high, "holds 16")] {
        fails(&["run", &p, "--feed", f, "--steps", "1"], &["input ids", v, "[0, 16)"]);
    }
    ok(&["run", &p, "--feed", &good, "--steps", "1"]);
    // A token file: uint16 ids from 99 down for a vocabulary of 16.
    let tokens = write(&d.join("tokens.bin"), (0..100u16).rev().flat_map(u16::to_le_bytes).collect());
    fails(
        &["train", &m, "--data", &feed("ids", &tokens), "--no-shuffle", "--loss", "ce-next:logits:ids", "--steps", "2"],
        &["input ids holds", "[0, 16)"],
    );
    fails(&["run", &p, "--data", &feed("ids", &tokens), "--steps", "2"], &["input ids holds", "[0, 16)"]);
}

#[test]
fn resume_refuses_a_dataset_whose_contents_changed() {
    let dir = tempdir();
    let d = dir.path();
    let m = classifier(d);
    let x = x_feed(d, "x.npy", 8);
    let l = labels(d, "l.npy", vec![0, 1, 2, 3, 4, 0, 1, 2]);
    let data = ["--data".to_string(), feed("x", &x), "--data".into(), feed("labels", &l)];
    let p = plan(&m, &d.join("p.json"), "1", "dp", "ce:logits:labels");
    let ck = s(&d.join("ck"));
    let run = |steps: &str, resume: bool| -> Vec<String> {
        let mut a: Vec<String> = ["run", &p, "--checkpoint", &ck, "--steps", steps].map(String::from).to_vec();
        a.extend(data.iter().cloned());
        if resume {
            a.push("--resume".into());
        }
        a
    };
    ok(&run("2", false).iter().map(String::as_str).collect::<Vec<_>>());
    ok(&run("3", true).iter().map(String::as_str).collect::<Vec<_>>());
    // The same name, shape and size, other values: once accepted.
    npy(&d.join("x.npy"), ir::Tensor::f32([8, 3], (0..24).map(|i| i as f32).collect()));
    fails(&run("4", true).iter().map(String::as_str).collect::<Vec<_>>(), &["--resume", "other contents"]);
    // `train --save` / `--load` keep the same check.
    x_feed(d, "x.npy", 8);
    let save = s(&d.join("save"));
    let train = |extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = ["train", &m, "--loss", "ce:logits:labels", "--steps", "1"].map(String::from).to_vec();
        a.extend(data.iter().cloned());
        a.extend(extra.iter().map(|e| e.to_string()));
        a
    };
    ok(&train(&["--save", &save]).iter().map(String::as_str).collect::<Vec<_>>());
    ok(&train(&["--load", &save]).iter().map(String::as_str).collect::<Vec<_>>());
    npy(&d.join("x.npy"), ir::Tensor::f32([8, 3], (0..24).map(|i| -(i as f32)).collect()));
    fails(&train(&["--load", &save]).iter().map(String::as_str).collect::<Vec<_>>(), &["--load", "other contents"]);
}

/// The `step` of each `--json` line of a run's stdout.
fn steps_of(stdout: &str) -> Vec<u64> {
    stdout.lines().filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?.get("step")?.as_u64()).collect()
}

#[test]
fn train_save_is_atomic_and_refuses_mixed_files() {
    let dir = tempdir();
    let d = dir.path();
    let m = classifier(d);
    let x = feed("x", &x_feed(d, "x.npy", 4));
    let l = feed("labels", &labels(d, "l.npy", vec![0, 1, 4, 2]));
    let save = s(&d.join("save"));
    let train = |extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = ["train", &m, "--feed", &x, "--feed", &l, "--loss", "ce:logits:labels", "--json"]
            .map(String::from)
            .to_vec();
        a.extend(extra.iter().map(|e| e.to_string()));
        a
    };
    let run = |a: Vec<String>| autopar(&a.iter().map(String::as_str).collect::<Vec<_>>());
    let o = run(train(&["--steps", "2", "--save", &save]));
    assert!(o.status.success(), "{}", stderr(&o));
    let params = std::fs::read(d.join("save/params.npz")).expect("the save's parameters");
    // Killed once its files are written, before they replace the directory: the save of step 2
    // is whole, and no staging directory is left once the next save runs.
    let o = run(train(&["--load", &save, "--steps", "2", "--save", &save, "--inject-exit-in-save"]));
    assert_eq!(o.status.code(), Some(137), "{}", stderr(&o));
    assert_eq!(std::fs::read(d.join("save/params.npz")).expect("the save's parameters"), params);
    let o = run(train(&["--load", &save, "--steps", "1", "--save", &save]));
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(steps_of(&stdout(&o)), [3]);
    let left: Vec<String> = std::fs::read_dir(d)
        .expect("listing")
        .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
        .filter(|n| n.contains("saving"))
        .collect();
    assert!(left.is_empty(), "staging directories left: {left:?}");
    // Files of two saves mixed (as a kill midway left them before saves were atomic): refused.
    std::fs::write(d.join("save/params.npz"), &params).expect("mixing the saves");
    let a = train(&["--load", &save, "--steps", "1"]);
    fails(&a.iter().map(String::as_str).collect::<Vec<_>>(), &["params.npz", "different saves"]);
}

#[test]
fn outputs_are_checked_before_step_1() {
    let dir = tempdir();
    let d = dir.path();
    let m = classifier(d);
    let x = feed("x", &x_feed(d, "x.npy", 4));
    let l = feed("labels", &labels(d, "l.npy", vec![0, 1, 4, 2]));
    let file = write(&d.join("a-file"), b"x".to_vec());
    let a_dir = s(d);
    let base = ["train", &m, "--feed", &x, "--feed", &l, "--loss", "ce:logits:labels", "--steps", "1"];
    for (extra, says) in [
        (["--save", &file], "not a directory"),
        (["--export-onnx", &a_dir], "is a directory"),
        (["--save", "/proc/autopar-test-save"], "cannot write"),
        (["--export-onnx", "/no/such/dir/out.onnx"], "does not exist"),
    ] {
        let args = [&base[..], &extra[..]].concat();
        let out = autopar(&args);
        assert!(!stdout(&out).contains("step    1"), "{args:?} trained before failing:\n{}", stdout(&out));
        fails(&args, &[extra[0], says]);
    }
    let p = plan(&m, &d.join("p.json"), "1", "dp", "ce:logits:labels");
    for (extra, says) in [
        (["--checkpoint", &file], "not a directory"),
        (["--save", &file], "not a directory"),
        (["--export-onnx", &a_dir], "is a directory"),
        (["--profile-ops", &a_dir], "is a directory"),
    ] {
        let args = [&["run", &p, "--feed", &x, "--feed", &l, "--steps", "1"][..], &extra[..]].concat();
        fails(&args, &[extra[0], says]);
    }
    fails(&["infer", &m, "--feed", &x, "--out", &file], &["--out", "not a directory"]);
}

#[test]
fn a_64_gib_token_file_trains_in_bounded_memory() {
    let dir = tempdir();
    let d = dir.path();
    let m = lm(d);
    // Sparse: 64 GiB of uint16 zeros (valid ids) on no disk; 2^33 sequences of 4 tokens, whose
    // epoch order once was a permutation vector of 64 GiB.
    let big = d.join("tokens.bin");
    std::fs::File::create(&big).and_then(|f| f.set_len(64 << 30)).expect("a sparse file");
    let data = feed("ids", &s(&big));
    for order in [&[][..], &["--no-shuffle"][..]] {
        let args =
            [&["train", &m, "--data", &data, "--loss", "ce-next:logits:ids", "--steps", "2"][..], order].concat();
        ok(&args);
    }
    let p = plan(&m, &d.join("p.json"), "2", "dp", "ce-next:logits:ids");
    ok(&["run", &p, "--data", &data, "--steps", "2"]);
}

#[test]
fn measurements_must_fit_their_plan() {
    let dir = tempdir();
    let d = dir.path();
    let m = classifier(d);
    let x = feed("x", &x_feed(d, "x.npy", 4));
    let l = feed("labels", &labels(d, "l.npy", vec![0, 1, 4, 2]));
    let p = plan(&m, &d.join("p.json"), "2", "dp", "ce:logits:labels");
    let prof = d.join("prof.json");
    ok(&["run", &p, "--feed", &x, "--feed", &l, "--steps", "1", "--profile-ops", &s(&prof)]);
    ok(&["explain", &p, "--measured", &s(&prof)]);
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&prof).unwrap()).unwrap();
    let with_ranks = |ranks: Vec<serde_json::Value>| -> String {
        let mut w = v.clone();
        w["ranks"] = serde_json::Value::Array(ranks);
        write(&d.join("edited.json"), serde_json::to_vec(&w).unwrap())
    };
    let one = v["ranks"][0].clone();
    let mut other = one.clone();
    other["rank"] = 7.into();
    fails(&["explain", &p, "--measured", &with_ranks(vec![one.clone(), other])], &["rank 7", "2"]);
    fails(&["explain", &p, "--measured", &with_ranks(vec![one.clone(), one.clone()])], &["rank 0", "twice"]);
    // Fake ranks (300,000 once ran for over a minute) are refused before they are compared; the
    // grouping of a real plan's many ranks is linear (codegen's figures tests time it).
    let many: Vec<serde_json::Value> = (0..3000)
        .map(|r| serde_json::json!({"rank": r, "steps": 1, "step_seconds": 0.001, "seconds": {}, "memory": []}))
        .collect();
    fails(&["explain", &p, "--measured", &with_ranks(many)], &["3000 rank entries", "2 ranks"]);
}

#[test]
fn run_logs_draw_finite_bounded_pages() {
    let dir = tempdir();
    let d = dir.path();
    // One step numbered 1e17 (f64 steps 16 apart there): once NaN coordinates.
    let log = write(&d.join("one.jsonl"), b"{\"step\":1e17,\"loss\":2.5,\"lr\":0.001}\n".to_vec());
    let page = d.join("one.html");
    ok(&["explain", "--run", &log, "--html", &s(&page)]);
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(!html.contains("NaN") && !html.contains("inf"), "{html}");
    assert!(html.contains("<polyline"), "{html}");
    // 300,000 steps: the page draws a bounded number of points per curve (the lowest and highest
    // of each bucket), not one per step.
    let mut text = String::new();
    for i in 1..=300_000u64 {
        text +=
            &format!("{{\"step\":{i},\"loss\":{},\"lr\":0.001,\"ms\":3.5}}\n", 3.0 + ((i * 7919) % 1000) as f64 / 1e3);
    }
    text += "{\"step\":150000,\"loss\":0.125}\n";
    let log = write(&d.join("long.jsonl"), text.into_bytes());
    let page = d.join("long.html");
    ok(&["explain", "--run", &log, "--html", &s(&page)]);
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(html.len() < 400_000, "a page of {} bytes", html.len());
    // The single low point survives the downsampling: the loss axis reaches down to it.
    assert!(html.contains(">0.2<") || html.contains(">0.1<") || html.contains(">0<"), "the minimum was lost");
}

#[test]
fn device_profiles_with_absurd_rates_are_refused() {
    let dir = tempdir();
    let d = dir.path();
    let m = classifier(d);
    let mut p = sharding::DeviceProfile::builtin("cpu").expect("the cpu profile");
    p.f32_flops = 1e-310;
    let file = write(&d.join("denormal.json"), serde_json::to_vec(&p).unwrap());
    let out = s(&d.join("p.json"));
    let plan =
        |dev: &str| ["plan", &m, "--mesh", "2", "--memory", "1GiB", "--device", dev, "-o", &out].map(String::from);
    fails(&plan(&file).iter().map(String::as_str).collect::<Vec<_>>(), &["f32_flops", "1e-310"]);
    let mut p = sharding::DeviceProfile::builtin("cpu").expect("the cpu profile");
    p.intra_node.beta = 1e-300;
    let file = write(&d.join("link.json"), serde_json::to_vec(&p).unwrap());
    fails(&plan(&file).iter().map(String::as_str).collect::<Vec<_>>(), &["intra_node.beta"]);
    let mut p = sharding::DeviceProfile::builtin("cpu").expect("the cpu profile");
    p.memory_bytes = 7;
    let file = write(&d.join("mem.json"), serde_json::to_vec(&p).unwrap());
    fails(&plan(&file).iter().map(String::as_str).collect::<Vec<_>>(), &["memory_bytes"]);
}

#[test]
fn nan_in_the_data_or_the_weights_is_an_error() {
    let dir = tempdir();
    let d = dir.path();
    let m = classifier(d);
    let mut xs: Vec<f32> = (0..12).map(|i| i as f32 * 0.1).collect();
    xs[4] = f32::NAN;
    let x_nan = feed("x", &npy(&d.join("xnan.npy"), ir::Tensor::f32([4, 3], xs)));
    let l = feed("labels", &labels(d, "l.npy", vec![0, 1, 4, 2]));
    // Once "diverged; try a smaller --lr".
    fails(
        &[&["train", &m, "--feed", &x_nan, "--feed", &l][..], &TRAIN_CE[..]].concat(),
        &["input x holds NaN", "element 4"],
    );
    let p = plan(&m, &d.join("p.json"), "2", "dp", "ce:logits:labels");
    fails(&["run", &p, "--feed", &x_nan, "--feed", &l, "--steps", "1"], &["input x holds NaN"]);
    // A learning rate that overflows the weights: they are not saved (once with exit code 0).
    let x = feed("x", &x_feed(d, "x.npy", 4));
    let save = s(&d.join("save"));
    let t = feed("t", &npy(&d.join("t.npy"), ir::Tensor::f32([4, 5], vec![0.0; 20])));
    let diverge = ["--loss", "mse:logits:t", "--optimizer", "sgd", "--lr", "1e30", "--steps", "4"];
    fails(
        &[&["train", &m, "--feed", &x, "--feed", &t, "--save", &save][..], &diverge[..]].concat(),
        &["--save", "parameter w holds", "NaN or infinite", "not saved"],
    );
    assert!(!PathBuf::from(&save).join("params.npz").exists());
    let onnx_out = s(&d.join("out.onnx"));
    fails(
        &[&["train", &m, "--feed", &x, "--feed", &t, "--export-onnx", &onnx_out][..], &diverge[..]].concat(),
        &["--export-onnx", "parameter w holds"],
    );
}

#[test]
fn two_runs_on_one_checkpoint_directory() {
    let dir = tempdir();
    let d = dir.path();
    let m = classifier(d);
    let x = feed("x", &x_feed(d, "x.npy", 4));
    let l = feed("labels", &labels(d, "l.npy", vec![0, 1, 4, 2]));
    let p = plan(&m, &d.join("p.json"), "1", "dp", "ce:logits:labels");
    let ck = d.join("ck");
    let ckpt = s(&ck);
    let run = ["run", &p, "--feed", &x, "--feed", &l, "--checkpoint", &ckpt];
    {
        // Another run holds the directory (here: this test process).
        let _held = runtime::outputs::DirLock::acquire(&ck).expect("locking");
        fails(
            &[&run[..], &["--steps", "1"][..]].concat(),
            &["--checkpoint", "in use by another run", &format!("process {}", std::process::id())],
        );
    }
    ok(&[&run[..], &["--steps", "1"][..]].concat());
    // A lock file left by a run that was killed does not block: the lock died with it.
    std::fs::write(ck.join(runtime::outputs::LOCK_FILE), "process 999999 on elsewhere").unwrap();
    ok(&[&run[..], &["--resume", "--steps", "2"][..]].concat());
}
