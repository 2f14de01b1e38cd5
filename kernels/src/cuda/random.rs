//! Training-mode dropout on the GPU: the keep bits of [`crate::random`] (Philox4x32-10 keyed by
//! each element's global index) in NVRTC source, bit for bit the CPU's, applied to f32 data
//! (bf16/f16 widened, computed in f32 and rounded once, as on the CPU).

use super::device::{CudaContext, Family, MAX_RANK, grid};
use super::elementwise::{narrow, widen};
use super::tensor::{Buf, CudaTensor, no_f64};
use crate::Error;
use crate::random::Draw;
use cudarc::driver::DeviceRepr;
use ir::{DType, DropoutAttrs, Op, TensorMeta};

pub(crate) const SRC: &str = r#"
struct DropLayout {
    i64 rank;
    i64 rows[MAXR];
    u64 strides[MAXR];
    i64 row_len;
    u64 start;
    unsigned int key0, key1, step0, step1, threshold, pad;
};
// Philox4x32-10 (Random123): the words of counter c under key (k0, k1).
__device__ __forceinline__ void philox4x32_10(unsigned int c[4], unsigned int k0, unsigned int k1) {
    for (int round = 0; round < 10; ++round) {
        if (round > 0) { k0 += 0x9E3779B9u; k1 += 0xBB67AE85u; }
        u64 p0 = (u64)0xD2511F53u * (u64)c[0];
        u64 p1 = (u64)0xCD9E8D57u * (u64)c[2];
        unsigned int n0 = (unsigned int)(p1 >> 32) ^ c[1] ^ k0;
        unsigned int n2 = (unsigned int)(p0 >> 32) ^ c[3] ^ k1;
        c[0] = n0; c[1] = (unsigned int)p1; c[2] = n2; c[3] = (unsigned int)p0;
    }
}
// Element i of the block (row-major): its global index, then its keep bit.
extern "C" __global__ void dropout_f32(float* out, u8* mask, const float* x, DropLayout L, float scale, i64 n, int want_mask) {
    FOR_EACH(i, n) {
        i64 r = i / L.row_len;
        u64 e = L.start + (u64)(i % L.row_len);
        for (int d = (int)L.rank - 1; d >= 0; --d) {
            e += (u64)(r % L.rows[d]) * L.strides[d];
            r /= L.rows[d];
        }
        u64 b = e >> 2;
        unsigned int c[4] = {(unsigned int)b, (unsigned int)(b >> 32), L.step0, L.step1};
        philox4x32_10(c, L.key0, L.key1);
        bool keep = c[e & 3] >= L.threshold;
        out[i] = keep ? x[i] * scale : 0.f;
        if (want_mask) mask[i] = keep ? 1 : 0;
    }
}
"#;

/// Mirrors `DropLayout` of [`SRC`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct DropLayout {
    rank: i64,
    rows: [i64; MAX_RANK],
    strides: [u64; MAX_RANK],
    row_len: i64,
    start: u64,
    key: [u32; 2],
    step: [u32; 2],
    threshold: u32,
    pad: u32,
}

// SAFETY: `DropLayout` is `repr(C)`, made of 64- and 32-bit integers in the order and with the
// padding of the `DropLayout` struct of `SRC`, so the kernel reads it as written.
unsafe impl DeviceRepr for DropLayout {}

/// Dropout `a` of `x` (a block of its tensor at `draw`): the contract of
/// [`crate::cpu::random::dropout`] on the device, with the same keep bits. Without a draw
/// nothing is dropped.
pub fn dropout(
    ctx: &CudaContext,
    a: &DropoutAttrs,
    x: &CudaTensor,
    draw: Option<&Draw>,
) -> Result<Vec<CudaTensor>, Error> {
    let op = "dropout";
    let outs = Op::Dropout(*a).infer(&[x.meta().clone()]).map_err(|message| Error::BadInput { op, message })?;
    if x.dtype().is_half() {
        let mut r = dropout(ctx, a, &widen(ctx, x)?, draw)?;
        r[0] = narrow(ctx, &r[0], x.dtype())?;
        return Ok(r);
    }
    if x.dtype() == DType::F64 {
        return Err(no_f64(op));
    }
    let shape = x.shape();
    let mut l = DropLayout { row_len: 1, ..DropLayout::default() };
    let scale = match draw {
        // Threshold 0 keeps every word: nothing dropped, x · 1 = x exactly.
        Some(d) if a.ratio > 0.0 => {
            let layout = d.layout(a, shape).map_err(|message| Error::BadInput { op, message })?;
            let (start, strides, rows) = layout.index_map();
            if rows.len() > MAX_RANK {
                return Err(Error::Unsupported { op, reason: format!("tensors of rank above {}", MAX_RANK + 1) });
            }
            let (key, step, threshold) = layout.words();
            l = DropLayout { rank: rows.len() as i64, start, key, step, threshold, ..l };
            for (k, (&n, &s)) in rows.iter().zip(strides).enumerate() {
                l.rows[k] = n as i64;
                l.strides[k] = s;
            }
            l.row_len = layout.row_len() as i64;
            a.scale() as f32
        }
        _ => 1.0,
    };
    let xv = x.f32s(op)?;
    let n = x.numel();
    let mut out = ctx.alloc::<f32>(op, n)?;
    let mut mask = ctx.alloc::<u8>(op, if a.mask { n } else { 1 })?;
    if n > 0 {
        let (n64, want) = (n as i64, i32::from(a.mask));
        launch!(ctx, op, Family::Random, "dropout_f32", grid(n); &mut out.s, &mut mask.s, &xv.s, &l, &scale, &n64, &want)?;
    }
    let mut r = vec![CudaTensor::from_f32(shape, out)];
    if a.mask {
        r.push(CudaTensor::new(TensorMeta::new(DType::Bool, shape.to_vec()), Buf::Bool(mask)));
    }
    debug_assert_eq!(r.iter().map(|t| t.meta().clone()).collect::<Vec<_>>(), outs);
    Ok(r)
}
