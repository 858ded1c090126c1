/* A step's whole layer stack in one call: the same kernels, in the same order, that
 * LlamaDecoderLayer.forward calls one by one from Python.
 *
 * At one token per request the ~10 Python calls around a layer's kernels (module dispatch,
 * argument checks, output allocation, ctypes) cost more than the kernels (docs/performance.md).
 * This loop calls the kernels directly, through pointers to the functions the other libraries
 * export (cpu_ops.c, quant_matmul.c with gguf_blocks.h, paged_decode.c, paged_prefill.c), so
 * each of them stays the only copy of its code and the results are bit for bit those of the
 * Python path. A projection (`struct proj`) is q4_matmul's int4 weight, or a GGUF file's
 * own parts as GGUFWeight keeps them (model/layers/linear.py): each part's rows by its own
 * kernel (gguf_matmul for Q4_K / Q5_K / Q6_K / Q8_0 blocks, q8_matmul rounded to bfloat16,
 * q4_matmul), into its columns of the output, as GGUFWeight.__call__ does. Per layer, for
 * the step's B rows (tokens):
 *
 *   h = norm(x += delta)                    add_rms_norm   (no add before the first layer)
 *   qkv = h Wqkv^T;  rotate q and k         matmul (q4 or the parts'), rotary
 *   a = attention(q; store k, v at slots)   paged_decode for decode tokens (storing theirs);
 *                                           prompt tokens stored first, then paged_prefill
 *                                           (with batch invariance, a decode token too, as a
 *                                           prompt chunk of one)
 *   delta = a Wo^T;  h = norm(x += delta)   matmul, add_rms_norm
 *   delta = silu(h Wg^T) * (h Wu^T) Wd^T    matmul, silu_and_mul, matmul (the first two in
 *                                           one where the gate/up is q4: q4_silu_matmul)
 *
 * and after the last layer out = norm(x += delta). Tensors are bfloat16, row-major. The last
 * layer, after storing every row's K/V, goes on with the step's K kept rows alone (a prompt
 * chunk's last token, none of a chunk that does not finish its prompt: attention.py), as the
 * Python layers do: x's kept rows are moved to its first K, and out holds K rows.
 */
#include <string.h>

#include <stddef.h>
#include <stdint.h>

#include "common.h"

/* -DSTACK_TIMING: wall time per kind of kernel, summed over calls, for benchmarks/decode_step.py
 * (decode_stack_timings reads and clears them). Off by default: the clock calls are not free. */
enum { T_NORM, T_QKV, T_ROTARY, T_STORE, T_ATTN, T_O, T_GATE_UP, T_SILU, T_DOWN, T_N };
#ifdef STACK_TIMING
#include <time.h>
static double timing[T_N];
static double seconds(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}
#define TIMED(slot, ...)                                                                       \
    do {                                                                                       \
        const double t0_ = seconds();                                                          \
        __VA_ARGS__;                                                                           \
        timing[slot] += seconds() - t0_;                                                       \
    } while (0)
int64_t decode_stack_timings(double *out)
{
    memcpy(out, timing, sizeof timing);
    memset(timing, 0, sizeof timing);
    return T_N;
}
#else
#define TIMED(slot, ...) __VA_ARGS__
#endif

#ifndef KV_PREFETCH /* (see the K/V stores below) */
#define KV_PREFETCH 1
#endif

typedef void (*norm_fn)(void *x, const void *delta, const void *w, void *out, int64_t T,
                        int64_t H, float eps);
typedef void (*rotary_fn)(void *x, int64_t row_stride, int64_t T, int64_t H, int64_t D,
                          const void *cos, const void *sin);
typedef void (*silu_fn)(const void *gate_up, void *out, int64_t T, int64_t I);
typedef void (*matmul_fn)(const uint16_t *x, const uint8_t *w, uint16_t *y, int64_t B, int64_t N,
                          int64_t K);
typedef void (*gguf_fn)(int64_t type, const uint16_t *x, const uint8_t *w, void *y, int64_t B,
                        int64_t N, int64_t K, int64_t f32);
