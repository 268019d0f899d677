/* Part of moe.c's one translation unit (included once, by moe.c only): MXFP4 and int4 rows
 * dotted with int8 vectors: vpdpbusd on 512 bits where the CPU has AVX512-VNNI, and the
 * same sums on 256 bits elsewhere (AVX2, and AVX-512 without VNNI: below the 512-bit
 * kernels). */

#if defined(SO_INT8DOT)

/* ---------------- MXFP4 in int8 (vpdpbusd) ----------------
 *
 * An e2m1 code times two is an integer in [-12, 12], so an MXFP4 row dotted with int8
 * vectors is exact integer arithmetic per block of 32, scaled once per block. The vector
 * (a token, or the activation between the projections) is quantised per block of 32 as
 * llama.cpp quantises it for the same weights (q8_0: the block's largest magnitude maps
 * to 127, rounded to nearest). Per 64 weight bytes this is two table lookups (vpshufb) and
 * two 64-byte multiply-adds: half the multiply instructions of decoding the codes to bf16
 * for vdpbf16ps, and a byte lookup the core issues more often than vpermw's word lookup
 * (benchmarks/cpu_kernels/ measured the two ways side by side when this one
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

/* x: len (a multiple of 32) floats in natural order; q: q8_bytes(len) bytes, laid out for
 * fmt's weights: MXFP4 bytes are code + 12 and twice the value, int4 bytes the value + 8. */
static void q8_quantize(int fmt, const float *x, int64_t len, int8_t *q) {
    const int32_t offset = fmt == SO_MXFP4 ? 12 : 8;
    const float unit = fmt == SO_MXFP4 ? 0.5f : 1.0f;
    memset(q, 0, (size_t)q8_bytes(len));
    for (int64_t b = 0; b < len / 32; b++) {
        const float *v = x + 32 * b;
        int8_t *c = q + b / 4 * Q8_CHUNK;
        int l = (int)(b % 4);
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(v[i]));
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f, scale = unit * (amax / 127.0f);
        int32_t sum = 0;
        for (int i = 0; i < 32; i++) {
            int qi = (int)nearbyintf(v[i] * inv);
            qi = qi > 127 ? 127 : (qi < -127 ? -127 : qi);
            c[(i & 1) * 64 + 16 * l + i / 2] = (int8_t)qi;
            sum += qi;
        }
        int32_t corr = -offset * sum;
        memcpy(c + 128 + 16 * l, &corr, 4);
        for (int m = 0; m < 4; m++) memcpy(c + 192 + 16 * l + 4 * m, &scale, 4);
    }
}

#if defined(SO_INT8_512)
/* Independent sums per token: chunk c of a row adds into sum c % NA. With one sum per token
 * each chunk's multiply-add waits for the previous one, and while a chunk waits for its
 * weights from memory the chunks behind it queue on that chain instead of issuing their
 * loads: one core then streams far below its read bandwidth (on a Zen 4 core the kernel
 * benchmark measured the MXFP4 rows well under 0.6 of it with one sum, over with four).
 * int4 keeps one sum: on the benchmark's shorter rows four measured no faster. */
#define NA 4

/* One 128-element chunk of an MXFP4 row at element k (a whole chunk, or the row's last 32,
 * 64 or 96 elements, loaded masked), added into sums a[t * NA + q] for the n tokens. */
