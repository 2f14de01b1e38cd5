//! Optimizer update ops over several steps against the update rules of `torch.optim.SGD`
//! (momentum, dampening 0, weight decay added to the gradient) and `torch.optim.AdamW`
//! (decoupled weight decay, bias correction at step t), written out in float64 here from
//! PyTorch's documentation. One step of each is also checked against PyTorch itself on four models
//! in `refgrad.rs`; these tests cover what one step cannot: momentum buffers, the AdamW step
//! counter and bias corrections at t > 1, and state carried between steps by the `Trainer`.
//!
//! The model is `y = w * x` (elementwise) with loss `mean((y - t)^2)`, so the gradient is known
//! in closed form: `g = 2 x (w x - t) / n`. Tolerance: 1e-5 relative per step (float32 kernels).

use std::collections::BTreeMap;

use ir::autodiff::{LossSpec, Optimizer, TrainOptions, training_graph};
use ir::{BinaryOp, DType, Graph, Op, Tensor, TensorMeta};
use runtime::Cpu;
use runtime::train::Trainer;

const N: usize = 6;
const X: [f32; N] = [0.5, -1.25, 2.0, 0.75, -0.3, 1.5];
/// No element of the initial gradient is near zero (AdamW step 1 is lr * sign(g) there).
const T: [f32; N] = [1.0, 0.45, -2.0, 0.25, 0.9, -1.1];
const W0: [f32; N] = [0.2, -0.4, 0.9, 1.3, -0.7, 0.05];

fn run(opt: Optimizer, steps: usize) -> Vec<Vec<f32>> {
    let mut g = Graph::new("wx");
    let meta = TensorMeta::new(DType::F32, [N]);
    let x = g.input("x", meta.clone());
    let w = g.param("w", meta, Some(Tensor::f32([N], W0.to_vec())));
    let y = g.add1("y", Op::Binary(BinaryOp::Mul), &[w, x]).unwrap();
    g.set_output("y", y);
    let loss = LossSpec::Mse { output: "y".into(), target: "t".into() };
    let tg = training_graph(&g, &TrainOptions::new(loss, Some(opt))).unwrap();
    let ctx = Cpu::new(1).unwrap();
    let mut tr = Trainer::new(&tg, &g.param_data).unwrap();
    let feeds: BTreeMap<String, Tensor> =
        [("x".to_string(), Tensor::f32([N], X.to_vec())), ("t".to_string(), Tensor::f32([N], T.to_vec()))].into();
    (0..steps)
        .map(|_| {
            tr.step(&ctx, &feeds).unwrap();
            tr.get("w").unwrap().to_f32_vec()
        })
        .collect()
}

fn grad(w: &[f64]) -> Vec<f64> {
    (0..N).map(|i| 2.0 * X[i] as f64 * (w[i] * X[i] as f64 - T[i] as f64) / N as f64).collect()
}

fn check(got: &[Vec<f32>], want: &[Vec<f64>]) {
    for (s, (g, w)) in got.iter().zip(want).enumerate() {
        for i in 0..N {
            let e = (g[i] as f64 - w[i]).abs() / w[i].abs().max(1e-3);
            assert!(
                e < 1e-5,
                "step {}: w[{i}] = {} but the reference gives {} (rel. error {e:.1e})",
                s + 1,
                g[i],
                w[i]
            );
        }
    }
}

#[test]
fn sgd_with_momentum_and_weight_decay() {
    let (lr, mu, wd) = (0.1, 0.9, 0.01);
    let got = run(Optimizer::Sgd { lr: lr as f32, momentum: mu as f32, weight_decay: wd as f32 }, 4);
    let mut w: Vec<f64> = W0.iter().map(|&v| v as f64).collect();
    let mut buf: Option<Vec<f64>> = None;
    let mut want = Vec::new();
    for _ in 0..4 {
        let d: Vec<f64> = grad(&w).iter().zip(&w).map(|(g, p)| g + wd * p).collect();
        // torch: the first step sets the buffer to the gradient, later ones to mu * buf + d.
        let b: Vec<f64> = match &buf {
            None => d.clone(),
            Some(b) => b.iter().zip(&d).map(|(b, d)| mu * b + d).collect(),
        };
        w = w.iter().zip(&b).map(|(p, b)| p - lr * b).collect();
        buf = Some(b);
        want.push(w.clone());
    }
    check(&got, &want);
}

#[test]
fn adamw_over_several_steps() {
    let (lr, b1, b2, eps, wd) = (0.01, 0.9, 0.999, 1e-8, 0.1);
    let opt = Optimizer::AdamW {
        lr: lr as f32,
        beta1: b1 as f32,
        beta2: b2 as f32,
        epsilon: eps as f32,
        weight_decay: wd as f32,
    };
    let got = run(opt, 5);
    let mut w: Vec<f64> = W0.iter().map(|&v| v as f64).collect();
    let (mut m, mut v) = (vec![0.0; N], vec![0.0; N]);
    let mut want = Vec::new();
    for t in 1..=5 {
        let g = grad(&w);
        for i in 0..N {
            w[i] *= 1.0 - lr * wd;
            m[i] = b1 * m[i] + (1.0 - b1) * g[i];
            v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
            let (mh, vh) = (m[i] / (1.0 - b1.powi(t)), v[i] / (1.0 - b2.powi(t)));
            w[i] -= lr * mh / (vh.sqrt() + eps);
        }
        want.push(w.clone());
    }
    check(&got, &want);
}

#[test]
fn plain_sgd_matches_closed_form() {
    let got = run(Optimizer::sgd(0.05), 3);
    let mut w: Vec<f64> = W0.iter().map(|&v| v as f64).collect();
    let mut want = Vec::new();
    for _ in 0..3 {
        w = w.iter().zip(grad(&w)).map(|(p, g)| p - 0.05 * g).collect();
        want.push(w.clone());
    }
    check(&got, &want);
}
