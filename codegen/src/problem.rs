//! The solver's problem for one training graph on one mesh.
//!
//! - One solver node per IR node, in topological order (time step = position). Its strategies
//!   are the sharding strategies of the op ([`sharding::strategies`]), restricted by the
//!   [`Baseline`] when one is pinned; its cost is the strategy's compute plus own-collective
//!   seconds, its usage the strategy's output bytes per rank.
//! - Live intervals: a value is live from its producer's step to its last consumer's step;
//!   parameters, optimizer state and constants are resident for the whole step; an optimizer
//!   update writes into its parameter's storage, so it adds no memory.
//! - One edge per producer/consumer pair: for every pair of strategies, the seconds of the
//!   cheapest layout conversion between the producer's output spec and the consumer's input spec
//!   ([`sharding::LayoutConverter`]); several values between the same pair add up.
//! - Ties: a parameter (or state) and its updated value must have the same spec: edge entries
//!   with different specs are forbidden (cost 10^18).
//!
//! Costs are integers in picoseconds; usages are bytes.

use std::collections::HashMap;
use std::sync::Arc;

use ir::{Graph, NodeIndex, Op, Value};
use sharding::{DeviceMesh, DeviceProfile, LayoutConverter, Search, ShardingSpec, Strategy};

use crate::{Error, Result};

/// Cost of a forbidden pair (IOPDDL's convention).
pub const FORBIDDEN: u64 = 1_000_000_000_000_000_000;

/// Seconds to the solver's integer cost unit (picoseconds).
pub fn to_cost(seconds: f64) -> u64 {
    (seconds * 1e12).round().clamp(0.0, (FORBIDDEN - 1) as f64) as u64
}

/// Which strategies a plan may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Baseline {
    /// Any strategy: the solver chooses.
    Auto,
    /// Data parallel: the batch split over every mesh axis it divides; parameters, gradients'
    /// updates and optimizer state replicated.
    Dp,
    /// Megatron: the batch split over the outer axes (data parallel), parameters replicated over
    /// them and free (tensor parallel) on the innermost axis.
    Megatron,
    /// ZeRO: data parallel with parameters, their updates and optimizer state sharded over the
    /// data axes.
    Zero,
}

impl Baseline {
    /// All of them.
    pub const ALL: [Baseline; 4] = [Baseline::Auto, Baseline::Dp, Baseline::Megatron, Baseline::Zero];
    /// Name as on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Baseline::Auto => "auto",
            Baseline::Dp => "dp",
            Baseline::Megatron => "megatron",
            Baseline::Zero => "zero",
        }
    }
}

impl std::str::FromStr for Baseline {
    type Err = String;
    fn from_str(s: &str) -> Result<Baseline, String> {
        Baseline::ALL
            .into_iter()
            .find(|b| b.name() == s)
            .ok_or_else(|| format!("unknown strategy `{s}` (auto, dp, megatron, zero)"))
    }
}

/// The problem and what each of its nodes and strategies stands for.
pub struct Built {
    /// The solver's problem.
    pub problem: solver::Problem,
    /// Graph node of each solver node (topological order).
    pub nodes: Vec<NodeIndex>,
    /// Strategies of each solver node (same order as the problem's).
    pub strategies: Vec<Vec<Strategy>>,
    /// The layout converter (its cache holds every conversion priced).
    pub converter: Arc<LayoutConverter>,
    /// Strategies generated before any restriction.
    pub total_strategies: usize,
    /// Nodes tied to the same node of the previous repeated layer.
    pub tied: usize,
}

/// Mesh axes of size > 1.
fn real_axes(mesh: &DeviceMesh) -> Vec<usize> {
    (0..mesh.ndim()).filter(|&a| mesh.shape()[a] > 1).collect()
}

/// The data axes of a baseline: every real axis for dp and zero; all but the innermost for megatron.
fn data_axes(mesh: &DeviceMesh, b: Baseline) -> Vec<usize> {
    let mut axes = real_axes(mesh);
    if b == Baseline::Megatron {
        axes.pop();
    }
    axes
}

