//! Import of the losses PyTorch exports for cross-entropy: `NegativeLogLikelihoodLoss` and
//! `SoftmaxCrossEntropyLoss` (opset 12/13), rewritten into existing ops so their kernels,
//! gradients and sharding come from those:
//!
//! ```text
//! log_p  = LogSoftmax(scores, axis 1)                   (SoftmaxCrossEntropyLoss only)
//! keep   = target != ignore_index                        (all true without ignore_index)
//! t      = Where(keep, target, 0)                        (a valid class where ignored)
//! picked = ReduceSum(Cast(t[:, None] == 0..C) * log_p, axis 1)
//! w      = weight[t] * keep                              (keep alone without weight)
//! loss   = -picked * w          reduction none
//!          sum(-picked * w)     reduction sum
//!          sum(-picked * w) / sum(w)   reduction mean (the weighted mean ONNX defines)
//! ```
//!
//! The input is `[N, C]` or `[N, C, d1, ..., dk]` with targets `[N]` or `[N, d1, ..., dk]`. A
//! target outside `0..C` that is not `ignore_index` picks nothing (ONNX leaves it undefined).

use super::*;

impl Importer<'_> {
    /// `NegativeLogLikelihoodLoss` and `SoftmaxCrossEntropyLoss`.
    pub(super) fn translate_loss(&mut self, n: &N, op_type: &str) -> Result<Vec<Option<V>>, String> {
        let nm = n.name.clone();
        let x = self.need(n, 0)?;
        let target = self.need(n, 1)?;
        let weight = self.opt(n, 2)?;
        let reduction = n.string("reduction").unwrap_or_else(|| "mean".into());
        if !matches!(reduction.as_str(), "none" | "sum" | "mean") {
            return Err(format!("reduction={reduction} is not one of none, sum, mean"));
        }
        let ignore = n.attr("ignore_index").map(|a| a.i);
        let (xm, tm) = (self.meta(&x), self.meta(&target));
        if xm.rank() < 2 || !xm.dtype.is_float() {
            return Err(format!("input must be a float tensor [N, C, ...], got {xm}"));
        }
        let mut want_t = xm.shape.clone();
        want_t.remove(1);
        if tm.shape != want_t || tm.dtype != DType::I64 {
            return Err(format!("target must be an integer tensor of shape {want_t:?}, got {tm}"));
        }
        let c = xm.shape[1];
        let log_p = if op_type == "SoftmaxCrossEntropyLoss" {
            self.emit1(&format!("{nm}.log_prob"), Op::LogSoftmax { axis: 1 }, &[x])?
        } else {
            x
        };
        let float = xm.dtype;
        let cast = |to: DType| Op::Cast { to };
        let bin = |b: BinaryOp| Op::Binary(b);
        // keep and the target made valid where ignored.
        let (keep, t) = match ignore {
            Some(ii) => {
                let ii = V::C(Rc::new(Tensor::i64(Vec::<usize>::new(), vec![ii])));
                let hit = self.emit1(&format!("{nm}.ignored"), bin(BinaryOp::Equal), &[target.clone(), ii])?;
                let keep = self.emit1(&format!("{nm}.keep"), Op::Unary(UnaryOp::Not), &[hit])?;
                let zero = V::C(Rc::new(Tensor::i64(Vec::<usize>::new(), vec![0])));
                let t = self.emit1(&format!("{nm}.target"), Op::Where, &[keep.clone(), target, zero])?;
                let keep = self.emit1(&format!("{nm}.keep.f"), cast(float), &[keep])?;
                (Some(keep), t)
            }
            None => (None, target),
        };
        // The one-hot of t along axis 1 times log_p, summed over the classes.
        let mut t_shape = want_t.clone();
        t_shape.insert(1, 1);
        let t1 = self.emit1(&format!("{nm}.target.c"), Op::Reshape { shape: t_shape }, std::slice::from_ref(&t))?;
        let mut c_shape = vec![1; xm.rank()];
        c_shape[1] = c;
        // The class indices are a constant of C elements: checked like any other (a declared
        // class count can be anything).
        self.constant_fits(&TensorMeta::new(DType::I64, c_shape.clone()))?;
        let classes = V::C(Rc::new(Tensor::i64(c_shape, (0..c as i64).collect())));
        let hot = self.emit1(&format!("{nm}.onehot"), bin(BinaryOp::Equal), &[t1, classes])?;
        let hot = self.emit1(&format!("{nm}.onehot.f"), cast(float), &[hot])?;
        let prod = self.emit1(&format!("{nm}.pick"), bin(BinaryOp::Mul), &[hot, log_p.clone()])?;
        let picked = self.emit1(
            &format!("{nm}.picked"),
            Op::Reduce { op: ReduceOp::Sum, axes: vec![1], keepdims: false },
            &[prod],
        )?;
        let neg = self.emit1(&format!("{nm}.nll"), Op::Unary(UnaryOp::Neg), &[picked])?;
        // The per-element weight: weight[t], masked.
        let w = match (weight, keep) {
            (Some(wt), keep) => {
                let wm = self.meta(&wt);
                if wm.shape != [c] {
                    return Err(format!("weight must have shape [{c}], got {wm}"));
                }
                let wt = self.emit1(&format!("{nm}.weight"), Op::Gather { axis: 0 }, &[wt, t])?;
                match keep {
                    Some(k) => Some(self.emit1(&format!("{nm}.weight.kept"), bin(BinaryOp::Mul), &[wt, k])?),
                    None => Some(wt),
                }
            }
            (None, keep) => keep,
        };
        let loss = match &w {
            Some(w) => self.emit1(&format!("{nm}.weighted"), bin(BinaryOp::Mul), &[neg, w.clone()])?,
            None => neg,
        };
        let all: Vec<usize> = (0..want_t.len()).collect();
        let sum = |s: &mut Self, name: &str, v: V| {
            s.emit1(name, Op::Reduce { op: ReduceOp::Sum, axes: all.clone(), keepdims: false }, &[v])
        };
        let out = match reduction.as_str() {
            "none" => loss,
            "sum" => sum(self, &nm, loss)?,
            _ => match w {
                // The weighted mean: over the weights of the picked classes (ignored ones have 0).
                Some(w) => {
                    let num = sum(self, &format!("{nm}.sum"), loss)?;
                    let den = sum(self, &format!("{nm}.weights"), w)?;
                    self.emit1(&nm, bin(BinaryOp::Div), &[num, den])?
                }
                None => {
                    self.emit1(&nm, Op::Reduce { op: ReduceOp::Mean, axes: all.clone(), keepdims: false }, &[loss])?
                }
            },
        };
        let mut outs = vec![Some(out)];
        if n.node.output.len() > 1 {
            if op_type != "SoftmaxCrossEntropyLoss" {
                return Err("NegativeLogLikelihoodLoss has one output".into());
            }
            outs.push(Some(log_p));
        }
        Ok(outs)
    }
}
