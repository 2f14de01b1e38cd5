//! Inlining of a model's local functions (`ModelProto.functions`).
//!
//! The dynamo exporter (`torch.onnx.export(..., dynamo=True)`) writes some aten ops as ONNX
//! functions local to the model, e.g. `pkg.onnxscript.torch_lib:aten_getitem`, whose body is one
//! `SequenceAt`. [`inline`] replaces every call of a local function by its body before import, so
//! the importer sees only ONNX ops:
//! - the function's formal inputs and outputs become the call's actual names (an omitted optional
//!   input becomes the empty name, as if the body's nodes omitted it);
//! - every other name of the body gets the call's unique prefix (`<call node>/<name>`), so two
//!   calls never share an intermediate value;
//! - an attribute that refers to the call's attribute (`ref_attr_name`) takes the call's value,
//!   or the function's default (`FunctionProto.attribute_proto`), or is dropped when neither
//!   exists (ONNX: the body node then sees the attribute as absent);
//! - calls inside a body are inlined in turn, up to [`MAX_DEPTH`] levels (a function that calls
//!   itself is an error, not a hang).
//!
//! The body's nodes bind to the model's opset of their domain (ONNX asks a function's opset
//! imports to be compatible with the model's).

use std::borrow::Cow;
use std::collections::HashMap;

use prost::Message;
use tract_onnx::pb::{AttributeProto, FunctionProto, ModelProto, NodeProto};

use crate::ImportError;

/// Deepest nesting of function calls inlined.
pub const MAX_DEPTH: usize = 32;

/// The fields of `FunctionProto` that tract-onnx's protobuf types do not have (IR version 9's
/// attribute defaults), decoded from the same bytes.
#[derive(Clone, PartialEq, Message)]
struct FunctionDefaults {
    #[prost(string, optional, tag = "1")]
    name: Option<String>,
    #[prost(message, repeated, tag = "11")]
    attribute_proto: Vec<AttributeProto>,
    #[prost(string, optional, tag = "10")]
    domain: Option<String>,
}

/// `ModelProto.functions` seen through [`FunctionDefaults`].
#[derive(Clone, PartialEq, Message)]
struct ModelFunctions {
    #[prost(message, repeated, tag = "25")]
    functions: Vec<FunctionDefaults>,
}

struct Function<'a> {
    proto: &'a FunctionProto,
    defaults: Vec<AttributeProto>,
}

/// The graph's nodes with every call of a local function of `model` replaced by the function's
/// body (`bytes` are the model's serialized bytes, for the attribute defaults). Borrows the
/// graph's nodes when the model has no functions.
pub(crate) fn inline<'m>(model: &'m ModelProto, bytes: &[u8]) -> Result<Cow<'m, [NodeProto]>, ImportError> {
    let Some(graph) = model.graph.as_ref() else { return Ok(Cow::Borrowed(&[])) };
    if model.functions.is_empty() {
        return Ok(Cow::Borrowed(&graph.node));
    }
    // The bytes decoded as a ModelProto already; this second view only skips other fields.
    let extra = ModelFunctions::decode(bytes).map(|m| m.functions).unwrap_or_default();
    let mut funcs: HashMap<(String, String), Function> = HashMap::new();
    for f in &model.functions {
        let key = (f.domain.clone().unwrap_or_default(), f.name.clone().unwrap_or_default());
        let defaults = extra
            .iter()
            .find(|e| e.domain.as_deref().unwrap_or("") == key.0 && e.name.as_deref().unwrap_or("") == key.1)
            .map(|e| e.attribute_proto.clone())
            .unwrap_or_default();
        if funcs.insert(key.clone(), Function { proto: f, defaults }).is_some() {
            return Err(ImportError::Decode {
                path: "model".into(),
                message: format!("two local functions are named {}:{}", key.0, key.1),
            });
        }
    }
    let mut out = Vec::with_capacity(graph.node.len());
    let mut calls = 0usize;
    for (i, n) in graph.node.iter().enumerate() {
        let mut n = n.clone();
        if n.name.is_empty() {
            // The name the importer would give it, so errors inside its body name the call.
            n.name =
                n.output.first().filter(|s| !s.is_empty()).cloned().unwrap_or_else(|| format!("{}_{i}", n.op_type));
        }
        expand(n, &funcs, 0, &mut calls, &mut out)?;
    }
    Ok(Cow::Owned(out))
}

