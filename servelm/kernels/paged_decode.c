/* Decode attention over the paged KV cache, for the CPU: one query token per sequence.
 *
 * The torch path gathers every sequence's K/V blocks into a padded copy, then runs SDPA over
 * it; on a 2-core CPU the copy and the padded SDPA cost more than the attention itself. This
 * kernel reads K and V in place through the block table, once each, in float32 arithmetic:
 *
 *   for each (sequence b, KV head h), in parallel:
 *     scores[g][t] = scale * q[b, h*G+g] . K[slot(b, t), h]      t < context_lens[b]
 *     probs        = softmax(scores)                              (float32)
 *     out[b, h*G+g] = sum_t probs[g][t] * V[slot(b, t), h]
 *
 * where G = Hq / Hkv query heads share a KV head (grouped-query attention) and
 * slot(b, t) = block_tables[b][t / block_size] * block_size + t % block_size.
 *
 * Per layer (the `_win` exports): a sliding window of W tokens (W > 0) reads only the last W
 * positions, t > context_lens[b] - 1 - W, as transformers' Mistral and Gemma masks do; blocks
 * wholly before it are never read (the KV cache may have given them back: their table entries
 * are placeholders). A soft-cap c > 0 turns each score s (scaled) into c tanh(s / c) before
 * the softmax (Gemma 2). The plain exports are both off.
 *
 * Layouts (elements, row-major): q [B, Hq, D] with rows q_stride apart; k, v [B, Hkv, D] with
 * rows k_stride / v_stride apart (the new token's K/V, stored at slots[b] first unless slots is
 * NULL); caches [num_slots, Hkv, D]; block_tables [B, max_blocks]; out [B, Hq, D] contiguous.
 * The exported functions fix the storage type and head size, so that the compiler unrolls and
 * vectorizes the loops over D.
 */

#include <math.h>
#include <stdlib.h>

#include "common.h"

/* One row of D elements (bfloat16 or float32) as float32. */
INLINE void load_row(const void *src, int bf16, int64_t i, float *dst, int D)
{
    if (bf16)
        for (int d = 0; d < D; d++)
            dst[d] = bf16_to_float(((const uint16_t *)src)[i + d]);
    else
        for (int d = 0; d < D; d++)
            dst[d] = ((const float *)src)[i + d];
}

INLINE void store_row(void *dst, int bf16, int64_t i, const float *src, float mul, int D)
{
    if (bf16)
        for (int d = 0; d < D; d++)
            ((uint16_t *)dst)[i + d] = float_to_bf16(src[d] * mul);
    else
        for (int d = 0; d < D; d++)
            ((float *)dst)[i + d] = src[d] * mul;
}

/* n bytes at p into the caches (a hint: never a fault) */
INLINE void prefetch_bytes(const void *p, int64_t n)
{
    for (int64_t byte = 0; byte < n; byte += 64)
        __builtin_prefetch((const char *)p + byte);
}

/* Ask the memory system for the rows of this head in the block after `start` (if any) while
 * the current block is computed: the blocks of a sequence lie anywhere in the cache, so the
 * hardware prefetcher cannot guess the next one. */
INLINE void prefetch_next_block(const void *cache, int bf16, const int64_t *table, int64_t start,
                                int64_t len, int64_t block_size, int64_t row, int64_t h, int D)
{
    const int64_t next = start + block_size, size = bf16 ? 2 : 4;
    if (next >= len)
        return;
    const char *p = (const char *)cache + (table[next / block_size] * block_size * row + h * D) * size;
    for (int64_t i = 0; i < block_size && next + i < len; i++)
        prefetch_bytes(p + i * row * size, D * size);
}

/* The first key a query at position len - 1 sees: the window's (window > 0) or key 0. */
INLINE int64_t window_start(int64_t len, int64_t window)
{
    return window > 0 && len > window ? len - window : 0;
}

/* tanh(x) = 1 - 2 / (e^2x + 1), from exp_approx (which clamps, so +-1 at the ends): a form the
 * compiler vectorizes, where libm's tanhf is a call per score. */
