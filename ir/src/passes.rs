//! Graph passes.
//!
//! [`canonicalize`] simplifies the view and arithmetic ops that exporters leave behind, by
//! equality saturation with egg over a small language of the rewritable ops, then extraction of
//! the smallest equivalent term per value:
//! - `identity(x) -> x`
//! - `transpose(p, transpose(q, x)) -> transpose(q∘p, x)`, and an identity permutation vanishes;
//! - `reshape(s, reshape(t, x)) -> reshape(s, x)`, and a reshape to the input's shape vanishes;
//! - `x * 1 -> x`, `x + 0 -> x` (either operand order) when the constant does not broadcast `x`
//!   to a larger shape and the dtypes agree.
//!
//! Every other op is an opaque leaf. The pass keeps the graph's invariants; it verifies the
//! result and reports a [`PassError`] if that ever fails (a bug in the pass, not user input).

use std::collections::HashMap;

use egg::{Analysis, DidMerge, EGraph, Id, Language, Runner, Symbol, define_language, rewrite};

use crate::graph::{Graph, Value};
use crate::op::{BinaryOp, Op};
use crate::tensor::{DType, Data};
use crate::verify::verify;

define_language! {
    enum Canon {
        "transpose" = Transpose([Id; 2]),
        "reshape" = Reshape([Id; 2]),
        "identity" = Identity([Id; 1]),
        "add" = Add([Id; 2]),
        "mul" = Mul([Id; 2]),
        Leaf(Symbol),
    }
}

/// Leaves: `v<node>_<slot>` (a value), `one<node>`/`zero<node>` (constants of all ones/zeros,
/// also values), `p<i>_<j>..` (a permutation), `s<d>_<d>..` (a shape).
fn list_sym(prefix: char, v: &[usize]) -> Symbol {
    let body: Vec<String> = v.iter().map(|x| x.to_string()).collect();
    Symbol::from(format!("{prefix}{}", body.join("_")))
}

fn parse_list(s: &str) -> Vec<usize> {
    s[1..].split('_').filter(|x| !x.is_empty()).filter_map(|x| x.parse().ok()).collect()
}

#[derive(Default)]
struct Shapes {
    leaves: HashMap<Symbol, (Vec<usize>, DType)>,
}

type Meta = Option<(Vec<usize>, DType)>;

impl Analysis<Canon> for Shapes {
    type Data = Meta;
    fn make(eg: &mut EGraph<Canon, Self>, enode: &Canon, _id: Id) -> Meta {
        let get = |i: &Id| eg[*i].data.clone();
        match enode {
            Canon::Leaf(s) => eg.analysis.leaves.get(s).cloned(),
            Canon::Identity([x]) => get(x),
            Canon::Transpose([p, x]) => {
                let perm = leaf_list(eg, *p)?;
                let (s, d) = get(x)?;
                Some((perm.iter().map(|&i| s.get(i).copied()).collect::<Option<Vec<_>>>()?, d))
            }
            Canon::Reshape([s, x]) => {
                let shape = leaf_list(eg, *s)?;
                let (_, d) = get(x)?;
                Some((shape, d))
            }
            Canon::Add([a, b]) | Canon::Mul([a, b]) => {
                let ((sa, da), (sb, _)) = (get(a)?, get(b)?);
                Some((crate::op::broadcast_shapes(&sa, &sb).ok()?, da))
            }
        }
    }
    fn merge(&mut self, a: &mut Meta, b: Meta) -> DidMerge {
        if a.is_none() && b.is_some() {
            *a = b;
            DidMerge(true, false)
        } else {
            DidMerge(false, a.is_some() && b.is_none())
        }
    }
}

fn leaf_sym(eg: &EGraph<Canon, Shapes>, id: Id) -> Option<Symbol> {
    eg[id].nodes.iter().find_map(|n| match n {
        Canon::Leaf(s) => Some(*s),
        _ => None,
    })
}

fn leaf_list(eg: &EGraph<Canon, Shapes>, id: Id) -> Option<Vec<usize>> {
    leaf_sym(eg, id).map(|s| parse_list(s.as_str()))
}

fn is_const(eg: &EGraph<Canon, Shapes>, id: Id, prefix: &str) -> bool {
    leaf_sym(eg, id).is_some_and(|s| s.as_str().starts_with(prefix))
}

/// `?x op ?c` may drop `?c` when `?c` is the neutral constant and the result keeps `?x`'s meta.
fn neutral(
    x: &'static str,
    c: &'static str,
    prefix: &'static str,
) -> impl Fn(&mut EGraph<Canon, Shapes>, Id, &egg::Subst) -> bool {
    let (xv, cv): (egg::Var, egg::Var) = (x.parse().expect("pattern var"), c.parse().expect("pattern var"));
    move |eg, id, subst| {
        is_const(eg, subst[cv], prefix) && eg[subst[xv]].data.is_some() && eg[subst[xv]].data == eg[id].data
    }
}

