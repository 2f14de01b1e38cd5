//! Communication overlapped with compute, in the estimate ([`crate::OptionsInfo::overlap`]).
//!
//! One rank (a stage's ranks) runs two streams, as Megatron-LM and PyTorch DDP/FSDP do on GPUs:
//!
//! - the **compute stream** runs ops and the collectives on the critical path (tensor-parallel
//!   conversions, an op's own collectives) in program order, each when its inputs are ready;
//! - the **communication stream** runs the collectives that [`on_comm_stream`] marks, in
//!   program order, each starting when its input is ready and the stream is free; the first
//!   consumer of its output waits for it.
//!
//! Marked: the prologue's collectives (ZeRO's weight gathers, which then overlap the forward)
//! and the conversions for the update part (the data-parallel reduction of weight gradients,
//! which overlaps the rest of the backward: a bucket per gradient, in the order they are made).
//! [`play`] gives the makespan; what it saves over running everything in turn is the
//! overlapped communication ([`Played::overlapped`]). Pipeline transfers overlap in the
//! schedule's play ([`crate::schedule::timeline`]). The runtime still runs collectives where the
//! program has them (blocking on the threads back end): overlap changes the estimate only,
//! never what a plan computes.

use std::collections::HashMap;

use crate::{Instr, ValueRef};

/// The result of [`play`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Played {
    /// The makespan: from the first instruction's start to the last one's end.
    pub seconds: f64,
    /// The instructions' seconds summed (the estimate without overlap).
    pub work: f64,
}

impl Played {
    /// Communication seconds hidden behind compute: `work - seconds` (never negative).
    pub fn overlapped(&self) -> f64 {
        (self.work - self.seconds).max(0.0)
    }
}

/// Plays `instrs` (in order; `true` beside an instruction: on the communication stream) on two
/// streams (see the module docs). Transfers and frees take no time here; values nobody in
/// `instrs` writes are ready at the start.
pub fn play<'a>(instrs: impl IntoIterator<Item = (&'a Instr, bool)>) -> Played {
    let mut ready: HashMap<ValueRef, f64> = HashMap::new();
    let (mut compute, mut comm, mut work) = (0.0f64, 0.0f64, 0.0f64);
    let mut end = 0.0f64;
    for (ins, on_comm) in instrs {
        let at = |ready: &HashMap<ValueRef, f64>, v: &ValueRef| ready.get(v).copied().unwrap_or(0.0);
        match ins {
            Instr::Op { inputs, outputs, seconds, .. } => {
                let start = inputs.iter().map(|v| at(&ready, v)).fold(compute, f64::max);
                compute = start + seconds;
                work += seconds;
                for v in outputs {
                    ready.insert(*v, compute);
                }
                end = end.max(compute);
            }
            Instr::Collective { input, output, seconds, .. } => {
                work += seconds;
                let t = if on_comm {
                    comm = at(&ready, input).max(comm) + seconds;
                    comm
                } else {
                    compute = at(&ready, input).max(compute) + seconds;
                    compute
                };
                ready.insert(*output, t);
                end = end.max(t);
            }
            Instr::Free { .. } | Instr::Transfer { .. } => {}
        }
    }
    Played { seconds: end, work }
}

/// Which of `program`'s instructions run on the communication stream: the collectives in the
/// prologue, and those converting for an op that `update` names (the update part: the op each
/// conversion is for is the next op after it).
pub fn on_comm_stream(program: &[Instr], update: &dyn Fn(&Instr) -> bool) -> Vec<bool> {
    let mut out = vec![false; program.len()];
    let mut serves_update = false;
    for (k, ins) in program.iter().enumerate().rev() {
        match ins {
            Instr::Op { .. } => serves_update = update(ins),
            Instr::Collective { phase, .. } => out[k] = *phase == crate::Phase::Prologue || serves_update,
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use sharding::{Collective, Local, ReduceKind, ShardingSpec};

    fn v(node: usize) -> ValueRef {
        ValueRef { node, slot: 0, copy: None }
    }

    fn op(node: usize, inputs: Vec<ValueRef>, seconds: f64) -> Instr {
        Instr::Op {
            node,
            name: format!("n{node}"),
            op: ir::Op::Unary(ir::UnaryOp::Relu),
            strategy: "r".into(),
            inputs,
            input_specs: vec![],
            outputs: vec![v(node)],
            output_specs: vec![],
            local_shapes: vec![],
            local: Local::Same,
            seconds,
            recompute: false,
            stage: 0,
            phase: crate::Phase::Forward,
            chunk: 0,
        }
    }

    fn reduce(input: ValueRef, out: usize, seconds: f64) -> Instr {
        Instr::Collective {
            input,
            output: v(out),
            collective: Collective::AllReduce { axes: vec![0], op: ReduceKind::Sum },
            from: ShardingSpec::replicated(1),
            to: ShardingSpec::replicated(1),
            bytes: 0,
            seconds,
            stage: 0,
            phase: crate::Phase::Forward,
            chunk: 0,
        }
    }

    #[test]
    fn a_reduction_overlaps_the_ops_after_its_input_and_its_reader_waits() {
        // grad1 (1 s), its reduction (3 s) on the comm stream, grad2 (2 s), then the update
        // reading the reduction (1 s): the reduction runs 1..4, grad2 1..3, the update 4..5.
        let p = [op(0, vec![], 1.0), reduce(v(0), 10, 3.0), op(1, vec![], 2.0), op(2, vec![v(10)], 1.0)];
        let played = play(p.iter().zip([false, true, false, false]));
        assert_eq!(played.work, 7.0);
        assert_eq!(played.seconds, 5.0);
        assert_eq!(played.overlapped(), 2.0);
        // On the compute stream, everything runs in turn.
        let serial = play(p.iter().map(|i| (i, false)));
        assert_eq!(serial.seconds, 7.0);
        assert_eq!(serial.overlapped(), 0.0);
    }

    #[test]
    fn conversions_for_the_update_ops_are_marked() {
        let p = [
            op(0, vec![], 1.0),
            reduce(v(0), 10, 3.0),
            op(1, vec![], 2.0),
            reduce(v(1), 11, 1.0),
            op(2, vec![v(10)], 1.0),
        ];
        let marked = on_comm_stream(&p, &|i| matches!(i, Instr::Op { node: 2, .. }));
        assert_eq!(marked, vec![false, false, false, true, false]);
    }
}
