//! The summarised walks over a plan's microbatch steps equal the exact ones (issue 46).
//!
//! `plan::memory::simulate_steps` summarises each segment once and replays the summaries step
//! by step, and `plan::schedule::timeline` finds each step's events once: both must give what
//! the instruction-by-instruction walks (`simulate_steps_exact`, `timeline_exact`) give, to the
//! byte and to the bit, errors included. Plans: mlp, gpt2-tiny and a small generated GPT,
//! without stages (1 and 3 microbatches) and on 2 and 4 stages under every schedule (1F1B,
//! GPipe, interleaved over 2 chunks, ZB-H1 with its weight phases, sequential). Each plan is
//! then replayed under many edited schedules: other microbatch counts, random interleavings of
//! the microbatches that keep each one's segment order (some of them deadlock), and broken
//! ones (a step dropped, doubled, moved before its microbatch's earlier segment), where the
//! summarised walk must fall back to the exact one.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use codegen::plan::{Phase, ScheduleKind, Step};
use codegen::{Baseline, Plan, PlanOptions};
use ir::Graph;
use ir::autodiff::{LossSpec, Optimizer, TrainOptions, training_graph};
use sharding::{DeviceMesh, DeviceProfile};

fn import(name: &str, loss: &str) -> Result<Graph> {
    let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/models").join(name);
    let g = tracer::import_file(&path, &tracer::ImportOptions { load_weights: false, ..Default::default() })?;
    train(&g, loss)
}

fn train(g: &Graph, loss: &str) -> Result<Graph> {
    let loss: LossSpec = loss.parse().map_err(anyhow::Error::msg)?;
    Ok(training_graph(g, &TrainOptions::new(loss, Some(Optimizer::adamw(1e-3))))?.graph)
}

/// A small deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % n.max(1)
    }
}

/// Both memory walks on every stage and both plays of the schedule: equal.
fn same_walks(p: &Plan, mesh: &DeviceMesh, what: &str) -> Result<()> {
    for s in 0..p.stages() {
        let fast = plan::memory::simulate_steps(p, mesh, s).map_err(|e| e.to_string());
        let exact = plan::memory::simulate_steps_exact(p, mesh, s).map_err(|e| e.to_string());
        ensure!(fast == exact, "{what}, stage {s}: memory {fast:?}, exact {exact:?}");
    }
    let (fast, exact) = (plan::schedule::timeline(p), plan::schedule::timeline_exact(p));
    ensure!(fast == exact, "{what}: timeline {fast:?}, exact {exact:?}");
    Ok(())
}

/// Each stage's steps as a random interleaving of the microbatches, each running `segments`
/// in order.
fn interleaving(rng: &mut Rng, stages: usize, microbatches: usize, segments: &[(Phase, usize)]) -> Vec<Vec<Step>> {
    (0..stages)
        .map(|_| {
            let mut next = vec![0usize; microbatches];
            let mut out = vec![];
            loop {
                let open: Vec<usize> = (0..microbatches).filter(|&m| next[m] < segments.len()).collect();
                if open.is_empty() {
                    break out;
                }
                // Mostly the oldest microbatches, as real schedules run them.
                let k = 1 + rng.below(3);
                let m = open[rng.below(open.len().min(k))];
                let (phase, chunk) = segments[next[m]];
                out.push(Step { microbatch: m, chunk, phase });
                next[m] += 1;
            }
        })
        .collect()
}

