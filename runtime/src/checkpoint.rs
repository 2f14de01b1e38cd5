//! Sharded, atomic checkpoints of a distributed run.
//!
//! Layout of a checkpoint directory `DIR`:
//!
//! ```text
//! DIR/LATEST                          the name of the newest complete checkpoint, one line
//! DIR/ckpt-00000003-<run>/manifest.json   step, model and plan hash, mesh, and every rank file's size and CRC-32
//! DIR/ckpt-00000003-<run>/rank-00000.npz  rank 0's shard header and blocks of every parameter and optimizer state
//! ...
//! ```
//!
//! Every shard holds its own identity: an int64 array [`HEADER`] of `[magic, version, rank,
//! step, plan hash, check]`, where `check` is a hash of the five before it (and the archive's
//! CRC-32 covers the entry as well). The manifest's CRCs catch a damaged file; the header
//! catches a whole, intact shard in the wrong place: swapped between ranks, copied from another
//! step or from a run of another plan (even with the manifest's CRCs recomputed to match). The
//! plan hash is [`Program::plan_hash`]: what the blocks depend on, so a re-made identical plan
//! resumes.
//!
//! Writing is atomic: every rank writes (and syncs) its file into a temporary directory
//! `DIR/.tmp-ckpt-...`; once all ranks have written (a barrier that also hands rank 0 the
//! checksums), rank 0 writes the manifest, renames the directory to its final name, and then
//! replaces `LATEST` by writing `LATEST.tmp` and renaming it. A run killed at any point leaves
//! `LATEST` naming a complete checkpoint (or no `LATEST` at all); unfinished temporary
//! directories are ignored and removed by the next writer. The newest two complete checkpoints
//! are kept.
//!
//! Reading checks that `LATEST` names a directory directly inside `DIR` (one path component,
//! symbolic links resolved: never a path elsewhere), the manifest's model hash, plan hash and
//! mesh against the plan, that every rank file is named as written, each file's size and
//! CRC-32, each shard header's rank, step and plan hash, and that every parameter and state
//! block is there with its local shape. Only regular files are read. Checkpoints of format
//! version 1 (no shard headers) are refused as too old.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Component, Path, PathBuf};

use ir::Tensor;
use serde::{Deserialize, Serialize};

use crate::comm::Communicator;
use crate::error::DistError;
use crate::npy::{read_npz, write_npz};
use crate::program::{Program, RankState};

/// The manifest's format name.
pub const FORMAT: &str = "autopar-checkpoint";
/// The manifest's version (2: shard headers and the plan hash).
pub const VERSION: u32 = 2;

/// Name of the shard header array in a rank file (see the module docs).
pub const HEADER: &str = "__autopar_shard_header__";

/// First word of a shard header ("APCKPT" and the format version, as bytes).
const MAGIC: i64 = 0x4150_434b_5054_0002;

/// One rank's file in a checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankFile {
    /// The rank.
    pub rank: usize,
    /// File name inside the checkpoint directory.
    pub file: String,
    /// Size in bytes.
    pub bytes: u64,
    /// CRC-32 (IEEE) of the file.
    pub crc32: u32,
}

/// `manifest.json` of a checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`FORMAT`].
    pub format: String,
    /// [`VERSION`].
    pub version: u32,
    /// Steps done when it was written.
    pub step: u64,
    /// The plan's model hash.
    pub model_hash: String,
    /// [`Program::plan_hash`] of the plan that wrote it.
    pub plan_hash: String,
    /// The mesh shape.
    pub mesh: Vec<usize>,
    /// One file per rank.
    pub files: Vec<RankFile>,
    /// Where the run is in its dataset (runs with `--data`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<crate::data::Position>,
    /// The seed the run drew its dropout masks from (plans with dropout): a resumed run must
    /// draw from the same to continue the same masks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
}

fn err(path: &Path, m: impl std::fmt::Display) -> DistError {
    DistError::Checkpoint(format!("{}: {m}", path.display()))
}

fn crc_of(path: &Path) -> Result<(u64, u32), DistError> {
    let mut f = ir::files::open_regular(path).map_err(|e| err(path, e))?;
    let mut h = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let k = f.read(&mut buf).map_err(|e| err(path, e))?;
        if k == 0 {
            break;
        }
        h.update(&buf[..k]);
        n += k as u64;
    }
    Ok((n, h.finalize()))
}

