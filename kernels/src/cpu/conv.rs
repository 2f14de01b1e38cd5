//! 2-D convolution (im2col + GEMM; 1x1 convolutions skip im2col; depthwise ones run directly)
//! and pooling, NCHW.

use super::elementwise::with_simd;
use super::linalg::{View, gemm_with, product_f32};
use super::{Accumulation, CpuContext, floats, tensor};
use super::{F, Float};
use crate::Error;
use ir::{ConvAttrs, PoolAttrs, Tensor};

/// Range of output positions `o` (within `0..out`) whose input index `o * stride + off` lies in
/// `0..len`.
fn valid_range(off: isize, stride: usize, len: usize, out: usize) -> (usize, usize) {
    let s = stride as isize;
    let lo = if off >= 0 { 0 } else { ((-off) + s - 1) / s };
    let last = len as isize - 1 - off;
    let hi = if last < 0 { 0 } else { last / s + 1 };
    let lo = (lo as usize).min(out);
    (lo, (hi as usize).clamp(lo, out))
}

/// Where one kernel tap `(i, j)` reads: its offsets into the image and the output rows and
/// columns whose input lies inside it (the rest is padding). One per tap, shared by every
/// channel: computing them per im2col row (seven integer divisions) cost more than copying a
/// small map's row.
#[derive(Clone, Copy)]
pub(crate) struct Tap {
    pub offy: isize,
    pub offx: isize,
    pub rows: (usize, usize),
    pub cols: (usize, usize),
}

pub(crate) fn taps(h: usize, w: usize, kh: usize, kw: usize, a: &ConvAttrs, oh: usize, ow: usize) -> Vec<Tap> {
    (0..kh * kw)
        .map(|t| {
            let (i, j) = (t / kw, t % kw);
            let offy = (i * a.dilations[0]) as isize - a.pads[0] as isize;
            let offx = (j * a.dilations[1]) as isize - a.pads[1] as isize;
            Tap {
                offy,
                offx,
                rows: valid_range(offy, a.strides[0], h, oh),
                cols: valid_range(offx, a.strides[1], w, ow),
            }
        })
        .collect()
}

/// Fills `col` (`[cg*kh*kw, oh*ow]`) with the patches of `x` (`[cg, h, w]`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn im2col(
    ctx: Option<&CpuContext>,
    x: &[F],
    h: usize,
    w: usize,
    kh: usize,
    kw: usize,
    a: &ConvAttrs,
    oh: usize,
    ow: usize,
    col: &mut [F],
) {
    // An empty map or kernel: the matrix has no cells to fill.
    if oh * ow == 0 || kh * kw == 0 {
        return;
    }
    let taps = taps(h, w, kh, kw, a, oh, ow);
    match ctx {
        Some(ctx) if ctx.parallel_for(col.len()) => ctx.for_rows(col, oh * ow, |r, row| {
            let (c, t) = (r / taps.len(), r % taps.len());
            im2col_row(&x[c * h * w..(c + 1) * h * w], w, a.strides, ow, taps[t], 0, row)
        }),
        _ => im2col_rows(x, h, w, kh, kw, a, oh, ow, 0, col),
    }
}

/// Fills rows `row0..` of the im2col matrix of `x` into `col` (whole rows of `oh*ow`), on the
/// calling thread.
#[allow(clippy::too_many_arguments)]
pub(crate) fn im2col_rows(
    x: &[F],
    h: usize,
    w: usize,
    kh: usize,
    kw: usize,
    a: &ConvAttrs,
    oh: usize,
    ow: usize,
    row0: usize,
    col: &mut [F],
) {
    if oh * ow == 0 || kh * kw == 0 {
        return;
    }
    let taps = taps(h, w, kh, kw, a, oh, ow);
    let (mut c, mut t) = (row0 / taps.len(), row0 % taps.len());
    for row in col.chunks_mut(oh * ow) {
        im2col_row(&x[c * h * w..(c + 1) * h * w], w, a.strides, ow, taps[t], 0, row);
        t += 1;
        if t == taps.len() {
            (c, t) = (c + 1, 0);
        }
    }
}

