/* Prefill attention over the paged KV cache on AMX tiles (or in their layout with AVX-512 BF16
 * vectors, or, further down, in float32 vectors of AVX2 or AVX-512):
 * the n newest tokens of one sequence attend, causally, to all ctx tokens of its context (the n
 * among them), reading K in place.
 *
 * torch's SDPA needs the context gathered out of the blocks and, once part of it is cached, a
 * mask for the offset causal pattern, and reaches a fraction of what the tile unit's large bf16
 * matmuls do (docs/performance.md). Here, for each query head and tile of 16 query
 * rows (in parallel), over the context in chunks of 32 keys, with q_i at position ctx - n + i:
 *
 *   S^T[key][i] = K[key] . q_i                         tile products, K read in place
 *   online softmax over keys (float32, lanes = queries): running max m_i, sum l_i, and
 *   O^T[d][i] = alpha_i O^T[d][i] + sum_key V^T[d][key] P^T[key][i]      P rounded to bf16
 *   out[i] = O[i] / l_i                                  keys > position masked
 *
 * Transposed so that the 16 lanes of a vector are the 16 queries: the softmax needs no
 * horizontal reductions and P^T is a tile operand as it comes. K tiles are 16 keys of one block
 * (block_size % 16 == 0) read through the block table; V is packed once per call as V^T, 32
 * keys by 16 dims a tile, into `scratch` (paged_prefill_scratch_bytes() of it). P is rounded
 * to bfloat16 for its product with V, as torch's flash attention does. Keys at and past ctx
 * are masked, their V packed as zeros; a half chunk wholly past ctx is not read.
 *
 * Layouts (elements, row-major): q [n, Hq, D] rows q_stride apart; caches [slots, Hkv, D];
 * blocks: the sequence's block table; out [n, Hq, D] rows out_stride apart. D % 32 == 0, at
 * most 256. bfloat16 only.
 *
 * Per layer (paged_prefill_bf16_win): a sliding window of W > 0 tokens, q_i seeing keys
 * position - W < key <= position (transformers' Mistral and Gemma masks), and a soft-cap c > 0,
 * each scaled score s becoming c tanh(s / c) before the mask (Gemma 2). Chunks of keys wholly
 * before every query's window are neither packed nor read (the KV cache may have given their
 * blocks back: placeholders in the table). A tile starts at the first chunk its first query
 * needs; a lane whose keys all lie further on keeps m at -1e30, l and O at 0 over those chunks,
 * which leaves its result the same to the bit as when it starts at its own first chunk.
 */

#include <math.h>
#include <stdlib.h>

#include "common.h"

#define QT 16 /* queries per tile: the lanes */
#define KC 32 /* keys per chunk: one bf16 tile row */

/* The slot of token t through the block table. */
INLINE int64_t slot_of(const int64_t *blocks, int64_t block_size, int64_t t)
{
    return blocks[t / block_size] * block_size + t % block_size;
}

/* The first key that a query at `pos` sees: the window's (window > 0) or key 0. */
INLINE int64_t first_key(int64_t pos, int64_t window)
{
    return window > 0 && pos >= window ? pos - window + 1 : 0;
}

/* The context of the decode token a thread takes next, asked for into L2 a slice at a time
 * while it computes the one before: asked for all at once (context_to_l2), a token's memory
 * time and its arithmetic ran one after the other; in slices, they overlap (the attention of a
 * 16-token decode step 1.35-1.45x faster on the Zen 4: docs/performance.md, session 29). The
 * next line of K and of V is at (t, b): 16 slots from t on (a block's, contiguous), b bytes in.
 * Each thread claims its next item before it starts on the one it holds, so it knows which. */
struct ahead {
    const char *k, *v;
    const int64_t *blocks;
    int64_t block_size, ctx, row_bytes, t, b;
    int64_t at, bytes; /* slot t's offset and the bytes of its (up to) 16 rows, found at b = 0 */
};

INLINE void ahead_step(struct ahead *a, int64_t lines)
{
    for (; lines > 0 && a->t < a->ctx; lines--) {
        if (a->b == 0) { /* (slot_of divides: once per 16 rows, not per line) */
            a->at = slot_of(a->blocks, a->block_size, a->t) * a->row_bytes;
            a->bytes = (a->ctx - a->t < 16 ? a->ctx - a->t : 16) * a->row_bytes;
        }
        __builtin_prefetch(a->k + a->at + a->b, 0, 2); /* (locality 2: into L2, prefetcht1) */
        __builtin_prefetch(a->v + a->at + a->b, 0, 2);
        a->b += 64;
        if (a->b >= a->bytes) {
            a->b = 0;
            a->t += 16;
        }
    }
}

/* Running maxima stay above this: a lane whose keys so far are all masked (outside its window)
 * then gets e^(-huge) = 0-ish factors, never inf - inf. */
#define M_FLOOR -1e30f

/* The tile layout below (S^T and P^T with lanes = queries, V^T packed in pairs of keys) serves
 * two builds: with AMX the products run on the tile unit; with AVX-512 BF16 but no AMX (AMD Zen
 * 4 and 5, Cooper Lake) the same products run as vdpbf16ps in 512-bit vectors (VECTOR_TILES),
 * which sum the same bfloat16 pairs into float32 lanes. Everything else, the softmax, the
 * masks, the packing and how the work is shared out, is one code. */
#if defined(HAVE_AMX)
#define TILED_PREFILL 1
#elif defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define TILED_PREFILL 1
#define VECTOR_TILES 1
#endif

#ifdef __AVX512F__
/* 16 rows of 16 32-bit words, transposed in registers: r[j] word i <- r[i] word j. Unpacks
 * transpose the 4 x 4 blocks within each 128-bit lane, then two rounds of lane shuffles move
 * the blocks (16 gathers of one word per row did the same, about half of a decode's time in
 * this kernel). */
INLINE void transpose16(__m512i r[16])
{
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) {
            t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0x88);
            t[8 * i + j + 4] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; j++) {
        r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
    }
}
#endif

#ifdef TILED_PREFILL

/* The tile registers configured for the calling thread (16 rows of 64 bytes each), and given
 * back, around a parallel region's tiles; nothing where vectors do the products. */
INLINE void tiles_on(void)
{
#ifdef HAVE_AMX
    struct tile_config cfg = {.palette = 1};
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.bytes_per_row[t] = 64;
    }
    _tile_loadconfig(&cfg);
#endif
}

INLINE void tiles_off(void)
{
#ifdef HAVE_AMX
    _tile_release();
#endif
}

/* 2^y for 16 lanes of y <= 0: 2^round(y) from vscalefps times 2^f, |f| <= 1/2, from its Taylor
 * series to f^5 (relative error below 3e-6, far inside P's bfloat16 rounding). Below -126
 * (where float32 runs out) it gives 2^-126; masked lanes are zeroed by the caller. */
