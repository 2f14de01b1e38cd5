//! Sharding specs: how one tensor is laid out over a mesh.
//!
//! Every mesh axis is in exactly one state for a tensor: it shards one tensor dim, it replicates,
//! or it holds partial sums (the tensor is the sum of the ranks' values along that axis).
//! A tensor dim may be split over several mesh axes; their order matters: `S01` splits the dim
//! into `n0 * n1` blocks and the rank at coordinates `(c0, c1)` holds block `c0 * n1 + c1`
//! (axis 0 outer), while `S10` gives it block `c1 * n0 + c0`.
//!
//! # Text form
//! ```text
//! spec    := dims [ '|' partial ]       e.g.  S0 R S1     S01 R R     R S1 | P0     - | P01
//! dims    := '-' | dim (' ' dim)*       one entry per tensor dim; '-' for a scalar
//! dim     := 'R' | 'S' digit+           mesh axes splitting the dim, outermost first
//! partial := 'P' digit+                 mesh axes holding partial sums (any order; printed sorted)
//! ```
//! Invariants of a valid spec for a shape on a mesh ([`ShardingSpec::check`]): one entry per tensor
//! dim, every mesh axis used at most once (across all dims and the partial set), and every dim
//! divisible by the product of the mesh axes that split it (uneven splits are rejected).

use crate::mesh::DeviceMesh;
use crate::{Error, Result};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::str::FromStr;

/// What one mesh axis does to a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AxisState {
    /// The axis splits tensor dim `dim`.
    Shard(usize),
    /// Every rank along the axis holds the same values.
    Replicate,
    /// The tensor is the sum over the axis of the ranks' values.
    Partial,
}

/// The layout of one tensor over a mesh. See the module docs for the text form.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ShardingSpec {
    dims: Vec<Vec<usize>>,
    partial: Vec<usize>,
}

impl ShardingSpec {
    /// Replicated on every axis.
    pub fn replicated(rank: usize) -> ShardingSpec {
        ShardingSpec { dims: vec![vec![]; rank], partial: vec![] }
    }

    /// From the mesh axes splitting each dim (outermost first) and the partial axes.
    pub fn new(dims: Vec<Vec<usize>>, mut partial: Vec<usize>) -> ShardingSpec {
        partial.sort_unstable();
        ShardingSpec { dims, partial }
    }

    /// A spec splitting one dim over some axes, replicated otherwise.
    pub fn shard(rank: usize, dim: usize, axes: &[usize]) -> ShardingSpec {
        let mut s = ShardingSpec::replicated(rank);
        s.dims[dim] = axes.to_vec();
        s
    }

    /// The spec with every mesh axis `a` renamed `perm[a]` (a symmetry of the mesh,
    /// [`DeviceMesh::symmetries`]): split orders within a dim are kept.
    pub fn permuted(&self, perm: &[usize]) -> ShardingSpec {
        ShardingSpec::new(
            self.dims.iter().map(|d| d.iter().map(|&a| perm[a]).collect()).collect(),
            self.partial.iter().map(|&a| perm[a]).collect(),
        )
    }

    /// Tensor rank the spec is for.
    pub fn rank(&self) -> usize {
        self.dims.len()
    }
    /// Mesh axes splitting each tensor dim, outermost first.
    pub fn dims(&self) -> &[Vec<usize>] {
        &self.dims
    }
    /// Mesh axes holding partial sums, sorted.
    pub fn partial(&self) -> &[usize] {
        &self.partial
    }
    /// True when no axis shards or holds partial sums.
    pub fn is_replicated(&self) -> bool {
        self.partial.is_empty() && self.dims.iter().all(|d| d.is_empty())
    }
    /// True when some axis holds partial sums.
    pub fn is_partial(&self) -> bool {
        !self.partial.is_empty()
    }