/// Output rows per block of a blocked im2col ([`im2col_block`]) of `kk` rows: blocks of about
/// [`BLOCK_ELEMS`] elements stay in L2 between their filling and the product that reads them,
/// where the whole matrix (7 MB for resnet18's 64-channel 3x3 convolutions at 56x56) went to
/// memory and back; but at least `min_cols` columns, since a product's speed falls with its
/// width (resnet18's 512-channel 3x3 convolution at 7x7 was 27% slower in blocks of 4 rows).
pub(crate) fn block_rows(kk: usize, oh: usize, ow: usize, min_cols: usize) -> usize {
    let ow = ow.max(1);
    (BLOCK_ELEMS / (kk * ow).max(1)).max(min_cols.div_ceil(ow)).clamp(1, oh.max(1))
}

/// See [`block_rows`].
const BLOCK_ELEMS: usize = 1 << 18;

/// Fills `col` (`[rows, (oy1 - oy0) * ow]`) with rows `row0..` of the im2col matrix (as many
/// as `col` holds), their columns of output rows `oy0..oy1`, on the calling thread.
#[allow(clippy::too_many_arguments)]
pub(crate) fn im2col_block(
    x: &[F],
    (h, w): (usize, usize),
    taps: &[Tap],
    a: &ConvAttrs,
    ow: usize,
    (oy0, oy1): (usize, usize),
    row0: usize,
    col: &mut [F],
) {
    let len = (oy1 - oy0) * ow;
    if len == 0 || taps.is_empty() {
        return;
    }
    for (r, row) in col.chunks_mut(len).enumerate() {
        let (c, t) = ((row0 + r) / taps.len(), (row0 + r) % taps.len());
        im2col_row(&x[c * h * w..(c + 1) * h * w], w, a.strides, ow, taps[t], oy0, row);
    }
}

/// One row of the im2col matrix: what kernel tap `tap` sees of `plane` (one channel, `w`
/// wide) at every output position of output rows `oy0..` (as many as `row` holds).
#[inline]
fn im2col_row(plane: &[F], w: usize, strides: [usize; 2], ow: usize, tap: Tap, oy0: usize, row: &mut [F]) {
    let ((ylo, yhi), (xlo, xhi)) = (tap.rows, tap.cols);
    if ow <= 8 {
        // Element by element: on a narrow map, calls to fill and copy cost more than this.
        for (r, out) in row.chunks_mut(ow).enumerate() {
            let oy = oy0 + r;
            let inside = oy >= ylo && oy < yhi;
            let iy = ((oy * strides[0]) as isize + tap.offy) as usize;
            for (ox, o) in out.iter_mut().enumerate() {
                *o = if inside && ox >= xlo && ox < xhi {
                    plane[iy * w + ((ox * strides[1]) as isize + tap.offx) as usize]
                } else {
                    0.0
                };
            }
        }
        return;
    }
    for (r, out) in row.chunks_mut(ow).enumerate() {
        let oy = oy0 + r;
        // No column of this kernel tap lands in the image (a map narrower than the padded
        // kernel): `xlo + offx` may then be negative, so nothing may be computed from it.
        if oy < ylo || oy >= yhi || xlo == xhi {
            out.fill(0.0);
            continue;
        }
        let iy = (oy * strides[0]) as isize + tap.offy;
        let src = &plane[iy as usize * w..(iy as usize + 1) * w];
        out[..xlo].fill(0.0);
        out[xhi..].fill(0.0);
        let s = ((xlo * strides[1]) as isize + tap.offx) as usize;
        let dst = &mut out[xlo..xhi];
        match strides[1] {
            1 => dst.copy_from_slice(&src[s..s + dst.len()]),
            // A stride of two as its own loop (resnets' downsampling convolutions): the indexed
            // loop took 2 ns an element.
            2 => dst.iter_mut().zip(src[s..].iter().step_by(2)).for_each(|(o, &v)| *o = v),
            st => dst.iter_mut().zip(src[s..].iter().step_by(st)).for_each(|(o, &v)| *o = v),
        }
    }
}

