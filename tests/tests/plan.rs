//! Planning (issue 6): `codegen::plan` on the bundled models.
//!
//! - Acceptance 1: gpt2-tiny, bert-tiny, mlp and resnet18 on meshes 1x2, 2x2 and 2x4, with a
//!   generous budget (64 GiB) and a tight one (1.25x the smallest peak any plan reaches, which
//!   the planner reports when asked for 1 byte): the auto plan is valid (it survives the JSON
//!   round trip through the validating loader) and fits, and its estimated step time is no more
//!   than each manual baseline (`dp`, `megatron`, `zero`, planned separately as
//!   `--strategy NAME` does) that fits the same budget. When the baseline's own solve ended at
//!   its time limit, "no more" allows the baseline solver's reported gap. The table is printed.
//! - Acceptance 2: on a tensor-only mesh the MLP's and gpt2-tiny's linear pairs are split column
//!   then row (Megatron's pattern), pinned by the specs chosen.
//! - Acceptance 3: a budget below the smallest peak is the "no plan fits" error naming that peak;
//!   1% above it plans successfully.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use codegen::plan::Instr;
use codegen::{Baseline, Plan, PlanOptions};
use ir::Graph;
use ir::autodiff::{LossSpec, Optimizer, TrainOptions, training_graph};
use sharding::{DeviceMesh, DeviceProfile};

fn model(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/models").join(name)
}

fn training(name: &str, loss: &str) -> Result<Graph> {
    let g = tracer::import_file(&model(name), &tracer::ImportOptions { load_weights: false, ..Default::default() })?;
    let loss: LossSpec = loss.parse().map_err(anyhow::Error::msg)?;
    Ok(training_graph(&g, &TrainOptions::new(loss, Some(Optimizer::adamw(1e-3))))?.graph)
}

const MODELS: [(&str, &str); 4] = [
    ("mlp.onnx", "mse:y:t"),
    ("gpt2-tiny.onnx", "ce-next:logits:input_ids"),
    ("bert-tiny.onnx", "mse:last_hidden_state:t"),
    ("resnet18.onnx", "ce:logits:labels"),
];

fn opts(budget: u64, baseline: Baseline) -> PlanOptions {
    PlanOptions {
        budget,
        baseline,
        time_limit: Duration::from_secs(2),
        threads: 1,
        compare_baselines: true,
        ..PlanOptions::default()
    }
}

fn min_peak(g: &Graph, mesh: &DeviceMesh, cpu: &DeviceProfile) -> Result<u64> {
    match codegen::plan(g, mesh, cpu, &opts(1, Baseline::Auto)) {
        Err(codegen::Error::Infeasible { min_peak_bytes, .. }) => Ok(min_peak_bytes),
        Err(e) => bail!("expected the infeasible-budget error, got: {e}"),
        Ok(_) => bail!("a 1-byte budget was accepted"),
    }
}

fn round_trip(p: &Plan) -> Result<Plan> {
    Plan::from_json(&p.to_json()?).context("the plan does not pass its own loader")
}

#[test]
fn auto_is_never_worse_than_manual_baselines() -> Result<()> {
    let cpu = DeviceProfile::builtin("cpu").context("cpu profile")?;
    let mut rows = vec![];
    for (name, loss) in MODELS {
        let g = training(name, loss)?;
        for shape in [[1, 2], [2, 2], [2, 4]] {
            let mesh = DeviceMesh::with_profile(shape.to_vec(), vec!["data".into(), "tensor".into()], &cpu)?;
            let tight = min_peak(&g, &mesh, &cpu)? / 4 * 5;
            for (label, budget) in [("64GiB", 64u64 << 30), ("tight", tight)] {
                let auto = codegen::plan(&g, &mesh, &cpu, &opts(budget, Baseline::Auto))
                    .with_context(|| format!("{name} on {mesh}, budget {budget}"))?;
                let auto = round_trip(&auto)?;
                ensure!(auto.estimate.peak_bytes_per_rank <= budget, "{name}: auto plan exceeds the budget");
                let mut row = format!(
                    "| {name} | {mesh} | {label} ({}) | {:.3} ms ({}) |",
                    codegen::fmt_bytes(budget),
                    auto.estimate.step_seconds * 1e3,
                    auto.solver.chosen.name()
                );
                for b in [Baseline::Dp, Baseline::Megatron, Baseline::Zero] {
                    match codegen::plan(&g, &mesh, &cpu, &PlanOptions { compare_baselines: false, ..opts(budget, b) }) {
                        Ok(p) => {
                            let p = round_trip(&p)?;
                            let base = p.estimate.step_seconds;
                            let gap = if p.solver.status == codegen::plan::SolveStatus::Optimal {
                                0.0
                            } else {
                                (p.solver.objective_seconds - p.solver.lower_bound_seconds).max(0.0)
                            };
                            ensure!(
                                auto.estimate.step_seconds <= base + gap + 1e-12,
                                "{name} on {mesh} ({label}): auto {} s > {} {} s",
                                auto.estimate.step_seconds,
                                b.name(),
                                base
                            );
                            row += &format!(" {:.3} ms |", base * 1e3);
                        }
                        Err(codegen::Error::Infeasible { .. }) => row += " does not fit |",
                        Err(e) => return Err(e).with_context(|| format!("{name} on {mesh}: {}", b.name())),
                    }
                }
                rows.push(row);
            }
        }
    }
    println!("| model | mesh | budget | auto (chosen) | dp | megatron | zero |\n|---|---|---|---|---|---|---|");
    for r in &rows {
        println!("{r}");
    }
    println!("{} (model, mesh, budget) combinations planned", rows.len());
    Ok(())
}

