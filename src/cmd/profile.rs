//! `autopar profile`: measures the links of a mesh and one device on the chosen back end and
//! writes a device profile that `autoparallelize --device FILE` uses.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use runtime::comm::{Communicator, ThreadWorld};
use runtime::profile::{Sample, fit, sweep};
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
            runtime::profile::worst_error(&mine, &runtime::profile::fit_with(&mine, 1))
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

fn sizes(max: u64) -> Vec<usize> {
    let mut v = vec![];
    let mut s = 1024u64;
    while s <= max.max(1024) {
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
    let ctx = kernels::cpu::CpuContext::new(1)?;
    let rates = runtime::profile::device(&ctx)?;
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
    let mut cal = runtime::calibrate::calibrate(mesh.size().min(cores))?;
    let outer = measured[0].clone();
    let per_axis: Vec<Link> = links.iter().map(|l| l.clone().unwrap_or_else(|| inner.clone())).collect();
    let host = std::fs::read_to_string("/etc/hostname").map(|s| s.trim().to_string()).unwrap_or_default();
    let profile = DeviceProfile {
        name: format!("measured-{backend}"),
        f32_flops: flops,
        f32_flops_exact: flops,
        bf16_flops: rates.bf16_flops,
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
    // with threads on this machine, the data-parallel plans of the calibration models are run
    // and the fit scaled to price them.
    let mut profile = profile;
    let trainer_scales = cal.step_scales;
    let anchored = if backend == "threads" && mesh.size() <= cores {
        if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
            eprintln!("running the data-parallel plans of the generated models on {mesh} ...");
        }
        // Each family's cost as the plans' runs measured it (the executor's own work per
        // instruction included), then the whole scaled to their steps.
        let runs = run_plans(&profile, mesh)?;
        let mut by_family: BTreeMap<String, Vec<(f64, f64, f64)>> = BTreeMap::new();
        for r in &runs {
            for (f, t, b, fl) in &r.ops {
                by_family.entry(f.clone()).or_default().push((*t, *b, *fl));
            }
        }
        for (f, samples) in &by_family {
            cal.op_costs.insert(f.clone(), runtime::calibrate::fit_family(samples));
        }
        let mut fixed: Vec<f64> = cal.op_costs.values().map(|c| c.fixed).collect();
        fixed.sort_by(f64::total_cmp);
        cal.op_seconds = fixed.get(fixed.len() / 2).copied().unwrap_or(cal.op_seconds);
        profile.op_costs = cal.op_costs.clone();
        profile.op_seconds = cal.op_seconds;
        let parts = anchors(&profile, mesh, &runs);
        let (sa, sb) = runtime::calibrate::step_scales(&parts.iter().map(|p| p.1).collect::<Vec<_>>());
        cal.rescale(sa, sb);
        profile.op_costs = cal.op_costs.clone();
        profile.op_seconds = cal.op_seconds;
        Some(
            parts
                .iter()
                .map(|(name, (f, v, rest, wall))| (name.clone(), (sa * f + sb * v + rest - wall) / wall))
                .collect::<Vec<_>>(),
        )
    } else {
        None
    };
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
            "ops       {} op families fitted on timed training steps of generated models (each family's \
             median error per instruction: {:.0}% in the median family); other ops {:.2} us per \
             instruction (the median fixed cost) + roofline; fixed costs x{:.2} and per-byte/FLOP \
             costs x{:.2} to price the untimed steps, which the fit then prices: {}",
            cal.op_costs.len(),
            errs.get(errs.len() / 2).copied().unwrap_or(0.0) * 100.0,
            cal.op_seconds * 1e6,
            trainer_scales.0,
            trainer_scales.1,
            cal.step_errors.iter().map(|(m, e)| format!("{m} {:+.1}%", e * 100.0)).collect::<Vec<_>>().join(", ")
        )?;
        match &anchored {
            Some(errs) => writeln!(
                out,
                "plans     the fit then scaled to the data-parallel plans of those models run on {mesh} (fixed costs \
                 x{:.2}, per-byte/FLOP costs x{:.2} in all), whose estimates are then: {}",
                cal.step_scales.0,
                cal.step_scales.1,
                errs.iter().map(|(m, e)| format!("{m} {:+.1}%", e * 100.0)).collect::<Vec<_>>().join(", ")
            )?,
            None => writeln!(
                out,
                "plans     not run: the fit is not scaled to plans' runs ({})",
                if backend == "threads" {
                    "the mesh has more ranks than this machine has cores"
                } else {
                    "threads only"
                }
            )?,
        }
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
            "op_costs": cal.op_costs, "op_errors": cal.errors, "calibration_step_errors": cal.step_errors,
            "calibration_step_scales": [cal.step_scales.0, cal.step_scales.1], "plan_errors": anchored});
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

