#!/usr/bin/env python3
"""What autopar does with each zoo model today: writes scripts/zoo/STATUS.md and status.json.

For every model of tests/data/zoo/manifest.json it lists the ONNX ops (domain:op, opset), the ops,
dtypes and attribute forms autopar does not support yet (against `autopar inspect --ops` and the
importer's documented limits), and runs the pipeline of issue 16's acceptance with the autopar
binary: inspect -> infer (= PyTorch's outputs) -> train 3 SGD steps (= PyTorch's losses) -> plan
2x2 -> run the plan 3 steps (= train). The first failing stage's exact one-line error is recorded.

It then folds every node whose inputs are all constants (Constant nodes, non-float initializers,
shapes of static tensors; evaluated with onnx.reference) into Constant nodes and runs the pipeline
again on that copy: what an import-time constant folder (issue 16, item 3) would leave to do.

Needs only onnx and numpy (the zoo venv has them). Usage, from the repository root:
    python scripts/zoo/status.py [--autopar target/debug/autopar] [--only NAME,...]
"""

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import warnings

import numpy as np
import onnx
from onnx import helper, numpy_helper, shape_inference
from onnx.reference import ReferenceEvaluator

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
ZOO = os.path.join(ROOT, "tests", "data", "zoo")
HERE = os.path.dirname(os.path.abspath(__file__))
warnings.filterwarnings("ignore")  # onnx.reference: log(0) and casts of -inf in folded mask arithmetic
OK_DTYPES = {"float32", "int64", "bool"}  # autopar's element types (f64 only internally)
# Stored tensors (Constant values, initializers) are also read as f64 (-> f32) and int32 (-> i64).
STORED_OK = OK_DTYPES | {"float64", "int32"}
TOL_INFER = 1e-4
TOL_TRAIN = 1e-4
TOL_RUN = 1e-5
MULTI_OUTPUT_OK = {"Split", "Dropout", "LayerNormalization"}  # ops whose extra outputs autopar computes


def dtype_of(code):
    return helper.tensor_dtype_to_np_dtype(code).name if code else "undefined"


def sh(cmd, timeout=600):
    """Run a command; (exit code, stdout, stderr) with a timeout as code -9."""
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout, p.stderr, time.time() - t0
    except subprocess.TimeoutExpired as e:
        return -9, e.stdout or "", f"timed out after {timeout} s", time.time() - t0


def first_error(code, err):
    """The one-line error (or a panic's location and message) of a failed run."""
    lines = [x.strip() for x in err.splitlines() if x.strip()]
    for x in lines:
        if x.startswith("error:"):
            return x
    for i, x in enumerate(lines):
        if "panicked" in x:
            x = re.sub(r"thread '([^']*)' \(\d+\)", r"thread '\1'", x)
            return f"{x} {lines[i + 1]}" if i + 1 < len(lines) else x
    return (lines[0] if lines else f"exit code {code}").strip()


# --------------------------------------------------------------------------------------------
# Static analysis
# --------------------------------------------------------------------------------------------


def supported_ops(autopar):
    code, out, err, _ = sh([autopar, "inspect", "--ops"])
    if code != 0:
        sys.exit(f"error: {autopar} inspect --ops failed: {first_error(code, err)}")
    ops = set()
    for line in out.splitlines()[1:]:
        ops.update(x.strip() for x in line.split(",") if x.strip())
    return ops


