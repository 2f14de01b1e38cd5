//! Training against PyTorch: losses, gradients and optimizer steps of the bundled models compared
//! with the references in `tests/data/refgrad` (computed with PyTorch 2.5.1; see its README.md
//! and NOTICE.md for the exact loss definitions and how they were checked).
//!
//! For mlp, gpt2-tiny, bert-tiny and resnet18 the tests build the training graph with autopar's
//! autodiff, run it on the CPU interpreter and check:
//! - the loss at the initial weights, and the gradient of every trainable initializer the
//!   reference stores (resnet18 stores a subset), norm-wise per tensor:
//!   `||ours - ref|| / max(||ref||, floor) <= 1e-4`, where `floor` = 1e-6 x the model's largest
//!   gradient norm (it only matters for tensors whose exact gradient is zero, like attention key
//!   biases, whose references are rounding noise);
//! - the parameters after one SGD step (lr 0.1) and one AdamW step (lr 1e-3, betas 0.9/0.999,
//!   eps 1e-8, weight decay 0.01), norm-wise <= 1e-4; for AdamW also the update itself where
//!   `|g_ref| > 1e-6` (elsewhere step 1 is ill-conditioned, see the README) to 1e-6 absolute, and
//!   the loss after the step;
//! - the loss curve of 5 SGD steps (6 losses) on the same batch, each to 1e-4 relative
//!   (resnet18: the lr 1e-4 curve, and the first two losses of the lr 0.1 curve, which diverges;
//!   with f32 accumulation its second at 2e-3, below).
//!
//! resnet18 runs twice: with f64 accumulation in its matrix products
//! (`kernels::cpu::Accumulation::F64`) every check above holds at 1e-4; with the default f32
//! accumulation, the gradients behind one ReLU input that f32 sums cannot resolve are compared to
//! 2e-3 (see `RESNET`), and so is the loss after its diverging lr 0.1 step (7 to 93), whose f32
//! rounding moved it 3e-4 when the classifier's product changed its summation order.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, ensure};
use ir::autodiff::{LossSpec, Optimizer, TrainOptions, TrainingGraph, training_graph};
use ir::{Graph, Tensor};
use runtime::train::Trainer;
use runtime::{Accumulation, Cpu};

const TOL: f64 = 1e-4;

/// Tolerance for the resnet18 gradients behind one ambiguous ReLU (see `RESNET`).
const FLIP_TOL: f64 = 2e-3;

fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("data")
}

struct Case {
    model: &'static str,
    loss: &'static str,
    /// (feed name, file under data/)
    feeds: &'static [(&'static str, &'static str)],
    /// lr of the stored SGD curve `losses_sgd5*.json`, and its file.
    curve: (f32, &'static str),
    /// Tensors compared with [`FLIP_TOL`] instead of [`TOL`] (see `RESNET`).
    flip_sensitive: &'static [&'static str],
    /// How the kernels' matrix products accumulate.
    accumulation: Accumulation,
}

impl Case {
    fn tol(&self, name: &str) -> f64 {
        if self.flip_sensitive.contains(&name) { FLIP_TOL } else { TOL }
    }
}

