/* GGUF's own quantized blocks (Q8_0, Q4_K, Q5_K, Q6_K) multiplied as they are: included at the
 * end of quant_matmul.c, whose helpers (group_sums, GROUP, the bf16 and half conversions) it
 * uses. A file of its own so that this kernel and the q4 one can change apart. */

/* ---- GGUF blocks as the file holds them: Q8_0, Q4_K, Q5_K, Q6_K --------------------------
 *
 * y = x W^T for W [N, K] kept as the GGUF file's own blocks, each row of W its K / QK blocks
 * back to back (the file's layout; the importer keeps them, store/gguf_import.py). A block's
 * weights are w = (d * sc) * q - (dmin * m) (Q4_K, Q5_K: 8 sub-blocks of 32, 6-bit sc and m),
 * (d * sc) * (q - 32) (Q6_K: 16 sub-blocks of 16, int8 sc) or d * q (Q8_0, blocks of 32), with
 * d and dmin float16. A block is taken in chunks of 32 weights (its inputs 32c..32c + 31): each
 * chunk's dot with x is scaled by its (d * sc), exact in float32 (kq_prep), and the (dmin * m)
 * part is taken as (dmin * m) * sum(x) per sub-block, from x's group sums. No weight and no x is
 * rounded; products are exact, sums float32, y rounded to bfloat16 once (float32 for the head).
 *
 *   AVX-512 BF16: a chunk's quants become the bfloat16 numbers q (Q6_K: q - 32), exact (integers
 *     below 2^8), by one vpermw / vpermt2w table lookup (Q8_0: through float32); vdpbf16ps
 *     multiplies them by x as it is, summing pairs into 16 float32 lanes, and one FMA per chunk
 *     adds those times the chunk's (d * sc) (Q6_K: lanes 0-7 and 8-15 have one each).
 *   AVX2, and AVX-512 without BF16: a chunk becomes 4 x 8 float32 weights (d * sc) * q, exact
 *     (at most 11 + 7 + 5 = 23 significant bits), by vector ops, for 8-lane FMAs with x in
 *     float32, two chains a row.
 *   Neither (the c build): plain C that unpacks a block to float32 and runs 16 lanes of FMAs.
 *
 * x in int16 (q4's gemm_int) was not needed: at one row of x, one thread takes 85-90 us for a
 * 1024 x 1024 Q4_K matrix, q4's AMX path 83 us for the same one in Q4_1, with x exact.
 *
 * Decode steps (up to KQ_FUSED_MAX_B rows of x) unpack each chunk into registers and take it to
 * every row of x at once, KQ_FUSED_ROWS rows of W together; prompts unpack a block of
 * KQ_TILE_ROWS rows of W once into a buffer and run every row of x through it. Either way each
 * y[b, n] is the same operations in the same order (per block: each chunk's dot in turn, then
 * the mins; the lanes summed at the end), so the kernel is batch invariant whatever the setting
 * (threads split W's rows, never x's). Measured against the plain C code it replaced, in a
 * Q4_K_M model's decode steps and in prompts: docs/performance.md, session 24. */

#define QK_K 256
enum { GGUF_Q8_0 = 8, GGUF_Q4_K = 12, GGUF_Q5_K = 13, GGUF_Q6_K = 14 };
/* The c build's: lanes of FMAs, and rows of W unpacked together (8 KiB of float32 weights, in
 * L1), so that each block of a row of x is read once per 8 rows of W rather than once per row */
#define KQ_LANES 16
#define KQ_TILE 8

/* weights per block and bytes per block of a GGUF type; 0 for one this code does not read */
int64_t gguf_block_size(int64_t type, int64_t *bytes)
{
    switch (type) {
    case GGUF_Q8_0: *bytes = 34; return 32;
    case GGUF_Q4_K: *bytes = 144; return QK_K;
    case GGUF_Q5_K: *bytes = 176; return QK_K;
    case GGUF_Q6_K: *bytes = 210; return QK_K;
    default: *bytes = 0; return 0;
    }
}

/* the float16 at p, which a block of 34 or 210 bytes may hold at an odd address */
INLINE float half_at(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, sizeof h);
#ifdef __F16C__
    return _cvtsh_ss(h); /* exact, as half_to_float */
#else
    return half_to_float(h);
#endif
}

/* Q4_K / Q5_K's 12 bytes of 6-bit scales and mins -> sc[8], m[8] (llama.cpp's get_scale_min_k4) */
INLINE void scale_min_k4(const uint8_t *s, uint8_t *sc, uint8_t *m)
{
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        m[j] = s[4 + j] & 63;
        sc[4 + j] = (uint8_t)((s[8 + j] & 0x0F) | ((s[j] >> 2) & 0x30));
        m[4 + j] = (uint8_t)((s[8 + j] >> 4) | ((s[4 + j] >> 2) & 0x30));
    }
}

