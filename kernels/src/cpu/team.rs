//! A fork-join team for one [`super::CpuContext`]: the calling thread and `threads - 1` helpers
//! that persist for the context's life.
//!
//! Why not rayon's pool: every kernel call came from the runtime's own thread, so each parallel
//! op paid `ThreadPool::install` (the caller hands the job over and sleeps until a worker is done)
//! plus the wake of workers that had gone to sleep between ops: 20 to 100 us an op on the 2-core
//! machine (measured with a 2-thread pool: `install` + `join` of empty work 21 us back to back,
//! 75-107 us after 0.1-1 ms idle), more than many ops of a training step take. Here the caller
//! runs tasks itself, and helpers spin for [`SPIN`] after their last task before they park, as
//! OpenMP runtimes do: ops of a step follow each other within microseconds, so helpers are
//! usually awake when the next op forks.
//!
//! Invariants:
//! - [`Team::run`] returns only once every task has run and no helper holds the job any more, so
//!   the job may borrow from the caller's stack.
//! - One job at a time: a call made while the team is busy (from inside a task, or from another
//!   thread sharing the context) runs its tasks inline, in order, on the calling thread.
//! - A panic in a task is caught, the other tasks still complete, and the first payload is
//!   resumed on the caller.

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Arc, Mutex};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

/// How long an idle helper spins (yielding its core to any other runnable thread) before it parks.
pub(crate) const SPIN: Duration = Duration::from_micros(200);

/// Spins before a waiting thread starts yielding its core.
const SPINS_BEFORE_YIELD: u32 = 64;

type Job = dyn Fn(usize) + Sync;

/// State the caller and the helpers share.
struct Shared {
    /// Bumped (SeqCst) when a job is published or the team stops.
    epoch: AtomicU64,
    /// The current job (a `&Job` with its lifetime erased), valid while `live`.
    job: Mutex<Option<JobPtr>>,
    /// True from a job's publication until its caller has seen every task done.
    live: AtomicBool,
    /// Helpers between entering a job and leaving it.
    inside: AtomicUsize,
    /// Next task to claim, tasks of the job, tasks done.
    next: AtomicUsize,
    tasks: AtomicUsize,
    done: AtomicUsize,
    /// A caller holds the team.
    busy: AtomicBool,
    stop: AtomicBool,
    /// Helpers parked (or about to): the caller unparks them after publishing.
    parked: Vec<AtomicBool>,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

#[derive(Clone, Copy)]
struct JobPtr(*const Job);
// SAFETY: the pointee is `Sync`, and `Team::run` keeps it alive while any helper can reach it.
unsafe impl Send for JobPtr {}

/// See the module docs.
pub(crate) struct Team {
    shared: Arc<Shared>,
    helpers: Vec<(Thread, Option<JoinHandle<()>>)>,
}

impl Team {
    /// A team of the caller and `threads - 1` helper threads named `{name}-{i}`.
    pub(crate) fn new(threads: usize, name: &str) -> std::io::Result<Team> {
        let n = threads.saturating_sub(1);
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            job: Mutex::new(None),
            live: AtomicBool::new(false),
            inside: AtomicUsize::new(0),
            next: AtomicUsize::new(0),
            tasks: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            busy: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            parked: (0..n).map(|_| AtomicBool::new(false)).collect(),
            panic: Mutex::new(None),
        });
        let mut team = Team { shared: shared.clone(), helpers: Vec::with_capacity(n) };
        for i in 0..n {
            let s = shared.clone();
            // On an error here, dropping `team` stops the helpers already started.
            let h = std::thread::Builder::new().name(format!("{name}-{}", i + 1)).spawn(move || helper(&s, i))?;
            team.helpers.push((h.thread().clone(), Some(h)));
        }
        Ok(team)
    }

    /// Runs `f(i)` for every `i` in `0..tasks`, over the caller and the helpers (tasks are claimed
    /// in order, one at a time). See the module docs for nesting and panics.
    pub(crate) fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        let s = &*self.shared;
        if tasks <= 1 || self.helpers.is_empty() || s.busy.compare_exchange(false, true, Acquire, Relaxed).is_err() {
            (0..tasks).for_each(f);
            return;
        }
        // SAFETY: only the lifetime is erased; the job is withdrawn (`live` false, `inside` 0)
        // before this function returns or unwinds.
        let ptr: *const Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), &'static Job>(f) };
        *s.job.lock().unwrap_or_else(|e| e.into_inner()) = Some(JobPtr(ptr));
        s.next.store(0, Relaxed);
        s.done.store(0, Relaxed);
        s.tasks.store(tasks, Relaxed);
        s.live.store(true, SeqCst);
        s.epoch.fetch_add(1, SeqCst);
        for ((t, _), p) in self.helpers.iter().zip(&s.parked) {
            if p.load(SeqCst) {
                t.unpark();
            }
        }
        claim(s, f);
        let mut spins = 0;
        while s.done.load(Acquire) < tasks {
            wait(&mut spins);
        }
        s.live.store(false, SeqCst);
        while s.inside.load(SeqCst) != 0 {
            wait(&mut spins);
        }
        *s.job.lock().unwrap_or_else(|e| e.into_inner()) = None;
        let theirs = s.panic.lock().unwrap_or_else(|e| e.into_inner()).take();
        s.busy.store(false, Release);
        if let Some(p) = theirs {
            resume_unwind(p);
        }
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        self.shared.stop.store(true, SeqCst);
        self.shared.epoch.fetch_add(1, SeqCst);
        for (t, h) in &mut self.helpers {
            t.unpark();
            if let Some(h) = h.take() {
                let _ = h.join();
            }
        }
    }
}