const MLP: Case = Case {
    model: "mlp",
    loss: "mse:y:target",
    feeds: &[("x", "models/mlp.x.npy"), ("target", "refgrad/mlp/mlp.target.npy")],
    curve: (0.1, "losses_sgd5.json"),
    flip_sensitive: &[],
    accumulation: Accumulation::F32,
};
const GPT2: Case = Case {
    model: "gpt2-tiny",
    loss: "ce-next:logits:input_ids",
    feeds: &[("input_ids", "models/gpt2-tiny.input_ids.npy")],
    curve: (0.1, "losses_sgd5.json"),
    flip_sensitive: &[],
    accumulation: Accumulation::F32,
};
const BERT: Case = Case {
    model: "bert-tiny",
    loss: "mse:last_hidden_state:target",
    feeds: &[
        ("input_ids", "models/bert-tiny.input_ids.npy"),
        ("attention_mask", "models/bert-tiny.attention_mask.npy"),
        ("target", "refgrad/bert-tiny/bert-tiny.target.npy"),
    ],
    curve: (0.1, "losses_sgd5.json"),
    flip_sensitive: &[],
    accumulation: Accumulation::F32,
};
/// resnet18 (BN-free, random init) has, in `layer3.1`, a ReLU input that is `conv2 + identity`
/// = -0.7512099 + 0.7512116 = 1.7e-6 in float64: about 28 float32 ulps of the terms, within the
/// rounding error of a float32 sum of the convolution's 2304 products, so whether that one ReLU
/// passes its gradient depends on the convolution's summation order.
/// PyTorch's float32 passes it, autopar's float32 does not; that single element moves every
/// gradient behind it (layers 1-3, the stem) by up to ~1e-3 relative, while layer 4 and the
/// classifier agree to ~5e-7. (Checked with an independent float64 NumPy reimplementation of the
/// network, which agrees with the PyTorch reference to 1e-6 and pins the difference to that
/// element.) Those tensors are compared with [`FLIP_TOL`]. With f64 accumulation ([`RESNET_F64`])
/// the sums are exact to f32 rounding, the ReLU input comes out positive as in PyTorch, and every
/// tensor agrees to [`TOL`].
const RESNET: Case = Case {
    model: "resnet18",
    loss: "ce:logits:labels",
    feeds: &[("input", "models/resnet18.input.npy"), ("labels", "refgrad/resnet18/resnet18.labels.npy")],
    curve: (1e-4, "losses_sgd5_lr0.0001.json"),
    flip_sensitive: &[
        "onnx::Conv_193",
        "onnx::Conv_194",
        "onnx::Conv_199",
        "onnx::Conv_208",
        "onnx::Conv_209",
        "onnx::Conv_214",
        "onnx::Conv_224",
    ],
    accumulation: Accumulation::F32,
};
/// resnet18 with f64 accumulation in convolutions and matrix products: every tensor to [`TOL`].
const RESNET_F64: Case = Case { flip_sensitive: &[], accumulation: Accumulation::F64, ..RESNET };

struct Loaded {
    graph: Graph,
    feeds: BTreeMap<String, Tensor>,
    refs: PathBuf,
}

fn load(c: &Case) -> Result<Loaded> {
    let path = data().join(format!("models/{}.onnx", c.model));
    let mut graph = tracer::import_file(&path, &tracer::ImportOptions::default())?;
    ir::passes::canonicalize(&mut graph)?;
    let mut feeds = BTreeMap::new();
    for (name, file) in c.feeds {
        feeds.insert(name.to_string(), runtime::npy::read_npy(&data().join(file))?);
    }
    Ok(Loaded { graph, feeds, refs: data().join("refgrad").join(c.model) })
}

fn build(l: &Loaded, c: &Case, optimizer: Option<Optimizer>) -> Result<TrainingGraph> {
    let loss: LossSpec = c.loss.parse().map_err(anyhow::Error::msg)?;
    Ok(training_graph(&l.graph, &TrainOptions::new(loss, optimizer))?)
}

fn json(path: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(serde_json::from_str(&text)?)
}

fn norm(v: &[f32]) -> f64 {
    v.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>().sqrt()
}

fn rel_err(got: &Tensor, want: &Tensor, floor: f64) -> Result<f64> {
    ensure!(got.meta() == want.meta(), "{} vs reference {}", got.meta(), want.meta());
    let (a, b) = (got.to_f32_vec(), want.to_f32_vec());
    let diff: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x - y).collect();
    Ok(norm(&diff) / norm(&b).max(floor))
}

fn close(what: &str, got: f64, want: f64) -> Result<()> {
    close_to(what, got, want, TOL)
}

fn close_to(what: &str, got: f64, want: f64, tol: f64) -> Result<()> {
    let e = (got - want).abs() / want.abs().max(1e-12);
    ensure!(e <= tol, "{what}: {got} vs PyTorch {want} (relative error {e:.2e} > {tol:e})");
    Ok(())
}

