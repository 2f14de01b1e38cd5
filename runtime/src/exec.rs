//! The one executor of a compiled [`Program`]: every back end's rank runs its step through
//! [`step`], over a [`Backend`] that holds the rank's tensors (host tensors for the CPU, device
//! tensors for a GPU) and runs its kernels and collectives.
//!
//! Invariants (the same on every back end):
//! - instructions run in the program's order, each reading only values written and not freed;
//! - parameters and optimizer state move out of the rank's storage into the step, and the
//!   updated values (and the frozen ones) become the storage of the next step;
//! - memory is accounted as [`plan::memory::simulate`] estimates it: the resident storage and
//!   constants from the start, inputs and outputs added when written, values subtracted when
//!   freed (a back end with its own allocator figures, a GPU's, reports those instead);
//! - the graph's outputs are assembled from every rank's blocks, so every rank returns the
//!   global values.

use std::collections::BTreeMap;
use std::time::Instant;

use ir::Tensor;
use sharding::{Collective, DeviceMesh, sim};

use crate::dist::{DistError, Exec, Kernel, KernelFailure, Program, StepResult};

/// What a rank's tensors live on, and how it computes and communicates.
pub(crate) trait Backend {
    /// A tensor block of this back end.
    type T: Clone;
    /// The rank.
    fn rank(&self) -> usize;
    /// Bytes of a block.
    fn bytes(t: &Self::T) -> u64;
    /// Shape of a block.
    fn shape(t: &Self::T) -> &[usize];
    /// Fails when another rank has aborted the run (before every instruction).
    fn check(&mut self) -> Result<(), DistError> {
        Ok(())
    }
    /// Runs one op's local computation; returns its outputs and the seconds it waited in
    /// collectives of its own (the special kernels).
    fn eval(&mut self, k: &Kernel, ins: &[&Self::T], mesh: &DeviceMesh) -> Result<(Vec<Self::T>, f64), KernelFailure>;
    /// Runs one collective of the plan on this rank's block (complete when it returns).
    fn collective(&mut self, c: &Collective, mesh: &DeviceMesh, x: &Self::T) -> Result<Self::T, DistError>;
    /// Every rank's block of a graph output, in rank order, on the host.
    fn gather_output(&mut self, everyone: &[usize], x: &Self::T) -> Result<Vec<Tensor>, DistError>;
    /// The step's peak bytes, given the executor's count (a back end with its own figures
    /// returns those).
    fn peak_bytes(&self, counted: u64) -> u64 {
        counted
    }
}

/// A value held during a step: written by it, or borrowed from the rank's inputs and
/// constants.
enum Held<'a, T> {
    Owned(T),
    Borrowed(&'a T),
}

impl<T: Clone> Held<'_, T> {
    fn get(&self) -> &T {
        match self {
            Held::Owned(t) => t,
            Held::Borrowed(t) => t,
        }
    }
    fn into_owned(self) -> T {
        match self {
            Held::Owned(t) => t,
            Held::Borrowed(t) => t.clone(),
        }
    }
}

