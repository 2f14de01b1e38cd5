//! Element types, tensor metas (shape + dtype) and dense host tensors.
//!
//! Shapes are always static: the tracer binds every dynamic dimension before a graph exists.

use std::fmt;

use crate::alloc::{self, AllocError};

/// Element type of a tensor. Closed on purpose: kernels implement every variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    /// 32-bit IEEE float: activations, parameters, gradients.
    F32,
    /// 64-bit IEEE float: the same values computed in double precision (`--precision f64`), for
    /// checking plans on models whose f32 results depend on summation order.
    F64,
    /// bfloat16 storage (`--precision bf16`): activations and gradients of mixed-precision
    /// training. Kernels compute in f32 and round each result to bf16.
    BF16,
    /// IEEE half-precision storage (`--precision fp16`), as [`DType::BF16`].
    F16,
    /// 64-bit signed integer: indices, token ids, shapes.
    I64,
    /// Boolean: masks and comparison results.
    Bool,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 => 8,
            DType::BF16 | DType::F16 => 2,
            DType::I64 => 8,
            DType::Bool => 1,
        }
    }
    /// Short name used in the text form (`f32`, `i64`, `bool`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::I64 => "i64",
            DType::Bool => "bool",
        }
    }
    /// Parses a short name as printed by [`DType::name`].
    pub fn from_name(s: &str) -> Option<DType> {
        match s {
            "f32" => Some(DType::F32),
            "f64" => Some(DType::F64),
            "bf16" => Some(DType::BF16),
            "f16" => Some(DType::F16),
            "i64" => Some(DType::I64),
            "bool" => Some(DType::Bool),
            _ => None,
        }
    }
    /// True for the floating-point types (the ones that carry gradients).
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::BF16 | DType::F16)
    }
    /// True for the 16-bit float types, stored narrow and computed in f32.
    pub fn is_half(self) -> bool {
        matches!(self, DType::BF16 | DType::F16)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Static type of a value: its shape and element type.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorMeta {
    /// Dimensions, outermost first. Empty for a scalar.
    pub shape: Vec<usize>,
    /// Element type.
    pub dtype: DType,
}

impl TensorMeta {
    /// A meta from a shape and a dtype.
    pub fn new(dtype: DType, shape: impl Into<Vec<usize>>) -> Self {
        TensorMeta { shape: shape.into(), dtype }
    }
    /// Number of elements. Saturates at `usize::MAX` for a shape that is not representable
    /// (see [`crate::shape`]); metas of a verified graph never are.
    pub fn numel(&self) -> usize {
        self.checked_numel().unwrap_or(usize::MAX)
    }
    /// Bytes of a dense tensor with this meta. Saturates at `usize::MAX` for a shape that is not
    /// representable; metas of a verified graph never are.
    pub fn bytes(&self) -> usize {
        self.checked_bytes().unwrap_or(usize::MAX)
    }
    /// Number of elements, or `None` when the shape's product overflows
    /// ([`crate::shape::checked_numel`]).
    pub fn checked_numel(&self) -> Option<usize> {
        crate::shape::checked_numel(&self.shape)
    }
    /// Bytes of a dense tensor with this meta, or `None` when they exceed `isize::MAX`
    /// ([`crate::shape::checked_bytes`]).
    pub fn checked_bytes(&self) -> Option<usize> {
        crate::shape::checked_bytes(&self.shape, self.dtype)
    }
    /// Rank (number of dimensions).
    pub fn rank(&self) -> usize {
        self.shape.len()
    }
}

impl fmt::Display for TensorMeta {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}[", self.dtype)?;
        for (i, d) in self.shape.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

/// Bytes per `memcpy` call in [`extend_fast`]: below glibc's `rep movsb` threshold (2 KiB for
/// SSE2, 4 KiB for AVX2), so every call takes its vector loop.
const COPY_CHUNK_BYTES: usize = 2048;

/// `out.extend_from_slice(src)`, as a sequence of small copies.
///
/// glibc 2.36 (Debian 12) copies blocks from a few KiB up to about half the L2 with `rep movsb`,
/// which on AMD Zen cores runs many times slower when source and destination share their offset
/// within a 4 KiB page — as two fresh heap blocks usually do (glibc bug 30994, fixed in 2.39).
/// Measured on this project's 2-core EPYC machine: a 256 KiB copy 159 us as one call, 10 us in
/// 2 KiB calls (BENCHMARKS.md, "Calibrating the cost model"). Sizes of 2 KiB and less are one
/// call, as before.
pub fn extend_fast<T: Copy>(out: &mut Vec<T>, src: &[T]) {
    let chunk = (COPY_CHUNK_BYTES / std::mem::size_of::<T>().max(1)).max(1);
    out.reserve(src.len());
    for s in src.chunks(chunk) {
        out.extend_from_slice(s);
    }
}

/// `src.to_vec()` through [`extend_fast`]'s small copies.
pub fn to_vec_fast<T: Copy>(src: &[T]) -> Vec<T> {
    let mut out = Vec::with_capacity(src.len());
    extend_fast(&mut out, src);
    out
}

/// Element storage of a [`Tensor`]. Cloning copies through [`extend_fast`]'s small copies.
#[derive(Debug, PartialEq)]
pub enum Data {
    /// f32 elements.
    F32(Vec<f32>),
    /// f64 elements.
    F64(Vec<f64>),
    /// bf16 elements.
    BF16(Vec<half::bf16>),
    /// f16 elements.
    F16(Vec<half::f16>),
    /// i64 elements.
    I64(Vec<i64>),
    /// bool elements.
    Bool(Vec<bool>),
}

impl Clone for Data {
    fn clone(&self) -> Data {
        match self {
            Data::F32(v) => Data::F32(to_vec_fast(v)),
            Data::F64(v) => Data::F64(to_vec_fast(v)),
            Data::BF16(v) => Data::BF16(to_vec_fast(v)),
            Data::F16(v) => Data::F16(to_vec_fast(v)),
            Data::I64(v) => Data::I64(to_vec_fast(v)),
            Data::Bool(v) => Data::Bool(to_vec_fast(v)),
        }
    }
}

impl Data {
    /// A copy, allocated fallibly.
    pub fn try_clone(&self) -> Result<Data, AllocError> {
        Ok(match self {
            Data::F32(v) => Data::F32(alloc::try_copy(v)?),
            Data::F64(v) => Data::F64(alloc::try_copy(v)?),
            Data::BF16(v) => Data::BF16(alloc::try_copy(v)?),
            Data::F16(v) => Data::F16(alloc::try_copy(v)?),
            Data::I64(v) => Data::I64(alloc::try_copy(v)?),
            Data::Bool(v) => Data::Bool(alloc::try_copy(v)?),
        })
    }
    /// Element type of this storage.
    pub fn dtype(&self) -> DType {
        match self {
            Data::F32(_) => DType::F32,
            Data::F64(_) => DType::F64,
            Data::BF16(_) => DType::BF16,
            Data::F16(_) => DType::F16,
            Data::I64(_) => DType::I64,
            Data::Bool(_) => DType::Bool,
        }
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Data::F32(v) => v.len(),
            Data::F64(v) => v.len(),
            Data::BF16(v) => v.len(),
            Data::F16(v) => v.len(),
            Data::I64(v) => v.len(),
            Data::Bool(v) => v.len(),
        }
    }
    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A dense, row-major host tensor.
///
/// Invariant: `data.len() == shape.iter().product()` and the shape is representable
/// ([`crate::shape`]); the constructors check both.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    shape: Vec<usize>,
    data: Data,
}

/// A tensor whose element count does not match its shape.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("tensor data has {len} elements but shape {shape:?} needs {}",
    needed.map_or_else(|| "more than a usize can count".to_string(), |n| n.to_string()))]
