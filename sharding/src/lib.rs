//! Sharding core of autopar: device meshes, sharding specs, collectives and their costs, the
//! layout converter, and per-op sharding strategies.
//!
//! Invariants kept by this crate:
//! - Costs are seconds (compute by a roofline on a [`DeviceProfile`], or by its op family's
//!   measured cost when the profile has one, see [`OpCost`]; collectives by alpha-beta on the
//!   mesh's links); memory is bytes per rank.
//! - A [`ShardingSpec`] that passes [`ShardingSpec::check`] gives every rank a block of the same
//!   shape; uneven splits are rejected, never silently padded.
//! - Every strategy a generator returns is correct: executing the op on each rank's blocks (plus
//!   the strategy's own collectives) gives the blocks of the output spec. The workspace's
//!   `tests/tests/strategies.rs` checks this by execution for every op family.
//! - No global state: converters own their cache, generators are plain functions.
//!
//! ```
//! use sharding::{DeviceMesh, ShardingSpec, LayoutConverter, Search};
//! let mesh = DeviceMesh::uniform(&[2, 4]).unwrap();
//! let conv = LayoutConverter::new(mesh, Search::Exact);
//! let from: ShardingSpec = "S0 R R".parse().unwrap();
//! let to: ShardingSpec = "R S01 R".parse().unwrap();
//! let path = conv.convert(&[8, 16, 32], 4, &from, &to).unwrap();
//! assert!(path.cost > 0.0);
//! ```
//!
//! Adding an op: its rule goes in `src/strategy/<family>.rs` (`strategy::rule` only dispatches):
//! the logical dims its inputs and outputs share and which inputs it is linear in; the other
//! stages and the tests to add are listed in `ir`'s crate docs ("Adding an op").
#![warn(missing_docs)]

pub mod collective;
pub mod convert;
mod error;
pub mod fx;
pub mod mesh;
pub mod sim;
pub mod spec;
pub mod strategy;

pub use collective::{Collective, ReduceKind};
pub use convert::{Conversion, LayoutConverter, Search, Step};
pub use error::{Error, Result};
pub use mesh::{DeviceMesh, DeviceProfile, Link, MeshAxes, MeshProfile, OpCost, Segment, cost_family, op_work};
pub use spec::{AxisState, ShardingSpec};
pub use strategy::{Local, OpContext, Strategy, expand, strategies};