static inline __attribute__((always_inline)) void mxfp4_chunk(const uint8_t *w, const uint8_t *sc, int64_t k,
                                                              int64_t len, const int8_t *Q, int64_t ldq, __m512 *a,
                                                              const int q, const int n) {
    const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)E2M1_U8));
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    /* The chunk's four scale bytes, broadcast as one dword, rotated so that 128-bit lane i
     * holds byte i in the exponent field: 2^(s-127) with no shuffle (s = 0 reads as 0). */
    const __m512i turn = _mm512_set_epi32(31, 31, 31, 31, 7, 7, 7, 7, 15, 15, 15, 15, 23, 23, 23, 23);
    const __m512i expo = _mm512_set1_epi32(0x7F800000);
    __m512i v;
    int32_t four;
    if (k + 128 <= len) {
        PF(w + k / 2);
        v = _mm512_loadu_si512((const void *)(w + k / 2));
        memcpy(&four, sc + k / 32, 4);
    } else {  /* the row's last 32, 64 or 96 elements */
        int64_t blocks = (len - k) / 32;
        v = _mm512_maskz_loadu_epi8(((__mmask64)1 << (16 * blocks)) - 1, (const void *)(w + k / 2));
        four = _mm_cvtsi128_si32(_mm_maskz_loadu_epi8((__mmask16)((1u << blocks) - 1), (const void *)(sc + k / 32)));
    }
    __m512i lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(v, low4));
    __m512i hi = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
    __m512 sv = _mm512_castsi512_ps(_mm512_and_si512(_mm512_rolv_epi32(_mm512_set1_epi32(four), turn), expo));
    for (int t = 0; t < n; t++) {
        const int8_t *x = Q + t * ldq + k / 128 * Q8_CHUNK;
        __m512i d = _mm512_dpbusd_epi32(_mm512_loadu_si512((const void *)(x + 128)), lo,
                                        _mm512_loadu_si512((const void *)x));
        d = _mm512_dpbusd_epi32(d, hi, _mm512_loadu_si512((const void *)(x + 64)));
        a[t * NA + q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(sv, _mm512_loadu_ps((const float *)(x + 192))),
                                        a[t * NA + q]);
    }
}

/* The sums of each token, added up: acc[t]. */
static inline __attribute__((always_inline)) void sums_out(const __m512 *a, float *acc, const int n) {
    for (int t = 0; t < n; t++) {
        __m512 s = a[t * NA];
        for (int q = 1; q < NA; q++) s = _mm512_add_ps(s, a[t * NA + q]);
        acc[t] = _mm512_reduce_add_ps(s);
    }
}

/* The row kernels' common signature (SO_ROWS_BY_N); the format is MXFP4's and bk unused. */
static inline __attribute__((always_inline)) void dotq_n(int fmt, const void *row, const void *scale, int64_t bk,
                                                         int64_t len, const int8_t *Q, int64_t ldq, float *acc,
                                                         const int n) {
    (void)fmt, (void)bk;
    const uint8_t *w = (const uint8_t *)row, *sc = (const uint8_t *)scale;
    __m512 a[NT * NA];
    for (int i = 0; i < n * NA; i++) a[i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + NA * 128 <= len; k += NA * 128)
        for (int q = 0; q < NA; q++) mxfp4_chunk(w, sc, k + 128 * q, len, Q, ldq, a, q, n);
    for (; k < len; k += 128) mxfp4_chunk(w, sc, k, len, Q, ldq, a, 0, n);
    sums_out(a, acc, n);
}

SO_ROWS_BY_N(dotq_mxfp4, dotq_n, SO_MXFP4, int8_t)

/* ---------------- int4 (W4A16, symmetric groups or zero points) in int8 ----------------
 *
 * The same vectors and sums as MXFP4 with no table: a nibble is the value + 8 as an
 * unsigned byte already (GPTQ's uint4b8), so the block's sum of codes enters at -8 and
 * the vector's scale unhalved (q8_quantize by format). Each block of 32 is scaled by its
 * group's scale (bk columns per scale, a multiple of 32): one broadcast per chunk when
 * groups span whole chunks, else one per 128-bit lane. A group's zero point z other than 8
 * (AWQ) adds (8 - z) * the block's sum of codes: (z - 8) times the -8 * sum the vector
 * carries, over 8, in the sum's lane (one multiply per chunk, on that path only). */
