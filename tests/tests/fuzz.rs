//! Mutation fuzzing of the readers of untrusted input (issue 22, item 7): the ONNX importer, the
//! `.npy` reader, plan.json loading (validation, then the runtime's compilation of the plan) and
//! the IOPDDL problem reader. `cargo fuzz` needs a nightly toolchain, so this is a hand-rolled
//! fuzzer running as ordinary tests, one per target.
//!
//! Each target mutates a committed seed corpus (`tests/data/fuzz/<target>/`) with byte flips,
//! truncations, splices and format-aware edits (numbers replaced by 0, -1, huge values or NaN
//! strings, fields removed or duplicated; ONNX models decoded with prost, their dims, attributes,
//! names and data edited, then re-encoded). Inputs that end in a new kind of outcome (a new error
//! message, or acceptance) join the pool that later mutations start from, so mutations stack.
//! Every input runs on a worker thread under `catch_unwind` (the panic hook is silenced there) and
//! a per-input time cap; a counting global allocator refuses any allocation above a cap and any
//! growth of the live total past it.
//!
//! Failures: a panic is recorded (one per panic location) and saved under
//! `target/tmp/fuzz/<target>/`; the run goes on to find other causes and fails at the end,
//! naming every saved file. A time-out saves the input and fails at once. A refused allocation
//! aborts the test binary (Rust's allocation-error handler aborts; the input is written to
//! `target/tmp/fuzz/<target>/current` before each run, and the abort message names it).
//!
//! Settings (environment):
//! - `AUTOPAR_FUZZ_SECS`: seconds per target (default 5, so the normal test run stays fast);
//! - `AUTOPAR_FUZZ_SEED`: the random seed (default: from the clock; printed);
//! - `AUTOPAR_FUZZ_INPUT_SECS`: the per-input time cap (default 10);
//! - `AUTOPAR_FUZZ_MAX_BYTES`: the allocation cap, single and live total (default 1 GiB);
//! - `AUTOPAR_FUZZ_SHOW_KINDS`: print each new kind of outcome (for tuning the mutators);
//! - `AUTOPAR_FUZZ_REPLAY=FILE` (an absolute path): run only FILE through each selected target,
//!   once, and report (`cargo test --workspace --test fuzz fuzz_onnx -- --nocapture` with it set
//!   replays one ONNX input).
//!
//! Each target prints its executions (`-- --nocapture` shows them).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::Once;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use prost::Message;
use serde_json::Value;
use tract_onnx::pb;

// ---------------------------------------------------------------------------------------------
// The allocation cap.

/// Refuses (returns null for) any allocation above [`CAP`] bytes, and any that would take the
/// live total past it. Fallible allocations (`try_reserve`) then take their error path; the
/// infallible ones abort the binary through Rust's allocation-error handler, after
/// [`refused`] has named the target whose input is to blame.
struct Capped;

/// The cap in bytes (set from `AUTOPAR_FUZZ_MAX_BYTES` before the first target runs).
static CAP: AtomicUsize = AtomicUsize::new(1 << 30);
/// Bytes live through this allocator.
static LIVE: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// The target a fuzz worker thread runs (empty on other threads); `const` and `Drop`-free so
    /// the allocator may read it.
    static WORKER: Cell<&'static str> = const { Cell::new("") };
}

impl Capped {
    fn admit(&self, size: usize) -> bool {
        let cap = CAP.load(Ordering::Relaxed);
        if size > cap {
            refused(size);
            return false;
        }
        if LIVE.fetch_add(size, Ordering::Relaxed) + size > cap {
            LIVE.fetch_sub(size, Ordering::Relaxed);
            refused(size);
            return false;
        }
        true
    }
}

/// Writes why an allocation is refused, without allocating (this runs inside the allocator).
fn refused(size: usize) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    let mut n = size;
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    let target = WORKER.try_with(|w| w.get()).unwrap_or("");
    if target == "harness" {
        // The harness's own test of the cap.
        return;
    }
    let mut err = std::io::stderr().lock();
    let _ = err.write_all(b"fuzz: refused an allocation of ");
    let _ = err.write_all(&digits[i..]);
    let _ = err.write_all(b" bytes (over AUTOPAR_FUZZ_MAX_BYTES, alone or with the live total) in target `");
    let _ = err.write_all(target.as_bytes());
    let _ = err.write_all(b"`; its input is target/tmp/fuzz/");
    let _ = err.write_all(target.as_bytes());
    let _ = err.write_all(b"/current (replay: AUTOPAR_FUZZ_REPLAY=FILE)\n");
}

// SAFETY: every call is forwarded to `System` with the same layout; the counter only decides
// whether to forward an allocation at all.
unsafe impl GlobalAlloc for Capped {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !self.admit(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded unchanged.
        let p = unsafe { System.alloc(layout) };
        if p.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !self.admit(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded unchanged.
        let p = unsafe { System.alloc_zeroed(layout) };
        if p.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let old = layout.size();
        if new_size > old && !self.admit(new_size - old) {
            return std::ptr::null_mut();
        }
        // SAFETY: forwarded unchanged.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if p.is_null() {
            if new_size > old {
                LIVE.fetch_sub(new_size - old, Ordering::Relaxed);
            }
        } else if new_size < old {
            LIVE.fetch_sub(old - new_size, Ordering::Relaxed);
        }
        p
    }
}

#[global_allocator]
static ALLOC: Capped = Capped;

// ---------------------------------------------------------------------------------------------
// Randomness and settings.

/// splitmix64: small, fast, and enough for choosing mutations.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (`n > 0`).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    /// True once in `n`.
    fn one_in(&mut self, n: usize) -> bool {
        self.below(n) == 0
    }
    fn pick<'a, T>(&mut self, v: &'a [T]) -> &'a T {
        &v[self.below(v.len())]
    }
}

