/* Routed experts of one MoE layer computed on the host CPU (selective-offload's host-compute).
 *
 * Plain C on a thread pool of its own (pool.h: pthreads, workers pinned to the cores given and
 * asleep between calls), no torch headers: Python calls it through ctypes with raw pointers,
 * and a CUDA host function (cudaLaunchHostFunc) can call so_moe_job_run(job) with no Python,
 * which is what lets a captured CUDA graph run the host's experts.
 *
 * Why a kernel of our own: at decode a token reads k experts' weights once, so the time is
 * the bytes read over the host's read bandwidth, and only a kernel that dequantises in
 * registers while it streams the weights gets near that bandwidth. The weights are read
 * in the layouts vLLM's create_weights makes (before any post-processing), so the same
 * host tensors serve this kernel and the device's UVA path; int4 is held row-major (GPTQ's
 * and AWQ's rewritten in place by the glue: their packing is input-major, which a row walk
 * cannot stream).
 *
 * out[t] = sum_j w[t,j] * (W2[e] @ act(W13[e] @ x[t] + b13[e]) + b2[e]), e = ids[t,j],
 * skipping picks whose id is negative or whose expert is not in the host set. Tokens are
 * grouped by expert so each expert's rows are read once per call whatever the batch. The
 * up projection is split over (expert, block of activation rows), then after a barrier the
 * down projection over blocks of output rows, so every output element has one writer; the
 * calling thread takes its share, and the threads draw work items from a shared counter.
 *
 * The SIMD path is picked at compile time by the -march=native macros: AVX-512 (F+BW+VL),
 * AVX2 with F16C and FMA, else plain C.
 */
#define _GNU_SOURCE 1  /* sched and pthread affinity (pool.h) */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && !defined(SO_NO_SIMD)
#define SO_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__) && !defined(SO_NO_SIMD)
#define SO_AVX2 1
#include <immintrin.h>
#endif
/* AVX512-BF16 and AVX512-VNNI (every CPU with the first has the second): bf16 and fp8
 * weights are multiplied in bf16 (vdpbf16ps), MXFP4 and int4 weights in int8 (vpdpbusd). */
#if defined(SO_AVX512) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define SO_BF16DOT 1
#endif
/* MXFP4 and int4 weights multiply int8 vectors (rows_int8.h) on every SIMD build: on 512
 * bits with vpdpbusd where the CPU has AVX512-VNNI, else on 256 bits (vpmaddubsw and
 * vpmaddwd; vpdpbusd where it has AVX-VNNI). */
#if defined(SO_AVX512) || defined(SO_AVX2)
#define SO_INT8DOT 1
#endif
#if defined(SO_AVX512) && defined(__AVX512VNNI__)
#define SO_INT8_512 1
#endif

/* int4 is W4A16 in groups: value = (nibble - z) * group scale, z = 8 for symmetric groups
 * (GPTQ's uint4b8, compressed-tensors) or the group's zero point (AWQ); one code per scale
 * dtype: bf16 or f16 scales as the checkpoint stores them. */
enum { SO_BF16 = 0, SO_MXFP4 = 1, SO_FP8_BLOCK = 2, SO_INT4_BF16 = 3, SO_INT4_F16 = 4 };
#define SO_IS_INT4(fmt) ((fmt) == SO_INT4_BF16 || (fmt) == SO_INT4_F16)
/* Gated activations, act(g, u): SiLU, gpt-oss's clamped SwiGLU (g and u interleaved in w13's
 * rows) and GELU with the tanh approximation (Gemma 3 and 4); the others take g then u. */
enum { SO_SILU = 0, SO_SWIGLUOAI = 1, SO_GELU_TANH = 2 };
enum { SO_DT_NONE = 0, SO_DT_BF16 = 1, SO_DT_F32 = 2 };

