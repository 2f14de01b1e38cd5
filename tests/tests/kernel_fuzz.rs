//! Random shapes and attributes for every kernel family, against tract (issue 16 acceptance).
//!
//! For each family (elementwise with broadcasting, activation, linalg, reduce, softmax, shape,
//! conv and pooling, norm, resize, index) a seeded generator draws valid one-node ONNX models:
//! random ranks and dims (size-1 and odd dims; empty tensors for the elementwise and activation
//! families, bound with `--input` as a user does), random attributes (negative axes,
//! clamped and negative slice steps, strides, dilations, pads, groups, `ceil_mode`, ...). Each is
//! imported by autopar and run on its CPU interpreter, and run by tract on the same inputs; every
//! output must agree: same shape, integers equal, floats within `|a - b| <= 1e-5 + 1e-4 * max|b|`
//! over the tensor (NaN where tract has NaN). A model tract cannot load or run is skipped and
//! counted with tract's reason; one autopar refuses, or a disagreement, fails the test.
//!
//! Forms left out, each where autopar and tract read ONNX differently or tract fails (see the
//! generators): `pytorch_half_pixel` onto an output axis of length 1 (the spec's text against its
//! reference implementation, which autopar follows), a negative-step Slice starting below `-d`
//! (the text clamps to 0, numpy and tract give an empty slice), GatherND's negative indices
//! (tract panics), ConvTranspose's `output_padding` at or above the stride (autopar refuses it).
//!
//! Then each family draws invalid models (shapes that do not broadcast or contract, bad axes,
//! permutations, split sizes, pads, group counts): autopar must return an error, at import or run
//! time, and never panic.
//!
//! The test prints a table: family, valid cases run, agreed with tract, skipped (tract), and
//! invalid cases refused cleanly. `AUTOPAR_KFUZZ_CASES=N` draws N valid cases per family (default
//! 150, ~4 s in debug; 3,000 per family on four seeds, 120,000 cases, all agreed when it was written), `AUTOPAR_KFUZZ_SEED=S` another seed (default fixed, so CI is reproducible).

use std::collections::BTreeMap;
use std::panic::{self, AssertUnwindSafe};

use anyhow::{Context, Result, anyhow, bail};
use prost::Message;
use runtime::Cpu;
use tests::f32_value_info;
use tracer::ImportOptions;
use tract_onnx::pb;
use tract_onnx::pb::attribute_proto::AttributeType;
use tract_onnx::pb::tensor_proto::DataType;
use tract_onnx::prelude::{DatumExt, Framework, InferenceModelExt, IntoRunnable, TValue, TVec, tvec};

// ---------------------------------------------------------------------------------------------
// Random numbers.

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // splitmix64
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (`n > 0`).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: i64, hi: i64) -> i64 {
        lo + (self.next() % (hi - lo + 1) as u64) as i64
    }
    fn coin(&mut self) -> bool {
        self.next() & 1 == 1
    }
    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len())]
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// A shape of rank `lo..=hi`, dims as [`Rng::shape`].
    fn shape_in(&mut self, lo: usize, hi: usize, max: usize) -> Vec<usize> {
        let rank = lo + self.below(hi - lo + 1);
        self.shape(rank, max)
    }
    /// A shape of rank `lo..=hi` where one dim in twenty is 0 (an empty tensor).
    fn shape_or_empty(&mut self, lo: usize, hi: usize, max: usize) -> Vec<usize> {
        let mut s = self.shape_in(lo, hi, max);
        for d in s.iter_mut() {
            if self.below(20) == 0 {
                *d = 0;
            }
        }
        s
    }
    /// A shape of `rank` dims in `1..=max`, a third of them 1.
    fn shape(&mut self, rank: usize, max: usize) -> Vec<usize> {
        (0..rank).map(|_| if self.below(3) == 0 { 1 } else { 1 + self.below(max) }).collect()
    }
}

// ---------------------------------------------------------------------------------------------
// Cases.

/// How a float input's values are drawn.
#[derive(Clone, Copy, PartialEq)]
enum Dist {
    /// Uniform in [-1, 1).
    Any,
    /// Uniform in [0.5, 1.5): divisors, logarithms, variances.
    Pos,
    /// Distinct values 0.1 apart, shuffled: no ties for max, arg-max, top-k, pooling.
    Distinct,
}

/// One input slot of the node.
#[derive(Clone)]
enum In {
    /// A float graph input fed at run time.
    F(Vec<usize>, Dist),
    /// A constant int64 initializer (axes, indices, shapes, k, repeats...).
    I(Vec<usize>, Vec<i64>),
    /// A constant float initializer (Resize scales).
    C(Vec<usize>, Vec<f32>),
    /// An omitted optional input.
    Skip,
}

