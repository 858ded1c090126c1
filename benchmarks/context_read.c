/* Read every line of K and V of each sequence's context, block by block in its table's order,
 * as decode attention reads them, and nothing else: the memory bound that
 * benchmarks/decode_attention.py sets beside the kernel. Built and loaded by
 * servelm.kernels.build like the kernels. */
#include <stdint.h>

/* Caches [slots, row_elems] bfloat16; tables [B, max_blocks]; ctx [B]. Returns a sum of the
 * words read, so that the compiler keeps the reads. */
int64_t context_read(const uint16_t *k, const uint16_t *v, const int64_t *tables,
                     int64_t max_blocks, const int64_t *ctx, int64_t B, int64_t row_elems,
                     int64_t block_size)
{
    int64_t total = 0;
#pragma omp parallel for schedule(static) reduction(+ : total)
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < ctx[b]; t += block_size) {
            const int64_t block = tables[b * max_blocks + t / block_size];
            const int64_t rows = ctx[b] - t < block_size ? ctx[b] - t : block_size;
            const uint64_t *pk = (const uint64_t *)(k + block * block_size * row_elems);
            const uint64_t *pv = (const uint64_t *)(v + block * block_size * row_elems);
            for (int64_t i = 0; i < rows * row_elems / 4; i += 8) /* a word a 64-byte line */
                total += (int64_t)(pk[i] + pv[i]);
        }
    return total;
}
