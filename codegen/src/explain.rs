//! Renderings of a plan for people: a one-screen summary, Graphviz DOT and a standalone HTML page.

use std::fmt::Write;

use crate::{Baseline, fmt_bytes};
use ::plan::{Instr, Phase, Plan, SolveStatus};

fn ms(s: f64) -> String {
    if s >= 1.0 { format!("{s:.3} s") } else { format!("{:.3} ms", s * 1e3) }
}

/// The one-screen summary.
pub fn summary(p: &Plan) -> String {
    let mut o = String::new();
    plan_and_step(&mut o, p);
    memory_lines(&mut o, p);
    pipeline_lines(&mut o, p);
    cost_lines(&mut o, p);
    solver_lines(&mut o, p);
    o
}

/// The plan line (model, mesh, device, strategy) and the step's estimate.
fn plan_and_step(o: &mut String, p: &Plan) {
    let e = &p.estimate;
    let names = p.mesh.names.join(" x ");
    let shape: Vec<String> = p.mesh.shape.iter().map(|s| s.to_string()).collect();
    let _ = writeln!(
        o,
        "plan      {} on mesh {} ({names}), device {}, strategy {} (chosen: {})",
        p.model.name,
        shape.join("x"),
        p.device,
        p.options.strategy.name(),
        p.solver.chosen.name()
    );
    let share = |x: f64| if e.step_seconds > 0.0 { 100.0 * x / e.step_seconds } else { 0.0 };
    let hidden = if e.overlapped_comm_seconds > 0.0 {
        format!(" - overlapped {}", ms(e.overlapped_comm_seconds))
    } else {
        String::new()
    };
    let recompute = if e.recompute_seconds > 0.0 {
        format!(" + recompute {} ({:.0}%)", ms(e.recompute_seconds), share(e.recompute_seconds))
    } else {
        String::new()
    };
    if let Some(pp) = &p.pipeline {
        // The stages work at once: their compute and communication add up to more than the
        // step; shown as shares of the stages' time (the rest is the bubble and the update).
        let all = e.step_seconds * pp.stages as f64;
        let of = |x: f64| if all > 0.0 { 100.0 * x / all } else { 0.0 };
        let _ = writeln!(
            o,
            "step      {} estimated; over its {} stages: compute {} ({:.0}% of their time) + communication {} ({:.0}%)",
            ms(e.step_seconds),
            pp.stages,
            ms(e.compute_seconds),
            of(e.compute_seconds),
            ms(e.comm_seconds),
            of(e.comm_seconds)
        );
    } else {
        let _ = writeln!(
            o,
            "step      {} estimated = compute {} ({:.0}%) + communication {} ({:.0}%){recompute}{hidden}",
            ms(e.step_seconds),
            ms(e.compute_seconds),
            share(e.compute_seconds),
            ms(e.comm_seconds),
            share(e.comm_seconds)
        );
    }
    if p.options.overlap {
        let _ = writeln!(
            o,
            "overlap   communication {} hidden behind compute, {} exposed (gradient reductions and the prologue's \
             gathers on a second stream{})",
            ms(e.overlapped_comm_seconds),
            ms((e.comm_seconds - e.overlapped_comm_seconds).max(0.0)),
            if p.pipeline.is_some() { ", pipeline transfers beside the stages' work" } else { "" }
        );
    }
}

/// The memory line: the peak against the budget, and by kind.
fn memory_lines(o: &mut String, p: &Plan) {
    let e = &p.estimate;
    let _ = writeln!(
        o,
        "memory    peak {} per rank of budget {} ({:.1}%); resident {} (parameters, optimizer state, constants)",
        fmt_bytes(e.peak_bytes_per_rank),
        fmt_bytes(p.options.budget_bytes),
        100.0 * e.peak_bytes_per_rank as f64 / p.options.budget_bytes.max(1) as f64,
        fmt_bytes(e.resident_bytes_per_rank)
    );
    let b = &e.memory;
    if b.parameters > 0 {
        let low = if b.low_copies > 0 {
            format!(" + their {} copies {}", p.options.precision, fmt_bytes(b.low_copies))
        } else {
            String::new()
        };
        let _ = writeln!(
            o,
            "          by kind: parameters {}{low} + optimizer state {} + gradients {} per rank; at the peak, {} \
             of activations, copies and gradients{}",
            fmt_bytes(b.parameters),
            fmt_bytes(b.optimizer_state),
            fmt_bytes(b.gradients),
            fmt_bytes(b.activations_at_peak),
            if p.options.precision == ::plan::Precision::F32 {
                String::new()
            } else {
                format!(" ({} mixed precision)", p.options.precision)
            }
        );
    }
}

