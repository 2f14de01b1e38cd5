//! Hand-computed cases per op family, naive references for products and convolutions, and
//! one-thread vs two-thread agreement on tensors large enough to take the parallel paths.

use super::*;
use ir::{BinaryOp, ConvAttrs, DType, PoolAttrs, ReduceOp, SliceAxis, UnaryOp};

fn ctx1() -> CpuContext {
    CpuContext::new(1).unwrap()
}

fn ctx2() -> CpuContext {
    CpuContext::new(2).unwrap()
}

fn run(op: Op, ins: &[&Tensor]) -> Vec<Tensor> {
    let outs = eval(&ctx1(), &op, ins).unwrap();
    let metas: Vec<TensorMeta> = ins.iter().map(|t| t.meta()).collect();
    assert_eq!(outs.iter().map(|t| t.meta()).collect::<Vec<_>>(), op.infer(&metas).unwrap());
    outs
}

fn run1(op: Op, ins: &[&Tensor]) -> Tensor {
    run(op, ins).remove(0)
}

fn f(shape: impl Into<Vec<usize>>, v: Vec<f32>) -> Tensor {
    Tensor::f32(shape, v)
}

fn iota(shape: impl Into<Vec<usize>>) -> Tensor {
    let shape = shape.into();
    let n = shape.iter().product::<usize>();
    Tensor::f32(shape, (0..n).map(|i| i as f32).collect())
}

/// Deterministic pseudo-random values in [-1, 1).
fn rnd(shape: impl Into<Vec<usize>>, seed: u64) -> Tensor {
    let shape = shape.into();
    let n = shape.iter().product::<usize>();
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let v = (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    Tensor::f32(shape, v)
}

#[track_caller]
fn close(t: &Tensor, shape: &[usize], want: &[f32]) {
    assert_eq!(t.shape(), shape, "shape");
    let got = t.as_f32().expect("f32 output");
    assert_eq!(got.len(), want.len());
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = (g - w).abs() <= 1e-5 + 1e-4 * w.abs() || (g.is_nan() && w.is_nan()) || g == w;
        assert!(ok, "element {i}: got {g}, want {w}\n got {got:?}\nwant {want:?}");
    }
}

#[track_caller]
fn same(a: &Tensor, b: &Tensor) {
    close(a, b.shape(), b.as_f32().unwrap());
}

fn bad(op: Op, ins: &[&Tensor]) -> Error {
    eval(&ctx1(), &op, ins).unwrap_err()
}

// ---------- elementwise ----------

#[test]
fn binary_broadcasting() {
    let a = iota([2, 3]);
    let row = f([3], vec![10., 20., 30.]);
    close(&run1(Op::Binary(BinaryOp::Add), &[&a, &row]), &[2, 3], &[10., 21., 32., 13., 24., 35.]);
    let col = f([2, 1], vec![1., 2.]);
    close(&run1(Op::Binary(BinaryOp::Mul), &[&col, &row]), &[2, 3], &[10., 20., 30., 20., 40., 60.]);
    let s = Tensor::scalar_f32(2.0);
    close(&run1(Op::Binary(BinaryOp::Sub), &[&s, &a]), &[2, 3], &[2., 1., 0., -1., -2., -3.]);
    close(&run1(Op::Binary(BinaryOp::Pow), &[&a, &s]), &[2, 3], &[0., 1., 4., 9., 16., 25.]);
    close(&run1(Op::Binary(BinaryOp::Div), &[&a, &s]), &[2, 3], &[0., 0.5, 1., 1.5, 2., 2.5]);
    close(&run1(Op::Binary(BinaryOp::Max), &[&a, &s]), &[2, 3], &[2., 2., 2., 3., 4., 5.]);
    close(&run1(Op::Binary(BinaryOp::Min), &[&a, &s]), &[2, 3], &[0., 1., 2., 2., 2., 2.]);
    // Middle-dim broadcast: [2,1,2] + [1,3,1].
    let x = iota([2, 1, 2]);
    let y = f([1, 3, 1], vec![0., 10., 20.]);
    close(
        &run1(Op::Binary(BinaryOp::Add), &[&x, &y]),
        &[2, 3, 2],
        &[0., 1., 10., 11., 20., 21., 2., 3., 12., 13., 22., 23.],
    );
    assert!(matches!(bad(Op::Binary(BinaryOp::Add), &[&iota([2, 3]), &iota([2])]), Error::BadInput { .. }));
    assert!(matches!(bad(Op::Binary(BinaryOp::Add), &[&a, &Tensor::i64([1], vec![1])]), Error::BadInput { .. }));
}

#[test]
fn binary_integers_and_bools() {
    let a = Tensor::i64([4], vec![-7, 7, 9, -9]);
    let b = Tensor::i64([4], vec![2, -2, 3, 4]);
    assert_eq!(run1(Op::Binary(BinaryOp::Div), &[&a, &b]), Tensor::i64([4], vec![-3, -3, 3, -2]));
    assert_eq!(
        run1(Op::Binary(BinaryOp::Pow), &[&b, &Tensor::i64([], vec![3])]),
        Tensor::i64([4], vec![8, -8, 27, 64])
    );
    assert_eq!(run1(Op::Binary(BinaryOp::Sub), &[&a, &b]), Tensor::i64([4], vec![-9, 9, 6, -13]));
    assert_eq!(run1(Op::Binary(BinaryOp::Less), &[&a, &b]), Tensor::bool([4], vec![true, false, false, true]));
    assert_eq!(run1(Op::Binary(BinaryOp::Equal), &[&a, &a]), Tensor::bool([4], vec![true; 4]));
    let zero = Tensor::i64([1], vec![0]);
    assert!(matches!(bad(Op::Binary(BinaryOp::Div), &[&a, &zero]), Error::BadInput { .. }));
    let p = Tensor::bool([4], vec![true, true, false, false]);
    let q = Tensor::bool([4], vec![true, false, true, false]);
    assert_eq!(run1(Op::Binary(BinaryOp::And), &[&p, &q]), Tensor::bool([4], vec![true, false, false, false]));
    assert_eq!(run1(Op::Binary(BinaryOp::Or), &[&p, &q]), Tensor::bool([4], vec![true, true, true, false]));
    assert_eq!(run1(Op::Binary(BinaryOp::Xor), &[&p, &q]), Tensor::bool([4], vec![false, true, true, false]));
    assert_eq!(run1(Op::Binary(BinaryOp::Equal), &[&p, &q]), Tensor::bool([4], vec![true, false, false, true]));
    let x = f([3], vec![1., 2., 3.]);
    let y = f([1], vec![2.]);
    assert_eq!(run1(Op::Binary(BinaryOp::GreaterOrEqual), &[&x, &y]), Tensor::bool([3], vec![false, true, true]));
    assert_eq!(run1(Op::Binary(BinaryOp::LessOrEqual), &[&x, &y]), Tensor::bool([3], vec![true, true, false]));
    assert_eq!(run1(Op::Binary(BinaryOp::Greater), &[&x, &y]), Tensor::bool([3], vec![false, false, true]));
}

