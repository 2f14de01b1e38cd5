//! The text form of a graph: a printer and a parser that round-trip.
//!
//! ```text
//! graph "mlp" {
//!   %0 "x" = input{name="x"} : f32[2,3]
//!   %1 "w" = param{name="w"} : f32[3,4]
//!   %2 "mm" = matmul(%0, %1) : f32[2,4]
//!   %3 "parts" = split{axis=1, sizes=[2, 2]}(%2) : f32[2,2], f32[2,2]
//!   %4 "r" = relu(%3.1) : f32[2,2]
//!   output "y" = %4
//! }
//! ```
//! Nodes are numbered in topological order; `%N.k` is output `k` of node `N` (`%N` = `%N.0`).
//! Training graphs end with `update %P = %N` lines: the storage of param/state `%P` takes the
//! value `%N` after each step.
//! Parameter data is not part of the text form; constants print their elements in full (bools
//! as 0/1).

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt::Write;

use crate::graph::{Graph, Value};
use crate::op::*;
use crate::ops::index::{IndexOp, ScatterReduction};
use crate::ops::resize::{ResizeAttrs, ResizeAxis};
use crate::tensor::{DType, Data, Tensor, TensorMeta};

/// A text-form parse error with its line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {message}")]
pub struct ParseError {
    /// 1-based line number.
    pub line: usize,
    /// What is wrong.
    pub message: String,
}

/// An attribute's value; a tensor is borrowed from the op when printing (a constant can be
/// gigabytes: never copied to be printed).
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Attr<'a> {
    Int(i64),
    Float(f32),
    Bool(bool),
    Ints(Vec<i64>),
    Str(String),
    DType(DType),
    Tensor(Cow<'a, Tensor>),
}

fn fmt_f32(x: f32) -> String {
    // `{:?}` is the shortest text that parses back to the same f32, and always shows a float.
    format!("{x:?}")
}

/// How [`fmt_attr`] writes a tensor's data: as text, or as a hash of its elements' bits (for
/// [`Graph::fingerprint`], which must not print megabytes of constants).
#[derive(Clone, Copy, PartialEq)]
enum TensorData {
    Text,
    Hash,
}

/// FNV-1a's step over whole words: every element's bits, in order.
fn hash_data(d: &Data) -> u64 {
    let step = |h: u64, w: u64| (h ^ w).wrapping_mul(0x0100_0000_01b3);
    let h = 0xcbf2_9ce4_8422_2325u64;
    match d {
        Data::F32(v) => v.iter().fold(h, |h, x| step(h, x.to_bits() as u64)),
        Data::F64(v) => v.iter().fold(h, |h, x| step(h, x.to_bits())),
        Data::BF16(v) => v.iter().fold(h, |h, x| step(h, x.to_bits() as u64)),
        Data::F16(v) => v.iter().fold(h, |h, x| step(h, x.to_bits() as u64)),
        Data::I64(v) => v.iter().fold(h, |h, &x| step(h, x as u64)),
        Data::Bool(v) => v.iter().fold(h, |h, &x| step(h, x as u64)),
    }
}

fn fmt_attr(a: &Attr, out: &mut impl Write, data: TensorData) -> std::fmt::Result {
    match a {
        Attr::Tensor(t) if data == TensorData::Hash => write!(out, "{} #{:016x}", t.meta(), hash_data(t.data())),
        Attr::Int(i) => write!(out, "{i}"),
        Attr::Float(x) => out.write_str(&fmt_f32(*x)),
        Attr::Bool(b) => write!(out, "{b}"),
        Attr::Ints(v) => {
            write!(out, "[{}]", v.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(", "))
        }
        Attr::Str(s) => write!(out, "{s:?}"),
        Attr::DType(d) => out.write_str(d.name()),
        Attr::Tensor(t) => {
            // Element by element into the sink: printing a constant allocates nothing per element.
            write!(out, "{} [", t.meta())?;
            fn items<T>(
                out: &mut impl Write,
                v: &[T],
                f: impl Fn(&mut dyn Write, &T) -> std::fmt::Result,
            ) -> std::fmt::Result {
                for (i, x) in v.iter().enumerate() {
                    if i > 0 {
                        out.write_str(", ")?;
                    }
                    f(out, x)?;
                }
                Ok(())
            }
            match t.data() {
                Data::F32(v) => items(out, v, |o, x| write!(o, "{x:?}")),
                Data::F64(v) => items(out, v, |o, x| write!(o, "{x:?}")),
                Data::BF16(v) => items(out, v, |o, x| write!(o, "{:?}", x.to_f32())),
                Data::F16(v) => items(out, v, |o, x| write!(o, "{:?}", x.to_f32())),
                Data::I64(v) => items(out, v, |o, x| write!(o, "{x}")),
                Data::Bool(v) => items(out, v, |o, &x| o.write_str(if x { "1" } else { "0" })),
            }?;
            out.write_char(']')
        }
    }
}

fn us(v: &[usize]) -> Attr<'static> {
    Attr::Ints(v.iter().map(|&x| x as i64).collect())
}

