//! The indexing family ([`ir::IndexOp`]) on the device: f32, i64 and bool tensors.
//!
//! Gathers and scatters read their indices back to the host (synchronising the stream, as Gather
//! does), where the CPU backend's plans (`cpu::index::nd_offsets`, `elements_offsets`) check them
//! and turn them into flat offsets; the device then moves the data. Scatters are deterministic
//! without atomics: the host groups the updates by target (`cpu::index::scatter_lists`), and each
//! target element folds its updates in index order, exactly as the CPU does.
//!
//! Triangles are elementwise; cumulative sums and arg-reductions walk one line per thread in
//! the CPU's order (so sums round the same); top-k gives each element its rank in the sorted line
//! (larger first, ties by index) and writes the first k.

use super::device::{CudaContext, Family, grid};
use super::tensor::{Buf, CudaTensor};
use crate::Error;
use crate::cpu::index::{around, elements_offsets, nd_offsets, scatter_lists};
use ir::{DType, IndexOp, ScatterReduction, TensorMeta};

pub(crate) const SRC: &str = r#"
__device__ __forceinline__ bool is_nan(i64) { return false; }
// a comes before b: larger (or smaller) first, NaN beyond every number (as the CPU's `ahead`).
template <typename T> __device__ __forceinline__ bool ahead(T a, T b, int largest) {
    bool an = is_nan(a), bn = is_nan(b);
    if (an && bn) return false;
    if (an) return largest != 0;
    if (bn) return largest == 0;
    return largest ? a > b : a < b;
}
__device__ __forceinline__ float add_(float a, float b) { return a + b; }
__device__ __forceinline__ i64 add_(i64 a, i64 b) { return wrap_add(a, b); }
__device__ __forceinline__ float mul_(float a, float b) { return a * b; }
__device__ __forceinline__ i64 mul_(i64 a, i64 b) { return wrap_mul(a, b); }
__device__ __forceinline__ u8 add_(u8, u8 b) { return b; }
__device__ __forceinline__ u8 mul_(u8, u8 b) { return b; }

#define PER_TYPE(T, S) \
extern "C" __global__ void trilu_##S(T* out, const T* x, i64 n, i64 rows, i64 cols, int upper, i64 k) { \
    FOR_EACH(p, n) { \
        i64 i = p / cols % rows, j = p % cols; \
        bool keep = upper ? (j - i >= k) : (j - i <= k); \
        out[p] = keep ? x[p] : (T)0; \
    } \
} \
extern "C" __global__ void take_##S(T* out, const T* x, const i64* offs, i64 len, i64 n) { \
    FOR_EACH(p, n) { out[p] = x[offs[p / len] + p % len]; } \
} \
extern "C" __global__ void copy_##S(T* out, const T* x, i64 n) { \
    FOR_EACH(p, n) { out[p] = x[p]; } \
} \
/* Target t (offset targets[t]) folds update slices src[start[t]..start[t+1]] in order. */ \
extern "C" __global__ void scatter_##S(T* out, const T* upd, const i64* targets, const i64* start, \
                                       const i64* src, i64 len, i64 n, int red) { \
    FOR_EACH(p, n) { \
        i64 t = p / len, q = p % len; \
        T acc = out[targets[t] + q]; \
        for (i64 s = start[t]; s < start[t + 1]; ++s) { \
            T v = upd[src[s] * len + q]; \
            switch (red) { \
                case 0: acc = v; break; \
                case 1: acc = add_(acc, v); break; \
                case 2: acc = mul_(acc, v); break; \
                case 3: acc = v > acc ? v : acc; break; \
                default: acc = v < acc ? v : acc; break; \
            } \
        } \
        out[targets[t] + q] = acc; \
    } \
}
PER_TYPE(float, f32)
PER_TYPE(i64, i64)
PER_TYPE(u8, u8)

