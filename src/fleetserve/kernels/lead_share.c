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
    ld->hint_seq = 0;
    ld->num_hints = 0;
    ld->waited = 0.0;
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

/* `word`'s fields: the job id (16 bits: ids are counted from 0 in each step, ~150 jobs
 * a step), the first and one past the last chunk not yet grabbed (24 bits each). */
#define LEAD_END_BITS 24
#define LEAD_END_MASK ((UINT64_C(1) << LEAD_END_BITS) - 1)
#define LEAD_MAX_CHUNKS ((int64_t)LEAD_END_MASK)

static inline uint32_t lead_job(uint64_t w) { return (uint32_t)(w >> (2 * LEAD_END_BITS)); }

/* Grab and multiply chunks of job `job` until none is left: thread 0 from the front,
 * thread 1 from the back. A successful swap of `word` means the job was still open, so
 * its fields (written before its id was published, rewritten only after every chunk is
 * done) are this job's. */
static void lead_grab(ds_lead *ld, uint32_t job, int tid) {
    for (;;) {
        uint64_t w = __atomic_load_n(&ld->word, __ATOMIC_ACQUIRE);
        if (lead_job(w) != job) return;
        const int64_t front = (int64_t)(w >> LEAD_END_BITS & LEAD_END_MASK);
        const int64_t back = (int64_t)(w & LEAD_END_MASK);
        if (front >= back) return;
        const lead_item_fn fn = __atomic_load_n(&ld->fn, __ATOMIC_RELAXED);
        int64_t take = fn ? 1 : (back - front) / 4;
        if (take < 1) take = 1;
        const uint64_t nw = tid == 0 ? w + ((uint64_t)take << LEAD_END_BITS) : w - (uint64_t)take;
        if (!__atomic_compare_exchange_n(&ld->word, &w, nw, 0, __ATOMIC_ACQ_REL,
                                         __ATOMIC_ACQUIRE))
            continue;
        const int64_t c0 = tid == 0 ? front : back - take;
        lead_run(ld, c0, c0 + take, tid);
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
    __atomic_store_n(&ld->word, (uint64_t)lead_job(last) << (2 * LEAD_END_BITS),
                     __ATOMIC_SEQ_CST);
}

/* Publish the job whose fields were just written (`chunks` of them, at most
 * LEAD_MAX_CHUNKS), take chunks of it, and wait for those thread 1 took: never for
 * thread 1 to start. */
static void lead_publish_and_run(ds_lead *ld, int64_t chunks) {
    __atomic_store_n(&ld->chunks, chunks, __ATOMIC_RELAXED);
    __atomic_store_n(&ld->done, 0, __ATOMIC_RELAXED);
    const uint32_t job = (lead_job(__atomic_load_n(&ld->word, __ATOMIC_RELAXED)) + 1) & 0xffffu;
    __atomic_store_n(&ld->word, (uint64_t)job << (2 * LEAD_END_BITS) | (uint64_t)chunks,
                     __ATOMIC_SEQ_CST);
    lead_wake(ld);
    lead_grab(ld, job, 0);
    if (__atomic_load_n(&ld->done, __ATOMIC_ACQUIRE) < chunks) {
        const double t0 = lead_now();
        while (__atomic_load_n(&ld->done, __ATOMIC_ACQUIRE) < chunks) lead_pause();
        ld->waited += lead_now() - t0;
    }
}

void lead_items(ds_lead *ld, int64_t items, lead_item_fn fn, void *ctx) {
    if (items > LEAD_MAX_CHUNKS) { /* never on a lead step's few rows: thread 0 alone */
        for (int64_t i = 0; i < items; i++) fn(ctx, i, 0);
        return;
    }
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
    /* grow: chunks made larger until they fit in `word` (never at a 135M model's sizes) */
    int64_t chunks = 0, grow = 1;
    for (;; grow *= 2) {
        chunks = 0;
        int64_t off = 0;
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
            g->chunk_panels *= grow;
            g->chunk0 = chunks;
            chunks += (panels + g->chunk_panels - 1) / g->chunk_panels;
            off += ns[s];
        }
        if (chunks <= LEAD_MAX_CHUNKS) break;
    }
    ld->num_segments = num_segments;
    ld->xb = xb;
    ld->m = m;
    ld->nb = k / 32;
    ld->ldo = ldo;
    lead_publish_and_run(ld, chunks);
}