/// True for a depthwise convolution (one input and one output channel per group) under f32
/// accumulation: [`depthwise`] and its gradients run it directly, tap by tap over the map.
/// Through im2col, one small product per channel cost 40-150 us per convolution on small maps
/// whatever their work (MobileNet's and EfficientNet's 2x2 and 4x4 maps).
pub(crate) fn is_depthwise(ctx: &CpuContext, a: &ConvAttrs, c: usize, m: usize) -> bool {
    a.group > 1 && a.group == c && a.group == m && ctx.accumulation() == Accumulation::F32
}

/// `out` (`[oh*ow]`) += every kernel tap's weight (`wts`, one per tap) times what it sees of
/// `plane` (`w` wide).
fn depthwise_plane(plane: &[F], w: usize, wts: &[F], taps: &[Tap], strides: [usize; 2], ow: usize, out: &mut [F]) {
    for (tap, &k) in taps.iter().zip(wts) {
        let ((ylo, yhi), (xlo, xhi)) = (tap.rows, tap.cols);
        if xlo == xhi {
            continue;
        }
        for oy in ylo..yhi {
            let iy = ((oy * strides[0]) as isize + tap.offy) as usize;
            let src = &plane[iy * w..(iy + 1) * w];
            let dst = &mut out[oy * ow + xlo..oy * ow + xhi];
            if strides[1] == 1 {
                let s = (xlo as isize + tap.offx) as usize;
                for (o, &v) in dst.iter_mut().zip(&src[s..s + (xhi - xlo)]) {
                    *o += k * v;
                }
            } else {
                for (o, ox) in dst.iter_mut().zip(xlo..xhi) {
                    *o += k * src[((ox * strides[1]) as isize + tap.offx) as usize];
                }
            }
        }
    }
}

/// The transpose of [`depthwise_plane`]: `plane` (`[h*w]`) += every tap's weight times `dy`
/// (`[oh*ow]`) put back where the tap read it.
fn depthwise_plane_t(dy: &[F], w: usize, wts: &[F], taps: &[Tap], strides: [usize; 2], ow: usize, plane: &mut [F]) {
    for (tap, &k) in taps.iter().zip(wts) {
        let ((ylo, yhi), (xlo, xhi)) = (tap.rows, tap.cols);
        if xlo == xhi {
            continue;
        }
        for oy in ylo..yhi {
            let iy = ((oy * strides[0]) as isize + tap.offy) as usize;
            let dst = &mut plane[iy * w..(iy + 1) * w];
            let src = &dy[oy * ow + xlo..oy * ow + xhi];
            if strides[1] == 1 {
                let s = (xlo as isize + tap.offx) as usize;
                for (o, &v) in dst[s..s + (xhi - xlo)].iter_mut().zip(src) {
                    *o += k * v;
                }
            } else {
                for (&v, ox) in src.iter().zip(xlo..xhi) {
                    dst[((ox * strides[1]) as isize + tap.offx) as usize] += k * v;
                }
            }
        }
    }
}

/// Shapes of a depthwise convolution: input `[n, c, h, w]`, kernel `kh x kw`, output `oh x ow`.
#[derive(Clone, Copy)]
pub(crate) struct Depthwise {
    pub n: usize,
    pub c: usize,
    pub h: usize,
    pub w: usize,
    pub kh: usize,
    pub kw: usize,
    pub oh: usize,
    pub ow: usize,
}