pub(crate) fn op_attrs(op: &Op) -> Vec<(&'static str, Attr<'_>)> {
    use Op::*;
    let pool = |a: &PoolAttrs| {
        vec![
            ("kernel", us(&a.kernel)),
            ("strides", us(&a.strides)),
            ("pads", us(&a.pads)),
            ("dilations", us(&a.dilations)),
            ("ceil_mode", Attr::Bool(a.ceil_mode)),
            ("count_include_pad", Attr::Bool(a.count_include_pad)),
        ]
    };
    match op {
        Input { name } | Param { name } => vec![("name", Attr::Str(name.clone()))],
        Constant(t) => vec![("value", Attr::Tensor(Cow::Borrowed(t)))],
        Unary(u) | UnaryGrad(u) => unary_attrs(*u),
        Binary(_) | Where | Identity | MatMul | GlobalAveragePool | GlobalMaxPool => vec![],
        Cast { to } => vec![("to", Attr::DType(*to))],
        Gemm { alpha, beta, trans_a, trans_b } => vec![
            ("alpha", Attr::Float(*alpha)),
            ("beta", Attr::Float(*beta)),
            ("trans_a", Attr::Bool(*trans_a)),
            ("trans_b", Attr::Bool(*trans_b)),
        ],
        Conv(a) => vec![
            ("strides", us(&a.strides)),
            ("pads", us(&a.pads)),
            ("dilations", us(&a.dilations)),
            ("group", Attr::Int(a.group as i64)),
        ],
        MaxPool(a) | AveragePool(a) => pool(a),
        BatchNorm { epsilon } | BatchNormTrain { epsilon } | BatchNormTrainGrad { epsilon } => {
            vec![("epsilon", Attr::Float(*epsilon))]
        }
        LayerNorm { axis, epsilon } => vec![("axis", Attr::Int(*axis as i64)), ("epsilon", Attr::Float(*epsilon))],
        Lrn { size, alpha, beta, bias } => vec![
            ("size", Attr::Int(*size as i64)),
            ("alpha", Attr::Float(*alpha)),
            ("beta", Attr::Float(*beta)),
            ("bias", Attr::Float(*bias)),
        ],
        Softmax { axis } | LogSoftmax { axis } | Concat { axis } | Gather { axis } => {
            vec![("axis", Attr::Int(*axis as i64))]
        }
        Reshape { shape } | Expand { shape } => vec![("shape", us(shape))],
        Transpose { perm } => vec![("perm", us(perm))],
        Split { axis, sizes } => vec![("axis", Attr::Int(*axis as i64)), ("sizes", us(sizes))],
        Slice { axes } => vec![("axes", slice_axes(axes))],
        Reduce { axes, keepdims, .. } => vec![("axes", us(axes)), ("keepdims", Attr::Bool(*keepdims))],
        Pad { pads, value } => vec![("pads", us(pads)), ("value", Attr::Float(*value))],
        State { name } => vec![("name", Attr::Str(name.clone()))],
        SoftmaxGrad { axis, .. } => vec![("axis", Attr::Int(*axis as i64))],
        LayerNormGrad { axis, epsilon } => {
            vec![("axis", Attr::Int(*axis as i64)), ("epsilon", Attr::Float(*epsilon))]
        }
        LrnGrad { size, alpha, beta, bias } => vec![
            ("size", Attr::Int(*size as i64)),
            ("alpha", Attr::Float(*alpha)),
            ("beta", Attr::Float(*beta)),
            ("bias", Attr::Float(*bias)),
        ],
        ConvInputGrad { attrs: a, shape } | ConvWeightGrad { attrs: a, shape } => vec![
            ("strides", us(&a.strides)),
            ("pads", us(&a.pads)),
            ("dilations", us(&a.dilations)),
            ("group", Attr::Int(a.group as i64)),
            ("shape", us(shape)),
        ],
        MaxPoolGrad(a) => pool(a),
        AveragePoolGrad { attrs, shape } => {
            let mut v = pool(attrs);
            v.push(("shape", us(shape)));
            v
        }
        GatherGrad { axis, shape } => vec![("axis", Attr::Int(*axis as i64)), ("shape", us(shape))],
        SliceGrad { axes, shape } => vec![("axes", slice_axes(axes)), ("shape", us(shape))],
        SgdUpdate { lr, momentum, weight_decay } => vec![
            ("lr", Attr::Float(*lr)),
            ("momentum", Attr::Float(*momentum)),
            ("weight_decay", Attr::Float(*weight_decay)),
        ],
        AdamWUpdate { lr, beta1, beta2, epsilon, weight_decay } => vec![
            ("lr", Attr::Float(*lr)),
            ("beta1", Attr::Float(*beta1)),
            ("beta2", Attr::Float(*beta2)),
            ("epsilon", Attr::Float(*epsilon)),
            ("weight_decay", Attr::Float(*weight_decay)),
        ],
        Resize(a) => resize_attrs(a),
        ResizeGrad { attrs, shape } => {
            let mut v = resize_attrs(attrs);
            v.push(("shape", us(shape)));
            v
        }
        Hardmax { axis } => vec![("axis", Attr::Int(*axis as i64))],
        Index(x) => index_attrs(x),
        Dropout(a) => {
            vec![("ratio", Attr::Float(a.ratio)), ("id", Attr::Int(a.id as i64)), ("mask", Attr::Bool(a.mask))]
        }
        Attention(a) | AttentionGrad(a) => vec![
            ("scale", Attr::Float(a.scale)),
            ("causal", Attr::Bool(a.causal)),
            ("offset", Attr::Int(a.offset as i64)),
            ("softcap", Attr::Float(a.softcap)),
        ],
        Moe(a) | MoeGrad(a) => vec![
            ("experts", Attr::Int(a.experts as i64)),
            ("top_k", Attr::Int(a.top_k as i64)),
            ("normalize", Attr::Bool(a.normalize)),
            ("act", Attr::Str(a.act.name().into())),
        ],
    }
}
/// Attributes of an indexing-family op (`tril`/`triu` name their side).
fn index_attrs(op: &IndexOp) -> Vec<(&'static str, Attr<'_>)> {
    let int = |x: usize| Attr::Int(x as i64);
    let red = |r: &ScatterReduction| Attr::Str(r.name().into());
    match op {
        IndexOp::Trilu { k, .. } => vec![("k", Attr::Int(*k))],
        IndexOp::ScatterNd { reduction } => vec![("reduction", red(reduction))],
        IndexOp::GatherNd { batch_dims } => vec![("batch_dims", int(*batch_dims))],
        IndexOp::GatherElements { axis } => vec![("axis", int(*axis))],
        IndexOp::ScatterElements { axis, reduction } => vec![("axis", int(*axis)), ("reduction", red(reduction))],
        IndexOp::CumSum { axis, exclusive, reverse } => {
            vec![("axis", int(*axis)), ("exclusive", Attr::Bool(*exclusive)), ("reverse", Attr::Bool(*reverse))]
        }
        IndexOp::ArgMax { axis, keepdims, select_last } | IndexOp::ArgMin { axis, keepdims, select_last } => {
            vec![("axis", int(*axis)), ("keepdims", Attr::Bool(*keepdims)), ("select_last", Attr::Bool(*select_last))]
        }
        IndexOp::TopK { axis, k, largest } => {
            vec![("axis", int(*axis)), ("k", int(*k)), ("largest", Attr::Bool(*largest))]
        }
    }
}