def analyse(model, supported):
    """Unsupported ops, dtypes and attribute forms of a model (static: the importer stops at the first)."""
    opset = {o.domain or "ai.onnx": o.version for o in model.opset_import}
    inferred = shape_inference.infer_shapes(model)
    seqs = {v.name for v in inferred.graph.value_info if v.type.HasField("sequence_type")}
    ops = collections.Counter()
    unsupported = collections.Counter()
    dtypes = collections.defaultdict(list)  # dtype -> where
    forms = collections.defaultdict(list)  # description -> node names
    used = collections.Counter(x for n in model.graph.node for x in n.input if x)
    used.update(o.name for o in model.graph.output)
    for n in model.graph.node:
        dom = n.domain or "ai.onnx"
        key = f"{dom}:{n.op_type}"
        ops[key] += 1
        if dom != "ai.onnx" or n.op_type not in supported:
            unsupported[key] += 1
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        # Values computed in the graph get their type from a Cast (or an input); stored tensors
        # are converted on import when autopar can read them.
        if any(o in seqs for o in n.output):
            dtypes["sequence (tensor list)"].append(f"{n.op_type} {n.name}")
        if n.op_type == "Cast" and dtype_of(attrs.get("to", 1)) not in OK_DTYPES:
            dtypes[dtype_of(attrs["to"])].append(f"Cast {n.name}")
        if n.op_type == "Constant" and "value" in attrs and dtype_of(attrs["value"].data_type) not in STORED_OK:
            dtypes[dtype_of(attrs["value"].data_type)].append(f"Constant {n.name}")
        if n.op_type in ("Conv", "ConvTranspose", "MaxPool", "AveragePool"):
            k = attrs.get("kernel_shape")
            if k is None and n.op_type in ("Conv", "ConvTranspose"):
                w = next((i for i in model.graph.initializer if i.name == n.input[1]), None)
                k = list(w.dims[2:]) if w is not None else None
            if k is not None and len(k) != 2:
                forms[f"{len(k)}-D {n.op_type}"].append(n.name)
        if n.op_type == "Pad" and attrs.get("mode", b"constant") not in (b"constant", "constant"):
            forms[f"Pad mode={attrs['mode'].decode()}"].append(n.name)
        if n.op_type == "Gelu" and attrs.get("approximate", b"none") not in (b"none", b"tanh"):
            forms[f"Gelu approximate={attrs['approximate']}"].append(n.name)
        if n.op_type == "Constant" and not ({"value", "value_float", "value_floats", "value_int", "value_ints"} & set(attrs)):
            forms[f"Constant with {', '.join(attrs)}"].append(n.name)
        if n.op_type not in MULTI_OUTPUT_OK and any(used[o] for o in n.output[1:] if o):
            forms[f"{n.op_type} with a used output beyond the first"].append(n.name)
        if n.op_type == "Dropout" and len(n.input) > 2 and n.input[1]:
            pass  # ratio 0 in the zoo: training-mode Dropout that drops nothing is supported
    for v in list(model.graph.input) + list(model.graph.output):
        t = dtype_of(v.type.tensor_type.elem_type)
        if t not in OK_DTYPES:
            dtypes[t].append(f"graph input/output {v.name}")
    for i in model.graph.initializer:
        t = dtype_of(i.data_type)
        if t not in STORED_OK:
            dtypes[t].append(f"initializer {i.name}")
    return {
        "opset": opset,
        "ops": dict(sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))),
        "unsupported_ops": dict(sorted(unsupported.items(), key=lambda kv: (-kv[1], kv[0]))),
        "unsupported_dtypes": {k: {"count": len(v), "first": v[:3]} for k, v in sorted(dtypes.items())},
        "unsupported_forms": {k: {"count": len(v), "first": v[:2]} for k, v in sorted(forms.items())},
    }


# --------------------------------------------------------------------------------------------
# Constant folding probe
# --------------------------------------------------------------------------------------------

NONDETERMINISTIC = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
                    "Bernoulli", "Dropout"}


def fold(model, feeds=None):
    """A copy of model in which every node computable from constants alone is a Constant.

    With feeds (graph input -> array), the inputs count as constants too: every value that does
    not depend on a parameter (masks, positions) is folded for these inputs. Passes repeat until
    nothing changes: a folded value can make a shape static (Pad's pads), which lets the next
    pass fold the Shape nodes reading it."""
    total = 0
    for _ in range(20):
        model, n = fold_pass(model, feeds or {})
        total += n
        if n == 0:
            break
    return model, total


