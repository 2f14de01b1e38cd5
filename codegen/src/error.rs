//! The crate's error type.

/// Errors of planning. `Infeasible` and `Plan` are the user's input (a budget too small, a
/// corrupt or hand-edited plan); the others wrap lower stages' errors or are bugs.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No plan fits the memory budget.
    #[error(
        "no plan fits {budget} per rank: the smallest peak {} {min_peak} per rank{dominant}; use --memory {suggest}",
        if *proven { "any plan reaches is" } else { "of the plans found is" }
    )]
    Infeasible {
        /// The budget, formatted.
        budget: String,
        /// The smallest reachable peak, formatted.
        min_peak: String,
        /// A budget that fits, formatted, and what else may help ("... or more, or a larger
        /// mesh", and a longer time limit when the peak is not `proven`).
        suggest: String,
        /// What dominates the peak (", dominated by ...").
        dominant: String,
        /// The smallest reachable peak in bytes.
        min_peak_bytes: u64,
        /// Whether the peak is the least any plan reaches (else the least of the plans the
        /// solver found before its time limit).
        proven: bool,
    },
    /// A plan cannot be read, or breaks its invariants ([`crate::Plan::validate`]).
    #[error(transparent)]
    Plan(#[from] ::plan::Error),
    /// A sharding error (no rule for an op, bad spec).
    #[error(transparent)]
    Sharding(#[from] sharding::Error),
    /// The solver failed.
    #[error(transparent)]
    Solver(#[from] solver::Error),
    /// The graph is malformed (a cycle, a verifier error).
    #[error("graph: {0}")]
    Graph(String),
    /// The problem would not fit in memory ([`crate::problem::MAX_EDGE_ENTRIES`]).
    #[error(
        "the sharding problem on mesh {mesh} is too large to build: {strategies} strategies and {entries} edge-cost entries (the limit is {limit}, about {} of memory); use a mesh with fewer axes (merge axes of the same link, e.g. 2x2x2x2x2 -> 4x8) or plan a smaller model first",
        fmt_bytes(limit.saturating_mul(8))
    )]
    TooLarge {
        /// The mesh.
        mesh: String,
        /// Strategies over all nodes.
        strategies: usize,
        /// Edge-cost entries (pairs of strategies of every edge).
        entries: u64,
        /// [`crate::problem::MAX_EDGE_ENTRIES`].
        limit: u64,
    },
    /// A manual layout per mesh axis ([`crate::Baseline::Axes`]) does not fit the mesh or the
    /// pipeline options.
    #[error("layout `{layout}` on mesh {mesh}: {why}")]
    Layout {
        /// The layout as given.
        layout: String,
        /// The mesh.
        mesh: String,
        /// What is wrong.
        why: String,
    },
    /// Pipeline stages cannot be made as asked (their count does not fit the mesh, a stage
    /// over the budget).
    #[error("pipeline: {0}")]
    Pipeline(String),
    /// The run's deadline passed before this piece of work ended (a candidate of a search is
    /// given up; the search goes on with what it has).
    #[error("the time limit ended while {0}; raise --time-limit")]
    OutOfTime(String),
    /// An internal invariant was broken (a bug in this crate).
    #[error("internal codegen error (a bug): {0}")]
    Internal(String),
}

/// Result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Bytes in human units (KiB, MiB, GiB).
pub fn fmt_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 { format!("{b} B") } else { format!("{v:.2} {}", UNITS[u]) }
}

/// Parses `16GiB`, `512MiB`, `1.5GB`, `100000` (bytes).
pub fn parse_bytes(s: &str) -> Option<u64> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num.parse().ok()?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "t" | "tb" => 1e12,
        "ki" | "kib" => 1024.0,
        "mi" | "mib" => 1048576.0,
        "gi" | "gib" => 1073741824.0,
        "ti" | "tib" => 1099511627776.0,
        _ => return None,
    };
    let b = v * mult;
    (b.is_finite() && (0.0..1.8e19).contains(&b)).then_some(b as u64)
}
