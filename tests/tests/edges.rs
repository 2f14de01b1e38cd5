//! The planner's cost graph against a direct recomputation, on meshes where the two ends of an
//! edge have different strategy counts (issue 22's acceptance for the edge-cost fix; issue 16,
//! item 5: no planning panic on any model or mesh).
//!
//! `codegen/src/problem.rs` once indexed an edge's row-major matrix with the wrong end's strategy
//! count when the asking node was the edge's second end: out of bounds on `--mesh 3` (gpt2-tiny),
//! on any odd parameter dim used elementwise (`y = x[2,3] + b[3]`), on 3 heads / odd token counts
//! on 4-device meshes, and silently wrong ties and responses where it did not crash. Here:
//!
//! - [`built_edges_are_the_conversions_between_their_strategies`]: for every edge of
//!   `Built::problem` and every strategy pair, the entry (read from either end with
//!   `Edge::cost_from`) is the sum over the values between the two nodes of the cheapest layout
//!   conversion from the producer's output spec to the consumer's input spec, priced afresh by a
//!   new `LayoutConverter`, plus `FORBIDDEN` where a parameter and its update differ; no pair of
//!   nodes with a value between them lacks an edge. Node costs are the strategies' seconds, and
//!   every strategy's specs divide their tensors evenly (indivisible dims lose the strategies
//!   that would split them, and the replicated strategy is always there). Then, for every
//!   grouping the planner uses, the folded problem (what the solver is given) is checked entry by
//!   entry: each folded node cost is its members' costs under the expansion maps plus the edges
//!   inside the group, each folded edge entry the sum of its member edges' entries.
//! - [`planning_never_panics_on_any_mesh`]: `codegen::plan` (the library call behind
//!   `autopar plan`) on meshes 2, 3, 4, 8, 1x4, 4x1, 2x2, 2x3, 2x4 and 2x2x2 succeeds (with a plan
//!   that passes its own validating loader) or returns a typed error; it never panics and never
//!   reports an internal error. Times are printed.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use codegen::problem::{Built, FORBIDDEN, Folding, Grouping, Groups, Merge, Why, build, to_cost};
use codegen::{Baseline, Plan, PlanOptions};
use ir::autodiff::{LossSpec, Optimizer, TrainOptions, training_graph};
use ir::{BinaryOp, DType, Graph, NodeIndex, Op, TensorMeta};
use sharding::{DeviceMesh, DeviceProfile, LayoutConverter, Search};

fn model(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/models").join(name)
}

fn train(g: &Graph, loss: &str) -> Result<Graph> {
    let loss: LossSpec = loss.parse().map_err(anyhow::Error::msg)?;
    let tg = training_graph(g, &TrainOptions::new(loss, Some(Optimizer::adamw(1e-3))))?;
    Ok(codegen::plan::canonical(&tg.graph)?)
}

fn imported(name: &str, loss: &str) -> Result<Graph> {
    let g = tracer::import_file(&model(name), &tracer::ImportOptions { load_weights: false, ..Default::default() })?;
    train(&g, loss)
}

fn f32m(shape: &[usize]) -> TensorMeta {
    TensorMeta::new(DType::F32, shape.to_vec())
}

/// `y = (x[2,3] + b[3]) @ w[3,5] + c[5]`: odd parameter dims used elementwise (issue 16's
/// smallest crash).
fn odd_bias() -> Result<Graph> {
    let mut g = Graph::new("odd_bias");
    let x = g.input("x", f32m(&[2, 3]));
    let b = g.param("b", f32m(&[3]), None);
    let h = g.add1("add", Op::Binary(BinaryOp::Add), &[x, b])?;
    let w = g.param("w", f32m(&[3, 5]), None);
    let c = g.param("c", f32m(&[5]), None);
    let y = g.add1("fc", Op::Gemm { alpha: 1.0, beta: 1.0, trans_a: false, trans_b: false }, &[h, w, c])?;
    g.set_output("y", y);
    train(&g, "mse:y:t")
}

