/* A/B of two builds of the bf16 GEMMs (gemm_bf16.c + gemm_bf16_tiled.c), one process,
 * alternating: docs/benchmarks.md's section "bf16 GEMMs at 2 threads" (issue 25).
 *
 *   F="-O3 -march=native -ffast-math -fopenmp -fPIC -std=c11"
 *   cc $F -shared -o A.so BASE/gemm_bf16.c BASE/gemm_bf16_tiled.c
 *   cc $F -shared -o B.so src/fleetserve/kernels/gemm_bf16.c src/fleetserve/kernels/gemm_bf16_tiled.c
 *   cc -O2 -fopenmp -o bf16_ab src/fleetserve/bench/bf16_ab.c -ldl
 *   OMP_WAIT_POLICY=passive ./bf16_ab ./A.so ./B.so THREADS ROUNDS MxNxK[,COPIES] ...
 *
 * Per shape: random x (uniform in [-0.5, 0.5]) and COPIES weights of N x K (default 1;
 * more than L3 holds streams from DRAM as a decode step does), each build's
 * gemm_bf16_share run by a team of THREADS ~2 GFLOP at a time, A, B, A, B, ... ROUNDS
 * times; reported, best of the rounds: the critical path (the busiest thread's CPU time
 * inside the share, ms a call: with passive waiting a thread that waits at a barrier
 * sleeps, so this is the team's slowest share, and other processes' load does not enter)
 * and the sum over the team; then whether the two builds' outputs are the same bits. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int (*share_fn)(const float *, int64_t, const uint16_t *, const float *, float *, int64_t,
                        int64_t, int64_t, int64_t);

static double thread_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static float uniform(void) { return (float)rand() / (float)RAND_MAX - 0.5f; }

int main(int argc, char **argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: %s A.so B.so THREADS ROUNDS MxNxK[,COPIES] ...\n", argv[0]);
        return 2;
    }
    share_fn fn[2];
    for (int l = 0; l < 2; l++) {
        void *h = dlopen(argv[1 + l], RTLD_NOW | RTLD_LOCAL);
        if (!h || !(fn[l] = (share_fn)dlsym(h, "gemm_bf16_share"))) {
            fprintf(stderr, "%s: %s\n", argv[1 + l], dlerror());
            return 1;
        }
    }
    const int threads = atoi(argv[3]), rounds = atoi(argv[4]);
    if (threads < 1 || threads > 64 || rounds < 1) {
        fprintf(stderr, "THREADS must be 1-64 and ROUNDS at least 1\n");
        return 2;
    }
    srand(1);
    for (int a = 5; a < argc; a++) {
        long m, n, k, copies = 1;
        if (sscanf(argv[a], "%ldx%ldx%ld,%ld", &m, &n, &k, &copies) < 3 || m < 1 || n < 1 ||
            k < 1 || copies < 1) {
            fprintf(stderr, "bad shape %s (MxNxK[,COPIES])\n", argv[a]);
            return 2;
        }
        float *x = malloc(sizeof(float) * m * k);
        for (long i = 0; i < m * k; i++) x[i] = uniform();
        uint16_t **w = malloc(sizeof(uint16_t *) * copies);
        for (long c = 0; c < copies; c++) {
            w[c] = aligned_alloc(64, (n * k * 2 + 63) / 64 * 64);
            for (long i = 0; i < n * k; i++) w[c][i] = to_bf16(uniform());
        }
        float *out[2];
        for (int l = 0; l < 2; l++) out[l] = aligned_alloc(64, (sizeof(float) * m * n + 63) / 64 * 64);
        int reps = (int)(2e9 / (2.0 * m * n * k)) + 1;
        if (reps < copies) reps = (int)copies;
        double best_path[2] = {1e30, 1e30}, best_sum[2] = {1e30, 1e30};
        for (int r = 0; r < rounds; r++)
            for (int l = 0; l < 2; l++) {
                double cpu[64] = {0};
#pragma omp parallel num_threads(threads)
                {
                    double t = 0;
                    for (int i = 0; i < reps; i++) {
                        const double t0 = thread_seconds();
                        fn[l](x, k, w[i % copies], NULL, out[l], n, m, n, k);
                        t += thread_seconds() - t0;
                    }
                    cpu[omp_get_thread_num()] = t;
                }
                double path = 0, sum = 0;
                for (int t = 0; t < threads; t++) path = cpu[t] > path ? cpu[t] : path, sum += cpu[t];
                if (path / reps < best_path[l]) best_path[l] = path / reps;
                if (sum / reps < best_sum[l]) best_sum[l] = sum / reps;
            }
        const double gflop = 2.0 * m * n * k * 1e-9;
        printf("%ld x %ld x %ld, %d threads: A %.3f ms (%.0f GFLOP/s, team %.3f) | B %.3f ms "
               "(%.0f GFLOP/s, team %.3f) | B/A %+.1f%% | %s\n",
               m, n, k, threads, best_path[0] * 1e3, gflop / best_path[0], best_sum[0] * 1e3,
               best_path[1] * 1e3, gflop / best_path[1], best_sum[1] * 1e3,
               (best_path[1] / best_path[0] - 1) * 100,
               memcmp(out[0], out[1], sizeof(float) * m * n) ? "OUTPUTS DIFFER" : "same bits");
        fflush(stdout);
        for (long c = 0; c < copies; c++) free(w[c]);
        free(w), free(x), free(out[0]), free(out[1]);
    }
    return 0;
}