/// Depthwise convolution ([`is_depthwise`]): `out` (`[n, c, oh, ow]`, holding the bias or zeros)
/// += each channel's kernel over its plane of `x`.
pub(crate) fn depthwise(ctx: &CpuContext, a: &ConvAttrs, d: Depthwise, x: &[F], wts: &[F], out: &mut [F]) {
    let (kk, plane, p) = (d.kh * d.kw, d.h * d.w, d.oh * d.ow);
    let taps = taps(d.h, d.w, d.kh, d.kw, a, d.oh, d.ow);
    ctx.for_rows_weighted(out, p.max(1), kk, |r, o| {
        let ch = r % d.c;
        with_simd(|| {
            depthwise_plane(
                &x[r * plane..(r + 1) * plane],
                d.w,
                &wts[ch * kk..(ch + 1) * kk],
                &taps,
                a.strides,
                d.ow,
                o,
            )
        })
    });
}

/// The gradient of [`depthwise`] with respect to its input (`dx`, `[n, c, h, w]`, zeros).
pub(crate) fn depthwise_input_grad(ctx: &CpuContext, a: &ConvAttrs, d: Depthwise, dy: &[F], wts: &[F], dx: &mut [F]) {
    let (kk, plane, p) = (d.kh * d.kw, d.h * d.w, d.oh * d.ow);
    let taps = taps(d.h, d.w, d.kh, d.kw, a, d.oh, d.ow);
    ctx.for_rows_weighted(dx, plane.max(1), kk, |r, o| {
        let ch = r % d.c;
        with_simd(|| {
            depthwise_plane_t(&dy[r * p..(r + 1) * p], d.w, &wts[ch * kk..(ch + 1) * kk], &taps, a.strides, d.ow, o)
        })
    });
}

/// The gradient of [`depthwise`] with respect to its weight (`dw`, `[c, 1, kh, kw]`): each
/// tap's products summed over the images and the map, image by image in order.
pub(crate) fn depthwise_weight_grad(ctx: &CpuContext, a: &ConvAttrs, d: Depthwise, x: &[F], dy: &[F], dw: &mut [F]) {
    let (kk, plane, p) = (d.kh * d.kw, d.h * d.w, d.oh * d.ow);
    let taps = taps(d.h, d.w, d.kh, d.kw, a, d.oh, d.ow);
    ctx.for_rows_weighted(dw, kk.max(1), d.n * p, |ch, row| {
        with_simd(|| {
            for (tap, out) in taps.iter().zip(row.iter_mut()) {
                let ((ylo, yhi), (xlo, xhi)) = (tap.rows, tap.cols);
                // Eight partial sums: the loop vectorises, and the order is fixed.
                let mut acc = [0.0 as F; 8];
                let mut add = |i: usize, v: F| acc[i % 8] += v;
                for ni in 0..d.n {
                    let r = ni * d.c + ch;
                    let (xp, dp) = (&x[r * plane..(r + 1) * plane], &dy[r * p..(r + 1) * p]);
                    for oy in ylo..yhi {
                        let iy = ((oy * a.strides[0]) as isize + tap.offy) as usize;
                        let g = &dp[oy * d.ow..(oy + 1) * d.ow];
                        for ox in xlo..xhi {
                            add(ox, g[ox] * xp[iy * d.w + ((ox * a.strides[1]) as isize + tap.offx) as usize]);
                        }
                    }
                }
                *out = acc.iter().sum();
            }
        })
    });
}

/// True for 1x1 convolutions with stride 1 and no padding, whose im2col is the input itself.
pub(crate) fn is_direct(a: &ConvAttrs, kh: usize, kw: usize) -> bool {
    kh == 1 && kw == 1 && a.strides == [1, 1] && a.pads == [0, 0, 0, 0]
}