/// Claims and runs tasks of the current job until none is left; a task's panic is kept for the
/// caller.
fn claim(s: &Shared, f: &(dyn Fn(usize) + Sync)) {
    let n = s.tasks.load(Relaxed);
    loop {
        let i = s.next.fetch_add(1, Relaxed);
        if i >= n {
            return;
        }
        let r = catch_unwind(AssertUnwindSafe(|| f(i)));
        s.done.fetch_add(1, Release);
        if let Err(p) = r {
            s.panic.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(p);
        }
    }
}

fn wait(spins: &mut u32) {
    if *spins < SPINS_BEFORE_YIELD {
        *spins += 1;
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}

fn helper(s: &Shared, me: usize) {
    let mut seen = s.epoch.load(SeqCst);
    loop {
        // Spin, then park, until a new epoch.
        let t0 = Instant::now();
        let mut spins = 0;
        // (`stop` too: a team dropped before this helper first read the epoch bumped it already.)
        let idle = || s.epoch.load(SeqCst) == seen && !s.stop.load(SeqCst);
        while idle() {
            if spins >= SPINS_BEFORE_YIELD && t0.elapsed() > SPIN {
                s.parked[me].store(true, SeqCst);
                while idle() {
                    std::thread::park();
                }
                s.parked[me].store(false, SeqCst);
                break;
            }
            wait(&mut spins);
        }
        if s.stop.load(SeqCst) {
            return;
        }
        seen = s.epoch.load(SeqCst);
        s.inside.fetch_add(1, SeqCst);
        // The job is the one of `seen` only while it is live and no newer one was published;
        // holding `inside` keeps its caller from withdrawing it.
        if s.live.load(SeqCst) && s.epoch.load(SeqCst) == seen {
            let job = *s.job.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(JobPtr(p)) = job {
                // SAFETY: the caller keeps the job alive while `live` and `inside > 0`.
                claim(s, unsafe { &*p });
            }
        }
        s.inside.fetch_sub(1, SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once_and_nesting_runs_inline() {
        let team = Team::new(3, "t").unwrap();
        for tasks in [0, 1, 2, 7, 100] {
            let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
            team.run(tasks, &|i| {
                hits[i].fetch_add(1, Relaxed);
                // A nested call runs inline and still runs every task.
                let inner = AtomicUsize::new(0);
                team.run(4, &|_| {
                    inner.fetch_add(1, Relaxed);
                });
                assert_eq!(inner.load(Relaxed), 4);
            });
            assert!(hits.iter().all(|h| h.load(Relaxed) == 1), "{tasks} tasks");
        }
    }

    #[test]
    fn a_panicking_task_reaches_the_caller_after_the_others_ran() {
        let team = Team::new(2, "t").unwrap();
        let ran = AtomicUsize::new(0);
        let r = catch_unwind(AssertUnwindSafe(|| {
            team.run(8, &|i| {
                ran.fetch_add(1, Relaxed);
                assert!(i != 5, "task five");
            })
        }));
        assert!(r.is_err());
        assert_eq!(ran.load(Relaxed), 8);
        // The team is usable afterwards, after its helpers have parked.
        std::thread::sleep(SPIN * 3);
        let ran = AtomicUsize::new(0);
        team.run(8, &|_| {
            ran.fetch_add(1, Relaxed);
        });
        assert_eq!(ran.load(Relaxed), 8);
    }
}
