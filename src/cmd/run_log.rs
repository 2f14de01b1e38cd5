//! `autopar explain --run LOG.jsonl`: a training run's `--json` log (of `run` or `train`) as a
//! text summary, and its curves (loss and evaluation loss, learning rate, gradient norm,
//! throughput) as SVG charts in a standalone page.

use std::path::Path;

use anyhow::{Context, Result, bail};
use codegen::svg::{LineChart, Series};

/// One step of a run log.
#[derive(Clone, Debug, Default)]
pub struct Step {
    /// Step number.
    pub step: f64,
    /// Training loss.
    pub loss: f64,
    /// Evaluation loss after the step, if evaluated.
    pub eval_loss: Option<f64>,
    /// Learning rate of the step.
    pub lr: Option<f64>,
    /// Global gradient norm (before clipping).
    pub grad_norm: Option<f64>,
    /// Tokens per second, or else samples per second.
    pub throughput: Option<(f64, &'static str)>,
    /// Milliseconds of the step.
    pub ms: Option<f64>,
}

/// The largest log read.
const MAX_LOG_BYTES: u64 = 1 << 30;

/// The steps of a `--json` log (other lines, such as the summary, are skipped), read line by
/// line (a log of millions of steps is never held as text).
pub fn read(path: &Path) -> Result<Vec<Step>> {
    use std::io::BufRead;
    let f = ir::files::open_regular(path).with_context(|| path.display().to_string())?;
    let len = f.metadata().with_context(|| path.display().to_string())?.len();
    if len > MAX_LOG_BYTES {
        bail!("{} is {len} bytes, more than the {MAX_LOG_BYTES} a run log is read up to", path.display());
    }
    let mut steps = vec![];
    for (i, line) in std::io::BufReader::new(f).lines().enumerate() {
        let line = line.with_context(|| format!("{}:{}", path.display(), i + 1))?;
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) else { continue };
        let f = |k: &str| v.get(k).and_then(serde_json::Value::as_f64);
        // A diverged step's loss is written as null (JSON has no NaN): kept, as NaN.
        let loss = match v.get("loss") {
            Some(serde_json::Value::Null) => Some(f64::NAN),
            _ => f("loss"),
        };
        let (Some(step), Some(loss)) = (f("step"), loss) else { continue };
        if !step.is_finite() {
            bail!("{}:{}: step {step} is not a number", path.display(), i + 1);
        }
        let throughput =
            f("tokens_per_s").map(|t| (t, "tokens/s")).or_else(|| f("samples_per_s").map(|t| (t, "samples/s")));
        steps.push(Step {
            step,
            loss,
            eval_loss: f("eval_loss"),
            lr: f("lr"),
            grad_norm: f("grad_norm"),
            throughput,
            ms: f("ms"),
        });
    }
    if steps.is_empty() {
        bail!("{} has no step lines (write one with `autopar run --json` or `autopar train --json`)", path.display());
    }
    Ok(steps)
}

/// A few lines on a run: steps, losses, evaluations, time.
pub fn summary(steps: &[Step]) -> String {
    let (first, last) = (&steps[0], &steps[steps.len() - 1]);
    let min = steps.iter().map(|s| s.loss).fold(f64::INFINITY, f64::min);
    let mut o = format!(
        "run       {} steps ({} to {}); loss {:.4} -> {:.4} (lowest {:.4})\n",
        steps.len(),
        first.step,
        last.step,
        first.loss,
        last.loss,
        min
    );
    let evals: Vec<(f64, f64)> = steps.iter().filter_map(|s| Some((s.step, s.eval_loss?))).collect();
    if let (Some(a), Some(b)) = (evals.first(), evals.last()) {
        let best = evals.iter().copied().fold((f64::NAN, f64::INFINITY), |m, e| if e.1 < m.1 { e } else { m });
        o += &format!(
            "eval      {} evaluations; loss {:.4} (step {}) -> {:.4} (step {}); lowest {:.4} at step {}\n",
            evals.len(),
            a.1,
            a.0,
            b.1,
            b.0,
            best.1,
            best.0
        );
    }
    let mut ms: Vec<f64> = steps.iter().filter_map(|s| s.ms).collect();
    ms.sort_by(f64::total_cmp);
    let mut tp: Vec<(f64, &str)> = steps.iter().filter_map(|s| s.throughput).collect();
    tp.sort_by(|a, b| a.0.total_cmp(&b.0));
    if let (Some(m), Some(t)) = (ms.get(ms.len() / 2), tp.get(tp.len() / 2)) {
        o += &format!("speed     median step {m:.1} ms, {:.1} {}\n", t.0, t.1);
    }
    o
}

fn series(name: &str, steps: &[Step], f: impl Fn(&Step) -> Option<f64>, dots: bool) -> Series {
    Series {
        name: name.into(),
        points: steps.iter().filter_map(|s| Some((s.step, f(s)?))).collect(),
        dots,
        dashed: false,
    }
}

/// The charts of a run: loss (and evaluation loss, and `references` as dashed lines), then
/// learning rate, gradient norm and throughput where the log has them.
pub fn charts(steps: &[Step], references: &[(f64, String)]) -> Vec<LineChart> {
    let mut loss = vec![series("training loss", steps, |s| Some(s.loss), false)];
    if steps.iter().any(|s| s.eval_loss.is_some()) {
        loss.push(series("evaluation loss", steps, |s| s.eval_loss, true));
    }
    let mut out = vec![LineChart {
        title: "Loss".into(),
        x_label: "step".into(),
        y_label: "loss".into(),
        series: loss,
        references: references.to_vec(),
    }];
    let mut more = |title: &str, y: &str, s: Series| {
        if !s.points.is_empty() {
            out.push(LineChart {
                title: title.into(),
                x_label: "step".into(),
                y_label: y.into(),
                series: vec![s],
                references: vec![],
            });
        }
    };
    more("Learning rate", "lr", series("learning rate", steps, |s| s.lr, false));
    more("Gradient norm (before clipping)", "global L2 norm", series("gradient norm", steps, |s| s.grad_norm, false));
    let unit = steps.iter().find_map(|s| s.throughput.map(|t| t.1)).unwrap_or("samples/s");
    more("Throughput", unit, series(unit, steps, |s| s.throughput.map(|t| t.0), false));
    out
}

/// A standalone page: the summary and every chart.
pub fn html(name: &str, steps: &[Step], references: &[(f64, String)]) -> String {
    let esc = |s: &str| s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;");
    let mut o = format!(
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>autopar run: {0}</title>\n\
         <style>body {{ font-family: sans-serif; margin: 2em; }} svg {{ display: block; margin: 1em 0; }}</style>\n\
         </head>\n<body>\n<h1>autopar run: {0}</h1>\n<pre>{1}</pre>\n",
        esc(name),
        esc(&summary(steps))
    );
    for c in charts(steps, references) {
        o += &c.svg();
    }
    o += "</body>\n</html>\n";
    o
}

/// `--reference VALUE[:LABEL]`.
pub fn parse_reference(s: &str) -> Result<(f64, String), String> {
    let (v, label) = s.split_once(':').unwrap_or((s, ""));
    let v: f64 = v.trim().parse().map_err(|_| format!("--reference `{s}` is not VALUE[:LABEL]"))?;
    if !v.is_finite() {
        return Err(format!("--reference `{s}`: not a finite value"));
    }
    Ok((v, if label.is_empty() { format!("{v}") } else { label.to_string() }))
}
