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

Every tensor is float32 and contiguous, rows first; indices are int64 as torch keeps them; the KV
cache is float32 or float16 (`f16`: rounded to the nearest float16 on the way in, read back
exactly). The Python side (specdec/model/cpu_kernels.py) checks shapes and pointers before
calling; nothing here checks bounds.
*/
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if (defined(__AVX2__) && defined(__FMA__)) || defined(__F16C__)
#include <immintrin.h>
#endif

/* Work below which a loop stays on the calling thread (a team's start costs a few microseconds). */
#define PARALLEL_MIN_FLOPS (1 << 17)

/* A float16 (IEEE binary16) as float, exactly: what the CPU's conversion instruction gives. */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    if (exponent == 0) { /* zero or subnormal: mantissa x 2^-24 */
        const float value = (float)mantissa * 5.9604644775390625e-8f;
        return sign ? -value : value;
    }
    uint32_t bits = sign | ((exponent == 31 ? 255u : exponent + 112u) << 23) | (mantissa << 13);
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* The float16 nearest to f (ties to even; beyond the largest, infinity; NaN stays NaN, quieted):
   what the CPU's conversion instruction gives (F16C's vcvtps2ph, round to nearest). */
static inline uint16_t float_to_half(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint16_t sign = (bits >> 16) & 0x8000;
    const uint32_t magnitude = bits & 0x7fffffff;
    if (magnitude > 0x7f800000) return sign | 0x7e00 | ((magnitude >> 13) & 0x3ff); /* NaN */
    if (magnitude >= 0x477ff000) return sign | 0x7c00; /* >= 65520 (or infinite): infinity */
    if (magnitude < 0x38800000) { /* below 2^-14: a subnormal float16, units of 2^-24 (exact scaling) */
        float units;
        const uint32_t scaled = magnitude + (24u << 23); /* |f| 2^24: its exponent is >= 1 here */
        memcpy(&units, &scaled, sizeof units);
        return sign | (uint16_t)(magnitude <= 0x33000000 ? 0 : nearbyintf(units)); /* 1024: the least normal */
    }
    uint32_t half = (magnitude - (112u << 23)) >> 13; /* exponent rebased 127 -> 15, mantissa cut to 10 */
    const uint32_t rest = magnitude & 0x1fff;
    half += rest > 0x1000 || (rest == 0x1000 && (half & 1)); /* a carry moves into the exponent */
    return sign | (uint16_t)half;
}

/* KV-cache elements: float32, or float16 where `f16` (always_inline callers pass a constant, so
   each of the two has its own code without a branch per number). */
static inline float cache_load(const void *cache, int64_t i, int f16) {
    return f16 ? half_to_float(((const uint16_t *)cache)[i]) : ((const float *)cache)[i];
}

static inline int64_t cache_element_bytes(int f16) { return f16 ? 2 : 4; }

static inline const void *cache_at(const void *cache, int64_t i, int f16) {
    return (const char *)cache + i * cache_element_bytes(f16);
}

/* cache[i .. i + n - 1] = src[0 .. n - 1]. */
static inline void cache_store(void *cache, int64_t i, const float *src, int64_t n, int f16) {
    if (!f16) {
        memcpy((float *)cache + i, src, n * sizeof(float));
        return;
    }
    uint16_t *out = (uint16_t *)cache + i;
    int64_t j = 0;
#if defined(__F16C__)
    for (; j + 8 <= n; j += 8)
        _mm_storeu_si128((__m128i *)(out + j),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; j < n; j++) out[j] = float_to_half(src[j]);
}

#if defined(__AVX2__) && defined(__FMA__)
/* cache[i .. i + 7] as floats. */
static inline __m256 cache_load8(const void *cache, int64_t i, int f16) {
    if (!f16) return _mm256_loadu_ps((const float *)cache + i);
#if defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)cache + i)));
#else
    float lanes[8];
    for (int l = 0; l < 8; l++) lanes[l] = half_to_float(((const uint16_t *)cache)[i + l]);
    return _mm256_loadu_ps(lanes);
#endif
}
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


/* In each row of qkv [T, (H + 2 Hkv) * D] (q heads, k heads, v heads): normalise each q and k
   head over D when head_norm [H + Hkv, D] is given (Qwen3), rotate them by their token's position
   (cos, sin [positions, D], halves not interleaved, as Hugging Face), and copy k and v into the
   cache's flat rows `slots` [T] (k_cache, v_cache [cache rows, Hkv, D], float16 where `f16`). q
   stays rotated in qkv. */
void rope_store_kv(float *qkv, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim,
                   const int64_t *positions, const float *cos, const float *sin,
                   const float *head_norm, float eps, const int64_t *slots,
                   void *k_cache, void *v_cache, int f16) {
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
        cache_store(k_cache, slots[t] * kv_heads * dim, row + heads * dim, kv_heads * dim, f16);
        cache_store(v_cache, slots[t] * kv_heads * dim, row + (heads + kv_heads) * dim, kv_heads * dim, f16);
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* The sum of a vector's eight floats, in one fixed order. */
static inline float lanes_sum(__m256 lanes) {
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(lanes), _mm256_extractf128_ps(lanes, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}
#endif

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
    sum = lanes_sum(_mm256_add_ps(even, odd));
#endif
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* e^x for x <= 0 (below -87: e^-87), within about 2 ulp, in operations a compiler turns into
   vector code (glibc's expf is one call per number: at batch 8 a third of attention's time); gcc
   does so only with -fno-trapping-math (cpu_kernels.py's FLAGS), else the clamp is a branch.
   Cephes' expf: x = n ln 2 + r, |r| <= ln 2 / 2, e^r by a degree-6 polynomial, times 2^n. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = nearbyintf(x * 1.44269504088896341f);
    const float r = fmaf(n, 2.12194440e-4f, fmaf(n, -0.693359375f, x)); /* x - n ln 2, ln 2 in two parts */
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r) + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23; /* 2^n: n >= -126, a normal float */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* gate_up [rows, 2 * inter] (gate then up) -> out [rows, inter] = silu(gate) * up, silu(x) =
   x sigmoid(x) with e = e^-|x| (never overflows): sigmoid(x) = 1 / (1 + e) for x >= 0, e / (1 + e)
   below. In vector code: libm's expf, one call per number, was ~5% of a batch-8 pass. */
void silu_mul(const float *gate_up, float *out, int64_t rows, int64_t inter) {
#pragma omp parallel for schedule(static) if (rows * inter * 16 >= PARALLEL_MIN_FLOPS)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) {
            const float x = g[i], e = exp_nonpositive(x < 0.0f ? x : -x);
            o[i] = x * ((x < 0.0f ? e : 1.0f) / (1.0f + e)) * u[i];
        }
    }
}

/* x[0] + .. + x[n - 1] in one fixed order that depends on n only (eight running sums, then one
   reduction, then the tail): a vectorised `+` reduction may start where x happens to be aligned. */
static inline float sum_in_order(const float *x, int64_t n) {
    int64_t i = 0;
    float sum = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 lanes = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) lanes = _mm256_add_ps(lanes, _mm256_loadu_ps(x + i));
    sum = lanes_sum(lanes);
#endif
    for (; i < n; i++) sum += x[i];
    return sum;
}

/* scores [length] -> e^(score - largest), in place; returns 1 / their sum (the softmax is the
   scores times it). */
static float softmax_weights(float *scores, int64_t length) {
    float best = -INFINITY;
#pragma omp simd reduction(max : best)
    for (int64_t j = 0; j < length; j++) best = scores[j] > best ? scores[j] : best;
#pragma omp simd
    for (int64_t j = 0; j < length; j++) scores[j] = exp_nonpositive(scores[j] - best);
    return 1.0f / sum_in_order(scores, length);
}

#define ATTENTION_INLINE static inline __attribute__((always_inline))

/* out [dim] += weights[j] v_j for j = j0 .. j1 - 1 in order, v_j = the cache's elements from
   slots[j] * row + offset: each output float one chain of multiply-adds over the keys, carried on
   from block to block. */
ATTENTION_INLINE void add_weighted_values(const float *weights, const void *values, int64_t offset,
                                          const int64_t *slots, int64_t j0, int64_t j1, int64_t row, int64_t dim,
                                          float *out, int f16) {
    int64_t start = 0;
#if defined(__AVX2__) && defined(__FMA__)
    /* 64 output floats at a time, summed in eight registers (head sizes 64 and 128). */
    for (; start + 64 <= dim; start += 64) {
        float *o = out + start;
        __m256 s[8];
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) s[i] = _mm256_loadu_ps(o + 8 * i);
        for (int64_t j = j0; j < j1; j++) {
            const int64_t v = slots[j] * row + offset + start;
            const __m256 p = _mm256_set1_ps(weights[j]);
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++) s[i] = _mm256_fmadd_ps(p, cache_load8(values, v + 8 * i, f16), s[i]);
        }
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(o + 8 * i, s[i]);
    }
#endif
    for (int64_t j = j0; j < j1; j++) {
        const int64_t v = slots[j] * row + offset;
        const float p = weights[j];
#pragma omp simd
        for (int64_t i = start; i < dim; i++) out[i] += p * cache_load(values, v + i, f16);
    }
}

/* scores[h * stride + j] = scale * (q_h . k_j) for the group's heads h (q [group, dim]) and the
   keys j0 <= j < j0 + KEY_BLOCK (and < length), k_j = the cache's elements from slots[j] * row +
   offset. The block's eight keys
   are each summed in a register of their own (lane i: the products of dimensions i, i + 8, ..) and
   reduced together: one fixed order for every key wherever it sits (a block short of eight
   repeats its last key and drops the extra scores). One key per dot, reduced on its own, left the
   multiply-adds waiting on each other. */
