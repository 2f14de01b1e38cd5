//! Why a distributed run failed.

use crate::comm::CommError;

/// Why a distributed run failed. `Plan` and `Data` are the user's input; `Kernel` names the
/// node; `Comm` carries another rank's failure or a timeout.
#[derive(Debug, Clone, thiserror::Error)]
pub enum DistError {
    /// The plan cannot be executed (inconsistent with its graph).
    #[error("plan: {0}")]
    Plan(String),
    /// The plan breaks its invariants ([`Plan::validate`]'s message).
    #[error("{0}")]
    InvalidPlan(String),
    /// A kernel failed on a rank.
    #[error("rank {rank}: node {node} ({op}): {message}")]
    Kernel {
        /// The rank.
        rank: usize,
        /// Node name.
        node: String,
        /// Op name.
        op: String,
        /// Kernel message.
        message: String,
    },
    /// Feeds or parameters do not fit the plan.
    #[error("rank {rank}: {message}")]
    Data {
        /// The rank.
        rank: usize,
        /// What is wrong.
        message: String,
    },
    /// A collective failed (another rank's failure, a timeout).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// A fault injected for testing.
    #[error("rank {rank}: injected fault at step {step}")]
    Injected {
        /// The rank.
        rank: usize,
        /// The step.
        step: u64,
    },
    /// A rank panicked (a bug).
    #[error("rank {rank} panicked: {message}")]
    Panic {
        /// The rank.
        rank: usize,
        /// The panic message.
        message: String,
    },
    /// A checkpoint could not be written or read.
    #[error("{0}")]
    Checkpoint(String),
}

impl DistError {
    /// True when this error only reports another rank's failure.
    pub fn is_secondary(&self) -> bool {
        matches!(self, DistError::Comm(CommError::Aborted { .. }))
    }
}
