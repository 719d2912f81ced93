/* Read-bandwidth probe for docs/benchmarks.md ("Decode attention: one pass, prefetched").
 *
 *   cc -O3 -march=native -fopenmp read_bandwidth.c -o read_bandwidth
 *   ./read_bandwidth MB PIECE THREADS STREAMS SHUFFLE
 *
 * Sums a MB-megabyte buffer (madvise'd for huge pages) in PIECE-byte pieces: in order
 * (SHUFFLE 0) or in a random order (SHUFFLE 1, like a paged KV cache's blocks), STREAMS
 * pieces at a time read line by line in turn (1: one piece after another). Prints the
 * GB/s each thread read per second of its own CPU time (best of 7), which holds up on a
 * shared machine better than wall time.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double cpu_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: %s MB PIECE THREADS STREAMS SHUFFLE\n", argv[0]);
        return 2;
    }
    const size_t total = (size_t)atol(argv[1]) << 20;
    const int piece = atoi(argv[2]), threads = atoi(argv[3]), S = atoi(argv[4]);
    const int shuffle = atoi(argv[5]);
    if (S < 1 || S > 8 || piece % 64) return 2;
    char *buf = aligned_alloc(2 << 20, total);
    madvise(buf, total, MADV_HUGEPAGE);
    memset(buf, 1, total);
    const size_t n = total / piece;
    int64_t *order = malloc(n * sizeof *order);
    for (size_t i = 0; i < n; i++) order[i] = (int64_t)i;
    srand(1);
    for (size_t i = n - 1; shuffle && i > 0; i--) {
        const size_t j = (size_t)rand() % (i + 1);
        const int64_t t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
    float sink = 0.f;
    double best = 1e30;
    for (int rep = 0; rep < 7; rep++) {
        double worst = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : sink) reduction(max : worst)
        {
            const double c0 = cpu_s();
            __m512 a[8];
            for (int s = 0; s < 8; s++) a[s] = _mm512_setzero_ps();
            const int nt = omp_get_num_threads(), t = omp_get_thread_num();
            const size_t lo = n * t / nt, hi = n * (t + 1) / nt;
            for (size_t k = lo; k + S <= hi; k += S) {
                const char *p[8];
                for (int s = 0; s < S; s++) p[s] = buf + order[k + s] * piece;
                for (int i = 0; i < piece; i += 64)
                    for (int s = 0; s < S; s++)
                        a[s] = _mm512_add_ps(a[s], _mm512_load_ps((const float *)(p[s] + i)));
            }
            __m512 r = a[0];
            for (int s = 1; s < 8; s++) r = _mm512_add_ps(r, a[s]);
            sink += _mm512_reduce_add_ps(r);
            worst = cpu_s() - c0;
        }
        if (worst < best) best = worst;
    }
    printf("%zu MB, %d-byte pieces, %d thread(s), %d stream(s), %s: %.2f GB/s per thread\n",
           total >> 20, piece, threads, S, shuffle ? "shuffled" : "in order",
           (double)total / threads / best / 1e9);
    return sink == 12345.f;
}