/// With pipeline stages: the schedule, each stage's steps and each stage's estimate.
fn pipeline_lines(o: &mut String, p: &Plan) {
    if let Some(pp) = &p.pipeline {
        let sc = &pp.schedule;
        let chunks = if sc.chunks > 1 { format!(" ({} chunks per stage)", sc.chunks) } else { String::new() };
        let _ = writeln!(
            o,
            "pipeline  {} stages x {} microbatch(es), {} schedule{chunks}: microbatches take {}, the stages idle {:.1}% \
             of it (the bubble)",
            pp.stages,
            pp.microbatches,
            sc.kind,
            ms(sc.seconds),
            100.0 * sc.bubble
        );
        for (i, steps) in sc.steps.iter().enumerate() {
            let shown: Vec<String> = steps.iter().take(24).map(|s| s.to_string()).collect();
            let more = if steps.len() > 24 { format!(" ... ({} steps)", steps.len()) } else { String::new() };
            let _ =
                writeln!(o, "{}stage {i}: {}{more}", if i == 0 { "schedule  " } else { "          " }, shown.join(" "));
        }
        for (i, st) in pp.per_stage.iter().enumerate() {
            let _ = writeln!(
                o,
                "{}stage {i}: {} ops, {} .. {}; compute {} + comm {} + receive {}; peak {}, resident {}",
                if i == 0 { "stages    " } else { "          " },
                st.ops,
                st.first,
                st.last,
                ms(st.compute_seconds),
                ms(st.comm_seconds),
                ms(st.transfer_seconds),
                fmt_bytes(st.peak_bytes),
                fmt_bytes(st.resident_bytes)
            );
        }
    }
}

/// The prologue ([`Phase::Prologue`]): what runs once a step before the first microbatch.
fn prologue_line(o: &mut String, p: &Plan) {
    let (mut ops, mut convs, mut gathers) = (0, 0, 0);
    let mut per_stage = vec![0.0f64; p.stages()];
    let last = per_stage.len() - 1;
    for i in p.program.iter().filter(|i| i.phase() == Phase::Prologue) {
        match i {
            Instr::Op { stage, seconds, .. } => {
                ops += 1;
                per_stage[(*stage).min(last)] += seconds;
            }
            Instr::Collective { stage, seconds, collective, .. } => {
                convs += 1;
                gathers += usize::from(matches!(collective, sharding::Collective::AllGather { .. }));
                per_stage[(*stage).min(last)] += seconds;
            }
            _ => {}
        }
    }
    if ops + convs == 0 {
        return;
    }
    let busiest = per_stage.iter().copied().fold(0.0, f64::max);
    let where_ = if p.stages() > 1 { " on the busiest stage" } else { "" };
    let _ = writeln!(
        o,
        "prologue  once a step, before the first microbatch: {ops} ops and {convs} conversions ({gathers} all-gathers), \
         {}{where_}; held until the update",
        ms(busiest)
    );
}

