//! Import of the data-movement and shape ops: `Constant`, `ConstantOfShape`, `Shape`, `Size`,
//! `Range`, `Reshape`, `Flatten`, `Squeeze`/`Unsqueeze`, `Transpose`, `Expand`, `Concat`, `Split`,
//! `Slice`, `Gather`, `Pad` (its non-constant modes in `pad.rs`).

use super::*;

impl Importer<'_> {
    /// The shape family's arms of [`Importer::translate`]: dispatches to one method per kind of
    /// op (constants, shape queries, reshapes, layout changes, concat/split, slice/gather, pad).
    pub(super) fn translate_shape(&mut self, n: &N, op_type: &str) -> Result<Vec<Option<V>>, String> {
        match op_type {
            "Constant" => self.constant(n),
            "ConstantOfShape" => self.constant_of_shape(n),
            "Range" => self.range(n),
            "Shape" | "Size" => self.shape_query(n, op_type),
            "Reshape" | "Flatten" | "Squeeze" | "Unsqueeze" => self.reshape_like(n, op_type),
            "Transpose" | "Expand" => self.layout(n, op_type),
            "Concat" | "Split" => self.concat_split(n, op_type),
            "Slice" | "Gather" => self.slice_gather(n, op_type),
            "Pad" => self.pad(n),
            other => Err(not_shape_op(other)),
        }
    }

    /// `Constant`: the tensor of its `value` (or `value_float(s)`, `value_int(s)`) attribute.
    fn constant(&mut self, n: &N) -> Result<Vec<Option<V>>, String> {
        let one = |v: V| Ok(vec![Some(v)]);
        let t = if let Some(a) = n.attr("value") {
            let t = a.t.as_ref().ok_or("value attribute has no tensor")?;
            tensor_from_proto(t, self.base_dir).map_err(|e| e.to_string())?.ok_or("value tensor has no data")?
        } else if let Some(a) = n.attr("value_float") {
            Tensor::scalar_f32(a.f)
        } else if let Some(a) = n.attr("value_floats") {
            Tensor::f32(vec![a.floats.len()], a.floats.clone())
        } else if let Some(a) = n.attr("value_int") {
            Tensor::i64(Vec::<usize>::new(), vec![a.i])
        } else if let Some(a) = n.attr("value_ints") {
            Tensor::i64(vec![a.ints.len()], a.ints.clone())
        } else {
            return Err("only value, value_float(s) and value_int(s) constants are supported".into());
        };
        one(V::C(Rc::new(t)))
    }

    /// `ConstantOfShape`: a fill of the constant shape input (or a weight-free parameter when it
    /// stands in for a weight).
    fn constant_of_shape(&mut self, n: &N) -> Result<Vec<Option<V>>, String> {
        let one = |v: V| Ok(vec![Some(v)]);
        let shape: Vec<usize> = self
            .const_ints(n, 0, "shape")?
            .ok_or("shape input is missing")?
            .into_iter()
            .map(|d| usize::try_from(d).map_err(|_| format!("negative dim {d}")))
            .collect::<Result<_, _>>()?;
        let value = match n.attr("value").and_then(|a| a.t.as_ref()) {
            Some(t) => tensor_from_proto(t, None).map_err(|e| e.to_string())?.ok_or("value tensor has no data")?,
            None => Tensor::scalar_f32(0.0),
        };
        let out = n.node.output.first().cloned().unwrap_or_default();
        let meta = TensorMeta::new(value.dtype(), shape.clone());
        if value.dtype() == DType::F32 && self.weight_slots.contains(&out) {
            // Topology-only models stand weights in with a fill: keep them as weight-free
            // parameters so planning counts them, without materialising them (so no
            // ceiling, only a size that does not overflow).
            if meta.checked_bytes().is_none() {
                return Err(ir::shape::too_large(&meta.shape, meta.dtype));
            }
            let p = self.g.param(&out, meta, None);
            return one(V::G(p));
        }
        self.constant_fits(&meta)?;
        let count = meta.numel();
        let t = match value.data() {
            ir::Data::F32(v) => Tensor::f32(shape, fill_as(count, &meta, *v.first().ok_or("empty value")?)?),
            ir::Data::F64(v) => Tensor::f64(shape, fill_as(count, &meta, *v.first().ok_or("empty value")?)?),
            ir::Data::BF16(_) | ir::Data::F16(_) => {
                let x = *value.to_f32_vec().first().ok_or("empty value")?;
                Tensor::f32(shape, fill_as(count, &meta, x)?).with_float_type(value.dtype())
            }
            ir::Data::I64(v) => Tensor::i64(shape, fill_as(count, &meta, *v.first().ok_or("empty value")?)?),
            ir::Data::Bool(v) => Tensor::bool(shape, fill_as(count, &meta, *v.first().ok_or("empty value")?)?),
        };
        one(V::C(Rc::new(t)))
    }

    /// `Range`: a constant sequence from constant scalar inputs, its length bounded first.
    fn range(&mut self, n: &N) -> Result<Vec<Option<V>>, String> {
        let one = |v: V| Ok(vec![Some(v)]);
        let get = |s: &mut Self, i: usize| -> Result<Rc<Tensor>, String> {
            match s.need(n, i)? {
                V::C(t) => Ok(t),
                V::G(_) => Err("Range inputs must be constants after folding".into()),
            }
        };
        let (a, b, d) = (get(self, 0)?, get(self, 1)?, get(self, 2)?);
        for (t, what) in [(&a, "start"), (&b, "limit"), (&d, "delta")] {
            if t.numel() != 1 {
                return Err(format!("{what} must be a scalar, got {}", t.meta()));
            }
        }
        // The count is bounded before anything is allocated.
        let t = match a.dtype() {
            DType::F32 => {
                let (a, b, d) = (a.to_f32_vec()[0], b.to_f32_vec()[0], d.to_f32_vec()[0]);
                if d == 0.0 {
                    return Err("delta is 0".into());
                }
                // In f32 as ONNX defines it; infinite or NaN spans are errors, not saturated.
                let span = (b - a) / d;
                if !span.is_finite() {
                    return Err(format!("range({a}, {b}, {d}) has no finite length"));
                }
                let cnt = span.ceil().max(0.0) as usize;
                self.constant_fits(&TensorMeta::new(DType::F32, [cnt]))?;
                Tensor::f32(vec![cnt], (0..cnt).map(|i| a + i as f32 * d).collect())
            }
            _ => {
                let (a, b, d) = (a.to_i64_vec()[0], b.to_i64_vec()[0], d.to_i64_vec()[0]);
                if d == 0 {
                    return Err("delta is 0".into());
                }
                // ceil((b - a) / d) in i128: the difference of two i64s does not wrap.
                let (span, d128) = (b as i128 - a as i128, d as i128);
                let (q, r) = (span / d128, span % d128);
                let cnt = (q + i128::from(r != 0 && (r > 0) == (d128 > 0))).max(0);
                let cnt = usize::try_from(cnt).map_err(|_| format!("range({a}, {b}, {d}) is too long"))?;
                self.constant_fits(&TensorMeta::new(DType::I64, [cnt]))?;
                // Every element lies between a and b, so it fits in an i64.
                Tensor::i64(vec![cnt], (0..cnt).map(|i| (a as i128 + i as i128 * d128) as i64).collect())
            }
        };
        one(V::C(Rc::new(t)))
    }

    /// Shape queries, answered at import: `Shape` and `Size`.
    fn shape_query(&mut self, n: &N, op_type: &str) -> Result<Vec<Option<V>>, String> {
        let one = |v: V| Ok(vec![Some(v)]);
        match op_type {
            "Shape" => {
                let x = self.need(n, 0)?;
                let s = self.meta(&x).shape;
                let r = s.len() as i64;
                let clamp = |v: i64| (if v < 0 { v + r } else { v }).clamp(0, r) as usize;
                let start = clamp(n.int("start", 0));
                let end = clamp(n.int("end", r));
                let dims: Vec<i64> = s[start..end.max(start)].iter().map(|&d| d as i64).collect();
                one(V::C(Rc::new(Tensor::i64(vec![dims.len()], dims))))
            }
            "Size" => {
                let x = self.need(n, 0)?;
                one(V::C(Rc::new(Tensor::i64(Vec::<usize>::new(), vec![self.meta(&x).numel() as i64]))))
            }
            other => Err(not_shape_op(other)),
        }
    }

    /// The reshapes: `Reshape`, `Flatten`, `Squeeze` and `Unsqueeze`.
    fn reshape_like(&mut self, n: &N, op_type: &str) -> Result<Vec<Option<V>>, String> {
        let nm = n.name.clone();
        let one = |v: V| Ok(vec![Some(v)]);
        match op_type {
            "Reshape" => {
                let x = self.need(n, 0)?;
                let m = self.meta(&x);
                let spec = self.const_ints(n, 1, "shape")?.ok_or("shape input is missing")?;
                let allowzero = n.int("allowzero", 0) != 0;
                let mut shape = Vec::with_capacity(spec.len());
                let mut infer = None;
                for (i, &d) in spec.iter().enumerate() {
                    match d {
                        -1 if infer.is_none() => {
                            infer = Some(i);
                            shape.push(1);
                        }
                        0 if !allowzero => shape.push(
                            *m.shape
                                .get(i)
                                .ok_or(format!("shape {spec:?} copies dim {i}, but the input has rank {}", m.rank()))?,
                        ),
                        d if d >= 0 => shape.push(d as usize),
                        _ => return Err(format!("bad target shape {spec:?}")),
                    }
                }
                if let Some(i) = infer {
                    let known = ir::shape::checked_numel(&shape)
                        .ok_or_else(|| format!("target shape {spec:?}: the product of its dims overflows"))?;
                    if known == 0 || !m.numel().is_multiple_of(known) {
                        return Err(format!("cannot reshape {:?} to {spec:?}", m.shape));
                    }
                    shape[i] = m.numel() / known;
                }
                one(self.emit1(&nm, Op::Reshape { shape }, &[x])?)
            }
            "Flatten" => {
                let x = self.need(n, 0)?;
                let m = self.meta(&x);
                // Flatten's axis ranges over [-r, r]: a negative axis counts from the rank.
                let (r, raw) = (m.rank() as i64, n.int("axis", 1));
                let axis = if raw < 0 { raw + r } else { raw };
                if !(0..=r).contains(&axis) {
                    return Err(format!("axis {raw} is out of range for rank {r}"));
                }
                let axis = axis as usize;
                let shape = vec![m.shape[..axis].iter().product(), m.shape[axis..].iter().product()];
                one(self.emit1(&nm, Op::Reshape { shape }, &[x])?)
            }
            "Squeeze" | "Unsqueeze" => {
                let x = self.need(n, 0)?;
                let m = self.meta(&x);
                let axes = if self.opset >= 13 { self.const_ints(n, 1, "axes")? } else { n.ints("axes") };
                let shape = if op_type == "Squeeze" {
                    match axes {
                        None => m.shape.iter().copied().filter(|&d| d != 1).collect(),
                        Some(a) => {
                            let a = a.iter().map(|&x| norm_axis(x, m.rank())).collect::<Result<Vec<_>, _>>()?;
                            if let Some(&bad) = a.iter().find(|&&i| m.shape.get(i) != Some(&1)) {
                                return Err(format!("cannot squeeze dim {bad} of {:?}: not of size 1", m.shape));
                            }
                            m.shape.iter().enumerate().filter(|(i, _)| !a.contains(i)).map(|(_, &d)| d).collect()
                        }
                    }
                } else {
                    let a = axes.ok_or("axes are required")?;
                    let r = m.rank() + a.len();
                    let mut a = a.iter().map(|&x| norm_axis(x, r)).collect::<Result<Vec<_>, _>>()?;
                    a.sort();
                    if a.windows(2).any(|w| w[0] == w[1]) {
                        return Err(format!("axes {a:?} name an axis twice"));
                    }
                    let mut src = m.shape.iter();
                    (0..r).map(|i| if a.contains(&i) { 1 } else { *src.next().unwrap_or(&1) }).collect()
                };
                one(self.emit1(&nm, Op::Reshape { shape }, &[x])?)
            }
            other => Err(not_shape_op(other)),
        }
    }

    /// Layout changes: `Transpose` and `Expand`.
    fn layout(&mut self, n: &N, op_type: &str) -> Result<Vec<Option<V>>, String> {
        let nm = n.name.clone();
        let one = |v: V| Ok(vec![Some(v)]);
        match op_type {
            "Transpose" => {
                let x = self.need(n, 0)?;
                let r = self.meta(&x).rank();
                let perm = match n.ints("perm") {
                    Some(p) => p.iter().map(|&a| norm_axis(a, r)).collect::<Result<Vec<_>, _>>()?,
                    None => (0..r).rev().collect(),
                };
                one(self.emit1(&nm, Op::Transpose { perm }, &[x])?)
            }
            "Expand" => {
                let x = self.need(n, 0)?;
                let spec = self.const_ints(n, 1, "shape")?.ok_or("shape input is missing")?;
                let spec = spec
                    .iter()
                    .map(|&d| usize::try_from(d).map_err(|_| format!("bad shape {spec:?}")))
                    .collect::<Result<Vec<_>, _>>()?;
                let shape = ir::broadcast_shapes(&self.meta(&x).shape, &spec)?;
                one(self.emit1(&nm, Op::Expand { shape }, &[x])?)
            }
            other => Err(not_shape_op(other)),
        }
    }

    /// `Concat` and `Split`.
    fn concat_split(&mut self, n: &N, op_type: &str) -> Result<Vec<Option<V>>, String> {
        let nm = n.name.clone();
        let one = |v: V| Ok(vec![Some(v)]);
        match op_type {
            "Concat" => {
                let ins = (0..n.node.input.len())
                    .filter_map(|i| self.opt(n, i).transpose())
                    .collect::<Result<Vec<_>, _>>()?;
                let r = ins.first().map(|v| self.meta(v).rank()).ok_or("needs at least one input")?;
                let axis = norm_axis(n.attr("axis").ok_or("axis is required")?.i, r)?;
                one(self.emit1(&nm, Op::Concat { axis }, &ins)?)
            }
            "Split" => {
                let x = self.need(n, 0)?;
                let m = self.meta(&x);
                let axis = norm_axis(n.int("axis", 0), m.rank())?;
                let d = *m.shape.get(axis).ok_or("cannot split a scalar")?;
                let given = if self.opset >= 13 { self.const_ints(n, 1, "split")? } else { n.ints("split") };
                let outs = n.node.output.len();
                let sizes: Vec<usize> = match given {
                    Some(s) => {
                        if s.len() != outs {
                            return Err(format!("split {s:?} has {} sizes for {outs} outputs", s.len()));
                        }
                        s.iter()
                            .map(|&x| usize::try_from(x).map_err(|_| format!("bad split {s:?}")))
                            .collect::<Result<_, _>>()?
                    }
                    None => {
                        if let Some(a) = n.attr("num_outputs")
                            && a.i != outs as i64
                        {
                            return Err(format!("num_outputs={} but the node has {outs} outputs", a.i));
                        }
                        let k = outs;
                        if k == 0 {
                            return Err("splits into zero outputs".into());
                        }
                        // Equal chunks, the last one smaller; every chunk non-empty (ONNX), so
                        // more outputs than elements is an error, not empty outputs.
                        let chunk = d.div_ceil(k);
                        if k > d || (k - 1) * chunk >= d {
                            return Err(format!(
                                "cannot split dim {axis} of size {d} into {k} non-empty chunks (more outputs than \
                                 elements, or chunks of {chunk} leave the last ones empty)"
                            ));
                        }
                        (0..k).map(|i| chunk.min(d - i * chunk)).collect()
                    }
                };
                Ok(self.emit(&nm, Op::Split { axis, sizes }, &[x])?.into_iter().map(Some).collect())
            }
            other => Err(not_shape_op(other)),
        }
    }

    /// Selections: `Slice` and `Gather`.
    fn slice_gather(&mut self, n: &N, op_type: &str) -> Result<Vec<Option<V>>, String> {
        let nm = n.name.clone();
        let one = |v: V| Ok(vec![Some(v)]);
        match op_type {
            "Slice" => {
                let x = self.need(n, 0)?;
                let m = self.meta(&x);
                let (starts, ends, axes, steps) = if self.opset >= 10 {
                    (
                        self.const_ints(n, 1, "starts")?.ok_or("starts are required")?,
                        self.const_ints(n, 2, "ends")?.ok_or("ends are required")?,
                        self.const_ints(n, 3, "axes")?,
                        self.const_ints(n, 4, "steps")?,
                    )
                } else {
                    (
                        n.ints("starts").ok_or("starts are required")?,
                        n.ints("ends").ok_or("ends are required")?,
                        n.ints("axes"),
                        None,
                    )
                };
                let axes = axes.unwrap_or_else(|| (0..starts.len() as i64).collect());
                let steps = steps.unwrap_or_else(|| vec![1; starts.len()]);
                if ends.len() != starts.len() || axes.len() != starts.len() || steps.len() != starts.len() {
                    return Err("starts, ends, axes and steps differ in length".into());
                }
                let mut out = Vec::new();
                for i in 0..starts.len() {
                    let axis = norm_axis(axes[i], m.rank())?;
                    let d = m.shape[axis] as i128;
                    let step = steps[i] as i128;
                    if step == 0 {
                        return Err("step 0".into());
                    }
                    let fix = |v: i64| if v < 0 { v as i128 + d } else { v as i128 };
                    let (s, e) = (fix(starts[i]), fix(ends[i]));
                    let (s, len) = if step > 0 {
                        let (s, e) = (s.clamp(0, d), e.clamp(0, d));
                        (s, if e > s { (e - s + step - 1) / step } else { 0 })
                    } else {
                        let (s, e) = (s.clamp(0, d - 1), e.clamp(-1, d - 1));
                        (s, if s > e { (s - e + (-step) - 1) / (-step) } else { 0 })
                    };
                    out.push(SliceAxis {
                        axis,
                        start: if len > 0 { s as i64 } else { 0 },
                        len: len as usize,
                        step: step as i64,
                    });
                }
                one(self.emit1(&nm, Op::Slice { axes: out }, &[x])?)
            }
            "Gather" => {
                let (x, idx) = (self.need(n, 0)?, self.need(n, 1)?);
                let axis = norm_axis(n.int("axis", 0), self.meta(&x).rank())?;
                // Constant indices are checked now, naming the node, rather than at run time.
                if let V::C(t) = &idx
                    && let Some(v) = t.as_i64()
                {
                    let d = self.meta(&x).shape[axis] as i64;
                    if let Some(bad) = v.iter().find(|&&i| i < -d || i >= d) {
                        return Err(format!("index {bad} is out of range for axis {axis} of size {d}"));
                    }
                }
                one(self.emit1(&nm, Op::Gather { axis }, &[x, idx])?)
            }
            other => Err(not_shape_op(other)),
        }
    }

    /// `Pad`: normalises the pads to every axis, then [`Importer::pad_modes`].
    fn pad(&mut self, n: &N) -> Result<Vec<Option<V>>, String> {
        let nm = n.name.clone();
        let one = |v: V| Ok(vec![Some(v)]);
        let x = self.need(n, 0)?;
        let m = self.meta(&x);
        let mode = n.string("mode").unwrap_or_else(|| "constant".into());
        let (raw, value, axes) = if self.opset >= 11 {
            let p = self.const_ints(n, 1, "pads")?.ok_or("pads are required")?;
            let v = match self.opt(n, 2)? {
                None => 0.0,
                Some(V::C(t)) => t.to_f32_vec().first().copied().unwrap_or(0.0),
                Some(V::G(_)) => return Err("constant_value must be a constant".into()),
            };
            (p, v, self.const_ints(n, 3, "axes")?)
        } else {
            (n.ints("pads").ok_or("pads are required")?, n.float("value", 0.0), None)
        };
        let r = m.rank();
        let axes = match axes {
            Some(a) => a.iter().map(|&a| norm_axis(a, r)).collect::<Result<Vec<_>, _>>()?,
            None => (0..r).collect(),
        };
        if raw.len() != 2 * axes.len() {
            return Err(format!("{} pads for {} axes", raw.len(), axes.len()));
        }
        let mut pads = vec![0; 2 * r];
        for (i, &a) in axes.iter().enumerate() {
            pads[a] = raw[i];
            pads[a + r] = raw[i + axes.len()];
        }
        one(self.pad_modes(&nm, x, &mode, &pads, value)?)
    }
}

/// The error for an op type outside the shape family (an importer bug).
fn not_shape_op(op_type: &str) -> String {
    format!("{op_type} is not a shape op (importer bug)")
}

/// `count` copies of `x`, allocated fallibly (a ConstantOfShape's fill; `meta` names it).
fn fill_as<T: Clone>(count: usize, meta: &TensorMeta, x: T) -> Result<Vec<T>, String> {
    ir::alloc::try_filled(count, x).map_err(|e| format!("the constant {meta}: {e}"))
}
