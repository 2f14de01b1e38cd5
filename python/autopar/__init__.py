"""autopar from Python: parallelise a PyTorch module or an ONNX model over a device mesh, train it
on the plan, and hand the weights back.

    plan = autopar.autoparallelize(model, {"input_ids": ids}, mesh="2x2", memory="16GiB")
    losses = [m["loss"] for m in plan.train(batches, steps=5)]
    model.load_state_dict(plan.state_dict(), strict=False)

The package calls the CLI's library in-process (no subprocess): `plan_onnx` is
`autopar autoparallelize`, `Plan.train` is `autopar run`, and errors carry the CLI's one-line
messages as `autopar.Error` subclasses."""

from __future__ import annotations

from ._autopar import ArgumentError, Error, ModelError, PlanError, RunError
from ._plan import Plan, plan_onnx
from ._torch import autoparallelize, export_onnx

__all__ = [
    "ArgumentError",
    "Error",
    "ModelError",
    "Plan",
    "PlanError",
    "RunError",
    "autoparallelize",
    "export_onnx",
    "plan_onnx",
]
