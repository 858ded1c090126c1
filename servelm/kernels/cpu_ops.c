/* Fused element-wise layers for the CPU: one pass over the data where torch runs 3-10 small
 * ops, each paying the dispatcher and, right after a big matmul, cold caches.
 *
 * Each op rounds where the torch ops it replaces round (float32 arithmetic, rounded to the
 * tensor's dtype after each of them), so bfloat16 results match those ops bit for bit up to
 * the order of a float32 sum:
 *
 *   add_rms_norm   x += delta (in place; skipped when delta is NULL);
 *                  out = w * round(x * rsqrt(mean(x^2) + eps))              rows of H
 *   silu_and_mul   out = round(silu(gate)) * up, gate and up the two halves of each row
 *   rotary         in place on the first H heads of each row (queries, then keys):
 *                  x = round(x * cos) + round(roll(x, D/2) * signed_sin)
 *                  with signed_sin = [-sin | sin], which is HF Llama's x cos + rotate_half(x) sin
 */

/* Wide vectors where the CPU has them: the compiler vectorizes these loops, and on x86 keeps
 * to 256 bits unless told; 512 makes the ops faster (docs/performance.md). */
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("prefer-vector-width=512")
#endif

#include <math.h>

#include "common.h"

INLINE float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

#define LOAD(p, i) (BF16 ? bf16_to_float(((const uint16_t *)(p))[i]) : ((const float *)(p))[i])
#define STORE(p, i, v)                                                                         \
    do {                                                                                       \
        if (BF16)                                                                              \
            ((uint16_t *)(p))[i] = float_to_bf16(v);                                           \
        else                                                                                   \
            ((float *)(p))[i] = (v);                                                           \
    } while (0)
#define ROUND(v) (BF16 ? round_bf16(v) : (v))

/* Rows run in parallel once there are enough of them to pay for the threads. */
#define DEFINE_OPS(SUFFIX, IS_BF16)                                                               \
    void add_rms_norm_##SUFFIX(void *x, const void *delta, const void *w, void *out,          \
                               int64_t T, int64_t H, float eps)                                \
    {                                                                                          \
        enum { BF16 = IS_BF16 };                                                               \
        _Pragma("omp parallel for if (T * H >= 16384)")                                        \
        for (int64_t t = 0; t < T; t++) {                                                      \
            const int64_t row = t * H;                                                         \
            if (delta)                                                                         \
                for (int64_t i = 0; i < H; i++)                                                \
                    STORE(x, row + i, LOAD(x, row + i) + LOAD(delta, row + i));                \
            float sum = 0.f;                                                                   \
            _Pragma("omp simd reduction(+ : sum)")                                             \
            for (int64_t i = 0; i < H; i++)                                                    \
                sum += LOAD(x, row + i) * LOAD(x, row + i);                                    \
            const float inv = 1.f / sqrtf(sum / (float)H + eps);                               \
            for (int64_t i = 0; i < H; i++)                                                    \
                STORE(out, row + i, LOAD(w, i) * ROUND(LOAD(x, row + i) * inv));               \
        }                                                                                      \
    }                                                                                          \
                                                                                               \
    void rotary_##SUFFIX(void *x, int64_t row_stride, int64_t T, int64_t H, int64_t D,          \
                         const void *cos, const void *sin)                                     \
    {                                                                                          \
        enum { BF16 = IS_BF16 };                                                               \
        const int64_t half = D / 2;                                                            \
        _Pragma("omp parallel for if (T * H * D >= 16384)")                                    \
        for (int64_t t = 0; t < T; t++)                                                        \
            for (int64_t h = 0; h < H; h++) {                                                  \
                const int64_t at = t * row_stride + h * D;                                     \
                for (int64_t i = 0; i < half; i++) {                                           \
                    const float a = LOAD(x, at + i), b = LOAD(x, at + half + i);               \
                    const float c0 = LOAD(cos, t * D + i), c1 = LOAD(cos, t * D + half + i);   \
                    const float s0 = LOAD(sin, t * D + i), s1 = LOAD(sin, t * D + half + i);   \
                    STORE(x, at + i, ROUND(a * c0) + ROUND(b * s0));                          \
                    STORE(x, at + half + i, ROUND(b * c1) + ROUND(a * s1));                    \
                }                                                                              \
            }                                                                                  \
    }                                                                                          \
                                                                                               \
    void silu_and_mul_##SUFFIX(const void *gate_up, void *out, int64_t T, int64_t I)           \
    {                                                                                          \
        enum { BF16 = IS_BF16 };                                                               \
        _Pragma("omp parallel for if (T * I >= 16384)")                                        \
        for (int64_t t = 0; t < T; t++)                                                        \
            for (int64_t i = 0; i < I; i++) {                                                  \
                const float g = LOAD(gate_up, t * 2 * I + i);                                  \
                const float silu = ROUND(g / (1.f + exp_approx(-g)));                          \
                STORE(out, t * I + i, silu * LOAD(gate_up, t * 2 * I + I + i));                \
            }                                                                                  \
    }