#define KEY_BLOCK 8
ATTENTION_INLINE void score_block(const float *q, int64_t group, int64_t dim, const void *keys, int64_t offset,
                                  const int64_t *slots, int64_t j0, int64_t length, int64_t row, float scale,
                                  float *scores, int64_t stride, int f16) {
    const int64_t count = length - j0 < KEY_BLOCK ? length - j0 : KEY_BLOCK;
#if defined(__AVX2__) && defined(__FMA__)
    if (dim % 8 == 0) {
        const void *k[KEY_BLOCK];
        for (int i = 0; i < KEY_BLOCK; i++)
            k[i] = cache_at(keys, slots[j0 + (i < count ? i : count - 1)] * row + offset, f16);
        for (int64_t h = 0; h < group; h++) {
            const float *qh = q + h * dim;
            __m256 a[KEY_BLOCK];
#pragma GCC unroll 8
            for (int i = 0; i < KEY_BLOCK; i++) a[i] = _mm256_setzero_ps();
            for (int64_t d = 0; d < dim; d += 8) {
                const __m256 qv = _mm256_loadu_ps(qh + d);
#pragma GCC unroll 8
                for (int i = 0; i < KEY_BLOCK; i++) a[i] = _mm256_fmadd_ps(qv, cache_load8(k[i], d, f16), a[i]);
            }
            const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
            const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
            const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                                              _mm256_permute2f128_ps(u0, u1, 0x31)); /* key i in lane i */
            float block[KEY_BLOCK];
            _mm256_storeu_ps(block, _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
            memcpy(scores + h * stride + j0, block, count * sizeof(float));
        }
        return;
    }
#endif
    for (int64_t j = j0; j < j0 + count; j++) {
        float k[dim]; /* the key as floats: dot's order for every cache format */
        for (int64_t i = 0; i < dim; i++) k[i] = cache_load(keys, slots[j] * row + offset + i, f16);
        for (int64_t h = 0; h < group; h++) scores[h * stride + j] = dot(q + h * dim, k, dim) * scale;
    }
}

/* Prefetch cache rows slots[j0 .. j1 - 1] (within length), elements from .. to of each. */
ATTENTION_INLINE void prefetch_rows(const void *cache, const int64_t *slots, int64_t j0, int64_t j1,
                                    int64_t length, int64_t row, int64_t from, int64_t to, int f16) {
    const int64_t line = 64 / cache_element_bytes(f16); /* elements in a 64-byte cache line */
    for (int64_t j = j0; j < j1 && j < length; j++)
        for (int64_t b = from; b < to; b += line) __builtin_prefetch(cache_at(cache, slots[j] * row + b, f16));
}

/* One token's attention for the q heads of its kv heads g0 .. g1 - 1: q and out are the token's
   rows (every head), its keys are cache rows slots[0 .. length - 1]. Blocks of keys go through all
   of those kv heads at once, so each cache row is read in one piece (its kv heads side by side),
   first for the scores, then for the values, with the next block's rows prefetched (at batch 8 a
   small model's pass reads half as many bytes of cache as of weights: attention waits on memory).
   Each head's result depends on nothing but its own inputs. scores: scratch, [(g1 - g0) group]
   [stride] and (g1 - g0) group more. */
#define VALUE_BLOCK 16
ATTENTION_INLINE void attend_heads(const float *q, float *out, int64_t g0, int64_t g1, int64_t group, int64_t dim,
                                   const int64_t *slots, int64_t length, int64_t row, const void *k_cache,
                                   const void *v_cache, float scale, float *scores, int64_t stride, int f16) {
    const int64_t count = (g1 - g0) * group; /* q heads */
    float *inv_total = scores + count * stride, *o = out + g0 * group * dim;
    for (int64_t j = 0; j < length; j += KEY_BLOCK) {
        prefetch_rows(k_cache, slots, j + KEY_BLOCK, j + 2 * KEY_BLOCK, length, row, g0 * dim, g1 * dim, f16);
        for (int64_t g = g0; g < g1; g++)
            score_block(q + g * group * dim, group, dim, k_cache, g * dim, slots, j, length, row, scale,
                        scores + (g - g0) * group * stride, stride, f16);
    }
    for (int64_t h = 0; h < count; h++) inv_total[h] = softmax_weights(scores + h * stride, length);
    memset(o, 0, count * dim * sizeof(float));
    for (int64_t j = 0; j < length; j += VALUE_BLOCK) {
        const int64_t end = j + VALUE_BLOCK < length ? j + VALUE_BLOCK : length;
        prefetch_rows(v_cache, slots, end, end + VALUE_BLOCK, length, row, g0 * dim, g1 * dim, f16);
        for (int64_t h = 0; h < count; h++)
            add_weighted_values(scores + h * stride, v_cache, (g0 + h / group) * dim, slots, j, end, row, dim,
                                o + h * dim, f16);
    }
    for (int64_t h = 0; h < count; h++)
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[h * dim + i] *= inv_total[h];
}

/* Causal attention of each new token over its own sequence's cached keys: token t (sequence
   token_seqs[t], at position positions[t]) attends to the keys of positions 0..positions[t], whose
   flat cache rows are kv_slots[seq, 0..] (kv_slots [B, max_len]). q is read from qkv (rotated by
   rope_store_kv); out [T, H * D]. Grouped-query attention as Hugging Face repeats kv heads: q heads
   g * group .. (g + 1) * group - 1 read kv head g. The threads' shares are tokens, each with all its
   kv heads, or where there are fewer tokens than threads (a decode step at batch 1) a token's kv
   heads split into up to one range per thread; each with its own scratch. A token's result is the
   same whatever the split. The cache is float16 where `f16` (each format has its own inlined
   copy of the loops). Returns 0, or -1 when the scratch could not be allocated. */
