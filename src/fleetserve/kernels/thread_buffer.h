/* A calling thread's buffer kept across calls (the OpenMP team's threads live as long as
 * the process): each user holds its own `_Thread_local` pointer and capacity and asks this
 * for at least `bytes`, 64-byte aligned; the old contents are not kept when it grows.
 * NULL when it cannot grow (the old buffer is kept then). */
#ifndef FLEETSERVE_THREAD_BUFFER_H
#define FLEETSERVE_THREAD_BUFFER_H

#include <stdlib.h>

static inline void *thread_buffer(void **buf, size_t *cap, size_t bytes) {
    if (bytes > *cap) {
        void *grown = aligned_alloc(64, (bytes + 63) / 64 * 64);
        if (!grown) return NULL;
        free(*buf);
        *buf = grown, *cap = bytes;
    }
    return *buf;
}

#endif
