//! Datasets streamed to the ranks of a run (`autopar run --data`, `autopar train --data`).
//!
//! A [`Dataset`] binds graph inputs to files of samples (the first dimension of every array):
//!
//! - **arrays**: a `.npy` file, a `.npz` archive (the array named after the input, or its only
//!   array), or a directory of such shards read in name order, one after the other;
//! - **tokens**: any other file, a flat array of little-endian `uint16` or `uint32` token ids
//!   (nanoGPT's `train.bin`) or of bytes (a text file as byte-level tokens), cut into
//!   sequences of the input's length `T` (its second dim). Binding two
//!   inputs to one token file, `input_ids,labels=train.bin`, gives the second the next tokens:
//!   sample `i` is tokens `[iT, iT+T)` for the first and `[iT+1, iT+T+1)` for the second.
//!
//! Every bound input must have the same number of samples. Step `s` (0-based) reads the global
//! batch of `B` samples (`B` = the inputs' first dim: the plan's global batch, every microbatch
//! of it) at position `(s mod E) * B` of epoch `s / E`'s order, where `E = samples / B` steps
//! make an epoch (the last incomplete batch is dropped, as `DataLoader(drop_last=True)`). An
//! epoch's order is the file order, or a permutation drawn from the seed and the epoch number
//! alone (Fisher–Yates over SplitMix64). So the batches are a function of the step, the seed and
//! the files: every rank computes the same order without talking to the others, and a run
//! resumed at step `s` sees exactly the batches the uninterrupted run would have
//! ([`Dataset::position`] is recorded in checkpoints and checked on resume).
//!
//! Each rank reads only the samples (rows) its block of an input covers, with positioned reads
//! ([`std::os::unix::fs::FileExt::read_exact_at`]) into the files: a data-parallel shard reads
//! its rows and no others; nothing assembles the global batch on one rank. A [`Reader`] counts
//! the bytes it read. Only regular files are read; headers are checked as `npy` checks them, and
//! a row outside a file is an error, never a panic. Compressed `.npz` entries
//! (`numpy.savez_compressed`) cannot be read by rows and are refused.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{Cursor, Read};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use ir::{DType, Data, Tensor, TensorMeta};

/// A dataset that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A binding is malformed or does not fit the graph's inputs.
    #[error("--data {binding}: {message}")]
    Binding {
        /// The binding as written (`NAME=PATH`).
        binding: String,
        /// What is wrong.
        message: String,
    },
    /// A shard's `.npy` header is not usable (the error names the file).
    #[error(transparent)]
    Npy(#[from] crate::npy::NpyError),
    /// A file could not be read.
    #[error("{path}: {message}")]
    File {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
}

/// Token ids' width in a token file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenType {
    /// Bytes: a text file is its own byte-level tokens.
    U8,
    /// Little-endian `uint16` (nanoGPT's `train.bin`).
    U16,
    /// Little-endian `uint32` (vocabularies over 65,536).
    U32,
}

impl TokenType {
    fn bytes(self) -> usize {
        match self {
            TokenType::U8 => 1,
            TokenType::U16 => 2,
            TokenType::U32 => 4,
        }
    }
}

/// `NAME=PATH` or `NAME,NEXT=TOKENS.bin`: the inputs a file feeds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Binding {
    /// The inputs, in order (a second one takes a token file's next tokens).
    pub names: Vec<String>,
    /// The file or directory.
    pub path: PathBuf,
}

impl std::str::FromStr for Binding {
    type Err = String;
    fn from_str(s: &str) -> Result<Binding, String> {
        let (names, path) =
            s.split_once('=').ok_or_else(|| format!("--data `{s}` is not NAME=PATH (or NAME,NEXT=TOKENS.bin)"))?;
        let names: Vec<String> = names.split(',').map(|n| n.trim().to_string()).collect();
        if names.iter().any(String::is_empty) || path.is_empty() || names.len() > 2 {
            return Err(format!("--data `{s}` is not NAME=PATH (or NAME,NEXT=TOKENS.bin)"));
        }
        if names.len() == 2 && names[0] == names[1] {
            return Err(format!("--data `{s}`: the input and its next tokens need two different inputs"));
        }
        Ok(Binding { names, path: PathBuf::from(path) })
    }
}

impl std::fmt::Display for Binding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}={}", self.names.join(","), self.path.display())
    }
}

/// How samples are ordered and what token files hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataOptions {
    /// Seed of every epoch's permutation.
    pub seed: u64,
    /// Permute each epoch (`false`: file order every epoch).
    pub shuffle: bool,
    /// Width of token ids in token files (`None`: bytes for a `.txt` file, else `uint16`).
    pub tokens: Option<TokenType>,
}

impl Default for DataOptions {
    fn default() -> Self {
        DataOptions { seed: 0, shuffle: true, tokens: None }
    }
}

/// An element type of a data file, and what it is held as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Elem {
    F32,
    F64,
    F16,
    I8,
    U8,
    I16,
    U16,
    I32,
    U32,
    I64,
    Bool,
}

