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
//!
//! Before solving, [`Built::groups`] folds the problem ([`solver::fold()`]) so that the solver sees
//! one decision per group of nodes, each node keeping its own live interval:
//!
//! - *exact ties*: a node whose strategy is a function of a neighbour's (every row of their edge
//!   has exactly one allowed entry, as between a parameter, its update and its optimizer state)
//!   joins the neighbour's group; this loses nothing;
//! - *follow ops* ([`Merge`]): an elementwise op, reshape, transpose, cast, slice, split,
//!   reduction or softmax whose inputs are one producer's value plus much smaller ones (a bias,
//!   a constant) joins that producer's group. With [`Merge::Proven`] (the default) only when,
//!   for each of the producer's strategies, one of its responses provably does at least as well
//!   as any other whatever its other neighbours choose (`proven_response`), so this loses
//!   nothing either. [`Merge::Cheapest`] takes the cheapest response unconditionally, as Alpa
//!   does: it merges far more but the follower can no longer convert to a layout its own
//!   consumers prefer (BENCHMARKS.md measures plans 0.35% worse on GPT-2 small and 6% worse on
//!   a 96-layer GPT);
//! - *repeated layers* (with `tie_layers`): the groups of the same ops in every transformer
//!   block ([`layer_pattern`]), with identical strategy lists, become one group: the decision is
//!   shared by every layer.

use std::collections::HashMap;
use std::sync::Arc;

use ::plan::AxisRole;
use ir::{Graph, NodeIndex, Op, Value};
use sharding::fx::FxMap;
use sharding::{DeviceMesh, DeviceProfile, LayoutConverter, Search, ShardingSpec, Strategy};

use crate::{Error, Result};

/// Cost of a forbidden pair (IOPDDL's convention).
pub const FORBIDDEN: u64 = 1_000_000_000_000_000_000;

/// Most edge-cost entries a problem may hold (8 bytes each, copied a few times by the solves:
/// 2 GiB): counted as built (equal matrices once) and as folded (one matrix per pair of
/// groups). The zoo's largest on 2x2x2, unet, has 37 M.
pub const MAX_EDGE_ENTRIES: u64 = 250_000_000;

/// Seconds to the solver's integer cost unit (picoseconds).
pub fn to_cost(seconds: f64) -> u64 {
    (seconds * 1e12).round().clamp(0.0, (FORBIDDEN - 1) as f64) as u64
}

pub use ::plan::Baseline;

/// The problem and what each of its nodes and strategies stands for.
#[derive(Clone)]
pub struct Built {
    /// The solver's problem.
    pub problem: solver::Problem,
    /// Graph node of each solver node (topological order).
    pub nodes: Vec<NodeIndex>,
    /// Strategies of each solver node (same order as the problem's), shared with the problems
    /// restricted from this one and between nodes with the same op and shapes.
    pub strategies: Vec<Vec<Arc<Strategy>>>,
    /// The layout converter (its cache holds every conversion priced).
    pub converter: Arc<LayoutConverter>,
    /// Strategies generated before any restriction.
    pub total_strategies: usize,
    /// Conversion prices (source spec, target spec, tensor) taken from a direct path
    /// ([`sharding::convert::direct`]) instead of the search, because the build ran past its
    /// time limit; 0 when every price is the search's.
    pub estimated_conversions: usize,
}

/// A built problem folded by its groups ([`Built::fold`]).
pub struct Folding {
    /// The folded problem and the map back.
    pub folded: solver::Folded,
    /// Nodes sharing a repeated layer's decision ([`Groups::tied`]).
    pub tied: usize,
}

/// Which follow ops join their producer's decision (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Merge {
    /// None (exact ties only).
    Off,
    /// Those for which a response is proven at least as good as any other (keeps the optimum).
    #[default]
    Proven,
    /// All of them, each with its cheapest response (Alpa's follow; can lose several percent).
    Cheapest,
}

impl std::str::FromStr for Merge {
    type Err = String;
    fn from_str(s: &str) -> Result<Merge, String> {
        match s {
            "off" => Ok(Merge::Off),
            "proven" => Ok(Merge::Proven),
            "cheapest" => Ok(Merge::Cheapest),
            _ => Err(format!("unknown merge mode `{s}` (off, proven, cheapest)")),
        }
    }
}

/// How [`Built::groups`] groups the problem's nodes (exact ties always).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Grouping {
    /// Which follow ops join their producers.
    pub merge: Merge,
    /// Share the decisions of repeated layers.
    pub tie_layers: bool,
}

/// Groups of solver nodes that share one decision ([`solver::Member`] maps), see the module docs.
#[derive(Clone, Debug, Default)]
pub struct Groups {
    /// The groups with more than one member.
    pub groups: Vec<Vec<solver::Member>>,
    /// Nodes whose decision is shared with the same node of another repeated layer (members of
    /// tied groups beyond the first layer's).
    pub tied: usize,
    /// Every node whose strategy was made a function of a neighbour's (before repeated layers
    /// are tied), in the order they were attached: the groups are these links' trees.
    pub links: Vec<Link>,
}

/// One node made to follow a neighbour: when `parent` takes strategy `s`, `child` takes `map[s]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Link {
    /// The following node.
    pub child: usize,
    /// The node it follows (an endpoint of an edge with `child`).
    pub parent: usize,
    /// The child's strategy for each of the parent's.
    pub map: Vec<usize>,
    /// Why the map loses nothing, or what it gives up.
    pub why: Why,
}

/// Why a [`Link`] was made (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Why {
    /// An exact tie: each of the parent's strategies allows exactly one of the child's.
    Tie,
    /// A follow op whose response is proven at least as good as any other ([`Merge::Proven`]).
    Proven,
    /// A follow op with its cheapest response ([`Merge::Cheapest`]).
    Cheapest,
}

/// The role of every axis of `mesh` under baseline `b` (`None` for auto).
fn roles(mesh: &DeviceMesh, b: Baseline) -> Option<Vec<AxisRole>> {
    b.roles(mesh.shape())
}

/// The axes of size > 1 whose role under baseline `b` is one of `of`: the data axes (`dp`,
/// `zero`; every one for dp and zero, all but the innermost for megatron) or the sequence axes
/// (`sp`).
fn axes_of(mesh: &DeviceMesh, b: Baseline, of: &[AxisRole]) -> Vec<usize> {
    let Some(r) = roles(mesh, b) else { return vec![] };
    (0..mesh.ndim()).filter(|&a| mesh.shape()[a] > 1 && of.contains(&r[a])).collect()
}

