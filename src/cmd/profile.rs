//! `autopar profile`: measures the links of a mesh and one device on the chosen back end and
//! writes a device profile that `autoparallelize --device FILE` uses.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use profiler::profile::{Sample, fit, sweep};
use runtime::comm::{Communicator, ThreadWorld};
use sharding::{DeviceMesh, DeviceProfile, Link, MeshAxes};

use super::run::Backend;

/// Arguments of `autopar profile`.
#[derive(clap::Args, Debug)]
pub struct ProfileArgs {
    /// Where the ranks run: threads of this process, or MPI processes (under mpirun).
    #[arg(long, value_enum, default_value = "threads")]
    pub backend: Backend,
    /// The mesh to measure, e.g. `2x4` (default: one axis of all ranks: the available cores for
    /// threads, the world size under mpirun).
    #[arg(long, value_parser = super::common::parse_mesh)]
    pub mesh: Option<String>,
    /// Largest block per rank in the sweeps (sizes double from 1 KiB; measured largest first, so
    /// the allocator is in the steady state a training step keeps it in). The default reaches
    /// past the caches, so the fit sees both regimes (see the printed segments). Outputs of
    /// 32 MiB and more always come fresh from the kernel, whose page faults then dominate.
    #[arg(long, value_name = "SIZE", default_value = "8MiB", value_parser = parse_sweep_bytes)]
    pub max_bytes: u64,
    /// Timed repetitions per size, 1 to 10000 (the median is kept; one warm-up run is not timed).
    #[arg(long, default_value = "20", value_parser = parse_reps)]
    pub reps: usize,
    /// Print the sweep and the summary as JSON.
    #[arg(long)]
    pub json: bool,
    /// Where to write the profile.
    #[arg(short = 'o', long, default_value = "profile.json")]
    pub out: PathBuf,
}

/// `--max-bytes`: from 1 KiB (the first size of a sweep) to 1 GiB (every rank holds a few blocks
/// of it at once).
fn parse_sweep_bytes(s: &str) -> Result<u64, String> {
    let b = super::common::parse_memory(s)?;
    if !(1 << 10..=1 << 30).contains(&b) {
        return Err("out of range (from 1KiB to 1GiB)".to_string());
    }
    Ok(b)
}

fn parse_reps(s: &str) -> Result<usize, String> {
    super::common::parse_int_in(s, 1, 10_000).map(|n| n as usize)
}

/// The worst relative error of the plain model: one alpha-beta line per collective and axis.
fn one_line_error(samples: &[Sample]) -> f64 {
    let axes = samples.iter().map(|s| s.axis).max().map_or(0, |a| a + 1);
    (0..axes)
        .map(|axis| {
            let mine: Vec<Sample> = samples.iter().filter(|s| s.axis == axis).cloned().collect();
            profiler::profile::worst_error(&mine, &profiler::profile::fit_with(&mine, 1))
        })
        .fold(0.0, f64::max)
}

/// `alpha .. us, beta .. ns/byte (.. GB/s)`, then each segment's figures from its size on.
fn describe(l: &Link) -> String {
    let line = |a: f64, b: f64| format!("alpha {:.2} us, beta {:.3} ns/byte ({:.2} GB/s)", a * 1e6, b * 1e9, 1e-9 / b);
    let mut text = line(l.alpha, l.beta);
    for g in &l.segments {
        text += &format!("; from {}: {}", human_bytes(g.from_bytes), line(g.alpha, g.beta));
    }
    text
}

fn human_bytes(b: f64) -> String {
    if b >= (1 << 20) as f64 { format!("{:.1} MiB", b / (1 << 20) as f64) } else { format!("{:.0} KiB", b / 1024.0) }
}

/// The smallest block the link sweep measures, bytes per rank.
const SMALLEST: usize = 1024;

fn sizes(max: u64) -> Vec<usize> {
    let mut v = vec![];
    let mut s = SMALLEST as u64;
    while s <= max.max(SMALLEST as u64) {
        v.push(s as usize);
        s *= 2;
    }
    v
}

/// What one rank measured: the samples and the fitted link per axis.
type Measured = (Vec<Sample>, Vec<Option<Link>>);

