//! The verifier reports every error with its node; the parser rejects malformed text with a line.

use ir::{Graph, verify};

#[test]
fn verifier_collects_all_errors_with_locations() {
    // Two independent problems: a wrong output meta and a matmul with mismatched inner dims.
    let text = r#"graph "bad" {
  %0 "x" = input{name="x"} : f32[2,3]
  %1 "w" = param{name="w"} : f32[4,5]
  %2 "mm" = matmul(%0, %1) : f32[2,5]
  %3 "r" = relu(%0) : f32[3,2]
  output "y" = %3
}"#;
    let g = Graph::parse(text).expect("parses: metas are taken as written");
    let errs = verify(&g).expect_err("two errors").0;
    assert_eq!(errs.len(), 2, "{errs:?}");
    assert_eq!(errs[0].node.as_deref(), Some("mm"));
    assert!(errs[0].message.contains("inner dims"), "{}", errs[0]);
    assert_eq!(errs[1].node.as_deref(), Some("r"));
    assert!(errs[1].message.contains("infers"), "{}", errs[1]);
}

#[test]
fn parser_errors_name_the_line() {
    for (text, line, phrase) in [
        ("graph \"g\" {\n  %0 \"x\" = input{name=\"x\"} : f99[2]\n}", 2, "unknown dtype"),
        (
            "graph \"g\" {\n  %0 \"x\" = input{name=\"x\"} : f32[2]\n  %1 \"y\" = frobnicate(%0) : f32[2]\n}",
            3,
            "unknown op",
        ),
        ("graph \"g\" {\n  %1 \"y\" = relu(%0) : f32[2]\n}", 2, "before it is defined"),
        ("graph \"g\" {\n  %0 \"x\" = input{name=\"x\"} : f32[2]\n", 2, "end of text"),
        ("graph \"g\" {\n  %0 \"c\" = const{value=f32[3] [1.0, 2.0]} : f32[3]\n}", 2, "elements"),
    ] {
        let e = Graph::parse(text).expect_err(text);
        assert_eq!(e.line, line, "{text}: {e}");
        assert!(e.message.contains(phrase), "{text}: {e}");
    }
}

#[test]
fn cycle_is_reported() {
    let mut g = Graph::new("c");
    let x = g.input("x", ir::TensorMeta::new(ir::DType::F32, [2]));
    let a = g.add1("a", ir::Op::Unary(ir::UnaryOp::Relu), &[x]).unwrap();
    let b = g.add1("b", ir::Op::Unary(ir::UnaryOp::Relu), &[a]).unwrap();
    // Rewire a to read b: a cycle.
    g.replace_all_uses(x, b);
    let errs = verify(&g).expect_err("cycle").0;
    assert!(errs[0].message.contains("cycle"), "{errs:?}");
}
