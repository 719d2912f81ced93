/* The weight streamer of lead steps (weight_stream.h): one thread per process, started
 * by the first lead step, never joined. Between steps it spins a short while for the
 * next (a burst's steps follow each other within microseconds), then sleeps on a
 * condition variable that the next ws_begin signals. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <string.h>
#include <time.h>

#include "weight_stream.h"

#define WS_MAX_REGIONS 4096
#define WS_CHUNK 4096             /* bytes prefetched between looks at the lead */
#define WS_SPIN_NS 200000         /* how long the streamer spins for the next step */

static inline void ws_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* What the lead hands over: the table under a sequence lock (gen odd while the lead
 * writes it; the streamer copies it and checks gen again), the lead's position. */
static struct {
    int64_t gen;
    ws_progress progress;
    int n;
    int64_t total, ahead;
    ws_region r[WS_MAX_REGIONS];
} shared;

static int held;     /* a lead step holds the streamer */
static int started;  /* 1: the thread runs; -1: it could not start */
static int sleeping; /* the streamer waits on `wake` */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;

static int64_t load(const int64_t *v) { return __atomic_load_n(v, __ATOMIC_ACQUIRE); }

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return 1e9 * (double)ts.tv_sec + (double)ts.tv_nsec;
}

/* The next even generation past `seen`: spun for, then slept for. */
static int64_t wait_step(int64_t seen) {
    const double until = now_ns() + WS_SPIN_NS;
    for (int spins = 0;; spins++) {
        const int64_t g = load(&shared.gen);
        if (g != seen && !(g & 1)) return g;
        ws_pause();
        if ((spins & 1023) == 1023 && now_ns() > until) break;
    }
    pthread_mutex_lock(&lock);
    __atomic_store_n(&sleeping, 1, __ATOMIC_SEQ_CST);
    int64_t g;
    while ((g = __atomic_load_n(&shared.gen, __ATOMIC_SEQ_CST)) == seen || (g & 1))
        pthread_cond_wait(&wake, &lock);
    __atomic_store_n(&sleeping, 0, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&lock);
    return g;
}

/* Prefetches [p, p + bytes), a line at a time. */
static void prefetch(const char *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 3);
}

/* One step's stream (generation g): ahead of the lead until it is done, then the
 * stream's first `ahead` bytes; returns early when a newer step begins. */
static void stream(const ws_region *r, int n, int64_t total, int64_t ahead, int64_t g) {
    int64_t pos = 0; /* past total: the stream's beginning again */
    int i = 0;       /* the region holding pos % total */
    for (;;) {
        if (load(&shared.gen) != g) return;
        const int64_t at = __atomic_load_n(&shared.progress.at, __ATOMIC_RELAXED);
        if (at == WS_DONE && pos < total) pos = total;
        if (at != WS_DONE && pos < at) pos = at;     /* no use reading behind the lead */
        if (pos >= total + ahead) return;
        if (at != WS_DONE && pos >= at + ahead) {
            for (int k = 0; k < 64; k++) ws_pause(); /* polled rarely: the lead owns the line */
            continue;
        }
        const int64_t q = pos < total ? pos : pos - total;
        if (q < r[i].start) i = 0;
        while (i + 1 < n && q >= r[i + 1].start) i++;
        int64_t len = r[i].start + r[i].bytes - q;
        if (len > WS_CHUNK) len = WS_CHUNK;
        if (len > 0)
            prefetch((const char *)r[i].data + (q - r[i].start), len);
        else
            len = 64; /* past a region's end (none: they are back to back) */
        pos += len;
    }
}

static void *streamer(void *unused) {
    (void)unused;
    static ws_region mine[WS_MAX_REGIONS];
    int64_t seen = 0;
    for (;;) {
        const int64_t g = wait_step(seen);
        const int n = shared.n;
        const int64_t total = shared.total, ahead = shared.ahead;
        if (n < 0 || n > WS_MAX_REGIONS) continue;
        memcpy(mine, shared.r, sizeof(ws_region) * (size_t)n);
        if (load(&shared.gen) != g) continue; /* rewritten while copied: the next one */
        seen = g;
        if (n > 0 && total > 0) stream(mine, n, total, ahead, g);
    }
    return NULL;
}

/* In a forked child the streamer thread is gone: the next lead step starts another. */
static void after_fork_child(void) {
    started = held = sleeping = 0;
    pthread_mutex_init(&lock, NULL);
    pthread_cond_init(&wake, NULL);
}

static int ensure_started(void) {
    const int s = __atomic_load_n(&started, __ATOMIC_ACQUIRE);
    if (s) return s > 0;
    static int fork_hook = 0;
    pthread_mutex_lock(&lock);
    if (!started) {
        if (!fork_hook) fork_hook = pthread_atfork(NULL, NULL, after_fork_child) == 0;
        pthread_attr_t attr;
        pthread_t t;
        int ok = pthread_attr_init(&attr) == 0;
        ok = ok && pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED) == 0;
        ok = ok && pthread_create(&t, &attr, streamer, NULL) == 0;
        __atomic_store_n(&started, ok ? 1 : -1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&lock);
    return started > 0;
}

ws_progress *ws_begin(const ws_region *r, int n, int64_t total, int64_t ahead) {
    if (n < 0 || n > WS_MAX_REGIONS) return NULL;
    if (__atomic_exchange_n(&held, 1, __ATOMIC_ACQUIRE)) return NULL;
    if (!ensure_started()) {
        __atomic_store_n(&held, 0, __ATOMIC_RELEASE);
        return NULL;
    }
    const int64_t g = shared.gen; /* only the holder writes it */
    __atomic_store_n(&shared.gen, g + 1, __ATOMIC_SEQ_CST);
    memcpy(shared.r, r, sizeof(ws_region) * (size_t)n);
    shared.n = n, shared.total = total, shared.ahead = ahead;
    __atomic_store_n(&shared.progress.at, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&shared.gen, g + 2, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&sleeping, __ATOMIC_SEQ_CST)) {
        pthread_mutex_lock(&lock);
        pthread_cond_signal(&wake);
        pthread_mutex_unlock(&lock);
    }
    return &shared.progress;
}

void ws_end(void) {
    __atomic_store_n(&shared.progress.at, WS_DONE, __ATOMIC_RELAXED);
    __atomic_store_n(&held, 0, __ATOMIC_RELEASE);
}
