//! `autopar run --backend nccl` (built only with `--features cuda`).
//!
//! - One rank on one device: the mlp planned on mesh `1`, three steps with SGD and with AdamW,
//!   give the same losses and final parameters (`--save`) as `--backend threads` within 1e-4
//!   relative. On a GPU when there is one; otherwise on the CPU emulation of libcuda, libnvrtc
//!   and libcublas of `kernels/tests/fake_cuda.cpp` (see `kernels/tests/cuda.rs` for what it can
//!   and cannot show). A one-rank run makes no NCCL call, so the emulator needs no NCCL.
//! - Without any CUDA library, `--backend nccl` fails with one line `error: no CUDA device: ...`.
//! - Two ranks on two GPUs with NCCL (mlp on mesh `2`, data parallel, and `1x2`), started by hand
//!   with `--rank/--world`: the same comparison; skipped without two devices and NCCL.
#![cfg(feature = "cuda")]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const TOL: f64 = 1e-4;
const STEPS: &str = "3";

fn data(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data").join(rel)
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

fn autopar(args: &[String], env: &[(&str, &std::ffi::OsStr)]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_autopar"));
    c.args(args).env_remove("AUTOPAR_LOG").env_remove("AUTOPAR_INJECT_FAULT").env("RUST_BACKTRACE", "0");
    for (k, v) in env {
        c.env(k, v);
    }
    c
}

#[track_caller]
fn ok(out: Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The mlp planned on `mesh` with `optimizer` into `dir`.
fn plan(mesh: &str, optimizer: &str, dir: &Path) -> PathBuf {
    plan_in(mesh, optimizer, "f32", dir)
}

/// [`plan`] at a precision (`f32`, or mixed `bf16` / `fp16`).
fn plan_in(mesh: &str, optimizer: &str, precision: &str, dir: &Path) -> PathBuf {
    plan_with(mesh, optimizer, precision, &[], dir)
}

/// [`plan_in`] with more planning flags (the plan's file name takes the first).
fn plan_with(mesh: &str, optimizer: &str, precision: &str, extra: &[&str], dir: &Path) -> PathBuf {
    let tag = extra.first().map(|x| x.trim_start_matches('-')).unwrap_or("");
    let out = if precision == "f32" {
        dir.join(format!("mlp-{mesh}-{optimizer}{tag}.json"))
    } else {
        dir.join(format!("mlp-{mesh}-{optimizer}{tag}-{precision}.json"))
    };
    let model = data("models/mlp.onnx");
    let args: Vec<String> = [
        "plan",
        s(&model).as_str(),
        "--mesh",
        mesh,
        "--memory",
        "4GiB",
        "--loss",
        "mse:y:target",
        "--optimizer",
        optimizer,
        "--lr",
        "0.05",
        "--time-limit",
        "1",
        "--precision",
        precision,
        "-o",
        s(&out).as_str(),
    ]
    .iter()
    .chain(extra)
    .map(|a| a.to_string())
    .collect();
    ok(autopar(&args, &[]).output().unwrap(), "autopar plan");
    out
}

/// `autopar run PLAN` for three steps with the mlp's feeds, saving into `save`.
fn run_args(plan: &Path, save: &Path, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = vec!["run".into(), s(plan), "--steps".into(), STEPS.into(), "--json".into()];
    for (n, f) in [("x", "models/mlp.x.npy"), ("target", "refgrad/mlp/mlp.target.npy")] {
        a.extend(["--feed".to_string(), format!("{n}={}", s(&data(f)))]);
    }
    a.extend(["--save".to_string(), s(save)]);
    a.extend(extra.iter().map(|x| x.to_string()));
    a
}

/// The `{"step": i, "loss": x}` lines of a `--json` run.
fn losses(stdout: &str) -> Vec<f64> {
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v.get("loss")?.as_f64())
        .collect()
}

fn norm(v: impl Iterator<Item = f64>) -> f64 {
    v.map(|x| x * x).sum::<f64>().sqrt()
}

/// Losses and saved parameters of the nccl run agree with the threads run within [`TOL`].
#[track_caller]
fn agree(what: &str, threads_out: &str, threads_save: &Path, nccl_out: &str, nccl_save: &Path) {
    let (want, got) = (losses(threads_out), losses(nccl_out));
    assert_eq!(want.len(), 3, "{what}: threads run printed {threads_out}");
    assert_eq!(got.len(), 3, "{what}: nccl run printed {nccl_out}");
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() <= TOL * w.abs().max(1e-12), "{what}: losses {got:?} vs threads {want:?}");
    }
    agree_params(what, threads_save, nccl_save);
    println!("{what}: losses {:?} and parameters agree with the threads run", losses(nccl_out));
}

