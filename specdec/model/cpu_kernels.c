/* A float32 forward pass on CPU in a fixed order: every result a token gets is computed the same
way whatever else the pass holds.

A request's logits must not depend on how it was scheduled: its batch mates, how many rows the
pass has, whether its tokens came as a prompt, a decode step or a verify pass, the thread count.
Libraries choose their kernels by shape (MKL's one-row product sums in another order than its
many-row one, so a verify pass and a decode step gave one token logits 1e-5 apart, and a near
tie then another token). Here each output element is one fixed chain of fused multiply-adds over
its own inputs: rows and threads only change which element is computed when, never how. Loops over
rows, tokens, heads and column panels are split across threads (OpenMP, sharing torch's runtime:
both link libgomp.so.1); reductions are never split.

Every tensor is float32 and contiguous, rows first; indices are int64 as torch keeps them. The
Python side (specdec/model/cpu_kernels.py) checks shapes and pointers before calling; nothing here
checks bounds.
*/
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

/* Work below which a loop stays on the calling thread (a team's start costs a few microseconds). */
#define PARALLEL_MIN_FLOPS (1 << 17)

/* 1 / sqrt(mean(x^2) + eps) over dim floats: the scale of an RMSNorm. */
static inline float inverse_rms(const float *x, int64_t dim, float eps) {
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < dim; i++) squares += x[i] * x[i];
    return 1.0f / sqrtf(squares / (float)dim + eps);
}

/* x [rows, dim] += delta [rows, dim] (skipped when delta is NULL: the first layer), then
   out [rows, dim] = weight [dim] * x / sqrt(mean(x^2) + eps), as Llama's RMSNorm computes it. */
void add_rms_norm(float *x, const float *delta, const float *weight, float *out,
                  int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for schedule(static) if (rows * dim * 4 >= PARALLEL_MIN_FLOPS)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * dim, *o = out + r * dim;
        if (delta) {
            const float *d = delta + r * dim;
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) xr[i] += d[i];
        }
        const float inv_rms = inverse_rms(xr, dim, eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[i] = weight[i] * (xr[i] * inv_rms);
    }
}

