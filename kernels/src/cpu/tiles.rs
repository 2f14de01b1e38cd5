//! Register-tiled f32 matrix products for CPUs with AVX-512: `TILE_M x TILE_N` blocks of the
//! result held in 24 registers, each step of the depth one broadcast per row against two
//! 16-lane vectors of a row of the other operand.
//!
//! Why: `gemm` packs both operands, and packing the large one of a product whose operands both
//! run along the depth (`a @ b^T` with `b` stored `[n, k]`: a linear layer's forward product,
//! a convolution's weight gradient) costs as much as the product when the other side is thin
//! (the mlp's `[32, 1024] @ [1024, 1024]^T`: 47 GFLOP/s in `gemm`, 110-116 here on one core of
//! the AVX-512 target, BENCHMARKS.md). Here the broadcast side is read in place with any
//! strides, and only a side that gives vectors but is not contiguous along them is copied, in
//! panels of `kc x TILE_N`. The product is computed either way round (`c` or `c^T`), whichever
//! copies fewer elements: for `[32, k] @ [n, k]^T` that is the 32-row side.
//!
//! Invariant: every element of `c` is the sum over the depth in blocks of [`KC`], each block a
//! chain of fused multiply-adds in depth order, times `alpha`, plus `beta * c` (not read when
//! `beta` is 0). With `alpha` 1 (every product of a training graph) the bits do not depend on
//! how the caller splits `c` into blocks nor on which way round a block is computed, so a
//! product split over threads gives the same result as one call.

/// An f32 matrix in memory: element `(i, j)` at `ptr + i * rs + j * cs` (strides in elements).
#[derive(Clone, Copy)]
pub(crate) struct Strided<P> {
    pub ptr: P,
    pub rs: isize,
    pub cs: isize,
}

/// Whether this CPU runs [`product`].
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Depth of one block: a `KC x TILE_N` panel (32 KiB) stays in the 48 KiB L1 while the tiles
/// of one row block sweep it.
const KC: usize = 256;
/// Columns of `c` per block: the `KC x NC` copied panels (1 MiB) stay in L2.
const NC: usize = 1024;
const TILE_M: usize = 12;
const TILE_N: usize = 32;

