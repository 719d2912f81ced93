/* A whole step of a Llama-family decoder in one call, one OpenMP parallel region: any
 * step the scheduler builds (decodes, prefill chunks, draft verification, any rows).
 *
 * Why: on one stream a step is ~30 layers x ~10 small kernels. Called one by one from
 * Python, each costs a few microseconds of glue (module call, ctypes checks, an output
 * tensor) and opens its own parallel region, whose end parks the team: with the short
 * OpenMP spin fleetserve sets (busy machines), every region pays a futex sleep and wake.
 * Here the pointers that do not change between steps (weights, norms, caches, rotary
 * tables) sit in a plan built once at load; one call runs every layer.
 *
 * Inside the region only the work worth splitting is split: the GEMMs (each thread takes
 * chunks of weight rows through the same share functions the standalone kernels use, so
 * every output is computed by the same code) and attention (one item per sequence, or
 * per (sequence, kv head) when there are fewer sequences than threads). The cheap
 * row-wise work (residual add + RMSNorm, silu * mul, block sums) is done by EVERY thread
 * on its own copy: the residual stream and the next GEMM's input are private, identical
 * in each thread, so no barrier is needed to hand them over. Per layer that leaves five
 * barriers (after qkv, attention, o, gate_up, down) and no region start or end.
 *
 * Per layer, for an all-decode step of m <= decode_step_max_rows() rows (one query
 * token per sequence):
 *   h = rmsnorm(res += x)                            private, every thread
 *   qkv = h @ Wqkv^T                                 split by weight rows     | barrier
 *   per (sequence, kv head): bias, q/k norm, rotary, cache write, attention  | barrier
 *   x = attn @ Wo^T                                  split                    | barrier
 *   h = rmsnorm(res += x); gu = h @ Wgu^T            private; split           | barrier
 *   h = silu(gate) * up; x = h @ Wdown^T             private; split           | barrier
 * and after the last layer, out = rmsnorm(res += x).
 *
 * Gemma 3's layers ("sandwich" norms) add two norms and another activation, each a row
 * function in the same place: the attention's output is normed before it joins the
 * residual (attn_out_norm), the MLP's too (mlp_out_norm, read by the next layer's input
 * norm instead of x), the MLP is gelu_tanh(gate) * up, and its local layers carry their
 * own rotary tables. The embedding scale is applied by the caller (x is scaled).
 *
 * A step with a sequence of several rows (a prefill chunk, a draft under verification)
 * first prepares every row's heads and writes its keys (split by rows | barrier), then
 * attends by (sequence, tile of rows, kv head): a row reads the keys of the rows before
 * it. A step of more rows than the decode-sized shares take ("wide") keeps the residual
 * stream and GEMM inputs shared, splits the row-wise work by rows (a barrier each), and
 * multiplies through the any-rows shares: those are what gemm_packed and quant_gemm run
 * for such row counts, so every row is computed by the module path's code.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, pthread */
#include <omp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fused_rows.h"
#include "lead_share.h"
#include "quant_dot.h"
#include "thread_buffer.h"

/* quant_gemm.c, gemm.c, paged_attention.c */
void quant_gemm_share(int qtype, const float *x, int64_t ldx, const float *xsum,
                      const void *xq, const uint8_t *w, int64_t row_bytes, float *out,
                      int64_t ldo, int64_t m, int64_t n, int64_t k);
void quant_dot_quantize_share(const float *x, int64_t ldx, int64_t m, int64_t k,
                              qdot_xblock *xb);
void quant_prefill_share(int qtype, const float *x, int64_t ldx, const uint8_t *w,
                         int64_t row_bytes, float *xp, float *panel, float *row, float *out,
                         int64_t ldo, int64_t m, int64_t n, int64_t k);
int64_t quant_prefill_x_floats(int64_t k);
int64_t quant_prefill_panel_floats(int64_t k);
int quant_share_max_rows(void);
int quant_panel_layout(int qtype);
void quant_panel_xsum(const float *x, int64_t ldx, int64_t m, int64_t k, float *xsum);
void gemm_packed_share(const float *x, int64_t ldx, float *xp, const float *packed,
                       const float *bias, float *out, int64_t ldo, int64_t m, int64_t n,
                       int64_t k);
void gemm_packed_rows_share(const float *x, int64_t ldx, float *xp, const float *packed,
                            const float *bias, float *out, int64_t ldo, int64_t m, int64_t n,
                            int64_t k);
int64_t gemm_rows_x_floats(int64_t k);
int gemm_share_max_rows(void);
int64_t gemm_x_floats(int64_t m, int64_t k);
int gemm_bf16_share(const float *x, int64_t ldx, const uint16_t *w, const float *bias,
                    float *out, int64_t ldo, int64_t m, int64_t n, int64_t k);
int gemm_bf16_tiled_share(const float *x, int64_t ldx, const uint16_t *wt, const float *bias,
                          float *out, int64_t ldo, int64_t m, int64_t n, int64_t k);
void attend_tile_dispatch(const float *q, int64_t q_stride, const void *k_cache,
                          const void *v_cache, float *out, const int64_t *table,
                          int64_t q_start, int64_t q_len, int64_t seq_len, int64_t r0,
                          int64_t r1, int h0, int h1, int num_heads, int num_kv_heads,
                          int head_dim, int block_size, float scale, int window,
                          float softcap, int kv_bf16, float *scores);

/* The plan: mirrored field for field by kernels/decode_step.py (ctypes). */
enum { W_QUANT = 0, W_PACKED = 1, W_BF16 = 2, W_BF16_TILED = 3 };
enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };
#define MAX_SEGMENTS 3

typedef struct {
    int32_t kind;  /* W_QUANT: GGUF blocks (quant.py), W_PACKED: gemm.c panels, W_BF16:
                    * [n, k] bf16 rows (gemm_bf16.c, any row count), W_BF16_TILED: the
                    * same as AMX B tiles (gemm_bf16_tiled.c) */
    int32_t qtype; /* W_QUANT only */
    const void *data;
    int64_t row_bytes; /* W_QUANT only */
    int64_t n;         /* output features of this segment */
} ds_segment;

/* Output features: the segments side by side. bias: NULL, or [sum of n] (a packed
 * weight adds it in its register tile, quantized ones after the GEMM, as quant.py). */
typedef struct {
    ds_segment seg[MAX_SEGMENTS];
    int32_t num_segments;
    int64_t k;
    const float *bias;
} ds_linear;

typedef struct {
    const float *input_norm, *post_norm, *q_norm, *k_norm; /* q/k_norm NULL: none */
    ds_linear qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* kv_cache_shapes (cpu.py): keys d-major in a block */
    int32_t window;           /* sliding window W (keys p - W + 1 .. p); 0: none */
    /* Gemma 3: norms of the attention's and the MLP's outputs (NULL: none), this layer's
     * rotary tables (NULL: the plan's). */
    const float *attn_out_norm, *mlp_out_norm;
    const float *cos, *sin;
    int32_t kv_bf16; /* the caches hold bf16 (else float32) */
} ds_layer;

typedef struct {
    int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
    const float *cos, *sin; /* [max_position, head_dim / 2] */
    const float *final_norm;
    const ds_layer *layers;
    const void *lora; /* lora.c's lora_step for this step's adapter rows; NULL: none */
    int32_t activation; /* ACT_SILU, ACT_GELU_TANH */
    /* The LM head (or this TP rank's vocab shard of it): num_segments 0 when the caller
     * computes the logits itself. */
    ds_linear head;
    /* Tensor parallelism: sums x[0 .. n) across the ranks in place (the row-parallel o
     * and down projections' partial outputs); NULL: one process. Called by the calling
     * thread (OpenMP's master) while the team waits. */
    void (*reduce)(float *x, int64_t n);
    /* Opt-in timing (NULL: off): wall seconds added up per (thread, phase), threads
     * 0 .. profile_threads - 1, [profile_threads][DS_PHASES]; a phase ending in the
     * team's barrier includes the wait in it. */
    double *profile;
    int32_t profile_threads;
    /* 1: the profile adds up each thread's CPU time (CLOCK_THREAD_CPUTIME_ID), not wall. */
    int32_t profile_cpu;
    /* 1: narrow steps' dot-layout GEMMs hand out work as quant_dot_share does (one ~16 KB
     * chunk per grab) instead of step_dot_share's guided runs: A/B runs. */
    int32_t dot_chunked;
    /* Steps of at least this many rows (0: none) may run as one sub-step per thread over
     * its own sequences (see split_step); the caller sets it only where every weight's
     * rows are multiplied the same whatever the other rows of the call. */
    int32_t split_min_rows;
    /* 1: the caller reads the final hidden states of the sampled rows only (logit_rows;
     * no prompt logprobs, no hidden-state consumer): a wide step runs its last layer's o
     * projection and MLP on those rows alone (see team_step); the other rows of `out` are
     * left unwritten. Set per call, only where rows are multiplied the same whatever the
     * other rows (as split_min_rows). */
    int32_t sampled_only;
    /* Steps of at most LEAD_MAX_SEQS sequences and this many rows (0: none), on exactly
     * 2 threads, run as a lead step: the layers on one thread, helped by the other, the
     * LM head on both (lead_step). */
    int32_t lead_max_rows;
    /* A lead step's projections whose weight rows thread 1 takes a share of (bits: 1 qkv,
     * 2 o, 4 gate_up, 8 down; dot-layout weights only; 0: the layers on thread 0 alone),
     * thread 1's spin after a shared GEMV before it sleeps (microseconds), and where the
     * chunks each thread took are added up ([2] int64; NULL: not counted). */
    int32_t lead_share;
    int32_t lead_spin_us;
    int32_t lead_chunk_bytes; /* weight bytes per chunk grabbed (lead_share.h) */
    int64_t *lead_counts;      /* [4]: lead_share.h's counts */
    /* What thread 1 takes a share of in a lead step of several rows (a verification):
     * bits 0-3 the projections as lead_share's, LEAD_HEADS each row's heads (rotary,
     * cache writes), LEAD_ATTENTION the attention items; 0: lead_share's, as a one-row
     * step. */
    int32_t lead_multi;
} ds_plan;

enum { LEAD_HEADS = 16, LEAD_ATTENTION = 32 };

/* The phases timed (kernels/decode_step.py's PHASES, in order): row work (norms, the
 * activation, GEMM inputs' block sums / int8 blocks), each projection, attention (with
 * the heads' bias, norms, rotary and cache writes), the final norm and LM head, argmax. */
