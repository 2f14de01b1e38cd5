#!/usr/bin/env python3
"""onnxruntime references for LSTM, GRU and RNN: tests/data/recurrent/<case>/.

The ONNX node suite has 12 recurrent cases, all forward, without clip, custom activations,
input_forget or bidirectional runs. This script writes one-node models that cover the rest of
the attribute space (every direction, layout 0 and 1, clip, activations with alpha/beta,
input_forget, peepholes, linear_before_reset, initial states, biases absent or present,
sequence_lens with sequences of different lengths, subsets of the outputs), with onnxruntime's
outputs for random inputs. `recurrent_onnxruntime_references` in `tests/tests/onnx_node.rs`
imports each model, runs it on autopar's
interpreter in f32 and f64 and compares.

Each case folder holds `model.onnx` (weights, biases, peepholes and sequence_lens are
initializers; X and the initial states are graph inputs) and `test_data_set_0/input_N.pb`,
`output_N.pb` as the ONNX node suite lays them out.

Before writing, every onnxruntime output is checked against a plain numpy implementation of the
operator written here from the ONNX operator docs, so a case records behaviour two independent
implementations agree on. Where the docs leave a choice open, onnxruntime's is the one recorded
(and autopar's): `clip` bounds the inputs of the gate activations but not the cell state fed to
LSTM's `h`; activation_alpha/beta are consumed in the order of the functions that take them;
`input_forget` sets f = 1 - i.

Needs numpy, onnx and onnxruntime (the zoo venv). Usage, from the repository root:
    python scripts/recurrent-refs.py [--out tests/data/recurrent]
"""

import argparse
import os
import shutil

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

OPSET = 14


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def act_fn(name, alphas, betas):
    """The activation `name`, taking its alpha/beta from the front of the lists."""
    n = name.lower()
    take = lambda lst, default: lst.pop(0) if lst else default  # noqa: E731
    if n == "tanh":
        return np.tanh
    if n == "sigmoid":
        return sigmoid
    if n == "relu":
        return lambda x: np.maximum(x, 0)
    if n == "softsign":
        return lambda x: x / (1 + np.abs(x))
    if n == "softplus":
        return lambda x: np.logaddexp(0, x)
    if n == "leakyrelu":
        a = take(alphas, 0.01)
        return lambda x: np.where(x >= 0, x, a * x)
    if n == "thresholdedrelu":
        a = take(alphas, 1.0)
        return lambda x: np.where(x > a, x, 0)
    if n == "elu":
        a = take(alphas, 1.0)
        return lambda x: np.where(x >= 0, x, a * (np.exp(np.minimum(x, 0)) - 1))
    if n == "hardsigmoid":
        a, b = take(alphas, 0.2), take(betas, 0.5)
        return lambda x: np.clip(a * x + b, 0, 1)
    if n == "affine":
        a, b = alphas.pop(0), betas.pop(0)
        return lambda x: a * x + b
    if n == "scaledtanh":
        a, b = alphas.pop(0), betas.pop(0)
        return lambda x: a * np.tanh(b * x)
    raise ValueError(name)


def reference(op, attrs, X, W, R, B=None, lens=None, h0=None, c0=None, P=None):
    """The operator in float64 numpy, from the ONNX docs (see the module doc for the choices)."""
    X, W, R = (a.astype(np.float64) for a in (X, W, R))
    layout = attrs.get("layout", 0)
    if layout:
        X = X.transpose(1, 0, 2)
        h0 = None if h0 is None else h0.transpose(1, 0, 2)
        c0 = None if c0 is None else c0.transpose(1, 0, 2)
    T, Bn, _ = X.shape
    D, GH, H = R.shape
    per_dir = {"RNN": 1, "GRU": 2, "LSTM": 3}[op]
    defaults = {"RNN": ["Tanh"], "GRU": ["Sigmoid", "Tanh"], "LSTM": ["Sigmoid", "Tanh", "Tanh"]}[op]
    names = attrs.get("activations", defaults * D)
    alphas, betas = list(attrs.get("activation_alpha", [])), list(attrs.get("activation_beta", []))
    fns = [act_fn(nm, alphas, betas) for nm in names]
    clip = attrs.get("clip")
    cl = (lambda v: np.clip(v, -clip, clip)) if clip is not None else (lambda v: v)
    B = np.zeros((D, 2 * GH)) if B is None else B.astype(np.float64)
    h0 = np.zeros((D, Bn, H)) if h0 is None else h0.astype(np.float64)
    c0 = np.zeros((D, Bn, H)) if c0 is None else c0.astype(np.float64)
    P = np.zeros((D, 3 * H)) if P is None else P.astype(np.float64)
    lens = np.full(Bn, T) if lens is None else lens
    direction = attrs.get("direction", "forward")
    Y = np.zeros((T, D, Bn, H))
    Yh, Yc = np.zeros((D, Bn, H)), np.zeros((D, Bn, H))
    for d in range(D):
        f = fns[d * per_dir : (d + 1) * per_dir]
        reverse = d == 1 or direction == "reverse"
        Wb, Rb = B[d, :GH], B[d, GH:]
        for b in range(Bn):
            h, c = h0[d, b], c0[d, b]
            L = lens[b]
            steps = range(L - 1, -1, -1) if reverse else range(L)
            for t in steps:
                x = X[t, b]
                if op == "RNN":
                    h = f[0](cl(W[d] @ x + R[d] @ h + Wb + Rb))
                elif op == "GRU":
                    xw = W[d] @ x + Wb
                    z = f[0](cl(xw[:H] + R[d][:H] @ h + Rb[:H]))
                    r = f[0](cl(xw[H : 2 * H] + R[d][H : 2 * H] @ h + Rb[H : 2 * H]))
                    if attrs.get("linear_before_reset", 0):
                        hh = f[1](cl(xw[2 * H :] + r * (R[d][2 * H :] @ h + Rb[2 * H :])))
                    else:
                        hh = f[1](cl(xw[2 * H :] + R[d][2 * H :] @ (r * h) + Rb[2 * H :]))
                    h = (1 - z) * hh + z * h
                else:
                    g = W[d] @ x + R[d] @ h + Wb + Rb
                    pi, po, pf = P[d, :H], P[d, H : 2 * H], P[d, 2 * H :]
                    i = f[0](cl(g[:H] + pi * c))
                    if attrs.get("input_forget", 0):
                        fg = 1 - i
                    else:
                        fg = f[0](cl(g[2 * H : 3 * H] + pf * c))
                    c = fg * c + i * f[1](cl(g[3 * H :]))
                    o = f[0](cl(g[H : 2 * H] + po * c))
                    h = o * f[2](c)
                Y[t, d, b] = h
            Yh[d, b], Yc[d, b] = h, c
    if layout:
        Y, Yh, Yc = Y.transpose(2, 0, 1, 3), Yh.transpose(1, 0, 2), Yc.transpose(1, 0, 2)
    return [Y, Yh, Yc]