/// Self-attention with 3 heads over 7 tokens and a 3-label head (ViT-tiny's 3 heads and 197
/// tokens, BERT's 3 labels, in miniature): dims that no mesh of 2 or 4 divides.
fn three_heads() -> Result<Graph> {
    let mut g = Graph::new("three_heads");
    let x = g.input("x", f32m(&[2, 7, 12]));
    let wq = g.param("wq", f32m(&[12, 12]), None);
    let q = g.add1("q", Op::MatMul, &[x, wq])?;
    let q = g.add1("heads", Op::Reshape { shape: vec![2, 7, 3, 4] }, &[q])?;
    let q = g.add1("heads.t", Op::Transpose { perm: vec![0, 2, 1, 3] }, &[q])?;
    let kt = g.add1("k.t", Op::Transpose { perm: vec![0, 1, 3, 2] }, &[q])?;
    let s = g.add1("scores", Op::MatMul, &[q, kt])?;
    let p = g.add1("softmax", Op::Softmax { axis: 3 }, &[s])?;
    let c = g.add1("context", Op::MatMul, &[p, q])?;
    let c = g.add1("merge.t", Op::Transpose { perm: vec![0, 2, 1, 3] }, &[c])?;
    let c = g.add1("merge", Op::Reshape { shape: vec![14, 12] }, &[c])?;
    let w = g.param("cls.w", f32m(&[3, 12]), None);
    let b = g.param("cls.b", f32m(&[3]), None);
    let y = g.add1("cls", Op::Gemm { alpha: 1.0, beta: 1.0, trans_a: false, trans_b: true }, &[c, w, b])?;
    g.set_output("y", y);
    train(&g, "mse:y:t")
}

fn graphs() -> Result<Vec<(&'static str, Graph)>> {
    Ok(vec![
        ("mlp", imported("mlp.onnx", "mse:y:t")?),
        ("odd-bias", odd_bias()?),
        ("three-heads", three_heads()?),
        ("gpt2-tiny", imported("gpt2-tiny.onnx", "ce-next:logits:input_ids")?),
    ])
}

/// Every grouping the planner can fold by.
const GROUPINGS: [Grouping; 4] = [
    Grouping { merge: Merge::Off, tie_layers: false },
    Grouping { merge: Merge::Proven, tie_layers: false },
    Grouping { merge: Merge::Cheapest, tie_layers: false },
    Grouping { merge: Merge::Proven, tie_layers: true },
];

#[test]
fn built_edges_are_the_conversions_between_their_strategies() -> Result<()> {
    let cpu = DeviceProfile::builtin("cpu").context("cpu profile")?;
    let mut rows = vec![];
    for (name, g) in graphs()? {
        for mesh in ["3", "2x3", "1x4", "2x2"] {
            let t = Instant::now();
            let mesh = DeviceMesh::parse(mesh, &cpu)?;
            let mut b = build(&g, &mesh, &cpu, Baseline::Auto, None).with_context(|| format!("{name} on {mesh}"))?;
            let what = format!("{name} on {mesh}");
            check_strategies(&g, &mesh, &b).context(what.clone())?;
            let (entries, uneven) = check_edges(&g, &mesh, &b).context(what.clone())?;
            ensure!(uneven > 0, "{what}: no edge joins nodes with different strategy counts");
            let mut folded = vec![];
            let mut links = 0;
            for how in GROUPINGS {
                links += check_links(&b, &b.groups(&g, how)).with_context(|| format!("{what}: links of {how:?}"))?;
                let f = b.fold(&g, how).with_context(|| format!("{what}: folding {how:?}"))?;
                check_folded(&b, &f).with_context(|| format!("{what}: folded by {how:?}"))?;
                folded.push(f.folded.problem.nodes.len());
            }
            // A budget between the smallest and the largest peak (when strategies differ in
            // memory at all): memory may bind, so proven responses must also use no more
            // memory than the strategies they exclude.
            let (lo, hi) = (b.problem.min_peak_usage().0, b.problem.max_peak_usage());
            if hi > lo + 1 {
                b.problem.usage_limit = Some(((lo + hi) / 2).min(u64::MAX as u128) as u64);
                ensure!(b.problem.memory_may_bind(), "{what}: the budget should be able to bind");
                let how = Grouping { merge: Merge::Proven, tie_layers: false };
                links +=
                    check_links(&b, &b.groups(&g, how)).with_context(|| format!("{what}: links under a budget"))?;
            }
            rows.push(format!(
                "| {name} | {mesh} | {} | {} | {uneven} | {entries} | {links} | {folded:?} | {:.1} s |",
                b.problem.nodes.len(),
                b.problem.edges.len(),
                t.elapsed().as_secs_f64()
            ));
        }
    }
    println!(
        "| model | mesh | nodes | edges | edges with unequal ends | entries checked | links checked | folded nodes (off, proven, cheapest, tied) | time |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        println!("{r}");
    }
    Ok(())
}