/// The split of a dim of `size` over `axes`: each axis in turn joins it when the product of the
/// group still divides `size` (an input's batch over the data axes, its sequence over the `sp`
/// axes).
fn dividing(mesh: &DeviceMesh, axes: Vec<usize>, size: usize) -> Vec<usize> {
    let mut chosen = vec![];
    for a in axes {
        let mut t = chosen.clone();
        t.push(a);
        if size.is_multiple_of(mesh.group_size(&t)) {
            chosen = t;
        }
    }
    chosen
}

fn is_resident(op: &Op) -> bool {
    matches!(op, Op::Param { .. } | Op::State { .. })
}

/// The mesh axes (of size above 1) whose role under `b` is [`AxisRole::Zero`].
fn zero_axes(mesh: &DeviceMesh, b: Baseline) -> Vec<usize> {
    axes_of(mesh, b, &[AxisRole::Zero])
}

/// Whether a baseline allows strategy `s` at node `n` (`part`: which nodes depend on the batch
/// and which form the update part, [`crate::microbatch::update_part`]):
/// - inputs split over the data axes (`dp`, `zero`), and along their second dimension (the
///   sequence) over the `sp` axes;
/// - parameters and optimizer state replicated over the `dp` and `sp` axes, sharded over all `zero` axes
///   (or replicated over them: small tensors), free over the `tp` axes, never partial;
/// - the forward and backward keep the data axes what data parallelism makes them: a value that
///   depends on the batch is split over them along its first (batch) dimension or partial over
///   them (a weight's gradient, before its reduction), nothing else; one that does not (a
///   parameter's 16-bit copy) is whole on every `dp` and `sp` axis; the `sp` axes are otherwise
///   free, like the `tp` ones. The update part is free (the
///   gradients' reductions and ZeRO's shards are there). Without `strict`, only the first two
///   (for a node with no strategy that keeps the batch first).
fn allowed(
    g: &Graph,
    n: NodeIndex,
    s: &Strategy,
    b: Baseline,
    mesh: &DeviceMesh,
    part: &(Vec<bool>, Vec<bool>),
    strict: bool,
) -> bool {
    let node = g.node(n);
    let out = &s.outputs[0];
    let Some(r) = roles(mesh, b) else { return true };
    match &node.op {
        Op::Input { .. } => {
            let shape = &node.outputs[0].shape;
            if shape.is_empty() {
                return out.is_replicated();
            }
            let batch = dividing(mesh, axes_of(mesh, b, &[AxisRole::Dp, AxisRole::Zero]), shape[0]);
            let mut want = ShardingSpec::shard(shape.len(), 0, &batch);
            if shape.len() >= 2 {
                want = want.with_dim(1, dividing(mesh, axes_of(mesh, b, &[AxisRole::Sp]), shape[1]));
            }
            *out == want
        }
        op if is_resident(op) => {
            if out.is_partial() {
                return false;
            }
            let used = out.used_axes();
            let real = |a: usize| mesh.shape()[a] > 1;
            let zero: Vec<usize> = (0..mesh.ndim()).filter(|&a| real(a) && r[a] == AxisRole::Zero).collect();
            let replicated_on = |a: &usize| !used.contains(a);
            (0..mesh.ndim())
                .filter(|&a| real(a) && matches!(r[a], AxisRole::Dp | AxisRole::Pp | AxisRole::Sp))
                .all(|a| replicated_on(&a))
                && (zero.iter().all(|a| used.contains(a)) || zero.iter().all(replicated_on))
        }
        _ if part.1[n.index()] || !strict => true,
        _ => {
            let real = |a: usize| mesh.shape()[a] > 1;
            let specs = || s.inputs.iter().chain(&s.outputs);
            if part.0[n.index()] {
                let data: Vec<usize> =
                    (0..mesh.ndim()).filter(|&a| real(a) && matches!(r[a], AxisRole::Dp | AxisRole::Zero)).collect();
                specs().all(|x| x.dims().iter().skip(1).all(|d| d.iter().all(|a| !data.contains(a))))
            } else {
                let dp: Vec<usize> =
                    (0..mesh.ndim()).filter(|&a| real(a) && matches!(r[a], AxisRole::Dp | AxisRole::Sp)).collect();
                specs().all(|x| x.used_axes().iter().all(|a| !dp.contains(a)))
            }
        }
    }
}

/// The strategies of each node (in `order`) that `baseline` allows, by index.
fn kept(
    g: &Graph,
    order: &[NodeIndex],
    strategies: &[Vec<Arc<Strategy>>],
    mesh: &DeviceMesh,
    baseline: Baseline,
) -> Result<Vec<Vec<usize>>> {
    let mut keep: Vec<Vec<usize>> = Vec::with_capacity(order.len());
    let part = crate::microbatch::update_part(g);
    for (st, &n) in strategies.iter().zip(order) {
        let pick = |strict: bool| -> Vec<usize> {
            (0..st.len()).filter(|&j| allowed(g, n, &st[j], baseline, mesh, &part, strict)).collect()
        };
        // The strict rule always keeps the replicated strategy, so a value whose batch is
        // not its first dimension (a sequence-first layout) is held whole on the data axes
        // under a manual layout (a worse baseline, never a wrong plan; `auto` is free). The
        // relaxed rule is for a node with no replicated strategy at all.
        let mut k = pick(true);
        if k.is_empty() {
            k = pick(false);
        }
        // Under ZeRO a parameter or state that can be sharded over every `zero` axis is: the
        // replicated choice is for tensors too small to divide.
        if is_resident(&g.node(n).op) {
            let zero = zero_axes(mesh, baseline);
            if !zero.is_empty() {
                let sharded: Vec<usize> = k
                    .iter()
                    .copied()
                    .filter(|&j| zero.iter().all(|a| st[j].outputs[0].used_axes().contains(a)))
                    .collect();
                if !sharded.is_empty() {
                    k = sharded;
                }
            }
        }
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
    Ok(keep)
}

/// Builds the problem (see the module docs) with the strategies `baseline` allows. `budget` is
/// bytes per rank.
pub fn build(
    g: &Graph,
    mesh: &DeviceMesh,
    profile: &DeviceProfile,
    baseline: Baseline,
    budget: Option<u64>,
) -> Result<Built> {
    build_until(g, mesh, profile, baseline, budget, None, None)
}

/// [`build`], given up with [`Error::OutOfTime`] once `deadline` passes. Past `soft`, the
/// conversions not yet priced are priced by a direct path instead of the search
/// ([`Built::estimated_conversions`]), so that a build that must finish does so promptly.
pub fn build_until(
    g: &Graph,
    mesh: &DeviceMesh,
    profile: &DeviceProfile,
    baseline: Baseline,
    budget: Option<u64>,
    deadline: Option<std::time::Instant>,
    soft: Option<std::time::Instant>,
) -> Result<Built> {
    build_all(g, mesh, profile, baseline, budget, deadline, soft)
}

/// Problems built during one planning run, by graph, mesh and baseline: a round that solves
/// again with less room, or a candidate of a search on a mesh already built for, builds once
/// (on a 70B model building prices millions of layout conversions: seconds). A run's entry
/// point starts a fresh cache ([`crate::PlanOptions::started`]); the graph is recognised by
/// a fingerprint of its nodes and edges.
#[derive(Clone, Default)]
pub struct Cache(Arc<std::sync::Mutex<Vec<Cached>>>);

/// A built problem under its key (graph fingerprint, mesh, baseline).
type Cached = (String, Arc<Built>);

/// What tells two graphs of one run apart: every node's name, op and output metas, and the
/// edges, hashed (a stage's graph of one cut and of another differ in their nodes).
fn fingerprint(graph: &Graph) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for n in graph.g.node_indices() {
        let node = &graph.g[n];
        (&node.name, node.op.name(), format!("{:?}", node.outputs)).hash(&mut h);
    }
    for e in graph.g.edge_indices() {
        if let Some((a, b)) = graph.g.edge_endpoints(e) {
            (a.index(), b.index(), format!("{:?}", graph.g[e])).hash(&mut h);
        }
    }
    h.finish()
}

