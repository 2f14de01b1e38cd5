//! The closed set of operators, their attributes, and shape/dtype inference.
//!
//! Every op takes its inputs positionally; optional ONNX inputs are resolved by the tracer into
//! attributes or a fixed input count (`Gemm` and `LayerNorm` take an optional last input).
//! Attributes are fully static and normalised: axes are non-negative, shapes are concrete, slice
//! bounds are clamped. ONNX ops that are only views under static shapes (`Flatten`, `Squeeze`,
//! `Unsqueeze`) become [`Op::Reshape`]; `Dropout` in inference (or with ratio 0) becomes
//! [`Op::Identity`], in training [`Op::Dropout`].

use crate::ops::resize::ResizeAttrs;
use crate::tensor::{DType, Tensor, TensorMeta};

/// Elementwise ops with one input. The activations and math functions after `Sign` (their
/// attributes, inference and text form) live in [`crate::ops::activation`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum UnaryOp {
    /// max(x, 0)
    Relu,
    /// x * Φ(x) with the exact normal CDF (erf form).
    Gelu,
    /// The tanh approximation of GELU.
    GeluTanh,
    /// tanh
    Tanh,
    /// Gauss error function.
    Erf,
    /// 1 / (1 + e^-x)
    Sigmoid,
    /// e^x
    Exp,
    /// natural log
    Log,
    /// square root
    Sqrt,
    /// -x
    Neg,
    /// 1 / x
    Reciprocal,
    /// |x|
    Abs,
    /// logical not (bool)
    Not,
    /// floor
    Floor,
    /// ceil
    Ceil,
    /// sin
    Sin,
    /// cos
    Cos,
    /// sign(x) in {-1, 0, 1}
    Sign,
    /// max(0, min(1, alpha x + beta))
    HardSigmoid {
        /// Slope.
        alpha: f32,
        /// Offset.
        beta: f32,
    },
    /// x · max(0, min(1, x / 6 + 1/2))
    HardSwish,
    /// x for x >= 0, alpha x below.
    LeakyRelu {
        /// Slope of the negative side.
        alpha: f32,
    },
    /// x for x > 0, alpha (e^x - 1) otherwise.
    Elu {
        /// Scale of the negative side.
        alpha: f32,
    },
    /// gamma x for x > 0, gamma alpha (e^x - 1) otherwise.
    Selu {
        /// Scale of the negative side.
        alpha: f32,
        /// Overall scale.
        gamma: f32,
    },
    /// max(0, x) + min(0, alpha (e^(x / alpha) - 1))
    Celu {
        /// Scale (and inverse input scale) of the negative side.
        alpha: f32,
    },
    /// ln(1 + e^x)
    Softplus,
    /// x / (1 + |x|)
    Softsign,
    /// x · tanh(softplus(x))
    Mish,
    /// x for x > alpha, 0 otherwise.
    ThresholdedRelu {
        /// Threshold.
        alpha: f32,
    },
    /// x + bias for x < -lambd, x - bias for x > lambd, 0 between.
    Shrink {
        /// Shift towards zero.
        bias: f32,
        /// Half-width of the zeroed band.
        lambd: f32,
    },
    /// Round to nearest, ties to even.
    Round,
    /// x is NaN (bool output).
    IsNaN,
    /// x is infinite with a sign it detects (bool output).
    IsInf {
        /// -inf counts.
        negative: bool,
        /// +inf counts.
        positive: bool,
    },
    /// tan
    Tan,
    /// arccos
    Acos,
    /// arcsin
    Asin,
    /// arctan
    Atan,
    /// sinh
    Sinh,
    /// cosh
    Cosh,
    /// arsinh
    Asinh,
    /// arcosh
    Acosh,
    /// artanh
    Atanh,
    /// Bitwise complement (i64).
    BitwiseNot,
}

/// Elementwise ops with two broadcast inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    /// a + b
    Add,
    /// a - b
    Sub,
    /// a * b
    Mul,
    /// a / b (integer division truncates toward zero)
    Div,
    /// a ^ b
    Pow,
    /// max(a, b)
    Max,
    /// min(a, b)
    Min,
    /// a == b (bool output)
    Equal,
    /// a < b (bool output)
    Less,
    /// a <= b (bool output)
    LessOrEqual,
    /// a > b (bool output)
    Greater,
    /// a >= b (bool output)
    GreaterOrEqual,
    /// logical and (bool)
    And,
    /// logical or (bool)
    Or,
    /// logical xor (bool)
    Xor,
    /// x for x >= 0, slope · x below: inputs x and the slope, which broadcasts to x
    /// (unidirectionally: the output has x's shape).
    PRelu,
    /// bitwise and (i64)
    BitwiseAnd,
    /// bitwise or (i64)
    BitwiseOr,
    /// bitwise xor (i64)
    BitwiseXor,
    /// Remainder with the divisor's sign (Python's `%`, ONNX `Mod` with `fmod=0`); integer
    /// division by zero is an error.
    Mod,
    /// Remainder with the dividend's sign (C's `fmod`, ONNX `Mod` with `fmod=1`).
    Fmod,
}

impl BinaryOp {
    /// True for ops whose output is bool regardless of input dtype.
    pub fn is_comparison(self) -> bool {
        use BinaryOp::*;
        matches!(self, Equal | Less | LessOrEqual | Greater | GreaterOrEqual)
    }
    /// True for ops defined only on bool.
    pub fn is_logical(self) -> bool {
        matches!(self, BinaryOp::And | BinaryOp::Or | BinaryOp::Xor)
    }
    /// True for ops defined only on integers.
    pub fn is_bitwise(self) -> bool {
        matches!(self, BinaryOp::BitwiseAnd | BinaryOp::BitwiseOr | BinaryOp::BitwiseXor)
    }
}

