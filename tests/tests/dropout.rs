//! Training-mode dropout (issue 50, item 2): masks that do not depend on how a step is run.
//!
//! The model (built here, random weights): `x [B,16] → matmul + bias → relu → h [B,32]`; an
//! attention-like branch `reshape [B,4,8] → softmax → dropout(0.25, with its mask output) →
//! reshape [B,32]` multiplied into `h`; `dropout(0.3) → matmul + bias → y [B,8]`; `mse` to a
//! target. SGD with momentum 0.9, seed 7 for the masks.
//!
//! - **Keep rate and scale**: over 2^20 elements the kept count is within 5 standard deviations
//!   of the binomial mean `n (1 - p)` (`sigma = sqrt(n p (1-p))`: a false failure has a chance
//!   below 1e-6), every kept element is `x / (1 - p)` exactly (f32 product), the rest 0; masks
//!   of other steps, seeds and ops overlap as independent ones do (same 5-sigma bound).
//! - **Inference and evaluation do not drop**: the forward graph run without a step, a
//!   trainer's and a plan's evaluation of the loss, equal the model with every dropout removed,
//!   exactly.
//! - **Plans draw the single-device masks**: 3 steps of plans on 2x2 (data parallel, Megatron's
//!   tensor parallel), 1x4, and 2 pipeline stages of 2 microbatches (the graph at batch 4, fed
//!   8 rows) equal 3 steps of the single-device trainer at batch 8 (losses and parameters within
//!   1e-5 relative, as the equivalence suite `dist.rs` asks), and 1x4 and 2x2 give the same
//!   losses. The same run with another seed, or without dropout, does not (the masks matter).
//! - **Resume**: a plan run for 2 steps, checkpointed and resumed for 2 more equals 4 steps in
//!   one go, exactly; so does a trainer saved and loaded; another seed is refused on both.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use codegen::{Baseline, PlanOptions};
use ir::autodiff::{LossSpec, Optimizer, TrainOptions, TrainingGraph, training_graph};
use ir::{BinaryOp, DType, DropoutAttrs, Graph, Op, Tensor, TensorMeta, UnaryOp};
use kernels::random::{Draw, Stream};
use runtime::Cpu;
use runtime::launch::{CheckpointOptions, RunOptions};
use runtime::program::Program;
use runtime::train::Trainer;
use sharding::{DeviceMesh, DeviceProfile};

const TOL: f64 = 1e-5;
const STEPS: u64 = 3;
const SEED: u64 = 7;

/// The model at batch `b` (see the module docs); `drop` false builds it without dropouts.
fn model(b: usize, drop: bool) -> Result<Graph> {
    let f32m = |s: &[usize]| TensorMeta::new(DType::F32, s.to_vec());
    let mut g = Graph::new("dropout-mlp");
    let x = g.input("x", f32m(&[b, 16]));
    let param = |g: &mut Graph, name: &str, shape: &[usize], seed: u64, scale: f32| {
        let t = tests::random_tensor(shape, seed);
        let t = Tensor::f32(shape.to_vec(), t.to_f32_vec().iter().map(|v| v * scale).collect());
        g.param(name, f32m(shape), Some(t))
    };
    let w1 = param(&mut g, "w1", &[16, 32], 1, 0.3);
    let b1 = param(&mut g, "b1", &[32], 2, 0.1);
    let w2 = param(&mut g, "w2", &[32, 8], 3, 0.3);
    let b2 = param(&mut g, "b2", &[8], 4, 0.1);
    let h = g.add1("fc1", Op::MatMul, &[x, w1])?;
    let h = g.add1("fc1.bias", Op::Binary(BinaryOp::Add), &[h, b1])?;
    let h = g.add1("relu", Op::Unary(UnaryOp::Relu), &[h])?;
    let a = g.add1("heads", Op::Reshape { shape: vec![b, 4, 8] }, &[h])?;
    let a = g.add1("softmax", Op::Softmax { axis: 2 }, &[a])?;
    let a = if drop {
        g.add_op("attn.drop", Op::Dropout(DropoutAttrs { ratio: 0.25, id: 0, mask: true }), &[a])?[0]
    } else {
        a
    };
    let a = g.add1("merge", Op::Reshape { shape: vec![b, 32] }, &[a])?;
    let h = g.add1("gate", Op::Binary(BinaryOp::Mul), &[a, h])?;
    let h = if drop { g.add1("drop", Op::Dropout(DropoutAttrs { ratio: 0.3, id: 1, mask: false }), &[h])? } else { h };
    let y = g.add1("fc2", Op::MatMul, &[h, w2])?;
    let y = g.add1("fc2.bias", Op::Binary(BinaryOp::Add), &[y, b2])?;
    g.set_output("y", y);
    Ok(g)
}

