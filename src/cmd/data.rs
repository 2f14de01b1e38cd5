//! `--data` and its flags, shared by `autopar run` and `autopar train`: datasets streamed into
//! the inputs of each step ([`runtime::data`]).

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result, bail};
use ir::{Tensor, TensorMeta};
use runtime::data::{Binding, DataOptions, Dataset, Position, TokenType};
use runtime::launch::EvalOptions;

/// Token id width of token files.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenKind {
    /// Bytes (a text file as byte-level tokens, vocabulary 256).
    U8,
    /// uint16 (nanoGPT's train.bin).
    U16,
    /// uint32.
    U32,
}

/// Dataset flags.
#[derive(clap::Args, Debug)]
pub struct DataArgs {
    /// Stream samples into an input from files, a new batch every step: `NAME=PATH`, where PATH
    /// is a .npy file, a .npz archive (the array named NAME, or its only array) or a directory
    /// of .npy/.npz shards read in name order (the first dim counts samples); or any other file
    /// as token ids (--token-type; `u8`: a text file's bytes), cut into sequences of the input's
    /// length: `NAME=TOKENS.bin`, or `NAME,NEXT=TOKENS.bin` where NEXT (the labels) gets the
    /// tokens one further. Each rank reads only the rows
    /// its block of the input needs; epochs are shuffled by --data-seed.
    #[arg(long = "data", value_name = "NAME=PATH")]
    pub data: Vec<String>,
    /// Seed of each epoch's sample order.
    #[arg(long, default_value_t = 0, requires = "data")]
    pub data_seed: u64,
    /// Read the samples in file order every epoch.
    #[arg(long, requires = "data")]
    pub no_shuffle: bool,
    /// Width of token ids in token files (any file but .npy/.npz): u16 (nanoGPT's train.bin),
    /// u32, or u8 (bytes: a text file as byte-level tokens). Default: u8 for a .txt file, u16
    /// otherwise.
    #[arg(long, value_enum)]
    pub token_type: Option<TokenKind>,
    /// Held-out data to evaluate the loss on (forward only, with the same plan; no gradients,
    /// no update): `NAME=PATH` as --data, read in file order, so every evaluation sees the same
    /// batches. Inputs it does not bind keep their training data.
    #[arg(long = "eval-data", value_name = "NAME=PATH")]
    pub eval_data: Vec<String>,
    /// Evaluate after every K steps (and always after the last).
    #[arg(long, value_name = "K", requires = "eval_data", value_parser = super::common::parse_steps)]
    pub eval_every: Option<u64>,
    /// Batches per evaluation (default: every complete batch of the held-out data).
    #[arg(long, value_name = "N", requires = "eval_data", value_parser = super::common::parse_steps)]
    pub eval_batches: Option<u64>,
}

impl DataArgs {
    /// Opens the dataset for `inputs` (name, the meta of one step's global batch), if any is
    /// bound; `feeds` (the fixed ones) must not name a bound input.
    pub fn open(&self, inputs: &[(String, TensorMeta)], feeds: &BTreeMap<String, Tensor>) -> Result<Option<Dataset>> {
        if self.data.is_empty() {
            return Ok(None);
        }
        let ds = self.open_bindings(&self.data, inputs, !self.no_shuffle)?;
        if let Some(n) = ds.names().find(|n| feeds.contains_key(*n)) {
            bail!("input {n} is given by both --feed and --data");
        }
        if let Some((n, m)) = inputs.iter().find(|(n, _)| !feeds.contains_key(n) && !ds.names().any(|d| d == n)) {
            bail!("input {n} ({m}) has neither --data nor --feed");
        }
        Ok(Some(ds))
    }

    fn open_bindings(&self, data: &[String], inputs: &[(String, TensorMeta)], shuffle: bool) -> Result<Dataset> {
        let bindings: Vec<Binding> =
            data.iter().map(|s| s.parse()).collect::<Result<_, String>>().map_err(anyhow::Error::msg)?;
        let opts = DataOptions {
            seed: self.data_seed,
            shuffle,
            tokens: self.token_type.map(|t| match t {
                TokenKind::U8 => TokenType::U8,
                TokenKind::U16 => TokenType::U16,
                TokenKind::U32 => TokenType::U32,
            }),
        };
        Ok(Dataset::open(&bindings, inputs, opts)?)
    }

    /// Opens the held-out data of `--eval-data`, if any.
    pub fn open_eval(&self, inputs: &[(String, TensorMeta)]) -> Result<Option<EvalOptions>> {
        if self.eval_data.is_empty() {
            return Ok(None);
        }
        let data = self.open_bindings(&self.eval_data, inputs, false).context("--eval-data")?;
        let whole = data.steps_per_epoch();
        if let Some(n) = self.eval_batches.filter(|&n| n > whole) {
            bail!("--eval-batches {n}: the held-out data holds {whole} batch(es) of {}", data.batch());
        }
        let batches = self.eval_batches.unwrap_or(whole).max(1);
        Ok(Some(EvalOptions { data: std::sync::Arc::new(data), every: self.eval_every.unwrap_or(0), batches }))
    }
}

/// One line on a dataset: its samples, epochs and order.
pub fn describe(ds: &Dataset) -> String {
    let o = ds.options();
    format!(
        "data: {} samples, {} per step, {} steps per epoch, {}: {}",
        ds.samples(),
        ds.batch(),
        ds.steps_per_epoch(),
        if o.shuffle { format!("shuffled with seed {}", o.seed) } else { "in file order".into() },
        ds.description()
    )
}

/// A graph's inputs by name, with their metas.
pub fn graph_inputs(g: &ir::Graph) -> Vec<(String, TensorMeta)> {
    g.inputs
        .iter()
        .filter_map(|&i| match &g.node(i).op {
            ir::Op::Input { name } => Some((name.clone(), g.node(i).outputs[0].clone())),
            _ => None,
        })
        .collect()
}

/// The file `train --save` records the data position in.
const POSITION_FILE: &str = "data.json";

/// Writes where a `train` run is in its data next to its saved state (and removes a position
/// an earlier save left, for a run on fixed feeds).
pub fn save_position(dir: &Path, ds: Option<&Dataset>, steps_done: u64) -> Result<()> {
    let file = dir.join(POSITION_FILE);
    let Some(ds) = ds else {
        return match std::fs::remove_file(&file) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(e).with_context(|| format!("--save: removing {}", file.display()))
            }
            _ => Ok(()),
        };
    };
    let text = serde_json::to_string_pretty(&ds.position(steps_done)?)?;
    std::fs::write(&file, text + "\n").with_context(|| format!("--save {}", file.display()))
}

/// Checks that a `train --load DIR` run continues the data of the run that saved it.
pub fn check_position(dir: &Path, ds: Option<&Dataset>, steps_done: u64) -> Result<()> {
    let file = dir.join(POSITION_FILE);
    let saved: Option<Position> = if file.exists() {
        let text = ir::files::read_regular_to_string(&file, 1 << 20).with_context(|| file.display().to_string())?;
        Some(serde_json::from_str(&text).with_context(|| file.display().to_string())?)
    } else {
        None
    };
    match (ds, saved) {
        (Some(d), Some(p)) => match d.resumes(&p, steps_done) {
            Some(why) => bail!("--load {}: {why}", dir.display()),
            None => Ok(()),
        },
        (Some(_), None) => bail!("--load {}: the saved run used fixed feeds (--feed), this one --data", dir.display()),
        (None, Some(p)) => bail!("--load {}: the saved run read --data ({}); pass it again", dir.display(), p.data),
        (None, None) => Ok(()),
    }
}
