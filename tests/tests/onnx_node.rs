//! ONNX backend node tests (onnx 1.22.0) on autopar's importer, interpreter and CPU kernels.
//!
//! Every case folder under `tests/data/onnx-node` (selected by `examples/select_node_cases.rs`)
//! is imported, run on [`runtime::Interpreter`] with `input_N.pb` fed to the N-th
//! non-initializer graph input, and each graph output compared with `output_N.pb`: same dtype
//! and shape, values within `|a - b| <= ATOL + RTOL * |b|` (NaN only where NaN is expected; float16 and
//! bfloat16 outputs at their storage precision, see [`tolerance`]).
//!
//! `manifest.txt` lists every case that is excluded (not run) or known to fail, with its reason.
//! The test fails when a case fails without being listed, when a listed case passes (the
//! manifest must stay honest), when the manifest names a case that is not there, or when fewer
//! than 95% of the run cases pass. A panic inside a case is caught and counted as a failure.
//!
//! `onnx_node_suite_in_f64` runs every case that passes in f32 again with the imported graph made
//! f64 ([`ir::Graph::with_float_type`]: f64 kernels, f32 inputs widened), its float outputs
//! narrowed back and compared with the same tolerances: the check of the f64 kernels that
//! `--precision f64` runs on.
//!
//! `ONNX_NODE_FILTER=substring` runs only the matching cases, and `ONNX_NODE_DIR=DIR` runs the
//! cases of another folder (the whole suite, say) against this manifest; either skips the
//! manifest checks that need exactly the selected cases.

use std::any::Any;
use std::collections::{BTreeMap, BTreeSet};
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{Context, Result, anyhow, bail};
use ir::{DType, Data, Tensor};
use prost::Message;
use runtime::Cpu;
use tract_onnx::pb;

/// Prints a report line to the real stdout, past libtest's capture, so the summary shows in a
/// plain `cargo test` run (the CI harness reads the `N passed, M failed` line).
macro_rules! report {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock(), $($arg)*);
    }};
}

const RTOL: f32 = 1e-4;
const ATOL: f32 = 1e-5;
const MIN_PASS_RATE: f64 = 0.95;

fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("data/onnx-node")
}

/// What the manifest says about a case.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Status {
    /// Copied but not run.
    Exclude,
    /// Run and expected to fail.
    Fail,
    /// Not copied into the repo (listed for the accounting).
    NotCopied,
}

struct Entry {
    status: Status,
    reason: String,
}

fn read_manifest(path: &Path) -> Result<BTreeMap<String, Entry>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, rest) = line.split_once(char::is_whitespace).unwrap_or((line, ""));
        let (status, reason) = rest.trim_start().split_once(char::is_whitespace).unwrap_or((rest.trim_start(), ""));
        let status = match status {
            "exclude" => Status::Exclude,
            "fail" => Status::Fail,
            "not-copied" => Status::NotCopied,
            other => bail!("manifest line {}: unknown status `{other}` (exclude | fail | not-copied)", i + 1),
        };
        let reason = reason.trim().to_string();
        if reason.is_empty() {
            bail!("manifest line {}: {name} has no reason", i + 1);
        }
        if out.insert(name.to_string(), Entry { status, reason }).is_some() {
            bail!("manifest line {}: {name} is listed twice", i + 1);
        }
    }
    Ok(out)
}

fn expected_dtype(code: i32) -> Result<DType> {
    // The type autopar holds this ONNX type in (int32 as i64, float16 as f32, ...: tracer's
    // dtype table), not whatever the reader produced: a result of another type still differs.
    tracer::held_dtype(code).ok_or_else(|| {
        anyhow!("expected output has element type {}, which autopar does not support", tracer::dtype_name(code))
    })
}

/// Reads a `TensorProto` file with the type autopar holds its declared element type in (integers
/// as int64, float16/bfloat16/float64 as float32), from the declaration rather than the data, so
/// the comparison still catches a result of another type.
fn read_pb(path: &Path) -> Result<(DType, Tensor)> {
    read_pb_typed(path).map(|(dtype, t, _)| (dtype, t))
}

/// [`read_pb`], also returning the file's ONNX element type code.
fn read_pb_typed(path: &Path) -> Result<(DType, Tensor, i32)> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let proto = pb::TensorProto::decode(&*bytes).with_context(|| format!("decoding {}", path.display()))?;
    let dtype = expected_dtype(proto.data_type)?;
    let t =
        tracer::tensor_from_proto(&proto, path.parent())?.ok_or_else(|| anyhow!("{} has no data", path.display()))?;
    Ok((dtype, t, proto.data_type))
}

