//! Layout conversion: the cheapest sequence of collectives turning one sharding spec of a tensor
//! into another.
//!
//! The search runs over specs of one tensor (same shape) with these one-step transforms, each a
//! [`Collective`] priced by [`Collective::cost`]:
//! - all-gather of the last `k` mesh axes splitting a dim (only the innermost axes of a dim can be
//!   gathered into a contiguous block);
//! - all-to-all moving those axes from one dim to the end of another dim's axes;
//! - a free local slice appending one unused axis to a dim;
//! - all-reduce of any subset of the partial axes, or reduce-scatter of them (in any order) onto a
//!   dim;
//! - a free make-partial of an unused axis, only toward a target that is partial on it.
//!
//! [`Search::Exact`] is Dijkstra over this graph (ties broken by fewer steps); it is optimal over
//! these transforms. [`Search::Greedy`] repeatedly takes the step that most reduces the number of
//! mesh axes in the wrong state (cheapest first), and falls back to [`direct`] (reduce, gather
//! what differs, then slice) when it stalls: always a valid path, not always the cheapest.
//! [`Search::Auto`] uses the exact search up to 4 mesh axes.
//!
//! Pricing many pairs (building the planner's problem) goes through [`LayoutConverter::costs`]:
//! the specs of one tensor form a [`StateGraph`] whose out-edges are computed once, and one
//! Dijkstra run per source prices every target ([`exact_costs`], the same costs as [`exact`]).
//! That turned 221k pairwise searches (gpt2-tiny on 2x2x2, 232 s) into under a second. A run
//! stops once its targets are settled and resumes when later targets are asked for.
//!
//! Past a planning time limit, [`direct_cost`] prices a pair in time linear in the spec's size
//! by one valid path ([`direct`]: reduce, gather beyond the shared prefix, slice), never
//! cheaper than the search's: a 4-D mesh's hundreds of thousands of pairs cost seconds to
//! search and milliseconds this way.

use crate::collective::{Collective, ReduceKind};
use crate::fx::FxMap;
use crate::mesh::DeviceMesh;
use crate::spec::{AxisState, ShardingSpec};
use crate::{Error, Result};
use serde::Serialize;
use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};
use std::sync::{Arc, Mutex};

/// Which search finds conversion paths.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Search {
    /// Dijkstra: optimal over the one-step transforms.
    Exact,
    /// Greedy descent with a gather-everything fallback.
    Greedy,
    /// Exact for meshes of at most 4 axes, greedy above.
    #[default]
    Auto,
}

/// One step of a conversion.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Step {
    /// The collective.
    pub collective: Collective,
    /// The spec after it.
    pub after: ShardingSpec,
    /// Bytes as nccl-tests counts them.
    pub bytes: usize,
    /// Seconds.
    pub cost: f64,
}

/// A path of collectives from one spec to another.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Conversion {
    /// Source spec.
    pub from: ShardingSpec,
    /// Target spec.
    pub to: ShardingSpec,
    /// Steps in order (empty when `from == to`).
    pub steps: Vec<Step>,
    /// Total seconds.
    pub cost: f64,
}

/// The one-step transforms from `spec` (see the module docs), with their costs.
pub fn neighbours(
    spec: &ShardingSpec,
    target: &ShardingSpec,
    shape: &[usize],
    elem: usize,
    mesh: &DeviceMesh,
) -> Vec<Step> {
    neighbours_toward(spec, target.partial(), shape, elem, mesh)
}