fn train_graph(g: &Graph) -> Result<TrainingGraph> {
    let loss = LossSpec::Mse { output: "y".into(), target: "t".into() };
    let opt = Optimizer::Sgd { lr: 0.1, momentum: 0.9, weight_decay: 0.0 };
    Ok(training_graph(g, &TrainOptions::new(loss, Some(opt)))?)
}

fn feeds(b: usize) -> BTreeMap<String, Tensor> {
    BTreeMap::from([
        ("x".to_string(), tests::random_tensor(&[b, 16], 11)),
        ("t".to_string(), tests::random_tensor(&[b, 8], 12)),
    ])
}

fn rel(got: &Tensor, want: &Tensor) -> f64 {
    let (a, b) = (got.to_f64_vec(), want.to_f64_vec());
    let d: f64 = a.iter().zip(&b).map(|(x, y)| (x - y) * (x - y)).sum::<f64>().sqrt();
    d / b.iter().map(|y| y * y).sum::<f64>().sqrt().max(1e-12)
}

/// `steps` steps of the single-device trainer from the graph's parameters: losses and the
/// final parameters.
fn single(
    tg: &TrainingGraph,
    g: &Graph,
    seed: u64,
    b: usize,
    steps: u64,
) -> Result<(Vec<f32>, BTreeMap<String, Tensor>)> {
    let ctx = Cpu::new(1)?;
    let mut t = Trainer::new(tg, &g.param_data)?.with_seed(seed);
    let f = feeds(b);
    let losses = (0..steps).map(|_| Ok(t.step(&ctx, &f)?.loss)).collect::<Result<_>>()?;
    Ok((losses, t.params()))
}

fn plan_of(tg: &TrainingGraph, mesh: &DeviceMesh, opts: &PlanOptions) -> Result<Program> {
    let cpu = DeviceProfile::builtin("cpu").context("cpu profile")?;
    let plan = codegen::plan(&tg.graph, mesh, &cpu, opts)?;
    let plan = codegen::Plan::from_json(&plan.to_json()?)?;
    let mut program = Program::new(&plan)?;
    program.set_seed(SEED);
    Ok(program)
}

fn ropts(until: u64) -> RunOptions {
    RunOptions { until_step: until, timeout: Duration::from_secs(120), ..RunOptions::default() }
}

/// Runs `program` from fresh ranks until step `until`: losses and the assembled parameters.
fn run(program: &Program, g: &Graph, b: usize, until: u64) -> Result<(Vec<f32>, BTreeMap<String, Tensor>)> {
    let f = feeds(b);
    let states =
        (0..program.ranks()).map(|k| program.init_rank(k, &g.param_data, &f)).collect::<Result<Vec<_>, _>>()?;
    let mut losses = vec![];
    let states = runtime::launch::run_threads(program, states, &ropts(until), &mut |x| losses.push(x.loss))?;
    Ok((losses, program.assemble_params(&states)?))
}

fn opts(baseline: Baseline) -> PlanOptions {
    PlanOptions {
        budget: 1 << 30,
        baseline,
        time_limit: Duration::from_secs(1),
        threads: 1,
        compare_baselines: false,
        ..PlanOptions::default()
    }
}

