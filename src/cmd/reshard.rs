//! `autopar reshard`: the cheapest collectives turning one sharding spec into another.

use std::io::Write;

use anyhow::{Result, bail};
use sharding::{DeviceProfile, LayoutConverter, Search, ShardingSpec};

/// Arguments of `autopar reshard`.
#[derive(clap::Args, Debug)]
pub struct ReshardArgs {
    /// Source spec, one entry per tensor dim, e.g. "S0 R R", "S01 R R", "R S1 | P0".
    pub from: String,
    /// Target spec.
    pub to: String,
    /// Device mesh: `2x4` (axis 0 outermost) or `data=2,tensor=4`.
    #[arg(long, default_value = "2x2", value_parser = super::common::parse_mesh)]
    pub mesh: String,
    /// Global tensor shape, e.g. `8x16x32`.
    #[arg(long)]
    pub shape: String,
    /// Element type: f32, i64 or bool.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Device profile for link costs: cpu, a100-80g, h100-sxm, h200, or a JSON file.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Measured alpha/beta per mesh axis (JSON `{"axes": [{"alpha": s, "beta": s_per_byte}, ...]}`);
    /// default: the device profile's links (intra-node for inner axes that fit in one machine).
    #[arg(long, value_name = "FILE")]
    pub mesh_profile: Option<String>,
    /// Use the greedy search instead of the exact (Dijkstra) one.
    #[arg(long)]
    pub greedy: bool,
    /// Print the path as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Runs `autopar reshard`.
pub fn run(a: &ReshardArgs) -> Result<()> {
    let profile = DeviceProfile::load(&a.device)?;
    let mesh = super::common::mesh(&a.mesh, &profile, a.mesh_profile.as_deref())?;
    let Some(dtype) = ir::DType::from_name(&a.dtype) else { bail!("--dtype {}: expected f32, i64 or bool", a.dtype) };
    let shape = super::common::parse_dims(&a.shape, dtype.size()).map_err(|e| anyhow::anyhow!("--shape {e}"))?;
    let from: ShardingSpec = a.from.parse()?;
    let to: ShardingSpec = a.to.parse()?;
    let search = if a.greedy { Search::Greedy } else { Search::Exact };
    let conv = LayoutConverter::new(mesh.clone(), search);
    let path = conv.convert(&shape, dtype.size(), &from, &to)?;
    let mut out = std::io::stdout().lock();
    if a.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&*path)?)?;
        return Ok(());
    }
    let local = |s: &ShardingSpec| s.local_shape(&shape, &mesh);
    writeln!(
        out,
        "{} on mesh {mesh} ({}): [{from}] (local {:?}) -> [{to}] (local {:?}), {} search",
        ir::TensorMeta::new(dtype, shape.clone()),
        profile.name,
        local(&from),
        local(&to),
        if a.greedy { "greedy" } else { "exact" }
    )?;
    if path.steps.is_empty() {
        writeln!(out, "  nothing to do: the layouts are the same")?;
    }
    for (i, s) in path.steps.iter().enumerate() {
        writeln!(
            out,
            "  {}. {:<48} -> [{}]  {} B  {:.3e} s",
            i + 1,
            s.collective.to_string(),
            s.after,
            s.bytes,
            s.cost
        )?;
    }
    writeln!(out, "total {:.3e} s", path.cost)?;
    Ok(())
}