typedef void (*q8_fn)(const uint16_t *x, const uint8_t *w, float *y, int64_t B, int64_t N,
                      int64_t K);
typedef void (*attention_fn)(const void *q, int64_t q_stride, const void *k, int64_t k_stride,
                             const void *v, int64_t v_stride, void *k_cache, void *v_cache,
                             const int64_t *slots, const int64_t *block_tables,
                             int64_t max_blocks, const int64_t *context_lens, int64_t B,
                             int64_t Hq, int64_t Hkv, int64_t block_size, int64_t max_len,
                             float scale, void *out);
typedef void (*prefill_fn)(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                           const uint16_t *v_cache, const int64_t *blocks, int64_t block_size,
                           int64_t n, int64_t ctx, int64_t Hq, int64_t Hkv, int64_t D, float scale,
                           uint16_t *out, int64_t out_stride, uint16_t *scratch);

typedef int64_t (*q4_silu_fn)(const uint16_t *x, const uint8_t *w, uint16_t *act, int64_t B,
                              int64_t I, int64_t K);
typedef void (*prefill_many_fn)(int64_t num, const uint16_t *const *q,
                                const int64_t *const *blocks, const int64_t *n, const int64_t *ctx,
                                uint16_t *const *out, int64_t q_stride, const uint16_t *k_cache,
                                const uint16_t *v_cache, int64_t block_size, int64_t Hq,
                                int64_t Hkv, int64_t D, float scale, int64_t out_stride);

/* Fixed for the life of the model (mirrored by ctypes Structures in decode_stack.py). */
struct kernels {
    norm_fn norm;
    rotary_fn rotary;
    silu_fn silu;
    matmul_fn q4;
    attention_fn attention;
    prefill_fn prefill; /* NULL: steps with prompt tokens are not taken */
    gguf_fn gguf;       /* gguf_matmul_bf16 */
    q8_fn q8;           /* q8_matmul_bf16 */
    prefill_many_fn prefill_many; /* paged_prefill_bf16_many: every prompt chunk at once */
    q4_silu_fn q4_silu; /* q4_silu_matmul_bf16: gate/up and silu_and_mul in one (0: not taken) */
};

struct shape {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
};

/* Rows start .. start + rows - 1 of a projection's output, from one stored weight. */
enum { PART_Q4 = 0, PART_GGUF = 1, PART_Q8 = 2 };
struct proj_part {
    int64_t kind, type, start, rows; /* type: the GGUF type number (PART_GGUF) */
    const uint8_t *w;
};

struct proj {
    int64_t num_parts;
    const struct proj_part *parts;
};

struct layer {
    const void *input_norm, *post_norm;          /* [hidden] */
    const struct proj *qkv, *o, *gate_up, *down;
    void *k_cache, *v_cache;                     /* [slots, kv_heads, head_dim] */
};

/* Rows start .. start + n - 1 of a step, which attend alike: n decode tokens, one per request
 * (blocks: their block tables [n, max_blocks]; context_lens [n]; max_len the longest), or one
 * request's n new tokens, the last of its context (prefill != 0; blocks: its block table;
 * max_len: its context length). kept: the place among the kept rows of its first decode row,
 * or of a prompt chunk's last row (-1: the chunk has none kept). */
struct part {
    int64_t start, n, prefill;
    const int64_t *blocks, *context_lens;
    int64_t max_blocks, max_len, kept;
};

/* This step: B tokens, their rotary rows, where their K/V go, and its parts (each row in one). */
struct step {
    int64_t B;
    const void *cos, *sin;                       /* [B, head_dim] */
    const int64_t *slots;                        /* [B] */
    int64_t num_parts;
    const struct part *parts;
    void *prefill_scratch;                       /* paged_prefill's, for the longest context */
    int64_t K;                                   /* rows the last layer computes */
    const int64_t *kept_rows;                    /* [K] ascending; NULL: all B rows (K = B) */
};

