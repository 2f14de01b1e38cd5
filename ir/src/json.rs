//! The JSON form of ops and graphs (serde), the one plans hold: read with serde's streaming
//! deserializer, never through the text form's lexer.
//!
//! - An op is its name when it has no attributes (`"matmul"`), else a one-key object from the
//!   name to its attributes, named as in the text form (`{"reshape": {"shape": [2, 16, 64]}}`).
//!   A tensor attribute is `{"dtype": "f32", "shape": [2], "data": [1.0, "-inf"]}`.
//! - Floats JSON cannot hold are the strings `"inf"`, `"-inf"` and `"NaN"`, in attributes and in
//!   tensor data alike; every finite `f32` round-trips exactly.
//! - A graph is `{"name", "nodes", "outputs", "updates"}`; node `id` is its position, nodes come
//!   in topological order, and values are written `%N` (output 0) or `%N.S`, as in the text form.
//!   Parameter data is not part of either form.
//!
//! Reading checks what the text form's parser checks (ids in order, values defined before use,
//! slots in range, attributes complete and of the right type); run [`crate::verify`] for the
//! rest.

use std::collections::HashMap;
use std::fmt;

use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::ser::{SerializeMap, SerializeSeq, SerializeStruct, Serializer};
use serde::{Deserialize, Serialize};

use crate::graph::{Graph, Value};
use crate::op::Op;
use crate::tensor::{DType, Data, Tensor, TensorMeta};
use crate::text::{Attr, op_attrs, op_from};

/// The spelling of a float JSON numbers cannot hold.
fn nonfinite(x: f64) -> &'static str {
    if x.is_nan() {
        "NaN"
    } else if x > 0.0 {
        "inf"
    } else {
        "-inf"
    }
}

fn ser_f32<S: Serializer>(x: f32, s: S) -> Result<S::Ok, S::Error> {
    if x.is_finite() { s.serialize_f32(x) } else { s.serialize_str(nonfinite(x as f64)) }
}

fn ser_f64<S: Serializer>(x: f64, s: S) -> Result<S::Ok, S::Error> {
    if x.is_finite() { s.serialize_f64(x) } else { s.serialize_str(nonfinite(x)) }
}

struct F32(f32);
impl Serialize for F32 {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        ser_f32(self.0, s)
    }
}
struct F64(f64);
impl Serialize for F64 {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        ser_f64(self.0, s)
    }
}

struct TensorForm<'a>(&'a Tensor);

impl Serialize for TensorForm<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        struct DataForm<'a>(&'a Data);
        impl Serialize for DataForm<'_> {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                let mut seq = s.serialize_seq(Some(self.0.len()))?;
                match self.0 {
                    Data::F32(v) => v.iter().try_for_each(|&x| seq.serialize_element(&F32(x)))?,
                    Data::F64(v) => v.iter().try_for_each(|&x| seq.serialize_element(&F64(x)))?,
                    Data::BF16(v) => v.iter().try_for_each(|&x| seq.serialize_element(&F32(x.to_f32())))?,
                    Data::F16(v) => v.iter().try_for_each(|&x| seq.serialize_element(&F32(x.to_f32())))?,
                    Data::I64(v) => v.iter().try_for_each(|x| seq.serialize_element(x))?,
                    Data::Bool(v) => v.iter().try_for_each(|x| seq.serialize_element(x))?,
                }
                seq.end()
            }
        }
        let mut st = s.serialize_struct("Tensor", 3)?;
        st.serialize_field("dtype", self.0.dtype().name())?;
        st.serialize_field("shape", self.0.shape())?;
        st.serialize_field("data", &DataForm(self.0.data()))?;
        st.end()
    }
}

struct AttrForm<'a>(&'a Attr<'a>);

