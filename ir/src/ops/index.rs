//! The indexing family: ops that address elements by their position (ONNX `Trilu`, `ScatterND`,
//! `GatherND`, `GatherElements`, `ScatterElements`, `CumSum`, `ArgMax`, `ArgMin`, `TopK`).
//!
//! They share one [`crate::Op`] variant, [`crate::Op::Index`], so that each stage (inference
//! here, gradients in `autodiff/index.rs`, kernels in `kernels/src/{cpu,cuda}/index.rs`, sharding
//! in `sharding/src/strategy/index.rs`, import in `tracer/src/import/index.rs`) has one file and
//! one arm in its big match. Gradients need no op of their own: a gather's gradient is a
//! scatter-add into zeros, a scatter's a masked copy and a gather, a cumulative sum's the reverse
//! cumulative sum, a triangle's the same triangle.
//!
//! Indices are i64 and may be negative (counted from the end of their dim, as ONNX allows); a
//! data-dependent index out of range is a kernel error, not a wrapped read.

use crate::op::InferError;
use crate::tensor::{DType, TensorMeta};

/// How a scatter combines an update with the value already at its target.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScatterReduction {
    /// The update replaces the value (with duplicate targets, the last update in index order).
    None,
    /// Sum.
    Add,
    /// Product.
    Mul,
    /// Maximum.
    Max,
    /// Minimum.
    Min,
}

impl ScatterReduction {
    /// ONNX's attribute spelling (`none`, `add`, `mul`, `max`, `min`).
    pub fn name(self) -> &'static str {
        match self {
            ScatterReduction::None => "none",
            ScatterReduction::Add => "add",
            ScatterReduction::Mul => "mul",
            ScatterReduction::Max => "max",
            ScatterReduction::Min => "min",
        }
    }
    /// Parses [`ScatterReduction::name`].
    pub fn from_name(s: &str) -> Option<ScatterReduction> {
        Some(match s {
            "none" => ScatterReduction::None,
            "add" => ScatterReduction::Add,
            "mul" => ScatterReduction::Mul,
            "max" => ScatterReduction::Max,
            "min" => ScatterReduction::Min,
            _ => return None,
        })
    }
}

/// The ops of the indexing family (see the module docs). Attributes are static and normalised:
/// axes are non-negative and in range.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum IndexOp {
    /// Keeps the lower (`upper == false`: `j - i <= k`) or upper (`j - i >= k`) triangle of the
    /// last two dims and zeroes the rest. Input x of rank >= 2.
    Trilu {
        /// Keep the upper triangle.
        upper: bool,
        /// Diagonal offset (positive: above the main diagonal).
        k: i64,
    },
    /// ONNX `ScatterND`: inputs data, indices `[..., q]` (i64), updates `indices.shape[..-1] ++
    /// data.shape[q..]`; each index tuple addresses a slice of data that takes its update.
    ScatterNd {
        /// How an update combines with the target.
        reduction: ScatterReduction,
    },
    /// ONNX `GatherND`: inputs data, indices `[..., q]` (i64); output `indices.shape[..-1] ++
    /// data.shape[batch_dims + q..]`. The first `batch_dims` dims of data and indices are shared.
    GatherNd {
        /// Leading dims shared by data and indices.
        batch_dims: usize,
    },
    /// ONNX `GatherElements`: inputs data, indices (i64) of data's rank; `out[i] = data[i with
    /// dim axis replaced by indices[i]]`; output shape = indices shape.
    GatherElements {
        /// Indexed axis.
        axis: usize,
    },
    /// ONNX `ScatterElements`: inputs data, indices (i64), updates (indices' shape); the inverse
    /// walk of [`IndexOp::GatherElements`] writing into a copy of data.
    ScatterElements {
        /// Indexed axis.
        axis: usize,
        /// How an update combines with the target.
        reduction: ScatterReduction,
    },
    /// Cumulative sum along an axis (input x, numeric).
    CumSum {
        /// Summed axis.
        axis: usize,
        /// Element i excludes x\[i\] itself (the sum of the ones before it).
        exclusive: bool,
        /// Sum from the end of the axis.
        reverse: bool,
    },
    /// Index (i64) of the largest element along an axis (the first one, or the last with
    /// `select_last`). NaN counts as larger than every number.
    ArgMax {
        /// Reduced axis.
        axis: usize,
        /// Keep the axis as size 1.
        keepdims: bool,
        /// Ties pick the last index.
        select_last: bool,
    },
    /// Index (i64) of the smallest element along an axis; NaN counts as larger than every number.
    ArgMin {
        /// Reduced axis.
        axis: usize,
        /// Keep the axis as size 1.
        keepdims: bool,
        /// Ties pick the last index.
        select_last: bool,
    },
    /// The `k` largest (or smallest) elements along an axis, sorted, with their i64 indices (two
    /// outputs). Ties go to the lower index; NaN counts as larger than every number.
    TopK {
        /// Axis.
        axis: usize,
        /// Elements kept (static).
        k: usize,
        /// Largest rather than smallest.
        largest: bool,
    },
}