int attend(const float *qkv, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim,
           const int64_t *token_seqs, const int64_t *positions, const int64_t *kv_slots,
           int64_t max_len, const void *k_cache, const void *v_cache, float scale, float *out, int f16) {
    const int64_t width = (heads + 2 * kv_heads) * dim, group = heads / kv_heads;
    const int64_t row = kv_heads * dim, threads = omp_get_max_threads();
    const int64_t wanted = tokens >= threads ? 1 : (threads + tokens - 1) / tokens;
    const int64_t parts = wanted < kv_heads ? wanted : kv_heads; /* kv-head ranges per token */
    int failed = 0;
#pragma omp parallel if (tokens * max_len * heads * dim * 2 >= PARALLEL_MIN_FLOPS) reduction(| : failed)
    {
        float *scores = malloc((heads * max_len + heads) * sizeof(float));
        if (!scores) failed = 1;
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t t = 0; t < tokens; t++) {
            for (int64_t part = 0; part < parts; part++) {
                if (!scores) continue;
                const int64_t g0 = part * kv_heads / parts, g1 = (part + 1) * kv_heads / parts;
                const int64_t *slots = kv_slots + token_seqs[t] * max_len;
                if (f16)
                    attend_heads(qkv + t * width, out + t * heads * dim, g0, g1, group, dim, slots, positions[t] + 1,
                                 row, k_cache, v_cache, scale, scores, max_len, 1);
                else
                    attend_heads(qkv + t * width, out + t * heads * dim, g0, g1, group, dim, slots, positions[t] + 1,
                                 row, k_cache, v_cache, scale, scores, max_len, 0);
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

/* out [rows] = the index of each row's largest value in x [rows, cols], as torch.argmax gives it:
   the first of equal ones, or the row's first NaN where it has one (NaN counts as the largest).
   One pass, sixteen lanes each keeping its largest value and where it was (the first: a later
   equal one does not replace it), then the lanes' largest, the first index among equals. torch's
   CPU argmax took half a millisecond for 8 rows of a 49,152-token vocabulary. */
#define ARGMAX_LANES 16
void argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t *out) {
#pragma omp parallel for schedule(static) if (rows * cols >= PARALLEL_MIN_FLOPS)
    for (int64_t r = 0; r < rows; r++) {
        const float *v = x + r * cols;
        float best[ARGMAX_LANES];
        int64_t at[ARGMAX_LANES];
        int nan = 0;
        for (int l = 0; l < ARGMAX_LANES; l++) best[l] = -INFINITY, at[l] = l < cols ? l : 0;
        int64_t i = 0;
        for (; i + ARGMAX_LANES <= cols; i += ARGMAX_LANES)
#pragma omp simd reduction(| : nan)
            for (int l = 0; l < ARGMAX_LANES; l++) {
                const float value = v[i + l];
                nan |= value != value;
                at[l] = value > best[l] ? i + l : at[l];
                best[l] = value > best[l] ? value : best[l];
            }
        for (int l = 0; i + l < cols; l++) { /* the tail, in lanes 0.. (later than the lanes' indices) */
            const float value = v[i + l];
            nan |= value != value;
            if (value > best[l]) best[l] = value, at[l] = i + l;
        }
        int64_t found = at[0];
        float top = best[0];
        for (int l = 1; l < ARGMAX_LANES; l++)
            if (best[l] > top || (best[l] == top && at[l] < found)) top = best[l], found = at[l];
        if (nan)
            for (found = 0; v[found] == v[found]; found++) {}
        out[r] = found;
    }
}

/* e^x for x <= 0, 0 below -87 (e^-87 ~ 1.6e-38: no float64 uniform resolves such a token), as a
   select a compiler vectorizes: a logit of -inf keeps probability 0. */
static inline float exp_or_zero(float x) {
    return x < -87.0f ? 0.0f : exp_nonpositive(x);
}

/* The temperature as specdec.sampling's transforms clamp it (their MIN_TEMPERATURE). */
static inline float clamped_temperature(float temperature) {
    return temperature < 1e-6f ? 1e-6f : temperature > FLT_MAX ? FLT_MAX : temperature;
}

/* A logit over the temperature t as specdec.sampling's transforms compute it: the logit, then the
   quotient, clamped to the finite floats. The clamps are comparisons: a call into libm's fminf
   cost ~0.3 us after the vector code around it, and ~100 us a row in sample_top. */
static inline float scaled_logit(float x, float t) {
    x = x < -FLT_MAX ? -FLT_MAX : x > FLT_MAX ? FLT_MAX : x;
    const float s = x / t;
    return s < -FLT_MAX ? -FLT_MAX : s > FLT_MAX ? FLT_MAX : s;
}

/* The index inverse CDF draws from the weights w [n] with the uniform u, as sample_from_probs
   draws: the first whose float64 running sum exceeds u x total, total being that sum over all of w
   in this order. Running sums never fall, so the index found has a positive weight. */
static int64_t drawn_index(const float *w, int64_t n, double u, double total) {
    /* u < 1 but u * total may round up to total; stay strictly below so some index qualifies. */
    const double target = fmin(u * total, nextafter(total, 0.0));
    double below = 0.0;
    for (int64_t j = 0; j < n; j++) {
        below += w[j];
        if (below > target) return j;
    }
    return n - 1;
}

/* A sampled draft token from one row of logits x [vocab] (draft_worker's choose_tokens): ids
   [width] = the row's `width` largest logits, largest first (the smaller index first among equals);
   q [width] = their softmax at `temperature`, clamped as specdec.sampling's transforms clamp; returns
   the index into ids of the token drawn from q with the uniform u by inverse CDF in float64, as
   sample_from_probs draws (never a token of probability 0), or -1 where the row holds a NaN or no
   memory was left (the caller then takes torch's ops). Each logit becomes one integer key, its
   value's order in the high half and its index reversed in the low half: larger key, larger logit
   (then smaller index), so selection and sorting compare integers. One pass keeps the keys above a
   threshold in a buffer of 2 x width, cut back to the largest width whenever it fills: ~20 us for
   256 of 4k logits, where torch's dozen small ops took ~120 us, and three times that between the
   draft's passes. */
static inline uint64_t logit_key(float value, int64_t index) {
    uint32_t bits;
    value += 0.0f; /* -0 as +0: equal logits, one order */
    memcpy(&bits, &value, sizeof bits);
    bits = bits >> 31 ? ~bits : bits | 0x80000000u;
    return (uint64_t)bits << 32 | (uint32_t)~(uint32_t)index;
}

/* Hoare's partition of key[lo..hi] about a median of three, largest first: on return
   key[lo..*left_end] >= pivot >= key[*right_start..hi]. */
static void partition_descending(uint64_t *key, int64_t lo, int64_t hi, int64_t *left_end, int64_t *right_start) {
    const uint64_t a = key[lo], b = key[lo + (hi - lo) / 2], c = key[hi];
    const uint64_t pivot = a > b ? (b > c ? b : (a > c ? c : a)) : (a > c ? a : (b > c ? c : b));
    int64_t i = lo, j = hi;
    while (i <= j) {
        while (key[i] > pivot) i++;
        while (key[j] < pivot) j--;
        if (i <= j) {
            const uint64_t t = key[i];
            key[i++] = key[j], key[j--] = t;
        }
    }
    *left_end = j, *right_start = i;
}

/* Reorders key[0..n) so that its m largest come first (in any order). */
static void keep_largest(uint64_t *key, int64_t n, int64_t m) {
    int64_t lo = 0, hi = n - 1, j, i;
    while (lo < hi) {
        partition_descending(key, lo, hi, &j, &i);
        if (m - 1 <= j) hi = j;
        else if (m - 1 >= i) lo = i;
        else return;
    }
}

static void sort_descending(uint64_t *key, int64_t lo, int64_t hi) {
    int64_t j, i;
    while (hi - lo > 16) { /* the smaller side by recursion, the larger by the loop */
        partition_descending(key, lo, hi, &j, &i);
        if (j - lo < hi - i) sort_descending(key, lo, j), lo = i;
        else sort_descending(key, i, hi), hi = j;
    }
    for (int64_t a = lo + 1; a <= hi; a++) { /* insertion sort of the rest */
        const uint64_t t = key[a];
        int64_t b = a;
        for (; b > lo && key[b - 1] < t; b--) key[b] = key[b - 1];
        key[b] = t;
    }
}

int64_t sample_top(const float *x, int64_t vocab, int64_t width, float temperature, double u, int64_t *ids,
                   float *q) {
    const int64_t capacity = 2 * width;
    uint64_t *key = malloc(capacity * sizeof *key), threshold = 0;
    if (!key) return -1;
    int64_t held = 0;
    float bar = NAN; /* the threshold's logit: a block of 16 none of which beats it is skipped whole */
    for (int64_t start = 0; start < vocab; start += 16) {
        const int64_t end = start + 16 < vocab ? start + 16 : vocab;
        int above = end - start < 16; /* (the last, short block is always looked at) */
        if (!above)
#pragma omp simd reduction(| : above)
            for (int l = 0; l < 16; l++) above |= !(x[start + l] <= bar); /* (a NaN is looked at too) */
        for (int64_t i = start; above && i < end; i++) {
            if (x[i] <= bar) continue; /* (a later logit equal to the bar's: a smaller key) */
            if (x[i] != x[i]) {
                free(key);
                return -1;
            }
            const uint64_t k = logit_key(x[i], i);
            if (k < threshold) continue;
            key[held++] = k;
            if (held == capacity) { /* keep the largest width; the least of them is the new bar */
                keep_largest(key, held, width);
                held = width, threshold = key[0];
                for (int64_t r = 1; r < width; r++) threshold = key[r] < threshold ? key[r] : threshold;
                bar = x[(uint32_t)~(uint32_t)threshold] + 0.0f;
            }
        }
    }
    if (held > width) keep_largest(key, held, width);
    sort_descending(key, 0, width - 1);
    const float t = clamped_temperature(temperature);
    for (int64_t r = 0; r < width; r++) {
        ids[r] = (uint32_t)~(uint32_t)key[r];
        q[r] = scaled_logit(x[ids[r]], t);
    }
    double total = 0.0;
    for (int64_t r = width - 1; r >= 0; r--) { /* (q[0] last: the largest, every exponent <= 0) */
        q[r] = exp_or_zero(q[r] - q[0]);
        total += q[r];
    }
    free(key);
    double cdf = 0.0;
    for (int64_t r = 0; r < width; r++) {
        q[r] = (float)(q[r] / total);
        cdf += q[r];
    }
    return drawn_index(q, width, u, cdf);
}

/* The largest scaled logit and the softmax's sum of the row x [vocab] at temperature t (0: a NaN);
   softmax_at gives one entry of that softmax from them. */
static int softmax_scale(const float *x, int64_t vocab, float t, float *top, float *total) {
    int nan = 0;
    float largest = -FLT_MAX, sum = 0.0f;
#pragma omp simd reduction(max : largest) reduction(| : nan)
    for (int64_t j = 0; j < vocab; j++) {
        nan |= x[j] != x[j];
        const float s = scaled_logit(x[j], t);
        largest = s > largest ? s : largest;
    }
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < vocab; j++) sum += exp_or_zero(scaled_logit(x[j], t) - largest);
    *top = largest, *total = sum;
    return !nan;
}

static inline float softmax_at(float x, float t, float top, float total) {
    return exp_or_zero(scaled_logit(x, t) - top) / total;
}

/* r [vocab] -= q (ids, probs [width]: a sparse proposal; entries outside the vocabulary are 0),
   each entry q touches clamped at 0 (its old value into saved [width] first, unless NULL); returns
   the float64 sum of r in order: the mass of max(0, r - q) when r >= 0. */
static double subtract_proposal(float *r, int64_t vocab, const int64_t *ids, const float *probs, int64_t width,
                                float *saved) {
    for (int64_t e = 0; e < width; e++)
        if (ids[e] >= 0 && ids[e] < vocab) {
            if (saved) saved[e] = r[ids[e]];
            r[ids[e]] -= probs[e];
        }
    for (int64_t e = 0; e < width; e++)
        if (ids[e] >= 0 && ids[e] < vocab) r[ids[e]] = r[ids[e]] > 0.0f ? r[ids[e]] : 0.0f;
    double mass = 0.0;
    for (int64_t j = 0; j < vocab; j++) mass += r[j];
    return mass;
}

/* The target's verdict on one sampled request's chain of `proposed` draft tokens (target_worker's
   chain acceptance, for temperature-only sampling): logits [proposed + 1, vocab], row i the
   target's at draft position i; p_i = softmax(clamp(logits_i / temperature)) in float32 as
   specdec.sampling's transforms compute it. Token i = draft[i], proposed from q_i (q_ids, q_probs
   [proposed, q_width]: its sparse entries), is accepted while u_accept[i] < p_i(t) / q_i(t) (as
   speculative_verify: no division); at the first rejection the next token is drawn from
   norm(max(0, p - q)) (p itself where that has no mass), after all of them from p, by inverse CDF
   with u_target at that position (float64 running sums). Returns the accepted count and writes
   *next_token, or -1 where a row the walk reads holds a NaN. scratch [vocab]: the drawn row. */
int64_t verify_sampled_chain(const float *logits, int64_t proposed, int64_t vocab, float temperature,
                             const int64_t *draft, const int64_t *q_ids, const float *q_probs, int64_t q_width,
                             const double *u_accept, const double *u_target, float *scratch, int64_t *next_token) {
    const float t = clamped_temperature(temperature);
    int64_t a = 0;
    float top = 0.0f, total = 0.0f;
    for (;; a++) { /* the softmax's largest value and sum of row a, then its draft token's test */
        const float *x = logits + a * vocab;
        if (!softmax_scale(x, vocab, t, &top, &total)) return -1;
        if (a == proposed) break;
        const float p = softmax_at(x[draft[a]], t, top, total);
        float q = 0.0f;
        for (int64_t e = 0; e < q_width; e++) q += q_ids[a * q_width + e] == draft[a] ? q_probs[a * q_width + e] : 0.0f;
        if (!(p > 0.0f && (p >= q || u_accept[a] * q < p))) break;
    }
    const float *x = logits + a * vocab;
    for (int64_t j = 0; j < vocab; j++) scratch[j] = softmax_at(x[j], t, top, total);
    double mass = 0.0;
    if (a < proposed) { /* the residual max(0, p - q) */
        mass = subtract_proposal(scratch, vocab, q_ids + a * q_width, q_probs + a * q_width, q_width, NULL);
        if (!(mass > 0.0)) /* p == q to rounding: a rejection had probability ~0; p is right */
            for (int64_t j = 0; j < vocab; j++) scratch[j] = softmax_at(x[j], t, top, total);
    }
    if (!(mass > 0.0)) {
        mass = 0.0;
        for (int64_t j = 0; j < vocab; j++) mass += scratch[j];
    }
    *next_token = drawn_index(scratch, vocab, u_target[a], mass);
    return a;
}

/* The target's verdict on one sampled request's token tree (specdec.sampling.tree's walk, for
   temperature-only sampling): logits [1 + nodes, vocab], row 0 the root's (the last committed
   token), row 1 + i node i's; tokens, parents [nodes] in depth-first order (-1: the root); node i
   drawn from q_i (q_ids, q_probs [nodes, q_width]). At a node r = p, its softmax as in
   verify_sampled_chain; its children are tried in order, child c accepted while
   u_accept[c] < r(c) / q_c(c) (no division), after a rejection r = norm(max(0, r - q_c)) (r itself
   where that has no mass); an accepted child becomes the node; where none is, the next token is
   drawn from r with u_next[depth] by inverse CDF. Writes the accepted nodes into path and
   *next_token; returns their count, or -1 where a row the walk reads holds a NaN. scratch
   [2 x vocab]: r, then the entries a rejection overwrote. */
int64_t verify_sampled_tree(const float *logits, int64_t nodes, int64_t vocab, float temperature, const int64_t *tokens,
                            const int64_t *parents, const int64_t *q_ids, const float *q_probs, int64_t q_width,
                            const double *u_accept, const double *u_next, float *scratch, int64_t *path,
                            int64_t *next_token) {
    const float t = clamped_temperature(temperature);
    float *saved = scratch + vocab;
    for (int64_t node = -1, depth = 0;;) {
        const float *x = logits + (node + 1) * vocab;
        float top = 0.0f, total = 0.0f;
        if (!softmax_scale(x, vocab, t, &top, &total)) return -1;
        int dense = 0; /* r in scratch (after a rejection), else p itself, an entry at a time */
        int64_t accepted = -1;
        for (int64_t c = node + 1; c < nodes && accepted < 0; c++) {
            if (parents[c] != node) continue;
            const int64_t *ids = q_ids + c * q_width;
            const float *probs = q_probs + c * q_width;
            const float r = dense ? scratch[tokens[c]] : softmax_at(x[tokens[c]], t, top, total);
            float q = 0.0f;
            for (int64_t e = 0; e < q_width; e++) q += ids[e] == tokens[c] ? probs[e] : 0.0f;
            if (r > 0.0f && (r >= q || u_accept[c] * q < r)) {
                accepted = c;
                break;
            }
            if (!dense)
                for (int64_t j = 0; j < vocab; j++) scratch[j] = softmax_at(x[j], t, top, total);
            dense = 1;
            const double mass = subtract_proposal(scratch, vocab, ids, probs, q_width, saved);
            if (mass > 0.0)
                for (int64_t j = 0; j < vocab; j++) scratch[j] = (float)(scratch[j] / mass);
            else /* r == q to rounding: a rejection had probability ~0; r is right (last first: repeats) */
                for (int64_t e = q_width - 1; e >= 0; e--)
                    if (ids[e] >= 0 && ids[e] < vocab) scratch[ids[e]] = saved[e];
        }
        if (accepted >= 0) {
            path[depth++] = node = accepted;
            continue;
        }
        if (!dense)
            for (int64_t j = 0; j < vocab; j++) scratch[j] = softmax_at(x[j], t, top, total);
        double mass = 0.0;
        for (int64_t j = 0; j < vocab; j++) mass += scratch[j];
        *next_token = drawn_index(scratch, vocab, u_next[depth], mass);
        return depth;
    }
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
DEFINE_PANEL_ROWS(5)
DEFINE_PANEL_ROWS(6)
typedef void PanelRows(const float *, int64_t, const float *, const float *, int64_t, float *, int64_t);
static PanelRows *const PANEL_ROWS[] = {0, panel_rows_1, panel_rows_2, panel_rows_3, panel_rows_4, panel_rows_5,
                                        panel_rows_6}; /* by rows */

int64_t panel_width(void) { return PANEL; }

/* The input rows of the next pass over a panel, `left` to go. AVX-512's 32 registers hold six
   rows' accumulators (24 vectors), so a product of 5-7 rows (a verify of K = 4-6) goes over each
   panel in passes as even as they go rather than 4 rows and the rest: 9-20% faster there, the same
   at 8 (4 + 4; 6 + 2 measured up to 10% slower) (docs/bench-2026-11-28-xeon-amx.md). AVX2's 16
   registers: 4 at a time, as before (not measured on such a CPU). */
static inline int64_t pass_rows(int64_t left) {
#if defined(__AVX512F__)
    return left / ((left + 5) / 6);
#else
    return left < 4 ? left : 4;
#endif
}

/* y [M, N] = x [M, K] @ w (+ bias [N]), w as column panels (above); bias may be NULL. Panels are
   shared out among threads; rows go through each panel a few at a time (pass_rows). */
void matmul(const float *x, int64_t m, int64_t k_len, const float *panels, int64_t n, const float *bias,
            float *y) {
    const int64_t count = (n + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) if (m * k_len * n * 2 >= PARALLEL_MIN_FLOPS && count > 1)
    for (int64_t p = 0; p < count; p++) {
        const float *panel = panels + p * k_len * PANEL, *b = bias ? bias + p * PANEL : 0;
        const int64_t cols = n - p * PANEL < PANEL ? n - p * PANEL : PANEL;
        float *out = y + p * PANEL;
        for (int64_t r = 0, rows; r < m; r += rows) {
            rows = pass_rows(m - r);
            PANEL_ROWS[rows](x + r * k_len, k_len, panel, b, cols, out + r * n, n);
        }
    }
}

/* --- quantized projections ----------------------------------------------------------------------

A quantized weight [K, N] keeps integer codes with a scale d (and for 4-bit codes a minimum m) per
group of QGROUP consecutive k of one column n: w[k, n] = d[g, n] * c[k, n] + m[g, n], g = k / QGROUP
(8-bit: c in -127..127, stored as c + 128; 4-bit: c in 0..15). Each product first quantizes its
input rows the same way, symmetric per group (dx = max |x| / 127, xq = round(x / dx)), then sums
codes times codes in int32 (exact: any order, any vector width gives the same integer) and only
then goes to floats, always in this chain for y[m, n]: for each group g in order,
    dot = sum over the group of c[k, n] * xq[m, k]         (int32; 8-bit: sum (c + 128) xq - 128 sum xq)
    acc = fma(d[g, n], dx[m, g] * dot, acc)
    acc = fma(m[g, n], dx[m, g] * sum of the group's xq[m, k], acc)     (4-bit with minimums)
then + bias[n]. So a row's output never depends on the other rows or the threads, like the float
product's; weights are never widened in memory, and the sums run on the CPU's int8 dot-product
instructions where it has them (AVX-512 VNNI), else on AVX2's byte products, else in plain C, all
to the same integers.

Layout, panels of PANEL columns as the float weights: codes [ceil(N / PANEL)][K / 4][PANEL * 4 *
bits / 8] bytes, each block of 4 consecutive k ("a quad") holding column j's 4 codes side by side
(byte 4 j + i: k = 4 quad + i). 4-bit quads are 128 bytes: bytes 0-63 hold columns 0-15 in their low
nibbles and 16-31 in their high ones, bytes 64-127 columns 32-47 and 48-63 likewise. Scales and
minimums are float16 (as GGUF stores them), [ceil(N / PANEL)][K / QGROUP][PANEL]. */

#define QGROUP 32
#define QUADS (QGROUP / 4)

int64_t quant_group(void) { return QGROUP; }

/* The code of column j, k = 4 quad + i, from a quad's bytes. */
static inline int32_t quad_code(const uint8_t *quad, int64_t bits, int j, int i) {
    if (bits == 8) return (int32_t)quad[4 * j + i] - 128;
    const int z = j / 16;
    const uint8_t byte = quad[(z / 2) * 64 + (j % 16) * 4 + i];
    return (z & 1) ? byte >> 4 : byte & 15;
}

/* One group of QGROUP inputs v quantized: codes q = round(v / d) (to nearest, ties to even) into
   out, d = max |v| / 127 (NaN ignored) into *d; returns the codes' sum. Written out for AVX-512:
   gcc kept the maximum a scalar chain of compares, and the group's quantization took 40-60% of an
   8-row product of 128 columns. */
static inline int32_t quantize_group(const float *v, int8_t *out, float *d) {
#if defined(__AVX512F__)
    const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
    /* max_ps(x, y) is y where x is NaN, as the comparison of the loop below keeps amax */
    const float amax = _mm512_reduce_max_ps(
        _mm512_max_ps(_mm512_abs_ps(b), _mm512_max_ps(_mm512_abs_ps(a), _mm512_setzero_ps())));
    *d = amax / 127.0f;
    const __m512 inv = _mm512_set1_ps(*d > 0.0f ? 1.0f / *d : 0.0f);
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)); /* (the rounding mode: to nearest) */
    const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
    _mm_storeu_si128((__m128i *)out, _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128((__m128i *)(out + 16), _mm512_cvtepi32_epi8(qb));
    return _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
#else
    float amax = 0.0f; /* not fmaxf: gcc calls libm's for each number */
    for (int k = 0; k < QGROUP; k++) amax = fabsf(v[k]) > amax ? fabsf(v[k]) : amax;
    *d = amax / 127.0f;
    const float inv = *d > 0.0f ? 1.0f / *d : 0.0f;
    int32_t sum = 0;
    for (int k = 0; k < QGROUP; k++) {
        const int32_t q = (int32_t)nearbyintf(v[k] * inv);
        out[k] = (int8_t)q;
        sum += q;
    }
    return sum;
#endif
}

/* Each row of x [M, K] quantized per group: xq [M, K], dx [M, K / QGROUP], xsum [M, K / QGROUP].
   Called inside a parallel region, whose threads share the groups. */
static void quantize_rows(const float *x, int64_t m, int64_t k_len, int8_t *xq, float *dx, int32_t *xsum) {
    const int64_t groups = k_len / QGROUP;
#pragma omp for schedule(static) collapse(2)
    for (int64_t r = 0; r < m; r++)
        for (int64_t g = 0; g < groups; g++)
            xsum[r * groups + g] = quantize_group(x + r * k_len + g * QGROUP, xq + r * k_len + g * QGROUP,
                                                  dx + r * groups + g);
}

/* Columns HALF * half .. of one panel (its y [rows][cols], row stride y_stride, cols counted from
   the panel's first column): rows (1-ROWS) quantized input rows (xq, dx, xsum of those rows, row
   stride k_len and groups) times the panel's codes, scales d and minimums mn [groups][PANEL] (mn
   may be NULL), + bias (the panel's; may be NULL), in the chain above. */
#define HALF (PANEL / 2)
#define ROWS 8
/* The half panel's rows, acc + r acc_stride + bias, into y (columns past `cols` dropped). */
static inline void store_half(const float *acc, int64_t acc_stride, int rows, int half, const float *bias,
                              int64_t cols, float *y, int64_t y_stride) {
    const int64_t width = cols - HALF * half < HALF ? cols - HALF * half : HALF;
    for (int r = 0; r < rows && width > 0; r++) {
        const float *in = acc + r * acc_stride;
        float *out = y + r * y_stride + HALF * half;
        if (bias)
#pragma omp simd
            for (int64_t j = 0; j < width; j++) out[j] = in[j] + bias[HALF * half + j];
        else
            memcpy(out, in, width * sizeof(float));
    }
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define QUANT_DOT_SIMD 2
/* Groups ahead of the one summed that the weights are fetched: the hardware's prefetch alone left
   products of 1-8 rows 5-10% slower (2 and 8 groups ahead measured between none and 4). */
#define PREFETCH_GROUPS 4
/* `halves` (1 or 2) half panels from `half` (32 columns, two vectors each) for up to eight rows at
   a time: sixteen independent int32 sums keep both of the CPU's dot-product units busy (four rows'
   eight sums were latency-bound, at about half the rate), and each weight quad is loaded and
   unpacked once for all the rows. Two halves (a whole panel) read each quad's bytes in order. */
static inline __attribute__((always_inline)) void panel_rows_quantized(
    const uint8_t *codes, int64_t bits, const uint16_t *d, const uint16_t *mn, const int8_t *xq, const float *dx,
    const int32_t *xsum, int64_t k_len, int64_t groups, const int rows, const int half, const int halves,
    const float *bias, int64_t cols, float *y, int64_t y_stride) {
    const __m512i low = _mm512_set1_epi8(15);
    const int64_t quad_bytes = PANEL * bits / 2, span = quad_bytes / 2 * halves;
    const int64_t ahead = PREFETCH_GROUPS * QUADS * quad_bytes;
    const int vecs = 2 * halves, in_registers = rows * vecs <= 8;
    /* The float accumulators: in registers for up to eight vectors, in memory for more (the
       registers then hold the sums). */
    __m512 held[8];
    float acc[ROWS][PANEL] __attribute__((aligned(64)));
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < vecs; v++) {
            if (in_registers) held[r * vecs + v] = _mm512_setzero_ps();
            else _mm512_store_ps(acc[r] + 16 * v, _mm512_setzero_ps());
        }
    for (int64_t g = 0; g < groups; g++) {
        __m512i products[ROWS][4];
        for (int r = 0; r < rows; r++)
            for (int v = 0; v < vecs; v++) products[r][v] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int q = 0; q < QUADS; q++) {
            const uint8_t *quad = codes + (g * QUADS + q) * quad_bytes + quad_bytes / 2 * half;
            for (int64_t line = 0; line < span; line += 64)
                _mm_prefetch((const char *)(quad + ahead + line), _MM_HINT_T0);
            __m512i w[4];
            for (int h = 0; h < halves; h++) {
                if (bits == 8) {
                    w[2 * h] = _mm512_loadu_si512(quad + 128 * h);
                    w[2 * h + 1] = _mm512_loadu_si512(quad + 128 * h + 64);
                } else {
                    const __m512i both = _mm512_loadu_si512(quad + 64 * h);
                    w[2 * h] = _mm512_and_si512(both, low);
                    w[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(both, 4), low);
                }
            }
            for (int r = 0; r < rows; r++) {
                int32_t four;
                memcpy(&four, xq + r * k_len + g * QGROUP + 4 * q, 4);
                const __m512i xv = _mm512_set1_epi32(four);
                for (int v = 0; v < vecs; v++) products[r][v] = _mm512_dpbusd_epi32(products[r][v], w[v], xv);
            }
        }
        const uint16_t *dg = d + g * PANEL + HALF * half, *mg = mn ? mn + g * PANEL + HALF * half : dg;
        __m512 dv[4], mv[4];
        for (int v = 0; v < vecs; v++) {
            dv[v] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dg + 16 * v)));
            mv[v] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mg + 16 * v))); /* unused without mn */
        }
        for (int r = 0; r < rows; r++) {
            const int32_t sum = xsum[r * groups + g];
            const float scale = dx[r * groups + g];
            const __m512 sv = _mm512_set1_ps(scale), xs = _mm512_set1_ps(scale * (float)sum);
            for (int v = 0; v < vecs; v++) {
                if (bits == 8) /* the codes were stored + 128 */
                    products[r][v] = _mm512_sub_epi32(products[r][v], _mm512_set1_epi32(128 * sum));
                __m512 a = in_registers ? held[r * vecs + v] : _mm512_load_ps(acc[r] + 16 * v);
                a = _mm512_fmadd_ps(dv[v], _mm512_mul_ps(sv, _mm512_cvtepi32_ps(products[r][v])), a);
                if (mn) a = _mm512_fmadd_ps(mv[v], xs, a);
                if (in_registers) held[r * vecs + v] = a;
                else _mm512_store_ps(acc[r] + 16 * v, a);
            }
        }
    }
    if (in_registers)
        for (int r = 0; r < rows; r++)
            for (int v = 0; v < vecs; v++) _mm512_store_ps(acc[r] + 16 * v, held[r * vecs + v]);
    for (int h = 0; h < halves; h++) store_half(acc[0] + HALF * h, PANEL, rows, half + h, bias, cols, y, y_stride);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QUANT_DOT_SIMD 1
