//! Helpers shared by subcommands: model loading, `--input` and `--feed` parsing.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// Parses `NAME=DIMS` bindings into the importer's options.
pub fn import_options(inputs: &[String], load_weights: bool) -> Result<tracer::ImportOptions> {
    let mut opts = tracer::ImportOptions { load_weights, ..Default::default() };
    for s in inputs {
        let (name, dims) = tracer::parse_input_binding(s).map_err(anyhow::Error::msg)?;
        opts.input_shapes.insert(name, dims);
    }
    Ok(opts)
}

/// Imports a model, with the file named in any error.
pub fn load_model(path: &Path, opts: &tracer::ImportOptions) -> Result<ir::Graph> {
    if !path.exists() {
        bail!("model file {} does not exist", path.display());
    }
    let mut g = tracer::import_file(path, opts).with_context(|| format!("importing {}", path.display()))?;
    ir::passes::canonicalize(&mut g)?;
    Ok(g)
}

/// Parses `NAME=FILE.npy` feeds and reads them.
pub fn read_feeds(feeds: &[String]) -> Result<BTreeMap<String, ir::Tensor>> {
    let mut out = BTreeMap::new();
    for s in feeds {
        let Some((name, file)) = s.split_once('=') else {
            bail!("--feed `{s}` is not NAME=FILE.npy");
        };
        let t = runtime::npy::read_npy(&PathBuf::from(file)).with_context(|| format!("--feed {name}"))?;
        if out.insert(name.to_string(), t).is_some() {
            bail!("--feed {name} is given twice");
        }
    }
    Ok(out)
}
