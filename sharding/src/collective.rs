//! Collectives over mesh axes and their alpha-beta cost.
//!
//! A collective acts on the groups of ranks that differ only along its `axes` (see
//! [`DeviceMesh::groups`]); a rank's index in its group is [`DeviceMesh::index_in_group`], so a
//! tensor dim split over the same axes in the same order is gathered in the right order.
//!
//! Cost: `alpha + factor * bytes * beta` seconds with the group's slowest link, where `bytes` and
//! `factor` follow nccl-tests' bus-bandwidth definitions (doc/PERFORMANCE.md there): all-reduce
//! `2(n-1)/n` of the buffer, all-gather `(n-1)/n` of the gathered output, reduce-scatter `(n-1)/n`
//! of the input, all-to-all `(n-1)/n` of the buffer, broadcast 1 (nccl-tests' factor). The local
//! slice and making a replicated tensor partial move no data and cost nothing.

use crate::mesh::DeviceMesh;
use serde::{Deserialize, Serialize};
use std::fmt;

/// Reduction used by an all-reduce.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ReduceKind {
    /// Sum (the reduction of `Partial`).
    Sum,
    /// Maximum (used inside ops, e.g. a vocabulary-parallel softmax).
    Max,
}

/// One collective (or free local re-layout) over some mesh axes.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Collective {
    /// Every rank gets the concatenation along `dim` of its group's blocks, in group order.
    AllGather {
        /// Mesh axes of the group, outermost first.
        axes: Vec<usize>,
        /// Tensor dim concatenated.
        dim: usize,
    },
    /// Every rank gets the reduction of its group's values.
    AllReduce {
        /// Mesh axes of the group.
        axes: Vec<usize>,
        /// Reduction.
        op: ReduceKind,
    },
    /// The group's sum, split along `dim`: group member `i` keeps block `i`.
    ReduceScatter {
        /// Mesh axes of the group, outermost first.
        axes: Vec<usize>,
        /// Tensor dim split.
        dim: usize,
    },
    /// Each rank splits its block along `split_dim` into `n` pieces and sends piece `i` to member
    /// `i`; it concatenates what it receives along `concat_dim`, in sender order.
    AllToAll {
        /// Mesh axes of the group, outermost first.
        axes: Vec<usize>,
        /// Dim that becomes split over the axes.
        split_dim: usize,
        /// Dim that stops being split over the axes.
        concat_dim: usize,
    },
    /// Every rank gets member 0's block.
    Broadcast {
        /// Mesh axes of the group.
        axes: Vec<usize>,
    },
    /// Local: member `i` keeps block `i` of `dim` (no communication).
    Slice {
        /// Mesh axes of the group, outermost first.
        axes: Vec<usize>,
        /// Tensor dim split.
        dim: usize,
    },
    /// Local: members other than 0 zero their block, so the group's sum is the replicated value
    /// (no communication).
    MakePartial {
        /// Mesh axes of the group.
        axes: Vec<usize>,
    },
}

impl Collective {
    /// Mesh axes it acts over.
    pub fn axes(&self) -> &[usize] {
        match self {
            Collective::AllGather { axes, .. }
            | Collective::AllReduce { axes, .. }
            | Collective::ReduceScatter { axes, .. }
            | Collective::AllToAll { axes, .. }
            | Collective::Broadcast { axes }
            | Collective::Slice { axes, .. }
            | Collective::MakePartial { axes } => axes,
        }
    }

