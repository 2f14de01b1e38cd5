//! Hostile inputs: files (see main.rs). Only regular files are read (devices, FIFOs and
//! directories are refused before any read); external data stays inside the model's directory
//! and within its file, with exactly the bytes its tensor needs; `run` refuses a model that is
//! missing or not the one planned unless asked for random weights; `infer --expect` fails on
//! NaN or infinite values.

use std::path::{Path, PathBuf};
use std::process::Command;

use prost::Message;

use crate::common::onnx::{self, DataType, pb};
use crate::common::*;

fn s(p: &Path) -> String {
    p.display().to_string()
}

fn mkfifo(path: &Path) {
    let st = Command::new("mkfifo").arg(path).status().expect("running mkfifo");
    assert!(st.success(), "mkfifo {}", path.display());
}

fn write_npy(path: &Path, shape: &[usize], v: Vec<f32>) -> String {
    runtime::npy::write_npy(path, &ir::Tensor::f32(shape.to_vec(), v)).unwrap();
    s(path)
}

/// `y = x @ w` with x f32[2,3] and w f32[3,2] as given.
fn matmul_model(w: pb::TensorProto) -> Vec<u8> {
    onnx::model(
        vec![onnx::node("mm", "MatMul", &["x", "w"], &["y"])],
        vec![w],
        vec![onnx::value_info("x", DataType::Float, &[2, 3])],
        vec![onnx::value_info("y", DataType::Float, &[2, 2])],
    )
}

/// w f32[3,2] (24 bytes) with these `external_data` entries.
fn external_w(entries: &[(&str, &str)]) -> pb::TensorProto {
    pb::TensorProto {
        name: "w".into(),
        dims: vec![3, 2],
        data_type: DataType::Float as i32,
        data_location: Some(1),
        external_data: entries
            .iter()
            .map(|(k, v)| pb::StringStringEntryProto { key: k.to_string(), value: v.to_string() })
            .collect(),
        ..Default::default()
    }
}

fn w_bytes() -> Vec<u8> {
    (0..6).flat_map(|i| (i as f32 * 0.5).to_le_bytes()).collect()
}

/// A directory `model/` holding `m.onnx` with w's data in external entries, and feeds next to
/// `model/`: returns (model path, x feed, target feed).
fn external_model(root: &Path, entries: &[(&str, &str)]) -> (String, String, String) {
    let dir = root.join("model");
    std::fs::create_dir_all(&dir).unwrap();
    let m = dir.join("m.onnx");
    std::fs::write(&m, matmul_model(external_w(entries))).unwrap();
    let x = write_npy(&root.join("x.npy"), &[2, 3], (0..6).map(|i| i as f32).collect());
    let t = write_npy(&root.join("t.npy"), &[2, 2], vec![1.0; 4]);
    (s(&m), format!("x={x}"), format!("t={t}"))
}

/// `autopar plan` of a model with loss `mse:y:t` on one device, into `out`.
fn plan_args<'a>(model: &'a str, out: &'a str) -> Vec<&'a str> {
    vec!["plan", model, "--mesh", "1x1", "--memory", "1GiB", "--loss", "mse:y:t", "--time-limit", "1", "-o", out]
}

#[test]
fn devices_fifos_and_directories_are_refused_before_reading() {
    let dir = tempdir();
    let fifo = dir.path().join("fifo");
    mkfifo(&fifo);
    let f = s(&fifo);
    let d = s(dir.path());
    let mlp = model("mlp.onnx");
    let plan = s(&dir.path().join("p.json"));
    for (bad, what) in [("/dev/zero", "character device"), (f.as_str(), "FIFO"), (d.as_str(), "directory")] {
        let feed = format!("x={bad}");
        for args in [
            vec!["inspect", bad],
            vec!["infer", &mlp, "--feed", &feed],
            vec!["run", bad],
            vec!["explain", bad],
            vec!["solve", bad],
            vec!["plan", &mlp, "--mesh", "1x2", "--memory", "1GiB", "--device", bad, "-o", &plan],
            vec!["plan", &mlp, "--mesh", "1x2", "--memory", "1GiB", "--mesh-profile", bad, "-o", &plan],
        ] {
            let line = fails(&args, &["not a regular file", what]);
            println!("{}: {line}", args.join(" "));
        }
    }
}

