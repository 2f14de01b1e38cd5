//! CUDA backend: the ops of [`crate::cpu`] on an NVIDIA GPU, plus NCCL collectives.
//!
//! What it is for: the runtime executes a plan's local ops on one GPU per rank with
//! [`eval`], and its collectives with `nccl::NcclComm` (one process per GPU): see
//! `runtime::gpu`, the `nccl` back end of `autopar run`. The CPU backend
//! stays the reference: every op here has the same contract as [`crate::cpu::eval`] and is
//! tested against it.
//!
//! Built without the `cuda` cargo feature this module is a stub (candle's `dummy_cuda_backend`
//! pattern): the same types and functions exist, and every entry point returns
//! [`Error::NotCompiledWith`](crate::Error::NotCompiledWith)`("cuda")`, so the workspace builds and tests everywhere.
//!
//! With the feature, the CUDA libraries are loaded at run time (cudarc's `dynamic-loading`):
//! the crate builds with no CUDA toolkit or driver installed, and on a machine without them
//! [`CudaContext::new`] returns [`Error::NoCudaDevice`](crate::Error::NoCudaDevice) with the reason instead of panicking.
//!
//! Invariants kept by the feature build:
//! - No global state: a [`CudaContext`] owns its device handle, its one stream, its cuBLAS
//!   handle, its NVRTC modules (compiled lazily, once per context and op family) and its memory
//!   accounting. Every kernel, copy and collective of a context runs on that one stream, in
//!   order, so no cross-stream synchronisation is needed (cudarc's per-buffer event tracking is
//!   off for the context).
//! - A [`CudaTensor`] is immutable once made: ops write only into buffers they allocate, so
//!   tensors may share a device buffer (`Reshape`, `Identity` and `clone` copy nothing).
//! - [`eval`] runs [`ir::Op::infer`] first and returns exactly the inferred metas; bad input
//!   is [`Error::BadInput`](crate::Error::BadInput), never a panic. Data-dependent checks the CPU makes (gather indices
//!   in range, integer division by zero, the AdamW step number) read the needed values back
//!   to the host, which synchronises the stream.
//! - Bool tensors are one byte per element on the device (0 or 1).
//! - bf16 and f16 tensors are their bits on the device (two bytes per element). Every op but
//!   `Cast` widens its 16-bit inputs to f32, runs the f32 kernel and rounds each result once
//!   (to nearest, ties to even, bit for bit as the CPU's `half` crate), as the CPU back end
//!   does; reductions over NCCL run in f32 and round once, gathers and sends move the 16-bit
//!   bytes. Matrix products of 16-bit operands are `cublasGemmEx` calls with f32 accumulation
//!   into an f32 result, rounded once (tensor cores on devices that have them).
//! - Matrix products go through cuBLAS in its default math mode (no TF32 for f32 data), so
//!   they round like any f32 GEMM; sums of reductions and normalisations accumulate in f64 as
//!   the CPU does. Results agree with the CPU to about 1e-5 absolute / 1e-4 relative, not
//!   bitwise (summation order and fused multiply-adds differ).
//!
//! Testing: `tests/cuda.rs` compares every op family with the CPU on a GPU when there is one,
//! and otherwise runs the same suite on a CPU emulation of libcuda/libnvrtc/libcublas built with
//! the host C++ compiler (see that file for what the emulation can and cannot show).
//!
//! Device libraries looked up at run time (by the dynamic loader, so their directory, e.g.
//! `/usr/local/cuda/lib64`, must be on `LD_LIBRARY_PATH` or in `ld.so.conf`): `libcuda.so`
//! (the driver), `libnvrtc.so`, `libcublas.so` (or their `.so.12` / `.so.11` names), and for
//! `nccl` `libnccl.so`. cudarc searches `libnccl.so` and
//! `libnccl.so.{12,11,10,9,1}` but not NCCL's usual `libnccl.so.2`: on GPU machines install
//! `libnccl-dev` (which provides `libnccl.so`) or add a symlink
//! `ln -s libnccl.so.2 /usr/lib/x86_64-linux-gnu/libnccl.so`.

#[cfg(not(feature = "cuda"))]
mod stub;
#[cfg(not(feature = "cuda"))]
pub use stub::{CudaContext, CudaTensor, device_count, dropout, eval, is_available};

/// Launches kernel `$name` of family `$fam` with config `$cfg` and the given arguments, in
/// order (references to device buffers or to scalars that outlive the launch), mapping a launch
/// failure to [`Error::Cuda`] for op `$op`. Evaluates to `Result<(), Error>`; the kernel lookup
/// (and the module's compilation on first use) returns early with `?`.
#[cfg(feature = "cuda")]
macro_rules! launch {
    ($ctx:expr, $op:expr, $fam:expr, $name:expr, $cfg:expr; $($arg:expr),* $(,)?) => {{
        use cudarc::driver::PushKernelArg as _;
        let func = $ctx.func($fam, $name)?;
        let mut builder = $ctx.stream().launch_builder(&func);
        $( builder.arg($arg); )*
        // SAFETY: every kernel of this backend takes exactly the parameters its caller pushes,
        // in order and with the same types (checked by reading the kernel source next to each
        // call), and touches only indices below the element counts it is given, which never
        // exceed the lengths of the buffers passed.
        unsafe { builder.launch($cfg) }.map(|_| ()).map_err(|e| $crate::cuda::device::cuda_err($op, e))
    }};
}

#[cfg(feature = "cuda")]
mod activation;
#[cfg(feature = "cuda")]
mod conv;
#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
mod elementwise;
#[cfg(feature = "cuda")]
mod index;
#[cfg(feature = "cuda")]
mod linalg;
#[cfg(feature = "cuda")]
pub mod nccl;
#[cfg(feature = "cuda")]
mod norm;
#[cfg(feature = "cuda")]
mod ops;
#[cfg(feature = "cuda")]
mod optim;
#[cfg(feature = "cuda")]
mod random;
#[cfg(feature = "cuda")]
mod reduce;
#[cfg(feature = "cuda")]
mod resize;
#[cfg(feature = "cuda")]
mod shape;
#[cfg(feature = "cuda")]
mod tensor;

#[cfg(feature = "cuda")]
pub use device::{CudaContext, device_count, is_available};
#[cfg(feature = "cuda")]
pub use ops::eval;
#[cfg(feature = "cuda")]
pub use random::dropout;
#[cfg(feature = "cuda")]
pub use tensor::CudaTensor;
