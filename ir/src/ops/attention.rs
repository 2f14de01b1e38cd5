//! Fused attention: [`crate::Op::Attention`] (ONNX `Attention`, opset 23, in its 4-D form) and
//! its gradient [`crate::Op::AttentionGrad`], computed as flash attention computes them.
//!
//! Inputs Q `[B, Hq, S, D]`, K `[B, Hkv, T, D]`, V `[B, Hkv, T, Dv]` and an optional mask
//! broadcasting to `[B, Hq, S, T]` (additive, of Q's type, or boolean: `true` attends).
//! Query head `h` reads key/value head `h / (Hq / Hkv)` (grouped-query attention; ONNX repeats
//! each key/value head `Hq / Hkv` times in place). With scores
//! `s = scale · q·k` (then `softcap · tanh(s / softcap)` when `softcap > 0`), plus the mask,
//! `Y = softmax(s) V` along the keys. A causal op also masks key `j` for query `i` when
//! `j > i + offset` (ONNX's upper-left alignment: `offset` is 0, or the length of a past cache).
//! A query row with no attended key gives zeros (ONNX's rule), and a key masked by the mask
//! (`-inf` or `false`) is skipped whatever its score is (select, not add: a masked `+inf` score
//! stays masked).
//!
//! The op has a second output, the row statistic `L = log Σ_j exp(s_ij)` `[B, Hq, S]`
//! (`+inf` for a row with no attended key), kept in f32 (f64 in an f64 graph) whatever Q's type
//! is: the backward recomputes the probabilities from it, `P = exp(s - L)`, as flash attention
//! does, so the `S x T` scores are never stored. The gradient op reads Q, K, V, Y, L and dY (and
//! the mask) and gives dQ, dK and dV (summed over the query heads of each group); the mask has
//! no gradient.
//!
//! Work (multiply-add = 2): `2 (D + Dv)` FLOPs per attended (query, key) pair and head forward,
//! `2 (3 D + 2 Dv)` backward (the scores recomputed, then dV, dP, dQ and dK): 2.5 times the
//! forward when `D = Dv`. A causal op attends about half the pairs, and its kernels skip the
//! others: it is priced at the pairs it attends.

use crate::op::{InferError, want_inputs};
use crate::tensor::{DType, TensorMeta};

/// Attributes of [`crate::Op::Attention`] and [`crate::Op::AttentionGrad`] (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionAttrs {
    /// Multiplies `q·k` (ONNX's default, `1 / sqrt(D)`, is written by the importer).
    pub scale: f32,
    /// Key `j` is masked for query `i` when `j > i + offset`.
    pub causal: bool,
    /// The causal frontier's shift: query `i` sits at key position `i + offset`.
    pub offset: usize,
    /// Scores pass through `softcap · tanh(s / softcap)` before the mask when positive.
    pub softcap: f32,
}

/// The sizes of one attention: batch, query heads, key/value heads, query length, key length,
/// the head size of Q and K and that of V.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionDims {
    /// Batch.
    pub b: usize,
    /// Query heads.
    pub hq: usize,
    /// Key/value heads (divides `hq`).
    pub hkv: usize,
    /// Query length.
    pub s: usize,
    /// Key length.
    pub t: usize,
    /// Head size of Q and K.
    pub d: usize,
    /// Head size of V.
    pub dv: usize,
}

impl AttentionDims {
    /// The sizes of Q, K and V's shapes, if they are an attention's (unchecked beyond rank).
    pub fn of(q: &[usize], k: &[usize], v: &[usize]) -> Option<AttentionDims> {
        match (q, k, v) {
            (&[b, hq, s, d], &[_, hkv, t, _], &[_, _, _, dv]) => Some(AttentionDims { b, hq, hkv, s, t, d, dv }),
            _ => None,
        }
    }
    /// Query heads per key/value head.
    pub fn group(&self) -> usize {
        self.hq / self.hkv.max(1)
    }
}

impl AttentionAttrs {
    /// Whether key `j` is attended by query `i` under the causal rule (always without it).
    #[inline]
    pub fn allowed(&self, i: usize, j: usize) -> bool {
        !self.causal || j <= i + self.offset
    }

    /// Keys a query row `i` may attend under the causal rule: `0..keys(i)` of the `t` keys.
    #[inline]
    pub fn keys(&self, i: usize, t: usize) -> usize {
        if self.causal { (i + self.offset + 1).min(t) } else { t }
    }