static inline __attribute__((always_inline)) void dotq4_n(int fmt, const void *row, const void *scale, int64_t bk,
                                                          int64_t len, const int8_t *Q, int64_t ldq, float *acc,
                                                          const int n) {
    const uint8_t *w = (const uint8_t *)row;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i lanes = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const int whole = bk % 128 == 0, per_group = (int)(bk / 32), zeros = ((const so_int4_row *)scale)->z != NULL;
    int64_t group = 0, next = bk;  /* the chunk's group when groups span whole chunks (no division) */
    __m512 a[NT];
    for (int t = 0; t < n; t++) a[t] = _mm512_setzero_ps();
    for (int64_t k = 0; k < len; k += 128) {
        __m512i v;
        __m512 sv;
        __m512i zv = _mm512_setzero_si512();
        int64_t blocks = k + 128 <= len ? 4 : (len - k) / 32;
        if (blocks == 4) {
            PF(w + k / 2);
            v = _mm512_loadu_si512((const void *)(w + k / 2));
        } else {  /* the row's last 32, 64 or 96 elements */
            v = _mm512_maskz_loadu_epi8(((__mmask64)1 << (16 * blocks)) - 1, (const void *)(w + k / 2));
        }
        if (whole) {
            if (k == next) group++, next += bk;
            sv = _mm512_set1_ps(int4_scale(fmt, scale, group));
            if (zeros) zv = _mm512_set1_epi32(int4_zero(scale, group) - 8);
        } else {  /* groups of 32 or 64: block l's scale in lane l; absent blocks 0 */
            float f[4] = {0, 0, 0, 0};
            int32_t zl[4] = {0, 0, 0, 0};
            for (int l = 0; l < blocks; l++) {
                int64_t gi = (int)(k / 32 + l) / per_group;
                f[l] = int4_scale(fmt, scale, gi);
                if (zeros) zl[l] = int4_zero(scale, gi) - 8;
            }
            sv = _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(_mm_loadu_ps(f)));
            if (zeros)
                zv = _mm512_permutexvar_epi32(lanes, _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)zl)));
        }
        __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        for (int t = 0; t < n; t++) {
            const int8_t *x = Q + t * ldq + k / 128 * Q8_CHUNK;
            __m512i d = _mm512_dpbusd_epi32(_mm512_loadu_si512((const void *)(x + 128)), lo,
                                            _mm512_loadu_si512((const void *)x));
            d = _mm512_dpbusd_epi32(d, hi, _mm512_loadu_si512((const void *)(x + 64)));
            if (zeros)
                d = _mm512_add_epi32(
                    d, _mm512_mullo_epi32(zv, _mm512_srai_epi32(_mm512_loadu_si512((const void *)(x + 128)), 3)));
            __m512 bs = _mm512_mul_ps(sv, _mm512_loadu_ps((const float *)(x + 192)));
            a[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), bs, a[t]);
        }
    }
    for (int t = 0; t < n; t++) acc[t] = _mm512_reduce_add_ps(a[t]);
}

SO_ROWS_BY_N(dotq_int4_bf16, dotq4_n, SO_INT4_BF16, int8_t)
SO_ROWS_BY_N(dotq_int4_f16, dotq4_n, SO_INT4_F16, int8_t)
#else /* 256 bits: AVX2, or AVX-512 without VNNI */

/* ---------------- the same on 256 bits ----------------
 *
 * The vectors and sums of the AVX-512 kernels above, on 256 bits: a chunk of 128 elements
 * is two 32-byte halves (blocks 0-1, then 2-3; 128-bit lane l of a half is one block), and
 * q8_quantize's layout serves unchanged (each half's vector, sum and scale lanes are 32
 * contiguous bytes of the chunk's). The four-product sums per int32 lane that vpdpbusd
 * makes are vpmaddubsw (unsigned weight byte times signed vector byte, pairs added to
 * int16) then vpmaddwd by ones (pairs added to int32): no pair can saturate int16, as a
 * weight byte is at most 24 (MXFP4's code + 12) or 15 (int4) and a vector byte at most
 * 127 in magnitude (2 * 24 * 127 < 32767). With AVX-VNNI (Intel since Alder Lake) the one
 * instruction does it. It replaced decoding each code to a float and multiplying it (AVX2
 * has no float lookup wider than a byte shuffle) with a byte lookup and half a multiply per
 * weight byte: the kernel benchmark measured that decoding far under the read bandwidth on
 * AVX2 hosts. Each half sums into its own accumulator (two independent sums per token, as
 * the AVX-512 kernels keep four). */

