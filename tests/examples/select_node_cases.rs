//! Selects the ONNX backend node test cases autopar can import and copies them into the repo.
//!
//! ```text
//! cargo run -p tests --example select_node_cases -- /work/shared/onnx-node tests/data/onnx-node
//! ```
//!
//! A case is copied when every node of its `model.onnx` is a default-domain op in
//! [`tracer::SUPPORTED_OPS`] (or calls a local function whose nodes all are: the importer inlines
//! them) and every tensor type the model declares (graph inputs and outputs, initializers,
//! `Constant`/`ConstantOfShape` values, `Cast` targets) is one autopar holds
//! ([`tracer::held_dtype`]: every integer type as i64, float16/bfloat16/float64 as f32, bool).
//! Every other case is listed with its reason in the last two sections of the destination's
//! `manifest.txt`, "not copied: ops" (the ops autopar lacks) and "not copied: dtype" (the element
//! types it does not hold), which this tool rewrites (the sections above them, written by hand,
//! are kept), so every case of the suite is accounted for. The destination's case folders are replaced; the suite's LICENSE and NOTICE are
//! copied alongside.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use prost::Message;
use tract_onnx::pb;

/// Opens the manifest sections this tool writes (everything from the first is replaced).
const NOT_COPIED_PREFIX: &str = "# --- not copied:";

/// Element types autopar holds (see [`tracer::held_dtype`]).
fn held(code: i32) -> bool {
    tracer::held_dtype(code).is_some()
}

/// Why a case is not copied.
enum Verdict {
    Copy,
    Ops(BTreeSet<String>),
    DType(BTreeSet<String>),
}

/// ONNX element type name, including the types newer than `tracer::dtype_name` knows.
fn dtype_name(code: i32) -> String {
    let newer = match code {
        14 => "complex64",
        15 => "complex128",
        17 => "float8e4m3fn",
        18 => "float8e4m3fnuz",
        19 => "float8e5m2",
        20 => "float8e5m2fnuz",
        21 => "uint4",
        22 => "int4",
        23 => "float4e2m1",
        24 => "float8e8m0",
        25 => "uint2",
        26 => "int2",
        27 => "float6e2m3",
        28 => "float6e3m2",
        _ => return tracer::dtype_name(code),
    };
    newer.to_string()
}

fn value_info_dtypes(vi: &pb::ValueInfoProto, bad: &mut BTreeSet<String>) {
    match vi.r#type.as_ref().and_then(|t| t.value.as_ref()) {
        Some(pb::type_proto::Value::TensorType(tt)) if held(tt.elem_type) => {}
        Some(pb::type_proto::Value::TensorType(tt)) => {
            bad.insert(dtype_name(tt.elem_type));
        }
        _ => {
            bad.insert("non-tensor (sequence/optional)".into());
        }
    }
}

fn judge(model: &pb::ModelProto) -> Verdict {
    let Some(g) = model.graph.as_ref() else {
        return Verdict::Ops(BTreeSet::from(["(no graph)".to_string()]));
    };
    let missing = missing_ops(model, &g.node);
    if !missing.is_empty() {
        return Verdict::Ops(missing);
    }
    let mut bad = BTreeSet::new();
    for vi in g.input.iter().chain(&g.output) {
        value_info_dtypes(vi, &mut bad);
    }
    let tensor = |t: &pb::TensorProto, bad: &mut BTreeSet<String>| {
        if !held(t.data_type) {
            bad.insert(dtype_name(t.data_type));
        }
    };
    for t in &g.initializer {
        tensor(t, &mut bad);
    }
    for n in &g.node {
        for a in &n.attribute {
            match (n.op_type.as_str(), a.name.as_str()) {
                ("Constant" | "ConstantOfShape", "value") => {
                    if let Some(t) = &a.t {
                        tensor(t, &mut bad);
                    }
                }
                ("Cast", "to") if !held(a.i as i32) => {
                    bad.insert(dtype_name(a.i as i32));
                }
                _ => {}
            }
        }
    }
    if bad.is_empty() { Verdict::Copy } else { Verdict::DType(bad) }
}