/// Reductions over a set of axes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// sum
    Sum,
    /// arithmetic mean
    Mean,
    /// maximum
    Max,
    /// minimum
    Min,
    /// product
    Prod,
    /// sum of squares
    SumSquare,
    /// sqrt of the sum of squares
    L2,
    /// sum of absolute values
    L1,
    /// log of the sum
    LogSum,
    /// log of the sum of exponentials
    LogSumExp,
}

/// Attributes of a 2-D convolution (NCHW input, OIHW weight).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ConvAttrs {
    /// Stride per spatial dim (h, w).
    pub strides: [usize; 2],
    /// Padding: [top, left, bottom, right] (ONNX order: begins then ends).
    pub pads: [usize; 4],
    /// Dilation per spatial dim.
    pub dilations: [usize; 2],
    /// Number of groups; in and out channels are both divisible by it.
    pub group: usize,
}

/// Attributes of a 2-D pooling window (NCHW).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PoolAttrs {
    /// Window size (h, w).
    pub kernel: [usize; 2],
    /// Stride per spatial dim.
    pub strides: [usize; 2],
    /// Padding: [top, left, bottom, right].
    pub pads: [usize; 4],
    /// Dilation per spatial dim (MaxPool only; 1 for average pooling).
    pub dilations: [usize; 2],
    /// Output size rounds up instead of down.
    pub ceil_mode: bool,
    /// AveragePool: padded cells count in the divisor.
    pub count_include_pad: bool,
}

impl PoolAttrs {
    /// Output spatial size for input spatial size `(h, w)`.
    pub fn out_hw(&self, h: usize, w: usize) -> Option<(usize, usize)> {
        let one = |i: usize, x: usize| -> Option<usize> {
            if self.kernel[i] == 0 || self.dilations[i] == 0 {
                return None;
            }
            let ext = self.dilations[i].checked_mul(self.kernel[i] - 1)?.checked_add(1)?;
            let padded = x.checked_add(self.pads[i])?.checked_add(self.pads[i + 2])?;
            if padded < ext || self.strides[i] == 0 {
                return None;
            }
            let num = padded - ext;
            let mut o = if self.ceil_mode { num.div_ceil(self.strides[i]) } else { num / self.strides[i] } + 1;
            // A window that starts entirely in the end padding is dropped (ONNX/PyTorch rule).
            if self.ceil_mode && (o - 1) * self.strides[i] >= x + self.pads[i] {
                o -= 1;
            }
            Some(o)
        };
        Some((one(0, h)?, one(1, w)?))
    }

    /// Why [`PoolAttrs::out_hw`] has no answer for input spatial size `(h, w)`.
    pub(crate) fn why_no_output(&self, h: usize, w: usize) -> String {
        for (i, x) in [h, w].into_iter().enumerate() {
            if self.kernel[i] == 0 || self.dilations[i] == 0 || self.strides[i] == 0 {
                return "window, strides and dilations must be at least 1".into();
            }
            if x.checked_add(self.pads[i]).and_then(|v| v.checked_add(self.pads[i + 2])).is_none() {
                return format!("padding {:?} of spatial dim {x} overflows", self.pads);
            }
            if self.dilations[i].checked_mul(self.kernel[i] - 1).and_then(|e| e.checked_add(1)).is_none() {
                return format!("a window of {} with dilation {} overflows", self.kernel[i], self.dilations[i]);
            }
        }
        "window larger than padded input".into()
    }
}

/// One sliced axis with concrete, clamped bounds.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SliceAxis {
    /// Axis index.
    pub axis: usize,
    /// First index taken.
    pub start: i64,
    /// Number of elements taken.
    pub len: usize,
    /// Step between taken indices (may be negative, never zero).
    pub step: i64,
}

