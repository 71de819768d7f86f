/* selfspec's own CPU kernels.
 *
 * The decoder's glue between its linears, fused: one call per step of a layer where eager torch
 * issues 5-15 small ops of ~5-10 us each (a 1-row decoding step spent ~10 ms of its ~40 ms there).
 *   add_norm      h' = h + y; x = rms_norm(h') * w            (the residual add and the next norm)
 *   silu_mul      out = silu(gate) * up                        (the MLP's activation)
 *   attend        RoPE on q and k, k/v written to the paged cache, then attention of each query over
 *                 exactly the keys it may see, read through the block table
 * The linears of the native backends (kernels/native_*.py), further down:
 *   linear_dense  float32 / bfloat16 weights;  linear_q8  int8 per channel;  linear_q4  4-bit groups of 32
 *   linear_codes  float32 weights rebuilt from the 4-bit / 8-bit codes they were dequantized from
 *   greedy_codes8 an 8-bit head's argmax per row from an int8 pass that bounds every logit (the greedy head)
 * and over the vocabulary, at the end: shortlist (the quantized draft's head) and argmax_rows.
 *
 * Exactness: every row is computed on its own, by the same loop, in a fixed order (reductions keep
 * LANES partial sums, 16 for attention's scores with AVX-512, and add them in a fixed tree; built with
 * -ffp-contract=off, so the compiler fuses no multiply-add on its own, and the linears fuse theirs
 * explicitly, in the same place for every row),
 * so a row's bits do not depend on how many rows share the call: a k-token verification computes
 * each position exactly as the 1-token step would. Activations are float32 (bf = 0) or bfloat16
 * (bf = 1, computed in float32 and rounded to nearest even where torch rounds). The glue is
 * single-threaded (at decoding sizes a parallel region costs more than the work), except attention's
 * queries; the linears split their output columns over OpenMP threads. Built and loaded by native.py. */

#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdint.h>
#ifdef __AVX__ /* AVX alone too: dot8's horizontal adds */
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__F16C__)
#define DOT_I8 1 /* the int8-activation linears: AVX2's byte dot products, F16C's float16 scales */
#endif
#include <stdlib.h>
#include <string.h>

/* AMX (Intel Sapphire Rapids and later): eight tile registers of up to 16 rows of 64 bytes, and
 * tdpbf16ps, which adds the product of a bfloat16 tile and a tile of bfloat16 pairs into a float32 one.
 * Used by attention's scores (attend_group) and by the linears of kernels/native_tiles.py. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define TILES 1
#define TILES_ONLY(...) __VA_ARGS__
#include <sys/syscall.h>
#include <unistd.h>
#define TILE_M 16 /* rows of x per tile */

typedef struct { /* ldtilecfg's 64 bytes, palette 1 */
    uint8_t palette, start;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* Linux hands AMX's 8 KB of tile state to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
 * XTILEDATA, kernel 5.16 and later); without it the first tile instruction faults. 1 when granted. */
static int granted; /* tiles_ready() said yes: attention may use the tiles too */
int tiles_ready(void) { return granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

/* Tiles for n rows of x: 0 the sums (n x 16 float32), 1 x (n x 32 bfloat16), 2-7 16 rows of 64 bytes (a
 * linear's weights in 2 and 3; tile_scores takes n = 16 and all eight). Loaded per call and thread:
 * another library (oneDNN's GEMMs) may have set its own since. */
static void tiles_for(int n) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.colsb[t] = 64, c.rows[t] = t < 2 ? (uint8_t)n : 16;
    _tile_loadconfig(&c);
}

#else
#define TILES 0
#define TILES_ONLY(...)
int tiles_ready(void) { return 0; }
#endif

/* Eight floats, one AVX register (two SSE ones): GCC/Clang vector extensions, elementwise IEEE. */
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
#define LANES 8

static inline float bf16_to_float(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float round_as(float f, int bf) { return bf ? bf16_to_float(float_to_bf16(f)) : f; }

/* Element i of an activation buffer, as float. */
static inline float get(const void *p, int64_t i, int bf) {
    return bf ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void put(void *p, int64_t i, float v, int bf) {
    if (bf)
        ((uint16_t *)p)[i] = float_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* n floats from p + offset: a pointer into p itself (float32) or converted into tmp (bfloat16). */
static inline const float *row(const void *p, int64_t offset, int64_t n, float *tmp, int bf) {
    if (!bf) return (const float *)p + offset;
    const uint16_t *s = (const uint16_t *)p + offset;
    for (int64_t i = 0; i < n; i++) tmp[i] = bf16_to_float(s[i]);
    return tmp;
}

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* 8 bfloat16 values -> float32 (exact: a bfloat16 is a float32's upper half). */
static inline v8 load_bf16(const uint16_t *p) {
#ifdef __AVX2__
    __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
    return (v8)_mm256_castsi256_ps(w);
#else
    v8 v;
    for (int l = 0; l < LANES; l++) v[l] = bf16_to_float(p[l]);
    return v;
#endif
}

/* n float32 values that hold bfloat16 ones (widened: exact) -> a new array of the bfloat16 bits, their
 * upper halves (the caller frees it). */
static inline uint16_t *narrowed(const float *x, int64_t n) {
    uint16_t *b = malloc(sizeof(uint16_t) * (size_t)n);
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, sizeof u);
        b[i] = (uint16_t)(u >> 16);
    }
    return b;
}

typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));

/* float_to_bf16 on 8 lanes: their bits in each lane's upper half (the lower half zero). */
static inline v8u bf16_bits8(v8 f) {
    v8u u = (v8u)f;
    v8u r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    v8u nan = (v8u)((u & 0x7fffffffu) > 0x7f800000u);
    return (r & ~nan) | (0x7fc00000u & nan);
}

/* round_as on 8 lanes. */
static inline v8 round8(v8 f, int bf) { return bf ? (v8)bf16_bits8(f) : f; }

/* get / put on 8 consecutive elements. */
static inline v8 get8(const void *p, int64_t i, int bf) {
    return bf ? load_bf16((const uint16_t *)p + i) : load8((const float *)p + i);
}

static inline void put8(void *p, int64_t i, v8 v, int bf) {
    if (!bf) {
        memcpy((float *)p + i, &v, sizeof v);
        return;
    }
    u16x8 h = __builtin_convertvector(bf16_bits8(v) >> 16, u16x8);
    memcpy((uint16_t *)p + i, &h, sizeof h);
}

/* get8 / put8 on the c elements left from i when fewer than 8 remain (lanes past them: 0, unwritten). */
static inline v8 getn(const void *p, int64_t i, int64_t c, int bf) {
    if (c >= LANES) return get8(p, i, bf);
    v8 v = {0};
    for (int64_t l = 0; l < c; l++) v[l] = get(p, i + l, bf);
    return v;
}

static inline void putn(void *p, int64_t i, v8 v, int64_t c, int bf) {
    if (c >= LANES)
        put8(p, i, v, bf);
    else
        for (int64_t l = 0; l < c; l++) put(p, i + l, v[l], bf);
}

/* a + b * c, fused (one rounding) where the CPU has FMA. The linears and attention use it: their bits
 * then differ between machines with and without FMA, but on one machine every row takes the same path. */
static inline v8 fma8(v8 a, v8 b, v8 c) {
#ifdef __FMA__
    return (v8)_mm256_fmadd_ps((__m256)b, (__m256)c, (__m256)a);
#else
    return a + b * c;
#endif
}

static inline float sum8(v8 a) { return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])); }

/* A fixed-order dot product: lane l sums the products i = l (mod 8), then the lanes are added in one
 * fixed tree, whatever the vector width the compiler emits. */
static inline float dot(const float *a, const float *b, int64_t n) {
    v8 even = {0}, odd = {0}; /* two chains: half the add latency of one */
    int64_t i = 0;
    for (; i + 2 * LANES <= n; i += 2 * LANES) {
        even += load8(a + i) * load8(b + i);
        odd += load8(a + i + LANES) * load8(b + i + LANES);
    }
    if (i + LANES <= n) {
        even += load8(a + i) * load8(b + i);
        i += LANES;
    }
    float s = sum8(even + odd);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline v8 select8(v8i mask, v8 a, v8 b) { return (v8)(((v8i)a & mask) | ((v8i)b & ~mask)); }

static inline v8 splat8(float x) { return (v8){x, x, x, x, x, x, x, x}; }

/* Sixteen floats: one AVX-512 register, two AVX ones (the compiler splits them). */
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

/* exp(x) for x in [-87, 88] to ~2 ulp (smaller x gives 0): x = n ln2 + r, |r| <= ln2 / 2, exp(r) by
 * Cephes' degree-6 polynomial, 2^n through the exponent bits. Vector code where glibc's expf is one
 * value at a time; every lane runs the same operations (none fused: -ffp-contract=off), so a value
 * depends neither on its lane nor on the vector's width. In place on `count` vectors, each step on all
 * of them before the next: one vector's ~20 dependent steps leave the FP scheduler full of waiting ops
 * (a softmax loop of exp8, AMD EPYC Zen 3: ~3 cycles an element; four in step: ~2). */
#define EXP_OF(name, vf, vi)                                                                                     \
    static inline __attribute__((always_inline)) void name(vf *xs, int count) {                                  \
        vf x[4], n[4], r[4], p[4];                                                                               \
        vi under[4];                                                                                             \
        for (int j = 0; j < count; j++) {                                                                        \
            under[j] = xs[j] < -87.0f;                                                                           \
            x[j] = (vf)(((vi)xs[j] & ~under[j]) | ((vi)((vf){0} - 87.0f) & under[j]));                           \
        }                                                                                                        \
        for (int j = 0; j < count; j++) {                                                                        \
            vi over = x[j] > 88.0f;                                                                              \
            x[j] = (vf)(((vi)x[j] & ~over) | ((vi)((vf){0} + 88.0f) & over));                                    \
        }                                                                                                        \
        for (int j = 0; j < count; j++) n[j] = x[j] * 1.44269504088896341f + 12582912.0f; /* rounded by the     \
                                                                                            1.5 * 2^23 shift */ \
        for (int j = 0; j < count; j++) n[j] = n[j] - 12582912.0f;                                              \
        for (int j = 0; j < count; j++) r[j] = x[j] - n[j] * 0.693359375f;                                      \
        for (int j = 0; j < count; j++) r[j] = r[j] - n[j] * -2.12194440e-4f;                                   \
        for (int j = 0; j < count; j++) p[j] = r[j] * 1.9875691500e-4f + 1.3981999507e-3f;                      \
        for (int j = 0; j < count; j++) p[j] = p[j] * r[j] + 8.3334519073e-3f;                                  \
        for (int j = 0; j < count; j++) p[j] = p[j] * r[j] + 4.1665795894e-2f;                                  \
        for (int j = 0; j < count; j++) p[j] = p[j] * r[j] + 1.6666665459e-1f;                                  \
        for (int j = 0; j < count; j++) p[j] = p[j] * r[j] + 5.0000001201e-1f;                                  \
        for (int j = 0; j < count; j++) p[j] = p[j] * (r[j] * r[j]) + r[j] + 1.0f;                              \
        for (int j = 0; j < count; j++) {                                                                        \
            vi bits = (__builtin_convertvector(n[j], vi) + 127) << 23;                                           \
            xs[j] = (vf)((vi)(p[j] * (vf)bits) & ~under[j]);                                                     \
        }                                                                                                        \
    }
EXP_OF(exps8, v8, v8i)
static inline v8 exp8(v8 x) {
    exps8(&x, 1);
    return x;
}
#ifdef __AVX512F__
EXP_OF(exps16, v16, v16i)
static inline v16 exp16(v16 x) {
    exps16(&x, 1);
    return x;
}
#endif

/* Elementwise work (in elements) from which the glue below splits its rows over the threads: below it,
 * starting the team costs more than the other thread saves (a decoding step's one row). */
#define GLUE_WORK 4096
#define GLUE_TEAM(work, threads) if ((work) >= GLUE_WORK && (threads) > 1) num_threads(threads)

/* Row r of add_norm (t: n + 8 floats of scratch). */
static inline __attribute__((always_inline)) void add_norm_row(const void *h, const void *y, void *h_out,
                                                               const void *w, void *x, int64_t r, int64_t n,
                                                               float eps, float *t, int bf) {
    int64_t o = r * n;
    for (int64_t i = 0; i < n; i += LANES) {
        v8 v = getn(h, o + i, n - i, bf);
        if (y) {
            v = round8(v + getn(y, o + i, n - i, bf), bf);
            putn(h_out, o + i, v, n - i, bf);
        }
        memcpy(t + i, &v, sizeof v);
    }
    v8 rs = splat8(1.0f / sqrtf(dot(t, t, n) / (float)n + eps));
    for (int64_t i = 0; i < n; i += LANES)
        putn(x, o + i, round8(load8(t + i) * rs, bf) * getn(w, i, n - i, bf), n - i, bf);
}

/* h [rows, n], y [rows, n] or NULL, w [n] -> h_out = h + y (skipped when y is NULL), x = rms_norm * w.
 * Eight lanes at a time: each element's operations are the scalar ones (IEEE, no contraction). Rows are
 * independent, so splitting them over threads leaves every bit as it was. */
void add_norm(const void *h, const void *y, void *h_out, const void *w, void *x, int64_t rows, int64_t n,
              float eps, int bf, int threads) {
#pragma omp parallel GLUE_TEAM(rows * n, threads)
    {
        float *t = malloc(sizeof(float) * (size_t)(n + LANES));
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            bf ? add_norm_row(h, y, h_out, w, x, r, n, eps, t, 1) : add_norm_row(h, y, h_out, w, x, r, n, eps, t, 0);
        free(t);
    }
}

/* Elements [i0, i1) of row r of silu_mul (i0 a multiple of LANES). */
static inline __attribute__((always_inline)) void silu_span(const void *gate_up, void *out, int64_t r, int64_t n,
                                                            int64_t i0, int64_t i1, int bf) {
    int64_t i = i0;
    for (; i + 4 * LANES <= i1; i += 4 * LANES) { /* four exps in step (exps8) */
        v8 g[4], e[4];
        for (int h = 0; h < 4; h++) g[h] = get8(gate_up, r * 2 * n + i + LANES * h, bf), e[h] = -g[h];
        exps8(e, 4);
        for (int h = 0; h < 4; h++) {
            v8 act = round8(g[h] / (e[h] + 1.0f), bf);
            put8(out, r * n + i + LANES * h, act * get8(gate_up, r * 2 * n + n + i + LANES * h, bf), bf);
        }
    }
    for (; i < i1; i += LANES) {
        v8 g = getn(gate_up, r * 2 * n + i, n - i, bf);
        v8 act = round8(g / (exp8(-g) + 1.0f), bf);
        putn(out, r * n + i, act * getn(gate_up, r * 2 * n + n + i, n - i, bf), n - i, bf);
    }
}

/* gate_up [rows, 2 * n] (gate then up) -> out [rows, n] = silu(gate) * up. */
void silu_mul(const void *gate_up, void *out, int64_t rows, int64_t n, int bf, int threads) {
#pragma omp parallel for schedule(static) GLUE_TEAM(rows * n, threads)
    for (int64_t r = 0; r < rows; r++) bf ? silu_span(gate_up, out, r, n, 0, n, 1) : silu_span(gate_up, out, r, n, 0, n, 0);
}

/* a [count] in one float format -> b in the other (widen: bfloat16 to float32, else float32 to bfloat16
 * rounded), 8 elements at a time, split over threads in whole vectors. */
static void convert(const void *a, void *b, int64_t count, int widen, int threads) {
#pragma omp parallel for schedule(static) GLUE_TEAM(count, threads)
    for (int64_t i = 0; i < count; i += LANES) {
        if (widen) putn(b, i, getn(a, i, count - i, 1), count - i, 0);
        else putn(b, i, getn(a, i, count - i, 0), count - i, 1);
    }
}

/* acc [dim] += sum over keys k < n of p[k] * v[k], one key after another (the same order whichever chunks
 * a caller splits the keys into: acc goes through memory between chunks, which keeps its bits). The
 * accumulators stay in registers for the head sizes that matter (dim a constant after inlining: 64, 128).
 * The values are float32 rows, or (bf) bfloat16 ones straight from the cache, widened in registers: the
 * same values, so the same bits. */
static inline __attribute__((always_inline)) void weigh(const float *p, int64_t n, const void *const *v, int64_t dim,
                                                        float *acc, int bf) {
    v8 a[16];
    int64_t vectors = dim / LANES;
    for (int64_t i = 0; i < vectors; i++) a[i] = load8(acc + i * LANES);
    for (int64_t k = 0; k < n; k++) {
        v8 w = splat8(p[k]);
        for (int64_t i = 0; i < vectors; i++)
            a[i] = fma8(a[i], w, get8(v[k], i * LANES, bf));
    }
    memcpy(acc, a, sizeof(float) * (size_t)dim);
}

static void weighted_sum(const float *p, int64_t n, const void *const *v, int64_t dim, float *acc, int bf) {
    if (dim == 64)
        bf ? weigh(p, n, v, 64, acc, 1) : weigh(p, n, v, 64, acc, 0);
    else if (dim == 128)
        bf ? weigh(p, n, v, 128, acc, 1) : weigh(p, n, v, 128, acc, 0);
    else if (dim % LANES == 0 && dim <= 16 * LANES)
        bf ? weigh(p, n, v, dim, acc, 1) : weigh(p, n, v, dim, acc, 0);
    else /* any other head size: one value at a time */
        for (int64_t k = 0; k < n; k++)
            for (int64_t i = 0; i < dim; i++) acc[i] += p[k] * get(v[k], i, bf);
}

#ifdef __AVX512F__
/* 16 elements of a key or value from the cache as float32 (a bfloat16 one widened in registers: exact). */
static inline __m512 load16(const void *x, int64_t i, int bf) {
    if (!bf) return _mm512_loadu_ps((const float *)x + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* weigh for two queries over the same n keys: each value read once for both, and 8 independent
 * accumulators at dim 64 (one query's 4 sixteen-lane ones would wait on the FMA latency). Each lane's
 * arithmetic is weigh's (acc + p * v, fused, key after key), so the bits are weigh's. */
static inline __attribute__((always_inline)) void weigh2(const float *p1, const float *p2, int64_t n,
                                                         const void *const *v, int64_t dim, float *acc1, float *acc2,
                                                         int bf) {
    __m512 a[8], b[8];
    int64_t vectors = dim / 16;
    for (int64_t i = 0; i < vectors; i++) a[i] = _mm512_loadu_ps(acc1 + 16 * i), b[i] = _mm512_loadu_ps(acc2 + 16 * i);
    for (int64_t k = 0; k < n; k++) {
        __m512 w1 = _mm512_set1_ps(p1[k]), w2 = _mm512_set1_ps(p2[k]);
        for (int64_t i = 0; i < vectors; i++) {
            __m512 x = load16(v[k], 16 * i, bf);
            a[i] = _mm512_fmadd_ps(w1, x, a[i]);
            b[i] = _mm512_fmadd_ps(w2, x, b[i]);
        }
    }
    for (int64_t i = 0; i < vectors; i++) _mm512_storeu_ps(acc1 + 16 * i, a[i]), _mm512_storeu_ps(acc2 + 16 * i, b[i]);
}
#define PAIR_DIM(dim) ((dim) % 16 == 0 && (dim) <= 128)
#else
/* weigh for two queries over the same n keys, 32 elements of the values at a time: each read of a value
 * serves both queries, and the 8 accumulators (4 per query) fit the 16 registers beside the value and
 * the weights, where a query's whole 64 elements would not. Each lane's arithmetic is weigh's (acc + p * v,
 * fused, key after key), so the bits are weigh's. A 1-row step's attention at a 1000-token context
 * (AMD EPYC, AVX2): ~30 % of its time in weighted sums, one query at a time; with this, 1 thread, three
 * runs: 2.28 / 2.34 / 2.95 ms against 2.64 / 2.39 / 2.40 (a small gain, kept: it is the AVX-512 path's). */
static inline __attribute__((always_inline)) void weigh2(const float *p1, const float *p2, int64_t n,
                                                         const void *const *v, int64_t dim, float *acc1, float *acc2,
                                                         int bf) {
    for (int64_t part = 0; part < dim; part += 4 * LANES) {
        v8 a[4], b[4];
        for (int i = 0; i < 4; i++) a[i] = load8(acc1 + part + i * LANES), b[i] = load8(acc2 + part + i * LANES);
        for (int64_t k = 0; k < n; k++) {
            v8 w1 = splat8(p1[k]), w2 = splat8(p2[k]);
            for (int i = 0; i < 4; i++) {
                v8 x = get8(v[k], part + i * LANES, bf);
                a[i] = fma8(a[i], w1, x);
                b[i] = fma8(b[i], w2, x);
            }
        }
        for (int i = 0; i < 4; i++) {
            memcpy(acc1 + part + i * LANES, &a[i], sizeof a[i]);
            memcpy(acc2 + part + i * LANES, &b[i], sizeof b[i]);
        }
    }
}
#define PAIR_DIM(dim) ((dim) % 32 == 0 && (dim) <= 128)
#endif

/* weighted_sum for two queries: query 1 over keys [a1, b1) with weights w1[k], query 2 over [a2, b2) with
 * w2[k]; v[k - c] is key k's value. Each query takes its keys in ascending order, as weighted_sum would
 * on its own (so the same bits); the keys both read share each value load. */
static void weighted_pair(const float *w1, int64_t a1, int64_t b1, const float *w2, int64_t a2, int64_t b2,
                          const void *const *v, int64_t c, int64_t dim, float *acc1, float *acc2, int bf) {
    int64_t lo = a1 > a2 ? a1 : a2, hi = b1 < b2 ? b1 : b2;
    if (lo < hi && PAIR_DIM(dim)) {
        if (a1 < lo) weighted_sum(w1 + a1, lo - a1, v + a1 - c, dim, acc1, bf);
        if (a2 < lo) weighted_sum(w2 + a2, lo - a2, v + a2 - c, dim, acc2, bf);
        const float *x1 = w1 + lo, *x2 = w2 + lo;
        const void *const *u = v + lo - c;
        if (dim == 64)
            bf ? weigh2(x1, x2, hi - lo, u, 64, acc1, acc2, 1) : weigh2(x1, x2, hi - lo, u, 64, acc1, acc2, 0);
        else
            bf ? weigh2(x1, x2, hi - lo, u, dim, acc1, acc2, 1) : weigh2(x1, x2, hi - lo, u, dim, acc1, acc2, 0);
        if (b1 > hi) weighted_sum(w1 + hi, b1 - hi, v + hi - c, dim, acc1, bf);
        if (b2 > hi) weighted_sum(w2 + hi, b2 - hi, v + hi - c, dim, acc2, bf);
        return;
    }
    if (a1 < b1) weighted_sum(w1 + a1, b1 - a1, v + a1 - c, dim, acc1, bf);
    if (a2 < b2) weighted_sum(w2 + a2, b2 - a2, v + a2 - c, dim, acc2, bf);
}

/* x [dim] <- x * cos + roll(x, dim / 2) * sin_signed, each product and the sum rounded as torch's
 * in-place ops round them (rope.apply_rope_), so the rotated bits equal the eager path's. t: dim + 8. */
static void rope(void *p, int64_t o, const void *cos, const void *sin, int64_t dim, float *t, int bf) {
    int64_t half = dim / 2;
    for (int64_t i = 0; i < dim; i += LANES) {
        v8 v = getn(p, o + i, dim - i, bf);
        memcpy(t + i, &v, sizeof v);
    }
    if (half % LANES == 0) /* the rolled half in whole vectors */
        for (int64_t i = 0; i < dim; i += LANES) {
            v8 a = round8(load8(t + i) * get8(cos, i, bf), bf);
            v8 b = round8(load8(t + (i + half) % dim) * get8(sin, i, bf), bf);
            put8(p, o + i, a + b, bf);
        }
    else
        for (int64_t i = 0; i < dim; i++) {
            float a = round_as(t[i] * get(cos, i, bf), bf);
            float b = round_as(t[(i + half) % dim] * get(sin, i, bf), bf);
            put(p, o + i, a + b, bf);
        }
}

/* q . key for 8 keys at once (lane l: keys[l]); each lane is summed by one fixed tree, the same for
 * every lane, so a score does not depend on which 8 keys it was computed with. dim % 8 == 0. Each key
 * sums its products in two chains (even and odd vectors of the key), and four keys' chains advance
 * together: one key's chain alone waits on the FMA latency at every step, eight independent chains do
 * not (a 1-row step's attention at a 1000-token context, 1 thread, AMD EPYC: 3.14-3.20 -> 2.81-2.83 ms).
 * The operations of each key are the same in either order, so are its bits. */
static inline __attribute__((always_inline)) v8 dot8(const float *q, const float *const *keys, int64_t dim) {
    v8 s[LANES];
    for (int l = 0; l < LANES; l += 4) {
        v8 even[4] = {{0}}, odd[4] = {{0}};
        int64_t i = 0;
        for (; i + 2 * LANES <= dim; i += 2 * LANES) {
            v8 qe = load8(q + i), qo = load8(q + i + LANES);
            for (int j = 0; j < 4; j++) {
                even[j] = fma8(even[j], qe, load8(keys[l + j] + i));
                odd[j] = fma8(odd[j], qo, load8(keys[l + j] + i + LANES));
            }
        }
        if (i < dim)
            for (int j = 0; j < 4; j++) even[j] = fma8(even[j], load8(q + i), load8(keys[l + j] + i));
        for (int j = 0; j < 4; j++) s[l + j] = even[j] + odd[j];
    }
#ifdef __AVX__ /* lane l = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)) of s[l], by three rounds of hadd */
    __m256 t0 = _mm256_hadd_ps((__m256)s[0], (__m256)s[1]), t1 = _mm256_hadd_ps((__m256)s[2], (__m256)s[3]);
    __m256 t2 = _mm256_hadd_ps((__m256)s[4], (__m256)s[5]), t3 = _mm256_hadd_ps((__m256)s[6], (__m256)s[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return (v8)_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
#else
    v8 r;
    for (int l = 0; l < LANES; l++)
        r[l] = ((s[l][0] + s[l][1]) + (s[l][2] + s[l][3])) + ((s[l][4] + s[l][5]) + (s[l][6] + s[l][7]));
    return r;
#endif
}

#ifdef __AVX512F__
/* The 16-lane sums of 16 keys (s[l]: key l's) -> lane l = key l's total, by one fixed tree: within each
 * 4-lane quarter (x0 + x2) + (x1 + x3), then (q0 + q1) + (q2 + q3). */
static inline __attribute__((always_inline)) __m512 lanes16(const __m512 *s) {
    __m512 t[8], u[4];
    for (int j = 0; j < 8; j++) /* per quarter: [a0 + a2, b0 + b2, a1 + a3, b1 + b3] of keys 2j, 2j + 1 */
        t[j] = _mm512_add_ps(_mm512_unpacklo_ps(s[2 * j], s[2 * j + 1]), _mm512_unpackhi_ps(s[2 * j], s[2 * j + 1]));
    for (int j = 0; j < 4; j++) /* per quarter: keys 4j .. 4j + 3, each (x0 + x2) + (x1 + x3) */
        u[j] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * j], t[2 * j + 1], 0x44),
                             _mm512_shuffle_ps(t[2 * j], t[2 * j + 1], 0xee));
    /* quarters q0 + q1 and q2 + q3 of keys 0-7 (v0) and 8-15 (v1), then their sum: lane l = key l */
    __m512 v0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xdd));
    __m512 v1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, 0x88), _mm512_shuffle_f32x4(v0, v1, 0xdd));
}

