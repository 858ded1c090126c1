/* y = x W^T for a quantized weight W [N, K] and bfloat16 rows x [B, K]: the matmuls of a decode
 * step, where every weight is read once per step and the time goes to memory and to turning a
 * few bits into numbers, and with AMX or AVX2 those of prompts too. Two of GGUF's forms, so
 * that the default model's weights are served exactly as its file holds them; both in groups
 * of 32 along each row:
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
 * With AMX (Sapphire Rapids and later), q4 goes to the tile unit instead (batch invariant, from
 * one row of x; else from amx_min_b), as a bfloat16 GEMM: each thread unpacks a pair of W
 * blocks into bfloat16 W tiles (w = q * scale + low in float32, rounded to nearest even:
 * exactly the bfloat16 weight the loader makes from the file, since q * scale is exact in
 * float32 and + low rounds once, as the file's dequantization does) and runs the rows of x
 * through them, 32 rows by 32 columns in four accumulator tiles that sum over all of K. A
 * weight is read from memory as 4 bits and unpacked once per call (per MiB of x), not once per
 * tile of rows, so this serves prompts as well as decode batches, faster than oneDNN on a
 * bfloat16 copy where the weights come from memory (docs/performance.md).
 * Each call configures the tiles on every thread and releases them at the end, as torch's and
 * oneDNN's AMX kernels, which share the registers, expect.
 *
 * Products are exact, sums float32 (as torch's int4 kernel does it); q4's y is rounded to
 * bfloat16 once, q8's (the logits) stays float32. With AVX2 alone (an AMD EPYC before Zen 4,
 * say), 8-lane FMAs on quants unpacked to float32 compute the same sums, in another order; with
 * neither, plain C does. With AVX2 alone, q4 by default quantizes x to int16 per group of 32
 * instead (batch invariant, from one row; else from qx_min_b) and multiplies in integers: exact
 * for every x within 2^7 of its group's largest, and faster (see gemm_int below; int8, faster
 * and lossy, is a choice). q8 does the same in int16. So does AVX-512 without BF16 (Skylake-X,
 * Ice Lake), in 512-bit tiles with VNNI's vpdpwssd / vpdpbusd where the CPU has them: the
 * same bits as the AVX2 build (int_tile_wide).
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
#define MAX_B 16 /* rows of x a block function takes */
/* Rows of x per pass over W. With AVX2 alone each pass unpacks every group's quants into
 * float32 again, so fewer, wider passes are faster (docs/performance.md). AVX-512 keeps 8 (not
 * measured there). */
#ifdef __AVX512F__
#define PASS_B 8
#else
#define PASS_B 16
#endif
/* Rows of x from which the tile unit is faster than the vector path in whole decode steps
 * (docs/performance.md); batch invariant, the tiles take every row count. The engine sets it
 * from kernels/paths.py, the one table of row cut-offs (q4_row_cutoffs). */
static int64_t amx_min_b = 6;
/* Rows of x from which q4 takes x in integers (gemm_int) where it is not batch invariant: at 1
 * row the float32 path, which unpacks each group straight into its FMAs, is about as fast
 * (docs/performance.md). Batch invariant, every row count takes it. Set as amx_min_b is. */
static int64_t qx_min_b = 2;

/* sum_j x[b, 32g + j] for every row b and group g, from bfloat16 x [B, K], j = 0 .. 31 in turn.
 * With AVX-512, 16 groups at a time, one a lane (the words of a pair gathered from 16 groups,
 * then each widened and added): the same additions in the same order, so the same sums, about
 * 8x faster; split between the threads from 64 groups. Done serially one element at a time, it
 * took 4-9 % of a prompt's q4 matmuls (docs/performance.md, session 29). */
static void group_sums(const uint16_t *x, float *xs, int64_t B, int64_t K)
{
    const int64_t n = B * (K / GROUP);
    int64_t done = 0; /* groups summed in vectors */
#ifdef __AVX512F__
    const int64_t vectors = n / LANES;
    const __m512i group = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7,
                                                              6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32(GROUP / 2));
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
#pragma omp parallel for schedule(static) if (n >= 64)
    for (int64_t v = 0; v < vectors; v++) {
        const int32_t *words = (const int32_t *)(x + v * LANES * GROUP);
        __m512 s = _mm512_setzero_ps();
        for (int j = 0; j < GROUP / 2; j++) {
            const __m512i pair = _mm512_i32gather_epi32(group, words + j, 4);
            s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16)));
            s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_and_si512(pair, high)));
        }
        _mm512_storeu_ps(xs + v * LANES, s);
    }
    done = vectors * LANES;
#endif
    for (int64_t i = done; i < n; i++) {
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
                     int64_t N, int64_t K, const int B, const int fixed)
{
    const int64_t G = K / GROUP;
    const __m512i low_nibble = _mm512_set1_epi16(0x000f), bias = _mm512_set1_epi16(0x4300);
    __m512 acc[MAX_B];
    for (int b = 0; b < B; b++)
        acc[b] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++, w += Q4_BYTES) {
        /* two more chains (odd chunks) where few rows of x give too few to hide the latency;
         * `fixed`: one chain whatever B, so that a row's sums do not depend on its batch */
        const int CHAINS = B <= 2 && !fixed ? 2 : 1;
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

#define Q4_READS_X_F32 0 /* the block reads x as bfloat16; f holds only its group sums */
/* gemm_int below serves too, but only when asked for (`--int4-activations`): int16 x runs at
 * vdpbf16ps's rate, so the exact bfloat16 products stay the default; int8 x (vpdpbusd) runs
 * at twice that, about 0.7 % off (docs/performance.md, session 28) */
#ifndef Q4_INT8
#define Q4_INT8 1
#endif
#ifndef Q4_X_BITS
#define Q4_X_BITS 0
#endif

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#define Q4_READS_X_F32 1 /* f holds each row's group sums, then the row in float32 */
#ifndef Q4_INT8 /* (tests build it with -DQ4_INT8=0 too) */
#define Q4_INT8 1 /* gemm_int below serves, with x in integers */
#endif
#ifndef Q4_FUSED_MAX_B
#define Q4_FUSED_MAX_B 2 /* rows of x up to which quants are not stored once unpacked */
#endif

/* The block's 16 rows' sums over one group, as 8-lane vectors after hadd: rows 0 1 4 5 2 3 6 7
 * of each 8. QUAD_ORDER permutes 8 lanes of rows 0-7 into that order (and back: it is its own
 * inverse). */
#define QUAD_ORDER 0xD8

/* 8 float32 lanes of rows 0-7 into quad order, or back */
INLINE __m256 quads(__m256 v)
{
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(v), QUAD_ORDER));
}

/* 16 float32 lanes in rows 0 1 4 5 2 3 6 7 | 8 9 12 13 10 11 14 15 order -> 16 bfloat16 */
INLINE void store_bf16_quads(uint16_t *dst, __m256 a, __m256 b)
{
    store_bf16_8(dst, quads(a));
    store_bf16_8(dst + 8, quads(b));
}

/* x[0], x[1] in every pair of lanes */
INLINE __m256 pair(const float *x)
{
    return _mm256_castpd_ps(_mm256_broadcast_sd((const double *)x));
}

/* 8 float16 at p -> float32 lanes in quad order */
INLINE __m256 load_half_quads(const uint16_t *p)
{
    return quads(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)));
}

/* One block of 16 rows against B rows of x, with AVX2's 8-lane FMAs. Each group's quants are
 * unpacked once into float32 vectors (vector m of a chunk: bytes 8m..8m+7, so lane 2i + e holds
 * row 4m + i's quant for x[2c + e], low nibble, or x[2c + 16 + e], high nibble), and each row of
 * x then runs through them with its pairs (x[2c], x[2c + 1]) broadcast to every lane pair; at the
 * group's end hadd sums each pair into its row. Eight chains of FMAs per row of x. */
INLINE void Q4_block(const uint16_t *x, const float *f, const uint8_t *w, uint16_t *y,
                     int64_t N, int64_t K, const int B, const int fixed)
{
    (void)x, (void)fixed; /* each row's sums are the same whatever B */
    const int64_t G = K / GROUP;
    const __m256i nibble = _mm256_set1_epi32(15);
    __m256 acc[MAX_B][2];
    for (int b = 0; b < B; b++)
        acc[b][0] = acc[b][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++, w += Q4_BYTES) {
        /* Up to Q4_FUSED_MAX_B rows of x, each quant vector goes into FMAs as it is unpacked
         * (d[b][m]: low nibbles, d[b][4 + m]: high, lanes 2i + e); for more, the group is
         * unpacked once into q[chunk][low nibbles of rows 0-3, 4-7, 8-11, 12-15; high the
         * same], and each row of x goes through it below. */
        __m256 d[Q4_FUSED_MAX_B][8], q[8][8];
        for (int b = 0; b < (B <= Q4_FUSED_MAX_B ? B : 0); b++)
            for (int k = 0; k < 8; k++)
                d[b][k] = _mm256_setzero_ps();
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {
            if (c % 2 == 0)
                _mm_prefetch((const char *)(w + PREFETCH * Q4_BYTES + 32 * c), _MM_HINT_T0);
            for (int m = 0; m < 4; m++) {
                const __m256i v =
                    _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + 32 * c + 8 * m)));
                const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, nibble));
                const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
                if (B > Q4_FUSED_MAX_B) {
                    q[c][m] = lo;
                    q[c][4 + m] = hi;
                    continue;
                }
                for (int b = 0; b < B; b++) {
                    const float *xg = f + b * (G + K) + G + g * GROUP;
                    d[b][m] = _mm256_fmadd_ps(lo, pair(xg + 2 * c), d[b][m]);
                    d[b][4 + m] = _mm256_fmadd_ps(hi, pair(xg + 16 + 2 * c), d[b][4 + m]);
                }
            }
        }
        _mm_prefetch((const char *)(w + PREFETCH * Q4_BYTES + LANES * GROUP / 2), _MM_HINT_T0);
        const uint16_t *sl = (const uint16_t *)(w + LANES * GROUP / 2);
        const __m256 scale[2] = {load_half_quads(sl), load_half_quads(sl + 8)};
        const __m256 low[2] = {load_half_quads(sl + LANES), load_half_quads(sl + LANES + 8)};
        for (int b = 0; b < B; b++) {
            __m256 e[8];
            if (B <= Q4_FUSED_MAX_B)
                for (int k = 0; k < 8; k++)
                    e[k] = d[b][k];
            else {
                const float *xg = f + b * (G + K) + G + g * GROUP;
                for (int k = 0; k < 8; k++)
                    e[k] = _mm256_setzero_ps();
#pragma GCC unroll 8
                for (int c = 0; c < 8; c++)
                    for (int m = 0; m < 4; m++) {
                        e[m] = _mm256_fmadd_ps(q[c][m], pair(xg + 2 * c), e[m]);
                        e[4 + m] = _mm256_fmadd_ps(q[c][4 + m], pair(xg + 16 + 2 * c), e[4 + m]);
                    }
            }
            const __m256 sums[2] = {
                _mm256_hadd_ps(_mm256_add_ps(e[0], e[4]), _mm256_add_ps(e[1], e[5])),
                _mm256_hadd_ps(_mm256_add_ps(e[2], e[6]), _mm256_add_ps(e[3], e[7]))};
            const __m256 xs = _mm256_broadcast_ss(f + b * (G + K) + g);
            for (int h = 0; h < 2; h++) {
                acc[b][h] = _mm256_fmadd_ps(scale[h], sums[h], acc[b][h]);
                acc[b][h] = _mm256_fmadd_ps(low[h], xs, acc[b][h]);
            }
        }
    }
    for (int b = 0; b < B; b++)
        store_bf16_quads(y + b * N, acc[b][0], acc[b][1]);
}

