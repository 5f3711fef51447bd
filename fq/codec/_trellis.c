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

/* Runtime dispatch to the widest vector ISA; results are identical on each (fmaf is one IEEE rounding
 * everywhere: an instruction where the ISA has FMA, libm otherwise; no other contraction). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FQ_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FQ_CLONES
#endif

#define L 256
#define NSTATES 65536
#define BIG_BITS 0x7e800000u /* 2^126 */

typedef struct {
    uint32_t *C;   /* NSTATES keys of the current position */
    float *M;      /* E minima over predecessors (keys read as floats) */
    uint8_t *bp;   /* L * E back pointers (the h of the best predecessor) */
} work_t;

static inline uint32_t fbits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bitsf(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

#define DEFINE_PASS(KK)                                                                                   \
FQ_CLONES static void forward_##KK(const float *x, int roll, int pre, const float *v, work_t *w)        \
{                                                                                                         \
    enum { K = KK, Q = 1 << KK, E = NSTATES >> KK, HS = 16 - KK };                                        \
    const uint32_t mask = ~(uint32_t) (Q - 1);                                                            \
    uint32_t *restrict C = w->C;                                                                          \
    float *restrict M = w->M;                                                                             \
    float xi = x[roll & (L - 1)];                                                                         \
    for (int s = 0; s < NSTATES; ++s) {                                                                   \
        float d = v[s] - xi;                                                                              \
        float m0 = (pre < 0 || (s >> K) == pre) ? 0.0f : bitsf(BIG_BITS);                                 \
        C[s] = (fbits(fmaf(d, d, m0)) & mask) | (uint32_t) (s >> HS);                                     \
    }                                                                                                     \
    for (int i = 1; i < L; ++i) {                                                                         \
        int prev = (i - 1 + roll) & (L - 1);                                                              \
        uint8_t *restrict bp = w->bp + (size_t) prev * E;                                                 \
        uint32_t *restrict Mu = (uint32_t *) M;                                                           \
        for (int j = 0; j < E; ++j) Mu[j] = C[j];                                                         \
        for (int h = 1; h < Q; ++h) {                                                                     \
            const uint32_t *restrict Ch = C + (size_t) h * E;                                             \
            for (int j = 0; j < E; ++j) Mu[j] = Ch[j] < Mu[j] ? Ch[j] : Mu[j];                            \
        }                                                                                                 \
        for (int j = 0; j < E; ++j) bp[j] = (uint8_t) (Mu[j] & (Q - 1));                                  \
        xi = x[(i + roll) & (L - 1)];                                                                     \
        for (int j = 0; j < E; ++j) {                                                                     \
            float m = M[j];                                                                               \
            for (int q = 0; q < Q; ++q) {                                                                 \
                int s = j * Q + q;                                                                        \
                float d = v[s] - xi;                                                                      \
                C[s] = (fbits(fmaf(d, d, m)) & mask) | (uint32_t) (s >> HS);                              \
            }                                                                                             \
        }                                                                                                 \
    }                                                                                                     \
}

DEFINE_PASS(1)
DEFINE_PASS(2)
DEFINE_PASS(3)
DEFINE_PASS(4)
DEFINE_PASS(5)
DEFINE_PASS(6)
DEFINE_PASS(7)
DEFINE_PASS(8)

typedef void (*pass_fn)(const float *, int, int, const float *, work_t *);
static const pass_fn PASSES[9] = {NULL, forward_1, forward_2, forward_3, forward_4,
                                  forward_5, forward_6, forward_7, forward_8};

/* Walk back from state s at ring step L-1 down to ring step `stop`; returns the state there. */
static int backtrack(int K, int roll, int s, int stop, const work_t *w, uint16_t *out)
{
    const int E = NSTATES >> K;
    for (int i = L - 1;; --i) {
        int pos = (i + roll) & (L - 1);
        if (out) out[pos] = (uint16_t) s;
        if (i == stop) return s;
        int prev = (i - 1 + roll) & (L - 1);
        int j = s >> K;
        s = (int) w->bp[(size_t) prev * E + j] * E + j;
    }
}

static void encode_tile(const float *x, int K, const float *v, work_t *w, uint16_t *out)
{
    const int E = NSTATES >> K, Q = 1 << K;
    /* pass 1: from position 128, unconstrained; best final state, back to ring step 127 = position 255 */
    PASSES[K](x, L / 2, -1, v, w);
    int best = 0; /* lowest state of minimal key */
    for (int s = 1; s < NSTATES; ++s)
        if (w->C[s] < w->C[best]) best = s;
    int s255 = backtrack(K, L / 2, best, L / 2 - 1, w, NULL);
    int pre = s255 & (E - 1);
    /* pass 2: from position 0, ring closed through `pre` */
    PASSES[K](x, 0, pre, v, w);
    int end = pre;
    for (int h = 1; h < Q; ++h)
        if (w->C[h * E + pre] < w->C[end]) end = h * E + pre;
    backtrack(K, 0, end, 0, w, out);
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

static PyObject *py_viterbi(PyObject *self, PyObject *args)
{
    PyObject *xo, *vo, *oo;
    int K, threads;
    if (!PyArg_ParseTuple(args, "OiOOi", &xo, &K, &vo, &oo, &threads)) return NULL;
    if (K < 1 || K > 8) {
        PyErr_SetString(PyExc_ValueError, "K must be in 1..8");
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
        int failed = 0;
        Py_BEGIN_ALLOW_THREADS
        #pragma omp parallel num_threads(threads > 0 ? threads : 1) reduction(|:failed)
        {
            work_t w;
            w.C = (uint32_t *) aligned_alloc(64, NSTATES * sizeof(uint32_t));
            w.M = (float *) aligned_alloc(64, E * sizeof(float) + 64);
            w.bp = (uint8_t *) aligned_alloc(64, ((L * E + 63) / 64) * 64);
            if (!w.C || !w.M || !w.bp) failed = 1;
            else {
                #pragma omp for schedule(static)
                for (Py_ssize_t t = 0; t < n; ++t)
                    encode_tile(x + t * L, K, v, &w, out + t * L);
            }
            free(w.C); free(w.M); free(w.bp);
        }
        Py_END_ALLOW_THREADS
        if (failed) err = 2;
    }
    PyBuffer_Release(&xb); PyBuffer_Release(&vb); PyBuffer_Release(&ob);
    if (err == 1) {
        PyErr_SetString(PyExc_ValueError, "viterbi: tiles must be (n, 256) float32, states (n, 256) 16-bit, values 65536 float32");
        return NULL;
    }
    if (err == 2) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"viterbi", py_viterbi, METH_VARARGS,
     "viterbi(tiles_f32, K, values_f32, out_states_u16, threads): exact tail-biting Viterbi per 256-tile"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_trellis", NULL, -1, methods};

PyMODINIT_FUNC PyInit__trellis(void) { return PyModule_Create(&module); }
