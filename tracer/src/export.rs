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