enum { PH_ROWS, PH_QKV, PH_ATTN, PH_O, PH_GATE_UP, PH_DOWN, PH_HEAD, PH_ARGMAX, DS_PHASES };
static double profile_clock(int cpu) {
    if (!cpu) return omp_get_wtime();
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
#define MARK(ph)                                                                        \
    do {                                                                                \
        if (prof) {                                                                     \
            const double t_ = profile_clock(p->profile_cpu);                            \
            prof[ph] += t_ - t_last;                                                    \
            t_last = t_;                                                                \
        }                                                                               \
    } while (0)

int decode_step_phases(void) { return DS_PHASES; }

/* The step's rows: m tokens of num_seqs sequences laid out back to back (the runner's
 * flattened batch), sequence i owning rows q_starts[i] .. q_starts[i] + q_lens[i]. */
typedef struct {
    int64_t m, num_seqs, max_blocks;
    const int64_t *positions, *slot_blocks, *slot_offsets; /* [m] */
    const int64_t *q_starts, *q_lens, *seq_lens;           /* [num_seqs] */
    const int64_t *tables;                                 /* [num_seqs, max_blocks] */
} ds_rows;

/* A thread's GEMM scratch: xp its private x tiles, xsum the GEMM input's block sums
 * (narrow steps); xp_wide the team's shared tiles, panel and row its own decoded weights
 * (wide steps); xq the GEMM input's int8 blocks, private when narrow, shared when wide
 * (NULL when no weight is in the dot layout). */
typedef struct {
    float *xp, *xp_wide, *panel, *row, *xsum;
    qdot_xblock *xq;
    int dot_chunked;  /* the plan's dot_chunked */
    int xsum_wanted;  /* some weight of the plan is in the panel layout (reads xsum) */
} ds_scratch;

/* Row-wise work over the step's m rows: split over the team (`wide`, ending in its
 * barrier) or done whole by every thread on its own copy. */
#define FOR_ROWS(wide, r, m, ...)                                                       \
    do {                                                                                \
        if (wide) {                                                                     \
            _Pragma("omp for schedule(static)") for (int64_t r = 0; r < (m); r++) {     \
                __VA_ARGS__;                                                            \
            }                                                                           \
        } else {                                                                        \
            for (int64_t r = 0; r < (m); r++) {                                         \
                __VA_ARGS__;                                                            \
            }                                                                           \
        }                                                                               \
    } while (0)

/* FOR_ROWS whose output rows only prepare_x reads next. Wide with int8 blocks (`own`:
 * the scratch has xq), quant_dot_quantize_share splits the same m rows with the same
 * static schedule, which OpenMP assigns to the same threads in one region: a thread
 * quantizes exactly the rows it wrote, so the barrier in between is dropped (three a
 * layer in wide steps). Otherwise as FOR_ROWS. */
#define FOR_ROWS_TO_X(wide, own, r, m, ...)                                             \
    do {                                                                                \
        if ((wide) && (own)) {                                                          \
            _Pragma("omp for schedule(static) nowait") for (int64_t r = 0; r < (m); r++) { \
                __VA_ARGS__;                                                            \
            }                                                                           \
        } else {                                                                        \
            FOR_ROWS(wide, r, m, __VA_ARGS__);                                          \
        }                                                                               \
    } while (0)

/* Steps of up to this many rows run the decode-sized GEMMs (the quantized kernels switch
 * to their prefill path past it, and the module path with them). */
int decode_step_max_rows(void) {
    const int q = quant_share_max_rows(), g = gemm_share_max_rows();
    return q < g ? q : g;
}

/* Rows per panel of the dot layout (quant_dot.c's PR). */
#define DOT_PANEL_ROWS 16

/* This thread's share of a dot-layout GEMM in a narrow step: quant_dot_share's panels,
 * each multiplied by the same code (quant_dot_panels: every output row the same bits
 * whichever thread computes it), handed out by OpenMP's guided schedule over the same
 * ~16 KB chunks: each thread first takes a long run of consecutive panels (one weight
 * stream, one grab of the shared counter), then ever smaller ones, so a thread slowed by
 * a neighbour still leaves its tail to the others. quant_dot_share hands out one chunk
 * per grab: at 2 threads each reads every other 16 KB of the weight (its stream restarts
 * each time) and the team's counter (one cache line) bounces between the cores ~6,000
 * times a token on SmolLM2. `chunked`: quant_dot_share itself (the plan's A/B switch).
 * Ends in the team's barrier. */
static void step_dot_share(int fmt, const qdot_xblock *xb, const uint8_t *w, int64_t row_bytes,
                           float *out, int64_t ldo, int64_t m, int64_t n, int64_t k,
                           int chunked) {
    if (chunked) {
        quant_dot_share(fmt, xb, w, row_bytes, out, ldo, m, n, k);
        return;
    }
    const int64_t nb = k / 32, panels = (n + DOT_PANEL_ROWS - 1) / DOT_PANEL_ROWS;
    int64_t chunk = 16384 / (DOT_PANEL_ROWS * row_bytes);
    if (chunk < 1) chunk = 1;
    const int64_t chunks = (panels + chunk - 1) / chunk;
    int64_t run0 = -1, run1 = -1; /* consecutive chunks [run0, run1) not yet multiplied */
#pragma omp for schedule(guided, 1) nowait
    for (int64_t c = 0; c < chunks; c++) {
        if (c != run1) {
            if (run1 > run0)
                quant_dot_panels(fmt, xb, m, nb, w, row_bytes, out, ldo, n, run0 * chunk,
                                 run1 * chunk < panels ? run1 * chunk : panels);
            run0 = c;
        }
        run1 = c + 1;
    }
    if (run1 > run0)
        quant_dot_panels(fmt, xb, m, nb, w, row_bytes, out, ldo, n, run0 * chunk,
                         run1 * chunk < panels ? run1 * chunk : panels);
#pragma omp barrier
}

/* This thread's share of out[m, n] = x @ W^T (+ bias for packed weights): the one place
 * that dispatches on the weight kind. `wide` (m > decode_step_max_rows()): the kernels'
 * any-rows shares, which the module path's kernels run for such m too; else the
 * decode-sized ones, reading what prepare_x left in the scratch. Ends in the team's
 * barrier. */
static void linear_share(const ds_linear *lin, const float *x, int64_t ldx, const ds_scratch *s,
                         float *out, int64_t ldo, int64_t m, int wide) {
    int64_t off = 0;
    for (int i = 0; i < lin->num_segments; i++) {
        const ds_segment *g = &lin->seg[i];
        const float *bias = lin->bias ? lin->bias + off : NULL;
        switch (g->kind) {
        case W_PACKED:
            if (wide)
                gemm_packed_rows_share(x, ldx, s->xp_wide, g->data, bias, out + off, ldo, m,
                                       g->n, lin->k);
            else
                gemm_packed_share(x, ldx, s->xp, g->data, bias, out + off, ldo, m, g->n,
                                  lin->k);
            break;
        case W_BF16: /* as the module path's gemm_bf16, for every row count */
            gemm_bf16_share(x, ldx, g->data, bias, out + off, ldo, m, g->n, lin->k);
            break;
        case W_BF16_TILED:
            gemm_bf16_tiled_share(x, ldx, g->data, bias, out + off, ldo, m, g->n, lin->k);
            break;
        case W_QUANT:
            /* The dot layout multiplies every row count in integers (as quant_gemm). */
            if (wide && !quant_dot_layout(g->qtype))
                quant_prefill_share(g->qtype, x, ldx, g->data, g->row_bytes, s->xp_wide,
                                    s->panel, s->row, out + off, ldo, m, g->n, lin->k);
            else if (!wide && quant_dot_layout(g->qtype))
                step_dot_share(g->qtype, s->xq, g->data, g->row_bytes, out + off, ldo, m,
                               g->n, lin->k, s->dot_chunked);
            else
                quant_gemm_share(g->qtype, x, ldx, s->xsum, s->xq, g->data, g->row_bytes,
                                 out + off, ldo, m, g->n, lin->k);
            break;
        }
        off += g->n;
    }
}

/* Whether a weight of this kind multiplies each row of x the same whatever the call's
 * other rows (its row count included): bf16 rows or tiles (one chain per row at every
 * row count, gemm_bf16*.c) and the dot layout (integer block sums, each row's blocks in
 * order, quant_dot.c). Such weights may run split steps (split_step). */
int decode_step_rows_independent(int kind, int qtype) {
    return kind == W_BF16 || kind == W_BF16_TILED || (kind == W_QUANT && quant_dot_layout(qtype));
}

static int linear_rows_independent(const ds_linear *lin) {
    for (int j = 0; j < lin->num_segments; j++)
        if (!decode_step_rows_independent(lin->seg[j].kind, lin->seg[j].qtype)) return 0;
    return 1;
}

/* Whether every weight of the plan (the head's too) multiplies a row the same whatever
 * the call's other rows: then a step of more rows than the decode-sized shares take may
 * still run narrow (a lead step's team of one) with the wide step's bits. */
static int plan_rows_independent(const ds_plan *p) {
    for (int l = 0; l < p->num_layers; l++) {
        const ds_layer *L = &p->layers[l];
        if (!linear_rows_independent(&L->qkv) || !linear_rows_independent(&L->o) ||
            !linear_rows_independent(&L->gate_up) || !linear_rows_independent(&L->down))
            return 0;
    }
    return linear_rows_independent(&p->head);
}

static int linear_has_dot(const ds_linear *lin) {
    for (int j = 0; j < lin->num_segments; j++)
        if (lin->seg[j].kind == W_QUANT && quant_dot_layout(lin->seg[j].qtype)) return 1;
    return 0;
}

static int linear_has_panel(const ds_linear *lin) {
    for (int j = 0; j < lin->num_segments; j++)
        if (lin->seg[j].kind == W_QUANT && quant_panel_layout(lin->seg[j].qtype)) return 1;
    return 0;
}

/* Whether some weight of the plan is in the panel layout (reads the GEMM input's block
 * sums). */
static int plan_has_panel(const ds_plan *p) {
    for (int l = 0; l < p->num_layers; l++) {
        const ds_layer *L = &p->layers[l];
        if (linear_has_panel(&L->qkv) || linear_has_panel(&L->o) ||
            linear_has_panel(&L->gate_up) || linear_has_panel(&L->down))
            return 1;
    }
    return linear_has_panel(&p->head);
}

/* Whether some weight of the plan is in the dot layout (int8 activations). */
static int plan_has_dot(const ds_plan *p) {
    for (int l = 0; l < p->num_layers; l++) {
        const ds_layer *L = &p->layers[l];
        if (linear_has_dot(&L->qkv) || linear_has_dot(&L->o) || linear_has_dot(&L->gate_up) ||
            linear_has_dot(&L->down))
            return 1;
    }
    return linear_has_dot(&p->head);
}

static int64_t linear_out(const ds_linear *lin) {
    int64_t n = 0;
    for (int i = 0; i < lin->num_segments; i++) n += lin->seg[i].n;
    return n;
}

/* The GEMM input x (m rows of k) prepared for the next linear_share: when narrow, by
 * this thread for its own use (the block sums and, when some weight wants them, the int8
 * blocks); when wide, the int8 blocks by the team, split by rows (ending in its barrier),
 * when some weight wants them. */
static void prepare_x(const float *x, int64_t m, int64_t k, const ds_scratch *s, int wide) {
    if (!wide) {
        /* quant_prepare_x's two halves: the block sums only where a panel reads them (a
         * scalar loop of ~3,300 adds a layer on SmolLM2, which dot-layout weights never
         * read). */
        if (s->xsum_wanted) quant_panel_xsum(x, k, m, k, s->xsum);
        if (s->xq) quant_dot_quantize_x(x, k, m, k, s->xq);
    } else if (s->xq)
        quant_dot_quantize_share(x, k, m, k, s->xq);
}

/* lora.c: a step's LoRA deltas around projection `proj` (0 qkv, 1 o, 2 gate_up, 3 down)
 * of a layer: the shrink before its GEMM share (no barrier), the expand after (barrier). */
void lora_step_shrink(const void *step, int layer, int proj, const float *x, int64_t ldx,
                      int64_t in_dim);
void lora_step_expand(const void *step, int layer, int proj, float *y, int64_t ldy,
                      int64_t out_dim);

/* linear_share plus the LoRA delta of the step's adapter rows, if any. */
static void projection_share(const ds_plan *p, int l, int proj, const ds_linear *lin,
                             const float *x, int64_t ldx, const ds_scratch *s, float *out,
                             int64_t ldo, int64_t m, int wide) {
    if (p->lora) lora_step_shrink(p->lora, l, proj, x, ldx, lin->k);
    linear_share(lin, x, ldx, s, out, ldo, m, wide);
    if (p->lora) lora_step_expand(p->lora, l, proj, out, ldo, linear_out(lin));
}

/* Tensor parallelism: the shared partial output x [n] summed across the ranks (by the
 * calling thread, the team waiting) before anyone reads it. */
static void reduce_shared(const ds_plan *p, float *x, int64_t n) {
    if (!p->reduce) return;
#pragma omp master
    p->reduce(x, n);
#pragma omp barrier
}

/* The step's output row: the final norm of res += x into o (o may be res), or, on a
 * pipeline stage before the last (no final norm), the residual stream res + x itself. */
static void final_row(const ds_plan *p, const float *x, float *res, float *o) {
    const int64_t H = p->hidden;
    if (p->final_norm) {
        rms_row(x, res, o, p->final_norm, H, p->eps);
        return;
    }
    for (int64_t i = 0; i < H; i++) res[i] += x[i];
    if (o != res) memcpy(o, res, (size_t)H * sizeof(float));
}

/* The LM head over the sampled rows: logits[j] = normed[rows[j]] @ Whead^T, j < nr, the
 * vocab split over the team by the GEMM shares. hb: nr rows of the head's input (shared
 * when `wide`, else this thread's own, with the narrow scratch s). */
static void head_share(const ds_plan *p, const float *normed, int64_t nr, const int64_t *rows,
                       float *hb, const ds_scratch *s, float *logits, int wide) {
    const int64_t H = p->hidden;
    FOR_ROWS(wide, j, nr, memcpy(hb + j * H, normed + rows[j] * H, (size_t)H * sizeof(float)));
    prepare_x(hb, nr, H, s, wide);
    linear_share(&p->head, hb, H, s, logits, linear_out(&p->head), nr, wide);
}

/* Greedy sampling fused at the end of the step: this thread's span of each head row's
 * logits (the vocab split evenly over the team, spans in thread order) scanned for its
 * argmax, into the row's slots of the spans' results (merged by the caller). */
static void head_argmax_span(const float *logits, int64_t nr, int64_t vocab, int stride,
                             float *best, int64_t *idx, int *nan) {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t v0 = vocab * t / nt, v1 = vocab * (t + 1) / nt;
    for (int64_t j = 0; j < nr; j++) {
        const int64_t s = j * stride + t; /* slots past the team's size stay empty */
        if (v1 > v0) {
            nan[s] = span_argmax(logits + j * vocab + v0, v1 - v0, &best[s], &idx[s]);
            idx[s] += v0;
        }
    }
}

/* projection_share, or on a lead step's thread 0 (lead) a GEMV whose weight rows thread
 * 1 may take a share of (lead_gemv): where the plan shares projection `proj`, the step is
 * narrow and every segment is in the dot layout (no packed weight's bias). */
static int lead_linear(ds_lead *lead, const ds_linear *lin, const ds_scratch *s, float *out,
                       int64_t ldo, int64_t m) {
    int shared = s->xq && lin->num_segments <= LEAD_MAX_SEGMENTS;
    for (int j = 0; shared && j < lin->num_segments; j++)
        shared = lin->seg[j].kind == W_QUANT && quant_dot_layout(lin->seg[j].qtype);
    if (!shared) return 0;
    int fmts[LEAD_MAX_SEGMENTS];
    const uint8_t *ws[LEAD_MAX_SEGMENTS];
    int64_t row_bytes[LEAD_MAX_SEGMENTS], ns[LEAD_MAX_SEGMENTS];
    for (int j = 0; j < lin->num_segments; j++) {
        fmts[j] = lin->seg[j].qtype;
        ws[j] = lin->seg[j].data;
        row_bytes[j] = lin->seg[j].row_bytes;
        ns[j] = lin->seg[j].n;
    }
    lead_gemv(lead, s->xq, m, lin->k, lin->num_segments, fmts, ws, row_bytes, ns, out, ldo);
    return 1;
}

/* What a lead step of m rows shares with thread 1: ds_plan's lead_multi bits when m > 1
 * and it is not empty, else lead_share's. */
static int lead_bits(const ds_plan *p, int64_t m) {
    return m > 1 && p->lead_multi ? p->lead_multi : p->lead_share;
}

static void step_projection(const ds_plan *p, ds_lead *lead, int l, int proj,
                            const ds_linear *lin, const float *x, int64_t ldx,
                            const ds_scratch *s, float *out, int64_t ldo, int64_t m, int wide) {
    if (lead && !wide && (lead_bits(p, m) >> proj & 1) && lead_linear(lead, lin, s, out, ldo, m))
        return;
    projection_share(p, l, proj, lin, x, ldx, s, out, ldo, m, wide);
}

static int quant_bias(const ds_linear *lin) {
    return lin->bias && lin->num_segments > 0 && lin->seg[0].kind == W_QUANT;
}

/* Row t's query heads of kv heads [h0, h1) and its keys and values of those heads: bias
 * (quantized qkv), q/k norm, rotary, cache write. */
static void prepare_heads(const ds_plan *p, const ds_layer *L, float *qkv, int64_t ldq,
                          const ds_rows *rw, int64_t t, int h0, int h1) {
    const int hd = p->head_dim, group = p->num_heads / p->num_kv_heads;
    const int64_t q_size = (int64_t)p->num_heads * hd, kv_size = (int64_t)p->num_kv_heads * hd;
    float *row = qkv + t * ldq;
    const int64_t pos = rw->positions[t];
    const float *cos_t = L->cos ? L->cos : p->cos, *sin_t = L->sin ? L->sin : p->sin;
    const float *c = cos_t + pos * (hd / 2), *s = sin_t + pos * (hd / 2);
    for (int h = h0; h < h1; h++) {
        float *q = row + (int64_t)h * group * hd, *k = row + q_size + (int64_t)h * hd;
        float *v = k + kv_size;
        if (quant_bias(&L->qkv)) {
            const float *b = L->qkv.bias;
            for (int64_t j = 0; j < group * hd; j++) q[j] += b[h * group * hd + j];
            for (int j = 0; j < hd; j++) k[j] += b[q_size + h * hd + j];
            for (int j = 0; j < hd; j++) v[j] += b[q_size + kv_size + h * hd + j];
        }
        if (L->q_norm) {
            for (int g = 0; g < group; g++)
                rms_row(q + g * hd, NULL, q + g * hd, L->q_norm, hd, p->eps);
            rms_row(k, NULL, k, L->k_norm, hd, p->eps);
        }
        rotate_row(q, group, hd, c, s);
        rotate_row(k, 1, hd, c, s);
        cache_write_head(k, v, L->k_cache, L->v_cache, rw->slot_blocks[t], rw->slot_offsets[t],
                         h, p->num_kv_heads, hd, p->block_size, L->kv_bf16);
    }
}

/* Rows [r0, r1) of sequence i for the query heads of kv heads [h0, h1), into attn. */
static void attend_rows(const ds_plan *p, const ds_layer *L, const float *qkv, int64_t ldq,
                        float *attn, const ds_rows *rw, int64_t i, int64_t r0, int64_t r1,
                        int h0, int h1, float *scores) {
    attend_tile_dispatch(qkv, ldq, L->k_cache, L->v_cache, attn, rw->tables + i * rw->max_blocks,
                         rw->q_starts[i], rw->q_lens[i], rw->seq_lens[i], r0, r1, h0, h1,
                         p->num_heads, p->num_kv_heads, p->head_dim, p->block_size, p->scale,
                         L->window, 0.f, L->kv_bf16, scores);
}

/* Query rows per attention item of a multi-row sequence (as paged_attention.c). */
#define Q_TILE 16

/* Rows per item of a q-row sequence: Q_TILE, or for a verification-sized query (up to
 * Q_TILE rows: paged_attention.c's VERIFY_ROWS) cut into `parts` row ranges. Each range
 * walks the blocks once (paged_verify.h) and a row's sums do not depend on its range. */
static int64_t rows_per_item(int64_t q, int parts) {
    return parts > 1 && q <= Q_TILE ? (q + parts - 1) / parts : Q_TILE;
}

/* Row ranges per verification query in a step of fewer sequences than threads: enough
 * that its (range, kv head) items share out evenly (3 kv heads on 2 threads: 2 ranges,
 * 6 items, where 3 items left one thread idle for a third of the phase). */
static int verify_parts(int threads, int num_kv_heads) {
    int a = threads, b = num_kv_heads;
    while (b) {
        const int t = a % b;
        a = b, b = t;
    }
    return threads / a;
}

/* Attention work items: item_start[i] .. item_start[i + 1] are sequence i's. A one-row
 * sequence is one item over `split` kv-head ranges' worth (split 1: all heads); a longer
 * one is one item per (range of rows_per_item rows, kv head). */
static int64_t attention_items(const ds_rows *rw, int split, int parts, int num_kv_heads,
                               int64_t *item_start) {
    item_start[0] = 0;
    for (int64_t i = 0; i < rw->num_seqs; i++) {
        const int64_t q = rw->q_lens[i], tile = rows_per_item(q, parts);
        item_start[i + 1] =
            item_start[i] + (q == 1 ? split : (q + tile - 1) / tile * num_kv_heads);
    }
    return item_start[rw->num_seqs];
}

/* One attention item: which sequence (walked forward from *seq, items arriving in
 * increasing order within a thread), rows and kv heads. With `prepare` (every sequence
 * one row) the row's heads are prepared first: no other item reads them. */
static void attention_item(const ds_plan *p, const ds_layer *L, float *qkv, int64_t ldq,
                           float *attn, const ds_rows *rw, const int64_t *item_start,
                           int64_t item, int64_t *seq, int split, int parts, int prepare,
                           float *scores) {
    if (item < item_start[*seq]) *seq = 0;
    while (item >= item_start[*seq + 1]) (*seq)++;
    const int64_t i = *seq, local = item - item_start[i];
    int64_t r0 = 0, r1 = 1;
    int h0 = 0, h1 = p->num_kv_heads;
    if (rw->q_lens[i] != 1) {
        const int64_t tile = rows_per_item(rw->q_lens[i], parts);
        h0 = (int)(local % p->num_kv_heads);
        h1 = h0 + 1;
        r0 = local / p->num_kv_heads * tile;
        r1 = r0 + tile < rw->q_lens[i] ? r0 + tile : rw->q_lens[i];
    } else if (split > 1) {
        h0 = (int)local;
        h1 = h0 + 1;
    }
    if (prepare) prepare_heads(p, L, qkv, ldq, rw, rw->q_starts[i], h0, h1);
    attend_rows(p, L, qkv, ldq, attn, rw, i, r0, r1, h0, h1, scores);
}

/* A lead step's items jobs over one layer's rows (lead_items): each row's heads, or the
 * attention items; scores: each thread's own. */
typedef struct {
    const ds_plan *p;
    const ds_layer *L;
    float *qkv, *attn;
    int64_t ldq;
    const ds_rows *rw;
    const int64_t *item_start;
    int split, parts, prepare;
    float *scores[2];
} lead_attention;

static void lead_heads_item(void *ctx, int64_t t, int tid) {
    const lead_attention *a = ctx;
    (void)tid;
    prepare_heads(a->p, a->L, a->qkv, a->ldq, a->rw, t, 0, a->p->num_kv_heads);
}

static void lead_attention_item(void *ctx, int64_t item, int tid) {
    const lead_attention *a = ctx;
    int64_t seq = 0;
    attention_item(a->p, a->L, a->qkv, a->ldq, a->attn, a->rw, a->item_start, item, &seq,
                   a->split, a->parts, a->prepare, a->scores[tid]);
}

static int64_t max3(int64_t a, int64_t b, int64_t c) {
    const int64_t ab = a > b ? a : b;
    return ab > c ? ab : c;
}

static size_t up64(size_t floats) { return (floats + 15) / 16 * 16; }

/* The step's buffers (64-byte aligned), kept by the calling thread from one step to the
 * next and grown when a step needs more: a prefill chunk of 1024 rows needs ~40 MB, past
 * glibc's largest mmap threshold (32 MB), so a buffer of its own per step was a fresh
 * mapping each time, ~9,600 page faults (and as many zeroed pages) a step. Per calling
 * thread: two threads may run steps of their own at once (ctypes lets go of the GIL). */
static float *step_buffer(size_t floats) {
    static _Thread_local void *buf = NULL;
    static _Thread_local size_t cap = 0;
    return thread_buffer(&buf, &cap, up64(floats) * sizeof(float));
}

/* x: [m, hidden] the step's embeddings (read only); out: [m, hidden] the final norm's
 * output (no final norm: the residual stream). positions, slot_blocks, slot_offsets [m] int64; q_starts, q_lens, seq_lens
 * [num_seqs] int64 (seq_lens: tokens in the cache after this step's writes); tables
 * [num_seqs, max_blocks] int64. w_slot_blocks, w_slot_offsets, w_tables (w_max_blocks
 * wide): the same for the sliding-window layers' own pool (a model with local and
 * global layers), or NULL: windowed layers use the ones above. logit_rows [nr] int64
 * (distinct rows of the step, nr <= m): with the plan's head, logits [nr, vocab] gets the
 * head's output for those rows (nr 0: none), and argmax [nr] int64 (NULL: not wanted)
 * each of those rows' argmax (numpy's: the first maximum, or the first NaN), scanned by
 * the team before the region ends. lead: a lead step's thread 0 (team of one) shares the
 * plan's lead_share projections with thread 1 through it and wakes that thread at the
 * last layer's start (NULL: not a lead step). Returns 0; -1:
 * out of memory; -2: no rows (decode_step: 1 when the step ran split by sequences, 2 as
 * a lead step). */
static int team_step(const ds_plan *p, const float *x, float *out, int64_t m,
                     const int64_t *positions, const int64_t *slot_blocks,
                     const int64_t *slot_offsets, int64_t num_seqs, const int64_t *q_starts,
                     const int64_t *q_lens, const int64_t *seq_lens, const int64_t *tables,
                     int64_t max_blocks, const int64_t *w_slot_blocks,
                     const int64_t *w_slot_offsets, const int64_t *w_tables,
                     int64_t w_max_blocks, int64_t nr, const int64_t *logit_rows,
                     float *logits, int64_t *argmax, int threads, ds_lead *lead) {
    if (m < 1 || num_seqs < 1) return -2;
    if (p->head.num_segments == 0) nr = 0;
    const ds_rows rw = {m,       num_seqs, max_blocks, positions, slot_blocks, slot_offsets,
                        q_starts, q_lens,  seq_lens,   tables};
    const ds_rows rw_window = {m,        num_seqs, w_max_blocks, positions, w_slot_blocks,
                               w_slot_offsets, q_starts, q_lens, seq_lens, w_tables};
    const int64_t H = p->hidden, I = p->intermediate, hd = p->head_dim;
    const int64_t q_size = p->num_heads * hd, ldq = q_size + 2 * p->num_kv_heads * hd;
    const int64_t kmax = max3(H, I, q_size);
    /* A lead step's layers run narrow at any row count it takes (lead_step). */
    const int wide = m > decode_step_max_rows() && !lead;
    const int dot = plan_has_dot(p), panel = plan_has_panel(p);
    /* The head's rows multiplied as the module path would multiply them: a wide step's
     * few sampled rows through the decode-sized shares, from a private narrow scratch. */
    const int head_wide = nr > decode_step_max_rows(), head_own = wide && nr > 0 && !head_wide;
    /* A prefill chunk's rows other than its last feed nothing past the last layer's keys
     * and values: with the caller's leave (p->sampled_only), the last layer's o projection,
     * norms and MLP run on the sampled rows alone, gathered to the front after its
     * attention (~6% of a 1,024-row chunk's GEMMs for a 12-layer model). Each row's sums are
     * those of the full step: the plan's weights multiply a row the same whatever the
     * call's other rows (the caller's condition), the row-wise work is per row. A split
     * step's group with no sampled row stops after the last layer's attention. */
    int prune = p->sampled_only && p->head.num_segments > 0 && wide && nr < m && !p->lora &&
                !p->reduce;
    for (int64_t j = 1; prune && j < nr; j++) prune = logit_rows[j] > logit_rows[j - 1];
    int64_t max_len = 1;
    int all_decode = 1;
    for (int64_t i = 0; i < num_seqs; i++) {
        max_len = seq_lens[i] > max_len ? seq_lens[i] : max_len;
        all_decode &= q_lens[i] == 1;
    }
    if (threads < 1) threads = 1;
    /* Few one-row sequences: an item per (sequence, kv head) keeps every thread busy. */
    const int split = all_decode && num_seqs < threads ? p->num_kv_heads : 1;
    /* Few sequences with several rows (speculative verification): row ranges too. A lead
     * step sharing its attention items with thread 1 cuts them as a team of 2 would. */
    const int lead_attn = lead && !wide && m > 1 && (lead_bits(p, m) & LEAD_ATTENTION);
    const int lead_heads = lead && !wide && !all_decode && (lead_bits(p, m) & LEAD_HEADS);
    const int item_threads = lead_attn ? 2 : threads;
    const int parts = !all_decode && num_seqs < item_threads
                          ? verify_parts(item_threads, p->num_kv_heads)
                          : 1;
    /* item_start, then (argmax) each head row's per-thread span results */
    const int64_t spans = argmax && nr > 0 ? nr * threads : 0;
    int64_t *item_start = malloc(sizeof(int64_t) * (size_t)(num_seqs + 1 + 2 * spans) +
                                 sizeof(int) * (size_t)spans);
    if (!item_start) return -1;
    int64_t *span_idx = item_start + num_seqs + 1;
    float *span_best = (float *)(span_idx + spans);
    int *span_nan = (int *)(span_idx + 2 * spans);
    for (int64_t s = 0; s < spans; s++) span_idx[s] = -1;
    const int64_t items = attention_items(&rw, split, parts, p->num_kv_heads, item_start);
    /* Shared: qkv, attn, x (o and down outputs), gate_up; when wide also the residual,
     * the GEMM input and the x tiles. Private per thread: when narrow the residual, GEMM
     * input, block sums and x tiles; when wide a decoded panel and row; the scores. */
    const int64_t xp_wide = gemm_rows_x_floats(kmax) > quant_prefill_x_floats(kmax)
                                ? gemm_rows_x_floats(kmax)
                                : quant_prefill_x_floats(kmax);
    const size_t rows_hx = up64(m * H) + up64(m * kmax);
    const size_t xq_floats =
        dot ? up64((m * (kmax / 32) * sizeof(qdot_xblock) + sizeof(float) - 1) / sizeof(float))
            : 0;
    const size_t shared = up64(m * ldq) + up64(m * q_size) + up64(m * H) + up64(m * 2 * I) +
                          (wide ? rows_hx + up64(xp_wide) + xq_floats : 0);
    const size_t head_xq =
        dot ? up64((nr * (H / 32) * sizeof(qdot_xblock) + sizeof(float) - 1) / sizeof(float))
            : 0;
    const size_t head_priv = head_own ? up64(nr * H) + up64(nr * (H / 32) + 1) +
                                            up64(gemm_x_floats(nr, H)) + head_xq
                                      : 0;
    const size_t priv = (wide ? up64(quant_prefill_panel_floats(kmax)) + up64(kmax)
                              : rows_hx + up64(m * (kmax / 32) + 1) +
                                    up64(gemm_x_floats(m, kmax)) + xq_floats) +
                        up64(p->num_heads * max_len) + head_priv;
    /* thread 1's attention scores in a lead step sharing its attention items */
    const size_t helper = lead_attn ? up64(p->num_heads * max_len) : 0;
    float *buf = step_buffer(shared + (size_t)threads * priv + helper);
    if (!buf) {
        free(item_start);
        return -1;
    }
    float *helper_scores = buf + shared + (size_t)threads * priv;
    float *qkv = buf, *attn = qkv + up64(m * ldq), *xs = attn + up64(m * q_size);
    float *gu = xs + up64(m * H), *wide_res = gu + up64(m * 2 * I);
#pragma omp parallel num_threads(threads)
    {
        float *mine = buf + shared + (size_t)omp_get_thread_num() * priv;
        float *res, *h, *scores;
        ds_scratch sc = {NULL, NULL, NULL, NULL, NULL, NULL, p->dot_chunked, panel};
        if (wide) {
            res = wide_res;
            h = res + up64(m * H);
            sc.xp_wide = h + up64(m * kmax);
            if (dot) sc.xq = (qdot_xblock *)(sc.xp_wide + up64(xp_wide));
            sc.panel = mine;
            sc.row = sc.panel + up64(quant_prefill_panel_floats(kmax));
            scores = sc.row + up64(kmax);
        } else {
            res = mine;
            h = res + up64(m * H);
            sc.xsum = h + up64(m * kmax);
            sc.xp = sc.xsum + up64(m * (kmax / 32) + 1);
            scores = sc.xp + up64(gemm_x_floats(m, kmax));
            if (dot) {
                sc.xq = (qdot_xblock *)scores;
                scores += xq_floats;
            }
        }
        const int tid = omp_get_thread_num();
        double *prof = p->profile && tid < p->profile_threads ? p->profile + tid * DS_PHASES
                                                              : NULL;
        double t_last = prof ? profile_clock(p->profile_cpu) : 0.0;
        FOR_ROWS(wide, r, m, memcpy(res + r * H, x + r * H, (size_t)H * sizeof(float)));
        /* What the last layer added to the residual stream: its down projection's output,
         * or (Gemma) that output normed into h. */
        float *added = xs;
        int64_t mr = m; /* the rows still carried: m, or nr once pruned */
        for (int l = 0; l < p->num_layers; l++) {
            const ds_layer *L = &p->layers[l];
            const ds_rows *lr = L->window > 0 && w_tables ? &rw_window : &rw;
            if (lead && l == p->num_layers - 1) lead_head_soon(lead);
            FOR_ROWS_TO_X(wide, sc.xq != NULL, r, mr,
                          rms_row(l ? added + r * H : res + r * H, l ? res + r * H : NULL,
                                  h + r * H, L->input_norm, H, p->eps));
            prepare_x(h, mr, H, &sc, wide);
            MARK(PH_ROWS);
            step_projection(p, lead, l, 0, &L->qkv, h, H, &sc, qkv, ldq, m, wide);
            MARK(PH_QKV);
            lead_attention la = {p,     L,         qkv,        attn, ldq, lr, item_start,
                                 split, parts, all_decode, {scores, helper_scores}};
            if (!all_decode) {
                /* A sequence's rows read each other's keys: all are written first. */
                if (lead_heads) {
                    lead_items(lead, m, lead_heads_item, &la);
                } else {
#pragma omp for schedule(static)
                    for (int64_t t = 0; t < m; t++)
                        prepare_heads(p, L, qkv, ldq, lr, t, 0, p->num_kv_heads);
                }
            }
            if (lead_attn) {
                lead_items(lead, items, lead_attention_item, &la);
            } else {
                int64_t seq = 0;
#pragma omp for schedule(dynamic, 1)
                for (int64_t it = 0; it < items; it++)
                    attention_item(p, L, qkv, ldq, attn, lr, item_start, it, &seq, split, parts,
                                   all_decode, scores);
            }
            if (prune && l == p->num_layers - 1) {
                /* rows logit_rows[j] -> j (ascending: a row is read before it is written) */
#pragma omp single
                for (int64_t j = 0; j < nr; j++) {
                    const int64_t r = logit_rows[j];
                    if (r == j) continue;
                    memcpy(attn + j * q_size, attn + r * q_size, sizeof(float) * (size_t)q_size);
                    memcpy(res + j * H, res + r * H, sizeof(float) * (size_t)H);
                }
                mr = nr;
            }
            MARK(PH_ATTN);
            if (mr == 0) break; /* every thread alike: no row left to carry */
            prepare_x(attn, mr, q_size, &sc, wide);
            MARK(PH_ROWS);
            step_projection(p, lead, l, 1, &L->o, attn, q_size, &sc, xs, H, mr, wide);
            reduce_shared(p, xs, mr * H);
            MARK(PH_O);
            if (L->attn_out_norm)
                FOR_ROWS_TO_X(
                    wide, sc.xq != NULL, r, mr,
                    rms_row(xs + r * H, NULL, h + r * H, L->attn_out_norm, H, p->eps);
                    rms_row(h + r * H, res + r * H, h + r * H, L->post_norm, H, p->eps));
            else
                FOR_ROWS_TO_X(
                    wide, sc.xq != NULL, r, mr,
                    rms_row(xs + r * H, res + r * H, h + r * H, L->post_norm, H, p->eps));
            prepare_x(h, mr, H, &sc, wide);
            MARK(PH_ROWS);
            step_projection(p, lead, l, 2, &L->gate_up, h, H, &sc, gu, 2 * I, mr, wide);
            MARK(PH_GATE_UP);
            if (p->activation == ACT_GELU_TANH)
                FOR_ROWS_TO_X(wide, sc.xq != NULL, r, mr,
                              gelu_tanh_row(gu + r * 2 * I, gu + r * 2 * I + I, h + r * I, I));
            else
                FOR_ROWS_TO_X(wide, sc.xq != NULL, r, mr,
                              silu_row(gu + r * 2 * I, gu + r * 2 * I + I, h + r * I, I));
            prepare_x(h, mr, I, &sc, wide);
            MARK(PH_ROWS);
            step_projection(p, lead, l, 3, &L->down, h, I, &sc, xs, H, mr, wide);
            reduce_shared(p, xs, mr * H);
            MARK(PH_DOWN);
            added = xs;
            if (L->mlp_out_norm) {
                FOR_ROWS(wide, r, mr,
                         rms_row(xs + r * H, NULL, h + r * H, L->mlp_out_norm, H, p->eps));
                added = h;
            }
        }
        if (wide) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < mr; r++)
                final_row(p, added + r * H, res + r * H, out + (prune ? logit_rows[r] : r) * H);
            if (head_own) { /* the few sampled rows, narrow, each thread its own copy */
                ds_scratch hs = {NULL, NULL, NULL, NULL, NULL, NULL, p->dot_chunked, panel};
                float *hb = scores + up64(p->num_heads * max_len);
                hs.xsum = hb + up64(nr * H);
                hs.xp = hs.xsum + up64(nr * (H / 32) + 1);
                if (dot) hs.xq = (qdot_xblock *)(hs.xp + up64(gemm_x_floats(nr, H)));
                head_share(p, out, nr, logit_rows, hb, &hs, logits, 0);
            } else if (nr > 0) {
                head_share(p, out, nr, logit_rows, h, &sc, logits, 1);
            }
        } else if (nr == 0) {
#pragma omp master
            for (int64_t r = 0; r < m; r++) final_row(p, added + r * H, res + r * H, out + r * H);
        } else {
            /* Every thread normalizes its own copy (the head's input), one writes `out`. */
            for (int64_t r = 0; r < m; r++) final_row(p, added + r * H, res + r * H, res + r * H);
#pragma omp master
            memcpy(out, res, (size_t)(m * H) * sizeof(float));
            head_share(p, res, nr, logit_rows, h, &sc, logits, 0);
        }
        MARK(PH_HEAD); /* with the last layer's Gemma output norm and the final norm */
        /* The head's shares end in the team's barrier: every logit is written. */
        if (spans)
            head_argmax_span(logits, nr, linear_out(&p->head), threads, span_best, span_idx,
                             span_nan);
        MARK(PH_ARGMAX);
    }
    for (int64_t j = 0; j < (spans ? nr : 0); j++)
        argmax[j] = argmax_merge(span_best + j * threads, span_idx + j * threads,
                                 span_nan + j * threads, threads);
    free(item_start);
    return 0;
}

