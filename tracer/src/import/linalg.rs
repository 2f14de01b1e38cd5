//! Import of the matrix products `MatMul` and `Gemm`.

use super::*;

impl Importer<'_> {
    /// The linalg family's arms of [`Importer::translate`].
    pub(super) fn translate_linalg(&mut self, n: &N, op_type: &str) -> Result<Vec<Option<V>>, String> {
        let nm = n.name.clone();
        let one = |v: V| Ok(vec![Some(v)]);
        match op_type {
            "MatMul" => {
                let (a, b) = (self.need(n, 0)?, self.need(n, 1)?);
                one(self.emit1(&nm, Op::MatMul, &[a, b])?)
            }
            "Gemm" => {
                let mut ins = vec![self.need(n, 0)?, self.need(n, 1)?];
                if let Some(c) = self.opt(n, 2)? {
                    ins.push(c);
                }
                let op = Op::Gemm {
                    alpha: n.float("alpha", 1.0),
                    beta: n.float("beta", 1.0),
                    trans_a: n.int("transA", 0) != 0,
                    trans_b: n.int("transB", 0) != 0,
                };
                one(self.emit1(&nm, op, &ins)?)
            }
            other => Err(format!("{other} is not a linalg op (importer bug)")),
        }
    }
}
