//! Trained weights in the safetensors format (Hugging Face's: a little-endian JSON header, then
//! the tensors' bytes in C order), keyed by ONNX initializer name, so that PyTorch
//! (`safetensors.torch.load_file`), Hugging Face tools and candle read what `train` and `run`
//! trained.
//!
//! Every [`ir::Tensor`] element type maps onto a safetensors dtype of the same width
//! (f32, f64, bf16, f16, i64, bool), so [`read_safetensors`] gives back exactly what
//! [`write_safetensors`] was given.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use ir::{Data, Tensor};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};

/// Errors reading or writing a safetensors file.
#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    /// I/O failure.
    #[error("{path}: {cause}")]
    Io {
        /// File.
        path: PathBuf,
        /// Cause.
        cause: std::io::Error,
    },
    /// Not a safetensors file, or one holding what autopar does not read.
    #[error("{path}: not a valid safetensors file: {message}")]
    Format {
        /// File.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

/// The header metadata autopar writes: `format: pt` (what Hugging Face's loaders expect of
/// PyTorch weights) and the producer.
pub fn metadata() -> BTreeMap<String, String> {
    [("format", "pt"), ("producer", concat!("autopar ", env!("CARGO_PKG_VERSION")))]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The largest safetensors file [`read_safetensors`] reads (it is read whole).
const MAX_FILE_BYTES: u64 = 64 << 30;

/// The bytes of a tensor, little-endian, and its safetensors dtype.
fn to_bytes(t: &Tensor) -> (Dtype, Vec<u8>) {
    fn le<T: Copy, const N: usize>(v: &[T], f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
        v.iter().flat_map(|&x| f(x)).collect()
    }
    match t.data() {
        Data::F32(v) => (Dtype::F32, le(v, f32::to_le_bytes)),
        Data::F64(v) => (Dtype::F64, le(v, f64::to_le_bytes)),
        Data::BF16(v) => (Dtype::BF16, le(v, |x| x.to_bits().to_le_bytes())),
        Data::F16(v) => (Dtype::F16, le(v, |x| x.to_bits().to_le_bytes())),
        Data::I64(v) => (Dtype::I64, le(v, i64::to_le_bytes)),
        Data::Bool(v) => (Dtype::BOOL, v.iter().map(|&b| b as u8).collect()),
    }
}

/// Writes `tensors` to `path` with `metadata` in the header's `__metadata__`.
pub fn write_safetensors(
    path: &Path,
    tensors: &BTreeMap<String, Tensor>,
    metadata: &BTreeMap<String, String>,
) -> Result<(), WeightsError> {
    let format = |message: String| WeightsError::Format { path: path.to_path_buf(), message };
    // The views borrow the bytes: convert every tensor first.
    let bytes: Vec<(&String, &Tensor, Dtype, Vec<u8>)> = tensors
        .iter()
        .map(|(name, t)| {
            let (dtype, b) = to_bytes(t);
            (name, t, dtype, b)
        })
        .collect();
    let views = bytes
        .iter()
        .map(|(name, t, dtype, b)| {
            TensorView::new(*dtype, t.shape().to_vec(), b)
                .map(|v| (name.as_str(), v))
                .map_err(|e| format(e.to_string()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let info: HashMap<String, String> = metadata.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    safetensors::serialize_to_file(views, Some(info), path).map_err(|e| match e {
        safetensors::SafeTensorError::IoError(cause) => WeightsError::Io { path: path.to_path_buf(), cause },
        other => format(other.to_string()),
    })
}

/// Reads every tensor of a safetensors file (f32, f64, bf16, f16, i64 or bool).
pub fn read_safetensors(path: &Path) -> Result<BTreeMap<String, Tensor>, WeightsError> {
    let format = |message: String| WeightsError::Format { path: path.to_path_buf(), message };
    let bytes = ir::files::read_regular(path, MAX_FILE_BYTES)
        .map_err(|cause| WeightsError::Io { path: path.to_path_buf(), cause })?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| format(e.to_string()))?;
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        let b = view.data();
        fn chunks<const N: usize, T>(b: &[u8], f: impl Fn([u8; N]) -> T) -> Vec<T> {
            b.chunks_exact(N).map(|c| f(c.try_into().unwrap_or([0; N]))).collect()
        }
        let data = match view.dtype() {
            Dtype::F32 => Data::F32(chunks(b, f32::from_le_bytes)),
            Dtype::F64 => Data::F64(chunks(b, f64::from_le_bytes)),
            Dtype::BF16 => Data::BF16(chunks(b, |c| ir::half::bf16::from_bits(u16::from_le_bytes(c)))),
            Dtype::F16 => Data::F16(chunks(b, |c| ir::half::f16::from_bits(u16::from_le_bytes(c)))),
            Dtype::I64 => Data::I64(chunks(b, i64::from_le_bytes)),
            Dtype::BOOL => Data::Bool(b.iter().map(|&x| x != 0).collect()),
            other => {
                return Err(format(format!(
                    "{name} has element type {other:?} (autopar reads f32, f64, bf16, f16, i64, bool)"
                )));
            }
        };
        let t = Tensor::new(view.shape().to_vec(), data).map_err(|e| format(format!("{name}: {e}")))?;
        out.insert(name, t);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every element type comes back as written, with the metadata in the header.
    #[test]
    fn round_trip() {
        let dir = std::env::temp_dir().join(format!("autopar-weights-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("w.safetensors");
        let mut t = BTreeMap::new();
        t.insert(
            "fc.weight".to_string(),
            Tensor::new(vec![2, 3], Data::F32(vec![1.0, -2.5, 3.0, 0.0, 1e-30, 7.0])).unwrap(),
        );
        t.insert("b".to_string(), Tensor::new(vec![2], Data::F64(vec![0.1, -0.2])).unwrap());
        t.insert("h".to_string(), Tensor::bf16([3], &[1.0, 0.5, -3.0]));
        t.insert("f".to_string(), Tensor::new(vec![1], Data::F16(vec![ir::half::f16::from_f32(0.25)])).unwrap());
        t.insert("i".to_string(), Tensor::new(vec![2, 1], Data::I64(vec![-3, 1 << 40])).unwrap());
        t.insert("m".to_string(), Tensor::new(vec![3], Data::Bool(vec![true, false, true])).unwrap());
        t.insert("s".to_string(), Tensor::new(vec![], Data::F32(vec![4.0])).unwrap());
        let meta: BTreeMap<String, String> = [("format".to_string(), "pt".to_string())].into();
        write_safetensors(&path, &t, &meta).unwrap();
        assert_eq!(read_safetensors(&path).unwrap(), t);
        let bytes = std::fs::read(&path).unwrap();
        let (_, m) = SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(m.metadata().as_ref().and_then(|m| m.get("format")).map(String::as_str), Some("pt"));
        // Not a safetensors file: one clear error naming it.
        std::fs::write(&path, b"not one").unwrap();
        let e = read_safetensors(&path).unwrap_err().to_string();
        assert!(e.contains("not a valid safetensors file") && e.contains("w.safetensors"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
