/* Exact tail-biting Viterbi search over the 65536-state EXL3 bitshift trellis, CPU.
 *
 * State s_i is 16 bits; s_i = ((s_{i-1} << K) | symbol_i) & 0xFFFF, so the predecessors of s are
 * h*E + (s >> K) for h < Q (E = 2^(16-K), Q = 2^K). The arithmetic, which the CUDA kernel
 * (_viterbi_cuda.cu) and the torch path (fq.codec.viterbi.viterbi_torch) repeat bit for bit:
 *
 *     d = v[s] - x_i                                  float32, round to nearest
 *     c = fma(d, d, M_{i-1}[s >> K])                  float32, one rounding
 *     key(s) = (bits(c) & ~(Q-1)) | h                 h = s >> (16-K), the top K bits of s
 *     M_i[j] = float(min_h key(h*E + j)),             back pointer = that minimum's low K bits
 *
 * i.e. costs are compared on their top 23-K mantissa bits, a tie goes to the lowest h, and the winner's
 * key is the cost carried on (its low K bits are its h). Why: the candidate's h rides in the cost's low
 * bits, so one unsigned min is the whole compare-and-select (a GPU does a 3-input min in one
 * instruction); the perturbation is below 2^-(23-K) relative per step, far below the coding error.
 * Costs are non-negative, so their bits order like their values.
 *
 * Tail-biting, as the reference encoder does it: pass 1 runs the ring from position 128 without
 * constraint and reads off the state at position 255 on the best path (the lowest state of minimal
 * key); pass 2 runs from position 0 with s_0 >> K fixed to that state's low 16-K bits (the other
 * predecessors cost BIG = 2^126, which d*d never moves and no finite path reaches) and ends on the
 * state with those low bits of minimal key, which closes the ring. Tiles are independent: OpenMP over
 * tiles, deterministic for any thread count.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ISA dispatch, chosen once when the module is imported (isa() names it): "avx512" (x86-64-v4) and "avx2"
 * (AVX2 + FMA), the hand-vectorized passes below, or "generic" (the portable pass, built for the baseline
 * ISA; on x86-64 its fmaf is libm's, exact but slow).
 * The environment variable FQ_CPU_ISA picks one of those (the import refuses a name it does not know or one
 * this CPU cannot run); unset, the widest one the CPU runs. Every one computes the same IEEE float32
 * operations in the same order -- fmaf is one rounding everywhere (the FMA instruction, or libm), there is
 * no other contraction -- and the same integer keys, so the states do not depend on the ISA
 * (tests/test_codec_isa.py). The ISA is therefore not part of any output, nor of the encoder identity
 * (fq.identity hashes this module's compiled bytes, which contain all three). */
#if defined(__x86_64__) && defined(__GNUC__)
#define FQ_X86 1
#include <immintrin.h>
#if defined(__clang__)
#define FQ_TARGET_AVX512 __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx512cd,avx2,fma,bmi,bmi2")))
#else
#define FQ_TARGET_AVX512 __attribute__((target("arch=x86-64-v4")))
#endif
#define FQ_TARGET_AVX2 __attribute__((target("avx2,fma")))
#else
#define FQ_X86 0
#endif

#define L 256
#define NSTATES 65536
#define BIG_BITS 0x7e800000u /* 2^126 */
#define VPAD 16 /* the AVX2 pass's copy of v has rows of E + VPAD values: the Q rows it reads at once then
                   fall in different L1 sets (unpadded, rows 2^(18-K) bytes apart map to one set) */

typedef struct {
    uint32_t *C;   /* NSTATES keys of the current position (the portable pass) */
    uint32_t *M;   /* E minima over predecessors, keys (read as floats: the cost carried on) */
    uint32_t *M2;  /* E more: the AVX2 pass keeps the previous position's minima and the next one's */
    uint8_t *bp;   /* L * E back pointers: the low byte of the best predecessor's key, its low K bits the h */
} work_t;

