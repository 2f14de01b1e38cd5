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

pub mod autodiff;
pub mod files;
mod graph;
mod op;
pub mod ops;
pub mod passes;
pub mod shape;
mod tensor;
mod text;
mod verify;

pub use graph::{Edge, Graph, GraphError, Node, Value};
pub use op::*;
pub use ops::index::{IndexOp, ScatterReduction};
pub use ops::resize::{CoordTransform, NearestMode, ResizeAttrs, ResizeAxis, ResizeMode};
pub use petgraph::stable_graph::NodeIndex;
pub use tensor::{DType, Data, ShapeDataMismatch, Tensor, TensorMeta, extend_fast, to_vec_fast};
pub use text::ParseError;
pub use verify::{VerifierError, VerifyErrors, verify};
