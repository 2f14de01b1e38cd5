//! Measuring the cost model's inputs on the real back end: the links of every mesh axis (alpha
//! and beta from all-reduce and all-gather sweeps) and one device's f32 throughput and memory
//! bandwidth.
//!
//! Every rank calls [`sweep`] (SPMD). Each measurement is a barrier, then a batch of the
//! collective on every group along one axis, back to back ([`batch`] of them: many for small
//! blocks, one from 1 MiB); a rep's time is the slowest rank's time per collective, a size's
//! time the median over reps.
//! [`fit`] finds the `alpha`, `beta` of the planner's model
//! (`alpha + factor * bytes * beta`, ring factors as in [`sharding::Collective::cost`]) by least
//! squares on *relative* errors, so small and large messages count alike; [`Sample::predicted`]
//! gives the model's time for comparison.
//!
//! On CPUs one line does not fit every size: blocks that stay in the caches move several times
//! faster per byte than those that spill to memory (BENCHMARKS.md: about 0.2 ns/B up to 1 MiB
//! and 0.6-1.7 ns/B from 4 MiB on the project's machine, for threads and MPI alike). [`fit`] therefore
//! also tries further lines for the sizes from some breakpoints on ([`sharding::Segment`]), and
//! keeps them when they reproduce the measurements markedly better. Transports switch protocols
//! too: Open MPI's shared-memory transport sends up to 4 KiB eagerly and larger messages by a
//! rendezvous, a step of several microseconds.

use std::sync::Arc;
use std::time::Instant;

use ir::Tensor;
use sharding::{Collective, DeviceMesh, Link, ReduceKind, Segment};

use runtime::comm::{CommError, Communicator};

/// One measured point.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Sample {
    /// `all-reduce` or `all-gather`.
    pub kind: String,
    /// The mesh axis.
    pub axis: usize,
    /// Ranks per group.
    pub ranks: usize,
    /// Bytes of each rank's block before the collective.
    pub bytes: usize,
    /// Median seconds.
    pub seconds: f64,
    /// The model's bytes term (ring factor x bytes as nccl-tests counts them).
    pub model_bytes: f64,
}

impl Sample {
    /// The model's seconds for this point with `link` (its gather link for an all-gather).
    pub fn predicted(&self, link: &Link) -> f64 {
        let line = if self.kind == "all-gather" { link.for_gather() } else { link };
        line.time(self.model_bytes)
    }
}

fn barrier(comm: &mut dyn Communicator) -> Result<(), CommError> {
    let everyone: Vec<usize> = (0..comm.size()).collect();
    comm.exchange(&everyone, Arc::new(Tensor::scalar_f32(0.0))).map(|_| ())
}

