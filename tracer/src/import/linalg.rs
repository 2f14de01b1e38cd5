//! Import of the matrix products `MatMul` and `Gemm`, and of fused `Attention` (opset 23).

use super::*;

impl Importer<'_> {
    /// The linalg family's arms of [`Importer::translate`].
    pub(super) fn translate_linalg(&mut self, n: &N, op_type: &str) -> Result<Vec<Option<V>>, String> {
        let nm = n.name.clone();
        let one = |v: V| Ok(vec![Some(v)]);
        match op_type {
            "MatMul" => {
                let (a, b) = (self.need(n, 0)?, self.need(n, 1)?);
                one(self.emit1(&nm, Op::MatMul, &[a, b])?)
            }
            "Gemm" => {
                let mut ins = vec![self.need(n, 0)?, self.need(n, 1)?];
                if let Some(c) = self.opt(n, 2)? {
                    ins.push(c);
                }
                let op = Op::Gemm {
                    alpha: n.float("alpha", 1.0),
                    beta: n.float("beta", 1.0),
                    trans_a: n.int("transA", 0) != 0,
                    trans_b: n.int("transB", 0) != 0,
                };
                one(self.emit1(&nm, op, &ins)?)
            }
            "Attention" => self.attention(n),
            other => Err(format!("{other} is not a linalg op (importer bug)")),
        }
    }

    /// ONNX `Attention` (opset 23): Q, K, V in the 4-D form `[B, heads, seq, head size]` or the
    /// 3-D form `[B, seq, heads x head size]` (with `q_num_heads` and `kv_num_heads`), an
    /// optional mask (bool: true attends; or float: added), `is_causal`, `scale` (default
    /// `1 / sqrt(head size)`) and `softcap`. The key/value cache inputs and outputs (inference)
    /// and the `qk_matmul_output` output are refused with their reason.
    fn attention(&mut self, n: &N) -> Result<Vec<Option<V>>, String> {
        let nm = n.name.clone();
        for (i, what) in [(4, "past_key"), (5, "past_value"), (6, "nonpad_kv_seqlen")] {
            if n.input(i).is_some() {
                return Err(format!(
                    "input {i} ({what}) is a key/value cache for inference; autopar trains on whole sequences"
                ));
            }
        }
        for (k, what) in [(1, "present_key"), (2, "present_value"), (3, "qk_matmul_output")] {
            if n.node.output.get(k).is_some_and(|o| !o.is_empty() && self.used.contains(o)) {
                return Err(format!("output {k} ({what}) is used; autopar computes only the attention output Y"));
            }
        }
        let (q, k, v) = (self.need(n, 0)?, self.need(n, 1)?, self.need(n, 2)?);
        let mask = self.opt(n, 3)?;
        let rank = self.meta(&q).rank();
        let three = rank == 3;
        let (q, k, v) = if three {
            let heads = |key: &str| -> Result<usize, String> {
                match n.int(key, 0) {
                    h if h > 0 => Ok(h as usize),
                    _ => Err(format!("3-D inputs need the attribute {key} (a positive head count)")),
                }
            };
            let (hq, hkv) = (heads("q_num_heads")?, heads("kv_num_heads")?);
            (
                self.split_heads(&format!("{nm}.q"), q, hq)?,
                self.split_heads(&format!("{nm}.k"), k, hkv)?,
                self.split_heads(&format!("{nm}.v"), v, hkv)?,
            )
        } else if rank == 4 {
            (q, k, v)
        } else {
            return Err(format!("Q must be 3-D or 4-D, got {}", self.meta(&q)));
        };
        let d = *self.meta(&q).shape.last().unwrap_or(&1);
        let attrs = ir::AttentionAttrs {
            scale: n.float("scale", 1.0 / (d.max(1) as f32).sqrt()),
            causal: n.int("is_causal", 0) != 0,
            offset: 0,
            softcap: n.float("softcap", 0.0),
        };
        let mut ins = vec![q, k, v];
        ins.extend(mask);
        let y = self.emit(&nm, Op::Attention(attrs), &ins)?.remove(0);
        let y = if three { self.merge_heads(&format!("{nm}.y"), y)? } else { y };
        Ok(vec![Some(y)])
    }

    /// `[B, S, H x D]` to `[B, H, S, D]`.
    fn split_heads(&mut self, name: &str, x: V, heads: usize) -> Result<V, String> {
        let s = self.meta(&x).shape;
        if s.len() != 3 || !s[2].is_multiple_of(heads) {
            return Err(format!("{name}: {s:?} is not [batch, seq, {heads} x head size]"));
        }
        let r =
            self.emit1(&format!("{name}.heads"), Op::Reshape { shape: vec![s[0], s[1], heads, s[2] / heads] }, &[x])?;
        self.emit1(&format!("{name}.transpose"), Op::Transpose { perm: vec![0, 2, 1, 3] }, &[r])
    }

    /// `[B, H, S, D]` to `[B, S, H x D]`.
    fn merge_heads(&mut self, name: &str, x: V) -> Result<V, String> {
        let s = self.meta(&x).shape;
        let t = self.emit1(&format!("{name}.transpose"), Op::Transpose { perm: vec![0, 2, 1, 3] }, &[x])?;
        self.emit1(&format!("{name}.merge"), Op::Reshape { shape: vec![s[0], s[2], s[1] * s[3]] }, &[t])
    }
}
