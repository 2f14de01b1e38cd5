//! Fallible allocation of the buffers a model or a plan sizes.
//!
//! A model of a few hundred bytes can ask for any amount of memory (an Expand to 24 GiB, a
//! ConstantOfShape of 2^28 elements), and Rust's infallible allocation aborts the process when
//! the operating system refuses (`memory allocation of N bytes failed`, SIGABRT). Every buffer
//! whose size comes from a model, a plan or a data file is therefore allocated here: the size is
//! checked first (it must be representable, at most `isize::MAX` bytes), then the memory is
//! reserved with [`Vec::try_reserve_exact`], and a refusal is an [`AllocError`] naming the bytes,
//! which callers turn into an error naming the node, tensor or file.
//!
//! [`reserve`] is the check for code that allocates through a library (a kernel's intermediate
//! vectors, tract's results, a collective's buffers): it reserves, and releases, the bytes the
//! caller is about to allocate, so that a request the system refuses is an error before the
//! library's own (infallible) allocation is attempted.

use std::fmt;

/// Memory the system refused (or a size that no allocation can have).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllocError {
    /// Bytes asked for (`None`: more than a `usize` counts).
    pub bytes: Option<usize>,
}

impl fmt::Display for AllocError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.bytes {
            Some(b) => write!(f, "cannot allocate {b} bytes ({}): out of memory", human(b)),
            None => f.write_str("cannot allocate more bytes than a usize counts"),
        }
    }
}

impl std::error::Error for AllocError {}

impl AllocError {
    /// A request for `bytes`.
    pub fn of(bytes: usize) -> AllocError {
        AllocError { bytes: Some(bytes) }
    }
}

/// `b` bytes in binary units, one decimal (`24.0 GiB`).
pub fn human(b: usize) -> String {
    let units = ["bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut x = b as f64;
    let mut u = 0;
    while x >= 1024.0 && u + 1 < units.len() {
        x /= 1024.0;
        u += 1;
    }
    if u == 0 { format!("{b} bytes") } else { format!("{x:.1} {}", units[u]) }
}

/// Bytes of `n` elements of `T`, checked: at most `isize::MAX`, as an allocation must be.
pub fn bytes_of<T>(n: usize) -> Result<usize, AllocError> {
    n.checked_mul(std::mem::size_of::<T>())
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or(AllocError { bytes: n.checked_mul(std::mem::size_of::<T>()) })
}

/// An empty vector with room for exactly `n` elements, or the error naming their bytes.
pub fn try_vec<T>(n: usize) -> Result<Vec<T>, AllocError> {
    let bytes = bytes_of::<T>(n)?;
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| AllocError::of(bytes))?;
    Ok(v)
}

/// `n` copies of `x` (`vec![x; n]`, fallibly).
pub fn try_filled<T: Clone>(n: usize, x: T) -> Result<Vec<T>, AllocError> {
    let mut v = try_vec(n)?;
    v.resize(n, x);
    Ok(v)
}

/// The items of `it`, which yields exactly `n` of them, collected into a vector allocated once
/// and fallibly (more items than `n` are an error rather than a growth).
pub fn try_collect<T>(n: usize, it: impl IntoIterator<Item = T>) -> Result<Vec<T>, AllocError> {
    let mut v = try_vec(n)?;
    for x in it {
        if v.len() == n {
            return Err(AllocError { bytes: n.checked_add(1).and_then(|m| m.checked_mul(std::mem::size_of::<T>())) });
        }
        v.push(x);
    }
    Ok(v)
}

/// A copy of `src`, fallibly (through [`crate::extend_fast`]'s small copies).
pub fn try_copy<T: Copy>(src: &[T]) -> Result<Vec<T>, AllocError> {
    let mut v = try_vec(src.len())?;
    crate::extend_fast(&mut v, src);
    Ok(v)
}

/// Checks that `bytes` can be allocated now: reserves them and releases them at once (see the
/// module docs). Zero bytes always can.
pub fn reserve(bytes: usize) -> Result<(), AllocError> {
    if bytes == 0 {
        return Ok(());
    }
    if bytes > isize::MAX as usize {
        return Err(AllocError::of(bytes));
    }
    let mut v: Vec<u8> = Vec::new();
    v.try_reserve_exact(bytes).map_err(|_| AllocError::of(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_past_isize_are_errors_not_aborts() {
        assert_eq!(try_vec::<u64>(usize::MAX / 4).unwrap_err().bytes, None);
        assert!(try_vec::<u8>(isize::MAX as usize + 1).is_err());
        assert!(reserve(usize::MAX).is_err());
        let e = try_filled(1usize << 61, 0f32).unwrap_err();
        assert_eq!(e.bytes, Some(1 << 63));
        assert!(e.to_string().contains("9223372036854775808 bytes (8.0 EiB)"), "{e}");
    }

    #[test]
    fn small_requests_succeed() {
        assert_eq!(try_filled(3, 1.5f32).unwrap(), vec![1.5; 3]);
        assert_eq!(try_collect(3, 0..3).unwrap(), vec![0, 1, 2]);
        assert!(try_collect(2, 0..3).is_err());
        assert_eq!(try_copy(&[1u8, 2]).unwrap(), vec![1, 2]);
        reserve(1 << 20).unwrap();
        assert_eq!(human(25769803776), "24.0 GiB");
    }
}