/// Integers that break size arithmetic: zero, negatives, powers of two around type limits.
const INTERESTING: &[i64] = &[
    0,
    1,
    -1,
    2,
    3,
    7,
    64,
    255,
    -128,
    65535,
    65536,
    i32::MAX as i64,
    i32::MIN as i64,
    u32::MAX as i64,
    1 << 31,
    1 << 32,
    1 << 40,
    1 << 53,
    (1 << 62) + 1,
    i64::MAX,
    i64::MIN,
];

fn interesting(r: &mut Rng) -> i64 {
    if r.one_in(4) { r.below(9) as i64 - 1 } else { *r.pick(INTERESTING) }
}

fn env_f64(name: &str, default: f64) -> f64 {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok()).unwrap_or(default)
}

fn fuzz_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("fuzz").join(target)
}

fn corpus(target: &str) -> Vec<Vec<u8>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/fuzz").join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file() && p.extension().is_none_or(|e| e != "md"))
        .collect();
    files.sort();
    let seeds: Vec<Vec<u8>> = files.iter().map(|f| std::fs::read(f).unwrap()).collect();
    assert!(!seeds.is_empty(), "no seeds in {}", dir.display());
    seeds
}

// ---------------------------------------------------------------------------------------------
// The loop.

/// A target's mutator: a new input from one of the pool (the pool is there for splices).
type Mutator = fn(&mut Rng, &[u8], &[Vec<u8>]) -> Vec<u8>;
/// A target: runs one input; `Err` is a clean refusal.
type Exec = fn(&[u8]) -> Result<(), String>;

/// What one input did.
enum Outcome {
    /// Accepted.
    Ok,
    /// Refused with this error (the expected outcome of most mutants).
    Err(String),
    /// Panicked (message, location).
    Panic(String, String),
}

thread_local! {
    /// The last panic on this thread: (message, location), set by the silent hook.
    static LAST_PANIC: std::cell::RefCell<Option<(String, String)>> = const { std::cell::RefCell::new(None) };
}

/// Installs (once) a panic hook that records panics of fuzz workers silently and leaves every
/// other thread's panics (the tests' own assertions) to the default hook.
fn silence_worker_panics() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if WORKER.with(|w| w.get()).is_empty() {
                return default(info);
            }
            let msg = info
                .payload()
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| info.payload().downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "(non-string panic)".into());
            LAST_PANIC.with(|p| *p.borrow_mut() = Some((msg, panic_site(info))));
        }));
        if let Ok(v) = std::env::var("AUTOPAR_FUZZ_MAX_BYTES")
            && let Ok(n) = v.trim().parse::<usize>()
        {
            CAP.store(n, Ordering::Relaxed);
        }
    });
}

/// Where a panic comes from, as `file:line`: its location, or, when that is in the standard
/// library (an overflow in `Iterator::product`, an index out of bounds in a slice method), the
/// first frame outside it; then, when different, the first frame in this workspace (`via ...`).
/// Distinct sites are distinct findings.
fn panic_site(info: &std::panic::PanicHookInfo) -> String {
    let std_lib = |f: &str| f.starts_with("/rustc/") || f.contains("/library/");
    let trim = |f: &str| f.rsplit_once(':').map_or(f.to_string(), |(a, _)| a.to_string());
    let here = info.location().map(|l| format!("{}:{}", l.file(), l.line())).unwrap_or_default();
    let bt = std::backtrace::Backtrace::force_capture().to_string();
    let frames: Vec<String> = bt
        .lines()
        .filter_map(|l| l.trim().strip_prefix("at "))
        .filter(|f| !std_lib(f) && !f.ends_with("tests/fuzz.rs") && !f.contains("tests/fuzz.rs:"))
        .map(trim)
        .collect();
    let site = if std_lib(&here) { frames.first().cloned().unwrap_or(here) } else { here };
    match frames.iter().find(|f| !f.contains("/.cargo/")) {
        Some(ours)
            if !ours.ends_with(site.trim_start_matches("./")) && !site.ends_with(ours.trim_start_matches("./")) =>
        {
            format!("{site} via {ours}")
        }
        _ => site,
    }
}

/// A thread that runs inputs of one target (so a hung input can be abandoned).
struct Worker {
    tx: mpsc::Sender<Vec<u8>>,
    rx: mpsc::Receiver<Outcome>,
}

impl Worker {
    fn start(target: &'static str, exec: Exec) -> Worker {
        let (tx, inputs) = mpsc::channel::<Vec<u8>>();
        let (done, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name(format!("fuzz-{target}"))
            .spawn(move || {
                WORKER.with(|w| w.set(target));
                for input in inputs {
                    let r = catch_unwind(AssertUnwindSafe(|| exec(&input)));
                    let out = match r {
                        Ok(Ok(())) => Outcome::Ok,
                        Ok(Err(e)) => Outcome::Err(e),
                        Err(_) => {
                            let (m, at) = LAST_PANIC.with(|p| p.borrow_mut().take()).unwrap_or_default();
                            Outcome::Panic(m, at)
                        }
                    };
                    drop(input);
                    if done.send(out).is_err() {
                        break;
                    }
                }
            })
            .expect("starting a fuzz worker");
        Worker { tx, rx }
    }
}

/// An error message without its numbers and quoted names: what kind of refusal it is.
fn error_kind(e: &str) -> String {
    let mut out = String::new();
    let mut quoted = false;
    for c in e.chars().take(4096) {
        if out.len() >= 120 {
            break;
        }
        match c {
            '`' | '"' | '\'' => {
                quoted = !quoted;
                out.push('_');
            }
            _ if quoted => {}
            c if c.is_ascii_digit() => {
                if !out.ends_with('#') {
                    out.push('#');
                }
            }
            c => out.push(c),
        }
    }
    out
}

fn save(target: &str, name: &str, input: &[u8]) -> PathBuf {
    let dir = fuzz_dir(target);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, input).unwrap();
    path
}

fn hash(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| (h ^ x as u64).wrapping_mul(0x0100_0000_01b3))
}