/* One block -> its weights' (d * sc) * q parts in w (exact), and the (dmin * m) of each
 * sub-block of 32 in mins (Q4_K, Q5_K; the others have none). Returns the weights per block. */
INLINE int unpack_block(int type, const uint8_t *blk, float *w, float *mins)
{
    if (type == GGUF_Q8_0) {
        const float d = half_at(blk);
        const int8_t *q = (const int8_t *)(blk + 2);
        for (int i = 0; i < 32; i++)
            w[i] = d * (float)q[i];
        return 32;
    }
    if (type == GGUF_Q6_K) {
        const uint8_t *ql = blk, *qh = blk + 128;
        const int8_t *sc = (const int8_t *)(blk + 192);
        const float d = half_at(blk + 208);
        /* element 128h + 32s + i: low 4 bits from ql[64h + 32(s % 2) + i] (high nibble for
         * s >= 2), high 2 bits from qh[32h + i] >> 2s */
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 4; s++) {
                for (int half = 0; half < 2; half++) { /* the sub-blocks of 16 */
                    const int e0 = 128 * h + 32 * s + 16 * half;
                    const float ds = d * (float)sc[e0 / 16];
                    const uint8_t *l = ql + 64 * h + 32 * (s % 2) + 16 * half;
                    const uint8_t *u = qh + 32 * h + 16 * half;
                    for (int i = 0; i < 16; i++) {
                        const int lo = (l[i] >> (4 * (s / 2))) & 15, hi = (u[i] >> (2 * s)) & 3;
                        w[e0 + i] = ds * (float)((lo | (hi << 4)) - 32);
                    }
                }
            }
        return QK_K;
    }
    /* Q4_K, Q5_K: sub-block 2p + t from the low (t = 0) or high (t = 1) nibbles of qs[32p..];
     * Q5_K's fifth bit of sub-block j's element i is bit j of qh[i] */
    const float d = half_at(blk), dmin = half_at(blk + 2);
    uint8_t sc[8], m[8];
    scale_min_k4(blk + 4, sc, m);
    const int five = type == GGUF_Q5_K;
    const uint8_t *qh = blk + 16, *qs = blk + (five ? 48 : 16);
    for (int j = 0; j < 8; j++) {
        const float ds = d * (float)sc[j];
        mins[j] = dmin * (float)m[j];
        for (int i = 0; i < 32; i++) {
            int q = (qs[32 * (j / 2) + i] >> (4 * (j % 2))) & 15;
            if (five)
                q |= ((qh[i] >> j) & 1) << 4;
            w[32 * j + i] = ds * (float)q;
        }
    }
    return QK_K;
}

/* The per-block numbers a block's chunks are scaled by, in p[16]: Q4_K, Q5_K: the 8 (dmin * m)
 * in p[0..7] and the 8 (d * sc) in p[8..15]; Q6_K: its 16 (d * sc); Q8_0: d in p[0]. Each is
 * exact in float32 (a float16 times a 6- or 8-bit integer). */
#if defined(__AVX2__) && defined(__F16C__)
/* The 16 integers (Q6_K's int8 scales, or Q4_K's m0-7 then sc0-7: llama.cpp's
 * get_scale_min_k4 on the 32-bit words u0, u1, u2 at blk + 4) made in a register. Made as
 * bytes on the stack, they were stored 8 at a time and loaded 16 at a time, a load the CPU
 * cannot forward from the stores: a third of a Q4_K decode matmul's time on the AMX Xeon
 * (docs/performance.md, session 25). */
