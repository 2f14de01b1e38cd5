//! Import of the convolution and pooling family: `Conv`, `ConvTranspose`, `MaxPool` and
//! `AveragePool` in 1, 2 and 3 spatial dims.
//!
//! The IR's convolution and pooling ops are 2-D (NCHW); other ranks are rewritten at import:
//! - **1-D** (`[N, C, L]`): a unit height is inserted (`[N, C, 1, L]`, weights `[M, C/g, 1, k]`),
//!   the 2-D op runs with window 1 and no padding on it, and the result is reshaped back. The
//!   gradients, kernels (CPU and CUDA) and sharding strategies are those of the 2-D op.
//! - **3-D pooling** (`[N, C, D, H, W]`): max and average pooling are separable, so the
//!   pooling is a 2-D pool over (H, W) of `[N, C*D, H, W]` followed by a 2-D pool with window
//!   `(kd, 1)` over `[N, C, D, OH*OW]`. Both the max (padding never wins) and the average (the
//!   divisor, with or without `count_include_pad`, is a product of per-axis counts) are
//!   exactly the 3-D results.
//! - **3-D convolution and transposed convolution** are not supported (an error naming the
//!   node): no model of the zoo uses them.
//!
//! `ConvTranspose` is the input gradient of a convolution, which the IR has as
//! [`Op::ConvInputGrad`]: its "forward input" shape is the transposed convolution's output
//! shape (from `output_shape`, or `strides`, `output_padding`, `pads`, `dilations`), and its
//! gradients are a `Conv` and a `ConvWeightGrad` (see `ir::autodiff`).

use super::{Importer, N, V};
use ir::{ConvAttrs, Op, PoolAttrs};

/// `SAME_UPPER`/`SAME_LOWER`/`VALID` pads (begins then ends) for any number of spatial dims.
fn auto_pads(
    auto_pad: &str,
    input: &[usize],
    kernel: &[usize],
    strides: &[usize],
    dil: &[usize],
) -> Result<Vec<usize>, String> {
    let k = input.len();
    let mut p = vec![0; 2 * k];
    match auto_pad {
        "SAME_UPPER" | "SAME_LOWER" => {
            for i in 0..k {
                let overflow = || format!("auto_pad={auto_pad}: kernel {kernel:?} with dilations {dil:?} overflows");
                if kernel[i] == 0 || input[i] == 0 {
                    return Err(format!("auto_pad={auto_pad} needs a non-empty kernel and input"));
                }
                let out = input[i].div_ceil(strides[i].max(1));
                let ext = (kernel[i] - 1).checked_mul(dil[i]).and_then(|e| e.checked_add(1)).ok_or_else(overflow)?;
                let span = (out - 1).checked_mul(strides[i]).ok_or_else(overflow)?;
                let total = span.checked_add(ext).ok_or_else(overflow)?.saturating_sub(input[i]);
                let small = total / 2;
                let (b, e) = if auto_pad == "SAME_UPPER" { (small, total - small) } else { (total - small, small) };
                p[i] = b;
                p[i + k] = e;
            }
            Ok(p)
        }
        "VALID" => Ok(p),
        _ => Err(format!("auto_pad={auto_pad} is not supported")),
    }
}

/// Per-dim attribute `key` of a `k`-D window: `k` values >= `min`, or `default` for each.
fn per_dim(n: &N, key: &str, k: usize, min: i64, default: usize) -> Result<Vec<usize>, String> {
    match n.ints(key) {
        None => Ok(vec![default; k]),
        Some(v) if v.len() == k && v.iter().all(|&x| x >= min) => Ok(v.iter().map(|&x| x as usize).collect()),
        Some(v) => Err(format!("{key}={v:?} must be {k} values >= {min}")),
    }
}

/// Pads (begins then ends) of a `k`-D window: `auto_pad`, or `pads`, or zeros.
fn window_pads(
    n: &N,
    input: &[usize],
    kernel: &[usize],
    strides: &[usize],
    dil: &[usize],
) -> Result<Vec<usize>, String> {
    let auto = n.string("auto_pad").unwrap_or_else(|| "NOTSET".into());
    if auto != "NOTSET" && !auto.is_empty() {
        return auto_pads(&auto, input, kernel, strides, dil);
    }
    per_dim(n, "pads", 2 * input.len(), 0, 0)
}

