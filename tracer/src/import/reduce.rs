//! Import of the `Reduce*` ops (axes as an attribute or, from opset 13/18, an input).

use super::*;

impl Importer<'_> {
    /// The reduce family's arms of [`Importer::translate`].
    pub(super) fn translate_reduce(&mut self, n: &N, op_type: &str) -> Result<Vec<Option<V>>, String> {
        let nm = n.name.clone();
        let one = |v: V| Ok(vec![Some(v)]);
        match op_type {
            "ReduceSum" | "ReduceMean" | "ReduceMax" | "ReduceMin" | "ReduceProd" | "ReduceSumSquare" | "ReduceL1"
            | "ReduceL2" | "ReduceLogSum" | "ReduceLogSumExp" => {
                let r = match op_type {
                    "ReduceSum" => ReduceOp::Sum,
                    "ReduceMean" => ReduceOp::Mean,
                    "ReduceMax" => ReduceOp::Max,
                    "ReduceMin" => ReduceOp::Min,
                    "ReduceProd" => ReduceOp::Prod,
                    "ReduceSumSquare" => ReduceOp::SumSquare,
                    "ReduceL1" => ReduceOp::L1,
                    "ReduceL2" => ReduceOp::L2,
                    "ReduceLogSum" => ReduceOp::LogSum,
                    _ => ReduceOp::LogSumExp,
                };
                let x = self.need(n, 0)?;
                let rank = self.meta(&x).rank();
                let axes_as_input = self.opset >= 18 || (op_type == "ReduceSum" && self.opset >= 13);
                let axes = if axes_as_input { self.const_ints(n, 1, "axes")? } else { n.ints("axes") };
                let mut axes = match axes {
                    Some(a) if !a.is_empty() => a.iter().map(|&a| norm_axis(a, rank)).collect::<Result<Vec<_>, _>>()?,
                    _ if n.int("noop_with_empty_axes", 0) != 0 => return one(x),
                    _ => (0..rank).collect(),
                };
                axes.sort();
                axes.dedup();
                one(self.emit1(&nm, Op::Reduce { op: r, axes, keepdims: n.int("keepdims", 1) != 0 }, &[x])?)
            }
            other => Err(format!("{other} is not a reduce op (importer bug)")),
        }
    }
}
