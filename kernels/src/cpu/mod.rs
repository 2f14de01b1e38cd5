//! CPU kernels: f32 compute (and the same kernels compiled for f64, see `float.rs`), i64/bool for
//! indices and masks.
//!
//! [`eval`] first runs [`ir::Op::infer`] on the inputs' metas, so every kernel below works on
//! inputs whose count, dtypes and shapes are known to be consistent, and returns exactly the
//! inferred output metas. Data-dependent failures (gather indices out of range, integer division
//! by zero) are checked by the kernels themselves.
//!
//! Parallelism: work is split over the [`CpuContext`]'s own team of threads (`team.rs`: the
//! caller and persistent helpers that spin briefly between ops) only when a tensor is large
//! enough for the split to pay ([`PAR_MIN_ELEMS`]); with one thread everything runs on the
//! caller's thread. Matrix products use the `gemm` crate (see `benches/gemm.rs` for the
//! measurement that chose it), or for thin f32 products of two operands contiguous along the
//! depth the register tiles of `tiles.rs` (AVX-512, which compute a block of the result to the
//! same bits as the whole product), one sequential product per thread on its block of the
//! result. Convolutions build their patch matrix in blocks of output rows that stay in cache
//! (`conv.rs`).

mod float;
pub(crate) mod index;
pub mod random;
pub(crate) mod shape;
mod team;
#[cfg(test)]
mod tests;
mod tiles;

use crate::Error;
pub(crate) use float::Float;
use ir::{DType, Data, Op, Tensor, TensorMeta};
use std::mem::MaybeUninit;

pub use k32::linalg::{gemm_f32, gemm_kernel};

/// The implementation a single-threaded matrix product runs ([`gemm_kernel`]): their speeds
/// differ by up to twice on one shape, so the cost model prices them apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProductKernel {
    /// Few rows against a transposed right operand (or few columns against a left one) of long
    /// depth, the large operand read in place (no packing): one dot product per element, or on
    /// CPUs with AVX-512 the register tiles of [`ProductKernel::Tiles`].
    Dots,
    /// Register tiles of broadcasts against 16-lane vectors (AVX-512), for operands that both
    /// run along the depth (`a @ b^T`, `b` stored `[n, k]`) and are not thin: only the side that
    /// gives vectors is copied, and only when it must be (`tiles.rs`).
    Tiles,
    /// `matrixmultiply`.
    MatrixMultiply,
    /// `gemm`.
    Gemm,
}

/// The float kernels for f32 tensors (see `float.rs`: the same files as [`k64`]).
#[path = "."]
pub(crate) mod k32 {
    /// The element type of this instantiation.
    pub(crate) type F = f32;
    pub(crate) use super::{
        Accumulation, CpuContext, Float, ProductKernel, SendPtr, shape, strides, tensor, wrong_float,
    };
    pub(crate) use std::f32::consts;
    pub(crate) mod activation;
    pub(crate) mod attention;
    pub(crate) mod batch_norm;
    pub(crate) mod conv;
    pub(crate) mod elementwise;
    pub(crate) mod grad;
    pub(crate) mod linalg;
    pub(crate) mod moe;
    pub(crate) mod norm;
    pub(crate) mod reduce;
    pub(crate) mod resize;

    /// The elements of `t`, which must be of this instantiation's type.
    pub(crate) fn floats<'a>(op: &'static str, t: &'a Tensor) -> Result<&'a [F], Error> {
        super::floats(op, t)
    }
    use super::{Error, Tensor};
}

/// The float kernels for f64 tensors: [`k32`]'s files compiled with `F = f64`. Casts between
/// `F` and f64 that are conversions in `k32` are no-ops here.
#[path = "."]
#[allow(clippy::unnecessary_cast, clippy::duplicate_mod, dead_code)]
pub(crate) mod k64 {
    /// The element type of this instantiation.
    pub(crate) type F = f64;
    pub(crate) use super::{
        Accumulation, CpuContext, Float, ProductKernel, SendPtr, shape, strides, tensor, wrong_float,
    };
    pub(crate) use std::f64::consts;
    pub(crate) mod activation;
    pub(crate) mod attention;
    pub(crate) mod batch_norm;
    pub(crate) mod conv;
    pub(crate) mod elementwise;
    pub(crate) mod grad;
    pub(crate) mod linalg;
    pub(crate) mod moe;
    pub(crate) mod norm;
    pub(crate) mod reduce;
    pub(crate) mod resize;