/// Parses an indexing-family op named `name` (one of [`IndexOp::NAMES`]).
fn index_from(name: &str, a: &mut Attrs) -> Result<IndexOp, String> {
    let red = |a: &mut Attrs| -> Result<ScatterReduction, String> {
        let s = a.string("reduction")?;
        ScatterReduction::from_name(&s).ok_or_else(|| format!("{name}: unknown reduction {s:?}"))
    };
    Ok(match name {
        "tril" | "triu" => IndexOp::Trilu { upper: name == "triu", k: a.int("k")? },
        "scatter_nd" => IndexOp::ScatterNd { reduction: red(a)? },
        "gather_nd" => IndexOp::GatherNd { batch_dims: a.usize("batch_dims")? },
        "gather_elements" => IndexOp::GatherElements { axis: a.usize("axis")? },
        "scatter_elements" => IndexOp::ScatterElements { axis: a.usize("axis")?, reduction: red(a)? },
        "cumsum" => {
            IndexOp::CumSum { axis: a.usize("axis")?, exclusive: a.bool("exclusive")?, reverse: a.bool("reverse")? }
        }
        "argmax" | "argmin" => {
            let (axis, keepdims, select_last) = (a.usize("axis")?, a.bool("keepdims")?, a.bool("select_last")?);
            if name == "argmax" {
                IndexOp::ArgMax { axis, keepdims, select_last }
            } else {
                IndexOp::ArgMin { axis, keepdims, select_last }
            }
        }
        "topk" => IndexOp::TopK { axis: a.usize("axis")?, k: a.usize("k")?, largest: a.bool("largest")? },
        _ => return Err(format!("unknown op {name}")),
    })
}

/// The attributes of a unary op (the activations of [`crate::ops::activation`] carry some).
fn unary_attrs(u: UnaryOp) -> Vec<(&'static str, Attr<'static>)> {
    use crate::ops::activation::{Param, params};
    params(u)
        .into_iter()
        .map(|(k, v)| {
            (
                k,
                match v {
                    Param::F32(x) => Attr::Float(x),
                    Param::Bool(b) => Attr::Bool(b),
                },
            )
        })
        .collect()
}

/// `u` with its attributes read from `a`.
fn unary_from(u: UnaryOp, a: &mut Attrs) -> Result<UnaryOp, String> {
    use crate::ops::activation::{Param, with_params};
    with_params(u, |k, kind| match kind {
        Param::F32(_) => a.float(k).map(Param::F32),
        Param::Bool(_) => a.bool(k).map(Param::Bool),
    })
}

fn resize_attrs(a: &ResizeAttrs) -> Vec<(&'static str, Attr<'_>)> {
    use crate::ops::resize::{coord_name, mode_name, nearest_name};
    vec![
        ("axes", Attr::Ints(a.axes.iter().flat_map(|x| [x.axis as i64, x.size as i64]).collect())),
        ("scales", Attr::Tensor(Cow::Owned(Tensor::f64([a.axes.len()], a.axes.iter().map(|x| x.scale).collect())))),
        ("mode", Attr::Str(mode_name(a.mode).into())),
        ("coord", Attr::Str(coord_name(a.coord).into())),
        ("nearest_mode", Attr::Str(nearest_name(a.nearest_mode).into())),
        ("cubic_a", Attr::Float(a.cubic_a)),
        ("exclude_outside", Attr::Bool(a.exclude_outside)),
    ]
}

fn parse_resize(a: &mut Attrs) -> Result<ResizeAttrs, String> {
    use crate::ops::resize::{coord_from_name, mode_from_name, nearest_from_name};
    let pairs = a.usizes("axes")?;
    let scales = match a.take("scales")? {
        Attr::Tensor(t) => t.as_f64().map(|v| v.to_vec()),
        _ => None,
    }
    .ok_or("resize: scales must be an f64 tensor")?;
    if !pairs.len().is_multiple_of(2) || pairs.len() / 2 != scales.len() {
        return Err("resize: axes must be (axis, size) pairs, one per scale".into());
    }
    let axes = pairs.chunks(2).zip(scales).map(|(p, scale)| ResizeAxis { axis: p[0], size: p[1], scale }).collect();
    let mode = a.string("mode")?;
    let coord = a.string("coord")?;
    let nearest = a.string("nearest_mode")?;
    Ok(ResizeAttrs {
        axes,
        mode: mode_from_name(&mode).ok_or(format!("resize: unknown mode {mode}"))?,
        coord: coord_from_name(&coord).ok_or(format!("resize: unknown coord {coord}"))?,
        nearest_mode: nearest_from_name(&nearest).ok_or(format!("resize: unknown nearest_mode {nearest}"))?,
        cubic_a: a.float("cubic_a")?,
        exclude_outside: a.bool("exclude_outside")?,
    })
}

