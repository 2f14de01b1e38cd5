//! Weight-free model generators: ONNX graphs with the shapes of real architectures and no weight
//! data, for planning at scales that would not fit in memory (`autopar gen gpt`).
//!
//! Float initializers are written with their dims and no data; the importer turns them into
//! shape-only parameters.

use prost::Message;
use tract_onnx::pb;
use tract_onnx::pb::tensor_proto::DataType;
use tract_onnx::pb::tensor_shape_proto::{Dimension, dimension};

/// How a generated model writes its attention.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionForm {
    /// As PyTorch's eager modules export it: `MatMul`, scale, causal `Where`, `Softmax`,
    /// `MatMul` (the `S x S` scores are tensors of the graph). Opset 20.
    #[default]
    Unfused,
    /// One ONNX `Attention` node per layer (opset 23, `is_causal`), which autopar computes as
    /// flash attention: the scores are never stored.
    Fused,
}

impl AttentionForm {
    fn opset(self) -> i64 {
        match self {
            AttentionForm::Unfused => 20,
            AttentionForm::Fused => 23,
        }
    }
}

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
        let sizes = [(self.layers, "--layers"), (self.seq, "--seq"), (self.vocab, "--vocab"), (self.batch, "--batch")];
        check_sizes(&sizes, self.hidden, self.heads)
    }
}

