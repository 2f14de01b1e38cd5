//! Canonicalisation keeps what a model computes: every bundled model gives the same outputs
//! before and after `ir::passes::canonicalize` (tolerance: 1e-6 relative to the output's max,
//! since rewrites only remove no-op views and neutral arithmetic), and the result verifies.

use std::collections::BTreeMap;
use std::path::Path;

fn data(p: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("data/models").join(p)
}

fn check(model: &str, feeds: &[(&str, &str)]) {
    let path = data(&format!("{model}.onnx"));
    if !path.exists() {
        panic!("missing test model {}", path.display());
    }
    let g0 = tracer::import_file(&path, &tracer::ImportOptions::default()).expect("import");
    let mut g1 = g0.clone();
    let stats = ir::passes::canonicalize(&mut g1).expect("canonicalize");
    ir::verify(&g1).expect("canonical graph verifies");
    let mut f = BTreeMap::new();
    for (name, file) in feeds {
        f.insert(name.to_string(), runtime::npy::read_npy(&data(file)).expect("npy"));
    }
    let ctx = runtime::Cpu::new(1).expect("cpu");
    let a = runtime::Interpreter::new(&g0).unwrap().run(&ctx, &f).expect("run original");
    let b = runtime::Interpreter::new(&g1).unwrap().run(&ctx, &f).expect("run canonical");
    println!("{model}: {} -> {} nodes ({stats:?})", g0.node_count(), g1.node_count());
    for (name, ta) in &a.outputs {
        let tb = &b.outputs[name];
        assert_eq!(ta.meta(), tb.meta(), "{model}/{name}");
        let (x, y) = (ta.as_f32().unwrap(), tb.as_f32().unwrap());
        let scale = x.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
        let err = x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs())) / scale;
        assert!(err <= 1e-6, "{model}/{name}: relative error {err}");
    }
}

#[test]
fn canonicalize_keeps_model_outputs() {
    check("mlp", &[("x", "mlp.x.npy")]);
    check("gpt2-tiny", &[("input_ids", "gpt2-tiny.input_ids.npy")]);
    check("bert-tiny", &[("input_ids", "bert-tiny.input_ids.npy"), ("attention_mask", "bert-tiny.attention_mask.npy")]);
}