impl std::fmt::Debug for Cache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.0.lock().map_or(0, |c| c.len());
        write!(f, "Cache({n} problems)")
    }
}

impl Cache {
    /// The problem of `graph` on `mesh` pinned to `baseline`: built by `make` the first time.
    pub fn get_or_build(
        &self,
        graph: &Graph,
        mesh: &DeviceMesh,
        baseline: Baseline,
        make: impl FnOnce() -> Result<Built>,
    ) -> Result<Arc<Built>> {
        let key = format!(
            "{:x}/{}/{}/{}/{mesh:?}/{}",
            fingerprint(graph),
            graph.name,
            graph.node_count(),
            graph.g.edge_count(),
            baseline.name()
        );
        if let Ok(c) = self.0.lock()
            && let Some((_, b)) = c.iter().find(|(k, _)| *k == key)
        {
            return Ok(b.clone());
        }
        let b = Arc::new(make()?);
        if let Ok(mut c) = self.0.lock() {
            c.push((key, b.clone()));
        }
        Ok(b)
    }
}

/// [`Error::OutOfTime`] when `deadline` has passed.
pub(crate) fn in_time(deadline: Option<std::time::Instant>, doing: &str) -> Result<()> {
    match deadline {
        Some(d) if std::time::Instant::now() > d => Err(Error::OutOfTime(doing.to_string())),
        _ => Ok(()),
    }
}

impl Built {
    /// The problem as if every layer's activations were recomputed during the backward
    /// ([`::plan::Recompute::Full`]'s model; what is dropped and run again is
    /// [`crate::checkpoint::full_recompute`]'s): a value the recomputation drops is live only
    /// until its last forward reader (its copy remade for the backward, one chain stage at a
    /// time, is not counted), and every op that runs again costs twice, with the conversions
    /// of its inputs. The layouts solved on it are those that pay for holding less.
    pub fn assume_recompute(&self, g: &Graph) -> Result<Built> {
        let order: Vec<usize> = self.nodes.iter().map(|n| n.index()).collect();
        let full = crate::checkpoint::full_recompute(g, &order)?;
        let pos: HashMap<usize, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        let mut problem = self.problem.clone();
        let double = |c: u64| if c >= FORBIDDEN { c } else { c.saturating_mul(2).min(FORBIDDEN - 1) };
        for (i, &n) in self.nodes.iter().enumerate() {
            let outs = g.node(n).outputs.len();
            let dropped = |s: usize| full.dropped.contains(&::plan::ValueRef::new(n.index(), s));
            if (0..outs).any(dropped) {
                let mut end = i;
                for s in 0..outs {
                    for (u, _) in g.users(Value::new(n, s)) {
                        if !dropped(s) || full.forward.contains(&u.index()) {
                            end = end.max(pos.get(&u.index()).copied().unwrap_or(i));
                        }
                    }
                }
                let node = &mut problem.nodes[i];
                node.interval.1 = node.interval.1.min(end as u64 + 1).max(node.interval.0);
            }
            if full.rerun.contains(&n.index()) {
                for c in &mut problem.nodes[i].costs {
                    *c = double(*c);
                }
            }
        }
        // Conversions into an op run again are made again. Matrices are shared between edges
        // (repeated layers): doubled once each.
        let mut done: HashMap<usize, Arc<[u64]>> = HashMap::new();
        for e in &mut problem.edges {
            let consumer = self.nodes[e.nodes.0.max(e.nodes.1)];
            if full.rerun.contains(&consumer.index()) {
                let key = e.costs.as_ptr() as usize;
                e.costs = done.entry(key).or_insert_with(|| e.costs.iter().map(|&c| double(c)).collect()).clone();
            }
        }
        Ok(Built {
            problem,
            nodes: self.nodes.clone(),
            strategies: self.strategies.clone(),
            converter: self.converter.clone(),
            total_strategies: self.total_strategies,
            estimated_conversions: self.estimated_conversions,
        })
    }

    /// The sub-problem with only the strategies `baseline` allows (replication where none is).
    pub fn restrict(&self, g: &Graph, mesh: &DeviceMesh, baseline: Baseline) -> Result<Built> {
        let keep = kept(g, &self.nodes, &self.strategies, mesh, baseline)?;
        Ok(self.restrict_to(&keep))
    }

    /// The sub-problem with the strategies any of `baselines` allows: what a solve with no time
    /// left searches (the layouts users write by hand, a few per node, instead of every one).
    pub fn restrict_any(&self, g: &Graph, mesh: &DeviceMesh, baselines: &[Baseline]) -> Result<Built> {
        let mut keep: Vec<Vec<usize>> = vec![vec![]; self.nodes.len()];
        for &b in baselines {
            for (all, k) in keep.iter_mut().zip(kept(g, &self.nodes, &self.strategies, mesh, b)?) {
                all.extend(k);
            }
        }
        for k in &mut keep {
            k.sort_unstable();
            k.dedup();
        }
        Ok(self.restrict_to(&keep))
    }

