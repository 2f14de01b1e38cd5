#!/usr/bin/env python3
"""PyTorch references for mixed-precision training: tests/data/mixed/refs.json.

For gpt2-tiny, bert-tiny and resnet18 (tests/data/models), the ONNX graph itself is run in
PyTorch by a small interpreter (below): every float initializer is one trainable nn.Parameter
(shared initializers stay shared, as autopar trains them), every node one torch call. Training
is 3 SGD steps with f32 parameters, in three precisions:

- f32: no autocast (checks the interpreter against `autopar train`);
- bf16 / fp16: `torch.autocast("cpu", dtype)`. PyTorch decides which ops run in 16 bits: matrix
  products and convolutions are cast down, every other op promotes its inputs as PyTorch's type
  promotion says. CPU autocast computes layer norms, softmax, exp and pow in 16 bits too; CUDA
  autocast (the one mixed-precision training uses) runs them in f32, and so does autopar: the
  ops of CUDA autocast's f32 list present in these graphs (LayerNormalization, Softmax,
  LogSoftmax, Pow, Exp, Log, Reciprocal, ReduceSum) run here with autocast disabled on f32
  inputs. The loss is computed in f32. fp16 uses a fixed loss scale of 1024 (gradients are
  unscaled before the step), as torch.amp.GradScaler would on steps without overflow.

It also exports a model in half precision, `tests/data/mixed/mlp-f16.onnx` (a two-layer GELU MLP
made `.half()`: f16 initializers, input and output; TorchScript exporter), with its input, an
f32 target, and the losses of 3 SGD steps of the same module with its f16 weights widened to
f32 (what autopar trains: f32 parameters initialised from the file's values).

Needs torch (2.5.1), numpy and onnx. Usage, from the repository root:
    python scripts/mixed-refs.py [--out tests/data/mixed/refs.json]
"""

import argparse
import json
import math
import os

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import numpy_helper

torch.set_num_threads(1)
STEPS = 3
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data")

CASES = [
    {
        "model": "gpt2-tiny",
        "loss": "ce-next:logits:input_ids",
        "feeds": {"input_ids": "models/gpt2-tiny.input_ids.npy"},
        "lr": 0.1,
    },
    {
        "model": "bert-tiny",
        "loss": "mse:last_hidden_state:target",
        "feeds": {
            "input_ids": "models/bert-tiny.input_ids.npy",
            "attention_mask": "models/bert-tiny.attention_mask.npy",
            "target": "refgrad/bert-tiny/bert-tiny.target.npy",
        },
        "lr": 0.1,
    },
    {
        "model": "resnet18",
        "loss": "ce:logits:labels",
        "feeds": {"input": "models/resnet18.input.npy", "labels": "refgrad/resnet18/resnet18.labels.npy"},
        "lr": 0.0001,
    },
]

F32_OPS = {"LayerNormalization", "Softmax", "LogSoftmax", "Pow", "Exp", "Log", "Reciprocal", "ReduceSum"}
DTYPES = {1: torch.float32, 6: torch.int32, 7: torch.int64, 9: torch.bool, 10: torch.float16, 11: torch.float64, 16: torch.bfloat16}


def attrs(node):
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def run_node(op, a, x):
    """One ONNX node on torch tensors `x` (None for a missing optional input)."""
    if op == "Identity":
        return [x[0]]
    if op == "Constant":
        return [torch.from_numpy(numpy_helper.to_array(a["value"]).copy())]
    if op == "ConstantOfShape":
        v = numpy_helper.to_array(a["value"]) if "value" in a else np.zeros(1, np.float32)
        return [torch.full([int(d) for d in x[0]], v.reshape(-1)[0].item(), dtype=torch.from_numpy(v.copy()).dtype)]
    if op == "Reshape":
        shape = [int(d) for d in x[1]]
        shape = [x[0].shape[i] if d == 0 else d for i, d in enumerate(shape)]
        return [x[0].reshape(shape)]
    if op == "Flatten":
        ax = a.get("axis", 1)
        return [x[0].reshape(int(np.prod(x[0].shape[:ax])), -1)]
    if op == "Unsqueeze":
        y = x[0]
        for d in sorted(int(d) for d in x[1]):
            y = y.unsqueeze(d)
        return [y]
    if op == "Transpose":
        return [x[0].permute(*a["perm"])]
    if op == "Split":
        sizes = [int(s) for s in x[1]]
        return list(torch.split(x[0], sizes, dim=a.get("axis", 0)))
    if op == "Gather":
        return [torch.index_select(x[0], a.get("axis", 0), x[1].reshape(-1)).reshape(
            *x[0].shape[: a.get("axis", 0)], *x[1].shape, *x[0].shape[a.get("axis", 0) + 1 :])]
    if op == "Expand":
        return [x[0] * torch.ones([int(d) for d in x[1]], dtype=x[0].dtype)]
    if op == "Cast":
        return [x[0].to(DTYPES[a["to"]])]
    if op in ("Add", "Sub", "Mul", "Div", "Pow", "Equal"):
        f = {"Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Div": torch.div, "Pow": torch.pow, "Equal": torch.eq}[op]
        return [f(x[0], x[1])]
    if op == "Where":
        return [torch.where(x[0], x[1], x[2])]
    if op == "Tanh":
        return [torch.tanh(x[0])]
    if op == "Erf":
        return [torch.erf(x[0])]
    if op == "Relu":
        return [torch.relu(x[0])]
    if op == "Softmax":
        return [torch.softmax(x[0], a.get("axis", -1))]
    if op == "LayerNormalization":
        ax = a.get("axis", -1)
        shape = x[0].shape[ax:]
        return [F.layer_norm(x[0], shape, x[1], x[2] if len(x) > 2 else None, a.get("epsilon", 1e-5))]
    if op == "MatMul":
        return [torch.matmul(x[0], x[1])]
    if op == "Gemm":
        A = x[0].t() if a.get("transA", 0) else x[0]
        B = x[1].t() if a.get("transB", 0) else x[1]
        y = torch.matmul(A, B) * a.get("alpha", 1.0)
        if len(x) > 2 and x[2] is not None:
            y = torch.addmm(x[2] * a.get("beta", 1.0), A, B, alpha=a.get("alpha", 1.0))
        return [y]
    if op == "Conv":
        pads = a.get("pads", [0, 0, 0, 0])
        assert pads[0] == pads[2] and pads[1] == pads[3], "asymmetric pads"
        return [F.conv2d(x[0], x[1], x[2] if len(x) > 2 else None, a.get("strides", [1, 1]), pads[:2],
                         a.get("dilations", [1, 1]), a.get("group", 1))]
    if op == "MaxPool":
        pads = a.get("pads", [0, 0, 0, 0])
        return [F.max_pool2d(x[0], a["kernel_shape"], a.get("strides", [1, 1]), pads[:2])]
    if op == "GlobalAveragePool":
        return [x[0].mean(dim=(2, 3), keepdim=True)]
    raise NotImplementedError(op)


