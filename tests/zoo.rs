//! The model zoo (issue 16): every model in `tests/data/zoo` through the whole pipeline, as a user
//! runs it, with the `autopar` binary:
//!
//! 1. `inspect`: the file imports (ops, parameter count);
//! 2. `infer` = PyTorch's outputs (`<output>.npy`), max relative error <= 1e-4 (`--expect`);
//! 3. `train` 3 SGD steps = PyTorch's 3 losses (`losses.json`, relative 1e-4), with `--freeze` for
//!    the initializers PyTorch does not train;
//! 4. `plan --mesh 2x2 --memory 1GiB` is made;
//! 5. `run` of that plan on 4 threads = `train`'s losses (relative 1e-5).
//!
//! Models exported with their training-mode dropout (`losses.json` has a `dropout` entry) draw
//! other masks than PyTorch (another generator), so for them stage 3 is "the deterministic part
//! and the statistics match": `train --no-dropout` = PyTorch's losses with every dropout 0
//! (relative 1e-4), and `train --seed 7` with dropout on gives finite losses, other than the
//! deterministic ones (it did drop), each within `band_sigmas` (5) standard deviations of the
//! mean of PyTorch's losses over 16 seeds (`dropout.losses_mean`/`losses_std`). Stages 4 and 5
//! use the same seed (`plan --seed 7`), and `run` must equal that `train` exactly as for the
//! other models (masks depend on the seed, the step and the global element index only).
//!
//! The test prints the table (model, exporter, ops, params, each check) and compares each model's
//! first failing stage with `tests/data/zoo/expected.txt`, which lists every model that does not
//! pass all five with the stage it stops at and why. It fails when a model stops earlier than
//! listed (a regression), stops later or passes while listed (the list must stay honest: update it),
//! or when the list names a model the zoo lacks. `ZOO_FILTER=substring` runs only matching models
//! and skips the checks that need all of them. `BLESS=1` rewrites `expected.txt` from this run
//! (each model's first failing stage and its error), for a change that moves models on.
//!
//! The models, their inputs and PyTorch's references are made by `scripts/zoo/export.py` (see
//! `scripts/zoo/README.md`); this test needs only the committed files.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// Relative tolerance of `train` against PyTorch's losses.
const TRAIN_RTOL: f64 = 1e-4;
/// Relative tolerance of `run` against `train`.
const RUN_RTOL: f64 = 1e-5;
/// The seed of the dropout models' `train` and `plan` (any would do; not the default 0, so that
/// the plan's recorded seed is what `run` draws from).
const DROPOUT_SEED: u64 = 7;
/// The pipeline's stages, in order.
const STAGES: [&str; 5] = ["inspect", "infer", "train", "plan", "run"];

fn zoo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/zoo")
}

