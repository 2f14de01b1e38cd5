//! Checked shape arithmetic: element counts and byte sizes that cannot overflow.
//!
//! A shape is *representable* when the product of its non-zero dims fits in a `usize` and a
//! dense tensor of it, at the widest dtype in question, would fit in `isize::MAX` bytes (the
//! largest allocation Rust permits, and the range of the signed strides kernels walk with).
//! Counting the non-zero dims only means every partial product of a representable shape (a
//! stride, a flattened size, a block of rows) is representable too, even when a zero dim makes
//! the whole count 0. [`crate::Op::infer`] and [`crate::verify`] accept only representable
//! metas, so code downstream of a verified graph may multiply dims without checks.

use crate::tensor::DType;

/// Product of the non-zero dims of `shape`, or `None` when it overflows `usize`.
fn extent(shape: &[usize]) -> Option<usize> {
    shape.iter().filter(|&&d| d != 0).try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

/// Number of elements of `shape`, or `None` when the shape is not representable in elements
/// (the product of its non-zero dims overflows `usize`).
///
/// ```
/// assert_eq!(ir::shape::checked_numel(&[2, 3]), Some(6));
/// assert_eq!(ir::shape::checked_numel(&[]), Some(1));
/// assert_eq!(ir::shape::checked_numel(&[0, 5]), Some(0));
/// assert_eq!(ir::shape::checked_numel(&[1 << 40, 1 << 40]), None);
/// // A zero dim does not hide dims whose product overflows (their strides would).
/// assert_eq!(ir::shape::checked_numel(&[0, 1 << 40, 1 << 40]), None);
/// ```
pub fn checked_numel(shape: &[usize]) -> Option<usize> {
    let e = extent(shape)?;
    Some(if shape.contains(&0) { 0 } else { e })
}

/// Bytes of a dense tensor of `shape` and `dtype`, or `None` when the shape is not
/// representable: the product of its non-zero dims times the element size exceeds
/// `isize::MAX`.
///
/// ```
/// use ir::{DType, shape::checked_bytes};
/// assert_eq!(checked_bytes(&[2, 3], DType::F32), Some(24));
/// assert_eq!(checked_bytes(&[1 << 62], DType::F32), None);
/// assert_eq!(checked_bytes(&[1 << 62], DType::Bool), Some(1 << 62));
/// ```
pub fn checked_bytes(shape: &[usize], dtype: DType) -> Option<usize> {
    let e = extent(shape)?.checked_mul(dtype.size())?;
    if e > isize::MAX as usize {
        return None;
    }
    Some(if shape.contains(&0) { 0 } else { e })
}

/// Why a shape is not representable, for messages: `shape [..] of f32 has more than 2^63 - 1
/// bytes` (or elements when even the count overflows).
pub fn too_large(shape: &[usize], dtype: DType) -> String {
    if extent(shape).is_none() {
        format!("shape {shape:?} has more elements than a usize can count (the product of its dims overflows)")
    } else {
        format!("a {dtype} tensor of shape {shape:?} would exceed {} bytes", isize::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_bytes_at_the_edges() {
        assert_eq!(checked_numel(&[usize::MAX]), Some(usize::MAX));
        assert_eq!(checked_numel(&[usize::MAX, 2]), None);
        assert_eq!(checked_numel(&[usize::MAX, 1, 1]), Some(usize::MAX));
        assert_eq!(checked_bytes(&[usize::MAX], DType::Bool), None);
        assert_eq!(checked_bytes(&[isize::MAX as usize], DType::Bool), Some(isize::MAX as usize));
        assert_eq!(checked_bytes(&[1 << 60], DType::F64), None);
        assert_eq!(checked_bytes(&[1 << 59], DType::F64), Some(1 << 62));
        assert_eq!(checked_bytes(&[0, 1 << 62], DType::F32), None);
        assert_eq!(checked_bytes(&[0, 1 << 20], DType::F32), Some(0));
        assert_eq!(checked_bytes(&[], DType::I64), Some(8));
    }

    #[test]
    fn messages_say_which_limit() {
        assert!(too_large(&[1 << 40, 1 << 40], DType::F32).contains("overflows"));
        assert!(too_large(&[1 << 62], DType::F32).contains("bytes"));
    }
}
