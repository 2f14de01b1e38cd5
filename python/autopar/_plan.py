"""`plan_onnx` and `Plan`: planning an ONNX file and training on the plan, through the CLI's library."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import numpy as np

from . import _autopar


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _opts_args(opts: Mapping[str, Any]) -> list[str]:
    """Keyword options as the CLI's flags: `time_limit=5` -> `--time-limit 5`, `tie_layers=True`
    -> `--tie-layers`, a list repeats the flag."""
    out: list[str] = []
    for k, v in opts.items():
        if v is None or v is False:
            continue
        if v is True:
            out.append(_flag(k))
        elif isinstance(v, (list, tuple)):
            for x in v:
                out += [_flag(k), str(x)]
        else:
            out += [_flag(k), str(v)]
    return out


def optimizer_args(optimizer: Any) -> list[str]:
    """`--optimizer` and its settings from a name (`"adamw"`, `"sgd"`), a dict of the CLI's
    optimizer flags (`{"optimizer": "sgd", "lr": 0.1}`) or a `torch.optim.SGD`/`AdamW`
    instance (its first parameter group's settings)."""
    if optimizer is None:
        return []
    if isinstance(optimizer, str):
        return ["--optimizer", optimizer]
    if isinstance(optimizer, Mapping):
        return _opts_args(optimizer)
    kind = type(optimizer).__name__
    group = optimizer.param_groups[0]
    if kind == "SGD":
        if group.get("nesterov") or group.get("dampening"):
            raise _autopar.ArgumentError("--optimizer sgd: nesterov and dampening are not supported")
        return ["--optimizer", "sgd", "--lr", repr(float(group["lr"])), "--momentum",
                repr(float(group["momentum"])), "--weight-decay", repr(float(group["weight_decay"]))]
    if kind == "AdamW":
        b1, b2 = group["betas"]
        return ["--optimizer", "adamw", "--lr", repr(float(group["lr"])), "--betas", f"{b1!r},{b2!r}",
                "--eps", repr(float(group["eps"])), "--weight-decay", repr(float(group["weight_decay"]))]
    raise _autopar.ArgumentError(f"--optimizer {kind}: autopar trains with SGD or AdamW")


def _inputs_args(inputs: Mapping[str, Any] | None) -> list[str]:
    out: list[str] = []
    for name, dims in (inputs or {}).items():
        if not isinstance(dims, str):
            dims = "x".join(str(int(d)) for d in dims)
        out += ["--input", f"{name}={dims}"]
    return out


def plan_onnx(path: str | os.PathLike, mesh: str = "2x2", memory: str | int = "16GiB",
              loss: str | None = None, optimizer: Any = None, precision: str | None = None,
              inputs: Mapping[str, Any] | None = None, **opts: Any) -> "Plan":
    """Plans an ONNX file as `autopar autoparallelize PATH --mesh MESH --memory MEMORY ...` does.

    `loss` is the CLI's spec (`mse:OUT:TARGET`, `ce:OUT:LABELS`, `ce-next:OUT:IDS`), `optimizer`
    a name, a dict of optimizer flags or a torch optimizer, `inputs` binds input shapes
    (`{"input_ids": (8, 128)}`); any other keyword is the CLI flag of that name
    (`time_limit=5`, `strategy="dp"`, `pipeline=2`). Needs no torch. Raises `autopar.Error`
    subclasses carrying the CLI's one-line message."""
    args = [os.fspath(path), "--mesh", str(mesh), "--memory", str(memory)]
    if loss is not None:
        args += ["--loss", loss]
    if precision is not None:
        args += ["--precision", precision]
    args += optimizer_args(optimizer) + _inputs_args(inputs) + _opts_args(opts)
    return Plan(_autopar.plan(args), os.fspath(path))


def _numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.ascontiguousarray(np.asarray(x))


def _bar(total: int):
    """tqdm's progress bar on a terminal, when tqdm is installed; else none."""
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="step")