/// Measures all-reduce and all-gather over the groups of mesh axis `axis` for every block size in
/// `sizes` (bytes per rank), `reps` times each (after one warm-up), largest first (a first small
/// size would be measured with the allocator still returning memory to the kernel). Every rank must call it with
/// the same arguments; every rank returns the same samples.
pub fn sweep(
    comm: &mut dyn Communicator,
    mesh: &DeviceMesh,
    axis: usize,
    sizes: &[usize],
    reps: usize,
) -> Result<Vec<Sample>, CommError> {
    let everyone: Vec<usize> = (0..comm.size()).collect();
    let n = mesh.group_size(&[axis]);
    let mut out = vec![];
    for (kind, c) in [
        ("all-reduce", Collective::AllReduce { axes: vec![axis], op: ReduceKind::Sum }),
        ("all-gather", Collective::AllGather { axes: vec![axis], dim: 0 }),
    ] {
        for &bytes in sizes.iter().rev() {
            let elems = (bytes / 4).max(n);
            let block = Tensor::f32(vec![elems], vec![1.0; elems]);
            // Small collectives run back to back in batches (as nccl-tests and the OSU benchmarks
            // time them): the ranks' skew leaving the barrier, a few microseconds, would
            // otherwise be a large part of a few-microsecond collective. The batch length is a
            // function of the size only, so every rank runs the same number.
            let iters = batch(bytes);
            let mut times = vec![];
            for rep in 0..=reps {
                barrier(comm)?;
                let t0 = Instant::now();
                for _ in 0..iters {
                    let _ = comm.run(&c, mesh, &block)?;
                }
                let mine = t0.elapsed().as_secs_f64() / iters as f64;
                let all = comm.exchange(&everyone, Arc::new(Tensor::f32(vec![1], vec![mine as f32])))?;
                let slowest = all.iter().map(|t| t.to_f32_vec()[0] as f64).fold(0.0, f64::max);
                if rep > 0 {
                    times.push(slowest);
                }
            }
            times.sort_by(f64::total_cmp);
            let seconds = times[times.len() / 2];
            let b = elems * 4;
            let nf = n as f64;
            let model_bytes = match c {
                Collective::AllReduce { .. } => 2.0 * (nf - 1.0) / nf * b as f64,
                _ => (nf - 1.0) / nf * (b * n) as f64,
            };
            out.push(Sample { kind: kind.into(), axis, ranks: n, bytes: b, seconds, model_bytes });
        }
    }
    Ok(out)
}

/// Collectives per timed batch for blocks of `bytes`: enough that a batch moves about 1 MiB,
/// at most 64.
pub fn batch(bytes: usize) -> usize {
    ((1usize << 20) / bytes.max(1)).clamp(1, 64)
}

/// The largest relative error of `link`'s predictions for `samples`.
pub fn worst_error(samples: &[Sample], link: &Link) -> f64 {
    samples.iter().map(|s| ((s.predicted(link) - s.seconds) / s.seconds).abs()).fold(0.0, f64::max)
}

/// Most lines [`fit`] uses for one kind of collective on one axis.
pub const MAX_SEGMENTS: usize = 4;

/// A worst relative error [`fit`] does not try to improve with more lines.
pub const GOOD_FIT: f64 = 0.10;

/// The link that best reproduces `samples` (see the module docs): all-reduces and all-gathers
/// each get their own (the second as [`Link::gather`]), and each is one line by least squares on
/// relative error, or up to [`MAX_SEGMENTS`] lines over consecutive size ranges of at least two
/// measured sizes each, the breakpoints chosen to minimise the worst relative error. Lines are
/// added only while the worst error exceeds [`GOOD_FIT`], and kept only when they make it at
/// least a tenth smaller. The first line keeps `alpha >= 0`; every line `beta > 0`.
pub fn fit(samples: &[Sample]) -> Link {
    fit_with(samples, MAX_SEGMENTS)
}

/// [`fit`] with at most `max_segments` lines per kind (1: the plain alpha-beta model, for
/// comparison).
pub fn fit_with(samples: &[Sample], max_segments: usize) -> Link {
    let (gathers, reductions): (Vec<Sample>, Vec<Sample>) =
        samples.iter().cloned().partition(|s| s.kind == "all-gather");
    if gathers.is_empty() || reductions.is_empty() {
        return fit_kind(samples, max_segments);
    }
    let mut link = fit_kind(&reductions, max_segments);
    link.gather = Some(Box::new(fit_kind(&gathers, max_segments)));
    link
}

/// [`fit`] for samples of one kind.
fn fit_kind(samples: &[Sample], max_segments: usize) -> Link {
    let mut sizes: Vec<f64> = samples.iter().map(|s| s.model_bytes).collect();
    sizes.sort_by(f64::total_cmp);
    sizes.dedup();
    let one = fit_line(samples, false);
    let mut best = (worst_error(samples, &one), one);
    for k in 2..=max_segments {
        if best.0 <= GOOD_FIT {
            break;
        }
        let mut best_k: Option<(f64, Link)> = None;
        let mut cuts = vec![];
        each_split(sizes.len(), k, 2, &mut cuts, &mut |cuts| {
            let link = piecewise(samples, &sizes, cuts);
            let e = worst_error(samples, &link);
            if best_k.as_ref().is_none_or(|b| e < b.0) {
                best_k = Some((e, link));
            }
        });
        if let Some(b) = best_k
            && b.0 < best.0 * 0.9
        {
            best = b;
        }
    }
    best.1
}

