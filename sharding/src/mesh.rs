//! Device meshes and device profiles.
//!
//! A [`DeviceMesh`] is an N-D grid of ranks. Axis 0 is outermost (across machines), the last axis
//! innermost (fastest links); ranks are numbered row-major, so the last coordinate varies fastest.
//! Every axis has a [`Link`] (alpha in seconds, beta in seconds per byte) used by the collective
//! cost model. A [`DeviceProfile`] gives one device's compute throughput, memory bandwidth and
//! capacity, and the links within and across machines from which a mesh's links are derived.

use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

/// Latency and inverse bandwidth of one mesh axis: a message of `b` bytes (as the collective's
/// cost counts them, ring factor included) costs `alpha + b * beta` seconds; with
/// [`Link::segments`], messages from a segment's size on follow that segment's line instead.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Link {
    /// Latency per collective, seconds.
    pub alpha: f64,
    /// Seconds per byte (1 / bandwidth).
    pub beta: f64,
    /// Further regimes for larger messages, by increasing `from_bytes`, as `autopar profile`
    /// finds them on CPUs: a transport's protocol switch (MPI's eager limit), blocks that no
    /// longer fit the caches and move at memory speed. Empty: one line for every size
    /// (datasheet links).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub segments: Vec<Segment>,
    /// The link of collectives that only move data (all-gather, all-to-all, broadcast) when
    /// measured apart from the reductions this link describes: transports run them with other
    /// algorithms (Open MPI's all-reduce of 64-128 KiB takes twice its all-gather's time).
    /// `None`: the same link for every collective.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gather: Option<Box<Link>>,
}

/// A size range of a [`Link`] with its own line.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Segment {
    /// Messages of at least this many bytes (as [`Link::time`] counts them) take this line,
    /// up to the next segment's `from_bytes`.
    pub from_bytes: f64,
    /// Intercept, seconds: may be negative (the line only covers sizes from `from_bytes`,
    /// where its time must not be negative).
    pub alpha: f64,
    /// Seconds per byte.
    pub beta: f64,
}

impl Link {
    /// A link from a latency in seconds and a bandwidth in bytes per second.
    pub fn new(alpha: f64, bytes_per_second: f64) -> Link {
        Link { alpha, beta: 1.0 / bytes_per_second, segments: vec![], gather: None }
    }

    /// A one-line link from a latency and seconds per byte.
    pub fn linear(alpha: f64, beta: f64) -> Link {
        Link { alpha, beta, segments: vec![], gather: None }
    }

    /// The link of data-moving collectives ([`Link::gather`], or this one).
    pub fn for_gather(&self) -> &Link {
        self.gather.as_deref().unwrap_or(self)
    }

    /// Seconds for a message of `bytes` (ring factor included).
    pub fn time(&self, bytes: f64) -> f64 {
        match self.segments.iter().rev().find(|s| bytes >= s.from_bytes) {
            Some(s) => s.alpha + bytes * s.beta,
            None => self.alpha + bytes * self.beta,
        }
    }

    /// The same link with `seconds` more latency per collective, in every segment and in the
    /// [`Link::gather`] link: what a collective costs beyond the line measured in a tight loop,
    /// such as the waiting for the other ranks inside a running program.
    pub fn with_latency(&self, seconds: f64) -> Link {
        Link {
            alpha: self.alpha + seconds,
            beta: self.beta,
            segments: self.segments.iter().map(|s| Segment { alpha: s.alpha + seconds, ..*s }).collect(),
            gather: self.gather.as_ref().map(|g| Box::new(g.with_latency(seconds))),
        }
    }

    /// Checks that the link's figures are finite, latencies `>= 0`, per-byte costs `> 0`, and
    /// segments in increasing order with non-negative times where they start.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let ok = |a: f64, b: f64| a.is_finite() && a >= 0.0 && b.is_finite() && b > 0.0;
        if !ok(self.alpha, self.beta) {
            return Err("alpha must be >= 0 and beta > 0".into());
        }
        let mut last = 0.0;
        for s in &self.segments {
            let starts_positive = ok(s.alpha + s.from_bytes * s.beta, s.beta);
            if !(s.from_bytes.is_finite() && s.from_bytes > last && s.alpha.is_finite() && starts_positive) {
                return Err(format!(
                    "segment from {} B: sizes must increase, beta be > 0 and the time at from_bytes >= 0",
                    s.from_bytes
                ));
            }
            last = s.from_bytes;
        }
        if let Some(g) = &self.gather {
            g.validate().map_err(|why| format!("gather: {why}"))?;
        }
        Ok(())
    }
}

/// One device's throughput and capacity, and the links between devices.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeviceProfile {
    /// Name (`cpu`, `a100-80g`, ...).
    pub name: String,
    /// Dense f32 FLOP/s used for f32 ops (for GPUs: TF32 tensor-core rate, PyTorch's matmul default
    /// on Ampere and later when TF32 is allowed; see `f32_flops_exact`).
    pub f32_flops: f64,
    /// Dense f32 FLOP/s without tensor cores (IEEE f32 on CUDA cores; equal to `f32_flops` on CPU).
    pub f32_flops_exact: f64,
    /// Dense bf16 (and f16) FLOP/s: the rate of ops computing in 16 bits under mixed precision
    /// (tensor cores on GPUs; on the CPU the same as f32, which it computes in).
    pub bf16_flops: f64,
    /// The fraction of the FLOP/s above that dense products reach at best: built-in GPU
    /// profiles take the maximum achievable matmul FLOP/s over the datasheet's (published
    /// measurements over many shapes; see [`DeviceProfile::builtin`]), since no kernel runs at
    /// the datasheet's peak. Every op's FLOPs are priced at `rate * flops_efficiency`; MFU is
    /// still counted against the datasheet rate. 1 for measured profiles (`autopar profile`),
    /// whose rates are achieved ones, and for files written before the field existed.
    #[serde(default = "one")]
    pub flops_efficiency: f64,
    /// Memory bandwidth, bytes per second.
    pub memory_bandwidth: f64,
    /// Memory capacity, bytes.
    pub memory_bytes: u64,
    /// Devices per machine: mesh axes whose inner product fits in it use `intra_node`.
    pub devices_per_node: usize,
    /// Link between devices of one machine.
    pub intra_node: Link,
    /// Link between machines.
    pub inter_node: Link,
    /// Seconds an op instruction of a family without a fit ([`DeviceProfile::op_costs`]) costs
    /// beyond its roofline time (dispatch, output allocation, bookkeeping of the executor):
    /// `autopar profile` writes the median fitted fixed cost; 0 in the built-in profiles (and in
    /// profile files written before it was measured).
    #[serde(default)]
    pub op_seconds: f64,
    /// FLOP/s of convolutions (and their gradients) when measured (`autopar profile`); the
    /// matrix-product rate otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conv_flops: Option<f64>,
    /// Costs fitted per op family ([`cost_family`]) on measured training steps (`autopar
    /// profile`); an op of a family listed here is priced by its fit alone, the others by
    /// [`DeviceProfile::op_seconds`] plus the roofline. Empty in the built-in profiles.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub op_costs: BTreeMap<String, OpCost>,
    /// Where the figures come from.
    pub source: String,
    /// Links measured per axis of one mesh (`autopar profile --mesh`): a mesh of exactly this
    /// shape takes them instead of `intra_node` / `inter_node`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mesh_axes: Option<MeshAxes>,
}