/* Scratch rows, each sized for B: h [B, hidden], qkv [B, (heads + 2 kv_heads) head_dim],
 * attn [B, heads head_dim], delta [B, hidden], gate_up [B, 2 intermediate], act [B, intermediate],
 * part [B, the most rows of any part] float32 (one part's output, before its columns). */
struct scratch {
    void *h, *qkv, *attn, *delta, *gate_up, *act, *part;
};

/* y [B, N] = x [B, K] W^T, W in p's parts: what Linear gives for an int4 or GGUF weight. */
static void project(const struct kernels *k, const struct proj *p, const uint16_t *x, uint16_t *y,
                    int64_t B, int64_t N, int64_t K, void *tmp)
{
    for (int64_t i = 0; i < p->num_parts; i++) {
        const struct proj_part *pt = &p->parts[i];
        const int64_t rows = pt->rows;
        if (pt->kind == PART_Q8) { /* float32 out, rounded as torch's .to(bfloat16) */
            const float *f = tmp;
            k->q8(x, pt->w, tmp, B, rows, K);
            for (int64_t b = 0; b < B; b++)
                for (int64_t r = 0; r < rows; r++)
                    y[b * N + pt->start + r] = float_to_bf16(f[b * rows + r]);
            continue;
        }
        uint16_t *dst = p->num_parts == 1 ? y : tmp;
        if (pt->kind == PART_GGUF)
            k->gguf(pt->type, x, pt->w, dst, B, rows, K, 0);
        else
            k->q4(x, pt->w, dst, B, rows, K);
        if (dst != y)
            for (int64_t b = 0; b < B; b++)
                memcpy(y + b * N + pt->start, dst + b * rows, 2 * rows);
    }
}

/* x [B, hidden]: the token embeddings, updated in place into the residual stream;
 * out [B, hidden]: the final norm's output (what the logits head reads) in its first K rows. */
