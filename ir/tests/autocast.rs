//! Mixed precision: `autocast` puts the casts where PyTorch's CUDA autocast computes (matmuls in
//! 16 bits, normalisations in f32, the rest promoted, parameters and constants weak), and the
//! training graph built on it keeps f32 parameters, f32 gradients (or 16-bit ones with
//! `grads = low`) and verifies.

use ir::autodiff::{LossSpec, MixedPrecision, Optimizer, TrainOptions};
use ir::{BinaryOp, DType, Graph, Op, Tensor, TensorMeta, UnaryOp};

/// An embedding lookup, a linear layer with a bias, a layer norm, a scaled residual, logits.
fn model() -> Graph {
    let mut g = Graph::new("tiny");
    let ids = g.input("ids", TensorMeta::new(DType::I64, [2, 3]));
    let emb = g.param("emb", TensorMeta::new(DType::F32, [10, 4]), None);
    let w = g.param("w", TensorMeta::new(DType::F32, [4, 4]), None);
    let b = g.param("b", TensorMeta::new(DType::F32, [4]), None);
    let gamma = g.param("gamma", TensorMeta::new(DType::F32, [4]), None);
    let beta = g.param("beta", TensorMeta::new(DType::F32, [4]), None);
    let head = g.param("head", TensorMeta::new(DType::F32, [4, 10]), None);
    let half = g.constant("half", Tensor::scalar_f32(0.5));
    let x = g.add1("embed", Op::Gather { axis: 0 }, &[emb, ids]).unwrap();
    let h = g.add1("mm", Op::MatMul, &[x, w]).unwrap();
    let h = g.add1("bias", Op::Binary(BinaryOp::Add), &[h, b]).unwrap();
    let h = g.add1("act", Op::Unary(UnaryOp::Gelu), &[h]).unwrap();
    let h = g.add1("scale", Op::Binary(BinaryOp::Mul), &[h, half]).unwrap();
    let h = g.add1("residual", Op::Binary(BinaryOp::Add), &[h, x]).unwrap();
    let h = g.add1("norm", Op::LayerNorm { axis: 2, epsilon: 1e-5 }, &[h, gamma, beta]).unwrap();
    let y = g.add1("logits", Op::MatMul, &[h, head]).unwrap();
    g.set_output("logits", y);
    g
}

fn dtype_of(g: &Graph, name: &str) -> DType {
    g.node(g.find(name).unwrap_or_else(|| panic!("no node {name}"))).outputs[0].dtype
}

#[test]
fn casts_follow_autocast_classes() {
    let mut g = model();
    let made = ir::autocast::autocast(&mut g, DType::BF16).unwrap();
    ir::verify(&g).unwrap();
    // Parameters stay f32: the master copy.
    assert_eq!(dtype_of(&g, "w"), DType::F32);
    // An embedding lookup reads only a parameter: it stays f32, as PyTorch's embedding does.
    assert_eq!(dtype_of(&g, "embed"), DType::F32);
    // Matrix products in bf16; the bias (weak) and what follows promote to bf16.
    for n in ["mm", "bias", "act", "scale", "logits"] {
        assert_eq!(dtype_of(&g, n), DType::BF16, "{n}");
    }
    // The residual meets the f32 embedding: f32. The layer norm computes in f32.
    assert_eq!(dtype_of(&g, "residual"), DType::F32);
    assert_eq!(dtype_of(&g, "norm"), DType::F32);
    // A constant is rounded, not cast at run time.
    let half = g.find("half.bf16").expect("the bf16 copy of the constant");
    assert!(matches!(&g.node(half).op, Op::Constant(t) if t.dtype() == DType::BF16));
    // Casts: x, w, b, the constant, the scaled value back to f32, the norm's output, head.
    assert_eq!(made.casts.len(), 7, "{:?}", made.casts);
    // Each value is cast once per type.
    let mut again = g.clone();
    let more = ir::autocast::autocast(&mut again, DType::BF16).unwrap();
    assert!(more.casts.is_empty(), "autocast is idempotent");
}

#[test]
fn mixed_training_keeps_f32_parameters_and_gradients() {
    let opts = TrainOptions {
        loss: LossSpec::CrossEntropy { output: "logits".into(), labels: "labels".into() },
        optimizer: Some(Optimizer::Sgd { lr: 0.1, momentum: 0.0, weight_decay: 0.0 }),
        frozen: vec![],
        schedule: Default::default(),
        clip_grad_norm: None,
    };
    for (grads, want) in [(DType::F32, DType::F32), (DType::BF16, DType::BF16)] {
        let mp = MixedPrecision { low: DType::BF16, grads, loss_scaling: false };
        let tg = ir::autodiff::training_graph_with(&model(), &opts, Some(mp)).unwrap();
        ir::verify(&tg.graph).unwrap();
        assert_eq!(tg.graph.meta(tg.loss).dtype, DType::F32, "the loss is f32");
        // w is read through its bf16 copy: its gradient is that copy's, cast back unless kept low.
        assert_eq!(tg.graph.meta(tg.grads["w"]).dtype, want);
        // emb is read in f32 (the lookup) only: an f32 gradient either way.
        assert_eq!(tg.graph.meta(tg.grads["emb"]).dtype, DType::F32);
        for (p, v) in &tg.graph.updates {
            assert_eq!(tg.graph.meta(ir::Value::new(*p, 0)).dtype, tg.graph.meta(*v).dtype);
        }
    }
}

#[test]
fn fp16_loss_scaling_adds_its_state_and_skips() {
    let opts = TrainOptions {
        loss: LossSpec::CrossEntropy { output: "logits".into(), labels: "labels".into() },
        optimizer: Some(Optimizer::AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.999, epsilon: 1e-8, weight_decay: 0.0 }),
        frozen: vec![],
        schedule: Default::default(),
        clip_grad_norm: None,
    };
    let mp = MixedPrecision { low: DType::F16, grads: DType::F32, loss_scaling: true };
    let tg = ir::autodiff::training_graph_with(&model(), &opts, Some(mp)).unwrap();
    ir::verify(&tg.graph).unwrap();
    let g = &tg.graph;
    for s in [ir::autodiff::LOSS_SCALE_STATE, ir::autodiff::LOSS_SCALE_GOOD_STEPS, ir::autodiff::LOSS_SCALE_POISON] {
        let n = g.find(s).unwrap_or_else(|| panic!("no state {s}"));
        assert!(g.updates.iter().any(|(t, _)| *t == n), "{s} is updated");
    }
    // Every parameter and optimizer state keeps its value unless the gradients are finite.
    for (t, v) in &g.updates {
        let name = &g.node(*t).name;
        if !name.starts_with("amp/") {
            assert!(matches!(g.node(v.node).op, Op::Where), "{name}'s update is not guarded");
        }
    }
}