/// `min_gain`: with `Auto`, the solver's own plan is kept only when it is estimated at least
/// that fraction of the step faster than the cheapest baseline compared; otherwise that
/// baseline is, `plan.json` records the threshold and `explain` says why the baseline was kept.
#[test]
fn auto_keeps_the_cheapest_baseline_unless_its_own_plan_gains_enough() -> Result<()> {
    let cpu = DeviceProfile::builtin("cpu").context("cpu profile")?;
    let mut kept = 0;
    for (name, loss) in [MODELS[0], MODELS[1]] {
        let g = training(name, loss)?;
        for shape in [[1, 2], [2, 2]] {
            let mesh = DeviceMesh::with_profile(shape.to_vec(), vec!["data".into(), "tensor".into()], &cpu)?;
            for min_gain in [0.0, 0.01, 0.2, 1.0] {
                let at = format!("{name} on {mesh}, min_gain {min_gain}");
                let o = PlanOptions { min_gain, ..opts(64 << 30, Baseline::Auto) };
                let p = round_trip(&codegen::plan(&g, &mesh, &cpu, &o).context(at.clone())?)?;
                ensure!(p.options.min_gain == min_gain, "{at}: plan.json records min_gain {}", p.options.min_gain);
                let step = p.estimate.step_seconds;
                let own =
                    p.solver.compared.get("auto").copied().flatten().with_context(|| format!("{at}: auto fits"))?;
                let best = codegen::plan::role_baselines(&mesh)
                    .iter()
                    .filter_map(|b| p.solver.compared.get(&b.name()).copied().flatten())
                    .min_by(f64::total_cmp)
                    .with_context(|| format!("{at}: no baseline was compared"))?;
                if p.solver.chosen == Baseline::Auto {
                    ensure!(step == own, "{at}: the auto plan's step {step} is not its compared {own}");
                    ensure!(own <= best * (1.0 - min_gain), "{at}: auto {own} s kept against the baselines' {best} s");
                } else {
                    ensure!(
                        step == best,
                        "{at}: kept {} at {step} s, not the cheapest baseline ({best} s)",
                        p.solver.chosen
                    );
                    ensure!(own > best * (1.0 - min_gain), "{at}: auto {own} s gains enough over {best} s");
                    // On an exact tie the baseline is as good as the solve found: its status.
                    ensure!(
                        own != step || p.solver.status != codegen::plan::SolveStatus::Feasible,
                        "{at}: a baseline tied with auto's plan says {}",
                        p.solver.status
                    );
                    if own < step {
                        kept += 1;
                        let text = codegen::explain::summary(&p);
                        ensure!(
                            text.contains(&format!("kept {}: auto's own plan is estimated only", p.solver.chosen)),
                            "{at}: explain does not say why the baseline was kept:\n{text}"
                        );
                    }
                }
                ensure!(min_gain < 1.0 || p.solver.chosen != Baseline::Auto, "{at}: auto kept with min_gain 1");
            }
        }
    }
    // With a threshold of 100%, a baseline is kept wherever auto's own plan was cheaper.
    ensure!(kept > 0, "no case kept a baseline over a cheaper auto plan: the test shows nothing");
    // A microbatched plan's step is its passes' and update's, not what its solves compared: with
    // no threshold, explain never says a baseline was kept over a cheaper auto plan; with one,
    // the gain it gives is the solves' (the percentage printed).
    let forward =
        tracer::import_file(&model(MODELS[1].0), &tracer::ImportOptions { load_weights: false, ..Default::default() })?;
    let loss: LossSpec = MODELS[1].1.parse().map_err(anyhow::Error::msg)?;
    let g = training_graph(&forward, &TrainOptions::new(loss, Some(Optimizer::adamw(1e-3))))?
        .with_gradient_scale(0.5)
        .graph;
    let mesh = DeviceMesh::with_profile(vec![2, 2], vec!["data".into(), "tensor".into()], &cpu)?;
    for min_gain in [0.0, 1.0] {
        let o = PlanOptions { min_gain, microbatches: 2, ..opts(64 << 30, Baseline::Auto) };
        let p = round_trip(&codegen::plan(&g, &mesh, &cpu, &o)?)?;
        let text = codegen::explain::summary(&p);
        let base = p.solver.compared.get(&p.solver.chosen.name()).copied().flatten().context("chosen plan")?;
        let own = p.solver.compared.get("auto").copied().flatten().context("auto's plan")?;
        let says = text.contains("kept ");
        ensure!(
            says == (min_gain > 0.0 && p.solver.chosen != Baseline::Auto && own < base),
            "microbatched, min_gain {min_gain}: chosen {}, auto {own} s, chosen {base} s, but explain says:\n{text}",
            p.solver.chosen
        );
        let gain = format!("estimated only {:.2}% faster (--min-gain 100%)", (1.0 - own / base) * 100.0);
        ensure!(!says || text.contains(&gain), "microbatched: explain does not say `{gain}`:\n{text}");
    }
    Ok(())
}

/// The chosen strategy of the op named `name`.
fn chosen<'a>(p: &'a Plan, name: &str) -> Result<(&'a str, Vec<String>)> {
    for i in &p.program {
        if let Instr::Op { name: n, strategy, input_specs, .. } = i
            && n == name
        {
            return Ok((strategy.as_str(), input_specs.iter().map(|s| s.to_string()).collect()));
        }
    }
    bail!("no op {name} in the plan")
}

#[test]
fn megatron_pattern_on_a_tensor_only_mesh() -> Result<()> {
    let cpu = DeviceProfile::builtin("cpu").context("cpu profile")?;
    let mesh = DeviceMesh::parse("tensor=4", &cpu)?;
    // mlp: replicated parameters and AdamW state take 4 x 1.5 MiB x 3 (fc2) + ...: a budget of
    // 1.25x the smallest peak rules replication out.
    let g = training("mlp.onnx", "mse:y:t")?;
    let budget = min_peak(&g, &mesh, &cpu)? / 4 * 5;
    let p = codegen::plan(&g, &mesh, &cpu, &opts(budget, Baseline::Auto))?;
    // fc2 column-parallel (weight [out, in] split on out), then fc3 row-parallel (split on in,
    // its input split the same way, output partial).
    assert_eq!(chosen(&p, "/fc2/Gemm")?, ("n@0", vec!["R R".into(), "S0 R".into(), "S0".into()]));
    assert_eq!(chosen(&p, "/fc3/Gemm")?, ("k@0", vec!["R S0".into(), "R S0".into(), "R | P0".into()]));
    let g = training("gpt2-tiny.onnx", "ce-next:logits:input_ids")?;
    let budget = min_peak(&g, &mesh, &cpu)? / 4 * 5;
    let p = codegen::plan(&g, &mesh, &cpu, &opts(budget, Baseline::Auto))?;
    for layer in ["h.0", "h.1"] {
        for (col, row) in [("attn/c_attn", "attn/c_proj"), ("mlp/c_fc", "mlp/c_proj")] {
            let c = chosen(&p, &format!("/m/transformer/{layer}/{col}/Gemm"))?;
            let r = chosen(&p, &format!("/m/transformer/{layer}/{row}/Gemm"))?;
            assert_eq!(c, ("n@0", vec!["R R".into(), "R S0".into(), "S0".into()]), "{layer} {col}");
            assert_eq!(r, ("k@0", vec!["R S0".into(), "S0 R".into(), "R | P0".into()]), "{layer} {row}");
        }
    }
    Ok(())
}

#[test]
fn too_small_budget_names_the_minimum_and_just_above_it_fits() -> Result<()> {
    let cpu = DeviceProfile::builtin("cpu").context("cpu profile")?;
    let mesh = DeviceMesh::parse("2x2", &cpu)?;
    let g = training("gpt2-tiny.onnx", "ce-next:logits:input_ids")?;
    let err = codegen::plan(&g, &mesh, &cpu, &opts(1 << 20, Baseline::Auto)).err().context("1 MiB was accepted")?;
    let msg = err.to_string();
    ensure!(msg.starts_with("no plan fits 1.00 MiB per rank: the smallest peak any plan reaches is"), "{msg}");
    ensure!(msg.contains("dominated by") && msg.contains("use --memory"), "{msg}");
    let min = min_peak(&g, &mesh, &cpu)?;
    let p = codegen::plan(&g, &mesh, &cpu, &opts(min + min / 100 + 1, Baseline::Auto))?;
    ensure!(p.estimate.peak_bytes_per_rank <= min + min / 100 + 1);
    println!("gpt2-tiny on 2x2: smallest peak {min} B; planned at +1% with peak {} B", p.estimate.peak_bytes_per_rank);
    Ok(())
}

#[test]
fn explain_renders_and_the_loader_rejects_corrupt_plans() -> Result<()> {
    let cpu = DeviceProfile::builtin("cpu").context("cpu profile")?;
    let mesh = DeviceMesh::parse("2x2", &cpu)?;
    let g = training("mlp.onnx", "mse:y:t")?;
    let p = codegen::plan(&g, &mesh, &cpu, &opts(64 << 30, Baseline::Auto))?;
    let s = codegen::explain::summary(&p);
    for k in ["step", "memory", "comms", "solver"] {
        ensure!(s.lines().any(|l| l.starts_with(k)), "summary has no `{k}` line:\n{s}");
    }
    // The HTML page is well formed: every opened element is closed in order.
    let html = codegen::explain::html(&p);
    check_html(&html)?;
    let dot = codegen::explain::dot(&p);
    ensure!(dot.starts_with("digraph plan {") && dot.trim_end().ends_with('}'));
    // Corruptions: each is a clear error, never a panic.
    let json = p.to_json().unwrap();
    let cases = [
        (
            json.replace(
                &format!("\"version\": {}", codegen::plan::VERSION),
                &format!("\"version\": {}", codegen::plan::VERSION + 1),
            ),
            "is newer",
        ),
        (json.replacen("\"spec\": \"", "\"spec\": \"S9 ", 1), "spec"),
        (json.replacen("\"kind\": \"free\"", "\"kind\": \"nonsense\"", 1), "unknown variant"),
        (json[..json.len() / 2].to_string(), "not JSON"),
        ("{}".to_string(), "no `version`"),
    ];
    for (text, phrase) in cases {
        match Plan::from_json(&text) {
            Ok(_) => bail!("a corrupt plan ({phrase}) was accepted"),
            Err(e) => ensure!(e.to_string().contains(phrase), "`{phrase}` not in: {e}"),
        }
    }
    // A program that reads a freed value is rejected.
    let mut q = p.clone();
    let first_free = q.program.iter().position(|i| matches!(i, Instr::Free { .. })).context("no free")?;
    let freed = match &q.program[first_free] {
        Instr::Free { values, .. } => values[0],
        _ => unreachable!(),
    };
    q.program
        .insert(first_free + 1, Instr::Free { values: vec![freed], stage: 0, phase: Default::default(), chunk: 0 });
    ensure!(q.validate().is_err(), "double free accepted");
    Ok(())
}