/// A 1-D window's attributes seen as 2-D with a unit first dim.
fn lift(v: &[usize], one: usize) -> [usize; 2] {
    [one, v[0]]
}

/// 1-D pads (begin, end) as 2-D `[top, left, bottom, right]`.
fn lift_pads(p: &[usize]) -> [usize; 4] {
    [0, p[0], 0, p[1]]
}

impl Importer<'_> {
    /// `Reshape` to `shape` under the name `name` (nothing when the shape already is `shape`).
    pub(super) fn reshape_to(&mut self, name: &str, x: V, shape: Vec<usize>) -> Result<V, String> {
        if self.meta(&x).shape == shape {
            return Ok(x);
        }
        self.emit1(name, Op::Reshape { shape }, &[x])
    }

    /// `Conv` with 1 or 2 spatial dims.
    pub(super) fn conv(&mut self, n: &N) -> Result<V, String> {
        let nm = n.name.clone();
        let (x, w) = (self.need(n, 0)?, self.need(n, 1)?);
        let (xm, wm) = (self.meta(&x), self.meta(&w));
        if xm.rank() != wm.rank() || !(3..=4).contains(&xm.rank()) {
            return Err(format!("only 1-D and 2-D convolution are supported (input {xm}, weight {wm}; 3-D is not)"));
        }
        let k = xm.rank() - 2;
        let kernel = wm.shape[2..].to_vec();
        let (strides, dil) = (per_dim(n, "strides", k, 1, 1)?, per_dim(n, "dilations", k, 1, 1)?);
        let pads = window_pads(n, &xm.shape[2..], &kernel, &strides, &dil)?;
        let group = n.int("group", 1);
        if group < 1 {
            return Err(format!("group={group} must be >= 1"));
        }
        let bias = self.opt(n, 2)?;
        let (x, w, attrs) = if k == 1 {
            let (s, ws) = (&xm.shape, &wm.shape);
            let x = self.reshape_to(&format!("{nm}.x2d"), x, vec![s[0], s[1], 1, s[2]])?;
            let w = self.reshape_to(&format!("{nm}.w2d"), w, vec![ws[0], ws[1], 1, ws[2]])?;
            let attrs = ConvAttrs {
                strides: lift(&strides, 1),
                pads: lift_pads(&pads),
                dilations: lift(&dil, 1),
                group: group as usize,
            };
            (x, w, attrs)
        } else {
            let attrs = ConvAttrs {
                strides: [strides[0], strides[1]],
                pads: [pads[0], pads[1], pads[2], pads[3]],
                dilations: [dil[0], dil[1]],
                group: group as usize,
            };
            (x, w, attrs)
        };
        let mut ins = vec![x, w];
        ins.extend(bias);
        if k == 2 {
            return self.emit1(&nm, Op::Conv(attrs), &ins);
        }
        let y = self.emit1(&format!("{nm}.2d"), Op::Conv(attrs), &ins)?;
        let s = self.meta(&y).shape;
        self.reshape_to(&nm, y, vec![s[0], s[1], s[3]])
    }

    /// `MaxPool` / `AveragePool` with 1, 2 or 3 spatial dims.
    pub(super) fn pool(&mut self, n: &N, max: bool) -> Result<V, String> {
        let nm = n.name.clone();
        let x = self.need(n, 0)?;
        let xm = self.meta(&x);
        let kernel = n.ints("kernel_shape").ok_or("kernel_shape is required")?;
        let k = kernel.len();
        if xm.rank() != k + 2 || !(1..=3).contains(&k) {
            return Err(format!("only 1-D, 2-D and 3-D pooling are supported (input {xm}, kernel {kernel:?})"));
        }
        if kernel.iter().any(|&d| d < 1) {
            return Err(format!("bad kernel_shape {kernel:?}"));
        }
        let kernel: Vec<usize> = kernel.iter().map(|&d| d as usize).collect();
        if max && n.int("storage_order", 0) != 0 {
            return Err("storage_order=1 is not supported".into());
        }
        let (strides, dil) = (per_dim(n, "strides", k, 1, 1)?, per_dim(n, "dilations", k, 1, 1)?);
        let pads = window_pads(n, &xm.shape[2..], &kernel, &strides, &dil)?;
        let (ceil_mode, count_include_pad) = (n.int("ceil_mode", 0) != 0, n.int("count_include_pad", 0) != 0);
        let pool = |kernel: [usize; 2], strides: [usize; 2], pads: [usize; 4], dilations: [usize; 2]| {
            let a = PoolAttrs { kernel, strides, pads, dilations, ceil_mode, count_include_pad };
            if max { Op::MaxPool(a) } else { Op::AveragePool(a) }
        };
        let s = xm.shape.clone();
        match k {
            2 => self.emit1(
                &nm,
                pool(
                    [kernel[0], kernel[1]],
                    [strides[0], strides[1]],
                    [pads[0], pads[1], pads[2], pads[3]],
                    [dil[0], dil[1]],
                ),
                &[x],
            ),
            1 => {
                let x = self.reshape_to(&format!("{nm}.x2d"), x, vec![s[0], s[1], 1, s[2]])?;
                let op = pool(lift(&kernel, 1), lift(&strides, 1), lift_pads(&pads), lift(&dil, 1));
                let y = self.emit1(&format!("{nm}.2d"), op, &[x])?;
                let o = self.meta(&y).shape;
                self.reshape_to(&nm, y, vec![o[0], o[1], o[3]])
            }
            _ => {
                // Separable: (H, W) first on [N, C*D, H, W], then D on [N, C, D, OH*OW].
                let cd = s[1].checked_mul(s[2]).ok_or("channels * depth overflows")?;
                let x = self.reshape_to(&format!("{nm}.hw_in"), x, vec![s[0], cd, s[3], s[4]])?;
                let op = pool(
                    [kernel[1], kernel[2]],
                    [strides[1], strides[2]],
                    [pads[1], pads[2], pads[4], pads[5]],
                    [dil[1], dil[2]],
                );
                let y = self.emit1(&format!("{nm}.hw"), op, &[x])?;
                let (oh, ow) = (self.meta(&y).shape[2], self.meta(&y).shape[3]);
                let y = self.reshape_to(&format!("{nm}.d_in"), y, vec![s[0], s[1], s[2], oh * ow])?;
                let op = pool([kernel[0], 1], [strides[0], 1], [pads[0], 0, pads[3], 0], [dil[0], 1]);
                let z = self.emit1(&format!("{nm}.d"), op, &[y])?;
                let od = self.meta(&z).shape[2];
                self.reshape_to(&nm, z, vec![s[0], s[1], od, oh, ow])
            }
        }
    }

    /// `ConvTranspose` with 1 or 2 spatial dims, as [`Op::ConvInputGrad`] (plus the bias).
    pub(super) fn conv_transpose(&mut self, n: &N) -> Result<V, String> {
        let nm = n.name.clone();
        let (x, w) = (self.need(n, 0)?, self.need(n, 1)?);
        let (xm, wm) = (self.meta(&x), self.meta(&w));
        if xm.rank() != wm.rank() || !(3..=4).contains(&xm.rank()) {
            return Err(format!(
                "only 1-D and 2-D transposed convolution are supported (input {xm}, weight {wm}; 3-D is not)"
            ));
        }
        let k = xm.rank() - 2;
        let group = n.int("group", 1);
        if group < 1 {
            return Err(format!("group={group} must be >= 1"));
        }
        let group = group as usize;
        if wm.shape[0] != xm.shape[1] {
            return Err(format!("weight {wm} must have the input's {} channels first", xm.shape[1]));
        }
        let c_out = wm.shape[1].checked_mul(group).ok_or("output channels overflow")?;
        let kernel = wm.shape[2..].to_vec();
        let (strides, dil) = (per_dim(n, "strides", k, 1, 1)?, per_dim(n, "dilations", k, 1, 1)?);
        let out_pad = per_dim(n, "output_padding", k, 0, 0)?;
        let input = &xm.shape[2..];
        let overflow = || "the output size overflows".to_string();
        // The full (unpadded) output length of each spatial dim.
        let mut full = Vec::with_capacity(k);
        for i in 0..k {
            let ext = (kernel[i].max(1) - 1).checked_mul(dil[i]).and_then(|e| e.checked_add(1)).ok_or_else(overflow)?;
            let span = input[i].saturating_sub(1).checked_mul(strides[i]).ok_or_else(overflow)?;
            full.push(span.checked_add(out_pad[i]).and_then(|v| v.checked_add(ext)).ok_or_else(overflow)?);
        }
        let auto = n.string("auto_pad").unwrap_or_else(|| "NOTSET".into());
        let same = auto == "SAME_UPPER" || auto == "SAME_LOWER";
        if !(same || auto == "NOTSET" || auto == "VALID" || auto.is_empty()) {
            return Err(format!("auto_pad={auto} is not supported"));
        }
        let output_shape = match n.ints("output_shape") {
            Some(v) if v.len() == k && v.iter().all(|&d| d >= 0) => Some(v.iter().map(|&d| d as usize).collect()),
            Some(v) if v.len() == k + 2 && v.iter().all(|&d| d >= 0) => {
                Some(v[2..].iter().map(|&d| d as usize).collect())
            }
            Some(v) => return Err(format!("output_shape={v:?} must have {k} values >= 0")),
            None if same => Some(
                (0..k)
                    .map(|i| input[i].checked_mul(strides[i]))
                    .collect::<Option<Vec<usize>>>()
                    .ok_or_else(overflow)?,
            ),
            None => None,
        };
        let (pads, out): (Vec<usize>, Vec<usize>) = match output_shape {
            Some(out) => {
                // ONNX: total = full - out split by auto_pad (SAME_UPPER puts the odd cell at
                // the end). A negative total means a longer output than the full one: the
                // extra cells at the end get no window, as with output_padding.
                let mut p = vec![0; 2 * k];
                for i in 0..k {
                    let total = full[i].saturating_sub(out[i]);
                    let (b, e) = if auto == "SAME_UPPER" {
                        (total / 2, total - total / 2)
                    } else {
                        (total - total / 2, total / 2)
                    };
                    p[i] = b;
                    p[i + k] = e;
                }
                (p, out)
            }
            None => {
                let p = if auto == "VALID" { vec![0; 2 * k] } else { per_dim(n, "pads", 2 * k, 0, 0)? };
                let out = (0..k)
                    .map(|i| {
                        full[i].checked_sub(p[i] + p[i + k]).ok_or_else(|| {
                            format!("pads {p:?} remove more than the {} cells of output dim {i}", full[i])
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                (p, out)
            }
        };
        let bias = self.opt(n, 2)?;
        let (x, w, attrs, shape) = if k == 1 {
            let (s, ws) = (&xm.shape, &wm.shape);
            let x = self.reshape_to(&format!("{nm}.x2d"), x, vec![s[0], s[1], 1, s[2]])?;
            let w = self.reshape_to(&format!("{nm}.w2d"), w, vec![ws[0], ws[1], 1, ws[2]])?;
            let attrs =
                ConvAttrs { strides: lift(&strides, 1), pads: lift_pads(&pads), dilations: lift(&dil, 1), group };
            (x, w, attrs, vec![s[0], c_out, 1, out[0]])
        } else {
            let attrs = ConvAttrs {
                strides: [strides[0], strides[1]],
                pads: [pads[0], pads[1], pads[2], pads[3]],
                dilations: [dil[0], dil[1]],
                group,
            };
            (x, w, attrs, vec![xm.shape[0], c_out, out[0], out[1]])
        };
        let named = |s: &str| if bias.is_none() && k == 2 { nm.clone() } else { format!("{nm}.{s}") };
        let mut y = self
            .emit1(&named("2d"), Op::ConvInputGrad { attrs, shape: shape.clone() }, &[x, w])
            .map_err(|e| format!("{e} (output_padding must be below the stride)"))?;
        if let Some(b) = bias {
            let bm = self.meta(&b);
            if bm.shape != [c_out] {
                return Err(format!("bias {bm} must be [{c_out}]"));
            }
            let b = self.reshape_to(&format!("{nm}.bias"), b, vec![c_out, 1, 1])?;
            let name = if k == 2 { nm.clone() } else { format!("{nm}.add") };
            y = self.emit1(&name, Op::Binary(ir::BinaryOp::Add), &[y, b])?;
        }
        if k == 2 {
            return Ok(y);
        }
        self.reshape_to(&nm, y, vec![shape[0], shape[1], shape[3]])
    }
}

impl Importer<'_> {
    /// The conv family's arms of [`Importer::translate`].
    pub(super) fn translate_conv(&mut self, n: &N, op_type: &str) -> Result<Vec<Option<V>>, String> {
        let nm = n.name.clone();
        let one = |v: V| Ok(vec![Some(v)]);
        match op_type {
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
            other => Err(format!("{other} is not a conv op (importer bug)")),
        }
    }
}
