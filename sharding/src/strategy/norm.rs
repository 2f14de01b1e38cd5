//! Rules of the normalisations with batch statistics (training-mode batch norm).
//!
//! Training-mode batch norm reduces every dim but the channel: only the channel (dim 1) splits
//! locally. Splitting the batch or a spatial dim would need the per-channel sums of every rank
//! (synchronised batch norm: an all-reduce of the mean and variance in the forward and of
//! `sum(dy)`, `sum(dy * xhat)` in the backward), which no strategy does yet, so those dims are
//! left whole and the solver reshards around the op: a batch-split plan gathers the batch here
//! and the result equals single-device training.

use super::{InMap, LogicalDim, ldim};
use ir::TensorMeta;

/// [`ir::Op::BatchNormTrain`] (x, scale, bias -> y) and [`ir::Op::BatchNormTrainGrad`]
/// (x, scale, dy -> dx, dscale, dbias): the channel dim, in every input and output.
pub(super) fn batch_norm_train_dims(ins: &[TensorMeta], outs: &[TensorMeta]) -> Vec<LogicalDim> {
    let c = ins[0].shape[1];
    if c <= 1 {
        return vec![];
    }
    let mut l = ldim("channel", c, ins.len(), outs.len());
    // x (and dy) carry the channel as dim 1; the per-channel vectors as dim 0.
    l.ins = ins.iter().map(|m| InMap::Dim(if m.rank() == 1 { 0 } else { 1 })).collect();
    l.outs = outs.iter().map(|m| Some(if m.rank() == 1 { 0 } else { 1 })).collect();
    vec![l]
}
