//! Compiling a validated plan into a [`Program`]: value ids become slots, every instruction of
//! the plan an instruction of its stage's code ([`Exec`]), each op its local kernel.

use std::collections::HashMap;

use ir::{DType, NodeIndex, Op, TensorMeta};
use plan::{Instr, Plan, ValueRef};
use sharding::{DeviceMesh, Local, ShardingSpec};

use crate::error::DistError;
use crate::program::{Exec, InputInfo, Kernel, Program, Resident, constant_slots};

impl Program {
    /// Compiles `plan` on `mesh` to compute in `float` (see the module docs): the plan's
    /// instructions in order, then the graph's outputs, the updates and frozen parameters each
    /// stage hands back to storage, and the values summed over microbatches.
    pub(crate) fn compile(plan: &Plan, mesh: DeviceMesh, float: DType) -> Result<Program, DistError> {
        let g = if float == DType::F32 {
            std::borrow::Cow::Borrowed(&plan.graph)
        } else {
            std::borrow::Cow::Owned(plan.graph.with_float_type(float).map_err(|e| bad(format!("graph: {e}")))?)
        };
        let mut c = Compiler::new(plan, &g, &mesh, float);
        for (at, ins) in plan.program.iter().enumerate() {
            c.instr(at, ins)?;
        }
        let outputs = c.outputs()?;
        let (updates, kept) = c.storage_returns()?;
        for (o, code) in c.origin.iter_mut().zip(&c.codes) {
            o.resize(code.len(), plan.program.len().saturating_sub(1));
        }
        let accumulate = c.accumulated(&outputs);
        let summed_after = c.summed_after(&accumulate);
        let Compiler { codes, slot_names, resident, constants, inputs, segments, send_bytes, origin, .. } = c;
        Ok(Program {
            seed: plan.options.seed,
            dropout: true,
            plan_hash: storage_hash(&plan.model.hash, &mesh, &resident),
            bounds: crate::bounds::index_bounds(&g),
            streamed: Default::default(),
            eval_marks: Default::default(),
            stages: plan.stages(),
            microbatches: plan.microbatches.max(1),
            segments,
            origin,
            steps: plan.steps(),
            send_bytes,
            // Whether blocks arrive in the order sent matters only to a back end without tags,
            // which runs only these schedules (`needs_buffered_sends`).
            schedule: plan.pipeline.as_ref().map(|p| {
                let kind = p.schedule.kind;
                let untagged = matches!(kind, plan::ScheduleKind::Sequential | plan::ScheduleKind::Gpipe);
                (kind, untagged && plan::schedule::timeline(plan).is_ok_and(|t| t.in_order))
            }),
            accumulate,
            summed_after,
            constant_slot: constant_slots(&codes, slot_names.len()),
            code: codes,
            slot_names,
            resident,
            constants,
            inputs,
            outputs,
            updates,
            kept,
            estimated_peak: plan.estimate.peak_bytes_per_rank,
            model_hash: plan.model.hash.clone(),
            mesh,
        })
    }
}

fn bad(m: String) -> DistError {
    DistError::Plan(m)
}

/// A graph output: name, slot, layout, global shape.
type Output = (String, usize, ShardingSpec, Vec<usize>);

/// What compiling a plan builds up, instruction by instruction.
struct Compiler<'p> {
    plan: &'p Plan,
    g: &'p ir::Graph,
    mesh: &'p DeviceMesh,
    float: DType,
    stages: usize,
    slots: HashMap<ValueRef, usize>,
    slot_names: Vec<ValueRef>,
    codes: Vec<Vec<Exec>>,
    resident: Vec<Resident>,
    constants: Vec<(ir::Tensor, ShardingSpec)>,
    inputs: Vec<InputInfo>,
    /// The layout each value is written in.
    out_specs: HashMap<ValueRef, ShardingSpec>,
    segments: Vec<HashMap<plan::Segment, std::ops::Range<usize>>>,
    /// Per stage, the segment its code is in.
    current: Vec<Option<plan::Segment>>,
    send_bytes: Vec<usize>,
    /// Transfers are numbered in program order: with the microbatch, a message's tag.
    transfers: u64,
    origin: Vec<Vec<usize>>,
}

