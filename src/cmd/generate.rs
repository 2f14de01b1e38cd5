//! `autopar gen`: weight-free model generators.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};

/// Arguments of `autopar gen`.
#[derive(clap::Args, Debug)]
pub struct GenArgs {
    /// What to generate.
    #[command(subcommand)]
    pub model: GenModel,
}

/// Generated architectures.
#[derive(clap::Subcommand, Debug)]
pub enum GenModel {
    /// A GPT-2-style decoder: embeddings, L pre-norm blocks (attention, GELU MLP of 4x width),
    /// final layer norm, LM head. Input `input_ids` [batch, seq], output `logits`.
    Gpt(GptArgs),
    /// A LLaMA-style decoder: embeddings, L blocks of RMSNorm, attention with rotary position
    /// embeddings and grouped-query heads (--kv-heads key/value heads), RMSNorm, SwiGLU MLP of
    /// width --ffn; final RMSNorm, untied LM head, no biases. Inputs `input_ids` and
    /// `position_ids` [batch, seq] (the rotary tables and the causal mask come from the
    /// positions), output `logits`. `--preset llama3-8b` or `llama3-70b` sets Meta's shapes
    /// (sequence 8192, batch 1); flags given with a preset override it.
    Llama(LlamaArgs),
}

/// How `gen` writes attention (`--attention`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionArg {
    /// Separate ops, as PyTorch's eager attention exports: MatMul, scale, causal mask, Softmax,
    /// MatMul (the batch x heads x seq x seq scores are tensors of the step, priced and stored).
    #[default]
    Unfused,
    /// One ONNX Attention node per layer (opset 23), computed as flash attention: the scores are
    /// never stored, and the backward recomputes them (what FlashAttention, PyTorch's
    /// scaled_dot_product_attention and Megatron-Core's fused attention do).
    Fused,
}

impl AttentionArg {
    fn form(self) -> tracer::generate::AttentionForm {
        match self {
            AttentionArg::Unfused => tracer::generate::AttentionForm::Unfused,
            AttentionArg::Fused => tracer::generate::AttentionForm::Fused,
        }
    }
}

/// Published LLaMA shapes.
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum LlamaPreset {
    /// LLaMA-3 8B: 32 layers, hidden 4096, 32 heads, 8 KV heads, FFN 14336, vocab 128256.
    #[value(name = "llama3-8b")]
    Llama3_8b,
    /// LLaMA-3 70B: 80 layers, hidden 8192, 64 heads, 8 KV heads, FFN 28672, vocab 128256.
    #[value(name = "llama3-70b")]
    Llama3_70b,
}

/// Arguments of `autopar gen llama`.
#[derive(clap::Args, Debug)]
pub struct LlamaArgs {
    /// Start from a published model's shapes.
    #[arg(long)]
    pub preset: Option<LlamaPreset>,
    /// Transformer blocks (at most 100000).
    #[arg(long, value_parser = |s: &str| size(s, 100_000))]
    pub layers: Option<usize>,
    /// Hidden size (at most 2^20).
    #[arg(long, value_parser = |s: &str| size(s, 1 << 20))]
    pub hidden: Option<usize>,
    /// Query heads (must divide --hidden, with an even head size; at most 2^16).
    #[arg(long, value_parser = |s: &str| size(s, 1 << 16))]
    pub heads: Option<usize>,
    /// Key/value heads (must divide --heads; default: --heads, plain multi-head attention).
    #[arg(long, value_parser = |s: &str| size(s, 1 << 16))]
    pub kv_heads: Option<usize>,
    /// MLP width (default: 8/3 x hidden rounded up to a multiple of 256, as LLaMA).
    #[arg(long, value_parser = |s: &str| size(s, 1 << 22))]
    pub ffn: Option<usize>,
    /// Sequence length (default 2048 without a preset; at most 2^24).
    #[arg(long, value_parser = |s: &str| size(s, 1 << 24))]
    pub seq: Option<usize>,
    /// Vocabulary size (default 32000 without a preset; at most 2^24).
    #[arg(long, value_parser = |s: &str| size(s, 1 << 24))]
    pub vocab: Option<usize>,
    /// Batch size (default 1; at most 2^24).
    #[arg(long, value_parser = |s: &str| size(s, 1 << 24))]
    pub batch: Option<usize>,
    /// How attention is written: `unfused` (separate ops) or `fused` (one ONNX Attention per
    /// layer, computed as flash attention).
    #[arg(long, value_enum, default_value_t = AttentionArg::Unfused)]
    pub attention: AttentionArg,
    /// Output file.
    #[arg(short = 'o', long)]
    pub out: PathBuf,
}