INLINE float tanh_approx(float x) { return 1.f - 2.f / (exp_approx(2.f * x) + 1.f); }

/* s -> cap tanh(s / cap) over n scores (cap > 0), in place: Gemma 2's attention soft-capping. */
INLINE void softcap_scores(float *s, int64_t n, float cap)
{
    const float inv = 1.f / cap;
#pragma omp simd
    for (int64_t t = 0; t < n; t++)
        s[t] = cap * tanh_approx(s[t] * inv);
}

/* Each of the `rows` rows of `scores` (len floats each) -> e^(s - its max), in place; their
 * sums into total. */
INLINE void softmax_rows(float *scores, int64_t rows, int64_t len, float *total)
{
    for (int64_t g = 0; g < rows; g++) {
        float *s = scores + g * len, m = -INFINITY, z = 0.f;
#pragma omp simd reduction(max : m)
        for (int64_t t = 0; t < len; t++) /* not fmaxf: a call into libm unless NaN is ruled out */
            m = s[t] > m ? s[t] : m;
#pragma omp simd reduction(+ : z)
        for (int64_t t = 0; t < len; t++) {
            s[t] = exp_approx(s[t] - m);
            z += s[t];
        }
        total[g] = z;
    }
}

/* One (sequence, KV head): its G query heads over the sequence's context. `scores` holds
 * G * len floats. */
INLINE void attend_one_head(const void *q, int64_t q_row, const void *k_cache,
                            const void *v_cache, const int64_t *table, int64_t len,
                            int64_t block_size, int64_t row, int64_t h, int64_t G, float scale,
                            int64_t window, float softcap, void *out, int64_t out_row,
                            float *scores, int bf16, int D)
{
    float qf[G][D], acc[G][D], total[G], x[D];
    /* keys lo .. len - 1; scores[g * nk + t - lo] */
    const int64_t lo = window_start(len, window), nk = len - lo;
    for (int64_t g = 0; g < G; g++) {
        load_row(q, bf16, q_row + g * D, qf[g], D);
        for (int d = 0; d < D; d++) {
            qf[g][d] *= scale;
            acc[g][d] = 0.f;
        }
    }
    /* Block by block, four tokens at a time (four independent sums per query head keep the
     * multiply-add units busy where one sum would wait on its own previous step). A block's
     * last group repeats its last token where it runs short, and drops those results. */
    for (int64_t start = lo - lo % block_size; start < len; start += block_size) {
        const int64_t base = table[start / block_size] * block_size * row + h * D;
        const int64_t n = len - start < block_size ? len - start : block_size;
        prefetch_next_block(k_cache, bf16, table, start, len, block_size, row, h, D);
        for (int64_t i = start < lo ? lo - start : 0; i < n; i += 4) {
            float x[4][D];
            for (int j = 0; j < 4; j++)
                load_row(k_cache, bf16, base + (i + j < n ? i + j : n - 1) * row, x[j], D);
            for (int64_t g = 0; g < G; g++) {
                float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
                for (int d = 0; d < D; d++) {
                    s0 += qf[g][d] * x[0][d];
                    s1 += qf[g][d] * x[1][d];
                    s2 += qf[g][d] * x[2][d];
                    s3 += qf[g][d] * x[3][d];
                }
                const float sums[4] = {s0, s1, s2, s3};
                for (int j = 0; j < 4 && i + j < n; j++)
                    scores[g * nk + start + i + j - lo] = sums[j];
            }
        }
    }
    if (softcap > 0.f)
        softcap_scores(scores, G * nk, softcap);
    softmax_rows(scores, G, nk, total);
    /* out = sum_t p_t V_t, normalized once at the end. */
    for (int64_t start = lo - lo % block_size; start < len; start += block_size) {
        const int64_t base = table[start / block_size] * block_size * row + h * D;
        const int64_t n = len - start < block_size ? len - start : block_size;
        prefetch_next_block(v_cache, bf16, table, start, len, block_size, row, h, D);
        for (int64_t i = start < lo ? lo - start : 0; i < n; i++) {
            load_row(v_cache, bf16, base + i * row, x, D);
            for (int64_t g = 0; g < G; g++) {
                const float p = scores[g * nk + start + i - lo];
                for (int d = 0; d < D; d++)
                    acc[g][d] += p * x[d];
            }
        }
    }
    for (int64_t g = 0; g < G; g++)
        store_row(out, bf16, out_row + g * D, acc[g], 1.f / total[g], D);
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* With AVX2 alone (CPUs without AVX-512), for bfloat16 caches, D a multiple of 32 and up to 8
 * query heads per KV head: one task takes a sequence's KV heads together (or one of them where
 * there are too few sequences to share), block by block, since a block's rows of all heads lie
 * side by side and so are read in order, once. Both products in 8-lane FMAs with lanes = dims
 * and G a constant (the sums stay in registers): a key's G sums over D, 8 keys at a time, each
 * head's 8 sums then reduced into one vector of 8 scores (sum8x8); for the values D in slices
 * of 32 (16, 8 for more heads) dims, each V row's slice widened once for all G heads; the
 * softmax in 8 lanes. While a block is computed, each of its rows asks for the same row of the
 * sequence's next block: the blocks lie anywhere in the cache, so no hardware prefetcher can
 * guess them, and one request per row spreads the requests over the block instead of queueing
 * them all at its start. About twice as fast as the generic loops (docs/performance.md). */
