/* A thread that streams a step's weights from memory into the shared L3 a bounded
 * distance ahead of the thread computing the step (decode_step.c's lead steps).
 *
 * Why: one stream's decode step on a small model reads ~100 MB a token, bound by
 * memory. One core alone already pulls ~96% of what two cores read, so splitting each
 * GEMV over two threads buys little bandwidth and costs ~150 barriers a token. Here one
 * thread (the lead) computes the whole step as a team of one, with no barrier, and the
 * streamer only prefetches ahead of it: the lead's weight reads hit the L3 (filled from
 * the streamer's L2 as its lines age out) while memory serves both cores' misses.
 *
 * The weights form one stream, in the order the step reads them: regions [start,
 * start + bytes) of it, back to back. The lead publishes its position in the stream
 * (ws_publish, a byte offset); the streamer prefetches the lines at its own position
 * while that is less than `ahead` bytes past the lead's, skips forward when the lead
 * passes it, and once the lead is done prefetches the stream's first `ahead` bytes
 * again (the next step's first layers). The streamer only prefetches (an instruction that
 * never faults and writes nothing): a late streamer, one reading weights freed since,
 * or none at all cannot change a result or stall the lead, which never waits for it.
 */
#ifndef FLEETSERVE_WEIGHT_STREAM_H
#define FLEETSERVE_WEIGHT_STREAM_H

#include <stdint.h>

#define WS_DONE INT64_MAX

typedef struct {
    const void *data;
    int64_t bytes, start; /* its place in the stream */
} ws_region;

typedef struct {
    int64_t at; /* the lead's stream position; WS_DONE (atomic: __atomic_* builtins) */
} ws_progress;

/* The lead's position (p NULL: no streamer). */
static inline void ws_publish(ws_progress *p, int64_t at) {
    if (p) __atomic_store_n(&p->at, at, __ATOMIC_RELAXED);
}

/* weight_stream.c. ws_begin hands the streamer this step's regions (ascending starts,
 * `total` bytes) and returns where to publish, or NULL when there is no streamer for it
 * (another step holds it, more regions than it takes, or no thread could start);
 * ws_end tells the streamer the step is done and lets it go. */
ws_progress *ws_begin(const ws_region *r, int n, int64_t total, int64_t ahead);
void ws_end(void);

#endif