impl LlamaArgs {
    /// The preset's shapes with the given flags over them; without a preset, --layers,
    /// --hidden and --heads are required.
    fn config(&self) -> Result<tracer::generate::LlamaConfig> {
        use tracer::generate::LlamaConfig;
        let base = match self.preset {
            Some(LlamaPreset::Llama3_8b) => Some(LlamaConfig::llama3_8b()),
            Some(LlamaPreset::Llama3_70b) => Some(LlamaConfig::llama3_70b()),
            None => None,
        };
        let need = |v: Option<usize>, from: Option<usize>, flag: &str| {
            v.or(from).with_context(|| format!("gen llama needs {flag} (or a --preset)"))
        };
        let layers = need(self.layers, base.as_ref().map(|b| b.layers), "--layers")?;
        let hidden = need(self.hidden, base.as_ref().map(|b| b.hidden), "--hidden")?;
        let heads = need(self.heads, base.as_ref().map(|b| b.heads), "--heads")?;
        let pick = |v: Option<usize>, from: Option<usize>, default: usize| v.or(from).unwrap_or(default);
        let ffn_default = (hidden * 8 / 3).div_ceil(256) * 256;
        Ok(LlamaConfig {
            layers,
            hidden,
            heads,
            kv_heads: pick(self.kv_heads, base.as_ref().map(|b| b.kv_heads), heads),
            ffn: pick(self.ffn, base.as_ref().map(|b| b.ffn), ffn_default),
            seq: pick(self.seq, base.as_ref().map(|b| b.seq), 2048),
            vocab: pick(self.vocab, base.as_ref().map(|b| b.vocab), 32000),
            batch: pick(self.batch, base.as_ref().map(|b| b.batch), 1),
        })
    }
}

/// Arguments of `autopar gen gpt`.
#[derive(clap::Args, Debug)]
pub struct GptArgs {
    /// Transformer blocks (at most 100000).
    #[arg(long, value_parser = |s: &str| size(s, 100_000))]
    pub layers: usize,
    /// Hidden size (at most 2^20).
    #[arg(long, value_parser = |s: &str| size(s, 1 << 20))]
    pub hidden: usize,
    /// Attention heads (must divide --hidden; at most 2^16).
    #[arg(long, value_parser = |s: &str| size(s, 1 << 16))]
    pub heads: usize,
    /// Sequence length (at most 2^24).
    #[arg(long, default_value = "1024", value_parser = |s: &str| size(s, 1 << 24))]
    pub seq: usize,
    /// Vocabulary size (at most 2^24).
    #[arg(long, default_value = "50257", value_parser = |s: &str| size(s, 1 << 24))]
    pub vocab: usize,
    /// Batch size (at most 2^24).
    #[arg(long, default_value = "8", value_parser = |s: &str| size(s, 1 << 24))]
    pub batch: usize,
    /// How attention is written: `unfused` (separate ops) or `fused` (one ONNX Attention per
    /// layer, computed as flash attention).
    #[arg(long, value_enum, default_value_t = AttentionArg::Unfused)]
    pub attention: AttentionArg,
    /// Output file.
    #[arg(short = 'o', long)]
    pub out: PathBuf,
}

/// A model dimension from 1 to `max`.
fn size(s: &str, max: u64) -> Result<usize, String> {
    super::common::parse_int_in(s, 1, max).map(|n| n as usize)
}

/// Refuses sizes whose largest tensors (or all parameters together) exceed 1 EiB in f32: each
/// flag is bounded, but their products could still overflow the importer's and planner's byte
/// counts.
fn check_products(g: &GptArgs) -> Result<()> {
    let (l, h, a, s, v, b) = (g.layers, g.hidden, g.heads, g.seq, g.vocab, g.batch);
    let bytes = |dims: &[usize]| dims.iter().fold(4u128, |acc, &d| acc.saturating_mul(d as u128));
    let params = (l as u128) * (12 * (h as u128).pow(2) + 13 * h as u128) + 2 * (v * h) as u128 + (s * h) as u128;
    for (what, n) in [
        (
            "the attention scores (batch x heads x seq x seq)",
            if g.attention == AttentionArg::Fused { 0 } else { bytes(&[b, a, s, s]) },
        ),
        ("the MLP activations (batch x seq x 4 x hidden)", bytes(&[b, s, 4, h])),
        ("the logits (batch x seq x vocab)", bytes(&[b, s, v])),
        ("the parameters", params.saturating_mul(4)),
    ] {
        if n > super::common::MAX_BYTES as u128 {
            bail!("{what} would take more than 1 EiB in f32; choose smaller sizes");
        }
    }
    Ok(())
}

