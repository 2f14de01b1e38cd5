//! Index geometry shared by the CPU and CUDA kernels: how a slice walks its input, and how a
//! reduction sees its input as `[outer, reduced, inner]`. One definition, so both back ends
//! address the same elements.

use ir::SliceAxis;

/// Element strides of a contiguous tensor of `shape`.
fn contiguous(shape: &[usize]) -> Vec<isize> {
    let mut st = vec![1isize; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        st[d] = st[d + 1] * shape[d + 1] as isize;
    }
    st
}

/// The first element and the per-dim element steps of a slice of a tensor of `shape` (negative
/// steps walk backwards; bounds were checked by inference). An empty output dim contributes
/// no offset.
pub(crate) fn slice_walk(shape: &[usize], axes: &[SliceAxis], out_shape: &[usize]) -> (isize, Vec<isize>) {
    let ist = contiguous(shape);
    let mut start = vec![0i64; shape.len()];
    let mut step = vec![1i64; shape.len()];
    for a in axes {
        start[a.axis] = a.start;
        step[a.axis] = a.step;
    }
    let mut base = 0isize;
    let mut st = vec![0isize; shape.len()];
    for d in 0..shape.len() {
        if out_shape[d] > 0 {
            base += start[d] as isize * ist[d];
        }
        st[d] = step[d] as isize * ist[d];
    }
    (base, st)
}

/// How a reduction over sorted, unique `axes` of a tensor of `shape` reads its input: as
/// `[outer, red, inner]` after moving the reduced axes last with `perm` when they are not
/// contiguous (then `inner` is 1).
pub(crate) struct ReduceLayout {
    /// The transpose that makes the reduced axes contiguous and last, if they are not already
    /// contiguous.
    pub perm: Option<Vec<usize>>,
    /// Elements before the reduced block.
    pub outer: usize,
    /// Elements reduced together.
    pub red: usize,
    /// Elements after the reduced block.
    pub inner: usize,
}

pub(crate) fn reduce_layout(shape: &[usize], axes: &[usize]) -> ReduceLayout {
    let s = shape;
    if axes.is_empty() {
        return ReduceLayout { perm: None, outer: s.iter().product(), red: 1, inner: 1 };
    }
    if axes.windows(2).all(|w| w[1] == w[0] + 1) {
        let (a0, a1) = (axes[0], axes[axes.len() - 1]);
        return ReduceLayout {
            perm: None,
            outer: s[..a0].iter().product(),
            red: s[a0..=a1].iter().product(),
            inner: s[a1 + 1..].iter().product(),
        };
    }
    let kept: Vec<usize> = (0..s.len()).filter(|d| !axes.contains(d)).collect();
    let outer = kept.iter().map(|&d| s[d]).product();
    let perm = kept.iter().chain(axes).copied().collect();
    ReduceLayout { perm: Some(perm), outer, red: axes.iter().map(|&d| s[d]).product(), inner: 1 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reductions_see_outer_red_inner() {
        let l = reduce_layout(&[2, 3, 4, 5], &[1, 2]);
        assert_eq!((l.perm, l.outer, l.red, l.inner), (None, 2, 12, 5));
        let l = reduce_layout(&[2, 3, 4, 5], &[0, 2]);
        assert_eq!((l.perm, l.outer, l.red, l.inner), (Some(vec![1, 3, 0, 2]), 15, 8, 1));
        let l = reduce_layout(&[2, 3], &[]);
        assert_eq!((l.perm, l.outer, l.red, l.inner), (None, 6, 1, 1));
    }

    #[test]
    fn a_reversed_slice_starts_at_its_last_element() {
        let axes = [SliceAxis { axis: 1, start: 3, len: 4, step: -1 }];
        assert_eq!(slice_walk(&[2, 4], &axes, &[2, 4]), (3, vec![4, -1]));
        assert_eq!(slice_walk(&[2, 4], &axes, &[0, 4]), (3, vec![4, -1]));
    }
}
