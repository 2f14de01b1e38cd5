//! `.npy` and `.npz` reading and writing (through the `npyz` crate) for feeds, outputs and
//! saved training state.
//!
//! Files are untrusted: only regular files are read, and each array's header is checked before
//! `npyz` sees it ([`checked_header`]): a header of at most [`MAX_HEADER_BYTES`], shallowly nested,
//! whose shape's element count does not overflow and whose data fits in the bytes the file (or
//! the archive entry) actually has. So a few bytes claiming a huge shape are an error, never an
//! allocation of that size.

use std::collections::BTreeMap;
use std::io::{BufReader, BufWriter, Cursor, Read, Write};
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
    #[error(
        "{path}: element type {descr} is not supported (use float16, float32, float64, bool or an integer type up to 32 bits, or int64)"
    )]
    DType {
        /// File.
        path: PathBuf,
        /// numpy type string.
        descr: String,
    },
}

/// The largest `.npy` header read (numpy itself writes a few hundred bytes and refuses to read
/// more than 10,000 by default).
pub const MAX_HEADER_BYTES: usize = 1 << 16;

/// Reads the preamble and header of a `.npy` stream of `total` bytes and checks them (see the
/// module docs). Returns the bytes read, to be given to `npyz` ahead of the rest of the stream.
pub(crate) fn checked_header(path: &Path, r: &mut impl Read, total: u64, what: &str) -> Result<Vec<u8>, NpyError> {
    let fmt = |message: String| NpyError::Format { path: path.to_path_buf(), message: format!("{what}{message}") };
    let io = |cause: std::io::Error| NpyError::Io { path: path.to_path_buf(), cause };
    let mut head = vec![0u8; 10];
    r.read_exact(&mut head).map_err(|_| fmt("too short for a .npy header".into()))?;
    if &head[..6] != b"\x93NUMPY" {
        return Err(fmt("no .npy magic (\\x93NUMPY) at the start".into()));
    }
    let len = match head[6] {
        1 => u16::from_le_bytes([head[8], head[9]]) as usize,
        2 | 3 => {
            let mut more = [0u8; 2];
            r.read_exact(&mut more).map_err(|_| fmt("truncated header".into()))?;
            head.extend_from_slice(&more);
            u32::from_le_bytes([head[8], head[9], more[0], more[1]]) as usize
        }
        v => return Err(fmt(format!("format version {v} is not supported"))),
    };
    if len > MAX_HEADER_BYTES {
        return Err(fmt(format!("a header of {len} bytes (at most {MAX_HEADER_BYTES} are read)")));
    }
    let start = head.len();
    head.resize(start + len, 0);
    r.read_exact(&mut head[start..]).map_err(io)?;
    let text = String::from_utf8_lossy(&head[start..]).into_owned();
    // npyz parses the header recursively: keep its nesting shallow.
    let mut depth = 0usize;
    for c in text.chars() {
        match c {
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        if depth > 8 {
            return Err(fmt("the header is nested too deeply".into()));
        }
    }
    // The element count and byte size the header asks for, against the bytes that follow it.
    // Every `shape` entry is checked (a Python dict keeps the last of repeated keys), and a
    // misleading `descr` can only make the bound 8 times the file's size.
    let item = match header_descr(&text).as_deref() {
        Some("<f8" | "<i8" | "<u8" | "<c8") => 8,
        Some("<f4" | "<i4" | "<u4") => 4,
        Some("<f2" | "<i2" | "<u2") => 2,
        _ => 1,
    };
    let data = total.saturating_sub(head.len() as u64);
    for shape in header_shapes(&text) {
        let shape = shape.map_err(|m| fmt(format!("header shape: {m}")))?;
        // Readers compute strides as products of the trailing dims, which a zero dim elsewhere
        // does not bound: the product of the non-zero dims must fit too.
        if shape.iter().filter(|&&d| d != 0).try_fold(1u64, |a, &d| a.checked_mul(d)).is_none() {
            return Err(fmt(format!("shape {shape:?} is too large (its dims' product overflows)")));
        }
        let n = shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .ok_or_else(|| fmt(format!("shape {shape:?} is too large")))?;
        match n.checked_mul(item) {
            Some(need) if need <= data => {}
            _ => {
                return Err(fmt(format!(
                    "shape {shape:?} needs {n} elements of {item} bytes, the file has {data} data bytes"
                )));
            }
        }
    }
    Ok(head)
}

/// The values of `key` in the header's dict: the text after each `'key':`.
fn header_values<'a>(text: &'a str, key: &str) -> impl Iterator<Item = &'a str> {
    let (single, double) = (format!("'{key}'"), format!("\"{key}\""));
    let starts: Vec<usize> = text.match_indices(&single).chain(text.match_indices(&double)).map(|(i, _)| i).collect();
    starts
        .into_iter()
        .filter_map(move |at| Some(text[at + key.len() + 2..].trim_start().strip_prefix(':')?.trim_start()))
}