#else

#define Q4_READS_X_F32 1

INLINE void Q4_block(const uint16_t *x, const float *f, const uint8_t *w, uint16_t *y,
                     int64_t N, int64_t K, const int B, const int fixed)
{
    (void)x, (void)fixed; /* each row's sums are the same whatever B */
    const int64_t G = K / GROUP;
    float acc[MAX_B][LANES] = {{0}};
    for (int64_t g = 0; g < G; g++, w += Q4_BYTES) {
        const uint16_t *sl = (const uint16_t *)(w + LANES * GROUP / 2);
        for (int b = 0; b < B; b++) {
            const float *row = f + b * (G + K), *xg = row + G + g * GROUP;
            float dot[LANES] = {0};
            for (int c = 0; c < 8; c++)
                for (int i = 0; i < LANES; i++)
                    for (int e = 0; e < 2; e++) {
                        const uint8_t byte = w[32 * c + 2 * i + e];
                        dot[i] += (float)(byte & 15) * xg[2 * c + e] +
                                  (float)(byte >> 4) * xg[2 * c + 16 + e];
                    }
            for (int i = 0; i < LANES; i++)
                acc[b][i] += half_to_float(sl[i]) * dot[i] + half_to_float(sl[LANES + i]) * row[g];
        }
    }
    for (int b = 0; b < B; b++)
        for (int i = 0; i < LANES; i++)
            y[b * N + i] = float_to_bf16(acc[b][i]);
}

#endif

#ifndef Q4_INT8
#define Q4_INT8 0
#endif


#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && !defined(Q8_FMA)

/* One block of 16 rows against B rows of x (bfloat16, read as pairs). Each pair of a group's
 * inputs (2k, 2k + 1) is widened to bfloat16 pairs for the block's 16 rows (exact: |q| <= 127
 * takes 7 bits) and meets x's pair in one vdpbf16ps, 32 multiply-adds where the float32 FMAs
 * below (-DQ8_FMA) do 16. Two chains per row whatever B (batch invariance). The logits head of
 * a 16-token decode step on AMD EPYC Zen 5, 2 threads: 2.21 -> 1.58 ms; 1 row: the same
 * (0.40 ms; docs/performance.md, session 27). */
INLINE void Q8_block(const uint16_t *x, const float *xf, const uint8_t *w, float *y,
                     int64_t N, int64_t K, const int B, const int fixed)
{
    (void)xf, (void)fixed;
    const int64_t G = K / GROUP;
    const __m512i pairs = pair_up(); /* lane i of the result: input 2k's and 2k + 1's */
    __m512 acc[MAX_B];
    for (int b = 0; b < B; b++)
        acc[b] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++, w += Q8_BYTES) {
        __m512 sum[MAX_B][2];
        for (int b = 0; b < B; b++)
            sum[b][0] = sum[b][1] = _mm512_setzero_ps();
#pragma GCC unroll 16
        for (int k = 0; k < GROUP / 2; k++) {
            if (k % 2 == 0)
                _mm_prefetch((const char *)(w + PREFETCH * Q8_BYTES + 32 * k), _MM_HINT_T0);
            const __m512 q0 = _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + 32 * k))));
            const __m512 q1 = _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + 32 * k + 16))));
            const __m512bh q =
                (__m512bh)_mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(q1, q0));
            for (int b = 0; b < B; b++) {
                const __m512bh xk = (__m512bh)_mm512_set1_epi32(
                    *(const int32_t *)(x + b * K + g * GROUP + 2 * k));
                sum[b][k % 2] = _mm512_dpbf16_ps(sum[b][k % 2], q, xk);
            }
        }
        const __m512 scale =
            _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + LANES * GROUP)));
        for (int b = 0; b < B; b++)
            acc[b] = _mm512_fmadd_ps(scale, _mm512_add_ps(sum[b][0], sum[b][1]), acc[b]);
    }
    for (int b = 0; b < B; b++)
        _mm512_storeu_ps(y + b * N, acc[b]);
}
#define Q8_READS_X_F32 0 /* the block reads x as bfloat16 */
/* and serves whatever q4 takes: faster than x in int16 at decode sizes (16 rows on the Zen 4:
 * 2.9 against 3.8 ms; docs/performance.md, session 28) */
#define Q8_INT 0

#elif defined(__AVX512F__)

/* One block of 16 rows against B rows of x (in float32, xf [B, K]). Up to four chains of FMAs
 * per row of x, as in Q4_block. */
INLINE void Q8_block(const uint16_t *x, const float *xf, const uint8_t *w, float *y,
                     int64_t N, int64_t K, const int B, const int fixed)
{
    (void)x;
    const int64_t G = K / GROUP;
    /* `fixed`: two chains whatever B, so that a row's sums do not depend on its batch */
    const int CHAINS = fixed ? 2 : (B == 1 ? 4 : (B == 2 ? 2 : 1));
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
        _mm512_storeu_ps(y + b * N, acc[b]);
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

/* One block of 16 rows against B rows of x (in float32, xf [B, K]), with AVX2's 8-lane FMAs:
 * each group's quants unpacked once into float32 (rows 0-7 and 8-15 of input j), then every row
 * of x through them, in four chains of FMAs per half. */
INLINE void Q8_block(const uint16_t *x, const float *xf, const uint8_t *w, float *y,
                     int64_t N, int64_t K, const int B, const int fixed)
{
    (void)x, (void)fixed; /* each row's sums are the same whatever B */
    const int64_t G = K / GROUP;
    __m256 acc[MAX_B][2];
    for (int b = 0; b < B; b++)
        acc[b][0] = acc[b][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++, w += Q8_BYTES) {
        __m256 q[GROUP][2];
#pragma GCC unroll 32
        for (int j = 0; j < GROUP; j++) {
            if (j % 4 == 0)
                _mm_prefetch((const char *)(w + PREFETCH * Q8_BYTES + 16 * j), _MM_HINT_T0);
            const __m128i bytes = _mm_loadu_si128((const __m128i *)(w + 16 * j));
            q[j][0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
            q[j][1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
        }
        const uint16_t *sl = (const uint16_t *)(w + LANES * GROUP);
        const __m256 scale[2] = {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sl)),
                                 _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sl + 8)))};
        for (int b = 0; b < B; b++) {
            const float *xg = xf + b * K + g * GROUP;
            __m256 s[2][4];
            for (int k = 0; k < 4; k++)
                s[0][k] = s[1][k] = _mm256_setzero_ps();
#pragma GCC unroll 32
            for (int j = 0; j < GROUP; j++) {
                const __m256 xj = _mm256_broadcast_ss(xg + j);
                s[0][j % 4] = _mm256_fmadd_ps(q[j][0], xj, s[0][j % 4]);
                s[1][j % 4] = _mm256_fmadd_ps(q[j][1], xj, s[1][j % 4]);
            }
            for (int h = 0; h < 2; h++) {
                const __m256 sum = _mm256_add_ps(_mm256_add_ps(s[h][0], s[h][1]),
                                                 _mm256_add_ps(s[h][2], s[h][3]));
                acc[b][h] = _mm256_fmadd_ps(scale[h], sum, acc[b][h]);
            }
        }
    }
    for (int b = 0; b < B; b++) {
        _mm256_storeu_ps(y + b * N, acc[b][0]);
        _mm256_storeu_ps(y + b * N + 8, acc[b][1]);
    }
}

#else

INLINE void Q8_block(const uint16_t *x, const float *xf, const uint8_t *w, float *y,
                     int64_t N, int64_t K, const int B, const int fixed)
{
    (void)x, (void)fixed;
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
            y[b * N + i] = acc[b][i];
}

#endif

/* One block of W (its quants at w, its outputs at y) against B <= PASS_B rows of x. `f` is what
 * the block function reads besides x: group sums (q4; and x in float32 after them, where
 * Q4_READS_X_F32) or x in float32 (q8). y is bfloat16 (q4) or float32 (q8, the logits).
 * `fixed`: each row's arithmetic the same whatever B (see q4_batch_invariant). */
#define PASS(KIND, Y, B_)                                                                      \
    static void KIND##_pass_##B_(const uint16_t *x, const float *f, const uint8_t *w, void *y, \
                                 int64_t N, int64_t K, int fixed)                              \
    {                                                                                          \
        if (fixed)                                                                             \
            KIND##_block(x, f, w, (Y *)y, N, K, B_, 1);                                        \
        else                                                                                   \
            KIND##_block(x, f, w, (Y *)y, N, K, B_, 0);                                        \
    }
#define PASSES(KIND, Y)                                                                        \
    PASS(KIND, Y, 1) PASS(KIND, Y, 2) PASS(KIND, Y, 3) PASS(KIND, Y, 4)                        \
    PASS(KIND, Y, 5) PASS(KIND, Y, 6) PASS(KIND, Y, 7) PASS(KIND, Y, 8)                        \
    PASS(KIND, Y, 9) PASS(KIND, Y, 10) PASS(KIND, Y, 11) PASS(KIND, Y, 12)                     \
    PASS(KIND, Y, 13) PASS(KIND, Y, 14) PASS(KIND, Y, 15) PASS(KIND, Y, 16)                    \
    static const pass_fn KIND##_passes[MAX_B + 1] = {                                          \
        0,              KIND##_pass_1,  KIND##_pass_2,  KIND##_pass_3,  KIND##_pass_4,         \
        KIND##_pass_5,  KIND##_pass_6,  KIND##_pass_7,  KIND##_pass_8,  KIND##_pass_9,         \
        KIND##_pass_10, KIND##_pass_11, KIND##_pass_12, KIND##_pass_13, KIND##_pass_14,        \
        KIND##_pass_15, KIND##_pass_16};

typedef void (*pass_fn)(const uint16_t *, const float *, const uint8_t *, void *, int64_t,
                        int64_t, int);
