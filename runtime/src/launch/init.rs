//! Where a run's parameters and optimizer state come from: a checkpoint, the ONNX file the plan
//! was made from, or a seed.

use std::collections::BTreeMap;
use std::path::PathBuf;

use ir::Tensor;

use super::LaunchError;
use crate::params::{FirstOf, OpenModel, ParamSource, SeededInit};
use crate::program::{Program, RankState};

/// How the ranks' blocks are initialised.
#[derive(Clone, Debug)]
pub enum Init {
    /// From the newest checkpoint in `dir` (parameters, optimizer state and the step count).
    Resume {
        /// The checkpoint directory.
        dir: PathBuf,
    },
    /// Parameters from a model file, each rank reading only its blocks; optimizer state from
    /// zero.
    Model {
        /// The model file.
        path: PathBuf,
        /// Its reader (the runtime reads no model format: the CLI passes its ONNX reader).
        open: OpenModel,
        /// Every parameter must have data in the file; otherwise those without data come from
        /// `seed` (weight-free models).
        all: bool,
        /// Seed of the parameters the file has no data for.
        seed: u64,
        /// The hash the plan recorded of the file and its external data
        /// ([`plan::ModelInfo::file_hash`]): a file that hashes otherwise is refused. `None`
        /// (plans from before hashes were recorded): used unchecked, with a warning.
        hash: Option<String>,
    },
    /// Every parameter from a seed (deterministic, the same on any mesh).
    Seed {
        /// The seed.
        seed: u64,
    },
}

/// The model file a plan records (`plan.model.source`; a relative path, from plans written
/// before sources were recorded absolute, is relative to the plan file's directory `plan_dir`).
/// It must exist.
pub fn model_file(plan: &plan::Plan, plan_dir: &std::path::Path) -> Result<PathBuf, LaunchError> {
    let src = std::path::Path::new(plan.model.source.as_deref().ok_or(LaunchError::NoModel)?);
    let path = if src.is_absolute() { src.to_path_buf() } else { plan_dir.join(src) };
    if !path.exists() {
        return Err(LaunchError::ModelGone(path));
    }
    Ok(path)
}

/// Every rank's blocks for `ranks` (this process's ranks), and a line saying where they came
/// from; `warn` hears what is used unchecked (on the process holding rank 0).
pub(crate) fn states(
    init: &Init,
    program: &Program,
    feeds: &BTreeMap<String, Tensor>,
    data: Option<&crate::data::Dataset>,
    ranks: &[usize],
    warn: &mut dyn FnMut(String),
) -> Result<(Vec<RankState>, String), LaunchError> {
    let mut states: Vec<RankState> = Vec::with_capacity(ranks.len());
    let setup = |e: crate::error::DistError| LaunchError::Setup(e.to_string());
    match init {
        Init::Resume { dir } => {
            let resume = |e: String| LaunchError::Setup(format!("--resume from {}: {e}", dir.display()));
            for &r in ranks {
                let mut st = program.empty_rank(r, feeds).map_err(setup)?;
                crate::checkpoint::load(dir, program, &mut st).map_err(|e| resume(e.to_string()))?;
                states.push(st);
            }
            let step = states.first().map_or(0, |s| s.steps_done);
            // The data position: the batches a resumed run reads follow from its step, so the
            // checkpoint's run must have read the same data in the same order.
            let (_, m) = crate::checkpoint::latest(dir).map_err(|e| resume(e.to_string()))?;
            match (data, &m.data) {
                (Some(d), Some(p)) => {
                    if let Some(why) = d.resumes(p, step) {
                        return Err(resume(why));
                    }
                }
                (Some(_), None) => {
                    return Err(resume("the checkpoint's run used fixed feeds (--feed), this one --data".into()));
                }
                (None, Some(p)) => {
                    return Err(resume(format!("the checkpoint's run read --data ({}); pass it again", p.data)));
                }
                (None, None) => {}
            }
            Ok((states, format!("resumed from {} at step {step}", dir.display())))
        }
        Init::Seed { seed } => {
            let params = program.resident.iter().filter(|r| !r.is_state).count();
            for &r in ranks {
                states.push(program.init_rank(r, &SeededInit { seed: *seed }, feeds).map_err(setup)?);
            }
            Ok((states, format!("parameters from seed {seed} ({params} tensors)")))
        }
        Init::Model { path, open, all, seed, hash } => {
            let ix = open(path)
                .map_err(|e| LaunchError::Setup(format!("reading parameters from {}: {e}", path.display())))?;
            let params: Vec<&str> = program.resident.iter().filter(|r| !r.is_state).map(|r| r.name.as_str()).collect();
            let from_file = params.iter().filter(|p| ix.has(p)).count();
            if *all && let Some(missing) = params.iter().find(|p| !ix.has(p)) {
                return Err(match ix.absent_file(missing) {
                    Some(f) => LaunchError::MissingExternal {
                        model: path.clone(),
                        file: f.to_path_buf(),
                        param: missing.to_string(),
                    },
                    None => LaunchError::MissingData {
                        model: path.clone(),
                        param: missing.to_string(),
                        with_data: from_file,
                        params: params.len(),
                    },
                });
            }
            match hash {
                Some(want) => {
                    let external = ix.external_files();
                    let files = std::iter::once(path.as_path()).chain(external.iter().map(PathBuf::as_path));
                    let got = plan::ModelInfo::file_hash(files)
                        .map_err(|e| LaunchError::Setup(format!("hashing {}: {e}", path.display())))?;
                    if &got != want {
                        return Err(LaunchError::ModelChanged { model: path.clone(), got, want: want.clone() });
                    }
                }
                None if ranks.contains(&0) => warn(format!(
                    "the plan records no hash of its model file (an older plan); {} is used unchecked",
                    path.display()
                )),
                None => {}
            }
            let seeded = SeededInit { seed: *seed };
            let sources: Vec<&dyn ParamSource> = vec![ix.as_ref(), &seeded];
            let source = FirstOf(sources);
            for &r in ranks {
                states.push(program.init_rank(r, &source, feeds).map_err(setup)?);
            }
            let note = if from_file == params.len() {
                format!("parameters from {}", path.display())
            } else {
                format!(
                    "parameters: {from_file} from {}, {} from seed {seed}",
                    path.display(),
                    params.len() - from_file
                )
            };
            Ok((states, note))
        }
    }
}