/// The parameters saved in `got_save` equal those in `want_save` within [`TOL`] (norm-wise).
#[track_caller]
fn agree_params(what: &str, want_save: &Path, got_save: &Path) {
    let want = runtime::npy::read_npz(&want_save.join("params.npz")).unwrap();
    let got = runtime::npy::read_npz(&got_save.join("params.npz")).unwrap();
    assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>(), "{what}: saved parameters");
    for (name, w) in &want {
        let g = &got[name];
        assert_eq!(g.shape(), w.shape(), "{what}: {name}");
        let (a, b) = (g.to_f32_vec(), w.to_f32_vec());
        let e = norm(a.iter().zip(&b).map(|(x, y)| (x - y) as f64)) / norm(b.iter().map(|&y| y as f64)).max(1e-12);
        assert!(e <= TOL, "{what}: parameter {name} differs from the threads run by {e:.2e}");
    }
}

/// The emulated libraries built in `dir` (libcuda, libnvrtc, libcublas), or `None` after printing
/// why not.
fn build_emulator(dir: &Path) -> Option<()> {
    if Command::new("c++").arg("--version").output().is_err() {
        println!("skipped: no host C++ compiler to build the CUDA emulator");
        return None;
    }
    let src = dir.join("fake.cpp");
    std::fs::write(&src, include_str!("../kernels/tests/fake_cuda.cpp")).unwrap();
    let built = Command::new("c++")
        .args(["-std=c++17", "-O1", "-shared", "-fPIC", "-o"])
        .arg(dir.join("libcuda.so"))
        .arg(&src)
        .arg("-ldl")
        .output()
        .unwrap();
    assert!(built.status.success(), "building the emulator:\n{}", String::from_utf8_lossy(&built.stderr));
    for name in ["libnvrtc.so", "libcublas.so"] {
        std::fs::copy(dir.join("libcuda.so"), dir.join(name)).unwrap();
    }
    Some(())
}