pub struct ShapeDataMismatch {
    /// The shape given.
    pub shape: Vec<usize>,
    /// Elements the shape needs (`None`: its product overflows, see [`crate::shape`]).
    pub needed: Option<usize>,
    /// Elements given.
    pub len: usize,
}

impl Tensor {
    /// A tensor from a shape and matching data.
    pub fn new(shape: impl Into<Vec<usize>>, data: Data) -> Result<Tensor, ShapeDataMismatch> {
        let shape = shape.into();
        // Checked: a wrapped product could match a short buffer and let kernels index past it.
        let needed = crate::shape::checked_bytes(&shape, data.dtype()).and(crate::shape::checked_numel(&shape));
        if needed != Some(data.len()) {
            return Err(ShapeDataMismatch { shape, needed, len: data.len() });
        }
        Ok(Tensor { shape, data })
    }
    /// An f32 tensor. Panics if the sizes disagree: for literals in code and tests.
    pub fn f32(shape: impl Into<Vec<usize>>, v: Vec<f32>) -> Tensor {
        Tensor::new(shape, Data::F32(v)).expect("f32 literal tensor with a consistent shape")
    }
    /// An f64 tensor. Panics if the sizes disagree: for literals in code and tests.
    pub fn f64(shape: impl Into<Vec<usize>>, v: Vec<f64>) -> Tensor {
        Tensor::new(shape, Data::F64(v)).expect("f64 literal tensor with a consistent shape")
    }
    /// An i64 tensor. Panics if the sizes disagree: for literals in code and tests.
    pub fn i64(shape: impl Into<Vec<usize>>, v: Vec<i64>) -> Tensor {
        Tensor::new(shape, Data::I64(v)).expect("i64 literal tensor with a consistent shape")
    }
    /// A bool tensor. Panics if the sizes disagree: for literals in code and tests.
    pub fn bool(shape: impl Into<Vec<usize>>, v: Vec<bool>) -> Tensor {
        Tensor::new(shape, Data::Bool(v)).expect("bool literal tensor with a consistent shape")
    }
    /// An f32 scalar.
    pub fn scalar_f32(x: f32) -> Tensor {
        Tensor::f32(Vec::<usize>::new(), vec![x])
    }
    /// A tensor of `meta` filled with zeros (false for bool), allocated fallibly: a meta is a
    /// model's or a plan's size ([`crate::alloc`]).
    pub fn zeros(meta: &TensorMeta) -> Result<Tensor, AllocError> {
        let n = meta.checked_numel().filter(|_| meta.checked_bytes().is_some()).ok_or(AllocError { bytes: None })?;
        let data = match meta.dtype {
            DType::F32 => Data::F32(alloc::try_filled(n, 0.0)?),
            DType::F64 => Data::F64(alloc::try_filled(n, 0.0)?),
            DType::BF16 => Data::BF16(alloc::try_filled(n, half::bf16::ZERO)?),
            DType::F16 => Data::F16(alloc::try_filled(n, half::f16::ZERO)?),
            DType::I64 => Data::I64(alloc::try_filled(n, 0)?),
            DType::Bool => Data::Bool(alloc::try_filled(n, false)?),
        };
        Ok(Tensor { shape: meta.shape.clone(), data })
    }
    /// A tensor of shape `[0]` (no elements, nothing allocated).
    pub fn empty(dtype: DType) -> Tensor {
        let data = match dtype {
            DType::F32 => Data::F32(Vec::new()),
            DType::F64 => Data::F64(Vec::new()),
            DType::BF16 => Data::BF16(Vec::new()),
            DType::F16 => Data::F16(Vec::new()),
            DType::I64 => Data::I64(Vec::new()),
            DType::Bool => Data::Bool(Vec::new()),
        };
        Tensor { shape: vec![0], data }
    }
    /// A copy, allocated fallibly (`clone` aborts when the system refuses the memory).
    pub fn try_clone(&self) -> Result<Tensor, AllocError> {
        Ok(Tensor { shape: self.shape.clone(), data: self.data.try_clone()? })
    }
    /// The block at `offsets` with shape `size` (a copy), or `None` when it does not lie inside
    /// this tensor.
    pub fn block(&self, offsets: &[usize], size: &[usize]) -> Option<Tensor> {
        let shape = &self.shape;
        let inside = shape.len() == offsets.len()
            && shape.len() == size.len()
            && (0..shape.len()).all(|d| offsets[d].checked_add(size[d]).is_some_and(|e| e <= shape[d]));
        if !inside {
            return None;
        }
        // Copies runs along the last dim, one per index of the others (a scalar: one run of 1).
        let (run, outer) = match size.split_last() {
            Some((&last, outer)) => (last, outer),
            None => (1, &[][..]),
        };
        let mut strides = vec![1usize; shape.len()];
        for d in (0..shape.len().saturating_sub(1)).rev() {
            strides[d] = strides[d + 1] * shape[d + 1];
        }
        let base: usize = offsets.iter().zip(&strides).map(|(o, s)| o * s).sum();
        let runs: usize = outer.iter().product();
        fn take<T: Copy>(v: &[T], base: usize, run: usize, runs: usize, outer: &[usize], strides: &[usize]) -> Vec<T> {
            let mut out = Vec::with_capacity(run * runs);
            let mut idx = vec![0usize; outer.len()];
            for _ in 0..if run == 0 { 0 } else { runs } {
                let at = base + idx.iter().zip(strides).map(|(i, s)| i * s).sum::<usize>();
                out.extend_from_slice(&v[at..at + run]);
                for d in (0..outer.len()).rev() {
                    idx[d] += 1;
                    if idx[d] < outer[d] {
                        break;
                    }
                    idx[d] = 0;
                }
            }
            out
        }
        let data = match &self.data {
            Data::F32(v) => Data::F32(take(v, base, run, runs, outer, &strides)),
            Data::F64(v) => Data::F64(take(v, base, run, runs, outer, &strides)),
            Data::BF16(v) => Data::BF16(take(v, base, run, runs, outer, &strides)),
            Data::F16(v) => Data::F16(take(v, base, run, runs, outer, &strides)),
            Data::I64(v) => Data::I64(take(v, base, run, runs, outer, &strides)),
            Data::Bool(v) => Data::Bool(take(v, base, run, runs, outer, &strides)),
        };
        Some(Tensor { shape: size.to_vec(), data })
    }
    /// Shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// Element type.
    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }
    /// Shape and dtype.
    pub fn meta(&self) -> TensorMeta {
        TensorMeta { shape: self.shape.clone(), dtype: self.dtype() }
    }
    /// Element storage.
    pub fn data(&self) -> &Data {
        &self.data
    }
    /// Consumes the tensor, returning its storage.
    pub fn into_data(self) -> Data {
        self.data
    }
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.data.len()
    }
    /// Bytes held by the elements.
    pub fn bytes(&self) -> usize {
        self.numel() * self.dtype().size()
    }
    /// The f32 elements, if this is an f32 tensor.
    pub fn as_f32(&self) -> Option<&[f32]> {
        match &self.data {
            Data::F32(v) => Some(v),
            _ => None,
        }
    }
    /// The f64 elements, if this is an f64 tensor.
    pub fn as_f64(&self) -> Option<&[f64]> {
        match &self.data {
            Data::F64(v) => Some(v),
            _ => None,
        }
    }
    /// The i64 elements, if this is an i64 tensor.
    pub fn as_i64(&self) -> Option<&[i64]> {
        match &self.data {
            Data::I64(v) => Some(v),
            _ => None,
        }
    }
    /// The bool elements, if this is a bool tensor.
    pub fn as_bool(&self) -> Option<&[bool]> {
        match &self.data {
            Data::Bool(v) => Some(v),
            _ => None,
        }
    }
    /// The same elements under another shape with the same element count.
    pub fn reshaped(mut self, shape: impl Into<Vec<usize>>) -> Result<Tensor, ShapeDataMismatch> {
        let shape = shape.into();
        let needed = crate::shape::checked_bytes(&shape, self.dtype()).and(crate::shape::checked_numel(&shape));
        if needed != Some(self.numel()) {
            return Err(ShapeDataMismatch { shape, needed, len: self.numel() });
        }
        self.shape = shape;
        Ok(self)
    }
    /// Elements as i64, converting from any dtype (bool as 0/1, f32 truncated).
    pub fn to_i64_vec(&self) -> Vec<i64> {
        match &self.data {
            Data::F32(v) => v.iter().map(|&x| x as i64).collect(),
            Data::F64(v) => v.iter().map(|&x| x as i64).collect(),
            Data::BF16(v) => v.iter().map(|&x| x.to_f32() as i64).collect(),
            Data::F16(v) => v.iter().map(|&x| x.to_f32() as i64).collect(),
            Data::I64(v) => v.clone(),
            Data::Bool(v) => v.iter().map(|&x| x as i64).collect(),
        }
    }
    /// Elements as f32, converting from any dtype.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match &self.data {
            Data::F32(v) => v.clone(),
            Data::F64(v) => v.iter().map(|&x| x as f32).collect(),
            Data::BF16(v) => half::slice::HalfFloatSliceExt::to_f32_vec(&v[..]),
            Data::F16(v) => half::slice::HalfFloatSliceExt::to_f32_vec(&v[..]),
            Data::I64(v) => v.iter().map(|&x| x as f32).collect(),
            Data::Bool(v) => v.iter().map(|&x| x as u8 as f32).collect(),
        }
    }
    /// Elements as f64, converting from any dtype (exact for f32, i64 up to 2^53 and bool).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        match &self.data {
            Data::F32(v) => v.iter().map(|&x| x as f64).collect(),
            Data::F64(v) => v.clone(),
            Data::BF16(v) => v.iter().map(|&x| x.to_f64()).collect(),
            Data::F16(v) => v.iter().map(|&x| x.to_f64()).collect(),
            Data::I64(v) => v.iter().map(|&x| x as f64).collect(),
            Data::Bool(v) => v.iter().map(|&x| x as u8 as f64).collect(),
        }
    }
    /// This tensor with its floating-point elements converted to `to` (f32 <-> f64); integer
    /// and bool tensors, and tensors already of `to`, are returned unchanged.
    pub fn with_float_type(self, to: DType) -> Tensor {
        if !self.dtype().is_float() || !to.is_float() || self.dtype() == to {
            return self;
        }
        let data = match (self.data, to) {
            (Data::F32(v), DType::F64) => Data::F64(v.iter().map(|&x| x as f64).collect()),
            (Data::F64(v), DType::F32) => Data::F32(v.iter().map(|&x| x as f32).collect()),
            (Data::F32(v), DType::BF16) => Data::BF16(half::vec::HalfFloatVecExt::from_f32_slice(&v)),
            (Data::F32(v), DType::F16) => Data::F16(half::vec::HalfFloatVecExt::from_f32_slice(&v)),
            (Data::F64(v), DType::BF16) => Data::BF16(v.iter().map(|&x| half::bf16::from_f64(x)).collect()),
            (Data::F64(v), DType::F16) => Data::F16(v.iter().map(|&x| half::f16::from_f64(x)).collect()),
            (d @ (Data::BF16(_) | Data::F16(_)), to) => {
                let wide = Tensor { shape: Vec::new(), data: d }.to_f32_vec();
                return Tensor { shape: self.shape, data: Data::F32(wide) }.with_float_type(to);
            }
            (d, _) => d,
        };
        Tensor { shape: self.shape, data }
    }
    /// A half-precision tensor widened to f32 (exact); any other tensor unchanged. Kernels run
    /// on the widened tensor and round their results back ([`Tensor::with_float_type`]).
    pub fn widened(self) -> Tensor {
        if self.dtype().is_half() { self.with_float_type(DType::F32) } else { self }
    }
    /// A bf16 tensor. Panics if the sizes disagree: for literals in code and tests.
    pub fn bf16(shape: impl Into<Vec<usize>>, v: &[f32]) -> Tensor {
        Tensor::f32(shape, v.to_vec()).with_float_type(DType::BF16)
    }
}

