//! Time of the kernels on the shapes of resnet18 and a small GPT (batch 1), one and two threads.
//!
//! ```text
//! cargo bench -p kernels --bench ops
//! ```

use ir::{BinaryOp, ConvAttrs, Op, PoolAttrs, Tensor, UnaryOp};
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

fn pool() -> PoolAttrs {
    PoolAttrs {
        kernel: [3, 3],
        strides: [2, 2],
        pads: [1; 4],
        dilations: [1, 1],
        ceil_mode: false,
        count_include_pad: false,
    }
}

fn main() {
    let conv = |s: usize, p: usize| Op::Conv(ConvAttrs { strides: [s, s], pads: [p; 4], dilations: [1, 1], group: 1 });
    // (name, op, input shapes)
    let cases: Vec<(&str, Op, Vec<Vec<usize>>)> = vec![
        ("conv1 7x7/2 3->64 @224", conv(2, 3), vec![vec![1, 3, 224, 224], vec![64, 3, 7, 7], vec![64]]),
        ("conv 3x3 64->64 @56", conv(1, 1), vec![vec![1, 64, 56, 56], vec![64, 64, 3, 3], vec![64]]),
        ("conv 3x3 128->128 @28", conv(1, 1), vec![vec![1, 128, 28, 28], vec![128, 128, 3, 3], vec![128]]),
        ("conv 3x3 256->256 @14", conv(1, 1), vec![vec![1, 256, 14, 14], vec![256, 256, 3, 3], vec![256]]),
        ("conv 3x3 512->512 @7", conv(1, 1), vec![vec![1, 512, 7, 7], vec![512, 512, 3, 3], vec![512]]),
        ("conv 1x1/2 64->128 @56", conv(2, 0), vec![vec![1, 64, 56, 56], vec![128, 64, 1, 1], vec![128]]),
        (
            "conv input grad 3x3 24->8 @32",
            Op::ConvInputGrad {
                attrs: ConvAttrs { strides: [1, 1], pads: [1; 4], dilations: [1, 1], group: 1 },
                shape: vec![1, 24, 32, 32],
            },
            vec![vec![1, 8, 32, 32], vec![8, 24, 3, 3]],
        ),
        (
            "conv input grad 3x3 64->64 @56",
            Op::ConvInputGrad {
                attrs: ConvAttrs { strides: [1, 1], pads: [1; 4], dilations: [1, 1], group: 1 },
                shape: vec![1, 64, 56, 56],
            },
            vec![vec![1, 64, 56, 56], vec![64, 64, 3, 3]],
        ),
        (
            "conv weight grad 3x3 24->8 @32",
            Op::ConvWeightGrad {
                attrs: ConvAttrs { strides: [1, 1], pads: [1; 4], dilations: [1, 1], group: 1 },
                shape: vec![8, 24, 3, 3],
            },
            vec![vec![1, 24, 32, 32], vec![1, 8, 32, 32]],
        ),
        ("maxpool 3x3/2 [1,64,32,32]", Op::MaxPool(pool()), vec![vec![1, 64, 32, 32]]),
        ("maxpool grad 3x3/2 [1,64,32,32]", Op::MaxPoolGrad(pool()), vec![vec![1, 64, 32, 32], vec![1, 64, 16, 16]]),
        ("matmul [1,128,256]@[256,1024]", Op::MatMul, vec![vec![1, 128, 256], vec![256, 1024]]),
        ("matmul attn [1,4,128,64]@[1,4,64,128]", Op::MatMul, vec![vec![1, 4, 128, 64], vec![1, 4, 64, 128]]),
        ("softmax [1,4,128,128]", Op::Softmax { axis: 3 }, vec![vec![1, 4, 128, 128]]),
        (
            "layernorm [1,128,256]",
            Op::LayerNorm { axis: 2, epsilon: 1e-5 },
            vec![vec![1, 128, 256], vec![256], vec![256]],
        ),
        ("gelu [1,128,1024]", Op::Unary(UnaryOp::Gelu), vec![vec![1, 128, 1024]]),
        ("add [1,64,56,56]+[1,64,56,56]", Op::Binary(BinaryOp::Add), vec![vec![1, 64, 56, 56], vec![1, 64, 56, 56]]),
        ("relu [1,64,112,112]", Op::Unary(UnaryOp::Relu), vec![vec![1, 64, 112, 112]]),
    ];
    let ctxs = [CpuContext::new(1).expect("pool"), CpuContext::new(2).expect("pool")];
    println!("| op | 1 thread ms | 2 threads ms | GFLOP/s (2 thr) |");
    println!("|---|---|---|---|");
    for (name, op, shapes) in cases {
        let ins: Vec<Tensor> = shapes.iter().map(|s| rnd(s)).collect();
        let refs: Vec<&Tensor> = ins.iter().collect();
        let metas: Vec<_> = ins.iter().map(|t| t.meta()).collect();
        let outs = op.infer(&metas).expect("valid case");
        let flops = op.flops(&metas, &outs) as f64;
        let t1 = time(&ctxs[0], &op, &refs);
        let t2 = time(&ctxs[1], &op, &refs);
        println!("| {name} | {:.3} | {:.3} | {:.1} |", t1 * 1e3, t2 * 1e3, flops / t2 / 1e9);
    }
}