    /// The sub-problem with strategies `keep[i]` (indices, ascending) of node `i`.
    fn restrict_to(&self, keep: &[Vec<usize>]) -> Built {
        let nodes = self.problem.nodes.iter().zip(keep).map(|(nd, k)| nd.restricted(k)).collect();
        // Shared matrices restricted the same way stay shared (repeated layers keep the same
        // strategies): one copy per (matrix, kept rows, kept columns).
        let mut kept_id: HashMap<&[usize], usize> = HashMap::new();
        let ids: Vec<usize> = keep
            .iter()
            .map(|k| {
                let next = kept_id.len();
                *kept_id.entry(k.as_slice()).or_insert(next)
            })
            .collect();
        let mut done: sharding::fx::FxMap<(usize, usize, usize), Arc<[u64]>> = Default::default();
        let edges = self
            .problem
            .edges
            .iter()
            .map(|e| {
                let (a, b) = e.nodes;
                let nb = self.strategies[b].len();
                let key = (e.costs.as_ptr() as usize, ids[a], ids[b]);
                let costs = done
                    .entry(key)
                    .or_insert_with(|| {
                        keep[a].iter().flat_map(|&i| keep[b].iter().map(move |&j| e.costs[i * nb + j])).collect()
                    })
                    .clone();
                solver::Edge { nodes: e.nodes, costs }
            })
            .collect();
        let problem =
            solver::Problem { name: self.problem.name.clone(), nodes, edges, usage_limit: self.problem.usage_limit };
        let strategies =
            keep.iter().zip(&self.strategies).map(|(k, st)| k.iter().map(|&j| st[j].clone()).collect()).collect();
        Built {
            problem,
            nodes: self.nodes.clone(),
            strategies,
            converter: self.converter.clone(),
            total_strategies: self.total_strategies,
            estimated_conversions: self.estimated_conversions,
        }
    }

    /// The chosen strategy of every solver node (so of every graph node, in [`Built::nodes`]
    /// order) for a solution of [`Built::problem`].
    pub fn chosen(&self, solution: &[usize]) -> Vec<&Strategy> {
        self.strategies.iter().zip(solution).map(|(st, &s)| &*st[s]).collect()
    }

    /// The problem folded by [`Built::groups`]: one node per group ([`solver::Folded::expand`]
    /// maps its solutions back to one strategy index per node of [`Built::problem`]).
    pub fn fold(&self, g: &Graph, how: Grouping) -> Result<Folding> {
        let start = std::time::Instant::now();
        let groups = self.groups(g, how);
        tracing::debug!("grouped in {:?}: {} groups, {} nodes tied", start.elapsed(), groups.groups.len(), groups.tied);
        // The folded problem holds one matrix per pair of groups, each its own allocation: refuse
        // one too large to fold and solve (the built problem only had its distinct matrices).
        let n = self.nodes.len();
        let mut group_of: Vec<usize> = (0..n).collect();
        let mut k: Vec<u64> = self.strategies.iter().map(|s| s.len() as u64).collect();
        for members in &groups.groups {
            for m in members {
                group_of[m.node] = members[0].node;
                k[m.node] = members[0].map.len() as u64;
            }
        }
        let mut pairs: sharding::fx::FxSet<(usize, usize)> = Default::default();
        let mut entries = 0u64;
        for e in &self.problem.edges {
            let (a, b) = (group_of[e.nodes.0], group_of[e.nodes.1]);
            if a != b && pairs.insert((a.min(b), a.max(b))) {
                entries += k[e.nodes.0] * k[e.nodes.1];
            }
        }
        if entries > MAX_EDGE_ENTRIES {
            return Err(Error::TooLarge {
                mesh: self.converter.mesh().to_string(),
                strategies: self.total_strategies,
                entries,
                limit: MAX_EDGE_ENTRIES,
            });
        }
        Ok(Folding { folded: solver::fold(&self.problem, &groups.groups)?, tied: groups.tied })
    }

