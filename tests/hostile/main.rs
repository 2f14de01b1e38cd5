//! Hostile and accidental inputs to the `autopar` binary (issue: no panic, no hang, no unbounded
//! allocation, no silent wrong result).
//!
//! Every case runs the binary under a memory cap (`ulimit -v`) and a time cap and asserts the
//! clean-failure contract: a non-zero exit (not a signal), exactly one line on stderr starting
//! with `error:` that names the problem, and no panic text. Inputs are crafted here (ONNX models
//! through tract-onnx's protobuf types and prost, plan.json edits, .npy bytes, flags), one module
//! per class of input.

mod alloc;
mod common;
mod files;
mod flags;
mod plans;
mod probe2;
mod shapes;