fn want_n(op: &str, ins: &[TensorMeta], n: usize) -> Result<(), InferError> {
    if ins.len() != n {
        return Err(format!("{op} takes {n} inputs, got {}", ins.len()));
    }
    Ok(())
}

fn want_indices(op: &str, m: &TensorMeta) -> Result<(), InferError> {
    if m.dtype != DType::I64 {
        return Err(format!("{op}: indices must be i64, got {}", m.dtype));
    }
    Ok(())
}

fn want_numeric(op: &str, m: &TensorMeta) -> Result<(), InferError> {
    if m.dtype == DType::Bool {
        return Err(format!("{op}: input must be numeric, got bool"));
    }
    Ok(())
}

fn want_axis(op: &str, axis: usize, m: &TensorMeta) -> Result<(), InferError> {
    if axis >= m.rank() {
        return Err(format!("{op}: axis {axis} out of range for {:?}", m.shape));
    }
    Ok(())
}

/// What `GatherND`/`ScatterND` index tuples address in data `d` with indices `i`: the tuple
/// length `q` and the dims of each addressed slice, or why they do not fit.
pub fn nd_parts(op: &str, d: &[usize], i: &[usize], batch_dims: usize) -> Result<(usize, Vec<usize>), InferError> {
    let Some(&q) = i.last() else {
        return Err(format!("{op}: indices must have rank >= 1"));
    };
    if batch_dims >= i.len() || batch_dims > d.len() || d[..batch_dims] != i[..batch_dims] {
        return Err(format!("{op}: batch_dims {batch_dims} do not match data {d:?} and indices {i:?}"));
    }
    if batch_dims + q > d.len() {
        return Err(format!("{op}: index tuples of {q} exceed the {} dims of data {d:?}", d.len() - batch_dims));
    }
    Ok((q, d[batch_dims + q..].to_vec()))
}

