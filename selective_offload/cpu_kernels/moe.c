/* Routed experts of one MoE layer computed on the host CPU (selective-offload's host-compute).
 *
 * Plain C with OpenMP, no torch headers: Python calls it through ctypes with raw pointers,
 * and a CUDA host function (cudaLaunchHostFunc) can call so_moe_job_run(job) with no Python,
 * which is what lets a captured CUDA graph run the host's experts.
 *
 * Why a kernel of our own: at decode a token reads k experts' weights once, so the time is
 * the bytes read over the host's read bandwidth, and only a kernel that dequantises in
 * registers while it streams the weights gets near that bandwidth. The weights are read
 * in the layouts vLLM's create_weights makes (before any post-processing), so the same
 * host tensors serve this kernel and the device's UVA path.
 *
 * out[t] = sum_j w[t,j] * (W2[e] @ act(W13[e] @ x[t] + b13[e]) + b2[e]), e = ids[t,j],
 * skipping picks whose id is negative or whose expert is not in the host set. Tokens are
 * grouped by expert so each expert's rows are read once per call whatever the batch. The
 * up projection is split over (expert, block of activation rows), then after a barrier the
 * down projection over blocks of output rows, so every output element has one writer.
 *
 * The SIMD path is picked at compile time by the -march=native macros: AVX-512 (F+BW+VL),
 * AVX2 with F16C and FMA, else plain C.
 */
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
 * weights are multiplied in bf16 (vdpbf16ps), MXFP4 weights in int8 (vpdpbusd). */
#if defined(SO_AVX512) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define SO_BF16DOT 1
#endif

enum { SO_BF16 = 0, SO_MXFP4 = 1, SO_FP8_BLOCK = 2 };
enum { SO_SILU = 0, SO_SWIGLUOAI = 1 };
enum { SO_DT_NONE = 0, SO_DT_BF16 = 1, SO_DT_F32 = 2 };

