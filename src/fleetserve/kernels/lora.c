// Grouped LoRA shrink/expand: y[row] += B_slot (A_slot x[row]) for the rows of each
// adapter slot, the rows of one slot taken together so that its A and B are read once
// per step and layer however many rows it has (mixed-adapter batches).
//
// A module may be fused (q/k/v, gate/up): its output columns are `num_segs` segments,
// segment g at columns [seg_starts[g], seg_starts[g + 1]), with its own rank-r pair.
// Per slot the layout is
//   A  [num_slots, num_segs * max_rank, in_dim]    segment g's A rows at g * max_rank
//   B  [num_slots, max_rank, out_dim]              rank-major: B^T of each slot
//   ranks [num_slots, num_segs]                    0: the adapter leaves g untouched
// Rows: `rows` lists the batch rows grouped by slot; group i is rows[group_starts[i] ..
// group_starts[i + 1]) with slot group_slots[i]. `shrunk` is scratch of
// [num_listed_rows, num_segs * max_rank] floats.
//
// A and B are float32 (`half` = 0) or bfloat16 (`half` = 1, stored as uint16): a decode
// step's LoRA work is bound by reading the slots' weights, so bf16 halves it. bf16 -> f32
// is a 16-bit shift, which every CPU does (no AVX512-BF16 needed); x, y and the
// accumulation stay float32.

#include <omp.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static float dot_f32(const float *a, const float *b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t k = 0; k < n; k++) acc += a[k] * b[k];
    return acc;
}

static float dot_bf16(const uint16_t *a, const float *b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t k = 0; k < n; k++) acc += bf16_to_f32(a[k]) * b[k];
    return acc;
}

// Four consecutive A rows (row stride n) against one x: four independent sums.
static void dot4_f32(const float *a, const float *x, int64_t n, float out[4]) {
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t k = 0; k < n; k++) {
        const float xk = x[k];
        s0 += a[k] * xk;
        s1 += a[n + k] * xk;
        s2 += a[2 * n + k] * xk;
        s3 += a[3 * n + k] * xk;
    }
    out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

static void dot4_bf16(const uint16_t *a, const float *x, int64_t n, float out[4]) {
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t k = 0; k < n; k++) {
        const float xk = x[k];
        s0 += bf16_to_f32(a[k]) * xk;
        s1 += bf16_to_f32(a[n + k]) * xk;
        s2 += bf16_to_f32(a[2 * n + k]) * xk;
        s3 += bf16_to_f32(a[3 * n + k]) * xk;
    }
    out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

static void axpy_f32(float *y, float s, const float *b, int64_t lo, int64_t hi) {
#pragma omp simd
    for (int64_t o = lo; o < hi; o++) y[o] += s * b[o];
}

static void axpy_bf16(float *y, float s, const uint16_t *b, int64_t lo, int64_t hi) {
#pragma omp simd
    for (int64_t o = lo; o < hi; o++) y[o] += s * bf16_to_f32(b[o]);
}

/* The shrink of rows grouped by slot: shrunk[i, c] = A_slot[c] . x[rows[i]] (0 past a
 * segment's rank). One (group, block of 4 A rows) item per iteration, each row of the
 * group dotted with the 4 A rows at once (4 independent sums, x read once per block).
 * An orphaned `omp for` with no barrier at its end: inside a parallel region the team
 * splits the items, and the caller's next barrier ends the shrink. */
