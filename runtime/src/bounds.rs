//! Bounds of the inputs that index something: token ids (the rows of an embedding table) and
//! class labels (the classes of a cross-entropy loss), checked where the data enters.
//!
//! The rule, per input: **ids that come from a fed input are data**. ONNX `Gather` wraps a
//! negative index (`-1` is the last row), which is what a model's own constant indices mean; a
//! token id of -1 or a label of 300 for 256 classes in a data file is a corrupt file, and a
//! gather that wrapped it, or read the neighbouring row of a flattened table, would train on
//! wrong data without a word. So every value of such an input must lie in `[0, bound)`; the
//! check runs on the host, on the tensors a step is fed (a `--feed` file, or each rank's block
//! of a `--data` batch), before any kernel, for training and evaluation steps alike and on every
//! back end (single device, ranks as threads or processes, GPUs), whether the gather is whole or
//! masked over a split table.
//!
//! An input is bounded when its values reach the index operand of a gather unchanged: through
//! reshapes, transposes, slices, expands, concatenations, splits, identities and casts. The
//! cross-entropy of [`ir::autodiff`] picks each row's label from the flattened log-probabilities
//! at `label + row * C`: an addition of the constant row offsets `[0, C, 2C, ...]` keeps the
//! labels' bound at `C`, the class count. Indices the model computes otherwise (position ids
//! from a `Range`, an offset added to an id) follow ONNX's rules in the kernels.

use std::collections::BTreeMap;

use ir::{BinaryOp, DType, Graph, IndexOp, NodeIndex, Op, Tensor, Value};

/// An input whose values index a table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexBound {
    /// The input.
    pub input: String,
    /// Every value must be in `[0, bound)`.
    pub bound: usize,
    /// What the values index (for the error): "the 256 classes of output logits".
    pub what: String,
}

/// The bounded inputs of `g` (at most one bound per input: the smallest).
pub fn index_bounds(g: &Graph) -> Vec<IndexBound> {
    let mut out: BTreeMap<String, IndexBound> = BTreeMap::new();
    for &i in &g.inputs {
        let Op::Input { name } = &g.node(i).op else { continue };
        if !is_integer(g.node(i).outputs[0].dtype) {
            continue;
        }
        let mut stack: Vec<(Value, Option<usize>)> = vec![(Value::new(i, 0), None)];
        let mut seen = std::collections::HashSet::new();
        while let Some((v, classes)) = stack.pop() {
            if !seen.insert((v, classes)) {
                continue;
            }
            for (user, slot) in g.users(v) {
                let node = g.node(user);
                let found = match (&node.op, slot) {
                    (Op::Gather { axis }, 1) => table_dim(g, user, 0, *axis).map(|d| {
                        let table = &g.node(g.node_inputs(user)[0].node).name;
                        match classes {
                            Some(c) => (c, format!("the {c} classes of a {d}-element table ({table})")),
                            None => (d, format!("the {d} rows of {table} (node {})", node.name)),
                        }
                    }),
                    (Op::Index(IndexOp::GatherElements { axis }), 1) => {
                        table_dim(g, user, 0, *axis).map(|d| (d, format!("the {d} entries of node {}", node.name)))
                    }
                    (op, _) if passes_values(op) => {
                        for k in 0..node.outputs.len() {
                            stack.push((Value::new(user, k), classes));
                        }
                        None
                    }
                    (Op::Binary(BinaryOp::Add), _) if classes.is_none() => {
                        let other = g.node_inputs(user)[1 - slot.min(1)];
                        if let Some(c) = row_offsets(g, other) {
                            stack.push((Value::new(user, 0), Some(c)));
                        }
                        None
                    }
                    _ => None,
                };
                if let Some((bound, what)) = found {
                    let e = out.entry(name.clone()).or_insert(IndexBound {
                        input: name.clone(),
                        bound,
                        what: what.clone(),
                    });
                    if bound < e.bound {
                        *e = IndexBound { input: name.clone(), bound, what };
                    }
                }
            }
        }
    }
    out.into_values().collect()
}

fn is_integer(d: DType) -> bool {
    matches!(d, DType::I64)
}

/// Ops whose outputs hold some of their inputs' values unchanged.
fn passes_values(op: &Op) -> bool {
    match op {
        Op::Reshape { .. }
        | Op::Identity
        | Op::Transpose { .. }
        | Op::Slice { .. }
        | Op::Expand { .. }
        | Op::Concat { .. }
        | Op::Split { .. } => true,
        Op::Cast { to } => is_integer(*to),
        _ => false,
    }
}

/// Dim `axis` of input `slot` of node `n`.
fn table_dim(g: &Graph, n: NodeIndex, slot: usize, axis: usize) -> Option<usize> {
    let v = *g.node_inputs(n).get(slot)?;
    g.meta(v).shape.get(axis).copied()
}