/// Fuzzes `target` for `AUTOPAR_FUZZ_SECS` seconds and fails listing every distinct finding.
///
/// The test supervises child processes (this test binary, running only this test with
/// `AUTOPAR_FUZZ_CHILD` set) that do the work in [`fuzz_child`]: a refused allocation aborts a
/// child, so the supervisor records the input it was running and starts another child with the
/// remaining time and a new seed; a time-out ends a child the same way. `AUTOPAR_FUZZ_REPLAY`
/// runs one input in this process instead.
fn fuzz(target: &'static str, mutate: Mutator, exec: Exec) {
    silence_worker_panics();
    if let Ok(file) = std::env::var("AUTOPAR_FUZZ_REPLAY") {
        return replay(target, exec, &file);
    }
    if std::env::var("AUTOPAR_FUZZ_CHILD").is_ok_and(|t| t == target) {
        return fuzz_child(target, mutate, exec);
    }
    let secs = env_f64("AUTOPAR_FUZZ_SECS", 5.0);
    let seed = std::env::var("AUTOPAR_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
    });
    let dir = fuzz_dir(target);
    std::fs::create_dir_all(&dir).unwrap();
    let t0 = Instant::now();
    // By site: (kind, message, saved input).
    let mut findings: BTreeMap<String, (String, String, PathBuf)> = BTreeMap::new();
    let (mut execs, mut accepted, mut children) = (0u64, 0u64, 0u64);
    let mut last_line = String::new();
    while children == 0 || (t0.elapsed().as_secs_f64() < secs && children < 1000 && findings.len() < 30) {
        let left = (secs - t0.elapsed().as_secs_f64()).max(0.0);
        let _ = std::fs::remove_file(dir.join("execs"));
        let _ = std::fs::remove_file(dir.join("current"));
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([&format!("fuzz_{target}"), "--exact", "--nocapture", "--test-threads=1"])
            .env("AUTOPAR_FUZZ_CHILD", target)
            .env("AUTOPAR_FUZZ_SECS", left.to_string())
            .env("AUTOPAR_FUZZ_SEED", seed.wrapping_add(children).to_string())
            .env("RUST_BACKTRACE", "1")
            .stdin(std::process::Stdio::null())
            .output()
            .expect("starting a fuzz child");
        children += 1;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let mut finished = false;
        for line in stdout.lines() {
            // libtest writes `test NAME ... ` before the test's first line.
            let line = line.find("fuzz-").map_or(line, |i| &line[i..]);
            let f: Vec<&str> = line.split('\t').collect();
            match f[..] {
                ["fuzz-execs", n, a, ref summary] => {
                    execs += n.parse::<u64>().unwrap_or(0);
                    accepted += a.parse::<u64>().unwrap_or(0);
                    last_line = summary.to_string();
                    finished = true;
                }
                ["fuzz-finding", kind, site, file, msg] => {
                    findings.entry(site.to_string()).or_insert((kind.into(), msg.into(), file.into()));
                }
                _ => {}
            }
        }
        if finished {
            continue;
        }
        // The child died: count what it did, and blame the input it was running.
        let counted = std::fs::read_to_string(dir.join("execs")).unwrap_or_default();
        let mut c = counted.split_whitespace().map(|x| x.parse::<u64>().unwrap_or(0));
        execs += c.next().unwrap_or(0);
        accepted += c.next().unwrap_or(0);
        let Ok(input) = std::fs::read(dir.join("current")) else {
            panic!("fuzz {target}: a child failed before running any input ({}):\n{stderr}", out.status);
        };
        let refused = stderr.lines().find(|l| l.starts_with("fuzz: refused an allocation"));
        let (kind, msg) = match refused {
            Some(l) => ("allocation", l.split(" (over").next().unwrap_or(l).trim_start_matches("fuzz: ").to_string()),
            None => ("abort", format!("the child ended with {}", out.status)),
        };
        // The first frame of the workspace below the allocation (backtraces name absolute paths).
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().display().to_string();
        let site = stderr
            .lines()
            .filter_map(|l| l.trim().strip_prefix("at "))
            .find(|f| f.starts_with(&root) && !f.contains("tests/fuzz.rs"))
            .map(|f| f.trim_start_matches(&root).trim_start_matches('/').to_string())
            .map(|f| f.rsplit_once(':').map_or(f.clone(), |(a, _)| a.to_string()))
            .unwrap_or_else(|| format!("{kind} {:016x}", hash(&input)));
        if let std::collections::btree_map::Entry::Vacant(e) = findings.entry(site) {
            let file = save(target, &format!("{kind}-{:016x}", hash(e.key().as_bytes())), &input);
            e.insert((kind.into(), msg, file));
        }
    }
    println!(
        "fuzz {target}: {execs} executions in {:.1} s ({:.0}/s) over {children} process(es), {accepted} accepted, \
         {} findings, seed {seed}; last process: {last_line}",
        t0.elapsed().as_secs_f64(),
        execs as f64 / t0.elapsed().as_secs_f64().max(1e-9),
        findings.len()
    );
    if !findings.is_empty() {
        let list: Vec<String> = findings
            .iter()
            .map(|(site, (kind, msg, f))| format!("  {kind} at {site}: {msg}\n    input: {}", f.display()))
            .collect();
        panic!(
            "fuzz {target}: {} findings (seed {seed}; replay one with AUTOPAR_FUZZ_REPLAY=FILE):\n{}",
            findings.len(),
            list.join("\n")
        );
    }
}

/// Runs one input file through `target` in this process and reports what it did.
fn replay(target: &'static str, exec: Exec, file: &str) {
    let input = std::fs::read(file).unwrap_or_else(|e| panic!("AUTOPAR_FUZZ_REPLAY={file}: {e}"));
    let cap = Duration::from_secs_f64(env_f64("AUTOPAR_FUZZ_INPUT_SECS", 10.0));
    let worker = Worker::start(target, exec);
    worker.tx.send(input).unwrap();
    match worker.rx.recv_timeout(cap) {
        Err(_) => panic!("{target}: {file} ran past the per-input cap of {cap:?}"),
        Ok(Outcome::Panic(m, at)) => panic!("{target}: {file} panicked at {at}: {m}"),
        Ok(Outcome::Err(e)) => println!("{target}: {file}: error (clean): {e}"),
        Ok(Outcome::Ok) => println!("{target}: {file}: accepted"),
    }
}

