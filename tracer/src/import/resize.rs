//! Import of `Resize` (opset 10-19), `Upsample` (opset 7-9, deprecated) and the pixel shuffles
//! `DepthToSpace` / `SpaceToDepth` (rewritten to `Reshape` + `Transpose` + `Reshape`).
//!
//! `Resize` needs its scales or sizes as constants (after folding). Supported: modes nearest
//! (every `nearest_mode`), linear and cubic (`cubic_coeff_a`, `exclude_outside`); every
//! `coordinate_transformation_mode` but `tf_crop_and_resize`; `axes` and
//! `keep_aspect_ratio_policy` (opset 18). Not supported, as errors naming the node: `antialias=1`
//! and `tf_crop_and_resize`. `Resize`-10 and `Upsample` use the asymmetric transformation and
//! floor rounding (their only behaviour for the upsampling `Upsample` allows).

use super::{Importer, N, V};
use ir::{CoordTransform, NearestMode, Op, ResizeAttrs, ResizeAxis, ResizeMode};

impl Importer<'_> {
    /// A constant float input (`None` when absent or empty, the ONNX convention for "not given").
    fn const_floats(&mut self, n: &N, i: usize, what: &str) -> Result<Option<Vec<f32>>, String> {
        // A float initializer would become a trainable parameter: read its data instead.
        if let Some(name) = n.input(i)
            && !self.vals.contains_key(name)
            && let Some(t) = self.inits.get(name).copied()
        {
            let t = super::tensor_from_proto(t, self.base_dir)
                .map_err(|e| e.to_string())?
                .ok_or_else(|| format!("{what} (input {i}) is an initializer without data"))?;
            return Ok((t.numel() > 0).then(|| t.to_f32_vec()));
        }
        match self.opt(n, i)? {
            None => Ok(None),
            Some(V::C(t)) if t.numel() == 0 => Ok(None),
            Some(V::C(t)) => Ok(Some(t.to_f32_vec())),
            Some(V::G(_)) => Err(format!("{what} (input {i}) must be a constant, but it depends on graph inputs")),
        }
    }

    /// Builds [`Op::Resize`] of `x` from per-axis scales or sizes (over `axes`).
    #[allow(clippy::too_many_arguments)]
    fn emit_resize(
        &mut self,
        name: &str,
        x: V,
        axes: &[usize],
        scales: Option<Vec<f32>>,
        sizes: Option<Vec<i64>>,
        policy: &str,
        mut attrs: ResizeAttrs,
    ) -> Result<V, String> {
        let shape = self.meta(&x).shape;
        let per_axis: Vec<(usize, f64)> = match (scales, sizes) {
            (Some(_), Some(_)) => return Err("scales and sizes are both given; ONNX allows one".into()),
            (None, None) => return Err("one of scales and sizes is required".into()),
            (Some(s), None) => {
                if s.len() != axes.len() {
                    return Err(format!("{} scales for {} axes", s.len(), axes.len()));
                }
                let mut v = Vec::new();
                for (&a, &sc) in axes.iter().zip(&s) {
                    if !(sc.is_finite() && sc > 0.0) {
                        return Err(format!("scale {sc} of axis {a} must be positive and finite"));
                    }
                    let sc = sc as f64;
                    let size = (shape[a] as f64 * sc).floor();
                    if size > usize::MAX as f64 / 2.0 {
                        return Err(format!("axis {a}: output length {size} is too large"));
                    }
                    v.push((size as usize, sc));
                }
                v
            }
            (None, Some(s)) => {
                if s.len() != axes.len() || s.iter().any(|&d| d < 0) {
                    return Err(format!("sizes {s:?} must be {} values >= 0", axes.len()));
                }
                let ratio = |a: usize, d: i64| if shape[a] == 0 { 1.0 } else { d as f64 / shape[a] as f64 };
                match policy {
                    "stretch" => axes.iter().zip(&s).map(|(&a, &d)| (d as usize, ratio(a, d))).collect(),
                    "not_larger" | "not_smaller" => {
                        let rs = axes.iter().zip(&s).map(|(&a, &d)| ratio(a, d));
                        let r = if policy == "not_larger" {
                            rs.fold(f64::INFINITY, f64::min)
                        } else {
                            rs.fold(0.0, f64::max)
                        };
                        // ONNX rounds half up: `floor(r * in + 0.5)`.
                        axes.iter().map(|&a| ((r * shape[a] as f64 + 0.5).floor() as usize, r)).collect()
                    }
                    p => return Err(format!("keep_aspect_ratio_policy={p} is not supported")),
                }
            }
        };
        let mut order: Vec<(usize, (usize, f64))> = axes.iter().copied().zip(per_axis).collect();
        order.sort_by_key(|(a, _)| *a);
        attrs.axes = order
            .into_iter()
            .filter(|&(a, (size, scale))| size != shape[a] || scale != 1.0)
            .map(|(axis, (size, scale))| ResizeAxis { axis, size, scale })
            .collect();
        if attrs.axes.is_empty() {
            return Ok(x);
        }
        self.emit1(name, Op::Resize(attrs), &[x])
    }

    /// `Resize`.
    pub(super) fn resize(&mut self, n: &N) -> Result<V, String> {
        let x = self.need(n, 0)?;
        let rank = self.meta(&x).rank();
        let mode = n.string("mode").unwrap_or_else(|| "nearest".into());
        let mode = ir::ops::resize::mode_from_name(&mode).ok_or(format!("mode={mode} is not supported"))?;
        if n.int("antialias", 0) != 0 {
            return Err("antialias=1 is not supported".into());
        }
        let (scales, sizes, coord, nearest) = if self.opset < 11 {
            (self.const_floats(n, 1, "scales")?, None, CoordTransform::Asymmetric, NearestMode::Floor)
        } else {
            let c = n.string("coordinate_transformation_mode").unwrap_or_else(|| "half_pixel".into());
            let coord = ir::ops::resize::coord_from_name(&c)
                .ok_or(format!("coordinate_transformation_mode={c} is not supported"))?;
            let m = n.string("nearest_mode").unwrap_or_else(|| "round_prefer_floor".into());
            let nearest = ir::ops::resize::nearest_from_name(&m).ok_or(format!("nearest_mode={m} is not supported"))?;
            let sizes = self.const_ints(n, 3, "sizes")?.filter(|s| !s.is_empty());
            (self.const_floats(n, 2, "scales")?, sizes, coord, nearest)
        };
        let axes: Vec<usize> = match n.ints("axes") {
            None => (0..rank).collect(),
            Some(v) => {
                let mut out = Vec::with_capacity(v.len());
                for a in v {
                    let a = super::norm_axis(a, rank)?;
                    if out.contains(&a) {
                        return Err(format!("axis {a} is repeated in axes"));
                    }
                    out.push(a);
                }
                out
            }
        };
        let policy = n.string("keep_aspect_ratio_policy").unwrap_or_else(|| "stretch".into());
        let attrs = ResizeAttrs {
            axes: vec![],
            mode,
            coord,
            nearest_mode: nearest,
            cubic_a: n.float("cubic_coeff_a", -0.75),
            exclude_outside: n.int("exclude_outside", 0) != 0,
        };
        let nm = n.name.clone();
        self.emit_resize(&nm, x, &axes, scales, sizes, &policy, attrs)
    }

    /// `Upsample` (deprecated): scales from the attribute (opset 7) or input 1 (opset 9).
    pub(super) fn upsample(&mut self, n: &N) -> Result<V, String> {
        let x = self.need(n, 0)?;
        let rank = self.meta(&x).rank();
        let scales = match n.attr("scales") {
            Some(a) => Some(a.floats.clone()),
            None => self.const_floats(n, 1, "scales")?,
        };
        if scales.as_ref().is_some_and(|s| s.iter().any(|&v| v < 1.0)) {
            return Err(format!("scales {scales:?} must be >= 1"));
        }
        let mode = match n.string("mode").as_deref().unwrap_or("nearest") {
            "nearest" => ResizeMode::Nearest,
            "linear" | "bilinear" => ResizeMode::Linear,
            m => return Err(format!("mode={m} is not supported")),
        };
        let attrs = ResizeAttrs {
            axes: vec![],
            mode,
            coord: CoordTransform::Asymmetric,
            nearest_mode: NearestMode::Floor,
            cubic_a: -0.75,
            exclude_outside: false,
        };
        let nm = n.name.clone();
        let axes: Vec<usize> = (0..rank).collect();
        self.emit_resize(&nm, x, &axes, scales, None, "stretch", attrs)
    }

    /// `DepthToSpace` (`DCR` or `CRD`) and `SpaceToDepth` as `Reshape` + `Transpose` + `Reshape`.
    pub(super) fn pixel_shuffle(&mut self, n: &N, to_space: bool) -> Result<V, String> {
        let nm = n.name.clone();
        let x = self.need(n, 0)?;
        let s = self.meta(&x).shape;
        let b = n.int("blocksize", 0);
        if s.len() != 4 || b < 1 {
            return Err(format!("needs a 4-D input and blocksize >= 1, got {s:?} and blocksize={b}"));
        }
        let b = b as usize;
        let bb = b.checked_mul(b).ok_or("blocksize overflows")?;
        let (nn, c, h, w) = (s[0], s[1], s[2], s[3]);
        let (split, perm, out) = if to_space {
            if c % bb != 0 {
                return Err(format!("channels {c} are not divisible by blocksize^2 = {bb}"));
            }
            let big = |v: usize| v.checked_mul(b).ok_or("the output size overflows");
            let out = vec![nn, c / bb, big(h)?, big(w)?];
            match n.string("mode").as_deref().unwrap_or("DCR") {
                "DCR" => (vec![nn, b, b, c / bb, h, w], vec![0, 3, 4, 1, 5, 2], out),
                "CRD" => (vec![nn, c / bb, b, b, h, w], vec![0, 1, 4, 2, 5, 3], out),
                m => return Err(format!("mode={m} is not supported")),
            }
        } else {
            if h % b != 0 || w % b != 0 {
                return Err(format!("spatial dims {h}x{w} are not divisible by blocksize {b}"));
            }
            let out = vec![nn, c.checked_mul(bb).ok_or("the output size overflows")?, h / b, w / b];
            (vec![nn, c, h / b, b, w / b, b], vec![0, 3, 5, 1, 2, 4], out)
        };
        let x = self.reshape_to(&format!("{nm}.split"), x, split)?;
        let y = self.emit1(&format!("{nm}.perm"), Op::Transpose { perm }, &[x])?;
        self.reshape_to(&nm, y, out)
    }
}