/// `(ATOL, RTOL)` for an expected output stored as ONNX type `code`. autopar computes float16
/// and bfloat16 graphs in f32, so their expected values carry the storage type's rounding (and
/// the reference's half-precision arithmetic): 4 units of roundoff, 4 x 2^-11 for float16 and
/// 4 x 2^-8 for bfloat16, relative, with the absolute floor raised alike. Every other type is
/// compared at the suite's f32 tolerances.
fn tolerance(code: i32) -> (f32, f32) {
    match code {
        10 => (1e-4, 4.0 * 2f32.powi(-11)),
        16 => (1e-3, 4.0 * 2f32.powi(-8)),
        _ => (ATOL, RTOL),
    }
}

fn numbered(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    (0..).map(|i| dir.join(format!("{prefix}_{i}.pb"))).take_while(|p| p.is_file()).collect()
}

/// First difference between `got` and `want`, if any.
fn compare(got: &Tensor, want: &Tensor, want_dtype: DType, (atol, rtol): (f32, f32)) -> Option<String> {
    if got.dtype() != want_dtype {
        return Some(format!("dtype {} instead of {}", got.dtype(), want_dtype));
    }
    if got.shape() != want.shape() {
        return Some(format!("shape {:?} instead of {:?}", got.shape(), want.shape()));
    }
    let at = |i: usize| {
        let mut idx = vec![0; want.shape().len()];
        let mut r = i;
        for (d, &n) in want.shape().iter().enumerate().rev() {
            idx[d] = r % n.max(1);
            r /= n.max(1);
        }
        idx
    };
    match (got.data(), want.data()) {
        (Data::F32(a), Data::F32(b)) => {
            let bad: Vec<usize> = (0..a.len())
                .filter(|&i| {
                    let (x, y) = (a[i], b[i]);
                    if x.is_nan() || y.is_nan() {
                        return x.is_nan() != y.is_nan();
                    }
                    if x.is_infinite() || y.is_infinite() {
                        return x != y;
                    }
                    (x - y).abs() > atol + rtol * y.abs()
                })
                .collect();
            let &i = bad.first()?;
            let worst =
                bad.iter().copied().max_by(|&p, &q| (a[p] - b[p]).abs().total_cmp(&(a[q] - b[q]).abs())).unwrap_or(i);
            Some(format!(
                "{} of {} values differ; first at {:?}: {} instead of {}; worst at {:?}: {} instead of {}",
                bad.len(),
                a.len(),
                at(i),
                a[i],
                b[i],
                at(worst),
                a[worst],
                b[worst]
            ))
        }
        (Data::I64(a), Data::I64(b)) => {
            let n = a.iter().zip(b).filter(|(x, y)| x != y).count();
            let i = a.iter().zip(b).position(|(x, y)| x != y)?;
            Some(format!("{n} of {} values differ; first at {:?}: {} instead of {}", a.len(), at(i), a[i], b[i]))
        }
        (Data::Bool(a), Data::Bool(b)) => {
            let n = a.iter().zip(b).filter(|(x, y)| x != y).count();
            let i = a.iter().zip(b).position(|(x, y)| x != y)?;
            Some(format!("{n} of {} values differ; first at {:?}: {} instead of {}", a.len(), at(i), a[i], b[i]))
        }
        _ => Some(format!("expected data is {} but declared {}", want.dtype(), want_dtype)),
    }
}

fn is_static(vi: &pb::ValueInfoProto) -> bool {
    match vi.r#type.as_ref().and_then(|t| t.value.as_ref()) {
        Some(pb::type_proto::Value::TensorType(tt)) => tt.shape.as_ref().is_some_and(|s| {
            s.dim
                .iter()
                .all(|d| matches!(d.value, Some(pb::tensor_shape_proto::dimension::Value::DimValue(v)) if v > 0))
        }),
        None => false,
    }
}

/// Operand slots ONNX lets be runtime tensors but autopar needs as constants, because they
/// decide output shapes (autopar's graphs have static shapes) or are read into op attributes.
fn static_slots(op_type: &str) -> &'static [usize] {
    match op_type {
        "Reshape" | "Expand" | "Split" | "Squeeze" | "Unsqueeze" => &[1],
        "ReduceSum" | "ReduceMean" | "ReduceMax" | "ReduceMin" | "ReduceProd" | "ReduceSumSquare" | "ReduceL1"
        | "ReduceL2" | "ReduceLogSum" | "ReduceLogSumExp" => &[1],
        "Slice" => &[1, 2, 3, 4],
        "Pad" => &[1, 2, 3],
        "Dropout" => &[1, 2],
        "ConstantOfShape" => &[0],
        "Range" => &[0, 1, 2],
        "Resize" => &[1, 2, 3],
        "Upsample" => &[1],
        "CumSum" | "TopK" | "Tile" | "OneHot" | "Trilu" => &[1],
        // sequence_lens: the unrolled steps are masked by the lengths known at import.
        "LSTM" | "GRU" | "RNN" => &[4],
        _ => &[],
    }
}