    /// The groups of nodes that share one decision (see the module docs): exact ties always,
    /// follow ops and repeated layers as `how` says. Each group's strategies are those of its
    /// first member (its root); every other member has a map from them to its own.
    pub fn groups(&self, g: &Graph, how: Grouping) -> Groups {
        let n = self.nodes.len();
        let k: Vec<usize> = self.strategies.iter().map(Vec::len).collect();
        let edge: HashMap<(usize, usize), usize> =
            self.problem.edges.iter().enumerate().map(|(i, e)| (e.nodes, i)).collect();
        // Cost of the edge between a at sa and b at sb.
        let entry = |e: &solver::Edge, a: usize, sa: usize, sb: usize| -> u64 { e.cost_from(a, sa, sb, &k) };
        let mut forest = Forest::new(n);
        let mut links = Vec::new();
        // Exact ties: b's strategy is a function of a's (one allowed entry per row). Found once
        // per shared matrix and side.
        let mut functions: sharding::fx::FxMap<(usize, bool), Option<Vec<usize>>> = Default::default();
        for e in &self.problem.edges {
            let (u, v) = e.nodes;
            for (a, b) in [(u, v), (v, u)] {
                let f = functions
                    .entry((e.costs.as_ptr() as usize, a == u))
                    .or_insert_with(|| {
                        (0..k[a])
                            .map(|sa| {
                                let mut allowed = (0..k[b]).filter(|&sb| entry(e, a, sa, sb) < FORBIDDEN);
                                let first = allowed.next()?;
                                allowed.next().is_none().then_some(first)
                            })
                            .collect()
                    })
                    .clone();
                if let Some(f) = f
                    && forest.attach(b, a, f.clone())
                {
                    links.push(Link { child: b, parent: a, map: f, why: Why::Tie });
                    break;
                }
            }
        }
        // Follow ops: each of the producer's strategies fixes the follower's (see `Merge`).
        if how.merge != Merge::Off {
            let pos: HashMap<NodeIndex, usize> = self.nodes.iter().enumerate().map(|(i, &n)| (n, i)).collect();
            let mut incident: Vec<Vec<usize>> = vec![Vec::new(); n];
            for (i, e) in self.problem.edges.iter().enumerate() {
                incident[e.nodes.0].push(i);
                incident[e.nodes.1].push(i);
            }
            let memory_binds = self.problem.memory_may_bind();
            // A response depends only on the matrices around `v`, its strategies (its costs
            // follow from them) and its usages: found once for all repeated layers.
            type Around = (usize, bool, Vec<(usize, bool)>, usize, usize, u64);
            let mut responses: HashMap<Around, Option<Vec<usize>>> = HashMap::new();
            for (v, &nv) in self.nodes.iter().enumerate() {
                let Some(u) = follows(g, nv).map(|nu| pos[&nu]) else { continue };
                let Some(&main) = edge.get(&(u.min(v), u.max(v))) else { continue };
                let others: Vec<&solver::Edge> = incident[v]
                    .iter()
                    .filter(|&&i| i != main)
                    .map(|&i| &self.problem.edges[i])
                    .filter(|o| o.nodes.0 != o.nodes.1)
                    .collect();
                let side = |e: &solver::Edge| (e.costs.as_ptr() as usize, e.nodes.0 == v);
                let mut around: Vec<(usize, bool)> = others.iter().map(|o| side(o)).collect();
                around.sort_unstable();
                let list = self.strategies[v].first().map_or(0, |s| Arc::as_ptr(s) as usize);
                let usages = {
                    use std::hash::{Hash, Hasher};
                    let mut h = std::collections::hash_map::DefaultHasher::new();
                    self.problem.nodes[v].usages.hash(&mut h);
                    h.finish()
                };
                let main_side = self.problem.edges[main].nodes.0 == u;
                let key = (side(&self.problem.edges[main]).0, main_side, around, list, k[v], usages);
                let (f, why) = if how.merge == Merge::Cheapest {
                    (Some(cheapest_response(&self.problem, &k, &self.problem.edges[main], u, v)), Why::Cheapest)
                } else {
                    let f = responses
                        .entry(key)
                        .or_insert_with(|| {
                            proven_response(&self.problem, &k, &self.problem.edges[main], u, v, &others, memory_binds)
                        })
                        .clone();
                    (f, Why::Proven)
                };
                if let Some(f) = f
                    && forest.attach(v, u, f.clone())
                {
                    links.push(Link { child: v, parent: u, map: f, why });
                }
            }
        }
        let trees = forest.trees(&k);
        if !how.tie_layers {
            return Groups { groups: trees.into_iter().filter(|t| t.len() > 1).collect(), tied: 0, links };
        }
        // Repeated layers: trees whose members have the same layer patterns, ops, shapes,
        // strategy lists and maps share one decision.
        let same = |a: &[Arc<Strategy>], b: &[Arc<Strategy>]| {
            a.len() == b.len()
                && a.iter().zip(b).all(|(x, y)| {
                    Arc::ptr_eq(x, y) || (x.inputs == y.inputs && x.outputs == y.outputs && x.local == y.local)
                })
        };
        let mut classes: std::collections::BTreeMap<String, Vec<usize>> = Default::default();
        for (t, members) in trees.iter().enumerate() {
            let mut key = String::new();
            let mut layered = false;
            for m in members {
                let node = g.node(self.nodes[m.node]);
                let pattern = layer_pattern(&node.name);
                layered |= pattern != node.name;
                let metas: Vec<String> = node.outputs.iter().map(|m| m.to_string()).collect();
                key += &format!("{pattern}|{}|{}\n", node.op.name(), metas.join(","));
            }
            if layered {
                classes.entry(key).or_default().push(t);
            }
        }
        let mut in_tie = vec![false; trees.len()];
        let mut groups = Vec::new();
        let mut tied = 0;
        for class in classes.into_values() {
            let mut left = class;
            while let Some((&rep, rest)) = left.split_first() {
                let (mine, others): (Vec<usize>, Vec<usize>) = rest.iter().partition(|&&t| {
                    trees[t]
                        .iter()
                        .zip(&trees[rep])
                        .all(|(a, b)| a.map == b.map && same(&self.strategies[a.node], &self.strategies[b.node]))
                });
                if !mine.is_empty() {
                    in_tie[rep] = true;
                    let mut group = trees[rep].clone();
                    for &t in &mine {
                        in_tie[t] = true;
                        tied += trees[t].len();
                        group.extend(trees[t].iter().cloned());
                    }
                    groups.push(group);
                }
                left = others;
            }
        }
        groups.extend(trees.into_iter().enumerate().filter(|(t, m)| !in_tie[*t] && m.len() > 1).map(|(_, m)| m));
        Groups { groups, tied, links }
    }
}

/// For each strategy `su` of `u`, the cheapest strategy of its follower `v`: own cost plus the
/// conversion from `u`'s output (then less memory, then the lower index).
fn cheapest_response(p: &solver::Problem, k: &[usize], main: &solver::Edge, u: usize, v: usize) -> Vec<usize> {
    let node = &p.nodes[v];
    let entry = |su: usize, t: usize| main.cost_from(u, su, t, k);
    (0..k[u])
        .map(|su| {
            (0..k[v]).min_by_key(|&t| (node.costs[t].saturating_add(entry(su, t)), node.usages[t], t)).unwrap_or(0)
        })
        .collect()
}

/// For each strategy `su` of `u`, a strategy `a` of its follower `v` that does at least as well
/// as every other strategy `b` whatever `v`'s other neighbours choose:
///
/// `local(b) - local(a) >= sum over the other edges of max over the neighbour's strategies of
/// (entry(a) - entry(b))`, where `local(t)` is `v`'s cost plus the edge entry with `u` at `su`,
/// and (when memory may bind) `a` uses no more memory than `b`. Replacing `b` by `a` in any
/// solution then costs no more and uses no more memory, so restricting `v` to `a` keeps the
/// optimum (an exchange argument, applied follower by follower in topological order). `None`
/// when some `su` has no such response.
fn proven_response(
    p: &solver::Problem,
    k: &[usize],
    main: &solver::Edge,
    u: usize,
    v: usize,
    others: &[&solver::Edge],
    memory_binds: bool,
) -> Option<Vec<usize>> {
    let entry = |e: &solver::Edge, a: usize, sa: usize, sb: usize| -> i128 { e.cost_from(a, sa, sb, k) as i128 };
    let kv = k[v];
    let node = &p.nodes[v];
    // worst(a, b), computed on demand: the most `a` can cost more than `b` on the other edges.
    let mut memo: HashMap<(usize, usize), i128> = HashMap::new();
    let mut worst = |a: usize, b: usize| -> i128 {
        *memo.entry((a, b)).or_insert_with(|| {
            others
                .iter()
                .map(|o| {
                    let w = if o.nodes.0 == v { o.nodes.1 } else { o.nodes.0 };
                    (0..k[w]).map(|sw| entry(o, v, a, sw) - entry(o, v, b, sw)).max().unwrap_or(0)
                })
                .sum()
        })
    };
    (0..k[u])
        .map(|su| {
            let local: Vec<i128> = (0..kv).map(|t| node.costs[t] as i128 + entry(main, u, su, t)).collect();
            let mut order: Vec<usize> = (0..kv).collect();
            order.sort_by_key(|&t| (local[t], node.usages[t], t));
            order.into_iter().find(|&a| {
                (0..kv).all(|b| {
                    b == a
                        || ((!memory_binds || node.usages[a] <= node.usages[b]) && local[b] - local[a] >= worst(a, b))
                })
            })
        })
        .collect()
}

