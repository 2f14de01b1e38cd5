//! Where parameter values come from, block by block: a [`ParamSource`] gives the block of a
//! parameter a rank holds, and a [`ModelParams`] is a model file's stored parameters. The
//! traits live here, below every crate that implements or reads them: `tracer` reads ONNX
//! files' initializers, `runtime` seeds and combines sources and reads them into ranks.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::{Tensor, TensorMeta};

/// Where a rank's parameter blocks come from.
pub trait ParamSource: Sync {
    /// The block of parameter `name` (global `meta`) at `offsets` with shape `size`, or `None`
    /// when the source has no data for it.
    fn block(&self, name: &str, meta: &TensorMeta, offsets: &[usize], size: &[usize])
    -> Result<Option<Tensor>, String>;
}

/// Whole tensors in memory (tests, single-process runs of small models).
impl ParamSource for BTreeMap<String, Tensor> {
    fn block(
        &self,
        name: &str,
        meta: &TensorMeta,
        offsets: &[usize],
        size: &[usize],
    ) -> Result<Option<Tensor>, String> {
        match self.get(name) {
            // The offsets come from a plan: a block outside the tensor is an error, not a panic.
            Some(t) if &t.meta() == meta => t.block(offsets, size).map(Some).ok_or_else(|| {
                format!(
                    "parameter {name}: a block of {size:?} at {offsets:?} does not lie inside shape {:?}",
                    t.shape()
                )
            }),
            Some(t) => Err(format!("parameter {name} is {} but the plan needs {meta}", t.meta())),
            None => Ok(None),
        }
    }
}

/// A model file's stored parameters (`autopar run --init model`): blocks as a [`ParamSource`],
/// and what a launcher checks before reading them.
pub trait ModelParams: ParamSource {
    /// Whether the file holds data for parameter `name`.
    fn has(&self, name: &str) -> bool;
    /// The external data file that should hold `name`'s data, when that file is missing.
    fn absent_file(&self, name: &str) -> Option<&Path>;
    /// The external data files the model refers to (hashed with it).
    fn external_files(&self) -> Vec<PathBuf>;
}
