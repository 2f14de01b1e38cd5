//! The CUDA backend against the CPU reference: for each op family, random inputs go through
//! `cuda::eval` and `cpu::eval` and the outputs must agree (f32 within `1e-5 + 1e-4 * |cpu|`,
//! looser where stated; i64 and bool exactly), and bad input must fail the same way.
//!
//! Every test that needs a GPU starts with [`device`], which prints `skipped: no CUDA device`
//! and returns when there is none, so the suite passes (by skipping) on machines without a GPU.
//! The tests that need no device (the clean error without a driver, the NCCL id files) run
//! everywhere the `cuda` feature is on.
//!
//! Without a GPU the suite also runs on a CPU emulation of the device
//! ([`every_device_test_on_a_cpu_emulated_device`]): a stand-in for libcuda, libnvrtc and
//! libcublas, built with the host C++ compiler, that runs the NVRTC sources as C++ (blocks one
//! after another, each with four real threads meeting at `__syncthreads`) and does SGEMM with
//! cuBLAS's column-major conventions. It exercises everything but the hardware: cudarc's calls,
//! the host code, kernel arguments, index arithmetic and block reductions, and the row-major to
//! column-major GEMM mapping. It cannot show behaviour that needs 256-thread blocks or warps,
//! launch limits, NVRTC dialect problems, device rounding (fused multiply-adds, `expf`), or real
//! cuBLAS and NCCL.
#![cfg(feature = "cuda")]

use ir::{BinaryOp, ConvAttrs, DType, Op, PoolAttrs, ReduceOp, SliceAxis, Tensor, UnaryOp};
use kernels::Error;
use kernels::cpu::{self, CpuContext};
use kernels::cuda::{self, CudaContext, CudaTensor, nccl};
use std::time::Duration;

/// Device 0, or `None` after printing `skipped: no CUDA device` (the reason goes to stderr).
/// Any other failure to open a present device fails the test.
fn device() -> Option<CudaContext> {
    match CudaContext::new(0) {
        Ok(ctx) => Some(ctx),
        Err(Error::NoCudaDevice(why)) => {
            println!("skipped: no CUDA device");
            eprintln!("  ({why})");
            None
        }
        Err(e) => panic!("a CUDA device is present but cannot be opened: {e}"),
    }
}

/// Deterministic pseudo-random values in [-1, 1).
fn rnd(shape: &[usize], seed: u64) -> Tensor {
    let n = shape.iter().product::<usize>();
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let v = (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    Tensor::f32(shape.to_vec(), v)
}

/// Positive values in [0.1, 2.1).
fn pos(shape: &[usize], seed: u64) -> Tensor {
    Tensor::f32(shape.to_vec(), rnd(shape, seed).as_f32().unwrap().iter().map(|x| x + 1.1).collect())
}

fn ints(shape: &[usize], seed: u64, lo: i64, hi: i64) -> Tensor {
    let v =
        rnd(shape, seed).as_f32().unwrap().iter().map(|x| lo + ((x + 1.0) / 2.0 * (hi - lo) as f32) as i64).collect();
    Tensor::i64(shape.to_vec(), v)
}

fn bools(shape: &[usize], seed: u64) -> Tensor {
    Tensor::bool(shape.to_vec(), rnd(shape, seed).as_f32().unwrap().iter().map(|&x| x > 0.0).collect())
}

/// Absolute and relative tolerance for f32 outputs.
#[derive(Clone, Copy)]
struct Tol(f32, f32);

const TIGHT: Tol = Tol(1e-5, 1e-4);
/// Products and convolutions: different summation order over up to a few hundred terms.
const GEMM: Tol = Tol(1e-4, 1e-4);

#[track_caller]
fn agree(got: &Tensor, want: &Tensor, tol: Tol, what: &str) {
    assert_eq!(got.meta(), want.meta(), "{what}: metas");
    if got.dtype().is_half() {
        // Both round an f32 result once; results that differ in the f32 ulp may round one
        // 16-bit ulp apart (2^-7 relative for bf16, 2^-10 for f16).
        let ulp = if got.dtype() == DType::BF16 { 1.0 / 128.0 } else { 1.0 / 1024.0 };
        let (g, w) = (got.to_f32_vec(), want.to_f32_vec());
        for (i, (&a, &b)) in g.iter().zip(&w).enumerate() {
            let ok = a == b || (a.is_nan() && b.is_nan()) || (a - b).abs() <= tol.0 + (tol.1 + ulp) * b.abs();
            assert!(ok, "{what}: element {i}: cuda {a}, cpu {b}");
        }
        return;
    }
    match (got.as_f32(), want.as_f32()) {
        (Some(g), Some(w)) => {
            for (i, (&a, &b)) in g.iter().zip(w).enumerate() {
                let ok = a == b || (a.is_nan() && b.is_nan()) || (a - b).abs() <= tol.0 + tol.1 * b.abs();
                assert!(ok, "{what}: element {i}: cuda {a}, cpu {b}");
            }
        }
        _ => assert_eq!(got, want, "{what}"),
    }
}

/// Runs `op` on both backends and compares every output.
#[track_caller]
fn check_tol(ctx: &CudaContext, op: &Op, ins: &[&Tensor], tol: Tol) {
    let cpu_ctx = CpuContext::new(1).unwrap();
    let want = cpu::eval(&cpu_ctx, op, ins).unwrap_or_else(|e| panic!("cpu {}: {e}", op.name()));
    let dev: Vec<CudaTensor> = ins.iter().map(|t| CudaTensor::upload(ctx, t).unwrap()).collect();
    let refs: Vec<&CudaTensor> = dev.iter().collect();
    let got = cuda::eval(ctx, op, &refs).unwrap_or_else(|e| panic!("cuda {}: {e}", op.name()));
    assert_eq!(got.len(), want.len(), "{}: output count", op.name());
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.meta(), &w.meta(), "{}: output {i} meta", op.name());
        agree(&g.download(ctx).unwrap(), w, tol, &format!("{} output {i} ({op:?})", op.name()));
    }
}

#[track_caller]
fn check(ctx: &CudaContext, op: Op, ins: &[&Tensor]) {
    check_tol(ctx, &op, ins, TIGHT);
}

/// Both backends reject the input with `BadInput`.
#[track_caller]
fn both_reject(ctx: &CudaContext, op: Op, ins: &[&Tensor]) {
    let cpu_ctx = CpuContext::new(1).unwrap();
    let e = cpu::eval(&cpu_ctx, &op, ins).unwrap_err();
    assert!(matches!(e, Error::BadInput { .. }), "cpu: {e}");
    let dev: Vec<CudaTensor> = ins.iter().map(|t| CudaTensor::upload(ctx, t).unwrap()).collect();
    let refs: Vec<&CudaTensor> = dev.iter().collect();
    let e = cuda::eval(ctx, &op, &refs).unwrap_err();
    assert!(matches!(e, Error::BadInput { .. }), "cuda: {e}");
}

// ---------- no device needed ----------

#[test]
fn context_without_a_driver_is_a_clean_error() {
    match CudaContext::new(0) {
        Ok(ctx) => {
            println!("a CUDA device is present ({}): nothing to check", ctx.device_name());
            assert!(cuda::is_available());
        }
        Err(Error::NoCudaDevice(why)) => {
            assert!(!why.is_empty());
            let msg = Error::NoCudaDevice(why).to_string();
            assert!(msg.starts_with("no CUDA device: "), "{msg}");
            assert!(!cuda::is_available());
        }
        Err(e) => panic!("expected NoCudaDevice, got {e}"),
    }
    // A device that cannot exist is never a panic either.
    assert!(matches!(CudaContext::new(1 << 20), Err(Error::NoCudaDevice(_))));
}

