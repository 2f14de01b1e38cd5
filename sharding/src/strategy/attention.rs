//! Sharding rule of fused attention and its gradient ([`super::rule`] dispatches here).
//!
//! Attention is independent per batch row and per key/value head group, so both split with no
//! communication: Q, K, V, the mask, Y and the row statistic are split alike. The head dim's
//! logical size is the key/value head count: a split of it into `n` contiguous blocks gives each
//! rank whole groups of query heads with their key/value head (`Hq / Hkv` query heads read one
//! key/value head). The query positions split too (K and V replicated, so gathered by a
//! conversion; the gradient's dK and dV are then partial sums over the query blocks): context
//! parallelism in its all-gather form. Under the causal rule each rank's block of queries has
//! its own frontier ([`Local::QueryBlocks`]). The head size is summed inside the softmax and
//! never splits.

use super::*;

/// The sharding rule of `Attention` (inputs Q, K, V, mask?; outputs Y, L) or `AttentionGrad`
/// (inputs Q, K, V, Y, L, dY, mask?; outputs dQ, dK, dV).
pub(super) fn rule(op: &Op, ins: &[TensorMeta], outs: &[TensorMeta]) -> Option<Rule> {
    let (attrs, grad) = match op {
        Op::Attention(a) => (a, false),
        Op::AttentionGrad(a) => (a, true),
        // `super::rule` sends only the ops above here.
        _ => return None,
    };
    let dims = ir::AttentionDims::of(&ins.first()?.shape, &ins.get(1)?.shape, &ins.get(2)?.shape)?;
    let (ni, no) = (ins.len(), outs.len());
    let mask = if grad { 6 } else { 3 };
    // The mask's dim for dim `d` of [B, Hq, S, T] (right-aligned broadcast), if it is not 1.
    let mask_dim = |d: usize| -> InMap {
        let Some(m) = ins.get(mask) else { return InMap::Replicate };
        let off = 4 - m.rank();
        match d.checked_sub(off) {
            Some(i) if m.shape[i] > 1 => InMap::Dim(i),
            _ => InMap::Replicate,
        }
    };
    // Query-side tensors: Q, and for the gradient Y, L and dY.
    let query_side: &[usize] = if grad { &[0, 3, 4, 5] } else { &[0] };
    let mut out_dims = vec![];
    // Batch and heads: every tensor but the mask has them as dims 0 and 1.
    for (d, name, size) in [(0, "batch", dims.b), (1, "heads", dims.hkv)] {
        if size <= 1 {
            continue;
        }
        let mut l = ldim(name, size, ni, no);
        for i in 0..ni.min(mask) {
            l.ins[i] = InMap::Dim(d);
        }
        if ni > mask {
            l.ins[mask] = mask_dim(d);
        }
        l.outs = vec![Some(d); no];
        out_dims.push(l);
    }
    if dims.s > 1 {
        let mut l = ldim("q", dims.s, ni, no);
        if attrs.causal {
            // Each rank's block of queries has its own causal frontier (context parallelism).
            l.special = Some(SpecialKind::QueryBlocks);
        }
        for &i in query_side {
            l.ins[i] = InMap::Dim(2);
        }
        if ni > mask {
            l.ins[mask] = mask_dim(2);
        }
        // Forward: Y and L split on their query dim. Gradient: dQ split, dK and dV summed.
        l.outs = if grad { vec![Some(2), None, None] } else { vec![Some(2); no] };
        out_dims.push(l);
    }
    Some(Rule { dims: out_dims, linear: vec![] })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir::{AttentionAttrs, DType};

    fn f(shape: &[usize]) -> TensorMeta {
        TensorMeta::new(DType::F32, shape.to_vec())
    }

    fn names(op: &Op, ins: &[TensorMeta], mesh: &[usize]) -> Vec<(String, Vec<String>, Vec<String>)> {
        let outs = op.infer(ins).unwrap();
        let mesh = DeviceMesh::uniform(mesh).unwrap();
        let cpu = DeviceProfile::builtin("cpu").unwrap();
        let ctx = OpContext { param_inputs: vec![false; ins.len()] };
        expand(op, ins, &outs, &ctx, &mesh, &cpu)
            .unwrap()
            .into_iter()
            .map(|s| {
                let sp = |v: &[ShardingSpec]| v.iter().map(|x| x.to_string()).collect();
                (s.name.clone(), sp(&s.inputs), sp(&s.outputs))
            })
            .collect()
    }

    #[test]
    fn batch_head_groups_and_query_rows() {
        let plain = AttentionAttrs { scale: 0.5, causal: false, offset: 0, softcap: 0.0 };
        let causal = AttentionAttrs { causal: true, ..plain };
        // Grouped-query attention: 4 query heads on 2 key/value heads, a mask [S, T].
        let (q, kv, m) = (f(&[2, 4, 8, 16]), f(&[2, 2, 8, 16]), f(&[8, 8]));
        let s = names(&Op::Attention(causal), &[q.clone(), kv.clone(), kv.clone(), m.clone()], &[2]);
        let find = |s: &[(String, Vec<String>, Vec<String>)], n: &str| s.iter().find(|x| x.0 == n).cloned();
        let heads = find(&s, "heads@0").expect("a head split");
        assert_eq!(heads.1, ["R S0 R R", "R S0 R R", "R S0 R R", "R R"]);
        assert_eq!(heads.2, ["R S0 R R", "R S0 R"]);
        assert!(find(&s, "batch@0").is_some());
        // Causal: the query rows split as blocks, each with its own frontier.
        let blocks = find(&s, "q@0").expect("a causal query split");
        assert_eq!(blocks.1, ["R R S0 R", "R R R R", "R R R R", "S0 R"]);
        let strategies = {
            let ins = [q.clone(), kv.clone(), kv.clone(), m.clone()];
            let outs = Op::Attention(causal).infer(&ins).unwrap();
            let mesh = DeviceMesh::uniform(&[2]).unwrap();
            let ctx = OpContext { param_inputs: vec![false; 4] };
            expand(&Op::Attention(causal), &ins, &outs, &ctx, &mesh, &DeviceProfile::builtin("cpu").unwrap()).unwrap()
        };
        let q_split = strategies.iter().find(|s| s.name == "q@0").unwrap();
        assert_eq!(q_split.local, Local::QueryBlocks { axes: vec![0] });
        // Priced as the last block, which attends the most keys: more than half the whole op.
        let whole = strategies.iter().find(|s| s.name == "replicate").unwrap();
        assert!(q_split.compute_seconds > 0.5 * whole.compute_seconds, "{q_split:?}");
        // Without the causal rule the query rows split as they are.
        let s = names(&Op::Attention(plain), &[q.clone(), kv.clone(), kv.clone(), m.clone()], &[2]);
        let rows = find(&s, "q@0").expect("a query split");
        assert_eq!(rows.1, ["R R S0 R", "R R R R", "R R R R", "S0 R"]);
        // 4 ranks cannot split 2 key/value heads.
        let s = names(&Op::Attention(causal), &[q.clone(), kv.clone(), kv.clone()], &[4]);
        assert!(find(&s, "heads@0").is_none());
        // The gradient: dK and dV are partial sums under a query split.
        let (y, l) = (f(&[2, 4, 8, 16]), f(&[2, 4, 8]));
        let s = names(&Op::AttentionGrad(plain), &[q.clone(), kv.clone(), kv.clone(), y.clone(), l, y], &[2]);
        let rows = find(&s, "q@0").expect("a query split of the gradient");
        assert_eq!(rows.2, ["R R S0 R", "R R R R | P0", "R R R R | P0"]);
    }
}
