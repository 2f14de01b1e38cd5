//! Whole-model checks on the bundled models in `tests/data/models` (see its `NOTICE.md`).
//!
//! Equivalence: gpt2-tiny, bert-tiny, mlp and resnet18 are imported, run on autopar's
//! [`runtime::Interpreter`] with the bundled `.npy` inputs, and every graph output is compared with
//! the output PyTorch computed (`<model>.<output>.npy`). The same models run on tract, our
//! reference executor, and our outputs must agree with tract's too. Tolerance: the max relative
//! error `max|a - b| / max|b|` (over the whole tensor) is at most [`MAX_REL_ERR`] = 1e-4.
//!
//! Inspection: `gpt2-small-graph-only.onnx` (no weights shipped) imports with shapes only and has
//! ~163M parameters; the two topology-only CNNs from the ONNX test data import.
//!
//! Bad models: the files in `tests/data/bad` are exactly what `examples/make_bad_models.rs`
//! builds, and each is rejected at import with the error it was made for.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};
use ir::{Data, Op};
use runtime::Cpu;
use tracer::{ImportError, ImportOptions};
use tract_onnx::prelude::{DatumExt, Framework, InferenceModelExt, IntoRunnable, TValue, TVec, tvec};

#[allow(dead_code)] // Only `models()` is used here; `main` writes the files.
#[path = "../examples/make_bad_models.rs"]
mod make_bad_models;

/// Largest allowed `max|a - b| / max|b|` between an output and its reference.
const MAX_REL_ERR: f32 = 1e-4;

fn models_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("data/models")
}

/// An output: its shape and values (every bundled model's outputs are f32).
struct Output {
    shape: Vec<usize>,
    values: Vec<f32>,
}

/// `max|a - b| / max|b|`; infinite when a value is not finite or the shapes differ.
fn max_rel_err(got: &Output, want: &Output) -> f32 {
    if got.shape != want.shape || got.values.iter().chain(&want.values).any(|x| !x.is_finite()) {
        return f32::INFINITY;
    }
    let max_diff = got.values.iter().zip(&want.values).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    let max_ref = want.values.iter().map(|b| b.abs()).fold(0.0, f32::max);
    max_diff / max_ref
}

fn check_close(what: &str, got: &Output, want: &Output) -> Result<()> {
    ensure!(got.shape == want.shape, "{what}: shape {:?}, expected {:?}", got.shape, want.shape);
    let err = max_rel_err(got, want);
    ensure!(err <= MAX_REL_ERR, "{what}: max relative error {err:e} > {MAX_REL_ERR:e}");
    Ok(())
}

fn read_npy(path: &Path) -> Result<ir::Tensor> {
    runtime::npy::read_npy(path).with_context(|| format!("reading {}", path.display()))
}

fn f32_output(t: &ir::Tensor, what: &str) -> Result<Output> {
    let Some(v) = t.as_f32() else { bail!("{what} is {}, expected f32", t.meta()) };
    Ok(Output { shape: t.shape().to_vec(), values: v.to_vec() })
}

/// Runs `model` on autopar's interpreter; outputs by name.
fn run_autopar(model: &Path, feeds: &BTreeMap<String, ir::Tensor>) -> Result<BTreeMap<String, Output>> {
    let g = tracer::import_file(model, &ImportOptions::default())
        .with_context(|| format!("importing {}", model.display()))?;
    let ctx = Cpu::new(2)?;
    let report = runtime::Interpreter::new(&g)?.run(&ctx, feeds).context("running on autopar's interpreter")?;
    report.outputs.iter().map(|(name, t)| Ok((name.clone(), f32_output(t, name)?))).collect()
}