#[test]
fn npy_headers_cannot_ask_for_more_than_the_file_holds() {
    let dir = tempdir();
    let npy = |name: &str, header: &str, data: usize| -> String {
        let mut h = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {header}, }}");
        while (h.len() + 11) % 64 != 0 {
            h.push(' ');
        }
        h.push('\n');
        let mut b = b"\x93NUMPY\x01\x00".to_vec();
        b.extend((h.len() as u16).to_le_bytes());
        b.extend(h.as_bytes());
        b.extend(vec![0u8; data]);
        let p = dir.path().join(name);
        std::fs::write(&p, b).unwrap();
        format!("x={}", p.display())
    };
    let mlp = model("mlp.onnx");
    for (feed, phrase) in [
        (npy("huge.npy", "(1099511627776, 1099511627776)", 16), "too large"),
        (npy("big.npy", "(1073741824, 64)", 16), "the file has 16 data bytes"),
        (npy("short.npy", "(4, 3)", 47), "the file has 47 data bytes"),
    ] {
        fails(&["infer", &mlp, "--feed", &feed], &[&feed[2..], phrase]);
    }
}

#[test]
fn external_data_stays_inside_the_models_directory_and_its_file() {
    let root = tempdir();
    let r = root.path();
    std::fs::create_dir_all(r.join("model")).unwrap();
    // Bytes of the right size outside the model's directory.
    std::fs::write(r.join("secret.bin"), w_bytes()).unwrap();
    std::os::unix::fs::symlink(r.join("secret.bin"), r.join("model/link.bin")).unwrap();
    std::os::unix::fs::symlink("/dev/urandom", r.join("model/random.bin")).unwrap();
    let mut padded = vec![0u8; 8];
    padded.extend(w_bytes());
    std::fs::write(r.join("model/w.bin"), &padded).unwrap();
    std::fs::create_dir_all(r.join("model/sub")).unwrap();
    mkfifo(&r.join("model/fifo.bin"));
    let plan = s(&r.join("plan.json"));
    for (entries, phrases) in [
        (vec![("location", "/etc/passwd")], vec!["tensor w", "/etc/passwd", "absolute path"]),
        (vec![("location", "../secret.bin")], vec!["tensor w", "outside the model's directory"]),
        (vec![("location", "sub/../../secret.bin")], vec!["outside the model's directory"]),
        (vec![("location", "link.bin")], vec!["link.bin", "outside the model's directory"]),
        (vec![("location", "random.bin")], vec!["random.bin", "outside the model's directory"]),
        (vec![("location", "fifo.bin")], vec!["fifo.bin", "not a regular file", "FIFO"]),
        (vec![("location", "w.bin"), ("offset", "16"), ("length", "24")], vec!["offset 16 of 24 bytes is outside"]),
        (vec![("location", "w.bin"), ("offset", "18446744073709551615"), ("length", "24")], vec!["is outside"]),
        (vec![("location", "w.bin"), ("offset", "8"), ("length", "20")], vec!["20 bytes", "needs 24"]),
        (vec![("location", "w.bin")], vec!["32 bytes", "needs 24"]),
        (vec![("location", "w.bin"), ("offset", "eight")], vec!["offset `eight` is not a byte count"]),
        (vec![("offset", "8")], vec!["without a location"]),
    ] {
        let (m, x, _) = external_model(r, &entries);
        // The importer (infer reads weights) and the block index (plan hashes and indexes them).
        let line = fails(&["infer", &m, "--feed", &x], &phrases);
        println!("{entries:?}: {line}");
        fails(&plan_args(&m, &plan), &phrases);
    }
    // The same file in range, also through a `..` that stays inside, is read.
    for loc in ["w.bin", "./sub/../w.bin"] {
        let (m, x, _) = external_model(r, &[("location", loc), ("offset", "8"), ("length", "24")]);
        let out = s(&r.join("out"));
        let text = ok(&["infer", &m, "--feed", &x, "--out", &out]);
        assert!(text.contains("y "), "{text}");
    }
}