/* Half a panel (32 columns, four vectors of eight) with AVX2, which has no 4-byte dot product:
   vpmaddubsw multiplies unsigned by signed bytes and adds pairs into int16 (saturating, so each
   pair must fit), vpmaddwd then adds those pairs into int32. 4-bit codes (0..15) times inputs (|x|
   <= 127): a pair is at most 3,810 and a group's four pairs per column at most 30,480, so the group
   sums in int16 and widens once. 8-bit codes go as |c| times x with c's sign (vpsignb): a pair is
   at most 32,258, widened every quad. The same integers as the other paths. */
static inline __attribute__((always_inline)) void unpack_quad(const uint8_t *quad, int64_t bits, int half,
                                                              __m256i codes[4], __m256i signs[4]) {
    if (bits == 8) { /* stored c + 128: flipping the top bit gives c as a signed byte */
        for (int i = 0; i < 4; i++) {
            signs[i] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(quad + 128 * half + 32 * i)),
                                        _mm256_set1_epi8(-128));
            codes[i] = _mm256_abs_epi8(signs[i]);
        }
    } else { /* 32 bytes hold 8 columns' quads in low nibbles and the 8 columns 16 on in high ones */
        const __m256i low = _mm256_set1_epi8(15);
        const __m256i a = _mm256_loadu_si256((const __m256i *)(quad + 64 * half));
        const __m256i b = _mm256_loadu_si256((const __m256i *)(quad + 64 * half + 32));
        codes[0] = _mm256_and_si256(a, low), codes[1] = _mm256_and_si256(b, low);
        codes[2] = _mm256_and_si256(_mm256_srli_epi16(a, 4), low);
        codes[3] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
    }
}