    /// The (query, key) pairs the causal rule leaves, per head (`s x t` without it).
    pub fn pairs(&self, s: usize, t: usize) -> u64 {
        if !self.causal {
            return (s as u64).saturating_mul(t as u64);
        }
        // Rows i with i + offset + 1 < t attend i + offset + 1 keys; the others all t.
        let (s, t, off) = (s as u64, t as u64, self.offset as u64);
        let partial = t.saturating_sub(off + 1).min(s);
        let first = off + 1;
        let tri = partial.saturating_mul(first.saturating_mul(2).saturating_add(partial.saturating_sub(1))) / 2;
        tri.saturating_add((s - partial).saturating_mul(t))
    }

    /// Checks Q, K, V (and the mask) for an attention op named `n`; returns the sizes.
    fn check(&self, n: &str, q: &TensorMeta, k: &TensorMeta, v: &TensorMeta) -> Result<AttentionDims, InferError> {
        for (m, what) in [(q, "Q"), (k, "K"), (v, "V")] {
            if m.rank() != 4 {
                return Err(format!("{n}: {what} must be 4-D [batch, heads, seq, head size], got {:?}", m.shape));
            }
            if !m.dtype.is_float() {
                return Err(format!("{n}: {what} must be a float tensor, got {}", m.dtype));
            }
            if m.dtype != q.dtype {
                return Err(format!("{n}: Q is {} but {what} is {}", q.dtype, m.dtype));
            }
        }
        let dims = AttentionDims::of(&q.shape, &k.shape, &v.shape).expect("ranks checked");
        if k.shape[0] != dims.b || v.shape[0] != dims.b {
            return Err(format!("{n}: batch sizes differ: Q {:?}, K {:?}, V {:?}", q.shape, k.shape, v.shape));
        }
        if v.shape[1] != dims.hkv {
            return Err(format!("{n}: K has {} heads but V has {}", dims.hkv, v.shape[1]));
        }
        if dims.hkv == 0 || !dims.hq.is_multiple_of(dims.hkv) {
            return Err(format!(
                "{n}: the query heads ({}) must be a multiple of the key/value heads ({})",
                dims.hq, dims.hkv
            ));
        }
        if v.shape[2] != dims.t {
            return Err(format!("{n}: K has {} keys but V has {}", dims.t, v.shape[2]));
        }
        if k.shape[3] != dims.d {
            return Err(format!("{n}: Q's head size is {} but K's is {}", dims.d, k.shape[3]));
        }
        if !(self.scale.is_finite() && self.softcap.is_finite() && self.softcap >= 0.0) {
            return Err(format!("{n}: scale must be finite and softcap finite and >= 0, got {self:?}"));
        }
        Ok(dims)
    }

    /// The mask's check: boolean or Q's float type, broadcasting to `[B, Hq, S, T]`.
    fn check_mask(n: &str, mask: &TensorMeta, q: DType, dims: &AttentionDims) -> Result<(), InferError> {
        if mask.dtype != DType::Bool && mask.dtype != q {
            return Err(format!("{n}: the mask must be bool or Q's type {q}, got {}", mask.dtype));
        }
        let full = [dims.b, dims.hq, dims.s, dims.t];
        let ok = mask.rank() <= 4 && mask.shape.iter().rev().zip(full.iter().rev()).all(|(&m, &f)| m == f || m == 1);
        if !ok {
            return Err(format!("{n}: the mask {:?} does not broadcast to [B, Hq, S, T] = {full:?}", mask.shape));
        }
        Ok(())
    }

    /// The float type of the row statistic for Q's type: f64 for f64, else f32.
    pub fn stat_dtype(q: DType) -> DType {
        if q == DType::F64 { DType::F64 } else { DType::F32 }
    }

    /// [`crate::Op::Attention`]: inputs Q, K, V and an optional mask; outputs Y
    /// `[B, Hq, S, Dv]` (Q's type) and the row statistic `[B, Hq, S]`.
    pub(crate) fn infer(&self, n: &str, ins: &[TensorMeta]) -> Result<Vec<TensorMeta>, InferError> {
        want_inputs(n, ins, 3, 4)?;
        let dims = self.check(n, &ins[0], &ins[1], &ins[2])?;
        if let Some(m) = ins.get(3) {
            Self::check_mask(n, m, ins[0].dtype, &dims)?;
        }
        let AttentionDims { b, hq, s, dv, .. } = dims;
        Ok(vec![
            TensorMeta::new(ins[0].dtype, [b, hq, s, dv]),
            TensorMeta::new(Self::stat_dtype(ins[0].dtype), [b, hq, s]),
        ])
    }