def fold_pass(model, feeds):
    inferred = shape_inference.infer_shapes(model)
    shapes = {}
    for v in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
        dims = v.type.tensor_type.shape.dim
        if v.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
            shapes[v.name] = [d.dim_value for d in dims]
    for i in model.graph.initializer:
        shapes[i.name] = list(i.dims)
    known = dict(feeds)
    for i in model.graph.initializer:
        if i.data_type != onnx.TensorProto.FLOAT:  # non-float initializers cannot be trained
            known[i.name] = numpy_helper.to_array(i)
    opsets = list(model.opset_import)
    kept, folded = [], 0
    for n in model.graph.node:
        ins = [x for x in n.input if x]
        value = None
        if n.op_type == "Constant":
            value = [ReferenceEvaluator(helper.make_model(helper.make_graph([n], "c", [], [
                helper.make_tensor_value_info(n.output[0], onnx.TensorProto.UNDEFINED, None)]),
                opset_imports=opsets)).run(None, {})[0]]
        elif n.op_type in ("Shape", "Size") and n.input[0] in shapes and n.input[0] not in known:
            s = shapes[n.input[0]]
            if n.op_type == "Size":
                value = [np.array(int(np.prod(s)), dtype=np.int64)]
            else:
                a = {x.name: x.i for x in n.attribute}
                r = len(s)
                st, en = a.get("start", 0), a.get("end", r)
                st, en = (st + r if st < 0 else st), (en + r if en < 0 else en)
                value = [np.array(s[max(0, min(st, r)):max(0, min(en, r))], dtype=np.int64)]
        elif ins and all(x in known for x in ins) and n.op_type not in NONDETERMINISTIC and \
                (n.domain or "ai.onnx") == "ai.onnx":
            g = helper.make_graph(
                [n], "f",
                [helper.make_tensor_value_info(x, helper.np_dtype_to_tensor_dtype(known[x].dtype),
                                               known[x].shape) for x in dict.fromkeys(ins)],
                [helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None) for o in n.output if o])
            try:
                value = ReferenceEvaluator(helper.make_model(g, opset_imports=opsets)).run(
                    None, {x: known[x] for x in dict.fromkeys(ins)})
            except Exception:  # noqa: BLE001 -- an op the reference cannot run stays a node
                value = None
        if value is None:
            kept.append(n)
            continue
        if n.op_type != "Constant" and not n.name.startswith("folded:"):
            folded += 1
        for o, v in zip([o for o in n.output if o], value):
            known[o] = np.asarray(v)
            shapes[o] = list(np.asarray(v).shape)
    needed = collections.Counter(x for n in kept for x in n.input if x)
    needed.update(o.name for o in model.graph.output)
    inits = {i.name for i in model.graph.initializer}
    consts = []
    for name, v in known.items():
        if needed[name] and name not in inits and name not in feeds:
            consts.append(helper.make_node("Constant", [], [name], name=f"folded:{name}",
                                           value=numpy_helper.from_array(v, name)))
    g = helper.make_graph(consts + kept, model.graph.name, list(model.graph.input), list(model.graph.output),
                          [i for i in model.graph.initializer if needed[i.name]])
    out = helper.make_model(g, opset_imports=opsets, ir_version=model.ir_version,
                            producer_name=model.producer_name, producer_version=model.producer_version)
    out.functions.extend(model.functions)
    return out, folded


# --------------------------------------------------------------------------------------------
# The pipeline
# --------------------------------------------------------------------------------------------


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    s = np.abs(b).max()
    return float(np.abs(a - b).max() / s) if s > 0 else float(np.abs(a - b).max())


def json_lines(out):
    rows = []
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows


def pipeline(autopar, path, entry, d, work, shown):
    """inspect -> infer -> train -> plan 2x2 -> run; every stage's verdict, stopping at the first failure.

    Errors name the model file as `shown` (no temporary or machine-specific paths)."""
    stages = pipeline_stages(autopar, path, entry, d, work)
    for v in stages.values():
        if v.get("error"):
            v["error"] = v["error"].replace(path, shown).replace(d + "/", "")
    return stages


