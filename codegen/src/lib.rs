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
//!
//! # Adding a pipeline schedule
//!
//! A schedule is a `ScheduleKind` (the `plan` crate's) and the order of each stage's steps
//! (`Step`: a microbatch, a model chunk, a phase) that [`schedule::steps`] gives for it. The
//! plan stores the steps themselves (`Schedule::steps`), so the validator and the runtime play
//! any order; what matches on the kind is listed here:
//!
//! | step | file | what to do | what checks it |
//! |---|---|---|---|
//! | kind | `codegen/plan/src/lib.rs`, `codegen/plan/plan.schema.json` | a `ScheduleKind` variant with its serde name, in `ScheduleKind::ALL` and `ScheduleKind::name` (the `--schedule` spelling its `FromStr` parses); rewrite the schema with `BLESS=1 cargo test -p plan --test schema` | `the_committed_schema_is_the_generated_one` (`codegen/plan/tests/schema.rs`) |
//! | steps | `codegen/src/schedule.rs` | its arm of `steps` (from `StepSeconds` if it plays a policy, as `zb_h1`), its refusals (chunks, microbatch counts), the module docs | `schedules_bubbles_match_their_formulas` (`tests/tests/plan.rs`) |
//! | program | `codegen/src/stage.rs`, `codegen/src/pipeline.rs` | in `place` (`stage.rs`): the model chunks it takes (`Interleaved` only) and the phases it cuts the program into (`ZbH1`'s `split_weight_gradients`); in `search` (`pipeline.rs`): whether `--pipeline auto` tries it | `pipeline_search_keeps_the_fastest_candidate`, `pipelined_plans_are_validated_stage_by_stage` (`tests/tests/plan.rs`) |
//! | validation | `codegen/plan/src/schedule.rs` | nothing for a new order: `Plan::validate` runs `check_steps` (each stage's steps a permutation in segment order) and `timeline` (transfers matched, deadlocks named, the bubble) on any kind | `edited_schedules_are_refused` (`tests/tests/plan.rs`); `summarised_walks_equal_the_exact_walks` (`tests/tests/plan_walks.rs`, against `timeline_exact`; add a config) |
//! | runtime | `runtime/src/compile.rs`, `runtime/src/program.rs` | nothing to run it: `Program::compile` takes `Plan::steps`. But `compile` and `Program::needs_buffered_sends` match the kind's variants: only `Sequential` and `Gpipe` may run on a back end whose sends wait for their receives (the `nccl` launcher, `runtime/src/launch/nccl.rs`); any other kind is refused there (a `matches!` and a `_` arm: the compiler points at neither) | `scheduled_pipelines_equal_single_device` (`tests/tests/dist.rs`, over `ScheduleKind::ALL`); `mpi_runs_equal_single_device` (`tests/cli_mpi.rs`: add it to its configs) |
//! | CLI | `src/cmd/plan.rs` | the `--schedule` help of `PlanArgs` | `microbatched_plans_run_from_the_command_line` (`tests/cli_run.rs`) |
#![warn(missing_docs)]

pub mod bound;
pub mod checkpoint;
mod error;
pub mod explain;
pub mod figures;
mod lower;
pub mod microbatch;
mod modes;
mod options;
pub mod pipeline;
pub mod plan;
pub mod problem;
pub mod schedule;
mod solve;
pub mod stage;
pub mod svg;

/// The liveness walk of a program (in the `plan` crate, re-exported).
pub use ::plan::memory;
/// The plan's verifier (in the `plan` crate, re-exported).
pub use ::plan::validate;

pub use ::plan::{ModelInfo, Plan, Recompute};
pub use error::{Error, Result, fmt_bytes, parse_bytes};
pub use lower::precision_of;
pub use options::PlanOptions;
pub use plan::{check_layout, label, plan};
pub use problem::Baseline;
