//! Lowering (the last pass): the solver's chosen strategies into one SPMD program with the
//! conversions between layouts, frees and the recomputation that makes it fit
//! ([`crate::checkpoint`]), and the plan's estimates.

use std::collections::{BTreeMap, HashMap};

use ::plan::{
    Baseline, CheckpointReport, CollectiveSummary, Estimate, Instr, MeshInfo, ModelInfo, OpCost, OptionsInfo,
    ParamShard, Phase, Plan, SolverInfo, VERSION, ValueRef,
};
use ir::{Graph, NodeIndex, Op};
use sharding::{DeviceMesh, DeviceProfile, ShardingSpec};

use crate::Result;
use crate::options::PlanOptions;
use crate::problem::Built;

/// How lowering recomputes activations ([`crate::checkpoint::fit`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Recomputation {
    /// Never.
    Never,
    /// What makes the program fit the budget.
    ToFit,
    /// Every chain stage.
    Every,
}

/// `bf16` or `fp16` for a mixed-precision training graph (one holding 16-bit values), else the
/// graph's float type.
pub fn precision_of(g: &Graph) -> &'static str {
    let mut wide = "f32";
    for n in g.g.node_weights() {
        for m in &n.outputs {
            match m.dtype {
                ir::DType::BF16 => return "bf16",
                ir::DType::F16 => return "fp16",
                ir::DType::F64 => wide = "f64",
                _ => {}
            }
        }
    }
    wide
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn lower(
    g: &Graph,
    mesh: &DeviceMesh,
    profile: &DeviceProfile,
    opts: &PlanOptions,
    b: &Built,
    sol: &[usize],
    peak: u64,
    solver_info: SolverInfo,
    how: Recomputation,
) -> Result<Plan> {
    let pos: HashMap<NodeIndex, usize> = b.nodes.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let picked = b.chosen(sol);
    let chosen = |n: NodeIndex| picked[pos[&n]];
    let keep = crate::checkpoint::kept_to_the_end(g);
    let mut program = vec![];
    let mut per_op = vec![];
    let mut colls: BTreeMap<String, CollectiveSummary> = BTreeMap::new();
    let (mut compute, mut comm) = (0.0, 0.0);
    let mut temp = 0usize;
    for &n in &b.nodes {
        let node = g.node(n);
        let s = chosen(n);
        let mut inputs = vec![];
        let mut conv_seconds = 0.0;
        for (k, v) in g.node_inputs(n).into_iter().enumerate() {
            let from = &chosen(v.node).outputs[v.slot];
            let to = &s.inputs[k];
            let mut cur = ValueRef::of(v);
            if from != to {
                let meta = g.meta(v);
                let path = b.converter.convert(&meta.shape, meta.dtype.size(), from, to)?;
                for step in &path.steps {
                    temp += 1;
                    let out = ValueRef::of(v).with_copy(temp);
                    let e = colls.entry(step.collective.kind().to_string()).or_insert_with(|| CollectiveSummary {
                        kind: step.collective.kind().to_string(),
                        count: 0,
                        bytes: 0,
                        seconds: 0.0,
                    });
                    e.count += 1;
                    e.bytes += step.bytes;
                    e.seconds += step.cost;
                    conv_seconds += step.cost;
                    let prev_from = program_spec_before(&path.from, &path.steps, step);
                    program.push(Instr::Collective {
                        input: cur,
                        output: out,
                        collective: step.collective.clone(),
                        from: prev_from,
                        to: step.after.clone(),
                        bytes: step.bytes,
                        seconds: step.cost,
                        stage: 0,
                        phase: Phase::Forward,
                        chunk: 0,
                    });
                    cur = out;
                }
            }
            inputs.push(cur);
        }
        for (c, bytes) in &s.collectives {
            let e = colls.entry(c.kind().to_string()).or_insert_with(|| CollectiveSummary {
                kind: c.kind().to_string(),
                count: 0,
                bytes: 0,
                seconds: 0.0,
            });
            e.count += 1;
            e.bytes += bytes;
            e.seconds += c.cost(*bytes, mesh);
        }
        compute += s.compute_seconds;
        comm += s.comm_seconds + conv_seconds;
        per_op.push(OpCost {
            node: node.name.clone(),
            op: node.op.name().to_string(),
            strategy: s.name.clone(),
            compute_seconds: s.compute_seconds,
            comm_seconds: s.comm_seconds + conv_seconds,
        });
        let outputs: Vec<ValueRef> = (0..node.outputs.len()).map(|k| ValueRef::new(n.index(), k)).collect();
        let local_shapes: Vec<Vec<usize>> =
            s.outputs.iter().zip(&node.outputs).map(|(sp, m)| sp.local_shape(&m.shape, mesh)).collect();
        let local_ins: Vec<ir::TensorMeta> = s
            .inputs
            .iter()
            .zip(g.node_inputs(n))
            .map(|(sp, v)| {
                let m = g.meta(v);
                ir::TensorMeta::new(m.dtype, sp.local_shape(&m.shape, mesh))
            })
            .collect();
        program.push(Instr::Op {
            node: n.index(),
            name: node.name.clone(),
            op: sharding::strategy::local_op(&node.op, &local_ins, &local_shapes),
            strategy: s.name.clone(),
            inputs: inputs.clone(),
            input_specs: s.inputs.clone(),
            outputs,
            output_specs: s.outputs.clone(),
            local_shapes,
            local: s.local.clone(),
            seconds: s.seconds(),
            recompute: false,
            stage: 0,
            phase: Phase::Forward,
            chunk: 0,
        });
    }
    // Frees after last reads, and recomputation of activations when the plan exceeds its budget.
    let (program, checkpoint) = if how != Recomputation::Never {
        crate::checkpoint::fit(g, mesh, program, &keep, opts.budget, how == Recomputation::Every)?
    } else {
        let p = crate::checkpoint::insert_frees(program, &keep);
        let peak = ::plan::memory::simulate(g, mesh, &p)?.peak;
        (p, CheckpointReport { peak_before: peak, peak_after: peak, ..Default::default() })
    };
    let recompute_seconds = checkpoint.extra_seconds;
    let mut params = vec![];
    let mut resident = 0u64;
    for &n in &b.nodes {
        let node = g.node(n);
        let name = match &node.op {
            Op::Param { name } | Op::State { name } => name.clone(),
            Op::Constant(_) => {
                resident += chosen(n).memory_bytes;
                continue;
            }
            _ => continue,
        };
        let s = chosen(n);
        resident += s.memory_bytes;
        let m = &node.outputs[0];
        params.push(ParamShard {
            name,
            node: n.index(),
            shape: m.shape.clone(),
            dtype: m.dtype.name().to_string(),
            spec: s.outputs[0].clone(),
            local_shape: s.outputs[0].local_shape(&m.shape, mesh),
            offsets: ::plan::listed_offsets(&s.outputs[0], &m.shape, mesh),
            stage: 0,
        });
    }
    let memory = ::plan::memory::simulate(g, mesh, &program)?;
    Ok(Plan {
        version: VERSION,
        model: ModelInfo { name: g.name.clone(), hash: g.fingerprint(), source: None, source_hash: None },
        mesh: MeshInfo { shape: mesh.shape().to_vec(), names: mesh.names().to_vec(), links: mesh.links().to_vec() },
        device: profile.name.clone(),
        options: OptionsInfo {
            budget_bytes: opts.budget,
            strategy: opts.baseline,
            time_limit_seconds: opts.time_limit.as_secs_f64(),
            precision: precision_of(g).to_string(),
            min_gain: if opts.baseline == Baseline::Auto && opts.compare_baselines { opts.min_gain } else { 0.0 },
            recompute: opts.recompute,
            seed: 0,
        },
        graph: g.clone(),
        microbatches: 1,
        accumulate: vec![],
        pipeline: None,
        params,
        program,
        estimate: Estimate {
            step_seconds: compute + comm + recompute_seconds,
            compute_seconds: compute,
            comm_seconds: comm,
            recompute_seconds,
            checkpoint,
            peak_bytes_per_rank: memory.peak,
            solver_peak_bytes_per_rank: peak,
            resident_bytes_per_rank: resident,
            memory: Default::default(),
            per_op,
            collectives: colls.into_values().collect(),
            model_flops: 0.0,
            mfu: 0.0,
        },
        solver: solver_info,
    })
}

/// The spec before `step` on a conversion path.
fn program_spec_before(from: &ShardingSpec, steps: &[sharding::Step], step: &sharding::Step) -> ShardingSpec {
    let i = steps.iter().position(|s| std::ptr::eq(s, step)).unwrap_or(0);
    if i == 0 { from.clone() } else { steps[i - 1].after.clone() }
}