impl Elem {
    fn from_descr(d: &str) -> Option<Elem> {
        Some(match d {
            "<f4" => Elem::F32,
            "<f8" => Elem::F64,
            "<f2" => Elem::F16,
            "|i1" => Elem::I8,
            "|u1" => Elem::U8,
            "<i2" => Elem::I16,
            "<u2" => Elem::U16,
            "<i4" => Elem::I32,
            "<u4" => Elem::U32,
            "<i8" => Elem::I64,
            "|b1" => Elem::Bool,
            _ => return None,
        })
    }
    fn bytes(self) -> usize {
        match self {
            Elem::I8 | Elem::U8 | Elem::Bool => 1,
            Elem::F16 | Elem::I16 | Elem::U16 => 2,
            Elem::F32 | Elem::I32 | Elem::U32 => 4,
            Elem::F64 | Elem::I64 => 8,
        }
    }
    /// The dtype autopar holds it as (float16 as f32, narrow integers as i64, as `npy` reads).
    fn dtype(self) -> DType {
        match self {
            Elem::F32 | Elem::F16 => DType::F32,
            Elem::F64 => DType::F64,
            Elem::Bool => DType::Bool,
            _ => DType::I64,
        }
    }
    fn decode(self, b: &[u8]) -> Data {
        fn le<const N: usize, T>(b: &[u8], f: impl Fn([u8; N]) -> T) -> Vec<T> {
            b.chunks_exact(N).map(|c| f(c.try_into().unwrap_or([0; N]))).collect()
        }
        match self {
            Elem::F32 => Data::F32(le(b, f32::from_le_bytes)),
            Elem::F64 => Data::F64(le(b, f64::from_le_bytes)),
            Elem::F16 => Data::F32(le(b, |c| ir::half::f16::from_le_bytes(c).to_f32())),
            Elem::I8 => Data::I64(b.iter().map(|&x| x as i8 as i64).collect()),
            Elem::U8 => Data::I64(b.iter().map(|&x| x as i64).collect()),
            Elem::I16 => Data::I64(le(b, |c| i16::from_le_bytes(c) as i64)),
            Elem::U16 => Data::I64(le(b, |c| u16::from_le_bytes(c) as i64)),
            Elem::I32 => Data::I64(le(b, |c| i32::from_le_bytes(c) as i64)),
            Elem::U32 => Data::I64(le(b, |c| u32::from_le_bytes(c) as i64)),
            Elem::I64 => Data::I64(le(b, i64::from_le_bytes)),
            Elem::Bool => Data::Bool(b.iter().map(|&x| x != 0).collect()),
        }
    }
}

/// One array of samples in a file: rows `first..first + rows` of its column.
#[derive(Clone, Debug)]
struct Shard {
    file: usize,
    /// Byte offset of row 0 in the file.
    offset: u64,
    rows: u64,
    first: u64,
}

/// Where an input's samples are.
#[derive(Clone, Debug)]
enum Column {
    Arrays { shards: Vec<Shard>, elem: Elem, row: Vec<usize> },
    Tokens { file: usize, elem: Elem, seq: usize, shift: u64 },
}

/// Inputs bound to files of samples (see the module docs). Immutable: each rank reads through
/// its own [`Reader`].
#[derive(Debug)]
pub struct Dataset {
    files: Vec<PathBuf>,
    columns: BTreeMap<String, Column>,
    /// The dtype each input takes (a data file's f32 is widened to an f64 input).
    dtypes: BTreeMap<String, DType>,
    samples: u64,
    batch: u64,
    opts: DataOptions,
    description: String,
    /// [`Dataset::content_hash`], computed on first use.
    content: std::sync::OnceLock<Result<String, String>>,
}

/// Where a run is in its data: recorded in checkpoints, checked on resume.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Position {
    /// What was read: the bindings, files (by name) and sizes.
    pub data: String,
    /// Samples per epoch in the files.
    pub samples: u64,
    /// Samples per step.
    pub batch: u64,
    /// The permutation seed.
    pub seed: u64,
    /// Whether epochs are permuted.
    pub shuffle: bool,
    /// The epoch of the next step.
    pub epoch: u64,
    /// The position of the next step's first sample in its epoch's order.
    pub next_sample: u64,
    /// [`Dataset::content_hash`] of the files (empty in positions recorded before it existed:
    /// those resume on names and sizes alone).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub content: String,
}

fn file_err(path: &Path, message: impl std::fmt::Display) -> DataError {
    DataError::File { path: path.to_path_buf(), message: message.to_string() }
}

/// The `.npy` header at `offset` of `f` (an entry of `total` bytes): element type, shape and the
/// byte offset of its data.
fn npy_header(path: &Path, f: &File, offset: u64, total: u64, what: &str) -> Result<(Elem, Vec<u64>, u64), DataError> {
    let mut f = f;
    std::io::Seek::seek(&mut f, std::io::SeekFrom::Start(offset)).map_err(|e| file_err(path, e))?;
    let mut r = std::io::BufReader::new(f).take(total);
    let head = crate::npy::checked_header(path, &mut r, total, what)?;
    let len = head.len() as u64;
    let npy = npyz::NpyFile::new(Cursor::new(head)).map_err(|e| file_err(path, format!("{what}{e}")))?;
    if npy.order() != npyz::Order::C {
        return Err(file_err(path, format!("{what}Fortran-order arrays are not supported")));
    }
    let descr = npy.dtype().descr();
    let descr = descr.trim_matches('\'');
    let elem = Elem::from_descr(descr).ok_or_else(|| {
        file_err(path, format!("{what}element type {descr} is not supported (floats, integers or bool)"))
    })?;
    Ok((elem, npy.shape().to_vec(), offset + len))
}