/// The closed set of IR operators.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// A graph input fed at run time (data, labels).
    Input {
        /// Name the user feeds it by.
        name: String,
    },
    /// A trainable parameter (an ONNX initializer or declared weight). Its data, when known,
    /// lives in [`crate::Graph::param_data`].
    Param {
        /// Initializer name.
        name: String,
    },
    /// A constant tensor (shape arithmetic results, masks, scalars).
    Constant(Tensor),
    /// Elementwise unary op.
    Unary(UnaryOp),
    /// Elementwise binary op with numpy broadcasting.
    Binary(BinaryOp),
    /// `cond ? a : b` with broadcasting.
    Where,
    /// Element type conversion.
    Cast {
        /// Target type.
        to: DType,
    },
    /// Passes its input through.
    Identity,
    /// Batched matrix product with numpy semantics (1-D operands promoted then squeezed).
    MatMul,
    /// `alpha * op(A) @ op(B) + beta * C` on 2-D operands; C optional and unidirectionally broadcast.
    Gemm {
        /// Scale of the product.
        alpha: f32,
        /// Scale of C.
        beta: f32,
        /// A is transposed.
        trans_a: bool,
        /// B is transposed.
        trans_b: bool,
    },
    /// 2-D convolution: inputs X `[N,C,H,W]`, W `[M,C/group,kh,kw]`, optional bias `[M]`.
    Conv(ConvAttrs),
    /// 2-D max pooling.
    MaxPool(PoolAttrs),
    /// 2-D average pooling.
    AveragePool(PoolAttrs),
    /// Mean over all spatial dims, keeping them as size 1.
    GlobalAveragePool,
    /// Max over all spatial dims, keeping them as size 1.
    GlobalMaxPool,
    /// Inference batch norm: inputs X, scale, bias, mean, var (per channel, dim 1).
    BatchNorm {
        /// Added to the variance.
        epsilon: f32,
    },
    /// Layer norm over dims `axis..`: inputs X, scale, optional bias.
    LayerNorm {
        /// First normalised dim.
        axis: usize,
        /// Added to the variance.
        epsilon: f32,
    },
    /// Local response normalisation across channels (dim 1).
    Lrn {
        /// Window size.
        size: usize,
        /// Scale.
        alpha: f32,
        /// Exponent.
        beta: f32,
        /// Bias.
        bias: f32,
    },
    /// Softmax along one axis.
    Softmax {
        /// Axis.
        axis: usize,
    },
    /// Log-softmax along one axis.
    LogSoftmax {
        /// Axis.
        axis: usize,
    },
    /// Same elements, new static shape.
    Reshape {
        /// Target shape.
        shape: Vec<usize>,
    },
    /// Permutes dims: output dim i is input dim `perm[i]`.
    Transpose {
        /// Permutation.
        perm: Vec<usize>,
    },
    /// Broadcasts to a static shape (numpy rules, result shape given).
    Expand {
        /// Result shape.
        shape: Vec<usize>,
    },
    /// Concatenates its inputs along an axis.
    Concat {
        /// Axis.
        axis: usize,
    },
    /// Splits along an axis into pieces of the given sizes (one output per piece).
    Split {
        /// Axis.
        axis: usize,
        /// Piece sizes, summing to the axis length.
        sizes: Vec<usize>,
    },
    /// Strided slice on some axes; others are taken whole.
    Slice {
        /// Sliced axes with concrete bounds.
        axes: Vec<SliceAxis>,
    },
    /// Gathers along `axis` of data (input 0) by i64 indices (input 1; negative wrap).
    Gather {
        /// Axis of the data.
        axis: usize,
    },
    /// Reduction over axes.
    Reduce {
        /// Kind.
        op: ReduceOp,
        /// Reduced axes (sorted, unique).
        axes: Vec<usize>,
        /// Keep reduced dims as size 1.
        keepdims: bool,
    },
    /// Constant padding of each dim: `pads` = begins then ends, as ONNX.
    Pad {
        /// Begins then ends, one per dim each.
        pads: Vec<usize>,
        /// Fill value.
        value: f32,
    },

    // ---- training: state, gradient ops and optimizer updates (built by `crate::autodiff`) ----
    /// Persistent non-trainable state kept by the runtime between steps (optimizer moments, the
    /// step counter). It starts at zero; [`crate::Graph::updates`] says what replaces it.
    State {
        /// Storage name (unique among params and states).
        name: String,
    },
    /// `dx = dy * f'(x)` for a differentiable unary op: inputs (x, dy), or (y, dy) with the forward
    /// output `y = f(x)` for the ops whose derivative is cheaper from it
    /// ([`unary_grad_from_output`]: tanh, sigmoid, exp, sqrt, reciprocal).
    UnaryGrad(UnaryOp),
    /// Gradient of softmax (or log-softmax when `log`) from its output: inputs y, dy.
    SoftmaxGrad {
        /// Softmax axis.
        axis: usize,
        /// The forward op was log-softmax.
        log: bool,
    },
    /// Gradient of layer norm: inputs x, scale, dy; outputs dx, dscale and dbias, the last two
    /// with the normalised shape `x.shape[axis..]` (summed over the leading dims).
    LayerNormGrad {
        /// First normalised dim.
        axis: usize,
        /// Added to the variance.
        epsilon: f32,
    },
    /// Gradient of local response normalisation: inputs x, dy.
    LrnGrad {
        /// Window size.
        size: usize,
        /// Scale.
        alpha: f32,
        /// Exponent.
        beta: f32,
        /// Bias.
        bias: f32,
    },
    /// Gradient of a convolution with respect to its input: inputs dy, W; output shape `shape`.
    ConvInputGrad {
        /// The forward convolution's attributes.
        attrs: ConvAttrs,
        /// Shape of the forward input X.
        shape: Vec<usize>,
    },
    /// Gradient of a convolution with respect to its weight: inputs X, dy; output shape `shape`.
    ConvWeightGrad {
        /// The forward convolution's attributes.
        attrs: ConvAttrs,
        /// Shape of the forward weight W.
        shape: Vec<usize>,
    },
    /// Gradient of max pooling: inputs x, dy; each window's dy goes to its first maximal cell.
    MaxPoolGrad(PoolAttrs),
    /// Gradient of average pooling: input dy; output shape `shape`.
    AveragePoolGrad {
        /// The forward pooling's attributes.
        attrs: PoolAttrs,
        /// Shape of the forward input.
        shape: Vec<usize>,
    },
    /// Gradient of gather with respect to its data (a scatter-add): inputs indices, dy.
    GatherGrad {
        /// Gather axis.
        axis: usize,
        /// Shape of the forward data.
        shape: Vec<usize>,
    },
    /// Gradient of a slice: input dy placed back into zeros of shape `shape`.
    SliceGrad {
        /// The forward slice's axes.
        axes: Vec<SliceAxis>,
        /// Shape of the forward input.
        shape: Vec<usize>,
    },
    /// One SGD step (PyTorch's `torch.optim.SGD`, no dampening or Nesterov):
    /// `g' = g + wd*p; buf' = momentum*buf + g'; p' = p - lr*buf'` (`buf'` = `g'` without momentum).
    /// Inputs p, g, with momentum buf, and optionally a trailing scalar lr factor (of p's type:
    /// the step's learning rate is `lr * factor`, a schedule's value; weight decay uses it
    /// too); outputs p' and, with momentum, buf'.
    SgdUpdate {
        /// Learning rate.
        lr: f32,
        /// Momentum (0: none, and no buffer).
        momentum: f32,
        /// L2 penalty added to the gradient.
        weight_decay: f32,
    },
    /// One AdamW step (PyTorch's `torch.optim.AdamW`: decoupled weight decay, bias correction).
    /// Inputs p, g, m, v, the i64 step number t >= 1 and optionally a trailing scalar lr factor
    /// (of p's type: the step's learning rate is `lr * factor`, a schedule's value; the
    /// decoupled weight decay uses it too, as PyTorch does); outputs p', m', v'.
    AdamWUpdate {
        /// Learning rate.
        lr: f32,
        /// First-moment decay.
        beta1: f32,
        /// Second-moment decay.
        beta2: f32,
        /// Added to the denominator.
        epsilon: f32,
        /// Decoupled weight decay.
        weight_decay: f32,
    },
    /// Resampling of some axes by nearest, linear or cubic interpolation (ONNX `Resize`,
    /// `Upsample`; see [`crate::ops::resize`]).
    Resize(ResizeAttrs),
    /// Gradient of [`Op::Resize`]: input dy; output the forward input's shape `shape`.
    ResizeGrad {
        /// The forward resize's attributes.
        attrs: ResizeAttrs,
        /// Shape of the forward input.
        shape: Vec<usize>,
    },
    /// Training-mode batch norm (ONNX `BatchNormalization` with `training_mode=1`): inputs X
    /// `[N, C, ...]`, scale `[C]`, bias `[C]`; each channel is normalised with the batch's mean
    /// and population variance over every dim but dim 1. Running statistics are state, not
    /// inputs (see `ops/norm.rs`).
    BatchNormTrain {
        /// Added to the variance.
        epsilon: f32,
    },
    /// Gradient of [`Op::BatchNormTrain`] through the batch mean and variance: inputs x, scale,
    /// dy; outputs dx, dscale and dbias (`[C]`).
    BatchNormTrainGrad {
        /// Added to the variance.
        epsilon: f32,
    },
    /// One-hot of the first maximum along an axis (ONNX Hardmax, opset 13+ form).
    Hardmax {
        /// Axis.
        axis: usize,
    },
    /// An op of the indexing family (gathers, scatters, triangles, cumulative sums, arg-reductions,
    /// top-k): see [`crate::ops::index`].
    Index(crate::IndexOp),
    /// Training-mode dropout (ONNX `Dropout` with `training_mode` true): input x (float);
    /// outputs `x · keep / (1 - ratio)` and, with `mask`, `keep` (bool). The mask is a function of
    /// the run's seed, the step and each element's global index, the same however the step is
    /// sharded, split into microbatches or staged; inference does not drop. See
    /// [`crate::ops::random`]. Its gradient is the same op on the output gradient.
    Dropout(crate::ops::random::DropoutAttrs),
    /// Fused (flash) attention, ONNX `Attention` in its 4-D form: inputs Q, K, V and an optional
    /// mask; outputs Y and the row log-sum-exp of the scores (see [`crate::ops::attention`]).
    Attention(crate::AttentionAttrs),
    /// Gradient of [`Op::Attention`], recomputing the scores: inputs Q, K, V, Y, the row
    /// log-sum-exp, dY and the optional mask; outputs dQ, dK and dV.
    AttentionGrad(crate::AttentionAttrs),
    /// Routed experts (mixture of experts), dropless: inputs x, the router weight and the
    /// stacked expert weights; outputs y and the auxiliary load-balancing loss (see
    /// [`crate::ops::moe`]).
    Moe(crate::MoeAttrs),
    /// Gradient of [`Op::Moe`], recomputing the routing: inputs the forward's, dy and daux;
    /// outputs the gradients of the forward inputs.
    MoeGrad(crate::MoeAttrs),
}