/// [`neighbours`] toward any target whose partial axes are `target_partial`: the transforms
/// depend on the target only through them (make-partial is offered on those axes alone).
fn neighbours_toward(
    spec: &ShardingSpec,
    target_partial: &[usize],
    shape: &[usize],
    elem: usize,
    mesh: &DeviceMesh,
) -> Vec<Step> {
    let mut out = vec![];
    let local_bytes = spec.local_bytes(shape, mesh, elem);
    let divides = |dims: &[Vec<usize>], e: usize, extra: &[usize]| {
        shape[e].is_multiple_of(mesh.group_size(&dims[e]) * mesh.group_size(extra))
    };
    let mut push = |c: Collective, after: ShardingSpec| {
        let cost = c.cost(local_bytes, mesh);
        out.push(Step { bytes: c.bytes(local_bytes, mesh), collective: c, after, cost });
    };
    let dims = spec.dims();
    for (d, axes) in dims.iter().enumerate() {
        for k in 1..=axes.len() {
            let (head, tail) = axes.split_at(axes.len() - k);
            let gathered = spec.clone().with_dim(d, head.to_vec());
            push(Collective::AllGather { axes: tail.to_vec(), dim: d }, gathered.clone());
            for e in 0..dims.len() {
                if e != d && divides(dims, e, tail) {
                    let mut to = dims[e].clone();
                    to.extend_from_slice(tail);
                    push(
                        Collective::AllToAll { axes: tail.to_vec(), split_dim: e, concat_dim: d },
                        gathered.clone().with_dim(e, to),
                    );
                }
            }
        }
    }
    let used = spec.used_axes();
    for a in (0..mesh.ndim()).filter(|a| !used.contains(a)) {
        for e in 0..dims.len() {
            if divides(dims, e, &[a]) {
                let mut to = dims[e].clone();
                to.push(a);
                push(Collective::Slice { axes: vec![a], dim: e }, spec.clone().with_dim(e, to));
            }
        }
        if target_partial.contains(&a) {
            let mut p = spec.partial().to_vec();
            p.push(a);
            push(Collective::MakePartial { axes: vec![a] }, spec.clone().with_partial(p));
        }
    }
    let partial = spec.partial();
    for subset in 1..(1u32 << partial.len()) {
        let chosen: Vec<usize> = (0..partial.len()).filter(|i| subset & (1 << i) != 0).map(|i| partial[i]).collect();
        let rest: Vec<usize> = partial.iter().copied().filter(|a| !chosen.contains(a)).collect();
        push(
            Collective::AllReduce { axes: chosen.clone(), op: ReduceKind::Sum },
            spec.clone().with_partial(rest.clone()),
        );
        for order in permutations(&chosen) {
            for e in 0..dims.len() {
                if divides(dims, e, &order) {
                    let mut to = dims[e].clone();
                    to.extend_from_slice(&order);
                    push(
                        Collective::ReduceScatter { axes: order.clone(), dim: e },
                        spec.clone().with_partial(rest.clone()).with_dim(e, to),
                    );
                }
            }
        }
    }
    out
}

fn permutations(v: &[usize]) -> Vec<Vec<usize>> {
    if v.len() <= 1 {
        return vec![v.to_vec()];
    }
    let mut out = vec![];
    for i in 0..v.len() {
        let mut rest = v.to_vec();
        let x = rest.remove(i);
        for mut p in permutations(&rest) {
            p.insert(0, x);
            out.push(p);
        }
    }
    out
}

#[derive(PartialEq)]
struct Entry {
    cost: f64,
    steps: usize,
    spec: ShardingSpec,
}
impl Eq for Entry {}
impl Ord for Entry {
    fn cmp(&self, o: &Self) -> Ordering {
        // Reversed: BinaryHeap is a max-heap.
        o.cost.total_cmp(&self.cost).then(o.steps.cmp(&self.steps)).then_with(|| o.spec.cmp(&self.spec))
    }
}
impl PartialOrd for Entry {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}

fn check_pair(from: &ShardingSpec, to: &ShardingSpec, shape: &[usize], mesh: &DeviceMesh) -> Result<()> {
    from.check(shape, mesh)?;
    to.check(shape, mesh)
}

fn finish(from: &ShardingSpec, to: &ShardingSpec, steps: Vec<Step>) -> Conversion {
    let cost = steps.iter().map(|s| s.cost).sum();
    Conversion { from: from.clone(), to: to.clone(), steps, cost }
}

/// Best known (cost, steps) to a spec and the step that reached it.
type Reached = (f64, usize, Option<(ShardingSpec, Step)>);