/* Everything one call needs; Python's MoEJob mirrors it field by field (checked by size). */
typedef struct {
    int64_t fmt, act, has_limit;
    float alpha, limit;
    int64_t T, K, E, H, I;          /* tokens, picks per token, experts, hidden, intermediate */
    int64_t block_n, block_k;       /* fp8-block scale block (rows, columns); int4: the group
                                     * (columns per scale) of w13 and of w2 */
    int64_t x_dtype;                /* SO_DT_BF16 or SO_DT_F32, [T, H] */
    int64_t ids_i64;                /* topk_ids int64 (1) or int32 (0), [T, K] */
    int64_t bias_dtype;             /* SO_DT_NONE / BF16 / F32, both biases alike */
    int64_t threads;
    const void *x;
    const void *topk_ids;
    const float *topk_weights;      /* [T, K] */
    const uint8_t *host_mask;       /* [E] or NULL (all experts on the host) */
    const void *w13, *w2;
    const void *w13_scale, *w2_scale;
    const void *w13_bias, *w2_bias;
    const uint8_t *w13_zeros, *w2_zeros;  /* int4 zero points or NULL (8): [E, rows/2, groups],
                                           * rows 2m and 2m+1 in a byte's low and high nibble */
    float *out;                     /* [T, H] f32, written whole */
    void *workspace;                /* so_moe_workspace_bytes(); NULL: allocated per call */
    int64_t workspace_bytes;
    int64_t status;                 /* 0 ok; 1 an id >= E; 2 out of memory; 3 bad format or activation */
    /* Counted by the job itself each time it runs, however it is run (by Python, or by a
     * CUDA host function a graph replays with no Python): runs, tokens (T per run) and the
     * distinct host experts read (each once per run), read by Python for the report. */
    int64_t runs, tokens, experts_read;
} so_moe_job;

int64_t so_moe_job_size(void) { return (int64_t)sizeof(so_moe_job); }

/* 1 where the tokens and the activation are held in bf16 (the AVX512-BF16 path), else 0. */
int64_t so_bf16_activations(void) {
#if defined(SO_BF16DOT)
    return 1;
#else
    return 0;
#endif
}

/* Whether the AVX512-BF16 path's bf16 row walk prefetches its weights in software (PF),
 * chosen when the library loads: on Intel, where it was measured to lift two threads'
 * rate; not on AMD, where the same prefetches cost a Zen 4 about a third of its rate at
 * one thread (benchmarks/results/cpu-kernels-*: the build line names the choice, and
 * benchmarks/cpu_kernels times the other one beside it). The other formats' walks decode
 * more per byte and prefetch on both (without it MXFP4 and int4 fell on the same Zen 4).
 * 0 on builds without that path. so_set_bf16_prefetch: a benchmark or test takes the other. */
static int so_bf16_pf = 0;
#if defined(SO_BF16DOT)
__attribute__((constructor)) static void so_choose_bf16_prefetch(void) {
    __builtin_cpu_init();
    so_bf16_pf = !__builtin_cpu_is("amd");
}
#endif
int64_t so_bf16_prefetch(void) { return so_bf16_pf; }
void so_set_bf16_prefetch(int64_t on) {
#if defined(SO_BF16DOT)
    so_bf16_pf = on != 0;
#else
    (void)on;
#endif
}

/* Where MXFP4 and int4 experts multiply int8 tokens and activations (rows_int8.h), the
 * width of that path in bits (512 or 256), else 0. */
int64_t so_int8_mxfp4(void) {
#if defined(SO_INT8_512)
    return 512;
#elif defined(SO_INT8DOT)
    return 256;
#else
    return 0;
#endif
}

int64_t so_simd_level(void) {
#if defined(SO_AVX512)
    return 512;
#elif defined(SO_AVX2)
    return 256;
#else
    return 0;
#endif
}

/* ---------------- element decoding, scalar ---------------- */

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* e2m1 (fp4) values times 2, sign in bit 3: exact in int8. */
static const int8_t E2M1_X2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline float e4m3_to_f32(uint8_t b) {
    /* The same bits as an IEEE half, scaled by 2^8 (e4m3 bias 7, half 15): exact. */
    int exp = (b >> 3) & 0xF, man = b & 7;
    float v = exp ? ldexpf(1.0f + man / 8.0f, exp - 7) : ldexpf(man / 8.0f, -6);
    return (b & 0x80) ? -v : v;
}

/* IEEE half -> float (the int4 scales of fp16 checkpoints): F16C's conversion where the
 * build has it, else in plain C. */
static inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__) && (defined(SO_AVX512) || defined(SO_AVX2))
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, u;
    if (exp == 0x1F) u = sign | 0x7F800000u | (man << 13);
    else if (exp) u = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) u = sign;
    else {
        float f = ldexpf((float)man, -24);
        return sign ? -f : f;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

/* An int4 row's groups, what the row kernels get as their ``scale`` for int4: the row's
 * scales, and its zero points (a byte per group holding this row's and its neighbour's
 * nibbles, ``shift`` 0 or 4) or NULL (8 throughout). */
typedef struct {
    const uint16_t *s;
    const uint8_t *z;
    int shift;
} so_int4_row;

/* Scale i of an int4 row: bf16 or f16 by the format code. */
static inline float int4_scale(int fmt, const void *scale, int64_t i) {
    uint16_t v = ((const so_int4_row *)scale)->s[i];
    return fmt == SO_INT4_BF16 ? bf16_to_f32(v) : f16_to_f32(v);
}

/* Zero point of group i of an int4 row. */
static inline int int4_zero(const void *scale, int64_t i) {
    const so_int4_row *g = (const so_int4_row *)scale;
    return g->z ? (g->z[i] >> g->shift) & 0xF : 8;
}

static inline float load_bias(const void *p, int64_t dtype, int64_t i) {
    if (dtype == SO_DT_BF16) return bf16_to_f32(((const uint16_t *)p)[i]);
    if (dtype == SO_DT_F32) return ((const float *)p)[i];
    return 0.0f;
}

/* ---------------- row dot products: acc[t] = row . X[t] for t < n (n <= NT) ----------------
 *
 * A row is walked 32 elements at a time; each step decodes them into f32 vectors (scaled)
 * and multiplies them with every token's vector. bf16 and mxfp4 keep their bytes in the
 * order they come (int4 too) and instead read X in a permuted order within each whole block of 32:
 * element 2i at slot i, element 2i+1 at slot 16 + i (perm32), because both store even and
 * odd elements together (the two halves of a 32-bit lane, the two nibbles of a byte) and
 * splitting them is cheaper than interleaving. fp8 reads X in natural order. A row's tail
 * past its last whole block of 32 is natural order in every format. */

#define NT 4
/* Bytes per 128 elements of an int8 vector for the MXFP4 and int4 path (its layout is described there). */
#define Q8_CHUNK 256
static inline int64_t q8_bytes(int64_t len) { return (len + 127) / 128 * Q8_CHUNK; }
/* Software prefetch this many bytes ahead of the weights being read: the rows a thread
 * walks follow each other in memory, and the hardware prefetcher alone leaves the loads
 * waiting on memory. A few rows ahead (rows are 1-6 KB in the layers benchmarked), not
 * one: with two threads sharing the memory system the nearer distance left both waiting
 * (benchmarks/cpu_kernels/ measures it). */
#ifndef SO_PREFETCH
#define SO_PREFETCH 4096
#endif
#define PF(p) _mm_prefetch((const char *)(p) + SO_PREFETCH, _MM_HINT_T0)

static inline int64_t perm32(int64_t k, int64_t len) {
    if (k >= len - len % 32) return k;
    int64_t i = k % 32;
    return k - i + ((i & 1) ? 16 + i / 2 : i / 2);
}

static inline float e8m0(uint8_t s) {
    uint32_t bits = (uint32_t)s << 23;
    float f;
    memcpy(&f, &bits, 4);
    return s ? f : 0x1p-127f;
}

#if defined(SO_AVX512) || defined(SO_AVX2)
/* The sum of a 256-bit vector's eight floats. */
static inline float hsum256(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_hadd_ps(h, h);
    h = _mm_hadd_ps(h, h);
    return _mm_cvtss_f32(h);
}
#endif

/* Element k of a row, for the tail and the plain-C path. */
static inline float element(int fmt, const void *row, const void *scale, int64_t bk, int64_t k) {
    if (fmt == SO_BF16) return bf16_to_f32(((const uint16_t *)row)[k]);
    if (fmt == SO_MXFP4) {
        uint8_t b = ((const uint8_t *)row)[k / 2];
        return 0.5f * E2M1_X2[(k & 1) ? b >> 4 : b & 0xF] * e8m0(((const uint8_t *)scale)[k / 32]);
    }
    if (SO_IS_INT4(fmt)) {
        uint8_t b = ((const uint8_t *)row)[k / 2];
        return (float)((int)((k & 1) ? b >> 4 : b & 0xF) - int4_zero(scale, k / bk)) * int4_scale(fmt, scale, k / bk);
    }
    return e4m3_to_f32(((const uint8_t *)row)[k]) * ((const float *)scale)[k / bk];
}

/* NAME(row, scale, bk, len, X, ldx, n, acc): KERNEL with the token count n (1 .. NT) a
 * constant in each of its copies, so the compiler keeps every token's sums in registers. */
#define SO_ROWS_BY_N(NAME, KERNEL, FMT, XT)                                                                   \
    static __attribute__((unused)) void NAME(const void *row, const void *scale, int64_t bk, int64_t len,      \
                                             const XT *X, int64_t ldx, int n, float *acc) {                    \
        switch (n) {                                                                                          \
            case 1: KERNEL(FMT, row, scale, bk, len, X, ldx, acc, 1); break;                                  \
            case 2: KERNEL(FMT, row, scale, bk, len, X, ldx, acc, 2); break;                                  \
            case 3: KERNEL(FMT, row, scale, bk, len, X, ldx, acc, 3); break;                                  \
            default: KERNEL(FMT, row, scale, bk, len, X, ldx, acc, 4); break;                                 \
        }                                                                                                     \
    }

/* The row dot products, by path: f32 (rows_f32.h), and where the CPU has AVX512-BF16 and
 * VNNI, bf16 and block FP8 in bf16 (rows_bf16.h) and MXFP4 and int4 in int8 (rows_int8.h). */
#include "rows_f32.h"
#include "rows_bf16.h"
#include "rows_int8.h"
#include "pool.h"


/* Row r of matrix `which` (0: w13 [E, 2I, H], 1: w2 [E, H, I]) of expert e, dotted with n
 * vectors of X, ldx elements apart (f32; bf16 on the AVX512-BF16 path; int8 vectors of
 * q8_bytes each for MXFP4 and int4 on every SIMD build). */
static void dot_row(const so_moe_job *j, int which, int64_t e, int64_t r, const void *X, int64_t ldx, int n,
                    float *acc) {
    int64_t R = which ? j->H : 2 * j->I, C = which ? j->I : j->H;
    const void *w = which ? j->w2 : j->w13, *sc = which ? j->w2_scale : j->w13_scale;
#if defined(SO_BF16DOT)
#define SO_DOT(FMT) dot16_##FMT
    typedef const uint16_t *xptr;
#else
#define SO_DOT(FMT) dot_##FMT
    typedef const float *xptr;
#endif
    if (j->fmt == SO_BF16) {
        SO_DOT(bf16)((const uint16_t *)w + (e * R + r) * C, NULL, 0, C, (xptr)X, ldx, n, acc);
    } else if (SO_IS_INT4(j->fmt)) {
        int64_t g = which ? j->block_k : j->block_n, G = C / g;  /* columns per scale, groups per row */
        const uint8_t *row = (const uint8_t *)w + (e * R + r) * (C / 2), *z = which ? j->w2_zeros : j->w13_zeros;
        so_int4_row s = {(const uint16_t *)sc + (e * R + r) * G, z ? z + (e * R + r) / 2 * G : NULL, (int)(r & 1) * 4};
#if defined(SO_INT8DOT)
        if (j->fmt == SO_INT4_BF16) dotq_int4_bf16(row, &s, g, C, (const int8_t *)X, ldx, n, acc);
        else dotq_int4_f16(row, &s, g, C, (const int8_t *)X, ldx, n, acc);
#else
        if (j->fmt == SO_INT4_BF16) dot_int4_bf16(row, &s, g, C, (xptr)X, ldx, n, acc);
        else dot_int4_f16(row, &s, g, C, (xptr)X, ldx, n, acc);
#endif
    } else if (j->fmt == SO_MXFP4) {
#if defined(SO_INT8DOT)
        dotq_mxfp4((const uint8_t *)w + (e * R + r) * (C / 2), (const uint8_t *)sc + (e * R + r) * (C / 32), 0, C,
                   (const int8_t *)X, ldx, n, acc);
#else
        SO_DOT(mxfp4)((const uint8_t *)w + (e * R + r) * (C / 2), (const uint8_t *)sc + (e * R + r) * (C / 32), 0, C,
                      (xptr)X, ldx, n, acc);
#endif
    } else {
        int64_t bn = j->block_n, bk = j->block_k, cols = (C + bk - 1) / bk;
        /* Block rows: w13 is [gate; up], each shard ceil(I / bn) block rows (vLLM's layout). */
        int64_t per_shard = (j->I + bn - 1) / bn, brow, rows;
        if (which) {
            brow = r / bn;
            rows = (j->H + bn - 1) / bn;
        } else {
            int64_t shard = r / j->I;
            brow = shard * per_shard + (r - shard * j->I) / bn;
            rows = 2 * per_shard;
        }
        SO_DOT(fp8)((const uint8_t *)w + (e * R + r) * C, (const float *)sc + (e * rows + brow) * cols, bk, C,
                    (xptr)X, ldx, n, acc);
    }
#undef SO_DOT
}

/* Where element k of a row of len elements sits in X, on this build's path. */
static inline int64_t slot_of(int fmt, int64_t k, int64_t len) {
#if defined(SO_BF16DOT)
    return perm16(fmt, k, len);
#else
    return fmt == SO_FP8_BLOCK ? k : perm32(k, len);
#endif
}

static inline float activate(const so_moe_job *j, float g, float u) {
    if (j->act == SO_SWIGLUOAI) {
        if (j->has_limit) {
            g = g < j->limit ? g : j->limit;
            u = u < -j->limit ? -j->limit : (u > j->limit ? j->limit : u);
        }
        return (u + 1.0f) * g / (1.0f + expf(-j->alpha * g));
    }
    if (j->act == SO_GELU_TANH)  /* torch's gelu(approximate="tanh"): 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) */
        return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g))) * u;
    return g / (1.0f + expf(-g)) * u;
}