fn check_html(html: &str) -> Result<()> {
    ensure!(html.starts_with("<!DOCTYPE html>"));
    let mut stack: Vec<String> = vec![];
    let mut rest = html;
    while let Some(i) = rest.find('<') {
        rest = &rest[i + 1..];
        let end = rest.find('>').context("unclosed tag")?;
        let tag = &rest[..end];
        rest = &rest[end + 1..];
        // Comments, doctype and self-closing elements (SVG's `<line .../>`) open nothing.
        if tag.starts_with('!') || tag.ends_with('/') {
            continue;
        }
        let name: String = tag.trim_start_matches('/').chars().take_while(|c| c.is_ascii_alphanumeric()).collect();
        if ["meta", "br"].contains(&name.as_str()) {
            continue;
        }
        if tag.starts_with('/') {
            let open = stack.pop().context("closing tag without opening")?;
            ensure!(open == name, "<{open}> closed by </{name}>");
        } else {
            stack.push(name);
        }
    }
    ensure!(stack.is_empty(), "unclosed elements: {stack:?}");
    Ok(())
}

/// With `tie_layers`, the same op of both gpt2-tiny blocks gets the same strategy.
#[test]
fn tied_layers_choose_the_same_strategies() -> Result<()> {
    let cpu = DeviceProfile::builtin("cpu").context("cpu profile")?;
    let mesh = DeviceMesh::parse("2x2", &cpu)?;
    let g = training("gpt2-tiny.onnx", "ce-next:logits:input_ids")?;
    let p = codegen::plan(&g, &mesh, &cpu, &PlanOptions { tie_layers: true, ..opts(64 << 30, Baseline::Auto) })?;
    ensure!(p.solver.tied > 50, "only {} nodes tied", p.solver.tied);
    let mut pairs = 0;
    for i in &p.program {
        if let Instr::Op { name, strategy, .. } = i
            && name.contains("/h.0/")
            && !name.starts_with("grad")
        {
            let other = name.replace("/h.0/", "/h.1/");
            if let Ok((s1, _)) = chosen(&p, &other) {
                ensure!(s1 == strategy, "{name}: {strategy} but {other}: {s1}");
                pairs += 1;
            }
        }
    }
    ensure!(pairs > 20, "only {pairs} layer pairs compared");
    Ok(())
}