PASSES(Q4, uint16_t)
PASSES(Q8, float)

/* Batch invariance (on unless the engine turns it off): every row of x is computed by the same
 * arithmetic whatever the number of rows in the call, so that a token's outputs do not depend
 * on what else its step holds (docs/architecture.md, "Batch invariance"). Off, the kernel picks
 * by row count: AMX tiles from amx_min_b rows, integer x from qx_min_b, more FMA chains for a
 * row or two. */
static int invariant = 1;

/* The row counts from which q4 takes the tiles and integer x where it is not batch invariant
 * (kernels/paths.py); a value below 1 leaves that one as it is. For the whole process. */
void q4_row_cutoffs(int64_t tiles, int64_t integers)
{
    if (tiles >= 1)
        amx_min_b = tiles;
    if (integers >= 1)
        qx_min_b = integers;
}

/* Sets it (0 or 1), or with -1 only asks; returns the setting now in force. For the whole
 * process, as q4_activation_bits. */
int64_t q4_batch_invariant(int64_t on)
{
    if (on == 0 || on == 1)
        invariant = (int)on;
    return invariant;
}

/* Bytes of x whose rows every thread's W blocks take in turn before the next rows: they stay
 * in L2 between blocks. Sweeping all of a 1,024-row prompt's x past each block read it from L3
 * block after block: a layer's four matmuls 1.08-1.10x faster at 1,024 rows, the same at 256
 * (AMD EPYC Zen 5, docs/performance.md, session 27). */
#ifndef X_SWEEP_BYTES
#define X_SWEEP_BYTES (256 << 10)
#endif

/* How the threads share a matmul's blocks of W (the vector passes and the integer tiles):
 * guided, large chunks first and smaller ones as the blocks run out, rather than static halves,
 * so that a thread held back (the API process shares these cores) does not leave the other
 * waiting at the end. In W2's server the engine's OpenMP waiting fell from 15 % to 10 % of its
 * samples and prompt steps took 3-8 % less a token (Zen 4, docs/performance.md, session 31).
 * Which thread takes a block changes no bits. */
#define BLOCK_SCHEDULE guided

/* x [B, K] in passes of PASS_B rows; f holds f_per_row floats for each row of x; y's rows are
 * N elements of y_size bytes. The blocks are split between the threads, and each block goes
 * through every pass of a sweep (X_SWEEP_BYTES of x) while it is in L1, so that more than
 * PASS_B rows (the logits of a decode step of 16 sequences) read W from memory once, not once
 * a pass. Each row's arithmetic is the same in any pass or sweep. */
INLINE int64_t sweep_rows(int64_t K)
{
    const int64_t sweep = X_SWEEP_BYTES / (K * 2) / PASS_B * PASS_B;
    return sweep < PASS_B ? PASS_B : sweep;
}

static void run(const pass_fn *passes, const uint16_t *x, const float *f, int64_t f_per_row,
                const uint8_t *w, void *y, int64_t y_size, int64_t block_bytes, int64_t B,
                int64_t N, int64_t K)
{
    const int fixed = invariant;
    const int64_t sweep = sweep_rows(K);
#pragma omp parallel
    for (int64_t b1 = 0; b1 < B; b1 += sweep) {
        const int64_t end = B - b1 < sweep ? B : b1 + sweep;
#pragma omp for schedule(BLOCK_SCHEDULE) nowait
        for (int64_t n = 0; n < N / LANES; n++)
            for (int64_t b0 = b1; b0 < end; b0 += PASS_B) {
                const int64_t nb = end - b0 < PASS_B ? end - b0 : PASS_B;
                passes[nb](x + b0 * K, f + b0 * f_per_row, w + n * (K / GROUP) * block_bytes,
                           (char *)y + (b0 * N + n * LANES) * y_size, N, K, fixed);
            }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#define FUSED_SILU 1
/* out[0 .. 15] = silu_and_mul of 16 bfloat16 gate and up values, in the lanes cpu_ops.c's
 * silu_and_mul_bf16 takes in this build, so with its bits */
INLINE void silu_store(const uint16_t *gate, const uint16_t *up, uint16_t *out)
{
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    store_bf16(out, silu_mul16(load_bf16(gate), load_bf16(up)));
#else
    for (int h = 0; h < LANES; h += 8)
        store_bf16_8(out + h, silu_mul8(load_bf16_8(gate + h), load_bf16_8(up + h)));
#endif
}

/* act [B, I] = silu_and_mul of a q4 gate/up projection (w: I gate rows, then I up rows) through
 * the vector passes: each thread takes a gate block and its up block together, pass by pass,
 * into two small buffers, and stores silu_store of them: the bits of q4_matmul_bf16 and then
 * silu_and_mul_bf16, without writing the projection's output and reading it back (a 256-token
 * prompt step's silu took 4.5 ms on the Zen 4; docs/performance.md, session 29). f: x_sums. */
static void run_silu(const uint16_t *x, const float *f, const uint8_t *w, uint16_t *act,
                     int64_t B, int64_t I, int64_t K)
{
    const int fixed = invariant;
    const int64_t sweep = sweep_rows(K), G = K / GROUP, per_row = G + (Q4_READS_X_F32 ? K : 0);
    const int64_t gate_blocks = I / LANES;
#pragma omp parallel
    {
        uint16_t gate[PASS_B * LANES], up[PASS_B * LANES];
        for (int64_t b1 = 0; b1 < B; b1 += sweep) {
            const int64_t end = B - b1 < sweep ? B : b1 + sweep;
#pragma omp for schedule(BLOCK_SCHEDULE) nowait
            for (int64_t n = 0; n < gate_blocks; n++)
                for (int64_t b0 = b1; b0 < end; b0 += PASS_B) {
                    const int64_t nb = end - b0 < PASS_B ? end - b0 : PASS_B;
                    const float *fb = f + b0 * per_row;
                    Q4_passes[nb](x + b0 * K, fb, w + n * G * Q4_BYTES, gate, LANES, K, fixed);
                    Q4_passes[nb](x + b0 * K, fb, w + (gate_blocks + n) * G * Q4_BYTES, up, LANES,
                                  K, fixed);
                    for (int64_t r = 0; r < nb; r++)
                        silu_store(gate + r * LANES, up + r * LANES,
                                   act + (b0 + r) * I + n * LANES);
                }
        }
    }
}
#else
#define FUSED_SILU 0
#endif

#ifdef HAVE_AMX
/* q4 on the tile unit, as a bfloat16 GEMM (see the top of the file). */
#define PAIR_ROWS 16 /* a W tile: 16 rows of (input 2r, input 2r + 1) pairs, 16 columns */
#define CHUNK_BYTES (1 << 20) /* of x per pass over W: it stays in L2 (2 MiB a core with AMX) */

/* One tile row: 16 bfloat16 pairs, columns 0-7 from lo and 8-15 from hi, whose lane 2i + e holds
 * q of column i's input of parity e, in float32; scale and low are duplicated into lanes the same
 * way. */
INLINE void dequant_pair_row(uint16_t *dst, __m512 q_lo, __m512 q_hi, __m512 scale_lo,
                             __m512 scale_hi, __m512 low_lo, __m512 low_hi)
{
    const __m512 lo = _mm512_fmadd_ps(q_lo, scale_lo, low_lo);
    const __m512 hi = _mm512_fmadd_ps(q_hi, scale_hi, low_hi);
    _mm512_store_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

/* Group wg (Q4_BYTES) of a block -> the W tile dst [PAIR_ROWS][16 columns][2] bfloat16. Byte
 * 2i + e of chunk c holds column i's q[2c + e] in its low nibble (pair row c) and q[2c + 16 + e]
 * in its high one (pair row c + 8): widened to 32 bits, each half chunk is already in the
 * tile's order of (column, parity). A nibble becomes a float32 by vpermps from the table 0..15,
 * which reads the low 4 bits of each index: the low nibble without masking it off, and on port
 * 5, where vcvtdq2ps would take port 0 from the tile unit (1.5x the groups a second at one row of
 * x with hot caches on the AMX Xeon; docs/performance.md, session 25). */
INLINE void dequant_group(const uint8_t *wg, uint16_t *dst)
{
    const __m512 values = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i pairs_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i pairs_hi = _mm512_add_epi32(pairs_lo, _mm512_set1_epi32(8));
    const uint16_t *sl = (const uint16_t *)(wg + LANES * GROUP / 2);
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sl));
    const __m512 low = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sl + LANES)));
    const __m512 scale_lo = _mm512_permutexvar_ps(pairs_lo, scale);
    const __m512 scale_hi = _mm512_permutexvar_ps(pairs_hi, scale);
    const __m512 low_lo = _mm512_permutexvar_ps(pairs_lo, low);
    const __m512 low_hi = _mm512_permutexvar_ps(pairs_hi, low);
    for (int c = 0; c < 8; c++) {
        const __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(wg + 32 * c)));
        const __m512i hi =
            _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(wg + 32 * c + 16)));
        dequant_pair_row(dst + 32 * c, _mm512_permutexvar_ps(lo, values),
                         _mm512_permutexvar_ps(hi, values), scale_lo, scale_hi, low_lo, low_hi);
        dequant_pair_row(dst + 32 * (c + 8),
                         _mm512_permutexvar_ps(_mm512_srli_epi32(lo, 4), values),
                         _mm512_permutexvar_ps(_mm512_srli_epi32(hi, 4), values), scale_lo,
                         scale_hi, low_lo, low_hi);
    }
}

/* A block's results on their way to y: its accumulator tiles, stored as float32 at the end of
 * its gemm_block call, then rounded to bfloat16 (or put through silu) and written to y a few
 * rows at a time while the tile unit works on the next block, so that the vector work and
 * y's cache misses overlap the tile unit's instead of following it (docs/performance.md,
 * session 26). Rows 0 .. ra - 1 are ya's (tiles 0, 1), then rb rows of yb's (tiles 2, 3). */
struct epilogue {
    __attribute__((aligned(64))) float acc[4][16 * 16];
    uint16_t *ya, *yb;
    int64_t N;              /* y's row length */
    int ra, rb, done, todo; /* rows of ya, of yb; rows written, rows to write */
    int wide, silu;         /* tiles 1 and 3 hold a second block; silu: see gemm_block */
};

/* Up to `count` more of e's rows to y, rounded to bfloat16; with silu, a gate and an up
 * block's columns rounded to bfloat16 first, as storing the projection's output would, then
 * silu_and_mul's arithmetic (silu_mul16), so that the bits are those of the two kernels one
 * after the other. */