/* One quad's products of a row (its four inputs `four`) into the row's sums (int32 for 8-bit,
   int16 pairs for 4-bit). */
static inline __attribute__((always_inline)) void add_quad(const __m256i codes[4], const __m256i signs[4],
                                                           int64_t bits, const int8_t *four, __m256i sums[4]) {
    int32_t packed;
    memcpy(&packed, four, 4);
    const __m256i xv = _mm256_set1_epi32(packed);
    for (int i = 0; i < 4; i++) {
        if (bits == 8)
            sums[i] = _mm256_add_epi32(sums[i], _mm256_madd_epi16(_mm256_maddubs_epi16(
                codes[i], _mm256_sign_epi8(xv, signs[i])), _mm256_set1_epi16(1)));
        else
            sums[i] = _mm256_add_epi16(sums[i], _mm256_maddubs_epi16(codes[i], xv));
        /* each sum one register, added in order: integer adds may be reassociated, and gcc then
           built trees of products over a group's quads that spilled to the stack (8 rows 1.3x
           slower) */
        __asm__("" : "+x"(sums[i]));
    }
}

/* A group's sums of one row into its float accumulators (the chain of the section's comment);
   dg, mg: the group's scales and minimums as floats (mg read only with `mins`). */
static inline __attribute__((always_inline)) void add_group(const __m256i sums[4], int64_t bits, const __m256 dg[4],
                                                            const __m256 mg[4], int mins, float scale, int32_t sum,
                                                            float *acc) {
    const __m256 sv = _mm256_set1_ps(scale), xs = _mm256_set1_ps(scale * (float)sum);
    for (int i = 0; i < 4; i++) {
        const __m256i dot = bits == 8 ? sums[i] : _mm256_madd_epi16(sums[i], _mm256_set1_epi16(1));
        __m256 a = _mm256_load_ps(acc + 8 * i);
        a = _mm256_fmadd_ps(dg[i], _mm256_mul_ps(sv, _mm256_cvtepi32_ps(dot)), a);
        if (mins) a = _mm256_fmadd_ps(mg[i], xs, a);
        _mm256_store_ps(acc + 8 * i, a);
    }
}

