//! Pipeline schedules: the steps each stage runs, checked and timed.
//!
//! A stage's program is cut into *segments* ([`Segment`]: a phase of a model chunk). A step
//! ([`Step`]) runs one segment for one microbatch; a stage runs its prologue once, its steps
//! in the schedule's order and then its update segment once. [`timeline`] plays every stage's steps together:
//!
//! - a stage runs its steps' instructions in order: ops and collectives take their estimated
//!   seconds, a send never waits (transfers are buffered), a receive waits until the transfer
//!   was sent and then takes its seconds; a step's span runs from its first instruction to its
//!   last (waits included), its work is the span without the waits;
//! - a receive takes the block of its transfer and microbatch (messages are tagged with both);
//!   whether every receive takes the oldest block in flight between its two stages is
//!   recorded ([`Timeline::in_order`]: a back end without tags needs it);
//! - a schedule under which no stage can go on before all have finished deadlocks: an error
//!   naming the stages, their steps and what they wait for.
//!
//! The same play gives the estimate: the seconds of the microbatch steps, each stage's busy
//! time, and the bubble (the idle share).

use std::collections::{HashMap, VecDeque};

use sharding::fx::FxMap;

use crate::{Instr, Phase, Plan, Segment, Step};

/// Every microbatch's phases in segment order, one microbatch after the other (with `weight`,
/// weight-gradient steps too).
pub fn sequential(microbatches: usize, chunks: usize, weight: bool) -> Vec<Step> {
    let mut out = vec![];
    for m in 0..microbatches.max(1) {
        out.extend((0..chunks).map(|c| Step { microbatch: m, chunk: c, phase: Phase::Forward }));
        out.extend((0..chunks).rev().map(|c| Step { microbatch: m, chunk: c, phase: Phase::Backward }));
        if weight {
            out.extend((0..chunks).rev().map(|c| Step { microbatch: m, chunk: c, phase: Phase::Weight }));
        }
    }
    out
}

/// The prologue's segment ([`Phase::Prologue`]): once per step, before the first step.
const PROLOGUE: Segment = Segment { phase: Phase::Prologue, chunk: 0 };

/// The seconds of a segment's work (its transfers' waits aside).
fn busy_seconds(evs: &[Event]) -> f64 {
    evs.iter().map(|e| if let Event::Busy(t) = e { *t } else { 0.0 }).sum()
}

/// When a receive of `t` seconds, of a transfer sent at `sent`, ends on a stage at `now`,
/// and the stage's seconds it takes. Without overlap the stage receives (after waiting for the
/// send); with it ([`crate::OptionsInfo::overlap`]) the transfer runs on the link from its send,
/// beside the stage's work, which waits only for its arrival.
fn received(now: f64, sent: f64, t: f64, overlap: bool) -> (f64, f64) {
    if overlap { (now.max(sent + t), 0.0) } else { (now.max(sent) + t, t) }
}

/// Per stage, the communication seconds [`crate::overlap`] hides (with
/// [`crate::OptionsInfo::overlap`]; zeros without): of the prologue's gathers behind its first
/// forward step, and of the update's gradient reductions behind its last backward (and
/// weight-gradient) step, chunk 0's (the last a schedule runs).
pub fn hidden_seconds(plan: &Plan) -> Vec<(f64, f64)> {
    let stages = plan.stages();
    if !plan.options.overlap {
        return vec![(0.0, 0.0); stages];
    }
    let p = &plan.program;
    let marks = crate::overlap::on_comm_stream(p, &|i| i.phase() == Phase::Update);
    let seg = |ph: Phase| Segment { phase: ph, chunk: 0 };
    (0..stages)
        .map(|s| {
            let of = |segs: &[Segment]| {
                let on = |k: &usize| p[*k].segment_on(s).is_some_and(|g| segs.contains(&g));
                crate::overlap::play((0..p.len()).filter(on).map(|k| (&p[k], marks[k]))).overlapped()
            };
            (of(&[PROLOGUE, seg(Phase::Forward)]), of(&[seg(Phase::Backward), seg(Phase::Weight), seg(Phase::Update)]))
        })
        .collect()
}

/// One step as played by [`timeline`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Span {
    /// The step (`None`: the update, once after the steps).
    pub step: Option<Step>,
    /// Start, seconds from the start of the training step.
    pub start: f64,
    /// End.
    pub end: f64,
}

