//! Resize (ONNX `Resize` opset 10-19 and `Upsample`): resampling of some axes by nearest,
//! linear or cubic interpolation, and its gradient.
//!
//! Every mode ONNX defines for `Resize` without `antialias` and without `tf_crop_and_resize` is
//! separable: the N-D result is the composition of one-axis resamplings, and a one-axis
//! resampling is a fixed linear map in which each output position reads a few input positions
//! ("taps") with fixed weights. [`ResizeAttrs::taps`] computes those taps once per axis, from the
//! same formulas as the ONNX reference implementation (`onnx/reference/ops/op_resize.py`):
//! the output coordinate `x` maps to the input coordinate `x_orig` by the coordinate
//! transformation, then
//! - nearest reads `x_orig` rounded by the nearest mode (an integral `x_orig` reads itself),
//! - linear reads `floor(x_orig)` and the next cell with weights `1 - r, r` (`r` the fraction),
//! - cubic reads `floor(x_orig) - 1 ..= floor(x_orig) + 2` with the Keys kernel of parameter `a`,
//!
//! indices clamped to the axis (edge padding); `exclude_outside` zeroes the weights of taps
//! outside the axis and renormalises. The kernels apply the axes in order; the gradient
//! ([`crate::Op::ResizeGrad`]) applies the transposed maps in reverse order, so it is exact for
//! every mode, and no mode needs a kernel of its own.

use crate::op::InferError;
use crate::tensor::TensorMeta;

/// How an output coordinate maps to an input coordinate (ONNX `coordinate_transformation_mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CoordTransform {
    /// `(x + 0.5) / scale - 0.5` (ONNX's default).
    HalfPixel,
    /// `half_pixel` re-centred so the output is symmetric about the input's centre.
    HalfPixelSymmetric,
    /// `half_pixel`, but 0 when the output axis has length 1 (PyTorch's `align_corners=False`).
    PytorchHalfPixel,
    /// `x * (in - 1) / (out - 1)`: the corner cells align.
    AlignCorners,
    /// `x / scale` (and the only mode of `Upsample` and `Resize`-10).
    Asymmetric,
}

/// How nearest mode rounds the input coordinate (ONNX `nearest_mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NearestMode {
    /// Round, halves down (ONNX's default).
    RoundPreferFloor,
    /// Round, halves up.
    RoundPreferCeil,
    /// Floor.
    Floor,
    /// Ceil.
    Ceil,
}

/// Interpolation of [`ResizeAttrs`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResizeMode {
    /// The nearest cell ([`ResizeAttrs::nearest_mode`] says how to round).
    Nearest,
    /// Linear in each resized axis (bilinear, trilinear).
    Linear,
    /// Cubic convolution in each resized axis ([`ResizeAttrs::cubic_a`]).
    Cubic,
}

/// One resized axis.
#[derive(Clone, Debug, PartialEq)]
pub struct ResizeAxis {
    /// The axis.
    pub axis: usize,
    /// Its output length.
    pub size: usize,
    /// The scale the coordinate transformation divides by: ONNX's `scales` entry when the model
    /// gives scales, otherwise `size / input length` (kept because `floor(in * scale)` loses it).
    pub scale: f64,
}

/// Attributes of [`crate::Op::Resize`]: the axes whose length changes (or whose scale is not 1),
/// sorted and unique; the other axes are copied.
#[derive(Clone, Debug, PartialEq)]
pub struct ResizeAttrs {
    /// Resized axes, sorted by axis.
    pub axes: Vec<ResizeAxis>,
    /// Interpolation.
    pub mode: ResizeMode,
    /// Output-to-input coordinate map.
    pub coord: CoordTransform,
    /// Rounding of [`ResizeMode::Nearest`].
    pub nearest_mode: NearestMode,
    /// The cubic kernel's parameter `a` (ONNX `cubic_coeff_a`, default -0.75).
    pub cubic_a: f32,
    /// Cubic taps outside the input get weight 0 (the others renormalised).
    pub exclude_outside: bool,
}