/// Every strategy's specs fit their tensors on the mesh (every split divides its dim), node
/// costs are the strategies' seconds, and every node keeps its fully replicated strategy.
fn check_strategies(g: &Graph, mesh: &DeviceMesh, b: &Built) -> Result<()> {
    for (i, (&n, st)) in b.nodes.iter().zip(&b.strategies).enumerate() {
        let node = g.node(n);
        let ins: Vec<TensorMeta> = g.node_inputs(n).iter().map(|v| g.meta(*v).clone()).collect();
        ensure!(!st.is_empty(), "{}: no strategy", node.name);
        ensure!(
            st.iter().any(|s| s.inputs.iter().chain(&s.outputs).all(|x| x.is_replicated())),
            "{}: no replicated strategy",
            node.name
        );
        for (j, s) in st.iter().enumerate() {
            for (spec, meta) in s.inputs.iter().zip(&ins).chain(s.outputs.iter().zip(&node.outputs)) {
                spec.check(&meta.shape, mesh).with_context(|| format!("{} strategy {}", node.name, s.name))?;
            }
            ensure!(
                b.problem.nodes[i].costs[j] == to_cost(s.seconds()),
                "{} strategy {}: node cost {} but the strategy takes {} s",
                node.name,
                s.name,
                b.problem.nodes[i].costs[j],
                s.seconds()
            );
        }
    }
    Ok(())
}

/// Recomputes every edge matrix of `b` from the strategies' specs and compares it, entry by
/// entry and from both ends, with the built one. Returns the entries checked and the number of
/// edges whose ends have different strategy counts.
fn check_edges(g: &Graph, mesh: &DeviceMesh, b: &Built) -> Result<(usize, usize)> {
    let converter = LayoutConverter::new(mesh.clone(), Search::Auto);
    let pos: HashMap<NodeIndex, usize> = b.nodes.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let k: Vec<usize> = b.strategies.iter().map(Vec::len).collect();
    // Expected matrices keyed by (smaller, larger) solver node, oriented [s_smaller][s_larger],
    // summed exactly (u128) and clamped once at the end.
    let mut want: BTreeMap<(usize, usize), Vec<u128>> = BTreeMap::new();
    let mut add = |a: usize, b: usize, cost: &mut dyn FnMut(usize, usize) -> Result<u64>| -> Result<()> {
        let (lo, hi) = (a.min(b), a.max(b));
        let m = want.entry((lo, hi)).or_insert_with(|| vec![0; k[lo] * k[hi]]);
        for sa in 0..k[a] {
            for sb in 0..k[b] {
                let at = if a == lo { sa * k[hi] + sb } else { sb * k[hi] + sa };
                m[at] += cost(sa, sb)? as u128;
            }
        }
        Ok(())
    };
    for (iv, &v) in b.nodes.iter().enumerate() {
        for (slot, val) in g.node_inputs(v).iter().enumerate() {
            let iu = pos[&val.node];
            let meta = g.meta(*val);
            add(iu, iv, &mut |su, sv| {
                let from = &b.strategies[iu][su].outputs[val.slot];
                let to = &b.strategies[iv][sv].inputs[slot];
                Ok(if from == to {
                    0
                } else {
                    to_cost(converter.convert(&meta.shape, meta.dtype.size(), from, to)?.cost)
                })
            })?;
        }
    }
    for (p, val) in &g.updates {
        let (ip, iu) = (pos[p], pos[&val.node]);
        add(ip, iu, &mut |sp, su| {
            let same = b.strategies[ip][sp].outputs[0] == b.strategies[iu][su].outputs[val.slot];
            Ok(if same { 0 } else { FORBIDDEN })
        })?;
    }
    let have: BTreeSet<(usize, usize)> = b.problem.edges.iter().map(|e| e.nodes).collect();
    ensure!(have.len() == b.problem.edges.len(), "parallel edges in the built problem");
    let expected: BTreeSet<(usize, usize)> = want.keys().copied().collect();
    ensure!(
        have == expected,
        "edges {:?} built but {:?} expected",
        have.difference(&expected),
        expected.difference(&have)
    );
    let (mut entries, mut uneven) = (0, 0);
    for e in &b.problem.edges {
        let (u, v) = e.nodes;
        ensure!(u < v, "edge {u}-{v} is not oriented producer first");
        ensure!(e.costs.len() == k[u] * k[v], "edge {u}-{v}: {} entries for {} x {}", e.costs.len(), k[u], k[v]);
        uneven += usize::from(k[u] != k[v]);
        let w = &want[&(u, v)];
        for su in 0..k[u] {
            for sv in 0..k[v] {
                let expect = w[su * k[v] + sv].min(FORBIDDEN as u128) as u64;
                let (from_u, from_v) = (e.cost_from(u, su, sv, &k), e.cost_from(v, sv, su, &k));
                ensure!(
                    from_u == expect && from_v == expect,
                    "edge {} -> {} at ({}, {}): {from_u} from the first end, {from_v} from the second, {expect} recomputed",
                    g.node(b.nodes[u]).name,
                    g.node(b.nodes[v]).name,
                    b.strategies[u][su].name,
                    b.strategies[v][sv].name
                );
                entries += 1;
            }
        }
    }
    Ok((entries, uneven))
}

