#!/usr/bin/env python3
"""PyTorch state-dict names and shapes of every zoo model, the reference for autopar's
`names.json` (the PyTorch names `--save` writes next to model.safetensors).

Builds each model exactly as export.py does (same configs and seeds; no export) and writes
tests/data/zoo/state-dicts.json: {model: {state-dict key: shape}} of the wrapped module (keys
start with `m.`, as the exported initializers do), with its non-persistent buffers too (such as
rotary `inv_freq`), which exports also hold as initializers. Models whose packages are missing
(timm, diffusers) are left out and listed.

Usage (in a venv with export.py's packages): python scripts/zoo/torch-names.py
"""

import json
import os
import sys

import importlib.machinery  # noqa: E402
import importlib.util  # noqa: E402
import types  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
# export.py imports what exporting and checking need; building the models needs none of these.
for mod in ["onnxruntime", "onnx"]:
    if importlib.util.find_spec(mod) is None:
        stub = types.ModuleType(mod)
        stub.__spec__ = importlib.machinery.ModuleSpec(mod, None)
        sys.modules[mod] = stub
import export  # noqa: E402


def main():
    out = {}
    for name, make in export.MODELS.items():
        try:
            spec = make()
        except Exception as ex:  # a missing optional package: leave the model out, say so
            print(f"{name:<14} skipped: {type(ex).__name__}: {str(ex).splitlines()[0][:120]}")
            continue
        sd = dict(spec.module.state_dict())
        # Buffers kept out of the state dict (rotary inv_freq) are exported as initializers too.
        sd.update(dict(spec.module.named_buffers()))
        out[name] = {k: list(v.shape) for k, v in sd.items()}
        print(f"{name:<14} {len(sd)} tensors")
    path = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data", "zoo", "state-dicts.json")
    with open(os.path.normpath(path), "w") as f:
        json.dump(out, f, indent=0, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
