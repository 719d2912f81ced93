/* A/B of two builds of the dot-layout kernels (quant_dot*.c), one process, alternating:
 * docs/benchmarks.md's section "Quantized GEMMs at 2-256 rows on Zen 4" (issue 25).
 *
 *   F="-O3 -march=native -ffast-math -fopenmp -fPIC -std=c11"
 *   cc $F -shared -o A.so BASE/quant_dot.c BASE/quant_dot_simd.c BASE/quant_dot_amx.c -lm
 *   cc $F -shared -o B.so src/fleetserve/kernels/quant_dot{,_simd,_amx}.c -lm
 *   cc -O2 -o quant_dot_ab src/fleetserve/bench/quant_dot_ab.c -ldl
 *   [KERNEL=1] [COPIES=40] [MINTIME=0.3] ./quant_dot_ab ./A.so ./B.so QTYPE N K ROWS...
 *
 * QTYPE 3 (Q4_1) or 8 (Q8_0); random weights of N x K (scales ~1e-3), x uniform in
 * [-1, 1]. Per row count: the two builds' outputs compared bit for bit, then each timed
 * (thread CPU time) 5 times, A, B, A, B, ..., medians reported. KERNEL=1 times the
 * panels alone on x quantized once (quant_dot_panels), else the whole quant_dot_gemm
 * (x quantized per call). COPIES=C rotates through C copies of the weights, so that
 * more than L3 holds streams from DRAM as in a served model (96 MB a token). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef void (*repack_fn)(int, const uint8_t *, int64_t, int64_t, uint8_t *, int);
typedef void (*quantize_fn)(const float *, int64_t, int64_t, int64_t, void *);
typedef void (*panels_fn)(int, const void *, int64_t, int64_t, const uint8_t *, int64_t, float *,
                          int64_t, int64_t, int64_t, int64_t);
typedef int (*gemm_fn)(int, const float *, int64_t, const uint8_t *, int64_t, float *, int64_t,
                       int64_t, int64_t, int64_t, int);

#define QDOT 0x100

static double thread_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static uint64_t rng_state = 88172645463325252ull;
static uint64_t next_random(void) { /* xorshift64 */
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

/* A small positive normal float as a half (truncated mantissa). */
static uint16_t to_half(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    const int e = (int)((b >> 23) & 255) - 127 + 15;
    if (e <= 0) return 0;
    return (uint16_t)((e << 10) | ((b >> 13) & 0x3ff));
}

static void *symbol(void *lib, const char *name) {
    void *f = dlsym(lib, name);
    if (!f) {
        fprintf(stderr, "%s: %s\n", name, dlerror());
        exit(1);
    }
    return f;
}

