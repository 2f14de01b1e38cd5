//! Random ops: training-mode [`crate::Op::Dropout`], whose mask comes from a counter-based
//! generator keyed by where an element is, never by who computes it.
//!
//! # The mask
//!
//! `y = x · keep / (1 - ratio)` and the optional second output is `keep` (bool), where for
//! element `e` of training step `s` (0 at a run's first step, counting on across checkpoints)
//! of a run with seed `S`:
//!
//! ```text
//! key(e)   = Philox4x32-10(counter = [q mod 2^32, q div 2^32, s mod 2^32, s div 2^32],
//!                          key     = K(S, id))[E mod 4],         q = E div 4
//! keep(e)  = key(e) >= floor(ratio · 2^32)
//! K(S, id) = splitmix64(splitmix64(S) xor id), as two 32-bit words (low first)
//! ```
//!
//! `id` is the op's [`DropoutAttrs::id`], given at import (distinct per ONNX node). `E` is the
//! element's *global index*: its row-major index in the tensor one device would compute from
//! the step's whole batch. The generator is `kernels::random` (the CPU kernel's and, in
//! NVRTC source, the CUDA kernel's); the runtime supplies `S`, `s` and where each block lies
//! (`kernels::random::Draw`).
//!
//! # Invariant: the mask does not depend on how the step is run
//!
//! - **Sharding**: a rank computing a block at offsets `o` (per dim, from the output's spec and
//!   its mesh coordinate) of the node's global shape `G` gives its local element `c` the index
//!   `E = Σ_d (o_d + c_d) · stride_G(d)`, the one the unsharded op gives it. Any split, any
//!   mesh, any rank count: the same mask.
//! - **Microbatches**: a plan with `M` microbatches is made for one microbatch's graph (the
//!   model's batch `b`); feeds hold the `M` microbatches one after the other along their first
//!   dim. Microbatch `m`'s elements get `E = m · numel(G) + index in G`: for a tensor whose first
//!   dim is the batch, exactly its row-major index in the `[M·b, …]` tensor of the whole step,
//!   so `M` microbatches of `b` draw the masks of one batch of `M·b`. (A tensor whose batch is
//!   not its first dim, such as a sequence-first layout, still gets a deterministic mask that is
//!   the same on every mesh, but not the whole batch's one.)
//! - **Pipeline stages** run the same ops with the same `(S, s, m)`; a **recomputation** of a
//!   forward op during backward is the same op at the same step, so it draws the same mask.
//! - **The backward** is the same op with the same `id` on the output gradient
//!   (`dx = dropout(dy)`): it regenerates the mask instead of keeping it.
//! - **Inference and evaluation** (no step) do not drop: `y = x`, `keep` all true. A kernel run
//!   without a draw (`kernels::cpu::eval`, constant folding) is inference.

use crate::op::{InferError, want_inputs};
use crate::tensor::{DType, TensorMeta};

/// Attributes of [`crate::Op::Dropout`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DropoutAttrs {
    /// Probability of dropping an element, in `[0, 1)`.
    pub ratio: f32,
    /// The op's key in the generator (distinct for every dropout of a model; its gradient has
    /// the same).
    pub id: u32,
    /// The op also outputs the keep mask (bool, the input's shape).
    pub mask: bool,
}

impl DropoutAttrs {
    /// `1 / (1 - ratio)`, the scale of the kept elements (in f64; kernels round it to their type).
    pub fn scale(&self) -> f64 {
        1.0 / (1.0 - self.ratio as f64)
    }

    /// The first 32-bit word that keeps an element: `floor(ratio · 2^32)`.
    pub fn threshold(&self) -> u32 {
        // ratio < 1 (checked by inference), so the product is below 2^32.
        (self.ratio as f64 * 4_294_967_296.0).floor().clamp(0.0, u32::MAX as f64) as u32
    }

    /// Why these attributes are invalid, if they are.
    pub fn check(&self, op: &str) -> Result<(), InferError> {
        if !(self.ratio.is_finite() && (0.0..1.0).contains(&self.ratio)) {
            return Err(format!("{op}: ratio {} is not in [0, 1)", self.ratio));
        }
        Ok(())
    }
}

/// Output metas of a dropout: the input's, and a bool mask of its shape with `mask`.
pub(crate) fn infer(n: &str, a: &DropoutAttrs, ins: &[TensorMeta]) -> Result<Vec<TensorMeta>, InferError> {
    want_inputs(n, ins, 1, 1)?;
    a.check(n)?;
    if !ins[0].dtype.is_float() {
        return Err(format!("{n}: input must be a float tensor, got {}", ins[0].dtype));
    }
    let mut outs = vec![ins[0].clone()];
    if a.mask {
        outs.push(TensorMeta::new(DType::Bool, ins[0].shape.clone()));
    }
    Ok(outs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Graph, Op};

    fn f32s(shape: &[usize]) -> TensorMeta {
        TensorMeta::new(DType::F32, shape.to_vec())
    }

    #[test]
    fn inference_checks_the_ratio_and_the_input() {
        let op = |ratio: f32, mask: bool| Op::Dropout(DropoutAttrs { ratio, id: 0, mask });
        assert_eq!(op(0.1, false).infer(&[f32s(&[2, 3])]).unwrap(), vec![f32s(&[2, 3])]);
        let both = op(0.1, true).infer(&[f32s(&[2, 3])]).unwrap();
        assert_eq!(both[1], TensorMeta::new(DType::Bool, vec![2, 3]));
        assert_eq!(op(0.1, true).num_outputs(), 2);
        for bad in [1.0, -0.1, f32::NAN] {
            assert!(op(bad, false).infer(&[f32s(&[2])]).unwrap_err().contains("ratio"), "{bad}");
        }
        let ints = TensorMeta::new(DType::I64, vec![2]);
        assert!(op(0.1, false).infer(&[ints]).unwrap_err().contains("float"));
        assert!(op(0.1, false).infer(&[f32s(&[2]), f32s(&[2])]).is_err());
    }

    #[test]
    fn the_threshold_keeps_one_minus_ratio_of_the_words() {
        let t = |ratio: f32| DropoutAttrs { ratio, id: 0, mask: false }.threshold();
        assert_eq!(t(0.0), 0);
        assert_eq!(t(0.5), 1 << 31);
        assert_eq!(t(0.25), 1 << 30);
        assert!(t(0.999_999_9) > u32::MAX - 1024);
    }

    #[test]
    fn text_form_round_trips() {
        let mut g = Graph::new("d");
        let x = g.input("x", f32s(&[2, 3]));
        let d = g.add_op("drop", Op::Dropout(DropoutAttrs { ratio: 0.1, id: 7, mask: true }), &[x]).unwrap();
        g.set_output("y", d[0]);
        g.set_output("mask", d[1]);
        let text = g.to_text();
        assert!(text.contains("dropout{ratio=0.1, id=7, mask=true}"), "{text}");
        assert_eq!(Graph::parse(&text).unwrap().to_text(), text);
    }
}
