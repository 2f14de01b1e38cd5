//! Reading blocks of float initializers straight from an ONNX file, without decoding the model.
//!
//! A distributed rank needs only its own block of each parameter. [`InitializerIndex::open`]
//! walks the protobuf wire format of the file (`ModelProto.graph` → `GraphProto.initializer`)
//! and records, for every float initializer (float32; float16, bfloat16 and float64 are read
//! converted to the f32 the importer holds them in), its shape and where its little-endian elements
//! sit: a byte range of the model file (`raw_data`, or packed `float_data`) or of an external
//! data file. [`InitializerIndex::read_block`] then reads only the bytes of one block (one read
//! per contiguous run). The element payloads are skipped by seeking, so a 500 MB model costs a
//! few kilobytes of reading to index.
//!
//! Invariant: a block read from the index equals the same block of the tensor the importer
//! builds from the same initializer (`tests`, and the workspace's runtime tests, check it).
//! External data is checked as the importer checks it ([`crate::proto`]): inside the model's
//! directory, a regular file, a range inside it of exactly the tensor's byte length.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use crate::ImportError;
use ir::half::{bf16, f16};

/// Where one float32 initializer's elements are.
#[derive(Clone, Debug, PartialEq)]
pub struct InitializerLoc {
    /// Global shape.
    pub shape: Vec<usize>,
    /// File holding the elements (the model, or its external data file).
    pub file: PathBuf,
    /// Byte offset of element 0 in that file.
    pub offset: u64,
    /// ONNX element type: float32, or float16 / bfloat16 / float64, read widened (or rounded, for
    /// float64) to the f32 the importer holds them in.
    pub data_type: i32,
}

/// Bytes per element of the float initializer types the index reads.
fn float_bytes(data_type: i32) -> Option<u64> {
    use crate::dtype::code::*;
    match data_type {
        FLOAT => Some(4),
        FLOAT16 | BFLOAT16 => Some(2),
        DOUBLE => Some(8),
        _ => None,
    }
}

/// The float32 initializers of one ONNX file, by name (see the module docs).
#[derive(Clone, Debug, Default)]
pub struct InitializerIndex {
    locs: BTreeMap<String, InitializerLoc>,
    /// Initializers whose external data file does not exist, with that file.
    absent: BTreeMap<String, PathBuf>,
    /// The external data files read from.
    external: BTreeSet<PathBuf>,
}

struct Wire<R: Read + Seek> {
    r: R,
    pos: u64,
    path: PathBuf,
}

impl<R: Read + Seek> Wire<R> {
    fn bad(&self, m: impl Into<String>) -> ImportError {
        ImportError::Decode { path: self.path.display().to_string(), message: m.into() }
    }

    fn byte(&mut self) -> Result<Option<u8>, ImportError> {
        let mut b = [0u8];
        match self.r.read(&mut b) {
            Ok(0) => Ok(None),
            Ok(_) => {
                self.pos += 1;
                Ok(Some(b[0]))
            }
            Err(cause) => Err(ImportError::Io { path: self.path.clone(), cause }),
        }
    }

    /// A varint, or `None` at a clean end of input.
    fn varint(&mut self) -> Result<Option<u64>, ImportError> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let Some(b) = self.byte()? else {
                return if shift == 0 { Ok(None) } else { Err(self.bad("truncated varint")) };
            };
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(Some(v));
            }
        }
        Err(self.bad("varint longer than 10 bytes"))
    }

    fn need_varint(&mut self) -> Result<u64, ImportError> {
        self.varint()?.ok_or_else(|| self.bad("truncated field"))
    }

    fn skip(&mut self, n: u64) -> Result<(), ImportError> {
        let n = i64::try_from(n).map_err(|_| self.bad("field length out of range"))?;
        self.r.seek(SeekFrom::Current(n)).map_err(|cause| ImportError::Io { path: self.path.clone(), cause })?;
        self.pos += n as u64;
        Ok(())
    }

    fn bytes(&mut self, n: u64) -> Result<Vec<u8>, ImportError> {
        if n > 1 << 20 {
            return Err(self.bad(format!("a {n}-byte header field (expected a short string)")));
        }
        let mut v = vec![0u8; n as usize];
        self.r.read_exact(&mut v).map_err(|cause| ImportError::Io { path: self.path.clone(), cause })?;
        self.pos += n;
        Ok(v)
    }

    /// Skips a field's payload of wire type `wt`.
    fn skip_field(&mut self, wt: u64) -> Result<(), ImportError> {
        match wt {
            0 => self.need_varint().map(|_| ()),
            1 => self.skip(8),
            2 => {
                let n = self.need_varint()?;
                self.skip(n)
            }
            5 => self.skip(4),
            _ => Err(self.bad(format!("unsupported protobuf wire type {wt}"))),
        }
    }
}

