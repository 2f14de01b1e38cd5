//! Rules of the normalisations (batch, layer and local response norm, softmax) and of
//! training-mode batch norm.
//!
//! Training-mode batch norm reduces every dim but the channel: only the channel (dim 1) splits
//! locally. Splitting the batch or a spatial dim would need the per-channel sums of every rank
//! (synchronised batch norm: an all-reduce of the mean and variance in the forward and of
//! `sum(dy)`, `sum(dy * xhat)` in the backward), which no strategy does yet, so those dims are
//! left whole and the solver reshards around the op: a batch-split plan gathers the batch here
//! and the result equals single-device training.

use super::*;

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

/// The sharding rule of a norm op (see [`super::rule`]).
pub(super) fn rule(op: &Op, ins: &[TensorMeta], outs: &[TensorMeta]) -> Option<Rule> {
    use Op::*;
    let ni = ins.len();
    let r = |dims: Vec<LogicalDim>, linear: Vec<Vec<usize>>| Some(Rule { dims, linear });
    match op {
        Lrn { .. } => r(elementwise(ins, outs, &[1]), vec![]),
        LrnGrad { .. } => r(elementwise(ins, outs, &[1]), vec![vec![1]]),
        BatchNorm { .. } => {
            let mut dims = elementwise(&ins[..1], outs, &[]);
            for l in &mut dims {
                l.ins.resize(ni, InMap::Replicate);
                if l.name == "d1" {
                    for i in 1..ni {
                        l.ins[i] = InMap::Dim(0);
                    }
                }
            }
            r(dims, vec![])
        }
        BatchNormTrain { .. } => r(norm::batch_norm_train_dims(ins, outs), vec![]),
        BatchNormTrainGrad { .. } => r(norm::batch_norm_train_dims(ins, outs), vec![vec![2]]),
        LayerNorm { axis, .. } => {
            let skip: Vec<usize> = (*axis..ins[0].rank()).collect();
            r(elementwise(ins, outs, &skip), vec![])
        }
        LayerNormGrad { axis, .. } => {
            let skip: Vec<usize> = (*axis..ins[0].rank()).collect();
            let mut dims = elementwise(&[ins[0].clone(), ins[2].clone()], &outs[..1], &skip);
            for l in &mut dims {
                l.ins = vec![l.ins[0].clone(), InMap::Replicate, l.ins[1].clone()];
                l.outs = vec![l.outs[0], None, None];
            }
            r(dims, vec![])
        }
        Softmax { axis } | LogSoftmax { axis } => {
            let mut dims = elementwise(ins, outs, &[]);
            for l in &mut dims {
                if l.name == format!("d{axis}") {
                    l.special = Some(SpecialKind::SplitSoftmax);
                    l.name = "vocab".into();
                }
            }
            r(dims, vec![])
        }
        SoftmaxGrad { axis, .. } => r(elementwise(ins, outs, &[*axis]), vec![vec![1]]),
        // Every dim but the axis splits; along the axis the argmax needs the whole row.
        Hardmax { axis } => r(elementwise(ins, outs, &[*axis]), vec![]),
        // `super::rule` sends only the ops above here.
        _ => None,
    }
}
