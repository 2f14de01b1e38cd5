//! Single-device training: runs a [`TrainingGraph`] step after step, keeping parameters and
//! optimizer state between steps, and saves or loads them.
//!
//! Invariant: the trainer's storage holds exactly one tensor per param and state of the graph,
//! with the graph's metas; each step replaces the updated ones ([`ir::Graph::updates`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ir::autodiff::TrainingGraph;
use ir::{Op, Tensor, TensorMeta};

use crate::npy::{NpyError, read_npz, write_npz};
use crate::{Interpreter, RunError};

/// Why training state cannot be saved or loaded.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// Reading or writing a file failed.
    #[error(transparent)]
    Npy(#[from] NpyError),
    /// Writing the safetensors file failed.
    #[error(transparent)]
    Weights(#[from] crate::weights::WeightsError),
    /// I/O outside the array files.
    #[error("{path}: {cause}")]
    Io {
        /// File or directory.
        path: PathBuf,
        /// Cause.
        cause: std::io::Error,
    },
    /// A parameter holds NaN or infinite values: the run diverged, and its weights are not saved.
    #[error(
        "parameter {name} holds {count} NaN or infinite value(s) of {total}: the run diverged, and its parameters are \
         not saved (try a smaller --lr, or check the input data)"
    )]
    NotFinite {
        /// The parameter.
        name: String,
        /// Its non-finite values.
        count: usize,
        /// Its values.
        total: usize,
    },
    /// A saved tensor does not fit the model.
    #[error("{path}: {message}")]
    Mismatch {
        /// File.
        path: PathBuf,
        /// What differs.
        message: String,
    },
}

/// One training step's results.
#[derive(Debug, Clone)]
pub struct StepReport {
    /// Step number (1 for the first step this trainer ran, continuing after a load).
    pub step: u64,
    /// The loss before this step's update.
    pub loss: f32,
    /// Peak bytes of inputs and intermediates during the step.
    pub peak_bytes: usize,
    /// Bytes of parameters and optimizer state (resident between steps).
    pub resident_bytes: usize,
    /// Every graph output of the step (the loss, and gradients when the graph has no optimizer).
    pub outputs: BTreeMap<String, Tensor>,
    /// Seconds per node kernel, when profiling ([`Trainer::with_profiling`]).
    pub node_seconds: Vec<(ir::NodeIndex, f64)>,
}

/// An activation the step keeps from forward until backward reads it.
#[derive(Debug, Clone, PartialEq)]
pub struct SavedTensor {
    /// Producing node.
    pub node: String,
    /// Its meta.
    pub meta: TensorMeta,
}

/// Runs a training graph on one CPU device.
pub struct Trainer<'t> {
    tg: &'t TrainingGraph,
    interp: Interpreter<'t>,
    storage: BTreeMap<String, Tensor>,
    steps_done: u64,
    /// The seed of the run's random ops (dropout masks).
    seed: u64,
    /// Whether steps draw their dropout masks (`false`: nothing dropped, as in inference).
    dropout: bool,
}

impl<'t> Trainer<'t> {
    /// A trainer starting from `params` (by name; every param of the graph must be there) with
    /// zero optimizer state. f32 params are widened for a graph made f64 by
    /// [`TrainingGraph::with_float_type`].
    pub fn new(tg: &'t TrainingGraph, params: &BTreeMap<String, Tensor>) -> Result<Self, RunError> {
        let g = &tg.graph;
        let mut storage = BTreeMap::new();
        for &p in &g.params {
            if let Op::Param { name } = &g.node(p).op {
                let t = params.get(name).ok_or_else(|| RunError::MissingParam { name: name.clone() })?;
                let want = g.node(p).outputs[0].dtype;
                let t =
                    if crate::values::widens(t.dtype(), want) { t.clone().with_float_type(want) } else { t.clone() };
                storage.insert(name.clone(), t);
            }
        }
        for &s in &g.states {
            if let Op::State { name } = &g.node(s).op {
                let t = Tensor::zeros(&g.node(s).outputs[0])
                    .map_err(|e| RunError::Alloc { what: format!("optimizer state {name}"), error: e })?;
                storage.insert(name.clone(), t);
            }
        }
        Ok(Trainer { tg, interp: Interpreter::new(g)?, storage, steps_done: 0, seed: 0, dropout: true })
    }