/* Everything one call needs; Python's MoEJob mirrors it field by field (checked by size). */
typedef struct {
    int64_t fmt, act, has_limit;
    float alpha, limit;
    int64_t T, K, E, H, I;          /* tokens, picks per token, experts, hidden, intermediate */
    int64_t block_n, block_k;       /* fp8-block scale block (rows, columns) */
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
    float *out;                     /* [T, H] f32, written whole */
    void *workspace;                /* so_moe_workspace_bytes(); NULL: allocated per call */
    int64_t workspace_bytes;
    int64_t status;                 /* 0 ok; 1 an id >= E; 2 out of memory; 3 bad format */
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

/* 1 where MXFP4 experts multiply int8 tokens and activations (the same path), else 0. */
int64_t so_int8_mxfp4(void) {
#if defined(SO_BF16DOT)
    return 1;
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

static inline float load_bias(const void *p, int64_t dtype, int64_t i) {
    if (dtype == SO_DT_BF16) return bf16_to_f32(((const uint16_t *)p)[i]);
    if (dtype == SO_DT_F32) return ((const float *)p)[i];
    return 0.0f;
}

/* ---------------- row dot products: acc[t] = row . X[t] for t < n (n <= NT) ----------------
 *
 * A row is walked 32 elements at a time; each step decodes them into f32 vectors (scaled)
 * and multiplies them with every token's vector. bf16 and mxfp4 keep their bytes in the
 * order they come and instead read X in a permuted order within each whole block of 32:
 * element 2i at slot i, element 2i+1 at slot 16 + i (perm32), because both store even and
 * odd elements together (the two halves of a 32-bit lane, the two nibbles of a byte) and
 * splitting them is cheaper than interleaving. fp8 reads X in natural order. A row's tail
 * past its last whole block of 32 is natural order in every format. */

#define NT 4
/* Bytes per 128 elements of an int8 vector for the MXFP4 path (its layout is described there). */
#define Q8_CHUNK 256
static inline int64_t q8_bytes(int64_t len) { return (len + 127) / 128 * Q8_CHUNK; }
/* Software prefetch this many bytes ahead of the weights being read: the rows a thread
 * walks follow each other in memory, and the hardware prefetcher alone leaves the loads
 * waiting on memory. A few rows ahead (rows are 1-6 KB in the layers benchmarked), not
 * one: with two threads sharing the memory system the nearer distance left both waiting
 * (benchmarks/bench_cpu_kernels.py measures it). */
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

/* Element k of a row, for the tail and the plain-C path. */
static inline float element(int fmt, const void *row, const void *scale, int64_t bk, int64_t k) {
    if (fmt == SO_BF16) return bf16_to_f32(((const uint16_t *)row)[k]);
    if (fmt == SO_MXFP4) {
        uint8_t b = ((const uint8_t *)row)[k / 2];
        return 0.5f * E2M1_X2[(k & 1) ? b >> 4 : b & 0xF] * e8m0(((const uint8_t *)scale)[k / 32]);
    }
    return e4m3_to_f32(((const uint8_t *)row)[k]) * ((const float *)scale)[k / bk];
}

#if defined(SO_AVX512)
/* 32 elements from k (a multiple of 32) as two vectors, for X slots [k, k+16) and [k+16, k+32). */
static inline __attribute__((always_inline)) void decode32(int fmt, const void *row, const void *scale, int64_t bk,
                                                           int64_t k, __m512 *w0, __m512 *w1) {
    if (fmt == SO_BF16) {
        __m512i v = _mm512_loadu_si512((const void *)((const uint16_t *)row + k));
        *w0 = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        *w1 = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
    } else if (fmt == SO_MXFP4) {
        static const float E2M1[16] = {0, .5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -.5f, -1, -1.5f, -2, -3, -4, -6};
        __m512 table = _mm512_mul_ps(_mm512_loadu_ps(E2M1), _mm512_set1_ps(e8m0(((const uint8_t *)scale)[k / 32])));
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)((const uint8_t *)row + k / 2)));
        __m512i lo = _mm512_and_si512(v, _mm512_set1_epi32(0xF)), hi = _mm512_srli_epi32(v, 4);
        *w0 = _mm512_permutexvar_ps(lo, table), *w1 = _mm512_permutexvar_ps(hi, table);
    } else {
        __m512i v = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)((const uint8_t *)row + k)));
        __m512i h = _mm512_and_si512(_mm512_slli_epi16(v, 7), _mm512_set1_epi16((short)0xBF80));
        __m512 s = _mm512_set1_ps(((const float *)scale)[k / bk] * 256.0f);
        *w0 = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), s);
        *w1 = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), s);
    }
}
#elif defined(SO_AVX2)
/* 32 elements from k as four vectors, for X slots k + 8q, q = 0..3. */
static inline __attribute__((always_inline)) void decode32(int fmt, const void *row, const void *scale, int64_t bk,
                                                           int64_t k, __m256 *w) {
    if (fmt == SO_BF16) {
        const uint16_t *p = (const uint16_t *)row + k;
        __m256i v0 = _mm256_loadu_si256((const __m256i *)p), v1 = _mm256_loadu_si256((const __m256i *)(p + 16));
        __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);
        w[0] = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));
        w[1] = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));
        w[2] = _mm256_castsi256_ps(_mm256_and_si256(v0, hi));
        w[3] = _mm256_castsi256_ps(_mm256_and_si256(v1, hi));
    } else if (fmt == SO_MXFP4) {
        const __m128i table = _mm_loadu_si128((const __m128i *)E2M1_X2), low4 = _mm_set1_epi8(0x0F);
        __m128i b = _mm_loadu_si128((const __m128i *)((const uint8_t *)row + k / 2));
        __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(b, low4));
        __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(b, 4), low4));
        __m256 s = _mm256_set1_ps(0.5f * e8m0(((const uint8_t *)scale)[k / 32]));
        w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), s);
        w[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), s);
        w[2] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), s);
        w[3] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), s);
    } else {
        const uint8_t *p = (const uint8_t *)row + k;
        __m256 s = _mm256_set1_ps(((const float *)scale)[k / bk] * 256.0f);
        for (int q = 0; q < 4; q++) {
            __m128i v = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(p + 8 * q)));
            __m128i h = _mm_and_si128(_mm_slli_epi16(v, 7), _mm_set1_epi16((short)0xBF80));
            w[q] = _mm256_mul_ps(_mm256_cvtph_ps(h), s);
        }
    }
}
#endif

