//! Import-time constant folding through tract, for nodes autopar has no kernel for.
//!
//! The importer folds nodes whose inputs are all constants with autopar's own CPU kernels
//! (`Importer::emit`). A node of an op autopar does not support (Trilu, Mod, ScatterND, CumSum,
//! ...) is still computable when every input is known at import: the causal masks, window masks and position tables of real models are
//! built this way. [`evaluate`] runs such a node on tract, the independent ONNX evaluator the
//! workspace already depends on for protobuf: a one-node ONNX model is built from the
//! `NodeProto`, analysed by tract, and run.
//!
//! Bounded before allocating: the node's first input is a source of the one-node model (a typed
//! fact of its shape, not a value), so tract's analysis cannot evaluate the node while inferring
//! shapes; the other inputs small enough to be shape-like parameters (`k`, `axis`, `repeats`,
//! indices) are constants so the output shapes are concrete. Those shapes are checked against
//! [`crate::ImportOptions::max_constant_bytes`] before the model runs; a node whose output shape
//! tract cannot make concrete is not folded.
//!
//! Dtypes: autopar holds every integer type as i64 and every float as f32 (see the crate docs),
//! so inputs go to tract in those types, and tract's results come back the same way: integers
//! (and tract's symbolic dims) as i64, floats as f32 (f16/bf16 widen exactly, f64 rounds), bools
//! as bools. A node whose ONNX type constraints need another input type (an int32-only input,
//! say) fails in tract and stays an error naming the node.

use ir::{Data, Tensor};
use tract_onnx::pb::{self, NodeProto, TensorProto};
use tract_onnx::prelude::{
    DatumType, Framework, InferenceModelExt, IntoRunnable, TValue, TVec, Tensor as TTensor, tvec,
};

/// Inputs with at most this many elements (other than the first) go to tract as constants: shape
/// parameters, axes, scalars and index tensors; larger ones as sources of a known shape.
const CONST_INPUT_ELEMS: usize = 4096;

/// ONNX `TensorProto.DataType` code of an autopar dtype.
pub(crate) fn onnx_code(t: &Tensor) -> i32 {
    match t.data() {
        Data::F32(_) => 1,
        Data::F64(_) => 11,
        Data::BF16(_) => 16,
        Data::F16(_) => 10,
        Data::I64(_) => 7,
        Data::Bool(_) => 9,
    }
}

/// An autopar tensor as an ONNX initializer (raw little-endian data).
pub(crate) fn tensor_to_proto(name: &str, t: &Tensor) -> TensorProto {
    let raw: Vec<u8> = match t.data() {
        Data::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Data::F64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Data::BF16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Data::F16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Data::I64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Data::Bool(v) => v.iter().map(|&b| b as u8).collect(),
    };
    TensorProto {
        name: name.to_string(),
        dims: t.shape().iter().map(|&d| d as i64).collect(),
        data_type: onnx_code(t),
        raw_data: raw,
        ..Default::default()
    }
}

