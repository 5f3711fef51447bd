/* Exact tail-biting Viterbi over the 65536-state EXL3 trellis, CUDA. Same algorithm, same float32
 * operations and the same tie rule as the CPU kernel (_trellis.c), so both return the same states.
 *
 * Edge formulation. A state is s = h*E + j (h: its top K bits, j: its low 16-K bits, E = 2^(16-K),
 * Q = 2^K); its predecessors are h'*E + (s >> K). The CPU kernel keeps C_i[s] for all 65536 states and
 * folds M_i[j] = min_h C_i[h*E + j] at the next position. Here only M (E floats) is kept:
 *     M_i[j] = min_h ( (v[h*E + j] - x_i)^2 + M_{i-1}[(h*E + j) >> K] ),  bp_i[j] = the first minimal h,
 * which is the same float32 value (d = v - x, then d*d, then + M, no FMA) and the same back pointer.
 * Position 0 of a pass uses a virtual M_{-1}: 0 everywhere (pass 1), or 0 at `pre` and +inf elsewhere
 * (pass 2); d*d + 0 == d*d and d*d + inf == inf, as the CPU's masked first column.
 *
 * Ends of the passes. Pass 1 (ring from position 128): the CPU takes the first s (lowest index) of
 * minimal C_255[s]; that is the lexicographic minimum of (M[j], bp[j]*E + j) over j, computed as a
 * 64-bit key (cost bits, state) -- costs are non-negative floats (never -0), whose bits order like the
 * values. Pass 2 (from position 0, ring closed through `pre`): the CPU's end state is the first minimal
 * h of C_255[h*E + pre], i.e. bp_255[pre]*E + pre.
 *
 * Work split. One block of 1024 threads per tile. The 65536 codebook values (fp16, exact) live in
 * registers, 64 per thread as 32 half2; each thread owns the same states at every step. A thread's
 * "unit" is NQ consecutive edges sharing their Q predecessors (read once from shared memory) times NH
 * values of h; for K >= 7 (fewer edges than threads) P = 2 or 4 lanes split an edge's h (interleaved,
 * so their predecessor reads fall in different banks) and merge with shuffles, ties to the lower h.
 * M is double-buffered in shared memory (2*E floats) for K >= 2. K = 1 (2 x 128 KB would not fit): the
 * low 24576 entries are double-buffered, the high 8192 updated in place from registers between two
 * barriers. Back pointers go to global scratch: one byte per edge and position (K >= 2), one bit
 * (K = 1, via ballots). Pass 1 stores only the positions its backtrack reads (255 and 0..126).
 *
 * Kernels per batch of tiles: forward(pass 1) -> backtrack to position 255 (one thread per tile) ->
 * forward(pass 2) -> backtrack writing the 256 states. The backtracks are pointer chases; running them
 * for a whole batch at once hides their latency behind each other instead of stalling an SM per tile.
 *
 * Build: nvcc -O3 -fmad=false (the explicit __fsub_rn/__fmul_rn/__fadd_rn already forbid contraction).
 * Loaded with ctypes by fq/codec/viterbi_cuda.py; the host entry points are extern "C".
 */
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int L = 256;
constexpr int NT = 1024;
constexpr unsigned FULL = 0xffffffffu;

template <int K>
struct Geo {
    static constexpr int Q = 1 << K;
    static constexpr int E = 65536 >> K;
    // A unit: NQ consecutive edges (sharing their predecessors: NQ divides Q) times NH values of h.
    static constexpr int NQ = E < NT ? 1 : (Q < 4 ? Q : (E / NT < 4 ? E / NT : 4));
    static constexpr int NU = E < NT ? 1 : E / (NT * NQ);               // units per thread
    static constexpr int P = E < NT ? NT / E : 1;                  // lanes per edge
    static constexpr int NH = Q / P;                               // h per unit
    static constexpr int NV = NU * NQ * NH;                        // values per thread
    static constexpr int LOW = K == 1 ? 24576 : E;                 // K = 1: double-buffered part
    static constexpr int STAGE_U = K == 1 ? LOW / (2 * NT) : NU;   // K = 1: first unit staged in registers
    static constexpr int BP_ROW = K == 1 ? E / 8 : E;              // back-pointer bytes per position
    // values held in registers (as float); the rest of the 64 sit in shared memory (K = 3, 4, which have
    // room: in registers the compiler spills 60 of them to local memory at every step)
    static constexpr int NREG = (K == 3 || K == 4) ? 32 : 64;
    static constexpr int VOFF = 1024 + 256 + 4 * (K == 1 ? E + LOW : 2 * E);  // byte offset of those values
    static constexpr int SMEM = VOFF + 4 * (64 - NREG) * NT;
    static_assert(NV == 64, "each thread holds 64 codebook values");
    static_assert(E < NT ? P * E == NT : NU * NT * NQ == E, "units cover the edges");
    static_assert(Q % NQ == 0, "a unit's edges share their predecessors");
    static_assert(K != 1 || (STAGE_U == 12 && NU == 16), "K = 1 layout");
};

