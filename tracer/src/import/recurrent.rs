//! The recurrent ops `RNN`, `GRU` and `LSTM`, unrolled over time into existing IR ops at import.
//!
//! Gradients, kernels on every backend, f64 and the sharding strategies (batch and hidden splits)
//! are then those of the ops the unrolling uses: `Gemm`, `Split`, `Concat`, `Reshape`, the
//! activations, elementwise arithmetic and, for per-batch `sequence_lens`, `Where`.
//!
//! The unrolled graph, per direction:
//! - the weights are split once into their per-direction (and, for GRU, per gate group) blocks;
//!   `W` and `R` are read with `Gemm(trans_b)`, so no transposed copy is made;
//! - the input projection of every time step is one `Gemm` over the flattened sequence, with the
//!   bias `Wb + Rb` added there, and one `Split` over time;
//! - each step (nodes named `<node>.fwd.t<i>.*` or `<node>.rev.t<i>.*`) is the recurrent product
//!   `Gemm(H, R, C = projection)`, the gates and the state update. A step whose state is known to
//!   be zero (no initial state, or a constant zero one) skips the terms that vanish;
//! - `Y` is one `Concat` over time per direction; `Y_h` and `Y_c` are the last states.
//!
//! Semantics follow the ONNX operator definitions (opsets 7 to 22); where they leave a choice
//! open, onnxruntime's is taken (the tests compare with it):
//! - `clip` bounds the input of every gate activation (`f`/`g`), including the peephole terms;
//!   the cell state fed to LSTM's `h` is not clipped;
//! - `activation_alpha` / `activation_beta` are consumed in the order of `activations`, each
//!   function taking the values it uses (LeakyRelu, ThresholdedRelu and Elu an alpha; HardSigmoid,
//!   Affine and ScaledTanh an alpha and a beta); a function whose value is not given takes the
//!   default of the ONNX op of that name (LeakyRelu 0.01, ThresholdedRelu 1, Elu 1, HardSigmoid 0.2
//!   and 0.5). Affine and ScaledTanh have no ONNX op and so no default: their values are required;
//! - LSTM's `input_forget=1` couples the gates as `f = 1 - i`;
//! - `sequence_lens` must be a constant (after folding) with every length in `0..=seq_length`.
//!   A sequence shorter than the others keeps its state past its end and outputs zeros there, and
//!   the reverse direction starts at its last element; the masks (`Where` on constant conditions)
//!   are emitted only for the steps some sequence does not reach.

use std::rc::Rc;

use ir::{BinaryOp, Op, Tensor, UnaryOp};

use super::{Importer, N, V};

/// The most time steps unrolled per direction: each adds about ten nodes to the graph.
const MAX_STEPS: usize = 1 << 14;

/// Which recurrent op.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Rnn,
    Gru,
    Lstm,
}

impl Kind {
    /// Gates per direction (rows of `W` and `R` in units of `hidden_size`).
    fn gates(self) -> usize {
        match self {
            Kind::Rnn => 1,
            Kind::Gru => 3,
            Kind::Lstm => 4,
        }
    }
    /// Activation functions per direction, and their defaults.
    fn default_activations(self) -> &'static [&'static str] {
        match self {
            Kind::Rnn => &["Tanh"],
            Kind::Gru => &["Sigmoid", "Tanh"],
            Kind::Lstm => &["Sigmoid", "Tanh", "Tanh"],
        }
    }
}

/// An activation function of the recurrent ops, with its parameters resolved.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Act {
    Unary(UnaryOp),
    /// `alpha * x + beta`
    Affine(f32, f32),
    /// `alpha * tanh(beta * x)`
    ScaledTanh(f32, f32),
}

