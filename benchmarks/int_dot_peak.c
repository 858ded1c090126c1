/* The peak rate of one core's integer (and float32) multiply-adds, for the "fraction of peak"
 * figures in docs/performance.md: 12 independent accumulator chains of one instruction, timed
 * by the thread's CPU time (so that other processes on a shared machine do not count), and a
 * chain of 1-cycle adds for the clock. Two cores' peak is twice one core's.
 *
 *     cc -O3 -march=native benchmarks/int_dot_peak.c -o /tmp/int_dot_peak && /tmp/int_dot_peak
 *
 * (-march=native: the instructions this CPU lacks are left out, by the feature macros.) */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#include "../servelm/kernels/common.h" /* (the tile registers: struct tile_config, amx_granted) */

#define ITERS 20000000L

static double cpu_seconds(void)
{
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* 12 chains of OP(a); the operands w, x pass through an empty asm each iteration, so that the
 * compiler neither hoists nor merges the instructions */
#define CHAINS(T, ZERO, OP)                                                                    \
    T a0 = ZERO, a1 = ZERO, a2 = ZERO, a3 = ZERO, a4 = ZERO, a5 = ZERO, a6 = ZERO, a7 = ZERO,  \
      a8 = ZERO, a9 = ZERO, a10 = ZERO, a11 = ZERO;                                            \
    for (long it = 0; it < ITERS; it++) {                                                      \
        a0 = OP(a0), a1 = OP(a1), a2 = OP(a2), a3 = OP(a3), a4 = OP(a4), a5 = OP(a5);          \
        a6 = OP(a6), a7 = OP(a7), a8 = OP(a8), a9 = OP(a9), a10 = OP(a10), a11 = OP(a11);      \
        __asm__ volatile("" : "+v"(w), "+v"(x));                                               \
        __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5),      \
                         "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));        \
    }                                                                                          \
    __asm__ volatile("" ::"v"(a0), "v"(a11));

static double rate(void (*fn)(void)) /* instructions per ns, the best of 3 */
{
    double best = 1e9;
    for (int rep = 0; rep < 3; rep++) {
        const double t0 = cpu_seconds();
        fn();
        const double t = cpu_seconds() - t0;
        best = t < best ? t : best;
    }
    return ITERS * 12.0 / best / 1e9;
}

#if defined(__AVX512VNNI__)
#define DPWSSD(a) _mm512_dpwssd_epi32(a, w, x)
#define DPBUSD(a) _mm512_dpbusd_epi32(a, w, x)
static void dpwssd(void) { __m512i w = _mm512_set1_epi16(3), x = w; CHAINS(__m512i, w, DPWSSD) }
static void dpbusd(void) { __m512i w = _mm512_set1_epi16(3), x = w; CHAINS(__m512i, w, DPBUSD) }
#endif
#if defined(__AVX2__) && defined(__FMA__)
/* vpmaddwd and vpaddd as the AVX2 integer path pairs them (each chain through both) */
#define MADDWD(a) _mm256_add_epi32(_mm256_madd_epi16(a, x), w)
static void maddwd(void) { __m256i w = _mm256_set1_epi16(3), x = w; CHAINS(__m256i, w, MADDWD) }
#endif
#if defined(__AVX512BF16__)
/* vdpbf16ps: the q4 vector path's instruction where AVX-512 has BF16 but no AMX (Zen 4 and 5) */
#define DPBF16(a) _mm512_dpbf16_ps(a, (__m512bh)w, (__m512bh)x)
static void dpbf16(void) { __m512i w = _mm512_set1_epi16(0x3f80), x = w; __m512 z = _mm512_setzero_ps(); CHAINS(__m512, z, DPBF16) }
#endif
#if defined(__AVX512F__)
#define FMA16(a) _mm512_fmadd_ps(a, w, x)
static void fma16(void) { __m512 w = _mm512_set1_ps(1.f), x = _mm512_set1_ps(1e-9f); CHAINS(__m512, x, FMA16) }
#endif

#ifdef HAVE_AMX
/* The tile unit: tdpbf16ps (16 x 16 x 32 bfloat16 multiply-adds) into 4 accumulator tiles
 * from operand tiles already loaded (amx) and, as the q4 kernel runs it, from two x and two W
 * tiles loaded from L1 each time (amx + loads). Returns tdpbf16ps a ns. */
static double amx_rate(int loads)
{
    static __attribute__((aligned(64))) uint16_t buf[4][16 * 32];
    struct tile_config cfg = {.palette = 1};
    for (int t = 0; t < 8; t++)
        cfg.rows[t] = 16, cfg.bytes_per_row[t] = 64;
    _tile_loadconfig(&cfg);
    _tile_loadd(4, buf[0], 64);
    _tile_loadd(5, buf[1], 64);
    _tile_loadd(6, buf[2], 64);
    _tile_loadd(7, buf[3], 64);
    double best = 1e9;
    const long iters = ITERS / 4;
    for (int rep = 0; rep < 3; rep++) {
        const double t0 = cpu_seconds();
        for (long it = 0; it < iters; it++) {
            if (loads) {
                _tile_loadd(4, buf[0], 64);
                _tile_loadd(6, buf[2], 64);
            }
            _tile_dpbf16ps(0, 4, 6);
            if (loads)
                _tile_loadd(7, buf[3], 64);
            _tile_dpbf16ps(1, 4, 7);
            if (loads)
                _tile_loadd(5, buf[1], 64);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        const double t = cpu_seconds() - t0;
        best = t < best ? t : best;
    }
    _tile_release();
    return iters * 4.0 / best / 1e9;
}
#endif

int main(void)
{
    long v = 0;
    double t0 = cpu_seconds();
    for (long i = 0; i < 1000000000L; i++)
        __asm__ volatile("add $1, %0" : "+r"(v));
    printf("clock (a chain of 1-cycle adds): %.2f GHz\n", 1.0 / (cpu_seconds() - t0));
    struct { const char *name; void (*fn)(void); int macs; } kinds[] = {
#if defined(__AVX512VNNI__)
        {"vpdpwssd zmm (int16 pairs)", dpwssd, 32},
        {"vpdpbusd zmm (u8 x s8 quads)", dpbusd, 64},
#endif
#if defined(__AVX512BF16__)
        {"vdpbf16ps zmm (bfloat16 pairs)", dpbf16, 32},
#endif
#if defined(__AVX2__) && defined(__FMA__)
        {"vpmaddwd + vpaddd ymm (int16)", maddwd, 16},
#endif
#if defined(__AVX512F__)
        {"vfmadd231ps zmm (float32)", fma16, 16},
#endif
    };
    for (unsigned k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
        const double r = rate(kinds[k].fn);
        printf("%-32s %.2f /ns a core: %6.0f GOP/s a core, %6.0f on 2 cores\n", kinds[k].name, r,
               2 * r * kinds[k].macs, 4 * r * kinds[k].macs);
    }
#ifdef HAVE_AMX
    if (amx_granted())
        for (int loads = 0; loads < 2; loads++) {
            const double r = amx_rate(loads); /* 16 x 16 x 32 multiply-adds each */
            printf("%-32s %.3f /ns a core: %6.0f GOP/s a core, %6.0f on 2 cores\n",
                   loads ? "tdpbf16ps, 4 tile loads a 4" : "tdpbf16ps (bfloat16 tiles)", r,
                   2 * r * 8192, 4 * r * 8192);
        }
#endif
    return 0;
}