/// Dijkstra over the one-step transforms: the cheapest path (fewest steps among equals).
pub fn exact(
    from: &ShardingSpec,
    to: &ShardingSpec,
    shape: &[usize],
    elem: usize,
    mesh: &DeviceMesh,
) -> Result<Conversion> {
    check_pair(from, to, shape, mesh)?;
    let mut best: HashMap<ShardingSpec, Reached> = HashMap::new();
    let mut heap = BinaryHeap::new();
    best.insert(from.clone(), (0.0, 0, None));
    heap.push(Entry { cost: 0.0, steps: 0, spec: from.clone() });
    while let Some(Entry { cost, steps, spec }) = heap.pop() {
        let (c, s, _) = &best[&spec];
        if (*c, *s) != (cost, steps) {
            continue;
        }
        if &spec == to {
            let mut path = vec![];
            let mut cur = spec;
            while let Some((prev, step)) = best[&cur].2.clone() {
                path.push(step);
                cur = prev;
            }
            path.reverse();
            return Ok(finish(from, to, path));
        }
        for step in neighbours(&spec, to, shape, elem, mesh) {
            let (nc, ns) = (cost + step.cost, steps + 1);
            let better = match best.get(&step.after) {
                None => true,
                Some((c, s, _)) => nc < *c || (nc == *c && ns < *s),
            };
            if better {
                heap.push(Entry { cost: nc, steps: ns, spec: step.after.clone() });
                best.insert(step.after.clone(), (nc, ns, Some((spec.clone(), step))));
            }
        }
    }
    Err(Error::NoConversion { from: from.to_string(), to: to.to_string(), why: "no path (a bug)".into() })
}

/// A spec as one integer: 4 bits per entry (mesh axis + 1, or 0 closing a dim) for the dims,
/// then 16 bits of partial-axis mask; `None` when it does not fit (more than 15 mesh axes or
/// more than 28 entries). Unique among the specs of one tensor rank (leading replicated dims
/// give leading zero nibbles, so specs of different ranks may share a key).
fn key(spec: &ShardingSpec) -> Option<u128> {
    let mut k: u128 = 0;
    let mut n = 0;
    for axes in spec.dims() {
        for &a in axes.iter().chain(std::iter::once(&usize::MAX)) {
            let nibble = if a == usize::MAX { 0 } else { a + 1 };
            if nibble > 15 || n == 28 {
                return None;
            }
            k = (k << 4) | nibble as u128;
            n += 1;
        }
    }
    let mut mask: u128 = 0;
    for &a in spec.partial() {
        if a >= 16 {
            return None;
        }
        mask |= 1 << a;
    }
    Some((k << 16) | mask)
}

/// The specs of one tensor (shape, element size) reachable by the one-step transforms toward
/// targets with one partial-axis set, with each state's out-edges computed once, when first
/// needed. Many searches share one graph: [`exact_costs`] is then integer work.
#[derive(Default)]
pub struct StateGraph {
    ids: FxMap<u128, u32>,
    states: Vec<ShardingSpec>,
    edges: Vec<Option<Vec<(u32, f64)>>>,
    /// The Dijkstra run from each source searched so far, paused once its targets were settled.
    runs: FxMap<u32, Run>,
}

/// A Dijkstra run from one state, resumable: the best cost found to each state (by id; missing
/// or infinite where unreached) and the frontier. A state is settled once its cost is at most
/// the frontier's least (costs are non-negative).
struct Run {
    best: Vec<f64>,
    /// Entries (cost bits, state): the bits of non-negative costs order as the costs do.
    heap: BinaryHeap<std::cmp::Reverse<(u64, u32)>>,
}

impl StateGraph {
    /// The id of a spec (added when new); `None` when the spec has no compact key.
    fn id(&mut self, spec: &ShardingSpec) -> Option<u32> {
        let k = key(spec)?;
        Some(*self.ids.entry(k).or_insert_with(|| {
            self.states.push(spec.clone());
            self.edges.push(None);
            (self.states.len() - 1) as u32
        }))
    }

