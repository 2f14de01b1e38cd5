//! `autopar infer`.

use std::path::PathBuf;

use anyhow::{Context, Result};

use super::common;

/// Arguments of `autopar infer`.
#[derive(clap::Args, Debug)]
pub struct InferArgs {
    /// The ONNX model.
    pub model: PathBuf,
    /// Feed a graph input from a .npy file: `NAME=FILE.npy` (float32, int64, int32 or bool).
    #[arg(long = "feed", value_name = "NAME=FILE.npy")]
    pub feeds: Vec<String>,
    /// Bind an input's shape, e.g. `input_ids=2x128` (default: the shapes of the feeds).
    #[arg(long = "input", value_name = "NAME=DIMS")]
    pub inputs: Vec<String>,
    /// Largest constant the importer may compute (folded shape arithmetic, ConstantOfShape,
    /// Range), in bytes; parameters and activations are shapes only and not bounded by it.
    #[arg(long, value_name = "BYTES", default_value_t = tracer::DEFAULT_MAX_CONSTANT_BYTES)]
    pub max_constant_bytes: usize,
    /// Directory for the outputs (`DIR/<output name>.npy`); created if missing.
    #[arg(long, default_value = "out")]
    pub out: PathBuf,
    /// How matrix products (matmul, gemm, convolutions) accumulate: f32 (fast) or f64 (about 2x
    /// slower products; sums that cancel keep their exact sign).
    #[arg(long, value_enum, default_value = "f32")]
    pub accumulate: common::AccumulateKind,
    /// CPU threads for the kernels.
    #[arg(long, default_value = "2", value_parser = common::parse_threads)]
    pub threads: usize,
    /// Compare an output with a reference .npy: `NAME=FILE.npy`. Prints the max relative error
    /// (max |ours - ref| / max |ref|) and fails if it exceeds --tolerance.
    #[arg(long = "expect", value_name = "NAME=FILE.npy")]
    pub expect: Vec<String>,
    /// Largest max-relative error --expect accepts (>= 0).
    #[arg(long, default_value = "1e-4", value_parser = common::parse_tolerance)]
    pub tolerance: f64,
    /// Print a JSON summary instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Runs `autopar infer`.
pub fn run(a: &InferArgs) -> Result<()> {
    let feeds = common::read_feeds(&a.feeds)?;
    let mut opts = common::import_options(&a.inputs, true, a.max_constant_bytes)?;
    // The feeds fill the model's dynamic dims, so a dynamic model needs no --input.
    for (name, t) in &feeds {
        opts.feed_shapes.insert(name.clone(), t.shape().to_vec());
    }
    let g = common::load_model(&a.model, &opts)?;
    let ctx = runtime::Cpu::new(a.threads.max(1))
        .context("starting the CPU thread pool")?
        .with_accumulation(a.accumulate.mode());
    runtime::outputs::check_dir("--out", &a.out, g.outputs.iter().map(|(_, v)| g.meta(*v).bytes() as u64).sum())?;
    let interp = runtime::Interpreter::new(&g)?;
    let t0 = std::time::Instant::now();
    let rep = interp.run(&ctx, &feeds)?;
    let dt = t0.elapsed();
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let mut written = Vec::new();
    for (name, t) in &rep.outputs {
        let file = a.out.join(format!("{}.npy", sanitize(name)));
        runtime::npy::write_npy(&file, t)?;
        written.push((name.clone(), t.meta().to_string(), file));
    }
    let expected = common::read_feeds(&a.expect).context("reading --expect references")?;
    let mut checks = Vec::new();
    for (name, r) in &expected {
        let Some(t) = rep.outputs.get(name) else {
            anyhow::bail!(
                "--expect {name}: the model has no output of that name (outputs: {})",
                rep.outputs.keys().cloned().collect::<Vec<_>>().join(", ")
            );
        };
        if t.meta() != r.meta() {
            anyhow::bail!("--expect {name}: output is {} but the reference is {}", t.meta(), r.meta());
        }
        checks.push((name.clone(), compare(&t.to_f64_vec(), &r.to_f64_vec())));
    }
    if a.json {
        let outs: Vec<_> =
            written.iter().map(|(n, m, f)| serde_json::json!({"name": n, "type": m, "file": f})).collect();
        let ch: Vec<_> = checks
            .iter()
            .map(|(n, c)| match c {
                Ok(e) => serde_json::json!({"name": n, "max_rel_error": e, "ok": *e <= a.tolerance}),
                Err(why) => serde_json::json!({"name": n, "max_rel_error": null, "ok": false, "error": why}),
            })
            .collect();
        println!(
            "{}",
            serde_json::json!({"outputs": outs, "checks": ch, "seconds": dt.as_secs_f64(), "peak_bytes": rep.peak_bytes, "param_bytes": rep.param_bytes})
        );
    } else {
        for (n, m, f) in &written {
            println!("{n:<24} {m:<20} -> {}", f.display());
        }
        println!(
            "forward {:.1} ms, peak activations {:.2} MiB, parameters {:.2} MiB",
            dt.as_secs_f64() * 1e3,
            rep.peak_bytes as f64 / 1048576.0,
            rep.param_bytes as f64 / 1048576.0
        );
        for (n, c) in &checks {
            match c {
                Ok(e) => {
                    let verdict = if *e <= a.tolerance { "ok" } else { "MISMATCH" };
                    println!("check {n:<18} max relative error {e:.2e} (tolerance {:.0e}): {verdict}", a.tolerance);
                }
                Err(why) => println!("check {n:<18} {why}: MISMATCH"),
            }
        }
    }
    for (n, c) in &checks {
        match c {
            // Written so that a NaN tolerance fails too.
            Ok(e) if *e <= a.tolerance => {}
            Ok(e) => {
                anyhow::bail!("output {n} differs from its reference: max relative error {e:.3e} > {:.0e}", a.tolerance)
            }
            Err(why) => anyhow::bail!("output {n} cannot match its reference: {why}"),
        }
    }
    Ok(())
}

/// The max relative error of `got` against `want` (max |got - want| / max |want|, or the max
/// absolute error when `want` is all zeros); an error when either side holds a NaN or an
/// infinity, which no tolerance can vouch for (and which `f64::max` would silently skip).
fn compare(got: &[f64], want: &[f64]) -> Result<f64, String> {
    let bad = |v: &[f64]| v.iter().filter(|x| !x.is_finite()).count();
    match (bad(got), bad(want)) {
        (0, 0) => {}
        (k, 0) => return Err(format!("the output has {k} NaN or infinite values")),
        (_, k) => return Err(format!("the reference has {k} NaN or infinite values")),
    }
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
    let err = got.iter().zip(want).fold(0f64, |m, (p, q)| m.max((p - q).abs()));
    Ok(if scale > 0.0 { err / scale } else { err })
}

fn sanitize(name: &str) -> String {
    name.chars().map(|c| if c.is_alphanumeric() || "-_.".contains(c) { c } else { '_' }).collect()
}
