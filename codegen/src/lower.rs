//! Lowering (the last pass): the solver's chosen strategies into one SPMD program with the
//! conversions between layouts, frees and the recomputation that makes it fit
//! ([`crate::checkpoint`]), and the plan's estimates.

use std::collections::{BTreeMap, HashMap, HashSet};

use ::plan::{
    Baseline, CheckpointReport, CollectiveSummary, Estimate, Instr, MeshInfo, ModelInfo, OpCost, OptionsInfo,
    ParamShard, Phase, Plan, SolverInfo, VERSION, ValueRef,
};
use ir::{Graph, NodeIndex, Op};
use sharding::{DeviceMesh, DeviceProfile, ShardingSpec, Strategy};

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
pub fn precision_of(g: &Graph) -> ::plan::Precision {
    use ::plan::Precision;
    let mut wide = Precision::F32;
    for n in g.g.node_weights() {
        for m in &n.outputs {
            match m.dtype {
                ir::DType::BF16 => return Precision::Bf16,
                ir::DType::F16 => return Precision::Fp16,
                ir::DType::F64 => wide = Precision::F64,
                _ => {}
            }
        }
    }
    wide
}

/// Lowers the solution `sol` of `b` into a plan: the program of every node's op after the
/// conversions of its inputs ([`Emitted`]), then frees and the recomputation `how` asks for,
/// then the parameters' shards, then the estimates. `peak` is the solution's peak in the
/// solver's model.
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
    let choice = Choice::new(b, sol);
    let keep = crate::checkpoint::kept_to_the_end(g);
    let Emitted { program, per_op, collectives, compute, comm } = Emitted::new(g, mesh, b, &choice)?;
    let (program, checkpoint) = recompute(g, mesh, program, &keep, opts.budget, how)?;
    let recompute_seconds = checkpoint.extra_seconds;
    let (params, resident) = param_shards(g, mesh, b, &choice);
    let memory = ::plan::memory::simulate(g, mesh, &program)?;
    let overlapped = if opts.overlap { crate::microbatch::overlapped(g, &program) } else { 0.0 };
    Ok(Plan {
        version: VERSION,
        model: ModelInfo { name: g.name.clone(), hash: g.fingerprint(), source: None, source_hash: None },
        mesh: MeshInfo { shape: mesh.shape().to_vec(), names: mesh.names().to_vec(), links: mesh.links().to_vec() },
        device: profile.name.clone(),
        options: OptionsInfo {
            budget_bytes: opts.budget,
            strategy: opts.baseline,
            time_limit_seconds: opts.time_limit.as_secs_f64(),
            precision: precision_of(g),
            min_gain: if opts.baseline == Baseline::Auto && opts.compare_baselines { opts.min_gain } else { 0.0 },
            recompute: opts.recompute,
            seed: 0,
            overlap: opts.overlap,
        },
        graph: g.clone(),
        microbatches: 1,
        accumulate: vec![],
        pipeline: None,
        params,
        program,
        estimate: Estimate {
            step_seconds: compute + comm + recompute_seconds - overlapped,
            compute_seconds: compute,
            comm_seconds: comm,
            overlapped_comm_seconds: overlapped,
            recompute_seconds,
            checkpoint,
            peak_bytes_per_rank: memory.peak,
            solver_peak_bytes_per_rank: peak,
            resident_bytes_per_rank: resident,
            memory: Default::default(),
            per_op,
            collectives: collectives.into_values().collect(),
            model_flops: 0.0,
            mfu: 0.0,
        },
        solver: solver_info,
    })
}

/// The strategy a solution chose for each graph node of a built problem.
struct Choice<'a> {
    pos: HashMap<NodeIndex, usize>,
    picked: Vec<&'a Strategy>,
}

impl<'a> Choice<'a> {
    fn new(b: &'a Built, sol: &[usize]) -> Self {
        Choice { pos: b.nodes.iter().enumerate().map(|(i, &n)| (n, i)).collect(), picked: b.chosen(sol) }
    }

    fn of(&self, n: NodeIndex) -> &'a Strategy {
        self.picked[self.pos[&n]]
    }
}

/// The program before frees and recomputation (every node's op in the problem's order, after
/// the collectives converting its inputs into the layouts it reads), with its costs.
struct Emitted {
    program: Vec<Instr>,
    per_op: Vec<OpCost>,
    /// Per collective kind: how often, how many bytes and seconds (conversions and ops' own).
    collectives: BTreeMap<String, CollectiveSummary>,
    /// Sum of the ops' compute seconds.
    compute: f64,
    /// Sum of the ops' own communication and their conversions' seconds.
    comm: f64,
}

