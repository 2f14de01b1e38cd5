//! Square f32 GEMM throughput (GFLOP/s) of the candidate GEMM crates and of `kernels::cpu::gemm_f32`.
//!
//! ```text
//! cargo bench -p kernels --bench gemm --features compare-gemm      # all candidates
//! cargo bench -p kernels --bench gemm                              # only what the kernels use
//! ```
//! Optional arguments: sizes (default `1024`). Each figure is the best of 5 runs after a warm-up.
//! matrixmultiply sizes its own thread pool once per process from `MATMUL_NUM_THREADS`, so the
//! bench re-runs itself once per thread count.

use std::process::Command;
use std::time::Instant;

const THREAD_COUNTS: [usize; 2] = [1, 2];

fn best_gflops(n: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
    }
    2.0 * (n as f64).powi(3) / best / 1e9
}

fn inputs(n: usize) -> (Vec<f32>, Vec<f32>) {
    let a = (0..n * n).map(|i| ((i * 7 % 13) as f32 - 6.0) / 13.0).collect();
    let b = (0..n * n).map(|i| ((i * 5 % 11) as f32 - 5.0) / 11.0).collect();
    (a, b)
}

fn run(n: usize, threads: usize) {
    let (a, b) = inputs(n);
    let mut c = vec![0f32; n * n];
    let row = |name: &str, g: f64| println!("| {name:<34} | {threads} | {n:>5} | {g:>7.1} |");

    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("rayon pool");
    let par = if threads == 1 { gemm::Parallelism::None } else { gemm::Parallelism::Rayon(threads) };
    let g = best_gflops(n, || {
        pool.install(|| unsafe {
            gemm::gemm(
                n,
                n,
                n,
                c.as_mut_ptr(),
                1,
                n as isize,
                false,
                a.as_ptr(),
                1,
                n as isize,
                b.as_ptr(),
                1,
                n as isize,
                0.0,
                1.0,
                false,
                false,
                false,
                par,
            )
        })
    });
    row("gemm 0.19 (x86-v4)", g);

    #[cfg(feature = "compare-gemm")]
    {
        let g = best_gflops(n, || unsafe {
            matrixmultiply::sgemm(
                n,
                n,
                n,
                1.0,
                a.as_ptr(),
                n as isize,
                1,
                b.as_ptr(),
                n as isize,
                1,
                0.0,
                c.as_mut_ptr(),
                n as isize,
                1,
            )
        });
        row("matrixmultiply 0.3 (threading)", g);

        let fpar = match std::num::NonZeroUsize::new(threads) {
            Some(t) if threads > 1 => faer::Par::Rayon(t),
            _ => faer::Par::Seq,
        };
        let g = best_gflops(n, || {
            pool.install(|| {
                let am = faer::MatRef::from_row_major_slice(&a, n, n);
                let bm = faer::MatRef::from_row_major_slice(&b, n, n);
                let cm = faer::MatMut::from_row_major_slice_mut(&mut c, n, n);
                faer::linalg::matmul::matmul(cm, faer::Accum::Replace, am, bm, 1.0f32, fpar);
            })
        });
        row("faer 0.24", g);
    }

    let ctx = kernels::cpu::CpuContext::new(threads).expect("cpu context");
    let g = best_gflops(n, || {
        kernels::cpu::gemm_f32(&ctx, n, n, n, &a, false, &b, false, &mut c, 1.0, 0.0).expect("gemm_f32")
    });
    row("kernels::cpu::gemm_f32 (chosen)", g);
}

fn main() {
    let sizes: Vec<usize> = std::env::args().skip(1).filter_map(|s| s.parse().ok()).collect();
    let sizes = if sizes.is_empty() { vec![1024] } else { sizes };
    if let Ok(t) = std::env::var("GEMM_BENCH_THREADS") {
        let threads = t.parse().expect("GEMM_BENCH_THREADS is a number");
        for &n in &sizes {
            run(n, threads);
        }
        return;
    }
    println!("| library                            | threads | n | GFLOP/s |");
    println!("|---|---|---|---|");
    let exe = std::env::current_exe().expect("bench executable path");
    for threads in THREAD_COUNTS {
        let status = Command::new(&exe)
            .args(sizes.iter().map(|s| s.to_string()))
            .env("GEMM_BENCH_THREADS", threads.to_string())
            .env("MATMUL_NUM_THREADS", threads.to_string())
            .status()
            .expect("re-run the bench");
        assert!(status.success(), "bench child failed");
    }
}
