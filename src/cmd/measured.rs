//! `autopar run --profile-ops FILE` writes what every rank measured of each instruction;
//! `autopar explain PLAN --measured FILE` sets it beside the plan's estimates, per op family and
//! per instruction, with the memory held over the step.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result, bail};
use codegen::Plan;
use codegen::plan::Instr;
use runtime::launch::RankProfile;

/// The profile file's format name.
const FORMAT: &str = "autopar-op-profile";

/// Writes the ranks' profiles of a run of `plan`.
pub fn write(path: &Path, plan: &Plan, profiles: &[RankProfile]) -> Result<()> {
    let ranks: Vec<serde_json::Value> = profiles
        .iter()
        .map(|p| {
            let seconds: serde_json::Map<String, serde_json::Value> =
                p.seconds.iter().map(|(k, v)| (k.to_string(), serde_json::json!(v))).collect();
            serde_json::json!({
                "rank": p.rank, "steps": p.steps, "step_seconds": p.step_seconds,
                "seconds": seconds, "memory": p.memory,
            })
        })
        .collect();
    let doc = serde_json::json!({
        "format": FORMAT, "version": 1, "model_hash": plan.model.hash,
        "instructions": plan.program.len(), "ranks": ranks,
    });
    std::fs::write(path, serde_json::to_string(&doc)? + "\n")
        .with_context(|| format!("--profile-ops {}", path.display()))
}

/// Reads a profile file written for `plan`.
pub fn read(path: &Path, plan: &Plan) -> Result<Vec<RankProfile>> {
    let text = ir::files::read_regular_to_string(path, 1 << 30).with_context(|| path.display().to_string())?;
    let v: serde_json::Value = serde_json::from_str(&text).with_context(|| path.display().to_string())?;
    if v["format"] != FORMAT {
        bail!("{} is not an op profile (written by `autopar run --profile-ops`)", path.display());
    }
    if v["model_hash"] != plan.model.hash.as_str() || v["instructions"] != plan.program.len() {
        bail!("{} was measured on another plan (its model or program differs)", path.display());
    }
    let bad = || anyhow::anyhow!("{}: a malformed rank entry", path.display());
    // Ranks are the plan's: each at most once, each a rank of its mesh.
    let ranks = plan.device_mesh().map_err(|e| anyhow::anyhow!("{e}"))?.size();
    let entries = v["ranks"].as_array().ok_or_else(bad)?;
    if entries.len() > ranks {
        bail!("{} holds {} rank entries; the plan has {ranks} ranks", path.display(), entries.len());
    }
    let mut seen = vec![false; ranks];
    let mut out = vec![];
    for r in entries {
        let rank = r["rank"].as_u64().ok_or_else(bad)? as usize;
        match seen.get_mut(rank) {
            None => bail!("{}: rank {rank} is not a rank of the plan's {ranks}", path.display()),
            Some(true) => bail!("{}: rank {rank} is measured twice", path.display()),
            Some(s) => *s = true,
        }
        let mut seconds = BTreeMap::new();
        for (k, s) in r["seconds"].as_object().ok_or_else(bad)? {
            let k: usize = k.parse().map_err(|_| bad())?;
            if k >= plan.program.len() {
                return Err(bad());
            }
            seconds.insert(k, s.as_f64().ok_or_else(bad)?);
        }
        let memory = r["memory"]
            .as_array()
            .ok_or_else(bad)?
            .iter()
            .map(|m| Some((m.get(0)?.as_u64()? as usize, m.get(1)?.as_u64()?)))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(bad)?;
        if memory.iter().any(|m| m.0 >= plan.program.len()) {
            return Err(bad());
        }
        out.push(RankProfile {
            rank,
            steps: r["steps"].as_u64().ok_or_else(bad)?,
            seconds,
            memory,
            step_seconds: r["step_seconds"].as_f64().ok_or_else(bad)?,
        });
    }
    if out.is_empty() {
        bail!("{} holds no rank's measurements", path.display());
    }
    Ok(out)
}

/// The text comparison: step and peak, per family, and the instructions that took longest.
pub fn summary(plan: &Plan, profiles: &[RankProfile]) -> String {
    let mut o = String::new();
    let est = &plan.estimate;
    let mut steps: Vec<f64> = profiles.iter().map(|p| p.step_seconds).collect();
    steps.sort_by(f64::total_cmp);
    let step = steps.last().copied().unwrap_or(0.0);
    let peak = profiles.iter().flat_map(|p| p.memory.iter().map(|m| m.1)).max().unwrap_or(0);
    let _ = writeln!(
        o,
        "measured  {} rank(s), {} step(s): step {:.3} ms (slowest rank's median) against {:.3} ms estimated ({:+.1}%); \
         peak {} against {}",
        profiles.len(),
        profiles.iter().map(|p| p.steps).max().unwrap_or(0),
        step * 1e3,
        est.step_seconds * 1e3,
        100.0 * (step - est.step_seconds) / est.step_seconds.max(1e-12),
        codegen::fmt_bytes(peak),
        codegen::fmt_bytes(est.peak_bytes_per_rank)
    );
    let seconds = per_instruction(plan, profiles);
    let fams = codegen::figures::families(plan, Some(&seconds));
    let mut rows = vec![];
    for (k, i) in plan.program.iter().enumerate() {
        let Some(m) = seconds[k] else { continue };
        let f = codegen::figures::family(i);
        let name = match i {
            Instr::Op { name, .. } => name.clone(),
            _ => f.clone(),
        };
        rows.push((k, name, f, codegen::figures::step_seconds(plan, i), m));
    }
    let _ = writeln!(o, "per op family (mean over the ranks that run it, per step):");
    let _ = writeln!(
        o,
        "  {:<28} {:>6} {:>12} {:>12} {:>9}",
        "family", "instrs", "estimated ms", "measured ms", "meas/est"
    );
    for f in &fams {
        let (e, m) = (f.estimated, f.measured.unwrap_or(0.0));
        let ratio = if e > 0.0 { format!("{:.2}", m / e) } else { "-".into() };
        let _ = writeln!(o, "  {:<28} {:>6} {:>12.3} {:>12.3} {ratio:>9}", f.family, f.instructions, e * 1e3, m * 1e3);
    }
    rows.sort_by(|a, b| b.4.total_cmp(&a.4));
    let _ = writeln!(o, "longest instructions:");
    for (k, name, f, e, m) in rows.iter().take(12) {
        let _ = writeln!(o, "  #{k:<6} {name} ({f}): estimated {:.3} ms, measured {:.3} ms", e * 1e3, m * 1e3);
    }
    o
}

/// Each instruction's measured seconds per step (the mean over the ranks that ran it), in one
/// pass over the measurements (linear in the ranks).
fn per_instruction(plan: &Plan, profiles: &[RankProfile]) -> Vec<Option<f64>> {
    let mut sums = vec![(0.0f64, 0usize); plan.program.len()];
    for p in profiles {
        for (&k, &s) in &p.seconds {
            if let Some(e) = sums.get_mut(k) {
                e.0 += s;
                e.1 += 1;
            }
        }
    }
    sums.into_iter().map(|(s, n)| (n > 0).then(|| s / n as f64)).collect()
}

/// The profiles as the plan's page draws them beside its estimates.
pub fn figures(plan: &Plan, profiles: &[RankProfile]) -> codegen::figures::Measured {
    codegen::figures::Measured {
        memory: profiles.iter().map(|p| (p.rank, p.memory.iter().map(|m| m.1).collect())).collect(),
        seconds: per_instruction(plan, profiles),
    }
}
