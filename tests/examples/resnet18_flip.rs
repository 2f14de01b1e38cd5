//! Shows why resnet18's parameters after steps 2-3 differ between single-device training and
//! some distributed plans by ~1.7e-4 (tests/tests/dist.rs, issue 7): one ReLU input within
//! rounding of zero.
//!
//! ```text
//! cargo run -p tests --example resnet18_flip            # the 1x2 dp plan; MESH=2x2 PLAN=auto ...
//! ```
//!
//! Trains resnet18 (SGD lr 1e-4, momentum 0.9, f64 accumulation in products, as the test does)
//! for one and two steps single-device and with a plan on the threads back end, then evaluates
//! the next step's training graph from both parameter sets node by node and prints: how many
//! parameter elements differ, every ReLU whose input changes sign, the smallest ReLU inputs of the
//! single-device run, and the first values that differ by more than 1e-5 (relative, norm-wise).
//! On the 1x2 dp plan step 2 has exactly one flip: `/layer1/layer1.1/relu_1/Relu` (after the
//! residual add) at element 5832, 3.4e-9 single-device against -4.1e-8 distributed, which moves
//! the gradients upstream of it by ~4e-3.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use codegen::{Baseline, PlanOptions};
use ir::Tensor;
use ir::autodiff::{LossSpec, Optimizer, TrainOptions, training_graph};
use runtime::launch::RunOptions;
use runtime::program::Program;
use runtime::train::Trainer;
use runtime::{Accumulation, Cpu};
use sharding::{DeviceMesh, DeviceProfile};

fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("data")
}