/// The schedule as played (see the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct Timeline {
    /// Per stage, its spans in order (the update last).
    pub spans: Vec<Vec<Span>>,
    /// From the first step's start to the last microbatch step's end.
    pub seconds: f64,
    /// The training step: until the last update ends.
    pub step_seconds: f64,
    /// Per stage, the seconds of its microbatch steps' work (ops, collectives, receiving; not
    /// waiting).
    pub busy: Vec<f64>,
    /// The idle share of the stages over `seconds`: `1 - sum(busy) / (stages * seconds)`.
    pub bubble: f64,
    /// Whether every receive took the oldest transfer in flight from its sender (so blocks
    /// meet in the order sent, without tags).
    pub in_order: bool,
}

/// A transfer in flight: its instruction, microbatch, and when it was sent.
type Sent = (usize, usize, f64);

/// What a stage does in a segment, in program order.
#[derive(Clone, Copy)]
enum Event {
    /// Computes (ops, collectives) for some seconds.
    Busy(f64),
    /// Sends transfer `k` to a stage.
    Send(usize, usize),
    /// Receives transfer `k` from a stage, taking some seconds.
    Recv(usize, usize, f64),
}

/// The most model chunks a stage may have.
pub const MAX_CHUNKS: usize = 1024;

/// What is wrong with the plan's steps as a list (each stage's steps a permutation of every
/// microbatch's segments, in segment order within a microbatch); empty when nothing is.
pub fn check_steps(plan: &Plan) -> Vec<String> {
    let mut out = vec![];
    let (m, chunks) = (plan.microbatches.max(1), plan.chunks());
    let weight = plan.program.iter().any(|i| i.phase() == Phase::Weight);
    let phases: Vec<Phase> =
        [Phase::Forward, Phase::Backward].into_iter().chain(weight.then_some(Phase::Weight)).collect();
    if chunks > MAX_CHUNKS {
        out.push(format!("{chunks} model chunks per stage (at most {MAX_CHUNKS})"));
        return out;
    }
    let want = m.saturating_mul(chunks).saturating_mul(phases.len());
    let steps = plan.steps();
    if steps.len() != plan.stages() {
        out.push(format!("the schedule has steps for {} stages, the plan has {}", steps.len(), plan.stages()));
        return out;
    }
    for (s, list) in steps.iter().enumerate() {
        let mut seen = std::collections::HashSet::new();
        let mut last: HashMap<usize, (u8, usize)> = HashMap::new();
        for st in list {
            let why = if st.microbatch >= m {
                Some(format!("step {st} of a microbatch past the plan's {m}"))
            } else if st.chunk >= chunks {
                Some(format!("step {st} of a chunk past the plan's {chunks}"))
            } else if !phases.contains(&st.phase) {
                Some(format!("step {st}: the program has no {:?} phase", st.phase))
            } else if !seen.insert(*st) {
                Some(format!("step {st} twice"))
            } else {
                let r = st.segment().rank(chunks);
                match last.insert(st.microbatch, r) {
                    Some(prev) if prev >= r => Some(format!(
                        "step {st} comes after a later part of microbatch {} (a microbatch runs its forward chunks \
                         first to last, then its backward and weight-gradient chunks last to first)",
                        st.microbatch
                    )),
                    _ => None,
                }
            };
            if let Some(why) = why {
                out.push(format!("stage {s}'s schedule: {why}"));
            }
        }
        if out.is_empty() && seen.len() != want {
            out.push(format!(
                "stage {s}'s schedule has {} steps; {m} microbatches of {chunks} chunk(s) and {} phases make {want}",
                seen.len(),
                phases.len()
            ));
        }
    }
    out
}

