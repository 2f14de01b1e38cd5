//! Pipeline schedules: the order of every stage's microbatch steps ([`steps`]).
//!
//! - **sequential**: each microbatch's forward and backward before the next one's.
//! - **GPipe**: every forward, then every backward.
//! - **1F1B**: stage `i` of `S` runs `S-1-i` forwards ahead (warm-up), then one forward and one
//!   backward in turn, then the remaining backwards; it holds at most `S-i` microbatches'
//!   activations, and its bubble is `(S-1)/(M+S-1)` of the step on a uniform model.
//! - **interleaved 1F1B** (Megatron's virtual stages): `v` model chunks per stage; forwards and
//!   backwards walk the chunks in groups of `S` microbatches, the warm-up is
//!   `2(S-1-i) + (v-1)S` forwards; the bubble shrinks by `v`. Needs `M` a multiple of `S`.
//! - **ZB-H1** (zero bubble, Qi et al. 2024): the backward is split into the input gradients
//!   other stages wait for (B) and the weight gradients nobody waits for (W); a stage runs a
//!   ready B first, else a ready forward while fewer than `S` microbatches are in flight (from
//!   forward to weight gradient: 1F1B's largest count), else a pending W. The Ws fill the waits
//!   1F1B has. The order comes from playing this policy with each stage's estimated step
//!   seconds; any order it gives is valid (the plan's validation checks it).

use plan::{Phase, ScheduleKind, Step};

use crate::{Error, Result};

/// Seconds of one microbatch's forward, backward and weight-gradient step on each stage (the
/// policy of ZB-H1 needs them).
#[derive(Clone, Debug, Default)]
pub struct StepSeconds {
    /// Per stage: forward, backward, weight gradient.
    pub per_stage: Vec<[f64; 3]>,
}

/// Each stage's steps under `kind` (see the module docs).
pub fn steps(
    kind: ScheduleKind,
    stages: usize,
    microbatches: usize,
    chunks: usize,
    seconds: &StepSeconds,
) -> Result<Vec<Vec<Step>>> {
    let m = microbatches.max(1);
    let f = |mb: usize, chunk: usize| Step { microbatch: mb, chunk, phase: Phase::Forward };
    let b = |mb: usize, chunk: usize| Step { microbatch: mb, chunk, phase: Phase::Backward };
    if chunks > 1 && kind != ScheduleKind::Interleaved {
        return Err(Error::Pipeline(format!("{chunks} model chunks per stage need the interleaved schedule")));
    }
    Ok(match kind {
        ScheduleKind::Sequential => (0..stages).map(|_| plan::schedule::sequential(m, chunks, false)).collect(),
        ScheduleKind::Gpipe => {
            (0..stages).map(|_| (0..m).map(|x| f(x, 0)).chain((0..m).map(|x| b(x, 0))).collect()).collect()
        }
        ScheduleKind::OneFOneB => (0..stages)
            .map(|i| {
                let warm = (stages - 1 - i).min(m);
                let mut out: Vec<Step> = (0..warm).map(|x| f(x, 0)).collect();
                for j in 0..m - warm {
                    out.push(f(warm + j, 0));
                    out.push(b(j, 0));
                }
                out.extend((m - warm..m).map(|x| b(x, 0)));
                out
            })
            .collect(),
        ScheduleKind::Interleaved => {
            if chunks < 2 {
                return Err(Error::Pipeline("the interleaved schedule needs at least 2 model chunks per stage".into()));
            }
            if !m.is_multiple_of(stages) {
                return Err(Error::Pipeline(format!(
                    "the interleaved schedule runs microbatches in groups of the {stages} stages: {m} microbatches \
                     is not a multiple of {stages}"
                )));
            }
            let total = m * chunks;
            // The k-th forward (backward) step of a stage: microbatch and chunk.
            let mb_of = |k: usize| (k / (stages * chunks)) * stages + k % stages;
            let fwd_chunk = |k: usize| (k / stages) % chunks;
            (0..stages)
                .map(|i| {
                    let warm = ((stages - 1 - i) * 2 + (chunks - 1) * stages).min(total);
                    let mut out: Vec<Step> = (0..warm).map(|k| f(mb_of(k), fwd_chunk(k))).collect();
                    for j in 0..total - warm {
                        let k = warm + j;
                        out.push(f(mb_of(k), fwd_chunk(k)));
                        out.push(b(mb_of(j), chunks - 1 - fwd_chunk(j)));
                    }
                    out.extend((total - warm..total).map(|j| b(mb_of(j), chunks - 1 - fwd_chunk(j))));
                    out
                })
                .collect()
        }
        ScheduleKind::ZbH1 => zb_h1(stages, m, seconds),
    })
}