#[test]
fn unary_values() {
    let x = f([5], vec![-2., -0.5, 0., 0.5, 1.]);
    let u = |op| run1(Op::Unary(op), &[&x]);
    close(&u(UnaryOp::Relu), &[5], &[0., 0., 0., 0.5, 1.]);
    close(&u(UnaryOp::Erf), &[5], &[-0.995_322_3, -0.520_499_9, 0., 0.520_499_9, 0.842_700_8]);
    close(&u(UnaryOp::Gelu), &[5], &[-0.045_500_26, -0.154_268_5, 0., 0.345_731_5, 0.841_344_7]);
    close(&u(UnaryOp::GeluTanh), &[5], &[-0.045_402_3, -0.154_286, 0., 0.345_714, 0.841_192]);
    close(&u(UnaryOp::Sigmoid), &[5], &[0.119_202_92, 0.377_540_67, 0.5, 0.622_459_3, 0.731_058_6]);
    close(&u(UnaryOp::Tanh), &[5], &[-0.964_027_6, -0.462_117_16, 0., 0.462_117_16, 0.761_594_2]);
    close(&u(UnaryOp::Abs), &[5], &[2., 0.5, 0., 0.5, 1.]);
    close(&u(UnaryOp::Neg), &[5], &[2., 0.5, 0., -0.5, -1.]);
    close(&u(UnaryOp::Sign), &[5], &[-1., -1., 0., 1., 1.]);
    close(&u(UnaryOp::Floor), &[5], &[-2., -1., 0., 0., 1.]);
    close(&u(UnaryOp::Ceil), &[5], &[-2., -0., 0., 1., 1.]);
    close(&u(UnaryOp::Exp), &[5], &[0.135_335_28, 0.606_530_66, 1., 1.648_721_3, std::f32::consts::E]);
    close(&u(UnaryOp::Sin), &[5], &[-0.909_297_4, -0.479_425_55, 0., 0.479_425_55, 0.841_470_96]);
    close(&u(UnaryOp::Cos), &[5], &[-0.416_146_84, 0.877_582_55, 1., 0.877_582_55, 0.540_302_3]);
    let p = f([3], vec![4., 1., 0.25]);
    close(&run1(Op::Unary(UnaryOp::Sqrt), &[&p]), &[3], &[2., 1., 0.5]);
    close(&run1(Op::Unary(UnaryOp::Log), &[&p]), &[3], &[4f32.ln(), 0., 0.25f32.ln()]);
    close(&run1(Op::Unary(UnaryOp::Reciprocal), &[&p]), &[3], &[0.25, 1., 4.]);
    // Extremes stay finite where the math is finite.
    let big = f([2], vec![-100., 100.]);
    close(&run1(Op::Unary(UnaryOp::Sigmoid), &[&big]), &[2], &[0., 1.]);
    let i = Tensor::i64([3], vec![-3, 0, 4]);
    assert_eq!(run1(Op::Unary(UnaryOp::Neg), &[&i]), Tensor::i64([3], vec![3, 0, -4]));
    assert_eq!(run1(Op::Unary(UnaryOp::Abs), &[&i]), Tensor::i64([3], vec![3, 0, 4]));
    assert_eq!(run1(Op::Unary(UnaryOp::Sign), &[&i]), Tensor::i64([3], vec![-1, 0, 1]));
    let b = Tensor::bool([2], vec![true, false]);
    assert_eq!(run1(Op::Unary(UnaryOp::Not), &[&b]), Tensor::bool([2], vec![false, true]));
    assert!(matches!(bad(Op::Unary(UnaryOp::Exp), &[&i]), Error::BadInput { .. }));
}

#[test]
fn erf_is_accurate() {
    // Reference values of erf to 9 digits.
    let xs = [0.1f32, 0.3, 0.8, 1.5, 2.2, 3.0, -1.2];
    let want =
        [0.112_462_916, 0.328_626_759, 0.742_100_965, 0.966_105_146, 0.998_137_154, 0.999_977_910, -0.910_313_978];
    let got = run1(Op::Unary(UnaryOp::Erf), &[&f([7], xs.to_vec())]);
    for (g, w) in got.as_f32().unwrap().iter().zip(want) {
        assert!(((*g as f64) - w).abs() < 2e-7, "{g} vs {w}");
    }
}

#[test]
fn gelu_tail_is_accurate() {
    // x * Phi(x) from f64 erfc.
    for x in [-6.0f32, -4.0, -2.5, 0.3, 3.0] {
        let want = 0.5 * x as f64 * libm::erfc(-(x as f64) / std::f64::consts::SQRT_2);
        let got = run1(Op::Unary(UnaryOp::Gelu), &[&f([1], vec![x])]).as_f32().unwrap()[0] as f64;
        assert!((got - want).abs() <= 1e-5 * want.abs() + 1e-30, "gelu({x}) = {got}, want {want}");
    }
}

#[test]
fn where_and_cast() {
    let c = Tensor::bool([2, 1], vec![true, false]);
    let a = iota([2, 2]);
    let b = Tensor::scalar_f32(-1.0);
    close(&run1(Op::Where, &[&c, &a, &b]), &[2, 2], &[0., 1., -1., -1.]);
    let x = f([5], vec![-1.7, 1.7, 2.5, -0.2, 0.0]);
    assert_eq!(run1(Op::Cast { to: DType::I64 }, &[&x]), Tensor::i64([5], vec![-1, 1, 2, 0, 0]));
    assert_eq!(run1(Op::Cast { to: DType::Bool }, &[&x]), Tensor::bool([5], vec![true, true, true, true, false]));
    let b = Tensor::bool([2], vec![true, false]);
    close(&run1(Op::Cast { to: DType::F32 }, &[&b]), &[2], &[1., 0.]);
    assert_eq!(run1(Op::Cast { to: DType::I64 }, &[&b]), Tensor::i64([2], vec![1, 0]));
    let i = Tensor::i64([2], vec![3, 0]);
    close(&run1(Op::Cast { to: DType::F32 }, &[&i]), &[2], &[3., 0.]);
    assert_eq!(run1(Op::Cast { to: DType::Bool }, &[&i]), Tensor::bool([2], vec![true, false]));
    assert_eq!(run1(Op::Identity, &[&i]), i);
    assert_eq!(run1(Op::Constant(i.clone()), &[]), i);
}

// ---------- matrix products ----------

fn naive_matmul(a: &Tensor, b: &Tensor) -> Tensor {
    let shape = ir::matmul_shape(a.shape(), b.shape()).unwrap();
    let a2: Vec<usize> = if a.shape().len() == 1 { vec![1, a.shape()[0]] } else { a.shape().to_vec() };
    let b2: Vec<usize> = if b.shape().len() == 1 { vec![b.shape()[0], 1] } else { b.shape().to_vec() };
    let (m, k, n) = (a2[a2.len() - 2], a2[a2.len() - 1], b2[b2.len() - 1]);
    let batch = ir::broadcast_shapes(&a2[..a2.len() - 2], &b2[..b2.len() - 2]).unwrap();
    let ab = ir::Tensor::f32(a2.clone(), a.to_f32_vec());
    let bb = ir::Tensor::f32(b2.clone(), b.to_f32_vec());
    let mut ash = batch.clone();
    ash.extend([m, k]);
    let mut bsh = batch.clone();
    bsh.extend([k, n]);
    let ae = run1(Op::Expand { shape: ash }, &[&ab]);
    let be = run1(Op::Expand { shape: bsh }, &[&bb]);
    let (av, bv) = (ae.as_f32().unwrap(), be.as_f32().unwrap());
    let nb: usize = batch.iter().product();
    let mut out = vec![0f32; nb * m * n];
    for t in 0..nb {
        for i in 0..m {
            for j in 0..n {
                out[t * m * n + i * n + j] =
                    (0..k).map(|p| av[t * m * k + i * k + p] * bv[t * k * n + p * n + j]).sum();
            }
        }
    }
    Tensor::f32(shape, out)
}

#[test]
fn matmul_hand_and_promotions() {
    let a = iota([2, 3]);
    let b = iota([3, 2]);
    close(&run1(Op::MatMul, &[&a, &b]), &[2, 2], &[10., 13., 28., 40.]);
    let v = f([3], vec![1., 1., 1.]);
    close(&run1(Op::MatMul, &[&v, &b]), &[2], &[6., 9.]);
    close(&run1(Op::MatMul, &[&a, &v]), &[2], &[3., 12.]);
    close(&run1(Op::MatMul, &[&v, &v]), &[], &[3.]);
    assert!(matches!(bad(Op::MatMul, &[&a, &a]), Error::BadInput { .. }));
}

#[test]
fn matmul_batched_matches_naive() {
    let cases: &[(&[usize], &[usize])] = &[
        (&[2, 3, 4], &[4, 5]),
        (&[4], &[2, 4, 3]),
        (&[2, 1, 3, 4], &[3, 4, 2]),
        (&[3, 4], &[2, 4, 5]),
        (&[2, 3, 4], &[4]),
        (&[1, 5, 7], &[3, 7, 2]),
        (&[8, 16, 32], &[8, 32, 16]),
        (&[2, 0, 3], &[3, 4]),
        (&[2, 3, 0], &[0, 4]),
    ];
    for (i, (sa, sb)) in cases.iter().enumerate() {
        let (a, b) = (rnd(sa.to_vec(), i as u64), rnd(sb.to_vec(), 100 + i as u64));
        let want = naive_matmul(&a, &b);
        for ctx in [ctx1(), ctx2()] {
            let got = eval(&ctx, &Op::MatMul, &[&a, &b]).unwrap().remove(0);
            same(&got, &want);
        }
    }
}