/// Op kinds whose layout follows their main input: elementwise ops, casts, reshapes,
/// transposes, slices, splits, pads, reductions and softmax.
fn follow_kind(op: &Op) -> bool {
    matches!(
        op,
        Op::Unary(_)
            | Op::Binary(_)
            | Op::Where
            | Op::Cast { .. }
            | Op::Identity
            | Op::Reshape { .. }
            | Op::Transpose { .. }
            | Op::Slice { .. }
            | Op::Split { .. }
            | Op::Pad { .. }
            | Op::Reduce { .. }
            | Op::Softmax { .. }
            | Op::LogSoftmax { .. }
    )
}

/// The producer a follow op follows: the one producing its largest input, when every input from
/// another producer is at most an eighth of that one's bytes.
fn follows(g: &Graph, n: NodeIndex) -> Option<NodeIndex> {
    if !follow_kind(&g.node(n).op) {
        return None;
    }
    let bytes = |v: Value| {
        let m = g.meta(v);
        m.shape.iter().product::<usize>().max(1) * m.dtype.size()
    };
    let inputs = g.node_inputs(n);
    let main = *inputs.iter().max_by_key(|&&v| bytes(v))?;
    let big = bytes(main);
    inputs.iter().all(|&v| v.node == main.node || bytes(v) * 8 <= big).then_some(main.node)
}

/// Nodes attached to parents whose strategy determines theirs (`map[s_parent]`), kept acyclic.
struct Forest {
    parent: Vec<Option<(usize, Vec<usize>)>>,
    root: Vec<usize>,
}

impl Forest {
    fn new(n: usize) -> Forest {
        Forest { parent: vec![None; n], root: (0..n).collect() }
    }

    fn find(&mut self, mut x: usize) -> usize {
        while self.root[x] != x {
            self.root[x] = self.root[self.root[x]];
            x = self.root[x];
        }
        x
    }

    /// Attaches `child` (with its subtree) under `parent` when it has no parent yet and is not
    /// in `parent`'s tree.
    fn attach(&mut self, child: usize, parent: usize, map: Vec<usize>) -> bool {
        if self.parent[child].is_some() {
            return false;
        }
        let (rc, rp) = (self.find(child), self.find(parent));
        if rc == rp {
            return false;
        }
        // `child` has no parent, so it is the root of its tree.
        self.root[rc] = rp;
        self.parent[child] = Some((parent, map));
        true
    }

    /// The trees, as members with maps from the root's strategies (`k[root]` of them), roots
    /// first and members in node order after them; trees in order of their roots.
    fn trees(self, k: &[usize]) -> Vec<Vec<solver::Member>> {
        let n = self.parent.len();
        let mut children: Vec<Vec<usize>> = vec![Vec::new(); n];
        for (c, p) in self.parent.iter().enumerate() {
            if let Some((p, _)) = p {
                children[*p].push(c);
            }
        }
        let mut out = Vec::new();
        for r in (0..n).filter(|&r| self.parent[r].is_none()) {
            let mut members = vec![solver::Member { node: r, map: (0..k[r]).collect() }];
            let mut head = 0;
            while head < members.len() {
                let v = members[head].node;
                for &c in &children[v] {
                    let Some((_, f)) = &self.parent[c] else { continue };
                    let map = members[head].map.iter().map(|&s| f[s]).collect();
                    members.push(solver::Member { node: c, map });
                }
                head += 1;
            }
            members[1..].sort_by_key(|m| m.node);
            out.push(members);
        }
        out
    }
}

/// An edge's costs, shared between the edges whose matrices are equal.
type Matrix = Arc<[u64]>;

/// Builds the problem: every node's strategies ([`node_strategies`]) that `baseline` allows,
/// its live interval ([`live_nodes`]), then the edges: the layout conversions between them, priced
/// ([`Interned::price_conversions`]) once the problem is known to fit
/// ([`Interned::check_size`]), and the ties of parameters to their updates.
fn build_all(
    g: &Graph,
    mesh: &DeviceMesh,
    profile: &DeviceProfile,
    baseline: Baseline,
    budget: Option<u64>,
    deadline: Option<std::time::Instant>,
    soft: Option<std::time::Instant>,
) -> Result<Built> {
    let doing = format!("building the sharding problem on mesh {mesh}");
    let order = g.topo_order().map_err(|n| Error::Graph(format!("cycle at node {}", g.node(n).name)))?;
    let pos: HashMap<NodeIndex, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let converter = Arc::new(LayoutConverter::new(mesh.clone(), Search::Auto));
    let t0 = std::time::Instant::now();
    let (mut strategies, mut rep, generated) = node_strategies(g, &order, mesh, profile, deadline, &doing)?;
    let mut total = generated;
    if baseline != Baseline::Auto {
        // Only the allowed strategies are priced: a pinned layout keeps a few of each node's,
        // and pricing the conversions between all of them (to drop most) is the build's
        // largest part (seconds on a 4-D mesh).
        let keep = kept(g, &order, &strategies, mesh, baseline)?;
        let mut first: HashMap<(usize, &[usize]), usize> = HashMap::new();
        let mut restricted = Vec::with_capacity(order.len());
        for (i, k) in keep.iter().enumerate() {
            let r = *first.entry((rep[i], k.as_slice())).or_insert(i);
            restricted.push((r, k.iter().map(|&j| strategies[i][j].clone()).collect::<Vec<_>>()));
        }
        rep = restricted.iter().map(|(r, _)| *r).collect();
        strategies = restricted.into_iter().map(|(_, st)| st).collect();
        total = strategies.iter().map(Vec::len).sum();
    }
    let nodes = live_nodes(g, &order, &pos, &strategies);
    tracing::debug!("strategies in {:?}: {} nodes, {total} strategies", t0.elapsed(), order.len());
    let t0 = std::time::Instant::now();
    // Edges: layout conversions, merged per node pair (key: (smaller, larger) index). Equal
    // matrices (every repeated layer's) are one shared allocation.
    let mut edges: HashMap<(usize, usize), Matrix> = HashMap::new();
    let estimated_conversions;
    {
        let mut interned = Interned::new(g, &order, &pos, &strategies, &rep);
        interned.check_size(mesh, total)?;
        estimated_conversions = interned.price_conversions(&converter, deadline, soft, &doing, &mut edges)?;
        interned.tie_updates(&mut edges);
    }
    tracing::debug!("conversions priced in {:?}: {} edges, {}", t0.elapsed(), edges.len(), converter.stats());
    let mut edge_list: Vec<((usize, usize), Matrix)> = edges.into_iter().collect();
    edge_list.sort_by_key(|e| e.0);
    let problem = solver::Problem {
        name: g.name.clone(),
        nodes,
        edges: edge_list.into_iter().map(|((a, b), costs)| solver::Edge { nodes: (a, b), costs }).collect(),
        usage_limit: budget,
    };
    problem.validate()?;
    Ok(Built { problem, nodes: order, strategies, converter, total_strategies: generated, estimated_conversions })
}

