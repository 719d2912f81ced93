/* A lead step's shared GEMVs: see lead_share.h. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */

#include "lead_share.h"

#include <time.h>

#define LEAD_PANEL_ROWS 16 /* quant_dot.c's PR */

static inline void lead_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static double lead_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void lead_init(ds_lead *ld, double spin_s, int64_t chunk_bytes, int64_t *counts) {
    pthread_mutex_init(&ld->lock, NULL);
    pthread_cond_init(&ld->cond, NULL);
    ld->sleeping = ld->head_soon = ld->ready = 0;
    ld->word = 0;
    ld->done = ld->chunks = 0;
    ld->num_segments = 0;
    ld->fn = NULL;
    ld->ctx = NULL;
    ld->spin_s = spin_s;
    ld->chunk_bytes = chunk_bytes > 0 ? chunk_bytes : 1;
    ld->counts = counts;
}

void lead_destroy(ds_lead *ld) {
    pthread_mutex_destroy(&ld->lock);
    pthread_cond_destroy(&ld->cond);
}

/* Thread 1 may be in cond_wait: wake it (sleeping is stored before thread 1 reads the
 * flags and `word`, both sequentially consistent: one of the two sides sees the other). */
static void lead_wake(ds_lead *ld) {
    if (!__atomic_load_n(&ld->sleeping, __ATOMIC_SEQ_CST)) return;
    pthread_mutex_lock(&ld->lock);
    pthread_cond_signal(&ld->cond);
    pthread_mutex_unlock(&ld->lock);
}

/* Chunks [c0, c1) of the job: each segment's panels in them (an items job: its items). */
static void lead_run(const ds_lead *ld, int64_t c0, int64_t c1, int tid) {
    if (ld->fn) {
        for (int64_t i = c0; i < c1; i++) ld->fn(ld->ctx, i, tid);
        return;
    }
    for (int s = 0; s < ld->num_segments; s++) {
        const lead_segment *g = &ld->seg[s];
        const int64_t panels = (g->n + LEAD_PANEL_ROWS - 1) / LEAD_PANEL_ROWS;
        const int64_t end = g->chunk0 + (panels + g->chunk_panels - 1) / g->chunk_panels;
        const int64_t a = c0 > g->chunk0 ? c0 : g->chunk0, b = c1 < end ? c1 : end;
        if (a >= b) continue;
        const int64_t p0 = (a - g->chunk0) * g->chunk_panels;
        int64_t p1 = (b - g->chunk0) * g->chunk_panels;
        if (p1 > panels) p1 = panels;
        quant_dot_panels(g->fmt, ld->xb, ld->m, ld->nb, g->w, g->row_bytes, g->out, ld->ldo,
                         g->n, p0, p1);
    }
}

/* Grab and multiply chunks of job `job` until none is left. A successful swap of `word`
 * means the job was still open, so its fields (written before its id was published,
 * rewritten only after every chunk is done) are this job's. */
static void lead_grab(ds_lead *ld, uint32_t job, int tid) {
    for (;;) {
        uint64_t w = __atomic_load_n(&ld->word, __ATOMIC_ACQUIRE);
        if ((uint32_t)(w >> 32) != job) return;
        const int64_t next = (int64_t)(uint32_t)w;
        const int64_t chunks = __atomic_load_n(&ld->chunks, __ATOMIC_RELAXED);
        if (next >= chunks) return;
        const lead_item_fn fn = __atomic_load_n(&ld->fn, __ATOMIC_RELAXED);
        int64_t take = fn ? 1 : (chunks - next) / 4;
        if (take < 1) take = 1;
        if (!__atomic_compare_exchange_n(&ld->word, &w, w + (uint64_t)take, 0, __ATOMIC_ACQ_REL,
                                         __ATOMIC_ACQUIRE))
            continue;
        lead_run(ld, next, next + take, tid);
        if (ld->counts)
            __atomic_add_fetch(&ld->counts[(ld->fn ? 2 : 0) + tid], take, __ATOMIC_RELAXED);
        __atomic_add_fetch(&ld->done, take, __ATOMIC_RELEASE);
    }
}

/* Close the last job before its fields are rewritten: a thread 1 that loaded its word
 * and then (after a preemption) reads the new `chunks` must not win a swap on that word
 * and run chunks over fields still being written. */
static void lead_close(ds_lead *ld) {
    const uint64_t last = __atomic_load_n(&ld->word, __ATOMIC_RELAXED);
    __atomic_store_n(&ld->word, (last & ~(uint64_t)0xffffffffu) | 0xffffffffu, __ATOMIC_SEQ_CST);
}

