/* y = x W^T for a quantized weight W [N, K] and a few bfloat16 rows x [B, K]: the matmuls of a
 * decode step, where every weight is read once per step and the time goes to memory and to
 * turning a few bits into numbers. Two of GGUF's forms, so that the default model's weights are
 * served exactly as its file holds them; both in groups of 32 along each row:
 *
 *   q4 (Q4_1, the layers' projections)  W[n, 32g + j] = q * scale[n, g] + low[n, g], q in 0..15
 *   q8 (Q8_0, the logits head)          W[n, 32g + j] = q * scale[n, g],  q in -127..127
 *
 * with scale and low in float16. Rows go in blocks of 16, one vector lane per row, so a group's
 * quants for 16 rows meet the same x values (one broadcast) and each lane ends as one output.
 *
 * q4 layout, per block and group: 8 chunks c of 32 bytes, byte 2i + e of chunk c holding for the
 * block's row i q[j = 2c + e] in its low nibble and q[j = 2c + 16 + e] in its high nibble; then
 * the 16 scales and the 16 lows. y[n] = sum_g scale * sum_j q_j x_j + low * sum_j x_j.
 * With AVX-512 BF16, a quant word q | 0x4300 is the bfloat16 number 128 + q and vdpbf16ps sums
 * pairs of bfloat16 products in float32 lanes: 3 integer ops and 2 dot products per 64 weights;
 * the 128 is taken back with low' = low - 128 * scale.
 *
 * q8 layout, per block and group: 32 rows of 16 bytes, byte i of row j holding q[j] of the
 * block's row i; then the 16 scales. Each 16 bytes widen to 16 float32 lanes for one FMA.
 *
 * With AMX (Sapphire Rapids and later) and at least AMX_MIN_B rows of x, q4 goes to the tile
 * unit instead: the same 128 + q words, unpacked as above, are exactly a tile of 16 columns of
 * bfloat16 pairs (the low nibbles of chunk c are pair row c, the high ones pair row c + 8), so
 * one tile product per group gives sum_j (128 + q_j) x_j for every row of x and of the block at
 * once; the group's scale and low are then applied as on the vector path. At 16 rows of x a
 * layer's four matmuls take 244 us instead of 691 (`benchmarks/quant_matmul.py`; 4 rows: even).
 * Each call configures the tiles on every thread and releases them at the end, as torch's and
 * oneDNN's AMX kernels, which share the registers, expect.
 *
 * Products are exact, sums float32 (as torch's int4 kernel does it); y is rounded to bfloat16
 * once. Without AVX-512, plain C computes the same sums.
 */

#include <stdlib.h>

#include "common.h"

#define GROUP 32
#define LANES 16                                  /* rows per block */
#define Q4_BYTES (LANES * GROUP / 2 + LANES * 2 * 2) /* quants, then scales and lows */
#define Q8_BYTES (LANES * GROUP + LANES * 2)         /* quants, then scales */
#ifndef PREFETCH
#define PREFETCH 8 /* blocks ahead, in the order read */
#endif
#define MAX_B 8                                   /* rows of x per pass over W */
#define AMX_MIN_B 5 /* rows of x from which the tile unit is faster (measured in steps: 4 slower) */
#define AMX_MAX_B 16 /* rows of a tile */

/* sum_j x[b, 32g + j] for every row b and group g, from bfloat16 x [B, K] */
static void group_sums(const uint16_t *x, float *xs, int64_t B, int64_t K)
{
    for (int64_t i = 0; i < B * (K / GROUP); i++) {
        float s = 0.f;
        for (int j = 0; j < GROUP; j++)
            s += bf16_to_float(x[i * GROUP + j]);
        xs[i] = s;
    }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)

/* One block of 16 rows against B rows of x (B a constant at each call site, so the loops over it
 * unroll and the accumulators stay in registers). Two dot-product chains per row of x, low and
 * high nibbles, so the FMA units do not wait on one chain. */