impl Emitted {
    fn new(g: &Graph, mesh: &DeviceMesh, b: &Built, choice: &Choice) -> Result<Emitted> {
        let mut e = Emitted { program: vec![], per_op: vec![], collectives: BTreeMap::new(), compute: 0.0, comm: 0.0 };
        // Conversion copies are numbered across the program.
        let mut temp = 0usize;
        for &n in &b.nodes {
            let node = g.node(n);
            let s = choice.of(n);
            let mut inputs = vec![];
            let mut conv_seconds = 0.0;
            for (k, v) in g.node_inputs(n).into_iter().enumerate() {
                let from = &choice.of(v.node).outputs[v.slot];
                inputs.push(e.convert(g, b, v, from, &s.inputs[k], &mut temp, &mut conv_seconds)?);
            }
            for (c, bytes) in &s.collectives {
                e.count(c.kind().to_string(), *bytes, c.cost(*bytes, mesh));
            }
            e.compute += s.compute_seconds;
            e.comm += s.comm_seconds + conv_seconds;
            e.per_op.push(OpCost {
                node: node.name.clone(),
                op: node.op.name().to_string(),
                strategy: s.name.clone(),
                compute_seconds: s.compute_seconds,
                comm_seconds: s.comm_seconds + conv_seconds,
            });
            e.program.push(op_instr(g, mesh, n, s, inputs));
        }
        Ok(e)
    }

    /// Emits the collectives converting `v` from layout `from` to `to` (none when they are the
    /// same), adding their seconds to `conv_seconds`; returns the converted value.
    #[allow(clippy::too_many_arguments)]
    fn convert(
        &mut self,
        g: &Graph,
        b: &Built,
        v: ir::Value,
        from: &ShardingSpec,
        to: &ShardingSpec,
        temp: &mut usize,
        conv_seconds: &mut f64,
    ) -> Result<ValueRef> {
        let mut cur = ValueRef::of(v);
        if from == to {
            return Ok(cur);
        }
        let meta = g.meta(v);
        let path = b.converter.convert(&meta.shape, meta.dtype.size(), from, to)?;
        for step in &path.steps {
            *temp += 1;
            let out = ValueRef::of(v).with_copy(*temp);
            self.count(step.collective.kind().to_string(), step.bytes, step.cost);
            *conv_seconds += step.cost;
            let prev_from = program_spec_before(&path.from, &path.steps, step);
            self.program.push(Instr::Collective {
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
        Ok(cur)
    }

    /// Counts one collective of `kind` in the summary.
    fn count(&mut self, kind: String, bytes: usize, seconds: f64) {
        let e = self.collectives.entry(kind.clone()).or_insert_with(|| CollectiveSummary {
            kind,
            count: 0,
            bytes: 0,
            seconds: 0.0,
        });
        e.count += 1;
        e.bytes += bytes;
        e.seconds += seconds;
    }
}

/// Node `n`'s op under strategy `s` on its local shapes, reading `inputs`.
fn op_instr(g: &Graph, mesh: &DeviceMesh, n: NodeIndex, s: &Strategy, inputs: Vec<ValueRef>) -> Instr {
    let node = g.node(n);
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
    Instr::Op {
        node: n.index(),
        name: node.name.clone(),
        op: sharding::strategy::local_op(&node.op, &local_ins, &local_shapes),
        strategy: s.name.clone(),
        inputs,
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
    }
}

/// Frees after last reads, and recomputation of activations as `how` asks (when the program
/// exceeds `budget`, or of every chain stage): the recompute pass ([`crate::checkpoint`]).
fn recompute(
    g: &Graph,
    mesh: &DeviceMesh,
    program: Vec<Instr>,
    keep: &HashSet<ValueRef>,
    budget: u64,
    how: Recomputation,
) -> Result<(Vec<Instr>, CheckpointReport)> {
    if how != Recomputation::Never {
        crate::checkpoint::fit(g, mesh, program, keep, budget, how == Recomputation::Every)
    } else {
        let p = crate::checkpoint::insert_frees(program, keep);
        let peak = ::plan::memory::simulate(g, mesh, &p)?.peak;
        Ok((p, CheckpointReport { peak_before: peak, peak_after: peak, ..Default::default() }))
    }
}

/// The shards of the parameters and optimizer state, and the bytes per rank resident all step
/// (theirs and the constants').
fn param_shards(g: &Graph, mesh: &DeviceMesh, b: &Built, choice: &Choice) -> (Vec<ParamShard>, u64) {
    let mut params = vec![];
    let mut resident = 0u64;
    for &n in &b.nodes {
        let node = g.node(n);
        let name = match &node.op {
            Op::Param { name } | Op::State { name } => name.clone(),
            Op::Constant(_) => {
                resident += choice.of(n).memory_bytes;
                continue;
            }
            _ => continue,
        };
        let s = choice.of(n);
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
    (params, resident)
}

/// The spec before `step` on a conversion path.
fn program_spec_before(from: &ShardingSpec, steps: &[sharding::Step], step: &sharding::Step) -> ShardingSpec {
    let i = steps.iter().position(|s| std::ptr::eq(s, step)).unwrap_or(0);
    if i == 0 { from.clone() } else { steps[i - 1].after.clone() }
}
