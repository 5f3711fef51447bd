/* Exact tail-biting Viterbi search over the 65536-state EXL3 bitshift trellis, CPU.
 *
 * State s_i is 16 bits; s_i = ((s_{i-1} << K) | symbol_i) & 0xFFFF, so the predecessors of s are
 * h*E + (s >> K) for h < Q (E = 2^(16-K), Q = 2^K). Per position: C[s] = (v[s] - x)^2 + M[s >> K],
 * M[j] = min_h C[h*E + j] with the first minimal h kept as back pointer. Costs are float32 with no
 * fused multiply-add, so the torch path (fq.codec.viterbi_torch) produces the same bits.
 *
 * Tail-biting, as the reference encoder does it: pass 1 runs the ring from position 128 without
 * constraint and reads off the state at position 255 on the best path; pass 2 runs from position 0
 * with s_0 >> K fixed to that state's low 16-K bits and ends on a state with those low bits, which
 * closes the ring. Tiles are independent: OpenMP over tiles, deterministic for any thread count.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Runtime dispatch to the widest vector ISA; results are identical on each (IEEE ops, no contraction). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FQ_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FQ_CLONES
#endif

#define L 256
#define NSTATES 65536

typedef struct {
    float *C;      /* NSTATES costs of the current position */
    float *M;      /* E minima over predecessors */
    uint8_t *bp;   /* L * E back pointers (the h of the best predecessor) */
} work_t;

#define DEFINE_PASS(KK)                                                                                   \
FQ_CLONES static void forward_##KK(const float *x, int roll, int pre, const float *v, work_t *w)        \
{                                                                                                         \
    enum { K = KK, Q = 1 << KK, E = NSTATES >> KK };                                                      \
    float *restrict C = w->C;                                                                             \
    float *restrict M = w->M;                                                                             \
    float xi = x[roll & (L - 1)];                                                                         \
    for (int s = 0; s < NSTATES; ++s) {                                                                   \
        float d = v[s] - xi;                                                                              \
        C[s] = d * d;                                                                                     \
    }                                                                                                     \
    if (pre >= 0)                                                                                         \
        for (int s = 0; s < NSTATES; ++s)                                                                 \
            if ((s >> K) != pre) C[s] = INFINITY;                                                         \
    for (int i = 1; i < L; ++i) {                                                                         \
        int prev = (i - 1 + roll) & (L - 1);                                                              \
        uint8_t *restrict bp = w->bp + (size_t) prev * E;                                                 \
        for (int j = 0; j < E; ++j) { M[j] = C[j]; bp[j] = 0; }                                           \
        for (int h = 1; h < Q; ++h) {                                                                     \
            const float *restrict Ch = C + (size_t) h * E;                                                \
            for (int j = 0; j < E; ++j) {                                                                 \
                float c = Ch[j];                                                                          \
                int lt = c < M[j];                                                                        \
                M[j] = lt ? c : M[j];                                                                     \
                bp[j] = lt ? (uint8_t) h : bp[j];                                                         \
            }                                                                                             \
        }                                                                                                 \
        xi = x[(i + roll) & (L - 1)];                                                                     \
        for (int j = 0; j < E; ++j) {                                                                     \
            float m = M[j];                                                                               \
            for (int q = 0; q < Q; ++q) {                                                                 \
                float d = v[j * Q + q] - xi;                                                              \
                C[j * Q + q] = d * d + m;                                                                 \
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
    int best = 0;
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
            w.C = (float *) aligned_alloc(64, NSTATES * sizeof(float));
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