/// Copies the mlp into `dir/models/`, plans it on 1x2 into `dir/plan.json`; returns (model,
/// plan, feeds).
fn planned_mlp(dir: &Path) -> (PathBuf, PathBuf, Vec<String>) {
    let models = dir.join("models");
    std::fs::create_dir_all(&models).unwrap();
    let m = models.join("mlp.onnx");
    std::fs::copy(model("mlp.onnx"), &m).unwrap();
    let p = dir.join("plan.json");
    ok(&[
        "plan",
        &s(&m),
        "--mesh",
        "1x2",
        "--memory",
        "1GiB",
        "--loss",
        "mse:y:target",
        "--time-limit",
        "1",
        "-o",
        &s(&p),
    ]);
    let feeds = vec![
        "--feed".to_string(),
        format!("x={}", s(&data("models/mlp.x.npy"))),
        "--feed".to_string(),
        format!("target={}", s(&data("refgrad/mlp/mlp.target.npy"))),
    ];
    (m, p, feeds)
}

fn run_args<'a>(plan: &'a str, feeds: &'a [String], extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec!["run", plan, "--steps", "1"];
    a.extend(feeds.iter().map(String::as_str));
    a.extend_from_slice(extra);
    a
}

#[test]
fn plans_record_the_model_absolute_and_hashed() {
    let dir = tempdir();
    let (m, p, _) = planned_mlp(dir.path());
    let plan: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    let source = plan["model"]["source"].as_str().unwrap();
    assert!(Path::new(source).is_absolute(), "{source}");
    assert_eq!(Path::new(source), m.canonicalize().unwrap());
    let hash = plan["model"]["source_hash"].as_str().unwrap();
    assert!(hash.starts_with("sha256:") && hash.len() == 71, "{hash}");
    // A relative model path on the command line is recorded absolute too.
    let q = s(&dir.path().join("q.json"));
    ok_in(
        Some(dir.path()),
        &["plan", "models/mlp.onnx", "--mesh", "1x2", "--memory", "1GiB", "--loss", "mse:y:target", "-o", &q],
    );
    let plan: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&q).unwrap()).unwrap();
    assert_eq!(plan["model"]["source"].as_str(), Some(source));
    assert_eq!(plan["model"]["source_hash"].as_str(), Some(hash));
}

#[test]
fn run_refuses_a_changed_model_unless_asked_for_random_weights() {
    let dir = tempdir();
    let (m, p, feeds) = planned_mlp(dir.path());
    let plan = s(&p);
    let out = ok(&run_args(&plan, &feeds, &[]));
    assert!(out.contains(&format!("parameters from {}", m.canonicalize().unwrap().display())), "{out}");
    // One weight changed in the last bit: a valid model, not the one planned.
    let mut mp = pb::ModelProto::decode(&*std::fs::read(&m).unwrap()).unwrap();
    let w = &mut mp.graph.as_mut().unwrap().initializer[0];
    if w.raw_data.is_empty() {
        w.float_data[0] = f32::from_bits(w.float_data[0].to_bits() ^ 1);
    } else {
        w.raw_data[0] ^= 1;
    }
    std::fs::write(&m, mp.encode_to_vec()).unwrap();
    let line = fails(&run_args(&plan, &feeds, &[]), &["is not the model the plan was made from", "--init random"]);
    println!("changed: {line}");
    fails(&run_args(&plan, &feeds, &["--init", "auto"]), &["is not the model the plan was made from"]);
    let out = ok(&run_args(&plan, &feeds, &["--init", "random", "--seed", "1"]));
    assert!(out.contains("parameters from seed 1"), "{out}");
}

#[test]
fn run_refuses_a_missing_or_moved_model_unless_asked_for_random_weights() {
    let dir = tempdir();
    let (m, p, feeds) = planned_mlp(dir.path());
    let plan = s(&p);
    // Moved: the recorded absolute path is gone; --model names the new place (same bytes).
    let moved = dir.path().join("elsewhere.onnx");
    std::fs::rename(&m, &moved).unwrap();
    let line = fails(&run_args(&plan, &feeds, &[]), &["mlp.onnx", "does not exist", "--init random"]);
    println!("moved: {line}");
    let mv = s(&moved);
    ok(&run_args(&plan, &feeds, &["--model", &mv]));
    // Missing altogether.
    std::fs::remove_file(&moved).unwrap();
    fails(&run_args(&plan, &feeds, &[]), &["does not exist"]);
    fails(&run_args(&plan, &feeds, &["--model", &mv]), &["elsewhere.onnx", "does not exist"]);
    let out = ok(&run_args(&plan, &feeds, &["--init", "random", "--seed", "1"]));
    assert!(out.contains("parameters from seed 1"), "{out}");
}