    /// Draws the run's dropout masks from `seed` (0 by default): step `k` (0-based, counting on
    /// after a load) draws the masks every plan of the graph draws at step `k` with that seed.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// With `false`, steps drop nothing: every training-mode dropout keeps every element, as
    /// in inference (the deterministic part of a model, to compare with a run without dropout).
    pub fn with_dropout(mut self, on: bool) -> Self {
        self.dropout = on;
        self
    }

    /// The seed of the run's dropout masks.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Whether the graph draws random numbers (it has a training-mode dropout).
    fn draws(&self) -> bool {
        let g = &self.tg.graph;
        g.g.node_indices().any(|n| matches!(g.node(n).op, Op::Dropout(_)))
    }

    /// Times every kernel of each step ([`StepReport::node_seconds`]).
    pub fn with_profiling(mut self, on: bool) -> Self {
        self.interp = self.interp.with_profiling(on);
        self
    }

    /// Runs one step on `feeds`: forward, loss, backward, update. Dropout draws the masks of
    /// step [`Trainer::steps_done`] of the seed's run.
    pub fn step(&mut self, cpu: &crate::cpu::Cpu, feeds: &BTreeMap<String, Tensor>) -> Result<StepReport, RunError> {
        for (name, t) in feeds {
            crate::bounds::check_no_nan(name, t).map_err(RunError::BadData)?;
        }
        let rep = if self.dropout {
            let key = crate::program::StepKey { seed: self.seed, step: self.steps_done };
            self.interp.run_step(cpu, feeds, &self.storage, key)?
        } else {
            self.interp.run_with_params(cpu, feeds, &self.storage)?
        };
        for (name, t) in rep.updates {
            self.storage.insert(name, t);
        }
        self.steps_done += 1;
        let loss = rep.outputs.get("loss").map(crate::values::scalar_f32).unwrap_or(f32::NAN);
        Ok(StepReport {
            step: self.steps_done,
            loss,
            peak_bytes: rep.peak_bytes,
            resident_bytes: rep.param_bytes,
            outputs: rep.outputs,
            node_seconds: rep.node_seconds,
        })
    }

    /// The loss of the current parameters on `feeds`, forward only: no gradients, no update,
    /// the step count unchanged, nothing dropped (evaluation on held-out data).
    pub fn eval(&self, cpu: &crate::cpu::Cpu, feeds: &BTreeMap<String, Tensor>) -> Result<f32, RunError> {
        for (name, t) in feeds {
            crate::bounds::check_no_nan(name, t).map_err(RunError::BadData)?;
        }
        let rep = self.interp.eval_with_params(cpu, feeds, &self.storage)?;
        Ok(rep.outputs.get(crate::program::EVAL_OUTPUT).map(crate::values::scalar_f32).unwrap_or(f32::NAN))
    }

    /// Steps run so far (including those of a loaded checkpoint).
    pub fn steps_done(&self) -> u64 {
        self.steps_done
    }