INLINE void epilogue_rows(struct epilogue *e, int count)
{
    for (; count > 0 && e->done < e->todo; count--, e->done++) {
        const int second = e->done >= e->ra, r = second ? e->done - e->ra : e->done;
        const float *lo = e->acc[2 * second] + 16 * r, *hi = e->acc[2 * second + 1] + 16 * r;
        uint16_t *y = (second ? e->yb : e->ya) + r * e->N;
        if (e->silu)
            store_bf16(y, silu_mul16(round_bf16_16(_mm512_load_ps(lo)),
                                     round_bf16_16(_mm512_load_ps(hi))));
        else if (e->wide) /* 32 columns: one 64-byte store */
            _mm512_storeu_si512(y, (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(hi),
                                                                _mm512_load_ps(lo)));
        else
            store_bf16(y, _mm512_load_ps(lo));
    }
}

/* Rows of e written per group of the next block: 2 x 16 rows in 16 groups (K = 512) */
#ifndef EPILOGUE_ROWS
#define EPILOGUE_ROWS 2
#endif

/* Software prefetch of the quants, in groups ahead of the one unpacked (0: none). The tile path
 * does little else per byte at a few rows of x, so without it the unpacking waits on memory
 * (docs/performance.md, session 25). */
#ifndef AMX_PREFETCH
#define AMX_PREFETCH 4
#endif

/* W tiles that serve one call of gemm_block only (a chunk of at most two x tiles: decode) go
 * through a ring of this many groups' tiles, which stays in L1, instead of a buffer of all G. */
#ifndef AMX_RING
#define AMX_RING 4
#endif

/* The block whose quants start at q: its group h's cache lines on their way to L1. Past the
 * block's G groups, the same groups of the block `next` bytes on: the same block of the
 * thread's next pair (threads take consecutive pairs: two neighbouring blocks, or with silu a
 * gate block and its up block, so the next pair's starts one or two blocks on). */
INLINE void prefetch_group(const uint8_t *q, int64_t h, int64_t G, int64_t next)
{
    const char *p = (const char *)(h < G ? q + h * Q4_BYTES : q + next + (h - G) * Q4_BYTES);
    for (int line = 0; line < Q4_BYTES / 64; line++)
        _mm_prefetch(p + 64 * line, _MM_HINT_T0);
}

/* With q0 (and q1), the quants of one (two) blocks: their group g unpacked into W tiles, at
 * w0 (w1) + PAIR_ROWS * 32 * (g & ring). */
INLINE void dequant_groups(const uint8_t *q0, const uint8_t *q1, uint16_t *w0, uint16_t *w1,
                           int64_t g, int64_t G, int64_t ring, int64_t next)
{
    if (AMX_PREFETCH) {
        prefetch_group(q0, g + AMX_PREFETCH, G, next);
        if (w1)
            prefetch_group(q1, g + AMX_PREFETCH, G, next);
    }
    dequant_group(q0 + g * Q4_BYTES, w0 + PAIR_ROWS * 32 * (g & ring));
    if (w1)
        dequant_group(q1 + g * Q4_BYTES, w1 + PAIR_ROWS * 32 * (g & ring));
}

/* Two x tiles xa, xb (xb may be NULL) by the W tiles of one or two blocks (w1 may be NULL),
 * summed over all G groups in accumulator tiles 0-3: [xa w0, xa w1, xb w0, xb w1]. With q0
 * (and q1), the blocks' quants, the W tiles are unpacked first, a group ahead of the tile
 * unit, so that the unpacking overlaps its work and a tile is not loaded while the stores that
 * wrote it are still on their way; ring: W tile g is at w + PAIR_ROWS * 32 * (g & ring) (-1:
 * every group its own). x_stride: bytes between an x tile's rows (each row a group's 32
 * inputs, the next group's GROUP elements on); ra, rb: rows of ya, yb to write, N apart,
 * through e (which first writes the previous call's rows). silu: the blocks are a gate and an
 * up block of the same columns, and ya, yb get silu(gate) * up (16 columns) instead of the two
 * blocks' outputs. */
static void gemm_block(const uint16_t *xa, int ra, const uint16_t *xb, int rb, int64_t x_stride,
                       uint16_t *w0, uint16_t *w1, const uint8_t *q0, const uint8_t *q1,
                       uint16_t *ya, uint16_t *yb, int64_t N, int64_t G, int64_t ring,
                       int64_t next, int silu, struct epilogue *e)
{
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    if (q0)
        dequant_groups(q0, q1, w0, w1, 0, G, ring, next);
    for (int64_t g = 0; g < G; g++) {
        if (q0 && g + 1 < G)
            dequant_groups(q0, q1, w0, w1, g + 1, G, ring, next);
        for (int line = 0; line < ra; line++) { /* the next group's x tiles, on their way to L1 */
            _mm_prefetch((const char *)(xa + GROUP * (g + 1)) + x_stride * line, _MM_HINT_T0);
            if (xb && line < rb)
                _mm_prefetch((const char *)(xb + GROUP * (g + 1)) + x_stride * line,
                             _MM_HINT_T0);
        }
        const uint16_t *wt0 = w0 + PAIR_ROWS * 32 * (g & ring);
        _tile_loadd(4, xa + GROUP * g, x_stride);
        _tile_loadd(6, wt0, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (w1) {
            _tile_loadd(7, w1 + PAIR_ROWS * 32 * (g & ring), 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (xb) {
            _tile_loadd(5, xb + GROUP * g, x_stride);
            _tile_dpbf16ps(2, 5, 6);
            if (w1)
                _tile_dpbf16ps(3, 5, 7);
        }
        epilogue_rows(e, EPILOGUE_ROWS);
    }
    epilogue_rows(e, e->todo);
    _tile_stored(0, e->acc[0], 64);
    if (w1)
        _tile_stored(1, e->acc[1], 64);
    if (xb) {
        _tile_stored(2, e->acc[2], 64);
        if (w1)
            _tile_stored(3, e->acc[3], 64);
    }
    e->ya = ya, e->yb = yb, e->N = N, e->ra = ra, e->rb = xb ? rb : 0;
    e->wide = w1 != NULL, e->silu = silu, e->done = 0, e->todo = e->ra + e->rb;
}

/* y [M, N] = x [M, K] W^T for q4 W on the tile unit. Each thread takes blocks of W two at a time
 * (32 columns), unpacks them to bfloat16 W tiles in its own buffer as the first two x tiles go
 * through, and runs the rest of the chunk's x tiles through those. The x tiles are read where x
 * lies, rows K apart: up to 16 rows (decode) the tiles are configured to M rows (each row's
 * sums are the same whatever M); from 17, a last tile of fewer than 16 rows is copied first,
 * with zero rows after them, so that no tile reads past x. (Copying all of x into 1 KiB tiles
 * first, as before, made the four matmuls of a layer 1.07-1.18x slower at 100-1,024 rows on
 * two threads of the AMX Xeon: docs/performance.md, session 26.) silu: W is a gate/up
 * projection (its first N / 2 rows the gate, then the up, N / 2 a whole number of blocks), and
 * y [M, N / 2] gets silu(x Wg^T) * (x Wu^T): each thread takes a gate block with the up block
 * of the same columns, in place of two neighbours. */
static void q4_gemm_amx(const uint16_t *x, const uint8_t *w, uint16_t *y, int64_t M, int64_t N,
                        int64_t K, int silu)
{
    const int64_t G = K / GROUP, tiles = (M + 15) / 16, blocks = N / LANES;
    const int64_t chunk = CHUNK_BYTES / (16 * K * 2) > 2 ? CHUNK_BYTES / (16 * K * 2) : 2;
    if (M < 1) /* (a tile of 0 rows is not a configuration the tile unit takes) */
        return;
    /* W tiles unpacked for one gemm_block call only: a ring of AMX_RING groups */
    const int64_t ring = AMX_RING && chunk >= tiles && tiles <= 2 ? AMX_RING - 1 : -1;
    const int64_t tail = M > 16 ? M % 16 : 0; /* rows of a last tile to copy */
    uint16_t *last = tail ? aligned_alloc(64, (size_t)(16 * K) * 2) : NULL;
    if (tail) {
        memcpy(last, x + (M - tail) * K, (size_t)(tail * K) * 2);
        memset(last + tail * K, 0, (size_t)((16 - tail) * K) * 2);
    }
#pragma omp parallel
    {
        struct tile_config cfg = {.palette = 1};
        for (int t = 0; t < 8; t++) {
            cfg.rows[t] = M < 16 && (t < 2 || t == 4) ? (uint8_t)M : 16; /* x and its sums */
            cfg.bytes_per_row[t] = 64;
        }
        _tile_loadconfig(&cfg);
        const int64_t per_block = (ring < 0 ? G : AMX_RING) * PAIR_ROWS * 32;
        uint16_t *w0 = aligned_alloc(64, (size_t)(2 * per_block) * 2);
        uint16_t *w1 = w0 + per_block;
        /* bytes from a pair's quants to those of the thread's next pair; y's row length */
        const int64_t next = (silu ? 1 : 2) * G * Q4_BYTES, Y = silu ? N / 2 : N;
        struct epilogue e = {.todo = 0};
        for (int64_t t0 = 0; t0 < tiles; t0 += chunk) {
            const int64_t t1 = t0 + chunk < tiles ? t0 + chunk : tiles;
#pragma omp for schedule(static)
            for (int64_t pair = 0; pair < (silu ? blocks / 2 : (blocks + 1) / 2); pair++) {
                const uint8_t *q0 = w + (silu ? 1 : 2) * pair * G * Q4_BYTES;
                const uint8_t *q1 = q0 + (silu ? blocks / 2 : 1) * G * Q4_BYTES;
                /* N % 32 == 16: the last pair has one block */
                uint16_t *second = silu || 2 * pair + 1 < blocks ? w1 : NULL;
                for (int64_t t = t0; t < t1; t += 2, q0 = q1 = NULL) {
                    const int ra = M - 16 * t < 16 ? (int)(M - 16 * t) : 16;
                    const int rb = M - 16 * (t + 1) < 16 ? (int)(M - 16 * (t + 1)) : 16;
                    uint16_t *ya = y + 16 * t * Y + (silu ? LANES : 2 * LANES) * pair;
                    const uint16_t *xa = tail && t == tiles - 1 ? last : x + 16 * t * K;
                    const uint16_t *xb = tail && t + 1 == tiles - 1 ? last : x + 16 * (t + 1) * K;
                    gemm_block(xa, ra, t + 1 < t1 ? xb : NULL, rb, 2 * K, w0, second, q0, q1,
                               ya, ya + 16 * Y, Y, G, ring, next, silu, &e);
                }
            }
        }
        epilogue_rows(&e, e.todo);
        free(w0);
        _tile_release();
    }
    free(last);
}
#endif

#if defined(__AVX2__)
#include <immintrin.h>

/* The smallest and largest of 8 float32 lanes */
INLINE float lanes_min8(__m256 x)
{
    float m[8];
    _mm256_storeu_ps(m, x);
    float r = m[0];
    for (int k = 1; k < 8; k++)
        r = m[k] < r ? m[k] : r;
    return r;
}

INLINE float lanes_max8(__m256 x)
{
    float m[8];
    _mm256_storeu_ps(m, x);
    float r = m[0];
    for (int k = 1; k < 8; k++)
        r = m[k] > r ? m[k] : r;
    return r;
}
#endif

#if Q4_INT8
/* q4 against x quantized to integers, with AVX2's integer dot products, where the float32 FMAs
 * above multiply 8 weights an instruction. Each row of x is quantized per group of 32, and
 *
 *   y[n] = sum_g scale[n, g] * d[g] * sum_j q_j a_j  +  low[n, g] * sum_j x_j
 *
 * with x_j ~ d a_j and sum_j x_j in float32 from x itself. Two widths:
 *
 *   int16 (the default): d is a power of two, 2^(E - 14) for a largest |x| in [2^E, 2^(E+1)),
 *     so every bfloat16 x within 2^7 of that largest (8 significant bits each) is an integer
 *     a exactly, and smaller ones are rounded by at most 2^(E - 15): relative to y about 1e-5,
 *     below the final rounding to bfloat16. vpmaddwd multiplies 16 pairs of int16 (the quants
 *     widened) into 8 int32 lanes: 16 weights an instruction, with an add.
 *   int8 (opt-in): a = round(x * 127 / max|x|), GGUF's Q8_0, as llama.cpp multiplies its 4-bit
 *     weights; each x is rounded by up to half a step of 1/127 of its group's largest, about
 *     0.7 % of y. vpmaddubsw multiplies 32 unsigned quants by signed bytes, summed in pairs into
 *     16-bit lanes: 32 weights an instruction. The pairs of a are stored twice (a0 a1 a0 a1)
 *     so that a 32-bit broadcast brings them; a 16-bit lane sums 16 products of at most
 *     15 * 127 per half group (30,480 < 32,767), and the halves are widened at the group's end.
 *
 * The q4 layout serves as it is: bytes 2i and 2i + 1 of a chunk hold row i's quants of x[2c],
 * x[2c + 1] (low nibbles) and x[2c + 16], x[2c + 17] (high), so one pair of a, broadcast, meets
 * every row. Sums come out in lanes of rows 0-7 and 8-15 (int16), or (0-3, 8-11) and
 * (4-7, 12-15) (int8, the order that unpacking leaves); scales and lows are loaded into that
 * order, and y is put back.
 *
 * Faster than the float32 FMA path above and than torch's float32 matmul on a float32 copy, at
 * every row count from 2 (docs/performance.md). With AVX-VNNI (a 256-bit vpdpwssd, on AVX2
 * CPUs from Alder Lake) the int16 multiply-adds are one instruction. */
#define QX_ROWS 4                 /* rows of x a tile takes */
#define QX_CHUNK_BYTES (128 << 10) /* of quantized x per pass over W: it stays in L2 */

/* With AVX-512 BW (Skylake-X, Ice Lake, without AVX-512 BF16 or AMX), the same sums in 512-bit
 * tiles (int_tile_wide below): one vector holds a group's sums for all 16 rows of a block, and
 * with AVX512-VNNI vpdpwssd (int16) and vpdpbusd (int8) multiply and add in one instruction.
 * Integer sums are exact, so every lane ends with the very integers the 256-bit code sums, and
 * the float32 steps after them are the same per lane: bit for bit the AVX2 build's y (tests:
 * test_quant_matmul.py). -DQX_WIDE=0 keeps the 256-bit tiles (the benchmark's "before"). */
#if defined(__AVX512BW__)
#ifndef QX_WIDE
#define QX_WIDE 1
#endif
#else
#undef QX_WIDE
#define QX_WIDE 0
#endif
#if QX_WIDE
#ifndef QX_TILE_ROWS
#define QX_TILE_ROWS 12 /* rows of x a wide tile takes (docs/performance.md, session 24) */
#endif
#else
#define QX_TILE_ROWS QX_ROWS
#endif

/* 32 bfloat16 at x -> 4 x 8 float32 lanes; returns their largest |x| and stores their sum */
INLINE float load_group(const uint16_t *x, __m256 v[4], float *sum)
{
    __m256 m = _mm256_setzero_ps(), s = _mm256_setzero_ps();
    for (int k = 0; k < 4; k++) {
        v[k] = load_bf16_8(x + 8 * k);
        m = _mm256_max_ps(m, _mm256_andnot_ps(_mm256_set1_ps(-0.f), v[k]));
        s = _mm256_add_ps(s, v[k]);
    }
    *sum = lanes_sum8(s);
    return lanes_max8(m);
}

INLINE float pow2f(int e) /* 2^e for e in -126..127 */
{
    const uint32_t bits = (uint32_t)(e + 127) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* x [B, K] bfloat16 -> a [B, K] int16 (bits 16) or pairs [B, K / 2] of int8 twice (bits 8;
 * QX_WIDE: quads [B, K / 4] of int8, a[2c], a[2c + 1], a[2c + 16], a[2c + 17] for chunk c of
 * each group, the four inputs a row's byte pair in chunk c holds); d and xs [B, K / 32] */
static void quantize_rows(const uint16_t *x, void *a, float *d, float *xs, int64_t B, int64_t K,
                          int bits)
{
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < B * (K / GROUP); i++) {
        __m256 v[4];
        const float amax = load_group(x + i * GROUP, v, xs + i);
        float inv;
        if (bits == 16) {
            uint32_t u;
            memcpy(&u, &amax, sizeof u);
            int e = (int)(u >> 23) - 127; /* 2^e <= amax < 2^(e + 1) (amax normal) */
            e = e < -100 ? -100 : (e > 113 ? 113 : e); /* 2^(14 - e) a float */
            inv = amax > 0.f ? pow2f(14 - e) : 0.f;
            d[i] = pow2f(e - 14);
        } else {
            inv = amax > 0.f ? 127.f / amax : 0.f;
            d[i] = amax / 127.f;
        }
        __m256i q[4]; /* rounded to nearest even, as torch.round */
        for (int k = 0; k < 4; k++)
            q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], _mm256_set1_ps(inv)));
        /* packs interleave 128-bit halves: a0-3 b0-3 | a4-7 b4-7 */
        const __m256i words[2] = {_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])};
        if (bits == 16) {
            for (int k = 0; k < 2; k++)
                _mm256_storeu_si256((__m256i *)((int16_t *)a + i * GROUP + 16 * k),
                                    _mm256_permute4x64_epi64(words[k], 0xD8));
            continue;
        }
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        const __m256i bytes =
            _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words[0], words[1]), order);