/// Calls `f` with every choice of `k - 1` cut indices into `0..m` that leaves each of the `k`
/// ranges at least `min` long (`cuts` holds the ones chosen so far).
fn each_split(m: usize, k: usize, min: usize, cuts: &mut Vec<usize>, f: &mut dyn FnMut(&[usize])) {
    let start = cuts.last().copied().unwrap_or(0);
    if k == 1 {
        if m >= start + min {
            f(cuts);
        }
        return;
    }
    for c in start + min..=m.saturating_sub(min * (k - 1)) {
        cuts.push(c);
        each_split(m, k - 1, min, cuts, f);
        cuts.pop();
    }
}

/// One line per range of `sizes` between `cuts` (indices where a new line starts).
fn piecewise(samples: &[Sample], sizes: &[f64], cuts: &[usize]) -> Link {
    let bounds: Vec<f64> = cuts.iter().map(|&c| sizes[c]).collect();
    let range = |lo: f64, hi: f64| -> Vec<Sample> {
        samples.iter().filter(|s| s.model_bytes >= lo && s.model_bytes < hi).cloned().collect()
    };
    let mut link = fit_line(&range(0.0, bounds[0]), false);
    for (i, &from) in bounds.iter().enumerate() {
        let to = bounds.get(i + 1).copied().unwrap_or(f64::INFINITY);
        let l = fit_line(&range(from, to), true);
        link.segments.push(Segment { from_bytes: from, alpha: l.alpha, beta: l.beta });
    }
    link
}

/// One line through `samples`: least squares on relative error, `beta > 0`, and `alpha >= 0`
/// unless `any_alpha` (a large-message segment only has to be positive over its sizes, and
/// past the caches the time grows faster than in proportion).
fn fit_line(samples: &[Sample], any_alpha: bool) -> Link {
    // Minimise sum ((alpha + beta x - t) / t)^2: normal equations in (alpha, beta).
    let weight = |s: &Sample| 1.0 / (s.seconds * s.seconds).max(1e-30);
    let (mut s11, mut s12, mut s22, mut r1, mut r2) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for s in samples {
        let w = weight(s);
        let x = s.model_bytes;
        s11 += w;
        s12 += w * x;
        s22 += w * x * x;
        r1 += w * s.seconds;
        r2 += w * x * s.seconds;
    }
    let det = s11 * s22 - s12 * s12;
    let (mut alpha, mut beta) =
        if det.abs() > 1e-300 { ((r1 * s22 - r2 * s12) / det, (s11 * r2 - s12 * r1) / det) } else { (0.0, 0.0) };
    let lowest = samples.iter().map(|s| s.model_bytes).fold(f64::INFINITY, f64::min);
    let alpha_ok = alpha >= 0.0 || (any_alpha && alpha + beta * lowest > 0.0);
    if beta <= 0.0 {
        // Times that do not grow with size (within noise): a constant, the best on relative
        // error, and the smallest positive slope.
        let (num, den) = samples.iter().fold((0.0, 0.0), |(n, d), s| (n + weight(s) * s.seconds, d + weight(s)));
        alpha = if den > 0.0 { num / den } else { 0.0 };
        beta = 1e-15;
    } else if !alpha_ok {
        // A line through the origin.
        alpha = 0.0;
        let (num, den) = samples.iter().fold((0.0, 0.0), |(n, d), s| {
            (n + weight(s) * s.model_bytes * s.seconds, d + weight(s) * s.model_bytes * s.model_bytes)
        });
        beta = if den > 0.0 { (num / den).max(1e-15) } else { 1e-12 };
    }
    Link::linear(alpha, beta)
}