fn main() -> Result<()> {
    let path = data().join("models/resnet18.onnx");
    let mut g = tracer::import_file(&path, &tracer::ImportOptions::default())?;
    ir::passes::canonicalize(&mut g)?;
    let mut feeds = BTreeMap::new();
    for (name, file) in [("input", "models/resnet18.input.npy"), ("labels", "refgrad/resnet18/resnet18.labels.npy")] {
        feeds.insert(name.to_string(), runtime::npy::read_npy(&data().join(file))?);
    }
    let loss: LossSpec = "ce:logits:labels".parse().map_err(anyhow::Error::msg)?;
    let optimizer = Optimizer::Sgd { lr: 1e-4, momentum: 0.9, weight_decay: 0.0 };
    let tg = training_graph(&g, &TrainOptions::new(loss, Some(optimizer)))?;
    let acc = Accumulation::F64;
    let ctx = Cpu::new(1)?.with_accumulation(acc);
    let mut trainer = Trainer::new(&tg, &g.param_data)?;
    let mut p_ref = vec![];
    for _ in 0..2 {
        trainer.step(&ctx, &feeds)?;
        p_ref.push(trainer.params());
    }
    let shape: Vec<usize> = std::env::var("MESH")
        .unwrap_or_else(|_| "1x2".into())
        .split('x')
        .map(|x| x.parse().context("MESH: e.g. 2x2"))
        .collect::<Result<_>>()?;
    let mesh = DeviceMesh::uniform(&shape)?;
    let baseline = match std::env::var("PLAN").as_deref() {
        Ok("auto") => Baseline::Auto,
        Ok("megatron") => Baseline::Megatron,
        Ok("zero") => Baseline::Zero,
        _ => Baseline::Dp,
    };
    let cpu = DeviceProfile::builtin("cpu").context("cpu")?;
    let opts = PlanOptions {
        budget: 16 << 30,
        baseline,
        time_limit: Duration::from_secs(1),
        threads: 1,
        compare_baselines: false,
        ..PlanOptions::default()
    };
    let plan = codegen::plan(&tg.graph, &mesh, &cpu, &opts)?;
    let program = Program::new(&plan)?;
    let index = tracer::InitializerIndex::open(&path)?;
    let mut p_dist = vec![];
    for steps in 1..=2u64 {
        let states =
            (0..program.ranks()).map(|k| program.init_rank(k, &index, &feeds)).collect::<Result<Vec<_>, _>>()?;
        let ropts = RunOptions {
            until_step: steps,
            accumulation: acc,
            timeout: Duration::from_secs(120),
            ..RunOptions::default()
        };
        let states = runtime::launch::run_threads(&program, states, &ropts, &mut |_| {})?;
        p_dist.push(program.assemble_params(&states)?);
    }
    let gr = &tg.graph;
    let order = gr.topo_order().unwrap();
    let eval = |params: &BTreeMap<String, Tensor>| -> BTreeMap<ir::Value, Tensor> {
        let mut vals: BTreeMap<ir::Value, Tensor> = BTreeMap::new();
        for &n in &order {
            let node = gr.node(n);
            let outs = match &node.op {
                ir::Op::Input { name } => vec![feeds[name].clone()],
                ir::Op::Param { name } => vec![params[name].clone()],
                ir::Op::State { .. } => vec![Tensor::zeros(&node.outputs[0]).unwrap()],
                ir::Op::Constant(t) => vec![t.clone()],
                op => {
                    let ins: Vec<&Tensor> = gr.node_inputs(n).iter().map(|v| &vals[v]).collect();
                    kernels::cpu::eval(ctx.context(), op, &ins).unwrap()
                }
            };
            for (s, t) in outs.into_iter().enumerate() {
                vals.insert(ir::Value::new(n, s), t);
            }
        }
        vals
    };
    for step in 0..2 {
        let mut ndiff = 0;
        for (k, v) in &p_ref[step] {
            ndiff += v.to_f32_vec().iter().zip(&p_dist[step][k].to_f32_vec()).filter(|(x, y)| x != y).count();
        }
        println!(
            "== forward of step {} from params after step {}: {ndiff} parameter elements differ",
            step + 2,
            step + 1
        );
        let va = eval(&p_ref[step]);
        let vb = eval(&p_dist[step]);
        let mut near: Vec<(f32, String, usize)> = vec![];
        for &n in &order {
            let node = gr.node(n);
            let name = node.op.name();
            if name != "relu" && name != "maxpool" {
                continue;
            }
            let ins = gr.node_inputs(n);
            let (xa, xb) = (va[&ins[0]].to_f32_vec(), vb[&ins[0]].to_f32_vec());
            if name == "relu" {
                for (i, (x, y)) in xa.iter().zip(&xb).enumerate() {
                    if (*x > 0.0) != (*y > 0.0) {
                        println!("RELU FLIP {} [{}] at {i}: ref {x:e} dist {y:e}", node.name, name);
                    }
                    if x.abs() < 1e-6 {
                        near.push((x.abs(), node.name.clone(), i));
                    }
                }
            } else {
                let (ya, yb) = (va[&ir::Value::new(n, 0)].to_f32_vec(), vb[&ir::Value::new(n, 0)].to_f32_vec());
                let d = ya.iter().zip(&yb).filter(|(a, b)| a != b).count();
                println!("maxpool {}: {d} outputs differ", node.name);
            }
        }
        near.sort_by(|a, b| a.0.total_cmp(&b.0));
        println!("smallest |relu input| (ref): {:?}", &near[..near.len().min(5)]);
        // First node whose outputs differ by more than 1e-5 relative.
        let mut shown = 0;
        for &n in &order {
            let node = gr.node(n);
            for s in 0..node.outputs.len() {
                let v = ir::Value::new(n, s);
                if va[&v].dtype() != ir::DType::F32 {
                    continue;
                }
                let (a, b) = (va[&v].to_f32_vec(), vb[&v].to_f32_vec());
                let nd: f64 = a.iter().zip(&b).map(|(x, y)| ((x - y) as f64).powi(2)).sum::<f64>().sqrt();
                let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
                if nd / na.max(1e-30) > 1e-5 && shown < 6 {
                    shown += 1;
                    println!("  {} [{}] rel {:.2e}", node.name, node.op.name(), nd / na.max(1e-30));
                }
            }
        }
    }
    Ok(())
}
