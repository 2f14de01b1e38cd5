//! Data movement: `Reshape`, `Transpose`, `Expand`, `Concat`, `Split`, `Slice`, `Gather`, `Pad`,
//! and the gradients `SliceGrad` and `GatherGrad`.
//!
//! [`crate::Op::infer`] dispatches the family's ops here. Its other stages: gradients in
//! `autodiff/shape.rs`, import in `tracer/src/import/shape.rs`, sharding rules in
//! `sharding/src/strategy/shape.rs`, kernels in `kernels/src/{cpu,cuda}/shape.rs`.

use crate::op::{InferError, Op, broadcast, want_dtype, want_float, want_inputs};
use crate::tensor::{DType, TensorMeta};
/// Shape inference of the shape family's forward ops.
pub(crate) fn infer(op: &Op, ins: &[TensorMeta]) -> Result<Vec<TensorMeta>, InferError> {
    use Op::*;
    let n = op.name();
    let one = |m: TensorMeta| Ok(vec![m]);
    match op {
        Reshape { shape } => {
            want_inputs(n, ins, 1, 1)?;
            if crate::shape::checked_numel(shape) != ins[0].checked_numel() {
                return Err(format!(
                    "{n}: cannot reshape {:?} ({} elements) to {shape:?}",
                    ins[0].shape,
                    ins[0].numel()
                ));
            }
            one(TensorMeta { shape: shape.clone(), dtype: ins[0].dtype })
        }
        Transpose { perm } => {
            want_inputs(n, ins, 1, 1)?;
            let x = &ins[0].shape;
            let mut seen = vec![false; x.len()];
            if perm.len() != x.len() || perm.iter().any(|&p| p >= x.len() || std::mem::replace(&mut seen[p], true)) {
                return Err(format!("{n}: {perm:?} is not a permutation of the {} dims of {x:?}", x.len()));
            }
            one(TensorMeta { shape: perm.iter().map(|&p| x[p]).collect(), dtype: ins[0].dtype })
        }
        Expand { shape } => {
            want_inputs(n, ins, 1, 1)?;
            let s = broadcast(&ins[0].shape, shape).map_err(|e| format!("{n}: {e}"))?;
            if &s != shape {
                return Err(format!("{n}: {:?} expanded by {shape:?} gives {s:?}", ins[0].shape));
            }
            one(TensorMeta { shape: s, dtype: ins[0].dtype })
        }
        Concat { axis } => {
            if ins.is_empty() {
                return Err(format!("{n} needs at least one input"));
            }
            let f = &ins[0];
            if *axis >= f.rank() {
                return Err(format!("{n}: axis {axis} out of range for {:?}", f.shape));
            }
            let mut s = f.shape.clone();
            s[*axis] = 0;
            for m in ins {
                let same = m.rank() == f.rank() && (0..f.rank()).all(|d| d == *axis || m.shape[d] == f.shape[d]);
                if !same || m.dtype != f.dtype {
                    return Err(format!("{n}: input {} does not match {} along dims other than {axis}", m, f));
                }
                s[*axis] = s[*axis]
                    .checked_add(m.shape[*axis])
                    .ok_or_else(|| format!("{n}: the concatenated dim {axis} overflows"))?;
            }
            one(TensorMeta { shape: s, dtype: f.dtype })
        }
        Split { axis, sizes } => {
            want_inputs(n, ins, 1, 1)?;
            let x = &ins[0];
            let total = sizes.iter().try_fold(0usize, |a, &b| a.checked_add(b));
            if *axis >= x.rank() || total != Some(x.shape[*axis]) {
                return Err(format!("{n}: sizes {sizes:?} on axis {axis} do not split {:?}", x.shape));
            }
            Ok(sizes
                .iter()
                .map(|&sz| {
                    let mut s = x.shape.clone();
                    s[*axis] = sz;
                    TensorMeta { shape: s, dtype: x.dtype }
                })
                .collect())
        }
        Slice { axes } => {
            want_inputs(n, ins, 1, 1)?;
            let x = &ins[0];
            let mut s = x.shape.clone();
            for a in axes {
                if a.axis >= x.rank() || a.step == 0 {
                    return Err(format!("{n}: bad axis {} or step {} for {:?}", a.axis, a.step, x.shape));
                }
                // In i128: a hostile length or step must not wrap the bounds check.
                let d = x.shape[a.axis] as i128;
                let last = a.start as i128 + (a.len as i128 - 1) * a.step as i128;
                if a.len > 0 && (a.start < 0 || a.start as i128 >= d || last < 0 || last >= d) {
                    return Err(format!("{n}: slice {a:?} out of bounds for dim of size {d}"));
                }
                s[a.axis] = a.len;
            }
            one(TensorMeta { shape: s, dtype: x.dtype })
        }
        Gather { axis } => {
            want_inputs(n, ins, 2, 2)?;
            want_dtype(n, &ins[1], DType::I64, "indices")?;
            let x = &ins[0].shape;
            if *axis >= x.len() {
                return Err(format!("{n}: axis {axis} out of range for {x:?}"));
            }
            let mut s = x[..*axis].to_vec();
            s.extend_from_slice(&ins[1].shape);
            s.extend_from_slice(&x[*axis + 1..]);
            one(TensorMeta { shape: s, dtype: ins[0].dtype })
        }
        Pad { pads, .. } => {
            want_inputs(n, ins, 1, 1)?;
            let x = &ins[0];
            if pads.len() != 2 * x.rank() {
                return Err(format!("{n}: {} pads for rank {}", pads.len(), x.rank()));
            }
            let s = (0..x.rank())
                .map(|d| x.shape[d].checked_add(pads[d])?.checked_add(pads[d + x.rank()]))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| format!("{n}: padding {pads:?} of {:?} overflows a dim", x.shape))?;
            one(TensorMeta { shape: s, dtype: x.dtype })
        }
        _ => Err(format!("{n} is not a shape op (dispatch bug)")),
    }
}

/// Shape inference of the shape family's gradient and update ops.
pub(crate) fn infer_grad(op: &Op, ins: &[TensorMeta]) -> Result<Vec<TensorMeta>, InferError> {
    use Op::*;
    let n = op.name();
    // The forward op's output shape for a forward input of `shape`, checked against dy.
    let want_dy = |fwd: Op, fwd_ins: Vec<TensorMeta>, dy: &TensorMeta| -> Result<(), InferError> {
        let y = fwd.infer(&fwd_ins).map_err(|e| format!("{n}: forward: {e}"))?;
        if y[0].shape != dy.shape {
            return Err(format!("{n}: dy is {:?} but the forward output is {:?}", dy.shape, y[0].shape));
        }
        Ok(())
    };
    // Gradients take the float type of their float inputs.
    let dt = ins.iter().map(|m| m.dtype).find(|d| d.is_float()).unwrap_or(DType::F32);
    let f = |s: &[usize]| TensorMeta::new(dt, s.to_vec());
    match op {
        GatherGrad { axis, shape } => {
            want_inputs(n, ins, 2, 2)?;
            want_float(n, &ins[1])?;
            want_dy(Op::Gather { axis: *axis }, vec![f(shape), ins[0].clone()], &ins[1])?;
            Ok(vec![f(shape)])
        }
        SliceGrad { axes, shape } => {
            want_inputs(n, ins, 1, 1)?;
            want_dy(Op::Slice { axes: axes.clone() }, vec![TensorMeta::new(ins[0].dtype, shape.clone())], &ins[0])?;
            Ok(vec![TensorMeta::new(ins[0].dtype, shape.clone())])
        }
        _ => Err(format!("{n} is not a shape gradient op (dispatch bug)")),
    }
}