#define VECTOR_DECODE 1

/* softmax_rows in 8 lanes: the same max, e^(s - max) (exp_approx8) and sums */
INLINE void softmax_rows8(float *scores, int64_t rows, int64_t len, float *total)
{
    for (int64_t r = 0; r < rows; r++) {
        float *s = scores + r * len, lanes[8], m = -INFINITY, z = 0.f;
        __m256 m8 = _mm256_set1_ps(-INFINITY), z8 = _mm256_setzero_ps();
        int64_t t = 0;
        for (; t + 8 <= len; t += 8)
            m8 = _mm256_max_ps(m8, _mm256_loadu_ps(s + t));
        _mm256_storeu_ps(lanes, m8);
        for (int j = 0; j < 8; j++)
            m = lanes[j] > m ? lanes[j] : m;
        for (int64_t u = t; u < len; u++)
            m = s[u] > m ? s[u] : m;
        for (t = 0; t + 8 <= len; t += 8) {
            const __m256 e = exp_approx8(_mm256_sub_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(m)));
            _mm256_storeu_ps(s + t, e);
            z8 = _mm256_add_ps(z8, e);
        }
        _mm256_storeu_ps(lanes, z8);
        for (int j = 0; j < 8; j++)
            z += lanes[j];
        for (int64_t u = t; u < len; u++) {
            s[u] = exp_approx(s[u] - m);
            z += s[u];
        }
        total[r] = z;
    }
}

/* lane j = the sum of v[j]'s 8 lanes */
INLINE __m256 sum8x8(const __m256 v[8])
{
    const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20),
                         _mm256_permute2f128_ps(ab, cd, 0x31));
}

/* dst[g * len + i] = q_g . K_i for a block's n rows of one KV head (k: its first), q_g the G
 * rows of qf; row i asks for row i of `next` (the next block's, or NULL). A short last group of
 * 8 repeats the block's last row and drops the results. */
