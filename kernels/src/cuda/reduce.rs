//! Reductions over a set of axes (f32 for every kind; i64 for Sum, Prod, Max, Min; bool for
//! Max = any and Min = all).
//!
//! As on the CPU, the reduced axes are brought into one contiguous run (by a transpose when
//! they are not adjacent), so every reduction is `[outer, red, inner] -> [outer, inner]`; f32
//! accumulates in f64. Long rows (`inner == 1`) reduce with one block per row; otherwise one
//! thread per output walks its column in order, and a few outputs over long columns are first
//! transposed into rows.

use super::device::{BLOCK, CudaContext, Family, grid, per_block};
use super::shape::transpose;
use super::tensor::{Buf, CudaTensor};
use crate::Error;
use ir::{ReduceOp, TensorMeta};

pub(crate) const SRC: &str = r#"
#define RB 256
// Kinds of combine: 0 add, 1 max, 2 min, 3 multiply (NaN-propagating max and min).
__device__ __forceinline__ int comb_kind(int code) {
    switch (code) { case 2: return 1; case 3: return 2; case 4: return 3; default: return 0; }
}
__device__ __forceinline__ double combine(int kind, double a, double b) {
    switch (kind) { case 1: return nan_max_d(a, b); case 2: return nan_min_d(a, b); case 3: return a * b; default: return a + b; }
}
__device__ __forceinline__ double init_of(int code) {
    switch (code) { case 2: return -D_INF; case 3: return D_INF; case 4: return 1.0; default: return 0.0; }
}
__device__ __forceinline__ double map_of(int code, double x) {
    switch (code) { case 5: case 6: return x * x; case 7: return fabs(x); default: return x; }
}
__device__ __forceinline__ double finish_of(int code, double acc, i64 red) {
    switch (code) { case 1: return acc / (double)red; case 6: return sqrt(acc); case 8: return log(acc); default: return acc; }
}
// Combines one value per thread of the block (blockDim.x a power of two, at most RB); every
// thread gets the result.
__device__ double block_reduce(double v, double* sh, int kind) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) sh[threadIdx.x] = combine(kind, sh[threadIdx.x], sh[threadIdx.x + s]);
        __syncthreads();
    }
    double r = sh[0];
    __syncthreads();
    return r;
}

// One block (RB threads) per row of `red` contiguous elements. code 9 is log-sum-exp.
extern "C" __global__ void reduce_rows_f32(float* out, const float* x, i64 red, int code) {
    __shared__ double sh[RB];
    const float* v = x + (i64)blockIdx.x * red;
    int kind = comb_kind(code);
    double m = 0.0;
    if (code == 9) {
        double mx = -D_INF;
        for (i64 k = threadIdx.x; k < red; k += blockDim.x) mx = nan_max_d(mx, (double)v[k]);
        mx = block_reduce(mx, sh, 1);
        m = is_inf(mx) ? 0.0 : mx;
    }
    double acc = init_of(code);
    for (i64 k = threadIdx.x; k < red; k += blockDim.x) {
        double e = code == 9 ? exp((double)v[k] - m) : map_of(code, (double)v[k]);
        acc = combine(kind, acc, e);
    }
    acc = block_reduce(acc, sh, kind);
    if (threadIdx.x == 0) out[blockIdx.x] = (float)(code == 9 ? m + log(acc) : finish_of(code, acc, red));
}

// One thread per output (o, q) walking x[o, 0..red, q] in order.
extern "C" __global__ void reduce_cols_f32(float* out, const float* x, i64 outer, i64 red, i64 inner, int code) {
    int kind = comb_kind(code);
    FOR_EACH(i, outer * inner) {
        i64 o = i / inner, q = i % inner;
        const float* v = x + o * red * inner + q;
        double m = 0.0;
        if (code == 9) {
            double mx = -D_INF;
            for (i64 k = 0; k < red; ++k) mx = nan_max_d(mx, (double)v[k * inner]);
            m = is_inf(mx) ? 0.0 : mx;
        }
        double acc = init_of(code);
        for (i64 k = 0; k < red; ++k) {
            double e = code == 9 ? exp((double)v[k * inner] - m) : map_of(code, (double)v[k * inner]);
            acc = combine(kind, acc, e);
        }
        out[i] = (float)(code == 9 ? m + log(acc) : finish_of(code, acc, red));
    }
}

// i64: code 0 sum, 2 max, 3 min, 4 product (wrapping).
extern "C" __global__ void reduce_cols_i64(i64* out, const i64* x, i64 outer, i64 red, i64 inner, int code) {
    FOR_EACH(i, outer * inner) {
        i64 o = i / inner, q = i % inner;
        const i64* v = x + o * red * inner + q;
        i64 acc = code == 2 ? (i64)0x8000000000000000ULL : code == 3 ? (i64)0x7fffffffffffffffLL : code == 4 ? 1 : 0;
        for (i64 k = 0; k < red; ++k) {
            i64 e = v[k * inner];
            switch (code) {
                case 2: acc = e > acc ? e : acc; break;
                case 3: acc = e < acc ? e : acc; break;
                case 4: acc = wrap_mul(acc, e); break;
                default: acc = wrap_add(acc, e); break;
            }
        }
        out[i] = acc;
    }
}

