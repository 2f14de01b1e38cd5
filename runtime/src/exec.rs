//! The one executor of a compiled [`Program`]: every back end's rank runs its step through
//! [`step`], over a [`Backend`] that holds the rank's tensors (host tensors for the CPU, device
//! tensors for a GPU) and runs its kernels and collectives. The single-device interpreter is
//! the same walk of a one-rank program (`Program::single`).
//!
//! Invariants (the same on every back end):
//! - instructions run in the program's order, each reading only values written and not freed;
//! - parameters and optimizer state move out of the rank's owned storage into the step, and the
//!   updated values (and the frozen ones) become the storage of the next step; borrowed
//!   storage (a caller's parameters) is read in place and only the updated values come back;
//! - a view (`Exec::View`) takes over its input's buffer: the input is never read again;
//! - memory is accounted as [`plan::memory::simulate`] estimates it: the resident storage and
//!   constants from the start, inputs and outputs added when written, values subtracted when
//!   freed (a back end with its own allocator figures, a GPU's, reports those instead);
//! - the graph's outputs are assembled from every rank's blocks, so every rank returns the
//!   global values (a one-rank program's outputs are its values, moved, not copied);
//! - with pipeline stages a rank runs its stage's code: sends and receives meet their peers'
//!   in the plan's order (a consistent order of every stage's transfers, so none waits for a
//!   transfer that comes later), and the outputs come from the ranks of its own stage.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use ir::Tensor;
use plan::{Phase, Segment};
use sharding::{Collective, DeviceMesh, sim};

use crate::dist::{DistError, Exec, Kernel, KernelFailure, Program, StepKey, StepResult, Stream};

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
    /// collectives of its own (the special kernels). Random ops draw from `stream` (`None`:
    /// they do not draw; a dropout keeps everything, as in inference).
    fn eval(
        &mut self,
        k: &Kernel,
        ins: &[&Self::T],
        mesh: &DeviceMesh,
        stream: Option<&Stream>,
    ) -> Result<(Vec<Self::T>, f64), KernelFailure>;
    /// Runs one collective of the plan on this rank's block (complete when it returns).
    fn collective(&mut self, c: &Collective, mesh: &DeviceMesh, x: &Self::T) -> Result<Self::T, DistError>;
    /// Every rank's block of a graph output, in rank order, on the host.
    fn gather_output(&mut self, everyone: &[usize], x: &Self::T) -> Result<Vec<Tensor>, DistError>;
    /// Makes ready the groups this rank will run collectives over ([`Program::groups_of`]);
    /// every rank calls it before its first instruction.
    fn prepare(&mut self, _groups: &[Vec<usize>]) -> Result<(), DistError> {
        Ok(())
    }
    /// Sends a block to rank `to` (a pipeline transfer), tagged.
    fn send(&mut self, to: usize, tag: u64, x: &Self::T) -> Result<(), DistError>;
    /// Receives the block of `meta` rank `from` sends with `tag`.
    fn recv(&mut self, from: usize, tag: u64, meta: &ir::TensorMeta) -> Result<Self::T, DistError>;
    /// A block on the host (a single rank's output, which needs no assembly).
    fn download(&mut self, x: Self::T) -> Result<Tensor, DistError>;
    /// `x` with another shape of the same size, reusing its buffer where the back end can
    /// (by default, a copy through the reshape kernel).
    fn reshape(&mut self, x: Self::T, shape: &[usize], mesh: &DeviceMesh) -> Result<Self::T, KernelFailure> {
        let (mut outs, _) = self.eval(&Kernel::Same(ir::Op::Reshape { shape: shape.to_vec() }), &[&x], mesh, None)?;
        outs.pop().ok_or_else(|| KernelFailure::Kernel("reshape returned nothing".into()))
    }
    /// A copy of `x` (a value read again later, or borrowed from the rank's inputs), allocated
    /// fallibly where the back end can: the message says what was refused.
    fn copy(&mut self, x: &Self::T) -> Result<Self::T, String> {
        Ok(x.clone())
    }
    /// Waits until the work queued so far is done (a GPU's stream), so that a profiled
    /// instruction's time is its own.
    fn sync(&mut self) -> Result<(), DistError> {
        Ok(())
    }
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
    fn into_owned<B: Backend<T = T>>(self, b: &mut B) -> Result<T, String> {
        match self {
            Held::Owned(t) => Ok(t),
            Held::Borrowed(t) => b.copy(t),
        }
    }
}

