//! The crate's error type.

use crate::validate::Problems;

/// Why a plan cannot be read, written or run. All but `Serialize` are the user's input (a
/// corrupt, hand-edited, truncated or stale file).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Not JSON at all.
    #[error("invalid plan: not JSON: {0}")]
    NotJson(String),
    /// JSON without a `version` field.
    #[error("invalid plan: no `version` field: not an autopar plan")]
    NoVersion,
    /// A plan of another format version.
    #[error(
        "invalid plan: version {found}; this autopar reads versions {} to {supported} ({})",
        crate::OLDEST_READ,
        if *found < u64::from(*supported) { "the plan is older: plan the model again" } else { "the plan is newer: update autopar" }
    )]
    Version {
        /// The file's version.
        found: u64,
        /// [`crate::VERSION`].
        supported: u32,
    },
    /// A field is missing or of the wrong type or form; `at` is where (`instruction 12: inputs[0]`).
    #[error("invalid plan: {at}: {why}")]
    Malformed {
        /// Where, as a path into the document.
        at: String,
        /// What is wrong.
        why: String,
    },
    /// The plan breaks its invariants ([`crate::Plan::validate`]): every problem found, each
    /// with where it is.
    #[error("invalid plan: {0}")]
    Invalid(Problems),
    /// A plan could not be written as JSON (a bug: every plan the types allow is writable).
    #[error("cannot write the plan as JSON: {0}")]
    Serialize(String),
}

/// Result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