impl<'p> Compiler<'p> {
    fn new(plan: &'p Plan, g: &'p ir::Graph, mesh: &'p DeviceMesh, float: DType) -> Self {
        let stages = plan.stages();
        Compiler {
            plan,
            g,
            mesh,
            float,
            stages,
            slots: HashMap::new(),
            slot_names: vec![],
            codes: vec![vec![]; stages],
            resident: vec![],
            constants: vec![],
            inputs: vec![],
            out_specs: HashMap::new(),
            segments: vec![HashMap::new(); stages],
            current: vec![None; stages],
            send_bytes: vec![0; stages],
            transfers: 0,
            origin: vec![vec![]; stages],
        }
    }

    fn slot_of(&mut self, id: &ValueRef) -> usize {
        let names = &mut self.slot_names;
        *self.slots.entry(*id).or_insert_with(|| {
            names.push(*id);
            names.len() - 1
        })
    }

    fn node(&self, i: usize) -> Result<&'p ir::Node, DistError> {
        self.g.g.node_weight(NodeIndex::new(i)).ok_or_else(|| bad(format!("no node %{i}")))
    }

    /// Each stage's code is in segment order (validated): a segment is one range.
    fn extend(&mut self, s: usize, seg: plan::Segment) -> Result<(), DistError> {
        let at = self.codes[s].len();
        let r = self.segments[s].entry(seg).or_insert(at..at);
        if self.current[s] != Some(seg) && r.end != at {
            return Err(DistError::Plan(format!("stage {s}'s {seg:?} is not contiguous")));
        }
        self.current[s] = Some(seg);
        r.end = at + 1;
        Ok(())
    }

    /// Plan instruction `at`: what it adds to each stage's code.
    fn instr(&mut self, at: usize, ins: &Instr) -> Result<(), DistError> {
        let stages = self.stages;
        // What this instruction adds to each stage's code comes from it.
        for (o, c) in self.origin.iter_mut().zip(&self.codes) {
            o.resize(c.len(), at.saturating_sub(1));
        }
        let stage = match ins {
            Instr::Op { stage, .. } | Instr::Collective { stage, .. } | Instr::Free { stage, .. } => *stage,
            Instr::Transfer { from, .. } => *from,
        };
        if stage >= stages {
            return Err(bad(format!("stage {stage} of {stages}")));
        }
        if let Some(seg) = ins.segment_on(stage) {
            self.extend(stage, seg)?;
        }
        if let Instr::Transfer { to, .. } = ins
            && let Some(seg) = ins.segment_on(*to)
            && *to < stages
        {
            self.extend(*to, seg)?;
        }
        match ins {
            Instr::Op { .. } => self.op(stage, ins),
            Instr::Collective { input, output, collective, to, .. } => {
                self.out_specs.insert(*output, to.clone());
                let e = Exec::Collective {
                    input: self.slot_of(input),
                    output: self.slot_of(output),
                    c: collective.clone(),
                };
                self.codes[stage].push(e);
                Ok(())
            }
            Instr::Free { values, .. } => {
                let slots = values.iter().map(|v| self.slot_of(v)).collect();
                self.codes[stage].push(Exec::Free { slots });
                Ok(())
            }
            Instr::Transfer { value, spec, from, to, .. } => self.transfer(ins, value, spec, *from, *to),
        }
    }

    /// An op instruction: a parameter or state (storage), an input's or a constant's block, or
    /// a kernel.
    fn op(&mut self, stage: usize, ins: &Instr) -> Result<(), DistError> {
        let Instr::Op { node: id, name, outputs, output_specs, .. } = ins else {
            return Err(bad("not an op instruction".into()));
        };
        let n = self.node(*id)?;
        for (o, s) in outputs.iter().zip(output_specs) {
            self.out_specs.insert(*o, s.clone());
        }
        let (Some(out0), Some(spec0), Some(meta0)) = (outputs.first(), output_specs.first(), n.outputs.first()) else {
            return Err(bad(format!("node {name} has no output")));
        };
        let slot0 = self.slot_of(out0);
        let e = match &n.op {
            Op::Param { name: p } | Op::State { name: p } => {
                self.resident.push(Resident {
                    name: p.clone(),
                    meta: meta0.clone(),
                    spec: spec0.clone(),
                    is_state: matches!(n.op, Op::State { .. }),
                    stage,
                });
                Exec::Storage { slot: slot0, name: p.clone() }
            }
            Op::Input { name: i } => {
                // A recomputation may read the input's block again.
                let index = match self.inputs.iter().position(|x: &InputInfo| &x.name == i) {
                    Some(k) => k,
                    None => {
                        self.inputs.push(InputInfo { name: i.clone(), meta: meta0.clone(), spec: spec0.clone() });
                        self.inputs.len() - 1
                    }
                };
                Exec::Input { slot: slot0, index }
            }
            Op::Constant(t) => {
                self.constants.push((t.clone(), spec0.clone()));
                Exec::Constant { slot: slot0, index: self.constants.len() - 1 }
            }
            op => self.kernel(ins, n, op)?,
        };
        self.codes[stage].push(e);
        Ok(())
    }

    /// A kernel instruction: the plan's local op for the graph's float type, checked against
    /// the graph's node, with its local input and output shapes.
    fn kernel(&mut self, ins: &Instr, n: &ir::Node, op: &Op) -> Result<Exec, DistError> {
        let Instr::Op {
            node: id,
            name,
            op: local_op,
            outputs,
            output_specs,
            input_specs,
            inputs: ins_ids,
            local,
            local_shapes,
            ..
        } = ins
        else {
            return Err(bad("not an op instruction".into()));
        };
        let (g, mesh) = (self.g, self.mesh);
        let global_ins: Vec<TensorMeta> =
            g.node_inputs(NodeIndex::new(*id)).iter().map(|v| g.meta(*v).clone()).collect();
        if global_ins.len() != input_specs.len() {
            return Err(bad(format!("node {name}: {} inputs, {} specs", global_ins.len(), input_specs.len())));
        }
        if local_op.name() != op.name() {
            return Err(bad(format!("node {name} is {}, not {}", op.name(), local_op.name())));
        }
        // The plan's local op, for the graph's float type.
        let local_op =
            if self.float == DType::F32 { local_op.clone() } else { local_op.clone().with_float_type(self.float) };
        let local_ins: Vec<TensorMeta> = input_specs
            .iter()
            .zip(&global_ins)
            .map(|(s, m)| TensorMeta::new(m.dtype, s.local_shape(&m.shape, mesh)))
            .collect();
        let local_outs = local_shapes.clone();
        if let Local::MaskedGather { axes }
        | Local::MaskedScatter { axes }
        | Local::SplitSoftmax { axes }
        | Local::QueryBlocks { axes } = local
        {
            mesh.check_axes(axes).map_err(|m| bad(format!("node {name}: {m}")))?;
        }
        let spec0 = output_specs.first().ok_or_else(|| bad(format!("node {name} has no output")))?;
        let kernel = compile_kernel(local_op, local, &global_ins, &n.outputs, &local_ins, &local_outs, spec0)
            .map_err(|m| bad(format!("node {name}: {m}")))?;
        Ok(Exec::Op {
            id: *id,
            node: name.clone(),
            op: op.name(),
            kernel,
            inputs: ins_ids.iter().map(|v| self.slot_of(v)).collect(),
            outputs: outputs.iter().map(|v| self.slot_of(v)).collect(),
            shapes: local_outs,
        })
    }

    /// A pipeline transfer: a send on stage `from`'s code, a receive on `to`'s, and the bytes
    /// `from` sends each step.
    fn transfer(
        &mut self,
        ins: &Instr,
        value: &ValueRef,
        spec: &ShardingSpec,
        from: usize,
        to: usize,
    ) -> Result<(), DistError> {
        let stages = self.stages;
        let slot = self.slot_of(value);
        let id = self.transfers;
        self.transfers += 1;
        self.codes[from].push(Exec::Send { slot, to, id });
        let m = self
            .g
            .g
            .node_weight(NodeIndex::new(value.node))
            .and_then(|n| n.outputs.get(value.slot))
            .ok_or_else(|| bad(format!("transfer of unknown value {value}")))?;
        let meta = TensorMeta::new(m.dtype, spec.local_shape(&m.shape, self.mesh));
        let times = if ins.once_per_step() { 1 } else { self.plan.microbatches.max(1) };
        self.send_bytes[from] += (meta.bytes() + 8 * meta.shape.len() + 1024) * times;
        let code = self.codes.get_mut(to).ok_or_else(|| bad(format!("stage {to} of {stages}")))?;
        code.push(Exec::Recv { slot, from, meta, id });
        Ok(())
    }

    /// The graph's outputs, each in the layout it is written in.
    fn outputs(&mut self) -> Result<Vec<Output>, DistError> {
        let g = self.g;
        let mut outputs = vec![];
        for (name, v) in &g.outputs {
            let id = ValueRef::of(*v);
            let spec = self
                .out_specs
                .get(&id)
                .cloned()
                .ok_or_else(|| bad(format!("output {name} ({id}) is never written")))?;
            outputs.push((name.clone(), self.slot_of(&id), spec, g.meta(*v).shape.clone()));
        }
        Ok(outputs)
    }

    /// Per stage, the slots whose values become storage after a step: the updated parameters
    /// and state, and the frozen ones read back as they were.
    #[allow(clippy::type_complexity)]
    fn storage_returns(&mut self) -> Result<(Vec<Vec<(String, usize)>>, Vec<Vec<(String, usize)>>), DistError> {
        let g = self.g;
        let stage_of_storage: HashMap<String, usize> =
            self.resident.iter().map(|r| (r.name.clone(), r.stage)).collect();
        let mut updates = vec![vec![]; self.stages];
        let mut updated = std::collections::HashSet::new();
        for (p, v) in &g.updates {
            let (Op::Param { name } | Op::State { name }) = &g.node(*p).op else {
                return Err(bad(format!("update of non-storage node %{}", p.index())));
            };
            let stage = stage_of_storage.get(name.as_str()).copied().unwrap_or(0);
            updates[stage].push((name.clone(), self.slot_of(&ValueRef::of(*v))));
            updated.insert(name.clone());
        }
        let mut kept = vec![vec![]; self.stages];
        let frozen: Vec<(String, usize)> =
            self.resident.iter().filter(|r| !updated.contains(&r.name)).map(|r| (r.name.clone(), r.stage)).collect();
        for (name, stage) in frozen {
            let n = g
                .params
                .iter()
                .chain(&g.states)
                .find(|&&n| matches!(&g.node(n).op, Op::Param { name: p } | Op::State { name: p } if *p == name));
            let n = n.ok_or_else(|| bad(format!("storage {name} has no node")))?;
            kept[stage].push((name, self.slot_of(&ValueRef::new(n.index(), 0))));
        }
        Ok((updates, kept))
    }

    /// The slots summed over microbatches: the plan's accumulated values and, with more than
    /// one microbatch, the outputs computed per microbatch (their mean is reported; those the
    /// update phase computes once per step, the learning rate and the gradient norm, are not).
    fn accumulated(&mut self, outputs: &[Output]) -> Vec<usize> {
        let plan = self.plan;
        let mut accumulate: Vec<usize> = plan.accumulate.iter().map(|v| self.slot_of(v)).collect();
        if plan.microbatches > 1 {
            let once: std::collections::HashSet<usize> = plan
                .program
                .iter()
                .filter_map(|i| match i {
                    Instr::Op { node, .. } if i.once_per_step() => Some(*node),
                    _ => None,
                })
                .collect();
            for ((_, v), o) in self.g.outputs.iter().zip(outputs) {
                if !once.contains(&v.node.index()) {
                    accumulate.push(o.1);
                }
            }
        }
        accumulate.sort_unstable();
        accumulate.dedup();
        accumulate
    }

    /// Per stage and step, the positions in `accumulate` of the values the step's microbatch
    /// adds into their sums when the step ends ([`Plan::summed_after_steps`]).
    fn summed_after(&mut self, accumulate: &[usize]) -> Vec<Vec<Vec<usize>>> {
        let plan = self.plan;
        let summed = plan.summed();
        (0..plan.stages())
            .map(|stage| {
                plan.summed_after_steps(stage, &summed)
                    .into_iter()
                    .map(|values| {
                        values.iter().filter_map(|v| accumulate.binary_search(&self.slot_of(v)).ok()).collect()
                    })
                    .collect()
            })
            .collect()
    }
}