#[test]
fn an_older_plans_relative_source_is_relative_to_the_plan_file() {
    let dir = tempdir();
    let (_, p, feeds) = planned_mlp(dir.path());
    // As plans were written before: the path as typed, no hash.
    let mut plan: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    plan["model"]["source"] = "models/mlp.onnx".into();
    plan["model"].as_object_mut().unwrap().remove("source_hash");
    std::fs::write(&p, plan.to_string()).unwrap();
    let elsewhere = tempdir();
    let ps = s(&p);
    let out = autopar_in(Some(elsewhere.path()), &run_args(&ps, &feeds, &[]));
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("warning: the plan records no hash"), "{err}");
    // Not found there: an error, not random weights.
    plan["model"]["source"] = "gone/mlp.onnx".into();
    std::fs::write(&p, plan.to_string()).unwrap();
    fails_in(Some(elsewhere.path()), &run_args(&ps, &feeds, &[]), &["gone/mlp.onnx", "does not exist"]);
}

#[test]
fn run_refuses_a_model_whose_external_data_went_missing() {
    let root = tempdir();
    let r = root.path();
    std::fs::create_dir_all(r.join("model")).unwrap();
    std::fs::write(r.join("model/w.bin"), w_bytes()).unwrap();
    let (m, x, t) = external_model(r, &[("location", "w.bin")]);
    let p = s(&r.join("plan.json"));
    ok(&plan_args(&m, &p));
    let feeds = vec!["--feed".to_string(), x, "--feed".to_string(), t];
    ok(&run_args(&p, &feeds, &[]));
    // Changed data: the hash covers the external file.
    let mut other = w_bytes();
    other[0] ^= 1;
    std::fs::write(r.join("model/w.bin"), &other).unwrap();
    fails(&run_args(&p, &feeds, &[]), &["is not the model the plan was made from"]);
    std::fs::remove_file(r.join("model/w.bin")).unwrap();
    let line = fails(&run_args(&p, &feeds, &[]), &["w.bin", "parameter w", "does not exist", "--init random"]);
    println!("{line}");
    ok(&run_args(&p, &feeds, &["--init", "random", "--seed", "1"]));
}

#[test]
fn infer_expect_fails_on_nan_inf_and_shape_mismatch() {
    let dir = tempdir();
    let d = dir.path();
    let w = onnx::floats("w", &[3, 2], &[1.0, 0.0, 0.0, 1.0, 1.0, 1.0]);
    let m = d.join("m.onnx");
    std::fs::write(&m, matmul_model(w)).unwrap();
    let m = s(&m);
    let x = |name: &str, v: f32| format!("x={}", write_npy(&d.join(name), &[2, 3], vec![v; 6]));
    let y = |name: &str, shape: &[usize], v: f32| {
        format!("y={}", write_npy(&d.join(name), shape, vec![v; shape.iter().product()]))
    };
    let out = s(&d.join("out"));
    let (ones, nan) = (x("ones.npy", 1.0), x("nan.npy", f32::NAN));
    // y = [2, 2] for x = ones: a matching reference passes.
    ok(&["infer", &m, "--feed", &ones, "--out", &out, "--expect", &y("y2.npy", &[2, 2], 2.0)]);
    for (feed, expect, phrases) in [
        (&nan, y("zeros.npy", &[2, 2], 0.0), vec!["output y", "the output has 4 NaN or infinite values"]),
        (&nan, y("nans.npy", &[2, 2], f32::NAN), vec!["output y", "NaN or infinite"]),
        (&ones, y("inf.npy", &[2, 2], f32::INFINITY), vec!["the reference has 4 NaN or infinite values"]),
        (&ones, y("y3.npy", &[3, 2], 2.0), vec!["--expect y", "f32[2,2]", "f32[3,2]"]),
        (&ones, y("far.npy", &[2, 2], 3.0), vec!["max relative error"]),
    ] {
        let line = fails(&["infer", &m, "--feed", feed, "--out", &out, "--expect", &expect], &phrases);
        println!("{line}");
    }
    let json = autopar(&["infer", &m, "--feed", &nan, "--out", &out, "--expect", &y("z.npy", &[2, 2], 0.0), "--json"]);
    assert!(!json.status.success());
    let v: serde_json::Value = serde_json::from_str(stdout(&json).trim()).unwrap();
    assert_eq!(v["checks"][0]["ok"], false, "{v}");
}