static inline __attribute__((always_inline)) void dot_n(int fmt, const void *row, const void *scale, int64_t bk,
                                                        int64_t len, const float *X, int64_t ldx, float *acc,
                                                        const int n) {
    int64_t whole = len - len % 32, k = 0;
    float s[NT] = {0};
#if defined(SO_AVX512)
    __m512 a[NT][4];
    for (int t = 0; t < n; t++)
        for (int q = 0; q < 4; q++) a[t][q] = _mm512_setzero_ps();
    for (; k + 64 <= whole; k += 64) {
        __m512 w0, w1, w2, w3;
        decode32(fmt, row, scale, bk, k, &w0, &w1);
        decode32(fmt, row, scale, bk, k + 32, &w2, &w3);
        for (int t = 0; t < n; t++) {
            const float *x = X + t * ldx + k;
            a[t][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x), a[t][0]);
            a[t][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + 16), a[t][1]);
            a[t][2] = _mm512_fmadd_ps(w2, _mm512_loadu_ps(x + 32), a[t][2]);
            a[t][3] = _mm512_fmadd_ps(w3, _mm512_loadu_ps(x + 48), a[t][3]);
        }
    }
    for (; k < whole; k += 32) {
        __m512 w0, w1;
        decode32(fmt, row, scale, bk, k, &w0, &w1);
        for (int t = 0; t < n; t++) {
            const float *x = X + t * ldx + k;
            a[t][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x), a[t][0]);
            a[t][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + 16), a[t][1]);
        }
    }
    for (int t = 0; t < n; t++)
        s[t] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[t][0], a[t][1]), _mm512_add_ps(a[t][2], a[t][3])));
#elif defined(SO_AVX2)
    __m256 a[NT][2];
    for (int t = 0; t < n; t++) a[t][0] = a[t][1] = _mm256_setzero_ps();
    for (; k < whole; k += 32) {
        __m256 w[4];
        decode32(fmt, row, scale, bk, k, w);
        for (int t = 0; t < n; t++) {
            const float *x = X + t * ldx + k;
            a[t][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(x), a[t][0]);
            a[t][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x + 8), a[t][1]);
            a[t][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(x + 16), a[t][0]);
            a[t][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x + 24), a[t][1]);
        }
    }
    for (int t = 0; t < n; t++) {
        __m256 v = _mm256_add_ps(a[t][0], a[t][1]);
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        h = _mm_hadd_ps(h, h);
        h = _mm_hadd_ps(h, h);
        s[t] = _mm_cvtss_f32(h);
    }
#else
    for (; k < whole; k++) {
        float w = element(fmt, row, scale, bk, k);
        int64_t slot = fmt == SO_FP8_BLOCK ? k : perm32(k, len);
        for (int t = 0; t < n; t++) s[t] += w * X[t * ldx + slot];
    }
#endif
    for (; k < len; k++) {
        float w = element(fmt, row, scale, bk, k);
        for (int t = 0; t < n; t++) s[t] += w * X[t * ldx + k];
    }
    for (int t = 0; t < n; t++) acc[t] = s[t];
}

#define SO_DOT_FMT(NAME, FMT)                                                                              \
    static __attribute__((unused)) void NAME(const void *row, const void *scale, int64_t bk, int64_t len, const float *X, int64_t ldx, \
                     int n, float *acc) {                                                                  \
        switch (n) {                                                                                       \
            case 1: dot_n(FMT, row, scale, bk, len, X, ldx, acc, 1); break;                                \
            case 2: dot_n(FMT, row, scale, bk, len, X, ldx, acc, 2); break;                                \
            case 3: dot_n(FMT, row, scale, bk, len, X, ldx, acc, 3); break;                                \
            default: dot_n(FMT, row, scale, bk, len, X, ldx, acc, 4); break;                               \
        }                                                                                                  \
    }
SO_DOT_FMT(dot_bf16, SO_BF16)
SO_DOT_FMT(dot_mxfp4, SO_MXFP4)
SO_DOT_FMT(dot_fp8, SO_FP8_BLOCK)

/* ---------------- the AVX512-BF16 path: tokens and activations as bf16, f32 sums ----------------
 *
 * Where the CPU has AVX512_BF16 (and VNNI) bf16 and fp8 weights are decoded to bf16 (exact
 * for bf16 and e4m3 values) and multiplied with vdpbf16ps, which sums 32 products into 16
 * f32 lanes in one instruction: decoding to f32 first costs more instructions than reading
 * the bytes takes. The tokens (bf16 already, as vLLM passes them) and the activation
 * between the two projections are held in bf16, as vLLM's own kernels hold them on the
 * device; the sums are f32. The decoded words come out of the byte shuffles in a lane
 * order of their own, so X is stored in that order (perm16), and a row's tail past its
 * last whole chunk in natural order, summed in plain C. MXFP4 weights take the int8 path
 * below. */
