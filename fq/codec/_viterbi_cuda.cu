/* Exact tail-biting Viterbi over the 65536-state EXL3 trellis, CUDA. Same algorithm, same float32
 * operations and the same keys as the CPU kernel (_trellis.c, whose header specifies the arithmetic),
 * so both return the same states.
 *
 * Edge formulation. A state is s = h*E + j (h: its top K bits, j: its low 16-K bits, E = 2^(16-K),
 * Q = 2^K); its predecessors are h'*E + (s >> K). Only M (E floats) is kept:
 *     key(h, j) = (bits(fma(v[h*E + j] - x_i, same, M_{i-1}[(h*E + j) >> K])) & ~(Q-1)) | h
 *     M_i[j] = min_h key(h, j) (as float),  bp_i[j] = M_i[j]'s low K bits.
 * Per candidate that is FADD, FFMA, LOP3 (mask and h in one) and half a 3-input unsigned min (VIMNMX3):
 * the h rides in the key, so there is no compare-and-select.
 * Position 0 of a pass uses a virtual M_{-1}: 0 everywhere (pass 1), or 0 at `pre` and BIG = 2^126
 * elsewhere (pass 2), exactly as the CPU's first column.
 *
 * Ends of the passes. Pass 1 (ring from position 128): the CPU takes the lowest state of minimal key;
 * that is the minimum of the 64-bit (key, h*E + j) over j. Pass 2 (from position 0, ring closed through
 * `pre`): the end state is bp_255[pre]*E + pre.
 *
 * Work split. One block of 1024 threads per tile: the 65536 codebook values (fp16, exact as float32)
 * are spread over the block, 64 per thread, and each thread owns the same states at every step. A
 * thread's "unit" is NQ consecutive edges sharing their Q predecessors (read once from shared memory)
 * times NH values of h; for K >= 7 (fewer edges than threads) P = 2 or 4 lanes split an edge's h
 * (interleaved, so their predecessor reads fall in different banks) and merge with shuffles.
 * The register file holds exactly 65536 words, so not all 64 values fit as float32 next to the working
 * registers: NREG of them are float32 registers, the others sit in shared memory as float4 rows (one
 * conflict-free 128-bit load per 4 values), cheaper than the local-memory spills the compiler makes of 64
 * float registers. K = 1, whose shared memory is all costs, holds all 64 in registers (a few spills; half2
 * registers converted at each use measured slower: 106k against 111k tiles/s with 56 float32).
 * M is double-buffered in shared memory (2*E floats) for K >= 2. K = 1 (2 x 128 KB would not fit): the
 * low 24576 entries are double-buffered, the high 8192 updated in place from registers between two
 * barriers. Back pointers go to global scratch: one byte per edge and position (K >= 2: the key's low
 * byte, gathered with byte permutes), one bit (K = 1: each thread's 32 bits of a position in one word).
 * Pass 1 stores only the positions its backtrack reads (255 and 0..126).
 *
 * Kernels per batch of tiles: forward(pass 1) -> backtrack to position 255 (one thread per tile) ->
 * forward(pass 2) -> backtrack writing the 256 states. The backtracks are pointer chases; running them
 * for a whole batch at once hides their latency behind each other instead of stalling an SM per tile.
 *
 * Build: nvcc -O3 -fmad=false (the only fused multiply-add is the explicit __fmaf_rn).
 * Loaded with ctypes by fq/codec/viterbi_cuda.py; the host entry points are extern "C".
 */
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