INLINE __m128i kq_ints(const int type, const uint8_t *blk)
{
    if (type == GGUF_Q6_K)
        return _mm_loadu_si128((const __m128i *)(blk + 192));
    const __m128i u = _mm_loadu_si128((const __m128i *)(blk + 4)); /* (4 bytes of qs spare) */
    const __m128i a = _mm_shuffle_epi32(u, _MM_SHUFFLE(2, 0, 2, 1));  /* u1, u2, u0, u2 */
    const __m128i b = _mm_shuffle_epi32(u, _MM_SHUFFLE(0, 0, 1, 1));  /* -, u1, -, u0 */
    const __m128i low = _mm_and_si128(_mm_srlv_epi32(a, _mm_setr_epi32(0, 4, 0, 0)),
                                      _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f,
                                                     0x0f0f0f0f));
    const __m128i high =
        _mm_and_si128(_mm_srli_epi32(b, 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
    return _mm_or_si128(low, high);
}

INLINE void kq_prep(const int type, const uint8_t *blk, float *p)
{
    if (type == GGUF_Q8_0) {
        p[0] = half_at(blk);
        return;
    }
    const __m128i v = kq_ints(type, blk);
    /* what b[8..15] and b[0..7] are multiplied by */
    const float d = type == GGUF_Q6_K ? half_at(blk + 208) : half_at(blk);
    const float lo = type == GGUF_Q6_K ? d : half_at(blk + 2);
#if defined(__AVX512F__)
    const __m512i i = type == GGUF_Q6_K ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v);
    const __m512 f = _mm512_insertf32x8(_mm512_set1_ps(lo), _mm256_set1_ps(d), 1);
    _mm512_storeu_ps(p, _mm512_mul_ps(_mm512_cvtepi32_ps(i), f));
    /* p kept in memory: each chunk's FMA then broadcasts its number from there (on a load
     * port), where from a register each broadcast is a shuffle on the port the unpacking
     * already fills (a fifth of the kernel's time on the AMX Xeon; docs/performance.md,
     * session 25) */
    __asm__("" : "+m"(*(float(*)[16])p));
#else
    for (int h = 0; h < 2; h++) {
        const __m128i part = h ? _mm_srli_si128(v, 8) : v;
        const __m256i i =
            type == GGUF_Q6_K ? _mm256_cvtepi8_epi32(part) : _mm256_cvtepu8_epi32(part);
        const __m256 f = _mm256_set1_ps(h ? d : lo);
        _mm256_storeu_ps(p + 8 * h, _mm256_mul_ps(_mm256_cvtepi32_ps(i), f));
    }
#endif
}
#endif /* (the c build has no kq_prep: gguf_matmul_c unpacks whole blocks) */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__F16C__)
/* With AVX-512 BF16: each chunk of 32 quants becomes the bfloat16 numbers q (Q6_K: q - 32),
 * exact (integers below 2^8), by a table lookup (vpermw); vdpbf16ps multiplies them by x as it
 * is (bfloat16) in pairs, exact products summed in float32 lanes (lane i: inputs 2i, 2i + 1),
 * and one FMA per chunk scales the 16 lanes by the chunk's (d * sc): x is never rounded. */
#define KQ_SIMD 1
#define KQ_X_F32 0 /* x read as bfloat16 */
typedef __m512 kq_acc;
typedef struct {
    __m512bh q;
    __m512 s;
} kq_chunk;
typedef __m512bh kq_x;
typedef struct {
    __m512i pos, neg; /* bfloat16 0..31 and -32..-1, for vpermw / vpermt2w */
} kq_tables;

INLINE kq_tables kq_make_tables(void)
{
    const __m512 i0 = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 i16 = _mm512_add_ps(i0, _mm512_set1_ps(16.f));
    const __m512 m32 = _mm512_set1_ps(-32.f);
    kq_tables t;
    t.pos = (__m512i)_mm512_cvtne2ps_pbh(i16, i0);
    t.neg = (__m512i)_mm512_cvtne2ps_pbh(_mm512_add_ps(i16, m32), _mm512_add_ps(i0, m32));
    return t;
}

/* 32 bytes at p -> 32 16-bit lanes */
INLINE __m512i kq_bytes16(const uint8_t *p)
{
    return _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
}

/* chunk c (32 weights, inputs 32c..32c + 31 of the block) of a block with numbers p */
INLINE kq_chunk kq_unpack(const int type, const uint8_t *blk, const float *p, const int c,
                          kq_tables t)
{
    kq_chunk ch;
    if (type == GGUF_Q8_0) {
        const __m128i q0 = _mm_loadu_si128((const __m128i *)(blk + 2));
        const __m128i q1 = _mm_loadu_si128((const __m128i *)(blk + 18));
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1));
        ch.q = _mm512_cvtne2ps_pbh(hi, lo);
        ch.s = _mm512_set1_ps(p[0]);
        return ch;
    }
    if (type == GGUF_Q6_K) {
        /* chunk c = 4h + s: low 4 bits from ql[64h + 32(s % 2) + i] (high nibble for s >= 2),
         * high 2 bits from qh[32h + i] >> 2s; lanes 0-7 are sub-block 2c, 8-15 2c + 1 */
        const int h = c / 4, s = c % 4;
        const __m512i l = kq_bytes16(blk + 64 * h + 32 * (s % 2));
        const __m512i u = kq_bytes16(blk + 128 + 32 * h);
        const __m512i lo =
            s < 2 ? _mm512_and_si512(l, _mm512_set1_epi16(15)) : _mm512_srli_epi16(l, 4);
        const __m512i up = s < 2 ? _mm512_slli_epi16(u, 4 - 2 * s)
                                 : (s == 2 ? u : _mm512_srli_epi16(u, 2));
        const __m512i q = _mm512_ternarylogic_epi32(lo, up, _mm512_set1_epi16(0x30), 0xF8);
        ch.q = (__m512bh)_mm512_permutex2var_epi16(t.neg, q, t.pos);
        const int a = 2 * c, b = 2 * c + 1;
        const __m512i idx = _mm512_setr_epi32(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b);
        ch.s = _mm512_permutexvar_ps(idx, _mm512_loadu_ps(p));
        return ch;
    }
    /* Q4_K, Q5_K: sub-block c from the low (c even) or high nibbles of qs[32(c / 2)..]; Q5_K's
     * fifth bit is bit c of qh[i] */
    const int five = type == GGUF_Q5_K;
    const __m512i v = kq_bytes16(blk + (five ? 48 : 16) + 32 * (c / 2));
    __m512i q = c % 2 ? _mm512_srli_epi16(v, 4) : _mm512_and_si512(v, _mm512_set1_epi16(15));
    if (five) {
        const __m512i u = kq_bytes16(blk + 16);
        const __m512i bit = c <= 4 ? _mm512_slli_epi16(u, 4 - c) : _mm512_srli_epi16(u, c - 4);
        q = _mm512_ternarylogic_epi32(q, bit, _mm512_set1_epi16(0x10), 0xF8); /* q | (bit & 16) */
    }
    ch.q = (__m512bh)_mm512_permutexvar_epi16(q, t.pos);
    ch.s = _mm512_set1_ps(p[8 + c]);
    return ch;
}