fn sync_dir(dir: &Path) {
    // Directory fsync makes the renames durable; not every platform allows opening a directory.
    if let Ok(f) = std::fs::File::open(dir) {
        let _ = f.sync_all();
    }
}

fn rank_file(rank: usize) -> String {
    format!("rank-{rank:05}.npz")
}

/// Plan hashes are 16 hex digits ([`Program::plan_hash`]).
fn hash_word(hex: &str) -> Result<i64, DistError> {
    u64::from_str_radix(hex, 16)
        .map(|h| h as i64)
        .map_err(|_| DistError::Checkpoint(format!("plan hash `{hex}` is not 16 hex digits")))
}

/// The header's check word: FNV-1a of the other five words' bytes.
fn check_word(words: &[i64]) -> i64 {
    let bytes = words.iter().flat_map(|w| w.to_le_bytes());
    bytes.fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)) as i64
}

/// The shard header of `rank` after `step` (see the module docs).
fn header(rank: usize, step: u64, plan_hash: &str) -> Result<Tensor, DistError> {
    let mut words = vec![MAGIC, VERSION as i64, rank as i64, step as i64, hash_word(plan_hash)?];
    words.push(check_word(&words));
    Ok(Tensor::i64(vec![words.len()], words))
}

/// Checks a shard's header against where it is read: rank `rank` of checkpoint `m`, `program`.
fn check_header(
    path: &Path,
    t: Option<&Tensor>,
    rank: usize,
    m: &Manifest,
    program: &Program,
) -> Result<(), DistError> {
    let t = t.ok_or_else(|| err(path, "has no shard header (checkpoint format too old, or not a shard)"))?;
    let words = match t.data() {
        ir::Data::I64(v) if t.shape() == [6] => v.as_slice(),
        _ => return Err(err(path, format!("its shard header is {}, not 6 int64 words", t.meta()))),
    };
    if words[0] != MAGIC || words[5] != check_word(&words[..5]) {
        return Err(err(path, "its shard header is damaged (bad magic or check word)"));
    }
    if words[1] != VERSION as i64 {
        return Err(err(path, format!("shard format version {}; this autopar reads {VERSION}", words[1])));
    }
    if words[2] != rank as i64 {
        return Err(err(
            path,
            format!("holds the blocks of rank {}, not of rank {rank} (shard files swapped or renamed?)", words[2]),
        ));
    }
    if words[3] != m.step as i64 {
        return Err(err(path, format!("is a shard of step {}, but the checkpoint is of step {}", words[3], m.step)));
    }
    if words[4] != hash_word(&program.plan_hash)? {
        return Err(err(path, format!("was written for another plan (plan hash {:016x})", words[4] as u64)));
    }
    Ok(())
}