#define NUMERIC(T, S) \
extern "C" __global__ void cumsum_##S(T* out, const T* x, i64 outer, i64 d, i64 inner, int excl, int rev) { \
    FOR_EACH(l, outer * inner) { \
        i64 a = l / inner, c = l % inner; \
        T acc = (T)0; \
        for (i64 jj = 0; jj < d; ++jj) { \
            i64 j = rev ? d - 1 - jj : jj; \
            i64 p = (a * d + j) * inner + c; \
            if (excl) { out[p] = acc; acc = add_(acc, x[p]); } \
            else { acc = add_(acc, x[p]); out[p] = acc; } \
        } \
    } \
} \
extern "C" __global__ void arg_##S(i64* out, const T* x, i64 outer, i64 d, i64 inner, int largest, int last) { \
    FOR_EACH(l, outer * inner) { \
        i64 a = l / inner, c = l % inner; \
        const T* v = x + a * d * inner + c; \
        i64 best = 0; \
        for (i64 j = 1; j < d; ++j) { \
            if (ahead(v[j * inner], v[best * inner], largest) || (last && !ahead(v[best * inner], v[j * inner], largest))) best = j; \
        } \
        out[l] = best; \
    } \
} \
/* Element (a, j, c) has rank r = how many of its line come before it; r < k lands at slot r. */ \
extern "C" __global__ void topk_##S(T* vals, i64* idx, const T* x, i64 outer, i64 d, i64 inner, i64 k, int largest) { \
    FOR_EACH(p, outer * d * inner) { \
        i64 c = p % inner, j = p / inner % d, a = p / inner / d; \
        const T* v = x + a * d * inner + c; \
        T me = v[j * inner]; \
        i64 r = 0; \
        for (i64 m = 0; m < d && r < k; ++m) { \
            if (ahead(v[m * inner], me, largest) || (m < j && !ahead(me, v[m * inner], largest))) ++r; \
        } \
        if (r < k) { \
            vals[(a * k + r) * inner + c] = me; \
            idx[(a * k + r) * inner + c] = j; \
        } \
    } \
}
NUMERIC(float, f32)
NUMERIC(i64, i64)
"#;

fn bad(op: &'static str, message: String) -> Error {
    Error::BadInput { op, message }
}

fn to_i64(v: &[usize]) -> Vec<i64> {
    v.iter().map(|&x| x as i64).collect()
}

/// Launches `<name>_<dtype>(out, x, args...)` for x's dtype into a new buffer of `n` elements.
macro_rules! per_dtype {
    ($ctx:expr, $op:expr, $x:expr, $n:expr, $name:literal; $($arg:expr),*) => {{
        let (ctx, op, n) = ($ctx, $op, $n);
        let cfg = grid(n);
        match $x.buf() {
            Buf::Half(_) => return Err(super::tensor::unwidened(op)),
            Buf::F32(v) => {
                let mut out = ctx.alloc::<f32>(op, n)?;
                if n > 0 {
                    launch!(ctx, op, Family::Index, concat!($name, "_f32"), cfg; &mut out.s, &v.s, $($arg),*)?;
                }
                Buf::F32(out)
            }
            Buf::I64(v) => {
                let mut out = ctx.alloc::<i64>(op, n)?;
                if n > 0 {
                    launch!(ctx, op, Family::Index, concat!($name, "_i64"), cfg; &mut out.s, &v.s, $($arg),*)?;
                }
                Buf::I64(out)
            }
            Buf::Bool(v) => {
                let mut out = ctx.alloc::<u8>(op, n)?;
                if n > 0 {
                    launch!(ctx, op, Family::Index, concat!($name, "_u8"), cfg; &mut out.s, &v.s, $($arg),*)?;
                }
                Buf::Bool(out)
            }
        }
    }};
}

/// The indices, read back to the host.
fn host_indices(ctx: &CudaContext, op: &'static str, t: &CudaTensor) -> Result<Vec<i64>, Error> {
    ctx.download_slice(op, t.i64s(op)?, t.numel())
}

/// `out[s * len + q] = x[offs[s] + q]`.
fn take(ctx: &CudaContext, op: &'static str, x: &CudaTensor, offs: &[usize], len: usize) -> Result<Buf, Error> {
    let n = offs.len() * len;
    let offs = ctx.upload_slice(op, &to_i64(offs))?;
    let (len, n64) = (len as i64, n as i64);
    Ok(per_dtype!(ctx, op, x, n, "take"; &offs.s, &len, &n64))
}