#if defined(SO_BF16DOT)

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFF + ((u >> 16) & 1);  /* round to nearest even */
    return (uint16_t)(u >> 16);
}

/* Where element k of a row of len elements sits in X. */
static inline int64_t perm16(int fmt, int64_t k, int64_t len) {
    if (fmt == SO_FP8_BLOCK) {
        int64_t c64 = len / 64 * 64;
        if (k >= c64) return k;
        int64_t B = k / 64 * 64, e = k - B, l = e / 16, h = (e % 16) / 8, w = e % 8;
        return B + h * 32 + 8 * l + w;
    }
    return k;
}

static inline __m512 dp512(__m512 acc, __m512i a, const uint16_t *x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)_mm512_loadu_si512((const void *)x));
}

/* e4m3 subnormals (exponent 0) as bf16, by mantissa: m * 2^-9. */
static const uint8_t E4M3_SUB_HI[16] = {0x00, 0x3B, 0x3B, 0x3B, 0x3C, 0x3C, 0x3C, 0x3C};
static const uint8_t E4M3_SUB_LO[16] = {0x00, 0x00, 0x80, 0xC0, 0x00, 0x20, 0x40, 0x60};
#if defined(__AVX512VBMI__)
/* The bf16 bytes of each e4m3 magnitude (codes 0-127), exact: filled when the library loads. */
static uint8_t E4M3_BF16_HI[128], E4M3_BF16_LO[128];
__attribute__((constructor)) static void so_fill_e4m3_tables(void) {
    for (int c = 0; c < 128; c++) {
        uint16_t h = f32_to_bf16(e4m3_to_f32((uint8_t)c));
        E4M3_BF16_HI[c] = (uint8_t)(h >> 8), E4M3_BF16_LO[c] = (uint8_t)h;
    }
}
#endif

static inline __attribute__((always_inline)) void dot16_n(int fmt, const void *row, const void *scale, int64_t bk,
                                                          int64_t len, const uint16_t *X, int64_t ldx, float *acc,
                                                          const int n) {
    __m512 a[NT][4];
    for (int t = 0; t < n; t++)
        for (int q = 0; q < 4; q++) a[t][q] = _mm512_setzero_ps();
    int64_t k = 0;
    float s[NT] = {0};
    if (fmt == SO_BF16) {
        const uint16_t *w = (const uint16_t *)row;
        for (; k + 128 <= len; k += 128) {
            PF(w + k), PF(w + k + 32), PF(w + k + 64), PF(w + k + 96);
            __m512i w0 = _mm512_loadu_si512((const void *)(w + k)), w1 = _mm512_loadu_si512((const void *)(w + k + 32));
            __m512i w2 = _mm512_loadu_si512((const void *)(w + k + 64)), w3 = _mm512_loadu_si512((const void *)(w + k + 96));
            for (int t = 0; t < n; t++) {
                const uint16_t *x = X + t * ldx + k;
                a[t][0] = dp512(a[t][0], w0, x);
                a[t][1] = dp512(a[t][1], w1, x + 32);
                a[t][2] = dp512(a[t][2], w2, x + 64);
                a[t][3] = dp512(a[t][3], w3, x + 96);
            }
        }
        for (; k + 32 <= len; k += 32) {
            __m512i w0 = _mm512_loadu_si512((const void *)(w + k));
            for (int t = 0; t < n; t++) a[t][0] = dp512(a[t][0], w0, X + t * ldx + k);
        }
    } else {
        const uint8_t *q = (const uint8_t *)row;
        const float *sc = (const float *)scale;
        const __m512i sign = _mm512_set1_epi8((char)0x80);
#if defined(__AVX512VBMI__)
        /* Each code's bf16 bytes looked up from 128-entry tables (vpermi2b reads the low
         * seven bits: the magnitude), the sign put back: four operations for 64 codes. */
        const __m512i thi0 = _mm512_loadu_si512((const void *)E4M3_BF16_HI),
                      thi1 = _mm512_loadu_si512((const void *)(E4M3_BF16_HI + 64));
        const __m512i tlo0 = _mm512_loadu_si512((const void *)E4M3_BF16_LO),
                      tlo1 = _mm512_loadu_si512((const void *)(E4M3_BF16_LO + 64));
#else
        const __m512i seven = _mm512_set1_epi8(7), bias = _mm512_set1_epi8(60);
        const __m512i f0 = _mm512_set1_epi8((char)0xF0), e78 = _mm512_set1_epi8(0x78);
        const __m512i shi = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)E4M3_SUB_HI));
        const __m512i slo = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)E4M3_SUB_LO));