/// A rank's parameters and optimizer state, as a step reads them.
pub(crate) enum Storage<'a, T> {
    /// Moved into the step and replaced by the updated (and the frozen) values: the storage of
    /// the next step. Unusable after a failed step.
    Owned(&'a mut BTreeMap<String, T>),
    /// Read in place; the updated values are written to `updates` (a single-device run of a
    /// caller's parameters).
    Borrowed { params: &'a BTreeMap<String, T>, updates: &'a mut BTreeMap<String, T> },
}

/// Whether a step trains or only evaluates the loss.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Every instruction: forward, loss, backward, update. Random ops draw from the key's
    /// stream, with the microbatch of each instruction (`None`: they do not draw, as in
    /// inference).
    Train(Option<StepKey>),
    /// Only the instructions the `loss` output depends on ([`Program::eval_marks`]); nothing is
    /// updated (storage should be borrowed), and `loss` is the only output. Nothing random is
    /// drawn: evaluation does not drop.
    Eval,
}

/// Runs one training step of `program` on a rank (see the module docs): `storage` holds its
/// parameter and optimizer-state blocks, `feeds` and `constants` its blocks of the inputs and
/// constants. With `profile`, every op's seconds are in [`StepResult::op_seconds`].
pub(crate) fn step<'a, B: Backend>(
    program: &Program,
    b: &mut B,
    storage: Storage<'a, B::T>,
    feeds: &[&'a B::T],
    constants: &[&'a B::T],
    profile: bool,
    mode: Mode,
) -> Result<StepResult, DistError> {
    let marks = (mode == Mode::Eval).then(|| program.eval_marks());
    let rank = b.rank();
    let t0 = Instant::now();
    let mut comm_seconds = 0.0;
    let mut op_seconds = vec![];
    // With `profile`: each instruction run, by its place in the stage's code, with its seconds
    // and the bytes held after it.
    let mut instr_profile: Vec<(usize, f64, u64)> = vec![];
    let mut last_instr: Option<(usize, Instant)> = None;
    let mut vals: Vec<Option<Held<'a, B::T>>> = (0..program.slot_names.len()).map(|_| None).collect();
    // Parameters move out of owned storage into the step; that storage is rebuilt at the end.
    let (mut taken, borrowed, mut updates_out) = match storage {
        Storage::Owned(s) => (std::mem::take(s), None, Some(s)),
        Storage::Borrowed { params, updates } => (BTreeMap::new(), Some((params, updates)), None),
    };
    let stored: u64 = match &borrowed {
        None => taken.values().map(B::bytes).sum(),
        Some((params, _)) => program.resident.iter().filter_map(|r| params.get(&r.name)).map(B::bytes).sum(),
    };
    let resident = stored + constants.iter().map(|t| B::bytes(t)).sum::<u64>();
    let (mut live, mut peak) = (resident, resident);
    let missing =
        |slot: usize| DistError::Plan(format!("rank {rank}: reads {} before it is written", program.slot_names[slot]));
    let mesh = program.mesh();
    let stage = program.stage_of(rank);
    let code = program.code.get(stage).ok_or_else(|| DistError::Plan(format!("rank {rank}: no code for its stage")))?;
    if program.ranks() > 1 {
        b.prepare(&program.groups_of(rank))?;
    }
    // The steps of the stage's schedule, each a segment of its code for one microbatch, then
    // the update segment once. Every microbatch in flight has its own values; parameters and
    // optimizer state (and, once a microbatch ends, what it leaves for the update) are shared.
    let microbatches = program.microbatches.max(1);
    let steps = program.steps.get(stage).map(Vec::as_slice).unwrap_or(&[]);
    let segments = &program.segments[stage];
    let mut last_step: HashMap<usize, usize> = HashMap::new();
    for (i, st) in steps.iter().enumerate() {
        last_step.insert(st.microbatch, i);
    }
    // Bytes a held value counts for (a constant's block stays with the rank's constants).
    let cost = |slot: usize, t: &B::T| if program.constant_slot[slot] { 0 } else { B::bytes(t) };
    let update = Segment { phase: Phase::Update, chunk: 0 };
    let runs = steps.iter().map(|st| (Some(st.microbatch), st.segment())).chain(std::iter::once((None, update)));
    let n_inputs = program.inputs.len();
    let mut tables: HashMap<usize, Vec<Option<Held<'a, B::T>>>> = HashMap::new();
    let mut acc: Vec<Option<B::T>> = vec![None; program.accumulate.len()];
    let fresh = || -> Vec<Option<Held<'a, B::T>>> { (0..program.slot_names.len()).map(|_| None).collect() };
    for (run, (mb, seg)) in runs.enumerate() {
        if mb.is_none() {
            // The sums are what the update reads.
            for (j, &slot) in program.accumulate.iter().enumerate() {
                if let Some(a) = acc[j].take() {
                    vals[slot] = Some(Held::Owned(a));
                }
            }
        }
        let mut table = match mb {
            Some(m) => tables.remove(&m).unwrap_or_else(fresh),
            None => std::mem::take(&mut vals),
        };
        let range = segments.get(&seg).cloned().unwrap_or(0..0);
        let m = mb.unwrap_or(0);
        let stream = match mode {
            Mode::Train(Some(key)) => Some(key.stream(m as u64)),
            _ => None,
        };
        for (k, ins) in code[range.clone()].iter().enumerate() {
            if marks.is_some_and(|mk| !mk[stage][range.start + k]) {
                continue;
            }
            // The previous instruction's time and the bytes held after it.
            if profile {
                b.sync()?;
                let now = Instant::now();
                if let Some((at, t)) = last_instr.replace((range.start + k, now)) {
                    instr_profile.push((at, (now - t).as_secs_f64(), live));
                }
            }
            b.check()?;
            match ins {
                Exec::Storage { slot, name } => {
                    // Read once per step (a later microbatch finds it in place).
                    let home = if mb.is_some() { &mut vals } else { &mut table };
                    if home[*slot].is_some() {
                        continue;
                    }
                    let none = || DistError::Data { rank, message: format!("no storage for {name}") };
                    home[*slot] = Some(match &borrowed {
                        None => Held::Owned(taken.remove(name).ok_or_else(none)?),
                        Some((params, _)) => Held::Borrowed(params.get(name).ok_or_else(none)?),
                    });
                }
                Exec::Input { slot, index } => {
                    // A state made by another program may lack the block.
                    let t = feeds.get(m * n_inputs + *index).ok_or_else(|| DistError::Data {
                        rank,
                        message: format!("no block of input {}", program.slot_names[*slot]),
                    })?;
                    live += B::bytes(t);
                    if let Some(old) = table[*slot].replace(Held::Borrowed(t)) {
                        live = live.saturating_sub(cost(*slot, old.get()));
                    }
                    peak = peak.max(live);
                }
                Exec::Constant { slot, index } => {
                    let t = constants.get(*index).ok_or_else(|| DistError::Data {
                        rank,
                        message: format!("no block of constant {}", program.slot_names[*slot]),
                    })?;
                    table[*slot] = Some(Held::Borrowed(t));
                }
                Exec::Op { id, node, op, kernel, inputs, outputs, shapes } => {
                    let ins: Vec<&B::T> = inputs
                        .iter()
                        .map(|&s| get(&table, &vals, s).ok_or_else(|| missing(s)))
                        .collect::<Result<_, _>>()?;
                    let kerr =
                        |m: String| DistError::Kernel { rank, node: node.clone(), op: op.to_string(), message: m };
                    let t1 = profile.then(Instant::now);
                    let (outs, waited) = b.eval(kernel, &ins, mesh, stream.as_ref()).map_err(|e| match e {
                        KernelFailure::Kernel(m) => kerr(m),
                        KernelFailure::Comm(c) => DistError::Comm(c),
                    })?;
                    if let Some(t1) = t1 {
                        op_seconds.push((*id, t1.elapsed().as_secs_f64()));
                    }
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
                        if let Some(old) = table[s].replace(Held::Owned(t)) {
                            live = live.saturating_sub(cost(s, old.get()));
                        }
                    }
                    peak = peak.max(live);
                }
                Exec::View { id, node, input, output, shape } => {
                    // The input's last read: its buffer becomes the output's (a shared value is
                    // copied: later microbatches read it).
                    let copy_err =
                        |m: String| DistError::Kernel { rank, node: node.clone(), op: "reshape".into(), message: m };
                    let x = match table[*input].take() {
                        Some(x) => x,
                        None => Held::Owned(
                            b.copy(vals.get(*input).and_then(Option::as_ref).ok_or_else(|| missing(*input))?.get())
                                .map_err(copy_err)?,
                        ),
                    };
                    let t1 = profile.then(Instant::now);
                    let x = x.into_owned(b).map_err(copy_err)?;
                    let y = b.reshape(x, shape, mesh).map_err(|e| match e {
                        KernelFailure::Kernel(m) => {
                            DistError::Kernel { rank, node: node.clone(), op: "reshape".into(), message: m }
                        }
                        KernelFailure::Comm(c) => DistError::Comm(c),
                    })?;
                    if let Some(t1) = t1 {
                        op_seconds.push((*id, t1.elapsed().as_secs_f64()));
                    }
                    table[*output] = Some(Held::Owned(y));
                }
                Exec::Collective { input, output, c } => {
                    let t1 = Instant::now();
                    let x = get(&table, &vals, *input).ok_or_else(|| missing(*input))?;
                    let y = b.collective(c, mesh, x)?;
                    comm_seconds += t1.elapsed().as_secs_f64();
                    live += B::bytes(&y);
                    peak = peak.max(live);
                    if let Some(old) = table[*output].replace(Held::Owned(y)) {
                        live = live.saturating_sub(cost(*output, old.get()));
                    }
                }
                Exec::Send { slot, to, id } => {
                    let t1 = Instant::now();
                    let x = get(&table, &vals, *slot).ok_or_else(|| missing(*slot))?;
                    b.send(program.peer(rank, *to), id * microbatches as u64 + m as u64, x)?;
                    comm_seconds += t1.elapsed().as_secs_f64();
                }
                Exec::Recv { slot, from, meta, id } => {
                    let t1 = Instant::now();
                    let y = b.recv(program.peer(rank, *from), id * microbatches as u64 + m as u64, meta)?;
                    comm_seconds += t1.elapsed().as_secs_f64();
                    live += B::bytes(&y);
                    peak = peak.max(live);
                    if let Some(old) = table[*slot].replace(Held::Owned(y)) {
                        live = live.saturating_sub(cost(*slot, old.get()));
                    }
                }
                Exec::Free { slots } => {
                    for &s in slots {
                        let h = match table[s].take() {
                            Some(h) => h,
                            None => match vals.get_mut(s).and_then(Option::take) {
                                Some(h) => h,
                                // An evaluation skips what the loss does not need.
                                None if marks.is_some() => continue,
                                None => return Err(missing(s)),
                            },
                        };
                        live = live.saturating_sub(cost(s, h.get()));
                    }
                }
            }
        }
        match mb {
            None => vals = table,
            Some(m) if last_step.get(&m) == Some(&run) => {
                // The microbatch's last step here: its values join the sums (in the order the
                // microbatches end), and what else it holds is left for the update.
                for (j, &slot) in program.accumulate.iter().enumerate() {
                    let Some(h) = table[slot].take() else { continue };
                    let x = h.into_owned(b).map_err(|m| DistError::Kernel {
                        rank,
                        node: program.slot_names[slot].to_string(),
                        op: "accumulate".into(),
                        message: m,
                    })?;
                    acc[j] = Some(match acc[j].take() {
                        None => x,
                        Some(a) => {
                            let add = Kernel::Same(ir::Op::Binary(ir::BinaryOp::Add));
                            let (mut outs, _) = b.eval(&add, &[&a, &x], mesh, None).map_err(|e| match e {
                                KernelFailure::Kernel(msg) => DistError::Kernel {
                                    rank,
                                    node: program.slot_names[slot].to_string(),
                                    op: "accumulate".into(),
                                    message: msg,
                                },
                                KernelFailure::Comm(c) => DistError::Comm(c),
                            })?;
                            let y = outs.pop().ok_or_else(|| DistError::Plan("accumulating: no sum".into()))?;
                            live += B::bytes(&y);
                            peak = peak.max(live);
                            live = live.saturating_sub(B::bytes(&a) + B::bytes(&x));
                            y
                        }
                    });
                }
                for (s, h) in table.into_iter().enumerate() {
                    if let Some(h) = h
                        && let Some(old) = vals[s].replace(h)
                    {
                        live = live.saturating_sub(cost(s, old.get()));
                    }
                }
            }
            Some(m) => {
                tables.insert(m, table);
            }
        }
    }
    if let Some((at, t)) = last_instr.take() {
        b.sync()?;
        instr_profile.push((at, t.elapsed().as_secs_f64(), live));
    }
    if !tables.is_empty() {
        return Err(DistError::Plan(format!("rank {rank}: the schedule leaves microbatches unfinished")));
    }
    // Values read at the end: outputs, updates and (into owned storage) frozen parameters. The
    // last read of each moves it; earlier ones copy.
    let frozen: &[(String, usize)] = if borrowed.is_none() { &program.kept[stage] } else { &[] };
    let updates: &[(String, usize)] = if mode == Mode::Eval { &[] } else { &program.updates[stage] };
    let outputs_read: Vec<&(String, usize, sharding::ShardingSpec, Vec<usize>)> =
        program.outputs.iter().filter(|o| mode != Mode::Eval || o.0 == crate::dist::EVAL_OUTPUT).collect();
    let mut reads = vec![0usize; vals.len()];
    let end_reads = outputs_read.iter().map(|(_, s, _, _)| s).chain(updates.iter().chain(frozen).map(|(_, s)| s));
    for &s in end_reads {
        reads[s] += 1;
    }
    // Outputs: every rank gets the global value, assembled from its stage's blocks (every
    // stage holds the outputs).
    let everyone = program.stage_ranks(rank);
    let stage_mesh = program.stage_mesh();
    let mut outputs = BTreeMap::new();
    for (name, slot, spec, shape) in outputs_read {
        let t = if everyone.len() == 1 {
            let x = take_read(b, &mut vals, &mut reads, *slot)
                .map_err(|m| DistError::Data { rank, message: format!("output {name}: {m}") })?
                .ok_or_else(|| missing(*slot))?;
            b.download(x)?
        } else {
            let x = vals[*slot].as_ref().map(Held::get).ok_or_else(|| missing(*slot))?;
            let t1 = Instant::now();
            let blocks = b.gather_output(&everyone, x)?;
            comm_seconds += t1.elapsed().as_secs_f64();
            reads[*slot] -= 1;
            sim::assemble(&blocks, spec, shape, &stage_mesh, f32::INFINITY)
                .map_err(|e| DistError::Plan(format!("output {name}: {e}")))?
        };
        // The mean over microbatches of what each computed (an output of the update phase is
        // computed once, and not summed).
        let summed = microbatches > 1 && program.accumulate.binary_search(slot).is_ok();
        outputs.insert(name.clone(), if summed { mean_of(t, microbatches) } else { t });
    }
    for (name, slot) in updates.iter().chain(frozen) {
        let t = take_read(b, &mut vals, &mut reads, *slot)
            .map_err(|m| DistError::Data { rank, message: format!("{name}: {m}") })?
            .ok_or_else(|| missing(*slot))?;
        taken.insert(name.clone(), t);
    }
    drop(vals);
    match (&mut updates_out, borrowed) {
        (Some(storage), _) => **storage = taken,
        (None, Some((_, updates))) => *updates = taken,
        (None, None) => unreachable!("storage is owned or borrowed"),
    }
    Ok(StepResult {
        outputs,
        peak_bytes: b.peak_bytes(peak),
        resident_bytes: resident,
        seconds: t0.elapsed().as_secs_f64(),
        comm_seconds,
        op_seconds,
        instr_profile,
        data_bytes: 0,
        data_seconds: 0.0,
        data_hash: 0,
    })
}