/// Recomputation, collectives, parameters and the costliest ops.
fn cost_lines(o: &mut String, p: &Plan) {
    prologue_line(o, p);
    let e = &p.estimate;
    let ck = &e.checkpoint;
    if !ck.recomputed.is_empty() {
        let _ = writeln!(
            o,
            "recompute {} of {} forward stages during backward: peak {} -> {} (+{} per step; chosen in {})",
            ck.recomputed.len(),
            ck.stages,
            fmt_bytes(ck.peak_before),
            fmt_bytes(ck.peak_after),
            ms(ck.extra_seconds),
            ms(ck.seconds)
        );
    }
    if e.collectives.is_empty() {
        let _ = writeln!(o, "comms     none");
    }
    for (i, c) in e.collectives.iter().enumerate() {
        let _ = writeln!(
            o,
            "{}{:<15} x{:<5} {:>12}  {}",
            if i == 0 { "comms     " } else { "          " },
            c.kind,
            c.count,
            fmt_bytes(c.bytes as u64),
            ms(c.seconds)
        );
    }
    let sharded = p.params.iter().filter(|x| !x.spec.is_replicated()).count();
    let _ = writeln!(
        o,
        "params    {} tensors: {} sharded, {} replicated",
        p.params.len(),
        sharded,
        p.params.len() - sharded
    );
    let mut top: Vec<_> = e.per_op.iter().collect();
    top.sort_by(|a, b| (b.compute_seconds + b.comm_seconds).total_cmp(&(a.compute_seconds + a.comm_seconds)));
    for (i, op) in top.iter().take(3).enumerate() {
        let _ = writeln!(
            o,
            "{}{} ({}, {}): {}",
            if i == 0 { "costliest " } else { "          " },
            op.node,
            op.op,
            op.strategy,
            ms(op.compute_seconds + op.comm_seconds)
        );
    }
}