#[derive(Clone)]
enum Att {
    Int(i64),
    Ints(Vec<i64>),
    Float(f32),
    Str(&'static str),
}

#[derive(Clone)]
struct Case {
    op: &'static str,
    opset: i64,
    ins: Vec<In>,
    attrs: Vec<(&'static str, Att)>,
    outs: usize,
}

fn case(op: &'static str, ins: Vec<In>, attrs: Vec<(&'static str, Att)>) -> Case {
    Case { op, opset: 17, ins, attrs, outs: 1 }
}

fn ints(v: &[i64]) -> In {
    In::I(vec![v.len()], v.to_vec())
}

impl Case {
    fn describe(&self) -> String {
        let ins: Vec<String> = self
            .ins
            .iter()
            .map(|i| match i {
                In::F(s, _) => format!("f32{s:?}"),
                In::I(s, v) => format!("i64{s:?}={v:?}"),
                In::C(_, v) => format!("const{v:?}"),
                In::Skip => "-".into(),
            })
            .collect();
        let attrs: Vec<String> = self
            .attrs
            .iter()
            .map(|(k, a)| match a {
                Att::Int(i) => format!("{k}={i}"),
                Att::Ints(v) => format!("{k}={v:?}"),
                Att::Float(f) => format!("{k}={f}"),
                Att::Str(s) => format!("{k}={s}"),
            })
            .collect();
        format!("{}-{}({}) {}", self.op, self.opset, ins.join(", "), attrs.join(" "))
    }

    fn model(&self) -> Vec<u8> {
        let mut input = Vec::new();
        let mut initializer = Vec::new();
        let mut names = Vec::new();
        for (k, i) in self.ins.iter().enumerate() {
            let name = format!("i{k}");
            match i {
                In::F(shape, _) => input.push(f32_value_info(&name, shape)),
                In::I(shape, v) => initializer.push(pb::TensorProto {
                    name: name.clone(),
                    dims: shape.iter().map(|&d| d as i64).collect(),
                    data_type: DataType::Int64 as i32,
                    int64_data: v.clone(),
                    ..Default::default()
                }),
                In::C(shape, v) => initializer.push(pb::TensorProto {
                    name: name.clone(),
                    dims: shape.iter().map(|&d| d as i64).collect(),
                    data_type: DataType::Float as i32,
                    float_data: v.clone(),
                    ..Default::default()
                }),
                In::Skip => {
                    names.push(String::new());
                    continue;
                }
            }
            names.push(name);
        }
        let outputs: Vec<String> = (0..self.outs).map(|k| format!("y{k}")).collect();
        let node = pb::NodeProto {
            name: "n".into(),
            op_type: self.op.into(),
            input: names,
            output: outputs.clone(),
            attribute: self.attrs.iter().map(|(k, a)| attr(k, a)).collect(),
            ..Default::default()
        };
        pb::ModelProto {
            ir_version: 8,
            opset_import: vec![pb::OperatorSetIdProto { domain: String::new(), version: self.opset }],
            graph: Some(pb::GraphProto {
                name: "kfuzz".into(),
                node: vec![node],
                input,
                output: outputs.iter().map(|o| pb::ValueInfoProto { name: o.clone(), ..Default::default() }).collect(),
                initializer,
                ..Default::default()
            }),
            ..Default::default()
        }
        .encode_to_vec()
    }