/// One calibration model's data-parallel plan on `mesh`, priced by a profile and run on threads:
/// `(name, (fixed, variable, rest, measured))`, where the estimate is `fixed + variable + rest`:
/// the fitted families' fixed costs, their per-byte and per-FLOP costs, and the rest (the
/// collectives, ops of no fitted family).
type Anchor = (String, (f64, f64, f64, f64));

/// A calibration model's data-parallel plan and what its run on threads measured: the median
/// step, and every op instruction's `(family, seconds, bytes, FLOPs)` on every rank (the mean
/// over the profiled steps).
struct PlanRun {
    model: runtime::calibrate::Model,
    step: f64,
    ops: Vec<(String, f64, f64, f64)>,
}

fn dp_options() -> codegen::plan::PlanOptions {
    codegen::plan::PlanOptions {
        baseline: plan::Baseline::Dp,
        compare_baselines: false,
        checkpoint: false,
        ..codegen::plan::PlanOptions::default()
    }
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

/// Runs the data-parallel plan of every calibration model on `mesh`'s threads (one kernel thread
/// per rank), as `autopar run` would: about a twentieth of a second of steps by `profile`'s
/// estimate profiled per instruction, then as many timed whole. A model whose plan cannot be
/// made is left out.
fn run_plans(profile: &DeviceProfile, mesh: &DeviceMesh) -> Result<Vec<PlanRun>> {
    let mut out = vec![];
    for m in runtime::calibrate::models()? {
        let Ok(plan) = codegen::plan::plan(&m.tg.graph, mesh, profile, &dp_options()) else { continue };
        let est = plan.estimate.step_seconds;
        let Ok(valid) = plan.into_valid() else { continue };
        let program = runtime::dist::Program::from_valid(&valid, ir::DType::F32)?;
        let steps = (0.05 / est.max(1e-6)).clamp(3.0, 100.0) as u64;
        let states =
            (0..program.ranks()).map(|r| program.init_rank(r, &m.params, &m.feeds)).collect::<Result<Vec<_>, _>>()?;
        // Steps timed per instruction (the first warms up and is left out), then as many timed
        // whole, which nothing slows.
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
        let Some(&step) = walls.get(walls.len() / 2) else { continue };
        let mut ops = vec![];
        for p in &profiles {
            for (&at, &t) in &p.seconds {
                if let Some((family, bytes, flops)) =
                    valid.program.get(at).and_then(|i| op_sample(&valid, valid.mesh(), i))
                {
                    ops.push((family, t, bytes, flops));
                }
            }
        }
        out.push(PlanRun { model: m, step, ops });
    }
    Ok(out)
}

/// Every run plan priced again by `profile`, split into its fixed, variable and other parts.
fn anchors(profile: &DeviceProfile, mesh: &DeviceMesh, runs: &[PlanRun]) -> Vec<Anchor> {
    // The same profile with only the fixed costs, and with only the per-byte and per-FLOP ones.
    let only = |fixed: bool| {
        let mut p = profile.clone();
        for c in p.op_costs.values_mut() {
            if fixed {
                (c.per_byte, c.per_flop) = (0.0, 0.0);
            } else {
                c.fixed = 0.0;
            }
        }
        p
    };
    let (fixed_only, variable_only) = (only(true), only(false));
    runs.iter()
        .filter_map(|r| {
            let est = |p: &DeviceProfile| {
                codegen::plan::plan(&r.model.tg.graph, mesh, p, &dp_options()).ok().map(|pl| pl.estimate.step_seconds)
            };
            let (e, ef, ev) = (est(profile)?, est(&fixed_only)?, est(&variable_only)?);
            let rest = ef + ev - e;
            Some((r.model.name.clone(), (ef - rest, ev - rest, rest, r.step)))
        })
        .collect()
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