fn slice_axes(axes: &[SliceAxis]) -> Attr<'_> {
    Attr::Ints(axes.iter().flat_map(|a| [a.axis as i64, a.start, a.len as i64, a.step]).collect())
}

fn parse_slice_axes(v: Vec<i64>) -> Result<Vec<SliceAxis>, String> {
    if !v.len().is_multiple_of(4) || v.chunks(4).any(|c| c[0] < 0 || c[2] < 0) {
        return Err("slice: axes must be (axis, start, len, step) quadruples".into());
    }
    Ok(v.chunks(4).map(|c| SliceAxis { axis: c[0] as usize, start: c[1], len: c[2] as usize, step: c[3] }).collect())
}

struct Attrs<'a> {
    map: HashMap<String, Attr<'static>>,
    op: &'a str,
}

impl Attrs<'_> {
    fn take(&mut self, k: &str) -> Result<Attr<'static>, String> {
        self.map.remove(k).ok_or_else(|| format!("{}: missing attribute {k}", self.op))
    }
    fn int(&mut self, k: &str) -> Result<i64, String> {
        match self.take(k)? {
            Attr::Int(i) => Ok(i),
            a => Err(format!("{}: attribute {k} must be an integer, got {a:?}", self.op)),
        }
    }
    fn usize(&mut self, k: &str) -> Result<usize, String> {
        let i = self.int(k)?;
        usize::try_from(i).map_err(|_| format!("{}: attribute {k} must be >= 0", self.op))
    }
    fn float(&mut self, k: &str) -> Result<f32, String> {
        match self.take(k)? {
            Attr::Float(x) => Ok(x),
            Attr::Int(i) => Ok(i as f32),
            // The JSON form writes what JSON numbers cannot hold as strings.
            Attr::Str(s) if matches!(s.as_str(), "inf" | "-inf" | "NaN") => Ok(s.parse().unwrap_or(f32::NAN)),
            a => Err(format!("{}: attribute {k} must be a float, got {a:?}", self.op)),
        }
    }
    fn bool(&mut self, k: &str) -> Result<bool, String> {
        match self.take(k)? {
            Attr::Bool(b) => Ok(b),
            a => Err(format!("{}: attribute {k} must be true or false, got {a:?}", self.op)),
        }
    }
    fn ints(&mut self, k: &str) -> Result<Vec<i64>, String> {
        match self.take(k)? {
            Attr::Ints(v) => Ok(v),
            a => Err(format!("{}: attribute {k} must be a list, got {a:?}", self.op)),
        }
    }
    fn usizes(&mut self, k: &str) -> Result<Vec<usize>, String> {
        self.ints(k)?
            .into_iter()
            .map(|i| usize::try_from(i).map_err(|_| format!("{}: attribute {k} must be >= 0", self.op)))
            .collect()
    }
    fn arr<const N: usize>(&mut self, k: &str) -> Result<[usize; N], String> {
        let v = self.usizes(k)?;
        v.try_into().map_err(|v: Vec<usize>| format!("{}: attribute {k} needs {N} values, got {}", self.op, v.len()))
    }
    fn string(&mut self, k: &str) -> Result<String, String> {
        match self.take(k)? {
            Attr::Str(s) => Ok(s),
            a => Err(format!("{}: attribute {k} must be a string, got {a:?}", self.op)),
        }
    }
    fn finish(self) -> Result<(), String> {
        match self.map.keys().next() {
            Some(k) => Err(format!("{}: unknown attribute {k}", self.op)),
            None => Ok(()),
        }
    }
}

