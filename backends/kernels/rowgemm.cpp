// A few rows times every weight, at the speed the weights stream from memory (fp32, CPU).
//
// out (M, N) = x (M, K) @ W^T (+ add): W (N, K) is packed once into column blocks of NB = 32
// outputs, each a (K, NB) panel read front to back, so a block's weights arrive as one
// sequential stream. Eight rows at a time keep 8 x 2 vector accumulators in registers, so every
// weight loaded feeds up to 16 multiply-adds and, on a few rows, the loop is bound by memory
// bandwidth, not by the FMA units (the reason oneDNN's and MKL's kernels are not: theirs block
// 64 outputs or more, which does not fit 8 rows' accumulators in the 32 vector registers).
// More rows run in chunks of 8 over a block while it sits in L1/L2, so it leaves DRAM once.
//
// Built at first use with the host's C++ compiler and -march=native (backends/cpu_kernels.py);
// GCC's vector extensions compile to AVX-512, AVX2 or NEON, whatever the host has. OpenMP
// runs in the runtime PyTorch already loaded (same libgomp soname), on `threads` threads.

#define NB 32
typedef float v16 __attribute__((vector_size(64), aligned(4)));

extern "C" {

// W (n, k) row-major -> out (ceil(n / NB), k, NB), rows past n zero.
void rowgemm_pack(const float *w, float *out, long n, long k, int threads) {
    long blocks = (n + NB - 1) / NB;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long b = 0; b < blocks; b++) {
        float *dst = out + b * k * NB;
        for (long kk = 0; kk < k; kk++)
            for (long j = 0; j < NB; j++) {
                long row = b * NB + j;
                dst[kk * NB + j] = row < n ? w[row * k + kk] : 0.0f;
            }
    }
}

}  // extern "C"

// One (MR, NB) output tile: rows x (MR, ldx) times panel (k, NB), plus add (MR rows of lda,
// lda 0: one row broadcast), into out (MR rows of ldo), its first `cols` columns.
template <int MR>
static void tile(const float *x, long ldx, const float *panel, long k, float *out, long ldo, long cols,
                 const float *add, long lda) {
    // Up to 4 rows, even and odd k add into separate accumulators: a row's adds are a chain
    // of dependent FMAs, and 2 x 2 chains per row do not cover the FMA's latency.
    constexpr int SETS = MR <= 4 ? 2 : 1;
    v16 lo[SETS][MR], hi[SETS][MR];
    for (int s = 0; s < SETS; s++)
        for (int m = 0; m < MR; m++) {
            lo[s][m] = v16{};
            hi[s][m] = v16{};
        }
    long kk = 0;
    for (; kk + SETS <= k; kk += SETS)
        for (int s = 0; s < SETS; s++) {
            v16 w0 = *(const v16 *)(panel + (kk + s) * NB);
            v16 w1 = *(const v16 *)(panel + (kk + s) * NB + 16);
            for (int m = 0; m < MR; m++) {
                float xv = x[m * ldx + kk + s];
                lo[s][m] += xv * w0;
                hi[s][m] += xv * w1;
            }
        }
    for (; kk < k; kk++) {
        v16 w0 = *(const v16 *)(panel + kk * NB);
        v16 w1 = *(const v16 *)(panel + kk * NB + 16);
        for (int m = 0; m < MR; m++) {
            float xv = x[m * ldx + kk];
            lo[0][m] += xv * w0;
            hi[0][m] += xv * w1;
        }
    }
    for (int s = 1; s < SETS; s++)
        for (int m = 0; m < MR; m++) {
            lo[0][m] += lo[s][m];
            hi[0][m] += hi[s][m];
        }
    for (int m = 0; m < MR; m++) {
        float row[NB];
        *(v16 *)row = lo[0][m];
        *(v16 *)(row + 16) = hi[0][m];
        float *o = out + m * ldo;
        if (add) {
            const float *a = add + m * lda;
            for (long j = 0; j < cols; j++) o[j] = row[j] + a[j];
        } else {
            for (long j = 0; j < cols; j++) o[j] = row[j];
        }
    }
}

typedef void (*tile_fn)(const float *, long, const float *, long, float *, long, long, const float *, long);
static const tile_fn TILES[9] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>, tile<7>, tile<8>};

extern "C" {

// out (m, n) = x (m, k) @ W^T + add; packed from rowgemm_pack; add null, (m, n) with lda n,
// or one (n,) row with lda 0 (a bias). Every pointer contiguous fp32.
void rowgemm(const float *x, const float *packed, float *out, const float *add, long lda, long m, long n, long k,
             int threads) {
    long blocks = (n + NB - 1) / NB;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long b = 0; b < blocks; b++) {
        long cols = n - b * NB < NB ? n - b * NB : NB;
        const float *panel = packed + b * k * NB;
        for (long r = 0; r < m; r += 8) {
            long rows = m - r < 8 ? m - r : 8;
            TILES[rows](x + r * k, k, panel, k, out + r * n + b * NB, n, cols,
                        add ? add + r * lda + b * NB : nullptr, lda);
        }
    }
}

}  // extern "C"