/// Every link a grouping made against its claim, recomputed from the built edges (indexed here
/// directly, row-major from the edge's smaller node): an exact tie allows exactly the mapped
/// strategy in each of the parent's rows; a proven response does at least as well as every
/// other strategy of the follower whatever its other neighbours choose, and uses no more memory
/// when memory may bind; a cheapest response is the cheapest (then least memory, then lowest
/// index). Returns the links checked.
fn check_links(b: &Built, groups: &Groups) -> Result<usize> {
    let p = &b.problem;
    let k: Vec<usize> = p.nodes.iter().map(|n| n.strategies()).collect();
    let index: HashMap<(usize, usize), usize> = p.edges.iter().enumerate().map(|(i, e)| (e.nodes, i)).collect();
    // Edge `i` with its end `a` at `sa` and its other end at `sb`.
    let at = |i: usize, a: usize, sa: usize, sb: usize| -> i128 {
        let e = &p.edges[i];
        let (lo, hi) = e.nodes;
        (if a == lo { e.costs[sa * k[hi] + sb] } else { e.costs[sb * k[a] + sa] }) as i128
    };
    let memory = p.memory_may_bind();
    for l in &groups.links {
        let (c, par) = (l.child, l.parent);
        let main = *index.get(&(c.min(par), c.max(par))).with_context(|| format!("link {c} <- {par} has no edge"))?;
        ensure!(l.map.len() == k[par] && l.map.iter().all(|&s| s < k[c]), "link {c} <- {par}: bad map");
        let node = &p.nodes[c];
        let local = |sp: usize, t: usize| node.costs[t] as i128 + at(main, par, sp, t);
        match l.why {
            Why::Tie => {
                for (sp, &to) in l.map.iter().enumerate() {
                    let allowed: Vec<usize> = (0..k[c]).filter(|&t| at(main, par, sp, t) < FORBIDDEN as i128).collect();
                    ensure!(allowed == [to], "tie {c} <- {par} at {sp}: maps to {to} but {allowed:?} allowed");
                }
            }
            Why::Cheapest => {
                for (sp, &to) in l.map.iter().enumerate() {
                    let best = (0..k[c]).min_by_key(|&t| (local(sp, t), node.usages[t], t));
                    ensure!(best == Some(to), "cheapest {c} <- {par} at {sp}: {to} but {best:?}");
                }
            }
            Why::Proven => {
                let others: Vec<(usize, usize)> = p
                    .edges
                    .iter()
                    .enumerate()
                    .filter(|&(i, e)| i != main && e.nodes.0 != e.nodes.1 && (e.nodes.0 == c || e.nodes.1 == c))
                    .map(|(i, e)| (i, if e.nodes.0 == c { e.nodes.1 } else { e.nodes.0 }))
                    .collect();
                let mut worst: HashMap<(usize, usize), i128> = HashMap::new();
                for (sp, &a) in l.map.iter().enumerate() {
                    for t in (0..k[c]).filter(|&t| t != a) {
                        ensure!(
                            !memory || node.usages[a] <= node.usages[t],
                            "proven {c} <- {par} at {sp}: {a} uses more memory than {t}"
                        );
                        let w = *worst.entry((a, t)).or_insert_with(|| {
                            others
                                .iter()
                                .map(|&(o, w)| (0..k[w]).map(|sw| at(o, c, a, sw) - at(o, c, t, sw)).max().unwrap_or(0))
                                .sum()
                        });
                        ensure!(
                            local(sp, t) - local(sp, a) >= w,
                            "proven {c} <- {par} at {sp}: {a} is not proven against {t} ({} - {} < {w})",
                            local(sp, t),
                            local(sp, a)
                        );
                    }
                }
            }
        }
    }
    Ok(groups.links.len())
}