/// The work of one child process (see [`fuzz`]): mutates the seeds until the time is up,
/// printing one `fuzz-finding` line per distinct panic site and a `fuzz-execs` line at the end;
/// writes the input it runs to `current` first and its counts to `execs` now and then, which the
/// supervisor reads when the child dies. A time-out ends the child (its worker cannot be stopped).
fn fuzz_child(target: &'static str, mutate: Mutator, exec: Exec) {
    let input_cap = Duration::from_secs_f64(env_f64("AUTOPAR_FUZZ_INPUT_SECS", 10.0));
    let secs = env_f64("AUTOPAR_FUZZ_SECS", 5.0);
    let seed = env_f64("AUTOPAR_FUZZ_SEED", 1.0) as u64;
    let worker = Worker::start(target, exec);
    let dir = fuzz_dir(target);
    let current = dir.join("current");
    let seeds = corpus(target);
    let mut rng = Rng(seed ^ hash(target.as_bytes()));
    let mut pool: Vec<Vec<u8>> = seeds.clone();
    let largest = seeds.iter().map(Vec::len).max().unwrap_or(0);
    let show_kinds = std::env::var("AUTOPAR_FUZZ_SHOW_KINDS").is_ok();
    let mut kinds: HashSet<String> = HashSet::new();
    let mut sites: HashSet<String> = HashSet::new();
    let (mut execs, mut accepted, mut slowest) = (0u64, 0u64, (Duration::ZERO, 0usize));
    let t0 = Instant::now();
    // The seeds first, unmutated: they must be handled too.
    let mut queue: Vec<Vec<u8>> = seeds.iter().rev().cloned().collect();
    while !queue.is_empty() || t0.elapsed().as_secs_f64() < secs {
        let input = match queue.pop() {
            Some(s) => s,
            None => {
                let base = rng.pick(&pool).clone();
                mutate(&mut rng, &base, &pool)
            }
        };
        std::fs::write(&current, &input).unwrap();
        let started = Instant::now();
        worker.tx.send(input.clone()).unwrap();
        let out = worker.rx.recv_timeout(input_cap);
        let took = started.elapsed();
        execs += 1;
        if execs.is_multiple_of(256) {
            let _ = std::fs::write(dir.join("execs"), format!("{execs} {accepted}"));
        }
        if took > slowest.0 {
            slowest = (took, input.len());
        }
        let kind = match out {
            Err(_) => {
                let f = save(target, &format!("timeout-{:016x}", hash(&input)), &input);
                println!(
                    "fuzz-finding\ttimeout\ttimeout {:016x}\t{}\tran past the per-input cap of {input_cap:?}",
                    hash(&input),
                    f.display()
                );
                println!("fuzz-execs\t{execs}\t{accepted}\tended by a time-out");
                std::process::exit(0);
            }
            Ok(Outcome::Panic(m, at)) => {
                if sites.insert(at.clone()) {
                    let f = save(target, &format!("panic-{:016x}", hash(at.as_bytes())), &input);
                    let m = m.replace(['\t', '\n'], " ");
                    println!("fuzz-finding\tpanic\t{at}\t{}\t{m}", f.display());
                }
                format!("panic {at}")
            }
            Ok(Outcome::Err(e)) => error_kind(&e),
            Ok(Outcome::Ok) => {
                accepted += 1;
                "ok".to_string()
            }
        };
        // A new kind of outcome: keep the input to mutate further (unless it has grown past
        // twice the largest seed: splices and duplications would make every later run slower).
        if show_kinds && !kinds.contains(&kind) {
            println!("new kind: {kind}");
        }
        if kinds.insert(kind) && input.len() <= 2 * largest && !pool.contains(&input) {
            if pool.len() < 512 {
                pool.push(input);
            } else {
                let k = seeds.len() + rng.below(pool.len() - seeds.len());
                pool[k] = input;
            }
        }
    }
    let _ = std::fs::remove_file(&current);
    println!(
        "fuzz-execs\t{execs}\t{accepted}\t{:.0} executions/s, {} kinds of outcome, pool {}, slowest input {:.1} ms ({} bytes)",
        execs as f64 / t0.elapsed().as_secs_f64(),
        kinds.len(),
        pool.len(),
        slowest.0.as_secs_f64() * 1e3,
        slowest.1
    );
}

// ---------------------------------------------------------------------------------------------
// Generic byte mutations.

fn mutate_bytes(r: &mut Rng, input: &[u8], pool: &[Vec<u8>]) -> Vec<u8> {
    let mut v = input.to_vec();
    for _ in 0..1 + r.below(4) {
        if v.is_empty() {
            v.push(r.next() as u8);
            continue;
        }
        let n = v.len();
        match r.below(9) {
            0 => {
                let i = r.below(n);
                v[i] ^= 1 << r.below(8);
            }
            1 => {
                let i = r.below(n);
                v[i] = *r.pick(&[0u8, 1, 0x7f, 0x80, 0xff, b'0', b'9', b'-']);
            }
            2 => {
                let i = r.below(n);
                let k = (1 + r.below(16)).min(n - i);
                v.drain(i..i + k);
            }
            3 => {
                let i = r.below(n);
                let k = 1 + r.below(16.min(n - i));
                let chunk = v[i..i + k].to_vec();
                let at = r.below(n + 1);
                v.splice(at..at, chunk);
            }
            4 => v.truncate(r.below(n)),
            5 => {
                let other = r.pick(pool);
                let cut = r.below(n + 1);
                let from = r.below(other.len() + 1);
                v.truncate(cut);
                v.extend_from_slice(&other[from..]);
            }
            6 => {
                let i = r.below(n);
                for b in v.iter_mut().skip(i).take(1 + r.below(8)) {
                    *b = r.next() as u8;
                }
            }
            7 => {
                let i = r.below(n);
                let b = r.next() as u8;
                v.insert(i, b);
            }
            _ => v = edit_digits(r, &v),
        }
    }
    v
}

