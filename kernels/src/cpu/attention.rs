//! Fused attention and its gradient ([`ir::Op::Attention`], [`ir::Op::AttentionGrad`]; the
//! semantics are in `ir::ops::attention`), computed as flash attention computes them: per
//! (batch, head), blocks of [`BLOCK`] query rows, each block's scores `[rows, keys]` in a scratch
//! buffer (never the whole `S x T`), a two-pass softmax over them, and the products with the
//! strided matrix product of `matrixmultiply` (one thread per task). A causal block computes only
//! the keys its last row attends. The backward recomputes each block's probabilities from the
//! forward's row log-sum-exp `L`: `P = exp(s - L)`, `dV += Pᵀ dY`, `dP = dY Vᵀ`,
//! `dS = P (dP - rowsum(dY Y))`, `dQ = dS K`, `dK += dSᵀ Q`, one task per (batch, key/value head)
//! so that the query heads sharing a key/value head add into its dK and dV in a fixed order.
//!
//! Products accumulate in the kernel's float type whatever the context's [`super::Accumulation`]
//! is: each output row is computed from whole rows of K and V in one order, so a plan splitting
//! the batch, the heads or the query rows computes bit for bit what one device does (only dK and
//! dV under a query split are sums over ranks).

use super::elementwise::{exp_fast, with_simd};
use super::{CpuContext, F, Float, floats, tensor};
use crate::Error;
use ir::{AttentionAttrs, AttentionDims, Tensor};

/// Query rows per block.
const BLOCK: usize = 64;

/// `c = alpha a b + beta c` for an `m x k` matrix `a` and a `k x n` matrix `b`, each given by
/// its row and column strides in elements, into the row-major `m x n` matrix `c` (with `beta`
/// 0, `c` is not read).
#[allow(clippy::too_many_arguments)]
fn mm(
    m: usize,
    k: usize,
    n: usize,
    alpha: F,
    a: &[F],
    (rsa, csa): (usize, usize),
    b: &[F],
    (rsb, csb): (usize, usize),
    beta: F,
    c: &mut [F],
) {
    if m == 0 || n == 0 {
        return;
    }
    let c = &mut c[..m * n];
    if k == 0 {
        c.iter_mut().for_each(|x| *x = if beta == 0.0 { 0.0 } else { *x * beta });
        return;
    }
    // The extents the strides reach, checked so the call below stays inside the slices.
    assert!((m - 1) * rsa + (k - 1) * csa < a.len() && (k - 1) * rsb + (n - 1) * csb < b.len());
    // SAFETY: `a` and `b` hold every element the strides address (checked above), `c` holds
    // `m * n` elements with row stride `n`, and `c` is a distinct, exclusively borrowed slice.
    unsafe {
        F::mm_gemm(
            m,
            k,
            n,
            alpha,
            a.as_ptr(),
            rsa as isize,
            csa as isize,
            b.as_ptr(),
            rsb as isize,
            csb as isize,
            beta,
            c.as_mut_ptr(),
            n as isize,
            1,
        )
    }
}

/// The mask, read through its broadcast to `[B, Hq, S, T]` (stride 0 on its size-1 dims).
enum Mask<'a> {
    None,
    Bool(&'a [bool], [usize; 4]),
    Add(&'a [F], [usize; 4]),
}

impl<'a> Mask<'a> {
    fn new(op: &'static str, t: Option<&&'a Tensor>) -> Result<Mask<'a>, Error> {
        let Some(t) = t else { return Ok(Mask::None) };
        let s = t.shape();
        let mut full = [1usize; 4];
        full[4 - s.len()..].copy_from_slice(s);
        let mut strides = [0usize; 4];
        let mut acc = 1;
        for d in (0..4).rev() {
            strides[d] = if full[d] == 1 { 0 } else { acc };
            acc *= full[d];
        }
        Ok(match t.as_bool() {
            Some(v) => Mask::Bool(v, strides),
            None => Mask::Add(floats(op, t)?, strides),
        })
    }

    /// Adds the mask of (b, h, query i) to a row of scores over keys `0..row.len()`; a masked
    /// key becomes `-inf` whatever its score.
    fn apply(&self, b: usize, h: usize, i: usize, row: &mut [F]) {
        match self {
            Mask::None => {}
            Mask::Bool(m, s) => {
                let base = b * s[0] + h * s[1] + i * s[2];
                for (j, x) in row.iter_mut().enumerate() {
                    if !m[base + j * s[3]] {
                        *x = F::NEG_INFINITY;
                    }
                }
            }
            Mask::Add(m, s) => {
                let base = b * s[0] + h * s[1] + i * s[2];
                for (j, x) in row.iter_mut().enumerate() {
                    let a = m[base + j * s[3]];
                    *x = if a == F::NEG_INFINITY { a } else { *x + a };
                }
            }
        }
    }
}