def pipeline_stages(autopar, path, entry, d, work):
    lj = json.load(open(os.path.join(d, "losses.json")))
    feeds = []
    for k, f in lj["feeds"].items():
        feeds += ["--feed", f"{k}={os.path.join(d, f)}"]
    stages = collections.OrderedDict()

    code, out, err, dt = sh([autopar, "inspect", path])
    if code != 0:
        stages["inspect"] = {"ok": False, "error": first_error(code, err), "exit": code}
        return stages
    m = re.search(r"params\s+\S+ \((\d+) parameters in (\d+) tensors", out)
    stages["inspect"] = {"ok": True, "seconds": round(dt, 2),
                         "params": int(m.group(1)) if m else None, "tensors": int(m.group(2)) if m else None}

    outdir = os.path.join(work, "infer")
    expect = []
    for o in entry["outputs"]:
        expect += ["--expect", f"{o['name']}={os.path.join(d, o['name'] + '.npy')}"]
    infer_feeds = []
    for k in entry["inputs"]:
        infer_feeds += ["--feed", f"{k['name']}={os.path.join(d, k['name'] + '.npy')}"]
    code, out, err, dt = sh([autopar, "infer", path, *infer_feeds, "--out", outdir, *expect, "--json"])
    rows = json_lines(out)
    errs = {c["name"]: c["max_rel_error"] for r in rows for c in r.get("checks", [])}
    if code != 0 or not errs:
        stages["infer"] = {"ok": False, "error": first_error(code, err), "exit": code, "max_rel_err": errs or None}
        return stages
    stages["infer"] = {"ok": max(errs.values()) <= TOL_INFER, "max_rel_err": max(errs.values()),
                       "seconds": round(dt, 2)}

    freeze = []
    for f in lj["freeze"]:
        freeze += ["--freeze", f]
    opt = ["--optimizer", "sgd", "--lr", str(lj["optimizer"]["lr"])]
    code, out, err, dt = sh([autopar, "train", path, *feeds, "--loss", entry["loss"], *opt, "--steps", "3",
                             *freeze, "--json"])
    losses = [r["loss"] for r in json_lines(out) if "step" in r and "loss" in r]
    if code != 0 or len(losses) != 3:
        stages["train"] = {"ok": False, "error": first_error(code, err), "exit": code}
        return stages
    e = max(abs(a - b) / abs(b) for a, b in zip(losses, lj["losses"]))
    stages["train"] = {"ok": e <= TOL_TRAIN, "losses": losses, "max_rel_err": e, "seconds": round(dt, 2)}

    plan = os.path.join(work, "plan.json")
    code, out, err, dt = sh([autopar, "plan", path, "--mesh", "2x2", "--memory", "1GiB", "--loss", entry["loss"],
                             *opt, "-o", plan])
    if code != 0:
        stages["plan"] = {"ok": False, "error": first_error(code, err), "exit": code, "seconds": round(dt, 2)}
        return stages
    stages["plan"] = {"ok": True, "seconds": round(dt, 2)}

    code, out, err, dt = sh([autopar, "run", plan, *feeds, "--steps", "3", "--json"])
    run_losses = [r["loss"] for r in json_lines(out) if "step" in r and "loss" in r]
    if code != 0 or len(run_losses) != 3:
        stages["run"] = {"ok": False, "error": first_error(code, err), "exit": code}
        return stages
    ref, note = losses, ""
    if lj["freeze"]:
        # plan has no --freeze: the run trains every initializer, so compare it with a train that does too.
        note = "plan/run have no --freeze: compared with train without --freeze"
        code, out, err, _ = sh([autopar, "train", path, *feeds, "--loss", entry["loss"], *opt, "--steps", "3",
                                "--json"])
        ref = [r["loss"] for r in json_lines(out) if "step" in r and "loss" in r]
        if code != 0 or len(ref) != 3:
            stages["run"] = {"ok": False, "error": "train without --freeze: " + first_error(code, err)}
            return stages
    e = max(abs(a - b) / abs(b) for a, b in zip(run_losses, ref))
    stages["run"] = {"ok": e <= TOL_RUN, "losses": run_losses, "max_rel_err_vs_train": e,
                     "seconds": round(dt, 2), "note": note}
    return stages


def verdict(stages):
    for k, v in stages.items():
        if not v["ok"]:
            return k, v
    return None, None


def md_escape(s):
    return s.replace("|", "\\|")


