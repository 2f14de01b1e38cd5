//! `Graph::with_float_type`: every float value, constant, cast target and parameter becomes the
//! new type; integer and bool values stay; node ids and names are kept; converting back gives the
//! original graph.

use ir::{BinaryOp, DType, Graph, Op, Tensor, TensorMeta};

fn sample() -> Graph {
    let mut g = Graph::new("sample");
    let x = g.input("x", TensorMeta::new(DType::F32, [2, 3]));
    let ids = g.input("ids", TensorMeta::new(DType::I64, [2]));
    let w = g.param("w", TensorMeta::new(DType::F32, [3, 4]), Some(Tensor::f32([3, 4], vec![0.5; 12])));
    let c = g.constant("c", Tensor::f32([4], vec![1.0, 2.0, 3.0, 4.0]));
    let y = g.add1("mm", Op::MatMul, &[x, w]).unwrap();
    let y = g.add1("add", Op::Binary(BinaryOp::Add), &[y, c]).unwrap();
    let f = g.add1("ids_f", Op::Cast { to: DType::F32 }, &[ids]).unwrap();
    let rows = g.add1("rows", Op::Gather { axis: 0 }, &[y, ids]).unwrap();
    g.set_output("y", y);
    g.set_output("f", f);
    g.set_output("rows", rows);
    g
}

#[test]
fn with_float_type_widens_every_float_and_nothing_else() {
    let g = sample();
    let w = g.with_float_type(DType::F64).unwrap();
    ir::verify(&w).unwrap();
    for n in g.g.node_indices() {
        let (a, b) = (g.node(n), w.node(n));
        assert_eq!(a.name, b.name);
        for (ma, mb) in a.outputs.iter().zip(&b.outputs) {
            assert_eq!(ma.shape, mb.shape, "{}", a.name);
            let want = if ma.dtype == DType::F32 { DType::F64 } else { ma.dtype };
            assert_eq!(mb.dtype, want, "{}", a.name);
        }
    }
    assert_eq!(w.param_data["w"], Tensor::f64([3, 4], vec![0.5; 12]));
    let back = w.with_float_type(DType::F32).unwrap();
    assert_eq!(back.to_text(), g.to_text());
    assert_eq!(back.param_data, g.param_data);
}

#[test]
fn with_float_type_rejects_a_non_float_type() {
    let err = sample().with_float_type(DType::I64).unwrap_err();
    assert!(err.to_string().contains("i64 is not a float type"), "{err}");
}

#[test]
fn ops_do_not_mix_float_types() {
    let a = TensorMeta::new(DType::F32, [2, 2]);
    let b = TensorMeta::new(DType::F64, [2, 2]);
    let err = Op::MatMul.infer(&[a.clone(), b.clone()]).unwrap_err();
    assert!(err.contains("mix f32 and f64"), "{err}");
    assert_eq!(Op::MatMul.infer(&[b.clone(), b.clone()]).unwrap(), vec![b]);
}