#endif
        if (bk % 64 == 0) {
            for (; k + 64 <= len; k += 64) {
                PF(q + k);
                __m512i v = _mm512_loadu_si512((const void *)(q + k));
#if defined(__AVX512VBMI__)
                __m512i hi = _mm512_or_si512(_mm512_permutex2var_epi8(thi0, v, thi1), _mm512_and_si512(v, sign));
                __m512i lo = _mm512_permutex2var_epi8(tlo0, v, tlo1);
#else
                __m512i sg = _mm512_and_si512(v, sign), m = _mm512_and_si512(v, seven);
                __m512i hi = _mm512_or_si512(sg, _mm512_add_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), seven), bias));
                __m512i lo = _mm512_and_si512(_mm512_slli_epi16(v, 4), f0);
                __mmask64 sub = _mm512_testn_epi8_mask(v, e78);
                hi = _mm512_mask_mov_epi8(hi, sub, _mm512_or_si512(_mm512_shuffle_epi8(shi, m), sg));
                lo = _mm512_mask_shuffle_epi8(lo, sub, slo, m);
#endif
                __m512i w0 = _mm512_unpacklo_epi8(lo, hi), w1 = _mm512_unpackhi_epi8(lo, hi);
                __m512 sv = _mm512_set1_ps(sc[k / bk]);
                for (int t = 0; t < n; t++) {
                    const uint16_t *x = X + t * ldx + k;
                    __m512 p = dp512(dp512(_mm512_setzero_ps(), w0, x), w1, x + 32);
                    a[t][0] = _mm512_fmadd_ps(p, sv, a[t][0]);
                }
            }
        }
    }
    for (int t = 0; t < n; t++)
        s[t] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[t][0], a[t][1]), _mm512_add_ps(a[t][2], a[t][3])));
    for (; k < len; k++) {  /* the tail, and fp8 rows whose scale block is not a multiple of 64 */
        float w = element(fmt, row, scale, bk, k);
        int64_t slot = perm16(fmt, k, len);
        for (int t = 0; t < n; t++) s[t] += w * bf16_to_f32(X[t * ldx + slot]);
    }
    for (int t = 0; t < n; t++) acc[t] = s[t];
}

#define SO_DOT16_FMT(NAME, FMT)                                                                               \
    static void NAME(const void *row, const void *scale, int64_t bk, int64_t len, const uint16_t *X, int64_t ldx, \
                     int n, float *acc) {                                                                     \
        switch (n) {                                                                                          \
            case 1: dot16_n(FMT, row, scale, bk, len, X, ldx, acc, 1); break;                                 \
            case 2: dot16_n(FMT, row, scale, bk, len, X, ldx, acc, 2); break;                                 \
            case 3: dot16_n(FMT, row, scale, bk, len, X, ldx, acc, 3); break;                                 \
            default: dot16_n(FMT, row, scale, bk, len, X, ldx, acc, 4); break;                                \
        }                                                                                                     \
    }
SO_DOT16_FMT(dot16_bf16, SO_BF16)
SO_DOT16_FMT(dot16_fp8, SO_FP8_BLOCK)

/* ---------------- MXFP4 in int8 (vpdpbusd) ----------------
 *
 * An e2m1 code times two is an integer in [-12, 12], so an MXFP4 row dotted with int8
 * vectors is exact integer arithmetic per block of 32, scaled once per block. The vector
 * (a token, or the activation between the projections) is quantised per block of 32 as
 * llama.cpp quantises it for the same weights (q8_0: the block's largest magnitude maps
 * to 127, rounded to nearest). Per 64 weight bytes this is two table lookups (vpshufb) and
 * two 64-byte multiply-adds: half the multiply instructions of decoding the codes to bf16
 * for vdpbf16ps, and a byte lookup the core issues more often than vpermw's word lookup
 * (benchmarks/bench_cpu_kernels.py measured the two ways side by side when this one
 * replaced the other).
 *
 * The vector is laid out per chunk of 128 elements (four blocks; 128-bit lane i of a
 * weight vector is block i) as Q8_CHUNK bytes: the blocks' even elements (the low
 * nibbles), their odd elements (the high nibbles), then 16 int32 and 16 f32 lanes aligned
 * with vpdpbusd's sums: -12 * the block's sum of codes in its first lane (vpdpbusd takes
 * the weights unsigned, as code + 12) and the block's scale / 2 in all four. A row's last
 * chunk may hold one to three blocks: the absent ones are zero throughout, and their
 * weight bytes and scales are loaded masked, so they add nothing. */