#[test]
fn gemm_attrs() {
    let a = iota([2, 3]);
    let bt = iota([2, 3]); // B^T: B = [[0,3],[1,4],[2,5]]
    let c = f([2], vec![100., 200.]);
    let op = Op::Gemm { alpha: 2.0, beta: 0.5, trans_a: false, trans_b: true };
    // A @ B = [[5, 14], [14, 50]]
    close(&run1(op.clone(), &[&a, &bt, &c]), &[2, 2], &[60., 128., 78., 200.]);
    let col = f([2, 1], vec![1., 2.]);
    close(&run1(op.clone(), &[&a, &bt, &col]), &[2, 2], &[10.5, 28.5, 29., 101.]);
    close(&run1(op, &[&a, &bt]), &[2, 2], &[10., 28., 28., 100.]);
    let at = iota([3, 2]); // A = [[0,2,4],[1,3,5]]
    let b = iota([3, 2]);
    let op = Op::Gemm { alpha: 1.0, beta: 1.0, trans_a: true, trans_b: false };
    close(&run1(op, &[&at, &b, &Tensor::scalar_f32(1.0)]), &[2, 2], &[21., 27., 27., 36.]);
}

#[test]
fn gemm_f32_checks_sizes() {
    let ctx = ctx1();
    let mut c = vec![0f32; 4];
    assert!(gemm_f32(&ctx, 2, 2, 2, &[1.0; 3], false, &[1.0; 4], false, &mut c, 1.0, 0.0).is_err());
    gemm_f32(&ctx, 2, 2, 2, &[1.0; 4], false, &[1.0; 4], false, &mut c, 1.0, 0.0).unwrap();
    assert_eq!(c, vec![2.0; 4]);
    let mut c = vec![f32::NAN; 4];
    gemm_f32(&ctx, 2, 2, 0, &[], false, &[], false, &mut c, 1.0, 0.0).unwrap();
    assert_eq!(c, vec![0.0; 4]);
}

/// Few rows (or few columns) against a transposed right operand with a long depth: the products
/// run as dot products without packing (`linalg::product_dots`). Edges off the 4 x 2 blocks and
/// the 8 lanes, alpha and beta, both orientations, one and two threads, against f64 sums; and a
/// convolution weight gradient of that shape (8 output channels, 1024 pixels) against the naive
/// reference.
#[test]
fn thin_products_by_dot_products_match_naive() {
    // (m, n, k)
    for (i, (m, n, k)) in
        [(8, 216, 1024), (5, 63, 259), (13, 40, 300), (32, 33, 257), (300, 7, 513), (2, 300, 2000), (1, 300, 2000)]
            .into_iter()
            .enumerate()
    {
        let a = rnd([m, k], 600 + i as u64);
        let bt = rnd([n, k], 700 + i as u64);
        let c = rnd([m, n], 800 + i as u64);
        let (av, bv, cv) = (a.as_f32().unwrap(), bt.as_f32().unwrap(), c.as_f32().unwrap());
        let want: Vec<f32> = (0..m * n)
            .map(|e| {
                let (r, q) = (e / n, e % n);
                let dot: f64 = (0..k).map(|p| av[r * k + p] as f64 * bv[q * k + p] as f64).sum();
                (1.5 * dot + 0.25 * cv[e] as f64) as f32
            })
            .collect();
        let op = Op::Gemm { alpha: 1.5, beta: 0.25, trans_a: false, trans_b: true };
        for ctx in [ctx1(), ctx2()] {
            close(&eval(&ctx, &op, &[&a, &bt, &c]).unwrap()[0], &[m, n], &want);
        }
    }
    let a = ConvAttrs { strides: [1, 1], pads: [1; 4], dilations: [1, 1], group: 1 };
    let (x, w) = (rnd([1, 24, 32, 32], 900), rnd([8, 24, 3, 3], 901));
    let dy = rnd([1, 8, 32, 32], 902);
    let (_, want_dw) = naive_conv_grads(&x, &w, &dy, &a);
    for ctx in [ctx1(), ctx2()] {
        let dw = eval(&ctx, &Op::ConvWeightGrad { attrs: a.clone(), shape: vec![8, 24, 3, 3] }, &[&x, &dy]).unwrap();
        same(&dw[0], &want_dw);
    }
}

// ---------- convolution and pooling ----------

fn naive_conv(x: &Tensor, w: &Tensor, bias: Option<&Tensor>, a: &ConvAttrs) -> Tensor {
    let (xs, ws) = (x.shape(), w.shape());
    let metas = [x.meta(), w.meta()];
    let out = Op::Conv(a.clone()).infer(&metas).unwrap().remove(0).shape;
    let (xv, wv) = (x.as_f32().unwrap(), w.as_f32().unwrap());
    let (c, h, wd) = (xs[1], xs[2], xs[3]);
    let (m, cg, kh, kw) = (ws[0], ws[1], ws[2], ws[3]);
    let mg = m / a.group;
    let mut y = vec![0f32; out.iter().product()];
    for n in 0..out[0] {
        for oc in 0..m {
            let g = oc / mg;
            for oy in 0..out[2] {
                for ox in 0..out[3] {
                    let mut s = bias.map(|b| b.as_f32().unwrap()[oc]).unwrap_or(0.0);
                    for ic in 0..cg {
                        for i in 0..kh {
                            for j in 0..kw {
                                let iy = (oy * a.strides[0] + i * a.dilations[0]) as isize - a.pads[0] as isize;
                                let ix = (ox * a.strides[1] + j * a.dilations[1]) as isize - a.pads[1] as isize;
                                if iy < 0 || ix < 0 || iy >= h as isize || ix >= wd as isize {
                                    continue;
                                }
                                let xi = ((n * c + g * cg + ic) * h + iy as usize) * wd + ix as usize;
                                s += xv[xi] * wv[((oc * cg + ic) * kh + i) * kw + j];
                            }
                        }
                    }
                    y[((n * m + oc) * out[2] + oy) * out[3] + ox] = s;
                }
            }
        }
    }
    Tensor::f32(out, y)
}

#[test]
fn conv_hand() {
    let x = iota([1, 1, 3, 3]);
    let w = f([1, 1, 2, 2], vec![1.; 4]);
    let a = ConvAttrs { strides: [1, 1], pads: [0; 4], dilations: [1, 1], group: 1 };
    close(&run1(Op::Conv(a.clone()), &[&x, &w]), &[1, 1, 2, 2], &[8., 12., 20., 24.]);
    let b = f([1], vec![1.]);
    let a = ConvAttrs { strides: [2, 2], pads: [1, 1, 1, 1], ..a };
    // Windows at (-1,-1), (-1,1), (1,-1), (1,1) over the zero-padded input.
    close(&run1(Op::Conv(a), &[&x, &w, &b]), &[1, 1, 2, 2], &[1., 4., 10., 25.]);
}

#[test]
fn conv_matches_naive() {
    let cases = [
        // (x shape, w shape, strides, pads, dilations, group, bias)
        ([2, 4, 7, 6], [6, 2, 3, 3], [1, 1], [1, 1, 1, 1], [1, 1], 2, true),
        ([1, 3, 9, 9], [4, 3, 3, 2], [2, 3], [0, 2, 1, 0], [1, 1], 1, false),
        ([1, 2, 10, 8], [2, 2, 3, 3], [1, 1], [2, 1, 0, 3], [2, 2], 1, true),
        ([2, 6, 5, 5], [6, 1, 3, 3], [1, 1], [1, 1, 1, 1], [1, 1], 6, true),
        ([1, 8, 6, 6], [4, 8, 1, 1], [1, 1], [0, 0, 0, 0], [1, 1], 1, true),
        ([1, 8, 6, 6], [4, 8, 1, 1], [2, 2], [0, 0, 0, 0], [1, 1], 1, false),
        ([1, 3, 40, 40], [16, 3, 7, 7], [2, 2], [3, 3, 3, 3], [1, 1], 1, true),
        ([4, 8, 16, 16], [8, 2, 3, 3], [1, 1], [1, 1, 1, 1], [1, 1], 4, false),
    ];
    for (i, (xs, ws, strides, pads, dilations, group, has_bias)) in cases.into_iter().enumerate() {
        let x = rnd(xs, i as u64);
        let w = rnd(ws, 50 + i as u64);
        let b = rnd([ws[0]], 99);
        let a = ConvAttrs { strides, pads, dilations, group };
        let bias = has_bias.then_some(&b);
        let want = naive_conv(&x, &w, bias, &a);
        let mut ins = vec![&x, &w];
        ins.extend(bias);
        for ctx in [ctx1(), ctx2()] {
            same(&eval(&ctx, &Op::Conv(a.clone()), &ins).unwrap()[0], &want);
        }
    }
}