/// The arrays of `path` (a `.npy`/`.npz` file) for input `name`: element type, shape, data
/// offset.
fn array_in(path: &Path, name: &str) -> Result<(Elem, Vec<u64>, u64), DataError> {
    let f = ir::files::open_regular(path).map_err(|e| file_err(path, e))?;
    let len = f.metadata().map_err(|e| file_err(path, e))?.len();
    if path.extension().is_some_and(|e| e == "npz") {
        let mut zip = zip::ZipArchive::new(&f).map_err(|e| file_err(path, format!("not a .npz archive: {e}")))?;
        let arrays: Vec<String> = zip.file_names().filter_map(|n| n.strip_suffix(".npy")).map(str::to_string).collect();
        let pick = if arrays.iter().any(|a| a == name) {
            name.to_string()
        } else if arrays.len() == 1 {
            arrays[0].clone()
        } else {
            return Err(file_err(path, format!("has no array named {name} (arrays: {})", arrays.join(", "))));
        };
        let e = zip.by_name(&format!("{pick}.npy")).map_err(|e| file_err(path, e))?;
        if e.compression() != zip::CompressionMethod::Stored {
            return Err(file_err(
                path,
                format!(
                    "array {pick} is compressed, which cannot be read by rows: save shards with numpy.savez (not \
                     savez_compressed) or as .npy"
                ),
            ));
        }
        let (start, size) = (e.data_start(), e.size());
        drop(e);
        if start.checked_add(size).is_none_or(|end| end > len) {
            return Err(file_err(path, format!("array {pick} lies outside the file")));
        }
        npy_header(path, &f, start, size, &format!("array {pick}: "))
    } else {
        npy_header(path, &f, 0, len, "")
    }
}

/// The shard files of `path`: the file itself, or a directory's `.npy`/`.npz` files in name
/// order.
fn shard_files(path: &Path) -> Result<Vec<PathBuf>, DataError> {
    let meta = std::fs::metadata(path).map_err(|e| file_err(path, e))?;
    if !meta.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut files = vec![];
    for e in std::fs::read_dir(path).map_err(|e| file_err(path, e))? {
        let p = e.map_err(|e| file_err(path, e))?.path();
        if p.extension().is_some_and(|x| x == "npy" || x == "npz") {
            files.push(p);
        }
    }
    files.sort();
    if files.is_empty() {
        return Err(file_err(path, "has no .npy or .npz shards"));
    }
    Ok(files)
}

/// A token file: anything but a directory or a `.npy`/`.npz` file.
fn is_token_file(path: &Path) -> bool {
    !path.is_dir() && !path.extension().is_some_and(|e| e == "npy" || e == "npz")
}

impl Dataset {
    /// Binds `bindings` to `inputs` (name and the meta one step reads: the global batch of
    /// every microbatch); inputs without a binding are fed otherwise.
    pub fn open(
        bindings: &[Binding],
        inputs: &[(String, TensorMeta)],
        opts: DataOptions,
    ) -> Result<Dataset, DataError> {
        let mut ds = Dataset {
            files: vec![],
            columns: BTreeMap::new(),
            dtypes: BTreeMap::new(),
            samples: 0,
            batch: 0,
            opts,
            description: String::new(),
            content: std::sync::OnceLock::new(),
        };
        let mut parts = vec![];
        let mut counts: Vec<(String, u64)> = vec![];
        for b in bindings {
            let bad = |message: String| DataError::Binding { binding: b.to_string(), message };
            let metas: Vec<&TensorMeta> = b
                .names
                .iter()
                .map(|n| {
                    inputs.iter().find(|(i, _)| i == n).map(|(_, m)| m).ok_or_else(|| {
                        let all: Vec<&str> = inputs.iter().map(|(i, _)| i.as_str()).collect();
                        bad(format!("the graph has no input {n} (inputs: {})", all.join(", ")))
                    })
                })
                .collect::<Result<_, _>>()?;
            for (n, m) in b.names.iter().zip(&metas) {
                if ds.columns.contains_key(n) {
                    return Err(bad(format!("input {n} is bound twice")));
                }
                if m.shape.is_empty() {
                    return Err(bad(format!("input {n} is a scalar; data feeds inputs whose first dim is the batch")));
                }
                let rows = m.shape[0] as u64;
                if ds.batch != 0 && rows != ds.batch {
                    return Err(bad(format!("input {n} takes {rows} samples per step, other inputs {}", ds.batch)));
                }
                ds.batch = rows;
            }
            let part = if is_token_file(&b.path) {
                ds.bind_tokens(b, &metas, &mut counts)?
            } else {
                ds.bind_arrays(b, &metas, &mut counts)?
            };
            parts.push(part);
        }
        let Some((first_name, samples)) = counts.first().cloned() else {
            return Err(DataError::Binding { binding: String::new(), message: "no inputs are bound".into() });
        };
        if let Some((n, c)) = counts.iter().find(|(_, c)| *c != samples) {
            return Err(DataError::Binding {
                binding: n.clone(),
                message: format!("{c} samples, but {first_name} has {samples}: every input needs one row per sample"),
            });
        }
        if samples < ds.batch {
            return Err(DataError::Binding {
                binding: first_name,
                message: format!("{samples} samples, fewer than one step's batch of {}", ds.batch),
            });
        }
        ds.samples = samples;
        ds.description = parts.join("; ");
        Ok(ds)
    }

