//! The device context: driver handle, stream, cuBLAS handle, lazily compiled NVRTC modules and
//! device memory accounting; plus the launch helpers every op family uses.

use crate::Error;
use cudarc::cublas::CudaBlas;
use cudarc::driver::{self as drv, CudaFunction, CudaModule, CudaSlice, CudaStream, DeviceRepr, LaunchConfig};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// The op families whose kernels are compiled together (one NVRTC module each).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Family {
    /// Unary, binary, where, cast, fill.
    Elementwise,
    /// Reductions over `[outer, red, inner]`.
    Reduce,
    /// Softmax, layer norm, batch norm, LRN and their gradients.
    Norm,
    /// Strided copies, gather, scatter, pad.
    Shape,
    /// im2col / col2im and pooling.
    Conv,
    /// Unary gradients and optimizer updates.
    Optim,
    /// Resize's per-axis linear maps.
    Resize,
    /// The activation family: newer activations, math functions, PRelu, bitwise ops, Hardmax.
    Activation,
    /// The indexing family: triangles, gathers and scatters by index, cumulative sums,
    /// arg-reductions, top-k.
    Index,
    /// Counter-based random numbers: training-mode dropout.
    Random,
}

const FAMILIES: usize = 10;

impl Family {
    fn index(self) -> usize {
        self as usize
    }
    fn source(self) -> &'static str {
        match self {
            Family::Elementwise => super::elementwise::SRC,
            Family::Reduce => super::reduce::SRC,
            Family::Norm => super::norm::SRC,
            Family::Shape => super::shape::SRC,
            Family::Conv => super::conv::SRC,
            Family::Optim => super::optim::SRC,
            Family::Resize => super::resize::SRC,
            Family::Activation => super::activation::SRC,
            Family::Index => super::index::SRC,
            Family::Random => super::random::SRC,
        }
    }
}

/// Definitions shared by every family's source: integer types, the strided-index descriptor
/// (mirrors [`Strided`]) and the grid-stride loop.
pub(crate) const PRELUDE: &str = r#"
typedef long long i64;
typedef unsigned long long u64;
typedef unsigned char u8;
#define MAXR 12
struct Strided {
    i64 rank;
    i64 dims[MAXR];
    i64 st[4][MAXR];
    i64 base[4];
};
// Offsets of element i (row-major over dims) in the first `k` operands.
__device__ __forceinline__ void offsets(const Strided& s, int k, i64 i, i64* off) {
    for (int j = 0; j < k; ++j) off[j] = s.base[j];
    for (int d = (int)s.rank - 1; d >= 0; --d) {
        i64 q = i % s.dims[d];
        i /= s.dims[d];
        for (int j = 0; j < k; ++j) off[j] += q * s.st[j][d];
    }
}
#define FOR_EACH(i, n) for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (i64)(n); i += (i64)blockDim.x * gridDim.x)
__device__ __forceinline__ i64 wrap_add(i64 a, i64 b) { return (i64)((u64)a + (u64)b); }
__device__ __forceinline__ i64 wrap_sub(i64 a, i64 b) { return (i64)((u64)a - (u64)b); }
__device__ __forceinline__ i64 wrap_mul(i64 a, i64 b) { return (i64)((u64)a * (u64)b); }
// NVRTC has neither INFINITY nor (reliably) isnan/isinf/isfinite without headers: our own.
#define F_INF __int_as_float(0x7f800000)
#define D_INF __longlong_as_double(0x7ff0000000000000LL)
__device__ __forceinline__ bool is_nan(float x) { return x != x; }
__device__ __forceinline__ bool is_nan(double x) { return x != x; }
__device__ __forceinline__ bool is_inf(float x) { return fabsf(x) == F_INF; }
__device__ __forceinline__ bool is_inf(double x) { return fabs(x) == D_INF; }
__device__ __forceinline__ bool is_finite(float x) { return fabsf(x) < F_INF; }
__device__ __forceinline__ bool is_finite(double x) { return fabs(x) < D_INF; }
__device__ __forceinline__ float nan_max(float a, float b) { return (is_nan(a) || is_nan(b)) ? __int_as_float(0x7fc00000) : fmaxf(a, b); }
__device__ __forceinline__ float nan_min(float a, float b) { return (is_nan(a) || is_nan(b)) ? __int_as_float(0x7fc00000) : fminf(a, b); }
__device__ __forceinline__ double nan_max_d(double a, double b) { return (is_nan(a) || is_nan(b)) ? __longlong_as_double(0x7ff8000000000000LL) : fmax(a, b); }
__device__ __forceinline__ double nan_min_d(double a, double b) { return (is_nan(a) || is_nan(b)) ? __longlong_as_double(0x7ff8000000000000LL) : fmin(a, b); }
"#;