/// The one-axis linear map of a resized axis: output position `j` is
/// `sum_t weight[j*width + t] * input[index[j*width + t]]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Taps {
    /// Taps per output position.
    pub width: usize,
    /// Input positions read (all below the input length).
    pub index: Vec<usize>,
    /// Their weights.
    pub weight: Vec<f64>,
}

impl Taps {
    /// The transposed map in compressed rows: input position `k` receives
    /// `weight[t] * dy[index[t]]` for `t` in `start[k]..start[k + 1]`, in increasing output
    /// order (so a gradient sums in a fixed order, on every backend).
    pub fn transpose(&self, in_len: usize) -> (Vec<usize>, Vec<usize>, Vec<f64>) {
        let mut count = vec![0usize; in_len + 1];
        for &k in &self.index {
            count[k + 1] += 1;
        }
        for k in 0..in_len {
            count[k + 1] += count[k];
        }
        let start = count.clone();
        let mut fill = count;
        let mut index = vec![0; self.index.len()];
        let mut weight = vec![0.0; self.index.len()];
        for (t, (&k, &w)) in self.index.iter().zip(&self.weight).enumerate() {
            let at = fill[k];
            fill[k] += 1;
            index[at] = t / self.width.max(1);
            weight[at] = w;
        }
        (start, index, weight)
    }
}

/// Name of a coordinate transformation in ONNX and in the text form.
pub fn coord_name(c: CoordTransform) -> &'static str {
    match c {
        CoordTransform::HalfPixel => "half_pixel",
        CoordTransform::HalfPixelSymmetric => "half_pixel_symmetric",
        CoordTransform::PytorchHalfPixel => "pytorch_half_pixel",
        CoordTransform::AlignCorners => "align_corners",
        CoordTransform::Asymmetric => "asymmetric",
    }
}

/// The coordinate transformation named `s` (ONNX spelling).
pub fn coord_from_name(s: &str) -> Option<CoordTransform> {
    use CoordTransform::*;
    [HalfPixel, HalfPixelSymmetric, PytorchHalfPixel, AlignCorners, Asymmetric]
        .into_iter()
        .find(|c| coord_name(*c) == s)
}

/// Name of a nearest mode in ONNX and in the text form.
pub fn nearest_name(m: NearestMode) -> &'static str {
    match m {
        NearestMode::RoundPreferFloor => "round_prefer_floor",
        NearestMode::RoundPreferCeil => "round_prefer_ceil",
        NearestMode::Floor => "floor",
        NearestMode::Ceil => "ceil",
    }
}

/// The nearest mode named `s` (ONNX spelling).
pub fn nearest_from_name(s: &str) -> Option<NearestMode> {
    use NearestMode::*;
    [RoundPreferFloor, RoundPreferCeil, Floor, Ceil].into_iter().find(|m| nearest_name(*m) == s)
}

/// Name of an interpolation mode in ONNX and in the text form.
pub fn mode_name(m: ResizeMode) -> &'static str {
    match m {
        ResizeMode::Nearest => "nearest",
        ResizeMode::Linear => "linear",
        ResizeMode::Cubic => "cubic",
    }
}

/// The interpolation mode named `s` (ONNX spelling).
pub fn mode_from_name(s: &str) -> Option<ResizeMode> {
    [ResizeMode::Nearest, ResizeMode::Linear, ResizeMode::Cubic].into_iter().find(|m| mode_name(*m) == s)
}

impl ResizeAttrs {
    /// Output shape for an input of shape `x`, or why there is none.
    pub fn out_shape(&self, x: &[usize]) -> Result<Vec<usize>, InferError> {
        let mut s = x.to_vec();
        let mut last = None;
        for a in &self.axes {
            if a.axis >= x.len() || last.is_some_and(|l| l >= a.axis) {
                return Err(format!("resized axes must be sorted, unique and < {}", x.len()));
            }
            last = Some(a.axis);
            if !(a.scale.is_finite() && a.scale > 0.0) {
                return Err(format!("axis {}: scale {} must be positive and finite", a.axis, a.scale));
            }
            if x[a.axis] == 0 && a.size > 0 {
                return Err(format!("axis {}: cannot interpolate an empty axis to length {}", a.axis, a.size));
            }
            s[a.axis] = a.size;
        }
        if !(self.cubic_a.is_finite()) {
            return Err(format!("cubic_a {} must be finite", self.cubic_a));
        }
        Ok(s)
    }