/* q . key for 16 keys at once (lane l: keys[l]), 16 products to a lane, the lanes of each key added by
 * one fixed tree (within each 4-lane quarter (x0 + x2) + (x1 + x3), then (q0 + q1) + (q2 + q3)), the same
 * for every key, so a score does not depend on which 16 keys it was computed with. dim % 16 == 0. Half
 * the FMAs of two dot8 calls and a shorter reduction per key; its scores differ from dot8's in the last
 * bits, so one machine always takes the same one (by dim). */
#define KEYS 16
static inline __attribute__((always_inline)) __m512 dot16(const float *q, const void *const *keys, int64_t dim,
                                                          int bf) {
    __m512 s[16];
    for (int l = 0; l < 16; l++) {
        __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
        int64_t i = 0;
        for (; i + 32 <= dim; i += 32) {
            even = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load16(keys[l], i, bf), even);
            odd = _mm512_fmadd_ps(_mm512_loadu_ps(q + i + 16), load16(keys[l], i + 16, bf), odd);
        }
        if (i < dim) even = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load16(keys[l], i, bf), even);
        s[l] = _mm512_add_ps(even, odd);
    }
    return lanes16(s);
}

#else
#define KEYS LANES
#endif

#ifdef __AVX512BF16__
/* bfloat16 q . key for 16 keys straight from the cache, by AVX512-BF16: one vdpbf16ps per 32 dims of a
 * key (each lane adds a pair of exact products), chained over the key in order, then dot16's tree over
 * the lanes. A quarter of dot16's multiply instructions and no widening or copying of the keys; the
 * scores differ from dot16's in the last bits, and every bfloat16 query on such a CPU takes this path
 * (whatever company it keeps), so rows stay exact. dim % 32 == 0. */
#define PAIRS_DOT(dim) ((dim) % 32 == 0)
static inline __attribute__((always_inline)) __m512 dot16_pairs(const uint16_t *q, const void *const *keys,
                                                                int64_t dim) {
    __m512 s[16];
    for (int l = 0; l < 16; l++) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < dim; i += 32)
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512((const void *)(q + i)),
                                   (__m512bh)_mm512_loadu_si512((const void *)((const uint16_t *)keys[l] + i)));
        s[l] = acc;
    }
    return lanes16(s);
}
#else
#define PAIRS_DOT(dim) 0
#endif

#ifdef __AVX512F__
#define DOT16(dim) ((dim) % 16 == 0) /* scores by dot16 */
#else
#define DOT16(dim) 0
#endif

/* Scaled scores of q against KEYS keys, as KEYS / 8 vectors of 8 (keys 8h .. 8h + 7 in sc[h]). The keys
 * are float32 rows, or (wide, dot16 only) bfloat16 ones straight from the cache, widened in registers:
 * the same values, so the same bits. */
static inline __attribute__((always_inline)) void scores(const float *q, const uint16_t *qb, const void *const *keys,
                                                         int64_t dim, float scale, v8 *sc, int wide) {
#ifdef __AVX512BF16__
    if (qb) { /* bfloat16 keys by pairs (dot16_pairs) */
        __m512 d = dim == 64 ? dot16_pairs(qb, keys, 64) : dot16_pairs(qb, keys, dim);
        __m512 x = _mm512_mul_ps(d, _mm512_set1_ps(scale));
        sc[0] = (v8)_mm512_castps512_ps256(x), sc[1] = (v8)_mm512_extractf32x8_ps(x, 1);
        return;
    }
#endif
    (void)qb;
#ifdef __AVX512F__
    if (DOT16(dim)) {
        __m512 d = dim == 64 ? (wide ? dot16(q, keys, 64, 1) : dot16(q, keys, 64, 0))
                             : (wide ? dot16(q, keys, dim, 1) : dot16(q, keys, dim, 0));
        __m512 x = _mm512_mul_ps(d, _mm512_set1_ps(scale));
        sc[0] = (v8)_mm512_castps512_ps256(x), sc[1] = (v8)_mm512_extractf32x8_ps(x, 1);
        return;
    }
#endif
    (void)wide;
    for (int h = 0; h < KEYS / LANES; h++) { /* the common head size unrolled */
        const float *const *k8 = (const float *const *)keys + h * LANES;
        sc[h] = (dim == 64 ? dot8(q, k8, 64) : dot8(q, k8, dim)) * splat8(scale);
    }
}

/* Keys per pass of attention's softmax. AVX2: four exps8 in step (exps8), since one exp8's ~20 dependent
 * steps one at a time filled Zen 3's FP scheduler (~3 cycles an element). AVX-512: one exp16, whose
 * 512-bit ops Zen 4 already splits in two halves; two in step made a 4-row step's attention 4 % slower
 * there (benchmarks/attend.py, 1000-token context). */
#ifdef __AVX512F__
#define EXP_KEYS 16
#else
#define EXP_KEYS 32
#endif
#define CHUNK 64 /* values per pass over the queries: 16 KB at dim 64, shared from L1 */
#ifndef SPAN
#define SPAN 256 /* keys per span: a query's partial results, merged (attend) */
#endif

/* Scores sc of keys k .. k + 7 into a row's p (pi[key], the row reading keys [b, e)): 8 keys all the
 * row's keep a running max per lane (peak), others go one by one into top. */
static inline void keep(v8 sc, int64_t k, int64_t b, int64_t e, float *pi, float *peak, float *top) {
    if (k + LANES <= b || k >= e) return;
    if (k >= b && k + LANES <= e) {
        v8 was = load8(peak);
        memcpy(pi + k, &sc, sizeof sc);
        was = select8((v8i)(sc > was), sc, was);
        memcpy(peak, &was, sizeof was);
        return;
    }
    float best = *top;
    for (int l = 0; l < LANES; l++)
        if (k + l >= b && k + l < e) {
            pi[k + l] = sc[l];
            best = sc[l] > best ? sc[l] : best;
        }
    *top = best;
}

#if TILES
/* Attention's scores on AMX, for attend_group: up to 16 queries of the call against 16 keys per
 * tdpbf16ps of 32 dims. The keys are the A tiles, read from the cache as they are (16 rows of a block;
 * keys not in one run of slots are copied first), the queries the B tiles, as pairs: C [key, query] =
 * the sum over dims, one accumulator per key and query, so a query's scores do not depend on the queries
 * beside it (row-exact). Two blocks of 16 keys at a time in two sums tiles, so that one block's multiply
 * need not wait for the other's store (tiles are not renamed). Each query's 16 scores are gathered from
 * C's column and kept as scores() results are. Tiles: 0, 1 sums; 2, 3 queries (dims 0-31, 32-63); 4-7
 * keys. Against dot16_pairs' 2 vdpbf16ps per query and key pair, a verification's queries cost what one
 * does. dim 32 or 64. */
static inline __attribute__((always_inline)) const uint16_t *key_block(const void *kv, int64_t g, int64_t slots,
                                                                       const int64_t *slot, int64_t k, int64_t lo,
                                                                       int64_t hi, int64_t dim, uint16_t *copy) {
    const uint16_t *a = (const uint16_t *)kv + (g * slots + slot[k - lo]) * dim;
    int run = k + 16 <= hi;
    for (int l = 1; l < 16 && run; l++) run = slot[k - lo + l] == slot[k - lo] + l;
    if (run) return a;
    for (int l = 0; l < 16; l++) { /* past the last key: the last key again, its score unused */
        int64_t at = k + l < hi ? k + l : hi - 1;
        memcpy(copy + l * dim, (const uint16_t *)kv + (g * slots + slot[at - lo]) * dim, (size_t)dim * 2);
    }
    return copy;
}

static void tile_scores(const uint16_t *qb, int64_t queries, const void *kv, int64_t g, int64_t slots,
                        const int64_t *slot, int64_t lo, int64_t hi, int64_t i0, int64_t m, const int64_t *begin,
                        const int64_t *end, int64_t dim, float scale, float *p, int64_t stride, float *peak,
                        float *top) {
    uint32_t b[2][256] __attribute__((aligned(64))); /* the chunk's queries as pair rows [dim / 32][16][16] */
    uint16_t copies[2][16 * 64] __attribute__((aligned(64)));
    float sums[2][256] __attribute__((aligned(64)));
    const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
    const __m512 factor = _mm512_set1_ps(scale);
    tiles_for(16);
    for (int64_t c0 = 0; c0 < queries; c0 += 16) {
        int64_t n = queries - c0 < 16 ? queries - c0 : 16;
        memset(b, 0, sizeof b);
        for (int64_t q = 0; q < n; q++) /* query q's 16 pairs of dims down column q */
            for (int64_t d = 0; d < dim / 32; d++)
                _mm512_i32scatter_epi32(b[d] + q, rows, _mm512_loadu_si512((const void *)(qb + (c0 + q) * dim + d * 32)),
                                        4);
        _tile_loadd(2, b[0], 64);
        if (dim == 64) _tile_loadd(3, b[1], 64);
        for (int64_t k = lo; k < hi; k += 32) {
            int two = k + 16 < hi;
            const uint16_t *a0 = key_block(kv, g, slots, slot, k, lo, hi, dim, copies[0]);
            const uint16_t *a1 = two ? key_block(kv, g, slots, slot, k + 16, lo, hi, dim, copies[1]) : a0;
            _tile_zero(0);
            _tile_zero(1);
            _tile_loadd(4, a0, dim * 2);
            _tile_loadd(6, a1, dim * 2);
            _tile_dpbf16ps(0, 4, 2);
            _tile_dpbf16ps(1, 6, 2);
            if (dim == 64) {
                _tile_loadd(5, a0 + 32, dim * 2);
                _tile_loadd(7, a1 + 32, dim * 2);
                _tile_dpbf16ps(0, 5, 3);
                _tile_dpbf16ps(1, 7, 3);
            }
            _tile_stored(0, sums[0], 64);
            _tile_stored(1, sums[1], 64);
            for (int h = 0; h < 1 + two; h++)
                for (int64_t q = 0; q < n; q++) {
                    int64_t i = c0 + q, j = (i0 + i) % m, at = k + 16 * h;
                    if (at + 16 <= begin[j] || at >= end[j]) continue;
                    __m512 x = _mm512_mul_ps(_mm512_i32gather_ps(rows, sums[h] + q, 4), factor);
                    v8 sc[2] = {(v8)_mm512_castps512_ps256(x), (v8)_mm512_extractf32x8_ps(x, 1)};
                    for (int l = 0; l < 2; l++)
                        keep(sc[l], at + l * LANES, begin[j], end[j], p + i * stride - begin[j], peak + i * LANES,
                             top + i);
                }
        }
    }
}
#define TILE_SCORES(dim) ((dim) == 32 || (dim) == 64)

#endif

/* Queries [i0, i1) of kv head g's group in sequence b, query i being query head g * group + i / m of
 * real row i % m, over the keys of one span [lo, hi): scores, softmax, weighted values. The queries
 * share each read of a key and a value (a kv head's keys and values are read once per call, not once
 * per query head or row); each query's arithmetic is its own, the same in any company. Row j reads keys
 * [rows_begin[j], rows_end[j]) of which this call takes those in [lo, hi) (maybe none); slot[k - lo] is
 * key k's cache slot. Query i's partial result goes to part + (i - i0) * pstride: its weighted sum of
 * values [dim], its top score and its sum of exps (the weights' total), for `attend` to merge. */
static void attend_group(const void *qkv, const void *kv, int64_t slots, const int64_t *slot, int64_t lo,
                         int64_t hi, const int64_t *rows_begin, const int64_t *rows_end, int64_t first, int64_t m,
                         int64_t g, int64_t i0, int64_t i1, int64_t heads, int64_t kv_heads, int64_t dim,
                         int64_t width, float scale, float *part, int64_t pstride, int bf) {
    int64_t group = heads / kv_heads, queries = i1 - i0, buffered = CHUNK > KEYS ? CHUNK : KEYS;
    int64_t *begin = malloc(sizeof(int64_t) * (size_t)(2 * m)), *end = begin + m; /* the rows' keys in the span */
    for (int64_t j = 0; j < m; j++) {
        begin[j] = rows_begin[j] > lo ? rows_begin[j] : lo;
        end[j] = rows_end[j] < hi ? rows_end[j] : hi;
        end[j] = end[j] > begin[j] ? end[j] : begin[j];
    }
    int64_t stride = (hi - lo + 47) / 16 * 16; /* >= keys + 32 of padding, in whole 64-byte lines */
    /* 64-byte aligned, each part a whole number of lines where dim is a multiple of 16: a vector load
     * from a row that straddles two cache lines costs two (bfloat16 keys and values copied to kt: a
     * step's attention for 8 rows at a 1000-token context 11.4 -> 8.9 ms with this and exp16) */
    size_t floats = (size_t)(queries * (2 * dim + stride + 2 + LANES) + buffered * dim);
    float *scratch = aligned_alloc(64, (sizeof(float) * floats + 63) / 64 * 64);
    float *q = scratch, *p = q + queries * dim, *acc = p + queries * stride, *kt = acc + queries * dim;
    float *top = kt + buffered * dim, *total = top + queries, *peak = total + queries;
    const void **v = malloc(sizeof(void *) * CHUNK);
    for (int64_t i = 0; i < queries; i++) {
        int64_t head = g * group + (i0 + i) / m, at = (first + (i0 + i) % m) * width + head * dim;
        const float *qi = row(qkv, at, dim, q + i * dim, bf);
        if (qi != q + i * dim) memcpy(q + i * dim, qi, sizeof(float) * (size_t)dim);
        top[i] = -INFINITY;
        for (int l = 0; l < LANES; l++) peak[i * LANES + l] = -INFINITY;
    }
    /* bfloat16 keys and values: converted once into kt and shared by the queries, or, when at most 4
     * queries share them (a decoding step, a draft), widened in registers where they are used instead of
     * copied (keys alone, k = 1 at a 1000-token context: 3.4 -> 3.0 ms a step's attention; 8 rows: 10.5 ->
     * 12.1 ms, hence the cutoff). */
    int wide = bf && DOT16(dim) && queries <= 4;
    /* bfloat16 scores by pairs where the CPU has AVX512-BF16 (dot16_pairs): the queries narrowed back to
     * bfloat16 (exact), the keys read from the cache as they are */
    uint16_t *qb = bf && PAIRS_DOT(dim) ? narrowed(q, queries * dim) : NULL;
    int tiled = 0; /* the scores on AMX (tile_scores) where Linux granted the tiles */
    TILES_ONLY(tiled = qb && granted && TILE_SCORES(dim));
    TILES_ONLY(if (tiled) tile_scores(qb, queries, kv, g, slots, slot, lo, hi, i0, m, begin, end, dim, scale, p,
                                      stride, peak, top));
    for (int64_t k = lo; k < hi && !tiled; k += KEYS) { /* KEYS keys at a time; every query shares each key read */
        const void *keys[KEYS];
        for (int l = 0; l < KEYS; l++) { /* past the last key: the last key again, its score unused */
            int64_t at = k + l < hi ? k + l : hi - 1, offset = (g * slots + slot[at - lo]) * dim;
            keys[l] = wide || qb ? (const void *)((const uint16_t *)kv + offset)
                                 : (const void *)row(kv, offset, dim, kt + l * dim, bf);
        }
        for (int64_t i = 0; i < queries; i++) {
            int64_t j = (i0 + i) % m;
            if (k + KEYS <= begin[j] || k >= end[j]) continue;
            v8 sc[KEYS / LANES];
            scores(q + i * dim, qb ? qb + i * dim : NULL, keys, dim, scale, sc, wide);
            for (int h = 0; h < KEYS / LANES; h++)
                keep(sc[h], k + h * LANES, begin[j], end[j], p + i * stride - begin[j], peak + i * LANES, top + i);
        }
    }
    for (int64_t i = 0; i < queries; i++) { /* softmax, in vectors counted from the row's own first key */
        int64_t n = end[(i0 + i) % m] - begin[(i0 + i) % m];
        float *pi = p + i * stride;
        for (int l = 0; l < LANES; l++) top[i] = peak[i * LANES + l] > top[i] ? peak[i * LANES + l] : top[i];
        for (int64_t k = n; k < n + EXP_KEYS; k++) pi[k] = -INFINITY; /* the last vectors' padding */
        v8 sum = {0};
        for (int64_t k = 0; k < n; k += EXP_KEYS) { /* summed 8 by 8 as ever: the same bits */
            v8 part[EXP_KEYS / LANES];
#ifdef __AVX512F__
            v16 e;
            memcpy(&e, pi + k, sizeof e);
            e = exp16(e - top[i]);
            memcpy(pi + k, &e, sizeof e);
            memcpy(part, &e, sizeof part);
#else /* v8, not v16: v16 without AVX-512 compiled to a call through memory (AMD EPYC, AVX2) */
            for (int h = 0; h < 4; h++) part[h] = load8(pi + k + LANES * h) - splat8(top[i]);
            exps8(part, 4);
            memcpy(pi + k, part, sizeof part);
#endif
            for (int h = 0; h < EXP_KEYS / LANES; h++) sum += part[h]; /* past n: exp(-inf) = +0, no change */
        }
        total[i] = sum8(sum);
        memset(acc + i * dim, 0, sizeof(float) * (size_t)dim);
    }
    for (int64_t c = lo; c < hi; c += CHUNK) { /* CHUNK values at a time; every query shares each read */
        int64_t stop = c + CHUNK < hi ? c + CHUNK : hi;
        for (int64_t k = c; k < stop; k++) {
            int64_t offset = ((kv_heads + g) * slots + slot[k - lo]) * dim;
            v[k - c] = wide ? (const void *)((const uint16_t *)kv + offset)
                            : (const void *)row(kv, offset, dim, kt + (k - c) * dim, bf);
        }
        for (int64_t i = 0; i < queries; i += 2) { /* two queries at a time, sharing each value load */
            int64_t j = (i0 + i) % m, a = c > begin[j] ? c : begin[j], b = stop < end[j] ? stop : end[j];
            const float *w = p + i * stride - begin[j];
            if (i + 1 == queries) {
                if (a < b) weighted_sum(w + a, b - a, v + a - c, dim, acc + i * dim, wide);
                continue;
            }
            int64_t j2 = (i0 + i + 1) % m, a2 = c > begin[j2] ? c : begin[j2], b2 = stop < end[j2] ? stop : end[j2];
            weighted_pair(w, a, b, p + (i + 1) * stride - begin[j2], a2, b2, v, c, dim, acc + i * dim,
                          acc + (i + 1) * dim, wide);
        }
    }
    for (int64_t i = 0; i < queries; i++) {
        float *r = part + i * pstride;
        memcpy(r, acc + i * dim, sizeof(float) * (size_t)dim);
        r[dim] = top[i], r[dim + 1] = total[i];
    }
    free(begin);
    free(qb);
    free(v);
    free(scratch);
}

/* One forward pass's attention for one layer.
 *   qkv         [batch * seq_len, (heads + 2 * kv_heads) * dim]: q, k, v of each row; q and k are rotated
 *               in place
 *   cos, sin    [positions, dim] RoPE tables (sin carries rotate_half's sign)
 *   kv          the layer's cache [2, kv_heads, slots, dim] (slots = blocks * block_size)
 *   positions   [batch * seq_len] each row's position; write_slots [batch * seq_len] where its k/v go
 *   tables      [batch, max_blocks] each sequence's blocks; num_tokens [batch] its real rows (the rest
 *               of its seq_len rows are padding: written to their slot, output zero)
 *   out         [batch * seq_len, heads * dim]
 * A row at position p attends to keys [max(0, p + 1 - window), p] (window 0: no window). The queries
 * (a row's query heads) of all sequences, span by span, are split over the threads; a query's arithmetic
 * is the same on any. In three parts, so that a team already running (team_layer) can call them:
 * attention_plan on one thread, then attention_share and, after a barrier, attention_merge on each. */
typedef struct {
    void *qkv;
    const void *cos, *sin;
    void *kv;
    int64_t slots;
    const int64_t *positions, *write_slots, *tables;
    int64_t max_blocks, block_size;
    const int64_t *num_tokens;
    int64_t batch, seq_len;
    void *out;
    int64_t heads, kv_heads, dim, window;
    float scale;
    int bf;
    /* attention_plan's: each row's key range [begin, end), each sequence's union [lo, hi), its keys' slots,
     * its spans and where its partials start, the total cost and queries, and the partials (per query and
     * span: the weighted sum of values [dim], the top score, the sum of exps) */
    int64_t *begin, *end, *lo, *hi, **slot, *spans, *parts_at, cost, queries;
    float *partial;
} attention;