#if QX_WIDE /* byte pairs c and c + 8 (a[2c], a[2c + 1] and a[2c + 16], a[2c + 17]) together */
        const __m128i first = _mm256_castsi256_si128(bytes);
        const __m128i second = _mm256_extracti128_si256(bytes, 1);
        int32_t *quads = (int32_t *)a + 8 * i;
        _mm_storeu_si128((__m128i *)quads, _mm_unpacklo_epi16(first, second));
        _mm_storeu_si128((__m128i *)(quads + 4), _mm_unpackhi_epi16(first, second));
        continue;
#endif
        const __m256i lo = _mm256_unpacklo_epi16(bytes, bytes);
        const __m256i hi = _mm256_unpackhi_epi16(bytes, bytes);
        int32_t *pairs = (int32_t *)a + 16 * i;
        _mm256_storeu_si256((__m256i *)pairs, _mm256_permute2x128_si256(lo, hi, 0x20));
        _mm256_storeu_si256((__m256i *)(pairs + 8), _mm256_permute2x128_si256(lo, hi, 0x31));
    }
}

/* sum + the sums of pairs of int16 products w0 * x0 and w1 * x1 in each 32-bit lane: with
 * AVX-VNNI (Alder Lake and later, without AVX-512) two vpdpwssd, else vpmaddwd and adds. */
INLINE __m256i dot_pairs16_8(__m256i sum, __m256i w0, __m256i x0, __m256i w1, __m256i x1)
{
#if defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(_mm256_dpwssd_avx_epi32(sum, w0, x0), w1, x1);
#else
    sum = _mm256_add_epi32(sum, _mm256_add_epi32(_mm256_madd_epi16(w0, x0),
                                                 _mm256_madd_epi16(w1, x1)));
    /* keeps GCC from reassociating the sums into a tree of all the products, held in memory:
     * 2x slower */
    __asm__("" : "+x"(sum));
    return sum;
#endif
}

/* Group g's sums of one block of W by R rows of quantized x (R a constant at each call site),
 * as int32 lanes in sums[r][0] (rows 0-7) and sums[r][1] (rows 8-15). Each byte of a chunk,
 * widened to 16 bits, holds a low and a high nibble, so an and and a shift give the quants.
 * (Unpacking the bytes against a register of zeros instead, in lanes of rows 0-3, 8-11 and
 * 4-7, 12-15, left GCC a register short at 4 rows: it spilled, and was slower.) */
INLINE void dots_int16(const int16_t *a, const uint8_t *wg, int64_t K, int64_t g, const int R,
                       __m256i sums[QX_ROWS][2])
{
    const __m256i nibble = _mm256_set1_epi16(15);
    for (int r = 0; r < R; r++)
        sums[r][0] = sums[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++) {
        const __m256i b0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wg + 32 * c)));
        const __m256i b1 =
            _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wg + 32 * c + 16)));
        const __m256i w[4] = {_mm256_and_si256(b0, nibble), _mm256_and_si256(b1, nibble),
                              _mm256_srli_epi16(b0, 4), _mm256_srli_epi16(b1, 4)};
        for (int r = 0; r < R; r++) {
            const int16_t *ar = a + r * K + g * GROUP + 2 * c;
            const __m256i x_lo = _mm256_set1_epi32(*(const int32_t *)ar);
            const __m256i x_hi = _mm256_set1_epi32(*(const int32_t *)(ar + 16));
            for (int h = 0; h < 2; h++)
                sums[r][h] = dot_pairs16_8(sums[r][h], w[h], x_lo, w[2 + h], x_hi);
        }
    }
}

/* The same with a in int8 pairs (stored twice), as int32 lanes of rows (0-3, 8-11) in sums[r][0]
 * and (4-7, 12-15) in sums[r][1]: the order that unpacking the 16-bit sums leaves. */