/// How matrix products (MatMul, Gemm, convolutions and their gradients) accumulate their sums.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Accumulation {
    /// In f32 (fused multiply-adds in the GEMM libraries, separate ones in the thin products'
    /// dot products), as BLAS libraries do: fast; a sum of `k` products carries a rounding error
    /// of a few `sqrt(k)` f32 ulps of its terms.
    #[default]
    F32,
    /// Products and sums in f64, rounded to f32 once at the end: about twice the time of a
    /// product, for results that do not depend on summation order at the f32 level (a sum that
    /// cancels to a few ulps of its terms keeps its sign).
    F64,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every block of a 3-D tensor (and of a scalar and empty blocks) is the elements an
    /// index-by-index walk picks.
    #[test]
    fn blocks_are_what_an_index_walk_picks() {
        let shape = [3usize, 4, 5];
        let t = Tensor::i64(shape.to_vec(), (0..60).collect());
        let at = |i: usize, j: usize, k: usize| (i * 20 + j * 5 + k) as i64;
        for (off, size) in
            [([0, 0, 0], [3, 4, 5]), ([1, 2, 3], [2, 2, 2]), ([2, 0, 4], [1, 4, 1]), ([0, 1, 0], [3, 0, 5])]
        {
            let b = t.block(&off, &size).expect("inside");
            let mut want = vec![];
            for i in 0..size[0] {
                for j in 0..size[1] {
                    for k in 0..size[2] {
                        want.push(at(off[0] + i, off[1] + j, off[2] + k));
                    }
                }
            }
            assert_eq!(b.shape(), &size);
            assert_eq!(b.as_i64().expect("i64"), &want[..], "{off:?} {size:?}");
        }
        assert!(t.block(&[2, 0, 0], &[2, 1, 1]).is_none());
        assert!(t.block(&[0, 0], &[1, 1]).is_none());
        assert!(t.block(&[usize::MAX, 0, 0], &[2, 1, 1]).is_none());
        let s = Tensor::scalar_f32(2.5);
        assert_eq!(s.block(&[], &[]).expect("scalar").as_f32(), Some(&[2.5f32][..]));
    }
}
