//! Scalars of the optimizer updates shared by the CPU and CUDA kernels, so both back ends
//! apply the same arithmetic.

/// The per-step scalars of an AdamW update at step `t` (PyTorch's arithmetic: bias corrections
/// in f64, then applied as scalars of the element type).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct AdamW {
    /// `1 - lr * weight_decay` (decoupled weight decay).
    pub decay: f64,
    /// `lr / (1 - beta1^t)`.
    pub step_size: f64,
    /// `sqrt(1 - beta2^t)`.
    pub bc2_sqrt: f64,
    /// `1 - beta1` (the first moment's weight of the gradient).
    pub w1: f64,
    /// `1 - beta2`.
    pub w2: f64,
}

impl AdamW {
    /// The scalars of step `t` (`t >= 1`, else the error message).
    pub fn at(lr: f64, beta1: f64, beta2: f64, weight_decay: f64, t: i64) -> Result<AdamW, String> {
        if t < 1 {
            return Err(format!("step must be >= 1, got {t}"));
        }
        let t = t.min(i32::MAX as i64) as i32;
        Ok(AdamW {
            decay: 1.0 - lr * weight_decay,
            step_size: lr / (1.0 - beta1.powi(t)),
            bc2_sqrt: (1.0 - beta2.powi(t)).sqrt(),
            w1: 1.0 - beta1,
            w2: 1.0 - beta2,
        })
    }
}
