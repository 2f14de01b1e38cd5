// A CPU stand-in for libcuda, libnvrtc and libcublas, enough for kernels::cuda's tests.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include <regex>
#include <fstream>
#include <sstream>
#include <functional>
#include <dlfcn.h>
#include <unistd.h>

typedef unsigned long long CUdeviceptr;
typedef void* Handle;
typedef void (*Launcher)(void**, unsigned, unsigned);

static thread_local Handle current_ctx = nullptr;
static int primary_ctx_token = 0;

static const char* SHIM_MACROS = R"SHIM(
#define __device__
#define __forceinline__ inline
#define __shared__ static
)SHIM";

static const char* SHIM_RUNTIME = R"SHIM(
#include <barrier>
#include <cmath>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>
struct Dim3Shim { unsigned int x, y, z; };
static thread_local Dim3Shim blockIdx, blockDim, threadIdx, gridDim;
static thread_local std::barrier<>* emu_barrier;
static std::mutex emu_launch;
// Threads per emulated block: real threads meeting at __syncthreads, fewer than a GPU's.
static const unsigned EMU_THREADS = 4;
inline void __syncthreads() { emu_barrier->arrive_and_wait(); }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline double __longlong_as_double(long long i) { double d; std::memcpy(&d, &i, 8); return d; }
)SHIM";

extern "C" {
// ---------------- driver ----------------
int cuInit(unsigned) { return 0; }
int cuDeviceGetCount(int* n) { *n = 1; return 0; }
int cuDeviceGet(int* d, int ordinal) { if (ordinal != 0) return 101; *d = 0; return 0; }
int cuDeviceGetName(char* name, int len, int) { std::snprintf(name, len, "autopar CPU-emulated device"); return 0; }
int cuDeviceGetAttribute(int* v, int, int) { *v = 0; return 0; }
int cuDevicePrimaryCtxRetain(Handle* c, int) { *c = &primary_ctx_token; return 0; }
int cuDevicePrimaryCtxRelease_v2(int) { return 0; }
int cuCtxGetCurrent(Handle* c) { *c = current_ctx; return 0; }
int cuCtxSetCurrent(Handle c) { current_ctx = c; return 0; }
int cuCtxSynchronize() { return 0; }
int cuGetErrorString(int, const char** s) { *s = "emulated CUDA error"; return 0; }
int cuGetErrorName(int, const char** s) { *s = "CUDA_ERROR_EMULATED"; return 0; }
int cuStreamCreate(Handle* s, unsigned) { *s = new int(0); return 0; }
int cuStreamDestroy_v2(Handle s) { delete (int*)s; return 0; }
int cuStreamSynchronize(Handle) { return 0; }
int cuMemAlloc_v2(CUdeviceptr* p, size_t n) { void* m = std::malloc(n ? n : 1); if (!m) return 2; *p = (CUdeviceptr)m; return 0; }
int cuMemFree_v2(CUdeviceptr p) { std::free((void*)p); return 0; }
int cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, Handle) { std::memset((void*)p, v, n); return 0; }
int cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void* s, size_t n, Handle) { std::memcpy((void*)d, s, n); return 0; }
int cuMemcpyDtoHAsync_v2(void* d, CUdeviceptr s, size_t n, Handle) { std::memcpy(d, (void*)s, n); return 0; }
int cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, Handle) { std::memmove((void*)d, (void*)s, n); return 0; }
int cuModuleLoadData(Handle* m, const void* image) {
    void* h = dlopen((const char*)image, RTLD_NOW | RTLD_LOCAL);
    if (!h) { std::fprintf(stderr, "emulator: %s\n", dlerror()); return 200; }
    *m = h;
    return 0;
}
int cuModuleGetFunction(Handle* f, Handle m, const char* name) {
    void* sym = dlsym(m, (std::string("__emu_") + name).c_str());
    if (!sym) return 500;
    *f = sym;
    return 0;
}
int cuModuleUnload(Handle) { return 0; }
// Blocks run one after another, each with a few real threads (kernels must not assume
// blockDim); launches of one module are serialised (its __shared__ arrays are plain statics).
int cuLaunchKernel(Handle f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned,
                   Handle, void** params, void**) {
    if (gy != 1 || gz != 1 || by != 1 || bz != 1 || gx == 0 || bx == 0 || bx > 1024) return 1;
    ((Launcher)f)(params, gx, bx);
    return 0;
}

// ---------------- nvrtc ----------------
struct Program { std::string src, ptx, log; };
int nvrtcCreateProgram(Program** p, const char* src, const char*, int, const char* const*, const char* const*) {
    *p = new Program{src, "", ""};
    return 0;
}
int nvrtcDestroyProgram(Program** p) { delete *p; *p = nullptr; return 0; }

static std::string run(const std::string& cmd, int* status) {
    std::string out;
    FILE* f = popen((cmd + " 2>&1").c_str(), "r");
    if (!f) { *status = -1; return "popen failed"; }
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
    *status = pclose(f);
    return out;
}

