//! Training-mode dropout on the CPU: the keep bits of [`crate::random`], a row of the block at a
//! time (split over the pool when large), applied to f32, f64, bf16 or f16 data.

use super::{CpuContext, tensor};
use crate::Error;
use crate::random::Draw;
use ir::{Data, DropoutAttrs, Op, Tensor, TensorMeta};

const OP: &str = "dropout";

/// Dropout `a` of `x`, a block of its tensor at `draw` (see [`crate::random`]): `x · keep /
/// (1 - ratio)` and, with `a.mask`, the keep bits. Without a draw (inference, evaluation) or at
/// ratio 0 nothing is dropped: `x` itself and an all-true mask.
pub fn dropout(ctx: &CpuContext, a: &DropoutAttrs, x: &Tensor, draw: Option<&Draw>) -> Result<Vec<Tensor>, Error> {
    let op = Op::Dropout(*a);
    let outs = op.infer(&[x.meta()]).map_err(|message| Error::BadInput { op: OP, message })?;
    let keep = match draw {
        Some(d) if a.ratio > 0.0 => Some(keep_bits(ctx, a, d, x.shape())?),
        _ => None,
    };
    let y = match &keep {
        None => x.clone(),
        Some(k) => apply(x, k, a.scale())?,
    };
    let mut result = vec![y];
    if a.mask {
        let bits = keep.unwrap_or_else(|| vec![true; x.numel()]);
        result.push(tensor(OP, x.shape(), Data::Bool(bits))?);
    }
    debug_assert_eq!(result.iter().map(Tensor::meta).collect::<Vec<TensorMeta>>(), outs);
    Ok(result)
}

/// The keep bit of every element of a block of `shape` at `draw`, in row-major order.
pub fn keep_bits(ctx: &CpuContext, a: &DropoutAttrs, draw: &Draw, shape: &[usize]) -> Result<Vec<bool>, Error> {
    let layout = draw.layout(a, shape).map_err(|message| Error::BadInput { op: OP, message })?;
    let n: usize = shape.iter().product();
    let mut keep = vec![false; n];
    // Each element costs about a quarter of a Philox block: weigh the rows accordingly.
    ctx.for_rows_weighted(&mut keep, layout.row_len(), 4, |r, row| layout.fill_row(r, row));
    Ok(keep)
}

/// `x` with the dropped elements zero and the kept ones scaled by `scale` (in the element type;
/// 16-bit types computed in f32 and rounded once).
fn apply(x: &Tensor, keep: &[bool], scale: f64) -> Result<Tensor, Error> {
    let data = match x.data() {
        Data::F32(v) => {
            let s = scale as f32;
            Data::F32(v.iter().zip(keep).map(|(&x, &k)| if k { x * s } else { 0.0 }).collect())
        }
        Data::F64(v) => Data::F64(v.iter().zip(keep).map(|(&x, &k)| if k { x * scale } else { 0.0 }).collect()),
        Data::BF16(v) => {
            let s = scale as f32;
            let f = |x: ir::half::bf16, k: bool| ir::half::bf16::from_f32(if k { x.to_f32() * s } else { 0.0 });
            Data::BF16(v.iter().zip(keep).map(|(&x, &k)| f(x, k)).collect())
        }
        Data::F16(v) => {
            let s = scale as f32;
            let f = |x: ir::half::f16, k: bool| ir::half::f16::from_f32(if k { x.to_f32() * s } else { 0.0 });
            Data::F16(v.iter().zip(keep).map(|(&x, &k)| f(x, k)).collect())
        }
        d => {
            return Err(Error::BadInput {
                op: OP,
                message: format!("input must be a float tensor, got {}", d.dtype()),
            });
        }
    };
    tensor(OP, x.shape(), data)
}