/// Plays the plan's schedule (see the module docs): the timeline, or why the stages cannot
/// run it (mismatched transfers, a deadlock).
///
/// The same play as [`timeline_exact`], to the bit, without its per-instruction lookups: each
/// step's events are found once, and the transfers in flight are kept per pair of stages.
pub fn timeline(plan: &Plan) -> Result<Timeline, String> {
    let stages = plan.stages();
    // Each stage's segments, by a small index, and their events in program order.
    let mut ids: Vec<FxMap<Segment, usize>> = vec![FxMap::default(); stages];
    let mut segs: Vec<Vec<Vec<Event>>> = vec![vec![]; stages];
    let mut push = |s: usize, seg: Segment, ev: Event| {
        if s >= stages {
            return;
        }
        let next = segs[s].len();
        let id = *ids[s].entry(seg).or_insert(next);
        if id == next {
            segs[s].push(vec![]);
        }
        segs[s][id].push(ev);
    };
    // The update's gradient reductions hidden behind the last backward: its work shortened.
    let hidden = hidden_seconds(plan);
    for (s, &(_, late)) in hidden.iter().enumerate() {
        if late > 0.0 {
            push(s, Segment { phase: Phase::Update, chunk: 0 }, Event::Busy(-late));
        }
    }
    for (k, ins) in plan.program.iter().enumerate() {
        match ins {
            Instr::Op { stage, seconds, .. } | Instr::Collective { stage, seconds, .. } => {
                if let Some(seg) = ins.segment_on(*stage) {
                    push(*stage, seg, Event::Busy(*seconds));
                }
            }
            Instr::Free { .. } => {}
            Instr::Transfer { from, to, seconds, .. } => {
                if let (Some(a), Some(b)) = (ins.segment_on(*from), ins.segment_on(*to)) {
                    push(*from, a, Event::Send(k, *to));
                    push(*to, b, Event::Recv(k, *from, *seconds));
                }
            }
        }
    }
    let update = Segment { phase: Phase::Update, chunk: 0 };
    let steps = plan.steps();
    if steps.len() != stages {
        return Err(format!("the schedule has steps for {} stages, the plan has {stages}", steps.len()));
    }
    // Each stage's steps, then its update (`None`), with their events.
    let lists: Vec<Vec<(Option<Step>, &[Event])>> = steps
        .into_iter()
        .enumerate()
        .map(|(s, l)| {
            let events = |seg: Segment| ids[s].get(&seg).map_or(&[][..], |&id| segs[s][id].as_slice());
            l.into_iter()
                .map(|st| (Some(st), events(st.segment())))
                .chain(std::iter::once((None, events(update))))
                .collect()
        })
        .collect();
    // In flight: per (from, to), the transfers sent and not yet received (instruction,
    // microbatch, when sent).
    let mut channels: Vec<VecDeque<Sent>> = vec![VecDeque::new(); stages * stages];
    // Per stage: its step, the event within it, and when the step started.
    let mut pos = vec![(0usize, 0usize, 0.0f64); stages];
    // A stage's prologue (no transfers) runs before its first step.
    let mut clock: Vec<f64> = (0..stages)
        .map(|s| ids[s].get(&PROLOGUE).map_or(0.0, |&id| busy_seconds(&segs[s][id])) - hidden[s].0)
        .collect();
    let mut spans: Vec<Vec<Span>> = lists.iter().map(|l| Vec::with_capacity(l.len())).collect();
    // Per stage, the seconds of its microbatch steps' work (waits excluded).
    let mut busy = vec![0.0; stages];
    let mut in_order = true;
    loop {
        let mut progress = false;
        for s in 0..stages {
            let (mut at, mut ev_at, mut started) = pos[s];
            let (mut now, mut worked) = (clock[s], busy[s]);
            'steps: while let Some(&(st, evs)) = lists[s].get(at) {
                let mb = st.map_or(0, |x| x.microbatch);
                let work = if st.is_some() { 1.0 } else { 0.0 };
                if ev_at == 0 {
                    started = now;
                }
                while let Some(&ev) = evs.get(ev_at) {
                    match ev {
                        Event::Busy(t) => {
                            now += t;
                            worked += t * work;
                        }
                        // (A transfer naming a stage past the plan's is never received.)
                        Event::Send(k, to) => {
                            if to < stages {
                                channels[s * stages + to].push_back((k, mb, now));
                            }
                        }
                        Event::Recv(k, from, t) => {
                            let Some(q) = (from < stages).then(|| &mut channels[from * stages + s]) else {
                                break 'steps;
                            };
                            let Some(i) = q.iter().position(|&(got, got_mb, _)| (got, got_mb) == (k, mb)) else {
                                break 'steps;
                            };
                            in_order &= i == 0;
                            let Some((_, _, sent)) = q.remove(i) else { break 'steps };
                            let (end, took) = received(now, sent, t, plan.options.overlap);
                            now = end;
                            worked += took * work;
                        }
                    }
                    ev_at += 1;
                    progress = true;
                }
                spans[s].push(Span { step: st, start: started, end: now });
                (at, ev_at, started) = (at + 1, 0, now);
                progress = true;
            }
            pos[s] = (at, ev_at, started);
            (clock[s], busy[s]) = (now, worked);
        }
        if (0..stages).all(|s| pos[s].0 == lists[s].len()) {
            break;
        }
        if !progress {
            return Err(deadlock(plan, &pos, &lists));
        }
    }
    Ok(finish(spans, busy, in_order))
}