static inline uint32_t fbits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bitsf(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* A pass computes M_i[j] = min_h key_i(h*E + j) for the ring steps i = 0..L-1, storing each step's back
 * pointers in the bp row of its position, and returns M_{L-1}: all a tile's end needs (below). */
typedef const uint32_t *(*pass_fn)(const float *, int, int, const float *, work_t *);

/* The portable pass: plain C, all 65536 keys of a position stored in C, then the min over h. (Built with
 * target_clones this was the whole kernel; GCC vectorized its candidate loop, Q consecutive lanes sharing
 * one M[j], for AVX2 with a de-interleave and re-interleave shuffle per vector, at ~1/3 of its AVX-512
 * speed. The vector passes below restructure the loops instead.) */
#define DEFINE_PASS(KK, NAME, ATTR)                                                                       \
ATTR static const uint32_t *NAME(const float *x, int roll, int pre, const float *v, work_t *w)           \
{                                                                                                         \
    enum { K = KK, Q = 1 << KK, E = NSTATES >> KK, HS = 16 - KK };                                        \
    const uint32_t mask = ~(uint32_t) (Q - 1);                                                            \
    uint32_t *restrict C = w->C;                                                                          \
    uint32_t *restrict Mu = w->M;                                                                         \
    float xi = x[roll & (L - 1)];                                                                         \
    for (int s = 0; s < NSTATES; ++s) {                                                                   \
        float d = v[s] - xi;                                                                              \
        float m0 = (pre < 0 || (s >> K) == pre) ? 0.0f : bitsf(BIG_BITS);                                 \
        C[s] = (fbits(fmaf(d, d, m0)) & mask) | (uint32_t) (s >> HS);                                     \
    }                                                                                                     \
    for (int i = 1;; ++i) {                                                                               \
        int prev = (i - 1 + roll) & (L - 1);                                                              \
        uint8_t *restrict bp = w->bp + (size_t) prev * E;                                                 \
        for (int j = 0; j < E; ++j) Mu[j] = C[j];                                                         \
        for (int h = 1; h < Q; ++h) {                                                                     \
            const uint32_t *restrict Ch = C + (size_t) h * E;                                             \
            for (int j = 0; j < E; ++j) Mu[j] = Ch[j] < Mu[j] ? Ch[j] : Mu[j];                            \
        }                                                                                                 \
        if (i == L) return Mu;                                                                            \
        for (int j = 0; j < E; ++j) bp[j] = (uint8_t) Mu[j];                                              \
        xi = x[(i + roll) & (L - 1)];                                                                     \
        for (int j = 0; j < E; ++j) {                                                                     \
            float m = bitsf(Mu[j]);                                                                       \
            for (int q = 0; q < Q; ++q) {                                                                 \
                int s = j * Q + q;                                                                        \
                float d = v[s] - xi;                                                                      \
                C[s] = (fbits(fmaf(d, d, m)) & mask) | (uint32_t) (s >> HS);                              \
            }                                                                                             \
        }                                                                                                 \
    }                                                                                                     \
}

#define DEFINE_PASSES(SUFFIX, ATTR)                                                                       \
DEFINE_PASS(1, forward_1_##SUFFIX, ATTR) DEFINE_PASS(2, forward_2_##SUFFIX, ATTR)                         \
DEFINE_PASS(3, forward_3_##SUFFIX, ATTR) DEFINE_PASS(4, forward_4_##SUFFIX, ATTR)                         \
DEFINE_PASS(5, forward_5_##SUFFIX, ATTR) DEFINE_PASS(6, forward_6_##SUFFIX, ATTR)                         \
DEFINE_PASS(7, forward_7_##SUFFIX, ATTR) DEFINE_PASS(8, forward_8_##SUFFIX, ATTR)

DEFINE_PASSES(generic, )
static const pass_fn PASSES_GENERIC[9] = {NULL, forward_1_generic, forward_2_generic, forward_3_generic,
                                          forward_4_generic, forward_5_generic, forward_6_generic,
                                          forward_7_generic, forward_8_generic};

#if FQ_X86
/* The AVX2 pass: the same keys, never stored. For a block of 16 columns j (two vectors of 8 lanes) it runs
 * over the Q predecessors' rows h, computing the candidates s = h*E + j directly and keeping their running
 * min in two registers: M_i[j] = min_h key(v[s] - x_i, M_{i-1}[s >> K], h). Per 8 candidates that is one
 * load of v (folded into the subtract), one fma, an and, an or, a min, and M_{i-1}[s >> K] spread over the
 * lanes: (j + l) >> K is the same for 2^K consecutive lanes, so at K >= 3 one broadcast load, at K = 1, 2
 * one permute of a loaded vector. Per position the memory touched is v and the E-entry minima, not 65536
 * stored and reloaded keys. d = x_i - v[s] is the portable pass's d negated, exactly (IEEE subtraction is
 * sign-symmetric), and d*d does not see the sign. The min over h is exact in any order: keys are distinct
 * integers (h in the low bits). */
static inline FQ_TARGET_AVX2 __attribute__((always_inline)) __m256i
key_avx2(const float *restrict v, int s, __m256 xi, __m256 m, __m256i mask, __m256i h)
{
    __m256 d = _mm256_sub_ps(xi, _mm256_loadu_ps(v + s));
    __m256 c = _mm256_fmadd_ps(d, d, m);
    return _mm256_or_si256(_mm256_and_si256(_mm256_castps_si256(c), mask), h);
}

static inline FQ_TARGET_AVX2 __attribute__((always_inline)) const uint32_t *
forward_avx2(const int K, const float *x, int roll, int pre, const float *v, work_t *w)
{
    const int Q = 1 << K, E = NSTATES >> K, F = E >> K; /* row h's predecessors start at M[h*F] */
    const __m256i mask = _mm256_set1_epi32((int) ~(uint32_t) (Q - 1));
    /* the low byte of each 32-bit lane to bytes 0-3 (first vector) or 8-11 (second) of its 128-bit half */
    const __m256i pick0 = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                           0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i pick1 = _mm256_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1,
                                           -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1);
    const __m256i order = _mm256_setr_epi32(0, 4, 2, 6, 1, 5, 3, 7);
    /* K = 1: lanes of columns j0..j0+7 take M[b..b+3] twice each, of j0+8..j0+15 M[b+4..b+7] */
    const __m256i spread1a = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
    const __m256i spread1b = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
    /* K = 2: M[b], M[b+1] four times each, then M[b+2], M[b+3] */
    const __m256i spread2a = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    const __m256i spread2b = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
    uint32_t *restrict Mp = w->M;
    uint32_t *restrict Mn = w->M2;
    /* M_{-1}: zero (pass 1), or zero at `pre` and 2^126 elsewhere (pass 2) */
    for (int j = 0; j < E; ++j) Mp[j] = (pre < 0 || j == pre) ? 0u : BIG_BITS;
    /* pass 1's backtrack reads only the rows of ring steps L/2-1 .. L-2 */
    const int bp_lo = pre < 0 ? L / 2 - 1 : 0;
    for (int i = 0; i < L; ++i) {
        const int pos = (i + roll) & (L - 1);
        const int keep_bp = i >= bp_lo && i < L - 1;
        uint8_t *restrict bp = w->bp + (size_t) pos * E;
        const __m256 xi = _mm256_set1_ps(x[pos]);
        const float *Mf = (const float *) Mp;
        for (int j0 = 0; j0 < E; j0 += 16) {
            __m256i a = _mm256_set1_epi32(-1), b = a;
            __m256i hv = _mm256_setzero_si256();
            const __m256i one = _mm256_set1_epi32(1);
            for (int h = 0; h < Q; ++h, hv = _mm256_add_epi32(hv, one)) {
                const int s = h * (E + VPAD) + j0;
                const float *mrow = Mf + h * F + (j0 >> K);
                __m256 ma, mb;
                if (K == 1) {
                    __m256 m8 = _mm256_load_ps(mrow);
                    ma = _mm256_permutevar8x32_ps(m8, spread1a);
                    mb = _mm256_permutevar8x32_ps(m8, spread1b);
                } else if (K == 2) {
                    __m256 m4 = _mm256_castps128_ps256(_mm_load_ps(mrow));
                    ma = _mm256_permutevar8x32_ps(m4, spread2a);
                    mb = _mm256_permutevar8x32_ps(m4, spread2b);
                } else if (K == 3) {
                    ma = _mm256_broadcast_ss(mrow);
                    mb = _mm256_broadcast_ss(mrow + 1);
                } else {
                    ma = mb = _mm256_broadcast_ss(mrow);
                }
                a = _mm256_min_epu32(a, key_avx2(v, s, xi, ma, mask, hv));
                b = _mm256_min_epu32(b, key_avx2(v, s + 8, xi, mb, mask, hv));
            }
            _mm256_store_si256((__m256i *) (Mn + j0), a);
            _mm256_store_si256((__m256i *) (Mn + j0 + 8), b);
            if (keep_bp) { /* the 16 low bytes, in order (the backtrack masks them to K bits) */
                __m256i p = _mm256_or_si256(_mm256_shuffle_epi8(a, pick0), _mm256_shuffle_epi8(b, pick1));
                p = _mm256_permutevar8x32_epi32(p, order);
                _mm_storeu_si128((__m128i *) (bp + j0), _mm256_castsi256_si128(p));
            }
        }
        uint32_t *t = Mp; Mp = Mn; Mn = t;
    }
    return Mp;
}

#define DEFINE_AVX2(KK)                                                                                   \
FQ_TARGET_AVX2 static const uint32_t *forward_##KK##_avx2(const float *x, int roll, int pre, const float *v, \
                                                          work_t *w)                                      \
{ return forward_avx2(KK, x, roll, pre, v, w); }
DEFINE_AVX2(1) DEFINE_AVX2(2) DEFINE_AVX2(3) DEFINE_AVX2(4)
DEFINE_AVX2(5) DEFINE_AVX2(6) DEFINE_AVX2(7) DEFINE_AVX2(8)
static const pass_fn PASSES_AVX2[9] = {NULL, forward_1_avx2, forward_2_avx2, forward_3_avx2, forward_4_avx2,
                                       forward_5_avx2, forward_6_avx2, forward_7_avx2, forward_8_avx2};

/* The AVX-512 pass: the AVX2 pass with 16 lanes (a block of 32 columns), the and-or in one ternary-logic
 * instruction and the back pointers narrowed by vpmovdb. */
static inline FQ_TARGET_AVX512 __attribute__((always_inline)) __m512i
key_avx512(const float *restrict v, int s, __m512 xi, __m512 m, __m512i mask, __m512i h)
{
    __m512 d = _mm512_sub_ps(xi, _mm512_loadu_ps(v + s));
    __m512 c = _mm512_fmadd_ps(d, d, m);
    return _mm512_ternarylogic_epi32(_mm512_castps_si512(c), mask, h, 0xEA); /* (c & mask) | h */
}

static inline FQ_TARGET_AVX512 __attribute__((always_inline)) const uint32_t *
forward_avx512(const int K, const float *x, int roll, int pre, const float *v, work_t *w)
{
    const int Q = 1 << K, E = NSTATES >> K, F = E >> K;
    const __m512i mask = _mm512_set1_epi32((int) ~(uint32_t) (Q - 1));
    /* lane l of the first vector takes M[b + (l >> K)], of the second M[b + ((16 + l) >> K)] (K <= 3) */
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i spread_a = _mm512_srli_epi32(iota, K);
    const __m512i spread_b = _mm512_srli_epi32(_mm512_add_epi32(iota, _mm512_set1_epi32(16)), K);
    uint32_t *restrict Mp = w->M;
    uint32_t *restrict Mn = w->M2;
    for (int j = 0; j < E; ++j) Mp[j] = (pre < 0 || j == pre) ? 0u : BIG_BITS;
    const int bp_lo = pre < 0 ? L / 2 - 1 : 0;
    for (int i = 0; i < L; ++i) {
        const int pos = (i + roll) & (L - 1);
        const int keep_bp = i >= bp_lo && i < L - 1;
        uint8_t *restrict bp = w->bp + (size_t) pos * E;
        const __m512 xi = _mm512_set1_ps(x[pos]);
        const float *Mf = (const float *) Mp;
        for (int j0 = 0; j0 < E; j0 += 32) {
            __m512i a = _mm512_set1_epi32(-1), b = a;
            __m512i hv = _mm512_setzero_si512();
            const __m512i one = _mm512_set1_epi32(1);
            for (int h = 0; h < Q; ++h, hv = _mm512_add_epi32(hv, one)) {
                const int s = h * (E + VPAD) + j0;
                const float *mrow = Mf + h * F + (j0 >> K);
                __m512 ma, mb;
                if (K == 1) {
                    __m512 m16 = _mm512_load_ps(mrow);
                    ma = _mm512_permutexvar_ps(spread_a, m16);
                    mb = _mm512_permutexvar_ps(spread_b, m16);
                } else if (K == 2) {
                    __m512 m8 = _mm512_castps256_ps512(_mm256_load_ps(mrow));
                    ma = _mm512_permutexvar_ps(spread_a, m8);
                    mb = _mm512_permutexvar_ps(spread_b, m8);
                } else if (K == 3) {
                    __m512 m4 = _mm512_castps128_ps512(_mm_load_ps(mrow));
                    ma = _mm512_permutexvar_ps(spread_a, m4);
                    mb = _mm512_permutexvar_ps(spread_b, m4);
                } else if (K == 4) {
                    ma = _mm512_set1_ps(mrow[0]);
                    mb = _mm512_set1_ps(mrow[1]);
                } else {
                    ma = mb = _mm512_set1_ps(mrow[0]);
                }
                a = _mm512_min_epu32(a, key_avx512(v, s, xi, ma, mask, hv));
                b = _mm512_min_epu32(b, key_avx512(v, s + 16, xi, mb, mask, hv));
            }
            _mm512_store_si512((__m512i *) (Mn + j0), a);
            _mm512_store_si512((__m512i *) (Mn + j0 + 16), b);
            if (keep_bp) {
                _mm_storeu_si128((__m128i *) (bp + j0), _mm512_cvtepi32_epi8(a));
                _mm_storeu_si128((__m128i *) (bp + j0 + 16), _mm512_cvtepi32_epi8(b));
            }
        }
        uint32_t *t = Mp; Mp = Mn; Mn = t;
    }
    return Mp;
}

#define DEFINE_AVX512(KK)                                                                                 \
FQ_TARGET_AVX512 static const uint32_t *forward_##KK##_avx512(const float *x, int roll, int pre,         \
                                                              const float *v, work_t *w)                  \
{ return forward_avx512(KK, x, roll, pre, v, w); }
DEFINE_AVX512(1) DEFINE_AVX512(2) DEFINE_AVX512(3) DEFINE_AVX512(4)
DEFINE_AVX512(5) DEFINE_AVX512(6) DEFINE_AVX512(7) DEFINE_AVX512(8)
static const pass_fn PASSES_AVX512[9] = {NULL, forward_1_avx512, forward_2_avx512, forward_3_avx512,
                                         forward_4_avx512, forward_5_avx512, forward_6_avx512,
                                         forward_7_avx512, forward_8_avx512};
#endif

/* ---- Half-integer K = KA + 0.5 (exllamav3's frac_k, MASK 0xAAAA) ----
 * Step p (tile position p) adds D(p) = KA + (p & 1) bits: s_p = ((s_{p-1} << D(p)) | symbol_p) & 0xFFFF. The same
 * arithmetic as above with two widths per step: KIN = D(p) (the predecessor node is s_p >> KIN, the low 16-KIN
 * bits of s_{p-1}) and KOUT = D(p+1) (M_p is indexed by the low 16-KOUT bits j of s_p, the candidates are
 * s = h*E + j with E = 2^(16-KOUT), h < 2^KOUT, tagged with h). Where the integer pass has K, read KIN for the
 * predecessor and KOUT for the tag. A tile's ring starts and ends on even positions (D = KA): both passes start
 * with 2^(16-KA) nodes and end with them, so the tail-biting is the integer one with K = KA at the seam.
 * The passes keep the back pointer rows at a stride of 2^(16-KA) (the widest node space). */
typedef const uint32_t *(*frac_pass_fn)(const float *, int, int, const float *, work_t *);

static inline int frac_bp_lo(int pre) { return pre < 0 ? L / 2 - 1 : 0; }

/* Portable: per column j the min over h, candidates computed directly (v unpadded). */
static const uint32_t *frac_pass_generic(const int KA, const float *x, int roll, int pre, const float *v,
                                         work_t *w)
{
    const size_t ROW = NSTATES >> KA;
    uint32_t *Mp = w->M, *Mn = w->M2;
    for (int j = 0; j < (NSTATES >> KA); ++j) Mp[j] = (pre < 0 || j == pre) ? 0u : BIG_BITS;
    const int bp_lo = frac_bp_lo(pre);
    for (int i = 0; i < L; ++i) {
        const int pos = (i + roll) & (L - 1);
        const int kin = KA + (pos & 1), kout = KA + ((pos + 1) & 1);
        const int E = NSTATES >> kout, Q = 1 << kout;
        const uint32_t mask = ~(uint32_t) (Q - 1);
        const int keep_bp = i >= bp_lo && i < L - 1;
        uint8_t *bp = w->bp + (size_t) pos * ROW;
        const float xi = x[pos];
        for (int j = 0; j < E; ++j) {
            uint32_t best = UINT32_MAX;
            for (int h = 0; h < Q; ++h) {
                const int s = h * E + j;
                const float d = v[s] - xi;
                const uint32_t key = (fbits(fmaf(d, d, bitsf(Mp[s >> kin]))) & mask) | (uint32_t) h;
                best = key < best ? key : best;
            }
            Mn[j] = best;
            if (keep_bp) bp[j] = (uint8_t) best;
        }
        uint32_t *t = Mp; Mp = Mn; Mn = t;
    }
    return Mp;
}

#define DEFINE_FRAC_GENERIC(KA)                                                                           \
static const uint32_t *frac_pass_##KA##_generic(const float *x, int roll, int pre, const float *v, work_t *w) \
{ return frac_pass_generic(KA, x, roll, pre, v, w); }
DEFINE_FRAC_GENERIC(1) DEFINE_FRAC_GENERIC(2) DEFINE_FRAC_GENERIC(3)
static const frac_pass_fn FRAC_PASSES_GENERIC[4] = {NULL, frac_pass_1_generic, frac_pass_2_generic,
                                                    frac_pass_3_generic};

/* The vector passes read v padded as 2^(KA+1) rows of 2^(15-KA) values (+ VPAD): the rows of the narrow split;
 * a wide-split row is two of them, and a block of columns never straddles one (rows are >= 4096 values). */
static inline int frac_vidx(int KA, int s)
{
    const int RS = 15 - KA;
    return (s >> RS) * ((1 << RS) + VPAD) + (s & ((1 << RS) - 1));
}

#if FQ_X86
static inline FQ_TARGET_AVX2 __attribute__((always_inline)) void
frac_step_avx2(const int KA, const int KIN, const int KOUT, const float *v, float x, const uint32_t *Mp,
               uint32_t *Mn, uint8_t *bp)
{
    const int Q = 1 << KOUT, E = NSTATES >> KOUT, F = E >> KIN;
    const __m256i mask = _mm256_set1_epi32((int) ~(uint32_t) (Q - 1));
    const __m256i pick0 = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                           0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i pick1 = _mm256_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1,
                                           -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1);
    const __m256i order = _mm256_setr_epi32(0, 4, 2, 6, 1, 5, 3, 7);
    const __m256i spread1a = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
    const __m256i spread1b = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
    const __m256i spread2a = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    const __m256i spread2b = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
    const __m256 xi = _mm256_set1_ps(x);
    const float *Mf = (const float *) Mp;
    for (int j0 = 0; j0 < E; j0 += 16) {
        __m256i a = _mm256_set1_epi32(-1), b = a;
        __m256i hv = _mm256_setzero_si256();
        const __m256i one = _mm256_set1_epi32(1);
        for (int h = 0; h < Q; ++h, hv = _mm256_add_epi32(hv, one)) {
            const int s = frac_vidx(KA, h * E + j0);
            const float *mrow = Mf + h * F + (j0 >> KIN);
            __m256 ma, mb;
            if (KIN == 1) {
                __m256 m8 = _mm256_loadu_ps(mrow);
                ma = _mm256_permutevar8x32_ps(m8, spread1a);
                mb = _mm256_permutevar8x32_ps(m8, spread1b);
            } else if (KIN == 2) {
                __m256 m4 = _mm256_castps128_ps256(_mm_loadu_ps(mrow));
                ma = _mm256_permutevar8x32_ps(m4, spread2a);
                mb = _mm256_permutevar8x32_ps(m4, spread2b);
            } else if (KIN == 3) {
                ma = _mm256_broadcast_ss(mrow);
                mb = _mm256_broadcast_ss(mrow + 1);
            } else {
                ma = mb = _mm256_broadcast_ss(mrow);
            }
            a = _mm256_min_epu32(a, key_avx2(v, s, xi, ma, mask, hv));
            b = _mm256_min_epu32(b, key_avx2(v, s + 8, xi, mb, mask, hv));
        }
        _mm256_storeu_si256((__m256i *) (Mn + j0), a);
        _mm256_storeu_si256((__m256i *) (Mn + j0 + 8), b);
        if (bp) {
            __m256i p = _mm256_or_si256(_mm256_shuffle_epi8(a, pick0), _mm256_shuffle_epi8(b, pick1));
            p = _mm256_permutevar8x32_epi32(p, order);
            _mm_storeu_si128((__m128i *) (bp + j0), _mm256_castsi256_si128(p));
        }
    }
}

static inline FQ_TARGET_AVX512 __attribute__((always_inline)) void
frac_step_avx512(const int KA, const int KIN, const int KOUT, const float *v, float x, const uint32_t *Mp,
                 uint32_t *Mn, uint8_t *bp)
{
    const int Q = 1 << KOUT, E = NSTATES >> KOUT, F = E >> KIN;
    const __m512i mask = _mm512_set1_epi32((int) ~(uint32_t) (Q - 1));
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i spread_a = _mm512_srli_epi32(iota, KIN);
    const __m512i spread_b = _mm512_srli_epi32(_mm512_add_epi32(iota, _mm512_set1_epi32(16)), KIN);
    const __m512 xi = _mm512_set1_ps(x);
    const float *Mf = (const float *) Mp;
    for (int j0 = 0; j0 < E; j0 += 32) {
        __m512i a = _mm512_set1_epi32(-1), b = a;
        __m512i hv = _mm512_setzero_si512();
        const __m512i one = _mm512_set1_epi32(1);
        for (int h = 0; h < Q; ++h, hv = _mm512_add_epi32(hv, one)) {
            const int s = frac_vidx(KA, h * E + j0);
            const float *mrow = Mf + h * F + (j0 >> KIN);
            __m512 ma, mb;
            if (KIN == 1) {
                __m512 m16 = _mm512_loadu_ps(mrow);
                ma = _mm512_permutexvar_ps(spread_a, m16);
                mb = _mm512_permutexvar_ps(spread_b, m16);
            } else if (KIN == 2) {
                __m512 m8 = _mm512_castps256_ps512(_mm256_loadu_ps(mrow));
                ma = _mm512_permutexvar_ps(spread_a, m8);
                mb = _mm512_permutexvar_ps(spread_b, m8);
            } else if (KIN == 3) {
                __m512 m4 = _mm512_castps128_ps512(_mm_loadu_ps(mrow));
                ma = _mm512_permutexvar_ps(spread_a, m4);
                mb = _mm512_permutexvar_ps(spread_b, m4);
            } else {
                ma = _mm512_set1_ps(mrow[0]);
                mb = _mm512_set1_ps(mrow[1]);
            }
            a = _mm512_min_epu32(a, key_avx512(v, s, xi, ma, mask, hv));
            b = _mm512_min_epu32(b, key_avx512(v, s + 16, xi, mb, mask, hv));
        }
        _mm512_storeu_si512((__m512i *) (Mn + j0), a);
        _mm512_storeu_si512((__m512i *) (Mn + j0 + 16), b);
        if (bp) {
            _mm_storeu_si128((__m128i *) (bp + j0), _mm512_cvtepi32_epi8(a));
            _mm_storeu_si128((__m128i *) (bp + j0 + 16), _mm512_cvtepi32_epi8(b));
        }
    }
}

/* KIN = 4 occurs only at KA = 3 (odd positions): 32 columns >> 4 = two minima, one per vector. */
#define DEFINE_FRAC_VEC(KA, ISA_, ATTR)                                                                   \
ATTR static const uint32_t *frac_pass_##KA##_##ISA_(const float *x, int roll, int pre, const float *v,  \
                                                    work_t *w)                                            \
{                                                                                                         \
    const size_t ROW = NSTATES >> KA;                                                                     \
    uint32_t *Mp = w->M, *Mn = w->M2;                                                                     \
    for (int j = 0; j < (NSTATES >> KA); ++j) Mp[j] = (pre < 0 || j == pre) ? 0u : BIG_BITS;              \
    const int bp_lo = frac_bp_lo(pre);                                                                    \
    for (int i = 0; i < L; ++i) {                                                                         \
        const int pos = (i + roll) & (L - 1);                                                             \
        uint8_t *bp = (i >= bp_lo && i < L - 1) ? w->bp + (size_t) pos * ROW : NULL;                      \
        if (pos & 1) frac_step_##ISA_(KA, KA + 1, KA, v, x[pos], Mp, Mn, bp);                             \
        else frac_step_##ISA_(KA, KA, KA + 1, v, x[pos], Mp, Mn, bp);                                     \
        uint32_t *t = Mp; Mp = Mn; Mn = t;                                                                \
    }                                                                                                     \
    return Mp;                                                                                            \
}
DEFINE_FRAC_VEC(1, avx2, FQ_TARGET_AVX2) DEFINE_FRAC_VEC(2, avx2, FQ_TARGET_AVX2)
DEFINE_FRAC_VEC(3, avx2, FQ_TARGET_AVX2)
DEFINE_FRAC_VEC(1, avx512, FQ_TARGET_AVX512) DEFINE_FRAC_VEC(2, avx512, FQ_TARGET_AVX512)
DEFINE_FRAC_VEC(3, avx512, FQ_TARGET_AVX512)
static const frac_pass_fn FRAC_PASSES_AVX2[4] = {NULL, frac_pass_1_avx2, frac_pass_2_avx2, frac_pass_3_avx2};
static const frac_pass_fn FRAC_PASSES_AVX512[4] = {NULL, frac_pass_1_avx512, frac_pass_2_avx512,
                                                   frac_pass_3_avx512};