/// The solver line (what was compared, skipped or kept, and why) and the step's bound.
fn solver_lines(o: &mut String, p: &Plan) {
    let e = &p.estimate;
    let compared: Vec<String> = p
        .solver
        .compared
        .iter()
        .map(|(k, v)| match v {
            Some(s) => format!("{k} {}", ms(*s)),
            None => format!("{k} does not fit"),
        })
        .collect();
    let skipped = if p.solver.skipped.is_empty() {
        String::new()
    } else {
        format!("; not solved in the time limit: {} (raise --time-limit to compare them)", p.solver.skipped.join(", "))
    };
    // A baseline kept although auto's own plan was estimated (slightly) faster: say why.
    // (Both from `compared`: a pipelined or microbatched plan's step is not its solves'.)
    let solved = |b: Baseline| p.solver.compared.get(&b.name()).copied().flatten();
    let kept = match (solved(Baseline::Auto), solved(p.solver.chosen)) {
        (Some(own), Some(base))
            if p.options.strategy == Baseline::Auto
                && p.solver.chosen != Baseline::Auto
                && p.options.min_gain > 0.0
                && own < base =>
        {
            Some(1.0 - own / base)
        }
        _ => None,
    };
    let skipped = match kept {
        Some(gain) => format!(
            "{skipped}; kept {}: auto's own plan is estimated only {:.2}% faster (--min-gain {}%)",
            p.solver.chosen.name(),
            gain * 100.0,
            (p.options.min_gain * 1e8).round() / 1e6
        ),
        None => skipped,
    };
    // A stage search that kept the plan without stages although one with them was estimated
    // (slightly) faster: say why.
    let unstaged = p.solver.compared.get("pipeline: no stages").copied().flatten();
    let staged = p
        .solver
        .compared
        .iter()
        .filter(|(k, _)| k.starts_with("pipeline: ") && k.as_str() != "pipeline: no stages")
        .filter_map(|(k, v)| v.map(|v| (k, v)))
        .min_by(|a, b| a.1.total_cmp(&b.1));
    let skipped = match (unstaged, staged) {
        (Some(u), Some((k, s))) if p.pipeline.is_none() && p.options.min_gain > 0.0 && s < u => format!(
            "{skipped}; kept no stages: {} is estimated only {:.2}% faster (--min-gain {}%)",
            k.trim_start_matches("pipeline: "),
            (1.0 - s / u) * 100.0,
            (p.options.min_gain * 1e8).round() / 1e6
        ),
        _ => skipped,
    };
    // A search stopped far from its bound: say what more time could buy (beyond the gain of
    // auto's own plan over a baseline kept).
    let gap = p.solver.objective_seconds / p.solver.lower_bound_seconds - 1.0 - kept.unwrap_or(0.0);
    let skipped = if p.solver.status == SolveStatus::Feasible && gap > 0.1 && gap.is_finite() {
        format!(
            "{skipped}; the objective is {:.0}% above its bound: a longer --time-limit may find a better plan",
            gap * 100.0
        )
    } else {
        skipped
    };
    let skipped = if p.solver.estimated_conversions > 0 {
        format!(
            "{skipped}; {} layout conversion prices were taken from a direct path (reduce, gather, slice) once \
             building the problem ran past the time limit: the objective and bound are over those prices",
            p.solver.estimated_conversions
        )
    } else {
        skipped
    };
    let _ = writeln!(
        o,
        "solver    {} in {:.2} s: {} nodes ({} tied to a repeated layer), {} edges, {} strategies; objective {} ({}); compared: {}{}",
        p.solver.status,
        p.solver.seconds,
        p.solver.nodes,
        p.solver.tied,
        p.solver.edges,
        p.solver.strategies,
        ms(p.solver.objective_seconds),
        // A solve restricted to the hand-written layouts' strategies (no time left) proves no
        // bound for the whole problem: it reports none (0), which is not a bound of 0 s.
        if p.solver.lower_bound_seconds > 0.0 || p.solver.objective_seconds <= 0.0 {
            format!("bound {}", ms(p.solver.lower_bound_seconds))
        } else {
            "no bound proven".to_string()
        },
        compared.join(", "),
        skipped
    );
    if p.solver.plan_bound_seconds > 0.0 && e.step_seconds > 0.0 {
        let _ = writeln!(
            o,
            "bound     no plan of this step takes less than {} on {} devices (every op priced whole on one device, \
             perfectly divided, no communication): this one is {:.1}x that; estimated MFU {:.1}% ({:.3e} model FLOPs per step)",
            ms(p.solver.plan_bound_seconds),
            p.mesh.shape.iter().product::<usize>(),
            e.step_seconds / p.solver.plan_bound_seconds,
            100.0 * e.mfu,
            e.model_flops
        );
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// Colour of a strategy by what it splits (replicated grey, partial orange, split blue).
fn colour(specs: &[sharding::ShardingSpec]) -> &'static str {
    if specs.iter().all(|s| s.is_replicated()) {
        "#dddddd"
    } else if specs.iter().any(|s| s.is_partial()) {
        "#f4b183"
    } else {
        "#9dc3e6"
    }
}

/// The program's ops as a Graphviz graph, coloured by their output layouts.
pub fn dot(p: &Plan) -> String {
    let mut o =
        String::from("digraph plan {\n  rankdir=TB;\n  node [shape=box, style=filled, fontname=\"monospace\"];\n");
    let mut producer = std::collections::HashMap::new();
    for ins in &p.program {
        if let Instr::Op { node, name, op, strategy, inputs, outputs, output_specs, .. } = ins {
            let specs: Vec<String> = output_specs.iter().map(|s| s.to_string()).collect();
            let _ = writeln!(
                o,
                "  n{node} [label=\"{}\\n{} {}\\n[{}]\", fillcolor=\"{}\"];",
                esc(name).replace('\\', "\\\\"),
                op.name(),
                esc(strategy),
                specs.join("] ["),
                colour(output_specs)
            );
            for i in inputs {
                if let Some(src) = producer.get(&i.base()) {
                    let style = if i.copy.is_some() { " [color=red, label=\"reshard\"]" } else { "" };
                    let _ = writeln!(o, "  n{src} -> n{node}{style};");
                }
            }
            for out in outputs {
                producer.insert(*out, *node);
            }
        }
    }
    o.push_str("}\n");
    o
}

/// The schedule as a timeline (SVG, no script): one row per stage, one box per step (F, B, W
/// of a microbatch, the update last), placed at its estimated start and end.
pub fn timeline_svg(t: &::plan::schedule::Timeline) -> String {
    let (width, row, left) = (1000.0, 28.0, 60.0);
    let end = t.step_seconds.max(1e-12);
    let x = |sec: f64| left + width * sec / end;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 {w} {h}\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"10\">",
        w = left + width + 10.0,
        h = row * (t.spans.len() as f64 + 1.0)
    );
    for (s, spans) in t.spans.iter().enumerate() {
        let y = row * s as f64 + 4.0;
        let _ = writeln!(o, "<text x=\"4\" y=\"{:.1}\">stage {s}</text>", y + row / 2.0);
        for sp in spans {
            let (label, fill) = match sp.step {
                Some(st) => (
                    st.to_string(),
                    match st.phase {
                        Phase::Forward => "#9dc3e6",
                        Phase::Backward => "#f4b183",
                        Phase::Weight => "#a9d18e",
                        Phase::Update | Phase::Prologue => "#dddddd",
                    },
                ),
                None => ("U".to_string(), "#dddddd"),
            };
            let (x0, x1) = (x(sp.start), x(sp.end).max(x(sp.start) + 0.5));
            let _ = write!(
                o,
                "<g><title>stage {s} {label}: {:.3} .. {:.3} ms</title><rect x=\"{x0:.1}\" y=\"{y:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{fill}\" stroke=\"#555\" stroke-width=\"0.5\"/>",
                sp.start * 1e3,
                sp.end * 1e3,
                x1 - x0,
                row - 8.0
            );
            if x1 - x0 > 7.0 * label.len() as f64 {
                let _ = write!(o, "<text x=\"{:.1}\" y=\"{:.1}\">{label}</text>", x0 + 2.0, y + row / 2.0);
            }
            o.push_str("</g>\n");
        }
    }
    let axis = row * t.spans.len() as f64 + 14.0;
    let _ = writeln!(
        o,
        "<text x=\"{left}\" y=\"{axis:.1}\">0</text><text x=\"{:.1}\" y=\"{axis:.1}\" text-anchor=\"end\">{:.3} ms</text>\n</svg>",
        left + width,
        end * 1e3
    );
    o
}

