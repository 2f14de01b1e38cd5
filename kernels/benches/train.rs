//! Time of the kernels a training step of the bundled models runs, on their exact shapes (batch as
//! exported): every distinct resnet18 convolution (B=2) forward, input gradient and weight
//! gradient, its max pooling, the mlp's (B=32) matrix products, and the linear layers of
//! gpt2-tiny (128 tokens, hidden 128) and of a GPT-2 of realistic width (`gpt2-wide` of
//! `scripts/bench-train`: 512 tokens, hidden 768); one and two threads.
//!
//! ```text
//! cargo bench -p kernels --bench train [FILTER]
//! ```
//! Each figure is the best of 5 runs after a warm-up; `count` is how many times one step runs the
//! shape, and the totals weigh each row by it.

use ir::{ConvAttrs, Op, PoolAttrs, Tensor};
use kernels::cpu::{CpuContext, eval};
use std::time::Instant;

fn rnd(shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    Tensor::f32(shape.to_vec(), (0..n).map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 500.0).collect())
}

fn time(ctx: &CpuContext, op: &Op, ins: &[&Tensor]) -> f64 {
    eval(ctx, op, ins).expect("kernel runs");
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let t = Instant::now();
        eval(ctx, op, ins).expect("kernel runs");
        best = best.min(t.elapsed().as_secs_f64());
    }
    best
}

/// (name, count per step, op, input shapes)
type Case = (String, usize, Op, Vec<Vec<usize>>);

fn conv_cases(out: &mut Vec<Case>) {
    let b = 2;
    // (c_in, c_out, k, stride, pad, h_in, count per step)
    let convs = [
        (3, 64, 7, 2, 3, 224, 1),
        (64, 64, 3, 1, 1, 56, 4),
        (64, 128, 3, 2, 1, 56, 1),
        (64, 128, 1, 2, 0, 56, 1),
        (128, 128, 3, 1, 1, 28, 3),
        (128, 256, 3, 2, 1, 28, 1),
        (128, 256, 1, 2, 0, 28, 1),
        (256, 256, 3, 1, 1, 14, 3),
        (256, 512, 3, 2, 1, 14, 1),
        (256, 512, 1, 2, 0, 14, 1),
        (512, 512, 3, 1, 1, 7, 3),
    ];
    for (c, m, k, s, p, h, count) in convs {
        let attrs = ConvAttrs { strides: [s, s], pads: [p; 4], dilations: [1, 1], group: 1 };
        let oh = (h + 2 * p - k) / s + 1;
        let tag = format!("{k}x{k}/{s} {c}->{m} @{h}");
        let x = vec![b, c, h, h];
        let w = vec![m, c, k, k];
        let dy = vec![b, m, oh, oh];
        out.push((format!("conv {tag}"), count, Op::Conv(attrs.clone()), vec![x.clone(), w.clone(), vec![m]]));
        if c != 3 {
            // The first convolution's input (the image) needs no gradient.
            out.push((
                format!("conv_input_grad {tag}"),
                count,
                Op::ConvInputGrad { attrs: attrs.clone(), shape: x.clone() },
                vec![dy.clone(), w.clone()],
            ));
        }
        out.push((format!("conv_weight_grad {tag}"), count, Op::ConvWeightGrad { attrs, shape: w }, vec![x, dy]));
    }
    let pool = PoolAttrs {
        kernel: [3, 3],
        strides: [2, 2],
        pads: [1, 1, 1, 1],
        dilations: [1, 1],
        ceil_mode: false,
        count_include_pad: false,
    };
    out.push(("maxpool 3x3/2 @112".into(), 1, Op::MaxPool(pool.clone()), vec![vec![b, 64, 112, 112]]));
    out.push((
        "maxpool_grad 3x3/2 @112".into(),
        1,
        Op::MaxPoolGrad(pool),
        vec![vec![b, 64, 112, 112], vec![b, 64, 56, 56]],
    ));
}