/* A step's cost per sequence in units of one row's GEMMs: each row multiplies every
 * weight once (compute-bound: ~2 FLOP a weight) and reads the keys and values before it
 * (memory-bound: ~1 byte moved costs what ~8 FLOP do here, the attention kernels reading
 * ~15 GB/s against the GEMMs' ~200 GFLOP/s on a Zen 4 core). Only the split's balance
 * depends on it. */
static double keys_per_row_cost(const ds_plan *p) {
    int64_t w = 0;
    const ds_layer *L = &p->layers[0];
    const ds_linear *lins[4] = {&L->qkv, &L->o, &L->gate_up, &L->down};
    for (int i = 0; i < 4; i++) w += lins[i]->k * linear_out(lins[i]);
    w += p->head.num_segments ? p->head.k * linear_out(&p->head) / p->num_layers : 0;
    const double kv_elems = 2.0 * p->num_kv_heads * p->head_dim;
    return (double)w / (15.0 * kv_elems);
}

/* Where a split step cuts its sequences: first[g] .. first[g + 1] are group g's, groups
 * of consecutive sequences whose costs (rows x (keys_per_row_cost + mean keys a row
 * reads)) are as even as a greedy cut makes them. Returns 1 when the dearest group costs
 * at most `slack` times the mean (so one sub-step per thread beats a team whose every
 * barrier may sleep), else 0. */
