//! Pipeline stages: a plan whose mesh's outermost axis is cut into stages, each stage an SPMD
//! program over the other axes running its part of the training graph.
//!
//! [`stage`] takes a plan made on the mesh with axis 0 of size 1 (every layout is then one of
//! the stage's submesh, and never splits over the stage axis) and places it on the whole mesh:
//!
//! 1. **Forward cut.** The forward nodes (the ancestors of the loss) that are not sources are
//!    cut, in the plan's topological order, into contiguous ranges of equal estimated seconds,
//!    one per stage; a forward op weighs its own seconds and those of the gradient ops derived
//!    from it (named `grad/<op>/…` by the training graph) and of the updates of the parameters
//!    it is the first to read.
//! 2. **The rest follows.** A node outside the forward (gradients, loss-scaled seeds) runs on the
//!    earliest stage among its computed inputs: a gradient op reads its forward op's
//!    activations, so it lands on that op's stage. Sources (parameters, optimizer state,
//!    constants, inputs) and nodes reading only sources go to the earliest stage reading them;
//!    an optimizer update runs on its parameter's stage (the next step's storage is there).
//! 3. **Transfers.** A conversion runs on the stage of the op it converts for. A value read on a
//!    stage that does not hold it is sent there, in its layout, right before the first reader
//!    ([`Instr::Transfer`]); the graph's outputs are sent to every stage at the end, so every
//!    rank returns them. Frees are then placed per stage.
//!
//! Any placement computes the same values (transfers move blocks unchanged); the cut only
//! decides how balanced the stages are. Invariant: the program's instructions keep the plan's
//! order, each stage's program is that order restricted to the stage, and every value a stage
//! reads is written on it or transferred to it before.

use std::collections::{HashMap, HashSet};

use ir::{NodeIndex, Op};
use sharding::{DeviceMesh, ShardingSpec};

use crate::plan::{Instr, MeshInfo, ParamShard, Pipeline, Plan, StageEstimate, ValueRef};
use crate::{Error, Result, fmt_bytes};

/// The mesh a pipelined plan is solved on: `mesh` with axis 0 of size 1.
pub fn stage_mesh(mesh: &DeviceMesh, stages: usize) -> Result<DeviceMesh> {
    let bad = |why: String| Error::Pipeline(why);
    if stages < 2 {
        return Err(bad(format!("{stages} stages: a pipeline has at least 2")));
    }
    if mesh.shape().first() != Some(&stages) {
        return Err(bad(format!(
            "{stages} stages on mesh {mesh}: the stages are the coordinates of the outermost mesh axis, so it must \
             have size {stages} (e.g. --mesh {stages}x2 for {stages} stages of 2 devices)"
        )));
    }
    let mut shape = mesh.shape().to_vec();
    shape[0] = 1;
    Ok(DeviceMesh::new(shape, mesh.names().to_vec(), mesh.links().to_vec())?)
}