INLINE void block_scores(const float *qf, const uint16_t *k, const uint16_t *next, int64_t row,
                         int64_t n, float *dst, int64_t len, const int G, const int D)
{
    for (int64_t i = 0; i < n; i += 8) {
        __m256 part[8][8];
        for (int j = 0; j < 8; j++) {
            const uint16_t *kj = k + (i + j < n ? i + j : n - 1) * row;
            if (next)
                prefetch_bytes(next + (i + j) * row, D * 2);
            __m256 s[8];
            for (int g = 0; g < G; g++)
                s[g] = _mm256_setzero_ps();
            for (int d = 0; d < D; d += 8) {
                const __m256 kd = load_bf16_8(kj + d);
                for (int g = 0; g < G; g++)
                    s[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + g * D + d), kd, s[g]);
            }
            for (int g = 0; g < G; g++)
                part[g][j] = s[g];
        }
        for (int g = 0; g < G; g++) {
            const __m256 r = sum8x8(part[g]);
            if (n - i >= 8)
                _mm256_storeu_ps(dst + g * len + i, r);
            else {
                float tmp[8];
                _mm256_storeu_ps(tmp, r);
                for (int64_t j = 0; j < n - i; j++)
                    dst[g * len + i + j] = tmp[j];
            }
        }
    }
}

/* acc[g] += sum_i p[g * len + i] V_i over a block's n rows of one KV head (v: its first); row i
 * asks for row i of `next`, as in block_scores */
INLINE void block_values(const float *p, int64_t len, const uint16_t *v, const uint16_t *next,
                         int64_t row, int64_t n, float *acc, const int G, const int D)
{
    const int slice = G <= 3 ? 4 : (G <= 6 ? 2 : 1); /* vectors of 8 dims per pass */
    for (int d0 = 0; d0 < D; d0 += 8 * slice) {
        __m256 a[8][4];
        for (int g = 0; g < G; g++)
            for (int u = 0; u < slice; u++)
                a[g][u] = _mm256_loadu_ps(acc + g * D + d0 + 8 * u);
        for (int64_t i = 0; i < n; i++) {
            __m256 pg[8];
            if (next && d0 == 0)
                prefetch_bytes(next + i * row, D * 2);
            for (int g = 0; g < G; g++)
                pg[g] = _mm256_broadcast_ss(p + g * len + i);
            for (int u = 0; u < slice; u++) {
                const __m256 x = load_bf16_8(v + i * row + d0 + 8 * u);
                for (int g = 0; g < G; g++)
                    a[g][u] = _mm256_fmadd_ps(pg[g], x, a[g][u]);
            }
        }
        for (int g = 0; g < G; g++)
            for (int u = 0; u < slice; u++)
                _mm256_storeu_ps(acc + g * D + d0 + 8 * u, a[g][u]);
    }
}

/* rows of the block starting at token `start` (a short last block has fewer) */
INLINE int64_t block_rows(int64_t len, int64_t start, int64_t block_size)
{
    return len - start < block_size ? len - start : block_size;
}

/* block i of a sequence's table in `cache`, `offset` elements in (its first head's rows); NULL
 * past the last of its `blocks` */
INLINE const uint16_t *block_at(const uint16_t *cache, const int64_t *table, int64_t i,
                                int64_t blocks, int64_t span, int64_t offset)
{
    return i < blocks ? cache + table[i] * span + offset : NULL;
}

/* KV heads h0 .. h0 + nh - 1 of one sequence (q, out: its rows) over its context. scores:
 * nh * G * len floats; qf, acc: nh * G * D each; total: nh * G. */
