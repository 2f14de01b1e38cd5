//! How long importing a long chain of nodes takes: import must stay linear in the node count
//! (issue 22 measured 2.4 s for 40k nodes and 27 s for 80k). Prints figures, asserts no time.
//!
//! ```text
//! cargo test --release -p tracer --test import_speed -- --ignored --nocapture
//! AUTOPAR_CHAIN_NODES=10000,40000,80000,160000 AUTOPAR_CHAIN_OPS=Add cargo test --release -p tracer --test import_speed -- --ignored --nocapture
//! ```

use std::time::Instant;

use prost::Message;
use tracer::{ImportOptions, import_bytes};
use tract_onnx::pb;

fn value_info(name: &str, dims: &[i64]) -> pb::ValueInfoProto {
    use pb::tensor_shape_proto::{Dimension, dimension::Value};
    let dim = dims.iter().map(|&d| Dimension { value: Some(Value::DimValue(d)), ..Default::default() }).collect();
    pb::ValueInfoProto {
        name: name.into(),
        r#type: Some(pb::TypeProto {
            value: Some(pb::type_proto::Value::TensorType(pb::type_proto::Tensor {
                elem_type: pb::tensor_proto::DataType::Float as i32,
                shape: Some(pb::TensorShapeProto { dim }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// `x -> ops[0] -> ops[1] -> ... -> ops[0] -> ...`: `nodes` nodes in one chain, each op
/// `Relu`, `Identity`, `Add` (of a parameter `b`), `Mul` (by `b`) or `AddZero` (an `Add` of a
/// constant zero, which canonicalisation removes). Every node is unnamed (names come from
/// outputs, as exporters often leave them) except every tenth, which repeats one name so the
/// importer has to make names unique.
pub fn chain(nodes: usize, ops: &[&str]) -> Vec<u8> {
    let mut node = Vec::with_capacity(nodes);
    let mut prev = "x".to_string();
    for i in 0..nodes {
        let out = format!("t{i}");
        let (op, input) = match ops[i % ops.len()] {
            "AddZero" => ("Add", vec![prev.clone(), "zero".into()]),
            op @ ("Relu" | "Identity") => (op, vec![prev.clone()]),
            op => (op, vec![prev.clone(), "b".into()]),
        };
        node.push(pb::NodeProto {
            name: if i % 10 == 9 { "same".into() } else { String::new() },
            op_type: op.into(),
            input,
            output: vec![out.clone()],
            ..Default::default()
        });
        prev = out;
    }
    let zero = pb::NodeProto {
        op_type: "Constant".into(),
        output: vec!["zero".into()],
        attribute: vec![pb::AttributeProto {
            name: "value".into(),
            r#type: pb::attribute_proto::AttributeType::Tensor as i32,
            t: Some(pb::TensorProto {
                dims: vec![8],
                data_type: pb::tensor_proto::DataType::Float as i32,
                float_data: vec![0.0; 8],
                ..Default::default()
            }),
            ..Default::default()
        }],
        ..Default::default()
    };
    node.insert(0, zero);
    let b = pb::TensorProto {
        name: "b".into(),
        dims: vec![8],
        data_type: pb::tensor_proto::DataType::Float as i32,
        float_data: vec![0.5; 8],
        ..Default::default()
    };
    pb::ModelProto {
        ir_version: 8,
        opset_import: vec![pb::OperatorSetIdProto { domain: String::new(), version: 17 }],
        graph: Some(pb::GraphProto {
            name: "chain".into(),
            node,
            initializer: vec![b],
            input: vec![value_info("x", &[2, 8])],
            output: vec![value_info(&prev, &[2, 8])],
            ..Default::default()
        }),
        ..Default::default()
    }
    .encode_to_vec()
}

#[test]
#[ignore = "a measurement: run with --release --ignored --nocapture"]
fn chain_import_time() {
    let sizes: Vec<usize> = std::env::var("AUTOPAR_CHAIN_NODES")
        .unwrap_or_else(|_| "10000,40000,80000".into())
        .split(',')
        .map(|s| s.trim().parse().expect("AUTOPAR_CHAIN_NODES is a list of node counts"))
        .collect();
    let ops = std::env::var("AUTOPAR_CHAIN_OPS").unwrap_or_else(|_| "Relu,Add".into());
    let ops: Vec<&str> = ops.split(',').map(str::trim).collect();
    let opts = ImportOptions { load_weights: false, ..Default::default() };
    for n in sizes {
        let bytes = chain(n, &ops);
        let t0 = Instant::now();
        let mut g = import_bytes(&bytes, "chain", "chain", None, &opts).expect("importing the chain");
        let import = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        ir::passes::canonicalize(&mut g).expect("canonicalizing the chain");
        let canon = t1.elapsed().as_secs_f64();
        let t2 = Instant::now();
        ir::verify(&g).expect("the chain verifies");
        let verify = t2.elapsed().as_secs_f64();
        println!(
            "chain of {n:>7} nodes ({}): import {import:.3} s, canonicalize {canon:.3} s, verify {verify:.3} s, total {:.3} s ({} nodes left)",
            ops.join(","),
            import + canon + verify,
            g.node_count()
        );
    }
}