/// Replaces one run of ASCII digits (a number in a text format) with an interesting number.
fn edit_digits(r: &mut Rng, v: &[u8]) -> Vec<u8> {
    let runs: Vec<(usize, usize)> = {
        let mut runs = vec![];
        let mut i = 0;
        while i < v.len() {
            if v[i].is_ascii_digit() {
                let s = i;
                while i < v.len() && v[i].is_ascii_digit() {
                    i += 1;
                }
                runs.push((s, i));
            } else {
                i += 1;
            }
        }
        runs
    };
    if runs.is_empty() {
        return v.to_vec();
    }
    let (s, e) = *r.pick(&runs);
    let with = match r.below(6) {
        0 => "18446744073709551615".to_string(),
        1 => "99999999999999999999999".to_string(),
        2 => "1e308".to_string(),
        _ => interesting(r).to_string(),
    };
    let mut out = v[..s].to_vec();
    out.extend_from_slice(with.as_bytes());
    out.extend_from_slice(&v[e..]);
    out
}

// ---------------------------------------------------------------------------------------------
// JSON mutations (plans, IOPDDL problems).

/// A random node of a JSON document, as a JSON pointer: a random walk from the root that stops
/// at each container with probability 1/4 (cheap on large plans, unlike listing every node).
fn random_pointer(r: &mut Rng, doc: &Value) -> String {
    let mut at = String::new();
    let mut v = doc;
    loop {
        let next = match v {
            Value::Array(a) if !a.is_empty() && !r.one_in(4) => {
                let i = r.below(a.len());
                at.push_str(&format!("/{i}"));
                &a[i]
            }
            Value::Object(o) if !o.is_empty() && !r.one_in(4) => {
                let (k, x) = o.iter().nth(r.below(o.len())).unwrap();
                at.push('/');
                at.push_str(&k.replace('~', "~0").replace('/', "~1"));
                x
            }
            _ => return at,
        };
        v = next;
    }
}

fn json_number(r: &mut Rng) -> Value {
    match r.below(10) {
        0 => Value::from(u64::MAX),
        1 => serde_json::json!(1e300),
        2 => serde_json::json!(-1e300),
        3 => serde_json::json!(0.5),
        4 => Value::from("NaN"),
        5 => Value::from(-1),
        _ => Value::from(interesting(r)),
    }
}

/// Text edits of a string value (plan graphs, specs and names are text with numbers inside).
fn mutate_text(r: &mut Rng, s: &str) -> String {
    let lines: Vec<&str> = s.split('\n').collect();
    match r.below(6) {
        0 | 1 => String::from_utf8_lossy(&edit_digits(r, s.as_bytes())).into_owned(),
        2 if lines.len() > 1 => {
            let mut l = lines.clone();
            l.remove(r.below(l.len()));
            l.join("\n")
        }
        3 if lines.len() > 1 => {
            let mut l = lines.clone();
            let i = r.below(l.len());
            let j = r.below(l.len());
            l.insert(j, lines[i]);
            l.join("\n")
        }
        4 if lines.len() > 1 => {
            let mut l = lines.clone();
            let (i, j) = (r.below(l.len()), r.below(l.len()));
            l.swap(i, j);
            l.join("\n")
        }
        _ => {
            // Swap two words (op names, dtypes, spec entries).
            let words: Vec<&str> =
                s.split(|c: char| !c.is_alphanumeric() && c != '_').filter(|w| !w.is_empty()).collect();
            if words.len() < 2 {
                return String::new();
            }
            let (a, b) = (*r.pick(&words), *r.pick(&words));
            s.replacen(a, b, 1)
        }
    }
}

/// One structural edit of a JSON document.
fn mutate_value(r: &mut Rng, doc: &mut Value) {
    let p = random_pointer(r, doc);
    let q = random_pointer(r, doc);
    let donor = doc.pointer(&q).cloned().unwrap_or(Value::Null);
    let Some(node) = doc.pointer_mut(&p) else { return };
    if r.one_in(8) {
        *node = match r.below(5) {
            0 => Value::Null,
            1 => serde_json::json!([]),
            2 => serde_json::json!({}),
            3 => Value::from(true),
            _ => donor,
        };
        return;
    }
    match node {
        Value::Number(_) | Value::Null | Value::Bool(_) => *node = json_number(r),
        Value::String(s) => {
            *s = match r.below(8) {
                0 => String::new(),
                1 => "NaN".into(),
                2 => "x".repeat(1 + r.below(300)),
                _ => mutate_text(r, s),
            }
        }
        Value::Array(a) => match r.below(6) {
            _ if a.is_empty() => a.push(donor),
            0 => {
                a.remove(r.below(a.len()));
            }
            1 => {
                let x = a[r.below(a.len())].clone();
                a.insert(r.below(a.len() + 1), x);
            }
            2 => a.truncate(r.below(a.len())),
            3 => {
                let (i, j) = (r.below(a.len()), r.below(a.len()));
                a.swap(i, j);
            }
            4 => a.push(donor),
            _ => a.clear(),
        },
        Value::Object(o) => {
            if o.is_empty() || r.one_in(3) {
                o.insert(format!("extra{}", r.below(3)), donor);
            } else {
                let k = o.keys().nth(r.below(o.len())).unwrap().clone();
                if r.one_in(2) {
                    o.remove(&k);
                } else {
                    o.insert(k, donor);
                }
            }
        }
    }
}