INLINE void Q4_block(const uint16_t *x, const float *xs, const uint8_t *w, uint16_t *y,
                     int64_t N, int64_t K, const int B)
{
    const int64_t G = K / GROUP;
    const __m512i low_nibble = _mm512_set1_epi16(0x000f), bias = _mm512_set1_epi16(0x4300);
    __m512 acc[MAX_B];
    for (int b = 0; b < B; b++)
        acc[b] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++, w += Q4_BYTES) {
        /* two more chains (odd chunks) where few rows of x give too few to hide the latency */
        const int CHAINS = B <= 2 ? 2 : 1;
        __m512 lo_sum[MAX_B][2], hi_sum[MAX_B][2];
        for (int b = 0; b < B; b++)
            for (int k = 0; k < CHAINS; k++)
                lo_sum[b][k] = hi_sum[b][k] = _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {
            if (c % 2 == 0) /* the block's 5 cache lines: 4 of quants here, scales below */
                _mm_prefetch((const char *)(w + PREFETCH * Q4_BYTES + 32 * c), _MM_HINT_T0);
            const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(w + 32 * c)));
            /* (v & 15) | 0x4300 and (v >> 4) | 0x4300: bfloat16 128 + q */
            const __m512bh lo = (__m512bh)_mm512_ternarylogic_epi32(v, low_nibble, bias, 0xEA);
            const __m512bh hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(v, 4), bias);
            for (int b = 0; b < B; b++) {
                const uint16_t *xg = x + b * K + g * GROUP + 2 * c;
                const __m512bh x_lo = (__m512bh)_mm512_set1_epi32(*(const int32_t *)xg);
                const __m512bh x_hi = (__m512bh)_mm512_set1_epi32(*(const int32_t *)(xg + 16));
                lo_sum[b][c % CHAINS] = _mm512_dpbf16_ps(lo_sum[b][c % CHAINS], lo, x_lo);
                hi_sum[b][c % CHAINS] = _mm512_dpbf16_ps(hi_sum[b][c % CHAINS], hi, x_hi);
            }
        }
        _mm_prefetch((const char *)(w + PREFETCH * Q4_BYTES + LANES * GROUP / 2), _MM_HINT_T0);
        const uint16_t *sl = (const uint16_t *)(w + LANES * GROUP / 2);
        const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sl));
        const __m512 low = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sl + LANES)));
        const __m512 low_biased = _mm512_fnmadd_ps(_mm512_set1_ps(128.f), scale, low);
        for (int b = 0; b < B; b++) {
            __m512 sum = _mm512_add_ps(lo_sum[b][0], hi_sum[b][0]);
            if (CHAINS == 2)
                sum = _mm512_add_ps(sum, _mm512_add_ps(lo_sum[b][1], hi_sum[b][1]));
            acc[b] = _mm512_fmadd_ps(scale, sum, acc[b]);
            acc[b] = _mm512_fmadd_ps(low_biased, _mm512_set1_ps(xs[b * G + g]), acc[b]);
        }
    }
    for (int b = 0; b < B; b++)
        store_bf16(y + b * N, acc[b]);
}

#else

INLINE void Q4_block(const uint16_t *x, const float *xs, const uint8_t *w, uint16_t *y,
                     int64_t N, int64_t K, const int B)
{
    const int64_t G = K / GROUP;
    float acc[MAX_B][LANES] = {{0}};
    for (int64_t g = 0; g < G; g++, w += Q4_BYTES) {
        const uint16_t *sl = (const uint16_t *)(w + LANES * GROUP / 2);
        for (int b = 0; b < B; b++) {
            float dot[LANES] = {0};
            for (int c = 0; c < 8; c++)
                for (int i = 0; i < LANES; i++)
                    for (int e = 0; e < 2; e++) {
                        const uint8_t byte = w[32 * c + 2 * i + e];
                        const uint16_t *xg = x + b * K + g * GROUP + 2 * c + e;
                        dot[i] += (float)(byte & 15) * bf16_to_float(xg[0]) +
                                  (float)(byte >> 4) * bf16_to_float(xg[16]);
                    }
            for (int i = 0; i < LANES; i++)
                acc[b][i] += half_to_float(sl[i]) * dot[i] + half_to_float(sl[LANES + i]) * xs[b * G + g];
        }
    }
    for (int b = 0; b < B; b++)
        for (int i = 0; i < LANES; i++)
            y[b * N + i] = float_to_bf16(acc[b][i]);
}

#endif


#if defined(__AVX512F__)

/* One block of 16 rows against B rows of x (in float32, xf [B, K]). Up to four chains of FMAs
 * per row of x, as in Q4_block. */