    /// The least cost from `start` to each of `targets` (infinite where unreachable): Dijkstra
    /// from `start`, run (or resumed from an earlier call) only until every target is settled,
    /// so states costlier than the farthest target are never expanded.
    fn search(
        &mut self,
        start: u32,
        targets: &[u32],
        partial: &[usize],
        shape: &[usize],
        elem: usize,
        mesh: &DeviceMesh,
    ) -> Result<Vec<f64>> {
        let mut run = self.runs.remove(&start).unwrap_or_else(|| {
            let mut best = vec![f64::INFINITY; self.states.len()];
            best[start as usize] = 0.0;
            Run { best, heap: BinaryHeap::from([std::cmp::Reverse((0f64.to_bits(), start))]) }
        });
        let cost_of = |best: &[f64], t: u32| best.get(t as usize).copied().unwrap_or(f64::INFINITY);
        let mut pending: Vec<u32> = targets.to_vec();
        while let Some(&std::cmp::Reverse((bits, id))) = run.heap.peek() {
            let cost = f64::from_bits(bits);
            pending.retain(|&t| cost_of(&run.best, t) > cost);
            if pending.is_empty() {
                break;
            }
            run.heap.pop();
            if run.best[id as usize] != cost {
                continue;
            }
            if self.edges[id as usize].is_none() {
                let spec = self.states[id as usize].clone();
                let mut list = Vec::new();
                for step in neighbours_toward(&spec, partial, shape, elem, mesh) {
                    let next = self
                        .id(&step.after)
                        .ok_or_else(|| Error::Internal(format!("spec {} has no compact key", step.after)))?;
                    list.push((next, step.cost.max(0.0)));
                }
                self.edges[id as usize] = Some(list);
            }
            if run.best.len() < self.states.len() {
                run.best.resize(self.states.len(), f64::INFINITY);
            }
            for &(next, c) in self.edges[id as usize].iter().flatten() {
                let nc = cost + c;
                if nc < run.best[next as usize] {
                    run.best[next as usize] = nc;
                    run.heap.push(std::cmp::Reverse((nc.to_bits(), next)));
                }
            }
        }
        let out = targets.iter().map(|&t| cost_of(&run.best, t)).collect();
        self.runs.insert(start, run);
        Ok(out)
    }
}

/// The state graphs of one tensor by partial-axis set (see [`exact_costs`]).
pub type Graphs = HashMap<Vec<usize>, StateGraph>;

/// [`exact`]'s cost from `from` to each of `targets`, by one Dijkstra run over all states per
/// source and distinct partial-axis set among the targets, instead of one per pair. `graphs`
/// holds the state graphs (and the runs) of earlier calls for the same tensor, by partial-axis
/// set; pass an empty one to start afresh.
pub fn exact_costs(
    from: &ShardingSpec,
    targets: &[&ShardingSpec],
    shape: &[usize],
    elem: usize,
    mesh: &DeviceMesh,
    graphs: &mut Graphs,
) -> Result<Vec<f64>> {
    exact_costs_with(from, targets, shape, elem, mesh, &mesh.symmetries(MAX_SYMMETRIES), graphs)
}

/// Symmetries tried per search (5! on a 5-axis mesh of one size and link).
const MAX_SYMMETRIES: usize = 120;

/// [`exact_costs`] with the mesh's symmetries given: each search runs from the least image of
/// its source (and partial-axis set) under them, so a source whose image was searched before
/// (the same layout on a swapped pair of equal axes) reuses that search.
fn exact_costs_with(
    from: &ShardingSpec,
    targets: &[&ShardingSpec],
    shape: &[usize],
    elem: usize,
    mesh: &DeviceMesh,
    symmetries: &[Vec<usize>],
    graphs: &mut Graphs,
) -> Result<Vec<f64>> {
    from.check(shape, mesh)?;
    for t in targets {
        t.check(shape, mesh)?;
    }
    let mut out = vec![f64::NAN; targets.len()];
    let mut groups: Vec<(&[usize], Vec<usize>)> = Vec::new();
    for (i, t) in targets.iter().enumerate() {
        match groups.iter_mut().find(|(p, _)| *p == t.partial()) {
            Some((_, members)) => members.push(i),
            None => groups.push((t.partial(), vec![i])),
        }
    }
    for (partial, members) in groups {
        // The least image of (partial set, source) under the symmetries.
        let perm = symmetries
            .iter()
            .min_by_key(|p| {
                let mut q: Vec<usize> = partial.iter().map(|&a| p[a]).collect();
                q.sort_unstable();
                (q, from.permuted(p))
            })
            .filter(|p| p.iter().enumerate().any(|(a, &b)| a != b));
        let image = |s: &ShardingSpec| perm.map_or_else(|| s.clone(), |p| s.permuted(p));
        let mut key: Vec<usize> = partial.iter().map(|&a| perm.map_or(a, |p| p[a])).collect();
        key.sort_unstable();
        let graph = graphs.entry(key.clone()).or_default();
        let start = graph.id(&image(from));
        let ends: Option<Vec<u32>> = members.iter().map(|&i| graph.id(&image(targets[i]))).collect();
        let partial = key.as_slice();
        let (Some(start), Some(ends)) = (start, ends) else {
            // Too large for compact keys: one search per pair.
            for i in members {
                out[i] = exact(from, targets[i], shape, elem, mesh)?.cost;
            }
            continue;
        };
        let costs = graph.search(start, &ends, partial, shape, elem, mesh)?;
        for (&i, &c) in members.iter().zip(&costs) {
            match Some(c).filter(|c| c.is_finite()) {
                Some(c) => out[i] = c,
                None => {
                    return Err(Error::NoConversion {
                        from: from.to_string(),
                        to: targets[i].to_string(),
                        why: "no path (a bug)".into(),
                    });
                }
            }
        }
    }
    Ok(out)
}