/// Sweeps every axis of size > 1 on this rank; returns the samples and the fitted link per axis.
fn measure(
    comm: &mut dyn Communicator,
    mesh: &DeviceMesh,
    sizes: &[usize],
    reps: usize,
) -> Result<Measured, runtime::comm::CommError> {
    let mut samples = vec![];
    let mut links = vec![];
    for axis in 0..mesh.ndim() {
        if mesh.shape()[axis] == 1 {
            links.push(None);
            continue;
        }
        let s = sweep(comm, mesh, axis, sizes, reps)?;
        links.push(Some(fit(&s)));
        samples.extend(s);
    }
    Ok((samples, links))
}

fn memory_bytes() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|k| k.parse::<u64>().ok()).map(|k| k * 1024))
        })
        .unwrap_or(16 << 30)
}

/// Builds the profile and prints the sweep (rank 0 only under MPI).
fn report(a: &ProfileArgs, mesh: &DeviceMesh, samples: &[Sample], links: &[Option<Link>], backend: &str) -> Result<()> {
    let cpu = runtime::Cpu::new(1)?;
    let rates = profiler::profile::device(&cpu)?;
    let (flops, bandwidth) = (rates.f32_flops, rates.memory_bandwidth);
    let measured: Vec<Link> = links.iter().flatten().cloned().collect();
    let Some(inner) = measured.last().cloned() else {
        bail!("--mesh {mesh}: every axis has size 1; nothing to measure")
    };
    // As many copies of the calibration steps at once as the mesh has ranks, at most one per
    // core of this machine (under MPI: the world's size, capped the same way).
    if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        eprintln!("timing training steps of generated models to fit each op family's cost ...");
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let cal = profiler::calibrate::calibrate(mesh.size().min(cores))?;
    let outer = measured[0].clone();
    let per_axis: Vec<Link> = links.iter().map(|l| l.clone().unwrap_or_else(|| inner.clone())).collect();
    let host = std::fs::read_to_string("/etc/hostname").map(|s| s.trim().to_string()).unwrap_or_default();
    let profile = DeviceProfile {
        name: format!("measured-{backend}"),
        f32_flops: flops,
        f32_flops_exact: flops,
        bf16_flops: rates.bf16_flops,
        flops_efficiency: 1.0,
        memory_bandwidth: bandwidth,
        memory_bytes: memory_bytes(),
        devices_per_node: mesh.size(),
        intra_node: inner,
        inter_node: outer,
        op_seconds: cal.op_seconds,
        conv_flops: Some(rates.conv_flops),
        op_costs: cal.op_costs.clone(),
        source: format!(
            "autopar profile --backend {backend} on {host}, mesh {mesh}: fitted to {} collectives",
            samples.len()
        ),
        mesh_axes: Some(MeshAxes { shape: mesh.shape().to_vec(), links: per_axis.clone() }),
    };
    // The fit prices the single-device training steps it was made on. A plan's run also has the
    // executor's own work per instruction, frees, and collectives that wait for the slower rank:
    // with threads on this machine, the data-parallel and Megatron plans of the calibration
    // models are run, the families they ran fitted again on their instructions' times and scaled
    // to their steps, and their collectives' latency beyond the sweep's lines added to the links.
    let mut profile = profile;
    let anchored: Result<PlanFit, String> = if backend != "threads" {
        Err("threads only".into())
    } else if mesh.size() > cores {
        Err("the mesh has more ranks than this machine has cores".into())
    } else {
        if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
            eprintln!("running the data-parallel and Megatron plans of the generated models on {mesh} ...");
        }
        plan_fit(&profile, mesh)
    };
    if let Ok(f) = &anchored {
        profile.op_costs.extend(f.op_costs.clone());
        profile.intra_node = profile.intra_node.with_latency(f.latency);
        profile.inter_node = profile.inter_node.with_latency(f.latency);
        if let Some(m) = &mut profile.mesh_axes {
            m.links = m.links.iter().map(|l| l.with_latency(f.latency)).collect();
        }
        let mut fixed: Vec<f64> = profile.op_costs.values().map(|c| c.fixed).collect();
        profile.op_seconds = profiler::calibrate::median(&mut fixed);
    }
    std::fs::write(&a.out, serde_json::to_string_pretty(&profile)? + "\n")
        .with_context(|| format!("writing {}", a.out.display()))?;
    let mut worst: f64 = 0.0;
    let mut out = std::io::stdout().lock();
    let mut rows = vec![];
    if !a.json {
        writeln!(
            out,
            "device    f32 {:.1} GFLOP/s, bf16 {:.1} GFLOP/s (one thread, 512^3 products), copy bandwidth {:.1} GB/s, \
             convolution {:.1} GFLOP/s",
            flops / 1e9,
            rates.bf16_flops / 1e9,
            bandwidth / 1e9,
            rates.conv_flops / 1e9,
        )?;
        let mut errs: Vec<f64> = cal.errors.values().copied().collect();
        errs.sort_by(f64::total_cmp);
        writeln!(
            out,
            "ops       {} op families fitted on timed single-device training steps of generated models \
             (each family's median error per instruction: {:.0}% in the median family), fixed costs x{:.2} \
             and per-byte/FLOP costs x{:.2} to price the untimed steps, which the fit then prices: {}",
            cal.op_costs.len(),
            errs.get(errs.len() / 2).copied().unwrap_or(0.0) * 100.0,
            cal.step_scales.0,
            cal.step_scales.1,
            cal.step_errors.iter().map(|(m, e)| format!("{m} {:+.1}%", e * 100.0)).collect::<Vec<_>>().join(", ")
        )?;
        match &anchored {
            Ok(f) => writeln!(
                out,
                "plans     {} of those families fitted again on the instructions of the models' data-parallel \
                 and Megatron plans run on {mesh}, fixed costs x{:.2} and per-byte/FLOP costs x{:.2} to price \
                 their steps; their latency-dominated collectives took {:.2} us more than the links' lines below \
                 (added to the profile's latencies); the profile then prices the plans: {}",
                f.op_costs.len(),
                f.scales.0,
                f.scales.1,
                f.latency * 1e6,
                f.errors.iter().map(|(m, e)| format!("{m} {:+.1}%", e * 100.0)).collect::<Vec<_>>().join(", ")
            )?,
            Err(why) => writeln!(out, "plans     not run ({why}): the single-device fit is kept")?,
        }
        writeln!(
            out,
            "          other ops: {:.2} us per instruction (the median fixed cost) + roofline",
            profile.op_seconds * 1e6
        )?;
        for (axis, l) in links.iter().enumerate() {
            if let Some(l) = l {
                writeln!(out, "axis {axis}    all-reduce {}", describe(l))?;
                if let Some(g) = &l.gather {
                    writeln!(out, "axis {axis}    all-gather {}", describe(g))?;
                }
            }
        }
        writeln!(
            out,
            "{:<11} {:>4} {:>5} {:>10} {:>12} {:>12} {:>7}",
            "collective", "axis", "ranks", "bytes", "measured us", "model us", "error"
        )?;
    }
    for s in samples {
        let Some(l) = &links[s.axis] else { continue };
        let p = s.predicted(l);
        let e = (p - s.seconds) / s.seconds;
        worst = worst.max(e.abs());
        if a.json {
            rows.push(serde_json::json!({"kind": s.kind, "axis": s.axis, "ranks": s.ranks, "bytes": s.bytes,
                "measured_s": s.seconds, "model_s": p, "error": e}));
        } else {
            writeln!(
                out,
                "{:<11} {:>4} {:>5} {:>10} {:>12.1} {:>12.1} {:>+6.1}%",
                s.kind,
                s.axis,
                s.ranks,
                s.bytes,
                s.seconds * 1e6,
                p * 1e6,
                e * 100.0
            )?;
        }
    }
    if a.json {
        let line = serde_json::json!({"samples": rows, "max_error": worst, "one_line_max_error": one_line_error(samples), "f32_flops": flops, "bf16_flops": rates.bf16_flops,
            "memory_bandwidth": bandwidth, "links": per_axis, "profile": a.out.display().to_string(),
            "op_costs": profile.op_costs, "single_device_op_costs": cal.op_costs, "single_device_op_errors": cal.errors, "calibration_step_errors": cal.step_errors,
            "calibration_step_scales": [cal.step_scales.0, cal.step_scales.1],
            "plan_families": anchored.as_ref().ok().map(|f| f.op_costs.keys().collect::<Vec<_>>()),
            "plan_step_scales": anchored.as_ref().ok().map(|f| [f.scales.0, f.scales.1]),
            "plan_collective_latency": anchored.as_ref().ok().map(|f| f.latency),
            "plan_errors": anchored.as_ref().ok().map(|f| &f.errors),
            "plans_not_run": anchored.as_ref().err()});
        writeln!(out, "{line}")?;
    } else {
        writeln!(
            out,
            "fit       the model reproduces every measured time within {:.1}% ({})",
            worst * 100.0,
            if worst <= 0.2 { "within 20%" } else { "NOT within 20%: the links are noisy or not alpha-beta" }
        )?;
        writeln!(
            out,
            "          (one alpha-beta line per collective and axis: within {:.1}%)",
            one_line_error(samples) * 100.0
        )?;
        writeln!(
            out,
            "wrote     {} (use: autopar plan MODEL --device {} --mesh {mesh} ...)",
            a.out.display(),
            a.out.display()
        )?;
    }
    Ok(())
}