/* a + the four-product sums of u (unsigned bytes) and s (signed bytes), per int32 lane. */
static inline __m256i dp4_256(__m256i a, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(a, u, s);
#else
    return _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* Half h of the chunk at k of a row of packed nibbles (w) with nb (1 or 2) of its blocks:
 * the low and high nibbles as bytes, the absent block's zero; the row's bytes past its
 * last block are not read. */
static inline __attribute__((always_inline)) void nibbles_half(const uint8_t *w, int64_t k, int h, int nb,
                                                               __m256i *lo, __m256i *hi) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const uint8_t *p = w + k / 2 + 32 * h;
    __m256i v = nb == 2 ? _mm256_loadu_si256((const __m256i *)p)
                        : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)p));
    *lo = _mm256_and_si256(v, low4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
}

/* The row's sums for the n vectors, added up: acc[t]. */
static inline __attribute__((always_inline)) void sums_out2(const __m256 *a, float *acc, const int n) {
    for (int t = 0; t < n; t++) acc[t] = hsum256(_mm256_add_ps(a[2 * t], a[2 * t + 1]));
}

/* The chunk's half h into the accumulators a[2t + h]. Called with h a constant (0, then 1
 * where the chunk has a third block), never in a loop over h: an accumulator indexed by a
 * variable lives in memory, and each of its sums then waits on a store and a load (the
 * AVX2 build's int4 and MXFP4 kernels ran at about half their rate so). */
static inline __attribute__((always_inline)) void mxfp4_half(const uint8_t *w, int64_t k, const int h, int nb,
                                                             __m256 s4, __m256i lut, const int8_t *Q, int64_t ldq,
                                                             __m256 *a, const int n) {
    const __m256i half0 = _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0), half1 = _mm256_set_epi32(3, 3, 3, 3, 2, 2, 2, 2);
    __m256i lo, hi;
    nibbles_half(w, k, h, nb, &lo, &hi);
    lo = _mm256_shuffle_epi8(lut, lo);
    hi = _mm256_shuffle_epi8(lut, hi);
    __m256 sv = _mm256_permutevar8x32_ps(s4, h ? half1 : half0);
    for (int t = 0; t < n; t++) {
        const int8_t *x = Q + t * ldq + k / 128 * Q8_CHUNK + 32 * h;
        __m256i d = dp4_256(_mm256_loadu_si256((const __m256i *)(x + 128)), lo,
                            _mm256_loadu_si256((const __m256i *)x));
        d = dp4_256(d, hi, _mm256_loadu_si256((const __m256i *)(x + 64)));
        a[2 * t + h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d),
                                       _mm256_mul_ps(sv, _mm256_loadu_ps((const float *)(x + 192))), a[2 * t + h]);
    }
}

static inline __attribute__((always_inline)) void dotq_n(int fmt, const void *row, const void *scale, int64_t bk,
                                                         int64_t len, const int8_t *Q, int64_t ldq, float *acc,
                                                         const int n) {
    (void)fmt, (void)bk;
    const uint8_t *w = (const uint8_t *)row, *sc = (const uint8_t *)scale;
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)E2M1_U8));
    __m256 a[2 * NT];
    for (int i = 0; i < 2 * n; i++) a[i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < len; k += 128) {
        int blocks = k + 128 <= len ? 4 : (int)((len - k) / 32);
        /* The chunk's scale bytes as 2^(s-127) in four lanes (s = 0 reads as 0; an absent
         * block's 0), then each half's two, one per 128-bit lane. */
        int32_t four = 0;
        if (blocks == 4) {
            PF(w + k / 2);
            memcpy(&four, sc + k / 32, 4);
        } else {
            memcpy(&four, sc + k / 32, (size_t)blocks);
        }
        __m256 s4 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_cvtsi32_si128(four)), 23));
        mxfp4_half(w, k, 0, blocks >= 2 ? 2 : 1, s4, lut, Q, ldq, a, n);
        if (blocks > 2) mxfp4_half(w, k, 1, blocks - 2, s4, lut, Q, ldq, a, n);
    }
    sums_out2(a, acc, n);
}

SO_ROWS_BY_N(dotq_mxfp4, dotq_n, SO_MXFP4, int8_t)

/* int4's half h, as mxfp4_half (h a constant): no table (a nibble is the value + 8
 * already), sv and zv the scale and the zero point less 8 of the half's blocks. */