/// A copy of `data` with update slice `s` (length `len`) folded in at `targets[s]`, in order.
fn scatter(
    ctx: &CudaContext,
    op: &'static str,
    data: &CudaTensor,
    targets: &[usize],
    len: usize,
    upd: &CudaTensor,
    r: ScatterReduction,
) -> Result<Buf, Error> {
    let n = data.numel();
    let n64 = n as i64;
    let (uniq, start, src) = scatter_lists(targets, r);
    let code: i32 = match r {
        ScatterReduction::None => 0,
        ScatterReduction::Add => 1,
        ScatterReduction::Mul => 2,
        ScatterReduction::Max => 3,
        ScatterReduction::Min => 4,
    };
    if data.dtype() == DType::Bool && r != ScatterReduction::None {
        return Err(bad(op, format!("no {} scatter of bool", r.name())));
    }
    let mut out = per_dtype!(ctx, op, data, n, "copy"; &n64);
    let work = uniq.len() * len;
    if work == 0 {
        return Ok(out);
    }
    let (t, s, k) = (
        ctx.upload_slice(op, &to_i64(&uniq))?,
        ctx.upload_slice(op, &to_i64(&start))?,
        ctx.upload_slice(op, &to_i64(&src))?,
    );
    let (len64, w64) = (len as i64, work as i64);
    let cfg = grid(work);
    let fam = Family::Index;
    match (&mut out, upd.buf()) {
        (Buf::F32(o), Buf::F32(u)) => {
            launch!(ctx, op, fam, "scatter_f32", cfg; &mut o.s, &u.s, &t.s, &s.s, &k.s, &len64, &w64, &code)?
        }
        (Buf::I64(o), Buf::I64(u)) => {
            launch!(ctx, op, fam, "scatter_i64", cfg; &mut o.s, &u.s, &t.s, &s.s, &k.s, &len64, &w64, &code)?
        }
        (Buf::Bool(o), Buf::Bool(u)) => {
            launch!(ctx, op, fam, "scatter_u8", cfg; &mut o.s, &u.s, &t.s, &s.s, &k.s, &len64, &w64, &code)?
        }
        _ => return Err(bad(op, format!("updates are {} but data is {}", upd.dtype(), data.dtype()))),
    }
    Ok(out)
}