/// JSON text of `v`, with the key at `dup` (an object member's pointer) written twice.
fn write_json(v: &Value, at: &str, dup: &str, out: &mut String) {
    match v {
        Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_json(x, &format!("{at}/{i}"), dup, out);
            }
            out.push(']');
        }
        Value::Object(o) => {
            out.push('{');
            let mut first = true;
            for (k, x) in o {
                let p = format!("{at}/{}", k.replace('~', "~0").replace('/', "~1"));
                for _ in 0..if p == dup { 2 } else { 1 } {
                    if !first {
                        out.push(',');
                    }
                    first = false;
                    out.push_str(&serde_json::to_string(k).unwrap());
                    out.push(':');
                    write_json(x, &p, dup, out);
                }
            }
            out.push('}');
        }
        x => out.push_str(&x.to_string()),
    }
}

/// JSON-aware edits (most of the time) or byte edits of a JSON document; `fix` repairs what
/// would otherwise stop every mutant at the first check (a plan's hash).
fn mutate_json(r: &mut Rng, input: &[u8], pool: &[Vec<u8>], fix: fn(&mut Rng, &mut Value)) -> Vec<u8> {
    let Ok(mut doc) = serde_json::from_slice::<Value>(input) else { return mutate_bytes(r, input, pool) };
    if r.one_in(8) {
        return mutate_bytes(r, input, pool);
    }
    for _ in 0..1 + r.below(3) {
        mutate_value(r, &mut doc);
    }
    fix(r, &mut doc);
    if !r.one_in(10) {
        return serde_json::to_vec(&doc).unwrap();
    }
    let dup = random_pointer(r, &doc);
    let mut out = String::new();
    write_json(&doc, "", &dup, &mut out);
    out.into_bytes()
}

// ---------------------------------------------------------------------------------------------
// ONNX mutations.

fn mutate_dims(r: &mut Rng, dims: &mut Vec<i64>) {
    match r.below(4) {
        _ if dims.is_empty() => dims.push(interesting(r)),
        0 => dims.push(interesting(r)),
        1 => {
            dims.remove(r.below(dims.len()));
        }
        _ => {
            let i = r.below(dims.len());
            dims[i] = interesting(r);
        }
    }
}

fn mutate_tensor(r: &mut Rng, t: &mut pb::TensorProto) {
    match r.below(8) {
        0 | 1 => mutate_dims(r, &mut t.dims),
        2 => t.data_type = *r.pick(&[0, 1, 2, 6, 7, 9, 10, 11, 16, 17, 99, -1]),
        3 => {
            let n = t.raw_data.len();
            t.raw_data.truncate(if n > 0 { r.below(n) } else { 0 });
            t.float_data.truncate(r.below(t.float_data.len() + 1));
        }
        4 if !t.int64_data.is_empty() => {
            let i = r.below(t.int64_data.len());
            t.int64_data[i] = interesting(r);
        }
        4 => t.int64_data.push(interesting(r)),
        5 if t.raw_data.len() >= 8 && t.data_type == 7 => {
            // int64 raw data: the values of shapes, axes, pads.
            let k = r.below(t.raw_data.len() / 8) * 8;
            t.raw_data[k..k + 8].copy_from_slice(&interesting(r).to_le_bytes());
        }
        5 => t.float_data.push(*r.pick(&[f32::NAN, f32::INFINITY, -0.0, 1e38])),
        6 => {
            // Data said to live in a file (the fuzz target gives no directory to read it from).
            t.data_location = Some(1);
            t.external_data = vec![
                pb::StringStringEntryProto { key: "location".into(), value: "weights.bin".into() },
                pb::StringStringEntryProto { key: "offset".into(), value: interesting(r).to_string() },
                pb::StringStringEntryProto { key: "length".into(), value: interesting(r).to_string() },
            ];
        }
        _ => t.name = String::new(),
    }
}

fn mutate_value_info(r: &mut Rng, v: &mut pb::ValueInfoProto) {
    use pb::tensor_shape_proto::dimension::Value as D;
    let Some(pb::type_proto::Value::TensorType(t)) = v.r#type.as_mut().and_then(|t| t.value.as_mut()) else {
        v.r#type = None;
        return;
    };
    match r.below(5) {
        0 => t.elem_type = *r.pick(&[0, 1, 2, 6, 7, 9, 10, 11, 16, 99]),
        1 => t.shape = None,
        _ => {
            let shape = t.shape.get_or_insert_with(Default::default);
            let dim = pb::tensor_shape_proto::Dimension {
                value: Some(if r.one_in(4) { D::DimParam("N".into()) } else { D::DimValue(interesting(r)) }),
                ..Default::default()
            };
            if shape.dim.is_empty() || r.one_in(3) {
                shape.dim.push(dim);
            } else if r.one_in(4) {
                shape.dim.remove(r.below(shape.dim.len()));
            } else {
                let i = r.below(shape.dim.len());
                shape.dim[i] = dim;
            }
        }
    }
}

fn mutate_attr(r: &mut Rng, a: &mut pb::AttributeProto) {
    match r.below(8) {
        0 => a.i = interesting(r),
        1 | 2 if !a.ints.is_empty() => {
            let i = r.below(a.ints.len());
            a.ints[i] = interesting(r);
        }
        1 | 2 => a.ints.push(interesting(r)),
        3 => {
            if a.ints.is_empty() || r.one_in(2) {
                a.ints.push(interesting(r));
            } else {
                a.ints.remove(r.below(a.ints.len()));
            }
        }
        4 => a.f = *r.pick(&[f32::NAN, f32::INFINITY, -1.0, 0.0, 1e30]),
        5 => a.r#type = r.below(15) as i32,
        6 if a.t.is_some() => mutate_tensor(r, a.t.as_mut().unwrap()),
        _ => a.s = mutate_text(r, &String::from_utf8_lossy(&a.s)).into_bytes(),
    }
}

/// All value names a graph mentions.
fn names(g: &pb::GraphProto) -> Vec<String> {
    let mut v: Vec<String> = g.node.iter().flat_map(|n| n.input.iter().chain(&n.output).cloned()).collect();
    v.extend(g.initializer.iter().map(|t| t.name.clone()));
    v.extend(g.input.iter().chain(&g.output).map(|i| i.name.clone()));
    v.push(String::new());
    v.push("nowhere".into());
    v
}