static int split_cut(const ds_plan *p, int64_t num_seqs, const int64_t *q_lens,
                     const int64_t *seq_lens, int groups, double slack, int64_t *first) {
    const double a = keys_per_row_cost(p);
    double total = 0.0;
    for (int64_t i = 0; i < num_seqs; i++)
        total += (double)q_lens[i] * (a + (double)seq_lens[i] - 0.5 * (double)(q_lens[i] - 1));
    double done = 0.0, dearest = 0.0, group = 0.0;
    int g = 0;
    first[0] = 0;
    for (int64_t i = 0; i < num_seqs; i++) {
        const double c =
            (double)q_lens[i] * (a + (double)seq_lens[i] - 0.5 * (double)(q_lens[i] - 1));
        /* Close group g before sequence i when i would carry it past its even share by
         * more than stopping short does, leaving a sequence for every later group. */
        const double target = total * (g + 1) / groups;
        const int64_t left = num_seqs - i, need = groups - 1 - g;
        if (g < groups - 1 && i > first[g] &&
            (left <= need || done + c - target > target - done)) {
            dearest = group > dearest ? group : dearest;
            first[++g] = i;
            group = 0.0;
        }
        done += c;
        group += c;
    }
    dearest = group > dearest ? group : dearest;
    first[g + 1] = num_seqs;
    return g == groups - 1 && dearest <= slack * total / groups;
}