/// Why an op cannot produce outputs for the given inputs.
pub type InferError = String;

pub(crate) fn broadcast(a: &[usize], b: &[usize]) -> Result<Vec<usize>, InferError> {
    let r = a.len().max(b.len());
    let mut out = vec![0; r];
    for i in 0..r {
        let da = if i + a.len() >= r { a[i + a.len() - r] } else { 1 };
        let db = if i + b.len() >= r { b[i + b.len() - r] } else { 1 };
        out[i] = if da == db || db == 1 {
            da
        } else if da == 1 {
            db
        } else {
            return Err(format!("shapes {a:?} and {b:?} do not broadcast"));
        };
    }
    Ok(out)
}

/// Numpy broadcast of two shapes.
pub fn broadcast_shapes(a: &[usize], b: &[usize]) -> Result<Vec<usize>, InferError> {
    broadcast(a, b)
}

pub(crate) fn want_inputs(op: &str, ins: &[TensorMeta], lo: usize, hi: usize) -> Result<(), InferError> {
    if ins.len() < lo || ins.len() > hi {
        if lo == hi {
            return Err(format!("{op} takes {lo} inputs, got {}", ins.len()));
        }
        return Err(format!("{op} takes {lo} to {hi} inputs, got {}", ins.len()));
    }
    Ok(())
}

pub(crate) fn want_dtype(op: &str, m: &TensorMeta, dt: DType, what: &str) -> Result<(), InferError> {
    if m.dtype != dt {
        return Err(format!("{op}: {what} must be {dt}, got {}", m.dtype));
    }
    Ok(())
}

pub(crate) fn want_float(op: &str, m: &TensorMeta) -> Result<(), InferError> {
    if !m.dtype.is_float() {
        return Err(format!("{op}: input must be f32 or f64, got {}", m.dtype));
    }
    Ok(())
}

/// The one float type of `ins`: every input floating-point, all of the same type.
pub(crate) fn float_of(op: &str, ins: &[TensorMeta]) -> Result<DType, InferError> {
    let dt = ins.first().map(|m| m.dtype).unwrap_or(DType::F32);
    for m in ins {
        want_float(op, m)?;
        if m.dtype != dt {
            return Err(format!("{op}: inputs mix {dt} and {}", m.dtype));
        }
    }
    Ok(dt)
}

