/* Throughput of the instructions the integer dot kernels (kernels/quant_dot_simd.c) are
 * made of, alone and mixed, on this core: docs/benchmarks.md's section "Quantized GEMMs
 * at 2-256 rows on Zen 4" (issue 25).
 *
 *   cc -O2 -march=native -o vnni_peak src/fleetserve/bench/vnni_peak.c && ./vnni_peak
 *
 * Each line runs one asm loop body 10 million times on independent registers (no
 * dependency between iterations except where named) and prints nanoseconds per body
 * (thread CPU time) and instructions per nanosecond; the last line, a chain of dependent
 * adds, gives the clock. A mix that takes as long as its vpdpbusd alone runs on other
 * pipes; one that takes the sum shares them. */
#include <stdint.h>
#include <stdio.h>
#include <time.h>

#define ITERS 10000000L

static int32_t xs[64] __attribute__((aligned(64)));

static double thread_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

#define RUN(body, name, ops)                                                              \
    do {                                                                                  \
        long n_ = ITERS;                                                                  \
        const double t0_ = thread_seconds();                                              \
        __asm__ volatile("1:\n" body "dec %0\n jnz 1b\n" : "+r"(n_) : "r"(xs) : "memory"); \
        const double t_ = thread_seconds() - t0_;                                         \
        printf("%-34s %6.2f ns/body %6.2f ops/ns\n", name, t_ / ITERS * 1e9,               \
               (ops) * ITERS / t_ / 1e9);                                                 \
    } while (0)

#define DP(r) "vpdpbusd %%zmm30, %%zmm31, %%zmm" #r "\n"
#define DP8 DP(0) DP(1) DP(2) DP(3) DP(4) DP(5) DP(6) DP(7)
#define DPM(r, off) "vpdpbusd " #off "(%1)%{1to16%}, %%zmm31, %%zmm" #r "\n"
#define FMA(r) "vfmadd231ps %%zmm30, %%zmm31, %%zmm" #r "\n"

int main(void) {
    __asm__ volatile("vpxord %%zmm30, %%zmm30, %%zmm30\n vpxord %%zmm31, %%zmm31, %%zmm31\n" :::);
    RUN(DP8 DP(8) DP(9) DP(10) DP(11), "12 vpdpbusd zmm", 12);
#define DPY(r) "vpdpbusd %%ymm30, %%ymm31, %%ymm" #r "\n"
    RUN(DPY(0) DPY(1) DPY(2) DPY(3) DPY(4) DPY(5) DPY(6) DPY(7), "8 vpdpbusd ymm", 8);
    RUN(FMA(12) FMA(13) FMA(14) FMA(15) FMA(16) FMA(17) FMA(18) FMA(19), "8 vfmadd zmm", 8);
    RUN(DPM(0, 0) DPM(1, 4) DPM(2, 8) DPM(3, 12) DPM(4, 16) DPM(5, 20) DPM(6, 24) DPM(7, 28),
        "8 vpdpbusd {1to16} from memory", 8);
    RUN(DP8 "vpbroadcastd (%1), %%zmm20\n vpbroadcastd 4(%1), %%zmm21\n"
            "vpbroadcastd 8(%1), %%zmm22\n vpbroadcastd 12(%1), %%zmm23\n",
        "8 vpdpbusd + 4 vpbroadcastd", 12);
    RUN(DP8 FMA(12) FMA(13) FMA(14) FMA(15), "8 vpdpbusd + 4 vfmadd", 12);
    RUN(DP8 "vcvtdq2ps %%zmm8, %%zmm12\n vmulps %%zmm30, %%zmm31, %%zmm13\n" FMA(14) FMA(15),
        "8 vpdpbusd + cvt, mul, 2 fma", 12);
    RUN(DP8 "vcvtdq2ps %%zmm8, %%zmm12\n vcvtdq2ps %%zmm9, %%zmm13\n"
            "vcvtdq2ps %%zmm10, %%zmm14\n vcvtdq2ps %%zmm11, %%zmm15\n",
        "8 vpdpbusd + 4 vcvtdq2ps", 12);
    RUN(DP8 "vpandd %%zmm30, %%zmm31, %%zmm12\n vpsrlw $4, %%zmm31, %%zmm13\n"
            "vpandd %%zmm30, %%zmm31, %%zmm14\n vpsrlw $4, %%zmm31, %%zmm15\n",
        "8 vpdpbusd + 2 vpandd, 2 vpsrlw", 12);
    RUN(DP8 "vpxord %%zmm30, %%zmm31, %%zmm12\n vpxord %%zmm30, %%zmm31, %%zmm13\n"
            "vpsubd %%zmm30, %%zmm31, %%zmm14\n vpsubd %%zmm30, %%zmm31, %%zmm15\n",
        "8 vpdpbusd + 2 vpxord, 2 vpsubd", 12);
    RUN("vpdpbusd %%zmm30, %%zmm31, %%zmm0\n vpdpbusd %%zmm30, %%zmm31, %%zmm0\n",
        "2 dependent vpdpbusd (latency)", 2);
    RUN("add $1, %%rax\n add $1, %%rax\n add $1, %%rax\n add $1, %%rax\n",
        "4 dependent add (the clock)", 4);
    return 0;
}