impl Serialize for AttrForm<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0 {
            Attr::Int(i) => s.serialize_i64(*i),
            Attr::Float(x) => ser_f32(*x, s),
            Attr::Bool(b) => s.serialize_bool(*b),
            Attr::Ints(v) => v.serialize(s),
            Attr::Str(v) => s.serialize_str(v),
            Attr::DType(d) => s.serialize_str(d.name()),
            Attr::Tensor(t) => TensorForm(t.as_ref()).serialize(s),
        }
    }
}

impl Serialize for Op {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        struct Attrs<'a>(&'a [(&'static str, Attr<'a>)]);
        impl Serialize for Attrs<'_> {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                let mut m = s.serialize_map(Some(self.0.len()))?;
                for (k, a) in self.0 {
                    m.serialize_entry(k, &AttrForm(a))?;
                }
                m.end()
            }
        }
        let attrs = op_attrs(self);
        if attrs.is_empty() {
            return s.serialize_str(self.name());
        }
        let mut m = s.serialize_map(Some(1))?;
        m.serialize_entry(self.name(), &Attrs(&attrs))?;
        m.end()
    }
}

/// A number, flag or string of tensor data, converted once the dtype is known.
enum Item {
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
}

impl<'de> Deserialize<'de> for Item {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Item;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a number, a flag, or \"inf\", \"-inf\", \"NaN\"")
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Item, E> {
                Ok(Item::Bool(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Item, E> {
                Ok(Item::Int(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Item, E> {
                i64::try_from(v).map(Item::Int).map_err(|_| E::custom(format!("{v} is out of range")))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Item, E> {
                Ok(Item::Float(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Item, E> {
                Ok(Item::Str(v.to_string()))
            }
        }
        d.deserialize_any(V)
    }
}

fn float_item(x: Item) -> Result<f64, String> {
    match x {
        Item::Int(i) => Ok(i as f64),
        Item::Float(f) => Ok(f),
        Item::Str(s) if matches!(s.as_str(), "inf" | "-inf" | "NaN") => Ok(s.parse().unwrap_or(f64::NAN)),
        Item::Str(s) => Err(format!("{s:?} is not a number")),
        Item::Bool(b) => Err(format!("{b} is not a number")),
    }
}

fn tensor(dtype: &str, shape: Vec<usize>, data: Vec<Item>) -> Result<Tensor, String> {
    let dt = DType::from_name(dtype).ok_or_else(|| format!("unknown dtype {dtype:?}"))?;
    let data = match dt {
        DType::F32 => Data::F32(data.into_iter().map(|x| float_item(x).map(|f| f as f32)).collect::<Result<_, _>>()?),
        DType::F64 => Data::F64(data.into_iter().map(float_item).collect::<Result<_, _>>()?),
        DType::BF16 | DType::F16 => {
            let wide: Vec<f32> = data.into_iter().map(|x| float_item(x).map(|f| f as f32)).collect::<Result<_, _>>()?;
            return Tensor::new(shape, Data::F32(wide)).map(|t| t.with_float_type(dt)).map_err(|e| e.to_string());
        }
        DType::I64 => Data::I64(
            data.into_iter()
                .map(|x| match x {
                    Item::Int(i) => Ok(i),
                    _ => Err("i64 data must be integers".to_string()),
                })
                .collect::<Result<_, _>>()?,
        ),
        DType::Bool => Data::Bool(
            data.into_iter()
                .map(|x| match x {
                    Item::Bool(b) => Ok(b),
                    _ => Err("bool data must be true or false".to_string()),
                })
                .collect::<Result<_, _>>()?,
        ),
    };
    Tensor::new(shape, data).map_err(|e| e.to_string())
}

impl<'de> Deserialize<'de> for Attr<'static> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Attr<'static>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an attribute: a number, flag, string, list of integers or tensor")
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Attr<'static>, E> {
                Ok(Attr::Bool(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Attr<'static>, E> {
                Ok(Attr::Int(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Attr<'static>, E> {
                i64::try_from(v).map(Attr::Int).map_err(|_| E::custom(format!("{v} is out of range")))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Attr<'static>, E> {
                Ok(Attr::Float(v as f32))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Attr<'static>, E> {
                Ok(Attr::Str(v.to_string()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Attr<'static>, A::Error> {
                let mut v = Vec::with_capacity(seq.size_hint().unwrap_or(0));
                while let Some(i) = seq.next_element::<i64>()? {
                    v.push(i);
                }
                Ok(Attr::Ints(v))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Attr<'static>, A::Error> {
                let (mut dtype, mut shape, mut data) = (None::<String>, None::<Vec<usize>>, None::<Vec<Item>>);
                while let Some(k) = map.next_key::<String>()? {
                    match k.as_str() {
                        "dtype" => dtype = Some(map.next_value()?),
                        "shape" => shape = Some(map.next_value()?),
                        "data" => data = Some(map.next_value()?),
                        _ => return Err(de::Error::unknown_field(&k, &["dtype", "shape", "data"])),
                    }
                }
                let dtype = dtype.ok_or_else(|| de::Error::missing_field("dtype"))?;
                let shape = shape.ok_or_else(|| de::Error::missing_field("shape"))?;
                let data = data.ok_or_else(|| de::Error::missing_field("data"))?;
                tensor(&dtype, shape, data).map(|t| Attr::Tensor(std::borrow::Cow::Owned(t))).map_err(de::Error::custom)
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for Op {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Op;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an op: its name, or {name: {attributes}}")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Op, E> {
                op_from(v, HashMap::new()).map_err(E::custom)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Op, A::Error> {
                let Some(name) = map.next_key::<String>()? else {
                    return Err(de::Error::custom("an op object needs one key, the op's name"));
                };
                let attrs: HashMap<String, Attr<'static>> = map.next_value()?;
                if map.next_key::<String>()?.is_some() {
                    return Err(de::Error::custom(format!("{name}: an op object has one key, the op's name")));
                }
                op_from(&name, attrs).map_err(de::Error::custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// `%N` or `%N.S`.
fn value_text(id: usize, slot: usize) -> String {
    if slot == 0 { format!("%{id}") } else { format!("%{id}.{slot}") }
}

fn parse_value(s: &str) -> Option<(usize, usize)> {
    let rest = s.strip_prefix('%')?;
    let (n, slot) = match rest.split_once('.') {
        Some((n, s)) => (n, s.parse().ok()?),
        None => (rest, 0),
    };
    // One spelling per value: no signs, no leading zeros.
    let canonical =
        |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()) && (t == "0" || !t.starts_with('0'));
    if !canonical(n) || rest.split_once('.').is_some_and(|(_, s)| !canonical(s)) {
        return None;
    }
    Some((n.parse().ok()?, slot))
}

fn parse_meta(s: &str) -> Option<TensorMeta> {
    let (d, rest) = s.split_once('[')?;
    let dims = rest.strip_suffix(']')?;
    let dtype = DType::from_name(d.trim())?;
    let shape = if dims.trim().is_empty() {
        vec![]
    } else {
        dims.split(',').map(|x| x.trim().parse().ok()).collect::<Option<Vec<usize>>>()?
    };
    Some(TensorMeta { shape, dtype })
}

impl Serialize for Graph {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let order = self
            .topo_order()
            .map_err(|n| serde::ser::Error::custom(format!("graph has a cycle through {}", self.node(n).name)))?;
        let ids: HashMap<_, _> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        let val = |v: Value| value_text(ids[&v.node], v.slot);
        #[derive(Serialize)]
        struct NodeOut<'a> {
            id: usize,
            name: &'a str,
            op: &'a Op,
            #[serde(skip_serializing_if = "Vec::is_empty")]
            inputs: Vec<String>,
            outputs: Vec<String>,
        }
        #[derive(Serialize)]
        struct Named<'a> {
            name: &'a str,
            value: String,
        }
        #[derive(Serialize)]
        struct Update {
            target: String,
            value: String,
        }
        struct Nodes<'a, F>(&'a Graph, &'a [petgraph::stable_graph::NodeIndex], F);
        impl<F: Fn(Value) -> String> Serialize for Nodes<'_, F> {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                let mut seq = s.serialize_seq(Some(self.1.len()))?;
                for (id, &n) in self.1.iter().enumerate() {
                    let node = self.0.node(n);
                    seq.serialize_element(&NodeOut {
                        id,
                        name: &node.name,
                        op: &node.op,
                        inputs: self.0.node_inputs(n).into_iter().map(&self.2).collect(),
                        outputs: node.outputs.iter().map(|m| m.to_string()).collect(),
                    })?;
                }
                seq.end()
            }
        }
        let mut st = s.serialize_struct("Graph", 4)?;
        st.serialize_field("name", &self.name)?;
        st.serialize_field("nodes", &Nodes(self, &order, &val))?;
        let outputs: Vec<Named> = self.outputs.iter().map(|(name, v)| Named { name, value: val(*v) }).collect();
        st.serialize_field("outputs", &outputs)?;
        let updates: Vec<Update> =
            self.updates.iter().map(|&(t, v)| Update { target: val(Value::new(t, 0)), value: val(v) }).collect();
        st.serialize_field("updates", &updates)?;
        st.end()
    }
}

impl<'de> Deserialize<'de> for Graph {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct NodeIn {
            id: usize,
            name: String,
            op: Op,
            #[serde(default)]
            inputs: Vec<String>,
            outputs: Vec<String>,
        }
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Named {
            name: String,
            value: String,
        }
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Update {
            target: String,
            value: String,
        }
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct GraphIn {
            name: String,
            nodes: Vec<NodeIn>,
            #[serde(default)]
            outputs: Vec<Named>,
            #[serde(default)]
            updates: Vec<Update>,
        }
        let gi = GraphIn::deserialize(d)?;
        let mut g = Graph::new(gi.name);
        let mut idx = Vec::with_capacity(gi.nodes.len());
        let value = |g: &Graph, idx: &[petgraph::stable_graph::NodeIndex], s: &str| -> Result<Value, String> {
            let (n, slot) = parse_value(s).ok_or_else(|| format!("{s:?} is not a value (%N or %N.S)"))?;
            let &node = idx.get(n).ok_or_else(|| format!("{s} is used before it is defined"))?;
            if slot >= g.node(node).outputs.len() {
                return Err(format!("%{n} has no output {slot}"));
            }
            Ok(Value::new(node, slot))
        };
        for n in gi.nodes {
            let at = |m: String| de::Error::custom(format!("node %{}: {m}", n.id));
            if n.id != idx.len() {
                return Err(at(format!("expected id {} (nodes are numbered in order)", idx.len())));
            }
            let ins = n.inputs.iter().map(|s| value(&g, &idx, s)).collect::<Result<Vec<_>, _>>().map_err(at)?;
            let outs = n
                .outputs
                .iter()
                .map(|s| parse_meta(s).ok_or_else(|| format!("{s:?} is not a tensor type like f32[2,3]")))
                .collect::<Result<Vec<_>, _>>()
                .map_err(at)?;
            if outs.is_empty() {
                return Err(at("a node has at least one output".into()));
            }
            idx.push(g.add_node_raw(n.name, n.op, &ins, outs));
        }
        for o in gi.outputs {
            let v = value(&g, &idx, &o.value).map_err(|m| de::Error::custom(format!("output {}: {m}", o.name)))?;
            g.outputs.push((o.name, v));
        }
        for u in gi.updates {
            let bad = |m: String| de::Error::custom(format!("update of {}: {m}", u.target));
            let t = value(&g, &idx, &u.target).map_err(bad)?;
            let v = value(&g, &idx, &u.value).map_err(bad)?;
            g.updates.push((t.node, v));
        }
        Ok(g)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BinaryOp, UnaryOp};

    #[test]
    fn values_have_one_spelling() {
        assert_eq!(parse_value("%3"), Some((3, 0)));
        assert_eq!(parse_value("%3.1"), Some((3, 1)));
        for bad in ["%03", "%3.01", "%", "3", "%+3", "%3.", "%-1"] {
            assert_eq!(parse_value(bad), None, "{bad}");
        }
        assert_eq!(parse_meta("f32[2,3]"), Some(TensorMeta::new(DType::F32, [2, 3])));
        assert_eq!(parse_meta("i64[]"), Some(TensorMeta::new(DType::I64, [])));
        assert_eq!(parse_meta("bf16[2]"), Some(TensorMeta::new(DType::BF16, [2])));
        assert_eq!(parse_meta("f8[2]"), None);
    }

    #[test]
    fn ops_round_trip_with_nonfinite_floats() {
        let ops = [
            Op::MatMul,
            Op::Reshape { shape: vec![2, 16, 64] },
            Op::Pad { pads: vec![0, 1, 0, 1], value: f32::NEG_INFINITY },
            Op::Unary(UnaryOp::LeakyRelu { alpha: 0.1 }),
            Op::Constant(Tensor::f32([3], vec![1.5e-7, f32::INFINITY, f32::NAN])),
            Op::Cast { to: DType::I64 },
            Op::Binary(BinaryOp::Add),
        ];
        for op in ops {
            let j = serde_json::to_string(&op).unwrap();
            let back: Op = serde_json::from_str(&j).unwrap();
            // NaN != NaN: compare the text forms.
            assert_eq!(format!("{back:?}"), format!("{op:?}"), "{j}");
        }
        assert_eq!(serde_json::to_string(&Op::MatMul).unwrap(), "\"matmul\"");
        assert_eq!(
            serde_json::to_string(&Op::Reshape { shape: vec![2, 3] }).unwrap(),
            r#"{"reshape":{"shape":[2,3]}}"#
        );
        let e = serde_json::from_str::<Op>(r#"{"reshape":{"shape":[2,3],"x":1}}"#).unwrap_err().to_string();
        assert!(e.contains("x"), "{e}");
    }

    #[test]
    fn renumbering_is_the_forms_numbering() {
        // Built out of topological order: `b` is added before the node it reads.
        let mut g = Graph::new("order");
        let y = g.input("y", TensorMeta::new(DType::F32, [2]));
        let x = g.input("x", TensorMeta::new(DType::F32, [2]));
        let s = g.add_op("sum", Op::Binary(BinaryOp::Add), &[x, y]).unwrap();
        let r = g.add_op("relu", Op::Unary(UnaryOp::Relu), &[s[0]]).unwrap();
        g.set_output("r", r[0]);
        let c = g.renumbered().unwrap();
        assert!(c.topo_order().unwrap().iter().enumerate().all(|(i, n)| n.index() == i));
        assert_eq!(c.to_text(), g.to_text());
        let j: Graph = serde_json::from_str(&serde_json::to_string(&g).unwrap()).unwrap();
        assert_eq!(j.to_text(), c.to_text());
        assert_eq!(j.fingerprint(), g.fingerprint());
    }

    #[test]
    fn graphs_round_trip() {
        let mut g = Graph::new("tiny");
        let x = g.input("x", TensorMeta::new(DType::F32, [2, 3]));
        let y = g.add_op("double", Op::Binary(BinaryOp::Add), &[x, x]).unwrap();
        g.set_output("y", y[0]);
        let j = serde_json::to_string(&g).unwrap();
        let back: Graph = serde_json::from_str(&j).unwrap();
        assert_eq!(back.to_text(), g.to_text());
        let bad = j.replace("\"%0\"", "\"%1\"");
        let e = serde_json::from_str::<Graph>(&bad).unwrap_err().to_string();
        assert!(e.contains("node %1: %1 is used before it is defined"), "{e}");
    }
}
