//! Subcommands.
pub mod bench;
pub mod common;
pub mod data;
pub mod generate;
pub mod infer;
pub mod inspect;
pub mod measured;
pub mod plan;
pub mod profile;
pub mod reshard;
pub mod run;
pub mod run_log;
pub mod run_report;
pub mod solve;
pub mod strategies;
pub mod train;