struct ComposeTranspose;

impl egg::Applier<Canon, Shapes> for ComposeTranspose {
    fn apply_one(
        &self,
        eg: &mut EGraph<Canon, Shapes>,
        id: Id,
        subst: &egg::Subst,
        _: Option<&egg::PatternAst<Canon>>,
        _: Symbol,
    ) -> Vec<Id> {
        let v = |s: &str| subst[s.parse::<egg::Var>().expect("pattern var")];
        let (Some(p), Some(q)) = (leaf_list(eg, v("?p")), leaf_list(eg, v("?q"))) else { return vec![] };
        if p.len() != q.len() {
            return vec![];
        }
        // out[i] = mid[p[i]] = x[q[p[i]]]
        let r: Vec<usize> = p.iter().map(|&i| q[i]).collect();
        let x = v("?x");
        let new = if r.iter().enumerate().all(|(i, &j)| i == j) {
            x
        } else {
            let pr = eg.add(Canon::Leaf(list_sym('p', &r)));
            eg.add(Canon::Transpose([pr, x]))
        };
        if eg.union(id, new) { vec![new] } else { vec![] }
    }
}

fn rules() -> Vec<egg::Rewrite<Canon, Shapes>> {
    let same_shape = |x: &'static str| {
        let xv: egg::Var = x.parse().expect("pattern var");
        move |eg: &mut EGraph<Canon, Shapes>, id: Id, subst: &egg::Subst| {
            eg[subst[xv]].data.is_some() && eg[subst[xv]].data == eg[id].data
        }
    };
    vec![
        rewrite!("identity"; "(identity ?x)" => "?x"),
        rewrite!("transpose-transpose"; "(transpose ?p (transpose ?q ?x))" => { ComposeTranspose }),
        rewrite!("transpose-noop"; "(transpose ?p ?x)" => "?x" if same_shape("?x") if is_identity_perm("?p")),
        rewrite!("reshape-reshape"; "(reshape ?s (reshape ?t ?x))" => "(reshape ?s ?x)"),
        rewrite!("reshape-noop"; "(reshape ?s ?x)" => "?x" if same_shape("?x")),
        rewrite!("mul-one"; "(mul ?x ?c)" => "?x" if neutral("?x", "?c", "one")),
        rewrite!("one-mul"; "(mul ?c ?x)" => "?x" if neutral("?x", "?c", "one")),
        rewrite!("add-zero"; "(add ?x ?c)" => "?x" if neutral("?x", "?c", "zero")),
        rewrite!("zero-add"; "(add ?c ?x)" => "?x" if neutral("?x", "?c", "zero")),
    ]
}

fn is_identity_perm(p: &'static str) -> impl Fn(&mut EGraph<Canon, Shapes>, Id, &egg::Subst) -> bool {
    let pv: egg::Var = p.parse().expect("pattern var");
    move |eg, _, subst| leaf_list(eg, subst[pv]).is_some_and(|v| v.iter().enumerate().all(|(i, &j)| i == j))
}

/// A pass produced an invalid graph (a bug in the pass).
#[derive(Debug, thiserror::Error)]
#[error("pass {pass} broke the graph: {message}")]
pub struct PassError {
    /// Pass name.
    pub pass: &'static str,
    /// Verifier output.
    pub message: String,
}

/// What [`canonicalize`] changed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct CanonStats {
    /// Values whose producer chain was replaced by a smaller one.
    pub rewritten: usize,
    /// Nodes removed in all.
    pub removed: usize,
}

fn rewritable(op: &Op) -> bool {
    matches!(op, Op::Identity | Op::Transpose { .. } | Op::Reshape { .. } | Op::Binary(BinaryOp::Add | BinaryOp::Mul))
}

fn const_kind(op: &Op) -> Option<&'static str> {
    let Op::Constant(t) = op else { return None };
    match t.data() {
        Data::F32(v) if v.iter().all(|&x| x == 1.0) => Some("one"),
        Data::F32(v) if v.iter().all(|&x| x == 0.0) => Some("zero"),
        Data::I64(v) if v.iter().all(|&x| x == 1) => Some("one"),
        Data::I64(v) if v.iter().all(|&x| x == 0) => Some("zero"),
        _ => None,
    }
}