    /// The run-time feeds, drawn from `seed`.
    fn feeds(&self, seed: u64) -> BTreeMap<String, ir::Tensor> {
        let mut r = Rng(seed);
        let mut out = BTreeMap::new();
        for (k, i) in self.ins.iter().enumerate() {
            if let In::F(shape, dist) = i {
                let n: usize = shape.iter().product();
                let v: Vec<f32> = match dist {
                    Dist::Any => (0..n).map(|_| r.unit() * 2.0 - 1.0).collect(),
                    Dist::Pos => (0..n).map(|_| 0.5 + r.unit()).collect(),
                    Dist::Distinct => {
                        let mut v: Vec<f32> = (0..n).map(|j| (j as f32 - n as f32 / 2.0) * 0.1).collect();
                        for j in (1..n).rev() {
                            v.swap(j, r.below(j + 1));
                        }
                        v
                    }
                };
                out.insert(format!("i{k}"), ir::Tensor::f32(shape.clone(), v));
            }
        }
        out
    }
}

fn attr(name: &str, a: &Att) -> pb::AttributeProto {
    let mut p = pb::AttributeProto { name: name.into(), ..Default::default() };
    match a {
        Att::Int(i) => {
            p.r#type = AttributeType::Int as i32;
            p.i = *i;
        }
        Att::Ints(v) => {
            p.r#type = AttributeType::Ints as i32;
            p.ints = v.clone();
        }
        Att::Float(f) => {
            p.r#type = AttributeType::Float as i32;
            p.f = *f;
        }
        Att::Str(s) => {
            p.r#type = AttributeType::String as i32;
            p.s = s.as_bytes().to_vec();
        }
    }
    p
}

// ---------------------------------------------------------------------------------------------
// Running and comparing.

/// A case's outcome against tract.
enum Outcome {
    Agreed,
    /// tract could not load or run it (its reason).
    TractSkipped(String),
}

fn ours(c: &Case, bytes: &[u8], feeds: &BTreeMap<String, ir::Tensor>) -> Result<Vec<ir::Tensor>> {
    let mut opts = ImportOptions { load_weights: true, ..Default::default() };
    // autopar reads a declared dim of 0 as unknown (as exporters write it); a user binds the
    // shape of an empty input with `--input`, as here.
    for (k, i) in c.ins.iter().enumerate() {
        if let In::F(shape, _) = i
            && shape.contains(&0)
        {
            opts.input_shapes.insert(format!("i{k}"), shape.clone());
        }
    }
    let g = tracer::import_bytes(bytes, "kfuzz.onnx", "kfuzz", None, &opts).context("autopar import")?;
    let ctx = Cpu::new(1)?;
    let mut report = runtime::Interpreter::new(&g)?.run(&ctx, feeds).context("autopar run")?;
    (0..c.outs).map(|k| report.outputs.remove(&format!("y{k}")).with_context(|| format!("no output y{k}"))).collect()
}

fn theirs(c: &Case, bytes: &[u8], feeds: &BTreeMap<String, ir::Tensor>) -> Result<TVec<TValue>> {
    let mut m = tract_onnx::onnx().model_for_read(&mut &bytes[..])?;
    let mut values: TVec<TValue> = tvec!();
    let mut slot = 0;
    for (k, i) in c.ins.iter().enumerate() {
        if let In::F(s, _) = i {
            m = m.with_input_fact(slot, f32::fact(s).into())?;
            let v = feeds[&format!("i{k}")].as_f32().context("f32 feed")?.to_vec();
            values.push(tract_onnx::prelude::Tensor::from_shape(s, &v)?.into());
            slot += 1;
        }
    }
    m.into_optimized()?.into_runnable()?.run(values)
}

fn compare(got: &ir::Tensor, want: &TValue) -> Result<()> {
    if let Ok(view) = want.to_plain_array_view::<f32>() {
        if got.shape() != view.shape() {
            bail!("shape {:?}, tract {:?}", got.shape(), view.shape());
        }
        let got = got.as_f32().ok_or_else(|| anyhow!("autopar gave {}, tract f32", got.dtype()))?;
        let max_ref = view.iter().filter(|v| v.is_finite()).fold(0.0f32, |m, v| m.max(v.abs()));
        for (i, (a, b)) in got.iter().zip(view.iter()).enumerate() {
            let ok = if b.is_nan() || a.is_nan() {
                a.is_nan() && b.is_nan()
            } else if b.is_infinite() || a.is_infinite() {
                a == b
            } else {
                (a - b).abs() <= 1e-5 + 1e-4 * max_ref
            };
            if !ok {
                bail!("element {i}: {a}, tract {b} (max |tract| {max_ref})");
            }
        }
        return Ok(());
    }
    if let Ok(view) = want.to_plain_array_view::<i64>() {
        if got.shape() != view.shape() {
            bail!("shape {:?}, tract {:?}", got.shape(), view.shape());
        }
        let got = got.as_i64().ok_or_else(|| anyhow!("autopar gave {}, tract i64", got.dtype()))?;
        if let Some(i) = got.iter().zip(view.iter()).position(|(a, b)| a != b) {
            bail!("element {i}: {}, tract {}", got[i], view.iter().nth(i).copied().unwrap_or_default());
        }
        return Ok(());
    }
    if let Ok(view) = want.to_plain_array_view::<bool>() {
        let got = match got.data() {
            ir::Data::Bool(v) => v,
            _ => bail!("autopar gave {}, tract bool", got.dtype()),
        };
        if got.iter().zip(view.iter()).any(|(a, b)| a != b) {
            bail!("bool outputs differ");
        }
        return Ok(());
    }
    bail!("tract output of type {:?}", want.datum_type())
}

fn run_valid(c: &Case, seed: u64) -> Result<Outcome> {
    let bytes = c.model();
    let feeds = c.feeds(seed);
    let want = match panic::catch_unwind(AssertUnwindSafe(|| theirs(c, &bytes, &feeds))) {
        Err(_) => return Ok(Outcome::TractSkipped("tract panicked".into())),
        Ok(Ok(w)) => w,
        Ok(Err(e)) => {
            let msg = format!("{e:#}");
            return Ok(Outcome::TractSkipped(msg.lines().next().unwrap_or("").chars().take(100).collect()));
        }
    };
    let got = ours(c, &bytes, &feeds)?;
    for (k, (g, w)) in got.iter().zip(want.iter()).enumerate() {
        compare(g, w).with_context(|| format!("output {k}"))?;
    }
    Ok(Outcome::Agreed)
}

/// An invalid case must be refused: an error from import or run, no panic, no output.
fn run_invalid(c: &Case) -> Result<()> {
    let bytes = c.model();
    let feeds = c.feeds(1);
    match panic::catch_unwind(AssertUnwindSafe(|| ours(c, &bytes, &feeds))) {
        Err(p) => {
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            bail!("panicked: {msg}")
        }
        Ok(Ok(_)) => bail!("accepted an invalid model"),
        Ok(Err(_)) => Ok(()),
    }
}

// ---------------------------------------------------------------------------------------------
// Generators: each draws one valid case of its family; `invalid` draws one that must fail.

/// Two shapes that broadcast (numpy rules): one is the other's suffix, with some dims 1.
fn broadcast_pair(r: &mut Rng) -> (Vec<usize>, Vec<usize>) {
    let a = r.shape_or_empty(0, 4, 4);
    let k = r.below(a.len() + 1);
    let mut b: Vec<usize> = a[a.len() - k..].to_vec();
    for d in b.iter_mut() {
        if r.below(3) == 0 {
            *d = 1;
        }
    }
    if r.coin() { (a, b) } else { (b, a) }
}

fn elementwise(r: &mut Rng) -> Case {
    let (a, b) = broadcast_pair(r);
    let op = r.pick(&["Add", "Sub", "Mul", "Div", "Max", "Min", "Pow", "Equal", "Less", "Greater"]);
    let second = if matches!(op, "Div" | "Pow") { Dist::Pos } else { Dist::Any };
    let first = if op == "Pow" { Dist::Pos } else { Dist::Any };
    case(op, vec![In::F(a, first), In::F(b, second)], vec![])
}

fn activation(r: &mut Rng) -> Case {
    let shape = r.shape_or_empty(1, 4, 5);
    let (op, dist, attrs): (&str, Dist, Vec<(&str, Att)>) = match r.below(22) {
        0 => ("Relu", Dist::Any, vec![]),
        1 => ("Sigmoid", Dist::Any, vec![]),
        2 => ("Tanh", Dist::Any, vec![]),
        3 => ("Exp", Dist::Any, vec![]),
        4 => ("Abs", Dist::Any, vec![]),
        5 => ("Neg", Dist::Any, vec![]),
        6 => ("Sqrt", Dist::Pos, vec![]),
        7 => ("Log", Dist::Pos, vec![]),
        8 => ("Erf", Dist::Any, vec![]),
        9 => ("Softplus", Dist::Any, vec![]),
        10 => ("LeakyRelu", Dist::Any, vec![("alpha", Att::Float(0.01 + r.unit()))]),
        11 => ("Elu", Dist::Any, vec![("alpha", Att::Float(0.5 + r.unit()))]),
        12 => ("HardSigmoid", Dist::Any, vec![("alpha", Att::Float(0.1 + r.unit())), ("beta", Att::Float(r.unit()))]),
        13 => ("HardSwish", Dist::Any, vec![]),
        14 => ("Selu", Dist::Any, vec![]),
        15 => ("Softsign", Dist::Any, vec![]),
        16 => ("Sin", Dist::Any, vec![]),
        17 => ("Cos", Dist::Any, vec![]),
        18 => ("Reciprocal", Dist::Pos, vec![]),
        19 => ("Floor", Dist::Any, vec![]),
        20 => ("Ceil", Dist::Any, vec![]),
        _ => ("ThresholdedRelu", Dist::Any, vec![("alpha", Att::Float(r.unit()))]),
    };
    case(op, vec![In::F(shape, dist)], attrs)
}

fn linalg(r: &mut Rng) -> Case {
    if r.coin() {
        let (m, k, n) = (1 + r.below(5), 1 + r.below(6), 1 + r.below(5));
        let (ta, tb) = (r.coin(), r.coin());
        let a = if ta { vec![k, m] } else { vec![m, k] };
        let b = if tb { vec![n, k] } else { vec![k, n] };
        let c = match r.below(3) {
            0 => vec![m, n],
            1 => vec![n],
            _ => vec![1, n],
        };
        let mut ins = vec![In::F(a, Dist::Any), In::F(b, Dist::Any)];
        if r.below(4) != 0 {
            ins.push(In::F(c, Dist::Any));
        }
        return case(
            "Gemm",
            ins,
            vec![
                ("transA", Att::Int(ta as i64)),
                ("transB", Att::Int(tb as i64)),
                ("alpha", Att::Float(0.5 + r.unit())),
                ("beta", Att::Float(0.5 + r.unit())),
            ],
        );
    }
    let (m, k, n) = (1 + r.below(5), 1 + r.below(6), 1 + r.below(5));
    // Batch dims that broadcast: one side's are a suffix of the other's, some widened from 1.
    let long = r.shape_in(0, 2, 3);
    let short: Vec<usize> =
        long[long.len() - r.below(long.len() + 1)..].iter().map(|&d| if r.below(3) == 0 { 1 } else { d }).collect();
    let (batch_a, batch_b) = if r.coin() { (long, short) } else { (short, long) };
    // A 1-D operand now and then (a vector: no batch dims).
    let a: Vec<usize> = if r.below(6) == 0 { vec![k] } else { [batch_a, vec![m, k]].concat() };
    let b: Vec<usize> = if r.below(6) == 0 { vec![k] } else { [batch_b, vec![k, n]].concat() };
    case("MatMul", vec![In::F(a, Dist::Any), In::F(b, Dist::Any)], vec![])
}

fn axes_subset(r: &mut Rng, rank: usize) -> Vec<i64> {
    let mut axes: Vec<i64> = (0..rank as i64).filter(|_| r.coin()).collect();
    for a in axes.iter_mut() {
        if r.coin() {
            *a -= rank as i64;
        }
    }
    axes
}

fn reduce(r: &mut Rng) -> Case {
    let rank = 1 + r.below(4);
    let shape = r.shape(rank, 5);
    let op = r.pick(&[
        "ReduceSum",
        "ReduceMean",
        "ReduceMax",
        "ReduceMin",
        "ReduceProd",
        "ReduceL1",
        "ReduceL2",
        "ReduceLogSumExp",
        "ReduceSumSquare",
        "ReduceLogSum",
    ]);
    let dist = if op == "ReduceLogSum" { Dist::Pos } else { Dist::Any };
    let axes = axes_subset(r, rank);
    let keepdims = ("keepdims", Att::Int(r.coin() as i64));
    // opset 18: every Reduce takes its axes as an input; empty = all axes.
    let mut c = case(op, vec![In::F(shape, dist)], vec![keepdims]);
    c.opset = 18;
    if !axes.is_empty() {
        c.ins.push(ints(&axes));
    }
    c
}

fn softmax(r: &mut Rng) -> Case {
    let rank = 1 + r.below(4);
    let shape = r.shape(rank, 5);
    let op = r.pick(&["Softmax", "LogSoftmax", "Hardmax"]);
    let axis = r.range(-(rank as i64), rank as i64 - 1);
    let dist = if op == "Hardmax" { Dist::Distinct } else { Dist::Any };
    case(op, vec![In::F(shape, dist)], vec![("axis", Att::Int(axis))])
}

fn shape_family(r: &mut Rng) -> Case {
    let rank = 1 + r.below(4);
    let shape = r.shape(rank, 5);
    let x = In::F(shape.clone(), Dist::Any);
    let n: usize = shape.iter().product();
    match r.below(9) {
        0 => {
            let mut perm: Vec<i64> = (0..rank as i64).collect();
            for j in (1..rank).rev() {
                perm.swap(j, r.below(j + 1));
            }
            case("Transpose", vec![x], vec![("perm", Att::Ints(perm))])
        }
        1 => {
            // A random factorisation of n, one dim possibly -1.
            let mut left = n;
            let mut dims = Vec::new();
            while left > 1 && dims.len() < 3 {
                let divs: Vec<usize> = (2..=left).filter(|d| left.is_multiple_of(*d)).collect();
                let d = r.pick(&divs);
                dims.push(d as i64);
                left /= d;
            }
            dims.push(left as i64);
            if r.coin() {
                let i = r.below(dims.len());
                dims[i] = -1;
            }
            case("Reshape", vec![x, ints(&dims)], vec![])
        }
        2 => {
            // Expand: a broadcast target with extra leading dims and 1s widened.
            let mut to: Vec<i64> = (0..r.below(2)).map(|_| 1 + r.below(3) as i64).collect();
            to.extend(shape.iter().map(|&d| if d == 1 && r.coin() { 1 + r.below(4) as i64 } else { d as i64 }));
            case("Expand", vec![x, ints(&to)], vec![])
        }
        3 => {
            let axis = r.below(rank);
            let parts = 1 + r.below(3);
            let ins = (0..parts)
                .map(|_| {
                    let mut s = shape.clone();
                    s[axis] = 1 + r.below(4);
                    In::F(s, Dist::Any)
                })
                .collect();
            let a = if r.coin() { axis as i64 - rank as i64 } else { axis as i64 };
            case("Concat", ins, vec![("axis", Att::Int(a))])
        }
        4 => {
            let axis = r.below(rank);
            let d = shape[axis];
            let mut sizes = Vec::new();
            let mut left = d;
            while left > 0 {
                let s = 1 + r.below(left);
                sizes.push(s as i64);
                left -= s;
            }
            let mut c = case("Split", vec![x, ints(&sizes)], vec![("axis", Att::Int(axis as i64))]);
            c.outs = sizes.len();
            c
        }
        5 => {
            let axes: Vec<i64> = (0..rank as i64).filter(|_| r.coin()).collect();
            let axes = if axes.is_empty() { vec![0] } else { axes };
            let (mut starts, mut ends, mut steps) = (vec![], vec![], vec![]);
            for &a in &axes {
                let d = shape[a as usize] as i64;
                let step = r.pick(&[1i64, 1, 2, 3, -1, -2]);
                // Starts and ends anywhere in [-d-2, d+2]: clamping and negative indices. A
                // negative step's start stays >= -d: below that, ONNX's text (and ONNX Runtime)
                // clamp it to 0 while numpy, and so tract, make the slice empty.
                let s = if step > 0 { r.range(-d - 2, d + 2) } else { r.range(-d, d + 2) };
                let e =
                    if r.below(8) == 0 { if step > 0 { i64::MAX } else { i64::MIN } } else { r.range(-d - 2, d + 2) };
                starts.push(s);
                ends.push(e);
                steps.push(step);
            }
            case("Slice", vec![x, ints(&starts), ints(&ends), ints(&axes), ints(&steps)], vec![])
        }
        6 => {
            let axis = r.below(rank);
            let d = shape[axis] as i64;
            let idx_shape = r.shape_in(0, 2, 3);
            let k: usize = idx_shape.iter().product();
            let idx: Vec<i64> = (0..k).map(|_| r.range(-d, d - 1)).collect();
            case("Gather", vec![x, In::I(idx_shape, idx)], vec![("axis", Att::Int(axis as i64))])
        }
        7 => {
            let mode = r.pick(&["constant", "edge", "reflect"]);
            let pads: Vec<i64> = (0..2 * rank)
                .map(|i| {
                    let d = shape[i % rank] as i64;
                    match mode {
                        "reflect" => r.range(0, d - 1),
                        // Negative pads crop: at most (d - 1) / 2 a side, so something is left.
                        _ => r.range(-(d - 1) / 2, 3),
                    }
                })
                .collect();
            case("Pad", vec![x, ints(&pads)], vec![("mode", Att::Str(mode))])
        }
        _ => {
            let axis = r.range(-(rank as i64), rank as i64);
            case("Flatten", vec![x], vec![("axis", Att::Int(axis))])
        }
    }
}

fn conv(r: &mut Rng) -> Case {
    let dims = 1 + r.below(2);
    let n = 1 + r.below(2);
    let op = r.pick(&["Conv", "Conv", "ConvTranspose", "MaxPool", "AveragePool", "GlobalAveragePool"]);
    let group = if op.starts_with("Conv") { r.pick(&[1usize, 1, 2]) } else { 1 };
    let cin = group * (1 + r.below(3));
    let kernel: Vec<usize> = (0..dims).map(|_| 1 + r.below(3)).collect();
    let strides: Vec<i64> = (0..dims).map(|_| 1 + r.below(2) as i64).collect();
    let dil: Vec<i64> = (0..dims).map(|_| 1 + r.below(2) as i64).collect();
    let pads: Vec<i64> = (0..2 * dims).map(|i| r.range(0, (kernel[i % dims] as i64 - 1).max(0))).collect();
    // Spatial sizes at least the dilated kernel, so every output has a window.
    let spatial: Vec<usize> = (0..dims).map(|i| (kernel[i] - 1) * dil[i] as usize + 1 + r.below(5)).collect();
    let x = In::F([vec![n, cin], spatial].concat(), if op == "MaxPool" { Dist::Distinct } else { Dist::Any });
    let ks: Vec<i64> = kernel.iter().map(|&k| k as i64).collect();
    match op {
        "Conv" => {
            let cout = group * (1 + r.below(3));
            let w = In::F([vec![cout, cin / group], kernel].concat(), Dist::Any);
            let mut ins = vec![x, w];
            if r.coin() {
                ins.push(In::F(vec![cout], Dist::Any));
            }
            case(
                op,
                ins,
                vec![
                    ("strides", Att::Ints(strides)),
                    ("dilations", Att::Ints(dil)),
                    ("pads", Att::Ints(pads)),
                    ("group", Att::Int(group as i64)),
                ],
            )
        }
        "ConvTranspose" => {
            let cout = group * (1 + r.below(3));
            let w = In::F([vec![cin, cout / group], kernel].concat(), Dist::Any);
            let mut ins = vec![x, w];
            if r.coin() {
                ins.push(In::F(vec![cout], Dist::Any));
            }
            // output_padding below the stride: autopar's form (PyTorch also allows it below the
            // dilation; autopar refuses that, naming the node).
            let op_pad: Vec<i64> = strides.iter().map(|&s| r.range(0, s - 1)).collect();
            case(
                op,
                ins,
                vec![
                    ("strides", Att::Ints(strides)),
                    ("dilations", Att::Ints(dil)),
                    ("pads", Att::Ints(pads)),
                    ("group", Att::Int(group as i64)),
                    ("output_padding", Att::Ints(op_pad)),
                ],
            )
        }
        "GlobalAveragePool" => case(op, vec![x], vec![]),
        _ => {
            let mut attrs = vec![
                ("kernel_shape", Att::Ints(ks)),
                ("strides", Att::Ints(strides)),
                ("pads", Att::Ints(pads)),
                ("ceil_mode", Att::Int(r.coin() as i64)),
            ];
            if op == "AveragePool" {
                attrs.push(("count_include_pad", Att::Int(r.coin() as i64)));
            } else {
                attrs.push(("dilations", Att::Ints(dil)));
            }
            case(op, vec![x], attrs)
        }
    }
}

fn norm(r: &mut Rng) -> Case {
    let n = 1 + r.below(3);
    let c = 1 + r.below(4);
    let spatial = r.shape_in(0, 2, 4);
    let shape = [vec![n, c], spatial].concat();
    let x = In::F(shape.clone(), Dist::Any);
    let eps = ("epsilon", Att::Float(r.pick(&[1e-5, 1e-3, 0.1])));
    match r.below(4) {
        0 => {
            // Constant statistics and affine parameters: tract folds them into the op.
            let mut stat = |lo: f32| In::C(vec![c], (0..c).map(|_| lo + r.unit()).collect());
            let ins = vec![x, stat(-0.5), stat(-0.5), stat(-0.5), stat(0.5)];
            case("BatchNormalization", ins, vec![eps])
        }
        1 => {
            let rank = shape.len();
            let axis = r.range(-(rank as i64), rank as i64 - 1);
            let a = if axis < 0 { axis + rank as i64 } else { axis } as usize;
            let tail = shape[a..].to_vec();
            let mut ins = vec![x, In::F(tail.clone(), Dist::Any)];
            if r.coin() {
                ins.push(In::F(tail, Dist::Any));
            }
            case("LayerNormalization", ins, vec![eps, ("axis", Att::Int(axis))])
        }
        2 => {
            // At least one spatial dim (autopar refuses [N, C], as PyTorch's InstanceNorm does).
            let x = In::F([vec![n, c], r.shape_in(1, 2, 4)].concat(), Dist::Any);
            case("InstanceNormalization", vec![x, In::F(vec![c], Dist::Any), In::F(vec![c], Dist::Any)], vec![eps])
        }
        _ => {
            let size = r.pick(&[1i64, 3, 5]);
            case(
                "LRN",
                vec![In::F([vec![n, c], r.shape(2, 4)].concat(), Dist::Any)],
                vec![
                    ("size", Att::Int(size)),
                    ("alpha", Att::Float(1e-4 + r.unit() * 1e-2)),
                    ("beta", Att::Float(0.5 + r.unit() * 0.3)),
                    ("bias", Att::Float(1.0 + r.unit())),
                ],
            )
        }
    }
}

fn resize(r: &mut Rng) -> Case {
    let n = 1 + r.below(2);
    let c = 1 + r.below(3);
    let (h, w) = (1 + r.below(4), 1 + r.below(4));
    let x = In::F(vec![n, c, h, w], Dist::Any);
    let sh = r.pick(&[1.0f32, 2.0, 3.0, 0.5]);
    let sw = r.pick(&[1.0f32, 2.0, 1.5, 0.5]);
    let mode = r.pick(&["nearest", "linear"]);
    let mut ct = r.pick(&["half_pixel", "asymmetric", "pytorch_half_pixel", "align_corners"]);
    // pytorch_half_pixel onto an axis of length 1: ONNX's text maps it to 0, its reference
    // implementation (which autopar and the node suite follow) to -0.5 when `scale * in` is 1
    // and to the usual formula otherwise; tract follows the text. Not compared.
    if ct == "pytorch_half_pixel" && ((h as f32 * sh).floor() == 1.0 || (w as f32 * sw).floor() == 1.0) {
        ct = "half_pixel";
    }
    let mut attrs = vec![("mode", Att::Str(mode)), ("coordinate_transformation_mode", Att::Str(ct))];
    if mode == "nearest" {
        attrs.push(("nearest_mode", Att::Str(r.pick(&["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"]))));
    }
    let mut c = case("Resize", vec![x, In::Skip, In::C(vec![4], vec![1.0, 1.0, sh, sw])], attrs);
    c.opset = 13;
    c
}

fn index(r: &mut Rng) -> Case {
    let rank = 1 + r.below(3);
    let shape = r.shape(rank, 5);
    let n: usize = shape.iter().product();
    let x = In::F(shape.clone(), Dist::Distinct);
    match r.below(8) {
        0 => {
            let s = r.shape_in(2, 3, 5);
            case(
                "Trilu",
                vec![In::F(s, Dist::Any), In::I(vec![], vec![r.range(-3, 3)])],
                vec![("upper", Att::Int(r.coin() as i64))],
            )
        }
        1 => {
            let axis = r.below(rank);
            let mut is = shape.clone();
            is[axis] = 1 + r.below(4);
            let k: usize = is.iter().product();
            let d = shape[axis] as i64;
            let idx = (0..k).map(|_| r.range(-d, d - 1)).collect();
            case("GatherElements", vec![x, In::I(is, idx)], vec![("axis", Att::Int(axis as i64))])
        }
        2 => {
            // ScatterElements along an axis with distinct targets per line (a permutation's prefix).
            let axis = r.below(rank);
            let d = shape[axis];
            let take = 1 + r.below(d);
            let mut us = shape.clone();
            us[axis] = take;
            let lines = n / d;
            let mut idx = vec![0i64; lines * take];
            let outer: usize = shape[..axis].iter().product();
            let inner: usize = shape[axis + 1..].iter().product();
            for o in 0..outer {
                for i in 0..inner {
                    let mut perm: Vec<i64> = (0..d as i64).collect();
                    for j in (1..d).rev() {
                        perm.swap(j, r.below(j + 1));
                    }
                    for t in 0..take {
                        idx[(o * take + t) * inner + i] = perm[t];
                    }
                }
            }
            let reduction = r.pick(&["none", "add", "mul", "max", "min"]);
            let mut c = case(
                "ScatterElements",
                vec![x, In::I(us.clone(), idx), In::F(us, Dist::Any)],
                vec![("axis", Att::Int(axis as i64)), ("reduction", Att::Str(reduction))],
            );
            c.opset = 18;
            c
        }
        3 => {
            let axis = r.range(-(rank as i64), rank as i64 - 1);
            let op = r.pick(&["ArgMax", "ArgMin"]);
            case(op, vec![x], vec![("axis", Att::Int(axis)), ("keepdims", Att::Int(r.coin() as i64))])
        }
        4 => {
            let axis = r.below(rank);
            let k = 1 + r.below(shape[axis]);
            let mut c = case(
                "TopK",
                vec![x, In::I(vec![1], vec![k as i64])],
                vec![("axis", Att::Int(axis as i64)), ("largest", Att::Int(r.coin() as i64))],
            );
            c.outs = 2;
            c
        }
        5 => {
            let axis = r.range(-(rank as i64), rank as i64 - 1);
            case(
                "CumSum",
                vec![In::F(shape, Dist::Any), In::I(vec![], vec![axis])],
                vec![("exclusive", Att::Int(r.coin() as i64)), ("reverse", Att::Int(r.coin() as i64))],
            )
        }
        6 => {
            let reps: Vec<i64> = (0..rank).map(|_| 1 + r.below(3) as i64).collect();
            case("Tile", vec![In::F(shape, Dist::Any), ints(&reps)], vec![])
        }
        _ => {
            // GatherND with batch_dims 0: indices [..., k] into the first k dims.
            let k = 1 + r.below(rank);
            let lead = r.shape_in(0, 1, 3);
            let m: usize = lead.iter().product();
            let mut idx = Vec::new();
            for _ in 0..m {
                // Non-negative: tract 0.23 panics on GatherND's negative indices (which ONNX allows;
                // autopar's are checked by the ONNX node suite).
                for &d in &shape[..k] {
                    idx.push(r.range(0, d as i64 - 1));
                }
            }
            case("GatherND", vec![x, In::I([lead, vec![k]].concat(), idx)], vec![])
        }
    }
}

/// An invalid case of family `f`.
fn invalid(f: &str, r: &mut Rng) -> Case {
    let any = |s: Vec<usize>| In::F(s, Dist::Any);
    match (f, r.below(2)) {
        ("elementwise", _) => case("Add", vec![any(vec![2, 3]), any(vec![4])], vec![]),
        ("activation", 0) => case("Celu", vec![any(vec![2])], vec![("alpha", Att::Float(0.0))]),
        ("activation", _) => case("Relu", vec![], vec![]),
        ("linalg", 0) => case("MatMul", vec![any(vec![2, 3]), any(vec![4, 5])], vec![]),
        ("linalg", _) => case("Gemm", vec![any(vec![2, 3, 1]), any(vec![3, 2])], vec![]),
        ("reduce", _) => {
            let mut c = case("ReduceSum", vec![any(vec![2, 3]), ints(&[r.pick(&[2i64, -3, 7])])], vec![]);
            c.opset = 18;
            c
        }
        ("softmax", _) => case("Softmax", vec![any(vec![2, 3])], vec![("axis", Att::Int(r.pick(&[2, -3, 9])))]),
        ("shape", 0) => case("Transpose", vec![any(vec![2, 3])], vec![("perm", Att::Ints(vec![0, 0]))]),
        ("shape", _) => match r.below(4) {
            0 => case("Reshape", vec![any(vec![2, 3]), ints(&[4, 2])], vec![]),
            1 => case("Split", vec![any(vec![5]), ints(&[2, 2])], vec![("axis", Att::Int(0))]),
            2 => case("Slice", vec![any(vec![5]), ints(&[0]), ints(&[5]), ints(&[0]), ints(&[0])], vec![]),
            _ => case("Concat", vec![any(vec![2, 3]), any(vec![2, 3, 1])], vec![("axis", Att::Int(0))]),
        },
        ("conv", 0) => case("Conv", vec![any(vec![1, 3, 5, 5]), any(vec![4, 2, 3, 3])], vec![]),
        ("conv", _) => case(
            "MaxPool",
            vec![any(vec![1, 1, 2, 2])],
            vec![("kernel_shape", Att::Ints(vec![3, 3])), ("pads", Att::Ints(vec![0, 0, 0, 0]))],
        ),
        ("norm", 0) => case(
            "BatchNormalization",
            vec![any(vec![2, 3, 4]), any(vec![4]), any(vec![4]), any(vec![4]), any(vec![4])],
            vec![],
        ),
        ("norm", _) => case("LayerNormalization", vec![any(vec![2, 3]), any(vec![4])], vec![("axis", Att::Int(-1))]),
        ("resize", _) => {
            let mut c =
                case("Resize", vec![any(vec![1, 1, 2, 2]), In::Skip, In::C(vec![3], vec![1.0, 2.0, 2.0])], vec![]);
            c.opset = 13;
            c
        }
        (_, 0) => case("GatherElements", vec![any(vec![2, 3]), In::I(vec![2, 3], vec![0, 1, 2, 3, 9, -9])], vec![]),
        (_, _) => case("Trilu", vec![any(vec![4])], vec![]),
    }
}

type Gen = fn(&mut Rng) -> Case;

const FAMILIES: [(&str, Gen); 10] = [
    ("elementwise", elementwise),
    ("activation", activation),
    ("linalg", linalg),
    ("reduce", reduce),
    ("softmax", softmax),
    ("shape", shape_family),
    ("conv", conv),
    ("norm", norm),
    ("resize", resize),
    ("index", index),
];

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok()).unwrap_or(default)
}