// bool: code 2 any, 3 all.
extern "C" __global__ void reduce_cols_u8(u8* out, const u8* x, i64 outer, i64 red, i64 inner, int code) {
    FOR_EACH(i, outer * inner) {
        i64 o = i / inner, q = i % inner;
        const u8* v = x + o * red * inner + q;
        u8 acc = code == 2 ? 0 : 1;
        for (i64 k = 0; k < red; ++k) acc = code == 2 ? (acc | (v[k * inner] != 0)) : (acc & (v[k * inner] != 0));
        out[i] = acc;
    }
}
"#;

/// Rows at least this long reduce with a block per row.
const LONG_ROW: usize = 64;
/// Below this many outputs over long columns, the columns are transposed into rows first.
const FEW_OUTPUTS: usize = 8192;

fn code(r: ReduceOp) -> i32 {
    use ReduceOp::*;
    match r {
        Sum => 0,
        Mean => 1,
        Max => 2,
        Min => 3,
        Prod => 4,
        SumSquare => 5,
        L2 => 6,
        L1 => 7,
        LogSum => 8,
        LogSumExp => 9,
    }
}

/// `[outer, red, inner] -> [outer, inner]` of an f32 buffer laid out that way.
pub(crate) fn reduce_f32_3d(
    ctx: &CudaContext,
    op: &'static str,
    r: ReduceOp,
    x: &CudaTensor,
    outer: usize,
    red: usize,
    inner: usize,
) -> Result<super::device::DeviceBuf<f32>, Error> {
    let n = outer * inner;
    let mut out = ctx.alloc::<f32>(op, n)?;
    if n == 0 {
        return Ok(out);
    }
    let c = code(r);
    let fam = Family::Reduce;
    if inner > 1 && n < FEW_OUTPUTS && red >= LONG_ROW {
        let t = transpose(ctx, &x.with_shape(&[outer, red, inner]), &[0, 2, 1])?;
        return reduce_f32_3d(ctx, op, r, &t, outer * inner, red, 1);
    }
    let v = x.f32s(op)?;
    if inner == 1 && red >= LONG_ROW {
        debug_assert_eq!(BLOCK, 256, "reduce_rows_f32 assumes RB == BLOCK");
        let red64 = red as i64;
        launch!(ctx, op, fam, "reduce_rows_f32", per_block(op, outer)?; &mut out.s, &v.s, &red64, &c)?;
    } else {
        let a = [outer, red, inner].map(|v| v as i64);
        launch!(ctx, op, fam, "reduce_cols_f32", grid(n); &mut out.s, &v.s, &a[0], &a[1], &a[2], &c)?;
    }
    Ok(out)
}

/// Reduces `axes` (sorted, unique) of `x`.
pub(crate) fn reduce(
    ctx: &CudaContext,
    r: ReduceOp,
    x: &CudaTensor,
    axes: &[usize],
    keepdims: bool,
) -> Result<CudaTensor, Error> {
    let op = ir::reduce_name(r);
    let s = x.shape();
    let out_shape = ir::reduced_shape(s, axes, keepdims);
    let crate::geometry::ReduceLayout { perm, outer, red, inner } = crate::geometry::reduce_layout(s, axes);
    let moved;
    let src = match perm {
        None => x,
        Some(perm) => {
            moved = transpose(ctx, x, &perm)?;
            &moved
        }
    };
    let n = outer * inner;
    let a = [outer, red, inner].map(|v| v as i64);
    let c = code(r);
    let fam = Family::Reduce;
    let buf = match src.buf() {
        Buf::Half(_) => return Err(super::tensor::unwidened(op)),
        Buf::F32(_) => Buf::F32(reduce_f32_3d(ctx, op, r, src, outer, red, inner)?),
        Buf::I64(v) => {
            if !matches!(r, ReduceOp::Sum | ReduceOp::Prod | ReduceOp::Max | ReduceOp::Min) {
                return Err(Error::BadInput { op, message: "this reduction takes f32 input".into() });
            }
            let mut out = ctx.alloc::<i64>(op, n)?;
            if n > 0 {
                launch!(ctx, op, fam, "reduce_cols_i64", grid(n); &mut out.s, &v.s, &a[0], &a[1], &a[2], &c)?;
            }
            Buf::I64(out)
        }
        Buf::Bool(v) => {
            if !matches!(r, ReduceOp::Max | ReduceOp::Min) {
                return Err(Error::BadInput { op, message: "input must be numeric".into() });
            }
            let mut out = ctx.alloc::<u8>(op, n)?;
            if n > 0 {
                launch!(ctx, op, fam, "reduce_cols_u8", grid(n); &mut out.s, &v.s, &a[0], &a[1], &a[2], &c)?;
            }
            Buf::Bool(out)
        }
    };
    Ok(CudaTensor::new(TensorMeta::new(x.dtype(), out_shape), buf))
}
