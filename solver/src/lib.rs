//! The sharding cost-graph problem, its exact ILP and a large-scale heuristic search.
//!
//! A [`Problem`] has nodes with strategies (each with a cost and a memory usage) and a half-open
//! live interval, edges with a cost for every pair of their endpoints' strategies, and an optional
//! usage limit that the live nodes must respect at every time step. This is exactly the IOPDDL
//! contest format (ASPLOS 2025), which [`Problem::read`] and [`Problem::write`] handle (gzip too).
//!
//! [`solve`] picks a method by size: the exact ILP ([`ilp`], good_lp + CBC behind the
//! [`ilp::MipBackend`] trait) for small problems after [`reduce`]tions, the anytime search
//! otherwise. A reached time limit is a result ([`Status::TimeLimit`], with a lower bound and the
//! gap), not an error.
//!
//! ```
//! use solver::{Problem, SolveOptions, Status};
//! let json = br#"{"problem": {"name": "tiny",
//!   "nodes": {"intervals": [[0, 2], [1, 3]], "costs": [[5, 1], [2, 3]], "usages": [[1, 4], [2, 2]]},
//!   "edges": {"nodes": [[0, 1]], "costs": [[0, 9, 9, 0]]},
//!   "usage_limit": 5}}"#;
//! let problem = Problem::from_json_bytes(json)?;
//! let result = solver::solve(&problem, &SolveOptions::default())?;
//! assert_eq!(result.status, Status::Optimal);
//! // Node 0 must take strategy 0 (usage 1) to fit 1 + 2 <= 5; strategy 0 of node 1 avoids the edge cost.
//! assert_eq!(result.solution, vec![0, 0]);
//! assert_eq!(result.cost, 7);
//! # Ok::<(), solver::Error>(())
//! ```
#![warn(missing_docs)]

mod bound;
mod error;
mod eval;
mod lns;
pub mod ilp;
mod model;
mod problem;
pub mod reduce;
mod search;
mod segtree;
mod solve;

pub use error::{Error, Result};
pub use eval::Evaluation;
pub use problem::{Edge, Node, Problem, read_solution, write_solution};
pub use solve::{Method, SolveOptions, SolveResult, Status, brute_force, solve};