/* RoPE, the cache writes, and the split of the work (A's arguments set, the rest made here). */
static void attention_plan(attention *A) {
    int64_t batch = A->batch, seq_len = A->seq_len, heads = A->heads, kv_heads = A->kv_heads, dim = A->dim;
    int64_t rows = batch * seq_len, width = (heads + 2 * kv_heads) * dim, slots = A->slots;
    const int64_t *positions = A->positions, *num_tokens = A->num_tokens;
    int bf = A->bf;
    float *t = malloc(sizeof(float) * (size_t)(dim + LANES));
    size_t elem = bf ? 2 : 4;
    for (int64_t r = 0; r < rows; r++) {
        int64_t pos = positions[r];
        for (int64_t hd = 0; hd < heads + kv_heads; hd++)
            rope(A->qkv, r * width + hd * dim, (const char *)A->cos + pos * dim * elem,
                 (const char *)A->sin + pos * dim * elem, dim, t, bf);
        for (int64_t g = 0; g < kv_heads; g++) {
            char *src = (char *)A->qkv + (r * width + (heads + g) * dim) * elem;
            memcpy((char *)A->kv + ((g * slots) + A->write_slots[r]) * dim * elem, src, dim * elem);
            memcpy((char *)A->kv + (((kv_heads + g) * slots) + A->write_slots[r]) * dim * elem,
                   src + kv_heads * dim * elem, dim * elem);
        }
    }
    free(t);
    int64_t *begin = A->begin = malloc(sizeof(int64_t) * (size_t)(2 * rows + 2 * batch)), *end = A->end = begin + rows;
    int64_t *lo = A->lo = end + rows, *hi = A->hi = lo + batch;
    int64_t **slot = A->slot = malloc(sizeof(int64_t *) * (size_t)batch);
    for (int64_t b = 0; b < batch; b++) {
        int64_t first = b * seq_len, m = num_tokens[b];
        if (m < seq_len) /* padding rows (0.0 is all zero bits in either format) */
            memset((char *)A->out + (first + m) * heads * dim * elem, 0,
                   (size_t)((seq_len - m) * heads * dim) * elem);
        lo[b] = INT64_MAX, hi[b] = 0, slot[b] = NULL;
        if (m == 0) continue;
        for (int64_t j = first; j < first + m; j++) {
            end[j] = positions[j] + 1;
            begin[j] = A->window > 0 && end[j] > A->window ? end[j] - A->window : 0;
            if (begin[j] < lo[b]) lo[b] = begin[j];
            if (end[j] > hi[b]) hi[b] = end[j];
        }
        const int64_t *table = A->tables + b * A->max_blocks;
        slot[b] = malloc(sizeof(int64_t) * (size_t)(hi[b] - lo[b]));
        for (int64_t k = lo[b]; k < hi[b];) { /* key k's cache slot, block by block (no division per key) */
            int64_t block = table[k / A->block_size], off = k % A->block_size;
            for (; off < A->block_size && k < hi[b]; off++, k++) slot[b][k - lo[b]] = block * A->block_size + off;
        }
    }
    /* The keys in spans of SPAN at fixed positions ([0, SPAN), [SPAN, 2 SPAN) ..): each query takes a
     * partial result per span, and the partials are merged in span order. A query's spans, and so its
     * bits, are the same in a 1-row step and in a verification, on any number of threads. Work items
     * (sequence, kv head, span, query), in that order, weighted by the span's keys, split evenly into
     * one contiguous range per thread: a 1-row step's three kv heads go 1.5 to each of 2 threads, where
     * whole kv heads left one thread reading two heads' keys and values. benchmarks/step.py at a
     * 1000-token context (AMD EPYC Zen 3, 2 threads, before / after alternating twice), what is not the
     * linears of a step: int4 draft 1 row 3.07 / 2.66 -> 2.33 / 2.42 ms, 5 rows 7.96 / 7.00 -> 6.81 /
     * 6.77 ms; float32 1 row 3.35 / 3.32 -> 2.95 / 3.07 ms, 5 rows 7.12 / 6.93 -> 6.30 / 6.56 ms. */
    int64_t *spans = A->spans = malloc(sizeof(int64_t) * (size_t)(2 * batch)), *parts_at = A->parts_at = spans + batch;
    int64_t entries = 0;
    A->cost = A->queries = 0;
    for (int64_t b = 0; b < batch; b++) {
        int64_t n = heads * num_tokens[b]; /* the sequence's queries */
        spans[b] = n ? (hi[b] - 1) / SPAN - lo[b] / SPAN + 1 : 0;
        parts_at[b] = entries;
        entries += n * spans[b];
        A->cost += n ? n * (hi[b] - lo[b]) : 0;
        A->queries += n;
    }
    A->partial = malloc(sizeof(float) * (size_t)(entries * (dim + 2)));
}

/* Thread `part` of `parts`: its items' partials (those whose cost starts in its even share). */
static void attention_share(const attention *A, int64_t part, int64_t parts) {
    int64_t group = A->heads / A->kv_heads, width = (A->heads + 2 * A->kv_heads) * A->dim, pstride = A->dim + 2;
    int64_t from = A->cost * part / parts, to = A->cost * (part + 1) / parts, at = 0;
    for (int64_t b = 0; b < A->batch; b++) {
        int64_t m = A->num_tokens[b], per = group * m, first = b * A->seq_len, s0 = A->lo[b] / SPAN;
        int64_t lo = A->lo[b], hi = A->hi[b], spans = A->spans[b];
        for (int64_t g = 0; g < A->kv_heads && m; g++)
            for (int64_t s = 0; s < spans; s++) {
                int64_t a = (s0 + s) * SPAN > lo ? (s0 + s) * SPAN : lo;
                int64_t z = (s0 + s + 1) * SPAN < hi ? (s0 + s + 1) * SPAN : hi, keys = z - a;
                int64_t i0 = from <= at ? 0 : (from - at + keys - 1) / keys;
                int64_t i1 = to <= at ? 0 : (to - at + keys - 1) / keys;
                i0 = i0 < per ? i0 : per, i1 = i1 < per ? i1 : per;
                if (i0 < i1)
                    attend_group(A->qkv, A->kv, A->slots, A->slot[b] + (a - lo), a, z, A->begin + first,
                                 A->end + first, first, m, g, i0, i1, A->heads, A->kv_heads, A->dim, width, A->scale,
                                 A->partial + (A->parts_at[b] + (g * per + i0) * spans + s) * pstride,
                                 spans * pstride, A->bf);
                at += per * keys;
            }
    }
    TILES_ONLY(if (A->bf && granted) _tile_release()); /* tile_scores': not saved at every context switch */
}

/* Thread `part` of `parts`: its even share of the queries merged from their partials, out = sum_s acc_s w_s /
 * sum_s total_s w_s, w_s = exp(top_s - top), top the largest top_s (w = 1 exactly there, so one span's
 * result is acc / total). */
static void attention_merge(const attention *A, int64_t part, int64_t parts) {
    int64_t group = A->heads / A->kv_heads, heads = A->heads, dim = A->dim, pstride = dim + 2;
    int64_t q0 = A->queries * part / parts, q1 = A->queries * (part + 1) / parts, base = 0;
    for (int64_t b = 0; b < A->batch; base += heads * A->num_tokens[b], b++) {
        int64_t m = A->num_tokens[b], per = group * m, n = A->spans[b];
        for (int64_t u = q0 > base ? q0 : base; u < q1 && u < base + heads * m; u++) {
            int64_t g = (u - base) / per, i = (u - base) % per;
            const float *e = A->partial + (A->parts_at[b] + (g * per + i) * n) * pstride;
            float top = -INFINITY, w[n];
            for (int64_t s = 0; s < n; s++) w[s] = e[s * pstride + dim]; /* the span's top score */
            for (int64_t s = 0; s < n; s++) top = w[s] > top ? w[s] : top;
            for (int64_t s = 0; s < n; s++) w[s] = w[s] == top ? 1.0f : expf(w[s] - top);
            float total = e[dim + 1] * w[0];
            for (int64_t s = 1; s < n; s++) total += e[s * pstride + dim + 1] * w[s];
            int64_t head = g * group + i / m, at = (b * A->seq_len + i % m) * heads * dim + head * dim;
            for (int64_t d = 0; d < dim; d += LANES) {
                v8 sum = load8(e + d) * splat8(w[0]);
                for (int64_t s = 1; s < n; s++) sum += load8(e + s * pstride + d) * splat8(w[s]);
                put8(A->out, at + d, sum / total, A->bf);
            }
        }
    }
}

static void attention_done(attention *A) {
    free(A->partial);
    free(A->spans);
    for (int64_t b = 0; b < A->batch; b++) free(A->slot[b]);
    free(A->slot);
    free(A->begin);
}

/* The thread's number and the team's size (0 of 1 outside a parallel region). */
static inline int64_t thread_number(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static inline int64_t team_size(void) {
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

/* A's attention on `threads` threads of a region of its own. */
static void attention_run(attention *A, int threads) {
    attention_plan(A);
#pragma omp parallel num_threads(threads)
    {
        attention_share(A, thread_number(), team_size());
#pragma omp barrier
        attention_merge(A, thread_number(), team_size());
    }
    attention_done(A);
}

void attend(void *qkv, const void *cos, const void *sin, void *kv, int64_t slots, const int64_t *positions,
            const int64_t *write_slots, const int64_t *tables, int64_t max_blocks, int64_t block_size,
            const int64_t *num_tokens, int64_t batch, int64_t seq_len, void *out, int64_t heads, int64_t kv_heads,
            int64_t dim, int64_t window, float scale, int bf, int threads) {
    attention A = {.qkv = qkv, .cos = cos, .sin = sin, .kv = kv, .slots = slots, .positions = positions,
                   .write_slots = write_slots, .tables = tables, .max_blocks = max_blocks, .block_size = block_size,
                   .num_tokens = num_tokens, .batch = batch, .seq_len = seq_len, .out = out, .heads = heads,
                   .kv_heads = kv_heads, .dim = dim, .window = window, .scale = scale, .bf = bf};
    attention_run(&A, threads);
}

/* ---- linears: y [rows, out] = x [rows, in] @ W.T, float32 activations --------------------------------
 * Each output column is one thread's, computed for every row by the same fixed-order loop, so a row's
 * bits depend neither on the other rows nor on the thread count (row-exact). Up to 4 rows (6 for float
 * weights) share each read of a weight row: a k-token verification reads the weights once per 4 (6)
 * tokens, not per token. */

#define ROW_BLOCK 4

/* Float weights, packed at load (native_float.py) in panels of 16 output columns: panel p holds
 * W[16p .. 16p + 15, i] for i = 0 .. in - 1 as [in][16], contiguous, the last panel padded with zero
 * columns. Each output y[r, o] is one float32 lane summed over i in order (a broadcast of x[r, i] times
 * two vectors of the panel), so no reduction across lanes, and its bits depend on nothing but x's row r
 * and W's column o: not on the rows or panels that share a tile, nor on the thread count. A tile keeps
 * 8-12 independent accumulators in registers (the FMA latency needs 8): 4 panels for 1 row, 2 panels
 * for 2-3 rows, 1 panel for up to 6 rows; more rows take a panel in blocks of up to 6, the panel read
 * from the cache after the first. Against the layout before (one weight row per output column, dot
 * products reduced across lanes), a standalone C benchmark of the default model's linear shapes measured
 * 17 vs 20 ms for a 1-row step's linears in float32, 7 vs 11 ms in bfloat16, and 21 vs 26 ms for 6 rows
 * in float32 (AMD EPYC, AVX2, 2 threads): more independent accumulators, one contiguous run per tile. */
#define PANEL 16
#define TILE_ROWS 6
/* Bytes ahead of a tile's reads that it prefetches (past a panel's end: the next panel's start, which
 * the thread reads next; prefetches do not fault). The hardware prefetcher alone left the memory idle
 * while 4-6 rows computed. benchmarks/linears.c (the default model's linears; a 2-core Intel Xeon at
 * 2.6 GHz with AVX-512, no AMX; 2 threads; four runs), cost of 4 / 6 / 8 rows relative to one row:
 *   float32   without (-DAHEAD_F32=0) 1.33-1.39 / 1.42-1.50 / 1.55-1.70x, 4 KB ahead 1.04-1.08 / 1.05-1.11 / 1.29-1.39x
 *   bfloat16  without 1.48-1.60 / 1.62-1.71 / 2.08-2.18x, 8 KB ahead 1.04-1.13 / 1.17-1.20 / 1.66-1.76x
 * One row costs the same either way (22 ms float32, 11-12 ms bfloat16). Not yet measured on AMD EPYC. */
#ifndef AHEAD_F32
#define AHEAD_F32 4096
#endif
#ifndef AHEAD_BF16
#define AHEAD_BF16 8192
#endif

/* A tile's prefetch, AHEAD bytes past panel row i. */
static inline __attribute__((always_inline)) void prefetch_ahead(const char *panel, int64_t i, int bf) {
    __builtin_prefetch(panel + i * PANEL * (bf ? 2 : 4) + (bf ? AHEAD_BF16 : AHEAD_F32), 0, 3);
}

/* Where rows take several tiles per panel, the tiles after the first read the panel from the cache and
 * the memory would idle through them (a 1-row tile's two accumulators wait on the FMA latency); so every
 * tile of such a panel also fetches 1/T of the thread's next panel (T tiles; `next` already offset by this
 * tile's share, `step` its bytes per panel row in 16.16 fixed point) and the memory streams through all
 * of them. benchmarks/linears.c (AMD EPYC Zen 3, AVX2, 2 threads; alternating, six runs each): float32
 * 7 / 8 rows 21.7-24.6 / 21.8-25.8 ms -> 19.0-23.4 / 19.0-23.1 ms (k = 1: 14-18 ms either way); bfloat16
 * 7 / 8 rows 14.4-15.7 / 15.1-15.6 -> 14.0-14.1 / 14.2-14.6 ms (three runs). Into L2 only (prefetcht1) was
 * no better. */
#define STREAM_TILES 4 /* up to 24 rows without AVX-512, 32 with it: verifications, not prompts (over_panels) */
static inline __attribute__((always_inline)) void prefetch_next(const char *next, int64_t i, int64_t step) {
    if (next) __builtin_prefetch(next + ((i * step) >> 16), 0, 3);
}

#ifdef __AVX512F__
/* With AVX-512 a panel row is one register: one accumulator per row and panel, so a tile takes up to 8
 * rows (an 8-token verification reads each panel once) and each FMA covers the 16 columns. Every lane
 * does the AVX2 path's arithmetic in the same order, so the bits are the same on either path (checked
 * against a -mno-avx512f build). benchmarks/linears.c, the Intel Xeon above, three runs: 8 rows cost
 * 1.22-1.27x one row in float32 and 1.33-1.41x in bfloat16, against 1.44-1.72x and 1.56-2.21x for the
 * AVX2 path on the same machine; 4-6 rows about the same on either. */
#undef TILE_ROWS
#define TILE_ROWS 8

/* The lanes of a panel whose first `cols` columns are real (all 16 from 16 on; the rest is padding). */
static inline __mmask16 real_lanes(int64_t cols) {
    return cols >= PANEL ? (__mmask16)0xffff : (__mmask16)((1u << cols) - 1);
}

/* A tile's accumulators (np panels by n rows) -> y, the columns past `cols` left out. */
static inline __attribute__((always_inline)) void store_tile(float *y, int64_t out, int64_t cols,
                                                             __m512 (*acc)[TILE_ROWS], int np, int n) {
    for (int p = 0; p < np; p++) {
        __mmask16 keep = real_lanes(cols - p * PANEL);
        for (int r = 0; r < n; r++) _mm512_mask_storeu_ps(y + r * out + p * PANEL, keep, acc[p][r]);
    }
}

/* Panel row i: 16 weights as float32 (a bfloat16 one widened). */
static inline __m512 panel16(const void *panel, int64_t i, int bf) {
    if (!bf) return _mm512_loadu_ps((const float *)panel + i * PANEL);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)panel + i * PANEL));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* n rows of x times `np` consecutive panels (w: the first) -> y (row stride out; `cols` columns left
 * from the first panel's). Accumulators stay in registers: np * n <= 8, fully unrolled. */
static inline __attribute__((always_inline)) void panel_tile(const float *x, const void *w, float *y, int64_t in,
                                                             int64_t out, int64_t cols, int np, int n, int bf,
                                                             const char *next, int64_t step) {
    __m512 acc[4][TILE_ROWS];
    for (int p = 0; p < np; p++)
        for (int r = 0; r < n; r++) acc[p][r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < in; i++)
        for (int p = 0; p < np; p++) {
            const char *panel = (const char *)w + p * in * PANEL * (bf ? 2 : 4);
            __m512 wi = panel16(panel, i, bf);
            prefetch_ahead(panel, i, bf);
            prefetch_next(next, i, step);
            for (int r = 0; r < n; r++) acc[p][r] = _mm512_fmadd_ps(wi, _mm512_set1_ps(x[r * in + i]), acc[p][r]);
        }
    store_tile(y, out, cols, acc, np, n);
}
#else
/* Half `h` of panel row i: 8 weights as float32 (a bfloat16 one widened). */
static inline v8 panel8(const void *panel, int64_t i, int h, int bf) {
    return bf ? load_bf16((const uint16_t *)panel + i * PANEL + h * LANES)
              : load8((const float *)panel + i * PANEL + h * LANES);
}

/* Columns [o, o + 16) of y's row (`cols` of them exist): a panel's two accumulators. */
static inline void store_panel(float *y, v8 lo, v8 hi, int64_t cols) {
    if (cols >= PANEL) {
        memcpy(y, &lo, sizeof lo);
        memcpy(y + LANES, &hi, sizeof hi);
        return;
    }
    float t[PANEL];
    memcpy(t, &lo, sizeof lo);
    memcpy(t + LANES, &hi, sizeof hi);
    memcpy(y, t, sizeof(float) * (size_t)cols);
}

/* n rows of x times `np` consecutive panels (w: the first) -> y (row stride out; `cols` columns left
 * from the first panel's). Accumulators stay in registers: np * n <= 6, fully unrolled. */
static inline __attribute__((always_inline)) void panel_tile(const float *x, const void *w, float *y, int64_t in,
                                                             int64_t out, int64_t cols, int np, int n, int bf,
                                                             const char *next, int64_t step) {
    v8 acc[4][2][TILE_ROWS];
    for (int p = 0; p < np; p++)
        for (int r = 0; r < n; r++) acc[p][0][r] = acc[p][1][r] = (v8){0};
    for (int64_t i = 0; i < in; i++)
        for (int p = 0; p < np; p++) {
            const char *panel = (const char *)w + p * in * PANEL * (bf ? 2 : 4);
            v8 lo = panel8(panel, i, 0, bf), hi = panel8(panel, i, 1, bf);
#ifdef __AVX__
            if (n == TILE_ROWS) /* in registers, not reloaded by each FMA (a prompt's tiles: ~6 % faster) */
                __asm__("" : "+x"(lo), "+x"(hi));
#endif
            prefetch_ahead(panel, i, bf);
            prefetch_next(next, i, step);
            for (int r = 0; r < n; r++) {
                v8 xi = splat8(x[r * in + i]);
                acc[p][0][r] = fma8(acc[p][0][r], lo, xi);
                acc[p][1][r] = fma8(acc[p][1][r], hi, xi);
            }
        }
    for (int p = 0; p < np; p++)
        for (int r = 0; r < n; r++) store_panel(y + r * out + p * PANEL, acc[p][0][r], acc[p][1][r], cols - p * PANEL);
}

#endif

/* tile(args..., n) with the row count n (1 .. TILE_ROWS) a constant, so each case unrolls on its own. */
#if TILE_ROWS > 6
#define BY_ROWS(n, tile, ...)                                                                                         \
    switch (n) {                                                                                                      \
    case 1: tile(__VA_ARGS__, 1); break;                                                                              \
    case 2: tile(__VA_ARGS__, 2); break;                                                                              \
    case 3: tile(__VA_ARGS__, 3); break;                                                                              \
    case 4: tile(__VA_ARGS__, 4); break;                                                                              \
    case 5: tile(__VA_ARGS__, 5); break;                                                                              \
    case 6: tile(__VA_ARGS__, 6); break;                                                                              \
    case 7: tile(__VA_ARGS__, 7); break;                                                                              \
    default: tile(__VA_ARGS__, 8); break;                                                                             \
    }
#else
#define BY_ROWS(n, tile, ...)                                                                                         \
    switch (n) {                                                                                                      \
    case 1: tile(__VA_ARGS__, 1); break;                                                                              \
    case 2: tile(__VA_ARGS__, 2); break;                                                                              \
    case 3: tile(__VA_ARGS__, 3); break;                                                                              \
    case 4: tile(__VA_ARGS__, 4); break;                                                                              \
    case 5: tile(__VA_ARGS__, 5); break;                                                                              \
    default: tile(__VA_ARGS__, 6); break;                                                                             \
    }
#endif

/* Rows for the next tile when `left` remain: all of them up to TILE_ROWS, else two even tiles, else a
 * full one (9 rows on AVX-512: 5 + 4, not 8 + 1). */
static inline int tile_rows(int64_t left) {
    return left <= TILE_ROWS ? (int)left : left < 2 * TILE_ROWS ? (int)(left + 1) / 2 : TILE_ROWS;
}

/* tile_rows for a layout: on AVX2, float32 panels take full tiles first (7 rows: 6 + 1, 8: 6 + 2), the
 * 6-row tile working at the memory's pace and the small one reading the panel from the cache. Alternated
 * in one process (benchmarks/linears.c's shapes, AMD EPYC Zen 3, 2 threads, four runs), 7 / 8 rows took
 * 22.6-26.7 / 22.2-27.0 ms so against 25.0-28.1 / 26.2-31.1 ms in two even tiles; bfloat16 panels, whose
 * every tile widens the weights again, ran 0-12 % slower so and keep even tiles. */
static inline int layout_rows(int64_t left, int full_first) {
    return TILE_ROWS == 6 && full_first && left > TILE_ROWS ? TILE_ROWS : tile_rows(left);
}

/* bfloat16 weights on bfloat16 activations with AVX512-BF16 (vdpbf16ps: 32 multiply-adds per instruction,
 * two per output column, against 16 after two widening ops in the panels above), packed at load (native_float.py)
 * in pair panels of 16 output columns: pair row j of panel p holds (W[o, 2j], W[o, 2j + 1]) for
 * o = 16p .. 16p + 15, 64 bytes, the last panel padded with zero columns. Each output is one float32
 * lane that vdpbf16ps adds both products of a pair to, pair after pair in order, so a row's bits depend
 * only on its own x and W's column, as above (row-exact); they differ from linear_dense's in order
 * and in vdpbf16ps's flushing of subnormals, so a model's bfloat16 bits depend on the kernel `auto`
 * picked, and plain and speculative passes share it. x holds bfloat16 values widened to float32
 * (exact): it is narrowed back without rounding. */
int bf16_pairs(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

#ifdef __AVX512BF16__
/* n rows of x (bfloat16, pairs as int32) times `np` consecutive pair panels (w: the first) -> y. */
static inline __attribute__((always_inline)) void pair_tile(const int32_t *x, const uint16_t *w, float *y,
                                                            int64_t in, int64_t out, int64_t cols, int np, int n,
                                                            const char *next, int64_t step) {
    __m512 acc[4][TILE_ROWS];
    int64_t half = in / 2;
    for (int p = 0; p < np; p++)
        for (int r = 0; r < n; r++) acc[p][r] = _mm512_setzero_ps();
    for (int64_t j = 0; j < half; j++)
        for (int p = 0; p < np; p++) {
            const uint16_t *panel = w + p * in * PANEL;
            __m512bh wj = (__m512bh)_mm512_loadu_si512((const void *)(panel + j * 2 * PANEL));
            __builtin_prefetch((const char *)(panel + j * 2 * PANEL) + AHEAD_BF16, 0, 3);
            prefetch_next(next, 2 * j, step);
            for (int r = 0; r < n; r++)
                acc[p][r] = _mm512_dpbf16_ps(acc[p][r], wj, (__m512bh)_mm512_set1_epi32(x[r * half + j]));
        }
    store_tile(y, out, cols, acc, np, n);
}
#endif

typedef uint8_t u8x8 __attribute__((vector_size(8)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

/* 8 bytes -> their low and high nibbles as floats; the nibbles are split after widening to 32 bits,
 * where AVX2 has the shifts (byte vectors have none, and the compiler would go one byte at a time). */
static inline void nibbles(const uint8_t *p, v8 *low, v8 *high) {
#ifdef __AVX2__ /* one vpmovzxbd: the generic conversion below compiles to a byte-by-byte insert */
    i32x8 w = (i32x8)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    u8x8 b;
    memcpy(&b, p, sizeof b);
    i32x8 w = __builtin_convertvector(b, i32x8);
#endif
    *low = __builtin_convertvector(w & 15, v8);
    *high = __builtin_convertvector(w >> 4, v8);
}

/* Float32 weights kept as the 4-bit or 8-bit codes they were dequantized from (kernels/native_codes.py),
 * in panels of 16 output columns as above, a block per group of 32 inputs: for CODES4 the 16 columns'
 * scales d and offsets m (float16), then 16 rows of 16 bytes, byte j of row t holding column j's code
 * for input 2t in its low nibble and for input 2t + 1 in its high one; for CODES8 the scales, then 32
 * rows of 16 int8 codes. A weight is rebuilt in registers as q * d + m (CODES4) or q * d (CODES8): d
 * has a float16's few significant bits, so q * d is exact and the one rounding of the sum gives the
 * float32 the checkpoint holds (native_codes.py checks every weight at load). Then each output is
 * summed over the inputs in order as in panel_tile, so the bits are linear_dense's on the float32
 * weights, from 0.625 (CODES4) or 1.0625 (CODES8) bytes a weight instead of 4. */
#define CODE_GROUP 32
#ifndef CODES_AHEAD
#define CODES_AHEAD 1280 /* bytes a block prefetches ahead (4 blocks of CODES4) */
#endif
#define SCALES (2 * PANEL) /* bytes of a block's 16 float16 scales (and again of its offsets) */
static inline int64_t code_block(int bits) { return SCALES * (bits == 4 ? 2 : 1) + PANEL * CODE_GROUP * bits / 8; }

static inline void prefetch_block(const uint8_t *b, int64_t bytes) {
    for (int64_t l = 0; l < bytes; l += 64) __builtin_prefetch(b + l + CODES_AHEAD, 0, 3);
}

#ifdef __AVX512F__
/* A block's scales d and offsets m (0 for CODES8) for the two halves of its rows: each half all 16
 * columns (float32 panels), or, pairs, lane k column k / 2 in the first half and 8 + k / 2 in the second
 * (pair_code_tile). */
typedef struct {
    __m512 d0, m0, d1, m1;
} block_scales;
static inline __attribute__((always_inline)) block_scales scales_of(const uint8_t *b, int bits, int pairs) {
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b)), m = _mm512_setzero_ps();
    if (bits == 4) m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + SCALES)));
    if (!pairs) return (block_scales){d, m, d, m};
    const __m512i low = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i high = _mm512_add_epi32(low, _mm512_set1_epi32(8));
    return (block_scales){_mm512_permutexvar_ps(low, d), _mm512_permutexvar_ps(low, m), _mm512_permutexvar_ps(high, d),
                          _mm512_permutexvar_ps(high, m)};
}