# name, op, attributes, (seq, batch, input, hidden), operands present, outputs present
CASES = [
    ("lstm_bidirectional_peepholes", "LSTM", {"direction": "bidirectional"}, (4, 3, 3, 4),
     {"B", "h0", "c0", "P"}, (1, 1, 1)),
    ("lstm_reverse_batchwise_clip_input_forget", "LSTM",
     {"direction": "reverse", "layout": 1, "clip": 0.6, "input_forget": 1}, (5, 2, 3, 3),
     {"B", "h0", "P"}, (0, 0, 1)),
    ("lstm_activations_sequence_lens", "LSTM",
     {"direction": "bidirectional",
      "activations": ["HardSigmoid", "LeakyRelu", "Softsign", "Sigmoid", "Elu", "Softplus"],
      "activation_alpha": [0.3, 0.2, 0.7], "activation_beta": [0.4]}, (4, 3, 2, 3),
     {"B", "lens", "c0"}, (1, 1, 1)),
    ("lstm_no_bias_batchwise", "LSTM", {"layout": 1}, (3, 2, 4, 5), set(), (1, 0, 1)),
    ("gru_bidirectional_batchwise_linear_before_reset", "GRU",
     {"direction": "bidirectional", "layout": 1, "linear_before_reset": 1}, (4, 3, 3, 4),
     {"B", "h0"}, (1, 1, 0)),
    ("gru_reverse_clip_activations_sequence_lens", "GRU",
     {"direction": "reverse", "clip": 0.8, "activations": ["Sigmoid", "Affine"],
      "activation_alpha": [0.5], "activation_beta": [0.1]}, (5, 3, 2, 3),
     {"B", "lens", "h0"}, (1, 1, 0)),
    ("gru_linear_before_reset_no_bias_sequence_lens", "GRU",
     {"direction": "bidirectional", "linear_before_reset": 1}, (4, 2, 3, 3),
     {"lens"}, (1, 1, 0)),
    ("gru_forward_initial_bias", "GRU", {}, (3, 2, 3, 5), {"B", "h0"}, (0, 1, 0)),
    ("rnn_bidirectional_batchwise_relu", "RNN",
     {"direction": "bidirectional", "layout": 1, "activations": ["Relu", "Tanh"]}, (4, 3, 3, 4),
     {"B", "h0"}, (1, 1, 0)),
    ("rnn_reverse_scaledtanh_clip_sequence_lens", "RNN",
     {"direction": "reverse", "clip": 0.9, "activations": ["ScaledTanh"],
      "activation_alpha": [1.5], "activation_beta": [0.7]}, (5, 3, 2, 3),
     {"B", "lens"}, (1, 1, 0)),
]

LENS = {3: [4, 1, 3], 2: [2, 4]}