VARIANTS = [
    ("today", "the file as exported"),
    ("folded", "every node whose inputs are all constants (Constant nodes, non-float initializers, shapes of "
               "static tensors) folded into a Constant: what an import-time constant folder leaves"),
    ("input-folded", "also the graph inputs taken as constants: every value that depends on no parameter "
                     "(masks, position ids, CLIP's pooled index) folded for the zoo's inputs: what is left "
                     "once forward-only paths work, i.e. the ops on the parameters' path"),
]


def stage_cell(stages):
    k, v = verdict(stages)
    if k is None:
        return "✓ all"
    return f"✗ {k}"


def error_line(stages):
    k, v = verdict(stages)
    if k is None:
        return "every stage passes"
    if v.get("error"):
        return f"{k}: `{v['error']}`"
    e = v.get("max_rel_err", v.get("max_rel_err_vs_train"))
    return f"{k}: max relative error {e:.2e} over the tolerance"


def op_list(ops):
    return ", ".join(f"{k.split(':', 1)[1] if k.startswith('ai.onnx:') else k} ({v})" for k, v in ops.items())


def gap_list(static):
    gaps = [f"dtype {k} ({v['count']})" for k, v in static["unsupported_dtypes"].items()]
    gaps += [f"{k} ({v['count']})" for k, v in static["unsupported_forms"].items()]
    return gaps