DEFINE_OPS(f32, 0)

/* bfloat16 in vectors, where a row is a whole number of them (other rows take the loops above):
 * the same arithmetic LANES_ lanes at a time, one body for both widths through the V_ names.
 * With AVX-512 BF16, 16 lanes, rounding with the convert instruction (to nearest even, as
 * float_to_bf16); with AVX2, 8 lanes, rounding in integer code as float_to_bf16 does. The
 * scalar loops cost prompts several times more (docs/performance.md). */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define LANES_ 16
typedef __m512 vec;
#define V_LOAD load_bf16
#define V_STORE store_bf16
#define V_ROUND round_bf16_16
#define V_ADD _mm512_add_ps
#define V_MUL _mm512_mul_ps
#define V_FMA _mm512_fmadd_ps
#define V_SET1 _mm512_set1_ps
#define V_ZERO _mm512_setzero_ps
#define V_SUM _mm512_reduce_add_ps
#define V_SILU_MUL silu_mul16
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES_ 8
typedef __m256 vec;
#define V_LOAD load_bf16_8
#define V_STORE store_bf16_8
#define V_ROUND round_bf16_8
#define V_ADD _mm256_add_ps
#define V_MUL _mm256_mul_ps
#define V_FMA _mm256_fmadd_ps
#define V_SET1 _mm256_set1_ps
#define V_ZERO _mm256_setzero_ps
#define V_SUM lanes_sum8
#define V_SILU_MUL silu_mul8
#endif

#ifdef LANES_
DEFINE_OPS(bf16_scalar, 1)

void add_rms_norm_bf16(void *x_, const void *delta_, const void *w_, void *out_, int64_t T,
                       int64_t H, float eps)
{
    if (H % LANES_) {
        add_rms_norm_bf16_scalar(x_, delta_, w_, out_, T, H, eps);
        return;
    }
    uint16_t *x = x_, *out = out_;
    const uint16_t *delta = delta_, *w = w_;
#pragma omp parallel for if (T * H >= 16384)
    for (int64_t t = 0; t < T; t++) {
        uint16_t *xr = x + t * H, *o = out + t * H;
        vec sum = V_ZERO();
        for (int64_t i = 0; i < H; i += LANES_) {
            vec v = V_LOAD(xr + i);
            if (delta) {
                v = V_ROUND(V_ADD(v, V_LOAD(delta + t * H + i)));
                V_STORE(xr + i, v);
            }
            sum = V_FMA(v, v, sum);
        }
        const vec inv = V_SET1(1.f / sqrtf(V_SUM(sum) / (float)H + eps));
        for (int64_t i = 0; i < H; i += LANES_) {
            const vec normed = V_ROUND(V_MUL(V_LOAD(xr + i), inv));
            V_STORE(o + i, V_MUL(V_LOAD(w + i), normed));
        }
    }
}