/// The measured cost of one op family: `fixed + per_byte * bytes + per_flop * flops` seconds,
/// where `bytes` are the op's inputs and outputs and `flops` its [`ir::Op::flops`] (both of the
/// local shapes). `fixed` includes the executor's share per instruction (dispatch, the output's
/// allocation and its free).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OpCost {
    /// Seconds per instruction.
    pub fixed: f64,
    /// Seconds per byte read or written.
    pub per_byte: f64,
    /// Seconds per floating-point operation (at f32; 16-bit ops scale it by the profile's
    /// `f32_flops / bf16_flops`).
    pub per_flop: f64,
    /// How many timed instructions the fit is made of.
    #[serde(default)]
    pub samples: usize,
}

impl OpCost {
    /// The fitted seconds of an op of this family.
    pub fn seconds(&self, bytes: f64, flops: f64) -> f64 {
        self.fixed + self.per_byte * bytes + self.per_flop * flops
    }
}

/// The family an op is priced by: its name ([`ir::Op::name`]); convolutions and their gradients
/// by their kind too, `conv/depthwise` (one input channel per group: its time is not that of a
/// dense one of the same FLOPs), `conv/grouped` (other grouped ones: a small product per
/// group), `conv/1x1` (a pointwise
/// one, stride 1 and no padding, is a plain matrix product) and `conv` (the others, which
/// gather their patches first); `gemm` by which operand is transposed (`gemm/ta`, `gemm/tb`,
/// `gemm/tab`), with the thin products the CPU runs as dot products apart (`gemm/tb/thin`).
/// `ins` are the op's (local) input metas (the weight's gives the kernel).
pub fn cost_family(op: &ir::Op, ins: &[ir::TensorMeta]) -> String {
    // The weight's shape `[out, in / group, kh, kw]`.
    let (attrs, weight) = match op {
        ir::Op::Conv(a) => (a, ins.get(1).map(|w| &w.shape[..])),
        ir::Op::ConvInputGrad { attrs, .. } => (attrs, ins.get(1).map(|w| &w.shape[..])),
        ir::Op::ConvWeightGrad { attrs, shape } => (attrs, Some(&shape[..])),
        // A product with a transposed operand reads it with strides (and the CPU kernel then
        // picks another implementation for some shapes).
        ir::Op::Gemm { trans_a, trans_b, .. } => {
            let t = match (trans_a, trans_b) {
                (false, false) => "",
                (true, false) => "/ta",
                (false, true) if thin_product(ins) => "/tb/thin",
                (false, true) => "/tb",
                (true, true) => "/tab",
            };
            return format!("gemm{t}");
        }
        _ => return op.name().to_string(),
    };
    let pointwise = weight.and_then(|w| w.get(2..4)).map(|k| k == [1, 1]);
    // One input and one output channel per group (plans split only the batch of a grouped
    // convolution, so the weight is whole on every rank): depthwise, which the CPU runs tap by
    // tap over each channel's plane; other grouped convolutions (a channel multiplier
    // included) are a small product per group.
    let depthwise = weight.is_some_and(|w| w.len() == 4 && w[1] == 1 && w[0] == attrs.group);
    if attrs.group > 1 && depthwise {
        format!("{}/depthwise", op.name())
    } else if attrs.group > 1 {
        format!("{}/grouped", op.name())
    } else if pointwise == Some(true) && attrs.strides == [1, 1] && attrs.pads == [0; 4] {
        format!("{}/1x1", op.name())
    } else {
        op.name().to_string()
    }
}

/// Whether a `Gemm` of `[m, k]` against a transposed `[n, k]` (`ins`: its local inputs) is one
/// the CPU kernel runs as dot products: 2 to 32 rows or columns, more than 256 outputs, depth
/// at least 256 (`kernels::cpu::gemm_kernel`'s `Dots`, which `tests/tests/strategies.rs` checks
/// this against). They run at about half the FLOP rate of the packed products the other
/// `gemm/tb` instructions are (the mlp's forward layers: 104 against 202 GFLOP/s for the same
/// shape untransposed, `cargo bench -p kernels --bench train mlp`), so they are priced apart.
fn thin_product(ins: &[ir::TensorMeta]) -> bool {
    match (ins.first().map(|a| &a.shape[..]), ins.get(1).map(|b| &b.shape[..])) {
        (Some(&[m, k]), Some(&[n, _])) => (2..=32).contains(&m.min(n)) && m * n > 256 && k >= 256,
        _ => false,
    }
}

/// The work the cost model prices an op by: its FLOPs ([`ir::Op::flops`]) and the bytes of its
/// inputs and outputs, for these (local) metas.
pub fn op_work(op: &ir::Op, ins: &[ir::TensorMeta], outs: &[ir::TensorMeta]) -> (f64, f64) {
    let bytes: usize = ins.iter().chain(outs).map(|m| m.bytes()).sum();
    (op.flops(ins, outs) as f64, bytes as f64)
}

/// Links measured on the axes of a mesh of one shape.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MeshAxes {
    /// The mesh shape they were measured on.
    pub shape: Vec<usize>,
    /// One link per axis, outermost first.
    pub links: Vec<Link>,
}

const GIB: u64 = 1 << 30;
const GB: f64 = 1e9;

fn one() -> f64 {
    1.0
}

/// Maximum achievable BF16 matmul FLOP/s (MAMF) of an A100 SXM and of an H100 SXM (the H200
/// the same), the best of many shapes measured with `torch.matmul`: 271.2 TFLOP/s of 312 (86.9%)
/// and 794.5 of 989 (80.3%). Source: S. Bekman, Machine Learning Engineering Open Book,
/// compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison table"
/// (github.com/stas00/ml-engineering, commit 744d01e). The BF16 fraction is also taken for the
/// TF32 rate, which the table does not measure.
const A100_MAMF: f64 = 271.2e12;
const H100_MAMF: f64 = 794.5e12;
/// The largest device or mesh profile file read (they are a few kilobytes of JSON).
const MAX_PROFILE_BYTES: u64 = 64 << 20;