    /// The state of one mesh axis.
    pub fn axis_state(&self, axis: usize) -> AxisState {
        if self.partial.contains(&axis) {
            return AxisState::Partial;
        }
        match self.dims.iter().position(|d| d.contains(&axis)) {
            Some(d) => AxisState::Shard(d),
            None => AxisState::Replicate,
        }
    }

    /// Mesh axes this spec uses (sharding or partial).
    pub fn used_axes(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self.dims.iter().flatten().chain(&self.partial).copied().collect();
        v.sort_unstable();
        v
    }

    /// With the partial axes replaced.
    pub fn with_partial(mut self, mut partial: Vec<usize>) -> ShardingSpec {
        partial.sort_unstable();
        self.partial = partial;
        self
    }

    /// With the axes of one dim replaced.
    pub fn with_dim(mut self, dim: usize, axes: Vec<usize>) -> ShardingSpec {
        self.dims[dim] = axes;
        self
    }

    /// Checks the spec against a global shape on a mesh (see the module docs).
    pub fn check(&self, shape: &[usize], mesh: &DeviceMesh) -> Result<()> {
        let err = |why: String| Error::SpecMismatch {
            spec: self.to_string(),
            shape: shape.to_vec(),
            mesh: mesh.to_string(),
            why,
        };
        if self.dims.len() != shape.len() {
            return Err(err(format!("the spec has {} dims, the tensor {}", self.dims.len(), shape.len())));
        }
        let mut used = vec![false; mesh.ndim()];
        for &a in self.dims.iter().flatten().chain(&self.partial) {
            if a >= mesh.ndim() {
                return Err(err(format!("mesh axis {a} does not exist (the mesh has {} axes)", mesh.ndim())));
            }
            if used[a] {
                return Err(err(format!("mesh axis {a} is used twice")));
            }
            used[a] = true;
        }
        for (d, axes) in self.dims.iter().enumerate() {
            let n = mesh.group_size(axes);
            if !shape[d].is_multiple_of(n) {
                return Err(err(format!(
                    "dim {d} of size {} is not divisible by {n} (uneven splits are not supported)",
                    shape[d]
                )));
            }
        }
        Ok(())
    }

    /// Shape of every rank's local block (all ranks have the same; partial sums keep the shape).
    pub fn local_shape(&self, shape: &[usize], mesh: &DeviceMesh) -> Vec<usize> {
        shape.iter().zip(&self.dims).map(|(&s, axes)| s / mesh.group_size(axes)).collect()
    }

    /// Offset of a rank's local block in the global tensor, per dim.
    pub fn offsets(&self, shape: &[usize], mesh: &DeviceMesh, rank: usize) -> Vec<usize> {
        let local = self.local_shape(shape, mesh);
        self.dims.iter().zip(local).map(|(axes, l)| mesh.index_in_group(rank, axes) * l).collect()
    }

    /// Bytes of one rank's block of a tensor with `elem` bytes per element.
    pub fn local_bytes(&self, shape: &[usize], mesh: &DeviceMesh, elem: usize) -> usize {
        self.local_shape(shape, mesh).iter().product::<usize>() * elem
    }
}

fn axes_text(axes: &[usize]) -> String {
    axes.iter().map(|a| a.to_string()).collect()
}

impl fmt::Display for ShardingSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.dims.is_empty() {
            f.write_str("-")?;
        }
        for (i, axes) in self.dims.iter().enumerate() {
            if i > 0 {
                f.write_str(" ")?;
            }
            if axes.is_empty() { f.write_str("R")? } else { write!(f, "S{}", axes_text(axes))? }
        }
        if !self.partial.is_empty() {
            write!(f, " | P{}", axes_text(&self.partial))?;
        }
        Ok(())
    }
}