    /// [`crate::Op::AttentionGrad`]: inputs Q, K, V, Y, the row statistic, dY and an optional
    /// mask; outputs dQ, dK and dV (the metas of Q, K and V).
    pub(crate) fn infer_grad(&self, n: &str, ins: &[TensorMeta]) -> Result<Vec<TensorMeta>, InferError> {
        want_inputs(n, ins, 6, 7)?;
        let dims = self.check(n, &ins[0], &ins[1], &ins[2])?;
        let dt = ins[0].dtype;
        let y = [dims.b, dims.hq, dims.s, dims.dv];
        for (i, what) in [(3, "Y"), (5, "dY")] {
            if ins[i].shape != y || ins[i].dtype != dt {
                return Err(format!("{n}: {what} must be {dt}{y:?}, got {}", ins[i]));
            }
        }
        let (l, ldt) = (&ins[4], Self::stat_dtype(dt));
        if l.shape != y[..3] || l.dtype != ldt {
            return Err(format!("{n}: the row statistic must be {ldt}{:?}, got {l}", &y[..3]));
        }
        if let Some(m) = ins.get(6) {
            Self::check_mask(n, m, dt, &dims)?;
        }
        Ok(vec![ins[0].clone(), ins[1].clone(), ins[2].clone()])
    }

    /// FLOPs of the forward op on inputs `ins` (see the module docs).
    pub(crate) fn flops(&self, ins: &[TensorMeta]) -> u64 {
        self.work(ins, |d, dv| 2 * (d + dv))
    }

    /// FLOPs of the gradient op on inputs `ins` (see the module docs).
    pub(crate) fn grad_flops(&self, ins: &[TensorMeta]) -> u64 {
        self.work(ins, |d, dv| 2 * (3 * d + 2 * dv))
    }