impl DeviceProfile {
    /// The built-in profiles' names.
    pub const BUILTIN: [&'static str; 4] = ["cpu", "a100-80g", "h100-sxm", "h200"];

    /// A built-in profile by name (`a100` and `h100` are accepted as aliases).
    pub fn builtin(name: &str) -> Option<DeviceProfile> {
        match name {
            // Measured on the development host (AMD EPYC, AVX2; BENCHMARKS.md): one rank is one
            // thread. GEMM 1024^3 with the `gemm` crate: 71.7 GFLOP/s on one thread. Copy bandwidth
            // of one thread (a 64 MiB memcpy): ~10 GB/s. Threads of one process exchange data by
            // memcpy through shared memory: ~5 us per collective and the copy bandwidth.
            "cpu" => Some(DeviceProfile {
                name: "cpu".into(),
                f32_flops: 71.7e9,
                f32_flops_exact: 71.7e9,
                bf16_flops: 71.7e9,
                flops_efficiency: 1.0,
                memory_bandwidth: 10.0 * GB,
                memory_bytes: 16 * GIB,
                devices_per_node: 64,
                intra_node: Link::new(5e-6, 10.0 * GB),
                inter_node: Link::new(20e-6, 12.5 * GB),
                op_seconds: 0.0,
                conv_flops: None,
                op_costs: BTreeMap::new(),
                source: "measured on the development host (see BENCHMARKS.md); inter-node: 100 Gb/s Ethernet".into(),
                mesh_axes: None,
            }),
            // NVIDIA A100 Tensor Core GPU datasheet (2021), SXM 80GB: FP32 19.5 TFLOPS, TF32 156
            // TFLOPS and BF16 312 TFLOPS dense, HBM2e 2,039 GB/s, 80 GB, NVLink 600 GB/s
            // (bidirectional: 300 GB/s each way). Inter-node: one HDR InfiniBand 200 Gb/s NIC per
            // GPU (25 GB/s), as in DGX A100. Latencies are typical NCCL figures, not datasheet.
            "a100-80g" | "a100" => Some(DeviceProfile {
                name: "a100-80g".into(),
                f32_flops: 156e12,
                f32_flops_exact: 19.5e12,
                bf16_flops: 312e12,
                flops_efficiency: A100_MAMF / 312e12,
                memory_bandwidth: 2039.0 * GB,
                memory_bytes: 80 * GIB,
                devices_per_node: 8,
                intra_node: Link::new(10e-6, 300.0 * GB),
                inter_node: Link::new(20e-6, 25.0 * GB),
                op_seconds: 0.0,
                conv_flops: None,
                op_costs: BTreeMap::new(),
                source: "NVIDIA A100 datasheet (SXM 80GB), products at the maximum achievable matmul FLOP/s (ml-engineering MAMF table); DGX A100 networking".into(),
                mesh_axes: None,
            }),
            // NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: FP32 67 TFLOPS, TF32 494.7 TFLOPS and
            // BF16 989.4 TFLOPS dense (the datasheet's 989/1,979 figures are with sparsity),
            // HBM3 3.35 TB/s, 80 GB, NVLink 900 GB/s (450 GB/s each way). Inter-node: one NDR
            // InfiniBand 400 Gb/s NIC per GPU (50 GB/s), as in DGX H100.
            "h100-sxm" | "h100" => Some(DeviceProfile {
                name: "h100-sxm".into(),
                f32_flops: 494.7e12,
                f32_flops_exact: 67e12,
                bf16_flops: 989.4e12,
                flops_efficiency: H100_MAMF / 989.4e12,
                memory_bandwidth: 3350.0 * GB,
                memory_bytes: 80 * GIB,
                devices_per_node: 8,
                intra_node: Link::new(10e-6, 450.0 * GB),
                inter_node: Link::new(20e-6, 50.0 * GB),
                op_seconds: 0.0,
                conv_flops: None,
                op_costs: BTreeMap::new(),
                source: "NVIDIA H100 datasheet (SXM), products at the maximum achievable matmul FLOP/s (ml-engineering MAMF table); DGX H100 networking".into(),
                mesh_axes: None,
            }),
            // NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: same compute as H100 SXM (FP32 67,
            // TF32 494.7 and BF16 989.4 TFLOPS dense), HBM3e 4.8 TB/s, 141 GB, NVLink 900 GB/s.
            "h200" => Some(DeviceProfile {
                name: "h200".into(),
                f32_flops: 494.7e12,
                f32_flops_exact: 67e12,
                bf16_flops: 989.4e12,
                flops_efficiency: H100_MAMF / 989.4e12,
                memory_bandwidth: 4800.0 * GB,
                memory_bytes: 141_000_000_000,
                devices_per_node: 8,
                intra_node: Link::new(10e-6, 450.0 * GB),
                inter_node: Link::new(20e-6, 50.0 * GB),
                op_seconds: 0.0,
                conv_flops: None,
                op_costs: BTreeMap::new(),
                source: "NVIDIA H200 datasheet (SXM), products at the H100's maximum achievable matmul FLOP/s (ml-engineering MAMF table); DGX H200 networking".into(),
                mesh_axes: None,
            }),
            _ => None,
        }
    }

    /// A built-in name, or else a JSON file holding a [`DeviceProfile`].
    pub fn load(name_or_path: &str) -> Result<DeviceProfile> {
        if let Some(p) = DeviceProfile::builtin(name_or_path) {
            return Ok(p);
        }
        let err = |why: String| Error::Profile { source_name: name_or_path.to_string(), why };
        let text =
            ir::files::read_regular_to_string(std::path::Path::new(name_or_path), MAX_PROFILE_BYTES).map_err(|e| {
                err(format!(
                    "not a built-in profile ({}) and not a readable file: {e}",
                    DeviceProfile::BUILTIN.join(", ")
                ))
            })?;
        let p: DeviceProfile = serde_json::from_str(&text).map_err(|e| err(e.to_string()))?;
        p.check().map_err(err)?;
        Ok(p)
    }

    fn check(&self) -> std::result::Result<(), String> {
        // Ranges far wider than any device's (a kiloFLOP/s to a zettaFLOP/s, a kilobyte per second
        // to an exabyte per second): a denormal or absurd rate makes every time infinite or zero,
        // and planning then contradicts itself ("no plan fits" a plan that fits).
        let within = |v: f64, lo: f64, hi: f64, what: &str| {
            if v.is_finite() && (lo..=hi).contains(&v) {
                Ok(())
            } else {
                Err(format!("{what} must be from {lo:e} to {hi:e}, got {v:e}"))
            }
        };
        within(self.f32_flops, 1e3, 1e21, "f32_flops (FLOP/s)")?;
        within(self.f32_flops_exact, 1e3, 1e21, "f32_flops_exact (FLOP/s)")?;
        within(self.bf16_flops, 1e3, 1e21, "bf16_flops (FLOP/s)")?;
        if !(self.flops_efficiency.is_finite() && self.flops_efficiency > 0.01 && self.flops_efficiency <= 1.0) {
            return Err(format!("flops_efficiency must be above 0.01 and at most 1, got {}", self.flops_efficiency));
        }
        within(self.memory_bandwidth, 1e3, 1e18, "memory_bandwidth (bytes/s)")?;
        if !(1 << 20..=1 << 60).contains(&self.memory_bytes) {
            return Err(format!("memory_bytes must be from 1 MiB to 1 EiB, got {}", self.memory_bytes));
        }
        if !(self.op_seconds.is_finite() && (0.0..1.0).contains(&self.op_seconds)) {
            return Err(format!("op_seconds must be from 0 to 1 s, got {}", self.op_seconds));
        }
        if let Some(c) = self.conv_flops {
            within(c, 1e3, 1e21, "conv_flops (FLOP/s)")?;
        }
        for (family, c) in &self.op_costs {
            // Bounds far above any device (a second per instruction, a millisecond per byte or
            // FLOP) keep every priced op finite.
            let ok = |v: f64, max: f64| v.is_finite() && (0.0..max).contains(&v);
            if !(ok(c.fixed, 1.0) && ok(c.per_byte, 1e-3) && ok(c.per_flop, 1e-3)) {
                return Err(format!(
                    "op_costs.{family}: fixed (s), per_byte and per_flop (s) must be >= 0 and below 1, 1e-3 and 1e-3"
                ));
            }
        }
        for (l, what) in [(&self.intra_node, "intra_node"), (&self.inter_node, "inter_node")] {
            l.validate().map_err(|why| format!("{what}: {why}"))?;
            // A link of a kilobyte per second to an exabyte per second, with at most an hour of
            // latency.
            within(l.beta, 1e-18, 1e-3, &format!("{what}.beta (seconds per byte)"))?;
            within(l.alpha, 0.0, 3600.0, &format!("{what}.alpha (seconds)"))?;
        }
        if self.devices_per_node == 0 {
            return Err("devices_per_node must be >= 1".into());
        }
        if let Some(m) = &self.mesh_axes {
            if m.links.len() != m.shape.len() {
                return Err("mesh_axes needs one link per axis of its shape".into());
            }
            for (i, l) in m.links.iter().enumerate() {
                l.validate().map_err(|why| format!("mesh_axes axis {i}: {why}"))?;
            }
        }
        Ok(())
    }

    /// Seconds to run `flops` floating-point operations touching `bytes` of memory (roofline),
    /// plus the fixed cost of an instruction ([`DeviceProfile::op_seconds`]). FLOPs run at the
    /// achievable rate ([`DeviceProfile::flops_efficiency`]).
    pub fn compute_seconds(&self, flops: f64, bytes: f64) -> f64 {
        self.op_seconds + (flops / (self.f32_flops * self.flops_efficiency)).max(bytes / self.memory_bandwidth)
    }
    /// [`DeviceProfile::compute_seconds`] for an op computing in `dtype`: 16-bit floats at
    /// [`DeviceProfile::bf16_flops`].
    pub fn compute_seconds_in(&self, dtype: ir::DType, flops: f64, bytes: f64) -> f64 {
        let rate = if dtype.is_half() { self.bf16_flops } else { self.f32_flops } * self.flops_efficiency;
        self.op_seconds + (flops / rate).max(bytes / self.memory_bandwidth)
    }

    /// The fitted cost a family is priced by: its own, else (a profile written before the
    /// family existed) the one it was split from: `*/grouped` for depthwise convolutions,
    /// `gemm/tb` for thin products.
    pub fn fitted_cost(&self, family: &str) -> Option<&OpCost> {
        self.op_costs
            .get(family)
            .or_else(|| family.strip_suffix("/depthwise").and_then(|f| self.op_costs.get(&format!("{f}/grouped"))))
            .or_else(|| family.strip_suffix("/thin").and_then(|f| self.op_costs.get(f)))
    }

    /// [`DeviceProfile::compute_seconds_in`] for `op`: by its family's fitted cost when the
    /// profile has one ([`DeviceProfile::op_costs`]); else convolutions at
    /// [`DeviceProfile::conv_flops`] when measured (scaled by the 16-bit speed-up).
    /// Sources (parameters, optimizer state, inputs, constants) cost nothing: they are looked
    /// up, not run, and the ops reading them are priced with those bytes among their inputs
    /// (a source priced at its bytes over the memory bandwidth counted every parameter's bytes
    /// twice a step, which favoured sharding them). `ins` are the op's (local) input metas.
    pub fn op_compute_seconds(
        &self,
        op: &ir::Op,
        ins: &[ir::TensorMeta],
        dtype: ir::DType,
        flops: f64,
        bytes: f64,
    ) -> f64 {
        if op.is_source() {
            return 0.0;
        }
        if let Some(c) = self.fitted_cost(&cost_family(op, ins)) {
            // Fitted on f32 steps: a 16-bit op's FLOPs at the profile's 16-bit speed-up (none on a
            // CPU, which computes bf16 in f32), its bytes as they are.
            let flops = if dtype.is_half() { flops * self.f32_flops / self.bf16_flops } else { flops };
            return c.seconds(bytes, flops);
        }
        let conv = matches!(op, ir::Op::Conv(_) | ir::Op::ConvInputGrad { .. } | ir::Op::ConvWeightGrad { .. });
        match self.conv_flops {
            Some(c) if conv => {
                let rate = if dtype.is_half() { c * self.bf16_flops / self.f32_flops } else { c };
                self.op_seconds + (flops / rate).max(bytes / self.memory_bandwidth)
            }
            _ => self.compute_seconds_in(dtype, flops, bytes),
        }
    }
}

/// Measured links of a mesh, one per axis (outermost first), as `autopar profile` writes them:
/// `{"axes": [{"alpha": 2e-5, "beta": 4e-11}, ...]}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MeshProfile {
    /// Link of each mesh axis.
    pub axes: Vec<Link>,
}