/// ZB-H1's order (see the module docs), played with `seconds` (a stage without figures takes
/// one second per step).
fn zb_h1(stages: usize, m: usize, seconds: &StepSeconds) -> Vec<Vec<Step>> {
    let t = |s: usize, p: usize| seconds.per_stage.get(s).map_or(1.0, |x| x[p].max(1e-12));
    // When each microbatch's forward / backward ended on each stage.
    let mut f_end: Vec<Vec<Option<f64>>> = vec![vec![None; m]; stages];
    let mut b_end: Vec<Vec<Option<f64>>> = vec![vec![None; m]; stages];
    let (mut next_f, mut next_b, mut next_w) = (vec![0usize; stages], vec![0usize; stages], vec![0usize; stages]);
    let mut clock = vec![0.0f64; stages];
    let mut out: Vec<Vec<Step>> = vec![vec![]; stages];
    let done = |s: usize, nw: &[usize]| nw[s] == m;
    while (0..stages).any(|s| !done(s, &next_w)) {
        // The stage with the earliest clock decides: every step that ends by then is known.
        let Some(s) =
            (0..stages).filter(|&s| !done(s, &next_w)).min_by(|&a, &b| clock[a].total_cmp(&clock[b]).then(a.cmp(&b)))
        else {
            break;
        };
        let now = clock[s];
        // When the next backward and forward can start (None: not yet known).
        let b_ready = (next_b[s] < next_f[s]).then(|| {
            let mb = next_b[s];
            let own = f_end[s][mb];
            let from = if s + 1 < stages { b_end[s + 1][mb] } else { own };
            own.zip(from).map(|(a, b)| a.max(b))
        });
        let f_ready = (next_f[s] < m && next_f[s] - next_w[s] < stages).then(|| {
            let mb = next_f[s];
            if s == 0 { Some(0.0) } else { f_end[s - 1][mb] }
        });
        let pick = |ready: Option<Option<f64>>| ready.flatten().filter(|&r| r <= now);
        let (phase, start) = if let Some(r) = pick(b_ready) {
            (Phase::Backward, r.max(now))
        } else if let Some(r) = pick(f_ready) {
            (Phase::Forward, r.max(now))
        } else if next_w[s] < next_b[s] {
            (Phase::Weight, now)
        } else {
            // Wait for the next step to become ready, or for another stage to move on.
            let later = [b_ready.flatten(), f_ready.flatten()].into_iter().flatten().filter(|&r| r > now);
            let others = (0..stages).filter(|&o| o != s && !done(o, &next_w)).map(|o| clock[o]).filter(|&c| c > now);
            match later.chain(others).min_by(f64::total_cmp) {
                Some(next) => clock[s] = next,
                // Nothing will change: give up on the policy and finish in 1F1B order.
                None => clock[s] = now + t(s, 0),
            }
            continue;
        };
        let (mb, p) = match phase {
            Phase::Forward => (next_f[s], 0),
            Phase::Backward => (next_b[s], 1),
            _ => (next_w[s], 2),
        };
        let end = start + t(s, p);
        match phase {
            Phase::Forward => {
                f_end[s][mb] = Some(end);
                next_f[s] += 1;
            }
            Phase::Backward => {
                b_end[s][mb] = Some(end);
                next_b[s] += 1;
            }
            _ => next_w[s] += 1,
        }
        clock[s] = end;
        out[s].push(Step { microbatch: mb, chunk: 0, phase });
    }
    out
}