#endif

static const pass_fn *PASSES = PASSES_GENERIC;
static const frac_pass_fn *FRAC_PASSES = FRAC_PASSES_GENERIC;
static const char *ISA = "generic";
static int PADDED_V = 0; /* the passes take v with rows of E + VPAD values, and need no C (the AVX2 pass) */

/* Walk back from state s at ring step L-1 down to ring step `stop`; returns the state there. The step into
 * position `pos` shifted by D(pos) bits (K; for a half-integer K = KA + 0.5, `frac`, KA at even positions and KA + 1
 * at odd ones), so the predecessor's low 16-D(pos) bits are s >> D(pos) and its top D(pos) bits are the stored h. */
static int backtrack(int K, int frac, int roll, int s, int stop, const work_t *w, uint16_t *out)
{
    const size_t ROW = NSTATES >> K;
    for (int i = L - 1;; --i) {
        const int pos = (i + roll) & (L - 1);
        if (out) out[pos] = (uint16_t) s;
        if (i == stop) return s;
        const int prev = (i - 1 + roll) & (L - 1);
        const int din = K + (frac & pos & 1);
        const int j = s >> din;
        s = (int) (w->bp[(size_t) prev * ROW + j] & ((1 << din) - 1)) * (NSTATES >> din) + j;
    }
}