/// A figure of the page: an `<svg>` with its caption, found by its `id`.
fn figure(id: &str, caption: &str, svg: &str) -> String {
    format!("<figure id=\"{id}\">\n{svg}<figcaption>{caption}</figcaption>\n</figure>\n")
}

/// A standalone HTML page: the summary, the collectives, the parameter layouts and the program.
pub fn html(p: &Plan) -> String {
    html_with(p, None)
}

/// [`html`], with what a run measured beside the estimates when given. Its figures (SVG, no
/// script), each a `<figure>` with a stable id: `memory` (memory over the step per rank),
/// `families` (time per op family), `mesh` (the mesh and the layout of the largest
/// parameters) and, with pipeline stages, `timeline` (the schedule).
pub fn html_with(p: &Plan, measured: Option<&crate::figures::Measured>) -> String {
    let mut o = String::new();
    let _ = write!(
        o,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>autopar plan: {}</title>\n<style>\nbody {{ font-family: sans-serif; margin: 2em; }}\ntable {{ border-collapse: collapse; }}\ntd, th {{ border: 1px solid #999; padding: 2px 6px; font-family: monospace; font-size: 12px; }}\n.r {{ background: #dddddd; }} .p {{ background: #f4b183; }} .s {{ background: #9dc3e6; }}\npre {{ overflow-x: auto; }} figure {{ margin: 1em 0; }} figure svg {{ max-width: 100%; height: auto; }}\nfigcaption {{ font-size: 13px; color: #333; max-width: 60em; }}\n</style>\n</head>\n<body>\n",
        esc(&p.model.name)
    );
    let _ = write!(o, "<h1>autopar plan: {}</h1>\n<pre>{}</pre>\n", esc(&p.model.name), esc(&summary(p)));
    o.push_str("<h2>Figures</h2>\n");
    let stages = p.stages();
    let who = if stages > 1 {
        "one line per pipeline stage (the ranks of a stage hold the same), by the plan's liveness walk".to_string()
    } else {
        "one line for every rank: without pipeline stages the program is SPMD and every rank holds the same, \
         by the plan's liveness walk"
            .to_string()
    };
    let measured_text = if measured.is_some() {
        "; measured (dashed): one line per group of ranks that held the same bytes, on the estimated line where \
         the runtime's accounting agrees"
    } else {
        ""
    };
    o.push_str(&figure(
        "memory",
        &format!(
            "Memory held after each instruction of the step, estimated: {who}{measured_text}. The dashed line is the \
             estimated peak."
        ),
        &crate::figures::memory_chart(p, measured).svg(),
    ));
    o.push_str(&figure(
        "families",
        &format!(
            "Time per op family (an op, or a collective's kind), estimated{} per step, summed over the family's \
             instructions{}.",
            if measured.is_some() {
                " and measured (the mean over the ranks that run each instruction; a collective's or a transfer's \
                 time includes waiting for its peers)"
            } else {
                ""
            },
            if p.microbatches > 1 { format!(" and the {} microbatches", p.microbatches) } else { String::new() }
        ),
        &crate::figures::families_chart(p, measured, 12).svg(),
    ));
    o.push_str(&figure(
        "mesh",
        "The device mesh and which block of each of the largest parameters every device holds: a device shows its \
         block's index along the split dims (R: the whole tensor; –: another pipeline stage holds it), and the \
         tensor beside it is split into those blocks in the same colours.",
        &crate::figures::mesh_svg(p, 4),
    ));
    if let Some(pp) = &p.pipeline
        && let Ok(t) = ::plan::schedule::timeline(p)
    {
        let _ = write!(
            o,
            "<h2>Schedule</h2>\n{}",
            figure(
                "timeline",
                &format!(
                    "{} schedule, {} stages x {} microbatches: estimated bubble {:.1}%. F forward, B backward, W weight \
                     gradients, U update.",
                    pp.schedule.kind,
                    pp.stages,
                    pp.microbatches,
                    100.0 * t.bubble
                ),
                &timeline_svg(&t)
            )
        );
    }
    o.push_str("<h2>Parameters</h2>\n<table>\n<tr><th>name</th><th>shape</th><th>spec</th><th>local shape</th></tr>\n");
    for x in &p.params {
        let class = if x.spec.is_replicated() { "r" } else { "s" };
        let _ = writeln!(
            o,
            "<tr class=\"{class}\"><td>{}</td><td>{:?}</td><td>{}</td><td>{:?}</td></tr>",
            esc(&x.name),
            x.shape,
            esc(&x.spec.to_string()),
            x.local_shape
        );
    }
    o.push_str("</table>\n<h2>Program</h2>\n<table>\n<tr><th>#</th><th>instruction</th><th>strategy / collective</th><th>specs</th><th>seconds</th></tr>\n");
    for (k, ins) in p.program.iter().enumerate() {
        match ins {
            Instr::Op { name, op, strategy, input_specs, output_specs, seconds, .. } => {
                let ins: Vec<String> = input_specs.iter().map(|s| format!("[{s}]")).collect();
                let outs: Vec<String> = output_specs.iter().map(|s| format!("[{s}]")).collect();
                let class = match colour(output_specs) {
                    "#dddddd" => "r",
                    "#f4b183" => "p",
                    _ => "s",
                };
                let _ = writeln!(
                    o,
                    "<tr class=\"{class}\"><td>{k}</td><td>{} ({})</td><td>{}</td><td>{} -&gt; {}</td><td>{seconds:.3e}</td></tr>",
                    esc(name),
                    op.name(),
                    esc(strategy),
                    esc(&ins.join(" ")),
                    esc(&outs.join(" "))
                );
            }
            Instr::Collective { input, collective, from, to, seconds, .. } => {
                let _ = writeln!(
                    o,
                    "<tr><td>{k}</td><td>{}</td><td>{}</td><td>[{}] -&gt; [{}]</td><td>{seconds:.3e}</td></tr>",
                    esc(&input.to_string()),
                    esc(&collective.to_string()),
                    esc(&from.to_string()),
                    esc(&to.to_string())
                );
            }
            Instr::Transfer { value, spec, from, to, seconds, .. } => {
                let _ = writeln!(
                    o,
                    "<tr><td>{k}</td><td>{}</td><td>send stage {from} -&gt; stage {to}</td><td>[{}]</td><td>{seconds:.3e}</td></tr>",
                    esc(&value.to_string()),
                    esc(&spec.to_string())
                );
            }
            Instr::Free { .. } => {}
        }
    }
    o.push_str("</table>\n</body>\n</html>\n");
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::figures::tests::planned;

    #[test]
    fn the_page_has_each_figure_by_id() {
        let p = planned(&[2, 2], Baseline::Auto, 2);
        let page = html(&p);
        for id in ["memory", "families", "mesh", "timeline"] {
            assert_eq!(page.matches(&format!("<figure id=\"{id}\">")).count(), 1, "{id}");
        }
        assert_eq!(page.matches("<figcaption>").count(), 4);
        let flat = html(&planned(&[2, 4], Baseline::Dp, 1));
        assert!(flat.contains("<figure id=\"mesh\">") && !flat.contains("<figure id=\"timeline\">"));
    }
}