INLINE void attend_heads(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                         const int64_t *table, int64_t len, int64_t block_size, int64_t row,
                         int64_t h0, int64_t nh, float scale, int64_t window, float softcap,
                         uint16_t *out, float *scores, float *qf, float *acc, float *total,
                         const int G, const int D)
{
    const int64_t heads = nh * G, first = h0 * G * D;
    for (int64_t i = 0; i < heads * D; i++) {
        qf[i] = bf16_to_float(q[first + i]) * scale;
        acc[i] = 0.f;
    }
    /* keys lo .. len - 1 (the window's): rows of nk scores, key t at t - lo; the first block's
     * rows before lo are skipped */
    const int64_t lo = window_start(len, window), nk = len - lo;
    const int64_t blocks = (len + block_size - 1) / block_size, span = block_size * row;
    for (int64_t i = lo / block_size; i < blocks; i++) {
        const int64_t start = i * block_size, n = block_rows(len, start, block_size);
        const int64_t skip = start < lo ? lo - start : 0, at = (skip * row);
        const uint16_t *k = block_at(k_cache, table, i, blocks, span, h0 * D);
        const uint16_t *next = block_at(k_cache, table, i + 1, blocks, span, h0 * D);
        for (int64_t h = 0; h < nh; h++)
            block_scores(qf + h * G * D, k + at + h * D, next ? next + h * D : NULL, row,
                         n - skip, scores + h * G * nk + start + skip - lo, nk, G, D);
    }
    if (softcap > 0.f)
        softcap_scores(scores, heads * nk, softcap);
    softmax_rows8(scores, heads, nk, total);
    for (int64_t i = lo / block_size; i < blocks; i++) {
        const int64_t start = i * block_size, n = block_rows(len, start, block_size);
        const int64_t skip = start < lo ? lo - start : 0, at = (skip * row);
        const uint16_t *v = block_at(v_cache, table, i, blocks, span, h0 * D);
        const uint16_t *next = block_at(v_cache, table, i + 1, blocks, span, h0 * D);
        for (int64_t h = 0; h < nh; h++)
            block_values(scores + h * G * nk + start + skip - lo, nk, v + at + h * D,
                         next ? next + h * D : NULL, row, n - skip, acc + h * G * D, G, D);
    }
    for (int64_t i = 0; i < heads; i++)
        store_row(out, 1, first + i * D, acc + i * D, 1.f / total[i], D);
}

/* attend_heads with G a constant, and D too where it is 64 (the default model's, and common):
 * with D known the loops run faster (docs/performance.md). Other head sizes share one copy per
 * G, which keeps the build at seconds. */
__attribute__((noinline, noclone)) static void
attend_heads_g(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
               const int64_t *table, int64_t len, int64_t block_size, int64_t row, int64_t h0,
               int64_t nh, float scale, int64_t window, float softcap, uint16_t *out,
               float *scores, float *qf, float *acc, float *total, int64_t G, int D)
{
    switch (G) {
#define ATTEND(G_, D_)                                                                         \
    attend_heads(q, k_cache, v_cache, table, len, block_size, row, h0, nh, scale, window,      \
                 softcap, out, scores, qf, acc, total, G_, D_)
#define CASE(G_)                                                                               \
    case G_:                                                                                   \
        if (D == 64)                                                                           \
            ATTEND(G_, 64);                                                                    \
        else                                                                                   \
            ATTEND(G_, D);                                                                     \
        break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
#undef ATTEND
    }
}
#else
#define VECTOR_DECODE 0
INLINE void attend_heads_g(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                           const int64_t *table, int64_t len, int64_t block_size, int64_t row,
                           int64_t h0, int64_t nh, float scale, int64_t window, float softcap,
                           uint16_t *out, float *scores, float *qf, float *acc, float *total,
                           int64_t G, int D)
{
    /* not reached: VECTOR_DECODE is 0 */
}
#endif

/* Whether a call takes the AVX2 path: bfloat16 caches, D a multiple of 32, up to 8 query heads
 * per KV head, in a build that has it */
INLINE int vector_path(int bf16, int64_t D, int64_t G)
{
    return VECTOR_DECODE && bf16 && D % 32 == 0 && G <= 8;
}

/* The parallel loop is written out in each exported function (not in a shared inline one):
 * OpenMP outlines a parallel region where it is written, and only an outlined region of its
 * own sees BF16 and D as constants. Threads pay off once there are two heads and a little
 * context to share. */