#[test]
fn one_rank_on_a_device_matches_threads() {
    let tmp = tempfile::tempdir().unwrap();
    let emu = tmp.path().join("emu");
    std::fs::create_dir_all(&emu).unwrap();
    // A real GPU when there is one, the emulator otherwise.
    let real = kernels::cuda::is_available();
    let mut env: Vec<(&str, std::ffi::OsString)> = vec![];
    if real {
        println!("on a real CUDA device");
    } else {
        if build_emulator(&emu).is_none() {
            return;
        }
        let mut path = std::ffi::OsString::from(&emu);
        if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
            path.push(":");
            path.push(old);
        }
        env.push(("LD_LIBRARY_PATH", path));
        env.push(("AUTOPAR_FAKE_CUDA_DIR", emu.clone().into_os_string()));
    }
    let env: Vec<(&str, &std::ffi::OsStr)> = env.iter().map(|(k, v)| (*k, v.as_os_str())).collect();
    for optimizer in ["sgd", "adamw"] {
        let p = plan("1", optimizer, tmp.path());
        let (ts, ns) = (tmp.path().join(format!("threads-{optimizer}")), tmp.path().join(format!("nccl-{optimizer}")));
        let threads = ok(autopar(&run_args(&p, &ts, &[]), &[]).output().unwrap(), "threads run");
        let out = autopar(&run_args(&p, &ns, &["--backend", "nccl"]), &env).output().unwrap();
        let nccl = ok(out, "nccl run");
        agree(&format!("mlp on mesh 1 with {optimizer}"), &threads, &ts, &nccl, &ns);
    }
    // A learning-rate schedule and gradient clipping (their lr factor read back by the update
    // kernels, the norm's reductions on the device).
    let sched = ["--clip-grad-norm", "0.5", "--lr-schedule", "cosine", "--warmup-steps", "1", "--decay-steps", "2"];
    let p = plan_with("1", "adamw", "f32", &sched, tmp.path());
    let (ts, ns) = (tmp.path().join("threads-sched"), tmp.path().join("nccl-sched"));
    let threads = ok(autopar(&run_args(&p, &ts, &[]), &[]).output().unwrap(), "threads run");
    let nccl = ok(autopar(&run_args(&p, &ns, &["--backend", "nccl"]), &env).output().unwrap(), "nccl run");
    agree("mlp on mesh 1 with AdamW, a schedule and clipping", &threads, &ts, &nccl, &ns);
    let field = |out: &str, key: &str| -> Vec<f64> {
        out.lines().filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?.get(key)?.as_f64()).collect()
    };
    for key in ["lr", "grad_norm"] {
        let (t, n) = (field(&threads, key), field(&nccl, key));
        assert_eq!(t.len(), 3, "{key}: {threads}");
        for (a, b) in n.iter().zip(&t) {
            assert!((a - b).abs() <= TOL * b.abs(), "{key}: nccl {n:?} vs threads {t:?}");
        }
    }
    // Mixed precision: 16-bit values on the device (widened for each op and rounded once, as the
    // CPU does); losses within bf16's unit roundoff (2^-8) of the threads run, where a GEMM's
    // different summation order may round an element one 16-bit ulp apart.
    for precision in ["bf16", "fp16"] {
        let p = plan_in("1", "sgd", precision, tmp.path());
        let (ts, ns) = (tmp.path().join(format!("t-{precision}")), tmp.path().join(format!("n-{precision}")));
        let threads = losses(&ok(autopar(&run_args(&p, &ts, &[]), &[]).output().unwrap(), "threads run"));
        let out = autopar(&run_args(&p, &ns, &["--backend", "nccl"]), &env).output().unwrap();
        let nccl = losses(&ok(out, "nccl run"));
        assert_eq!(nccl.len(), threads.len());
        for (g, w) in nccl.iter().zip(&threads) {
            assert!((g - w).abs() <= w.abs() / 256.0, "{precision}: nccl {nccl:?} vs threads {threads:?}");
        }
        println!("mlp on mesh 1 in {precision}: nccl {nccl:?}, threads {threads:?}");
    }
    // Checkpoints hold the downloaded blocks (AdamW's moments included): two steps, then a
    // resumed third, end where the uninterrupted threads run does (its plan was written above).
    let p = tmp.path().join("mlp-1-adamw.json");
    let (ck, resumed_save) = (s(&tmp.path().join("ck")), tmp.path().join("resumed"));
    let mut first = run_args(&p, &resumed_save, &["--backend", "nccl", "--checkpoint", &ck]);
    first[3] = "2".into();
    ok(autopar(&first, &env).output().unwrap(), "nccl run to a checkpoint");
    let args = run_args(&p, &resumed_save, &["--backend", "nccl", "--checkpoint", &ck, "--resume"]);
    let resumed = ok(autopar(&args, &env).output().unwrap(), "resumed nccl run");
    let threads = ok(autopar(&run_args(&p, &tmp.path().join("t"), &[]), &[]).output().unwrap(), "threads run");
    let (got, want) = (losses(&resumed), losses(&threads));
    assert_eq!(got.len(), 1, "{resumed}");
    assert!((got[0] - want[2]).abs() <= TOL * want[2].abs(), "resumed step 3: {got:?} vs threads {want:?}");
    agree_params("mlp resumed at step 2", &tmp.path().join("t"), &resumed_save);
    // Streamed data (new blocks uploaded before each step) and an evaluation after each step
    // (forward only, on the device): the threads run's losses and evaluations.
    let mut binds = vec![];
    for (n, f) in [("x", "models/mlp.x.npy"), ("target", "refgrad/mlp/mlp.target.npy")] {
        let t = runtime::npy::read_npy(&data(f)).unwrap();
        let mut v = t.to_f32_vec();
        v.extend(t.to_f32_vec().iter().map(|x| x * 0.5));
        let file = tmp.path().join(format!("{n}-data.npy"));
        runtime::npy::write_npy(&file, &ir::Tensor::f32(vec![2 * t.shape()[0], t.shape()[1]], v)).unwrap();
        binds.extend(["--data".to_string(), format!("{n}={}", s(&file))]);
        binds.extend(["--eval-data".to_string(), format!("{n}={}", s(&data(f)))]);
    }
    let mut args: Vec<String> =
        ["run", &s(&p), "--steps", "3", "--json", "--eval-every", "1"].map(String::from).to_vec();
    args.extend(binds);
    let evals = |out: &str| -> Vec<f64> {
        out.lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|v| v.get("eval_loss")?.as_f64())
            .collect()
    };
    let threads = ok(autopar(&args, &[]).output().unwrap(), "threads run with --data");
    let prof = tmp.path().join("prof.json");
    args.extend(["--backend".to_string(), "nccl".to_string(), "--profile-ops".to_string(), s(&prof)]);
    let nccl = ok(autopar(&args, &env).output().unwrap(), "nccl run with --data");
    // Profiled on the device: each instruction timed after the stream drains.
    let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&prof).unwrap()).unwrap();
    assert_eq!(doc["ranks"][0]["steps"], 2, "{doc}");
    assert!(!doc["ranks"][0]["seconds"].as_object().unwrap().is_empty());
    let (want, got) = ([losses(&threads), evals(&threads)].concat(), [losses(&nccl), evals(&nccl)].concat());
    assert_eq!(got.len(), 6, "{nccl}");
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() <= TOL * w.abs(), "--data: nccl {got:?} vs threads {want:?}");
    }
}

