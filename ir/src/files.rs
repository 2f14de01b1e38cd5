//! Opening the files a user names (models, external data, feeds, plans, profiles, checkpoints).
//!
//! Only regular files are read: a device (`/dev/zero`, `/dev/urandom`) would be read forever and a
//! FIFO would block the open until some writer appears, so both are refused with an error that
//! says what the path is, before anything is read. The type is checked twice: on the path before
//! opening (so that opening a device, which can have effects of its own, never happens), and on
//! the opened file (so that a path swapped for a FIFO in between is still refused; on Unix the open
//! does not block on a FIFO).
//!
//! [`read_regular`] also bounds the size: a caller states the largest file it expects, and a
//! larger file is an error rather than an allocation of whatever size the file has.

use std::fs::{File, Metadata};
use std::io::{self, Read};
use std::path::Path;

/// What a path is, for an error message, if it is not a regular file.
fn not_regular(m: &Metadata) -> Option<&'static str> {
    let t = m.file_type();
    if t.is_file() {
        return None;
    }
    if t.is_dir() {
        return Some("a directory");
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return Some("a FIFO");
        }
        if t.is_char_device() {
            return Some("a character device");
        }
        if t.is_block_device() {
            return Some("a block device");
        }
        if t.is_socket() {
            return Some("a socket");
        }
    }
    Some("not a file")
}

fn refuse(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, format!("not a regular file ({what})"))
}

/// Opens `path` for reading if it is a regular file (symbolic links followed); a directory,
/// device, FIFO or socket is an [`io::ErrorKind::InvalidInput`] error naming what it is.
pub fn open_regular(path: &Path) -> io::Result<File> {
    if let Some(what) = not_regular(&std::fs::metadata(path)?) {
        return Err(refuse(what));
    }
    let mut opts = std::fs::OpenOptions::new();
    opts.read(true);
    #[cfg(unix)]
    {
        // Not blocking in open() if the path became a FIFO since the check above; it has no
        // effect on reads of a regular file.
        use std::os::unix::fs::OpenOptionsExt;
        opts.custom_flags(libc::O_NONBLOCK);
    }
    let f = opts.open(path)?;
    if let Some(what) = not_regular(&f.metadata()?) {
        return Err(refuse(what));
    }
    Ok(f)
}

/// Reads the whole of the regular file `path` ([`open_regular`]) if it has at most `max_bytes`
/// bytes; a larger file is an [`io::ErrorKind::InvalidData`] error giving both sizes.
pub fn read_regular(path: &Path, max_bytes: u64) -> io::Result<Vec<u8>> {
    let f = open_regular(path)?;
    let len = f.metadata()?.len();
    let too_big = |len: u64| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("the file has {len} bytes, more than the {max_bytes} expected of it"),
        )
    };
    if len > max_bytes {
        return Err(too_big(len));
    }
    // The length can change while reading (a file being written): read at most one byte past
    // the bound to notice.
    let mut out = Vec::with_capacity(len as usize);
    f.take(max_bytes.saturating_add(1)).read_to_end(&mut out)?;
    if out.len() as u64 > max_bytes {
        return Err(too_big(out.len() as u64));
    }
    Ok(out)
}

/// [`read_regular`] for a UTF-8 text file.
pub fn read_regular_to_string(path: &Path, max_bytes: u64) -> io::Result<String> {
    String::from_utf8(read_regular(path, max_bytes)?)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("the file is not UTF-8 text: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regular_files_are_read_within_their_bound() {
        let dir = std::env::temp_dir().join(format!("ir-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("a.txt");
        std::fs::write(&f, "hello").unwrap();
        assert_eq!(read_regular_to_string(&f, 5).unwrap(), "hello");
        let e = read_regular(&f, 4).unwrap_err();
        assert!(e.to_string().contains("5 bytes, more than the 4"), "{e}");
        let e = read_regular(&dir, 100).unwrap_err();
        assert!(e.to_string().contains("a directory"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[cfg(unix)]
    #[test]
    fn devices_are_refused_without_reading() {
        let e = read_regular(Path::new("/dev/zero"), u64::MAX).unwrap_err();
        assert!(e.to_string().contains("character device"), "{e}");
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    }
}
