//! Matrix products through cuBLAS: `MatMul` (numpy batching, strided-batched SGEMM) and `Gemm`.
//!
//! cuBLAS is column-major; a row-major `r x c` buffer is the column-major `c x r` matrix, its
//! transpose. So the row-major product `C = op(A) @ op(B)` is computed as the column-major
//! `C^T = op(B)^T @ op(A)^T`: B goes first, the dims become `(n, m, k)`, and each operand's
//! transpose flag is the row-major one.
//!
//! bf16 and f16 operands go through `cublasGemmEx` (tensor cores where the device has them) with
//! f32 accumulation into an f32 result, rounded once to the operands' type: the values the CPU
//! computes (f32 products of the widened operands, rounded once).

use super::device::{CudaContext, DeviceBuf, cuda_err};
use super::shape::{broadcast_f32_buf, expand};
use super::tensor::{Buf, CudaTensor};
use crate::Error;
use cudarc::cublas::sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
use cudarc::cublas::{Gemm, GemmConfig, StridedBatchedConfig};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use ir::{DType, TensorMeta};

/// Shape of one batch of row-major products for [`sgemm`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Product {
    /// Rows of `op(A)` and C.
    pub m: usize,
    /// Columns of `op(B)` and C.
    pub n: usize,
    /// Columns of `op(A)`, rows of `op(B)`.
    pub k: usize,
    /// A holds `k x m` (it is transposed in the product).
    pub trans_a: bool,
    /// B holds `n x k`.
    pub trans_b: bool,
    /// Products in the batch.
    pub batch: usize,
    /// Elements between consecutive A matrices (0: one A for all).
    pub stride_a: usize,
    /// Elements between consecutive B matrices.
    pub stride_b: usize,
    /// Elements between consecutive C matrices.
    pub stride_c: usize,
    /// Scale of the product.
    pub alpha: f32,
    /// Scale of C's previous content (0: C is not read).
    pub beta: f32,
}

fn int(op: &'static str, v: usize) -> Result<i32, Error> {
    i32::try_from(v)
        .map_err(|_| Error::Unsupported { op, reason: format!("dimension {v} exceeds cuBLAS's 32-bit sizes") })
}

/// `C[i] = alpha * op(A[i]) @ op(B[i]) + beta * C[i]` for every product of the batch, on
/// row-major matrices (see the module docs for the mapping to cuBLAS). Callers ensure
/// `m, n, k > 0` and that the buffers hold the strided batch.
pub(crate) fn sgemm<A: DevicePtr<f32>, B: DevicePtr<f32>, C: DevicePtrMut<f32>>(
    ctx: &CudaContext,
    op: &'static str,
    p: Product,
    a: &A,
    b: &B,
    c: &mut C,
) -> Result<(), Error> {
    debug_assert!(p.m > 0 && p.n > 0 && p.k > 0 && p.batch > 0);
    let cfg = GemmConfig {
        transa: if p.trans_b { CUBLAS_OP_T } else { CUBLAS_OP_N },
        transb: if p.trans_a { CUBLAS_OP_T } else { CUBLAS_OP_N },
        m: int(op, p.n)?,
        n: int(op, p.m)?,
        k: int(op, p.k)?,
        alpha: p.alpha,
        lda: int(op, if p.trans_b { p.k } else { p.n })?,
        ldb: int(op, if p.trans_a { p.m } else { p.k })?,
        beta: p.beta,
        ldc: int(op, p.n)?,
    };
    // SAFETY: the dims and leading dimensions above describe matrices that lie inside the
    // buffers (callers size them for the batch), and C does not alias A or B (C is a buffer the
    // op allocated).
    let r = if p.batch == 1 {
        unsafe { ctx.blas().gemm(cfg, b, a, c) }
    } else {
        let batched = StridedBatchedConfig {
            gemm: cfg,
            batch_size: int(op, p.batch)?,
            stride_a: p.stride_b as i64,
            stride_b: p.stride_a as i64,
            stride_c: p.stride_c as i64,
        };
        unsafe { ctx.blas().gemm_strided_batched(batched, b, a, c) }
    };
    r.map_err(|e| cuda_err(op, e))
}

/// [`sgemm`] of f32 operands, or `cublasGemmEx` of 16-bit ones (both of one type), into an f32
/// `c`.
fn product(
    ctx: &CudaContext,
    op: &'static str,
    p: Product,
    a: &CudaTensor,
    b: &CudaTensor,
    c: &mut DeviceBuf<f32>,
) -> Result<(), Error> {
    match (a.buf(), b.buf()) {
        (Buf::F32(x), Buf::F32(y)) => sgemm(ctx, op, p, &x.s, &y.s, &mut c.s),
        (Buf::Half(x), Buf::Half(y)) if a.dtype() == b.dtype() => gemm_ex(ctx, op, p, a.dtype(), x, y, c),
        _ => Err(Error::BadInput { op, message: format!("operands {} and {}", a.dtype(), b.dtype()) }),
    }
}