/// The convolution's two gradients by direct accumulation over every in-image tap: `dx`
/// (`[N, C, H, W]`) and `dw` (`[M, C/group, kh, kw]`) for output gradient `dy`.
fn naive_conv_grads(x: &Tensor, w: &Tensor, dy: &Tensor, a: &ConvAttrs) -> (Tensor, Tensor) {
    let (xs, ws, out) = (x.shape(), w.shape(), dy.shape());
    let (xv, wv, dyv) = (x.as_f32().unwrap(), w.as_f32().unwrap(), dy.as_f32().unwrap());
    let (c, h, wd) = (xs[1], xs[2], xs[3]);
    let (m, cg, kh, kw) = (ws[0], ws[1], ws[2], ws[3]);
    let mg = m / a.group;
    let mut dx = vec![0f32; xv.len()];
    let mut dw = vec![0f32; wv.len()];
    for n in 0..out[0] {
        for oc in 0..m {
            let g = oc / mg;
            for oy in 0..out[2] {
                for ox in 0..out[3] {
                    let d = dyv[((n * m + oc) * out[2] + oy) * out[3] + ox];
                    for ic in 0..cg {
                        for i in 0..kh {
                            for j in 0..kw {
                                let iy = (oy * a.strides[0] + i * a.dilations[0]) as isize - a.pads[0] as isize;
                                let ix = (ox * a.strides[1] + j * a.dilations[1]) as isize - a.pads[1] as isize;
                                if iy < 0 || ix < 0 || iy >= h as isize || ix >= wd as isize {
                                    continue;
                                }
                                let xi = ((n * c + g * cg + ic) * h + iy as usize) * wd + ix as usize;
                                let wi = ((oc * cg + ic) * kh + i) * kw + j;
                                dx[xi] += d * wv[wi];
                                dw[wi] += d * xv[xi];
                            }
                        }
                    }
                }
            }
        }
    }
    (Tensor::f32(xs.to_vec(), dx), Tensor::f32(ws.to_vec(), dw))
}

/// Maps smaller than the kernel's padded span (ConvNeXt's last stage: a 2x2 map under a 7x7
/// depthwise kernel with padding 3), pads wider than the map, strides and dilations that leave
/// whole kernel rows or columns outside the image: the forward pass and both gradients (whose
/// weight gradient shares the forward im2col) against the naive references, on both paths.
#[test]
fn conv_small_maps_under_big_kernels() {
    let cases = [
        // (x shape, w shape, strides, pads, dilations, group)
        ([1, 2, 2, 2], [3, 2, 7, 7], [1, 1], [3, 3, 3, 3], [1, 1], 1),
        ([2, 4, 2, 2], [4, 1, 7, 7], [1, 1], [3, 3, 3, 3], [1, 1], 4),
        ([1, 1, 1, 1], [2, 1, 5, 5], [1, 1], [2, 2, 2, 2], [1, 1], 1),
        ([1, 2, 3, 2], [2, 2, 3, 5], [2, 3], [4, 4, 4, 4], [1, 1], 1),
        ([1, 1, 2, 3], [2, 1, 3, 3], [1, 1], [3, 2, 1, 4], [2, 3], 1),
        ([1, 1, 4, 1], [1, 1, 1, 3], [1, 1], [0, 5, 0, 5], [1, 1], 1),
        ([1, 2, 2, 2], [2, 2, 2, 2], [3, 3], [2, 2, 2, 2], [1, 1], 1),
        ([2, 3, 3, 3], [3, 3, 7, 7], [2, 2], [3, 3, 3, 3], [1, 1], 1),
        ([1, 2, 1, 4], [2, 1, 1, 3], [1, 2], [0, 3, 0, 3], [1, 2], 2),
        // Depthwise (one channel per group), which runs tap by tap without im2col: strides,
        // dilations, asymmetric pads, maps wider than 8 and narrower than the kernel.
        ([2, 5, 11, 13], [5, 1, 5, 5], [2, 2], [2, 1, 2, 3], [1, 1], 5),
        ([1, 3, 9, 10], [3, 1, 3, 3], [1, 2], [2, 2, 2, 2], [2, 2], 3),
        ([3, 4, 16, 16], [4, 1, 3, 3], [1, 1], [1, 1, 1, 1], [1, 1], 4),
        ([1, 6, 4, 4], [6, 1, 5, 5], [2, 2], [2, 2, 2, 2], [1, 1], 6),
        ([2, 2, 3, 1], [2, 1, 3, 3], [1, 1], [0, 4, 1, 0], [1, 1], 2),
        // Enough work (83K multiply-adds) for the two-thread context to split the planes.
        ([2, 8, 24, 24], [8, 1, 3, 3], [1, 1], [1, 1, 1, 1], [1, 1], 8),
        // Stride 1 with at least as many input as output channels per group, whose input
        // gradient is a forward convolution of dy with the flipped kernel: groups, asymmetric
        // pads, dilations, and a size the two threads split.
        ([2, 6, 7, 6], [4, 3, 3, 3], [1, 1], [1, 0, 2, 1], [1, 1], 2),
        ([1, 3, 6, 7], [2, 3, 3, 3], [1, 1], [3, 2, 1, 4], [2, 3], 1),
        ([4, 8, 16, 16], [8, 2, 3, 5], [1, 1], [1, 2, 1, 2], [1, 1], 4),
    ];
    check_convs(&cases, 200, same);
}

/// Maps wide enough for the row-by-row patch copies (more than 8 columns) with strides 1, 2 and
/// 3, and patch matrices large enough to be built in several blocks of output rows (the forward
/// pass, and the weight gradient's deeper blocks): against the naive references, on both paths.
#[test]
fn conv_blocks_of_rows_and_strided_patches() {
    let cases = [
        // 32 input channels at 64x64: patches of 288 rows in blocks of 14 output rows (forward)
        // and 16 (weight gradient); the input gradient as a forward convolution.
        ([1, 32, 64, 64], [8, 32, 3, 3], [1, 1], [1, 1, 1, 1], [1, 1], 1),
        // Stride 2 and 3 on 25- and 17-column outputs: strided copies, the strided col2im.
        ([2, 16, 50, 50], [8, 16, 3, 3], [2, 2], [1, 1, 1, 1], [1, 1], 1),
        ([1, 4, 40, 52], [6, 2, 5, 5], [3, 3], [2, 1, 2, 3], [1, 1], 2),
    ];
    // Both sides sum up to 4096 f32 products in different orders: agreement within 1e-5 of the
    // largest magnitude of each result (outputs that cancel to ~0.04 among values of ~70 differ
    // by a few 1e-5 in the last bits of either sum).
    check_convs(&cases, 700, |got, want| {
        let w = want.as_f32().unwrap();
        let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert_eq!(got.shape(), want.shape());
        for (i, (g, v)) in got.as_f32().unwrap().iter().zip(w).enumerate() {
            assert!((g - v).abs() <= 1e-5 * scale, "element {i}: got {g}, want {v} (scale {scale})");
        }
    });
}

type ConvCase = ([usize; 4], [usize; 4], [usize; 2], [usize; 4], [usize; 2], usize);

/// Each convolution's forward pass and both gradients against the naive references, on one and
/// two threads (random data seeded from `seed`), compared by `check(got, want)`.
fn check_convs(cases: &[ConvCase], seed: u64, check: impl Fn(&Tensor, &Tensor)) {
    for (i, &(xs, ws, strides, pads, dilations, group)) in cases.iter().enumerate() {
        let x = rnd(xs, seed + i as u64);
        let w = rnd(ws, seed + 100 + i as u64);
        let b = rnd([ws[0]], seed + 200 + i as u64);
        let a = ConvAttrs { strides, pads, dilations, group };
        let want = naive_conv(&x, &w, Some(&b), &a);
        let dy = rnd(want.shape().to_vec(), seed + 300 + i as u64);
        let (want_dx, want_dw) = naive_conv_grads(&x, &w, &dy, &a);
        for ctx in [ctx1(), ctx2()] {
            check(&eval(&ctx, &Op::Conv(a.clone()), &[&x, &w, &b]).unwrap()[0], &want);
            let dx = eval(&ctx, &Op::ConvInputGrad { attrs: a.clone(), shape: xs.to_vec() }, &[&dy, &w]).unwrap();
            check(&dx[0], &want_dx);
            let dw = eval(&ctx, &Op::ConvWeightGrad { attrs: a.clone(), shape: ws.to_vec() }, &[&x, &dy]).unwrap();
            check(&dw[0], &want_dw);
        }
    }
}