/// Runs `run(task, chunk, scratch, inner_ctx)` for each `chunk`-long piece of
/// `out` (one per (image, group) of a convolution, `macs` multiply-adds each). When the tasks
/// split evenly over the threads (a batch of two on two threads) or are many, they run in
/// parallel, each sequential: no synchronisation inside a task, and each thread packs its own
/// operands. Otherwise tasks run in turn, each using the whole pool.
pub(crate) fn per_group(
    ctx: &CpuContext,
    out: &mut [F],
    chunk: usize,
    macs: usize,
    run: impl Fn(usize, &mut [F], &mut Vec<F>, Option<&CpuContext>) -> Result<(), Error> + Sync + Send,
) -> Result<(), Error> {
    let chunk = chunk.max(1);
    let tasks = out.len() / chunk;
    let t = ctx.threads();
    if t > 1 && tasks >= t && (tasks.is_multiple_of(t) || tasks >= 4 * t || macs < (1 << 22)) {
        // Groups of tasks share one scratch buffer: enough groups to balance the threads, few
        // enough that the im2col buffer is not allocated for every (image, group).
        let per = tasks.div_ceil(4 * t);
        let dst = super::SendPtr(out.as_mut_ptr());
        ctx.try_run(tasks.div_ceil(per), |j| {
            let mut col = Vec::new();
            for i in j * per..((j + 1) * per).min(tasks) {
                // SAFETY: chunk i of `out` (tasks whole chunks), written by this task only.
                let o = unsafe { std::slice::from_raw_parts_mut(dst.get().add(i * chunk), chunk) };
                run(i, o, &mut col, None)?;
            }
            Ok(())
        })
    } else {
        let mut col = Vec::new();
        for (t, o) in out.chunks_mut(chunk).enumerate() {
            run(t, o, &mut col, Some(ctx))?;
        }
        Ok(())
    }
}

/// Conv: X `[N,C,H,W]`, W `[M,C/group,kh,kw]`, optional bias `[M]`.
pub(crate) fn conv(ctx: &CpuContext, a: &ConvAttrs, inputs: &[&Tensor], out_shape: &[usize]) -> Result<Tensor, Error> {
    let (x, w) = (floats("conv", inputs[0])?, floats("conv", inputs[1])?);
    let (xs, ws) = (inputs[0].shape(), inputs[1].shape());
    let (n, c, h, wd) = (xs[0], xs[1], xs[2], xs[3]);
    let (m, cg, kh, kw) = (ws[0], ws[1], ws[2], ws[3]);
    let (oh, ow) = (out_shape[2], out_shape[3]);
    let g = a.group;
    let mg = m / g;
    let kk = cg * kh * kw;
    let p = oh * ow;
    let mut out = vec![0.0; n * m * p];
    let has_bias = inputs.len() > 2;
    if has_bias {
        let bias = floats("conv", inputs[2])?;
        ctx.for_rows(&mut out, p.max(1), |r, row| row.fill(bias[r % m]));
    }
    if out.is_empty() {
        return tensor("conv", out_shape, F::data(out));
    }
    if cg == 1 && is_depthwise(ctx, a, c, m) {
        let d = Depthwise { n, c, h, w: wd, kh, kw, oh, ow };
        depthwise(ctx, a, d, x, w, &mut out);
        return tensor("conv", out_shape, F::data(out));
    }
    let beta = if has_bias { 1.0 } else { 0.0 };
    let direct = is_direct(a, kh, kw);
    let plane = h * wd;
    let blocked = !direct && ctx.accumulation() == Accumulation::F32;
    let taps = taps(h, wd, kh, kw, a, oh, ow);
    let rows = block_rows(kk, oh, ow, 256);
    let run = |t: usize, outg: &mut [F], col: &mut Vec<F>, inner: Option<&CpuContext>| -> Result<(), Error> {
        let (ni, gi) = (t / g, t % g);
        let xin = &x[(ni * c + gi * cg) * plane..(ni * c + (gi + 1) * cg) * plane];
        let wg = &w[gi * mg * kk..(gi + 1) * mg * kk];
        if blocked {
            // The product by blocks of output rows, each block's patches built just before.
            for oy0 in (0..oh).step_by(rows) {
                let oy1 = (oy0 + rows).min(oh);
                let cols = (oy1 - oy0) * ow;
                col.resize(kk * cols, 0.0);
                im2col_block(xin, (h, wd), &taps, a, ow, (oy0, oy1), 0, col);
                let wv = View { ptr: wg.as_ptr(), rs: kk as isize, cs: 1 };
                let cv = View { ptr: col.as_ptr(), rs: cols as isize, cs: 1 };
                // SAFETY: `wv` is mg x kk, `cv` kk x cols; the block of `outg` (mg x p, row
                // stride p) from column oy0 * ow is mg x cols and aliases neither.
                unsafe { product_f32(inner, mg, cols, kk, wv, cv, outg[oy0 * ow..].as_mut_ptr(), p, 1.0, beta) };
            }
            return Ok(());
        }
        let colv: &[F] = if direct {
            xin
        } else {
            col.resize(kk * p, 0.0);
            im2col(inner, xin, h, wd, kh, kw, a, oh, ow, col);
            col
        };
        gemm_with(inner, ctx.accumulation(), mg, p, kk, wg, false, colv, false, outg, 1.0, beta)
    };
    per_group(ctx, &mut out, mg * p, mg * kk * p, run)?;
    tensor("conv", out_shape, F::data(out))
}