/// Runs the canonicalisation rewrites described in the module docs, then removes dead nodes.
pub fn canonicalize(g: &mut Graph) -> Result<CanonStats, PassError> {
    let before = g.node_count();
    let order = g.topo_order().map_err(|_| PassError { pass: "canonicalize", message: "graph has a cycle".into() })?;
    let mut eg: EGraph<Canon, Shapes> = EGraph::new(Shapes::default());
    let mut ids: HashMap<Value, Id> = HashMap::new();
    // Size of the term each value currently has (saturating: shared DAGs can blow up as trees).
    let mut size: HashMap<Value, u64> = HashMap::new();
    let mut leaf_of: HashMap<Symbol, Value> = HashMap::new();
    for &n in &order {
        let node = g.node(n);
        let ins = g.node_inputs(n);
        if !rewritable(&node.op) {
            for slot in 0..node.outputs.len() {
                let v = Value::new(n, slot);
                let sym = match const_kind(&node.op) {
                    Some(k) => Symbol::from(format!("{k}{}", n.index())),
                    None => Symbol::from(format!("v{}_{slot}", n.index())),
                };
                eg.analysis.leaves.insert(sym, (node.outputs[slot].shape.clone(), node.outputs[slot].dtype));
                let id = eg.add(Canon::Leaf(sym));
                leaf_of.insert(sym, v);
                ids.insert(v, id);
                size.insert(v, 1);
            }
            continue;
        }
        let child = |v: &Value| ids[v];
        let sz: u64 = ins.iter().map(|v| size[v]).fold(1u64, |a, b| a.saturating_add(b));
        let e = match &node.op {
            Op::Identity => Canon::Identity([child(&ins[0])]),
            Op::Transpose { perm } => Canon::Transpose([eg.add(Canon::Leaf(list_sym('p', perm))), child(&ins[0])]),
            Op::Reshape { shape } => Canon::Reshape([eg.add(Canon::Leaf(list_sym('s', shape))), child(&ins[0])]),
            Op::Binary(BinaryOp::Add) => Canon::Add([child(&ins[0]), child(&ins[1])]),
            Op::Binary(BinaryOp::Mul) => Canon::Mul([child(&ins[0]), child(&ins[1])]),
            _ => unreachable!("rewritable() lists these ops"),
        };
        let id = eg.add(e);
        let v = Value::new(n, 0);
        ids.insert(v, id);
        // Attribute leaves count 1 each, as in extraction.
        let attr = u64::from(matches!(node.op, Op::Transpose { .. } | Op::Reshape { .. }));
        size.insert(v, sz.saturating_add(attr));
    }
    let runner = Runner::default().with_egraph(eg).with_iter_limit(30).with_node_limit(200_000).run(&rules());
    let eg = runner.egraph;
    let extractor = Smallest::new(&eg);
    // Boundary values: produced by a rewritable op, read by something else or a graph output.
    let mut boundary: Vec<Value> = Vec::new();
    for &n in &order {
        if !rewritable(&g.node(n).op) {
            continue;
        }
        let v = Value::new(n, 0);
        let read_outside =
            g.users(v).iter().any(|(u, _)| !rewritable(&g.node(*u).op)) || g.outputs.iter().any(|(_, o)| *o == v);
        if read_outside {
            boundary.push(v);
        }
    }
    let mut stats = CanonStats::default();
    for v in boundary {
        // The cost first: building the term walks everything below it, which over a long chain
        // of boundary values (a residual stream) would be quadratic when nothing is rewritten.
        let class = ids[&v];
        if extractor.cost(class) >= size[&v] {
            continue;
        }
        let expr = extractor.term(class);
        let name = g.node(v.node).name.clone();
        let new = build(g, &expr, &leaf_of, &name).map_err(|m| PassError { pass: "canonicalize", message: m })?;
        if new != v {
            g.replace_all_uses(v, new);
            stats.rewritten += 1;
        }
    }
    g.remove_dead();
    stats.removed = before.saturating_sub(g.node_count());
    verify(g).map_err(|e| PassError { pass: "canonicalize", message: e.to_string() })?;
    Ok(stats)
}

/// The smallest term (AST size, as `egg::AstSize` counts it) of every e-class.
///
/// `egg::Extractor` finds the costs by sweeping all classes until nothing changes, in hash
/// order; over a chain of n rewritable ops that takes about n sweeps, so canonicalising an
/// 80k-node chain took minutes. Here each class is settled once, cheapest first (Knuth's
/// generalisation of Dijkstra's algorithm, exact for costs that are at least each child's cost):
/// O(N log N) in the e-graph's size. Among nodes of the optimal cost, a class keeps the first in
/// its node list.
struct Smallest<'a> {
    eg: &'a EGraph<Canon, Shapes>,
    /// Per canonical class: its cost and the index of its chosen node.
    best: HashMap<Id, (u64, usize)>,
}