    /// Shape inference of [`crate::Op::Resize`].
    pub(crate) fn infer(&self, n: &str, ins: &[TensorMeta]) -> Result<Vec<TensorMeta>, InferError> {
        if ins.len() != 1 {
            return Err(format!("{n} takes 1 input, got {}", ins.len()));
        }
        if !ins[0].dtype.is_float() {
            return Err(format!("{n}: input must be f32 or f64, got {}", ins[0].dtype));
        }
        let s = self.out_shape(&ins[0].shape).map_err(|e| format!("{n}: {e}"))?;
        Ok(vec![TensorMeta::new(ins[0].dtype, s)])
    }

    /// Shape inference of [`crate::Op::ResizeGrad`]: input dy, output the forward input `shape`.
    pub(crate) fn infer_grad(
        &self,
        n: &str,
        shape: &[usize],
        ins: &[TensorMeta],
    ) -> Result<Vec<TensorMeta>, InferError> {
        if ins.len() != 1 {
            return Err(format!("{n} takes 1 input, got {}", ins.len()));
        }
        if !ins[0].dtype.is_float() {
            return Err(format!("{n}: dy must be f32 or f64, got {}", ins[0].dtype));
        }
        let y = self.out_shape(shape).map_err(|e| format!("{n}: forward: {e}"))?;
        if y != ins[0].shape {
            return Err(format!("{n}: dy is {:?} but the forward output is {y:?}", ins[0].shape));
        }
        Ok(vec![TensorMeta::new(ins[0].dtype, shape.to_vec())])
    }

    /// Floating-point operations for `out_n` outputs (taps per output, summed over the axes).
    pub(crate) fn flops(&self, out_n: u64) -> u64 {
        let w = match self.mode {
            ResizeMode::Nearest => 0,
            ResizeMode::Linear => 4,
            ResizeMode::Cubic => 8,
        };
        out_n.saturating_mul(w * self.axes.len() as u64)
    }