/// The folded problem against its members: node costs and edge entries recomputed from the
/// built problem through the expansion maps, and random folded solutions costing what their
/// expansions cost.
fn check_folded(b: &Built, f: &Folding) -> Result<()> {
    let (p, fp) = (&b.problem, &f.folded.problem);
    let groups = f.folded.groups();
    let k: Vec<usize> = p.nodes.iter().map(|n| n.strategies()).collect();
    let kf: Vec<usize> = fp.nodes.iter().map(|n| n.strategies()).collect();
    ensure!(groups.len() == fp.nodes.len(), "{} groups for {} folded nodes", groups.len(), fp.nodes.len());
    // (group, map) of every built node.
    let mut of: Vec<Option<(usize, &[usize])>> = vec![None; p.nodes.len()];
    for (gi, members) in groups.iter().enumerate() {
        for m in members {
            ensure!(of[m.node].is_none(), "node {} in two groups", m.node);
            ensure!(m.map.len() == kf[gi], "node {}: map of {} for {} strategies", m.node, m.map.len(), kf[gi]);
            of[m.node] = Some((gi, &m.map));
        }
    }
    let of: Vec<(usize, &[usize])> = of
        .into_iter()
        .enumerate()
        .map(|(i, o)| o.with_context(|| format!("node {i} in no group")))
        .collect::<Result<_>>()?;
    let clamp = |x: u128| x.min(FORBIDDEN as u128) as u64;
    // Node costs: members' costs plus the edges inside the group.
    let mut node_want: Vec<Vec<u128>> = kf.iter().map(|&n| vec![0; n]).collect();
    for (gi, members) in groups.iter().enumerate() {
        for m in members {
            for (s, &ms) in m.map.iter().enumerate() {
                node_want[gi][s] += p.nodes[m.node].costs[ms] as u128;
            }
        }
    }
    // Edges between groups, oriented [s_smaller group][s_larger group].
    let mut edge_want: BTreeMap<(usize, usize), Vec<u128>> = BTreeMap::new();
    for e in &p.edges {
        let (a, c) = e.nodes;
        let ((ga, ma), (gc, mc)) = (of[a], of[c]);
        if ga == gc {
            for (s, (&sa, &sc)) in ma.iter().zip(mc).enumerate() {
                node_want[ga][s] += e.cost_from(a, sa, sc, &k) as u128;
            }
            continue;
        }
        let (lo, hi) = (ga.min(gc), ga.max(gc));
        let m = edge_want.entry((lo, hi)).or_insert_with(|| vec![0; kf[lo] * kf[hi]]);
        for (sa, &xa) in ma.iter().enumerate() {
            for (sc, &xc) in mc.iter().enumerate() {
                let at = if ga == lo { sa * kf[hi] + sc } else { sc * kf[hi] + sa };
                // Read from the second end half the time: both must agree.
                let cost = if (sa + sc) % 2 == 0 { e.cost_from(a, xa, xc, &k) } else { e.cost_from(c, xc, xa, &k) };
                m[at] += cost as u128;
            }
        }
    }
    for (gi, (node, want)) in fp.nodes.iter().zip(&node_want).enumerate() {
        // A group's strategies are allowed combinations of its members' (a tie map that
        // pairs a parameter with an update of another layout would be forbidden here).
        ensure!(
            want.iter().all(|&c| c < FORBIDDEN as u128),
            "folded node {gi} (members {:?}) has a forbidden strategy",
            groups[gi].iter().map(|m| m.node).collect::<Vec<_>>()
        );
        for (s, (&have, &sum)) in node.costs.iter().zip(want).enumerate() {
            ensure!(have == clamp(sum), "folded node {gi} at {s}: {have} but members sum to {sum}");
        }
    }
    let have: BTreeSet<(usize, usize)> = fp.edges.iter().map(|e| e.nodes).collect();
    let expected: BTreeSet<(usize, usize)> = edge_want.keys().copied().collect();
    ensure!(have.len() == fp.edges.len(), "parallel edges in the folded problem");
    ensure!(
        have == expected,
        "folded edges {:?} but member edges {:?}",
        have.difference(&expected),
        expected.difference(&have)
    );
    for e in &fp.edges {
        let (u, v) = e.nodes;
        let w = &edge_want[&(u, v)];
        for su in 0..kf[u] {
            for sv in 0..kf[v] {
                let expect = clamp(w[su * kf[v] + sv]);
                let (from_u, from_v) = (e.cost_from(u, su, sv, &kf), e.cost_from(v, sv, su, &kf));
                ensure!(
                    from_u == expect && from_v == expect,
                    "folded edge {u}-{v} at ({su}, {sv}): {from_u} / {from_v}, members sum to {expect}"
                );
            }
        }
    }
    // Whole solutions: the folded cost is the expanded one.
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..20 {
        let x: Vec<usize> = kf
            .iter()
            .map(|&n| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                (seed % n as u64) as usize
            })
            .collect();
        let full = f.folded.expand(&x)?;
        let (a, e) = (fp.evaluate(&x)?, p.evaluate(&full)?);
        ensure!(a.cost == e.cost, "folded solution costs {} but its expansion {}", a.cost, e.cost);
    }
    Ok(())
}

