//! Routed experts (issue 47, first slices): `Op::Moe` against PyTorch, and plans with the op.
//!
//! - `moe_matches_pytorch`: the forward (y and the auxiliary load-balancing loss) and the
//!   gradient op `Op::MoeGrad` (dx, the router's and every expert weight's gradient) on the
//!   inputs of `tests/data/moe/refs.json`, which Hugging Face's own `MixtralSparseMoeBlock` and
//!   `load_balancing_loss_func` computed in float32 (`scripts/moe-refs.py`). The loss there is
//!   `sum(y * r) + aux_weight * aux`, so the gradient op gets dy = r and daux = aux_weight.
//!   Tolerance: `|ours - ref| <= 1e-5 * max(1, |ref|)` per element (both sides f32, sums of a
//!   few terms in different orders: a few ulps).
//! - `plans_with_the_op_are_valid_and_train_like_one_device`: a tiny model with the op (a
//!   linear layer, the MoE block, the aux loss added to the output) is planned on a 2x2 mesh
//!   (the op replicated: its only strategy), the plan passes its JSON loader, and 3 SGD steps of
//!   it on threads give the single-device trainer's losses to 1e-5 relative.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use codegen::PlanOptions;
use codegen::plan::Instr;
use ir::autodiff::{LossSpec, Optimizer, TrainOptions, training_graph};
use ir::{BinaryOp, DType, Graph, MoeAct, MoeAttrs, Op, Tensor, TensorMeta};
use runtime::launch::RunOptions;
use runtime::params::{ParamSource, SeededInit};
use runtime::program::Program;
use runtime::train::Trainer;
use runtime::{Accumulation, Cpu};
use serde_json::Value as Json;
use sharding::{DeviceMesh, DeviceProfile};

const TOL: f64 = 1e-5;

fn refs() -> Result<Json> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/moe/refs.json");
    Ok(serde_json::from_str(&std::fs::read_to_string(&p).with_context(|| p.display().to_string())?)?)
}

fn floats(v: &Json) -> Result<Vec<f32>> {
    v.as_array().context("an array")?.iter().map(|x| x.as_f64().map(|f| f as f32).context("a number")).collect()
}

fn close(what: &str, got: &[f32], want: &[f32]) -> Result<f64> {
    ensure!(got.len() == want.len(), "{what}: {} values, reference {}", got.len(), want.len());
    let mut worst: f64 = 0.0;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let e = (g as f64 - w as f64).abs() / (w as f64).abs().max(1.0);
        ensure!(e <= TOL, "{what}[{i}]: {g} vs PyTorch {w} ({e:.2e} > {TOL:.0e})");
        worst = worst.max(e);
    }
    Ok(worst)
}

#[test]
fn moe_matches_pytorch() -> Result<()> {
    let doc = refs()?;
    let ctx = kernels::cpu::CpuContext::new(1)?;
    for c in doc["cases"].as_array().context("cases")? {
        let name = c["name"].as_str().context("name")?;
        let s = &c["shape"];
        let dim = |k: &str| s[k].as_u64().map(|v| v as usize).with_context(|| format!("{name}: shape.{k}"));
        let (b, sq, h, f, e, k) =
            (dim("batch")?, dim("seq")?, dim("hidden")?, dim("ffn")?, dim("experts")?, dim("top_k")?);
        let attrs =
            MoeAttrs { experts: e, top_k: k, normalize: c["normalize"].as_bool() == Some(true), act: MoeAct::Swiglu };
        let i = &c["inputs"];
        let t = |v: &Json, shape: &[usize]| -> Result<Tensor> { Ok(Tensor::f32(shape.to_vec(), floats(v)?)) };
        let ins = [
            t(&i["x"], &[b, sq, h])?,
            t(&i["router"], &[h, e])?,
            t(&i["w1"], &[e, h, f])?,
            t(&i["w3"], &[e, h, f])?,
            t(&i["w2"], &[e, f, h])?,
        ];
        let refs: Vec<&Tensor> = ins.iter().collect();
        let out = kernels::cpu::eval(&ctx, &Op::Moe(attrs), &refs)?;
        let mut worst = close(&format!("{name}: y"), out[0].as_f32().context("y")?, &floats(&c["y"])?)?;
        let aux = c["aux"].as_f64().context("aux")? as f32;
        worst = worst.max(close(&format!("{name}: aux"), out[1].as_f32().context("aux")?, &[aux])?);
        let aux_weight = c["aux_weight"].as_f64().context("aux_weight")? as f32;
        let dy = t(&i["r"], &[b, sq, h])?;
        let daux = Tensor::f32(Vec::<usize>::new(), vec![aux_weight]);
        let mut gins = refs.clone();
        gins.extend([&dy, &daux]);
        let grads = kernels::cpu::eval(&ctx, &Op::MoeGrad(attrs), &gins)?;
        for (g, key) in grads.iter().zip(["x", "router", "w1", "w3", "w2"]) {
            let want = floats(&c["grads"][key])?;
            worst = worst.max(close(&format!("{name}: d{key}"), g.as_f32().context("grad")?, &want)?);
        }
        println!("{name}: y, aux and 5 gradients within {worst:.2e} of PyTorch");
    }
    Ok(())
}