/// The error of a schedule under which no stage can go on.
fn deadlock(plan: &Plan, pos: &[(usize, usize, f64)], lists: &[Vec<(Option<Step>, &[Event])>]) -> String {
    let name = |k: usize| match &plan.program[k] {
        Instr::Transfer { value, .. } => match plan.graph.g.node_weight(ir::NodeIndex::new(value.node)) {
            Some(n) => format!("{value} ({})", n.name),
            None => value.to_string(),
        },
        _ => format!("instruction {k}"),
    };
    let show = |st: Option<Step>| st.map_or("the update".to_string(), |s| s.to_string());
    let stuck: Vec<String> = (0..lists.len())
        .filter(|&s| pos[s].0 < lists[s].len())
        .map(|s| {
            let (st, evs) = lists[s][pos[s].0];
            let waits = match evs.get(pos[s].1) {
                Some(Event::Recv(k, from, _)) => format!("{} from stage {from}", name(*k)),
                _ => "nothing".into(),
            };
            format!("stage {s} at {} waits for {waits}", show(st))
        })
        .collect();
    format!("the schedule deadlocks: {}", stuck.join("; "))
}

/// The timeline of the stages' spans.
fn finish(spans: Vec<Vec<Span>>, busy: Vec<f64>, in_order: bool) -> Timeline {
    let stages = spans.len();
    let (mut first, mut last, mut step_seconds) = (f64::INFINITY, 0.0f64, 0.0f64);
    for list in &spans {
        for sp in list {
            step_seconds = step_seconds.max(sp.end);
            if sp.step.is_some() {
                first = first.min(sp.start);
                last = last.max(sp.end);
            }
        }
    }
    let seconds = if first.is_finite() { last - first } else { 0.0 };
    let bubble = if seconds > 0.0 { 1.0 - busy.iter().sum::<f64>() / (stages as f64 * seconds) } else { 0.0 };
    Timeline { spans, seconds, step_seconds, busy, bubble: bubble.max(0.0), in_order }
}