static void shrink_items(const float *x, int64_t x_stride, int64_t in_dim, const void *A,
                         const int32_t *ranks, int64_t max_rank, int32_t num_segs,
                         const int64_t *rows, const int64_t *group_starts,
                         const int32_t *group_slots, int32_t num_groups, float *shrunk,
                         int32_t half) {
    const int64_t width = (int64_t)num_segs * max_rank;
    const int64_t blocks = (width + 3) / 4;
#pragma omp for schedule(static) nowait
    for (int64_t item = 0; item < (int64_t)num_groups * blocks; item++) {
        const int64_t grp = item / blocks, c0 = (item % blocks) * 4;
        const int32_t slot = group_slots[grp];
        const int64_t r0 = group_starts[grp], r1 = group_starts[grp + 1];
        int64_t live[4];
        int32_t num_live = 0;
        for (int64_t c = c0; c < c0 + 4 && c < width; c++) {
            const int32_t r = ranks[(int64_t)slot * num_segs + c / max_rank];
            if (c % max_rank < r) live[num_live++] = c;
            else
                for (int64_t i = r0; i < r1; i++) shrunk[i * width + c] = 0.0f;
        }
        const int64_t base = (int64_t)slot * width * in_dim;
        for (int64_t i = r0; i < r1; i++) {
            const float *xr = x + rows[i] * x_stride;
            float out[4];
            if (num_live == 4 && half)
                dot4_bf16((const uint16_t *)A + base + c0 * in_dim, xr, in_dim, out);
            else if (num_live == 4)
                dot4_f32((const float *)A + base + c0 * in_dim, xr, in_dim, out);
            else
                for (int32_t j = 0; j < num_live; j++) {
                    const int64_t off = base + live[j] * in_dim;
                    out[j] = half ? dot_bf16((const uint16_t *)A + off, xr, in_dim)
                                  : dot_f32((const float *)A + off, xr, in_dim);
                }
            for (int32_t j = 0; j < num_live; j++) shrunk[i * width + live[j]] = out[j];
        }
    }
}

/* The expand: y[rows[i]] += shrunk[i] B_slot, the team splitting the output columns in
 * tiles of `tile` (no two threads write one element; each element's sum runs over the
 * ranks in the same order whatever the tiling). B is stored rank-major, so each of a
 * row's r updates is one contiguous axpy. An orphaned `omp for` ending in the team's
 * barrier. */
static void expand_tiles(float *y, int64_t y_stride, int64_t out_dim, const void *B,
                         const int32_t *ranks, int64_t max_rank, int32_t num_segs,
                         const int64_t *seg_starts, const int64_t *rows,
                         const int64_t *group_starts, const int32_t *group_slots,
                         int32_t num_groups, const float *shrunk, int64_t tile, int32_t half) {
    const int64_t width = (int64_t)num_segs * max_rank;
#pragma omp for schedule(static)
    for (int64_t o0 = 0; o0 < out_dim; o0 += tile) {
        const int64_t o1 = o0 + tile < out_dim ? o0 + tile : out_dim;
        for (int32_t g = 0; g < num_segs; g++) {
            const int64_t lo = seg_starts[g] > o0 ? seg_starts[g] : o0;
            const int64_t hi = seg_starts[g + 1] < o1 ? seg_starts[g + 1] : o1;
            if (lo >= hi) continue;
            for (int32_t grp = 0; grp < num_groups; grp++) {
                const int32_t slot = group_slots[grp];
                const int32_t r = ranks[(int64_t)slot * num_segs + g];
                const int64_t bt = (int64_t)slot * max_rank * out_dim;
                for (int64_t i = group_starts[grp]; i < group_starts[grp + 1]; i++) {
                    float *yr = y + rows[i] * y_stride;
                    const float *s = shrunk + i * width + (int64_t)g * max_rank;
                    for (int32_t k = 0; k < r; k++) {
                        const int64_t bk = bt + (int64_t)k * out_dim;
                        if (half)
                            axpy_bf16(yr, s[k], (const uint16_t *)B + bk, lo, hi);
                        else
                            axpy_f32(yr, s[k], (const float *)B + bk, lo, hi);
                    }
                }
            }
        }
    }
}

/* Output columns per expand item for a team of `threads`: a few tiles per thread (so
 * that a short output still splits evenly), a multiple of 16 floats, at least 64. */
