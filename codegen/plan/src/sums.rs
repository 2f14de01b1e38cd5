//! When a microbatch's summed values join their sums: the rule the memory walks and the
//! runtime share.
//!
//! With several microbatches, the values the update phase reads from the pass (the parameter
//! gradients, [`Plan::accumulate`]) and the graph's per-microbatch outputs are summed over the
//! microbatches. A microbatch adds each of them into its sum as soon as it is done with it:
//! at the end of the step after which none of its later steps reads, writes or frees it. A
//! gradient is final once the backward of the chunk that computes it ends, so under an
//! interleaved schedule a microbatch in flight holds at most its current chunk's weight
//! gradients, not those of every chunk it has been through (which is what summing at the
//! microbatch's last step held: on LLaMA-3 405B in 16 stages of 8 chunks, 16 microbatches'
//! worth of a stage's gradients), as Megatron accumulates each gradient into its parameter's
//! buffer when it is computed.

use std::collections::{HashMap, HashSet};

use crate::{Instr, Plan, Segment, ValueRef};

impl Plan {
    /// The values summed over a step's microbatches, sorted: [`Plan::accumulate`] (the
    /// gradients) and, with more than one microbatch, the graph's outputs computed per
    /// microbatch (their mean is reported; those the update phase computes once per step, the
    /// learning rate and the gradient norm, are not).
    pub fn summed(&self) -> Vec<ValueRef> {
        let mut summed = self.accumulate.clone();
        if self.microbatches > 1 {
            let once: HashSet<usize> = self
                .program
                .iter()
                .filter_map(|i| match i {
                    Instr::Op { node, .. } if i.once_per_step() => Some(*node),
                    _ => None,
                })
                .collect();
            summed.extend(
                self.graph
                    .outputs
                    .iter()
                    .filter(|(_, v)| !once.contains(&v.node.index()))
                    .map(|(_, v)| ValueRef::of(*v)),
            );
        }
        summed.sort();
        summed.dedup();
        summed
    }

    /// For each step of `stage`'s schedule ([`Plan::steps`]), the values of `summed` that its
    /// microbatch is done with when the step ends: touched (written, read or freed) by the
    /// step's segment or an earlier step of the microbatch, and by none of its later steps. A
    /// value is listed at one step per microbatch at most, and a microbatch's last step lists
    /// what its earlier ones left.
    pub fn summed_after_steps(&self, stage: usize, summed: &[ValueRef]) -> Vec<Vec<ValueRef>> {
        let wanted: HashSet<ValueRef> = summed.iter().copied().collect();
        // The summed values each segment of the stage touches.
        let mut touched: HashMap<Segment, HashSet<ValueRef>> = HashMap::new();
        for ins in &self.program {
            let Some(seg) = ins.segment_on(stage) else { continue };
            let set = touched.entry(seg).or_default();
            let mut touch = |v: &ValueRef| {
                if wanted.contains(v) {
                    set.insert(*v);
                }
            };
            match ins {
                Instr::Op { inputs, outputs, .. } => inputs.iter().chain(outputs).for_each(&mut touch),
                Instr::Collective { input, output, .. } => [input, output].into_iter().for_each(&mut touch),
                Instr::Free { values, .. } => values.iter().for_each(&mut touch),
                Instr::Transfer { value, .. } => touch(value),
            }
        }
        let steps = self.steps().into_iter().nth(stage).unwrap_or_default();
        // The last step of each microbatch, and the last step touching each of its values.
        let mut last_step: HashMap<usize, usize> = HashMap::new();
        let mut last_touch: HashMap<(usize, ValueRef), usize> = HashMap::new();
        for (i, st) in steps.iter().enumerate() {
            last_step.insert(st.microbatch, i);
            for v in touched.get(&st.segment()).into_iter().flatten() {
                last_touch.insert((st.microbatch, *v), i);
            }
        }
        let mut after: Vec<Vec<ValueRef>> = vec![vec![]; steps.len()];
        for (&m, &end) in &last_step {
            for v in summed {
                after[last_touch.get(&(m, *v)).copied().unwrap_or(end)].push(*v);
            }
        }
        for a in &mut after {
            a.sort();
        }
        after
    }
}