/// The batch split a baseline gives an input of batch size `batch`: the longest prefix of the
/// data axes whose product divides it.
fn batch_axes(mesh: &DeviceMesh, b: Baseline, batch: usize) -> Vec<usize> {
    let mut chosen = vec![];
    for a in data_axes(mesh, b) {
        let mut t = chosen.clone();
        t.push(a);
        if batch.is_multiple_of(mesh.group_size(&t)) {
            chosen = t;
        }
    }
    chosen
}

fn is_resident(op: &Op) -> bool {
    matches!(op, Op::Param { .. } | Op::State { .. })
}

/// Whether a baseline allows strategy `s` at node `n`.
fn allowed(g: &Graph, n: NodeIndex, s: &Strategy, b: Baseline, mesh: &DeviceMesh) -> bool {
    let node = g.node(n);
    let out = &s.outputs[0];
    match (&node.op, b) {
        (_, Baseline::Auto) => true,
        (Op::Input { .. }, _) => {
            let shape = &node.outputs[0].shape;
            if shape.is_empty() {
                return out.is_replicated();
            }
            let want = ShardingSpec::shard(shape.len(), 0, &batch_axes(mesh, b, shape[0]));
            *out == want
        }
        (op, Baseline::Dp) if is_resident(op) => out.is_replicated(),
        (op, Baseline::Megatron) if is_resident(op) => {
            let data = data_axes(mesh, b);
            !out.is_partial() && out.used_axes().iter().all(|a| !data.contains(a))
        }
        (op, Baseline::Zero) if is_resident(op) => {
            let data = data_axes(mesh, b);
            // Sharded over every data axis when the tensor divides; small tensors stay replicated.
            !out.is_partial() && (data.iter().all(|a| out.used_axes().contains(a)) || out.is_replicated())
        }
        _ => true,
    }
}

/// Builds the problem (see the module docs) with the strategies `baseline` allows. `budget` is
/// bytes per rank.
pub fn build(
    g: &Graph,
    mesh: &DeviceMesh,
    profile: &DeviceProfile,
    baseline: Baseline,
    budget: Option<u64>,
    tie_layers: bool,
) -> Result<Built> {
    let full = build_all(g, mesh, profile, budget, tie_layers)?;
    if baseline == Baseline::Auto { Ok(full) } else { full.restrict(g, mesh, baseline) }
}

impl Built {
    /// The sub-problem with only the strategies `baseline` allows (replication where none is).
    pub fn restrict(&self, g: &Graph, mesh: &DeviceMesh, baseline: Baseline) -> Result<Built> {
        let mut keep: Vec<Vec<usize>> = Vec::with_capacity(self.nodes.len());
        for (i, &n) in self.nodes.iter().enumerate() {
            let st = &self.strategies[i];
            let mut k: Vec<usize> = (0..st.len()).filter(|&j| allowed(g, n, &st[j], baseline, mesh)).collect();
            if k.is_empty() {
                k = (0..st.len())
                    .filter(|&j| st[j].inputs.iter().chain(&st[j].outputs).all(|x| x.is_replicated()))
                    .collect();
            }
            if k.is_empty() {
                return Err(Error::Internal(format!("node {} has no strategy", g.node(n).name)));
            }
            keep.push(k);
        }
        let nodes = self
            .problem
            .nodes
            .iter()
            .zip(&keep)
            .map(|(nd, k)| solver::Node {
                interval: nd.interval,
                costs: k.iter().map(|&j| nd.costs[j]).collect(),
                usages: k.iter().map(|&j| nd.usages[j]).collect(),
            })
            .collect();
        let edges = self
            .problem
            .edges
            .iter()
            .map(|e| {
                let (a, b) = e.nodes;
                let nb = self.strategies[b].len();
                let costs = keep[a].iter().flat_map(|&i| keep[b].iter().map(move |&j| e.costs[i * nb + j])).collect();
                solver::Edge { nodes: e.nodes, costs }
            })
            .collect();
        let problem =
            solver::Problem { name: self.problem.name.clone(), nodes, edges, usage_limit: self.problem.usage_limit };
        let strategies =
            keep.iter().zip(&self.strategies).map(|(k, st)| k.iter().map(|&j| st[j].clone()).collect()).collect();
        Ok(Built {
            problem,
            nodes: self.nodes.clone(),
            strategies,
            converter: self.converter.clone(),
            total_strategies: self.total_strategies,
            tied: self.tied,
        })
    }
}

