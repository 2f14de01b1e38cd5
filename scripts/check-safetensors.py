#!/usr/bin/env python3
"""Checks that a model.safetensors written by `autopar train --save DIR` or `autopar run --save DIR`
loads with the Python `safetensors` package (issue 23) and holds the same tensors as DIR/params.npz.

Usage (in a venv: python3 -m venv /tmp/venv && /tmp/venv/bin/pip install safetensors numpy torch):
    /tmp/venv/bin/python scripts/check-safetensors.py DIR
Loads with `safetensors.numpy.load_file`, and with `safetensors.torch.load_file` when torch is
installed; prints one line per tensor and exits non-zero on any difference. With DIR/names.json
(the PyTorch names autopar found in the model file), also builds the PyTorch state dict they give
(transposing where a name says so) and, given a second argument, saves it with torch.save:
    /tmp/venv/bin/python scripts/check-safetensors.py DIR state_dict.pt"""

import json
import os
import sys

import numpy as np
from safetensors.numpy import load_file


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    d = sys.argv[1]
    st = load_file(f"{d}/model.safetensors")
    npz = np.load(f"{d}/params.npz")
    if sorted(st) != sorted(npz.files):
        sys.exit(f"names differ: {sorted(st)} against {sorted(npz.files)}")
    for name in sorted(st):
        a, b = st[name], npz[name]
        if a.dtype != b.dtype or a.shape != b.shape or not np.array_equal(a, b):
            sys.exit(f"{name}: {a.dtype}{list(a.shape)} differs from params.npz's {b.dtype}{list(b.shape)}")
        print(f"{name}: {a.dtype}{list(a.shape)} equal")
    try:
        from safetensors.torch import load_file as load_torch
    except ImportError:
        print("torch not installed: the torch loader was not tried")
        return
    t = load_torch(f"{d}/model.safetensors")
    for name, x in t.items():
        if not np.array_equal(x.numpy(), st[name]):
            sys.exit(f"{name}: torch loads different values")
    print(f"{len(t)} tensors load with safetensors.torch too")
    names = f"{d}/names.json"
    if not os.path.exists(names):
        return
    doc = json.load(open(names))
    sd = {}
    for onnx_name, torch_names in doc["params"].items():
        for n in torch_names:
            x = t[onnx_name]
            sd[n["name"]] = x.t().contiguous() if n["transposed"] else x
    print(f"names.json: {len(sd)} state-dict entries from {len(doc['params'])} tensors; "
          f"{len(doc['unmapped'])} without a PyTorch name")
    if len(sys.argv) == 3:
        import torch

        torch.save(sd, sys.argv[2])
        print(f"saved the state dict to {sys.argv[2]} (load with module.load_state_dict(..., strict=False))")


if __name__ == "__main__":
    main()
