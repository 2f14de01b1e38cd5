//! The ONNX-to-IR translation, with constant folding of everything computable at import.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::rc::Rc;

use ir::{BinaryOp, DType, Graph, Op, ReduceOp, SliceAxis, Tensor, TensorMeta, UnaryOp, Value};
use kernels::cpu::CpuContext;
use prost::Message;
use tract_onnx::pb::{self, AttributeProto, NodeProto, TensorProto};

use crate::proto::{dtype_name, proto_shape, tensor_from_proto};

mod activation;
use crate::{ImportError, SUPPORTED_OPS};

mod conv;
mod folding;
mod index;
mod norm;
mod pad;
mod resize;
mod sequence;

/// Options of an import.
#[derive(Clone, Debug)]
pub struct ImportOptions {
    /// Shapes bound to graph inputs by name (`--input NAME=2x128`). They fill dynamic dims and
    /// may also override the model's static dims (shapes are re-propagated).
    pub input_shapes: BTreeMap<String, Vec<usize>>,
    /// Read parameter data. When false (or when the data is absent) parameters are shape-only.
    pub load_weights: bool,
    /// Shapes of the data that will be fed (e.g. from `--feed` files). Unlike `input_shapes` they
    /// only fill the model's dynamic dims, and only when the rank agrees: a feed whose static dims
    /// disagree with the model is reported when it is fed, not silently re-shaped into the graph.
    pub feed_shapes: BTreeMap<String, Vec<usize>>,
    /// Ceiling on the bytes of any one constant the importer materialises: folded shape
    /// computations, `ConstantOfShape` fills, `Range`s. A few bytes of ONNX can ask for terabytes
    /// this way; past the ceiling the import fails naming the node, before allocating. Shapes
    /// that stay metadata (inputs, activations, weight-free parameters) are not bounded by it.
    pub max_constant_bytes: usize,
}

/// Default of [`ImportOptions::max_constant_bytes`]: 1 GiB.
pub const DEFAULT_MAX_CONSTANT_BYTES: usize = 1 << 30;

impl Default for ImportOptions {
    fn default() -> Self {
        ImportOptions {
            input_shapes: BTreeMap::new(),
            load_weights: true,
            feed_shapes: BTreeMap::new(),
            max_constant_bytes: DEFAULT_MAX_CONSTANT_BYTES,
        }
    }
}

/// Parses `NAME=2x128` (also `NAME=2,128`; `NAME=` alone binds a scalar).
pub fn parse_input_binding(s: &str) -> Result<(String, Vec<usize>), String> {
    let (name, dims) = s.split_once('=').ok_or_else(|| format!("`{s}` is not NAME=DIMS (e.g. input_ids=2x128)"))?;
    if name.is_empty() {
        return Err(format!("`{s}` has no input name (expected NAME=DIMS, e.g. input_ids=2x128)"));
    }
    let dims = if dims.trim().is_empty() {
        vec![]
    } else {
        dims.split(['x', 'X', ','])
            .map(|d| {
                d.trim()
                    .parse::<usize>()
                    .map_err(|_| format!("`{s}`: `{d}` is not a dimension (expected NAME=DIMS, e.g. input_ids=2x128)"))
            })
            .collect::<Result<_, _>>()?
    };
    Ok((name.to_string(), dims))
}

/// Imports an ONNX model file: a regular file of at most [`crate::MAX_MODEL_BYTES`]. External
/// data is looked up next to the file (and must stay in its directory).
pub fn import_file(path: &Path, opts: &ImportOptions) -> Result<Graph, ImportError> {
    let bytes = ir::files::read_regular(path, crate::MAX_MODEL_BYTES)
        .map_err(|cause| ImportError::Io { path: path.to_path_buf(), cause })?;
    let name = path.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
    import_bytes(&bytes, &path.display().to_string(), &name, path.parent(), opts)
}

/// Imports a model from its serialized bytes. `source` names it in errors; `base_dir` is where
/// external data files are looked up (none: parameters with external data are shape-only).
pub fn import_bytes(
    bytes: &[u8],
    source: &str,
    name: &str,
    base_dir: Option<&Path>,
    opts: &ImportOptions,
) -> Result<Graph, ImportError> {
    let model = pb::ModelProto::decode(bytes)
        .map_err(|e| ImportError::Decode { path: source.to_string(), message: e.to_string() })?;
    let Some(graph) = model.graph.as_ref() else {
        return Err(ImportError::Decode { path: source.to_string(), message: "the model has no graph".into() });
    };
    if graph.node.is_empty() && graph.output.is_empty() {
        return Err(ImportError::Decode { path: source.to_string(), message: "the model's graph is empty".into() });
    }
    let opset = model
        .opset_import
        .iter()
        .find(|o| o.domain.is_empty() || o.domain == "ai.onnx")
        .map(|o| o.version)
        .unwrap_or(if model.opset_import.is_empty() { 1 } else { 18 });
    let mut inits = HashMap::with_capacity(graph.initializer.len());
    for t in &graph.initializer {
        // Two initializers of one name: which one a reader gets would be an accident of order.
        if inits.insert(t.name.clone(), t).is_some() {
            return Err(ImportError::BadTensor {
                tensor: t.name.clone(),
                message: "two initializers have this name".into(),
            });
        }
    }
    let nodes = crate::functions::inline(&model, bytes)?;
    let mut imp = Importer {
        g: Graph::new(name),
        vals: HashMap::new(),
        producers: HashMap::new(),
        materialized: HashMap::new(),
        inits,
        opset,
        cpu: CpuContext::new(1).map_err(|e| ImportError::Internal(format!("cannot start the constant folder: {e}")))?,
        base_dir,
        load_weights: opts.load_weights,
        max_constant_bytes: opts.max_constant_bytes,
        weight_slots: HashSet::new(),
        used: HashSet::new(),
        seqs: HashMap::new(),
    };
    imp.scan(graph, &nodes);
    imp.declare_inputs(graph, opts)?;
    for (i, node) in nodes.iter().enumerate() {
        imp.node(i, node)?;
    }
    for o in &graph.output {
        let v = imp.val(&o.name).map_err(|m| ImportError::Node {
            node: format!("graph output {}", o.name),
            op_type: "output".into(),
            message: m,
        })?;
        let v = imp.materialize(&o.name, &v);
        imp.g.set_output(&o.name, v);
    }
    imp.g.remove_dead();
    ir::verify(&imp.g).map_err(|e| ImportError::Internal(e.to_string()))?;
    crate::tied::warn_shared(&imp.g);
    Ok(imp.g)
}

/// A value during import: in the graph, or a constant known now.
#[derive(Clone)]
enum V {
    G(Value),
    C(Rc<Tensor>),
}