#[test]
fn without_cuda_libraries_nccl_is_one_clear_error() {
    if kernels::cuda::is_available() {
        println!("skipped: a CUDA device is present");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let p = plan("1", "sgd", tmp.path());
    let empty = tmp.path().join("no-libs");
    std::fs::create_dir_all(&empty).unwrap();
    let out = autopar(
        &run_args(&p, &tmp.path().join("save"), &["--backend", "nccl"]),
        &[("LD_LIBRARY_PATH", empty.as_os_str())],
    )
    .output()
    .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "succeeded without CUDA: {err}");
    assert!(!err.contains("panicked"), "panicked: {err}");
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(lines[0].starts_with("error: no CUDA device: "), "{err}");
}

#[test]
fn two_ranks_on_two_gpus_match_threads() {
    match kernels::cuda::device_count() {
        Ok(n) if n >= 2 => {}
        Ok(_) => {
            println!("skipped: fewer than 2 CUDA devices");
            return;
        }
        Err(_) => {
            println!("skipped: no CUDA device");
            return;
        }
    }
    if kernels::cuda::nccl::NcclId::new().is_err() {
        println!("skipped: no NCCL library");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    for mesh in ["2", "1x2"] {
        let p = plan(mesh, "adamw", tmp.path());
        let ts = tmp.path().join(format!("threads-{mesh}"));
        let threads = ok(autopar(&run_args(&p, &ts, &[]), &[]).output().unwrap(), "threads run");
        let ids = tmp.path().join(format!("ids-{mesh}"));
        let ns = tmp.path().join(format!("nccl-{mesh}"));
        let children: Vec<_> = (0..2)
            .map(|r| {
                let (rank, ids) = (r.to_string(), s(&ids));
                let extra = ["--backend", "nccl", "--rank", &rank, "--world", "2", "--nccl-dir", &ids];
                autopar(&run_args(&p, &ns, &extra), &[])
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let outs: Vec<Output> = children.into_iter().map(|c| c.wait_with_output().unwrap()).collect();
        let mut outs = outs.into_iter();
        let rank0 = ok(outs.next().unwrap(), "nccl rank 0");
        ok(outs.next().unwrap(), "nccl rank 1");
        agree(&format!("mlp on mesh {mesh} over 2 GPUs"), &threads, &ts, &rank0, &ns);
    }
}