/* Rows 2t and 2t + 1 of block b rebuilt in float32 (CODES4: byte j's low and high nibble; CODES8: bytes
 * 0-15 and 16-31): q * d + m, exact up to the one rounding to the checkpoint's float32. */
static inline __attribute__((always_inline)) void rebuild_rows(const uint8_t *b, int t, int bits, block_scales s,
                                                               __m512 *w0, __m512 *w1) {
    if (bits == 4) {
        __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 2 * SCALES + 16 * t)));
        /* q as a float by a 16-entry table (vpermps reads an index's low 4 bits: the low nibble needs no
         * mask) rather than a conversion: one op less per 32 weights, and on Intel's port 5 rather than
         * port 0, which the conversions and shifts crowd. A rebuild-bound loop (benchmarks/linears.c mode
         * 5, the layers alone, 1 thread, the Xeon with AMX) took 8.6 ms against 9.9; the same floats. */
        const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        *w0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(c, q), s.d0, s.m0);
        *w1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), q), s.d1, s.m1);
    } else {
        const __m128i *c = (const __m128i *)(b + SCALES + 32 * t);
        *w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(c))), s.d0);
        *w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(c + 1))), s.d1);
    }
}

/* n rows of x times `np` consecutive code panels (w: the first) -> y, as panel_tile. Not yet timed: each
 * row's two FMAs per pair of inputs go to one sum, back to back, and 4-8 rows take one panel, so a 4-row
 * tile keeps only 4 sums in flight (the AVX2 tile below gained ~1.5x at 4 rows from fixing the same). */
static inline __attribute__((always_inline)) void code_tile(const float *x, const uint8_t *w, float *y, int64_t in,
                                                            int64_t out, int64_t cols, int np, int n, int bits,
                                                            const char *next, int64_t step) {
    __m512 acc[4][TILE_ROWS];
    int64_t groups = in / CODE_GROUP, block = code_block(bits), bytes = groups * block;
    for (int p = 0; p < np; p++)
        for (int r = 0; r < n; r++) acc[p][r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++)
        for (int p = 0; p < np; p++) {
            const uint8_t *b = w + p * bytes + g * block;
            const float *xg = x + g * CODE_GROUP;
            prefetch_block(b, block);
            block_scales sc = scales_of(b, bits, 0);
            if (bits == 4) {
                for (int t = 0; t < CODE_GROUP / 2; t++) {
                    __m512 w0, w1;
                    rebuild_rows(b, t, 4, sc, &w0, &w1);
                    prefetch_next(next, g * CODE_GROUP + 2 * t, step);
                    for (int r = 0; r < n; r++) {
                        acc[p][r] = _mm512_fmadd_ps(w0, _mm512_set1_ps(xg[r * in + 2 * t]), acc[p][r]);
                        acc[p][r] = _mm512_fmadd_ps(w1, _mm512_set1_ps(xg[r * in + 2 * t + 1]), acc[p][r]);
                    }
                }
            } else
                for (int t = 0; t < CODE_GROUP; t++) {
                    __m128i c = _mm_loadu_si128((const __m128i *)(b + SCALES + 16 * t));
                    __m512 wt = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c)), sc.d0);
                    prefetch_next(next, g * CODE_GROUP + t, step);
                    for (int r = 0; r < n; r++)
                        acc[p][r] = _mm512_fmadd_ps(wt, _mm512_set1_ps(xg[r * in + t]), acc[p][r]);
                }
        }
    store_tile(y, out, cols, acc, np, n);
}
#else
/* 8 int8 codes -> floats. */
static inline v8 codes8(const int8_t *p) {
#ifdef __AVX2__
    return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    int8_t b[LANES];
    memcpy(b, p, sizeof b);
    v8 v;
    for (int l = 0; l < LANES; l++) v[l] = b[l];
    return v;
#endif
}

/* 8 float16 values (the bytes at p) -> float32 (exact). */
static inline v8 half8(const uint8_t *p) {
#ifdef __F16C__
    return (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    v8 v;
    for (int l = 0; l < LANES; l++) {
        uint16_t h;
        memcpy(&h, p + 2 * l, sizeof h);
        uint32_t sign = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 31, f = h & 1023;
        float x = e == 31 ? (f ? NAN : INFINITY) : e ? ldexpf((float)(f | 1024), (int)e - 25) : ldexpf((float)f, -24);
        uint32_t u;
        memcpy(&u, &x, sizeof u);
        u |= sign;
        memcpy(&v[l], &u, sizeof u);
    }
    return v;
#endif
}

/* Half h (columns 8h .. 8h + 7) of rows 2t and 2t + 1 of CODES4 block b rebuilt in float32, q * d + m: the
 * one rebuild of code_tile, wide_rows and rebuild_panel. */
static inline __attribute__((always_inline)) void rebuild_half(const uint8_t *b, int t, int h, v8 d, v8 m, v8 *w0,
                                                               v8 *w1) {
    v8 q0, q1;
    nibbles(b + 2 * SCALES + 16 * t + LANES * h, &q0, &q1);
    *w0 = fma8(m, q0, d), *w1 = fma8(m, q1, d);
}

/* 6 rows of a CODES4 tile, inputs 2t and 2t + 1 (b: the block, xt: x + 2t; dm: the block's scales and
 * offsets, both halves, as floats): 12 sums, one input at a time, its two weight halves rebuilt from a
 * fresh load of the codes, scales and offsets. Both inputs' four halves at once, as code_tile does for
 * fewer rows, would need 12 sums, 4 weights, 4 scales and offsets and a broadcast: more than the 16
 * registers, and that tile spilled its sums. Each sum takes the same FMAs in the same order, and each
 * weight the same rebuild, so the same bits. benchmarks/linears.c mode 6 (AMD EPYC Zen 3, 2 threads,
 * alternating, best of 4-8 runs, two sittings): 6 rows 12.2-12.9 -> 11.6-12.0 ms from memory,
 * 10.7-11.2 -> 9.9-10.1 ms in the cache; 5 rows (10 sums, which fit beside the 4 weights) ran 5 % slower
 * this way and keep code_tile's order. */
static inline __attribute__((always_inline)) void wide_rows(v8 (*acc)[TILE_ROWS], const uint8_t *b, int t,
                                                            const float *dm, const float *xt, int64_t in, int n) {
    for (int j = 0; j < 2; j++) {
        const uint8_t *bj = b;
        const float *sj = dm;
        __asm__ volatile("" : "+r"(bj), "+r"(sj)); /* loaded again for each input: registers are short */
        v8 w[2];
        for (int h = 0; h < 2; h++) {
            v8 w0, w1;
            rebuild_half(bj, t, h, load8(sj + LANES * h), load8(sj + 2 * LANES + LANES * h), &w0, &w1);
            w[h] = j ? w1 : w0;
        }
        for (int r = 0; r < n; r++) {
            v8 xi = splat8(xt[r * in + j]);
            acc[0][r] = fma8(acc[0][r], w[0], xi);
            acc[1][r] = fma8(acc[1][r], w[1], xi);
        }
    }
}

/* n rows of x times `np` consecutive code panels (w: the first) -> y, as panel_tile (each lane the same
 * arithmetic as the AVX-512 path's). */
static inline __attribute__((always_inline)) void code_tile(const float *x, const uint8_t *w, float *y, int64_t in,
                                                            int64_t out, int64_t cols, int np, int n, int bits,
                                                            const char *next, int64_t step) {
    v8 acc[4][2][TILE_ROWS];
    int64_t groups = in / CODE_GROUP, block = code_block(bits), bytes = groups * block;
    for (int p = 0; p < np; p++)
        for (int r = 0; r < n; r++) acc[p][0][r] = acc[p][1][r] = (v8){0};
    for (int64_t g = 0; g < groups; g++)
        for (int p = 0; p < np; p++) {
            const uint8_t *b = w + p * bytes + g * block;
            const float *xg = x + g * CODE_GROUP;
            prefetch_block(b, block);
            v8 d[2] = {half8(b), half8(b + 2 * LANES)};
            if (bits == 4) {
                v8 m[2] = {half8(b + SCALES), half8(b + SCALES + 2 * LANES)};
                float dm[4 * LANES] __attribute__((aligned(32))); /* d and m for wide_rows */
                if (n == TILE_ROWS) memcpy(dm, d, sizeof d), memcpy(dm + 2 * LANES, m, sizeof m);
                for (int t = 0; t < CODE_GROUP / 2; t++) {
                    prefetch_next(next, g * CODE_GROUP + 2 * t, step);
                    if (n == TILE_ROWS) { /* see wide_rows */
                        wide_rows(acc[p], b, t, dm, xg + 2 * t, in, n);
                        continue;
                    }
                    v8 w0[2], w1[2];
                    for (int h = 0; h < 2; h++) rebuild_half(b, t, h, d[h], m[h], &w0[h], &w1[h]);
                    /* All four weight vectors first, then each row's input 2t into both halves before its
                     * input 2t + 1: a sum's next FMA never waits on the one just issued. Halves one after
                     * the other (each row's two FMAs back to back, on the FMA's latency) ran a 4-row tile
                     * in the cache at about half the FMA ports' peak, this at 80-86 %; the same sums in the
                     * same order. benchmarks/linears.c mode 6 (AMD EPYC Zen 3, 2 threads, best of six runs
                     * alternating the two): 4 / 8 rows 12.5 / 23.6 -> 8.8 / 17.0 ms, 1 row 6.7-6.8 either
                     * way; in the cache (`hot`) 10.7 / 21.0 -> 6.6 / 13.0 ms. */
                    for (int r = 0; r < n; r++) {
                        v8 x0 = splat8(xg[r * in + 2 * t]), x1 = splat8(xg[r * in + 2 * t + 1]);
                        acc[p][0][r] = fma8(acc[p][0][r], w0[0], x0);
                        acc[p][1][r] = fma8(acc[p][1][r], w0[1], x0);
                        acc[p][0][r] = fma8(acc[p][0][r], w1[0], x1);
                        acc[p][1][r] = fma8(acc[p][1][r], w1[1], x1);
                    }
                }
            } else
                for (int t = 0; t < CODE_GROUP; t++) {
                    const int8_t *c = (const int8_t *)(b + SCALES + 16 * t);
                    v8 w0 = codes8(c) * d[0], w1 = codes8(c + LANES) * d[1];
                    prefetch_next(next, g * CODE_GROUP + t, step);
                    for (int r = 0; r < n; r++) {
                        v8 xi = splat8(xg[r * in + t]);
                        acc[p][0][r] = fma8(acc[p][0][r], w0, xi);
                        acc[p][1][r] = fma8(acc[p][1][r], w1, xi);
                    }
                }
        }
    for (int p = 0; p < np; p++)
        for (int r = 0; r < n; r++) store_panel(y + r * out + p * PANEL, acc[p][0][r], acc[p][1][r], cols - p * PANEL);
}
#endif

#ifdef __AVX512BF16__
/* bfloat16 weights rounded from such codes (a bfloat16 model loaded from a 4-bit or 8-bit checkpoint):
 * the same blocks, the codes in pair panels' order. Pair row t of a group (inputs 2t and 2t + 1) holds
 * for lane k of 16 the code of column k / 2 (CODES4: byte k's low nibble; CODES8: byte k) and of column
 * 8 + k / 2 (its high nibble; byte 16 + k), each for input 2t + k % 2. The two halves are rebuilt in
 * float32 as above (the checkpoint's float32), and vcvtne2ps2bf16 rounds them to nearest even, as torch
 * rounds a float32 model to bfloat16 (it flushes subnormals, which weights that are multiples of
 * float16's 2^-24 never are), into one pair row of pair_tile's order: the sums are pair_tile's bit for
 * bit, from 0.625 (CODES4) or 1.0625 (CODES8) bytes a weight instead of 2. */
static inline __attribute__((always_inline)) void pair_code_tile(const int32_t *x, const uint8_t *w, float *y,
                                                                 int64_t in, int64_t out, int64_t cols, int np, int n,
                                                                 int bits, const char *next, int64_t step) {
    __m512 acc[4][TILE_ROWS];
    int64_t groups = in / CODE_GROUP, block = code_block(bits), bytes = groups * block, half = in / 2;
    for (int p = 0; p < np; p++)
        for (int r = 0; r < n; r++) acc[p][r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++)
        for (int p = 0; p < np; p++) {
            const uint8_t *b = w + p * bytes + g * block;
            const int32_t *xg = x + g * CODE_GROUP / 2;
            prefetch_block(b, block);
            block_scales sc = scales_of(b, bits, 1);
            for (int t = 0; t < CODE_GROUP / 2; t++) {
                __m512 wl, wh;
                rebuild_rows(b, t, bits, sc, &wl, &wh);
                __m512bh wt = _mm512_cvtne2ps_pbh(wh, wl); /* columns 0-7 from wl, 8-15 from wh */
                prefetch_next(next, g * CODE_GROUP + 2 * t, step);
                for (int r = 0; r < n; r++)
                    acc[p][r] = _mm512_dpbf16_ps(acc[p][r], wt, (__m512bh)_mm512_set1_epi32(xg[r * half + t]));
            }
        }
    store_tile(y, out, cols, acc, np, n);
}
#endif

#ifdef __AVX512F__
/* A prompt's many row tiles each rebuilding a code panel: instead the panel is rebuilt once (the same
 * float32 weights, rounded to bfloat16 into pair rows for PANELS_PAIR_CODES*) into `dst`, laid out as
 * panel_tile's float32 panel or pair_tile's pair panel, which then run every tile: the same products in
 * the same order, so the same bits. */
static void rebuild_panel(const uint8_t *w, int64_t in, int bits, int pairs, void *dst) {
    int64_t block = code_block(bits);
    for (int64_t g = 0; g < in / CODE_GROUP; g++) {
        const uint8_t *b = w + g * block;
        block_scales sc = scales_of(b, bits, pairs);
        for (int t = 0; t < CODE_GROUP / 2; t++) { /* rows 2t and 2t + 1 (pairs: one pair row) */
            __m512 w0, w1;
            rebuild_rows(b, t, bits, sc, &w0, &w1);
#ifdef __AVX512BF16__
            if (pairs) { /* pair row g * 16 + t */
                __m512i row = (__m512i)_mm512_cvtne2ps_pbh(w1, w0);
                _mm512_storeu_si512((uint16_t *)dst + (g * CODE_GROUP / 2 + t) * 2 * PANEL, row);
                continue;
            }
#endif
            _mm512_storeu_ps((float *)dst + (g * CODE_GROUP + 2 * t) * PANEL, w0);
            _mm512_storeu_ps((float *)dst + (g * CODE_GROUP + 2 * t + 1) * PANEL, w1);
        }
    }
}
#else
/* rebuild_panel on 8-lane halves, float32 only (pair panels need AVX512-BF16): each weight rebuilt as
 * code_tile rebuilds it, so panel_tile's sums are code_tile's bit for bit. A prompt's rows then take
 * 6-row tiles of one panel, its weights in registers, where each code tile rebuilt the panel again:
 * the default model's 30 layers on 256 rows of codes (benchmarks/linears.c ... prompt, AMD EPYC Zen 3,
 * 2 threads, best of six runs alternating) took 1.12 ms a row against 1.62 on the code tiles, near the
 * FMA ports' peak (~1.1 ms a row). */
static void rebuild_panel(const uint8_t *w, int64_t in, int bits, int pairs, void *dst) {
    (void)pairs;
    int64_t block = code_block(bits);
    float *out = dst;
    for (int64_t g = 0; g < in / CODE_GROUP; g++) {
        const uint8_t *b = w + g * block;
        float *rows = out + g * CODE_GROUP * PANEL;
        v8 d[2] = {half8(b), half8(b + 2 * LANES)};
        if (bits == 4) {
            v8 m[2] = {half8(b + SCALES), half8(b + SCALES + 2 * LANES)};
            for (int t = 0; t < CODE_GROUP / 2; t++)
                for (int h = 0; h < 2; h++) {
                    v8 w0, w1;
                    rebuild_half(b, t, h, d[h], m[h], &w0, &w1);
                    memcpy(rows + 2 * t * PANEL + LANES * h, &w0, sizeof w0);
                    memcpy(rows + (2 * t + 1) * PANEL + LANES * h, &w1, sizeof w1);
                }
        } else
            for (int t = 0; t < CODE_GROUP; t++)
                for (int h = 0; h < 2; h++) {
                    v8 wt = codes8((const int8_t *)(b + SCALES + 16 * t + LANES * h)) * d[h];
                    memcpy(rows + t * PANEL + LANES * h, &wt, sizeof wt);
                }
    }
}
#endif

/* the layouts over_panels runs */
enum { PANELS_F32, PANELS_BF16, PANELS_PAIRS, PANELS_CODES4, PANELS_CODES8, PANELS_PAIR_CODES4, PANELS_PAIR_CODES8 };

/* One tile of `layout` with np and n known to the compiler (each case unrolled on its own). */
#ifdef __AVX512BF16__
#define PAIR_TILE(np, n) pair_tile((const int32_t *)(xb + r * in), wp, yr, in, out, cols, np, n, next, step)
#define PAIR_CODE_TILE(np, n, bits) \
    pair_code_tile((const int32_t *)(xb + r * in), wp, yr, in, out, cols, np, n, bits, next, step)
#else
#define PAIR_TILE(np, n) (void)0
#define PAIR_CODE_TILE(np, n, bits) (void)0
#endif
#define TILE(np, n)                                                                                                   \
    (kind == PANELS_PAIRS         ? PAIR_TILE(np, n)                                                                  \
     : kind == PANELS_PAIR_CODES4 ? PAIR_CODE_TILE(np, n, 4)                                                          \
     : kind == PANELS_PAIR_CODES8 ? PAIR_CODE_TILE(np, n, 8)                                                          \
     : kind == PANELS_CODES4      ? code_tile(xr, wp, yr, in, out, cols, np, n, 4, next, step)                        \
     : kind == PANELS_CODES8      ? code_tile(xr, wp, yr, in, out, cols, np, n, 8, next, step)                        \
     : kind == PANELS_BF16        ? panel_tile(xr, wp, yr, in, out, cols, np, n, 1, next, step)                       \
                                   : panel_tile(xr, wp, yr, in, out, cols, np, n, 0, next, step))

#ifdef __AVX512F__
/* A prompt's rows (float32) over code panels of `bits`: four panels at a time rebuilt to float32, then
 * tiles of 6 rows by the four (24 accumulators: a broadcast of x feeds four FMAs, where one panel's 8-row
 * tiles loaded an x element per FMA and ran at about a third of the FMA units' rate). Each output is
 * panel_tile's lane, summed over the inputs in order, so the same bits. */
#define PROMPT_ONE(j, k) \
    panel_tile(xr, own + (j) * in * PANEL, yr + (j) * PANEL, in, out, cols - (j) * PANEL, 1, k, 0, NULL, 0)
static void prompt_panels(const float *x, const void *w, float *y, int64_t rows, int64_t in, int64_t out, int bits,
                          size_t bytes, int threads) {
    int64_t panels = (out + PANEL - 1) / PANEL;
#pragma omp parallel num_threads(threads)
    {
        float *own = aligned_alloc(64, sizeof(float) * (size_t)(4 * in * PANEL));
#pragma omp for schedule(static)
        for (int64_t g = 0; g < (panels + 3) / 4; g++) {
            int64_t p = 4 * g, np = panels - p < 4 ? panels - p : 4, cols = out - p * PANEL;
            for (int64_t j = 0; j < np; j++)
                rebuild_panel((const uint8_t *)w + (p + j) * bytes, in, bits, 0, own + j * in * PANEL);
            for (int64_t r = 0; r < rows;) {
                int n = rows - r < 6 ? (int)(rows - r) : 6;
                const float *xr = x + r * in;
                float *yr = y + r * out + p * PANEL;
                if (np == 4 && n == 6)
                    panel_tile(xr, own, yr, in, out, cols, 4, 6, 0, NULL, 0);
                else
                    for (int64_t j = 0; j < np; j++) BY_ROWS(n, PROMPT_ONE, j);
                r += n;
            }
        }
        free(own);
    }
}
#endif

/* Panels a tile of over_panels takes for `rows` rows of `layout`: 4 for one row; 2 for 2-3 rows of float32
 * weights, or of any layout with AVX-512; else 1. But code panels on AVX-512 take 1 wherever that measured
 * faster (below).
 * Without AVX-512, 2 bfloat16 panels by 3 rows need 12 accumulators, 4 widened weight halves and a
 * broadcast: more than the 16 registers, so that tile spilled; 3 such rows take one panel at a time.
 * benchmarks/linears.c mode 1 (AMD EPYC Zen 3, three runs alternating): 3 rows 11.1-11.4 -> 7.9-9.0
 * ms, 1.31-1.58x -> 1.06-1.13x of one row. 2 rows too: benchmarks/step.py (the default model in
 * bfloat16, 78-token context, two runs each) 12.4-12.7 -> 9.6-10.4 ms of linears against 10.0 for one
 * row; linears.c 9.6-10.4 -> 8.9-9.3 ms. Float32 weights are FMA memory operands and keep 2 panels for
 * up to 3 rows (1 panel: 2 / 3 rows 18.8 / 19.6-21.4 ms against 16.9-19.6 / 14.6-19.8 in step.py).
 * On AVX-512 the code panels (4-bit and 8-bit, float32 and pair order) stream best one panel at a time
 * (benchmarks/linears.c modes 4 and 6, AMD EPYC Zen 4, 2 threads, three runs alternating, ms for the
 * default model's linears): bfloat16 1 / 2 / 3 rows 5.8-6.2 / 6.7-7.5 / 6.3-7.5 on 4 / 2 / 2 panels
 * against 4.8-4.9 / 5.3-5.7 / 5.0-6.2 on one; float32 2 / 3 rows 6.3-6.4 / 6.9-8.3 against 5.3-5.8 /
 * 5.5-6.1, and 1 row alike either way (5.1-5.3 on 4, 5.2-5.5 on one: its one sum waits on each FMA), so
 * it keeps 4. Two panels for 4-8 rows (up to 16 sums) ran 1.5-1.8x slower. Any span gives the same bits. */
static inline int64_t panel_span(int64_t rows, int layout) {
    if (TILE_ROWS == 8 && (layout == PANELS_PAIR_CODES4 || layout == PANELS_PAIR_CODES8)) return 1;
    if (TILE_ROWS == 8 && (layout == PANELS_CODES4 || layout == PANELS_CODES8)) return rows == 1 ? 4 : 1;
    int64_t paired = TILE_ROWS == 6 && layout != PANELS_F32 ? 1 : 3; /* the most rows 2 panels take */
    return rows == 1 ? 4 : rows <= paired ? 2 : 1;
}

/* y [rows, out] = x [rows, in] @ W.T over panels of `layout` (xb: x narrowed to bfloat16, for pair
 * panels): groups of 1-4 panels (panel_span) split over the threads, each group's rows in tiles of up to
 * TILE_ROWS. */
static inline __attribute__((always_inline)) void over_panels(const float *x, const uint16_t *xb, const void *w,
                                                              float *y, int64_t rows, int64_t in, int64_t out,
                                                              int layout, int threads) {
    int64_t panels = (out + PANEL - 1) / PANEL, span = panel_span(rows, layout);
    int codes = layout == PANELS_CODES4 || layout == PANELS_PAIR_CODES4   ? 4
                : layout == PANELS_CODES8 || layout == PANELS_PAIR_CODES8 ? 8
                                                                          : 0;
    size_t bytes = codes ? (size_t)(in / CODE_GROUP * code_block(codes)) /* one panel */
                         : (size_t)(in * PANEL) * (layout == PANELS_F32 ? 4 : 2);
    /* Tiles per panel. From 2 to STREAM_TILES (then span is 1) each prefetches its share of the next panel.
     * A prompt's many tiles per panel are compute-bound and gain nothing from it: with it, a 600-token fp32
     * prefill took 1093-1167 ms against 963-1018 without in one reading (best of 5, alternating twice); a
     * C harness of 512-row linears could not tell them apart from the VM's noise (95-120 ms either way). */
    int64_t tiles = 0;
    for (int64_t r = 0; r < rows; tiles++) r += layout_rows(rows - r, layout == PANELS_F32);
    int stream = tiles > 1 && tiles <= STREAM_TILES;
    int64_t step = stream ? (int64_t)((bytes / (size_t)in) << 16) / tiles : 0;
    int pairs = layout == PANELS_PAIR_CODES4 || layout == PANELS_PAIR_CODES8;
    int rebuild = codes && tiles > STREAM_TILES; /* a prompt's code panels, each rebuilt once */
    (void)xb;
#ifdef __AVX512F__
    if (rebuild && !pairs) {
        prompt_panels(x, w, y, rows, in, out, codes, bytes, threads);
        return;
    }
#endif
    /* Each thread an even, contiguous share of the panels, in groups of `span` and then one panel at a
     * time: whole groups split unevenly where their count is odd (the default model's o and down
     * projections are 9 groups of 4 panels for one row: 5 on one thread, 4 on the other). */
#pragma omp parallel num_threads(threads)
    {
        int64_t part = thread_number(), parts = team_size();
        int64_t last = panels * (part + 1) / parts;
        for (int64_t p = panels * part / parts; p < last;) {
            int np = last - p >= span ? (int)span : 1; /* a short last group: one panel at a time */
            const void *wp = (const char *)w + p * bytes;
            int64_t cols = out - p * PANEL;
            const char *following = stream && p + 1 < panels ? (const char *)wp + bytes : NULL;
            int kind = layout; /* the layout the tiles read */
            void *own = NULL;
            if (rebuild && np == 1) {
                own = aligned_alloc(64, (size_t)(in * PANEL) * (pairs ? 2 : 4));
                rebuild_panel(wp, in, codes, pairs, own);
                wp = own, kind = pairs ? PANELS_PAIRS : PANELS_F32;
            }
            for (int64_t r = 0, t = 0; r < rows; t++) {
                int n = layout_rows(rows - r, layout == PANELS_F32);
                const float *xr = x + r * in;
                float *yr = y + r * out + p * PANEL;
                const char *next = following ? following + (size_t)t * bytes / (size_t)tiles : NULL;
                if (np == 4) TILE(4, 1);
                else if (np == 2) n == 1 ? TILE(2, 1) : n == 2 ? TILE(2, 2) : TILE(2, 3);
                else BY_ROWS(n, TILE, 1);
                r += n;
            }
            free(own);
            p += np;
        }
    }
}

/* x [rows, in] float32, w: code panels of `bits` 4 or 8 (above) -> y [rows, out] float32; in % 32 == 0. */
void linear_codes(const float *x, const uint8_t *w, float *y, int64_t rows, int64_t in, int64_t out, int bits,
                  int threads) {
    over_panels(x, NULL, w, y, rows, in, out, bits == 4 ? PANELS_CODES4 : PANELS_CODES8, threads);
}

/* x [rows, in] float32, w: float32 (bf = 0) or bfloat16 (bf = 1) panels (above) -> y [rows, out] float32. */
void linear_dense(const float *x, const void *w, float *y, int64_t rows, int64_t in, int64_t out, int bf,
                  int threads) {
    over_panels(x, NULL, w, y, rows, in, out, bf ? PANELS_BF16 : PANELS_F32, threads);
}

#ifdef __AVX512BF16__
/* x [rows, in] float32 holding bfloat16 values, w: pair panels (above) -> y [rows, out] float32; in even. */
void linear_pairs(const float *x, const uint16_t *w, float *y, int64_t rows, int64_t in, int64_t out,
                  int threads) {
    uint16_t *xb = narrowed(x, rows * in);
    over_panels(x, xb, w, y, rows, in, out, PANELS_PAIRS, threads);
    free(xb);
}
#endif

#ifdef __AVX512BF16__
/* x [rows, in] float32 holding bfloat16 values, w: pair code panels of `bits` 4 or 8 (above) -> y [rows,
 * out] float32; in % 32 == 0. */
void linear_pair_codes(const float *x, const uint8_t *w, float *y, int64_t rows, int64_t in, int64_t out, int bits,
                       int threads) {
    uint16_t *xb = narrowed(x, rows * in);
    over_panels(x, xb, w, y, rows, in, out, bits == 4 ? PANELS_PAIR_CODES4 : PANELS_PAIR_CODES8, threads);
    free(xb);
}
#endif

#if TILES
/* bfloat16 linears on AMX (Intel Sapphire Rapids and later): one tdpbf16ps multiplies a tile of up to 16
 * rows of x (32 inputs each, as 16 pairs) by a tile of 16 pair rows of 16 columns, adding into 16 x 16
 * float32 sums. Its B tile is exactly 16 pair rows of pair_tile's panels (64 bytes each), so the panels,
 * or code panels rebuilt into them group by group (rebuild_panel), feed it as they are. A row's sums
 * depend only on its own x and the weights: each output column of each row is its own accumulator, so a
 * k-row call gives every row the bits of a 1-row call (row-exact), and the vdpbf16ps loops above cost a
 * multiply-add per row while here up to 16 rows take one instruction. The bits are not pair_tile's
 * (tdpbf16ps adds each pair's two products in its own order), so this is a backend of its own
 * (kernels/native_tiles.py) and plain and speculative passes share it. */

/* n rows of xb (bfloat16, row stride in) times one panel -> y (row stride out, `cols` real columns).
 * `pairs`: the panel's pair rows, or NULL to rebuild each group of the code panel `codes` (of `bits`)
 * into a 1 KB buffer just before its multiply (in L1, where a rebuilt 1536-input panel, 48 KB, is not). */
static inline __attribute__((always_inline)) void tile_panel(const uint16_t *xb, const uint16_t *pairs,
                                                             const uint8_t *codes, int bits, float *y,
                                                             int64_t in, int64_t out, int64_t cols, int n) {
    uint16_t group[2][CODE_GROUP / 2 * 2 * PANEL] __attribute__((aligned(64)));
    int64_t block = bits ? code_block(bits) : 0;
    _tile_zero(0);
    for (int64_t g = 0; g < in / CODE_GROUP; g++) {
        const uint16_t *b = pairs ? pairs + g * CODE_GROUP * PANEL : group[g & 1];
        if (!pairs) {
            prefetch_block(codes + g * block, block);
            rebuild_panel(codes + g * block, CODE_GROUP, bits, 1, group[g & 1]);
        }
        _tile_loadd(1, xb + g * CODE_GROUP, in * 2);
        if (g & 1) { /* two weight tiles: the next load need not wait for this multiply */
            _tile_loadd(3, b, 64);
            _tile_dpbf16ps(0, 1, 3);
        } else {
            _tile_loadd(2, b, 64);
            _tile_dpbf16ps(0, 1, 2);
        }
    }
    if (cols >= PANEL) {
        _tile_stored(0, y, out * 4);
        return;
    }
    float sums[TILE_M * PANEL] __attribute__((aligned(64)));
    _tile_stored(0, sums, PANEL * 4);
    for (int r = 0; r < n; r++) _mm512_mask_storeu_ps(y + r * out, real_lanes(cols), _mm512_load_ps(sums + r * PANEL));
}

/* y [rows, out] = xb [rows, in] (bfloat16) @ W.T on AMX, W pair panels (bits 0) or pair code panels of
 * `bits` 4 or 8; in % 32 == 0. Panels split over the threads; a prompt's rows (over TILE_M) rebuild each
 * code panel once (rebuild_panel) and then run all their tiles on it. */
static void tile_panels(const uint16_t *xb, const void *w, float *y, int64_t rows, int64_t in, int64_t out,
                        int bits, int threads) {
    int64_t panels = (out + PANEL - 1) / PANEL;
    size_t bytes = bits ? (size_t)(in / CODE_GROUP * code_block(bits)) : (size_t)(in * PANEL) * 2;
    int whole = bits && rows > TILE_M; /* rebuild whole panels: several row tiles read each */
#pragma omp parallel num_threads(threads)
    {
        uint16_t *own = whole ? aligned_alloc(64, (size_t)(in * PANEL) * 2) : NULL;
        int configured = 0;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const uint8_t *wp = (const uint8_t *)w + p * bytes;
            const uint16_t *pairs = bits ? NULL : (const uint16_t *)wp;
            if (whole) {
                rebuild_panel(wp, in, bits, 1, own);
                pairs = own;
            }
            for (int64_t r = 0; r < rows; r += TILE_M) {
                int n = rows - r < TILE_M ? (int)(rows - r) : TILE_M;
                if (n != configured) tiles_for(n), configured = n;
                tile_panel(xb + r * in, pairs, wp, bits, y + r * out + p * PANEL, in, out, out - p * PANEL, n);
            }
        }
        _tile_release(); /* the thread's tile state: not saved at every context switch from here on */
        free(own);
    }
}