struct Importer<'a> {
    g: Graph,
    vals: HashMap<String, V>,
    /// Who defined each value name (a node's name; `None` for a graph input): ONNX names are
    /// assigned once, and a second writer is an error rather than a silent "last writer wins".
    producers: HashMap<String, Option<String>>,
    /// Graph values of constants already added, by the constant's address. The `Rc` is held so
    /// the address cannot be reused by another constant while the entry exists.
    materialized: HashMap<usize, (Rc<Tensor>, Value)>,
    inits: HashMap<String, &'a TensorProto>,
    opset: i64,
    cpu: CpuContext,
    base_dir: Option<&'a Path>,
    load_weights: bool,
    max_constant_bytes: usize,
    /// Values read as a weight operand (Conv/Gemm/BN/LN parameters, MatMul B).
    weight_slots: HashSet<String>,
    /// Every value some node or graph output reads.
    used: HashSet<String>,
    /// Tensor sequences whose structure is known at import, by name (see `sequence.rs`).
    seqs: HashMap<String, Rc<Vec<V>>>,
}

fn elem_dtype(code: i32, what: &str) -> Result<DType, ImportError> {
    crate::dtype::held_as(code)
        .ok_or_else(|| ImportError::UnsupportedDType { tensor: what.to_string(), dtype: dtype_name(code) })
}

struct N<'a> {
    node: &'a NodeProto,
    name: String,
}

impl N<'_> {
    fn attr(&self, k: &str) -> Option<&AttributeProto> {
        self.node.attribute.iter().find(|a| a.name == k)
    }
    fn int(&self, k: &str, d: i64) -> i64 {
        self.attr(k).map(|a| a.i).unwrap_or(d)
    }
    fn float(&self, k: &str, d: f32) -> f32 {
        self.attr(k).map(|a| a.f).unwrap_or(d)
    }
    fn ints(&self, k: &str) -> Option<Vec<i64>> {
        self.attr(k).map(|a| a.ints.clone())
    }
    fn string(&self, k: &str) -> Option<String> {
        self.attr(k).map(|a| String::from_utf8_lossy(&a.s).to_string())
    }
    fn input(&self, i: usize) -> Option<&str> {
        self.node.input.get(i).map(|s| s.as_str()).filter(|s| !s.is_empty())
    }
}

fn norm_axis(axis: i64, rank: usize) -> Result<usize, String> {
    let r = rank as i64;
    let a = if axis < 0 { axis + r } else { axis };
    if a < 0 || a >= r {
        return Err(format!("axis {axis} is out of range for rank {rank}"));
    }
    Ok(a as usize)
}

impl<'a> Importer<'a> {
    fn scan(&mut self, graph: &pb::GraphProto, nodes: &[NodeProto]) {
        for n in nodes {
            for i in &n.input {
                self.used.insert(i.clone());
            }
            let slots: &[usize] = match n.op_type.as_str() {
                "Conv" | "ConvTranspose" | "Gemm" | "LayerNormalization" => &[1, 2],
                "BatchNormalization" => &[1, 2, 3, 4],
                "MatMul" => &[1],
                _ => &[],
            };
            for &s in slots {
                if let Some(x) = n.input.get(s) {
                    self.weight_slots.insert(x.clone());
                }
            }
        }
        for o in &graph.output {
            self.used.insert(o.name.clone());
        }
    }