/* e2m1 code + 12 as an unsigned byte (the codes times two, offset to be unsigned). */
static const uint8_t E2M1_U8[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

/* x: len (a multiple of 32) floats in natural order; q: q8_bytes(len) bytes. */
static void q8_quantize(const float *x, int64_t len, int8_t *q) {
    memset(q, 0, (size_t)q8_bytes(len));
    for (int64_t b = 0; b < len / 32; b++) {
        const float *v = x + 32 * b;
        int8_t *c = q + b / 4 * Q8_CHUNK;
        int l = (int)(b % 4);
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(v[i]));
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f, half = 0.5f * (amax / 127.0f);
        int32_t sum = 0;
        for (int i = 0; i < 32; i++) {
            int qi = (int)nearbyintf(v[i] * inv);
            qi = qi > 127 ? 127 : (qi < -127 ? -127 : qi);
            c[(i & 1) * 64 + 16 * l + i / 2] = (int8_t)qi;
            sum += qi;
        }
        // mutation: mxfp4-q8-offset
        int32_t corr = -12 * sum;
        memcpy(c + 128 + 16 * l, &corr, 4);
        for (int m = 0; m < 4; m++) memcpy(c + 192 + 16 * l + 4 * m, &half, 4);
    }
}

static inline __attribute__((always_inline)) void dotq_n(const uint8_t *w, const uint8_t *sc, int64_t len,
                                                         const int8_t *Q, int64_t ldq, float *acc, const int n) {
    const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)E2M1_U8));
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    /* The chunk's four scale bytes, broadcast as one dword, rotated so that 128-bit lane i
     * holds byte i in the exponent field: 2^(s-127) with no shuffle (s = 0 reads as 0). */
    // mutation: mxfp4-scale-lanes
    const __m512i turn = _mm512_set_epi32(31, 31, 31, 31, 7, 7, 7, 7, 15, 15, 15, 15, 23, 23, 23, 23);
    const __m512i expo = _mm512_set1_epi32(0x7F800000);
    __m512 a[NT];
    for (int t = 0; t < n; t++) a[t] = _mm512_setzero_ps();
    for (int64_t k = 0; k < len; k += 128) {
        __m512i v;
        int32_t four;
        if (k + 128 <= len) {
            PF(w + k / 2);
            v = _mm512_loadu_si512((const void *)(w + k / 2));
            memcpy(&four, sc + k / 32, 4);
        } else {  /* the row's last 32, 64 or 96 elements */
            int64_t blocks = (len - k) / 32;
            v = _mm512_maskz_loadu_epi8(((__mmask64)1 << (16 * blocks)) - 1, (const void *)(w + k / 2));
            // mutation: mxfp4-scale-tail-unmasked
            four = _mm_cvtsi128_si32(_mm_maskz_loadu_epi8((__mmask16)((1u << blocks) - 1), (const void *)(sc + k / 32)));
        }
        // mutation: mxfp4-nibble-order
        __m512i lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(v, low4));
        __m512i hi = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
        __m512 sv = _mm512_castsi512_ps(_mm512_and_si512(_mm512_rolv_epi32(_mm512_set1_epi32(four), turn), expo));
        for (int t = 0; t < n; t++) {
            const int8_t *x = Q + t * ldq + k / 128 * Q8_CHUNK;
            __m512i d = _mm512_dpbusd_epi32(_mm512_loadu_si512((const void *)(x + 128)), lo,
                                            _mm512_loadu_si512((const void *)x));
            d = _mm512_dpbusd_epi32(d, hi, _mm512_loadu_si512((const void *)(x + 64)));
            a[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(sv, _mm512_loadu_ps((const float *)(x + 192))), a[t]);
        }
    }
    for (int t = 0; t < n; t++) acc[t] = _mm512_reduce_add_ps(a[t]);
}