/* gate_up [rows, 2 * inter] (gate then up) -> out [rows, inter] = silu(gate) * up. */
void silu_mul(const float *gate_up, float *out, int64_t rows, int64_t inter) {
#pragma omp parallel for schedule(static) if (rows * inter * 16 >= PARALLEL_MIN_FLOPS)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        for (int64_t i = 0; i < inter; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* In each row of qkv [T, (H + 2 Hkv) * D] (q heads, k heads, v heads): normalise each q and k
   head over D when head_norm [H + Hkv, D] is given (Qwen3), rotate them by their token's position
   (cos, sin [positions, D], halves not interleaved, as Hugging Face), and copy k and v into the
   cache's flat rows `slots` [T] (k_cache, v_cache [cache rows, Hkv, D]). q stays rotated in qkv. */
void rope_store_kv(float *qkv, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim,
                   const int64_t *positions, const float *cos, const float *sin,
                   const float *head_norm, float eps, const int64_t *slots,
                   float *k_cache, float *v_cache) {
    const int64_t width = (heads + 2 * kv_heads) * dim, half = dim / 2;
#pragma omp parallel for schedule(static) if (tokens * width * 8 >= PARALLEL_MIN_FLOPS)
    for (int64_t t = 0; t < tokens; t++) {
        float *row = qkv + t * width;
        const float *c = cos + positions[t] * dim, *s = sin + positions[t] * dim;
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            float *v = row + h * dim;
            if (head_norm) {
                const float inv_rms = inverse_rms(v, dim, eps);
                const float *w = head_norm + h * dim;
#pragma omp simd
                for (int64_t i = 0; i < dim; i++) v[i] = (v[i] * inv_rms) * w[i];
            }
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
        memcpy(k_cache + slots[t] * kv_heads * dim, row + heads * dim, kv_heads * dim * sizeof(float));
        memcpy(v_cache + slots[t] * kv_heads * dim, row + (heads + kv_heads) * dim,
               kv_heads * dim * sizeof(float));
    }
}

/* a . b over n floats. */
static inline float dot(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float sum = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
    /* Two independent vector sums (no chain of dependent multiply-adds), one horizontal add. */
    __m256 even = _mm256_setzero_ps(), odd = even;
    for (; i + 16 <= n; i += 16) {
        even = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), even);
        odd = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), odd);
    }
    const __m256 both = _mm256_add_ps(even, odd);
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(both), _mm256_extractf128_ps(both, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    sum = _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
#endif
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* out [dim] = sum_j softmax(scores)_j v_j over j < length, v_j = values + slots[j] * row. scores
   are overwritten. */
static void weighted_sum(float *scores, const float *values, const int64_t *slots, int64_t length,
                         int64_t row, int64_t dim, float *out) {
    float best = -INFINITY, total = 0.0f;
    for (int64_t j = 0; j < length; j++) best = scores[j] > best ? scores[j] : best;
    for (int64_t j = 0; j < length; j++) {
        scores[j] = expf(scores[j] - best);
        total += scores[j];
    }
    const float inv_total = 1.0f / total;
    int64_t start = 0;
#if defined(__AVX2__) && defined(__FMA__)
    /* 64 output floats at a time, summed in eight registers (head sizes 64 and 128). */
    for (; start + 64 <= dim; start += 64) {
        __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
        for (int64_t j = 0; j < length; j++) {
            const float *v = values + slots[j] * row + start;
            const __m256 p = _mm256_set1_ps(scores[j]);
            s0 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v), s0);
            s1 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8), s1);
            s2 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 16), s2);
            s3 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 24), s3);
            s4 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 32), s4);
            s5 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 40), s5);
            s6 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 48), s6);
            s7 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 56), s7);
        }
        const __m256 norm = _mm256_set1_ps(inv_total);
        float *o = out + start;
        _mm256_storeu_ps(o, _mm256_mul_ps(s0, norm));
        _mm256_storeu_ps(o + 8, _mm256_mul_ps(s1, norm));
        _mm256_storeu_ps(o + 16, _mm256_mul_ps(s2, norm));
        _mm256_storeu_ps(o + 24, _mm256_mul_ps(s3, norm));
        _mm256_storeu_ps(o + 32, _mm256_mul_ps(s4, norm));
        _mm256_storeu_ps(o + 40, _mm256_mul_ps(s5, norm));
        _mm256_storeu_ps(o + 48, _mm256_mul_ps(s6, norm));
        _mm256_storeu_ps(o + 56, _mm256_mul_ps(s7, norm));
    }
#endif
    if (start == dim) return;
    memset(out + start, 0, (dim - start) * sizeof(float));
    for (int64_t j = 0; j < length; j++) {
        const float *v = values + slots[j] * row, p = scores[j];
#pragma omp simd
        for (int64_t i = start; i < dim; i++) out[i] += p * v[i];
    }
    for (int64_t i = start; i < dim; i++) out[i] *= inv_total;
}

/* Causal attention of each new token over its own sequence's cached keys: token t (sequence
   token_seqs[t], at position positions[t]) attends to the keys of positions 0..positions[t], whose
   flat cache rows are kv_slots[seq, 0..] (kv_slots [B, max_len]). q is read from qkv (rotated by
   rope_store_kv); out [T, H * D]. Grouped-query attention as Hugging Face repeats kv heads: q heads
   g * group .. (g + 1) * group - 1 read kv head g. Each key is read once for its whole group
   (memory traffic, not arithmetic, is what attention over a cache costs); each head's values are
   then summed while they are in cache. Tokens and kv heads are shared out among threads, each
   with its own scores; a token's result is the same on any thread. Returns 0, or -1 when the
   scratch could not be allocated. */