fn mutate_graph(r: &mut Rng, g: &mut pb::GraphProto) {
    let names = names(g);
    let n = g.node.len();
    match r.below(12) {
        0..=2 if n > 0 => {
            let k = r.below(n);
            let donor = g.node[r.below(n)].attribute.clone();
            let node = &mut g.node[k];
            if node.attribute.is_empty() || r.one_in(5) {
                if let Some(a) = donor.first() {
                    node.attribute.push(a.clone());
                }
            } else {
                let i = r.below(node.attribute.len());
                if r.one_in(6) {
                    node.attribute.remove(i);
                } else {
                    mutate_attr(r, &mut node.attribute[i]);
                }
            }
        }
        3 if n > 0 => {
            let k = r.below(n);
            g.node[k].op_type = if r.one_in(2) {
                r.pick(tracer::SUPPORTED_OPS).to_string()
            } else {
                g.node[r.below(n)].op_type.clone()
            };
        }
        4 if n > 0 => {
            // Rewire: an input or an output renamed to any name of the graph (cycles, duplicate
            // outputs, dangling inputs).
            let k = r.below(n);
            let name = r.pick(&names).clone();
            let node = &mut g.node[k];
            let list = if r.one_in(2) || node.output.is_empty() { &mut node.input } else { &mut node.output };
            if list.is_empty() || r.one_in(4) {
                list.push(name);
            } else {
                let i = r.below(list.len());
                if r.one_in(5) {
                    list.remove(i);
                } else {
                    list[i] = name;
                }
            }
        }
        5 if n > 0 => {
            let k = r.below(n);
            if r.one_in(2) {
                g.node.remove(k);
            } else {
                let copy = g.node[k].clone();
                g.node.insert(r.below(n + 1), copy);
            }
        }
        6 if n > 1 => {
            let (i, j) = (r.below(n), r.below(n));
            g.node.swap(i, j);
        }
        7 | 8 if !g.initializer.is_empty() => {
            let k = r.below(g.initializer.len());
            mutate_tensor(r, &mut g.initializer[k]);
        }
        9 if !g.input.is_empty() => {
            let k = r.below(g.input.len());
            mutate_value_info(r, &mut g.input[k]);
        }
        10 if !g.output.is_empty() => {
            let k = r.below(g.output.len());
            if r.one_in(3) {
                g.output[k].name = r.pick(&names).clone();
            } else {
                mutate_value_info(r, &mut g.output[k]);
            }
        }
        _ => {
            // Constants hold the shapes, axes and pads most ops read.
            let consts: Vec<usize> = (0..n).filter(|&i| g.node[i].op_type == "Constant").collect();
            if let Some(&k) = consts.get(r.below(consts.len().max(1))) {
                for a in &mut g.node[k].attribute {
                    if let Some(t) = a.t.as_mut() {
                        mutate_tensor(r, t);
                    } else {
                        mutate_attr(r, a);
                    }
                }
            } else if !g.initializer.is_empty() {
                let k = r.below(g.initializer.len());
                mutate_tensor(r, &mut g.initializer[k]);
            }
        }
    }
}

fn mutate_onnx(r: &mut Rng, input: &[u8], pool: &[Vec<u8>]) -> Vec<u8> {
    let decoded = pb::ModelProto::decode(input);
    let (Ok(mut m), false) = (decoded, r.one_in(6)) else { return mutate_bytes(r, input, pool) };
    for _ in 0..1 + r.below(3) {
        if r.one_in(20) {
            m.opset_import =
                vec![pb::OperatorSetIdProto { domain: String::new(), version: *r.pick(&[1, 7, 11, 13, 18, 99, -1]) }];
        } else if let Some(g) = m.graph.as_mut() {
            mutate_graph(r, g);
        }
    }
    m.encode_to_vec()
}

// ---------------------------------------------------------------------------------------------
// .npy mutations.

fn mutate_npy(r: &mut Rng, input: &[u8], pool: &[Vec<u8>]) -> Vec<u8> {
    // The header: magic (6), version (2), length (2 or 4), then a Python dict in ASCII.
    let header_end = input.iter().position(|&b| b == b'\n').map_or(input.len(), |i| i + 1);
    let mut v = input.to_vec();
    match r.below(8) {
        0 | 1 => {
            let head = edit_digits(r, &v[..header_end.min(v.len())]);
            v.splice(..header_end.min(v.len()), head);
        }
        2 => {
            let descr =
                *r.pick(&["<f4", "<f8", "<i8", "<i4", "|b1", ">f4", "<f2", "|u1", "<U3", "|O", "<c8", "<i2", ""]);
            let text = String::from_utf8_lossy(&v[..header_end.min(v.len())]).into_owned();
            if let Some(s) = text.find("'descr': '")
                && let Some(e) = text[s + 10..].find('\'')
            {
                let new = format!("{}{descr}{}", &text[..s + 10], &text[s + 10 + e..]);
                v.splice(..header_end.min(v.len()), new.into_bytes());
            }
        }
        3 => {
            let text = String::from_utf8_lossy(&v[..header_end.min(v.len())]).into_owned();
            let from = if r.one_in(2) { "False" } else { "'shape'" };
            let to = *r.pick::<&str>(&["True", "'shape': (), 'x'", "'sh'", "None"]);
            let new = text.replacen(from, to, 1);
            v.splice(..header_end.min(v.len()), new.into_bytes());
        }
        4 if v.len() >= 10 => {
            // The header length (version 1: u16 at 8) or the version (6, 7).
            if r.one_in(2) {
                let len = interesting(r) as u16;
                v[8..10].copy_from_slice(&len.to_le_bytes());
            } else {
                v[6] = *r.pick(&[1, 2, 3, 0, 255]);
            }
        }
        5 => v.truncate(r.below(v.len() + 1)),
        _ => v = mutate_bytes(r, &v, pool),
    }
    v
}

// ---------------------------------------------------------------------------------------------
// The targets.