/// Runs `f` for tasks `0..n` (over the context's pool when `work` pays for it), in order.
fn tasks<R: Send>(ctx: &CpuContext, n: usize, work: usize, f: impl Fn(usize) -> R + Sync + Send) -> Vec<R> {
    if n > 1 && ctx.parallel_for(work) {
        let slots: Vec<std::sync::Mutex<Option<R>>> = (0..n).map(|_| std::sync::Mutex::new(None)).collect();
        ctx.run(n, |i| {
            let r = f(i);
            *slots[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
        });
        slots.into_iter().map(|s| s.into_inner().unwrap_or_else(|p| p.into_inner()).expect("every task ran")).collect()
    } else {
        (0..n).map(f).collect()
    }
}

/// The sizes of an attention from its first three inputs (checked by inference).
fn dims(op: &'static str, ins: &[&Tensor]) -> Result<AttentionDims, Error> {
    AttentionDims::of(ins[0].shape(), ins[1].shape(), ins[2].shape())
        .ok_or_else(|| Error::BadInput { op, message: "Q, K and V must be 4-D".into() })
}

/// Scaled, soft-capped, causally cut and masked scores of query rows `i0..i0 + rows` of head
/// (b, h) against keys `0..tk`: `s` holds them row-major (`rows x tk`) on return, with `-inf` for
/// every key a row does not attend.
#[allow(clippy::too_many_arguments)]
fn scores(
    a: &AttentionAttrs,
    x: &AttentionDims,
    mask: &Mask,
    (b, h, i0, rows, tk): (usize, usize, usize, usize, usize),
    q: &[F],
    k: &[F],
    s: &mut [F],
) {
    let d = x.d;
    mm(rows, d, tk, a.scale as F, &q[i0 * d..], (d, 1), k, (1, d), 0.0, s);
    let cap = a.softcap as F;
    for r in 0..rows {
        let row = &mut s[r * tk..(r + 1) * tk];
        if cap > 0.0 {
            row.iter_mut().for_each(|v| *v = cap * (*v / cap).tanh());
        }
        mask.apply(b, h, i0 + r, row);
        row[a.keys(i0 + r, tk)..].iter_mut().for_each(|v| *v = F::NEG_INFINITY);
    }
}

/// [`ir::Op::Attention`]: outputs Y and the row log-sum-exp.
pub(crate) fn attention(ctx: &CpuContext, a: &AttentionAttrs, ins: &[&Tensor]) -> Result<Vec<Tensor>, Error> {
    let op = "attention";
    let x = dims(op, ins)?;
    let (q, k, v) = (floats(op, ins[0])?, floats(op, ins[1])?, floats(op, ins[2])?);
    let mask = Mask::new(op, ins.get(3))?;
    let AttentionDims { b: nb, hq, s: ns, t: nt, d, dv, .. } = x;
    let group = x.group();
    let work = (nb * hq).saturating_mul(a.pairs(ns, nt) as usize).saturating_mul(d + dv);
    let heads = tasks(ctx, nb * hq, work, |bh| {
        let (b, h) = (bh / hq, bh % hq);
        let kv = b * x.hkv + h / group;
        let qh = &q[bh * ns * d..(bh + 1) * ns * d];
        let kh = &k[kv * nt * d..(kv + 1) * nt * d];
        let vh = &v[kv * nt * dv..(kv + 1) * nt * dv];
        let mut y = vec![0.0 as F; ns * dv];
        let mut l = vec![F::INFINITY; ns];
        let mut s = vec![0.0 as F; BLOCK.min(ns) * nt];
        for i0 in (0..ns).step_by(BLOCK) {
            let rows = BLOCK.min(ns - i0);
            let tk = a.keys(i0 + rows - 1, nt);
            if tk == 0 {
                continue;
            }
            let s = &mut s[..rows * tk];
            scores(a, &x, &mask, (b, h, i0, rows, tk), qh, kh, s);
            with_simd(|| {
                for (r, row) in s.chunks_mut(tk).enumerate() {
                    let max = row.iter().fold(F::NEG_INFINITY, |m, &v| m.max(v));
                    if max == F::NEG_INFINITY {
                        // No attended key: a zero row (and a statistic that gives P = 0).
                        row.iter_mut().for_each(|p| *p = 0.0);
                        continue;
                    }
                    let mut sum = 0.0 as F;
                    for p in row.iter_mut() {
                        *p = exp_fast(*p - max);
                        sum += *p;
                    }
                    let inv = 1.0 / sum;
                    row.iter_mut().for_each(|p| *p *= inv);
                    l[i0 + r] = max + sum.ln();
                }
            });
            mm(rows, tk, dv, 1.0, s, (tk, 1), vh, (dv, 1), 0.0, &mut y[i0 * dv..]);
        }
        (y, l)
    });
    let mut y = Vec::with_capacity(nb * hq * ns * dv);
    let mut l = Vec::with_capacity(nb * hq * ns);
    for (hy, hl) in heads {
        y.extend_from_slice(&hy);
        l.extend_from_slice(&hl);
    }
    Ok(vec![tensor(op, &[nb, hq, ns, dv], F::data(y))?, tensor(op, &[nb, hq, ns], F::data(l))?])
}

/// [`ir::Op::AttentionGrad`]: inputs Q, K, V, Y, L, dY (and the mask); outputs dQ, dK, dV.
pub(crate) fn attention_grad(ctx: &CpuContext, a: &AttentionAttrs, ins: &[&Tensor]) -> Result<Vec<Tensor>, Error> {
    let op = "attention_grad";
    let x = dims(op, ins)?;
    let (q, k, v) = (floats(op, ins[0])?, floats(op, ins[1])?, floats(op, ins[2])?);
    let (y, l, dy) = (floats(op, ins[3])?, floats(op, ins[4])?, floats(op, ins[5])?);
    let mask = Mask::new(op, ins.get(6))?;
    let AttentionDims { b: nb, hq, hkv, s: ns, t: nt, d, dv } = x;
    let group = x.group();
    let cap = a.softcap as F;
    let scale = a.scale as F;
    let work = (nb * hq).saturating_mul(a.pairs(ns, nt) as usize).saturating_mul(3 * d + 2 * dv);
    let parts = tasks(ctx, nb * hkv, work, |bk| {
        let b = bk / hkv;
        let kh = &k[bk * nt * d..(bk + 1) * nt * d];
        let vh = &v[bk * nt * dv..(bk + 1) * nt * dv];
        let mut dq = vec![0.0 as F; group * ns * d];
        let mut dk = vec![0.0 as F; nt * d];
        let mut dvv = vec![0.0 as F; nt * dv];
        let rows_max = BLOCK.min(ns);
        let (mut s, mut p, mut dp) =
            (vec![0.0 as F; rows_max * nt], vec![0.0 as F; rows_max * nt], vec![0.0 as F; rows_max * nt]);
        for g in 0..group {
            let h = (bk % hkv) * group + g;
            let bh = b * hq + h;
            let qh = &q[bh * ns * d..(bh + 1) * ns * d];
            let (yh, dyh) = (&y[bh * ns * dv..(bh + 1) * ns * dv], &dy[bh * ns * dv..(bh + 1) * ns * dv]);
            let lh = &l[bh * ns..(bh + 1) * ns];
            let dqh = &mut dq[g * ns * d..(g + 1) * ns * d];
            for i0 in (0..ns).step_by(BLOCK) {
                let rows = BLOCK.min(ns - i0);
                let tk = a.keys(i0 + rows - 1, nt);
                if tk == 0 {
                    continue;
                }
                let (s, p, dp) = (&mut s[..rows * tk], &mut p[..rows * tk], &mut dp[..rows * tk]);
                scores(a, &x, &mask, (b, h, i0, rows, tk), qh, kh, s);
                with_simd(|| {
                    for (r, (srow, prow)) in s.chunks(tk).zip(p.chunks_mut(tk)).enumerate() {
                        let li = lh[i0 + r];
                        for (pp, &sv) in prow.iter_mut().zip(srow) {
                            *pp = if sv == F::NEG_INFINITY { 0.0 } else { exp_fast(sv - li) };
                        }
                    }
                });
                let dyb = &dyh[i0 * dv..];
                // dV += Pᵀ dY; dP = dY Vᵀ.
                mm(tk, rows, dv, 1.0, p, (1, tk), dyb, (dv, 1), 1.0, &mut dvv);
                mm(rows, dv, tk, 1.0, dyb, (dv, 1), vh, (1, dv), 0.0, dp);
                with_simd(|| {
                    for r in 0..rows {
                        let i = i0 + r;
                        let di: F = (0..dv).map(|c| dyh[i * dv + c] * yh[i * dv + c]).sum();
                        let (srow, prow) = (&s[r * tk..(r + 1) * tk], &p[r * tk..(r + 1) * tk]);
                        for ((g, &pp), &sv) in dp[r * tk..(r + 1) * tk].iter_mut().zip(prow).zip(srow) {
                            let ds = pp * (*g - di);
                            // Through the soft cap: d(c tanh(u / c)) / du = 1 - (s / c)^2.
                            let ds = if cap > 0.0 && pp != 0.0 { ds * (1.0 - (sv / cap) * (sv / cap)) } else { ds };
                            *g = ds * scale;
                        }
                    }
                });
                // dQ = dS K; dK += dSᵀ Q.
                mm(rows, tk, d, 1.0, dp, (tk, 1), kh, (d, 1), 0.0, &mut dqh[i0 * d..]);
                mm(tk, rows, d, 1.0, dp, (1, tk), &qh[i0 * d..], (d, 1), 1.0, &mut dk);
            }
        }
        (dq, dk, dvv)
    });
    let (mut dq, mut dk, mut dvv) = (vec![], vec![], vec![]);
    // Tasks are (batch, key/value head) in order: their query heads are contiguous in dQ.
    for (a, b, c) in parts {
        dq.extend_from_slice(&a);
        dk.extend_from_slice(&b);
        dvv.extend_from_slice(&c);
    }
    Ok(vec![
        tensor(op, ins[0].shape(), F::data(dq))?,
        tensor(op, ins[1].shape(), F::data(dk))?,
        tensor(op, ins[2].shape(), F::data(dvv))?,
    ])
}