#[test]
fn keep_rate_is_binomial_and_kept_elements_are_scaled() -> Result<()> {
    let ctx = Cpu::new(2)?;
    let n = 1usize << 20;
    let x = Tensor::f32(vec![1024, 1024], vec![1.0; n]);
    let draw = |seed, step, id: u32, ratio| -> Result<Vec<bool>> {
        let a = DropoutAttrs { ratio, id, mask: true };
        let d = Draw { stream: Stream { seed, step, microbatch: 0 }, shape: vec![1024, 1024], offsets: vec![0, 0] };
        let out = kernels::cpu::random::dropout(ctx.context(), &a, &x, Some(&d))?;
        let (y, mask) = (out[0].to_f32_vec(), out[1].as_bool().context("bool mask")?.to_vec());
        let s = (1.0 / (1.0 - ratio as f64)) as f32;
        for (v, &k) in y.iter().zip(&mask) {
            ensure!(*v == if k { s } else { 0.0 }, "ratio {ratio}: element {v} with keep {k}");
        }
        Ok(mask)
    };
    // |count - mean| <= 5 sigma of a binomial with `trials` and probability `q`.
    let within = |count: usize, trials: usize, q: f64, what: &str| -> Result<()> {
        let (mean, sigma) = (trials as f64 * q, (trials as f64 * q * (1.0 - q)).sqrt());
        let z = (count as f64 - mean) / sigma;
        println!("{what}: {count} of {trials} (expected {mean:.0}, {z:+.2} sigma)");
        ensure!(z.abs() <= 5.0, "{what}: {count} of {trials}, {z:.2} sigma from {mean:.0}");
        Ok(())
    };
    for ratio in [0.1f32, 0.5, 0.9] {
        let m = draw(SEED, 0, 0, ratio)?;
        let q = 1.0 - DropoutAttrs { ratio, id: 0, mask: false }.threshold() as f64 / 4294967296.0;
        within(m.iter().filter(|&&k| k).count(), n, q, &format!("kept at ratio {ratio}"))?;
    }
    // Other steps, seeds and ops draw independent masks: both kept with probability (1-p)^2.
    let base = draw(SEED, 0, 0, 0.5)?;
    for (what, other) in
        [("step 1", draw(SEED, 1, 0, 0.5)?), ("seed 8", draw(SEED + 1, 0, 0, 0.5)?), ("op 1", draw(SEED, 0, 1, 0.5)?)]
    {
        let both = base.iter().zip(&other).filter(|(a, b)| **a && **b).count();
        within(both, n, 0.25, &format!("kept in both step 0 and {what}"))?;
    }
    // A block at offsets draws the whole tensor's bits there.
    let a = DropoutAttrs { ratio: 0.5, id: 0, mask: false };
    let stream = Stream { seed: SEED, step: 0, microbatch: 0 };
    let block = kernels::cpu::random::keep_bits(
        ctx.context(),
        &a,
        &Draw { stream, shape: vec![1024, 1024], offsets: vec![512, 256] },
        &[3, 5],
    )?;
    for (k, &bit) in block.iter().enumerate() {
        ensure!(bit == base[(512 + k / 5) * 1024 + 256 + k % 5], "block element {k}");
    }
    // Microbatch 1 of a [512, 1024] tensor is rows 512.. of the whole batch's.
    let mb = Draw { stream: Stream { microbatch: 1, ..stream }, shape: vec![512, 1024], offsets: vec![0, 0] };
    let bits = kernels::cpu::random::keep_bits(ctx.context(), &a, &mb, &[512, 1024])?;
    ensure!(bits == base[n / 2..], "microbatch 1 draws the second half of the batch's mask");
    Ok(())
}