def run_ort(model, feeds, layout):
    """onnxruntime's outputs. It refuses layout=1, so a batch-major model runs as its layout-0
    twin on transposed inputs, with the outputs transposed back."""
    if layout:
        model = onnx.ModelProto.FromString(model.SerializeToString())
        node = model.graph.node[0]
        for a in node.attribute:
            if a.name == "layout":
                a.i = 0
        for vi in list(model.graph.input) + list(model.graph.output):
            dims = vi.type.tensor_type.shape.dim
            perm = [1, 0, 2] if len(dims) == 3 else [1, 2, 0, 3]
            vals = [dims[k].dim_value for k in perm]
            for d, v in zip(dims, vals):
                d.dim_value = v
        feeds = {k: v.transpose(1, 0, 2) for k, v in feeds.items()}
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, feeds)
    if layout:
        got = [g.transpose(1, 0, 2) if g.ndim == 3 else g.transpose(2, 0, 1, 3) for g in got]
    return got


def make_case(out_dir, name, op, attrs, dims, present, outputs, rng):
    T, Bn, I, H = dims
    D = 2 if attrs.get("direction") == "bidirectional" else 1
    G = {"RNN": 1, "GRU": 3, "LSTM": 4}[op]
    layout = attrs.get("layout", 0)
    f32 = lambda *s: rng.uniform(-1, 1, size=s).astype(np.float32)  # noqa: E731
    X = f32(Bn, T, I) * 2 if layout else f32(T, Bn, I) * 2
    W, R = f32(D, G * H, I), f32(D, G * H, H)
    state = (Bn, D, H) if layout else (D, Bn, H)
    ops = {
        "B": f32(D, 2 * G * H),
        "lens": np.array((LENS[Bn] if T >= 4 else [T] * Bn)[:Bn], dtype=np.int32),
        "h0": f32(*state),
        "c0": f32(*state),
        "P": f32(D, 3 * H),
    }
    slots = ["X", "W", "R", "B", "lens", "h0", "c0", "P"][: 8 if op == "LSTM" else 6]
    node_inputs, graph_inputs, feeds, inits = [], [], {}, []
    for s in slots:
        if s in ("X", "h0", "c0") and (s == "X" or s in present):
            arr = X if s == "X" else ops[s]
            node_inputs.append(s)
            graph_inputs.append(helper.make_tensor_value_info(s, TensorProto.FLOAT, arr.shape))
            feeds[s] = arr
        elif s in ("W", "R") or s in present:
            arr = {"W": W, "R": R}.get(s, ops.get(s))
            node_inputs.append(s)
            inits.append(numpy_helper.from_array(arr, s))
        else:
            node_inputs.append("")
    while node_inputs and node_inputs[-1] == "":
        node_inputs.pop()
    out_names = [nm if want else "" for nm, want in zip(["Y", "Y_h", "Y_c"], outputs)]
    if op != "LSTM":
        out_names = out_names[:2]
    while out_names and out_names[-1] == "":
        out_names.pop()
    node = helper.make_node(op, node_inputs, out_names, name=name, hidden_size=H, **attrs)
    want = reference(op, attrs, X, W, R,
                     B=ops["B"] if "B" in present else None,
                     lens=ops["lens"] if "lens" in present else None,
                     h0=ops["h0"] if "h0" in present else None,
                     c0=ops["c0"] if "c0" in present else None,
                     P=ops["P"] if "P" in present else None)
    want = [w for w, o in zip(want, out_names) if o]
    graph_outputs = [
        helper.make_tensor_value_info(o, TensorProto.FLOAT, w.shape) for o, w in zip([o for o in out_names if o], want)
    ]
    graph = helper.make_graph([node], name, graph_inputs, graph_outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    got = run_ort(model, feeds, layout)

    for o, g, w in zip([o for o in out_names if o], got, want):
        err = np.abs(g - w).max()
        assert g.shape == w.shape, (name, o, g.shape, w.shape)
        assert err < 1e-5, f"{name}: onnxruntime and the numpy reference differ on {o} by {err}"

    case = os.path.join(out_dir, f"test_{name}")
    data = os.path.join(case, "test_data_set_0")
    os.makedirs(data)
    onnx.save(model, os.path.join(case, "model.onnx"))
    for k, vi in enumerate(graph_inputs):
        t = numpy_helper.from_array(feeds[vi.name], vi.name)
        with open(os.path.join(data, f"input_{k}.pb"), "wb") as fh:
            fh.write(t.SerializeToString())
    for k, (o, g) in enumerate(zip([o for o in out_names if o], got)):
        with open(os.path.join(data, f"output_{k}.pb"), "wb") as fh:
            fh.write(numpy_helper.from_array(g, o).SerializeToString())
    print(f"{name}: outputs {[o for o in out_names if o]}, onnxruntime = numpy reference")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/data/recurrent")
    args = ap.parse_args()
    for e in os.listdir(args.out) if os.path.isdir(args.out) else []:
        if e.startswith("test_"):
            shutil.rmtree(os.path.join(args.out, e))
    os.makedirs(args.out, exist_ok=True)
    for k, (name, op, attrs, dims, present, outputs) in enumerate(CASES):
        make_case(args.out, name, op, attrs, dims, present, outputs, np.random.default_rng(100 + k))
    print(f"onnxruntime {ort.__version__}, onnx {onnx.__version__}")


if __name__ == "__main__":
    main()