impl MeshProfile {
    /// Reads a mesh profile from a JSON file.
    pub fn load(path: &str) -> Result<MeshProfile> {
        let err = |why: String| Error::Profile { source_name: path.to_string(), why };
        let text = ir::files::read_regular_to_string(std::path::Path::new(path), MAX_PROFILE_BYTES)
            .map_err(|e| err(e.to_string()))?;
        let p: MeshProfile = serde_json::from_str(&text).map_err(|e| err(e.to_string()))?;
        for (i, l) in p.axes.iter().enumerate() {
            l.validate().map_err(|why| err(format!("axis {i}: {why}")))?;
        }
        Ok(p)
    }
}

/// An N-D grid of ranks with a name and a link per axis.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeviceMesh {
    shape: Vec<usize>,
    names: Vec<String>,
    links: Vec<Link>,
}

impl DeviceMesh {
    /// A mesh with explicit axis names and links (one of each per axis).
    pub fn new(shape: Vec<usize>, names: Vec<String>, links: Vec<Link>) -> Result<DeviceMesh> {
        let text = shape.iter().map(|s| s.to_string()).collect::<Vec<_>>().join("x");
        let err = |why: &str| Error::Mesh { text: text.clone(), why: why.to_string() };
        if shape.is_empty() {
            return Err(err("a mesh needs at least one axis"));
        }
        if shape.contains(&0) {
            return Err(err("axis sizes must be >= 1"));
        }
        if shape.len() > 10 {
            return Err(err("at most 10 axes (specs name axes by one digit)"));
        }
        // Every rank number, group size and coordinate computation multiplies axis sizes: one
        // check here keeps them all from wrapping.
        if shape.iter().try_fold(1usize, |acc, &s| acc.checked_mul(s)).is_none() {
            return Err(err("the number of ranks (the product of the axis sizes) overflows"));
        }
        if names.len() != shape.len() || links.len() != shape.len() {
            return Err(err("one name and one link per axis"));
        }
        for (i, n) in names.iter().enumerate() {
            if n.is_empty() || names[..i].contains(n) {
                return Err(err(&format!("axis name `{n}` is empty or repeated")));
            }
        }
        Ok(DeviceMesh { shape, names, links })
    }