INLINE __m512 exp2_512(__m512 y)
{
    y = _mm512_max_ps(y, _mm512_set1_ps(-126.f));
    const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(y, n);
    __m512 p = _mm512_set1_ps(1.33335581e-3f); /* ln2^5 / 5! */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.61812911e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.55041087e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40226507e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93147181e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* c log2(e) tanh(x / c) for 16 lanes (x the scaled score, c the soft-cap): the soft-capped
 * score in the log2 units the softmax below works in. tanh(y) = 1 - 2 / (2^(2y log2 e) + 1);
 * exp2_512 saturates at both ends, so it gives +-1 there. */
INLINE __m512 softcap_log2_512(__m512 x, float cap)
{
    const __m512 e = exp2_512(_mm512_mul_ps(x, _mm512_set1_ps(2.f * 1.44269504f / cap)));
    const __m512 t = _mm512_sub_ps(_mm512_set1_ps(1.f),
                                   _mm512_div_ps(_mm512_set1_ps(2.f),
                                                 _mm512_add_ps(e, _mm512_set1_ps(1.f))));
    return _mm512_mul_ps(t, _mm512_set1_ps(cap * 1.44269504f));
}

/* Software prefetch, chunks of KC keys ahead (0: none). A decode step reads its K and V from
 * memory, a row of one head (128 bytes in the default model) per slot, through tile loads and
 * pack_v's loads that each wait for their lines; asking for the next chunk's lines while this
 * one is computed took a 16-token decode step's attention from 24-26 to 20-21 ms on one thread
 * of the AMX Xeon (2 chunks ahead: no better; docs/performance.md, session 25). */
#ifndef ATTN_PREFETCH
#define ATTN_PREFETCH 1
#endif

/* A decode token's whole context, K and V of every head, on its way to L2 (-DCONTEXT_TO_L2=0:
 * not): the token's attention waits on memory (most of pack_v's and attend_tile's samples
 * are on the loads and the chunk prefetches), and asking for all of it at once, into L2,
 * keeps more of its lines in flight than a chunk ahead into L1 (256 KiB at 340 tokens; the
 * C layer loop of a 16-token decode step 1.01-1.09x faster on the AMX Xeon, two runs of
 * alternating rounds: docs/performance.md, session 26). */
#ifndef CONTEXT_TO_L2
#define CONTEXT_TO_L2 1
#endif
INLINE void context_to_l2(const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *blocks,
                          int64_t block_size, int64_t ctx, int64_t row_bytes)
{
    for (int64_t t = 0; t < ctx; t += 16) { /* a block's 16 slots (block_size % 16 == 0) */
        const int64_t at = slot_of(blocks, block_size, t) * row_bytes;
        const int64_t bytes = (ctx - t < 16 ? ctx - t : 16) * row_bytes;
        for (int64_t b = 0; b < bytes; b += 64) {
            _mm_prefetch((const char *)k_cache + at + b, _MM_HINT_T1);
            _mm_prefetch((const char *)v_cache + at + b, _MM_HINT_T1);
        }
    }
}

/* Asks for the lines of chunk c's keys of KV head h in `cache` (K or V); nothing past ctx or
 * wholly before lo (whose blocks may have been given back). */
INLINE void prefetch_chunk(const uint16_t *cache, const int64_t *blocks, int64_t block_size,
                           int64_t lo, int64_t ctx, int64_t Hkv, int64_t D, int64_t h, int64_t c)
{
    for (int64_t t0 = c * KC; t0 < c * KC + KC && t0 < ctx; t0 += 16) { /* one block's 16 */
        if (t0 + 16 <= lo)
            continue;
        const char *row = (const char *)(cache + (slot_of(blocks, block_size, t0) * Hkv + h) * D);
        const int64_t keys = ctx - t0 < 16 ? ctx - t0 : 16;
        for (int64_t k = 0; k < keys; k++)
            for (int64_t b = 0; b < D * 2; b += 64)
                _mm_prefetch(row + k * Hkv * D * 2 + b, _MM_HINT_T0);
    }
}

/* V^T of chunk c of KV head h: for each slab of 16 dims, 16 rows (dims) of 32 keys. Pairs of
 * keys are interleaved first (each 32-bit word then holds one dim of both), then the 16 x 16
 * words of the slab are transposed: row d holds dim d of the 16 pairs. */
static void pack_v(const uint16_t *v_cache, const int64_t *blocks, int64_t block_size,
                   int64_t lo, int64_t ctx, int64_t Hkv, int64_t D, int64_t h, int64_t c,
                   uint16_t *dst)
{
    if (ATTN_PREFETCH && (c + ATTN_PREFETCH) * KC < ctx)
        prefetch_chunk(v_cache, blocks, block_size, lo, ctx, Hkv, D, h, c + ATTN_PREFETCH);
    const __m512i pairs = pair_up();
    const uint16_t *rows[KC];
    for (int64_t k = 0; k < KC; k++) { /* keys before lo (no query's) as zeros, never read */
        const int64_t t = c * KC + k;
        rows[k] = t >= lo && t < ctx ? v_cache + (slot_of(blocks, block_size, t) * Hkv + h) * D
                                     : NULL;
    }
    for (int64_t j = 0; j < D / 16; j++) {
        __m512i words[16]; /* [pair][dim of the slab], then [dim][pair] */
        for (int r = 0; r < 16; r++) {
            const uint16_t *a = rows[2 * r], *b = rows[2 * r + 1];
            const __m256i va = a ? _mm256_loadu_si256((const __m256i *)(a + 16 * j))
                                 : _mm256_setzero_si256();
            const __m256i vb = b ? _mm256_loadu_si256((const __m256i *)(b + 16 * j))
                                 : _mm256_setzero_si256();
            const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(va), vb, 1);
            words[r] = _mm512_permutexvar_epi16(pairs, ab);
        }
        transpose16(words);
        for (int d = 0; d < 16; d++)
            _mm512_store_si512(dst + j * 16 * KC + d * KC, words[d]);
    }
}

#ifdef HAVE_AMX
/* S^T [32 keys, 16 queries] of one chunk into s: k[half] the first of its 16 keys' rows in
 * the cache (NULL: past the context, zeros), row_bytes apart; qt Q^T in slabs of 32 dims. */
static void scores(const uint16_t *const k[2], int64_t row_bytes, int64_t D,
                   const uint16_t (*qt)[16 * 32], float *s)
{
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t j = 0; j < D / 32; j++) {
        _tile_loadd(4, qt[j], 64);
        if (k[0]) {
            _tile_loadd(0, k[0] + 32 * j, row_bytes);
            _tile_dpbf16ps(2, 0, 4);
        }
        if (k[1]) {
            _tile_loadd(1, k[1] + 32 * j, row_bytes);
            _tile_dpbf16ps(3, 1, 4);
        }
    }
    _tile_stored(2, s, 64);
    _tile_stored(3, s + 16 * QT, 64);
}

/* The same for D = 64, each operand in a tile of its own so that the products overlap. */
static void scores_d64(const uint16_t *const k[2], int64_t row_bytes, const uint16_t *qt,
                       float *s)
{
    _tile_loadd(4, qt, 64);
    _tile_loadd(5, qt + 16 * 32, 64);
    _tile_zero(2);
    _tile_zero(3);
    if (k[0]) {
        _tile_loadd(0, k[0], row_bytes);
        _tile_loadd(1, k[0] + 32, row_bytes);
        _tile_dpbf16ps(2, 0, 4);
        _tile_dpbf16ps(2, 1, 5);
    }
    if (k[1]) {
        _tile_loadd(6, k[1], row_bytes);
        _tile_loadd(7, k[1] + 32, row_bytes);
        _tile_dpbf16ps(3, 6, 4);
        _tile_dpbf16ps(3, 7, 5);
    }
    _tile_stored(2, s, 64);
    _tile_stored(3, s + 16 * QT, 64);
}

/* O^T [D, 16 queries] += V^T . P^T: v the chunk's V^T (slabs of 16 dims by 32 keys), pt P^T
 * as pairs of keys. */
static void values(const uint16_t *pt, const uint16_t *v, int64_t D, float *ot)
{
    _tile_loadd(4, pt, 64);
    for (int64_t j = 0; j < D / 16; j++) {
        _tile_loadd(6, ot + j * 16 * QT, 64);
        _tile_loadd(5, v + j * 16 * KC, 64);
        _tile_dpbf16ps(6, 5, 4);
        _tile_stored(6, ot + j * 16 * QT, 64);
    }
}

static void values_d64(const uint16_t *pt, const uint16_t *v, float *ot)
{
    _tile_loadd(4, pt, 64);
    _tile_loadd(0, ot, 64);
    _tile_loadd(1, ot + 16 * QT, 64);
    _tile_loadd(2, ot + 32 * QT, 64);
    _tile_loadd(3, ot + 48 * QT, 64);
    _tile_loadd(5, v, 64);
    _tile_loadd(6, v + 16 * KC, 64);
    _tile_loadd(7, v + 32 * KC, 64);
    _tile_dpbf16ps(0, 5, 4);
    _tile_dpbf16ps(1, 6, 4);
    _tile_dpbf16ps(2, 7, 4);
    _tile_loadd(5, v + 48 * KC, 64);
    _tile_dpbf16ps(3, 5, 4);
    _tile_stored(0, ot, 64);
    _tile_stored(1, ot + 16 * QT, 64);
    _tile_stored(2, ot + 32 * QT, 64);
    _tile_stored(3, ot + 48 * QT, 64);
}

#else /* VECTOR_TILES: the same products, one vdpbf16ps per 16 lanes and pair of terms */

/* A bfloat16 pair (one 32-bit word at p) in every lane */
INLINE __m512bh pair_at(const uint16_t *p)
{
    return (__m512bh)_mm512_set1_epi32(*(const int32_t *)p);
}

/* S^T [32 keys, 16 queries], as the tiles: for each key, its dims in pairs against Q^T's rows
 * of the same pairs. 8 keys at a time: 8 independent chains keep both vector units busy, and
 * their 8 row pointers stay in registers (with 16, GCC kept some in vector registers and moved
 * them back for every load; 8 at a time made the whole attention 1.04-1.06x faster on the Zen
 * 4, docs/performance.md, session 29). */
static void scores(const uint16_t *const k[2], int64_t row_bytes, int64_t D,
                   const uint16_t (*qt)[16 * 32], float *s)
{
    for (int half = 0; half < 2; half++)
        for (int k0 = 0; k0 < 16 && k[half]; k0 += 8) {
            const uint16_t *key_row[8];
            __m512 acc[8];
            for (int key = 0; key < 8; key++) {
                key_row[key] = (const uint16_t *)((const char *)k[half] + (k0 + key) * row_bytes);
                acc[key] = _mm512_setzero_ps();
            }
            for (int64_t w = 0; w < D / 2; w++) { /* dims 2w, 2w + 1 */
                const __m512bh qw = (__m512bh)_mm512_load_si512(qt[w / 16] + (w % 16) * 32);
#pragma GCC unroll 8
                for (int key = 0; key < 8; key++)
                    acc[key] = _mm512_dpbf16_ps(acc[key], qw, pair_at(key_row[key] + 2 * w));
            }
            for (int key = 0; key < 8; key++)
                _mm512_store_ps(s + (half * 16 + k0 + key) * QT, acc[key]);
        }
    for (int half = 0; half < 2; half++) /* a half past the context: zeros, as the tiles give */
        for (int key = 0; !k[half] && key < 16; key++)
            _mm512_store_ps(s + (half * 16 + key) * QT, _mm512_setzero_ps());
}

