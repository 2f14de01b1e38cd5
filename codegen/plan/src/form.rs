//! Schema-only mirrors of the JSON forms `ir` writes for graphs and ops (`ir`'s serde impls are
//! written by hand, so the schema of [`crate::Plan`] describes them here). Never constructed.

#![allow(dead_code)]

use std::borrow::Cow;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};

/// An op: its name when it has no attributes, else `{name: {attribute: value}}`; a tensor
/// attribute is `{dtype, shape, data}`, floats JSON cannot hold are `"inf"`, `"-inf"`, `"NaN"`.
pub(crate) struct OpForm;

impl JsonSchema for OpForm {
    fn schema_name() -> Cow<'static, str> {
        "Op".into()
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "description": "An op: its name when it has no attributes (\"matmul\"), else {name: {attribute: value}} ({\"reshape\": {\"shape\": [2, 16, 64]}}). A tensor attribute is {dtype, shape, data}; floats JSON cannot hold are \"inf\", \"-inf\", \"NaN\".",
            "oneOf": [
                { "type": "string" },
                {
                    "type": "object",
                    "minProperties": 1,
                    "maxProperties": 1,
                    "additionalProperties": { "type": "object" }
                }
            ]
        })
    }
}

/// One node of the graph.
#[derive(JsonSchema)]
#[schemars(deny_unknown_fields)]
pub(crate) struct NodeForm {
    /// Its position in `nodes` (values are `%id` and `%id.slot`).
    id: usize,
    /// Unique name.
    name: String,
    /// The op and its attributes.
    op: OpForm,
    /// Values read, `%N` or `%N.S` of earlier nodes (absent for inputs, parameters, state and
    /// constants).
    #[serde(default)]
    inputs: Vec<String>,
    /// Type of each output, as `f32[2,3]`.
    outputs: Vec<String>,
}

/// A named graph output.
#[derive(JsonSchema)]
#[schemars(deny_unknown_fields)]
pub(crate) struct OutputForm {
    /// Output name.
    name: String,
    /// The value.
    value: String,
}

/// A parameter or state update of a training step.
#[derive(JsonSchema)]
#[schemars(deny_unknown_fields)]
pub(crate) struct UpdateForm {
    /// The param or state node, `%N`.
    target: String,
    /// Its value after the step.
    value: String,
}

/// The JSON form of a graph: nodes in topological order.
#[derive(JsonSchema)]
#[schemars(rename = "Graph", deny_unknown_fields)]
pub(crate) struct GraphForm {
    /// Model name.
    name: String,
    /// The nodes; node `id` is at position `id`.
    nodes: Vec<NodeForm>,
    /// Graph outputs.
    #[serde(default)]
    outputs: Vec<OutputForm>,
    /// Updates of parameters and state.
    #[serde(default)]
    updates: Vec<UpdateForm>,
}
