/* The read bandwidth of the cores a step runs on: the roofline's denominator.
 *
 * A streaming read of a buffer, split evenly over `threads` OpenMP threads (each its own
 * contiguous part, as the step's GEMM shares split weight rows), with 64-byte loads (AVX-512
 * where the build has it) into eight independent accumulators per thread, so neither the
 * adds nor a dependency chain bound the loop: only the loads do. The buffer is written
 * first by the same threads (first touch: each thread's part is faulted in where it runs),
 * then read `reps` times; the best pass counts (a shared machine only ever slows a pass).
 *
 * Two sizes answer two questions: a buffer several times the last-level cache is what
 * DRAM gives; a buffer the size of the bytes a token reads, read over and over, is what a
 * decode step that streams its ~100 MB every few milliseconds can get when part of it
 * stays in a large L3 (the step's own working set).
 */
#define _GNU_SOURCE /* madvise, MADV_HUGEPAGE */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* Sum of n floats (n a multiple of 128) with eight 16-float accumulators. */
static float sum_span(const float *x, int64_t n) {
#if defined(__AVX512F__)
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
           a7 = a0;
    for (int64_t i = 0; i < n; i += 128) {
        a0 = _mm512_add_ps(a0, _mm512_load_ps(x + i));
        a1 = _mm512_add_ps(a1, _mm512_load_ps(x + i + 16));
        a2 = _mm512_add_ps(a2, _mm512_load_ps(x + i + 32));
        a3 = _mm512_add_ps(a3, _mm512_load_ps(x + i + 48));
        a4 = _mm512_add_ps(a4, _mm512_load_ps(x + i + 64));
        a5 = _mm512_add_ps(a5, _mm512_load_ps(x + i + 80));
        a6 = _mm512_add_ps(a6, _mm512_load_ps(x + i + 96));
        a7 = _mm512_add_ps(a7, _mm512_load_ps(x + i + 112));
    }
    a0 = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
    a4 = _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7));
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a4));
#else
    float acc[16] = {0};
    for (int64_t i = 0; i < n; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += x[i + j];
    float s = 0.f;
    for (int j = 0; j < 16; j++) s += acc[j];
    return s;
#endif
}

/* Whether the loads are AVX-512 (1) or the compiler's own vectors of a plain loop (0). */
int read_probe_avx512(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

static double thread_cpu_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Reads `bytes` (rounded down to 512 per thread) `reps` times on `threads` threads after
 * one warm pass; best[0] the best pass's wall seconds, best[1] the median's (reps <= 64),
 * best[2] the best pass's CPU seconds of its slowest thread (time a preempted thread
 * spent off its core left out: on a loaded machine the figure to hold a step's CPU time
 * per token against; past one thread it assumes the threads ran at the same time), and
 * returns the bytes one pass reads (-1: out of memory). `huge`: the buffer on 2 MiB
 * transparent huge pages (madvise) as the step's weights are (kernels/huge_pages.py),
 * else on 4 KiB pages. */
int64_t read_probe(int64_t bytes, int threads, int reps, int huge, double *best) {
    if (threads < 1) threads = 1;
    if (reps < 1) reps = 1;
    if (reps > 64) reps = 64;
    const int64_t per = bytes / threads / 512 * 128; /* floats per thread */
    if (per < 128) return -1;
    const size_t page = (size_t)2 << 20, len = (size_t)(per * threads) * sizeof(float);
    float *buf = aligned_alloc(page, (len + page - 1) / page * page);
    if (!buf) return -1;
#ifdef MADV_HUGEPAGE
    if (huge) madvise(buf, (len + page - 1) / page * page, MADV_HUGEPAGE);
#else
    (void)huge;
#endif
    double secs[64], cpu[64] = {0};
    volatile float sink = 0.f;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num();
        float *mine = buf + (int64_t)t * per;
        for (int64_t i = 0; i < per; i++) mine[i] = (float)(i & 7) * 0.125f;
        float s = sum_span(mine, per); /* warm pass */
        for (int r = 0; r < reps; r++) {
#pragma omp barrier
            double t0 = 0.0;
#pragma omp master
            t0 = omp_get_wtime();
            const double c0 = thread_cpu_seconds();
            s += sum_span(mine, per);
            const double c1 = thread_cpu_seconds() - c0;
#pragma omp critical
            cpu[r] = c1 > cpu[r] ? c1 : cpu[r];
#pragma omp barrier
#pragma omp master
            secs[r] = omp_get_wtime() - t0;
        }
#pragma omp critical
        sink += s;
    }
    (void)sink;
    free(buf);
    double lo = secs[0], cpu_lo = cpu[0];
    for (int r = 1; r < reps; r++) {
        lo = secs[r] < lo ? secs[r] : lo;
        cpu_lo = cpu[r] < cpu_lo ? cpu[r] : cpu_lo;
    }
    /* median by insertion sort: reps is small */
    for (int i = 1; i < reps; i++) {
        const double v = secs[i];
        int j = i - 1;
        while (j >= 0 && secs[j] > v) {
            secs[j + 1] = secs[j];
            j--;
        }
        secs[j + 1] = v;
    }
    best[0] = lo;
    best[2] = cpu_lo;
    best[1] = reps % 2 ? secs[reps / 2] : 0.5 * (secs[reps / 2 - 1] + secs[reps / 2]);
    return per * threads * (int64_t)sizeof(float);
}
