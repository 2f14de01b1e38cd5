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
