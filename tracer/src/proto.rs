//! Reading ONNX `TensorProto`s (inline, raw or external data) into [`ir::Tensor`]s.

use std::path::Path;

use ir::{Data, Tensor};
use prost::Message;
use tract_onnx::pb::TensorProto;

use crate::ImportError;

/// ONNX element type names by `TensorProto.DataType` code.
pub fn dtype_name(code: i32) -> String {
    match code {
        1 => "float32",
        2 => "uint8",
        3 => "int8",
        4 => "uint16",
        5 => "int16",
        6 => "int32",
        7 => "int64",
        8 => "string",
        9 => "bool",
        10 => "float16",
        11 => "float64",
        12 => "uint32",
        13 => "uint64",
        16 => "bfloat16",
        _ => return format!("type code {code}"),
    }
    .to_string()
}

/// Reads a serialized `TensorProto` file (as in the ONNX backend test data).
pub fn read_tensor_file(path: &Path) -> Result<Tensor, ImportError> {
    let bytes = std::fs::read(path).map_err(|cause| ImportError::Io { path: path.to_path_buf(), cause })?;
    let t = TensorProto::decode(&*bytes)
        .map_err(|e| ImportError::Decode { path: path.display().to_string(), message: e.to_string() })?;
    tensor_from_proto(&t, path.parent())?
        .ok_or_else(|| ImportError::BadTensor { tensor: path.display().to_string(), message: "has no data".into() })
}

fn dims(t: &TensorProto) -> Result<Vec<usize>, ImportError> {
    let bad = |m: String| ImportError::BadTensor { tensor: t.name.clone(), message: m };
    let d: Vec<usize> = t
        .dims
        .iter()
        .map(|&d| usize::try_from(d))
        .collect::<Result<_, _>>()
        .map_err(|_| bad(format!("negative dim in {:?}", t.dims)))?;
    // Shapes from a file are untrusted: element and byte counts must fit in memory arithmetic.
    if d.iter().try_fold(8usize, |a, &x| a.checked_mul(x)).is_none() {
        return Err(bad(format!("shape {:?} is too large", t.dims)));
    }
    Ok(d)
}

/// Declared shape of a tensor proto.
pub(crate) fn proto_shape(t: &TensorProto) -> Result<Vec<usize>, ImportError> {
    dims(t)
}

/// Converts a tensor proto. Returns `Ok(None)` when the data is absent (a weight-free model):
/// no inline data for a non-empty tensor, or an external data file that does not exist.
/// int32 and float64 data are widened/narrowed to autopar's i64 and f32.
pub fn tensor_from_proto(t: &TensorProto, base_dir: Option<&Path>) -> Result<Option<Tensor>, ImportError> {
    let shape = dims(t)?;
    let bad = |m: String| ImportError::BadTensor { tensor: t.name.clone(), message: m };
    let n: usize = shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .filter(|&n| n.checked_mul(8).is_some())
        .ok_or_else(|| bad(format!("shape {shape:?} is too large")))?;
    let external = t.data_location == Some(1) || !t.external_data.is_empty();
    let raw: Option<Vec<u8>> = if external {
        let get = |k: &str| t.external_data.iter().find(|e| e.key == k).map(|e| e.value.clone());
        let Some(loc) = get("location") else { return Err(bad("external data without a location".into())) };
        let Some(dir) = base_dir else { return Ok(None) };
        let path = dir.join(&loc);
        let Ok(bytes) = std::fs::read(&path) else { return Ok(None) };
        let off: usize = get("offset").and_then(|s| s.parse().ok()).unwrap_or(0);
        let len: Option<usize> = get("length").and_then(|s| s.parse().ok());
        let end = len.map(|l| off + l).unwrap_or(bytes.len());
        if off > end || end > bytes.len() {
            return Err(bad(format!(
                "external data range {off}..{end} is outside {} ({} bytes)",
                path.display(),
                bytes.len()
            )));
        }
        Some(bytes[off..end].to_vec())
    } else if !t.raw_data.is_empty() {
        Some(t.raw_data.clone())
    } else {
        None
    };
    let elem = |size: usize| -> Result<Option<&[u8]>, ImportError> {
        match &raw {
            Some(r) if r.len() == n * size => Ok(Some(r.as_slice())),
            Some(r) => Err(bad(format!("raw data has {} bytes, shape {shape:?} needs {}", r.len(), n * size))),
            None => Ok(None),
        }
    };
    let check = |len: usize| -> Result<bool, ImportError> {
        if len == n {
            Ok(true)
        } else if len == 0 {
            Ok(false)
        } else {
            Err(bad(format!("has {len} elements, shape {shape:?} needs {n}")))
        }
    };
    let data = match t.data_type {
        1 => match elem(4)? {
            Some(r) => Data::F32(r.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()),
            None if check(t.float_data.len())? || n == 0 => Data::F32(t.float_data.clone()),
            None => return Ok(None),
        },
        11 => match elem(8)? {
            Some(r) => Data::F32(
                r.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")) as f32).collect(),
            ),
            None if check(t.double_data.len())? || n == 0 => {
                Data::F32(t.double_data.iter().map(|&x| x as f32).collect())
            }
            None => return Ok(None),
        },
        7 => match elem(8)? {
            Some(r) => {
                Data::I64(r.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes"))).collect())
            }
            None if check(t.int64_data.len())? || n == 0 => Data::I64(t.int64_data.clone()),
            None => return Ok(None),
        },
        6 => match elem(4)? {
            Some(r) => {
                Data::I64(r.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64).collect())
            }
            None if check(t.int32_data.len())? || n == 0 => Data::I64(t.int32_data.iter().map(|&x| x as i64).collect()),
            None => return Ok(None),
        },
        9 => match elem(1)? {
            Some(r) => Data::Bool(r.iter().map(|&b| b != 0).collect()),
            None if check(t.int32_data.len())? || n == 0 => Data::Bool(t.int32_data.iter().map(|&x| x != 0).collect()),
            None => return Ok(None),
        },
        code => return Err(ImportError::UnsupportedDType { tensor: t.name.clone(), dtype: dtype_name(code) }),
    };
    Tensor::new(shape, data).map(Some).map_err(|e| bad(e.to_string()))
}