/// What the header fields of one `TensorProto` say.
#[derive(Default)]
struct TensorHeader {
    name: String,
    dims: Vec<i64>,
    data_type: i32,
    /// (offset, length) of `raw_data` or packed `float_data` in the model file.
    inline: Option<(u64, u64)>,
    external: Vec<(String, String)>,
    data_location: i32,
}

impl InitializerIndex {
    /// Indexes the float32 initializers of the ONNX model at `path` (see the module docs).
    pub fn open(path: &Path) -> Result<InitializerIndex, ImportError> {
        let f = ir::files::open_regular(path).map_err(|cause| ImportError::Io { path: path.to_path_buf(), cause })?;
        let len = f.metadata().map_err(|cause| ImportError::Io { path: path.to_path_buf(), cause })?.len();
        let mut w = Wire { r: BufReader::new(f), pos: 0, path: path.to_path_buf() };
        let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
        let mut index = InitializerIndex::default();
        // ModelProto: field 7 is the graph.
        while let Some(key) = w.varint()? {
            let (field, wt) = (key >> 3, key & 7);
            if field == 7 && wt == 2 {
                let n = w.need_varint()?;
                let end = w.pos + n;
                if end > len {
                    return Err(w.bad("graph runs past the end of the file"));
                }
                index.read_graph(&mut w, end, &base)?;
            } else {
                w.skip_field(wt)?;
            }
        }
        Ok(index)
    }

    fn read_graph<R: Read + Seek>(&mut self, w: &mut Wire<R>, end: u64, base: &Path) -> Result<(), ImportError> {
        // GraphProto: field 5 is a repeated initializer (TensorProto).
        while w.pos < end {
            let key = w.need_varint()?;
            let (field, wt) = (key >> 3, key & 7);
            if field == 5 && wt == 2 {
                let n = w.need_varint()?;
                let t_end = w.pos + n;
                if t_end > end {
                    return Err(w.bad("initializer runs past the end of its graph"));
                }
                let h = read_tensor(w, t_end)?;
                self.add(h, w, base)?;
            } else {
                w.skip_field(wt)?;
            }
        }
        Ok(())
    }

    fn add<R: Read + Seek>(&mut self, h: TensorHeader, w: &Wire<R>, base: &Path) -> Result<(), ImportError> {
        let Some(elem) = float_bytes(h.data_type) else { return Ok(()) };
        let bad = |m: String| ImportError::BadTensor { tensor: h.name.clone(), message: m };
        let shape: Vec<usize> = h
            .dims
            .iter()
            .map(|&d| usize::try_from(d))
            .collect::<Result<_, _>>()
            .map_err(|_| bad(format!("negative dim in {:?}", h.dims)))?;
        let n = shape
            .iter()
            .try_fold(elem, |a, &d| a.checked_mul(d as u64))
            .ok_or_else(|| bad(format!("shape {shape:?} is too large")))?;
        let external = h.data_location == 1 || !h.external.is_empty();
        let loc = if external {
            let entries: Vec<(&str, &str)> = h.external.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            match crate::proto::external_range(&h.name, &entries, base, n)? {
                Some(r) => {
                    self.external.insert(r.file.clone());
                    InitializerLoc { shape, file: r.file, offset: r.offset, data_type: h.data_type }
                }
                None => {
                    // Weight-free: the data file is absent.
                    let loc = entries.iter().rev().find(|(k, _)| *k == "location").map_or("", |(_, v)| *v);
                    self.absent.insert(h.name, base.join(loc));
                    return Ok(());
                }
            }
        } else {
            match h.inline {
                Some((offset, len)) if len == n => {
                    InitializerLoc { shape, file: w.path.clone(), offset, data_type: h.data_type }
                }
                Some((_, len)) if n > 0 => {
                    return Err(bad(format!("has {len} data bytes, shape {shape:?} needs {n}")));
                }
                _ => return Ok(()), // no data: weight-free
            }
        };
        self.locs.insert(h.name, loc);
        Ok(())
    }