    fn declare_inputs(&mut self, graph: &pb::GraphProto, opts: &ImportOptions) -> Result<(), ImportError> {
        use pb::tensor_shape_proto::dimension::Value::DimValue;
        let tensor_type = |vi: &pb::ValueInfoProto| match vi.r#type.as_ref().and_then(|t| t.value.as_ref()) {
            Some(pb::type_proto::Value::TensorType(tt)) => Some(tt.clone()),
            _ => None,
        };
        for vi in &graph.input {
            let bad = |message: String| ImportError::BadTensor { tensor: format!("input {}", vi.name), message };
            let Some(tt) = tensor_type(vi) else { continue };
            let dims: Vec<Option<i64>> = tt
                .shape
                .iter()
                .flat_map(|s| &s.dim)
                .map(|d| match d.value {
                    Some(DimValue(v)) => Some(v),
                    _ => None,
                })
                .collect();
            if let Some(v) = dims.iter().flatten().find(|&&v| v < 0) {
                return Err(bad(format!("declares dim {v}: dims cannot be negative")));
            }
            // An input that names an initializer takes the initializer's value (the convention of
            // ONNX IR < 4); its declared type must then be the initializer's, not another.
            if let Some(t) = self.inits.get(&vi.name) {
                let same_rank = tt.shape.is_none() || dims.len() == t.dims.len();
                let same_dims =
                    same_rank && dims.iter().zip(&t.dims).all(|(d, &td)| d.is_none_or(|d| d == td || d == 0));
                if tt.elem_type != t.data_type || !same_dims {
                    return Err(bad(format!(
                        "declares {} {dims:?} but the initializer of this name is {} {:?}",
                        dtype_name(tt.elem_type),
                        dtype_name(t.data_type),
                        t.dims
                    )));
                }
            }
        }
        let real: Vec<_> = graph.input.iter().filter(|i| !self.inits.contains_key(&i.name)).collect();
        for name in opts.input_shapes.keys() {
            if !real.iter().any(|i| &i.name == name) {
                let names: Vec<_> = real.iter().map(|i| i.name.as_str()).collect();
                return Err(ImportError::BadBinding {
                    name: name.clone(),
                    message: format!("the model has no input of that name (inputs: {})", names.join(", ")),
                });
            }
        }
        for vi in real {
            let Some(pb::type_proto::Value::TensorType(tt)) = vi.r#type.as_ref().and_then(|t| t.value.as_ref()) else {
                return Err(ImportError::UnsupportedDType { tensor: vi.name.clone(), dtype: "non-tensor".into() });
            };
            let dtype = elem_dtype(tt.elem_type, &vi.name)?;
            let declared: Vec<Option<usize>> = match &tt.shape {
                Some(s) => s
                    .dim
                    .iter()
                    .map(|d| match &d.value {
                        Some(pb::tensor_shape_proto::dimension::Value::DimValue(v)) if *v > 0 => Some(*v as usize),
                        _ => None,
                    })
                    .collect(),
                None => vec![],
            };
            let shape = match opts.input_shapes.get(&vi.name) {
                Some(b) => {
                    if tt.shape.is_some() && b.len() != declared.len() {
                        return Err(ImportError::BadBinding {
                            name: vi.name.clone(),
                            message: format!("binds {} dims but the input has rank {}", b.len(), declared.len()),
                        });
                    }
                    b.clone()
                }
                None => {
                    if tt.shape.is_none() {
                        return Err(ImportError::UnboundDim {
                            input: vi.name.clone(),
                            dim: 0,
                            dim_name: "unknown rank".into(),
                            example: "2x128".into(),
                        });
                    }
                    let hint = opts.feed_shapes.get(&vi.name).filter(|h| h.len() == declared.len());
                    let mut s = Vec::new();
                    for (i, d) in declared.iter().enumerate() {
                        match (d, hint) {
                            (Some(v), _) => s.push(*v),
                            (None, Some(h)) => s.push(h[i]),
                            (None, None) => {
                                let dim_name = match &tt.shape.as_ref().expect("checked").dim[i].value {
                                    Some(pb::tensor_shape_proto::dimension::Value::DimParam(p)) if !p.is_empty() => {
                                        p.clone()
                                    }
                                    _ => "unnamed".into(),
                                };
                                let example = declared
                                    .iter()
                                    .map(|d| d.map(|x| x.to_string()).unwrap_or_else(|| "N".into()))
                                    .collect::<Vec<_>>()
                                    .join("x");
                                return Err(ImportError::UnboundDim {
                                    input: vi.name.clone(),
                                    dim: i,
                                    dim_name,
                                    example,
                                });
                            }
                        }
                    }
                    s
                }
            };
            let meta = TensorMeta::new(dtype, shape);
            if meta.checked_bytes().is_none() {
                return Err(ImportError::BadTensor {
                    tensor: format!("input {}", vi.name),
                    message: ir::shape::too_large(&meta.shape, meta.dtype),
                });
            }
            if self.producers.insert(vi.name.clone(), None).is_some() {
                return Err(ImportError::BadTensor {
                    tensor: format!("input {}", vi.name),
                    message: "the graph declares two inputs of this name".into(),
                });
            }
            let v = self.g.input(&vi.name, meta);
            self.vals.insert(vi.name.clone(), V::G(v));
        }
        Ok(())
    }

    /// Looks a value up by name, creating parameters and constants from initializers on first use.
    fn val(&mut self, name: &str) -> Result<V, String> {
        if let Some(v) = self.vals.get(name) {
            return Ok(v.clone());
        }
        let Some(t) = self.inits.get(name).copied() else {
            if self.seqs.contains_key(name) {
                return Err(format!("reads the tensor sequence {name} where a tensor is expected"));
            }
            return Err(format!("reads {name}, which no node, input or initializer defines"));
        };
        // Float initializers of every precision are the trainable parameters (held as f32).
        let v = if crate::dtype::is_float(t.data_type) {
            let shape = proto_shape(t).map_err(|e| e.to_string())?;
            if ir::shape::checked_bytes(&shape, DType::F32).is_none() {
                return Err(format!("initializer {name}: {}", ir::shape::too_large(&shape, DType::F32)));
            }
            let data =
                if self.load_weights { tensor_from_proto(t, self.base_dir).map_err(|e| e.to_string())? } else { None };
            V::G(self.g.param(name, TensorMeta::new(DType::F32, shape), data))
        } else {
            match tensor_from_proto(t, self.base_dir).map_err(|e| e.to_string())? {
                Some(c) => V::C(Rc::new(c)),
                None => {
                    return Err(format!(
                        "initializer {name} ({}) has no data, and only float initializers may be weight-free",
                        dtype_name(t.data_type)
                    ));
                }
            }
        };
        self.vals.insert(name.to_string(), v.clone());
        Ok(v)
    }

    fn materialize(&mut self, name: &str, v: &V) -> Value {
        match v {
            V::G(x) => *x,
            V::C(t) => {
                let key = Rc::as_ptr(t) as usize;
                if let Some((_, x)) = self.materialized.get(&key) {
                    return *x;
                }
                let x = self.g.constant(name, (**t).clone());
                self.materialized.insert(key, (t.clone(), x));
                x
            }
        }
    }

    fn meta(&self, v: &V) -> TensorMeta {
        match v {
            V::G(x) => self.g.meta(*x).clone(),
            V::C(t) => t.meta(),
        }
    }

    /// Checks, before allocating it, that a constant of `meta` stays under the ceiling of
    /// [`ImportOptions::max_constant_bytes`].
    fn constant_fits(&self, meta: &TensorMeta) -> Result<(), String> {
        match meta.checked_bytes() {
            None => Err(format!("constant: {}", ir::shape::too_large(&meta.shape, meta.dtype))),
            Some(b) if b > self.max_constant_bytes => Err(format!(
                "the constant {meta} would take {b} bytes, more than the {} allowed for a constant computed at \
                 import (--max-constant-bytes)",
                self.max_constant_bytes
            )),
            Some(_) => Ok(()),
        }
    }

    /// Adds `op` on `ins`, or evaluates it now when every input is a constant.
    fn emit(&mut self, name: &str, op: Op, ins: &[V]) -> Result<Vec<V>, String> {
        let metas: Vec<TensorMeta> = ins.iter().map(|v| self.meta(v)).collect();
        let outs = op.infer(&metas)?;
        if ins.iter().all(|v| matches!(v, V::C(_))) {
            for m in &outs {
                self.constant_fits(m)?;
            }
            let ts: Vec<&Tensor> = ins
                .iter()
                .map(|v| match v {
                    V::C(t) => &**t,
                    V::G(_) => unreachable!("all inputs are constants"),
                })
                .collect();
            let outs = kernels::cpu::eval(&self.cpu, &op, &ts).map_err(|e| format!("folding {}: {e}", op.name()))?;
            return Ok(outs.into_iter().map(|t| V::C(Rc::new(t))).collect());
        }
        let vals: Vec<Value> =
            ins.iter().enumerate().map(|(i, v)| self.materialize(&format!("{name}.in{i}"), v)).collect();
        let outs = self.g.add_op(name, op, &vals).map_err(|e| e.to_string())?;
        Ok(outs.into_iter().map(V::G).collect())
    }

    fn emit1(&mut self, name: &str, op: Op, ins: &[V]) -> Result<V, String> {
        Ok(self.emit(name, op, ins)?.remove(0))
    }

    fn node(&mut self, i: usize, node: &'a NodeProto) -> Result<(), ImportError> {
        let name = if node.name.is_empty() {
            node.output.first().filter(|s| !s.is_empty()).cloned().unwrap_or_else(|| format!("{}_{i}", node.op_type))
        } else {
            node.name.clone()
        };
        let n = N { node, name: name.clone() };
        let ok_domain = node.domain.is_empty() || node.domain == "ai.onnx";
        if ok_domain && let Some(done) = self.sequence_node(&n) {
            return done;
        }
        let outs = if !ok_domain || !SUPPORTED_OPS.contains(&node.op_type.as_str()) {
            // No translation, but its value may be known now: folded through tract.
            self.fold_unsupported(&n)?.ok_or_else(|| ImportError::UnsupportedOp {
                node: name.clone(),
                op_type: node.op_type.clone(),
                domain: node.domain.clone(),
            })?
        } else {
            self.translate(&n).map_err(|message| ImportError::Node {
                node: name.clone(),
                op_type: node.op_type.clone(),
                message,
            })?
        };
        for (k, out) in node.output.iter().enumerate() {
            if out.is_empty() {
                continue;
            }
            // ONNX assigns every name once; a second writer would silently win.
            let clash = if self.inits.contains_key(out) {
                Some("an initializer".to_string())
            } else {
                self.producers.insert(out.clone(), Some(name.clone())).map(|p| match p {
                    Some(p) => format!("node {p}"),
                    None => "a graph input".to_string(),
                })
            };
            if let Some(other) = clash {
                return Err(ImportError::Node {
                    node: name,
                    op_type: node.op_type.clone(),
                    message: format!("output {k} ({out}) is already defined by {other}"),
                });
            }
            match outs.get(k) {
                Some(Some(v)) => {
                    self.vals.insert(out.clone(), v.clone());
                }
                _ if self.used.contains(out) => {
                    return Err(ImportError::Node {
                        node: name,
                        op_type: node.op_type.clone(),
                        message: format!(
                            "output {k} ({out}) is used, but autopar only computes this op's first output"
                        ),
                    });
                }
                _ => {}
            }
        }
        Ok(())
    }

    fn need(&mut self, n: &N, i: usize) -> Result<V, String> {
        match n.input(i) {
            Some(s) => self.val(s),
            None => Err(format!("input {i} is missing")),
        }
    }

    fn opt(&mut self, n: &N, i: usize) -> Result<Option<V>, String> {
        match n.input(i) {
            Some(s) => self.val(s).map(Some),
            None => Ok(None),
        }
    }

    fn const_ints(&mut self, n: &N, i: usize, what: &str) -> Result<Option<Vec<i64>>, String> {
        match self.opt(n, i)? {
            None => Ok(None),
            Some(V::C(t)) => Ok(Some(t.to_i64_vec())),
            Some(V::G(_)) => Err(format!(
                "{what} (input {i}) must be a constant after folding shape computations, but it depends on graph inputs"
            )),
        }
    }

    fn translate(&mut self, n: &N) -> Result<Vec<Option<V>>, String> {
        let op_type = n.node.op_type.as_str();
        let nm = n.name.clone();
        let one = |v: V| Ok(vec![Some(v)]);
        let unary = |u: UnaryOp| Op::Unary(u);
        match op_type {
            "Identity" => one(self.need(n, 0)?),
            "Dropout" => {
                if self.opset >= 12 && n.input(2).is_some() {
                    let tm = self.const_ints(n, 2, "training_mode")?.unwrap_or_default();
                    let ratio = match self.opt(n, 1)? {
                        Some(V::C(t)) => t.to_f32_vec().first().copied().unwrap_or(0.5),
                        Some(V::G(_)) => 0.5,
                        None => 0.5,
                    };
                    // Training-mode dropout is random unless it drops nothing.
                    if tm.first().copied().unwrap_or(0) != 0 && ratio != 0.0 {
                        return Err("training-mode Dropout is not supported; export the model in eval mode".into());
                    }
                }
                let x = self.need(n, 0)?;
                // The all-true mask has the input's size, which may be an activation far larger
                // than any constant: built only when something reads it.
                if !n.node.output.get(1).is_some_and(|o| self.used.contains(o)) {
                    return one(x);
                }
                let m = TensorMeta::new(DType::Bool, self.meta(&x).shape);
                self.constant_fits(&m)?;
                let mask = V::C(Rc::new(Tensor::bool(m.shape.clone(), vec![true; m.numel()])));
                Ok(vec![Some(x), Some(mask)])
            }
            "Constant" => {
                let t = if let Some(a) = n.attr("value") {
                    let t = a.t.as_ref().ok_or("value attribute has no tensor")?;
                    tensor_from_proto(t, self.base_dir).map_err(|e| e.to_string())?.ok_or("value tensor has no data")?
                } else if let Some(a) = n.attr("value_float") {
                    Tensor::scalar_f32(a.f)
                } else if let Some(a) = n.attr("value_floats") {
                    Tensor::f32(vec![a.floats.len()], a.floats.clone())
                } else if let Some(a) = n.attr("value_int") {
                    Tensor::i64(Vec::<usize>::new(), vec![a.i])
                } else if let Some(a) = n.attr("value_ints") {
                    Tensor::i64(vec![a.ints.len()], a.ints.clone())
                } else {
                    return Err("only value, value_float(s) and value_int(s) constants are supported".into());
                };
                one(V::C(Rc::new(t)))
            }
            "ConstantOfShape" => {
                let shape: Vec<usize> = self
                    .const_ints(n, 0, "shape")?
                    .ok_or("shape input is missing")?
                    .into_iter()
                    .map(|d| usize::try_from(d).map_err(|_| format!("negative dim {d}")))
                    .collect::<Result<_, _>>()?;
                let value = match n.attr("value").and_then(|a| a.t.as_ref()) {
                    Some(t) => {
                        tensor_from_proto(t, None).map_err(|e| e.to_string())?.ok_or("value tensor has no data")?
                    }
                    None => Tensor::scalar_f32(0.0),
                };
                let out = n.node.output.first().cloned().unwrap_or_default();
                let meta = TensorMeta::new(value.dtype(), shape.clone());
                if value.dtype() == DType::F32 && self.weight_slots.contains(&out) {
                    // Topology-only models stand weights in with a fill: keep them as weight-free
                    // parameters so planning counts them, without materialising them (so no
                    // ceiling, only a size that does not overflow).
                    if meta.checked_bytes().is_none() {
                        return Err(ir::shape::too_large(&meta.shape, meta.dtype));
                    }
                    let p = self.g.param(&out, meta, None);
                    return one(V::G(p));
                }
                self.constant_fits(&meta)?;
                let count = meta.numel();
                let t = match value.data() {
                    ir::Data::F32(v) => Tensor::f32(shape, vec![*v.first().ok_or("empty value")?; count]),
                    ir::Data::F64(v) => Tensor::f64(shape, vec![*v.first().ok_or("empty value")?; count]),
                    ir::Data::I64(v) => Tensor::i64(shape, vec![*v.first().ok_or("empty value")?; count]),
                    ir::Data::Bool(v) => Tensor::bool(shape, vec![*v.first().ok_or("empty value")?; count]),
                };
                one(V::C(Rc::new(t)))
            }
            "Shape" => {
                let x = self.need(n, 0)?;
                let s = self.meta(&x).shape;
                let r = s.len() as i64;
                let clamp = |v: i64| (if v < 0 { v + r } else { v }).clamp(0, r) as usize;
                let start = clamp(n.int("start", 0));
                let end = clamp(n.int("end", r));
                let dims: Vec<i64> = s[start..end.max(start)].iter().map(|&d| d as i64).collect();
                one(V::C(Rc::new(Tensor::i64(vec![dims.len()], dims))))
            }
            "Size" => {
                let x = self.need(n, 0)?;
                one(V::C(Rc::new(Tensor::i64(Vec::<usize>::new(), vec![self.meta(&x).numel() as i64]))))
            }
            "Range" => {
                let get = |s: &mut Self, i: usize| -> Result<Rc<Tensor>, String> {
                    match s.need(n, i)? {
                        V::C(t) => Ok(t),
                        V::G(_) => Err("Range inputs must be constants after folding".into()),
                    }
                };
                let (a, b, d) = (get(self, 0)?, get(self, 1)?, get(self, 2)?);
                for (t, what) in [(&a, "start"), (&b, "limit"), (&d, "delta")] {
                    if t.numel() != 1 {
                        return Err(format!("{what} must be a scalar, got {}", t.meta()));
                    }
                }
                // The count is bounded before anything is allocated.
                let t = match a.dtype() {
                    DType::F32 => {
                        let (a, b, d) = (a.to_f32_vec()[0], b.to_f32_vec()[0], d.to_f32_vec()[0]);
                        if d == 0.0 {
                            return Err("delta is 0".into());
                        }
                        // In f32 as ONNX defines it; infinite or NaN spans are errors, not saturated.
                        let span = (b - a) / d;
                        if !span.is_finite() {
                            return Err(format!("range({a}, {b}, {d}) has no finite length"));
                        }
                        let cnt = span.ceil().max(0.0) as usize;
                        self.constant_fits(&TensorMeta::new(DType::F32, [cnt]))?;
                        Tensor::f32(vec![cnt], (0..cnt).map(|i| a + i as f32 * d).collect())
                    }
                    _ => {
                        let (a, b, d) = (a.to_i64_vec()[0], b.to_i64_vec()[0], d.to_i64_vec()[0]);
                        if d == 0 {
                            return Err("delta is 0".into());
                        }
                        // ceil((b - a) / d) in i128: the difference of two i64s does not wrap.
                        let (span, d128) = (b as i128 - a as i128, d as i128);
                        let (q, r) = (span / d128, span % d128);
                        let cnt = (q + i128::from(r != 0 && (r > 0) == (d128 > 0))).max(0);
                        let cnt = usize::try_from(cnt).map_err(|_| format!("range({a}, {b}, {d}) is too long"))?;
                        self.constant_fits(&TensorMeta::new(DType::I64, [cnt]))?;
                        // Every element lies between a and b, so it fits in an i64.
                        Tensor::i64(vec![cnt], (0..cnt).map(|i| (a as i128 + i as i128 * d128) as i64).collect())
                    }
                };
                one(V::C(Rc::new(t)))
            }
            "Relu" | "Tanh" | "Erf" | "Sigmoid" | "Exp" | "Log" | "Sqrt" | "Neg" | "Reciprocal" | "Abs" | "Not"
            | "Floor" | "Ceil" | "Sin" | "Cos" | "Sign" => {
                let u = match op_type {
                    "Relu" => UnaryOp::Relu,
                    "Tanh" => UnaryOp::Tanh,
                    "Erf" => UnaryOp::Erf,
                    "Sigmoid" => UnaryOp::Sigmoid,
                    "Exp" => UnaryOp::Exp,
                    "Log" => UnaryOp::Log,
                    "Sqrt" => UnaryOp::Sqrt,
                    "Neg" => UnaryOp::Neg,
                    "Reciprocal" => UnaryOp::Reciprocal,
                    "Abs" => UnaryOp::Abs,
                    "Not" => UnaryOp::Not,
                    "Floor" => UnaryOp::Floor,
                    "Ceil" => UnaryOp::Ceil,
                    "Sin" => UnaryOp::Sin,
                    "Cos" => UnaryOp::Cos,
                    _ => UnaryOp::Sign,
                };
                let x = self.need(n, 0)?;
                one(self.emit1(&nm, unary(u), &[x])?)
            }
            "Gelu" => {
                let u = match n.string("approximate").as_deref().unwrap_or("none") {
                    "none" => UnaryOp::Gelu,
                    "tanh" => UnaryOp::GeluTanh,
                    a => return Err(format!("approximate={a} is not supported")),
                };
                {
                    let x = self.need(n, 0)?;
                    one(self.emit1(&nm, unary(u), &[x])?)
                }
            }
            "Add" | "Sub" | "Mul" | "Div" | "Equal" | "Less" | "LessOrEqual" | "Greater" | "GreaterOrEqual" | "And"
            | "Or" | "Xor" => {
                let b = match op_type {
                    "Add" => BinaryOp::Add,
                    "Sub" => BinaryOp::Sub,
                    "Mul" => BinaryOp::Mul,
                    "Div" => BinaryOp::Div,
                    "Equal" => BinaryOp::Equal,
                    "Less" => BinaryOp::Less,
                    "LessOrEqual" => BinaryOp::LessOrEqual,
                    "Greater" => BinaryOp::Greater,
                    "GreaterOrEqual" => BinaryOp::GreaterOrEqual,
                    "And" => BinaryOp::And,
                    "Or" => BinaryOp::Or,
                    _ => BinaryOp::Xor,
                };
                if self.opset < 7 && n.int("broadcast", 0) != 0 && n.attr("axis").is_some() {
                    return Err("legacy broadcast with an axis (opset < 7) is not supported".into());
                }
                let (a, c) = (self.need(n, 0)?, self.need(n, 1)?);
                one(self.emit1(&nm, Op::Binary(b), &[a, c])?)
            }
            "Pow" => {
                let (a, mut e) = (self.need(n, 0)?, self.need(n, 1)?);
                let (da, de) = (self.meta(&a).dtype, self.meta(&e).dtype);
                if da != de {
                    e = self.emit1(&format!("{nm}.cast_exponent"), Op::Cast { to: da }, &[e])?;
                }
                one(self.emit1(&nm, Op::Binary(BinaryOp::Pow), &[a, e])?)
            }
            "Sum" | "Max" | "Min" | "Mean" => {
                let b = match op_type {
                    "Max" => BinaryOp::Max,
                    "Min" => BinaryOp::Min,
                    _ => BinaryOp::Add,
                };
                let k = n.node.input.iter().filter(|s| !s.is_empty()).count();
                if k == 0 {
                    return Err("needs at least one input".into());
                }
                let mut acc = self.need(n, 0)?;
                for i in 1..n.node.input.len() {
                    if let Some(x) = self.opt(n, i)? {
                        acc = self.emit1(&format!("{nm}.{i}"), Op::Binary(b), &[acc, x])?;
                    }
                }
                if op_type == "Mean" && k > 1 {
                    let d = V::C(Rc::new(Tensor::scalar_f32(k as f32)));
                    acc = self.emit1(&format!("{nm}.mean"), Op::Binary(BinaryOp::Div), &[acc, d])?;
                }
                one(acc)
            }
            "Clip" => {
                let x = self.need(n, 0)?;
                let dt = self.meta(&x).dtype;
                let (lo, hi) = if self.opset < 11 {
                    let scalar = |v: f32| V::C(Rc::new(Tensor::scalar_f32(v)));
                    (n.attr("min").map(|a| scalar(a.f)), n.attr("max").map(|a| scalar(a.f)))
                } else {
                    (self.opt(n, 1)?, self.opt(n, 2)?)
                };
                let mut acc = x;
                for (b, v, sfx) in [(BinaryOp::Max, lo, "min"), (BinaryOp::Min, hi, "max")] {
                    if let Some(mut v) = v {
                        let m = self.meta(&v);
                        if m.numel() != 1 {
                            return Err(format!("{sfx} must be a scalar"));
                        }
                        if m.rank() != 0 {
                            v = self.emit1(&format!("{nm}.{sfx}_scalar"), Op::Reshape { shape: vec![] }, &[v])?;
                        }
                        if m.dtype != dt {
                            v = self.emit1(&format!("{nm}.{sfx}_cast"), Op::Cast { to: dt }, &[v])?;
                        }
                        acc = self.emit1(&format!("{nm}.{sfx}"), Op::Binary(b), &[acc, v])?;
                    }
                }
                one(acc)
            }
            "Where" => {
                let (c, a, b) = (self.need(n, 0)?, self.need(n, 1)?, self.need(n, 2)?);
                one(self.emit1(&nm, Op::Where, &[c, a, b])?)
            }
            "Cast" | "CastLike" => {
                let x = self.need(n, 0)?;
                let code = if op_type == "Cast" { n.int("to", 1) as i32 } else { 0 };
                let to = if op_type == "Cast" {
                    elem_dtype(code, &format!("Cast target of {nm}")).map_err(|e| e.to_string())?
                } else {
                    let t = self.need(n, 1)?;
                    self.meta(&t).dtype
                };
                if op_type == "Cast" {
                    return one(self.cast(&nm, x, code, to)?);
                }
                if self.meta(&x).dtype == to {
                    return one(x);
                }
                one(self.emit1(&nm, Op::Cast { to }, &[x])?)
            }
            "MatMul" => {
                let (a, b) = (self.need(n, 0)?, self.need(n, 1)?);
                one(self.emit1(&nm, Op::MatMul, &[a, b])?)
            }
            "Gemm" => {
                let mut ins = vec![self.need(n, 0)?, self.need(n, 1)?];
                if let Some(c) = self.opt(n, 2)? {
                    ins.push(c);
                }
                let op = Op::Gemm {
                    alpha: n.float("alpha", 1.0),
                    beta: n.float("beta", 1.0),
                    trans_a: n.int("transA", 0) != 0,
                    trans_b: n.int("transB", 0) != 0,
                };
                one(self.emit1(&nm, op, &ins)?)
            }
            "Conv" => one(self.conv(n)?),
            "MaxPool" | "AveragePool" => one(self.pool(n, op_type == "MaxPool")?),
            "GlobalAveragePool" => {
                let x = self.need(n, 0)?;
                one(self.emit1(&nm, Op::GlobalAveragePool, &[x])?)
            }
            "GlobalMaxPool" => {
                let x = self.need(n, 0)?;
                one(self.emit1(&nm, Op::GlobalMaxPool, &[x])?)
            }
            "BatchNormalization" => self.batch_normalization(n),
            "InstanceNormalization" => self.instance_normalization(n),
            "GroupNormalization" => self.group_normalization(n),
            "MeanVarianceNormalization" => self.mean_variance_normalization(n),
            "LpNormalization" => self.lp_normalization(n),
            "RMSNormalization" => self.rms_normalization(n),
            "LayerNormalization" => {
                let x = self.need(n, 0)?;
                let axis = norm_axis(n.int("axis", -1), self.meta(&x).rank())?;
                let mut ins = vec![x, self.need(n, 1)?];
                if let Some(b) = self.opt(n, 2)? {
                    ins.push(b);
                }
                let epsilon = n.float("epsilon", 1e-5);
                let x = ins[0].clone();
                let y = self.emit1(&nm, Op::LayerNorm { axis, epsilon }, &ins)?;
                let wants = |k: usize| n.node.output.get(k).is_some_and(|o| self.used.contains(o));
                if !wants(1) && !wants(2) {
                    return one(y);
                }
                // The optional Mean and InvStdDev outputs, computed as ordinary ops when read.
                let rank = self.meta(&x).rank();
                let axes: Vec<usize> = (axis..rank).collect();
                let mean = self.emit1(
                    &format!("{nm}.mean"),
                    Op::Reduce { op: ReduceOp::Mean, axes: axes.clone(), keepdims: true },
                    std::slice::from_ref(&x),
                )?;
                let centered = self.emit1(&format!("{nm}.centered"), Op::Binary(BinaryOp::Sub), &[x, mean.clone()])?;
                let sq = self.emit1(&format!("{nm}.sq"), Op::Binary(BinaryOp::Mul), &[centered.clone(), centered])?;
                let var =
                    self.emit1(&format!("{nm}.var"), Op::Reduce { op: ReduceOp::Mean, axes, keepdims: true }, &[sq])?;
                let eps = V::C(Rc::new(Tensor::scalar_f32(epsilon)));
                let ve = self.emit1(&format!("{nm}.var_eps"), Op::Binary(BinaryOp::Add), &[var, eps])?;
                let sd = self.emit1(&format!("{nm}.std"), Op::Unary(UnaryOp::Sqrt), &[ve])?;
                let inv = self.emit1(&format!("{nm}.inv_std"), Op::Unary(UnaryOp::Reciprocal), &[sd])?;
                Ok(vec![Some(y), Some(mean), Some(inv)])
            }
            "LRN" => {
                let size = n.int("size", 0);
                if size < 1 {
                    return Err("size must be >= 1".into());
                }
                let op = Op::Lrn {
                    size: size as usize,
                    alpha: n.float("alpha", 1e-4),
                    beta: n.float("beta", 0.75),
                    bias: n.float("bias", 1.0),
                };
                {
                    let x = self.need(n, 0)?;
                    one(self.emit1(&nm, op, &[x])?)
                }
            }
            "Softmax" | "LogSoftmax" => {
                let x = self.need(n, 0)?;
                let m = self.meta(&x);
                let r = m.rank();
                let mk = |axis| if op_type == "Softmax" { Op::Softmax { axis } } else { Op::LogSoftmax { axis } };
                if self.opset >= 13 {
                    let axis = norm_axis(n.int("axis", -1), r)?;
                    return one(self.emit1(&nm, mk(axis), &[x])?);
                }
                // Before opset 13 the op flattens to 2-D at `axis` and normalises the second half.
                let axis = norm_axis(n.int("axis", 1), r + 1).map_err(|_| format!("axis out of range for rank {r}"))?;
                if axis + 1 == r {
                    return one(self.emit1(&nm, mk(axis), &[x])?);
                }
                let outer: usize = m.shape[..axis].iter().product();
                let inner: usize = m.shape[axis..].iter().product();
                let flat = self.emit1(&format!("{nm}.flat"), Op::Reshape { shape: vec![outer, inner] }, &[x])?;
                let y = self.emit1(&nm, mk(1), &[flat])?;
                one(self.emit1(&format!("{nm}.unflat"), Op::Reshape { shape: m.shape.clone() }, &[y])?)
            }
            "Reshape" => {
                let x = self.need(n, 0)?;
                let m = self.meta(&x);
                let spec = self.const_ints(n, 1, "shape")?.ok_or("shape input is missing")?;
                let allowzero = n.int("allowzero", 0) != 0;
                let mut shape = Vec::with_capacity(spec.len());
                let mut infer = None;
                for (i, &d) in spec.iter().enumerate() {
                    match d {
                        -1 if infer.is_none() => {
                            infer = Some(i);
                            shape.push(1);
                        }
                        0 if !allowzero => shape.push(
                            *m.shape
                                .get(i)
                                .ok_or(format!("shape {spec:?} copies dim {i}, but the input has rank {}", m.rank()))?,
                        ),
                        d if d >= 0 => shape.push(d as usize),
                        _ => return Err(format!("bad target shape {spec:?}")),
                    }
                }
                if let Some(i) = infer {
                    let known = ir::shape::checked_numel(&shape)
                        .ok_or_else(|| format!("target shape {spec:?}: the product of its dims overflows"))?;
                    if known == 0 || !m.numel().is_multiple_of(known) {
                        return Err(format!("cannot reshape {:?} to {spec:?}", m.shape));
                    }
                    shape[i] = m.numel() / known;
                }
                one(self.emit1(&nm, Op::Reshape { shape }, &[x])?)
            }
            "Flatten" => {
                let x = self.need(n, 0)?;
                let m = self.meta(&x);
                // Flatten's axis ranges over [-r, r]: a negative axis counts from the rank.
                let (r, raw) = (m.rank() as i64, n.int("axis", 1));
                let axis = if raw < 0 { raw + r } else { raw };
                if !(0..=r).contains(&axis) {
                    return Err(format!("axis {raw} is out of range for rank {r}"));
                }
                let axis = axis as usize;
                let shape = vec![m.shape[..axis].iter().product(), m.shape[axis..].iter().product()];
                one(self.emit1(&nm, Op::Reshape { shape }, &[x])?)
            }
            "Squeeze" | "Unsqueeze" => {
                let x = self.need(n, 0)?;
                let m = self.meta(&x);
                let axes = if self.opset >= 13 { self.const_ints(n, 1, "axes")? } else { n.ints("axes") };
                let shape = if op_type == "Squeeze" {
                    match axes {
                        None => m.shape.iter().copied().filter(|&d| d != 1).collect(),
                        Some(a) => {
                            let a = a.iter().map(|&x| norm_axis(x, m.rank())).collect::<Result<Vec<_>, _>>()?;
                            if let Some(&bad) = a.iter().find(|&&i| m.shape.get(i) != Some(&1)) {
                                return Err(format!("cannot squeeze dim {bad} of {:?}: not of size 1", m.shape));
                            }
                            m.shape.iter().enumerate().filter(|(i, _)| !a.contains(i)).map(|(_, &d)| d).collect()
                        }
                    }
                } else {
                    let a = axes.ok_or("axes are required")?;
                    let r = m.rank() + a.len();
                    let mut a = a.iter().map(|&x| norm_axis(x, r)).collect::<Result<Vec<_>, _>>()?;
                    a.sort();
                    if a.windows(2).any(|w| w[0] == w[1]) {
                        return Err(format!("axes {a:?} name an axis twice"));
                    }
                    let mut src = m.shape.iter();
                    (0..r).map(|i| if a.contains(&i) { 1 } else { *src.next().unwrap_or(&1) }).collect()
                };
                one(self.emit1(&nm, Op::Reshape { shape }, &[x])?)
            }
            "Transpose" => {
                let x = self.need(n, 0)?;
                let r = self.meta(&x).rank();
                let perm = match n.ints("perm") {
                    Some(p) => p.iter().map(|&a| norm_axis(a, r)).collect::<Result<Vec<_>, _>>()?,
                    None => (0..r).rev().collect(),
                };
                one(self.emit1(&nm, Op::Transpose { perm }, &[x])?)
            }
            "Expand" => {
                let x = self.need(n, 0)?;
                let spec = self.const_ints(n, 1, "shape")?.ok_or("shape input is missing")?;
                let spec = spec
                    .iter()
                    .map(|&d| usize::try_from(d).map_err(|_| format!("bad shape {spec:?}")))
                    .collect::<Result<Vec<_>, _>>()?;
                let shape = ir::broadcast_shapes(&self.meta(&x).shape, &spec)?;
                one(self.emit1(&nm, Op::Expand { shape }, &[x])?)
            }
            "Concat" => {
                let ins = (0..n.node.input.len())
                    .filter_map(|i| self.opt(n, i).transpose())
                    .collect::<Result<Vec<_>, _>>()?;
                let r = ins.first().map(|v| self.meta(v).rank()).ok_or("needs at least one input")?;
                let axis = norm_axis(n.attr("axis").ok_or("axis is required")?.i, r)?;
                one(self.emit1(&nm, Op::Concat { axis }, &ins)?)
            }
            "Split" => {
                let x = self.need(n, 0)?;
                let m = self.meta(&x);
                let axis = norm_axis(n.int("axis", 0), m.rank())?;
                let d = *m.shape.get(axis).ok_or("cannot split a scalar")?;
                let given = if self.opset >= 13 { self.const_ints(n, 1, "split")? } else { n.ints("split") };
                let outs = n.node.output.len();
                let sizes: Vec<usize> = match given {
                    Some(s) => {
                        if s.len() != outs {
                            return Err(format!("split {s:?} has {} sizes for {outs} outputs", s.len()));
                        }
                        s.iter()
                            .map(|&x| usize::try_from(x).map_err(|_| format!("bad split {s:?}")))
                            .collect::<Result<_, _>>()?
                    }
                    None => {
                        if let Some(a) = n.attr("num_outputs")
                            && a.i != outs as i64
                        {
                            return Err(format!("num_outputs={} but the node has {outs} outputs", a.i));
                        }
                        let k = outs;
                        if k == 0 {
                            return Err("splits into zero outputs".into());
                        }
                        // Equal chunks, the last one smaller; every chunk non-empty (ONNX), so
                        // more outputs than elements is an error, not empty outputs.
                        let chunk = d.div_ceil(k);
                        if k > d || (k - 1) * chunk >= d {
                            return Err(format!(
                                "cannot split dim {axis} of size {d} into {k} non-empty chunks (more outputs than \
                                 elements, or chunks of {chunk} leave the last ones empty)"
                            ));
                        }
                        (0..k).map(|i| chunk.min(d - i * chunk)).collect()
                    }
                };
                Ok(self.emit(&nm, Op::Split { axis, sizes }, &[x])?.into_iter().map(Some).collect())
            }
            "Slice" => {
                let x = self.need(n, 0)?;
                let m = self.meta(&x);
                let (starts, ends, axes, steps) = if self.opset >= 10 {
                    (
                        self.const_ints(n, 1, "starts")?.ok_or("starts are required")?,
                        self.const_ints(n, 2, "ends")?.ok_or("ends are required")?,
                        self.const_ints(n, 3, "axes")?,
                        self.const_ints(n, 4, "steps")?,
                    )
                } else {
                    (
                        n.ints("starts").ok_or("starts are required")?,
                        n.ints("ends").ok_or("ends are required")?,
                        n.ints("axes"),
                        None,
                    )
                };
                let axes = axes.unwrap_or_else(|| (0..starts.len() as i64).collect());
                let steps = steps.unwrap_or_else(|| vec![1; starts.len()]);
                if ends.len() != starts.len() || axes.len() != starts.len() || steps.len() != starts.len() {
                    return Err("starts, ends, axes and steps differ in length".into());
                }
                let mut out = Vec::new();
                for i in 0..starts.len() {
                    let axis = norm_axis(axes[i], m.rank())?;
                    let d = m.shape[axis] as i128;
                    let step = steps[i] as i128;
                    if step == 0 {
                        return Err("step 0".into());
                    }
                    let fix = |v: i64| if v < 0 { v as i128 + d } else { v as i128 };
                    let (s, e) = (fix(starts[i]), fix(ends[i]));
                    let (s, len) = if step > 0 {
                        let (s, e) = (s.clamp(0, d), e.clamp(0, d));
                        (s, if e > s { (e - s + step - 1) / step } else { 0 })
                    } else {
                        let (s, e) = (s.clamp(0, d - 1), e.clamp(-1, d - 1));
                        (s, if s > e { (s - e + (-step) - 1) / (-step) } else { 0 })
                    };
                    out.push(SliceAxis {
                        axis,
                        start: if len > 0 { s as i64 } else { 0 },
                        len: len as usize,
                        step: step as i64,
                    });
                }
                one(self.emit1(&nm, Op::Slice { axes: out }, &[x])?)
            }
            "Gather" => {
                let (x, idx) = (self.need(n, 0)?, self.need(n, 1)?);
                let axis = norm_axis(n.int("axis", 0), self.meta(&x).rank())?;
                // Constant indices are checked now, naming the node, rather than at run time.
                if let V::C(t) = &idx
                    && let Some(v) = t.as_i64()
                {
                    let d = self.meta(&x).shape[axis] as i64;
                    if let Some(bad) = v.iter().find(|&&i| i < -d || i >= d) {
                        return Err(format!("index {bad} is out of range for axis {axis} of size {d}"));
                    }
                }
                one(self.emit1(&nm, Op::Gather { axis }, &[x, idx])?)
            }
            "ReduceSum" | "ReduceMean" | "ReduceMax" | "ReduceMin" | "ReduceProd" | "ReduceSumSquare" | "ReduceL1"
            | "ReduceL2" | "ReduceLogSum" | "ReduceLogSumExp" => {
                let r = match op_type {
                    "ReduceSum" => ReduceOp::Sum,
                    "ReduceMean" => ReduceOp::Mean,
                    "ReduceMax" => ReduceOp::Max,
                    "ReduceMin" => ReduceOp::Min,
                    "ReduceProd" => ReduceOp::Prod,
                    "ReduceSumSquare" => ReduceOp::SumSquare,
                    "ReduceL1" => ReduceOp::L1,
                    "ReduceL2" => ReduceOp::L2,
                    "ReduceLogSum" => ReduceOp::LogSum,
                    _ => ReduceOp::LogSumExp,
                };
                let x = self.need(n, 0)?;
                let rank = self.meta(&x).rank();
                let axes_as_input = self.opset >= 18 || (op_type == "ReduceSum" && self.opset >= 13);
                let axes = if axes_as_input { self.const_ints(n, 1, "axes")? } else { n.ints("axes") };
                let mut axes = match axes {
                    Some(a) if !a.is_empty() => a.iter().map(|&a| norm_axis(a, rank)).collect::<Result<Vec<_>, _>>()?,
                    _ if n.int("noop_with_empty_axes", 0) != 0 => return one(x),
                    _ => (0..rank).collect(),
                };
                axes.sort();
                axes.dedup();
                one(self.emit1(&nm, Op::Reduce { op: r, axes, keepdims: n.int("keepdims", 1) != 0 }, &[x])?)
            }
            "Pad" => {
                let x = self.need(n, 0)?;
                let m = self.meta(&x);
                let mode = n.string("mode").unwrap_or_else(|| "constant".into());
                let (raw, value, axes) = if self.opset >= 11 {
                    let p = self.const_ints(n, 1, "pads")?.ok_or("pads are required")?;
                    let v = match self.opt(n, 2)? {
                        None => 0.0,
                        Some(V::C(t)) => t.to_f32_vec().first().copied().unwrap_or(0.0),
                        Some(V::G(_)) => return Err("constant_value must be a constant".into()),
                    };
                    (p, v, self.const_ints(n, 3, "axes")?)
                } else {
                    (n.ints("pads").ok_or("pads are required")?, n.float("value", 0.0), None)
                };
                let r = m.rank();
                let axes = match axes {
                    Some(a) => a.iter().map(|&a| norm_axis(a, r)).collect::<Result<Vec<_>, _>>()?,
                    None => (0..r).collect(),
                };
                if raw.len() != 2 * axes.len() {
                    return Err(format!("{} pads for {} axes", raw.len(), axes.len()));
                }
                let mut pads = vec![0; 2 * r];
                for (i, &a) in axes.iter().enumerate() {
                    pads[a] = raw[i];
                    pads[a + r] = raw[i + axes.len()];
                }
                one(self.pad_modes(&nm, x, &mode, &pads, value)?)
            }
            "ConvTranspose" => one(self.conv_transpose(n)?),
            "Resize" => one(self.resize(n)?),
            "Upsample" => one(self.upsample(n)?),
            "DepthToSpace" => one(self.pixel_shuffle(n, true)?),
            "SpaceToDepth" => one(self.pixel_shuffle(n, false)?),
            t if activation::OPS.contains(&t) => self.translate_activation(n, t),
            "Trilu" | "ScatterND" | "CumSum" | "ArgMax" | "ArgMin" | "Mod" | "GatherND" | "Tile" | "GatherElements"
            | "ScatterElements" | "TopK" | "OneHot" | "EyeLike" | "Einsum" => self.translate_index(n),
            other => Err(format!("{other} is listed as supported but has no translation (importer bug)")),
        }
    }
}