namespace {

constexpr int L = 256;
constexpr int NT = 1024;
constexpr unsigned FULL = 0xffffffffu;
constexpr unsigned BIG_BITS = 0x7e800000u;  // 2^126

// float32 values kept in registers, per K (tuned so that ptxas spills nothing: nvcc -Xptxas -v;
// -DFQ_NREG<K>=n overrides one, for tuning)
#ifndef FQ_NREG1
#define FQ_NREG1 64
#endif
#ifndef FQ_NREG2
#define FQ_NREG2 40
#endif
#ifndef FQ_NREG3
#define FQ_NREG3 40
#endif
#ifndef FQ_NREG4
#define FQ_NREG4 36
#endif
#ifndef FQ_NREG5
#define FQ_NREG5 44
#endif
#ifndef FQ_NREG6
#define FQ_NREG6 44
#endif
#ifndef FQ_NREG7
#define FQ_NREG7 32
#endif
#ifndef FQ_NREG8
#define FQ_NREG8 32
#endif
constexpr int NREG_OF[9] = {0, FQ_NREG1, FQ_NREG2, FQ_NREG3, FQ_NREG4, FQ_NREG5, FQ_NREG6, FQ_NREG7, FQ_NREG8};

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
    static constexpr int NREG = NREG_OF[K];                        // float32 values in registers
    static constexpr int NSM4 = (64 - NREG) / 4;                   // float4 rows in shared memory
    static constexpr int VOFF = 1024 + 256 + 4 * (K == 1 ? E + LOW : 2 * E);  // byte offset of those rows
    static constexpr int SMEM = VOFF + 16 * NSM4 * NT;
    static constexpr unsigned MASK = ~(unsigned) (Q - 1);
    static_assert(NV == 64, "each thread holds 64 codebook values");
    static_assert(E < NT ? P * E == NT : NU * NT * NQ == E, "units cover the edges");
    static_assert(Q % NQ == 0, "a unit's edges share their predecessors");
    static_assert(K != 1 || (STAGE_U == 12 && NU == 16), "K = 1 layout");
    static_assert(NREG % 4 == 0 && NREG >= 4 && NREG <= 64, "values split in whole float4 rows");
    static_assert(K != 1 || NREG == 64, "K = 1 has no shared memory left for values");
    static_assert(SMEM <= 232448, "shared memory per block");
};

/* This thread's 64 codebook values: slot k < NREG in vreg, the rest in vsm4. */
template <int K>
struct Values {
    float vreg[Geo<K>::NREG];
};

/* (bits(c) & mask) | TAG as one LOP3 with TAG as its immediate (with a constant mask and TAG it would
 * take two: LOP3 has one immediate operand). */
template <unsigned TAG>
__device__ __forceinline__ unsigned key_of(float c, unsigned mask)
{
    unsigned r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(__float_as_uint(c)), "r"(mask), "n"(TAG));  // (a & b) | c
    return r;
}

/* f(std::integral_constant<int, 0>{}), ..., f(std::integral_constant<int, N - 1>{}): an unrolled loop whose
 * index is a compile-time constant in the body. */
template <int N, int I = 0, typename F>
__device__ __forceinline__ void unroll(F&& f)
{
    if constexpr (I < N) {
        f(std::integral_constant<int, I>{});
        unroll<N, I + 1>(f);
    }
}

template <int K>
__device__ __forceinline__ int bp_get(const uint8_t* row, int j)
{
    if constexpr (K == 1) {
        // edge j = 2(t + 1024u) + e is bit 2u + e of word t
        const int w = j >> 1;
        const unsigned word = reinterpret_cast<const unsigned*>(row)[w & (NT - 1)];
        return (word >> (2 * (w / NT) + (j & 1))) & 1;
    } else {
        return row[j] & ((1 << K) - 1);
    }
}

/* This thread's offset in a back-pointer row: K = 1, word t; else the first edge of its first unit (unit u's
 * edges start (NT / P) * NQ * u bytes further). Added to the tile's base once, outside the position loop. */
template <int K>
__device__ __forceinline__ unsigned bp_offset(const int t)
{
    using Gm = Geo<K>;
    return K == 1 ? 4u * (unsigned) t : (unsigned) (t / Gm::P) * Gm::NQ;
}

/* One trellis position: M_i from M_{i-1} for every edge, back pointers to `bpt` when `store` (`bpt`: the
 * position's back-pointer row plus this thread's offset in it, bp_offset).
 * M_{i-1} is read from buf[i & 1], M_i written to buf[(i + 1) & 1] (K = 1: see the file comment).
 * FINAL (the last position of pass 1) also folds this thread's edges into `key`. Ends with the
 * barrier(s) after which M_i is visible to the whole block. */