INLINE kq_x kq_load_x(const uint16_t *x, const float *xf, int64_t at)
{
    (void)xf;
    return (__m512bh)_mm512_loadu_si512((const void *)(x + at));
}

INLINE kq_acc kq_zero(void) { return _mm512_setzero_ps(); }

INLINE kq_acc kq_madd(kq_acc acc, kq_chunk ch, kq_x x)
{
    return _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), ch.q, x), ch.s, acc);
}

/* acc - sum_j (dmin * m_j) * xs_j: the mins in lanes 0-7 (p[8..15] meet zeros) */
INLINE kq_acc kq_mins(kq_acc acc, const float *p, const float *xs)
{
    const __m512 sums = _mm512_zextps256_ps512(_mm256_loadu_ps(xs));
    return _mm512_fnmadd_ps(_mm512_loadu_ps(p), sums, acc);
}

INLINE float kq_sum(kq_acc acc) { return _mm512_reduce_add_ps(acc); }

#ifndef KQ_FUSED_ROWS
#define KQ_FUSED_ROWS 4 /* rows of W a fused pass takes at once */
#endif
#define KQ_TILE_ROWS 8 /* rows of W a tiled pass unpacks together */
#ifndef KQ_FUSED_MAX_B
#define KQ_FUSED_MAX_B 4 /* rows of x up to which chunks go straight from memory into the dots */
#endif

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* With AVX2 (and AVX-512 without BF16): each chunk of 32 quants becomes 4 x 8 float32 weights
 * (d * sc) * q, exact, and 8-lane FMAs with x in float32 sum them, in two chains per row. */
#define KQ_SIMD 1
#define KQ_X_F32 1
typedef struct {
    __m256 a[2];
} kq_acc;
typedef struct {
    __m256 w[4];
} kq_chunk;
typedef struct {
    __m256 v[4];
} kq_x;
typedef int kq_tables;

INLINE kq_tables kq_make_tables(void) { return 0; }

INLINE __m256i kq_bytes32(const uint8_t *p) /* 8 bytes at p -> 8 32-bit lanes */
{
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

INLINE kq_chunk kq_unpack(const int type, const uint8_t *blk, const float *p, const int c,
                          kq_tables t)
{
    (void)t;
    kq_chunk ch;
    for (int m = 0; m < 4; m++) {
        __m256i q;
        float s;
        if (type == GGUF_Q8_0) {
            q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * m)));
            s = p[0];
        } else if (type == GGUF_Q6_K) { /* as in unpack_block */
            const int h = c / 4, sb = c % 4;
            const __m256i l = kq_bytes32(blk + 64 * h + 32 * (sb % 2) + 8 * m);
            const __m256i u = kq_bytes32(blk + 128 + 32 * h + 8 * m);
            const __m256i lo =
                sb < 2 ? _mm256_and_si256(l, _mm256_set1_epi32(15)) : _mm256_srli_epi32(l, 4);
            const __m256i up = sb < 2 ? _mm256_slli_epi32(u, 4 - 2 * sb)
                                      : (sb == 2 ? u : _mm256_srli_epi32(u, 2));
            q = _mm256_sub_epi32(
                _mm256_or_si256(lo, _mm256_and_si256(up, _mm256_set1_epi32(0x30))),
                _mm256_set1_epi32(32));
            s = p[2 * c + m / 2];
        } else {
            const int five = type == GGUF_Q5_K;
            const __m256i v = kq_bytes32(blk + (five ? 48 : 16) + 32 * (c / 2) + 8 * m);
            q = c % 2 ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(15));
            if (five) {
                const __m256i u = kq_bytes32(blk + 16 + 8 * m);
                const __m256i bit =
                    c <= 4 ? _mm256_slli_epi32(u, 4 - c) : _mm256_srli_epi32(u, c - 4);
                q = _mm256_or_si256(q, _mm256_and_si256(bit, _mm256_set1_epi32(16)));
            }
            s = p[8 + c];
        }
        ch.w[m] = _mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(s));
    }
    return ch;
}