/// Visits the in-image cells of the window of output `(oy, ox)` in row-major order: calls
/// `f(index in the h x w plane)` for each.
#[inline]
pub(crate) fn window_cells(a: &PoolAttrs, h: usize, w: usize, oy: usize, ox: usize, mut f: impl FnMut(usize)) {
    if a.dilations == [1, 1] {
        // Clip the window once instead of testing every cell.
        let (ya, yb) = clip(oy, a, 0, h);
        let (xa, xb) = clip(ox, a, 1, w);
        for y in ya..yb {
            for x in xa..xb {
                f(y * w + x);
            }
        }
        return;
    }
    let y0 = (oy * a.strides[0]) as isize - a.pads[0] as isize;
    let x0 = (ox * a.strides[1]) as isize - a.pads[1] as isize;
    for i in 0..a.kernel[0] {
        let y = y0 + (i * a.dilations[0]) as isize;
        if y < 0 || y >= h as isize {
            continue;
        }
        for j in 0..a.kernel[1] {
            let x = x0 + (j * a.dilations[1]) as isize;
            if x >= 0 && x < w as isize {
                f(y as usize * w + x as usize);
            }
        }
    }
}

/// The divisor of average pooling for output `(oy, ox)`: its in-image cells, or with
/// `count_include_pad` its cells inside the padded input (cells past the end padding, possible
/// with `ceil_mode`, never count).
pub(crate) fn avg_divisor(a: &PoolAttrs, h: usize, w: usize, oy: usize, ox: usize) -> usize {
    if !a.count_include_pad {
        let mut n = 0;
        window_cells(a, h, w, oy, ox, |_| n += 1);
        return n;
    }
    let padded = |o: usize, d: usize, len: usize| -> usize {
        let start = (o * a.strides[d]) as isize - a.pads[d] as isize;
        let end = (len + a.pads[d + 2]) as isize;
        (0..a.kernel[d]).filter(|&i| start + ((i * a.dilations[d]) as isize) < end).count()
    };
    padded(oy, 0, h) * padded(ox, 1, w)
}

/// The in-image range `[lo, hi)` along dim `d` (of size `len`) of output `o`'s window, for
/// dilation 1.
#[inline]
pub(crate) fn clip(o: usize, a: &PoolAttrs, d: usize, len: usize) -> (usize, usize) {
    let start = (o * a.strides[d]) as isize - a.pads[d] as isize;
    let lo = start.max(0) as usize;
    let hi = (start + a.kernel[d] as isize).clamp(0, len as isize) as usize;
    (lo.min(hi), hi)
}

/// Index in `plane` of the first maximal in-image cell of output `(oy, ox)`'s window (a NaN
/// wins), or `None` for a window entirely in the padding. Max pooling and its gradient both use
/// it, so they agree on ties.
#[inline]
pub(crate) fn window_argmax(a: &PoolAttrs, plane: &[F], h: usize, w: usize, oy: usize, ox: usize) -> Option<usize> {
    let mut best = F::NEG_INFINITY;
    let mut at = None;
    window_cells(a, h, w, oy, ox, |k| {
        let v = plane[k];
        if v > best || v.is_nan() || at.is_none() {
            best = v;
            at = Some(k);
        }
    });
    at
}

