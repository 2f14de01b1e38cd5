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
                    // The elements equal to the result share its gradient evenly (PyTorch's
                    // `amax`/`amin`): a row of ties, such as a row every mask set to
                    // finfo.min, passes dy on once, not once per element.
                    let yk = b.reshape("y.keep", y, &kept)?;
                    let m = b.bin("mask", BinaryOp::Equal, x, yk)?;
                    let dt = b.g.meta(x).dtype;
                    let mf = b.op("mask.float", Op::Cast { to: dt }, &[m])?;
                    let ties = b.reduce_sum("ties", mf, axes.clone(), true)?;
                    let share = b.bin("dy.share", BinaryOp::Div, dyk, ties)?;
                    b.mask("dx.where", m, share, true)?
                }
                ReduceOp::Prod => {
                    // d/dx_i = the product of the others: y / x_i where x_i != 0; where x_i = 0,
                    // the product of the nonzero others if x_i is the only zero, else 0 (as
                    // PyTorch's `prod_backward`; y / x_i would be 0 / 0 there).
                    let yk = b.reshape("y.keep", y, &kept)?;
                    let q = b.bin("dx.div", BinaryOp::Div, yk, x)?;
                    let zero = b.scalar("zero", 0.0, x);
                    let one = b.scalar("one", 1.0, x);
                    let z = b.bin("x.is0", BinaryOp::Equal, x, zero)?;
                    let nz = b.op("x.nonzero", Op::Where, &[z, one, x])?;
                    let pnz = b.op(
                        "prod.nonzero",
                        Op::Reduce { op: ReduceOp::Prod, axes: axes.clone(), keepdims: true },
                        &[nz],
                    )?;
                    let dt = b.g.meta(x).dtype;
                    let zf = b.op("x.is0.float", Op::Cast { to: dt }, &[z])?;
                    let zeros = b.reduce_sum("zeros", zf, axes.clone(), true)?;
                    let only = b.bin("one.zero", BinaryOp::Equal, zeros, one)?;
                    let at0 = b.mask("at.zero", only, pnz, true)?;
                    let t = b.op("dx.others", Op::Where, &[z, at0, q])?;
                    b.mul("dx.mul", t, dyk)?
                }
                ReduceOp::SumSquare => {
                    let t = b.scale("dx.2x", x, 2.0)?;
                    b.mul("dx.mul", t, dyk)?
                }
                ReduceOp::L2 => {
                    // x / |x|, and 0 where the norm is 0 (PyTorch's `norm_backward`; not 0 / 0).
                    let yk = b.reshape("y.keep", y, &kept)?;
                    let t = b.bin("dx.div", BinaryOp::Div, x, yk)?;
                    let zero = b.scalar("zero", 0.0, x);
                    let y0 = b.bin("y.is0", BinaryOp::Equal, yk, zero)?;
                    let t = b.mask("dx.where", y0, t, false)?;
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
        // `super::vjp` sends only the ops above here.
        _ => return Err(no_rule(b, n)),
    }
    Ok(())
}
