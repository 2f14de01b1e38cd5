//! Checked shape arithmetic (issue 22): inference and the verifier never accept a meta whose
//! element count or byte size overflows, tensors cannot hold such a shape, and the graph's
//! bookkeeping (names, dead-node removal, canonicalisation) stays linear.

use ir::{BinaryOp, ConvAttrs, DType, Graph, Op, PoolAttrs, SliceAxis, Tensor, TensorMeta, UnaryOp, verify};

fn f32s(shape: &[usize]) -> TensorMeta {
    TensorMeta::new(DType::F32, shape.to_vec())
}

/// Inference fails and says `phrase`.
fn refused(op: Op, ins: &[TensorMeta], phrase: &str) {
    match op.infer(ins) {
        Ok(outs) => panic!("{} inferred {outs:?}", op.name()),
        Err(e) => assert!(e.contains(phrase), "`{phrase}` is not in: {e}"),
    }
}

#[test]
fn reshape_to_a_product_that_wraps_is_refused() {
    // 4 * (2^62 + 1) = 2^64 + 4 wraps to 4: a wrapping product accepted it.
    refused(Op::Reshape { shape: vec![4, (1 << 62) + 1] }, &[f32s(&[4])], "cannot reshape");
    refused(Op::Reshape { shape: vec![0, 1 << 40, 1 << 40] }, &[f32s(&[0])], "cannot reshape");
    assert!(Op::Reshape { shape: vec![2, 2] }.infer(&[f32s(&[4])]).is_ok());
}

#[test]
fn outputs_past_the_byte_limit_are_refused() {
    refused(Op::Expand { shape: vec![1 << 32, 1 << 32, 2] }, &[f32s(&[2])], "overflows");
    // 2^61 f32 elements count fine but take 2^63 bytes.
    refused(Op::Expand { shape: vec![1 << 61] }, &[f32s(&[1])], "bytes");
    assert!(Op::Expand { shape: vec![1 << 40] }.infer(&[f32s(&[1])]).is_ok());
    // A gather's output multiplies the index shape into the data's.
    let idx = TensorMeta::new(DType::I64, vec![1 << 31, 1 << 31]);
    refused(Op::Gather { axis: 0 }, &[f32s(&[1 << 31, 4]), idx], "overflows");
    let ok = TensorMeta::new(DType::I64, vec![3]);
    assert!(Op::Gather { axis: 0 }.infer(&[f32s(&[5, 4]), ok]).is_ok());
}

#[test]
fn attribute_arithmetic_is_checked() {
    refused(Op::Pad { pads: vec![usize::MAX, 1], value: 0.0 }, &[f32s(&[4])], "overflows");
    let big = usize::MAX / 2;
    refused(Op::Concat { axis: 0 }, &[f32s(&[big]), f32s(&[big]), f32s(&[big])], "overflows");
    refused(Op::Split { axis: 0, sizes: vec![usize::MAX, 5] }, &[f32s(&[4])], "do not split");
    // A slice whose last index wraps an i64 must not pass the bounds check.
    let axes = vec![SliceAxis { axis: 0, start: 0, len: usize::MAX, step: i64::MAX }];
    refused(Op::Slice { axes }, &[f32s(&[4])], "out of bounds");
    let conv = |pads: usize, dil: usize| {
        Op::Conv(ConvAttrs { strides: [1, 1], pads: [pads; 4], dilations: [dil, 1], group: 1 })
    };
    refused(conv(usize::MAX, 1), &[f32s(&[1, 1, 4, 4]), f32s(&[1, 1, 1, 1])], "padding");
    refused(conv(1 << 40, 1), &[f32s(&[1, 1, 4, 4]), f32s(&[1, 1, 1, 1])], "overflows");
    refused(conv(0, usize::MAX), &[f32s(&[1, 1, 4, 4]), f32s(&[1, 1, 3, 1])], "dilation");
    let pool = PoolAttrs {
        kernel: [usize::MAX, 1],
        strides: [1, 1],
        pads: [0; 4],
        dilations: [2, 1],
        ceil_mode: false,
        count_include_pad: false,
    };
    refused(Op::MaxPool(pool), &[f32s(&[1, 1, 4, 4])], "dilation");
}

#[test]
fn flops_saturate_instead_of_overflowing() {
    let a = PoolAttrs {
        kernel: [1 << 40, 1 << 40],
        strides: [1, 1],
        pads: [0; 4],
        dilations: [1, 1],
        ceil_mode: false,
        count_include_pad: false,
    };
    assert_eq!(Op::MaxPool(a).flops(&[], &[f32s(&[1 << 40])]), u64::MAX);
    assert_eq!(Op::MatMul.flops(&[f32s(&[1 << 40, 1 << 40])], &[f32s(&[1 << 40, 1 << 20])]), u64::MAX);
    assert_eq!(Op::MatMul.flops(&[f32s(&[2, 3])], &[f32s(&[2, 4])]), 48);
}

