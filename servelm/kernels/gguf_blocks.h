/* GGUF's own quantized blocks (Q8_0, Q4_K, Q5_K, Q6_K) multiplied as they are: included at the
 * end of quant_matmul.c, whose helpers (group_sums, GROUP, the bf16 and half conversions) it
 * uses. A file of its own so that this kernel and the q4 one can change apart. */

/* ---- GGUF blocks as the file holds them: Q8_0, Q4_K, Q5_K, Q6_K --------------------------
 *
 * y = x W^T for W [N, K] kept as the GGUF file's own blocks, each row of W its K / QK blocks
 * back to back (the file's layout; the importer keeps them, store/gguf_import.py). A block's
 * weights are w = (d * sc) * q - (dmin * m) (Q4_K, Q5_K: 8 sub-blocks of 32, 6-bit sc and m),
 * (d * sc) * (q - 32) (Q6_K: 16 sub-blocks of 16, int8 sc) or d * q (Q8_0, blocks of 32), with
 * d and dmin float16. Each block of a row is unpacked once per call into float32 weights
 * (d * sc) * q, which are exact in float32 (at most 11 + 7 + 5 = 23 significant bits), and every
 * row of x runs through them in 16 lanes of FMAs; the (dmin * m) part is taken as
 * (dmin * m) * sum(x) per sub-block. Products are exact, sums float32, y rounded to bfloat16
 * once, as q4 does. The code is plain C that the compiler vectorizes for each build.
 *
 * Batch invariant whatever the setting: a row of x meets the same operations in the same order
 * whatever the number of rows (threads split W's rows, never x's). A GEMM of many rows (a
 * prompt) runs at this vector code's FMA speed: no tiles, no register blocking over x. */

#define QK_K 256
enum { GGUF_Q8_0 = 8, GGUF_Q4_K = 12, GGUF_Q5_K = 13, GGUF_Q6_K = 14 };
#define KQ_LANES 16
/* Rows of W unpacked together (8 KiB of float32 weights, in L1), so that each block of a row of
 * x is read once per 8 rows of W rather than once per row: a prompt's x comes from cache 8
 * times less. Each row's arithmetic is the same whatever the tile. */
#define KQ_TILE 8

/* weights per block and bytes per block of a GGUF type; 0 for one this code does not read */
int64_t gguf_block_size(int64_t type, int64_t *bytes)
{
    switch (type) {
    case GGUF_Q8_0: *bytes = 34; return 32;
    case GGUF_Q4_K: *bytes = 144; return QK_K;
    case GGUF_Q5_K: *bytes = 176; return QK_K;
    case GGUF_Q6_K: *bytes = 210; return QK_K;
    default: *bytes = 0; return 0;
    }
}

/* the float16 at p, which a block of 34 or 210 bytes may hold at an odd address */
INLINE float half_at(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return half_to_float(h);
}

/* Q4_K / Q5_K's 12 bytes of 6-bit scales and mins -> sc[8], m[8] (llama.cpp's get_scale_min_k4) */
INLINE void scale_min_k4(const uint8_t *s, uint8_t *sc, uint8_t *m)
{
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        m[j] = s[4 + j] & 63;
        sc[4 + j] = (uint8_t)((s[8 + j] & 0x0F) | ((s[j] >> 2) & 0x30));
        m[4 + j] = (uint8_t)((s[8 + j] >> 4) | ((s[4 + j] >> 2) & 0x30));
    }
}

/* One block -> its weights' (d * sc) * q parts in w (exact), and the (dmin * m) of each
 * sub-block of 32 in mins (Q4_K, Q5_K; the others have none). Returns the weights per block. */
INLINE int unpack_block(int type, const uint8_t *blk, float *w, float *mins)
{
    if (type == GGUF_Q8_0) {
        const float d = half_at(blk);
        const int8_t *q = (const int8_t *)(blk + 2);
        for (int i = 0; i < 32; i++)
            w[i] = d * (float)q[i];
        return 32;
    }
    if (type == GGUF_Q6_K) {
        const uint8_t *ql = blk, *qh = blk + 128;
        const int8_t *sc = (const int8_t *)(blk + 192);
        const float d = half_at(blk + 208);
        /* element 128h + 32s + i: low 4 bits from ql[64h + 32(s % 2) + i] (high nibble for
         * s >= 2), high 2 bits from qh[32h + i] >> 2s */
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 4; s++) {
                for (int half = 0; half < 2; half++) { /* the sub-blocks of 16 */
                    const int e0 = 128 * h + 32 * s + 16 * half;
                    const float ds = d * (float)sc[e0 / 16];
                    const uint8_t *l = ql + 64 * h + 32 * (s % 2) + 16 * half;
                    const uint8_t *u = qh + 32 * h + 16 * half;
                    for (int i = 0; i < 16; i++) {
                        const int lo = (l[i] >> (4 * (s / 2))) & 15, hi = (u[i] >> (2 * s)) & 3;
                        w[e0 + i] = ds * (float)((lo | (hi << 4)) - 32);
                    }
                }
            }
        return QK_K;
    }
    /* Q4_K, Q5_K: sub-block 2p + t from the low (t = 0) or high (t = 1) nibbles of qs[32p..];
     * Q5_K's fifth bit of sub-block j's element i is bit j of qh[i] */
    const float d = half_at(blk), dmin = half_at(blk + 2);
    uint8_t sc[8], m[8];
    scale_min_k4(blk + 4, sc, m);
    const int five = type == GGUF_Q5_K;
    const uint8_t *qh = blk + 16, *qs = blk + (five ? 48 : 16);
    for (int j = 0; j < 8; j++) {
        const float ds = d * (float)sc[j];
        mins[j] = dmin * (float)m[j];
        for (int i = 0; i < 32; i++) {
            int q = (qs[32 * (j / 2) + i] >> (4 * (j % 2))) & 15;
            if (five)
                q |= ((qh[i] >> j) & 1) << 4;
            w[32 * j + i] = ds * (float)q;
        }
    }
    return QK_K;
}

