//! CPU kernels: f32 compute, i64/bool for indices and masks.
//!
//! [`eval`] first runs [`ir::Op::infer`] on the inputs' metas, so every kernel below works on
//! inputs whose count, dtypes and shapes are known to be consistent, and returns exactly the
//! inferred output metas. Data-dependent failures (gather indices out of range, integer division
//! by zero) are checked by the kernels themselves.
//!
//! Parallelism: work is split over the [`CpuContext`]'s own rayon pool only when a tensor is large
//! enough for the split to pay ([`PAR_MIN_ELEMS`]); with one thread everything runs on the
//! caller's thread. Matrix products use the `gemm` crate (see `benches/gemm.rs` for the
//! measurement that chose it) with `Parallelism::Rayon(threads)` inside the pool.

mod conv;
mod elementwise;
mod grad;
mod linalg;
mod norm;
mod reduce;
mod shape;
#[cfg(test)]
mod tests;

use crate::Error;
use ir::{Data, Op, Tensor, TensorMeta};
use rayon::prelude::*;

pub use linalg::gemm_f32;

/// Tensors smaller than this (in elements of work) are processed on the calling thread.
pub const PAR_MIN_ELEMS: usize = 1 << 15;

/// The CPU backend's execution context: an explicit worker pool and its size.
///
/// There is no global state: two contexts with different thread counts can be used side by side
/// (one per simulated rank, say) and never share workers.
pub struct CpuContext {
    pool: rayon::ThreadPool,
    threads: usize,
    accumulation: Accumulation,
}

/// How matrix products (MatMul, Gemm, convolutions and their gradients) accumulate their sums.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Accumulation {
    /// In f32 with fused multiply-adds, as BLAS libraries do: fast; a sum of `k` products carries
    /// a rounding error of a few `sqrt(k)` f32 ulps of its terms.
    #[default]
    F32,
    /// Products and sums in f64, rounded to f32 once at the end: about twice the time of a
    /// product, for results that do not depend on summation order at the f32 level (a sum that
    /// cancels to a few ulps of its terms keeps its sign).
    F64,
}

impl std::fmt::Debug for CpuContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuContext").field("threads", &self.threads).field("accumulation", &self.accumulation).finish()
    }
}

impl CpuContext {
    /// A context running kernels on `threads` worker threads (0 means one per available core).
    /// With one thread every kernel runs sequentially on the caller's thread.
    pub fn new(threads: usize) -> Result<CpuContext, Error> {
        let threads =
            if threads == 0 { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) } else { threads };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("autopar-cpu-{i}"))
            .build()
            .map_err(|e| Error::ThreadPool { threads, message: e.to_string() })?;
        Ok(CpuContext { pool, threads, accumulation: Accumulation::F32 })
    }

    /// The same context with another accumulation mode for matrix products.
    pub fn with_accumulation(mut self, accumulation: Accumulation) -> CpuContext {
        self.accumulation = accumulation;
        self
    }

    /// How matrix products accumulate.
    pub fn accumulation(&self) -> Accumulation {
        self.accumulation
    }

    /// Number of worker threads.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f` inside this context's pool (rayon calls in `f` use its workers).
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        if self.threads == 1 { f() } else { self.pool.install(f) }
    }

    /// True when `work` elements are worth splitting over the pool.
    pub(crate) fn parallel_for(&self, work: usize) -> bool {
        self.threads > 1 && work >= PAR_MIN_ELEMS
    }

    /// `f(a[i], b[i])` for every `i` (`a` and `b` have one length), written straight into a new
    /// vector (no zero-fill first), split over the pool when long.
    pub(crate) fn zip_map_f32(&self, a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32 + Sync + Send) -> Vec<f32> {
        debug_assert_eq!(a.len(), b.len());
        if self.parallel_for(a.len()) {
            let mut out = Vec::new();
            self.pool.install(|| {
                a.par_iter().zip(b).with_min_len(PAR_MIN_ELEMS / 4).map(|(&x, &y)| f(x, y)).collect_into_vec(&mut out)
            });
            out
        } else {
            a.iter().zip(b).map(|(&x, &y)| f(x, y)).collect()
        }
    }

    /// Calls `f(row_index, row)` for every `row_len`-long row of `out`, in parallel when `out` is
    /// large. `out.len()` must be a multiple of `row_len`; rows are grouped so that each task
    /// carries at least [`PAR_MIN_ELEMS`]/4 elements.
    pub(crate) fn for_rows<T: Send>(&self, out: &mut [T], row_len: usize, f: impl Fn(usize, &mut [T]) + Sync + Send) {
        self.for_rows_weighted(out, row_len, 1, f)
    }

    /// [`Self::for_rows`] where each output element costs `weight` units of work.
    pub(crate) fn for_rows_weighted<T: Send>(
        &self,
        out: &mut [T],
        row_len: usize,
        weight: usize,
        f: impl Fn(usize, &mut [T]) + Sync + Send,
    ) {
        if row_len == 0 || out.is_empty() {
            return;
        }
        let rows = out.len() / row_len;
        let work = out.len().saturating_mul(weight.max(1));
        if !self.parallel_for(work) || rows < 2 {
            for (i, r) in out.chunks_mut(row_len).enumerate() {
                f(i, r);
            }
            return;
        }
        let per_row = row_len.saturating_mul(weight.max(1));
        let min_rows = (PAR_MIN_ELEMS / 4).div_ceil(per_row).max(1);
        // Enough tasks for load balance, each big enough to amortise scheduling.
        let rows_per_task = rows.div_ceil(self.threads * 8).max(min_rows);
        self.pool.install(|| {
            out.par_chunks_mut(rows_per_task * row_len).enumerate().for_each(|(t, chunk)| {
                for (j, r) in chunk.chunks_mut(row_len).enumerate() {
                    f(t * rows_per_task + j, r);
                }
            })
        });
    }
}