pub(crate) fn op_from(name: &str, map: HashMap<String, Attr<'static>>) -> Result<Op, String> {
    let mut a = Attrs { map, op: name };
    let pool = |a: &mut Attrs| -> Result<PoolAttrs, String> {
        Ok(PoolAttrs {
            kernel: a.arr("kernel")?,
            strides: a.arr("strides")?,
            pads: a.arr("pads")?,
            dilations: a.arr("dilations")?,
            ceil_mode: a.bool("ceil_mode")?,
            count_include_pad: a.bool("count_include_pad")?,
        })
    };
    let op = if let Some(u) = UNARY_OPS.iter().find(|u| unary_name(**u) == name) {
        Op::Unary(unary_from(*u, &mut a)?)
    } else if let Some(u) = UNARY_OPS.iter().find(|u| unary_differentiable(**u) && unary_grad_name(**u) == name) {
        Op::UnaryGrad(unary_from(*u, &mut a)?)
    } else if let Some(b) = BINARY_OPS.iter().find(|b| binary_name(**b) == name) {
        Op::Binary(*b)
    } else if let Some(r) = REDUCE_OPS.iter().find(|r| reduce_name(**r) == name) {
        Op::Reduce { op: *r, axes: a.usizes("axes")?, keepdims: a.bool("keepdims")? }
    } else {
        match name {
            "input" => Op::Input { name: a.string("name")? },
            "param" => Op::Param { name: a.string("name")? },
            "const" => match a.take("value")? {
                Attr::Tensor(t) => Op::Constant(t.into_owned()),
                v => return Err(format!("const: value must be a tensor, got {v:?}")),
            },
            "where" => Op::Where,
            "identity" => Op::Identity,
            "matmul" => Op::MatMul,
            "global_avgpool" => Op::GlobalAveragePool,
            "global_maxpool" => Op::GlobalMaxPool,
            "cast" => match a.take("to")? {
                Attr::DType(d) => Op::Cast { to: d },
                Attr::Str(s) if DType::from_name(&s).is_some() => {
                    Op::Cast { to: DType::from_name(&s).expect("checked") }
                }
                v => return Err(format!("cast: to must be a dtype, got {v:?}")),
            },
            "gemm" => Op::Gemm {
                alpha: a.float("alpha")?,
                beta: a.float("beta")?,
                trans_a: a.bool("trans_a")?,
                trans_b: a.bool("trans_b")?,
            },
            "conv" => Op::Conv(ConvAttrs {
                strides: a.arr("strides")?,
                pads: a.arr("pads")?,
                dilations: a.arr("dilations")?,
                group: a.usize("group")?,
            }),
            "maxpool" => Op::MaxPool(pool(&mut a)?),
            "avgpool" => Op::AveragePool(pool(&mut a)?),
            "batchnorm" => Op::BatchNorm { epsilon: a.float("epsilon")? },
            "batchnorm_train" => Op::BatchNormTrain { epsilon: a.float("epsilon")? },
            "batchnorm_train_grad" => Op::BatchNormTrainGrad { epsilon: a.float("epsilon")? },
            "layernorm" => Op::LayerNorm { axis: a.usize("axis")?, epsilon: a.float("epsilon")? },
            "lrn" => Op::Lrn {
                size: a.usize("size")?,
                alpha: a.float("alpha")?,
                beta: a.float("beta")?,
                bias: a.float("bias")?,
            },
            "softmax" => Op::Softmax { axis: a.usize("axis")? },
            "log_softmax" => Op::LogSoftmax { axis: a.usize("axis")? },
            "concat" => Op::Concat { axis: a.usize("axis")? },
            "gather" => Op::Gather { axis: a.usize("axis")? },
            "reshape" => Op::Reshape { shape: a.usizes("shape")? },
            "expand" => Op::Expand { shape: a.usizes("shape")? },
            "transpose" => Op::Transpose { perm: a.usizes("perm")? },
            "split" => Op::Split { axis: a.usize("axis")?, sizes: a.usizes("sizes")? },
            "slice" => Op::Slice { axes: parse_slice_axes(a.ints("axes")?)? },
            "pad" => Op::Pad { pads: a.usizes("pads")?, value: a.float("value")? },
            "state" => Op::State { name: a.string("name")? },
            "hardmax" => Op::Hardmax { axis: a.usize("axis")? },
            "dropout" => {
                let id = a.int("id")?;
                let id = u32::try_from(id).map_err(|_| format!("dropout: id {id} is not in 0..2^32"))?;
                Op::Dropout(crate::DropoutAttrs { ratio: a.float("ratio")?, id, mask: a.bool("mask")? })
            }
            "attention" | "attention_grad" => {
                let attrs = crate::AttentionAttrs {
                    scale: a.float("scale")?,
                    causal: a.bool("causal")?,
                    offset: a.usize("offset")?,
                    softcap: a.float("softcap")?,
                };
                if name == "attention" { Op::Attention(attrs) } else { Op::AttentionGrad(attrs) }
            }
            "moe" | "moe_grad" => {
                let act = a.string("act")?;
                let act = crate::MoeAct::parse(&act)
                    .ok_or_else(|| format!("{name}: act must be swiglu or gelu, got {act}"))?;
                let attrs = crate::MoeAttrs {
                    experts: a.usize("experts")?,
                    top_k: a.usize("top_k")?,
                    normalize: a.bool("normalize")?,
                    act,
                };
                if name == "moe" { Op::Moe(attrs) } else { Op::MoeGrad(attrs) }
            }
            "softmax_grad" => Op::SoftmaxGrad { axis: a.usize("axis")?, log: false },
            "log_softmax_grad" => Op::SoftmaxGrad { axis: a.usize("axis")?, log: true },
            "layernorm_grad" => Op::LayerNormGrad { axis: a.usize("axis")?, epsilon: a.float("epsilon")? },
            "lrn_grad" => Op::LrnGrad {
                size: a.usize("size")?,
                alpha: a.float("alpha")?,
                beta: a.float("beta")?,
                bias: a.float("bias")?,
            },
            "conv_input_grad" | "conv_weight_grad" => {
                let attrs = ConvAttrs {
                    strides: a.arr("strides")?,
                    pads: a.arr("pads")?,
                    dilations: a.arr("dilations")?,
                    group: a.usize("group")?,
                };
                let shape = a.usizes("shape")?;
                if name == "conv_input_grad" {
                    Op::ConvInputGrad { attrs, shape }
                } else {
                    Op::ConvWeightGrad { attrs, shape }
                }
            }
            "maxpool_grad" => Op::MaxPoolGrad(pool(&mut a)?),
            "avgpool_grad" => Op::AveragePoolGrad { attrs: pool(&mut a)?, shape: a.usizes("shape")? },
            "gather_grad" => Op::GatherGrad { axis: a.usize("axis")?, shape: a.usizes("shape")? },
            "slice_grad" => Op::SliceGrad { axes: parse_slice_axes(a.ints("axes")?)?, shape: a.usizes("shape")? },
            "sgd_update" => Op::SgdUpdate {
                lr: a.float("lr")?,
                momentum: a.float("momentum")?,
                weight_decay: a.float("weight_decay")?,
            },
            "adamw_update" => Op::AdamWUpdate {
                lr: a.float("lr")?,
                beta1: a.float("beta1")?,
                beta2: a.float("beta2")?,
                epsilon: a.float("epsilon")?,
                weight_decay: a.float("weight_decay")?,
            },
            "resize" => Op::Resize(parse_resize(&mut a)?),
            "resize_grad" => Op::ResizeGrad { attrs: parse_resize(&mut a)?, shape: a.usizes("shape")? },
            _ if IndexOp::NAMES.contains(&name) => Op::Index(index_from(name, &mut a)?),
            _ => return Err(format!("unknown op {name}")),
        }
    };
    a.finish()?;
    Ok(op)
}