/// The `shape` tuples of a header.
fn header_shapes(text: &str) -> impl Iterator<Item = Result<Vec<u64>, String>> + '_ {
    header_values(text, "shape").filter_map(|v| {
        let v = v.strip_prefix('(')?;
        let inner = &v[..v.find(')')?];
        Some(
            inner
                .split(',')
                .map(|d| d.trim().trim_end_matches('L'))
                .filter(|d| !d.is_empty())
                .map(|d| d.parse::<u64>().map_err(|_| format!("`{d}` is not a dimension")))
                .collect(),
        )
    })
}

/// The `descr` string of a header, if it is a plain quoted string.
fn header_descr(text: &str) -> Option<String> {
    let v = header_values(text, "descr").next()?;
    let q = v.chars().next().filter(|c| *c == '\'' || *c == '"')?;
    let body = &v[1..];
    Some(body[..body.find(q)?].to_string())
}

/// Reads a C-order `.npy` file of float32, float64, int64, bool, or a narrower integer type
/// (int32, int16, int8, uint32, uint16, uint8: widened to int64, as autopar holds every integer).
/// Only a regular file is read (see the module docs for the checks).
pub fn read_npy(path: &Path) -> Result<Tensor, NpyError> {
    let io = |cause: std::io::Error| NpyError::Io { path: path.to_path_buf(), cause };
    let file = ir::files::open_regular(path).map_err(io)?;
    let total = file.metadata().map_err(io)?.len();
    let mut r = BufReader::new(file);
    let head = checked_header(path, &mut r, total, "")?;
    let f = npyz::NpyFile::new(Cursor::new(head).chain(r))
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
        // float16 feeds (of models exported in half precision) are held as f32, as the importer
        // holds their inputs: exact.
        "<f2" => Data::F32(
            f.into_vec::<ir::half::f16>().map_err(|e| fmt(e.to_string()))?.into_iter().map(|x| x.to_f32()).collect(),
        ),
        "<i8" => Data::I64(f.into_vec::<i64>().map_err(|e| fmt(e.to_string()))?),
        "<i4" => Data::I64(f.into_vec::<i32>().map_err(|e| fmt(e.to_string()))?.into_iter().map(i64::from).collect()),
        "<i2" => Data::I64(f.into_vec::<i16>().map_err(|e| fmt(e.to_string()))?.into_iter().map(i64::from).collect()),
        "|i1" => Data::I64(f.into_vec::<i8>().map_err(|e| fmt(e.to_string()))?.into_iter().map(i64::from).collect()),
        "|u1" => Data::I64(f.into_vec::<u8>().map_err(|e| fmt(e.to_string()))?.into_iter().map(i64::from).collect()),
        "<u2" => Data::I64(f.into_vec::<u16>().map_err(|e| fmt(e.to_string()))?.into_iter().map(i64::from).collect()),
        "<u4" => Data::I64(f.into_vec::<u32>().map_err(|e| fmt(e.to_string()))?.into_iter().map(i64::from).collect()),
        "|b1" => Data::Bool(f.into_vec::<bool>().map_err(|e| fmt(e.to_string()))?),
        other => return Err(NpyError::DType { path: path.to_path_buf(), descr: format!("{what}{other}") }),
    };
    Tensor::new(shape, data).map_err(|e| fmt(e.to_string()))
}