/// Mesh axes whose state differs between two specs (a shard at a different position in its dim's
/// order counts as different).
fn distance(a: &ShardingSpec, b: &ShardingSpec, ndim: usize) -> usize {
    let pos = |s: &ShardingSpec, ax: usize| match s.axis_state(ax) {
        AxisState::Shard(d) => Some((d, s.dims()[d].iter().position(|&x| x == ax))),
        _ => None,
    };
    (0..ndim).filter(|&ax| a.axis_state(ax) != b.axis_state(ax) || pos(a, ax) != pos(b, ax)).count()
}

/// The greedy search of the module docs.
pub fn greedy(
    from: &ShardingSpec,
    to: &ShardingSpec,
    shape: &[usize],
    elem: usize,
    mesh: &DeviceMesh,
) -> Result<Conversion> {
    check_pair(from, to, shape, mesh)?;
    let mut cur = from.clone();
    let mut path = vec![];
    let mut seen = vec![cur.clone()];
    while &cur != to && path.len() <= 2 * mesh.ndim() + 2 {
        let d0 = distance(&cur, to, mesh.ndim());
        let best = neighbours(&cur, to, shape, elem, mesh)
            .into_iter()
            .filter(|s| !seen.contains(&s.after) && distance(&s.after, to, mesh.ndim()) < d0)
            .min_by(|a, b| {
                distance(&a.after, to, mesh.ndim())
                    .cmp(&distance(&b.after, to, mesh.ndim()))
                    .then(a.cost.total_cmp(&b.cost))
            });
        match best {
            Some(s) => {
                cur = s.after.clone();
                seen.push(cur.clone());
                path.push(s);
            }
            None => break,
        }
    }
    if &cur == to {
        return Ok(finish(from, to, path));
    }
    direct(from, to, shape, elem, mesh)
}

/// A direct path, found in time linear in the spec's size, for pricing past a time limit: reduce
/// the partial axes the target does not keep, gather each dim's axes beyond the prefix it
/// shares with the target, then slice into the target and make it partial. Always valid, and
/// never cheaper than [`exact`] (which may use all-to-alls and reduce-scatters instead).
pub fn direct(
    from: &ShardingSpec,
    to: &ShardingSpec,
    shape: &[usize],
    elem: usize,
    mesh: &DeviceMesh,
) -> Result<Conversion> {
    check_pair(from, to, shape, mesh)?;
    let mut steps = vec![];
    let mut cur = from.clone();
    let mut go = |c: Collective, after: ShardingSpec, cur: &mut ShardingSpec| {
        let lb = cur.local_bytes(shape, mesh, elem);
        steps.push(Step { bytes: c.bytes(lb, mesh), cost: c.cost(lb, mesh), collective: c, after: after.clone() });
        *cur = after;
    };
    let reduce: Vec<usize> = cur.partial().iter().copied().filter(|a| !to.partial().contains(a)).collect();
    if !reduce.is_empty() {
        let keep: Vec<usize> = cur.partial().iter().copied().filter(|a| to.partial().contains(a)).collect();
        let after = cur.clone().with_partial(keep);
        go(Collective::AllReduce { axes: reduce, op: ReduceKind::Sum }, after, &mut cur);
    }
    for d in 0..shape.len() {
        let (have, want) = (&from.dims()[d], &to.dims()[d]);
        let common = have.iter().zip(want).take_while(|(a, b)| a == b).count();
        if common < have.len() {
            let after = cur.clone().with_dim(d, have[..common].to_vec());
            go(Collective::AllGather { axes: have[common..].to_vec(), dim: d }, after, &mut cur);
        }
    }
    for (d, want) in to.dims().iter().enumerate() {
        for &a in &want[cur.dims()[d].len()..] {
            let mut v = cur.dims()[d].clone();
            v.push(a);
            let after = cur.clone().with_dim(d, v);
            go(Collective::Slice { axes: vec![a], dim: d }, after, &mut cur);
        }
    }
    for &a in to.partial() {
        if !cur.partial().contains(&a) {
            let mut p = cur.partial().to_vec();
            p.push(a);
            let after = cur.clone().with_partial(p);
            go(Collective::MakePartial { axes: vec![a] }, after, &mut cur);
        }
    }
    if &cur != to {
        return Err(Error::Internal(format!("direct conversion {from} -> {to} ended at {cur}")));
    }
    Ok(finish(from, to, steps))
}

