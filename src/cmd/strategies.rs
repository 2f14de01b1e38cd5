//! `autopar strategies`: the sharding strategies of every op of a model on a mesh.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use ir::autodiff::LossSpec;
use sharding::DeviceProfile;

use super::common;

/// Arguments of `autopar strategies`.
#[derive(clap::Args, Debug)]
pub struct StrategiesArgs {
    /// The ONNX model.
    pub model: PathBuf,
    /// Device mesh: `2x4` (axis 0 outermost) or `data=2,tensor=4`.
    #[arg(long, default_value = "2x2", value_parser = common::parse_mesh)]
    pub mesh: String,
    /// Device profile for costs: cpu, a100-80g, h100-sxm, h200, or a JSON file.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Measured alpha/beta per mesh axis (JSON `{"axes": [{"alpha": s, "beta": s_per_byte}, ...]}`);
    /// default: the device profile's links (intra-node for inner axes that fit in one machine).
    #[arg(long, value_name = "FILE")]
    pub mesh_profile: Option<String>,
    /// Only this node (exact name; repeatable).
    #[arg(long = "node", value_name = "NAME")]
    pub nodes: Vec<String>,
    /// Only nodes whose name contains this text (repeatable; any match).
    #[arg(long = "match", value_name = "TEXT")]
    pub matches: Vec<String>,
    /// Bind an input's shape, e.g. `input_ids=2x128`.
    #[arg(long = "input", value_name = "NAME=DIMS")]
    pub inputs: Vec<String>,
    /// Largest constant the importer may compute (folded shape arithmetic, ConstantOfShape,
    /// Range), in bytes; parameters and activations are shapes only and not bounded by it.
    #[arg(long, value_name = "BYTES", default_value_t = tracer::DEFAULT_MAX_CONSTANT_BYTES)]
    pub max_constant_bytes: usize,
    /// List the strategies of the training graph (forward, loss, backward, optimizer update) for
    /// this loss (`mse:OUT:TARGET`, `ce:OUT:LABELS`, `ce-next:OUT:IDS`); without it, the forward
    /// graph only.
    #[arg(long, value_name = "SPEC")]
    pub loss: Option<String>,
    /// Optimizer of the training graph (with --loss).
    #[command(flatten)]
    pub opt: common::OptimizerArgs,
    /// One JSON object per node instead of the table.
    #[arg(long)]
    pub json: bool,
}

fn fmt_specs(specs: &[sharding::ShardingSpec]) -> String {
    specs.iter().map(|s| format!("[{s}]")).collect::<Vec<_>>().join(" ")
}

/// Runs `autopar strategies`.
pub fn run(a: &StrategiesArgs) -> Result<()> {
    let profile = DeviceProfile::load(&a.device)?;
    let mesh = common::mesh(&a.mesh, &profile, a.mesh_profile.as_deref())?;
    let opts = common::import_options(&a.inputs, false, a.max_constant_bytes)?;
    let forward = common::load_model(&a.model, &opts)?;
    let graph = match &a.loss {
        Some(spec) => {
            let loss: LossSpec = spec.parse().map_err(anyhow::Error::msg)?;
            ir::autodiff::training_graph(&forward, &a.opt.train_options(loss, vec![])?)?.graph
        }
        None => forward,
    };
    let order = graph.topo_order().map_err(|n| anyhow::anyhow!("the graph has a cycle at node {n:?}"))?;
    let selected: Vec<_> = order
        .into_iter()
        .filter(|&n| {
            let name = &graph.node(n).name;
            (a.nodes.is_empty() && a.matches.is_empty())
                || a.nodes.iter().any(|t| t == name)
                || a.matches.iter().any(|t| name.contains(t.as_str()))
        })
        .collect();
    if selected.is_empty() {
        bail!(
            "no node is named {:?} or contains {:?} (autopar inspect --graph lists the names{})",
            a.nodes,
            a.matches,
            if a.loss.is_some() { "; autopar train --graph those of the training graph" } else { "" }
        );
    }
    let mut out = std::io::stdout().lock();
    if !a.json {
        writeln!(
            out,
            "mesh {mesh} ({}), device {}; costs in seconds per rank, memory = output bytes per rank",
            mesh.names().join(" x "),
            profile.name
        )?;
        writeln!(out, "specs per tensor dim: R replicated, S<axes> split over mesh axes; | P<axes> partial sums")?;
    }
    let mut total = 0;
    for n in selected {
        let node = graph.node(n);
        let strategies =
            sharding::strategies(&graph, n, &mesh, &profile).with_context(|| format!("node {}", node.name))?;
        total += strategies.len();
        if a.json {
            let line = serde_json::json!({ "node": node.name, "op": node.op.name(), "strategies": strategies });
            writeln!(out, "{line}")?;
            continue;
        }
        let ins: Vec<String> = graph.node_inputs(n).iter().map(|v| graph.meta(*v).to_string()).collect();
        let outs: Vec<String> = node.outputs.iter().map(|m| m.to_string()).collect();
        writeln!(out, "\n{} ({}): {} -> {}", node.name, node.op.name(), ins.join(", "), outs.join(", "))?;
        for s in &strategies {
            writeln!(
                out,
                "  {:<18} {} -> {}  compute {:.3e} s  comm {:.3e} s  mem {} B{}",
                s.name,
                fmt_specs(&s.inputs),
                fmt_specs(&s.outputs),
                s.compute_seconds,
                s.comm_seconds,
                s.memory_bytes,
                if s.tags.is_empty() { String::new() } else { format!("  [{}]", s.tags.join(", ")) }
            )?;
        }
    }
    if !a.json {
        writeln!(out, "\n{total} strategies")?;
    }
    Ok(())
}
