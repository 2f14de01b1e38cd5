//! Op implementations per backend for autopar's IR.
//!
//! Every backend evaluates one [`ir::Op`] on concrete tensors with the op's ONNX semantics and
//! produces exactly the output metas that [`ir::Op::infer`] computes for the inputs' metas.
//!
//! - [`cpu`]: f32 kernels, the same compiled for f64 (`--precision f64`), and i64 and bool where
//!   indices and masks need them. Matrix products and
//!   convolutions go through the `gemm` crate (the fastest of the GEMM crates measured in
//!   `benches/gemm.rs`), except f32 products whose operands both run along the depth and that
//!   are thin, which run as AVX-512 register tiles where the CPU has them ([`cpu::ProductKernel`]);
//!   all parallel work runs on the thread pool of an explicit [`cpu::CpuContext`], never on a
//!   global pool.
//! - [`cuda`]: the same ops on an NVIDIA GPU (cuBLAS for matrix products, NVRTC-compiled kernels
//!   for the rest, NCCL collectives) when the crate is built with the `cuda` feature; without it
//!   a stub whose every entry point returns [`Error::NotCompiledWith`]. Built with the feature on
//!   a machine without a GPU, it reports [`Error::NoCudaDevice`] instead of failing to build.
//!
//! Bad input never panics: wrong arity, dtypes or shapes, out-of-range gather indices and integer
//! division by zero are all [`Error::BadInput`]; outputs larger than the memory the system gives
//! are [`Error::OutOfMemory`], never an abort.
//!
//! ```
//! use ir::{BinaryOp, Op, Tensor};
//! let ctx = kernels::cpu::CpuContext::new(1)?;
//! let a = Tensor::f32([2, 2], vec![1.0, 2.0, 3.0, 4.0]);
//! let b = Tensor::f32([2], vec![10.0, 20.0]);
//! let out = kernels::cpu::eval(&ctx, &Op::Binary(BinaryOp::Add), &[&a, &b])?;
//! assert_eq!(out[0], Tensor::f32([2, 2], vec![11.0, 22.0, 13.0, 24.0]));
//! # Ok::<(), kernels::Error>(())
//! ```
#![warn(missing_docs)]

pub mod cpu;
pub mod cuda;
mod geometry;
mod optim;
pub mod random;

/// Why a kernel could not run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// The op (or this form of it) has no kernel on this backend. Our gap, not the user's.
    #[error("{op}: not supported: {reason}")]
    Unsupported {
        /// Op name as in the IR text form.
        op: &'static str,
        /// What is missing.
        reason: String,
    },
    /// The inputs do not fit the op: wrong count, dtype or shape, out-of-range indices, integer
    /// division by zero. The caller's input (or an unverified graph), not a kernel bug.
    #[error("{op}: bad input: {message}")]
    BadInput {
        /// Op name as in the IR text form.
        op: &'static str,
        /// What is wrong.
        message: String,
    },
    /// The backend needs a cargo feature this build lacks (e.g. `"cuda"`).
    #[error("autopar was built without {0} support (rebuild with `--features {0}`)")]
    NotCompiledWith(&'static str),
    /// No usable CUDA device: the driver library (or NVRTC, cuBLAS, NCCL) cannot be loaded, or
    /// the requested device does not exist. The machine's setup, not a kernel bug.
    #[error("no CUDA device: {0}")]
    NoCudaDevice(String),
    /// A CUDA driver, cuBLAS, NVRTC or NCCL call failed on a device that was opened: out of
    /// device memory, a kernel that did not compile or launch, a communicator error.
    #[error("{op}: CUDA error: {message}")]
    Cuda {
        /// Op (or backend operation) that made the call.
        op: &'static str,
        /// The library's error.
        message: String,
    },
    /// Ranks could not meet to build a communicator: the NCCL unique id could not be written,
    /// or did not appear in time. The launch setup (paths, ranks that never started).
    #[error("rendezvous failed: {0}")]
    Rendezvous(String),
    /// The memory of an op's results (and of the working copies it makes) cannot be allocated:
    /// the model or plan asks for more than the machine gives (or than `ulimit -v` allows).
    /// Checked before the kernel runs (see [`cpu::eval`]), so it is an error, never an abort.
    #[error("{op}: {}", ir::AllocError { bytes: *bytes })]
    OutOfMemory {
        /// Op name as in the IR text form.
        op: &'static str,
        /// Bytes asked for (`None`: more than a usize counts).
        bytes: Option<usize>,
    },
    /// The worker thread pool could not be created.
    #[error("cannot start a pool of {threads} threads: {message}")]
    ThreadPool {
        /// Threads requested.
        threads: usize,
        /// The operating system's reason.
        message: String,
    },
}

impl Error {
    /// An allocation for `op` that the system refused.
    pub fn out_of_memory(op: &'static str, e: ir::AllocError) -> Error {
        Error::OutOfMemory { op, bytes: e.bytes }
    }
}
