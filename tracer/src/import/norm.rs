//! Normalisations: training-mode BatchNormalization onto [`Op::BatchNormTrain`], and the ones
//! with per-instance statistics expressed with ops that already have kernels, gradients and
//! sharding rules:
//!
//! - `InstanceNormalization` = [`Op::LayerNorm`] over dims `2..` (unit scale), then the
//!   per-channel scale and bias as `Mul`/`Add` (skipped when they are constant ones/zeros, as
//!   PyTorch's GroupNorm export writes them). Batch and channel dims split.
//! - `GroupNormalization` (opset 18: scale/bias per group; 21: per channel) = reshape to
//!   `[N, G, -1]`, the same layer norm, reshape back, scale and bias.
//! - `MeanVarianceNormalization`, `LpNormalization` and `RMSNormalization` as the reductions and
//!   elementwise ops of their ONNX function bodies.

use std::rc::Rc;

use ir::{BinaryOp, Op, ReduceOp, Tensor, UnaryOp};

use super::{Importer, N, V, norm_axis};

/// True when `v` is a constant whose every element is `x`.
fn all_const(v: &V, x: f32) -> bool {
    matches!(v, V::C(t) if t.dtype().is_float() && t.to_f32_vec().iter().all(|&a| a == x))
}

fn scalar(v: f32) -> V {
    V::C(Rc::new(Tensor::scalar_f32(v)))
}