/// Calls `f(output index, window_argmax(..))` for every output of one `h x w` plane, in row-major
/// order: the same cells [`window_argmax`] picks, with the window clipping hoisted out of the loop
/// and full 3x3 windows unrolled (max pooling was ~17 ns per output through the generic walk).
#[allow(clippy::too_many_arguments)]
#[inline]
pub(crate) fn plane_argmax(
    a: &PoolAttrs,
    plane: &[F],
    h: usize,
    w: usize,
    oh: usize,
    ow: usize,
    xr: &[(usize, usize)],
    mut f: impl FnMut(usize, Option<usize>),
) {
    if a.dilations != [1, 1] {
        for oy in 0..oh {
            for ox in 0..ow {
                f(oy * ow + ox, window_argmax(a, plane, h, w, oy, ox));
            }
        }
        return;
    }
    // The first cell is taken, then a later one wins when greater or NaN (window_argmax's rule).
    // Without NaNs in the plane, branch-free: on a ReLU's output the comparisons go either way at
    // random, and the mispredicted branches took 3/4 of the time (0.42 ms for resnet50's 64 x
    // 32 x 32 max pool in a training step, 0.1 ms when the same input was pooled over and over).
    let finite = !plane.iter().fold(false, |nan, v| nan | v.is_nan());
    let pick = |plane: &[F], best: &mut F, at: &mut usize, k: usize| {
        let v = plane[k];
        if finite {
            let take = 0usize.wrapping_sub((v > *best) as usize);
            *at = (*at & !take) | (k & take);
            *best = best.max(v);
        } else if v > *best || v.is_nan() {
            *best = v;
            *at = k;
        }
    };
    for oy in 0..oh {
        let (ya, yb) = clip(oy, a, 0, h);
        for (ox, &(xa, xb)) in xr.iter().enumerate() {
            let out = oy * ow + ox;
            if ya == yb || xa == xb {
                f(out, None);
                continue;
            }
            let first = ya * w + xa;
            let (mut best, mut at) = (plane[first], first);
            if yb - ya == 3 && xb - xa == 3 {
                pick(plane, &mut best, &mut at, first + 1);
                pick(plane, &mut best, &mut at, first + 2);
                for r in [first + w, first + 2 * w] {
                    pick(plane, &mut best, &mut at, r);
                    pick(plane, &mut best, &mut at, r + 1);
                    pick(plane, &mut best, &mut at, r + 2);
                }
            } else {
                for y in ya..yb {
                    for x in xa..xb {
                        if y != ya || x != xa {
                            pick(plane, &mut best, &mut at, y * w + x);
                        }
                    }
                }
            }
            f(out, Some(at));
        }
    }
}

/// The clipped column range of every output column's window (dilation 1), for [`plane_argmax`].
pub(crate) fn column_ranges(a: &PoolAttrs, w: usize, ow: usize) -> Vec<(usize, usize)> {
    (0..ow).map(|ox| clip(ox, a, 1, w)).collect()
}

/// Max pooling; padding cells never win.
pub(crate) fn max_pool(ctx: &CpuContext, a: &PoolAttrs, x: &Tensor, out_shape: &[usize]) -> Result<Tensor, Error> {
    let xv = floats("maxpool", x)?;
    let (h, w) = (x.shape()[2], x.shape()[3]);
    let (oh, ow) = (out_shape[2], out_shape[3]);
    let mut out = vec![0.0; out_shape.iter().product()];
    let xr = column_ranges(a, w, ow);
    ctx.for_rows_weighted(&mut out, (oh * ow).max(1), a.kernel[0] * a.kernel[1], |r, row| {
        let plane = &xv[r * h * w..(r + 1) * h * w];
        if a.dilations == [1, 1] {
            with_simd(|| plane_max(a, plane, (h, w), ow, &xr, row));
        } else {
            plane_argmax(a, plane, h, w, oh, ow, &xr, |o, k| row[o] = k.map_or(F::NEG_INFINITY, |k| plane[k]));
        }
    });
    tensor("maxpool", out_shape, F::data(out))
}