impl<'a> Smallest<'a> {
    fn new(eg: &'a EGraph<Canon, Shapes>) -> Smallest<'a> {
        use std::cmp::Reverse;
        use std::collections::BinaryHeap;
        let classes: Vec<_> = eg.classes().collect();
        let index: HashMap<Id, usize> = classes.iter().enumerate().map(|(i, c)| (c.id, i)).collect();
        let child = |id: Id| index[&eg.find(id)];
        // Per node: children not settled yet; per class: the nodes (class, node) reading it.
        let mut pending: Vec<Vec<usize>> = Vec::with_capacity(classes.len());
        let mut users: Vec<Vec<(usize, usize)>> = vec![Vec::new(); classes.len()];
        let mut heap = BinaryHeap::new();
        for (ci, c) in classes.iter().enumerate() {
            let mut p = Vec::with_capacity(c.nodes.len());
            for (ni, n) in c.nodes.iter().enumerate() {
                p.push(n.children().len());
                for &ch in n.children() {
                    users[child(ch)].push((ci, ni));
                }
                if n.children().is_empty() {
                    heap.push(Reverse((1u64, ci, ni)));
                }
            }
            pending.push(p);
        }
        let mut cost: Vec<Option<u64>> = vec![None; classes.len()];
        let node_cost = |cost: &[Option<u64>], n: &Canon| -> Option<u64> {
            n.children().iter().try_fold(1u64, |acc, &ch| Some(acc.saturating_add(cost[child(ch)]?)))
        };
        while let Some(Reverse((c, ci, _))) = heap.pop() {
            if cost[ci].is_some() {
                continue;
            }
            cost[ci] = Some(c);
            for &(pc, pn) in &users[ci] {
                pending[pc][pn] -= 1;
                if pending[pc][pn] == 0 && cost[pc].is_none() {
                    let n = &classes[pc].nodes[pn];
                    let nc = node_cost(&cost, n).expect("every child is settled");
                    heap.push(Reverse((nc, pc, pn)));
                }
            }
        }
        // The first node of optimal cost per class (well-founded: costs grow strictly upward).
        let mut best = HashMap::with_capacity(classes.len());
        for (ci, c) in classes.iter().enumerate() {
            let Some(opt) = cost[ci] else { continue };
            if let Some(ni) = c.nodes.iter().position(|n| node_cost(&cost, n) == Some(opt)) {
                best.insert(c.id, (opt, ni));
            }
        }
        Smallest { eg, best }
    }

    /// Size of the smallest term of `id`'s class (`u64::MAX` when it has none, e.g. a cycle).
    fn cost(&self, id: Id) -> u64 {
        self.best.get(&self.eg.find(id)).map_or(u64::MAX, |b| b.0)
    }

    /// The smallest term of `id`'s class, sharing repeated subterms. Only for a class that has a
    /// cost (see [`Smallest::cost`]); so do all classes below it.
    fn term(&self, id: Id) -> egg::RecExpr<Canon> {
        let node = |id: Id| {
            let c = self.eg.find(id);
            let (_, ni) = self.best[&c];
            self.eg[c].nodes[ni].clone()
        };
        node(id).build_recexpr(node)
    }
}

fn build(
    g: &mut Graph,
    expr: &egg::RecExpr<Canon>,
    leaf_of: &HashMap<Symbol, Value>,
    name: &str,
) -> Result<Value, String> {
    let mut vals: Vec<Option<Value>> = Vec::with_capacity(expr.len());
    let get = |vals: &Vec<Option<Value>>, i: Id| {
        vals[usize::from(i)].ok_or_else(|| "extracted term uses an attribute as a value".to_string())
    };
    for node in expr.as_ref() {
        let attr = |j: Id| match &expr[j] {
            Canon::Leaf(s) => Ok(parse_list(s.as_str())),
            _ => Err("attribute is not a leaf".to_string()),
        };
        let v = match node {
            Canon::Leaf(s) => leaf_of.get(s).copied(),
            Canon::Identity([x]) => Some(get(&vals, *x)?),
            Canon::Transpose([p, x]) => Some(
                g.add1(&format!("{name}.t"), Op::Transpose { perm: attr(*p)? }, &[get(&vals, *x)?])
                    .map_err(|e| e.to_string())?,
            ),
            Canon::Reshape([s, x]) => Some(
                g.add1(&format!("{name}.r"), Op::Reshape { shape: attr(*s)? }, &[get(&vals, *x)?])
                    .map_err(|e| e.to_string())?,
            ),
            Canon::Add([a, b]) => Some(
                g.add1(name, Op::Binary(BinaryOp::Add), &[get(&vals, *a)?, get(&vals, *b)?])
                    .map_err(|e| e.to_string())?,
            ),
            Canon::Mul([a, b]) => Some(
                g.add1(name, Op::Binary(BinaryOp::Mul), &[get(&vals, *a)?, get(&vals, *b)?])
                    .map_err(|e| e.to_string())?,
            ),
        };
        vals.push(v);
    }
    let root = Id::from(expr.len() - 1);
    get(&vals, root)
}
