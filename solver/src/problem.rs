//! The cost-graph problem and its IOPDDL JSON form.
//!
//! Invariants kept by [`Problem::validate`] (and so by every problem this module reads):
//! every node has at least one strategy and as many usages as costs (in each of its live
//! intervals); every interval has `start <= end`; every edge names existing nodes and its cost
//! matrix has `|strategies(u)| * |strategies(v)|` entries, row-major over `u` then `v`.
//!
//! Beyond IOPDDL, a node may have further live intervals ([`Node::extra`]): a node that stands
//! for several tensors sharing one decision (ops merged into their producer, the same op of
//! every repeated layer; see [`crate::fold`]) keeps each tensor's own interval and usages. In
//! JSON they are an optional `nodes.extra` list, absent when no node has any.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// One operator: its live interval and its strategies' costs and memory usages.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Node {
    /// Half-open live interval `[start, end)`: the node is live at time `t` iff `start <= t < end`.
    pub interval: (u64, u64),
    /// Cost of each strategy.
    pub costs: Vec<u64>,
    /// Memory usage of each strategy while the node is live.
    pub usages: Vec<u64>,
    /// Further live intervals, each with its own usage per strategy (empty for IOPDDL nodes).
    /// The node's usage at time `t` is the sum over all its intervals containing `t`.
    pub extra: Vec<Live>,
}

/// A further live interval of a [`Node`]: while it is live, strategy `s` uses `usages[s]`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Live {
    /// Half-open interval `[start, end)`.
    pub interval: (u64, u64),
    /// Usage of each of the node's strategies.
    pub usages: Vec<u64>,
}

impl Node {
    /// A node with one live interval (an IOPDDL node).
    pub fn new(interval: (u64, u64), costs: Vec<u64>, usages: Vec<u64>) -> Node {
        Node { interval, costs, usages, extra: Vec::new() }
    }

    /// Number of strategies.
    pub fn strategies(&self) -> usize {
        self.costs.len()
    }

    /// Every live interval with its usages: the primary one first, then [`Node::extra`].
    pub fn lives(&self) -> impl Iterator<Item = ((u64, u64), &[u64])> {
        std::iter::once((self.interval, self.usages.as_slice()))
            .chain(self.extra.iter().map(|l| (l.interval, l.usages.as_slice())))
    }

    /// The node with only strategies `keep` (indices, in the new order).
    pub fn restricted(&self, keep: &[usize]) -> Node {
        let pick = |v: &[u64]| keep.iter().map(|&s| v[s]).collect::<Vec<u64>>();
        Node {
            interval: self.interval,
            costs: pick(&self.costs),
            usages: pick(&self.usages),
            extra: self.extra.iter().map(|l| Live { interval: l.interval, usages: pick(&l.usages) }).collect(),
        }
    }

    /// Whether the node's memory does not depend on its strategy (every interval is empty or
    /// has equal usages).
    pub fn memory_free(&self) -> bool {
        self.lives().all(|((s, e), us)| s >= e || us.iter().all(|&u| u == us[0]))
    }
}

/// A dependency between two nodes with a cost for every pair of their strategies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Edge {
    /// The two endpoints `(u, v)`.
    pub nodes: (usize, usize),
    /// Row-major costs: the pair `(s_u, s_v)` costs `costs[s_u * |strategies(v)| + s_v]`.
    /// Shared: the edges of repeated layers hold one matrix (a 70B LLaMA on 8x8x8 has 80
    /// copies of each layer's ~10 M entries).
    pub costs: std::sync::Arc<[u64]>,
}

impl Edge {
    /// The cost with endpoint `a` (either end) at strategy `sa` and the other end at `sb`;
    /// `k[i]` is the strategy count of node `i`. The one place that indexes [`Edge::costs`] by
    /// a side: rows are always `u`'s strategies, columns `v`'s, whichever side asks.
    pub fn cost_from(&self, a: usize, sa: usize, sb: usize, k: &[usize]) -> u64 {
        let (u, v) = self.nodes;
        if a == u { self.costs[sa * k[v] + sb] } else { self.costs[sb * k[v] + sa] }
    }
}

