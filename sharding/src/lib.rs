//! Sharding core of autopar: device meshes, sharding specs, collectives and their costs, the
//! layout converter, and per-op sharding strategies.
//!
//! Invariants kept by this crate:
//! - Costs are seconds (compute by a roofline on a [`DeviceProfile`], or by its op family's
//!   measured cost when the profile has one, see [`OpCost`]; collectives by alpha-beta on the
//!   mesh's links); memory is bytes per rank.
//! - A [`ShardingSpec`] that passes [`ShardingSpec::check`] gives every rank a block of the same
//!   shape; uneven splits are rejected, never silently padded.
//! - Every strategy a generator returns is correct: executing the op on each rank's blocks (plus
//!   the strategy's own collectives) gives the blocks of the output spec. The workspace's
//!   `tests/tests/strategies.rs` checks this by execution for every op family.
//! - No global state: converters own their cache, generators are plain functions.
//!
//! ```
//! use sharding::{DeviceMesh, ShardingSpec, LayoutConverter, Search};
//! let mesh = DeviceMesh::uniform(&[2, 4]).unwrap();
//! let conv = LayoutConverter::new(mesh, Search::Exact);
//! let from: ShardingSpec = "S0 R R".parse().unwrap();
//! let to: ShardingSpec = "R S01 R".parse().unwrap();
//! let path = conv.convert(&[8, 16, 32], 4, &from, &to).unwrap();
//! assert!(path.cost > 0.0);
//! ```
//!
//! Adding an op: its rule goes in `src/strategy/<family>.rs` (`strategy::rule` only dispatches):
//! the logical dims its inputs and outputs share and which inputs it is linear in; the other
//! stages and the tests to add are listed in `ir`'s crate docs ("Adding an op").
//!
//! # Adding a collective
//!
//! A collective is one [`Collective`] value all the way to the ranks: the plan carries it
//! unchanged in `Instr::Collective` (there is no instruction per kind), codegen's `lower`
//! (`codegen/src/plan.rs`) copies the converter's steps whatever their kind, and the runtime's
//! `Program::compile` and `exec::step` hand it to the back end's `collective`. The work is the
//! match arms on it (about 7 files in 3 crates: `sharding`, `plan`, `runtime`):
//!
//! | step | file | what to do | what checks it |
//! |---|---|---|---|
//! | variant and cost | `sharding/src/collective.rs` | the variant, its arms in `axes`, `kind`, `is_local`, `local_shape_after`, `bytes`, `cost` (nccl-tests' bus factor; `gather` picks `Link::for_gather`) and `Display` | `collective::tests::ring_factors` |
//! | semantics | `sharding/src/sim.rs` | its arm of `sim::apply`: the exact blocks every rank gets (reductions in group order) | `sim::tests::gather_and_reduce_scatter`; `conversions_execute_correctly` (`sharding/tests/convert.rs`) |
//! | path search | `sharding/src/convert.rs` | if it converts layouts: offer it in `neighbours_toward`, list it in the module docs | `conversions_execute_correctly`, `exact_is_never_beaten`, `colossal_auto_examples` (`sharding/tests/convert.rs`); `convert::tests::simple_paths` |
//! | plan format | `codegen/plan/src/validate.rs`, `codegen/plan/plan.schema.json` | its arm of `spec_after` (the spec it leaves, or why it cannot run there); rewrite the schema with `BLESS=1 cargo test -p plan --test schema` | `validate::tests::spec_after_agrees_with_the_converter`; `the_committed_schema_is_the_generated_one` (`codegen/plan/tests/schema.rs`) |
//! | lowering | `codegen/src/plan.rs` | nothing: `lower` emits every step and sums it per `Collective::kind` in `Estimate::collectives` | `golden_lowered_plan_gpt2_tiny_2x2` (`tests/tests/plan.rs`) |
//! | threads, MPI | `runtime/src/comm.rs` | its arms in `group_of` (checks before any rank waits) and in the default `Communicator::run`, built on `exchange` / `exchange_pieces`; `MpiComm` (`runtime/src/mpi_comm.rs`) inherits `run`, so it changes only for a new primitive | `comm::tests::threads_match_the_simulation` (add a case); `mpi_runs_equal_single_device` (`tests/cli_mpi.rs`, feature `mpi`) |
//! | NCCL | `runtime/src/gpu.rs` | its arm in `GpuExec::collective` (an NCCL call, or a composition as all-to-all's) and the module docs' mapping | `two_ranks_on_two_gpus_match_threads` (`tests/cli_gpu.rs`, feature `cuda`, two GPUs) |
//! | executor | `runtime/src/compile.rs`, `runtime/src/exec.rs` | nothing: `Instr::Collective` becomes `Exec::Collective`, run by `Backend::collective` | `threads_run_a_plan_and_report_every_step_in_order` (`runtime/tests/launch.rs`) |
//! | profiling | `profiler/src/profile.rs` | nothing unless it needs its own link: `sweep` times all-reduce and all-gather only | `profile::tests::all_gathers_get_their_own_link` |
//!
//! Collectives an op's strategy needs inside its local computation (`Strategy::collectives`:
//! a split softmax's max and sum all-reduces) run in the runtime's special kernels ([`Local`]),
//! not through the arms above.
//!
//! # Adding a cost-model term
//!
//! Every price is seconds from a [`DeviceProfile`] (device rates, links, fitted families): an
//! op's in [`DeviceProfile::op_compute_seconds`], a collective's in [`Collective::cost`] over
//! [`DeviceMesh::time`]. Planning only sums them, so a term lives where they are computed:
//!
//! | step | file | what to do | what checks it |
//! |---|---|---|---|
//! | input | `sharding/src/mesh.rs` | a `DeviceProfile` field with `#[serde(default)]` (profile files written before it still load through `DeviceProfile::load`), its bounds in `DeviceProfile`'s `check`, a value with its source in each `DeviceProfile::builtin` | `mesh::tests::fitted_op_costs_price_their_families`, `mesh::tests::parse_and_links` |
//! | op term | `sharding/src/mesh.rs`, `sharding/src/strategy.rs` | use it in `compute_seconds_in` / `op_compute_seconds` (by `cost_family` and `op_work`); `build` prices every strategy with them | `strategy::tests::matmul_on_2x2`; `auto_is_never_worse_than_manual_baselines` (`tests/tests/plan.rs`) |
//! | link term | `sharding/src/mesh.rs`, `sharding/src/collective.rs` | in `Link::time` / `DeviceMesh::time`, or `Collective::cost` | `collective::tests::ring_factors`, `mesh::tests::segments_and_gather_links` |
//! | estimate | `codegen/src/plan.rs`, `codegen/src/pipeline.rs`, `codegen/plan/src/schedule.rs` | nothing for an op or link term (`lower` sums the plan's `Estimate`, `place` the stages', `timeline` plays the schedule); a term of its own (per step) goes where `Estimate` is built, and must keep `codegen/src/bound.rs`'s `floor` a lower bound | `golden_lowered_plan_gpt2_tiny_2x2`, `schedules_bubbles_match_their_formulas` (`tests/tests/plan.rs`) |
//! | measuring | `profiler/src/profile.rs`, `profiler/src/calibrate.rs` | measure the input: `device` (rates), `sweep` and `fit` (links), `calibrate`, `fit_family` and `step_scales` (per-family [`OpCost`], coefficients non-negative) | `profile::tests::fit_recovers_a_linear_model`, `calibrate::tests::fit_is_never_negative` |
//! | profile file | `src/cmd/profile.rs` | `report` builds the `DeviceProfile` that `autopar profile` writes: fill the field | `profile_writes_a_device_profile_that_plan_uses` (`tests/cli_run.rs`) |
//! | fidelity | `BENCHMARKS.md`, `scripts/bench-fidelity`, `scripts/bench-published` | re-run both on a quiet machine and update their sections (estimates against measured steps; published runs) | `published_runs_are_priced_within_20_percent` (`tests/published.rs`); `profiled_runs_set_measurements_beside_estimates` (`tests/cli_run.rs`) |
#![warn(missing_docs)]

pub mod collective;
pub mod convert;
mod error;
pub mod fx;
pub mod mesh;
pub mod sim;
pub mod spec;
pub mod strategy;

pub use collective::{Collective, ReduceKind};
pub use convert::{Conversion, LayoutConverter, Search, Step};
pub use error::{Error, Result};
pub use mesh::{DeviceMesh, DeviceProfile, Link, MeshAxes, MeshProfile, OpCost, Segment, cost_family, op_work};
pub use spec::{AxisState, ShardingSpec};
pub use strategy::{Local, OpContext, Strategy, expand, shift_queries, strategies};
