/* The default model's linears (30 layers x q, k, v, o, gate, up, down + the LM head; SmolLM2-135M
 * shapes) on native.c's kernels, outside Python: the cost of a k-row call relative to one row, the best
 * of 12 passes each. Weights are arbitrary bits in each kernel's panel layout (the timing does not
 * depend on their values); every layer has its own buffer, so each pass streams all of them from
 * memory as a decode step does.
 *
 *   cc -O3 -march=native -ffp-contract=off -fopenmp benchmarks/linears.c -o /tmp/linears -lm
 *   /tmp/linears 0   # float32 weights (linear_dense);  1: bfloat16;
 *                    # 2: int4 codes with an int8 LM head on int8 activations (linear_q4_i8, linear_q8_i8)
 *                    # 3: bfloat16 in pair panels (linear_pairs; AVX512-BF16 only)
 *                    # 4: bfloat16 from 4-bit codes in pair order (linear_pair_codes; 8-bit codes for the head)
 *                    # 5: the same codes on AMX tiles (linear_tiles; AMX-BF16 only; the head as in 4)
 *                    # 6: float32 from 4-bit codes (linear_codes; 8-bit codes for the head)
 *
 *   /tmp/linears 6 2 hot  # the 30 layers all on layer 0's weights, no LM head: 2.2 MB of codes (14 MB
 *                         # of float32) that stay in the cache, so the time is the kernels' arithmetic
 *   /tmp/linears 6 2 prompt  # a prompt's 256 rows through the 30 layers (no LM head): ms a row
 *
 * Add -DAHEAD_F32=0 -DAHEAD_BF16=0 (-DQ4_AHEAD=0 -DQ8_AHEAD=0) to build without the kernels' software
 * prefetch. */
#include "../selfspec/kernels/native.c"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* A prompt's rows (PROMPT of them) through the layers' `count` linears, best of 6 passes: ms a row. */
enum { PROMPT = 256 };
static int prompt_rows(int mode, void *const *w, const int64_t *in, const int64_t *out, int count, int threads) {
    if (mode != 0 && mode != 1 && mode != 6) return fprintf(stderr, "prompt: modes 0, 1 and 6\n"), 2;
    float *x = aligned_alloc(64, sizeof(float) * PROMPT * 1536), *y = aligned_alloc(64, sizeof(float) * PROMPT * 1536);
    for (int i = 0; i < PROMPT * 1536; i++) x[i] = (float)(i % 17) * 0.01f;
    double best = 1e9;
    for (int pass = 0; pass < 6; pass++) {
        double t = seconds();
        for (int l = 0; l < count; l++)
            if (mode == 6) linear_codes(x, w[l], y, PROMPT, in[l], out[l], 4, threads);
            else linear_dense(x, w[l], y, PROMPT, in[l], out[l], mode, threads);
        t = seconds() - t;
        best = t < best ? t : best;
    }
    printf("mode %d, %d threads, a %d-row prompt through the layers: %.3f ms a row\n", mode, threads, PROMPT,
           best * 1e3 / PROMPT);
    return 0;
}