/// [`direct`]'s cost without building its path (its slices and make-partials are free): what
/// pricing past a time limit adds up for each of hundreds of thousands of pairs. The specs are
/// taken as valid for `shape` on `mesh`.
pub fn direct_cost(from: &ShardingSpec, to: &ShardingSpec, shape: &[usize], elem: usize, mesh: &DeviceMesh) -> f64 {
    let (have, want) = (from.dims(), to.dims());
    // Each dim's axes are a prefix of the source's while reducing and gathering: its length.
    let mut len: Vec<usize> = have.iter().map(Vec::len).collect();
    let local = |len: &[usize]| -> usize {
        shape.iter().zip(have).zip(len).map(|((&s, axes), &l)| s / mesh.group_size(&axes[..l])).product::<usize>()
            * elem
    };
    let mut cost = 0.0;
    let reduce: Vec<usize> = from.partial().iter().copied().filter(|a| !to.partial().contains(a)).collect();
    if !reduce.is_empty() {
        cost += Collective::AllReduce { axes: reduce, op: ReduceKind::Sum }.cost(local(&len), mesh);
    }
    for d in 0..shape.len() {
        let common = have[d].iter().zip(&want[d]).take_while(|(a, b)| a == b).count();
        if common < have[d].len() {
            let before = local(&len);
            cost += Collective::AllGather { axes: have[d][common..].to_vec(), dim: d }.cost(before, mesh);
            len[d] = common;
        }
    }
    cost
}

/// Cheapest cost over all paths of at most `max_steps` transforms (exhaustive; for tests).
pub fn brute_force_cost(
    from: &ShardingSpec,
    to: &ShardingSpec,
    shape: &[usize],
    elem: usize,
    mesh: &DeviceMesh,
    max_steps: usize,
) -> Option<f64> {
    #[allow(clippy::too_many_arguments)]
    fn go(
        cur: &ShardingSpec,
        to: &ShardingSpec,
        shape: &[usize],
        elem: usize,
        mesh: &DeviceMesh,
        left: usize,
        acc: f64,
        best: &mut Option<f64>,
    ) {
        if cur == to {
            *best = Some(best.map_or(acc, |b: f64| b.min(acc)));
            return;
        }
        if left == 0 {
            return;
        }
        for s in neighbours(cur, to, shape, elem, mesh) {
            go(&s.after, to, shape, elem, mesh, left - 1, acc + s.cost, best);
        }
    }
    let mut best = None;
    go(from, to, shape, elem, mesh, max_steps, 0.0, &mut best);
    best
}

type Key = (Vec<usize>, usize, ShardingSpec, ShardingSpec);

/// Finds and caches conversions on one mesh.
pub struct LayoutConverter {
    mesh: DeviceMesh,
    search: Search,
    cache: Mutex<HashMap<Key, Arc<Conversion>>>,
    /// State graphs of [`exact_costs`] by tensor (shape, element size), then partial-axis set.
    graphs: Mutex<HashMap<(Vec<usize>, usize), Graphs>>,
    /// The mesh's symmetries ([`DeviceMesh::symmetries`]).
    symmetries: Vec<Vec<usize>>,
}

impl LayoutConverter {
    /// A converter on `mesh` using `search`.
    pub fn new(mesh: DeviceMesh, search: Search) -> LayoutConverter {
        let symmetries = mesh.symmetries(MAX_SYMMETRIES);
        LayoutConverter {
            mesh,
            search,
            cache: Mutex::new(HashMap::new()),
            graphs: Mutex::new(HashMap::new()),
            symmetries,
        }
    }

    /// The mesh.
    pub fn mesh(&self) -> &DeviceMesh {
        &self.mesh
    }