    /// This mesh with each run of adjacent axes of the same link merged into one axis (sizes
    /// multiplied, names joined with `+`), from axis `from` on (axes before it are kept as
    /// they are). Ranks keep their numbers: the merged axis enumerates its parts' coordinates
    /// in the same row-major order. A collective over a merged axis costs what it costs over
    /// its parts together; what is lost is splitting over one part alone.
    pub fn merged_same_links(&self, from: usize) -> DeviceMesh {
        self.merged_where(from, |_, _| true)
    }

    /// [`DeviceMesh::merged_same_links`], merging axis `a` into the axis before it (`a - 1`)
    /// only when also `joins(a - 1, a)`.
    pub fn merged_where(&self, from: usize, joins: impl Fn(usize, usize) -> bool) -> DeviceMesh {
        let (mut shape, mut names, mut links) = (vec![], vec![], vec![]);
        for a in 0..self.ndim() {
            if a > from && links.last() == Some(&self.links[a]) && joins(a - 1, a) {
                let k = shape.len() - 1;
                shape[k] *= self.shape[a];
                names[k] = format!("{}+{}", names[k], self.names[a]);
            } else {
                shape.push(self.shape[a]);
                names.push(self.names[a].clone());
                links.push(self.links[a].clone());
            }
        }
        DeviceMesh { shape, names, links }
    }

    /// A mesh whose links come from a device profile: an axis is within one machine when the
    /// product of its size and the sizes of all inner axes fits in `devices_per_node`.
    pub fn with_profile(shape: Vec<usize>, names: Vec<String>, profile: &DeviceProfile) -> Result<DeviceMesh> {
        if let Some(m) = &profile.mesh_axes
            && m.shape == shape
            && m.links.len() == shape.len()
        {
            return DeviceMesh::new(shape, names, m.links.clone());
        }
        let links = (0..shape.len())
            .map(|a| {
                let inner: usize = shape[a..].iter().product();
                if inner <= profile.devices_per_node { profile.intra_node.clone() } else { profile.inter_node.clone() }
            })
            .collect();
        DeviceMesh::new(shape, names, links)
    }

    /// Parses `2x4` (axes named `m0`, `m1`, ...) or `data=2,tensor=4`, first axis outermost.
    /// Named axes may state their link (else the profile's, by [`DeviceMesh::with_profile`]):
    /// `node=8:ib,gpu=8:nvlink` (`intra`/`nvlink` is the profile's link within a machine,
    /// `inter`/`ib` across machines), or a bandwidth and optional latency,
    /// `pod=4:25GB/s+30us` (latency default: the profile's inter-node one).
    pub fn parse(text: &str, profile: &DeviceProfile) -> Result<DeviceMesh> {
        let err = |why: String| Error::Mesh { text: text.to_string(), why };
        let t = text.trim();
        let (shape, names) = if t.contains('=') {
            let mut shape = vec![];
            let mut names = vec![];
            let mut links: Vec<Option<Link>> = vec![];
            for part in t.split(',') {
                let (n, s) = part
                    .split_once('=')
                    .ok_or_else(|| err(format!("`{part}` is not NAME=SIZE (write data=2,tensor=4)")))?;
                let (s, link) = match s.split_once(':') {
                    Some((s, l)) => (s, Some(parse_link(l.trim(), profile).map_err(&err)?)),
                    None => (s, None),
                };
                let size: usize =
                    s.trim().parse().map_err(|_| err(format!("`{s}` is not an axis size (a positive integer)")))?;
                names.push(n.trim().to_string());
                shape.push(size);
                links.push(link);
            }
            if links.iter().any(Option::is_some) {
                let derived = DeviceMesh::with_profile(shape.clone(), names.clone(), profile).map_err(|e| match e {
                    Error::Mesh { why, .. } => err(why),
                    other => other,
                })?;
                let links = links.into_iter().zip(derived.links).map(|(l, d)| l.unwrap_or(d)).collect();
                return DeviceMesh::new(shape, names, links).map_err(|e| match e {
                    Error::Mesh { why, .. } => err(why),
                    other => other,
                });
            }
            (shape, names)
        } else {
            let mut shape = vec![];
            for s in t.split(['x', 'X']) {
                let size: usize = s.trim().parse().map_err(|_| {
                    err(format!("`{s}` is not an axis size (write 2x4, or name the axes: data=2,tensor=4)"))
                })?;
                shape.push(size);
            }
            let names = (0..shape.len()).map(|i| format!("m{i}")).collect();
            (shape, names)
        };
        DeviceMesh::with_profile(shape, names, profile).map_err(|e| match e {
            Error::Mesh { why, .. } => err(why),
            other => other,
        })
    }

    /// A mesh with uniform unit links, for tests and examples.
    pub fn uniform(shape: &[usize]) -> Result<DeviceMesh> {
        let names = (0..shape.len()).map(|i| format!("m{i}")).collect();
        DeviceMesh::new(shape.to_vec(), names, vec![Link::linear(1e-5, 1e-10); shape.len()])
    }

