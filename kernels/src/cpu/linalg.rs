//! Matrix products through the `gemm` crate: `MatMul` (numpy batching) and `Gemm`; thin ones
//! (a few rows or columns, long depth) as dot products without packing ([`product_dots`]), some
//! through `matrixmultiply` where it measured faster.
//!
//! `gemm` 0.19 with `x86-v4` was the fastest crate measured on the target machine (see
//! `benches/gemm.rs` and BENCHMARKS.md). It always runs sequentially here: a product is split
//! over the context's threads by blocks of its result ([`product_f32`]).

use super::{Accumulation, CpuContext, ProductKernel, elementwise::broadcast_f32, floats, tensor};
use super::{F, Float};
use crate::Error;
use ir::Tensor;

/// Below this many multiply-adds per matrix, a batch of products is split over threads by batch
/// entry rather than inside each product.
const SMALL_GEMM_MACS: usize = 1 << 21;

/// Products (or batches of them) with at least this many multiply-adds are split over the
/// context's threads. A split saves half the product's time and costs a fork and join (about a
/// microsecond with the helpers awake, tens when one has to be woken) plus a second packing of
/// the shared operand: at 1 << 20 (2 MFLOP, 15-40 us on one core of the 2-core targets) it
/// pays; at 1 << 17 (2-3 us) the tiny zoo models were 10-20% slower on 2 threads than on 1
/// (BENCHMARKS.md, issue 51).
const PAR_GEMM_MIN_MACS: usize = 1 << 20;

/// A strided read-only matrix view: element `(i, j)` is at `ptr + i * rs + j * cs`.
#[derive(Clone, Copy)]
pub(crate) struct View {
    pub ptr: *const F,
    pub rs: isize,
    pub cs: isize,
}

impl View {
    /// The view of rows `i0..` and columns `j0..`.
    fn at(self, i0: usize, j0: usize) -> View {
        View { ptr: self.ptr.wrapping_offset(i0 as isize * self.rs + j0 as isize * self.cs), ..self }
    }
}

/// `c = alpha * a @ b + beta * c` (accumulation in the element type) for an `m x k` view `a`, a `k x n` view `b`
/// and a row-major `c` with row stride `ldc`, split over the threads of `par` (if any) by slices
/// of `c`, each slice sequential. With `beta == 0`, `c` is not read.
///
/// The products are split here rather than inside the GEMM library: one contiguous block of `c`
/// per thread, each on its own packed operands, scaled better on the 2-core target than `gemm`'s
/// own split for the thin products of training steps (BENCHMARKS.md).
///
/// # Safety
/// The views and `c` must cover their matrices; `c` must alias neither input.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn product_f32(
    par: Par,
    m: usize,
    n: usize,
    k: usize,
    a: View,
    b: View,
    c: *mut F,
    ldc: usize,
    alpha: F,
    beta: F,
) {
    let Some((ctx, by_cols, per, parts)) = split(par, m, n, k) else {
        // SAFETY: forwarded from the caller.
        unsafe { product_seq(m, n, k, a, b, c, ldc, alpha, beta) };
        return;
    };
    let len = if by_cols { n } else { m };
    let (a_addr, b_addr, c_addr) = (a.ptr as usize, b.ptr as usize, c as usize);
    ctx.run(parts, |t| {
        let (lo, hi) = (t * per, ((t + 1) * per).min(len));
        let a = View { ptr: a_addr as *const F, ..a };
        let b = View { ptr: b_addr as *const F, ..b };
        let c = c_addr as *mut F;
        // SAFETY: each part writes its own disjoint block of `c` (rows or columns lo..hi), and
        // reads inside the caller's views.
        unsafe {
            if by_cols {
                product_seq(m, hi - lo, k, a, b.at(0, lo), c.add(lo), ldc, alpha, beta)
            } else {
                product_seq(hi - lo, n, k, a.at(lo, 0), b, c.add(lo * ldc), ldc, alpha, beta)
            }
        }
    });
}

