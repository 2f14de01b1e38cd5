//! Weight-free model generators: ONNX graphs with the shapes of real architectures and no weight
//! data, for planning at scales that would not fit in memory (`autopar gen gpt`).
//!
//! Float initializers are written with their dims and no data; the importer turns them into
//! shape-only parameters.

use prost::Message;
use tract_onnx::pb;
use tract_onnx::pb::tensor_proto::DataType;
use tract_onnx::pb::tensor_shape_proto::{Dimension, dimension};

/// The shape of a GPT-2-style decoder (pre-layer-norm blocks, GELU MLP of 4x width, tied nothing).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GptConfig {
    /// Transformer blocks.
    pub layers: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Attention heads (divides `hidden`).
    pub heads: usize,
    /// Sequence length.
    pub seq: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Batch size.
    pub batch: usize,
}

impl GptConfig {
    /// Parameters of the model.
    pub fn parameters(&self) -> usize {
        let (h, v, s) = (self.hidden, self.vocab, self.seq);
        let block = 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + 2 * h + (h * 4 * h + 4 * h) + (4 * h * h + h);
        v * h + s * h + self.layers * block + 2 * h + h * v
    }

    /// Checks the sizes.
    pub fn check(&self) -> Result<(), String> {
        for (v, what) in [
            (self.layers, "--layers"),
            (self.hidden, "--hidden"),
            (self.heads, "--heads"),
            (self.seq, "--seq"),
            (self.vocab, "--vocab"),
            (self.batch, "--batch"),
        ] {
            if v == 0 {
                return Err(format!("{what} must be at least 1"));
            }
        }
        if !self.hidden.is_multiple_of(self.heads) {
            return Err(format!("--heads {} does not divide --hidden {}", self.heads, self.hidden));
        }
        Ok(())
    }
}

