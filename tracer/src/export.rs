//! Writing a model back out with new initializer values: the trained weights in the exporter's
//! own graph, so that any ONNX runtime runs what `train` or `run` trained.
//!
//! Only the initializers named in the new values change; everything else (nodes, inputs, opset,
//! metadata) is the original file's. Each new value keeps its initializer's element type
//! (float32, float16, bfloat16 or float64: a model exported in half precision stays so) and is
//! written inline as `raw_data`, so a weight-free export with external data becomes a complete
//! model (within protobuf's 2 GiB limit).

use std::collections::BTreeMap;

use ir::{Data, Tensor};
use prost::Message;
use tract_onnx::pb;

use crate::ImportError;

/// The ONNX model `bytes` (read from `source`) with every initializer named in `values`
/// replaced by its value. Errors: bytes that are not a model; a value with no initializer of
/// its name, or of another shape; an initializer whose type is not a float type.
pub fn with_initializers(
    bytes: &[u8],
    source: &str,
    values: &BTreeMap<String, Tensor>,
) -> Result<Vec<u8>, ImportError> {
    let mut model = pb::ModelProto::decode(bytes)
        .map_err(|e| ImportError::Decode { path: source.to_string(), message: e.to_string() })?;
    let graph = model
        .graph
        .as_mut()
        .ok_or_else(|| ImportError::Decode { path: source.to_string(), message: "the model has no graph".into() })?;
    let bad = |tensor: &str, message: String| ImportError::BadTensor { tensor: tensor.to_string(), message };
    let mut left: BTreeMap<&str, &Tensor> = values.iter().map(|(k, v)| (k.as_str(), v)).collect();
    for init in &mut graph.initializer {
        let Some(t) = left.remove(init.name.as_str()) else { continue };
        let dims: Vec<i64> = t.shape().iter().map(|&d| d as i64).collect();
        if dims != init.dims {
            return Err(bad(
                &init.name,
                format!("the model's initializer is {:?}, the new value {:?}", init.dims, dims),
            ));
        }
        if !matches!(t.data(), Data::F32(_) | Data::F64(_) | Data::BF16(_) | Data::F16(_)) {
            return Err(bad(&init.name, format!("the new value is {}, not a float tensor", t.meta())));
        }
        let f = t.to_f64_vec();
        let raw: Vec<u8> = match init.data_type {
            1 => f.iter().flat_map(|&x| (x as f32).to_le_bytes()).collect(),
            10 => f.iter().flat_map(|&x| ir::half::f16::from_f64(x).to_bits().to_le_bytes()).collect(),
            16 => f.iter().flat_map(|&x| ir::half::bf16::from_f64(x).to_bits().to_le_bytes()).collect(),
            11 => f.iter().flat_map(|&x| x.to_le_bytes()).collect(),
            code => {
                return Err(bad(
                    &init.name,
                    format!("it is {} in the model; only float initializers are trained", crate::dtype_name(code)),
                ));
            }
        };
        let (name, data_type, doc_string) = (init.name.clone(), init.data_type, init.doc_string.clone());
        *init = pb::TensorProto { name, data_type, dims, doc_string, raw_data: raw, ..Default::default() };
    }
    if let Some((name, _)) = left.into_iter().next() {
        return Err(bad(name, format!("{source} has no initializer of this name")));
    }
    Ok(model.encode_to_vec())
}

/// A PyTorch name an initializer stands for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TorchName {
    /// The state-dict key (as the exported module named it, wrapper prefix included).
    pub name: String,
    /// The initializer is the transpose of the PyTorch tensor (an `nn.Linear` weight the
    /// exporter turned into a `MatMul` operand).
    pub transposed: bool,
    /// Where the name comes from: `initializer` (its own name), or the node that names it.
    pub from: String,
}