impl Op {
    /// The op in a graph made float type `to` ([`crate::Graph::with_float_type`]): constants'
    /// float data converted, float casts retargeted; every other op is unchanged.
    pub fn with_float_type(self, to: DType) -> Op {
        match self {
            Op::Constant(t) => Op::Constant(t.with_float_type(to)),
            Op::Cast { to: c } if c.is_float() => Op::Cast { to },
            op => op,
        }
    }
    /// The op's name in the text form (also used in messages).
    pub fn name(&self) -> &'static str {
        use Op::*;
        match self {
            Input { .. } => "input",
            Param { .. } => "param",
            Constant(_) => "const",
            Unary(u) => unary_name(*u),
            Binary(b) => binary_name(*b),
            Where => "where",
            Cast { .. } => "cast",
            Identity => "identity",
            MatMul => "matmul",
            Gemm { .. } => "gemm",
            Conv(_) => "conv",
            MaxPool(_) => "maxpool",
            AveragePool(_) => "avgpool",
            GlobalAveragePool => "global_avgpool",
            GlobalMaxPool => "global_maxpool",
            BatchNorm { .. } => "batchnorm",
            LayerNorm { .. } => "layernorm",
            Lrn { .. } => "lrn",
            Softmax { .. } => "softmax",
            LogSoftmax { .. } => "log_softmax",
            Reshape { .. } => "reshape",
            Transpose { .. } => "transpose",
            Expand { .. } => "expand",
            Concat { .. } => "concat",
            Split { .. } => "split",
            Slice { .. } => "slice",
            Gather { .. } => "gather",
            Reduce { op, .. } => reduce_name(*op),
            Pad { .. } => "pad",
            State { .. } => "state",
            UnaryGrad(u) => unary_grad_name(*u),
            SoftmaxGrad { log: false, .. } => "softmax_grad",
            SoftmaxGrad { log: true, .. } => "log_softmax_grad",
            LayerNormGrad { .. } => "layernorm_grad",
            LrnGrad { .. } => "lrn_grad",
            ConvInputGrad { .. } => "conv_input_grad",
            ConvWeightGrad { .. } => "conv_weight_grad",
            MaxPoolGrad(_) => "maxpool_grad",
            AveragePoolGrad { .. } => "avgpool_grad",
            GatherGrad { .. } => "gather_grad",
            SliceGrad { .. } => "slice_grad",
            SgdUpdate { .. } => "sgd_update",
            AdamWUpdate { .. } => "adamw_update",
            Resize(_) => "resize",
            ResizeGrad { .. } => "resize_grad",
            BatchNormTrain { .. } => "batchnorm_train",
            BatchNormTrainGrad { .. } => "batchnorm_train_grad",
            Hardmax { .. } => "hardmax",
            Index(x) => x.name(),
            Dropout(_) => "dropout",
            Attention(_) => "attention",
            AttentionGrad(_) => "attention_grad",
            Moe(_) => "moe",
            MoeGrad(_) => "moe_grad",
        }
    }

    /// True for ops with no inputs whose value is known before running (params and constants
    /// are sources too, but only constants are foldable).
    pub fn is_source(&self) -> bool {
        matches!(self, Op::Input { .. } | Op::Param { .. } | Op::State { .. } | Op::Constant(_))
    }

    /// Number of outputs the op produces.
    pub fn num_outputs(&self) -> usize {
        match self {
            Op::Split { sizes, .. } => sizes.len(),
            Op::LayerNormGrad { .. } | Op::AdamWUpdate { .. } | Op::BatchNormTrainGrad { .. } => 3,
            Op::SgdUpdate { momentum, .. } if *momentum != 0.0 => 2,
            Op::Index(x) => x.num_outputs(),
            Op::Attention(_) => 2,
            Op::AttentionGrad(_) => 3,
            Op::Moe(_) => 2,
            Op::MoeGrad(a) => a.num_inputs(),
            Op::Dropout(a) if a.mask => 2,
            // Every variant is listed (no wildcard), so a new op decides its output count here.
            Op::SgdUpdate { .. } | Op::Dropout(_) => 1,
            Op::Input { .. }
            | Op::Param { .. }
            | Op::Constant(_)
            | Op::Unary(_)
            | Op::Binary(_)
            | Op::Where
            | Op::Cast { .. }
            | Op::Identity
            | Op::MatMul
            | Op::Gemm { .. }
            | Op::Conv(_)
            | Op::MaxPool(_)
            | Op::AveragePool(_)
            | Op::GlobalAveragePool
            | Op::GlobalMaxPool
            | Op::BatchNorm { .. }
            | Op::LayerNorm { .. }
            | Op::Lrn { .. }
            | Op::Softmax { .. }
            | Op::LogSoftmax { .. }
            | Op::Reshape { .. }
            | Op::Transpose { .. }
            | Op::Expand { .. }
            | Op::Concat { .. }
            | Op::Slice { .. }
            | Op::Gather { .. }
            | Op::Reduce { .. }
            | Op::Pad { .. }
            | Op::State { .. }
            | Op::UnaryGrad(_)
            | Op::SoftmaxGrad { .. }
            | Op::LrnGrad { .. }
            | Op::ConvInputGrad { .. }
            | Op::ConvWeightGrad { .. }
            | Op::MaxPoolGrad(_)
            | Op::AveragePoolGrad { .. }
            | Op::GatherGrad { .. }
            | Op::SliceGrad { .. }
            | Op::Resize(_)
            | Op::ResizeGrad { .. }
            | Op::BatchNormTrain { .. }
            | Op::Hardmax { .. } => 1,
        }
    }

    /// Output metas for the given input metas, or why they are invalid. Every output is
    /// representable ([`crate::shape`]): an output whose element count or byte size overflows is
    /// an error, never a wrapped size.
    pub fn infer(&self, ins: &[TensorMeta]) -> Result<Vec<TensorMeta>, InferError> {
        let outs = self.infer_shapes(ins)?;
        for m in &outs {
            if m.checked_bytes().is_none() {
                return Err(format!("{}: output {}", self.name(), crate::shape::too_large(&m.shape, m.dtype)));
            }
        }
        Ok(outs)
    }

    /// [`Op::infer`] before the size check of the outputs. Arithmetic on dims is checked here
    /// too: attributes (pads, sizes, slice bounds) are not bounded by the input shapes.
    ///
    /// One arm per variant, no wildcard: a new [`Op`] does not compile until it names the family
    /// file that infers it. Each family's `infer` ends in a "dispatch bug" error that this match
    /// never reaches.
    fn infer_shapes(&self, ins: &[TensorMeta]) -> Result<Vec<TensorMeta>, InferError> {
        use Op::*;
        let n = self.name();
        let one = |m: TensorMeta| Ok(vec![m]);
        match self {
            Input { .. } | Param { .. } | State { .. } => Err(format!("{n} has no inferred meta: it is declared")),
            Constant(t) => {
                want_inputs(n, ins, 0, 0)?;
                one(t.meta())
            }
            Resize(a) => a.infer(n, ins),
            ResizeGrad { attrs, shape } => attrs.infer_grad(n, shape, ins),
            BatchNormTrain { .. } => crate::ops::norm::infer_batch_norm_train(n, ins),
            Index(x) => x.infer(ins),
            Dropout(a) => crate::ops::random::infer(n, a, ins),
            Attention(a) => a.infer(n, ins),
            Moe(a) => a.infer(n, ins),
            Unary(_) | Binary(_) | Where | Cast { .. } | Identity => crate::ops::elementwise::infer(self, ins),
            MatMul | Gemm { .. } => crate::ops::linalg::infer(self, ins),
            Conv(_) | MaxPool(_) | AveragePool(_) | GlobalAveragePool | GlobalMaxPool => {
                crate::ops::conv::infer(self, ins)
            }
            BatchNorm { .. } | LayerNorm { .. } | Lrn { .. } | Softmax { .. } | LogSoftmax { .. } | Hardmax { .. } => {
                crate::ops::norm::infer(self, ins)
            }
            Reshape { .. }
            | Transpose { .. }
            | Expand { .. }
            | Concat { .. }
            | Split { .. }
            | Slice { .. }
            | Gather { .. }
            | Pad { .. } => crate::ops::shape::infer(self, ins),
            Reduce { .. } => crate::ops::reduce::infer(self, ins),
            // Training ops (state, gradients, optimizer updates).
            BatchNormTrainGrad { .. } => crate::ops::norm::infer_batch_norm_train_grad(n, ins),
            UnaryGrad(_) => crate::ops::elementwise::infer_grad(self, ins),
            SoftmaxGrad { .. } | LayerNormGrad { .. } | LrnGrad { .. } => crate::ops::norm::infer_grad(self, ins),
            ConvInputGrad { .. } | ConvWeightGrad { .. } | MaxPoolGrad(_) | AveragePoolGrad { .. } => {
                crate::ops::conv::infer_grad(self, ins)
            }
            GatherGrad { .. } | SliceGrad { .. } => crate::ops::shape::infer_grad(self, ins),
            SgdUpdate { .. } | AdamWUpdate { .. } => crate::ops::training::infer_grad(self, ins),
            AttentionGrad(a) => a.infer_grad(n, ins),
            MoeGrad(a) => a.infer_grad(n, ins),
        }
    }

    /// Floating-point operations of one execution with the given input metas (multiply-add = 2).
    /// Data movement ops count 0. Saturates at `u64::MAX` (a 175B-parameter model's counts are
    /// far below it; a hostile attribute must not overflow).
    pub fn flops(&self, ins: &[TensorMeta], outs: &[TensorMeta]) -> u64 {
        use Op::*;
        // Saturating product of counts.
        fn mul(xs: &[u64]) -> u64 {
            xs.iter().fold(1u64, |a, &b| a.saturating_mul(b))
        }
        let numel = |m: Option<&TensorMeta>| m.map(|m| m.numel() as u64).unwrap_or(0);
        let out_n = numel(outs.first());
        let window = |a: &PoolAttrs| mul(&[a.kernel[0] as u64, a.kernel[1] as u64]);
        // Elements per output of a convolution: the product of W's dims after the first.
        let per_out =
            |w: Option<&TensorMeta>| w.map(|w| mul(&w.shape.iter().skip(1).map(|&d| d as u64).collect::<Vec<_>>()));
        let bias = if ins.len() > 2 { out_n } else { 0 };
        match self {
            MatMul => {
                let k = ins.first().and_then(|m| m.shape.last()).copied().unwrap_or(1) as u64;
                mul(&[2, k, out_n])
            }
            Gemm { trans_a, .. } => {
                let a = ins.first().map(|m| m.shape.as_slice()).unwrap_or(&[]);
                let k = a.get(if *trans_a { 0 } else { 1 }).copied().unwrap_or(0) as u64;
                mul(&[2, k, out_n]).saturating_add(bias)
            }
            Conv(_) => mul(&[2, per_out(ins.get(1)).unwrap_or(0), out_n]).saturating_add(bias),
            MaxPool(a) | AveragePool(a) => mul(&[window(a), out_n]),
            GlobalAveragePool | GlobalMaxPool | Reduce { .. } => numel(ins.first()),
            Unary(_) | Binary(_) | Where => out_n,
            // A multiply per element and a Philox block (10 rounds of two 32-bit products) per four.
            Dropout(_) => mul(&[6, out_n]),
            Hardmax { .. } => mul(&[2, out_n]),
            Index(crate::IndexOp::CumSum { .. }) => out_n,
            Index(crate::IndexOp::ArgMax { .. } | crate::IndexOp::ArgMin { .. }) => numel(ins.first()),
            Softmax { .. } | LogSoftmax { .. } => mul(&[5, out_n]),
            LayerNorm { .. } | BatchNorm { .. } => mul(&[8, out_n]),
            Lrn { size, .. } => mul(&[(*size as u64).saturating_add(4), out_n]),
            // Gradients cost what their forward op costs, times the work per element.
            ConvInputGrad { .. } => mul(&[2, per_out(ins.get(1)).unwrap_or(0), numel(ins.first())]),
            ConvWeightGrad { shape, .. } => {
                let per = mul(&shape.iter().skip(1).map(|&d| d as u64).collect::<Vec<_>>());
                mul(&[2, per, numel(ins.get(1))])
            }
            MaxPoolGrad(a) => mul(&[window(a), numel(ins.get(1))]),
            AveragePoolGrad { attrs: a, .. } => mul(&[window(a), numel(ins.first())]),
            UnaryGrad(_) => mul(&[4, out_n]),
            SoftmaxGrad { .. } => mul(&[4, out_n]),
            LayerNormGrad { .. } => mul(&[12, out_n]),
            BatchNormTrain { .. } => mul(&[10, out_n]),
            BatchNormTrainGrad { .. } => mul(&[14, out_n]),
            LrnGrad { size, .. } => mul(&[(*size as u64).saturating_mul(2).saturating_add(8), out_n]),
            GatherGrad { .. } | SliceGrad { .. } => numel(ins.last()),
            SgdUpdate { .. } => mul(&[4, out_n]),
            AdamWUpdate { .. } => mul(&[12, out_n]),
            Resize(a) => a.flops(out_n),
            ResizeGrad { attrs, .. } => attrs.flops(numel(ins.first())),
            Attention(a) => a.flops(ins),
            AttentionGrad(a) => a.grad_flops(ins),
            Moe(a) => a.flops(ins),
            MoeGrad(a) => a.grad_flops(ins),
            // Data movement, sources and the indexing ops that only copy: no arithmetic. Listed
            // one by one (no wildcard), so a new op decides its count here.
            Input { .. }
            | Param { .. }
            | Constant(_)
            | State { .. }
            | Cast { .. }
            | Identity
            | Reshape { .. }
            | Transpose { .. }
            | Expand { .. }
            | Concat { .. }
            | Split { .. }
            | Slice { .. }
            | Gather { .. }
            | Pad { .. } => 0,
            Index(
                crate::IndexOp::Trilu { .. }
                | crate::IndexOp::GatherElements { .. }
                | crate::IndexOp::ScatterElements { .. }
                | crate::IndexOp::GatherNd { .. }
                | crate::IndexOp::ScatterNd { .. }
                | crate::IndexOp::TopK { .. },
            ) => 0,
        }
    }
}