/// A calibration model's plan, run on threads: the plan, the median measured step, every op
/// instruction's `(plan index, family, seconds, bytes, FLOPs)` on every rank (the mean over the
/// profiled steps), and every communicating collective's `(measured, priced, priced small)`
/// seconds on every rank (waiting for the other ranks included; the last is the price of the
/// same collective of the sweep's smallest blocks, [`SMALLEST`] bytes per rank).
struct PlanRun {
    name: String,
    plan: plan::Valid,
    step: f64,
    ops: Vec<(usize, String, f64, f64, f64)>,
    collectives: Vec<(f64, f64, f64)>,
}

/// What the plans' runs fitted: the families they ran, the factors their fixed and per-byte/FLOP
/// costs were scaled by to price the plans' steps, the latency every collective had beyond its
/// link's line (seconds; added to the profile's links), and each plan's error as the result
/// prices it.
struct PlanFit {
    op_costs: BTreeMap<String, sharding::OpCost>,
    scales: (f64, f64),
    latency: f64,
    errors: Vec<(String, f64)>,
}

/// Family, bytes and FLOPs of a plan's op instruction on one rank (`None` for other kinds and
/// for parameters, inputs and constants, which are looked up, not run).
fn op_sample(p: &plan::Plan, mesh: &DeviceMesh, i: &plan::Instr) -> Option<(String, f64, f64)> {
    let plan::Instr::Op { op, inputs, input_specs, outputs, local_shapes, .. } = i else { return None };
    if op.is_source() {
        return None;
    }
    let meta =
        |v: &plan::ValueRef| p.graph.g.node_weight(ir::NodeIndex::new(v.node)).and_then(|n| n.outputs.get(v.slot));
    let ins: Vec<ir::TensorMeta> = inputs
        .iter()
        .zip(input_specs)
        .map(|(v, s)| meta(v).map(|m| ir::TensorMeta::new(m.dtype, s.local_shape(&m.shape, mesh))))
        .collect::<Option<_>>()?;
    let outs: Vec<ir::TensorMeta> = outputs
        .iter()
        .zip(local_shapes)
        .map(|(v, shape)| meta(v).map(|m| ir::TensorMeta::new(m.dtype, shape.clone())))
        .collect::<Option<_>>()?;
    let (flops, bytes) = sharding::op_work(op, &ins, &outs);
    Some((sharding::cost_family(op, &ins), bytes, flops))
}