/// Every size at least 1, and `heads` dividing `hidden` (the checks both generators share).
fn check_sizes(sizes: &[(usize, &str)], hidden: usize, heads: usize) -> Result<(), String> {
    let all = [(hidden, "--hidden"), (heads, "--heads")];
    if let Some((_, what)) = all.iter().chain(sizes).find(|(v, _)| *v == 0) {
        return Err(format!("{what} must be at least 1"));
    }
    if !hidden.is_multiple_of(heads) {
        return Err(format!("--heads {heads} does not divide --hidden {hidden}"));
    }
    Ok(())
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
        self.float_const(name, &[], &[x])
    }

    /// A float tensor as a `Constant` node.
    fn float_const(&mut self, name: &str, dims: &[usize], v: &[f32]) -> String {
        let t = pb::TensorProto {
            dims: dims.iter().map(|&d| d as i64).collect(),
            data_type: DataType::Float as i32,
            float_data: v.to_vec(),
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

    /// ONNX `Attention` (opset 23) on 4-D Q, K, V with the causal rule and scale `1/sqrt(d)`.
    fn causal_attention(&mut self, name: &str, q: &str, k: &str, v: &str, d: usize) -> String {
        let scale = pb::AttributeProto {
            name: "scale".into(),
            r#type: pb::attribute_proto::AttributeType::Float as i32,
            f: 1.0 / (d as f32).sqrt(),
            ..Default::default()
        };
        self.op(name, "Attention", &[q, k, v], vec![int_attr("is_causal", 1), scale])
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
/// `[batch, seq]` (i64) and output `logits` `[batch, seq, vocab]`; attention is causal. Node and parameter names
/// follow GPT-2's export (`/h.{i}/attn/...`, `h.{i}.mlp.c_fc.weight`).
pub fn gpt(c: &GptConfig) -> Result<Vec<u8>, String> {
    gpt_with(c, AttentionForm::Unfused)
}

/// [`gpt`] with its attention written in `form` (opset 23 when fused).
pub fn gpt_with(c: &GptConfig, form: AttentionForm) -> Result<Vec<u8>, String> {
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
    // Unfused: the scale and the causal mask [S, S] (a query attends to keys at its position
    // and before, GPT-2's `bias` buffer; the importer folds it to a constant).
    let unfused = (form == AttentionForm::Unfused).then(|| {
        let scale = m.scalar("attn.scale", (d as f32).sqrt());
        let positions: Vec<i64> = (0..s as i64).collect();
        let positions = m.ints("mask.positions", &positions);
        let q_shape = m.ints("shape.mask_q", &[s as i64, 1]);
        let k_shape = m.ints("shape.mask_k", &[1, s as i64]);
        let pq = m.op("/mask/Reshape", "Reshape", &[&positions, &q_shape], vec![]);
        let pk = m.op("/mask/Reshape_1", "Reshape", &[&positions, &k_shape], vec![]);
        let allowed = m.op("/mask/LessOrEqual", "LessOrEqual", &[&pk, &pq], vec![]);
        (scale, allowed, m.scalar("mask.min", f32::MIN))
    });
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
        let k_perm = if form == AttentionForm::Fused { [0, 2, 1, 3] } else { [0, 2, 3, 1] };
        for (n, perm) in names.iter().zip([[0, 2, 1, 3], k_perm, [0, 2, 1, 3]]) {
            let r = m.op(&format!("{n}/Reshape"), "Reshape", &[n, &heads_shape], vec![]);
            heads.push(m.op(&format!("{n}/Transpose"), "Transpose", &[&r], vec![ints_attr("perm", &perm)]));
        }
        let ctx = if form == AttentionForm::Fused {
            m.causal_attention(&format!("/{p}/attn/Attention"), &heads[0], &heads[1], &heads[2], d)
        } else {
            let (scale, allowed, neg) = unfused.as_ref().expect("unfused attention has its mask");
            let scores = m.op(&format!("/{p}/attn/MatMul"), "MatMul", &[&heads[0], &heads[1]], vec![]);
            let scores = m.op(&format!("/{p}/attn/Div"), "Div", &[&scores, scale], vec![]);
            let scores = m.op(&format!("/{p}/attn/Where"), "Where", &[allowed, &scores, neg], vec![]);
            let probs = m.op(&format!("/{p}/attn/Softmax"), "Softmax", &[&scores], vec![int_attr("axis", -1)]);
            m.op(&format!("/{p}/attn/MatMul_1"), "MatMul", &[&probs, &heads[2]], vec![])
        };
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
        opset_import: vec![pb::OperatorSetIdProto { domain: String::new(), version: form.opset() }],
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

/// The shape of a LLaMA-style decoder: RMSNorm, rotary position embeddings, grouped-query
/// attention (`kv_heads` key/value heads shared by `heads / kv_heads` query heads each), a
/// SwiGLU MLP of width `ffn`, untied embeddings, no biases.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LlamaConfig {
    /// Transformer blocks.
    pub layers: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Query heads (divides `hidden`).
    pub heads: usize,
    /// Key/value heads (divides `heads`).
    pub kv_heads: usize,
    /// MLP width.
    pub ffn: usize,
    /// Sequence length.
    pub seq: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Batch size.
    pub batch: usize,
}

impl LlamaConfig {
    /// LLaMA-3 8B's shapes (Meta's `params.json`: 32 layers, dim 4096, 32 heads, 8 KV heads,
    /// FFN 14336, vocab 128256) at sequence 8192 and batch 1.
    pub fn llama3_8b() -> LlamaConfig {
        LlamaConfig {
            layers: 32,
            hidden: 4096,
            heads: 32,
            kv_heads: 8,
            ffn: 14336,
            seq: 8192,
            vocab: 128_256,
            batch: 1,
        }
    }

    /// LLaMA-3 70B's shapes (80 layers, dim 8192, 64 heads, 8 KV heads, FFN 28672, vocab
    /// 128256) at sequence 8192 and batch 1.
    pub fn llama3_70b() -> LlamaConfig {
        LlamaConfig {
            layers: 80,
            hidden: 8192,
            heads: 64,
            kv_heads: 8,
            ffn: 28672,
            seq: 8192,
            vocab: 128_256,
            batch: 1,
        }
    }

    /// Size of one head.
    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }

    /// Parameters of the model.
    pub fn parameters(&self) -> usize {
        let (h, f, v) = (self.hidden, self.ffn, self.vocab);
        let kv = self.kv_heads * self.head_dim();
        let block = 2 * h + h * h + 2 * h * kv + h * h + 3 * h * f;
        2 * v * h + self.layers * block + h
    }

    /// Checks the sizes.
    pub fn check(&self) -> Result<(), String> {
        let sizes = [
            (self.layers, "--layers"),
            (self.kv_heads, "--kv-heads"),
            (self.ffn, "--ffn"),
            (self.seq, "--seq"),
            (self.vocab, "--vocab"),
            (self.batch, "--batch"),
        ];
        check_sizes(&sizes, self.hidden, self.heads)?;
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(format!("--kv-heads {} does not divide --heads {}", self.kv_heads, self.heads));
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(format!("rotary embeddings need an even head size, not {}", self.head_dim()));
        }
        Ok(())
    }
}

impl Builder {
    /// `x * weight / sqrt(mean(x², last axis) + eps)`, as LLaMA's RMSNorm.
    fn rms_norm(&mut self, p: &str, x: &str, h: usize, last: &str, eps: &str) -> String {
        let w = self.weight(&format!("{p}.weight"), &[h]);
        let sq = self.op(&format!("/{p}/Pow"), "Mul", &[x, x], vec![]);
        let ms = self.op(&format!("/{p}/ReduceMean"), "ReduceMean", &[&sq, last], vec![int_attr("keepdims", 1)]);
        let ms = self.op(&format!("/{p}/Add"), "Add", &[&ms, eps], vec![]);
        let rms = self.op(&format!("/{p}/Sqrt"), "Sqrt", &[&ms], vec![]);
        let y = self.op(&format!("/{p}/Div"), "Div", &[x, &rms], vec![]);
        self.op(&format!("/{p}/Mul"), "Mul", &[&y, &w], vec![])
    }

    /// `x @ W` with `W` `[n_in, n_out]` and no bias.
    fn proj(&mut self, p: &str, x: &str, n_in: usize, n_out: usize) -> String {
        let w = self.weight(&format!("{p}.weight"), &[n_in, n_out]);
        self.op(&format!("/{p}/MatMul"), "MatMul", &[x, &w], vec![])
    }

    /// Rotary embedding of `x` `[B, heads, S, d]`: `x * cos + rotate_half(x) * sin`.
    fn rotary(&mut self, p: &str, x: &str, cos: &str, sin: &str, halves: &str) -> String {
        let names = [format!("{p}/Split_lo"), format!("{p}/Split_hi")];
        self.nodes.push(pb::NodeProto {
            name: format!("{p}/Split"),
            op_type: "Split".into(),
            input: vec![x.to_string(), halves.to_string()],
            output: names.to_vec(),
            attribute: vec![int_attr("axis", -1)],
            ..Default::default()
        });
        let neg = self.op(&format!("{p}/Neg"), "Neg", &[&names[1]], vec![]);
        let rot = self.op(&format!("{p}/Concat"), "Concat", &[&neg, &names[0]], vec![int_attr("axis", -1)]);
        let a = self.op(&format!("{p}/Mul"), "Mul", &[x, cos], vec![]);
        let b = self.op(&format!("{p}/Mul_1"), "Mul", &[&rot, sin], vec![]);
        self.op(&format!("{p}/Add"), "Add", &[&a, &b], vec![])
    }
}

/// The ONNX bytes (IR version 8, opset 20) of a weight-free LLaMA-style decoder (see
/// [`LlamaConfig`]) with inputs `input_ids` and `position_ids` `[batch, seq]` (i64) and output
/// `logits` `[batch, seq, vocab]`. The rotary tables and the causal mask are computed from
/// `position_ids` (as Hugging Face's export does), so no `[seq, seq]` constant is stored.
/// Parameter names follow Meta's checkpoints (`layers.{i}.attention.wq.weight`, stored
/// `[in, out]`).
pub fn llama(c: &LlamaConfig) -> Result<Vec<u8>, String> {
    llama_with(c, AttentionForm::Unfused)
}

/// [`llama`] with its attention written in `form` (opset 23 when fused).
pub fn llama_with(c: &LlamaConfig, form: AttentionForm) -> Result<Vec<u8>, String> {
    c.check()?;
    let (b, s, h, a, kvh, v) = (c.batch, c.seq, c.hidden, c.heads, c.kv_heads, c.vocab);
    let d = c.head_dim();
    let rep = a / kvh;
    let mut m = Builder { nodes: vec![], inits: vec![] };
    let emb = m.weight("tok_embeddings.weight", &[v, h]);
    let mut x = m.op("/tok_embeddings/Gather", "Gather", &[&emb, "input_ids"], vec![int_attr("axis", 0)]);
    let last = m.ints("axes.last", &[-1]);
    let eps = m.scalar("rms.eps", 1e-5);
    // Rotary tables [B, 1, S, d] from the positions: angle = position * theta^(-2i/d).
    let inv: Vec<f32> = (0..d / 2).map(|i| 500_000f64.powf(-2.0 * i as f64 / d as f64) as f32).collect();
    let inv_freq = m.float_const("rope.inv_freq", &[1, d / 2], &inv);
    let pos = m.op("/rope/Cast", "Cast", &["position_ids"], vec![int_attr("to", DataType::Float as i64)]);
    let pos_col = m.ints("shape.pos_col", &[b as i64, s as i64, 1]);
    let pos = m.op("/rope/Reshape", "Reshape", &[&pos, &pos_col], vec![]);
    let ang = m.op("/rope/Mul", "Mul", &[&pos, &inv_freq], vec![]);
    let ang = m.op("/rope/Concat", "Concat", &[&ang, &ang], vec![int_attr("axis", -1)]);
    let rope_shape = m.ints("shape.rope", &[b as i64, 1, s as i64, d as i64]);
    let ang = m.op("/rope/Reshape_1", "Reshape", &[&ang, &rope_shape], vec![]);
    let cos = m.op("/rope/Cos", "Cos", &[&ang], vec![]);
    let sin = m.op("/rope/Sin", "Sin", &[&ang], vec![]);
    // Unfused: the causal mask [B, 1, S, S] (key position <= query position) and the scale.
    let unfused = (form == AttentionForm::Unfused).then(|| {
        let q_shape = m.ints("shape.mask_q", &[b as i64, 1, s as i64, 1]);
        let k_shape = m.ints("shape.mask_k", &[b as i64, 1, 1, s as i64]);
        let pq = m.op("/mask/Reshape", "Reshape", &["position_ids", &q_shape], vec![]);
        let pk = m.op("/mask/Reshape_1", "Reshape", &["position_ids", &k_shape], vec![]);
        let allowed = m.op("/mask/LessOrEqual", "LessOrEqual", &[&pk, &pq], vec![]);
        (m.scalar("attn.scale", (d as f32).sqrt()), allowed, m.scalar("mask.min", f32::MIN))
    });
    let halves = m.ints("split.rope", &[(d / 2) as i64, (d / 2) as i64]);
    let q_heads = m.ints("shape.q_heads", &[b as i64, s as i64, a as i64, d as i64]);
    let kv_heads = m.ints("shape.kv_heads", &[b as i64, s as i64, kvh as i64, d as i64]);
    let kv_rep = m.ints("shape.kv_rep", &[b as i64, kvh as i64, 1, s as i64, d as i64]);
    let kv_expand = m.ints("shape.kv_expand", &[b as i64, kvh as i64, rep as i64, s as i64, d as i64]);
    let kv_merged = m.ints("shape.kv_merged", &[b as i64, a as i64, s as i64, d as i64]);
    let merged = m.ints("shape.merged", &[b as i64, s as i64, h as i64]);
    let heads_first = ints_attr("perm", &[0, 2, 1, 3]);
    for i in 0..c.layers {
        let p = format!("layers.{i}");
        let n = m.rms_norm(&format!("{p}.attention_norm"), &x, h, &last, &eps);
        let q = m.proj(&format!("{p}.attention.wq"), &n, h, a * d);
        let k = m.proj(&format!("{p}.attention.wk"), &n, h, kvh * d);
        let vv = m.proj(&format!("{p}.attention.wv"), &n, h, kvh * d);
        let q = m.op(&format!("/{p}/attention/q/Reshape"), "Reshape", &[&q, &q_heads], vec![]);
        let q = m.op(&format!("/{p}/attention/q/Transpose"), "Transpose", &[&q], vec![heads_first.clone()]);
        let q = m.rotary(&format!("/{p}/attention/q/rope"), &q, &cos, &sin, &halves);
        let mut kv = vec![];
        for (name, t) in [("k", &k), ("v", &vv)] {
            let t = m.op(&format!("/{p}/attention/{name}/Reshape"), "Reshape", &[t, &kv_heads], vec![]);
            let mut t =
                m.op(&format!("/{p}/attention/{name}/Transpose"), "Transpose", &[&t], vec![heads_first.clone()]);
            if name == "k" {
                t = m.rotary(&format!("/{p}/attention/k/rope"), &t, &cos, &sin, &halves);
            }
            // Grouped-query attention: each key/value head serves `rep` query heads (the fused
            // op reads them in place).
            if rep > 1 && form == AttentionForm::Unfused {
                let r = m.op(&format!("/{p}/attention/{name}/repeat/Reshape"), "Reshape", &[&t, &kv_rep], vec![]);
                let e = m.op(&format!("/{p}/attention/{name}/repeat/Expand"), "Expand", &[&r, &kv_expand], vec![]);
                t = m.op(&format!("/{p}/attention/{name}/repeat/Reshape_1"), "Reshape", &[&e, &kv_merged], vec![]);
            }
            kv.push(t);
        }
        let ctx = if form == AttentionForm::Fused {
            m.causal_attention(&format!("/{p}/attention/Attention"), &q, &kv[0], &kv[1], d)
        } else {
            let (scale, allowed, neg) = unfused.as_ref().expect("unfused attention has its mask");
            let kt = m.op(
                &format!("/{p}/attention/k/Transpose_1"),
                "Transpose",
                &[&kv[0]],
                vec![ints_attr("perm", &[0, 1, 3, 2])],
            );
            let scores = m.op(&format!("/{p}/attention/MatMul"), "MatMul", &[&q, &kt], vec![]);
            let scores = m.op(&format!("/{p}/attention/Div"), "Div", &[&scores, scale], vec![]);
            let scores = m.op(&format!("/{p}/attention/Where"), "Where", &[allowed, &scores, neg], vec![]);
            let probs = m.op(&format!("/{p}/attention/Softmax"), "Softmax", &[&scores], vec![int_attr("axis", -1)]);
            m.op(&format!("/{p}/attention/MatMul_1"), "MatMul", &[&probs, &kv[1]], vec![])
        };
        let ctx = m.op(&format!("/{p}/attention/Transpose"), "Transpose", &[&ctx], vec![heads_first.clone()]);
        let ctx = m.op(&format!("/{p}/attention/Reshape"), "Reshape", &[&ctx, &merged], vec![]);
        let o = m.proj(&format!("{p}.attention.wo"), &ctx, a * d, h);
        x = m.op(&format!("/{p}/Add"), "Add", &[&x, &o], vec![]);
        let n = m.rms_norm(&format!("{p}.ffn_norm"), &x, h, &last, &eps);
        // SwiGLU: w2(silu(w1 x) * w3 x).
        let g = m.proj(&format!("{p}.feed_forward.w1"), &n, h, c.ffn);
        let sg = m.op(&format!("/{p}/feed_forward/Sigmoid"), "Sigmoid", &[&g], vec![]);
        let g = m.op(&format!("/{p}/feed_forward/Mul"), "Mul", &[&g, &sg], vec![]);
        let up = m.proj(&format!("{p}.feed_forward.w3"), &n, h, c.ffn);
        let f = m.op(&format!("/{p}/feed_forward/Mul_1"), "Mul", &[&g, &up], vec![]);
        let f = m.proj(&format!("{p}.feed_forward.w2"), &f, c.ffn, h);
        x = m.op(&format!("/{p}/Add_1"), "Add", &[&x, &f], vec![]);
    }
    let x = m.rms_norm("norm", &x, h, &last, &eps);
    let head = m.weight("output.weight", &[h, v]);
    let logits = m.op("/output/MatMul", "MatMul", &[&x, &head], vec![]);
    m.nodes.push(pb::NodeProto {
        name: "/logits/Identity".into(),
        op_type: "Identity".into(),
        input: vec![logits],
        output: vec!["logits".into()],
        ..Default::default()
    });
    let model = pb::ModelProto {
        ir_version: 8,
        opset_import: vec![pb::OperatorSetIdProto { domain: String::new(), version: form.opset() }],
        producer_name: "autopar gen llama".into(),
        graph: Some(pb::GraphProto {
            name: format!("llama-{}l-{}h", c.layers, c.hidden),
            node: m.nodes,
            initializer: m.inits,
            input: vec![
                dims_info("input_ids", DataType::Int64, &[b, s]),
                dims_info("position_ids", DataType::Int64, &[b, s]),
            ],
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

    #[test]
    fn generated_llama_imports_with_its_parameter_count() {
        let c = LlamaConfig { layers: 2, hidden: 64, heads: 4, kv_heads: 2, ffn: 96, seq: 16, vocab: 100, batch: 2 };
        let bytes = llama(&c).unwrap();
        let g = crate::import_bytes(&bytes, "gen", "gen", None, &crate::ImportOptions::default()).unwrap();
        assert_eq!(g.param_stats().0, c.parameters());
        assert_eq!(g.meta(g.outputs[0].1).shape, vec![2, 16, 100]);
        // Meta's published sizes: 8.03B and 70.6B parameters.
        assert_eq!(LlamaConfig::llama3_8b().parameters(), 8_030_261_248);
        assert_eq!(LlamaConfig::llama3_70b().parameters(), 70_553_706_496);
        assert!(llama(&LlamaConfig { kv_heads: 3, ..c.clone() }).is_err());
        assert!(llama(&LlamaConfig { hidden: 68, heads: 4, ..c }).is_err());
    }
}