def write_md(results, supported, autopar, version, path):
    n = len(results)
    count = {}
    for key, _ in VARIANTS:
        count[key] = (sum(1 for r in results if r[key]["stages"]["inspect"]["ok"]),
                      [r["name"] for r in results if verdict(r[key]["stages"])[0] is None])
    L = ["# Model zoo: what autopar does with each model today", ""]
    L.append(f"Generated by `scripts/zoo/status.py` with `{autopar}` ({version}, {len(supported)} supported "
             f"ops) on {time.strftime('%Y-%m-%d')}; every number is in `status.json`. The models, their "
             "inputs and PyTorch's references are in `tests/data/zoo` (see README.md here).")
    L.append("")
    L.append(f"Pipeline per model (issue 16's acceptance): `inspect` → `infer` = PyTorch's outputs (max relative "
             f"error ≤ {TOL_INFER:g}) → `train` 3 SGD steps = PyTorch's losses (≤ {TOL_TRAIN:g}, with `--freeze` "
             f"for the initializers losses.json lists) → `plan --mesh 2x2 --memory 1GiB` → `run` 3 steps = "
             f"`train` (≤ {TOL_RUN:g}). It runs on three variants of each file:")
    L.append("")
    for key, text in VARIANTS:
        L.append(f"- **{key}**: {text}.")
    L.append("")
    for key, _ in VARIANTS:
        imp, ok = count[key]
        L.append(f"- {key}: {imp}/{n} import, **{len(ok)}/{n} pass every stage** ({', '.join(ok) or 'none'})")
    L.append("")
    L.append("## Summary")
    L.append("")
    L.append("| model | exporter | params | nodes | unsupported ops (count) | other gaps | today | folded: ops left | "
             "folded | input-folded: ops left | input-folded |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        s = r["today"]["static"]
        cells = [r["name"], r["exporter"], str(r["params"]), str(r["nodes"]), op_list(s["unsupported_ops"]) or "-",
                 "; ".join(gap_list(s)) or "-", stage_cell(r["today"]["stages"])]
        for key in ("folded", "input-folded"):
            left = op_list(r[key]["static"]["unsupported_ops"]) or "-"
            cells += [left, stage_cell(r[key]["stages"])]
        L.append("| " + " | ".join(md_escape(c) for c in cells) + " |")
    L.append("")
    L.append("## Unsupported ops over the zoo")
    L.append("")
    L.append("How many models use each op autopar lacks, in each variant:")
    L.append("")
    L.append("| op | " + " | ".join(k for k, _ in VARIANTS) + " |")
    L.append("|---|" + "---|" * len(VARIANTS))
    per = {k: collections.Counter(op for r in results for op in r[k]["static"]["unsupported_ops"]) for k, _ in VARIANTS}
    for op, c in sorted(per["today"].items(), key=lambda kv: (-kv[1], kv[0])):
        L.append(f"| {op} | " + " | ".join(str(per[k].get(op, 0)) for k, _ in VARIANTS) + " |")
    L.append("")
    L.append("## Exact errors")
    L.append("")
    L.append("The first failing stage of each model and its one-line error, per variant:")
    L.append("")
    for r in results:
        L.append(f"- **{r['name']}**: {error_line(r['today']['stages'])}")
        for key in ("folded", "input-folded"):
            L.append(f"  - {key}: {error_line(r[key]['stages'])}")
    L.append("")
    L.append("## Dtypes and attribute forms autopar does not support (where they occur, in the file as exported)")
    L.append("")
    for r in results:
        s = r["today"]["static"]
        items = [f"dtype {k} x{v['count']} (e.g. {'; '.join(v['first'])})" for k, v in s["unsupported_dtypes"].items()]
        items += [f"{k} x{v['count']} (e.g. {'; '.join(v['first'])})" for k, v in s["unsupported_forms"].items()]
        if items:
            L.append(f"- **{r['name']}**: " + " · ".join(md_escape(x) for x in items))
    L.append("")
    L.append("## ONNX ops per model (op count; opset imports)")
    L.append("")
    for r in results:
        s = r["today"]["static"]
        ops = ", ".join(f"{k.split(':', 1)[1] if k.startswith('ai.onnx:') else k} {v}" for k, v in s["ops"].items())
        L.append(f"- **{r['name']}** ({', '.join(f'{d} {v}' for d, v in s['opset'].items())}): {ops}")
    L.append("")
    with open(path, "w") as f:
        f.write("\n".join(L))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--autopar", default=os.path.join(ROOT, "target", "debug", "autopar"))
    ap.add_argument("--only", default="", help="comma-separated model names")
    ap.add_argument("--zoo", default=ZOO)
    ap.add_argument("--out", default=HERE, help="where STATUS.md and status.json go")
    a = ap.parse_args()
    man = json.load(open(os.path.join(a.zoo, "manifest.json")))
    names = [x for x in a.only.split(",") if x]
    supported = supported_ops(a.autopar)
    version = sh([a.autopar, "--version"])[1].strip() + ", built " + time.strftime(
        "%Y-%m-%d %H:%M", time.localtime(os.path.getmtime(a.autopar)))
    results = []
    for e in man["models"]:
        if names and e["name"] not in names:
            continue
        d = os.path.join(a.zoo, e["name"])
        path = os.path.join(d, "model.onnx")
        model = onnx.load(path)
        feeds = {i["name"]: np.load(os.path.join(d, i["name"] + ".npy")) for i in e["inputs"]}
        r = {"name": e["name"], "exporter": e["exporter"], "params": e["params"], "nodes": e["nodes"]}
        with tempfile.TemporaryDirectory() as work:
            for key, _ in VARIANTS:
                m, nfolded = model, 0
                if key == "folded":
                    m, nfolded = fold(model)
                elif key == "input-folded":
                    m, nfolded = fold(model, feeds)
                p = path
                if key != "today":
                    p = os.path.join(work, f"{key}.onnx")
                    onnx.save(m, p)
                shown = f"tests/data/zoo/{e['name']}/model.onnx" if key == "today" else f"{key}.onnx"
                r[key] = {"folded_nodes": nfolded, "nodes": len(m.graph.node), "static": analyse(m, supported),
                          "stages": pipeline(a.autopar, p, e, d, work, shown)}
        results.append(r)
        print(f"{e['name']:<14} " + "  ".join(f"{k}: {stage_cell(r[k]['stages']):<10}" for k, _ in VARIANTS),
              flush=True)
    with open(os.path.join(a.out, "status.json"), "w") as f:
        json.dump({"autopar": version, "supported_ops": sorted(supported), "models": results}, f, indent=1)
        f.write("\n")
    shown = os.path.relpath(a.autopar, ROOT) if a.autopar.startswith(ROOT) else a.autopar
    write_md(results, supported, shown, version, os.path.join(a.out, "STATUS.md"))


if __name__ == "__main__":
    main()