    /// The names of the float32 initializers with data, in name order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.locs.keys().map(String::as_str)
    }

    /// The initializer called `name`, if the file has its data.
    pub fn get(&self, name: &str) -> Option<&InitializerLoc> {
        self.locs.get(name)
    }

    /// The external data file of initializer `name` when that file does not exist (the reason
    /// the index has no data for it).
    pub fn absent_file(&self, name: &str) -> Option<&Path> {
        self.absent.get(name).map(PathBuf::as_path)
    }

    /// The external data files the index reads from, each once, in path order.
    pub fn external_files(&self) -> impl Iterator<Item = &Path> {
        self.external.iter().map(PathBuf::as_path)
    }

    /// Number of float32 initializers with data.
    pub fn len(&self) -> usize {
        self.locs.len()
    }

    /// True when no float32 initializer has data (a weight-free model).
    pub fn is_empty(&self) -> bool {
        self.locs.is_empty()
    }

    /// Reads the block of initializer `name` that starts at `offsets` and has shape `size`.
    /// Returns `Ok(None)` when the file has no data for it.
    pub fn read_block(&self, name: &str, offsets: &[usize], size: &[usize]) -> Result<Option<Vec<f32>>, ImportError> {
        let Some(loc) = self.locs.get(name) else { return Ok(None) };
        let bad = |m: String| ImportError::BadTensor { tensor: name.to_string(), message: m };
        let shape = &loc.shape;
        if offsets.len() != shape.len() || size.len() != shape.len() {
            return Err(bad(format!("block of rank {} asked of a rank-{} tensor", size.len(), shape.len())));
        }
        if offsets.iter().zip(size).zip(shape).any(|((&o, &s), &d)| o + s > d) {
            return Err(bad(format!("block at {offsets:?} of size {size:?} is outside shape {shape:?}")));
        }
        let total: usize = size.iter().product();
        // Sized by the file (an external data file may be sparse): allocated fallibly.
        let mut out = ir::alloc::try_vec(total).map_err(|e| bad(format!("a block of {size:?}: {e}")))?;
        if total == 0 {
            return Ok(Some(out));
        }
        // The block is a set of contiguous runs: the trailing dims taken whole, plus one partial dim.
        let nd = shape.len();
        let mut k = nd; // dims k.. are whole in the block
        while k > 0 && size[k - 1] == shape[k - 1] {
            k -= 1;
        }
        let inner: usize = shape[k..].iter().product();
        let run = if k == 0 { inner } else { size[k - 1] * inner };
        let lead = k.saturating_sub(1); // dims 0..lead are iterated
        let strides: Vec<usize> = (0..nd).map(|d| shape[d + 1..].iter().product()).collect();
        let mut f =
            ir::files::open_regular(&loc.file).map_err(|cause| ImportError::Io { path: loc.file.clone(), cause })?;
        let mut idx = vec![0usize; lead];
        let elem = float_bytes(loc.data_type).unwrap_or(4) as usize;
        let mut buf = ir::alloc::try_filled(run * elem, 0u8).map_err(|e| bad(format!("a block of {size:?}: {e}")))?;
        loop {
            let mut start: usize = (0..nd).map(|d| offsets[d] * strides[d]).sum();
            start += idx.iter().enumerate().map(|(d, &i)| i * strides[d]).sum::<usize>();
            f.seek(SeekFrom::Start(loc.offset + (elem * start) as u64))
                .and_then(|_| f.read_exact(&mut buf))
                .map_err(|cause| ImportError::Io { path: loc.file.clone(), cause })?;
            use crate::dtype::code::*;
            match loc.data_type {
                FLOAT16 => out.extend(buf.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())),
                BFLOAT16 => out.extend(buf.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())),
                DOUBLE => {
                    out.extend(buf.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8])) as f32))
                }
                _ => out.extend(buf.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))),
            }
            // Next index over the leading dims (odometer).
            let mut d = lead;
            loop {
                if d == 0 {
                    return Ok(Some(out));
                }
                d -= 1;
                idx[d] += 1;
                if idx[d] < size[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
    }
}