class Plan:
    """A plan: its layouts per device, its estimate, and training on it."""

    def __init__(self, native: Any, model: str):
        self._native = native
        self.model = model
        self._json = json.loads(native.to_json())
        self._params: dict[str, np.ndarray] | None = None
        self._names: dict[str, Any] | None = None

    def summary(self) -> str:
        """The summary `autopar autoparallelize` prints."""
        return self._native.summary()

    def __repr__(self) -> str:
        return f"<autopar.Plan of {self.model} on mesh {self.mesh}>"

    @property
    def mesh(self) -> list[int]:
        """The device mesh's axis sizes."""
        return list(self._json["mesh"]["shape"]) if "shape" in self._json.get("mesh", {}) else self._json.get("mesh")

    @property
    def estimate(self) -> dict[str, Any]:
        """The cost model's estimate of a step (seconds, memory per device, ...), as plan.json has it."""
        return self._json["estimate"]

    def strategies(self) -> dict[str, Any]:
        """The layout chosen for each parameter (ONNX initializer name -> its sharding)."""
        return self._json.get("params", self._json.get("layouts", {}))

    def to_json(self) -> str:
        """The plan as `plan.json` holds it."""
        return self._native.to_json()

    def save(self, path: str | os.PathLike) -> None:
        """Writes `plan.json` (for `autopar run PATH`)."""
        Path(path).write_text(self._native.to_json())

    def to_html(self, path: str | os.PathLike) -> None:
        """Writes the page of `autopar explain PLAN --html PATH`."""
        Path(path).write_text(self._native.html())

    def train(self, data: Iterable[Mapping[str, Any]], steps: int | None = None, backend: str = "threads",
              **opts: Any) -> list[dict[str, Any]]:
        """Trains `steps` steps on the plan as `autopar run` does, one batch of `data` per step
        (an iterable of dicts input name -> numpy array or torch tensor holding the global
        batch: a `DataLoader` works). Returns each step's metrics (`step`, `loss`, `seconds`,
        ...); shows a progress bar on a terminal when tqdm is installed. Other keywords are
        `autopar run` flags (`threads_per_rank=2`, `accumulate="f64"`). The trained parameters
        are then `state_dict()`."""
        batches: list[Mapping[str, Any]] = []
        for b in data:
            if steps is not None and len(batches) == steps:
                break
            batches.append(b)
        if not batches:
            raise _autopar.ArgumentError("data: no batches")
        if steps is None:
            steps = len(batches)
        elif len(batches) < steps:
            raise _autopar.ArgumentError(f"data: {len(batches)} batches for {steps} steps")
        tmp = Path(tempfile.mkdtemp(prefix="autopar-"))
        try:
            (tmp / "plan.json").write_text(self._native.to_json())
            args = [str(tmp / "plan.json"), "--steps", str(steps), "--backend", backend, "--model", self.model,
                    "--save", str(tmp / "out"), "--no-shuffle"]
            for name in batches[0]:
                arrays = [_numpy(b[name]) for b in batches]
                if len({a.shape for a in arrays}) > 1:
                    raise _autopar.RunError(f"--data {name}: the batches' shapes differ")
                np.save(tmp / f"{name}.npy", np.concatenate(arrays))
                args += ["--data", f"{name}={tmp / f'{name}.npy'}"]
            args += _opts_args(opts)
            metrics: list[dict[str, Any]] = []
            bar = _bar(steps)

            def on_step(m: dict[str, Any]) -> None:
                metrics.append(m)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{m['loss']:.4f}")

            try:
                _autopar.run(args, on_step)
            finally:
                if bar is not None:
                    bar.close()
            npz = np.load(tmp / "out" / "params.npz")
            self._params = {k: npz[k] for k in npz.files}
            names = tmp / "out" / "names.json"
            self._names = json.loads(names.read_text()) if names.exists() else None
            return metrics
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def parameters(self) -> dict[str, np.ndarray]:
        """The trained parameters under their ONNX initializer names (after `train`)."""
        if self._params is None:
            raise _autopar.RunError("the plan has not been trained: call train() first")
        return dict(self._params)

    def state_dict(self) -> dict[str, Any]:
        """The trained parameters under the module's own parameter names (names.json: transposed
        back where the exporter transposed), as torch tensors (numpy arrays without torch), for
        `module.load_state_dict(plan.state_dict(), strict=False)`."""
        params = self.parameters()
        try:
            import torch
        except ImportError:
            torch = None
        out: dict[str, Any] = {}
        names = (self._names or {}).get("params", {n: [{"name": n, "transposed": False}] for n in params})
        for onnx_name, torch_names in names.items():
            for n in torch_names:
                x = params[onnx_name]
                x = np.ascontiguousarray(x.T) if n["transposed"] else x
                out[n["name"]] = torch.from_numpy(x.copy()) if torch is not None else x
        return out