/// Pooling windows larger than the map (padding up to kernel - 1 on each side, strides):
/// max and average pooling against direct window walks, and their gradients by the identities
/// `<dy, maxpool(x)> = <maxpool_grad(x, dy), x>` (each output is its window's argmax cell) and
/// `<dy, avgpool(x)> = <avgpool_grad(dy), x>` (average pooling is linear).
#[test]
fn pooling_small_maps_under_big_windows() {
    let cases = [
        // (x shape, kernel, strides, pads)
        ([1, 2, 2, 2], [7, 7], [1, 1], [3, 3, 3, 3]),
        ([2, 1, 1, 3], [5, 3], [2, 1], [4, 2, 4, 2]),
        ([1, 1, 3, 2], [3, 6], [3, 2], [2, 5, 2, 5]),
        ([1, 3, 2, 2], [2, 2], [4, 4], [1, 1, 1, 1]),
    ];
    for (i, (xs, kernel, strides, pads)) in cases.into_iter().enumerate() {
        let x = rnd(xs, 600 + i as u64);
        let xv = x.as_f32().unwrap();
        for include_pad in [false, true] {
            let a = PoolAttrs { count_include_pad: include_pad, ..pool(kernel, strides, pads) };
            let (h, w) = (xs[2], xs[3]);
            let out = Op::MaxPool(a.clone()).infer(&[x.meta()]).unwrap().remove(0).shape;
            let (oh, ow) = (out[2], out[3]);
            let (mut mx, mut avg) = (vec![0f32; out.iter().product()], vec![0f32; out.iter().product()]);
            for p in 0..xs[0] * xs[1] {
                for oy in 0..oh {
                    for ox in 0..ow {
                        let (mut best, mut sum, mut cells, mut padded) = (f32::NEG_INFINITY, 0f32, 0, 0);
                        for ky in 0..kernel[0] {
                            for kx in 0..kernel[1] {
                                let y = (oy * strides[0] + ky) as isize - pads[0] as isize;
                                let xx = (ox * strides[1] + kx) as isize - pads[1] as isize;
                                if y < (h + pads[2]) as isize && xx < (w + pads[3]) as isize {
                                    padded += 1;
                                }
                                if y < 0 || xx < 0 || y >= h as isize || xx >= w as isize {
                                    continue;
                                }
                                let v = xv[(p * h + y as usize) * w + xx as usize];
                                best = best.max(v);
                                sum += v;
                                cells += 1;
                            }
                        }
                        let o = (p * oh + oy) * ow + ox;
                        mx[o] = best;
                        let div = if include_pad { padded } else { cells };
                        avg[o] = if div == 0 { 0.0 } else { sum / div as f32 };
                    }
                }
            }
            let dy = rnd(out.clone(), 700 + i as u64);
            let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(&p, &q)| p as f64 * q as f64).sum::<f64>();
            for ctx in [ctx1(), ctx2()] {
                let y = eval(&ctx, &Op::MaxPool(a.clone()), &[&x]).unwrap().remove(0);
                close(&y, &out, &mx);
                let y = eval(&ctx, &Op::AveragePool(a.clone()), &[&x]).unwrap().remove(0);
                close(&y, &out, &avg);
                let dx = eval(&ctx, &Op::MaxPoolGrad(a.clone()), &[&x, &dy]).unwrap().remove(0);
                let (l, r) = (dot(dy.as_f32().unwrap(), &mx), dot(dx.as_f32().unwrap(), xv));
                assert!((l - r).abs() <= 1e-5 * (1.0 + l.abs()), "case {i}: max pool adjoint {l} vs {r}");
                let dx = eval(&ctx, &Op::AveragePoolGrad { attrs: a.clone(), shape: xs.to_vec() }, &[&dy])
                    .unwrap()
                    .remove(0);
                let (l, r) = (dot(dy.as_f32().unwrap(), &avg), dot(dx.as_f32().unwrap(), xv));
                assert!((l - r).abs() <= 1e-5 * (1.0 + l.abs()), "case {i}: average pool adjoint {l} vs {r}");
            }
        }
    }
}

/// Ties and NaNs in max pooling and its gradient: the first maximal cell of a window (row-major)
/// wins a tie and the last NaN wins over everything, in planes with NaNs and in planes without
/// (which take the branch-free path), for full 3x3 windows and clipped ones, against a direct
/// walk over each window.
#[test]
fn max_pool_ties_and_nans() {
    // Values from {0, 1, 2, 3} (many ties); channel 0 gets NaNs, channel 1 none.
    let (h, w) = (7, 8);
    let mut v: Vec<f32> = (0..2 * h * w).map(|i| ((i * 7 + i / 5) % 4) as f32).collect();
    for k in [3, 12, 13, 30, 44] {
        v[k] = f32::NAN;
    }
    let x = f([1, 2, h, w], v.clone());
    for a in [pool([3, 3], [1, 1], [0; 4]), pool([3, 3], [2, 2], [1, 1, 1, 1]), pool([2, 3], [2, 1], [0, 1, 1, 0])] {
        let (oh, ow) = a.out_hw(h, w).unwrap();
        let mut want_y = vec![0f32; 2 * oh * ow];
        let mut dy = vec![0f32; 2 * oh * ow];
        let mut want_dx = vec![0f32; 2 * h * w];
        for p in 0..2 {
            for oy in 0..oh {
                for ox in 0..ow {
                    let o = (p * oh + oy) * ow + ox;
                    dy[o] = 1.0 + o as f32;
                    let mut at: Option<usize> = None;
                    for ky in 0..a.kernel[0] {
                        for kx in 0..a.kernel[1] {
                            let y = (oy * a.strides[0] + ky) as isize - a.pads[0] as isize;
                            let xx = (ox * a.strides[1] + kx) as isize - a.pads[1] as isize;
                            if y < 0 || xx < 0 || y >= h as isize || xx >= w as isize {
                                continue;
                            }
                            let k = (p * h + y as usize) * w + xx as usize;
                            if at.is_none_or(|b| v[k] > v[b] || v[k].is_nan()) {
                                at = Some(k);
                            }
                        }
                    }
                    let k = at.expect("every window has a cell in these cases");
                    want_y[o] = v[k];
                    want_dx[k] += dy[o];
                }
            }
        }
        let dy = f([1, 2, oh, ow], dy);
        for ctx in [ctx1(), ctx2()] {
            close(&eval(&ctx, &Op::MaxPool(a.clone()), &[&x]).unwrap()[0], &[1, 2, oh, ow], &want_y);
            close(&eval(&ctx, &Op::MaxPoolGrad(a.clone()), &[&x, &dy]).unwrap()[0], &[1, 2, h, w], &want_dx);
        }
    }
}

fn pool(kernel: [usize; 2], strides: [usize; 2], pads: [usize; 4]) -> PoolAttrs {
    PoolAttrs { kernel, strides, pads, dilations: [1, 1], ceil_mode: false, count_include_pad: false }
}

#[test]
fn max_pool_padding_ceil_dilation() {
    // All-negative input: padded cells must not win.
    let x = f([1, 1, 2, 2], vec![-1., -2., -3., -4.]);
    close(
        &run1(Op::MaxPool(pool([2, 2], [1, 1], [1, 1, 1, 1])), &[&x]),
        &[1, 1, 3, 3],
        &[-1., -1., -2., -1., -1., -2., -3., -3., -4.],
    );
    // ceil_mode: 5 wide, kernel 2, stride 2 -> 3 outputs; last window holds one cell.
    let x = iota([1, 1, 1, 5]);
    let a = PoolAttrs { ceil_mode: true, ..pool([1, 2], [1, 2], [0; 4]) };
    close(&run1(Op::MaxPool(a.clone()), &[&x]), &[1, 1, 1, 3], &[1., 3., 4.]);
    let floor = PoolAttrs { ceil_mode: false, ..a };
    close(&run1(Op::MaxPool(floor), &[&x]), &[1, 1, 1, 2], &[1., 3.]);
    let x = iota([1, 1, 1, 6]);
    let d = PoolAttrs { dilations: [1, 2], ..pool([1, 2], [1, 1], [0; 4]) };
    close(&run1(Op::MaxPool(d), &[&x]), &[1, 1, 1, 4], &[2., 3., 4., 5.]);
}

#[test]
fn average_pool_count_include_pad() {
    let x = iota([1, 1, 2, 2]); // [[0,1],[2,3]]
    let excl = pool([2, 2], [1, 1], [1, 1, 0, 0]);
    close(&run1(Op::AveragePool(excl.clone()), &[&x]), &[1, 1, 2, 2], &[0., 0.5, 1., 1.5]);
    let incl = PoolAttrs { count_include_pad: true, ..excl };
    close(&run1(Op::AveragePool(incl), &[&x]), &[1, 1, 2, 2], &[0., 0.25, 0.5, 1.5]);
    // ceil_mode with count_include_pad: cells past the end padding do not count.
    let x = iota([1, 1, 1, 5]);
    let a = PoolAttrs { ceil_mode: true, count_include_pad: true, ..pool([1, 2], [1, 2], [0; 4]) };
    close(&run1(Op::AveragePool(a), &[&x]), &[1, 1, 1, 3], &[0.5, 2.5, 4.]);
}