INLINE void dots_int8(const int32_t *pairs, const uint8_t *wg, int64_t K, int64_t g, const int R,
                      __m256i sums[QX_ROWS][2])
{
    const __m256i nibble = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256i half[QX_ROWS][2]; /* 16-bit sums of chunks 0-3 and 4-7 */
    for (int r = 0; r < R; r++)
        half[r][0] = half[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(wg + 32 * c));
        const __m256i lo = _mm256_and_si256(v, nibble);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        for (int r = 0; r < R; r++) {
            const int32_t *ar = pairs + r * (K / 2) + 16 * g;
            const __m256i x_lo = _mm256_set1_epi32(ar[c]), x_hi = _mm256_set1_epi32(ar[8 + c]);
            const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x_lo),
                                               _mm256_maddubs_epi16(hi, x_hi));
            half[r][c / 4] = _mm256_add_epi16(half[r][c / 4], t);
            __asm__("" : "+x"(half[r][c / 4])); /* as above */
        }
    }
    for (int r = 0; r < R; r++) {
        sums[r][0] = _mm256_madd_epi16(_mm256_unpacklo_epi16(half[r][0], half[r][1]), ones);
        sums[r][1] = _mm256_madd_epi16(_mm256_unpackhi_epi16(half[r][0], half[r][1]), ones);
    }
}

/* Group g's sums of one q8 block by R rows of x in int16, as int32 lanes in sums[r][0] (rows
 * 0-7) and sums[r][1] (rows 8-15). The quants of inputs j and j + 1, interleaved byte by byte
 * and widened, meet the pair a_j, a_j+1 in one vpmaddwd: a lane sums 32 products of at most
 * 2^15 * 127, 133 M at most. */
INLINE void dots_q8_int16(const int16_t *a, const uint8_t *wg, int64_t K, int64_t g, const int R,
                          __m256i sums[QX_ROWS][2])
{
    for (int r = 0; r < R; r++)
        sums[r][0] = sums[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 1 /* unrolled 2 or 8 times: the same, within the noise */
    for (int j = 0; j < GROUP; j += 4) {
        __m256i w[2][2]; /* inputs j, j + 1 and j + 2, j + 3; rows 0-7 and 8-15 */
        for (int p = 0; p < 2; p++) {
            const __m128i w0 = _mm_loadu_si128((const __m128i *)(wg + 16 * (j + 2 * p)));
            const __m128i w1 = _mm_loadu_si128((const __m128i *)(wg + 16 * (j + 2 * p + 1)));
            w[p][0] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(w0, w1));
            w[p][1] = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(w0, w1));
        }
        for (int r = 0; r < R; r++) {
            const int16_t *ar = a + r * K + g * GROUP + j;
            const __m256i x0 = _mm256_set1_epi32(*(const int32_t *)ar);
            const __m256i x1 = _mm256_set1_epi32(*(const int32_t *)(ar + 2));
            for (int h = 0; h < 2; h++)
                sums[r][h] = dot_pairs16_8(sums[r][h], w[0][h], x0, w[1][h], x1);
        }
    }
}

#if QX_WIDE
/* acc + the sums of pairs of int16 products w * x in each 32-bit lane: vpdpwssd with
 * AVX512-VNNI (Ice Lake), vpmaddwd and an add without it (Skylake-X) */
INLINE __m512i dot_pairs16(__m512i acc, __m512i w, __m512i x)
{
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, w, x);
#else
    acc = _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
    __asm__("" : "+v"(acc)); /* as in dot_pairs16_8 */
    return acc;
#endif
}

/* acc + the sums of 4 products of unsigned bytes w and signed bytes x in each 32-bit lane:
 * vpdpbusd, or vpmaddubsw (pairs of at most 2 * 15 * 127, far from int16's limit) and
 * vpmaddwd by ones */
INLINE __m512i dot_quads8(__m512i acc, __m512i w, __m512i x)
{
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, w, x);
#else
    const __m512i pairs = _mm512_maddubs_epi16(w, x);
    acc = _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
    __asm__("" : "+v"(acc));
    return acc;
#endif
}

/* Group g's sums of one q4 block by R rows of x in int16, as int32 lanes of rows 0-15 in
 * sums[r]: a chunk's 32 bytes widen to 32 words, word 2i + e holding row i's quants of
 * x[2c + e] (low nibble) and x[2c + 16 + e] (high), which a broadcast pair of a meets. Two
 * chains a row up to 8 rows, so that few rows still keep both units busy; one from 9, which
 * are enough chains, and two would not fit in the 32 registers. */
INLINE void dots_int16_wide(const int16_t *a, const uint8_t *wg, int64_t K, int64_t g,
                            const int R, __m512i sums[QX_TILE_ROWS])
{
    const __m512i nibble = _mm512_set1_epi16(15);
    const int H = R <= 8 ? 1 : 0; /* the high nibbles' chain (one chain a row from 9 rows) */
    __m512i part[QX_TILE_ROWS][2];
    for (int r = 0; r < R; r++)
        part[r][0] = part[r][1] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++) {
        const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(wg + 32 * c)));
        const __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_srli_epi16(v, 4);
        for (int r = 0; r < R; r++) {
            const int16_t *ar = a + r * K + g * GROUP + 2 * c;
            part[r][0] = dot_pairs16(part[r][0], lo, _mm512_set1_epi32(*(const int32_t *)ar));
            part[r][H] =
                dot_pairs16(part[r][H], hi, _mm512_set1_epi32(*(const int32_t *)(ar + 16)));
        }
    }
    for (int r = 0; r < R; r++)
        sums[r] = H ? _mm512_add_epi32(part[r][0], part[r][1]) : part[r][0];
}

/* The same with a in int8 quads (quantize_rows), as int32 lanes of rows 0-3, 8-11, 4-7, 12-15
 * (WIDE_INT8_ORDER): a chunk's low and high nibbles, interleaved in 16-bit pairs, put row i's
 * four quants of x[2c], x[2c + 1], x[2c + 16], x[2c + 17] in one 32-bit lane. */
#define WIDE_INT8_ORDER _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15)
INLINE void dots_int8_wide(const int32_t *quads, const uint8_t *wg, int64_t K, int64_t g,
                           const int R, __m512i sums[QX_TILE_ROWS])
{
    const __m256i nibble = _mm256_set1_epi8(15);
    __m512i part[QX_TILE_ROWS][2];
    for (int r = 0; r < R; r++)
        part[r][0] = part[r][1] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(wg + 32 * c));
        const __m256i lo = _mm256_and_si256(v, nibble);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_unpacklo_epi16(lo, hi)),
                                             _mm256_unpackhi_epi16(lo, hi), 1);
        const int k = R <= 8 ? c % 2 : 0; /* two chains a row up to 8 rows, as in dots_int16_wide */
        for (int r = 0; r < R; r++)
            part[r][k] =
                dot_quads8(part[r][k], w, _mm512_set1_epi32(quads[r * (K / 4) + 8 * g + c]));
    }
    for (int r = 0; r < R; r++)
        sums[r] = R <= 8 ? _mm512_add_epi32(part[r][0], part[r][1]) : part[r][0];
}

/* Group g's sums of one q8 block by R rows of x in int16, as int32 lanes of rows 0-15: inputs
 * j and j + 1 (32 bytes together) widen to words and interleave, row by row, into the pairs
 * that a_j, a_j+1 meet. */
INLINE void dots_q8_int16_wide(const int16_t *a, const uint8_t *wg, int64_t K, int64_t g,
                               const int R, __m512i sums[QX_TILE_ROWS])
{
    static const int16_t order[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i pairs = _mm512_loadu_si512(order);
    __m512i part[QX_TILE_ROWS][2];
    for (int r = 0; r < R; r++)
        part[r][0] = part[r][1] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int j = 0; j < GROUP; j += 2) {
        const __m512i w = _mm512_permutexvar_epi16(
            pairs, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(wg + 16 * j))));
        const int k = R <= 8 ? j / 2 % 2 : 0; /* as in dots_int16_wide */
        for (int r = 0; r < R; r++) {
            const int16_t *ar = a + r * K + g * GROUP + j;
            part[r][k] = dot_pairs16(part[r][k], w, _mm512_set1_epi32(*(const int32_t *)ar));
        }
    }
    for (int r = 0; r < R; r++)
        sums[r] = R <= 8 ? _mm512_add_epi32(part[r][0], part[r][1]) : part[r][0];
}

/* int_tile (below) in 512-bit vectors: the same float32 steps per lane, so the same y */
INLINE void int_tile_wide(const void *a, const float *d, const float *xs, const uint8_t *w,
                          void *y, int64_t N, int64_t K, const int R, const int bits,
                          const int q8)
{
    const int64_t G = K / GROUP;
    const int ordered = q8 || bits == 16; /* sums in lanes of rows 0-15 (else as int8's) */
    __m512 acc[QX_TILE_ROWS];
    for (int r = 0; r < R; r++)
        acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++, w += q8 ? Q8_BYTES : Q4_BYTES) {
        __m512i sums[QX_TILE_ROWS];
        if (q8)
            dots_q8_int16_wide(a, w, K, g, R, sums);
        else if (bits == 16)
            dots_int16_wide(a, w, K, g, R, sums);
        else
            dots_int8_wide(a, w, K, g, R, sums);
        const uint16_t *sl = (const uint16_t *)(w + (q8 ? LANES * GROUP : LANES * GROUP / 2));
        __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sl)), low;
        if (!q8)
            low = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sl + LANES)));
        if (!ordered) { /* into the sums' lanes */
            scale = _mm512_permutexvar_ps(WIDE_INT8_ORDER, scale);
            low = _mm512_permutexvar_ps(WIDE_INT8_ORDER, low);
        }
        for (int r = 0; r < R; r++) {
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]),
                                     _mm512_mul_ps(scale, _mm512_set1_ps(d[r * G + g])), acc[r]);
            if (!q8)
                acc[r] = _mm512_fmadd_ps(low, _mm512_set1_ps(xs[r * G + g]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        if (q8) {
            _mm512_storeu_ps((float *)y + r * N, acc[r]);
            continue;
        }
        /* int8's lanes back into the rows' order (the order is its own inverse) */
        const __m512 v = ordered ? acc[r] : _mm512_permutexvar_ps(WIDE_INT8_ORDER, acc[r]);
        store_bf16_8((uint16_t *)y + r * N, _mm512_castps512_ps256(v));
        store_bf16_8((uint16_t *)y + r * N + 8,
                     _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    }
}
#endif

/* One block of 16 rows of W (q4, or q8 where `q8`) against R rows of quantized x -> y [R, 16 of
 * N], bfloat16 (q4) or float32 (q8) */
INLINE void int_tile(const void *a, const float *d, const float *xs, const uint8_t *w,
                     void *y, int64_t N, int64_t K, const int R, const int bits, const int q8)
{
    const int64_t G = K / GROUP;
    const int ordered = q8 || bits == 16; /* sums in lanes of rows 0-7, 8-15 (else as int8's) */
    __m256 acc[QX_ROWS][2];
    for (int r = 0; r < R; r++)
        acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++, w += q8 ? Q8_BYTES : Q4_BYTES) {
        __m256i sums[QX_ROWS][2];
        if (q8)
            dots_q8_int16(a, w, K, g, R, sums);
        else if (bits == 16)
            dots_int16(a, w, K, g, R, sums);
        else
            dots_int8(a, w, K, g, R, sums);
        const uint16_t *sl = (const uint16_t *)(w + (q8 ? LANES * GROUP : LANES * GROUP / 2));
        __m256 scale[2], low[2];
        for (int k = 0; k < (q8 ? 1 : 2); k++) {
            const __m256 v0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sl + 16 * k)));
            const __m256 v1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sl + 16 * k + 8)));
            __m256 *dst = k ? low : scale;
            dst[0] = ordered ? v0 : _mm256_permute2f128_ps(v0, v1, 0x20); /* the sums' lanes */
            dst[1] = ordered ? v1 : _mm256_permute2f128_ps(v0, v1, 0x31);
        }
        for (int r = 0; r < R; r++) {
            const __m256 dx = _mm256_set1_ps(d[r * G + g]), sx = _mm256_set1_ps(xs[r * G + g]);
            for (int h = 0; h < 2; h++) {
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][h]),
                                            _mm256_mul_ps(scale[h], dx), acc[r][h]);
                if (!q8)
                    acc[r][h] = _mm256_fmadd_ps(low[h], sx, acc[r][h]);
            }
        }
    }
    for (int r = 0; r < R; r++) { /* int8's lanes back into the rows' order */
        const __m256 a0 = acc[r][0], a1 = acc[r][1];
        if (q8) {
            _mm256_storeu_ps((float *)y + r * N, a0);
            _mm256_storeu_ps((float *)y + r * N + 8, a1);
            continue;
        }
        store_bf16_8((uint16_t *)y + r * N, ordered ? a0 : _mm256_permute2f128_ps(a0, a1, 0x20));
        store_bf16_8((uint16_t *)y + r * N + 8, ordered ? a1 : _mm256_permute2f128_ps(a0, a1, 0x31));
    }
}

