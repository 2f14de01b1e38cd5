//! Import of the indexing family ([`ir::IndexOp`]: Trilu, ScatterND, GatherND, GatherElements,
//! ScatterElements, CumSum, ArgMax, ArgMin, TopK) and of the ops that are rewrites into existing
//! ones under static shapes: Mod (a [`BinaryOp`]), Tile (reshape, expand, reshape), OneHot
//! (a comparison with a range and a `Where`), EyeLike (a constant) and Einsum (transposes,
//! reshapes, reduce-sums and one batched MatMul).
//!
//! Like every op, these fold into constants when all their inputs are known.

use std::rc::Rc;

use ir::{BinaryOp, DType, IndexOp, Op, ReduceOp, ScatterReduction, SliceAxis, Tensor, TensorMeta};

use super::{Importer, N, V, elem_dtype, norm_axis};

impl Importer<'_> {
    /// Translates one node of the family (see the module docs).
    pub(super) fn translate_index(&mut self, n: &N) -> Result<Vec<Option<V>>, String> {
        let nm = n.name.clone();
        let op_type = n.node.op_type.as_str();
        let one = |v: V| Ok(vec![Some(v)]);
        let reduction = |n: &N| {
            let r = n.string("reduction").unwrap_or_else(|| "none".into());
            ScatterReduction::from_name(&r).ok_or_else(|| format!("reduction={r} is not supported"))
        };
        match op_type {
            "Trilu" => {
                let x = self.need(n, 0)?;
                let k = match self.const_ints(n, 1, "k")? {
                    None => 0,
                    Some(v) if v.len() == 1 => v[0],
                    Some(v) => return Err(format!("k must hold one value, got {v:?}")),
                };
                let op = IndexOp::Trilu { upper: n.int("upper", 1) != 0, k };
                one(self.emit1(&nm, Op::Index(op), &[x])?)
            }
            "ScatterND" => {
                let ins = [self.need(n, 0)?, self.need(n, 1)?, self.need(n, 2)?];
                one(self.emit1(&nm, Op::Index(IndexOp::ScatterNd { reduction: reduction(n)? }), &ins)?)
            }
            "GatherND" => {
                let ins = [self.need(n, 0)?, self.need(n, 1)?];
                let b = usize::try_from(n.int("batch_dims", 0)).map_err(|_| "batch_dims must be >= 0".to_string())?;
                one(self.emit1(&nm, Op::Index(IndexOp::GatherNd { batch_dims: b }), &ins)?)
            }
            "GatherElements" | "ScatterElements" => {
                let (x, i) = (self.need(n, 0)?, self.need(n, 1)?);
                let axis = norm_axis(n.int("axis", 0), self.meta(&x).rank())?;
                if op_type == "GatherElements" {
                    return one(self.emit1(&nm, Op::Index(IndexOp::GatherElements { axis }), &[x, i])?);
                }
                let u = self.need(n, 2)?;
                let op = IndexOp::ScatterElements { axis, reduction: reduction(n)? };
                one(self.emit1(&nm, Op::Index(op), &[x, i, u])?)
            }
            "CumSum" => {
                let x = self.need(n, 0)?;
                let a = self.const_ints(n, 1, "axis")?.ok_or("axis is required")?;
                let [a] = a[..] else { return Err(format!("axis must hold one value, got {a:?}")) };
                let axis = norm_axis(a, self.meta(&x).rank())?;
                let op =
                    IndexOp::CumSum { axis, exclusive: n.int("exclusive", 0) != 0, reverse: n.int("reverse", 0) != 0 };
                one(self.emit1(&nm, Op::Index(op), &[x])?)
            }
            "ArgMax" | "ArgMin" => {
                let x = self.need(n, 0)?;
                let axis = norm_axis(n.int("axis", 0), self.meta(&x).rank())?;
                let (keepdims, select_last) = (n.int("keepdims", 1) != 0, n.int("select_last_index", 0) != 0);
                let op = if op_type == "ArgMax" {
                    IndexOp::ArgMax { axis, keepdims, select_last }
                } else {
                    IndexOp::ArgMin { axis, keepdims, select_last }
                };
                one(self.emit1(&nm, Op::Index(op), &[x])?)
            }
            "TopK" => {
                let x = self.need(n, 0)?;
                let m = self.meta(&x);
                let axis = norm_axis(n.int("axis", -1), m.rank())?;
                let k = if self.opset >= 10 {
                    let k = self.const_ints(n, 1, "K")?.ok_or("K is required")?;
                    let [k] = k[..] else { return Err(format!("K must hold one value, got {k:?}")) };
                    k
                } else {
                    n.int("k", -1)
                };
                let k = usize::try_from(k).map_err(|_| format!("K={k} must be >= 0"))?;
                let op = IndexOp::TopK { axis, k, largest: n.int("largest", 1) != 0 };
                // `sorted=0` allows any order; sorted is one of them.
                Ok(self.emit(&nm, Op::Index(op), &[x])?.into_iter().map(Some).collect())
            }
            "Mod" => {
                let (a, b) = (self.need(n, 0)?, self.need(n, 1)?);
                let op = if n.int("fmod", 0) != 0 { BinaryOp::Fmod } else { BinaryOp::Mod };
                one(self.emit1(&nm, Op::Binary(op), &[a, b])?)
            }
            "Tile" => self.tile(n),
            "OneHot" => self.one_hot(n),
            "EyeLike" => {
                let x = self.need(n, 0)?;
                let m = self.meta(&x);
                let [r, c] = m.shape[..] else { return Err(format!("input must be 2-D, got {m}")) };
                let dtype = match n.attr("dtype") {
                    Some(a) => elem_dtype(a.i as i32, &format!("dtype of {nm}")).map_err(|e| e.to_string())?,
                    None => m.dtype,
                };
                let k = n.int("k", 0) as i128;
                let meta = TensorMeta::new(dtype, [r, c]);
                self.constant_fits(&meta)?;
                let on = |p: usize| (p % c.max(1)) as i128 - (p / c.max(1)) as i128 == k;
                let t = match dtype {
                    DType::F32 => Tensor::f32(vec![r, c], (0..r * c).map(|p| if on(p) { 1.0 } else { 0.0 }).collect()),
                    DType::F64 => Tensor::f64(vec![r, c], (0..r * c).map(|p| if on(p) { 1.0 } else { 0.0 }).collect()),
                    DType::BF16 | DType::F16 => {
                        Tensor::f32(vec![r, c], (0..r * c).map(|p| if on(p) { 1.0 } else { 0.0 }).collect())
                            .with_float_type(dtype)
                    }
                    DType::I64 => Tensor::i64(vec![r, c], (0..r * c).map(|p| i64::from(on(p))).collect()),
                    DType::Bool => Tensor::bool(vec![r, c], (0..r * c).map(on).collect()),
                };
                one(V::C(Rc::new(t)))
            }
            "Einsum" => self.einsum(n),
            other => Err(format!("{other} is not an op of the indexing family (importer bug)")),
        }
    }

    /// Tile: `x[d0, d1]` by `[r0, r1]` is `x` reshaped to `[1, d0, 1, d1]`, expanded to
    /// `[r0, d0, r1, d1]` and reshaped to `[r0*d0, r1*d1]` (only repeated dims get a new axis).
    fn tile(&mut self, n: &N) -> Result<Vec<Option<V>>, String> {
        let nm = &n.name;
        let x = self.need(n, 0)?;
        let m = self.meta(&x);
        let reps = self.const_ints(n, 1, "repeats")?.ok_or("repeats are required")?;
        if reps.len() != m.rank() || reps.iter().any(|&r| r < 0) {
            return Err(format!("repeats {reps:?} must be {} values >= 0", m.rank()));
        }
        let (mut split, mut big, mut out) = (vec![], vec![], vec![]);
        for (&d, &r) in m.shape.iter().zip(&reps) {
            let r = r as usize;
            if r != 1 {
                split.push(1);
                big.push(r);
            }
            split.push(d);
            big.push(d);
            out.push(d.checked_mul(r).ok_or_else(|| format!("tiling {:?} by {reps:?} overflows", m.shape))?);
        }
        if out == m.shape {
            return Ok(vec![Some(x)]);
        }
        let s = self.emit1(&format!("{nm}.split"), Op::Reshape { shape: split }, &[x])?;
        let e = self.emit1(&format!("{nm}.expand"), Op::Expand { shape: big }, &[s])?;
        Ok(vec![Some(self.emit1(nm, Op::Reshape { shape: out }, &[e])?)])
    }

    /// OneHot: `where(unsqueeze(wrap(indices), axis) == range(depth), on, off)`, where `wrap` adds
    /// `depth` to negative indices; indices outside `[-depth, depth)` match nothing (all off).
    fn one_hot(&mut self, n: &N) -> Result<Vec<Option<V>>, String> {
        let nm = &n.name;
        let mut idx = self.need(n, 0)?;
        let depth = match self.opt(n, 1)? {
            Some(V::C(t)) if t.numel() == 1 => t.to_f64_vec()[0],
            Some(V::C(t)) => return Err(format!("depth must hold one value, got {}", t.meta())),
            _ => return Err("depth must be a constant".into()),
        };
        if !(depth >= 1.0 && depth <= (1u64 << 40) as f64) {
            return Err(format!("depth {depth} must be a positive count"));
        }
        let depth = depth as usize;
        let values = self.need(n, 2)?;
        let vm = self.meta(&values);
        if vm.numel() != 2 || vm.rank() != 1 {
            return Err(format!("values must be [off, on], got {vm}"));
        }
        let im = self.meta(&idx);
        let axis = norm_axis(n.int("axis", -1), im.rank() + 1)?;
        if im.dtype != DType::I64 {
            idx = self.emit1(&format!("{nm}.cast"), Op::Cast { to: DType::I64 }, &[idx])?;
        }
        let d = V::C(Rc::new(Tensor::i64(Vec::<usize>::new(), vec![depth as i64])));
        let zero = V::C(Rc::new(Tensor::i64(Vec::<usize>::new(), vec![0])));
        let neg = self.emit1(&format!("{nm}.negative"), Op::Binary(BinaryOp::Less), &[idx.clone(), zero])?;
        let up = self.emit1(&format!("{nm}.wrap"), Op::Binary(BinaryOp::Add), &[idx.clone(), d])?;
        let idx = self.emit1(&format!("{nm}.wrapped"), Op::Where, &[neg, up, idx])?;
        let mut shape = im.shape.clone();
        shape.insert(axis, 1);
        let idx = self.emit1(&format!("{nm}.unsqueeze"), Op::Reshape { shape }, &[idx])?;
        let mut rs = vec![1; im.rank() + 1];
        rs[axis] = depth;
        self.constant_fits(&TensorMeta::new(DType::I64, [depth]))?;
        let range = V::C(Rc::new(Tensor::i64(rs, (0..depth as i64).collect())));
        let hot = self.emit1(&format!("{nm}.hot"), Op::Binary(BinaryOp::Equal), &[idx, range])?;
        let pick = |s: &mut Self, i: i64, what: &str| -> Result<V, String> {
            let sl = Op::Slice { axes: vec![SliceAxis { axis: 0, start: i, len: 1, step: 1 }] };
            let v = s.emit1(&format!("{nm}.{what}"), sl, std::slice::from_ref(&values))?;
            s.emit1(&format!("{nm}.{what}_scalar"), Op::Reshape { shape: vec![] }, &[v])
        };
        let (off, on) = (pick(self, 0, "off")?, pick(self, 1, "on")?);
        Ok(vec![Some(self.emit1(nm, Op::Where, &[hot, on, off])?)])
    }

    /// Einsum of one or two operands without repeated labels in a term (no diagonals): labels
    /// only one operand has and the output lacks are summed first; then the operands are
    /// transposed and reshaped to `[batch, m, k]` and `[batch, k, n]` for one MatMul, whose
    /// result is reshaped and transposed to the output's labels.
    fn einsum(&mut self, n: &N) -> Result<Vec<Option<V>>, String> {
        let nm = n.name.clone();
        let eq = n.string("equation").ok_or("equation is required")?;
        let ops = (0..n.node.input.len()).map(|i| self.need(n, i)).collect::<Result<Vec<_>, _>>()?;
        let ranks: Vec<usize> = ops.iter().map(|v| self.meta(v).rank()).collect();
        let (terms, out) = parse_einsum(&eq, &ranks)?;
        let mut size = std::collections::HashMap::new();
        for (t, v) in terms.iter().zip(&ops) {
            let s = self.meta(v).shape;
            for (l, &d) in t.iter().zip(&s) {
                if *size.entry(*l).or_insert(d) != d {
                    return Err(format!(
                        "{eq}: label {l} has sizes {} and {d} (broadcasting labels is not supported)",
                        size[l]
                    ));
                }
            }
        }
        let dims = |ls: &[char]| ls.iter().map(|l| size[l]).collect::<Vec<usize>>();
        // Sums the labels of operand `i` that neither the output nor the other operand has.
        let mut reduced = vec![];
        for (i, (t, v)) in terms.iter().zip(&ops).enumerate() {
            let other: Vec<char> =
                terms.iter().enumerate().filter(|(j, _)| *j != i).flat_map(|(_, t)| t.clone()).collect();
            let axes: Vec<usize> = (0..t.len()).filter(|&d| !out.contains(&t[d]) && !other.contains(&t[d])).collect();
            if axes.is_empty() {
                reduced.push((t.clone(), v.clone()));
            } else {
                let keep: Vec<char> =
                    t.iter().enumerate().filter(|(d, _)| !axes.contains(d)).map(|(_, &l)| l).collect();
                let op = Op::Reduce { op: ReduceOp::Sum, axes, keepdims: false };
                reduced.push((keep, self.emit1(&format!("{nm}.sum{i}"), op, std::slice::from_ref(v))?));
            }
        }
        let (labels, y) = if reduced.len() == 1 {
            reduced.remove(0)
        } else {
            let (ta, a) = reduced.remove(0);
            let (tb, b) = reduced.remove(0);
            let batch: Vec<char> = ta.iter().copied().filter(|l| tb.contains(l) && out.contains(l)).collect();
            let ms: Vec<char> = ta.iter().copied().filter(|l| !tb.contains(l)).collect();
            let ks: Vec<char> = ta.iter().copied().filter(|l| tb.contains(l) && !out.contains(l)).collect();
            let ns: Vec<char> = tb.iter().copied().filter(|l| !ta.contains(l)).collect();
            let prod = |ls: &[char]| dims(ls).iter().product::<usize>();
            let (nb, nm_, nk, nn) = (prod(&batch), prod(&ms), prod(&ks), prod(&ns));
            let a = self.arrange(&format!("{nm}.a"), a, &ta, &[&batch[..], &ms, &ks].concat(), vec![nb, nm_, nk])?;
            let b = self.arrange(&format!("{nm}.b"), b, &tb, &[&batch[..], &ks, &ns].concat(), vec![nb, nk, nn])?;
            let p = self.emit1(&format!("{nm}.matmul"), Op::MatMul, &[a, b])?;
            let labels = [&batch[..], &ms, &ns].concat();
            let p = self.emit1(&format!("{nm}.unflat"), Op::Reshape { shape: dims(&labels) }, &[p])?;
            (labels, p)
        };
        let perm: Vec<usize> = out
            .iter()
            .map(|l| labels.iter().position(|m| m == l))
            .collect::<Option<_>>()
            .ok_or_else(|| format!("{eq}: an output label is missing from the inputs"))?;
        if perm.iter().enumerate().all(|(i, &p)| i == p) {
            // Reshape to fix a rank-0 result's or a reduce's shape only when they differ.
            let want = dims(&out);
            if self.meta(&y).shape == want {
                return Ok(vec![Some(y)]);
            }
            return Ok(vec![Some(self.emit1(&nm, Op::Reshape { shape: want }, &[y])?)]);
        }
        Ok(vec![Some(self.emit1(&nm, Op::Transpose { perm }, &[y])?)])
    }

    /// Transposes `v` (labels `from`) to the label order `to` and reshapes it to `shape`.
    fn arrange(&mut self, name: &str, v: V, from: &[char], to: &[char], shape: Vec<usize>) -> Result<V, String> {
        let perm: Vec<usize> = to.iter().map(|l| from.iter().position(|m| m == l).unwrap_or(0)).collect();
        let v = if perm.iter().enumerate().all(|(i, &p)| i == p) {
            v
        } else {
            self.emit1(&format!("{name}.transpose"), Op::Transpose { perm }, &[v])?
        };
        if self.meta(&v).shape == shape {
            return Ok(v);
        }
        self.emit1(&format!("{name}.reshape"), Op::Reshape { shape }, &[v])
    }
}

