//! Learning-rate schedules and gradient clipping by global norm, as ops of the training graph's
//! update phase (so that plans price them and every back end runs the same arithmetic).
//!
//! - A schedule ([`LrSchedule`]) turns the optimizer's step counter `k` (0 at the first step:
//!   AdamW's `adamw/step` before its increment, or `sgd/step`) into an f32 factor read by every
//!   update op as its optional trailing input; the step's learning rate is `lr * factor(k)`,
//!   PyTorch's `LambdaLR` / `CosineAnnealingLR` / `StepLR` values when `scheduler.step()` follows
//!   `optimizer.step()`. The graph outputs it as `lr`.
//! - Clipping ([`clip_grad_norm`]) is `torch.nn.utils.clip_grad_norm_(params, max_norm)` with
//!   norm type 2: the total norm of every gradient, the coefficient
//!   `min(max_norm / (total + 1e-6), 1)`, every gradient multiplied by it. The graph outputs the
//!   total norm before clipping as `grad_norm`.
//!
//! Invariant: every node made here is named [`UPDATE_PREFIX`]`…`, so that passes splitting a step
//! into microbatches run it once per step, on the gradients summed over the microbatches
//! ([`runs_once_per_step`]).

use std::collections::BTreeMap;

use crate::graph::{Graph, Value};
use crate::op::{BinaryOp, Op, ReduceOp, UnaryOp};
use crate::tensor::{DType, Tensor, TensorMeta};

use super::AutodiffError;

/// The prefix of the names of the nodes that run once per training step, after the gradients of
/// every microbatch are summed: the optimizer's updates, its step counter, the learning-rate
/// schedule and gradient clipping.
pub const UPDATE_PREFIX: &str = "update/";

/// Whether a node of a training graph, by its name, runs once per step on the summed gradients
/// (see [`UPDATE_PREFIX`]).
pub fn runs_once_per_step(name: &str) -> bool {
    name.starts_with(UPDATE_PREFIX)
}

/// The state counting SGD's steps when a schedule needs it (i64; AdamW has its own,
/// `adamw/step`). Optimizer state: checkpoints keep it.
pub const SGD_STEP_STATE: &str = "sgd/step";

/// The epsilon `clip_grad_norm_` adds to the total norm.
pub const CLIP_EPSILON: f32 = 1e-6;

/// How the learning rate decays after the warmup.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum LrDecay {
    /// The base learning rate (factor 1).
    #[default]
    Constant,
    /// `CosineAnnealingLR(T_max = steps, eta_min = min_lr)`'s closed form,
    /// `min_lr + (lr - min_lr) (1 + cos(pi k / steps)) / 2` for `k <= steps`, then `min_lr`.
    Cosine {
        /// Steps from the base learning rate to the floor (`T_max`), >= 1.
        steps: u64,
        /// The floor (`eta_min`), absolute, in `[0, lr]`.
        min_lr: f32,
    },
    /// `StepLR(step_size, gamma)`: `lr * gamma^floor(k / step_size)`.
    Step {
        /// Steps between decays, >= 1.
        step_size: u64,
        /// The factor of each decay, > 0.
        gamma: f32,
    },
}

/// A learning-rate schedule: a linear warmup over `warmup_steps` (factor `(k + 1) / W` at steps
/// `k < W`, as `LambdaLR(lambda k: min(1, (k + 1) / W))`), then `decay` counted from the end of
/// the warmup (as `SequentialLR` with the milestone `W`). The default is no schedule.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LrSchedule {
    /// Warmup steps (0: none).
    pub warmup_steps: u64,
    /// The decay after the warmup.
    pub decay: LrDecay,
}

/// Largest step count a schedule takes. The counter is an i64; in f32 the step is only the
/// numerator of a ratio (`k / T`, `(k + 1) / W`), whose relative rounding does not grow with it.
const MAX_STEPS: u64 = 1 << 40;

impl LrSchedule {
    /// Whether the learning rate is the base one at every step (no graph nodes, no `lr` output).
    pub fn is_constant(&self) -> bool {
        self.warmup_steps == 0 && self.decay == LrDecay::Constant
    }