/// `C` when `v` is a constant `[0, C, 2C, ...]` (at least two rows, `C > 0`): the row offsets of a
/// flattened `[rows, C]` table.
fn row_offsets(g: &Graph, v: Value) -> Option<usize> {
    let Op::Constant(t) = &g.node(v.node).op else { return None };
    let x = t.as_i64()?;
    let c = *x.get(1)?;
    (c > 0 && x.iter().enumerate().all(|(r, &o)| o == r as i64 * c)).then_some(c as usize)
}

/// Checks the values of `t`, fed as input `b.input`, against the bound; the error names the
/// input, the first value outside and the bound.
pub fn check(b: &IndexBound, t: &Tensor) -> Result<(), String> {
    let bad = |at: usize, v: String| {
        Err(format!(
            "input {} holds {v} at element {at} of {}; its values index {}, so each must be in [0, {}) (ids and \
             labels from data are never wrapped)",
            b.input,
            t.meta(),
            b.what,
            b.bound
        ))
    };
    let bound = b.bound as i64;
    match t.data() {
        ir::Data::I64(v) => {
            if let Some((at, x)) = v.iter().enumerate().find(|(_, x)| **x < 0 || **x >= bound) {
                return bad(at, x.to_string());
            }
        }
        ir::Data::F32(v) => {
            if let Some((at, x)) = v.iter().enumerate().find(|(_, x)| !(**x >= 0.0 && (**x as i64) < bound)) {
                return bad(at, x.to_string());
            }
        }
        ir::Data::F64(v) => {
            if let Some((at, x)) = v.iter().enumerate().find(|(_, x)| !(**x >= 0.0 && (**x as i64) < bound)) {
                return bad(at, x.to_string());
            }
        }
        _ => {}
    }
    Ok(())
}

/// Refuses a NaN in a training step's input `name`: it makes every loss NaN, which would read as
/// a divergence ("try a smaller --lr") while the data is at fault. Infinities pass (additive
/// attention masks hold -inf).
pub fn check_no_nan(name: &str, t: &Tensor) -> Result<(), String> {
    let at = match t.data() {
        ir::Data::F32(v) => v.iter().position(|x| x.is_nan()),
        ir::Data::F64(v) => v.iter().position(|x| x.is_nan()),
        ir::Data::BF16(v) => v.iter().position(|x| x.is_nan()),
        ir::Data::F16(v) => v.iter().position(|x| x.is_nan()),
        _ => None,
    };
    match at {
        Some(at) => Err(format!(
            "input {name} holds NaN at element {at} of {}: a NaN in the data makes the loss NaN (check the data, not \
             the learning rate)",
            t.meta()
        )),
        None => Ok(()),
    }
}

/// Checks every fed tensor of `feeds` that a bound names.
pub fn check_all<'t>(
    bounds: &[IndexBound],
    feeds: impl IntoIterator<Item = (&'t str, &'t Tensor)>,
) -> Result<(), String> {
    for (name, t) in feeds {
        for b in bounds.iter().filter(|b| b.input == name) {
            check(b, t)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir::TensorMeta;

    #[test]
    fn token_ids_and_labels_are_bounded() {
        let mut g = Graph::new("lm");
        let ids = g.input("ids", TensorMeta::new(DType::I64, [2, 3]));
        let table = g.param("emb", TensorMeta::new(DType::F32, [10, 4]), None);
        let e = g.add1("embed", Op::Gather { axis: 0 }, &[table, ids]).unwrap();
        let flat = g.add1("flat", Op::Reshape { shape: vec![24] }, &[e]).unwrap();
        let labels = g.input("labels", TensorMeta::new(DType::I64, [4]));
        let off = g.constant("offsets", Tensor::i64([4], vec![0, 6, 12, 18]));
        let idx = g.add1("index", Op::Binary(BinaryOp::Add), &[labels, off]).unwrap();
        let picked = g.add1("picked", Op::Gather { axis: 0 }, &[flat, idx]).unwrap();
        g.set_output("y", picked);
        let b = index_bounds(&g);
        assert_eq!(b.iter().map(|b| (b.input.as_str(), b.bound)).collect::<Vec<_>>(), [("ids", 10), ("labels", 6)]);
        assert!(check(&b[0], &Tensor::i64([2, 3], vec![0, 1, 2, 3, 4, 9])).is_ok());
        let e = check(&b[0], &Tensor::i64([2, 3], vec![0, 1, -1, 3, 4, 9])).unwrap_err();
        assert!(e.contains("input ids holds -1 at element 2") && e.contains("[0, 10)"), "{e}");
        let e = check(&b[1], &Tensor::i64([4], vec![0, 6, 1, 1])).unwrap_err();
        assert!(e.contains("input labels holds 6") && e.contains("[0, 6)") && e.contains("6 classes"), "{e}");
    }
}