    fn work(&self, ins: &[TensorMeta], per_pair: impl Fn(u64, u64) -> u64) -> u64 {
        let dims = match ins {
            [q, k, v, ..] => AttentionDims::of(&q.shape, &k.shape, &v.shape),
            _ => None,
        };
        let Some(x) = dims else { return 0 };
        let heads = (x.b as u64).saturating_mul(x.hq as u64);
        heads.saturating_mul(self.pairs(x.s, x.t)).saturating_mul(per_pair(x.d as u64, x.dv as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Graph, Op};

    fn f(shape: &[usize]) -> TensorMeta {
        TensorMeta::new(DType::F32, shape.to_vec())
    }
    const PLAIN: AttentionAttrs = AttentionAttrs { scale: 0.5, causal: false, offset: 0, softcap: 0.0 };

    #[test]
    fn shapes_and_checks() {
        let (q, k, v) = (f(&[2, 6, 4, 8]), f(&[2, 3, 5, 8]), f(&[2, 3, 5, 7]));
        let outs = Op::Attention(PLAIN).infer(&[q.clone(), k.clone(), v.clone()]).unwrap();
        assert_eq!(outs, vec![f(&[2, 6, 4, 7]), f(&[2, 6, 4])]);
        // Masks broadcast to [B, Hq, S, T]; bool or Q's type.
        for m in [f(&[4, 5]), f(&[2, 1, 4, 5]), f(&[6, 1, 5]), TensorMeta::new(DType::Bool, [1, 5])] {
            assert!(Op::Attention(PLAIN).infer(&[q.clone(), k.clone(), v.clone(), m.clone()]).is_ok(), "{m}");
        }
        let bad = |ins: &[TensorMeta]| Op::Attention(PLAIN).infer(ins).unwrap_err();
        assert!(bad(&[q.clone(), k.clone(), v.clone(), f(&[4, 6])]).contains("broadcast"));
        assert!(bad(&[q.clone(), k.clone(), v.clone(), TensorMeta::new(DType::I64, [4, 5])]).contains("mask"));
        assert!(bad(&[f(&[2, 5, 4, 8]), k.clone(), v.clone()]).contains("multiple"));
        assert!(bad(&[q.clone(), f(&[2, 3, 5, 9]), v.clone()]).contains("head size"));
        assert!(bad(&[q.clone(), k.clone(), f(&[2, 3, 6, 7])]).contains("keys"));
        assert!(bad(&[f(&[2, 6, 4]), k.clone(), v.clone()]).contains("4-D"));
        assert!(bad(&[q.clone(), k.clone()]).contains("inputs"));
        // The statistic stays f32 in a 16-bit graph, f64 in an f64 one.
        let h = |s: &[usize]| TensorMeta::new(DType::BF16, s.to_vec());
        let outs = Op::Attention(PLAIN).infer(&[h(&[1, 2, 3, 4]), h(&[1, 1, 3, 4]), h(&[1, 1, 3, 4])]).unwrap();
        assert_eq!(outs[1].dtype, DType::F32);
        // The gradient: dQ, dK, dV like Q, K, V.
        let (y, l) = (f(&[2, 6, 4, 7]), f(&[2, 6, 4]));
        let g = Op::AttentionGrad(PLAIN)
            .infer(&[q.clone(), k.clone(), v.clone(), y.clone(), l.clone(), y.clone()])
            .unwrap();
        assert_eq!(g, vec![q.clone(), k.clone(), v.clone()]);
        assert!(Op::AttentionGrad(PLAIN).infer(&[q.clone(), k.clone(), v.clone(), y.clone(), y.clone(), y]).is_err());
    }

    #[test]
    fn causal_pairs_and_flops() {
        let c = AttentionAttrs { causal: true, ..PLAIN };
        let brute = |a: &AttentionAttrs, s: usize, t: usize| {
            (0..s).flat_map(|i| (0..t).map(move |j| (i, j))).filter(|&(i, j)| a.allowed(i, j)).count() as u64
        };
        for (s, t, off) in [(4, 4, 0), (4, 6, 0), (6, 4, 0), (5, 9, 3), (3, 2, 7), (0, 3, 0), (3, 0, 0)] {
            let a = AttentionAttrs { offset: off, ..c };
            assert_eq!(a.pairs(s, t), brute(&a, s, t), "s {s} t {t} offset {off}");
            assert_eq!(PLAIN.pairs(s, t), (s * t) as u64);
        }
        // 4 B Hq S T D forward without a mask's halving, 2.5 times that backward.
        let ins = [f(&[2, 4, 16, 8]), f(&[2, 2, 16, 8]), f(&[2, 2, 16, 8])];
        let fw = Op::Attention(PLAIN).flops(&ins, &[]);
        assert_eq!(fw, 4 * 2 * 4 * 16 * 16 * 8);
        let mut gins = ins.to_vec();
        gins.extend([f(&[2, 4, 16, 8]), f(&[2, 4, 16]), f(&[2, 4, 16, 8])]);
        assert_eq!(Op::AttentionGrad(PLAIN).flops(&gins, &[]) * 2, fw * 5);
        assert_eq!(Op::Attention(c).flops(&ins, &[]), 4 * 2 * 4 * (16 * 17 / 2) * 8);
    }

    #[test]
    fn text_and_json_round_trip() {
        let mut g = Graph::new("attn");
        let q = g.input("q", f(&[1, 4, 3, 8]));
        let k = g.input("k", f(&[1, 2, 5, 8]));
        let m = g.input("m", TensorMeta::new(DType::Bool, [3, 5]));
        let a = AttentionAttrs { scale: 0.25, causal: true, offset: 2, softcap: 30.0 };
        let y = g.add_op("a", Op::Attention(a), &[q, k, k, m]).unwrap();
        let d = g.add_op("d", Op::AttentionGrad(a), &[q, k, k, y[0], y[1], y[0], m]).unwrap();
        g.set_output("y", y[0]);
        g.set_output("dq", d[0]);
        crate::verify(&g).unwrap();
        let text = g.to_text();
        assert!(text.contains("attention"), "{text}");
        assert_eq!(Graph::parse(&text).unwrap().to_text(), text);
        let op = serde_json::to_string(&Op::Attention(a)).unwrap();
        assert_eq!(serde_json::from_str::<Op>(&op).unwrap(), Op::Attention(a));
    }
}