/// A cost-graph problem: choose one strategy per node minimising node plus edge costs, such that
/// at every time step the usages of the live nodes sum to at most `usage_limit`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Problem {
    /// Name (free text).
    pub name: String,
    /// Nodes, indexed from 0.
    pub nodes: Vec<Node>,
    /// Edges.
    pub edges: Vec<Edge>,
    /// Memory limit per time step; `None` means unlimited.
    pub usage_limit: Option<u64>,
}

#[derive(Serialize, Deserialize)]
struct FileJson {
    problem: ProblemJson,
}

#[derive(Serialize, Deserialize)]
struct ProblemJson {
    #[serde(default)]
    name: String,
    nodes: NodesJson,
    #[serde(default)]
    edges: EdgesJson,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    usage_limit: Option<u64>,
}

#[derive(Serialize, Deserialize)]
struct NodesJson {
    intervals: Vec<[u64; 2]>,
    costs: Vec<Vec<u64>>,
    usages: Vec<Vec<u64>>,
    /// Extension: each node's further live intervals (absent in IOPDDL files).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    extra: Vec<Vec<LiveJson>>,
}

#[derive(Serialize, Deserialize)]
struct LiveJson {
    interval: [u64; 2],
    usages: Vec<u64>,
}

#[derive(Serialize, Deserialize, Default)]
struct EdgesJson {
    #[serde(default)]
    nodes: Vec<[usize; 2]>,
    #[serde(default)]
    costs: Vec<Vec<u64>>,
}

/// The largest problem read, compressed or not (the contest's largest is 29 MB of JSON).
pub const MAX_PROBLEM_BYTES: u64 = 1 << 30;

/// Reads the regular file `path` if it has at most `max` bytes. A device would be read forever
/// and a FIFO would block: they are refused before anything is read, as `ir::files` does for the
/// other crates (this one depends on none of them).
fn read_regular(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    use std::io::{Error as IoError, ErrorKind};
    let refuse = |m: std::fs::Metadata| {
        let t = m.file_type();
        #[cfg(unix)]
        use std::os::unix::fs::FileTypeExt;
        #[cfg(unix)]
        let what = if t.is_dir() {
            "a directory"
        } else if t.is_fifo() {
            "a FIFO"
        } else if t.is_char_device() {
            "a character device"
        } else if t.is_block_device() {
            "a block device"
        } else {
            "not a file"
        };
        #[cfg(not(unix))]
        let what = if t.is_dir() { "a directory" } else { "not a file" };
        IoError::new(ErrorKind::InvalidInput, format!("not a regular file ({what})"))
    };
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(refuse(meta));
    }
    let mut opts = std::fs::OpenOptions::new();
    opts.read(true);
    #[cfg(unix)]
    {
        // No blocking open if the path became a FIFO since the check above.
        use std::os::unix::fs::OpenOptionsExt;
        opts.custom_flags(libc::O_NONBLOCK);
    }
    let f = opts.open(path)?;
    let meta = f.metadata()?;
    if !meta.is_file() {
        return Err(refuse(meta));
    }
    let mut out = Vec::with_capacity(meta.len().min(max) as usize);
    f.take(max.saturating_add(1)).read_to_end(&mut out)?;
    if out.len() as u64 > max {
        return Err(IoError::new(ErrorKind::InvalidData, format!("the file has more than the {max} bytes expected")));
    }
    Ok(out)
}

impl Problem {
    /// Reads an IOPDDL problem from a `.json` or gzipped file (detected by its magic bytes): a
    /// regular file of at most [`MAX_PROBLEM_BYTES`], compressed and uncompressed.
    pub fn read(path: impl AsRef<Path>) -> Result<Problem> {
        let path = path.as_ref();
        let io = |cause| Error::Io { path: path.to_path_buf(), cause };
        let raw = read_regular(path, MAX_PROBLEM_BYTES).map_err(io)?;
        let text = if raw.starts_with(&[0x1f, 0x8b]) {
            let mut out = Vec::new();
            let parse = |message: String| Error::Parse { path: path.to_path_buf(), message };
            flate2::read::MultiGzDecoder::new(&raw[..])
                .take(MAX_PROBLEM_BYTES + 1)
                .read_to_end(&mut out)
                .map_err(|e| parse(format!("bad gzip data: {e}")))?;
            if out.len() as u64 > MAX_PROBLEM_BYTES {
                return Err(parse(format!("decompresses to more than {MAX_PROBLEM_BYTES} bytes")));
            }
            out
        } else {
            raw
        };
        Self::from_json_bytes_at(&text, path.to_path_buf())
    }