impl IndexOp {
    /// The op's name in the text form.
    pub fn name(&self) -> &'static str {
        match self {
            IndexOp::Trilu { upper: false, .. } => "tril",
            IndexOp::Trilu { upper: true, .. } => "triu",
            IndexOp::ScatterNd { .. } => "scatter_nd",
            IndexOp::GatherNd { .. } => "gather_nd",
            IndexOp::GatherElements { .. } => "gather_elements",
            IndexOp::ScatterElements { .. } => "scatter_elements",
            IndexOp::CumSum { .. } => "cumsum",
            IndexOp::ArgMax { .. } => "argmax",
            IndexOp::ArgMin { .. } => "argmin",
            IndexOp::TopK { .. } => "topk",
        }
    }

    /// Every text-form name, for parsing.
    pub const NAMES: [&'static str; 10] = [
        "tril",
        "triu",
        "scatter_nd",
        "gather_nd",
        "gather_elements",
        "scatter_elements",
        "cumsum",
        "argmax",
        "argmin",
        "topk",
    ];

    /// Number of outputs.
    pub fn num_outputs(&self) -> usize {
        if matches!(self, IndexOp::TopK { .. }) { 2 } else { 1 }
    }

    /// Output metas for the given input metas, or why they are invalid.
    pub fn infer(&self, ins: &[TensorMeta]) -> Result<Vec<TensorMeta>, InferError> {
        let n = self.name();
        match self {
            IndexOp::Trilu { .. } => {
                want_n(n, ins, 1)?;
                if ins[0].rank() < 2 {
                    return Err(format!("{n}: input must have rank >= 2, got {:?}", ins[0].shape));
                }
                Ok(vec![ins[0].clone()])
            }
            IndexOp::GatherNd { batch_dims } => {
                want_n(n, ins, 2)?;
                want_indices(n, &ins[1])?;
                let (d, i) = (&ins[0].shape, &ins[1].shape);
                let (_, slice) = nd_parts(n, d, i, *batch_dims)?;
                let mut s = i[..i.len() - 1].to_vec();
                s.extend(slice);
                Ok(vec![TensorMeta::new(ins[0].dtype, s)])
            }
            IndexOp::ScatterNd { reduction } => {
                want_n(n, ins, 3)?;
                want_indices(n, &ins[1])?;
                let (d, i, u) = (&ins[0].shape, &ins[1].shape, &ins[2]);
                if u.dtype != ins[0].dtype {
                    return Err(format!("{n}: updates are {} but data is {}", u.dtype, ins[0].dtype));
                }
                if *reduction != ScatterReduction::None {
                    want_numeric(n, &ins[0])?;
                }
                let (_, slice) = nd_parts(n, d, i, 0)?;
                let mut want = i[..i.len() - 1].to_vec();
                want.extend(slice);
                if u.shape != want {
                    return Err(format!("{n}: updates {:?} must be {want:?} for data {d:?}, indices {i:?}", u.shape));
                }
                Ok(vec![ins[0].clone()])
            }
            IndexOp::GatherElements { axis } => {
                want_n(n, ins, 2)?;
                want_indices(n, &ins[1])?;
                want_axis(n, *axis, &ins[0])?;
                elements_fit(n, &ins[0].shape, &ins[1].shape, *axis)?;
                Ok(vec![TensorMeta::new(ins[0].dtype, ins[1].shape.clone())])
            }
            IndexOp::ScatterElements { axis, reduction } => {
                want_n(n, ins, 3)?;
                want_indices(n, &ins[1])?;
                want_axis(n, *axis, &ins[0])?;
                if ins[2].dtype != ins[0].dtype || ins[2].shape != ins[1].shape {
                    return Err(format!("{n}: updates {} must have data's type and the indices' shape", ins[2]));
                }
                if *reduction != ScatterReduction::None {
                    want_numeric(n, &ins[0])?;
                }
                elements_fit(n, &ins[0].shape, &ins[1].shape, *axis)?;
                Ok(vec![ins[0].clone()])
            }
            IndexOp::CumSum { axis, .. } => {
                want_n(n, ins, 1)?;
                want_numeric(n, &ins[0])?;
                want_axis(n, *axis, &ins[0])?;
                Ok(vec![ins[0].clone()])
            }
            IndexOp::ArgMax { axis, keepdims, .. } | IndexOp::ArgMin { axis, keepdims, .. } => {
                want_n(n, ins, 1)?;
                want_numeric(n, &ins[0])?;
                want_axis(n, *axis, &ins[0])?;
                if ins[0].shape[*axis] == 0 {
                    return Err(format!("{n}: axis {axis} of {:?} is empty", ins[0].shape));
                }
                let s = crate::op::reduced_shape(&ins[0].shape, &[*axis], *keepdims);
                Ok(vec![TensorMeta::new(DType::I64, s)])
            }
            IndexOp::TopK { axis, k, .. } => {
                want_n(n, ins, 1)?;
                want_numeric(n, &ins[0])?;
                want_axis(n, *axis, &ins[0])?;
                if *k > ins[0].shape[*axis] {
                    return Err(format!("{n}: k={k} exceeds axis {axis} of {:?}", ins[0].shape));
                }
                let mut s = ins[0].shape.clone();
                s[*axis] = *k;
                Ok(vec![TensorMeta::new(ins[0].dtype, s.clone()), TensorMeta::new(DType::I64, s)])
            }
        }
    }

    /// Whether gradients flow through the op at all (never to the indices; an arg-reduction's
    /// output is an index; a scatter with a reduction other than none or add has no rule).
    pub fn differentiable(&self) -> bool {
        match self {
            IndexOp::ArgMax { .. } | IndexOp::ArgMin { .. } => false,
            IndexOp::ScatterNd { reduction } | IndexOp::ScatterElements { reduction, .. } => {
                matches!(reduction, ScatterReduction::None | ScatterReduction::Add)
            }
            // Listed one by one (no wildcard), so a new indexing op decides here.
            IndexOp::Trilu { .. }
            | IndexOp::GatherNd { .. }
            | IndexOp::GatherElements { .. }
            | IndexOp::CumSum { .. }
            | IndexOp::TopK { .. } => true,
        }
    }
}