/// Runs the binary in `dir`; `Ok(stdout)` on success, `Err(last stderr line)` otherwise.
fn autopar(dir: &Path, args: &[String]) -> Result<String, String> {
    let out = Command::new(env!("CARGO_BIN_EXE_autopar"))
        .args(args)
        .current_dir(dir)
        .env_remove("AUTOPAR_LOG")
        .env("RUST_BACKTRACE", "0")
        .output()
        .map_err(|e| format!("cannot run autopar: {e}"))?;
    let err = String::from_utf8_lossy(&out.stderr);
    if err.contains("panicked") {
        return Err(format!("PANIC: {}", err.lines().find(|l| l.contains("panicked")).unwrap_or("")));
    }
    if !out.status.success() {
        let line = err.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("(no message)");
        return Err(line.trim().to_string());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The per-step losses of `train --json` / `run --json` (lines with a `step` and a `loss`).
fn losses(stdout: &str) -> Vec<f64> {
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v.get("step").is_some())
        .filter_map(|v| v.get("loss").and_then(Value::as_f64))
        .collect()
}

fn max_rel(ours: &[f64], reference: &[f64]) -> f64 {
    ours.iter().zip(reference).map(|(a, b)| (a - b).abs() / b.abs().max(1e-12)).fold(0.0, f64::max)
}

/// One model's outcome: the first stage that failed (with its message), and a cell per stage.
struct Outcome {
    failed: Option<(usize, String)>,
    cells: Vec<String>,
    ops: String,
    params: String,
}

fn check(name: &str, model: &Value) -> Outcome {
    let dir = zoo().join(name);
    let work = std::env::temp_dir().join(format!("autopar-zoo-{}-{name}", std::process::id()));
    let _ = std::fs::create_dir_all(&work);
    let spec: Value = std::fs::read_to_string(dir.join("losses.json"))
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok())
        .unwrap_or(Value::Null);
    let onnx = dir.join("model.onnx").display().to_string();
    let loss = spec["loss"].as_str().unwrap_or_default().to_string();
    let target = loss.split(':').nth(2).unwrap_or_default().to_string();
    let lr = spec["optimizer"]["lr"].as_f64().unwrap_or(0.01).to_string();
    let feeds: Vec<(String, String)> = spec["feeds"]
        .as_object()
        .map(|m| m.iter().map(|(k, v)| (k.clone(), dir.join(v.as_str().unwrap_or("")).display().to_string())).collect())
        .unwrap_or_default();
    let feed_args = |with_target: bool| -> Vec<String> {
        feeds
            .iter()
            .filter(|(k, _)| with_target || *k != target || loss.starts_with("ce-next"))
            .flat_map(|(k, f)| ["--feed".to_string(), format!("{k}={f}")])
            .collect()
    };
    let freeze: Vec<String> = spec["freeze"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).flat_map(|p| ["--freeze".to_string(), p.to_string()]).collect())
        .unwrap_or_default();
    let train_opts: Vec<String> =
        ["--loss", &loss, "--optimizer", "sgd", "--lr", &lr].iter().map(|s| s.to_string()).collect();

    let mut out = Outcome { failed: None, cells: vec![], ops: "-".into(), params: "-".into() };
    let fail = |out: &mut Outcome, stage: usize, why: String| {
        out.cells.push("✗".into());
        out.failed = Some((stage, why));
    };

    // 1. inspect
    match autopar(&work, &["inspect".into(), onnx.clone(), "--json".into()]) {
        Ok(s) => {
            let v: Value = serde_json::from_str(&s).unwrap_or(Value::Null);
            out.ops = v["ops"].as_object().map_or(0, |m| m.len()).to_string();
            out.params = v["params"].as_u64().map_or("-".into(), |p| p.to_string());
            out.cells.push("✓".into());
        }
        Err(e) => {
            fail(&mut out, 0, e);
            return out;
        }
    }
    // 2. infer = PyTorch
    let mut args = vec!["infer".to_string(), onnx.clone()];
    args.extend(feed_args(false));
    for o in model["outputs"].as_array().into_iter().flatten() {
        let o = o["name"].as_str().unwrap_or_default();
        args.extend(["--expect".to_string(), format!("{o}={}", dir.join(format!("{o}.npy")).display())]);
    }
    args.push("--json".into());
    match autopar(&work, &args) {
        Ok(s) => {
            let v: Value = serde_json::from_str(&s).unwrap_or(Value::Null);
            let worst = v["checks"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|c| c["max_rel_error"].as_f64())
                .fold(0.0, f64::max);
            out.cells.push(format!("✓ {worst:.0e}"));
        }
        Err(e) => {
            fail(&mut out, 1, e);
            return out;
        }
    }
    // 3. train = PyTorch's losses
    let mut args = vec!["train".to_string(), onnx.clone()];
    args.extend(feed_args(true));
    args.extend(train_opts.clone());
    args.extend(freeze.clone());
    args.extend(["--steps", "3", "--json"].map(String::from));
    let reference: Vec<f64> = spec["losses"].as_array().into_iter().flatten().filter_map(Value::as_f64).collect();
    let band = &spec["dropout"];
    let dropout = band.is_object();
    if dropout {
        // The deterministic part: every dropout off, as PyTorch's reference was made.
        args.push("--no-dropout".into());
    }
    let trained = match autopar(&work, &args) {
        Ok(s) => {
            let l = losses(&s);
            let err = max_rel(&l, &reference);
            if l.len() != reference.len() || err > TRAIN_RTOL {
                let what = if dropout { "--no-dropout losses" } else { "losses" };
                fail(&mut out, 2, format!("{what} {l:?} against PyTorch's {reference:?} (max rel {err:.1e})"));
                return out;
            }
            l
        }
        Err(e) => {
            fail(&mut out, 2, e);
            return out;
        }
    };
    let err = max_rel(&trained, &reference);
    let trained = if dropout {
        // With dropout on: finite, not the deterministic losses, within PyTorch's band.
        args.pop();
        args.extend(["--seed".to_string(), DROPOUT_SEED.to_string()]);
        let l = match autopar(&work, &args) {
            Ok(s) => losses(&s),
            Err(e) => {
                fail(&mut out, 2, e);
                return out;
            }
        };
        match in_band(&l, &trained, band) {
            Ok(sigmas) => out.cells.push(format!("✓ {err:.0e}, {sigmas:.1}σ")),
            Err(why) => {
                fail(&mut out, 2, why);
                return out;
            }
        }
        l
    } else {
        out.cells.push(format!("✓ {err:.0e}"));
        trained
    };
    // 4. plan 2x2
    let plan = work.join("plan.json").display().to_string();
    let mut args =
        vec!["plan".to_string(), onnx.clone(), "--mesh".into(), "2x2".into(), "--memory".into(), "1GiB".into()];
    args.extend(train_opts);
    args.extend(freeze);
    if dropout {
        args.extend(["--seed".to_string(), DROPOUT_SEED.to_string()]);
    }
    args.extend(["-o".to_string(), plan.clone()]);
    if let Err(e) = autopar(&work, &args) {
        fail(&mut out, 3, e);
        return out;
    }
    out.cells.push("✓".into());
    // 5. run = train
    let mut args = vec!["run".to_string(), plan];
    args.extend(feed_args(true));
    args.extend(["--steps", "3", "--json"].map(String::from));
    match autopar(&work, &args) {
        Ok(s) => {
            let l = losses(&s);
            let err = max_rel(&l, &trained);
            if l.len() != trained.len() || err > RUN_RTOL {
                fail(&mut out, 4, format!("run's losses {l:?} against train's {trained:?} (max rel {err:.1e})"));
            } else {
                out.cells.push(format!("✓ {err:.0e}"));
            }
        }
        Err(e) => fail(&mut out, 4, e),
    }
    let _ = std::fs::remove_dir_all(&work);
    out
}