    /// A token file bound to the inputs of `metas` (a second input reads the next tokens): its
    /// columns and sample counts; returns its description.
    fn bind_tokens(
        &mut self,
        b: &Binding,
        metas: &[&TensorMeta],
        counts: &mut Vec<(String, u64)>,
    ) -> Result<String, DataError> {
        let bad = |message: String| DataError::Binding { binding: b.to_string(), message };
        let file = self.files.len();
        let f = ir::files::open_regular(&b.path).map_err(|e| file_err(&b.path, e))?;
        let len = f.metadata().map_err(|e| file_err(&b.path, e))?.len();
        let width = self.opts.tokens.unwrap_or(if b.path.extension().is_some_and(|e| e == "txt") {
            TokenType::U8
        } else {
            TokenType::U16
        });
        let elem = match width {
            TokenType::U8 => Elem::U8,
            TokenType::U16 => Elem::U16,
            TokenType::U32 => Elem::U32,
        };
        let tokens = len / width.bytes() as u64;
        let shift = b.names.len() as u64 - 1;
        for (k, (n, m)) in b.names.iter().zip(metas).enumerate() {
            if m.shape.len() != 2 || m.dtype != DType::I64 {
                return Err(bad(format!(
                    "input {n} is {m}; a token file feeds integer inputs of shape [batch, sequence]"
                )));
            }
            let seq = m.shape[1];
            if seq == 0 {
                return Err(bad(format!("input {n} has sequences of length 0")));
            }
            if k == 1 && seq != metas[0].shape[1] {
                return Err(bad(format!("inputs {} and {n} differ in sequence length", b.names[0])));
            }
            let samples = tokens.saturating_sub(shift) / seq as u64;
            self.columns.insert(n.clone(), Column::Tokens { file, elem, seq, shift: k as u64 });
            self.dtypes.insert(n.clone(), DType::I64);
            counts.push((n.clone(), samples));
        }
        let name = b.path.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        let width = match width {
            TokenType::U8 => "byte",
            TokenType::U16 => "uint16",
            TokenType::U32 => "uint32",
        };
        self.files.push(b.path.clone());
        Ok(format!("{}: {name} ({tokens} {width} tokens)", b.names.join(",")))
    }

    /// The `.npy`/`.npz` shards bound to one input: its column and sample count; returns its
    /// description.
    fn bind_arrays(
        &mut self,
        b: &Binding,
        metas: &[&TensorMeta],
        counts: &mut Vec<(String, u64)>,
    ) -> Result<String, DataError> {
        let bad = |message: String| DataError::Binding { binding: b.to_string(), message };
        if b.names.len() != 1 {
            return Err(bad("only a token file feeds two inputs (the second the next tokens)".into()));
        }
        let (n, m) = (&b.names[0], metas[0]);
        let want_row: Vec<u64> = m.shape[1..].iter().map(|&d| d as u64).collect();
        if want_row.contains(&0) {
            return Err(bad(format!("input {n} is {m}: samples of no elements cannot be read")));
        }
        let mut shards = vec![];
        let mut first = 0u64;
        let mut elem = None;
        let mut names = vec![];
        for path in shard_files(&b.path)? {
            let (e, shape, offset) = array_in(&path, n)?;
            if shape.is_empty() || shape[1..] != want_row[..] {
                return Err(bad(format!(
                    "{} holds an array of shape {shape:?}; input {n} takes samples of shape {want_row:?} (the \
                     first dim counts samples)",
                    path.display()
                )));
            }
            if elem.is_some_and(|x| x != e) {
                return Err(bad(format!("{} holds another element type than the shards before it", path.display())));
            }
            elem = Some(e);
            let (dt, want) = (e.dtype(), m.dtype);
            if dt != want && !crate::values::widens(dt, want) {
                return Err(bad(format!("{} holds {dt} values; input {n} is {want}", path.display())));
            }
            shards.push(Shard { file: self.files.len(), offset, rows: shape[0], first });
            // Rows are bounded by the file's bytes (the header check) and have bytes: no
            // overflow short of 2^64 bytes of files.
            first = first.checked_add(shape[0]).ok_or_else(|| bad("more than 2^64 samples".into()))?;
            names.push(format!(
                "{} ({} rows)",
                path.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default(),
                shape[0]
            ));
            self.files.push(path);
        }
        let Some(elem) = elem else { return Err(bad("no shards".into())) };
        counts.push((n.clone(), first));
        self.dtypes.insert(n.clone(), m.dtype);
        self.columns.insert(n.clone(), Column::Arrays { shards, elem, row: m.shape[1..].to_vec() });
        Ok(format!("{n}: {}", names.join(", ")))
    }

