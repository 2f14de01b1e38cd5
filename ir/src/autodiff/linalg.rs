//! Gradients of the linalg family (`vjp` dispatches here).

use super::*;

/// Input gradients of a single-output linalg op `op` (node `n`) given its output gradient `dy`,
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
    let k = ins.len();
    let w = |i: usize| want.get(i).copied().unwrap_or(false);
    let sh = |b: &Builder, i: usize| b.shape(ins[i]);
    match op {
        Op::MatMul => {
            let (da, db) = matmul_vjp(b, ins[0], ins[1], dy, w(0), w(1))?;
            out[0] = da;
            out[1] = db;
        }
        Op::Gemm { alpha, beta, trans_a, trans_b } => {
            let (a, bb) = (ins[0], ins[1]);
            let gemm = |alpha, ta, tb| Op::Gemm { alpha, beta: 0.0, trans_a: ta, trans_b: tb };
            if w(0) {
                out[0] = Some(if trans_a {
                    b.op("da", gemm(alpha, trans_b, true), &[bb, dy])?
                } else {
                    b.op("da", gemm(alpha, false, !trans_b), &[dy, bb])?
                });
            }
            if w(1) {
                out[1] = Some(if trans_b {
                    b.op("db", gemm(alpha, true, trans_a), &[dy, a])?
                } else {
                    b.op("db", gemm(alpha, !trans_a, false), &[a, dy])?
                });
            }
            if k > 2 && w(2) {
                let s = sh(b, 2);
                let t = b.sum_to("dc.sum", dy, &s)?;
                out[2] = Some(b.scale("dc", t, beta)?);
            }
        }
        // `super::vjp` sends only the ops above here.
        _ => return Err(no_rule(b, n)),
    }
    Ok(())
}
