//! Where a run writes: checked before its first step, written atomically, and not shared.
//!
//! - [`check_dir`] and [`check_file`] check an output destination before any work: a directory
//!   must be one (or creatable), a file must not be a directory, the place must be writable (a
//!   file is created and removed there), and the file system must have room for the bytes the
//!   output will take. A run that would fail to save after its last step fails before its first.
//! - [`SaveDir`] writes a directory of files atomically: into a staging directory next to it,
//!   which then takes its place in one step (`renameat2(RENAME_EXCHANGE)`, or a rename when the
//!   directory is new). A run killed while saving leaves the previous save whole; a reader never
//!   sees a mix of two saves. Staging directories of a dead process are removed by the next save.
//! - [`DirLock`] is an exclusive lock on a directory (an `flock` on `DIR/.lock`, which names its
//!   holder): two runs on one checkpoint directory would remove each other's files. The kernel
//!   releases it when the process exits, however it exits, so a stale lock never blocks.

use std::fs::File;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

/// Why an output destination cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("{flag} {path}: {message}")]
pub struct OutputError {
    /// The flag that names it (`--save`).
    pub flag: String,
    /// The destination.
    pub path: PathBuf,
    /// What is wrong.
    pub message: String,
}

fn out_err(flag: &str, path: &Path, message: impl std::fmt::Display) -> OutputError {
    OutputError { flag: flag.to_string(), path: path.to_path_buf(), message: message.to_string() }
}

/// Free bytes for an unprivileged writer on the file system of `dir`.
pub fn free_bytes(dir: &Path) -> std::io::Result<u64> {
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a statvfs the call fills.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// Checks that `dir` can be written there: creates and removes a file in it.
fn probe_writable(flag: &str, target: &Path, dir: &Path) -> Result<(), OutputError> {
    let probe = dir.join(format!(".autopar-probe-{}", std::process::id()));
    let r = File::create(&probe).and_then(|mut f| f.write_all(b"probe"));
    let _ = std::fs::remove_file(&probe);
    r.map_err(|e| out_err(flag, target, format!("cannot write in {}: {e}", dir.display())))
}

/// Checks there is room for `bytes` more in `dir`'s file system.
fn check_room(flag: &str, target: &Path, dir: &Path, bytes: u64) -> Result<(), OutputError> {
    if let Ok(free) = free_bytes(dir)
        && free < bytes
    {
        return Err(out_err(
            flag,
            target,
            format!(
                "needs about {} but its file system has {} free",
                ir::alloc::human(bytes as usize),
                ir::alloc::human(free as usize)
            ),
        ));
    }
    Ok(())
}

/// The existing directory closest to `path` (itself, or an ancestor).
fn existing_ancestor(path: &Path) -> PathBuf {
    let mut p = if path.is_absolute() { path.to_path_buf() } else { Path::new(".").join(path) };
    while !p.is_dir() {
        match p.parent() {
            Some(q) if !q.as_os_str().is_empty() => p = q.to_path_buf(),
            _ => return PathBuf::from("."),
        }
    }
    p
}

/// Checks, before a run starts, that the output directory `dir` (`flag` names it) can be written
/// with about `bytes` in it: it is a directory or does not exist (its nearest existing ancestor
/// is then written to), it is writable, and its file system has room.
pub fn check_dir(flag: &str, dir: &Path, bytes: u64) -> Result<(), OutputError> {
    if dir.exists() && !dir.is_dir() {
        return Err(out_err(flag, dir, "exists and is not a directory"));
    }
    let at = existing_ancestor(dir);
    probe_writable(flag, dir, &at)?;
    check_room(flag, dir, &at, bytes)
}

/// Checks, before a run starts, that the file `file` (`flag` names it) can be written with about
/// `bytes`: it is not a directory, its directory exists and is writable, and has room.
pub fn check_file(flag: &str, file: &Path, bytes: u64) -> Result<(), OutputError> {
    if file.is_dir() {
        return Err(out_err(flag, file, "is a directory; name a file"));
    }
    let dir = file.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if !dir.is_dir() {
        return Err(out_err(flag, file, format!("the directory {} does not exist", dir.display())));
    }
    probe_writable(flag, file, dir)?;
    check_room(flag, file, dir, bytes)
}

/// Prefix of staging directories next to a target `NAME`: `.NAME.saving-PID-NANOS`.
fn staging_prefix(target: &Path) -> String {
    format!(".{}.saving-", target.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default())
}

fn sync_dir(dir: &Path) {
    if let Ok(f) = File::open(dir) {
        let _ = f.sync_all();
    }
}

/// Whether process `pid` is alive (`kill(pid, 0)`).
fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    pid > 0
        && (unsafe { libc::kill(pid, 0) } == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM))
}

/// A directory written atomically (see the module docs). Files are written into
/// [`SaveDir::path`]; [`SaveDir::commit`] puts them in place of the target as a whole. Dropped
/// without a commit, the staging directory is removed.
#[derive(Debug)]
pub struct SaveDir {
    target: PathBuf,
    staging: PathBuf,
    committed: bool,
}