/// Evaluates `op` on `inputs` with ONNX semantics.
///
/// Returns one tensor per output of the op, with exactly the metas [`Op::infer`] gives for the
/// inputs' metas. `Input` and `Param` have no kernel (the runtime feeds them) and are
/// [`Error::Unsupported`]; `Constant` returns a copy of its tensor.
pub fn eval(ctx: &CpuContext, op: &Op, inputs: &[&Tensor]) -> Result<Vec<Tensor>, Error> {
    let name = op.name();
    if let Op::Input { .. } | Op::Param { .. } | Op::State { .. } = op {
        return Err(Error::Unsupported {
            op: name,
            reason: "inputs and params are fed by the runtime, not computed".into(),
        });
    }
    // `PoolAttrs::out_hw` (used by inference) assumes windows of at least one cell.
    let empty_window = match op {
        Op::MaxPool(a) | Op::AveragePool(a) => a.kernel.contains(&0),
        Op::Conv(_) => inputs.get(1).is_some_and(|w| w.shape().len() == 4 && (w.shape()[2] == 0 || w.shape()[3] == 0)),
        Op::ConvInputGrad { .. } => {
            inputs.get(1).is_some_and(|w| w.shape().len() == 4 && (w.shape()[2] == 0 || w.shape()[3] == 0))
        }
        Op::ConvWeightGrad { shape, .. } => shape.len() == 4 && (shape[2] == 0 || shape[3] == 0),
        Op::MaxPoolGrad(a) | Op::AveragePoolGrad { attrs: a, .. } => a.kernel.contains(&0),
        _ => false,
    };
    if empty_window {
        return Err(Error::BadInput { op: name, message: "kernel window has a zero-sized dim".into() });
    }
    let metas: Vec<TensorMeta> = inputs.iter().map(|t| t.meta()).collect();
    let outs = op.infer(&metas).map_err(|message| Error::BadInput { op: name, message })?;
    let result = match op {
        Op::Input { .. } | Op::Param { .. } | Op::State { .. } => unreachable!("handled above"),
        Op::Constant(t) => vec![t.clone()],
        Op::Identity => vec![inputs[0].clone()],
        Op::Unary(u) => vec![elementwise::unary(ctx, *u, inputs[0])?],
        Op::Binary(b) => vec![elementwise::binary(ctx, *b, inputs[0], inputs[1], &outs[0].shape)?],
        Op::Where => vec![elementwise::where_(ctx, inputs[0], inputs[1], inputs[2], &outs[0].shape)?],
        Op::Cast { to } => vec![elementwise::cast(inputs[0], *to)?],
        Op::MatMul => vec![linalg::matmul(ctx, inputs[0], inputs[1], &outs[0].shape)?],
        Op::Gemm { alpha, beta, trans_a, trans_b } => {
            vec![linalg::gemm_op(ctx, inputs, *alpha, *beta, *trans_a, *trans_b, &outs[0].shape)?]
        }
        Op::Conv(a) => vec![conv::conv(ctx, a, inputs, &outs[0].shape)?],
        Op::MaxPool(a) => vec![conv::max_pool(ctx, a, inputs[0], &outs[0].shape)?],
        Op::AveragePool(a) => vec![conv::avg_pool(ctx, a, inputs[0], &outs[0].shape)?],
        Op::GlobalAveragePool => vec![conv::global_pool(ctx, inputs[0], false)?],
        Op::GlobalMaxPool => vec![conv::global_pool(ctx, inputs[0], true)?],
        Op::BatchNorm { epsilon } => vec![norm::batch_norm(ctx, inputs, *epsilon)?],
        Op::LayerNorm { axis, epsilon } => vec![norm::layer_norm(ctx, inputs, *axis, *epsilon)?],
        Op::Lrn { size, alpha, beta, bias } => vec![norm::lrn(ctx, inputs[0], *size, *alpha, *beta, *bias)?],
        Op::Softmax { axis } => vec![norm::softmax(ctx, inputs[0], *axis, false)?],
        Op::LogSoftmax { axis } => vec![norm::softmax(ctx, inputs[0], *axis, true)?],
        Op::Reshape { shape } => vec![reshape(inputs[0], shape)?],
        Op::Transpose { perm } => vec![shape::transpose(ctx, inputs[0], perm)?],
        Op::Expand { shape } => vec![shape::expand(ctx, inputs[0], shape)?],
        Op::Concat { axis } => vec![shape::concat(inputs, *axis, &outs[0].shape)?],
        Op::Split { axis, sizes } => shape::split(inputs[0], *axis, sizes)?,
        Op::Slice { axes } => vec![shape::slice(ctx, inputs[0], axes, &outs[0].shape)?],
        Op::Gather { axis } => vec![shape::gather(inputs[0], inputs[1], *axis, &outs[0].shape)?],
        Op::Reduce { op: r, axes, keepdims } => vec![reduce::reduce(ctx, *r, inputs[0], axes, *keepdims)?],
        Op::Pad { pads, value } => vec![shape::pad(inputs[0], pads, *value, &outs[0].shape)?],
        Op::UnaryGrad(u) => vec![grad::unary_grad(ctx, *u, inputs[0], inputs[1])?],
        Op::SoftmaxGrad { axis, log } => vec![grad::softmax_grad(ctx, inputs[0], inputs[1], *axis, *log)?],
        Op::LayerNormGrad { axis, epsilon } => grad::layer_norm_grad(ctx, inputs, *axis, *epsilon)?,
        Op::LrnGrad { size, alpha, beta, bias } => {
            vec![grad::lrn_grad(ctx, inputs[0], inputs[1], *size, *alpha, *beta, *bias)?]
        }
        Op::ConvInputGrad { attrs, shape } => vec![grad::conv_input_grad(ctx, attrs, inputs[0], inputs[1], shape)?],
        Op::ConvWeightGrad { attrs, shape } => {
            vec![grad::conv_weight_grad(ctx, attrs, inputs[0], inputs[1], shape)?]
        }
        Op::MaxPoolGrad(a) => vec![grad::max_pool_grad(ctx, a, inputs[0], inputs[1])?],
        Op::AveragePoolGrad { attrs, shape } => vec![grad::avg_pool_grad(ctx, attrs, inputs[0], shape)?],
        Op::GatherGrad { axis, shape } => vec![grad::gather_grad(inputs[0], inputs[1], *axis, shape)?],
        Op::SliceGrad { axes, shape } => vec![grad::slice_grad(inputs[0], axes, shape)?],
        Op::SgdUpdate { lr, momentum, weight_decay } => grad::sgd_update(ctx, inputs, *lr, *momentum, *weight_decay)?,
        Op::AdamWUpdate { lr, beta1, beta2, epsilon, weight_decay } => {
            grad::adamw_update(inputs, *lr, *beta1, *beta2, *epsilon, *weight_decay)?
        }
    };
    debug_assert_eq!(result.iter().map(|t| t.meta()).collect::<Vec<_>>(), outs, "{name}: kernel output metas");
    Ok(result)
}

fn reshape(x: &Tensor, shape: &[usize]) -> Result<Tensor, Error> {
    x.clone().reshaped(shape.to_vec()).map_err(|e| Error::BadInput { op: "reshape", message: e.to_string() })
}

/// A tensor from a shape and data whose length the kernel computed from that same shape.
pub(crate) fn tensor(op: &'static str, shape: &[usize], data: Data) -> Result<Tensor, Error> {
    Tensor::new(shape.to_vec(), data).map_err(|e| Error::BadInput { op, message: format!("internal size error: {e}") })
}

/// The f32 elements of `t` (callers have checked the dtype through `Op::infer`).
pub(crate) fn f32s<'a>(op: &'static str, t: &'a Tensor) -> Result<&'a [f32], Error> {
    t.as_f32().ok_or_else(|| Error::BadInput { op, message: format!("expected f32, got {}", t.dtype()) })
}

/// Row-major strides of `shape`.
pub(crate) fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}