/// Checks the losses of a training run with dropout (`l`) against PyTorch's with dropout on over
/// several seeds (`band`, losses.json's `dropout`): every loss finite and within `band_sigmas`
/// standard deviations of PyTorch's mean at its step, and some loss other than the deterministic
/// run's (`deterministic`, relative 1e-6: the run dropped). `Ok(the largest distance in sigmas)`.
fn in_band(l: &[f64], deterministic: &[f64], band: &Value) -> Result<f64, String> {
    let floats = |k: &str| -> Vec<f64> { band[k].as_array().into_iter().flatten().filter_map(Value::as_f64).collect() };
    let (mean, std) = (floats("losses_mean"), floats("losses_std"));
    let sigmas = band["band_sigmas"].as_f64().unwrap_or(5.0);
    if l.len() != mean.len() || std.len() != mean.len() || l.iter().any(|x| !x.is_finite()) {
        return Err(format!("dropout losses {l:?}: not {} finite values", mean.len()));
    }
    if max_rel(l, deterministic) <= 1e-6 {
        return Err(format!("dropout losses {l:?} equal the --no-dropout ones {deterministic:?}: nothing dropped"));
    }
    let worst = l.iter().zip(&mean).zip(&std).map(|((x, m), s)| (x - m).abs() / s.max(1e-12)).fold(0.0, f64::max);
    if worst > sigmas {
        return Err(format!(
            "dropout losses {l:?} outside PyTorch's mean {mean:?} ± {sigmas} std {std:?} ({worst:.1} sigmas)"
        ));
    }
    Ok(worst)
}