    /// The elements of `t`, which must be of this instantiation's type.
    pub(crate) fn floats<'a>(op: &'static str, t: &'a Tensor) -> Result<&'a [F], Error> {
        super::floats(op, t)
    }
    use super::{Error, Tensor};
}

/// Tensors smaller than this (in elements of work) are processed on the calling thread.
pub const PAR_MIN_ELEMS: usize = 1 << 15;

/// The CPU backend's execution context: an explicit team of worker threads and its size.
///
/// There is no global state: two contexts with different thread counts can be used side by side
/// (one per simulated rank, say) and never share workers.
pub struct CpuContext {
    team: team::Team,
    threads: usize,
    accumulation: Accumulation,
}

/// How matrix products accumulate (an execution option shared with the runtime, defined in `ir`).
pub use ir::Accumulation;

impl std::fmt::Debug for CpuContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuContext").field("threads", &self.threads).field("accumulation", &self.accumulation).finish()
    }
}

/// A pointer tasks write disjoint parts of one buffer through.
pub(crate) struct SendPtr<T>(pub *mut T);
impl<T> Clone for SendPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SendPtr<T> {}
// SAFETY: every user writes disjoint elements from each task and reads none another task writes.
unsafe impl<T> Send for SendPtr<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for SendPtr<T> {}
impl<T> SendPtr<T> {
    /// The pointer (a method, so closures capture the `Sync` wrapper rather than its field).
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}

impl CpuContext {
    /// A context running kernels on `threads` threads, the caller's included (0 means one per
    /// available core). With one thread every kernel runs sequentially on the caller's thread.
    pub fn new(threads: usize) -> Result<CpuContext, Error> {
        let threads =
            if threads == 0 { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) } else { threads };
        let team = team::Team::new(threads, "autopar-cpu")
            .map_err(|e| Error::ThreadPool { threads, message: e.to_string() })?;
        Ok(CpuContext { team, threads, accumulation: Accumulation::F32 })
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

    /// Number of threads, the caller's included.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f(i)` for every `i` in `0..tasks` over the context's threads (the caller's
    /// included), claimed in order; inline when called from inside another task.
    pub(crate) fn run(&self, tasks: usize, f: impl Fn(usize) + Sync) {
        self.team.run(tasks, &f)
    }