INLINE kq_x kq_load_x(const uint16_t *x, const float *xf, int64_t at)
{
    (void)x;
    kq_x v;
    for (int m = 0; m < 4; m++)
        v.v[m] = _mm256_loadu_ps(xf + at + 8 * m);
    return v;
}

INLINE kq_acc kq_zero(void)
{
    kq_acc a;
    a.a[0] = a.a[1] = _mm256_setzero_ps();
    return a;
}

INLINE kq_acc kq_madd(kq_acc acc, kq_chunk ch, kq_x x)
{
    for (int m = 0; m < 4; m++)
        acc.a[m % 2] = _mm256_fmadd_ps(ch.w[m], x.v[m], acc.a[m % 2]);
    return acc;
}

INLINE kq_acc kq_mins(kq_acc acc, const float *p, const float *xs)
{
    acc.a[0] = _mm256_fnmadd_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(xs), acc.a[0]);
    return acc;
}

INLINE float kq_sum(kq_acc acc) { return lanes_sum8(_mm256_add_ps(acc.a[0], acc.a[1])); }

#define KQ_FUSED_ROWS 2
#define KQ_TILE_ROWS 4
#ifndef KQ_FUSED_MAX_B
#define KQ_FUSED_MAX_B 1
#endif
#endif

#ifdef KQ_SIMD
#ifndef KQ_PREFETCH_ROWS
#define KQ_PREFETCH_ROWS 8
#endif
/* The SIMD paths: each output y[b, n] is sum over W's blocks k, in order, of its chunks' dots
 * (kq_madd), then the block's mins (kq_mins), summed across lanes at the end: the same operations
 * whatever B and however the rows are grouped, so batch invariant. */

INLINE void kq_store(void *y, int64_t at, float v, int64_t f32)
{
    if (f32)
        ((float *)y)[at] = v;
    else
        ((uint16_t *)y)[at] = float_to_bf16(v);
}

/* R rows of W from n0 against B rows of x (R, B constants at each call), each chunk unpacked
 * into registers and taken by every row of x at once: decode steps. */
INLINE void kq_fused(const int type, const int R, const int B, const uint16_t *x,
                     const float *xf, const float *xs, const uint8_t *w, int64_t row_bytes,
                     int64_t block_bytes, int64_t qk, void *y, int64_t n0, int64_t N,
                     int64_t K, int64_t f32, kq_tables t)
{
    const int chunks = type == GGUF_Q8_0 ? 1 : 8, mins = type == GGUF_Q4_K || type == GGUF_Q5_K;
    const int64_t blocks = K / qk, G = K / 32;
    kq_acc acc[KQ_FUSED_MAX_B][KQ_FUSED_ROWS];
    for (int b = 0; b < B; b++)
        for (int r = 0; r < R; r++)
            acc[b][r] = kq_zero();
    /* the rows KQ_PREFETCH_ROWS on (a later pass's, in this thread's range: static schedule),
     * spread over this pass's blocks, so that memory is read while this pass computes */
    const uint8_t *ahead = w + (n0 + KQ_PREFETCH_ROWS) * row_bytes;
    const int64_t ahead_bytes = (int64_t)R * block_bytes; /* per block of this pass */
    for (int64_t k = 0; k < blocks; k++) {
        const uint8_t *blk[KQ_FUSED_ROWS];
        float p[KQ_FUSED_ROWS][16];
        if (KQ_PREFETCH_ROWS)
            for (int64_t o = 0; o < ahead_bytes; o += 64)
                __builtin_prefetch(ahead + k * ahead_bytes + o, 0, 3);
        for (int r = 0; r < R; r++) {
            blk[r] = w + (n0 + r) * row_bytes + k * block_bytes;
            kq_prep(type, blk[r], p[r]);
        }
#pragma GCC unroll 8
        for (int c = 0; c < chunks; c++) {
            kq_x xv[KQ_FUSED_MAX_B];
            for (int b = 0; b < B; b++)
                xv[b] = kq_load_x(x, xf, b * K + k * qk + 32 * c);
            for (int r = 0; r < R; r++) {
                const kq_chunk ch = kq_unpack(type, blk[r], p[r], c, t);
                for (int b = 0; b < B; b++)
                    acc[b][r] = kq_madd(acc[b][r], ch, xv[b]);
            }
        }
        if (mins)
            for (int b = 0; b < B; b++)
                for (int r = 0; r < R; r++)
                    acc[b][r] = kq_mins(acc[b][r], p[r], xs + b * G + k * 8);
    }
    for (int b = 0; b < B; b++)
        for (int r = 0; r < R; r++)
            kq_store(y, b * N + n0 + r, kq_sum(acc[b][r]), f32);
}