/// Builds the unrestricted problem.
fn build_all(
    g: &Graph,
    mesh: &DeviceMesh,
    profile: &DeviceProfile,
    budget: Option<u64>,
    tie_layers: bool,
) -> Result<Built> {
    let order = g.topo_order().map_err(|n| Error::Graph(format!("cycle at node {}", g.node(n).name)))?;
    let pos: HashMap<NodeIndex, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let steps = order.len() as u64;
    let converter = Arc::new(LayoutConverter::new(mesh.clone(), Search::Auto));
    let mut strategies: Vec<Vec<Strategy>> = Vec::with_capacity(order.len());
    let mut total = 0;
    for &n in &order {
        let all = sharding::strategies(g, n, mesh, profile)?;
        total += all.len();
        strategies.push(all);
    }
    // Live intervals.
    let outputs: Vec<NodeIndex> = g.outputs.iter().map(|(_, v)| v.node).collect();
    let updated: Vec<NodeIndex> = g.updates.iter().map(|(_, v)| v.node).collect();
    let mut nodes = Vec::with_capacity(order.len());
    for (i, &n) in order.iter().enumerate() {
        let op = &g.node(n).op;
        let last = (0..g.node(n).outputs.len())
            .flat_map(|s| g.users(Value::new(n, s)))
            .map(|(u, _)| pos[&u])
            .max()
            .unwrap_or(i);
        let interval = if is_resident(op) || matches!(op, Op::Constant(_)) {
            (0, steps)
        } else if outputs.contains(&n) {
            (i as u64, steps)
        } else {
            (i as u64, last as u64 + 1)
        };
        let writes_in_place = updated.contains(&n);
        let st = &strategies[i];
        nodes.push(solver::Node {
            interval,
            costs: st.iter().map(|s| to_cost(s.seconds())).collect(),
            usages: st.iter().map(|s| if writes_in_place { 0 } else { s.memory_bytes }).collect(),
        });
    }
    // Edges: layout conversions, merged per node pair (key: (smaller, larger) index).
    let mut edges: HashMap<(usize, usize), Vec<u64>> = HashMap::new();
    let mut add = |a: usize, b: usize, cost: &dyn Fn(usize, usize) -> u64, strategies: &[Vec<Strategy>]| {
        let (sa, sb) = (strategies[a].len(), strategies[b].len());
        let (lo, hi) = if a < b { (a, b) } else { (b, a) };
        let m = edges.entry((lo, hi)).or_insert_with(|| vec![0; sa * sb]);
        let hi_n = strategies[hi].len();
        for i in 0..sa {
            for j in 0..sb {
                let c = cost(i, j);
                let k = if a < b { i * hi_n + j } else { j * hi_n + i };
                m[k] = m[k].saturating_add(c).min(FORBIDDEN);
            }
        }
    };
    // Conversions priced so far, keyed by reference (the converter's own cache clones its keys).
    let mut priced: HashMap<(&[usize], usize, &ShardingSpec, &ShardingSpec), u64> = HashMap::new();
    for (iv, &v) in order.iter().enumerate() {
        for (slot_in, val) in g.node_inputs(v).iter().enumerate() {
            let iu = pos[&val.node];
            let meta = g.meta(*val);
            // Price each distinct (output spec, input spec) pair once.
            let (outs, out_idx) = distinct(strategies[iu].iter().map(|s| &s.outputs[val.slot]));
            let (ins, in_idx) = distinct(strategies[iv].iter().map(|s| &s.inputs[slot_in]));
            let mut price = vec![0u64; outs.len() * ins.len()];
            for (a, from) in outs.iter().enumerate() {
                for (b, to) in ins.iter().enumerate() {
                    price[a * ins.len() + b] = if from == to {
                        0
                    } else {
                        let key = (meta.shape.as_slice(), meta.dtype.size(), *from, *to);
                        match priced.get(&key) {
                            Some(&c) => c,
                            None => {
                                let c = to_cost(converter.convert(&meta.shape, meta.dtype.size(), from, to)?.cost);
                                priced.insert(key, c);
                                c
                            }
                        }
                    };
                }
            }
            let cost = |i: usize, j: usize| -> u64 { price[out_idx[i] * ins.len() + in_idx[j]] };
            add(iu, iv, &cost, &strategies);
        }
    }
    for (p, val) in &g.updates {
        let (ip, iu) = (pos[p], pos[&val.node]);
        let cost = |i: usize, j: usize| -> u64 {
            if strategies[ip][i].outputs[0] == strategies[iu][j].outputs[val.slot] { 0 } else { FORBIDDEN }
        };
        add(ip, iu, &cost, &strategies);
    }
    // Repeated layers: the same op at the same place of consecutive blocks takes the same
    // strategy (an equality edge: forbidden off the diagonal).
    let mut tied = 0;
    if tie_layers {
        let mut groups: HashMap<(String, &'static str, String), Vec<usize>> = HashMap::new();
        for (i, &n) in order.iter().enumerate() {
            let node = g.node(n);
            let key = layer_pattern(&node.name);
            if key != node.name {
                let metas: Vec<String> = node.outputs.iter().map(|m| m.to_string()).collect();
                groups.entry((key, node.op.name(), metas.join(","))).or_default().push(i);
            }
        }
        let mut group_list: Vec<Vec<usize>> = groups.into_values().filter(|v| v.len() > 1).collect();
        group_list.sort();
        for members in group_list {
            for w in members.windows(2) {
                let (a, b) = (w[0], w[1]);
                let same = strategies[a].len() == strategies[b].len()
                    && strategies[a]
                        .iter()
                        .zip(&strategies[b])
                        .all(|(x, y)| x.inputs == y.inputs && x.outputs == y.outputs && x.local == y.local);
                if same {
                    add(a, b, &|i, j| if i == j { 0 } else { FORBIDDEN }, &strategies);
                    tied += 1;
                }
            }
        }
    }
    let mut edge_list: Vec<((usize, usize), Vec<u64>)> = edges.into_iter().collect();
    edge_list.sort_by_key(|e| e.0);
    let problem = solver::Problem {
        name: g.name.clone(),
        nodes,
        edges: edge_list.into_iter().map(|((a, b), costs)| solver::Edge { nodes: (a, b), costs }).collect(),
        usage_limit: budget,
    };
    problem.validate()?;
    Ok(Built { problem, nodes: order, strategies, converter, total_strategies: total, tied })
}

/// The distinct specs of a list, and each element's index among them.
fn distinct<'a>(specs: impl Iterator<Item = &'a ShardingSpec>) -> (Vec<&'a ShardingSpec>, Vec<usize>) {
    let mut uniq: Vec<&ShardingSpec> = vec![];
    let mut seen: HashMap<&ShardingSpec, usize> = HashMap::new();
    let idx = specs
        .map(|s| {
            *seen.entry(s).or_insert_with(|| {
                uniq.push(s);
                uniq.len() - 1
            })
        })
        .collect();
    (uniq, idx)
}