/* One row of xb (bfloat16) times one code panel of `bits` on the tiles -> y [cols]: a row's logits in one
 * panel of the greedy head, the bits the whole head gives that row (each row and column its own sums). */
static void tile_row(const uint16_t *xb, const uint8_t *w, float *y, int64_t in, int64_t cols, int bits) {
    tiles_for(1);
    tile_panel(xb, NULL, w, bits, y, in, PANEL, cols, 1);
    _tile_release();
}

/* x [rows, in] float32 holding bfloat16 values, w: pair panels (bits 0) or pair code panels (bits 4, 8)
 * -> y [rows, out] float32, on AMX; in % 32 == 0. */
void linear_tiles(const float *x, const void *w, float *y, int64_t rows, int64_t in, int64_t out, int bits,
                  int threads) {
    uint16_t *xb = narrowed(x, rows * in);
    tile_panels(xb, w, y, rows, in, out, bits, threads);
    free(xb);
}
#endif

int tiles(void) { return TILES; }

/* 4-bit weights in groups of 32 along `in`: per group 16 bytes, byte j holding code j in its low nibble
 * and code j + 16 in its high one (GGUF's Q4 block order), and a float32 scale s and offset m:
 * w = q * s + m. So x . w = sum over groups of s * (x . q) + m * sum(x): the codes are widened to
 * float in registers, and sum(x) per group is computed once per row (xsum [rows, in / 32]). */
/* acc[r] += s_g * (x_r . q) over group g's 32 codes, for rows r < n. */
static inline __attribute__((always_inline)) void q4_group(const float *x, const uint8_t *codes, float scale,
                                                           v8 *acc, int64_t in, int n) {
    v8 q0, q1, q2, q3;
    nibbles(codes, &q0, &q2);
    nibbles(codes + 8, &q1, &q3);
    v8 s = splat8(scale);
    for (int r = 0; r < n; r++) {
        const float *xg = x + r * in;
        v8 t = fma8(fma8(fma8(q0 * load8(xg), q1, load8(xg + 8)), q2, load8(xg + 16)), q3, load8(xg + 24));
        acc[r] = fma8(acc[r], t, s);
    }
}

static inline __attribute__((always_inline)) void q4_rows(const float *x, const float *xsum, const uint8_t *codes,
                                                          const float *scale, const float *offset, float *y,
                                                          int64_t in, int64_t out, int n) {
    int64_t groups = in / 32, g = 0;
    v8 even[ROW_BLOCK] = {{0}}, odd[ROW_BLOCK] = {{0}}; /* two add chains: half the latency of one */
    for (; g + 1 < groups; g += 2) {
        q4_group(x + g * 32, codes + g * 16, scale[g], even, in, n);
        q4_group(x + (g + 1) * 32, codes + (g + 1) * 16, scale[g + 1], odd, in, n);
    }
    if (g < groups) q4_group(x + g * 32, codes + g * 16, scale[g], even, in, n);
    for (int r = 0; r < n; r++) {
        float off = 0.0f;
        for (g = 0; g < groups; g++) off += offset[g] * xsum[r * groups + g];
        y[r * out] = sum8(even[r] + odd[r]) + off;
    }
}

void linear_q4(const float *x, const uint8_t *codes, const float *scale, const float *offset, float *y, int64_t rows,
               int64_t in, int64_t out, int threads) {
    int64_t groups = in / 32;
    float *xsum = malloc(sizeof(float) * (size_t)(rows * groups));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < groups; g++) {
            const float *xg = x + r * in + g * 32;
            xsum[r * groups + g] = sum8((load8(xg) + load8(xg + 8)) + (load8(xg + 16) + load8(xg + 24)));
        }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t o = 0; o < out; o++)
        for (int64_t r = 0; r < rows; r += ROW_BLOCK) {
            const float *xr = x + r * in, *xs = xsum + r * groups, *so = scale + o * groups, *mo = offset + o * groups;
            const uint8_t *co = codes + o * groups * 16;
            float *yr = y + r * out + o;
            switch (rows - r) {
            case 1: q4_rows(xr, xs, co, so, mo, yr, in, out, 1); break;
            case 2: q4_rows(xr, xs, co, so, mo, yr, in, out, 2); break;
            case 3: q4_rows(xr, xs, co, so, mo, yr, in, out, 3); break;
            default: q4_rows(xr, xs, co, so, mo, yr, in, out, 4); break;
            }
        }
    free(xsum);
}

/* 8-bit weights, one float32 scale per output channel: y = scale_o * (x . q_o). */
static inline v8 load_i8(const int8_t *p) {
#ifdef __AVX2__
    return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    v8 v;
    for (int l = 0; l < LANES; l++) v[l] = (float)p[l];
    return v;
#endif
}

static inline __attribute__((always_inline)) void q8_rows(const float *x, const int8_t *qo, float scale, float *y,
                                                          int64_t in, int64_t out, int n) {
    v8 a[ROW_BLOCK] = {{0}}, b[ROW_BLOCK] = {{0}};
    for (int64_t i = 0; i < in; i += 2 * LANES) {
        v8 w0 = load_i8(qo + i), w1 = load_i8(qo + i + LANES);
        for (int r = 0; r < n; r++) {
            a[r] = fma8(a[r], w0, load8(x + r * in + i));
            b[r] = fma8(b[r], w1, load8(x + r * in + i + LANES));
        }
    }
    for (int r = 0; r < n; r++) y[r * out] = sum8(a[r] + b[r]) * scale;
}

/* x [rows, in] float32, codes [out, in] int8, scale [out] -> y [rows, out]; in % 16 == 0. */
void linear_q8(const float *x, const int8_t *codes, const float *scale, float *y, int64_t rows, int64_t in,
               int64_t out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t o = 0; o < out; o++)
        for (int64_t r = 0; r < rows; r += ROW_BLOCK) {
            const float *xr = x + r * in;
            const int8_t *qo = codes + o * in;
            float *yr = y + r * out + o;
            switch (rows - r) {
            case 1: q8_rows(xr, qo, scale[o], yr, in, out, 1); break;
            case 2: q8_rows(xr, qo, scale[o], yr, in, out, 2); break;
            case 3: q8_rows(xr, qo, scale[o], yr, in, out, 3); break;
            default: q8_rows(xr, qo, scale[o], yr, in, out, 4); break;
            }
        }
}

/* ---- int8 activations: the integer dot products of llama.cpp's Q4 x Q8 path -------------------------
 * The activations are quantized per row in blocks of 32 (q = round(x / d), d = max|x| / 127, as
 * llama.cpp's Q8 blocks), and each block's products with the weight codes are summed in int32: with
 * VNNI one vpdpbusd takes 64 multiply-adds, without it vpmaddubsw + vpmaddwd do (the same integers, so
 * the same bits on every path). Weights are packed in panels of 16 output columns, as linear_dense's.
 * Row-exact as above: a row's blocks, scales and sums depend on that row alone. Needs AVX2 and F16C
 * (dot_i8 says whether this build has them); elsewhere the float-activation kernels run.
 * benchmarks/linears.c (mode 2: the default model's 4-bit linears and int8 LM head; the 2-core Xeon
 * above, VNNI, 2 threads, four runs): 5.0-5.4 ms a step, 4 / 8 rows 1.13-1.15 / 1.45-1.74x. The kernels
 * before these (one column at a time, each group widened to float and reduced on its own), timed on
 * the same shapes with q, k, v fused: 8.0 ms, 4 / 8 rows 1.67 / 2.98x. */
int dot_i8(void) {
#ifdef DOT_I8
    return 1;
#else
    return 0;
#endif
}

/* Whether this build has linear_q2_i8 (the 2-bit panels: AVX2, F16C and AVX-512 BW). */
int q2_i8(void) {
#if defined(DOT_I8) && defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}

#ifdef DOT_I8
/* x [rows, in] float32 -> qx [rows, in] int8, d [rows, in / 32] (the block scales), qsum [rows, in / 32]
 * (the sum of the block's codes) and s = d * qsum (what a per-group weight offset multiplies). */
void quantize_i8(const float *x, int8_t *qx, float *d, float *s, int32_t *qsum, int64_t rows, int64_t in) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < rows * in / 32; b++) {
        const float *p = x + b * 32;
        __m256 v[4], m = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(p + 8 * j);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[j]));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
        float scale = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m256i i[4];
        for (int j = 0; j < 4; j++) /* round to nearest even (MXCSR's default mode) */
            i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(inverse)));
        __m256i q = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
        q = _mm256_permutevar8x32_epi32(q, order); /* the packs interleave 128-bit lanes: restore order */
        _mm256_storeu_si256((__m256i *)(qx + b * 32), q);
        __m256i all = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q), _mm256_set1_epi16(1));
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(all), _mm256_extracti128_si256(all, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
        d[b] = scale;
        qsum[b] = _mm_cvtsi128_si32(t);
        s[b] = scale * (float)qsum[b];
    }
}

/* quantize_i8 into one allocation (the codes, then d, s and qsum; free the codes' pointer). */
static int8_t *quantized(const float *x, int64_t rows, int64_t in, float **d, float **s, int32_t **qsum) {
    int64_t blocks = rows * in / 32;
    int8_t *qx = malloc((size_t)(rows * in) + sizeof(float) * (size_t)(3 * blocks));
    *d = (float *)(qx + rows * in), *s = *d + blocks; /* rows * in is a multiple of 32: aligned */
    *qsum = (int32_t *)(*s + blocks);
    quantize_i8(x, qx, *d, *s, *qsum, rows, in);
    return qx;
}

/* Byte dot products for the panels below: four codes of a column in one 32-bit lane times four
 * activations broadcast to every lane. dot32 sums one block of 32 inputs, the 8 code vectors c times the
 * row's 8 activation quads, in two chains (integers: exact in any order); `plus128`: q8's codes, stored
 * + 128 (dot4s), else q4's, 0..15 (dot4). */
#ifdef __AVX512BW__
/* acc + the four u8 x s8 products in each 32-bit lane (vpmaddubsw cannot saturate: codes are < 16). */
static inline __m512i dot4(__m512i acc, __m512i codes, __m512i x) {
#ifdef __AVX512VNNI__
    return _mm512_dpbusd_epi32(acc, codes, x);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(codes, x), _mm512_set1_epi16(1)));
#endif
}

/* acc + the four products (u - 128) * x in each lane; with VNNI plus 128 * sum(x), which the caller takes
 * off (Q8_BIASED). */
#ifdef __AVX512VNNI__
#define Q8_BIASED 1
static inline __m512i dot4s(__m512i acc, __m512i u, __m512i x) { return _mm512_dpbusd_epi32(acc, u, x); }
#else
#define Q8_BIASED 0
static inline __m512i dot4s(__m512i acc, __m512i u, __m512i x) {
    __m512i w = _mm512_xor_si512(u, _mm512_set1_epi8((char)0x80)); /* the signed code */
    __m512i sx = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(w), sx),
                                                   _mm512_set1_epi16(1)));
}
#endif

static inline __attribute__((always_inline)) __m512i dot32(const __m512i *c, const int32_t *xq, int plus128) {
    __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
    for (int j = 0; j < 8; j += 2) {
        __m512i x0 = _mm512_set1_epi32(xq[j]), x1 = _mm512_set1_epi32(xq[j + 1]);
        even = plus128 ? dot4s(even, c[j], x0) : dot4(even, c[j], x0);
        odd = plus128 ? dot4s(odd, c[j + 1], x1) : dot4(odd, c[j + 1], x1);
    }
    return _mm512_add_epi32(even, odd);
}
#else
static inline __m256i dot4(__m256i acc, __m256i codes, __m256i x) {
#ifdef __AVXVNNI__
    return _mm256_dpbusd_avx_epi32(acc, codes, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), _mm256_set1_epi16(1)));
#endif
}