/// The ops of `nodes` autopar cannot import, looking through calls of the model's local functions
/// (the importer inlines them) and into subgraph attributes (whose ops it never supports).
fn missing_ops(model: &pb::ModelProto, nodes: &[pb::NodeProto]) -> BTreeSet<String> {
    fn walk(model: &pb::ModelProto, nodes: &[pb::NodeProto], depth: usize, out: &mut BTreeSet<String>) {
        for n in nodes {
            let default = n.domain.is_empty() || n.domain == "ai.onnx";
            let local = model.functions.iter().find(|f| {
                f.name.as_deref() == Some(n.op_type.as_str()) && f.domain.as_deref().unwrap_or("") == n.domain
            });
            match local {
                Some(f) if depth < 8 => walk(model, &f.node, depth + 1, out),
                _ if default && tracer::SUPPORTED_OPS.contains(&n.op_type.as_str()) => {}
                _ if default => {
                    out.insert(n.op_type.clone());
                }
                _ => {
                    out.insert(format!("{}:{}", n.domain, n.op_type));
                }
            }
            for a in &n.attribute {
                if let Some(sub) = &a.g {
                    walk(model, &sub.node, depth + 1, out);
                }
            }
        }
    }
    let mut out = BTreeSet::new();
    walk(model, nodes, 0, &mut out);
    out
}

fn copy_dir(from: &Path, to: &Path) -> Result<()> {
    fs::create_dir_all(to).with_context(|| format!("creating {}", to.display()))?;
    for e in fs::read_dir(from).with_context(|| format!("listing {}", from.display()))? {
        let e = e?;
        let dst = to.join(e.file_name());
        if e.file_type()?.is_dir() {
            copy_dir(&e.path(), &dst)?;
        } else {
            fs::copy(e.path(), &dst).with_context(|| format!("copying {}", e.path().display()))?;
        }
    }
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [src, dst] = args.as_slice() else {
        bail!("usage: select_node_cases SUITE_DIR DEST_DIR (e.g. /work/shared/onnx-node tests/data/onnx-node)");
    };
    let (src, dst) = (PathBuf::from(src), PathBuf::from(dst));
    let mut cases: Vec<PathBuf> = fs::read_dir(&src)
        .with_context(|| format!("listing {}", src.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("model.onnx").is_file())
        .collect();
    cases.sort();
    fs::create_dir_all(&dst)?;
    // Replace previously selected cases so a changed selection leaves nothing stale behind.
    for e in fs::read_dir(&dst)? {
        let p = e?.path();
        if p.is_dir() && p.join("model.onnx").is_file() {
            fs::remove_dir_all(&p)?;
        }
    }
    let (mut copied, mut by_ops, mut by_dtype) = (0, Vec::new(), Vec::new());
    for case in &cases {
        let name = case.file_name().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
        let bytes = fs::read(case.join("model.onnx"))?;
        let model = pb::ModelProto::decode(&*bytes).with_context(|| format!("decoding {name}/model.onnx"))?;
        match judge(&model) {
            Verdict::Copy => {
                copy_dir(case, &dst.join(&name))?;
                copied += 1;
            }
            Verdict::Ops(o) => by_ops.push((name, o)),
            Verdict::DType(d) => by_dtype.push((name, d)),
        }
    }
    for f in ["LICENSE", "NOTICE"] {
        fs::copy(src.join(f), dst.join(f)).with_context(|| format!("copying {f}"))?;
    }
    // The manifest's last sections list the cases not copied; rewrite them, keep the rest.
    let mut section = format!("{NOT_COPIED_PREFIX} ops ({}) ---\n", by_ops.len());
    for (name, o) in &by_ops {
        let o: Vec<_> = o.iter().cloned().collect();
        section += &format!("{name}  not-copied  unsupported op: {}\n", o.join(", "));
    }
    section += &format!("\n{NOT_COPIED_PREFIX} dtype ({}) ---\n", by_dtype.len());
    for (name, d) in &by_dtype {
        section += &format!(
            "{name}  not-copied  {} tensors are not supported\n",
            d.iter().cloned().collect::<Vec<_>>().join(", ")
        );
    }
    let manifest = dst.join("manifest.txt");
    let kept = match fs::read_to_string(&manifest) {
        Ok(text) => match text.find(NOT_COPIED_PREFIX) {
            Some(at) => text[..at].to_string(),
            None => format!("{}\n\n", text.trim_end()),
        },
        Err(_) => String::new(),
    };
    fs::write(&manifest, kept + &section).with_context(|| format!("writing {}", manifest.display()))?;
    eprintln!(
        "{} cases: {copied} copied, {} with unsupported ops, {} with unsupported dtypes",
        cases.len(),
        by_ops.len(),
        by_dtype.len()
    );
    Ok(())
}
