//! `.npy` and `.npz` reading and writing (through the `npyz` crate) for feeds, outputs and
//! saved training state.

use std::collections::BTreeMap;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use ir::{Data, Tensor};
use npyz::WriterBuilder;

/// A `.npy` file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum NpyError {
    /// I/O failure.
    #[error("{path}: {cause}")]
    Io {
        /// File.
        path: PathBuf,
        /// Cause.
        cause: std::io::Error,
    },
    /// Not a readable `.npy` file.
    #[error("{path}: not a valid .npy file: {message}")]
    Format {
        /// File.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// An element type autopar does not handle.
    #[error("{path}: element type {descr} is not supported (use float32, float64, int64, int32 or bool)")]
    DType {
        /// File.
        path: PathBuf,
        /// numpy type string.
        descr: String,
    },
}

/// Reads a C-order `.npy` file of float32, float64, int64, int32 (widened to int64) or bool.
pub fn read_npy(path: &Path) -> Result<Tensor, NpyError> {
    let bytes = std::fs::read(path).map_err(|cause| NpyError::Io { path: path.to_path_buf(), cause })?;
    let f = npyz::NpyFile::new(&bytes[..])
        .map_err(|e| NpyError::Format { path: path.to_path_buf(), message: e.to_string() })?;
    decode(path, f, "")
}

fn decode<R: std::io::Read>(path: &Path, f: npyz::NpyFile<R>, what: &str) -> Result<Tensor, NpyError> {
    let fmt = |message: String| NpyError::Format { path: path.to_path_buf(), message: format!("{what}{message}") };
    if f.order() != npyz::Order::C {
        return Err(fmt("Fortran-order arrays are not supported".into()));
    }
    let shape: Vec<usize> = f.shape().iter().map(|&d| d as usize).collect();
    let descr = f.dtype().descr();
    let data = match descr.trim_matches('\'') {
        "<f4" => Data::F32(f.into_vec::<f32>().map_err(|e| fmt(e.to_string()))?),
        "<f8" => Data::F64(f.into_vec::<f64>().map_err(|e| fmt(e.to_string()))?),
        "<i8" => Data::I64(f.into_vec::<i64>().map_err(|e| fmt(e.to_string()))?),
        "<i4" => Data::I64(f.into_vec::<i32>().map_err(|e| fmt(e.to_string()))?.into_iter().map(i64::from).collect()),
        "|b1" => Data::Bool(f.into_vec::<bool>().map_err(|e| fmt(e.to_string()))?),
        other => return Err(NpyError::DType { path: path.to_path_buf(), descr: format!("{what}{other}") }),
    };
    Tensor::new(shape, data).map_err(|e| fmt(e.to_string()))
}

/// Reads every array of a `.npz` archive (as written by `numpy.savez`) by name.
pub fn read_npz(path: &Path) -> Result<BTreeMap<String, Tensor>, NpyError> {
    let io = |cause: std::io::Error| NpyError::Io { path: path.to_path_buf(), cause };
    let mut ar = npyz::npz::NpzArchive::open(path).map_err(io)?;
    let names: Vec<String> = ar.array_names().map(str::to_string).collect();
    let mut out = BTreeMap::new();
    for name in names {
        let f = ar
            .by_name(&name)
            .map_err(|e| NpyError::Format { path: path.to_path_buf(), message: format!("array {name}: {e}") })?
            .ok_or_else(|| NpyError::Format { path: path.to_path_buf(), message: format!("array {name} vanished") })?;
        let t = decode(path, f, &format!("array {name}: "))?;
        out.insert(name, t);
    }
    Ok(out)
}

/// Writes tensors (by name, e.g. a `&BTreeMap<String, Tensor>`) as a `.npz` archive readable
/// by `numpy.load`.
pub fn write_npz<'a>(path: &Path, arrays: impl IntoIterator<Item = (&'a String, &'a Tensor)>) -> Result<(), NpyError> {
    let io = |cause: std::io::Error| NpyError::Io { path: path.to_path_buf(), cause };
    let mut w = npyz::npz::NpzWriter::create(path).map_err(io)?;
    let zip = w.zip_writer();
    for (name, t) in arrays {
        zip.start_file(npyz::npz::file_name_from_array_name(name), Default::default()).map_err(|e| io(e.into()))?;
        encode(t, &mut *zip).map_err(io)?;
    }
    zip.finish().map_err(|e| io(e.into()))?;
    Ok(())
}

/// Writes a tensor as a C-order `.npy` file.
pub fn write_npy(path: &Path, t: &Tensor) -> Result<(), NpyError> {
    let io = |cause: std::io::Error| NpyError::Io { path: path.to_path_buf(), cause };
    let file = std::fs::File::create(path).map_err(io)?;
    let mut w = BufWriter::new(file);
    encode(t, &mut w).map_err(io)?;
    w.flush().map_err(io)
}

/// The `.npy` encoding of `t` (header and C-order data).
fn encode(t: &Tensor, w: impl Write) -> std::io::Result<()> {
    fn put<T: npyz::AutoSerialize + Copy>(v: &[T], shape: &[u64], w: impl Write) -> std::io::Result<()> {
        let mut wr = npyz::WriteOptions::new().default_dtype().shape(shape).writer(w).begin_nd()?;
        wr.extend(v.iter().copied())?;
        wr.finish()
    }
    let shape: Vec<u64> = t.shape().iter().map(|&d| d as u64).collect();
    match t.data() {
        Data::F32(v) => put(v, &shape, w),
        Data::F64(v) => put(v, &shape, w),
        Data::I64(v) => put(v, &shape, w),
        Data::Bool(v) => put(v, &shape, w),
    }
}