    /// The inputs it feeds.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.columns.keys().map(String::as_str)
    }

    /// Samples in the files (one epoch).
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// Samples per step.
    pub fn batch(&self) -> u64 {
        self.batch
    }

    /// Steps per epoch (the last incomplete batch dropped).
    pub fn steps_per_epoch(&self) -> u64 {
        self.samples / self.batch.max(1)
    }

    /// Bytes of one step's global batch in the files (every bound input's rows).
    pub fn bytes_per_step(&self) -> u64 {
        let row = |c: &Column| match c {
            Column::Arrays { elem, row, .. } => row.iter().product::<usize>() * elem.bytes(),
            Column::Tokens { elem, seq, .. } => seq * elem.bytes(),
        };
        self.columns.values().map(|c| row(c) as u64 * self.batch).sum()
    }

    /// Tokens in a sample when an input reads a token file (its sequence length).
    pub fn tokens_per_sample(&self) -> Option<usize> {
        self.columns.values().find_map(|c| match c {
            Column::Tokens { seq, shift: 0, .. } => Some(*seq),
            _ => None,
        })
    }

    /// The options it was opened with.
    pub fn options(&self) -> DataOptions {
        self.opts
    }

    /// The bindings and files, one line.
    pub fn description(&self) -> &str {
        &self.description
    }

    /// A hash of what the batches depend on (the files by name and size, samples, batch, seed,
    /// order): every process of a run must see the same.
    pub fn fingerprint(&self) -> i64 {
        let text =
            format!("{}|{}|{}|{}|{}", self.description, self.samples, self.batch, self.opts.seed, self.opts.shuffle);
        // FNV-1a.
        let h = text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
        h as i64
    }

    /// A hash of the files' contents, in binding order: two CRC-32s (of the bytes, and of the
    /// bytes with another initial value) and the length of each file, read once per dataset as
    /// a stream of 1 MiB blocks (never whole in memory), on first use: by the first checkpoint,
    /// save or resume of a run. A file changed in place, or another file under the same name
    /// and size, gives another hash.
    pub fn content_hash(&self) -> Result<String, DataError> {
        let r = self.content.get_or_init(|| {
            let mut buf = vec![0u8; 1 << 20];
            let mut parts = vec![];
            for path in &self.files {
                let mut f = ir::files::open_regular(path).map_err(|e| format!("{}: {e}", path.display()))?;
                let (mut a, mut b) = (crc32fast::Hasher::new(), crc32fast::Hasher::new_with_initial(0x5bd1_e995));
                let mut len = 0u64;
                loop {
                    let k = f.read(&mut buf).map_err(|e| format!("{}: hashing its contents: {e}", path.display()))?;
                    if k == 0 {
                        break;
                    }
                    a.update(&buf[..k]);
                    b.update(&buf[..k]);
                    len += k as u64;
                }
                parts.push(format!("{:08x}{:08x}:{len}", a.finalize(), b.finalize()));
            }
            Ok(parts.join(","))
        });
        r.clone().map_err(|message| DataError::File { path: PathBuf::new(), message })
    }

    /// Where a run that has done `steps_done` steps is (with the contents' hash: the files are
    /// read once, see [`Dataset::content_hash`]).
    pub fn position(&self, steps_done: u64) -> Result<Position, DataError> {
        let e = self.steps_per_epoch().max(1);
        Ok(Position {
            data: self.description.clone(),
            samples: self.samples,
            batch: self.batch,
            seed: self.opts.seed,
            shuffle: self.opts.shuffle,
            epoch: steps_done / e,
            next_sample: (steps_done % e) * self.batch,
            content: self.content_hash()?,
        })
    }

    /// Why a run of this dataset cannot continue from a checkpoint recorded at `p` after
    /// `steps_done` steps (`None`: it can).
    pub fn resumes(&self, p: &Position, steps_done: u64) -> Option<String> {
        let mut here = match self.position(steps_done) {
            Ok(h) => h,
            Err(e) => return Some(format!("its data cannot be compared with this run's: {e}")),
        };
        if p.content.is_empty() {
            // Recorded before contents were hashed.
            here.content.clear();
        }
        if here == *p {
            return None;
        }
        let what = if p.data != here.data {
            format!("read {} and this run reads {}", p.data, here.data)
        } else if p.content != here.content {
            format!(
                "read files of the same names and sizes but other contents ({} then, {} now): the data changed",
                p.content, here.content
            )
        } else if (p.seed, p.shuffle) != (here.seed, here.shuffle) {
            let order =
                |s: bool, seed: u64| if s { format!("shuffled with seed {seed}") } else { "in file order".into() };
            format!("read its data {}, this run {}", order(p.shuffle, p.seed), order(here.shuffle, here.seed))
        } else {
            format!(
                "is at sample {} of epoch {} with batch {}; this run would be at sample {} of epoch {} with batch {}",
                p.next_sample, p.epoch, p.batch, here.next_sample, here.epoch, here.batch
            )
        };
        Some(format!("the checkpoint's run {what}: pass the same --data and --data-seed"))
    }

    /// A reader for one rank.
    pub fn reader(&self) -> Reader<'_> {
        Reader { ds: self, files: HashMap::new(), order: None, bytes: 0, buf: vec![] }
    }
}

/// SplitMix64's finaliser: the Feistel rounds' mixing function.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Rounds of the Feistel network: 4 make a pseudo-random permutation (Luby–Rackoff); 6 for margin.
const ROUNDS: usize = 6;

/// The sample order of one epoch: `0..n`, or a permutation of it drawn from the seed and the
/// epoch, as a function of the position (O(1) memory, whatever `n`: a 64 GiB token file has
/// billions of samples).
///
/// The permutation is a balanced Feistel network over the `2k`-bit integers (`4^k >= n`, the
/// smallest such `k`) keyed by the seed and the epoch, walked in cycles until it lands in
/// `[0, n)` ("cycle-walking"): a bijection of `[0, 2^2k)` restricted to `[0, n)` this way is a
/// bijection of `[0, n)`, and since `4^k < 4n`, a position takes fewer than 4 walks on average.
#[derive(Clone, Debug)]
pub struct EpochOrder {
    n: u64,
    shuffle: bool,
    half: u32,
    keys: [u64; ROUNDS],
}

impl EpochOrder {
    /// Epoch `epoch`'s order of `n` samples (`shuffle == false`: file order).
    pub fn new(n: u64, seed: u64, epoch: u64, shuffle: bool) -> EpochOrder {
        let bits = (64 - n.saturating_sub(1).leading_zeros()).max(2);
        let half = bits.div_ceil(2);
        let mut keys = [0u64; ROUNDS];
        let mut z = mix(seed ^ epoch.wrapping_mul(0xd1b5_4a32_d192_ed03));
        for k in &mut keys {
            z = mix(z);
            *k = z;
        }
        EpochOrder { n, shuffle, half, keys }
    }

