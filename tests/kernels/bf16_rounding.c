/* The kernels' float32 -> bfloat16 stores from common.h, as a test calls them
 * (tests/kernels/test_bf16_rounding.py): store_bf16 where the build has AVX-512 (with BF16 the
 * convert instruction, without it integer code), store_bf16_8 with AVX2, else float_to_bf16.
 * n % 16 == 0. */
#include "common.h"

void round_to_bf16(const float *x, uint16_t *out, int64_t n)
{
    for (int64_t i = 0; i < n; i += 16) {
#if defined(__AVX512F__)
        store_bf16(out + i, _mm512_loadu_ps(x + i));
#elif defined(__AVX2__) && defined(__FMA__)
        store_bf16_8(out + i, _mm256_loadu_ps(x + i));
        store_bf16_8(out + i + 8, _mm256_loadu_ps(x + i + 8));
#else
        for (int64_t k = i; k < i + 16; k++)
            out[k] = float_to_bf16(x[k]);
#endif
    }
}
