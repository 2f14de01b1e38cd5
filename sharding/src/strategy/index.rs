//! Sharding rules of the indexing family ([`IndexOp`]). The indexed axis of a gather or scatter
//! (and a triangle's two matrix dims, a cumulative sum's or arg-reduction's axis) stays whole:
//! the indices address global positions along it. Every other dim splits as in an elementwise op:
//! the dims a gather copies through, the slice dims a scatter writes, the batch dims GatherND
//! shares. Gathers are linear in their data; scatters with reduction none or add are jointly
//! linear in data and updates.

use super::{InMap, LogicalDim, Rule, elementwise, ldim};
use ir::{IndexOp, ScatterReduction, TensorMeta};

/// The rule of an indexing-family op for its input and output metas.
pub(super) fn rule(op: &IndexOp, ins: &[TensorMeta], outs: &[TensorMeta]) -> Option<Rule> {
    let (ni, no) = (ins.len(), outs.len());
    let r = |dims: Vec<LogicalDim>, linear: Vec<Vec<usize>>| {
        Some(Rule { dims: dims.into_iter().filter(|l| l.size > 1).collect(), linear })
    };
    let linear_scatter = |red: &ScatterReduction| {
        if matches!(red, ScatterReduction::None | ScatterReduction::Add) { vec![vec![0, 2]] } else { vec![] }
    };
    // Dim `d` of input `i` for each `(i, d)`, and of output 0 at `o`.
    let dim = |name: String, size: usize, at: &[(usize, usize)], o: Option<usize>| {
        let mut l = ldim(name, size, ni, no);
        for &(i, d) in at {
            l.ins[i] = InMap::Dim(d);
        }
        l.outs[0] = o;
        l
    };
    match op {
        IndexOp::Trilu { .. } => {
            let rank = ins[0].rank();
            r(elementwise(ins, outs, &[rank - 2, rank - 1]), vec![vec![0]])
        }
        IndexOp::CumSum { axis, .. } => r(elementwise(ins, outs, &[*axis]), vec![vec![0]]),
        IndexOp::ArgMax { axis, keepdims, .. } | IndexOp::ArgMin { axis, keepdims, .. } => {
            let x = &ins[0].shape;
            let dims = (0..x.len())
                .filter(|d| d != axis)
                .map(|d| {
                    let o = if *keepdims || d < *axis { d } else { d - 1 };
                    dim(format!("d{d}"), x[d], &[(0, d)], Some(o))
                })
                .collect();
            r(dims, vec![])
        }
        IndexOp::TopK { axis, .. } => {
            let mut dims = elementwise(ins, &outs[..1], &[*axis]);
            for l in &mut dims {
                l.outs = vec![l.outs[0]; no];
            }
            r(dims, vec![])
        }
        IndexOp::GatherElements { axis } | IndexOp::ScatterElements { axis, .. } => {
            let (x, i) = (&ins[0].shape, &ins[1].shape);
            let dims = (0..x.len())
                .filter(|d| d != axis && x[*d] == i[*d])
                .map(|d| {
                    let at: Vec<(usize, usize)> = (0..ni).map(|k| (k, d)).collect();
                    dim(format!("d{d}"), x[d], &at, Some(d))
                })
                .collect();
            let linear = match op {
                IndexOp::ScatterElements { reduction, .. } => linear_scatter(reduction),
                _ => vec![vec![0]],
            };
            r(dims, linear)
        }
        IndexOp::GatherNd { batch_dims } => {
            let (x, i) = (&ins[0].shape, &ins[1].shape);
            let q = i[i.len() - 1];
            let lead = i.len() - 1;
            let mut dims: Vec<LogicalDim> = (0..lead)
                .map(|d| {
                    let at: &[(usize, usize)] = if d < *batch_dims { &[(0, d), (1, d)] } else { &[(1, d)] };
                    dim(format!("i{d}"), i[d], at, Some(d))
                })
                .collect();
            for j in batch_dims + q..x.len() {
                dims.push(dim(format!("d{j}"), x[j], &[(0, j)], Some(lead + j - batch_dims - q)));
            }
            r(dims, vec![vec![0]])
        }
        IndexOp::ScatterNd { reduction } => {
            let (x, i) = (&ins[0].shape, &ins[1].shape);
            let q = i[i.len() - 1];
            let lead = i.len() - 1;
            let dims =
                (q..x.len()).map(|j| dim(format!("d{j}"), x[j], &[(0, j), (2, lead + j - q)], Some(j))).collect();
            r(dims, linear_scatter(reduction))
        }
    }
}