/// Loss and gradients at the initial weights.
fn check_grads(c: &Case) -> Result<()> {
    let l = load(c)?;
    let tg = build(&l, c, None)?;
    let ctx = Cpu::new(2)?.with_accumulation(c.accumulation);
    let rep = runtime::Interpreter::new(&tg.graph)?.run(&ctx, &l.feeds)?;
    let loss = rep.outputs["loss"].to_f32_vec()[0] as f64;
    let want = json(&l.refs.join("loss.json"))?["loss"].as_f64().context("loss.json: no loss")?;
    close(&format!("{}: loss", c.model), loss, want)?;

    let refs = runtime::npy::read_npz(&l.refs.join("grads.npz"))?;
    ensure!(!refs.is_empty(), "{}: no reference gradients", c.model);
    let floor = 1e-6 * refs.values().map(|t| norm(&t.to_f32_vec())).fold(0.0, f64::max);
    let mut worst = (0.0, String::new());
    let mut bad = Vec::new();
    for (name, want) in &refs {
        let Some(got) = rep.outputs.get(&format!("grad/{name}")) else {
            // A parameter no op reads is not trained (no gradient output): PyTorch's reference
            // gradient for it must then be zero (bert-tiny's pooler, which the loss never reads).
            ensure!(
                want.to_f32_vec().iter().all(|&v| v == 0.0),
                "{}: no gradient for {name}, whose reference is not zero (trainable: {:?})",
                c.model,
                tg.trainable
            );
            continue;
        };
        let e = rel_err(got, want, floor).with_context(|| format!("{}: gradient of {name}", c.model))?;
        if e > c.tol(name) {
            bad.push(format!("{name}: {e:.2e}"));
        }
        if e > worst.0 {
            worst = (e, name.clone());
        }
    }
    ensure!(bad.is_empty(), "{}: gradients with relative error > {TOL:e}: {}", c.model, bad.join(", "));
    eprintln!(
        "{}: loss {loss:.8}, {} gradients, worst relative error {:.2e} ({})",
        c.model,
        refs.len(),
        worst.0,
        worst.1
    );
    Ok(())
}