fn exec_onnx(bytes: &[u8]) -> Result<(), String> {
    // The importer holds a constant it computes twice for a moment (the folded value and the
    // graph's copy of it), so its ceiling must stay under half the allocation cap: a quarter.
    let cap = CAP.load(Ordering::Relaxed);
    let mut opts = tracer::ImportOptions { max_constant_bytes: cap / 4, ..Default::default() };
    // One input in eight binds its first graph input's shape, as `--input` does.
    let h = hash(bytes);
    if h.is_multiple_of(8)
        && let Ok(m) = pb::ModelProto::decode(bytes)
        && let Some(i) = m.graph.as_ref().and_then(|g| g.input.first())
    {
        let dims = [(h >> 8) as usize % 5, 1 << ((h >> 16) % 48), 3];
        opts.input_shapes.insert(i.name.clone(), dims[..((h >> 24) % 4) as usize].to_vec());
    }
    // No base directory: external data is never read from disk here.
    let mut g = tracer::import_bytes(bytes, "fuzz.onnx", "fuzz", None, &opts).map_err(|e| e.to_string())?;
    ir::passes::canonicalize(&mut g).map_err(|e| e.to_string())?;
    Ok(())
}

fn exec_npy(bytes: &[u8]) -> Result<(), String> {
    // The reader takes a path (its callers name files); one file per worker thread.
    let path = fuzz_dir("npy").join("input.npy");
    std::fs::write(&path, bytes).map_err(|e| format!("writing the input: {e}"))?;
    let t = runtime::npy::read_npy(&path).map_err(|e| e.to_string())?;
    // Whatever is accepted must be a consistent tensor.
    let n = t.shape().iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    assert_eq!(n, Some(t.data().len()), "accepted a tensor whose shape does not match its data");
    Ok(())
}

fn exec_plan(bytes: &[u8]) -> Result<(), String> {
    let text = std::str::from_utf8(bytes).map_err(|e| e.to_string())?;
    let plan = codegen::Plan::from_json(text).map_err(|e| e.to_string())?;
    // What `autopar explain` and `autopar run` do with a plan that passed validation.
    let _ = codegen::explain::summary(&plan);
    runtime::program::Program::new(&plan).map_err(|e| e.to_string())?;
    Ok(())
}

fn exec_iopddl(bytes: &[u8]) -> Result<(), String> {
    let p = solver::Problem::from_json_bytes(bytes).map_err(|e| e.to_string())?;
    // What `autopar solve --check` does with a first-strategy solution.
    let _ = p.evaluate(&vec![0; p.nodes.len()]);
    // What `autopar solve` does, briefly, on small problems (one input in four).
    if p.nodes.len() <= 64 && hash(bytes).is_multiple_of(4) {
        let opts = solver::SolveOptions {
            time_limit: Duration::from_millis(50),
            threads: 1,
            ..solver::SolveOptions::default()
        };
        solver::solve(&p, &opts).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// FNV-1a as codegen hashes a plan's graph: a mutant with a repaired hash reaches the checks
/// after it.
fn fix_plan_hash(r: &mut Rng, doc: &mut Value) {
    if r.one_in(4) {
        return;
    }
    let Some(graph) = doc.get("graph").and_then(Value::as_str) else { return };
    let h = format!("{:016x}", hash(graph.as_bytes()));
    if let Some(m) = doc.get_mut("model").and_then(Value::as_object_mut) {
        m.insert("hash".into(), Value::from(h));
    }
}

fn no_fix(_: &mut Rng, _: &mut Value) {}

#[test]
fn fuzz_onnx() {
    fuzz("onnx", mutate_onnx, exec_onnx);
}

#[test]
fn fuzz_npy() {
    fuzz("npy", mutate_npy, exec_npy);
}

#[test]
fn fuzz_plan() {
    fuzz("plan", |r, i, p| mutate_json(r, i, p, fix_plan_hash), exec_plan);
}

#[test]
fn fuzz_iopddl() {
    fuzz("iopddl", |r, i, p| mutate_json(r, i, p, no_fix), exec_iopddl);
}

/// The panic hook, the worker and the cap themselves: a panicking input is caught and reported
/// with its location, and a refused allocation is an error for fallible allocations.
#[test]
fn harness_catches_panics_and_caps_allocations() {
    silence_worker_panics();
    let w = Worker::start("harness", |b| {
        if b.first() == Some(&1) {
            panic!("boom");
        }
        let mut v: Vec<u8> = Vec::new();
        match v.try_reserve(CAP.load(Ordering::Relaxed) + 1) {
            Ok(()) => Err("an allocation far above the cap succeeded".into()),
            Err(_) => Ok(()),
        }
    });
    w.tx.send(vec![1]).unwrap();
    match w.rx.recv().unwrap() {
        Outcome::Panic(m, at) => assert!(m == "boom" && at.contains("fuzz.rs"), "{m} at {at}"),
        _ => panic!("the panic was not caught"),
    }
    w.tx.send(vec![0]).unwrap();
    assert!(matches!(w.rx.recv().unwrap(), Outcome::Ok), "the cap did not refuse");
}

/// Every finding the fuzzer made (`tests/data/fuzz/crashes/<target>/`, see its NOTICE.md) stays
/// fixed: each file runs once through its target and must end in acceptance or a clean error,
/// never a panic.
#[test]
fn recorded_findings_stay_fixed() {
    let targets: [(&str, Exec); 2] = [("onnx", exec_onnx), ("npy", exec_npy)];
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/fuzz/crashes");
    let mut ran = 0;
    for (target, exec) in targets {
        let Ok(dir) = std::fs::read_dir(root.join(target)) else { continue };
        let mut files: Vec<PathBuf> = dir.map(|e| e.unwrap().path()).filter(|p| p.is_file()).collect();
        files.sort();
        for f in files {
            let input = std::fs::read(&f).unwrap();
            let outcome = std::panic::catch_unwind(|| exec(&input));
            assert!(outcome.is_ok(), "{}: the {target} target panicked again", f.display());
            ran += 1;
        }
    }
    assert!(ran > 0, "no recorded findings under {}", root.display());
}