/// Runs `model` on tract (see ../shared/docs/DEPENDENCIES.md); outputs by name.
fn run_tract(model: &Path, feeds: &BTreeMap<String, ir::Tensor>) -> Result<BTreeMap<String, Output>> {
    let onnx = tract_onnx::onnx();
    // tract numbers the graph inputs that are not initializers and keeps the outputs' order.
    let proto = onnx.proto_model_for_path(model)?;
    let graph = proto.graph.as_ref().context("the model has no graph")?;
    let inits: HashSet<&str> = graph.initializer.iter().map(|t| t.name.as_str()).collect();
    let inputs: Vec<&str> = graph.input.iter().map(|i| i.name.as_str()).filter(|n| !inits.contains(n)).collect();
    let outputs: Vec<&str> = graph.output.iter().map(|o| o.name.as_str()).collect();

    let mut m = onnx.with_ignore_value_info(true).with_ignore_output_shapes(true).model_for_path(model)?;
    let mut values: TVec<TValue> = tvec!();
    for (i, name) in inputs.iter().enumerate() {
        let t = feeds.get(*name).with_context(|| format!("no feed for input {name}"))?;
        let (fact, value) = match t.data() {
            Data::F32(v) => (f32::fact(t.shape()), tract_onnx::prelude::Tensor::from_shape(t.shape(), v)?),
            Data::F64(v) => (f64::fact(t.shape()), tract_onnx::prelude::Tensor::from_shape(t.shape(), v)?),
            Data::BF16(_) | Data::F16(_) => {
                (f32::fact(t.shape()), tract_onnx::prelude::Tensor::from_shape(t.shape(), &t.to_f32_vec())?)
            }
            Data::I64(v) => (i64::fact(t.shape()), tract_onnx::prelude::Tensor::from_shape(t.shape(), v)?),
            Data::Bool(v) => (bool::fact(t.shape()), tract_onnx::prelude::Tensor::from_shape(t.shape(), v)?),
        };
        m = m.with_input_fact(i, fact.into())?;
        values.push(value.into());
    }
    let results = m.into_optimized()?.into_runnable()?.run(values)?;
    ensure!(
        results.len() == outputs.len(),
        "tract returned {} outputs, the model declares {}",
        results.len(),
        outputs.len()
    );
    outputs
        .iter()
        .zip(results.iter())
        .map(|(name, r)| {
            let view = r.to_plain_array_view::<f32>()?;
            Ok((name.to_string(), Output { shape: view.shape().to_vec(), values: view.iter().copied().collect() }))
        })
        .collect()
}

/// Runs `model` with the bundled inputs on autopar and on tract, and checks every output against
/// PyTorch's and autopar's against tract's.
fn check_model(model: &str, inputs: &[&str], outputs: &[&str]) -> Result<()> {
    let dir = models_dir();
    let path = dir.join(format!("{model}.onnx"));
    let feeds: BTreeMap<String, ir::Tensor> = inputs
        .iter()
        .map(|i| Ok((i.to_string(), read_npy(&dir.join(format!("{model}.{i}.npy")))?)))
        .collect::<Result<_>>()?;

    let ours = run_autopar(&path, &feeds)?;
    let names: Vec<&str> = ours.keys().map(String::as_str).collect();
    let mut expected = outputs.to_vec();
    expected.sort_unstable();
    ensure!(names == expected, "{model}: graph outputs {names:?}, expected {expected:?}");
    for out in outputs {
        let want = f32_output(&read_npy(&dir.join(format!("{model}.{out}.npy")))?, out)?;
        check_close(&format!("{model}: {out} (autopar vs PyTorch)"), &ours[*out], &want)?;
    }

    let tract = run_tract(&path, &feeds).with_context(|| format!("{model}: running on tract"))?;
    for out in outputs {
        let reference = tract.get(*out).with_context(|| format!("{model}: tract has no output {out}"))?;
        check_close(&format!("{model}: {out} (autopar vs tract)"), &ours[*out], reference)?;
    }
    Ok(())
}

#[test]
fn mlp_matches_pytorch_and_tract() -> Result<()> {
    check_model("mlp", &["x"], &["y"])
}

#[test]
fn gpt2_tiny_matches_pytorch_and_tract() -> Result<()> {
    check_model("gpt2-tiny", &["input_ids"], &["logits"])
}

#[test]
fn bert_tiny_matches_pytorch_and_tract() -> Result<()> {
    check_model("bert-tiny", &["input_ids", "attention_mask"], &["last_hidden_state", "pooler_output"])
}

#[test]
fn resnet18_matches_pytorch_and_tract() -> Result<()> {
    check_model("resnet18", &["input"], &["logits"])
}

#[test]
fn tolerance_is_relative_to_the_reference() {
    let want = Output { shape: vec![3], values: vec![100.0, -200.0, 0.5] };
    let close = Output { shape: vec![3], values: vec![100.01, -200.0, 0.5] };
    let far = Output { shape: vec![3], values: vec![100.0, -200.0, 0.6] };
    assert!(max_rel_err(&close, &want) <= MAX_REL_ERR);
    assert!(max_rel_err(&far, &want) > MAX_REL_ERR);
    let nan = Output { shape: vec![3], values: vec![f32::NAN, -200.0, 0.5] };
    assert_eq!(max_rel_err(&nan, &want), f32::INFINITY);
    let reshaped = Output { shape: vec![1, 3], values: want.values.clone() };
    assert_eq!(max_rel_err(&reshaped, &want), f32::INFINITY);
}

/// Imports `path` with shapes only, as `autopar inspect` does.
fn import_shapes_only(path: &Path) -> Result<ir::Graph> {
    let opts = ImportOptions { load_weights: false, ..Default::default() };
    Ok(tracer::import_file(path, &opts)?)
}