/// A tiny model: `z = x W_in`, `(y, aux) = moe(z)`, output `y + aux` (the aux loss trained too).
fn tiny(act: MoeAct) -> Result<Graph> {
    let (tokens, hidden, experts, ffn) = (8, 4, 4, 6);
    let mut g = Graph::new("moe-tiny");
    let f = |s: &[usize]| TensorMeta::new(DType::F32, s.to_vec());
    let x = g.input("x", f(&[tokens, hidden]));
    let w_in = g.param("w_in", f(&[hidden, hidden]), None);
    let z = g.add1("proj", Op::MatMul, &[x, w_in])?;
    let router = g.param("router", f(&[hidden, experts]), None);
    let mut ins = vec![z, router, g.param("w1", f(&[experts, hidden, ffn]), None)];
    if act == MoeAct::Swiglu {
        ins.push(g.param("w3", f(&[experts, hidden, ffn]), None));
    }
    ins.push(g.param("w2", f(&[experts, ffn, hidden]), None));
    let attrs = MoeAttrs { experts, top_k: 2, normalize: true, act };
    let outs = g.add_op("moe", Op::Moe(attrs), &ins)?;
    let y = g.add1("out", Op::Binary(BinaryOp::Add), &[outs[0], outs[1]])?;
    g.set_output("y", y);
    Ok(g)
}

/// A parameter source's values times a factor.
struct Scaled(SeededInit, f32);

impl ParamSource for Scaled {
    fn block(
        &self,
        name: &str,
        meta: &TensorMeta,
        offsets: &[usize],
        size: &[usize],
    ) -> Result<Option<Tensor>, String> {
        let Some(t) = self.0.block(name, meta, offsets, size)? else { return Ok(None) };
        let v: Vec<f32> = t.as_f32().ok_or("seeded blocks are f32")?.iter().map(|x| x * self.1).collect();
        Ok(Some(Tensor::f32(size.to_vec(), v)))
    }
}

#[test]
fn plans_with_the_op_are_valid_and_train_like_one_device() -> Result<()> {
    const STEPS: u64 = 3;
    let cpu_profile = DeviceProfile::builtin("cpu").context("cpu profile")?;
    for act in [MoeAct::Swiglu, MoeAct::Gelu] {
        let g = tiny(act)?;
        let loss: LossSpec = "mse:y:t".parse().map_err(anyhow::Error::msg)?;
        let opt = Optimizer::Sgd { lr: 0.1, momentum: 0.0, weight_decay: 0.0 };
        let tg = training_graph(&g, &TrainOptions::new(loss, Some(opt)))?;
        // The seeded init scaled to std 0.5 on both sides (the same global tensors on every
        // rank), so the routing is far from uniform and the steps move the loss.
        let init = Scaled(SeededInit { seed: 47 }, 25.0);
        let mut params = BTreeMap::new();
        for &p in &g.params {
            let Op::Param { name } = &g.node(p).op else { continue };
            let meta = g.meta(ir::Value::new(p, 0)).clone();
            let t = init.block(name, &meta, &vec![0; meta.rank()], &meta.shape).map_err(anyhow::Error::msg)?;
            params.insert(name.clone(), t.context("seeded")?);
        }
        let mut feeds = BTreeMap::new();
        let xs: Vec<f32> = (0..32).map(|i| ((i * 37 % 17) as f32 - 8.0) * 0.125).collect();
        let ts: Vec<f32> = (0..32).map(|i| ((i * 11 % 13) as f32 - 6.0) * 0.1).collect();
        feeds.insert("x".to_string(), Tensor::f32(vec![8, 4], xs));
        feeds.insert("t".to_string(), Tensor::f32(vec![8, 4], ts));

        let ctx = Cpu::new(1)?;
        let mut trainer = Trainer::new(&tg, &params)?;
        let want: Vec<f32> = (0..STEPS).map(|_| Ok(trainer.step(&ctx, &feeds)?.loss)).collect::<Result<_>>()?;

        let mesh = DeviceMesh::uniform(&[2, 2])?;
        let opts = PlanOptions { budget: 1 << 30, compare_baselines: false, ..PlanOptions::default() };
        let plan = codegen::plan(&tg.graph, &mesh, &cpu_profile, &opts).context("planning the MoE model on 2x2")?;
        let plan = codegen::Plan::from_json(&plan.to_json()?).context("the plan's own loader")?;
        let mut seen = 0;
        for i in &plan.program {
            if let Instr::Op { op: Op::Moe(_) | Op::MoeGrad(_), input_specs, .. } = i {
                seen += 1;
                ensure!(
                    input_specs.iter().all(|s| s.dims().iter().all(|d| d.is_empty()) && !s.to_string().contains('|')),
                    "the op is replicated only, got {input_specs:?}"
                );
            }
        }
        ensure!(seen >= 2, "{act:?}: the plan holds {seen} moe/moe_grad ops");
        let program = Program::with_float_type(&plan, DType::F32)?;
        let states =
            (0..program.ranks()).map(|k| program.init_rank(k, &init, &feeds)).collect::<Result<Vec<_>, _>>()?;
        let ropts = RunOptions {
            until_step: STEPS,
            accumulation: Accumulation::F32,
            timeout: Duration::from_secs(120),
            ..RunOptions::default()
        };
        let mut got = vec![];
        runtime::launch::run_threads(&program, states, &ropts, &mut |x| got.push(x.loss))?;
        ensure!(got.len() == want.len(), "{} steps reported", got.len());
        for (s, (g, w)) in got.iter().zip(&want).enumerate() {
            let e = ((g - w) as f64).abs() / (*w as f64).abs().max(1e-12);
            ensure!(e <= TOL, "{act:?} step {}: plan loss {g} vs single device {w} ({e:.2e})", s + 1);
        }
        println!(
            "{act:?}: 2x2 plan ({:.3e} s/step estimated), losses {got:?} = single device",
            plan.estimate.step_seconds
        );
    }
    Ok(())
}
