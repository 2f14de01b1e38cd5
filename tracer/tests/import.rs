//! Import behaviour on small hand-built models: external data, weight-free initializers,
//! dynamic-dim binding, shape folding, and errors that name what is wrong.

use prost::Message;
use tracer::{ImportError, ImportOptions, import_bytes, import_file};
use tract_onnx::pb;

fn vi(name: &str, elem: i32, dims: &[Result<i64, &str>]) -> pb::ValueInfoProto {
    use pb::tensor_shape_proto::{Dimension, dimension::Value};
    let dim = dims
        .iter()
        .map(|d| Dimension {
            denotation: String::new(),
            value: Some(match d {
                Ok(v) => Value::DimValue(*v),
                Err(p) => Value::DimParam(p.to_string()),
            }),
        })
        .collect();
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

fn node(op: &str, ins: &[&str], outs: &[&str], attrs: Vec<pb::AttributeProto>) -> pb::NodeProto {
    pb::NodeProto {
        input: ins.iter().map(|s| s.to_string()).collect(),
        output: outs.iter().map(|s| s.to_string()).collect(),
        name: format!("{op}_{}", outs[0]),
        op_type: op.into(),
        attribute: attrs,
        ..Default::default()
    }
}

fn model(
    nodes: Vec<pb::NodeProto>,
    inputs: Vec<pb::ValueInfoProto>,
    outputs: Vec<pb::ValueInfoProto>,
    inits: Vec<pb::TensorProto>,
) -> Vec<u8> {
    pb::ModelProto {
        ir_version: 8,
        opset_import: vec![pb::OperatorSetIdProto { domain: String::new(), version: 17 }],
        graph: Some(pb::GraphProto {
            node: nodes,
            name: "t".into(),
            initializer: inits,
            input: inputs,
            output: outputs,
            ..Default::default()
        }),
        ..Default::default()
    }
    .encode_to_vec()
}

fn external_weight(location: &str) -> pb::TensorProto {
    pb::TensorProto {
        dims: vec![3, 2],
        data_type: 1,
        name: "w".into(),
        data_location: Some(1),
        external_data: vec![
            pb::StringStringEntryProto { key: "location".into(), value: location.into() },
            pb::StringStringEntryProto { key: "offset".into(), value: "8".into() },
            pb::StringStringEntryProto { key: "length".into(), value: "24".into() },
        ],
        ..Default::default()
    }
}

fn matmul_model(w: pb::TensorProto, batch: Result<i64, &str>) -> Vec<u8> {
    model(
        vec![node("MatMul", &["x", "w"], &["y"], vec![])],
        vec![vi("x", 1, &[batch, Ok(3)])],
        vec![vi("y", 1, &[batch, Ok(2)])],
        vec![w],
    )
}

#[test]
fn external_data_is_read_and_missing_data_is_weight_free() {
    let dir = tempfile::tempdir().unwrap();
    let mut bytes = vec![0u8; 8];
    for i in 0..6 {
        bytes.extend_from_slice(&(i as f32).to_le_bytes());
    }
    std::fs::write(dir.path().join("w.bin"), &bytes).unwrap();
    let path = dir.path().join("m.onnx");
    std::fs::write(&path, matmul_model(external_weight("w.bin"), Ok(4))).unwrap();
    let g = import_file(&path, &ImportOptions::default()).unwrap();
    assert_eq!(g.param_data["w"].as_f32().unwrap(), &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    // Without the data file the parameter is shape-only, and the model still imports.
    std::fs::remove_file(dir.path().join("w.bin")).unwrap();
    let g = import_file(&path, &ImportOptions::default()).unwrap();
    assert!(g.param_data.is_empty());
    assert_eq!(g.param_stats(), (6, 24));
}

#[test]
fn initializer_without_data_is_weight_free() {
    let w = pb::TensorProto { dims: vec![3, 2], data_type: 1, name: "w".into(), ..Default::default() };
    let g = import_bytes(&matmul_model(w, Ok(4)), "m", "m", None, &ImportOptions::default()).unwrap();
    assert!(g.param_data.is_empty());
    assert_eq!(g.param_stats().0, 6);
}

#[test]
fn dynamic_dims_need_a_binding_that_names_the_input() {
    let w = pb::TensorProto {
        dims: vec![3, 2],
        data_type: 1,
        name: "w".into(),
        float_data: vec![0.0; 6],
        ..Default::default()
    };
    let bytes = matmul_model(w, Err("batch"));
    let e = import_bytes(&bytes, "m", "m", None, &ImportOptions::default()).unwrap_err();
    assert!(matches!(e, ImportError::UnboundDim { .. }));
    let msg = e.to_string();
    assert!(msg.contains("input x") && msg.contains("batch") && msg.contains("--input x=Nx3"), "{msg}");
    let mut opts = ImportOptions::default();
    opts.input_shapes.insert("x".into(), vec![5, 3]);
    let g = import_bytes(&bytes, "m", "m", None, &opts).unwrap();
    assert_eq!(g.meta(g.outputs[0].1).shape, vec![5, 2]);
    // A binding for an input that does not exist is an error naming it.
    let mut opts = ImportOptions::default();
    opts.input_shapes.insert("nope".into(), vec![5, 3]);
    let msg = import_bytes(&bytes, "m", "m", None, &opts).unwrap_err().to_string();
    assert!(msg.contains("nope") && msg.contains("inputs: x"), "{msg}");
}

#[test]
fn shape_computations_fold_away() {
    // y = Reshape(x, Concat(Shape(x)[0:1], [-1])) with a Gather on the shape: no shape op remains.
    let i64t = |name: &str, v: Vec<i64>| pb::TensorProto {
        dims: vec![v.len() as i64],
        data_type: 7,
        name: name.into(),
        int64_data: v,
        ..Default::default()
    };
    let scalar0 =
        pb::TensorProto { dims: vec![], data_type: 7, name: "zero".into(), int64_data: vec![0], ..Default::default() };
    let axis0 = pb::AttributeProto { name: "axis".into(), r#type: 2, i: 0, ..Default::default() };
    let nodes = vec![
        node("Shape", &["x"], &["s"], vec![]),
        node("Gather", &["s", "zero"], &["b"], vec![axis0.clone()]),
        node("Unsqueeze", &["b", "axes"], &["b1"], vec![]),
        node("Concat", &["b1", "minus1"], &["target"], vec![axis0]),
        node("Reshape", &["x", "target"], &["y"], vec![]),
    ];
    let bytes = model(
        nodes,
        vec![vi("x", 1, &[Err("n"), Ok(3), Ok(4)])],
        vec![vi("y", 1, &[Err("n"), Ok(12)])],
        vec![i64t("axes", vec![0]), i64t("minus1", vec![-1]), scalar0],
    );
    let mut opts = ImportOptions::default();
    opts.input_shapes.insert("x".into(), vec![2, 3, 4]);
    let g = import_bytes(&bytes, "m", "m", None, &opts).unwrap();
    let ops: Vec<&str> = g.g.node_weights().map(|n| n.op.name()).collect();
    assert_eq!(ops, vec!["input", "reshape"], "{}", g.to_text());
    assert_eq!(g.meta(g.outputs[0].1).shape, vec![2, 12]);
}

#[test]
fn unsupported_op_names_node_and_op() {
    // Det has no kernel; NonZero and the other data-dependent ops have their own error
    // (tests/fold.rs).
    let bytes = model(
        vec![node("Det", &["x"], &["y"], vec![])],
        vec![vi("x", 1, &[Ok(3), Ok(3)])],
        vec![vi("y", 1, &[])],
        vec![],
    );
    let msg = import_bytes(&bytes, "m", "m", None, &ImportOptions::default()).unwrap_err().to_string();
    assert!(msg.contains("Det_y") && msg.contains("Det") && msg.contains("autopar inspect --ops"), "{msg}");
}

#[test]
fn garbage_is_a_decode_error_not_a_panic() {
    for bytes in [vec![], vec![0xff; 64], b"not an onnx model at all".to_vec()] {
        let e = import_bytes(&bytes, "junk.onnx", "junk", None, &ImportOptions::default()).unwrap_err();
        assert!(e.to_string().contains("junk.onnx"), "{e}");
    }
}
