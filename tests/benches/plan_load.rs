//! Loading a plan: `Plan::from_json` (parse and validate) and `Program::new` (the runtime's
//! compilation) of GPT-2 small's plan on a 2x4 mesh, the work `autopar run` does before its
//! first step. Prints the median of several runs of each.
//!
//! `cargo bench -p tests --bench plan_load`; `AUTOPAR_BENCH_PLAN=FILE` times that plan instead
//! (the first run writes the GPT-2 small plan to `target/tmp/plan_load/gpt2-small-2x4.json`).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use ir::autodiff::{LossSpec, Optimizer, TrainOptions, training_graph};
use sharding::{DeviceMesh, DeviceProfile};

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn plan_file() -> PathBuf {
    if let Some(p) = std::env::var_os("AUTOPAR_BENCH_PLAN") {
        return PathBuf::from(p);
    }
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("plan_load");
    let path = dir.join("gpt2-small-2x4.json");
    if path.exists() {
        return path;
    }
    std::fs::create_dir_all(&dir).unwrap();
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/models/gpt2-small-graph-only.onnx");
    let g = tracer::import_file(&model, &tracer::ImportOptions { load_weights: false, ..Default::default() }).unwrap();
    let loss: LossSpec = "ce-next:logits:input_ids".parse().unwrap();
    let t = training_graph(&g, &TrainOptions::new(loss, Some(Optimizer::adamw(1e-4)))).unwrap();
    let mesh = DeviceMesh::uniform(&[2, 4]).unwrap();
    let cpu = DeviceProfile::builtin("cpu").unwrap();
    let opts = codegen::PlanOptions { budget: 64 << 30, ..Default::default() };
    let p = codegen::plan(&t.graph, &mesh, &cpu, &opts).unwrap();
    std::fs::write(&path, p.to_json().unwrap()).unwrap();
    path
}

fn main() {
    let path = plan_file();
    let text = std::fs::read_to_string(&path).unwrap();
    let (mut load, mut compile, mut valid, mut from_valid) = (vec![], vec![], vec![], vec![]);
    let mut instrs = 0;
    for _ in 0..7 {
        // As a library user without the loader's result would: load, then compile (which
        // validates the plan it is given).
        let t = Instant::now();
        let plan = codegen::Plan::from_json(&text).unwrap();
        load.push(t.elapsed());
        let t = Instant::now();
        let prog = runtime::program::Program::new(&plan).unwrap();
        compile.push(t.elapsed());
        instrs = plan.program.len();
        std::hint::black_box(prog);
        // As `autopar run` does: one validation, whose parsed graph the compiler takes.
        let t = Instant::now();
        let v = plan::Valid::from_json(&text).unwrap();
        valid.push(t.elapsed());
        let t = Instant::now();
        let prog = runtime::program::Program::from_valid(&v, ir::DType::F32).unwrap();
        from_valid.push(t.elapsed());
        std::hint::black_box(prog);
    }
    let ms = |v: Vec<Duration>| median(v).as_secs_f64() * 1e3;
    let (l, c, v, f) = (ms(load), ms(compile), ms(valid), ms(from_valid));
    println!(
        "plan_load {}: {} instructions, {:.1} MB (median of 7)\n  Plan::from_json {l:.1} ms + Program::new {c:.1} ms = {:.1} ms\n  Valid::from_json {v:.1} ms + Program::from_valid {f:.1} ms = {:.1} ms",
        path.file_name().unwrap().to_string_lossy(),
        instrs,
        text.len() as f64 / 1e6,
        l + c,
        v + f
    );
}
