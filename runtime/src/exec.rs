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

use crate::error::DistError;
use crate::program::{Exec, Kernel, KernelFailure, Program, StepKey, StepResult, Stream};

/// What a rank's tensors live on, and how it computes and communicates.
pub trait Backend {
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
    let t0 = Instant::now();
    // Parameters move out of owned storage into the step; that storage is rebuilt at the end.
    let (taken, borrowed, dest) = match storage {
        Storage::Owned(s) => (std::mem::take(s), None, Dest::Storage(s)),
        Storage::Borrowed { params, updates } => (BTreeMap::new(), Some(params), Dest::Updates(updates)),
    };
    let mut w = Walk::new(program, b, taken, borrowed, feeds, constants, profile, mode);
    let rank = w.rank;
    let code =
        program.code.get(w.stage).ok_or_else(|| DistError::Plan(format!("rank {rank}: no code for its stage")))?;
    if program.ranks() > 1 {
        w.b.prepare(&program.groups_of(rank))?;
    }
    w.run_schedule(code)?;
    w.finish(dest, t0)
}

/// Where the values a step leaves for storage go.
enum Dest<'a, T> {
    /// Back into the rank's owned storage.
    Storage(&'a mut BTreeMap<String, T>),
    /// Into the caller's map of updates (the parameters were borrowed).
    Updates(&'a mut BTreeMap<String, T>),
}

/// The microbatch (and its random stream) a segment of code runs for.
struct At {
    /// `None`: the update segment, run once per step.
    mb: Option<usize>,
    /// The microbatch (0 for the update).
    m: usize,
    stream: Option<Stream>,
}

/// A slot table: one value (or none) per slot of the program.
type Table<'a, T> = Vec<Option<Held<'a, T>>>;

/// One step's walk of a rank's code: the interpreter, one method per instruction kind.
struct Walk<'p, 'a, B: Backend> {
    program: &'p Program,
    b: &'p mut B,
    rank: usize,
    stage: usize,
    mode: Mode,
    /// In an evaluation, the instructions the loss depends on ([`Program::eval_marks`]).
    marks: Option<&'p [Vec<bool>]>,
    profile: bool,
    feeds: &'p [&'a B::T],
    constants: &'p [&'a B::T],
    /// Owned parameters and state not yet read (then, the values left for storage).
    taken: BTreeMap<String, B::T>,
    /// Borrowed parameters and state, read in place.
    borrowed: Option<&'a BTreeMap<String, B::T>>,
    /// Shared values: parameters and optimizer state, and what finished microbatches leave
    /// for the update.
    vals: Table<'a, B::T>,
    /// Bytes of the storage and constants (resident throughout).
    resident: u64,
    live: u64,
    peak: u64,
    comm_seconds: f64,
    op_seconds: Vec<(usize, f64)>,
    /// With `profile`: each instruction run, by its place in the stage's code, with its seconds
    /// and the bytes held after it.
    instr_profile: Vec<(usize, f64, u64)>,
    last_instr: Option<(usize, Instant)>,
}