/* The end of a pass from its last minima M (= min over h of the last position's keys). Pass 1 ends on the
 * lowest state of minimal key: every state of key k has h = k & (Q-1), so it is h*E + the lowest j with
 * M[j] = k. Pass 2 ends on the state with low bits `pre` of minimal key: h = M[pre] & (Q-1).
 * A half-integer K (`frac`, K = KA): both passes end on an odd position whose successor (an even one) adds KA
 * bits, so the ends are the integer K = KA's, and pre (the low 16-KA bits of s_255) is the node into position 0,
 * as in exllamav3's quantize_tiles_frac_kernel (pass 1 from 128, traced back to position 0's in-node; pass 2 from
 * 0 through it). */
static void encode_tile(const float *x, int K, int frac, const float *v, work_t *w, uint16_t *out)
{
    const int E = NSTATES >> K, Q = 1 << K;
    const pass_fn pass = frac ? FRAC_PASSES[K] : PASSES[K];
    /* pass 1: from position 128, unconstrained; best final state, back to ring step 127 = position 255 */
    const uint32_t *M = pass(x, L / 2, -1, v, w);
    int jbest = 0;
    for (int j = 1; j < E; ++j)
        if (M[j] < M[jbest]) jbest = j;
    int best = (int) (M[jbest] & (uint32_t) (Q - 1)) * E + jbest;
    int s255 = backtrack(K, frac, L / 2, best, L / 2 - 1, w, NULL);
    int pre = s255 & (E - 1);
    /* pass 2: from position 0, ring closed through `pre` */
    M = pass(x, 0, pre, v, w);
    int end = (int) (M[pre] & (uint32_t) (Q - 1)) * E + pre;
    backtrack(K, frac, 0, end, 0, w, out);
}

