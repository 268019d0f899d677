/* Part of moe.c's one translation unit (included once, by moe.c only): the f32 row dot
 * products (AVX-512, AVX2, plain C), used where the CPU has no AVX512-BF16: for bf16 and
 * block FP8 on the SIMD builds (their MXFP4 and int4 take the int8 path, rows_int8.h), for
 * every format in plain C. */

#if defined(SO_AVX512)
/* 32 bf16 or block-FP8 elements from k (a multiple of 32) as two vectors, for X slots [k,
 * k+16) and [k+16, k+32). */
static inline __attribute__((always_inline)) void decode32(int fmt, const void *row, const void *scale, int64_t bk,
                                                           int64_t k, __m512 *w0, __m512 *w1) {
    if (fmt == SO_BF16) {
        __m512i v = _mm512_loadu_si512((const void *)((const uint16_t *)row + k));
        *w0 = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        *w1 = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
    } else {
        __m512i v = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)((const uint8_t *)row + k)));
        __m512i h = _mm512_and_si512(_mm512_slli_epi16(v, 7), _mm512_set1_epi16((short)0xBF80));
        __m512 s = _mm512_set1_ps(((const float *)scale)[k / bk] * 256.0f);
        *w0 = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), s);
        *w1 = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), s);
    }
}
#elif defined(SO_AVX2)
/* 32 bf16 or block-FP8 elements from k as four vectors, for X slots k + 8q, q = 0..3. */
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
    if (fmt == SO_FP8_BLOCK && bk % 32 == 0) {
        /* Block FP8: each scale block's products summed unscaled and scaled once, as on
         * 256 bits below (the decoded values are 2^-8 of the weights: decode32). */
        const uint8_t *q = (const uint8_t *)row;
        const float *sc = (const float *)scale;
        const __m512i keep = _mm512_set1_epi16((short)0xBF80);
        while (k < whole) {
            int64_t end = (k / bk + 1) * bk < whole ? (k / bk + 1) * bk : whole;
            __m512 b[NT][2];
            for (int t = 0; t < n; t++) b[t][0] = b[t][1] = _mm512_setzero_ps();
            for (; k < end; k += 32) {
                PF(q + k);
                __m512i v = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(q + k)));
                v = _mm512_and_si512(_mm512_slli_epi16(v, 7), keep);
                __m512 w0 = _mm512_cvtph_ps(_mm512_castsi512_si256(v)), w1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(v, 1));
                for (int t = 0; t < n; t++) {
                    const float *x = X + t * ldx + k;
                    b[t][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x), b[t][0]);
                    b[t][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + 16), b[t][1]);
                }
            }
            __m512 sv = _mm512_set1_ps(sc[(end - 1) / bk] * 256.0f);
            for (int t = 0; t < n; t++) a[t][0] = _mm512_fmadd_ps(_mm512_add_ps(b[t][0], b[t][1]), sv, a[t][0]);
        }
    }
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
    if (fmt == SO_FP8_BLOCK && bk % 32 == 0) {
        /* Block FP8: each scale block's products summed unscaled, then scaled once (the
         * decoded values are the e4m3 bits as fp16, 2^-8 of their value: see decode32),
         * and 16 codes widened per instruction: per weight byte half the instructions of
         * decoding 32 at a time with their scale. */
        const uint8_t *q = (const uint8_t *)row;
        const float *sc = (const float *)scale;
        const __m256i keep = _mm256_set1_epi16((short)0xBF80);
        while (k < whole) {
            int64_t end = (k / bk + 1) * bk < whole ? (k / bk + 1) * bk : whole;
            __m256 b[NT][2];
            for (int t = 0; t < n; t++) b[t][0] = b[t][1] = _mm256_setzero_ps();
            for (; k < end; k += 32) {
                PF(q + k);
                __m256i v0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + k)));
                __m256i v1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + k + 16)));
                v0 = _mm256_and_si256(_mm256_slli_epi16(v0, 7), keep);
                v1 = _mm256_and_si256(_mm256_slli_epi16(v1, 7), keep);
                __m256 w[4] = {_mm256_cvtph_ps(_mm256_castsi256_si128(v0)), _mm256_cvtph_ps(_mm256_extracti128_si256(v0, 1)),
                               _mm256_cvtph_ps(_mm256_castsi256_si128(v1)), _mm256_cvtph_ps(_mm256_extracti128_si256(v1, 1))};
                for (int t = 0; t < n; t++) {
                    const float *x = X + t * ldx + k;
                    b[t][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(x), b[t][0]);
                    b[t][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x + 8), b[t][1]);
                    b[t][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(x + 16), b[t][0]);
                    b[t][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x + 24), b[t][1]);
                }
            }
            __m256 sv = _mm256_set1_ps(sc[(end - 1) / bk] * 256.0f);
            for (int t = 0; t < n; t++) a[t][0] = _mm256_fmadd_ps(_mm256_add_ps(b[t][0], b[t][1]), sv, a[t][0]);
        }
    }
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
    for (int t = 0; t < n; t++) s[t] = hsum256(_mm256_add_ps(a[t][0], a[t][1]));
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

SO_ROWS_BY_N(dot_bf16, dot_n, SO_BF16, float)
SO_ROWS_BY_N(dot_fp8, dot_n, SO_FP8_BLOCK, float)
#if !defined(SO_INT8DOT)  /* plain C: MXFP4 and int4 decoded element by element */
SO_ROWS_BY_N(dot_mxfp4, dot_n, SO_MXFP4, float)
SO_ROWS_BY_N(dot_int4_bf16, dot_n, SO_INT4_BF16, float)
SO_ROWS_BY_N(dot_int4_f16, dot_n, SO_INT4_F16, float)
#endif
