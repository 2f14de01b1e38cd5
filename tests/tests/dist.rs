//! Distributed training equals single-device training (issue 7, acceptance 1 and 3).
//!
//! For mlp, gpt2-tiny, bert-tiny and resnet18, on meshes 1x2, 2x1, 2x2, 1x4 and 2x4, with the auto
//! plan and each manual baseline (dp, megatron, zero) that fits a generous budget: 3 training
//! steps of the plan on the `threads` back end (one thread per rank) give the same per-step losses
//! and final parameters as 3 steps of the single-device `Trainer` on the same training graph,
//! within 1e-5 relative (norm-wise per tensor; losses relative). Parameters start from the ONNX
//! file's initializers, read block by block by every rank.
//!
//! The optimizer is SGD with momentum 0.9 (its momentum is optimizer state, sharded like its
//! parameter): AdamW's first steps amplify rounding noise in near-zero gradients to a full
//! learning-rate step (see tests/data/refgrad/README.md), so an AdamW comparison would test the
//! optimizer's conditioning, not the plan. AdamW plans are executed by the CLI tests.
//!
//! Memory (acceptance 3): every rank's measured peak (bytes of tensors held at once) is compared
//! with the plan's estimate; the table printed at the end lists both, and the test fails beyond
//! 10%.
//!
//! resnet18 (BN-free, random initialisation) is chaotic at the f32 level: among its millions of
//! ReLU inputs some sit within rounding error of zero (tests/tests/refgrad.rs, `RESNET`), and any
//! change of summation order (a batch split's all-reduce of weight gradients, a partial sum over
//! split channels) can flip one, which moves every gradient behind it by ~1e-4. Its convolutions
//! run with f64 accumulation on both sides, which removes the flips of step 1; for later steps
//! the parameter tolerance is the larger of 1e-5 and the model's own *noise floor*: how far the
//! single-device run moves when only its accumulation precision changes (f64 vs f32 sums, the
//! same graph and data). A sharded run may not deviate more than the single-device run deviates
//! from itself. The printed table shows the floor; for mlp, gpt2-tiny and bert-tiny it is below
//! 1e-5, so their check is exactly 1e-5. Losses are checked at 1e-5 for every model and step.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use codegen::{Baseline, PlanOptions};
use ir::Tensor;
use ir::autodiff::{LossSpec, Optimizer, TrainOptions, training_graph};
use kernels::cpu::{Accumulation, CpuContext};
use runtime::dist::Program;
use runtime::launch::RunOptions;
use runtime::train::Trainer;
use sharding::{DeviceMesh, DeviceProfile};

const TOL: f64 = 1e-5;
const MEM_TOL: f64 = 0.10;
const STEPS: u64 = 3;
const MESHES: [[usize; 2]; 5] = [[1, 2], [2, 1], [2, 2], [1, 4], [2, 4]];

fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("data")
}

struct Case {
    model: &'static str,
    loss: &'static str,
    feeds: &'static [(&'static str, &'static str)],
    lr: f32,
    accumulation: Accumulation,
}

const CASES: [Case; 4] = [
    Case {
        model: "mlp",
        loss: "mse:y:target",
        feeds: &[("x", "models/mlp.x.npy"), ("target", "refgrad/mlp/mlp.target.npy")],
        lr: 0.05,
        accumulation: Accumulation::F32,
    },
    Case {
        model: "gpt2-tiny",
        loss: "ce-next:logits:input_ids",
        feeds: &[("input_ids", "models/gpt2-tiny.input_ids.npy")],
        lr: 0.05,
        accumulation: Accumulation::F32,
    },
    Case {
        model: "bert-tiny",
        loss: "mse:last_hidden_state:target",
        feeds: &[
            ("input_ids", "models/bert-tiny.input_ids.npy"),
            ("attention_mask", "models/bert-tiny.attention_mask.npy"),
            ("target", "refgrad/bert-tiny/bert-tiny.target.npy"),
        ],
        lr: 0.05,
        accumulation: Accumulation::F32,
    },
    Case {
        model: "resnet18",
        loss: "ce:logits:labels",
        feeds: &[("input", "models/resnet18.input.npy"), ("labels", "refgrad/resnet18/resnet18.labels.npy")],
        lr: 1e-4,
        accumulation: Accumulation::F64,
    },
];

