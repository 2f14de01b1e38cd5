#!/usr/bin/env python3
"""Writes tests/data/schedules/refs.json: PyTorch's learning rates per step for the schedules
autopar builds (`--lr-schedule`, `--warmup-steps`), and a few training steps of the bundled mlp
with gradient clipping (`--clip-grad-norm`) and a schedule, for tests/tests/lr_clip.rs.

Everything comes from real torch objects: `torch.optim.SGD`/`AdamW`, the schedulers of
`torch.optim.lr_scheduler` (LambdaLR for the warmup, CosineAnnealingLR, StepLR, chained by
SequentialLR at the end of the warmup; a LambdaLR holding `min_lr` after the cosine, as autopar
does, where CosineAnnealingLR would rise again) and `torch.nn.utils.clip_grad_norm_`'s two parts,
`get_total_norm` (on the gradients in f64: its f32 reduction loses 1.5e-5 on a 1M-element
tensor; `grad_norms_torch_f32` keeps the f32 values) and `clip_grads_with_norm_`. The lr of
step k is the optimizer's lr when `optimizer.step()` runs, with `scheduler.step()` after it.

The mlp is tests/data/models/mlp.onnx written as torch code (its initializers as parameters;
the exporter merged the two LayerNorms' equal initializers, so both read the same tensors, as
the ONNX file does), trained on tests/data/models/mlp.x.npy with the MSE loss against
tests/data/refgrad/mlp/mlp.target.npy (tests/data/refgrad/README.md defines it).

Run by hand: /tmp/venv/bin/python scripts/make-schedule-refs.py (torch, numpy, onnx).
"""

import json
import math
import os
import sys

import numpy as np
import onnx
import onnx.numpy_helper
import torch
import torch.nn.functional as F
from torch.optim import lr_scheduler as sched

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")
STEPS = 30


def scheduler(opt, base_lr, s):
    """The torch scheduler of a schedule description (see `schedules` below)."""
    w = s["warmup_steps"]
    d = s["decay"]
    if d["kind"] == "constant":
        after = [sched.LambdaLR(opt, lambda k: 1.0)]
        milestones = []
    elif d["kind"] == "cosine":
        floor = d["min_lr"] / base_lr
        after = [
            sched.CosineAnnealingLR(opt, T_max=d["steps"], eta_min=d["min_lr"]),
            sched.LambdaLR(opt, lambda k: floor),
        ]
        milestones = [w + d["steps"]]
    elif d["kind"] == "step":
        after = [sched.StepLR(opt, step_size=d["step_size"], gamma=d["gamma"])]
        milestones = []
    else:
        raise ValueError(d)
    if w > 0:
        warmup = sched.LambdaLR(opt, lambda k: min(1.0, (k + 1) / w))
        scheds = [warmup] + after
        milestones = [w] + milestones
    else:
        scheds = after
    if len(scheds) == 1:
        return scheds[0]
    return sched.SequentialLR(opt, scheds, milestones=milestones)


def lrs(s, steps=STEPS):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=s["lr"])
    sc = scheduler(opt, s["lr"], s)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sc.step()
    return out


schedules = [
    {"name": "constant", "lr": 0.1, "warmup_steps": 0, "decay": {"kind": "constant"}},
    {"name": "warmup", "lr": 3e-3, "warmup_steps": 7, "decay": {"kind": "constant"}},
    {
        "name": "warmup-cosine-floor",
        "lr": 1e-3,
        "warmup_steps": 5,
        "decay": {"kind": "cosine", "steps": 20, "min_lr": 1e-4},
    },
    {"name": "cosine", "lr": 1.0, "warmup_steps": 0, "decay": {"kind": "cosine", "steps": 30, "min_lr": 0.0}},
    {"name": "cosine-held", "lr": 0.5, "warmup_steps": 0, "decay": {"kind": "cosine", "steps": 17, "min_lr": 0.05}},
    {"name": "step", "lr": 0.1, "warmup_steps": 0, "decay": {"kind": "step", "step_size": 7, "gamma": 0.5}},
    {"name": "warmup-step", "lr": 0.05, "warmup_steps": 4, "decay": {"kind": "step", "step_size": 5, "gamma": 0.3}},
]


def mlp_params():
    m = onnx.load(os.path.join(DATA, "models", "mlp.onnx"))
    return {i.name: torch.tensor(onnx.numpy_helper.to_array(i).copy()) for i in m.graph.initializer}


