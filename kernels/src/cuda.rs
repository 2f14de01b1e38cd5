//! CUDA backend.
//!
//! Without the `cuda` feature this is a stub whose entry points return
//! [`Error::NotCompiledWith`]`("cuda")`, so the workspace builds and tests on machines without a
//! GPU (candle's `dummy_cuda_backend` pattern). The real backend (cudarc: cuBLAS, NVRTC) lives behind
//! the feature and is not written yet: with the feature on, the entry points report
//! [`Error::Unsupported`].

use crate::Error;

/// A CUDA device handle. Holds nothing in this build.
#[derive(Debug)]
pub struct CudaContext {
    _private: (),
}

impl CudaContext {
    /// Opens CUDA device `ordinal`.
    pub fn new(ordinal: usize) -> Result<CudaContext, Error> {
        let _ = ordinal;
        unavailable()
    }
}

/// Evaluates `op` on device tensors. Same contract as [`crate::cpu::eval`].
pub fn eval(ctx: &CudaContext, op: &ir::Op, inputs: &[&ir::Tensor]) -> Result<Vec<ir::Tensor>, Error> {
    let _ = (ctx, op, inputs);
    unavailable()
}

/// True when this build can drive CUDA devices.
pub fn is_available() -> bool {
    false
}

#[cfg(not(feature = "cuda"))]
fn unavailable<T>() -> Result<T, Error> {
    Err(Error::NotCompiledWith("cuda"))
}

#[cfg(feature = "cuda")]
fn unavailable<T>() -> Result<T, Error> {
    Err(Error::Unsupported { op: "cuda", reason: "the CUDA backend is not implemented yet".into() })
}

#[cfg(test)]
mod tests {
    #[test]
    #[cfg(not(feature = "cuda"))]
    fn stub_reports_missing_feature() {
        assert_eq!(super::CudaContext::new(0).unwrap_err(), crate::Error::NotCompiledWith("cuda"));
        assert!(!super::is_available());
    }
}