/// Every node's strategies in `order`, the first node with the same strategy list as each
/// (itself when new), and how many strategies in all.
#[allow(clippy::type_complexity)]
fn node_strategies(
    g: &Graph,
    order: &[NodeIndex],
    mesh: &DeviceMesh,
    profile: &DeviceProfile,
    deadline: Option<std::time::Instant>,
    doing: &str,
) -> Result<(Vec<Vec<Arc<Strategy>>>, Vec<usize>, usize)> {
    let mut strategies: Vec<Vec<Arc<Strategy>>> = Vec::with_capacity(order.len());
    let mut total = 0;
    // A node's strategies depend only on its op, the metas of its inputs and outputs and which
    // inputs are parameters: every repeated layer asks for the same ones again.
    let mut memo: HashMap<String, usize> = HashMap::new();
    // The first node with the same strategy list as each node (itself when new).
    let mut rep: Vec<usize> = Vec::with_capacity(order.len());
    for &n in order {
        in_time(deadline, doing)?;
        let node = g.node(n);
        let key = (!matches!(node.op, Op::Constant(_))).then(|| {
            let ins: Vec<String> = g
                .node_inputs(n)
                .iter()
                .map(|v| {
                    format!("{}{}", g.meta(*v), if matches!(g.node(v.node).op, Op::Param { .. }) { "p" } else { "" })
                })
                .collect();
            let outs: Vec<String> = node.outputs.iter().map(|m| m.to_string()).collect();
            format!("{:?}|{}|{}", node.op, ins.join(","), outs.join(","))
        });
        let all = match key.as_ref().and_then(|k| memo.get(k)) {
            Some(&i) => {
                rep.push(i);
                strategies[i].clone()
            }
            None => {
                rep.push(strategies.len());
                if let Some(k) = key {
                    memo.insert(k, strategies.len());
                }
                sharding::strategies(g, n, mesh, profile)?.into_iter().map(Arc::new).collect()
            }
        };
        total += all.len();
        strategies.push(all);
    }
    Ok((strategies, rep, total))
}

/// The solver's nodes: each one's live interval, and per strategy its seconds and bytes.
fn live_nodes(
    g: &Graph,
    order: &[NodeIndex],
    pos: &HashMap<NodeIndex, usize>,
    strategies: &[Vec<Arc<Strategy>>],
) -> Vec<solver::Node> {
    let steps = order.len() as u64;
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
        nodes.push(solver::Node::new(
            interval,
            st.iter().map(|s| to_cost(s.seconds())).collect(),
            st.iter().map(|s| if writes_in_place { 0 } else { s.memory_bytes }).collect(),
        ));
    }
    nodes
}

/// Adds `m` (oriented [lo][hi]) to the edge of a pair: shared when it is the pair's only one.
fn merge(edges: &mut HashMap<(usize, usize), Matrix>, key: (usize, usize), m: &Matrix) {
    match edges.entry(key) {
        std::collections::hash_map::Entry::Vacant(slot) => {
            slot.insert(m.clone());
        }
        std::collections::hash_map::Entry::Occupied(mut o) => {
            let sum: Matrix = o.get().iter().zip(m.iter()).map(|(&x, &c)| x.saturating_add(c).min(FORBIDDEN)).collect();
            o.insert(sum);
        }
    }
}

/// The graph's specs and shapes as small integers, so that conversion prices, and whole edge
/// matrices (the same in every repeated layer), are cached under cheap keys.
struct Interned<'a> {
    g: &'a Graph,
    order: &'a [NodeIndex],
    pos: &'a HashMap<NodeIndex, usize>,
    specs: Vec<&'a ShardingSpec>,
    /// Spec id of every strategy's output (per slot), per node.
    outs_of: Vec<Vec<Vec<u32>>>,
    /// Spec id of every strategy's input (per slot), per node.
    ins_of: Vec<Vec<Vec<u32>>>,
    shape_id: FxMap<&'a [usize], u32>,
}