/* KQ_TILE rows of W from n0 against B rows of x: each block of the rows unpacked once into
 * `buf`, then every row of x through it, the sums kept in `acc` [B][KQ_TILE] between blocks:
 * prompts. */
INLINE void kq_tiled(const int type, const uint16_t *x, const float *xf, const float *xs,
                     const uint8_t *w, int64_t row_bytes, int64_t block_bytes, int64_t qk,
                     void *y, int64_t n0, int64_t rows, int64_t B, int64_t N, int64_t K,
                     int64_t f32, kq_tables t, kq_chunk *buf, kq_acc *acc)
{
    const int chunks = type == GGUF_Q8_0 ? 1 : 8, mins = type == GGUF_Q4_K || type == GGUF_Q5_K;
    const int64_t blocks = K / qk, G = K / 32;
    float p[KQ_TILE_ROWS][16];
    for (int64_t i = 0; i < B * KQ_TILE_ROWS; i++)
        acc[i] = kq_zero();
    for (int64_t k = 0; k < blocks; k++) {
        for (int64_t r = 0; r < rows; r++) {
            const uint8_t *blk = w + (n0 + r) * row_bytes + k * block_bytes;
            kq_prep(type, blk, p[r]);
#pragma GCC unroll 8
            for (int c = 0; c < chunks; c++)
                buf[r * 8 + c] = kq_unpack(type, blk, p[r], c, t);
        }
        for (int64_t b = 0; b < B; b++) {
            kq_acc *a = acc + b * KQ_TILE_ROWS;
            if (rows == KQ_TILE_ROWS) { /* the common case, with the sums in registers */
                kq_acc s[KQ_TILE_ROWS];
                for (int r = 0; r < KQ_TILE_ROWS; r++)
                    s[r] = a[r];
#pragma GCC unroll 8
                for (int c = 0; c < chunks; c++) {
                    const kq_x xv = kq_load_x(x, xf, b * K + k * qk + 32 * c);
                    for (int r = 0; r < KQ_TILE_ROWS; r++)
                        s[r] = kq_madd(s[r], buf[r * 8 + c], xv);
                }
                if (mins)
                    for (int r = 0; r < KQ_TILE_ROWS; r++)
                        s[r] = kq_mins(s[r], p[r], xs + b * G + k * 8);
                for (int r = 0; r < KQ_TILE_ROWS; r++)
                    a[r] = s[r];
                continue;
            }
            for (int64_t r = 0; r < rows; r++) {
                for (int c = 0; c < chunks; c++)
                    a[r] = kq_madd(a[r], buf[r * 8 + c], kq_load_x(x, xf, b * K + k * qk + 32 * c));
                if (mins)
                    a[r] = kq_mins(a[r], p[r], xs + b * G + k * 8);
            }
        }
    }
    for (int64_t b = 0; b < B; b++)
        for (int64_t r = 0; r < rows; r++)
            kq_store(y, b * N + n0 + r, kq_sum(acc[b * KQ_TILE_ROWS + r]), f32);
}

/* The fused pass of rows n0.. (R of them) for B = 1..KQ_FUSED_MAX_B rows of x, and the tiled
 * pass, with the type, R and B constants in each call (for the inlining: the loops over them
 * unroll and the sums stay in registers) */
#define KQ_ARGS x, xf, xs, w, row_bytes, block_bytes, qk, y, n0, N, K, f32, t
#define KQ_FUSED_CASE(TYPE, R, NB) \
    case NB: kq_fused(TYPE, R, NB, KQ_ARGS); break;
#if KQ_FUSED_MAX_B >= 4
#define KQ_FUSED_CASES(TYPE, R) KQ_FUSED_CASE(TYPE, R, 1) KQ_FUSED_CASE(TYPE, R, 2) \
    KQ_FUSED_CASE(TYPE, R, 3) KQ_FUSED_CASE(TYPE, R, 4)