    /// Parses an IOPDDL problem from JSON bytes.
    pub fn from_json_bytes(bytes: &[u8]) -> Result<Problem> {
        Self::from_json_bytes_at(bytes, PathBuf::from("<memory>"))
    }

    fn from_json_bytes_at(bytes: &[u8], path: PathBuf) -> Result<Problem> {
        let file: FileJson =
            serde_json::from_slice(bytes).map_err(|e| Error::Parse { path, message: e.to_string() })?;
        let p = file.problem;
        let n = p.nodes.intervals.len();
        if p.nodes.costs.len() != n || p.nodes.usages.len() != n {
            return Err(Error::InvalidProblem(format!(
                "nodes.intervals has {n} entries but nodes.costs has {} and nodes.usages has {}",
                p.nodes.costs.len(),
                p.nodes.usages.len()
            )));
        }
        if p.edges.nodes.len() != p.edges.costs.len() {
            return Err(Error::InvalidProblem(format!(
                "edges.nodes has {} entries but edges.costs has {}",
                p.edges.nodes.len(),
                p.edges.costs.len()
            )));
        }
        if !p.nodes.extra.is_empty() && p.nodes.extra.len() != n {
            return Err(Error::InvalidProblem(format!(
                "nodes.intervals has {n} entries but nodes.extra has {}",
                p.nodes.extra.len()
            )));
        }
        let mut extra = p.nodes.extra.into_iter();
        let nodes = p
            .nodes
            .intervals
            .into_iter()
            .zip(p.nodes.costs)
            .zip(p.nodes.usages)
            .map(|((iv, costs), usages)| Node {
                interval: (iv[0], iv[1]),
                costs,
                usages,
                extra: extra
                    .next()
                    .unwrap_or_default()
                    .into_iter()
                    .map(|l| Live { interval: (l.interval[0], l.interval[1]), usages: l.usages })
                    .collect(),
            })
            .collect();
        let edges = p
            .edges
            .nodes
            .into_iter()
            .zip(p.edges.costs)
            .map(|(uv, costs)| Edge { nodes: (uv[0], uv[1]), costs: costs.into() })
            .collect();
        let problem = Problem { name: p.name, nodes, edges, usage_limit: p.usage_limit };
        problem.validate()?;
        Ok(problem)
    }

    /// Checks the invariants listed in the module docs.
    pub fn validate(&self) -> Result<()> {
        for (i, node) in self.nodes.iter().enumerate() {
            if node.costs.is_empty() {
                return Err(Error::InvalidProblem(format!("node {i} has no strategies")));
            }
            if node.costs.len() != node.usages.len() {
                return Err(Error::InvalidProblem(format!(
                    "node {i} has {} costs but {} usages",
                    node.costs.len(),
                    node.usages.len()
                )));
            }
            for ((start, end), usages) in node.lives() {
                if start > end {
                    return Err(Error::InvalidProblem(format!(
                        "node {i} has interval [{start}, {end}) with start after end"
                    )));
                }
                if usages.len() != node.costs.len() {
                    return Err(Error::InvalidProblem(format!(
                        "node {i} has {} costs but {} usages in interval [{start}, {end})",
                        node.costs.len(),
                        usages.len()
                    )));
                }
            }
        }
        let n = self.nodes.len();
        for (e, edge) in self.edges.iter().enumerate() {
            let (u, v) = edge.nodes;
            if u >= n || v >= n {
                return Err(Error::InvalidProblem(format!(
                    "edge {e} joins nodes {u} and {v} but there are only {n} nodes"
                )));
            }
            let want = self.nodes[u].strategies() * self.nodes[v].strategies();
            if edge.costs.len() != want {
                return Err(Error::InvalidProblem(format!(
                    "edge {e} ({u}, {v}) has {} costs, expected {} x {} = {want}",
                    edge.costs.len(),
                    self.nodes[u].strategies(),
                    self.nodes[v].strategies()
                )));
            }
        }
        Ok(())
    }

