//! The crate's error type.
//!
//! Every variant says whose fault it is: [`Error::is_user_error`] is true for bad input (a missing
//! or malformed file, an inconsistent problem, a solution that does not fit its problem, a problem
//! that cannot meet its memory limit) and false for failures of the environment or of this crate.

use std::path::PathBuf;

/// Errors of the solver crate. Messages are one line and name the offending item.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read or written (user input or environment).
    #[error("{path}: {cause}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        cause: std::io::Error,
    },
    /// A file is not valid JSON of the expected shape (user input).
    #[error("{path}: not a valid IOPDDL file: {message}")]
    Parse {
        /// The file (or `<memory>`).
        path: PathBuf,
        /// What the JSON reader said, with line and column.
        message: String,
    },
    /// The problem is well-formed JSON but inconsistent (user input), e.g. an edge names a node
    /// that does not exist or a cost matrix has the wrong size.
    #[error("invalid problem: {0}")]
    InvalidProblem(String),
    /// A solution does not fit its problem (user input): wrong length or strategy out of range.
    #[error("invalid solution: {0}")]
    InvalidSolution(String),
    /// No choice of strategies fits the usage limit (user input). The minimum peak is reached by
    /// choosing the smallest usage at every node, so this is exact, not a heuristic failure.
    #[error(
        "problem is infeasible: the minimum possible peak usage is {min_peak} at time step {time}, above the usage limit {limit}"
    )]
    Infeasible {
        /// The smallest peak usage any solution can have.
        min_peak: u128,
        /// A time step where that peak is reached.
        time: u64,
        /// The problem's usage limit.
        limit: u64,
    },
    /// The MIP back end failed (environment or a bug in the model we built).
    #[error("MIP back end {backend} failed: {message}")]
    Backend {
        /// Back-end name.
        backend: &'static str,
        /// Its message.
        message: String,
    },
    /// An internal invariant was broken (a bug in this crate).
    #[error("internal solver error (a bug): {0}")]
    Internal(String),
}

impl Error {
    /// True when the error is caused by the caller's input rather than by the environment or a bug.
    pub fn is_user_error(&self) -> bool {
        matches!(
            self,
            Error::Io { .. }
                | Error::Parse { .. }
                | Error::InvalidProblem(_)
                | Error::InvalidSolution(_)
                | Error::Infeasible { .. }
        )
    }
}

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
