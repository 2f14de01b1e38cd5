//! `autopar inspect`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Result, bail};
use ir::Op;

use super::common;

/// Arguments of `autopar inspect`.
#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    /// The ONNX model.
    #[arg(required_unless_present = "ops")]
    pub model: Option<PathBuf>,
    /// Bind an input's shape, e.g. `input_ids=2x128` (fills dynamic dims; may override static ones).
    #[arg(long = "input", value_name = "NAME=DIMS")]
    pub inputs: Vec<String>,
    /// Largest constant the importer may compute (folded shape arithmetic, ConstantOfShape,
    /// Range), in bytes; parameters and activations are shapes only and not bounded by it.
    #[arg(long, value_name = "BYTES", default_value_t = tracer::DEFAULT_MAX_CONSTANT_BYTES)]
    pub max_constant_bytes: usize,
    /// Print the imported graph in autopar's IR text form (with --json: its JSON form, as plans
    /// hold it).
    #[arg(long)]
    pub graph: bool,
    /// List the ONNX ops autopar supports and exit.
    #[arg(long)]
    pub ops: bool,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

fn human_bytes(b: usize) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = b as f64;
    let mut u = 0;
    while x >= 1024.0 && u + 1 < units.len() {
        x /= 1024.0;
        u += 1;
    }
    if u == 0 { format!("{b} B") } else { format!("{x:.2} {}", units[u]) }
}

fn human_count(n: u64) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.2}G", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.2}M", n as f64 / 1e6),
        n if n >= 1_000 => format!("{:.1}K", n as f64 / 1e3),
        n => n.to_string(),
    }
}

/// Runs `autopar inspect`.
pub fn run(a: &InspectArgs) -> Result<()> {
    if a.ops {
        if a.json {
            println!("{}", serde_json::json!({ "supported_ops": tracer::SUPPORTED_OPS }));
        } else {
            println!("Supported ONNX ops ({}):", tracer::SUPPORTED_OPS.len());
            for chunk in tracer::SUPPORTED_OPS.chunks(8) {
                println!("  {}", chunk.join(", "));
            }
        }
        return Ok(());
    }
    let Some(path) = &a.model else { bail!("a model file is required (or --ops)") };
    // Inspection never needs weights: import shapes only.
    let opts = common::import_options(&a.inputs, false, a.max_constant_bytes)?;
    let (g, notes) = common::load_model_noted(path, &opts)?;
    if a.graph {
        return common::print_graph(&g, a.json);
    }
    let (params, param_bytes) = g.param_stats();
    let mut per_op: BTreeMap<&str, usize> = BTreeMap::new();
    let mut flops = 0u64;
    for n in g.g.node_indices() {
        let node = g.node(n);
        if matches!(node.op, Op::Input { .. } | Op::Param { .. } | Op::Constant(_)) {
            continue;
        }
        *per_op.entry(node.op.name()).or_default() += 1;
        let ins: Vec<_> = g.node_inputs(n).iter().map(|&v| g.meta(v).clone()).collect();
        flops += node.op.flops(&ins, &node.outputs);
    }
    let inputs: Vec<(String, String)> = g
        .inputs
        .iter()
        .map(|&i| match &g.node(i).op {
            Op::Input { name } => (name.clone(), g.node(i).outputs[0].to_string()),
            _ => unreachable!("inputs list holds input nodes"),
        })
        .collect();
    let outputs: Vec<(String, String)> = g.outputs.iter().map(|(n, v)| (n.clone(), g.meta(*v).to_string())).collect();
    let ops_total: usize = per_op.values().sum();
    let statistics = ir::autodiff::running_statistics(&g);
    if a.json {
        let j = serde_json::json!({
            "model": g.name,
            "inputs": inputs.iter().map(|(n, m)| serde_json::json!({"name": n, "type": m})).collect::<Vec<_>>(),
            "outputs": outputs.iter().map(|(n, m)| serde_json::json!({"name": n, "type": m})).collect::<Vec<_>>(),
            "params": params, "param_bytes": param_bytes, "param_tensors": g.params.len(),
            "statistics": statistics, "constants": notes.constants,
            "nodes": ops_total, "ops": per_op, "forward_flops": flops,
            "shared_parameters": tracer::shared_parameters(&g).iter().map(|s| serde_json::json!({
                "name": s.name, "op": s.op, "slot": s.slot, "nodes": s.nodes,
            })).collect::<Vec<_>>(),
        });
        println!("{j}");
        return Ok(());
    }
    println!("model    {} ({})", g.name, path.display());
    println!("inputs");
    for (n, m) in &inputs {
        println!("  {n:<24} {m}");
    }
    println!("outputs");
    for (n, m) in &outputs {
        println!("  {n:<24} {m}");
    }
    println!(
        "params   {} ({} parameters in {} tensors, {})",
        human_count(params as u64),
        params,
        g.params.len(),
        human_bytes(param_bytes)
    );
    for line in common::held_lines(&statistics, &notes.constants) {
        println!("held     {line}");
    }
    println!("forward  {} FLOPs", human_count(flops));
    println!("nodes    {ops_total}");
    let mut by_count: Vec<_> = per_op.into_iter().collect();
    by_count.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    for (op, c) in by_count {
        println!("  {op:<16} {c}");
    }
    let shared = tracer::shared_parameters(&g);
    if !shared.is_empty() {
        println!("shared   {} parameter(s) in the same role of several nodes:", shared.len());
        for s in &shared {
            println!("  {s}");
        }
        println!("  {}", tracer::TIED_ADVICE);
    }
    Ok(())
}
