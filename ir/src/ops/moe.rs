//! Routed experts (mixture of experts): [`crate::Op::Moe`] and its gradient [`crate::Op::MoeGrad`].
//!
//! Inputs: x `[T, H]` or `[B, S, H]` (the tokens are every row of the last dim), the router
//! weight `[H, E]`, and the experts' weights stacked along a first dim of `E`: for SwiGLU
//! `w1 [E, H, F]`, `w3 [E, H, F]`, `w2 [E, F, H]`; for GELU `w1 [E, H, F]`, `w2 [E, F, H]`.
//! Per token `x_t`:
//! - router probabilities `p = softmax(x_t · Wr)` over the `E` experts;
//! - the `top_k` largest (ties to the lower expert index), with weights `g_j = p_j`, or with
//!   `normalize` `g_j = p_j / Σ_chosen p` (Mixtral's renormalisation);
//! - expert `j`'s output `o_j = act(x_t W1[j]) W2[j]`, where SwiGLU's `act` is
//!   `silu(x_t W1[j]) * (x_t W3[j])` and GELU's is the exact (erf) GELU of `x_t W1[j]`;
//! - `y_t = Σ_chosen g_j o_j`.
//!
//! Dropless: every token reaches its `top_k` experts, so the output equals PyTorch's module
//! (HF `MixtralSparseMoeBlock`) and the shapes are static whatever the routing.
//!
//! The second output is the auxiliary load-balancing loss (a scalar), Switch Transformer's
//! `E · Σ_e f_e P_e` as HF's `load_balancing_loss_func` computes it: `f_e` is the fraction of
//! the `T` tokens that chose expert `e` (in any of their `top_k` slots) and `P_e` the mean
//! router probability of `e` over the tokens. `f` is piecewise constant, so the loss's gradient
//! flows through `P` only.
//!
//! The gradient op recomputes the routing and the experts' hidden activations from the inputs
//! (nothing but the inputs is kept between the passes) and reads dy and the loss's gradient
//! daux (a scalar); it gives dx, the router's gradient and the experts' (in the input order).
//! Top-k selection is piecewise constant: the router's gradient flows through the chosen
//! weights and, for the loss, through every probability.
//!
//! Work (multiply-add = 2): `2 H E` per token for the router, and per chosen expert `2 H F`
//! per projection (three for SwiGLU, two for GELU); the backward is about twice the forward
//! plus the recomputed forward.

use crate::op::{InferError, want_inputs};
use crate::tensor::{DType, TensorMeta};

/// The experts' activation of [`crate::Op::Moe`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MoeAct {
    /// `silu(x W1) * (x W3)`, then `W2` (Mixtral, Qwen2-MoE, DeepSeek).
    Swiglu,
    /// `gelu(x W1)` (exact, erf form), then `W2` (Switch, GShard).
    Gelu,
}

impl MoeAct {
    /// The text form's name.
    pub fn name(self) -> &'static str {
        match self {
            MoeAct::Swiglu => "swiglu",
            MoeAct::Gelu => "gelu",
        }
    }
    /// The activation named `s` in the text form.
    pub fn parse(s: &str) -> Option<MoeAct> {
        match s {
            "swiglu" => Some(MoeAct::Swiglu),
            "gelu" => Some(MoeAct::Gelu),
            _ => None,
        }
    }
    /// Expert weight tensors: w1, w3, w2 for SwiGLU; w1, w2 for GELU.
    pub fn weights(self) -> usize {
        match self {
            MoeAct::Swiglu => 3,
            MoeAct::Gelu => 2,
        }
    }
}

/// Attributes of [`crate::Op::Moe`] and [`crate::Op::MoeGrad`] (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MoeAttrs {
    /// Number of experts `E`.
    pub experts: usize,
    /// Experts per token (at least 1, at most `E`).
    pub top_k: usize,
    /// Renormalise the chosen weights to sum to 1.
    pub normalize: bool,
    /// The experts' activation.
    pub act: MoeAct,
}

/// The sizes of one routed-experts layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeDims {
    /// Tokens (the product of x's dims but the last).
    pub tokens: usize,
    /// Hidden size `H`.
    pub hidden: usize,
    /// Experts `E`.
    pub experts: usize,
    /// The experts' inner size `F`.
    pub ffn: usize,
}

impl MoeAttrs {
    /// Number of forward inputs: x, the router and the expert weights.
    pub fn num_inputs(&self) -> usize {
        2 + self.act.weights()
    }

