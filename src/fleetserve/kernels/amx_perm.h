/* Whether this process may use AMX tiles (AMX-BF16 in gemm_bf16.c, AMX-INT8 in
 * quant_dot_amx.c). Linux hands out the tile state only on request: the first call asks
 * for it (arch_prctl ARCH_REQ_XCOMP_PERM); FLEETSERVE_AMX=0 refuses it without asking, so
 * the callers keep their AVX-512 kernels. The answer is kept per including source (a
 * static inline: each kernel asks once; asking twice is harmless). The including source
 * defines _GNU_SOURCE before its first include (syscall). */
#ifndef FLEETSERVE_AMX_PERM_H
#define FLEETSERVE_AMX_PERM_H

#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static inline int amx_permitted(void) {
    static int state; /* 0: not asked yet, 1: yes, -1: no */
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (s == 0) {
        const char *env = getenv("FLEETSERVE_AMX");
        if (env && env[0] == '0')
            s = -1;
        else
            s = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        __atomic_store_n(&state, s, __ATOMIC_RELEASE);
    }
    return s == 1;
}

#endif
