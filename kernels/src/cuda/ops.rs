//! [`eval`]: one IR op on device tensors, dispatched to the op families.

use super::device::CudaContext;
use super::tensor::CudaTensor;
use super::{activation, conv, elementwise, index, linalg, norm, optim, reduce, resize, shape};
use crate::Error;
use ir::{Op, ReduceOp, TensorMeta};

/// Evaluates `op` on device `inputs` with ONNX semantics: the contract of
/// [`crate::cpu::eval`] on the GPU.
///
/// Returns one tensor per output of the op, with exactly the metas [`Op::infer`] gives for the
/// inputs' metas. `Input`, `Param` and `State` have no kernel (the runtime feeds them) and are
/// [`Error::Unsupported`]; `Constant` uploads its tensor. Inconsistent inputs are
/// [`Error::BadInput`], as are the data-dependent failures the CPU detects (out-of-range gather
/// indices, integer division by zero, an AdamW step below 1), which read values back to the host.
/// Work is queued on the context's stream; download a result (or
/// [`CudaContext::synchronize`]) to wait for it.
pub fn eval(ctx: &CudaContext, op: &Op, inputs: &[&CudaTensor]) -> Result<Vec<CudaTensor>, Error> {
    let name = op.name();
    if let Op::Input { .. } | Op::Param { .. } | Op::State { .. } = op {
        return Err(Error::Unsupported {
            op: name,
            reason: "inputs and params are fed by the runtime, not computed".into(),
        });
    }
    // `PoolAttrs::out_hw` (used by inference) assumes windows of at least one cell.
    let zero_kernel =
        |w: Option<&&CudaTensor>| w.is_some_and(|w| w.shape().len() == 4 && (w.shape()[2] == 0 || w.shape()[3] == 0));
    let empty_window = match op {
        Op::MaxPool(a) | Op::AveragePool(a) => a.kernel.contains(&0),
        Op::Conv(_) | Op::ConvInputGrad { .. } => zero_kernel(inputs.get(1)),
        Op::ConvWeightGrad { shape, .. } => shape.len() == 4 && (shape[2] == 0 || shape[3] == 0),
        Op::MaxPoolGrad(a) | Op::AveragePoolGrad { attrs: a, .. } => a.kernel.contains(&0),
        _ => false,
    };
    if empty_window {
        return Err(Error::BadInput { op: name, message: "kernel window has a zero-sized dim".into() });
    }
    let metas: Vec<TensorMeta> = inputs.iter().map(|t| t.meta().clone()).collect();
    let outs = op.infer(&metas).map_err(|message| Error::BadInput { op: name, message })?;
    // Matrix products of one 16-bit type run as such (cublasGemmEx, f32 accumulation); other
    // ops on 16-bit floats compute in f32, as on the CPU: inputs widened (exactly), each result
    // rounded once to its type.
    let products = matches!(op, Op::MatMul | Op::Gemm { .. }) && metas.iter().all(|m| m.dtype == metas[0].dtype);
    if !matches!(op, Op::Cast { .. }) && !products && metas.iter().any(|m| m.dtype.is_half()) {
        let wide: Vec<CudaTensor> = inputs.iter().map(|t| elementwise::widen(ctx, t)).collect::<Result<_, _>>()?;
        let refs: Vec<&CudaTensor> = wide.iter().collect();
        return eval(ctx, op, &refs)?
            .into_iter()
            .zip(&outs)
            .map(|(t, m)| if m.dtype.is_half() { elementwise::narrow(ctx, &t, m.dtype) } else { Ok(t) })
            .collect();
    }
    let out0 = || outs[0].shape.as_slice();
    let result = match op {
        Op::Input { .. } | Op::Param { .. } | Op::State { .. } => unreachable!("handled above"),
        Op::Constant(t) => vec![CudaTensor::upload(ctx, t)?],
        Op::Identity => vec![inputs[0].clone()],
        Op::Unary(u) => vec![elementwise::unary(ctx, *u, inputs[0])?],
        Op::Binary(b) => vec![elementwise::binary(ctx, *b, inputs[0], inputs[1], out0())?],
        Op::Where => vec![elementwise::where_(ctx, inputs[0], inputs[1], inputs[2], out0())?],
        Op::Cast { to } => vec![elementwise::cast(ctx, inputs[0], *to)?],
        Op::MatMul => vec![linalg::matmul(ctx, inputs[0], inputs[1], out0())?],
        Op::Gemm { alpha, beta, trans_a, trans_b } => {
            vec![linalg::gemm_op(ctx, inputs, *alpha, *beta, *trans_a, *trans_b, out0())?]
        }
        Op::Conv(a) => vec![conv::conv(ctx, a, inputs, out0())?],
        Op::MaxPool(a) => vec![conv::pool(ctx, a, inputs[0], out0(), true)?],
        Op::AveragePool(a) => vec![conv::pool(ctx, a, inputs[0], out0(), false)?],
        Op::GlobalAveragePool | Op::GlobalMaxPool => {
            let kind = if matches!(op, Op::GlobalMaxPool) { ReduceOp::Max } else { ReduceOp::Mean };
            let axes: Vec<usize> = (2..inputs[0].shape().len()).collect();
            vec![reduce::reduce(ctx, kind, inputs[0], &axes, true)?]
        }
        Op::BatchNorm { epsilon } => vec![norm::batch_norm(ctx, inputs, *epsilon)?],
        Op::LayerNorm { axis, epsilon } => vec![norm::layer_norm(ctx, inputs, *axis, *epsilon)?],
        Op::Lrn { size, alpha, beta, bias } => vec![norm::lrn(ctx, inputs[0], None, *size, *alpha, *beta, *bias)?],
        Op::Softmax { axis } => vec![norm::softmax(ctx, inputs[0], *axis, false)?],
        Op::LogSoftmax { axis } => vec![norm::softmax(ctx, inputs[0], *axis, true)?],
        Op::Reshape { shape } => vec![inputs[0].with_shape(shape)],
        Op::Transpose { perm } => vec![shape::transpose(ctx, inputs[0], perm)?],
        Op::Expand { shape } => vec![shape::expand(ctx, "expand", inputs[0], shape)?],
        Op::Concat { axis } => vec![shape::concat(ctx, inputs, *axis, out0())?],
        Op::Split { axis, sizes } => shape::split(ctx, inputs[0], *axis, sizes)?,
        Op::Slice { axes } => vec![shape::slice(ctx, inputs[0], axes, out0())?],
        Op::Gather { axis } => vec![shape::gather(ctx, inputs[0], inputs[1], *axis, out0())?],
        Op::Reduce { op: r, axes, keepdims } => vec![reduce::reduce(ctx, *r, inputs[0], axes, *keepdims)?],
        Op::Pad { pads, value } => vec![shape::pad(ctx, inputs[0], pads, *value, out0())?],
        Op::UnaryGrad(u) => vec![optim::unary_grad(ctx, *u, inputs[0], inputs[1])?],
        Op::SoftmaxGrad { axis, log } => vec![norm::softmax_grad(ctx, inputs[0], inputs[1], *axis, *log)?],
        Op::LayerNormGrad { axis, epsilon } => norm::layer_norm_grad(ctx, inputs, *axis, *epsilon)?,
        Op::LrnGrad { size, alpha, beta, bias } => {
            vec![norm::lrn(ctx, inputs[0], Some(inputs[1]), *size, *alpha, *beta, *bias)?]
        }
        Op::ConvInputGrad { attrs, shape } => vec![conv::conv_input_grad(ctx, attrs, inputs[0], inputs[1], shape)?],
        Op::ConvWeightGrad { attrs, shape } => {
            vec![conv::conv_weight_grad(ctx, attrs, inputs[0], inputs[1], shape)?]
        }
        Op::MaxPoolGrad(a) => vec![conv::max_pool_grad(ctx, a, inputs[0], inputs[1])?],
        Op::AveragePoolGrad { attrs, shape } => vec![conv::avg_pool_grad(ctx, attrs, inputs[0], shape)?],
        Op::GatherGrad { axis, shape } => vec![shape::gather_grad(ctx, inputs[0], inputs[1], *axis, shape)?],
        Op::SliceGrad { axes, shape } => vec![shape::slice_grad(ctx, inputs[0], axes, shape)?],
        Op::SgdUpdate { lr, momentum, weight_decay } => optim::sgd_update(ctx, inputs, *lr, *momentum, *weight_decay)?,
        Op::AdamWUpdate { lr, beta1, beta2, epsilon, weight_decay } => {
            optim::adamw_update(ctx, inputs, *lr, *beta1, *beta2, *epsilon, *weight_decay)?
        }
        Op::Resize(a) => vec![resize::resize(ctx, a, inputs[0], out0())?],
        Op::ResizeGrad { attrs, shape } => vec![resize::resize_grad(ctx, attrs, inputs[0], shape)?],
        Op::BatchNormTrain { epsilon } => vec![norm::batch_norm_train(ctx, inputs, *epsilon)?],
        Op::BatchNormTrainGrad { epsilon } => norm::batch_norm_train_grad(ctx, inputs, *epsilon)?,
        Op::Hardmax { axis } => vec![activation::hardmax(ctx, inputs[0], *axis)?],
        Op::Index(x) => index::eval(ctx, x, inputs, &outs)?,
        // Without a step to draw for, dropout is inference: nothing dropped.
        Op::Dropout(a) => super::random::dropout(ctx, a, inputs[0], None)?,
        // No device kernel yet: a plan with fused attention runs on CPU ranks.
        Op::Attention(_) | Op::AttentionGrad(_) => {
            return Err(Error::Unsupported {
                op: name,
                reason: "fused attention has no CUDA kernel yet; run this plan on CPU ranks, or import the model \
                         with attention as separate ops (MatMul, Softmax, MatMul)"
                    .into(),
            });
        }
        // No device kernel yet: a plan with routed experts runs on CPU ranks.
        Op::Moe(_) | Op::MoeGrad(_) => {
            return Err(Error::Unsupported {
                op: name,
                reason: "routed experts (moe) have no CUDA kernel yet; run this plan on CPU ranks (--backend threads \
                         or mpi)"
                    .into(),
            });
        }
    };
    debug_assert_eq!(result.iter().map(|t| t.meta().clone()).collect::<Vec<_>>(), outs, "{name}: kernel output metas");
    Ok(result)
}
