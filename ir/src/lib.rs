//! autopar's graph IR.
//!
//! A [`Graph`] is a petgraph `StableGraph` of [`Node`]s, each holding one [`Op`] from a closed
//! set and the [`TensorMeta`] (static shape and dtype) of every output. Edges carry which output
//! slot of the producer feeds which input slot of the consumer.
//!
//! Invariants kept by every pass and checked by [`verify`]:
//! - the graph is acyclic and every input slot `0..n` of a node is fed exactly once;
//! - every node's output metas equal what [`Op::infer`] computes from its inputs' metas;
//! - graph outputs name existing values; input and param names are unique.
//!
//! - training graphs ([`autodiff::training_graph`]) also list [`Graph::updates`]: each targets a
//!   param or state once, with a value of the same meta (the same storage after the step).
//!
//! Analysis results (strategies, live intervals, costs, training phases) live in side tables
//! keyed by [`NodeIndex`], never as fields on nodes.
//!
//! # Adding an op
//!
//! Ops come in families with the same name in every crate (`elementwise`, `activation`,
//! `linalg`, `conv`, `norm`, `shape`, `reduce`, `resize`, `index`, `training`, `random`,
//! `attention`); an op's code lives in its family's file of each stage, and the big matches (`Op::infer`, `vjp`,
//! `Importer::translate`, `strategy::rule`, the CPU and CUDA `eval`) only dispatch to them:
//!
//! | stage | file | provides |
//! |---|---|---|
//! | IR | `ir/src/op.rs` | the [`Op`] variant (or a variant of the family's enum, as [`IndexOp`]), its name and text form |
//! | inference | `ir/src/ops/<family>.rs` | output metas from input metas, every check an error naming the op, sizes checked ([`shape`]) |
//! | gradient | `ir/src/autodiff/<family>.rs` | input gradients from output gradients, built from existing ops |
//! | import | `tracer/src/ops.rs`, `tracer/src/import/<family>.rs` | one entry in `OP_TABLE` (the ONNX name and its family: `inspect --ops`, the importer's dispatch and `docs/ops.md` all come from it), then the ONNX node (attributes, opsets, constant operands) to IR ops in the family's method, or a rewrite into existing ops |
//! | sharding | `sharding/src/strategy/<family>.rs` | the op's logical dims (which input/output dims split together) and linear inputs |
//! | kernels | `kernels/src/cpu/<family>.rs`, `kernels/src/cuda/<family>.rs` | the CPU kernel (f32/f64/i64/bool as the op allows) and the CUDA one |
//!
//! The compiler points at each stage to fill in: the dispatchers of the per-op stages
//! ([`Op::infer`], [`Op::flops`], [`Op::num_outputs`], the gradient rule `vjp` and
//! [`autodiff`]'s list of differentiable ops, [`autocast::policy`], `strategy::rule` and
//! `strategy::local_op` in `sharding`, the CPU and CUDA `eval`) match every variant with no
//! wildcard arm, as do the per-kind choices inside them (unary and binary names, gradients and
//! linearity; indexing ops' gradients; the CPU and CUDA unary and bitwise kernels). A new variant is a compile error at each until it is
//! given its family's rule, or an explicit "none" (no gradient, replicated only, no FLOPs). The
//! families' own functions keep a last "dispatch bug" arm that their dispatcher never reaches.
//!
//! An op the importer can rewrite into existing ops (as `Einsum`, `GroupNormalization` or
//! `Pad`'s edge modes are) needs the import file only. The tests a new op adds: its ONNX node
//! suite cases (`tests/data/onnx-node`, selected by `tests/examples/select_node_cases.rs`), a
//! finite-difference case per gradient (`tests/tests/autodiff_fd.rs`), its CUDA kernel against
//! the CPU one on the emulated device (`kernels/tests/cuda.rs`), its strategies executed on
//! simulated ranks (`tests/tests/strategies.rs`), and a generator in the kernel fuzz against
//! tract (`tests/tests/kernel_fuzz.rs`).
//!
//! ```
//! use ir::{Graph, Op, BinaryOp, DType, TensorMeta};
//! let mut g = Graph::new("tiny");
//! let x = g.input("x", TensorMeta::new(DType::F32, [2, 3]));
//! let y = g.add_op("double", Op::Binary(BinaryOp::Add), &[x, x]).unwrap();
//! g.set_output("y", y[0]);
//! ir::verify(&g).unwrap();
//! let text = g.to_text();
//! assert_eq!(ir::Graph::parse(&text).unwrap().to_text(), text);
//! ```
#![warn(missing_docs)]

pub mod alloc;
pub mod autocast;
pub mod autodiff;
pub mod files;
mod graph;
mod json;
mod op;
pub mod ops;
pub mod params;
pub mod passes;
pub mod shape;
mod tensor;
mod text;
mod verify;

pub use alloc::AllocError;
pub use graph::{Edge, Graph, GraphError, Node, Value};
pub use half;
pub use op::*;
pub use ops::attention::{AttentionAttrs, AttentionDims};
pub use ops::index::{IndexOp, ScatterReduction};
pub use ops::moe::{MoeAct, MoeAttrs, MoeDims};
pub use ops::random::DropoutAttrs;
pub use ops::resize::{CoordTransform, NearestMode, ResizeAttrs, ResizeAxis, ResizeMode};
pub use petgraph::stable_graph::NodeIndex;
pub use tensor::{Accumulation, DType, Data, ShapeDataMismatch, Tensor, TensorMeta, extend_fast, to_vec_fast};
pub use text::ParseError;
pub use verify::{VerifierError, VerifyErrors, verify};
