//! Import-time constant folding through tract (ops autopar has no kernel for), the dtypes autopar
//! holds in wider types, local functions and static tensor sequences (the dynamo exporter's forms).
//!
//! The folded values are checked against the ONNX backend node suite's expected outputs
//! (`data/fold`, copied cases: see its README): each case's inputs are bound as `Constant`
//! nodes, so the whole graph is known at import and must come out as one constant.

use std::path::{Path, PathBuf};

use ir::{Data, Graph, Op, Tensor};
use prost::Message;
use tracer::{ImportError, ImportOptions, import_bytes, read_tensor_file};
use tract_onnx::pb;

fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/fold")
}

/// The node case `case` with every graph input replaced by a `Constant` of its test value.
fn constant_case(case: &str) -> Vec<u8> {
    let dir = data_dir().join(case);
    let mut m = pb::ModelProto::decode(&*std::fs::read(dir.join("model.onnx")).unwrap()).unwrap();
    let g = m.graph.as_mut().unwrap();
    let mut consts = Vec::new();
    for (i, input) in g.input.drain(..).enumerate() {
        let bytes = std::fs::read(dir.join(format!("test_data_set_0/input_{i}.pb"))).unwrap();
        let mut t = pb::TensorProto::decode(&*bytes).unwrap();
        t.name = input.name.clone();
        consts.push(pb::NodeProto {
            op_type: "Constant".into(),
            name: format!("bind_{}", input.name),
            output: vec![input.name.clone()],
            attribute: vec![pb::AttributeProto { name: "value".into(), r#type: 4, t: Some(t), ..Default::default() }],
            ..Default::default()
        });
    }
    consts.append(&mut g.node);
    g.node = consts;
    m.encode_to_vec()
}

/// The value of graph output `k`, which must be a constant.
fn constant_output(g: &Graph, k: usize) -> Tensor {
    let v = g.outputs[k].1;
    match &g.node(v.node).op {
        Op::Constant(t) => t.clone(),
        other => panic!("output {k} is computed by {} rather than folded:\n{}", other.name(), g.to_text()),
    }
}

fn close(got: &Tensor, want: &Tensor, rtol: f64) {
    assert_eq!(got.shape(), want.shape());
    assert_eq!(got.dtype(), want.dtype());
    let (a, b) = (got.to_f64_vec(), want.to_f64_vec());
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() <= rtol * y.abs() + 1e-6, "{a:?} vs {b:?}");
    }
}

#[test]
fn unsupported_ops_on_constants_fold_to_the_node_suites_outputs() {
    for (case, rtol) in [
        ("test_triu_neg", 0.0),
        ("test_tril_pos", 0.0),
        ("test_mod_mixed_sign_int32", 0.0),
        // Computed in f32 here, in f16 by ONNX: equal to f16's precision.
        ("test_mod_mixed_sign_float16", 1e-3),
        ("test_scatternd", 0.0),
        ("test_cumsum_2d_axis_1", 1e-6),
        ("test_cumsum_1d_reverse_exclusive", 1e-6),
    ] {
        let g = import_bytes(&constant_case(case), case, case, None, &ImportOptions::default())
            .unwrap_or_else(|e| panic!("{case}: {e}"));
        let want = read_tensor_file(&data_dir().join(case).join("test_data_set_0/output_0.pb")).unwrap();
        close(&constant_output(&g, 0), &want, rtol);
    }
}

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

