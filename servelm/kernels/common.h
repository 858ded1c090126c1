/* What servelm's C kernels share: bfloat16 <-> float32 as torch converts, float16 -> float32, a
 * vectorizable e^x, the same for 16 AVX-512 lanes or 8 AVX2 lanes, and the AMX tile registers.
 * Included by each kernel source; `build.py` hashes it with them. */

#ifndef SERVELM_KERNELS_COMMON_H
#define SERVELM_KERNELS_COMMON_H

#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

INLINE float bf16_to_float(uint16_t x)
{
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

INLINE uint16_t float_to_bf16(float f) /* round to nearest even, as torch does */
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

INLINE float half_to_float(uint16_t h) /* IEEE float16 -> float32, exactly */
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0x1f) /* inf, NaN */
        u = sign | 0x7f800000u | (man << 13);
    else if (exp) /* normal: rebias the exponent */
        u = sign | ((exp + 112) << 23) | (man << 13);
    else { /* zero or subnormal: man * 2^-24, exact in float32 */
        float f = (float)man * 5.9604644775390625e-8f;
        memcpy(&u, &f, sizeof u);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* float32 -> IEEE float16, rounded to nearest even as torch's .half() rounds: beyond 65,504 by
 * half a step or more, infinity; below 2^-14, a subnormal (a multiple of 2^-24) or zero. */
INLINE uint16_t float_to_half(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    u &= 0x7fffffffu;
    if (u > 0x7f800000u) /* NaN */
        return sign | 0x7e00u;
    if (u >= 0x477ff000u) /* 65,520 and up (infinity too) */
        return sign | 0x7c00u;
    if (u < 0x38800000u) { /* below 2^-14: round |f| / 2^-24 (exact: a power of two) */
        float a;
        memcpy(&a, &u, sizeof a);
        return sign | (uint16_t)__builtin_nearbyintf(a * 16777216.f); /* 1024 is 2^-14, normal */
    }
    u += 0x0fffu + ((u >> 13) & 1u); /* round the mantissa to 10 bits; a carry bumps the exponent */
    return sign | (uint16_t)((u - 0x38000000u) >> 13); /* exponent bias 127 -> 15 */
}

/* e^x over float32's range, in a form the compiler vectorizes: x = n ln2 + r with
 * |r| <= ln2 / 2; e^r from its Taylor series to r^7 (relative error below 1e-7); 2^n built as a
 * float's exponent. x is clamped to [-87, 88]: below, e^-87 (which a softmax's sum of at least
 * 1 absorbs); above, float32 would overflow. */
INLINE float exp_approx(float x)
{
    x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
    const float n = __builtin_rintf(x * 1.44269504f);
    const float r = x - n * 0.693145752f - n * 1.42860677e-06f;
    float p = 1.f / 5040;
    p = p * r + 1.f / 720;
    p = p * r + 1.f / 120;
    p = p * r + 1.f / 24;
    p = p * r + 1.f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* New tokens' k and v rows (B of them, `k_stride` / `v_stride` elements apart, Hkv heads of D
 * elements of `size` bytes side by side) into the paged caches at their slots. */
INLINE void store_new_tokens(const void *k, int64_t k_stride, const void *v, int64_t v_stride,
                             void *k_cache, void *v_cache, const int64_t *slots, int64_t B,
                             int64_t Hkv, int64_t size, int D)
{
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < Hkv; h++) {
            const int64_t dst = (slots[b] * Hkv + h) * D * size;
            memcpy((char *)k_cache + dst, (const char *)k + (b * k_stride + h * D) * size,
                   D * size);
            memcpy((char *)v_cache + dst, (const char *)v + (b * v_stride + h * D) * size,
                   D * size);
        }
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 bfloat16 at p -> 16 float32 lanes (exactly) */
INLINE __m512 load_bf16(const uint16_t *p)
{
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* 16 float32 lanes -> 16 bfloat16 at dst, rounded to nearest even (with AVX-512 BF16 in one
 * instruction, which takes float32 subnormals as zeros; without it, as float_to_bf16 rounds:
 * tests/kernels/test_bf16_rounding.py) */
INLINE void store_bf16(uint16_t *dst, __m512 v)
{
#if defined(__AVX512BF16__)
    _mm256_storeu_si256((__m256i *)dst, (__m256i)_mm512_cvtneps_pbh(v));
#else /* float_to_bf16's integer rounding, 16 lanes at a time */
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    r = _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), u,
                             _mm512_set1_epi32(0x400000)); /* a NaN stays a NaN */
    _mm256_storeu_si256((__m256i *)dst, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
#endif
}

#if defined(__AVX512BW__)
/* The permutation (_mm512_permutexvar_epi16) that interleaves two rows of 16 bfloat16, the low
 * and high half of a vector, into pairs a0 b0 a1 b1 ...: vdpbf16ps's pairs, AMX's too */
INLINE __m512i pair_up(void)
{
    return _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                            6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
}
#endif

#if defined(__AVX512BF16__)
/* v rounded to bfloat16 and back, as storing and loading it would */
INLINE __m512 round_bf16_16(__m512 v)
{
    const __m512i wide = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#endif

/* exp_approx for 16 lanes: the same reduction and series, 2^n from vscalefps */
INLINE __m512 exp_approx16(__m512 x)
{
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-06f), r);
    __m512 p = _mm512_set1_ps(1.f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

#if defined(__AVX512BF16__)
/* silu(gate) * up for 16 lanes of bfloat16 values, silu rounded to bfloat16 (the caller rounds
 * the product as it stores it): silu_and_mul (cpu_ops.c) and the q4 gate/up tiles' fused stores
 * (quant_matmul.c) both call this, so that fused and unfused give the same bits. */
INLINE __m512 silu_mul16(__m512 gate, __m512 up)
{
    const __m512 e = exp_approx16(_mm512_mul_ps(gate, _mm512_set1_ps(-1.f)));
    return _mm512_mul_ps(round_bf16_16(_mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.f), e))),
                         up);
}
#endif
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* 8 bfloat16 at p -> 8 float32 lanes (exactly) */
INLINE __m256 load_bf16_8(const uint16_t *p)
{
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

/* The sum of 8 float32 lanes, added in lane order */
INLINE float lanes_sum8(__m256 v)
{
    float lanes[8], total = 0.f;
    _mm256_storeu_ps(lanes, v);
    for (int k = 0; k < 8; k++)
        total += lanes[k];
    return total;
}

/* 8 float32 lanes -> their bfloat16 bits in the high halves of 32-bit lanes, rounded as
 * float_to_bf16 rounds (to nearest even; a NaN stays a NaN) */
INLINE __m256i bf16_bits_8(__m256 v)
{
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded =
        _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
    const __m256i nan = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
    const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_and_si256(_mm256_blendv_epi8(rounded, nan, is_nan),
                            _mm256_set1_epi32((int)0xffff0000u));
}

/* v rounded to bfloat16 and back, as storing and loading it would */
INLINE __m256 round_bf16_8(__m256 v) { return _mm256_castsi256_ps(bf16_bits_8(v)); }

/* 8 float32 lanes -> 8 bfloat16 at dst, rounded as float_to_bf16 */
INLINE void store_bf16_8(uint16_t *dst, __m256 v)
{
    const __m256i halves = _mm256_srli_epi32(bf16_bits_8(v), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(halves, halves), 0x08);
    _mm_storeu_si128((__m128i *)dst, _mm256_castsi256_si128(packed));
}

/* exp_approx for 8 lanes: the same reduction, series and 2^n as a float's exponent */
INLINE __m256 exp_approx8(__m256 x)
{
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-06f), r);
    __m256 p = _mm256_set1_ps(1.f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    const __m256i bits =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

/* silu_mul16 (above) for 8 lanes: silu_and_mul where AVX2 is the widest, and the q4 gate/up
 * passes' fused stores in the same builds */
INLINE __m256 silu_mul8(__m256 gate, __m256 up)
{
    const __m256 e = exp_approx8(_mm256_mul_ps(gate, _mm256_set1_ps(-1.f)));
    return _mm256_mul_ps(round_bf16_8(_mm256_div_ps(gate, _mm256_add_ps(_mm256_set1_ps(1.f), e))),
                         up);
}
#endif

/* AMX (Sapphire Rapids and later): the tile registers, where the compiler targets them. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define HAVE_AMX 1

/* Linux hands a process the tile registers only when asked (once; oneDNN asks too). */
__attribute__((unused)) static int amx_granted(void)
{
    static int state; /* 0 not asked yet, 1 granted, -1 refused (an older kernel, a VM) */
    if (state == 0) {
        const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    }
    return state == 1;
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
};
#endif

#endif