fn value_info(name: &str, t: &Tensor) -> pb::ValueInfoProto {
    use pb::tensor_shape_proto::{Dimension, dimension};
    let shape = pb::TensorShapeProto {
        dim: t
            .shape()
            .iter()
            .map(|&d| Dimension { value: Some(dimension::Value::DimValue(d as i64)), ..Default::default() })
            .collect(),
    };
    pb::ValueInfoProto {
        name: name.to_string(),
        r#type: Some(pb::TypeProto {
            value: Some(pb::type_proto::Value::TensorType(pb::type_proto::Tensor {
                elem_type: onnx_code(t),
                shape: Some(shape),
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn to_tract(t: &Tensor) -> Result<TTensor, String> {
    let r = match t.data() {
        Data::F32(v) => TTensor::from_shape(t.shape(), v),
        Data::F64(v) => TTensor::from_shape(t.shape(), v),
        Data::BF16(_) | Data::F16(_) => TTensor::from_shape(t.shape(), &t.to_f32_vec()),
        Data::I64(v) => TTensor::from_shape(t.shape(), v),
        Data::Bool(v) => TTensor::from_shape(t.shape(), v),
    };
    r.map_err(|e| format!("{e:#}"))
}

/// A tract result in autopar's dtypes: integers and symbolic dims as i64, floats as f32.
pub(crate) fn from_tract(t: &TTensor) -> Result<Tensor, String> {
    let dt = t.datum_type();
    let shape = t.shape().to_vec();
    let err = |e: tract_onnx::prelude::TractError| format!("converting tract's {dt:?} result: {e:#}");
    let data = if dt == DatumType::Bool {
        Data::Bool(t.to_plain_array_view::<bool>().map_err(err)?.iter().copied().collect())
    } else if dt.is_float() {
        let c = t.cast_to::<f32>().map_err(err)?;
        Data::F32(c.to_plain_array_view::<f32>().map_err(err)?.iter().copied().collect())
    } else if dt == DatumType::U64 {
        // The one integer type with values past i64: refused rather than wrapped.
        let v = t.to_plain_array_view::<u64>().map_err(err)?;
        Data::I64(
            v.iter()
                .map(|&x| i64::try_from(x).map_err(|_| format!("uint64 value {x} does not fit autopar's int64")))
                .collect::<Result<_, _>>()?,
        )
    } else if dt.is_integer() || dt == DatumType::TDim {
        let c = t.cast_to::<i64>().map_err(err)?;
        Data::I64(c.to_plain_array_view::<i64>().map_err(err)?.iter().copied().collect())
    } else {
        return Err(format!("tract's result has element type {dt:?}, which autopar does not hold"));
    };
    Tensor::new(shape, data).map_err(|e| e.to_string())
}

/// Evaluates `node` on tract with constant `inputs` (one per input slot of the node, `None` for
/// an omitted optional input) under the default-domain `opset`. Returns one tensor per output
/// slot (`None` for an omitted output). Refuses, before running, an output larger than
/// `max_bytes` or of a shape tract cannot make concrete. A panic inside tract (a third-party
/// evaluator handed an untrusted node) is caught and returned as the node's error.
pub(crate) fn evaluate(
    node: &NodeProto,
    inputs: &[Option<&Tensor>],
    opset: i64,
    max_bytes: usize,
) -> Result<Vec<Option<Tensor>>, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| evaluate_unguarded(node, inputs, opset, max_bytes)))
        .unwrap_or_else(|payload| {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "no message".into());
            Err(format!("tract failed while folding it: {msg}"))
        })
}

fn evaluate_unguarded(
    node: &NodeProto,
    inputs: &[Option<&Tensor>],
    opset: i64,
    max_bytes: usize,
) -> Result<Vec<Option<Tensor>>, String> {
    let mut n = node.clone();
    n.name = "fold".into();
    let mut graph = pb::GraphProto { name: "fold".into(), ..Default::default() };
    let mut feeds: TVec<TValue> = tvec!();
    let mut first = true;
    for (k, (slot, t)) in n.input.iter_mut().zip(inputs).enumerate() {
        let Some(t) = t else {
            slot.clear();
            continue;
        };
        *slot = format!("in{k}");
        if first || t.numel() > CONST_INPUT_ELEMS {
            graph.input.push(value_info(slot, t));
            feeds.push(to_tract(t)?.into());
        } else {
            graph.initializer.push(tensor_to_proto(slot, t));
        }
        first = false;
    }
    let mut outs = Vec::new();
    for (k, slot) in n.output.iter_mut().enumerate() {
        if !slot.is_empty() {
            *slot = format!("out{k}");
            graph.output.push(pb::ValueInfoProto { name: slot.clone(), ..Default::default() });
            outs.push(k);
        }
    }
    let domain = n.domain.clone();
    graph.node.push(n);
    let mut opset_import = vec![pb::OperatorSetIdProto { domain: String::new(), version: opset }];
    if !domain.is_empty() && domain != "ai.onnx" {
        opset_import.push(pb::OperatorSetIdProto { domain, version: 1 });
    }
    let model = pb::ModelProto { ir_version: 8, opset_import, graph: Some(graph), ..Default::default() };
    let tract = |e: tract_onnx::prelude::TractError| format!("tract: {e:#}");
    let typed = tract_onnx::onnx()
        .with_ignore_output_shapes(true)
        .model_for_proto_model(&model)
        .and_then(|m| m.into_typed())
        .map_err(tract)?;
    let mut shapes = Vec::with_capacity(outs.len());
    let mut total = 0usize;
    for (i, &k) in outs.iter().enumerate() {
        let fact = typed.output_fact(i).map_err(tract)?;
        let shape = fact
            .shape
            .as_concrete()
            .ok_or_else(|| format!("output {k} has shape {:?}, which is not known before running it", fact.shape))?;
        // The bytes autopar will hold it in, whatever tract's type.
        let dt = fact.datum_type;
        let elem: usize = if dt == DatumType::Bool {
            1
        } else if dt.is_float() {
            4
        } else {
            8
        };
        let bytes = shape.iter().try_fold(elem, |a, &d| a.checked_mul(d));
        match bytes {
            Some(b) if b <= max_bytes => {}
            _ => {
                return Err(format!(
                    "output {k} of shape {shape:?} would take {} bytes, more than the {max_bytes} allowed for a \
                     constant computed at import (--max-constant-bytes)",
                    bytes.map(|b| b.to_string()).unwrap_or_else(|| "too many".into())
                ));
            }
        }
        shapes.push(shape.to_vec());
        total = total.saturating_add(bytes.unwrap_or(usize::MAX));
    }
    // tract's results and our copies of them are held at once; tract allocates infallibly, so
    // the memory is checked first (an error naming the node, not an abort).
    ir::alloc::reserve(total.saturating_mul(2)).map_err(|e| format!("folding it: {e}"))?;
    let results = typed.into_runnable().and_then(|r| r.run(feeds)).map_err(tract)?;
    let mut out = vec![None; node.output.len()];
    for ((r, &k), shape) in results.iter().zip(&outs).zip(&shapes) {
        // The bound above holds only if the result has the shape tract announced.
        if r.shape() != shape.as_slice() {
            return Err(format!("tract computed output {k} of shape {:?}, having announced {shape:?}", r.shape()));
        }
        out[k] = Some(from_tract(r)?);
    }
    Ok(out)
}