/// Places `plan` (made on [`stage_mesh`]) on `mesh` as `stages` pipeline stages (see the module
/// docs); every stage's peak must fit `budget`.
pub fn stage(plan: Plan, mesh: &DeviceMesh, stages: usize, budget: u64) -> Result<Plan> {
    let g = &plan.graph;
    let n_nodes = g.g.node_count();
    let node = |i: usize| g.node(NodeIndex::new(i));
    let is_source = |i: usize| node(i).op.is_source();
    // Program node ids are topological (the plan's graph is canonical).
    let inputs_of: Vec<Vec<usize>> =
        (0..n_nodes).map(|i| g.node_inputs(NodeIndex::new(i)).iter().map(|v| v.node.index()).collect()).collect();
    let mut consumers: Vec<Vec<usize>> = vec![vec![]; n_nodes];
    for (i, ins) in inputs_of.iter().enumerate() {
        for &j in ins {
            consumers[j].push(i);
        }
    }
    let Some(loss) = g.outputs.iter().find(|(n, _)| n == "loss").or(g.outputs.first()).map(|(_, v)| v.node.index())
    else {
        return Err(Error::Pipeline("the graph has no output to pipeline towards".into()));
    };
    let mut forward = vec![false; n_nodes];
    let mut stack = vec![loss];
    while let Some(n) = stack.pop() {
        if !forward[n] {
            forward[n] = true;
            stack.extend(&inputs_of[n]);
        }
    }
    // 1. The forward cut, by estimated seconds (a floor keeps free ops from piling up).
    let mut seconds = vec![0.0f64; n_nodes];
    for ins in &plan.program {
        if let Instr::Op { node, seconds: s, .. } = ins {
            seconds[*node] += s;
        }
    }
    let fwd: Vec<usize> = (0..n_nodes).filter(|&i| forward[i] && !is_source(i)).collect();
    if fwd.len() < stages {
        return Err(Error::Pipeline(format!("the model has {} forward ops: too few for {stages} stages", fwd.len())));
    }
    // A forward op's weight: its seconds and those of the gradient ops the training graph
    // derived from it (named `grad/<op>/...`) and of the updates of the parameters it reads
    // first, which will run on its stage.
    let index_of: HashMap<&str, usize> = fwd.iter().map(|&i| (node(i).name.as_str(), i)).collect();
    let mut extra = vec![0.0f64; n_nodes];
    for i in (0..n_nodes).filter(|&i| !forward[i]) {
        let name = &node(i).name;
        let owner = if let Some(rest) = name.strip_prefix("grad/") {
            rest.match_indices('/').map(|(p, _)| &rest[..p]).find_map(|cand| index_of.get(cand).copied())
        } else if name.starts_with("update/") {
            inputs_of[i]
                .iter()
                .filter(|&&j| matches!(node(j).op, Op::Param { .. }))
                .find_map(|&j| consumers[j].iter().copied().filter(|&c| forward[c]).min())
        } else {
            None
        };
        if let Some(o) = owner {
            extra[o] += seconds[i];
        }
    }
    let weight: Vec<f64> = fwd.iter().map(|&i| seconds[i] + extra[i] + 1e-9).collect();
    let total: f64 = weight.iter().sum();
    let mut stage_of: Vec<Option<usize>> = vec![None; n_nodes];
    let mut acc = 0.0;
    for (k, &i) in fwd.iter().enumerate() {
        let mid = acc + weight[k] / 2.0;
        acc += weight[k];
        // Stages in order, none empty: at least one op per later stage stays.
        let by_cost = ((mid / total) * stages as f64) as usize;
        let prev = if k == 0 { 0 } else { stage_of[fwd[k - 1]].unwrap_or(0) };
        // The earliest stage that still leaves one op to each later stage, and the latest that
        // leaves none empty before.
        let earliest = stages.saturating_sub(fwd.len() - k);
        let latest = if k == 0 { 0 } else { prev + 1 };
        stage_of[i] = Some(by_cost.min(stages - 1).max(prev).max(earliest).min(latest));
    }
    // 2. The rest: update ops wait for their parameters' stages (an update writing a parameter
    // and its optimizer state goes with the parameter).
    let mut update_node: HashMap<usize, usize> = HashMap::new();
    for (p, v) in &g.updates {
        let e = update_node.entry(v.node.index()).or_insert(p.index());
        if matches!(node(p.index()).op, Op::Param { .. }) {
            *e = p.index();
        }
    }
    for i in 0..n_nodes {
        if stage_of[i].is_some() || is_source(i) || update_node.contains_key(&i) {
            continue;
        }
        stage_of[i] = inputs_of[i].iter().filter(|&&j| !is_source(j)).filter_map(|&j| stage_of[j]).min();
    }
    let by_consumers = |stage_of: &mut Vec<Option<usize>>, skip_updates: bool| {
        for i in (0..n_nodes).rev() {
            if stage_of[i].is_some() && !is_source(i) {
                continue;
            }
            let s = consumers[i]
                .iter()
                .filter(|c| !(skip_updates && update_node.contains_key(c)))
                .filter_map(|&c| stage_of[c])
                .min();
            stage_of[i] = s.or(stage_of[i]);
        }
    };
    by_consumers(&mut stage_of, true);
    for (&u, &p) in &update_node {
        stage_of[u] = Some(stage_of[p].unwrap_or(0));
    }
    by_consumers(&mut stage_of, false);
    let stage_of: Vec<usize> = stage_of.into_iter().map(|s| s.unwrap_or(0)).collect();

    // 3. Stages of instructions, transfers, frees.
    // The update part of a microbatched plan: from its `boundary`-th instruction (frees aside).
    let boundary = plan.program[..plan.update_from.min(plan.program.len())]
        .iter()
        .filter(|i| !matches!(i, Instr::Free { .. }))
        .count();
    let microbatches = plan.microbatches;
    let mut program: Vec<Instr> = plan.program.into_iter().filter(|i| !matches!(i, Instr::Free { .. })).collect();
    let mut next_op_stage = 0;
    for ins in program.iter_mut().rev() {
        match ins {
            Instr::Op { node, stage, .. } => {
                *stage = stage_of[*node];
                next_op_stage = *stage;
            }
            Instr::Collective { stage, .. } => *stage = next_op_stage,
            Instr::Free { .. } | Instr::Transfer { .. } => {}
        }
    }
    let meta = |v: &ValueRef| g.node(NodeIndex::new(v.node)).outputs[v.slot].clone();
    let transfer = |value: ValueRef, spec: &ShardingSpec, from: usize, to: usize| {
        let m = meta(&value);
        let bytes = spec.local_bytes(&m.shape, mesh, m.dtype.size());
        Instr::Transfer { value, spec: spec.clone(), from, to, bytes, seconds: mesh.time(&[0], bytes as f64, true) }
    };
    let mut out = Vec::with_capacity(program.len() * 2);
    let mut home: HashMap<ValueRef, (usize, ShardingSpec)> = HashMap::new();
    let mut held: HashSet<(usize, ValueRef)> = HashSet::new();
    let mut boundary_out = None;
    for (k, ins) in program.into_iter().enumerate() {
        if k == boundary {
            boundary_out = Some(out.len());
        }
        let (stage, reads): (usize, Vec<ValueRef>) = match &ins {
            Instr::Op { stage, inputs, .. } => (*stage, inputs.clone()),
            Instr::Collective { stage, input, .. } => (*stage, vec![*input]),
            Instr::Free { .. } | Instr::Transfer { .. } => unreachable!("removed or not yet placed"),
        };
        for r in reads {
            if !held.contains(&(stage, r)) {
                let (from, spec) = home
                    .get(&r)
                    .cloned()
                    .ok_or_else(|| Error::Internal(format!("pipelining: {r} is read before it is written")))?;
                out.push(transfer(r, &spec, from, stage));
                held.insert((stage, r));
            }
        }
        match &ins {
            Instr::Op { stage, outputs, output_specs, .. } => {
                for (o, s) in outputs.iter().zip(output_specs) {
                    home.insert(*o, (*stage, s.clone()));
                    held.insert((*stage, *o));
                }
            }
            Instr::Collective { stage, output, to, .. } => {
                home.insert(*output, (*stage, to.clone()));
                held.insert((*stage, *output));
            }
            _ => {}
        }
        out.push(ins);
    }
    let boundary_out = boundary_out.unwrap_or(out.len());
    for (_, v) in &g.outputs {
        let r = ValueRef::of(*v);
        let (from, spec) =
            home.get(&r).cloned().ok_or_else(|| Error::Internal(format!("pipelining: output {r} is never written")))?;
        for to in (0..stages).filter(|&s| !held.contains(&(s, r))) {
            out.push(transfer(r, &spec, from, to));
        }
    }
    let keep = crate::checkpoint::kept_to_the_end(g);
    let program = crate::checkpoint::insert_frees(out, &keep);
    let update_from = crate::microbatch::position_of_nth_non_free(&program, boundary_out);

    // Estimates.
    let compute_of: HashMap<&str, f64> =
        plan.estimate.per_op.iter().map(|o| (o.node.as_str(), o.compute_seconds)).collect();
    let mut per_stage = vec![];
    let mut step = 0.0;
    let mut transfer_total = 0.0;
    for s in 0..stages {
        let mem = crate::memory::simulate_stage(g, mesh, &program, s)?;
        // The values this stage accumulates over microbatches are held once more meanwhile.
        let mine: Vec<ValueRef> = plan
            .accumulate
            .iter()
            .copied()
            .filter(|v| program[..update_from].iter().any(|i| writes_on(i, v, s)))
            .collect();
        let acc = if microbatches > 1 { crate::microbatch::accumulated_bytes_in(g, mesh, &program, &mine) } else { 0 };
        let (mut ops, mut compute, mut comm, mut recv) = (0, 0.0, 0.0, 0.0);
        let mut names = vec![];
        for (k, ins) in program.iter().enumerate() {
            // The microbatch part runs once per microbatch.
            let times = if k < update_from { microbatches as f64 } else { 1.0 };
            match ins {
                Instr::Op { stage, node, name, seconds, .. } if *stage == s => {
                    ops += 1;
                    // An op's seconds are its compute and its own collectives.
                    let c = compute_of.get(name.as_str()).copied().unwrap_or(*seconds).min(*seconds);
                    compute += c * times;
                    comm += (seconds - c) * times;
                    if forward[*node] && !is_source(*node) {
                        names.push(&g.node(NodeIndex::new(*node)).name);
                    }
                }
                Instr::Collective { stage, seconds, .. } if *stage == s => comm += seconds * times,
                Instr::Transfer { to, seconds, .. } if *to == s => recv += seconds * times,
                _ => {}
            }
        }
        step += compute + comm + recv;
        transfer_total += recv;
        per_stage.push(StageEstimate {
            ops,
            first: names.first().map_or(String::new(), |n| n.to_string()),
            last: names.last().map_or(String::new(), |n| n.to_string()),
            compute_seconds: compute,
            comm_seconds: comm,
            transfer_seconds: recv,
            peak_bytes: if acc > 0 {
                mem.peak.max(crate::memory::simulate_stage(g, mesh, &program[..update_from], s)?.peak + acc)
            } else {
                mem.peak
            },
            resident_bytes: mem.resident,
        });
    }
    let peak = per_stage.iter().map(|s| s.peak_bytes).max().unwrap_or(0);
    if peak > budget {
        let worst = per_stage.iter().position(|s| s.peak_bytes == peak).unwrap_or(0);
        return Err(Error::Pipeline(format!(
            "stage {worst} needs {} per rank, over the budget of {}; use more stages, a larger mesh per stage or \
             --memory {}",
            fmt_bytes(peak),
            fmt_bytes(budget),
            fmt_bytes(peak + peak / 100 + 1)
        )));
    }
    let params = plan
        .params
        .into_iter()
        .map(|p| ParamShard {
            offsets: (0..mesh.size()).map(|r| p.spec.offsets(&p.shape, mesh, r)).collect(),
            stage: stage_of[p.node],
            ..p
        })
        .collect();
    let mut estimate = plan.estimate;
    estimate.step_seconds = step;
    estimate.comm_seconds += transfer_total;
    estimate.peak_bytes_per_rank = peak;
    estimate.resident_bytes_per_rank = per_stage.iter().map(|s| s.resident_bytes).max().unwrap_or(0);
    let mut options = plan.options;
    options.budget_bytes = budget;
    Ok(Plan {
        mesh: MeshInfo { shape: mesh.shape().to_vec(), names: mesh.names().to_vec(), links: mesh.links().to_vec() },
        options,
        pipeline: Some(Pipeline { stages, microbatches, per_stage }),
        update_from,
        params,
        program,
        estimate,
        ..plan
    })
}

/// Whether `ins` writes `v` on stage `s`.
fn writes_on(ins: &Instr, v: &ValueRef, s: usize) -> bool {
    match ins {
        Instr::Op { outputs, stage, .. } => *stage == s && outputs.contains(v),
        Instr::Collective { output, stage, .. } => *stage == s && output == v,
        _ => false,
    }
}