/* int_tile (int_tile_wide) for `rows` (1 to QX_TILE_ROWS) rows, R a constant in each call */
INLINE void int_tiles(const void *a, const float *d, const float *xs, const uint8_t *w,
                      void *y, int64_t N, int64_t K, int64_t rows, const int bits,
                      const int q8)
{
#if QX_WIDE
#define WIDE_CASE(R)                                                                           \
    case R:                                                                                    \
        if (R <= QX_TILE_ROWS)                                                                 \
            int_tile_wide(a, d, xs, w, y, N, K, R <= QX_TILE_ROWS ? R : 1, bits, q8);          \
        return;
    switch (rows) {
        WIDE_CASE(1) WIDE_CASE(2) WIDE_CASE(3) WIDE_CASE(4) WIDE_CASE(5) WIDE_CASE(6)
        WIDE_CASE(7) WIDE_CASE(8) WIDE_CASE(9) WIDE_CASE(10) WIDE_CASE(11) WIDE_CASE(12)
    }
    return;
#endif
    switch (rows) {
    case 1: int_tile(a, d, xs, w, y, N, K, 1, bits, q8); break;
    case 2: int_tile(a, d, xs, w, y, N, K, 2, bits, q8); break;
    case 3: int_tile(a, d, xs, w, y, N, K, 3, bits, q8); break;
    default: int_tile(a, d, xs, w, y, N, K, 4, bits, q8); break;
    }
}

/* One tile of q4 (bits and q8 constants in each call, for the tile's inlining). */
INLINE void q4_int_tile(const void *a, const float *d, const float *xs, const uint8_t *w, void *y,
                        int64_t N, int64_t K, int64_t rows, int bits)
{
    if (bits == 16)
        int_tiles(a, d, xs, w, y, N, K, rows, 16, 0);
    else
        int_tiles(a, d, xs, w, y, N, K, rows, 8, 0);
}

/* y [B, N] = x [B, K] W^T through x in integers of `bits` (q4; q8 takes 16 only): x is
 * quantized, then taken in chunks that stay in L2, each chunk's tiles of rows through every
 * block of W, the blocks split between the threads. `silu` (q4 only, in a build with
 * FUSED_SILU): W is a gate/up projection of N = 2I rows and y is act [B, I], silu_and_mul of
 * its halves, as run_silu does it. */
static void gemm_int(const uint16_t *x, const uint8_t *w, void *y, int64_t B, int64_t N,
                     int64_t K, int bits, int q8, int silu)
{
    /* int16, or int8 pairs twice (int8 quads: QX_WIDE) */
    const int64_t G = K / GROUP, row_bytes = QX_WIDE && bits == 8 && !q8 ? K : 2 * K;
    const int64_t block_bytes = G * (q8 ? Q8_BYTES : Q4_BYTES);
    char *scratch = malloc((size_t)(B * (row_bytes + 2 * G * (int64_t)sizeof(float))));
    float *d = (float *)(scratch + B * row_bytes), *xs = d + B * G;
    quantize_rows(x, scratch, d, xs, B, K, bits);
    int64_t chunk = QX_CHUNK_BYTES / row_bytes / QX_TILE_ROWS * QX_TILE_ROWS;
    chunk = chunk < QX_TILE_ROWS ? QX_TILE_ROWS : chunk;
    const int64_t blocks = N / LANES / (silu ? 2 : 1); /* (gate blocks, with silu) */
#pragma omp parallel
    {
        uint16_t gate[QX_TILE_ROWS * LANES], up[QX_TILE_ROWS * LANES];
        for (int64_t b0 = 0; b0 < B; b0 += chunk) {
            const int64_t b1 = b0 + chunk < B ? b0 + chunk : B;
#pragma omp for schedule(BLOCK_SCHEDULE) nowait
            for (int64_t n = 0; n < blocks; n++)
                for (int64_t b = b0; b < b1; b += QX_TILE_ROWS) {
                    const void *a = scratch + b * row_bytes;
                    const uint8_t *wn = w + n * block_bytes;
                    const int64_t rows = b1 - b < QX_TILE_ROWS ? b1 - b : QX_TILE_ROWS;
                    if (q8) {
                        int_tiles(a, d + b * G, xs + b * G, wn, (float *)y + b * N + n * LANES,
                                  N, K, rows, 16, 1);
                        continue;
                    }
#if FUSED_SILU
                    if (silu) {
                        q4_int_tile(a, d + b * G, xs + b * G, wn, gate, LANES, K, rows, bits);
                        q4_int_tile(a, d + b * G, xs + b * G, wn + blocks * block_bytes, up,
                                    LANES, K, rows, bits);
                        for (int64_t r = 0; r < rows; r++)
                            silu_store(gate + r * LANES, up + r * LANES,
                                       (uint16_t *)y + (b + r) * (N / 2) + n * LANES);
                        continue;
                    }
#endif
                    q4_int_tile(a, d + b * G, xs + b * G, wn, (uint16_t *)y + b * N + n * LANES,
                                N, K, rows, bits);
                }
        }
    }
    free(scratch);
}
#endif

/* w (the q4 layout) -> W [N, K] float32, w = q * scale + low: q * scale is exact in float32 and
 * + low rounds once, as the file's dequantization does. For a float32 GEMM elsewhere. */
void q4_dequantize_f32(const uint8_t *w, float *out, int64_t N, int64_t K)
{
    const int64_t G = K / GROUP;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N / LANES; n++)
        for (int64_t g = 0; g < G; g++) {
            const uint8_t *block = w + (n * G + g) * Q4_BYTES;
            const uint16_t *sl = (const uint16_t *)(block + LANES * GROUP / 2);
            for (int i = 0; i < LANES; i++) {
                const float scale = half_to_float(sl[i]), low = half_to_float(sl[LANES + i]);
                float *row = out + (n * LANES + i) * K + g * GROUP;
                uint8_t bytes[16]; /* row i's: byte 2c + e holds element 2c + e and 16 + 2c + e */
                for (int c = 0; c < 8; c++)
                    memcpy(bytes + 2 * c, block + 32 * c + 2 * i, 2);
#if defined(__AVX2__) && defined(__FMA__)
                /* fma rounds q * scale + low once, as the scalar code does (q * scale is exact) */
                const __m128i packed = _mm_loadu_si128((const __m128i *)bytes);
                const __m128i nibbles[2] = {_mm_and_si128(packed, _mm_set1_epi8(15)),
                                            _mm_and_si128(_mm_srli_epi16(packed, 4),
                                                          _mm_set1_epi8(15))};
                const __m256 vs = _mm256_set1_ps(scale), vl = _mm256_set1_ps(low);
                for (int h = 0; h < 4; h++) {
                    const __m128i q8 = nibbles[h / 2]; /* h = 0, 1: low nibbles; 2, 3: high */
                    const __m128i part = h % 2 ? _mm_unpackhi_epi64(q8, q8) : q8;
                    const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part));
                    _mm256_storeu_ps(row + 8 * h, _mm256_fmadd_ps(q, vs, vl));
                }
#else
                for (int j = 0; j < 16; j++) {
                    row[j] = (float)(bytes[j] & 15) * scale + low;
                    row[16 + j] = (float)(bytes[j] >> 4) * scale + low;
                }
#endif
            }
        }
}

/* The rows of x from which q4 runs on AMX tiles here; 0 where it never does (no AMX in this
 * build, or Linux refused the tile registers). */
int64_t q4_tile_min_rows(void)
{
#ifdef HAVE_AMX
    return amx_granted() ? (invariant ? 1 : amx_min_b) : 0;
#else
    return 0;
#endif
}

/* Whether q4 takes the tiles for B rows of x: q4_matmul_bf16 and q4_silu_matmul_bf16 alike. */
INLINE int on_tiles(int64_t B)
{
    const int64_t from = q4_tile_min_rows();
    return from && B >= from;
}

#ifndef Q4_X_BITS
#define Q4_X_BITS 16 /* how q4 takes x until told (benchmarks build it with 8) */
#endif
#define Q4_OWN_BITS (Q4_INT8 ? Q4_X_BITS : 0) /* this build's own choice */
static int q4_x_bits = Q4_OWN_BITS;

/* How q4 takes x: as int16 (bits 16) or int8 (8) through gemm_int, or as it is (0: in
 * float32, or bfloat16 pairs where the vector path has them); -1 only asks, -2 goes back to
 * this build's own choice. Returns the width now in use: 0 where this build has no integer
 * path, or where AMX tiles take x (as bfloat16, whatever is asked). */
int64_t q4_activation_bits(int64_t bits)
{
    if (bits == -2)
        bits = Q4_OWN_BITS;
    if (Q4_INT8 && (bits == 0 || bits == 8 || bits == 16) && !q4_tile_min_rows())
        q4_x_bits = (int)bits;
    return q4_x_bits;
}

/* What the q4 vector passes read besides x (their `f`), malloc'd: each row's group sums, and
 * where Q4_READS_X_F32 the row in float32 after them. */
