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
mod elementwise;
mod folding;
mod index;
mod linalg;
mod loss;
mod norm;
mod pad;
mod recurrent;
mod reduce;
mod resize;
mod sequence;
mod shape;

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
    import_file_noted(path, opts).map(|(g, _)| g)
}

/// [`import_file`], with what the import held as constants ([`ImportNotes`]).
pub fn import_file_noted(path: &Path, opts: &ImportOptions) -> Result<(Graph, ImportNotes), ImportError> {
    let bytes = ir::files::read_regular(path, crate::MAX_MODEL_BYTES)
        .map_err(|cause| ImportError::Io { path: path.to_path_buf(), cause })?;
    let name = path.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
    import_bytes_noted(&bytes, &path.display().to_string(), &name, path.parent(), opts)
}

/// What an import decided that a user should be able to see.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ImportNotes {
    /// Float initializers read as constants rather than parameters, in the order the graph
    /// reads them: an exporter's numbers ([`is_exporter_constant`]).
    pub constants: Vec<String>,
}

/// Whether a float initializer named `name` with `dims` is a number an exporter wrote, not a
/// weight: it holds one element and its name is not a PyTorch state-dict key (`a.b.weight`).
///
/// ONNX does not say which initializers are weights; autopar trains the float ones. But
/// exporters and simplifiers also store Python numbers as float initializers: onnxsim folds the
/// dynamo exporter's `Cast(Constant)` into `scalar_tensor_default_1` (the 2 of `x.pow(2)`, the 0
/// of `mask == 0`), TorchScript's constant folding names its results `onnx::Div_12` or
/// `/m/attn/Sqrt_output_0`. Trained, such a number is a weight PyTorch never had, and the
/// exponent of `x.pow(2)` has the gradient `x^2 ln x`, NaN for every negative `x` (issue 50).
/// Both exporters name a module's parameters by their state-dict keys, so a one-element
/// parameter of a submodule (`m.logit_scale`, `pool.p`) stays a parameter. Not covered: a
/// one-element parameter of the exported module itself (`logit_scale` of a CLIPModel exported
/// without a wrapper) has no dot and is held too.
pub fn is_exporter_constant(name: &str, dims: &[i64]) -> bool {
    dims.iter().all(|&d| d == 1) && !crate::export::torch_like(name)
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
    import_bytes_noted(bytes, source, name, base_dir, opts).map(|(g, _)| g)
}