    /// The IOPDDL JSON text of this problem.
    pub fn to_json(&self) -> String {
        let file = FileJson {
            problem: ProblemJson {
                name: self.name.clone(),
                nodes: NodesJson {
                    intervals: self.nodes.iter().map(|n| [n.interval.0, n.interval.1]).collect(),
                    costs: self.nodes.iter().map(|n| n.costs.clone()).collect(),
                    usages: self.nodes.iter().map(|n| n.usages.clone()).collect(),
                    extra: if self.nodes.iter().all(|n| n.extra.is_empty()) {
                        Vec::new()
                    } else {
                        self.nodes
                            .iter()
                            .map(|n| {
                                n.extra
                                    .iter()
                                    .map(|l| LiveJson {
                                        interval: [l.interval.0, l.interval.1],
                                        usages: l.usages.clone(),
                                    })
                                    .collect()
                            })
                            .collect()
                    },
                },
                edges: EdgesJson {
                    nodes: self.edges.iter().map(|e| [e.nodes.0, e.nodes.1]).collect(),
                    costs: self.edges.iter().map(|e| e.costs.to_vec()).collect(),
                },
                usage_limit: self.usage_limit,
            },
        };
        // Serialising plain integers and strings cannot fail.
        serde_json::to_string(&file).unwrap_or_default()
    }

    /// Writes the problem as IOPDDL JSON, gzipped when the path ends in `.gz`.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let io = |cause| Error::Io { path: path.to_path_buf(), cause };
        let text = self.to_json();
        if path.extension().is_some_and(|e| e == "gz") {
            let file = std::fs::File::create(path).map_err(io)?;
            let mut gz = flate2::write::GzEncoder::new(file, flate2::Compression::default());
            gz.write_all(text.as_bytes()).map_err(io)?;
            gz.finish().map_err(io)?;
            Ok(())
        } else {
            std::fs::write(path, text).map_err(io)
        }
    }

    /// Total number of strategies over all nodes.
    pub fn total_strategies(&self) -> usize {
        self.nodes.iter().map(Node::strategies).sum()
    }

    /// Checks that `solution` has one in-range strategy per node.
    pub fn check_solution(&self, solution: &[usize]) -> Result<()> {
        if solution.len() != self.nodes.len() {
            return Err(Error::InvalidSolution(format!(
                "{} strategies given for {} nodes",
                solution.len(),
                self.nodes.len()
            )));
        }
        for (i, (&s, node)) in solution.iter().zip(&self.nodes).enumerate() {
            if s >= node.strategies() {
                return Err(Error::InvalidSolution(format!(
                    "node {i} has strategy {s} but only {} strategies",
                    node.strategies()
                )));
            }
        }
        Ok(())
    }
}

/// Reads a solution file: a JSON list of strategy indices (or `{"solution": [...]}`).
pub fn read_solution(path: impl AsRef<Path>) -> Result<Vec<usize>> {
    let path = path.as_ref();
    let raw = read_regular(path, MAX_PROBLEM_BYTES).map_err(|cause| Error::Io { path: path.to_path_buf(), cause })?;
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Sol {
        List(Vec<usize>),
        Obj { solution: Vec<usize> },
    }
    match serde_json::from_slice::<Sol>(&raw) {
        Ok(Sol::List(v)) | Ok(Sol::Obj { solution: v }) => Ok(v),
        Err(e) => Err(Error::Parse {
            path: path.to_path_buf(),
            message: format!("expected a JSON list of strategy indices: {e}"),
        }),
    }
}

/// Writes a solution as a JSON list of strategy indices.
pub fn write_solution(path: impl AsRef<Path>, solution: &[usize]) -> Result<()> {
    let path = path.as_ref();
    let text = serde_json::to_string(solution).unwrap_or_default();
    std::fs::write(path, text + "\n").map_err(|cause| Error::Io { path: path.to_path_buf(), cause })
}