// ---- bf16: the same panels of 32 outputs, k in pairs ((ceil(n / NB), ceil(k / 2), NB, 2)), each
// pair's two products summed into an fp32 accumulator by one AVX512-BF16 instruction
// (vdpbf16ps: twice fp32's multiply-adds per cycle, half its bytes); the sum is rounded to
// bf16 once, at the end, as oneDNN's bf16 matmul does. Built only where the compiler targets it.
#include <stdint.h>

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    __builtin_memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) {  // round to nearest even; NaN stays NaN
    uint32_t bits;
    __builtin_memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

extern "C" {

int rowgemm_has_bf16(void) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

// W (n, k) bf16 row-major -> (ceil(n / NB), ceil(k / 2), NB, 2), rows past n and k zero.
void rowgemm_pack_bf16(const uint16_t *w, uint16_t *out, long n, long k, int threads) {
    long blocks = (n + NB - 1) / NB, pairs = (k + 1) / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long b = 0; b < blocks; b++) {
        uint16_t *dst = out + b * pairs * NB * 2;
        for (long p = 0; p < pairs; p++)
            for (long j = 0; j < NB; j++)
                for (long h = 0; h < 2; h++) {
                    long row = b * NB + j, col = 2 * p + h;
                    dst[(p * NB + j) * 2 + h] = row < n && col < k ? w[row * k + col] : 0;
                }
    }
}

}  // extern "C"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

template <int MR>
static void tile_bf16(const uint16_t *x, long ldx, const uint16_t *panel, long k, uint16_t *out, long ldo,
                      long cols, const uint16_t *add, long lda) {
    constexpr int SETS = MR <= 4 ? 2 : 1;  // as the fp32 tile: more chains than FMA latency needs
    __m512 lo[SETS][MR], hi[SETS][MR];
    for (int s = 0; s < SETS; s++)
        for (int m = 0; m < MR; m++) {
            lo[s][m] = _mm512_setzero_ps();
            hi[s][m] = _mm512_setzero_ps();
        }
    long full = k / 2, p = 0;
    for (; p + SETS <= full; p += SETS)
        for (int s = 0; s < SETS; s++) {
            __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + (p + s) * NB * 2);
            __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + (p + s) * NB * 2 + 32);
            for (int m = 0; m < MR; m++) {
                uint32_t pair;
                __builtin_memcpy(&pair, x + m * ldx + 2 * (p + s), 4);
                __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
                lo[s][m] = _mm512_dpbf16_ps(lo[s][m], xv, w0);
                hi[s][m] = _mm512_dpbf16_ps(hi[s][m], xv, w1);
            }
        }
    for (; p < full; p++) {
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + p * NB * 2);
        __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + p * NB * 2 + 32);
        for (int m = 0; m < MR; m++) {
            uint32_t pair;
            __builtin_memcpy(&pair, x + m * ldx + 2 * p, 4);
            __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
            lo[0][m] = _mm512_dpbf16_ps(lo[0][m], xv, w0);
            hi[0][m] = _mm512_dpbf16_ps(hi[0][m], xv, w1);
        }
    }
    for (int s = 1; s < SETS; s++)
        for (int m = 0; m < MR; m++) {
            lo[0][m] = _mm512_add_ps(lo[0][m], lo[s][m]);
            hi[0][m] = _mm512_add_ps(hi[0][m], hi[s][m]);
        }
    if (k % 2) {  // the last k alone: its pair's second half is zero in the panel and here
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + full * NB * 2);
        __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + full * NB * 2 + 32);
        for (int m = 0; m < MR; m++) {
            __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x[m * ldx + k - 1]);
            lo[0][m] = _mm512_dpbf16_ps(lo[0][m], xv, w0);
            hi[0][m] = _mm512_dpbf16_ps(hi[0][m], xv, w1);
        }
    }
    for (int m = 0; m < MR; m++) {
        float row[NB];
        _mm512_storeu_ps(row, lo[0][m]);
        _mm512_storeu_ps(row + 16, hi[0][m]);
        uint16_t *o = out + m * ldo;
        const uint16_t *a = add ? add + m * lda : nullptr;
        for (long j = 0; j < cols; j++) o[j] = float_to_bf16(a ? row[j] + bf16_to_float(a[j]) : row[j]);
    }
}

typedef void (*tile_bf16_fn)(const uint16_t *, long, const uint16_t *, long, uint16_t *, long, long,
                             const uint16_t *, long);
static const tile_bf16_fn TILES_BF16[9] = {nullptr, tile_bf16<1>, tile_bf16<2>, tile_bf16<3>, tile_bf16<4>,
                                            tile_bf16<5>, tile_bf16<6>, tile_bf16<7>, tile_bf16<8>};

extern "C" void rowgemm_bf16(const uint16_t *x, const uint16_t *packed, uint16_t *out, const uint16_t *add, long lda,
                             long m, long n, long k, int threads) {
    long blocks = (n + NB - 1) / NB, panel_size = (k + 1) / 2 * NB * 2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long b = 0; b < blocks; b++) {
        long cols = n - b * NB < NB ? n - b * NB : NB;
        for (long r = 0; r < m; r += 8) {
            long rows = m - r < 8 ? m - r : 8;
            TILES_BF16[rows](x + r * k, k, packed + b * panel_size, k, out + r * n + b * NB, n, cols,
                             add ? add + r * lda + b * NB : nullptr, lda);
        }
    }
}
#else
extern "C" void rowgemm_bf16(const uint16_t *, const uint16_t *, uint16_t *, const uint16_t *, long, long, long, long,
                             int) {}
#endif
