//! Fused attention in training plans: generated GPT and LLaMA decoders written with one ONNX
//! `Attention` node per layer (`autopar gen ... --attention fused`) train on threads, split by
//! data, heads (Megatron), stages and microbatches, as one device trains them: losses and final
//! parameters within [`TOL`] (relative, norm-wise) over [`STEPS`] SGD steps with momentum. The
//! single-device reference is the same model written with separate ops (MatMul, Softmax,
//! MatMul, whose kernels the ONNX node suite checks), so the fused op's forward and its
//! recomputing backward are checked against the unfused formulation too.
//!
//! Parameters come from [`runtime::params::SeededInit`] (the models are weight-free), the tokens
//! from a fixed pseudo-random draw.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use codegen::plan::ScheduleKind;
use codegen::{Baseline, PlanOptions};
use ir::autodiff::{LossSpec, Optimizer, TrainOptions, training_graph};
use ir::params::ParamSource;
use ir::{Graph, Op, Tensor};
use runtime::launch::RunOptions;
use sharding::{DeviceMesh, DeviceProfile};
use tracer::generate::{AttentionForm, GptConfig, LlamaConfig};

/// Relative tolerance on losses and parameters (the distributed tests' 1e-5).
const TOL: f64 = 1e-5;
const STEPS: u64 = 3;
const SGD: Optimizer = Optimizer::Sgd { lr: 0.05, momentum: 0.9, weight_decay: 0.0 };

/// The ops of `g`.
fn ops(g: &Graph) -> Vec<&Op> {
    g.topo_order().expect("a DAG").into_iter().map(|n| &g.node(n).op).collect()
}

fn import(bytes: &[u8], name: &str) -> Result<Graph> {
    let opts = tracer::ImportOptions { load_weights: false, ..Default::default() };
    let mut g = tracer::import_bytes(bytes, name, name, None, &opts)?;
    ir::passes::canonicalize(&mut g)?;
    Ok(g)
}

/// Every parameter of `g`, whole, from the seeded initialisation.
fn seeded_params(g: &Graph) -> Result<BTreeMap<String, Tensor>> {
    let init = runtime::params::SeededInit { seed: 11 };
    let mut out = BTreeMap::new();
    for i in g.topo_order().expect("a DAG") {
        let n = g.node(i);
        if let Op::Param { name, .. } = &n.op {
            let meta = &n.outputs[0];
            let t = init
                .block(name, meta, &vec![0; meta.rank()], &meta.shape.clone())
                .map_err(anyhow::Error::msg)?
                .with_context(|| format!("no initial value for {name}"))?;
            out.insert(name.clone(), t);
        }
    }
    Ok(out)
}

fn tokens(batch: usize, seq: usize, vocab: usize) -> Tensor {
    let ids = (0..batch * seq).map(|i| ((i * 7919 + 13) % vocab) as i64).collect();
    Tensor::i64([batch, seq], ids)
}

fn rel_err(got: &Tensor, want: &Tensor) -> Result<f64> {
    ensure!(got.meta() == want.meta(), "{} vs {}", got.meta(), want.meta());
    let (a, b) = (got.to_f64_vec(), want.to_f64_vec());
    let norm = |v: &mut dyn Iterator<Item = f64>| v.map(|x| x * x).sum::<f64>().sqrt();
    Ok(norm(&mut a.iter().zip(&b).map(|(x, y)| x - y)) / norm(&mut b.iter().copied()).max(1e-12))
}

struct Model {
    name: &'static str,
    fused: Graph,
    unfused: Graph,
    feeds: BTreeMap<String, Tensor>,
}

fn models() -> Result<Vec<Model>> {
    // A batch of 2 (a mesh of 4 cannot split it alone) and sequences long enough that the
    // planner splits the heads.
    let (batch, seq) = (2, 128);
    let gpt = GptConfig { layers: 2, hidden: 32, heads: 4, seq, vocab: 32, batch };
    let llama = LlamaConfig { layers: 2, hidden: 32, heads: 4, kv_heads: 2, ffn: 64, seq, vocab: 32, batch };
    let ids = tokens(batch, seq, 32);
    let positions = Tensor::i64([batch, seq], (0..batch * seq).map(|i| (i % seq) as i64).collect());
    let gen_gpt = |f| tracer::generate::gpt_with(&gpt, f).map_err(anyhow::Error::msg);
    let gen_llama = |f| tracer::generate::llama_with(&llama, f).map_err(anyhow::Error::msg);
    Ok(vec![
        Model {
            name: "gpt",
            fused: import(&gen_gpt(AttentionForm::Fused)?, "gpt")?,
            unfused: import(&gen_gpt(AttentionForm::Unfused)?, "gpt")?,
            feeds: BTreeMap::from([("input_ids".to_string(), ids.clone())]),
        },
        Model {
            name: "llama",
            fused: import(&gen_llama(AttentionForm::Fused)?, "llama")?,
            unfused: import(&gen_llama(AttentionForm::Unfused)?, "llama")?,
            feeds: BTreeMap::from([("input_ids".to_string(), ids), ("position_ids".to_string(), positions)]),
        },
    ])
}

/// Single-device training of `g`: the losses and the final parameters.
fn train(
    g: &Graph,
    params: &BTreeMap<String, Tensor>,
    feeds: &BTreeMap<String, Tensor>,
) -> Result<(Vec<f32>, BTreeMap<String, Tensor>)> {
    let loss: LossSpec = "ce-next:logits:input_ids".parse().map_err(anyhow::Error::msg)?;
    let tg = training_graph(g, &TrainOptions::new(loss, Some(SGD)))?;
    let cpu = runtime::Cpu::new(1)?;
    let mut t = runtime::train::Trainer::new(&tg, params)?;
    let losses = (0..STEPS).map(|_| Ok(t.step(&cpu, feeds)?.loss)).collect::<Result<Vec<_>>>()?;
    Ok((losses, t.params()))
}

