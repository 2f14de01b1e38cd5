//! Where a rank's parameters come from ([`ParamSource`], [`ModelParams`]: the traits are
//! `ir`'s): in-memory tensors, a seed ([`SeededInit`]), the first of several ([`FirstOf`]), or a
//! model file. The runtime reads no model format itself: the caller passes the reader
//! ([`crate::launch::Init::Model`]'s `open`; the CLI passes `tracer`'s ONNX reader).

use std::path::Path;

pub use ir::params::{ModelParams, ParamSource};
use ir::{Tensor, TensorMeta};

/// Deterministic pseudo-random initial values, a function of (seed, name, global element index)
/// only, so every mesh and every rank sees the same global tensor: rank-1 tensors named like a
/// scale (`weight`, `scale`, `gamma`) start at 1, other rank-1 tensors at 0, the rest uniform with
/// standard deviation 0.02 (GPT-2's initialisation).
#[derive(Clone, Copy, Debug)]
pub struct SeededInit {
    /// The seed.
    pub seed: u64,
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl ParamSource for SeededInit {
    fn block(
        &self,
        name: &str,
        meta: &TensorMeta,
        offsets: &[usize],
        size: &[usize],
    ) -> Result<Option<Tensor>, String> {
        let n = ir::shape::checked_numel(size).ok_or_else(|| format!("parameter {name}: a block of {size:?}"))?;
        let oom = |e: ir::AllocError| format!("parameter {name} (a block of {size:?}): {e}");
        if meta.shape.len() <= 1 {
            let lower = name.to_ascii_lowercase();
            let one = ["weight", "scale", "gamma"].iter().any(|k| lower.ends_with(k));
            let v = ir::alloc::try_filled(n, if one { 1.0 } else { 0.0 }).map_err(oom)?;
            return Ok(Some(Tensor::f32(size.to_vec(), v)));
        }
        let key = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3));
        let base = splitmix(self.seed ^ key);
        let shape = &meta.shape;
        let amp = 0.02f64 * 3f64.sqrt();
        let mut v = ir::alloc::try_vec(n).map_err(oom)?;
        let mut idx = vec![0usize; size.len()];
        for _ in 0..n {
            let flat = idx.iter().zip(offsets).zip(shape).fold(0usize, |acc, ((&i, &o), &d)| acc * d + i + o);
            let u =
                (splitmix(base ^ (flat as u64).wrapping_mul(0x2545_f491_4f6c_dd1d)) >> 11) as f64 / (1u64 << 53) as f64;
            v.push(((2.0 * u - 1.0) * amp) as f32);
            for d in (0..size.len()).rev() {
                idx[d] += 1;
                if idx[d] < size[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
        Ok(Some(Tensor::f32(size.to_vec(), v)))
    }
}

/// The first source with data for a block wins.
pub struct FirstOf<'a>(pub Vec<&'a dyn ParamSource>);

impl ParamSource for FirstOf<'_> {
    fn block(
        &self,
        name: &str,
        meta: &TensorMeta,
        offsets: &[usize],
        size: &[usize],
    ) -> Result<Option<Tensor>, String> {
        for s in &self.0 {
            if let Some(t) = s.block(name, meta, offsets, size)? {
                return Ok(Some(t));
            }
        }
        Ok(None)
    }
}

/// Opens a model file's stored parameters: the reader the caller supplies
/// ([`crate::launch::Init::Model`]).
pub type OpenModel = fn(&Path) -> Result<Box<dyn ModelParams>, String>;
