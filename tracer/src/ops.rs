//! The one table of supported ONNX ops: each op's name and the family of the importer that
//! translates it. [`crate::SUPPORTED_OPS`] (what `autopar inspect --ops` prints), the importer's
//! dispatch (`Importer::translate`) and `docs/ops.md` (checked by a test) all come from it, so
//! adding an op is one entry here plus its arm in the family's method.

/// The importer method (`src/import/<family>.rs`) that translates an op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Family {
    /// `translate_elementwise` (`import/elementwise.rs`).
    Elementwise,
    /// `translate_shape` (`import/shape.rs`).
    Shape,
    /// `translate_linalg` (`import/linalg.rs`).
    Linalg,
    /// `translate_conv` (`import/conv.rs`).
    Conv,
    /// `translate_norm` (`import/norm.rs`).
    Norm,
    /// `translate_reduce` (`import/reduce.rs`).
    Reduce,
    /// `conv_transpose` (`import/conv.rs`).
    ConvTranspose,
    /// `resize` (`import/resize.rs`).
    Resize,
    /// `upsample` (`import/resize.rs`).
    Upsample,
    /// `pixel_shuffle` towards depth to space (`import/conv.rs`).
    DepthToSpace,
    /// `pixel_shuffle` towards space to depth (`import/conv.rs`).
    SpaceToDepth,
    /// `translate_activation` (`import/activation.rs`).
    Activation,
    /// `translate_index` (`import/index.rs`).
    Index,
    /// `translate_loss` (`import/loss.rs`).
    Loss,
    /// `swish` (`import/activation.rs`).
    Swish,
    /// `translate_recurrent` (`import/recurrent.rs`).
    Recurrent,
    /// Sequence ops, handled before dispatch by `sequence_node` (`import/sequence.rs`).
    Sequence,
}

/// Every supported op (default domain) and its family, in the order of [`crate::SUPPORTED_OPS`]
/// (alphabetical, then the later additions).
pub(crate) const OP_TABLE: &[(&str, Family)] = &[
    ("Abs", Family::Elementwise),
    ("Add", Family::Elementwise),
    ("And", Family::Elementwise),
    ("AveragePool", Family::Conv),
    ("BatchNormalization", Family::Norm),
    ("Cast", Family::Elementwise),
    ("CastLike", Family::Elementwise),
    ("Ceil", Family::Elementwise),
    ("Clip", Family::Elementwise),
    ("Concat", Family::Shape),
    ("Constant", Family::Shape),
    ("ConstantOfShape", Family::Shape),
    ("Conv", Family::Conv),
    ("Cos", Family::Elementwise),
    ("Div", Family::Elementwise),
    ("Dropout", Family::Elementwise),
    ("Equal", Family::Elementwise),
    ("Erf", Family::Elementwise),
    ("Exp", Family::Elementwise),
    ("Expand", Family::Shape),
    ("Flatten", Family::Shape),
    ("Floor", Family::Elementwise),
    ("Gather", Family::Shape),
    ("Gelu", Family::Elementwise),
    ("Gemm", Family::Linalg),
    ("GlobalAveragePool", Family::Conv),
    ("GlobalMaxPool", Family::Conv),
    ("Greater", Family::Elementwise),
    ("GreaterOrEqual", Family::Elementwise),
    ("Identity", Family::Elementwise),
    ("LRN", Family::Norm),
    ("LayerNormalization", Family::Norm),
    ("Less", Family::Elementwise),
    ("LessOrEqual", Family::Elementwise),
    ("Log", Family::Elementwise),
    ("LogSoftmax", Family::Norm),
    ("MatMul", Family::Linalg),
    ("Max", Family::Elementwise),
    ("MaxPool", Family::Conv),
    ("Mean", Family::Elementwise),
    ("Min", Family::Elementwise),
    ("Mul", Family::Elementwise),
    ("Neg", Family::Elementwise),
    ("Not", Family::Elementwise),
    ("Or", Family::Elementwise),
    ("Pad", Family::Shape),
    ("Pow", Family::Elementwise),
    ("Range", Family::Shape),
    ("Reciprocal", Family::Elementwise),
    ("ReduceL1", Family::Reduce),
    ("ReduceL2", Family::Reduce),
    ("ReduceLogSum", Family::Reduce),
    ("ReduceLogSumExp", Family::Reduce),
    ("ReduceMax", Family::Reduce),
    ("ReduceMean", Family::Reduce),
    ("ReduceMin", Family::Reduce),
    ("ReduceProd", Family::Reduce),
    ("ReduceSum", Family::Reduce),
    ("ReduceSumSquare", Family::Reduce),
    ("Relu", Family::Elementwise),
    ("Reshape", Family::Shape),
    ("Shape", Family::Shape),
    ("Sigmoid", Family::Elementwise),
    ("Sign", Family::Elementwise),
    ("Sin", Family::Elementwise),
    ("Size", Family::Shape),
    ("Slice", Family::Shape),
    ("Softmax", Family::Norm),
    ("Split", Family::Shape),
    ("Sqrt", Family::Elementwise),
    ("Squeeze", Family::Shape),
    ("Sub", Family::Elementwise),
    ("Sum", Family::Elementwise),
    ("Tanh", Family::Elementwise),
    ("Transpose", Family::Shape),
    ("Unsqueeze", Family::Shape),
    ("Where", Family::Elementwise),
    ("Xor", Family::Elementwise),
    ("ConvTranspose", Family::ConvTranspose),
    ("DepthToSpace", Family::DepthToSpace),
    ("Resize", Family::Resize),
    ("SpaceToDepth", Family::SpaceToDepth),
    ("Upsample", Family::Upsample),
    ("InstanceNormalization", Family::Norm),
    ("GroupNormalization", Family::Norm),
    ("MeanVarianceNormalization", Family::Norm),
    ("LpNormalization", Family::Norm),
    ("RMSNormalization", Family::Norm),
    ("HardSigmoid", Family::Activation),
    ("HardSwish", Family::Activation),
    ("LeakyRelu", Family::Activation),
    ("Elu", Family::Activation),
    ("Selu", Family::Activation),
    ("Celu", Family::Activation),
    ("Softplus", Family::Activation),
    ("Softsign", Family::Activation),
    ("Mish", Family::Activation),
    ("ThresholdedRelu", Family::Activation),
    ("Shrink", Family::Activation),
    ("Round", Family::Activation),
    ("IsNaN", Family::Activation),
    ("IsInf", Family::Activation),
    ("Tan", Family::Activation),
    ("Acos", Family::Activation),
    ("Asin", Family::Activation),
    ("Atan", Family::Activation),
    ("Sinh", Family::Activation),
    ("Cosh", Family::Activation),
    ("Asinh", Family::Activation),
    ("Acosh", Family::Activation),
    ("Atanh", Family::Activation),
    ("BitwiseNot", Family::Activation),
    ("PRelu", Family::Activation),
    ("BitwiseAnd", Family::Activation),
    ("BitwiseOr", Family::Activation),
    ("BitwiseXor", Family::Activation),
    ("Hardmax", Family::Activation),
    ("Trilu", Family::Index),
    ("ScatterND", Family::Index),
    ("CumSum", Family::Index),
    ("ArgMax", Family::Index),
    ("ArgMin", Family::Index),
    ("Mod", Family::Index),
    ("GatherND", Family::Index),
    ("Tile", Family::Index),
    ("GatherElements", Family::Index),
    ("ScatterElements", Family::Index),
    ("TopK", Family::Index),
    ("OneHot", Family::Index),
    ("EyeLike", Family::Index),
    ("Einsum", Family::Index),
    ("ConcatFromSequence", Family::Sequence),
    ("SequenceAt", Family::Sequence),
    ("SequenceConstruct", Family::Sequence),
    ("SequenceEmpty", Family::Sequence),
    ("SequenceErase", Family::Sequence),
    ("SequenceInsert", Family::Sequence),
    ("SequenceLength", Family::Sequence),
    ("SplitToSequence", Family::Sequence),
    ("NegativeLogLikelihoodLoss", Family::Loss),
    ("SoftmaxCrossEntropyLoss", Family::Loss),
    ("Swish", Family::Swish),
    ("LSTM", Family::Recurrent),
    ("GRU", Family::Recurrent),
    ("RNN", Family::Recurrent),
    ("Attention", Family::Linalg),
];