fn norm(v: &[f32]) -> f64 {
    v.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>().sqrt()
}

fn rel_err(got: &Tensor, want: &Tensor) -> Result<f64> {
    ensure!(got.meta() == want.meta(), "{} vs {}", got.meta(), want.meta());
    let (a, b) = (got.to_f32_vec(), want.to_f32_vec());
    let d: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x - y).collect();
    Ok(norm(&d) / norm(&b).max(1e-12))
}

struct Row {
    model: &'static str,
    mesh: String,
    plan: String,
    loss_err: f64,
    param_err: f64,
    estimate: u64,
    measured: u64,
}

fn check_model(c: &Case) -> Result<Vec<Row>> {
    let path = data().join(format!("models/{}.onnx", c.model));
    let mut g = tracer::import_file(&path, &tracer::ImportOptions::default())?;
    ir::passes::canonicalize(&mut g)?;
    let mut feeds = BTreeMap::new();
    for (name, file) in c.feeds {
        feeds.insert(name.to_string(), runtime::npy::read_npy(&data().join(file))?);
    }
    let loss: LossSpec = c.loss.parse().map_err(anyhow::Error::msg)?;
    let optimizer = Optimizer::Sgd { lr: c.lr, momentum: 0.9, weight_decay: 0.0 };
    let tg = training_graph(&g, &TrainOptions { loss, optimizer: Some(optimizer), frozen: vec![] })?;

    // The single-device reference.
    let ctx = CpuContext::new(1)?.with_accumulation(c.accumulation);
    let mut trainer = Trainer::new(&tg, &g.param_data)?;
    let mut want_losses = vec![];
    for _ in 0..STEPS {
        want_losses.push(trainer.step(&ctx, &feeds)?.loss);
    }
    let want_params = trainer.params();
    // The noise floor: the same single-device run with the other accumulation precision.
    let other = match c.accumulation {
        Accumulation::F32 => Accumulation::F64,
        Accumulation::F64 => Accumulation::F32,
    };
    let ctx2 = CpuContext::new(1)?.with_accumulation(other);
    let mut t2 = Trainer::new(&tg, &g.param_data)?;
    for _ in 0..STEPS {
        t2.step(&ctx2, &feeds)?;
    }
    let mut floor: f64 = 0.0;
    for (name, p) in t2.params() {
        floor = floor.max(rel_err(&p, &want_params[&name])?);
    }
    let param_tol = TOL.max(floor);
    println!(
        "{}: noise floor (single-device f64 vs f32 sums, {STEPS} steps) {floor:.2e}; parameter tolerance {param_tol:.1e}",
        c.model
    );

    let index = tracer::InitializerIndex::open(&path)?;
    let cpu = DeviceProfile::builtin("cpu").context("cpu profile")?;
    let mut rows = vec![];
    for shape in MESHES {
        let mesh = DeviceMesh::uniform(&shape)?;
        for b in Baseline::ALL {
            let opts = PlanOptions {
                budget: 16 << 30,
                baseline: b,
                time_limit: Duration::from_secs(1),
                threads: 1,
                compare_baselines: false,
                ..PlanOptions::default()
            };
            let what = format!("{} on {}x{} with {}", c.model, shape[0], shape[1], b.name());
            let t_plan = std::time::Instant::now();
            let plan = match codegen::plan(&tg.graph, &mesh, &cpu, &opts) {
                Ok(p) => p,
                Err(e) => {
                    println!("{what}: no plan ({e})");
                    continue;
                }
            };
            // Through JSON, as `autopar run` reads it.
            let plan = codegen::Plan::from_json(&plan.to_json()).with_context(|| what.clone())?;
            let program = Program::new(&plan).with_context(|| what.clone())?;
            let t_init = std::time::Instant::now();
            let states = (0..program.ranks())
                .map(|r| program.init_rank(r, &index, &feeds))
                .collect::<Result<Vec<_>, _>>()
                .with_context(|| what.clone())?;
            let ropts = RunOptions {
                until_step: STEPS,
                accumulation: c.accumulation,
                timeout: Duration::from_secs(120),
                ..RunOptions::default()
            };
            let t_run = std::time::Instant::now();
            let mut losses = vec![];
            let mut peaks = vec![];
            let states = runtime::launch::run_threads(&program, states, &ropts, &mut |r| {
                losses.push(r.loss);
                peaks.push(r.peak_bytes.clone());
            })
            .with_context(|| what.clone())?;
            println!(
                "{what}: plan {:.2}s init {:.2}s run {:.2}s",
                (t_init - t_plan).as_secs_f64(),
                (t_run - t_init).as_secs_f64(),
                t_run.elapsed().as_secs_f64()
            );
            let mut loss_err: f64 = 0.0;
            for (i, (got, want)) in losses.iter().zip(&want_losses).enumerate() {
                let e = ((got - want) as f64).abs() / (*want as f64).abs().max(1e-12);
                ensure!(e <= TOL, "{what}: step {} loss {got} vs single-device {want} ({e:.2e})", i + 1);
                loss_err = loss_err.max(e);
            }
            ensure!(losses.len() == STEPS as usize, "{what}: {} steps reported", losses.len());
            let params = program.assemble_params(&states).with_context(|| what.clone())?;
            let mut param_err: f64 = 0.0;
            for (name, want) in &want_params {
                let got = params.get(name).with_context(|| format!("{what}: no parameter {name}"))?;
                let e = rel_err(got, want).with_context(|| format!("{what}: {name}"))?;
                ensure!(
                    e <= param_tol,
                    "{what}: parameter {name} differs from single-device by {e:.2e} (tolerance {param_tol:.1e})"
                );
                param_err = param_err.max(e);
            }
            let measured = peaks.iter().flatten().copied().max().unwrap_or(0);
            let estimate = plan.estimate.peak_bytes_per_rank;
            let dev = (measured as f64 - estimate as f64).abs() / estimate.max(1) as f64;
            ensure!(
                dev <= MEM_TOL,
                "{what}: measured peak {measured} B vs estimate {estimate} B ({:.1}%)",
                dev * 100.0
            );
            rows.push(Row {
                model: c.model,
                mesh: format!("{}x{}", shape[0], shape[1]),
                plan: format!("{} ({})", b.name(), plan.solver.chosen.name()),
                loss_err,
                param_err,
                estimate,
                measured,
            });
        }
    }
    Ok(rows)
}

