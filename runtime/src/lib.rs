//! Executes autopar graphs.
//!
//! The crate is in layers, each in its own module; a layer uses only those below it (no module
//! imports another in a loop: `scripts/check-rooms` checks it):
//!
//! | layer | module | what it holds |
//! |---|---|---|
//! | the compiled program | [`program`] ([`compile`](program::Program::new)) | [`Program`]: per-stage code of [`program::Exec`] instructions over slots, each op's local [`program::Kernel`]; [`RankState`], a rank's blocks; what a step returns ([`StepResult`]) |
//! | the interpreter | [`exec`] | the one walk of a program's code, one method per instruction kind, over a [`Backend`] |
//! | back ends | [`cpu`], `gpu` (feature `cuda`) | [`Backend`] implementations: host tensors and CPU kernels on a [`Cpu`]; device tensors, CUDA kernels and NCCL |
//! | ranks | [`rank`] | [`rank::Rank`]: a back end's rank as the launcher's loop drives it (step, report, checkpoint, evaluate) |
//! | launchers | [`launch`] | threads, `mpi`, `nccl`: start the ranks, run [`launch::rank_loop`] on each, handle faults |
//! | single device | [`Interpreter`], [`train`] | a bare graph as the one-rank program, on a [`Cpu`] |
//!
//! Parameters come from a [`params::ParamSource`] the caller supplies (the CLI passes an ONNX
//! reader): this crate reads no model format, and callers never name a kernels type (they build a
//! [`Cpu`]).
//!
//! One executor runs everything: `exec::step` walks a compiled [`Program`] over a back end
//! (host tensors and CPU kernels, or device tensors, CUDA kernels and NCCL). A distributed plan
//! compiles to one program per mesh; a bare graph compiles to the one-rank program, which is
//! what [`Interpreter`] runs on one CPU device: nodes in the graph's topological order, each
//! through the CPU kernels, every intermediate freed right after its last use, a reshape
//! of a value read for the last time made a view of it. It reports the peak bytes it held
//! (inputs and intermediates; parameters and constants are counted separately because they
//! stay resident).
//!
//! Training graphs run the same way: their [`ir::Op::State`] nodes read the same name-keyed map as
//! parameters, and the new values of [`ir::Graph::updates`] come back in [`RunReport::updates`];
//! [`train::Trainer`] keeps them between steps.
//!
//! Distributed execution: [`program`] compiles a plan (the `plan` crate's format; this crate never
//! links the planner or the solver) into a per-rank [`Program`] and runs
//! its steps; [`comm`] has the [`comm::Communicator`] trait and its `threads` back end (ranks as
//! threads, deterministic reductions, abort and timeout instead of hangs), `mpi_comm` the `mpi`
//! one (feature `mpi`); [`launch`] runs steps on every rank with checkpoints ([`checkpoint`]) and
//! fault handling. `gpu` (feature `cuda`) runs the same compiled program on one GPU per rank,
//! with the CUDA kernels and NCCL collectives (the `nccl` back end). [`data`] streams datasets
//! into the inputs: before each step every rank reads only the rows of its input blocks, in an
//! epoch order that is a function of the step and a seed (so checkpoints resume it exactly).
//! An evaluation step runs only the instructions the `loss` output depends on, with the
//! parameters borrowed, so held-out losses come from the same plan without an update.
//!
//! Invariants: feeds must match the graph inputs' metas exactly; a parameter without data is an
//! error (weight-free models can be planned, not run, until they are initialised).
//!
//! # Adding a back end
//!
//! A back end is a transport for host tensors (a [`comm::Communicator`], as `mpi`), or a
//! device with its own tensors (a [`Backend`] and a [`rank::Rank`], as `nccl`'s GPU
//! ranks). Either way the ranks run the one walk, `exec::step`, and the one loop,
//! [`launch::rank_loop`]; never fork them:
//!
//! | step | file | what to do | what checks it |
//! |---|---|---|---|
//! | transport | `runtime/src/comm.rs` | implement `Communicator`: `rank`, `size`, `exchange`, `exchange_pieces`, `abort`; override `all_reduce`, `all_gather`, tagged `send` / `recv`, `prepare`, `check` where the library does better (as `MpiComm`, `runtime/src/mpi_comm.rs`); `CpuBackend` and `CpuRank` then run it unchanged | `comm::tests::threads_match_the_simulation`, `comm::tests::abort_reaches_every_rank` (their pattern) |
//! | device | `runtime/src/exec.rs` | implement the public [`Backend`] trait: `T`, `eval`, `collective`, `gather_output`, `send` / `recv`, `download`, and `reshape`, `copy`, `sync`, `peak_bytes` where the device differs; models: `CpuBackend` (`runtime/src/cpu.rs`), `GpuExec` (`runtime/src/gpu.rs`) | `one_rank_on_a_device_matches_threads` (`tests/cli_gpu.rs`) |
//! | rank | `runtime/src/rank.rs` | implement `Rank` (`step`, `report`, `checkpoint`, `eval`, `set_feed_blocks`, `poison`) as `CpuRank` and `gpu::GpuRank` do | `a_resumed_run_continues_bit_exactly` (`runtime/tests/launch.rs`) |
//! | launcher | `runtime/src/launch/<name>.rs`, `runtime/src/launch/mod.rs` | a function beside `threads`, `mpi` (`runtime/src/launch/mpi.rs`), `nccl` (`runtime/src/launch/nccl.rs`) that starts the ranks and returns `Finished` or a `LaunchError`, with a stub under `#[cfg(not(feature = ...))]` saying how to rebuild; refuse what it cannot run before any rank starts (`Program::needs_buffered_sends`, as `nccl` does) | `a_failing_rank_stops_the_run_with_its_own_error`, `invalid_plans_are_refused_before_any_rank_starts` (`runtime/tests/launch.rs`) |
//! | feature | `runtime/Cargo.toml`, `Cargo.toml`, `runtime/src/lib.rs`, `scripts/test` | a feature in both manifests (as `mpi`, `cuda`), the module behind `#[cfg(feature = ...)]`, its clippy and test lines in `scripts/test`; no model reader among the dependencies | the `cargo tree -p runtime` check in `scripts/test` |
//! | CLI | `src/cmd/run.rs`, `src/cmd/profile.rs` | a variant of the `Backend` enum (`--backend`, a clap `ValueEnum`), its arm in `run`'s `match a.backend` in both files (`profile` may refuse, as it does `nccl`) | `mpi_runs_equal_single_device` (`tests/cli_mpi.rs`), `two_ranks_on_two_gpus_match_threads` (`tests/cli_gpu.rs`): a `[[test]]` of its own with `required-features` in `Cargo.toml` |
#![warn(missing_docs)]

pub mod bounds;
pub mod checkpoint;
pub mod comm;
mod compile;
pub mod cpu;
pub mod data;
mod error;
pub mod exec;
#[cfg(feature = "cuda")]
pub mod gpu;
mod interpreter;
pub mod launch;
#[cfg(feature = "mpi")]
pub mod mpi_comm;
pub mod npy;
pub mod outputs;
pub mod params;
pub mod program;
pub mod rank;
pub mod train;
mod values;
pub mod weights;

pub use cpu::{Accumulation, Cpu};
pub use error::DistError;
pub use exec::Backend;
pub use interpreter::{Interpreter, RunError, RunReport};
pub use program::{EVAL_OUTPUT, Program, RankState, StepResult};
pub use values::scalar_f32;