/// Whether a plan's collective moves data between ranks (not a local slice, nor a group of one).
fn communicates(p: &plan::Valid, c: &sharding::Collective) -> bool {
    !c.is_local() && p.mesh().group_size(c.axes()) > 1
}

/// Plans one calibration model on `mesh` with `baseline` and runs it on threads (one kernel
/// thread per rank) as `autopar run` would: about a twentieth of a second of steps by the
/// estimate profiled per instruction (after one warm-up step), then as many timed whole.
fn run_plan(
    m: &profiler::calibrate::Model,
    baseline: plan::Baseline,
    profile: &DeviceProfile,
    mesh: &DeviceMesh,
) -> Result<PlanRun> {
    let name = format!("{} {}", m.name, baseline.name());
    // One pass per step: each instruction's profiled time per step is then its time per run.
    let opts = codegen::plan::PlanOptions {
        baseline,
        compare_baselines: false,
        recompute: codegen::Recompute::Off,
        deadline: None,
        abandon_late: false,
        cache: Default::default(),
        stages: 1,
        microbatches: 1,
        accumulated: 1,
        ..codegen::plan::PlanOptions::default()
    };
    let plan = codegen::plan::plan(&m.tg.graph, mesh, profile, &opts)?;
    let est = plan.estimate.step_seconds;
    let plan = plan.into_valid()?;
    let program = runtime::program::Program::from_valid(&plan, ir::DType::F32)?;
    let steps = (0.05 / est.max(1e-6)).clamp(3.0, 100.0) as u64;
    let states =
        (0..program.ranks()).map(|r| program.init_rank(r, &m.params, &m.feeds)).collect::<Result<Vec<_>, _>>()?;
    let mut opts = runtime::launch::RunOptions {
        until_step: steps + 1,
        threads_per_rank: 1,
        accumulation: Default::default(),
        timeout: Duration::from_secs(120),
        checkpoint: None,
        fault: None,
        run_id: format!("profile-{}", std::process::id()),
        data: None,
        eval: None,
        profile_ops: true,
    };
    let states = runtime::launch::run_threads(&program, states, &opts, &mut |_| {})?;
    let profiles: Vec<runtime::launch::RankProfile> = states.iter().filter_map(|st| st.profile.clone()).collect();
    (opts.until_step, opts.profile_ops) = (2 * steps + 1, false);
    let mut walls = vec![];
    runtime::launch::run_threads(&program, states, &opts, &mut |r| walls.push(r.seconds))?;
    walls.sort_by(f64::total_cmp);
    let step = walls.get(walls.len() / 2).copied().context("no step was run")?;
    let (mut ops, mut collectives) = (vec![], vec![]);
    for p in &profiles {
        for (&at, &t) in &p.seconds {
            match plan.program.get(at) {
                Some(plan::Instr::Collective { collective, seconds, .. }) if communicates(&plan, collective) => {
                    collectives.push((t, *seconds, collective.cost(SMALLEST, plan.mesh())))
                }
                Some(i) => {
                    if let Some((family, bytes, flops)) = op_sample(&plan, plan.mesh(), i) {
                        ops.push((at, family, t, bytes, flops));
                    }
                }
                None => {}
            }
        }
    }
    Ok(PlanRun { name, plan, step, ops, collectives })
}