/// Writes this rank's part of the checkpoint after step `st.steps_done`, and (rank 0) completes
/// it. `run` names this run's temporary directories; every rank must pass the same one. `fault`
/// stops the process after this rank's file is written, as a kill mid-write would (tests).
pub fn write(
    dir: &Path,
    run: &str,
    program: &Program,
    st: &RankState,
    comm: &mut dyn Communicator,
    data: Option<&crate::data::Position>,
    exit_mid_write: bool,
) -> Result<PathBuf, DistError> {
    let step = st.steps_done;
    let name = format!("ckpt-{step:08}-{run}");
    let tmp = dir.join(format!(".tmp-{name}"));
    std::fs::create_dir_all(&tmp).map_err(|e| err(&tmp, e))?;
    let file = tmp.join(rank_file(st.rank));
    if st.storage.contains_key(HEADER) {
        return Err(err(&file, format!("a parameter is named {HEADER}, the name of the shard header")));
    }
    let head = (HEADER.to_string(), header(st.rank, step, &program.plan_hash)?);
    write_npz(&file, std::iter::once((&head.0, &head.1)).chain(&st.storage)).map_err(|e| err(&file, e))?;
    std::fs::File::open(&file).and_then(|f| f.sync_all()).map_err(|e| err(&file, e))?;
    let (bytes, crc) = crc_of(&file)?;
    if exit_mid_write {
        eprintln!("rank {}: injected fault: exiting while checkpoint {name} is being written", st.rank);
        std::process::exit(137);
    }
    let everyone: Vec<usize> = (0..program.ranks()).collect();
    let sums = comm.exchange(&everyone, std::sync::Arc::new(Tensor::i64(vec![2], vec![bytes as i64, crc as i64])))?;
    let done = dir.join(&name);
    if st.rank == 0 {
        let files = sums
            .iter()
            .enumerate()
            .map(|(rank, t)| {
                let v = t.to_i64_vec();
                RankFile { rank, file: rank_file(rank), bytes: v[0] as u64, crc32: v[1] as u32 }
            })
            .collect();
        let m = Manifest {
            format: FORMAT.into(),
            version: VERSION,
            step,
            model_hash: program.model_hash.clone(),
            plan_hash: program.plan_hash.clone(),
            mesh: program.mesh().shape().to_vec(),
            files,
            data: data.cloned(),
            seed: program.draws().then(|| program.seed()),
        };
        let mpath = tmp.join("manifest.json");
        let text = serde_json::to_string_pretty(&m).map_err(|e| err(&mpath, e))?;
        std::fs::write(&mpath, text + "\n").map_err(|e| err(&mpath, e))?;
        std::fs::File::open(&mpath).and_then(|f| f.sync_all()).map_err(|e| err(&mpath, e))?;
        sync_dir(&tmp);
        std::fs::rename(&tmp, &done).map_err(|e| err(&done, e))?;
        let previous = latest_name(dir);
        let lt = dir.join("LATEST.tmp");
        std::fs::write(&lt, format!("{name}\n")).map_err(|e| err(&lt, e))?;
        std::fs::File::open(&lt).and_then(|f| f.sync_all()).map_err(|e| err(&lt, e))?;
        std::fs::rename(&lt, dir.join("LATEST")).map_err(|e| err(dir, e))?;
        sync_dir(dir);
        prune(dir, &name, previous.as_deref(), run);
    }
    Ok(done)
}

/// The largest `LATEST` file read (it holds one directory name).
const MAX_LATEST_BYTES: u64 = 4096;
/// The largest manifest read (a few hundred bytes per rank).
const MAX_MANIFEST_BYTES: u64 = 64 << 20;

