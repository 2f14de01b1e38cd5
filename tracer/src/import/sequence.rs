//! Tensor sequences whose structure is static, eliminated at import.
//!
//! The dynamo exporter splits tensors into sequences (`SplitToSequence`, read back by
//! `SequenceAt` with a constant position, often inside an inlined `aten_getitem` function).
//! autopar has no sequence values: a sequence is tracked at import as the list of its tensors
//! (each a graph value or a constant), and every sequence op becomes the tensor ops it stands for
//! (`Split`, `Concat`, reshapes) or plain bookkeeping (`SequenceAt`, `SequenceInsert`, ...).
//! Positions must be constants (after folding); a sequence that reaches a graph output or an op
//! other than these is an error naming the node.

use std::rc::Rc;

use ir::{Op, Tensor};

use super::{Importer, N, V, norm_axis};
use crate::ImportError;

/// The most tensors a sequence may hold (each is a value of the imported graph; an insert copies
/// the sequence, so a chain of inserts costs the square of this).
const MAX_SEQUENCE_LEN: usize = 1 << 14;

/// The sequence ops the importer eliminates.
pub(crate) const SEQUENCE_OPS: &[&str] = &[
    "ConcatFromSequence",
    "SequenceAt",
    "SequenceConstruct",
    "SequenceEmpty",
    "SequenceErase",
    "SequenceInsert",
    "SequenceLength",
    "SplitToSequence",
];

/// What a sequence op produces.
enum Out {
    Seq(Vec<V>),
    Tensor(V),
}