/// [`sgemm`] on bf16 or f16 operands (`dtype`; their bits) with f32 accumulation and an f32
/// result: `cublasGemmEx` / `cublasGemmStridedBatchedEx` with `CUBLAS_COMPUTE_32F`.
fn gemm_ex(
    ctx: &CudaContext,
    op: &'static str,
    p: Product,
    dtype: DType,
    a: &DeviceBuf<u8>,
    b: &DeviceBuf<u8>,
    c: &mut DeviceBuf<f32>,
) -> Result<(), Error> {
    use cudarc::cublas::{result, sys};
    use std::ffi::c_void;
    debug_assert!(p.m > 0 && p.n > 0 && p.k > 0 && p.batch > 0);
    let ty = if dtype == DType::BF16 { sys::cudaDataType::CUDA_R_16BF } else { sys::cudaDataType::CUDA_R_16F };
    let f32_ty = sys::cudaDataType::CUDA_R_32F;
    let transa = if p.trans_b { CUBLAS_OP_T } else { CUBLAS_OP_N };
    let transb = if p.trans_a { CUBLAS_OP_T } else { CUBLAS_OP_N };
    let (m, n, k) = (int(op, p.n)?, int(op, p.m)?, int(op, p.k)?);
    let lda = int(op, if p.trans_b { p.k } else { p.n })?;
    let ldb = int(op, if p.trans_a { p.m } else { p.k })?;
    let ldc = int(op, p.n)?;
    let (alpha, beta) = (p.alpha, p.beta);
    let stream = ctx.stream();
    let (bp, _rb) = b.s.device_ptr(stream);
    let (ap, _ra) = a.s.device_ptr(stream);
    let (cp, _rc) = c.s.device_ptr_mut(stream);
    let handle = *ctx.blas().handle();
    let compute = sys::cublasComputeType_t::CUBLAS_COMPUTE_32F;
    let algo = sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT;
    let (alpha, beta) = (&alpha as *const f32 as *const c_void, &beta as *const f32 as *const c_void);
    // SAFETY: as in `sgemm`: the dims and leading dimensions describe matrices inside the
    // buffers (2 bytes per element of A and B, 4 of C), C is a buffer the op allocated, and the
    // scalars outlive the call.
    let r = unsafe {
        if p.batch == 1 {
            result::gemm_ex(
                handle,
                transa,
                transb,
                m,
                n,
                k,
                alpha,
                bp as *const c_void,
                ty,
                lda,
                ap as *const c_void,
                ty,
                ldb,
                beta,
                cp as *mut c_void,
                f32_ty,
                ldc,
                compute,
                algo,
            )
        } else {
            result::gemm_strided_batched_ex(
                handle,
                transa,
                transb,
                m,
                n,
                k,
                alpha,
                bp as *const c_void,
                ty,
                lda,
                p.stride_b as i64,
                ap as *const c_void,
                ty,
                ldb,
                p.stride_a as i64,
                beta,
                cp as *mut c_void,
                f32_ty,
                ldc,
                p.stride_c as i64,
                int(op, p.batch)?,
                compute,
                algo,
            )
        }
    };
    r.map_err(|e| cuda_err(op, e))
}