/// The latency collectives have in a running program beyond their links' lines, from
/// `(measured, priced, priced small)` seconds: the median excess of the latency-dominated ones
/// (priced at most twice the same collective of the sweep's smallest blocks, which the links'
/// latency prices), at least 0; of all of them when none is.
///
/// Larger collectives are left out: inside a run they take anything from a third to three times
/// their swept price (other ranks' compute shares the memory bandwidth, the blocks are colder or
/// warmer than the sweep's loop), so a median over every size lands between the two and moves
/// with how many of each the plans have (0 to 12 us between profiles of one machine).
fn collective_latency(samples: impl Iterator<Item = (f64, f64, f64)>) -> f64 {
    let (mut small, mut all) = (vec![], vec![]);
    for (measured, priced, small_price) in samples {
        all.push(measured - priced);
        if priced <= 2.0 * small_price {
            small.push(measured - priced);
        }
    }
    let excess = if small.is_empty() { &mut all } else { &mut small };
    profiler::calibrate::median(excess).max(0.0)
}

/// Runs the data-parallel and Megatron plans of every calibration model on `mesh`
/// ([`run_plan`]; a plan that cannot be made or run is left out, with a warning) and fits:
/// - the latency a collective has in a running program beyond its link's line (the waiting for
///   the other ranks, a colder cache than the sweep's loop): [`collective_latency`] over the
///   plans' communicating collectives. Megatron's plans have several per layer, in the
///   middle of the step, which the data-parallel plans' gradient reductions alone do not show;
/// - the families the plans ran, on their instructions' times, scaled to the plans' measured
///   steps: each plan is priced as made (its collectives with the latency above, and any other
///   family by the plan's own figures) with the new fit's fixed and per-byte/FLOP parts apart,
///   and [`profiler::calibrate::step_scales`] gives the two factors.
fn plan_fit(profile: &DeviceProfile, mesh: &DeviceMesh) -> Result<PlanFit, String> {
    // The plans price their collectives by the swept links (`mesh` came with the built-in CPU
    // profile's), so the excess measured is over the lines the profile is written with.
    let mesh =
        &DeviceMesh::with_profile(mesh.shape().to_vec(), mesh.names().to_vec(), profile).map_err(|e| e.to_string())?;
    let models = profiler::calibrate::models().map_err(|e| e.to_string())?;
    let mut runs = vec![];
    for m in &models {
        for baseline in [plan::Baseline::Dp, plan::Baseline::Megatron] {
            match run_plan(m, baseline, profile, mesh) {
                Ok(r) => runs.push(r),
                Err(e) => eprintln!("warning: the {} plan of {} on {mesh} is left out: {e:#}", baseline.name(), m.name),
            }
        }
    }
    if runs.is_empty() {
        return Err(format!("no calibration model's plan could be run on {mesh}"));
    }
    let latency = collective_latency(runs.iter().flat_map(|r| r.collectives.iter().copied()));
    let mut by_family: BTreeMap<String, Vec<(f64, f64, f64)>> = BTreeMap::new();
    for r in &runs {
        for (_, f, t, b, fl) in &r.ops {
            by_family.entry(f.clone()).or_default().push((*t, *b, *fl));
        }
    }
    let mut op_costs: BTreeMap<String, sharding::OpCost> =
        by_family.iter().map(|(f, s)| (f.clone(), profiler::calibrate::fit_family(s))).collect();
    // Each plan's estimate split: the new fit's fixed and variable parts of every op it timed,
    // and the rest as the plan priced it (collectives; an op's own collectives: its seconds
    // beyond the old fit's price of it).
    let parts: Vec<(f64, f64, f64, f64)> = runs
        .iter()
        .map(|r| {
            let timed: BTreeMap<usize, (&String, f64, f64)> =
                r.ops.iter().map(|(at, f, _, b, fl)| (*at, (f, *b, *fl))).collect();
            let (mut fixed, mut variable, mut rest) = (0.0, 0.0, 0.0);
            for (at, i) in r.plan.program.iter().enumerate() {
                let seconds = match i {
                    plan::Instr::Op { seconds, .. }
                    | plan::Instr::Collective { seconds, .. }
                    | plan::Instr::Transfer { seconds, .. } => *seconds,
                    _ => 0.0,
                };
                match (timed.get(&at), i) {
                    (Some(&(f, b, fl)), plan::Instr::Op { .. }) => {
                        let new = &op_costs[f];
                        fixed += new.fixed;
                        variable += new.seconds(b, fl) - new.fixed;
                        // Without a fit (nor one it was split from) the op was priced by the
                        // roofline: none of its seconds are collectives of its own.
                        let old = profile.fitted_cost(f).map_or(seconds, |c| c.seconds(b, fl));
                        rest += (seconds - old).max(0.0);
                    }
                    (_, plan::Instr::Collective { collective, .. }) if communicates(&r.plan, collective) => {
                        rest += seconds + latency
                    }
                    _ => rest += seconds,
                }
            }
            (fixed, variable, rest, r.step)
        })
        .collect();
    let (a, b) = profiler::calibrate::step_scales(&parts);
    profiler::calibrate::scale(&mut op_costs, (a, b));
    let errors = runs
        .iter()
        .zip(&parts)
        .map(|(r, &(f, v, rest, wall))| (r.name.clone(), (a * f + b * v + rest - wall) / wall))
        .collect();
    Ok(PlanFit { op_costs, scales: (a, b), latency, errors })
}