/// Graph inputs whose values flow into a [`static_slots`] operand (directly or through other
/// nodes; `Shape` and `Size` read only their input's shape, so the walk stops there). The test
/// binds them to their test values as `Constant` nodes, as a user folds such inputs before
/// planning, instead of feeding them.
fn static_operand_inputs(g: &pb::GraphProto) -> BTreeSet<&str> {
    let producer: BTreeMap<&str, &pb::NodeProto> =
        g.node.iter().flat_map(|n| n.output.iter().map(move |o| (o.as_str(), n))).collect();
    let mut todo: Vec<&str> = g
        .node
        .iter()
        .flat_map(|n| static_slots(&n.op_type).iter().filter_map(|&s| n.input.get(s)))
        .map(|s| s.as_str())
        .collect();
    let (mut seen, mut bound) = (BTreeSet::new(), BTreeSet::new());
    while let Some(v) = todo.pop() {
        if v.is_empty() || !seen.insert(v) {
            continue;
        }
        if g.input.iter().any(|i| i.name == v) {
            bound.insert(v);
        }
        if let Some(n) = producer.get(v).filter(|n| !matches!(n.op_type.as_str(), "Shape" | "Size")) {
            todo.extend(n.input.iter().map(|s| s.as_str()));
        }
    }
    bound
}

/// Runs one case; `Err` carries the reason it failed. `Ok(true)`: it passed with some inputs
/// bound as constants.
fn run_case(dir: &Path, ctx: &Cpu, float: DType) -> Result<bool> {
    let model_path = dir.join("model.onnx");
    let bytes = std::fs::read(&model_path).with_context(|| format!("reading {}", model_path.display()))?;
    let model = pb::ModelProto::decode(&*bytes).context("decoding model.onnx")?;
    let g = model.graph.as_ref().ok_or_else(|| anyhow!("model.onnx has no graph"))?;
    let inits: BTreeSet<&str> = g.initializer.iter().map(|t| t.name.as_str()).collect();
    let inputs: Vec<&pb::ValueInfoProto> = g.input.iter().filter(|i| !inits.contains(i.name.as_str())).collect();

    let data = dir.join("test_data_set_0");
    let input_files = numbered(&data, "input");
    let output_files = numbered(&data, "output");
    if input_files.len() != inputs.len() {
        bail!("{} input files for {} graph inputs", input_files.len(), inputs.len());
    }
    if output_files.len() != g.output.len() {
        bail!("{} output files for {} graph outputs", output_files.len(), g.output.len());
    }

    let static_inputs = static_operand_inputs(g);
    let mut feeds = BTreeMap::new();
    let mut constants = Vec::new();
    let mut opts = tracer::ImportOptions { load_weights: true, ..Default::default() };
    for (vi, file) in inputs.iter().zip(&input_files) {
        if static_inputs.contains(vi.name.as_str()) {
            let bytes = std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
            let mut t = pb::TensorProto::decode(&*bytes).with_context(|| format!("decoding {}", file.display()))?;
            t.name = vi.name.clone();
            constants.push(t);
            continue;
        }
        let (_, t) = read_pb(file).with_context(|| format!("input {}", vi.name))?;
        if !is_static(vi) {
            opts.input_shapes.insert(vi.name.clone(), t.shape().to_vec());
        }
        feeds.insert(vi.name.clone(), t);
    }

    let bound = !constants.is_empty();
    let graph = if constants.is_empty() {
        tracer::import_file(&model_path, &opts).context("import")?
    } else {
        let mut model = model.clone();
        let g = model.graph.as_mut().expect("checked above");
        g.input.retain(|i| !constants.iter().any(|c| c.name == i.name));
        let nodes = constants.into_iter().map(|t| pb::NodeProto {
            op_type: "Constant".into(),
            output: vec![t.name.clone()],
            name: format!("{}.bound", t.name),
            attribute: vec![pb::AttributeProto {
                name: "value".into(),
                r#type: pb::attribute_proto::AttributeType::Tensor as i32,
                t: Some(t),
                ..Default::default()
            }],
            ..Default::default()
        });
        g.node.splice(0..0, nodes);
        let name = dir.file_name().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
        tracer::import_bytes(&model.encode_to_vec(), &model_path.display().to_string(), &name, Some(dir), &opts)
            .context("import")?
    };
    let graph =
        if float == DType::F32 { graph } else { graph.with_float_type(float).context("making the graph f64")? };
    let interp = runtime::Interpreter::new(&graph).context("schedule")?;
    let report = interp.run(ctx, &feeds).context("run")?;

    let mut problems = Vec::new();
    for (o, file) in g.output.iter().zip(&output_files) {
        let (dtype, want, code) = read_pb_typed(file).with_context(|| format!("expected output {}", o.name))?;
        match report.outputs.get(&o.name) {
            None => problems.push(format!("output {} was not produced", o.name)),
            Some(got) => {
                let got = if got.dtype() == float && dtype == DType::F32 {
                    got.clone().with_float_type(dtype)
                } else {
                    got.clone()
                };
                if let Some(p) = compare(&got, &want, dtype, tolerance(code)) {
                    problems.push(format!("output {}: {p}", o.name));
                }
            }
        }
    }
    if problems.is_empty() { Ok(bound) } else { Err(anyhow!(problems.join("; "))) }
}