/* ---------------- the call ---------------- */

/* Element i of the job's tokens as f32 (they come as bf16 or f32). */
static inline float token_f32(const so_moe_job *j, int64_t i) {
    return j->x_dtype == SO_DT_F32 ? ((const float *)j->x)[i] : bf16_to_f32(((const uint16_t *)j->x)[i]);
}

static int64_t align64(int64_t n) { return (n + 63) & ~(int64_t)63; }

int64_t so_moe_workspace_bytes(int64_t T, int64_t K, int64_t E, int64_t H, int64_t I) {
    int64_t P = T * K;
    return align64(T * H * 4) + align64(P * I * 4) + align64(P * 8) + align64(P * 4) + align64((E + 1) * 8) * 3 +
           align64(T * q8_bytes(H)) + align64(P * q8_bytes(I));
}

/* Activation rows per up-projection work item. An item reads its gate rows, then its up
 * rows: two sequential streams of JB rows each (swigluoai's interleaved pairs: one of 2 JB).
 * 32 rather than 8 makes each stream long enough for the hardware prefetcher to run ahead
 * (int4's 1 KB rows made 8 KB streams at 8): on a Zen 4 the kernel benchmark measured every
 * format faster with two threads, MXFP4 and int4 most. */
#define JB 32
/* Output rows per down-projection work item. An item reads each picked expert's rows of its
 * block one after another, so a block is that many short streams: 64 rows keep each long
 * enough for the prefetch to run ahead where rows are short (int4's Qwen3-30B-A3B rows of
 * 768 inputs are 384 bytes: the kernel benchmark's int4 layer measured faster than at 16). */