void lead_prefetch(ds_lead *ld, int num_regions, const lead_region *regions) {
    if (num_regions > LEAD_MAX_REGIONS) num_regions = LEAD_MAX_REGIONS;
    const uint32_t seq = __atomic_load_n(&ld->hint_seq, __ATOMIC_RELAXED);
    __atomic_store_n(&ld->hint_seq, seq + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    for (int i = 0; i < num_regions; i++) {
        __atomic_store_n(&ld->hint[i].p, regions[i].p, __ATOMIC_RELAXED);
        __atomic_store_n(&ld->hint[i].bytes, regions[i].bytes, __ATOMIC_RELAXED);
    }
    __atomic_store_n(&ld->num_hints, num_regions, __ATOMIC_RELAXED);
    __atomic_store_n(&ld->hint_seq, seq + 2, __ATOMIC_RELEASE);
}

void lead_head_soon(ds_lead *ld) {
    __atomic_store_n(&ld->head_soon, 1, __ATOMIC_SEQ_CST);
    lead_wake(ld);
}

void lead_layers_done(ds_lead *ld) {
    __atomic_store_n(&ld->ready, 1, __ATOMIC_SEQ_CST);
    lead_wake(ld);
}

/* Thread 1's copy of the posted regions: region `at`, `off` bytes into it, read next. */
typedef struct {
    uint32_t seq;
    int n, at;
    int64_t off;
    lead_region r[LEAD_MAX_REGIONS];
} lead_reader;

/* Take newly posted regions (a sequence lock's reader: a copy torn by thread 0 posting
 * again is dropped). Returns 1 when it took some. */
static int lead_read_hints(ds_lead *ld, lead_reader *pf) {
    const uint32_t s1 = __atomic_load_n(&ld->hint_seq, __ATOMIC_ACQUIRE);
    if (s1 == pf->seq || (s1 & 1)) return 0;
    int n = __atomic_load_n(&ld->num_hints, __ATOMIC_RELAXED);
    if (n > LEAD_MAX_REGIONS) n = LEAD_MAX_REGIONS;
    lead_region r[LEAD_MAX_REGIONS];
    for (int i = 0; i < n; i++) {
        r[i].p = __atomic_load_n(&ld->hint[i].p, __ATOMIC_RELAXED);
        r[i].bytes = __atomic_load_n(&ld->hint[i].bytes, __ATOMIC_RELAXED);
    }
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (__atomic_load_n(&ld->hint_seq, __ATOMIC_RELAXED) != s1) return 0;
    pf->seq = s1;
    pf->n = n;
    pf->at = 0;
    pf->off = 0;
    for (int i = 0; i < n; i++) pf->r[i] = r[i];
    return 1;
}

/* Read the next 4 KB of the current region (a load a cache line, independent of each
 * other: the core keeps as many misses in flight as it can, as the read probe does). */
static void lead_touch(lead_reader *pf) {
    enum { STEP = 4096, LINE = 64 };
    const lead_region *g = &pf->r[pf->at];
    int64_t end = pf->off + STEP;
    if (end > g->bytes) end = g->bytes;
    uint64_t acc = 0;
    for (int64_t o = pf->off; o < end; o += LINE) acc ^= *(const volatile uint64_t *)(g->p + o);
    __asm__ volatile("" : : "r"(acc));
    pf->off = end;
    if (end >= g->bytes) {
        pf->at++;
        pf->off = 0;
    }
}

void lead_help(ds_lead *ld) {
    uint32_t seen = 0; /* the last job id thread 1 looked at */
    lead_reader pf = {0, 0, 0, 0, {{NULL, 0}}};
    for (;;) {
        /* Spin: through the head's wait unbounded, else spin_s past the last job. */
        double until = lead_now() + ld->spin_s;
        for (int i = 0;; i++) {
            if (__atomic_load_n(&ld->ready, __ATOMIC_ACQUIRE)) return;
            const uint32_t job = lead_job(__atomic_load_n(&ld->word, __ATOMIC_ACQUIRE));
            if (job != seen) {
                seen = job;
                /* A region begun is this job's tail: what is left of it is late. */
                if (pf.at < pf.n && pf.off > 0) {
                    pf.at++;
                    pf.off = 0;
                }
                lead_grab(ld, job, 1);
                until = lead_now() + ld->spin_s;
                continue;
            }
            if (lead_read_hints(ld, &pf) || pf.at < pf.n) {
                lead_touch(&pf);
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
               lead_job(__atomic_load_n(&ld->word, __ATOMIC_SEQ_CST)) == seen)
            pthread_cond_wait(&ld->cond, &ld->lock);
        __atomic_store_n(&ld->sleeping, 0, __ATOMIC_SEQ_CST);
        pthread_mutex_unlock(&ld->lock);
    }
}