fn dims_info(name: &str, elem: DataType, dims: &[usize]) -> pb::ValueInfoProto {
    let dim = dims
        .iter()
        .map(|&d| Dimension { value: Some(dimension::Value::DimValue(d as i64)), ..Default::default() })
        .collect();
    pb::ValueInfoProto {
        name: name.into(),
        r#type: Some(pb::TypeProto {
            value: Some(pb::type_proto::Value::TensorType(pb::type_proto::Tensor {
                elem_type: elem as i32,
                shape: Some(pb::TensorShapeProto { dim }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

struct Builder {
    nodes: Vec<pb::NodeProto>,
    inits: Vec<pb::TensorProto>,
}

impl Builder {
    /// A weight-free float initializer.
    fn weight(&mut self, name: &str, dims: &[usize]) -> String {
        self.inits.push(pb::TensorProto {
            name: name.into(),
            dims: dims.iter().map(|&d| d as i64).collect(),
            data_type: DataType::Float as i32,
            ..Default::default()
        });
        name.to_string()
    }

    fn ints(&mut self, name: &str, v: &[i64]) -> String {
        self.inits.push(pb::TensorProto {
            name: name.into(),
            dims: vec![v.len() as i64],
            data_type: DataType::Int64 as i32,
            int64_data: v.to_vec(),
            ..Default::default()
        });
        name.to_string()
    }

    /// A float scalar as a `Constant` node (a float initializer would be a parameter).
    fn scalar(&mut self, name: &str, x: f32) -> String {
        let t = pb::TensorProto {
            dims: vec![],
            data_type: DataType::Float as i32,
            float_data: vec![x],
            ..Default::default()
        };
        self.nodes.push(pb::NodeProto {
            name: name.into(),
            op_type: "Constant".into(),
            output: vec![name.to_string()],
            attribute: vec![pb::AttributeProto {
                name: "value".into(),
                r#type: pb::attribute_proto::AttributeType::Tensor as i32,
                t: Some(t),
                ..Default::default()
            }],
            ..Default::default()
        });
        name.to_string()
    }

    fn op(&mut self, name: &str, op: &str, ins: &[&str], attrs: Vec<pb::AttributeProto>) -> String {
        let out = format!("{name}_out");
        self.nodes.push(pb::NodeProto {
            name: name.into(),
            op_type: op.into(),
            input: ins.iter().map(|s| s.to_string()).collect(),
            output: vec![out.clone()],
            attribute: attrs,
            ..Default::default()
        });
        out
    }

    fn layer_norm(&mut self, p: &str, x: &str, h: usize) -> String {
        let g = self.weight(&format!("{p}.weight"), &[h]);
        let b = self.weight(&format!("{p}.bias"), &[h]);
        self.op(&format!("/{p}/LayerNormalization"), "LayerNormalization", &[x, &g, &b], vec![int_attr("axis", -1)])
    }

    fn linear(&mut self, p: &str, x: &str, n_in: usize, n_out: usize) -> String {
        let w = self.weight(&format!("{p}.weight"), &[n_in, n_out]);
        let b = self.weight(&format!("{p}.bias"), &[n_out]);
        let y = self.op(&format!("/{p}/MatMul"), "MatMul", &[x, &w], vec![]);
        self.op(&format!("/{p}/Add"), "Add", &[&y, &b], vec![])
    }
}

fn int_attr(name: &str, v: i64) -> pb::AttributeProto {
    pb::AttributeProto {
        name: name.into(),
        r#type: pb::attribute_proto::AttributeType::Int as i32,
        i: v,
        ..Default::default()
    }
}

fn ints_attr(name: &str, v: &[i64]) -> pb::AttributeProto {
    pb::AttributeProto {
        name: name.into(),
        r#type: pb::attribute_proto::AttributeType::Ints as i32,
        ints: v.to_vec(),
        ..Default::default()
    }
}

/// The ONNX bytes (IR version 8, opset 20) of a weight-free GPT with input `input_ids`
/// `[batch, seq]` (i64) and output `logits` `[batch, seq, vocab]`. Node and parameter names
/// follow GPT-2's export (`/h.{i}/attn/...`, `h.{i}.mlp.c_fc.weight`).
pub fn gpt(c: &GptConfig) -> Result<Vec<u8>, String> {
    c.check()?;
    let (b, s, h, a, v) = (c.batch, c.seq, c.hidden, c.heads, c.vocab);
    let d = h / a;
    let mut m = Builder { nodes: vec![], inits: vec![] };
    let wte = m.weight("wte.weight", &[v, h]);
    let wpe = m.weight("wpe.weight", &[s, h]);
    let tok = m.op("/wte/Gather", "Gather", &[&wte, "input_ids"], vec![int_attr("axis", 0)]);
    let mut x = m.op("/embed/Add", "Add", &[&tok, &wpe], vec![]);
    let heads_shape = m.ints("shape.heads", &[b as i64, s as i64, a as i64, d as i64]);
    let merged_shape = m.ints("shape.merged", &[b as i64, s as i64, h as i64]);
    let split = m.ints("split.qkv", &[h as i64, h as i64, h as i64]);
    let scale = m.scalar("attn.scale", (d as f32).sqrt());
    for i in 0..c.layers {
        let p = format!("h.{i}");
        let ln1 = m.layer_norm(&format!("{p}.ln_1"), &x, h);
        let qkv = m.linear(&format!("{p}.attn.c_attn"), &ln1, h, 3 * h);
        let names: Vec<String> = ["q", "k", "v"].iter().map(|n| format!("/{p}/attn/Split_{n}")).collect();
        m.nodes.push(pb::NodeProto {
            name: format!("/{p}/attn/Split"),
            op_type: "Split".into(),
            input: vec![qkv, split.clone()],
            output: names.clone(),
            attribute: vec![int_attr("axis", 2)],
            ..Default::default()
        });
        let mut heads = vec![];
        for (n, perm) in names.iter().zip([[0, 2, 1, 3], [0, 2, 3, 1], [0, 2, 1, 3]]) {
            let r = m.op(&format!("{n}/Reshape"), "Reshape", &[n, &heads_shape], vec![]);
            heads.push(m.op(&format!("{n}/Transpose"), "Transpose", &[&r], vec![ints_attr("perm", &perm)]));
        }
        let scores = m.op(&format!("/{p}/attn/MatMul"), "MatMul", &[&heads[0], &heads[1]], vec![]);
        let scores = m.op(&format!("/{p}/attn/Div"), "Div", &[&scores, &scale], vec![]);
        let probs = m.op(&format!("/{p}/attn/Softmax"), "Softmax", &[&scores], vec![int_attr("axis", -1)]);
        let ctx = m.op(&format!("/{p}/attn/MatMul_1"), "MatMul", &[&probs, &heads[2]], vec![]);
        let ctx = m.op(&format!("/{p}/attn/Transpose"), "Transpose", &[&ctx], vec![ints_attr("perm", &[0, 2, 1, 3])]);
        let ctx = m.op(&format!("/{p}/attn/Reshape"), "Reshape", &[&ctx, &merged_shape], vec![]);
        let o = m.linear(&format!("{p}.attn.c_proj"), &ctx, h, h);
        x = m.op(&format!("/{p}/Add"), "Add", &[&x, &o], vec![]);
        let ln2 = m.layer_norm(&format!("{p}.ln_2"), &x, h);
        let f = m.linear(&format!("{p}.mlp.c_fc"), &ln2, h, 4 * h);
        let f = m.op(&format!("/{p}/mlp/act/Gelu"), "Gelu", &[&f], vec![]);
        let f = m.linear(&format!("{p}.mlp.c_proj"), &f, 4 * h, h);
        x = m.op(&format!("/{p}/Add_1"), "Add", &[&x, &f], vec![]);
    }
    let x = m.layer_norm("ln_f", &x, h);
    let head = m.weight("lm_head.weight", &[h, v]);
    let logits = m.op("/lm_head/MatMul", "MatMul", &[&x, &head], vec![]);
    m.nodes.push(pb::NodeProto {
        name: "/logits/Identity".into(),
        op_type: "Identity".into(),
        input: vec![logits],
        output: vec!["logits".into()],
        ..Default::default()
    });
    let model = pb::ModelProto {
        ir_version: 8,
        opset_import: vec![pb::OperatorSetIdProto { domain: String::new(), version: 20 }],
        producer_name: "autopar gen gpt".into(),
        graph: Some(pb::GraphProto {
            name: format!("gpt-{}l-{}h", c.layers, c.hidden),
            node: m.nodes,
            initializer: m.inits,
            input: vec![dims_info("input_ids", DataType::Int64, &[b, s])],
            output: vec![dims_info("logits", DataType::Float, &[b, s, v])],
            ..Default::default()
        }),
        ..Default::default()
    };
    Ok(model.encode_to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_gpt_imports_with_its_parameter_count() {
        let c = GptConfig { layers: 2, hidden: 64, heads: 4, seq: 16, vocab: 100, batch: 2 };
        let bytes = gpt(&c).unwrap();
        let g = crate::import_bytes(&bytes, "gen", "gen", None, &crate::ImportOptions::default()).unwrap();
        assert_eq!(g.param_stats().0, c.parameters());
        assert_eq!(g.outputs[0].0, "logits");
        assert_eq!(g.meta(g.outputs[0].1).shape, vec![2, 16, 100]);
        assert!(gpt(&GptConfig { heads: 3, ..c }).is_err());
    }
}