/* The rows' half panel: one row takes each quad as it is unpacked; more unpack a group's quads
   once, go over them two rows at a time (their eight sums stay in registers), then take each
   row's sums into its accumulators in a loop of its own (the scales in registers there: done
   after each pair instead, the scales and sums spilled, ~7% slower at 8 rows). Called with
   `bits` and `rows` constant, so each (bits, rows) is a copy of its own without branches. */
static inline __attribute__((always_inline)) void panel_rows_quantized(
    const uint8_t *codes, int64_t bits, const uint16_t *d, const uint16_t *mn, const int8_t *xq, const float *dx,
    const int32_t *xsum, int64_t k_len, int64_t groups, const int rows, const int half, const int halves,
    const float *bias, int64_t cols, float *y, int64_t y_stride) {
    (void)halves; /* 1: this path goes half by half */
    const int64_t quad_bytes = PANEL * bits / 2;
    __m256i unpacked[QUADS][4], signs[QUADS][4]; /* signs: written and read for 8-bit codes only */
    float acc[ROWS][HALF] __attribute__((aligned(32)));
    for (int r = 0; r < rows; r++) /* not memset: gcc made it a `rep stos`, ~3% of an 8-row product */
        for (int i = 0; i < 4; i++) _mm256_store_ps(acc[r] + 8 * i, _mm256_setzero_ps());
    /* The group after next is fetched ahead: this half reads every other 64 or 128 bytes, which
       the hardware's prefetch did not follow (8-bit weights from memory went at half the speed).
       Past the last group it fetches whatever follows: a prefetch never faults. */
    const int64_t half_bytes = quad_bytes / 2, ahead = 2 * QUADS * quad_bytes;
    for (int64_t g = 0; g < groups; g++) {
        const uint16_t *dh = d + g * PANEL + HALF * half, *mh = mn ? mn + g * PANEL + HALF * half : 0;
        const int8_t *xg = xq + g * QGROUP;
        __m256i first[4], second[4], dots[ROWS][4];
        for (int i = 0; i < 4; i++) first[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int q = 0; q < QUADS; q++) {
            const uint8_t *quad = codes + (g * QUADS + q) * quad_bytes;
            for (int64_t line = 0; line < half_bytes; line += 64)
                _mm_prefetch((const char *)(quad + half_bytes * half + ahead + line), _MM_HINT_T0);
            unpack_quad(quad, bits, half, unpacked[q], signs[q]);
            if (rows == 1) add_quad(unpacked[q], signs[q], bits, xg + 4 * q, first);
        }
        __m256 dg[4], mg[4]; /* converted once for all the rows */
        for (int i = 0; i < 4; i++) {
            dg[i] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dh + 8 * i)));
            mg[i] = mh ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mh + 8 * i))) : _mm256_setzero_ps();
        }
        if (rows == 1) add_group(first, bits, dg, mg, mn != 0, dx[g], xsum[g], acc[0]);
        for (int r = 0; rows > 1 && r < rows; r += 2) {
            const int pair = r + 1 < rows;
            for (int i = 0; i < 4; i++) first[i] = second[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int q = 0; q < QUADS; q++) {
                add_quad(unpacked[q], signs[q], bits, xg + r * k_len + 4 * q, first);
                if (pair) add_quad(unpacked[q], signs[q], bits, xg + (r + 1) * k_len + 4 * q, second);
            }
            for (int i = 0; i < 4; i++) {
                dots[r][i] = first[i];
                if (pair) dots[r + 1][i] = second[i];
            }
        }
        for (int r = 0; rows > 1 && r < rows; r++)
            add_group(dots[r], bits, dg, mg, mn != 0, dx[r * groups + g], xsum[r * groups + g], acc[r]);
    }
    store_half(acc[0], HALF, rows, half, bias, cols, y, y_stride);
}
#else
#define QUANT_DOT_SIMD 0
/* Plain C the compiler can vectorize (any CPU's SIMD, ARM's NEON included). The codes stay in
   their bytes: element n of a quad's half holds column n / 4's code for k = 4 quad + n % 4 (4-bit:
   the low nibbles columns 0-15 of the half, the high ones 16-31), so each byte times the input of
   its k adds into a sum of its own, and a group's four sums per column are added at its end. */
static inline void panel_rows_quantized(
    const uint8_t *codes, int64_t bits, const uint16_t *d, const uint16_t *mn, const int8_t *xq, const float *dx,
    const int32_t *xsum, int64_t k_len, int64_t groups, const int rows, const int half, const int halves,
    const float *bias, int64_t cols, float *y, int64_t y_stride) {
    (void)halves; /* 1: this path goes half by half */
    const int64_t quad_bytes = PANEL * bits / 2;
    float acc[ROWS][HALF], dg[HALF], mg[HALF];
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < HALF; i++) acc[r][i] = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        for (int i = 0; i < HALF; i++) {
            dg[i] = half_to_float(d[g * PANEL + HALF * half + i]);
            mg[i] = mn ? half_to_float(mn[g * PANEL + HALF * half + i]) : 0.0f;
        }
        for (int r = 0; r < rows; r++) {
            const int8_t *x = xq + r * k_len + g * QGROUP;
            int32_t sums[4 * HALF] = {0}; /* [4 column + k % 4] */
            for (int q = 0; q < QUADS; q++) {
                const uint8_t *quad = codes + (g * QUADS + q) * quad_bytes + quad_bytes / 2 * half;
                int32_t inputs[2 * HALF]; /* byte n's input: x[4 quad + n % 4] */
                for (int n = 0; n < 2 * HALF; n++) inputs[n] = x[4 * q + n % 4];
                if (bits == 8) { /* 128 bytes, stored c + 128 */
#pragma omp simd
                    for (int n = 0; n < 2 * HALF; n++) {
                        sums[n] += ((int32_t)quad[n] - 128) * inputs[n];
                        sums[2 * HALF + n] += ((int32_t)quad[2 * HALF + n] - 128) * inputs[n];
                    }
                } else { /* 64 bytes, two codes each */
#pragma omp simd
                    for (int n = 0; n < 2 * HALF; n++) {
                        sums[n] += (int32_t)(quad[n] & 15) * inputs[n];
                        sums[2 * HALF + n] += (int32_t)(quad[n] >> 4) * inputs[n];
                    }
                }
            }
            const float scale = dx[r * groups + g], xs = scale * (float)xsum[r * groups + g];
            for (int i = 0; i < HALF; i++) {
                const int32_t dot = sums[4 * i] + sums[4 * i + 1] + sums[4 * i + 2] + sums[4 * i + 3];
                const float a = fmaf(dg[i], scale * (float)dot, acc[r][i]);
                acc[r][i] = mn ? fmaf(mg[i], xs, a) : a;
            }
        }
    }
    store_half(acc[0], HALF, rows, half, bias, cols, y, y_stride);
}
#endif

