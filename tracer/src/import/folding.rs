//! The importer's hooks into [`crate::fold`] (tract's evaluator) and exact casts of constants.

use std::rc::Rc;

use ir::{DType, Op, Tensor, TensorMeta};

use super::{Importer, N, V};
use crate::ImportError;
use crate::proto::dtype_name;

/// Ops never folded even with constant inputs: their value is not a function of their inputs
/// (random ops; training-mode `Dropout` depends on the step, and inference-mode `Dropout` is
/// an identity the importer resolves itself).
const NOT_FOLDABLE: &[&str] =
    &["RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli", "Dropout"];

impl Importer<'_> {
    /// The value of each input slot of `n` (`None` for an omitted one), when every input is
    /// known at import; `Ok(None)` when one is computed from graph inputs or is a trainable
    /// parameter (float initializers are never folded), or is not a tensor.
    fn known_inputs(&mut self, n: &N) -> Result<Option<Vec<Option<Rc<Tensor>>>>, String> {
        let mut out = Vec::with_capacity(n.node.input.len());
        for s in &n.node.input {
            if s.is_empty() {
                out.push(None);
                continue;
            }
            let t = match self.vals.get(s) {
                Some(V::C(t)) => t.clone(),
                Some(V::G(_)) => return Ok(None),
                None => match self.inits.get(s.as_str()) {
                    Some(t) if crate::dtype::is_float(t.data_type) => return Ok(None),
                    Some(_) => match self.val(s)? {
                        V::C(t) => t,
                        V::G(_) => return Ok(None),
                    },
                    // Undefined, or a sequence: the ordinary path reports it.
                    None => return Ok(None),
                },
            };
            out.push(Some(t));
        }
        let foldable = out.iter().any(Option::is_some) && !NOT_FOLDABLE.contains(&n.node.op_type.as_str());
        Ok(foldable.then_some(out))
    }

    /// Evaluates `n` on tract with known inputs.
    fn fold_known(&self, n: &N, ins: &[Option<Rc<Tensor>>]) -> Result<Vec<Option<V>>, String> {
        let refs: Vec<Option<&Tensor>> = ins.iter().map(|t| t.as_deref()).collect();
        let outs = crate::fold::evaluate(n.node, &refs, self.opset, self.max_constant_bytes)?;
        tracing::debug!(node = %n.name, op = %n.node.op_type, "folded at import through tract");
        Ok(outs.into_iter().map(|t| t.map(|t| V::C(Rc::new(t)))).collect())
    }

    /// A node of an op autopar has no translation for: its outputs as constants when every input
    /// is known (`Ok(None)` when one is not: the op is then unsupported). A fold that fails (an op
    /// tract lacks too, a result over `--max-constant-bytes`) is an error naming the node.
    pub(super) fn fold_unsupported(&mut self, n: &N) -> Result<Option<Vec<Option<V>>>, ImportError> {
        let err =
            |message: String| ImportError::Node { node: n.name.clone(), op_type: n.node.op_type.clone(), message };
        let Some(ins) = self.known_inputs(n).map_err(err)? else { return Ok(None) };
        let domain = if n.node.domain.is_empty() { String::new() } else { format!(" (domain {})", n.node.domain) };
        self.fold_known(n, &ins).map(Some).map_err(|m| {
            err(format!(
                "op {}{domain} is not supported; its inputs are all constants, but folding it at import failed: {m}",
                n.node.op_type
            ))
        })
    }

    /// `Cast(to = code)` of `x`, held as `to`: exact on constants (wrapping to narrow integer
    /// types, rounding to half precision: [`crate::dtype::cast_constant`]); on computed values the
    /// cast to the held type, with a warning where that skips a rounding to half precision.
    pub(super) fn cast(&mut self, name: &str, x: V, code: i32, to: DType) -> Result<V, String> {
        if let V::C(t) = &x {
            self.constant_fits(&TensorMeta::new(to, t.shape().to_vec()))?;
            return Ok(V::C(Rc::new(crate::dtype::cast_constant(t, code)?)));
        }
        if crate::dtype::cast_loses_rounding(code) {
            tracing::warn!(
                node = name,
                "Cast to {} of a computed value keeps f32 precision (autopar does not round to half precision)",
                dtype_name(code)
            );
        }
        if self.meta(&x).dtype == to {
            return Ok(x);
        }
        self.emit1(name, Op::Cast { to }, &[x])
    }
}