/// [`timeline`] as first written, looking each instruction's segment up as it plays it: the
/// reference the faster play is checked against.
pub fn timeline_exact(plan: &Plan) -> Result<Timeline, String> {
    let stages = plan.stages();
    let mut segs: HashMap<(usize, Segment), Vec<Event>> = HashMap::new();
    for (k, ins) in plan.program.iter().enumerate() {
        match ins {
            Instr::Op { stage, seconds, .. } | Instr::Collective { stage, seconds, .. } => {
                if let Some(seg) = ins.segment_on(*stage) {
                    segs.entry((*stage, seg)).or_default().push(Event::Busy(*seconds));
                }
            }
            Instr::Free { .. } => {}
            Instr::Transfer { from, to, seconds, .. } => {
                if let (Some(a), Some(b)) = (ins.segment_on(*from), ins.segment_on(*to)) {
                    segs.entry((*from, a)).or_default().push(Event::Send(k, *to));
                    segs.entry((*to, b)).or_default().push(Event::Recv(k, *from, *seconds));
                }
            }
        }
    }
    let update = Segment { phase: Phase::Update, chunk: 0 };
    let hidden = hidden_seconds(plan);
    for (s, &(_, late)) in hidden.iter().enumerate() {
        if late > 0.0 {
            segs.entry((s, update)).or_default().insert(0, Event::Busy(-late));
        }
    }
    // Each stage's steps, then its update (`None`).
    let lists: Vec<Vec<Option<Step>>> =
        plan.steps().into_iter().map(|l| l.into_iter().map(Some).chain(std::iter::once(None)).collect()).collect();
    if lists.len() != stages {
        return Err(format!("the schedule has steps for {} stages, the plan has {stages}", lists.len()));
    }
    let events = |s: usize, st: Option<Step>| -> &[Event] {
        segs.get(&(s, st.map_or(update, Step::segment))).map(Vec::as_slice).unwrap_or(&[])
    };
    // In flight: per (from, to), the transfers sent and not yet received (instruction,
    // microbatch, when sent).
    let mut channels: HashMap<(usize, usize), VecDeque<Sent>> = HashMap::new();
    // Per stage: its step, the event within it, and when the step started.
    let mut pos = vec![(0usize, 0usize, 0.0f64); stages];
    let mut clock: Vec<f64> =
        (0..stages).map(|s| segs.get(&(s, PROLOGUE)).map_or(0.0, |evs| busy_seconds(evs)) - hidden[s].0).collect();
    let mut spans: Vec<Vec<Span>> = vec![vec![]; stages];
    // Per stage, the seconds of its microbatch steps' work (waits excluded).
    let mut busy = vec![0.0; stages];
    let mut in_order = true;
    let name = |k: usize| match &plan.program[k] {
        Instr::Transfer { value, .. } => match plan.graph.g.node_weight(ir::NodeIndex::new(value.node)) {
            Some(n) => format!("{value} ({})", n.name),
            None => value.to_string(),
        },
        _ => format!("instruction {k}"),
    };
    let show = |st: Option<Step>| st.map_or("the update".to_string(), |s| s.to_string());
    loop {
        let mut progress = false;
        for s in 0..stages {
            while let Some(&st) = lists[s].get(pos[s].0) {
                let evs = events(s, st);
                let mb = st.map_or(0, |x| x.microbatch);
                if pos[s].1 == 0 {
                    pos[s].2 = clock[s];
                }
                let Some(&ev) = evs.get(pos[s].1) else {
                    spans[s].push(Span { step: st, start: pos[s].2, end: clock[s] });
                    pos[s] = (pos[s].0 + 1, 0, clock[s]);
                    progress = true;
                    continue;
                };
                let work = if st.is_some() { 1.0 } else { 0.0 };
                match ev {
                    Event::Busy(t) => {
                        clock[s] += t;
                        busy[s] += t * work;
                    }
                    Event::Send(k, to) => channels.entry((s, to)).or_default().push_back((k, mb, clock[s])),
                    Event::Recv(k, from, t) => {
                        let q = channels.entry((from, s)).or_default();
                        let Some(i) = q.iter().position(|&(got, got_mb, _)| (got, got_mb) == (k, mb)) else {
                            break;
                        };
                        in_order &= i == 0;
                        let Some((_, _, at)) = q.remove(i) else { break };
                        let (end, took) = received(clock[s], at, t, plan.options.overlap);
                        clock[s] = end;
                        busy[s] += took * work;
                    }
                }
                pos[s].1 += 1;
                progress = true;
            }
        }
        if (0..stages).all(|s| pos[s].0 == lists[s].len()) {
            break;
        }
        if !progress {
            let stuck: Vec<String> = (0..stages)
                .filter(|&s| pos[s].0 < lists[s].len())
                .map(|s| {
                    let st = lists[s][pos[s].0];
                    let waits = match events(s, st).get(pos[s].1) {
                        Some(Event::Recv(k, from, _)) => format!("{} from stage {from}", name(*k)),
                        _ => "nothing".into(),
                    };
                    format!("stage {s} at {} waits for {waits}", show(st))
                })
                .collect();
            return Err(format!("the schedule deadlocks: {}", stuck.join("; ")));
        }
    }
    let (mut first, mut last, mut step_seconds) = (f64::INFINITY, 0.0f64, 0.0f64);
    for list in &spans {
        for sp in list {
            step_seconds = step_seconds.max(sp.end);
            if sp.step.is_some() {
                first = first.min(sp.start);
                last = last.max(sp.end);
            }
        }
    }
    let seconds = if first.is_finite() { last - first } else { 0.0 };
    let bubble = if seconds > 0.0 { 1.0 - busy.iter().sum::<f64>() / (stages as f64 * seconds) } else { 0.0 };
    Ok(Timeline { spans, seconds, step_seconds, busy, bubble: bubble.max(0.0), in_order })
}
