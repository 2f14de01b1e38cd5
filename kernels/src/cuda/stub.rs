//! The CUDA backend of a build without the `cuda` feature: the public types and functions of
//! the real backend, each entry point returning [`Error::NotCompiledWith`]`("cuda")`.

use crate::Error;
use ir::{Tensor, TensorMeta};

/// A CUDA device handle. Cannot be created in this build.
#[derive(Debug)]
pub struct CudaContext {
    _private: (),
}

impl CudaContext {
    /// Opens CUDA device `ordinal`: always [`Error::NotCompiledWith`] in this build.
    pub fn new(ordinal: usize) -> Result<CudaContext, Error> {
        let _ = ordinal;
        unavailable()
    }
    /// Bytes of device memory currently allocated through this context.
    pub fn bytes_in_use(&self) -> usize {
        0
    }
    /// The most bytes allocated at once since the context was made or [`Self::reset_peak`].
    pub fn peak_bytes(&self) -> usize {
        0
    }
    /// Restarts peak tracking from the current usage.
    pub fn reset_peak(&self) {}
}

/// A tensor in device memory. Cannot be created in this build.
#[derive(Debug, Clone)]
pub struct CudaTensor {
    meta: TensorMeta,
}

impl CudaTensor {
    /// Copies a host tensor to the device: always [`Error::NotCompiledWith`] in this build.
    pub fn upload(ctx: &CudaContext, t: &Tensor) -> Result<CudaTensor, Error> {
        let _ = (ctx, t);
        unavailable()
    }
    /// Copies the tensor back to the host.
    pub fn download(&self, ctx: &CudaContext) -> Result<Tensor, Error> {
        let _ = ctx;
        unavailable()
    }
    /// Shape and dtype.
    pub fn meta(&self) -> &TensorMeta {
        &self.meta
    }
    /// Bytes of the elements.
    pub fn bytes(&self) -> usize {
        self.meta.bytes()
    }
}

/// Evaluates `op` on device tensors. Same contract as [`crate::cpu::eval`].
pub fn eval(ctx: &CudaContext, op: &ir::Op, inputs: &[&CudaTensor]) -> Result<Vec<CudaTensor>, Error> {
    let _ = (ctx, op, inputs);
    unavailable()
}

/// Training-mode dropout of a block of its tensor on the device: always
/// [`Error::NotCompiledWith`] in this build.
pub fn dropout(
    ctx: &CudaContext,
    a: &ir::DropoutAttrs,
    x: &CudaTensor,
    draw: Option<&crate::random::Draw>,
) -> Result<Vec<CudaTensor>, Error> {
    let _ = (ctx, a, x, draw);
    unavailable()
}

/// Number of CUDA devices: always [`Error::NotCompiledWith`] in this build.
pub fn device_count() -> Result<usize, Error> {
    unavailable()
}

/// True when this build can drive CUDA devices: never in this build.
pub fn is_available() -> bool {
    false
}

fn unavailable<T>() -> Result<T, Error> {
    Err(Error::NotCompiledWith("cuda"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn stub_reports_missing_feature() {
        assert_eq!(super::CudaContext::new(0).unwrap_err(), crate::Error::NotCompiledWith("cuda"));
        assert!(!super::is_available());
    }
}