fn io_metas(g: &ir::Graph) -> (Vec<String>, Vec<String>) {
    let inputs = g
        .inputs
        .iter()
        .map(|&i| match &g.node(i).op {
            Op::Input { name } => format!("{name}: {}", g.node(i).outputs[0]),
            other => format!("non-input {}", other.name()),
        })
        .collect();
    let outputs = g.outputs.iter().map(|(n, v)| format!("{n}: {}", g.meta(*v))).collect();
    (inputs, outputs)
}

#[test]
fn gpt2_small_graph_only_imports_without_weights() -> Result<()> {
    let g = import_shapes_only(&models_dir().join("gpt2-small-graph-only.onnx"))?;
    let (params, bytes) = g.param_stats();
    assert!((162_000_000..=164_000_000).contains(&params), "{params} parameters, expected 163M ± 1M");
    assert_eq!(bytes, params * 4, "parameters are f32");
    assert!(g.param_data.is_empty(), "no weights are read");
    assert_eq!(io_metas(&g), (vec!["input_ids: i64[1,128]".to_string()], vec!["logits: f32[1,128,50257]".to_string()]));
    Ok(())
}

#[test]
fn light_cnns_import() -> Result<()> {
    // (file, parameters: the architectures' known counts, running BatchNorm statistics included)
    for (file, expected_params, input, output) in [
        ("light/light_resnet50.onnx", 25_610_152, "gpu_0/data_0: f32[1,3,224,224]", "gpu_0/softmax_1: f32[1,1000]"),
        ("light/light_vgg19.onnx", 143_667_240, "data_0: f32[1,3,224,224]", "prob_1: f32[1,1000]"),
    ] {
        let g = import_shapes_only(&models_dir().join(file)).with_context(|| format!("importing {file}"))?;
        assert_eq!(g.param_stats().0, expected_params, "{file}: parameter count");
        assert_eq!(io_metas(&g), (vec![input.to_string()], vec![output.to_string()]), "{file}");
    }
    Ok(())
}

#[test]
fn bad_models_are_reproducible() -> Result<()> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/bad");
    for (file, _, bytes) in make_bad_models::models() {
        let committed = std::fs::read(dir.join(file)).with_context(|| format!("reading tests/data/bad/{file}"))?;
        assert!(
            committed == bytes,
            "tests/data/bad/{file} differs from what examples/make_bad_models.rs builds; run `cargo run -p tests --example make_bad_models`"
        );
    }
    Ok(())
}

#[test]
fn bad_models_are_rejected_with_the_right_error() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/bad");
    let import = |file: &str| tracer::import_file(&dir.join(file), &ImportOptions::default());
    match import("unsupported_op.onnx") {
        Err(ImportError::DataDependent { node, op_type, .. }) => {
            assert_eq!((node.as_str(), op_type.as_str()), ("nonzero_0", "NonZero"))
        }
        other => panic!("unsupported_op.onnx: {:?}", other.map(|_| "imported")),
    }
    match import("dynamic_dim.onnx") {
        Err(ImportError::UnboundDim { input, dim, dim_name, .. }) => {
            assert_eq!((input.as_str(), dim, dim_name.as_str()), ("x", 0, "batch"))
        }
        other => panic!("dynamic_dim.onnx: {:?}", other.map(|_| "imported")),
    }
    match import("shape_mismatch.onnx") {
        Err(ImportError::Node { node, op_type, .. }) => {
            assert_eq!((node.as_str(), op_type.as_str()), ("matmul_0", "MatMul"))
        }
        other => panic!("shape_mismatch.onnx: {:?}", other.map(|_| "imported")),
    }
    // Bound, the dynamic dim imports.
    let opts = ImportOptions { input_shapes: [("x".to_string(), vec![3, 4])].into(), ..Default::default() };
    let g = tracer::import_file(&dir.join("dynamic_dim.onnx"), &opts).expect("dynamic_dim.onnx with x=3x4");
    assert_eq!(io_metas(&g).1, vec!["y: f32[3,4]".to_string()]);
}

