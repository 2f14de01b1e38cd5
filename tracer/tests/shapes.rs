//! Hostile shapes and graph integrity at import (issue 22): sizes that overflow or ask for more
//! memory than a constant may take are errors naming the node, before anything is allocated;
//! a name written twice, a Split into more outputs than elements and constant indices out of
//! range are errors, not silent results.

use ir::{DType, Op};
use prost::Message;
use tracer::{ImportError, ImportOptions, import_bytes};
use tract_onnx::pb;

fn vi(name: &str, elem: i32, dims: &[i64]) -> pb::ValueInfoProto {
    use pb::tensor_shape_proto::{Dimension, dimension::Value};
    let dim = dims.iter().map(|&d| Dimension { value: Some(Value::DimValue(d)), ..Default::default() }).collect();
    pb::ValueInfoProto {
        name: name.into(),
        r#type: Some(pb::TypeProto {
            value: Some(pb::type_proto::Value::TensorType(pb::type_proto::Tensor {
                elem_type: elem,
                shape: Some(pb::TensorShapeProto { dim }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn node(name: &str, op: &str, ins: &[&str], outs: &[&str], attrs: Vec<pb::AttributeProto>) -> pb::NodeProto {
    pb::NodeProto {
        name: name.into(),
        op_type: op.into(),
        input: ins.iter().map(|s| s.to_string()).collect(),
        output: outs.iter().map(|s| s.to_string()).collect(),
        attribute: attrs,
        ..Default::default()
    }
}

fn attr_int(name: &str, i: i64) -> pb::AttributeProto {
    pb::AttributeProto { name: name.into(), r#type: 2, i, ..Default::default() }
}

fn attr_ints(name: &str, ints: &[i64]) -> pb::AttributeProto {
    pb::AttributeProto { name: name.into(), r#type: 7, ints: ints.to_vec(), ..Default::default() }
}

fn ints(name: &str, dims: &[i64], v: &[i64]) -> pb::TensorProto {
    pb::TensorProto {
        name: name.into(),
        dims: dims.to_vec(),
        data_type: 7,
        int64_data: v.to_vec(),
        ..Default::default()
    }
}

fn floats(name: &str, dims: &[i64], v: &[f32]) -> pb::TensorProto {
    pb::TensorProto {
        name: name.into(),
        dims: dims.to_vec(),
        data_type: 1,
        float_data: v.to_vec(),
        ..Default::default()
    }
}

fn model(
    nodes: Vec<pb::NodeProto>,
    inits: Vec<pb::TensorProto>,
    inputs: Vec<pb::ValueInfoProto>,
    outputs: Vec<&str>,
) -> Vec<u8> {
    pb::ModelProto {
        ir_version: 8,
        opset_import: vec![pb::OperatorSetIdProto { domain: String::new(), version: 17 }],
        graph: Some(pb::GraphProto {
            name: "t".into(),
            node: nodes,
            initializer: inits,
            input: inputs,
            output: outputs.into_iter().map(|o| vi(o, 1, &[])).collect(),
            ..Default::default()
        }),
        ..Default::default()
    }
    .encode_to_vec()
}

fn import(bytes: &[u8]) -> Result<ir::Graph, ImportError> {
    import_bytes(bytes, "m", "m", None, &ImportOptions::default())
}

/// The import fails, and its message names every phrase.
fn fails(bytes: &[u8], phrases: &[&str]) -> String {
    let msg = match import(bytes) {
        Ok(g) => panic!("imported:\n{}", g.to_text()),
        Err(e) => e.to_string(),
    };
    assert!(!msg.contains("internal error"), "{msg}");
    for p in phrases {
        assert!(msg.contains(p), "`{p}` is not in: {msg}");
    }
    msg
}

#[test]
fn a_huge_constant_of_shape_is_refused_before_it_is_allocated() {
    let bytes = model(
        vec![node("fill", "ConstantOfShape", &["shape"], &["y"], vec![])],
        vec![ints("shape", &[1], &[1 << 40])],
        vec![],
        vec!["y"],
    );
    fails(&bytes, &["fill", "f32[1099511627776]", "--max-constant-bytes"]);
    // Past usize: an overflow, not a wrapped count.
    let bytes = model(
        vec![node("fill", "ConstantOfShape", &["shape"], &["y"], vec![])],
        vec![ints("shape", &[3], &[1 << 32, 1 << 32, 1 << 32])],
        vec![],
        vec!["y"],
    );
    fails(&bytes, &["fill", "overflows"]);
}

#[test]
fn the_constant_ceiling_is_an_option() {
    let bytes = model(
        vec![node("fill", "ConstantOfShape", &["shape"], &["y"], vec![])],
        vec![ints("shape", &[1], &[1000])],
        vec![],
        vec!["y"],
    );
    assert!(import(&bytes).is_ok());
    let opts = ImportOptions { max_constant_bytes: 3999, ..Default::default() };
    let msg = import_bytes(&bytes, "m", "m", None, &opts).unwrap_err().to_string();
    assert!(msg.contains("fill") && msg.contains("4000 bytes") && msg.contains("3999"), "{msg}");
    let opts = ImportOptions { max_constant_bytes: 4000, ..Default::default() };
    assert!(import_bytes(&bytes, "m", "m", None, &opts).is_ok());
}

#[test]
fn folding_is_bounded_by_the_ceiling() {
    // Expand and Pad of constants are folded at import: their results are constants too.
    let expand = model(
        vec![node("grow", "Expand", &["c", "shape"], &["y"], vec![])],
        vec![ints("c", &[1], &[7]), ints("shape", &[2], &[1 << 20, 1 << 20])],
        vec![],
        vec!["y"],
    );
    fails(&expand, &["grow", "i64[1048576,1048576]", "--max-constant-bytes"]);
    let pad = model(
        vec![node("wide", "Pad", &["c", "pads"], &["y"], vec![])],
        vec![ints("c", &[1], &[7]), ints("pads", &[2], &[0, 1 << 40])],
        vec![],
        vec!["y"],
    );
    fails(&pad, &["wide", "--max-constant-bytes"]);
    let range = model(
        vec![node("count", "Range", &["a", "b", "d"], &["y"], vec![])],
        vec![ints("a", &[], &[i64::MIN]), ints("b", &[], &[i64::MAX]), ints("d", &[], &[1])],
        vec![],
        vec!["y"],
    );
    fails(&range, &["count"]);
}

#[test]
fn shapes_of_graph_values_that_overflow_name_the_node() {
    let x = || vec![vi("x", 1, &[4])];
    // 4 * (2^62 + 1) wraps to 4, the input's element count: it used to pass.
    let reshape = model(
        vec![node("wrap", "Reshape", &["x", "shape"], &["y"], vec![])],
        vec![ints("shape", &[2], &[4, (1 << 62) + 1])],
        x(),
        vec!["y"],
    );
    fails(&reshape, &["wrap"]);
    let expand = model(
        vec![node("grow", "Expand", &["x", "shape"], &["y"], vec![])],
        vec![ints("shape", &[3], &[1 << 32, 1 << 32, 4])],
        x(),
        vec!["y"],
    );
    fails(&expand, &["grow", "overflows"]);
    let pad = model(
        vec![node("wide", "Pad", &["x", "pads"], &["y"], vec![])],
        vec![ints("pads", &[2], &[i64::MAX, i64::MAX])],
        x(),
        vec!["y"],
    );
    fails(&pad, &["wide", "overflows"]);
    // A graph value of 4 TiB is only metadata: it imports (planning sees its size).
    let big = model(
        vec![node("grow", "Expand", &["x", "shape"], &["y"], vec![])],
        vec![ints("shape", &[2], &[1 << 38, 4])],
        x(),
        vec!["y"],
    );
    let g = import(&big).unwrap();
    assert_eq!(g.meta(g.outputs[0].1).bytes(), 1 << 42);
}

#[test]
fn conv_with_huge_padding_is_an_error_naming_the_node() {
    let conv = |pads: i64| {
        model(
            vec![node("conv", "Conv", &["x", "w"], &["y"], vec![attr_ints("pads", &[pads; 4])])],
            vec![floats("w", &[1, 1, 1, 1], &[1.0])],
            vec![vi("x", 1, &[1, 1, 4, 4])],
            vec!["y"],
        )
    };
    fails(&conv(1 << 40), &["conv", "overflows"]);
    fails(&conv(i64::MAX), &["conv", "padding", "overflows"]);
    let g = import(&conv(2)).unwrap();
    assert_eq!(g.meta(g.outputs[0].1).shape, vec![1, 1, 8, 8]);
    // SAME padding with a dilation that overflows the kernel's extent.
    let same = model(
        vec![node(
            "same",
            "Conv",
            &["x", "w"],
            &["y"],
            vec![
                pb::AttributeProto {
                    name: "auto_pad".into(),
                    r#type: 3,
                    s: b"SAME_UPPER".to_vec(),
                    ..Default::default()
                },
                attr_ints("dilations", &[i64::MAX, 1]),
            ],
        )],
        vec![floats("w", &[1, 1, 3, 1], &[1.0; 3])],
        vec![vi("x", 1, &[1, 1, 4, 4])],
        vec!["y"],
    );
    fails(&same, &["same", "overflows"]);
}

#[test]
fn huge_inputs_and_initializers_are_errors() {
    let bytes = model(
        vec![node("r", "Relu", &["x"], &["y"], vec![])],
        vec![],
        vec![vi("x", 1, &[1 << 40, 1 << 40])],
        vec!["y"],
    );
    fails(&bytes, &["input x", "overflows"]);
    let mut opts = ImportOptions::default();
    opts.input_shapes.insert("x".into(), vec![usize::MAX, 2]);
    let msg = import_bytes(&bytes, "m", "m", None, &opts).unwrap_err().to_string();
    assert!(msg.contains("input x"), "{msg}");
    // A weight-free initializer with a zero dim and dims whose product overflows.
    let w = pb::TensorProto { name: "w".into(), dims: vec![0, 1 << 40, 1 << 40], data_type: 1, ..Default::default() };
    let bytes = model(vec![node("id", "Identity", &["w"], &["y"], vec![])], vec![w], vec![], vec!["y"]);
    fails(&bytes, &["w"]);
}

#[test]
fn a_name_written_twice_is_an_error_naming_both_writers() {
    let x = || vec![vi("x", 1, &[3])];
    let twice = model(
        vec![node("first", "Relu", &["x"], &["y"], vec![]), node("second", "Sigmoid", &["x"], &["y"], vec![])],
        vec![],
        x(),
        vec!["y"],
    );
    fails(&twice, &["second", "first", "output 0 (y)"]);
    let shadows_init =
        model(vec![node("n", "Relu", &["x"], &["w"], vec![])], vec![floats("w", &[3], &[1.0; 3])], x(), vec!["w"]);
    fails(&shadows_init, &["node n", "an initializer"]);
    let shadows_input = model(vec![node("n", "Relu", &["x"], &["x"], vec![])], vec![], x(), vec!["x"]);
    fails(&shadows_input, &["node n", "a graph input"]);
    let same_node =
        model(vec![node("n", "Split", &["x"], &["a", "a"], vec![])], vec![], vec![vi("x", 1, &[4])], vec!["a"]);
    fails(&same_node, &["node n", "output 1 (a)", "node n"]);
    let two_inits = model(
        vec![node("n", "Add", &["x", "w"], &["y"], vec![])],
        vec![floats("w", &[3], &[1.0; 3]), floats("w", &[3], &[2.0; 3])],
        x(),
        vec!["y"],
    );
    fails(&two_inits, &["tensor w", "two initializers"]);
    let two_inputs = model(
        vec![node("n", "Relu", &["x"], &["y"], vec![])],
        vec![],
        vec![vi("x", 1, &[3]), vi("x", 1, &[4])],
        vec!["y"],
    );
    fails(&two_inputs, &["input x", "two inputs"]);
}

#[test]
fn split_outputs_must_match_the_elements() {
    let split = |outs: &[&str], inits: Vec<pb::TensorProto>, ins: &[&str], attrs| {
        model(vec![node("cut", "Split", ins, outs, attrs)], inits, vec![vi("x", 1, &[2, 4])], vec![outs[0]])
    };
    fails(&split(&["a", "b", "c"], vec![], &["x"], vec![]), &["cut", "more outputs than elements"]);
    fails(
        &split(&["a", "b"], vec![ints("s", &[3], &[1, 1, 0])], &["x", "s"], vec![]),
        &["cut", "3 sizes for 2 outputs"],
    );
    fails(&split(&["a", "b"], vec![], &["x"], vec![attr_int("num_outputs", 3)]), &["cut", "num_outputs=3"]);
    // Equal chunks whose last ones would be empty: 4 into 3 chunks of 2.
    fails(&split(&["a", "b", "c"], vec![], &["x"], vec![attr_int("axis", 1)]), &["cut", "chunks of 2"]);
    let g = import(&split(&["a", "b"], vec![], &["x"], vec![attr_int("axis", 1)])).unwrap();
    assert_eq!(g.meta(g.outputs[0].1).shape, vec![2, 2]);
}

#[test]
fn constant_gather_indices_are_checked_at_import() {
    let gather = |idx: i64| {
        model(
            vec![node("pick", "Gather", &["x", "i"], &["y"], vec![attr_int("axis", 1)])],
            vec![ints("i", &[1], &[idx])],
            vec![vi("x", 1, &[2, 5])],
            vec!["y"],
        )
    };
    fails(&gather(5), &["pick", "index 5", "size 5"]);
    fails(&gather(-6), &["pick", "index -6"]);
    assert!(import(&gather(-5)).is_ok());
    assert!(import(&gather(4)).is_ok());
}

#[test]
fn unsqueeze_with_a_repeated_axis_is_an_error() {
    let bytes = model(
        vec![node("u", "Unsqueeze", &["x", "axes"], &["y"], vec![])],
        vec![ints("axes", &[2], &[0, 0])],
        vec![vi("x", 1, &[3])],
        vec!["y"],
    );
    fails(&bytes, &["u", "twice"]);
}

#[test]
fn an_unread_dropout_mask_of_a_huge_activation_is_not_built() {
    let bytes = model(
        vec![node("drop", "Dropout", &["x"], &["y", "mask"], vec![])],
        vec![],
        vec![vi("x", 1, &[1 << 20, 1 << 20])],
        vec!["y"],
    );
    let g = import(&bytes).unwrap();
    assert_eq!(g.meta(g.outputs[0].1).shape, vec![1 << 20, 1 << 20]);
}

#[test]
fn temporary_constants_are_never_confused() {
    // Mean over 2 and over 3 inputs each divide by a scalar built for the node and dropped after:
    // the constant cache was keyed by address, so the second could get the first's divisor.
    let bytes = model(
        vec![
            node("m2", "Mean", &["x", "x"], &["a"], vec![]),
            node("m3", "Mean", &["x", "x", "x"], &["b"], vec![]),
            node("m4", "Mean", &["x", "x", "x", "x"], &["c"], vec![]),
        ],
        vec![],
        vec![vi("x", 1, &[3])],
        vec!["a", "b", "c"],
    );
    let g = import(&bytes).unwrap();
    let mut divisors: Vec<f32> =
        g.g.node_indices()
            .filter(|&n| matches!(g.node(n).op, Op::Binary(ir::BinaryOp::Div)))
            .map(|n| match &g.node(g.node_inputs(n)[1].node).op {
                Op::Constant(t) => t.as_f32().unwrap()[0],
                op => panic!("divisor is {}", op.name()),
            })
            .collect();
    divisors.sort_by(f32::total_cmp);
    assert_eq!(divisors, vec![2.0, 3.0, 4.0]);
}

#[test]
fn a_175b_model_plans_weight_free_under_the_default_ceiling() {
    let c = tracer::generate::GptConfig { layers: 96, hidden: 12288, heads: 96, seq: 2048, vocab: 50257, batch: 1 };
    let bytes = tracer::generate::gpt(&c).unwrap();
    let g =
        import_bytes(&bytes, "gpt", "gpt", None, &ImportOptions { load_weights: false, ..Default::default() }).unwrap();
    let (params, bytes) = g.param_stats();
    assert_eq!(params, c.parameters());
    assert!(params > 174_000_000_000, "{params}");
    assert_eq!(bytes, params * DType::F32.size());
    assert!(g.param_data.is_empty());
}

#[test]
fn declared_inputs_are_checked() {
    let relu = || vec![node("r", "Relu", &["x"], &["y"], vec![])];
    fails(&model(relu(), vec![], vec![vi("x", 1, &[2, -3])], vec!["y"]), &["input x", "dim -3"]);
    // An input that names an initializer takes its value, and must declare its type.
    let w = || floats("x", &[3], &[1.0; 3]);
    assert!(import(&model(relu(), vec![w()], vec![vi("x", 1, &[3])], vec!["y"])).is_ok());
    fails(&model(relu(), vec![w()], vec![vi("x", 1, &[4])], vec!["y"]), &["input x", "initializer"]);
    fails(&model(relu(), vec![w()], vec![vi("x", 7, &[3])], vec!["y"]), &["input x", "int64"]);
}

/// A `Constant` node of a tensor.
fn constant(name: &str, t: pb::TensorProto) -> pb::NodeProto {
    let value = pb::AttributeProto { name: "value".into(), r#type: 4, t: Some(t), ..Default::default() };
    node(name, "Constant", &[], &[name], vec![value])
}

#[test]
fn training_mode_dropout_imports_with_an_id_per_node() {
    let bool_t = |name: &str, v: bool| pb::TensorProto {
        name: name.into(),
        data_type: 9,
        int32_data: vec![i32::from(v)],
        ..Default::default()
    };
    let bytes = model(
        vec![
            constant("ratio", floats("ratio", &[], &[0.1])),
            constant("zero", floats("zero", &[], &[0.0])),
            constant("on", bool_t("on", true)),
            constant("off", bool_t("off", false)),
            node("d1", "Dropout", &["x", "ratio", "on"], &["a", "m1"], vec![]),
            node("d2", "Dropout", &["a", "ratio", "on"], &["b", "m2"], vec![]),
            node("d3", "Dropout", &["b", "ratio", "off"], &["c"], vec![]),
            node("d4", "Dropout", &["c", "zero", "on"], &["y"], vec![]),
        ],
        vec![],
        vec![vi("x", 1, &[2, 3])],
        vec!["y", "m2"],
    );
    let g = import(&bytes).unwrap();
    let drops: Vec<ir::DropoutAttrs> =
        g.g.node_indices()
            .filter_map(|n| match g.node(n).op {
                ir::Op::Dropout(a) => Some(a),
                _ => None,
            })
            .collect();
    // d1 and d2 in training mode (distinct ids; only d2's mask is read); d3 in inference and d4
    // at ratio 0 are identities.
    assert_eq!(
        drops,
        vec![ir::DropoutAttrs { ratio: 0.1, id: 0, mask: false }, ir::DropoutAttrs { ratio: 0.1, id: 1, mask: true }],
        "{}",
        g.to_text()
    );
    let bad = model(
        vec![
            constant("ratio", floats("ratio", &[], &[1.0])),
            node("d", "Dropout", &["x", "ratio", "on"], &["y"], vec![]),
        ],
        vec![],
        vec![vi("x", 1, &[2]), vi("on", 9, &[])],
        vec!["y"],
    );
    fails(&bad, &["d", "training_mode"]);
}

/// What the unrolling of `LSTM`, `GRU` and `RNN` cannot take is refused at import with the node's
/// name and the reason: per-batch lengths fed at run time (the masks are built at import), lengths
/// outside the sequence, an activation the spec does not define, more steps than are unrolled.
#[test]
fn recurrent_ops_the_unrolling_cannot_take_are_errors_naming_the_node() {
    let (t, b, i, h) = (2i64, 1i64, 3i64, 2i64);
    let rec = |op: &str, steps: i64, extra_inputs: Vec<pb::ValueInfoProto>, inits: Vec<pb::TensorProto>| {
        let g = match op {
            "LSTM" => 4,
            "GRU" => 3,
            _ => 1,
        };
        let n = |k: i64| (0..k).map(|v| v as f32 * 0.01).collect::<Vec<_>>();
        let mut all = vec![floats("W", &[1, g * h, i], &n(g * h * i)), floats("R", &[1, g * h, h], &n(g * h * h))];
        all.extend(inits);
        let mut inputs = vec![vi("x", 1, &[steps, b, i])];
        inputs.extend(extra_inputs);
        (all, inputs)
    };
    let node_with =
        |name: &str, op: &str, ins: &[&str], attrs: Vec<pb::AttributeProto>| node(name, op, ins, &["y"], attrs);

    // A valid LSTM imports: Y is [steps, dirs, batch, hidden].
    let (inits, inputs) = rec("LSTM", t, vec![], vec![]);
    let ok = model(vec![node_with("lstm", "LSTM", &["x", "W", "R"], vec![])], inits, inputs, vec!["y"]);
    let g = import(&ok).unwrap();
    assert_eq!(g.meta(g.outputs[0].1).shape, vec![t as usize, 1, b as usize, h as usize]);

    // sequence_lens fed at run time.
    let (inits, inputs) = rec("LSTM", t, vec![vi("lens", 6, &[b])], vec![]);
    let fed = model(vec![node_with("lstm", "LSTM", &["x", "W", "R", "", "lens"], vec![])], inits, inputs, vec!["y"]);
    fails(&fed, &["lstm", "LSTM", "sequence_lens", "constant"]);

    // A length longer than the sequence.
    let (inits, inputs) = rec("GRU", t, vec![], vec![ints("lens", &[b], &[t + 1])]);
    let long = model(vec![node_with("gru", "GRU", &["x", "W", "R", "", "lens"], vec![])], inits, inputs, vec!["y"]);
    fails(&long, &["gru", "GRU", "sequence_lens[0] = 3", "outside 0..=2"]);

    // An activation the ONNX spec does not list.
    let gelu = pb::AttributeProto {
        name: "activations".into(),
        r#type: 8,
        strings: vec![b"Gelu".to_vec()],
        ..Default::default()
    };
    let (inits, inputs) = rec("RNN", t, vec![], vec![]);
    let act = model(vec![node_with("rnn", "RNN", &["x", "W", "R"], vec![gelu])], inits, inputs, vec!["y"]);
    fails(&act, &["rnn", "RNN", "activation Gelu"]);

    // More steps than autopar unrolls.
    let (inits, inputs) = rec("RNN", 1 << 15, vec![], vec![]);
    let steps = model(vec![node_with("rnn", "RNN", &["x", "W", "R"], vec![])], inits, inputs, vec!["y"]);
    fails(&steps, &["rnn", "sequence length 32768", "16384 steps"]);
}
