//! Import of the indexing family's rewrites (Einsum, Tile, OneHot, EyeLike) and ops, checked by
//! running the imported graph on the CPU kernels against values computed here by definition.

use std::collections::HashMap;

use ir::{Graph, Op, Tensor, Value};
use kernels::cpu::{CpuContext, eval};
use prost::Message;
use tracer::{ImportOptions, import_bytes};
use tract_onnx::pb;

fn vi(name: &str, elem: i32, dims: &[usize]) -> pb::ValueInfoProto {
    use pb::tensor_shape_proto::{Dimension, dimension::Value};
    let dim =
        dims.iter().map(|&d| Dimension { denotation: String::new(), value: Some(Value::DimValue(d as i64)) }).collect();
    pb::ValueInfoProto {
        name: name.into(),
        r#type: Some(pb::TypeProto {
            denotation: String::new(),
            value: Some(pb::type_proto::Value::TensorType(pb::type_proto::Tensor {
                elem_type: elem,
                shape: Some(pb::TensorShapeProto { dim }),
            })),
        }),
        doc_string: String::new(),
    }
}

fn attr_s(name: &str, s: &str) -> pb::AttributeProto {
    pb::AttributeProto { name: name.into(), s: s.as_bytes().to_vec(), r#type: 3, ..Default::default() }
}

fn attr_i(name: &str, i: i64) -> pb::AttributeProto {
    pb::AttributeProto { name: name.into(), i, r#type: 2, ..Default::default() }
}

fn ints_init(name: &str, v: &[i64]) -> pb::TensorProto {
    pb::TensorProto {
        name: name.into(),
        dims: vec![v.len() as i64],
        data_type: 7,
        int64_data: v.to_vec(),
        ..Default::default()
    }
}

/// A one-node model: float inputs `x{i}` of the given shapes, constant i64 inputs after them.
fn one_node(op: &str, shapes: &[&[usize]], consts: &[(&str, &[i64])], attrs: Vec<pb::AttributeProto>) -> Vec<u8> {
    let mut inputs: Vec<String> = (0..shapes.len()).map(|i| format!("x{i}")).collect();
    inputs.extend(consts.iter().map(|(n, _)| n.to_string()));
    let node = pb::NodeProto {
        input: inputs,
        output: vec!["y".into()],
        name: op.into(),
        op_type: op.into(),
        attribute: attrs,
        ..Default::default()
    };
    pb::ModelProto {
        ir_version: 8,
        opset_import: vec![pb::OperatorSetIdProto { domain: String::new(), version: 17 }],
        graph: Some(pb::GraphProto {
            node: vec![node],
            name: "t".into(),
            initializer: consts.iter().map(|(n, v)| ints_init(n, v)).collect(),
            input: shapes.iter().enumerate().map(|(i, s)| vi(&format!("x{i}"), 1, s)).collect(),
            output: vec![vi("y", 0, &[])],
            ..Default::default()
        }),
        ..Default::default()
    }
    .encode_to_vec()
}

/// Runs `g` on the CPU with the given inputs (by name) and returns output `y`.
fn run(g: &Graph, feeds: &HashMap<String, Tensor>) -> Tensor {
    let ctx = CpuContext::new(1).unwrap();
    let mut vals: HashMap<Value, Tensor> = HashMap::new();
    for n in g.topo_order().unwrap() {
        let node = g.node(n);
        let outs = match &node.op {
            Op::Input { name } => vec![feeds[name].clone()],
            op => {
                let ins: Vec<Tensor> = g.node_inputs(n).iter().map(|v| vals[v].clone()).collect();
                let refs: Vec<&Tensor> = ins.iter().collect();
                eval(&ctx, op, &refs).unwrap_or_else(|e| panic!("{}: {e}", node.name))
            }
        };
        for (k, t) in outs.into_iter().enumerate() {
            vals.insert(Value::new(n, k), t);
        }
    }
    let y = g.outputs.iter().find(|(n, _)| n == "y").unwrap().1;
    vals[&y].clone()
}

fn seq(shape: &[usize], seed: u32) -> Tensor {
    let n: usize = shape.iter().product();
    Tensor::f32(shape, (0..n).map(|i| ((i as u32 * 7 + seed * 13) % 11) as f32 - 5.0).collect())
}

fn import(bytes: &[u8]) -> Graph {
    import_bytes(bytes, "t", "t", None, &ImportOptions::default()).unwrap_or_else(|e| panic!("{e}"))
}

/// Naive einsum by definition over labelled dims (no ellipsis): sums every label not in `out`.
fn einsum_ref(terms: &[&str], out: &str, xs: &[&Tensor]) -> Vec<f32> {
    let mut size: HashMap<char, usize> = HashMap::new();
    for (t, x) in terms.iter().zip(xs) {
        for (c, &d) in t.chars().zip(x.shape()) {
            size.insert(c, d);
        }
    }
    let labels: Vec<char> = size.keys().copied().collect();
    let outl: Vec<char> = out.chars().collect();
    let out_n: usize = outl.iter().map(|c| size[c]).product();
    let mut y = vec![0f32; out_n];
    let total: usize = labels.iter().map(|c| size[c]).product();
    for mut k in 0..total {
        let mut at: HashMap<char, usize> = HashMap::new();
        for c in &labels {
            at.insert(*c, k % size[c]);
            k /= size[c];
        }
        let flat = |ls: &mut dyn Iterator<Item = char>, dims: &[usize]| {
            ls.zip(dims).fold(0usize, |acc, (c, &d)| acc * d + at[&c])
        };
        let mut p = 1f32;
        for (t, x) in terms.iter().zip(xs) {
            p *= x.as_f32().unwrap()[flat(&mut t.chars(), x.shape())];
        }
        let od: Vec<usize> = outl.iter().map(|c| size[c]).collect();
        y[flat(&mut outl.iter().copied(), &od)] += p;
    }
    y
}

#[test]
fn einsum_rewrites_match_the_definition() {
    let cases: [(&str, &[&[usize]]); 8] = [
        ("bhqd,bhkd->bhqk", &[&[2, 3, 4, 5], &[2, 3, 6, 5]]),
        ("bhqk,bhkd->bhqd", &[&[2, 3, 4, 6], &[2, 3, 6, 5]]),
        ("i,j->ij", &[&[4], &[3]]),
        ("bij,jk->bik", &[&[2, 3, 4], &[4, 5]]),
        ("ij->ji", &[&[3, 4]]),
        ("ij->", &[&[3, 4]]),
        ("bnd,nd->bn", &[&[2, 3, 4], &[3, 4]]),
        ("abc,cd->dba", &[&[2, 3, 4], &[4, 5]]),
    ];
    for (eq, shapes) in cases {
        let g = import(&one_node("Einsum", shapes, &[], vec![attr_s("equation", eq)]));
        let xs: Vec<Tensor> = shapes.iter().enumerate().map(|(i, s)| seq(s, i as u32)).collect();
        let feeds = xs.iter().enumerate().map(|(i, t)| (format!("x{i}"), t.clone())).collect();
        let y = run(&g, &feeds);
        let (lhs, out) = eq.split_once("->").unwrap();
        let terms: Vec<&str> = lhs.split(',').collect();
        let want = einsum_ref(&terms, out, &xs.iter().collect::<Vec<_>>());
        assert_eq!(y.as_f32().unwrap(), &want[..], "{eq}");
    }
    // The ellipsis and an implicit output.
    let g = import(&one_node("Einsum", &[&[2, 3, 4], &[4, 5]], &[], vec![attr_s("equation", "...ij,jk")]));
    assert_eq!(g.outputs.len(), 1);
    let y = run(&g, &[("x0".into(), seq(&[2, 3, 4], 0)), ("x1".into(), seq(&[4, 5], 1))].into());
    let want = einsum_ref(&["aij", "jk"], "aik", &[&seq(&[2, 3, 4], 0), &seq(&[4, 5], 1)]);
    assert_eq!(y.as_f32().unwrap(), &want[..]);
    let e = import_bytes(
        &one_node("Einsum", &[&[3, 3]], &[], vec![attr_s("equation", "ii->i")]),
        "t",
        "t",
        None,
        &ImportOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("diagonals"), "{e}");
}

#[test]
fn tile_one_hot_and_eye_like() {
    let g = import(&one_node("Tile", &[&[2, 3]], &[("reps", &[2, 1])], vec![]));
    let x = seq(&[2, 3], 0);
    let y = run(&g, &[("x0".into(), x.clone())].into());
    let xv = x.as_f32().unwrap();
    assert_eq!(y.shape(), &[4, 3]);
    assert_eq!(y.as_f32().unwrap(), &[xv, xv].concat()[..]);
    let g = import(&one_node("Tile", &[&[2, 3]], &[("reps", &[1, 2])], vec![]));
    let y = run(&g, &[("x0".into(), x.clone())].into());
    assert_eq!(y.as_f32().unwrap(), &[&xv[..3], &xv[..3], &xv[3..], &xv[3..]].concat()[..]);

    // OneHot of float indices [1, -1, 5] with depth 3 on axis 0, values [off, on] = [2, 7].
    let mut m =
        pb::ModelProto::decode(&one_node("OneHot", &[&[3]], &[("depth", &[3])], vec![attr_i("axis", 0)])[..]).unwrap();
    let gr = m.graph.as_mut().unwrap();
    gr.node[0].input.push("values".into());
    gr.initializer.push(pb::TensorProto {
        name: "values".into(),
        dims: vec![2],
        data_type: 7,
        int64_data: vec![2, 7],
        ..Default::default()
    });
    let g = import(&m.encode_to_vec());
    let y = run(&g, &[("x0".into(), Tensor::f32([3], vec![1.0, -1.0, 5.0]))].into());
    assert_eq!((y.shape(), y.as_i64().unwrap()), (&[3, 3][..], &[2, 2, 2, 7, 2, 2, 2, 7, 2][..]));

    let g = import(&one_node("EyeLike", &[&[2, 4]], &[], vec![attr_i("k", 1)]));
    assert!(matches!(g.node(g.outputs[0].1.node).op, Op::Constant(_)));
    let y = run(&g, &[("x0".into(), seq(&[2, 4], 0))].into());
    assert_eq!(y.as_f32().unwrap(), &[0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]);
}
