/* The small ops of a float32 forward pass on CPU, fused: everything between the matrix products.

A decode step of a small model spends its time in two kinds of work: the projections, which stream
the weights (oneDNN does those at the memory's speed), and some dozen tiny ops per layer (norms,
rotary embedding, KV writes, attention over a short context, SiLU), each of which costs torch
5-70 us of dispatch for a microsecond of arithmetic. These functions do the tiny ops in four calls
per layer, on the calling thread (specdec/model/kernel_forward.py drives them). Every tensor is
float32 and contiguous, rows first; indices are int64 as torch keeps them. Loops are vectorised
with `omp simd` (compiled with -fopenmp-simd: vector code, no OpenMP runtime) and, for attention's
inner products, AVX2 intrinsics where the CPU has them; summation orders differ from torch's, so
results agree to float32 rounding, not bit for bit. Nothing here checks bounds: the caller passes
positions inside the rotary table and slots inside the cache.
*/
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

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
   rope_store_kv); out [T, H * D]; scores is scratch for (H / Hkv) * max_len floats. Grouped-query
   attention as Hugging Face repeats kv heads: q heads g * group .. (g + 1) * group - 1 read kv
   head g. Each key is read once for its whole group (memory traffic, not arithmetic, is what
   attention over a cache costs); each head's values are then summed while they are in cache. */
void attend(const float *qkv, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim,
            const int64_t *token_seqs, const int64_t *positions, const int64_t *kv_slots,
            int64_t max_len, const float *k_cache, const float *v_cache, float scale, float *out,
            float *scores) {
    const int64_t width = (heads + 2 * kv_heads) * dim, group = heads / kv_heads;
    const int64_t row = kv_heads * dim;
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t *slots = kv_slots + token_seqs[t] * max_len, length = positions[t] + 1;
        for (int64_t g = 0; g < kv_heads; g++) {
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
}