/// The larger of `m` and `v`, or a NaN when either is one (max pooling's rule: a NaN wins).
#[inline(always)]
fn nan_max(m: F, v: F) -> F {
    if v > m || v.is_nan() { v } else { m }
}

/// Max pooling of one plane with dilation 1 (`out` holds its `oh x ow` outputs): the window
/// rows' maximum per column first (a loop that vectorises), then each window's columns of it;
/// the window walk of [`plane_argmax`] cost 8 ns an output (3.4 ms of resnet18's step).
fn plane_max(a: &PoolAttrs, plane: &[F], (h, w): (usize, usize), ow: usize, xr: &[(usize, usize)], out: &mut [F]) {
    let mut cols = vec![F::NEG_INFINITY; w];
    for (oy, o) in out.chunks_mut(ow.max(1)).enumerate() {
        let (ya, yb) = clip(oy, a, 0, h);
        if ya == yb {
            o.fill(F::NEG_INFINITY);
            continue;
        }
        cols.copy_from_slice(&plane[ya * w..(ya + 1) * w]);
        for y in ya + 1..yb {
            for (m, &v) in cols.iter_mut().zip(&plane[y * w..(y + 1) * w]) {
                *m = nan_max(*m, v);
            }
        }
        for (o, &(xa, xb)) in o.iter_mut().zip(xr) {
            *o = if xa == xb { F::NEG_INFINITY } else { cols[xa + 1..xb].iter().fold(cols[xa], |m, &v| nan_max(m, v)) };
        }
    }
}

/// Average pooling (divisor: [`avg_divisor`]).
pub(crate) fn avg_pool(ctx: &CpuContext, a: &PoolAttrs, x: &Tensor, out_shape: &[usize]) -> Result<Tensor, Error> {
    let xv = floats("avgpool", x)?;
    let (h, w) = (x.shape()[2], x.shape()[3]);
    let (oh, ow) = (out_shape[2], out_shape[3]);
    let mut out = vec![0.0; out_shape.iter().product()];
    ctx.for_rows_weighted(&mut out, (oh * ow).max(1), a.kernel[0] * a.kernel[1], |r, row| {
        let plane = &xv[r * h * w..(r + 1) * h * w];
        for oy in 0..oh {
            for ox in 0..ow {
                let mut sum = 0.0 as F;
                window_cells(a, h, w, oy, ox, |k| sum += plane[k]);
                let cnt = avg_divisor(a, h, w, oy, ox);
                row[oy * ow + ox] = if cnt == 0 { 0.0 } else { sum / cnt as F };
            }
        }
    });
    tensor("avgpool", out_shape, F::data(out))
}

/// Mean or max over all spatial dims (`[N, C, ...] -> [N, C, 1, ...]`).
pub(crate) fn global_pool(ctx: &CpuContext, x: &Tensor, max: bool) -> Result<Tensor, Error> {
    let op = if max { "global_maxpool" } else { "global_avgpool" };
    let xv = floats(op, x)?;
    let s = x.shape();
    let (nc, sp) = (s[0] * s[1], s[2..].iter().product::<usize>());
    let mut out = vec![0.0; nc];
    ctx.for_rows_weighted(&mut out, 1, sp, |r, o| {
        let v = &xv[r * sp..(r + 1) * sp];
        o[0] = if max {
            v.iter().fold(F::NEG_INFINITY, |m, &x| if x > m || x.is_nan() { x } else { m })
        } else {
            (v.iter().map(|&x| x as f64).sum::<f64>() / sp as f64) as F
        };
    });
    let mut shape = s.to_vec();
    shape[2..].iter_mut().for_each(|d| *d = 1);
    tensor(op, &shape, F::data(out))
}