/* rows [T, K] = the columns index [T] of a quantized weight [K, N] (codes, scales and minimums as
   above; mins may be NULL) as floats, each d * c then + m, rounded as torch rounds codes * d + m:
   the embedding rows of a model whose LM head is its embedding, at a few microseconds a token. */
void quantized_columns(const uint8_t *codes, const uint16_t *scales, const uint16_t *mins, int64_t bits,
                       int64_t k_len, const int64_t *index, int64_t count, float *rows) {
    const int64_t groups = k_len / QGROUP, panel_bytes = k_len * PANEL * bits / 8;
    const int64_t quad_bytes = PANEL * bits / 2;
    for (int64_t t = 0; t < count; t++) {
        const int64_t p = index[t] / PANEL;
        const int j = (int)(index[t] % PANEL);
        const uint8_t *c = codes + p * panel_bytes;
        const uint16_t *d = scales + p * groups * PANEL, *mn = mins ? mins + p * groups * PANEL : 0;
        float *row = rows + t * k_len;
        for (int64_t k = 0; k < k_len; k++) {
            const int64_t g = k / QGROUP;
            const int32_t code = quad_code(c + (k / 4) * quad_bytes, bits, j, (int)(k % 4));
            const float scaled = (float)code * half_to_float(d[g * PANEL + j]);
            row[k] = mn ? scaled + half_to_float(mn[g * PANEL + j]) : scaled;
        }
    }
}

/* Which path the quantized sums take: 2 AVX-512 VNNI, 1 AVX2, 0 plain C. */
int64_t quant_dot_simd(void) { return QUANT_DOT_SIMD; }

/* Products of up to WHOLE_ROWS rows (a decode step, a short verify) are bound by the weights'
   stream, which half panels slowed: each thread read every other 64 or 128 bytes of a panel, then
   the rest; whole panels read in order measured 1.2-1.35x faster at 1-4 rows (AVX-512 only). More
   rows take half panels, whose eight rows' sums fit the registers. */
#define WHOLE_ROWS 4

/* y [M, N] = x [M, K] @ w (+ bias [N]), w quantized to `bits` (8 or 4) as above; mins and bias may
   be NULL. K is a multiple of QGROUP.
   Returns -1 when the quantized rows find no memory, else 0. */
int matmul_quantized(const float *x, int64_t m, int64_t k_len, int64_t bits, const uint8_t *codes,
                     const uint16_t *scales, const uint16_t *mins, int64_t n, const float *bias, float *y) {
    const int64_t count = (n + PANEL - 1) / PANEL, groups = k_len / QGROUP;
    const int64_t panel_bytes = k_len * PANEL * bits / 8;
    int8_t *xq = malloc((size_t)(m * k_len));
    float *dx = malloc((size_t)(m * groups) * sizeof(float));
    int32_t *xsum = malloc((size_t)(m * groups) * sizeof(int32_t));
    if (!xq || !dx || !xsum) {
        free(xq), free(dx), free(xsum);
        return -1;
    }
    /* One team for both loops: the input rows' groups shared out, then panels: whole ones for up to
       WHOLE_ROWS rows (but an odd count's last, in halves, so that two threads still split evenly),
       else half panels, rows eight at a time; a half past the last column (n % PANEL <= HALF) has
       nothing to do. */
    const int64_t paired = QUANT_DOT_SIMD == 2 && m <= WHOLE_ROWS ? count - count % 2 : 0;
    const int64_t shares = paired + 2 * (count - paired);
#pragma omp parallel if (m * k_len * n * 2 >= PARALLEL_MIN_FLOPS && count > 1)
    {
        quantize_rows(x, m, k_len, xq, dx, xsum);
#pragma omp for schedule(static)
        for (int64_t share = 0; share < shares; share++) {
            const int64_t p = share < paired ? share : paired + (share - paired) / 2;
            const int half = share < paired ? 0 : (int)((share - paired) % 2), halves = share < paired ? 2 : 1;
            const uint8_t *c = codes + p * panel_bytes;
            const uint16_t *d = scales + p * groups * PANEL, *mn = mins ? mins + p * groups * PANEL : 0;
            const float *b = bias ? bias + p * PANEL : 0;
            const int64_t cols = n - p * PANEL < PANEL ? n - p * PANEL : PANEL;
            if (HALF * half >= cols) continue;
            for (int64_t r = 0; r < m; r += ROWS) {
                const int8_t *xr = xq + r * k_len;
                const float *dr = dx + r * groups;
                const int32_t *sr = xsum + r * groups;
                float *yr = y + r * n + p * PANEL;
#define QUANT_ROWS(R, H) \
    if (bits == 8) panel_rows_quantized(c, 8, d, mn, xr, dr, sr, k_len, groups, R, half, H, b, cols, yr, n); \
    else panel_rows_quantized(c, 4, d, mn, xr, dr, sr, k_len, groups, R, half, H, b, cols, yr, n);
#define ROWS_CASE(R) \
    case R: \
        if (halves == 2 && R <= WHOLE_ROWS) { \
            QUANT_ROWS(R, 2) \
        } else { \
            QUANT_ROWS(R, 1) \
        } \
        break;
                switch (m - r < ROWS ? m - r : ROWS) { /* a copy for each rows, bits and halves */
                    ROWS_CASE(8) ROWS_CASE(7) ROWS_CASE(6) ROWS_CASE(5) ROWS_CASE(4) ROWS_CASE(3) ROWS_CASE(2)
                    ROWS_CASE(1)
                }
#undef ROWS_CASE
#undef QUANT_ROWS
            }
        }
    }
    free(xq), free(dx), free(xsum);
    return 0;
}

/* --- a whole pass through the decoder layers -----------------------------------------------------

The same calls, in the same order, as one call per op from Python would make (so the same bits),
without crossing into Python ~10 times a layer: at batch 1 on a small model those crossings cost
as much as the arithmetic. */

/* One projection as the layer table holds it: float panels (bits 32) or codes (8 or 4). */
typedef struct {
    int64_t bits;
    const void *weights; /* float panels, or codes */
    const uint16_t *scales, *mins; /* codes only (float16); mins may be NULL */
    const float *bias;             /* may be NULL */
    int64_t n;                     /* output columns */
} Projection;

typedef struct {
    const float *input_norm, *post_norm, *head_norm; /* head_norm NULL but for Qwen3 */
    Projection qkv, o_proj, gate_up, down;
} DecoderLayer;

static int project(const float *x, int64_t m, int64_t k, const Projection *p, float *y) {
    if (p->bits == 32) {
        matmul(x, m, k, p->weights, p->n, p->bias, y);
        return 0;
    }
    return matmul_quantized(x, m, k, p->bits, p->weights, p->scales, p->mins, p->n, p->bias, y);
}

/* decoder_layers with its scratch given: qkv [T, (H + 2 Hkv) D], attn [T, H D], out [T, hidden],
   gate_up [T, 2 inter], act [T, inter]. */
static int layers_in(const DecoderLayer *layers, int64_t count, const float *final_norm, float *x, float *h,
                     float *qkv, float *attn, float *out, float *gate_up, float *act, int64_t tokens,
                     int64_t hidden, int64_t heads, int64_t kv_heads, int64_t dim, int64_t inter, float eps,
                     float scale, const int64_t *positions, const float *cos, const float *sin,
                     const int64_t *slots, const int64_t *token_seqs, const int64_t *kv_slots, int64_t max_len,
                     void *k_cache, void *v_cache, int64_t layer_stride, int f16) {
    const float *delta = 0;
    for (int64_t i = 0; i < count; i++) {
        const DecoderLayer *l = layers + i;
        void *kc = (char *)k_cache + i * layer_stride * cache_element_bytes(f16);
        void *vc = (char *)v_cache + i * layer_stride * cache_element_bytes(f16);
        add_rms_norm(x, delta, l->input_norm, h, tokens, hidden, eps);
        if (project(h, tokens, hidden, &l->qkv, qkv)) return -1;
        rope_store_kv(qkv, tokens, heads, kv_heads, dim, positions, cos, sin, l->head_norm, eps, slots, kc, vc,
                      f16);
        if (attend(qkv, tokens, heads, kv_heads, dim, token_seqs, positions, kv_slots, max_len, kc, vc, scale,
                   attn, f16))
            return -1;
        if (project(attn, tokens, heads * dim, &l->o_proj, out)) return -1;
        add_rms_norm(x, out, l->post_norm, h, tokens, hidden, eps);
        if (project(h, tokens, hidden, &l->gate_up, gate_up)) return -1;
        silu_mul(gate_up, act, tokens, inter);
        if (project(act, tokens, inter, &l->down, out)) return -1;
        delta = out;
    }
    add_rms_norm(x, delta, final_norm, h, tokens, hidden, eps);
    return 0;
}

/* Every layer of a pass over `tokens` new tokens, then the final norm: x [T, hidden] (the
   embeddings; the residual stream, updated in place) -> h [T, hidden] = final_norm(x). Caches
   k_cache, v_cache [layers][rows][Hkv][D], layer_stride elements apart, float16 where `f16`.
   Other arguments as rope_store_kv and attend take them. The layers' scratch (q/k/v, attention, a
   block's output, gate/up, SiLU * up) is one allocation made here, each part starting on a cache
   line of its own. Returns 0, or -1 when scratch memory ran out. */