/// Runs `autopar profile`.
pub fn run(a: &ProfileArgs) -> Result<()> {
    let sizes = sizes(a.max_bytes);
    let cpu = DeviceProfile::builtin("cpu").context("cpu profile")?;
    match a.backend {
        Backend::Threads => {
            let text = a
                .mesh
                .clone()
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get().max(2)).to_string());
            let mesh = DeviceMesh::parse(&text, &cpu)?;
            // One thread per rank.
            if mesh.size() > super::common::MAX_THREADS {
                bail!("--mesh {mesh}: {} ranks as threads; at most {}", mesh.size(), super::common::MAX_THREADS);
            }
            let comms = ThreadWorld::new(mesh.size(), Duration::from_secs(300));
            let results: Vec<Result<Measured, runtime::comm::CommError>> = std::thread::scope(|s| {
                let hs: Vec<_> = comms
                    .into_iter()
                    .map(|mut c| {
                        let (mesh, sizes) = (&mesh, &sizes);
                        s.spawn(move || measure(&mut c, mesh, sizes, a.reps))
                    })
                    .collect();
                hs.into_iter()
                    .map(|h| {
                        h.join().unwrap_or_else(|_| {
                            Err(runtime::comm::CommError::Bad { rank: 0, why: "a rank panicked".into() })
                        })
                    })
                    .collect()
            });
            let mut first = None;
            for r in results {
                let r = r?;
                first.get_or_insert(r);
            }
            let (samples, links) = first.context("no ranks")?;
            report(a, &mesh, &samples, &links, "threads")
        }
        Backend::Mpi => run_mpi(a, &sizes, &cpu),
        Backend::Nccl => bail!(
            "--backend nccl: profiling NCCL links is not implemented yet; measure with --backend mpi on the same \
             machines, or give the links with --mesh-profile when planning"
        ),
    }
}