/// Shape after reducing `axes` of `shape`.
pub fn reduced_shape(shape: &[usize], axes: &[usize], keepdims: bool) -> Vec<usize> {
    let mut s = Vec::with_capacity(shape.len());
    for (d, &x) in shape.iter().enumerate() {
        if axes.contains(&d) {
            if keepdims {
                s.push(1);
            }
        } else {
            s.push(x);
        }
    }
    s
}

/// Output shape of a numpy matmul.
pub fn matmul_shape(a: &[usize], b: &[usize]) -> Result<Vec<usize>, InferError> {
    if a.is_empty() || b.is_empty() {
        return Err("matmul: operands must have rank >= 1".into());
    }
    let a2 = if a.len() == 1 { vec![1, a[0]] } else { a.to_vec() };
    let b2 = if b.len() == 1 { vec![b[0], 1] } else { b.to_vec() };
    let (m, k) = (a2[a2.len() - 2], a2[a2.len() - 1]);
    let (k2, n) = (b2[b2.len() - 2], b2[b2.len() - 1]);
    if k != k2 {
        return Err(format!("matmul: inner dims differ: {a:?} @ {b:?}"));
    }
    let batch = broadcast(&a2[..a2.len() - 2], &b2[..b2.len() - 2]).map_err(|e| format!("matmul batch dims: {e}"))?;
    let mut s = batch;
    if a.len() > 1 {
        s.push(m);
    }
    if b.len() > 1 {
        s.push(n);
    }
    Ok(s)
}