/// Most dims a strided kernel walks after merging contiguous dims ([`Strided::new`]).
pub(crate) const MAX_RANK: usize = 12;

/// Threads per block of the 1-D kernels.
pub(crate) const BLOCK: u32 = 256;

/// Where each of up to four operands' elements sit while a kernel walks an index space
/// row-major: `offset_k(i) = base[k] + sum_d idx_d(i) * st[k][d]` (in elements; strides may be
/// negative or 0 for broadcast dims). Passed to kernels by value; layout matches `PRELUDE`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Strided {
    rank: i64,
    dims: [i64; MAX_RANK],
    st: [[i64; MAX_RANK]; 4],
    base: [i64; 4],
}

// SAFETY: `Strided` is `repr(C)`, made only of i64s, and matches the `Strided` struct of
// `PRELUDE` field for field, so the kernel reads it as written.
unsafe impl DeviceRepr for Strided {}

impl Strided {
    /// The walk of index space `dims` with operands `ops[k] = (base, strides)` (one stride per
    /// dim). Size-1 dims are dropped and dims every operand walks contiguously are merged, so
    /// tensors of any rank fit as long as at most [`MAX_RANK`] distinct dims remain.
    pub fn new(op: &'static str, dims: &[usize], ops: &[(isize, &[isize])]) -> Result<Strided, Error> {
        debug_assert!(ops.len() <= 4 && ops.iter().all(|(_, s)| s.len() == dims.len()));
        let mut d: Vec<i64> = Vec::new();
        let mut st: Vec<Vec<i64>> = vec![Vec::new(); ops.len()];
        for (i, &n) in dims.iter().enumerate() {
            if n == 1 {
                continue;
            }
            let merge =
                !d.is_empty() && ops.iter().zip(&st).all(|((_, s), v)| v[v.len() - 1] == s[i] as i64 * n as i64);
            if merge {
                *d.last_mut().expect("non-empty") *= n as i64;
                for ((_, s), v) in ops.iter().zip(st.iter_mut()) {
                    *v.last_mut().expect("non-empty") = s[i] as i64;
                }
            } else {
                d.push(n as i64);
                for ((_, s), v) in ops.iter().zip(st.iter_mut()) {
                    v.push(s[i] as i64);
                }
            }
        }
        if d.len() > MAX_RANK {
            return Err(Error::Unsupported {
                op,
                reason: format!("{} non-mergeable dims (the CUDA kernels walk at most {MAX_RANK})", d.len()),
            });
        }
        let mut s = Strided { rank: d.len() as i64, ..Strided::default() };
        s.dims[..d.len()].copy_from_slice(&d);
        for (k, ((base, _), v)) in ops.iter().zip(&st).enumerate() {
            s.base[k] = *base as i64;
            s.st[k][..v.len()].copy_from_slice(v);
        }
        Ok(s)
    }

    /// Fills the descriptor as given, without merging dims: `dims` and up to four per-dim
    /// arrays for kernels that read them as something other than strides (`dims.len()` must be
    /// at most [`MAX_RANK`]; callers check).
    pub fn set_raw(&mut self, dims: &[usize], arrays: &[&[isize]]) {
        debug_assert!(dims.len() <= MAX_RANK && arrays.len() <= 4);
        self.rank = dims.len() as i64;
        for (d, &n) in dims.iter().enumerate() {
            self.dims[d] = n as i64;
        }
        for (k, a) in arrays.iter().enumerate() {
            for (d, &v) in a.iter().enumerate() {
                self.st[k][d] = v as i64;
            }
        }
    }
}