#ifdef __AVXVNNI__
#define Q8_BIASED 1
static inline __m256i dot4s(__m256i acc, __m256i u, __m256i x) { return _mm256_dpbusd_avx_epi32(acc, u, x); }
#else
#define Q8_BIASED 0
static inline __m256i dot4s(__m256i acc, __m256i u, __m256i x) {
    __m256i w = _mm256_xor_si256(u, _mm256_set1_epi8((char)0x80));
    __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
#endif

static inline __attribute__((always_inline)) __m256i dot32(const __m256i *c, const int32_t *xq, int plus128) {
#ifndef __AVXVNNI__
    if (!plus128) { /* q4: codes 0..15 times |x| <= 127 sum to at most 16 * 15 * 127 = 30480 per 16-bit lane
                     * over a block, so the block is summed in int16 and widened once (the same integers:
                     * benchmarks/linears.c mode 2, EPYC Zen 3, three runs alternating: 4 / 8 rows 7.6-9.2 /
                     * 13.7-18.3 ms against 10.0-11.4 / 19.7-20.7 ms widening every product pair; 1 row
                     * 4.8-5.0 against 4.9-5.7 ms) */
        __m256i a = _mm256_maddubs_epi16(c[0], _mm256_set1_epi32(xq[0]));
        __m256i b = _mm256_maddubs_epi16(c[1], _mm256_set1_epi32(xq[1]));
        for (int j = 2; j < 8; j += 2) {
            a = _mm256_add_epi16(a, _mm256_maddubs_epi16(c[j], _mm256_set1_epi32(xq[j])));
            b = _mm256_add_epi16(b, _mm256_maddubs_epi16(c[j + 1], _mm256_set1_epi32(xq[j + 1])));
        }
        return _mm256_madd_epi16(_mm256_add_epi16(a, b), _mm256_set1_epi16(1));
    }
#endif
    __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
    for (int j = 0; j < 8; j += 2) {
        __m256i x0 = _mm256_set1_epi32(xq[j]), x1 = _mm256_set1_epi32(xq[j + 1]);
        even = plus128 ? dot4s(even, c[j], x0) : dot4(even, c[j], x0);
        odd = plus128 ? dot4s(odd, c[j + 1], x1) : dot4(odd, c[j + 1], x1);
    }
    return _mm256_add_epi32(even, odd);
}
#endif

/* 4-bit weights in panels for the int8 activations (native_dot.py packs them): per panel of 16 output
 * columns and group of 32 inputs, Q4_PANEL_GROUP bytes in one stream, the order the kernel reads them:
 *   4 x 64 bytes of codes: chunk c, byte 4 * o + t: column o's code 4c + t (low nibble), 4c + 16 + t (high)
 *   16 float16 scales s, then 16 float16 offsets m, one per column (w = q * s + m)
 * So four consecutive codes of a column sit in one 32-bit lane, and one vpdpbusd (VNNI) multiplies them
 * with four activations broadcast to every lane and adds the four products to that lane: 64 multiply-
 * adds per instruction, where a column-at-a-time dot product widened and summed every group on its own.
 * The integer sums are exact; the floats are added in one order for every row (row-exact).
 *
 * The same products read the float backends' 4-bit code panels too (native_codes.py: per group, the 16
 * float16 scales, the 16 offsets, then 16 rows of 16 code bytes, each byte two inputs of one column in
 * `codes4` order, or of two columns in pair order; native_shared.py), so a quantized self-draft multiplies
 * the very bytes its target streams: one copy of the weights, not two. vpermb (AVX512-VBMI) gathers each
 * column's four code bytes of a 64-byte load into its 32-bit lane; a column's nibbles there are the even
 * inputs 8j, 8j + 2, 8j + 4, 8j + 6 (low) and the odd ones (high), so the quantized activations are
 * reordered to match (codes_order). The integer sums are the same integers and the float steps the same,
 * so on the same codes the bits are those of the kernel's own panels. */
#define Q4_PANEL_GROUP 320 /* bytes per panel and group of a 4-bit layout (native_codes.py's code_block(4)) */
/* 2-bit weights (native_int2.py, the quantized draft's coarse head): per panel and group, 2 chunks of 64
 * bytes, chunk k byte 4 * o + t holding column o's codes 4 (k + 2 s) + t in bits 2 s, 2 s + 1 (s = 0 .. 3),
 * then the 16 float16 scales and the 16 offsets: 3 bits a weight, where the 4-bit panels take 5. AVX-512. */
#define Q2_PANEL_GROUP 192
/* Bytes a tile prefetches ahead of its reads. 8 KB: on a 2-core Xeon with AMX (Sapphire Rapids class),
 * benchmarks/linears.c mode 2 (the int4 layers and the int8 head from memory, 2 threads, four rounds
 * alternating) took 2.66-3.33 ms a row against 3.41-3.86 at 2 KB, and an int4 draft token (bf16 target,
 * γ 4, 100-token context, three rounds alternating) 2.57-3.14 against 3.48-3.68 ms. 0-8 KB were within
 * noise on an AMD EPYC Zen 4 and an AVX-512 Xeon without AMX (HISTORY.md, sessions 2 and 23). */
#ifndef Q4_AHEAD
#define Q4_AHEAD 8192
#endif
enum { Q4_OWN, Q4_CODES, Q4_PAIR_CODES, Q2_OWN }; /* the panels' layout: native_dot.py's, codes4, pair_codes4,
                                                     native_int2.py's */
static inline int64_t group_bytes(int layout) { return layout == Q2_OWN ? Q2_PANEL_GROUP : Q4_PANEL_GROUP; }
#if defined(__AVX512BW__) && defined(__AVX512VBMI__)
#define SHARED_CODES 1

/* qx's bytes in each group of 8 inputs as the code panels' lanes hold them: the even inputs, then the odd. */
static void codes_order(int8_t *qx, int64_t n) {
    const __m512i order = _mm512_set_epi64(0x0f0d0b090e0c0a08, 0x0705030106040200, 0x0f0d0b090e0c0a08,
                                           0x0705030106040200, 0x0f0d0b090e0c0a08, 0x0705030106040200,
                                           0x0f0d0b090e0c0a08, 0x0705030106040200);
    int64_t i = 0;
    for (; i + 64 <= n; i += 64)
        _mm512_storeu_si512(qx + i, _mm512_shuffle_epi8(_mm512_loadu_si512(qx + i), order));
    for (; i < n; i += 32) { /* n is a multiple of 32 */
        __m256i v = _mm256_loadu_si256((const __m256i *)(qx + i));
        _mm256_storeu_si256((__m256i *)(qx + i), _mm256_shuffle_epi8(v, _mm512_castsi512_si256(order)));
    }
}

/* One 64-byte load of a code panel's rows (4 rows: inputs 8j .. 8j + 7) -> its even and odd inputs' codes,
 * four of each column in its lane. codes4: lane o, byte r <- byte 16 r + o, both nibbles column o's; pair
 * order: bytes 16 r + 2 (o % 8) + e (e = 0 for even inputs, 1 for odd), whose low nibble is column o % 8's
 * and high one column 8 + o % 8's. */
static inline __attribute__((always_inline)) void gathered(__m512i v, int pairs, __m512i *even, __m512i *odd) {
    const __m512i low = _mm512_set1_epi8(15), bytes = _mm512_set1_epi32(0x01010101);
    const __m512i rows = _mm512_set1_epi32(0x30201000); /* byte r: 16 r */
    if (pairs) {
        const __m512i column = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14);
        const __m512i nibble = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);
        __m512i at = _mm512_add_epi32(_mm512_mullo_epi32(column, bytes), rows);
        *even = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi8(at, v), nibble), low);
        at = _mm512_add_epi32(at, bytes);
        *odd = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi8(at, v), nibble), low);
    } else {
        const __m512i column = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512i t = _mm512_permutexvar_epi8(_mm512_add_epi32(_mm512_mullo_epi32(column, bytes), rows), v);
        *even = _mm512_and_si512(t, low);
        *odd = _mm512_and_si512(_mm512_srli_epi16(t, 4), low);
    }
}
#else
#define SHARED_CODES 0
#endif

#ifdef __AVX512BW__
/* n rows of quantized x (qx, d, s: quantize_i8's; reordered by codes_order for the code panels) times one
 * panel of `layout` -> y (row stride out, `cols` columns). */
static inline __attribute__((always_inline)) void q4i8_tile(const int8_t *qx, const float *d, const float *s,
                                                            const uint8_t *panel, float *y, int64_t in, int64_t out,
                                                            int64_t cols, int layout, int n) {
    int64_t groups = in / 32;
    __m512 acc[TILE_ROWS], off[TILE_ROWS];
    for (int r = 0; r < n; r++) acc[r] = off[r] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(15), two = _mm512_set1_epi8(3);
    const int scales = layout == Q4_OWN ? 256 : layout == Q2_OWN ? 128 : 0; /* byte offsets */
    const int codes = layout == Q4_OWN || layout == Q2_OWN ? 0 : 64;
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *p = panel + g * group_bytes(layout);
        for (int k = 0; k < 5; k++) __builtin_prefetch(p + Q4_AHEAD + 64 * k, 0, 3);
        __m512i c[8];
        for (int k = 0; k < 2 && layout == Q2_OWN; k++) { /* c[k + 2 s]: bits 2 s, 2 s + 1 of each byte */
            __m512i v = _mm512_loadu_si512((const void *)(p + 64 * k));
            for (int s = 0; s < 4; s++) c[k + 2 * s] = _mm512_and_si512(_mm512_srli_epi16(v, 2 * s), two);
        }
        for (int j = 0; j < 4 && layout != Q2_OWN; j++) {
            __m512i v = _mm512_loadu_si512((const void *)(p + codes + 64 * j));
#if SHARED_CODES
            if (layout != Q4_OWN) {
                gathered(v, layout == Q4_PAIR_CODES, &c[2 * j], &c[2 * j + 1]);
                continue;
            }
#endif
            c[j] = _mm512_and_si512(v, low);
            c[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + scales)));
        __m512 offset = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + scales + 32)));
        for (int r = 0; r < n; r++) {
            const int32_t *xq = (const int32_t *)(qx + r * in + g * 32); /* 8 quads of activations */
            __m512 sum = _mm512_cvtepi32_ps(dot32(c, xq, 0));
            acc[r] = _mm512_fmadd_ps(sum, _mm512_mul_ps(scale, _mm512_set1_ps(d[r * groups + g])), acc[r]);
            off[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(s[r * groups + g]), off[r]);
        }
    }
    __mmask16 keep = real_lanes(cols);
    for (int r = 0; r < n; r++) _mm512_mask_storeu_ps(y + r * out, keep, _mm512_add_ps(acc[r], off[r]));
}
#else
/* The AVX-512 tile's arithmetic on 8-lane halves (the same bits: integer sums, then the same float ops). */
static inline __attribute__((always_inline)) void q4i8_tile(const int8_t *qx, const float *d, const float *s,
                                                            const uint8_t *panel, float *y, int64_t in, int64_t out,
                                                            int64_t cols, int layout, int n) {
    (void)layout; /* Q4_OWN: the code panels' layouts need AVX512-VBMI */
    int64_t groups = in / 32;
    __m256 acc[2][TILE_ROWS], off[2][TILE_ROWS];
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < n; r++) acc[h][r] = off[h][r] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(15);
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *p = panel + g * Q4_PANEL_GROUP;
        for (int k = 0; k < 5; k++) __builtin_prefetch(p + Q4_AHEAD + 64 * k, 0, 3);
        for (int h = 0; h < 2; h++) {
            __m256i c[8];
            for (int j = 0; j < 4; j++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(p + 64 * j + 32 * h));
                c[j] = _mm256_and_si256(v, low);
                c[j + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            }
            __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 256 + 16 * h)));
            __m256 offset = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 288 + 16 * h)));
            for (int r = 0; r < n; r++) {
                const int32_t *xq = (const int32_t *)(qx + r * in + g * 32);
                __m256 sum = _mm256_cvtepi32_ps(dot32(c, xq, 0));
                acc[h][r] = _mm256_fmadd_ps(sum, _mm256_mul_ps(scale, _mm256_set1_ps(d[r * groups + g])), acc[h][r]);
                off[h][r] = _mm256_fmadd_ps(offset, _mm256_set1_ps(s[r * groups + g]), off[h][r]);
            }
        }
    }
    for (int r = 0; r < n; r++)
        store_panel(y + r * out, (v8)_mm256_add_ps(acc[0][r], off[0][r]), (v8)_mm256_add_ps(acc[1][r], off[1][r]), cols);
}
#endif

/* Panel p of `layout` (at `panel`) for every row of quantized x (qx, d, s) -> its columns of y [rows, out]. */
static inline __attribute__((always_inline)) void q4_panel(const int8_t *qx, const float *d, const float *s,
                                                           const uint8_t *panel, float *y, int64_t rows, int64_t in,
                                                           int64_t out, int64_t p, int layout) {
    int64_t groups = in / 32;
    for (int64_t r = 0; r < rows;) {
        int n = tile_rows(rows - r);
        const int8_t *xr = qx + r * in;
        const float *dr = d + r * groups, *sr = s + r * groups;
        float *yr = y + r * out + p * PANEL;
        int64_t cols = out - p * PANEL;
        if (layout == Q4_CODES) {
            BY_ROWS(n, q4i8_tile, xr, dr, sr, panel, yr, in, out, cols, Q4_CODES);
        } else if (layout == Q4_PAIR_CODES) {
            BY_ROWS(n, q4i8_tile, xr, dr, sr, panel, yr, in, out, cols, Q4_PAIR_CODES);
#ifdef __AVX512BW__
        } else if (layout == Q2_OWN) {
            BY_ROWS(n, q4i8_tile, xr, dr, sr, panel, yr, in, out, cols, Q2_OWN);
#endif
        } else {
            BY_ROWS(n, q4i8_tile, xr, dr, sr, panel, yr, in, out, cols, Q4_OWN);
        }
        r += n;
    }
}

/* n quantized activations (quantize_i8's) put in the order `layout`'s panels read them. */
static void q4_order(int8_t *qx, int64_t n, int layout) {
#if SHARED_CODES
    if (layout == Q4_CODES || layout == Q4_PAIR_CODES) codes_order(qx, n);
#else
    (void)qx, (void)n, (void)layout;
#endif
}

/* x [rows, in] float32, panels of `layout` -> y [rows, out]; in % 32 == 0. */
static void q4_i8(const float *x, const uint8_t *panels, float *y, int64_t rows, int64_t in, int64_t out,
                  int layout, int threads) {
    int64_t groups = in / 32, count = (out + PANEL - 1) / PANEL;
    float *d, *s;
    int32_t *qsum;
    int8_t *qx = quantized(x, rows, in, &d, &s, &qsum);
    q4_order(qx, rows * in, layout);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < count; p++)
        q4_panel(qx, d, s, panels + p * groups * group_bytes(layout), y, rows, in, out, p, layout);
    free(qx);
}

/* x [rows, in] float32, panels as above -> y [rows, out]; in % 32 == 0. */
void linear_q4_i8(const float *x, const uint8_t *panels, float *y, int64_t rows, int64_t in, int64_t out,
                  int threads) {
    q4_i8(x, panels, y, rows, in, out, Q4_OWN, threads);
}

#if SHARED_CODES
/* x [rows, in] float32, native_codes.py's 4-bit code panels (pairs: in pair order) -> y [rows, out]. */
void linear_q4_codes_i8(const float *x, const uint8_t *panels, float *y, int64_t rows, int64_t in, int64_t out,
                        int pairs, int threads) {
    q4_i8(x, panels, y, rows, in, out, pairs ? Q4_PAIR_CODES : Q4_CODES, threads);
}
#endif

#ifdef __AVX512BW__
/* x [rows, in] float32, 2-bit panels (Q2_PANEL_GROUP) -> y [rows, out]; in % 32 == 0. */
void linear_q2_i8(const float *x, const uint8_t *panels, float *y, int64_t rows, int64_t in, int64_t out,
                  int threads) {
    q4_i8(x, panels, y, rows, in, out, Q2_OWN, threads);
}
#endif

/* 8-bit weights in panels for the int8 activations (native_dot.py packs them): per panel of 16 output
 * columns and block of 32 inputs, 8 chunks of 64 bytes, chunk j byte 4 * o + t holding column o's code
 * 4j + t plus 128 (unsigned: vpdpbusd multiplies unsigned by signed bytes). A block's sum is then
 * sum(q * x) + 128 * sum(x), and the second term, the same for every column, is taken off in int32;
 * the scale per column multiplies the row's float sum at the end. */
#define Q8_PANEL_BLOCK 512
#ifndef Q8_AHEAD
#define Q8_AHEAD 8192 /* as Q4_AHEAD */
#endif

#ifdef __AVX512BW__
static inline __attribute__((always_inline)) void q8i8_tile(const int8_t *qx, const float *d, const int32_t *qsum,
                                                            const uint8_t *panel, const float *scale, float *y,
                                                            int64_t in, int64_t out, int64_t cols, int n) {
    int64_t blocks = in / 32;
    __m512 acc[TILE_ROWS];
    for (int r = 0; r < n; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = panel + b * Q8_PANEL_BLOCK;
        for (int k = 0; k < 8; k++) __builtin_prefetch(p + Q8_AHEAD + 64 * k, 0, 3);
        __m512i c[8];
        for (int j = 0; j < 8; j++) c[j] = _mm512_loadu_si512((const void *)(p + 64 * j));
        for (int r = 0; r < n; r++) {
            const int32_t *xq = (const int32_t *)(qx + r * in + b * 32);
            __m512i sum = dot32(c, xq, 1);
            if (Q8_BIASED) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(128 * qsum[r * blocks + b]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(d[r * blocks + b]), acc[r]);
        }
    }
    __mmask16 keep = real_lanes(cols);
    __m512 s = _mm512_loadu_ps(scale);
    for (int r = 0; r < n; r++) _mm512_mask_storeu_ps(y + r * out, keep, _mm512_mul_ps(acc[r], s));
}
#else
static inline __attribute__((always_inline)) void q8i8_tile(const int8_t *qx, const float *d, const int32_t *qsum,
                                                            const uint8_t *panel, const float *scale, float *y,
                                                            int64_t in, int64_t out, int64_t cols, int n) {
    int64_t blocks = in / 32;
    __m256 acc[2][TILE_ROWS];
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < n; r++) acc[h][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *p = panel + b * Q8_PANEL_BLOCK;
        for (int k = 0; k < 8; k++) __builtin_prefetch(p + Q8_AHEAD + 64 * k, 0, 3);
        for (int h = 0; h < 2; h++) {
            __m256i c[8];
            for (int j = 0; j < 8; j++) c[j] = _mm256_loadu_si256((const __m256i *)(p + 64 * j + 32 * h));
            for (int r = 0; r < n; r++) {
                const int32_t *xq = (const int32_t *)(qx + r * in + b * 32);
                __m256i sum = dot32(c, xq, 1);
                if (Q8_BIASED) sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(128 * qsum[r * blocks + b]));
                acc[h][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(d[r * blocks + b]), acc[h][r]);
            }
        }
    }
    __m256 lo = _mm256_loadu_ps(scale), hi = _mm256_loadu_ps(scale + LANES);
    for (int r = 0; r < n; r++)
        store_panel(y + r * out, (v8)_mm256_mul_ps(acc[0][r], lo), (v8)_mm256_mul_ps(acc[1][r], hi), cols);
}
#endif

/* x [rows, in] float32, panels as above, scale [16 * panels] (padded) -> y [rows, out]; in % 32 == 0. */
void linear_q8_i8(const float *x, const uint8_t *panels, const float *scale, float *y, int64_t rows, int64_t in,
                  int64_t out, int threads) {
    int64_t blocks = in / 32, count = (out + PANEL - 1) / PANEL;
    float *d, *s;
    int32_t *qsum;
    int8_t *qx = quantized(x, rows, in, &d, &s, &qsum);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < count; p++) {
        const uint8_t *panel = panels + p * blocks * Q8_PANEL_BLOCK;
        for (int64_t r = 0; r < rows;) {
            int n = tile_rows(rows - r);
            const int8_t *xr = qx + r * in;
            const float *dr = d + r * blocks, *sp = scale + p * PANEL;
            const int32_t *br = qsum + r * blocks;
            float *yr = y + r * out + p * PANEL;
            int64_t cols = out - p * PANEL;
            BY_ROWS(n, q8i8_tile, xr, dr, br, panel, sp, yr, in, out, cols);
            r += n;
        }
    }
    free(qx);
}
#endif

/* ---- the greedy head: each row's argmax without every logit ----------------------------------------------
 * A greedy step needs only the argmax of the LM head's logits, and the head is a step's largest linear
 * (the default model's: 49152 x 576 8-bit codes, ~1 ms of a ~7 ms float32 step). For a head of CODES8
 * panels (float32 or, pairs, bfloat16 ones), greedy_codes8 finds the argmax the full logits give, ties to
 * the lowest index, from a cheaper pass that bounds every logit:
 *   1. Each row's x is quantized to int8 per block of 32 (quantize_i8: x ~ d q, |x - d q| <= d / 2 up to
 *      the rounding of 1 / d) and multiplied with the head's own codes in int32 (vpdpbusd, VNNI), so
 *      A_j = sum over blocks of d_x d_w (q . c) approximates logit j, and
 *        |A_j - logit_j| <= B_j = sum over blocks of e d_x W1_jb,  W1_jb = sum over the block of |w_ji|
 *      (`bound`: float16 per column and block, rounded up), e = 0.5002 + 127.01 slack: the quantization's
 *      half step plus `slack` times sum |x| |w| (127 d_x >= the block's max |x|) for the float rounding of
 *      the exact logit and of A (float32: 576 products sum to within 576 * 2^-24 ~ 3.4e-5 of that; bfloat16
 *      also rounds each rebuilt weight by up to 2^-9 of itself).
 *   2. T = max_j (A_j - B_j) is at most the largest logit; a column whose A_j + B_j < T is below it and is
 *      not the argmax (with bfloat16 logits: its rounded logit is below the rounded largest, so it ties
 *      with nothing either). The rest, the candidates (mostly 1-5 columns of 49152 on the default model),
 *      are computed exactly: their panels by code_tile / pair_code_tile / tile_row, the kernel the head
 *      runs (linear_codes, linear_pair_codes or linear_tiles), so the same bits (row-exact), and the
 *      argmax is taken over them.
 * A row with non-finite x, a block too small for int8 (1 / d overflows), or more than GREEDY_PANELS candidate
 * panels computes every logit instead (those rows in one call).
 * Needs AVX512-VBMI (vpermb puts a column's 4 codes in one 32-bit lane) and VNNI; greedy_head() says
 * whether this build has them. */
#if defined(DOT_I8) && defined(__AVX512VBMI__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define GREEDY 1
/* Rows sharing each read of the codes in the bounding pass. 8 (one verification of gamma = 7): its
 * bounding pass read the codes twice with 4, and an 8-row head took 1.18-1.25 ms against 2.21-2.39 (fp32,
 * Xeon AMX, 2 threads); 1-4 rows unchanged. */
#define GREEDY_ROWS 8
/* Candidate panels past which a row computes every logit. 1024 (a third of the default model's head):
 * with 64, a flat row's full head cost 1.75 ms against 0.64 for a usual row, and an 8-row verification
 * met such rows 8 times as often; its candidates one by one cost 0.68 ms (the same ids either way). */
#define GREEDY_PANELS 1024
#ifndef GREEDY_AHEAD
#define GREEDY_AHEAD 2048 /* bytes the bounding pass prefetches ahead of its reads */
#endif
/* `slack` above: float32 logits need 3.4e-5 (3x that here), bfloat16 ones 2^-9 more (1.99e-3 in all) */
#define GREEDY_SLACK_F32 1e-4f
#define GREEDY_SLACK_BF16 2.05e-3f
#ifdef __AVX512BF16__
#define PAIRS_ONLY(...) __VA_ARGS__
#else
#define PAIRS_ONLY(...) /* pair panels need AVX512-BF16: native_codes.py makes none without it */
#endif
void argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out);

/* vpermb's indices for a 64-byte chunk of a CODES8 block (4 inputs of 16 columns) -> byte 4 o + t holding
 * column o's code for the chunk's input t. Float32 panels: input t's row is bytes 16 t .. 16 t + 15.
 * Pair panels (_lanes in native_codes.py): row R = 2 (t / 2) + o / 8, lane 2 (o % 8) + t % 2. */
static __m512i chunk_order(int pairs) {
    uint8_t at[64];
    for (int o = 0; o < PANEL; o++)
        for (int t = 0; t < 4; t++)
            at[4 * o + t] = (uint8_t)(pairs ? 16 * (2 * (t / 2) + o / 8) + 2 * (o % 8) + t % 2 : 16 * t + o);
    return _mm512_loadu_si512((const void *)at);
}

/* W1 for greedy_codes8: per panel, group and column, sum |w| = d sum |c| over the group (exact in float32:
 * an 11-bit d times at most 32 * 127), as float16 rounded up -> bound [panels, in / 32, 16]. */
void greedy_bound(const uint8_t *w, int64_t in, int64_t out, int pairs, uint16_t *bound) {
    int64_t groups = in / CODE_GROUP, block = code_block(8), panels = (out + PANEL - 1) / PANEL;
    const __m512i order = chunk_order(pairs), ones = _mm512_set1_epi8(1);
    for (int64_t b = 0; b < panels * groups; b++) {
        const uint8_t *blk = w + b * block;
        __m512i sum = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) { /* |c| as unsigned bytes (|-128| = 128 too) times 1, 4 to a lane */
            __m512i c = _mm512_permutexvar_epi8(order, _mm512_loadu_si512((const void *)(blk + SCALES + 64 * j)));
            sum = _mm512_dpbusd_epi32(sum, _mm512_abs_epi8(c), ones);
        }
        __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk)));
        _mm256_storeu_si256((__m256i *)(bound + b * PANEL), _mm512_cvtps_ph(w1, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC));
    }
}

/* Step 1 above, per row and panel: low = the largest A - B, high = the largest A + B of its columns
 * (those < out), each [rows, panels]. */
static void greedy_bounds(const int8_t *qx, const float *d, const int32_t *qsum, const uint8_t *w,
                          const uint16_t *bound, float *low, float *high, int64_t rows, int64_t in, int64_t out,
                          int pairs, float e, int threads) {
    int64_t groups = in / CODE_GROUP, block = code_block(8), panels = (out + PANEL - 1) / PANEL;
    const __m512i order = chunk_order(pairs), flip = _mm512_set1_epi8((char)0x80);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t r0 = 0; r0 < rows; r0 += GREEDY_ROWS) {
            int n = rows - r0 < GREEDY_ROWS ? (int)(rows - r0) : GREEDY_ROWS;
            __m512 a[GREEDY_ROWS], b[GREEDY_ROWS];
            for (int r = 0; r < n; r++) a[r] = b[r] = _mm512_setzero_ps();
            for (int64_t g = 0; g < groups; g++) {
                const uint8_t *blk = w + (p * groups + g) * block;
                for (int64_t l = 0; l < block; l += 64) __builtin_prefetch(blk + l + GREEDY_AHEAD, 0, 3);
                __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
                __m512 w1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(bound + (p * groups + g) * PANEL)));
                __m512i u[8]; /* codes + 128 as unsigned bytes: vpdpbusd's unsigned side */
                for (int j = 0; j < 8; j++)
                    u[j] = _mm512_xor_si512(
                        _mm512_permutexvar_epi8(order, _mm512_loadu_si512((const void *)(blk + SCALES + 64 * j))),
                        flip);
                for (int r = 0; r < n; r++) {
                    int64_t at = (r0 + r) * groups + g;
                    const int32_t *xq = (const int32_t *)(qx + (r0 + r) * in + g * CODE_GROUP);
                    __m512i acc = _mm512_set1_epi32(-128 * qsum[at]); /* sum (c + 128) q = sum c q + 128 sum q */
                    for (int j = 0; j < 8; j++) acc = _mm512_dpbusd_epi32(acc, u[j], _mm512_set1_epi32(xq[j]));
                    a[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(dw, _mm512_set1_ps(d[at])), a[r]);
                    b[r] = _mm512_fmadd_ps(w1, _mm512_set1_ps(e * d[at]), b[r]);
                }
            }
            __mmask16 real = real_lanes(out - p * PANEL);
            const __m512 none = _mm512_set1_ps(-INFINITY);
            for (int r = 0; r < n; r++) {
                low[(r0 + r) * panels + p] = _mm512_reduce_max_ps(_mm512_mask_sub_ps(none, real, a[r], b[r]));
                high[(r0 + r) * panels + p] = _mm512_reduce_max_ps(_mm512_mask_add_ps(none, real, a[r], b[r]));
            }
        }
}