/* x [B, K] bfloat16; w [N, row bytes] GGUF blocks of `type`; y [B, N] bfloat16, or float32
 * with f32 (the logits head). K a multiple of the type's block (the caller checks). */
void gguf_matmul_bf16(int64_t type, const uint16_t *x, const uint8_t *w, void *y, int64_t B,
                      int64_t N, int64_t K, int64_t f32)
{
    int64_t block_bytes;
    const int64_t qk = gguf_block_size(type, &block_bytes);
    if (qk == 0)
        return;
    const int64_t blocks = K / qk, row_bytes = blocks * block_bytes, G = K / GROUP;
    const int with_mins = type == GGUF_Q4_K || type == GGUF_Q5_K;
    float *xf = malloc((size_t)(B * K) * sizeof(float));
    float *xs = malloc((size_t)(B * G) * sizeof(float));
    for (int64_t i = 0; i < B * K; i++)
        xf[i] = bf16_to_float(x[i]);
    if (with_mins)
        group_sums(x, xs, B, K);
#pragma omp parallel
    {
        float *wf = malloc(KQ_TILE * QK_K * sizeof(float)), mins[KQ_TILE][8];
        float *acc = malloc((size_t)(B * KQ_TILE * (KQ_LANES + 1)) * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < (N + KQ_TILE - 1) / KQ_TILE; t++) {
            const int64_t n0 = t * KQ_TILE, rows = N - n0 < KQ_TILE ? N - n0 : KQ_TILE;
            for (int64_t i = 0; i < B * KQ_TILE * (KQ_LANES + 1); i++)
                acc[i] = 0.f; /* per row of x and of W: 16 lanes, then the mins' sum */
            for (int64_t k = 0; k < blocks; k++) {
                for (int64_t r = 0; r < rows; r++)
                    unpack_block((int)type, w + (n0 + r) * row_bytes + k * block_bytes,
                                 wf + r * QK_K, mins[r]);
                for (int64_t b = 0; b < B; b++) {
                    const float *xb = xf + b * K + k * qk;
                    for (int64_t r = 0; r < rows; r++) {
                        const float *wr = wf + r * QK_K;
                        float *lanes = acc + (b * KQ_TILE + r) * (KQ_LANES + 1), sum[KQ_LANES];
                        /* a local copy: the compiler keeps it in registers across the loop */
                        memcpy(sum, lanes, sizeof sum);
                        for (int64_t i = 0; i < qk; i += KQ_LANES)
                            for (int l = 0; l < KQ_LANES; l++)
                                sum[l] += wr[i + l] * xb[i + l];
                        memcpy(lanes, sum, sizeof sum);
                        if (with_mins)
                            for (int j = 0; j < 8; j++)
                                lanes[KQ_LANES] += mins[r][j] * xs[b * G + k * 8 + j];
                    }
                }
            }
            for (int64_t b = 0; b < B; b++)
                for (int64_t r = 0; r < rows; r++) {
                    const float *lanes = acc + (b * KQ_TILE + r) * (KQ_LANES + 1);
                    float sum = 0.f;
                    for (int l = 0; l < KQ_LANES; l++)
                        sum += lanes[l];
                    const int64_t at = b * N + n0 + r;
                    if (f32)
                        ((float *)y)[at] = sum - lanes[KQ_LANES];
                    else
                        ((uint16_t *)y)[at] = float_to_bf16(sum - lanes[KQ_LANES]);
                }
        }
        free(acc);
        free(wf);
    }
    free(xf);
    free(xs);
}

/* The float32 weights W [N, K] that GGUF blocks of `type` hold, w = (d * sc) * q - dmin * m
 * rounded once, as the gguf package's dequantization computes them: for the check at load. */
void gguf_dequantize_f32(int64_t type, const uint8_t *w, float *out, int64_t N, int64_t K)
{
    int64_t block_bytes;
    const int64_t qk = gguf_block_size(type, &block_bytes);
    if (qk == 0)
        return;
    const int64_t blocks = K / qk;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float wf[QK_K], mins[8] = {0};
        for (int64_t k = 0; k < blocks; k++) {
            unpack_block((int)type, w + (n * blocks + k) * block_bytes, wf, mins);
            float *o = out + n * K + k * qk;
            for (int64_t i = 0; i < qk; i++) {
                volatile float v = wf[i]; /* no fused multiply-add: one rounding, as numpy's */
                o[i] = v - mins[i / 32];
            }
        }
    }
}