int decoder_layers(const DecoderLayer *layers, int64_t count, const float *final_norm, float *x, float *h,
                   int64_t tokens, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t dim, int64_t inter,
                   float eps, float scale, const int64_t *positions, const float *cos, const float *sin,
                   const int64_t *slots, const int64_t *token_seqs, const int64_t *kv_slots, int64_t max_len,
                   void *k_cache, void *v_cache, int64_t layer_stride, int f16) {
    const int64_t widths[5] = {(heads + 2 * kv_heads) * dim, heads * dim, hidden, 2 * inter, inter};
    int64_t sizes[5], total = 0; /* in floats, each a whole number of 64-byte lines */
    for (int p = 0; p < 5; p++) total += sizes[p] = (tokens * widths[p] + 15) / 16 * 16;
    float *part[5];
    part[0] = aligned_alloc(64, (size_t)total * sizeof(float));
    if (!part[0] && total) return -1;
    for (int p = 1; p < 5; p++) part[p] = part[p - 1] + sizes[p - 1];
    const int status = layers_in(layers, count, final_norm, x, h, part[0], part[1], part[2], part[3], part[4],
                                 tokens, hidden, heads, kv_heads, dim, inter, eps, scale, positions, cos, sin, slots,
                                 token_seqs, kv_slots, max_len, k_cache, v_cache, layer_stride, f16);
    free(part[0]);
    return status;
}

/* --- a draft's chain in one call ------------------------------------------------------------------

A draft proposes K tokens in K passes: the first feeds each request what it has not seen (its
catch-up), each later one the token the pass before picked. From Python each pass cost several
times its arithmetic: between two passes the interpreter's own memory had left the caches to the
weights, and each call into torch or ctypes found it cold. So the chain runs here, each pass the
same calls in the same order as kernel_forward's pass over the same tokens and the draft's pick
(argmax_rows, or sample_top with the request's DRAFT uniform), so the same bits. */

/* SplitMix64's finalizer (specdec.sampling.random.mix64). */
static inline uint64_t mix64(uint64_t x) {
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

/* The uniform of stream `key` at `position` (specdec.sampling.random.uniforms: 53 bits). */
static inline double stream_uniform(uint64_t key, int64_t position) {
    return (double)(mix64(key + ((uint64_t)position + 1) * 0x9E3779B97F4A7C15ULL) >> 11) * 0x1p-53;
}

/* A sampled tree's children of one node after its first (draft_worker.draft_tree's
   distinct_children): the first, `first`, was drawn from q [width] over ids [width]; child j = 1 ..
   count - 1 is drawn from q less the children before it, renormalised ((float)(q_e / total), the
   float64 total summed in order), with the uniform of stream keys[j] at `position`, by inverse CDF
   (drawn_index, as sample_from_probs draws). Writes the children's ids (children [count], the
   first's too) and each later one's distribution (rows [count][width], row 0 untouched); returns
   how many children there are (fewer where the earlier ones took all of q's mass). */
int64_t distinct_children(const float *q, const int64_t *ids, int64_t width, int64_t first, int64_t count,
                          const uint64_t *keys, int64_t position, int64_t *children, float *rows) {
    int64_t taken = -1; /* the index in ids of the last child drawn (none where q lacks `first`) */
    for (int64_t e = 0; e < width && taken < 0; e++) taken = ids[e] == first ? e : -1;
    children[0] = first;
    const float *previous = q;
    for (int64_t j = 1; j < count; j++) {
        float *left = rows + j * width;
        double total = 0.0, mass = 0.0;
        for (int64_t e = 0; e < width; e++) {
            left[e] = e == taken ? 0.0f : previous[e];
            total += left[e];
        }
        if (!(total > 0.0)) return j;
        for (int64_t e = 0; e < width; e++) mass += left[e] = (float)(left[e] / total);
        taken = drawn_index(left, width, stream_uniform(keys[j], position), mass);
        children[j] = ids[taken];
        previous = left;
    }
    return count;
}

/* Up to `steps` passes over `seqs` requests. Request i takes part in passes 0 .. steps_of[i] - 1
   (>= 1): pass 0 feeds its feed_len[i] tokens of `feed` (the requests' feeds one after another),
   pass s > 0 its pick of pass s - 1, at positions from first_position[i] on, into its cache
   slots (`slots`: feed_len[i] + steps_of[i] - 1 a request, one request's after another's); each
   pass picks picks[i][s] from the logits of the request's last token: the argmax where widths[i]
   is 0 or less (below 0: the ids of the first pass's -widths[i] largest logits into ids, a
   greedy tree's root children), else the draw of sample_top at temperatures[i] over widths[i]
   tokens with the uniform of stream keys[i] at the picked token's position, its ids and q into
   ids, q [seqs][steps][width]. kv_slots [seqs][max_len]: each request's cache slots by position. The
   embedding: rows [vocab][hidden] floats, or (rows NULL) the columns of `codes` (the LM head's,
   tied). Other arguments as decoder_layers takes them. Returns 0; -1 when memory ran out; -2
   when a sampled row's logits held a NaN (the caller's passes in torch then retell the chain). */
int draft_chain(const DecoderLayer *layers, int64_t count, const float *final_norm, const Projection *lm_head,
                const float *rows, const Projection *codes, int64_t vocab, int64_t seqs, int64_t steps,
                const int64_t *steps_of, const int64_t *feed, const int64_t *feed_len, int64_t *picks,
                const int64_t *first_position, const int64_t *slots, const int64_t *kv_slots, int64_t max_len,
                const float *temperatures, const uint64_t *keys, const int64_t *widths, int64_t width,
                int64_t *ids, float *q, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t dim,
                int64_t inter, float eps, float scale, const float *cos, const float *sin, void *k_cache,
                void *v_cache, int64_t layer_stride, int f16) {
    int64_t most = seqs; /* the most tokens a pass feeds */
    for (int64_t i = 0, fed = 0; i < seqs; i++) most = (fed += feed_len[i]) > most ? fed : most;
    float *x = malloc((size_t)(2 * most * hidden + seqs * hidden + seqs * vocab) * sizeof(float));
    int64_t *index = malloc((size_t)(4 * most + 4 * seqs) * sizeof(int64_t));
    if (!x || !index) {
        free(x), free(index);
        return -1;
    }
    float *h = x + most * hidden, *last = h + most * hidden, *logits = last + seqs * hidden;
    int64_t *tokens = index, *positions = index + most, *slot = index + 2 * most, *row_seq = index + 3 * most;
    int64_t *last_row = index + 4 * most, *picked_by = last_row + seqs, *feed_at = picked_by + seqs;
    int64_t *slot_at = feed_at + seqs;
    for (int64_t i = 0; i < seqs; i++) {
        feed_at[i] = i ? feed_at[i - 1] + feed_len[i - 1] : 0;
        slot_at[i] = i ? slot_at[i - 1] + feed_len[i - 1] + steps_of[i - 1] - 1 : 0;
    }
    int status = 0;
    for (int64_t s = 0; s < steps && !status; s++) {
        int64_t fed = 0, active = 0;
        for (int64_t i = 0; i < seqs; i++) {
            if (s >= steps_of[i]) continue;
            const int64_t n = s ? 1 : feed_len[i], past = s ? feed_len[i] + s - 1 : 0; /* (tokens before) */
            for (int64_t j = 0; j < n; j++, fed++) {
                tokens[fed] = s ? picks[i * steps + s - 1] : feed[feed_at[i] + j];
                positions[fed] = first_position[i] + past + j, slot[fed] = slots[slot_at[i] + past + j];
                row_seq[fed] = i;
            }
            last_row[active] = fed - 1, picked_by[active++] = i;
        }
        if (rows)
            for (int64_t t = 0; t < fed; t++) memcpy(x + t * hidden, rows + tokens[t] * hidden, hidden * sizeof(float));
        else
            quantized_columns(codes->weights, codes->scales, codes->mins, codes->bits, hidden, tokens, fed, x);
        if (decoder_layers(layers, count, final_norm, x, h, fed, hidden, heads, kv_heads, dim, inter, eps, scale,
                           positions, cos, sin, slot, row_seq, kv_slots, max_len, k_cache, v_cache, layer_stride,
                           f16)) {
            status = -1;
            break;
        }
        for (int64_t a = 0; a < active; a++) /* each request's last token: the rows that pick */
            memcpy(last + a * hidden, h + last_row[a] * hidden, hidden * sizeof(float));
        if (project(last, active, hidden, lm_head, logits)) {
            status = -1;
            break;
        }
        for (int64_t a = 0; a < active && !status; a++) {
            const int64_t i = picked_by[a], at = i * steps + s;
            if (widths[i] <= 0) {
                argmax_rows(logits + a * vocab, 1, vocab, picks + at);
                /* (a greedy tree's root: the first pass's -widths[i] largest logits' ids too) */
                if (widths[i] < 0 && s == 0
                    && sample_top(logits + a * vocab, vocab, -widths[i], 1.0f, 0.0, ids + at * width, q + at * width) < 0)
                    status = -2;
                continue;
            }
            const int64_t drawn = sample_top(logits + a * vocab, vocab, widths[i], temperatures[i],
                                             stream_uniform(keys[i], positions[last_row[a]] + 1), ids + at * width,
                                             q + at * width);
            if (drawn < 0) status = -2;
            else picks[at] = ids[at * width + drawn];
        }
    }
    free(x), free(index);
    return status;
}