static inline __attribute__((always_inline)) void int4_half(const uint8_t *w, int64_t k, const int h, int nb,
                                                            __m256 sv, __m256i zv, int zeros, const int8_t *Q,
                                                            int64_t ldq, __m256 *a, const int n) {
    __m256i lo, hi;
    nibbles_half(w, k, h, nb, &lo, &hi);
    for (int t = 0; t < n; t++) {
        const int8_t *x = Q + t * ldq + k / 128 * Q8_CHUNK + 32 * h;
        __m256i corr = _mm256_loadu_si256((const __m256i *)(x + 128));
        __m256i d = dp4_256(corr, lo, _mm256_loadu_si256((const __m256i *)x));
        d = dp4_256(d, hi, _mm256_loadu_si256((const __m256i *)(x + 64)));
        if (zeros) d = _mm256_add_epi32(d, _mm256_mullo_epi32(zv, _mm256_srai_epi32(corr, 3)));
        a[2 * t + h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d),
                                       _mm256_mul_ps(sv, _mm256_loadu_ps((const float *)(x + 192))), a[2 * t + h]);
    }
}

/* Groups of 32 or 64 columns: the scale and zero point less 8 of each of the half's nb
 * blocks, one per 128-bit lane (the absent block's 0). */
static inline __attribute__((always_inline)) void int4_half_groups(int fmt, const void *scale, int64_t bk, int64_t k,
                                                                   int h, int nb, int zeros, __m256 *sv, __m256i *zv) {
    float f[2] = {0, 0};
    int32_t z[2] = {0, 0};
    for (int l = 0; l < nb; l++) {
        int64_t gi = (k / 32 + 2 * h + l) * 32 / bk;
        f[l] = int4_scale(fmt, scale, gi);
        if (zeros) z[l] = int4_zero(scale, gi) - 8;
    }
    *sv = _mm256_set_m128(_mm_set1_ps(f[1]), _mm_set1_ps(f[0]));
    *zv = _mm256_set_m128i(_mm_set1_epi32(z[1]), _mm_set1_epi32(z[0]));
}

/* int4: the group's scale and zero point per block (moe.c's int4_scale, int4_zero), as the
 * AVX-512 kernel above. */
static inline __attribute__((always_inline)) void dotq4_n(int fmt, const void *row, const void *scale, int64_t bk,
                                                          int64_t len, const int8_t *Q, int64_t ldq, float *acc,
                                                          const int n) {
    const uint8_t *w = (const uint8_t *)row;
    const int zeros = ((const so_int4_row *)scale)->z != NULL, whole = bk % 128 == 0;
    int64_t group = 0, next = bk;  /* the chunk's group when groups span whole chunks (no division) */
    __m256 a[2 * NT];
    for (int i = 0; i < 2 * n; i++) a[i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < len; k += 128) {
        int blocks = k + 128 <= len ? 4 : (int)((len - k) / 32);
        if (blocks == 4) PF(w + k / 2);
        __m256 s0, s1 = _mm256_setzero_ps();
        __m256i z0 = _mm256_setzero_si256(), z1 = _mm256_setzero_si256();
        if (whole) {  /* one group for the whole chunk: its scale and zero point, once */
            if (k == next) group++, next += bk;
            s0 = s1 = _mm256_set1_ps(int4_scale(fmt, scale, group));
            if (zeros) z0 = z1 = _mm256_set1_epi32(int4_zero(scale, group) - 8);
        } else {  /* groups of 32 or 64: each block's own */
            int4_half_groups(fmt, scale, bk, k, 0, blocks >= 2 ? 2 : 1, zeros, &s0, &z0);
            if (blocks > 2) int4_half_groups(fmt, scale, bk, k, 1, blocks - 2, zeros, &s1, &z1);
        }
        int4_half(w, k, 0, blocks >= 2 ? 2 : 1, s0, z0, zeros, Q, ldq, a, n);
        if (blocks > 2) int4_half(w, k, 1, blocks - 2, s1, z1, zeros, Q, ldq, a, n);
    }
    sums_out2(a, acc, n);
}

SO_ROWS_BY_N(dotq_int4_bf16, dotq4_n, SO_INT4_BF16, int8_t)
SO_ROWS_BY_N(dotq_int4_f16, dotq4_n, SO_INT4_F16, int8_t)
#endif /* AVX-512 or AVX2 */
#endif