/// Row-major strides of `shape`, in elements.
pub(crate) fn contiguous(shape: &[usize]) -> Vec<isize> {
    let mut s = vec![1isize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1] as isize;
    }
    s
}

/// Strides that read a tensor of `shape` broadcast (numpy rules) to rank `rank`: 0 along
/// broadcast dims.
pub(crate) fn broadcast_strides(shape: &[usize], rank: usize) -> Vec<isize> {
    let c = contiguous(shape);
    let mut st = vec![0isize; rank];
    for i in 0..shape.len() {
        st[i + rank - shape.len()] = if shape[i] == 1 { 0 } else { c[i] };
    }
    st
}

/// A grid-stride launch over `n` items (`n > 0`).
pub(crate) fn grid(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(BLOCK as usize).clamp(1, 1 << 20) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
}

/// One block of [`BLOCK`] threads per item (`n > 0`; rows past 2^31 do not fit a grid).
pub(crate) fn per_block(op: &'static str, n: usize) -> Result<LaunchConfig, Error> {
    let blocks = u32::try_from(n)
        .ok()
        .filter(|&b| b < i32::MAX as u32)
        .ok_or_else(|| Error::Unsupported { op, reason: format!("{n} rows do not fit one CUDA grid") })?;
    Ok(LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 })
}

/// A failed driver, cuBLAS or NCCL call of `op`.
pub(crate) fn cuda_err(op: &'static str, e: impl std::fmt::Debug) -> Error {
    Error::Cuda { op, message: format!("{e:?}") }
}

/// Bytes allocated through a context, shared with every buffer it allocated so that dropping
/// a buffer after the context is gone still balances the count.
#[derive(Debug, Default)]
pub(crate) struct Memory {
    in_use: AtomicUsize,
    peak: AtomicUsize,
}

impl Memory {
    fn add(&self, n: usize) {
        let now = self.in_use.fetch_add(n, Ordering::Relaxed) + n;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }
    fn sub(&self, n: usize) {
        self.in_use.fetch_sub(n, Ordering::Relaxed);
    }
}

/// A device allocation counted in its context's [`Memory`]. Always at least one element long
/// (CUDA rejects empty allocations); kernels are given the logical length separately.
#[derive(Debug)]
pub(crate) struct DeviceBuf<T> {
    pub(crate) s: CudaSlice<T>,
    bytes: usize,
    memory: Arc<Memory>,
}

impl<T> Drop for DeviceBuf<T> {
    fn drop(&mut self) {
        self.memory.sub(self.bytes);
    }
}

/// A CUDA device with its stream, cuBLAS handle and compiled kernels.
///
/// Made by [`CudaContext::new`]; everything it runs goes to its one stream, in order. It can be
/// shared between threads (`Sync`), but work from several threads interleaves on the stream.
pub struct CudaContext {
    ordinal: usize,
    name: String,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    modules: [OnceLock<Arc<CudaModule>>; FAMILIES],
    functions: Mutex<HashMap<(Family, &'static str), CudaFunction>>,
    memory: Arc<Memory>,
}

impl std::fmt::Debug for CudaContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaContext")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .field("bytes_in_use", &self.bytes_in_use())
            .finish()
    }
}

/// Runs a cudarc call that may panic when a library or one of its symbols is missing (cudarc
/// panics rather than returning an error there), turning the panic into [`Error::NoCudaDevice`].
fn guarded<T>(what: &str, f: impl FnOnce() -> T) -> Result<T, Error> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|p| {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "unknown panic".into());
        Error::NoCudaDevice(format!("{what}: {msg}"))
    })
}

