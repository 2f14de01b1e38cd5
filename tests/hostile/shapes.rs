//! Hostile inputs: shapes (see main.rs). A few hundred bytes of ONNX asking for terabytes, shape
//! products that overflow `usize`, and graphs that write one name twice: each is one clean error
//! naming the node, under the memory and time caps.

use crate::common::onnx::{self, DataType, pb};
#[allow(unused_imports)]
use crate::common::*;

/// Writes `bytes` as `name.onnx` in a fresh directory and runs `autopar inspect` on it, which
/// must fail naming every phrase.
fn inspect_fails(name: &str, bytes: Vec<u8>, phrases: &[&str]) -> String {
    let dir = tempdir();
    let path = dir.path().join(format!("{name}.onnx"));
    std::fs::write(&path, bytes).expect("writing the model");
    fails(&["inspect", path.to_str().expect("a UTF-8 path")], phrases)
}

fn out(name: &str) -> pb::ValueInfoProto {
    onnx::value_info(name, DataType::Float, &[])
}

#[test]
fn constant_of_shape_2_pow_40() {
    let m = onnx::model(
        vec![onnx::node("fill_tb", "ConstantOfShape", &["shape"], &["y"])],
        vec![onnx::ints("shape", &[1], &[1 << 40])],
        vec![],
        vec![out("y")],
    );
    inspect_fails("fill", m, &["fill_tb", "--max-constant-bytes"]);
}

#[test]
fn expand_to_huge() {
    // A constant expanded to 2^40 elements is folded at import: bounded before allocation. (A
    // float initializer would be a parameter, a graph value: the constant is a Constant node.)
    let mut c = onnx::node("c_const", "Constant", &[], &["c"]);
    c.attribute.push(pb::AttributeProto {
        name: "value".into(),
        r#type: pb::attribute_proto::AttributeType::Tensor as i32,
        t: Some(onnx::floats("", &[1], &[1.0])),
        ..Default::default()
    });
    let m = onnx::model(
        vec![c, onnx::node("expand_tb", "Expand", &["c", "shape"], &["y"])],
        vec![onnx::ints("shape", &[1], &[1 << 40])],
        vec![],
        vec![out("y")],
    );
    inspect_fails("expand", m, &["expand_tb", "--max-constant-bytes"]);
    // A graph value expanded past what a usize counts: an overflow, not a wrapped size.
    let m = onnx::model(
        vec![onnx::node("expand_wrap", "Expand", &["x", "shape"], &["y"])],
        vec![onnx::ints("shape", &[3], &[1 << 32, 1 << 32, 4])],
        vec![onnx::value_info("x", DataType::Float, &[4])],
        vec![out("y")],
    );
    inspect_fails("expand_wrap", m, &["expand_wrap", "overflows"]);
}

#[test]
fn pad_huge() {
    let m = onnx::model(
        vec![onnx::node("pad_tb", "Pad", &["c", "pads"], &["y"])],
        vec![onnx::ints("c", &[1], &[7]), onnx::ints("pads", &[2], &[0, 1 << 40])],
        vec![],
        vec![out("y")],
    );
    inspect_fails("pad", m, &["pad_tb", "--max-constant-bytes"]);
    let m = onnx::model(
        vec![onnx::node("pad_wrap", "Pad", &["x", "pads"], &["y"])],
        vec![onnx::ints("pads", &[2], &[i64::MAX, i64::MAX])],
        vec![onnx::value_info("x", DataType::Float, &[4])],
        vec![out("y")],
    );
    inspect_fails("pad_wrap", m, &["pad_wrap", "overflows"]);
}

#[test]
fn conv_huge_padding() {
    for (pads, phrase) in [(1i64 << 40, "overflows"), (i64::MAX, "padding")] {
        let mut conv = onnx::node("conv_pad", "Conv", &["x", "w"], &["y"]);
        conv.attribute.push(onnx::attr_ints("pads", &[pads; 4]));
        let m = onnx::model(
            vec![conv],
            vec![onnx::floats("w", &[1, 1, 1, 1], &[1.0])],
            vec![onnx::value_info("x", DataType::Float, &[1, 1, 4, 4])],
            vec![out("y")],
        );
        inspect_fails("conv", m, &["conv_pad", phrase]);
    }
}

#[test]
fn reshape_whose_product_overflows() {
    // 4 * (2^62 + 1) wraps to 4, the input's count: a wrapping product took it for a view.
    let m = onnx::model(
        vec![onnx::node("reshape_wrap", "Reshape", &["x", "shape"], &["y"])],
        vec![onnx::ints("shape", &[2], &[4, (1 << 62) + 1])],
        vec![onnx::value_info("x", DataType::Float, &[4])],
        vec![out("y")],
    );
    inspect_fails("reshape", m, &["reshape_wrap", "cannot reshape"]);
}

#[test]
fn duplicate_outputs() {
    let m = onnx::model(
        vec![onnx::node("writer_a", "Relu", &["x"], &["y"]), onnx::node("writer_b", "Sigmoid", &["x"], &["y"])],
        vec![],
        vec![onnx::value_info("x", DataType::Float, &[3])],
        vec![out("y")],
    );
    inspect_fails("dup", m, &["writer_b", "writer_a", "already defined"]);
}

#[test]
fn split_with_more_outputs_than_elements() {
    let m = onnx::model(
        vec![onnx::node("split_many", "Split", &["x"], &["a", "b", "c"])],
        vec![],
        vec![onnx::value_info("x", DataType::Float, &[2])],
        vec![out("a")],
    );
    inspect_fails("split", m, &["split_many", "more outputs than elements"]);
}

#[test]
fn the_constant_ceiling_is_a_flag() {
    let dir = tempdir();
    let path = dir.path().join("fill.onnx");
    let m = onnx::model(
        vec![onnx::node("fill_small", "ConstantOfShape", &["shape"], &["y"])],
        vec![onnx::ints("shape", &[1], &[1000])],
        vec![],
        vec![out("y")],
    );
    std::fs::write(&path, m).expect("writing the model");
    let path = path.to_str().expect("a UTF-8 path");
    ok(&["inspect", path]);
    ok(&["inspect", path, "--max-constant-bytes", "4000"]);
    fails(&["inspect", path, "--max-constant-bytes", "3999"], &["fill_small", "4000 bytes", "3999"]);
}