/// Runs one training step of `program` on a rank (see the module docs): `storage` holds its
/// parameter and optimizer-state blocks (replaced by the updated ones on success; unusable
/// after a failure), `feeds` and `constants` its blocks of the inputs and constants.
pub(crate) fn step<B: Backend>(
    program: &Program,
    b: &mut B,
    storage: &mut BTreeMap<String, B::T>,
    feeds: &[&B::T],
    constants: &[&B::T],
) -> Result<StepResult, DistError> {
    let rank = b.rank();
    let t0 = Instant::now();
    let mut comm_seconds = 0.0;
    let mut vals: Vec<Option<Held<B::T>>> = (0..program.slot_names.len()).map(|_| None).collect();
    let resident: u64 =
        storage.values().map(B::bytes).sum::<u64>() + constants.iter().map(|t| B::bytes(t)).sum::<u64>();
    let (mut live, mut peak) = (resident, resident);
    // Parameters move out of storage into the step; the storage is rebuilt at the end.
    let mut taken = std::mem::take(storage);
    let missing =
        |slot: usize| DistError::Plan(format!("rank {rank}: reads {} before it is written", program.slot_names[slot]));
    let mesh = program.mesh();
    for ins in &program.code {
        b.check()?;
        match ins {
            Exec::Storage { slot, name } => {
                let t = taken
                    .remove(name)
                    .ok_or_else(|| DistError::Data { rank, message: format!("no storage for {name}") })?;
                vals[*slot] = Some(Held::Owned(t));
            }
            Exec::Input { slot, index } => {
                // A state made by another program may lack the block.
                let t = feeds.get(*index).ok_or_else(|| DistError::Data {
                    rank,
                    message: format!("no block of input {}", program.slot_names[*slot]),
                })?;
                live += B::bytes(t);
                vals[*slot] = Some(Held::Borrowed(t));
            }
            Exec::Constant { slot, index } => {
                let t = constants.get(*index).ok_or_else(|| DistError::Data {
                    rank,
                    message: format!("no block of constant {}", program.slot_names[*slot]),
                })?;
                vals[*slot] = Some(Held::Borrowed(t));
            }
            Exec::Op { node, op, kernel, inputs, outputs, shapes } => {
                let ins: Vec<&B::T> = inputs
                    .iter()
                    .map(|&s| vals[s].as_ref().map(Held::get).ok_or_else(|| missing(s)))
                    .collect::<Result<_, _>>()?;
                let kerr = |m: String| DistError::Kernel { rank, node: node.clone(), op: op.to_string(), message: m };
                let (outs, waited) = b.eval(kernel, &ins, mesh).map_err(|e| match e {
                    KernelFailure::Kernel(m) => kerr(m),
                    KernelFailure::Comm(c) => DistError::Comm(c),
                })?;
                comm_seconds += waited;
                if outs.len() != outputs.len() {
                    return Err(kerr(format!("{} outputs, the plan has {}", outs.len(), outputs.len())));
                }
                // Blocks of any other shape would only fail later, at a reader, or not at all.
                if let Some((t, want)) = outs.iter().zip(shapes).find(|(t, want)| B::shape(t) != want.as_slice()) {
                    return Err(kerr(format!("a block of {:?}, the plan's layout needs {want:?}", B::shape(t))));
                }
                for (t, &s) in outs.into_iter().zip(outputs) {
                    live += B::bytes(&t);
                    vals[s] = Some(Held::Owned(t));
                }
                peak = peak.max(live);
            }
            Exec::Collective { input, output, c } => {
                let t1 = Instant::now();
                let x = vals[*input].as_ref().map(Held::get).ok_or_else(|| missing(*input))?;
                let y = b.collective(c, mesh, x)?;
                comm_seconds += t1.elapsed().as_secs_f64();
                live += B::bytes(&y);
                peak = peak.max(live);
                vals[*output] = Some(Held::Owned(y));
            }
            Exec::Free { slots } => {
                for &s in slots {
                    let h = vals[s].take().ok_or_else(|| missing(s))?;
                    live = live.saturating_sub(B::bytes(h.get()));
                }
            }
        }
    }
    // Outputs: every rank gets the global value.
    let everyone: Vec<usize> = (0..mesh.size()).collect();
    let mut outputs = BTreeMap::new();
    for (name, slot, spec, shape) in &program.outputs {
        let x = vals[*slot].as_ref().map(Held::get).ok_or_else(|| missing(*slot))?;
        let t1 = Instant::now();
        let blocks = b.gather_output(&everyone, x)?;
        comm_seconds += t1.elapsed().as_secs_f64();
        let t = sim::assemble(&blocks, spec, shape, mesh, f32::INFINITY)
            .map_err(|e| DistError::Plan(format!("output {name}: {e}")))?;
        outputs.insert(name.clone(), t);
    }
    for (name, slot) in program.updates.iter().chain(&program.kept) {
        let t = vals[*slot].take().ok_or_else(|| missing(*slot))?.into_owned();
        taken.insert(name.clone(), t);
    }
    drop(vals);
    *storage = taken;
    Ok(StepResult { outputs, peak_bytes: b.peak_bytes(peak), seconds: t0.elapsed().as_secs_f64(), comm_seconds })
}