int main(int argc, char **argv) {
    int mode = argc > 1 ? atoi(argv[1]) : 0, bf = mode == 1 || mode == 3, threads = argc > 2 ? atoi(argv[2]) : 2;
    int hot = argc > 3 && !strcmp(argv[3], "hot"), prompt = argc > 3 && !strcmp(argv[3], "prompt");
    if (mode == 5 && !tiles_ready()) return 1; /* Linux lends AMX's tile state on request */
    const int64_t shapes[8][2] = {{576, 576}, {576, 192}, {576, 192}, {576, 576},
                                  {576, 1536}, {576, 1536}, {1536, 576}, {576, 49152}}; /* [in, out] */
    enum { LINEARS = 30 * 7 + 1, PASSES = 12 };
    void *w[LINEARS];
    int64_t in[LINEARS], out[LINEARS];
    for (int l = 0; l < LINEARS; l++) {
        int s = l == LINEARS - 1 ? 7 : l % 7;
        in[l] = shapes[s][0], out[l] = shapes[s][1];
        size_t bytes = (size_t)((out[l] + PANEL - 1) / PANEL * PANEL * in[l]) * (bf ? 2 : 4);
        if (mode == 2) /* 320 bytes per 32 weights of int4 (codes, float16 scales and offsets), 32 of int8 */
            bytes = (size_t)((out[l] + PANEL - 1) / PANEL * PANEL * in[l]) / 32 * (l == LINEARS - 1 ? 32 : 20);
        if (mode >= 4) /* code panels: 20 bytes per 32 weights of 4-bit codes, 34 of 8-bit ones */
            bytes = (size_t)((out[l] + PANEL - 1) / PANEL * PANEL * in[l]) / 32 * (l == LINEARS - 1 ? 34 : 20);
        w[l] = aligned_alloc(64, (bytes + 63) / 64 * 64);
        for (size_t j = 0; j < bytes / 4; j++) /* small finite values in either format */
            ((uint32_t *)w[l])[j] = 0x3c003c00u ^ ((uint32_t)(j * 2654435761u) & 0x00ff00ffu);
    }
    for (int l = 7; hot && l < LINEARS - 1; l++) free(w[l]), w[l] = w[l % 7];
    float *x = aligned_alloc(64, sizeof(float) * 8 * 1536), *y = aligned_alloc(64, sizeof(float) * 8 * 49152);
    for (int i = 0; i < 8 * 1536; i++) x[i] = (float)(i % 17) * 0.01f;
    float *scale = aligned_alloc(64, sizeof(float) * 49152);
    for (int i = 0; i < 49152; i++) scale[i] = 0.01f;
    if (prompt) return prompt_rows(mode, w, in, out, LINEARS - 1, threads);
    const int ks[] = {1, 2, 3, 4, 5, 6, 7, 8};
    double best[8];
    for (int j = 0; j < 8; j++) best[j] = 1e9;
    for (int pass = 0; pass < PASSES; pass++)
        for (int j = 0; j < 8; j++) { /* interleaved, so drift on the machine hits every k alike */
            double t = seconds();
            for (int l = 0; l < LINEARS - hot; l++)
                if (mode < 2) linear_dense(x, w[l], y, ks[j], in[l], out[l], bf, threads);
                else if (mode == 6) linear_codes(x, w[l], y, ks[j], in[l], out[l], l == LINEARS - 1 ? 8 : 4, threads);
#ifdef __AVX512BF16__
                else if (mode == 3) linear_pairs(x, w[l], y, ks[j], in[l], out[l], threads);
                else if (mode >= 4 && l == LINEARS - 1) linear_pair_codes(x, w[l], y, ks[j], in[l], out[l], 8, threads);
                else if (mode == 4) linear_pair_codes(x, w[l], y, ks[j], in[l], out[l], 4, threads);
#endif
#if TILES
                else if (mode == 5) linear_tiles(x, w[l], y, ks[j], in[l], out[l], 4, threads);
#endif
#ifdef DOT_I8
                else if (l < LINEARS - 1) linear_q4_i8(x, w[l], y, ks[j], in[l], out[l], threads);
                else linear_q8_i8(x, w[l], scale, y, ks[j], in[l], out[l], threads);
#endif
            t = seconds() - t;
            if (t < best[j]) best[j] = t;
        }
    const char *names[] = {"float32", "bfloat16", "int4 (int8 head)", "bfloat16 pairs", "bfloat16 codes", "bfloat16 codes on AMX", "float32 codes"};
    printf("%s weights, %d threads%s:", names[mode], threads, hot ? ", in the cache" : "");
    for (int j = 0; j < 8; j++) printf("  k=%d %.2f ms (%.2fx)", ks[j], best[j] * 1e3, best[j] / best[0]);
    printf("\n");
    return 0;
}