    /// Axis sizes, outermost first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// Number of axes.
    pub fn ndim(&self) -> usize {
        self.shape.len()
    }
    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.shape.iter().product()
    }
    /// Axis names.
    pub fn names(&self) -> &[String] {
        &self.names
    }
    /// Link of each axis.
    pub fn links(&self) -> &[Link] {
        &self.links
    }
    /// Replaces the link of each axis by a measured mesh profile's.
    pub fn apply_profile(&mut self, p: &MeshProfile) -> Result<()> {
        if p.axes.len() != self.ndim() {
            let why = format!("the mesh profile has {} axes, the mesh {}", p.axes.len(), self.ndim());
            return Err(Error::Mesh { text: self.to_string(), why });
        }
        self.links = p.axes.clone();
        Ok(())
    }

    /// Checks that `axes` name distinct axes of this mesh: what [`DeviceMesh::group_size`],
    /// [`DeviceMesh::group_of`] and [`DeviceMesh::index_in_group`] need (they index the shape
    /// by axis, and a repeated axis makes a group list ranks twice, whose collectives never
    /// complete).
    pub fn check_axes(&self, axes: &[usize]) -> std::result::Result<(), String> {
        for (i, &a) in axes.iter().enumerate() {
            if a >= self.ndim() {
                return Err(format!("mesh axis {a} does not exist (the mesh has {} axes)", self.ndim()));
            }
            if axes[..i].contains(&a) {
                return Err(format!("mesh axis {a} appears twice in {axes:?}"));
            }
        }
        Ok(())
    }

    /// Product of the sizes of some axes.
    pub fn group_size(&self, axes: &[usize]) -> usize {
        axes.iter().map(|&a| self.shape[a]).product()
    }

    /// The link a collective over several axes is limited by: the slowest axis's latency and
    /// bandwidth (a ring over the group crosses every axis's links). Segments are dropped: use
    /// [`DeviceMesh::time`] for a collective's time.
    pub fn link(&self, axes: &[usize]) -> Link {
        axes.iter().fold(Link::linear(0.0, 0.0), |acc, &a| {
            Link::linear(acc.alpha.max(self.links[a].alpha), acc.beta.max(self.links[a].beta))
        })
    }

    /// Seconds for a message of `bytes` (ring factor included) over `axes`, of a reduction or
    /// (`gather`) of a collective that only moves data: [`DeviceMesh::link`]'s line, or, when
    /// some axis has measured segments or per-kind links, the slowest axis's time at that size.
    pub fn time(&self, axes: &[usize], bytes: f64, gather: bool) -> f64 {
        if axes.iter().all(|&a| self.links[a].segments.is_empty() && self.links[a].gather.is_none()) {
            return self.link(axes).time(bytes);
        }
        let line = |a: usize| if gather { self.links[a].for_gather() } else { &self.links[a] };
        axes.iter().map(|&a| line(a).time(bytes)).fold(0.0, f64::max)
    }

    /// Permutations of the axes that map the mesh onto itself (`perm[a]` is where axis `a`
    /// goes): any reordering of axes of equal size and equal link, identity first. Costs are the
    /// same under them: a layout and its image convert to the images of each other's targets at
    /// the same price. At most `cap` of them (a subset still holds only true symmetries).
    pub fn symmetries(&self, cap: usize) -> Vec<Vec<usize>> {
        let n = self.ndim();
        let mut classes: Vec<Vec<usize>> = vec![];
        for a in (0..n).filter(|&a| self.shape[a] > 1) {
            match classes.iter_mut().find(|c| self.shape[c[0]] == self.shape[a] && self.links[c[0]] == self.links[a]) {
                Some(c) => c.push(a),
                None => classes.push(vec![a]),
            }
        }
        let mut perms: Vec<Vec<usize>> = vec![(0..n).collect()];
        for class in classes.iter().filter(|c| c.len() > 1) {
            let mut orders: Vec<Vec<usize>> = vec![];
            permutations(&mut class.clone(), 0, &mut orders);
            let mut next = vec![];
            'all: for p in &perms {
                for order in &orders {
                    let mut q = p.clone();
                    for (&from, &to) in class.iter().zip(order) {
                        q[from] = to;
                    }
                    next.push(q);
                    if next.len() >= cap.max(1) {
                        break 'all;
                    }
                }
            }
            perms = next;
        }
        perms
    }

    /// Coordinates of a rank.
    pub fn coords(&self, rank: usize) -> Vec<usize> {
        let mut c = vec![0; self.ndim()];
        let mut r = rank;
        for a in (0..self.ndim()).rev() {
            c[a] = r % self.shape[a];
            r /= self.shape[a];
        }
        c
    }

    /// The rank at some coordinates.
    pub fn rank(&self, coords: &[usize]) -> usize {
        coords.iter().zip(&self.shape).fold(0, |acc, (&c, &s)| acc * s + c)
    }

    /// A rank's index within its group along `axes` (`axes[0]` outermost): the shard index a
    /// tensor dim split over these axes, in this order, gives the rank.
    pub fn index_in_group(&self, rank: usize, axes: &[usize]) -> usize {
        let c = self.coords(rank);
        axes.iter().fold(0, |acc, &a| acc * self.shape[a] + c[a])
    }

    /// The groups of ranks that differ only along `axes`; within a group, ranks are ordered by
    /// [`DeviceMesh::index_in_group`]. Groups are ordered by their smallest rank.
    pub fn groups(&self, axes: &[usize]) -> Vec<Vec<usize>> {
        let mut groups: Vec<Vec<usize>> = vec![];
        let mut seen = vec![false; self.size()];
        for r in 0..self.size() {
            if seen[r] {
                continue;
            }
            let g = self.group_of(r, axes);
            for &m in &g {
                seen[m] = true;
            }
            groups.push(g);
        }
        groups
    }

    /// The group along `axes` that contains `rank`, ordered by index in group.
    pub fn group_of(&self, rank: usize, axes: &[usize]) -> Vec<usize> {
        let base = self.coords(rank);
        let n = self.group_size(axes);
        (0..n)
            .map(|mut i| {
                let mut c = base.clone();
                for &a in axes.iter().rev() {
                    c[a] = i % self.shape[a];
                    i /= self.shape[a];
                }
                self.rank(&c)
            })
            .collect()
    }
}

/// A link named in a mesh text (see [`DeviceMesh::parse`]).
fn parse_link(text: &str, profile: &DeviceProfile) -> std::result::Result<Link, String> {
    match text {
        "intra" | "nvlink" => return Ok(profile.intra_node.clone()),
        "inter" | "ib" => return Ok(profile.inter_node.clone()),
        _ => {}
    }
    let bad = || {
        format!(
            "`{text}` is not a link: write intra (nvlink), inter (ib), or a bandwidth and latency such as 25GB/s+30us"
        )
    };
    let (bw, lat) = match text.split_once('+') {
        Some((b, l)) => (b, Some(l)),
        None => (text, None),
    };
    let number = |s: &str, units: &[(&str, f64)]| -> Option<f64> {
        let s = s.trim();
        let (unit, scale) = units.iter().find(|(u, _)| s.ends_with(u))?;
        let v: f64 = s[..s.len() - unit.len()].trim().parse().ok()?;
        let v = v * scale;
        (v.is_finite() && v >= 0.0).then_some(v)
    };
    let bandwidth = number(bw, &[("GB/s", 1e9), ("MB/s", 1e6), ("TB/s", 1e12)]).ok_or_else(bad)?;
    let alpha = match lat {
        // Per second, then divided: 30us is exactly 3e-5 s.
        Some(l) => number(l, &[("us", 1.0), ("ms", 1e3), ("ns", 1e-3)]).ok_or_else(bad)? / 1e6,
        None => profile.inter_node.alpha,
    };
    let link = Link::new(alpha, bandwidth);
    link.validate().map_err(|why| format!("link `{text}`: {why}"))?;
    Ok(link)
}