/// Folding (exact ties, follow ops, tied layers) is exact for the plans it allows: every
/// solution of the folded problem expands to a solution of the built problem with the same cost
/// and peak, tied ops of both gpt2-tiny blocks take the same strategy, and each stage shrinks
/// the problem.
#[test]
fn folded_solutions_expand_with_the_same_cost() -> Result<()> {
    use codegen::problem::{Grouping, Merge, build, layer_pattern};
    let cpu = DeviceProfile::builtin("cpu").context("cpu profile")?;
    let mesh = DeviceMesh::parse("2x2", &cpu)?;
    let g = codegen::plan::canonical(&training("gpt2-tiny.onnx", "ce-next:logits:input_ids")?)?;
    // A budget that binds for some plans, so memory stays in the problem.
    let b = build(&g, &mesh, &cpu, Baseline::Auto, Some(6 << 20))?;
    ensure!(b.problem.memory_may_bind(), "the budget should be able to bind");
    let exact = b.fold(&g, Grouping { merge: Merge::Off, tie_layers: false })?;
    let merged = b.fold(&g, Grouping { merge: Merge::Proven, tie_layers: false })?;
    let cheapest = b.fold(&g, Grouping { merge: Merge::Cheapest, tie_layers: false })?;
    let tied = b.fold(&g, Grouping { merge: Merge::Proven, tie_layers: true })?;
    let n = |f: &codegen::problem::Folding| f.folded.problem.nodes.len();
    println!(
        "nodes: built {}, exact ties {}, merged {}, tied {}",
        b.problem.nodes.len(),
        n(&exact),
        n(&merged),
        n(&tied)
    );
    ensure!(n(&exact) < b.problem.nodes.len() && n(&merged) <= n(&exact) && n(&tied) < n(&merged));
    ensure!(tied.tied > 50, "only {} nodes tied", tied.tied);
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for f in [&exact, &merged, &cheapest, &tied] {
        let p = &f.folded.problem;
        for _ in 0..30 {
            let x: Vec<usize> = p
                .nodes
                .iter()
                .map(|nd| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    (seed % nd.strategies() as u64) as usize
                })
                .collect();
            let full = f.folded.expand(&x)?;
            let (a, e) = (p.evaluate(&x)?, b.problem.evaluate(&full)?);
            ensure!(a.cost == e.cost, "folded cost {} but expanded {}", a.cost, e.cost);
            ensure!(a.peak_usage == e.peak_usage, "folded peak {} but expanded {}", a.peak_usage, e.peak_usage);
            // Tied: the same op of both blocks, when in one group, has the same strategy.
            if std::ptr::eq(f, &tied) {
                let chosen = b.chosen(&full);
                for members in f.folded.groups() {
                    for m in members {
                        let name = &g.node(b.nodes[m.node]).name;
                        let twin = members.iter().find(|o| {
                            let other = &g.node(b.nodes[o.node]).name;
                            other != name && layer_pattern(other) == layer_pattern(name)
                        });
                        if let Some(o) = twin {
                            ensure!(chosen[m.node].outputs == chosen[o.node].outputs, "{name}: tied but different");
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// Issue 20, item 1: the time limit bounds the whole run after import. On gpt2-tiny over 2x2x2
/// (32,506 strategies, 6.6M edge entries) with a limit far below what the four solves would take,
/// the plan still comes back, within the limit plus a margin for what cannot be interrupted
/// (building the problem, one pass of reductions: generous here, 30 s, as this is a debug build on
/// a shared machine; release figures are in BENCHMARKS.md). Baselines that did not fit are named
/// in the report, never shown as compared; with time to spare on a small problem none is skipped.
#[test]
fn the_time_limit_bounds_the_whole_run() -> Result<()> {
    let cpu = DeviceProfile::builtin("cpu").context("cpu profile")?;
    let g = training("gpt2-tiny.onnx", "ce-next:logits:input_ids")?;
    let mesh = DeviceMesh::parse("2x2x2", &cpu)?;
    let limit = Duration::from_millis(300);
    let p = codegen::plan(&g, &mesh, &cpu, &PlanOptions { time_limit: limit, ..opts(64 << 30, Baseline::Auto) })?;
    let p = round_trip(&p)?;
    ensure!(
        p.solver.seconds <= limit.as_secs_f64() + 30.0,
        "{:.1} s against a limit of {limit:?}: {:?}",
        p.solver.seconds,
        p.solver.timings
    );
    for stage in ["build", "solve auto", "lower"] {
        ensure!(p.solver.timings.contains_key(stage), "no `{stage}` in the timings {:?}", p.solver.timings);
    }
    let staged: f64 = p.solver.timings.values().sum();
    ensure!(staged <= p.solver.seconds + 1e-3, "stages {staged} s exceed the run's {} s", p.solver.seconds);
    for b in &p.solver.skipped {
        ensure!(!p.solver.compared.contains_key(b), "{b} is both skipped and compared");
    }
    let s = codegen::explain::summary(&p);
    if !p.solver.skipped.is_empty() {
        ensure!(s.contains("not solved in the time limit"), "the summary does not name the skipped baselines:\n{s}");
    }
    println!("gpt2-tiny on 2x2x2, limit {limit:?}: {:.2} s, skipped {:?}", p.solver.seconds, p.solver.skipped);

    // A small problem with time to spare: every baseline is solved and compared.
    let g = training("mlp.onnx", "mse:y:t")?;
    let mesh = DeviceMesh::parse("2x2", &cpu)?;
    let p = codegen::plan(
        &g,
        &mesh,
        &cpu,
        &PlanOptions { time_limit: Duration::from_secs(20), ..opts(64 << 30, Baseline::Auto) },
    )?;
    ensure!(p.solver.skipped.is_empty(), "skipped {:?} with 20 s for the MLP", p.solver.skipped);
    let all = 1 + codegen::plan::role_baselines(&mesh).len();
    ensure!(p.solver.compared.len() == all, "compared {:?}, not auto and every role baseline", p.solver.compared);
    Ok(())
}

/// A pinned layout's problem is built with only the strategies it allows (pricing the
/// conversions between all of them first was most of a 4-D mesh's build): the same problem as
/// the unrestricted one restricted afterwards, node for node and price for price.
#[test]
fn a_pinned_problem_is_the_restricted_unpinned_one() -> Result<()> {
    use codegen::problem::build;
    let cpu = DeviceProfile::builtin("cpu").context("cpu profile")?;
    let mesh = DeviceMesh::parse("2x2", &cpu)?;
    let g = codegen::plan::canonical(&training("gpt2-tiny.onnx", "ce-next:logits:input_ids")?)?;
    let all = build(&g, &mesh, &cpu, Baseline::Auto, Some(64 << 20))?;
    for b in [Baseline::Dp, Baseline::Megatron, Baseline::Zero] {
        let pinned = build(&g, &mesh, &cpu, b, Some(64 << 20))?;
        let after = all.restrict(&g, &mesh, b)?;
        ensure!(pinned.problem == after.problem, "{}: the pinned build differs from the restriction", b.name());
        ensure!(pinned.problem.nodes.len() == all.problem.nodes.len());
        ensure!(
            pinned.problem.total_strategies() < all.problem.total_strategies(),
            "{}: nothing was left out",
            b.name()
        );
    }
    Ok(())
}

/// A plan whose time is already spent still comes back (the first candidate is owed): the
/// conversions not priced by then are priced by a direct path, the plan says how many, it is
/// valid, and its summary says what that means for the objective and bound.
#[test]
fn past_the_time_limit_conversions_are_priced_directly() -> Result<()> {
    let cpu = DeviceProfile::builtin("cpu").context("cpu profile")?;
    let g = training("gpt2-tiny.onnx", "ce-next:logits:input_ids")?;
    let mesh = DeviceMesh::parse("2x2x2", &cpu)?;
    let late = PlanOptions { deadline: Some(std::time::Instant::now()), ..opts(64 << 30, Baseline::Auto) };
    let p = round_trip(&codegen::plan(&g, &mesh, &cpu, &late)?)?;
    ensure!(p.solver.estimated_conversions > 0, "no conversion was priced directly");
    let s = codegen::explain::summary(&p);
    ensure!(s.contains("direct path"), "the summary does not say so:\n{s}");
    // With no time left to solve, auto searched only the strategies of the hand-written layouts
    // (no bound over every strategy is claimed), and says so.
    ensure!(
        p.solver.skipped.iter().any(|k| k.starts_with("auto over every strategy")),
        "the quick solve is not named: {:?}",
        p.solver.skipped
    );
    ensure!(p.solver.lower_bound_seconds == 0.0, "a bound over the restricted problem is reported");
    ensure!(s.contains("not solved in the time limit: auto over every strategy"), "{s}");
    // With time, every price is the search's, and the plan is at least as good.
    let timely = codegen::plan(&g, &mesh, &cpu, &opts(64 << 30, Baseline::Auto))?;
    ensure!(timely.solver.estimated_conversions == 0);
    println!(
        "gpt2-tiny on 2x2x2: {} prices direct, step {:.3} ms; searched {:.3} ms",
        p.solver.estimated_conversions,
        p.estimate.step_seconds * 1e3,
        timely.estimate.step_seconds * 1e3
    );
    Ok(())
}

/// A problem too large to hold (here the MLP on a 5-axis mesh of 2s: 131k strategies, 425M
/// edge-cost entries, over 3 GiB as built) is refused with its size and what to do before any
/// price is computed, instead of running out of memory after minutes. Each axis has its own
/// link, so the search cannot merge adjacent axes into fewer (as it does for same-link ones).
#[test]
fn a_problem_too_large_for_memory_is_a_clear_error() -> Result<()> {
    let cpu = DeviceProfile::builtin("cpu").context("cpu profile")?;
    let g = training("mlp.onnx", "mse:y:t")?;
    let mesh = DeviceMesh::parse("a=2:10GB/s,b=2:20GB/s,c=2:30GB/s,d=2:40GB/s,e=2:50GB/s", &cpu)?;
    match codegen::plan(&g, &mesh, &cpu, &opts(64 << 30, Baseline::Auto)) {
        Err(e @ codegen::Error::TooLarge { entries, limit, .. }) => {
            ensure!(entries > limit, "refused {entries} entries under the limit {limit}");
            let text = e.to_string();
            ensure!(text.contains("fewer axes") && text.contains("2x2x2x2x2"), "unclear message: {text}");
            Ok(())
        }
        Err(e) => bail!("expected the too-large error, got: {e}"),
        Ok(_) => bail!("a 425M-entry problem was built"),
    }
}

/// The lowered program of gpt2-tiny on 2x2, one line per instruction (estimates left out: they
/// follow the device profile), against `tests/data/golden/plan_gpt2-tiny_2x2.txt`. A change to
/// lowering, conversion paths, frees or the chosen strategies shows as a diff here;
/// `BLESS=1 cargo test --workspace --test plan golden` rewrites the file after a deliberate one.
#[test]
fn golden_lowered_plan_gpt2_tiny_2x2() -> Result<()> {
    let cpu = DeviceProfile::builtin("cpu").context("cpu profile")?;
    let g = training("gpt2-tiny.onnx", "ce-next:logits:input_ids")?;
    let mesh = DeviceMesh::uniform(&[2, 2])?;
    // Time enough to prove the optimum on any machine, so the plan does not depend on speed.
    let o =
        PlanOptions { time_limit: Duration::from_secs(120), compare_baselines: false, ..opts(1 << 30, Baseline::Auto) };
    let p = round_trip(&codegen::plan(&g, &mesh, &cpu, &o)?)?;
    ensure!(p.solver.status != codegen::plan::SolveStatus::Feasible, "not solved to optimality: {}", p.solver.status);
    let mut text = String::new();
    for (k, ins) in p.program.iter().enumerate() {
        let list = |v: &[codegen::plan::ValueRef]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", ");
        let specs = |v: &[sharding::ShardingSpec]| v.iter().map(|x| format!("[{x}]")).collect::<Vec<_>>().join(" ");
        let line = match ins {
            Instr::Op { name, op, strategy, inputs, input_specs, outputs, output_specs, local, recompute, .. } => {
                // The local op as the plan writes it (attributes for the blocks).
                let op = if op.is_source() { op.name().to_string() } else { serde_json::to_string(op)? };
                format!(
                    "{} = {op}({}) {name} `{strategy}` {} -> {}{}{}",
                    list(outputs),
                    list(inputs),
                    specs(input_specs),
                    specs(output_specs),
                    if *local == sharding::Local::Same { String::new() } else { format!(" {local:?}") },
                    if *recompute { " recompute" } else { "" }
                )
            }
            Instr::Collective { input, output, collective, from, to, bytes, .. } => {
                format!("{output} = {collective}({input}) [{from}] -> [{to}] {bytes} B")
            }
            Instr::Free { values, .. } => format!("free {}", list(values)),
            Instr::Transfer { value, spec, from, to, bytes, .. } => {
                format!("send {value} [{spec}] stage {from} -> {to} {bytes} B")
            }
        };
        text.push_str(&format!("{k:4} {line}\n"));
    }
    for s in &p.params {
        text.push_str(&format!("param {} %{} {:?} [{}] local {:?}\n", s.name, s.node, s.shape, s.spec, s.local_shape));
    }
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/golden/plan_gpt2-tiny_2x2.txt");
    if std::env::var_os("BLESS").is_some() {
        std::fs::write(&path, &text)?;
        return Ok(());
    }
    let want = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
    if want != text {
        let first = want
            .lines()
            .zip(text.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(want.lines().count().min(text.lines().count()));
        bail!(
            "the lowered plan differs from {} from line {}:\n  golden: {}\n  now:    {}\n({} lines golden, {} now; BLESS=1 rewrites it after a deliberate change)",
            path.display(),
            first + 1,
            want.lines().nth(first).unwrap_or("<end>"),
            text.lines().nth(first).unwrap_or("<end>"),
            want.lines().count(),
            text.lines().count()
        );
    }
    Ok(())
}

/// Like a compiler's verifier, validation goes on past the first problem: five independent
/// edits of a valid plan are five problems, each at its instruction or parameter.
#[test]
fn a_plan_with_five_errors_reports_all_five() -> Result<()> {
    let cpu = DeviceProfile::builtin("cpu").context("cpu profile")?;
    let g = training("mlp.onnx", "mse:y:t")?;
    let mesh = DeviceMesh::uniform(&[2, 2])?;
    let mut p = codegen::plan(&g, &mesh, &cpu, &opts(1 << 30, Baseline::Dp))?;
    p.validate()?;
    let ops: Vec<usize> = (0..p.program.len())
        .filter(|&k| matches!(&p.program[k], Instr::Op { inputs, .. } if !inputs.is_empty()))
        .collect();
    let free = (0..p.program.len()).find(|&k| matches!(p.program[k], Instr::Free { .. })).context("no free")?;
    ensure!(ops.len() >= 3, "too few ops");
    // 1. A local shape that is not the spec's split.
    if let Instr::Op { local_shapes, .. } = &mut p.program[ops[0]] {
        local_shapes[0][0] += 1;
    }
    // 2. An op renamed.
    if let Instr::Op { name, .. } = &mut p.program[ops[1]] {
        name.push_str("_edited");
    }
    // 3. A read of a value never written.
    if let Instr::Op { inputs, .. } = &mut p.program[ops[2]] {
        inputs[0] = inputs[0].with_copy(99_999);
    }
    // 4. A free of a value that is not live.
    if let Instr::Free { values, .. } = &mut p.program[free] {
        values.push(codegen::plan::ValueRef::new(0, 7));
    }
    // 5. A parameter's offsets for too few ranks.
    p.params[0].offsets.truncate(1);
    let problems = p.problems();
    let at: Vec<String> = problems.iter().map(|x| x.to_string()).collect();
    let want = [
        format!("instruction {}: ", ops[0]),
        format!("instruction {}: ", ops[1]),
        format!("instruction {}: ", ops[2]),
        format!("instruction {free}: frees %0.7"),
        format!("parameter {}: 1 offsets", p.params[0].name),
    ];
    for w in &want {
        ensure!(at.iter().any(|a| a.starts_with(w.as_str())), "no problem starting `{w}` in:\n{}", at.join("\n"));
    }
    ensure!(problems.len() == 5, "{} problems, want 5:\n{}", problems.len(), at.join("\n"));
    // The error names them all (three shown, the rest counted) and the JSON loader agrees.
    let err = Plan::from_json(&p.to_json()?).err().context("accepted")?.to_string();
    ensure!(err.contains("and 2 more"), "{err}");
    Ok(())
}

/// A pipelined plan (issue 18) is checked like any other, stage by stage: each edit below is
/// refused with the instruction it breaks.
#[test]
fn pipelined_plans_are_validated_stage_by_stage() -> Result<()> {
    let cpu = DeviceProfile::builtin("cpu").context("cpu profile")?;
    let g = training("gpt2-tiny.onnx", "ce-next:logits:input_ids")?;
    let mesh = DeviceMesh::uniform(&[2, 2])?;
    let p = codegen::plan(&g, &mesh, &cpu, &PlanOptions { stages: 2, ..opts(1 << 30, Baseline::Auto) })?;
    let p = round_trip(&p)?;
    let pp = p.pipeline.as_ref().context("no pipeline")?;
    ensure!(pp.stages == 2 && pp.per_stage.iter().all(|s| s.ops > 0), "{:?}", pp.per_stage);
    // The tied embedding is read on both stages: some transfer goes back to stage 0 (its
    // gradient) and the loss goes to stage 0 at the end.
    let transfers: Vec<usize> =
        (0..p.program.len()).filter(|&k| matches!(p.program[k], Instr::Transfer { .. })).collect();
    ensure!(transfers.iter().any(|&k| matches!(p.program[k], Instr::Transfer { from: 1, to: 0, .. })), "no 1 -> 0");
    let first = transfers[0];
    let refused = |q: &Plan, want: &str| -> Result<()> {
        let err = Plan::from_json(&q.to_json()?).err().context(format!("accepted (want `{want}`)"))?.to_string();
        ensure!(err.contains(want), "want `{want}` in: {err}");
        Ok(())
    };
    // A transfer removed: its receiver reads a value its stage never got.
    let mut q = p.clone();
    let Instr::Transfer { value, to, .. } = q.program.remove(first) else { unreachable!() };
    refused(&q, &format!("reads {value} before it is written or after it is freed (on stage {to})"))?;
    // A transfer from a stage that does not hold the value.
    let mut q = p.clone();
    if let Instr::Transfer { from, to, .. } = &mut q.program[first] {
        std::mem::swap(from, to);
    }
    refused(&q, &format!("instruction {first}: sends"))?;
    // An op moved to a stage the plan does not have.
    let mut q = p.clone();
    let op = (0..q.program.len()).find(|&k| matches!(q.program[k], Instr::Op { .. })).context("no op")?;
    if let Instr::Op { stage, .. } = &mut q.program[op] {
        *stage = 2;
    }
    refused(&q, &format!("instruction {op}: runs on stage 2, but the plan has 2 stages"))?;
    // A layout split over the stage axis.
    let mut q = p.clone();
    if let Instr::Transfer { spec, .. } = &mut q.program[first] {
        *spec = sharding::ShardingSpec::shard(spec.rank().max(1), 0, &[0]);
    }
    refused(&q, "the pipeline's stage axis")?;
    // Stages that are not the outermost axis.
    let mut q = p.clone();
    if let Some(pp) = &mut q.pipeline {
        pp.stages = 3;
    }
    refused(&q, "3 pipeline stages on mesh")?;
    // A parameter claimed by the other stage.
    let mut q = p.clone();
    q.params[0].stage = 1 - q.params[0].stage;
    refused(&q, &format!("parameter {}: on stage", q.params[0].name))?;
    Ok(())
}

/// A microbatched plan (issue 18, item 2) moves its update part to the end and names the values
/// it accumulates; edits that break that are refused.
#[test]
fn microbatched_plans_are_validated() -> Result<()> {
    let cpu = DeviceProfile::builtin("cpu").context("cpu profile")?;
    let g = training("mlp.onnx", "mse:y:t")?;
    let mesh = DeviceMesh::uniform(&[2])?;
    let p = codegen::plan(&g, &mesh, &cpu, &PlanOptions { microbatches: 4, ..opts(1 << 30, Baseline::Auto) })?;
    let p = round_trip(&p)?;
    let update = |i: &Instr| i.phase() == codegen::plan::Phase::Update;
    ensure!(p.microbatches == 4 && !p.accumulate.is_empty() && p.program.iter().any(update), "not microbatched");
    // Every update op is in the update phase, which comes last.
    let first = p.program.iter().position(update).context("no update phase")?;
    for (k, ins) in p.program.iter().enumerate() {
        if let Instr::Op { op: ir::Op::AdamWUpdate { .. } | ir::Op::SgdUpdate { .. }, .. } = ins {
            ensure!(update(ins), "update op at {k} outside the update phase");
        }
        ensure!(update(ins) == (k >= first), "instruction {k} is on the wrong side of the update phase");
    }
    // The step's parts: the pass's compute and communication count 4 times, the update's once,
    // each on its own side (a data-parallel plan's gradient reduction stays communication).
    let dp = codegen::plan(&g, &mesh, &cpu, &PlanOptions { microbatches: 4, ..opts(1 << 30, Baseline::Dp) })?;
    let part = |upd: bool, comm: bool| -> f64 {
        dp.program
            .iter()
            .filter(|i| update(i) == upd)
            .map(|i| match i {
                Instr::Op { seconds, .. } if !comm => *seconds,
                Instr::Collective { seconds, .. } if comm => *seconds,
                _ => 0.0,
            })
            .sum()
    };
    let e = &dp.estimate;
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs().max(1e-12);
    ensure!(part(true, true) > 0.0, "the dp plan reduces no gradient in its update");
    ensure!(close(e.compute_seconds, 4.0 * part(false, false) + part(true, false)), "compute {e:?}");
    ensure!(close(e.comm_seconds, 4.0 * part(false, true) + part(true, true)), "communication {e:?}");
    ensure!(close(e.compute_seconds + e.comm_seconds + e.recompute_seconds, e.step_seconds), "parts {e:?}");
    let refused = |q: &Plan, want: &str| -> Result<()> {
        let err = Plan::from_json(&q.to_json()?).err().context(format!("accepted (want `{want}`)"))?.to_string();
        ensure!(err.contains(want), "want `{want}` in: {err}");
        Ok(())
    };
    let forward = |i: &mut Instr| i.set_phase(codegen::plan::Phase::Forward);
    // No update phase: the sums are read where nothing accumulated them.
    let mut q = p.clone();
    q.program.iter_mut().for_each(forward);
    refused(&q, "which is not live where the microbatches end")?;
    // A microbatch instruction after the update began.
    let mut q = p.clone();
    q.program.last_mut().map(forward).context("empty program")?;
    refused(&q, "phase after the update phase began")?;
    let mut q = p.clone();
    q.microbatches = 0;
    refused(&q, "0 microbatches")?;
    Ok(())
}

/// Pipeline schedules (issue 18, item 3) on a uniform model (a GPT of 8 equal blocks, its
/// embedding and head small, on 4 stages of 1 device, 8 microbatches): the estimated bubble of
/// 1F1B and GPipe is (S-1)/(M+S-1) of the microbatch steps within 2%, interleaved 1F1B's with 2
/// chunks (S-1)/(2M+S-1) within 5%, ZB-H1's is lower than 1F1B's; 1F1B holds fewer microbatches'
/// activations than GPipe (a lower peak), and every plan passes its loader.
#[test]
fn schedules_bubbles_match_their_formulas() -> Result<()> {
    use codegen::plan::ScheduleKind;
    let cfg = tracer::generate::GptConfig { layers: 8, hidden: 128, heads: 2, seq: 64, vocab: 16, batch: 2 };
    let bytes = tracer::generate::gpt(&cfg).map_err(anyhow::Error::msg)?;
    let g = tracer::import_bytes(&bytes, "uniform.onnx", "uniform", None, &tracer::ImportOptions::default())?;
    let loss: LossSpec = "ce-next:logits:input_ids".parse().map_err(anyhow::Error::msg)?;
    let (s, m) = (4usize, 8usize);
    let tg =
        training_graph(&g, &TrainOptions::new(loss, Some(Optimizer::adamw(1e-3))))?.with_gradient_scale(1.0 / m as f32);
    let cpu = DeviceProfile::builtin("cpu").context("cpu profile")?;
    let mesh = DeviceMesh::uniform(&[s, 1])?;
    let mut bubble = std::collections::BTreeMap::new();
    let mut peak = std::collections::BTreeMap::new();
    for kind in [ScheduleKind::OneFOneB, ScheduleKind::Gpipe, ScheduleKind::Interleaved, ScheduleKind::ZbH1] {
        let o = PlanOptions { stages: s, microbatches: m, schedule: kind, chunks: 2, ..opts(8 << 30, Baseline::Auto) };
        let p = round_trip(&codegen::plan(&tg.graph, &mesh, &cpu, &o)?)?;
        let pp = p.pipeline.as_ref().context("no pipeline")?;
        println!("{kind}: bubble {:.4}, peak {}", pp.schedule.bubble, p.estimate.peak_bytes_per_rank);
        bubble.insert(kind.name(), pp.schedule.bubble);
        peak.insert(kind.name(), p.estimate.peak_bytes_per_rank);
    }
    let near = |got: f64, want: f64, tol: f64| (got - want).abs() <= tol * want;
    let flat = (s - 1) as f64 / (m + s - 1) as f64;
    for k in ["1f1b", "gpipe"] {
        ensure!(near(bubble[k], flat, 0.02), "{k}: bubble {:.4}, want {flat:.4} within 2%", bubble[k]);
    }
    let interleaved = (s - 1) as f64 / (2 * m + s - 1) as f64;
    ensure!(
        near(bubble["interleaved"], interleaved, 0.05),
        "interleaved: bubble {:.4}, want {interleaved:.4}",
        bubble["interleaved"]
    );
    ensure!(
        bubble["zb-h1"] < bubble["1f1b"],
        "zb-h1's bubble {:.4} is not below 1f1b's {:.4}",
        bubble["zb-h1"],
        bubble["1f1b"]
    );
    ensure!(peak["1f1b"] < peak["gpipe"], "1f1b peak {} vs gpipe {}", peak["1f1b"], peak["gpipe"]);
    Ok(())
}

/// A microbatch adds each gradient into its sum when the step computing it ends, not at its
/// last step on the stage (issue 46: under an interleaved schedule, holding every chunk's
/// gradients until a microbatch's last step held 16 microbatches' worth of a stage's gradients
/// on LLaMA-3 405B, 186 instead of 59 GiB a rank). An 8-layer GPT in 2 stages of 2 chunks over
/// 4 microbatches: every gradient a step lists was touched by that step's segment (or it is the
/// microbatch's last step), and some gradients are listed at a backward step before the
/// microbatch's last one (the second chunk's).
#[test]
fn gradients_join_their_sums_when_their_chunk_ends() -> Result<()> {
    use codegen::plan::{Phase, ScheduleKind};
    let cfg = tracer::generate::GptConfig { layers: 8, hidden: 128, heads: 2, seq: 64, vocab: 16, batch: 2 };
    let bytes = tracer::generate::gpt(&cfg).map_err(anyhow::Error::msg)?;
    let g = tracer::import_bytes(&bytes, "uniform.onnx", "uniform", None, &tracer::ImportOptions::default())?;
    let loss: LossSpec = "ce-next:logits:input_ids".parse().map_err(anyhow::Error::msg)?;
    let m = 4usize;
    let tg =
        training_graph(&g, &TrainOptions::new(loss, Some(Optimizer::adamw(1e-3))))?.with_gradient_scale(1.0 / m as f32);
    let cpu = DeviceProfile::builtin("cpu").context("cpu profile")?;
    let mesh = DeviceMesh::uniform(&[2, 1])?;
    let o = PlanOptions {
        stages: 2,
        microbatches: m,
        schedule: ScheduleKind::Interleaved,
        chunks: 2,
        ..opts(8 << 30, Baseline::Auto)
    };
    let p = round_trip(&codegen::plan(&tg.graph, &mesh, &cpu, &o)?)?;
    let summed = p.summed();
    ensure!(!p.accumulate.is_empty(), "no gradients are summed over the microbatches");
    for stage in 0..p.stages() {
        let steps = &p.steps()[stage];
        let after = p.summed_after_steps(stage, &summed);
        ensure!(after.len() == steps.len(), "stage {stage}: {} lists for {} steps", after.len(), steps.len());
        let last: std::collections::HashMap<usize, usize> =
            steps.iter().enumerate().map(|(i, st)| (st.microbatch, i)).collect();
        let mut early = 0;
        for (i, (st, values)) in steps.iter().zip(&after).enumerate() {
            let touched: std::collections::HashSet<_> = p
                .program
                .iter()
                .filter(|ins| ins.segment_on(stage) == Some(st.segment()))
                .flat_map(|ins| match ins {
                    Instr::Op { inputs, outputs, .. } => inputs.iter().chain(outputs).copied().collect::<Vec<_>>(),
                    Instr::Collective { input, output, .. } => vec![*input, *output],
                    Instr::Free { values, .. } => values.clone(),
                    Instr::Transfer { value, .. } => vec![*value],
                })
                .collect();
            for v in values {
                ensure!(
                    touched.contains(v) || last[&st.microbatch] == i,
                    "stage {stage}, step {st}: sums {v}, which it does not touch"
                );
            }
            if last[&st.microbatch] != i && st.phase == Phase::Backward {
                early += values.iter().filter(|v| p.accumulate.contains(v)).count();
            }
        }
        ensure!(early > 0, "stage {stage}: no gradient joins its sum before its microbatch's last step");
    }
    Ok(())
}

/// `--pipeline auto` (issue 18, item 4): on 4x1 with 4 microbatches the search prices gpt2-tiny
/// without stages and in 2 and 4 stages (the outer axis cut into stages of sub-axes) under
/// 1F1B, ZB-H1 and interleaved, and keeps the fastest, but the plan without stages unless the
/// fastest with stages is more than `min_gain` faster (the plan without stages on a tie): for
/// thresholds 0, 1%, 20% and 100% the kept estimate is the one this rule picks from
/// `solver.compared`, the plan records the threshold and passes its loader, and `explain` says
/// when a faster staged plan was passed over.
#[test]
fn pipeline_search_keeps_the_fastest_candidate() -> Result<()> {
    let g = training("gpt2-tiny.onnx", "ce-next:logits:input_ids")?;
    let cpu = DeviceProfile::builtin("cpu").context("cpu profile")?;
    let mesh = DeviceMesh::uniform(&[4, 1])?;
    let mut staged_kept = 0;
    for min_gain in [0.0, 0.01, 0.2, 1.0] {
        let o = PlanOptions { microbatches: 4, compare_baselines: false, min_gain, ..opts(4 << 30, Baseline::Auto) };
        let p = round_trip(&codegen::pipeline::search(&g, &mesh, &cpu, &o)?)?;
        let found: Vec<(&String, f64)> = p
            .solver
            .compared
            .iter()
            .filter(|(k, _)| k.starts_with("pipeline: "))
            .filter_map(|(k, v)| v.map(|v| (k, v)))
            .collect();
        for want in [
            "pipeline: no stages",
            "pipeline: 2 stages, 1f1b",
            "pipeline: 4 stages, zb-h1",
            "pipeline: 4 stages, interleaved x2",
        ] {
            ensure!(found.iter().any(|(k, _)| k.as_str() == want), "{want} not searched: {found:?}");
        }
        let unstaged = found.iter().find(|(k, _)| k.as_str() == "pipeline: no stages").context("no stages")?.1;
        let staged = found
            .iter()
            .filter(|(k, _)| k.as_str() != "pipeline: no stages")
            .map(|(_, v)| *v)
            .fold(f64::INFINITY, f64::min);
        let want = if staged < unstaged * (1.0 - min_gain) { staged } else { unstaged };
        ensure!(
            p.estimate.step_seconds == want,
            "min-gain {min_gain}: kept {} s, want {want} s: {found:?}",
            p.estimate.step_seconds
        );
        ensure!(p.pipeline.is_some() == (want < unstaged), "min-gain {min_gain}: stages {:?}", p.pipeline.is_some());
        staged_kept += usize::from(p.pipeline.is_some());
        ensure!(p.options.min_gain == min_gain, "recorded min-gain {} for {min_gain}", p.options.min_gain);
        ensure!(p.solver.timings.contains_key("pipeline search"), "no search timing");
        let text = codegen::explain::summary(&p);
        let passed_over = p.pipeline.is_none() && staged < unstaged && min_gain > 0.0;
        ensure!(text.contains("kept no stages: ") == passed_over, "min-gain {min_gain}: {text}");
    }
    // The cheapest plan has stages here (so the thresholds above decide something), and a
    // threshold of 100% keeps the plan without them.
    ensure!((1..4).contains(&staged_kept), "a plan with stages was kept for {staged_kept} of 4 thresholds");
    Ok(())
}

/// `--pipeline auto` searches no more stages than microbatches while a plan with fewer fits
/// (more stages idle over half the step): gpt2-tiny on 4x1 with 2 microbatches prices no
/// stages and 2 stages, not 4.
#[test]
fn pipeline_search_skips_more_stages_than_microbatches_while_fewer_fit() -> Result<()> {
    let g = training("gpt2-tiny.onnx", "ce-next:logits:input_ids")?;
    let cpu = DeviceProfile::builtin("cpu").context("cpu profile")?;
    let mesh = DeviceMesh::uniform(&[4, 1])?;
    let o = PlanOptions { microbatches: 2, compare_baselines: false, ..opts(4 << 30, Baseline::Auto) };
    let p = codegen::pipeline::search(&g, &mesh, &cpu, &o)?;
    let names: Vec<&String> = p.solver.compared.keys().chain(p.solver.skipped.iter()).collect();
    ensure!(names.iter().any(|k| k.starts_with("pipeline: 2 stages")), "2 stages not searched: {names:?}");
    ensure!(names.iter().any(|k| k.as_str() == "pipeline: no stages"), "no stages not searched: {names:?}");
    ensure!(!names.iter().any(|k| k.starts_with("pipeline: 4 stages")), "4 stages searched: {names:?}");
    Ok(())
}

/// When no plan with at most as many stages as microbatches fits, `--pipeline auto` goes on to
/// more stages, fewest first: gpt2-tiny on a 1-D mesh of 6 with 2 microbatches and 6 MiB per
/// device fits neither without stages nor in 2 stages (the time limit's plans, verified below),
/// and plans in 3.
#[test]
fn pipeline_search_takes_more_stages_than_microbatches_when_fewer_do_not_fit() -> Result<()> {
    let g = training("gpt2-tiny.onnx", "ce-next:logits:input_ids")?;
    let cpu = DeviceProfile::builtin("cpu").context("cpu profile")?;
    let mesh = DeviceMesh::uniform(&[6])?;
    let o = PlanOptions { microbatches: 2, compare_baselines: false, ..opts(6 << 20, Baseline::Auto) };
    for stages in [1, 2] {
        let fixed = PlanOptions { stages, ..o.clone() };
        ensure!(
            codegen::plan(&g, &mesh, &cpu, &fixed).is_err(),
            "{stages} stage(s) fit 6 MiB: the case no longer tests the fallback"
        );
    }
    let p = codegen::pipeline::search(&g, &mesh, &cpu, &o)?;
    let stages = p.pipeline.as_ref().map_or(1, |pp| pp.stages);
    ensure!(stages == 3, "{stages} stages chosen, want 3 (compared: {:?})", p.solver.compared.keys());
    ensure!(p.estimate.peak_bytes_per_rank <= 6 << 20, "peak {} over 6 MiB", p.estimate.peak_bytes_per_rank);
    Ok(())
}

/// A schedule edited by hand (issue 18, item 3) is refused with what is wrong: a microbatch's
/// backward before its forward, a step twice, chunks out of range, an instruction out of its
/// stage's segment order, and stages whose orders wait for each other (a deadlock).
#[test]
fn edited_schedules_are_refused() -> Result<()> {
    use codegen::plan::{Phase, ScheduleKind, Step};
    let cpu = DeviceProfile::builtin("cpu").context("cpu profile")?;
    let g = training("mlp.onnx", "mse:y:t")?;
    let mesh = DeviceMesh::uniform(&[2, 1])?;
    let o =
        PlanOptions { stages: 2, microbatches: 2, schedule: ScheduleKind::OneFOneB, ..opts(1 << 30, Baseline::Auto) };
    let p = round_trip(&codegen::plan(&g, &mesh, &cpu, &o)?)?;
    let refused = |q: &Plan, want: &str| -> Result<()> {
        let err = Plan::from_json(&q.to_json()?).err().context(format!("accepted (want `{want}`)"))?.to_string();
        ensure!(err.contains(want), "want `{want}` in: {err}");
        Ok(())
    };
    let steps = |q: &mut Plan, s: usize, list: &str| -> Result<()> {
        let pp = q.pipeline.as_mut().context("no pipeline")?;
        pp.schedule.steps[s] =
            list.split(' ').map(|x| x.parse::<Step>().map_err(anyhow::Error::msg)).collect::<Result<_>>()?;
        Ok(())
    };
    let mut q = p.clone();
    steps(&mut q, 0, "B0 F0 F1 B1")?;
    refused(&q, "comes after a later part of microbatch 0")?;
    let mut q = p.clone();
    steps(&mut q, 1, "F0 B0 F0 B1")?;
    refused(&q, "step F0 twice")?;
    let mut q = p.clone();
    q.pipeline.as_mut().context("no pipeline")?.schedule.chunks = 0;
    refused(&q, "model chunks per stage")?;
    // The first backward instruction of stage 1 moved into its forward.
    let mut q = p.clone();
    let k = q.program.iter().position(|i| i.phase() == Phase::Backward).context("no backward")?;
    q.program[k].set_phase(Phase::Weight);
    refused(&q, "the order a microbatch runs them")?;
    // Stage 0 one microbatch after the other, stage 1 the second first: each waits for the other.
    let mut q = p.clone();
    steps(&mut q, 0, "F0 B0 F1 B1")?;
    steps(&mut q, 1, "F1 B1 F0 B0")?;
    refused(&q, "the schedule deadlocks: stage 0 at B0 waits for")?;
    Ok(())
}

/// Issue 20: the edges of repeated layers share one cost matrix (a 70B LLaMA on 8x8x8 holds
/// 80 copies of each layer's otherwise), restricting to a baseline keeps them shared, and the
/// shared problem folds exactly as the same problem with every matrix copied.
#[test]
fn repeated_layers_share_their_edge_matrices() -> Result<()> {
    use codegen::problem::{Grouping, build};
    use tracer::generate::{LlamaConfig, llama};
    let cpu = DeviceProfile::builtin("cpu").context("cpu profile")?;
    let config = LlamaConfig { layers: 6, hidden: 64, heads: 4, kv_heads: 2, ffn: 128, seq: 16, vocab: 256, batch: 4 };
    let bytes = llama(&config).map_err(anyhow::Error::msg)?;
    let opts = tracer::ImportOptions { load_weights: false, ..Default::default() };
    let g = tracer::import_bytes(&bytes, "llama", "llama", None, &opts)?;
    let loss: LossSpec = "ce-next:logits:input_ids".parse().map_err(anyhow::Error::msg)?;
    let train = TrainOptions::new(loss, Some(Optimizer::adamw(1e-3)));
    let g = codegen::plan::canonical(&training_graph(&g, &train)?.graph)?;
    let mesh = DeviceMesh::parse("2x2x2", &cpu)?;
    let b = build(&g, &mesh, &cpu, Baseline::Auto, Some(16 << 30))?;
    let distinct = |p: &solver::Problem| {
        p.edges.iter().map(|e| e.costs.as_ptr() as usize).collect::<std::collections::HashSet<_>>().len()
    };
    let (edges, shared) = (b.problem.edges.len(), distinct(&b.problem));
    println!("{edges} edges, {shared} distinct matrices");
    ensure!(shared * 3 < edges, "{shared} distinct matrices for {edges} edges");
    let zero = b.restrict(&g, &mesh, Baseline::Zero)?;
    ensure!(distinct(&zero.problem) * 3 < edges, "restricting copied the matrices");
    let mut copied = b.problem.clone();
    for e in &mut copied.edges {
        e.costs = e.costs.to_vec().into();
    }
    ensure!(distinct(&copied) == edges);
    let groups = b.groups(&g, Grouping { tie_layers: true, ..Default::default() });
    ensure!(groups.tied > 0, "no layer tied");
    let (a, c) = (solver::fold(&b.problem, &groups.groups)?, solver::fold(&copied, &groups.groups)?);
    ensure!(a.problem == c.problem, "the shared problem folds differently");
    ensure!(b.problem.size() == copied.size());
    Ok(())
}

/// The prologue's rules (issue 46), each broken once in a real plan: gpt2-tiny under `zero`
/// on 2x2 with 4 microbatches, and under `pp,zero` in 2 stages. The loader refuses a forward op
/// moved into the prologue (it reads what no microbatch wrote yet), a prologue value freed
/// inside a microbatch (later microbatches read it), and a stage-to-stage transfer in the
/// prologue. The unbroken plans load, and their step estimate is the hand count: prologue and
/// update instructions once, every other instruction once per microbatch.
#[test]
fn prologue_rules_are_validated() -> Result<()> {
    use codegen::plan::Phase;
    let cpu = DeviceProfile::builtin("cpu").context("cpu profile")?;
    let g = training("gpt2-tiny.onnx", "ce-next:logits:input_ids")?;
    let mesh = DeviceMesh::uniform(&[2, 2])?;
    let m = 4;
    let refused = |q: &Plan, want: &str| -> Result<()> {
        let err = Plan::from_json(&q.to_json()?).err().context(format!("accepted (want `{want}`)"))?.to_string();
        ensure!(err.contains(want), "want `{want}` in: {err}");
        Ok(())
    };
    for (layout, stages) in [("zero", 1), ("pp,zero", 2)] {
        let o = PlanOptions {
            microbatches: m,
            stages,
            compare_baselines: false,
            ..opts(16 << 30, layout.parse().map_err(anyhow::Error::msg)?)
        };
        let p = round_trip(&codegen::plan(&g, &mesh, &cpu, &o)?)?;
        let phase = |i: &Instr| i.phase();
        let last = p.program.iter().rposition(|i| phase(i) == Phase::Prologue).context("no prologue")?;
        if stages == 1 {
            // The hand count (one stage: no bubble, the step is the sum of its instructions).
            let once = |i: &Instr| matches!(phase(i), Phase::Prologue | Phase::Update);
            let hand: f64 = p
                .program
                .iter()
                .map(|i| match i {
                    Instr::Op { seconds, .. } | Instr::Collective { seconds, .. } => {
                        if once(i) {
                            *seconds
                        } else {
                            m as f64 * *seconds
                        }
                    }
                    _ => 0.0,
                })
                .sum();
            let step = p.estimate.step_seconds;
            ensure!((hand - step).abs() <= 1e-9 * step, "{layout}: step {step} s, counted by hand {hand} s");
        }
        // A forward op moved into the prologue, after the prologue's last instruction.
        let mut q = p.clone();
        // (One that reads what an input op of the microbatch wrote.)
        let fed: Vec<_> = (last + 1..q.program.len())
            .filter_map(|k| match &q.program[k] {
                Instr::Op { op: ir::Op::Input { .. }, outputs, .. } => Some(outputs[0]),
                _ => None,
            })
            .collect();
        let k = (last + 1..q.program.len())
            .find(|&k| match &q.program[k] {
                Instr::Op { inputs, phase: Phase::Forward, .. } => inputs.iter().any(|v| fed.contains(v)),
                _ => false,
            })
            .context("no forward op reading an input")?;
        let ins = q.program.remove(k);
        q.program.insert(last + 1, ins);
        q.program[last + 1].set_phase(Phase::Prologue);
        refused(&q, "in the prologue, before any microbatch could write it")?;
        // A prologue value freed inside the first microbatch.
        let mut q = p.clone();
        let (value, stage) = p.program[..=last]
            .iter()
            .find_map(|i| match i {
                Instr::Collective { output, stage, .. } => Some((*output, *stage)),
                _ => None,
            })
            .context("no collective in the prologue")?;
        q.program.insert(last + 1, Instr::Free { values: vec![value], stage, phase: Phase::Forward, chunk: 0 });
        refused(&q, "which the prologue wrote, before the update phase")?;
        // A transfer in the prologue.
        if stages > 1 {
            let mut q = p.clone();
            let t = q.program.iter().position(|i| matches!(i, Instr::Transfer { .. })).context("no transfer")?;
            q.program[t].set_phase(Phase::Prologue);
            refused(&q, "is a transfer in the prologue")?;
        }
    }
    Ok(())
}