void rotary_bf16(void *x_, int64_t row_stride, int64_t T, int64_t H, int64_t D, const void *cos_,
                 const void *sin_)
{
    const int64_t half = D / 2;
    if (half % LANES_) {
        rotary_bf16_scalar(x_, row_stride, T, H, D, cos_, sin_);
        return;
    }
    uint16_t *x = x_;
    const uint16_t *cos = cos_, *sin = sin_;
#pragma omp parallel for if (T * H * D >= 16384)
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) {
            uint16_t *xa = x + t * row_stride + h * D, *xb = xa + half;
            for (int64_t i = 0; i < half; i += LANES_) {
                const vec a = V_LOAD(xa + i), b = V_LOAD(xb + i);
                const uint16_t *ct = cos + t * D, *st = sin + t * D;
                const vec c0 = V_LOAD(ct + i), c1 = V_LOAD(ct + half + i);
                const vec s0 = V_LOAD(st + i), s1 = V_LOAD(st + half + i);
                V_STORE(xa + i, V_ADD(V_ROUND(V_MUL(a, c0)), V_ROUND(V_MUL(b, s0))));
                V_STORE(xb + i, V_ADD(V_ROUND(V_MUL(b, c1)), V_ROUND(V_MUL(a, s1))));
            }
        }
}

void silu_and_mul_bf16(const void *gate_up_, void *out_, int64_t T, int64_t I)
{
    if (I % LANES_) {
        silu_and_mul_bf16_scalar(gate_up_, out_, T, I);
        return;
    }
    const uint16_t *gate_up = gate_up_;
    uint16_t *out = out_;
#pragma omp parallel for if (T * I >= 16384)
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < I; i += LANES_)
            V_STORE(out + t * I + i, V_SILU_MUL(V_LOAD(gate_up + t * 2 * I + i),
                                                V_LOAD(gate_up + t * 2 * I + I + i)));
}
#else
DEFINE_OPS(bf16, 1)
#endif

/* out[b] = the index of row b's largest value, the first on ties (-0 and +0 equal), or of its
 * first NaN, as torch's max reduction picks it (the sampler's greedy pick): x [B, V] float32.
 * One pass finds the largest value in vectors, a second its first place (the row is in L2 by
 * then); rows in parallel. A decode step's 16 x 49,152 logits on the Zen 4: 0.11 ms, torch's
 * max 0.34-0.50 and its argmax 0.34-0.41 (docs/performance.md, session 31). */
void argmax_rows_f32(const float *x, int64_t B, int64_t V, int64_t *out)
{
#pragma omp parallel for if (B * V >= 65536)
    for (int64_t b = 0; b < B; b++) {
        const float *row = x + b * V;
        float top = -INFINITY;
        int nan = 0;
        int64_t i = 0;
#if defined(__AVX512F__)
        __m512 m = _mm512_set1_ps(-INFINITY);
        __mmask16 unordered = 0;
        for (; i + 16 <= V; i += 16) {
            const __m512 v = _mm512_loadu_ps(row + i);
            unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            m = _mm512_max_ps(m, v);
        }
        top = _mm512_reduce_max_ps(m);
        nan = unordered != 0;
#elif defined(__AVX2__)
        __m256 m = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
        for (; i + 8 <= V; i += 8) {
            const __m256 v = _mm256_loadu_ps(row + i);
            unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            m = _mm256_max_ps(m, v);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, m);
        for (int k = 0; k < 8; k++)
            top = lanes[k] > top ? lanes[k] : top;
        nan = _mm256_movemask_ps(unordered) != 0;
#endif
        for (; i < V; i++) {
            nan |= row[i] != row[i];
            top = row[i] > top ? row[i] : top;
        }
        int64_t at = 0;
        if (nan)
            while (row[at] == row[at])
                at++;
        else
            while (row[at] != top && at + 1 < V) /* (top is in the row: found) */
                at++;
        out[b] = at;
    }
}