static int64_t expand_tile(int64_t out_dim, int threads) {
    if (threads <= 1) return out_dim > 0 ? out_dim : 1;
    int64_t t = (out_dim + 4 * threads - 1) / (4 * threads);
    t = (t + 15) / 16 * 16;
    return t < 64 ? 64 : t;
}

void lora_shrink_expand(
    const float *x, int64_t x_stride, float *y, int64_t y_stride, int64_t in_dim,
    int64_t out_dim, const void *A, const void *B, const int32_t *ranks, int64_t max_rank,
    int32_t num_segs, const int64_t *seg_starts, const int64_t *rows,
    const int64_t *group_starts, const int32_t *group_slots, int32_t num_groups,
    float *shrunk, int32_t num_threads, int32_t half) {
    const int64_t tile = expand_tile(out_dim, num_threads);
#pragma omp parallel num_threads(num_threads)
    {
        shrink_items(x, x_stride, in_dim, A, ranks, max_rank, num_segs, rows, group_starts,
                     group_slots, num_groups, shrunk, half);
#pragma omp barrier
        expand_tiles(y, y_stride, out_dim, B, ranks, max_rank, num_segs, seg_starts, rows,
                     group_starts, group_slots, num_groups, shrunk, tile, half);
    }
}

/* ---- Inside the C decode step (decode_step.c) ----------------------------------------
 * The step's LoRA: per decoder layer and projection (qkv, o, gate_up, down) the slots of
 * one LoRALinear, and the step's rows grouped by slot. Mirrored by lora/fused.py. */
typedef struct {
    const void *a, *b; /* NULL: this projection has no LoRA */
    const int32_t *ranks;
    const int64_t *seg_starts;
    int64_t max_rank;
    int32_t num_segs, half;
} lora_proj;

typedef struct {
    const lora_proj *projs; /* [num_layers * 4] */
    const int64_t *rows, *group_starts;
    const int32_t *group_slots;
    int32_t num_groups;
    float *shrunk; /* [rows, 3 * max_rank] scratch */
} lora_step;

/* Whether any of the step's slots has a rank on this projection (all threads agree: it
 * reads only shared, unchanging data, so they take the same barriers). */
static const lora_proj *active_proj(const lora_step *s, int layer, int proj) {
    if (!s) return NULL;
    const lora_proj *lp = &s->projs[layer * 4 + proj];
    if (!lp->a) return NULL;
    for (int32_t grp = 0; grp < s->num_groups; grp++)
        for (int32_t g = 0; g < lp->num_segs; g++)
            if (lp->ranks[(int64_t)s->group_slots[grp] * lp->num_segs + g] > 0) return lp;
    return NULL;
}

/* Called by every thread of the step's team before the projection's GEMM share: the
 * shrink of x [m, in_dim] (no barrier: the GEMM's ends it). */
void lora_step_shrink(const void *step, int layer, int proj, const float *x, int64_t ldx,
                      int64_t in_dim) {
    const lora_step *s = step;
    const lora_proj *lp = active_proj(s, layer, proj);
    if (!lp) return;
    shrink_items(x, ldx, in_dim, lp->a, lp->ranks, lp->max_rank, lp->num_segs, s->rows,
                 s->group_starts, s->group_slots, s->num_groups, s->shrunk, lp->half);
}

/* ... and after it (its barrier passed): y [m, out_dim] += the delta, ending in a barrier.
 * The same arithmetic as lora_shrink_expand, so the module path's rows match. */
void lora_step_expand(const void *step, int layer, int proj, float *y, int64_t ldy,
                      int64_t out_dim) {
    const lora_step *s = step;
    const lora_proj *lp = active_proj(s, layer, proj);
    if (!lp) return;
    expand_tiles(y, ldy, out_dim, lp->b, lp->ranks, lp->max_rank, lp->num_segs,
                 lp->seg_starts, s->rows, s->group_starts, s->group_slots, s->num_groups,
                 s->shrunk, expand_tile(out_dim, omp_get_num_threads()), lp->half);
}