#[test]
fn planning_never_panics_on_any_mesh() -> Result<()> {
    let cpu = DeviceProfile::builtin("cpu").context("cpu profile")?;
    let meshes = ["2", "3", "4", "8", "1x4", "4x1", "2x2", "2x3", "2x4", "2x2x2", "4x4x4"];
    let opts = PlanOptions { time_limit: Duration::from_millis(500), threads: 1, ..PlanOptions::default() };
    let mut rows = vec![];
    let mut failures = vec![];
    for (name, g) in graphs()? {
        for text in meshes {
            let mesh = DeviceMesh::parse(text, &cpu)?;
            let t = Instant::now();
            let outcome = catch_unwind(AssertUnwindSafe(|| codegen::plan(&g, &mesh, &cpu, &opts)));
            let secs = t.elapsed().as_secs_f64();
            let verdict = match outcome {
                Err(panic) => {
                    let why = panic
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default();
                    failures.push(format!("{name} on {text}: panicked: {why}"));
                    "PANIC".to_string()
                }
                Ok(Err(codegen::Error::Internal(e))) => {
                    failures.push(format!("{name} on {text}: internal error: {e}"));
                    "internal error".to_string()
                }
                Ok(Err(e)) => format!("error: {e}"),
                // The time limit holds, with a generous margin in this debug build for what
                // cannot be interrupted (issue 20; release figures in BENCHMARKS.md).
                Ok(Ok(p)) if p.solver.seconds > opts.time_limit.as_secs_f64() + 30.0 => {
                    failures.push(format!(
                        "{name} on {text}: {:.1} s over a {:?} limit",
                        p.solver.seconds, opts.time_limit
                    ));
                    "over its time limit".to_string()
                }
                Ok(Ok(p)) => match Plan::from_json(&p.to_json().unwrap()) {
                    Ok(_) => format!("{:.3} ms, {}", p.estimate.step_seconds * 1e3, p.solver.chosen.name()),
                    Err(e) => {
                        failures.push(format!("{name} on {text}: the plan fails its own loader: {e}"));
                        "invalid plan".to_string()
                    }
                },
            };
            rows.push(format!("| {name} | {text} | {verdict} | {secs:.1} s |"));
        }
    }
    println!("| model | mesh | outcome | plan time |\n|---|---|---|---|");
    for r in &rows {
        println!("{r}");
    }
    if !failures.is_empty() {
        bail!("{}", failures.join("\n"));
    }
    Ok(())
}