/* Panel p's real columns of `out`. */
static inline int64_t panel_cols(int64_t out, int64_t p) { return out - p * PANEL < PANEL ? out - p * PANEL : PANEL; }

/* The largest bfloat16 value below bfloat16 t (t finite): anything under it rounds below t. */
static float bf16_below(float t) {
    uint16_t u = float_to_bf16(t);
    if ((u & 0x7fff) == 0) return bf16_to_float(0x8001); /* +-0: the negative least subnormal */
    return bf16_to_float(u & 0x8000 ? (uint16_t)(u + 1) : (uint16_t)(u - 1));
}

/* A row's candidate panels (step 2 above) from its low and high [panels] (greedy_bounds) into found
 * [GREEDY_PANELS], ascending -> their count, or -1 when there are more. */
static int64_t candidates(const float *low, const float *high, int64_t panels, int pairs, int64_t *found) {
    int64_t count = 0;
    float t = -INFINITY;
    for (int64_t p = 0; p < panels; p++) t = low[p] > t ? low[p] : t;
    if (pairs) t = bf16_below(bf16_to_float(float_to_bf16(t)));
    for (int64_t p = 0; p < panels; p++)
        if (high[p] >= t) {
            if (count == GREEDY_PANELS) return -1;
            found[count++] = p;
        }
    return count;
}

/* x [rows, in] float32 (pairs: holding bfloat16 values), w: CODES8 panels (pairs: in pair order), bound:
 * W1 as above [panels, in / 32, 16] float16 -> ids [rows]: each row's argmax of x @ W.T as linear_codes
 * (pairs: linear_pair_codes, rounded to bfloat16) computes it, the first of equal maxima. */
void greedy_codes8(const float *x, const uint8_t *w, const uint16_t *bound, int64_t rows, int64_t in, int64_t out,
                   int pairs, int tiles, int threads, int64_t *ids) {
    float slack = pairs ? GREEDY_SLACK_BF16 : GREEDY_SLACK_F32;
    int64_t panels = (out + PANEL - 1) / PANEL, groups = in / CODE_GROUP, bytes = groups * code_block(8);
    float *d, *s;
    int32_t *qsum;
    int8_t *qx = quantized(x, rows, in, &d, &s, &qsum);
    float *low = malloc(sizeof(float) * (size_t)(2 * rows * panels)), *high = low + rows * panels;
    uint16_t *xb = pairs ? narrowed(x, rows * in) : NULL;
    greedy_bounds(qx, d, qsum, w, bound, low, high, rows, in, out, pairs, 0.5002f + 127.01f * slack, threads);
    /* per row its candidate panels (count[r] of them at found + r * GREEDY_PANELS; -1: every logit) */
    int64_t *found = malloc(sizeof(int64_t) * (size_t)(rows * (GREEDY_PANELS + 2))), *count = found + rows * GREEDY_PANELS;
    int64_t *first = count + rows, pairs_total = 0; /* first[r]: row r's first entry among all rows' candidates */
    for (int64_t r = 0; r < rows; r++) {
        int plain = 1; /* finite, and no block so small that 1 / d overflowed in quantize_i8 */
        for (int64_t i = 0; i < in; i++) plain &= isfinite(x[r * in + i]) != 0;
        for (int64_t g = 0; g < groups; g++) plain &= !(d[r * groups + g] > 0.0f && d[r * groups + g] < 1e-30f);
        count[r] = plain ? candidates(low + r * panels, high + r * panels, panels, pairs, found + r * GREEDY_PANELS) : -1;
        first[r] = pairs_total;
        pairs_total += count[r] > 0 ? count[r] : 0;
    }
    float *exact = malloc(sizeof(float) * (size_t)(pairs_total * PANEL + 1)); /* each candidate panel's logits */
    int64_t *row_of = malloc(sizeof(int64_t) * (size_t)(pairs_total + 1));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < count[r]; i++) row_of[first[r] + i] = r;
#pragma omp parallel for schedule(dynamic) num_threads(threads) if (pairs_total > 1)
    for (int64_t e = 0; e < pairs_total; e++) { /* every row's candidate panels, exactly, over the threads */
        int64_t r = row_of[e], p = found[r * GREEDY_PANELS + e - first[r]], cols = panel_cols(out, p);
        float *y = exact + e * PANEL;
        TILES_ONLY(if (tiles) tile_row(xb + r * in, w + p * bytes, y, in, cols, 8); else)
        PAIRS_ONLY(if (pairs) pair_code_tile((const int32_t *)(xb + r * in), w + p * bytes, y, in, PANEL, cols, 1, 1, 8,
                                             NULL, 0);
                   else)
        code_tile(x + r * in, w + p * bytes, y, in, PANEL, cols, 1, 1, 8, NULL, 0);
    }
    int64_t *left = malloc(sizeof(int64_t) * (size_t)rows), missing = 0; /* rows needing every logit */
    for (int64_t r = 0; r < rows; r++) {
        if (count[r] < 0) {
            left[missing++] = r;
            continue;
        }
        int64_t best = -1;
        float top = 0.0f;
        for (int64_t i = 0; i < count[r]; i++) { /* ascending panels and columns: ties keep the lowest index */
            int64_t p = found[r * GREEDY_PANELS + i], cols = panel_cols(out, p);
            for (int64_t j = 0; j < cols; j++) {
                float v = round_as(exact[(first[r] + i) * PANEL + j], pairs);
                if (best < 0 || v > top) best = p * PANEL + j, top = v;
            }
        }
        ids[r] = best;
    }
    if (missing) { /* one call for all of them, as the full head would run */
        float *xs = malloc(sizeof(float) * (size_t)(missing * (in + out))), *y = xs + missing * in;
        for (int64_t i = 0; i < missing; i++) memcpy(xs + i * in, x + left[i] * in, sizeof(float) * (size_t)in);
        TILES_ONLY(if (tiles) linear_tiles(xs, w, y, missing, in, out, 8, threads); else)
        PAIRS_ONLY(if (pairs) linear_pair_codes(xs, w, y, missing, in, out, 8, threads); else)
        linear_codes(xs, w, y, missing, in, out, 8, threads);
        for (int64_t i = 0; pairs && i < missing * out; i++) y[i] = round_as(y[i], 1);
        for (int64_t i = 0; i < missing; i++) argmax_rows(y + i * out, 1, out, ids + left[i]);
        free(xs);
    }
    free(left);
    free(row_of);
    free(exact);
    free(found);
    free(xb);
    free(low);
    free(qx);
}
#else
#define GREEDY 0
#endif

int greedy_head(void) { return GREEDY; }

#ifndef SHARED_CODES
#define SHARED_CODES 0
#endif
int shared_codes(void) { return SHARED_CODES; } /* linear_q4_codes_i8 is built */

/* ---- one decoder layer in one call ---------------------------------------------------------------------
 * The same kernels as the calls above, in the order decoder._layer makes them, without the ~8 trips
 * through Python and ~8 tensor allocations per layer (each ~3-10 us here, ~2 ms a step). A row's bits
 * are those of the separate calls: each kernel is the same, and bfloat16 activations are rounded
 * where torch rounds them on the separate path (after each linear). */
typedef struct { /* one linear's weights, as its backend (kernels/native_*.py) keeps them */
    int64_t kind; /* LINEAR_* */
    int64_t in, out;
    const void *w; /* weights or codes */
    const float *scale, *offset;
} linear_spec;

enum {
    LINEAR_ZERO, LINEAR_F32, LINEAR_BF16, LINEAR_Q8, LINEAR_Q4, LINEAR_Q8_I8, LINEAR_Q4_I8, LINEAR_BF16_PAIRS,
    LINEAR_CODES4, LINEAR_CODES8, LINEAR_PAIR_CODES4, LINEAR_PAIR_CODES8, LINEAR_TILE_PAIRS, LINEAR_TILE_CODES4,
    LINEAR_TILE_CODES8, LINEAR_Q4_CODES_I8, LINEAR_Q4_PAIR_CODES_I8, LINEAR_Q2_I8
};

typedef struct { /* what a pass's layers share (ops.Fused.prepare) */
    const void *cos, *sin;
    const int64_t *positions, *write_slots, *tables;
    int64_t max_blocks, block_size;
    const int64_t *num_tokens;
    int64_t batch, seq_len, heads, kv_heads, dim, hidden;
    float scale, eps;
    int64_t bf, threads;
} pass_info;

/* One layer's attention arguments for a pass (qkv and out as attend's), from what its layers share. */
static attention pass_attention(const pass_info *P, void *qkv, void *kv, int64_t slots, int64_t window, void *out) {
    return (attention){.qkv = qkv, .cos = P->cos, .sin = P->sin, .kv = kv, .slots = slots, .positions = P->positions,
                       .write_slots = P->write_slots, .tables = P->tables, .max_blocks = P->max_blocks,
                       .block_size = P->block_size, .num_tokens = P->num_tokens, .batch = P->batch,
                       .seq_len = P->seq_len, .out = out, .heads = P->heads, .kv_heads = P->kv_heads, .dim = P->dim,
                       .window = window, .scale = P->scale, .bf = (int)P->bf};
}

void attend_pass(const pass_info *P, void *qkv, void *kv, int64_t slots, int64_t window, void *out) {
    attention A = pass_attention(P, qkv, kv, slots, window, out);
    attention_run(&A, (int)P->threads);
}

/* y [rows, out] = x [rows, in] @ W.T in float32 (LINEAR_ZERO: zeros, for benchmarks/step.py). */
static void linear_run(const linear_spec *L, const float *x, float *y, int64_t rows, int threads) {
    switch (L->kind) {
    case LINEAR_F32: linear_dense(x, L->w, y, rows, L->in, L->out, 0, threads); break;
    case LINEAR_BF16: linear_dense(x, L->w, y, rows, L->in, L->out, 1, threads); break;
    case LINEAR_Q8: linear_q8(x, L->w, L->scale, y, rows, L->in, L->out, threads); break;
    case LINEAR_Q4: linear_q4(x, L->w, L->scale, L->offset, y, rows, L->in, L->out, threads); break;
    case LINEAR_CODES4: linear_codes(x, L->w, y, rows, L->in, L->out, 4, threads); break;
    case LINEAR_CODES8: linear_codes(x, L->w, y, rows, L->in, L->out, 8, threads); break;
#ifdef DOT_I8
    case LINEAR_Q8_I8: linear_q8_i8(x, L->w, L->scale, y, rows, L->in, L->out, threads); break;
    case LINEAR_Q4_I8: linear_q4_i8(x, L->w, y, rows, L->in, L->out, threads); break;
#endif
#ifdef __AVX512BW__
    case LINEAR_Q2_I8: linear_q2_i8(x, L->w, y, rows, L->in, L->out, threads); break;
#endif
#if SHARED_CODES
    case LINEAR_Q4_CODES_I8: linear_q4_codes_i8(x, L->w, y, rows, L->in, L->out, 0, threads); break;
    case LINEAR_Q4_PAIR_CODES_I8: linear_q4_codes_i8(x, L->w, y, rows, L->in, L->out, 1, threads); break;
#endif
#ifdef __AVX512BF16__
    case LINEAR_BF16_PAIRS: linear_pairs(x, L->w, y, rows, L->in, L->out, threads); break;
    case LINEAR_PAIR_CODES4: linear_pair_codes(x, L->w, y, rows, L->in, L->out, 4, threads); break;
    case LINEAR_PAIR_CODES8: linear_pair_codes(x, L->w, y, rows, L->in, L->out, 8, threads); break;
#endif
#if TILES
    case LINEAR_TILE_PAIRS: linear_tiles(x, L->w, y, rows, L->in, L->out, 0, threads); break;
    case LINEAR_TILE_CODES4: linear_tiles(x, L->w, y, rows, L->in, L->out, 4, threads); break;
    case LINEAR_TILE_CODES8: linear_tiles(x, L->w, y, rows, L->in, L->out, 8, threads); break;
#endif
    default: memset(y, 0, sizeof(float) * (size_t)(rows * L->out));
    }
}

/* The linear on activations of the pass's dtype: bfloat16 is widened before and rounded after. Exported
 * for native.py's bfloat16 linears outside `layers` (a prompt's): one call where torch's widening and
 * rounding around the kernel took ~13 % of a bfloat16 prefill. */
void linear_act(const linear_spec *L, const void *x, void *y, int64_t rows, int bf, int threads) {
    if (!bf) {
        linear_run(L, x, y, rows, threads);
        return;
    }
    int64_t n = rows * L->in, m = rows * L->out;
    float *xf = malloc(sizeof(float) * (size_t)(n + m)), *yf = xf + n;
#if TILES /* the tiles take bfloat16 x as it is: no widening here and narrowing back in linear_tiles */
    if (L->kind >= LINEAR_TILE_PAIRS && L->kind <= LINEAR_TILE_CODES8) {
        int bits = L->kind == LINEAR_TILE_PAIRS ? 0 : L->kind == LINEAR_TILE_CODES4 ? 4 : 8;
        tile_panels(x, L->w, yf, rows, L->in, L->out, bits, threads);
        convert(yf, y, m, 0, threads);
        free(xf);
        return;
    }
#endif
    convert(x, xf, n, 1, threads);
    linear_run(L, xf, yf, rows, threads);
    convert(yf, y, m, 0, threads);
    free(xf);
}

/* kv: the layer's cache (`slots` per kv head); h [rows, hidden] (+ y, the previous layer's output, or
 * NULL) -> h_out: the residual stream after attention; y_out: the MLP's output (added to the stream by
 * the next layer's first norm). */
static void layer(const pass_info *P, void *kv, int64_t slots, int64_t window, const void *h, const void *y,
           void *h_out, void *y_out, const void *attn_norm, const void *mlp_norm, const linear_spec *qkv,
           const linear_spec *o, const linear_spec *gate_up, const linear_spec *down) {
    int64_t rows = P->batch * P->seq_len, n = P->hidden, elem = P->bf ? 2 : 4, inner = gate_up->out / 2;
    int bf = (int)P->bf, threads = (int)P->threads;
    int64_t width = qkv->out > gate_up->out ? qkv->out : gate_up->out; /* the widest output (>= hidden) */
    width = width > n ? width : n;
    char *x = malloc((size_t)(rows * (n + 2 * width + inner) * elem));
    char *a = x + rows * n * elem, *b = a + rows * width * elem, *c = b + rows * width * elem;
    const void *stream = h;
    if (y) {
        add_norm(h, y, h_out, attn_norm, x, rows, n, P->eps, bf, threads);
        stream = h_out;
    } else
        add_norm(h, NULL, NULL, attn_norm, x, rows, n, P->eps, bf, threads);
    linear_act(qkv, x, a, rows, bf, threads);
    attend_pass(P, a, kv, slots, window, b);
    linear_act(o, b, a, rows, bf, threads);
    add_norm(stream, a, h_out, mlp_norm, x, rows, n, P->eps, bf, threads);
    linear_act(gate_up, x, a, rows, bf, threads);
    silu_mul(a, c, rows, inner, bf, threads);
    linear_act(down, c, y_out, rows, bf, threads);
    free(x);
}

typedef struct { /* one layer's weights for `layers` (ops.Fused.layers builds them once per model) */
    const void *attn_norm, *mlp_norm;
    const linear_spec *qkv, *o, *gate_up, *down;
    int64_t window; /* 0: none */
} layer_spec;

/* ---- a pass's layers in one OpenMP team -----------------------------------------------------------------
 * `layer` opens a parallel region per linear and one for attention, and runs the glue and each linear's
 * quantization of x between them on one thread: in a 1-row int4 draft step the second thread waited
 * ~30 % of the time (perf over benchmarks/draft.py). Where every linear is an int8-activation 4-bit one
 * (team_kind), one team runs all the layers instead: a row's glue on one thread (omp for over rows), each
 * linear's x widened and quantized by every thread for itself (a row: ~1 us, less than a barrier) with the
 * panels split as q4_i8 splits them, attention's items and merge as `attend` splits them. The same kernels
 * and the same operations per element as `layer`, so the same bits. Every other kind in the team too
 * (each kernel's omp-for body shared with its exported function) measured slower for the fp32 codes
 * step (benchmarks/step.py, ctx 300, 5 alternations: 5 rows 16.35 against 13.61 ms, medians; the cause
 * was not found), so the other kinds keep a region per call. */
#ifdef DOT_I8
static int team_kind(const linear_spec *L) {
    return L->kind == LINEAR_Q4_I8 || (q2_i8() && L->kind == LINEAR_Q2_I8) ||
           (SHARED_CODES && (L->kind == LINEAR_Q4_CODES_I8 || L->kind == LINEAR_Q4_PAIR_CODES_I8));
}

static int team_ready(const layer_spec *L, int64_t count) {
    for (int64_t i = 0; i < count; i++)
        if (!team_kind(L[i].qkv) || !team_kind(L[i].o) || !team_kind(L[i].gate_up) || !team_kind(L[i].down))
            return 0;
    return count > 0;
}

typedef struct { /* one thread's: x widened and quantized for a linear, add_norm's row */
    float *xf, *d, *s, *t;
    int32_t *qsum;
    int8_t *qx;
} team_scratch;

static team_scratch scratch_for(int64_t rows, int64_t in) { /* in: the widest input of the pass's linears */
    int64_t n = rows * in, blocks = n / 32;
    team_scratch S;
    S.xf = malloc(sizeof(float) * (size_t)(n + 3 * blocks + in + LANES) + (size_t)n);
    S.d = S.xf + n, S.s = S.d + blocks, S.qsum = (int32_t *)(S.s + blocks), S.t = (float *)(S.qsum + blocks);
    S.qx = (int8_t *)(S.t + in + LANES);
    return S;
}

/* The linear L (team_kind) on x [rows, in] in the pass's dtype -> y [rows, out] (bf: through yf [rows, out]
 * float32, rounded to bfloat16 panel by panel as linear_act's convert rounds them); called by every thread
 * of the team, and ends in its barrier. */
static void team_linear(const linear_spec *L, const void *x, void *y, float *yf, int64_t rows, int bf,
                        team_scratch *S) {
    int64_t in = L->in, out = L->out, n = rows * in, count = (out + PANEL - 1) / PANEL;
    int layout = L->kind == LINEAR_Q4_I8         ? Q4_OWN
                 : L->kind == LINEAR_Q2_I8       ? Q2_OWN
                 : L->kind == LINEAR_Q4_CODES_I8 ? Q4_CODES
                                                 : Q4_PAIR_CODES;
    const float *xf = x;
    if (bf) {
        for (int64_t i = 0; i < n; i += LANES) putn(S->xf, i, getn(x, i, n - i, 1), n - i, 0);
        xf = S->xf;
    }
    quantize_i8(xf, S->qx, S->d, S->s, S->qsum, rows, in);
    q4_order(S->qx, n, layout);
    float *dst = bf ? yf : y;
    const uint8_t *panels = L->w;
#pragma omp for schedule(static)
    for (int64_t p = 0; p < count; p++) {
        q4_panel(S->qx, S->d, S->s, panels + p * (in / 32) * group_bytes(layout), dst, rows, in, out, p, layout);
        for (int64_t r = 0; r < rows && bf; r++)
            for (int64_t c = p * PANEL; c < out && c < (p + 1) * PANEL; c += LANES)
                putn(y, r * out + c, getn(yf, r * out + c, out - c, 0), out - c, 1);
    }
}

typedef struct { /* what the team's threads share: one layer's activations, the states between layers */
    char *x, *a, *b, *c, *states;
    float *yf;
    attention A;
} team_buffers;

static void team_alloc(team_buffers *B, const pass_info *P, const layer_spec *L) {
    int64_t rows = P->batch * P->seq_len, n = P->hidden, elem = P->bf ? 2 : 4, inner = L->gate_up->out / 2;
    int64_t width = L->qkv->out > L->gate_up->out ? L->qkv->out : L->gate_up->out;
    width = width > n ? width : n;
    B->x = malloc((size_t)(rows * (5 * n + 2 * width + inner) * elem) + sizeof(float) * (size_t)(rows * width));
    B->a = B->x + rows * n * elem, B->b = B->a + rows * width * elem, B->c = B->b + rows * width * elem;
    B->states = B->c + rows * inner * elem, B->yf = (float *)(B->states + 4 * rows * n * elem);
}

/* `layer` for every thread of a team. */
static void team_layer(const pass_info *P, void *kv, int64_t slots, int64_t window, const void *h, const void *y,
                       void *h_out, void *y_out, const layer_spec *L, team_buffers *B, team_scratch *S) {
    int64_t rows = P->batch * P->seq_len, n = P->hidden, inner = L->gate_up->out / 2, chunks = (inner + 63) / 64;
    int bf = (int)P->bf;
    const void *stream = y ? h_out : h;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        bf ? add_norm_row(h, y, h_out, L->attn_norm, B->x, r, n, P->eps, S->t, 1)
           : add_norm_row(h, y, h_out, L->attn_norm, B->x, r, n, P->eps, S->t, 0);
    team_linear(L->qkv, B->x, B->a, B->yf, rows, bf, S);
#pragma omp single
    {
        B->A = pass_attention(P, B->a, kv, slots, window, B->b);
        attention_plan(&B->A);
    }
    attention_share(&B->A, thread_number(), team_size());
#pragma omp barrier
    attention_merge(&B->A, thread_number(), team_size());
#pragma omp barrier
#pragma omp single nowait
    attention_done(&B->A);
    team_linear(L->o, B->b, B->a, B->yf, rows, bf, S);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        bf ? add_norm_row(stream, B->a, h_out, L->mlp_norm, B->x, r, n, P->eps, S->t, 1)
           : add_norm_row(stream, B->a, h_out, L->mlp_norm, B->x, r, n, P->eps, S->t, 0);
    team_linear(L->gate_up, B->x, B->a, B->yf, rows, bf, S);
#pragma omp for schedule(static)
    for (int64_t k = 0; k < rows * chunks; k++) { /* silu_mul in spans of 64 elements */
        int64_t r = k / chunks, i0 = k % chunks * 64, i1 = i0 + 64 < inner ? i0 + 64 : inner;
        bf ? silu_span(B->a, B->c, r, inner, i0, i1, 1) : silu_span(B->a, B->c, r, inner, i0, i1, 0);
    }
    team_linear(L->down, B->c, y_out, B->yf, rows, bf, S);
}

/* `layers` for every thread of a team (the states between layers in B's two pairs, used in turn). */
static void team_pass(const pass_info *P, const layer_spec *L, int64_t count, void *const *kv, int64_t slots,
                      const void *h, const void *y, void *h_out, void *y_out, team_buffers *B, team_scratch *S) {
    size_t bytes = (size_t)(P->batch * P->seq_len * P->hidden * (P->bf ? 2 : 4));
    for (int64_t i = 0; i < count; i++) {
        void *ho = h_out, *yo = y_out;
        if (i < count - 1) ho = B->states + (i % 2) * 2 * bytes, yo = (char *)ho + bytes;
        team_layer(P, kv[i], slots, L[i].window, h, y, ho, yo, &L[i], B, S);
        h = ho, y = yo;
    }
}

/* The widest input of the layers' linears and the hidden size (the LM head's). */
static int64_t widest(const pass_info *P, const layer_spec *L) {
    int64_t w = P->hidden;
    const linear_spec *all[4] = {L->qkv, L->o, L->gate_up, L->down};
    for (int i = 0; i < 4; i++) w = all[i]->in > w ? all[i]->in : w;
    return w;
}
#endif

/* `count` consecutive layers (L[i], cache kv[i]) in one call: `layer` after `layer`, the states between
 * them in two scratch pairs used in turn, the last layer's into h_out and y_out. The same calls in the
 * same order as one `layer` call each, so the same bits, without ~20 us of Python per layer. */
