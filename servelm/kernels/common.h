/* What servelm's C kernels share: bfloat16 <-> float32 as torch converts, float16 -> float32, and a
 * vectorizable e^x.
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
