//! The two floating-point element types the CPU kernels are compiled for.
//!
//! The float kernels (`elementwise`, `linalg`, `conv`, `norm`, `reduce`, `grad`) are written once
//! against the alias `F` and compiled twice, as `cpu::k32` (`F = f32`) and `cpu::k64`
//! (`F = f64`); Rust's untyped float literals take either type. [`Float`] carries what differs:
//! how the element sits in a [`Data`], the fast `exp`/`tanh` (a vectorising polynomial for f32,
//! the C library's for f64), `erf`, and the sequential GEMM.

use ir::{DType, Data, Tensor};

/// A float element type of the CPU kernels.
pub(crate) trait Float: Copy + Send + Sync + Default + PartialOrd + std::fmt::Debug + 'static {
    /// The dtype of tensors of this element.
    const DTYPE: DType;
    /// sqrt(2/pi), rounded to this type (the tanh approximation of GELU).
    const SQRT_2_OVER_PI: Self;
    /// The elements of `t`, if it has this element type.
    fn view(t: &Tensor) -> Option<&[Self]>;
    /// Storage holding `v`.
    fn data(v: Vec<Self>) -> Data;
    /// `e^x`, branch-free so loops over it vectorise (f32), or exact to the last ulp (f64).
    fn exp_fast(self) -> Self;
    /// `tanh(x)`, likewise.
    fn tanh_fast(self) -> Self;
    /// The error function.
    fn erf(self) -> Self;
    /// The complementary error function.
    fn erfc(self) -> Self;
    /// Whether [`Self::tiles_product`] runs on this CPU (f32 with AVX-512; never f64, whose
    /// products stay `gemm`'s).
    fn tiles() -> bool;
    /// One thread's `c = alpha * a @ b + beta * c` through `tiles::product` (strides in
    /// elements, `c` contiguous along its rows with row stride `ldc`).
    ///
    /// # Safety
    /// [`Self::tiles`] is true; the pointers and strides describe valid `m x k`, `k x n` and
    /// `m x n` matrices, `c` not overlapping `a` or `b`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn tiles_product(
        m: usize,
        n: usize,
        k: usize,
        a: (*const Self, isize, isize),
        b: (*const Self, isize, isize),
        c: *mut Self,
        ldc: usize,
        alpha: Self,
        beta: Self,
    );
    /// One thread's `c = alpha * a @ b + beta * c` with `matrixmultiply` (strides in elements).
    ///
    /// # Safety
    /// The pointers and strides must describe valid `m x k`, `k x n` and `m x n` matrices, `c`
    /// not overlapping `a` or `b`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn mm_gemm(
        m: usize,
        k: usize,
        n: usize,
        alpha: Self,
        a: *const Self,
        rsa: isize,
        csa: isize,
        b: *const Self,
        rsb: isize,
        csb: isize,
        beta: Self,
        c: *mut Self,
        rsc: isize,
        csc: isize,
    );
}

impl Float for f32 {
    const DTYPE: DType = DType::F32;
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    fn view(t: &Tensor) -> Option<&[f32]> {
        t.as_f32()
    }
    fn data(v: Vec<f32>) -> Data {
        Data::F32(v)
    }
    #[inline(always)]
    fn exp_fast(self) -> f32 {
        exp_f32(self)
    }
    #[inline(always)]
    fn tanh_fast(self) -> f32 {
        tanh_f32(self)
    }
    fn erf(self) -> f32 {
        libm::erff(self)
    }
    fn erfc(self) -> f32 {
        libm::erfcf(self)
    }
    fn tiles() -> bool {
        super::tiles::available()
    }
    unsafe fn tiles_product(
        m: usize,
        n: usize,
        k: usize,
        a: (*const f32, isize, isize),
        b: (*const f32, isize, isize),
        c: *mut f32,
        ldc: usize,
        alpha: f32,
        beta: f32,
    ) {
        use super::tiles::Strided;
        let (a, b) = (Strided { ptr: a.0, rs: a.1, cs: a.2 }, Strided { ptr: b.0, rs: b.1, cs: b.2 });
        let c = Strided { ptr: c, rs: ldc as isize, cs: 1 };
        // SAFETY: forwarded from the caller's contract.
        unsafe { super::tiles::product(m, n, k, a, b, c, alpha, beta) }
    }
    unsafe fn mm_gemm(
        m: usize,
        k: usize,
        n: usize,
        alpha: f32,
        a: *const f32,
        rsa: isize,
        csa: isize,
        b: *const f32,
        rsb: isize,
        csb: isize,
        beta: f32,
        c: *mut f32,
        rsc: isize,
        csc: isize,
    ) {
        // SAFETY: forwarded from the caller's contract.
        unsafe { matrixmultiply::sgemm(m, k, n, alpha, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc) }
    }
}

