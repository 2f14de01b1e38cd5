//! Gradients of the reduce family (`vjp` dispatches here).

use super::*;

/// Input gradients of a single-output reduce op `op` (node `n`) given its output gradient `dy`,
/// written into `out` (one entry per input; entries of inputs with `want[i] == false` may stay
/// `None`).
pub(super) fn vjp(
    b: &mut Builder,
    n: NodeIndex,
    op: Op,
    ins: &[Value],
    dy: Value,
    _want: &[bool],
    out: &mut [Option<Value>],
) -> Result<(), AutodiffError> {
    let y = Value::new(n, 0);
    let sh = |b: &Builder, i: usize| b.shape(ins[i]);
    match op {
        Op::Reduce { op: r, axes, .. } => {
            let x = ins[0];
            let shape = sh(b, 0);
            let kept = reduced_shape(&shape, &axes, true);
            let dyk = b.reshape("dy.keep", dy, &kept)?;
            let count: usize = axes.iter().map(|&a| shape[a]).product();
            let local = match r {
                ReduceOp::Sum => dyk,
                ReduceOp::Mean => b.scale("dx.mean", dyk, 1.0 / count.max(1) as f32)?,
                ReduceOp::Max | ReduceOp::Min => {
                    let yk = b.reshape("y.keep", y, &kept)?;
                    let m = b.bin("mask", BinaryOp::Equal, x, yk)?;
                    b.mask("dx.where", m, dyk, true)?
                }
                ReduceOp::Prod => {
                    let yk = b.reshape("y.keep", y, &kept)?;
                    let t = b.bin("dx.div", BinaryOp::Div, yk, x)?;
                    b.mul("dx.mul", t, dyk)?
                }
                ReduceOp::SumSquare => {
                    let t = b.scale("dx.2x", x, 2.0)?;
                    b.mul("dx.mul", t, dyk)?
                }
                ReduceOp::L2 => {
                    let yk = b.reshape("y.keep", y, &kept)?;
                    let t = b.bin("dx.div", BinaryOp::Div, x, yk)?;
                    b.mul("dx.mul", t, dyk)?
                }
                ReduceOp::L1 => {
                    let s = b.op("dx.sign", Op::Unary(UnaryOp::Sign), &[x])?;
                    b.mul("dx.mul", s, dyk)?
                }
                ReduceOp::LogSum => {
                    let yk = b.reshape("y.keep", y, &kept)?;
                    let e = b.op("dx.exp", Op::Unary(UnaryOp::Exp), &[yk])?;
                    b.bin("dx.div", BinaryOp::Div, dyk, e)?
                }
                ReduceOp::LogSumExp => {
                    let yk = b.reshape("y.keep", y, &kept)?;
                    let d = b.bin("dx.sub", BinaryOp::Sub, x, yk)?;
                    let e = b.op("dx.exp", Op::Unary(UnaryOp::Exp), &[d])?;
                    b.mul("dx.mul", e, dyk)?
                }
            };
            out[0] = Some(b.expand("dx", local, &shape)?);
        }
        _ => return Err(no_rule(b, n)),
    }
    Ok(())
}