static int get_buffer(PyObject *obj, Py_buffer *view, int writable, const char *fmt, Py_ssize_t itemsize,
                      const char *name)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) return -1;
    if (view->itemsize != itemsize || (view->format && strchr(fmt, view->format[0]) == NULL)) {
        PyErr_Format(PyExc_ValueError, "%s: expected a contiguous buffer of format %s", name, fmt);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* viterbi(tiles, K, values, out, threads) and viterbi_frac(tiles, KA, values, out, threads), K = KA + 0.5 (mul1
   values; the caller checks the codebook): one body. A frac search reads v as 2 << KA rows of 1 << (15 - KA) values,
   an integer one as 1 << K rows of E; the AVX2 pass wants each row padded (PADDED_V), the integer generic pass a
   per-thread cost table C. */
static PyObject *viterbi_tiles(PyObject *args, int frac)
{
    const char *name = frac ? "viterbi_frac" : "viterbi";
    PyObject *xo, *vo, *oo;
    int K, threads;
    if (!PyArg_ParseTuple(args, "OiOOi", &xo, &K, &vo, &oo, &threads)) return NULL;
    if (frac ? (K < 1 || K > 3) : (K < 1 || K > 8)) {
        PyErr_SetString(PyExc_ValueError, frac ? "viterbi_frac: KA must be in 1..3 (K = 1.5, 2.5, 3.5)"
                                               : "K must be in 1..8");
        return NULL;
    }
    Py_buffer xb, vb, ob;
    if (get_buffer(xo, &xb, 0, "f", 4, "tiles") < 0) return NULL;
    if (get_buffer(vo, &vb, 0, "f", 4, "values") < 0) { PyBuffer_Release(&xb); return NULL; }
    if (get_buffer(oo, &ob, 1, "HhBb", 2, "states") < 0) {
        PyBuffer_Release(&xb); PyBuffer_Release(&vb); return NULL;
    }
    Py_ssize_t n = xb.len / (4 * L);
    int err = 0;
    if (xb.len != n * 4 * L || ob.len != n * 2 * L || vb.len != 4 * NSTATES) err = 1;
    if (!err) {
        const float *x = (const float *) xb.buf;
        const float *v = (const float *) vb.buf;
        uint16_t *out = (uint16_t *) ob.buf;
        const size_t E = NSTATES >> K;
        const int rows = frac ? 2 << K : 1 << K;       /* v's rows ... */
        const size_t width = frac ? E / 2 : E;          /* ... of this many values */
        const int table = !PADDED_V && !frac;           /* the integer generic pass's cost table */
        int failed = 0;
        Py_BEGIN_ALLOW_THREADS
        float *vpad = NULL;
        if (PADDED_V) { /* the AVX2 pass's layout of v: row r at r * (width + VPAD) */
            vpad = (float *) aligned_alloc(64, (size_t) rows * (width + VPAD) * sizeof(float));
            if (!vpad) failed = 1;
            else {
                for (int r = 0; r < rows; ++r) memcpy(vpad + r * (width + VPAD), v + r * width, width * sizeof(float));
                v = vpad;
            }
        }
        if (!failed) {
            #pragma omp parallel num_threads(threads > 0 ? threads : 1) reduction(|:failed)
            {
                work_t w;
                w.C = table ? (uint32_t *) aligned_alloc(64, NSTATES * sizeof(uint32_t)) : NULL;
                w.M = (uint32_t *) aligned_alloc(64, E * sizeof(uint32_t) + 64);
                w.M2 = (uint32_t *) aligned_alloc(64, E * sizeof(uint32_t) + 64);
                w.bp = (uint8_t *) aligned_alloc(64, ((L * E + 63) / 64) * 64);
                if ((table && !w.C) || !w.M || !w.M2 || !w.bp) failed = 1;
                else {
                    #pragma omp for schedule(static)
                    for (Py_ssize_t t = 0; t < n; ++t)
                        encode_tile(x + t * L, K, frac, v, &w, out + t * L);
                }
                free(w.C); free(w.M); free(w.M2); free(w.bp);
            }
        }
        free(vpad);
        Py_END_ALLOW_THREADS
        if (failed) err = 2;
    }
    PyBuffer_Release(&xb); PyBuffer_Release(&vb); PyBuffer_Release(&ob);
    if (err == 1) {
        PyErr_Format(PyExc_ValueError, "%s: tiles must be (n, 256) float32, states (n, 256) 16-bit, values 65536 float32",
                     name);
        return NULL;
    }
    if (err == 2) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_viterbi(PyObject *self, PyObject *args) { return viterbi_tiles(args, 0); }
static PyObject *py_viterbi_frac(PyObject *self, PyObject *args) { return viterbi_tiles(args, 1); }

/* The ISAs this CPU and build can run, widest first. */
static int isa_runs(const char *name)
{
    if (strcmp(name, "generic") == 0) return 1;
#if FQ_X86
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (strcmp(name, "avx2") == 0) return avx2;
    if (strcmp(name, "avx512") == 0)
        return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("bmi2");
#endif
    return 0;
}

static const char *const ISA_NAMES[] = {"avx512", "avx2", "generic"};

static int select_isa(const char *name)
{
    const pass_fn *table = PASSES_GENERIC;
    const frac_pass_fn *frac = FRAC_PASSES_GENERIC;
#if FQ_X86
    if (strcmp(name, "avx512") == 0) { table = PASSES_AVX512; frac = FRAC_PASSES_AVX512; }
    else if (strcmp(name, "avx2") == 0) { table = PASSES_AVX2; frac = FRAC_PASSES_AVX2; }
    PADDED_V = table == PASSES_AVX2 || table == PASSES_AVX512;
#endif
    for (int k = 0; k < 3; ++k)
        if (strcmp(name, ISA_NAMES[k]) == 0) { ISA = ISA_NAMES[k]; PASSES = table; FRAC_PASSES = frac; return 0; }
    return -1;
}

static PyObject *py_isa(PyObject *self, PyObject *unused)
{
    return PyUnicode_FromString(ISA);
}

static PyObject *py_isas(PyObject *self, PyObject *unused)
{
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    for (int k = 0; k < 3; ++k) {
        if (!isa_runs(ISA_NAMES[k])) continue;
        PyObject *u = PyUnicode_FromString(ISA_NAMES[k]);
        if (!u || PyList_Append(out, u) < 0) { Py_XDECREF(u); Py_DECREF(out); return NULL; }
        Py_DECREF(u);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"viterbi", py_viterbi, METH_VARARGS,
     "viterbi(tiles_f32, K, values_f32, out_states_u16, threads): exact tail-biting Viterbi per 256-tile"},
    {"viterbi_frac", py_viterbi_frac, METH_VARARGS,
     "viterbi_frac(tiles_f32, KA, values_f32, out_states_u16, threads): the same at K = KA + 0.5 (KA 1..3)"},
    {"isa", py_isa, METH_NOARGS, "isa(): the instruction set the kernel runs: 'avx512', 'avx2' or 'generic'"},
    {"isas", py_isas, METH_NOARGS, "isas(): the instruction sets this CPU can run, widest first"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_trellis", NULL, -1, methods};

/* Chooses the ISA once: FQ_CPU_ISA if set (refused unless known and runnable here), else the widest. */
PyMODINIT_FUNC PyInit__trellis(void)
{
    const char *want = getenv("FQ_CPU_ISA");
    if (want && *want) {
        if (select_isa(want) < 0) {
            PyErr_Format(PyExc_ValueError, "FQ_CPU_ISA=%s: unknown; allowed values: avx512, avx2, generic "
                                           "(or unset: the widest this CPU runs)", want);
            return NULL;
        }
        if (!isa_runs(want)) {
            PyErr_Format(PyExc_ValueError, "FQ_CPU_ISA=%s: this CPU (or build) cannot run it; allowed values "
                                           "here: %s%s%s (or unset)", want,
                         isa_runs("avx512") ? "avx512, " : "", isa_runs("avx2") ? "avx2, " : "", "generic");
            return NULL;
        }
    } else {
        for (int k = 0; k < 3; ++k)
            if (isa_runs(ISA_NAMES[k])) { select_isa(ISA_NAMES[k]); break; }
    }
    return PyModule_Create(&module);
}
