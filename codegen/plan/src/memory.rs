//! Memory of a lowered program on one rank: the liveness walk behind the plan's estimate.
//!
//! The walk follows the program exactly as the runtime executes it, with the same accounting:
//! - parameters, optimizer state and constants (their local blocks) are resident when the step
//!   starts;
//! - an `op` instruction adds the bytes of its outputs (an `input` adds its local batch block;
//!   sources that are resident add nothing), a `collective` adds the bytes of the converted copy
//!   it writes, and a `free` subtracts the bytes of the values it names (a parameter or state
//!   freed after its last read gives its storage up to its updated value);
//! - the peak is taken after every instruction that adds bytes, i.e. while an op's inputs and
//!   outputs are both held.
//!
//! Every rank holds blocks of the same shapes (uneven splits are rejected), so one walk gives
//! the figure of every rank of a stage. With pipeline stages a stage's walk takes its own
//! instructions only: a transfer adds the bytes of the value it receives (a send adds nothing;
//! the sender frees the value after its last read, the send included). Kernel scratch space (e.g. a convolution's column buffer) is outside
//! this accounting, on both sides.

use std::collections::HashMap;

use ir::{Graph, NodeIndex, Op};
use sharding::DeviceMesh;

use crate::{Error, Instr, Location, Problem, Problems, Result, ValueRef};

/// The memory profile of a program (bytes per rank).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryProfile {
    /// Parameters, optimizer state and constants held when the step starts.
    pub resident: u64,
    /// The largest number of bytes held at once.
    pub peak: u64,
    /// Index of the instruction at which the peak is first reached (`None`: before the first).
    pub peak_at: Option<usize>,
}

/// Walks `program` (see the module docs) on every stage and returns the profile of the stage
/// with the highest peak. `graph` is the plan's graph (node `%i` is index `i`).
pub fn simulate(graph: &Graph, mesh: &DeviceMesh, program: &[Instr]) -> Result<MemoryProfile> {
    let stages: std::collections::BTreeSet<usize> = program
        .iter()
        .flat_map(|i| match i {
            Instr::Op { stage, .. } | Instr::Collective { stage, .. } | Instr::Free { stage, .. } => [*stage, *stage],
            Instr::Transfer { from, to, .. } => [*from, *to],
        })
        .collect();
    let mut best: Option<MemoryProfile> = None;
    for s in stages {
        let m = simulate_stage(graph, mesh, program, s)?;
        if best.as_ref().is_none_or(|b| m.peak > b.peak) {
            best = Some(m);
        }
    }
    Ok(best.unwrap_or(MemoryProfile { resident: 0, peak: 0, peak_at: None }))
}

/// Walks the instructions of one pipeline stage (see the module docs); instruction indices
/// are the program's.
pub fn simulate_stage(graph: &Graph, mesh: &DeviceMesh, program: &[Instr], stage: usize) -> Result<MemoryProfile> {
    let bad = |k: usize, why: String| Error::Invalid(Problems(vec![Problem { at: Location::Instr(k), why }]));
    let mut bytes: HashMap<ValueRef, u64> = HashMap::new();
    let mut resident = 0u64;
    let program: Vec<(usize, &Instr)> = program.iter().enumerate().filter(|(_, i)| i.runs_on(stage)).collect();
    for &(_, ins) in &program {
        if let Instr::Op { node, outputs, local_shapes, .. } = ins {
            let n = graph.g.node_weight(NodeIndex::new(*node));
            if let Some(n) = n
                && matches!(n.op, Op::Param { .. } | Op::State { .. } | Op::Constant(_))
            {
                for (o, shape) in outputs.iter().zip(local_shapes) {
                    let b = (shape.iter().product::<usize>() * n.outputs[0].dtype.size()) as u64;
                    resident += b;
                    bytes.insert(*o, b);
                }
            }
        }
    }
    let (mut live, mut peak, mut peak_at) = (resident, resident, None);
    for &(k, ins) in &program {
        let added = match ins {
            Instr::Op { node, outputs, local_shapes, .. } => {
                let n = graph.g.node_weight(NodeIndex::new(*node)).ok_or_else(|| bad(k, format!("no node %{node}")))?;
                if matches!(n.op, Op::Param { .. } | Op::State { .. } | Op::Constant(_)) {
                    0
                } else {
                    let mut sum = 0;
                    for ((o, shape), m) in outputs.iter().zip(local_shapes).zip(&n.outputs) {
                        let b = (shape.iter().product::<usize>() * m.dtype.size()) as u64;
                        bytes.insert(*o, b);
                        sum += b;
                    }
                    sum
                }
            }
            Instr::Collective { input, output, to, .. } => {
                let m = graph
                    .g
                    .node_weight(NodeIndex::new(input.node))
                    .and_then(|x| x.outputs.get(input.slot))
                    .ok_or_else(|| bad(k, format!("unknown value {input}")))?;
                let b = (to.local_shape(&m.shape, mesh).iter().product::<usize>() * m.dtype.size()) as u64;
                bytes.insert(*output, b);
                b
            }
            Instr::Transfer { value, spec, to, .. } if *to == stage => {
                let m = graph
                    .g
                    .node_weight(NodeIndex::new(value.node))
                    .and_then(|x| x.outputs.get(value.slot))
                    .ok_or_else(|| bad(k, format!("unknown value {value}")))?;
                let b = (spec.local_shape(&m.shape, mesh).iter().product::<usize>() * m.dtype.size()) as u64;
                bytes.insert(*value, b);
                b
            }
            Instr::Transfer { .. } => 0,
            Instr::Free { values, .. } => {
                for v in values {
                    let b = bytes.remove(v).ok_or_else(|| bad(k, format!("frees {v}, which is not held")))?;
                    live = live.saturating_sub(b);
                }
                0
            }
        };
        if added > 0 {
            live += added;
            if live > peak {
                peak = live;
                peak_at = Some(k);
            }
        }
    }
    Ok(MemoryProfile { resident, peak, peak_at })
}