impl Graph {
    /// Prints the graph in the text form described in this module's docs.
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        let _ = self.write_text(&mut out, TensorData::Text);
        out
    }

    /// Writes the text form to `w` as it is printed (a graph holding gigabytes of constants is
    /// never held as text in memory).
    pub fn write_text_to(&self, w: &mut impl std::io::Write) -> std::io::Result<()> {
        /// `fmt::Write` onto an `io::Write`, keeping the first I/O error.
        struct Io<'w, W> {
            w: &'w mut W,
            err: Option<std::io::Error>,
        }
        impl<W: std::io::Write> Write for Io<'_, W> {
            fn write_str(&mut self, s: &str) -> std::fmt::Result {
                self.w.write_all(s.as_bytes()).map_err(|e| {
                    self.err = Some(e);
                    std::fmt::Error
                })
            }
        }
        let mut io = Io { w, err: None };
        match self.write_text(&mut io, TensorData::Text) {
            Ok(()) => Ok(()),
            Err(_) => Err(io.err.unwrap_or_else(|| std::io::Error::other("formatting the graph failed"))),
        }
    }

    /// FNV-1a (16 hex digits) of the text form with every tensor attribute's data replaced by a
    /// hash of its elements' bits: what a plan's model hash is. Equal graphs have equal
    /// fingerprints; any change of a node, attribute, constant or edge changes it (but for
    /// hash collisions), without printing constants.
    pub fn fingerprint(&self) -> String {
        /// FNV-1a over the bytes written.
        struct Fnv(u64);
        impl Write for Fnv {
            fn write_str(&mut self, s: &str) -> std::fmt::Result {
                self.0 = s.bytes().fold(self.0, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3));
                Ok(())
            }
        }
        let mut h = Fnv(0xcbf2_9ce4_8422_2325);
        let _ = self.write_text(&mut h, TensorData::Hash);
        format!("{:016x}", h.0)
    }

    fn write_text(&self, out: &mut impl Write, data: TensorData) -> std::fmt::Result {
        let order = match self.topo_order() {
            Ok(o) => o,
            Err(_) => self.g.node_indices().collect(),
        };
        let ids: HashMap<_, _> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        let val = |v: Value| match ids.get(&v.node) {
            Some(i) if v.slot == 0 => format!("%{i}"),
            Some(i) => format!("%{i}.{}", v.slot),
            None => "%?".to_string(),
        };
        writeln!(out, "graph {:?} {{", self.name)?;
        for (i, &n) in order.iter().enumerate() {
            let node = &self.g[n];
            write!(out, "  %{i} {:?} = {}", node.name, node.op.name())?;
            let attrs = op_attrs(&node.op);
            if !attrs.is_empty() {
                out.write_char('{')?;
                for (j, (k, a)) in attrs.iter().enumerate() {
                    if j > 0 {
                        out.write_str(", ")?;
                    }
                    out.write_str(k)?;
                    out.write_char('=')?;
                    fmt_attr(a, out, data)?;
                }
                out.write_char('}')?;
            }
            let ins = self.node_inputs(n);
            if !node.op.is_source() {
                write!(out, "({})", ins.iter().map(|&v| val(v)).collect::<Vec<_>>().join(", "))?;
            }
            writeln!(out, " : {}", node.outputs.iter().map(|m| m.to_string()).collect::<Vec<_>>().join(", "))?;
        }
        for (name, v) in &self.outputs {
            writeln!(out, "  output {name:?} = {}", val(*v))?;
        }
        for &(src, v) in &self.updates {
            writeln!(out, "  update {} = {}", val(Value::new(src, 0)), val(v))?;
        }
        out.write_str("}\n")
    }

    /// Parses the text form. Output metas are taken as written; run [`crate::verify`] to check
    /// them against inference.
    pub fn parse(text: &str) -> Result<Graph, ParseError> {
        let mut p = Parser { toks: lex(text)?, pos: 0 };
        p.graph()
    }
}

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ident(String),
    Num(String),
    Str(String),
    Val(usize, usize),
    P(char),
}