#[cfg(not(feature = "mpi"))]
fn run_mpi(_: &ProfileArgs, _: &[usize], _: &DeviceProfile) -> Result<()> {
    bail!("--backend mpi: this autopar was built without MPI support (rebuild with --features mpi)")
}

#[cfg(feature = "mpi")]
fn run_mpi(a: &ProfileArgs, sizes: &[usize], cpu: &DeviceProfile) -> Result<()> {
    let world = runtime::mpi_comm::MpiWorld::init()?;
    let mut comm = world.comm();
    let text = a.mesh.clone().unwrap_or_else(|| comm.size().to_string());
    let mesh = DeviceMesh::parse(&text, cpu)?;
    if mesh.size() != comm.size() {
        bail!("--mesh {mesh} has {} ranks but mpirun started {}", mesh.size(), comm.size());
    }
    let (samples, links) = measure(&mut comm, &mesh, sizes, a.reps)?;
    if comm.rank() == 0 {
        report(a, &mesh, &samples, &links, "mpi")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::collective_latency;

    /// Large collectives' excess, whichever its sign, does not move the latency: only those
    /// whose price is mostly latency count.
    #[test]
    fn latency_from_the_latency_dominated_collectives() {
        let us = 1e-6;
        // (measured, priced, priced small): three small ones 2 us over their price, four large
        // ones far under it and four far over it.
        let mut s =
            vec![(6.0 * us, 4.0 * us, 4.0 * us), (7.0 * us, 5.0 * us, 4.0 * us), (10.0 * us, 8.0 * us, 4.0 * us)];
        s.extend([(80.0 * us, 280.0 * us, 4.0 * us); 4]);
        s.extend([(400.0 * us, 280.0 * us, 4.0 * us); 4]);
        assert!((collective_latency(s.iter().copied()) - 2.0 * us).abs() < 1e-12);
        // Only large ones: their median excess, at least 0.
        assert_eq!(collective_latency([(80.0 * us, 280.0 * us, 4.0 * us)].into_iter()), 0.0);
        let large =
            [(300.0 * us, 280.0 * us, 4.0 * us), (310.0 * us, 280.0 * us, 4.0 * us), (90.0 * us, 60.0 * us, 4.0 * us)];
        assert!((collective_latency(large.into_iter()) - 30.0 * us).abs() < 1e-12);
    }
}
