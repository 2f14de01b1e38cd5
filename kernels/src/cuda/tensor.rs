//! Device tensors: a counted device buffer and a [`TensorMeta`].

use super::device::{CudaContext, DeviceBuf};
use crate::Error;
use ir::{DType, Data, Tensor, TensorMeta};
use std::sync::Arc;

/// Device storage of one dtype. Bool is one byte per element, 0 or 1. bf16 and f16 are their
/// bits, two little-endian bytes per element (kernels read them as `unsigned short`; collectives
/// that only move data move the bytes).
#[derive(Debug)]
pub(crate) enum Buf {
    F32(DeviceBuf<f32>),
    I64(DeviceBuf<i64>),
    Bool(DeviceBuf<u8>),
    Half(DeviceBuf<u8>),
}

/// A dense, row-major tensor in the memory of one [`CudaContext`]'s device.
///
/// Immutable once made: ops allocate new tensors for their outputs, so `clone` (and the
/// `Reshape` / `Identity` ops) share the buffer instead of copying it. The buffer is freed, and
/// leaves the context's [`CudaContext::bytes_in_use`], when the last tensor sharing it drops.
/// A tensor must only be used with the context that made it.
#[derive(Debug, Clone)]
pub struct CudaTensor {
    meta: TensorMeta,
    buf: Arc<Buf>,
}

fn bad(op: &'static str, message: String) -> Error {
    Error::BadInput { op, message }
}

/// f64 tensors (`--precision f64`) are for checking plans on CPU ranks; the GPU back end has no
/// f64 kernels.
pub(crate) fn no_f64(op: &'static str) -> Error {
    Error::Unsupported { op, reason: "f64 tensors run on CPU ranks only (the GPU kernels are f32)".into() }
}

/// A 16-bit float tensor reached a kernel: [`crate::cuda::eval`] widens them first, so this is
/// a dispatch bug, reported rather than a panic.
pub(crate) fn unwidened(op: &'static str) -> Error {
    Error::Unsupported { op, reason: "a bf16/f16 input reached an f32 kernel unwidened (a dispatch bug)".into() }
}

fn half_bytes(bits: impl Iterator<Item = u16>) -> Vec<u8> {
    bits.flat_map(u16::to_le_bytes).collect()
}

impl CudaTensor {
    /// Copies a host tensor to the device.
    pub fn upload(ctx: &CudaContext, t: &Tensor) -> Result<CudaTensor, Error> {
        let op = "upload";
        let buf = match t.data() {
            Data::F32(v) => Buf::F32(ctx.upload_slice(op, v)?),
            Data::F64(_) => return Err(no_f64(op)),
            Data::BF16(v) => Buf::Half(ctx.upload_slice(op, &half_bytes(v.iter().map(|x| x.to_bits())))?),
            Data::F16(v) => Buf::Half(ctx.upload_slice(op, &half_bytes(v.iter().map(|x| x.to_bits())))?),
            Data::I64(v) => Buf::I64(ctx.upload_slice(op, v)?),
            Data::Bool(v) => Buf::Bool(ctx.upload_slice(op, &v.iter().map(|&b| b as u8).collect::<Vec<u8>>())?),
        };
        Ok(CudaTensor { meta: t.meta(), buf: Arc::new(buf) })
    }

    /// Copies the tensor back to the host (waits for the work that produces it).
    pub fn download(&self, ctx: &CudaContext) -> Result<Tensor, Error> {
        let op = "download";
        let n = self.meta.numel();
        let data = match &*self.buf {
            Buf::F32(b) => Data::F32(ctx.download_slice(op, b, n)?),
            Buf::I64(b) => Data::I64(ctx.download_slice(op, b, n)?),
            Buf::Bool(b) => Data::Bool(ctx.download_slice(op, b, n)?.into_iter().map(|x| x != 0).collect()),
            Buf::Half(b) => {
                let bytes = ctx.download_slice(op, b, 2 * n)?;
                let bits = bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]]));
                match self.meta.dtype {
                    DType::BF16 => Data::BF16(bits.map(ir::half::bf16::from_bits).collect()),
                    _ => Data::F16(bits.map(ir::half::f16::from_bits).collect()),
                }
            }
        };
        Tensor::new(self.meta.shape.clone(), data).map_err(|e| bad(op, e.to_string()))
    }

    /// A tensor of `meta` filled with zeros (false for bool).
    pub fn zeros(ctx: &CudaContext, meta: &TensorMeta) -> Result<CudaTensor, Error> {
        let op = "zeros";
        let n = meta.numel();
        let buf = match meta.dtype {
            DType::F32 => Buf::F32(ctx.zeros(op, n)?),
            DType::F64 => return Err(no_f64(op)),
            DType::BF16 | DType::F16 => Buf::Half(ctx.zeros(op, 2 * n)?),
            DType::I64 => Buf::I64(ctx.zeros(op, n)?),
            DType::Bool => Buf::Bool(ctx.zeros(op, n)?),
        };
        Ok(CudaTensor { meta: meta.clone(), buf: Arc::new(buf) })
    }

    /// Shape and dtype.
    pub fn meta(&self) -> &TensorMeta {
        &self.meta
    }

    /// Dimensions, outermost first.
    pub fn shape(&self) -> &[usize] {
        &self.meta.shape
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.meta.dtype
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.meta.numel()
    }

    /// Bytes of the elements (bool: one per element).
    pub fn bytes(&self) -> usize {
        self.meta.bytes()
    }

    pub(crate) fn new(meta: TensorMeta, buf: Buf) -> CudaTensor {
        CudaTensor { meta, buf: Arc::new(buf) }
    }

    pub(crate) fn from_f32(shape: &[usize], b: DeviceBuf<f32>) -> CudaTensor {
        CudaTensor::new(TensorMeta::new(DType::F32, shape.to_vec()), Buf::F32(b))
    }

    /// The same buffer under another shape with the same element count.
    pub(crate) fn with_shape(&self, shape: &[usize]) -> CudaTensor {
        debug_assert_eq!(shape.iter().product::<usize>(), self.numel());
        CudaTensor { meta: TensorMeta::new(self.meta.dtype, shape.to_vec()), buf: self.buf.clone() }
    }

    pub(crate) fn buf(&self) -> &Buf {
        &self.buf
    }

    /// The f32 buffer (callers have checked the dtype through `Op::infer`).
    pub(crate) fn f32s(&self, op: &'static str) -> Result<&DeviceBuf<f32>, Error> {
        match &*self.buf {
            Buf::F32(b) => Ok(b),
            _ => Err(bad(op, format!("expected f32, got {}", self.meta.dtype))),
        }
    }

    /// The i64 buffer.
    pub(crate) fn i64s(&self, op: &'static str) -> Result<&DeviceBuf<i64>, Error> {
        match &*self.buf {
            Buf::I64(b) => Ok(b),
            _ => Err(bad(op, format!("expected i64, got {}", self.meta.dtype))),
        }
    }

    /// The bytes of a bf16 or f16 buffer (two per element).
    pub(crate) fn halves(&self, op: &'static str) -> Result<&DeviceBuf<u8>, Error> {
        match &*self.buf {
            Buf::Half(b) => Ok(b),
            _ => Err(bad(op, format!("expected bf16 or f16, got {}", self.meta.dtype))),
        }
    }

    /// The bool buffer (bytes 0/1).
    pub(crate) fn bools(&self, op: &'static str) -> Result<&DeviceBuf<u8>, Error> {
        match &*self.buf {
            Buf::Bool(b) => Ok(b),
            _ => Err(bad(op, format!("expected bool, got {}", self.meta.dtype))),
        }
    }
}
