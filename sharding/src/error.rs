//! The crate's error type.

/// Errors of the sharding crate. Messages are one line and name what is wrong. All variants are
/// caused by the caller's input (a malformed spec, a shape the mesh does not divide, an op with no
/// rule), except [`Error::Internal`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// A mesh description could not be parsed or is inconsistent.
    #[error("invalid mesh `{text}`: {why}")]
    Mesh {
        /// The text or a description of the mesh.
        text: String,
        /// What is wrong.
        why: String,
    },
    /// A device or mesh profile could not be read or is inconsistent.
    #[error("invalid profile {source_name}: {why}")]
    Profile {
        /// The file or profile name.
        source_name: String,
        /// What is wrong.
        why: String,
    },
    /// A sharding spec could not be parsed.
    #[error("malformed sharding spec `{text}`: {why}")]
    SpecSyntax {
        /// The text.
        text: String,
        /// What is wrong.
        why: String,
    },
    /// A spec does not fit a tensor shape on a mesh (wrong rank, axis used twice, indivisible dim).
    #[error("sharding spec `{spec}` does not fit shape {shape:?} on mesh {mesh}: {why}")]
    SpecMismatch {
        /// The spec, in text form.
        spec: String,
        /// The global shape.
        shape: Vec<usize>,
        /// The mesh shape, e.g. `2x4`.
        mesh: String,
        /// What is wrong.
        why: String,
    },
    /// No layout conversion exists between two specs (only happens for a malformed request).
    #[error("no layout conversion from `{from}` to `{to}`: {why}")]
    NoConversion {
        /// Source spec.
        from: String,
        /// Target spec.
        to: String,
        /// Why.
        why: String,
    },
    /// An op has no sharding rule, or its inputs do not match its rule.
    #[error("no sharding rule for node `{node}` ({op}): {why}")]
    NoRule {
        /// Node name.
        node: String,
        /// Op name.
        op: String,
        /// Why.
        why: String,
    },
    /// Local shards handed to the simulator do not fit the spec (caller's bug).
    #[error("shards do not match spec `{spec}`: {why}")]
    Shards {
        /// The spec.
        spec: String,
        /// What is wrong.
        why: String,
    },
    /// The simulator was handed tensors that do not fit the operation: a block that does not lie
    /// inside its tensor, a split into pieces that do not divide the dim, a concatenation of
    /// mismatched shapes. Checked so that bad input is this error, never an index out of bounds.
    #[error("simulated sharding: {0}")]
    Sim(String),
    /// An internal invariant was broken (a bug in this crate).
    #[error("internal sharding error (a bug): {0}")]
    Internal(String),
}

/// Result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