/// `tests/data/zoo/expected.txt`: model -> (stage it stops at, why).
fn expected() -> BTreeMap<String, (String, String)> {
    let text = std::fs::read_to_string(zoo().join("expected.txt")).expect("tests/data/zoo/expected.txt");
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            // MODEL, STAGE and WHY are separated by runs of spaces.
            let mut f = l.split_whitespace();
            let model = f.next().unwrap_or_default().to_string();
            let stage = f.next().unwrap_or_default().to_string();
            assert!(STAGES.contains(&stage.as_str()), "expected.txt: {model}: unknown stage {stage:?}");
            (model, (stage, f.collect::<Vec<_>>().join(" ")))
        })
        .collect()
}

#[test]
fn zoo_models_import_infer_train_plan_and_run() {
    let manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(zoo().join("manifest.json")).expect("manifest.json"))
            .expect("JSON");
    let filter = std::env::var("ZOO_FILTER").ok();
    let expected = expected();
    let mut table = String::from(
        "| model | exporter | ops | params | inspect | infer | train | plan 2x2 | run = train |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    let (mut problems, mut passed, mut seen) = (vec![], 0, vec![]);
    let mut blessed = String::from(
        "# Zoo models that do not pass every stage of tests/zoo.rs (BLESS=1 rewrites this file):\n\
         # MODEL  STAGE-IT-STOPS-AT  WHY (the error it gives)\n",
    );
    for m in manifest["models"].as_array().expect("models") {
        let name = m["name"].as_str().expect("name");
        if filter.as_deref().is_some_and(|f| !name.contains(f)) {
            continue;
        }
        seen.push(name.to_string());
        let o = check(name, m);
        let mut cells = o.cells.clone();
        cells.resize(STAGES.len(), "·".into());
        let _ = writeln!(
            table,
            "| {name} | {} | {} | {} | {} |",
            m["exporter"].as_str().unwrap_or("?"),
            o.ops,
            o.params,
            cells.join(" | ")
        );
        let got = o.failed.as_ref().map(|(s, _)| STAGES[*s]);
        if let Some((stage, why)) = &o.failed {
            eprintln!("{name}: stops at {}: {why}", STAGES[*stage]);
            let why = why.strip_prefix("error: ").unwrap_or(why).replace(&zoo().display().to_string(), "zoo");
            let _ = writeln!(blessed, "{name}  {}  {why}", STAGES[*stage]);
        } else {
            passed += 1;
        }
        let want = expected.get(name).map(|(s, _)| s.as_str());
        if got != want {
            let rank = |s: Option<&str>| s.map_or(STAGES.len(), |s| STAGES.iter().position(|x| *x == s).unwrap_or(0));
            let how = if rank(got) < rank(want) { "REGRESSION" } else { "better than listed: update expected.txt" };
            problems.push(format!(
                "{name}: stops at {} but expected.txt says {} ({how})",
                got.unwrap_or("nothing (passes)"),
                want.unwrap_or("nothing (passes)")
            ));
        }
    }
    if std::env::var("BLESS").is_ok_and(|b| b == "1") && filter.is_none() {
        std::fs::write(zoo().join("expected.txt"), &blessed).expect("writing expected.txt");
        problems.clear();
    }
    if filter.is_none() {
        for name in expected.keys() {
            if !seen.contains(name) {
                problems.push(format!("expected.txt names {name}, which the zoo does not have"));
            }
        }
    }
    // Past libtest's capture, so a plain `cargo test` shows the table.
    use std::io::Write as _;
    let _ = writeln!(std::io::stdout().lock(), "\n{table}\nzoo: {passed} of {} models pass every stage", seen.len());
    assert!(problems.is_empty(), "zoo:\n{}", problems.join("\n"));
}