def mlp(p, x):
    def ln(h):
        # Both LayerNorms read ln_in's tensors (the ONNX file's Identity aliases).
        return F.layer_norm(h, (h.shape[-1],), p["ln_in.weight"], p["ln_in.bias"], eps=1e-5)

    def gelu(h):
        # The exported graph's arithmetic: h * (1 + erf(h / sqrt(2))) * 0.5.
        return h * (torch.erf(h / 1.4142135381698608) + 1.0) * 0.5

    h = ln(x)
    h = gelu(F.linear(h, p["fc1.weight"], p["fc1.bias"]))
    h = gelu(F.linear(h, p["fc2.weight"], p["fc2.bias"]))
    return ln(F.linear(h, p["fc3.weight"], p["fc3.bias"]))


def train(case):
    torch.manual_seed(0)
    params = {k: torch.nn.Parameter(v.clone()) for k, v in mlp_params().items()}
    init = {k: v.detach().clone() for k, v in params.items()}
    x = torch.tensor(np.load(os.path.join(DATA, "models", "mlp.x.npy")))
    t = torch.tensor(np.load(os.path.join(DATA, "refgrad", "mlp", "mlp.target.npy")))
    o = case["optimizer"]
    plist = list(params.values())
    if o["kind"] == "adamw":
        opt = torch.optim.AdamW(
            plist, lr=o["lr"], betas=(0.9, 0.999), eps=1e-8, weight_decay=o["weight_decay"], foreach=False
        )
    else:
        opt = torch.optim.SGD(plist, lr=o["lr"], momentum=o["momentum"], weight_decay=o["weight_decay"], foreach=False)
    sc = scheduler(opt, o["lr"], case["schedule"]) if case["schedule"] else None
    losses, norms, torch_norms, lr_used = [], [], [], []
    for _ in range(case["steps"]):
        opt.zero_grad()
        loss = F.mse_loss(mlp(params, x), t)
        loss.backward()
        # clip_grad_norm_ is get_total_norm then clip_grads_with_norm_. Its f32 norm is off by
        # 1.5e-5 relative here (torch.linalg.vector_norm's CPU reduction over fc2.weight's 1M
        # elements; a sum of squares in f32 is not), so the total norm is taken of the f32
        # gradients in f64, rounded to f32, and given to torch's clipping; torch's own value is
        # kept for information.
        grads = [q.grad for q in plist]
        own = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=False)
        total = torch.nn.utils.get_total_norm([g.double() for g in grads], norm_type=2.0).float()
        torch.nn.utils.clip_grads_with_norm_(plist, case["clip_grad_norm"], total, foreach=False)
        losses.append(loss.item())
        norms.append(total.item())
        torch_norms.append(own.item())
        lr_used.append(opt.param_groups[0]["lr"])
        opt.step()
        if sc is not None:
            sc.step()
    with torch.no_grad():
        final_loss = F.mse_loss(mlp(params, x), t).item()
    return {
        **case,
        "losses": losses,
        "final_loss": final_loss,
        "grad_norms": norms,
        "grad_norms_torch_f32": torch_norms,
        "lrs": lr_used,
        # The norm of each parameter's change over the steps (the parameters are too large to
        # store; this is sensitive to every update).
        "update_norms": {k: (params[k].detach() - init[k]).double().norm().item() for k in sorted(params)},
    }


training = [
    {
        "name": "mlp-adamw-clip",
        "optimizer": {"kind": "adamw", "lr": 1e-3, "weight_decay": 0.01},
        "schedule": None,
        "clip_grad_norm": 0.5,
        "steps": 5,
    },
    {
        "name": "mlp-sgd-warmup-cosine-clip",
        "optimizer": {"kind": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.0},
        "schedule": {"lr": 0.1, "warmup_steps": 2, "decay": {"kind": "cosine", "steps": 4, "min_lr": 0.01}},
        "clip_grad_norm": 1.0,
        "steps": 7,
    },
]


def main():
    torch.set_num_threads(1)
    out = {
        "about": "made by scripts/make-schedule-refs.py; read by tests/tests/lr_clip.rs",
        "torch": torch.__version__,
        "steps": STEPS,
        "schedules": [{**s, "lrs": lrs(s)} for s in schedules],
        "training": [train(c) for c in training],
    }
    for c in out["training"]:
        clipped = sum(n > c["clip_grad_norm"] for n in c["grad_norms"])
        print(f"{c['name']}: losses {c['losses']}, grad norms {c['grad_norms']} ({clipped} steps clipped)")
        if clipped == 0:
            sys.exit(f"{c['name']}: clipping is never active")
    path = os.path.join(DATA, "schedules", "refs.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(f"wrote {path}")
    assert math.isfinite(out["training"][0]["final_loss"])


if __name__ == "__main__":
    main()