/// [`check_products`] for a LLaMA.
fn check_llama(c: &tracer::generate::LlamaConfig, attention: AttentionArg) -> Result<()> {
    let bytes = |dims: &[usize]| dims.iter().fold(4u128, |acc, &d| acc.saturating_mul(d as u128));
    let params = {
        let (h, f, v, l) = (c.hidden as u128, c.ffn as u128, c.vocab as u128, c.layers as u128);
        let kv = (c.kv_heads * (c.hidden / c.heads.max(1))) as u128;
        2 * v * h + l * (2 * h + 2 * h * h + 2 * h * kv + 3 * h * f) + h
    };
    for (what, n) in [
        (
            "the attention scores (batch x heads x seq x seq)",
            if attention == AttentionArg::Fused { 0 } else { bytes(&[c.batch, c.heads, c.seq, c.seq]) },
        ),
        ("the MLP activations (batch x seq x ffn)", bytes(&[c.batch, c.seq, c.ffn])),
        ("the logits (batch x seq x vocab)", bytes(&[c.batch, c.seq, c.vocab])),
        ("the parameters", params.saturating_mul(4)),
    ] {
        if n > super::common::MAX_BYTES as u128 {
            bail!("{what} would take more than 1 EiB in f32; choose smaller sizes");
        }
    }
    Ok(())
}

/// A parameter count as people say it: `8.03B`, `124.44M`.
fn count(n: usize) -> String {
    if n >= 1_000_000_000 { format!("{:.2}B", n as f64 / 1e9) } else { format!("{:.2}M", n as f64 / 1e6) }
}

/// Runs `autopar gen`.
pub fn run(a: &GenArgs) -> Result<()> {
    match &a.model {
        GenModel::Llama(l) => {
            let c = l.config()?;
            c.check().map_err(anyhow::Error::msg)?;
            check_llama(&c, l.attention)?;
            let bytes = tracer::generate::llama_with(&c, l.attention.form()).map_err(anyhow::Error::msg)?;
            std::fs::write(&l.out, &bytes).with_context(|| format!("writing {}", l.out.display()))?;
            println!(
                "wrote {} ({} bytes, no weights): LLaMA with {} layers, hidden {}, {} heads ({} key/value), ffn {}, seq {}, vocab {}, batch {}, {} attention; {} parameters",
                l.out.display(),
                bytes.len(),
                c.layers,
                c.hidden,
                c.heads,
                c.kv_heads,
                c.ffn,
                c.seq,
                c.vocab,
                c.batch,
                attention_name(l.attention),
                count(c.parameters())
            );
        }
        GenModel::Gpt(g) => {
            check_products(g)?;
            let c = tracer::generate::GptConfig {
                layers: g.layers,
                hidden: g.hidden,
                heads: g.heads,
                seq: g.seq,
                vocab: g.vocab,
                batch: g.batch,
            };
            let bytes = tracer::generate::gpt_with(&c, g.attention.form()).map_err(anyhow::Error::msg)?;
            std::fs::write(&g.out, &bytes).with_context(|| format!("writing {}", g.out.display()))?;
            println!(
                "wrote {} ({} bytes, no weights): GPT with {} layers, hidden {}, {} heads, seq {}, vocab {}, batch {}, {} attention; {} parameters",
                g.out.display(),
                bytes.len(),
                c.layers,
                c.hidden,
                c.heads,
                c.seq,
                c.vocab,
                c.batch,
                attention_name(g.attention),
                count(c.parameters())
            );
        }
    }
    Ok(())
}

fn attention_name(a: AttentionArg) -> &'static str {
    match a {
        AttentionArg::Unfused => "unfused",
        AttentionArg::Fused => "fused",
    }
}