    /// The taps of resized axis number `k` (an index into [`ResizeAttrs::axes`]) for an input
    /// axis of length `in_len` (at least 1 when the output is not empty: see
    /// [`ResizeAttrs::out_shape`]).
    pub fn taps(&self, k: usize, in_len: usize) -> Taps {
        let a = &self.axes[k];
        let width = match self.mode {
            ResizeMode::Nearest => 1,
            ResizeMode::Linear => 2,
            ResizeMode::Cubic => 4,
        };
        let mut index = Vec::with_capacity(a.size * width);
        let mut weight = Vec::with_capacity(a.size * width);
        if in_len == 0 {
            return Taps { width, index, weight };
        }
        let last = in_len as i64 - 1;
        let clamp = |i: i64| i.clamp(0, last) as usize;
        // The reference's output length is the float `scale * in`, not the integer size.
        let out_f = a.scale * in_len as f64;
        for j in 0..a.size {
            let x = j as f64;
            let xo = match self.coord {
                CoordTransform::HalfPixel => (x + 0.5) / a.scale - 0.5,
                CoordTransform::HalfPixelSymmetric => {
                    let adjustment = a.size as f64 / out_f;
                    let center = in_len as f64 / 2.0;
                    center * (1.0 - adjustment) + (x + 0.5) / a.scale - 0.5
                }
                CoordTransform::PytorchHalfPixel => {
                    if out_f == 1.0 {
                        -0.5
                    } else {
                        (x + 0.5) / a.scale - 0.5
                    }
                }
                CoordTransform::AlignCorners => {
                    if out_f == 1.0 {
                        0.0
                    } else {
                        x * (in_len as f64 - 1.0) / (out_f - 1.0)
                    }
                }
                CoordTransform::Asymmetric => x / a.scale,
            };
            let fl = xo.floor();
            let (i0, r) = (fl as i64, xo - fl);
            match self.mode {
                ResizeMode::Nearest => {
                    let up = match self.nearest_mode {
                        _ if r == 0.0 => false,
                        NearestMode::RoundPreferFloor => r > 0.5,
                        NearestMode::RoundPreferCeil => r >= 0.5,
                        NearestMode::Floor => false,
                        NearestMode::Ceil => true,
                    };
                    index.push(clamp(i0 + i64::from(up)));
                    weight.push(1.0);
                }
                ResizeMode::Linear => {
                    index.extend([clamp(i0), clamp(i0 + 1)]);
                    weight.extend([1.0 - r, r]);
                }
                ResizeMode::Cubic => {
                    let ca = self.cubic_a as f64;
                    // Keys' kernel at distances 1 + r, r, 1 - r, 2 - r.
                    let near = |d: f64| ((ca + 2.0) * d - (ca + 3.0)) * d * d + 1.0;
                    let far = |d: f64| ((ca * d - 5.0 * ca) * d + 8.0 * ca) * d - 4.0 * ca;
                    let mut w = [far(r + 1.0), near(r), near(1.0 - r), far(2.0 - r)];
                    if self.exclude_outside {
                        for (t, wt) in w.iter_mut().enumerate() {
                            let i = i0 - 1 + t as i64;
                            if i < 0 || i > last {
                                *wt = 0.0;
                            }
                        }
                        let sum: f64 = w.iter().sum();
                        if sum != 0.0 {
                            for wt in &mut w {
                                *wt /= sum;
                            }
                        }
                    }
                    for (t, wt) in w.into_iter().enumerate() {
                        index.push(clamp(i0 - 1 + t as i64));
                        weight.push(wt);
                    }
                }
            }
        }
        Taps { width, index, weight }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attrs(mode: ResizeMode, coord: CoordTransform, size: usize, scale: f64) -> ResizeAttrs {
        ResizeAttrs {
            axes: vec![ResizeAxis { axis: 0, size, scale }],
            mode,
            coord,
            nearest_mode: NearestMode::RoundPreferFloor,
            cubic_a: -0.75,
            exclude_outside: false,
        }
    }

    #[test]
    fn nearest_asymmetric_floor_repeats() {
        let mut a = attrs(ResizeMode::Nearest, CoordTransform::Asymmetric, 6, 3.0);
        a.nearest_mode = NearestMode::Floor;
        assert_eq!(a.taps(0, 2).index, [0, 0, 0, 1, 1, 1]);
    }

    #[test]
    fn linear_weights_sum_to_one_and_transpose_round_trips() {
        for coord in [CoordTransform::HalfPixel, CoordTransform::AlignCorners, CoordTransform::Asymmetric] {
            let a = attrs(ResizeMode::Linear, coord, 7, 7.0 / 3.0);
            let t = a.taps(0, 3);
            for j in 0..7 {
                let s: f64 = t.weight[j * 2..j * 2 + 2].iter().sum();
                assert!((s - 1.0).abs() < 1e-12);
            }
            let (start, idx, w) = t.transpose(3);
            assert_eq!(start[3], 14);
            let total: f64 = w.iter().sum();
            assert!((total - 7.0).abs() < 1e-9, "{total}");
            assert!(idx.iter().all(|&j| j < 7));
        }
    }

    #[test]
    fn align_corners_hits_the_corners() {
        let a = attrs(ResizeMode::Linear, CoordTransform::AlignCorners, 5, 2.5);
        let t = a.taps(0, 2);
        assert_eq!((t.index[0], t.weight[0]), (0, 1.0));
        assert_eq!((t.index[8], t.weight[8]), (1, 1.0));
    }

    #[test]
    fn bad_axes_are_errors() {
        let mut a = attrs(ResizeMode::Linear, CoordTransform::HalfPixel, 4, 2.0);
        assert!(a.out_shape(&[2]).is_ok());
        assert!(a.out_shape(&[0]).is_err());
        a.axes[0].axis = 3;
        assert!(a.out_shape(&[2]).is_err());
        a.axes[0].axis = 0;
        a.axes[0].scale = f64::NAN;
        assert!(a.out_shape(&[2]).is_err());
    }
}