/// `GatherElements`/`ScatterElements`: indices of data's rank, no larger than data off the axis.
fn elements_fit(op: &str, d: &[usize], i: &[usize], axis: usize) -> Result<(), InferError> {
    if d.len() != i.len() || (0..d.len()).any(|k| k != axis && i[k] > d[k]) {
        return Err(format!("{op}: indices {i:?} do not fit data {d:?} off axis {axis}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Graph, Op};

    fn f(shape: &[usize]) -> TensorMeta {
        TensorMeta::new(DType::F32, shape)
    }
    fn i(shape: &[usize]) -> TensorMeta {
        TensorMeta::new(DType::I64, shape)
    }

    #[test]
    fn shapes_follow_onnx() {
        let gnd = IndexOp::GatherNd { batch_dims: 1 };
        assert_eq!(gnd.infer(&[f(&[2, 3, 4, 5]), i(&[2, 7, 2])]).unwrap(), vec![f(&[2, 7, 5])]);
        let gnd0 = IndexOp::GatherNd { batch_dims: 0 };
        assert_eq!(gnd0.infer(&[f(&[2, 3]), i(&[4, 2])]).unwrap(), vec![f(&[4])]);
        let snd = IndexOp::ScatterNd { reduction: ScatterReduction::None };
        assert_eq!(snd.infer(&[f(&[4, 4, 4]), i(&[2, 1]), f(&[2, 4, 4])]).unwrap(), vec![f(&[4, 4, 4])]);
        assert!(snd.infer(&[f(&[4, 4, 4]), i(&[2, 1]), f(&[2, 4])]).unwrap_err().contains("updates"));
        assert!(gnd0.infer(&[f(&[2, 3]), i(&[4, 3])]).unwrap_err().contains("exceed"));
        let ge = IndexOp::GatherElements { axis: 1 };
        assert_eq!(ge.infer(&[f(&[3, 3]), i(&[2, 5])]).unwrap(), vec![f(&[2, 5])]);
        assert!(ge.infer(&[f(&[3, 3]), i(&[4, 5])]).is_err());
        let am = IndexOp::ArgMax { axis: 1, keepdims: false, select_last: false };
        assert_eq!(am.infer(&[f(&[2, 3, 4])]).unwrap(), vec![i(&[2, 4])]);
        assert!(am.infer(&[f(&[2, 0, 4])]).unwrap_err().contains("empty"));
        let tk = IndexOp::TopK { axis: 0, k: 2, largest: true };
        assert_eq!(tk.infer(&[f(&[3, 4])]).unwrap(), vec![f(&[2, 4]), i(&[2, 4])]);
        assert!(tk.infer(&[f(&[1, 4])]).unwrap_err().contains("exceeds"));
        assert!(IndexOp::Trilu { upper: true, k: 0 }.infer(&[f(&[3])]).is_err());
        assert!(
            IndexOp::CumSum { axis: 0, exclusive: false, reverse: false }
                .infer(&[TensorMeta::new(DType::Bool, [2])])
                .is_err()
        );
        let bad_idx = IndexOp::GatherElements { axis: 0 }.infer(&[f(&[3]), f(&[3])]).unwrap_err();
        assert!(bad_idx.contains("i64"), "{bad_idx}");
    }

    #[test]
    fn every_op_round_trips_through_the_text_form() {
        use ScatterReduction as R;
        let mut g = Graph::new("index");
        let x = g.input("x", f(&[3, 4]));
        let idx = g.input("i", i(&[3, 4]));
        let nd = g.input("nd", i(&[2, 1]));
        let ops = [
            (IndexOp::Trilu { upper: false, k: -1 }, vec![x]),
            (IndexOp::Trilu { upper: true, k: 2 }, vec![x]),
            (IndexOp::GatherNd { batch_dims: 0 }, vec![x, nd]),
            (IndexOp::GatherElements { axis: 1 }, vec![x, idx]),
            (IndexOp::ScatterElements { axis: 0, reduction: R::Max }, vec![x, idx, x]),
            (IndexOp::CumSum { axis: 1, exclusive: true, reverse: false }, vec![x]),
            (IndexOp::ArgMax { axis: 0, keepdims: true, select_last: true }, vec![x]),
            (IndexOp::ArgMin { axis: 1, keepdims: false, select_last: false }, vec![x]),
            (IndexOp::TopK { axis: 1, k: 2, largest: false }, vec![x]),
        ];
        for (k, (op, ins)) in ops.into_iter().enumerate() {
            let outs = g.add_op(&format!("n{k}"), Op::Index(op), &ins).unwrap();
            g.set_output(&format!("y{k}"), outs[0]);
        }
        let rows = g.add_op("rows", Op::Index(IndexOp::GatherNd { batch_dims: 0 }), &[x, nd]).unwrap();
        let s = g.add_op("s", Op::Index(IndexOp::ScatterNd { reduction: R::Add }), &[x, nd, rows[0]]).unwrap();
        g.set_output("s", s[0]);
        crate::verify(&g).unwrap();
        let text = g.to_text();
        assert!(text.contains("tril{k=-1}") && text.contains("reduction=\"max\""), "{text}");
        assert_eq!(Graph::parse(&text).unwrap().to_text(), text);
        assert!(Graph::parse(&text.replace("\"max\"", "\"sum\"")).unwrap_err().message.contains("unknown reduction"));
    }
}