/// Measured GEMM throughput of one thread in f32 and on bf16 storage (FLOP/s, best of a few
/// 512^3 products), copy bandwidth (bytes/s, best of a few 64 MiB copies), a convolution's
/// throughput ([`conv_flops`]). The cost per instruction of each op family is fitted apart
/// ([`crate::calibrate`]).
pub fn device(cpu: &runtime::Cpu) -> Result<DeviceRates, runtime::RunError> {
    let ctx = cpu.context();
    let n = 512;
    let a = Tensor::f32(vec![n, n], (0..n * n).map(|i| (i % 7) as f32 * 0.1).collect());
    let b = Tensor::f32(vec![n, n], (0..n * n).map(|i| (i % 5) as f32 * 0.1).collect());
    let kernel = |op: &'static str| {
        move |e: kernels::Error| runtime::RunError::Kernel { node: "profile".into(), op, message: e.to_string() }
    };
    let gemm = |a: &Tensor, b: &Tensor| -> Result<f64, kernels::Error> {
        let mut best = f64::MAX;
        for _ in 0..4 {
            let t0 = Instant::now();
            let _ = kernels::cpu::eval(ctx, &ir::Op::MatMul, &[a, b])?;
            best = best.min(t0.elapsed().as_secs_f64());
        }
        Ok(2.0 * (n * n * n) as f64 / best)
    };
    let f32_flops = gemm(&a, &b).map_err(kernel("matmul"))?;
    // The same product on bf16 storage: what a mixed-precision plan's matmuls run at here.
    let bf16_flops = gemm(&a.clone().with_float_type(ir::DType::BF16), &b.clone().with_float_type(ir::DType::BF16))
        .map_err(kernel("matmul"))?;
    let len = 16 << 20; // 16 Mi f32 = 64 MiB
    let src = vec![1.0f32; len];
    let mut dst = vec![0.0f32; len];
    let mut best = f64::MAX;
    for _ in 0..4 {
        let t0 = Instant::now();
        dst.copy_from_slice(&src);
        std::hint::black_box(&mut dst);
        best = best.min(t0.elapsed().as_secs_f64());
    }
    Ok(DeviceRates {
        f32_flops,
        bf16_flops,
        memory_bandwidth: (len * 4) as f64 / best,
        conv_flops: conv_flops(ctx).map_err(kernel("conv"))?,
    })
}

/// FLOP/s of a 3x3 convolution of 64 to 64 channels on 8 images of 28x28 (a ResNet stage's
/// shape), best of a few, with the FLOPs the planner counts ([`ir::Op::flops`]).
pub fn conv_flops(ctx: &kernels::cpu::CpuContext) -> Result<f64, kernels::Error> {
    let op = ir::Op::Conv(ir::ConvAttrs { strides: [1, 1], pads: [1, 1, 1, 1], dilations: [1, 1], group: 1 });
    let (n, c, hw) = (8, 64, 28);
    let x = Tensor::f32(vec![n, c, hw, hw], (0..n * c * hw * hw).map(|i| (i % 7) as f32 * 0.1).collect());
    let w = Tensor::f32(vec![c, c, 3, 3], (0..c * c * 9).map(|i| (i % 5) as f32 * 0.1).collect());
    let metas =
        [ir::TensorMeta::new(ir::DType::F32, [n, c, hw, hw]), ir::TensorMeta::new(ir::DType::F32, [c, c, 3, 3])];
    let flops = op.flops(&metas, &[ir::TensorMeta::new(ir::DType::F32, [n, c, hw, hw])]) as f64;
    let mut best = f64::MAX;
    for _ in 0..4 {
        let t0 = Instant::now();
        let _ = kernels::cpu::eval(ctx, &op, &[&x, &w])?;
        best = best.min(t0.elapsed().as_secs_f64());
    }
    Ok(flops / best)
}