/// `c = alpha * a @ b + beta * c` for an `m x k` matrix `a`, a `k x n` matrix `b` and an `m x n`
/// matrix `c`, on the calling thread. With `beta == 0`, `c` is not read.
///
/// # Safety
/// [`available`] is true; the three matrices lie in memory with their strides; `c` overlaps
/// neither input, and its elements are distinct (`c` strides that do not alias).
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn product(
    m: usize,
    n: usize,
    k: usize,
    a: Strided<*const f32>,
    b: Strided<*const f32>,
    c: Strided<*mut f32>,
    alpha: f32,
    beta: f32,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        for i in 0..m {
            for j in 0..n {
                // SAFETY: (i, j) is inside `c`.
                let o = unsafe { &mut *c.ptr.offset(i as isize * c.rs + j as isize * c.cs) };
                *o = if beta == 0.0 { 0.0 } else { beta * *o };
            }
        }
        return;
    }
    // Elements copied per orientation: a vector side not contiguous along its vectors, and for
    // c^T (when `c` is not contiguous along the vectors) the results moved into `c` one by one.
    let cost = |vec_cs: isize, c_cs: isize, cols: usize| {
        (if vec_cs != 1 { k * cols } else { 0 }) + if c_cs != 1 { m * n } else { 0 }
    };
    let flip = cost(a.rs, c.rs, m) < cost(b.cs, c.cs, n);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: forwarded from the caller; c^T = b^T @ a^T is the same product.
    unsafe {
        let t = |s: Strided<*const f32>| Strided { ptr: s.ptr, rs: s.cs, cs: s.rs };
        let (m, n, a, b, c) =
            if flip { (n, m, t(b), t(a), Strided { ptr: c.ptr, rs: c.cs, cs: c.rs }) } else { (m, n, a, b, c) };
        if c.cs == 1 {
            avx512::blocked(m, n, k, a, b, c, alpha, beta);
            return;
        }
        // Results contiguous in a scratch matrix first, then moved into `c` once (not once per
        // depth block).
        let mut out = vec![0f32; m * n];
        avx512::blocked(m, n, k, a, b, Strided { ptr: out.as_mut_ptr(), rs: n as isize, cs: 1 }, 1.0, 0.0);
        // In 16 x 16 blocks, so that neither side is walked across a whole row per element.
        for i0 in (0..m).step_by(16) {
            for j0 in (0..n).step_by(16) {
                for j in j0..(j0 + 16).min(n) {
                    for i in i0..(i0 + 16).min(m) {
                        // SAFETY: (i, j) is inside `c`.
                        let o = &mut *c.ptr.offset(i as isize * c.rs + j as isize * c.cs);
                        let v = alpha * out[i * n + j];
                        *o = if beta == 0.0 { v } else { beta.mul_add(*o, v) };
                    }
                }
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (flip, alpha, beta);
        unreachable!("tiles::product without AVX-512 (callers check `available`)")
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{KC, NC, Strided, TILE_M, TILE_N};
    use std::arch::x86_64::*;

    type Acc = [[__m512; 2]; TILE_M];

    /// The block loops of [`super::product`] with vectors along `n` (`b`'s rows, read in place
    /// when contiguous, else copied into `kc x TILE_N` panels).
    ///
    /// # Safety
    /// As [`super::product`], with `m, n, k > 0`.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn blocked(
        m: usize,
        n: usize,
        k: usize,
        a: Strided<*const f32>,
        b: Strided<*const f32>,
        c: Strided<*mut f32>,
        alpha: f32,
        beta: f32,
    ) {
        let copy = b.cs != 1;
        let mut panel = if copy { vec![0f32; KC.min(k) * n.min(NC).div_ceil(TILE_N) * TILE_N] } else { Vec::new() };
        for jc in (0..n).step_by(NC) {
            let nc = (n - jc).min(NC);
            for pc in (0..k).step_by(KC) {
                let kc = (k - pc).min(KC);
                // SAFETY: rows pc..pc + kc and columns jc..jc + nc lie inside `b`.
                let bb = unsafe { b.ptr.offset(pc as isize * b.rs + jc as isize * b.cs) };
                if copy {
                    // SAFETY: as above; the panel holds ceil(nc / TILE_N) panels of kc x TILE_N.
                    unsafe { fill_panels(kc, nc, Strided { ptr: bb, ..b }, &mut panel) };
                }
                let beta = if pc == 0 { beta } else { 1.0 };
                for ir in (0..m).step_by(TILE_M) {
                    let mr = (m - ir).min(TILE_M);
                    // SAFETY: rows ir.. and depth pc.. of `a`.
                    let ap = Strided { ptr: unsafe { a.ptr.offset(ir as isize * a.rs + pc as isize * a.cs) }, ..a };
                    for jr in (0..nc).step_by(TILE_N) {
                        let nr = (nc - jr).min(TILE_N);
                        let (bp, brs) = if copy {
                            (panel[jr * kc..].as_ptr(), TILE_N as isize)
                        } else {
                            // SAFETY: column jr of the block, inside `b`.
                            (unsafe { bb.add(jr) }, b.rs)
                        };
                        // SAFETY: the tile's rows, depth and columns lie inside the operands;
                        // the CPU has AVX-512 (the caller's contract).
                        unsafe {
                            let acc = if nr == TILE_N {
                                tile::<false>(kc, ap, mr, bp, brs, nr)
                            } else {
                                tile::<true>(kc, ap, mr, bp, brs, nr)
                            };
                            let at = c.ptr.offset(ir as isize * c.rs + (jc + jr) as isize * c.cs);
                            store(&acc, Strided { ptr: at, ..c }, mr, nr, alpha, beta);
                        }
                    }
                }
            }
        }
    }

    /// Copies the `kc x nc` block `b` (not contiguous along its rows) into panels of
    /// `kc x TILE_N`, zeros past `nc`.
    ///
    /// # Safety
    /// `b` covers `kc x nc`; `out` holds `ceil(nc / TILE_N) * kc * TILE_N` elements.
    unsafe fn fill_panels(kc: usize, nc: usize, b: Strided<*const f32>, out: &mut [f32]) {
        for jp in (0..nc).step_by(TILE_N) {
            let w = (nc - jp).min(TILE_N);
            let dst = &mut out[jp * kc..jp * kc + kc * TILE_N];
            for j in 0..w {
                // SAFETY: column jp + j of `b`, read down its kc rows.
                let src = unsafe { b.ptr.offset((jp + j) as isize * b.cs) };
                for (p, d) in dst.iter_mut().skip(j).step_by(TILE_N).enumerate() {
                    // SAFETY: p < kc.
                    *d = unsafe { *src.offset(p as isize * b.rs) };
                }
            }
            if w < TILE_N {
                for row in dst.chunks_mut(TILE_N) {
                    row[w..].fill(0.0);
                }
            }
        }
    }

    /// Lanes `0..nr` of the two vectors of a tile row.
    fn masks(nr: usize) -> (u16, u16) {
        let lo = if nr >= 16 { 0xffff } else { ((1u32 << nr) - 1) as u16 };
        let hi = if nr >= 32 {
            0xffff
        } else if nr > 16 {
            ((1u32 << (nr - 16)) - 1) as u16
        } else {
            0
        };
        (lo, hi)
    }

    /// The `TILE_M x TILE_N` sums over depth `kc` of rows `a` (`mr` of them; the others repeat
    /// the last and are not stored) against `b`'s rows (`brs` apart, contiguous; with `EDGE`
    /// only `nr` columns are read).
    ///
    /// # Safety
    /// `a` covers `mr x kc`, `b` covers `kc` rows of `nr` (`TILE_N` without `EDGE`) elements.
    #[target_feature(enable = "avx512f")]
    unsafe fn tile<const EDGE: bool>(
        kc: usize,
        a: Strided<*const f32>,
        mr: usize,
        b: *const f32,
        brs: isize,
        nr: usize,
    ) -> Acc {
        let mut acc = [[_mm512_setzero_ps(); 2]; TILE_M];
        // SAFETY: rows below mr, inside `a`.
        let rows: [*const f32; TILE_M] =
            std::array::from_fn(|i| unsafe { a.ptr.offset(i.min(mr - 1) as isize * a.rs) });
        let (m0, m1) = masks(nr);
        let mut bp = b;
        // The contiguous case apart: one index for every row pointer.
        macro_rules! steps {
            ($at:expr) => {
                for p in 0..kc {
                    // SAFETY: row p of `b`: TILE_N elements, or nr under the masks.
                    let (b0, b1) = unsafe {
                        if EDGE {
                            (_mm512_maskz_loadu_ps(m0, bp), _mm512_maskz_loadu_ps(m1, bp.add(16)))
                        } else {
                            (_mm512_loadu_ps(bp), _mm512_loadu_ps(bp.add(16)))
                        }
                    };
                    for i in 0..TILE_M {
                        // SAFETY: element (i, p) of `a`.
                        let av = _mm512_set1_ps(unsafe { *rows[i].offset($at(p)) });
                        acc[i][0] = _mm512_fmadd_ps(av, b0, acc[i][0]);
                        acc[i][1] = _mm512_fmadd_ps(av, b1, acc[i][1]);
                    }
                    bp = bp.wrapping_offset(brs);
                }
            };
        }
        if a.cs == 1 {
            steps!(|p: usize| p as isize);
        } else {
            steps!(|p: usize| p as isize * a.cs);
        }
        acc
    }

    /// `c = alpha * acc + beta * c` for the tile's first `mr` rows and `nr` columns (`c` not
    /// read when `beta` is 0).
    ///
    /// # Safety
    /// `c` covers `mr x nr` elements and is contiguous along its rows (`cs == 1`).
    #[target_feature(enable = "avx512f")]
    unsafe fn store(acc: &Acc, c: Strided<*mut f32>, mr: usize, nr: usize, alpha: f32, beta: f32) {
        let al = _mm512_set1_ps(alpha);
        {
            let be = _mm512_set1_ps(beta);
            let (m0, m1) = masks(nr);
            for (i, r) in acc.iter().enumerate().take(mr) {
                // SAFETY: row i of the tile, nr elements under the masks.
                unsafe {
                    let row = c.ptr.offset(i as isize * c.rs);
                    let mut v0 = _mm512_mul_ps(r[0], al);
                    let mut v1 = _mm512_mul_ps(r[1], al);
                    if beta != 0.0 {
                        v0 = _mm512_fmadd_ps(be, _mm512_maskz_loadu_ps(m0, row), v0);
                        v1 = _mm512_fmadd_ps(be, _mm512_maskz_loadu_ps(m1, row.add(16)), v1);
                    }
                    _mm512_mask_storeu_ps(row, m0, v0);
                    _mm512_mask_storeu_ps(row.add(16), m1, v1);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every orientation, edge and block boundary against a plain f64 product.
    #[test]
    fn products_match_a_plain_product() {
        if !available() {
            return;
        }
        let shapes = [(1, 1, 1), (5, 7, 3), (12, 32, 256), (13, 33, 257), (32, 1030, 300), (40, 9, 600), (3, 2100, 20)];
        for (m, n, k) in shapes {
            for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
                for beta in [0.0f32, 0.5] {
                    let av: Vec<f32> = (0..m * k).map(|i| ((i * 7 % 13) as f32 - 6.0) / 7.0).collect();
                    let bv: Vec<f32> = (0..k * n).map(|i| ((i * 5 % 11) as f32 - 5.0) / 3.0).collect();
                    let a = if ta {
                        Strided { ptr: av.as_ptr(), rs: 1, cs: m as isize }
                    } else {
                        Strided { ptr: av.as_ptr(), rs: k as isize, cs: 1 }
                    };
                    let b = if tb {
                        Strided { ptr: bv.as_ptr(), rs: 1, cs: k as isize }
                    } else {
                        Strided { ptr: bv.as_ptr(), rs: n as isize, cs: 1 }
                    };
                    let c0: Vec<f32> = (0..m * n).map(|i| (i % 3) as f32).collect();
                    let mut c = c0.clone();
                    // SAFETY: the views cover their buffers.
                    unsafe {
                        product(m, n, k, a, b, Strided { ptr: c.as_mut_ptr(), rs: n as isize, cs: 1 }, 2.0, beta)
                    };
                    for i in 0..m {
                        for j in 0..n {
                            let mut s = 0f64;
                            for p in 0..k {
                                // SAFETY: inside the buffers.
                                let (x, y) = unsafe {
                                    (
                                        *a.ptr.offset(i as isize * a.rs + p as isize * a.cs),
                                        *b.ptr.offset(p as isize * b.rs + j as isize * b.cs),
                                    )
                                };
                                s += x as f64 * y as f64;
                            }
                            let want = 2.0 * s + beta as f64 * c0[i * n + j] as f64;
                            let got = c[i * n + j] as f64;
                            // f32 sums of k terms of size ~1: a relative 1e-5 of the magnitude.
                            assert!(
                                (got - want).abs() <= 1e-5 * (1.0 + want.abs()) * (k as f64).sqrt(),
                                "{m}x{n}x{k} ta {ta} tb {tb}: {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }
}