fn mlp_cases(out: &mut Vec<Case>) {
    let gemm = |ta, tb| Op::Gemm { alpha: 1.0, beta: 1.0, trans_a: ta, trans_b: tb };
    // forward x [32,k] @ W[n,k]^T; input grad dy [32,n] @ W [n,k]; weight grad dy^T [n,32] @ x [32,k]
    for (k, n) in [(256, 1024), (1024, 1024), (1024, 256)] {
        out.push((
            format!("mlp fwd [32,{k}]@[{n},{k}]^T"),
            1,
            gemm(false, true),
            vec![vec![32, k], vec![n, k], vec![n]],
        ));
        out.push((format!("mlp dx [32,{n}]@[{n},{k}]"), 1, gemm(false, false), vec![vec![32, n], vec![n, k]]));
        out.push((format!("mlp dw [32,{n}]^T@[32,{k}]"), 1, gemm(true, false), vec![vec![32, n], vec![32, k]]));
    }
}

fn transformer_cases(out: &mut Vec<Case>) {
    let gemm = |ta, tb| Op::Gemm { alpha: 1.0, beta: 0.0, trans_a: ta, trans_b: tb };
    // HF Conv1D layers, W stored [k, n]: forward x [t,k] @ W; input grad dy [t,n] @ W^T; weight
    // grad x^T [k,t] @ dy [t,n]. (model, tokens, [(k, n)]): attention in, attention out, MLP up,
    // MLP down, LM head.
    let models = [
        ("gpt2", 128, [(128, 384), (128, 128), (128, 512), (512, 128), (128, 1000)]),
        ("gpt2-wide", 512, [(768, 2304), (768, 768), (768, 3072), (3072, 768), (768, 2048)]),
    ];
    for (model, t, layers) in models {
        for (k, n) in layers {
            out.push((format!("{model} fwd [{t},{k}]@[{k},{n}]"), 1, gemm(false, false), vec![vec![t, k], vec![k, n]]));
            out.push((format!("{model} dx [{t},{n}]@[{k},{n}]^T"), 1, gemm(false, true), vec![vec![t, n], vec![k, n]]));
            out.push((format!("{model} dw [{t},{k}]^T@[{t},{n}]"), 1, gemm(true, false), vec![vec![t, k], vec![t, n]]));
        }
    }
}

fn main() {
    let filter = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let mut cases = Vec::new();
    conv_cases(&mut cases);
    mlp_cases(&mut cases);
    transformer_cases(&mut cases);
    let ctxs = [CpuContext::new(1).expect("pool"), CpuContext::new(2).expect("pool")];
    println!("| op | count | 1 thread ms | 2 threads ms | GFLOP/s 1 thr | GFLOP/s 2 thr |");
    println!("|---|---|---|---|---|---|");
    let mut totals = std::collections::BTreeMap::<String, (f64, f64)>::new();
    for (name, count, op, shapes) in cases {
        if filter.as_ref().is_some_and(|f| !name.contains(f.as_str())) {
            continue;
        }
        let ins: Vec<Tensor> = shapes.iter().map(|s| rnd(s)).collect();
        let refs: Vec<&Tensor> = ins.iter().collect();
        let metas: Vec<_> = ins.iter().map(|t| t.meta()).collect();
        let outs = op.infer(&metas).expect("valid case");
        let flops = op.flops(&metas, &outs) as f64;
        let t1 = time(&ctxs[0], &op, &refs);
        let t2 = time(&ctxs[1], &op, &refs);
        let group = name.split(' ').next().unwrap_or("").to_string();
        let e = totals.entry(group).or_default();
        e.0 += t1 * count as f64;
        e.1 += t2 * count as f64;
        println!(
            "| {name} | {count} | {:.3} | {:.3} | {:.1} | {:.1} |",
            t1 * 1e3,
            t2 * 1e3,
            flops / t1 / 1e9,
            flops / t2 / 1e9
        );
    }
    println!();
    println!("| kind | total 1 thread ms | total 2 threads ms |");
    println!("|---|---|---|");
    for (k, (t1, t2)) in totals {
        println!("| {k} | {:.2} | {:.2} |", t1 * 1e3, t2 * 1e3);
    }
}