/* Sequences dealt to `groups` groups dearest first, each to the group that costs least
 * so far (split_cut's costs): group[i] is sequence i's. Returns 1 when the dearest group
 * costs at most `slack` times the mean and every group has a sequence. */
static int split_deal(const ds_plan *p, int64_t num_seqs, const int64_t *q_lens,
                      const int64_t *seq_lens, int groups, double slack, int *group) {
    const double a = keys_per_row_cost(p);
    double *cost = malloc(sizeof(double) * (size_t)num_seqs);
    int64_t *order = malloc(sizeof(int64_t) * (size_t)num_seqs);
    if (!cost || !order) {
        free(cost);
        free(order);
        return 0;
    }
    double total = 0.0, load[64] = {0.0};
    int count[64] = {0};
    for (int64_t i = 0; i < num_seqs; i++) {
        cost[i] = (double)q_lens[i] * (a + (double)seq_lens[i] - 0.5 * (double)(q_lens[i] - 1));
        total += cost[i];
        order[i] = i;
    }
    for (int64_t i = 1; i < num_seqs; i++) /* insertion sort, dearest first */
        for (int64_t j = i; j > 0 && cost[order[j]] > cost[order[j - 1]]; j--) {
            const int64_t t = order[j];
            order[j] = order[j - 1], order[j - 1] = t;
        }
    for (int64_t k = 0; k < num_seqs; k++) {
        int best = 0;
        for (int g = 1; g < groups; g++) best = load[g] < load[best] ? g : best;
        group[order[k]] = best;
        load[best] += cost[order[k]];
        count[best]++;
    }
    double dearest = 0.0;
    int empty = 0;
    for (int g = 0; g < groups; g++) {
        dearest = load[g] > dearest ? load[g] : dearest;
        empty |= count[g] == 0;
    }
    free(cost);
    free(order);
    return !empty && dearest <= slack * total / groups;
}

