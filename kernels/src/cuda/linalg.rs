//! Matrix products through cuBLAS: `MatMul` (numpy batching, strided-batched SGEMM) and `Gemm`.
//!
//! cuBLAS is column-major; a row-major `r x c` buffer is the column-major `c x r` matrix, its
//! transpose. So the row-major product `C = op(A) @ op(B)` is computed as the column-major
//! `C^T = op(B)^T @ op(A)^T`: B goes first, the dims become `(n, m, k)`, and each operand's
//! transpose flag is the row-major one.

use super::device::{CudaContext, DeviceBuf, cuda_err};
use super::shape::{broadcast_f32_buf, expand};
use super::tensor::CudaTensor;
use crate::Error;
use cudarc::cublas::sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
use cudarc::cublas::{Gemm, GemmConfig, StridedBatchedConfig};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use ir::TensorMeta;

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
    if nb * m * n == 0 || k == 0 {
        return CudaTensor::zeros(ctx, &TensorMeta::new(ir::DType::F32, out_shape.to_vec()));
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
        sgemm(ctx, op, p, &a.f32s(op)?.s, &b.f32s(op)?.s, &mut out.s)?;
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
        sgemm(ctx, op, p, &ta.f32s(op)?.s, &tb.f32s(op)?.s, &mut out.s)?;
    }
    Ok(CudaTensor::from_f32(out_shape, out))
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
    let (a, b) = (inputs[0].f32s(op)?, inputs[1].f32s(op)?);
    let (m, n) = (out_shape[0], out_shape[1]);
    let k = if trans_a { inputs[0].shape()[0] } else { inputs[0].shape()[1] };
    let (mut out, beta): (DeviceBuf<f32>, f32) = match inputs.get(2) {
        Some(c) if beta != 0.0 => (broadcast_f32_buf(ctx, op, c, out_shape)?, beta),
        _ => (ctx.zeros::<f32>(op, m * n)?, 0.0),
    };
    if m * n > 0 {
        if k == 0 {
            // No product: C scaled by beta (or the zeros already there).
            if beta != 0.0 {
                let c = CudaTensor::from_f32(out_shape, out);
                let s = CudaTensor::upload(ctx, &ir::Tensor::scalar_f32(beta))?;
                return super::elementwise::binary(ctx, ir::BinaryOp::Mul, &c, &s, out_shape);
            }
        } else {
            let p = Product { m, n, k, trans_a, trans_b, batch: 1, stride_a: 0, stride_b: 0, stride_c: 0, alpha, beta };
            sgemm(ctx, op, p, &a.s, &b.s, &mut out.s)?;
        }
    }
    Ok(CudaTensor::from_f32(out_shape, out))
}