#[test]
fn torch_names_are_the_modules_state_dict_keys() {
    // `--save`'s names.json against PyTorch: every name found for a zoo model's initializer is a
    // key of its module's state dict (tests/data/zoo/state-dicts.json, made by
    // scripts/zoo/torch-names.py), with the initializer's shape, or its transpose where the name
    // says `transposed`. Prints each model's coverage.
    let refs: BTreeMap<String, BTreeMap<String, Vec<usize>>> =
        serde_json::from_str(&std::fs::read_to_string(zoo().join("state-dicts.json")).unwrap()).unwrap();
    let (mut named, mut total) = (0, 0);
    for (model, keys) in &refs {
        let path = zoo().join(model).join("model.onnx");
        let bytes = std::fs::read(&path).unwrap();
        let names = tracer::export::torch_names(&bytes, model).unwrap();
        let index = tracer::InitializerIndex::open(&path).unwrap();
        let inits: Vec<String> = index.names().map(str::to_string).collect();
        // Float initializers: the parameters (int64 buffers, such as position ids, are not).
        let names: BTreeMap<&String, &Vec<tracer::export::TorchName>> =
            names.iter().filter(|(i, _)| index.get(i).is_some()).collect();
        for (init, ns) in &names {
            let shape = &index.get(init).unwrap().shape;
            for n in ns.iter() {
                let want = keys.get(&n.name).unwrap_or_else(|| panic!("{model}: {init} named {} ({})", n.name, n.from));
                let mut got = shape.clone();
                if n.transposed {
                    got.reverse();
                }
                assert_eq!(&got, want, "{model}: {init} as {} ({})", n.name, n.from);
            }
        }
        let missing: Vec<&String> = inits.iter().filter(|i| !names.contains_key(i)).collect();
        println!("{model:<14} {} of {} initializers named; without a name: {missing:?}", names.len(), inits.len());
        named += names.len();
        total += inits.len();
    }
    println!("{named} of {total} initializers named in {} models", refs.len());
    assert!(named * 10 >= total * 9, "fewer than 90% named");
    // The bundled TorchScript exports whose weights the exporter renamed and transposed
    // (tests/data/refgrad/README.md, "ONNX semantics"): gpt2-tiny's lm_head, bert-tiny's
    // attention and dense weights; and the parameters merged into one initializer, named by
    // the Identity nodes that copy it.
    let models = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/models");
    let names = |m: &str| tracer::export::torch_names(&std::fs::read(models.join(m)).unwrap(), m).unwrap();
    let gpt2 = names("gpt2-tiny.onnx");
    let lm = &gpt2["onnx::MatMul_471"];
    assert_eq!((lm.len(), lm[0].name.as_str(), lm[0].transposed), (1, "m.lm_head.weight", true), "{lm:?}");
    let ln: Vec<&str> = gpt2["m.transformer.h.0.ln_1.bias"].iter().map(|n| n.name.as_str()).collect();
    assert!(ln.len() == 9 && ln.contains(&"m.transformer.ln_f.bias"), "{ln:?}");
    let bert = names("bert-tiny.onnx");
    let q = &bert["onnx::MatMul_258"][0];
    assert_eq!((q.name.as_str(), q.transposed), ("m.encoder.layer.0.attention.self.query.weight", true));
    assert!(bert.keys().all(|k| !k.contains("::") || bert[k][0].transposed), "{bert:?}");
}
