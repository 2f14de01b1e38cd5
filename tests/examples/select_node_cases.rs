//! Selects the ONNX backend node test cases autopar can import and copies them into the repo.
//!
//! ```text
//! cargo run -p tests --example select_node_cases -- /work/shared/onnx-node tests/data/onnx-node
//! ```
//!
//! A case is copied when every node of its `model.onnx` is a default-domain op in
//! [`tracer::SUPPORTED_OPS`] and every tensor type the model declares (graph inputs and outputs,
//! initializers, `Constant`/`ConstantOfShape` values, `Cast` targets) is float32, int64 or bool.
//! Cases with supported ops but another element type are not copied; they are listed with their
//! dtypes in the last section of the destination's `manifest.txt` ("not copied: dtype"), which
//! this tool rewrites (the sections above it, written by hand, are kept) so the accounting stays
//! complete. The destination's case folders are replaced; the suite's LICENSE and NOTICE are
//! copied alongside.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use prost::Message;
use tract_onnx::pb;

/// Opens the manifest section this tool writes (everything after it is replaced).
const NOT_COPIED_HEADER: &str = "# --- not copied: dtype";

/// Element types autopar handles: float32, int64, bool.
const OK_DTYPES: [i32; 3] = [1, 7, 9];

/// Why a case is not copied.
enum Verdict {
    Copy,
    Ops,
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
        Some(pb::type_proto::Value::TensorType(tt)) if OK_DTYPES.contains(&tt.elem_type) => {}
        Some(pb::type_proto::Value::TensorType(tt)) => {
            bad.insert(dtype_name(tt.elem_type));
        }
        None => {
            bad.insert("non-tensor (sequence/optional)".into());
        }
    }
}

fn judge(model: &pb::ModelProto) -> Verdict {
    let Some(g) = model.graph.as_ref() else {
        return Verdict::Ops;
    };
    let supported = |n: &pb::NodeProto| {
        (n.domain.is_empty() || n.domain == "ai.onnx") && tracer::SUPPORTED_OPS.contains(&n.op_type.as_str())
    };
    if !g.node.iter().all(supported) {
        return Verdict::Ops;
    }
    let mut bad = BTreeSet::new();
    for vi in g.input.iter().chain(&g.output) {
        value_info_dtypes(vi, &mut bad);
    }
    let tensor = |t: &pb::TensorProto, bad: &mut BTreeSet<String>| {
        if !OK_DTYPES.contains(&t.data_type) {
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
                ("Cast", "to") if !OK_DTYPES.contains(&(a.i as i32)) => {
                    bad.insert(dtype_name(a.i as i32));
                }
                _ => {}
            }
        }
    }
    if bad.is_empty() { Verdict::Copy } else { Verdict::DType(bad) }
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
    let (mut copied, mut by_ops, mut by_dtype) = (0, 0, Vec::new());
    for case in &cases {
        let name = case.file_name().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
        let bytes = fs::read(case.join("model.onnx"))?;
        let model = pb::ModelProto::decode(&*bytes).with_context(|| format!("decoding {name}/model.onnx"))?;
        match judge(&model) {
            Verdict::Copy => {
                copy_dir(case, &dst.join(&name))?;
                copied += 1;
            }
            Verdict::Ops => by_ops += 1,
            Verdict::DType(d) => by_dtype.push((name, d)),
        }
    }
    for f in ["LICENSE", "NOTICE"] {
        fs::copy(src.join(f), dst.join(f)).with_context(|| format!("copying {f}"))?;
    }
    // The manifest's last section lists the cases not copied; rewrite it, keep the rest.
    let mut section = format!("{NOT_COPIED_HEADER} ({}) ---\n", by_dtype.len());
    for (name, d) in &by_dtype {
        section += &format!(
            "{name}  not-copied  {} tensors are not supported\n",
            d.iter().cloned().collect::<Vec<_>>().join(", ")
        );
    }
    let manifest = dst.join("manifest.txt");
    let kept = match fs::read_to_string(&manifest) {
        Ok(text) => match text.find(NOT_COPIED_HEADER) {
            Some(at) => text[..at].to_string(),
            None => format!("{}\n\n", text.trim_end()),
        },
        Err(_) => String::new(),
    };
    fs::write(&manifest, kept + &section).with_context(|| format!("writing {}", manifest.display()))?;
    eprintln!(
        "{} cases: {copied} copied, {by_ops} with unsupported ops, {} with unsupported dtypes",
        cases.len(),
        by_dtype.len()
    );
    Ok(())
}