/// Why the CUDA libraries the backend needs cannot be loaded, if they cannot.
fn missing_library() -> Option<String> {
    // SAFETY: each check only tries to open a shared library by name (dlopen) and closes it.
    let checks: [(bool, &str); 3] = unsafe {
        [
            (drv::sys::is_culib_present(), "libcuda.so not found (is the NVIDIA driver installed?)"),
            (
                cudarc::nvrtc::sys::is_culib_present(),
                "libnvrtc.so not found (install NVRTC, e.g. the cuda-nvrtc package, with its directory on LD_LIBRARY_PATH)",
            ),
            (
                cudarc::cublas::sys::is_culib_present(),
                "libcublas.so not found (install cuBLAS, e.g. the libcublas package, with its directory on LD_LIBRARY_PATH)",
            ),
        ]
    };
    checks.iter().find(|(present, _)| !present).map(|(_, why)| why.to_string())
}

/// True when this build can drive CUDA devices: the driver, NVRTC and cuBLAS libraries load
/// and the driver reports at least one device.
pub fn is_available() -> bool {
    missing_library().is_none() && matches!(guarded("cuInit", drv::CudaContext::device_count), Ok(Ok(n)) if n > 0)
}

/// Number of CUDA devices the driver reports (for choosing a device per rank).
///
/// Errors with [`Error::NoCudaDevice`] when the driver or a library is missing or the driver
/// fails to initialise; never panics for those.
pub fn device_count() -> Result<usize, Error> {
    if let Some(why) = missing_library() {
        return Err(Error::NoCudaDevice(why));
    }
    let count = guarded("cuInit", drv::CudaContext::device_count)?
        .map_err(|e| Error::NoCudaDevice(format!("the driver did not initialise: {e:?}")))?;
    Ok(usize::try_from(count).unwrap_or(0))
}