#[test]
fn global_pools() {
    let x = iota([1, 2, 2, 2]);
    close(&run1(Op::GlobalAveragePool, &[&x]), &[1, 2, 1, 1], &[1.5, 5.5]);
    close(&run1(Op::GlobalMaxPool, &[&x]), &[1, 2, 1, 1], &[3., 7.]);
    let x3 = iota([2, 1, 3]);
    close(&run1(Op::GlobalAveragePool, &[&x3]), &[2, 1, 1], &[1., 4.]);
}

// ---------- normalisation ----------

#[test]
fn batch_norm_hand() {
    let x = iota([1, 2, 1, 2]);
    let ins = [f([2], vec![1., 2.]), f([2], vec![0., 1.]), f([2], vec![0.5, 2.]), f([2], vec![4., 1.])];
    let y = run1(Op::BatchNorm { epsilon: 0.0 }, &[&x, &ins[0], &ins[1], &ins[2], &ins[3]]);
    close(&y, &[1, 2, 1, 2], &[-0.25, 0.25, 1., 3.]);
}

#[test]
fn layer_norm_hand() {
    let x = f([2, 3], vec![1., 2., 3., 0., 0., 3.]);
    let s = f([3], vec![1., 1., 2.]);
    let b = f([3], vec![0., 1., 0.]);
    let r = (2.0f32 / 3.0).sqrt();
    let y = run1(Op::LayerNorm { axis: 1, epsilon: 0.0 }, &[&x, &s, &b]);
    let q = 2f32.sqrt(); // row 2: mean 1, var 2
    close(&y, &[2, 3], &[-1. / r, 1., 2. / r, -1. / q, 1. - 1. / q, 2. * 2. / q]);
    // Over the last two dims, scalar scale, no bias.
    let x = f([1, 2, 2], vec![1., 2., 3., 4.]);
    let y = run1(Op::LayerNorm { axis: 1, epsilon: 0.0 }, &[&x, &Tensor::scalar_f32(1.0)]);
    let sd = 1.25f32.sqrt();
    close(&y, &[1, 2, 2], &[-1.5 / sd, -0.5 / sd, 0.5 / sd, 1.5 / sd]);
}

#[test]
fn lrn_windows() {
    // size 2: window of channel c is [c, c+1]; size 3: [c-1, c+1].
    let x = f([1, 3, 1, 1], vec![1., 2., 3.]);
    let y = run1(Op::Lrn { size: 2, alpha: 2.0, beta: 1.0, bias: 1.0 }, &[&x]);
    close(&y, &[1, 3, 1, 1], &[1. / (1. + 5.), 2. / (1. + 13.), 3. / (1. + 9.)]);
    let y = run1(Op::Lrn { size: 3, alpha: 3.0, beta: 0.5, bias: 2.0 }, &[&x]);
    close(&y, &[1, 3, 1, 1], &[1. / 7f32.sqrt(), 2. / 16f32.sqrt(), 3. / 15f32.sqrt()]);
}

#[test]
fn softmax_stable_and_axes() {
    let x = f([2, 3], vec![1., 2., 3., 1000., 1001., 1002.]);
    let e = [1f32, std::f32::consts::E, std::f32::consts::E.powi(2)];
    let s: f32 = e.iter().sum();
    let want: Vec<f32> = e.iter().chain(&e).map(|v| v / s).collect();
    close(&run1(Op::Softmax { axis: 1 }, &[&x]), &[2, 3], &want);
    let logw: Vec<f32> = want.iter().map(|v| v.ln()).collect();
    close(&run1(Op::LogSoftmax { axis: 1 }, &[&x]), &[2, 3], &logw);
    let x = f([2, 2], vec![0., 1., 0., 3.]);
    let a = 1. / (1. + 1f32.exp());
    let b = 1. / (1. + 1f32.exp().powi(-2) * 1f32.exp().powi(0)); // e^1 / (e^1 + e^3)
    close(&run1(Op::Softmax { axis: 0 }, &[&x]), &[2, 2], &[0.5, 1. - b, 0.5, b]);
    let _ = a;
    let ls = run1(Op::LogSoftmax { axis: 0 }, &[&x]);
    close(&ls, &[2, 2], &[0.5f32.ln(), (1. - b).ln(), 0.5f32.ln(), b.ln()]);
}

// ---------- data movement ----------

#[test]
fn reshape_transpose_expand() {
    let x = iota([2, 3]);
    close(&run1(Op::Reshape { shape: vec![3, 2] }, &[&x]), &[3, 2], &[0., 1., 2., 3., 4., 5.]);
    assert!(matches!(bad(Op::Reshape { shape: vec![4] }, &[&x]), Error::BadInput { .. }));
    close(&run1(Op::Transpose { perm: vec![1, 0] }, &[&x]), &[3, 2], &[0., 3., 1., 4., 2., 5.]);
    let y = iota([2, 3, 4]);
    let t = run1(Op::Transpose { perm: vec![2, 0, 1] }, &[&y]);
    let tv = t.as_f32().unwrap();
    for i in 0..2 {
        for j in 0..3 {
            for k in 0..4 {
                assert_eq!(tv[(k * 2 + i) * 3 + j], ((i * 3 + j) * 4 + k) as f32);
            }
        }
    }
    let b = Tensor::bool([2, 1], vec![true, false]);
    assert_eq!(run1(Op::Transpose { perm: vec![1, 0] }, &[&b]), Tensor::bool([1, 2], vec![true, false]));
    let c = f([3, 1], vec![1., 2., 3.]);
    close(
        &run1(Op::Expand { shape: vec![2, 3, 2] }, &[&c]),
        &[2, 3, 2],
        &[1., 1., 2., 2., 3., 3., 1., 1., 2., 2., 3., 3.],
    );
    let i = Tensor::i64([1], vec![7]);
    assert_eq!(run1(Op::Expand { shape: vec![3] }, &[&i]), Tensor::i64([3], vec![7; 3]));
}

#[test]
fn concat_split() {
    let a = iota([2, 1]);
    let b = f([2, 2], vec![10., 11., 12., 13.]);
    let c = run1(Op::Concat { axis: 1 }, &[&a, &b]);
    close(&c, &[2, 3], &[0., 10., 11., 1., 12., 13.]);
    let parts = run(Op::Split { axis: 1, sizes: vec![1, 2] }, &[&c]);
    assert_eq!(parts, vec![a, b]);
    let i = run1(Op::Concat { axis: 0 }, &[&Tensor::i64([1], vec![1]), &Tensor::i64([2], vec![2, 3])]);
    assert_eq!(i, Tensor::i64([3], vec![1, 2, 3]));
    assert!(matches!(bad(Op::Concat { axis: 0 }, &[&iota([1]), &Tensor::i64([1], vec![1])]), Error::BadInput { .. }));
}

#[test]
fn slice_negative_steps() {
    let x = iota([6]);
    let s = |start, len, step| Op::Slice { axes: vec![SliceAxis { axis: 0, start, len, step }] };
    close(&run1(s(4, 3, -2), &[&x]), &[3], &[4., 2., 0.]);
    close(&run1(s(5, 6, -1), &[&x]), &[6], &[5., 4., 3., 2., 1., 0.]);
    close(&run1(s(1, 2, 3), &[&x]), &[2], &[1., 4.]);
    close(&run1(s(0, 0, 1), &[&x]), &[0], &[]);
    let y = iota([3, 4]);
    let op = Op::Slice {
        axes: vec![SliceAxis { axis: 0, start: 2, len: 2, step: -1 }, SliceAxis { axis: 1, start: 1, len: 2, step: 2 }],
    };
    close(&run1(op, &[&y]), &[2, 2], &[9., 11., 5., 7.]);
    assert!(matches!(bad(s(4, 3, 2), &[&x]), Error::BadInput { .. }));
}

#[test]
fn gather_wraps_and_checks() {
    let x = iota([3, 2]);
    let idx = Tensor::i64([2], vec![-1, 0]);
    close(&run1(Op::Gather { axis: 0 }, &[&x, &idx]), &[2, 2], &[4., 5., 0., 1.]);
    let idx2 = Tensor::i64([2, 2], vec![1, 0, 1, 1]);
    close(&run1(Op::Gather { axis: 1 }, &[&x, &idx2]), &[3, 2, 2], &[1., 0., 1., 1., 3., 2., 3., 3., 5., 4., 5., 5.]);
    let scalar = Tensor::i64([], vec![1]);
    close(&run1(Op::Gather { axis: 0 }, &[&x, &scalar]), &[2], &[2., 3.]);
    for i in [3, -4] {
        let e = bad(Op::Gather { axis: 0 }, &[&x, &Tensor::i64([1], vec![i])]);
        assert!(matches!(e, Error::BadInput { .. }), "{e}");
    }
    let ids = Tensor::i64([4], vec![10, 20, 30, 40]);
    assert_eq!(run1(Op::Gather { axis: 0 }, &[&ids, &Tensor::i64([1], vec![2])]), Tensor::i64([1], vec![30]));
}

