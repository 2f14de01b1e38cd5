//! Import of the elementwise ops: unary math, binary arithmetic and comparisons with numpy
//! broadcasting, variadic `Sum`/`Max`/`Min`/`Mean`, `Clip`, `Where`, `Cast`/`CastLike`, `Identity`,
//! `Dropout` (inference form, and training form onto [`Op::Dropout`]), `Gelu`.

use super::*;

impl Importer<'_> {
    /// The elementwise family's arms of [`Importer::translate`].
    pub(super) fn translate_elementwise(&mut self, n: &N, op_type: &str) -> Result<Vec<Option<V>>, String> {
        let nm = n.name.clone();
        let one = |v: V| Ok(vec![Some(v)]);
        let unary = |u: UnaryOp| Op::Unary(u);
        match op_type {
            "Identity" => one(self.need(n, 0)?),
            "Dropout" => self.dropout(n),
            "Relu" | "Tanh" | "Erf" | "Sigmoid" | "Exp" | "Log" | "Sqrt" | "Neg" | "Reciprocal" | "Abs" | "Not"
            | "Floor" | "Ceil" | "Sin" | "Cos" | "Sign" => {
                let u = match op_type {
                    "Relu" => UnaryOp::Relu,
                    "Tanh" => UnaryOp::Tanh,
                    "Erf" => UnaryOp::Erf,
                    "Sigmoid" => UnaryOp::Sigmoid,
                    "Exp" => UnaryOp::Exp,
                    "Log" => UnaryOp::Log,
                    "Sqrt" => UnaryOp::Sqrt,
                    "Neg" => UnaryOp::Neg,
                    "Reciprocal" => UnaryOp::Reciprocal,
                    "Abs" => UnaryOp::Abs,
                    "Not" => UnaryOp::Not,
                    "Floor" => UnaryOp::Floor,
                    "Ceil" => UnaryOp::Ceil,
                    "Sin" => UnaryOp::Sin,
                    "Cos" => UnaryOp::Cos,
                    _ => UnaryOp::Sign,
                };
                let x = self.need(n, 0)?;
                one(self.emit1(&nm, unary(u), &[x])?)
            }
            "Gelu" => {
                let u = match n.string("approximate").as_deref().unwrap_or("none") {
                    "none" => UnaryOp::Gelu,
                    "tanh" => UnaryOp::GeluTanh,
                    a => return Err(format!("approximate={a} is not supported")),
                };
                {
                    let x = self.need(n, 0)?;
                    one(self.emit1(&nm, unary(u), &[x])?)
                }
            }
            "Add" | "Sub" | "Mul" | "Div" | "Equal" | "Less" | "LessOrEqual" | "Greater" | "GreaterOrEqual" | "And"
            | "Or" | "Xor" => {
                let b = match op_type {
                    "Add" => BinaryOp::Add,
                    "Sub" => BinaryOp::Sub,
                    "Mul" => BinaryOp::Mul,
                    "Div" => BinaryOp::Div,
                    "Equal" => BinaryOp::Equal,
                    "Less" => BinaryOp::Less,
                    "LessOrEqual" => BinaryOp::LessOrEqual,
                    "Greater" => BinaryOp::Greater,
                    "GreaterOrEqual" => BinaryOp::GreaterOrEqual,
                    "And" => BinaryOp::And,
                    "Or" => BinaryOp::Or,
                    _ => BinaryOp::Xor,
                };
                if self.opset < 7 && n.int("broadcast", 0) != 0 && n.attr("axis").is_some() {
                    return Err("legacy broadcast with an axis (opset < 7) is not supported".into());
                }
                let (a, c) = (self.need(n, 0)?, self.need(n, 1)?);
                one(self.emit1(&nm, Op::Binary(b), &[a, c])?)
            }
            "Pow" => {
                let (a, mut e) = (self.need(n, 0)?, self.need(n, 1)?);
                let (da, de) = (self.meta(&a).dtype, self.meta(&e).dtype);
                if da != de {
                    e = self.emit1(&format!("{nm}.cast_exponent"), Op::Cast { to: da }, &[e])?;
                }
                one(self.emit1(&nm, Op::Binary(BinaryOp::Pow), &[a, e])?)
            }
            "Sum" | "Max" | "Min" | "Mean" => {
                let b = match op_type {
                    "Max" => BinaryOp::Max,
                    "Min" => BinaryOp::Min,
                    _ => BinaryOp::Add,
                };
                let k = n.node.input.iter().filter(|s| !s.is_empty()).count();
                if k == 0 {
                    return Err("needs at least one input".into());
                }
                let mut acc = self.need(n, 0)?;
                for i in 1..n.node.input.len() {
                    if let Some(x) = self.opt(n, i)? {
                        acc = self.emit1(&format!("{nm}.{i}"), Op::Binary(b), &[acc, x])?;
                    }
                }
                if op_type == "Mean" && k > 1 {
                    let d = V::C(Rc::new(Tensor::scalar_f32(k as f32)));
                    acc = self.emit1(&format!("{nm}.mean"), Op::Binary(BinaryOp::Div), &[acc, d])?;
                }
                one(acc)
            }
            "Clip" => {
                let x = self.need(n, 0)?;
                let dt = self.meta(&x).dtype;
                let (lo, hi) = if self.opset < 11 {
                    let scalar = |v: f32| V::C(Rc::new(Tensor::scalar_f32(v)));
                    (n.attr("min").map(|a| scalar(a.f)), n.attr("max").map(|a| scalar(a.f)))
                } else {
                    (self.opt(n, 1)?, self.opt(n, 2)?)
                };
                let mut acc = x;
                for (b, v, sfx) in [(BinaryOp::Max, lo, "min"), (BinaryOp::Min, hi, "max")] {
                    if let Some(mut v) = v {
                        let m = self.meta(&v);
                        if m.numel() != 1 {
                            return Err(format!("{sfx} must be a scalar"));
                        }
                        if m.rank() != 0 {
                            v = self.emit1(&format!("{nm}.{sfx}_scalar"), Op::Reshape { shape: vec![] }, &[v])?;
                        }
                        if m.dtype != dt {
                            v = self.emit1(&format!("{nm}.{sfx}_cast"), Op::Cast { to: dt }, &[v])?;
                        }
                        acc = self.emit1(&format!("{nm}.{sfx}"), Op::Binary(b), &[acc, v])?;
                    }
                }
                one(acc)
            }
            "Where" => {
                let (c, a, b) = (self.need(n, 0)?, self.need(n, 1)?, self.need(n, 2)?);
                one(self.emit1(&nm, Op::Where, &[c, a, b])?)
            }
            "Cast" | "CastLike" => {
                let x = self.need(n, 0)?;
                let code = if op_type == "Cast" { n.int("to", 1) as i32 } else { 0 };
                let to = if op_type == "Cast" {
                    elem_dtype(code, &format!("Cast target of {nm}")).map_err(|e| e.to_string())?
                } else {
                    let t = self.need(n, 1)?;
                    self.meta(&t).dtype
                };
                if op_type == "Cast" {
                    return one(self.cast(&nm, x, code, to)?);
                }
                if self.meta(&x).dtype == to {
                    return one(x);
                }
                one(self.emit1(&nm, Op::Cast { to }, &[x])?)
            }
            other => Err(format!("{other} is not a elementwise op (importer bug)")),
        }
    }
}

