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

use crate::op::{InferError, float_of, want_inputs};
use crate::tensor::TensorMeta;

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
