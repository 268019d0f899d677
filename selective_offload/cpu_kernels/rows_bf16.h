/* Part of moe.c's one translation unit (included once, by moe.c only): bf16 and block
 * FP8 rows dotted with bf16 vectors (vdpbf16ps). */

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

/* The bf16/fp8 row walk; pf: prefetch the bf16 weights ahead (a constant in each copy). */
static inline __attribute__((always_inline)) void dot16_core(int fmt, const void *row, const void *scale, int64_t bk,
                                                             int64_t len, const uint16_t *X, int64_t ldx, float *acc,
                                                             const int n, const int pf) {
    __m512 a[NT][4];
    for (int t = 0; t < n; t++)
        for (int q = 0; q < 4; q++) a[t][q] = _mm512_setzero_ps();
    int64_t k = 0;
    float s[NT] = {0};
    if (fmt == SO_BF16) {
        const uint16_t *w = (const uint16_t *)row;
        for (; k + 128 <= len; k += 128) {
            if (pf) PF(w + k), PF(w + k + 32), PF(w + k + 64), PF(w + k + 96);
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

#define dot16_n(fmt, row, scale, bk, len, X, ldx, acc, n) dot16_core(fmt, row, scale, bk, len, X, ldx, acc, n, 1)
#define dot16_stream(fmt, row, scale, bk, len, X, ldx, acc, n) dot16_core(fmt, row, scale, bk, len, X, ldx, acc, n, 0)
SO_ROWS_BY_N(dot16_bf16_pf, dot16_n, SO_BF16, uint16_t)
SO_ROWS_BY_N(dot16_bf16_stream, dot16_stream, SO_BF16, uint16_t)
SO_ROWS_BY_N(dot16_fp8, dot16_n, SO_FP8_BLOCK, uint16_t)

static void dot16_bf16(const void *row, const void *scale, int64_t bk, int64_t len, const uint16_t *X, int64_t ldx,
                       int n, float *acc) {
    if (so_bf16_pf) dot16_bf16_pf(row, scale, bk, len, X, ldx, n, acc);
    else dot16_bf16_stream(row, scale, bk, len, X, ldx, n, acc);
}
#endif