    /// One pass of the network over `[0, 4^half)`.
    fn permute(&self, x: u64) -> u64 {
        let mask = (1u64 << self.half) - 1;
        let (mut l, mut r) = (x >> self.half, x & mask);
        for k in &self.keys {
            (l, r) = (r, l ^ (mix(r ^ k) & mask));
        }
        (l << self.half) | r
    }

    /// The sample at position `i` (`i < n`) of the order.
    pub fn at(&self, i: u64) -> u64 {
        if !self.shuffle || self.n <= 1 {
            return i;
        }
        let mut y = self.permute(i);
        while y >= self.n {
            y = self.permute(y);
        }
        y
    }
}

/// Files a [`Reader`] keeps open (every rank thread has its own reader).
const MAX_OPEN_FILES: usize = 32;

/// One rank's reads of a [`Dataset`]: its open files, the current epoch's order and the bytes
/// read so far.
pub struct Reader<'d> {
    ds: &'d Dataset,
    files: HashMap<usize, File>,
    order: Option<(u64, EpochOrder)>,
    bytes: u64,
    buf: Vec<u8>,
}

impl Reader<'_> {
    /// Whether the dataset feeds input `name`.
    pub fn binds(&self, name: &str) -> bool {
        self.ds.columns.contains_key(name)
    }

    /// Bytes read from the files so far.
    pub fn bytes_read(&self) -> u64 {
        self.bytes
    }

    /// Samples `a..a + n` of step `step`'s global batch (0-based step), in batch order.
    pub fn rows(&mut self, step: u64, a: u64, n: u64) -> Result<Vec<u64>, DataError> {
        let ds = self.ds;
        if a.checked_add(n).is_none_or(|end| end > ds.batch) {
            return Err(DataError::Binding {
                binding: String::new(),
                message: format!("rows {a}..{} of a batch of {}", a.saturating_add(n), ds.batch),
            });
        }
        let per = ds.steps_per_epoch().max(1);
        let (epoch, at) = (step / per, (step % per) * ds.batch + a);
        if self.order.as_ref().is_none_or(|(e, _)| *e != epoch) {
            self.order = Some((epoch, EpochOrder::new(ds.samples, ds.opts.seed, epoch, ds.opts.shuffle)));
        }
        let order = self
            .order
            .as_ref()
            .map(|(_, o)| o)
            .ok_or_else(|| DataError::Binding { binding: String::new(), message: "no epoch order".into() })?;
        Ok((at..at + n).map(|i| order.at(i)).collect())
    }

    /// Reads `len` bytes at `at` of file `file` (keeping at most [`MAX_OPEN_FILES`] open).
    fn read(&mut self, file: usize, at: u64, len: usize) -> Result<(), DataError> {
        let ds = self.ds;
        let path = &ds.files[file];
        if self.files.len() >= MAX_OPEN_FILES && !self.files.contains_key(&file) {
            // Shuffled reads of many shards: close them all rather than run out of descriptors.
            self.files.clear();
        }
        let f = match self.files.entry(file) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(ir::files::open_regular(path).map_err(|e| file_err(path, e))?)
            }
        };
        self.buf.resize(len, 0);
        f.read_exact_at(&mut self.buf, at)
            .map_err(|e| file_err(path, format!("reading {len} bytes at {at}: {e} (was the file truncated?)")))?;
        self.bytes += len as u64;
        Ok(())
    }

    /// The block at `offsets` of size `size` of input `name`'s global batch at `step`: the rows
    /// `offsets[0]..+size[0]` of the batch, each cut to the rest of the block.
    pub fn block(&mut self, name: &str, step: u64, offsets: &[usize], size: &[usize]) -> Result<Tensor, DataError> {
        let ds = self.ds;
        let bad = |message: String| DataError::Binding { binding: name.to_string(), message };
        let (col, dtype) = match (ds.columns.get(name), ds.dtypes.get(name)) {
            (Some(c), Some(d)) => (c, *d),
            _ => return Err(bad("is not bound to data".into())),
        };
        let (elem, row): (Elem, Vec<usize>) = match col {
            Column::Arrays { elem, row, .. } => (*elem, row.clone()),
            Column::Tokens { elem, seq, .. } => (*elem, vec![*seq]),
        };
        if offsets.len() != row.len() + 1 || size.len() != offsets.len() {
            return Err(bad(format!("a block of rank {} for samples of rank {}", offsets.len(), row.len())));
        }
        let rows = self.rows(step, offsets[0] as u64, size[0] as u64).map_err(|e| match e {
            DataError::Binding { message, .. } => bad(message),
            e => e,
        })?;
        let whole = offsets[1..].iter().all(|&o| o == 0) && size[1..] == row[..];
        let row_elems: usize = row.iter().product();
        let row_bytes = row_elems * elem.bytes();
        let mut parts = Vec::with_capacity(rows.len());
        for i in rows {
            let (file, at) = match col {
                Column::Arrays { shards, .. } => {
                    let k = shards.partition_point(|s| s.first + s.rows <= i);
                    let s = shards.get(k).ok_or_else(|| bad(format!("sample {i} is past the last shard")))?;
                    (s.file, s.offset + (i - s.first) * row_bytes as u64)
                }
                Column::Tokens { file, seq, shift, .. } => (*file, (i * *seq as u64 + shift) * elem.bytes() as u64),
            };
            self.read(file, at, row_bytes)?;
            let mut shape = vec![1];
            shape.extend(&row);
            let t = Tensor::new(shape, elem.decode(&self.buf)).map_err(|e| bad(e.to_string()))?;
            let t = if whole {
                t
            } else {
                let mut off = vec![0];
                off.extend(&offsets[1..]);
                let mut sz = vec![1];
                sz.extend(&size[1..]);
                sharding::sim::checked_block(&t, &off, &sz).map_err(|e| bad(e.to_string()))?
            };
            parts.push(t);
        }
        let t = if parts.is_empty() {
            Tensor::zeros(&TensorMeta::new(elem.dtype(), size.to_vec())).map_err(|e| bad(e.to_string()))?
        } else {
            sharding::sim::concat(&parts, 0).map_err(|e| bad(e.to_string()))?
        };
        Ok(if t.dtype() != dtype { t.with_float_type(dtype) } else { t })
    }

    /// Every bound input's whole global batch at `step` (one device: `autopar train`).
    pub fn batch(&mut self, step: u64, inputs: &[(String, TensorMeta)]) -> Result<BTreeMap<String, Tensor>, DataError> {
        let mut out = BTreeMap::new();
        for (name, meta) in inputs {
            if self.ds.columns.contains_key(name) {
                let zero = vec![0; meta.shape.len()];
                out.insert(name.clone(), self.block(name, step, &zero, &meta.shape)?);
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(n: u64, seed: u64, epoch: u64, shuffle: bool) -> Vec<u64> {
        let o = EpochOrder::new(n, seed, epoch, shuffle);
        (0..n).map(|i| o.at(i)).collect()
    }

    #[test]
    fn every_epoch_is_a_permutation_and_differs() {
        for n in [1u64, 2, 3, 5, 17, 64, 100, 1000, 4097] {
            let a = order(n, 7, 0, true);
            let mut s = a.clone();
            s.sort();
            assert_eq!(s, (0..n).collect::<Vec<_>>(), "n = {n}");
        }
        let (a, b) = (order(1000, 7, 0, true), order(1000, 7, 1, true));
        assert_ne!(a, b);
        assert_ne!(a, order(1000, 8, 0, true));
        assert_eq!(a, order(1000, 7, 0, true));
        assert_eq!(order(5, 7, 3, false), vec![0, 1, 2, 3, 4]);
    }

    /// Shuffle quality: where position `i` lands is spread evenly over the samples (a chi-square
    /// test of position against sample, in deciles, over many epochs), and no order keeps its
    /// neighbours together (the mean displacement of a random permutation is about n/3).
    #[test]
    fn shuffled_orders_are_spread_evenly() {
        let (n, epochs, bins) = (1000u64, 200u64, 10usize);
        // counts[position decile][sample decile]
        let mut counts = vec![vec![0f64; bins]; bins];
        for e in 0..epochs {
            let o = order(n, 3, e, true);
            let disp: f64 = o.iter().enumerate().map(|(i, &s)| (i as f64 - s as f64).abs()).sum::<f64>() / n as f64;
            assert!((disp - n as f64 / 3.0).abs() < n as f64 / 15.0, "epoch {e}: mean displacement {disp}");
            let adjacent = o.windows(2).filter(|w| w[0].abs_diff(w[1]) == 1).count();
            assert!(adjacent < 12, "epoch {e}: {adjacent} neighbours stay together");
            for (i, &s) in o.iter().enumerate() {
                counts[i * bins / n as usize][s as usize * bins / n as usize] += 1.0;
            }
        }
        let expected = (n * epochs) as f64 / (bins * bins) as f64;
        let chi2: f64 = counts.iter().flatten().map(|&c| (c - expected).powi(2) / expected).sum();
        // 81 degrees of freedom: the 99.9th percentile of chi-square(81) is about 126.
        assert!(chi2 < 126.0, "chi-square {chi2:.1} over 81 degrees of freedom");
    }

    #[test]
    fn orders_of_billions_of_samples_take_no_memory() {
        // A 64 GiB uint16 token file cut into sequences of 8: 4 * 2^30 samples.
        let n = 4u64 << 30;
        let o = EpochOrder::new(n, 1, 0, true);
        let mut seen = std::collections::HashSet::new();
        for i in (0..n).step_by((n / 1000) as usize) {
            let s = o.at(i);
            assert!(s < n && seen.insert(s));
        }
        assert_eq!(EpochOrder::new(n, 1, 0, false).at(n - 1), n - 1);
    }

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("autopar-data-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn ints(rows: std::ops::Range<i64>, width: i64) -> Tensor {
        let n = (rows.end - rows.start) as usize;
        Tensor::i64(vec![n, width as usize], rows.flat_map(|r| (0..width).map(move |c| r * 10 + c)).collect())
    }

    fn meta(shape: &[usize]) -> TensorMeta {
        TensorMeta::new(DType::I64, shape.to_vec())
    }

    fn unshuffled() -> DataOptions {
        DataOptions { shuffle: false, ..DataOptions::default() }
    }

    #[test]
    fn shards_are_read_by_rows_and_blocks() {
        let d = dir("shards");
        crate::npy::write_npy(&d.join("a.npy"), &ints(0..3, 3)).unwrap();
        crate::npy::write_npy(&d.join("b.npy"), &ints(3..9, 3)).unwrap();
        let b: Binding = format!("x={}", d.display()).parse().unwrap();
        let ds = Dataset::open(&[b], &[("x".into(), meta(&[4, 3]))], unshuffled()).unwrap();
        assert_eq!((ds.samples(), ds.steps_per_epoch(), ds.bytes_per_step()), (9, 2, 4 * 3 * 8));
        let mut r = ds.reader();
        // Step 1 is rows 4..8; its rows 1..3 (samples 5, 6, across no boundary) and columns 1..3.
        let t = r.block("x", 1, &[1, 1], &[2, 2]).unwrap();
        assert_eq!(t.to_i64_vec(), vec![51, 52, 61, 62]);
        assert_eq!(r.bytes_read(), 2 * 3 * 8);
        // Step 2 wraps to epoch 1 (the 9th sample is dropped): rows 0..4 across both shards.
        let t = r.block("x", 2, &[0, 0], &[4, 3]).unwrap();
        assert_eq!(t.to_i64_vec(), ints(0..4, 3).to_i64_vec());
        std::fs::remove_dir_all(&d).ok();
    }

    #[test]
    fn a_second_input_of_a_token_file_reads_the_next_tokens() {
        let d = dir("tokens");
        let bin = d.join("t.bin");
        std::fs::write(&bin, (0..50u16).flat_map(u16::to_le_bytes).collect::<Vec<u8>>()).unwrap();
        let b: Binding = format!("ids,labels={}", bin.display()).parse().unwrap();
        let inputs = [("ids".into(), meta(&[2, 5])), ("labels".into(), meta(&[2, 5]))];
        let ds = Dataset::open(&[b], &inputs, unshuffled()).unwrap();
        // 49 tokens have a next one: 9 sequences of 5.
        assert_eq!(ds.samples(), 9);
        let f = ds.reader().batch(1, &inputs).unwrap();
        assert_eq!(f["ids"].to_i64_vec(), (10..20).collect::<Vec<i64>>());
        assert_eq!(f["labels"].to_i64_vec(), (11..21).collect::<Vec<i64>>());
        std::fs::remove_dir_all(&d).ok();
    }

    #[test]
    fn stored_npz_entries_are_read_and_compressed_ones_refused() {
        use std::io::Write;
        let d = dir("npz");
        crate::npy::write_npy(&d.join("x.npy"), &ints(0..4, 2)).unwrap();
        let npy = std::fs::read(d.join("x.npy")).unwrap();
        for (name, method) in
            [("stored.npz", zip::CompressionMethod::Stored), ("deflated.npz", zip::CompressionMethod::Deflated)]
        {
            let mut z = zip::ZipWriter::new(std::fs::File::create(d.join(name)).unwrap());
            z.start_file("other.npy", zip::write::FileOptions::default().compression_method(method)).unwrap();
            z.write_all(&npy).unwrap();
            z.start_file("x.npy", zip::write::FileOptions::default().compression_method(method)).unwrap();
            z.write_all(&npy).unwrap();
            z.finish().unwrap();
        }
        let inputs = [("x".into(), meta(&[2, 2]))];
        let b: Binding = format!("x={}", d.join("stored.npz").display()).parse().unwrap();
        let ds = Dataset::open(&[b], &inputs, unshuffled()).unwrap();
        assert_eq!(ds.reader().batch(1, &inputs).unwrap()["x"].to_i64_vec(), vec![20, 21, 30, 31]);
        let b: Binding = format!("x={}", d.join("deflated.npz").display()).parse().unwrap();
        let e = Dataset::open(&[b], &inputs, unshuffled()).unwrap_err().to_string();
        assert!(e.contains("compressed"), "{e}");
        std::fs::remove_dir_all(&d).ok();
    }

    #[test]
    fn data_that_does_not_fit_the_inputs_is_refused() {
        let d = dir("bad");
        crate::npy::write_npy(&d.join("x.npy"), &ints(0..6, 3)).unwrap();
        crate::npy::write_npy(&d.join("y.npy"), &ints(0..5, 3)).unwrap();
        let bind = |s: &str| -> Binding { s.parse().unwrap() };
        let (x, y) = (format!("x={}", d.join("x.npy").display()), format!("y={}", d.join("y.npy").display()));
        type Case<'a> = (Vec<Binding>, Vec<(String, TensorMeta)>, &'a str);
        let cases: Vec<Case> = vec![
            (vec![bind(&x)], vec![("x".into(), meta(&[2, 4]))], "takes samples of shape [4]"),
            (vec![bind(&x), bind(&y.replace("y=", "x="))], vec![("x".into(), meta(&[2, 3]))], "bound twice"),
            (vec![bind(&x), bind(&y)], vec![("x".into(), meta(&[2, 3])), ("y".into(), meta(&[2, 3]))], "5 samples"),
            (vec![bind(&x)], vec![("x".into(), meta(&[8, 3]))], "fewer than one step's batch of 8"),
            (vec![bind(&x)], vec![("x".into(), TensorMeta::new(DType::F32, vec![2, 3]))], "holds i64 values"),
            (vec![bind(&x)], vec![("z".into(), meta(&[2, 3]))], "no input x"),
        ];
        for (b, inputs, says) in cases {
            let e = Dataset::open(&b, &inputs, unshuffled()).unwrap_err().to_string();
            assert!(e.contains(says), "{says}: {e}");
        }
        std::fs::remove_dir_all(&d).ok();
    }

    #[test]
    fn bindings_parse() {
        let b: Binding = "input_ids,labels=train.bin".parse().unwrap();
        assert_eq!(b.names, ["input_ids", "labels"]);
        assert!("x".parse::<Binding>().is_err());
        assert!("=f".parse::<Binding>().is_err());
        assert!("a,b,c=f".parse::<Binding>().is_err());
    }
}
