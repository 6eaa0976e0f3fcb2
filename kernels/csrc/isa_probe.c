/* What the CPU and the operating system let this process run, asked at load time.
 *
 * Compiled into every variant, but kernels/cpu_native.py calls it from the baseline library
 * (built for plain x86-64, so the probe itself never executes an instruction the CPU may lack).
 * An instruction set counts only if the CPU lists it (cpuid) AND the OS saves its registers on a
 * context switch (XCR0, read with xgetbv once cpuid says OSXSAVE): a VM or an old kernel may
 * list AVX-512 and still not save ZMM state. AMX also needs the kernel's per-process permission
 * (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA) before any tile instruction: a VM may
 * list amx flags and still fault at ldtilecfg, so the bit is set only when the request succeeds.
 */
#include "pd_ops.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

static uint64_t xcr0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

static int amx_granted(void) {
#if defined(__linux__) && defined(SYS_arch_prctl)
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#else
    return 0;
#endif
}

int pd_cpu_features(void) {
    unsigned a1, b1, c1, d1, a7, b7, c7, d7, a71 = 0, b71, c71, d71, ae, be, ce = 0, de;
    if (!__get_cpuid(1, &a1, &b1, &c1, &d1) || !__get_cpuid_count(7, 0, &a7, &b7, &c7, &d7)) return 0;
    if (!(c1 & (1u << 27))) return 0;  /* no OSXSAVE: xgetbv would fault, and no AVX state is saved */
    __get_cpuid_count(7, 1, &a71, &b71, &c71, &d71);
    __get_cpuid(0x80000001, &ae, &be, &ce, &de);
    const uint64_t x = xcr0();
    int f = 0;
    const int ymm_saved = (x & 0x6) == 0x6, zmm_saved = (x & 0xe6) == 0xe6, tiles_saved = (x & 0x60000) == 0x60000;
    const int v3 = (c1 & (1u << 12)) && (c1 & (1u << 22)) && (c1 & (1u << 28)) && (c1 & (1u << 29))  /* FMA MOVBE AVX F16C */
                   && (b7 & (1u << 3)) && (b7 & (1u << 5)) && (b7 & (1u << 8)) && (ce & (1u << 5));  /* BMI1 AVX2 BMI2 LZCNT */
    if (v3 && ymm_saved) f |= PD_CPU_AVX2;
    const unsigned v4 = (1u << 16) | (1u << 17) | (1u << 28) | (1u << 30) | (1u << 31);  /* F DQ CD BW VL */
    if ((f & PD_CPU_AVX2) && zmm_saved && (b7 & v4) == v4 && (c7 & (1u << 11))) {  /* and VNNI */
        f |= PD_CPU_AVX512;
        if (a71 & (1u << 5)) f |= PD_CPU_AVX512_BF16;
    }
    const unsigned amx = (1u << 22) | (1u << 24) | (1u << 25);  /* AMX-BF16 AMX-TILE AMX-INT8 */
    if ((d7 & amx) == amx && tiles_saved && amx_granted()) f |= PD_CPU_AMX;
    return f;
}
#else
int pd_cpu_features(void) { return 0; }
#endif

int pd_build_isa(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
    return 2;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    return 1;
#else
    return 0;
#endif
}

/* The hash of the sources this library was compiled from (kernels/native_build.py passes it). */
#ifndef PD_SOURCE_HASH
#define PD_SOURCE_HASH "unknown"
#endif
const char *pd_source_hash(void) { return PD_SOURCE_HASH; }