/// The message and location of the last panic on this test's threads (the hook records it).
static LAST_PANIC: Mutex<Option<String>> = Mutex::new(None);

fn payload_text(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".into())
}

/// The panic's message with its location, as the hook recorded it.
fn panic_message(payload: &(dyn Any + Send)) -> String {
    let recorded = LAST_PANIC.lock().ok().and_then(|mut l| l.take());
    recorded.unwrap_or_else(|| payload_text(payload))
}

#[test]
fn onnx_node_suite() -> Result<()> {
    suite(DType::F32)
}

#[test]
fn onnx_node_suite_in_f64() -> Result<()> {
    suite(DType::F64)
}

/// The onnxruntime references of `tests/data/recurrent` (made by `scripts/recurrent-refs.py`,
/// which checks each against its own numpy implementation of the ONNX definitions): LSTM, GRU and
/// RNN over the attributes the node suite leaves out (reverse and bidirectional runs, layout 1,
/// clip, custom activations, input_forget, per-batch sequence_lens). Every case must pass, in f32
/// and in f64, with the suite's tolerances.
#[test]
fn recurrent_onnxruntime_references() -> Result<()> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/recurrent");
    let mut cases: Vec<PathBuf> = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.join("model.onnx").is_file())
        .collect();
    cases.sort();
    if cases.len() < 10 {
        bail!("{} recurrent cases in {}, expected at least 10", cases.len(), dir.display());
    }
    let ctx = Cpu::new(1)?;
    let mut problems = Vec::new();
    for case in &cases {
        for float in [DType::F32, DType::F64] {
            if let Err(e) = run_case(case, &ctx, float) {
                problems.push(format!("{} ({float:?}): {e:#}", case.display()));
            }
        }
    }
    report!("recurrent references: {} cases, {} failures (f32 and f64)", cases.len(), problems.len());
    if problems.is_empty() { Ok(()) } else { Err(anyhow!(problems.join("\n"))) }
}