/// How an `m x n` result of depth `k` is split over `par`'s threads: `(context, by columns,
/// columns or rows per part, parts)`, or `None` to run it on the calling thread. The split
/// dimension is the one whose split duplicates the smaller packed operand: columns of `c` when
/// `a` (m x k) is the smaller, rows otherwise.
fn split(par: Par<'_>, m: usize, n: usize, k: usize) -> Option<(&CpuContext, bool, usize, usize)> {
    let ctx = par?;
    let threads = ctx.threads();
    if threads <= 1 || (m < 16 && n < 32) || m.saturating_mul(n).saturating_mul(k) < PAR_GEMM_MIN_MACS {
        return None;
    }
    let by_cols = n >= m;
    let (len, align) = if by_cols { (n, 16) } else { (m, 8) };
    let per = len.div_ceil(threads).div_ceil(align) * align;
    Some((ctx, by_cols, per, len.div_ceil(per)))
}

/// One thread's `c = alpha * a @ b + beta * c` by the implementation [`choose`] picks.
///
/// # Safety
/// As [`product_f32`].
#[allow(clippy::too_many_arguments)]
unsafe fn product_seq(m: usize, n: usize, k: usize, a: View, b: View, c: *mut F, ldc: usize, alpha: F, beta: F) {
    if m == 0 || n == 0 {
        return;
    }
    let kernel = choose(m, n, k, (a.rs, a.cs), (b.rs, b.cs));
    if matches!(kernel, ProductKernel::Dots | ProductKernel::Tiles) && F::tiles() {
        // SAFETY: forwarded from the caller; the CPU runs the tiles.
        unsafe { F::tiles_product(m, n, k, (a.ptr, a.rs, a.cs), (b.ptr, b.rs, b.cs), c, ldc, alpha, beta) };
        return;
    }
    if kernel == ProductKernel::Dots {
        // SAFETY: forwarded from the caller.
        unsafe { product_dots(m, n, k, a, b, c, ldc, alpha, beta) };
        return;
    }
    let use_mm = kernel == ProductKernel::MatrixMultiply;
    // SAFETY: forwarded from the caller.
    unsafe {
        if use_mm {
            F::mm_gemm(m, k, n, alpha, a.ptr, a.rs, a.cs, b.ptr, b.rs, b.cs, beta, c, ldc as isize, 1);
        } else {
            gemm::gemm(
                m,
                n,
                k,
                c,
                1,
                ldc as isize,
                beta != 0.0,
                a.ptr,
                a.cs,
                a.rs,
                b.ptr,
                b.cs,
                b.rs,
                beta,
                alpha,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
    }
}

/// The implementation [`product_seq`] runs for an `m x k` view `a` and a `k x n` view `b`, given
/// as `(row stride, column stride)`:
/// - [`product_dots`] for thin products whose operands are contiguous along the depth: few rows
///   against a transposed right operand (or few columns against a left one), long depth (a
///   convolution's weight gradient with few output channels; a linear layer of a small batch).
///   Packing the large operand costs as much as the product there; dot products need no packing
///   (on AVX-512, `tiles::product` runs them: 110-130 GFLOP/s for the mlp's forward products
///   against 55-65 in dot products and 47-73 in `gemm` on one core, BENCHMARKS.md);
/// - on AVX-512, `tiles::product` ([`ProductKernel::Tiles`]) for the other products whose operands
///   are both contiguous along the depth with at most [`TILES_MAX_SIDE`] rows or columns (and,
///   as for dot products, more than 256 outputs and a depth of at least 256: on the small
///   products of MobileNetV3's 1x1 weight gradients the tiles' copies and allocations made its
///   step 5-10% slower): a
///   convolution's weight gradient `dy @ col^T` with 64 output channels ran at 0.69-0.71 of
///   `gemm`'s time (64 x 576 x 3136), while with 128 to 512 channels `gemm`'s packed products
///   were 4-22% faster (`cargo bench -p kernels --bench train weight_grad`, BENCHMARKS.md);
/// - `matrixmultiply` where it measured faster on the target: [16..64, k] x [k, n]^T with k
///   around 1024 (the mlp's layers: 64 against 42 GFLOP/s), but not for the long k of
///   convolution weight gradients (k = output pixels); and [m, k]^T x [k, < 64] (resnet18's
///   last-stage input gradients);
/// - `gemm` otherwise.
fn choose(m: usize, n: usize, k: usize, a: (isize, isize), b: (isize, isize)) -> ProductKernel {
    let along_depth = a.1 == 1 && b.0 == 1;
    if along_depth && (2..=DOTS_MAX_SIDE).contains(&m.min(n)) && m * n > DOTS_GEMM_MAX_MN && k >= DOTS_MIN_K {
        return ProductKernel::Dots;
    }
    if along_depth && F::tiles() && m.min(n) <= TILES_MAX_SIDE && m * n > DOTS_GEMM_MAX_MN && k >= DOTS_MIN_K {
        return ProductKernel::Tiles;
    }
    let trans_a = a.1 != 1;
    let trans_b = b.1 != 1;
    if (trans_b && !trans_a && (16..=64).contains(&m) && (512..=2048).contains(&k))
        || (trans_a && !trans_b && n < 64 && m >= 256)
    {
        ProductKernel::MatrixMultiply
    } else {
        ProductKernel::Gemm
    }
}

/// The implementation a single-threaded `op(a) @ op(b)` of packed row-major matrices runs (as
/// the `Gemm` op's kernel calls it with one thread; `op(a)` is `m x k`, `op(b)` is `k x n`):
/// what the cost model's families follow (`sharding::cost_family`). With more threads each
/// thread's block of the product chooses by its own shape, and with f64 accumulation every
/// product is `gemm`'s.
pub fn gemm_kernel(m: usize, n: usize, k: usize, trans_a: bool, trans_b: bool) -> ProductKernel {
    let a = if trans_a { (1, m as isize) } else { (k as isize, 1) };
    let b = if trans_b { (1, k as isize) } else { (n as isize, 1) };
    choose(m, n, k, a, b)
}

/// [`product_dots`] takes the products with 2 to this many rows or columns (`gemm` multiplies a
/// single row at 39 GFLOP/s, 1 x 1000 x 512), more than `DOTS_GEMM_MAX_MN` outputs (`gemm` has
/// its own fast path for fewer: 100 GFLOP/s for 4 x 36 against 60-70 here) and at least this
/// depth. Measured on the target (GFLOP/s, depth 1024): 8 x 216: 5 `gemm`, 10 `matrixmultiply`,
/// 53-73 here; 16 x 144: 11, 25, 65-74; 32 x 288: 20, 42, 70; 32 x 1024: 70 here (64 in
/// `matrixmultiply`, BENCHMARKS.md); 2 x 1000 x 512: 2 in `gemm`, 9 here. At 64 x 576 (depth
/// 3136) `gemm` is ahead again: 77 against 57.
const DOTS_MAX_SIDE: usize = 32;
/// See [`choose`].
const TILES_MAX_SIDE: usize = 64;
const DOTS_GEMM_MAX_MN: usize = 256;
const DOTS_MIN_K: usize = 256;

/// `c = alpha * a @ b + beta * c` as one dot product per element, for `a` contiguous along its
/// rows and `b` along its columns (`a.cs == 1`, `b.rs == 1`): `DOT_MR` rows of `a` against
/// `DOT_NR` columns of `b` at a time, `DOT_LANES` partial sums each, compiled for AVX2 when the
/// CPU has it. Measured against `gemm` for 8 rows, 216 columns and depth 1024 (a 3x3
/// convolution's weight gradient, 8 output channels, 24 input channels, 32x32): see
/// BENCHMARKS.md.
///
/// # Safety
/// As [`product_f32`].
#[allow(clippy::too_many_arguments)]
unsafe fn product_dots(m: usize, n: usize, k: usize, a: View, b: View, c: *mut F, ldc: usize, alpha: F, beta: F) {
    super::elementwise::with_simd(|| {
        // The long side streams through once, against blocks of the short side's operand,
        // which stays in cache (at most 32 rows or columns of the depth).
        let (outer, inner) =
            if m <= n { (n.div_ceil(DOT_NR), m.div_ceil(DOT_MR)) } else { (m.div_ceil(DOT_MR), n.div_ceil(DOT_NR)) };
        for o in 0..outer {
            for t in 0..inner {
                let (i, j) = if m <= n { (t * DOT_MR, o * DOT_NR) } else { (o * DOT_MR, t * DOT_NR) };
                let (mr, nr) = ((m - i).min(DOT_MR), (n - j).min(DOT_NR));
                let row = |r: usize| a.ptr.wrapping_offset((i + r) as isize * a.rs);
                let col = |q: usize| b.ptr.wrapping_offset((j + q) as isize * b.cs);
                // SAFETY: (i + r, j + q) is inside c's m x n block with row stride ldc for r < mr
                // and q < nr; rows and columns hold k elements each (the caller's views).
                let o = (unsafe { c.add(i * ldc + j) }, ldc);
                let ab = (alpha, beta);
                unsafe {
                    match (mr, nr) {
                        (4, 2) => dot_block::<4, 2>(k, [row(0), row(1), row(2), row(3)], [col(0), col(1)], o, ab),
                        (4, _) => dot_block::<4, 1>(k, [row(0), row(1), row(2), row(3)], [col(0)], o, ab),
                        (3, 2) => dot_block::<3, 2>(k, [row(0), row(1), row(2)], [col(0), col(1)], o, ab),
                        (3, _) => dot_block::<3, 1>(k, [row(0), row(1), row(2)], [col(0)], o, ab),
                        (2, 2) => dot_block::<2, 2>(k, [row(0), row(1)], [col(0), col(1)], o, ab),
                        (2, _) => dot_block::<2, 1>(k, [row(0), row(1)], [col(0)], o, ab),
                        (_, 2) => dot_block::<1, 2>(k, [row(0)], [col(0), col(1)], o, ab),
                        _ => dot_block::<1, 1>(k, [row(0)], [col(0)], o, ab),
                    }
                }
            }
        }
    })
}

/// `MR x NR` results of [`product_dots`] at `out` (row stride `ldc`): the dot products of
/// `rows` and `cols`, `k` long, with `DOT_LANES` partial sums each. Inlined into
/// [`product_dots`]'s AVX2 closure (dispatching to an AVX2 function per block instead ran at
/// 8 GFLOP/s).
///
/// # Safety
/// `rows` and `cols` hold `k` elements each; `out` covers the `MR x NR` block.
#[inline(always)]
unsafe fn dot_block<const MR: usize, const NR: usize>(
    k: usize,
    rows: [*const F; MR],
    cols: [*const F; NR],
    (out, ldc): (*mut F, usize),
    (alpha, beta): (F, F),
) {
    const L: usize = DOT_LANES;
    let kb = k / L * L;
    let mut acc = [[[F::default(); L]; NR]; MR];
    for p in (0..kb).step_by(L) {
        // SAFETY: p + L <= kb <= k.
        let av: [[F; L]; MR] = std::array::from_fn(|r| unsafe { rows[r].add(p).cast::<[F; L]>().read_unaligned() });
        for q in 0..NR {
            // SAFETY: as above.
            let bv = unsafe { cols[q].add(p).cast::<[F; L]>().read_unaligned() };
            for r in 0..MR {
                for l in 0..L {
                    acc[r][q][l] += av[r][l] * bv[l];
                }
            }
        }
    }
    for r in 0..MR {
        for q in 0..NR {
            let mut s: F = acc[r][q].iter().copied().fold(F::default(), |x, y| x + y);
            for p in kb..k {
                // SAFETY: p < k.
                s += unsafe { *rows[r].add(p) * *cols[q].add(p) };
            }
            // SAFETY: inside the caller's block.
            let o = unsafe { &mut *out.add(r * ldc + q) };
            *o = if beta == F::default() { alpha * s } else { alpha * s + beta * *o };
        }
    }
}

/// Rows of `a` and columns of `b` per block of [`product_dots`], and the partial sums per dot
/// product (one AVX2 register of f32): 8 accumulators, 4 + 1 operand registers.
const DOT_MR: usize = 4;
const DOT_NR: usize = 2;
const DOT_LANES: usize = 8;

fn bad(op: &'static str, message: String) -> Error {
    Error::BadInput { op, message }
}

/// `c = alpha * op(a) @ op(b) + beta * c` on packed row-major matrices.
///
/// `op(a)` is `m x k` (`a` holds `m x k`, or `k x m` when `trans_a`), `op(b)` is `k x n`, `c` is
/// `m x n`. When `beta == 0`, `c` is not read (NaNs in it do not propagate). Uses the context's
/// threads when the product is large enough.
#[allow(clippy::too_many_arguments)]
pub fn gemm_f32(
    ctx: &CpuContext,
    m: usize,
    n: usize,
    k: usize,
    a: &[F],
    trans_a: bool,
    b: &[F],
    trans_b: bool,
    c: &mut [F],
    alpha: F,
    beta: F,
) -> Result<(), Error> {
    gemm_with(Some(ctx), ctx.accumulation(), m, n, k, a, trans_a, b, trans_b, c, alpha, beta)
}

/// How a product may be split: over the threads of a context, or not at all (`None`, for
/// callers already inside a parallel loop).
pub(crate) type Par<'a> = Option<&'a CpuContext>;

/// [`gemm_f32`] with an explicit parallelism.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_with(
    par: Par,
    acc: Accumulation,
    m: usize,
    n: usize,
    k: usize,
    a: &[F],
    trans_a: bool,
    b: &[F],
    trans_b: bool,
    c: &mut [F],
    alpha: F,
    beta: F,
) -> Result<(), Error> {
    let sizes = (m.checked_mul(k), k.checked_mul(n), m.checked_mul(n));
    let (Some(mk), Some(kn), Some(mn)) = sizes else {
        return Err(bad("gemm", format!("size overflow: m={m} n={n} k={k}")));
    };
    if a.len() != mk || b.len() != kn || c.len() != mn {
        return Err(bad(
            "gemm",
            format!("buffer sizes a={} b={} c={} do not fit m={m} n={n} k={k}", a.len(), b.len(), c.len()),
        ));
    }
    if mn == 0 {
        return Ok(());
    }
    if k == 0 {
        if beta == 0.0 {
            c.fill(0.0);
        } else {
            c.iter_mut().for_each(|x| *x *= beta);
        }
        return Ok(());
    }
    let (lhs_cs, lhs_rs) = if trans_a { (m as isize, 1) } else { (1, k as isize) };
    let (rhs_cs, rhs_rs) = if trans_b { (k as isize, 1) } else { (1, n as isize) };
    if acc == Accumulation::F64 {
        let a64: Vec<f64> = a.iter().map(|&x| x as f64).collect();
        let b64: Vec<f64> = b.iter().map(|&x| x as f64).collect();
        let mut c64: Vec<f64> = if beta != 0.0 { c.iter().map(|&x| x as f64).collect() } else { vec![0.0; mn] };
        let (ap, bp, cp) = (a64.as_ptr() as usize, b64.as_ptr() as usize, super::SendPtr(c64.as_mut_ptr()));
        // Rows r0.. and columns j0.. of `c`, `rows x cols` of them (a block one thread owns).
        let block = |r0: usize, j0: usize, rows: usize, cols: usize| {
            // SAFETY: as below, on the f64 copies (same sizes and strides), for a block of `c`
            // inside its m x n and the rows of `a` and columns of `b` it reads.
            unsafe {
                gemm::gemm(
                    rows,
                    cols,
                    k,
                    cp.get().add(r0 * n + j0),
                    1,
                    n as isize,
                    beta != 0.0,
                    (ap as *const f64).offset(r0 as isize * lhs_rs),
                    lhs_cs,
                    lhs_rs,
                    (bp as *const f64).offset(j0 as isize * rhs_cs),
                    rhs_cs,
                    rhs_rs,
                    beta as f64,
                    alpha as f64,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
        };
        match split(par, m, n, k) {
            Some((ctx, by_cols, per, parts)) => ctx.run(parts, |t| {
                let lo = t * per;
                if by_cols { block(0, lo, m, per.min(n - lo)) } else { block(lo, 0, per.min(m - lo), n) }
            }),
            None => block(0, 0, m, n),
        }
        c.iter_mut().zip(c64).for_each(|(o, v)| *o = v as F);
        return Ok(());
    }
    let av = View { ptr: a.as_ptr(), rs: lhs_rs, cs: lhs_cs };
    let bv = View { ptr: b.as_ptr(), rs: rhs_rs, cs: rhs_cs };
    // SAFETY: the views cover exactly m*k, k*n and m*n elements (checked above) with these
    // strides; `c` is borrowed mutably, so it aliases neither input.
    unsafe { product_f32(par, m, n, k, av, bv, c.as_mut_ptr(), n, alpha, beta) };
    Ok(())
}

/// Offsets (in matrices) of every batch entry of an operand with batch dims `dims` broadcast to
/// `batch`.
fn batch_offsets(dims: &[usize], batch: &[usize]) -> Vec<usize> {
    let r = batch.len();
    let mut st = vec![0; r];
    let mut acc = 1;
    for i in (0..dims.len()).rev() {
        st[i + r - dims.len()] = if dims[i] == 1 { 0 } else { acc };
        acc *= dims[i];
    }
    let nb: usize = batch.iter().product();
    (0..nb)
        .map(|mut idx| {
            let mut off = 0;
            for d in (0..r).rev() {
                off += (idx % batch[d]) * st[d];
                idx /= batch[d];
            }
            off
        })
        .collect()
}

/// Numpy matmul: 1-D operands are promoted (and the added dim dropped), batch dims broadcast.
pub(crate) fn matmul(ctx: &CpuContext, a: &Tensor, b: &Tensor, out_shape: &[usize]) -> Result<Tensor, Error> {
    let (av, bv) = (floats("matmul", a)?, floats("matmul", b)?);
    let a2: Vec<usize> = if a.shape().len() == 1 { vec![1, a.shape()[0]] } else { a.shape().to_vec() };
    let b2: Vec<usize> = if b.shape().len() == 1 { vec![b.shape()[0], 1] } else { b.shape().to_vec() };
    let (m, k) = (a2[a2.len() - 2], a2[a2.len() - 1]);
    let n = b2[b2.len() - 1];
    let (ab, bb) = (&a2[..a2.len() - 2], &b2[..b2.len() - 2]);
    let batch = ir::broadcast_shapes(ab, bb).map_err(|e| bad("matmul", e))?;
    let nb: usize = batch.iter().product();
    let mut out = vec![0.0; nb * m * n];
    let b_single = bb.iter().product::<usize>() == 1;
    let a_full = ab.iter().product::<usize>() == nb;
    if b_single && a_full {
        // [batch.., m, k] @ [k, n]: one product with the batch folded into the rows.
        gemm_f32(ctx, nb * m, n, k, av, false, bv, false, &mut out, 1.0, 0.0)?;
    } else if nb > 0 {
        let (ao, bo) = (batch_offsets(ab, &batch), batch_offsets(bb, &batch));
        let (mk, kn, mn) = (m * k, k * n, m * n);
        let one = |i: usize, c: &mut [F], par| {
            let (x, y) = (ao[i] * mk, bo[i] * kn);
            gemm_with(par, ctx.accumulation(), m, n, k, &av[x..x + mk], false, &bv[y..y + kn], false, c, 1.0, 0.0)
        };
        if mn > 0 && ctx.threads() > 1 && nb > 1 && m * n * k < SMALL_GEMM_MACS && nb * m * n * k >= PAR_GEMM_MIN_MACS {
            let dst = super::SendPtr(out.as_mut_ptr());
            ctx.try_run(nb, |i| {
                // SAFETY: matrix i of `out` (nb * mn elements), written by this task only.
                one(i, unsafe { std::slice::from_raw_parts_mut(dst.get().add(i * mn), mn) }, None)
            })?;
        } else if mn > 0 {
            out.chunks_mut(mn).enumerate().try_for_each(|(i, c)| one(i, c, Some(ctx)))?;
        }
    }
    tensor("matmul", out_shape, F::data(out))
}

/// ONNX Gemm: `alpha * op(A) @ op(B) + beta * C`, C broadcast to `[m, n]`.
pub(crate) fn gemm_op(
    ctx: &CpuContext,
    inputs: &[&Tensor],
    alpha: f32,
    beta: f32,
    trans_a: bool,
    trans_b: bool,
    out_shape: &[usize],
) -> Result<Tensor, Error> {
    let (alpha, beta) = (alpha as F, beta as F);
    let (a, b) = (floats("gemm", inputs[0])?, floats("gemm", inputs[1])?);
    let (m, n) = (out_shape[0], out_shape[1]);
    let k = if trans_a { inputs[0].shape()[0] } else { inputs[0].shape()[1] };
    let (mut out, beta) = match inputs.get(2) {
        Some(c) if beta != 0.0 => (broadcast_f32(ctx, "gemm", c, out_shape)?, beta),
        _ => (vec![0.0; m * n], 0.0),
    };
    gemm_f32(ctx, m, n, k, a, trans_a, b, trans_b, &mut out, alpha, beta)?;
    tensor("gemm", out_shape, F::data(out))
}