#[test]
fn fused_attention_trains_as_the_unfused_model_on_one_device() -> Result<()> {
    for m in models()? {
        let n_attn = ops(&m.fused).into_iter().filter(|op| matches!(op, Op::Attention(_))).count();
        ensure!(n_attn == 2, "{}: {n_attn} attention ops", m.name);
        ensure!(!ops(&m.fused).into_iter().any(|op| matches!(op, Op::Softmax { .. })), "{}: a softmax is left", m.name);
        let params = seeded_params(&m.fused)?;
        let (fl, fp) = train(&m.fused, &params, &m.feeds)?;
        let (ul, up) = train(&m.unfused, &params, &m.feeds)?;
        for (a, b) in fl.iter().zip(&ul) {
            let e = ((a - b) as f64).abs() / (*b as f64).abs();
            ensure!(e <= TOL, "{}: fused loss {a} vs unfused {b}", m.name);
        }
        let mut worst: f64 = 0.0;
        for (name, want) in &up {
            worst = worst.max(rel_err(&fp[name], want).with_context(|| name.clone())?);
        }
        println!("{}: fused vs unfused over {STEPS} steps: losses {fl:?}, worst parameter {worst:.2e}", m.name);
        ensure!(worst <= TOL, "{}: parameters differ by {worst:.2e}", m.name);
    }
    Ok(())
}

#[test]
fn fused_attention_plans_train_as_one_device() -> Result<()> {
    let cpu = DeviceProfile::builtin("cpu").context("cpu profile")?;
    // (mesh, baseline, stages, microbatches, schedule)
    let configs: [(&[usize], Baseline, usize, usize, ScheduleKind); 5] = [
        (&[2, 2], Baseline::Auto, 1, 1, ScheduleKind::OneFOneB),
        (&[4], Baseline::Megatron, 1, 1, ScheduleKind::OneFOneB),
        (&[2, 2], Baseline::Dp, 1, 2, ScheduleKind::OneFOneB),
        (&[2, 2], Baseline::Megatron, 2, 2, ScheduleKind::OneFOneB),
        (&[2, 2], Baseline::Auto, 2, 4, ScheduleKind::Interleaved),
    ];
    let mut rows = 0;
    for m in models()? {
        let mut head_splits = 0;
        let params = seeded_params(&m.fused)?;
        let (want_losses, want_params) = train(&m.fused, &params, &m.feeds)?;
        let loss: LossSpec = "ce-next:logits:input_ids".parse().map_err(anyhow::Error::msg)?;
        let tg = training_graph(&m.fused, &TrainOptions::new(loss, Some(SGD)))?;
        for (shape, baseline, stages, microbatches, schedule) in configs {
            let what =
                format!("{} on {shape:?}, {}, {stages} stages, {microbatches} microbatches", m.name, baseline.name());
            let mesh = DeviceMesh::uniform(shape)?;
            let scaled;
            let graph = if microbatches > 1 {
                scaled = tg.with_gradient_scale(1.0 / microbatches as f32);
                &scaled.graph
            } else {
                &tg.graph
            };
            let opts = PlanOptions {
                budget: 16 << 30,
                baseline,
                time_limit: Duration::from_secs(1),
                compare_baselines: false,
                stages,
                microbatches,
                schedule,
                chunks: 2,
                ..PlanOptions::default()
            };
            let plan = codegen::plan(graph, &mesh, &cpu, &opts).with_context(|| what.clone())?;
            // How the attention ops are split (their strategies' names: `batch@0 heads@1`, ...).
            let mut splits: Vec<String> = plan
                .estimate
                .per_op
                .iter()
                .filter(|o| o.op.starts_with("attention"))
                .map(|o| format!("{} {}", o.op, o.strategy))
                .collect();
            splits.sort();
            splits.dedup();
            let plan = codegen::Plan::from_json(&plan.to_json()?).with_context(|| what.clone())?;
            let program = runtime::program::Program::new(&plan).with_context(|| what.clone())?;
            let feeds: BTreeMap<String, Tensor> =
                m.feeds.iter().map(|(k, t)| (k.clone(), tests::repeat_rows(t, microbatches))).collect();
            let states = (0..program.ranks())
                .map(|k| program.init_rank(k, &params, &feeds))
                .collect::<Result<Vec<_>, _>>()
                .with_context(|| what.clone())?;
            let ropts = RunOptions { until_step: STEPS, timeout: Duration::from_secs(120), ..RunOptions::default() };
            let mut losses = vec![];
            let states = runtime::launch::run_threads(&program, states, &ropts, &mut |x| losses.push(x.loss))
                .with_context(|| what.clone())?;
            for (got, want) in losses.iter().zip(&want_losses) {
                let e = ((got - want) as f64).abs() / (*want as f64).abs();
                ensure!(e <= TOL, "{what}: loss {got} vs single-device {want}");
            }
            let got = program.assemble_params(&states)?;
            let mut worst: f64 = 0.0;
            for (name, want) in &want_params {
                worst = worst.max(rel_err(&got[name], want).with_context(|| format!("{what}: {name}"))?);
            }
            ensure!(worst <= TOL, "{what}: parameters differ from single-device by {worst:.2e}");
            println!("{what}: equal (worst parameter {worst:.1e}); attention split as {splits:?}");
            head_splits += usize::from(splits.iter().any(|s| s.contains("heads@")));
            rows += 1;
        }
        ensure!(head_splits > 0, "{}: no plan splits the attention heads", m.name);
    }
    ensure!(rows == 10);
    Ok(())
}