static float *x_sums(const uint16_t *x, int64_t B, int64_t K)
{
    const int64_t G = K / GROUP, per_row = G + (Q4_READS_X_F32 ? K : 0);
    float *f = malloc((size_t)(B * per_row) * sizeof(float));
    if (!Q4_READS_X_F32)
        group_sums(x, f, B, K);
    for (int64_t b = 0; Q4_READS_X_F32 && b < B; b++) {
        group_sums(x + b * K, f + b * per_row, 1, K);
        for (int64_t k = 0; k < K; k++)
            f[b * per_row + G + k] = bf16_to_float(x[b * K + k]);
    }
    return f;
}

/* Whether q4 takes x in integers (gemm_int) for B rows. */
INLINE int on_integers(int64_t B)
{
    return Q4_INT8 && q4_x_bits && B >= (invariant ? 1 : qx_min_b);
}

/* x [B, K] bfloat16; w [N / 16, K / 32, Q4_BYTES or Q8_BYTES] as above; y [B, N], bfloat16
 * (q4) or float32 (q8: the logits). K % 32 == 0 and N % 16 == 0 (the caller checks). Batch
 * invariant, one path serves every B: the tiles where there are tiles, else integer x where
 * this build has it, else the vector (or plain C) blocks with fixed chains. */
void q4_matmul_bf16(const uint16_t *x, const uint8_t *w, uint16_t *y, int64_t B, int64_t N,
                    int64_t K)
{
#ifdef HAVE_AMX
    if (on_tiles(B)) {
        q4_gemm_amx(x, w, y, B, N, K, 0);
        return;
    }
#endif
#if Q4_INT8
    if (on_integers(B)) {
        gemm_int(x, w, y, B, N, K, q4_x_bits, 0, 0);
        return;
    }
#endif
    float *f = x_sums(x, B, K);
    run(Q4_passes, x, f, K / GROUP + (Q4_READS_X_F32 ? K : 0), w, y, 2, Q4_BYTES, B, N, K);
    free(f);
}

/* act [B, I] = silu(x Wg^T) * (x Wu^T), w the q4 gate/up projection [2I rows: the gate's,
 * then the up's, K], on whichever path q4_matmul_bf16 takes, silu_and_mul's arithmetic in its
 * stores (the tiles', gemm_int's or the vector passes'): bit for bit what q4_matmul_bf16 and
 * then silu_and_mul_bf16 give, without writing the projection's output and reading it back.
 * Returns 0, having done nothing, in a build without AVX2 or where I is not a whole number of
 * blocks: the caller runs the two kernels. */
int64_t q4_silu_matmul_bf16(const uint16_t *x, const uint8_t *w, uint16_t *act, int64_t B,
                            int64_t I, int64_t K)
{
    if (I % LANES)
        return 0;
#ifdef HAVE_AMX
    if (on_tiles(B)) {
        q4_gemm_amx(x, w, act, B, 2 * I, K, 1);
        return 1;
    }
#endif
#if FUSED_SILU
#if Q4_INT8
    if (on_integers(B)) {
        gemm_int(x, w, act, B, 2 * I, K, q4_x_bits, 0, 1);
        return 1;
    }
#endif
    float *f = x_sums(x, B, K);
    run_silu(x, f, w, act, B, I, K);
    free(f);
    return 1;
#else
    (void)x, (void)w, (void)act, (void)B, (void)K;
    return 0;
#endif
}

#ifndef Q8_READS_X_F32
#define Q8_READS_X_F32 1 /* Q8_block reads x in float32 (xf) */
#endif

#ifndef Q8_INT
#define Q8_INT Q4_INT8 /* q8 takes x as int16 where q4 takes integers */
#endif

void q8_matmul_bf16(const uint16_t *x, const uint8_t *w, float *y, int64_t B, int64_t N,
                    int64_t K)
{
#if Q8_INT
    if (q4_x_bits && B >= (invariant ? 1 : qx_min_b)) { /* x as int16, whichever width q4 takes */
        gemm_int(x, w, y, B, N, K, 16, 1, 0);
        return;
    }
#endif
    const int64_t per_row = Q8_READS_X_F32 ? K : 0;
    float *xf = per_row ? malloc((size_t)(B * K) * sizeof(float)) : NULL;
    for (int64_t i = 0; i < B * per_row; i++)
        xf[i] = bf16_to_float(x[i]);
    run(Q8_passes, x, xf, per_row, w, y, 4, Q8_BYTES, B, N, K);
    free(xf);
}

/* Quantizing float32 weights W [N, K] into the two layouts above, as a model loads: a Q4_1
 * GGUF's weights, dequantized to float32 in the checkpoint, go back to their 4-bit values, and
 * its Q8_0 head to its 8-bit ones. Both return how far the farthest weight lies from its grid
 * point, in grid steps (0 up to float rounding: the weights were on the grid), or -1 where a
 * group's scale or low is not finite in float16 (the kernel's form); every operation rounds as
 * the same steps in torch float32 do (linear.py's `_on_grid`), which the tests check. */

/* The smallest and largest of a group's 32 values v; returns 1 if any is NaN (none of the
 * ordered comparisons holds for it, so it is looked for apart) */
INLINE int group_range(const float *v, float *lo, float *hi);
/* One group's q from its 32 values v on the grid low + q * step (step 0: every q is 0);
 * returns the largest |v / step - q| before q is clamped to 0..top (or -top..top, bottom = -1) */
INLINE float on_grid(const float *v, float low, float step, int bottom, int top, uint8_t *q);

#if defined(__AVX2__)
#include <immintrin.h>

INLINE int group_range(const float *v, float *lo, float *hi)
{
    __m256 mn = _mm256_loadu_ps(v), mx = mn, nan = _mm256_cmp_ps(mn, mn, _CMP_UNORD_Q);
    for (int j = 8; j < GROUP; j += 8) {
        const __m256 x = _mm256_loadu_ps(v + j);
        mn = _mm256_min_ps(x, mn); /* x < mn ? x : mn */
        mx = _mm256_max_ps(x, mx);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    }
    *lo = lanes_min8(mn);
    *hi = lanes_max8(mx);
    return _mm256_movemask_ps(nan) != 0;
}

INLINE float on_grid(const float *v, float low, float step, int bottom, int top, uint8_t *q)
{
    const __m256 vlow = _mm256_set1_ps(low), div = _mm256_set1_ps(step == 0.f ? 1.f : step);
    const __m256 lo = _mm256_set1_ps((float)(bottom * top)), hi = _mm256_set1_ps((float)top);
    __m256 worst = _mm256_setzero_ps();
    for (int j = 0; j < GROUP; j += 8) {
        const __m256 exact = _mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(v + j), vlow), div);
        const __m256 r = _mm256_round_ps(exact, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256 d = _mm256_andnot_ps(_mm256_set1_ps(-0.f), _mm256_sub_ps(exact, r));
        worst = _mm256_max_ps(d, worst); /* d > worst ? d : worst */
        int32_t qi[8];
        _mm256_storeu_si256((__m256i *)qi,
                            _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi)));
        for (int k = 0; k < 8; k++) /* q4: 0..15; q8: the int8 value's two's complement */
            q[j + k] = (uint8_t)qi[k];
    }
    return lanes_max8(worst);
}
#else
INLINE int group_range(const float *v, float *lo, float *hi)
{
    int nan = 0;
    *lo = *hi = v[0];
    for (int j = 0; j < GROUP; j++) {
        *lo = v[j] < *lo ? v[j] : *lo;
        *hi = v[j] > *hi ? v[j] : *hi;
        nan |= v[j] != v[j];
    }
    return nan;
}

INLINE float on_grid(const float *v, float low, float step, int bottom, int top, uint8_t *q)
{
    const float div = step == 0.f ? 1.f : step, lo = (float)(bottom * top), hi = (float)top;
    float worst = 0.f;
    for (int j = 0; j < GROUP; j++) {
        const float exact = (v[j] - low) / div, r = __builtin_nearbyintf(exact);
        const float d = __builtin_fabsf(exact - r);
        worst = d > worst ? d : worst;
        q[j] = (uint8_t)(int)(r < lo ? lo : (r > hi ? hi : r));
    }
    return worst;
}
#endif

static int finite_half(uint16_t h) { return (h & 0x7c00u) != 0x7c00u; }

/* W -> the q4 layout (q8 = 0): each group on 15 steps from its minimum to its maximum, the low
 * and the step rounded to float16 first, as the file stores them; or the q8 layout (q8 = 1):
 * each group's scale its largest |w| / 127, rounded to float16 */
static float quantize(const float *w, uint8_t *out, int64_t N, int64_t K, int q8)
{
    const int64_t G = K / GROUP, bytes = q8 ? Q8_BYTES : Q4_BYTES;
    const int quants = q8 ? LANES * GROUP : LANES * GROUP / 2;
    float worst = 0.f;
    int bad = 0;
#pragma omp parallel for schedule(static) reduction(max : worst) reduction(| : bad)
    for (int64_t n = 0; n < N / LANES; n++)
        for (int64_t g = 0; g < G; g++) {
            uint8_t *block = out + (n * G + g) * bytes;
            uint16_t *scales = (uint16_t *)(block + quants), *lows = scales + LANES; /* q4 */
            for (int i = 0; i < LANES; i++) {
                const float *v = w + (n * LANES + i) * K + g * GROUP;
                float lo, hi, low = 0.f;
                bad |= group_range(v, &lo, &hi);
                if (q8) {
                    scales[i] = float_to_half((-lo > hi ? -lo : hi) / 127.f); /* largest |w| */
                } else {
                    lows[i] = float_to_half(lo);
                    scales[i] = float_to_half((hi - lo) / 15.f);
                    bad |= !finite_half(lows[i]);
                    low = half_to_float(lows[i]);
                }
                bad |= !finite_half(scales[i]);
                uint8_t q[GROUP];
                const float d = on_grid(v, low, half_to_float(scales[i]), q8 ? -1 : 0,
                                        q8 ? 127 : 15, q);
                worst = d > worst ? d : worst;
                if (q8)
                    for (int j = 0; j < GROUP; j++) /* byte 16j + i */
                        block[LANES * j + i] = q[j];
                else
                    for (int j = 0; j < 16; j++) /* byte 2i + e of chunk c (j = 2c + e) */
                        block[16 * (j & ~1) + 2 * i + (j & 1)] = (uint8_t)(q[j] | q[16 + j] << 4);
            }
        }
    return bad ? -1.f : worst;
}

float q4_quantize_f32(const float *w, uint8_t *out, int64_t N, int64_t K)
{
    return quantize(w, out, N, K, 0);
}

float q8_quantize_f32(const float *w, uint8_t *out, int64_t N, int64_t K)
{
    return quantize(w, out, N, K, 1);
}

#include "gguf_blocks.h"