fn read_tensor<R: Read + Seek>(w: &mut Wire<R>, end: u64) -> Result<TensorHeader, ImportError> {
    let mut h = TensorHeader::default();
    while w.pos < end {
        let key = w.need_varint()?;
        let (field, wt) = (key >> 3, key & 7);
        match (field, wt) {
            (1, 0) => h.dims.push(w.need_varint()? as i64),
            (1, 2) => {
                let n = w.need_varint()?;
                let e = w.pos + n;
                while w.pos < e {
                    h.dims.push(w.need_varint()? as i64);
                }
            }
            (2, 0) => h.data_type = w.need_varint()? as i32,
            (8, 2) => {
                let n = w.need_varint()?;
                h.name = String::from_utf8_lossy(&w.bytes(n)?).into_owned();
            }
            // raw_data, or packed float_data: little-endian f32 elements either way.
            (9, 2) | (4, 2) => {
                let n = w.need_varint()?;
                h.inline = Some((w.pos, n));
                w.skip(n)?;
            }
            (4, 5) => return Err(w.bad(format!("initializer {}: unpacked float_data is not supported", h.name))),
            (13, 2) => {
                let n = w.need_varint()?;
                let e = w.pos + n;
                let (mut k, mut v) = (String::new(), String::new());
                while w.pos < e {
                    let key = w.need_varint()?;
                    match (key >> 3, key & 7) {
                        (1, 2) => {
                            let n = w.need_varint()?;
                            k = String::from_utf8_lossy(&w.bytes(n)?).into_owned();
                        }
                        (2, 2) => {
                            let n = w.need_varint()?;
                            v = String::from_utf8_lossy(&w.bytes(n)?).into_owned();
                        }
                        (_, wt) => w.skip_field(wt)?,
                    }
                }
                h.external.push((k, v));
            }
            (14, 0) => h.data_location = w.need_varint()? as i32,
            (_, wt) => w.skip_field(wt)?,
        }
    }
    if w.pos != end {
        return Err(w.bad(format!("initializer {} overruns its length", h.name)));
    }
    Ok(h)
}

/// Blocks read straight from the file (`autopar run --init model`).
impl ir::params::ParamSource for InitializerIndex {
    fn block(
        &self,
        name: &str,
        meta: &ir::TensorMeta,
        offsets: &[usize],
        size: &[usize],
    ) -> Result<Option<ir::Tensor>, String> {
        match self.get(name) {
            Some(loc) if loc.shape != meta.shape => {
                Err(format!("initializer {name} has shape {:?} but the plan needs {meta}", loc.shape))
            }
            _ => Ok(self
                .read_block(name, offsets, size)
                .map_err(|e| e.to_string())?
                .map(|v| ir::Tensor::f32(size.to_vec(), v))),
        }
    }
}

impl ir::params::ModelParams for InitializerIndex {
    fn has(&self, name: &str) -> bool {
        self.get(name).is_some()
    }
    fn absent_file(&self, name: &str) -> Option<&Path> {
        InitializerIndex::absent_file(self, name)
    }
    fn external_files(&self) -> Vec<PathBuf> {
        InitializerIndex::external_files(self).map(Path::to_path_buf).collect()
    }
}