/* A gathered group's buffers, kept by the thread across steps (as step_buffer, which
 * the group's own team_step uses beside it); NULL when it cannot grow. */
static void *gather_buffer(size_t bytes) {
    static _Thread_local void *buf = NULL;
    static _Thread_local size_t cap = 0;
    return thread_buffer(&buf, &cap, bytes);
}

/* split_step for sequences that no cut into consecutive runs shares out evenly (a
 * prefill chunk of one sequence beside others' decodes): dealt by split_deal, each
 * group's rows, metadata and sampled rows gathered into the thread's own buffers, run
 * as a team of one, and its hidden states, logits and argmax put back in place. */
static int gathered_split(const ds_plan *p, const float *x, float *out, int64_t m,
                          const int64_t *positions, const int64_t *slot_blocks,
                          const int64_t *slot_offsets, int64_t num_seqs,
                          const int64_t *q_starts, const int64_t *q_lens,
                          const int64_t *seq_lens, const int64_t *tables, int64_t max_blocks,
                          const int64_t *w_slot_blocks, const int64_t *w_slot_offsets,
                          const int64_t *w_tables, int64_t w_max_blocks, int64_t nr,
                          const int64_t *logit_rows, float *logits, int64_t *argmax,
                          int groups, double slack, int *rc) {
    int *group = malloc(sizeof(int) * (size_t)num_seqs);
    int64_t *seq_of_row = malloc(sizeof(int64_t) * (size_t)m);
    if (!group || !seq_of_row || !split_deal(p, num_seqs, q_lens, seq_lens, groups, slack, group)) {
        free(group);
        free(seq_of_row);
        return 0;
    }
    for (int64_t i = 0; i < num_seqs; i++)
        for (int64_t r = q_starts[i]; r < q_starts[i] + q_lens[i]; r++) seq_of_row[r] = i;
    const int64_t vocab = linear_out(&p->head), H = p->hidden, wmb = w_tables ? w_max_blocks : 0;
    int worst = 0;
#pragma omp parallel num_threads(groups) reduction(min : worst)
    {
        const int g = omp_get_thread_num();
        int64_t ng = 0, mg = 0, nrg = 0;
        for (int64_t i = 0; i < num_seqs; i++)
            if (group[i] == g) ng++, mg += q_lens[i];
        for (int64_t j = 0; j < nr; j++) nrg += group[seq_of_row[logit_rows[j]]] == g;
        /* floats: x, out, logits; int64s: 5 per row, 3 per sequence, the tables, 3 per
         * sampled row (its local row, its index j, its argmax) */
        const size_t nf = (size_t)(2 * mg * H + nrg * vocab + 1) / 2 * 2; /* int64s follow */
        const size_t ni = (size_t)(5 * mg + 3 * ng + ng * (max_blocks + wmb) + 3 * nrg);
        float *fb = gather_buffer(sizeof(float) * nf + sizeof(int64_t) * ni);
        if (!fb) {
            worst = -1;
        } else {
            float *xg = fb, *og = xg + mg * H, *lg = og + mg * H;
            int64_t *ib = (int64_t *)(fb + nf);
            int64_t *pos = ib, *sb = pos + mg, *so = sb + mg, *wsb = so + mg, *wso = wsb + mg;
            int64_t *qs = wso + mg, *ql = qs + ng, *sl = ql + ng;
            int64_t *tb = sl + ng, *wtb = tb + ng * max_blocks, *lr = wtb + ng * wmb;
            int64_t *jg = lr + nrg, *am = jg + nrg;
            int64_t k = 0, r = 0;
            for (int64_t i = 0; i < num_seqs; i++) {
                if (group[i] != g) continue;
                const int64_t q0 = q_starts[i], n = q_lens[i];
                qs[k] = r, ql[k] = n, sl[k] = seq_lens[i];
                memcpy(tb + k * max_blocks, tables + i * max_blocks,
                       sizeof(int64_t) * (size_t)max_blocks);
                if (wmb)
                    memcpy(wtb + k * wmb, w_tables + i * wmb, sizeof(int64_t) * (size_t)wmb);
                memcpy(xg + r * H, x + q0 * H, sizeof(float) * (size_t)(n * H));
                for (int64_t t = 0; t < n; t++) {
                    pos[r + t] = positions[q0 + t];
                    sb[r + t] = slot_blocks[q0 + t], so[r + t] = slot_offsets[q0 + t];
                    if (wmb) wsb[r + t] = w_slot_blocks[q0 + t], wso[r + t] = w_slot_offsets[q0 + t];
                }
                k++, r += n;
            }
            int64_t c = 0;
            for (int64_t j = 0; j < nr; j++) {
                const int64_t i = seq_of_row[logit_rows[j]];
                if (group[i] != g) continue;
                int64_t local = 0; /* sequence i's first local row: qs of its slot */
                for (int64_t s2 = 0, kk = 0; s2 < i; s2++) kk += group[s2] == g, local = kk;
                lr[c] = qs[local] + logit_rows[j] - q_starts[i];
                jg[c++] = j;
            }
            ds_plan sub = *p;
            sub.profile = p->profile && g < p->profile_threads ? p->profile + g * DS_PHASES : NULL;
            sub.profile_threads = sub.profile ? 1 : 0;
            worst = team_step(&sub, xg, og, mg, pos, sb, so, ng, qs, ql, sl, tb, max_blocks,
                              wmb ? wsb : NULL, wmb ? wso : NULL, wmb ? wtb : NULL, w_max_blocks,
                              nrg, lr, logits ? lg : NULL, argmax ? am : NULL, 1, NULL);
            for (int64_t i = 0, kk = 0; i < num_seqs; i++) {
                if (group[i] != g) continue;
                memcpy(out + q_starts[i] * H, og + qs[kk] * H,
                       sizeof(float) * (size_t)(q_lens[i] * H));
                kk++;
            }
            for (int64_t j = 0; j < nrg; j++) {
                if (logits)
                    memcpy(logits + jg[j] * vocab, lg + j * vocab, sizeof(float) * (size_t)vocab);
                if (argmax) argmax[jg[j]] = am[j];
            }
        }
    }
    free(group);
    free(seq_of_row);
    *rc = worst;
    return 1;
}

/* A step of many sequences as one sub-step per thread, each over its own consecutive
 * sequences on one thread (team_step with a team of one, nested: inactive), with no
 * barrier between them: at 2 threads the team's ~17 barriers a layer cost a futex sleep
 * and a wake (~60-80 us in this VM) whenever one thread runs ~20 us ahead of the other
 * (GOMP_SPINCOUNT=1000), and a late wake makes the next barrier late too. A sub-step
 * reads every weight itself (twice the weight traffic of the team), so only steps whose
 * rows keep the GEMMs compute-bound split (split_min_rows). Rows' results are the
 * team's: each weight kind the caller allows multiplies a row the same whatever the
 * other rows, attention and the row-wise work are per row, the LM head's rows and their
 * argmax per row. logit_rows must ascend (each group's logits are then a slice). Returns
 * 1 when it ran the step (rc: the sub-steps' worst result), 0 when the step does not
 * split. */