#elif KQ_FUSED_MAX_B >= 2
#define KQ_FUSED_CASES(TYPE, R) KQ_FUSED_CASE(TYPE, R, 1) KQ_FUSED_CASE(TYPE, R, 2)
#else
#define KQ_FUSED_CASES(TYPE, R) KQ_FUSED_CASE(TYPE, R, 1)
#endif
#define KQ_FUSED_TYPE(TYPE)                                      \
    static void kq_fused_##TYPE(int R, int64_t B, const uint16_t *x, const float *xf,       \
                                const float *xs, const uint8_t *w, int64_t row_bytes,       \
                                int64_t block_bytes, int64_t qk, void *y, int64_t n0,       \
                                int64_t N, int64_t K, int64_t f32, kq_tables t)             \
    {                                                                                        \
        if (R == KQ_FUSED_ROWS)                                                              \
            switch (B) { KQ_FUSED_CASES(TYPE, KQ_FUSED_ROWS) default: break; }               \
        else                                                                                 \
            switch (B) { KQ_FUSED_CASES(TYPE, 1) default: break; }                           \
    }                                                                                        \
    static void kq_tiled_##TYPE(const uint16_t *x, const float *xf, const float *xs,        \
                                const uint8_t *w, int64_t row_bytes, int64_t block_bytes,   \
                                int64_t qk, void *y, int64_t n0, int64_t rows, int64_t B,   \
                                int64_t N, int64_t K, int64_t f32, kq_tables t,             \
                                kq_chunk *buf, kq_acc *acc)                                 \
    {                                                                                        \
        kq_tiled(TYPE, x, xf, xs, w, row_bytes, block_bytes, qk, y, n0, rows, B, N, K, f32, \
                 t, buf, acc);                                                               \
    }
KQ_FUSED_TYPE(GGUF_Q8_0)
KQ_FUSED_TYPE(GGUF_Q4_K)
KQ_FUSED_TYPE(GGUF_Q5_K)
KQ_FUSED_TYPE(GGUF_Q6_K)

typedef void (*kq_fused_fn)(int, int64_t, const uint16_t *, const float *, const float *,
                            const uint8_t *, int64_t, int64_t, int64_t, void *, int64_t, int64_t,
                            int64_t, int64_t, kq_tables);
typedef void (*kq_tiled_fn)(const uint16_t *, const float *, const float *, const uint8_t *,
                            int64_t, int64_t, int64_t, void *, int64_t, int64_t, int64_t,
                            int64_t, int64_t, int64_t, kq_tables, kq_chunk *, kq_acc *);

static void kq_matmul(int64_t type, const uint16_t *x, const float *xf, const float *xs,
                      const uint8_t *w, void *y, int64_t B, int64_t N, int64_t K, int64_t f32)
{
    int64_t block_bytes;
    const int64_t qk = gguf_block_size(type, &block_bytes);
    const int64_t row_bytes = K / qk * block_bytes;
    const kq_tables t = kq_make_tables();
    const kq_fused_fn fused = type == GGUF_Q8_0   ? kq_fused_GGUF_Q8_0
                              : type == GGUF_Q4_K ? kq_fused_GGUF_Q4_K
                              : type == GGUF_Q5_K ? kq_fused_GGUF_Q5_K
                                                  : kq_fused_GGUF_Q6_K;
    const kq_tiled_fn tiled = type == GGUF_Q8_0   ? kq_tiled_GGUF_Q8_0
                              : type == GGUF_Q4_K ? kq_tiled_GGUF_Q4_K
                              : type == GGUF_Q5_K ? kq_tiled_GGUF_Q5_K
                                                  : kq_tiled_GGUF_Q6_K;
    if (B <= KQ_FUSED_MAX_B) {
        const int64_t whole = N / KQ_FUSED_ROWS, full = whole * KQ_FUSED_ROWS;
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < whole + (N - full); i++) { /* tiles, then single rows */
            const int64_t n0 = i < whole ? i * KQ_FUSED_ROWS : full + (i - whole);
            fused(n0 < full ? KQ_FUSED_ROWS : 1, B, KQ_ARGS);
        }
        return;
    }
#pragma omp parallel
    {
        kq_chunk *buf = aligned_alloc(64, KQ_TILE_ROWS * 8 * sizeof(kq_chunk));
        kq_acc *acc = aligned_alloc(64, (size_t)(B * KQ_TILE_ROWS) * sizeof(kq_acc));
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < (N + KQ_TILE_ROWS - 1) / KQ_TILE_ROWS; tile++) {
            const int64_t n0 = tile * KQ_TILE_ROWS;
            const int64_t rows = N - n0 < KQ_TILE_ROWS ? N - n0 : KQ_TILE_ROWS;
            tiled(x, xf, xs, w, row_bytes, block_bytes, qk, y, n0, rows, B, N, K, f32, t, buf,
                  acc);
        }
        free(acc);
        free(buf);
    }
}
#endif