/// Text-form name of a unary op.
pub fn unary_name(u: UnaryOp) -> &'static str {
    use UnaryOp::*;
    match u {
        Relu => "relu",
        Gelu => "gelu",
        GeluTanh => "gelu_tanh",
        Tanh => "tanh",
        Erf => "erf",
        Sigmoid => "sigmoid",
        Exp => "exp",
        Log => "log",
        Sqrt => "sqrt",
        Neg => "neg",
        Reciprocal => "reciprocal",
        Abs => "abs",
        Not => "not",
        Floor => "floor",
        Ceil => "ceil",
        Sin => "sin",
        Cos => "cos",
        Sign => "sign",
        // The activations name themselves (no wildcard: a new unary op is named here).
        HardSigmoid { .. }
        | HardSwish
        | LeakyRelu { .. }
        | Elu { .. }
        | Selu { .. }
        | Celu { .. }
        | Softplus
        | Softsign
        | Mish
        | ThresholdedRelu { .. }
        | Shrink { .. }
        | Round
        | IsNaN
        | IsInf { .. }
        | Tan
        | Acos
        | Asin
        | Atan
        | Sinh
        | Cosh
        | Asinh
        | Acosh
        | Atanh
        | BitwiseNot => crate::ops::activation::name(u),
    }
}