#define HB 64

/* A failed job, made loud. A CUDA host function cannot raise, and its caller does not wait
 * for it, so a failed job (1) fills its output with NaN, never leaving the previous step's
 * sums to be read as this one's, and (2) is counted process-wide (its status kept), which
 * Python reads at the next point it runs (cpu_kernels.raise_if_failed) and raises on. */
static int64_t so_failure_count = 0, so_failure_status = 0;
static void *so_failure_job = NULL;

static void so_fail(void *job, int64_t *status, int64_t code, float *out, int64_t n) {
    *status = code;
    for (int64_t i = 0; i < n; i++) out[i] = NAN;
    __atomic_store_n(&so_failure_status, code, __ATOMIC_SEQ_CST);
    __atomic_store_n(&so_failure_job, job, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&so_failure_count, 1, __ATOMIC_SEQ_CST);
}

/* Jobs failed in this process so far, the status of the last and its job's address (which
 * Python names the group of). */
int64_t so_failures(void) { return __atomic_load_n(&so_failure_count, __ATOMIC_SEQ_CST); }
int64_t so_last_failure(void) { return __atomic_load_n(&so_failure_status, __ATOMIC_SEQ_CST); }
void *so_last_failed_job(void) { return __atomic_load_n(&so_failure_job, __ATOMIC_SEQ_CST); }

/* One MoE job's parallel part: what each of its threads runs (pool.h), its inputs grouped
 * and converted by so_moe_job_run first. */
typedef struct {
    const so_moe_job *c;
    const char *xbase, *abase;
    int64_t xld, ald, xstep, astep;
    const int64_t *ptok;
    const float *pw;
    const int64_t *gexp, *gstart;
    float *actf;
    void *act;
    int8_t *Qa;
    int64_t jblocks, up_items, hblocks, ng, total;
    int fmt, q8;
    int64_t next_up, next_down;  /* the dynamic loops' next items */
} so_moe_work;

