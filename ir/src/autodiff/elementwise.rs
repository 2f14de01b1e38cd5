//! Gradients of the elementwise family (`vjp` dispatches here).

use super::*;

/// Input gradients of a single-output elementwise op `op` (node `n`) given its output gradient `dy`,
/// written into `out` (one entry per input; entries of inputs with `want[i] == false` may stay
/// `None`).
pub(super) fn vjp(
    b: &mut Builder,
    n: NodeIndex,
    op: Op,
    ins: &[Value],
    dy: Value,
    want: &[bool],
    out: &mut [Option<Value>],
) -> Result<(), AutodiffError> {
    let y = Value::new(n, 0);
    let w = |i: usize| want.get(i).copied().unwrap_or(false);
    let sh = |b: &Builder, i: usize| b.shape(ins[i]);
    match op {
        Op::Identity => out[0] = Some(dy),
        // A cast between float types passes the gradient back in the input's type.
        Op::Cast { to } if to.is_float() && b.g.meta(ins[0]).dtype.is_float() => {
            let from = b.g.meta(ins[0]).dtype;
            out[0] = Some(if from == to { dy } else { b.op("dx", Op::Cast { to: from }, &[dy])? });
        }
        Op::Cast { .. } => {}
        Op::Unary(UnaryOp::Neg) => out[0] = Some(b.neg("dx", dy)?),
        Op::Unary(u) if unary_differentiable(u) => {
            let from = if unary_grad_from_output(u) { y } else { ins[0] };
            out[0] = Some(b.op("dx", Op::UnaryGrad(u), &[from, dy])?)
        }
        Op::Unary(_) => {}
        Op::Binary(op) => {
            let (a, c) = (ins[0], ins[1]);
            let (sa, sc) = (sh(b, 0), sh(b, 1));
            match op {
                BinaryOp::Add => {
                    if w(0) {
                        out[0] = Some(b.sum_to("da", dy, &sa)?);
                    }
                    if w(1) {
                        out[1] = Some(b.sum_to("db", dy, &sc)?);
                    }
                }
                BinaryOp::Sub => {
                    if w(0) {
                        out[0] = Some(b.sum_to("da", dy, &sa)?);
                    }
                    if w(1) {
                        let s = b.sum_to("db.sum", dy, &sc)?;
                        out[1] = Some(b.neg("db", s)?);
                    }
                }
                BinaryOp::Mul if a == c => {
                    // x * x: one contribution, 2 x dy.
                    let t = b.mul("dx.mul", dy, a)?;
                    let t = b.scale("dx.2", t, 2.0)?;
                    out[0] = Some(b.sum_to("dx", t, &sa)?);
                }
                BinaryOp::Mul => {
                    if w(0) {
                        let t = b.mul("da.mul", dy, c)?;
                        out[0] = Some(b.sum_to("da", t, &sa)?);
                    }
                    if w(1) {
                        let t = b.mul("db.mul", dy, a)?;
                        out[1] = Some(b.sum_to("db", t, &sc)?);
                    }
                }
                BinaryOp::Div => {
                    if w(0) {
                        let t = b.bin("da.div", BinaryOp::Div, dy, c)?;
                        out[0] = Some(b.sum_to("da", t, &sa)?);
                    }
                    if w(1) {
                        // d(a/c)/dc = -y/c
                        let t = b.mul("db.mul", dy, y)?;
                        let t = b.bin("db.div", BinaryOp::Div, t, c)?;
                        let t = b.sum_to("db.sum", t, &sc)?;
                        out[1] = Some(b.neg("db", t)?);
                    }
                }
                // PyTorch's conventions where the formulas meet 0 x inf (`pow_backward_self`,
                // `pow_backward_exponent`): the base's gradient is 0 where the exponent is 0 (not
                // 0 x a^-1, NaN at a = 0), and the exponent's is 0 where a = 0 and c >= 0 (not
                // 0 x ln 0). For a < 0 the exponent's gradient stays NaN, as in PyTorch: a^c has
                // no derivative in c there (an exporter's number read as a weight was the cause
                // in issue 50; the importer holds those as constants).
                BinaryOp::Pow => {
                    if w(0) {
                        // c * a^(c-1)
                        let one = b.scalar("da.one", 1.0, c);
                        let cm1 = b.bin("da.cm1", BinaryOp::Sub, c, one)?;
                        let p = b.bin("da.pow", BinaryOp::Pow, a, cm1)?;
                        let mut p = b.mul("da.c", p, c)?;
                        if !constant_without(b, c, |x| x == 0.0) {
                            let zero = b.scalar("da.c0", 0.0, c);
                            let c0 = b.bin("da.c.is0", BinaryOp::Equal, c, zero)?;
                            p = b.mask("da.c.where", c0, p, false)?;
                        }
                        let t = b.mul("da.mul", dy, p)?;
                        out[0] = Some(b.sum_to("da", t, &sa)?);
                    }
                    if w(1) {
                        // y * ln(a), 0 where a = 0 and c >= 0
                        let l = b.op("db.log", Op::Unary(UnaryOp::Log), &[a])?;
                        let t = b.mul("db.y", y, l)?;
                        let zero = b.scalar("db.0", 0.0, a);
                        let a0 = b.bin("db.a.is0", BinaryOp::Equal, a, zero)?;
                        let zero = b.scalar("db.c0", 0.0, c);
                        let cpos = b.bin("db.c.ge0", BinaryOp::GreaterOrEqual, c, zero)?;
                        let both = b.bin("db.a0.c.ge0", BinaryOp::And, a0, cpos)?;
                        let t = b.mask("db.where", both, t, false)?;
                        let t = b.mul("db.mul", dy, t)?;
                        out[1] = Some(b.sum_to("db", t, &sc)?);
                    }
                }
                BinaryOp::PRelu => activation::prelu_vjp(b, a, c, dy, [w(0), w(1)], out)?,
                BinaryOp::Max | BinaryOp::Min => {
                    // The first operand wins ties.
                    let cmp = if op == BinaryOp::Max { BinaryOp::GreaterOrEqual } else { BinaryOp::LessOrEqual };
                    let m = b.bin("mask", cmp, a, c)?;
                    if w(0) {
                        let t = b.mask("da.where", m, dy, true)?;
                        out[0] = Some(b.sum_to("da", t, &sa)?);
                    }
                    if w(1) {
                        let t = b.mask("db.where", m, dy, false)?;
                        out[1] = Some(b.sum_to("db", t, &sc)?);
                    }
                }
                // No gradient flows through comparisons, logic, bitwise ops and remainders
                // ([`super::differentiable`] keeps them off gradient paths). Listed one by one
                // (no wildcard), so a new binary op decides its gradient here.
                BinaryOp::Equal
                | BinaryOp::Less
                | BinaryOp::LessOrEqual
                | BinaryOp::Greater
                | BinaryOp::GreaterOrEqual
                | BinaryOp::And
                | BinaryOp::Or
                | BinaryOp::Xor
                | BinaryOp::BitwiseAnd
                | BinaryOp::BitwiseOr
                | BinaryOp::BitwiseXor
                | BinaryOp::Mod
                | BinaryOp::Fmod => {}
            }
        }
        Op::Where => {
            let c = ins[0];
            if w(1) {
                let t = b.mask("da.where", c, dy, true)?;
                let s = sh(b, 1);
                out[1] = Some(b.sum_to("da", t, &s)?);
            }
            if w(2) {
                let t = b.mask("db.where", c, dy, false)?;
                let s = sh(b, 2);
                out[2] = Some(b.sum_to("db", t, &s)?);
            }
        }
        // `super::vjp` sends only the ops above here.
        _ => return Err(no_rule(b, n)),
    }
    Ok(())
}

/// True when `v` is a constant none of whose elements satisfies `bad` (so a mask for them is not
/// needed).
fn constant_without(b: &Builder, v: Value, bad: impl Fn(f32) -> bool) -> bool {
    match &b.g.node(v.node).op {
        Op::Constant(t) if t.dtype().is_float() => !t.to_f32_vec().iter().any(|&x| bad(x)),
        _ => false,
    }
}

/// The gradient of a training-mode dropout: with its mask fixed it is linear, `dx = dy · keep /
/// (1 - ratio)`, which is the same dropout (same `id`, no mask output) on `dy`. Run in the same
/// step and microbatch over a tensor of the same global shape, it draws the forward's mask again
/// (`crate::ops::random`) instead of keeping it. The mask output has no gradient.
pub(super) fn dropout_vjp(
    b: &mut Builder,
    a: crate::DropoutAttrs,
    dy: Option<Value>,
) -> Result<Option<Value>, AutodiffError> {
    let Some(dy) = dy else { return Ok(None) };
    Ok(Some(b.op("dx", Op::Dropout(crate::DropoutAttrs { mask: false, ..a }), &[dy])?))
}