/// The names of [`OP_TABLE`], in its order.
pub(crate) const OP_NAMES: [&str; OP_TABLE.len()] = names();

const fn names<const N: usize>() -> [&'static str; N] {
    let mut out = [""; N];
    let mut i = 0;
    while i < N {
        out[i] = OP_TABLE[i].0;
        i += 1;
    }
    out
}

/// The family of a supported op, `None` for an op outside the table.
pub(crate) fn family(op_type: &str) -> Option<Family> {
    OP_TABLE.iter().find(|(name, _)| *name == op_type).map(|&(_, f)| f)
}

#[cfg(test)]
/// The text of `docs/ops.md`: every supported op and the file that imports it.
pub(crate) fn ops_page() -> String {
    let mut s = String::from(
        "# Supported ONNX ops\n\n\
         The ONNX ops (default domain) the importer translates, as `autopar inspect --ops` lists \
         them. This page is generated from the table in `tracer/src/ops.rs` and checked by a test \
         (`cargo test -p tracer ops_page`; `AUTOPAR_BLESS=1` rewrites it).\n\n\
         | op | imported in |\n|---|---|\n",
    );
    for &(name, f) in OP_TABLE {
        s.push_str(&format!("| `{name}` | `tracer/src/import/{}` |\n", file(f)));
    }
    s
}

/// The importer file of a family.
#[cfg(test)]
fn file(f: Family) -> &'static str {
    match f {
        Family::Elementwise => "elementwise.rs",
        Family::Shape => "shape.rs",
        Family::Linalg => "linalg.rs",
        Family::Conv | Family::ConvTranspose | Family::DepthToSpace | Family::SpaceToDepth => "conv.rs",
        Family::Norm => "norm.rs",
        Family::Reduce => "reduce.rs",
        Family::Resize | Family::Upsample => "resize.rs",
        Family::Activation | Family::Swish => "activation.rs",
        Family::Index => "index.rs",
        Family::Loss => "loss.rs",
        Family::Recurrent => "recurrent.rs",
        Family::Sequence => "sequence.rs",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn op_names_are_unique() {
        let mut seen = std::collections::HashSet::new();
        for name in OP_NAMES {
            assert!(seen.insert(name), "{name} is in the table twice");
        }
    }

    /// `docs/ops.md` is the table's: regenerate it with `AUTOPAR_BLESS=1`.
    #[test]
    fn ops_page_matches_the_table() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/ops.md");
        let want = ops_page();
        if std::env::var_os("AUTOPAR_BLESS").is_some() {
            std::fs::write(&path, &want).unwrap();
        }
        let have = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            have == want,
            "docs/ops.md differs from tracer/src/ops.rs: run `AUTOPAR_BLESS=1 cargo test -p tracer ops_page`"
        );
    }
}