impl CudaContext {
    /// Opens CUDA device `ordinal` with a new stream and a cuBLAS handle.
    ///
    /// Errors with [`Error::NoCudaDevice`] when the driver or a library is missing, the driver
    /// fails to initialise, or there is no such device; never panics for those. Kernels are
    /// compiled on first use.
    pub fn new(ordinal: usize) -> Result<CudaContext, Error> {
        if let Some(why) = missing_library() {
            return Err(Error::NoCudaDevice(why));
        }
        let count = guarded("cuInit", drv::CudaContext::device_count)?
            .map_err(|e| Error::NoCudaDevice(format!("the driver did not initialise: {e:?}")))?;
        if count <= 0 {
            return Err(Error::NoCudaDevice("the driver reports no CUDA device".into()));
        }
        if ordinal >= count as usize {
            return Err(Error::NoCudaDevice(format!("device {ordinal} requested but the driver reports {count}")));
        }
        let device = guarded("cuDevicePrimaryCtxRetain", || drv::CudaContext::new(ordinal))?
            .map_err(|e| Error::NoCudaDevice(format!("cannot open device {ordinal}: {e:?}")))?;
        // SAFETY: all work of this context goes to the one stream made below, in order, so
        // cudarc's per-buffer events (which order work across streams) are not needed; no
        // buffer exists yet.
        unsafe { device.disable_event_tracking() };
        let stream = device.new_stream().map_err(|e| cuda_err("cuda", e))?;
        let blas = guarded("cublasCreate", || CudaBlas::new(stream.clone()))?.map_err(|e| cuda_err("cublas", e))?;
        // Plain f32 arithmetic in GEMMs: no TF32 tensor-core rounding (the default math mode
        // already excludes it; set it explicitly so a changed default cannot creep in).
        // SAFETY: the handle is live (owned by `blas`).
        unsafe {
            cudarc::cublas::sys::cublasSetMathMode(
                *blas.handle(),
                cudarc::cublas::sys::cublasMath_t::CUBLAS_DEFAULT_MATH,
            )
        }
        .result()
        .map_err(|e| cuda_err("cublas", e))?;
        let name = device.name().unwrap_or_else(|_| format!("CUDA device {ordinal}"));
        Ok(CudaContext {
            ordinal,
            name,
            stream,
            blas,
            modules: [const { OnceLock::new() }; FAMILIES],
            functions: Mutex::new(HashMap::new()),
            memory: Arc::new(Memory::default()),
        })
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device's name as the driver reports it.
    pub fn device_name(&self) -> &str {
        &self.name
    }

    /// Bytes of device memory currently allocated through this context (tensors and kernel
    /// scratch; not cuBLAS or NCCL internal workspaces).
    pub fn bytes_in_use(&self) -> usize {
        self.memory.in_use.load(Ordering::Relaxed)
    }

    /// The most bytes allocated at once since the context was made or [`Self::reset_peak`].
    pub fn peak_bytes(&self) -> usize {
        self.memory.peak.load(Ordering::Relaxed)
    }

    /// Restarts peak tracking from the current usage.
    pub fn reset_peak(&self) {
        self.memory.peak.store(self.bytes_in_use(), Ordering::Relaxed);
    }

    /// Waits until all work queued on the context's stream has finished.
    pub fn synchronize(&self) -> Result<(), Error> {
        self.stream.synchronize().map_err(|e| cuda_err("synchronize", e))
    }

    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub(crate) fn blas(&self) -> &CudaBlas {
        &self.blas
    }

    /// An uninitialised buffer of `n` elements (at least one is allocated).
    pub(crate) fn alloc<T: DeviceRepr>(&self, op: &'static str, n: usize) -> Result<DeviceBuf<T>, Error> {
        let len = n.max(1);
        // SAFETY: every caller writes the `n` elements it reads back before reading them
        // (kernels fill their outputs; uploads copy into them).
        let s = unsafe { self.stream.alloc::<T>(len) }.map_err(|e| cuda_err(op, e))?;
        Ok(self.track(s))
    }

    /// A buffer of `n` zeros (bit pattern 0: 0.0, 0, false).
    pub(crate) fn zeros<T: DeviceRepr + drv::ValidAsZeroBits>(
        &self,
        op: &'static str,
        n: usize,
    ) -> Result<DeviceBuf<T>, Error> {
        let s = self.stream.alloc_zeros::<T>(n.max(1)).map_err(|e| cuda_err(op, e))?;
        Ok(self.track(s))
    }

    /// A buffer holding a copy of host data.
    pub(crate) fn upload_slice<T: DeviceRepr>(&self, op: &'static str, v: &[T]) -> Result<DeviceBuf<T>, Error> {
        let mut b = self.alloc::<T>(op, v.len())?;
        if !v.is_empty() {
            self.stream.memcpy_htod(v, &mut b.s).map_err(|e| cuda_err(op, e))?;
        }
        Ok(b)
    }

    /// The first `n` elements of a buffer, copied to the host (synchronises the stream).
    pub(crate) fn download_slice<T: DeviceRepr + Default + Clone>(
        &self,
        op: &'static str,
        b: &DeviceBuf<T>,
        n: usize,
    ) -> Result<Vec<T>, Error> {
        let mut v = vec![T::default(); n];
        if n > 0 {
            self.stream.memcpy_dtoh(&b.s.slice(..n), &mut v).map_err(|e| cuda_err(op, e))?;
        }
        self.synchronize()?;
        Ok(v)
    }

    fn track<T>(&self, s: CudaSlice<T>) -> DeviceBuf<T> {
        let bytes = s.num_bytes();
        self.memory.add(bytes);
        DeviceBuf { s, bytes, memory: self.memory.clone() }
    }

    /// The kernel `name` of `family`, compiling the family's module on first use.
    pub(crate) fn func(&self, family: Family, name: &'static str) -> Result<CudaFunction, Error> {
        let mut cache = self.functions.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = cache.get(&(family, name)) {
            return Ok(f.clone());
        }
        let module = self.module(family)?;
        let f = module.load_function(name).map_err(|e| cuda_err(name, e))?;
        cache.insert((family, name), f.clone());
        Ok(f)
    }

    fn module(&self, family: Family) -> Result<Arc<CudaModule>, Error> {
        let slot = &self.modules[family.index()];
        if let Some(m) = slot.get() {
            return Ok(m.clone());
        }
        let src = format!("{PRELUDE}\n{}", family.source());
        let ptx = cudarc::nvrtc::compile_ptx(src).map_err(|e| Error::Cuda {
            op: "nvrtc",
            message: format!("compiling the {family:?} kernels failed: {}", compile_log(&e)),
        })?;
        let m = self.stream.context().load_module(ptx).map_err(|e| cuda_err("nvrtc", e))?;
        Ok(slot.get_or_init(|| m).clone())
    }
}

/// The compiler log of a failed NVRTC compilation (the error's debug form otherwise).
fn compile_log(e: &cudarc::nvrtc::CompileError) -> String {
    match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
        other => format!("{other:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strided_merges_contiguous_dims_and_drops_ones() {
        // [2, 3, 4] + [4]: the output walks [24] contiguously; b repeats every 4.
        let out = [2, 3, 4];
        let (sa, sb) = (contiguous(&out), broadcast_strides(&[4], 3));
        assert_eq!(sb, vec![0, 0, 1]);
        let s = Strided::new("test", &out, &[(0, &sa), (0, &sb)]).unwrap();
        assert_eq!(s.rank, 2);
        assert_eq!(&s.dims[..2], &[6, 4]);
        assert_eq!(&s.st[0][..2], &[4, 1]);
        assert_eq!(&s.st[1][..2], &[0, 1]);
        // A transpose does not merge; size-1 dims vanish.
        let s = Strided::new("test", &[3, 1, 2], &[(5, &[1, 7, 3])]).unwrap();
        assert_eq!((s.rank, &s.dims[..2], &s.st[0][..2], s.base[0]), (2, &[3, 2][..], &[1, 3][..], 5));
        // A scalar walk has rank 0 (one element at the base).
        assert_eq!(Strided::new("test", &[], &[(0, &[])]).unwrap().rank, 0);
    }

    #[test]
    fn strided_rejects_too_many_distinct_dims() {
        let dims = vec![2; MAX_RANK + 1];
        // Reversed strides never merge.
        let st: Vec<isize> = (0..dims.len()).map(|i| 1 << i).collect();
        let e = Strided::new("transpose", &dims, &[(0, &st)]).unwrap_err();
        assert!(matches!(e, Error::Unsupported { op: "transpose", .. }), "{e}");
    }

    /// Enough of CUDA's device environment for a host C++ compiler to type-check the kernels.
    const SHIM: &str = r#"
#include <cmath>
using std::isnan; using std::isinf; using std::isfinite;
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
struct Dim3Shim { unsigned int x, y, z; };
static Dim3Shim blockIdx, blockDim, threadIdx, gridDim;
inline void __syncthreads() {}
inline float __int_as_float(int) { return 0.f; }
inline int __float_as_int(float) { return 0; }
inline double __longlong_as_double(long long) { return 0.0; }
"#;

    /// NVRTC is not available without a GPU driver, so the kernel sources are type-checked by
    /// the host C++ compiler against a small shim of CUDA's built-ins: it catches syntax and
    /// type errors, not device semantics.
    #[test]
    fn kernel_sources_type_check_as_cpp() {
        let Ok(v) = std::process::Command::new("c++").arg("--version").output() else {
            println!("skipped: no host C++ compiler to type-check the CUDA sources");
            return;
        };
        assert!(v.status.success());
        let dir = std::env::temp_dir().join(format!("autopar-cuda-src-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for fam in [
            Family::Elementwise,
            Family::Reduce,
            Family::Norm,
            Family::Shape,
            Family::Conv,
            Family::Optim,
            Family::Resize,
            Family::Activation,
            Family::Index,
            Family::Random,
        ] {
            let path = dir.join(format!("{fam:?}.cpp"));
            std::fs::write(&path, format!("{SHIM}\n{PRELUDE}\n{}", fam.source())).unwrap();
            let out = std::process::Command::new("c++")
                .args(["-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Werror"])
                .arg(&path)
                .output()
                .unwrap();
            assert!(out.status.success(), "{fam:?} kernels:\n{}", String::from_utf8_lossy(&out.stderr));
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}