/// What [`device`] measured.
#[derive(Clone, Copy, Debug)]
pub struct DeviceRates {
    /// FLOP/s of an f32 matrix product.
    pub f32_flops: f64,
    /// FLOP/s of the same product on bf16 storage (widened, computed in f32, rounded).
    pub bf16_flops: f64,
    /// Bytes per second of a large copy.
    pub memory_bandwidth: f64,
    /// FLOP/s of a convolution ([`conv_flops`]).
    pub conv_flops: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fit_recovers_a_linear_model() {
        let link = Link::linear(5e-6, 1e-10);
        let samples: Vec<Sample> = [1e3, 1e4, 1e5, 1e6, 1e7]
            .iter()
            .map(|&x| Sample {
                kind: "all-reduce".into(),
                axis: 0,
                ranks: 2,
                bytes: x as usize,
                seconds: link.alpha + x * link.beta,
                model_bytes: x,
            })
            .collect();
        let f = fit(&samples);
        assert!((f.alpha - link.alpha).abs() / link.alpha < 1e-6, "{f:?}");
        assert!((f.beta - link.beta).abs() / link.beta < 1e-6, "{f:?}");
        assert!(f.segments.is_empty(), "a line needs no second segment: {f:?}");
    }

    /// Times that turn twice as steep per byte from 4 MiB on (a cache spilling to memory) get a
    /// second segment starting there, and it reproduces every point.
    #[test]
    fn fit_finds_the_large_message_segment() {
        let at = |x: f64| if x < 4e6 { 5e-6 + x * 2e-10 } else { -4e-4 + x * 3e-10 };
        let samples: Vec<Sample> = (0..12)
            .map(|k| {
                let x = 4096.0 * 2f64.powi(k);
                Sample {
                    kind: "all-reduce".into(),
                    axis: 0,
                    ranks: 2,
                    bytes: x as usize,
                    seconds: at(x),
                    model_bytes: x,
                }
            })
            .collect();
        let f = fit(&samples);
        assert_eq!(f.segments.len(), 1, "{f:?}");
        assert!(f.gather.is_none(), "only all-reduces were measured");
        assert!((4e6..=4.2e6).contains(&f.segments[0].from_bytes), "{f:?}");
        assert!(worst_error(&samples, &f) < 1e-6, "{f:?}");
        assert!(worst_error(&samples, &fit_line(&samples, false)) > 0.1, "one line does not fit these");
    }

    /// Every split into `k` ranges of at least `min` consecutive indices, once each.
    #[test]
    fn each_split_enumerates_the_ranges() {
        let mut got = vec![];
        each_split(6, 3, 2, &mut vec![], &mut |c| got.push(c.to_vec()));
        assert_eq!(got, vec![vec![2, 4]]);
        let mut got = vec![];
        each_split(7, 2, 2, &mut vec![], &mut |c| got.push(c.to_vec()));
        assert_eq!(got, vec![vec![2], vec![3], vec![4], vec![5]]);
    }

    /// All-reduces and all-gathers measured with different costs each get their own line, and
    /// `predicted` takes the one of the sample's kind.
    #[test]
    fn all_gathers_get_their_own_link() {
        let mut samples = vec![];
        for k in 0..8 {
            let x = 4096.0 * 2f64.powi(k);
            for (kind, alpha, beta) in [("all-reduce", 8e-6, 4e-10), ("all-gather", 3e-6, 2e-10)] {
                samples.push(Sample {
                    kind: kind.into(),
                    axis: 0,
                    ranks: 2,
                    bytes: x as usize,
                    seconds: alpha + x * beta,
                    model_bytes: x,
                });
            }
        }
        let f = fit(&samples);
        let g = f.gather.as_deref().expect("a gather link");
        assert!((f.alpha - 8e-6).abs() < 1e-12 && (g.alpha - 3e-6).abs() < 1e-12, "{f:?}");
        assert!(worst_error(&samples, &f) < 1e-6, "{f:?}");
    }
}