impl Float for f64 {
    const DTYPE: DType = DType::F64;
    const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
    fn view(t: &Tensor) -> Option<&[f64]> {
        t.as_f64()
    }
    fn data(v: Vec<f64>) -> Data {
        Data::F64(v)
    }
    #[inline(always)]
    fn exp_fast(self) -> f64 {
        self.exp()
    }
    #[inline(always)]
    fn tanh_fast(self) -> f64 {
        self.tanh()
    }
    fn erf(self) -> f64 {
        libm::erf(self)
    }
    fn erfc(self) -> f64 {
        libm::erfc(self)
    }
    fn tiles() -> bool {
        false
    }
    unsafe fn tiles_product(
        _: usize,
        _: usize,
        _: usize,
        _: (*const f64, isize, isize),
        _: (*const f64, isize, isize),
        _: *mut f64,
        _: usize,
        _: f64,
        _: f64,
    ) {
        unreachable!("f64 products have no tiled kernel (`tiles()` is false)")
    }
    unsafe fn mm_gemm(
        m: usize,
        k: usize,
        n: usize,
        alpha: f64,
        a: *const f64,
        rsa: isize,
        csa: isize,
        b: *const f64,
        rsb: isize,
        csb: isize,
        beta: f64,
        c: *mut f64,
        rsc: isize,
        csc: isize,
    ) {
        // SAFETY: forwarded from the caller's contract.
        unsafe { matrixmultiply::dgemm(m, k, n, alpha, a, rsa, csa, b, rsb, csb, beta, c, rsc, csc) }
    }
}

/// tanh through one [`exp_f32`], with a Taylor series near 0 where `e^2x - 1` would cancel;
/// branch-free, so loops over it vectorise. Relative error a few ulp; exactly +-1 past |x| = 9.
#[inline(always)]
fn tanh_f32(x: f32) -> f32 {
    let a = x.abs();
    let x2 = x * x;
    // x - x^3/3 + 2x^5/15 - 17x^7/315 (next term < 4e-10 relative for |x| < 0.125)
    let small = a * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 - x2 * (17.0 / 315.0))));
    let e = exp_f32(2.0 * a.min(9.0));
    let big = (e - 1.0) / (e + 1.0);
    let t = if a < 0.125 { small } else { big };
    let t = if a > 9.0 { 1.0 } else { t };
    if x.is_nan() { x } else { t.copysign(x) }
}

/// `e^x` for f32 without a libm call (Cephes' `expf`: range reduction by ln 2 in two parts and a
/// degree-6 polynomial; within 1-2 ulp of the exact value), branch-free so that loops over it
/// vectorise. Results below ~1.6e-38 (x < -87) flush to 0; x > 88.5 gives +inf; NaN stays NaN.
#[inline(always)]
fn exp_f32(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    let xc = x.clamp(-87.0, 88.5);
    let t = xc * std::f32::consts::LOG2_E + MAGIC;
    let n = t - MAGIC;
    let r = xc - n * 0.693_359_4 - n * -2.121_944_4e-4;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r + 0.166_666_65) * r
        + 0.5;
    let y = p * r * r + r + 1.0;
    let ni = t.to_bits() as i32 - MAGIC.to_bits() as i32;
    let scale = f32::from_bits(((ni + 127) << 23) as u32);
    let res = y * scale;
    let res = if x < -87.0 { 0.0 } else { res };
    let res = if x > 88.5 { f32::INFINITY } else { res };
    if x.is_nan() { x } else { res }
}