static int split_step(const ds_plan *p, const float *x, float *out, int64_t m,
                      const int64_t *positions, const int64_t *slot_blocks,
                      const int64_t *slot_offsets, int64_t num_seqs, const int64_t *q_starts,
                      const int64_t *q_lens, const int64_t *seq_lens, const int64_t *tables,
                      int64_t max_blocks, const int64_t *w_slot_blocks,
                      const int64_t *w_slot_offsets, const int64_t *w_tables,
                      int64_t w_max_blocks, int64_t nr, const int64_t *logit_rows,
                      float *logits, int64_t *argmax, int threads, int *rc) {
    enum { MAX_GROUPS = 64 };
    const int groups = threads < MAX_GROUPS ? threads : MAX_GROUPS;
    if (groups < 2 || p->split_min_rows < 1 || m < p->split_min_rows || num_seqs < groups ||
        p->reduce || p->lora || omp_in_parallel())
        return 0;
    if (p->head.num_segments == 0) nr = 0;
    for (int64_t j = 1; j < nr; j++)
        if (logit_rows[j] <= logit_rows[j - 1]) return 0;
    int64_t first[MAX_GROUPS + 1];
    if (!split_cut(p, num_seqs, q_lens, seq_lens, groups, 1.08, first))
        return gathered_split(p, x, out, m, positions, slot_blocks, slot_offsets, num_seqs,
                              q_starts, q_lens, seq_lens, tables, max_blocks, w_slot_blocks,
                              w_slot_offsets, w_tables, w_max_blocks, nr, logit_rows, logits,
                              argmax, groups, 1.08, rc);
    /* Each group's q_starts and logit rows rebased to its first row. */
    int64_t *rebased = malloc(sizeof(int64_t) * (size_t)(num_seqs + nr + 1));
    if (!rebased) {
        *rc = -1;
        return 1;
    }
    const int64_t vocab = linear_out(&p->head), H = p->hidden;
    int worst = 0;
#pragma omp parallel num_threads(groups) reduction(min : worst)
    {
        const int g = omp_get_thread_num();
        const int64_t s0 = first[g], s1 = first[g + 1];
        const int64_t r0 = q_starts[s0], r1 = s1 < num_seqs ? q_starts[s1] : m;
        int64_t *qs = rebased + s0;
        for (int64_t i = s0; i < s1; i++) qs[i - s0] = q_starts[i] - r0;
        int64_t j0 = 0, j1 = 0;
        while (j0 < nr && logit_rows[j0] < r0) j0++;
        for (j1 = j0; j1 < nr && logit_rows[j1] < r1;) j1++;
        int64_t *lr = rebased + num_seqs + 1 + j0;
        for (int64_t j = j0; j < j1; j++) lr[j - j0] = logit_rows[j] - r0;
        /* The profile's slot for this thread (a team of one writes slot 0). */
        ds_plan sub = *p;
        sub.profile = p->profile && g < p->profile_threads ? p->profile + g * DS_PHASES : NULL;
        sub.profile_threads = sub.profile ? 1 : 0;
        worst = team_step(
            &sub, x + r0 * H, out + r0 * H, r1 - r0, positions + r0, slot_blocks + r0,
            slot_offsets + r0, s1 - s0, qs, q_lens + s0, seq_lens + s0, tables + s0 * max_blocks,
            max_blocks, w_tables ? w_slot_blocks + r0 : NULL, w_tables ? w_slot_offsets + r0 : NULL,
            w_tables ? w_tables + s0 * w_max_blocks : NULL, w_max_blocks, j1 - j0, lr,
            logits ? logits + j0 * vocab : NULL, argmax ? argmax + j0 : NULL, 1, NULL);
    }
    free(rebased);
    *rc = worst;
    return 1;
}

/* Sequences a lead step takes at most: replayed SmolLM2 steps of 2-4 one-row decodes
 * and of 2 x 4 rows ran 8-26% faster as lead steps than as a team; split_step, tried
 * first, takes steps of split_min_rows and more that share out evenly. */
#define LEAD_MAX_SEQS 4

/* A step of few sequences and rows on 2 threads as a lead step, in one region of 2:
 * thread 0 runs the layers as a team of one (what split_step's sub-steps run: the team's
 * results bit for bit, with no barrier) while thread 1 sleeps, helping with the plan's
 * lead_share projections (lead_share.h: chunks of weight rows grabbed from one counter,
 * thread 0 never waiting for thread 1 to start), until the last layer starts; the two
 * then run the LM head (a shared GEMV too where lead_share is not empty, else as
 * team_step's narrow steps do) and argmax: the same rows' dot products, the same bits.
 * A one-row step as a team splits ~150 GEMVs and attentions a token over the team, each
 * ending in a barrier whose wait (a preempted partner) costs more than the second core
 * gives; a shared GEMV has no barrier, and only the long ones (gate_up, down, the head)
 * are worth its two sync points. Returns 1 when it ran the step
 * (rc: the worst result), 0 when the step is not one. */
static int lead_step(const ds_plan *p, const float *x, float *out, int64_t m,
                     const int64_t *positions, const int64_t *slot_blocks,
                     const int64_t *slot_offsets, int64_t num_seqs, const int64_t *q_starts,
                     const int64_t *q_lens, const int64_t *seq_lens, const int64_t *tables,
                     int64_t max_blocks, const int64_t *w_slot_blocks,
                     const int64_t *w_slot_offsets, const int64_t *w_tables,
                     int64_t w_max_blocks, int64_t nr, const int64_t *logit_rows,
                     float *logits, int64_t *argmax, int threads, int *rc) {
    /* Past the decode-sized shares' rows (a verification of 9-16 rows) the team of one
     * still runs narrow: only where every weight multiplies a row as the wide step's
     * shares do, and within a verification's attention (Q_TILE rows). */
    if (threads != 2 || num_seqs > LEAD_MAX_SEQS || m > p->lead_max_rows || m > Q_TILE ||
        (m > decode_step_max_rows() && !plan_rows_independent(p)) || p->reduce || p->lora ||
        omp_in_parallel())
        return 0;
    const int head = p->head.num_segments > 0 && nr > 0 && p->final_norm;
    /* The head's scratch: per thread its input rows, block sums, x tiles and int8
     * blocks; the argmax spans (gather_buffer: the layers' team_step takes step_buffer). */
    const int64_t H = p->hidden, vocab = linear_out(&p->head);
    const int dot = plan_has_dot(p), panel = plan_has_panel(p);
    const int64_t spans = head && argmax ? nr * threads : 0;
    const size_t xq_floats =
        dot ? up64((nr * (H / 32) * sizeof(qdot_xblock) + sizeof(float) - 1) / sizeof(float))
            : 0;
    const size_t priv = up64(nr * H) + up64(nr * (H / 32) + 1) + up64(gemm_x_floats(nr, H)) +
                        xq_floats;
    float *hbuf = head ? gather_buffer(sizeof(float) * (size_t)threads * priv +
                                       (sizeof(int64_t) * 2 + sizeof(int)) * (size_t)spans)
                       : NULL;
    if (head && !hbuf) {
        *rc = -1;
        return 1;
    }
    int64_t *span_idx = head ? (int64_t *)(hbuf + (size_t)threads * priv) : NULL;
    float *span_best = head ? (float *)(span_idx + spans) : NULL;
    int *span_nan = head ? (int *)(span_idx + 2 * spans) : NULL;
    for (int64_t s = 0; s < spans; s++) span_idx[s] = -1;
    int layers_rc = 0, head_done = 0; /* head_done: thread 0 ran the head with thread 1 */
    double t_head = 0.0;              /* when it started (profiles) */
    ds_lead lead;
    lead_init(&lead, 1e-6 * p->lead_spin_us, p->lead_chunk_bytes, p->lead_counts);
#pragma omp parallel num_threads(threads)
    {
        const int tid = omp_get_thread_num();
        if (tid == 0) {
            layers_rc = team_step(p, x, out, m, positions, slot_blocks, slot_offsets,
                                  num_seqs, q_starts, q_lens, seq_lens, tables, max_blocks,
                                  w_slot_blocks, w_slot_offsets, w_tables, w_max_blocks,
                                  head ? 0 : nr, logit_rows, logits, argmax, 1, &lead);
            /* The head as a shared GEMV too (thread 1 spinning since the last layer):
             * whole weight rows a grab, as the projections. */
            if (head && layers_rc == 0 && lead_bits(p, m)) {
                t_head = p->profile ? profile_clock(p->profile_cpu) : 0.0;
                float *hb = hbuf;
                ds_scratch sc = {NULL, NULL, NULL, NULL, NULL, NULL, p->dot_chunked, panel};
                sc.xsum = hb + up64(nr * H);
                sc.xp = sc.xsum + up64(nr * (H / 32) + 1);
                if (dot) sc.xq = (qdot_xblock *)(sc.xp + up64(gemm_x_floats(nr, H)));
                for (int64_t j = 0; j < nr; j++)
                    memcpy(hb + j * H, out + logit_rows[j] * H, (size_t)H * sizeof(float));
                prepare_x(hb, nr, H, &sc, 0);
                head_done = lead_linear(&lead, &p->head, &sc, logits, vocab, nr);
            }
            lead_layers_done(&lead);
        } else {
            lead_help(&lead);
        }
        if (head && layers_rc == 0) {
            double *prof = p->profile && tid < p->profile_threads
                               ? p->profile + tid * DS_PHASES
                               : NULL;
            double t_last = prof ? profile_clock(p->profile_cpu) : 0.0;
            if (tid == 0 && head_done) t_last = t_head;
            float *hb = hbuf + (size_t)tid * priv;
            ds_scratch sc = {NULL, NULL, NULL, NULL, NULL, NULL, p->dot_chunked, panel};
            sc.xsum = hb + up64(nr * H);
            sc.xp = sc.xsum + up64(nr * (H / 32) + 1);
            if (dot) sc.xq = (qdot_xblock *)(sc.xp + up64(gemm_x_floats(nr, H)));
            if (!head_done) head_share(p, out, nr, logit_rows, hb, &sc, logits, 0);
            MARK(PH_HEAD);
            if (spans)
                head_argmax_span(logits, nr, vocab, threads, span_best, span_idx, span_nan);
            MARK(PH_ARGMAX);
        }
    }
    for (int64_t j = 0; j < (spans && layers_rc == 0 ? nr : 0); j++)
        argmax[j] = argmax_merge(span_best + j * threads, span_idx + j * threads,
                                 span_nan + j * threads, threads);
    lead_destroy(&lead);
    *rc = layers_rc;
    return 1;
}

/* The step (see team_step for its arguments and results): the layers on one thread and
 * the head on two where the step is one sequence's few rows (lead_step: returns 2 when
 * it ran so), split over the threads by sequences where that pays (split_step: 1), else
 * by the team within each kernel. */
