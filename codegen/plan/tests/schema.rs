//! `plan.schema.json` is the schema the types generate: a change to the format shows in review
//! as a change to that file. `BLESS=1 cargo test -p plan --test schema` rewrites it.

use std::path::Path;

#[test]
fn the_committed_schema_is_the_generated_one() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("plan.schema.json");
    let now = plan::json_schema();
    if std::env::var_os("BLESS").is_some() {
        std::fs::write(&path, &now).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == now,
        "{} is not the schema of the plan types: run `BLESS=1 cargo test -p plan --test schema` and commit it (and bump plan::VERSION if old plans no longer read)",
        path.display()
    );
    // It describes the version it was made for.
    let schema: serde_json::Value = serde_json::from_str(&now).unwrap();
    assert_eq!(schema["title"], "Plan");
    for field in ["version", "graph", "program", "params", "mesh"] {
        assert!(schema["required"].as_array().unwrap().iter().any(|f| f == field), "{field}");
    }
}

/// A plan written in format 6 (precision a free string, here absent: f32) still reads, as this
/// version, with the same precision.
#[test]
fn a_version_6_plan_reads_as_this_version() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../runtime/tests/data/mlp_sgd_mesh2.json");
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.starts_with("{\"version\":6,"), "the fixture is no longer a version-6 plan");
    let p = plan::Plan::from_json(&text).unwrap();
    assert_eq!((p.version, p.options.precision), (plan::VERSION, plan::Precision::F32));
    let bf16 = text.replacen("\"time_limit_seconds\":1.0", "\"time_limit_seconds\":1.0,\"precision\":\"bf16\"", 1);
    assert_eq!(plan::Plan::parse(&bf16).unwrap().options.precision, plan::Precision::Bf16);
    let bad = text.replacen("\"time_limit_seconds\":1.0", "\"time_limit_seconds\":1.0,\"precision\":\"f8\"", 1);
    let e = plan::Plan::parse(&bad).unwrap_err().to_string();
    assert!(e.contains("precision") && e.contains("f8"), "{e}");
}
