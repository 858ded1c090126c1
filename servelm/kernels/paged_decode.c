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
        for (int64_t byte = 0; byte < D * size; byte += 64)
            __builtin_prefetch(p + i * row * size + byte);
}

/* One (sequence, KV head): its G query heads over the sequence's context. `scores` holds
 * G * len floats. */
INLINE void attend_one_head(const void *q, int64_t q_row, const void *k_cache,
                            const void *v_cache, const int64_t *table, int64_t len,
                            int64_t block_size, int64_t row, int64_t h, int64_t G, float scale,
                            void *out, int64_t out_row, float *scores, int bf16, int D)
{
    float qf[G][D], acc[G][D], peak[G], total[G], x[D];
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
    for (int64_t start = 0; start < len; start += block_size) {
        const int64_t base = table[start / block_size] * block_size * row + h * D;
        const int64_t n = len - start < block_size ? len - start : block_size;
        prefetch_next_block(k_cache, bf16, table, start, len, block_size, row, h, D);
        for (int64_t i = 0; i < n; i += 4) {
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
                    scores[g * len + start + i + j] = sums[j];
            }
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (int64_t t = 0; t < len; t++) /* not fmaxf: a call into libm unless NaN is ruled out */
            m = scores[g * len + t] > m ? scores[g * len + t] : m;
        peak[g] = m;
    }
    for (int64_t g = 0; g < G; g++) {
        float *s = scores + g * len, m = peak[g], z = 0.f;
#pragma omp simd reduction(+ : z)
        for (int64_t t = 0; t < len; t++) {
            s[t] = exp_approx(s[t] - m);
            z += s[t];
        }
        total[g] = z;
    }
    /* out = sum_t p_t V_t, normalized once at the end. */
    for (int64_t start = 0; start < len; start += block_size) {
        const int64_t base = table[start / block_size] * block_size * row + h * D;
        const int64_t n = len - start < block_size ? len - start : block_size;
        prefetch_next_block(v_cache, bf16, table, start, len, block_size, row, h, D);
        for (int64_t i = 0; i < n; i++) {
            load_row(v_cache, bf16, base + i * row, x, D);
            for (int64_t g = 0; g < G; g++) {
                const float p = scores[g * len + start + i];
                for (int d = 0; d < D; d++)
                    acc[g][d] += p * x[d];
            }
        }
    }
    for (int64_t g = 0; g < G; g++)
        store_row(out, bf16, out_row + g * D, acc[g], 1.f / total[g], D);
}

/* The parallel loop is written out in each exported function (not in a shared inline one):
 * OpenMP outlines a parallel region where it is written, and only an outlined region of its
 * own sees BF16 and D as constants. Threads pay off once there are two heads and a little
 * context to share. */
#define EXPORT(NAME, BF16, D)                                                                  \
    void NAME(const void *q, int64_t q_stride, const void *k, int64_t k_stride, const void *v, \
              int64_t v_stride, void *k_cache, void *v_cache, const int64_t *slots,            \
              const int64_t *block_tables, int64_t max_blocks, const int64_t *context_lens,    \
              int64_t B, int64_t Hq, int64_t Hkv, int64_t block_size, int64_t max_len,         \
              float scale, void *out)                                                          \
    {                                                                                          \
        const int64_t G = Hq / Hkv;                                                            \
        if (slots)                                                                             \
            store_new_tokens(k, k_stride, v, v_stride, k_cache, v_cache, slots, B, Hkv,        \
                             BF16 ? 2 : 4, D);                                                 \
        _Pragma("omp parallel if (B * Hkv > 1 && B * max_len >= 128)")                         \
        {                                                                                      \
            float *scores = malloc(sizeof(float) * G * max_len);                               \
            _Pragma("omp for collapse(2) schedule(static)")                                    \
            for (int64_t b = 0; b < B; b++)                                                    \
                for (int64_t h = 0; h < Hkv; h++)                                              \
                    attend_one_head(q, b * q_stride + h * G * D, k_cache, v_cache,             \
                                    block_tables + b * max_blocks, context_lens[b],            \
                                    block_size, Hkv * D, h, G, scale, out,                     \
                                    (b * Hq + h * G) * D, scores, BF16, D);                    \
            free(scores);                                                                      \
        }                                                                                      \
    }

EXPORT(paged_decode_bf16_d16, 1, 16)
EXPORT(paged_decode_bf16_d32, 1, 32)
EXPORT(paged_decode_bf16_d64, 1, 64)
EXPORT(paged_decode_bf16_d128, 1, 128)
EXPORT(paged_decode_f32_d16, 0, 16)
EXPORT(paged_decode_f32_d32, 0, 32)
EXPORT(paged_decode_f32_d64, 0, 64)
EXPORT(paged_decode_f32_d128, 0, 128)