impl Importer<'_> {
    /// `Dropout`: identity in inference (opsets before 12 have no training form; from 12,
    /// `training_mode` absent or false) and at ratio 0, with an all-true mask; otherwise
    /// [`Op::Dropout`] with the next id (its key in the generator, distinct per node). The
    /// node's `seed` attribute is not used: masks come from the run's seed (`--seed`), so that a
    /// run is reproducible on any mesh. Ratio and training mode must be known at import.
    fn dropout(&mut self, n: &N) -> Result<Vec<Option<V>>, String> {
        let nm = n.name.clone();
        let want_mask = n.node.output.get(1).is_some_and(|o| self.used.contains(o));
        let training = self.opset >= 12
            && self.const_ints(n, 2, "training_mode")?.is_some_and(|t| t.first().copied().unwrap_or(0) != 0);
        let ratio = match self.opt(n, 1)? {
            Some(V::C(t)) => t.to_f32_vec().first().copied().unwrap_or(0.5),
            Some(V::G(_)) if training => {
                return Err("ratio (input 1) must be a constant after folding shape computations, but it depends \
                            on graph inputs"
                    .into());
            }
            _ => 0.5,
        };
        let x = self.need(n, 0)?;
        if training && ratio != 0.0 {
            let a = ir::DropoutAttrs { ratio, id: self.dropouts, mask: want_mask };
            a.check("Dropout")?;
            if !self.meta(&x).dtype.is_float() {
                return Err(format!(
                    "training-mode Dropout of a {} tensor: only floats are dropped",
                    self.meta(&x).dtype
                ));
            }
            self.dropouts = self.dropouts.checked_add(1).ok_or("more than 2^32 training-mode Dropout nodes")?;
            // Never folded, even of a constant: its value depends on the step.
            let xv = self.materialize(&format!("{nm}.in0"), &x);
            let outs = self.g.add_op(&nm, Op::Dropout(a), &[xv]).map_err(|e| e.to_string())?;
            return Ok(outs.into_iter().map(|v| Some(V::G(v))).collect());
        }
        // The all-true mask has the input's size, which may be an activation far larger than
        // any constant: built only when something reads it.
        if !want_mask {
            return Ok(vec![Some(x)]);
        }
        let m = TensorMeta::new(DType::Bool, self.meta(&x).shape);
        self.constant_fits(&m)?;
        let mask = V::C(Rc::new(Tensor::bool(m.shape.clone(), vec![true; m.numel()])));
        Ok(vec![Some(x), Some(mask)])
    }
}