impl Importer<'_> {
    fn bin(&mut self, name: String, b: BinaryOp, x: V, y: V) -> Result<V, String> {
        self.emit1(&name, Op::Binary(b), &[x, y])
    }

    /// `y * scale + bias` with `[K]` scale and bias applied along dim 1 of `y` (`[N, K, ...]`);
    /// a constant unit scale or zero bias is skipped.
    fn channel_affine(&mut self, nm: &str, y: V, scale: V, bias: V) -> Result<V, String> {
        let rank = self.meta(&y).rank();
        let k = self.meta(&y).shape[1];
        let mut cshape = vec![k];
        cshape.extend(std::iter::repeat_n(1, rank - 2));
        let mut y = y;
        for (v, is_scale) in [(scale, true), (bias, false)] {
            let m = self.meta(&v);
            if m.shape != [k] {
                let what = if is_scale { "scale" } else { "bias" };
                return Err(format!("{what} shape {:?} must be [{k}]", m.shape));
            }
            if all_const(&v, if is_scale { 1.0 } else { 0.0 }) {
                continue;
            }
            let what = if is_scale { "scale" } else { "bias" };
            let c = self.reshape_to(&format!("{nm}.{what}.c"), v, cshape.clone())?;
            let b = if is_scale { BinaryOp::Mul } else { BinaryOp::Add };
            y = self.bin(format!("{nm}.{what}"), b, y, c)?;
        }
        Ok(y)
    }

    /// Layer norm over dims `2..` of `x` with a unit scale: the per-(instance, channel) statistics.
    fn instance_stats_norm(&mut self, nm: &str, x: V, epsilon: f32) -> Result<V, String> {
        let m = self.meta(&x);
        if m.rank() < 3 {
            return Err(format!("input {:?} needs a spatial dim after N and C", m.shape));
        }
        let one = V::C(Rc::new(Tensor::f32(vec![1], vec![1.0])));
        self.emit1(&format!("{nm}.norm"), Op::LayerNorm { axis: 2, epsilon }, &[x, one])
    }

    pub(super) fn batch_normalization(&mut self, n: &N) -> Result<Vec<Option<V>>, String> {
        let nm = n.name.clone();
        let epsilon = n.float("epsilon", 1e-5);
        let ins = (0..5).map(|i| self.need(n, i)).collect::<Result<Vec<_>, _>>()?;
        if self.opset < 14 || n.int("training_mode", 0) == 0 {
            return Ok(vec![Some(self.emit1(&nm, Op::BatchNorm { epsilon }, &ins)?)]);
        }
        // Training mode: the batch's statistics. The running mean and variance (inputs 3, 4)
        // are state the output does not read; the optional outputs 1 and 2 blend them with the
        // batch statistics (ONNX: `running * momentum + batch * (1 - momentum)`, population
        // variance) and are computed only when something reads them.
        let [x, scale, bias, rmean, rvar] = <[V; 5]>::try_from(ins).map_err(|_| "five inputs".to_string())?;
        let y = self.emit1(&nm, Op::BatchNormTrain { epsilon }, &[x.clone(), scale, bias])?;
        let wants = |k: usize| n.node.output.get(k).is_some_and(|o| self.used.contains(o));
        if !wants(1) && !wants(2) {
            return Ok(vec![Some(y)]);
        }
        let momentum = n.float("momentum", 0.9);
        let xs = self.meta(&x).shape;
        let axes: Vec<usize> = (0..xs.len()).filter(|&d| d != 1).collect();
        let mean_k = self.emit1(
            &format!("{nm}.mean"),
            Op::Reduce { op: ReduceOp::Mean, axes: axes.clone(), keepdims: true },
            std::slice::from_ref(&x),
        )?;
        let centered = self.bin(format!("{nm}.centered"), BinaryOp::Sub, x, mean_k.clone())?;
        let sq = self.bin(format!("{nm}.sq"), BinaryOp::Mul, centered.clone(), centered)?;
        let var_k = self.emit1(
            &format!("{nm}.var"),
            Op::Reduce { op: ReduceOp::Mean, axes: axes.clone(), keepdims: true },
            &[sq],
        )?;
        let mut outs = vec![Some(y)];
        for (k, (batch, running)) in [(mean_k, rmean), (var_k, rvar)].into_iter().enumerate() {
            let what = if k == 0 { "running_mean" } else { "running_var" };
            let batch = self.reshape_to(&format!("{nm}.{what}.batch"), batch, vec![xs[1]])?;
            let a = self.bin(format!("{nm}.{what}.old"), BinaryOp::Mul, running, scalar(momentum))?;
            let b = self.bin(format!("{nm}.{what}.new"), BinaryOp::Mul, batch, scalar(1.0 - momentum))?;
            outs.push(Some(self.bin(format!("{nm}.{what}"), BinaryOp::Add, a, b)?));
        }
        Ok(outs)
    }

    pub(super) fn instance_normalization(&mut self, n: &N) -> Result<Vec<Option<V>>, String> {
        let nm = n.name.clone();
        let (x, scale, bias) = (self.need(n, 0)?, self.need(n, 1)?, self.need(n, 2)?);
        let y = self.instance_stats_norm(&nm, x, n.float("epsilon", 1e-5))?;
        Ok(vec![Some(self.channel_affine(&nm, y, scale, bias)?)])
    }

    pub(super) fn group_normalization(&mut self, n: &N) -> Result<Vec<Option<V>>, String> {
        let nm = n.name.clone();
        let (x, scale, bias) = (self.need(n, 0)?, self.need(n, 1)?, self.need(n, 2)?);
        let xs = self.meta(&x).shape;
        if xs.len() < 3 {
            return Err(format!("input {xs:?} needs a spatial dim after N and C"));
        }
        let g = n.int("num_groups", 0);
        if g <= 0 || !xs[1].is_multiple_of(g as usize) {
            return Err(format!("num_groups={g} does not divide the {} channels", xs[1]));
        }
        let g = g as usize;
        let rest: usize = xs[1..].iter().product::<usize>() / g;
        let xr = self.reshape_to(&format!("{nm}.grouped"), x, vec![xs[0], g, rest])?;
        let y = self.instance_stats_norm(&nm, xr, n.float("epsilon", 1e-5))?;
        // Opset 18 scales per group, opset 21 per channel.
        if self.opset < 21 {
            let y = self.channel_affine(&nm, y, scale, bias)?;
            return Ok(vec![Some(self.reshape_to(&format!("{nm}.ungrouped"), y, xs)?)]);
        }
        let y = self.reshape_to(&format!("{nm}.ungrouped"), y, xs)?;
        Ok(vec![Some(self.channel_affine(&nm, y, scale, bias)?)])
    }

    pub(super) fn mean_variance_normalization(&mut self, n: &N) -> Result<Vec<Option<V>>, String> {
        let nm = n.name.clone();
        let x = self.need(n, 0)?;
        let rank = self.meta(&x).rank();
        let mut axes = match n.ints("axes") {
            Some(a) => a.iter().map(|&a| norm_axis(a, rank)).collect::<Result<Vec<_>, _>>()?,
            None if rank >= 4 => vec![0, 2, 3],
            None => return Err(format!("the default axes [0, 2, 3] need rank >= 4, got rank {rank}")),
        };
        axes.sort();
        axes.dedup();
        // ONNX's function body: (x - E[x]) / (sqrt(var) + 1e-9); the variance as E[(x - E[x])^2]
        // (never negative) rather than E[x^2] - E[x]^2.
        let mean = Op::Reduce { op: ReduceOp::Mean, axes, keepdims: true };
        let m = self.emit1(&format!("{nm}.mean"), mean.clone(), std::slice::from_ref(&x))?;
        let d = self.bin(format!("{nm}.centered"), BinaryOp::Sub, x, m)?;
        let sq = self.bin(format!("{nm}.sq"), BinaryOp::Mul, d.clone(), d.clone())?;
        let var = self.emit1(&format!("{nm}.var"), mean, &[sq])?;
        let sd = self.emit1(&format!("{nm}.std"), Op::Unary(UnaryOp::Sqrt), &[var])?;
        let den = self.bin(format!("{nm}.den"), BinaryOp::Add, sd, scalar(1e-9))?;
        Ok(vec![Some(self.bin(nm, BinaryOp::Div, d, den)?)])
    }

    pub(super) fn lp_normalization(&mut self, n: &N) -> Result<Vec<Option<V>>, String> {
        let nm = n.name.clone();
        let x = self.need(n, 0)?;
        let axis = norm_axis(n.int("axis", -1), self.meta(&x).rank())?;
        let op = match n.int("p", 2) {
            1 => ReduceOp::L1,
            2 => ReduceOp::L2,
            p => return Err(format!("p={p} is not 1 or 2")),
        };
        let norm = self.emit1(
            &format!("{nm}.norm"),
            Op::Reduce { op, axes: vec![axis], keepdims: true },
            std::slice::from_ref(&x),
        )?;
        // A zero vector stays zero (ONNX's reference), not 0/0.
        let zero = self.bin(format!("{nm}.zero"), BinaryOp::Equal, norm.clone(), scalar(0.0))?;
        let q = self.bin(format!("{nm}.div"), BinaryOp::Div, x, norm)?;
        Ok(vec![Some(self.emit1(&nm, Op::Where, &[zero, scalar(0.0), q])?)])
    }

    pub(super) fn rms_normalization(&mut self, n: &N) -> Result<Vec<Option<V>>, String> {
        let nm = n.name.clone();
        let (x, scale) = (self.need(n, 0)?, self.need(n, 1)?);
        let rank = self.meta(&x).rank();
        let axis = norm_axis(n.int("axis", -1), rank)?;
        let sq = self.bin(format!("{nm}.sq"), BinaryOp::Mul, x.clone(), x.clone())?;
        let ms = self.emit1(
            &format!("{nm}.mean_sq"),
            Op::Reduce { op: ReduceOp::Mean, axes: (axis..rank).collect(), keepdims: true },
            &[sq],
        )?;
        let e = self.bin(format!("{nm}.eps"), BinaryOp::Add, ms, scalar(n.float("epsilon", 1e-5)))?;
        let rms = self.emit1(&format!("{nm}.rms"), Op::Unary(UnaryOp::Sqrt), &[e])?;
        let y = self.bin(format!("{nm}.normed"), BinaryOp::Div, x, rms)?;
        Ok(vec![Some(self.bin(nm, BinaryOp::Mul, y, scale)?)])
    }
}