#[test]
fn inference_and_evaluation_do_not_drop() -> Result<()> {
    let ctx = Cpu::new(1)?;
    let (with, without) = (model(8, true)?, model(8, false)?);
    let f = feeds(8);
    let fx = BTreeMap::from([("x".to_string(), f["x"].clone())]);
    let y = runtime::Interpreter::new(&with)?.run(&ctx, &fx)?.outputs["y"].clone();
    let want = runtime::Interpreter::new(&without)?.run(&ctx, &fx)?.outputs["y"].clone();
    ensure!(y == want, "inference of the dropout model differs from the model without dropout");
    let (tg, tg0) = (train_graph(&with)?, train_graph(&without)?);
    let mut t = Trainer::new(&tg, &with.param_data)?.with_seed(SEED);
    let t0 = Trainer::new(&tg0, &without.param_data)?;
    let (e, e0) = (t.eval(&ctx, &f)?, t0.eval(&ctx, &f)?);
    ensure!(e == e0, "evaluation loss {e} vs {e0} without dropout");
    // The training step draws: its loss (before the update) differs.
    let l = t.step(&ctx, &f)?.loss;
    ensure!(l != e, "the training step dropped nothing (loss {l})");
    // A plan's evaluation does not drop either.
    let program = plan_of(&tg, &DeviceMesh::uniform(&[2, 2])?, &opts(Baseline::Dp))?;
    let states = (0..4).map(|k| program.init_rank(k, &with.param_data, &f)).collect::<Result<Vec<_>, _>>()?;
    let ev = std::thread::scope(|s| -> Result<Vec<f32>> {
        let comms = runtime::comm::ThreadWorld::new(4, Duration::from_secs(60));
        let hs: Vec<_> = states
            .iter()
            .zip(comms)
            .map(|(st, mut c)| {
                let p = &program;
                s.spawn(move || -> Result<f32> {
                    let ctx = Cpu::new(1)?;
                    let r = p.eval(st, &ctx, &mut c, vec![])?;
                    Ok(runtime::scalar_f32(&r.outputs["loss"]))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().map_err(|_| anyhow::anyhow!("rank panicked"))?).collect()
    })?;
    for l in ev {
        ensure!(((l - e0) as f64).abs() <= TOL * e0 as f64, "a plan's evaluation loss {l} vs {e0} without dropout");
    }
    Ok(())
}

#[test]
fn plans_draw_the_single_device_masks() -> Result<()> {
    let g8 = model(8, true)?;
    let tg8 = train_graph(&g8)?;
    let (want, want_params) = single(&tg8, &g8, SEED, 8, STEPS)?;
    println!("single device, seed {SEED}: {want:?}");
    // The masks matter: another seed, or no dropout, trains otherwise.
    let (other, _) = single(&tg8, &g8, SEED + 1, 8, STEPS)?;
    let g0 = model(8, false)?;
    let (plain, _) = single(&train_graph(&g0)?, &g0, SEED, 8, STEPS)?;
    ensure!(other != want && plain != want, "seed {} {other:?} / no dropout {plain:?} vs {want:?}", SEED + 1);

    let g4 = model(4, true)?;
    let tg4 = train_graph(&g4)?.with_gradient_scale(0.5);
    let pipeline = PlanOptions { stages: 2, microbatches: 2, ..opts(Baseline::Auto) };
    let cases: [(&str, [usize; 2], PlanOptions, bool); 5] = [
        ("2x2 dp", [2, 2], opts(Baseline::Dp), false),
        ("2x2 megatron", [2, 2], opts(Baseline::Megatron), false),
        ("2x2 auto", [2, 2], opts(Baseline::Auto), false),
        ("1x4 dp", [1, 4], opts(Baseline::Dp), false),
        ("2x1, 2 stages of 2 microbatches of 4", [2, 1], pipeline, true),
    ];
    let mut by_mesh = BTreeMap::new();
    for (what, shape, o, micro) in cases {
        let mesh = DeviceMesh::uniform(&shape)?;
        let program = plan_of(if micro { &tg4 } else { &tg8 }, &mesh, &o).with_context(|| what.to_string())?;
        ensure!(program.draws(), "{what}: the plan has no dropout");
        let (losses, params) =
            run(&program, if micro { &g4 } else { &g8 }, 8, STEPS).with_context(|| what.to_string())?;
        let mut worst: f64 = 0.0;
        for (got, w) in losses.iter().zip(&want) {
            let e = ((got - w) as f64).abs() / (*w as f64).abs();
            ensure!(e <= TOL, "{what}: loss {got} vs single device {w} ({e:.1e})");
            worst = worst.max(e);
        }
        ensure!(losses.len() == want.len(), "{what}: {} steps", losses.len());
        let mut pworst: f64 = 0.0;
        for (name, w) in &want_params {
            let e = rel(&params[name], w);
            ensure!(e <= TOL, "{what}: parameter {name} differs from single device by {e:.1e}");
            pworst = pworst.max(e);
        }
        println!("{what}: losses {losses:?}; max rel. error: loss {worst:.1e}, parameters {pworst:.1e}");
        by_mesh.insert(what, losses);
    }
    let (a, b) = (&by_mesh["1x4 dp"], &by_mesh["2x2 dp"]);
    let d = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).abs()).fold(0.0, f64::max);
    println!("1x4 vs 2x2 (dp): largest loss difference {d:.1e}");
    ensure!(d <= TOL * want[0] as f64, "1x4 {a:?} vs 2x2 {b:?}");
    Ok(())
}

#[test]
fn resumed_runs_continue_the_masks() -> Result<()> {
    let g = model(8, true)?;
    let tg = train_graph(&g)?;
    let program = plan_of(&tg, &DeviceMesh::uniform(&[2, 2])?, &opts(Baseline::Megatron))?;
    let (whole, whole_params) = run(&program, &g, 8, 4)?;
    let dir = std::env::temp_dir().join(format!("autopar-dropout-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let f = feeds(8);
    let states = (0..4).map(|k| program.init_rank(k, &g.param_data, &f)).collect::<Result<Vec<_>, _>>()?;
    let mut first = vec![];
    let o = RunOptions { checkpoint: Some(CheckpointOptions { dir: dir.clone(), every: None }), ..ropts(2) };
    runtime::launch::run_threads(&program, states, &o, &mut |x| first.push(x.loss))?;
    let load = |program: &Program| -> Result<Vec<runtime::program::RankState>> {
        (0..4)
            .map(|k| {
                let mut st = program.empty_rank(k, &f)?;
                runtime::checkpoint::load(&dir, program, &mut st)?;
                Ok(st)
            })
            .collect()
    };
    let mut second = vec![];
    let states = runtime::launch::run_threads(&program, load(&program)?, &ropts(4), &mut |x| second.push(x.loss))?;
    first.extend(second);
    ensure!(first == whole, "resumed {first:?} vs uninterrupted {whole:?}");
    let params = program.assemble_params(&states)?;
    for (name, w) in &whole_params {
        ensure!(&params[name] == w, "parameter {name} differs after the resume");
    }
    // Another seed would draw other masks: refused.
    let mut other = plan_of(&tg, &DeviceMesh::uniform(&[2, 2])?, &opts(Baseline::Megatron))?;
    other.set_seed(SEED + 1);
    let e = load(&other).err().context("a resume with another seed was accepted")?;
    ensure!(e.to_string().contains(&format!("--seed {SEED}")), "{e}");

    // The single-device trainer: saved after 2 steps and loaded, as 4 in one go.
    let ctx = Cpu::new(1)?;
    let (whole, _) = single(&tg, &g, SEED, 8, 4)?;
    let mut t = Trainer::new(&tg, &g.param_data)?.with_seed(SEED);
    let mut losses: Vec<f32> = (0..2).map(|_| Ok(t.step(&ctx, &f)?.loss)).collect::<Result<_>>()?;
    let saved = dir.join("trainer");
    t.save(&saved)?;
    let mut t = Trainer::new(&tg, &g.param_data)?.with_seed(SEED);
    t.load(&saved)?;
    for _ in 0..2 {
        losses.push(t.step(&ctx, &f)?.loss);
    }
    ensure!(losses == whole, "trainer resumed {losses:?} vs uninterrupted {whole:?}");
    let mut t = Trainer::new(&tg, &g.param_data)?.with_seed(SEED + 1);
    let e = t.load(&saved).err().context("a trainer load with another seed was accepted")?;
    ensure!(e.to_string().contains(&format!("--seed {SEED}")), "{e}");
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
