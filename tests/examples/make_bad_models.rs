//! Writes the small hand-built ONNX models in `tests/data/bad/` that the CLI tests use to check
//! that bad models give a clean error (never a panic).
//!
//! ```text
//! cargo run -p tests --example make_bad_models
//! ```
//!
//! Every model is built from tract-onnx's protobuf types and encoded with prost, so the output is
//! byte-for-byte reproducible; `tests/tests/models.rs` checks that the committed files equal what
//! this program builds.

use std::path::Path;

use prost::Message;
use tract_onnx::pb;
use tract_onnx::pb::tensor_proto::DataType;
use tract_onnx::pb::tensor_shape_proto::{Dimension, dimension};

/// A dim of a declared shape: a number or a symbolic name.
enum D {
    N(i64),
    Sym(&'static str),
}

fn value_info(name: &str, elem: DataType, dims: &[D]) -> pb::ValueInfoProto {
    let dim = dims
        .iter()
        .map(|d| Dimension {
            value: Some(match d {
                D::N(n) => dimension::Value::DimValue(*n),
                D::Sym(s) => dimension::Value::DimParam(s.to_string()),
            }),
            ..Default::default()
        })
        .collect();
    pb::ValueInfoProto {
        name: name.into(),
        r#type: Some(pb::TypeProto {
            value: Some(pb::type_proto::Value::TensorType(pb::type_proto::Tensor {
                elem_type: elem as i32,
                shape: Some(pb::TensorShapeProto { dim }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn node(name: &str, op_type: &str, inputs: &[&str], outputs: &[&str]) -> pb::NodeProto {
    pb::NodeProto {
        name: name.into(),
        op_type: op_type.into(),
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: outputs.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

/// A model (ONNX IR version 8, opset 17) with one graph.
fn model(
    graph_name: &str,
    nodes: Vec<pb::NodeProto>,
    inputs: Vec<pb::ValueInfoProto>,
    outputs: Vec<pb::ValueInfoProto>,
) -> Vec<u8> {
    pb::ModelProto {
        ir_version: 8,
        opset_import: vec![pb::OperatorSetIdProto { domain: String::new(), version: 17 }],
        producer_name: "autopar tests/examples/make_bad_models.rs".into(),
        graph: Some(pb::GraphProto {
            name: graph_name.into(),
            node: nodes,
            input: inputs,
            output: outputs,
            ..Default::default()
        }),
        ..Default::default()
    }
    .encode_to_vec()
}

/// Every bad model: file name, what it tests, and its bytes.
pub fn models() -> Vec<(&'static str, &'static str, Vec<u8>)> {
    use D::{N, Sym};
    vec![
        (
            "unsupported_op.onnx",
            "x: f32[2,3] -> NonZero (node `nonzero_0`) -> y: i64[2,nnz]; NonZero is outside the supported ops",
            model(
                "unsupported_op",
                vec![node("nonzero_0", "NonZero", &["x"], &["y"])],
                vec![value_info("x", DataType::Float, &[N(2), N(3)])],
                vec![value_info("y", DataType::Int64, &[N(2), Sym("nnz")])],
            ),
        ),
        (
            "dynamic_dim.onnx",
            "x: f32[batch,4] -> Relu (node `relu_0`) -> y; `batch` is a dim_param that only --input or a feed can bind",
            model(
                "dynamic_dim",
                vec![node("relu_0", "Relu", &["x"], &["y"])],
                vec![value_info("x", DataType::Float, &[Sym("batch"), N(4)])],
                vec![value_info("y", DataType::Float, &[Sym("batch"), N(4)])],
            ),
        ),
        (
            "shape_mismatch.onnx",
            "a: f32[2,3], b: f32[4,5] -> MatMul (node `matmul_0`) -> y; the inner dims 3 and 4 differ",
            model(
                "shape_mismatch",
                vec![node("matmul_0", "MatMul", &["a", "b"], &["y"])],
                vec![value_info("a", DataType::Float, &[N(2), N(3)]), value_info("b", DataType::Float, &[N(4), N(5)])],
                vec![value_info("y", DataType::Float, &[N(2), N(5)])],
            ),
        ),
    ]
}

#[allow(dead_code)] // `tests/tests/models.rs` includes this file for `models()` only.
fn main() -> std::io::Result<()> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/bad");
    std::fs::create_dir_all(&dir)?;
    for (file, what, bytes) in models() {
        std::fs::write(dir.join(file), &bytes)?;
        println!("{file:<22} {:>4} bytes  {what}", bytes.len());
    }
    Ok(())
}
