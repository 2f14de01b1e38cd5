//! Planning: from a training graph, a device mesh and a memory budget to a distributed plan.
//!
//! `problem` builds the solver's cost graph (strategies per op from `sharding`, layout-conversion
//! costs per edge, live intervals, parameter/update ties), `plan` solves it and lowers the choice
//! into one SPMD program with inserted collectives and frees (a [`Plan`] of the `plan` crate,
//! the format the runtime reads: re-exported here with its verifier and liveness walk),
//! `explain` renders a plan for people (with `figures`, its pictures).
//!
//! Invariants: every cost is seconds (the solver sees picoseconds); memory is the liveness peak
//! in bytes per rank; a parameter and its updated value always get the same spec; the plan the
//! solver returns with `auto` is never costlier (by the same model) than the manual baselines
//! (`dp`, `megatron`, `zero`) that fit, because those are solved too and are feasible plans of
//! the same problem.
#![warn(missing_docs)]

pub mod bound;
pub mod checkpoint;
mod error;
pub mod explain;
pub mod figures;
pub mod microbatch;
pub mod pipeline;
pub mod plan;
pub mod problem;
pub mod schedule;
pub mod svg;

/// The liveness walk of a program (in the `plan` crate, re-exported).
pub use ::plan::memory;
/// The plan's verifier (in the `plan` crate, re-exported).
pub use ::plan::validate;

pub use error::{Error, Result, fmt_bytes, parse_bytes};
pub use plan::{ModelInfo, Plan, PlanOptions, Recompute, check_layout, label, plan, precision_of};
pub use problem::Baseline;
