#!/usr/bin/env python3
"""Test models and PyTorch references for issue 50 items 3 and 4: tests/data/numerics/.

Item 3, the NaN class: a tiny LlamaForCausalLM (random weights, no hub access) with an
`attention_mask` input, exported twice:

- `llama-dynamo-sim`: `torch.onnx.export(dynamo=True)` (opset 18), then simplified by onnxsim.
  Its causal mask is built with ScatterND from the mask input and holds finfo(float32).min;
  onnxsim folds the exporter's `Cast(Constant)` numbers into float initializers
  (`scalar_tensor_default`: the 0 of `mask == 0`; `scalar_tensor_default_1`: the 2 of
  `x.pow(2)` in RMSNorm) and removes the RMSNorm weights (a product with ones);
- `llama-torchscript`: `torch.onnx.export` (TorchScript, opset 17, training mode, no constant
  folding: initializers are the module's parameters), whose mask is built with
  ConstantOfShape, Trilu, Expand, Where and ScatterND.

The batch has three rows: one unpadded, one right-padded (3 positions), one left-padded (2
positions). The left padding gives query rows that every key masks: whole softmax rows of
finfo.min, which PyTorch's eager attention turns into a uniform distribution.

Item 4, statistics are not weights: `levit-bn`, a LeViT-style network (a convolution stem with
BatchNorm2d, attention and MLP blocks whose Linear layers are followed by BatchNorm1d, LeViT's
`Linear_BN`, and a BatchNorm1d before the classifier) exported in eval mode (TorchScript, opset
17, no constant folding): every BatchNormalization is the inference form, whose mean and variance
inputs are the running statistics. They are set to random values, variances down to 3e-4.

References: for each model, PyTorch trains the module on the committed inputs for 3 steps with
SGD and with AdamW (learning rates in refs.json), as `autopar train --steps 3` does (the loss
before each update; AdamW with PyTorch's defaults but the lr: betas 0.9/0.999, eps 1e-8, weight decay 0.01; gradients
of every trained parameter, `zero_grad` before each step). What PyTorch trains is what the file
trains:

- the LLaMA files: every parameter that is an initializer of the file (as-is or transposed, as
  onnxsim stores MatMul weights). The RMSNorm weights that onnxsim removed are frozen (they are
  ones, so the forward is the same); the rotary `inv_freq` buffer is never trained;
- `levit-bn`: the module's *parameters*, with the whole module in eval mode for every step, so
  the BatchNorm layers normalise with their running statistics, which are buffers and
  constants. The script checks that no buffer changed.

refs.json also records the loss's gradient norm at the initial weights (what `--clip-grad-norm`
reports), the initializers autopar should hold as statistics or constants, and onnxruntime's
agreement with PyTorch's forward.

edge-grads.json: PyTorch's gradients of single ops at the points where a backward formula taken
literally gives 0 x inf or 0 / 0 (see `edge_cases`).

Needs torch 2.5.1, transformers 4.46.3, onnx, onnxscript, onnxsim, onnxruntime (the venv of
scripts/zoo). Usage, from the repository root:
    python scripts/numerics-refs.py [--out tests/data/numerics]
"""

import argparse
import collections
import json
import os
import tempfile
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from onnx import numpy_helper  # noqa: E402

warnings.filterwarnings("ignore")
torch.set_num_threads(1)

STEPS = 3
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


class CausalLM(torch.nn.Module):
    """Plain tensors in, logits out."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, input_ids, attention_mask):
        return self.m(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      pad_token_id=0, attention_dropout=0.0)
    cfg._attn_implementation = "eager"
    model = CausalLM(LlamaForCausalLM(cfg))
    # PyTorch never updates nn.Embedding's padding row, which an ONNX Gather cannot say: without
    # its padding_idx (the row is zeros already) training the module is training the file, as
    # scripts/zoo does.
    model.m.model.embed_tokens.padding_idx = None
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, 64, (3, 8), generator=g)
    mask = torch.ones(3, 8, dtype=torch.int64)
    mask[1, 5:] = 0  # right padding
    mask[2, :2] = 0  # left padding: the first queries see no key
    ids[mask == 0] = 0
    inputs = collections.OrderedDict(input_ids=ids, attention_mask=mask)
    return model, inputs, "ce-next:logits:input_ids", None


class LinearBN(torch.nn.Module):
    """LeViT's Linear_BN: a Linear without bias, then BatchNorm1d over the flattened tokens."""

    def __init__(self, a, b):
        super().__init__()
        self.c = torch.nn.Linear(a, b, bias=False)
        self.bn = torch.nn.BatchNorm1d(b)

    def forward(self, x):
        return self.bn(self.c(x).flatten(0, 1)).reshape(x.shape[0], x.shape[1], -1)