/// [`import_bytes`], with what the import held as constants ([`ImportNotes`]).
pub fn import_bytes_noted(
    bytes: &[u8],
    source: &str,
    name: &str,
    base_dir: Option<&Path>,
    opts: &ImportOptions,
) -> Result<(Graph, ImportNotes), ImportError> {
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
        held_constants: Vec::new(),
        dropouts: 0,
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
    Ok((imp.g, ImportNotes { constants: imp.held_constants }))
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
    /// Float initializers read as constants ([`is_exporter_constant`]).
    held_constants: Vec<String>,
    /// Training-mode dropouts emitted so far: the next one's `id` (its key in the generator,
    /// distinct per node in the file's order).
    dropouts: u32,
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
        // An exporter's number is a constant when the file holds its value (a few bytes, read
        // even when weights are not: inspect and train must agree on what is a parameter).
        if crate::dtype::is_float(t.data_type)
            && is_exporter_constant(name, &t.dims)
            && let Some(c) = tensor_from_proto(t, self.base_dir).map_err(|e| e.to_string())?
        {
            let v = V::C(Rc::new(c));
            self.held_constants.push(name.to_string());
            self.vals.insert(name.to_string(), v.clone());
            return Ok(v);
        }
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
    /// [`ImportOptions::max_constant_bytes`], and that the system gives its memory
    /// ([`ir::alloc::reserve`]: an error, not an abort, under a tighter `ulimit -v`).
    fn constant_fits(&self, meta: &TensorMeta) -> Result<(), String> {
        match meta.checked_bytes() {
            None => Err(format!("constant: {}", ir::shape::too_large(&meta.shape, meta.dtype))),
            Some(b) if b > self.max_constant_bytes => Err(format!(
                "the constant {meta} would take {b} bytes, more than the {} allowed for a constant computed at \
                 import (--max-constant-bytes)",
                self.max_constant_bytes
            )),
            Some(b) => ir::alloc::reserve(b).map_err(|e| format!("the constant {meta}: {e}")),
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
            self.fold_unsupported(&n)?.ok_or_else(|| match data_dependent(&node.op_type).filter(|_| ok_domain) {
                Some((what, instead)) => ImportError::DataDependent {
                    node: name.clone(),
                    op_type: node.op_type.clone(),
                    what: what.into(),
                    instead: instead.into(),
                },
                None => ImportError::UnsupportedOp {
                    node: name.clone(),
                    op_type: node.op_type.clone(),
                    domain: node.domain.clone(),
                },
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
        use crate::ops::Family;
        let op_type = n.node.op_type.as_str();
        let one = |v: V| Ok(vec![Some(v)]);
        let no_translation = || Err(format!("{op_type} is listed as supported but has no translation (importer bug)"));
        let Some(family) = crate::ops::family(op_type) else {
            return no_translation();
        };
        match family {
            Family::Elementwise => self.translate_elementwise(n, op_type),
            Family::Shape => self.translate_shape(n, op_type),
            Family::Linalg => self.translate_linalg(n, op_type),
            Family::Conv => self.translate_conv(n, op_type),
            Family::Norm => self.translate_norm(n, op_type),
            Family::Reduce => self.translate_reduce(n, op_type),
            Family::ConvTranspose => one(self.conv_transpose(n)?),
            Family::Resize => one(self.resize(n)?),
            Family::Upsample => one(self.upsample(n)?),
            Family::DepthToSpace => one(self.pixel_shuffle(n, true)?),
            Family::SpaceToDepth => one(self.pixel_shuffle(n, false)?),
            Family::Activation => self.translate_activation(n, op_type),
            Family::Index => self.translate_index(n),
            Family::Loss => self.translate_loss(n, op_type),
            Family::Swish => self.swish(n),
            Family::Recurrent => self.translate_recurrent(n, op_type),
            // Translated before dispatch (`Importer::sequence_node`).
            Family::Sequence => no_translation(),
        }
    }
}

/// For an ONNX op whose output shape depends on the values it reads (once its inputs are not
/// all constants, when folding would remove it): what it does that depends on the values, and
/// what to export instead. Such ops are what data-dependent routing (mixture-of-experts' per-expert loops),
/// boolean indexing and scripted control flow look like in ONNX.
fn data_dependent(op_type: &str) -> Option<(&'static str, &'static str)> {
    Some(match op_type {
        "NonZero" => (
            "returns as many indices as there are nonzero elements: its shape depends on the input values",
            "compute with a mask of fixed shape (`torch.where(mask, x, 0)` rather than `x[mask]`, `mask.nonzero()` or \
             one-argument `torch.where`); for mixture-of-experts routing, export the dense one-hot dispatch \
             (GShard/Switch einsum form) rather than the per-expert loop",
        ),
        "Unique" => (
            "returns as many values as are distinct: its shape depends on the input values",
            "keep a result of fixed size, such as a one-hot encoding or counts over a known range",
        ),
        "Compress" => (
            "keeps the elements a condition selects: its shape depends on the input values",
            "keep every element and mask with `torch.where`",
        ),
        "NonMaxSuppression" => (
            "returns as many boxes as survive: its shape depends on the input values",
            "run box suppression outside the trained graph",
        ),
        "If" => (
            "runs the branch that a value computed from the inputs chooses",
            "export with the branch fixed (traced, not `torch.jit.script`ed), or compute both and select with \
             `torch.where`",
        ),
        "Loop" => (
            "repeats its body as often as values computed from the inputs decide",
            "export with the loop unrolled: `torch.onnx.export` traces a Python loop into straight-line nodes (do not \
             `torch.jit.script` it)",
        ),
        _ => return None,
    })
}