/// Issue 23: a model written back with new initializers (`tracer::export`, what `--export-onnx`
/// writes) imports with exactly those values, and tract runs it to the same outputs as autopar
/// (tolerance as above): the file is a valid ONNX model with the new weights, not only ours to read.
#[test]
fn exported_weights_run_on_tract() -> Result<()> {
    let dir = models_dir();
    let path = dir.join("mlp.onnx");
    let original = tracer::import_file(&path, &ImportOptions::default())?;
    // New values: every weight scaled and shifted, so the outputs change.
    let values: BTreeMap<String, ir::Tensor> = original
        .param_data
        .iter()
        .map(|(name, t)| {
            let v: Vec<f32> = t.to_f32_vec().iter().enumerate().map(|(i, x)| 1.1 * x + 1e-3 * (i % 7) as f32).collect();
            Ok((name.clone(), ir::Tensor::new(t.shape().to_vec(), Data::F32(v))?))
        })
        .collect::<Result<_>>()?;
    let bytes = std::fs::read(&path)?;
    let out = std::env::temp_dir().join(format!("autopar-export-{}", std::process::id()));
    std::fs::create_dir_all(&out)?;
    let exported = out.join("mlp-trained.onnx");
    std::fs::write(&exported, tracer::export::with_initializers(&bytes, "mlp.onnx", &values)?)?;
    let again = tracer::import_file(&exported, &ImportOptions::default())?;
    ensure!(again.param_data == values, "the exported initializers are not the new values");
    let feeds: BTreeMap<String, ir::Tensor> = [("x".to_string(), read_npy(&dir.join("mlp.x.npy"))?)].into();
    let (ours, theirs) = (run_autopar(&exported, &feeds)?, run_tract(&exported, &feeds)?);
    std::fs::remove_dir_all(&out).ok();
    let before = run_autopar(&path, &feeds)?;
    ensure!(before["y"].values != ours["y"].values, "the new weights changed nothing");
    check_close("mlp with new weights: y (autopar vs tract)", &ours["y"], &theirs["y"])?;
    // A value with no initializer of its name is refused, naming it.
    let mut extra = values.clone();
    extra.insert("no.such.weight".into(), ir::Tensor::new(vec![1], Data::F32(vec![0.0]))?);
    let e = tracer::export::with_initializers(&bytes, "mlp.onnx", &extra).err().context("accepted an unknown name")?;
    ensure!(e.to_string().contains("no.such.weight"), "{e}");
    Ok(())
}

/// `autopar gen gpt` is a causal language model: with seeded weights, the logits at a position
/// do not change when a later token does, and do when an earlier one does (our interpreter, and
/// tract on the same weights written into the file).
#[test]
fn generated_gpts_attend_causally() -> Result<()> {
    use runtime::params::ParamSource;
    let c = tracer::generate::GptConfig { layers: 2, hidden: 32, heads: 4, seq: 8, vocab: 16, batch: 1 };
    let bytes = tracer::generate::gpt(&c).map_err(anyhow::Error::msg)?;
    let g = tracer::import_bytes(&bytes, "gpt.onnx", "gpt", None, &ImportOptions::default())?;
    let seeded = runtime::params::SeededInit { seed: 3 };
    let mut params = BTreeMap::new();
    for &p in &g.params {
        if let Op::Param { name } = &g.node(p).op {
            let meta = g.node(p).outputs[0].clone();
            let zero = vec![0; meta.shape.len()];
            let t = seeded.block(name, &meta, &zero, &meta.shape).map_err(anyhow::Error::msg)?.context("no block")?;
            params.insert(name.clone(), t);
        }
    }
    let file = std::env::temp_dir().join(format!("autopar-causal-gpt-{}.onnx", std::process::id()));
    std::fs::write(&file, tracer::export::with_initializers(&bytes, "gpt.onnx", &params)?)?;
    let ctx = Cpu::new(1)?;
    let interp = runtime::Interpreter::new(&g)?;
    let logits = |ids: Vec<i64>| -> Result<(Vec<f32>, Vec<f32>)> {
        let feeds = BTreeMap::from([("input_ids".to_string(), ir::Tensor::i64(vec![1, 8], ids))]);
        let ours = interp.run_with_params(&ctx, &feeds, &params)?.outputs["logits"].to_f32_vec();
        let theirs = run_tract(&file, &feeds)?["logits"].values.clone();
        Ok((ours, theirs))
    };
    let base = logits(vec![1, 2, 3, 4, 5, 6, 7, 8])?;
    let late = logits(vec![1, 2, 3, 4, 5, 6, 7, 0])?;
    let early = logits(vec![0, 2, 3, 4, 5, 6, 7, 8])?;
    let v = c.vocab;
    for (what, a, b, c2) in [("autopar", &base.0, &late.0, &early.0), ("tract", &base.1, &late.1, &early.1)] {
        // Positions 0..7 see only tokens 0..=p: changing token 7 changes position 7 alone.
        ensure!(a[..7 * v] == b[..7 * v], "{what}: a later token changed earlier logits");
        ensure!(a[7 * v..] != b[7 * v..], "{what}: the last position ignores its own token");
        ensure!(a[7 * v..] != c2[7 * v..], "{what}: the last position ignores the first token");
    }
    std::fs::remove_file(&file).ok();
    Ok(())
}