class Block(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = LinearBN(dim, 3 * dim)
        self.proj = LinearBN(dim, dim)
        self.fc1 = LinearBN(dim, 2 * dim)
        self.fc2 = LinearBN(2 * dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        h = self.heads
        q, k, v = self.qkv(x).reshape(b, n, 3, h, c // h).permute(2, 0, 3, 1, 4)
        a = (q @ k.transpose(-2, -1)) * (c // h) ** -0.5
        y = (a.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c)
        x = x + self.proj(F.hardswish(y))
        return x + self.fc2(F.hardswish(self.fc1(x)))


class LeViTLike(torch.nn.Module):
    def __init__(self, dim=16, classes=10):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, dim, 3, stride=2, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(dim)
        self.block = Block(dim, heads=2)
        self.head_bn = torch.nn.BatchNorm1d(dim)
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, x):
        x = F.hardswish(self.bn(self.conv(x))).flatten(2).transpose(1, 2)
        x = self.block(x)
        return self.head(self.head_bn(x.mean(1)))


def levit():
    torch.manual_seed(0)
    model = LeViTLike()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 8, 8, generator=g)
    labels = torch.randint(0, 10, (4,), generator=g)
    # Running statistics as training leaves them: the averages over batches like the input, with
    # a few channels of tiny variance (the layer before scales them down), as in the issue's
    # LeViT. The affine weights and biases are random.
    norms = [m for m in model.modules() if isinstance(m, (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d))]
    before = {model.bn: model.conv, model.head_bn: None}
    for mod in model.modules():
        if isinstance(mod, LinearBN):
            before[mod.bn] = mod.c
    with torch.no_grad():
        for bn in norms:
            layer = before[bn]
            if layer is not None:
                layer.weight[0] *= 0.1
            bn.weight.copy_(torch.rand(bn.num_features, generator=g) + 0.5)
            bn.bias.copy_(torch.rand(bn.num_features, generator=g) * 0.2 - 0.1)
            bn.momentum = None  # cumulative average
        model.train()
        for _ in range(8):
            model(torch.randn(4, 3, 8, 8, generator=g))
        for bn in norms:
            bn.momentum = 0.1
    model.eval()
    return model, collections.OrderedDict(x=x), "ce:y:labels", labels


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------


def strip(m):
    """Drop each node's FX metadata and stack traces (local paths, most of a dynamo file)."""
    for n in m.graph.node:
        del n.metadata_props[:]
        n.doc_string = ""
    return m


def export(model, inputs, outputs, path, kind):
    args = tuple(inputs.values())
    names = list(inputs.keys())
    if kind == "dynamo-sim":
        import onnxsim

        with tempfile.TemporaryDirectory() as d:
            tmp = os.path.join(d, "model.onnx")
            torch.onnx.export(model, args, tmp, input_names=names, output_names=outputs, opset_version=18,
                              dynamo=True)
            m = onnx.load(tmp)
        m, ok = onnxsim.simplify(strip(m))
        assert ok, "onnxsim could not check its result"
    elif kind == "torchscript-train":
        torch.onnx.export(model, args, path, input_names=names, output_names=outputs, opset_version=17,
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)
        m = onnx.load(path)
    elif kind == "torchscript-eval":
        torch.onnx.export(model, args, path, input_names=names, output_names=outputs, opset_version=17,
                          training=torch.onnx.TrainingMode.EVAL, do_constant_folding=False)
        m = onnx.load(path)
    else:
        raise ValueError(kind)
    onnx.save(strip(m), path)
    return onnx.load(path)


def match_initializers(model, onnx_model):
    """Which module parameters the file holds as initializers (as-is or transposed), and the float
    initializers that are no parameter."""
    params = dict(model.named_parameters())
    claimed, other = {}, []
    for init in onnx_model.graph.initializer:
        if init.data_type != onnx.TensorProto.FLOAT:
            continue
        a = numpy_helper.to_array(init)
        hit = None
        for name, p in params.items():
            if name in claimed.values():
                continue
            v = p.detach().numpy()
            if v.shape == a.shape and np.array_equal(v, a) or v.ndim == 2 and v.T.shape == a.shape and np.array_equal(v.T, a):
                hit = name
                break
        if hit is None:
            other.append(init.name)
        else:
            claimed[init.name] = hit
    return claimed, other


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


def loss_of(spec, out, inputs, target):
    kind = spec.split(":")[0]
    if kind == "ce":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
    ids = inputs["input_ids"]
    return F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), ids[:, 1:].reshape(-1))


