//! Small rules on tensor values shared by the single-device and distributed paths.

use ir::{DType, Tensor};

/// True when data of `from` is taken, widened, where `to` is expected: f32 weights and feed files
/// for a graph made f64 (`--precision f64`). Never the reverse: an f64 file for an f32 model is a
/// mismatch, not a silent rounding.
pub(crate) fn widens(from: DType, to: DType) -> bool {
    from == DType::F32 && to == DType::F64
}

/// The first element of a float scalar (the loss) as f32; NaN for anything else.
pub fn scalar_f32(t: &Tensor) -> f32 {
    match t.data() {
        ir::Data::F32(v) => v.first().copied().unwrap_or(f32::NAN),
        ir::Data::F64(v) => v.first().map(|&x| x as f32).unwrap_or(f32::NAN),
        _ => f32::NAN,
    }
}
