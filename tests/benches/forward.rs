//! Forward-pass time of bundled models: autopar's interpreter vs tract, 1 and 2 threads, in one
//! run on the same machine. Prints a markdown table (median of N runs after a warm-up).
//!
//! `cargo bench -p tests --bench forward` (add `-- --runs 20` to change the run count).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use tract_onnx::prelude::*;
use tract_onnx::tract_core::tract_linalg::multithread::{Executor, multithread_tract_scope};

fn data(p: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("data/models").join(p)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn to_tract(t: &ir::Tensor) -> Tensor {
    match t.data() {
        ir::Data::F32(v) => tract_ndarray::ArrayD::from_shape_vec(t.shape(), v.clone()).expect("shape").into_tensor(),
        ir::Data::F64(v) => tract_ndarray::ArrayD::from_shape_vec(t.shape(), v.clone()).expect("shape").into_tensor(),
        ir::Data::BF16(_) | ir::Data::F16(_) => {
            tract_ndarray::ArrayD::from_shape_vec(t.shape(), t.to_f32_vec()).expect("shape").into_tensor()
        }
        ir::Data::I64(v) => tract_ndarray::ArrayD::from_shape_vec(t.shape(), v.clone()).expect("shape").into_tensor(),
        ir::Data::Bool(v) => tract_ndarray::ArrayD::from_shape_vec(t.shape(), v.clone()).expect("shape").into_tensor(),
    }
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let runs: usize = args
        .iter()
        .position(|a| a == "--runs")
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    let models: [(&str, &[(&str, &str)]); 2] =
        [("resnet18", &[("input", "resnet18.input.npy")]), ("gpt2-tiny", &[("input_ids", "gpt2-tiny.input_ids.npy")])];
    println!("| model | threads | autopar (ms) | tract (ms) | autopar / tract |");
    println!("|---|---|---|---|---|");
    for (model, feeds) in models {
        let path = data(&format!("{model}.onnx"));
        let mut g = tracer::import_file(&path, &tracer::ImportOptions::default())?;
        ir::passes::canonicalize(&mut g)?;
        let mut f = BTreeMap::new();
        let mut tv = TVec::new();
        for (name, file) in feeds {
            let t = runtime::npy::read_npy(&data(file))?;
            tv.push(to_tract(&t).into_tvalue());
            f.insert(name.to_string(), t);
        }
        let mut tm =
            tract_onnx::onnx().with_ignore_value_info(true).with_ignore_output_shapes(true).model_for_path(&path)?;
        for (i, t) in tv.iter().enumerate() {
            tm = tm.with_input_fact(i, InferenceFact::dt_shape(t.datum_type(), t.shape()))?;
        }
        let plan = tm.into_optimized()?.into_runnable()?;
        for threads in [1usize, 2] {
            let ctx = runtime::Cpu::new(threads)?;
            let interp = runtime::Interpreter::new(&g)?;
            interp.run(&ctx, &f)?;
            let ours = median(
                (0..runs)
                    .map(|_| {
                        let t0 = Instant::now();
                        interp.run(&ctx, &f).expect("run");
                        t0.elapsed().as_secs_f64() * 1e3
                    })
                    .collect(),
            );
            let exec = if threads == 1 { Executor::SingleThread } else { Executor::multithread(threads) };
            let theirs = multithread_tract_scope(exec, || -> anyhow::Result<f64> {
                plan.run(tv.clone())?;
                let mut v = Vec::new();
                for _ in 0..runs {
                    let t0 = Instant::now();
                    plan.run(tv.clone())?;
                    v.push(t0.elapsed().as_secs_f64() * 1e3);
                }
                Ok(median(v))
            })?;
            println!("| {model} | {threads} | {ours:.2} | {theirs:.2} | {:.2} |", ours / theirs);
        }
    }
    Ok(())
}
