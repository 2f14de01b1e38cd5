//! Reading ONNX `TensorProto`s (inline, raw or external data) into [`ir::Tensor`]s.
//!
//! External data is untrusted like the rest of the model: its location must be a relative path
//! that stays inside the model's directory (lexically, and after symbolic links are resolved),
//! the file must be a regular file, and `offset`/`length` must select a range inside it whose
//! length is exactly what the tensor's dims and element type need ([`external_range`]).

use std::io::{Read, Seek, SeekFrom};
use std::path::{Component, Path, PathBuf};

use ir::Tensor;
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

/// The largest ONNX file (model or serialized tensor) read whole: protobuf's 2 GiB message limit,
/// which ONNX keeps too (larger models hold their weights in external data files).
pub const MAX_MODEL_BYTES: u64 = 2 << 30;

/// Where a tensor's external data is: a range of a regular file inside the model's directory.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ExternalRange {
    /// The data file (as joined to the model's directory).
    pub file: PathBuf,
    /// Byte offset of the first element.
    pub offset: u64,
    /// Byte length: exactly what the tensor needs.
    pub len: u64,
}

/// Resolves the `external_data` entries (`location`, `offset`, `length`) of tensor `tensor`
/// against `base_dir` (the model's directory), for a tensor of `need` bytes. `Ok(None)` when the
/// data file does not exist (a weight-free model). Errors: no location; an absolute location, or
/// one leading outside `base_dir` (through `..` or a symbolic link); a file that is not regular;
/// an offset or length that is not a number, a range past the end of the file, or a length other
/// than `need`.
pub(crate) fn external_range(
    tensor: &str,
    entries: &[(&str, &str)],
    base_dir: &Path,
    need: u64,
) -> Result<Option<ExternalRange>, ImportError> {
    let bad = |m: String| ImportError::BadTensor { tensor: tensor.to_string(), message: m };
    // `Path::parent` of a bare file name is the empty path: the current directory.
    let base_dir = if base_dir.as_os_str().is_empty() { Path::new(".") } else { base_dir };
    let get = |k: &str| entries.iter().rev().find(|(key, _)| *key == k).map(|(_, v)| *v);
    let loc = match get("location") {
        Some(l) if !l.is_empty() => l,
        _ => return Err(bad("external data without a location".into())),
    };
    let rel = Path::new(loc);
    // Lexically first: an absolute path or a `..` above the model's directory is refused whether
    // or not the file exists.
    let mut depth = 0usize;
    for c in rel.components() {
        match c {
            Component::Prefix(_) | Component::RootDir => {
                return Err(bad(format!(
                    "external data location {loc} is an absolute path; it must be relative to the model's directory"
                )));
            }
            Component::ParentDir if depth == 0 => {
                return Err(bad(format!("external data location {loc} leads outside the model's directory")));
            }
            Component::ParentDir => depth -= 1,
            Component::Normal(_) => depth += 1,
            Component::CurDir => {}
        }
    }
    let file = base_dir.join(rel);
    let io = |path: &Path, cause| ImportError::Io { path: path.to_path_buf(), cause };
    match std::fs::metadata(&file) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io(&file, e)),
        Ok(_) => {}
    }
    // Then where it really is: a symbolic link may point anywhere.
    let real = file.canonicalize().map_err(|e| io(&file, e))?;
    let root = base_dir.canonicalize().map_err(|e| io(base_dir, e))?;
    if !real.starts_with(&root) {
        return Err(bad(format!(
            "external data location {loc} leads outside the model's directory (to {})",
            real.display()
        )));
    }
    let size = ir::files::open_regular(&file).and_then(|f| f.metadata()).map_err(|e| io(&file, e))?.len();
    let number = |k: &str| -> Result<Option<u64>, ImportError> {
        match get(k) {
            None => Ok(None),
            Some(v) => v
                .trim()
                .parse::<u64>()
                .map(Some)
                .map_err(|_| bad(format!("external data {k} `{v}` is not a byte count"))),
        }
    };
    let offset = number("offset")?.unwrap_or(0);
    let len = match number("length")? {
        Some(l) => l,
        None => size.saturating_sub(offset),
    };
    match offset.checked_add(len) {
        Some(end) if end <= size => {}
        _ => {
            return Err(bad(format!(
                "external data range at offset {offset} of {len} bytes is outside {} ({size} bytes)",
                file.display()
            )));
        }
    }
    if len != need {
        return Err(bad(format!("external data has {len} bytes in {}, its shape needs {need}", file.display())));
    }
    Ok(Some(ExternalRange { file, offset, len }))
}

/// Reads the bytes of an external data range.
fn read_range(r: &ExternalRange) -> Result<Vec<u8>, ImportError> {
    let io = |cause| ImportError::Io { path: r.file.clone(), cause };
    let mut f = ir::files::open_regular(&r.file).map_err(io)?;
    f.seek(SeekFrom::Start(r.offset)).map_err(io)?;
    let mut out = Vec::new();
    // The file may have shrunk since it was measured: read what is there and compare.
    f.take(r.len).read_to_end(&mut out).map_err(io)?;
    if out.len() as u64 != r.len {
        return Err(ImportError::BadTensor {
            tensor: r.file.display().to_string(),
            message: format!("external data ends after {} of {} bytes", out.len(), r.len),
        });
    }
    Ok(out)
}

/// Reads a serialized `TensorProto` file (as in the ONNX backend test data).
pub fn read_tensor_file(path: &Path) -> Result<Tensor, ImportError> {
    let bytes = ir::files::read_regular(path, MAX_MODEL_BYTES)
        .map_err(|cause| ImportError::Io { path: path.to_path_buf(), cause })?;
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
/// Element types are held as [`crate::dtype`] describes (integers as i64, floats as f32).
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
        let Some(size) = crate::dtype::elem_bytes(t.data_type) else {
            return Err(ImportError::UnsupportedDType { tensor: t.name.clone(), dtype: dtype_name(t.data_type) });
        };
        let entries: Vec<(&str, &str)> = t.external_data.iter().map(|e| (e.key.as_str(), e.value.as_str())).collect();
        if !entries.iter().any(|(k, _)| *k == "location") {
            return Err(bad("external data without a location".into()));
        }
        let Some(dir) = base_dir else { return Ok(None) };
        // n * 8 fits (checked above), so n * size does.
        match external_range(&t.name, &entries, dir, n as u64 * size)? {
            Some(r) => Some(read_range(&r)?),
            None => return Ok(None),
        }
    } else if !t.raw_data.is_empty() {
        Some(t.raw_data.clone())
    } else {
        None
    };
    if crate::dtype::held_as(t.data_type).is_none() {
        return Err(ImportError::UnsupportedDType { tensor: t.name.clone(), dtype: dtype_name(t.data_type) });
    }
    let data = match &raw {
        Some(r) => {
            let size = crate::dtype::elem_bytes(t.data_type)
                .ok_or_else(|| bad(format!("{} has no raw encoding", dtype_name(t.data_type))))?
                as usize;
            if r.len() != n * size {
                return Err(bad(format!("raw data has {} bytes, shape {shape:?} needs {}", r.len(), n * size)));
            }
            crate::dtype::decode_raw(t.data_type, r).map_err(bad)?
        }
        None => {
            let (len, data) = crate::dtype::decode_fields(t).map_err(bad)?;
            if len != n && len != 0 {
                return Err(bad(format!("has {len} elements, shape {shape:?} needs {n}")));
            }
            if len == 0 && n != 0 {
                return Ok(None);
            }
            data
        }
    };
    Tensor::new(shape, data).map(Some).map_err(|e| bad(e.to_string()))
}