impl<'a> Interned<'a> {
    fn new(
        g: &'a Graph,
        order: &'a [NodeIndex],
        pos: &'a HashMap<NodeIndex, usize>,
        strategies: &'a [Vec<Arc<Strategy>>],
        rep: &[usize],
    ) -> Interned<'a> {
        let mut spec_id: FxMap<&ShardingSpec, u32> = FxMap::default();
        let mut specs: Vec<&ShardingSpec> = Vec::new();
        let mut outs_of: Vec<Vec<Vec<u32>>> = Vec::with_capacity(order.len());
        let mut ins_of: Vec<Vec<Vec<u32>>> = Vec::with_capacity(order.len());
        for (i, st) in strategies.iter().enumerate() {
            // Nodes with the same strategy list (every repeated layer's) have the same ids.
            if rep[i] != i {
                outs_of.push(outs_of[rep[i]].clone());
                ins_of.push(ins_of[rep[i]].clone());
                continue;
            }
            let (n_out, n_in) = st.first().map_or((0, 0), |s| (s.outputs.len(), s.inputs.len()));
            let mut outs = vec![Vec::with_capacity(st.len()); n_out];
            let mut ins = vec![Vec::with_capacity(st.len()); n_in];
            for s in st {
                for (k, sp) in s.outputs.iter().enumerate().take(n_out) {
                    outs[k].push(intern(&mut spec_id, &mut specs, sp));
                }
                for (k, sp) in s.inputs.iter().enumerate().take(n_in) {
                    ins[k].push(intern(&mut spec_id, &mut specs, sp));
                }
            }
            outs_of.push(outs);
            ins_of.push(ins);
        }
        Interned { g, order, pos, specs, outs_of, ins_of, shape_id: FxMap::default() }
    }

    /// The problem's size is known before any price: refuses one that would not fit in memory
    /// (a 5-axis mesh of 2s gives a ViT ~1M entries per edge) instead of running out of it.
    /// Matrices are stored once per distinct (shape, element size, producer specs, consumer
    /// specs), as [`Interned::price_conversions`] does; a node pair joined by several values
    /// gets one more. And the solves see one matrix per pair of decisions: an edge of a
    /// repeated layer counts once per layer pattern (tying will share its decisions), every
    /// other edge once.
    fn check_size(&mut self, mesh: &DeviceMesh, total: usize) -> Result<()> {
        let g = self.g;
        let mut distinct: sharding::fx::FxSet<(u32, usize, &[u32], &[u32])> = Default::default();
        let mut pairs: sharding::fx::FxSet<(usize, usize)> = Default::default();
        let mut layered: std::collections::HashSet<(String, String, usize)> = Default::default();
        let (mut stored, mut solved) = (0u64, 0u64);
        for (iv, &v) in self.order.iter().enumerate() {
            let pv = layer_pattern(&g.node(v).name);
            for (slot_in, val) in g.node_inputs(v).iter().enumerate() {
                let iu = self.pos[&val.node];
                let meta = g.meta(*val);
                let next = self.shape_id.len() as u32;
                let shape = *self.shape_id.entry(meta.shape.as_slice()).or_insert(next);
                let (from, to) = (self.outs_of[iu][val.slot].as_slice(), self.ins_of[iv][slot_in].as_slice());
                let size = (from.len() * to.len()) as u64;
                let new_pair = pairs.insert((iu, iv));
                if distinct.insert((shape, meta.dtype.size(), from, to)) || !new_pair {
                    stored += size;
                }
                let name_u = &g.node(val.node).name;
                let pu = layer_pattern(name_u);
                let repeated = pv != g.node(v).name && pu != *name_u;
                if !repeated || layered.insert((pu, pv.clone(), slot_in)) {
                    solved += size;
                }
            }
        }
        let entries = stored.max(solved);
        if entries > MAX_EDGE_ENTRIES {
            return Err(Error::TooLarge {
                mesh: mesh.to_string(),
                strategies: total,
                entries,
                limit: MAX_EDGE_ENTRIES,
            });
        }
        Ok(())
    }

    /// Prices the layout conversion of every value from its producer's output specs to its
    /// consumer's input specs into `edges`, one matrix per distinct signature.
    /// Prices the conversions on every edge (see [`build_until`] for the deadlines); returns how
    /// many (source, target, tensor) prices are the direct path's.
    fn price_conversions(
        &mut self,
        converter: &LayoutConverter,
        deadline: Option<std::time::Instant>,
        soft: Option<std::time::Instant>,
        doing: &str,
        edges: &mut HashMap<(usize, usize), Matrix>,
    ) -> Result<usize> {
        let mut estimated = 0;
        let mut late = false;
        let g = self.g;
        let specs = &self.specs;
        let mut priced: FxMap<(u32, usize, u32, u32), u64> = FxMap::default();
        // Edge matrices by (shape, element size, the producer's output spec ids, the consumer's input
        // spec ids).
        type Signature<'a> = (u32, usize, &'a [u32], &'a [u32]);
        let mut matrices: FxMap<Signature, Matrix> = FxMap::default();
        for (iv, &v) in self.order.iter().enumerate() {
            in_time(deadline, doing)?;
            late = late || soft.is_some_and(|t| std::time::Instant::now() > t);
            for (slot_in, val) in g.node_inputs(v).iter().enumerate() {
                let iu = self.pos[&val.node];
                let meta = g.meta(*val);
                let dsize = meta.dtype.size();
                let next = self.shape_id.len() as u32;
                let shape = *self.shape_id.entry(meta.shape.as_slice()).or_insert(next);
                let (from, to) = (self.outs_of[iu][val.slot].as_slice(), self.ins_of[iv][slot_in].as_slice());
                let m = match matrices.entry((shape, dsize, from, to)) {
                    std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
                    std::collections::hash_map::Entry::Vacant(slot) => {
                        // Price what is new, one search per distinct source spec.
                        let mut sources: Vec<u32> = from.to_vec();
                        sources.sort_unstable();
                        sources.dedup();
                        let mut targets: Vec<u32> = to.to_vec();
                        targets.sort_unstable();
                        targets.dedup();
                        for &a in &sources {
                            let new: Vec<u32> = targets
                                .iter()
                                .copied()
                                .filter(|&b| b != a && !priced.contains_key(&(shape, dsize, a, b)))
                                .collect();
                            if new.is_empty() {
                                continue;
                            }
                            let to_specs: Vec<&ShardingSpec> = new.iter().map(|&b| specs[b as usize]).collect();
                            let costs = if late {
                                estimated += to_specs.len();
                                converter.direct_costs(&meta.shape, dsize, specs[a as usize], &to_specs)
                            } else {
                                converter.costs(&meta.shape, dsize, specs[a as usize], &to_specs)?
                            };
                            for (&b, c) in new.iter().zip(costs) {
                                priced.insert((shape, dsize, a, b), to_cost(c));
                            }
                        }
                        // A dense table of the distinct pairs, then the matrix read from it.
                        let column = |b: u32| targets.binary_search(&b).unwrap_or(0);
                        let priced = &priced;
                        let table: Vec<u64> = sources
                            .iter()
                            .flat_map(|&a| {
                                targets.iter().map(move |&b| if a == b { 0 } else { priced[&(shape, dsize, a, b)] })
                            })
                            .collect();
                        let cols: Vec<usize> = to.iter().map(|&b| column(b)).collect();
                        let mut m = Vec::with_capacity(from.len() * to.len());
                        for &a in from {
                            let row = sources.binary_search(&a).unwrap_or(0) * targets.len();
                            m.extend(cols.iter().map(|&c| table[row + c]));
                        }
                        slot.insert(m.into())
                    }
                };
                // The producer comes first in topological order: the matrix is oriented [s_u][s_v].
                merge(edges, (iu, iv), m);
            }
        }
        Ok(estimated)
    }

    /// Ties between a parameter (or state) and its update, shared like the conversions.
    fn tie_updates(&self, edges: &mut HashMap<(usize, usize), Matrix>) {
        let mut ties: FxMap<(&[u32], &[u32]), Matrix> = FxMap::default();
        for (p, val) in &self.g.updates {
            let (ip, iu) = (self.pos[p], self.pos[&val.node]);
            let (lo, hi, lo_slot, hi_slot) = if ip < iu { (ip, iu, 0, val.slot) } else { (iu, ip, val.slot, 0) };
            let (a, b) = (self.outs_of[lo][lo_slot].as_slice(), self.outs_of[hi][hi_slot].as_slice());
            let m = ties.entry((a, b)).or_insert_with(|| {
                a.iter().flat_map(|x| b.iter().map(move |y| if x == y { 0 } else { FORBIDDEN })).collect()
            });
            merge(edges, (lo, hi), m);
        }
    }
}

/// The id of `spec` among `all` (added when new).
fn intern<'a>(ids: &mut FxMap<&'a ShardingSpec, u32>, all: &mut Vec<&'a ShardingSpec>, spec: &'a ShardingSpec) -> u32 {
    if let Some(&x) = ids.get(spec) {
        return x;
    }
    let x = all.len() as u32;
    ids.insert(spec, x);
    all.push(spec);
    x
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