#[test]
fn nccl_id_files_round_trip_and_time_out() {
    let dir = std::env::temp_dir().join(format!("autopar-nccl-id-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bytes: Vec<u8> = (0..nccl::ID_BYTES as u32).map(|i| (i * 7 % 251) as u8).collect();
    let id = nccl::NcclId::from_bytes(&bytes).unwrap();
    let path = nccl::group_id_path(&dir, &[0, 2, 4]);
    assert!(path.ends_with("nccl-id-0-2-4"));
    // A reader that starts first waits for the writer.
    let reader = {
        let path = path.clone();
        std::thread::spawn(move || nccl::read_id_file(&path, Duration::from_secs(10)))
    };
    std::thread::sleep(Duration::from_millis(50));
    nccl::write_id_file(&path, &id).unwrap();
    assert_eq!(reader.join().unwrap().unwrap(), id);
    assert_eq!(nccl::read_id_file(&path, Duration::ZERO).unwrap().as_bytes(), &bytes[..]);
    let missing = nccl::read_id_file(&dir.join("absent"), Duration::from_millis(30)).unwrap_err();
    assert!(matches!(missing, Error::Rendezvous(_)), "{missing}");
    std::fs::write(dir.join("short"), [1u8, 2, 3]).unwrap();
    assert!(matches!(nccl::read_id_file(&dir.join("short"), Duration::ZERO), Err(Error::Rendezvous(_))));
    assert!(matches!(nccl::NcclId::from_bytes(&[0; 3]), Err(Error::Rendezvous(_))));
    std::fs::remove_dir_all(&dir).ok();
}

// ---------- device tests ----------

#[test]
fn tensors_round_trip_and_memory_is_counted() {
    let Some(ctx) = device() else { return };
    let before = ctx.bytes_in_use();
    ctx.reset_peak();
    let t = rnd(&[3, 5], 1);
    let d = CudaTensor::upload(&ctx, &t).unwrap();
    assert_eq!(d.bytes(), 60);
    assert!(ctx.bytes_in_use() >= before + 60);
    assert_eq!(d.download(&ctx).unwrap(), t);
    for t in [ints(&[4], 2, -9, 9), bools(&[2, 3], 3), Tensor::f32(vec![0, 4], vec![]), Tensor::scalar_f32(2.5)] {
        assert_eq!(CudaTensor::upload(&ctx, &t).unwrap().download(&ctx).unwrap(), t);
    }
    let shared = d.clone();
    drop(d);
    assert!(ctx.bytes_in_use() >= before + 60, "a clone keeps the buffer");
    drop(shared);
    assert_eq!(ctx.bytes_in_use(), before);
    assert!(ctx.peak_bytes() >= before + 60);
    ctx.reset_peak();
    assert_eq!(ctx.peak_bytes(), ctx.bytes_in_use());
}

#[test]
fn sources_are_not_kernels() {
    let Some(ctx) = device() else { return };
    let e = cuda::eval(&ctx, &Op::Input { name: "x".into() }, &[]).unwrap_err();
    assert!(matches!(e, Error::Unsupported { .. }), "{e}");
    check(&ctx, Op::Constant(rnd(&[2, 2], 4)), &[]);
    check(&ctx, Op::Identity, &[&ints(&[3], 5, 0, 9)]);
    both_reject(&ctx, Op::Binary(BinaryOp::Add), &[&rnd(&[2], 1), &rnd(&[3], 2)]);
}

#[test]
fn unary_ops() {
    let Some(ctx) = device() else { return };
    let x = rnd(&[7, 33], 10);
    let mut special = x.as_f32().unwrap().to_vec();
    special[..6].copy_from_slice(&[0.0, -0.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 3.5]);
    let special = Tensor::f32(vec![7, 33], special);
    for u in ir::UNARY_OPS {
        if matches!(u, UnaryOp::Not | UnaryOp::BitwiseNot) {
            continue;
        }
        let input = if matches!(u, UnaryOp::Log | UnaryOp::Sqrt) { pos(&[7, 33], 11) } else { x.clone() };
        check(&ctx, Op::Unary(u), &[&input]);
        if !matches!(u, UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Gelu | UnaryOp::GeluTanh) {
            check(&ctx, Op::Unary(u), &[&special]);
        }
    }
    let i = Tensor::i64(vec![5], vec![-3, 0, 7, i64::MIN, i64::MAX]);
    for u in [UnaryOp::Neg, UnaryOp::Abs, UnaryOp::Sign] {
        check(&ctx, Op::Unary(u), &[&i]);
    }
    check(&ctx, Op::Unary(UnaryOp::Not), &[&bools(&[9], 12)]);
    check(&ctx, Op::Unary(UnaryOp::Relu), &[&Tensor::f32(vec![0], vec![])]);
}

#[test]
fn binary_ops_broadcast() {
    let Some(ctx) = device() else { return };
    let shapes: [(&[usize], &[usize]); 6] = [
        (&[2, 3, 4], &[4]),
        (&[2, 1, 4], &[3, 1]),
        (&[5], &[]),
        (&[], &[3, 2]),
        (&[4, 1, 3, 1], &[1, 5, 1, 2]),
        (&[6, 7], &[6, 7]),
    ];
    for (k, (sa, sb)) in shapes.iter().enumerate() {
        let (a, b) = (rnd(sa, 20 + k as u64), rnd(sb, 40 + k as u64));
        for op in ir::BINARY_OPS {
            // PRelu's slope must broadcast to x: tested in `activation_family`.
            if op.is_logical() || op.is_bitwise() || op == BinaryOp::PRelu {
                continue;
            }
            let (a, b) = if op == BinaryOp::Pow { (pos(sa, 1), rnd(sb, 2)) } else { (a.clone(), b.clone()) };
            check(&ctx, Op::Binary(op), &[&a, &b]);
        }
        let (ia, ib) = (ints(sa, 60 + k as u64, -20, 20), ints(sb, 70 + k as u64, 1, 6));
        for op in ir::BINARY_OPS {
            if !op.is_logical() && op != BinaryOp::PRelu {
                check(&ctx, Op::Binary(op), &[&ia, &ib]);
            }
        }
        let (ba, bb) = (bools(sa, 80 + k as u64), bools(sb, 90 + k as u64));
        for op in [BinaryOp::Equal, BinaryOp::And, BinaryOp::Or, BinaryOp::Xor] {
            check(&ctx, Op::Binary(op), &[&ba, &bb]);
        }
    }
    // Integer corner cases: wrapping, MIN / -1, negative powers, division by zero.
    let a = Tensor::i64(vec![4], vec![i64::MIN, 7, -7, 2]);
    let b = Tensor::i64(vec![4], vec![-1, -2, 2, -3]);
    for op in [BinaryOp::Div, BinaryOp::Mul, BinaryOp::Sub, BinaryOp::Pow] {
        check(&ctx, Op::Binary(op), &[&a, &b]);
    }
    both_reject(&ctx, Op::Binary(BinaryOp::Div), &[&a, &Tensor::i64(vec![2, 1], vec![1, 0])]);
    let nan = Tensor::f32(vec![3], vec![f32::NAN, 1.0, -0.0]);
    for op in [BinaryOp::Max, BinaryOp::Min, BinaryOp::Equal, BinaryOp::Less] {
        check(&ctx, Op::Binary(op), &[&nan, &Tensor::f32(vec![3], vec![0.0, f32::NAN, 0.0])]);
    }
}

#[test]
fn where_and_cast() {
    let Some(ctx) = device() else { return };
    let c = bools(&[3, 1, 4], 1);
    check(&ctx, Op::Where, &[&c, &rnd(&[2, 4], 2), &rnd(&[3, 2, 1], 3)]);
    check(&ctx, Op::Where, &[&c, &ints(&[4], 4, -5, 5), &ints(&[], 5, 0, 3)]);
    check(&ctx, Op::Where, &[&c, &bools(&[4], 6), &bools(&[3, 1, 1], 7)]);
    let f = Tensor::f32(vec![7], vec![1.7, -1.7, 0.0, f32::NAN, 1e30, -1e30, 0.4]);
    let i = Tensor::i64(vec![4], vec![-3, 0, 1 << 40, 5]);
    let b = bools(&[5], 8);
    for to in [DType::F32, DType::I64, DType::Bool] {
        for t in [&f, &i, &b] {
            check(&ctx, Op::Cast { to }, &[t]);
        }
    }
}

#[test]
fn half_precision_storage() {
    let Some(ctx) = device() else { return };
    // Rounding to nearest even, NaN, infinities, f16's overflow (65520 and up) and subnormals.
    let f = Tensor::f32(
        vec![10],
        vec![
            1.0 + 1.0 / 256.0,
            1.0 + 3.0 / 256.0,
            -2.5e-6,
            70000.0,
            65519.0,
            65520.0,
            f32::NAN,
            f32::INFINITY,
            1e-8,
            -0.0,
        ],
    );
    for to in [DType::BF16, DType::F16] {
        // Casts are exact: compared bit for bit.
        let cpu_ctx = CpuContext::new(1).unwrap();
        let want = cpu::eval(&cpu_ctx, &Op::Cast { to }, &[&f]).unwrap().remove(0);
        let dev = CudaTensor::upload(&ctx, &f).unwrap();
        let got = cuda::eval(&ctx, &Op::Cast { to }, &[&dev]).unwrap().remove(0).download(&ctx).unwrap();
        let bits = |t: &Tensor| match t.data() {
            ir::Data::BF16(v) => v.iter().map(|x| x.to_bits()).collect::<Vec<u16>>(),
            ir::Data::F16(v) => v.iter().map(|x| x.to_bits()).collect(),
            _ => panic!("not a 16-bit tensor"),
        };
        assert_eq!(bits(&got), bits(&want), "cast to {to}");
        let h = f.clone().with_float_type(to);
        for back in [DType::F32, DType::I64, DType::Bool, DType::BF16, DType::F16] {
            check(&ctx, Op::Cast { to: back }, &[&h]);
        }
        // Ops on 16-bit inputs compute in f32 and round once, on both back ends.
        let a = rnd(&[4, 8], 1).with_float_type(to);
        let b = rnd(&[8, 3], 2).with_float_type(to);
        check_tol(&ctx, &Op::MatMul, &[&a, &b], GEMM);
        // cublasGemmEx: batched, transposed with a bias (Gemm), and a partial broadcast.
        let (x, y) = (rnd(&[2, 4, 8], 4).with_float_type(to), rnd(&[2, 8, 3], 5).with_float_type(to));
        check_tol(&ctx, &Op::MatMul, &[&x, &y], GEMM);
        let (w, bias) = (rnd(&[3, 8], 6).with_float_type(to), rnd(&[3], 7).with_float_type(to));
        let gemm = Op::Gemm { alpha: 0.5, beta: 1.0, trans_a: false, trans_b: true };
        check_tol(&ctx, &gemm, &[&a, &w, &bias], GEMM);
        let (p, q) = (rnd(&[2, 1, 4, 8], 8).with_float_type(to), rnd(&[1, 3, 8, 2], 9).with_float_type(to));
        check_tol(&ctx, &Op::MatMul, &[&p, &q], GEMM);
        check(&ctx, Op::Binary(BinaryOp::Add), &[&a, &rnd(&[8], 3).with_float_type(to)]);
        check(&ctx, Op::Softmax { axis: 1 }, &[&a]);
        check(&ctx, Op::Transpose { perm: vec![1, 0] }, &[&a]);
        check(&ctx, Op::Reduce { op: ReduceOp::Sum, axes: vec![1], keepdims: false }, &[&a]);
    }
}

#[test]
fn reductions() {
    let Some(ctx) = device() else { return };
    // Shapes that take each path: long rows, transposed few-output columns, plain columns.
    let cases: [(&[usize], &[usize]); 9] = [
        (&[4, 300], &[1]),
        (&[3, 200, 5], &[1]),
        (&[64, 3, 70], &[1]),
        (&[2, 3, 4], &[0, 2]),
        (&[2, 3, 4, 5], &[0, 1, 3]),
        (&[6, 5], &[]),
        (&[6, 5], &[0, 1]),
        (&[7], &[0]),
        (&[3, 0, 2], &[1]),
    ];
    for (k, (shape, axes)) in cases.iter().enumerate() {
        let x = rnd(shape, 100 + k as u64);
        let p = pos(shape, 200 + k as u64);
        for r in ir::REDUCE_OPS {
            let input = if matches!(r, ReduceOp::LogSum) { &p } else { &x };
            for keepdims in [false, true] {
                check(&ctx, Op::Reduce { op: r, axes: axes.to_vec(), keepdims }, &[input]);
            }
        }
        let i = ints(shape, 300 + k as u64, -4, 5);
        for r in [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Max, ReduceOp::Min] {
            check(&ctx, Op::Reduce { op: r, axes: axes.to_vec(), keepdims: false }, &[&i]);
        }
        let b = bools(shape, 400 + k as u64);
        for r in [ReduceOp::Max, ReduceOp::Min] {
            check(&ctx, Op::Reduce { op: r, axes: axes.to_vec(), keepdims: true }, &[&b]);
        }
    }
    let nan = Tensor::f32(vec![2, 100], (0..200).map(|i| if i == 150 { f32::NAN } else { i as f32 }).collect());
    for r in [ReduceOp::Max, ReduceOp::Min, ReduceOp::Sum, ReduceOp::LogSumExp] {
        check(&ctx, Op::Reduce { op: r, axes: vec![1], keepdims: false }, &[&nan]);
    }
    let ninf = Tensor::f32(vec![1, 80], vec![f32::NEG_INFINITY; 80]);
    check(&ctx, Op::Reduce { op: ReduceOp::LogSumExp, axes: vec![1], keepdims: false }, &[&ninf]);
    check(&ctx, Op::GlobalAveragePool, &[&rnd(&[2, 3, 9, 11], 5)]);
    check(&ctx, Op::GlobalMaxPool, &[&rnd(&[2, 3, 9, 11], 6)]);
}

#[test]
fn softmax_family() {
    let Some(ctx) = device() else { return };
    for (shape, axis) in [(&[3, 100][..], 1), (&[2, 5, 7], 1), (&[4, 6], 1), (&[6, 4], 0), (&[2, 3, 130], 2)] {
        let x = rnd(shape, 7);
        check(&ctx, Op::Softmax { axis }, &[&x]);
        check(&ctx, Op::LogSoftmax { axis }, &[&x]);
        let dy = rnd(shape, 8);
        for log in [false, true] {
            let cpu_ctx = CpuContext::new(1).unwrap();
            let fwd = if log { Op::LogSoftmax { axis } } else { Op::Softmax { axis } };
            let y = cpu::eval(&cpu_ctx, &fwd, &[&x]).unwrap().remove(0);
            check(&ctx, Op::SoftmaxGrad { axis, log }, &[&y, &dy]);
        }
    }
    let mask =
        Tensor::f32(vec![2, 70], (0..140).map(|i| if i < 70 { f32::NEG_INFINITY } else { i as f32 / 50.0 }).collect());
    check(&ctx, Op::Softmax { axis: 1 }, &[&mask]);
}

#[test]
fn normalisations() {
    let Some(ctx) = device() else { return };
    let x = rnd(&[4, 3, 80], 1);
    for (axis, scale) in [(2, rnd(&[80], 2)), (1, rnd(&[3, 80], 3)), (2, rnd(&[1], 4))] {
        let eps = 1e-5;
        check(&ctx, Op::LayerNorm { axis, epsilon: eps }, &[&x, &scale]);
        check(&ctx, Op::LayerNorm { axis, epsilon: eps }, &[&x, &scale, &rnd(&x.shape()[axis..], 5)]);
        check(&ctx, Op::LayerNormGrad { axis, epsilon: eps }, &[&x, &scale, &rnd(&[4, 3, 80], 6)]);
    }
    let small = rnd(&[5, 6], 7);
    check(&ctx, Op::LayerNorm { axis: 1, epsilon: 1e-3 }, &[&small, &rnd(&[6], 8)]);
    check(&ctx, Op::LayerNormGrad { axis: 1, epsilon: 1e-3 }, &[&small, &rnd(&[6], 8), &rnd(&[5, 6], 9)]);
    let img = rnd(&[2, 5, 4, 3], 10);
    let c = |s| rnd(&[5], s);
    check(&ctx, Op::BatchNorm { epsilon: 1e-5 }, &[&img, &c(11), &c(12), &c(13), &pos(&[5], 14)]);
    // Training batch norm: statistics over N and the spatial dims (2-D, 3-D, 4-D; a channel
    // longer than a block; a batch of one).
    for (shape, s) in [(&[2, 5, 4, 3][..], 20), (&[6, 5][..], 24), (&[3, 5, 300][..], 28), (&[1, 5, 7][..], 32)] {
        let x = rnd(shape, s);
        check(&ctx, Op::BatchNormTrain { epsilon: 1e-5 }, &[&x, &c(s + 1), &c(s + 2)]);
        check(&ctx, Op::BatchNormTrainGrad { epsilon: 1e-3 }, &[&x, &c(s + 1), &rnd(shape, s + 3)]);
    }
    for size in [1, 2, 3, 5] {
        let (alpha, beta, bias) = (1e-2, 0.75, 1.5);
        check(&ctx, Op::Lrn { size, alpha, beta, bias }, &[&img]);
        check(&ctx, Op::LrnGrad { size, alpha, beta, bias }, &[&img, &rnd(&[2, 5, 4, 3], 15)]);
    }
}

#[test]
fn matrix_products() {
    let Some(ctx) = device() else { return };
    let mm = |a: &[usize], b: &[usize], s| {
        check_tol(&ctx, &Op::MatMul, &[&rnd(a, s), &rnd(b, s + 1)], GEMM);
    };
    mm(&[5, 7], &[7, 3], 1);
    mm(&[2, 4, 5, 7], &[7, 3], 3);
    mm(&[2, 5, 7], &[2, 7, 3], 5);
    mm(&[5, 7], &[4, 7, 3], 7);
    mm(&[2, 1, 5, 7], &[3, 7, 6], 9);
    mm(&[7], &[7, 3], 11);
    mm(&[2, 5, 7], &[7], 13);
    mm(&[7], &[7], 15);
    mm(&[3, 0], &[0, 4], 17);
    mm(&[64, 130], &[130, 70], 19);
    for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
        let a = if ta { rnd(&[6, 4], 20) } else { rnd(&[4, 6], 20) };
        let b = if tb { rnd(&[5, 6], 21) } else { rnd(&[6, 5], 21) };
        let gemm = Op::Gemm { alpha: 0.5, beta: 2.0, trans_a: ta, trans_b: tb };
        check_tol(&ctx, &gemm, &[&a, &b], GEMM);
        for c in [rnd(&[5], 22), rnd(&[4, 1], 23), rnd(&[], 24), rnd(&[4, 5], 25)] {
            check_tol(&ctx, &gemm, &[&a, &b, &c], GEMM);
        }
        let no_c = Op::Gemm { alpha: 1.0, beta: 0.0, trans_a: ta, trans_b: tb };
        check_tol(&ctx, &no_c, &[&a, &b, &Tensor::f32(vec![5], vec![f32::NAN; 5])], GEMM);
    }
    let empty_k = Op::Gemm { alpha: 1.0, beta: 3.0, trans_a: false, trans_b: false };
    check(&ctx, empty_k, &[&rnd(&[3, 0], 1), &rnd(&[0, 2], 2), &rnd(&[3, 2], 3)]);
}

#[test]
fn larger_shapes_take_multi_block_paths_and_free_their_scratch() {
    let Some(ctx) = device() else { return };
    let before = ctx.bytes_in_use();
    ctx.reset_peak();
    let x = rnd(&[4, 64, 256], 1);
    check(&ctx, Op::LayerNorm { axis: 2, epsilon: 1e-5 }, &[&x, &rnd(&[256], 2), &rnd(&[256], 3)]);
    check(&ctx, Op::Softmax { axis: 2 }, &[&x]);
    check(&ctx, Op::Softmax { axis: 1 }, &[&x]);
    check(&ctx, Op::Unary(UnaryOp::Gelu), &[&x]);
    check(&ctx, Op::Reduce { op: ReduceOp::Sum, axes: vec![0, 1], keepdims: false }, &[&x]);
    check(&ctx, Op::Reduce { op: ReduceOp::Mean, axes: vec![0, 2], keepdims: true }, &[&x]);
    check(&ctx, Op::Transpose { perm: vec![2, 0, 1] }, &[&x]);
    check_tol(&ctx, &Op::MatMul, &[&x, &rnd(&[256, 96], 4)], GEMM);
    check_tol(&ctx, &Op::MatMul, &[&rnd(&[4, 2, 64, 32], 5), &rnd(&[4, 2, 32, 64], 6)], GEMM);
    let ids = ints(&[4, 64], 7, 0, 500);
    check(&ctx, Op::Gather { axis: 0 }, &[&rnd(&[500, 48], 8), &ids]);
    check(&ctx, Op::GatherGrad { axis: 0, shape: vec![500, 48] }, &[&ids, &rnd(&[4, 64, 48], 9)]);
    let img = rnd(&[4, 8, 20, 20], 10);
    let a = conv_attrs([1, 1], [1, 1, 1, 1], [1, 1], 1);
    check_tol(&ctx, &Op::Conv(a.clone()), &[&img, &rnd(&[16, 8, 3, 3], 11), &rnd(&[16], 12)], GEMM);
    check_tol(
        &ctx,
        &Op::ConvWeightGrad { attrs: a.clone(), shape: vec![16, 8, 3, 3] },
        &[&img, &rnd(&[4, 16, 20, 20], 13)],
        GEMM,
    );
    check_tol(
        &ctx,
        &Op::ConvInputGrad { attrs: a, shape: vec![4, 8, 20, 20] },
        &[&rnd(&[4, 16, 20, 20], 14), &rnd(&[16, 8, 3, 3], 15)],
        GEMM,
    );
    check(&ctx, Op::MaxPoolGrad(pool_attrs([3, 3], [2, 2], [1, 1, 1, 1])), &[&img, &rnd(&[4, 8, 10, 10], 16)]);
    // Every input, output and scratch buffer of those ops is gone.
    assert_eq!(ctx.bytes_in_use(), before);
    assert!(ctx.peak_bytes() >= before + x.bytes());
}

fn conv_attrs(strides: [usize; 2], pads: [usize; 4], dilations: [usize; 2], group: usize) -> ConvAttrs {
    ConvAttrs { strides, pads, dilations, group }
}

#[test]
fn convolutions_and_their_gradients() {
    let Some(ctx) = device() else { return };
    let cases = [
        // (x shape, w shape, attrs)
        ([2, 3, 9, 8], [4, 3, 3, 3], conv_attrs([1, 1], [1, 1, 1, 1], [1, 1], 1)),
        ([1, 4, 10, 7], [6, 2, 3, 2], conv_attrs([2, 1], [0, 1, 2, 0], [1, 2], 2)),
        ([2, 6, 5, 5], [6, 1, 3, 3], conv_attrs([1, 2], [2, 2, 1, 1], [2, 1], 6)),
        ([3, 4, 6, 6], [5, 4, 1, 1], conv_attrs([1, 1], [0; 4], [1, 1], 1)),
        ([1, 4, 6, 6], [4, 2, 1, 1], conv_attrs([1, 1], [0; 4], [1, 1], 2)),
        ([2, 2, 7, 7], [3, 2, 2, 2], conv_attrs([3, 3], [0; 4], [1, 1], 1)),
        // Maps smaller than the padded kernel (ConvNeXt's last stage: 2x2 under a 7x7
        // depthwise kernel, padding 3), pads wider than the map, whole taps outside the image.
        ([2, 4, 2, 2], [4, 1, 7, 7], conv_attrs([1, 1], [3, 3, 3, 3], [1, 1], 4)),
        ([1, 2, 3, 2], [2, 2, 3, 5], conv_attrs([2, 3], [4, 4, 4, 4], [1, 1], 1)),
        ([1, 1, 2, 3], [2, 1, 3, 3], conv_attrs([1, 1], [3, 2, 1, 4], [2, 3], 1)),
        ([1, 1, 4, 1], [1, 1, 1, 3], conv_attrs([1, 1], [0, 5, 0, 5], [1, 1], 1)),
    ];
    let cpu_ctx = CpuContext::new(1).unwrap();
    for (k, (xs, ws, a)) in cases.iter().enumerate() {
        let s = 50 * k as u64;
        let (x, w, b) = (rnd(xs, s), rnd(ws, s + 1), rnd(&[ws[0]], s + 2));
        check_tol(&ctx, &Op::Conv(a.clone()), &[&x, &w], GEMM);
        check_tol(&ctx, &Op::Conv(a.clone()), &[&x, &w, &b], GEMM);
        let y = cpu::eval(&cpu_ctx, &Op::Conv(a.clone()), &[&x, &w]).unwrap().remove(0);
        let dy = rnd(y.shape(), s + 3);
        check_tol(&ctx, &Op::ConvInputGrad { attrs: a.clone(), shape: xs.to_vec() }, &[&dy, &w], GEMM);
        check_tol(&ctx, &Op::ConvWeightGrad { attrs: a.clone(), shape: ws.to_vec() }, &[&x, &dy], GEMM);
    }
    both_reject(
        &ctx,
        Op::Conv(conv_attrs([1, 1], [0; 4], [1, 1], 1)),
        &[&rnd(&[1, 2, 3, 3], 1), &rnd(&[1, 2, 0, 1], 2)],
    );
}

fn pool_attrs(kernel: [usize; 2], strides: [usize; 2], pads: [usize; 4]) -> PoolAttrs {
    PoolAttrs { kernel, strides, pads, dilations: [1, 1], ceil_mode: false, count_include_pad: false }
}

#[test]
fn pooling_and_its_gradients() {
    let Some(ctx) = device() else { return };
    let base = pool_attrs([3, 3], [2, 2], [1, 1, 1, 1]);
    let attrs = [
        base.clone(),
        PoolAttrs { ceil_mode: true, ..base.clone() },
        PoolAttrs { count_include_pad: true, ..base.clone() },
        PoolAttrs { ceil_mode: true, count_include_pad: true, ..pool_attrs([2, 3], [2, 2], [0, 1, 1, 0]) },
        PoolAttrs { dilations: [2, 1], ..pool_attrs([2, 2], [1, 1], [1, 0, 0, 1]) },
        pool_attrs([2, 2], [2, 2], [0; 4]),
        // Windows larger than the map.
        pool_attrs([11, 13], [1, 2], [5, 6, 5, 6]),
    ];
    let cpu_ctx = CpuContext::new(1).unwrap();
    let mut x = rnd(&[2, 3, 9, 10], 3).as_f32().unwrap().to_vec();
    x[17] = x[18]; // a tie inside a window
    let x = Tensor::f32(vec![2, 3, 9, 10], x);
    for a in attrs {
        let avg = PoolAttrs { dilations: [1, 1], ..a.clone() };
        check(&ctx, Op::MaxPool(a.clone()), &[&x]);
        check(&ctx, Op::AveragePool(avg.clone()), &[&x]);
        let y = cpu::eval(&cpu_ctx, &Op::MaxPool(a.clone()), &[&x]).unwrap().remove(0);
        let dy = rnd(y.shape(), 4);
        check(&ctx, Op::MaxPoolGrad(a.clone()), &[&x, &dy]);
        let y = cpu::eval(&cpu_ctx, &Op::AveragePool(avg.clone()), &[&x]).unwrap().remove(0);
        let dy = rnd(y.shape(), 5);
        check(&ctx, Op::AveragePoolGrad { attrs: avg, shape: x.shape().to_vec() }, &[&dy]);
    }
    both_reject(&ctx, Op::MaxPool(pool_attrs([0, 2], [1, 1], [0; 4])), &[&x]);
}

#[test]
fn data_movement() {
    let Some(ctx) = device() else { return };
    let x = rnd(&[2, 3, 4, 5], 1);
    let i = ints(&[2, 3, 4], 2, -50, 50);
    let b = bools(&[3, 4], 3);
    check(&ctx, Op::Transpose { perm: vec![3, 1, 0, 2] }, &[&x]);
    check(&ctx, Op::Transpose { perm: vec![2, 0, 1] }, &[&i]);
    check(&ctx, Op::Transpose { perm: vec![1, 0] }, &[&b]);
    check(&ctx, Op::Reshape { shape: vec![6, 20] }, &[&x]);
    check(&ctx, Op::Expand { shape: vec![2, 3, 4] }, &[&rnd(&[3, 1], 4)]);
    check(&ctx, Op::Expand { shape: vec![5, 3, 4] }, &[&b]);
    check(&ctx, Op::Concat { axis: 1 }, &[&rnd(&[2, 1, 3], 5), &rnd(&[2, 4, 3], 6), &rnd(&[2, 0, 3], 7)]);
    check(&ctx, Op::Concat { axis: 0 }, &[&i, &i]);
    check(&ctx, Op::Split { axis: 2, sizes: vec![1, 3, 0] }, &[&x]);
    check(&ctx, Op::Split { axis: 0, sizes: vec![2, 1] }, &[&b]);
    let sl = Op::Slice {
        axes: vec![SliceAxis { axis: 1, start: 2, len: 2, step: -1 }, SliceAxis { axis: 3, start: 0, len: 3, step: 2 }],
    };
    check(&ctx, sl.clone(), &[&x]);
    check(&ctx, Op::Slice { axes: vec![SliceAxis { axis: 0, start: 1, len: 2, step: 1 }] }, &[&b]);
    let sg = Op::SliceGrad {
        axes: vec![SliceAxis { axis: 1, start: 2, len: 2, step: -1 }, SliceAxis { axis: 3, start: 0, len: 3, step: 2 }],
        shape: vec![2, 3, 4, 5],
    };
    check(&ctx, sg, &[&rnd(&[2, 2, 4, 3], 8)]);
    for (pads, value) in [(vec![1, 0, 2, 1, 0, 3, 0, 2], 0.5), (vec![0; 8], 0.0)] {
        check(&ctx, Op::Pad { pads: pads.clone(), value }, &[&x]);
    }
    check(&ctx, Op::Pad { pads: vec![1, 0, 0, 2, 1, 0], value: -3.7 }, &[&i]);
    check(&ctx, Op::Pad { pads: vec![1, 1, 0, 2], value: 1.0 }, &[&b]);
}

#[test]
fn gather_and_its_gradient() {
    let Some(ctx) = device() else { return };
    let x = rnd(&[4, 6, 3], 1);
    let idx = Tensor::i64(vec![2, 3], vec![0, -1, 5, 5, 2, -6]);
    for axis in [0usize, 1] {
        let idx = if axis == 0 { Tensor::i64(vec![5], vec![3, 0, -1, 3, 1]) } else { idx.clone() };
        check(&ctx, Op::Gather { axis }, &[&x, &idx]);
        let y = cpu::eval(&CpuContext::new(1).unwrap(), &Op::Gather { axis }, &[&x, &idx]).unwrap().remove(0);
        check(&ctx, Op::GatherGrad { axis, shape: vec![4, 6, 3] }, &[&idx, &rnd(y.shape(), 2)]);
    }
    check(&ctx, Op::Gather { axis: 0 }, &[&ints(&[5, 2], 3, -9, 9), &Tensor::i64(vec![], vec![4])]);
    check(&ctx, Op::Gather { axis: 1 }, &[&bools(&[2, 3], 4), &Tensor::i64(vec![0], vec![])]);
    // An embedding-shaped gradient with many repeated ids.
    let ids = ints(&[8, 16], 5, 0, 10);
    check(&ctx, Op::GatherGrad { axis: 0, shape: vec![10, 32] }, &[&ids, &rnd(&[8, 16, 32], 6)]);
    both_reject(&ctx, Op::Gather { axis: 1 }, &[&x, &Tensor::i64(vec![1], vec![6])]);
    both_reject(
        &ctx,
        Op::GatherGrad { axis: 0, shape: vec![4, 3] },
        &[&Tensor::i64(vec![1], vec![-5]), &rnd(&[1, 3], 7)],
    );
}

#[test]
fn indexing_family() {
    use ir::{IndexOp, ScatterReduction as R};
    let Some(ctx) = device() else { return };
    let x = rnd(&[3, 5, 4], 1);
    let i = ints(&[3, 5, 4], 2, -9, 9);
    let b = bools(&[3, 5, 4], 3);
    for (upper, k) in [(false, 0), (true, 0), (false, -2), (true, 3)] {
        for t in [&x, &i, &b] {
            check(&ctx, Op::Index(IndexOp::Trilu { upper, k }), &[t]);
        }
    }
    for axis in 0..3 {
        for (exclusive, reverse) in [(false, false), (true, false), (false, true), (true, true)] {
            check(&ctx, Op::Index(IndexOp::CumSum { axis, exclusive, reverse }), &[&x]);
            check(&ctx, Op::Index(IndexOp::CumSum { axis, exclusive, reverse }), &[&i]);
        }
        for (keepdims, select_last) in [(false, false), (true, true)] {
            check(&ctx, Op::Index(IndexOp::ArgMax { axis, keepdims, select_last }), &[&x]);
            check(&ctx, Op::Index(IndexOp::ArgMin { axis, keepdims, select_last }), &[&i]);
        }
        for largest in [true, false] {
            let k = x.shape()[axis] - 1;
            check(&ctx, Op::Index(IndexOp::TopK { axis, k, largest }), &[&x]);
            check(&ctx, Op::Index(IndexOp::TopK { axis, k, largest }), &[&i]);
        }
    }
    // Ties and NaN order the same way on both.
    let ties = Tensor::f32(vec![2, 4], vec![1.0, f32::NAN, 1.0, 0.0, 2.0, 2.0, 2.0, 2.0]);
    check(&ctx, Op::Index(IndexOp::TopK { axis: 1, k: 3, largest: true }), &[&ties]);
    check(&ctx, Op::Index(IndexOp::ArgMax { axis: 1, keepdims: false, select_last: true }), &[&ties]);
    // Gathers by tuples (with a batch dim) and by elements, negative indices included.
    let nd = Tensor::i64(vec![2, 2], vec![0, -1, 2, 3]);
    check(&ctx, Op::Index(IndexOp::GatherNd { batch_dims: 0 }), &[&x, &nd]);
    check(
        &ctx,
        Op::Index(IndexOp::GatherNd { batch_dims: 1 }),
        &[&i, &Tensor::i64(vec![3, 2, 1], vec![0, 4, -1, 2, 3, 3])],
    );
    let ge = ints(&[3, 2, 4], 4, -5, 5);
    check(&ctx, Op::Index(IndexOp::GatherElements { axis: 1 }), &[&x, &ge]);
    check(&ctx, Op::Index(IndexOp::GatherElements { axis: 1 }), &[&b, &ge]);
    // Scatters, duplicate targets included, with every reduction.
    let rows = Tensor::i64(vec![3, 1], vec![1, -3, 1]);
    for red in [R::None, R::Add, R::Mul, R::Max, R::Min] {
        check(&ctx, Op::Index(IndexOp::ScatterNd { reduction: red }), &[&x, &rows, &rnd(&[3, 5, 4], 5)]);
        check(&ctx, Op::Index(IndexOp::ScatterNd { reduction: red }), &[&i, &rows, &ints(&[3, 5, 4], 6, -3, 3)]);
        let se = ints(&[3, 2, 4], 7, -5, 5);
        check(&ctx, Op::Index(IndexOp::ScatterElements { axis: 1, reduction: red }), &[&x, &se, &rnd(&[3, 2, 4], 8)]);
    }
    let cells = Tensor::i64(vec![2, 3], vec![0, 1, 2, 2, -1, 0]);
    check(&ctx, Op::Index(IndexOp::ScatterNd { reduction: R::None }), &[&b, &cells, &bools(&[2], 9)]);
    // An out-of-range index is the same error on both.
    both_reject(&ctx, Op::Index(IndexOp::GatherNd { batch_dims: 0 }), &[&x, &Tensor::i64(vec![1, 1], vec![3])]);
    both_reject(
        &ctx,
        Op::Index(IndexOp::ScatterElements { axis: 0, reduction: R::Add }),
        &[&x, &Tensor::i64(vec![1, 1, 1], vec![-4]), &rnd(&[1, 1, 1], 10)],
    );
    // Remainders of both signs, and integer division by zero.
    for op in [BinaryOp::Mod, BinaryOp::Fmod] {
        check(&ctx, Op::Binary(op), &[&ints(&[4, 6], 11, -20, 20), &ints(&[6], 12, 1, 7)]);
        check(&ctx, Op::Binary(op), &[&ints(&[4, 6], 13, -20, 20), &ints(&[6], 14, -7, -1)]);
        check(&ctx, Op::Binary(op), &[&rnd(&[4, 6], 15), &pos(&[6], 16)]);
        both_reject(&ctx, Op::Binary(op), &[&ints(&[2], 17, 1, 5), &Tensor::i64(vec![2], vec![3, 0])]);
    }
}

#[test]
fn gradients_and_optimizer_updates() {
    let Some(ctx) = device() else { return };
    let x = rnd(&[5, 13], 1);
    let dy = rnd(&[5, 13], 2);
    let cpu_ctx = CpuContext::new(1).unwrap();
    for u in ir::UNARY_OPS {
        if !ir::unary_differentiable(u) {
            continue;
        }
        let input = if ir::unary_grad_from_output(u) || matches!(u, UnaryOp::Log) {
            let p = pos(&[5, 13], 3);
            if ir::unary_grad_from_output(u) { cpu::eval(&cpu_ctx, &Op::Unary(u), &[&p]).unwrap().remove(0) } else { p }
        } else {
            x.clone()
        };
        check(&ctx, Op::UnaryGrad(u), &[&input, &dy]);
    }
    let (p, g, m, v) = (rnd(&[7, 9], 4), rnd(&[7, 9], 5), rnd(&[7, 9], 6), pos(&[7, 9], 7));
    check(&ctx, Op::SgdUpdate { lr: 0.1, momentum: 0.0, weight_decay: 0.01 }, &[&p, &g]);
    check(&ctx, Op::SgdUpdate { lr: 0.1, momentum: 0.9, weight_decay: 0.0 }, &[&p, &g, &m]);
    let adamw = Op::AdamWUpdate { lr: 1e-3, beta1: 0.9, beta2: 0.999, epsilon: 1e-8, weight_decay: 0.01 };
    for t in [1, 5, 1000] {
        check(&ctx, adamw.clone(), &[&p, &g, &m, &v, &Tensor::i64(vec![], vec![t])]);
    }
    both_reject(&ctx, adamw.clone(), &[&p, &g, &m, &v, &Tensor::i64(vec![], vec![0])]);
    // A schedule's lr factor (the optional trailing input).
    let f = Tensor::scalar_f32(0.37);
    check(&ctx, Op::SgdUpdate { lr: 0.1, momentum: 0.0, weight_decay: 0.01 }, &[&p, &g, &f]);
    check(&ctx, Op::SgdUpdate { lr: 0.1, momentum: 0.9, weight_decay: 0.01 }, &[&p, &g, &m, &f]);
    check(&ctx, adamw, &[&p, &g, &m, &v, &Tensor::i64(vec![], vec![3]), &f]);
}

#[test]
fn activation_family() {
    let Some(ctx) = device() else { return };
    let x = rnd(&[6, 35], 31);
    // Wider values, the kinks of the piecewise ops, and the non-finite ones.
    let mut sv: Vec<f32> = x.as_f32().unwrap().iter().map(|v| v * 5.0).collect();
    sv[..10].copy_from_slice(&[0.0, -0.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 3.0, -3.0, 0.5, -0.5, 2.5]);
    let special = Tensor::f32(vec![6, 35], sv);
    use UnaryOp::*;
    let with_attrs = [
        HardSigmoid { alpha: 0.3, beta: 0.4 },
        LeakyRelu { alpha: 0.2 },
        Elu { alpha: 0.7 },
        Selu { alpha: 1.5, gamma: 2.0 },
        Celu { alpha: 2.0 },
        ThresholdedRelu { alpha: 0.25 },
        Shrink { bias: 0.1, lambd: 0.3 },
        IsInf { negative: false, positive: true },
        IsInf { negative: true, positive: false },
    ];
    let dy = rnd(&[6, 35], 32);
    for u in ir::ops::activation::OPS.into_iter().chain(with_attrs) {
        if u == BitwiseNot {
            continue;
        }
        let input = if u == Acosh { pos(&[6, 35], 33) } else { x.clone() };
        check(&ctx, Op::Unary(u), &[&input]);
        check(&ctx, Op::Unary(u), &[&special]);
        if ir::unary_differentiable(u) {
            check(&ctx, Op::UnaryGrad(u), &[&input, &dy]);
        }
    }
    check(&ctx, Op::Unary(BitwiseNot), &[&Tensor::i64(vec![5], vec![-3, 0, 7, i64::MIN, i64::MAX])]);
    both_reject(&ctx, Op::Unary(BitwiseNot), &[&x]);
    both_reject(&ctx, Op::Unary(Softplus), &[&ints(&[3], 1, 0, 5)]);
    // PRelu: a per-channel slope, a scalar one, a full one; a slope x would broadcast to fails.
    let x4 = rnd(&[2, 3, 4, 5], 34);
    for slope in [rnd(&[3, 1, 1], 35), rnd(&[], 36), rnd(&[2, 3, 4, 5], 37), rnd(&[5], 38)] {
        check(&ctx, Op::Binary(BinaryOp::PRelu), &[&x4, &slope]);
    }
    both_reject(&ctx, Op::Binary(BinaryOp::PRelu), &[&rnd(&[5], 1), &rnd(&[2, 5], 2)]);
    let (ia, ib) = (ints(&[4, 1, 3], 39, -1000, 1000), ints(&[5, 1], 40, -1000, 1000));
    for op in [BinaryOp::BitwiseAnd, BinaryOp::BitwiseOr, BinaryOp::BitwiseXor] {
        check(&ctx, Op::Binary(op), &[&ia, &ib]);
        both_reject(&ctx, Op::Binary(op), &[&rnd(&[3], 1), &rnd(&[3], 2)]);
    }
    // Hardmax along every axis, with ties (the first maximum wins) and an empty tensor.
    let mut tv = rnd(&[3, 4, 5], 41).as_f32().unwrap().to_vec();
    tv[5] = tv[0].max(tv[5]);
    tv[0] = tv[5];
    let tied = Tensor::f32(vec![3, 4, 5], tv);
    for axis in 0..3 {
        check(&ctx, Op::Hardmax { axis }, &[&tied]);
    }
    check(&ctx, Op::Hardmax { axis: 1 }, &[&Tensor::f32(vec![2, 0], vec![])]);
    both_reject(&ctx, Op::Hardmax { axis: 3 }, &[&tied]);
}

/// True in the child process that runs this suite on the emulated device.
#[test]
fn dropout_draws_the_cpu_masks() {
    use ir::DropoutAttrs;
    use kernels::random::{Draw, Stream};
    let Some(ctx) = device() else { return };
    let cpu_ctx = CpuContext::new(1).unwrap();
    let stream = Stream { seed: 3, step: (1 << 32) + 5, microbatch: 1 };
    // Blocks of several ranks, offsets in every dim, a scalar; with and without the mask output.
    // (block, global shape, offsets, ratio, mask output)
    type Case<'a> = (&'a [usize], &'a [usize], &'a [usize], f32, bool);
    let cases: [Case; 5] = [
        (&[6, 10], &[6, 10], &[0, 0], 0.3, true),
        (&[3, 5], &[6, 10], &[3, 5], 0.5, false),
        (&[2, 3, 4, 7], &[4, 3, 8, 7], &[2, 0, 4, 0], 0.1, true),
        (&[], &[], &[], 0.9, true),
        (&[33, 65], &[66, 130], &[33, 65], 0.25, false),
    ];
    for (k, (local, shape, offsets, ratio, mask)) in cases.into_iter().enumerate() {
        let a = DropoutAttrs { ratio, id: k as u32, mask };
        let draw = Draw { stream, shape: shape.to_vec(), offsets: offsets.to_vec() };
        for x in [rnd(local, 40 + k as u64), rnd(local, 40 + k as u64).with_float_type(DType::BF16)] {
            let want = cpu::random::dropout(&cpu_ctx, &a, &x, Some(&draw)).unwrap();
            let dev = CudaTensor::upload(&ctx, &x).unwrap();
            let got = cuda::dropout(&ctx, &a, &dev, Some(&draw)).unwrap();
            assert_eq!(got.len(), want.len());
            for (g, w) in got.iter().zip(&want) {
                // The same bits and the same f32 product: equal exactly.
                assert_eq!(g.download(&ctx).unwrap(), *w, "case {k} ({})", x.dtype());
            }
        }
    }
    // Without a draw (inference, `eval`) nothing is dropped; a block outside its tensor is
    // refused as on the CPU.
    let x = rnd(&[4, 5], 9);
    check(&ctx, Op::Dropout(DropoutAttrs { ratio: 0.5, id: 0, mask: true }), &[&x]);
    let a = DropoutAttrs { ratio: 0.5, id: 0, mask: false };
    let bad = Draw { stream, shape: vec![4, 5], offsets: vec![1, 0] };
    let dev = CudaTensor::upload(&ctx, &x).unwrap();
    assert!(matches!(cuda::dropout(&ctx, &a, &dev, Some(&bad)), Err(Error::BadInput { .. })));
    assert!(matches!(cpu::random::dropout(&cpu_ctx, &a, &x, Some(&bad)), Err(Error::BadInput { .. })));
}