/// A node name with its layer indices replaced by `#`: every digit run between a `.` and a `.`,
/// `/` or the end (`/h.3/attn/MatMul` and `h.3.mlp.c_fc.weight` give `/h.#/attn/MatMul` and
/// `h.#.mlp.c_fc.weight`), so the same op of every block has the same pattern.
pub fn layer_pattern(name: &str) -> String {
    let b = name.as_bytes();
    let mut out = String::with_capacity(name.len());
    let mut i = 0;
    while i < b.len() {
        if b[i].is_ascii_digit() && i > 0 && b[i - 1] == b'.' {
            let mut j = i;
            while j < b.len() && b[j].is_ascii_digit() {
                j += 1;
            }
            if j == b.len() || b[j] == b'.' || b[j] == b'/' {
                out.push('#');
                i = j;
                continue;
            }
        }
        out.push(b[i] as char);
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_patterns() {
        assert_eq!(layer_pattern("/m/transformer/h.11/attn/MatMul"), "/m/transformer/h.#/attn/MatMul");
        assert_eq!(layer_pattern("h.3.mlp.c_fc.weight/m"), "h.#.mlp.c_fc.weight/m");
        assert_eq!(layer_pattern("onnx::MatMul_471"), "onnx::MatMul_471");
        assert_eq!(layer_pattern("layer.2"), "layer.#");
        assert_eq!(layer_pattern("v1.5x"), "v1.5x");
    }
}