fn report(rows: &[Row]) {
    println!(
        "| model | mesh | plan | max loss rel. err | max param rel. err | estimated peak (B) | measured peak (B) | deviation |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for r in rows {
        let dev = 100.0 * (r.measured as f64 - r.estimate as f64) / r.estimate.max(1) as f64;
        println!(
            "| {} | {} | {} | {:.1e} | {:.1e} | {} | {} | {dev:+.2}% |",
            r.model, r.mesh, r.plan, r.loss_err, r.param_err, r.estimate, r.measured
        );
    }
    println!("{} (model, mesh, plan) combinations ran {STEPS} steps equal to single-device training", rows.len());
}

#[test]
fn mlp_equals_single_device() -> Result<()> {
    let rows = check_model(&CASES[0])?;
    report(&rows);
    Ok(())
}

#[test]
fn gpt2_tiny_equals_single_device() -> Result<()> {
    let rows = check_model(&CASES[1])?;
    report(&rows);
    Ok(())
}

#[test]
fn bert_tiny_equals_single_device() -> Result<()> {
    let rows = check_model(&CASES[2])?;
    report(&rows);
    Ok(())
}

#[test]
fn resnet18_equals_single_device() -> Result<()> {
    let rows = check_model(&CASES[3])?;
    report(&rows);
    Ok(())
}