    /// The cheapest known conversion of a tensor of `shape` with `elem`-byte elements.
    pub fn convert(
        &self,
        shape: &[usize],
        elem: usize,
        from: &ShardingSpec,
        to: &ShardingSpec,
    ) -> Result<Arc<Conversion>> {
        let key = (shape.to_vec(), elem, from.clone(), to.clone());
        if let Some(c) = self.cache.lock().map_err(|_| Error::Internal("poisoned cache".into()))?.get(&key) {
            return Ok(c.clone());
        }
        let c = Arc::new(if self.exact_search() {
            exact(from, to, shape, elem, &self.mesh)?
        } else {
            greedy(from, to, shape, elem, &self.mesh)?
        });
        self.cache.lock().map_err(|_| Error::Internal("poisoned cache".into()))?.insert(key, c.clone());
        Ok(c)
    }

    /// The cost of converting `from` into each of `targets` (as [`LayoutConverter::convert`]
    /// prices them, without caching the paths): for the exact search, one Dijkstra run per
    /// source over state graphs kept between calls; one greedy path per pair above 4 mesh axes.
    pub fn costs(
        &self,
        shape: &[usize],
        elem: usize,
        from: &ShardingSpec,
        targets: &[&ShardingSpec],
    ) -> Result<Vec<f64>> {
        if self.exact_search() {
            let mut graphs = self.graphs.lock().map_err(|_| Error::Internal("poisoned cache".into()))?;
            let graphs = graphs.entry((shape.to_vec(), elem)).or_default();
            exact_costs_with(from, targets, shape, elem, &self.mesh, &self.symmetries, graphs)
        } else {
            targets.iter().map(|t| Ok(greedy(from, t, shape, elem, &self.mesh)?.cost)).collect()
        }
    }

    /// The cost of [`direct`] from `from` to each of `targets`: what pricing past a time limit
    /// uses (linear in the spec's size per pair, where [`LayoutConverter::costs`] searches).
    pub fn direct_costs(
        &self,
        shape: &[usize],
        elem: usize,
        from: &ShardingSpec,
        targets: &[&ShardingSpec],
    ) -> Vec<f64> {
        targets.iter().map(|t| direct_cost(from, t, shape, elem, &self.mesh)).collect()
    }

    fn exact_search(&self) -> bool {
        match self.search {
            Search::Exact => true,
            Search::Greedy => false,
            Search::Auto => self.mesh.ndim() <= 4,
        }
    }

    /// What the exact searches hold: tensors, state graphs, states and searches run (for logs).
    pub fn stats(&self) -> String {
        let Ok(graphs) = self.graphs.lock() else { return "poisoned".into() };
        let (mut n, mut states, mut searches, mut edges) = (0, 0, 0, 0);
        for g in graphs.values().flat_map(|g| g.values()) {
            n += 1;
            states += g.states.len();
            searches += g.runs.len();
            edges += g.edges.iter().flatten().map(Vec::len).sum::<usize>();
        }
        format!("{} tensors, {n} state graphs, {states} states, {edges} edges, {searches} searches", graphs.len())
    }