    /// Checks the forward inputs (the first [`Self::num_inputs`] of `ins`) of an op named `n`.
    pub fn check(&self, n: &str, ins: &[TensorMeta]) -> Result<MoeDims, InferError> {
        let k = self.num_inputs();
        if ins.len() < k {
            return Err(format!("{n}: takes x, the router and {} expert weights, got {} inputs", k - 2, ins.len()));
        }
        let x = &ins[0];
        let dt = x.dtype;
        for (i, m) in ins[..k].iter().enumerate() {
            if !m.dtype.is_float() || m.dtype != dt {
                return Err(format!("{n}: every input must be x's float type {dt}; input {i} is {}", m.dtype));
            }
        }
        if !(2..=3).contains(&x.rank()) {
            return Err(format!("{n}: x must be [tokens, hidden] or [batch, seq, hidden], got {:?}", x.shape));
        }
        let hidden = *x.shape.last().expect("rank checked");
        let tokens = x.shape[..x.rank() - 1].iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        let tokens = tokens.ok_or_else(|| format!("{n}: x's token count overflows: {:?}", x.shape))?;
        let e = self.experts;
        if e == 0 || self.top_k == 0 || self.top_k > e {
            return Err(format!("{n}: need 1 <= top_k <= experts, got top_k {} of {e} experts", self.top_k));
        }
        if ins[1].shape != [hidden, e] {
            return Err(format!("{n}: the router must be [hidden, experts] = [{hidden}, {e}], got {:?}", ins[1].shape));
        }
        let w1 = &ins[2].shape;
        if w1.len() != 3 || w1[0] != e || w1[1] != hidden {
            return Err(format!("{n}: w1 must be [experts, hidden, ffn] = [{e}, {hidden}, F], got {w1:?}"));
        }
        let ffn = w1[2];
        if self.act == MoeAct::Swiglu && ins[3].shape != *w1 {
            return Err(format!("{n}: w3 must be w1's shape {w1:?}, got {:?}", ins[3].shape));
        }
        let w2 = &ins[k - 1].shape;
        if *w2 != [e, ffn, hidden] {
            return Err(format!("{n}: w2 must be [experts, ffn, hidden] = [{e}, {ffn}, {hidden}], got {w2:?}"));
        }
        Ok(MoeDims { tokens, hidden, experts: e, ffn })
    }

    /// [`crate::Op::Moe`]: outputs y (x's meta) and the auxiliary loss (a scalar of x's type).
    pub(crate) fn infer(&self, n: &str, ins: &[TensorMeta]) -> Result<Vec<TensorMeta>, InferError> {
        let k = self.num_inputs();
        want_inputs(n, ins, k, k)?;
        self.check(n, ins)?;
        Ok(vec![ins[0].clone(), TensorMeta::new(ins[0].dtype, Vec::<usize>::new())])
    }

    /// [`crate::Op::MoeGrad`]: the forward inputs, dy (x's meta) and daux (a scalar); outputs
    /// the gradients of the forward inputs (their metas).
    pub(crate) fn infer_grad(&self, n: &str, ins: &[TensorMeta]) -> Result<Vec<TensorMeta>, InferError> {
        let k = self.num_inputs();
        want_inputs(n, ins, k + 2, k + 2)?;
        self.check(n, ins)?;
        let dt: DType = ins[0].dtype;
        if ins[k] != ins[0] {
            return Err(format!("{n}: dy must be x's meta {}, got {}", ins[0], ins[k]));
        }
        if ins[k + 1].rank() != 0 || ins[k + 1].dtype != dt {
            return Err(format!("{n}: daux must be a {dt} scalar, got {}", ins[k + 1]));
        }
        Ok(ins[..k].to_vec())
    }

    /// FLOPs of the forward op (see the module docs).
    pub(crate) fn flops(&self, ins: &[TensorMeta]) -> u64 {
        let Ok(d) = self.check("moe", ins) else { return 0 };
        let router = (d.tokens as u64).saturating_mul(2 * d.hidden as u64).saturating_mul(d.experts as u64);
        let per = (2 * d.hidden as u64).saturating_mul(d.ffn as u64).saturating_mul(self.act.weights() as u64);
        let experts = (d.tokens as u64).saturating_mul(self.top_k as u64).saturating_mul(per);
        router.saturating_add(experts)
    }

