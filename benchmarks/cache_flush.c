/* Evict a range of memory from every cache level (clflush, then a fence), so that the next
 * read of it comes from DRAM: benchmarks/decode_step.py times each matmul on cold weights this
 * way. Built and loaded by servelm.kernels.build like the kernels. */
#include <immintrin.h>
#include <stdint.h>

void cache_flush(const char *p, int64_t bytes)
{
    for (int64_t i = 0; i < bytes; i += 64)
        _mm_clflush(p + i);
    _mm_sfence();
}