/// Parses an einsum equation for operands of the given ranks into the label list of each operand
/// and of the output, `...` expanded to labels of its own (the ellipsis dims must agree in
/// count and size across operands that have them, right-aligned as numpy broadcasts).
fn parse_einsum(eq: &str, ranks: &[usize]) -> Result<(Vec<Vec<char>>, Vec<char>), String> {
    let eq: String = eq.chars().filter(|c| !c.is_whitespace()).collect();
    let (lhs, rhs) = match eq.split_once("->") {
        Some((l, r)) => (l.to_string(), Some(r.to_string())),
        None => (eq.clone(), None),
    };
    let terms: Vec<&str> = lhs.split(',').collect();
    if terms.len() != ranks.len() {
        return Err(format!("{eq}: {} terms for {} inputs", terms.len(), ranks.len()));
    }
    if !(1..=2).contains(&terms.len()) {
        return Err(format!("{eq}: only einsums of one or two operands are supported"));
    }
    if ranks.iter().any(|&r| r > 10) {
        return Err(format!("{eq}: operands of rank above 10 are not supported"));
    }
    // Ellipsis dims get the labels '0', '1', ... (not letters, so they cannot clash), right-aligned
    // over the longest ellipsis as numpy broadcasts them.
    let named = |t: &str| t.replace("...", "").chars().count();
    let mut ell = 0usize;
    for (t, &r) in terms.iter().zip(ranks) {
        if t.contains("...") {
            ell = ell
                .max(r.checked_sub(named(t)).ok_or_else(|| format!("{eq}: term {t} has more labels than its rank"))?);
        }
    }
    let expand = |t: &str, rank: Option<usize>| -> Result<Vec<char>, String> {
        if let Some((a, b)) = t.split_once("...") {
            let k = rank.map_or(ell, |r| r - named(t));
            let dots = (ell - k..ell).map(|i| char::from(b'0' + i as u8));
            Ok(a.chars().chain(dots).chain(b.chars()).collect())
        } else {
            if rank.is_some_and(|r| r != named(t)) {
                return Err(format!("{eq}: term {t} has {} labels for rank {}", named(t), rank.unwrap_or(0)));
            }
            Ok(t.chars().collect())
        }
    };
    let mut parsed = vec![];
    for (t, &r) in terms.iter().zip(ranks) {
        let ls = expand(t, Some(r))?;
        if ls.iter().any(|c| !(c.is_ascii_alphabetic() || c.is_ascii_digit())) {
            return Err(format!("{eq}: bad label in {t}"));
        }
        let mut seen = std::collections::HashSet::new();
        if !ls.iter().all(|c| seen.insert(*c)) {
            return Err(format!("{eq}: a label repeats within {t} (diagonals and traces are not supported)"));
        }
        parsed.push(ls);
    }
    let out = match rhs {
        Some(r) => expand(&r, None)?,
        None => {
            // Implicit output: the ellipsis dims, then the labels used once, alphabetically.
            let all: Vec<char> = parsed.iter().flatten().copied().collect();
            let mut once: Vec<char> = all
                .iter()
                .copied()
                .filter(|c| c.is_ascii_alphabetic() && all.iter().filter(|d| *d == c).count() == 1)
                .collect();
            once.sort();
            let mut dots: Vec<char> = (0..ell).map(|i| char::from(b'0' + i as u8)).collect();
            dots.extend(once);
            dots
        }
    };
    Ok((parsed, out))
}
