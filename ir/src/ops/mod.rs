//! Op families kept in files of their own: attributes, shape inference and the helpers their
//! kernels share. An op family added here gets one arm per giant match in `op.rs` (name,
//! inference, FLOPs), `text.rs` and `autodiff.rs`, each delegating to its file.

pub(crate) mod norm;
pub mod resize;
pub mod activation;