static void dotq_mxfp4(const uint8_t *w, const uint8_t *sc, int64_t len, const int8_t *Q, int64_t ldq, int n,
                       float *acc) {
    switch (n) {
        case 1: dotq_n(w, sc, len, Q, ldq, acc, 1); break;
        case 2: dotq_n(w, sc, len, Q, ldq, acc, 2); break;
        case 3: dotq_n(w, sc, len, Q, ldq, acc, 3); break;
        default: dotq_n(w, sc, len, Q, ldq, acc, 4); break;
    }
}
#endif

/* Row r of matrix `which` (0: w13 [E, 2I, H], 1: w2 [E, H, I]) of expert e, dotted with n
 * vectors of X, ldx elements apart (f32; bf16 on the AVX512-BF16 path, int8 vectors of
 * q8_bytes each there for MXFP4). */
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
    } else if (j->fmt == SO_MXFP4) {
#if defined(SO_BF16DOT)
        dotq_mxfp4((const uint8_t *)w + (e * R + r) * (C / 2), (const uint8_t *)sc + (e * R + r) * (C / 32), C,
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
            // mutation: fp8-scale-block-index
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
            // mutation: swigluoai-clamp
            g = g < j->limit ? g : j->limit;
            u = u < -j->limit ? -j->limit : (u > j->limit ? j->limit : u);
        }
        return (u + 1.0f) * g / (1.0f + expf(-j->alpha * g));
    }
    return g / (1.0f + expf(-g)) * u;
}

/* ---------------- the call ---------------- */

static int64_t align64(int64_t n) { return (n + 63) & ~(int64_t)63; }

int64_t so_moe_workspace_bytes(int64_t T, int64_t K, int64_t E, int64_t H, int64_t I) {
    int64_t P = T * K;
    return align64(T * H * 4) + align64(P * I * 4) + align64(P * 8) + align64(P * 4) + align64((E + 1) * 8) * 3 +
           align64(T * q8_bytes(H)) + align64(P * q8_bytes(I));
}

#define JB 8   /* activation rows per up-projection work item */
#define HB 16  /* output rows per down-projection work item */