#[test]
fn every_kernel_family_agrees_with_tract_on_random_shapes() {
    let cases = env_u64("AUTOPAR_KFUZZ_CASES", 150);
    let seed = env_u64("AUTOPAR_KFUZZ_SEED", 0x6b66_757a_7a31);
    let mut failures = Vec::new();
    let mut table = String::from(
        "| family | valid cases | agreed with tract | skipped (tract cannot) | invalid refused |\n|---|---|---|---|---|\n",
    );
    let mut skipped_reasons: BTreeMap<String, usize> = BTreeMap::new();
    for (fi, (family, generate)) in FAMILIES.iter().enumerate() {
        let mut r = Rng(seed ^ (fi as u64).wrapping_mul(0x1000_0000_01B3));
        let (mut agreed, mut skipped, mut refused) = (0, 0, 0);
        for i in 0..cases {
            let c = generate(&mut r);
            match panic::catch_unwind(AssertUnwindSafe(|| run_valid(&c, seed.wrapping_add(i)))) {
                Ok(Ok(Outcome::Agreed)) => agreed += 1,
                Ok(Ok(Outcome::TractSkipped(why))) => {
                    skipped += 1;
                    *skipped_reasons.entry(format!("{}: {why}", c.op)).or_default() += 1;
                }
                Ok(Err(e)) => failures.push(format!("{family} case {i}: {}: {e:#}", c.describe())),
                Err(_) => failures.push(format!("{family} case {i}: {}: panicked", c.describe())),
            }
        }
        let invalid_n = 4;
        for i in 0..invalid_n {
            let c = invalid(family, &mut r);
            match run_invalid(&c) {
                Ok(()) => refused += 1,
                Err(e) => failures.push(format!("{family} invalid case {i}: {}: {e:#}", c.describe())),
            }
        }
        table += &format!("| {family} | {cases} | {agreed} | {skipped} | {refused} of {invalid_n} |\n");
    }
    println!("{table}");
    for (why, n) in &skipped_reasons {
        println!("skipped {n}x: {why}");
    }
    assert!(failures.is_empty(), "{} cases failed (seed {seed}):\n{}", failures.len(), failures.join("\n"));
}