/// `--data`: shards and token files that do not fit the inputs, or are not what they claim, are
/// one clear error each (no panic, no hang on a FIFO, no allocation of a claimed size).
#[test]
fn datasets_that_do_not_fit_are_one_clear_error() {
    let dir = tempdir();
    let root = dir.path();
    let m = s(&root.join("m.onnx"));
    std::fs::write(
        &m,
        matmul_model(pb::TensorProto {
            name: "w".into(),
            dims: vec![3, 2],
            data_type: DataType::Float as i32,
            raw_data: w_bytes(),
            ..Default::default()
        }),
    )
    .unwrap();
    let t = format!("t={}", write_npy(&root.join("t.npy"), &[4, 2], vec![1.0; 8]));
    let ok_x = write_npy(&root.join("x.npy"), &[4, 3], (0..12).map(|i| i as f32).collect());
    // A header that claims 999 rows over 4 rows of data.
    let mut head = "{'descr': '<f4', 'fortran_order': False, 'shape': (999, 3), }".to_string();
    while !(head.len() + 11).is_multiple_of(64) {
        head.push(' ');
    }
    head.push('\n');
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend((head.len() as u16).to_le_bytes());
    bytes.extend(head.as_bytes());
    bytes.extend([0u8; 48]);
    std::fs::write(root.join("long.npy"), &bytes).unwrap();
    let fifo_dir = root.join("fifo");
    std::fs::create_dir_all(&fifo_dir).unwrap();
    mkfifo(&fifo_dir.join("a.npy"));
    std::fs::create_dir_all(root.join("empty")).unwrap();
    std::fs::write(root.join("tokens.bin"), [1u8, 0, 2, 0, 3, 0]).unwrap();
    let wide = write_npy(&root.join("wide.npy"), &[4, 5], vec![0.0; 20]);
    let few = write_npy(&root.join("few.npy"), &[1, 3], vec![0.0; 3]);
    let train = |x: &str, extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> =
            ["train", &m, "--loss", "mse:y:t", "--steps", "1", "--data", x, "--data", &t].map(String::from).to_vec();
        a.extend(extra.iter().map(|e| e.to_string()));
        a
    };
    let x = |p: &Path| format!("x={}", s(p));
    for (args, says) in [
        (train(&x(&root.join("long.npy")), &[]), &["long.npy", "the file has 48 data bytes"][..]),
        (train(&x(&fifo_dir), &[]), &["a.npy"][..]),
        (train(&x(&root.join("empty")), &[]), &["has no .npy or .npz shards"][..]),
        (train(&x(&root.join("tokens.bin")), &[]), &["a token file feeds integer inputs"][..]),
        (train(&format!("x={wide}"), &[]), &["shape [4, 5]", "samples of shape [3]"][..]),
        (train(&format!("x={few}"), &[]), &["4 samples, but x has 1"][..]),
        (train(&x(&root.join("missing.npy")), &[]), &["missing.npy"][..]),
        (train(&format!("x,x={}", s(&root.join("tokens.bin"))), &[]), &["two different inputs"][..]),
        (train(&format!("x={ok_x}"), &["--eval-data", &format!("x={wide}")]), &["--eval-data", "shape [4, 5]"][..]),
        (
            train(&format!("x={ok_x}"), &["--eval-data", &x(&root.join("x.npy")), "--eval-batches", "5"]),
            &["--eval-batches 5"][..],
        ),
    ] {
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        fails(&a, says);
    }
}