def train(model, trained, inputs, spec, target, optimizer, lr):
    """The loss before each of STEPS updates, the initial gradient norm, and the final state."""
    model = __import__("copy").deepcopy(model)
    model.eval()  # every step: BatchNorm reads its running statistics, no dropout
    params = [p for n, p in model.named_parameters() if n in trained]
    for n, p in model.named_parameters():
        p.requires_grad_(n in trained)
    if optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=lr)
    else:
        opt = torch.optim.AdamW(params, lr=lr)
    losses, norm = [], None
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=False)
        loss = loss_of(spec, model(*inputs.values()), inputs, target)
        losses.append(float(loss))
        loss.backward()
        if norm is None:
            norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params)))
        assert all(torch.isfinite(p.grad).all() for p in params), "PyTorch's gradient is not finite"
        opt.step()
    return losses, norm, model


def ort_rel_err(path, inputs, expected):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    s = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    got = s.run(None, {k: v.numpy() for k, v in inputs.items()})[0]
    e = expected.detach().numpy()
    return float(np.abs(got - e).max() / np.abs(e).max())


def make(out, name, build, kind, output, lrs):
    model, inputs, spec, target = build()
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "model.onnx")
    model.eval()
    m = export(model, inputs, [output], path, kind)
    with torch.no_grad():
        y = model(*inputs.values())
    feeds = {}
    for k, v in inputs.items():
        np.save(os.path.join(d, f"{k}.npy"), v.numpy())
        feeds[k] = f"{k}.npy"
    if target is not None:
        tname = spec.split(":")[2]
        np.save(os.path.join(d, f"{tname}.npy"), target.numpy())
        feeds[tname] = f"{tname}.npy"
    claimed, other = match_initializers(model, m)
    trained = set(claimed.values())
    frozen_in_torch = sorted(n for n, _ in model.named_parameters() if n not in trained)
    # What the file no longer holds must not matter to the forward: RMSNorm weights of ones.
    for n in frozen_in_torch:
        p = dict(model.named_parameters())[n]
        assert torch.equal(p, torch.ones_like(p)), f"{n} is not in the file and not ones"
    readers = collections.defaultdict(set)
    for node in m.graph.node:
        for k, i in enumerate(node.input):
            readers[i].add((node.op_type, k))
    statistics = sorted(n for n in other if any(op == "BatchNormalization" and k in (3, 4) for op, k in readers[n]))
    constants = sorted(n for n in other if n not in statistics
                       and int(np.prod(numpy_helper.to_array(
                           next(i for i in m.graph.initializer if i.name == n)).shape)) == 1)
    buffers = sorted(n for n in other if n not in statistics and n not in constants)
    variances = [float(b.min()) for n, b in model.named_buffers() if n.endswith("running_var")]
    ref = {
        "model": name,
        "export": kind,
        "loss": spec,
        "feeds": feeds,
        "freeze": buffers,
        "statistics": statistics,
        "constants": constants,
        "frozen_in_pytorch": frozen_in_torch,
        "ort_max_rel_err": ort_rel_err(path, inputs, y),
        "smallest_running_var": min(variances) if variances else None,
        "optimizers": {},
    }
    for opt, lr in lrs.items():
        losses, norm, after = train(model, trained, inputs, spec, target, opt, lr)
        ref["optimizers"][opt] = {"lr": lr, "losses": losses, "grad_norm": norm}
        for bn, b in model.named_buffers():
            assert torch.equal(b, dict(after.named_buffers())[bn]), f"buffer {bn} changed"
    with open(os.path.join(d, "refs.json"), "w") as f:
        json.dump(ref, f, indent=1)
        f.write("\n")
    print(name, {k: v for k, v in ref.items() if k not in ("feeds",)})