    /// Short kind name (`all-gather`, ...).
    pub fn kind(&self) -> &'static str {
        match self {
            Collective::AllGather { .. } => "all-gather",
            Collective::AllReduce { .. } => "all-reduce",
            Collective::ReduceScatter { .. } => "reduce-scatter",
            Collective::AllToAll { .. } => "all-to-all",
            Collective::Broadcast { .. } => "broadcast",
            Collective::Slice { .. } => "slice",
            Collective::MakePartial { .. } => "make-partial",
        }
    }

    /// True for the local re-layouts that move no data.
    pub fn is_local(&self) -> bool {
        matches!(self, Collective::Slice { .. } | Collective::MakePartial { .. })
    }

    /// The shape of each rank's block after the collective, given the shape before.
    pub fn local_shape_after(&self, before: &[usize], mesh: &DeviceMesh) -> Vec<usize> {
        let mut s = before.to_vec();
        let n = mesh.group_size(self.axes());
        match self {
            Collective::AllGather { dim, .. } => s[*dim] *= n,
            Collective::ReduceScatter { dim, .. } | Collective::Slice { dim, .. } => s[*dim] /= n,
            Collective::AllToAll { split_dim, concat_dim, .. } => {
                s[*split_dim] /= n;
                s[*concat_dim] *= n;
            }
            _ => {}
        }
        s
    }

    /// Bytes as nccl-tests counts them, given each rank's block size before the collective.
    pub fn bytes(&self, local_bytes_before: usize, mesh: &DeviceMesh) -> usize {
        let n = mesh.group_size(self.axes());
        match self {
            Collective::AllGather { .. } => local_bytes_before * n,
            Collective::Slice { .. } | Collective::MakePartial { .. } => 0,
            _ => local_bytes_before,
        }
    }

    /// Seconds on `mesh`, given each rank's block size in bytes before the collective.
    pub fn cost(&self, local_bytes_before: usize, mesh: &DeviceMesh) -> f64 {
        let n = mesh.group_size(self.axes());
        if self.is_local() || n == 1 {
            return 0.0;
        }
        let nf = n as f64;
        let factor = match self {
            Collective::AllReduce { .. } => 2.0 * (nf - 1.0) / nf,
            Collective::Broadcast { .. } => 1.0,
            _ => (nf - 1.0) / nf,
        };
        let gather = !matches!(self, Collective::AllReduce { .. } | Collective::ReduceScatter { .. });
        mesh.time(self.axes(), factor * self.bytes(local_bytes_before, mesh) as f64, gather)
    }
}

fn axes_text(axes: &[usize]) -> String {
    axes.iter().map(|a| a.to_string()).collect()
}

impl fmt::Display for Collective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ax = axes_text(self.axes());
        match self {
            Collective::AllGather { dim, .. } => write!(f, "all-gather(dim {dim}, axes {ax})"),
            Collective::AllReduce { op: ReduceKind::Sum, .. } => write!(f, "all-reduce(axes {ax})"),
            Collective::AllReduce { op: ReduceKind::Max, .. } => write!(f, "all-reduce-max(axes {ax})"),
            Collective::ReduceScatter { dim, .. } => write!(f, "reduce-scatter(dim {dim}, axes {ax})"),
            Collective::AllToAll { split_dim, concat_dim, .. } => {
                write!(f, "all-to-all(split dim {split_dim}, gather dim {concat_dim}, axes {ax})")
            }
            Collective::Broadcast { .. } => write!(f, "broadcast(axes {ax})"),
            Collective::Slice { dim, .. } => write!(f, "slice(dim {dim}, axes {ax})"),
            Collective::MakePartial { .. } => write!(f, "make-partial(axes {ax})"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mesh::Link;

    #[test]
    fn ring_factors() {
        let m = DeviceMesh::new(vec![4], vec!["x".into()], vec![Link::linear(1.0, 1.0)]).unwrap();
        let ar = Collective::AllReduce { axes: vec![0], op: ReduceKind::Sum };
        assert_eq!(ar.cost(100, &m), 1.0 + 150.0);
        let ag = Collective::AllGather { axes: vec![0], dim: 0 };
        assert_eq!(ag.cost(100, &m), 1.0 + 300.0);
        let rs = Collective::ReduceScatter { axes: vec![0], dim: 0 };
        assert_eq!(rs.cost(400, &m), 1.0 + 300.0);
        assert_eq!(Collective::Slice { axes: vec![0], dim: 0 }.cost(400, &m), 0.0);
    }
}
