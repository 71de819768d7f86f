/* Read bandwidth against the size of what is read: where the last-level cache ends on this machine. A
 * decoding step streams the model's weights, and whether a step's and a draft's weights, heads and KV
 * cache fit in that cache changes their cost by up to ~2x (a 2-core Xeon VM with AMX: 43-54 GB/s up to
 * 96 MB, 30-39 at 112 MB, 20-24 from 160 MB; its lscpu says 300 MB of L3, shared with other VMs).
 *
 *   cc -O2 -march=native -fopenmp benchmarks/bandwidth.c -o /tmp/bandwidth && /tmp/bandwidth [threads]
 *
 * Each size is read whole 8 times (64-byte vector loads split over the threads), the best of the last 6. */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 2;
    const size_t mb[] = {8, 16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 256, 384};
    const int sizes = sizeof mb / sizeof mb[0];
    char *a = aligned_alloc(64, mb[sizes - 1] << 20);
    for (size_t i = 0; i < mb[sizes - 1] << 20; i += 64) a[i] = (char)i; /* every page touched */
    long sink = 0;
    for (int s = 0; s < sizes; s++) {
        size_t n = mb[s] << 20;
        double best = 1e9;
        for (int pass = 0; pass < 8; pass++) {
            double t = seconds();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
            {
#ifdef __AVX512F__
                __m512i acc = _mm512_setzero_si512();
#pragma omp for schedule(static)
                for (size_t i = 0; i < n; i += 64) acc = _mm512_or_si512(acc, _mm512_load_si512((const void *)(a + i)));
                sink += _mm512_reduce_or_epi32(acc);
#else
                long acc = 0;
#pragma omp for schedule(static)
                for (size_t i = 0; i < n; i += 8) acc |= *(const long *)(a + i);
                sink += acc;
#endif
            }
            t = seconds() - t;
            if (pass > 1 && t < best) best = t;
        }
        printf("%4zu MB: %5.1f GB/s\n", mb[s], n / best / 1e9);
    }
    return (int)(sink & 0); /* the reads are used, so not optimised away */
}