def edge_cases(out):
    """PyTorch's gradients where backward formulas meet 0 x inf or ties: edge-grads.json.

    Each case is y = f(inputs) with the loss mean((y - t)^2) (`mse:y:t`); the listed inputs are
    trained, the others are constants. The values sit exactly on the points where a formula taken
    literally gives NaN (0^0, products with zeros, a zero norm) or where a whole softmax row is
    finfo.min, and PyTorch's autograd gives finite gradients."""
    fmin = torch.finfo(torch.float32).min
    g = torch.Generator().manual_seed(3)
    mask = torch.zeros(2, 4)
    mask[0, 2:] = fmin
    mask[1, :] = fmin  # a whole row masked
    keep = mask == 0
    cases = {
        "pow": (lambda x, c: x ** c, {"x": torch.tensor([0.0, 0.0, 2.0, 3.0, 0.5, 1.5]),
                                      "c": torch.tensor([0.0, 2.0, 0.0, 1.5, 3.0, 0.5])}, {}),
        "prod": (lambda x: torch.prod(x, dim=1), {"x": torch.tensor([[0.0, 2.0, 3.0], [0.0, 0.0, 4.0],
                                                                    [1.5, 2.0, 0.5]])}, {}),
        "l2": (lambda x: torch.linalg.vector_norm(x, dim=1), {"x": torch.tensor([[0.0, 0.0, 0.0],
                                                                                [3.0, 4.0, 0.0]])}, {}),
        "amax": (lambda x: torch.amax(x, dim=1), {"x": torch.tensor([[1.0, 1.0, 0.0, -2.0], [-3.0] * 4,
                                                                    [0.5, -1.0, 2.0, 2.0]])}, {}),
        "masked_softmax": (lambda s, mask: torch.softmax(s + mask, dim=-1),
                           {"s": torch.randn(2, 4, generator=g)}, {"mask": mask}),
        "where_softmax": (lambda s, keep, fill: torch.softmax(torch.where(keep, s, fill), dim=-1),
                          {"s": torch.randn(2, 4, generator=g)}, {"keep": keep, "fill": torch.tensor(fmin)}),
    }
    refs = {}
    for name, (f, trained, consts) in cases.items():
        xs = {k: v.clone().requires_grad_(True) for k, v in trained.items()}
        y = f(**xs, **consts)
        t = torch.randn(y.shape, generator=g)
        F.mse_loss(y, t).backward()
        grads = {k: v.grad.tolist() for k, v in xs.items()}
        assert all(torch.isfinite(v.grad).all() for v in xs.values()), name
        refs[name] = {
            "inputs": {k: v.tolist() for k, v in trained.items()},
            "constants": {k: v.tolist() if v.dtype != torch.bool else v.int().tolist() for k, v in consts.items()},
            "y": y.tolist(),
            "t": t.tolist(),
            "grads": grads,
        }
    with open(os.path.join(out, "edge-grads.json"), "w") as f:
        json.dump({"about": edge_cases.__doc__.strip(), "cases": refs}, f, indent=1)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "data", "numerics"))
    a = ap.parse_args()
    make(a.out, "llama-dynamo-sim", llama, "dynamo-sim", "logits", {"sgd": 0.1, "adamw": 0.01})
    make(a.out, "llama-torchscript", llama, "torchscript-train", "logits", {"sgd": 0.1, "adamw": 0.01})
    make(a.out, "levit-bn", levit, "torchscript-eval", "y", {"sgd": 0.01, "adamw": 0.001})
    edge_cases(a.out)


if __name__ == "__main__":
    main()
