"""`autoparallelize`: export a PyTorch module for training as docs/export.md prescribes, then plan it."""

from __future__ import annotations

import collections
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping

from . import _autopar
from ._plan import Plan, optimizer_args, plan_onnx


def _merged_parameters(module: Any, path: str) -> list[str]:
    """The module's parameters the file lost (what an eval-mode export does when it merges equal
    initializers): those not an initializer under their own name, past the number of float
    initializers the exporter renamed (`onnx::MatMul_258`). Empty when none is lost."""
    import onnx

    params = dict(module.named_parameters())  # tied parameters once
    known = set(params) | {n for n, _ in module.named_buffers()}
    inits = onnx.load(path, load_external_data=False).graph.initializer
    names = {t.name for t in inits}
    missing = [n for n in params if n not in names]
    float_types = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE)
    renamed = [t.name for t in inits if t.name not in known and t.data_type in float_types and len(t.dims) > 0]
    return missing[len(renamed):] if len(renamed) < len(missing) else []


def export_onnx(module: Any, example_inputs: Mapping[str, Any], path: str | os.PathLike,
                output_names: list[str] | None = None) -> None:
    """Exports `module` for training: `torch.onnx.export` in training mode, opset 17, no constant
    folding, every `nn.Dropout` at p=0 (restored after), `example_inputs`' values the forward's positional
    arguments in order, named by their keys.
    Parameter values are kept as initializers under the module's names."""
    import torch

    dropouts = [(m, m.p) for m in module.modules() if isinstance(m, torch.nn.modules.dropout._DropoutNd)]
    was_training = module.training
    config = getattr(module, "config", None)
    use_cache = getattr(config, "use_cache", None)
    try:
        for m, _ in dropouts:
            m.p = 0.0
        if use_cache is not None:
            config.use_cache = False
        module.train()
        names = list(example_inputs)
        with torch.no_grad():
            torch.onnx.export(
                module,
                tuple(example_inputs.values()),
                os.fspath(path),
                input_names=names,
                output_names=output_names or ["output"],
                opset_version=17,
                training=torch.onnx.TrainingMode.TRAINING,
                do_constant_folding=False,
                dynamo=False,
            )
    finally:
        for m, p in dropouts:
            m.p = p
        if use_cache is not None:
            config.use_cache = use_cache
        module.train(was_training)


def autoparallelize(module: Any, example_inputs: Mapping[str, Any], mesh: str = "2x2",
                    memory: str | int = "16GiB", loss: str | None = None, optimizer: Any = None,
                    precision: str | None = None, output_names: list[str] | None = None,
                    onnx_path: str | os.PathLike | None = None, **opts: Any) -> Plan:
    """Exports `module` for training (`export_onnx`) with `example_inputs` (a dict input name ->
    tensor, the global batch of one step) and plans it as `plan_onnx` does. Refuses
    (`autopar.ModelError`) a file whose exporter merged equal parameters into one. The ONNX file
    is written to `onnx_path` (default: a temporary directory kept as long as the plan)."""
    optimizer_args(optimizer)  # refuse an unsupported optimizer before exporting
    if onnx_path is None:
        tmp = tempfile.TemporaryDirectory(prefix="autopar-")
        path = Path(tmp.name) / "model.onnx"
    else:
        tmp, path = None, Path(onnx_path)
    export_onnx(module, example_inputs, path, output_names)
    lost = _merged_parameters(module, os.fspath(path))
    if lost:
        raise _autopar.ModelError(
            f"{path}: the export merged parameters into others ({', '.join(lost[:3])}, ...): "
            "training the file would train them as one"
        )
    plan = plan_onnx(path, mesh=mesh, memory=memory, loss=loss, optimizer=optimizer, precision=precision, **opts)
    plan._tmp = tmp
    return plan