void so_moe_job_run(void *arg) {
    so_moe_job *j = (so_moe_job *)arg;
    int64_t T = j->T, K = j->K, E = j->E, H = j->H, I = j->I, P = T * K;
    j->status = 0;
    if (j->fmt < SO_BF16 || j->fmt > SO_FP8_BLOCK) { j->status = 3; return; }
    int64_t need = so_moe_workspace_bytes(T, K, E, H, I);
    char *ws = (char *)j->workspace, *own = NULL;
    if (!ws || j->workspace_bytes < need) {
        own = ws = (char *)malloc((size_t)need);
        if (!ws) { j->status = 2; return; }
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
    int8_t *Qx = (int8_t *)ws;  /* the MXFP4 path's int8 tokens and activations */
    ws += align64(T * q8_bytes(H));
    int8_t *Qa = (int8_t *)ws;

    /* Group the host's picks by expert (counting sort: stable, tokens ascending). */
    memset(count, 0, (size_t)(E + 1) * 8);
    for (int64_t p = 0; p < P; p++) {
        int64_t e = j->ids_i64 ? ((const int64_t *)j->topk_ids)[p] : ((const int32_t *)j->topk_ids)[p];
        if (e < 0) continue;
        if (e >= E) { j->status = 1; free(own); return; }
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
    for (int64_t p = 0; p < P; p++) {
        int64_t e = j->ids_i64 ? ((const int64_t *)j->topk_ids)[p] : ((const int32_t *)j->topk_ids)[p];
        if (e < 0 || (j->host_mask && !j->host_mask[e])) continue;
        int64_t slot = count[e]++;
        ptok[slot] = p / K;
        pw[slot] = j->topk_weights[p];
    }
    /* The tokens in the order the format's row walk reads them (perm32, perm16), or
     * quantised to int8 vectors (MXFP4 on the AVX512-BF16 path). */
#if defined(SO_BF16DOT)
    typedef uint16_t xval;  /* X and the activation in bf16 */
#define SO_STORE(v) f32_to_bf16(v)
#else
    typedef float xval;
#define SO_STORE(v) (v)
#endif
    xval *X = (xval *)xf, *act = (xval *)actf;
    int fmt = (int)j->fmt;
#if defined(SO_BF16DOT)
    const int q8 = fmt == SO_MXFP4;
#else
    const int q8 = 0;
#endif
    if (q8) {
        for (int64_t i = 0; i < T * H; i++)
            xf[i] = j->x_dtype == SO_DT_F32 ? ((const float *)j->x)[i] : bf16_to_f32(((const uint16_t *)j->x)[i]);
        for (int64_t t = 0; t < T; t++) q8_quantize(xf + t * H, H, Qx + t * q8_bytes(H));
    } else {
        for (int64_t t = 0; t < T; t++)
            for (int64_t k = 0; k < H; k++) {
                int64_t i = t * H + k;
                xval v;
#if defined(SO_BF16DOT)
                v = j->x_dtype == SO_DT_F32 ? f32_to_bf16(((const float *)j->x)[i]) : ((const uint16_t *)j->x)[i];
#else
                v = j->x_dtype == SO_DT_F32 ? ((const float *)j->x)[i] : bf16_to_f32(((const uint16_t *)j->x)[i]);
#endif
                X[t * H + slot_of(fmt, k, H)] = v;
            }
    }
    /* Where the row walks read their vectors: base, bytes between vectors, and the stride
     * dot_row takes (elements of the vector's type). */
    const char *xbase = q8 ? (const char *)Qx : (const char *)X, *abase = q8 ? (const char *)Qa : (const char *)act;
    const int64_t xstep = q8 ? q8_bytes(H) : H * (int64_t)sizeof(xval), xld = q8 ? q8_bytes(H) : H;
    const int64_t astep = q8 ? q8_bytes(I) : I * (int64_t)sizeof(xval), ald = q8 ? q8_bytes(I) : I;
    memset(j->out, 0, (size_t)(T * H * 4));
    if (total == 0) { free(own); return; }

    int64_t jblocks = (I + JB - 1) / JB, up_items = ng * jblocks, hblocks = (H + HB - 1) / HB;
    int threads = j->threads > 0 ? (int)j->threads : 1;
    const so_moe_job *c = j;
#pragma omp parallel num_threads(threads)
    {
        float g[JB][NT], u[JB][NT], acc[NT];
        /* Up projection and activation: act[slot, i] for the slots of each expert. A work
         * item's gate rows are read one after another, then its up rows (two sequential
         * streams, not one row of each in turn). */
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < up_items; it++) {
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
        /* (implicit barrier) The MXFP4 path quantises each slot's whole activation row. */
        if (q8) {
#pragma omp for schedule(static)
            for (int64_t s = 0; s < total; s++) q8_quantize(actf + s * I, I, Qa + s * q8_bytes(I));
        }
        /* (implicit barrier) Down projection: each block of output rows has one writer, and
         * reads each expert's rows of the block one after another. Dynamic: on a shared
         * machine a descheduled thread's share is taken by the others. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t hb = 0; hb < hblocks; hb++) {
            int64_t h0 = hb * HB, h1 = h0 + HB < H ? h0 + HB : H;
            for (int64_t gi = 0; gi < ng; gi++) {
                int64_t e = gexp[gi], s0 = gstart[gi], s1 = gstart[gi + 1];
                for (int64_t h = h0; h < h1; h++) {
                    float b2 = load_bias(c->w2_bias, c->bias_dtype, e * H + h);
                    for (int64_t s = s0; s < s1; s += NT) {
                        int n = s1 - s < NT ? (int)(s1 - s) : NT;
                        dot_row(c, 1, e, h, abase + s * astep, ald, n, acc);
                        for (int q = 0; q < n; q++)
                            // mutation: accumulate-topk-weight, accumulate-assign
                            c->out[ptok[s + q] * H + h] += pw[s + q] * (acc[q] + b2);
                    }
                }
            }
        }
    }
    free(own);
}

/* Sum a buffer as floats with the same threads: the read bandwidth the kernel is judged
 * against (the caller times it). */
double so_read_sum(const void *buf, int64_t nbytes, int64_t threads) {
    const float *f = (const float *)buf;
    int64_t n = nbytes / 4;
    double total = 0.0;
#pragma omp parallel num_threads((int)(threads > 0 ? threads : 1)) reduction(+ : total)
    {
#pragma omp for schedule(static)
        for (int64_t c = 0; c < (n + 4095) / 4096; c++) {
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
            __m256 v = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
            __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            h = _mm_hadd_ps(_mm_hadd_ps(h, h), _mm_hadd_ps(h, h));
            total += _mm_cvtss_f32(h);
#endif
            float s = 0.0f;
            for (; k < end; k++) s += f[k];
            total += s;
        }
    }
    return total;
}
