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
        ("the attention scores (batch x heads x seq x seq)", bytes(&[b, a, s, s])),
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

/// Runs `autopar gen`.
pub fn run(a: &GenArgs) -> Result<()> {
    match &a.model {
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
            let bytes = tracer::generate::gpt(&c).map_err(anyhow::Error::msg)?;
            std::fs::write(&g.out, &bytes).with_context(|| format!("writing {}", g.out.display()))?;
            println!(
                "wrote {} ({} bytes, no weights): GPT with {} layers, hidden {}, {} heads, seq {}, vocab {}, batch {}; {:.2}B parameters",
                g.out.display(),
                bytes.len(),
                c.layers,
                c.hidden,
                c.heads,
                c.seq,
                c.vocab,
                c.batch,
                c.parameters() as f64 / 1e9
            );
        }
    }
    Ok(())
}