// Compiles the CUDA source with the host C++ compiler into a shared library whose `__emu_NAME`
// functions run kernel NAME over a grid; the "PTX" is the library's path.
int nvrtcCompileProgram(Program* p, int, const char* const*) {
    const char* dir_env = std::getenv("AUTOPAR_FAKE_CUDA_DIR");
    std::string dir = dir_env ? dir_env : "/tmp";
    std::string key = std::to_string(std::hash<std::string>{}(p->src));
    std::string base = dir + "/kernels-" + key;
    std::string so = base + ".so";
    if (access(so.c_str(), R_OK) == 0) { p->ptx = so; return 0; }
    std::string tag = std::to_string(getpid()) + "-" + std::to_string((unsigned long)(size_t)p);
    // Find the kernels and their parameter types in the preprocessed source.
    {
        std::ofstream f(base + "-" + tag + ".pre.cpp");
        f << SHIM_MACROS << "#define __global__ KERNEL_MARK\n" << p->src;
    }
    int st = 0;
    std::string pre = run("c++ -E -P -x c++ " + base + "-" + tag + ".pre.cpp", &st);
    if (st != 0) { std::remove((base + "-" + tag + ".pre.cpp").c_str()); p->log = pre; return 6; }
    std::regex kernel(R"(extern\s+"C"\s+KERNEL_MARK\s+void\s+(\w+)\s*\(([^)]*)\))");
    std::string wrappers;
    for (auto it = std::sregex_iterator(pre.begin(), pre.end(), kernel); it != std::sregex_iterator(); ++it) {
        std::string name = (*it)[1], params = (*it)[2];
        std::string call;
        std::stringstream ps(params);
        std::string one;
        int i = 0;
        while (std::getline(ps, one, ',')) {
            size_t end = one.find_last_not_of(" \t\n");
            size_t start = one.find_last_of(" \t\n*&", end);
            std::string type = one.substr(0, start + 1);
            if (i) call += ", ";
            call += "*(" + type + "*)p[" + std::to_string(i) + "]";
            ++i;
        }
        wrappers += "extern \"C\" void __emu_" + name + "(void** p, unsigned grid, unsigned block) {\n"
                    "    std::lock_guard<std::mutex> lock(emu_launch);\n"
                    "    unsigned nt = block < EMU_THREADS ? block : EMU_THREADS;\n"
                    "    for (unsigned b = 0; b < grid; ++b) {\n"
                    "        std::barrier<> bar(nt);\n"
                    "        std::vector<std::thread> ts;\n"
                    "        for (unsigned t = 0; t < nt; ++t) ts.emplace_back([&, t] {\n"
                    "            emu_barrier = &bar; gridDim = {grid, 1, 1}; blockDim = {nt, 1, 1};\n"
                    "            blockIdx = {b, 0, 0}; threadIdx = {t, 0, 0};\n"
                    "            " + name + "(" + call + ");\n"
                    "        });\n"
                    "        for (auto& th : ts) th.join();\n"
                    "    }\n}\n";
    }
    {
        std::ofstream f(base + "-" + tag + ".cpp");
        f << SHIM_RUNTIME << SHIM_MACROS << "#define __global__\n" << p->src << "\n" << wrappers;
    }
    std::string out = run("c++ -std=c++20 -O1 -shared -fPIC -pthread -o " + base + "-" + tag + ".so " + base + "-" + tag + ".cpp", &st);
    std::remove((base + "-" + tag + ".cpp").c_str());
    std::remove((base + "-" + tag + ".pre.cpp").c_str());
    if (st != 0) { p->log = out; return 6; }
    std::rename((base + "-" + tag + ".so").c_str(), so.c_str());
    p->ptx = so;
    return 0;
}
int nvrtcGetPTXSize(Program* p, size_t* n) { *n = p->ptx.size() + 1; return 0; }
int nvrtcGetPTX(Program* p, char* out) { std::memcpy(out, p->ptx.c_str(), p->ptx.size() + 1); return 0; }
int nvrtcGetProgramLogSize(Program* p, size_t* n) { *n = p->log.size() + 1; return 0; }
int nvrtcGetProgramLog(Program* p, char* out) { std::memcpy(out, p->log.c_str(), p->log.size() + 1); return 0; }