/// Reads `activations`, `activation_alpha` and `activation_beta`: `per_dir` functions for each
/// of `dirs` directions.
fn activations(n: &N, kind: Kind, dirs: usize) -> Result<Vec<Vec<Act>>, String> {
    let per_dir = kind.default_activations().len();
    let names: Vec<String> = match n.attr("activations") {
        Some(a) => a.strings.iter().map(|s| String::from_utf8_lossy(s).to_string()).collect(),
        None => kind.default_activations().iter().cycle().take(per_dir * dirs).map(|s| s.to_string()).collect(),
    };
    if names.len() != per_dir * dirs {
        return Err(format!(
            "activations lists {} functions; this op takes {per_dir} per direction, {} for {dirs} direction(s)",
            names.len(),
            per_dir * dirs
        ));
    }
    let alphas = n.attr("activation_alpha").map(|a| a.floats.clone()).unwrap_or_default();
    let betas = n.attr("activation_beta").map(|a| a.floats.clone()).unwrap_or_default();
    let (mut ai, mut bi) = (alphas.iter().copied(), betas.iter().copied());
    let mut acts = Vec::with_capacity(names.len());
    for name in &names {
        let required = |v: Option<f32>, what: &str| {
            v.ok_or_else(|| {
                format!("activation {name} needs an {what} value (activation_{what}), and none is left for it")
            })
        };
        let act = match name.to_ascii_lowercase().as_str() {
            "relu" => Act::Unary(UnaryOp::Relu),
            "tanh" => Act::Unary(UnaryOp::Tanh),
            "sigmoid" => Act::Unary(UnaryOp::Sigmoid),
            "softsign" => Act::Unary(UnaryOp::Softsign),
            "softplus" => Act::Unary(UnaryOp::Softplus),
            "leakyrelu" => Act::Unary(UnaryOp::LeakyRelu { alpha: ai.next().unwrap_or(0.01) }),
            "thresholdedrelu" => Act::Unary(UnaryOp::ThresholdedRelu { alpha: ai.next().unwrap_or(1.0) }),
            "elu" => Act::Unary(UnaryOp::Elu { alpha: ai.next().unwrap_or(1.0) }),
            "hardsigmoid" => {
                Act::Unary(UnaryOp::HardSigmoid { alpha: ai.next().unwrap_or(0.2), beta: bi.next().unwrap_or(0.5) })
            }
            "affine" => Act::Affine(required(ai.next(), "alpha")?, required(bi.next(), "beta")?),
            "scaledtanh" => Act::ScaledTanh(required(ai.next(), "alpha")?, required(bi.next(), "beta")?),
            _ => {
                return Err(format!(
                    "activation {name} is not one of Relu, Tanh, Sigmoid, Affine, LeakyRelu, ThresholdedRelu, \
                     ScaledTanh, HardSigmoid, Elu, Softsign, Softplus"
                ));
            }
        };
        acts.push(act);
    }
    Ok(acts.chunks(per_dir).map(|c| c.to_vec()).collect())
}

fn scalar(v: f32) -> V {
    V::C(Rc::new(Tensor::scalar_f32(v)))
}

/// True when `v` is a constant whose every element is zero.
fn is_const_zero(v: &V) -> bool {
    matches!(v, V::C(t) if t.dtype().is_float() && t.to_f64_vec().iter().all(|&a| a == 0.0))
}

/// What is fixed for the whole node.
struct Spec {
    kind: Kind,
    /// Node name (prefix of every emitted node).
    nm: String,
    hidden: usize,
    batch: usize,
    steps: usize,
    /// Batch-major tensors (`layout=1`).
    batch_major: bool,
    clip: Option<f32>,
    /// LSTM `input_forget`.
    input_forget: bool,
    /// GRU `linear_before_reset`.
    linear_before_reset: bool,
    /// Per step, which sequences it reaches (`None`: all of them).
    masks: Vec<Option<Rc<Tensor>>>,
}

/// The blocks of one direction's weights.
struct Dir {
    /// Name part: `fwd` or `rev`.
    tag: &'static str,
    reverse: bool,
    acts: Vec<Act>,
    /// Input weights per gate group (`[rows, input]`): one group, or GRU's `zr` and `h`.
    w: Vec<V>,
    /// Recurrence weights, grouped as `w`.
    r: Vec<V>,
    /// Bias added to the input projection of each group (`Wb + Rb`, except GRU's `Rbh` under
    /// `linear_before_reset`).
    bias: Vec<Option<V>>,
    /// GRU's `Rbh` under `linear_before_reset`.
    rbh: Option<V>,
    /// LSTM peepholes `P[i]`, `P[o]`, `P[f]`.
    peep: Option<[V; 3]>,
    h0: Option<V>,
    c0: Option<V>,
}

/// One step's result: the new hidden state and (LSTM) cell state.
struct State {
    h: V,
    c: Option<V>,
}