/* O^T [D, 16 queries] += V^T . P^T, as the tiles: row d of O^T takes V^T's row d, 16 pairs of
 * keys, against P^T's 16 rows of the same pairs; 16 dims at a time, 16 chains. */
static void values(const uint16_t *pt, const uint16_t *v, int64_t D, float *ot)
{
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
        __m512 acc[16];
        for (int d = 0; d < 16; d++)
            acc[d] = _mm512_load_ps(ot + (d0 + d) * QT);
        const uint16_t *vd = v + d0 * KC; /* pair `pair` of its 16 rows, KC apart */
        for (int pair = 0; pair < KC / 2; pair++, vd += 2) {
            const __m512bh p = (__m512bh)_mm512_load_si512(pt + pair * 32);
            /* one pointer, the rows at fixed offsets from it: left to itself GCC made 16, kept
             * some in vector registers and moved them back for every load (the attention
             * 1.05-1.07x faster this way on the Zen 4, session 29) */
            __asm__("" : "+r"(vd));
#pragma GCC unroll 16
            for (int d = 0; d < 16; d++)
                acc[d] = _mm512_dpbf16_ps(acc[d], p, pair_at(vd + d * KC));
        }
        for (int d = 0; d < 16; d++)
            _mm512_store_ps(ot + (d0 + d) * QT, acc[d]);
    }
}
#endif

/* S^T of chunk c of KV head h into s; a half wholly before key lo (before every query's window:
 * its block may have been given back) is not read. */
INLINE void chunk_scores(const uint16_t *k_cache, const int64_t *blocks, int64_t block_size,
                         int64_t lo, int64_t ctx, int64_t Hkv, int64_t D, int64_t h, int64_t c,
                         const uint16_t (*qt)[16 * 32], float *s)
{
    const uint16_t *k[2] = {NULL, NULL};
    for (int half = 0; half < 2; half++) { /* 16 keys: one block's worth (or part of one) */
        const int64_t t0 = c * KC + half * 16;
        if (t0 < ctx && t0 + 16 > lo)
            k[half] = k_cache + (slot_of(blocks, block_size, t0) * Hkv + h) * D;
    }
#ifdef HAVE_AMX
    if (D == 64) {
        scores_d64(k, Hkv * D * 2, qt[0], s);
        return;
    }
#endif
    scores(k, Hkv * D * 2, D, qt, s);
}

/* The online softmax of chunk c's S^T (sc, lanes = queries), in log2 units (scores times scale
 * * log2 e): updates each lane's running max m and sum l, writes P^T as pairs of keys in
 * bfloat16 (pt), and returns the factor alpha that O's rows take first. */
INLINE __m512 softmax_chunk(float *sc, int64_t c, int64_t first_pos, __m512i pos, __m512i below,
                            float scale, int64_t window, float softcap, __m512 *m_run,
                            __m512 *l_run, uint16_t *pt)
{
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    /* soft-capped scores come in log2 units already */
    const __m512 log2_scale = _mm512_set1_ps(softcap > 0.f ? 1.f : scale * 1.44269504f);
    const __m512i pairs = pair_up();
    if (softcap > 0.f)
        for (int k = 0; k < KC; k++)
            _mm512_store_ps(sc + k * QT,
                            softcap_log2_512(_mm512_mul_ps(_mm512_load_ps(sc + k * QT),
                                                           _mm512_set1_ps(scale)),
                                             softcap));
    const int masked = c * KC + KC - 1 > first_pos || window > 0;
    __mmask16 ok[KC];
    __m512 chunk_max = neg_inf;
    for (int k = 0; k < KC; k++) {
        const __m512i key = _mm512_set1_epi32(c * KC + k);
        ok[k] = masked ? _mm512_cmple_epi32_mask(key, pos) : 0xffff;
        if (window > 0)
            ok[k] &= _mm512_cmpgt_epi32_mask(key, below);
        const __m512 sk = _mm512_load_ps(sc + k * QT);
        chunk_max = _mm512_mask_max_ps(chunk_max, ok[k], chunk_max, sk);
    }
    /* finite: a lane with no key yet keeps M_FLOOR */
    const __m512 m = _mm512_max_ps(_mm512_max_ps(*m_run, _mm512_mul_ps(chunk_max, log2_scale)),
                                   _mm512_set1_ps(M_FLOOR));
    const __m512 alpha = exp2_512(_mm512_sub_ps(*m_run, m));
    *m_run = m;
    __m512 sum = _mm512_setzero_ps();
    for (int k = 0; k < KC; k += 2) {
        const __m512 s0 = _mm512_load_ps(sc + k * QT), s1 = _mm512_load_ps(sc + (k + 1) * QT);
        const __m512 p0 = _mm512_maskz_mov_ps(ok[k], exp2_512(_mm512_fmsub_ps(s0, log2_scale, m)));
        const __m512 p1 =
            _mm512_maskz_mov_ps(ok[k + 1], exp2_512(_mm512_fmsub_ps(s1, log2_scale, m)));
        sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
        const __m512i two = (__m512i)_mm512_cvtne2ps_pbh(p1, p0); /* [p0 | p1] as bf16 */
        _mm512_store_si512(pt + (k / 2) * 32, _mm512_permutexvar_epi16(pairs, two));
    }
    *l_run = _mm512_fmadd_ps(*l_run, alpha, sum);
    return alpha;
}

/* One tile of 16 lanes of KV head h: lane r is pair t0 + r of (query i, head j of the group),
 * t = i * G + j for the G = Hq / Hkv query heads that share h, so that the heads of a group
 * read each K and V tile once (a decode token's G heads share one tile). Each lane's arithmetic
 * depends only on its query, its position and the context, never on the tile's other lanes:
 * what makes a token's attention the same as a prompt's token or a generated one. */
static void attend_tile(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                        const uint16_t *vt, const int64_t *blocks, int64_t block_size, int64_t n,
                        int64_t ctx, int64_t Hq, int64_t Hkv, int64_t D, int64_t h, int64_t t0,
                        float scale, int64_t window, float softcap, uint16_t *out,
                        int64_t out_stride)
{
    const int64_t G = Hq / Hkv, rows = n * G - t0 < QT ? n * G - t0 : QT;
    const int64_t first_pos = ctx - n + t0 / G, last_pos = ctx - n + (t0 + rows - 1) / G;
    const int64_t chunks = last_pos / KC + 1, vt_chunk = D * KC;
    const int64_t first_chunk = first_key(first_pos, window) / KC;
    const int64_t lo = first_key(ctx - n, window); /* no query of the call sees keys before */
    __attribute__((aligned(64))) uint16_t qt[256 / 32][16 * 32]; /* Q^T, pairs of dims */
    __attribute__((aligned(64))) float s[2][KC * QT];             /* S^T of two chunks */
    __attribute__((aligned(64))) uint16_t pt[16 * 32];            /* P^T, pairs of keys */
    __attribute__((aligned(64))) float ot[256 * QT];              /* O^T */
    int32_t q_at[QT], pos_lanes[QT]; /* each lane's q row (in 32-bit words) and position */
    int32_t below_lanes[QT];         /* keys at or below this lie outside the lane's window */
    int64_t out_at[QT];
    for (int64_t r = 0; r < QT; r++) { /* padding lanes repeat the last real one */
        const int64_t t = t0 + (r < rows ? r : rows - 1), i = t / G, head = h * G + t % G;
        q_at[r] = (int32_t)((i * q_stride + head * D) / 2);
        out_at[r] = i * out_stride + head * D;
        pos_lanes[r] = (int32_t)(ctx - n + i);
        below_lanes[r] = (int32_t)(first_key(ctx - n + i, window) - 1);
    }

    /* Q^T as the second operand: row r of slab j holds dims (32j + 2r, +1) of each lane's
     * query, that is, as 32-bit words, word 16j + r of each lane's row (zeros in padding
     * lanes): 16 lanes' words of the slab loaded as rows and transposed (gathering them took
     * more time than the rest of a short tile's setup; docs/performance.md, session 29) */
    const int *q_words = (const int *)q;
    for (int64_t j = 0; j < D / 32; j++) {
        __m512i slab[16];
        for (int r = 0; r < QT; r++)
            slab[r] = r < rows ? _mm512_loadu_si512(q_words + q_at[r] + 16 * j)
                               : _mm512_setzero_si512();
        transpose16(slab);
        for (int w = 0; w < 16; w++)
            _mm512_store_si512(qt[j] + w * 32, slab[w]);
    }
    const __m512i pos = _mm512_loadu_si512(pos_lanes), below = _mm512_loadu_si512(below_lanes);
    __m512 m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++)
        _mm512_store_ps(ot + d * QT, _mm512_setzero_ps());

    /* S^T of the next chunk goes to the tile unit before this chunk's softmax, which then
     * runs while the products and their store complete (vectors merely take that order) */
    chunk_scores(k_cache, blocks, block_size, lo, ctx, Hkv, D, h, first_chunk, qt,
                 s[first_chunk & 1]);
    for (int64_t c = first_chunk; c < chunks; c++) {
        float *sc = s[c & 1];
        if (c + 1 < chunks)
            chunk_scores(k_cache, blocks, block_size, lo, ctx, Hkv, D, h, c + 1, qt,
                         s[(c + 1) & 1]);
        if (ATTN_PREFETCH && c + 1 + ATTN_PREFETCH < chunks)
            prefetch_chunk(k_cache, blocks, block_size, lo, ctx, Hkv, D, h, c + 1 + ATTN_PREFETCH);
        const __m512 alpha = softmax_chunk(sc, c, first_pos, pos, below, scale, window, softcap,
                                           &m, &l, pt);
        if (_mm512_cmp_ps_mask(alpha, _mm512_set1_ps(1.f), _CMP_NEQ_UQ)) /* a new max */
            for (int64_t d = 0; d < D; d++)
                _mm512_store_ps(ot + d * QT, _mm512_mul_ps(_mm512_load_ps(ot + d * QT), alpha));

        /* O^T += V^T . P^T */
        const uint16_t *v = vt + (h * ((ctx + KC - 1) / KC) + c) * vt_chunk;
#ifdef HAVE_AMX
        if (D == 64) {
            values_d64(pt, v, ot);
            continue;
        }
#endif
        values(pt, v, D, ot);
    }

    __attribute__((aligned(64))) float inv_l[QT];
    _mm512_store_ps(inv_l, _mm512_div_ps(_mm512_set1_ps(1.f), l));
    for (int64_t d = 0; d < D; d += 16) { /* lane i's row of O: column i of O^T */
        __m512i dims[16];
        for (int k = 0; k < 16; k++)
            dims[k] = _mm512_load_si512(ot + (d + k) * QT);
        transpose16(dims); /* dims[i]: dims d .. d + 15 of lane i */
        for (int64_t i = 0; i < rows; i++)
            store_bf16(out + out_at[i] + d,
                       _mm512_mul_ps(_mm512_castsi512_ps(dims[i]), _mm512_set1_ps(inv_l[i])));
    }
}