    /// FLOPs of the gradient op: the recomputed forward and twice it for the gradients.
    pub(crate) fn grad_flops(&self, ins: &[TensorMeta]) -> u64 {
        self.flops(ins).saturating_mul(3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Op;

    fn f(shape: &[usize]) -> TensorMeta {
        TensorMeta::new(DType::F32, shape.to_vec())
    }
    const SW: MoeAttrs = MoeAttrs { experts: 4, top_k: 2, normalize: true, act: MoeAct::Swiglu };

    #[test]
    fn shapes_and_checks() {
        let ins = [f(&[2, 3, 8]), f(&[8, 4]), f(&[4, 8, 6]), f(&[4, 8, 6]), f(&[4, 6, 8])];
        let outs = Op::Moe(SW).infer(&ins).unwrap();
        assert_eq!(outs, vec![f(&[2, 3, 8]), f(&[])]);
        let gelu = MoeAttrs { act: MoeAct::Gelu, ..SW };
        let gins = [f(&[6, 8]), f(&[8, 4]), f(&[4, 8, 6]), f(&[4, 6, 8])];
        assert_eq!(Op::Moe(gelu).infer(&gins).unwrap(), vec![f(&[6, 8]), f(&[])]);
        let bad = |a: MoeAttrs, ins: &[TensorMeta]| Op::Moe(a).infer(ins).unwrap_err();
        assert!(bad(SW, &gins).contains("takes"), "{}", bad(SW, &gins));
        assert!(bad(MoeAttrs { top_k: 5, ..SW }, &ins).contains("top_k"));
        assert!(bad(MoeAttrs { top_k: 0, ..SW }, &ins).contains("top_k"));
        assert!(bad(MoeAttrs { experts: 3, ..SW }, &ins).contains("router"));
        let mut w = ins.clone();
        w[4] = f(&[4, 8, 6]);
        assert!(bad(SW, &w).contains("w2"), "{}", bad(SW, &w));
        w = ins.clone();
        w[3] = f(&[4, 8, 5]);
        assert!(bad(SW, &w).contains("w3"));
        w = ins.clone();
        w[0] = f(&[8]);
        assert!(bad(SW, &w).contains("x must be"));
        w = ins.clone();
        w[1] = TensorMeta::new(DType::F64, vec![8, 4]);
        assert!(bad(SW, &w).contains("float type"));
    }

    #[test]
    fn grad_shapes_and_flops() {
        let ins = vec![f(&[6, 8]), f(&[8, 4]), f(&[4, 8, 6]), f(&[4, 8, 6]), f(&[4, 6, 8])];
        let mut gins = ins.clone();
        gins.extend([f(&[6, 8]), f(&[])]);
        assert_eq!(Op::MoeGrad(SW).infer(&gins).unwrap(), ins);
        gins[6] = f(&[1]);
        assert!(Op::MoeGrad(SW).infer(&gins).unwrap_err().contains("daux"));
        // Router 6 tokens x 2*8*4, experts 6 x 2 x 3 projections x 2*8*6.
        assert_eq!(Op::Moe(SW).flops(&ins, &[]), 6 * 64 + 6 * 2 * 3 * 96);
    }

    #[test]
    fn text_and_json_round_trip() {
        let mut g = crate::Graph::new("moe");
        let gelu = MoeAttrs { act: MoeAct::Gelu, normalize: false, top_k: 1, ..SW };
        let ins: Vec<_> = [("x", &[6, 8][..]), ("r", &[8, 4]), ("w1", &[4, 8, 6]), ("w2", &[4, 6, 8])]
            .iter()
            .map(|(n, s)| g.input(n, f(s)))
            .collect();
        let y = g.add_op("m", Op::Moe(gelu), &ins).unwrap();
        let mut gins = ins.clone();
        gins.extend([y[0], y[1]]);
        let d = g.add_op("d", Op::MoeGrad(gelu), &gins).unwrap();
        g.set_output("y", y[0]);
        g.set_output("dr", d[1]);
        crate::verify(&g).unwrap();
        let text = g.to_text();
        assert!(text.contains("moe_grad") && text.contains("gelu"), "{text}");
        assert_eq!(crate::Graph::parse(&text).unwrap().to_text(), text);
        for op in [Op::Moe(SW), Op::MoeGrad(gelu)] {
            let j = serde_json::to_string(&op).unwrap();
            assert_eq!(serde_json::from_str::<Op>(&j).unwrap(), op);
        }
    }
}
