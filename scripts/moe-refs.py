#!/usr/bin/env python3
"""PyTorch references for autopar's routed-experts op (ir::Op::Moe): tests/data/moe/refs.json.

Each case builds Hugging Face's own `MixtralSparseMoeBlock` (transformers 4.46, torch 2.5.1,
float32) with a fixed seed: the router's softmax over the logits, top-k, the chosen weights
renormalised to sum to 1, SwiGLU experts `w2(silu(w1 x) * w3 x)`, dropless. The auxiliary loss is
HF's `load_balancing_loss_func` on the block's router logits (Switch's `E * sum_e f_e P_e`).
The script records, for the loss `L = sum(y * r) + AUX_WEIGHT * aux` with a fixed random `r`:
the inputs, y, aux, L and the gradients of L with respect to x, the router and the experts'
weights, in autopar's layouts:
    router [H, E] = gate.weight^T
    w1, w3 [E, H, F] = stack(experts[e].w1.weight^T), likewise w3
    w2     [E, F, H] = stack(experts[e].w2.weight^T)
`moe_matches_pytorch` in tests/tests/moe.rs runs Op::Moe and Op::MoeGrad on them and compares
to 1e-5.

Usage, in the zoo venv (~/.cache/autopar-python/venv), from the repository root:
    python scripts/moe-refs.py [--out tests/data/moe/refs.json]
"""

import argparse
import json

import torch
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock, load_balancing_loss_func

AUX_WEIGHT = 0.5
CASES = [
    # name, batch, seq, hidden, ffn, experts, top_k, seed
    ("mixtral_top2", 2, 3, 4, 3, 4, 2, 47),
    ("mixtral_top1", 1, 5, 4, 3, 4, 1, 48),
]


def flat(t):
    # 9 significant digits hold an f32 exactly.
    return [float(f"{v:.9g}") for v in t.detach().reshape(-1).tolist()]


def case(name, b, s, h, f, e, k, seed):
    torch.manual_seed(seed)
    cfg = MixtralConfig(hidden_size=h, intermediate_size=f, num_local_experts=e, num_experts_per_tok=k)
    block = MixtralSparseMoeBlock(cfg).float()
    # HF's init gives small weights; wider ones make the routing and the checks less trivial.
    with torch.no_grad():
        for p in block.parameters():
            p.uniform_(-1.0, 1.0)
    block.train()
    x = torch.empty(b, s, h).uniform_(-1.0, 1.0).requires_grad_(True)
    r = torch.empty(b, s, h).uniform_(-1.0, 1.0)
    y, logits = block(x)
    aux = load_balancing_loss_func((logits,), e, k)
    loss = (y * r).sum() + AUX_WEIGHT * aux
    loss.backward()
    ex = block.experts
    w1 = torch.stack([m.w1.weight.t() for m in ex])
    w3 = torch.stack([m.w3.weight.t() for m in ex])
    w2 = torch.stack([m.w2.weight.t() for m in ex])
    grad = lambda ps: torch.stack([p.grad.t() for p in ps])  # noqa: E731
    return {
        "name": name,
        "shape": {"batch": b, "seq": s, "hidden": h, "ffn": f, "experts": e, "top_k": k},
        "normalize": True,
        "act": "swiglu",
        "aux_weight": AUX_WEIGHT,
        "inputs": {
            "x": flat(x),
            "router": flat(block.gate.weight.t()),
            "w1": flat(w1),
            "w3": flat(w3),
            "w2": flat(w2),
            "r": flat(r),
        },
        "y": flat(y.reshape(b, s, h)),
        "aux": float(f"{float(aux):.9g}"),
        "loss": float(f"{float(loss):.9g}"),
        "grads": {
            "x": flat(x.grad),
            "router": flat(block.gate.weight.grad.t()),
            "w1": flat(grad([m.w1.weight for m in ex])),
            "w3": flat(grad([m.w3.weight for m in ex])),
            "w2": flat(grad([m.w2.weight for m in ex])),
        },
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/data/moe/refs.json")
    args = ap.parse_args()
    doc = {
        "generator": "scripts/moe-refs.py",
        "torch": torch.__version__,
        "cases": [case(*c) for c in CASES],
    }
    with open(args.out, "w") as fh:
        json.dump(doc, fh, separators=(",", ":"))
        fh.write("\n")


if __name__ == "__main__":
    main()