fn lex(text: &str) -> Result<Vec<(Tok, usize)>, ParseError> {
    let mut toks = Vec::new();
    let mut line = 1;
    let cs: Vec<char> = text.chars().collect();
    let mut i = 0;
    let err = |line, m: String| ParseError { line, message: m };
    while i < cs.len() {
        let c = cs[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c == ';' || (c == '/' && cs.get(i + 1) == Some(&'/')) {
            while i < cs.len() && cs[i] != '\n' {
                i += 1;
            }
        } else if c == '%' {
            i += 1;
            let s = i;
            while i < cs.len() && cs[i].is_ascii_digit() {
                i += 1;
            }
            let n: usize = cs[s..i]
                .iter()
                .collect::<String>()
                .parse()
                .map_err(|_| err(line, "expected a node number after %".into()))?;
            let mut slot = 0;
            if cs.get(i) == Some(&'.') && cs.get(i + 1).is_some_and(|c| c.is_ascii_digit()) {
                i += 1;
                let s = i;
                while i < cs.len() && cs[i].is_ascii_digit() {
                    i += 1;
                }
                slot = cs[s..i].iter().collect::<String>().parse().map_err(|_| err(line, "bad output slot".into()))?;
            }
            toks.push((Tok::Val(n, slot), line));
        } else if c == '"' {
            let mut s = String::new();
            i += 1;
            loop {
                match cs.get(i) {
                    None => return Err(err(line, "unterminated string".into())),
                    Some('"') => {
                        i += 1;
                        break;
                    }
                    Some('\\') => {
                        match cs.get(i + 1) {
                            Some('n') => s.push('\n'),
                            Some('t') => s.push('\t'),
                            Some(&c) => s.push(c),
                            None => return Err(err(line, "unterminated string".into())),
                        }
                        i += 2;
                    }
                    Some(&c) => {
                        s.push(c);
                        i += 1;
                    }
                }
            }
            toks.push((Tok::Str(s), line));
        } else if c.is_ascii_digit() || c == '-' || c == '+' {
            let s = i;
            i += 1;
            while i < cs.len()
                && (cs[i].is_ascii_alphanumeric()
                    || cs[i] == '.'
                    || ((cs[i] == '-' || cs[i] == '+') && matches!(cs[i - 1], 'e' | 'E')))
            {
                i += 1;
            }
            toks.push((Tok::Num(cs[s..i].iter().collect()), line));
        } else if c.is_alphabetic() || c == '_' {
            let s = i;
            while i < cs.len() && (cs[i].is_alphanumeric() || cs[i] == '_') {
                i += 1;
            }
            toks.push((Tok::Ident(cs[s..i].iter().collect()), line));
        } else if "{}()[],:=".contains(c) {
            toks.push((Tok::P(c), line));
            i += 1;
        } else {
            return Err(err(line, format!("unexpected character {c:?}")));
        }
    }
    Ok(toks)
}

struct Parser {
    toks: Vec<(Tok, usize)>,
    pos: usize,
}

impl Parser {
    fn line(&self) -> usize {
        self.toks.get(self.pos).or(self.toks.last()).map(|t| t.1).unwrap_or(1)
    }
    fn err<T>(&self, m: impl Into<String>) -> Result<T, ParseError> {
        Err(ParseError { line: self.line(), message: m.into() })
    }
    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.pos).map(|t| &t.0)
    }
    fn next(&mut self) -> Result<Tok, ParseError> {
        match self.toks.get(self.pos) {
            Some(t) => {
                self.pos += 1;
                Ok(t.0.clone())
            }
            None => self.err("unexpected end of text"),
        }
    }
    fn punct(&mut self, c: char) -> Result<(), ParseError> {
        match self.next()? {
            Tok::P(x) if x == c => Ok(()),
            t => {
                self.pos -= 1;
                self.err(format!("expected {c:?}, found {t:?}"))
            }
        }
    }
    fn eat(&mut self, c: char) -> bool {
        if self.peek() == Some(&Tok::P(c)) {
            self.pos += 1;
            true
        } else {
            false
        }
    }
    fn ident(&mut self) -> Result<String, ParseError> {
        match self.next()? {
            Tok::Ident(s) => Ok(s),
            t => {
                self.pos -= 1;
                self.err(format!("expected a name, found {t:?}"))
            }
        }
    }
    fn string(&mut self) -> Result<String, ParseError> {
        match self.next()? {
            Tok::Str(s) => Ok(s),
            t => {
                self.pos -= 1;
                self.err(format!("expected a string, found {t:?}"))
            }
        }
    }
    fn num(&mut self) -> Result<String, ParseError> {
        match self.next()? {
            Tok::Num(s) => Ok(s),
            Tok::Ident(s) if s == "inf" || s == "NaN" => Ok(s),
            t => {
                self.pos -= 1;
                self.err(format!("expected a number, found {t:?}"))
            }
        }
    }
    fn meta(&mut self) -> Result<TensorMeta, ParseError> {
        let d = self.ident()?;
        let dtype = match DType::from_name(&d) {
            Some(d) => d,
            None => return self.err(format!("unknown dtype {d}")),
        };
        self.punct('[')?;
        let mut shape = Vec::new();
        while !self.eat(']') {
            let n = self.num()?;
            match n.parse() {
                Ok(x) => shape.push(x),
                Err(_) => return self.err(format!("bad dimension {n}")),
            }
            if !self.eat(',') {
                self.punct(']')?;
                break;
            }
        }
        Ok(TensorMeta { shape, dtype })
    }
    fn list<T>(&mut self, mut item: impl FnMut(&mut Self) -> Result<T, ParseError>) -> Result<Vec<T>, ParseError> {
        self.punct('[')?;
        let mut v = Vec::new();
        if self.eat(']') {
            return Ok(v);
        }
        loop {
            v.push(item(self)?);
            if self.eat(']') {
                return Ok(v);
            }
            self.punct(',')?;
        }
    }
    fn attr(&mut self) -> Result<Attr<'static>, ParseError> {
        match self.peek().cloned() {
            Some(Tok::Str(s)) => {
                self.pos += 1;
                Ok(Attr::Str(s))
            }
            Some(Tok::P('[')) => {
                let v = self.list(|p| {
                    let n = p.num()?;
                    n.parse::<i64>().or_else(|_| p.err(format!("bad integer {n}")))
                })?;
                Ok(Attr::Ints(v))
            }
            Some(Tok::Ident(s)) if s == "true" || s == "false" => {
                self.pos += 1;
                Ok(Attr::Bool(s == "true"))
            }
            Some(Tok::Ident(s)) if DType::from_name(&s).is_some() => {
                if self.toks.get(self.pos + 1).map(|t| &t.0) == Some(&Tok::P('[')) {
                    let meta = self.meta()?;
                    let data = match meta.dtype {
                        DType::F32 => Data::F32(self.list(|p| {
                            let n = p.num()?;
                            n.parse::<f32>().or_else(|_| p.err(format!("bad float {n}")))
                        })?),
                        DType::F64 => Data::F64(self.list(|p| {
                            let n = p.num()?;
                            n.parse::<f64>().or_else(|_| p.err(format!("bad float {n}")))
                        })?),
                        DType::BF16 | DType::F16 => {
                            let wide = self.list(|p| {
                                let n = p.num()?;
                                n.parse::<f32>().or_else(|_| p.err(format!("bad float {n}")))
                            })?;
                            Tensor::f32([wide.len()], wide).with_float_type(meta.dtype).into_data()
                        }
                        DType::I64 => Data::I64(self.list(|p| {
                            let n = p.num()?;
                            n.parse::<i64>().or_else(|_| p.err(format!("bad integer {n}")))
                        })?),
                        DType::Bool => Data::Bool(self.list(|p| match p.next()? {
                            Tok::Num(s) if s == "1" => Ok(true),
                            Tok::Num(s) if s == "0" => Ok(false),
                            Tok::Ident(s) if s == "true" => Ok(true),
                            Tok::Ident(s) if s == "false" => Ok(false),
                            t => p.err(format!("bad bool {t:?} (expected 0 or 1)")),
                        })?),
                    };
                    match Tensor::new(meta.shape, data) {
                        Ok(t) => Ok(Attr::Tensor(Cow::Owned(t))),
                        Err(e) => self.err(e.to_string()),
                    }
                } else {
                    self.pos += 1;
                    Ok(Attr::DType(DType::from_name(&s).expect("checked above")))
                }
            }
            _ => {
                let n = self.num()?;
                if let Ok(i) = n.parse::<i64>() {
                    Ok(Attr::Int(i))
                } else if let Ok(x) = n.parse::<f32>() {
                    Ok(Attr::Float(x))
                } else {
                    self.err(format!("bad attribute value {n}"))
                }
            }
        }
    }
    fn graph(&mut self) -> Result<Graph, ParseError> {
        let kw = self.ident()?;
        if kw != "graph" {
            return self.err("expected `graph`");
        }
        let mut g = Graph::new(self.string()?);
        self.punct('{')?;
        let mut nodes: HashMap<usize, crate::NodeIndex> = HashMap::new();
        loop {
            match self.next()? {
                Tok::P('}') => break,
                Tok::Ident(k) if k == "output" => {
                    let name = self.string()?;
                    self.punct('=')?;
                    let v = self.value(&nodes, &g)?;
                    g.outputs.push((name, v));
                }
                Tok::Ident(k) if k == "update" => {
                    let src = self.value(&nodes, &g)?;
                    self.punct('=')?;
                    let v = self.value(&nodes, &g)?;
                    g.updates.push((src.node, v));
                }
                Tok::Val(id, 0) => {
                    let line = self.line();
                    let name = self.string()?;
                    self.punct('=')?;
                    let opname = self.ident()?;
                    let mut attrs = HashMap::new();
                    if self.eat('{') {
                        loop {
                            let k = self.ident()?;
                            self.punct('=')?;
                            let a = self.attr()?;
                            attrs.insert(k, a);
                            if self.eat('}') {
                                break;
                            }
                            self.punct(',')?;
                        }
                    }
                    let op = op_from(&opname, attrs).map_err(|m| ParseError { line, message: m })?;
                    let mut ins = Vec::new();
                    if self.eat('(') && !self.eat(')') {
                        loop {
                            ins.push(self.value(&nodes, &g)?);
                            if self.eat(')') {
                                break;
                            }
                            self.punct(',')?;
                        }
                    }
                    self.punct(':')?;
                    let mut outs = vec![self.meta()?];
                    while self.eat(',') {
                        outs.push(self.meta()?);
                    }
                    if nodes.contains_key(&id) {
                        return Err(ParseError { line, message: format!("%{id} is defined twice") });
                    }
                    let idx = g.add_node_raw(name, op, &ins, outs);
                    nodes.insert(id, idx);
                }
                t => {
                    self.pos -= 1;
                    return self.err(format!("expected a node, `output`, `update` or `}}`, found {t:?}"));
                }
            }
        }
        if self.pos != self.toks.len() {
            return self.err("text after the end of the graph");
        }
        Ok(g)
    }
    fn value(&mut self, nodes: &HashMap<usize, crate::NodeIndex>, g: &Graph) -> Result<Value, ParseError> {
        match self.next()? {
            Tok::Val(n, s) => match nodes.get(&n) {
                Some(&idx) if s < g.g[idx].outputs.len() => Ok(Value::new(idx, s)),
                Some(_) => self.err(format!("%{n} has no output {s}")),
                None => self.err(format!("%{n} is used before it is defined")),
            },
            t => {
                self.pos -= 1;
                self.err(format!("expected a value like %3, found {t:?}"))
            }
        }
    }
}