#define EXPORT(NAME, BF16, D)                                                                  \
    void NAME##_win(const void *q, int64_t q_stride, const void *k, int64_t k_stride,          \
                    const void *v, int64_t v_stride, void *k_cache, void *v_cache,             \
                    const int64_t *slots, const int64_t *block_tables, int64_t max_blocks,     \
                    const int64_t *context_lens, int64_t B, int64_t Hq, int64_t Hkv,           \
                    int64_t block_size, int64_t max_len, float scale, int64_t window,          \
                    float softcap, void *out)                                                  \
    {                                                                                          \
        const int64_t G = Hq / Hkv;                                                            \
        if (slots)                                                                             \
            store_new_tokens(k, k_stride, v, v_stride, k_cache, v_cache, slots, B, Hkv,        \
                             BF16 ? 2 : 4, D);                                                 \
        if (vector_path(BF16, D, G)) {                                                         \
            const int64_t per = B >= 2 ? Hkv : 1; /* KV heads per task */                \
            const int64_t tasks = B * (Hkv / per);                                             \
            _Pragma("omp parallel if (tasks > 1 && B * max_len >= 128)")                       \
            {                                                                                  \
                float *scores = malloc(sizeof(float) * per * G * (max_len + 2 * D + 1));        \
                float *qf = scores + per * G * max_len, *acc = qf + per * G * D;               \
                _Pragma("omp for schedule(static)")                                            \
                for (int64_t t = 0; t < tasks; t++) {                                          \
                    const int64_t b = t / (Hkv / per), h0 = t % (Hkv / per) * per;             \
                    attend_heads_g((const uint16_t *)q + b * q_stride, k_cache, v_cache,       \
                                   block_tables + b * max_blocks, context_lens[b], block_size, \
                                   Hkv * D, h0, per, scale, window, softcap,                   \
                                   (uint16_t *)out + b * Hq * D, scores, qf, acc,              \
                                   acc + per * G * D, G, D);                                   \
                }                                                                              \
                free(scores);                                                                  \
            }                                                                                  \
            return;                                                                            \
        }                                                                                      \
        _Pragma("omp parallel if (B * Hkv > 1 && B * max_len >= 128)")                         \
        {                                                                                      \
            float *scores = malloc(sizeof(float) * G * max_len);                               \
            _Pragma("omp for collapse(2) schedule(static)")                                    \
            for (int64_t b = 0; b < B; b++)                                                    \
                for (int64_t h = 0; h < Hkv; h++)                                              \
                    attend_one_head(q, b * q_stride + h * G * D, k_cache, v_cache,             \
                                    block_tables + b * max_blocks, context_lens[b],            \
                                    block_size, Hkv * D, h, G, scale, window, softcap, out,    \
                                    (b * Hq + h * G) * D, scores, BF16, D);                    \
            free(scores);                                                                      \
        }                                                                                      \
    }                                                                                          \
    /* full attention, no soft-capping: what the C layer loop (decode_stack.c) calls */        \
    void NAME(const void *q, int64_t q_stride, const void *k, int64_t k_stride, const void *v, \
              int64_t v_stride, void *k_cache, void *v_cache, const int64_t *slots,            \
              const int64_t *block_tables, int64_t max_blocks, const int64_t *context_lens,    \
              int64_t B, int64_t Hq, int64_t Hkv, int64_t block_size, int64_t max_len,         \
              float scale, void *out)                                                          \
    {                                                                                          \
        NAME##_win(q, q_stride, k, k_stride, v, v_stride, k_cache, v_cache, slots,             \
                   block_tables, max_blocks, context_lens, B, Hq, Hkv, block_size, max_len,    \
                   scale, 0, 0.f, out);                                                        \
    }

EXPORT(paged_decode_bf16_d16, 1, 16)
EXPORT(paged_decode_bf16_d32, 1, 32)
EXPORT(paged_decode_bf16_d64, 1, 64)
EXPORT(paged_decode_bf16_d128, 1, 128)
EXPORT(paged_decode_f32_d16, 0, 16)
EXPORT(paged_decode_f32_d32, 0, 32)
EXPORT(paged_decode_f32_d64, 0, 64)
EXPORT(paged_decode_f32_d128, 0, 128)

/* 1 where calls with these caches (bf16: 1 for bfloat16) and head size take the AVX2 path (with
 * up to 8 query heads per KV head), 0 where they take the generic loops */
int64_t paged_decode_vector_path(int64_t bf16, int64_t D) { return vector_path((int)bf16, D, 1); }