impl Importer<'_> {
    /// `RNN`, `GRU` and `LSTM`.
    pub(super) fn translate_recurrent(&mut self, n: &N, op_type: &str) -> Result<Vec<Option<V>>, String> {
        let kind = match op_type {
            "RNN" => Kind::Rnn,
            "GRU" => Kind::Gru,
            "LSTM" => Kind::Lstm,
            other => return Err(format!("{other} is not a recurrent op (importer bug)")),
        };
        let nm = n.name.clone();
        let x = self.need(n, 0)?;
        let w = self.need(n, 1)?;
        let r = self.need(n, 2)?;
        let (xm, wm, rm) = (self.meta(&x), self.meta(&w), self.meta(&r));
        for (m, what) in [(&xm, "X"), (&wm, "W"), (&rm, "R")] {
            if !m.dtype.is_float() {
                return Err(format!("{what} must be a float tensor, got {m}"));
            }
            if m.rank() != 3 {
                return Err(format!("{what} must be 3-D, got {m}"));
            }
        }
        let direction = n.string("direction").unwrap_or_else(|| "forward".into());
        let dirs = match direction.as_str() {
            "forward" | "reverse" => 1,
            "bidirectional" => 2,
            other => return Err(format!("direction {other:?} is not forward, reverse or bidirectional")),
        };
        let layout = n.int("layout", 0);
        if layout != 0 && layout != 1 {
            return Err(format!("layout {layout} is not 0 or 1"));
        }
        let batch_major = layout == 1;
        let (steps, batch, input) =
            if batch_major { (xm.shape[1], xm.shape[0], xm.shape[2]) } else { (xm.shape[0], xm.shape[1], xm.shape[2]) };
        let g = kind.gates();
        let hidden = rm.shape[2];
        if let Some(a) = n.attr("hidden_size")
            && a.i != hidden as i64
        {
            return Err(format!("hidden_size {} disagrees with R {rm} (hidden size {hidden})", a.i));
        }
        if hidden == 0 || batch == 0 || steps == 0 {
            return Err(format!("X {xm} and R {rm}: sequence length, batch and hidden size must be at least 1"));
        }
        if steps > MAX_STEPS {
            return Err(format!("sequence length {steps} is more than the {MAX_STEPS} steps autopar unrolls (X {xm})"));
        }
        let rows = g * hidden;
        if wm.shape != [dirs, rows, input] {
            return Err(format!("W {wm} must be [{dirs}, {rows}, {input}] ({direction}, hidden size {hidden})"));
        }
        if rm.shape != [dirs, rows, hidden] {
            return Err(format!("R {rm} must be [{dirs}, {rows}, {hidden}] ({direction})"));
        }
        let clip = match n.attr("clip") {
            None => None,
            Some(a) if a.f > 0.0 && a.f.is_finite() => Some(a.f),
            Some(a) => return Err(format!("clip {} must be a positive number", a.f)),
        };
        let input_forget = kind == Kind::Lstm && n.int("input_forget", 0) != 0;
        let linear_before_reset = kind == Kind::Gru && n.int("linear_before_reset", 0) != 0;
        let acts = activations(n, kind, dirs)?;

        // Optional operands, checked against their ONNX shapes.
        let state_shape = if batch_major { vec![batch, dirs, hidden] } else { vec![dirs, batch, hidden] };
        let opt = |this: &mut Self, i: usize, what: &str, shape: &[usize]| -> Result<Option<V>, String> {
            let Some(v) = this.opt(n, i)? else { return Ok(None) };
            let m = this.meta(&v);
            if !m.dtype.is_float() || m.shape != shape {
                return Err(format!("{what} (input {i}) must be a float tensor of shape {shape:?}, got {m}"));
            }
            Ok(Some(v))
        };
        let b = opt(self, 3, "B", &[dirs, 2 * rows])?;
        let h0 = opt(self, 5, "initial_h", &state_shape)?;
        let (c0, p) = if kind == Kind::Lstm {
            (opt(self, 6, "initial_c", &state_shape)?, opt(self, 7, "P", &[dirs, 3 * hidden])?)
        } else {
            (None, None)
        };
        let masks = self.sequence_masks(n, batch, steps)?;
        let spec = Spec {
            kind,
            nm: nm.clone(),
            hidden,
            batch,
            steps,
            batch_major,
            clip,
            input_forget,
            linear_before_reset,
            masks,
        };

        // The weights, split once into per-direction blocks.
        let h = hidden;
        let groups: Vec<usize> = if kind == Kind::Gru { vec![2 * h, h] } else { vec![rows] };
        let w_blocks = self.blocks(&format!("{nm}.W"), w, dirs, &groups)?;
        let r_blocks = self.blocks(&format!("{nm}.R"), r, dirs, &groups)?;
        let b_blocks = match b.filter(|b| !is_const_zero(b)) {
            None => None,
            Some(b) => {
                let groups: Vec<usize> = groups.iter().chain(&groups).copied().collect();
                Some(self.blocks(&format!("{nm}.B"), b, dirs, &groups)?)
            }
        };
        let p_blocks = match p.filter(|p| !is_const_zero(p)) {
            None => None,
            Some(p) => Some(self.blocks(&format!("{nm}.P"), p, dirs, &[h, h, h])?),
        };
        let h0s = self.state_blocks(&format!("{nm}.initial_h"), h0, &spec, dirs)?;
        let c0s = self.state_blocks(&format!("{nm}.initial_c"), c0, &spec, dirs)?;

        // The input, flattened once for the projections of every direction.
        let x_flat = self.emit1(&format!("{nm}.X.flat"), Op::Reshape { shape: vec![steps * batch, input] }, &[x])?;

        let mut ys = Vec::with_capacity(dirs);
        let mut last = Vec::with_capacity(dirs);
        for (d, acts) in acts.into_iter().enumerate() {
            let reverse = d == 1 || direction == "reverse";
            let tag = if reverse { "rev" } else { "fwd" };
            let ng = groups.len();
            let (mut bias, mut rbh) = (vec![None; ng], None);
            if let Some(bb) = &b_blocks {
                let (wb, rb) = bb[d].split_at(ng);
                for k in 0..ng {
                    if linear_before_reset && k == 1 {
                        bias[k] = Some(wb[k].clone());
                        rbh = Some(rb[k].clone());
                    } else {
                        bias[k] = Some(self.emit1(
                            &format!("{nm}.{tag}.bias{k}"),
                            Op::Binary(BinaryOp::Add),
                            &[wb[k].clone(), rb[k].clone()],
                        )?);
                    }
                }
            }
            let peep = p_blocks.as_ref().map(|p| [p[d][0].clone(), p[d][1].clone(), p[d][2].clone()]);
            let dir = Dir {
                tag,
                reverse,
                acts,
                w: w_blocks[d].clone(),
                r: r_blocks[d].clone(),
                bias,
                rbh,
                peep,
                h0: h0s.as_ref().map(|s| s[d].clone()),
                c0: c0s.as_ref().map(|s| s[d].clone()),
            };
            let (y, fin) = self.run_direction(&spec, &dir, &x_flat)?;
            ys.push(y);
            last.push(fin);
        }

        let want = |k: usize| n.node.output.get(k).is_some_and(|o| !o.is_empty());
        let mut outs = vec![None; n.node.output.len()];
        if want(0) {
            outs[0] = Some(self.output_y(&spec, ys)?);
        }
        if want(1) {
            let hs = last.iter().map(|s| s.h.clone()).collect();
            outs[1] = Some(self.output_state(&spec, &format!("{nm}.Y_h"), hs)?);
        }
        if want(2) && kind == Kind::Lstm {
            let cs = last
                .iter()
                .map(|s| s.c.clone().ok_or("LSTM step without a cell state (importer bug)"))
                .collect::<Result<_, _>>()?;
            outs[2] = Some(self.output_state(&spec, &format!("{nm}.Y_c"), cs)?);
        }
        Ok(outs)
    }

    /// The per-step masks of a constant `sequence_lens` (input 4): `None` for the steps every
    /// sequence reaches.
    fn sequence_masks(&mut self, n: &N, batch: usize, steps: usize) -> Result<Vec<Option<Rc<Tensor>>>, String> {
        let lens = match self.opt(n, 4)? {
            None => return Ok(vec![None; steps]),
            Some(V::G(_)) => {
                return Err("sequence_lens (input 4) must be a constant (an initializer, or computed from \
                            constants); per-batch lengths fed at run time are not supported"
                    .into());
            }
            Some(V::C(t)) => t,
        };
        if lens.dtype().is_float() || lens.shape() != [batch] {
            return Err(format!(
                "sequence_lens (input 4) must be an integer tensor of shape [{batch}], got {}",
                lens.meta()
            ));
        }
        let lens = lens.to_i64_vec();
        if let Some((b, l)) = lens.iter().enumerate().find(|(_, l)| !(0..=steps as i64).contains(l)) {
            return Err(format!("sequence_lens[{b}] = {l} is outside 0..={steps} (the sequence length)"));
        }
        Ok((0..steps)
            .map(|t| {
                let reach: Vec<bool> = lens.iter().map(|&l| (t as i64) < l).collect();
                (!reach.iter().all(|&r| r)).then(|| Rc::new(Tensor::bool(vec![batch, 1], reach)))
            })
            .collect())
    }

    /// Splits a weight `[dirs, rows(, cols)]` into per-direction blocks of `groups` rows each
    /// (2-D blocks `[rows, cols]` for a 3-D weight, 1-D `[rows]` for a 2-D one).
    fn blocks(&mut self, name: &str, v: V, dirs: usize, groups: &[usize]) -> Result<Vec<Vec<V>>, String> {
        let m = self.meta(&v);
        let total: usize = m.shape[..2].iter().product();
        let flat = if m.rank() == 3 { vec![total, m.shape[2]] } else { vec![total] };
        let flat = self.reshape_to(&format!("{name}.flat"), v, flat)?;
        let sizes: Vec<usize> = (0..dirs).flat_map(|_| groups.iter().copied()).collect();
        let pieces = if sizes.len() == 1 {
            vec![flat]
        } else {
            self.emit(&format!("{name}.split"), Op::Split { axis: 0, sizes }, &[flat])?
        };
        Ok(pieces.chunks(groups.len()).map(|c| c.to_vec()).collect())
    }

    /// An initial state `[dirs, batch, hidden]` (`[batch, dirs, hidden]` batch-major) as one
    /// `[batch, hidden]` value per direction; `None` when absent or a constant zero.
    fn state_blocks(&mut self, name: &str, v: Option<V>, s: &Spec, dirs: usize) -> Result<Option<Vec<V>>, String> {
        let Some(v) = v.filter(|v| !is_const_zero(v)) else { return Ok(None) };
        let (b, h) = (s.batch, s.hidden);
        if dirs == 1 {
            return Ok(Some(vec![self.reshape_to(&format!("{name}.flat"), v, vec![b, h])?]));
        }
        let (shape, axis, sizes) =
            if s.batch_major { (vec![b, dirs * h], 1, vec![h; dirs]) } else { (vec![dirs * b, h], 0, vec![b; dirs]) };
        let flat = self.reshape_to(&format!("{name}.flat"), v, shape)?;
        Ok(Some(self.emit(&format!("{name}.split"), Op::Split { axis, sizes }, &[flat])?))
    }

    /// The input projection `X W^T + bias` of every step, as one `[batch, rows]` value per step.
    fn project(&mut self, s: &Spec, name: &str, x_flat: &V, w: &V, bias: Option<&V>) -> Result<Vec<V>, String> {
        let rows = self.meta(w).shape[0];
        let (t, b) = (s.steps, s.batch);
        let mut ins = vec![x_flat.clone(), w.clone()];
        ins.extend(bias.cloned());
        let gemm = Op::Gemm { alpha: 1.0, beta: 1.0, trans_a: false, trans_b: true };
        let p = self.emit1(name, gemm, &ins)?;
        if t == 1 {
            return Ok(vec![p]);
        }
        if s.batch_major {
            let p = self.emit1(&format!("{name}.rows"), Op::Reshape { shape: vec![b, t * rows] }, &[p])?;
            self.emit(&format!("{name}.steps"), Op::Split { axis: 1, sizes: vec![rows; t] }, &[p])
        } else {
            self.emit(&format!("{name}.steps"), Op::Split { axis: 0, sizes: vec![b; t] }, &[p])
        }
    }

    /// Runs one direction over every step: its outputs in time order, and the final state.
    fn run_direction(&mut self, s: &Spec, d: &Dir, x_flat: &V) -> Result<(Vec<V>, State), String> {
        let nm = &s.nm;
        let mut proj = Vec::with_capacity(d.w.len());
        for (k, w) in d.w.iter().enumerate() {
            let name = if d.w.len() == 1 { format!("{nm}.{}.x", d.tag) } else { format!("{nm}.{}.x{k}", d.tag) };
            proj.push(self.project(s, &name, x_flat, w, d.bias[k].as_ref())?);
        }
        let order: Vec<usize> = if d.reverse { (0..s.steps).rev().collect() } else { (0..s.steps).collect() };
        let mut h = d.h0.clone();
        let mut c = d.c0.clone();
        let mut ys: Vec<Option<V>> = vec![None; s.steps];
        for t in order {
            let p = format!("{nm}.{}.t{t}", d.tag);
            let xs: Vec<V> = proj.iter().map(|steps| steps[t].clone()).collect();
            let new = match s.kind {
                Kind::Rnn => self.rnn_step(s, d, &p, &xs[0], h.as_ref())?,
                Kind::Gru => self.gru_step(s, d, &p, &xs, h.as_ref())?,
                Kind::Lstm => self.lstm_step(s, d, &p, &xs[0], h.as_ref(), c.as_ref())?,
            };
            match &s.masks[t] {
                None => {
                    ys[t] = Some(new.h.clone());
                    h = Some(new.h);
                    c = new.c;
                }
                Some(m) => {
                    // Sequences that end before this step keep their state and output zeros.
                    let m = V::C(m.clone());
                    let keep = |this: &mut Self, what: &str, new: V, old: Option<V>| {
                        let old = old.unwrap_or_else(|| scalar(0.0));
                        this.emit1(&format!("{p}.{what}.masked"), Op::Where, &[m.clone(), new, old])
                    };
                    ys[t] = Some(keep(self, "y", new.h.clone(), None)?);
                    h = Some(keep(self, "h", new.h, h)?);
                    c = match new.c {
                        Some(nc) => Some(keep(self, "c", nc, c)?),
                        None => None,
                    };
                }
            }
        }
        let ys = ys.into_iter().collect::<Option<Vec<V>>>().ok_or("a step was not run (importer bug)")?;
        let h = h.ok_or("no step was run (importer bug)")?;
        Ok((ys, State { h, c }))
    }

    /// `act(clip(x))`.
    fn activate(&mut self, s: &Spec, name: &str, a: Act, x: V) -> Result<V, String> {
        let mut x = x;
        if let Some(c) = s.clip {
            x = self.emit1(&format!("{name}.clip_lo"), Op::Binary(BinaryOp::Max), &[x, scalar(-c)])?;
            x = self.emit1(&format!("{name}.clip_hi"), Op::Binary(BinaryOp::Min), &[x, scalar(c)])?;
        }
        self.apply(name, a, x)
    }

    /// `act(x)`, without clipping (LSTM's `h` on the cell state).
    fn apply(&mut self, name: &str, a: Act, x: V) -> Result<V, String> {
        let mul = |this: &mut Self, what: &str, x: V, k: f32| {
            if k == 1.0 {
                Ok(x)
            } else {
                this.emit1(&format!("{name}.{what}"), Op::Binary(BinaryOp::Mul), &[x, scalar(k)])
            }
        };
        match a {
            Act::Unary(u) => self.emit1(name, Op::Unary(u), &[x]),
            Act::Affine(alpha, beta) => {
                let y = mul(self, "scale", x, alpha)?;
                if beta == 0.0 { Ok(y) } else { self.emit1(name, Op::Binary(BinaryOp::Add), &[y, scalar(beta)]) }
            }
            Act::ScaledTanh(alpha, beta) => {
                let y = mul(self, "in_scale", x, beta)?;
                let y = self.emit1(name, Op::Unary(UnaryOp::Tanh), &[y])?;
                mul(self, "out_scale", y, alpha)
            }
        }
    }

    /// `x + H R^T` (`x` alone when the state is zero).
    fn recur(&mut self, name: &str, x: &V, h: Option<&V>, r: &V) -> Result<V, String> {
        match h {
            None => Ok(x.clone()),
            Some(h) => {
                let gemm = Op::Gemm { alpha: 1.0, beta: 1.0, trans_a: false, trans_b: true };
                self.emit1(name, gemm, &[h.clone(), r.clone(), x.clone()])
            }
        }
    }

    fn rbin(&mut self, name: &str, b: BinaryOp, x: V, y: V) -> Result<V, String> {
        self.emit1(name, Op::Binary(b), &[x, y])
    }

    /// `H = f(X W^T + H R^T + Wb + Rb)`.
    fn rnn_step(&mut self, s: &Spec, d: &Dir, p: &str, x: &V, h: Option<&V>) -> Result<State, String> {
        let pre = self.recur(&format!("{p}.gates"), x, h, &d.r[0])?;
        Ok(State { h: self.activate(s, &format!("{p}.h"), d.acts[0], pre)?, c: None })
    }

    /// `z, r = f(...)`, `h~ = g(...)` (reset before or after the recurrent product),
    /// `H = h~ + z (H - h~)`.
    fn gru_step(&mut self, s: &Spec, d: &Dir, p: &str, xs: &[V], h: Option<&V>) -> Result<State, String> {
        let hd = s.hidden;
        let (f, g) = (d.acts[0], d.acts[1]);
        let zr_pre = self.recur(&format!("{p}.zr_pre"), &xs[0], h, &d.r[0])?;
        // One activation over both gates that share `f` (clipping is elementwise too).
        let zr = self.activate(s, &format!("{p}.zr"), f, zr_pre)?;
        let zr = self.emit(&format!("{p}.zr.split"), Op::Split { axis: 1, sizes: vec![hd, hd] }, &[zr])?;
        let (z, r) = (zr[0].clone(), zr[1].clone());
        let gemm = Op::Gemm { alpha: 1.0, beta: 1.0, trans_a: false, trans_b: true };
        let cand_pre = match h {
            // r H R_h^T and r (H R_h^T + Rb_h) vanish with H.
            None if !s.linear_before_reset || d.rbh.is_none() => xs[1].clone(),
            None => {
                let rb = self.rbin(&format!("{p}.hr"), BinaryOp::Mul, r, d.rbh.clone().ok_or("checked")?)?;
                self.rbin(&format!("{p}.h_pre"), BinaryOp::Add, xs[1].clone(), rb)?
            }
            Some(h) if s.linear_before_reset => {
                let mut ins = vec![h.clone(), d.r[1].clone()];
                ins.extend(d.rbh.clone());
                let hr = self.emit1(&format!("{p}.hr"), gemm, &ins)?;
                let rhr = self.rbin(&format!("{p}.reset"), BinaryOp::Mul, r, hr)?;
                self.rbin(&format!("{p}.h_pre"), BinaryOp::Add, xs[1].clone(), rhr)?
            }
            Some(h) => {
                let rh = self.rbin(&format!("{p}.reset"), BinaryOp::Mul, r, h.clone())?;
                self.emit1(&format!("{p}.h_pre"), gemm, &[rh, d.r[1].clone(), xs[1].clone()])?
            }
        };
        let cand = self.activate(s, &format!("{p}.cand"), g, cand_pre)?;
        let h = match h {
            None => {
                let zc = self.rbin(&format!("{p}.zh"), BinaryOp::Mul, z, cand.clone())?;
                self.rbin(&format!("{p}.h"), BinaryOp::Sub, cand, zc)?
            }
            Some(h) => {
                let diff = self.rbin(&format!("{p}.dh"), BinaryOp::Sub, h.clone(), cand.clone())?;
                let zd = self.rbin(&format!("{p}.zdh"), BinaryOp::Mul, z, diff)?;
                self.rbin(&format!("{p}.h"), BinaryOp::Add, cand, zd)?
            }
        };
        Ok(State { h, c: None })
    }

    /// Gates `i, o, f, c` (ONNX order), peepholes on the previous cell state for `i` and `f` and
    /// on the new one for `o`; `C = f C' + i c`, `H = o h(C)`.
    fn lstm_step(
        &mut self,
        s: &Spec,
        d: &Dir,
        p: &str,
        x: &V,
        h: Option<&V>,
        c_prev: Option<&V>,
    ) -> Result<State, String> {
        let hd = s.hidden;
        let (f, g, ha) = (d.acts[0], d.acts[1], d.acts[2]);
        let pre = self.recur(&format!("{p}.gates"), x, h, &d.r[0])?;
        let peep = |this: &mut Self, k: usize, what: &str, pre: V, cell: Option<&V>| -> Result<V, String> {
            match (&d.peep, cell) {
                (Some(pp), Some(cell)) => {
                    let pc = this.rbin(&format!("{p}.{what}.peep"), BinaryOp::Mul, cell.clone(), pp[k].clone())?;
                    this.rbin(&format!("{p}.{what}.pre"), BinaryOp::Add, pre, pc)
                }
                _ => Ok(pre),
            }
        };
        if d.peep.is_none() && !s.input_forget {
            // One activation over the three gates that share `f` (clipping is elementwise too).
            let parts = self.emit(&format!("{p}.split"), Op::Split { axis: 1, sizes: vec![3 * hd, hd] }, &[pre])?;
            let iof = self.activate(s, &format!("{p}.iof"), f, parts[0].clone())?;
            let iof = self.emit(&format!("{p}.iof.split"), Op::Split { axis: 1, sizes: vec![hd; 3] }, &[iof])?;
            let cell = self.activate(s, &format!("{p}.c"), g, parts[1].clone())?;
            let c = self.lstm_cell(p, &iof[0], &iof[2], cell, c_prev)?;
            let hc = self.apply(&format!("{p}.hc"), ha, c.clone())?;
            let h = self.rbin(&format!("{p}.h"), BinaryOp::Mul, iof[1].clone(), hc)?;
            return Ok(State { h, c: Some(c) });
        }
        let parts = self.emit(&format!("{p}.split"), Op::Split { axis: 1, sizes: vec![hd; 4] }, &[pre])?;
        let i_pre = peep(self, 0, "i", parts[0].clone(), c_prev)?;
        let i = self.activate(s, &format!("{p}.i"), f, i_pre)?;
        let fg = if s.input_forget {
            self.rbin(&format!("{p}.f"), BinaryOp::Sub, scalar(1.0), i.clone())?
        } else {
            let f_pre = peep(self, 2, "f", parts[2].clone(), c_prev)?;
            self.activate(s, &format!("{p}.f"), f, f_pre)?
        };
        let cell = self.activate(s, &format!("{p}.c"), g, parts[3].clone())?;
        let c = self.lstm_cell(p, &i, &fg, cell, c_prev)?;
        // The output gate's peephole reads the new cell state.
        let o_pre = peep(self, 1, "o", parts[1].clone(), Some(&c))?;
        let o = self.activate(s, &format!("{p}.o"), f, o_pre)?;
        let hc = self.apply(&format!("{p}.hc"), ha, c.clone())?;
        let h = self.rbin(&format!("{p}.h"), BinaryOp::Mul, o, hc)?;
        Ok(State { h, c: Some(c) })
    }

    /// `C = f C' + i c` (`i c` when the previous cell state is zero).
    fn lstm_cell(&mut self, p: &str, i: &V, f: &V, cell: V, c_prev: Option<&V>) -> Result<V, String> {
        let ic = self.rbin(&format!("{p}.ic"), BinaryOp::Mul, i.clone(), cell)?;
        match c_prev {
            None => Ok(ic),
            Some(c_prev) => {
                let fc = self.rbin(&format!("{p}.fc"), BinaryOp::Mul, f.clone(), c_prev.clone())?;
                self.rbin(&format!("{p}.C"), BinaryOp::Add, fc, ic)
            }
        }
    }

    /// `Y`: `[steps, dirs, batch, hidden]` (`[batch, steps, dirs, hidden]` batch-major) from
    /// each direction's `[batch, hidden]` outputs in time order.
    fn output_y(&mut self, s: &Spec, ys: Vec<Vec<V>>) -> Result<V, String> {
        let (t, b, h, dirs) = (s.steps, s.batch, s.hidden, ys.len());
        let nm = &s.nm;
        let (axis, shape) = if s.batch_major { (1, vec![b, t, 1, h]) } else { (0, vec![t, 1, b, h]) };
        let mut per_dir = Vec::with_capacity(dirs);
        for (d, y) in ys.into_iter().enumerate() {
            let name = format!("{nm}.Y.d{d}");
            let cat = if y.len() == 1 {
                y.into_iter().next().ok_or("empty")?
            } else {
                self.emit1(&format!("{name}.concat"), Op::Concat { axis }, &y)?
            };
            per_dir.push(self.reshape_to(&name, cat, shape.clone())?);
        }
        if per_dir.len() == 1 {
            return per_dir.pop().ok_or_else(|| "no direction (importer bug)".into());
        }
        self.emit1(&format!("{nm}.Y"), Op::Concat { axis: if s.batch_major { 2 } else { 1 } }, &per_dir)
    }

    /// `Y_h` / `Y_c`: `[dirs, batch, hidden]` (`[batch, dirs, hidden]` batch-major).
    fn output_state(&mut self, s: &Spec, name: &str, states: Vec<V>) -> Result<V, String> {
        let (b, h, dirs) = (s.batch, s.hidden, states.len());
        let (axis, shape) = if s.batch_major { (1, vec![b, dirs, h]) } else { (0, vec![dirs, b, h]) };
        let cat = if dirs == 1 {
            states.into_iter().next().ok_or("no direction (importer bug)")?
        } else {
            self.emit1(&format!("{name}.concat"), Op::Concat { axis }, &states)?
        };
        self.reshape_to(name, cat, shape)
    }
}