static void so_moe_work_run(void *arg, int tid, int nt) {
    so_moe_work *wk = (so_moe_work *)arg;
    const so_moe_job *c = wk->c;
    const int64_t I = c->I, H = c->H, jblocks = wk->jblocks, xld = wk->xld, ald = wk->ald;
    const int64_t xstep = wk->xstep, astep = wk->astep, *ptok = wk->ptok, *gexp = wk->gexp, *gstart = wk->gstart;
    const float *pw = wk->pw;
    const char *xbase = wk->xbase, *abase = wk->abase;
    const int fmt = wk->fmt, q8 = wk->q8;
    float *actf = wk->actf;
#if defined(SO_BF16DOT)
    typedef uint16_t xval;
#define SO_STORE(v) f32_to_bf16(v)
#else
    typedef float xval;
#define SO_STORE(v) (v)
#endif
    xval *act = (xval *)wk->act;
    float g[JB][NT], u[JB][NT], acc[NT];
    (void)tid;
    /* Up projection and activation: act[slot, i] for the slots of each expert. A work
     * item's gate rows are read one after another, then its up rows (two sequential
     * streams, not one row of each in turn). Dynamic: on a shared machine a descheduled
     * thread's share is taken by the others. */
    for (int64_t it; (it = so_next(&wk->next_up)) < wk->up_items;) {
        int64_t gi = it / jblocks, i0 = (it % jblocks) * JB, i1 = i0 + JB < I ? i0 + JB : I;
        int64_t e = gexp[gi], s0 = gstart[gi], s1 = gstart[gi + 1];
        int swiglu = c->act == SO_SWIGLUOAI;
        for (int64_t s = s0; s < s1; s += NT) {
            int n = s1 - s < NT ? (int)(s1 - s) : NT;
            /* Slots of consecutive tokens are consecutive rows of X, dotted together;
             * others one at a time. */
            int consecutive = 1;
            for (int q = 1; q < n; q++) consecutive &= ptok[s + q] == ptok[s] + q;
            /* Rows in memory order: silu's gate rows then its up rows, swigluoai's
             * interleaved pairs in turn. */
            for (int64_t step = 0; step < 2 * (i1 - i0); step++) {
                int64_t half = swiglu ? step % 2 : step / (i1 - i0);
                int64_t i = i0 + (swiglu ? step / 2 : step % (i1 - i0));
                int64_t r = swiglu ? 2 * i + half : i + half * I;
                float *dst = half ? u[i - i0] : g[i - i0];
                if (consecutive) {
                    dot_row(c, 0, e, r, xbase + ptok[s] * xstep, xld, n, dst);
                } else {
                    for (int q = 0; q < n; q++) dot_row(c, 0, e, r, xbase + ptok[s + q] * xstep, xld, 1, dst + q);
                }
            }
            for (int64_t i = i0; i < i1; i++) {
                int64_t rg = swiglu ? 2 * i : i, ru = swiglu ? 2 * i + 1 : I + i;
                float bg = load_bias(c->w13_bias, c->bias_dtype, e * 2 * I + rg);
                float bu = load_bias(c->w13_bias, c->bias_dtype, e * 2 * I + ru);
                int64_t slot = slot_of(fmt, i, I);
                for (int q = 0; q < n; q++) {
                    float v = activate(c, g[i - i0][q] + bg, u[i - i0][q] + bu);
                    if (q8)
                        actf[(s + q) * I + i] = v;  /* f32, quantised once the row is whole */
                    else
                        act[(s + q) * I + slot] = SO_STORE(v);
                }
            }
        }
    }
    SO_BARRIER(nt);
    /* The int8 path quantises each slot's whole activation row (static shares). */
#if defined(SO_INT8DOT)
    if (q8) {
        int64_t lo, hi;
        so_share(wk->total, tid, nt, &lo, &hi);
        for (int64_t s = lo; s < hi; s++) q8_quantize(fmt, actf + s * I, I, wk->Qa + s * q8_bytes(I));
        SO_BARRIER(nt);
    }
#endif
    /* Down projection: each block of output rows has one writer, and reads each expert's
     * rows of the block one after another. Dynamic, as above. */
    for (int64_t hb; (hb = so_next(&wk->next_down)) < wk->hblocks;) {
        int64_t h0 = hb * HB, h1 = h0 + HB < H ? h0 + HB : H;
        for (int64_t gi = 0; gi < wk->ng; gi++) {
            int64_t e = gexp[gi], s0 = gstart[gi], s1 = gstart[gi + 1];
            for (int64_t h = h0; h < h1; h++) {
                float b2 = load_bias(c->w2_bias, c->bias_dtype, e * H + h);
                for (int64_t s = s0; s < s1; s += NT) {
                    int n = s1 - s < NT ? (int)(s1 - s) : NT;
                    dot_row(c, 1, e, h, abase + s * astep, ald, n, acc);
                    for (int q = 0; q < n; q++)
                        c->out[ptok[s + q] * H + h] += pw[s + q] * (acc[q] + b2);
                }
            }
        }
    }
#undef SO_STORE
}