impl Importer<'_> {
    /// Handles `n` when it is a sequence op (`None` otherwise): its output is defined, or the
    /// error names the node.
    pub(super) fn sequence_node(&mut self, n: &N) -> Option<Result<(), ImportError>> {
        if !SEQUENCE_OPS.contains(&n.node.op_type.as_str()) {
            return None;
        }
        let err =
            |message: String| ImportError::Node { node: n.name.clone(), op_type: n.node.op_type.clone(), message };
        Some(self.sequence_op(n).map_err(err).and_then(|out| {
            let name = n.node.output.first().filter(|s| !s.is_empty()).ok_or_else(|| err("has no output".into()))?;
            let clash = if self.inits.contains_key(name) {
                Some("an initializer".to_string())
            } else {
                self.producers.insert(name.clone(), Some(n.name.clone())).map(|p| match p {
                    Some(p) => format!("node {p}"),
                    None => "a graph input".to_string(),
                })
            };
            if let Some(other) = clash {
                return Err(err(format!("output 0 ({name}) is already defined by {other}")));
            }
            match out {
                Out::Seq(s) => {
                    self.seqs.insert(name.clone(), Rc::new(s));
                }
                Out::Tensor(v) => {
                    self.vals.insert(name.clone(), v);
                }
            }
            Ok(())
        }))
    }

    fn seq(&self, n: &N, i: usize) -> Result<Rc<Vec<V>>, String> {
        let name = n.input(i).ok_or_else(|| format!("input {i} (a sequence) is missing"))?;
        self.seqs
            .get(name)
            .cloned()
            .ok_or_else(|| format!("input {i} ({name}) is not a sequence whose structure is known at import"))
    }

    /// A constant position into a sequence of `len` (ONNX: negative counts from the end; an
    /// insertion may also name `len`).
    fn position(&mut self, n: &N, i: usize, len: usize, insert: bool) -> Result<Option<usize>, String> {
        let Some(p) = self.const_ints(n, i, "position")? else { return Ok(None) };
        let [p] = p[..] else { return Err(format!("position must be a scalar, got {p:?}")) };
        let l = len as i64;
        let q = if p < 0 { p + l } else { p };
        if q < 0 || q > l || (q == l && !insert) {
            return Err(format!("position {p} is out of range for a sequence of {len} tensors"));
        }
        Ok(Some(q as usize))
    }

    fn sequence_op(&mut self, n: &N) -> Result<Out, String> {
        let nm = n.name.clone();
        Ok(match n.node.op_type.as_str() {
            "SequenceEmpty" => Out::Seq(vec![]),
            "SequenceConstruct" => {
                Out::Seq((0..n.node.input.len()).map(|i| self.need(n, i)).collect::<Result<_, _>>()?)
            }
            "SequenceLength" => {
                let s = self.seq(n, 0)?;
                Out::Tensor(V::C(Rc::new(Tensor::i64(Vec::<usize>::new(), vec![s.len() as i64]))))
            }
            "SequenceAt" => {
                let s = self.seq(n, 0)?;
                let p = self.position(n, 1, s.len(), false)?.ok_or("position is required")?;
                Out::Tensor(s[p].clone())
            }
            "SequenceInsert" => {
                let s = self.seq(n, 0)?;
                let t = self.need(n, 1)?;
                if s.len() >= MAX_SEQUENCE_LEN {
                    return Err(format!("would make a sequence of more than {MAX_SEQUENCE_LEN} tensors"));
                }
                let p = self.position(n, 2, s.len(), true)?.unwrap_or(s.len());
                let mut s = (*s).clone();
                s.insert(p, t);
                Out::Seq(s)
            }
            "SequenceErase" => {
                let s = self.seq(n, 0)?;
                if s.is_empty() {
                    return Err("erases from an empty sequence".into());
                }
                let p = self.position(n, 1, s.len(), false)?.unwrap_or(s.len() - 1);
                let mut s = (*s).clone();
                s.remove(p);
                Out::Seq(s)
            }
            "SplitToSequence" => {
                let x = self.need(n, 0)?;
                let m = self.meta(&x);
                let axis = norm_axis(n.int("axis", 0), m.rank())?;
                let d = m.shape[axis];
                let split = self.opt(n, 1)?;
                // Each element becomes an output of one Split node: bound their number before
                // allocating (a declared dim can be huge).
                let count = |k: usize| {
                    if k > MAX_SEQUENCE_LEN {
                        Err(format!("would make a sequence of {k} tensors (more than {MAX_SEQUENCE_LEN})"))
                    } else {
                        Ok(k)
                    }
                };
                let (sizes, squeeze) = match split {
                    None => (vec![1; count(d)?], n.int("keepdims", 1) == 0),
                    Some(V::G(_)) => return Err("split must be a constant after folding".into()),
                    Some(V::C(t)) => {
                        let v = t.to_i64_vec();
                        let sizes: Vec<usize> = if t.shape().is_empty() {
                            let c =
                                usize::try_from(v[0]).ok().filter(|&c| c > 0).ok_or(format!("bad split {}", v[0]))?;
                            (0..count(d.div_ceil(c))?).map(|i| c.min(d - i * c)).collect()
                        } else {
                            count(v.len())?;
                            v.iter()
                                .map(|&s| usize::try_from(s).map_err(|_| format!("bad split {v:?}")))
                                .collect::<Result<_, _>>()?
                        };
                        if sizes.iter().sum::<usize>() != d {
                            return Err(format!("split {sizes:?} does not add up to dim {axis} of {}", m));
                        }
                        (sizes, false)
                    }
                };
                if sizes.is_empty() {
                    return Ok(Out::Seq(vec![]));
                }
                let parts = self.emit(&nm, Op::Split { axis, sizes }, &[x])?;
                if !squeeze {
                    return Ok(Out::Seq(parts));
                }
                let mut shape = m.shape.clone();
                shape.remove(axis);
                let parts = parts
                    .into_iter()
                    .enumerate()
                    .map(|(k, p)| self.emit1(&format!("{nm}.squeeze{k}"), Op::Reshape { shape: shape.clone() }, &[p]))
                    .collect::<Result<_, _>>()?;
                Out::Seq(parts)
            }
            "ConcatFromSequence" => {
                let s = self.seq(n, 0)?;
                let first = s.first().ok_or("concatenates an empty sequence")?;
                let r = self.meta(first).rank();
                let raw = n.attr("axis").ok_or("axis is required")?.i;
                let mut parts = (*s).clone();
                let axis = if n.int("new_axis", 0) != 0 {
                    // Stacking: each tensor gains a dim of 1 at `axis` (which ranges over rank + 1).
                    let axis = norm_axis(raw, r + 1)?;
                    for (k, p) in parts.iter_mut().enumerate() {
                        let mut shape = self.meta(p).shape;
                        shape.insert(axis.min(shape.len()), 1);
                        *p =
                            self.emit1(&format!("{nm}.unsqueeze{k}"), Op::Reshape { shape }, std::slice::from_ref(p))?;
                    }
                    axis
                } else {
                    norm_axis(raw, r)?
                };
                if parts.len() == 1 {
                    return Ok(Out::Tensor(parts.remove(0)));
                }
                Out::Tensor(self.emit1(&nm, Op::Concat { axis }, &parts)?)
            }
            other => return Err(format!("{other} is not a sequence op (importer bug)")),
        })
    }
}