template <int K, bool FINAL, int PARITY>
__device__ __forceinline__ void step(const Values<K>& V, const float4* vsm4, const unsigned mask, const float x,
                                     const int i, const int t, float* buf0, float* buf1, const bool store, uint8_t* bpt,
                                     unsigned long long& key)
{
    using Gm = Geo<K>;
    constexpr int E = Gm::E, NU = Gm::NU, NQ = Gm::NQ, NH = Gm::NH, P = Gm::P, NREG = Gm::NREG;
    // the position's parity picks the buffers: PARITY 0 or 1 fixes it at compile time (K >= 2 runs the positions
    // in pairs: 4-10% fewer instructions per position); -1 reads it from i (K = 1: pairs spill more, measured slower)
    const bool odd = PARITY < 0 ? (i & 1) : PARITY == 1;
    const float* Mc = odd ? buf1 : buf0;  // K = 1: the low part of M_{i-1}; its high part is buf0[p]
    float* Mn = odd ? buf0 : buf1;
    float stage[K == 1 ? 2 * (NU - Gm::STAGE_U) : 1];
    unsigned bits = 0u;  // K = 1: this thread's back-pointer bits (edge e of unit u at bit 2u + e)
    float4 row = make_float4(0.f, 0.f, 0.f, 0.f);  // K >= 2: the shared-memory row of the current slots

#pragma unroll
    for (int u = 0; u < NU; ++u) {
        const int w = t + NT * u;
        const int j0 = (w / P) * NQ;
        const int part = w % P;
        unsigned best[NQ];
        // hq is a compile-time constant here, so the key's tag P*hq is the LOP3's immediate
        unroll<NH>([&](auto hqc) {
            constexpr int hq = decltype(hqc)::value;
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
                float v;
                if (k < NREG) {
                    v = V.vreg[k < NREG ? k : 0];
                } else {
                    const int r = k - NREG;
                    if ((r & 3) == 0) row = vsm4[(r >> 2) * NT + t];
                    v = (r & 3) == 0 ? row.x : (r & 3) == 1 ? row.y : (r & 3) == 2 ? row.z : row.w;
                }
                const float d = __fsub_rn(v, x);
                const unsigned c = key_of<P * hq>(__fmaf_rn(d, d, pm), mask);
                best[e] = hq == 0 ? c : min(best[e], c);
            }
        });
        if constexpr (P > 1) {
            // this lane's h are part + P*hq: its part joins the tag (the low bits are zero: order is kept)
            best[0] |= (unsigned) part;
        }
        if constexpr (P > 1) {
            // lanes t .. t+P-1 hold interleaved h of one edge: the minimum key is the edge's
#pragma unroll
            for (int off = 1; off < P; off <<= 1) best[0] = min(best[0], __shfl_down_sync(FULL, best[0], off));
        }

        // costs of this position: the minimal keys themselves (their low K bits are the h)
        float m[NQ];
#pragma unroll
        for (int e = 0; e < NQ; ++e) m[e] = __uint_as_float(best[e]);
        if constexpr (K == 1) {
            if (u < Gm::STAGE_U) {
                *reinterpret_cast<float2*>(Mn + j0) = make_float2(m[0], m[1]);
            } else {
                stage[2 * (u - Gm::STAGE_U)] = m[0];
                stage[2 * (u - Gm::STAGE_U) + 1] = m[1];
            }
        } else if constexpr (NQ == 4) {
            *reinterpret_cast<float4*>(Mn + j0) = make_float4(m[0], m[1], m[2], m[3]);
        } else if constexpr (NQ == 2) {
            *reinterpret_cast<float2*>(Mn + j0) = make_float2(m[0], m[1]);
        } else {
            if (part == 0) Mn[j0] = m[0];
        }

        // back pointers of this position: K = 1 gathers this thread's 32 bits (16 units x 2 edges) in one
        // word; otherwise each edge's byte is its key's low byte (the h; bp_get masks the cost bits above)
        if constexpr (K == 1) {
            bits |= ((best[0] & 1u) << (2 * u)) | ((best[1] & 1u) << (2 * u + 1));
        } else if (store) {
            if constexpr (NQ == 4) {
                const unsigned lo = __byte_perm(best[0], best[1], 0x0040), hi = __byte_perm(best[2], best[3], 0x0040);
                *reinterpret_cast<unsigned*>(bpt + (NT / P) * NQ * u) = __byte_perm(lo, hi, 0x5410);
            } else if constexpr (NQ == 2) {
                *reinterpret_cast<unsigned short*>(bpt + (NT / P) * NQ * u) =
                    (unsigned short) __byte_perm(best[0], best[1], 0x0040);
            } else {
                if (part == 0) bpt[(NT / P) * NQ * u] = (uint8_t) best[0];
            }
        }

        if constexpr (FINAL) {
            // pass 1 ends on the lowest state of minimal key: min of (key, state)
            if (part == 0) {
#pragma unroll
                for (int e = 0; e < NQ; ++e) {
                    const unsigned h = best[e] & (Gm::Q - 1);
                    const unsigned long long kk = ((unsigned long long) best[e] << 32) | (h * E + j0 + e);
                    key = kk < key ? kk : key;
                }
            }
        }
    }
    if constexpr (K == 1) {
        if (store) *reinterpret_cast<unsigned*>(bpt) = bits;  // coalesced: word t of the row
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
    constexpr int E = Gm::E, NQ = Gm::NQ, NH = Gm::NH, P = Gm::P, NREG = Gm::NREG;
    extern __shared__ __align__(16) unsigned char smem[];
    float* xs = reinterpret_cast<float*>(smem);
    unsigned long long* red = reinterpret_cast<unsigned long long*>(smem + 1024);
    float* buf0 = reinterpret_cast<float*>(smem + 1024 + 256);  // K = 1: X (E entries)
    float* buf1 = buf0 + E;                                      // K = 1: Y (LOW entries)
    float4* vsm4 = reinterpret_cast<float4*>(smem + Gm::VOFF);

    const int t = threadIdx.x;
    const bool pass2 = pre_in != nullptr;
    const int pre = pass2 ? pre_in[blockIdx.x] : -1;
    const int roll = pass2 ? 0 : L / 2;
    const float* tile = tiles + (size_t) blockIdx.x * L;
    uint8_t* bp_tile = bp + (size_t) blockIdx.x * L * Gm::BP_ROW + bp_offset<K>(t);  // this thread's column

    if (t < L) xs[t] = tile[t];
    // The key mask as a value read from shared memory: held in a register, so that each key is one LOP3
    // with the tag as its immediate (a mask ptxas knows is a constant takes the only immediate slot).
    if (t == 0) reinterpret_cast<unsigned*>(red)[0] = Gm::MASK;
    for (int p = t; p < E; p += NT) buf0[p] = (pre < 0 || p == pre) ? 0.0f : __uint_as_float(BIG_BITS);

    // This thread's 64 codebook values: unit u, h index hq, edge e -> slot k = (u*NH + hq)*NQ + e.
    Values<K> V;
#pragma unroll
    for (int k = 0; k < 64; ++k) {
        const int e = k % NQ, hq = (k / NQ) % NH, u = k / (NQ * NH);
        const int w = t + NT * u;
        const int j0 = (w / P) * NQ, part = w % P;
        const unsigned short raw = values[(part + P * hq) * E + j0 + e];
        if (k < NREG) {
            V.vreg[k < NREG ? k : 0] = __half2float(__ushort_as_half(raw));
        } else {
            const int r = k - NREG;
            reinterpret_cast<float*>(vsm4 + (r >> 2) * NT + t)[r & 3] = __half2float(__ushort_as_half(raw));
        }
    }
    __syncthreads();
    const unsigned mask = reinterpret_cast<volatile unsigned*>(red)[0];
    __syncthreads();  // red is the end's reduction scratch too

    unsigned long long key = ~0ull;
    static_assert(L % 2 == 0, "positions 0 .. L-2 in pairs (even, odd) then L-2, L-1");
    if constexpr (K == 1) {
        for (int i = 0; i < L - 1; ++i) {
            const int pos = (i + roll) & (L - 1);
            const bool store = pass2 || i >= L / 2 - 1;  // pass 1's backtrack reads positions 255 and 0..126
            step<K, false, -1>(V, vsm4, mask, xs[pos], i, t, buf0, buf1, store, bp_tile + (size_t) pos * Gm::BP_ROW, key);
        }
    } else {
        for (int i = 0; i < L - 2; i += 2) {
            const int pos = (i + roll) & (L - 1);
            const bool store = pass2 || i >= L / 2 - 1;
            step<K, false, 0>(V, vsm4, mask, xs[pos], i, t, buf0, buf1, store, bp_tile + (size_t) pos * Gm::BP_ROW, key);
            const int pos1 = (i + 1 + roll) & (L - 1);
            const bool store1 = pass2 || i + 1 >= L / 2 - 1;
            step<K, false, 1>(V, vsm4, mask, xs[pos1], i + 1, t, buf0, buf1, store1, bp_tile + (size_t) pos1 * Gm::BP_ROW,
                              key);
        }
        const int pos = (L - 2 + roll) & (L - 1);
        step<K, false, 0>(V, vsm4, mask, xs[pos], L - 2, t, buf0, buf1, true, bp_tile + (size_t) pos * Gm::BP_ROW, key);
    }
    const int pos = (L - 1 + roll) & (L - 1);
    uint8_t* bprow = bp_tile + (size_t) pos * Gm::BP_ROW;
    if (pass2) {
        step<K, false, 1>(V, vsm4, mask, xs[pos], L - 1, t, buf0, buf1, true, bprow, key);
        return;
    }
    step<K, true, 1>(V, vsm4, mask, xs[pos], L - 1, t, buf0, buf1, false, bprow, key);
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

/* ---------------------------------------------------------------------------------------------------------------
 * 16x16 block factor of fq.codec.ldl (chol_inv16): per matrix, D = C C^T (Cholesky of the lower triangle of the
 * 16x16 block at `a`) and D^-1 = C^-T C^-1, in exactly the order of numpy elementwise float64 operations that
 * chol_inv16 performs on the host, each one rounded on its own (__d*_rn: never contracted into an FMA), so the
 * bits are the CPU path's. One thread per matrix: the factorization is a few thousand dependent operations and
 * the point is to keep the GPU's queue full (no host round trip per block), not to be fast on its own.
 * good[b]: 1 if every pivot was finite and positive (else the matrix's D^-1 is the identity, as chol_inv16). */
__global__ void fq_chol_inv16_kernel(const double* __restrict__ a, long long sb, long long sr, long long sc,
                                     double* __restrict__ inv, int* __restrict__ good, int n)
{
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= n) return;
    constexpr int N = 16;
    const double* m = a + (size_t) b * sb;
    double C[N][N], X[N][N], v[N];
    for (int i = 0; i < N; ++i)
        for (int j = 0; j < N; ++j) C[i][j] = 0.0;
    bool ok = true;
    for (int c = 0; c < N; ++c) {
        for (int i = c; i < N; ++i) v[i] = __dadd_rn(m[i * sr + c * sc], 0.0);  // tril(A) + 0: the host's symmetrized D
        for (int t = 0; t < c; ++t)
            for (int i = c; i < N; ++i) v[i] = __dsub_rn(v[i], __dmul_rn(C[i][t], C[c][t]));
        double piv = v[c];
        bool g = isfinite(piv) && piv > 0.0;
        for (int i = c; i < N; ++i) g = g && isfinite(v[i]);
        ok = ok && g;
        if (!g) piv = 1.0;
        const double d = __dsqrt_rn(piv);
        C[c][c] = d;
        for (int i = c + 1; i < N; ++i) C[i][c] = __ddiv_rn(g ? v[i] : 0.0, d);
    }
    for (int i = 0; i < N; ++i) {  // X = C^-1, row by row
        double r[N];
        for (int j = 0; j < N; ++j) r[j] = j == i ? 1.0 : 0.0;
        for (int t = 0; t < i; ++t)
            for (int j = 0; j < N; ++j) r[j] = __dsub_rn(r[j], __dmul_rn(C[i][t], X[t][j]));
        for (int j = 0; j < N; ++j) X[i][j] = __ddiv_rn(r[j], C[i][i]);
    }
    double* o = inv + (size_t) b * N * N;
    for (int p = 0; p < N; ++p)
        for (int q = 0; q < N; ++q) {
            double s = __dmul_rn(X[0][p], X[0][q]);
            for (int t = 1; t < N; ++t) s = __dadd_rn(s, __dmul_rn(X[t][p], X[t][q]));
            o[p * N + q] = ok ? s : (p == q ? 1.0 : 0.0);
        }
    good[b] = ok ? 1 : 0;
}

}  // namespace

extern "C" {

/* Version of the C interface below; viterbi_cuda.py checks it. */
int fq_viterbi_abi(void) { return 3; }

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

/* The 16x16 block factors of fq.codec.ldl.chol_inv16 for n matrices: block b at a + b*sb, element (i, j) at
 * i*sr + j*sc (float64, lower triangle read); inv: n x 16 x 16 float64; good: n int32. Queued on `stream`. */
int fq_chol_inv16(int device, const double* a, long long sb, long long sr, long long sc, double* inv, int* good,
                  long long n, void* stream)
{
    if (n < 0 || n > 0x7fffffffLL) return -1;
    if (n == 0) return 0;
    cudaError_t err = cudaSetDevice(device);
    if (err != cudaSuccess) return (int) err;
    fq_chol_inv16_kernel<<<(int) ((n + 63) / 64), 64, 0, (cudaStream_t) stream>>>(a, sb, sr, sc, inv, good, (int) n);
    return (int) cudaGetLastError();
}

}  // extern "C"
