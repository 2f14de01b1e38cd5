//! ONNX import into autopar's IR.
//!
//! [`import_file`] reads an ONNX model through tract-onnx's protobuf types and produces an
//! [`ir::Graph`] in which every shape is static and no node computes a shape:
//! - graph inputs get their dims from the model, or from [`ImportOptions::input_shapes`]
//!   (`--input NAME=2x128`); a dim left unbound is an error naming the input;
//! - float initializers (of any precision) become trainable [`ir::Op::Param`]s (their data in
//!   `param_data`), other initializers and `Constant` nodes become constants;
//! - element types: every ONNX integer type is held as i64, float16/bfloat16/float64 as f32,
//!   bool as bool; casts of constants are exact (wrapping, rounding to half precision); the table
//!   and the limits are in `dtype.rs`;
//! - every node whose inputs are all constant is evaluated at import (shape arithmetic: `Shape`,
//!   `Gather`/`Slice`/`Concat`/`Unsqueeze` on shapes, `ConstantOfShape`, `Range`, `Cast`, ...),
//!   and inputs that must be static (reshape targets, split sizes, slice bounds, expand shapes,
//!   reduction axes, pads) are read from those constants into op attributes. Nodes of ops autopar
//!   has no kernel for (Trilu, Mod, ScatterND, CumSum, ...) are evaluated through tract's ONNX evaluator when all their inputs are known (`fold.rs`),
//!   within [`ImportOptions::max_constant_bytes`]; trainable parameters are never folded;
//! - a model's local functions (`ModelProto.functions`, which the dynamo exporter writes) are
//!   inlined before import (`functions.rs`), and tensor sequences whose structure is static
//!   (`SplitToSequence` read by `SequenceAt` at constant positions, ...) become the tensor ops
//!   they stand for (`import/sequence.rs`);
//! - [`shared_parameters`] lists parameters read in the same role by several nodes (what an
//!   eval-mode export's merging of equal initializers leaves), logged as a warning at import;
//! - weight-free models (initializer data absent, external data file missing) import with shapes
//!   only; a `ConstantOfShape` that feeds a weight operand (the topology-only model convention)
//!   becomes a weight-free parameter rather than a materialised fill.
//!
//! - `LSTM`, `GRU` and `RNN` are unrolled over time into matrix products, activations and
//!   elementwise ops (`import/recurrent.rs`: every direction, layout, activation and clip, initial
//!   states, peepholes, constant `sequence_lens`);
//! - convolution and pooling are 2-D in the IR: 1-D `Conv`/`ConvTranspose`/pooling get a unit
//!   height, 3-D pooling is two separable 2-D pools, `ConvTranspose` is the IR's convolution
//!   input gradient, `DepthToSpace`/`SpaceToDepth` are reshape-transpose-reshape, `Upsample` is a
//!   `Resize` (see `import/conv.rs` and `import/resize.rs` for the forms and what is not supported).
//!
//! An ONNX op outside [`SUPPORTED_OPS`] whose inputs are not all known at import is an error
//! naming the node and its op type.
//!
//! Adding an op: its import goes in `src/import/<family>.rs` (one method per family,
//! `Importer::translate` only dispatches), its name and family at the end of the table in
//! `src/ops.rs` (from which [`SUPPORTED_OPS`], the dispatch and `docs/ops.md` follow); the other
//! stages and the tests to add are listed in `ir`'s crate docs ("Adding an op").
#![warn(missing_docs)]

mod dtype;
pub mod export;
mod fold;
mod functions;
pub mod generate;
mod import;
mod ops;
mod proto;
pub mod shards;
mod tied;

pub use dtype::held_dtype;
pub use import::{
    DEFAULT_MAX_CONSTANT_BYTES, ImportNotes, ImportOptions, import_bytes, import_bytes_noted, import_file,
    import_file_noted, is_exporter_constant, parse_input_binding,
};
pub use proto::{MAX_MODEL_BYTES, dtype_name, read_tensor_file, tensor_from_proto};
pub use shards::InitializerIndex;
pub use tied::{SharedParameter, TIED_ADVICE, shared_parameters};

use std::path::PathBuf;

/// ONNX ops (default domain) the importer accepts: the names of the table in `src/ops.rs`
/// (listed in `docs/ops.md`).
pub const SUPPORTED_OPS: &[&str] = &ops::OP_NAMES;

/// Why a model could not be imported. Every variant is a problem with the user's model or
/// options except [`ImportError::Internal`].
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    /// The file could not be read.
    #[error("cannot read {path}: {cause}")]
    Io {
        /// File.
        path: PathBuf,
        /// Cause.
        cause: std::io::Error,
    },
    /// The bytes are not an ONNX model.
    #[error("{path} is not a valid ONNX model: {message}")]
    Decode {
        /// File.
        path: String,
        /// Decoder message.
        message: String,
    },
    /// A node uses an op outside the supported set.
    #[error("node {node}: op {op_type}{} is not supported (see `autopar inspect --ops` for the supported list)",
        if domain.is_empty() { String::new() } else { format!(" (domain {domain})") })]
    UnsupportedOp {
        /// Node name.
        node: String,
        /// ONNX op type.
        op_type: String,
        /// ONNX domain.
        domain: String,
    },
    /// A node's output shape depends on the values it reads (`NonZero`, `Unique`, a branch or a
    /// loop decided at run time): autopar plans with every shape known before running.
    #[error(
        "node {node}: op {op_type} {what}; autopar plans every op and shape before running, so the model must be \
         exported without it: {instead}"
    )]
    DataDependent {
        /// Node name.
        node: String,
        /// ONNX op type.
        op_type: String,
        /// What it does that depends on the values.
        what: String,
        /// What to export instead.
        instead: String,
    },
    /// A graph input has a dynamic dim that nothing binds.
    #[error("input {input} has dynamic dim {dim} ({dim_name}); bind it with --input {input}={example}")]
    UnboundDim {
        /// Input name.
        input: String,
        /// Dim index.
        dim: usize,
        /// Symbolic name in the model.
        dim_name: String,
        /// An example binding with the known dims filled in.
        example: String,
    },
    /// A binding names no graph input, or disagrees with the model's static dims.
    #[error("--input {name}: {message}")]
    BadBinding {
        /// Input name.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// A node is malformed or its inputs do not fit it.
    #[error("node {node} ({op_type}): {message}")]
    Node {
        /// Node name.
        node: String,
        /// ONNX op type.
        op_type: String,
        /// What is wrong.
        message: String,
    },
    /// A tensor has an element type autopar does not handle.
    #[error(
        "tensor {tensor}: element type {dtype} is not supported (integer, float16, bfloat16, float32, float64 and bool are)"
    )]
    UnsupportedDType {
        /// Tensor name.
        tensor: String,
        /// ONNX type name.
        dtype: String,
    },
    /// A tensor's data is inconsistent with its declared shape.
    #[error("tensor {tensor}: {message}")]
    BadTensor {
        /// Tensor name.
        tensor: String,
        /// What is wrong.
        message: String,
    },
    /// The imported graph failed verification (a bug in the importer).
    #[error("internal error: imported graph is invalid: {0}")]
    Internal(String),
}
