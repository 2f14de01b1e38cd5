#!/usr/bin/env python3
"""Writes the ONNX fuzz seeds that exercise import-time folding and the dynamo exporter's forms
(tests/data/fuzz/onnx/fold_bitshift_constant.onnx, function_sequence_int32.onnx). Run by hand
in a venv with `onnx` and `numpy` (e.g. the zoo venv of scripts/zoo/README.md), from the
repository root: python scripts/fuzz-seeds.py"""

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper as h

OUT = "tests/data/fuzz/onnx"


def const(name, array):
    return h.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(array, name))


def save(graph, path, opsets, functions=()):
    m = h.make_model(graph, opset_imports=opsets, functions=list(functions), producer_name="autopar-fuzz-seed")
    m.ir_version = 8
    onnx.checker.check_model(m)
    onnx.save(m, f"{OUT}/{path}")


# An op autopar has no kernel for (BitShift) on constants: folded through tract at import.
nodes = [
    const("c", np.array([[1, 2, 3], [4, 5, 6]], dtype=np.uint8)),
    const("k", np.array([1], dtype=np.uint8)),
    h.make_node("BitShift", ["c", "k"], ["b"], direction="LEFT"),
    h.make_node("Cast", ["b"], ["bf"], to=T.FLOAT),
    h.make_node("Trilu", ["bf"], ["t"], upper=0),
    h.make_node("Add", ["x", "t"], ["y"]),
]
x = h.make_tensor_value_info("x", T.FLOAT, [2, 3])
y = h.make_tensor_value_info("y", T.FLOAT, [2, 3])
save(h.make_graph(nodes, "fold", [x], [y]), "fold_bitshift_constant.onnx", [h.make_opsetid("", 17)])

# A local function, static tensor sequences and an int32 input (what the dynamo exporter writes).
body = [h.make_node("Mul", ["a", "b"], ["m"]), h.make_node("Add", ["m", "a"], ["o"])]
fn = h.make_function("local", "scale_add", ["a", "b"], ["o"], body, [h.make_opsetid("", 17)])
nodes = [
    h.make_node("Cast", ["ids"], ["idf"], to=T.FLOAT),
    h.make_node("scale_add", ["x", "idf"], ["s"], domain="local"),
    h.make_node("SplitToSequence", ["s"], ["seq"], axis=1, keepdims=1),
    const("i1", np.array(1, dtype=np.int64)),
    h.make_node("SequenceAt", ["seq", "i1"], ["e"]),
    h.make_node("ConcatFromSequence", ["seq"], ["cat"], axis=1),
    h.make_node("Add", ["cat", "e"], ["y"]),
]
ids = h.make_tensor_value_info("ids", T.INT32, [2, 3])
save(
    h.make_graph(nodes, "dyn", [x, ids], [y]),
    "function_sequence_int32.onnx",
    [h.make_opsetid("", 17), h.make_opsetid("local", 1)],
    [fn],
)