void so_moe_job_run(void *arg) {
    so_moe_job *j = (so_moe_job *)arg;
    int64_t T = j->T, K = j->K, E = j->E, H = j->H, I = j->I, P = T * K;
    j->status = 0;
    j->runs++;
    j->tokens += T;
    if (j->fmt < SO_BF16 || j->fmt > SO_INT4_F16 || j->act < SO_SILU || j->act > SO_GELU_TANH) {
        so_fail(j, &j->status, 3, j->out, T * H);
        return;
    }
    int64_t need = so_moe_workspace_bytes(T, K, E, H, I);
    char *ws = (char *)j->workspace, *own = NULL;
    if (!ws || j->workspace_bytes < need) {
        own = ws = (char *)malloc((size_t)need);
        if (!ws) { so_fail(j, &j->status, 2, j->out, T * H); return; }
    }
    float *xf = (float *)ws;
    ws += align64(T * H * 4);
    float *actf = (float *)ws;
    ws += align64(P * I * 4);
    int64_t *ptok = (int64_t *)ws;
    ws += align64(P * 8);
    float *pw = (float *)ws;
    ws += align64(P * 4);
    int64_t *count = (int64_t *)ws;
    ws += align64((E + 1) * 8);
    int64_t *gexp = (int64_t *)ws;
    ws += align64((E + 1) * 8);
    int64_t *gstart = (int64_t *)ws;
    ws += align64((E + 1) * 8);
    int8_t *Qx = (int8_t *)ws;  /* the int8 path's tokens and activations (MXFP4, int4) */
    ws += align64(T * q8_bytes(H));
    int8_t *Qa = (int8_t *)ws;

    /* Group the host's picks by expert (counting sort: stable, tokens ascending). */
    memset(count, 0, (size_t)(E + 1) * 8);
    for (int64_t p = 0; p < P; p++) {
        int64_t e = j->ids_i64 ? ((const int64_t *)j->topk_ids)[p] : ((const int32_t *)j->topk_ids)[p];
        if (e < 0) continue;
        if (e >= E) { so_fail(j, &j->status, 1, j->out, T * H); free(own); return; }
        if (j->host_mask && !j->host_mask[e]) continue;
        count[e]++;
    }
    int64_t ng = 0, total = 0;
    for (int64_t e = 0; e < E; e++) {
        if (!count[e]) continue;
        gexp[ng] = e;
        gstart[ng] = total;
        total += count[e];
        count[e] = gstart[ng];  /* now the next free slot */
        ng++;
    }
    gstart[ng] = total;
    j->experts_read += ng;
    for (int64_t p = 0; p < P; p++) {
        int64_t e = j->ids_i64 ? ((const int64_t *)j->topk_ids)[p] : ((const int32_t *)j->topk_ids)[p];
        if (e < 0 || (j->host_mask && !j->host_mask[e])) continue;
        int64_t slot = count[e]++;
        ptok[slot] = p / K;
        pw[slot] = j->topk_weights[p];
    }
    memset(j->out, 0, (size_t)(T * H * 4));
    if (total == 0) { free(own); return; }
    /* The tokens in the order the format's row walk reads them (perm32, perm16), or
     * quantised to int8 vectors (MXFP4 and int4 on the int8 paths). */
#if defined(SO_BF16DOT)
    typedef uint16_t xval;  /* X and the activation in bf16 */
#else
    typedef float xval;
#endif
    xval *X = (xval *)xf, *act = (xval *)actf;
    int fmt = (int)j->fmt;
#if defined(SO_INT8DOT)
    const int q8 = fmt == SO_MXFP4 || SO_IS_INT4(fmt);
    if (q8) {
        for (int64_t i = 0; i < T * H; i++) xf[i] = token_f32(j, i);
        for (int64_t t = 0; t < T; t++) q8_quantize(fmt, xf + t * H, H, Qx + t * q8_bytes(H));
    } else
#else
    const int q8 = 0;
#endif
    {
        for (int64_t t = 0; t < T; t++)
            for (int64_t k = 0; k < H; k++) {
                int64_t i = t * H + k;
                xval v;
#if defined(SO_BF16DOT)
                v = j->x_dtype == SO_DT_F32 ? f32_to_bf16(((const float *)j->x)[i]) : ((const uint16_t *)j->x)[i];
#else
                v = token_f32(j, i);
#endif
                X[t * H + slot_of(fmt, k, H)] = v;
            }
    }
    /* Where the row walks read their vectors: base, bytes between vectors, and the stride
     * dot_row takes (elements of the vector's type). */
    const char *xbase = q8 ? (const char *)Qx : (const char *)X, *abase = q8 ? (const char *)Qa : (const char *)act;
    const int64_t xld = q8 ? q8_bytes(H) : H, ald = q8 ? q8_bytes(I) : I, width = q8 ? 1 : (int64_t)sizeof(xval);
    const int64_t xstep = xld * width, astep = ald * width;

    int64_t jblocks = (I + JB - 1) / JB;
    so_moe_work work = {j, xbase, abase, xld, ald, xstep, astep, ptok, pw, gexp, gstart, actf, act, Qa,
                        jblocks, ng * jblocks, (H + HB - 1) / HB, ng, total, fmt, q8, 0, 0};
    int threads = j->threads > 0 ? (int)j->threads : 1;
    if (so_par(threads, so_moe_work_run, &work)) so_fail(j, &j->status, 4, j->out, T * H);
    free(own);
}

