//! The sharding cost-graph problem, its exact ILP and a large-scale heuristic search.
//!
//! A [`Problem`] has nodes with strategies (each with a cost and a memory usage) and a half-open
//! live interval, edges with a cost for every pair of their endpoints' strategies, and an optional
//! usage limit that the live nodes must respect at every time step. This is exactly the IOPDDL
//! contest format (ASPLOS 2025), which [`Problem::read`] and [`Problem::write`] handle (gzip too).
//!
//! [`solve`] first applies optimum-preserving [`reduce`]tions, then picks a method by size:
//!
//! - **small** (the reduced ILP has at most [`SolveOptions::ilp_max_vars`] variables): a short
//!   search gives a starting point and the exact ILP ([`ilp`], good_lp + CBC behind the
//!   [`ilp::MipBackend`] trait) proves the optimum or improves on it until the time limit;
//! - **large**: parallel anytime search threads sharing their best solution. Each builds a start
//!   with Lagrangian memory prices (TRW-S message passing over the whole cost graph, exact DP over
//!   random trees, node sweeps, moves of whole groups of nodes tied by forbidden edge entries,
//!   greedy memory repair), then improves it with exact DP over random trees and maximum
//!   spanning forests, memory-coupled pair moves and perturbations; thread 0 also re-solves
//!   connected regions exactly with the ILP (large-neighbourhood search). On graphs of a few thousand nodes, rounds of an ILP restricted
//!   to promising strategies per node run in between.
//!
//! Memory feasibility is checked exactly at the *maximal* time steps (where some interval starts
//! and the next event is an end), with a segment tree for range-add / range-max. A reached time
//! limit is a result ([`Status::TimeLimit`], with a lower bound and the gap), not an error; a
//! problem whose smallest possible peak exceeds the limit is [`Error::Infeasible`], naming that
//! peak and its time step. Every returned solution is re-evaluated exactly ([`Problem::evaluate`],
//! `u128` sums) on the original problem.
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
// The numerical loops index several parallel arrays by strategy; iterators would obscure them.
#![allow(clippy::needless_range_loop)]

mod bound;
mod error;
mod eval;
pub mod fold;
pub mod ilp;
mod lns;
mod model;
mod problem;
pub mod reduce;
#[cfg(test)]
mod reduce_reference;
mod search;
mod segtree;
mod solve;
mod trws;

pub use error::{Error, Result};
pub use eval::Evaluation;
pub use fold::{Folded, Member, Size, fold};
pub use problem::{Edge, Live, Node, Problem, read_solution, write_solution};
pub use solve::{Method, SolveOptions, SolveResult, Status, brute_force, solve};