fn int(name: &str, i: i64) -> pb::AttributeProto {
    pb::AttributeProto { name: name.into(), r#type: 2, i, ..Default::default() }
}

fn tensor(name: &str, code: i32, dims: &[i64], raw: Vec<u8>) -> pb::TensorProto {
    pb::TensorProto { name: name.into(), dims: dims.to_vec(), data_type: code, raw_data: raw, ..Default::default() }
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn model(
    nodes: Vec<pb::NodeProto>,
    inputs: Vec<pb::ValueInfoProto>,
    outputs: Vec<pb::ValueInfoProto>,
    inits: Vec<pb::TensorProto>,
) -> pb::ModelProto {
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
}

fn import(m: &pb::ModelProto, opts: &ImportOptions) -> Result<Graph, ImportError> {
    import_bytes(&m.encode_to_vec(), "m", "m", None, opts)
}

/// A causal mask as HF decoders build it: Trilu of a constant fill, used on a graph input.
fn mask_model(fill: pb::TensorProto) -> pb::ModelProto {
    model(
        vec![node("Trilu", &["fill"], &["mask"], vec![int("upper", 1)]), node("Add", &["x", "mask"], &["y"], vec![])],
        vec![vi("x", 7, &[4, 4])],
        vec![vi("y", 7, &[4, 4])],
        vec![fill],
    )
}

#[test]
fn folds_stay_under_the_constant_ceiling_and_never_touch_parameters() {
    // An int64 fill is a constant: Trilu folds, and y = x + constant.
    let fill = tensor("fill", 7, &[4, 4], (0..16i64).flat_map(|x| x.to_le_bytes()).collect());
    let g = import(&mask_model(fill.clone()), &ImportOptions::default()).unwrap();
    let ops: Vec<&str> = g.g.node_weights().map(|n| n.op.name()).collect();
    assert!(!ops.contains(&"Trilu") && ops.len() == 3, "{}", g.to_text());
    let c = g.g.node_weights().find_map(|n| if let Op::Constant(t) = &n.op { Some(t.clone()) } else { None }).unwrap();
    assert_eq!(c.as_i64().unwrap()[..8], [0, 1, 2, 3, 0, 5, 6, 7]);

    // The result is 128 bytes held as i64: a ceiling of 127 refuses the fold, naming the node.
    let opts = ImportOptions { max_constant_bytes: 127, ..Default::default() };
    let msg = import(&mask_model(fill), &opts).unwrap_err().to_string();
    assert!(msg.contains("Trilu_mask") && msg.contains("--max-constant-bytes") && msg.contains("128"), "{msg}");

    // A float initializer is a trainable parameter: never folded, so an op autopar has no
    // kernel for (Det) on it is unsupported.
    let w = tensor("fill", 1, &[4, 4], f32s(&[1.0; 16]));
    let det = model(
        vec![node("Det", &["fill"], &["d"], vec![]), node("Add", &["x", "d"], &["y"], vec![])],
        vec![vi("x", 1, &[4, 4])],
        vec![vi("y", 1, &[4, 4])],
        vec![w],
    );
    let e = import(&det, &ImportOptions::default()).unwrap_err();
    assert!(matches!(e, ImportError::UnsupportedOp { .. }), "{e}");
}

#[test]
fn narrow_and_half_precision_types_are_held_wide() {
    // y = Cast<int8>(ids) + Cast<int32>(w16 > 0): an int32 input, a float16 parameter, int8 and
    // bfloat16 constants.
    let half: Vec<u8> = [1.5f32, -2.0].iter().flat_map(|&x| half_bits(x).to_le_bytes()).collect();
    let m = model(
        vec![
            node("Cast", &["ids"], &["ids64"], vec![int("to", 7)]),
            node("Cast", &["w16"], &["w32"], vec![int("to", 1)]),
            node("MatMul", &["xf", "w32"], &["y"], vec![]),
            node("Cast", &["small"], &["small_f"], vec![int("to", 16)]),
            node("Cast", &["small_f"], &["small_u8"], vec![int("to", 2)]),
            node("Add", &["ids64", "small_u8"], &["z"], vec![]),
        ],
        vec![vi("ids", 6, &[2]), vi("xf", 1, &[1, 2])],
        vec![vi("y", 1, &[1, 1]), vi("z", 7, &[2])],
        vec![tensor("w16", 10, &[2, 1], half), tensor("small", 3, &[2], vec![0xff, 0x05])],
    );
    let g = import(&m, &ImportOptions::default()).unwrap();
    assert_eq!(g.meta(g.find_value("ids")).dtype, ir::DType::I64);
    // The float16 initializer is a parameter, widened exactly.
    assert_eq!(g.param_data["w16"].as_f32().unwrap(), &[1.5, -2.0]);
    // int8 [-1, 5] -> bfloat16 -> uint8: [255, 5].
    let c = g.g.node_weights().find_map(|n| if let Op::Constant(t) = &n.op { Some(t.clone()) } else { None }).unwrap();
    assert_eq!(c.data(), &Data::I64(vec![255, 5]));
}

fn half_bits(x: f32) -> u16 {
    // Exact for the values used here (normal, few fraction bits).
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = (((b >> 23) & 0xff) as i32 - 127 + 15) as u16;
    sign | (exp << 10) | ((b >> 13) & 0x3ff) as u16
}

trait FindValue {
    fn find_value(&self, name: &str) -> ir::Value;
}

impl FindValue for Graph {
    fn find_value(&self, name: &str) -> ir::Value {
        ir::Value::new(self.find(name).unwrap_or_else(|| panic!("no node {name}")), 0)
    }
}

/// The dynamo exporter's form of `a, b = x.split(2, dim=1)`: SplitToSequence read back through a
/// local function `aten_getitem(seq, i) = SequenceAt(seq, i)`.
fn dynamo_split_model() -> pb::ModelProto {
    let getitem = pb::FunctionProto {
        name: Some("aten_getitem".into()),
        domain: Some("pkg.onnxscript.torch_lib".into()),
        input: vec!["self".into(), "i".into()],
        output: vec!["return_val".into()],
        node: vec![node("SequenceAt", &["self", "i"], &["return_val"], vec![])],
        opset_import: vec![pb::OperatorSetIdProto { domain: String::new(), version: 18 }],
        ..Default::default()
    };
    let call = |i: &str, out: &str| pb::NodeProto {
        domain: "pkg.onnxscript.torch_lib".into(),
        ..node("aten_getitem", &["seq", i], &[out], vec![])
    };
    let i64s =
        |name: &str, dims: &[i64], v: &[i64]| tensor(name, 7, dims, v.iter().flat_map(|x| x.to_le_bytes()).collect());
    let mut m = model(
        vec![
            node("SplitToSequence", &["x", "two"], &["seq"], vec![int("axis", 1)]),
            call("zero", "a"),
            call("minus1", "b"),
            node("SequenceLength", &["seq"], &["len"], vec![]),
            node("Sub", &["a", "b"], &["d"], vec![]),
        ],
        vec![vi("x", 1, &[3, 4])],
        vec![vi("d", 1, &[3, 2]), vi("len", 7, &[])],
        vec![i64s("two", &[], &[2]), i64s("zero", &[], &[0]), i64s("minus1", &[], &[-1])],
    );
    m.functions.push(getitem);
    m.opset_import.push(pb::OperatorSetIdProto { domain: "pkg.onnxscript.torch_lib".into(), version: 1 });
    m
}

#[test]
fn local_functions_inline_and_static_sequences_become_splits() {
    let g = import(&dynamo_split_model(), &ImportOptions::default()).unwrap();
    let ops: Vec<&str> = g.g.node_weights().map(|n| n.op.name()).collect();
    assert!(ops.contains(&"split") && ops.contains(&"sub"), "{}", g.to_text());
    assert_eq!(g.meta(g.outputs[0].1).shape, vec![3, 2]);
    assert_eq!(constant_output(&g, 1).as_i64().unwrap(), &[2]);
    // The two reads are the split's two outputs.
    let sub = g.find("d").or_else(|| g.find("Sub_d")).unwrap();
    let ins = g.node_inputs(sub);
    assert_eq!((ins[0].slot, ins[1].slot), (0, 1), "{}", g.to_text());
}

#[test]
fn sequences_errors_name_the_node() {
    let mut m = dynamo_split_model();
    // Position 2 of a 2-tensor sequence.
    m.graph.as_mut().unwrap().initializer[1] = tensor("zero", 7, &[], 2i64.to_le_bytes().to_vec());
    let msg = import(&m, &ImportOptions::default()).unwrap_err().to_string();
    assert!(msg.contains("position 2 is out of range") && msg.contains("aten_getitem_a"), "{msg}");
}

#[test]
fn parameters_in_the_same_role_of_several_nodes_are_reported() {
    // One scale for two LayerNorms (an eval-mode export's merge) is reported; one table read by a
    // Gather and a MatMul (GPT-2's tied embedding) is not.
    let ones = tensor("ones", 1, &[4], f32s(&[1.0; 4]));
    let table = tensor("table", 1, &[5, 4], f32s(&[0.5; 20]));
    let m = model(
        vec![
            node("Gather", &["table", "ids"], &["e"], vec![]),
            node("LayerNormalization", &["e", "ones"], &["h1"], vec![]),
            node("LayerNormalization", &["h1", "ones"], &["h2"], vec![]),
            node("Transpose", &["table"], &["table_t"], vec![]),
            node("MatMul", &["h2", "table_t"], &["logits"], vec![]),
        ],
        vec![vi("ids", 7, &[2, 3])],
        vec![vi("logits", 1, &[2, 3, 5])],
        vec![ones, table],
    );
    let g = import(&m, &ImportOptions::default()).unwrap();
    let shared = tracer::shared_parameters(&g);
    assert_eq!(shared.len(), 1, "{shared:?}");
    assert_eq!((shared[0].name.as_str(), shared[0].slot, shared[0].nodes.len()), ("ones", 1, 2));
    let text = shared[0].to_string();
    assert!(text.contains("ones") && text.contains("LayerNormalization_h1"), "{text}");
}

#[test]
fn a_fold_past_the_ceiling_is_refused_before_it_runs() {
    // Tile (no autopar kernel) of a 1-element constant: 3 times folds; 2^30 times (4 GiB) is
    // refused from tract's announced shape, before running, naming the node. (tract 0.23 reads
    // repeats past i32 as 0: such a Tile folds to an empty tensor, see the report.)
    let tile = |reps: i64| {
        model(
            vec![
                node(
                    "Constant",
                    &[],
                    &["c"],
                    vec![pb::AttributeProto {
                        name: "value".into(),
                        r#type: 4,
                        t: Some(tensor("", 1, &[1], f32s(&[1.0]))),
                        ..Default::default()
                    }],
                ),
                node("Tile", &["c", "reps"], &["y"], vec![]),
            ],
            vec![],
            vec![vi("y", 1, &[])],
            vec![tensor("reps", 7, &[1], reps.to_le_bytes().to_vec())],
        )
    };
    let g = import(&tile(3), &ImportOptions::default()).unwrap();
    assert_eq!(constant_output(&g, 0).as_f32().unwrap(), &[1.0; 3]);
    let msg = import(&tile(1 << 30), &ImportOptions::default()).unwrap_err().to_string();
    assert!(msg.contains("Tile_y") && msg.contains("--max-constant-bytes"), "{msg}");
}

/// Ops whose output shape depends on the values they read are refused with why and what to
/// export instead, once folding cannot remove them; with constant inputs they fold away.
#[test]
fn data_dependent_ops_say_what_to_export_instead() {
    for (op, advice) in [("NonZero", "torch.where"), ("Unique", "fixed size")] {
        let m = model(vec![node(op, &["x"], &["y"], vec![])], vec![vi("x", 1, &[4])], vec![vi("y", 7, &[4])], vec![]);
        let e = import(&m, &ImportOptions::default()).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, ImportError::DataDependent { .. }), "{op}: {msg}");
        assert!(msg.contains(op) && msg.contains("depends on the input values") && msg.contains(advice), "{msg}");
    }
}
