//! Normalisations with batch statistics: [`Op::BatchNormTrain`] and its gradient
//! [`Op::BatchNormTrainGrad`].
//!
//! Training-mode batch norm normalises every channel (dim 1) with the mean and the population
//! variance of the batch: over dim 0 and every spatial dim. Its running statistics are *state*,
//! not parameters: the normalised output does not read them (the importer computes ONNX's
//! optional running-statistics outputs from the batch when a graph reads them, see
//! `tracer`), so training gives them no gradient and no optimizer update.
//!
//! [`Op::BatchNormTrain`]: crate::Op::BatchNormTrain
//! [`Op::BatchNormTrainGrad`]: crate::Op::BatchNormTrainGrad

use crate::op::{InferError, Op, broadcast, float_of, want_float, want_inputs};
use crate::tensor::{DType, TensorMeta};

/// Checks X `[N, C, ...]` and the per-channel inputs `[C]` from index 1 on; returns C.
fn channels(n: &str, ins: &[TensorMeta], per_channel: &[usize]) -> Result<usize, InferError> {
    let x = &ins[0].shape;
    if x.len() < 2 {
        return Err(format!("{n}: input must have a channel dim, got {x:?}"));
    }
    for &i in per_channel {
        if ins[i].shape != [x[1]] {
            return Err(format!("{n}: input {i} shape {:?} must be [{}]", ins[i].shape, x[1]));
        }
    }
    Ok(x[1])
}

/// [`crate::Op::BatchNormTrain`]: inputs X `[N, C, ...]`, scale `[C]`, bias `[C]`; output like X.
pub(crate) fn infer_batch_norm_train(n: &str, ins: &[TensorMeta]) -> Result<Vec<TensorMeta>, InferError> {
    want_inputs(n, ins, 3, 3)?;
    float_of(n, ins)?;
    channels(n, ins, &[1, 2])?;
    Ok(vec![ins[0].clone()])
}

/// [`crate::Op::BatchNormTrainGrad`]: inputs x, scale `[C]`, dy (x's shape); outputs dx (x's
/// shape), dscale and dbias (`[C]`).
pub(crate) fn infer_batch_norm_train_grad(n: &str, ins: &[TensorMeta]) -> Result<Vec<TensorMeta>, InferError> {
    want_inputs(n, ins, 3, 3)?;
    float_of(n, ins)?;
    channels(n, ins, &[1])?;
    if ins[2].shape != ins[0].shape {
        return Err(format!("{n}: x and dy shapes differ: {:?} vs {:?}", ins[0].shape, ins[2].shape));
    }
    Ok(vec![ins[0].clone(), ins[1].clone(), ins[1].clone()])
}

/// Shape inference of the norm family's forward ops.
pub(crate) fn infer(op: &Op, ins: &[TensorMeta]) -> Result<Vec<TensorMeta>, InferError> {
    use crate::op::Op::*;
    let n = op.name();
    let one = |m: TensorMeta| Ok(vec![m]);
    match op {
        BatchNorm { .. } => {
            want_inputs(n, ins, 5, 5)?;
            let x = &ins[0].shape;
            if x.len() < 2 {
                return Err(format!("{n}: input must have a channel dim, got {x:?}"));
            }
            float_of(n, ins)?;
            for (i, m) in ins.iter().enumerate() {
                if i > 0 && m.shape != [x[1]] {
                    return Err(format!("{n}: input {i} shape {:?} must be [{}]", m.shape, x[1]));
                }
            }
            one(ins[0].clone())
        }
        LayerNorm { axis, .. } => {
            want_inputs(n, ins, 2, 3)?;
            let x = &ins[0].shape;
            if *axis >= x.len() {
                return Err(format!("{n}: axis {axis} out of range for {x:?}"));
            }
            float_of(n, ins)?;
            for (i, m) in ins.iter().enumerate() {
                if i > 0 && broadcast(&x[*axis..], &m.shape).ok().as_deref() != Some(&x[*axis..]) {
                    return Err(format!("{n}: input {i} shape {:?} does not broadcast to {:?}", m.shape, &x[*axis..]));
                }
            }
            one(ins[0].clone())
        }
        Lrn { size, .. } => {
            want_inputs(n, ins, 1, 1)?;
            want_float(n, &ins[0])?;
            if *size == 0 || ins[0].rank() < 2 {
                return Err(format!("{n}: needs size >= 1 and a channel dim"));
            }
            one(ins[0].clone())
        }
        Softmax { axis } | LogSoftmax { axis } | Hardmax { axis } => {
            want_inputs(n, ins, 1, 1)?;
            want_float(n, &ins[0])?;
            if *axis >= ins[0].rank() {
                return Err(format!("{n}: axis {axis} out of range for {:?}", ins[0].shape));
            }
            one(ins[0].clone())
        }
        _ => Err(format!("{n} is not a norm op (dispatch bug)")),
    }
}

/// Shape inference of the norm family's gradient and update ops.
pub(crate) fn infer_grad(op: &Op, ins: &[TensorMeta]) -> Result<Vec<TensorMeta>, InferError> {
    use crate::op::Op::*;
    let n = op.name();
    let f32s = |ins: &[TensorMeta]| float_of(n, ins).map(|_| ());
    let same = |a: &TensorMeta, b: &TensorMeta, what: &str| {
        if a.shape != b.shape {
            return Err(format!("{n}: {what} shapes differ: {:?} vs {:?}", a.shape, b.shape));
        }
        Ok(())
    };
    // Gradients take the float type of their float inputs.
    let dt = ins.iter().map(|m| m.dtype).find(|d| d.is_float()).unwrap_or(DType::F32);
    let f = |s: &[usize]| TensorMeta::new(dt, s.to_vec());
    match op {
        SoftmaxGrad { axis, .. } => {
            want_inputs(n, ins, 2, 2)?;
            f32s(ins)?;
            same(&ins[0], &ins[1], "y and dy")?;
            if *axis >= ins[0].rank() {
                return Err(format!("{n}: axis {axis} out of range for {:?}", ins[0].shape));
            }
            Ok(vec![ins[0].clone()])
        }
        LayerNormGrad { axis, epsilon } => {
            want_inputs(n, ins, 3, 3)?;
            f32s(ins)?;
            Op::LayerNorm { axis: *axis, epsilon: *epsilon }.infer(&ins[..2])?;
            same(&ins[0], &ins[2], "x and dy")?;
            let norm = f(&ins[0].shape[*axis..]);
            Ok(vec![ins[0].clone(), norm.clone(), norm])
        }
        LrnGrad { size, alpha, beta, bias } => {
            want_inputs(n, ins, 2, 2)?;
            Op::Lrn { size: *size, alpha: *alpha, beta: *beta, bias: *bias }.infer(&ins[..1])?;
            f32s(ins)?;
            same(&ins[0], &ins[1], "x and dy")?;
            Ok(vec![ins[0].clone()])
        }
        _ => Err(format!("{n} is not a norm gradient op (dispatch bug)")),
    }
}