#ifdef VECTOR_TILES
/* O += P V over one chunk for R lanes (R, NG constants at each call site): pairs of keys in
 * order, as attend_tile sums them, each lane's 16-dim slabs as chains side by side (one chain
 * at a time, as it was, waited on vdpbf16ps's latency). A pair's two V rows are interleaved
 * here, 32 dims at a time, by in-lane unpacks: o holds each group of 32 dims as dims 0-3, 8-11,
 * 16-19, 24-27 then 4-7, 12-15, 20-23, 28-31 (`unscramble` puts them back). NG groups a pass. */
INLINE void chunk_values(float (*o)[256], const float *alpha, int rescale, const uint32_t *p_words,
                         const uint16_t *const *vrow, int64_t D, const int R, const int NG)
{
    for (int64_t g0 = 0; g0 < D / 32; g0 += NG) {
        __m512 sum[8][4];
        for (int r = 0; r < R; r++)
            for (int s = 0; s < 2 * NG; s++) {
                sum[r][s] = _mm512_load_ps(o[r] + 32 * g0 + 16 * s);
                if (rescale)
                    sum[r][s] = _mm512_mul_ps(sum[r][s], _mm512_set1_ps(alpha[r]));
            }
        for (int pair = 0; pair < KC / 2; pair++) {
            __m512bh vp[4];
            for (int g = 0; g < NG; g++) {
                const __m512i a = _mm512_loadu_si512(vrow[2 * pair] + 32 * (g0 + g));
                const __m512i b = _mm512_loadu_si512(vrow[2 * pair + 1] + 32 * (g0 + g));
                vp[2 * g] = (__m512bh)_mm512_unpacklo_epi16(a, b);
                vp[2 * g + 1] = (__m512bh)_mm512_unpackhi_epi16(a, b);
            }
            for (int r = 0; r < R; r++) {
                const __m512bh p = (__m512bh)_mm512_set1_epi32((int)p_words[pair * 16 + r]);
                for (int s = 0; s < 2 * NG; s++)
                    sum[r][s] = _mm512_dpbf16_ps(sum[r][s], vp[s], p);
            }
        }
        for (int r = 0; r < R; r++)
            for (int s = 0; s < 2 * NG; s++)
                _mm512_store_ps(o[r] + 32 * g0 + 16 * s, sum[r][s]);
    }
}

/* chunk_values for `rows` lanes: two 32-dim groups a pass up to 4 lanes (8 chains of 16
 * dims a lane), one from 5 */
static void chunk_values_rows(float (*o)[256], const float *alpha, int rescale,
                              const uint32_t *p_words, const uint16_t *const *vrow, int64_t D,
                              int64_t rows)
{
    const int wide = D % 64 == 0;
    switch (rows) {
#define ROWS_CASE(R)                                                                              \
    case R:                                                                                       \
        if (R <= 4 && wide)                                                                       \
            chunk_values(o, alpha, rescale, p_words, vrow, D, R, 2);                              \
        else                                                                                      \
            chunk_values(o, alpha, rescale, p_words, vrow, D, R, 1);                              \
        break;
        ROWS_CASE(1)
        ROWS_CASE(2)
        ROWS_CASE(3)
        ROWS_CASE(4)
        ROWS_CASE(5)
        ROWS_CASE(6)
        ROWS_CASE(7)
        ROWS_CASE(8)
#undef ROWS_CASE
    }
}

/* 16 dims of a 32-dim group of o, from chunk_values's order back to theirs: the first 16
 * (second: 1) */
INLINE __m512 unscramble(const float *group, int second)
{
    const __m512i first_idx =
        _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i idx = _mm512_add_epi32(first_idx, _mm512_set1_epi32(second ? 8 : 0));
    return _mm512_permutex2var_ps(_mm512_load_ps(group), idx, _mm512_load_ps(group + 16));
}

/* A decode token's tile (or a few tokens'), computed as attend_tile computes it, to the bit,
 * with the products turned around, for KV heads h0 .. h0 + heads - 1 at once: lane L is pair
 * t = L % (n G) of KV head h0 + L / (n G), so the softmax runs once for every head's lanes
 * (a head's G alone left most of 16 lanes idle). S with lanes = keys, one vdpbf16ps per lane,
 * 16 keys and pair of dims (attend_tile: one per key, for 16 lanes), then transposed to lanes
 * = queries for the same softmax; O with lanes = dims (chunk_values), reading V's rows in
 * place. Each lane's products and sums are the same operations in the same order, only held
 * in other vector lanes (test_paged_prefill.py's many-chunks test holds a decode token to its
 * numbers alone). Against packing V and one head a tile: a 16-token decode step's attention in
 * cache 1.7x faster on the Zen 4 (docs/performance.md, session 30). `next`: the context to ask
 * for meanwhile, `step` lines a chunk and head (struct ahead). No window or soft-cap: the C
 * layer loop's full attention only. */