/// Evaluates an indexing-family op; `outs` are the inferred output metas.
pub(crate) fn eval(
    ctx: &CudaContext,
    op: &IndexOp,
    inputs: &[&CudaTensor],
    outs: &[TensorMeta],
) -> Result<Vec<CudaTensor>, Error> {
    let name = op.name();
    let x = inputs[0];
    let shape = x.shape();
    let one = |b: Buf| Ok(vec![CudaTensor::new(outs[0].clone(), b)]);
    let no_bool = || bad(name, format!("{name} of bool is not supported"));
    match op {
        IndexOp::Trilu { upper, k } => {
            let n = x.numel();
            let (r, c) = (shape[shape.len() - 2] as i64, shape[shape.len() - 1] as i64);
            let (n64, up) = (n as i64, i32::from(*upper));
            one(per_dtype!(ctx, name, x, n, "trilu"; &n64, &r, &c, &up, k))
        }
        IndexOp::GatherNd { batch_dims } => {
            let idx = host_indices(ctx, name, inputs[1])?;
            let (offs, len) = nd_offsets(name, shape, &idx, inputs[1].shape(), *batch_dims)?;
            one(take(ctx, name, x, &offs, len)?)
        }
        IndexOp::GatherElements { axis } => {
            let idx = host_indices(ctx, name, inputs[1])?;
            let offs = elements_offsets(name, shape, &idx, inputs[1].shape(), *axis)?;
            one(take(ctx, name, x, &offs, 1)?)
        }
        IndexOp::ScatterNd { reduction } => {
            let idx = host_indices(ctx, name, inputs[1])?;
            let (offs, len) = nd_offsets(name, shape, &idx, inputs[1].shape(), 0)?;
            one(scatter(ctx, name, x, &offs, len, inputs[2], *reduction)?)
        }
        IndexOp::ScatterElements { axis, reduction } => {
            let idx = host_indices(ctx, name, inputs[1])?;
            let offs = elements_offsets(name, shape, &idx, inputs[1].shape(), *axis)?;
            one(scatter(ctx, name, x, &offs, 1, inputs[2], *reduction)?)
        }
        IndexOp::CumSum { axis, exclusive, reverse } => {
            if x.dtype() == DType::Bool {
                return Err(no_bool());
            }
            let (o, d, i) = around(shape, *axis);
            let (o, d, i) = (o as i64, d as i64, i as i64);
            let (e, r) = (i32::from(*exclusive), i32::from(*reverse));
            let n = x.numel();
            // The kernel runs one thread per line: launch over the lines, not the elements.
            let lines = (o * i) as usize;
            let cfg = grid(lines.max(1));
            let buf = match x.buf() {
                Buf::Half(_) => return Err(super::tensor::unwidened(name)),
                Buf::F32(v) => {
                    let mut out = ctx.alloc::<f32>(name, n)?;
                    if lines > 0 && d > 0 {
                        launch!(ctx, name, Family::Index, "cumsum_f32", cfg; &mut out.s, &v.s, &o, &d, &i, &e, &r)?;
                    }
                    Buf::F32(out)
                }
                Buf::I64(v) => {
                    let mut out = ctx.alloc::<i64>(name, n)?;
                    if lines > 0 && d > 0 {
                        launch!(ctx, name, Family::Index, "cumsum_i64", cfg; &mut out.s, &v.s, &o, &d, &i, &e, &r)?;
                    }
                    Buf::I64(out)
                }
                Buf::Bool(_) => return Err(no_bool()),
            };
            one(buf)
        }
        IndexOp::ArgMax { axis, select_last, .. } | IndexOp::ArgMin { axis, select_last, .. } => {
            let (o, d, i) = around(shape, *axis);
            let lines = o * i;
            let (o, d, i) = (o as i64, d as i64, i as i64);
            let (lg, last) = (i32::from(matches!(op, IndexOp::ArgMax { .. })), i32::from(*select_last));
            let mut out = ctx.alloc::<i64>(name, lines)?;
            if lines > 0 {
                let cfg = grid(lines);
                match x.buf() {
                    Buf::Half(_) => return Err(super::tensor::unwidened(name)),
                    Buf::F32(v) => {
                        launch!(ctx, name, Family::Index, "arg_f32", cfg; &mut out.s, &v.s, &o, &d, &i, &lg, &last)?
                    }
                    Buf::I64(v) => {
                        launch!(ctx, name, Family::Index, "arg_i64", cfg; &mut out.s, &v.s, &o, &d, &i, &lg, &last)?
                    }
                    Buf::Bool(_) => return Err(no_bool()),
                }
            }
            one(Buf::I64(out))
        }
        IndexOp::TopK { axis, k, largest } => {
            let (o, d, i) = around(shape, *axis);
            let (n_in, n_out) = (o * d * i, o * k * i);
            let (o, d, i, k) = (o as i64, d as i64, i as i64, *k as i64);
            let lg = i32::from(*largest);
            let mut idx = ctx.alloc::<i64>(name, n_out)?;
            let cfg = grid(n_in.max(1));
            let vals = match x.buf() {
                Buf::Half(_) => return Err(super::tensor::unwidened(name)),
                Buf::F32(v) => {
                    let mut vals = ctx.alloc::<f32>(name, n_out)?;
                    if n_out > 0 {
                        launch!(ctx, name, Family::Index, "topk_f32", cfg; &mut vals.s, &mut idx.s, &v.s, &o, &d, &i, &k, &lg)?;
                    }
                    Buf::F32(vals)
                }
                Buf::I64(v) => {
                    let mut vals = ctx.alloc::<i64>(name, n_out)?;
                    if n_out > 0 {
                        launch!(ctx, name, Family::Index, "topk_i64", cfg; &mut vals.s, &mut idx.s, &v.s, &o, &d, &i, &k, &lg)?;
                    }
                    Buf::I64(vals)
                }
                Buf::Bool(_) => return Err(no_bool()),
            };
            Ok(vec![CudaTensor::new(outs[0].clone(), vals), CudaTensor::new(outs[1].clone(), Buf::I64(idx))])
        }
    }
}