class Graph(torch.nn.Module):
    """An ONNX graph as a torch module: float initializers are parameters."""

    def __init__(self, path):
        super().__init__()
        self.model = onnx.load(path)
        self.names = []
        self.consts = {}
        for init in self.model.graph.initializer:
            arr = numpy_helper.to_array(init).copy()
            if arr.dtype.kind == "f":
                self.register_parameter(f"p{len(self.names)}", torch.nn.Parameter(torch.from_numpy(arr.astype(np.float32))))
                self.names.append(init.name)
            else:
                self.consts[init.name] = torch.from_numpy(arr)

    def forward(self, feeds):
        env = dict(self.consts)
        env.update({n: getattr(self, f"p{i}") for i, n in enumerate(self.names)})
        env.update(feeds)
        for node in self.model.graph.node:
            x = [env[i] if i else None for i in node.input]
            if node.op_type in F32_OPS and torch.is_autocast_enabled("cpu"):
                with torch.autocast("cpu", enabled=False):
                    x = [t.float() if t is not None and t.is_floating_point() else t for t in x]
                    y = run_node(node.op_type, attrs(node), x)
            else:
                y = run_node(node.op_type, attrs(node), x)
            env.update(zip(node.output, y))
        return {o.name: env[o.name] for o in self.model.graph.output}


def loss_of(spec, outs, feeds):
    kind, out, other = spec.split(":")
    y = outs[out].float()
    if kind == "mse":
        return ((y - feeds[other].float()) ** 2).mean()
    if kind == "ce":
        return F.cross_entropy(y.reshape(-1, y.shape[-1]), feeds[other].reshape(-1))
    ids = feeds[other]
    return F.cross_entropy(y[:, :-1].reshape(-1, y.shape[-1]), ids[:, 1:].reshape(-1))


def train(case, precision):
    torch.manual_seed(0)
    g = Graph(os.path.join(ROOT, "models", case["model"] + ".onnx"))
    feeds = {k: torch.from_numpy(np.load(os.path.join(ROOT, v))) for k, v in case["feeds"].items()}
    opt = torch.optim.SGD(g.parameters(), lr=case["lr"])
    scale = 1024.0 if precision == "fp16" else 1.0
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        if precision == "f32":
            outs = g(feeds)
        else:
            dt = torch.bfloat16 if precision == "bf16" else torch.float16
            with torch.autocast("cpu", dtype=dt):
                outs = g(feeds)
        loss = loss_of(case["loss"], outs, feeds)
        (loss * scale).backward()
        if scale != 1.0:
            for p in g.parameters():
                if p.grad is not None:
                    p.grad /= scale
        assert all(torch.isfinite(p.grad).all() for p in g.parameters() if p.grad is not None), "non-finite gradient"
        opt.step()
        losses.append(loss.item())
    return losses


def export_f16_mlp(out_dir):
    torch.manual_seed(0)

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(16, 32)
            self.fc2 = torch.nn.Linear(32, 8)

        def forward(self, x):
            return self.fc2(F.gelu(self.fc1(x)))

    m = MLP().half()
    x = torch.randn(4, 16).half()
    target = torch.randn(4, 8)
    path = os.path.join(out_dir, "mlp-f16.onnx")
    torch.onnx.export(m, (x,), path, input_names=["x"], output_names=["y"], opset_version=17, dynamo=False)
    np.save(os.path.join(out_dir, "mlp-f16.x.npy"), x.numpy())
    np.save(os.path.join(out_dir, "mlp-f16.target.npy"), target.numpy())
    wide = m.float()
    opt = torch.optim.SGD(wide.parameters(), lr=0.1)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = ((wide(x.float()) - target) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print("mlp-f16 (widened to f32)", " ".join(f"{v:.7f}" for v in losses))
    return {"model": "mlp-f16", "loss": "mse:y:target", "lr": 0.1, "f32": losses}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "mixed", "refs.json"))
    args = ap.parse_args()
    out = {"steps": STEPS, "torch": torch.__version__, "f32_policy_ops": sorted(F32_OPS), "cases": []}
    for case in CASES:
        row = dict(case)
        for p in ("f32", "bf16", "fp16"):
            row[p] = train(case, p)
            print(case["model"], p, " ".join(f"{x:.7f}" for x in row[p]), flush=True)
        row["bf16_vs_f32"] = max(abs(a - b) for a, b in zip(row["bf16"], row["f32"]))
        out["cases"].append(row)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    out["f16_model"] = export_f16_mlp(os.path.dirname(args.out))
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