#define FEW_LANES 8 /* a head's lanes (n G) up to which a decode token takes this path */
static void attend_few(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                       const uint16_t *v_cache, const int64_t *blocks, int64_t block_size,
                       int64_t n, int64_t ctx, int64_t Hq, int64_t Hkv, int64_t D, int64_t h0,
                       int64_t heads, float scale, uint16_t *out, int64_t out_stride,
                       struct ahead *next, int64_t step)
{
    static const uint16_t zeros[256] __attribute__((aligned(64))); /* V past ctx */
    const int64_t G = Hq / Hkv, rows = n * G, lanes = heads * rows; /* rows: a head's lanes */
    const int64_t last = lanes > 0 ? lanes - 1 : 0;
    const int64_t first_pos = ctx - n, chunks = (ctx - 1) / KC + 1, row_bytes = Hkv * D * 2;
    __attribute__((aligned(64))) float s_rows[QT][KC]; /* S, a lane's row of the chunk's keys */
    __attribute__((aligned(64))) float sc[KC * QT];    /* S^T of the chunk */
    __attribute__((aligned(64))) uint16_t pt[16 * 32]; /* P^T, pairs of keys */
    __attribute__((aligned(64))) float o[QT][256], alpha_of[QT];
    const int32_t *q_words[QT];
    int32_t pos_lanes[QT];
    int64_t out_at[QT];
    for (int64_t L = 0; L < QT; L++) { /* padding lanes repeat the last real one */
        const int64_t t = (L < lanes ? L : last) % rows, i = t / G;
        const int64_t head = (h0 + (L < lanes ? L : last) / rows) * G + t % G;
        if (L < lanes) {
            q_words[L] = (const int32_t *)(q + i * q_stride + head * D);
            out_at[L] = i * out_stride + head * D;
            for (int64_t d = 0; d < D; d += 16)
                _mm512_store_ps(o[L] + d, _mm512_setzero_ps());
        }
        pos_lanes[L] = (int32_t)(ctx - n + i);
    }
    const __m512i pos = _mm512_loadu_si512(pos_lanes);
    const __m512i below = _mm512_set1_epi32(-1); /* (no window) */
    __m512 m = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; c++) {
        /* (no chunk-ahead prefetch into L1 here: with `next` asking for the following token's
         * context, it made no difference; docs/performance.md, session 30) */
        ahead_step(next, step * heads);
        int64_t at[2] = {0, 0}; /* each half's first slot's row of head 0 (16 keys: a block's) */
        for (int half = 0; half < 2; half++)
            if (c * KC + half * 16 < ctx)
                at[half] = slot_of(blocks, block_size, c * KC + half * 16) * Hkv * D;
        const int halves = c * KC + 16 < ctx ? 2 : 1; /* (the first is always read) */
        /* S: acc[half][row], lanes = the half's 16 keys; both halves' chains side by side */
        for (int64_t hl = 0; hl < heads; hl++) {
            __m512 acc[2][FEW_LANES];
            for (int half = 0; half < 2; half++)
                for (int r = 0; r < FEW_LANES; r++)
                    acc[half][r] = _mm512_setzero_ps();
            for (int64_t j = 0; j < D / 32; j++) { /* 16 words (32 dims) of each key at a time */
                __m512i kw[2][16];
                for (int half = 0; half < halves; half++) {
                    const char *k = (const char *)(k_cache + at[half] + (h0 + hl) * D);
                    for (int key = 0; key < 16; key++)
                        kw[half][key] = _mm512_loadu_si512(k + key * row_bytes + 64 * j);
                    transpose16(kw[half]); /* kw[half][w]: word 16j + w of the 16 keys */
                }
                for (int w = 0; w < 16; w++)
                    for (int r = 0; r < rows; r++) {
                        const __m512bh qw =
                            (__m512bh)_mm512_set1_epi32(q_words[hl * rows + r][16 * j + w]);
                        for (int half = 0; half < halves; half++)
                            acc[half][r] =
                                _mm512_dpbf16_ps(acc[half][r], (__m512bh)kw[half][w], qw);
                    }
            }
            for (int r = 0; r < rows; r++)
                for (int half = 0; half < 2; half++)
                    _mm512_store_ps(s_rows[hl * rows + r] + 16 * half, acc[half][r]);
        }
        for (int half = 0; half < 2; half++) { /* to lanes = queries: S^T */
            __m512i st[16];
            for (int L = 0; L < 16; L++)
                st[L] = _mm512_load_si512(s_rows[L < lanes ? L : last] + 16 * half);
            transpose16(st);
            for (int key = 0; key < 16; key++)
                _mm512_store_si512(sc + (half * 16 + key) * QT, st[key]);
        }
        const __m512 alpha =
            softmax_chunk(sc, c, first_pos, pos, below, scale, 0, 0.f, &m, &l, pt);
        _mm512_store_ps(alpha_of, alpha);
        const int rescale = _mm512_cmp_ps_mask(alpha, _mm512_set1_ps(1.f), _CMP_NEQ_UQ) != 0;
        for (int64_t hl = 0; hl < heads; hl++) {
            const uint16_t *vrow[KC];
            for (int key = 0; key < KC; key++) {
                const int64_t t = c * KC + key;
                vrow[key] = t < ctx ? v_cache + at[key / 16] + (h0 + hl) * D + key % 16 * Hkv * D
                                    : zeros;
            }
            chunk_values_rows(o + hl * rows, alpha_of + hl * rows, rescale,
                              (const uint32_t *)pt + hl * rows, vrow, D, rows);
        }
    }
    __attribute__((aligned(64))) float inv_l[QT];
    _mm512_store_ps(inv_l, _mm512_div_ps(_mm512_set1_ps(1.f), l));
    for (int L = 0; L < lanes; L++)
        for (int64_t d = 0; d < D; d += 16)
            store_bf16(out + out_at[L] + d,
                       _mm512_mul_ps(unscramble(o[L] + d / 32 * 32, d % 32 != 0),
                                     _mm512_set1_ps(inv_l[L])));
}
#endif

#elif defined(__AVX2__) && defined(__FMA__)
#define VECTOR_PREFILL 1

/* Without tiles, in float32 FMAs: an AVX2-only CPU in 8 lanes, an AVX-512 one without BF16
 * (Skylake-X, Ice Lake) in 16 (VW). The context's K and V are widened once per call into
 * `scratch`: K^T in chunks of VW keys (kt [Hkv][keys / VW][D][VW], keys rounded up to VW,
 * zeros past ctx) and V as rows (vf [Hkv][keys][D]). Each task is one query head and VW queries,
 * over the keys in chunks of VW, with q_i at position ctx - n + i:
 *
 *   s_i = q_i . K[chunk] * scale      lanes = the VW keys, q_i broadcast: VW chains of FMAs
 *   s transposed VW x VW              lanes = the VW queries from here on
 *   online softmax (float32): running max m, sum l; p = e^(s - m), keys > position masked
 *   O_i = alpha_i O_i + sum_key p[key][i] V[key]      lanes = dims, p broadcast
 *   out_i = O_i / l_i
 *
 * With lanes = queries the softmax needs no horizontal reductions and no scalar exp (with lanes
 * = keys it cost more than either product). The softmax moves on UPDATE_KEYS keys at a time: O
 * is rescaled, loaded and stored once per 32 keys rather than per 8, which is faster
 * (docs/performance.md). P stays in float32 (torch's flash attention rounds it to bf16); the
 * output is rounded once. Every lane's arithmetic is the same in both widths, in the same
 * order, and the softmax's updates fall on the same keys: the two builds give the same bits
 * (tests/kernels/test_paged_prefill.py), and so the same greedy text. */
#define UPDATE_KEYS 32 /* keys per softmax update (64 was no faster in 8 lanes) */

/* 8 x 8 float32 transposed in place: r[j] lane i <- r[i] lane j */
INLINE void transpose8(__m256 r[8])
{
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4)
        for (int j = 0; j < 2; j++) {
            u[i + 2 * j] = _mm256_shuffle_ps(t[i + j], t[i + 2 + j], _MM_SHUFFLE(1, 0, 1, 0));
            u[i + 2 * j + 1] = _mm256_shuffle_ps(t[i + j], t[i + 2 + j], _MM_SHUFFLE(3, 2, 3, 2));
        }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

#ifdef __AVX512F__
#define VW 16
typedef __m512 vec;
typedef __m512i ivec;
typedef __mmask16 lanes_mask;
#define VOP(name) _mm512_##name
#else
#define VW 8
typedef __m256 vec;
typedef __m256i ivec;
typedef __m256 lanes_mask;
#define VOP(name) _mm256_##name
#endif

/* the operations whose intrinsics differ between the widths only in their prefix */
INLINE vec vzero(void) { return VOP(setzero_ps)(); }
INLINE vec vset(float x) { return VOP(set1_ps)(x); }
INLINE vec vload(const float *p) { return VOP(loadu_ps)(p); }
INLINE void vstore(float *p, vec v) { VOP(storeu_ps)(p, v); }
INLINE vec vbcast(const float *p) { return VOP(set1_ps)(*p); }
INLINE vec vadd(vec a, vec b) { return VOP(add_ps)(a, b); }
INLINE vec vsub(vec a, vec b) { return VOP(sub_ps)(a, b); }
INLINE vec vmul(vec a, vec b) { return VOP(mul_ps)(a, b); }
INLINE vec vdiv(vec a, vec b) { return VOP(div_ps)(a, b); }
INLINE vec vmax(vec a, vec b) { return VOP(max_ps)(a, b); }
INLINE vec vfma(vec a, vec b, vec c) { return VOP(fmadd_ps)(a, b, c); }
INLINE ivec iset(int32_t x) { return VOP(set1_epi32)(x); }
INLINE ivec iadd(ivec a, ivec b) { return VOP(add_epi32)(a, b); }

#if VW == 16
INLINE vec vexp(vec x) { return exp_approx16(x); }
INLINE vec vload_bf16(const uint16_t *p) { return load_bf16(p); }
INLINE void vstore_bf16(uint16_t *p, vec v) { store_bf16(p, v); }
INLINE ivec iload(const int32_t *p) { return _mm512_loadu_si512(p); }
/* Lanes (queries) that see key t: below_i < t < pos_i + 1, with past = pos + 1 and below the
 * last key before the lane's window (-1 without one) */
INLINE lanes_mask sees_window(ivec past, ivec below, int64_t t)
{
    const ivec key = iset((int32_t)t);
    return _mm512_cmpgt_epi32_mask(past, key) & _mm512_cmpgt_epi32_mask(key, below);
}
INLINE vec masked_inf(vec x, lanes_mask m) { return _mm512_mask_blend_ps(m, vset(-INFINITY), x); }
INLINE vec masked_zero(vec x, lanes_mask m) { return _mm512_maskz_mov_ps(m, x); }