/// Whether an ONNX name reads as a PyTorch state-dict key (`a.b.weight`; not `onnx::MatMul_7`).
pub(crate) fn torch_like(name: &str) -> bool {
    !name.is_empty() && !name.contains("::") && !name.starts_with('/') && name.contains('.')
}

/// The module path of a node named by the exporter's scope (`/m/encoder/query/MatMul` is
/// `m.encoder.query`).
fn module_of(node: &str) -> Option<String> {
    let parts: Vec<&str> = node.strip_prefix('/')?.split('/').collect();
    let (_, path) = parts.split_last()?;
    (!path.is_empty() && path.iter().all(|p| !p.is_empty())).then(|| path.join("."))
}

/// The PyTorch names of a model's initializers, where the file keeps them (see
/// [`TorchName`]): an initializer's own name when it reads as a state-dict key; else the scope
/// of the one node that reads it as a weight (`MatMul` input 1: the transpose of a Linear
/// weight; `Gemm` input 1, transposed unless `transB`; `Conv` inputs 1 and 2); and the names
/// of `Identity` nodes that copy it (a TorchScript export merges equal parameters into one
/// initializer and names the others that way). Initializers with no name found are left out.
pub fn torch_names(bytes: &[u8], source: &str) -> Result<BTreeMap<String, Vec<TorchName>>, ImportError> {
    let model = pb::ModelProto::decode(bytes)
        .map_err(|e| ImportError::Decode { path: source.to_string(), message: e.to_string() })?;
    let Some(graph) = model.graph.as_ref() else {
        return Err(ImportError::Decode { path: source.to_string(), message: "the model has no graph".into() });
    };
    // Node inputs by name, each with its reader and input index.
    let mut readers: BTreeMap<&str, Vec<(&pb::NodeProto, usize)>> = BTreeMap::new();
    for n in &graph.node {
        for (k, i) in n.input.iter().enumerate() {
            readers.entry(i.as_str()).or_default().push((n, k));
        }
    }
    let mut out = BTreeMap::new();
    for init in &graph.initializer {
        let mut names = vec![];
        let uses: &[(&pb::NodeProto, usize)] = readers.get(init.name.as_str()).map_or(&[], Vec::as_slice);
        if torch_like(&init.name) {
            names.push(TorchName { name: init.name.clone(), transposed: false, from: "initializer".into() });
        } else {
            let weights: Vec<TorchName> = uses
                .iter()
                .filter(|(n, _)| n.op_type != "Identity")
                .filter_map(|(n, k)| {
                    let module = module_of(&n.name)?;
                    let trans_b = n.attribute.iter().find(|a| a.name == "transB").is_some_and(|a| a.i != 0);
                    let (suffix, transposed) = match (n.op_type.as_str(), k) {
                        ("MatMul", 1) if init.dims.len() == 2 => ("weight", true),
                        ("Gemm", 1) => ("weight", !trans_b),
                        ("Conv", 1) => ("weight", false),
                        ("Conv", 2) => ("bias", false),
                        _ => return None,
                    };
                    let from = format!("node {} ({} input {k})", n.name, n.op_type);
                    Some(TorchName { name: format!("{module}.{suffix}"), transposed, from })
                })
                .collect();
            // One reader's scope names it; several readers (a shared weight) name nothing sure.
            if let [w] = weights.as_slice()
                && uses.iter().filter(|(n, _)| n.op_type != "Identity").count() == 1
            {
                names.push(w.clone());
            }
        }
        let transposed = names.first().is_some_and(|n| n.transposed);
        for (n, _) in uses.iter().filter(|(n, _)| n.op_type == "Identity") {
            if let Some(o) = n.output.first().filter(|o| torch_like(o)) {
                let from =
                    if n.name.is_empty() { "Identity".to_string() } else { format!("node {} (Identity)", n.name) };
                names.push(TorchName { name: o.clone(), transposed, from });
            }
        }
        if !names.is_empty() {
            out.insert(init.name.clone(), names);
        }
    }
    Ok(out)
}