/// The plan under edited schedules (see the module docs).
fn edited(p: &Plan, mesh: &DeviceMesh, rng: &mut Rng, name: &str) -> Result<usize> {
    let Some(pp) = &p.pipeline else {
        // Without stages the steps follow from the microbatch count.
        for m in [1, 2, 5, 16] {
            let mut q = p.clone();
            q.microbatches = m;
            same_walks(&q, mesh, &format!("{name}, {m} microbatches"))?;
        }
        return Ok(4);
    };
    let stages = pp.stages;
    let chunks = p.chunks();
    let weight = p.program.iter().any(|i| i.phase() == Phase::Weight);
    let mut segments: Vec<(Phase, usize)> = (0..chunks).map(|c| (Phase::Forward, c)).collect();
    segments.extend((0..chunks).rev().map(|c| (Phase::Backward, c)));
    if weight {
        segments.extend((0..chunks).rev().map(|c| (Phase::Weight, c)));
    }
    let mut n = 0;
    for round in 0..12 {
        let m = [1, 2, 3, 4, 7, 9][round % 6];
        let mut q = p.clone();
        q.microbatches = m;
        let mut steps = interleaving(rng, stages, m, &segments);
        let what = match round % 4 {
            0 | 1 => "interleaved".to_string(),
            // Broken schedules: the summaries do not apply.
            2 => {
                let s = rng.below(stages);
                let i = rng.below(steps[s].len());
                steps[s].remove(i);
                format!("step {i} of stage {s} dropped")
            }
            _ => {
                let s = rng.below(stages);
                let i = rng.below(steps[s].len());
                let dup = steps[s][i];
                let at = rng.below(steps[s].len() + 1);
                steps[s].insert(at, dup);
                format!("step {dup} of stage {s} doubled")
            }
        };
        q.pipeline.as_mut().context("stages")?.schedule.steps = steps;
        same_walks(&q, mesh, &format!("{name}, {m} microbatches, {what}"))?;
        n += 1;
    }
    // A microbatch's later segment moved before its first on one stage.
    if segments.len() > 1 {
        let mut q = p.clone();
        let steps = &mut q.pipeline.as_mut().context("stages")?.schedule.steps;
        if let Some(i) = steps[0].iter().position(|s| (s.phase, s.chunk) != segments[0]) {
            let st = steps[0].remove(i);
            steps[0].insert(0, st);
            same_walks(&q, mesh, &format!("{name}, {st} first"))?;
            n += 1;
        }
    }
    Ok(n)
}

#[test]
fn summarised_walks_equal_the_exact_walks() -> Result<()> {
    let cpu = DeviceProfile::builtin("cpu").context("cpu profile")?;
    let cfg = tracer::generate::GptConfig { layers: 4, hidden: 64, heads: 2, seq: 16, vocab: 32, batch: 4 };
    let bytes = tracer::generate::gpt(&cfg).map_err(anyhow::Error::msg)?;
    let gpt = tracer::import_bytes(&bytes, "gpt.onnx", "gpt", None, &tracer::ImportOptions::default())?;
    let models = [
        ("mlp", import("mlp.onnx", "mse:y:t")?),
        ("gpt2-tiny", import("gpt2-tiny.onnx", "ce-next:logits:input_ids")?),
        ("gpt", train(&gpt, "ce-next:logits:input_ids")?),
    ];
    let mut rng = Rng(46);
    let (mut plans, mut variants, mut summarised) = (0, 0, 0);
    for (name, g) in &models {
        let configs: Vec<(Vec<usize>, usize, usize, ScheduleKind)> = vec![
            (vec![2, 1], 0, 1, ScheduleKind::OneFOneB),
            (vec![1, 2], 0, 3, ScheduleKind::OneFOneB),
            (vec![2, 1], 2, 4, ScheduleKind::OneFOneB),
            (vec![2, 2], 2, 3, ScheduleKind::Gpipe),
            (vec![4, 1], 4, 4, ScheduleKind::Interleaved),
            (vec![2, 1], 2, 4, ScheduleKind::ZbH1),
            (vec![4, 1], 4, 5, ScheduleKind::ZbH1),
            (vec![2, 1], 2, 2, ScheduleKind::Sequential),
        ];
        for (shape, stages, microbatches, schedule) in configs {
            let mesh = DeviceMesh::uniform(&shape)?;
            let o = PlanOptions {
                budget: 8 << 30,
                baseline: Baseline::Auto,
                time_limit: Duration::from_millis(500),
                threads: 1,
                compare_baselines: false,
                stages,
                microbatches,
                schedule,
                chunks: 2,
                ..PlanOptions::default()
            };
            let what = format!("{name} on {shape:?}, {stages} stages, {microbatches} microbatches, {schedule}");
            let p = codegen::plan(g, &mesh, &cpu, &o).with_context(|| what.clone())?;
            same_walks(&p, &mesh, &what)?;
            // The lowered plan itself takes the summarised path on every stage.
            for s in 0..p.stages() {
                let m = plan::memory::simulate_steps_summarised(&p, &mesh, s);
                ensure!(m.is_some(), "{what}: stage {s} not summarised");
                summarised += 1;
            }
            plans += 1;
            variants += edited(&p, &mesh, &mut rng, &what)?;
        }
    }
    println!("{plans} plans ({summarised} stage walks summarised), {variants} edited schedules: equal walks");
    ensure!(plans == 24 && variants > 200, "{plans} plans, {variants} variants");
    Ok(())
}