/* 16 x 16 float32 transposed in place (transpose16's words) */
INLINE void transpose(vec r[16])
{
    __m512i w[16];
    for (int i = 0; i < 16; i++)
        w[i] = _mm512_castps_si512(r[i]);
    transpose16(w);
    for (int i = 0; i < 16; i++)
        r[i] = _mm512_castsi512_ps(w[i]);
}
#else
INLINE vec vexp(vec x) { return exp_approx8(x); }
INLINE vec vload_bf16(const uint16_t *p) { return load_bf16_8(p); }
INLINE void vstore_bf16(uint16_t *p, vec v) { store_bf16_8(p, v); }
INLINE ivec iload(const int32_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
/* (as above) */
INLINE lanes_mask sees_window(ivec past, ivec below, int64_t t)
{
    const ivec key = iset((int32_t)t);
    return _mm256_castsi256_ps(
        _mm256_and_si256(_mm256_cmpgt_epi32(past, key), _mm256_cmpgt_epi32(key, below)));
}
INLINE vec masked_inf(vec x, lanes_mask m) { return _mm256_blendv_ps(vset(-INFINITY), x, m); }
INLINE vec masked_zero(vec x, lanes_mask m) { return _mm256_and_ps(x, m); }

INLINE void transpose(vec r[8]) { transpose8(r); }
#endif

#define GROUP_CHUNKS (UPDATE_KEYS / VW) /* chunks of VW keys per softmax update */

INLINE int64_t keys_padded(int64_t ctx) { return (ctx + VW - 1) / VW * VW; }

/* The next chunk from *counter (shared by the threads) that is a decode token's, n * G <= VW
 * (one task a head), or num where none is left */
INLINE int64_t claim_token(int64_t *counter, int64_t num, const int64_t *n, int64_t G)
{
    int64_t i;
    do
        i = __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED);
    while (i < num && n[i] * G > VW);
    return i < num ? i : num;
}

/* Keys VW c .. VW c + VW - 1 of KV head h into kt and vf (zeros past ctx, and before lo: no
 * query of the call sees those, whose blocks may have been given back), in 8 x 8 transposes in
 * both widths (16 x 16 ones made this 2-3x slower on the Zen 4; docs/performance.md, session
 * 31). */
static void widen_chunk(const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *blocks,
                        int64_t block_size, int64_t lo, int64_t ctx, int64_t Hkv, int64_t D,
                        int64_t h, int64_t c, float *kt, float *vf)
{
    const uint16_t *k_rows[VW], *v_rows[VW];
    for (int j = 0; j < VW; j++) {
        const int64_t t = VW * c + j;
        const int64_t row =
            t >= lo && t < ctx ? (slot_of(blocks, block_size, t) * Hkv + h) * D : -1;
        k_rows[j] = row < 0 ? NULL : k_cache + row;
        v_rows[j] = row < 0 ? NULL : v_cache + row;
    }
    for (int half = 0; half < VW; half += 8)
        for (int64_t d = 0; d < D; d += 8) {
            __m256 r[8];
            for (int j = 0; j < 8; j++) {
                const uint16_t *k_row = k_rows[half + j], *v_row = v_rows[half + j];
                r[j] = k_row ? load_bf16_8(k_row + d) : _mm256_setzero_ps();
                _mm256_storeu_ps(vf + (VW * c + half + j) * D + d,
                                 v_row ? load_bf16_8(v_row + d) : _mm256_setzero_ps());
            }
            transpose8(r); /* r[j]: dim d + j of the 8 keys */
            for (int j = 0; j < 8; j++)
                _mm256_storeu_ps(kt + (c * D + d + j) * VW + half, r[j]);
        }
}

/* The first chunk (of VW keys) of the group of GROUP_CHUNKS chunks that holds `key`: groups
 * start at multiples of UPDATE_KEYS whatever a task's queries (and the width), so that a
 * query's softmax updates fall on the same keys alone or among others (batch invariance) */
INLINE int64_t first_group(int64_t key) { return key / UPDATE_KEYS * GROUP_CHUNKS; }

/* c tanh(x / c): 1 - 2 / (e^2y + 1), vexp clamping to +-1 at the ends */
INLINE vec softcap_lanes(vec x, float cap)
{
    const vec e = vexp(vmul(x, vset(2.f / cap)));
    return vmul(vsub(vset(1.f), vdiv(vset(2.f), vadd(e, vset(1.f)))), vset(cap));
}

/* out[c][i] = the scores of chunk c's VW keys (K^T at k, chunk after chunk) for query i (qs[i],
 * scaled) of R real ones, the padding lanes' the last real one's; C chunks (R, C constants at
 * each call site). Each sum is one chain of FMAs over the dims, in order (batch invariance);
 * with few queries (a decode token's G), C chunks' chains side by side keep the FMA units busy
 * where R chains alone waited on their latency (a decode step's attention 1.2x faster with the
 * avx2 build on the Zen 4; docs/performance.md, session 30). (The sums in an array of their
 * own: summed in the array `transpose` takes, GCC stored every sum to the stack after each FMA,
 * the attention 1.16-1.25x slower on the Zen 4 with that build; docs/performance.md, session
 * 29.) */
INLINE void chunk_sums(const float *k, const float (*qs)[256], int64_t D, const int R,
                       const int C, vec out[][VW])
{
    vec sums[GROUP_CHUNKS][VW];
    for (int c = 0; c < C; c++)
        for (int i = 0; i < R; i++)
            sums[c][i] = vzero();
    for (int64_t d = 0; d < D; d++) {
        vec kd[GROUP_CHUNKS];
        for (int c = 0; c < C; c++)
            kd[c] = vload(k + (c * D + d) * VW);
        for (int i = 0; i < R; i++) {
            const vec qd = vbcast(qs[i] + d);
            for (int c = 0; c < C; c++)
                sums[c][i] = vfma(kd[c], qd, sums[c][i]);
        }
    }
    for (int c = 0; c < C; c++)
        for (int i = 0; i < VW; i++)
            out[c][i] = sums[c][i < R ? i : R - 1];
}

/* The scores of `groups` chunks from k for `rows` real queries: chunk_sums, as many chunks at a
 * time as make 4-8 chains, then one at a time; from 5 real queries, all VW lanes */
static void group_sums(const float *k, const float (*qs)[256], int64_t D, int64_t rows,
                       int groups, vec out[GROUP_CHUNKS][VW])
{
    int c = 0;
    switch (rows) {
#define SUMS_CASE(R, C)                                                                           \
    case R:                                                                                       \
        for (; c + C <= groups; c += C)                                                           \
            chunk_sums(k + c * D * VW, qs, D, R, C, out + c);                                     \
        for (; c < groups; c++)                                                                   \
            chunk_sums(k + c * D * VW, qs, D, R, 1, out + c);                                     \
        break;
        SUMS_CASE(1, GROUP_CHUNKS)
        SUMS_CASE(2, GROUP_CHUNKS)
        SUMS_CASE(3, 2)
        SUMS_CASE(4, 2)
#undef SUMS_CASE
    default: /* (5 and more) */
        for (; c < groups; c++)
            chunk_sums(k + c * D * VW, qs, D, VW, 1, out + c);
    }
}

/* O_i = alpha_i O_i + sum_key pt[key][i] V[key] for queries i .. i + R - 1 and dims d ..
 * d + V VW - 1 (R, V constants at each call site), each lane a chain over the keys in order */