#ifndef KQ_SIMD
/* The plain C path (no AVX2): */
static void gguf_matmul_c(int64_t type, const uint16_t *x, const uint8_t *w, void *y, int64_t B,
                      int64_t N, int64_t K, int64_t f32)
{
    int64_t block_bytes;
    const int64_t qk = gguf_block_size(type, &block_bytes);
    if (qk == 0)
        return;
    const int64_t blocks = K / qk, row_bytes = blocks * block_bytes, G = K / GROUP;
    const int with_mins = type == GGUF_Q4_K || type == GGUF_Q5_K;
    float *xf = malloc((size_t)(B * K) * sizeof(float));
    float *xs = malloc((size_t)(B * G) * sizeof(float));
    for (int64_t i = 0; i < B * K; i++)
        xf[i] = bf16_to_float(x[i]);
    if (with_mins)
        group_sums(x, xs, B, K);
#pragma omp parallel
    {
        float *wf = malloc(KQ_TILE * QK_K * sizeof(float)), mins[KQ_TILE][8];
        float *acc = malloc((size_t)(B * KQ_TILE * (KQ_LANES + 1)) * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < (N + KQ_TILE - 1) / KQ_TILE; t++) {
            const int64_t n0 = t * KQ_TILE, rows = N - n0 < KQ_TILE ? N - n0 : KQ_TILE;
            for (int64_t i = 0; i < B * KQ_TILE * (KQ_LANES + 1); i++)
                acc[i] = 0.f; /* per row of x and of W: 16 lanes, then the mins' sum */
            for (int64_t k = 0; k < blocks; k++) {
                for (int64_t r = 0; r < rows; r++)
                    unpack_block((int)type, w + (n0 + r) * row_bytes + k * block_bytes,
                                 wf + r * QK_K, mins[r]);
                for (int64_t b = 0; b < B; b++) {
                    const float *xb = xf + b * K + k * qk;
                    for (int64_t r = 0; r < rows; r++) {
                        const float *wr = wf + r * QK_K;
                        float *lanes = acc + (b * KQ_TILE + r) * (KQ_LANES + 1), sum[KQ_LANES];
                        /* a local copy: the compiler keeps it in registers across the loop */
                        memcpy(sum, lanes, sizeof sum);
                        for (int64_t i = 0; i < qk; i += KQ_LANES)
                            for (int l = 0; l < KQ_LANES; l++)
                                sum[l] += wr[i + l] * xb[i + l];
                        memcpy(lanes, sum, sizeof sum);
                        if (with_mins)
                            for (int j = 0; j < 8; j++)
                                lanes[KQ_LANES] += mins[r][j] * xs[b * G + k * 8 + j];
                    }
                }
            }
            for (int64_t b = 0; b < B; b++)
                for (int64_t r = 0; r < rows; r++) {
                    const float *lanes = acc + (b * KQ_TILE + r) * (KQ_LANES + 1);
                    float sum = 0.f;
                    for (int l = 0; l < KQ_LANES; l++)
                        sum += lanes[l];
                    const int64_t at = b * N + n0 + r;
                    if (f32)
                        ((float *)y)[at] = sum - lanes[KQ_LANES];
                    else
                        ((uint16_t *)y)[at] = float_to_bf16(sum - lanes[KQ_LANES]);
                }
        }
        free(acc);
        free(wf);
    }
    free(xf);
    free(xs);
}

#endif

/* x [B, K] bfloat16; w [N, row bytes] GGUF blocks of `type`; y [B, N] bfloat16, or float32
 * with f32 (the logits head). K a multiple of the type's block (the caller checks). */
void gguf_matmul_bf16(int64_t type, const uint16_t *x, const uint8_t *w, void *y, int64_t B,
                      int64_t N, int64_t K, int64_t f32)
{
#ifdef KQ_SIMD
    int64_t block_bytes;
    if (gguf_block_size(type, &block_bytes) == 0)
        return;
    float *xs = NULL, *xf = NULL;
    if (type == GGUF_Q4_K || type == GGUF_Q5_K) {
        xs = malloc((size_t)(B * (K / GROUP)) * sizeof(float));
        group_sums(x, xs, B, K);
    }
    if (KQ_X_F32) {
        xf = malloc((size_t)(B * K) * sizeof(float));
        for (int64_t i = 0; i < B * K; i++)
            xf[i] = bf16_to_float(x[i]);
    }
    kq_matmul(type, x, xf, xs, w, y, B, N, K, f32);
    free(xf);
    free(xs);
#else
    gguf_matmul_c(type, x, w, y, B, N, K, f32);
#endif
}

/* The float32 weights W [N, K] that GGUF blocks of `type` hold, w = (d * sc) * q - dmin * m
 * rounded once, as the gguf package's dequantization computes them: for the check at load. */
void gguf_dequantize_f32(int64_t type, const uint8_t *w, float *out, int64_t N, int64_t K)
{
    int64_t block_bytes;
    const int64_t qk = gguf_block_size(type, &block_bytes);
    if (qk == 0)
        return;
    const int64_t blocks = K / qk;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float wf[QK_K], mins[8] = {0};
        for (int64_t k = 0; k < blocks; k++) {
            unpack_block((int)type, w + (n * blocks + k) * block_bytes, wf, mins);
            float *o = out + n * K + k * qk;
            for (int64_t i = 0; i < qk; i++) {
                volatile float v = wf[i]; /* no fused multiply-add: one rounding, as numpy's */
                o[i] = v - mins[i / 32];
            }
        }
    }
}