template <int K>
__device__ __forceinline__ int bp_get(const uint8_t* row, int j)
{
    if constexpr (K == 1) {
        const int w = j >> 1;
        const unsigned word = reinterpret_cast<const unsigned*>(row)[(w >> 5) * 2 + (j & 1)];
        return (word >> (w & 31)) & 1;
    } else {
        return row[j];
    }
}

/* One trellis position: M_i from M_{i-1} for every edge, back pointers to `bprow` when `store`.
 * M_{i-1} is read from buf[i & 1], M_i written to buf[(i + 1) & 1] (K = 1: see the file comment).
 * FINAL (the last position of pass 1) also folds this thread's edges into `key`. Ends with the
 * barrier(s) after which M_i is visible to the whole block. */
template <int K, bool FINAL>
__device__ __forceinline__ void step(const float (&vreg)[Geo<K>::NREG], const float* vsm, const float x, const int i,
                                     const int t, float* buf0, float* buf1, const bool store, uint8_t* bprow,
                                     unsigned long long& key)
{
    using Gm = Geo<K>;
    constexpr int E = Gm::E, NU = Gm::NU, NQ = Gm::NQ, NH = Gm::NH, P = Gm::P;
    const int lane = t & 31;
    const float* Mc = (i & 1) ? buf1 : buf0;  // K = 1: the low part of M_{i-1}; its high part is buf0[p]
    float* Mn = (i & 1) ? buf0 : buf1;
    float stage[K == 1 ? 2 * (NU - Gm::STAGE_U) : 1];
    uint2 bits = make_uint2(0u, 0u);  // K = 1: lane u keeps unit u's two ballot words

#pragma unroll
    for (int u = 0; u < NU; ++u) {
        const int w = t + NT * u;
        const int j0 = (w / P) * NQ;
        const int part = w % P;
        float best[NQ];
        int bh[NQ];
#pragma unroll
        for (int hq = 0; hq < NH; ++hq) {
            const int h = part + P * hq;
            const int pidx = h * (E >> K) + (j0 >> K);  // (h*E + j0) >> K, as h*E is a multiple of 2^K
            float pm;
            if constexpr (K == 1)
                pm = (hq == 1 && u >= 8) ? buf0[pidx] : Mc[pidx];  // pidx >= LOW exactly when hq == 1, u >= 8
            else
                pm = Mc[pidx];
#pragma unroll
            for (int e = 0; e < NQ; ++e) {
                const int k = (u * NH + hq) * NQ + e;
                const float v = k < Gm::NREG ? vreg[k < Gm::NREG ? k : 0] : vsm[(k - Gm::NREG) * NT + t];
                const float d = __fsub_rn(v, x);
                const float c = __fadd_rn(__fmul_rn(d, d), pm);
                if (hq == 0) {
                    best[e] = c;
                    bh[e] = h;
                } else if (c < best[e]) {  // strict: the first (lowest) h keeps a tie
                    best[e] = c;
                    bh[e] = h;
                }
            }
        }
        if constexpr (P > 1) {
            // lanes t .. t+P-1 hold interleaved h of one edge; merge into part 0, ties to the lower h
#pragma unroll
            for (int off = 1; off < P; off <<= 1) {
                const float ob = __shfl_down_sync(FULL, best[0], off);
                const int oh = __shfl_down_sync(FULL, bh[0], off);
                if (ob < best[0] || (ob == best[0] && oh < bh[0])) {
                    best[0] = ob;
                    bh[0] = oh;
                }
            }
        }

        // costs of this position
        if constexpr (K == 1) {
            if (u < Gm::STAGE_U) {
                *reinterpret_cast<float2*>(Mn + j0) = make_float2(best[0], best[1]);
            } else {
                stage[2 * (u - Gm::STAGE_U)] = best[0];
                stage[2 * (u - Gm::STAGE_U) + 1] = best[1];
            }
        } else if constexpr (NQ == 8) {
            *reinterpret_cast<float4*>(Mn + j0) = make_float4(best[0], best[1], best[2], best[3]);
            *reinterpret_cast<float4*>(Mn + j0 + 4) = make_float4(best[4], best[5], best[6], best[7]);
        } else if constexpr (NQ == 4) {
            *reinterpret_cast<float4*>(Mn + j0) = make_float4(best[0], best[1], best[2], best[3]);
        } else if constexpr (NQ == 2) {
            *reinterpret_cast<float2*>(Mn + j0) = make_float2(best[0], best[1]);
        } else {
            if (part == 0) Mn[j0] = best[0];
        }

        // back pointers of this position
        if (store) {
            if constexpr (K == 1) {
                const unsigned b0 = __ballot_sync(FULL, bh[0] != 0);
                const unsigned b1 = __ballot_sync(FULL, bh[1] != 0);
                if (lane == u) bits = make_uint2(b0, b1);
            } else if constexpr (NQ == 8) {
                const unsigned lo = bh[0] | (bh[1] << 8) | (bh[2] << 16) | (bh[3] << 24);
                const unsigned hi = bh[4] | (bh[5] << 8) | (bh[6] << 16) | (bh[7] << 24);
                *reinterpret_cast<uint2*>(bprow + j0) = make_uint2(lo, hi);
            } else if constexpr (NQ == 4) {
                *reinterpret_cast<unsigned*>(bprow + j0) = bh[0] | (bh[1] << 8) | (bh[2] << 16) | (bh[3] << 24);
            } else if constexpr (NQ == 2) {
                *reinterpret_cast<unsigned short*>(bprow + j0) = (unsigned short) (bh[0] | (bh[1] << 8));
            } else {
                if (part == 0) bprow[j0] = (uint8_t) bh[0];
            }
        }

        if constexpr (FINAL) {
            // pass 1 ends on the first state (lowest index) of minimal cost: min of (cost bits, state)
            if (part == 0) {
#pragma unroll
                for (int e = 0; e < NQ; ++e) {
                    const unsigned long long kk = ((unsigned long long) __float_as_uint(best[e]) << 32)
                                                | (unsigned) (bh[e] * E + j0 + e);
                    key = kk < key ? kk : key;
                }
            }
        }
    }
    if constexpr (K == 1) {
        // unit u's words: edges 2w and 2w+1 (w = warp*32 + lane + 1024u) at word (w >> 5) * 2 + (j & 1)
        if (store && lane < NU) reinterpret_cast<uint2*>(bprow)[(t >> 5) + 32 * lane] = bits;
    }
    __syncthreads();
    if constexpr (K == 1) {
        // the high part of M_i, held in registers until every read of M_{i-1} is done
#pragma unroll
        for (int u = Gm::STAGE_U; u < NU; ++u) {
            const int j0 = 2 * (t + NT * u);
            *reinterpret_cast<float2*>(buf0 + j0) =
                make_float2(stage[2 * (u - Gm::STAGE_U)], stage[2 * (u - Gm::STAGE_U) + 1]);
        }
        __syncthreads();
    }
}