INLINE void values_pass(float (*o)[256], const float *alpha, const float (*pt)[VW],
                        const float *v, int64_t D, int keys, int i, int64_t d, const int R,
                        const int V)
{
    vec acc[4][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < V; j++)
            acc[r][j] = vmul(vload(o[i + r] + d + VW * j), vbcast(alpha + i + r));
    for (int key = 0; key < keys; key++) {
        vec pk[4];
        for (int r = 0; r < R; r++)
            pk[r] = vbcast(pt[key] + i + r);
        for (int j = 0; j < V; j++) {
            vec vk = vload(v + key * D + d + VW * j);
            /* in a register: GCC would fold the load into every FMA, 10 loads to 8 FMAs where
             * 6 do (8 lanes), which is slower */
            __asm__("" : "+v"(vk));
            for (int r = 0; r < R; r++)
                acc[r][j] = vfma(vk, pk[r], acc[r][j]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < V; j++)
            vstore(o[i + r] + d + VW * j, acc[r][j]);
}

/* VW lanes of KV head h over its widened context: lane r is pair t0 + r of (query i, head j of
 * the group), t = i * G + j, as on the tiles above (each lane's arithmetic its own). */
static void attend_queries(const uint16_t *q, int64_t q_stride, const float *kt, const float *vf,
                           int64_t n, int64_t ctx, int64_t Hq, int64_t Hkv, int64_t D, int64_t h,
                           int64_t t0, float scale, int64_t window, float softcap, uint16_t *out,
                           int64_t out_stride)
{
    const int64_t G = Hq / Hkv, rows = n * G - t0 < VW ? n * G - t0 : VW;
    const int64_t first_pos = ctx - n + t0 / G, last_pos = ctx - n + (t0 + rows - 1) / G;
    const int64_t chunks = last_pos / VW + 1;
    float qs[VW][256], o[VW][256];
    __attribute__((aligned(64))) float pt[UPDATE_KEYS][VW], alpha[VW]; /* P^T [key][query] */
    int32_t pos_lanes[VW], below_lanes[VW]; /* padding lanes repeat the last real one */
    int64_t out_at[VW];
    for (int r = 0; r < VW; r++) {
        const int64_t t = t0 + (r < rows ? r : rows - 1), i = t / G, head = h * G + t % G;
        const uint16_t *qi = q + i * q_stride + head * D;
        for (int64_t d = 0; d < D; d += VW) {
            vstore(qs[r] + d, vmul(vload_bf16(qi + d), vset(scale)));
            vstore(o[r] + d, vzero());
        }
        pos_lanes[r] = (int32_t)(ctx - n + i);
        below_lanes[r] = (int32_t)(first_key(ctx - n + i, window) - 1);
        out_at[r] = i * out_stride + head * D;
    }
    const ivec past = iadd(iload(pos_lanes), iset(1)), below = iload(below_lanes);
    vec m = vset(-INFINITY), l = vzero(); /* lanes: queries */
    for (int64_t c0 = first_group(first_key(first_pos, window)); c0 < chunks;
         c0 += GROUP_CHUNKS) {
        const int groups = chunks - c0 < GROUP_CHUNKS ? (int)(chunks - c0) : GROUP_CHUNKS;
        const int keys = VW * groups;
        /* all but the last groups of keys lie at or before every query, and (no window) after
         * none's first key: no masking there */
        const int all_see = VW * (c0 + groups) - 1 <= first_pos && window <= 0;
        vec top = vset(-INFINITY), s_all[GROUP_CHUNKS][VW];
        group_sums(kt + c0 * D * VW, qs, D, rows, groups, s_all);
        for (int gi = 0; gi < groups; gi++) {
            /* s[i] lanes = the chunk's VW keys, for query i; then transposed: lanes = queries */
            const int64_t c = c0 + gi;
            vec *s = s_all[gi];
            transpose(s);
            /* keys past a query's position, or before its window, masked (-inf) */
            for (int j = 0; j < VW; j++) {
                if (softcap > 0.f)
                    s[j] = softcap_lanes(s[j], softcap);
                if (!all_see)
                    s[j] = masked_inf(s[j], sees_window(past, below, VW * c + j));
                top = vmax(top, s[j]);
                vstore(pt[VW * gi + j], s[j]);
            }
        }
        /* online softmax, lanes = queries; m_new is finite (M_FLOOR where a lane has seen no
         * key yet), and alpha is (about) 0 the first time; masked keys' p is 0 */
        const vec m_new = vmax(vmax(m, top), vset(M_FLOOR));
        const vec a = vexp(vsub(m, m_new));
        m = m_new;
        vec sum = vzero();
        for (int j = 0; j < keys; j++) { /* (vexp of -inf is tiny, not 0: masked again) */
            const vec e = vexp(vsub(vload(pt[j]), m_new));
            const vec p = all_see ? e : masked_zero(e, sees_window(past, below, VW * c0 + j));
            sum = vadd(sum, p);
            vstore(pt[j], p);
        }
        l = vfma(l, a, sum);
        vstore(alpha, a);
        /* O_i = alpha_i O_i + sum_key P^T[key][i] V[key] for the real queries (a padding
         * lane's O is never stored): 2 queries by 32 dims a pass in 8 lanes (16 registers), 4
         * by 64 in 16 (32) */
        const float *v = vf + VW * c0 * D;
        for (int i = 0; i < rows; i += VW / 4) {
            int64_t d = 0;
#if VW == 16
            for (; d + 64 <= D; d += 64)
                values_pass(o, alpha, pt, v, D, keys, i, d, 4, 4);
#endif
            for (; d < D; d += 32)
                values_pass(o, alpha, pt, v, D, keys, i, d, VW / 4, 32 / VW);
        }
    }
    __attribute__((aligned(64))) float inv_l[VW];
    vstore(inv_l, vdiv(vset(1.f), l));
    for (int64_t i = 0; i < rows; i++)
        for (int64_t d = 0; d < D; d += VW)
            vstore_bf16(out + out_at[i] + d, vmul(vload(o[i] + d), vset(inv_l[i])));
}

#endif

/* Whether a chunk of n new tokens (G query heads a KV head) takes attend_few, which reads V in
 * place: it needs no packed V, so no scratch */
INLINE int takes_few(int64_t n, int64_t G)
{
#ifdef VECTOR_TILES
    return n * G <= FEW_LANES;
#else
    (void)n, (void)G;
    return 0;
#endif
}

/* Bytes of scratch a call needs: its packed V (tiles), or its widened K and V (vectors). */
int64_t paged_prefill_scratch_bytes(int64_t ctx, int64_t Hkv, int64_t D)
{
#ifdef VECTOR_PREFILL
    return Hkv * keys_padded(ctx) * D * 4 * 2;
#else
    return Hkv * ((ctx + KC - 1) / KC) * D * KC * 2;
#endif
}

/* How this build runs the kernel: 1 on AMX tiles (where Linux lets this process use them), 2 in
 * AVX2 vectors (a build without AVX-512), 3 in AVX-512 BF16 vectors (a build with it and no
 * AMX), 4 in AVX-512 float32 vectors (a build without BF16), 0 not at all. */
int64_t paged_prefill_available(void)
{
#ifdef HAVE_AMX
    return amx_granted();
#elif defined(VECTOR_TILES)
    return 3;
#elif defined(VECTOR_PREFILL)
    return VW == 16 ? 4 : 2;
#else
    return 0;
#endif
}

void paged_prefill_bf16_win(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                            const uint16_t *v_cache, const int64_t *blocks, int64_t block_size,
                            int64_t n, int64_t ctx, int64_t Hq, int64_t Hkv, int64_t D,
                            float scale, int64_t window, float softcap, uint16_t *out,
                            int64_t out_stride, uint16_t *scratch)
{
#ifdef TILED_PREFILL
    const int64_t chunks = (ctx + KC - 1) / KC, tiles = (n * (Hq / Hkv) + QT - 1) / QT;
    /* chunks before the first query's window are read by no tile */
    const int64_t skip = first_key(ctx - n, window) / KC, packed = chunks - skip;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t hc = 0; hc < Hkv * packed; hc++) {
            const int64_t h = hc / packed, c = skip + hc % packed;
            pack_v(v_cache, blocks, block_size, first_key(ctx - n, window), ctx, Hkv, D, h, c,
                   scratch + (h * chunks + c) * D * KC);
        }
        tiles_on();
        /* the last query tiles see the most keys: hand them out first */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < Hkv * tiles; item++) {
            const int64_t tile = tiles - 1 - item / Hkv, h = item % Hkv;
            attend_tile(q, q_stride, k_cache, scratch, blocks, block_size, n, ctx, Hq, Hkv, D,
                        h, tile * QT, scale, window, softcap, out, out_stride);
        }
        tiles_off();
    }
#elif defined(VECTOR_PREFILL)
    const int64_t keys = keys_padded(ctx), items = (n * (Hq / Hkv) + VW - 1) / VW;
    float *kt = (float *)scratch, *vf = kt + Hkv * keys * D;
    /* chunks before the first query's window's group are read by no task */
    const int64_t skip = first_group(first_key(ctx - n, window)), widened = keys / VW - skip;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t hc = 0; hc < Hkv * widened; hc++) {
            const int64_t h = hc / widened;
            widen_chunk(k_cache, v_cache, blocks, block_size, first_key(ctx - n, window), ctx, Hkv,
                        D, h, skip + hc % widened, kt + h * keys * D, vf + h * keys * D);
        }
        /* the last queries see the most keys: hand them out first */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < Hkv * items; item++) {
            const int64_t tile = items - 1 - item / Hkv, h = item % Hkv;
            attend_queries(q, q_stride, kt + h * keys * D, vf + h * keys * D, n, ctx, Hq, Hkv, D,
                           h, tile * VW, scale, window, softcap, out, out_stride);
        }
    }
#else
    (void)q, (void)q_stride, (void)k_cache, (void)v_cache, (void)blocks, (void)block_size;
    (void)n, (void)ctx, (void)Hq, (void)Hkv, (void)D, (void)scale, (void)out, (void)out_stride;
    (void)scratch, (void)window, (void)softcap;
    abort(); /* callers ask paged_prefill_available() first */
#endif
}

/* Full attention, no soft-capping: what the C layer loop (decode_stack.c) calls. */
void paged_prefill_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                        const uint16_t *v_cache, const int64_t *blocks, int64_t block_size,
                        int64_t n, int64_t ctx, int64_t Hq, int64_t Hkv, int64_t D, float scale,
                        uint16_t *out, int64_t out_stride, uint16_t *scratch)
{
    paged_prefill_bf16_win(q, q_stride, k_cache, v_cache, blocks, block_size, n, ctx, Hq, Hkv, D,
                           scale, 0, 0.f, out, out_stride, scratch);
}

/* Many requests' chunks in one call (the C layer loop's step: with batch invariance each decode
 * token is a chunk of one). One call per chunk made a parallel region per request and layer,
 * each with 3 KV heads' single tile to share between the threads and two barriers: in a
 * 16-request decode step the threads spent most of attention waiting (docs/performance.md,
 * session 24). Here every chunk's packing, then every chunk's tiles, are one pool of items for
 * the threads; each (chunk, head, tile) is computed by the same code as alone, so a token's
 * numbers do not change. A chunk with one tile a head (a decode token: its G query heads fill
 * a tile's lanes) is one item, all its heads in turn (packing its V first where it takes
 * attend_tile; attend_few reads V in place, its heads together): one thread reads all of each
 * slot's K and V rows (the heads' rows lie side by side), and a step of such chunks alone has
 * no barrier between packing and attending (docs/performance.md, sessions 25 and 30). Chunk i:
 * its queries q[i] (rows q_stride apart), n[i] of them, the last of a context of ctx[i] tokens
 * in blocks[i]; output to out[i]. Full attention, no soft-capping. The packed V of every chunk
 * lives in a buffer kept between the calling thread's calls. */