fn expand(
    node: NodeProto,
    funcs: &HashMap<(String, String), Function>,
    depth: usize,
    calls: &mut usize,
    out: &mut Vec<NodeProto>,
) -> Result<(), ImportError> {
    let Some(f) = funcs.get(&(node.domain.clone(), node.op_type.clone())) else {
        out.push(node);
        return Ok(());
    };
    let err = |message: String| ImportError::Node {
        node: node.name.clone(),
        op_type: format!("{}:{}", node.domain, node.op_type),
        message,
    };
    if depth >= MAX_DEPTH {
        return Err(err(format!(
            "local functions nest more than {MAX_DEPTH} calls deep (a function that calls itself?)"
        )));
    }
    let p = f.proto;
    if node.input.len() > p.input.len() || node.output.len() > p.output.len() {
        return Err(err(format!(
            "calls a function of {} inputs and {} outputs with {} and {}",
            p.input.len(),
            p.output.len(),
            node.input.len(),
            node.output.len()
        )));
    }
    *calls += 1;
    let prefix = format!("{}#{}", node.name, calls);
    let mut names: HashMap<&str, String> = HashMap::new();
    for (i, formal) in p.input.iter().enumerate() {
        names.insert(formal, node.input.get(i).cloned().unwrap_or_default());
    }
    for (i, formal) in p.output.iter().enumerate() {
        // An output the call does not name is still computed, under a private name.
        let actual = node.output.get(i).filter(|s| !s.is_empty()).cloned();
        names.insert(formal, actual.unwrap_or_else(|| format!("{prefix}/{formal}")));
    }
    let rename = |s: &String| -> String {
        if s.is_empty() {
            return String::new();
        }
        names.get(s.as_str()).cloned().unwrap_or_else(|| format!("{prefix}/{s}"))
    };
    for (k, b) in p.node.iter().enumerate() {
        let mut attrs = Vec::with_capacity(b.attribute.len());
        for a in &b.attribute {
            if a.ref_attr_name.is_empty() {
                attrs.push(a.clone());
                continue;
            }
            let given = node.attribute.iter().find(|c| c.name == a.ref_attr_name);
            let given = given.or_else(|| f.defaults.iter().find(|d| d.name == a.ref_attr_name));
            if let Some(v) = given {
                attrs.push(AttributeProto { name: a.name.clone(), ref_attr_name: String::new(), ..v.clone() });
            }
        }
        let body = NodeProto {
            name: format!("{prefix}/{}", if b.name.is_empty() { format!("{}_{k}", b.op_type) } else { b.name.clone() }),
            input: b.input.iter().map(rename).collect(),
            output: b.output.iter().map(rename).collect(),
            attribute: attrs,
            ..b.clone()
        };
        expand(body, funcs, depth + 1, calls, out)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tract_onnx::pb::GraphProto;

    fn node(op: &str, domain: &str, ins: &[&str], outs: &[&str]) -> NodeProto {
        NodeProto {
            op_type: op.into(),
            domain: domain.into(),
            input: ins.iter().map(|s| s.to_string()).collect(),
            output: outs.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    fn attr_ref(name: &str, r: &str) -> AttributeProto {
        AttributeProto { name: name.into(), ref_attr_name: r.into(), r#type: 2, ..Default::default() }
    }

    fn model(nodes: Vec<NodeProto>, functions: Vec<FunctionProto>) -> ModelProto {
        ModelProto { graph: Some(GraphProto { node: nodes, ..Default::default() }), functions, ..Default::default() }
    }

    fn function(name: &str, ins: &[&str], outs: &[&str], body: Vec<NodeProto>) -> FunctionProto {
        FunctionProto {
            name: Some(name.into()),
            domain: Some("local".into()),
            input: ins.iter().map(|s| s.to_string()).collect(),
            output: outs.iter().map(|s| s.to_string()).collect(),
            node: body,
            ..Default::default()
        }
    }

    #[test]
    fn calls_become_bodies_with_private_intermediates_and_attribute_references() {
        // f(x; alpha) = Relu(LeakyRelu<alpha = @alpha>(x)); g(x) = f(f(x))
        let mut leaky = node("LeakyRelu", "", &["x"], &["t"]);
        leaky.attribute.push(attr_ref("alpha", "alpha"));
        let f = function("f", &["x"], &["y"], vec![leaky, node("Relu", "", &["t"], &["y"])]);
        let mut call1 = node("f", "local", &["a"], &["mid"]);
        call1.attribute.push(AttributeProto { name: "alpha".into(), f: 0.5, r#type: 1, ..Default::default() });
        let g = function("g", &["a"], &["b"], vec![call1, node("f", "local", &["mid"], &["b"])]);
        let mut outer = node("g", "local", &["in"], &["out"]);
        outer.name = "call".into();
        let m = model(vec![outer], vec![f, g]);
        let nodes = inline(&m, &m.encode_to_vec()).unwrap();
        let ops: Vec<_> = nodes.iter().map(|n| (n.op_type.as_str(), n.input.clone(), n.output.clone())).collect();
        assert_eq!(ops.len(), 4);
        assert_eq!(ops[0].1, vec!["in"]);
        assert_eq!(ops[3].2, vec!["out"]);
        // The inner calls' intermediates are distinct and private.
        assert_eq!(ops[1].2, ops[2].1);
        assert_ne!(ops[0].2, ops[2].2);
        assert!(ops[0].2[0].starts_with("call#"), "{:?}", ops[0]);
        // The first inner call passes alpha; the second passes none, so its LeakyRelu has none.
        assert_eq!(nodes[0].attribute.len(), 1);
        assert_eq!((nodes[0].attribute[0].name.as_str(), nodes[0].attribute[0].f), ("alpha", 0.5));
        assert!(nodes[0].attribute[0].ref_attr_name.is_empty());
        assert!(nodes[2].attribute.is_empty());
    }

    #[test]
    fn recursion_is_an_error_naming_the_call() {
        let f = function("f", &["x"], &["y"], vec![node("f", "local", &["x"], &["y"])]);
        let m = model(vec![node("f", "local", &["in"], &["out"])], vec![f]);
        let e = inline(&m, &m.encode_to_vec()).unwrap_err().to_string();
        assert!(e.contains("nest more than") && e.contains("local:f"), "{e}");
    }
}