template <int K>
__global__ void __launch_bounds__(NT, 1)
fq_viterbi_forward(const float* __restrict__ tiles, const unsigned short* __restrict__ values,
                   const int* __restrict__ pre_in, uint8_t* __restrict__ bp, unsigned* __restrict__ best_out)
{
    using Gm = Geo<K>;
    constexpr int E = Gm::E, NQ = Gm::NQ, NH = Gm::NH, P = Gm::P;
    extern __shared__ __align__(16) unsigned char smem[];
    float* xs = reinterpret_cast<float*>(smem);
    unsigned long long* red = reinterpret_cast<unsigned long long*>(smem + 1024);
    float* buf0 = reinterpret_cast<float*>(smem + 1024 + 256);  // K = 1: X (E entries)
    float* buf1 = buf0 + E;                                      // K = 1: Y (LOW entries)

    const int t = threadIdx.x;
    const bool pass2 = pre_in != nullptr;
    const int pre = pass2 ? pre_in[blockIdx.x] : -1;
    const int roll = pass2 ? 0 : L / 2;
    const float* tile = tiles + (size_t) blockIdx.x * L;
    uint8_t* bp_tile = bp + (size_t) blockIdx.x * L * Gm::BP_ROW;

    if (t < L) xs[t] = tile[t];
    for (int p = t; p < E; p += NT) buf0[p] = (pre < 0 || p == pre) ? 0.0f : __int_as_float(0x7f800000);

    // This thread's 64 codebook values (fp16, exact as float): unit u, h index hq, edge e -> value slot
    // k = (u*NH + hq)*NQ + e; slots below NREG in registers, the others in shared memory at [k - NREG][t].
    float vreg[Gm::NREG];
    float* vsm = reinterpret_cast<float*>(smem + Gm::VOFF);
#pragma unroll
    for (int k = 0; k < 64; ++k) {
        const int e = k % NQ, hq = (k / NQ) % NH, u = k / (NQ * NH);
        const int w = t + NT * u;
        const int j0 = (w / P) * NQ, part = w % P;
        const float v = __half2float(__ushort_as_half(values[(part + P * hq) * E + j0 + e]));
        if (k < Gm::NREG)
            vreg[k < Gm::NREG ? k : 0] = v;
        else
            vsm[(k - Gm::NREG) * NT + t] = v;
    }
    __syncthreads();

    unsigned long long key = ~0ull;
    for (int i = 0; i < L - 1; ++i) {
        const int pos = (i + roll) & (L - 1);
        const bool store = pass2 || i >= L / 2 - 1;  // pass 1's backtrack reads positions 255 and 0..126
        step<K, false>(vreg, vsm, xs[pos], i, t, buf0, buf1, store, bp_tile + (size_t) pos * Gm::BP_ROW, key);
    }
    const int pos = (L - 1 + roll) & (L - 1);
    uint8_t* bprow = bp_tile + (size_t) pos * Gm::BP_ROW;
    if (pass2) {
        step<K, false>(vreg, vsm, xs[pos], L - 1, t, buf0, buf1, true, bprow, key);
        return;
    }
    step<K, true>(vreg, vsm, xs[pos], L - 1, t, buf0, buf1, false, bprow, key);
#pragma unroll
    for (int off = 16; off; off >>= 1) {
        const unsigned long long o = __shfl_xor_sync(FULL, key, off);
        key = o < key ? o : key;
    }
    if ((t & 31) == 0) red[t >> 5] = key;
    __syncthreads();
    if (t < 32) {
        unsigned long long k = red[t];
#pragma unroll
        for (int off = 16; off; off >>= 1) {
            const unsigned long long o = __shfl_xor_sync(FULL, k, off);
            k = o < k ? o : k;
        }
        if (t == 0) best_out[blockIdx.x] = (unsigned) (k & 0xffffffffu);
    }
}