impl SaveDir {
    /// Starts a save of `target` (a directory, or a path where none exists yet).
    pub fn new(target: &Path) -> std::io::Result<SaveDir> {
        if target.exists() && !target.is_dir() {
            return Err(std::io::Error::other(format!("{} exists and is not a directory", target.display())));
        }
        let parent = target.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        std::fs::create_dir_all(parent)?;
        let prefix = staging_prefix(target);
        // Staging directories of dead processes (a save that was killed).
        if let Ok(entries) = std::fs::read_dir(parent) {
            for e in entries.flatten() {
                let n = e.file_name().to_string_lossy().into_owned();
                let pid = n.strip_prefix(&prefix).and_then(|r| r.split('-').next()).and_then(|p| p.parse::<i32>().ok());
                if pid.is_some_and(|p| !alive(p)) {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let staging = parent.join(format!("{prefix}{}-{nanos}", std::process::id()));
        std::fs::create_dir(&staging)?;
        Ok(SaveDir { target: target.to_path_buf(), staging, committed: false })
    }

    /// Where the files go until the commit.
    pub fn path(&self) -> &Path {
        &self.staging
    }

    /// The directory the files end up in.
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// Syncs the files and puts them in place of the target in one step.
    pub fn commit(mut self) -> std::io::Result<()> {
        for e in std::fs::read_dir(&self.staging)?.flatten() {
            File::open(e.path())?.sync_all()?;
        }
        sync_dir(&self.staging);
        if self.target.is_dir() {
            exchange(&self.staging, &self.target)?;
            // The staging path now holds the previous save.
            let _ = std::fs::remove_dir_all(&self.staging);
        } else {
            std::fs::rename(&self.staging, &self.target)?;
        }
        if let Some(p) = self.target.parent().filter(|p| !p.as_os_str().is_empty()) {
            sync_dir(p);
        }
        self.committed = true;
        Ok(())
    }
}

impl Drop for SaveDir {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_dir_all(&self.staging);
        }
    }
}

/// Swaps two directories atomically (`renameat2(RENAME_EXCHANGE)`). On a file system without
/// it, `b` is renamed aside, `a` renamed to `b`, and the old `b` moved to `a`: a process killed
/// between the two renames leaves the previous save whole next to the target
/// (`.NAME.saving-...`), never a mix.
fn exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    let ca = std::ffi::CString::new(a.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    let cb = std::ffi::CString::new(b.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    // SAFETY: two NUL-terminated paths relative to the working directory.
    let r = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            ca.as_ptr(),
            libc::AT_FDCWD,
            cb.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if r == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    if !matches!(e.raw_os_error(), Some(libc::EINVAL) | Some(libc::ENOSYS)) {
        return Err(e);
    }
    let aside = a.with_extension("old");
    std::fs::rename(b, &aside)?;
    std::fs::rename(a, b)?;
    std::fs::rename(&aside, a)
}

/// An exclusive lock on a directory (see the module docs), held until dropped or the process
/// ends.
#[derive(Debug)]
pub struct DirLock {
    _file: File,
}

/// The lock file in a locked directory.
pub const LOCK_FILE: &str = ".lock";

impl DirLock {
    /// Locks `dir` (created if missing) for this process, or says which process holds it.
    pub fn acquire(dir: &Path) -> Result<DirLock, String> {
        if dir.exists() && !dir.is_dir() {
            return Err(format!("{}: exists and is not a directory", dir.display()));
        }
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let path = dir.join(LOCK_FILE);
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        // SAFETY: flock on a descriptor this function owns.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                let holder = std::fs::read_to_string(&path).unwrap_or_default();
                let holder = holder.trim();
                return Err(format!(
                    "{} is in use by another run{}; wait for it to end, or give this run another directory",
                    dir.display(),
                    if holder.is_empty() { String::new() } else { format!(" ({holder})") }
                ));
            }
            return Err(format!("{}: locking it: {e}", path.display()));
        }
        let me = format!("process {} on {}", std::process::id(), hostname());
        let _ = f.set_len(0).and_then(|_| f.write_all(me.as_bytes())).and_then(|_| f.flush());
        Ok(DirLock { _file: f })
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "this host".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("autopar-outputs-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_save_replaces_the_directory_whole() {
        let d = tmp("save");
        let target = d.join("out");
        for round in 0..2 {
            let s = SaveDir::new(&target).unwrap();
            std::fs::write(s.path().join("a"), format!("{round}")).unwrap();
            if round == 0 {
                std::fs::write(s.path().join("only-first"), "x").unwrap();
            }
            s.commit().unwrap();
            assert_eq!(std::fs::read_to_string(target.join("a")).unwrap(), format!("{round}"));
        }
        assert!(!target.join("only-first").exists());
        // An uncommitted save leaves the target as it was, and no staging directory.
        let s = SaveDir::new(&target).unwrap();
        std::fs::write(s.path().join("a"), "2").unwrap();
        drop(s);
        assert_eq!(std::fs::read_to_string(target.join("a")).unwrap(), "1");
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 1);
        std::fs::remove_dir_all(&d).ok();
    }

    #[test]
    fn a_second_lock_names_the_first() {
        let d = tmp("lock");
        let first = DirLock::acquire(&d).unwrap();
        // flock locks belong to the open file: a second open in this process conflicts too.
        let e = DirLock::acquire(&d).unwrap_err();
        assert!(e.contains("in use by another run") && e.contains(&format!("process {}", std::process::id())), "{e}");
        drop(first);
        DirLock::acquire(&d).unwrap();
        std::fs::remove_dir_all(&d).ok();
    }

    #[test]
    fn destinations_are_checked() {
        let d = tmp("check");
        let f = d.join("file");
        std::fs::write(&f, "x").unwrap();
        assert!(check_dir("--save", &f, 0).unwrap_err().to_string().contains("not a directory"));
        assert!(check_file("--export-onnx", &d, 0).unwrap_err().to_string().contains("is a directory"));
        assert!(check_file("--out", &d.join("no/such/x.onnx"), 0).unwrap_err().to_string().contains("does not exist"));
        assert!(check_dir("--save", &d.join("new/dir"), 1).is_ok());
        assert!(check_dir("--save", &d, u64::MAX / 2).unwrap_err().to_string().contains("free"));
        std::fs::remove_dir_all(&d).ok();
    }
}