/// The kernel of an op instruction: `op` is the plan's local op (attributes already local),
/// `out_spec` its first output's layout.
fn compile_kernel(
    op: Op,
    local: &Local,
    global_ins: &[TensorMeta],
    global_outs: &[TensorMeta],
    local_ins: &[TensorMeta],
    local_outs: &[Vec<usize>],
    out_spec: &ShardingSpec,
) -> Result<Kernel, String> {
    Ok(match local {
        Local::Same => match op {
            Op::Dropout(attrs) => {
                let shape = global_outs.first().map(|m| m.shape.clone()).ok_or("dropout without an output")?;
                if out_spec.dims().len() != shape.len() {
                    return Err(format!("dropout output layout `{out_spec}` for a tensor of {shape:?}"));
                }
                Kernel::Dropout { attrs, shape, spec: out_spec.clone() }
            }
            op => Kernel::Same(op),
        },
        Local::MaskedGather { axes } => {
            let Op::Gather { axis } = op else { return Err(format!("masked gather on {}", op.name())) };
            let dim = |m: Option<&TensorMeta>| m.and_then(|m| m.shape.get(axis).copied());
            let (Some(rows), Some(total)) = (dim(local_ins.first()), dim(global_ins.first())) else {
                return Err(format!("gather axis {axis} is not a dim of its table"));
            };
            Kernel::MaskedGather { op: Op::Gather { axis }, axis, axes: axes.clone(), rows, total }
        }
        Local::MaskedScatter { axes } => {
            let Op::GatherGrad { axis, .. } = op else { return Err(format!("masked scatter on {}", op.name())) };
            // The table's global shape: the node's output.
            let shape = global_outs.first().map(|m| m.shape.as_slice()).unwrap_or_default();
            let (Some(&rows), Some(&total)) = (local_outs.first().and_then(|s| s.get(axis)), shape.get(axis)) else {
                return Err(format!("scatter axis {axis} is not a dim of its table"));
            };
            let pre = shape[..axis].iter().product();
            Kernel::MaskedScatter { op, axes: axes.clone(), rows, total, pre }
        }
        Local::SplitSoftmax { axes } => {
            let (axis, log) = match op {
                Op::Softmax { axis } => (axis, false),
                Op::LogSoftmax { axis } => (axis, true),
                _ => return Err(format!("split softmax on {}", op.name())),
            };
            Kernel::SplitSoftmax { axis, log, axes: axes.clone() }
        }
        Local::QueryBlocks { axes } => {
            if !matches!(op, Op::Attention(_) | Op::AttentionGrad(_)) {
                return Err(format!("query blocks on {}", op.name()));
            }
            let rows = local_ins.first().and_then(|q| q.shape.get(2)).copied().ok_or("attention without queries")?;
            Kernel::QueryBlock { op, axes: axes.clone(), rows }
        }
    })
}

/// [`Program::plan_hash`]: FNV-1a over the fields, each followed by a separator.
fn storage_hash(model_hash: &str, mesh: &DeviceMesh, resident: &[Resident]) -> String {
    let mut text = format!("{model_hash}\n{mesh}\n");
    for r in resident {
        text.push_str(&format!("{}\t{}\t{}\n", r.name, r.meta, r.spec));
    }
    plan::fnv(&text)
}