#include "rows_head.h"

/* Sum a buffer as floats with the same threads: the read bandwidth the kernel is judged
 * against (the caller times it). Each thread sums an even share of its 4096-float chunks. */
typedef struct {
    const float *f;
    int64_t n;
    double part[SO_POOL_MAX];
} so_read_work;

static void so_read_run(void *arg, int tid, int nt) {
    so_read_work *wk = (so_read_work *)arg;
    const float *f = wk->f;
    int64_t n = wk->n, lo, hi;
    double total = 0.0;
    so_share((n + 4095) / 4096, tid, nt, &lo, &hi);
    for (int64_t c = lo; c < hi; c++) {
        int64_t k = c * 4096, end = k + 4096 < n ? k + 4096 : n;
#if defined(SO_AVX512)
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (; k + 64 <= end; k += 64) {
            a0 = _mm512_add_ps(a0, _mm512_loadu_ps(f + k));
            a1 = _mm512_add_ps(a1, _mm512_loadu_ps(f + k + 16));
            a2 = _mm512_add_ps(a2, _mm512_loadu_ps(f + k + 32));
            a3 = _mm512_add_ps(a3, _mm512_loadu_ps(f + k + 48));
        }
        total += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#elif defined(SO_AVX2)
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (; k + 32 <= end; k += 32) {
            a0 = _mm256_add_ps(a0, _mm256_loadu_ps(f + k));
            a1 = _mm256_add_ps(a1, _mm256_loadu_ps(f + k + 8));
            a2 = _mm256_add_ps(a2, _mm256_loadu_ps(f + k + 16));
            a3 = _mm256_add_ps(a3, _mm256_loadu_ps(f + k + 24));
        }
        total += hsum256(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
        float s = 0.0f;
        for (; k < end; k++) s += f[k];
        total += s;
    }
    wk->part[tid] = total;
}

/* NaN when the threads could not be started. */
double so_read_sum(const void *buf, int64_t nbytes, int64_t threads) {
    int nt = threads > 0 ? (threads < SO_POOL_MAX ? (int)threads : SO_POOL_MAX) : 1;
    so_read_work *wk = (so_read_work *)calloc(1, sizeof(so_read_work));
    if (!wk) return NAN;
    wk->f = (const float *)buf;
    wk->n = nbytes / 4;
    double total = 0.0;
    if (so_par(nt, so_read_run, wk)) total = NAN;
    else
        for (int t = 0; t < nt; t++) total += wk->part[t];
    free(wk);
    return total;
}