    /// Number of cached conversions.
    pub fn cached(&self) -> usize {
        self.cache.lock().map(|c| c.len()).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conv(m: &DeviceMesh, shape: &[usize], a: &str, b: &str) -> Conversion {
        exact(&a.parse().unwrap(), &b.parse().unwrap(), shape, 4, m).unwrap()
    }

    /// Every valid spec of `shape` with each mesh axis replicated, partial or splitting one dim
    /// (axes of one dim in mesh order).
    fn all_specs(shape: &[usize], m: &DeviceMesh) -> Vec<ShardingSpec> {
        let states = shape.len() + 2;
        let mut out = vec![];
        for code in 0..states.pow(m.ndim() as u32) {
            let (mut dims, mut partial) = (vec![vec![]; shape.len()], vec![]);
            let mut c = code;
            for axis in 0..m.ndim() {
                match c % states {
                    0 => {}
                    1 => partial.push(axis),
                    d => dims[d - 2].push(axis),
                }
                c /= states;
            }
            let spec = ShardingSpec::new(dims, partial);
            if spec.check(shape, m).is_ok() {
                out.push(spec);
            }
        }
        out
    }

    #[test]
    fn one_search_per_source_prices_as_the_pairwise_search() {
        let m = DeviceMesh::uniform(&[2, 2, 2]).unwrap();
        let shape = [4, 8, 2];
        let specs = all_specs(&shape, &m);
        assert!(specs.len() > 50, "{} specs", specs.len());
        let targets: Vec<&ShardingSpec> = specs.iter().collect();
        let mut graphs = HashMap::new();
        for from in specs.iter().step_by(7) {
            let costs = exact_costs(from, &targets, &shape, 4, &m, &mut graphs).unwrap();
            for (to, c) in targets.iter().zip(costs) {
                let pair = exact(from, to, &shape, 4, &m).unwrap().cost;
                assert!((c - pair).abs() <= 1e-12 * pair.max(1e-9), "{from} -> {to}: {c} against {pair}");
            }
        }
        // The converter's cached graphs give the same prices.
        let conv = LayoutConverter::new(m.clone(), Search::Auto);
        let from = &specs[specs.len() / 2];
        let direct = exact_costs(from, &targets, &shape, 4, &m, &mut HashMap::new()).unwrap();
        assert_eq!(conv.costs(&shape, 4, from, &targets).unwrap(), direct);
        assert_eq!(conv.costs(&shape, 4, from, &targets).unwrap(), direct);
    }

    #[test]
    fn a_paused_search_resumes_to_the_same_prices() {
        // Searches stop once their targets are settled; a later call from the same source
        // resumes the run. Ask for a few targets first, then all of them.
        // Mixed links: the mesh has fewer symmetries, so more sources are searched.
        let profile = crate::DeviceProfile::builtin("h100-sxm").unwrap();
        let m = DeviceMesh::parse("node=2:ib,data=2,tensor=2:nvlink", &profile).unwrap();
        let shape = [4, 8, 2];
        let specs = all_specs(&shape, &m);
        let all: Vec<&ShardingSpec> = specs.iter().collect();
        let mut graphs = HashMap::new();
        for from in specs.iter().step_by(11) {
            let few: Vec<&ShardingSpec> = specs.iter().step_by(13).collect();
            exact_costs(from, &few, &shape, 4, &m, &mut graphs).unwrap();
            let costs = exact_costs(from, &all, &shape, 4, &m, &mut graphs).unwrap();
            for (to, c) in all.iter().zip(costs) {
                let pair = exact(from, to, &shape, 4, &m).unwrap().cost;
                assert!((c - pair).abs() <= 1e-12 * pair.max(1e-9), "{from} -> {to}: {c} against {pair}");
            }
        }
    }

    #[test]
    fn direct_paths_are_valid_and_never_beat_the_search() {
        let m = DeviceMesh::uniform(&[2, 2, 2]).unwrap();
        let shape = [4, 8, 2];
        let specs = all_specs(&shape, &m);
        for from in specs.iter().step_by(3) {
            for to in specs.iter().step_by(5) {
                // `direct` checks that its steps end at the target.
                let d = direct(from, to, &shape, 4, &m).unwrap();
                let e = exact(from, to, &shape, 4, &m).unwrap().cost;
                assert_eq!(direct_cost(from, to, &shape, 4, &m), d.cost, "{from} -> {to}");
                assert!(d.cost >= e - 1e-12 * e.max(1e-9), "{from} -> {to}: direct {} beats exact {e}", d.cost);
                let mut cur = from.clone();
                for s in &d.steps {
                    assert!(
                        neighbours(&cur, to, &shape, 4, &m).iter().any(|n| n.after == s.after),
                        "{from} -> {to}: step {:?} from {cur} is not a transform",
                        s.collective
                    );
                    cur = s.after.clone();
                }
                if from == to {
                    assert_eq!(d.cost, 0.0);
                }
            }
        }
    }

    #[test]
    fn simple_paths() {
        let m = DeviceMesh::uniform(&[2, 4]).unwrap();
        let c = conv(&m, &[8, 16, 32], "S0 R R", "R S0 R");
        assert_eq!(c.steps.len(), 1);
        assert_eq!(c.steps[0].collective.kind(), "all-to-all");
        let c = conv(&m, &[8, 16, 32], "R R R | P1", "R S1 R");
        assert_eq!(c.steps[0].collective.kind(), "reduce-scatter");
        let c = conv(&m, &[8, 16, 32], "R R R", "S01 R R");
        assert_eq!(c.cost, 0.0);
        assert!(c.steps.iter().all(|s| s.collective.is_local()));
    }
}
