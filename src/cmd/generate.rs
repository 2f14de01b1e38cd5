//! `autopar gen`: weight-free model generators.

use std::path::PathBuf;

use anyhow::{Context, Result};

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
    /// Transformer blocks.
    #[arg(long)]
    pub layers: usize,
    /// Hidden size.
    #[arg(long)]
    pub hidden: usize,
    /// Attention heads (must divide --hidden).
    #[arg(long)]
    pub heads: usize,
    /// Sequence length.
    #[arg(long, default_value_t = 1024)]
    pub seq: usize,
    /// Vocabulary size.
    #[arg(long, default_value_t = 50257)]
    pub vocab: usize,
    /// Batch size.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Output file.
    #[arg(short = 'o', long)]
    pub out: PathBuf,
}

/// Runs `autopar gen`.
pub fn run(a: &GenArgs) -> Result<()> {
    match &a.model {
        GenModel::Gpt(g) => {
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