    /// Why the schedule cannot run with base learning rate `lr`, if it cannot.
    pub fn check(&self, lr: f32) -> Result<(), String> {
        if self.warmup_steps > MAX_STEPS {
            return Err(format!("warmup of {} steps: at most {MAX_STEPS}", self.warmup_steps));
        }
        match self.decay {
            LrDecay::Constant => Ok(()),
            LrDecay::Cosine { steps, min_lr } => {
                if steps == 0 || steps > MAX_STEPS {
                    return Err(format!("cosine decay over {steps} steps: it takes 1 to {MAX_STEPS}"));
                }
                if !(min_lr.is_finite() && (0.0..=lr).contains(&min_lr)) {
                    return Err(format!("minimum learning rate {min_lr}: it must be in [0, lr = {lr}]"));
                }
                Ok(())
            }
            LrDecay::Step { step_size, gamma } => {
                if step_size == 0 || step_size > MAX_STEPS {
                    return Err(format!("step decay every {step_size} steps: it takes 1 to {MAX_STEPS}"));
                }
                if !(gamma.is_finite() && gamma > 0.0) {
                    return Err(format!("step decay gamma {gamma}: it must be a finite number > 0"));
                }
                Ok(())
            }
        }
    }

    /// The learning rate at step `k` (0-based) for base `lr`, in f64: the definition the graph
    /// computes in f32.
    pub fn lr_at(&self, lr: f64, k: u64) -> f64 {
        let w = self.warmup_steps;
        if k < w {
            return lr * (k + 1) as f64 / w as f64;
        }
        let k = k - w;
        match self.decay {
            LrDecay::Constant => lr,
            LrDecay::Cosine { steps, min_lr } => {
                let min = min_lr as f64;
                let c = k.min(steps) as f64;
                min + (lr - min) * (1.0 + (std::f64::consts::PI * c / steps as f64).cos()) / 2.0
            }
            LrDecay::Step { step_size, gamma } => lr * (gamma as f64).powi((k / step_size).min(i32::MAX as u64) as i32),
        }
    }
}

/// The step counter `k` for a schedule: `sgd/step` (with its increment, an update) for SGD;
/// AdamW passes its own.
pub(super) fn sgd_counter(g: &mut Graph) -> Result<Value, AutodiffError> {
    let s = g.state(SGD_STEP_STATE, TensorMeta::new(DType::I64, []));
    let one = g.constant("update/sgd_step.one", Tensor::i64([], vec![1]));
    let s1 = g.add1("update/sgd_step", Op::Binary(BinaryOp::Add), &[s, one])?;
    g.updates.push((s.node, s1));
    Ok(s)
}

/// The f32 factor of the learning rate at step `k` (an i64 scalar, 0 at the first step), and the
/// learning rate itself (`lr * factor`, the graph's `lr` output).
pub(super) fn lr_factor(g: &mut Graph, k: Value, s: &LrSchedule, lr: f32) -> Result<(Value, Value), AutodiffError> {
    let i64c = |g: &mut Graph, name: &str, x: u64| g.constant(name, Tensor::i64([], vec![x as i64]));
    let f32c = |g: &mut Graph, name: &str, x: f32| g.constant(name, Tensor::scalar_f32(x));
    let bin = |g: &mut Graph, name: &str, b: BinaryOp, x: Value, y: Value| g.add1(name, Op::Binary(b), &[x, y]);
    let w = s.warmup_steps;
    // Steps counted after the warmup.
    let after = if w > 0 {
        let wc = i64c(g, "update/lr/warmup_steps", w);
        let d = bin(g, "update/lr/after_warmup", BinaryOp::Sub, k, wc)?;
        let zero = i64c(g, "update/lr/zero", 0);
        bin(g, "update/lr/after_warmup.clamped", BinaryOp::Max, d, zero)?
    } else {
        k
    };
    let decay = match s.decay {
        LrDecay::Constant => None,
        LrDecay::Cosine { steps, min_lr } => {
            // min + (1 - min) (1 + cos(pi c / T)) / 2 with c = min(k', T), as factors of lr.
            let t = i64c(g, "update/lr/cosine_steps", steps);
            let c = bin(g, "update/lr/cosine_step", BinaryOp::Min, after, t)?;
            let cf = g.add1("update/lr/cosine_step.f32", Op::Cast { to: DType::F32 }, &[c])?;
            let scale = f32c(g, "update/lr/pi_over_steps", (std::f64::consts::PI / steps as f64) as f32);
            let x = bin(g, "update/lr/cosine_angle", BinaryOp::Mul, cf, scale)?;
            let cos = g.add1("update/lr/cos", Op::Unary(UnaryOp::Cos), &[x])?;
            let floor = if lr > 0.0 { (min_lr as f64 / lr as f64) as f32 } else { 0.0 };
            let one = f32c(g, "update/lr/one", 1.0);
            let up = bin(g, "update/lr/cos_plus_one", BinaryOp::Add, cos, one)?;
            let half = f32c(g, "update/lr/half_range", ((1.0 - floor as f64) / 2.0) as f32);
            let part = bin(g, "update/lr/cosine_part", BinaryOp::Mul, up, half)?;
            let fc = f32c(g, "update/lr/floor", floor);
            Some(bin(g, "update/lr/cosine", BinaryOp::Add, part, fc)?)
        }
        LrDecay::Step { step_size, gamma } => {
            let size = i64c(g, "update/lr/step_size", step_size);
            let n = bin(g, "update/lr/decays", BinaryOp::Div, after, size)?;
            let nf = g.add1("update/lr/decays.f32", Op::Cast { to: DType::F32 }, &[n])?;
            let gc = f32c(g, "update/lr/gamma", gamma);
            Some(bin(g, "update/lr/step_decay", BinaryOp::Pow, gc, nf)?)
        }
    };
    let factor = if w > 0 {
        // (k + 1) / W while k < W.
        let kf = g.add1("update/lr/step.f32", Op::Cast { to: DType::F32 }, &[k])?;
        let one = f32c(g, "update/lr/warmup_one", 1.0);
        let k1 = bin(g, "update/lr/step_plus_one", BinaryOp::Add, kf, one)?;
        let wf = f32c(g, "update/lr/warmup_steps.f32", w as f32);
        let ramp = bin(g, "update/lr/warmup", BinaryOp::Div, k1, wf)?;
        let wc = i64c(g, "update/lr/warmup_end", w);
        let warming = bin(g, "update/lr/warming_up", BinaryOp::Less, k, wc)?;
        let rest = match decay {
            Some(d) => d,
            None => f32c(g, "update/lr/constant", 1.0),
        };
        g.add1("update/lr/factor", Op::Where, &[warming, ramp, rest])?
    } else {
        decay.ok_or_else(|| AutodiffError::Options("a constant schedule has no factor (caller bug)".into()))?
    };
    let base = f32c(g, "update/lr/base", lr);
    let lr_value = bin(g, "update/lr", BinaryOp::Mul, base, factor)?;
    Ok((factor, lr_value))
}