/// Numpy matmul: 1-D operands are promoted (and the added dim dropped), batch dims broadcast.
pub(crate) fn matmul(
    ctx: &CudaContext,
    a: &CudaTensor,
    b: &CudaTensor,
    out_shape: &[usize],
) -> Result<CudaTensor, Error> {
    let op = "matmul";
    let a2: Vec<usize> = if a.shape().len() == 1 { vec![1, a.shape()[0]] } else { a.shape().to_vec() };
    let b2: Vec<usize> = if b.shape().len() == 1 { vec![b.shape()[0], 1] } else { b.shape().to_vec() };
    let (m, k) = (a2[a2.len() - 2], a2[a2.len() - 1]);
    let n = b2[b2.len() - 1];
    let (ab, bb) = (&a2[..a2.len() - 2], &b2[..b2.len() - 2]);
    let batch = ir::broadcast_shapes(ab, bb).map_err(|message| Error::BadInput { op, message })?;
    let nb: usize = batch.iter().product();
    let half = a.dtype().is_half();
    if nb * m * n == 0 || k == 0 {
        return CudaTensor::zeros(ctx, &TensorMeta::new(a.dtype(), out_shape.to_vec()));
    }
    let mut out = ctx.alloc::<f32>(op, nb * m * n)?;
    let (a_n, b_n): (usize, usize) = (ab.iter().product(), bb.iter().product());
    let base = Product {
        m,
        n,
        k,
        trans_a: false,
        trans_b: false,
        batch: 1,
        stride_a: 0,
        stride_b: 0,
        stride_c: 0,
        alpha: 1.0,
        beta: 0.0,
    };
    if b_n == 1 && a_n == nb {
        // [batch.., m, k] @ [k, n]: one product with the batch folded into the rows.
        let p = Product { m: nb * m, ..base };
        product(ctx, op, p, a, b, &mut out)?;
    } else {
        // Each operand either walks the whole batch or is shared by it; partial broadcasts are
        // materialised first.
        let full = |t: &CudaTensor, dims: &[usize], rows: usize, cols: usize| -> Result<Option<CudaTensor>, Error> {
            let count: usize = dims.iter().product();
            if count == nb || count == 1 {
                return Ok(None);
            }
            let mut shape = batch.clone();
            shape.extend([rows, cols]);
            let mut src = dims.to_vec();
            src.extend([rows, cols]);
            Ok(Some(expand(ctx, op, &t.with_shape(&src), &shape)?))
        };
        if half && [(a_n, ab), (b_n, bb)].iter().any(|(count, _)| *count != nb && *count != 1) {
            // A partial broadcast of 16-bit operands: materialised in f32 (the copy kernels are
            // f32), multiplied there, rounded once.
            let (wa, wb) = (super::elementwise::widen(ctx, a)?, super::elementwise::widen(ctx, b)?);
            let y = matmul(ctx, &wa, &wb, out_shape)?;
            return super::elementwise::narrow(ctx, &y, a.dtype());
        }
        let (ea, eb) = (full(a, ab, m, k)?, full(b, bb, k, n)?);
        let (ta, tb) = (ea.as_ref().unwrap_or(a), eb.as_ref().unwrap_or(b));
        let (a_shared, b_shared) = (ea.is_none() && a_n == 1, eb.is_none() && b_n == 1);
        let p = Product {
            batch: nb,
            stride_a: if a_shared { 0 } else { m * k },
            stride_b: if b_shared { 0 } else { k * n },
            stride_c: m * n,
            ..base
        };
        product(ctx, op, p, ta, tb, &mut out)?;
    }
    let y = CudaTensor::from_f32(out_shape, out);
    if half { super::elementwise::narrow(ctx, &y, a.dtype()) } else { Ok(y) }
}

/// ONNX Gemm: `alpha * op(A) @ op(B) + beta * C`, C broadcast to `[m, n]`.
pub(crate) fn gemm_op(
    ctx: &CudaContext,
    inputs: &[&CudaTensor],
    alpha: f32,
    beta: f32,
    trans_a: bool,
    trans_b: bool,
    out_shape: &[usize],
) -> Result<CudaTensor, Error> {
    let op = "gemm";
    let (a, b) = (inputs[0], inputs[1]);
    let half = a.dtype().is_half();
    let (m, n) = (out_shape[0], out_shape[1]);
    let k = if trans_a { inputs[0].shape()[0] } else { inputs[0].shape()[1] };
    let (mut out, beta): (DeviceBuf<f32>, f32) = match inputs.get(2) {
        // A 16-bit bias is accumulated into in f32.
        Some(c) if beta != 0.0 => (broadcast_f32_buf(ctx, op, &super::elementwise::widen(ctx, c)?, out_shape)?, beta),
        _ => (ctx.zeros::<f32>(op, m * n)?, 0.0),
    };
    let done = |y: CudaTensor| if half { super::elementwise::narrow(ctx, &y, a.dtype()) } else { Ok(y) };
    if m * n > 0 {
        if k == 0 {
            // No product: C scaled by beta (or the zeros already there).
            if beta != 0.0 {
                let c = CudaTensor::from_f32(out_shape, out);
                let s = CudaTensor::upload(ctx, &ir::Tensor::scalar_f32(beta))?;
                return done(super::elementwise::binary(ctx, ir::BinaryOp::Mul, &c, &s, out_shape)?);
            }
        } else {
            let p = Product { m, n, k, trans_a, trans_b, batch: 1, stride_a: 0, stride_b: 0, stride_c: 0, alpha, beta };
            product(ctx, op, p, a, b, &mut out)?;
        }
    }
    done(CudaTensor::from_f32(out_shape, out))
}