// ---------------- cublas (column-major, as the real one) ----------------
int cublasCreate_v2(Handle* h) { *h = new int(0); return 0; }
int cublasDestroy_v2(Handle h) { delete (int*)h; return 0; }
int cublasSetStream_v2(Handle, Handle) { return 0; }
int cublasSetMathMode(Handle, int) { return 0; }
static void sgemm1(int ta, int tb, int m, int n, int k, float alpha, const float* A, int lda, const float* B, int ldb,
                   float beta, float* C, int ldc) {
    for (int j = 0; j < n; ++j)
        for (int i = 0; i < m; ++i) {
            double acc = 0.0;
            for (int l = 0; l < k; ++l) {
                float a = ta ? A[l + (long)i * lda] : A[i + (long)l * lda];
                float b = tb ? B[j + (long)l * ldb] : B[l + (long)j * ldb];
                acc += (double)a * b;
            }
            float* c = &C[i + (long)j * ldc];
            *c = (float)(alpha * acc) + (beta == 0.f ? 0.f : beta * *c);
        }
}
static int check_ld(int ta, int tb, int m, int n, int k, int lda, int ldb, int ldc) {
    int ra = ta ? k : m, rb = tb ? n : k;
    if (m < 0 || n < 0 || k < 0 || lda < (ra > 1 ? ra : 1) || ldb < (rb > 1 ? rb : 1) || ldc < (m > 1 ? m : 1)) return 7;
    return 0;
}
int cublasSgemm_v2(Handle, int ta, int tb, int m, int n, int k, const float* alpha, const float* A, int lda,
                   const float* B, int ldb, const float* beta, float* C, int ldc) {
    if (int e = check_ld(ta, tb, m, n, k, lda, ldb, ldc)) return e;
    sgemm1(ta, tb, m, n, k, *alpha, A, lda, B, ldb, *beta, C, ldc);
    return 0;
}
// GemmEx with f32 compute: A and B of type 0 (f32), 2 (f16) or 14 (bf16), C f32 (type 0).
static float load_elem(const void* p, int type, long i) {
    if (type == 0) return ((const float*)p)[i];
    unsigned short h = ((const unsigned short*)p)[i];
    unsigned int bits;
    if (type == 14) {
        bits = (unsigned int)h << 16;
    } else {
        unsigned int sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
        if (e == 0) {
            float v = (float)m * 5.9604644775390625e-8f;
            return sign ? -v : v;
        }
        bits = e == 31 ? (sign | 0x7f800000u | (m << 13)) : (sign | ((e + 112u) << 23) | (m << 13));
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}
static void gemm_ex1(int ta, int tb, int m, int n, int k, float alpha, const void* A, int at, int lda, const void* B,
                     int bt, int ldb, float beta, float* C, int ldc) {
    for (int j = 0; j < n; ++j)
        for (int i = 0; i < m; ++i) {
            double acc = 0.0;
            for (int l = 0; l < k; ++l) {
                float a = load_elem(A, at, ta ? l + (long)i * lda : i + (long)l * lda);
                float b = load_elem(B, bt, tb ? j + (long)l * ldb : l + (long)j * ldb);
                acc += (double)a * b;
            }
            float* c = &C[i + (long)j * ldc];
            *c = (float)(alpha * acc) + (beta == 0.f ? 0.f : beta * *c);
        }
}
static int ex_types(int at, int bt, int ct) {
    bool ok = (at == 0 || at == 2 || at == 14) && bt == at && ct == 0;
    return ok ? 0 : 7;
}
int cublasGemmEx(Handle, int ta, int tb, int m, int n, int k, const void* alpha, const void* A, int at, int lda,
                 const void* B, int bt, int ldb, const void* beta, void* C, int ct, int ldc, int, int) {
    if (int e = check_ld(ta, tb, m, n, k, lda, ldb, ldc)) return e;
    if (int e = ex_types(at, bt, ct)) return e;
    gemm_ex1(ta, tb, m, n, k, *(const float*)alpha, A, at, lda, B, bt, ldb, *(const float*)beta, (float*)C, ldc);
    return 0;
}
int cublasGemmStridedBatchedEx(Handle, int ta, int tb, int m, int n, int k, const void* alpha, const void* A, int at,
                               int lda, long long sa, const void* B, int bt, int ldb, long long sb, const void* beta,
                               void* C, int ct, int ldc, long long sc, int batch, int, int) {
    if (int e = check_ld(ta, tb, m, n, k, lda, ldb, ldc)) return e;
    if (int e = ex_types(at, bt, ct)) return e;
    size_t ea = at == 0 ? 4 : 2, eb = bt == 0 ? 4 : 2;
    for (int i = 0; i < batch; ++i)
        gemm_ex1(ta, tb, m, n, k, *(const float*)alpha, (const char*)A + i * sa * ea, at, lda, (const char*)B + i * sb * eb,
                 bt, ldb, *(const float*)beta, (float*)C + i * sc, ldc);
    return 0;
}
int cublasSgemmStridedBatched(Handle, int ta, int tb, int m, int n, int k, const float* alpha, const float* A,
                              int lda, long long sa, const float* B, int ldb, long long sb, const float* beta,
                              float* C, int ldc, long long sc, int batch) {
    if (int e = check_ld(ta, tb, m, n, k, lda, ldb, ldc)) return e;
    for (int i = 0; i < batch; ++i) sgemm1(ta, tb, m, n, k, *alpha, A + i * sa, lda, B + i * sb, ldb, *beta, C + i * sc, ldc);
    return 0;
}
}