/// One SGD step (lr 0.1) and one AdamW step against the stored parameters; the SGD loss curve.
fn check_steps(c: &Case) -> Result<()> {
    let l = load(c)?;
    let ctx = Cpu::new(2)?.with_accumulation(c.accumulation);
    let init = l.graph.param_data.clone();

    // SGD, lr 0.1: parameters after one step, and the first losses of the curve.
    let tg = build(&l, c, Some(Optimizer::sgd(0.1)))?;
    let mut t = Trainer::new(&tg, &init)?;
    let l0 = t.step(&ctx, &l.feeds)?.loss;
    let after = runtime::npy::read_npz(&l.refs.join("params_after_sgd.npz"))?;
    let grads = runtime::npy::read_npz(&l.refs.join("grads.npz"))?;
    for (name, want) in &after {
        let got = t.get(name).with_context(|| format!("{}: no parameter {name}", c.model))?;
        let e = rel_err(got, want, 0.0)?;
        ensure!(e <= c.tol(name), "{}: {name} after one SGD step: relative error {e:.2e}", c.model);
    }
    let l1 = t.step(&ctx, &l.feeds)?.loss;
    let curve01: Vec<Option<f64>> = serde_json::from_value(json(&l.refs.join("losses_sgd5.json"))?)?;
    let first = |i: usize| curve01.get(i).copied().flatten().context("losses_sgd5.json: missing loss");
    close(&format!("{}: SGD lr 0.1 loss 0", c.model), l0 as f64, first(0)?)?;
    // With f32 sums (a case with flip-sensitive tensors, see `RESNET`) the loss after the lr 0.1
    // step, which diverges (7 to 93), carries the f32 rounding of its cancelling sums: it moved
    // 3e-4 when the classifier's product changed its summation order. Compared like the loss
    // after the AdamW step below.
    let tol = if c.flip_sensitive.is_empty() { TOL } else { FLIP_TOL };
    close_to(&format!("{}: SGD lr 0.1 loss 1", c.model), l1 as f64, first(1)?, tol)?;

    // The 5-step curve.
    let (lr, file) = c.curve;
    let curve: Vec<Option<f64>> = serde_json::from_value(json(&l.refs.join(file))?)?;
    let tg = build(&l, c, Some(Optimizer::sgd(lr)))?;
    let mut t = Trainer::new(&tg, &init)?;
    let mut ours = Vec::new();
    for (i, want) in curve.iter().enumerate() {
        let got = t.step(&ctx, &l.feeds)?.loss as f64;
        ours.push(got);
        if let Some(w) = want {
            close(&format!("{}: SGD lr {lr} loss {i}", c.model), got, *w)?;
        }
    }

    // AdamW: parameters after one step, their update where it is well-conditioned, and the loss
    // after the step.
    let tg = build(&l, c, Some(Optimizer::adamw(1e-3)))?;
    let mut t = Trainer::new(&tg, &init)?;
    t.step(&ctx, &l.feeds)?;
    let after = runtime::npy::read_npz(&l.refs.join("params_after_adamw.npz"))?;
    for (name, want) in &after {
        let got = t.get(name).with_context(|| format!("{}: no parameter {name}", c.model))?;
        let g = grads.get(name).with_context(|| format!("{}: no reference gradient for {name}", c.model))?;
        let (p0, p1, w, g) = (init[name].to_f32_vec(), got.to_f32_vec(), want.to_f32_vec(), g.to_f32_vec());
        // Step 1 moves each element by about lr * sign(g): where |g| <= 1e-6 the sign is rounding
        // noise (zero-gradient key biases), so those elements only need to stay within a step.
        // Behind resnet18's ambiguous ReLU our gradients differ by up to ~1e-3 of the largest, so
        // there the sign is only reliable for larger gradients.
        let gmax = g.iter().fold(0f32, |m, x| m.max(x.abs()));
        let cut = if c.tol(name) > TOL { 1e-2 * gmax } else { 1e-6 };
        let (mut diff, mut base) = (0f64, 0f64);
        for i in 0..p0.len() {
            let d = (p1[i] - w[i]).abs();
            if g[i].abs() > cut {
                diff += (d as f64).powi(2);
                base += (w[i] as f64).powi(2);
                let du = ((p1[i] - p0[i]) - (w[i] - p0[i])).abs();
                ensure!(du <= 1e-6, "{}: {name}[{i}] AdamW update differs by {du:.2e} (g = {:e})", c.model, g[i]);
            } else {
                ensure!(d <= 2.0 * 1e-3, "{}: {name}[{i}] moved {d:e} from the reference (|g| <= {cut:e})", c.model);
            }
        }
        let e = diff.sqrt() / base.sqrt().max(1e-30);
        ensure!(e <= c.tol(name), "{}: {name} after one AdamW step: relative error {e:.2e}", c.model);
    }
    let la = t.step(&ctx, &l.feeds)?.loss as f64;
    let want = json(&l.refs.join("loss.json"))?["loss_after_1_adamw_step"].as_f64().context("no adamw loss")?;
    // AdamW's first step moves every element by ~lr whatever the gradient's size, so the
    // gradients behind resnet18's ambiguous ReLU move this loss too.
    let tol = if c.flip_sensitive.is_empty() { TOL } else { FLIP_TOL };
    close_to(&format!("{}: loss after one AdamW step", c.model), la, want, tol)?;
    eprintln!("{}: SGD lr {lr} losses {ours:.8?}; loss after one AdamW step {la:.8}", c.model);
    Ok(())
}

#[test]
fn mlp_grads() -> Result<()> {
    check_grads(&MLP)
}
#[test]
fn mlp_steps() -> Result<()> {
    check_steps(&MLP)
}
#[test]
fn gpt2_tiny_grads() -> Result<()> {
    check_grads(&GPT2)
}
#[test]
fn gpt2_tiny_steps() -> Result<()> {
    check_steps(&GPT2)
}
#[test]
fn bert_tiny_grads() -> Result<()> {
    check_grads(&BERT)
}
#[test]
fn bert_tiny_steps() -> Result<()> {
    check_steps(&BERT)
}
#[test]
fn resnet18_grads() -> Result<()> {
    check_grads(&RESNET)
}
#[test]
fn resnet18_steps() -> Result<()> {
    check_steps(&RESNET)
}
#[test]
fn resnet18_grads_f64_accumulation() -> Result<()> {
    check_grads(&RESNET_F64)
}
#[test]
fn resnet18_steps_f64_accumulation() -> Result<()> {
    check_steps(&RESNET_F64)
}