INLINE void Q8_block(const uint16_t *x, const float *xf, const uint8_t *w, uint16_t *y,
                     int64_t N, int64_t K, const int B)
{
    (void)x;
    const int64_t G = K / GROUP;
    const int CHAINS = B == 1 ? 4 : (B == 2 ? 2 : 1);
    __m512 acc[MAX_B];
    for (int b = 0; b < B; b++)
        acc[b] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++, w += Q8_BYTES) {
        __m512 sum[MAX_B][4];
        for (int b = 0; b < B; b++)
            for (int k = 0; k < CHAINS; k++)
                sum[b][k] = _mm512_setzero_ps();
#pragma GCC unroll 32
        for (int j = 0; j < GROUP; j++) {
            if (j % 4 == 0)
                _mm_prefetch((const char *)(w + PREFETCH * Q8_BYTES + 16 * j), _MM_HINT_T0);
            const __m512 q = _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + 16 * j))));
            for (int b = 0; b < B; b++)
                sum[b][j % CHAINS] = _mm512_fmadd_ps(
                    q, _mm512_set1_ps(xf[b * K + g * GROUP + j]), sum[b][j % CHAINS]);
        }
        const __m512 scale =
            _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + LANES * GROUP)));
        for (int b = 0; b < B; b++) {
            __m512 s = sum[b][0];
            for (int k = 1; k < CHAINS; k++)
                s = _mm512_add_ps(s, sum[b][k]);
            acc[b] = _mm512_fmadd_ps(scale, s, acc[b]);
        }
    }
    for (int b = 0; b < B; b++)
        store_bf16(y + b * N, acc[b]);
}

#else

INLINE void Q8_block(const uint16_t *x, const float *xf, const uint8_t *w, uint16_t *y,
                     int64_t N, int64_t K, const int B)
{
    (void)x;
    const int64_t G = K / GROUP;
    float acc[MAX_B][LANES] = {{0}};
    for (int64_t g = 0; g < G; g++, w += Q8_BYTES) {
        const uint16_t *scale = (const uint16_t *)(w + LANES * GROUP);
        for (int b = 0; b < B; b++) {
            float dot[LANES] = {0};
            for (int j = 0; j < GROUP; j++)
                for (int i = 0; i < LANES; i++)
                    dot[i] += (float)(int8_t)w[16 * j + i] * xf[b * K + g * GROUP + j];
            for (int i = 0; i < LANES; i++)
                acc[b][i] += half_to_float(scale[i]) * dot[i];
        }
    }
    for (int b = 0; b < B; b++)
        for (int i = 0; i < LANES; i++)
            y[b * N + i] = float_to_bf16(acc[b][i]);
}

#endif

/* Every block of W against B <= MAX_B rows of x, the blocks split between the threads. `f` is
 * what the block function reads besides x: group sums (q4) or x in float32 (q8). */
#define PASS(KIND, B_)                                                                         \
    static void KIND##_pass_##B_(const uint16_t *x, const float *f, const uint8_t *w,          \
                                 uint16_t *y, int64_t N, int64_t K)                            \
    {                                                                                          \
        const int64_t bytes = (K / GROUP) * KIND##_BYTES;                                     \
        _Pragma("omp parallel for schedule(static)")                                           \
        for (int64_t n = 0; n < N / LANES; n++)                                                \
            KIND##_block(x, f, w + n * bytes, y + n * LANES, N, K, B_);                       \
    }
#define PASSES(KIND)                                                                           \
    PASS(KIND, 1) PASS(KIND, 2) PASS(KIND, 3) PASS(KIND, 4)                                    \
    PASS(KIND, 5) PASS(KIND, 6) PASS(KIND, 7) PASS(KIND, 8)                                    \
    static const pass_fn KIND##_passes[MAX_B + 1] = {                                          \
        0, KIND##_pass_1, KIND##_pass_2, KIND##_pass_3, KIND##_pass_4,                         \
        KIND##_pass_5, KIND##_pass_6, KIND##_pass_7, KIND##_pass_8};

typedef void (*pass_fn)(const uint16_t *, const float *, const uint8_t *, uint16_t *, int64_t,
                        int64_t);
PASSES(Q4)
PASSES(Q8)

/* x [B, K] in passes of MAX_B rows; f holds f_per_row floats for each row of x. */
static void run(const pass_fn *passes, const uint16_t *x, const float *f, int64_t f_per_row,
                const uint8_t *w, uint16_t *y, int64_t B, int64_t N, int64_t K)
{
    for (int64_t b0 = 0; b0 < B; b0 += MAX_B) {
        const int64_t nb = B - b0 < MAX_B ? B - b0 : MAX_B;
        passes[nb](x + b0 * K, f + b0 * f_per_row, w, y + b0 * N, N, K);
    }
}

#ifdef HAVE_AMX
/* q4 for B (AMX_MIN_B..16) rows of x: tile 0 the product [B, 16] float32, tile 1 x's group
 * [B, 32] bfloat16 (read in place), tile 2 the block's group as 16 pair rows of 16 columns. */