impl FromStr for ShardingSpec {
    type Err = Error;
    fn from_str(text: &str) -> Result<ShardingSpec> {
        let err = |why: String| Error::SpecSyntax { text: text.to_string(), why };
        let digits = |s: &str, what: &str| -> Result<Vec<usize>> {
            if s.is_empty() {
                return Err(err(format!("`{what}` needs mesh axis digits, as in {what}0 or {what}01")));
            }
            s.chars()
                .map(|c| c.to_digit(10).map(|d| d as usize))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| err(format!("`{what}{s}`: mesh axes are single digits")))
        };
        let (dims_text, partial_text) = match text.split_once('|') {
            Some((d, p)) => (d, Some(p.trim())),
            None => (text, None),
        };
        let mut dims = vec![];
        let tokens: Vec<&str> = dims_text.split_whitespace().collect();
        if tokens.is_empty() {
            return Err(err("no dims: write one R or S<axes> per tensor dim (`-` for a scalar)".into()));
        }
        if tokens != ["-"] {
            for t in tokens {
                match t.split_at(1) {
                    ("R", "") => dims.push(vec![]),
                    ("S", rest) => dims.push(digits(rest, "S")?),
                    _ => return Err(err(format!("`{t}` is not R or S<axes> (S0, S01, ...)"))),
                }
            }
        }
        let mut partial = vec![];
        if let Some(p) = partial_text {
            match p.strip_prefix('P') {
                Some(rest) => partial = digits(rest, "P")?,
                None => return Err(err(format!("after `|` comes P<axes> (P0, P01), not `{p}`"))),
            }
        }
        let mut all: Vec<usize> = dims.iter().flatten().chain(&partial).copied().collect();
        let n = all.len();
        all.sort_unstable();
        all.dedup();
        if all.len() != n {
            return Err(err("a mesh axis appears twice".into()));
        }
        Ok(ShardingSpec::new(dims, partial))
    }
}

impl Serialize for ShardingSpec {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

/// In JSON a spec is its text form (`"S0 R | P1"`).
impl schemars::JsonSchema for ShardingSpec {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "ShardingSpec".into()
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "string",
            "description": "A layout: one entry per tensor dim, `R` (replicated) or `S` with the mesh axes splitting it, outermost first (`S01`); then `| P` with the axes holding partial sums. A scalar is `-`. Example: `S0 R S1 | P2`.",
            "pattern": "^(-|[RS0-9 ]+)( \\| P[0-9]+)?$"
        })
    }
}

impl<'de> Deserialize<'de> for ShardingSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<ShardingSpec, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_round_trips() {
        for t in ["S0 R S1", "S01 R R", "R S1 | P0", "- | P01", "-", "S10 R", "R R | P12"] {
            let s: ShardingSpec = t.parse().unwrap();
            assert_eq!(s.to_string(), t);
        }
        assert_eq!("R  S1|P0".parse::<ShardingSpec>().unwrap().to_string(), "R S1 | P0");
        for bad in ["", "X R", "S R", "S0 S0", "R | Q0", "R | P", "S0 | P0", "Sa"] {
            assert!(bad.parse::<ShardingSpec>().is_err(), "{bad}");
        }
    }

    #[test]
    fn local_shapes_and_offsets() {
        let m = DeviceMesh::uniform(&[2, 4]).unwrap();
        assert!("S01 R S1".parse::<ShardingSpec>().is_err()); // axis 1 twice
        let s = ShardingSpec::new(vec![vec![0, 1], vec![], vec![1]], vec![]);
        assert!(s.check(&[8, 3, 4], &m).unwrap_err().to_string().contains("used twice"));
        assert!("S2 R".parse::<ShardingSpec>().unwrap().check(&[8, 3], &m).is_err());
        let s: ShardingSpec = "S10 R".parse().unwrap();
        s.check(&[16, 3], &m).unwrap();
        assert_eq!(s.local_shape(&[16, 3], &m), vec![2, 3]);
        // rank 6 = (1, 2): block c1 * 2 + c0 = 5
        assert_eq!(s.offsets(&[16, 3], &m, 6), vec![10, 0]);
        let e = "S0 R".parse::<ShardingSpec>().unwrap().check(&[3, 4], &m).unwrap_err();
        assert!(e.to_string().contains("not divisible by 2"), "{e}");
    }
}