fn emulated() -> bool {
    std::env::var_os(EMULATED).is_some()
}

#[test]
fn nccl_single_rank_collectives() {
    let Some(ctx) = device() else { return };
    if emulated() {
        println!("skipped: no NCCL on the emulated device");
        return;
    }
    let id = match nccl::NcclId::new() {
        Ok(id) => id,
        Err(Error::NoCudaDevice(why)) => {
            println!("skipped: no NCCL ({why})");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let comm = nccl::NcclComm::new(&ctx, 0, 1, &id).unwrap();
    assert_eq!((comm.rank(), comm.world()), (0, 1));
    let t = rnd(&[4, 3], 1);
    let d = CudaTensor::upload(&ctx, &t).unwrap();
    for r in [nccl::Reduction::Sum, nccl::Reduction::Max] {
        assert_eq!(comm.all_reduce(&ctx, &d, r).unwrap().download(&ctx).unwrap(), t);
    }
    assert_eq!(comm.all_gather(&ctx, &d).unwrap().download(&ctx).unwrap(), t);
    assert_eq!(comm.reduce_scatter(&ctx, &d, nccl::Reduction::Sum).unwrap().download(&ctx).unwrap(), t);
    assert_eq!(comm.broadcast(&ctx, Some(&d), d.meta(), 0).unwrap().download(&ctx).unwrap(), t);
    let i = ints(&[5], 2, -9, 9);
    let di = CudaTensor::upload(&ctx, &i).unwrap();
    assert_eq!(comm.all_reduce(&ctx, &di, nccl::Reduction::Sum).unwrap().download(&ctx).unwrap(), i);
    let b = CudaTensor::upload(&ctx, &bools(&[3], 3)).unwrap();
    assert!(matches!(comm.all_reduce(&ctx, &b, nccl::Reduction::Sum), Err(Error::BadInput { .. })));
}

#[test]
fn nccl_two_ranks_on_two_devices() {
    let Some(ctx) = device() else { return };
    if emulated() {
        println!("skipped: no NCCL on the emulated device");
        return;
    }
    drop(ctx);
    if CudaContext::new(1).is_err() {
        println!("skipped: fewer than 2 CUDA devices");
        return;
    }
    let dir = std::env::temp_dir().join(format!("autopar-nccl-2-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ranks: Vec<_> = (0..2usize)
        .map(|rank| {
            let dir = dir.clone();
            std::thread::spawn(move || {
                let ctx = CudaContext::new(rank).unwrap();
                let comm = nccl::NcclComm::for_group(&ctx, rank, &[0, 1], &dir, Duration::from_secs(60)).unwrap();
                let mine = Tensor::f32(vec![2, 2], vec![rank as f32 + 1.0; 4]);
                let d = CudaTensor::upload(&ctx, &mine).unwrap();
                let sum = comm.all_reduce(&ctx, &d, nccl::Reduction::Sum).unwrap().download(&ctx).unwrap();
                let max = comm.all_reduce(&ctx, &d, nccl::Reduction::Max).unwrap().download(&ctx).unwrap();
                let all = comm.all_gather(&ctx, &d).unwrap().download(&ctx).unwrap();
                let part = comm.reduce_scatter(&ctx, &d, nccl::Reduction::Sum).unwrap().download(&ctx).unwrap();
                let root = comm.broadcast(&ctx, Some(&d), d.meta(), 1).unwrap().download(&ctx).unwrap();
                let other = comm.send_recv(&ctx, &d, 1 - rank, d.meta(), 1 - rank).unwrap().download(&ctx).unwrap();
                (sum, max, all, part, root, other)
            })
        })
        .collect();
    for (rank, h) in ranks.into_iter().enumerate() {
        let (sum, max, all, part, root, other) = h.join().unwrap();
        assert_eq!(sum, Tensor::f32(vec![2, 2], vec![3.0; 4]));
        assert_eq!(max, Tensor::f32(vec![2, 2], vec![2.0; 4]));
        assert_eq!(all, Tensor::f32(vec![4, 2], vec![1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0]));
        assert_eq!(part, Tensor::f32(vec![1, 2], vec![3.0; 2]));
        assert_eq!(root, Tensor::f32(vec![2, 2], vec![2.0; 4]));
        assert_eq!(other, Tensor::f32(vec![2, 2], vec![(2 - rank) as f32; 4]));
    }
    std::fs::remove_dir_all(&dir).ok();
}

// ---------- the whole suite on a CPU-emulated device ----------

/// Set in the child process that runs the suite against the emulated libraries.
const EMULATED: &str = "AUTOPAR_CUDA_EMULATED";

/// A CPU stand-in for libcuda, libnvrtc and libcublas (one library, copied under the three
/// names cudarc loads). Device pointers are host pointers; "PTX" is the path of a shared library
/// compiled from the CUDA source by the host C++ compiler, with one `__emu_NAME` launcher per
/// kernel that runs the grid's blocks in turn, each on four threads (the kernels use grid-stride
/// loops and size their block reductions by `blockDim`, so any power-of-two block is valid).
/// The source is shared with the root crate's GPU run test (`tests/cli_gpu.rs`).
const FAKE_CUDA: &str = include_str!("fake_cuda.cpp");

#[test]
fn every_device_test_on_a_cpu_emulated_device() {
    if emulated() {
        return;
    }
    if std::process::Command::new("c++").arg("--version").output().is_err() {
        println!("skipped: no host C++ compiler to build the CUDA emulator");
        return;
    }
    let dir = std::env::temp_dir().join(format!("autopar-cuda-emu-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("fake.cpp"), FAKE_CUDA).unwrap();
    let built = std::process::Command::new("c++")
        .args(["-std=c++17", "-O1", "-shared", "-fPIC", "-o"])
        .arg(dir.join("libcuda.so"))
        .arg(dir.join("fake.cpp"))
        .arg("-ldl")
        .output()
        .unwrap();
    assert!(built.status.success(), "building the emulator:\n{}", String::from_utf8_lossy(&built.stderr));
    for name in ["libnvrtc.so", "libcublas.so"] {
        std::fs::copy(dir.join("libcuda.so"), dir.join(name)).unwrap();
    }
    let mut path = std::ffi::OsString::from(&dir);
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
        path.push(":");
        path.push(old);
    }
    let run = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--test-threads=2", "--nocapture", "--skip", "every_device_test_on_a_cpu_emulated_device"])
        .env("LD_LIBRARY_PATH", path)
        .env(EMULATED, "1")
        .env("AUTOPAR_FAKE_CUDA_DIR", &dir)
        .output()
        .unwrap();
    std::fs::remove_dir_all(&dir).ok();
    let out = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "the suite failed on the emulated device:\n{out}\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(out.contains("CPU-emulated device"), "the emulated device was not used:\n{out}");
    assert!(!out.contains("skipped: no CUDA device"), "device tests skipped on the emulated device:\n{out}");
    println!("{}", out.lines().filter(|l| l.starts_with("test result")).collect::<Vec<_>>().join("\n"));
}

#[test]
fn resize_and_its_gradient() {
    use ir::{CoordTransform, NearestMode, ResizeAttrs, ResizeAxis, ResizeMode};
    let Some(ctx) = device() else { return };
    let x = rnd(&[2, 3, 5, 4], 1);
    let axes = |h: (usize, f64), w: (usize, f64)| {
        vec![ResizeAxis { axis: 2, size: h.0, scale: h.1 }, ResizeAxis { axis: 3, size: w.0, scale: w.1 }]
    };
    let forms = [
        (ResizeMode::Nearest, CoordTransform::Asymmetric, NearestMode::Floor, false),
        (ResizeMode::Nearest, CoordTransform::HalfPixel, NearestMode::RoundPreferCeil, false),
        (ResizeMode::Linear, CoordTransform::HalfPixel, NearestMode::RoundPreferFloor, false),
        (ResizeMode::Linear, CoordTransform::AlignCorners, NearestMode::RoundPreferFloor, false),
        (ResizeMode::Linear, CoordTransform::PytorchHalfPixel, NearestMode::RoundPreferFloor, false),
        (ResizeMode::Cubic, CoordTransform::HalfPixel, NearestMode::RoundPreferFloor, true),
    ];
    for (mode, coord, nearest_mode, exclude_outside) in forms {
        // Upsampling both axes, downsampling one, and a single resized middle axis.
        for axes in [
            axes((10, 2.0), (7, 1.75)),
            axes((3, 0.6), (8, 2.0)),
            vec![ResizeAxis { axis: 1, size: 5, scale: 5.0 / 3.0 }],
        ] {
            let a = ResizeAttrs { axes, mode, coord, nearest_mode, cubic_a: -0.75, exclude_outside };
            check(&ctx, Op::Resize(a.clone()), &[&x]);
            let y = a.out_shape(x.shape()).unwrap();
            check(&ctx, Op::ResizeGrad { attrs: a, shape: x.shape().to_vec() }, &[&rnd(&y, 2)]);
        }
    }
}
