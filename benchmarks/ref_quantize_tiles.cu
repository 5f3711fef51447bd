/* A minimal C binding of the reference encoder's tile kernels (exllamav3 1.6.5 quantize_tiles), for
 * benchmarks/encode_speed.py only. It is not part of fq: nothing here is shipped or used to encode.
 *
 * The kernels come from the installed exllamav3 package (its headers are included from there at build
 * time; none of their code is in this repository). This file only launches them the way the package's
 * own host code (quant/quantize.cu, qt_launch) does: block size read back from the compiled kernel,
 * dynamic shared memory as the package computes it, and batches of (resident blocks per SM x SMs) tiles
 * sharing one scratch area.
 *
 * Built per K in separate translation units (-DFQREF_K=k, compiled in parallel) plus one with
 * -DFQREF_HOST for the C interface.
 */
#include <cuda_runtime.h>
#include <stdint.h>

#include "quant/quantize_tiles_optimized.cuh"

typedef void (*fqref_kernel_t)(const float*, float*, uint16_t*, half*, uint16_t*, const half2*);

#ifdef FQREF_K
#define FQREF_CAT2(a, b) a##b
#define FQREF_CAT(a, b) FQREF_CAT2(a, b)
extern "C" fqref_kernel_t FQREF_CAT(fqref_kernel_k, FQREF_K)(int cb, int opt)
{
    switch (cb) {
    case 0: return opt ? quantize_tiles_optimized_kernel<FQREF_K, 0> : quantize_tiles_kernel<FQREF_K, 0>;
    case 1: return opt ? quantize_tiles_optimized_kernel<FQREF_K, 1> : quantize_tiles_kernel<FQREF_K, 1>;
    case 2: return opt ? quantize_tiles_optimized_kernel<FQREF_K, 2> : quantize_tiles_kernel<FQREF_K, 2>;
    default: return nullptr;
    }
}
#endif

#ifdef FQREF_HOST
extern "C" fqref_kernel_t fqref_kernel_k1(int, int);
extern "C" fqref_kernel_t fqref_kernel_k2(int, int);
extern "C" fqref_kernel_t fqref_kernel_k3(int, int);
extern "C" fqref_kernel_t fqref_kernel_k4(int, int);
extern "C" fqref_kernel_t fqref_kernel_k8(int, int);

static fqref_kernel_t fqref_kernel(int K, int cb, int opt)
{
    switch (K) {
    case 1: return fqref_kernel_k1(cb, opt);
    case 2: return fqref_kernel_k2(cb, opt);
    case 3: return fqref_kernel_k3(cb, opt);
    case 4: return fqref_kernel_k4(cb, opt);
    case 8: return fqref_kernel_k8(cb, opt);
    default: return nullptr;
    }
}

extern "C" const char* fqref_error_string(int code) { return cudaGetErrorString((cudaError_t) code); }

/* Launch geometry of (K, cb, kernel variant) on `device`, as the package's qt_launch computes it, and the
 * scratch per tile: the back-pointer history and (generic kernel, K = 1) the global cost arrays. */
extern "C" int fqref_geometry(int device, int K, int cb, int opt, int* threads, int* shmem, int* blocks_per_sm,
                              long long* edges_bytes, long long* costs_bytes)
{
    fqref_kernel_t k = fqref_kernel(K, cb, opt);
    if (!k) return -1;
    cudaError_t err = cudaSetDevice(device);
    if (err != cudaSuccess) return (int) err;
    const int L = 256;
    const int edges = 65536 >> K;
    const int cost_arrays = opt ? (K == 1 ? 1 : 2) : (K >= QT_SHARED_COSTS_MIN_K ? 2 : 0);
    const int sh = cost_arrays * edges * (int) sizeof(half) + (opt && QT_OPTIMIZED_COSTS_ONLY ? 0 : L * (int) sizeof(half) + 64 + 128);
    err = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, sh);
    if (err != cudaSuccess) return (int) err;
    cudaFuncAttributes attr;
    err = cudaFuncGetAttributes(&attr, k);
    if (err != cudaSuccess) return (int) err;
    int bps = 0;
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&bps, k, attr.maxThreadsPerBlock, sh);
    if (err != cudaSuccess) return (int) err;
    *threads = attr.maxThreadsPerBlock;
    *shmem = sh;
    *blocks_per_sm = bps;
    *edges_bytes = opt ? (long long) L * edges / (K == 1 ? 8 : 1) : (long long) L * edges * 2;
    *costs_bytes = 2LL * edges * (long long) sizeof(half);
    return 0;
}

/* Quantize n tiles in batches of `batch` (the scratch holds `batch` tiles). Queued on `stream`. */
extern "C" int fqref_run(int device, int K, int cb, int opt, const float* in, float* out_tiles, uint16_t* out_idx,
                         half* costs, uint16_t* edges, long long n, int batch, void* stream)
{
    int threads, sh, bps;
    long long eb, cbytes;
    int err = fqref_geometry(device, K, cb, opt, &threads, &sh, &bps, &eb, &cbytes);
    if (err) return err;
    fqref_kernel_t k = fqref_kernel(K, cb, opt);
    for (long long b0 = 0; b0 < n; b0 += batch) {
        const int bsz = (int) (n - b0 < batch ? n - b0 : batch);
        k<<<bsz, threads, sh, (cudaStream_t) stream>>>(in + 256 * b0, out_tiles + 256 * b0, out_idx + 256 * b0, costs,
                                                       edges, nullptr);
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) return (int) e;
    }
    return 0;
}
#endif