/// The suite with float graphs computing in `float` (see the module docs).
fn suite(float: DType) -> Result<()> {
    let wide = float == DType::F64;
    let manifest = read_manifest(&data_dir().join("manifest.txt"))?;
    let dir = std::env::var_os("ONNX_NODE_DIR").map(PathBuf::from).unwrap_or_else(data_dir);
    let filter =
        std::env::var("ONNX_NODE_FILTER").ok().or_else(|| std::env::var_os("ONNX_NODE_DIR").map(|_| String::new()));
    let mut cases: Vec<String> = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join("model.onnx").is_file())
        .map(|e| e.file_name().to_string_lossy().to_string())
        .collect();
    cases.sort();
    let present: BTreeSet<&str> = cases.iter().map(|s| s.as_str()).collect();

    let ctx = Cpu::new(1)?;
    let prev_hook = panic::take_hook();
    panic::set_hook(Box::new(|info| {
        let mut loc = info.location().map(|l| format!(" at {}:{}", l.file(), l.line())).unwrap_or_default();
        if loc.contains("/rustc/") {
            // A panic inside std (an overflow in `product`, say): name the innermost workspace frame.
            let bt = std::backtrace::Backtrace::force_capture().to_string();
            let lines: Vec<&str> = bt.lines().map(str::trim).collect();
            let from = lines.iter().rposition(|l| l.contains("core::panicking::")).unwrap_or(0);
            if let Some(at) =
                lines[from..].iter().find(|l| l.starts_with("at ") && !l.contains("/rustc/") && !l.contains(".cargo"))
            {
                loc = format!("{loc}, called from {}", &at[3..]);
            }
        }
        let msg = payload_text(info.payload());
        if let Ok(mut l) = LAST_PANIC.lock() {
            *l = Some(format!("{msg}{loc}"));
        }
    }));

    let (mut passed, mut failed, mut skipped, mut passed_bound) = (0usize, 0usize, 0usize, 0usize);
    let mut unexpected = Vec::new();
    let mut now_passing = Vec::new();
    let mut panics = Vec::new();
    let start = std::time::Instant::now();
    for name in &cases {
        if filter.as_deref().is_some_and(|f| !name.contains(f)) {
            continue;
        }
        let entry = manifest.get(name);
        if entry.is_some_and(|e| e.status == Status::Exclude) {
            skipped += 1;
            continue;
        }
        let known_fail = entry.is_some_and(|e| e.status == Status::Fail);
        if wide && known_fail {
            // f64 checks the cases that pass in f32.
            skipped += 1;
            continue;
        }
        let outcome = match panic::catch_unwind(AssertUnwindSafe(|| run_case(&dir.join(name), &ctx, float))) {
            Ok(r) => r.map_err(|e| format!("{e:#}")),
            Err(payload) => {
                let m = format!("PANIC: {}", panic_message(&*payload));
                panics.push(format!("{name}: {m}"));
                Err(m)
            }
        };
        match outcome {
            Ok(bound) => {
                passed += 1;
                passed_bound += usize::from(bound);
                if known_fail {
                    now_passing.push(name.clone());
                }
            }
            Err(reason) => {
                failed += 1;
                let tag = if known_fail { "known-fail" } else { "FAIL" };
                report!("{tag} {name}: {reason}");
                if !known_fail {
                    unexpected.push(name.clone());
                }
            }
        }
    }
    panic::set_hook(prev_hook);

    let run = passed + failed;
    let rate = if run == 0 { 1.0 } else { passed as f64 / run as f64 };
    let mut problems = Vec::new();
    for n in &now_passing {
        report!("NOW PASSES {n}: listed as failing in manifest.txt; remove its line");
    }
    if !now_passing.is_empty() {
        problems.push(format!(
            "{} cases listed as failing in manifest.txt now pass (remove their lines): {}",
            now_passing.len(),
            now_passing.join(", ")
        ));
    }
    if !unexpected.is_empty() {
        problems.push(format!("{} cases fail without a manifest line: {}", unexpected.len(), unexpected.join(", ")));
    }
    if !panics.is_empty() {
        problems.extend(
            panics
                .iter()
                .filter(|p| unexpected.iter().any(|u| p.starts_with(u.as_str())))
                .map(|p| format!("panic in {p}")),
        );
    }
    if filter.is_none() && !wide {
        for (n, e) in &manifest {
            match (e.status, present.contains(n.as_str())) {
                (Status::NotCopied, true) => {
                    problems.push(format!("manifest says {n} is not copied, but it is in {}", dir.display()))
                }
                (Status::Exclude | Status::Fail, false) => {
                    problems.push(format!("manifest lists {n} ({}), which is not in {}", e.reason, dir.display()))
                }
                _ => {}
            }
        }
        if rate < MIN_PASS_RATE {
            problems.push(format!("pass rate {:.1}% is below {:.0}%", rate * 100.0, MIN_PASS_RATE * 100.0));
        }
    }
    if wide {
        report!("onnx-node in f64: {passed} passed, {failed} failed, {skipped} skipped (excluded or failing in f32)");
        if failed > 0 {
            problems.push(format!("{failed} cases that pass in f32 fail in f64: {}", unexpected.join(", ")));
        }
        return if problems.is_empty() { Ok(()) } else { Err(anyhow!(problems.join("\n"))) };
    }
    report!(
        "onnx-node: {passed_bound} of the passing cases had shape operands (axes, shape, pads...) bound as constants"
    );
    report!(
        "onnx-node: {skipped} skipped (excluded in manifest.txt), {} not copied; {:.1}% of run cases pass; {:.1}s",
        manifest.values().filter(|e| e.status == Status::NotCopied).count(),
        rate * 100.0,
        start.elapsed().as_secs_f64()
    );
    report!("onnx-node: {passed} passed, {failed} failed");
    if problems.is_empty() { Ok(()) } else { Err(anyhow!(problems.join("\n"))) }
}