int attend(const float *qkv, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim,
           const int64_t *token_seqs, const int64_t *positions, const int64_t *kv_slots,
           int64_t max_len, const float *k_cache, const float *v_cache, float scale, float *out) {
    const int64_t width = (heads + 2 * kv_heads) * dim, group = heads / kv_heads;
    const int64_t row = kv_heads * dim;
    int failed = 0;
#pragma omp parallel if (tokens * max_len * heads * dim * 2 >= PARALLEL_MIN_FLOPS) reduction(| : failed)
    {
        float *scores = malloc(group * max_len * sizeof(float));
        if (!scores) failed = 1;
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t t = 0; t < tokens; t++) {
            for (int64_t g = 0; g < kv_heads; g++) {
                if (!scores) continue;
                const int64_t *slots = kv_slots + token_seqs[t] * max_len, length = positions[t] + 1;
                const float *q = qkv + t * width + g * group * dim;
                const float *keys = k_cache + g * dim, *values = v_cache + g * dim;
                for (int64_t j = 0; j < length; j++) {
                    const float *k = keys + slots[j] * row;
                    for (int64_t h = 0; h < group; h++)
                        scores[h * max_len + j] = dot(q + h * dim, k, dim) * scale;
                }
                for (int64_t h = 0; h < group; h++)
                    weighted_sum(scores + h * max_len, values, slots, length, row, dim,
                                 out + t * heads * dim + (g * group + h) * dim);
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

/* --- projections ------------------------------------------------------------------------------

A weight [K, N] is stored as column panels of PANEL floats, [ceil(N / PANEL)][K][PANEL] (zeros
past N): one panel's K rows are contiguous, so a product streams them in order, and a panel is
reused from cache for every block of input rows. Output y[m, n] is always the chain
acc = fma(x[m, k], w[k, n], acc) for k = 0, 1, .., K - 1 from acc = 0, then + bias[n]: fmaf is
exactly rounded wherever it runs, and the compiler turns these loops into vector FMAs. */

#define PANEL 64

/* y rows [R, cols] of one panel: the R rows x [R, K] (row stride k_len) times panel [K, PANEL]. */
#define DEFINE_PANEL_ROWS(R)                                                                       \
    static void panel_rows_##R(const float *restrict x, int64_t k_len, const float *restrict panel, \
                               const float *restrict bias, int64_t cols, float *restrict y,         \
                               int64_t y_stride) {                                                  \
        float acc[R][PANEL];                                                                        \
        for (int r = 0; r < R; r++)                                                                 \
            for (int j = 0; j < PANEL; j++) acc[r][j] = 0.0f;                                       \
        for (int64_t k = 0; k < k_len; k++) {                                                       \
            const float *restrict w = panel + k * PANEL;                                            \
            for (int r = 0; r < R; r++) {                                                           \
                const float xv = x[r * k_len + k];                                                  \
                _Pragma("omp simd") for (int j = 0; j < PANEL; j++) acc[r][j] = fmaf(xv, w[j], acc[r][j]); \
            }                                                                                       \
        }                                                                                           \
        for (int r = 0; r < R; r++)                                                                 \
            for (int64_t j = 0; j < cols; j++) y[r * y_stride + j] = bias ? acc[r][j] + bias[j] : acc[r][j]; \
    }
DEFINE_PANEL_ROWS(1)
DEFINE_PANEL_ROWS(2)
DEFINE_PANEL_ROWS(3)
DEFINE_PANEL_ROWS(4)

int64_t panel_width(void) { return PANEL; }

/* y [M, N] = x [M, K] @ w (+ bias [N]), w as column panels (above); bias may be NULL. Panels are
   shared out among threads; rows go four at a time through each panel. */
void matmul(const float *x, int64_t m, int64_t k_len, const float *panels, int64_t n, const float *bias,
            float *y) {
    const int64_t count = (n + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) if (m * k_len * n * 2 >= PARALLEL_MIN_FLOPS && count > 1)
    for (int64_t p = 0; p < count; p++) {
        const float *panel = panels + p * k_len * PANEL, *b = bias ? bias + p * PANEL : 0;
        const int64_t cols = n - p * PANEL < PANEL ? n - p * PANEL : PANEL;
        float *out = y + p * PANEL;
        int64_t r = 0;
        for (; r + 4 <= m; r += 4) panel_rows_4(x + r * k_len, k_len, panel, b, cols, out + r * n, n);
        switch (m - r) {
            case 3: panel_rows_3(x + r * k_len, k_len, panel, b, cols, out + r * n, n); break;
            case 2: panel_rows_2(x + r * k_len, k_len, panel, b, cols, out + r * n, n); break;
            case 1: panel_rows_1(x + r * k_len, k_len, panel, b, cols, out + r * n, n); break;
            default: break;
        }
    }
}