#[test]
fn reductions() {
    let x = iota([2, 3]);
    let r = |op, axes: Vec<usize>, keepdims| Op::Reduce { op, axes, keepdims };
    close(&run1(r(ReduceOp::Sum, vec![1], true), &[&x]), &[2, 1], &[3., 12.]);
    close(&run1(r(ReduceOp::Mean, vec![0], false), &[&x]), &[3], &[1.5, 2.5, 3.5]);
    close(&run1(r(ReduceOp::Max, vec![0, 1], false), &[&x]), &[], &[5.]);
    close(&run1(r(ReduceOp::Min, vec![1], false), &[&x]), &[2], &[0., 3.]);
    close(&run1(r(ReduceOp::Prod, vec![1], false), &[&x]), &[2], &[0., 60.]);
    close(&run1(r(ReduceOp::SumSquare, vec![1], false), &[&x]), &[2], &[5., 50.]);
    close(&run1(r(ReduceOp::L2, vec![1], false), &[&x]), &[2], &[5f32.sqrt(), 50f32.sqrt()]);
    let n = f([2], vec![-1., 2.]);
    close(&run1(r(ReduceOp::L1, vec![0], false), &[&n]), &[], &[3.]);
    close(&run1(r(ReduceOp::LogSum, vec![1], false), &[&x]), &[2], &[3f32.ln(), 12f32.ln()]);
    let big = f([2], vec![1000., 1000.]);
    close(&run1(r(ReduceOp::LogSumExp, vec![0], true), &[&big]), &[1], &[1000. + 2f32.ln()]);
    close(&run1(r(ReduceOp::Sum, vec![], false), &[&x]), &[2, 3], x.as_f32().unwrap());
    // Non-adjacent axes go through a transpose.
    let y = iota([2, 3, 2]);
    close(&run1(r(ReduceOp::Sum, vec![0, 2], true), &[&y]), &[1, 3, 1], &[14., 22., 30.]);
    let i = Tensor::i64([2, 2], vec![3, -1, 7, 2]);
    assert_eq!(run1(r(ReduceOp::Max, vec![1], false), &[&i]), Tensor::i64([2], vec![3, 7]));
    assert_eq!(run1(r(ReduceOp::Sum, vec![0], true), &[&i]), Tensor::i64([1, 2], vec![10, 1]));
    assert!(matches!(bad(r(ReduceOp::Mean, vec![0], false), &[&i]), Error::BadInput { .. }));
    assert!(matches!(bad(r(ReduceOp::Sum, vec![2], false), &[&x]), Error::BadInput { .. }));
}

/// Reductions over trailing axes, where each output is one contiguous run, of every kind (on
/// f32) against the run folded in f64 here; with runs of -inf and an empty run.
#[test]
fn trailing_reductions_match_a_direct_fold() {
    let mut vals: Vec<f32> = (0..90).map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0).collect();
    vals[9..18].fill(f32::NEG_INFINITY);
    let x = f([2, 5, 3, 3], vals.clone());
    let fold = |op: ReduceOp, c: &[f32]| -> f32 {
        let c: Vec<f64> = c.iter().map(|&v| v as f64).collect();
        let sum = |f: &dyn Fn(f64) -> f64| c.iter().map(|&v| f(v)).sum::<f64>();
        (match op {
            ReduceOp::Sum => sum(&|v| v),
            ReduceOp::Mean => sum(&|v| v) / c.len() as f64,
            ReduceOp::Max => c.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            ReduceOp::Min => c.iter().copied().fold(f64::INFINITY, f64::min),
            ReduceOp::Prod => c.iter().product(),
            ReduceOp::SumSquare => sum(&|v| v * v),
            ReduceOp::L2 => sum(&|v| v * v).sqrt(),
            ReduceOp::L1 => sum(&|v| v.abs()),
            ReduceOp::LogSum => sum(&|v| v).ln(),
            ReduceOp::LogSumExp => {
                let m = c.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let m = if m.is_infinite() { 0.0 } else { m };
                m + sum(&|v| (v - m).exp()).ln()
            }
        }) as f32
    };
    use ReduceOp::*;
    for op in [Sum, Mean, Max, Min, Prod, SumSquare, L2, L1, LogSum, LogSumExp] {
        for (axes, run, shape) in
            [(vec![3], 3, vec![2, 5, 3]), (vec![2, 3], 9, vec![2, 5]), (vec![1, 2, 3], 45, vec![2])]
        {
            let want: Vec<f32> = vals.chunks(run).map(|c| fold(op, c)).collect();
            close(&run1(Op::Reduce { op, axes, keepdims: false }, &[&x]), &shape, &want);
        }
    }
    let empty = f([2, 0], vec![]);
    for op in [Sum, Max, LogSumExp] {
        close(&run1(Op::Reduce { op, axes: vec![1], keepdims: false }, &[&empty]), &[2], &[fold(op, &[]); 2]);
    }
}

#[test]
fn pad_constant() {
    let x = iota([2, 2]);
    let y = run1(Op::Pad { pads: vec![1, 0, 0, 2], value: 9.0 }, &[&x]);
    close(&y, &[3, 4], &[9., 9., 9., 9., 0., 1., 9., 9., 2., 3., 9., 9.]);
    let i = Tensor::i64([2], vec![1, 2]);
    assert_eq!(run1(Op::Pad { pads: vec![1, 1], value: 0.0 }, &[&i]), Tensor::i64([4], vec![0, 1, 2, 0]));
}

// ---------- errors ----------

#[test]
fn bad_inputs_are_errors() {
    let x = iota([2, 3]);
    assert!(matches!(bad(Op::Input { name: "x".into() }, &[]), Error::Unsupported { .. }));
    assert!(matches!(bad(Op::Param { name: "w".into() }, &[]), Error::Unsupported { .. }));
    assert!(matches!(bad(Op::Unary(UnaryOp::Relu), &[&x, &x]), Error::BadInput { .. }));
    assert!(matches!(bad(Op::Unary(UnaryOp::Relu), &[]), Error::BadInput { .. }));
    let w = iota([1, 2, 1, 1]);
    let a = ConvAttrs { strides: [1, 1], pads: [0; 4], dilations: [1, 1], group: 1 };
    assert!(matches!(bad(Op::Conv(a), &[&iota([1, 3, 2, 2]), &w]), Error::BadInput { .. }));
    assert!(matches!(bad(Op::MaxPool(pool([5, 5], [1, 1], [0; 4])), &[&iota([1, 1, 2, 2])]), Error::BadInput { .. }));
    assert!(matches!(bad(Op::Softmax { axis: 2 }, &[&x]), Error::BadInput { .. }));
    assert!(matches!(bad(Op::Transpose { perm: vec![0, 0] }, &[&x]), Error::BadInput { .. }));
    assert!(matches!(bad(Op::Where, &[&x, &x, &x]), Error::BadInput { .. }));
    let e = bad(Op::Gather { axis: 0 }, &[&x, &Tensor::i64([1], vec![i64::MIN])]);
    assert!(e.to_string().contains("out of range"), "{e}");
    let e = bad(Op::MaxPool(pool([0, 1], [1, 1], [0; 4])), &[&iota([1, 1, 2, 2])]);
    assert!(matches!(e, Error::BadInput { .. }));
    let empty_w = Tensor::f32([1, 1, 0, 1], vec![]);
    let a = ConvAttrs { strides: [1, 1], pads: [0; 4], dilations: [1, 1], group: 1 };
    assert!(matches!(bad(Op::Conv(a), &[&iota([1, 1, 2, 2]), &empty_w]), Error::BadInput { .. }));
}

// ---------- parallel paths agree with the sequential ones ----------

