/* A lead step's second thread (kernels/decode_step.c, lead_step): asleep while the first
 * runs the layers, it takes chunks of the shared projections' weight rows (the plan's
 * lead_share, then the LM head's) from a counter both threads grab from, and stays awake
 * from the last layer's start until the layers end.
 *
 * Why work stealing and not a split: thread 0 never waits for thread 1 to start a GEMV,
 * only for the chunks thread 1 took, so a preempted thread 1 costs at most the chunk it
 * holds (a guided grab: at most a quarter of what was left) and a GEMV runs at one
 * core's speed when thread 1 is off the CPU. Every weight row is a whole dot product by
 * quant_dot_panels, whichever thread takes it: the bits are the team's.
 *
 * A job is either a GEMV (lead_gemv: chunks of weight rows) or a list of items
 * (lead_items: a function called on item indices, one a grab: a lead step of several
 * rows' attention items and, opt-in, each row's heads; each a few to ~20 microseconds,
 * so a preempted thread 1 holds at most one).
 *
 * Sync per shared GEMV: thread 0 publishes the job (one store of `word`, a futex wake
 * only when thread 1 sleeps) and waits for `done` to reach the job's chunks; thread 1
 * spins ~lead_spin_us after a job (the next shared GEMV often follows within
 * microseconds), then sleeps on the condition variable.
 *
 * Two ends: thread 0 grabs a job's chunks from the front, thread 1 from the back, so the
 * rows thread 1 will multiply are known before the job starts: the tail of each coming
 * shared GEMV. While thread 0 runs what it does not share (the rows' norms, qkv,
 * attention, o: ~35% of a one-row step), thread 1 reads those tails into its own cache
 * (lead_prefetch: regions thread 0 posts), so a step streams from both cores' memory
 * paths where it had one most of the time. The reads are loads of weights the step
 * holds, never a write, and thread 0 waits for none of them. */
#ifndef FLEETSERVE_LEAD_SHARE_H
#define FLEETSERVE_LEAD_SHARE_H

#include <pthread.h>
#include <stdint.h>

#include "quant_dot.h"

#define LEAD_MAX_SEGMENTS 3
#define LEAD_MAX_REGIONS 8

/* Bytes thread 1 reads ahead into its cache (lead_prefetch). */
typedef struct {
    const uint8_t *p;
    int64_t bytes;
} lead_region;

/* One segment of a shared projection: n weight rows in the dot layout `fmt` into out. */
typedef struct {
    int fmt;
    const uint8_t *w;
    int64_t row_bytes, n;
    float *out;
    int64_t chunk_panels, chunk0; /* panels per chunk; the segment's first chunk */
} lead_segment;

/* An items job's work: item `item` by thread `tid` (0 or 1; its own scratch). */
typedef void (*lead_item_fn)(void *ctx, int64_t item, int tid);

typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int sleeping;  /* thread 1 is (about to be) in cond_wait */
    int head_soon; /* the last layer started: thread 1 spins until `ready` */
    int ready;     /* the layers are done (the head may start) */
    /* The job: (job id << 48) | (front << 24) | back, the chunks [front, back) not yet
     * grabbed. Thread 0 writes the fields below, then publishes a new id; chunks are
     * grabbed by compare-and-swap, thread 0's from the front, thread 1's from the back. */
    uint64_t word;
    int64_t done, chunks; /* chunks multiplied in this job; the job's chunks */
    const qdot_xblock *xb;
    int64_t m, nb, ldo;
    int num_segments;
    lead_segment seg[LEAD_MAX_SEGMENTS];
    lead_item_fn fn; /* an items job's (NULL: a GEMV) */
    void *ctx;
    double spin_s;       /* thread 1's spin after a job before it sleeps */
    /* Weight bytes per chunk: a grab takes whole chunks (a run of consecutive panels,
     * one weight stream), a quarter of those left, so a late thread still finds work
     * and a preempted one holds at most that quarter. */
    int64_t chunk_bytes;
    /* [4] chunks taken by thread 0 and 1, then items taken by thread 0 and 1 (NULL: not
     * counted) */
    int64_t *counts;
    /* Seconds thread 0 waited for chunks or items thread 1 held (a preempted thread 1
     * shows here: lead_step then runs the next one-row steps on one thread). */
    double waited;
    /* lead_prefetch's regions, under a sequence lock (odd: being written) so that
     * thread 1 never reads a torn pointer. */
    uint32_t hint_seq;
    int num_hints;
    lead_region hint[LEAD_MAX_REGIONS];
} ds_lead;

void lead_init(ds_lead *ld, double spin_s, int64_t chunk_bytes, int64_t *counts);
void lead_destroy(ds_lead *ld);
/* Thread 0: out = x @ W^T over the segments, thread 1 helping if it comes. */
void lead_gemv(ds_lead *ld, const qdot_xblock *xb, int64_t m, int64_t k, int num_segments,
               const int *fmts, const uint8_t *const *ws, const int64_t *row_bytes,
               const int64_t *ns, float *out, int64_t ldo);
/* Thread 0: fn(ctx, i, tid) for i in [0, items), thread 1 taking items if it comes;
 * returns when every item is done. */
void lead_items(ds_lead *ld, int64_t items, lead_item_fn fn, void *ctx);
/* Thread 0: the regions thread 1 reads into its cache, in order, while no job is open
 * (replacing those posted before; a job arriving abandons the region being read). */
void lead_prefetch(ds_lead *ld, int num_regions, const lead_region *regions);
/* Thread 0: the last layer starts (thread 1 stays awake for the head); the layers end. */
void lead_head_soon(ds_lead *ld);
void lead_layers_done(ds_lead *ld);
/* Thread 1: help with every job until the layers are done. */
void lead_help(ds_lead *ld);

#endif