void decode_stack_bf16(const struct kernels *k, const struct shape *s, const struct layer *layers,
                       int64_t num_layers, const void *final_norm, const struct step *st,
                       const struct scratch *buf, void *x, void *out)
{
    const int64_t B = st->B, H = s->hidden, D = s->head_dim, Hq = s->heads, Hkv = s->kv_heads;
    const int64_t I = s->intermediate, q_size = Hq * D, kv_size = Hkv * D;
    const int64_t qkv_row = q_size + 2 * kv_size; /* elements between two tokens' q, k or v */
    uint16_t *qkv = buf->qkv;
    const void *delta = NULL;
    int64_t R = B; /* rows from the attention on: K in the last layer */
    for (int64_t l = 0; l < num_layers; l++) {
        const struct layer *ly = &layers[l];
        const int kept_only = l == num_layers - 1 && st->kept_rows;
        TIMED(T_NORM, k->norm(x, delta, ly->input_norm, buf->h, B, H, s->eps));
        TIMED(T_QKV, project(k, ly->qkv, buf->h, qkv, B, qkv_row, H, buf->part));
        TIMED(T_ROTARY, k->rotary(qkv, qkv_row, B, Hq + Hkv, D, st->cos, st->sin));
        /* prompt tokens' K/V first: another part may read the blocks they fill (a request
         * whose cached prefix another request of the step is computing); a decode token's
         * block is its own request's last, which no other part reads, and the decode kernel
         * stores it itself */
        /* their cache lines asked for first, all at once (-DKV_PREFETCH=0: not): one copy
         * after another, each waiting for its lines, took 0.14-0.29 ms of a 16-token decode
         * step on one thread of the AMX Xeon, 0.03-0.14 so (docs/performance.md, session 25) */
        for (int64_t i = 0; i < st->num_parts; i++)
            if (KV_PREFETCH && st->parts[i].prefill)
                for (int64_t r = 0; r < st->parts[i].n; r++) {
                    const int64_t at = st->slots[st->parts[i].start + r] * kv_size * 2;
                    for (int64_t b = 0; b < kv_size * 2; b += 64) {
                        __builtin_prefetch((char *)ly->k_cache + at + b, 1);
                        __builtin_prefetch((char *)ly->v_cache + at + b, 1);
                    }
                }
        for (int64_t i = 0; i < st->num_parts; i++) {
            const struct part *p = &st->parts[i];
            const uint16_t *kn = qkv + p->start * qkv_row + q_size;
            if (p->prefill)
                TIMED(T_STORE, store_new_tokens(kn, qkv_row, kn + kv_size, qkv_row, ly->k_cache,
                                                ly->v_cache, st->slots + p->start, p->n, Hkv, 2,
                                                (int)D));
        }
        /* the prompt chunks (with batch invariance every decode token is one) in one call */
        const int64_t P = st->num_parts;
        const uint16_t *pq[P];
        const int64_t *pb[P];
        int64_t pn[P], pc[P], np = 0;
        uint16_t *po[P];
        for (int64_t i = 0; i < st->num_parts; i++) {
            const struct part *p = &st->parts[i];
            if (kept_only && p->kept < 0)
                continue;
            /* kept only: a prompt chunk's last query alone */
            const int64_t skip = kept_only && p->prefill ? p->n - 1 : 0;
            const uint16_t *q = qkv + (p->start + skip) * qkv_row, *kn = q + q_size,
                           *vn = kn + kv_size;
            uint16_t *a = (uint16_t *)buf->attn + (kept_only ? p->kept : p->start) * q_size;
            if (p->prefill && k->prefill_many) {
                pq[np] = q, pb[np] = p->blocks, pn[np] = p->n - skip, pc[np] = p->max_len;
                po[np++] = a;
            } else if (p->prefill)
                TIMED(T_ATTN, k->prefill(q, qkv_row, ly->k_cache, ly->v_cache, p->blocks,
                                         s->block_size, p->n - skip, p->max_len, Hq, Hkv, D,
                                         s->scale, a, q_size, st->prefill_scratch));
            else
                TIMED(T_ATTN, k->attention(q, qkv_row, kn, qkv_row, vn, qkv_row, ly->k_cache,
                                           ly->v_cache, st->slots + p->start, p->blocks,
                                           p->max_blocks, p->context_lens, p->n, Hq, Hkv,
                                           s->block_size, p->max_len, s->scale, a));
        }
        if (np) /* (after the decode parts: no chunk reads a block a decode token fills) */
            TIMED(T_ATTN, k->prefill_many(np, pq, pb, pn, pc, po, qkv_row, ly->k_cache,
                                          ly->v_cache, s->block_size, Hq, Hkv, D, s->scale,
                                          q_size));
        if (kept_only) { /* x's kept rows (ascending) to its first K */
            R = st->K;
            for (int64_t r = 0; r < R; r++)
                if (st->kept_rows[r] != r)
                    memcpy((uint16_t *)x + r * H, (uint16_t *)x + st->kept_rows[r] * H, 2 * H);
        }
        TIMED(T_O, project(k, ly->o, buf->attn, buf->delta, R, H, q_size, buf->part));
        TIMED(T_NORM, k->norm(x, buf->delta, ly->post_norm, buf->h, R, H, s->eps));
        /* a q4 gate/up: silu_and_mul in the matmul's stores (the same bits) */
        const struct proj *gu = ly->gate_up;
        int64_t fused = 0;
        if (k->q4_silu && gu->num_parts == 1 && gu->parts[0].kind == PART_Q4)
            TIMED(T_GATE_UP, fused = k->q4_silu(buf->h, gu->parts[0].w, buf->act, R, I, H));
        if (!fused) {
            TIMED(T_GATE_UP, project(k, gu, buf->h, buf->gate_up, R, 2 * I, H, buf->part));
            TIMED(T_SILU, k->silu(buf->gate_up, buf->act, R, I));
        }
        TIMED(T_DOWN, project(k, ly->down, buf->act, buf->delta, R, H, I, buf->part));
        delta = buf->delta;
    }
    TIMED(T_NORM, k->norm(x, delta, final_norm, out, R, H, s->eps));
}