int decode_step(const ds_plan *p, const float *x, float *out, int64_t m,
                const int64_t *positions, const int64_t *slot_blocks,
                const int64_t *slot_offsets, int64_t num_seqs, const int64_t *q_starts,
                const int64_t *q_lens, const int64_t *seq_lens, const int64_t *tables,
                int64_t max_blocks, const int64_t *w_slot_blocks,
                const int64_t *w_slot_offsets, const int64_t *w_tables, int64_t w_max_blocks,
                int64_t nr, const int64_t *logit_rows, float *logits, int64_t *argmax,
                int threads) {
    if (m < 1 || num_seqs < 1) return -2;
    int rc = 0;
    if (split_step(p, x, out, m, positions, slot_blocks, slot_offsets, num_seqs, q_starts,
                   q_lens, seq_lens, tables, max_blocks, w_slot_blocks, w_slot_offsets,
                   w_tables, w_max_blocks, nr, logit_rows, logits, argmax, threads, &rc))
        return rc < 0 ? rc : 1;
    if (lead_step(p, x, out, m, positions, slot_blocks, slot_offsets, num_seqs, q_starts,
                  q_lens, seq_lens, tables, max_blocks, w_slot_blocks, w_slot_offsets, w_tables,
                  w_max_blocks, nr, logit_rows, logits, argmax, threads, &rc))
        return rc < 0 ? rc : 2;
    return team_step(p, x, out, m, positions, slot_blocks, slot_offsets, num_seqs, q_starts,
                     q_lens, seq_lens, tables, max_blocks, w_slot_blocks, w_slot_offsets,
                     w_tables, w_max_blocks, nr, logit_rows, logits, argmax, threads, NULL);
}

/* The embedding table a burst reads its tokens' rows from: GGUF blocks (quant.py's
 * QuantWeight, read by quant_dequantize_rows as its quant_embedding does) or, qtype < 0,
 * float32 rows [vocab, hidden] (nn.Embedding's, copied as embed_rows' numpy lookup). */
typedef struct {
    int32_t qtype;
    const void *data;
    int64_t row_bytes;
    int64_t vocab;
} ds_embedding;

void quant_dequantize_rows(int qtype, const uint8_t *w, int64_t row_bytes, const int64_t *ids,
                           int64_t n_ids, int64_t k, float *out, int threads);

/* A lone greedy sequence's next tokens, one decode step each (worker/decode_burst.py):
 * `token` is embedded through the model's own lookup and decoded at position pos0, the
 * step's argmax is the next token, decoded at pos0 + 1, and so on: num_steps tokens, or
 * fewer when one is in stop_ids (kept, not decoded). What one step at a time does, without
 * going back to Python between the steps. table: the sequence's num_blocks block ids,
 * holding the slots of positions pos0 .. pos0 + num_steps - 1; x, out [hidden] and
 * logits [vocab] scratch. Returns the number of tokens written to `tokens`, or a negative
 * error: decode_step's, or -3 for a token outside the embedding table or a position
 * outside the blocks. */
int64_t decode_burst(const ds_plan *p, const ds_embedding *emb, int64_t token, int64_t pos0,
                     const int64_t *table, int64_t num_blocks, int64_t num_steps,
                     const int64_t *stop_ids, int64_t num_stops, float *x, float *out,
                     float *logits, int64_t *tokens, int threads) {
    const int64_t H = p->hidden, bs = p->block_size, zero = 0, one = 1;
    int64_t n = 0;
    while (n < num_steps) {
        if (token < 0 || token >= emb->vocab || (pos0 + n) / bs >= num_blocks) return -3;
        if (emb->qtype >= 0)
            quant_dequantize_rows(emb->qtype, emb->data, emb->row_bytes, &token, 1, H, x, 1);
        else
            memcpy(x, (const float *)emb->data + token * H, (size_t)H * sizeof(float));
        const int64_t pos = pos0 + n, block = table[pos / bs], offset = pos % bs, len = pos + 1;
        int64_t next = 0;
        const int rc = decode_step(p, x, out, 1, &pos, &block, &offset, 1, &zero, &one, &len,
                                   table, num_blocks, NULL, NULL, NULL, 0, 1, &zero, logits,
                                   &next, threads);
        if (rc < 0) return rc;
        tokens[n++] = token = next;
        for (int64_t i = 0; i < num_stops; i++)
            if (stop_ids[i] == token) return n;
    }
    return n;
}

/* ---- speculative bursts (worker/spec_burst.py; helper sburst's code, not the team's) ---- */

/* spec_decode/ngram.py's find_ngram_match on tokens[0 .. len): the longest suffix n-gram
 * (max_n down to min_n tokens) that occurred before, its latest earlier occurrence;
 * returns where the tokens after it start and sets *n_out to n, or returns -1 with
 * *n_out = 0. A scan: ~1k tokens of int64 compares, a few microseconds. */
static int64_t spec_ngram_match(const int64_t *tokens, int64_t len, int64_t min_n,
                                int64_t max_n, int64_t *n_out) {
    for (int64_t n = max_n < len - 1 ? max_n : len - 1; n >= min_n && n >= 1; n--) {
        const int64_t *suffix = tokens + len - n;
        /* candidate starts len - n - 1 down to 0 (the suffix itself excluded) */
        for (int64_t i = len - n - 1; i >= 0; i--) {
            if (tokens[i] != suffix[0]) continue;
            if (memcmp(tokens + i, suffix, (size_t)n * sizeof(int64_t)) == 0) {
                *n_out = n;
                return i + n;
            }
        }
    }
    *n_out = 0;
    return -1;
}

static int spec_is_stop(int64_t token, const int64_t *stop_ids, int64_t num_stops) {
    for (int64_t i = 0; i < num_stops; i++)
        if (stop_ids[i] == token) return 1;
    return 0;
}

/* The limits of one speculative burst (spec_burst's arguments beside the buffers). */
typedef struct {
    int64_t budget;          /* no round starts once this many tokens were emitted */
    int64_t max_output;      /* tokens the request may still emit (max_tokens' room) */
    int64_t max_position;    /* positions written stay below it (blocks, max_model_len) */
    int64_t k;               /* drafts after a match of 2+ tokens (or of 1 when max_n = 1) */
    int64_t unigram_drafts;  /* drafts after a match of one token when max_n > 1 */
    int64_t min_n, max_n;    /* the n-gram lengths looked up */
} ds_spec_limits;

/* A lone greedy sequence's speculative decoding, verification after verification in one
 * call: what the n-gram proposer (spec_decode/ngram.py, fixed draft length) and the
 * greedy rejection sampler do across scheduler steps, without going back to Python.
 * tokens[0 .. len): the sequence, its last token pending (not in the cache) at position
 * len - 1; each round looks up the drafts as NgramProposer.propose would (the match's
 * k or unigram_drafts tokens, cut after a stop token, capped by max_output - 1), runs
 * the pending token and the drafts as one step of 1 + d rows (all rows' logits and
 * argmax: the verification step the runner would build), accepts the drafts while each
 * equals the argmax of the row before it and emits them and one argmax of its own; a
 * round without a match is a one-row decode. The emitted tokens are appended to tokens
 * (capacity len + budget + k). It ends after the round that brings the emitted count
 * to budget, after a stop token, at max_output, or before a round whose rows
 * would reach max_position (its drafts are not cut: the next scheduler step verifies
 * them with the scheduler's slots). table: the sequence's num_blocks block ids; x, out
 * [k + 1, hidden], logits [k + 1, vocab] scratch, rows (int64 [k + 1]) and argmax (int64
 * [k + 1]) scratch. counts[0..3]: rounds (C steps), verifications (rounds with drafts),
 * drafts, accepted drafts. Returns the number of tokens emitted, or a negative error: decode_step's, -3
 * for a token outside the embedding table, -4 for k + 1 > 64 rows or len < 1. */
int64_t spec_burst(const ds_plan *p, const ds_embedding *emb, int64_t *tokens, int64_t len,
                   const int64_t *table, int64_t num_blocks, const ds_spec_limits *lim,
                   const int64_t *stop_ids, int64_t num_stops, float *x, float *out,
                   float *logits, int64_t *rows, int64_t *argmax, int64_t *counts,
                   int threads) {
    const int64_t H = p->hidden, bs = p->block_size, zero = 0;
    const int64_t max_position =
        lim->max_position < num_blocks * bs ? lim->max_position : num_blocks * bs;
    int64_t positions[64], slot_blocks[64], slot_offsets[64];
    int64_t emitted = 0;
    counts[0] = counts[1] = counts[2] = counts[3] = 0;
    if (lim->k + 1 > 64 || len < 1) return -4;
    while (emitted < lim->budget && emitted < lim->max_output) {
        const int64_t pos = len - 1;
        int64_t n = 0, d = 0;
        const int64_t start = spec_ngram_match(tokens, len, lim->min_n, lim->max_n, &n);
        if (n) {
            d = n == 1 && lim->max_n > 1 ? lim->unigram_drafts : lim->k;
            if (d > len - start) d = len - start;
            for (int64_t i = 0; i < d; i++)
                if (spec_is_stop(tokens[start + i], stop_ids, num_stops)) {
                    d = i + 1;
                    break;
                }
        }
        /* the scheduler's caps on drafts: max_tokens' room, max_model_len */
        if (d > lim->max_output - emitted - 1) d = lim->max_output - emitted - 1;
        if (d < 0) d = 0;
        if (pos + d >= max_position) break; /* the scheduler's next step takes it */
        const int64_t m = d + 1;
        for (int64_t r = 0; r < m; r++) {
            const int64_t t = r ? tokens[start + r - 1] : tokens[pos];
            if (t < 0 || t >= emb->vocab) return -3;
            if (emb->qtype >= 0)
                quant_dequantize_rows(emb->qtype, emb->data, emb->row_bytes, &t, 1, H,
                                      x + r * H, 1);
            else
                memcpy(x + r * H, (const float *)emb->data + t * H, (size_t)H * sizeof(float));
            positions[r] = pos + r;
            slot_blocks[r] = table[(pos + r) / bs];
            slot_offsets[r] = (pos + r) % bs;
            rows[r] = r;
        }
        const int64_t seq_len = pos + m;
        const int rc = decode_step(p, x, out, m, positions, slot_blocks, slot_offsets, 1, &zero,
                                   &m, &seq_len, table, num_blocks, NULL, NULL, NULL, 0, m,
                                   rows, logits, argmax, threads);
        if (rc < 0) return rc;
        int64_t a = 0;
        while (a < d && argmax[a] == tokens[start + a]) a++;
        counts[0] += 1;
        if (d) {
            counts[1] += 1;
            counts[2] += d;
            counts[3] += a;
        }
        /* drafts[0 .. a) then the target's own token; the sequence grows in place (the
         * accepted drafts are copied before the bonus overwrites nothing they read) */
        for (int64_t j = 0; j <= a; j++) {
            const int64_t t = j < a ? tokens[start + j] : argmax[a];
            tokens[len++] = t;
            emitted++;
            if (spec_is_stop(t, stop_ids, num_stops)) return emitted;
        }
    }
    return emitted;
}