    /// Current value of a param or state.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.storage.get(name)
    }

    /// Replaces the value of an existing param or state (of the same meta); `false` when there
    /// is none of that name and meta.
    pub fn set(&mut self, name: &str, t: Tensor) -> bool {
        match self.storage.get_mut(name) {
            Some(old) if old.meta() == t.meta() => {
                *old = t;
                true
            }
            _ => false,
        }
    }

    /// Current parameters (no optimizer state), by name.
    pub fn params(&self) -> BTreeMap<String, Tensor> {
        let g = &self.tg.graph;
        g.params
            .iter()
            .filter_map(|&p| match &g.node(p).op {
                Op::Param { name } => self.storage.get(name).map(|t| (name.clone(), t.clone())),
                _ => None,
            })
            .collect()
    }

    /// The activations each step keeps for backward, largest first.
    pub fn saved_for_backward(&self) -> Vec<SavedTensor> {
        let g = &self.tg.graph;
        let mut v: Vec<SavedTensor> = self
            .tg
            .saved_for_backward()
            .into_iter()
            .map(|v| SavedTensor { node: g.node(v.node).name.clone(), meta: g.meta(v).clone() })
            .collect();
        v.sort_by(|a, b| b.meta.bytes().cmp(&a.meta.bytes()).then(a.node.cmp(&b.node)));
        v
    }

    /// Writes `DIR/params.npz` (parameters), `DIR/state.npz` (optimizer state),
    /// `DIR/trainer.json` (steps done) and `DIR/model.safetensors` (the parameters again, for
    /// other tools: [`crate::weights`]) atomically ([`crate::outputs::SaveDir`]): a save killed
    /// midway leaves the previous one whole.
    pub fn save(&self, dir: &Path) -> Result<(), CheckpointError> {
        let io = |cause| CheckpointError::Io { path: dir.to_path_buf(), cause };
        let staged = crate::outputs::SaveDir::new(dir).map_err(io)?;
        self.save_into(staged.path())?;
        staged.commit().map_err(io)
    }

    /// Refuses to save parameters that are not finite: a diverged run's weights would load
    /// and train as if they were good. Names the first such parameter.
    pub fn check_finite(&self) -> Result<(), CheckpointError> {
        for (name, t) in self.params() {
            let bad = t.to_f64_vec().iter().filter(|x| !x.is_finite()).count();
            if bad > 0 {
                return Err(CheckpointError::NotFinite { name, count: bad, total: t.numel() });
            }
        }
        Ok(())
    }

    /// What [`Trainer::save`] writes, into the existing directory `dir` (a
    /// [`crate::outputs::SaveDir`]'s staging directory, to which a caller adds its own files
    /// before the commit). `trainer.json`, written last, records every file's size and CRC-32:
    /// [`Trainer::load`] refuses files of different saves.
    pub fn save_into(&self, dir: &Path) -> Result<(), CheckpointError> {
        self.check_finite()?;
        let g = &self.tg.graph;
        let pick = |nodes: &[ir::NodeIndex]| -> BTreeMap<String, Tensor> {
            nodes
                .iter()
                .filter_map(|&n| match &g.node(n).op {
                    Op::Param { name } | Op::State { name } => {
                        self.storage.get(name).map(|t| (name.clone(), t.clone()))
                    }
                    _ => None,
                })
                .collect()
        };
        let params = pick(&g.params);
        write_npz(&dir.join("params.npz"), &params)?;
        crate::weights::write_safetensors(&dir.join("model.safetensors"), &params, &crate::weights::metadata())?;
        write_npz(&dir.join("state.npz"), &pick(&g.states))?;
        let mut files = serde_json::Map::new();
        for f in SAVED_FILES {
            let (bytes, crc32) = file_crc(&dir.join(f))?;
            files.insert(f.to_string(), serde_json::json!({ "bytes": bytes, "crc32": crc32 }));
        }
        let meta = dir.join("trainer.json");
        let mut info = serde_json::json!({ "steps_done": self.steps_done, "files": files });
        if self.draws() {
            // A continued run must draw from the same seed to continue the same masks.
            info["seed"] = self.seed.into();
        }
        let text = info.to_string();
        std::fs::write(&meta, text + "\n").map_err(|cause| CheckpointError::Io { path: meta, cause })?;
        Ok(())
    }

    /// Loads what [`Trainer::save`] wrote. Parameters must all be present with the graph's
    /// metas; missing optimizer state (e.g. a checkpoint saved with another optimizer) stays
    /// zero.
    pub fn load(&mut self, dir: &Path) -> Result<(), CheckpointError> {
        let g = &self.tg.graph;
        let saved = read_trainer_json(dir)?;
        // Every file the save recorded must be the one it wrote (a save of another step, or a
        // save killed midway by an autopar without atomic saves, mixes files).
        if let Some(files) = saved.as_ref().and_then(|v| v.get("files")).and_then(|f| f.as_object()) {
            let step = saved.as_ref().and_then(|v| v.get("steps_done")).and_then(|x| x.as_u64()).unwrap_or(0);
            for (name, want) in files {
                let path = dir.join(name);
                let got = file_crc(&path)?;
                let want = (want.get("bytes").and_then(|x| x.as_u64()), want.get("crc32").and_then(|x| x.as_u64()));
                if want != (Some(got.0), Some(got.1 as u64)) {
                    return Err(CheckpointError::Mismatch {
                        path,
                        message: format!(
                            "is not the file saved with trainer.json (step {step}): the directory mixes files of \
                             different saves"
                        ),
                    });
                }
            }
        }
        let ppath = dir.join("params.npz");
        let params = read_npz(&ppath)?;
        let spath = dir.join("state.npz");
        let states = if spath.exists() { read_npz(&spath)? } else { BTreeMap::new() };
        let mut next = self.storage.clone();
        for (nodes, file, path, required) in [(&g.params, &params, &ppath, true), (&g.states, &states, &spath, false)] {
            for &n in nodes.iter() {
                let (Op::Param { name } | Op::State { name }) = &g.node(n).op else { continue };
                let want = &g.node(n).outputs[0];
                match file.get(name) {
                    Some(t) if &t.meta() == want => {
                        next.insert(name.clone(), t.clone());
                    }
                    Some(t) => {
                        return Err(CheckpointError::Mismatch {
                            path: path.clone(),
                            message: format!("{name} is {} but the model needs {want}", t.meta()),
                        });
                    }
                    None if required => {
                        return Err(CheckpointError::Mismatch {
                            path: path.clone(),
                            message: format!("parameter {name} is missing"),
                        });
                    }
                    None => {}
                }
            }
        }
        let meta = dir.join("trainer.json");
        let (steps, seed) = match saved {
            Some(v) => (
                v.get("steps_done").and_then(|x| x.as_u64()).ok_or_else(|| CheckpointError::Mismatch {
                    path: meta.clone(),
                    message: "expected {\"steps_done\": N}".into(),
                })?,
                v.get("seed").and_then(|x| x.as_u64()),
            ),
            // Saved by an older autopar: no step count.
            None => (0, None),
        };
        if let Some(seed) = seed.filter(|&s| self.draws() && s != self.seed) {
            return Err(CheckpointError::Mismatch {
                path: meta,
                message: format!(
                    "saved by a run drawing its dropout masks from seed {seed}, this run's seed is {}: pass --seed \
                     {seed} to continue them",
                    self.seed
                ),
            });
        }
        self.storage = next;
        self.steps_done = steps;
        Ok(())
    }
}

/// The files [`Trainer::save_into`] records in `trainer.json`.
const SAVED_FILES: [&str; 3] = ["params.npz", "state.npz", "model.safetensors"];

/// `DIR/trainer.json`, if there is one.
fn read_trainer_json(dir: &Path) -> Result<Option<serde_json::Value>, CheckpointError> {
    let meta = dir.join("trainer.json");
    match ir::files::read_regular_to_string(&meta, 1 << 20) {
        Ok(s) => serde_json::from_str(&s)
            .map(Some)
            .map_err(|e| CheckpointError::Mismatch { path: meta, message: format!("not JSON: {e}") }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(cause) => Err(CheckpointError::Io { path: meta, cause }),
    }
}

/// Size and CRC-32 of a file, read as a stream.
fn file_crc(path: &Path) -> Result<(u64, u32), CheckpointError> {
    use std::io::Read;
    let io = |cause| CheckpointError::Io { path: path.to_path_buf(), cause };
    let mut f = ir::files::open_regular(path).map_err(io)?;
    let mut h = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let k = f.read(&mut buf).map_err(io)?;
        if k == 0 {
            return Ok((n, h.finalize()));
        }
        h.update(&buf[..k]);
        n += k as u64;
    }
}