void layers(const pass_info *P, const layer_spec *L, int64_t count, void *const *kv, int64_t slots, const void *h,
            const void *y, void *h_out, void *y_out) {
#ifdef DOT_I8
    if (team_ready(L, count)) {
        team_buffers B;
        team_alloc(&B, P, L);
#pragma omp parallel num_threads((int)P->threads)
        {
            team_scratch S = scratch_for(P->batch * P->seq_len, widest(P, L));
            team_pass(P, L, count, kv, slots, h, y, h_out, y_out, &B, &S);
            free(S.xf);
        }
        free(B.x);
        return;
    }
#endif
    size_t bytes = (size_t)(P->batch * P->seq_len * P->hidden * (P->bf ? 2 : 4));
    char *scratch = count > 1 ? malloc(4 * bytes) : NULL;
    for (int64_t i = 0; i < count; i++) {
        void *ho = h_out, *yo = y_out;
        if (i < count - 1) ho = scratch + (i % 2) * 2 * bytes, yo = (char *)ho + bytes;
        layer(P, kv[i], slots, L[i].window, h, y, ho, yo, L[i].attn_norm, L[i].mlp_norm, L[i].qkv, L[i].o,
              L[i].gate_up, L[i].down);
        h = ho, y = yo;
    }
    free(scratch);
}

/* ---- the vocabulary: a shortlist (the quantized draft's LM head, decoding/quantized.py) and argmax -------
 * shortlist: scores [rows, n] float32, each row's k highest replaced by exact ones, the dot products of the
 * row's x [rows, in] with the float weight's rows [n, in] (float32 or, bf, bfloat16) at those indices,
 * rounded to bfloat16 where the weight is, as the target's own logits are (its ties then break alike). Ties
 * keep the lower index; NaN is shortlisted only where fewer than k scores are numbers. One call (~15 us for
 * 49152 scores from Python) where torch's topk, gather, bmm and scatter took ~0.2 ms a draft step. */
static void keep_best(float *best, int64_t *at, int64_t held, float value, int64_t index) {
    int64_t j = held;
    for (; j > 0 && value > best[j - 1]; j--) { /* strictly greater: an equal value stays behind */
        best[j] = best[j - 1];
        at[j] = at[j - 1];
    }
    best[j] = value;
    at[j] = index;
}

/* The indices of the k highest of x [n] into at [k] (best [k + 1] and block [n / 64 + 1] scratch), highest
 * first; k <= n. First a floor: the k-th highest of the maxima of blocks of 64 values (k blocks each hold
 * a value that high, so the k highest values all reach it); then only the blocks whose maximum reaches the
 * floor are searched (one pass inserting as it went took ~50 us for 49152 scores: far more insertions). */
#define BLOCK 64
static void top_k(const float *x, int64_t n, int64_t k, float *best, int64_t *at, float *block) {
    int64_t blocks = (n + BLOCK - 1) / BLOCK, held = 0;
    for (int64_t b = 0; b < blocks; b++) {
        int64_t i = b * BLOCK, e = i + BLOCK < n ? i + BLOCK : n;
        v8 top = splat8(-INFINITY);
        for (; i + LANES <= e; i += LANES) {
            v8 v = load8(x + i);
            top = select8((v8i)(v > top), v, top);
        }
        float m = -INFINITY;
        for (int l = 0; l < LANES; l++) m = top[l] > m ? top[l] : m;
        for (; i < e; i++) m = x[i] > m ? x[i] : m;
        block[b] = m;
    }
    float floor = -INFINITY;
    if (blocks >= k) {
        for (int64_t b = 0; b < blocks; b++) /* the blocks' own top k (into at for now), for its k-th value */
            if (held < k) keep_best(best, at, held++, block[b], b);
            else if (block[b] > best[k - 1]) keep_best(best, at, k - 1, block[b], b);
        floor = best[k - 1];
        held = 0;
    }
    for (int64_t b = 0; b < blocks; b++) {
        if (!(block[b] >= floor)) continue;
        int64_t e = (b + 1) * BLOCK < n ? (b + 1) * BLOCK : n;
        for (int64_t i = b * BLOCK; i < e; i++)
            if (!(x[i] >= floor)) continue;
            else if (held < k) keep_best(best, at, held++, x[i], i);
            else if (x[i] > best[k - 1]) keep_best(best, at, k - 1, x[i], i);
    }
    for (int64_t i = 0; held < k && i < n; i++) /* fewer than k numbers: NaNs last, in order */
        if (x[i] != x[i]) at[held++] = i;
}

/* The shortlisted rows are scattered over the float head (56 MB in bf16): each was a wait on memory, so
 * the rows RESCORE_AHEAD places ahead are fetched while one is rescored. After an 80 MB stream, as in a
 * draft step (an ad-hoc ctypes loop, AMD EPYC Zen 4, two runs, medians): bf16 k = 128 160 -> 147 and
 * 130 -> 108 us, fp32 k = 32 47 -> 43 and 58 -> 56 us; 3 to 24 rows ahead did alike. */
#define RESCORE_AHEAD 6
static inline void prefetch_row(const void *weight, int64_t row, int64_t in, int bf) {
    const char *p = (const char *)weight + row * in * (bf ? 2 : 4);
    for (int64_t b = 0; b < in * (bf ? 2 : 4); b += 64) __builtin_prefetch(p + b, 0, 3);
}

void shortlist(float *scores, int64_t rows, int64_t n, int64_t k, const float *x, int64_t in, const void *weight,
               int bf) {
    int64_t *at = malloc(sizeof(int64_t) * (size_t)k + sizeof(float) * (size_t)(k + 2 + n / BLOCK));
    float *best = (float *)(at + k), *block = best + k + 1;
    for (int64_t r = 0; r < rows; r++) {
        top_k(scores + r * n, n, k, best, at, block);
        const float *xr = x + r * in;
        for (int64_t j = 0; j < k && j < RESCORE_AHEAD; j++) prefetch_row(weight, at[j], in, bf);
        for (int64_t j = 0; j < k; j++) {
            if (j + RESCORE_AHEAD < k) prefetch_row(weight, at[j + RESCORE_AHEAD], in, bf);
            int64_t o = at[j] * in, i = 0;
            v8 acc = {0};
            for (; i + LANES <= in; i += LANES) acc = fma8(acc, load8(xr + i), get8(weight, o + i, bf));
            float sum = sum8(acc);
            for (; i < in; i++) sum += xr[i] * get(weight, o + i, bf);
            scores[r * n + at[j]] = round_as(sum, bf);
        }
    }
    free(at);
}

/* x [rows, n] float32 -> out [rows]: each row's argmax as torch.argmax gives it (the first of equal
 * maxima; the first NaN where a row has one), in two vector passes (the maximum, then where it first is):
 * ~5 us for 49152 logits, where torch.argmax took 50-90 us here (a greedy step makes one or two). */
void argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        v8 top[4] = {splat8(-INFINITY), splat8(-INFINITY), splat8(-INFINITY), splat8(-INFINITY)};
        v8i nan[4] = {{0}};
        int64_t i = 0;
        for (; i + 4 * LANES <= n; i += 4 * LANES) /* four chains: one would wait on its compare and blend */
            for (int c = 0; c < 4; c++) {
                v8 v = load8(xr + i + c * LANES);
                nan[c] |= v != v;
                top[c] = select8((v8i)(v > top[c]), v, top[c]);
            }
        for (; i + LANES <= n; i += LANES) {
            v8 v = load8(xr + i);
            nan[0] |= v != v;
            top[0] = select8((v8i)(v > top[0]), v, top[0]);
        }
        float m = -INFINITY;
        int any = 0;
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < LANES; l++) m = top[c][l] > m ? top[c][l] : m, any |= nan[c][l] != 0;
        for (; i < n; i++) m = xr[i] > m ? xr[i] : m, any |= xr[i] != xr[i];
        int64_t at = 0;
#ifdef __AVX__ /* where the maximum first is, 8 at a time */
        for (; !any && at + LANES <= n; at += LANES) {
            int hit = _mm256_movemask_ps((__m256)(v8)(load8(xr + at) == splat8(m)));
            if (hit) {
                at += __builtin_ctz((unsigned)hit);
                break;
            }
        }
#endif
        if (any) /* NaN wins, the first one */
            while (xr[at] == xr[at]) at++;
        else
            while (at < n - 1 && !(xr[at] == m)) at++;
        out[r] = at;
    }
}

/* ---- a draft in one call ------------------------------------------------------------------------------
 * A sampled row's weights w = exp((s - max) / temperature), cut as sampling.process_logits cuts the
 * probabilities: top-k keeps the weights at or above the k-th largest, top-p the fewest largest whose mass
 * before each reaches top_p of the total (the largest always kept). Both find their cut in the weights'
 * histogram by float bits (`RANKS` ranks of 4 mantissa bits per binade, larger weights in higher ranks)
 * and sort only the rank the cut falls in, so a draw costs two passes over the vocabulary. */
#define RANKS 4096
typedef struct {
    double *mass; /* [RANKS] */
    int64_t *count; /* [RANKS] */
    float *tied; /* [n]: one rank's weights */
} ranks;

static inline int rank_of(float w) { /* w >= 0 and finite */
    uint32_t u;
    memcpy(&u, &w, sizeof u);
    return (int)(u >> 19);
}

static int descending(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

/* The histogram of w [n] (mass and count per rank) and the highest rank `limit` reaches counting down
 * from the top: by count (k) when by_mass is 0, else by mass; -> that rank, *before: what the ranks
 * above it hold, *sorted: its weights, largest first (in R->tied). */
static int cut_rank(const float *w, int64_t n, double limit, int by_mass, ranks *R, double *before, int64_t *sorted) {
    memset(R->mass, 0, sizeof(double) * RANKS);
    memset(R->count, 0, sizeof(int64_t) * RANKS);
    for (int64_t i = 0; i < n; i++) {
        int r = rank_of(w[i]);
        R->mass[r] += w[i], R->count[r]++;
    }
    int r = RANKS - 1;
    *before = 0.0;
    for (; r > 0; r--) {
        double here = by_mass ? R->mass[r] : (double)R->count[r];
        if (*before + here >= limit) break;
        *before += here;
    }
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++)
        if (rank_of(w[i]) == r) R->tied[m++] = w[i];
    qsort(R->tied, (size_t)m, sizeof(float), descending);
    *sorted = m;
    return r;
}

/* Zeroes the weights below `floor` (the ones at it stay). */
static void drop_below(float *w, int64_t n, float floor) {
    for (int64_t i = 0; i < n; i++) w[i] = w[i] < floor ? 0.0f : w[i];
}

static void cut_top_k(float *w, int64_t n, int64_t k, ranks *R) {
    double before;
    int64_t m;
    cut_rank(w, n, (double)k, 0, R, &before, &m);
    drop_below(w, n, R->tied[k - 1 - (int64_t)before < m ? k - 1 - (int64_t)before : m - 1]);
}

static void cut_top_p(float *w, int64_t n, float top_p, double total, ranks *R) {
    double before, limit = (double)top_p * total;
    int64_t m, j = 0;
    int r = cut_rank(w, n, limit, 1, R, &before, &m);
    if (before == 0.0 && m > 0) before = R->tied[j++]; /* the largest weight is always kept */
    for (; j < m && before < limit; j++) before += R->tied[j];
    float floor = j < m ? R->tied[j - 1] : R->tied[m - 1]; /* the smallest weight kept */
    for (int64_t i = 0; i < n; i++) /* ranks below r, and the rest of rank r, go */
        w[i] = rank_of(w[i]) < r || w[i] < floor ? 0.0f : w[i];
}

/* Sampling from weights: q [n] (>= 0) summed 8 at a time into one partial sum per 8 (`part`, n / 8 + 1
 * doubles), and the cumulative weights those partial sums added in order in double precision (as torch's
 * cumsum of float32 accumulates), so the last one is the total itself. pick -> the first token whose
 * cumulative weight exceeds u times the total (sampling.inverse_cdf): always one of positive weight. */
static double partial_sums(const float *q, int64_t n, double *part) {
    double total = 0.0;
    for (int64_t i = 0, j = 0; i < n; i += LANES, j++) {
        part[j] = (double)sum8(getn(q, i, n - i, 0)); /* past n: 0s */
        total += part[j];
    }
    return total;
}

static int64_t last_positive(const float *q, int64_t from, int64_t to) {
    int64_t l = to - 1;
    while (l > from && !(q[l] > 0)) l--;
    return l;
}

static int64_t pick(const float *q, int64_t n, const double *part, double total, float u) {
    double target = u * total, below = 0.0;
    for (int64_t i = 0, j = 0; i < n; i += LANES, j++) {
        if (!(below + part[j] > target)) {
            below += part[j];
            continue;
        }
        int64_t end = i + LANES < n ? i + LANES : n;
        for (int64_t l = i; l < end; l++) /* the token within these 8 */
            if ((below += q[l]) > target) return l;
        return last_positive(q, i, end); /* their float sum rounded above the running one */
    }
    return last_positive(q, 0, n); /* u * total rounded up to the total */
}

/* q [n] <- the distribution of scores s as sampling.process_logits makes it: at temperature 0 the one-hot
 * of the argmax (the first of equal maxima), else softmax(s / temperature) cut by top-k (0: off) and top-p
 * (1: off). A row without a finite maximum (NaN or infinite scores), or at a temperature whose inverse
 * overflows, is its one-hot too (sampling._scale's limit, up to exact ties). -> Σ q (1 up to rounding),
 * with part its partial sums, for `pick`. */
static double distribution(const float *s, int64_t n, float temperature, int64_t top_k, float top_p, float *q,
                           double *part, ranks *R) {
    int64_t top;
    argmax_rows(s, 1, n, &top);
    float m = s[top];
    if (!(temperature > 0) || !(m - m == 0.0f) || !(1.0f / temperature < INFINITY)) {
        memset(q, 0, sizeof(float) * (size_t)n);
        q[top] = 1.0f;
        return partial_sums(q, n, part);
    }
    v8 inv = splat8(1.0f / temperature);
    for (int64_t i = 0; i < n; i += LANES) putn(q, i, exp8((getn(s, i, n - i, 0) - splat8(m)) * inv), n - i, 0);
    if (top_k > 0 && top_k < n) cut_top_k(q, n, top_k, R);
    if (top_p < 1.0f) cut_top_p(q, n, top_p, partial_sums(q, n, part), R);
    v8 sum = splat8((float)partial_sums(q, n, part));
    for (int64_t i = 0; i < n; i += LANES) putn(q, i, getn(q, i, n - i, 0) / sum, n - i, 0);
    return partial_sums(q, n, part);
}

/* One sampled draft token of a row: q [n] <- its distribution, and the token a uniform u in [0, 1) draws
 * from it. */
static int64_t draw(const float *s, int64_t n, float temperature, int64_t top_k, float top_p, float u, float *q,
                    double *part, ranks *R) {
    double total = distribution(s, n, temperature, top_k, top_p, q, part, R);
    return pick(q, n, part, total, u);
}

/* Speculative sampling of one round (decoding/acceptance.py's rule, rejection_sample's draws), row by row:
 * draft d_i is kept while u_i q_i(d_i) < p_i(d_i); at the first rejected position k the last token is drawn
 * with u_final from normalize(max(0, p_k - q_k)) (from p_k where that mass is at most `eps`), after cap
 * accepted drafts from p_cap (the bonus). Only the distributions up to there are computed.
 *   logits    [rows, width, vocab] float32: the target's, penalized where a row penalizes
 *   drafts    [rows, width - 1] and caps [rows]: each row's drafts and how many it has
 *   q         [rows * (width - 1)] addresses of each draft's distribution [vocab]; NULL: a point mass on
 *             the draft itself (lookup, a greedy draft)
 *   temperature, top_k, top_p [rows]: each row's processing, as `distribution`
 *   u         [rows, width - 1] the acceptance tests, u_final [rows] the last token's draw
 *   out       [rows, width]: the accepted drafts, then the last token (the rest left as they are);
 *   accepted  [rows] */
void accept_drafts(const float *logits, int64_t rows, int64_t width, int64_t vocab, const int64_t *drafts,
                   const int64_t *caps, const float *const *q, const float *temperature, const int64_t *top_k,
                   const float *top_p, const float *u, const float *u_final, float eps, int64_t *out,
                   int64_t *accepted) {
    int64_t gamma = width - 1;
    float *p = malloc(sizeof(float) * (size_t)(2 * vocab)), *r = p + vocab;
    double *part = malloc(sizeof(double) * (size_t)(vocab / LANES + 1 + RANKS));
    ranks R = {part + vocab / LANES + 1, malloc(sizeof(int64_t) * RANKS), malloc(sizeof(float) * (size_t)vocab)};
    for (int64_t b = 0; b < rows; b++) {
        int64_t k = 0, cap = caps[b], last;
        const float *row = logits + b * width * vocab;
        double total = 0.0;
        for (; k <= cap; k++) {
            total = distribution(row + k * vocab, vocab, temperature[b], top_k[b], top_p[b], p, part, &R);
            if (k == cap) break;
            int64_t d = drafts[b * gamma + k];
            const float *qk = q[b * gamma + k];
            if (!(u[b * gamma + k] * (qk ? qk[d] : 1.0f) < p[d])) break;
            out[b * width + k] = d;
        }
        if (k < cap) { /* the residual of p_k over q_k */
            int64_t d = drafts[b * gamma + k];
            const float *qk = q[b * gamma + k];
            for (int64_t i = 0; i < vocab; i++) {
                float x = p[i] - (qk ? qk[i] : (float)(i == d));
                r[i] = x > 0 ? x : 0.0f;
            }
            double mass = partial_sums(r, vocab, part);
            last = mass > eps ? pick(r, vocab, part, mass, u_final[b]) : pick(p, vocab, part, partial_sums(p, vocab, part), u_final[b]);
        } else
            last = pick(p, vocab, part, total, u_final[b]);
        out[b * width + k] = last;
        accepted[b] = k;
    }
    free(R.count);
    free(R.tied);
    free(part);
    free(p);
}

/* `steps` draft tokens for each of P->batch sequences from tokens[b] (decoding/quantized.py's fast path):
 * each step embeds every row's input, runs `count` layers (`layers`), adds the last residual, normalizes,
 * scores the vocabulary with the shortlisted head (the coarse linear `head`, then `shortlist` with the float
 * `weight`'s rows) and picks each row's next input: its argmax where temperature is NULL or temperature[b]
 * is 0, else `draw` at its temperature, top_k and top_p with the uniform u[b, step], its distribution
 * written to q [batch, steps, vocab]. P
 * describes the whole draft as one pass of seq_len = steps (positions and write_slots [batch, steps]); step
 * j runs row b's entry j as a pass of one row per sequence. The calls and their order are the Python
 * path's (decoder.forward, DecoderModel.logits, Shortlist, then sampling.argmax or a draw), so the same
 * greedy tokens, without its ~0.4-0.6 ms of Python and tensor bookkeeping per draft step (~10 % of a
 * greedy draft token here, ~25 % of a sampled one). out: [batch, steps]. */
typedef struct { /* draft_tokens' state, which its steps share */
    const pass_info *P;
    pass_info Q; /* one step's pass: one row per sequence */
    const void *embed, *norm, *weight;
    const linear_spec *head;
    int64_t k;
    const float *temperature, *top_p, *u;
    const int64_t *top_k;
    float *q, *xf, *scores;
    int64_t *out, *pos, *slot, *next;
    char *h, *h_out, *y_out, *x;
    double *part;
    ranks R;
} drafting;

/* Step j's inputs: each row's position, slot and embedded token. */
static void draft_inputs(drafting *D, int64_t j) {
    const pass_info *P = D->P;
    int64_t n = P->hidden, elem = P->bf ? 2 : 4, steps = P->seq_len;
    for (int64_t b = 0; b < P->batch; b++) {
        D->pos[b] = P->positions[b * steps + j], D->slot[b] = P->write_slots[b * steps + j];
        memcpy(D->h + b * n * elem, (const char *)D->embed + D->next[b] * n * elem, (size_t)(n * elem));
    }
}

/* The last residual added and the final norm, in float32 for the head. */
static void draft_norm(drafting *D, int threads) {
    const pass_info *P = D->P;
    int64_t rows = P->batch, n = P->hidden;
    int bf = (int)P->bf;
    for (int64_t i = 0; i < rows * n; i++) put(D->h, i, get(D->h_out, i, bf) + get(D->y_out, i, bf), bf); /* h + y */
    add_norm(D->h, NULL, NULL, D->norm, D->x, rows, n, P->eps, bf, threads);
    for (int64_t i = 0; i < rows * n; i++) D->xf[i] = get(D->x, i, bf);
}

/* The shortlist's exact scores, then each row's step-j token. */
static void draft_pick(drafting *D, int64_t j) {
    const pass_info *P = D->P;
    int64_t rows = P->batch, steps = P->seq_len, vocab = D->head->out;
    shortlist(D->scores, rows, vocab, D->k, D->xf, P->hidden, D->weight, (int)P->bf);
    for (int64_t b = 0; b < rows; b++) {
        const float *s = D->scores + b * vocab;
        if (D->temperature && D->temperature[b] > 0)
            D->next[b] = draw(s, vocab, D->temperature[b], D->top_k[b], D->top_p[b], D->u[b * steps + j],
                              D->q + (b * steps + j) * vocab, D->part, &D->R);
        else
            argmax_rows(s, 1, vocab, D->next + b);
        D->out[b * steps + j] = D->next[b];
    }
}

void draft_tokens(const pass_info *P, const layer_spec *L, int64_t count, void *const *kv, int64_t slots,
                  const void *embed, const void *norm, const linear_spec *head, int64_t k, const void *weight,
                  const int64_t *tokens, const float *temperature, const int64_t *top_k, const float *top_p,
                  const float *u, float *q, int64_t *out) {
    int64_t rows = P->batch, steps = P->seq_len, n = P->hidden, vocab = head->out, elem = P->bf ? 2 : 4;
    drafting D = {.P = P, .Q = *P, .embed = embed, .norm = norm, .weight = weight, .head = head, .k = k,
                  .temperature = temperature, .top_p = top_p, .u = u, .top_k = top_k, .q = q, .out = out};
    D.h = malloc((size_t)(4 * rows * n * elem) + sizeof(float) * (size_t)(rows * (n + vocab)));
    D.h_out = D.h + rows * n * elem, D.y_out = D.h_out + rows * n * elem, D.x = D.y_out + rows * n * elem;
    D.xf = (float *)(D.x + rows * n * elem), D.scores = D.xf + rows * n;
    D.part = malloc(sizeof(double) * (size_t)(vocab / LANES + 1 + RANKS));
    D.R = (ranks){D.part + vocab / LANES + 1, malloc(sizeof(int64_t) * RANKS), malloc(sizeof(float) * (size_t)vocab)};
    int64_t *meta = malloc(sizeof(int64_t) * (size_t)(4 * rows)), *ones = meta;
    D.pos = ones + rows, D.slot = D.pos + rows, D.next = D.slot + rows;
    D.Q.num_tokens = ones, D.Q.seq_len = 1, D.Q.positions = D.pos, D.Q.write_slots = D.slot;
    for (int64_t b = 0; b < rows; b++) ones[b] = 1, D.next[b] = tokens[b];
#ifdef DOT_I8
    if (team_ready(L, count) && team_kind(head)) { /* every step in one team */
        team_buffers B;
        team_alloc(&B, &D.Q, L);
#pragma omp parallel num_threads((int)P->threads)
        {
            team_scratch S = scratch_for(rows, widest(P, L));
            for (int64_t j = 0; j < steps; j++) {
#pragma omp single
                draft_inputs(&D, j);
                team_pass(&D.Q, L, count, kv, slots, D.h, NULL, D.h_out, D.y_out, &B, &S);
#pragma omp single
                draft_norm(&D, 1);
                team_linear(head, D.xf, D.scores, NULL, rows, 0, &S);
#pragma omp single
                draft_pick(&D, j);
            }
            free(S.xf);
        }
        free(B.x);
        steps = 0;
    }
#endif
    for (int64_t j = 0; j < steps; j++) {
        draft_inputs(&D, j);
        layers(&D.Q, L, count, kv, slots, D.h, NULL, D.h_out, D.y_out);
        draft_norm(&D, (int)P->threads);
        linear_run(head, D.xf, D.scores, rows, (int)P->threads);
        draft_pick(&D, j);
    }
    free(D.R.count);
    free(D.R.tied);
    free(D.part);
    free(meta);
    free(D.h);
}
