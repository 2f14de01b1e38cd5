//! Convolution and pooling (2-D in the IR; 1-D and 3-D forms are rewritten at import) and their
//! gradients.
//!
//! [`crate::Op::infer`] dispatches the family's ops here. Its other stages: gradients in
//! `autodiff/conv.rs`, import in `tracer/src/import/conv.rs`, sharding rules in
//! `sharding/src/strategy/conv.rs`, kernels in `kernels/src/{cpu,cuda}/conv.rs`.

use crate::op::{InferError, Op, PoolAttrs, float_of, want_float, want_inputs};
use crate::tensor::{DType, TensorMeta};
/// Shape inference of the conv family's forward ops.
pub(crate) fn infer(op: &Op, ins: &[TensorMeta]) -> Result<Vec<TensorMeta>, InferError> {
    use Op::*;
    let n = op.name();
    let one = |m: TensorMeta| Ok(vec![m]);
    match op {
        Conv(a) => {
            want_inputs(n, ins, 2, 3)?;
            let dt = float_of(n, ins)?;
            let (x, w) = (&ins[0].shape, &ins[1].shape);
            if x.len() != 4 || w.len() != 4 {
                return Err(format!("{n}: only 2-D convolution (4-D X and W) is supported, got X{x:?} W{w:?}"));
            }
            if a.group == 0 || x[1] % a.group != 0 || w[0] % a.group != 0 || x[1] / a.group != w[1] {
                return Err(format!("{n}: channels do not match: X{x:?} W{w:?} group={}", a.group));
            }
            if let Some(b) = ins.get(2)
                && b.shape != [w[0]]
            {
                return Err(format!("{n}: bias shape {:?} must be [{}]", b.shape, w[0]));
            }
            let pa = PoolAttrs {
                kernel: [w[2], w[3]],
                strides: a.strides,
                pads: a.pads,
                dilations: a.dilations,
                ceil_mode: false,
                count_include_pad: false,
            };
            let (oh, ow) = pa
                .out_hw(x[2], x[3])
                .ok_or_else(|| format!("{n}: {} (X{x:?} W{w:?})", pa.why_no_output(x[2], x[3])))?;
            one(TensorMeta::new(dt, vec![x[0], w[0], oh, ow]))
        }
        MaxPool(a) | AveragePool(a) => {
            want_inputs(n, ins, 1, 1)?;
            want_float(n, &ins[0])?;
            let x = &ins[0].shape;
            if x.len() != 4 {
                return Err(format!("{n}: only 2-D pooling (4-D input) is supported, got {x:?}"));
            }
            let (oh, ow) =
                a.out_hw(x[2], x[3]).ok_or_else(|| format!("{n}: {} (input {x:?})", a.why_no_output(x[2], x[3])))?;
            one(TensorMeta::new(ins[0].dtype, vec![x[0], x[1], oh, ow]))
        }
        GlobalAveragePool | GlobalMaxPool => {
            want_inputs(n, ins, 1, 1)?;
            want_float(n, &ins[0])?;
            let x = &ins[0].shape;
            if x.len() < 3 {
                return Err(format!("{n}: input must have spatial dims, got {x:?}"));
            }
            let mut s = x.clone();
            for d in &mut s[2..] {
                *d = 1;
            }
            one(TensorMeta::new(ins[0].dtype, s))
        }
        _ => Err(format!("{n} is not a conv op (dispatch bug)")),
    }
}

/// Shape inference of the conv family's gradient and update ops.
pub(crate) fn infer_grad(op: &Op, ins: &[TensorMeta]) -> Result<Vec<TensorMeta>, InferError> {
    use Op::*;
    let n = op.name();
    let f32s = |ins: &[TensorMeta]| float_of(n, ins).map(|_| ());
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
        ConvInputGrad { attrs, shape } => {
            want_inputs(n, ins, 2, 2)?;
            f32s(ins)?;
            want_dy(Op::Conv(attrs.clone()), vec![f(shape), ins[1].clone()], &ins[0])?;
            Ok(vec![f(shape)])
        }
        ConvWeightGrad { attrs, shape } => {
            want_inputs(n, ins, 2, 2)?;
            f32s(ins)?;
            want_dy(Op::Conv(attrs.clone()), vec![ins[0].clone(), f(shape)], &ins[1])?;
            Ok(vec![f(shape)])
        }
        MaxPoolGrad(a) => {
            want_inputs(n, ins, 2, 2)?;
            f32s(ins)?;
            want_dy(Op::MaxPool(a.clone()), vec![ins[0].clone()], &ins[1])?;
            Ok(vec![ins[0].clone()])
        }
        AveragePoolGrad { attrs, shape } => {
            want_inputs(n, ins, 1, 1)?;
            f32s(ins)?;
            want_dy(Op::AveragePool(attrs.clone()), vec![f(shape)], &ins[0])?;
            Ok(vec![f(shape)])
        }
        _ => Err(format!("{n} is not a conv gradient op (dispatch bug)")),
    }
}