    /// [`Self::run`] for fallible tasks: every task runs, and the first error (by task index) is
    /// returned.
    pub(crate) fn try_run<E: Send>(&self, tasks: usize, f: impl Fn(usize) -> Result<(), E> + Sync) -> Result<(), E> {
        let first: std::sync::Mutex<Option<(usize, E)>> = std::sync::Mutex::new(None);
        self.run(tasks, |i| {
            if let Err(e) = f(i) {
                let mut g = first.lock().unwrap_or_else(|p| p.into_inner());
                if g.as_ref().is_none_or(|(j, _)| i < *j) {
                    *g = Some((i, e));
                }
            }
        });
        match first.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some((_, e)) => Err(e),
            None => Ok(()),
        }
    }

    /// True when `work` elements are worth splitting over the threads.
    pub(crate) fn parallel_for(&self, work: usize) -> bool {
        self.threads > 1 && work >= PAR_MIN_ELEMS
    }

    /// `f(a[i], b[i])` for every `i` (`a` and `b` have one length), written straight into a new
    /// vector (no zero-fill first), split over the threads when long.
    pub(crate) fn zip_map<T: Copy + Send + Sync>(
        &self,
        a: &[T],
        b: &[T],
        f: impl Fn(T, T) -> T + Sync + Send,
    ) -> Vec<T> {
        debug_assert_eq!(a.len(), b.len());
        let n = a.len().min(b.len());
        if !self.parallel_for(n) {
            return a.iter().zip(b).map(|(&x, &y)| f(x, y)).collect();
        }
        let parts = (self.threads * 4).min(n / (PAR_MIN_ELEMS / 4)).max(1);
        let per = n.div_ceil(parts);
        let mut out: Vec<T> = Vec::with_capacity(n);
        let dst = SendPtr(out.as_mut_ptr());
        self.run(parts, |t| {
            let (lo, hi) = (t * per, ((t + 1) * per).min(n));
            if lo >= hi {
                return;
            }
            // SAFETY: `out` has capacity `n`; part `t` writes only elements lo..hi.
            let o = unsafe { std::slice::from_raw_parts_mut(dst.get().add(lo).cast::<MaybeUninit<T>>(), hi - lo) };
            for ((o, &x), &y) in o.iter_mut().zip(&a[lo..hi]).zip(&b[lo..hi]) {
                o.write(f(x, y));
            }
        });
        // SAFETY: every part ran (a panic would have left through `run`), so all n are written.
        unsafe { out.set_len(n) };
        out
    }

    /// Calls `f(row_index, row)` for every `row_len`-long row of `out`, in parallel when `out` is
    /// large (the last row is shorter when `row_len` does not divide `out.len()`); rows are
    /// grouped so that each task carries at least [`PAR_MIN_ELEMS`]/4 elements.
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
        // The last row may be shorter (`chunks_mut`'s rule).
        let (len, rows) = (out.len(), out.len().div_ceil(row_len));
        let work = len.saturating_mul(weight.max(1));
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
        let dst = SendPtr(out.as_mut_ptr());
        self.run(rows.div_ceil(rows_per_task), |t| {
            let (lo, hi) = (t * rows_per_task, ((t + 1) * rows_per_task).min(rows));
            for i in lo..hi {
                let at = i * row_len;
                // SAFETY: row i of `out` (elements at..at + its length, inside `len`), written by
                // this task only.
                f(i, unsafe { std::slice::from_raw_parts_mut(dst.get().add(at), row_len.min(len - at)) });
            }
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
    reserve_outputs(name, &metas, &outs)?;
    // Half-precision storage computes in f32: the inputs widened (exactly), each result rounded
    // to its half type once, as PyTorch's bf16/f16 CPU kernels do.
    if !matches!(op, Op::Cast { .. }) && metas.iter().any(|m| m.dtype.is_half()) {
        let wide: Vec<Tensor> = inputs.iter().map(|t| (*t).clone().widened()).collect();
        let refs: Vec<&Tensor> = wide.iter().collect();
        let results = eval(ctx, op, &refs)?;
        return Ok(results.into_iter().zip(&outs).map(|(t, m)| t.with_float_type(m.dtype)).collect());
    }
    // Ops on f64 tensors run the f64 instantiation of the float kernels; everything else (f32,
    // and ops on integers or bools only) the f32 one.
    let wide = metas.iter().chain(&outs).any(|m| m.dtype == DType::F64);
    macro_rules! float {
        ($m:ident :: $f:ident ( $($arg:expr),* $(,)? )) => {
            if wide { k64::$m::$f($($arg),*) } else { k32::$m::$f($($arg),*) }
        };
    }
    let result = match op {
        Op::Input { .. } | Op::Param { .. } | Op::State { .. } => unreachable!("handled above"),
        Op::Constant(t) => vec![t.clone()],
        Op::Identity => vec![inputs[0].clone()],
        Op::Unary(u) => vec![float!(elementwise::unary(ctx, *u, inputs[0]))?],
        Op::Binary(b) => vec![float!(elementwise::binary(ctx, *b, inputs[0], inputs[1], &outs[0].shape))?],
        Op::Where => vec![float!(elementwise::where_(ctx, inputs[0], inputs[1], inputs[2], &outs[0].shape))?],
        Op::Cast { to } => vec![k32::elementwise::cast(inputs[0], *to)?],
        Op::MatMul => vec![float!(linalg::matmul(ctx, inputs[0], inputs[1], &outs[0].shape))?],
        Op::Gemm { alpha, beta, trans_a, trans_b } => {
            vec![float!(linalg::gemm_op(ctx, inputs, *alpha, *beta, *trans_a, *trans_b, &outs[0].shape))?]
        }
        Op::Conv(a) => vec![float!(conv::conv(ctx, a, inputs, &outs[0].shape))?],
        Op::MaxPool(a) => vec![float!(conv::max_pool(ctx, a, inputs[0], &outs[0].shape))?],
        Op::AveragePool(a) => vec![float!(conv::avg_pool(ctx, a, inputs[0], &outs[0].shape))?],
        Op::GlobalAveragePool => vec![float!(conv::global_pool(ctx, inputs[0], false))?],
        Op::GlobalMaxPool => vec![float!(conv::global_pool(ctx, inputs[0], true))?],
        Op::BatchNorm { epsilon } => vec![float!(norm::batch_norm(ctx, inputs, *epsilon))?],
        Op::LayerNorm { axis, epsilon } => vec![float!(norm::layer_norm(ctx, inputs, *axis, *epsilon))?],
        Op::Lrn { size, alpha, beta, bias } => vec![float!(norm::lrn(ctx, inputs[0], *size, *alpha, *beta, *bias))?],
        Op::Softmax { axis } => vec![float!(norm::softmax(ctx, inputs[0], *axis, false))?],
        Op::LogSoftmax { axis } => vec![float!(norm::softmax(ctx, inputs[0], *axis, true))?],
        Op::Reshape { shape } => vec![reshape(inputs[0], shape)?],
        Op::Transpose { perm } => vec![shape::transpose(ctx, inputs[0], perm)?],
        Op::Expand { shape } => vec![shape::expand(ctx, inputs[0], shape)?],
        Op::Concat { axis } => vec![shape::concat(inputs, *axis, &outs[0].shape)?],
        Op::Split { axis, sizes } => shape::split(inputs[0], *axis, sizes)?,
        Op::Slice { axes } => vec![shape::slice(ctx, inputs[0], axes, &outs[0].shape)?],
        Op::Gather { axis } => vec![shape::gather(inputs[0], inputs[1], *axis, &outs[0].shape)?],
        Op::Reduce { op: r, axes, keepdims } => vec![float!(reduce::reduce(ctx, *r, inputs[0], axes, *keepdims))?],
        Op::Pad { pads, value } => vec![shape::pad(inputs[0], pads, *value, &outs[0].shape)?],
        Op::UnaryGrad(u) => vec![float!(grad::unary_grad(ctx, *u, inputs[0], inputs[1]))?],
        Op::SoftmaxGrad { axis, log } => vec![float!(grad::softmax_grad(ctx, inputs[0], inputs[1], *axis, *log))?],
        Op::LayerNormGrad { axis, epsilon } => float!(grad::layer_norm_grad(ctx, inputs, *axis, *epsilon))?,
        Op::LrnGrad { size, alpha, beta, bias } => {
            vec![float!(grad::lrn_grad(ctx, inputs[0], inputs[1], *size, *alpha, *beta, *bias))?]
        }
        Op::ConvInputGrad { attrs, shape } => {
            vec![float!(grad::conv_input_grad(ctx, attrs, inputs[0], inputs[1], shape))?]
        }
        Op::ConvWeightGrad { attrs, shape } => {
            vec![float!(grad::conv_weight_grad(ctx, attrs, inputs[0], inputs[1], shape))?]
        }
        Op::MaxPoolGrad(a) => vec![float!(grad::max_pool_grad(ctx, a, inputs[0], inputs[1]))?],
        Op::AveragePoolGrad { attrs, shape } => vec![float!(grad::avg_pool_grad(ctx, attrs, inputs[0], shape))?],
        Op::GatherGrad { axis, shape } => vec![float!(grad::gather_grad(inputs[0], inputs[1], *axis, shape))?],
        Op::SliceGrad { axes, shape } => vec![float!(grad::slice_grad(inputs[0], axes, shape))?],
        Op::SgdUpdate { lr, momentum, weight_decay } => {
            float!(grad::sgd_update(ctx, inputs, *lr, *momentum, *weight_decay))?
        }
        Op::AdamWUpdate { lr, beta1, beta2, epsilon, weight_decay } => {
            float!(grad::adamw_update(inputs, *lr, *beta1, *beta2, *epsilon, *weight_decay))?
        }
        Op::Resize(a) => vec![float!(resize::resize(ctx, a, inputs[0], &outs[0].shape))?],
        Op::ResizeGrad { attrs, shape } => vec![float!(resize::resize_grad(ctx, attrs, inputs[0], shape))?],
        Op::BatchNormTrain { epsilon } => vec![float!(batch_norm::batch_norm_train(ctx, inputs, *epsilon))?],
        Op::BatchNormTrainGrad { epsilon } => float!(batch_norm::batch_norm_train_grad(ctx, inputs, *epsilon))?,
        Op::Hardmax { axis } => vec![float!(activation::hardmax(ctx, inputs[0], *axis))?],
        Op::Index(x) => index::eval(x, inputs, &outs.iter().map(|m| m.shape.clone()).collect::<Vec<_>>())?,
        // Without a step to draw for, dropout is inference: nothing dropped (the runtime's
        // training steps call `random::dropout` with their draw).
        Op::Dropout(a) => random::dropout(ctx, a, inputs[0], None)?,
        Op::Attention(a) => float!(attention::attention(ctx, a, inputs))?,
        Op::AttentionGrad(a) => float!(attention::attention_grad(ctx, a, inputs))?,
        Op::Moe(a) => float!(moe::moe(a, inputs))?,
        Op::MoeGrad(a) => float!(moe::moe_grad(a, inputs))?,
    };
    debug_assert_eq!(result.iter().map(|t| t.meta()).collect::<Vec<_>>(), outs, "{name}: kernel output metas");
    Ok(result)
}

/// Checks that the memory `op` is about to allocate can be: its outputs, and for half-precision
/// inputs the f32 copies it computes on ([`ir::alloc::reserve`]). Every kernel runs after this
/// check, so a model or plan that asks for more memory than the system gives is
/// [`Error::OutOfMemory`] naming the bytes, whatever kernel a new op adds; the kernels' own large
/// buffers are allocated fallibly as well where they are made (`shape.rs`).
fn reserve_outputs(op: &'static str, ins: &[TensorMeta], outs: &[TensorMeta]) -> Result<(), Error> {
    let oom = |bytes| Error::OutOfMemory { op, bytes };
    let wide =
        |m: &TensorMeta| if m.dtype.is_half() { m.checked_numel().and_then(|n| n.checked_mul(4)) } else { Some(0) };
    let mut total = Some(0usize);
    for m in outs {
        total = total.and_then(|t| t.checked_add(m.checked_bytes()?)).and_then(|t| t.checked_add(wide(m)?));
    }
    for m in ins {
        total = total.and_then(|t| t.checked_add(wide(m)?));
    }
    let total = total.ok_or(oom(None))?;
    ir::alloc::reserve(total).map_err(|e| oom(e.bytes))
}

fn reshape(x: &Tensor, shape: &[usize]) -> Result<Tensor, Error> {
    x.clone().reshaped(shape.to_vec()).map_err(|e| Error::BadInput { op: "reshape", message: e.to_string() })
}

/// A tensor from a shape and data whose length the kernel computed from that same shape.
pub(crate) fn tensor(op: &'static str, shape: &[usize], data: Data) -> Result<Tensor, Error> {
    Tensor::new(shape.to_vec(), data).map_err(|e| Error::BadInput { op, message: format!("internal size error: {e}") })
}

/// The float elements of `t` (callers have checked the dtype through `Op::infer`).
fn floats<'a, T: Float>(op: &'static str, t: &'a Tensor) -> Result<&'a [T], Error> {
    T::view(t).ok_or_else(|| Error::BadInput { op, message: format!("expected {}, got {}", T::DTYPE, t.dtype()) })
}

/// A float tensor of the other float type reached a kernel instantiation (a dispatch bug).
pub(crate) fn wrong_float(op: &'static str, got: DType) -> Error {
    Error::Unsupported { op, reason: format!("{got} input reached a kernel not compiled for it (a dispatch bug)") }
}

/// Row-major strides of `shape`.
pub(crate) fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}