/* Publish the job whose fields were just written (`chunks` of them), take chunks of it,
 * and wait for those thread 1 took: never for thread 1 to start. */
static void lead_publish_and_run(ds_lead *ld, int64_t chunks) {
    __atomic_store_n(&ld->chunks, chunks, __ATOMIC_RELAXED);
    __atomic_store_n(&ld->done, 0, __ATOMIC_RELAXED);
    const uint32_t job = (uint32_t)(__atomic_load_n(&ld->word, __ATOMIC_RELAXED) >> 32) + 1;
    __atomic_store_n(&ld->word, (uint64_t)job << 32, __ATOMIC_SEQ_CST);
    lead_wake(ld);
    lead_grab(ld, job, 0);
    while (__atomic_load_n(&ld->done, __ATOMIC_ACQUIRE) < chunks) lead_pause();
}

void lead_items(ds_lead *ld, int64_t items, lead_item_fn fn, void *ctx) {
    lead_close(ld);
    __atomic_store_n(&ld->fn, fn, __ATOMIC_RELAXED);
    ld->ctx = ctx;
    lead_publish_and_run(ld, items);
}

void lead_gemv(ds_lead *ld, const qdot_xblock *xb, int64_t m, int64_t k, int num_segments,
               const int *fmts, const uint8_t *const *ws, const int64_t *row_bytes,
               const int64_t *ns, float *out, int64_t ldo) {
    lead_close(ld);
    __atomic_store_n(&ld->fn, (lead_item_fn)NULL, __ATOMIC_RELAXED);
    int64_t chunks = 0, off = 0;
    for (int s = 0; s < num_segments; s++) {
        lead_segment *g = &ld->seg[s];
        const int64_t panels = (ns[s] + LEAD_PANEL_ROWS - 1) / LEAD_PANEL_ROWS;
        g->fmt = fmts[s];
        g->w = ws[s];
        g->row_bytes = row_bytes[s];
        g->n = ns[s];
        g->out = out + off;
        g->chunk_panels = ld->chunk_bytes / (LEAD_PANEL_ROWS * row_bytes[s]);
        if (g->chunk_panels < 1) g->chunk_panels = 1;
        g->chunk0 = chunks;
        chunks += (panels + g->chunk_panels - 1) / g->chunk_panels;
        off += ns[s];
    }
    ld->num_segments = num_segments;
    ld->xb = xb;
    ld->m = m;
    ld->nb = k / 32;
    ld->ldo = ldo;
    lead_publish_and_run(ld, chunks);
}

void lead_head_soon(ds_lead *ld) {
    __atomic_store_n(&ld->head_soon, 1, __ATOMIC_SEQ_CST);
    lead_wake(ld);
}

void lead_layers_done(ds_lead *ld) {
    __atomic_store_n(&ld->ready, 1, __ATOMIC_SEQ_CST);
    lead_wake(ld);
}

void lead_help(ds_lead *ld) {
    uint32_t seen = 0; /* the last job id thread 1 looked at */
    for (;;) {
        /* Spin: through the head's wait unbounded, else spin_s past the last job. */
        double until = lead_now() + ld->spin_s;
        for (int i = 0;; i++) {
            if (__atomic_load_n(&ld->ready, __ATOMIC_ACQUIRE)) return;
            const uint32_t job =
                (uint32_t)(__atomic_load_n(&ld->word, __ATOMIC_ACQUIRE) >> 32);
            if (job != seen) {
                seen = job;
                lead_grab(ld, job, 1);
                until = lead_now() + ld->spin_s;
                continue;
            }
            if ((i & 63) == 63 && !__atomic_load_n(&ld->head_soon, __ATOMIC_ACQUIRE) &&
                lead_now() > until)
                break;
            lead_pause();
        }
        pthread_mutex_lock(&ld->lock);
        __atomic_store_n(&ld->sleeping, 1, __ATOMIC_SEQ_CST);
        while (!__atomic_load_n(&ld->ready, __ATOMIC_SEQ_CST) &&
               !__atomic_load_n(&ld->head_soon, __ATOMIC_SEQ_CST) &&
               (uint32_t)(__atomic_load_n(&ld->word, __ATOMIC_SEQ_CST) >> 32) == seen)
            pthread_cond_wait(&ld->cond, &ld->lock);
        __atomic_store_n(&ld->sleeping, 0, __ATOMIC_SEQ_CST);
        pthread_mutex_unlock(&ld->lock);
    }
}