/// Reads every array of a `.npz` archive (as written by `numpy.savez`) by name. Only a regular
/// file is read, and each array's header is checked against the size of its entry (no more than
/// deflate can expand its compressed bytes to).
pub fn read_npz(path: &Path) -> Result<BTreeMap<String, Tensor>, NpyError> {
    let io = |cause: std::io::Error| NpyError::Io { path: path.to_path_buf(), cause };
    let fmt = |message: String| NpyError::Format { path: path.to_path_buf(), message };
    let file = ir::files::open_regular(path).map_err(io)?;
    let file_len = file.metadata().map_err(io)?.len();
    let mut ar = npyz::npz::NpzArchive::new(BufReader::new(file)).map_err(io)?;
    let names: Vec<String> = ar.array_names().map(str::to_string).collect();
    let mut out = BTreeMap::new();
    for name in names {
        let what = format!("array {name}: ");
        let mut entry = ar
            .zip_archive()
            .by_name(&npyz::npz::file_name_from_array_name(&name))
            .map_err(|e| fmt(format!("{what}{e}")))?;
        // Deflate expands at most 1032-fold; the declared size alone could be anything.
        let total = entry.size().min(entry.compressed_size().min(file_len).saturating_mul(1032));
        let head = checked_header(path, &mut entry, total, &what)?;
        let f = npyz::NpyFile::new(Cursor::new(head).chain(entry)).map_err(|e| fmt(format!("{what}{e}")))?;
        let t = decode(path, f, &what)?;
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
        // numpy has no bfloat16: half types are written widened to f32 (exactly).
        Data::BF16(_) | Data::F16(_) => put(&t.to_f32_vec(), &shape, w),
        Data::I64(v) => put(v, &shape, w),
        Data::Bool(v) => put(v, &shape, w),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A version-1 `.npy` file of `descr` and `shape` holding `data` (little-endian bytes).
    fn npy(descr: &str, shape: &str, data: &[u8]) -> Vec<u8> {
        let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
        while (10 + header.len() + 1) % 64 != 0 {
            header.push(' ');
        }
        header.push('\n');
        let mut out = b"\x93NUMPY\x01\x00".to_vec();
        out.extend_from_slice(&(header.len() as u16).to_le_bytes());
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(data);
        out
    }

    #[test]
    fn narrow_integers_widen_to_int64() {
        let dir = std::env::temp_dir().join(format!("autopar-npy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cases: [(&str, Vec<u8>, Vec<i64>); 5] = [
            ("|u1", vec![0, 7, 255], vec![0, 7, 255]),
            ("|i1", vec![0x80, 0xff, 5], vec![-128, -1, 5]),
            ("<i2", [-300i16, 2, 32767].iter().flat_map(|v| v.to_le_bytes()).collect(), vec![-300, 2, 32767]),
            ("<u2", [65535u16, 0, 9].iter().flat_map(|v| v.to_le_bytes()).collect(), vec![65535, 0, 9]),
            ("<u4", [u32::MAX, 1, 2].iter().flat_map(|v| v.to_le_bytes()).collect(), vec![u32::MAX as i64, 1, 2]),
        ];
        for (descr, bytes, want) in cases {
            let path = dir.join(format!("{}.npy", descr.replace(['<', '|'], "")));
            std::fs::write(&path, npy(descr, "(3,)", &bytes)).unwrap();
            let t = read_npy(&path).unwrap_or_else(|e| panic!("{descr}: {e}"));
            assert_eq!(t.shape(), &[3], "{descr}");
            assert_eq!(t.data(), &Data::I64(want), "{descr}");
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}