static int by_value(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc < 7) {
        fprintf(stderr, "usage: %s A.so B.so QTYPE(3|8) N K ROWS...\n", argv[0]);
        return 1;
    }
    void *lib[2] = {dlopen(argv[1], RTLD_NOW | RTLD_LOCAL), dlopen(argv[2], RTLD_NOW | RTLD_LOCAL)};
    if (!lib[0] || !lib[1]) {
        fprintf(stderr, "%s\n", dlerror());
        return 1;
    }
    repack_fn repack = (repack_fn)symbol(lib[0], "quant_dot_repack");
    quantize_fn quantize = (quantize_fn)symbol(lib[0], "quant_dot_quantize_x");
    gemm_fn gemm[2];
    panels_fn panels[2];
    for (int i = 0; i < 2; i++) {
        gemm[i] = (gemm_fn)symbol(lib[i], "quant_dot_gemm");
        panels[i] = (panels_fn)symbol(lib[i], "quant_dot_panels");
    }
    const int kernel_only = getenv("KERNEL") != NULL;
    const int copies = getenv("COPIES") ? atoi(getenv("COPIES")) : 1;
    const double min_time = getenv("MINTIME") ? atof(getenv("MINTIME")) : 0.2;
    const int qtype = atoi(argv[3]);
    if ((qtype != 3 && qtype != 8) || copies < 1) {
        fprintf(stderr, "QTYPE must be 3 (Q4_1) or 8 (Q8_0), COPIES >= 1\n");
        return 1;
    }
    const int fmt = qtype | QDOT;
    const int64_t n = atol(argv[4]), k = atol(argv[5]);
    const int64_t block_bytes = qtype == 8 ? 34 : 20, nb = k / 32, row_bytes = nb * block_bytes;
    const int64_t panels_n = (n + 15) / 16;
    /* GGUF rows: random quants, scales ~1e-3 (and Q4_1 mins ~ -1e-2). */
    uint8_t *gguf = malloc((size_t)(n * row_bytes));
    for (int64_t i = 0; i < n * row_bytes; i++) gguf[i] = (uint8_t)next_random();
    for (int64_t j = 0; j < n; j++) {
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *blk = gguf + j * row_bytes + b * block_bytes;
            const uint16_t d = to_half(0.001f + (float)(next_random() % 1000) * 1e-5f);
            memcpy(blk, &d, 2);
            if (qtype == 3) {
                const uint16_t m = to_half(0.01f + (float)(next_random() % 1000) * 1e-5f) | 0x8000;
                memcpy(blk + 2, &m, 2);
            }
        }
    }
    uint8_t **w = malloc((size_t)copies * sizeof *w);
    for (int c = 0; c < copies; c++) {
        w[c] = aligned_alloc(64, (size_t)(panels_n * 16 * row_bytes + 64));
        repack(fmt, gguf, n, row_bytes, w[c], 1);
    }
    for (int a = 6; a < argc; a++) {
        const int64_t m = atol(argv[a]);
        float *x = malloc((size_t)(m * k) * sizeof(float));
        float *out[2] = {malloc((size_t)(m * n) * sizeof(float)),
                         malloc((size_t)(m * n) * sizeof(float))};
        void *xq = aligned_alloc(64, (size_t)(m * nb * 64 + 64));
        for (int64_t i = 0; i < m * k; i++)
            x[i] = (float)((int)(next_random() % 20001) - 10000) * 1e-4f;
        quantize(x, k, m, k, xq);
        for (int i = 0; i < 2; i++) gemm[i](fmt, x, k, w[0], row_bytes, out[i], n, m, n, k, 1);
        const int same = memcmp(out[0], out[1], (size_t)(m * n) * sizeof(float)) == 0;
        double t[2][5];
        for (int rep = 0; rep < 5; rep++) {
            for (int i = 0; i < 2; i++) {
                long calls = 0;
                double elapsed;
                const double t0 = thread_seconds();
                do {
                    const uint8_t *wc = w[calls % copies];
                    if (kernel_only)
                        panels[i](fmt, xq, m, nb, wc, row_bytes, out[i], n, n, 0, panels_n);
                    else
                        gemm[i](fmt, x, k, wc, row_bytes, out[i], n, m, n, k, 1);
                    calls++;
                } while ((elapsed = thread_seconds() - t0) < min_time / 5 || calls < 3);
                t[i][rep] = elapsed / (double)calls;
            }
        }
        qsort(t[0], 5, sizeof(double), by_value);
        qsort(t[1], 5, sizeof(double), by_value);
        const double flops = 2.0 * (double)(m * n * k), bytes = (double)(n * row_bytes);
        printf("%s %6ldx%-5ld m=%3ld  A %7.1f GF/s %5.1f GB/s %8.1f us | B %7.1f GF/s %8.1f us"
               " | B/A %.3f %s\n",
               qtype == 8 ? "Q8_0" : "Q4_1", (long)n, (long)k, (long)m, flops / t[0][2] / 1e9,
               bytes / t[0][2] / 1e9, t[0][2] * 1e6, flops / t[1][2] / 1e9, t[1][2] * 1e6,
               t[0][2] / t[1][2], same ? "bits=" : "BITS DIFFER");
        fflush(stdout);
        free(xq);
        free(x);
        free(out[0]);
        free(out[1]);
    }
    return 0;
}
