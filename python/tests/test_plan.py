"""plan_onnx without torch and the errors of each kind, against the CLI's messages."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import autopar

ROOT = Path(__file__).resolve().parents[2]
MLP = ROOT / "tests" / "data" / "models" / "mlp.onnx"


def test_plan_onnx_needs_no_torch(tmp_path):
    # A fresh interpreter in which importing torch fails.
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import autopar\n"
        f"p = autopar.plan_onnx({str(MLP)!r}, mesh='2x2', memory='16GiB')\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        f"p.save({str(tmp_path / 'plan.json')!r}); p.to_html({str(tmp_path / 'plan.html')!r})\n"
        "print(p.summary())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "plan.json").stat().st_size > 0
    assert "<html" in (tmp_path / "plan.html").read_text().lower()
    assert out.stdout.strip()


def test_plan_has_estimate_and_strategies():
    p = autopar.plan_onnx(MLP, mesh="2x2", memory="16GiB")
    assert p.estimate
    assert p.strategies()


def test_unknown_mesh_raises_the_cli_message():
    # `autopar autoparallelize mlp.onnx --mesh 2y2 --memory 16GiB` prints this after `error: `.
    with pytest.raises(autopar.PlanError) as e:
        autopar.plan_onnx(MLP, mesh="2y2", memory="16GiB")
    assert str(e.value) == (
        "invalid mesh `2y2`: `2y2` is not an axis size (write 2x4, or name the axes: data=2,tensor=4)"
    )
    assert isinstance(e.value, autopar.Error)


def test_bad_flag_value_raises_argument_error():
    with pytest.raises(autopar.ArgumentError) as e:
        autopar.plan_onnx(MLP, mesh="2x2", memory="lots")
    assert str(e.value).startswith("--memory lots: ")


def test_memory_that_fits_no_plan_raises_plan_error():
    with pytest.raises(autopar.PlanError) as e:
        autopar.plan_onnx(MLP, mesh="2x2", memory="1KiB")
    # The CLI's line (`--memory 1KiB`).
    # (the rest depends on how far the solver got within --time-limit)
    assert str(e.value).startswith("no plan fits 1.00 KiB per rank: the smallest peak ")


def test_unsupported_op_raises_model_error(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    node = helper.make_node("Unique", ["x"], ["y"])
    g = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None])],
    )
    path = tmp_path / "unique.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    with pytest.raises(autopar.ModelError) as e:
        autopar.plan_onnx(path, mesh="2x2", memory="16GiB")
    assert "Unique" in str(e.value)


def test_wrong_input_shape_raises_run_error():
    p = autopar.plan_onnx(MLP, mesh="2x2", memory="16GiB")
    with pytest.raises(autopar.RunError) as e:
        p.train([{"x": np.zeros((3, 3), np.float32), "y_target": np.zeros((32, 256), np.float32)}], steps=1)
    assert str(e.value)


def cli_error(args):
    """The CLI's own `error: ` line for `autopar ARGS` (the binary `AUTOPAR`, default the debug
    build in CARGO_TARGET_DIR). Skipped when no binary was built, but never on CI."""
    import os

    target = os.environ.get("CARGO_TARGET_DIR", str(ROOT / "target"))
    exe = Path(os.environ.get("AUTOPAR", Path(target) / "debug" / "autopar"))
    if not exe.exists():
        if os.environ.get("CI") == "true":
            raise AssertionError(f"{exe}: no CLI binary to compare the messages with")
        pytest.skip(f"{exe} not built")
    out = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True)
    assert out.returncode != 0
    return [line for line in out.stderr.splitlines() if line.startswith("error: ")][-1][len("error: "):]


@pytest.mark.parametrize("kind", ["mesh", "memory", "op"])
def test_errors_carry_the_cli_message(kind, tmp_path):
    """Each kind of bad argument: the exception's text is the CLI's line, word for word."""
    model, mesh, memory = MLP, "2x2", "16GiB"
    if kind == "mesh":
        mesh = "2y2"
    elif kind == "memory":
        memory = "1KiB"
    else:
        import onnx
        from onnx import TensorProto, helper

        g = helper.make_graph(
            [helper.make_node("Unique", ["x"], ["y"])], "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None])],
        )
        model = tmp_path / "unique.onnx"
        onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), model)
    with pytest.raises(autopar.Error) as e:
        autopar.plan_onnx(model, mesh=mesh, memory=memory)
    assert str(e.value) == cli_error(["autoparallelize", model, "--mesh", mesh, "--memory", memory])