/// A value of a microbatch's `table`, or else a shared one.
fn get<'x, T: Clone>(table: &'x [Option<Held<'_, T>>], shared: &'x [Option<Held<'_, T>>], s: usize) -> Option<&'x T> {
    table.get(s).and_then(Option::as_ref).or_else(|| shared.get(s).and_then(Option::as_ref)).map(Held::get)
}

/// A value read at the end of a step: moved out at its last read, copied before.
fn take_read<B: Backend>(
    b: &mut B,
    vals: &mut [Option<Held<'_, B::T>>],
    reads: &mut [usize],
    s: usize,
) -> Result<Option<B::T>, String> {
    reads[s] = reads[s].saturating_sub(1);
    if reads[s] == 0 {
        vals[s].take().map(|h| h.into_owned(b)).transpose()
    } else {
        vals[s].as_ref().map(|h| b.copy(h.get())).transpose()
    }
}

/// `t` (a sum over `n` microbatches) divided by `n`; tensors of other element types as they are.
fn mean_of(t: Tensor, n: usize) -> Tensor {
    let shape = t.shape().to_vec();
    let data = match t.into_data() {
        ir::Data::F32(v) => ir::Data::F32(v.into_iter().map(|x| x / n as f32).collect()),
        ir::Data::F64(v) => ir::Data::F64(v.into_iter().map(|x| x / n as f64).collect()),
        d => d,
    };
    Tensor::new(shape, data).unwrap_or_else(|e| unreachable!("same shape and length: {e}"))
}