/// The name `LATEST` holds, if any.
fn latest_name(dir: &Path) -> Option<String> {
    ir::files::read_regular_to_string(&dir.join("LATEST"), MAX_LATEST_BYTES)
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

/// Removes complete checkpoints other than `keep` and `previous`, and temporary directories of
/// other runs (a run killed mid-write).
fn prune(dir: &Path, keep: &str, previous: Option<&str>, run: &str) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        let stale_ckpt = n.starts_with("ckpt-") && n != keep && Some(n.as_str()) != previous;
        let stale_tmp = n.starts_with(".tmp-ckpt-") && !n.ends_with(run);
        if stale_ckpt || stale_tmp {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// The checkpoint directory `LATEST` names, once it is checked to be a directory directly
/// inside `dir` (see the module docs).
fn latest_dir(dir: &Path) -> Result<PathBuf, DistError> {
    let lpath = dir.join("LATEST");
    if !lpath.exists() {
        return Err(err(dir, "no checkpoint here (no LATEST file)"));
    }
    let name = ir::files::read_regular_to_string(&lpath, MAX_LATEST_BYTES)
        .map_err(|e| err(&lpath, format!("{e} (a LATEST file holds the one-line name of a checkpoint)")))?
        .trim()
        .to_string();
    if name.is_empty() {
        return Err(err(&lpath, "is empty"));
    }
    let mut parts = Path::new(&name).components();
    if !matches!((parts.next(), parts.next()), (Some(Component::Normal(_)), None)) {
        return Err(err(&lpath, format!("names `{name}`, not a checkpoint directory inside {}", dir.display())));
    }
    // Symbolic links resolved, the directory must still be one directly inside `dir`.
    let root = dir.canonicalize().map_err(|e| err(dir, e))?;
    let ck = root.join(&name).canonicalize().map_err(|e| err(&lpath, format!("names `{name}`: {e}")))?;
    if ck.parent() != Some(root.as_path()) {
        return Err(err(
            &lpath,
            format!("names `{name}`, which leads outside {} (to {})", dir.display(), ck.display()),
        ));
    }
    if !ck.is_dir() {
        return Err(err(&lpath, format!("names `{name}`, which is not a directory")));
    }
    Ok(ck)
}

/// Reads the manifest of the newest complete checkpoint in `dir`.
pub fn latest(dir: &Path) -> Result<(PathBuf, Manifest), DistError> {
    let ck = latest_dir(dir)?;
    let mpath = ck.join("manifest.json");
    let text = ir::files::read_regular_to_string(&mpath, MAX_MANIFEST_BYTES).map_err(|e| err(&mpath, e))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| err(&mpath, format!("not a checkpoint manifest: {e}")))?;
    let (format, version) = (v.get("format").and_then(|x| x.as_str()), v.get("version").and_then(|x| x.as_u64()));
    match (format, version) {
        (Some(FORMAT), Some(v)) if v == VERSION as u64 => {}
        (Some(FORMAT), Some(v)) if v < VERSION as u64 => {
            return Err(err(
                &ck,
                format!(
                    "checkpoint format too old (version {v}, without shard headers; this autopar reads version {VERSION}): start again without --resume"
                ),
            ));
        }
        (f, v) => {
            return Err(err(
                &mpath,
                format!(
                    "format {} version {}; this autopar reads {FORMAT} {VERSION}",
                    f.unwrap_or("?"),
                    v.unwrap_or(0)
                ),
            ));
        }
    }
    let m: Manifest = serde_json::from_value(v).map_err(|e| err(&mpath, format!("not a checkpoint manifest: {e}")))?;
    Ok((ck, m))
}

/// Loads rank `st.rank`'s blocks from the newest checkpoint in `dir` into `st` (see the module
/// docs for what is checked).
pub fn load(dir: &Path, program: &Program, st: &mut RankState) -> Result<u64, DistError> {
    let (ck, m) = latest(dir)?;
    if m.model_hash != program.model_hash {
        return Err(err(&ck, "was written for another plan (model hash differs)"));
    }
    if m.plan_hash != program.plan_hash {
        return Err(err(&ck, "was written for another plan (the parameters' layouts differ)"));
    }
    if m.mesh != program.mesh().shape() {
        return Err(err(
            &ck,
            format!("was written on mesh {:?}, the plan's mesh is {:?}", m.mesh, program.mesh().shape()),
        ));
    }
    if program.draws() && m.seed.is_some_and(|s| s != program.seed()) {
        return Err(err(
            &ck,
            format!(
                "was written by a run drawing its dropout masks from seed {}, this run's seed is {}: pass --seed {} \
                 to continue them",
                m.seed.unwrap_or(0),
                program.seed(),
                m.seed.unwrap_or(0)
            ),
        ));
    }
    let entry = m
        .files
        .iter()
        .find(|f| f.rank == st.rank)
        .ok_or_else(|| err(&ck, format!("has no file of rank {}", st.rank)))?;
    // The name as written: a manifest naming another path (`../x`, `/etc/x`) reads nothing.
    if entry.file != rank_file(st.rank) {
        return Err(err(
            &ck,
            format!("names `{}` as the file of rank {}, not {}", entry.file, st.rank, rank_file(st.rank)),
        ));
    }
    let path = ck.join(&entry.file);
    let (bytes, crc) = crc_of(&path)?;
    if bytes != entry.bytes || crc != entry.crc32 {
        return Err(err(
            &path,
            format!(
                "is corrupt: {bytes} bytes with CRC-32 {crc:08x}, the manifest says {} and {:08x}",
                entry.bytes, entry.crc32
            ),
        ));
    }
    let blocks: BTreeMap<String, Tensor> = read_npz(&path).map_err(|e| err(&path, e))?;
    check_header(&path, blocks.get(HEADER), st.rank, &m, program)?;
    let mut next = BTreeMap::new();
    let stage = program.stage_of(st.rank);
    for r in program.resident.iter().filter(|r| r.stage == stage) {
        let want = r.spec.local_shape(&r.meta.shape, program.mesh());
        match blocks.get(&r.name) {
            Some(t) if t.shape() == want.as_slice() && t.dtype() == r.meta.dtype => {
                next.insert(r.name.clone(), t.clone());
            }
            Some(t) => {
                return Err(err(&path, format!("{} is {} but the plan needs a block of {want:?}", r.name, t.meta())));
            }
            None => return Err(err(&path, format!("has no block of {}", r.name))),
        }
    }
    st.storage = next;
    st.steps_done = m.step;
    Ok(m.step)
}