impl Importer<'_> {
    /// The norm family's arms of [`Importer::translate`].
    pub(super) fn translate_norm(&mut self, n: &N, op_type: &str) -> Result<Vec<Option<V>>, String> {
        let nm = n.name.clone();
        let one = |v: V| Ok(vec![Some(v)]);
        match op_type {
            "BatchNormalization" => self.batch_normalization(n),
            "InstanceNormalization" => self.instance_normalization(n),
            "GroupNormalization" => self.group_normalization(n),
            "MeanVarianceNormalization" => self.mean_variance_normalization(n),
            "LpNormalization" => self.lp_normalization(n),
            "RMSNormalization" => self.rms_normalization(n),
            "LayerNormalization" => {
                let x = self.need(n, 0)?;
                let axis = norm_axis(n.int("axis", -1), self.meta(&x).rank())?;
                let mut ins = vec![x, self.need(n, 1)?];
                if let Some(b) = self.opt(n, 2)? {
                    ins.push(b);
                }
                let epsilon = n.float("epsilon", 1e-5);
                let x = ins[0].clone();
                let y = self.emit1(&nm, Op::LayerNorm { axis, epsilon }, &ins)?;
                let wants = |k: usize| n.node.output.get(k).is_some_and(|o| self.used.contains(o));
                if !wants(1) && !wants(2) {
                    return one(y);
                }
                // The optional Mean and InvStdDev outputs, computed as ordinary ops when read.
                let rank = self.meta(&x).rank();
                let axes: Vec<usize> = (axis..rank).collect();
                let mean = self.emit1(
                    &format!("{nm}.mean"),
                    Op::Reduce { op: ReduceOp::Mean, axes: axes.clone(), keepdims: true },
                    std::slice::from_ref(&x),
                )?;
                let centered = self.emit1(&format!("{nm}.centered"), Op::Binary(BinaryOp::Sub), &[x, mean.clone()])?;
                let sq = self.emit1(&format!("{nm}.sq"), Op::Binary(BinaryOp::Mul), &[centered.clone(), centered])?;
                let var =
                    self.emit1(&format!("{nm}.var"), Op::Reduce { op: ReduceOp::Mean, axes, keepdims: true }, &[sq])?;
                let eps = V::C(Rc::new(Tensor::scalar_f32(epsilon)));
                let ve = self.emit1(&format!("{nm}.var_eps"), Op::Binary(BinaryOp::Add), &[var, eps])?;
                let sd = self.emit1(&format!("{nm}.std"), Op::Unary(UnaryOp::Sqrt), &[ve])?;
                let inv = self.emit1(&format!("{nm}.inv_std"), Op::Unary(UnaryOp::Reciprocal), &[sd])?;
                Ok(vec![Some(y), Some(mean), Some(inv)])
            }
            "LRN" => {
                let size = n.int("size", 0);
                if size < 1 {
                    return Err("size must be >= 1".into());
                }
                let op = Op::Lrn {
                    size: size as usize,
                    alpha: n.float("alpha", 1e-4),
                    beta: n.float("beta", 0.75),
                    bias: n.float("bias", 1.0),
                };
                {
                    let x = self.need(n, 0)?;
                    one(self.emit1(&nm, op, &[x])?)
                }
            }
            "Softmax" | "LogSoftmax" => {
                let x = self.need(n, 0)?;
                let m = self.meta(&x);
                let r = m.rank();
                let mk = |axis| if op_type == "Softmax" { Op::Softmax { axis } } else { Op::LogSoftmax { axis } };
                if self.opset >= 13 {
                    let axis = norm_axis(n.int("axis", -1), r)?;
                    return one(self.emit1(&nm, mk(axis), &[x])?);
                }
                // Before opset 13 the op flattens to 2-D at `axis` and normalises the second half.
                let axis = norm_axis(n.int("axis", 1), r + 1).map_err(|_| format!("axis out of range for rank {r}"))?;
                if axis + 1 == r {
                    return one(self.emit1(&nm, mk(axis), &[x])?);
                }
                let outer: usize = m.shape[..axis].iter().product();
                let inner: usize = m.shape[axis..].iter().product();
                let flat = self.emit1(&format!("{nm}.flat"), Op::Reshape { shape: vec![outer, inner] }, &[x])?;
                let y = self.emit1(&nm, mk(1), &[flat])?;
                one(self.emit1(&format!("{nm}.unflat"), Op::Reshape { shape: m.shape.clone() }, &[y])?)
            }
            other => Err(format!("{other} is not a norm op (importer bug)")),
        }
    }
}
