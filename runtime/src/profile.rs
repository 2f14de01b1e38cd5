//! Measuring the cost model's inputs on the real back end: the links of every mesh axis (alpha
//! and beta from all-reduce and all-gather sweeps) and one device's f32 throughput and memory
//! bandwidth.
//!
//! Every rank calls [`sweep`] (SPMD). Each measurement is a barrier, then the collective on every
//! group along one axis; a rep's time is the slowest rank's, a size's time the median over reps.
//! [`fit`] finds the `alpha`, `beta` of the planner's model
//! (`alpha + factor * bytes * beta`, ring factors as in [`sharding::Collective::cost`]) by least
//! squares on *relative* errors, so small and large messages count alike; [`Sample::predicted`]
//! gives the model's time for comparison.

use std::sync::Arc;
use std::time::Instant;

use ir::Tensor;
use sharding::{Collective, DeviceMesh, Link, ReduceKind};

use crate::comm::{CommError, Communicator};

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
    /// The model's seconds for this point with `link`.
    pub fn predicted(&self, link: &Link) -> f64 {
        link.alpha + self.model_bytes * link.beta
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
            let mut times = vec![];
            for rep in 0..=reps {
                barrier(comm)?;
                let t0 = Instant::now();
                let _ = comm.run(&c, mesh, &block)?;
                let mine = t0.elapsed().as_secs_f64();
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

/// The link that best reproduces `samples`: least squares on relative error (see the module
/// docs). `alpha` is kept non-negative and `beta` positive.
pub fn fit(samples: &[Sample]) -> Link {
    // Minimise sum ((alpha + beta x - t) / t)^2: normal equations in (alpha, beta).
    let (mut s11, mut s12, mut s22, mut r1, mut r2) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for s in samples {
        let w = 1.0 / (s.seconds * s.seconds).max(1e-30);
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
    if alpha < 0.0 || beta <= 0.0 {
        // Refit the one parameter left: beta alone through the origin, or alpha alone.
        alpha = alpha.max(0.0);
        let (num, den) = samples.iter().fold((0.0, 0.0), |(n, d), s| {
            let w = 1.0 / (s.seconds * s.seconds).max(1e-30);
            (n + w * s.model_bytes * (s.seconds - alpha), d + w * s.model_bytes * s.model_bytes)
        });
        beta = if den > 0.0 { (num / den).max(1e-15) } else { 1e-12 };
    }
    Link { alpha, beta }
}

/// Measured f32 GEMM throughput of one thread (FLOP/s, best of a few 512^3 products) and copy
/// bandwidth (bytes/s, best of a few 64 MiB copies).
pub fn device(ctx: &kernels::cpu::CpuContext) -> Result<(f64, f64), kernels::Error> {
    let n = 512;
    let a = Tensor::f32(vec![n, n], (0..n * n).map(|i| (i % 7) as f32 * 0.1).collect());
    let b = Tensor::f32(vec![n, n], (0..n * n).map(|i| (i % 5) as f32 * 0.1).collect());
    let mut best = f64::MAX;
    for _ in 0..4 {
        let t0 = Instant::now();
        let _ = kernels::cpu::eval(ctx, &ir::Op::MatMul, &[&a, &b])?;
        best = best.min(t0.elapsed().as_secs_f64());
    }
    let flops = 2.0 * (n * n * n) as f64 / best;
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
    Ok((flops, (len * 4) as f64 / best))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fit_recovers_a_linear_model() {
        let link = Link { alpha: 5e-6, beta: 1e-10 };
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
    }
}