/// Every ordering of `items[k..]` (with `items[..k]` fixed) appended to `out`, the given order first.
fn permutations(items: &mut Vec<usize>, k: usize, out: &mut Vec<Vec<usize>>) {
    if k + 1 >= items.len() {
        out.push(items.clone());
        return;
    }
    for i in k..items.len() {
        items.swap(k, i);
        permutations(items, k + 1, out);
        items.swap(k, i);
    }
}

impl fmt::Display for DeviceMesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s: Vec<String> = self.shape.iter().map(|s| s.to_string()).collect();
        f.write_str(&s.join("x"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coords_and_groups() {
        let m = DeviceMesh::uniform(&[2, 4]).unwrap();
        assert_eq!(m.coords(5), vec![1, 1]);
        assert_eq!(m.rank(&[1, 3]), 7);
        assert_eq!(m.groups(&[1]), vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
        assert_eq!(m.groups(&[0]), vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]);
        assert_eq!(m.group_of(6, &[1, 0]), vec![0, 4, 1, 5, 2, 6, 3, 7]);
        assert_eq!(m.index_in_group(6, &[1, 0]), 5);
        assert_eq!(m.index_in_group(6, &[0, 1]), 6);
    }

    #[test]
    fn parse_and_links() {
        let h100 = DeviceProfile::builtin("h100").unwrap();
        let m = DeviceMesh::parse("data=4,tensor=8", &h100).unwrap();
        assert_eq!(m.names(), ["data", "tensor"]);
        assert_eq!(m.links()[1], h100.intra_node);
        assert_eq!(m.links()[0], h100.inter_node);
        assert!(DeviceMesh::parse("2xfour", &h100).unwrap_err().to_string().contains("`four`"));
        assert!(DeviceMesh::parse("2x0", &h100).is_err());
        assert!(DeviceMesh::parse("a=2,a=2", &h100).is_err());
        // Links per axis: named, or a bandwidth and latency; unnamed axes keep the profile's.
        let c = DeviceMesh::parse("pod=4:25GB/s+30us,node=8:ib,gpu=8", &h100).unwrap();
        assert_eq!(c.links()[0], Link::new(30e-6, 25e9));
        assert_eq!(c.links()[1], h100.inter_node);
        assert_eq!(c.links()[2], h100.intra_node);
        assert_eq!(DeviceMesh::parse("a=2:nvlink,b=64", &h100).unwrap().links()[0], h100.intra_node);
        let e = DeviceMesh::parse("a=2:fast", &h100).unwrap_err().to_string();
        assert!(e.contains("`fast` is not a link"), "{e}");
        assert!(DeviceMesh::parse("a=2:0GB/s", &h100).is_err());
        assert!(DeviceMesh::parse("a=2:1e300TB/s", &h100).is_err());
        assert!(DeviceMesh::parse("a=2:1e-320GB/s", &h100).is_err());
        assert_eq!(DeviceMesh::parse("a=2:1GB/s+0us", &h100).unwrap().links()[0].alpha, 0.0);
        let e = DeviceMesh::uniform(&[1 << 32, 1 << 32]).unwrap_err().to_string();
        assert!(e.contains("overflows"), "{e}");
    }

    #[test]
    fn symmetries_swap_axes_of_equal_size_and_link() {
        let h100 = DeviceProfile::builtin("h100").unwrap();
        // 8x8x8 on 8-GPU nodes: the two outer axes cross machines, the inner one does not.
        let m = DeviceMesh::parse("8x8x8", &h100).unwrap();
        assert_eq!(m.symmetries(100), vec![vec![0, 1, 2], vec![1, 0, 2]]);
        let u = DeviceMesh::uniform(&[2, 2, 2]).unwrap();
        let s = u.symmetries(100);
        assert_eq!(s.len(), 6);
        assert_eq!(s[0], vec![0, 1, 2]);
        assert_eq!(u.symmetries(4).len(), 4);
        assert_eq!(DeviceMesh::uniform(&[2, 4]).unwrap().symmetries(100), vec![vec![0, 1]]);
    }

    /// A profile with fitted op costs prices an op of a fitted family by its fit (grouped
    /// convolutions apart from dense ones), any other op by `op_seconds` and the roofline, and a
    /// negative coefficient is refused.
    #[test]
    fn fitted_op_costs_price_their_families() {
        let mut p = DeviceProfile::builtin("cpu").unwrap();
        p.op_seconds = 1e-6;
        let fit = OpCost { fixed: 2e-6, per_byte: 1e-10, per_flop: 1e-11, samples: 3 };
        p.op_costs.insert("conv/grouped".into(), fit.clone());
        let conv = |group| ir::Op::Conv(ir::ConvAttrs { strides: [1, 1], pads: [0; 4], dilations: [1, 1], group });
        let m = |s: &[usize]| ir::TensorMeta::new(ir::DType::F32, s.to_vec());
        let (x, w3, w1) = (m(&[2, 8, 4, 4]), m(&[8, 2, 3, 3]), m(&[8, 8, 1, 1]));
        let t = p.op_compute_seconds(&conv(4), &[x.clone(), w3.clone()], ir::DType::F32, 1e6, 1e4);
        assert!((t - (2e-6 + 1e-6 + 1e-5)).abs() < 1e-15, "{t}");
        let dense = p.op_compute_seconds(&conv(1), &[x.clone(), w3.clone()], ir::DType::F32, 1e6, 1e4);
        assert!((dense - (1e-6 + 1e6 / p.f32_flops)).abs() < 1e-15, "{dense}");
        assert_eq!(cost_family(&conv(4), &[x.clone(), w3.clone()]), "conv/grouped");
        assert_eq!(cost_family(&conv(8), &[x.clone(), m(&[8, 1, 3, 3])]), "conv/depthwise");
        // A channel multiplier is not what the CPU runs tap by tap.
        assert_eq!(cost_family(&conv(4), &[x.clone(), m(&[8, 1, 3, 3])]), "conv/grouped");
        // A profile from before `*/depthwise` prices depthwise ones by `*/grouped`.
        let dw = p.op_compute_seconds(&conv(8), &[x.clone(), m(&[8, 1, 3, 3])], ir::DType::F32, 1e6, 1e4);
        assert!((dw - t).abs() < 1e-15, "{dw}");
        let mut q = p.clone();
        q.op_costs.insert("conv/depthwise".into(), OpCost { fixed: 5e-6, ..fit.clone() });
        let dw = q.op_compute_seconds(&conv(8), &[x.clone(), m(&[8, 1, 3, 3])], ir::DType::F32, 1e6, 1e4);
        assert!((dw - (t + 3e-6)).abs() < 1e-15, "{dw}");
        let dw_grad = ir::Op::ConvWeightGrad {
            attrs: ir::ConvAttrs { strides: [1, 1], pads: [0; 4], dilations: [1, 1], group: 8 },
            shape: vec![8, 1, 3, 3],
        };
        assert_eq!(cost_family(&dw_grad, &[x.clone(), x.clone()]), "conv_weight_grad/depthwise");
        assert_eq!(cost_family(&conv(1), &[x.clone(), w3]), "conv");
        assert_eq!(cost_family(&conv(1), &[x.clone(), w1.clone()]), "conv/1x1");
        let wgrad = ir::Op::ConvWeightGrad {
            attrs: ir::ConvAttrs { strides: [1, 1], pads: [0; 4], dilations: [1, 1], group: 1 },
            shape: vec![8, 8, 1, 1],
        };
        assert_eq!(cost_family(&wgrad, &[x.clone(), x]), "conv_weight_grad/1x1");
        let gemm = ir::Op::Gemm { alpha: 1.0, beta: 1.0, trans_a: false, trans_b: true };
        assert_eq!(cost_family(&gemm, &[]), "gemm/tb");
        let (thin, wide) = ([m(&[16, 1024]), m(&[1024, 1024])], [m(&[128, 1024]), m(&[1024, 1024])]);
        assert_eq!(cost_family(&gemm, &thin), "gemm/tb/thin");
        assert_eq!(cost_family(&gemm, &wide), "gemm/tb");
        // Priced by `gemm/tb` until the profile has the family.
        p.op_costs.insert("gemm/tb".into(), fit.clone());
        let price = |p: &DeviceProfile| p.op_compute_seconds(&gemm, &thin, ir::DType::F32, 1e6, 1e4);
        assert!((price(&p) - (2e-6 + 1e-6 + 1e-5)).abs() < 1e-15);
        let mut q = p.clone();
        q.op_costs.insert("gemm/tb/thin".into(), OpCost { fixed: 5e-6, ..fit.clone() });
        assert!((price(&q) - price(&p) - 3e-6).abs() < 1e-15);
        // Parameters and inputs are looked up, whatever their bytes and whichever profile: the
        // ops reading them pay for those bytes.
        for profile in [&p, &DeviceProfile::builtin("h100-sxm").unwrap()] {
            for source in [ir::Op::Param { name: "w".into() }, ir::Op::Input { name: "x".into() }] {
                assert_eq!(profile.op_compute_seconds(&source, &[], ir::DType::F32, 0.0, 4e9), 0.0);
            }
        }
        assert_eq!(p.check(), Ok(()));
        let back: DeviceProfile = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
        assert_eq!(back, p);
        p.op_costs.insert("add".into(), OpCost { per_byte: -1e-12, ..fit.clone() });
        assert!(p.check().unwrap_err().contains("op_costs.add"));
        p.op_costs.insert("add".into(), OpCost { per_flop: 1e300, ..fit });
        assert!(p.check().unwrap_err().contains("op_costs.add"));
    }

    /// Built-in GPUs price FLOPs at the maximum achievable matmul rate, memory-bound work at the
    /// datasheet bandwidth; a profile file without the field keeps its rates as they are.
    #[test]
    fn flops_run_at_the_achievable_rate() {
        let a100 = DeviceProfile::builtin("a100-80g").unwrap();
        let t = a100.compute_seconds_in(ir::DType::BF16, 271.2e12, 1.0);
        assert!((t - 1.0).abs() < 1e-12, "{t}");
        let streaming = a100.compute_seconds_in(ir::DType::BF16, 1.0, 2039e9);
        assert!((streaming - 1.0).abs() < 1e-12, "{streaming}");
        assert_eq!(a100.check(), Ok(()));
        let mut json = serde_json::to_value(DeviceProfile::builtin("cpu").unwrap()).unwrap();
        json.as_object_mut().unwrap().remove("flops_efficiency");
        let old: DeviceProfile = serde_json::from_value(json).unwrap();
        assert_eq!(old.flops_efficiency, 1.0);
        assert_eq!(old.compute_seconds(71.7e9, 0.0), 1.0);
        let bad = DeviceProfile { flops_efficiency: 0.0, ..old };
        assert!(bad.check().unwrap_err().contains("flops_efficiency"));
    }

    #[test]
    fn axes_are_checked() {
        let m = DeviceMesh::uniform(&[2, 4]).unwrap();
        assert_eq!(m.check_axes(&[1, 0]), Ok(()));
        assert!(m.check_axes(&[2]).unwrap_err().contains("does not exist"));
        assert!(m.check_axes(&[1, 1]).unwrap_err().contains("twice"));
    }

    /// A measured link: segments take over from their sizes on, data-moving collectives use
    /// the gather link, and a mesh prices each kind with its own line.
    #[test]
    fn segments_and_gather_links() {
        let mut l = Link::linear(2e-6, 1e-10);
        l.segments.push(Segment { from_bytes: 1e6, alpha: -1e-4, beta: 3e-10 });
        l.gather = Some(Box::new(Link::linear(1e-6, 1e-10)));
        assert!((l.time(1e3) - (2e-6 + 1e-7)).abs() < 1e-15);
        assert!((l.time(2e6) - (-1e-4 + 6e-4)).abs() < 1e-15);
        assert!((l.for_gather().time(2e6) - (1e-6 + 2e-4)).abs() < 1e-15);
        assert_eq!(l.validate(), Ok(()));
        // Added latency moves every line by the same time, the gather link's too.
        let slow = l.with_latency(3e-6);
        for bytes in [1e3, 2e6] {
            assert!((slow.time(bytes) - l.time(bytes) - 3e-6).abs() < 1e-15);
            assert!((slow.for_gather().time(bytes) - l.for_gather().time(bytes) - 3e-6).abs() < 1e-15);
        }
        let m = DeviceMesh::new(vec![2], vec!["x".into()], vec![l.clone()]).unwrap();
        assert_eq!(m.time(&[0], 2e6, false), l.time(2e6));
        assert_eq!(m.time(&[0], 2e6, true), l.for_gather().time(2e6));
        // JSON keeps everything; a datasheet link writes neither field.
        let back: Link = serde_json::from_str(&serde_json::to_string(&l).unwrap()).unwrap();
        assert_eq!(back, l);
        assert_eq!(serde_json::to_string(&Link::linear(1.0, 1.0)).unwrap(), r#"{"alpha":1.0,"beta":1.0}"#);
        // A segment whose time is not positive where it starts is rejected.
        let mut bad = Link::linear(2e-6, 1e-10);
        bad.segments.push(Segment { from_bytes: 1e6, alpha: -1.0, beta: 1e-10 });
        assert!(bad.validate().is_err());
    }
}