#[test]
fn two_threads_match_one() {
    let (c1, c2) = (ctx1(), ctx2());
    let x = rnd([4, 64, 33, 17], 1);
    let row = rnd([17], 2);
    let mask = Tensor::bool([1, 1, 33, 17], (0..33 * 17).map(|i| i % 3 == 0).collect());
    let cases: Vec<(Op, Vec<&Tensor>)> = vec![
        (Op::Unary(UnaryOp::Gelu), vec![&x]),
        (Op::Binary(BinaryOp::Add), vec![&x, &row]),
        (Op::Where, vec![&mask, &x, &row]),
        (Op::Softmax { axis: 3 }, vec![&x]),
        (Op::Softmax { axis: 1 }, vec![&x]),
        (Op::LayerNorm { axis: 3, epsilon: 1e-5 }, vec![&x, &row, &row]),
        (Op::Transpose { perm: vec![0, 2, 1, 3] }, vec![&x]),
        (Op::Reduce { op: ReduceOp::Mean, axes: vec![3], keepdims: true }, vec![&x]),
        (Op::Reduce { op: ReduceOp::LogSumExp, axes: vec![1, 2], keepdims: false }, vec![&x]),
        (Op::Reduce { op: ReduceOp::Max, axes: vec![0, 3], keepdims: false }, vec![&x]),
        (Op::MaxPool(pool([3, 3], [2, 2], [1, 1, 1, 1])), vec![&x]),
        (Op::AveragePool(pool([2, 2], [2, 2], [0; 4])), vec![&x]),
        (Op::GlobalAveragePool, vec![&x]),
        (Op::Lrn { size: 5, alpha: 1e-4, beta: 0.75, bias: 1.0 }, vec![&x]),
        (Op::Slice { axes: vec![SliceAxis { axis: 2, start: 32, len: 16, step: -2 }] }, vec![&x]),
        (Op::Expand { shape: vec![2, 4, 64, 33, 17] }, vec![&x]),
    ];
    for (op, ins) in cases {
        let a = eval(&c1, &op, &ins).unwrap();
        let b = eval(&c2, &op, &ins).unwrap();
        assert_eq!(a.len(), b.len());
        for (p, q) in a.iter().zip(&b) {
            assert_eq!(p.shape(), q.shape(), "{}", op.name());
            for (u, v) in p.as_f32().unwrap().iter().zip(q.as_f32().unwrap()) {
                assert!((u - v).abs() <= 1e-5 * (1.0 + u.abs()), "{}: {u} vs {v}", op.name());
            }
        }
    }
}

#[test]
fn context_reports_threads() {
    assert_eq!(ctx2().threads(), 2);
    assert!(CpuContext::new(0).unwrap().threads() >= 1);
}

/// f64 accumulation rounds a cancelling sum once: `1e8 + 1 - 1e8 + ... ` loses the ones in f32
/// (1e8 + 1 == 1e8 in f32) but not in f64.
#[test]
fn f64_accumulation_keeps_cancelling_sums() {
    let k = 64;
    let a: Vec<f32> = (0..k).map(|i| if i % 2 == 0 { 1e8 } else { 1.0 }).collect();
    let mut b: Vec<f32> = vec![1.0; k];
    // Pairs (1e8 * 1) + (1 * 1), then subtract the 1e8s at the end.
    for (i, x) in b.iter_mut().enumerate() {
        if i % 2 == 0 && i >= k / 2 {
            *x = -1.0;
        }
    }
    let want: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
    for threads in [1, 2] {
        let ctx = CpuContext::new(threads).unwrap().with_accumulation(Accumulation::F64);
        let mut c = [0f32];
        gemm_f32(&ctx, 1, 1, k, &a, false, &b, false, &mut c, 1.0, 0.0).unwrap();
        assert_eq!(c[0] as f64, want, "threads {threads}");
        let y = run_ctx(&ctx, Op::MatMul, &[&f([1, k], a.clone()), &f([k, 1], b.clone())]);
        assert_eq!(y.to_f32_vec(), vec![want as f32]);
    }
}

fn run_ctx(ctx: &CpuContext, op: Op, ins: &[&Tensor]) -> Tensor {
    eval(ctx, &op, ins).unwrap().swap_remove(0)
}

#[test]
fn half_precision_storage_computes_in_f32_and_rounds_once() {
    // 1 + 2^-8 is not a bf16 (8 significand bits): it rounds to even, 1.0; 1 + 3*2^-8 to 1 + 2^-6.
    let x = f([3], vec![1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, 70000.0]);
    let b = run1(Op::Cast { to: DType::BF16 }, &[&x]);
    assert_eq!(b.dtype(), DType::BF16);
    assert_eq!(b.to_f32_vec(), vec![1.0, 1.0 + 1.0 / 64.0, 70144.0]);
    // f16's largest finite value is 65504: 70000 overflows to inf.
    let h = run1(Op::Cast { to: DType::F16 }, &[&x]);
    assert_eq!(h.to_f32_vec()[2], f32::INFINITY);
    // A product of bf16 matrices is the f32 product of their values, rounded once to bf16.
    let a = Tensor::bf16([2, 3], &[0.1, 0.2, 0.3, 0.4, 0.5, 0.6]);
    let w = Tensor::bf16([3, 2], &[1.5, -2.25, 0.125, 3.0, -0.7, 0.9]);
    let y = run1(Op::MatMul, &[&a, &w]);
    assert_eq!(y.dtype(), DType::BF16);
    let wide = run1(Op::MatMul, &[&a.clone().widened(), &w.clone().widened()]);
    assert_eq!(y, wide.with_float_type(DType::BF16));
    // Shape ops move 16-bit elements exactly.
    let t = run1(Op::Transpose { perm: vec![1, 0] }, &[&a]);
    assert_eq!(t.dtype(), DType::BF16);
    assert_eq!(t.to_f32_vec()[1], a.to_f32_vec()[3]);
    // Widening a cast back is exact.
    assert_eq!(run1(Op::Cast { to: DType::F32 }, &[&b]).to_f32_vec(), b.to_f32_vec());
}

// ---------- optimizer updates ----------

/// The optional trailing lr factor (a schedule's value) is the same step as an attribute lr
/// of `lr * factor`, bit for bit, in f32 and f64 (weight decay uses the scaled lr too; in f64
/// a factor of 0.5, whose product with the f32 attribute is exact in both); a
/// factor that is not a scalar of the parameter's type is refused.
#[test]
fn update_lr_factor_scales_the_learning_rate() {
    let (p, g, m, v) = (rnd([5, 7], 1), rnd([5, 7], 2), rnd([5, 7], 3), rnd([5, 7], 4));
    let v = run1(Op::Unary(UnaryOp::Abs), &[&v]);
    let lr = 0.3f32;
    let t = Tensor::i64([], vec![4]);
    let sgd = |lr: f32, momentum: f32| Op::SgdUpdate { lr, momentum, weight_decay: 0.1 };
    let adamw = |lr: f32| Op::AdamWUpdate { lr, beta1: 0.9, beta2: 0.999, epsilon: 1e-8, weight_decay: 0.1 };
    for wide in [false, true] {
        let w = |x: &Tensor| if wide { x.clone().with_float_type(DType::F64) } else { x.clone() };
        let (p, g, m, v) = (w(&p), w(&g), w(&m), w(&v));
        let factor = if wide { 0.5f32 } else { 0.37 };
        let f = w(&Tensor::scalar_f32(factor));
        let cases: [(Op, Vec<&Tensor>, Op, Vec<&Tensor>); 3] = [
            (sgd(lr, 0.0), vec![&p, &g, &f], sgd(lr * factor, 0.0), vec![&p, &g]),
            (sgd(lr, 0.9), vec![&p, &g, &m, &f], sgd(lr * factor, 0.9), vec![&p, &g, &m]),
            (adamw(lr), vec![&p, &g, &m, &v, &t, &f], adamw(lr * factor), vec![&p, &g, &m, &v, &t]),
        ];
        for (op, ins, plain, plain_ins) in cases {
            let (got, want) = (run(op.clone(), &ins), run(plain, &plain_ins));
            assert_eq!(got, want, "{} with a factor (f64: {wide})", op.name());
            // Without a factor the op is unchanged: a factor of 1 is the same step.
            let one = w(&Tensor::scalar_f32(1.0));
            let mut ins1 = ins.clone();
            *ins1.last_mut().unwrap() = &one;
            let n = ins1.len() - 1;
            assert_eq!(run(op.clone(), &ins1), run(op.clone(), &ins1[..n]), "{} with factor 1", op.name());
        }
    }
    let bad_factor = [Tensor::f32([1], vec![0.5]), Tensor::scalar_f32(0.5).with_float_type(DType::F64)];
    for f in &bad_factor {
        assert!(matches!(bad(sgd(lr, 0.0), &[&p, &g, f]), Error::BadInput { .. }), "{}", f.meta());
        assert!(matches!(bad(adamw(lr), &[&p, &g, &m, &v, &t, f]), Error::BadInput { .. }), "{}", f.meta());
    }
}