/* Pass 1 backtrack: from the best final state (ring step 255 = position 127) back to ring step 127
 * (position 255); `pre` is that state's low 16-K bits. One thread per tile. */
template <int K>
__global__ void fq_viterbi_back1(const uint8_t* __restrict__ bp, const unsigned* __restrict__ best,
                                 int* __restrict__ pre, int n)
{
    using Gm = Geo<K>;
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= n) return;
    const uint8_t* base = bp + (size_t) b * L * Gm::BP_ROW;
    int s = (int) best[b];
    for (int i = L - 1; i >= L / 2; --i) {
        const int pos = (i - 1 + L / 2) & (L - 1);
        const int j = s >> K;
        s = bp_get<K>(base + (size_t) pos * Gm::BP_ROW, j) * Gm::E + j;
    }
    pre[b] = s & (Gm::E - 1);
}

/* Pass 2 backtrack: the end state is bp_255[pre]*E + pre; writes all 256 states. */
template <int K>
__global__ void fq_viterbi_back2(const uint8_t* __restrict__ bp, const int* __restrict__ pre,
                                 int* __restrict__ out, int n)
{
    using Gm = Geo<K>;
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= n) return;
    const uint8_t* base = bp + (size_t) b * L * Gm::BP_ROW;
    int* o = out + (size_t) b * L;
    int j = pre[b];
    int s = bp_get<K>(base + (size_t) (L - 1) * Gm::BP_ROW, j) * Gm::E + j;
    o[L - 1] = s;
    for (int pos = L - 2; pos >= 0; --pos) {
        j = s >> K;
        s = bp_get<K>(base + (size_t) pos * Gm::BP_ROW, j) * Gm::E + j;
        o[pos] = s;
    }
}