/// `clip_grad_norm_(max_norm)` over `grads` (see the module docs): the clipped gradients (f32)
/// and the total norm before clipping (an f32 scalar).
pub(super) fn clip_grad_norm(
    g: &mut Graph,
    grads: &BTreeMap<String, Value>,
    max_norm: f32,
) -> Result<(BTreeMap<String, Value>, Value), AutodiffError> {
    let mut wide = BTreeMap::new();
    let mut total: Option<Value> = None;
    for (name, &v) in grads {
        // Gradients kept in 16 bits are widened after their sum over microbatches and ranks.
        let v32 = if g.meta(v).dtype == DType::F32 {
            v
        } else {
            g.add1(&format!("update/clip/{name}/f32"), Op::Cast { to: DType::F32 }, &[v])?
        };
        let sq = g.add1(&format!("update/clip/{name}/square"), Op::Binary(BinaryOp::Mul), &[v32, v32])?;
        let axes: Vec<usize> = (0..g.meta(sq).rank()).collect();
        let s = if axes.is_empty() {
            sq
        } else {
            let r = Op::Reduce { op: ReduceOp::Sum, axes, keepdims: false };
            g.add1(&format!("update/clip/{name}/sum_of_squares"), r, &[sq])?
        };
        total = Some(match total {
            None => s,
            Some(t) => g.add1("update/clip/sum_of_squares", Op::Binary(BinaryOp::Add), &[t, s])?,
        });
        wide.insert(name.clone(), v32);
    }
    let total = total.ok_or_else(|| AutodiffError::Options("clipping needs a gradient (caller bug)".into()))?;
    let norm = g.add1("update/clip/norm", Op::Unary(UnaryOp::Sqrt), &[total])?;
    let eps = g.constant("update/clip/epsilon", Tensor::scalar_f32(CLIP_EPSILON));
    let den = g.add1("update/clip/norm_plus_epsilon", Op::Binary(BinaryOp::Add), &[norm, eps])?;
    let max = g.constant("update/clip/max_norm", Tensor::scalar_f32(max_norm));
    let coef = g.add1("update/clip/coef", Op::Binary(BinaryOp::Div), &[max, den])?;
    let one = g.constant("update/clip/one", Tensor::scalar_f32(1.0));
    let coef = g.add1("update/clip/coef_clamped", Op::Binary(BinaryOp::Min), &[coef, one])?;
    let mut clipped = BTreeMap::new();
    for (name, v) in wide {
        clipped.insert(name.clone(), g.add1(&format!("update/clip/{name}"), Op::Binary(BinaryOp::Mul), &[v, coef])?);
    }
    Ok((clipped, norm))
}
