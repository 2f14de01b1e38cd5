//! Op families kept in files of their own (issue 16): attributes, shape inference and the helpers
//! their kernels share. An op family added here gets one short arm per giant match in `op.rs`
//! (name, inference, FLOPs), `text.rs` and `autodiff.rs`, each delegating to its file; the family's
//! other stages live in files of the same name in `autodiff/`, `tracer`, `sharding` and `kernels`.

pub mod activation;
pub mod attention;
pub(crate) mod conv;
pub(crate) mod elementwise;
pub mod index;
pub(crate) mod linalg;
pub mod moe;
pub(crate) mod norm;
pub mod random;
pub(crate) mod reduce;
pub mod resize;
pub(crate) mod shape;
pub(crate) mod training;