impl<'p, 'a, B: Backend> Walk<'p, 'a, B> {
    #[allow(clippy::too_many_arguments)]
    fn new(
        program: &'p Program,
        b: &'p mut B,
        taken: BTreeMap<String, B::T>,
        borrowed: Option<&'a BTreeMap<String, B::T>>,
        feeds: &'p [&'a B::T],
        constants: &'p [&'a B::T],
        profile: bool,
        mode: Mode,
    ) -> Self {
        let rank = b.rank();
        let stored: u64 = match borrowed {
            None => taken.values().map(B::bytes).sum(),
            Some(params) => program.resident.iter().filter_map(|r| params.get(&r.name)).map(B::bytes).sum(),
        };
        let resident = stored + constants.iter().map(|t| B::bytes(t)).sum::<u64>();
        Walk {
            program,
            b,
            rank,
            stage: program.stage_of(rank),
            mode,
            marks: (mode == Mode::Eval).then(|| program.eval_marks()),
            profile,
            feeds,
            constants,
            taken,
            borrowed,
            vals: Self::fresh(program),
            resident,
            live: resident,
            peak: resident,
            comm_seconds: 0.0,
            op_seconds: vec![],
            instr_profile: vec![],
            last_instr: None,
        }
    }

    fn fresh(program: &Program) -> Table<'a, B::T> {
        (0..program.slot_names.len()).map(|_| None).collect()
    }

    fn missing(&self, slot: usize) -> DistError {
        DistError::Plan(format!("rank {}: reads {} before it is written", self.rank, self.program.slot_names[slot]))
    }

    /// Bytes a held value counts for (a constant's block stays with the rank's constants).
    fn cost(&self, slot: usize, t: &B::T) -> u64 {
        if self.program.constant_slot[slot] { 0 } else { B::bytes(t) }
    }

    /// `y` written to `slot` of `table`: counted, and the value it replaces released.
    fn write(&mut self, table: &mut Table<'a, B::T>, slot: usize, y: B::T) {
        self.live += B::bytes(&y);
        if let Some(old) = table[slot].replace(Held::Owned(y)) {
            self.live = self.live.saturating_sub(self.cost(slot, old.get()));
        }
    }

    /// `y`, a collective's result or a received block, written to `slot` of `table`: the peak
    /// counts it beside the value it replaces (both are held while it arrives).
    fn received(&mut self, table: &mut Table<'a, B::T>, slot: usize, y: B::T) {
        self.live += B::bytes(&y);
        self.peak = self.peak.max(self.live);
        if let Some(old) = table[slot].replace(Held::Owned(y)) {
            self.live = self.live.saturating_sub(self.cost(slot, old.get()));
        }
    }

    /// The prologue segment once, the steps of the stage's schedule, each a segment of its code
    /// for one microbatch, then the update segment once. Every microbatch in flight has its own
    /// values; parameters, optimizer state, what the prologue wrote (and, once a microbatch
    /// ends, what it leaves for the update) are shared.
    fn run_schedule(&mut self, code: &[Exec]) -> Result<(), DistError> {
        let program = self.program;
        let steps = program.steps.get(self.stage).map(Vec::as_slice).unwrap_or(&[]);
        let segments = &program.segments[self.stage];
        let mut last_step: HashMap<usize, usize> = HashMap::new();
        // Run 0 is the prologue.
        for (i, st) in steps.iter().enumerate() {
            last_step.insert(st.microbatch, i + 1);
        }
        let prologue = Segment { phase: Phase::Prologue, chunk: 0 };
        let update = Segment { phase: Phase::Update, chunk: 0 };
        let runs = std::iter::once((None, prologue))
            .chain(steps.iter().map(|st| (Some(st.microbatch), st.segment())))
            .chain(std::iter::once((None, update)));
        let mut tables: HashMap<usize, Table<'a, B::T>> = HashMap::new();
        let mut acc: Vec<Option<B::T>> = vec![None; program.accumulate.len()];
        for (run, (mb, seg)) in runs.enumerate() {
            if mb.is_none() {
                // The sums are what the update reads.
                for (j, &slot) in program.accumulate.iter().enumerate() {
                    if let Some(a) = acc[j].take() {
                        self.vals[slot] = Some(Held::Owned(a));
                    }
                }
            }
            let mut table = match mb {
                Some(m) => tables.remove(&m).unwrap_or_else(|| Self::fresh(program)),
                None => std::mem::take(&mut self.vals),
            };
            let range = segments.get(&seg).cloned().unwrap_or(0..0);
            let m = mb.unwrap_or(0);
            let stream = match self.mode {
                Mode::Train(Some(key)) => Some(key.stream(m as u64)),
                _ => None,
            };
            let at = At { mb, m, stream };
            for (k, ins) in code[range.clone()].iter().enumerate() {
                if self.marks.is_some_and(|mk| !mk[self.stage][range.start + k]) {
                    continue;
                }
                self.before(range.start + k)?;
                self.exec(ins, &mut table, &at)?;
            }
            match mb {
                None => self.vals = table,
                Some(m) => {
                    // What the microbatch is done with joins the sums (run 0 is the prologue).
                    let done = program.summed_after.get(self.stage).and_then(|a| a.get(run - 1));
                    self.add_to_sums(&mut table, &mut acc, done.map(Vec::as_slice).unwrap_or(&[]))?;
                    if last_step.get(&m) == Some(&run) {
                        self.end_microbatch(table, &mut acc)?;
                    } else {
                        tables.insert(m, table);
                    }
                }
            }
        }
        if let Some((at, t)) = self.last_instr.take() {
            self.b.sync()?;
            self.instr_profile.push((at, t.elapsed().as_secs_f64(), self.live));
        }
        if !tables.is_empty() {
            return Err(DistError::Plan(format!("rank {}: the schedule leaves microbatches unfinished", self.rank)));
        }
        Ok(())
    }

    /// Before instruction `at` of the stage's code: the previous instruction's time and the
    /// bytes held after it (profiling), and whether another rank has aborted.
    fn before(&mut self, at: usize) -> Result<(), DistError> {
        if self.profile {
            self.b.sync()?;
            let now = Instant::now();
            if let Some((prev, t)) = self.last_instr.replace((at, now)) {
                self.instr_profile.push((prev, (now - t).as_secs_f64(), self.live));
            }
        }
        self.b.check()
    }

    fn exec(&mut self, ins: &Exec, table: &mut Table<'a, B::T>, at: &At) -> Result<(), DistError> {
        match ins {
            Exec::Storage { slot, name } => self.storage(table, *slot, name, at),
            Exec::Input { slot, index } => self.input(table, *slot, *index, at),
            Exec::Constant { slot, index } => self.constant(table, *slot, *index),
            Exec::Op { id, node, op, kernel, inputs, outputs, shapes } => {
                self.op(table, at, OpInstr { id: *id, node, op, kernel, inputs, outputs, shapes })
            }
            Exec::View { id, node, input, output, shape } => self.view(table, *id, node, *input, *output, shape),
            Exec::Collective { input, output, c } => self.collective(table, *input, *output, c),
            Exec::Send { slot, to, id } => self.send(table, *slot, *to, *id, at),
            Exec::Recv { slot, from, meta, id } => self.recv(table, *slot, *from, meta, *id, at),
            Exec::Free { slots } => self.free(table, slots),
        }
    }

    /// A parameter or state, read once per step (a later microbatch finds it in place).
    fn storage(&mut self, table: &mut Table<'a, B::T>, slot: usize, name: &str, at: &At) -> Result<(), DistError> {
        let home = if at.mb.is_some() { &mut self.vals } else { table };
        if home[slot].is_some() {
            return Ok(());
        }
        let rank = self.rank;
        let none = || DistError::Data { rank, message: format!("no storage for {name}") };
        home[slot] = Some(match self.borrowed {
            None => Held::Owned(self.taken.remove(name).ok_or_else(none)?),
            Some(params) => Held::Borrowed(params.get(name).ok_or_else(none)?),
        });
        Ok(())
    }

    /// This rank's block of a fed input (a state made by another program may lack it).
    fn input(&mut self, table: &mut Table<'a, B::T>, slot: usize, index: usize, at: &At) -> Result<(), DistError> {
        let n_inputs = self.program.inputs.len();
        let t: &'a B::T = self.feeds.get(at.m * n_inputs + index).copied().ok_or_else(|| DistError::Data {
            rank: self.rank,
            message: format!("no block of input {}", self.program.slot_names[slot]),
        })?;
        self.live += B::bytes(t);
        if let Some(old) = table[slot].replace(Held::Borrowed(t)) {
            self.live = self.live.saturating_sub(self.cost(slot, old.get()));
        }
        self.peak = self.peak.max(self.live);
        Ok(())
    }

    fn constant(&mut self, table: &mut Table<'a, B::T>, slot: usize, index: usize) -> Result<(), DistError> {
        let t: &'a B::T = self.constants.get(index).copied().ok_or_else(|| DistError::Data {
            rank: self.rank,
            message: format!("no block of constant {}", self.program.slot_names[slot]),
        })?;
        table[slot] = Some(Held::Borrowed(t));
        Ok(())
    }

    /// A kernel: its outputs must have the blocks' shapes the plan's layouts give.
    fn op(&mut self, table: &mut Table<'a, B::T>, at: &At, i: OpInstr<'_>) -> Result<(), DistError> {
        let rank = self.rank;
        let kerr = |m: String| DistError::Kernel { rank, node: i.node.to_string(), op: i.op.to_string(), message: m };
        let vals = &self.vals;
        let ins: Vec<&B::T> = i
            .inputs
            .iter()
            .map(|&s| get(table, vals, s).ok_or(s))
            .collect::<Result<_, _>>()
            .map_err(|s| self.missing(s))?;
        let t1 = self.profile.then(Instant::now);
        let (outs, waited) =
            self.b.eval(i.kernel, &ins, self.program.mesh(), at.stream.as_ref()).map_err(|e| match e {
                KernelFailure::Kernel(m) => kerr(m),
                KernelFailure::Comm(c) => DistError::Comm(c),
            })?;
        if let Some(t1) = t1 {
            self.op_seconds.push((i.id, t1.elapsed().as_secs_f64()));
        }
        self.comm_seconds += waited;
        if outs.len() != i.outputs.len() {
            return Err(kerr(format!("{} outputs, the plan has {}", outs.len(), i.outputs.len())));
        }
        // Blocks of any other shape would only fail later, at a reader, or not at all.
        if let Some((t, want)) = outs.iter().zip(i.shapes).find(|(t, want)| B::shape(t) != want.as_slice()) {
            return Err(kerr(format!("a block of {:?}, the plan's layout needs {want:?}", B::shape(t))));
        }
        for (t, &s) in outs.into_iter().zip(i.outputs) {
            self.write(table, s, t);
        }
        self.peak = self.peak.max(self.live);
        Ok(())
    }

    /// A reshape at its input's last read: the input's buffer becomes the output's (a shared
    /// value is copied: later microbatches read it).
    fn view(
        &mut self,
        table: &mut Table<'a, B::T>,
        id: usize,
        node: &str,
        input: usize,
        output: usize,
        shape: &[usize],
    ) -> Result<(), DistError> {
        let rank = self.rank;
        let kerr = |m: String| DistError::Kernel { rank, node: node.to_string(), op: "reshape".into(), message: m };
        let x = match table[input].take() {
            Some(x) => x,
            None => {
                let shared = self.vals.get(input).and_then(Option::as_ref).ok_or_else(|| self.missing(input))?;
                Held::Owned(self.b.copy(shared.get()).map_err(kerr)?)
            }
        };
        let t1 = self.profile.then(Instant::now);
        let x = x.into_owned(self.b).map_err(kerr)?;
        let y = self.b.reshape(x, shape, self.program.mesh()).map_err(|e| match e {
            KernelFailure::Kernel(m) => kerr(m),
            KernelFailure::Comm(c) => DistError::Comm(c),
        })?;
        if let Some(t1) = t1 {
            self.op_seconds.push((id, t1.elapsed().as_secs_f64()));
        }
        table[output] = Some(Held::Owned(y));
        Ok(())
    }

    fn collective(
        &mut self,
        table: &mut Table<'a, B::T>,
        input: usize,
        output: usize,
        c: &Collective,
    ) -> Result<(), DistError> {
        let t1 = Instant::now();
        let x = get(table, &self.vals, input).ok_or_else(|| self.missing(input))?;
        let y = self.b.collective(c, self.program.mesh(), x)?;
        self.comm_seconds += t1.elapsed().as_secs_f64();
        self.received(table, output, y);
        Ok(())
    }

    /// The tag of transfer `id` for the microbatch: unique within a step.
    fn tag(&self, id: u64, at: &At) -> u64 {
        id * self.program.microbatches.max(1) as u64 + at.m as u64
    }

    fn send(&mut self, table: &Table<'a, B::T>, slot: usize, to: usize, id: u64, at: &At) -> Result<(), DistError> {
        let t1 = Instant::now();
        let (peer, tag) = (self.program.peer(self.rank, to), self.tag(id, at));
        let x = get(table, &self.vals, slot).ok_or_else(|| self.missing(slot))?;
        self.b.send(peer, tag, x)?;
        self.comm_seconds += t1.elapsed().as_secs_f64();
        Ok(())
    }

    fn recv(
        &mut self,
        table: &mut Table<'a, B::T>,
        slot: usize,
        from: usize,
        meta: &ir::TensorMeta,
        id: u64,
        at: &At,
    ) -> Result<(), DistError> {
        let t1 = Instant::now();
        let y = self.b.recv(self.program.peer(self.rank, from), self.tag(id, at), meta)?;
        self.comm_seconds += t1.elapsed().as_secs_f64();
        self.received(table, slot, y);
        Ok(())
    }

    fn free(&mut self, table: &mut Table<'a, B::T>, slots: &[usize]) -> Result<(), DistError> {
        for &s in slots {
            let h = match table[s].take() {
                Some(h) => h,
                None => match self.vals.get_mut(s).and_then(Option::take) {
                    Some(h) => h,
                    // An evaluation skips what the loss does not need.
                    None if self.marks.is_some() => continue,
                    None => return Err(self.missing(s)),
                },
            };
            self.live = self.live.saturating_sub(self.cost(s, h.get()));
        }
        Ok(())
    }

    /// The summed values at positions `which` of `program.accumulate` that `table` holds join
    /// their sums (in the order the microbatches give them): the first becomes the sum, a later
    /// one is added to it.
    fn add_to_sums(
        &mut self,
        table: &mut Table<'a, B::T>,
        acc: &mut [Option<B::T>],
        which: &[usize],
    ) -> Result<(), DistError> {
        let program = self.program;
        for &j in which {
            let slot = program.accumulate[j];
            let Some(h) = table[slot].take() else { continue };
            let rank = self.rank;
            let fail = |message: String| DistError::Kernel {
                rank,
                node: program.slot_names[slot].to_string(),
                op: "accumulate".into(),
                message,
            };
            let x = h.into_owned(self.b).map_err(fail)?;
            acc[j] = Some(match acc[j].take() {
                None => x,
                Some(a) => {
                    let add = Kernel::Same(ir::Op::Binary(ir::BinaryOp::Add));
                    let (mut outs, _) = self.b.eval(&add, &[&a, &x], program.mesh(), None).map_err(|e| match e {
                        KernelFailure::Kernel(msg) => fail(msg),
                        KernelFailure::Comm(c) => DistError::Comm(c),
                    })?;
                    let y = outs.pop().ok_or_else(|| DistError::Plan("accumulating: no sum".into()))?;
                    self.live += B::bytes(&y);
                    self.peak = self.peak.max(self.live);
                    self.live = self.live.saturating_sub(B::bytes(&a) + B::bytes(&x));
                    y
                }
            });
        }
        Ok(())
    }

    /// A microbatch's last step on this stage: what it still holds of the summed values joins
    /// the sums, and what else it holds is left for the update.
    fn end_microbatch(&mut self, mut table: Table<'a, B::T>, acc: &mut [Option<B::T>]) -> Result<(), DistError> {
        let all: Vec<usize> = (0..self.program.accumulate.len()).collect();
        self.add_to_sums(&mut table, acc, &all)?;
        for (s, h) in table.into_iter().enumerate() {
            if let Some(h) = h
                && let Some(old) = self.vals[s].replace(h)
            {
                self.live = self.live.saturating_sub(self.cost(s, old.get()));
            }
        }
        Ok(())
    }

    /// Values read at the end: outputs, updates and (into owned storage) frozen parameters. The
    /// last read of each moves it; earlier ones copy.
    fn finish(mut self, dest: Dest<'a, B::T>, t0: Instant) -> Result<StepResult, DistError> {
        let (program, rank, stage, mode) = (self.program, self.rank, self.stage, self.mode);
        let frozen: &[(String, usize)] = if self.borrowed.is_none() { &program.kept[stage] } else { &[] };
        let updates: &[(String, usize)] = if mode == Mode::Eval { &[] } else { &program.updates[stage] };
        let outputs_read: Vec<&(String, usize, sharding::ShardingSpec, Vec<usize>)> =
            program.outputs.iter().filter(|o| mode != Mode::Eval || o.0 == crate::program::EVAL_OUTPUT).collect();
        let mut reads = vec![0usize; self.vals.len()];
        let end_reads = outputs_read.iter().map(|(_, s, _, _)| s).chain(updates.iter().chain(frozen).map(|(_, s)| s));
        for &s in end_reads {
            reads[s] += 1;
        }
        // Outputs: every rank gets the global value, assembled from its stage's blocks (every
        // stage holds the outputs).
        let everyone = program.stage_ranks(rank);
        let stage_mesh = program.stage_mesh();
        let microbatches = program.microbatches.max(1);
        let mut outputs = BTreeMap::new();
        for (name, slot, spec, shape) in outputs_read {
            let t = if everyone.len() == 1 {
                let x = take_read(self.b, &mut self.vals, &mut reads, *slot)
                    .map_err(|m| DistError::Data { rank, message: format!("output {name}: {m}") })?
                    .ok_or_else(|| self.missing(*slot))?;
                self.b.download(x)?
            } else {
                let x = self.vals[*slot].as_ref().map(Held::get).ok_or_else(|| self.missing(*slot))?;
                let t1 = Instant::now();
                let blocks = self.b.gather_output(&everyone, x)?;
                self.comm_seconds += t1.elapsed().as_secs_f64();
                reads[*slot] -= 1;
                sim::assemble(&blocks, spec, shape, &stage_mesh, f32::INFINITY)
                    .map_err(|e| DistError::Plan(format!("output {name}: {e}")))?
            };
            // The mean over microbatches of what each computed (an output of the update phase is
            // computed once, and not summed).
            let summed = microbatches > 1 && program.accumulate.binary_search(slot).is_ok();
            outputs.insert(name.clone(), if summed { mean_of(t, microbatches) } else { t });
        }
        let mut taken = std::mem::take(&mut self.taken);
        for (name, slot) in updates.iter().chain(frozen) {
            let t = take_read(self.b, &mut self.vals, &mut reads, *slot)
                .map_err(|m| DistError::Data { rank, message: format!("{name}: {m}") })?
                .ok_or_else(|| self.missing(*slot))?;
            taken.insert(name.clone(), t);
        }
        self.vals = vec![];
        match dest {
            Dest::Storage(s) | Dest::Updates(s) => *s = taken,
        }
        Ok(StepResult {
            outputs,
            peak_bytes: self.b.peak_bytes(self.peak),
            resident_bytes: self.resident,
            seconds: t0.elapsed().as_secs_f64(),
            comm_seconds: self.comm_seconds,
            op_seconds: self.op_seconds,
            instr_profile: self.instr_profile,
            data_bytes: 0,
            data_seconds: 0.0,
            data_hash: 0,
        })
    }
}

/// The fields of an [`Exec::Op`].
struct OpInstr<'x> {
    id: usize,
    node: &'x str,
    op: &'x str,
    kernel: &'x Kernel,
    inputs: &'x [usize],
    outputs: &'x [usize],
    shapes: &'x [Vec<usize>],
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