template <int K>
int run(const float* tiles, long long n, const unsigned short* values, int* out, uint8_t* bp, long long batch,
        unsigned* best, int* pre, cudaStream_t stream)
{
    using Gm = Geo<K>;
    cudaError_t err = cudaFuncSetAttribute(fq_viterbi_forward<K>, cudaFuncAttributeMaxDynamicSharedMemorySize, Gm::SMEM);
    if (err != cudaSuccess) return (int) err;
    for (long long b0 = 0; b0 < n; b0 += batch) {
        const int nb = (int) (n - b0 < batch ? n - b0 : batch);
        const float* x = tiles + b0 * L;
        const int nbt = (nb + 127) / 128;
        fq_viterbi_forward<K><<<nb, NT, Gm::SMEM, stream>>>(x, values, nullptr, bp, best);
        fq_viterbi_back1<K><<<nbt, 128, 0, stream>>>(bp, best, pre, nb);
        fq_viterbi_forward<K><<<nb, NT, Gm::SMEM, stream>>>(x, values, pre, bp, nullptr);
        fq_viterbi_back2<K><<<nbt, 128, 0, stream>>>(bp, pre, out + b0 * L, nb);
        err = cudaGetLastError();
        if (err != cudaSuccess) return (int) err;
    }
    return 0;
}

}  // namespace

extern "C" {

/* Version of the C interface below; viterbi_cuda.py checks it. */
int fq_viterbi_abi(void) { return 1; }

/* Bytes of back-pointer scratch per tile. */
long long fq_viterbi_bp_bytes(int K)
{
    switch (K) {
    case 1: return (long long) L * Geo<1>::BP_ROW;
    case 2: return (long long) L * Geo<2>::BP_ROW;
    case 3: return (long long) L * Geo<3>::BP_ROW;
    case 4: return (long long) L * Geo<4>::BP_ROW;
    case 5: return (long long) L * Geo<5>::BP_ROW;
    case 6: return (long long) L * Geo<6>::BP_ROW;
    case 7: return (long long) L * Geo<7>::BP_ROW;
    case 8: return (long long) L * Geo<8>::BP_ROW;
    default: return -1;
    }
}

const char* fq_viterbi_error_string(int code) { return cudaGetErrorString((cudaError_t) code); }

/* tiles: n x 256 float32; values: 65536 fp16 bit patterns; out: n x 256 int32 states; scratch for
 * `batch` tiles: bp (batch * fq_viterbi_bp_bytes(K) bytes), best and pre (batch 32-bit words each).
 * All device pointers of `device`; work is queued on `stream`. Returns 0 or a cudaError_t code;
 * -1 for bad arguments. */
int fq_viterbi_run(int device, int K, const float* tiles, long long n, const unsigned short* values, int* out,
                   uint8_t* bp, long long batch, unsigned* best, int* pre, void* stream)
{
    if (n < 0 || batch < 1 || batch > 0x7fffffffLL) return -1;
    if (n == 0) return 0;
    cudaError_t err = cudaSetDevice(device);  // this library's runtime keeps its own current device
    if (err != cudaSuccess) return (int) err;
    cudaStream_t s = (cudaStream_t) stream;
    switch (K) {
    case 1: return run<1>(tiles, n, values, out, bp, batch, best, pre, s);
    case 2: return run<2>(tiles, n, values, out, bp, batch, best, pre, s);
    case 3: return run<3>(tiles, n, values, out, bp, batch, best, pre, s);
    case 4: return run<4>(tiles, n, values, out, bp, batch, best, pre, s);
    case 5: return run<5>(tiles, n, values, out, bp, batch, best, pre, s);
    case 6: return run<6>(tiles, n, values, out, bp, batch, best, pre, s);
    case 7: return run<7>(tiles, n, values, out, bp, batch, best, pre, s);
    case 8: return run<8>(tiles, n, values, out, bp, batch, best, pre, s);
    default: return -1;
    }
}

}  // extern "C"