#[test]
fn tensors_cannot_hold_a_wrapped_shape() {
    // [2^63, 2] wraps to 0 elements: an empty buffer used to match it.
    let e = Tensor::new(vec![1usize << 63, 2], ir::Data::F32(vec![])).unwrap_err();
    assert!(e.to_string().contains("more than a usize can count"), "{e}");
    assert!(Tensor::new(vec![0usize, 1 << 62], ir::Data::F32(vec![])).is_err());
    assert!(Tensor::new(vec![0usize, 3], ir::Data::F32(vec![])).is_ok());
    assert!(Tensor::f32([2], vec![1.0, 2.0]).reshaped(vec![(1usize << 63) + 1, 2]).is_err());
    assert_eq!(TensorMeta::new(DType::F32, vec![1 << 40, 1 << 40]).numel(), usize::MAX);
}

#[test]
fn the_verifier_rejects_declared_metas_that_overflow() {
    let mut g = Graph::new("huge");
    let x = g.input("x", f32s(&[1 << 40, 1 << 40]));
    g.add_node_raw("y", Op::Unary(UnaryOp::Relu), &[x], vec![f32s(&[1 << 40, 1 << 40])]);
    let e = verify(&g).unwrap_err();
    assert!(e.0.iter().any(|e| e.node.as_deref() == Some("x") && e.message.contains("overflows")), "{e}");
    // The relu's meta is checked by inference: it fails there too, naming the relu.
    assert!(e.0.iter().any(|e| e.node.as_deref() == Some("y")), "{e}");
}

#[test]
fn repeated_names_get_suffixes_in_order() {
    let mut g = Graph::new("names");
    let x = g.input("x", f32s(&[2]));
    let mut v = x;
    for _ in 0..4 {
        v = g.add1("n", Op::Unary(UnaryOp::Relu), &[v]).unwrap();
    }
    // A base that looks like a suffixed name is taken as it is, or suffixed in turn.
    g.add1("n.5", Op::Unary(UnaryOp::Relu), &[v]).unwrap();
    g.add1("n", Op::Unary(UnaryOp::Relu), &[v]).unwrap();
    g.add1("n.5", Op::Unary(UnaryOp::Relu), &[v]).unwrap();
    let names: Vec<&str> = g.g.node_weights().map(|n| n.name.as_str()).collect();
    assert_eq!(names, ["x", "n", "n.1", "n.2", "n.3", "n.5", "n.4", "n.5.1"]);
    verify(&g).unwrap();
}

#[test]
fn removing_dead_nodes_keeps_indices_and_frees_names() {
    let mut g = Graph::new("dead");
    let x = g.input("x", f32s(&[2]));
    let c = g.constant("c", Tensor::f32([2], vec![1.0, 2.0]));
    let mut keep = x;
    for i in 0..50 {
        // Fifty dead readers of the shared constant, and a live chain.
        g.add1(&format!("dead{i}"), Op::Binary(BinaryOp::Add), &[x, c]).unwrap();
        keep = g.add1("live", Op::Binary(BinaryOp::Mul), &[keep, c]).unwrap();
    }
    g.set_output("y", keep);
    let before: Vec<(ir::NodeIndex, String)> =
        g.g.node_indices()
            .filter(|&n| !g.node(n).name.starts_with("dead"))
            .map(|n| (n, g.node(n).name.clone()))
            .collect();
    assert_eq!(g.remove_dead(), 50);
    let after: Vec<(ir::NodeIndex, String)> = g.g.node_indices().map(|n| (n, g.node(n).name.clone())).collect();
    assert_eq!(before, after);
    assert_eq!(g.users(c).len(), 50);
    verify(&g).unwrap();
    // The freed name is free again.
    let d = g.add1("dead0", Op::Unary(UnaryOp::Relu), &[x]).unwrap();
    assert_eq!(g.node(d.node).name, "dead0");
}

#[test]
fn canonicalize_removes_neutral_ops_along_a_long_chain() {
    let mut g = Graph::new("chain");
    let x = g.input("x", f32s(&[4]));
    let zero = g.constant("zero", Tensor::f32([4], vec![0.0; 4]));
    let w = g.param("w", f32s(&[4]), None);
    let mut v = x;
    for i in 0..3000 {
        v = match i % 3 {
            0 => g.add1("add0", Op::Binary(BinaryOp::Add), &[v, zero]).unwrap(),
            1 => g.add1("id", Op::Identity, &[v]).unwrap(),
            _ => g.add1("mul", Op::Binary(BinaryOp::Mul), &[v, w]).unwrap(),
        };
    }
    g.set_output("y", v);
    let stats = ir::passes::canonicalize(&mut g).unwrap();
    assert_eq!(stats.rewritten, 1);
    let ops: Vec<&str> = g.g.node_weights().map(|n| n.op.name()).filter(|&o| o != "mul").collect();
    assert_eq!(ops, ["input", "param"]);
    assert_eq!(g.g.node_weights().filter(|n| n.op.name() == "mul").count(), 1000);
}
