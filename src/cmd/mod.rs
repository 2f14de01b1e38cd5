//! Subcommands.
pub mod common;
pub mod infer;
pub mod inspect;
pub mod solve;
pub mod train;