void paged_prefill_bf16_many(int64_t num, const uint16_t *const *q, const int64_t *const *blocks,
                             const int64_t *n, const int64_t *ctx, uint16_t *const *out,
                             int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                             int64_t block_size, int64_t Hq, int64_t Hkv, int64_t D, float scale,
                             int64_t out_stride)
{
    /* one per calling thread (two engines in one process call this from their own threads);
     * the OpenMP threads below use the caller's, through `packed` */
    static _Thread_local uint16_t *buffer;
    static _Thread_local int64_t buffer_bytes;
    const int64_t G = Hq / Hkv;
    int64_t *at = malloc((size_t)(3 * num + 3) * sizeof(int64_t));
    /* prefix sums of items: packing (of chunks of several tiles a head), and the attending:
     * a tile each (of those) or one for the chunk (one tile a head) */
    int64_t *packs = at + num + 1, *tiles = packs + num + 1;
    at[0] = packs[0] = tiles[0] = 0;
    for (int64_t i = 0; i < num; i++) {
        const int64_t per_head = (n[i] * G + QT - 1) / QT;
        at[i + 1] = at[i] + (takes_few(n[i], G) ? 0 : paged_prefill_scratch_bytes(ctx[i], Hkv, D));
        packs[i + 1] = packs[i] + (per_head > 1 ? Hkv * ((ctx[i] + KC - 1) / KC) : 0);
        tiles[i + 1] = tiles[i] + (per_head > 1 ? Hkv * per_head : 1);
    }
    if (at[num] > buffer_bytes) {
        free(buffer);
        buffer = aligned_alloc(64, (size_t)((at[num] + 63) / 64 * 64));
        buffer_bytes = at[num];
    }
    char *const packed = (char *)buffer;
#ifdef TILED_PREFILL
    int64_t claimed = 0; /* items handed out (below) */
#pragma omp parallel
    {
        int64_t i = 0;
        if (packs[num]) { /* (the same for every thread: all of them skip it, or none) */
#pragma omp for schedule(static)
            for (int64_t item = 0; item < packs[num]; item++) {
                while (item >= packs[i + 1])
                    i++;
                while (item < packs[i])
                    i--;
                const int64_t chunks = (ctx[i] + KC - 1) / KC, hc = item - packs[i];
                pack_v(v_cache, blocks[i], block_size, 0, ctx[i], Hkv, D, hc / chunks,
                       hc % chunks, (uint16_t *)(packed + at[i]) + hc * D * KC);
            }
        }
        tiles_on();
        i = 0;
        /* Items handed out one at a time as threads come for them, each thread claiming its
         * next one before it starts on the one it holds, so that it knows which context to ask
         * for meanwhile (struct ahead). */
        int64_t item = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED), asked = -1;
        while (item < tiles[num]) {
            const int64_t following = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
            while (item >= tiles[i + 1])
                i++;
            while (item < tiles[i])
                i--;
            uint16_t *vt = (uint16_t *)(packed + at[i]);
            if (tiles[i + 1] - tiles[i] == 1) { /* one tile a head: V^T, then the tiles */
                const int64_t chunks = (ctx[i] + KC - 1) / KC;
                const int few = takes_few(n[i], G);
                if (CONTEXT_TO_L2 && item != asked)
                    context_to_l2(k_cache, v_cache, blocks[i], block_size, ctx[i], Hkv * D * 2);
                /* the following item's context, if it is a decode token's too, spread over
                 * this one's V packs and heads */
                struct ahead next = {0};
                int64_t step = 0, j = i;
                while (j < num && following >= tiles[j + 1])
                    j++;
                if (following < tiles[num] && tiles[j + 1] - tiles[j] == 1) {
                    next = (struct ahead){.k = (const char *)k_cache,
                                          .v = (const char *)v_cache, .blocks = blocks[j],
                                          .block_size = block_size, .ctx = ctx[j],
                                          .row_bytes = Hkv * D * 2};
                    step = ctx[j] * Hkv * D * 2 / 64 / (chunks * Hkv + Hkv) + 1;
                    asked = following;
                }
                if (!few) /* (attend_few reads V in place) */
                    for (int64_t c = 0; c < chunks; c++)
                        for (int64_t h = 0; h < Hkv; h++) {
                            pack_v(v_cache, blocks[i], block_size, 0, ctx[i], Hkv, D, h, c,
                                   vt + (h * chunks + c) * D * KC);
                            ahead_step(&next, step);
                        }
#ifdef VECTOR_TILES
                /* as many KV heads a call as their lanes fill one tile */
                for (int64_t h0 = 0, per = QT / (n[i] * G); few && h0 < Hkv; h0 += per) {
                    const int64_t heads = Hkv - h0 < per ? Hkv - h0 : per;
                    ahead_step(&next, step * heads);
                    attend_few(q[i], q_stride, k_cache, v_cache, blocks[i], block_size, n[i],
                               ctx[i], Hq, Hkv, D, h0, heads, scale, out[i], out_stride, &next,
                               step);
                }
#endif
                for (int64_t h = 0; h < Hkv && !few; h++) {
                    ahead_step(&next, step);
                    attend_tile(q[i], q_stride, k_cache, vt, blocks[i], block_size, n[i], ctx[i],
                                Hq, Hkv, D, h, 0, scale, 0, 0.f, out[i], out_stride);
                }
            } else {
                const int64_t own = item - tiles[i], count = (tiles[i + 1] - tiles[i]) / Hkv;
                const int64_t tile = count - 1 - own / Hkv, h = own % Hkv;
                attend_tile(q[i], q_stride, k_cache, vt, blocks[i], block_size, n[i], ctx[i], Hq,
                            Hkv, D, h, tile * QT, scale, 0, 0.f, out[i], out_stride);
            }
            item = following;
        }
        tiles_off();
    }
#elif defined(VECTOR_PREFILL)
    /* Prompt chunks (more than one task a head) one at a time, each split between the threads
     * by paged_prefill_bf16_win; then the decode tokens (one task a head: a token's G queries
     * fit a task's VW lanes) in one parallel region, a token to a thread, widened and attended
     * as paged_prefill_bf16_win does it (so with its bits), the context of the thread's next
     * token asked for meanwhile (struct ahead). Each token in a call of its own, its three
     * tasks shared by two threads, took a 16-token decode step's attention 22 ms on the Zen 4
     * with this build; docs/performance.md, session 29. */
    int64_t claimed = 0; /* chunk indices handed out (claim_token) */
    for (int64_t i = 0; i < num; i++)
        if (n[i] * G > VW)
            paged_prefill_bf16_win(q[i], q_stride, k_cache, v_cache, blocks[i], block_size, n[i],
                                   ctx[i], Hq, Hkv, D, scale, 0, 0.f, out[i], out_stride,
                                   (uint16_t *)(packed + at[i]));
#pragma omp parallel
    {
        int64_t i = claim_token(&claimed, num, n, G);
        while (i < num) {
            const int64_t following = claim_token(&claimed, num, n, G), keys = keys_padded(ctx[i]);
            float *kt = (float *)(packed + at[i]), *vf = kt + Hkv * keys * D;
            struct ahead next = {0};
            int64_t step = 0;
            if (following < num) {
                next = (struct ahead){.k = (const char *)k_cache, .v = (const char *)v_cache,
                                      .blocks = blocks[following], .block_size = block_size,
                                      .ctx = ctx[following], .row_bytes = Hkv * D * 2};
                step = ctx[following] * Hkv * D * 2 / 64 / (Hkv * keys / VW + Hkv) + 1;
            }
            for (int64_t h = 0; h < Hkv; h++)
                for (int64_t c = 0; c < keys / VW; c++) {
                    widen_chunk(k_cache, v_cache, blocks[i], block_size, 0, ctx[i], Hkv, D, h, c,
                                kt + h * keys * D, vf + h * keys * D);
                    ahead_step(&next, step);
                }
            for (int64_t h = 0; h < Hkv; h++) {
                ahead_step(&next, step);
                attend_queries(q[i], q_stride, kt + h * keys * D, vf + h * keys * D, n[i], ctx[i],
                               Hq, Hkv, D, h, 0, scale, 0, 0.f, out[i], out_stride);
            }
            i = following;
        }
    }
#else
    for (int64_t i = 0; i < num; i++)
        paged_prefill_bf16_win(q[i], q_stride, k_cache, v_cache, blocks[i], block_size, n[i],
                               ctx[i], Hq, Hkv, D, scale, 0, 0.f, out[i], out_stride,
                               (uint16_t *)(packed + at[i]));
#endif
    free(at);
}