/// True for unary ops with a [`Op::UnaryGrad`] (the others are piecewise constant or boolean).
pub fn unary_differentiable(u: UnaryOp) -> bool {
    use UnaryOp::*;
    // Every variant is named (no wildcard), so a new unary op decides here.
    match u {
        Not | Floor | Ceil | Sign | Round | IsNaN | IsInf { .. } | BitwiseNot => false,
        Relu
        | Gelu
        | GeluTanh
        | Tanh
        | Erf
        | Sigmoid
        | Exp
        | Log
        | Sqrt
        | Neg
        | Reciprocal
        | Abs
        | Sin
        | Cos
        | HardSigmoid { .. }
        | HardSwish
        | LeakyRelu { .. }
        | Elu { .. }
        | Selu { .. }
        | Celu { .. }
        | Softplus
        | Softsign
        | Mish
        | ThresholdedRelu { .. }
        | Shrink { .. }
        | Tan
        | Acos
        | Asin
        | Atan
        | Sinh
        | Cosh
        | Asinh
        | Acosh
        | Atanh => true,
    }
}

/// True when [`Op::UnaryGrad`] of `u` reads the forward output `y` instead of the input `x`:
/// `tanh' = 1 - y^2`, `sigmoid' = y (1 - y)`, `exp' = y`, `sqrt' = 1 / (2 y)`, `(1/x)' = -y^2`.
pub fn unary_grad_from_output(u: UnaryOp) -> bool {
    use UnaryOp::*;
    matches!(u, Tanh | Sigmoid | Exp | Sqrt | Reciprocal)
}

/// Text-form name of a unary op's gradient.
pub fn unary_grad_name(u: UnaryOp) -> &'static str {
    use UnaryOp::*;
    match u {
        Relu => "relu_grad",
        Gelu => "gelu_grad",
        GeluTanh => "gelu_tanh_grad",
        Tanh => "tanh_grad",
        Erf => "erf_grad",
        Sigmoid => "sigmoid_grad",
        Exp => "exp_grad",
        Log => "log_grad",
        Sqrt => "sqrt_grad",
        Neg => "neg_grad",
        Reciprocal => "reciprocal_grad",
        Abs => "abs_grad",
        Not => "not_grad",
        Floor => "floor_grad",
        Ceil => "ceil_grad",
        Sin => "sin_grad",
        Cos => "cos_grad",
        Sign => "sign_grad",
        HardSigmoid { .. }
        | HardSwish
        | LeakyRelu { .. }
        | Elu { .. }
        | Selu { .. }
        | Celu { .. }
        | Softplus
        | Softsign
        | Mish
        | ThresholdedRelu { .. }
        | Shrink { .. }
        | Round
        | IsNaN
        | IsInf { .. }
        | Tan
        | Acos
        | Asin
        | Atan
        | Sinh
        | Cosh
        | Asinh
        | Acosh
        | Atanh
        | BitwiseNot => crate::ops::activation::grad_name(u),
    }
}

/// Every unary op, for parsing and listing.
pub const UNARY_OPS: [UnaryOp; 42] = {
    use UnaryOp::*;
    let a = crate::ops::activation::OPS;
    [
        Relu, Gelu, GeluTanh, Tanh, Erf, Sigmoid, Exp, Log, Sqrt, Neg, Reciprocal, Abs, Not, Floor, Ceil, Sin, Cos,
        Sign, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15],
        a[16], a[17], a[18], a[19], a[20], a[21], a[22], a[23],
    ]
};

/// Text-form name of a binary op.
pub fn binary_name(b: BinaryOp) -> &'static str {
    use BinaryOp::*;
    match b {
        Add => "add",
        Sub => "sub",
        Mul => "mul",
        Div => "div",
        Pow => "pow",
        Max => "max",
        Min => "min",
        Equal => "equal",
        Less => "less",
        LessOrEqual => "less_equal",
        Greater => "greater",
        GreaterOrEqual => "greater_equal",
        And => "and",
        Or => "or",
        Xor => "xor",
        PRelu => "prelu",
        BitwiseAnd => "bitwise_and",
        BitwiseOr => "bitwise_or",
        BitwiseXor => "bitwise_xor",
        Mod => "mod",
        Fmod => "fmod",
    }
}

/// Every binary op, for parsing and listing.
pub const BINARY_OPS: [BinaryOp; 21] = {
    use BinaryOp::*;
    [
        Add,
        Sub,
        Mul,
        Div,
        Pow,
        Max,
        Min,
        Equal,
        Less,
        LessOrEqual,
        Greater,
        GreaterOrEqual,
        And,
        Or,
        Xor,
        PRelu,
        BitwiseAnd,
        BitwiseOr,
        BitwiseXor,
        Mod,
        Fmod,
    ]
};

/// Text-form name of a reduction.
pub fn reduce_name(r: ReduceOp) -> &'static str {
    use ReduceOp::*;
    match r {
        Sum => "reduce_sum",
        Mean => "reduce_mean",
        Max => "reduce_max",
        Min => "reduce_min",
        Prod => "reduce_prod",
        SumSquare => "reduce_sum_square",
        L2 => "reduce_l2",
        L1 => "reduce_l1",
        LogSum => "reduce_log_sum",
        LogSumExp => "reduce_log_sum_exp",
    }
}

/// Every reduction, for parsing and listing.
pub const REDUCE_OPS: [ReduceOp; 10] = {
    use ReduceOp::*;
    [Sum, Mean, Max, Min, Prod, SumSquare, L2, L1, LogSum, LogSumExp]
};