static void q4_amx(const uint16_t *x, const float *xs, const uint8_t *w, uint16_t *y, int64_t B,
                   int64_t N, int64_t K)
{
    const int64_t G = K / GROUP, bytes = G * Q4_BYTES;
#pragma omp parallel
    {
        struct tile_config cfg = {.palette = 1};
        cfg.rows[0] = cfg.rows[1] = (uint8_t)B;
        cfg.rows[2] = 16;
        cfg.bytes_per_row[0] = cfg.bytes_per_row[1] = cfg.bytes_per_row[2] = 64;
        _tile_loadconfig(&cfg);
        const __m512i low_nibble = _mm512_set1_epi16(0x000f), bias = _mm512_set1_epi16(0x4300);
        __attribute__((aligned(64))) uint16_t pairs[16 * 32];
        __attribute__((aligned(64))) float dot[AMX_MAX_B * LANES];
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N / LANES; n++) {
            const uint8_t *wg = w + n * bytes;
            __m512 acc[AMX_MAX_B];
            for (int b = 0; b < B; b++)
                acc[b] = _mm512_setzero_ps();
            for (int64_t g = 0; g < G; g++, wg += Q4_BYTES) {
                for (int line = 0; line < 5; line++) /* the block's 5 cache lines */
                    _mm_prefetch((const char *)(wg + PREFETCH * Q4_BYTES + 64 * line), _MM_HINT_T0);
                for (int c = 0; c < 8; c++) {
                    const __m512i v =
                        _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(wg + 32 * c)));
                    _mm512_store_si512(pairs + 32 * c,
                                       _mm512_ternarylogic_epi32(v, low_nibble, bias, 0xEA));
                    _mm512_store_si512(pairs + 32 * (c + 8),
                                       _mm512_or_si512(_mm512_srli_epi16(v, 4), bias));
                }
                _tile_zero(0);
                _tile_loadd(1, x + g * GROUP, K * 2);
                _tile_loadd(2, pairs, 64);
                _tile_dpbf16ps(0, 1, 2);
                _tile_stored(0, dot, 64);
                const uint16_t *sl = (const uint16_t *)(wg + LANES * GROUP / 2);
                const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sl));
                const __m512 low =
                    _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sl + LANES)));
                const __m512 low_biased = _mm512_fnmadd_ps(_mm512_set1_ps(128.f), scale, low);
                for (int b = 0; b < B; b++) {
                    acc[b] = _mm512_fmadd_ps(scale, _mm512_load_ps(dot + LANES * b), acc[b]);
                    acc[b] = _mm512_fmadd_ps(low_biased, _mm512_set1_ps(xs[b * G + g]), acc[b]);
                }
            }
            for (int b = 0; b < B; b++)
                store_bf16(y + b * N + n * LANES, acc[b]);
        }
        _tile_release();
    }
}
#endif

/* The rows of x from which q4 runs on AMX tiles here; 0 where it never does (no AMX in this
 * build, or Linux refused the tile registers). */
int64_t q4_tile_min_rows(void)
{
#ifdef HAVE_AMX
    return amx_granted() ? AMX_MIN_B : 0;
#else
    return 0;
#endif
}

/* x [B, K] bfloat16; w [N / 16, K / 32, Q4_BYTES or Q8_BYTES] as above; y [B, N] bfloat16.
 * K % 32 == 0 and N % 16 == 0 (the caller checks). */
void q4_matmul_bf16(const uint16_t *x, const uint8_t *w, uint16_t *y, int64_t B, int64_t N,
                    int64_t K)
{
    float *xs = malloc((size_t)(B * (K / GROUP)) * sizeof(float));
    group_sums(x, xs, B, K);
#ifdef HAVE_AMX
    if (B >= AMX_MIN_B && amx_granted()) {
        for (int64_t b0 = 0; b0 < B; b0 += AMX_MAX_B) { /* tiles of 16 rows, a short rest apart */
            const int64_t nb = B - b0 < AMX_MAX_B ? B - b0 : AMX_MAX_B;
            const int64_t G = K / GROUP;
            if (nb >= AMX_MIN_B)
                q4_amx(x + b0 * K, xs + b0 * G, w, y + b0 * N, nb, N, K);
            else
                run(Q4_passes, x + b0 * K, xs + b0 * G, G, w, y + b0 * N, nb, N, K);
        }
        free(xs);
        return;
    }
#endif
    run(Q4_passes, x, xs, K / GROUP, w, y, B, N, K);
    free(xs);
}

void q8_matmul_bf16(const uint16_t *x, const uint8_t *w, uint16_t *y, int64_t B, int64_t N,
                    int64_t K)
{
    float *xf = malloc((size_t)(B * K) * sizeof(float));
    for (int64_t i = 0; i < B * K; i++)
        xf[i] = bf16_to_float(x[i]);
    run(Q8_passes, x, xf, K, w, y, B, N, K);
    free(xf);
}
