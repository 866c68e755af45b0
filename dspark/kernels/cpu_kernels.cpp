// CPU kernels of a decoding pass: attention of new rows over their slot's KV cache; the residual
// add + RMSNorm and SwiGLU steps between a layer's matmuls.
//
// Why by hand: SDPA's CPU kernel gives a row different bits depending on how many rows share the
// call and on the thread count (seen on AMD Zen 4), so the engine used to run every row as its own
// SDPA batch entry on one thread: exact, but 10 ms of a 36 ms verification pass of 8 rows. Here every
// (row, query head) is computed from start to end in a fixed order of operations on one thread: its
// bits depend on nothing but its own query, position and cache, so a verified row is exactly the row
// decoding would have computed, at any batch and thread count. A task takes one KV head and a few
// rows of one slot (a verified block), which share each key and value they read: with AVX-512 or
// AVX2 at head size 64; elsewhere one head at a time.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "release_gil.h"

#if defined(__x86_64__)
#include <immintrin.h>  // the AVX-512 paths below; elsewhere the portable loops, vectorized by the compiler
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int LANES = 16;  // one AVX-512 register of floats; two AVX2 ones
constexpr int kMaxHeadsTogether = 16;  // query heads of one KV head an attention task computes at once
constexpr int64_t kNormRowsPerThread = 128;  // add_rms_norm's rows a thread takes at least (see there)
constexpr int64_t kSiluRowsPerThread = 16;   // silu_mul's (see there)

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// exp(x) for x <= 0 (softmax after subtracting the max): 2^(x log2 e) split into 2^n * 2^f with
// a degree-6 polynomial for 2^f on [-0.5, 0.5] (relative error ~2e-7), its steps fused multiply-adds.
// exp_nonpositive8 below does the same operations eight lanes at a time: the same bits for a value
// whichever of the two computes it.
constexpr float kExpPoly[7] = {1.5403530393381606e-4f, 1.3333558146428443e-3f, 9.6181291076284772e-3f,
                               5.5504108664821580e-2f, 2.4022650695910071e-1f, 6.9314718055994531e-1f, 1.0f};

inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float t = x * 1.4426950408889634f;
    const float n = std::nearbyint(t);
    const float f = t - n;
    // p * f + c, which GCC contracts to a fused multiply-add (-march=native has FMA) and, unlike
    // std::fma, still vectorizes with AVX-512 (SwiGLU: 4.6 us for 8 rows on a Zen 4, 119 with std::fma).
    float p = kExpPoly[0];
    for (int i = 1; i < 7; ++i) p = p * f + kExpPoly[i];
    int32_t bits;
    std::memcpy(&bits, &p, 4);
    bits += static_cast<int32_t>(n) << 23;
    float out;
    std::memcpy(&out, &bits, 4);
    return out;
}

#if defined(__AVX2__) && defined(__FMA__)
// Why by hand: GCC leaves the loops that call exp_nonpositive scalar (std::nearbyint), ~5 ns a value
// on an AVX2 EPYC: SwiGLU's 1536 a row and softmax's every score.
inline __m256 exp_nonpositive8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(t, n);
    __m256 p = _mm256_set1_ps(kExpPoly[0]);
    for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExpPoly[i]));
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23)));
}
#endif

#ifdef __AVX512F__
// The same sixteen lanes at a time (softmax's scores).
inline __m512 exp_nonpositive16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(kExpPoly[0]);
    for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExpPoly[i]));
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23)));
}
#endif

// Sum of LANES partial sums in a fixed tree order.
inline float lane_sum(const float* acc) {
    float s8[8], s4[4];
    for (int l = 0; l < 8; ++l) s8[l] = acc[l] + acc[l + 8];
    for (int l = 0; l < 4; ++l) s4[l] = s8[l] + s8[l + 4];
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // bf16 -> fp32 is a 16-bit shift
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(p))), 16));
}
#endif

template <typename T>
inline float dot(const float* q, const T* k, int64_t hd) {
#ifdef __AVX512F__
    if (hd % LANES == 0) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t d = 0; d < hd; d += LANES) acc = _mm512_fmadd_ps(load16(q + d), load16(k + d), acc);
        return _mm512_reduce_add_ps(acc);
    }
#endif
    float acc[LANES] = {0.0f};
    int64_t d = 0;
    for (; d + LANES <= hd; d += LANES)
        for (int l = 0; l < LANES; ++l) acc[l] += q[d + l] * to_float(k[d + l]);
    for (int l = 0; d + l < hd; ++l) acc[l] += q[d + l] * to_float(k[d + l]);
    return lane_sum(acc);
}

// Softmax of one row of scores in place (minus its max, exp, a fixed-order sum); returns 1 / sum.
inline float softmax_weights(float* scores, int64_t keys) {
    float top = -INFINITY;
    int64_t t = 0;
#ifdef __AVX512F__
    // The max is exact in any order: 16 lanes at a time instead of one dependent compare a key.
    __m512 top16 = _mm512_set1_ps(-INFINITY);
    for (; t + LANES <= keys; t += LANES) top16 = _mm512_max_ps(top16, _mm512_loadu_ps(scores + t));
    top = _mm512_reduce_max_ps(top16);
#elif defined(__AVX2__)
    __m256 top8 = _mm256_set1_ps(-INFINITY);
    for (; t + 8 <= keys; t += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(scores + t));
    alignas(32) float tops[8];
    _mm256_store_ps(tops, top8);
    for (const float v : tops) top = v > top ? v : top;
#endif
    for (; t < keys; ++t) top = scores[t] > top ? scores[t] : top;
    float partial[LANES] = {0.0f};
    t = 0;
#ifdef __AVX512F__
    // `partial` as one vector, each lane adding its keys in the loop's order; the last keys masked.
    const __m512 max16 = _mm512_set1_ps(top);
    __m512 sum16 = _mm512_setzero_ps();
    for (; t < keys; t += LANES) {
        const __mmask16 keep = keys - t >= LANES ? __mmask16(0xFFFF) : __mmask16((1u << (keys - t)) - 1);
        const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(keep, scores + t), max16));
        _mm512_mask_storeu_ps(scores + t, keep, e);
        sum16 = _mm512_mask_add_ps(sum16, keep, sum16, e);
    }
    _mm512_storeu_ps(partial, sum16);
#elif defined(__AVX2__) && defined(__FMA__)
    // The lanes of `partial` as two vectors: each lane adds its keys in the loop's order.
    const __m256 max8 = _mm256_set1_ps(top);
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (; t + LANES <= keys; t += LANES) {
        const __m256 a = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(scores + t), max8));
        const __m256 b = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(scores + t + 8), max8));
        _mm256_storeu_ps(scores + t, a);
        _mm256_storeu_ps(scores + t + 8, b);
        lo = _mm256_add_ps(lo, a);
        hi = _mm256_add_ps(hi, b);
    }
    _mm256_storeu_ps(partial, lo);
    _mm256_storeu_ps(partial + 8, hi);
#endif
    for (; t + LANES <= keys; t += LANES)
        for (int l = 0; l < LANES; ++l) {
            scores[t + l] = exp_nonpositive(scores[t + l] - top);
            partial[l] += scores[t + l];
        }
    for (int l = 0; t + l < keys; ++l) {
        scores[t + l] = exp_nonpositive(scores[t + l] - top);
        partial[l] += scores[t + l];
    }
    return 1.0f / lane_sum(partial);
}

#ifdef __AVX512F__
// Index pairs for score_tree: stage s takes vectors holding 16 / L keys of L lanes each (L = 16 >> s)
// and, from two of them, makes one holding twice the keys at L / 2 lanes each, a key's lane l added to
// its lane l + L / 2; after four stages lane j holds the sum of key j's 16 lanes.
struct LaneSumIndex {
    __m512i lo[4], hi[4];
    LaneSumIndex() {
        for (int s = 0; s < 4; ++s) {
            const int lanes = 16 >> s, keys = 16 / lanes, half = lanes / 2;
            alignas(64) int32_t l[16], h[16];
            for (int o = 0; o < 16; ++o) {
                const int key = o / half, lane = o % half;
                l[o] = key < keys ? key * lanes + lane : 16 + (key - keys) * lanes + lane;
                h[o] = l[o] + half;
            }
            lo[s] = _mm512_load_si512(l);
            hi[s] = _mm512_load_si512(h);
        }
    }
};

// Scores of one query head (64 wide, 4 vectors q) for keys j0 .. j0 + 2^S - 1 of k (zero past n):
// key j's q . k as 4 lane-wise products summed in order, then its 16 lanes summed by a fixed tree
// (LaneSumIndex), built as the partial products come so that few vectors are live at once. Lane i
// of the result is key j0 + i's score (S = 4: 16 keys). The same operations for a key whatever else
// shares the call.
template <int S, typename T>
__attribute__((always_inline)) inline __m512 score_tree(const __m512* q, const T* k, int64_t j0, int64_t n) {
    if constexpr (S == 0) {
        if (j0 >= n) return _mm512_setzero_ps();
        const T* kt = k + j0 * 64;
        __m512 acc = _mm512_mul_ps(q[0], load16(kt));
        acc = _mm512_fmadd_ps(q[1], load16(kt + 16), acc);
        acc = _mm512_fmadd_ps(q[2], load16(kt + 32), acc);
        return _mm512_fmadd_ps(q[3], load16(kt + 48), acc);
    } else {
        static const LaneSumIndex index;
        const __m512 a = score_tree<S - 1>(q, k, j0, n), b = score_tree<S - 1>(q, k, j0 + (1 << (S - 1)), n);
        return _mm512_add_ps(_mm512_permutex2var_ps(a, index.lo[S - 1], b), _mm512_permutex2var_ps(a, index.hi[S - 1], b));
    }
}

// One query head's scores for keys t0 .. t0 + n - 1 (n <= 16, `chunk` their fp32 rows) into scores[t0 ..].
inline void scores16(const __m512* q, const float* chunk, int64_t t0, int64_t n, float* scores) {
    const __mmask16 keep = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
    _mm512_mask_storeu_ps(scores + t0, keep, score_tree<4>(q, chunk, 0, n));
}

// H heads' softmax weights times the values, each head over its own keys in order (H x 4 sums and a
// value's 4 vectors stay in registers), scaled by 1 / sum.
template <int H, typename T>
inline void weighted_values(const float* weights, int64_t stride, const int64_t* keys, const float* inv, const T* v,
                            float* const* out) {
    int64_t most = 0;
    for (int g = 0; g < H; ++g) most = std::max(most, keys[g]);
    __m512 acc[H][4];
#pragma GCC unroll 8
    for (int g = 0; g < H; ++g)
        for (int i = 0; i < 4; ++i) acc[g][i] = _mm512_setzero_ps();
    for (int64_t t = 0; t < most; ++t) {
        const T* vt = v + t * 64;
        const __m512 v0 = load16(vt), v1 = load16(vt + 16), v2 = load16(vt + 32), v3 = load16(vt + 48);
#pragma GCC unroll 8
        for (int g = 0; g < H; ++g) {
            if (t >= keys[g]) continue;
            const __m512 w = _mm512_set1_ps(weights[g * stride + t]);
            acc[g][0] = _mm512_fmadd_ps(w, v0, acc[g][0]);
            acc[g][1] = _mm512_fmadd_ps(w, v1, acc[g][1]);
            acc[g][2] = _mm512_fmadd_ps(w, v2, acc[g][2]);
            acc[g][3] = _mm512_fmadd_ps(w, v3, acc[g][3]);
        }
    }
#pragma GCC unroll 8
    for (int g = 0; g < H; ++g) {
        const __m512 scale = _mm512_set1_ps(inv[g]);
        for (int i = 0; i < 4; ++i) _mm512_storeu_ps(out[g] + 16 * i, _mm512_mul_ps(acc[g][i], scale));
    }
}

// M query heads (64 wide, scaled) that share one KV head: several rows of one slot (a verified block)
// and their heads of the group. Query m sees keys 0..keys[m]-1. Every key and value is read once for all
// M from cache, and each head's arithmetic is the same whatever M, so a row's bits do not depend on
// which rows share the call. scores: M x stride floats; out[m]: where head m's 64 outputs go.
template <typename T>
void attend_heads(const float* queries, const int64_t* keys, int M, const T* k, const T* v, float* scores,
                  int64_t stride, float* const* out) {
    // 16 keys (4 KB) at a time for every head, so they are read from L1. A bf16 cache's 16 keys are
    // widened to fp32 once for all M heads (exactly: bf16 -> fp32 is a shift), not once a head.
    alignas(64) float widened[16 * 64];
    for (int64_t t = 0; t < stride; t += 16) {
        const float* chunk = widened;
        if constexpr (std::is_same_v<T, float>) {
            chunk = k + t * 64;
        } else {
            for (int64_t i = 0; i < std::min<int64_t>(16, stride - t) * 4; ++i)
                _mm512_store_ps(widened + 16 * i, load16(k + t * 64 + 16 * i));
        }
        for (int m = 0; m < M; ++m) {
            if (t >= keys[m]) continue;
            const float* qm = queries + m * 64;
            const __m512 q[4] = {load16(qm), load16(qm + 16), load16(qm + 32), load16(qm + 48)};
            scores16(q, chunk, t, std::min<int64_t>(16, keys[m] - t), scores + m * stride);
        }
    }
    float inv[kMaxHeadsTogether];
    for (int m = 0; m < M; ++m) inv[m] = softmax_weights(scores + m * stride, keys[m]);
    int c = 0;
    for (; c + 6 <= M; c += 6) weighted_values<6>(scores + c * stride, stride, keys + c, inv + c, v, out + c);
    switch (M - c) {
        case 5: weighted_values<5>(scores + c * stride, stride, keys + c, inv + c, v, out + c); break;
        case 4: weighted_values<4>(scores + c * stride, stride, keys + c, inv + c, v, out + c); break;
        case 3: weighted_values<3>(scores + c * stride, stride, keys + c, inv + c, v, out + c); break;
        case 2: weighted_values<2>(scores + c * stride, stride, keys + c, inv + c, v, out + c); break;
        case 1: weighted_values<1>(scores + c * stride, stride, keys + c, inv + c, v, out + c); break;
        default: break;
    }
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// The same on AVX2, head size 64, a cache of fp32 or bf16. Scores ride with the query heads in the
// lanes (8 heads a vector, the queries transposed once a call) and 8 keys in 8 registers: a score is
// one fused multiply-add chain over the 64 dims in order, with none of the hadd trees that keys in
// the lanes needed (1.12-1.24x a task on a Zen 3). A head's score gets the same operations in any
// lane and beside any other heads, so a row's bits do not depend on the call.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // bf16 -> fp32 is a 16-bit shift: exact
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(p))), 16));
}

// Scores of keys t .. t + n - 1 (n <= 8; `chunk` their fp32 rows, zero past n) for heads of one
// group: qt holds its 8 heads transposed ([64][8]), `heads` of them real; head l's scores go to
// scores[l * stride + t ..].
inline void scores8(const float* qt, const float* chunk, int64_t n, int heads, float* scores, int64_t stride) {
    __m256 acc[8];
    const __m256 q0 = _mm256_load_ps(qt);
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_mul_ps(q0, _mm256_broadcast_ss(chunk + j * 64));
    for (int d = 1; d < 64; ++d) {
        const __m256 qd = _mm256_load_ps(qt + 8 * d);
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qd, _mm256_broadcast_ss(chunk + j * 64 + d), acc[j]);
    }
    alignas(32) float lanes[8][8];  // key j's scores, head l in lane l
    for (int j = 0; j < 8; ++j) _mm256_store_ps(lanes[j], acc[j]);
    for (int l = 0; l < heads; ++l)
        for (int j = 0; j < n; ++j) scores[l * stride + j] = lanes[j][l];
}

// H heads' weights times the values over 32 of the 64 dims (`half`), each head over its own keys
// in order, scaled by 1 / sum: H x 4 sums and a value's 4 vectors stay in registers.
template <int H, typename T>
inline void weighted_values_avx2(const float* weights, int64_t stride, const int64_t* keys, const float* inv,
                                 const T* v, float* const* out, int half) {
    int64_t most = 0;
    for (int g = 0; g < H; ++g) most = std::max(most, keys[g]);
    __m256 acc[H][4];
    for (int g = 0; g < H; ++g)
        for (int i = 0; i < 4; ++i) acc[g][i] = _mm256_setzero_ps();
    for (int64_t t = 0; t < most; ++t) {
        const T* vt = v + t * 64 + 32 * half;
        const __m256 v0 = load8(vt), v1 = load8(vt + 8), v2 = load8(vt + 16), v3 = load8(vt + 24);
        for (int g = 0; g < H; ++g) {
            if (t >= keys[g]) continue;
            const __m256 w = _mm256_set1_ps(weights[g * stride + t]);
            acc[g][0] = _mm256_fmadd_ps(w, v0, acc[g][0]);
            acc[g][1] = _mm256_fmadd_ps(w, v1, acc[g][1]);
            acc[g][2] = _mm256_fmadd_ps(w, v2, acc[g][2]);
            acc[g][3] = _mm256_fmadd_ps(w, v3, acc[g][3]);
        }
    }
    for (int g = 0; g < H; ++g) {
        const __m256 scale = _mm256_set1_ps(inv[g]);
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out[g] + 32 * half + 8 * i, _mm256_mul_ps(acc[g][i], scale));
    }
}

template <typename T>
void attend_heads_avx2(const float* queries, const int64_t* keys, int M, const T* k, const T* v, float* scores,
                       int64_t stride, float* const* out) {
    // The queries transposed, 8 heads a group, zero past M; then 8 keys (2 KB) at a time for every
    // group, read from L1. A bf16 cache's keys, and the last few keys, are widened (or copied) into
    // a zero-padded chunk once for all heads.
    constexpr int kGroups = (kMaxHeadsTogether + 7) / 8;
    alignas(32) float qt[kGroups][64][8];
    const int groups = (M + 7) / 8;
    for (int g = 0; g < groups; ++g)
        for (int d = 0; d < 64; ++d)
            for (int l = 0; l < 8; ++l) qt[g][d][l] = 8 * g + l < M ? queries[(8 * g + l) * 64 + d] : 0.0f;
    alignas(32) float widened[8 * 64];
    for (int64_t t = 0; t < stride; t += 8) {
        const int64_t n = std::min<int64_t>(8, stride - t);
        const float* chunk = widened;
        if constexpr (std::is_same_v<T, float>) {
            if (n == 8) chunk = k + t * 64;
        }
        if (chunk == widened) {
            for (int64_t i = 0; i < 8 * 8; ++i)
                _mm256_store_ps(widened + 8 * i, i < n * 8 ? load8(k + t * 64 + 8 * i) : _mm256_setzero_ps());
        }
        for (int g = 0; g < groups; ++g)
            scores8(&qt[g][0][0], chunk, n, std::min(8, M - 8 * g), scores + 8 * g * stride + t, stride);
    }
    float inv[kMaxHeadsTogether];
    for (int m = 0; m < M; ++m) inv[m] = softmax_weights(scores + m * stride, keys[m]);
    for (int half = 0; half < 2; ++half) {
        int c = 0;
        for (; c + 3 <= M; c += 3) weighted_values_avx2<3>(scores + c * stride, stride, keys + c, inv + c, v, out + c, half);
        if (M - c == 2) weighted_values_avx2<2>(scores + c * stride, stride, keys + c, inv + c, v, out + c, half);
        if (M - c == 1) weighted_values_avx2<1>(scores + c * stride, stride, keys + c, inv + c, v, out + c, half);
    }
}
#endif

// Any head size and grouping: one query head at a time.
template <typename T>
void one_head(const float* query, const T* k, const T* v, int64_t keys, int64_t hd, float* scores, float* acc,
              float* out) {
    for (int64_t t = 0; t < keys; ++t) scores[t] = dot(query, k + t * hd, hd);
    const float inv = softmax_weights(scores, keys);
    for (int64_t d = 0; d < hd; ++d) acc[d] = 0.0f;
    for (int64_t t = 0; t < keys; ++t)
        for (int64_t d = 0; d < hd; ++d) acc[d] += scores[t] * to_float(v[t * hd + d]);
    for (int64_t d = 0; d < hd; ++d) out[d] = acc[d] * inv;
}

// How many pieces to cut one slot's `rows` into (at least `fewest`), so that its kv_heads x pieces
// tasks keep every thread busy: a task costs about its query heads plus two (its keys and values
// streamed once; measured on a Zen 3), and the slowest thread's tasks decide the time. One request
// verifying 4 rows on 2 threads: 3 tasks of 12 heads (one thread does two) -> 6 of 6 (three each).
// Which rows share a task does not change a row's bits, so the cut may follow the thread count.
inline int64_t balanced_pieces(int64_t rows, int64_t fewest, int64_t group, int64_t kv_heads, int64_t threads) {
    int64_t best = fewest, best_cost = INT64_MAX;
    for (int64_t p = fewest; p <= std::min(rows, fewest + threads); ++p) {
        const int64_t rounds = (p * kv_heads + threads - 1) / threads, per_task = (rows + p - 1) / p * group + 2;
        if (rounds * per_task < best_cost) best = p, best_cost = rounds * per_task;
    }
    return best;
}

// Tasks of one KV head and a run of consecutive rows of one slot (a verified block), at most
// kMaxHeadsTogether query heads in all, split evenly: the run's rows read each key and value once.
// q(r, h, query) fills query[hd] with row r's head h, rotated, before scaling. A row's bits do not
// depend on the tasks: every (row, head) is computed by the same operations in the same order.
template <typename T, typename Query>
void attend_rows(const Query& q, const T* kc, const T* vc, const int64_t* slots, const int64_t* key_counts,
                 float* out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t hd,
                 int64_t max_len, float scale) {
    const int64_t group = heads / kv_heads;
    const int64_t slot_stride = kv_heads * max_len * hd;
    const int64_t most_rows = std::max<int64_t>(1, kMaxHeadsTogether / group);
    std::vector<int64_t> first;  // each task's first row; rows first[i]..first[i + 1] - 1
    for (int64_t r = 0; r < rows;) {
        int64_t end = r + 1;
        while (end < rows && slots[end] == slots[r]) ++end;
        int64_t pieces = (end - r + most_rows - 1) / most_rows;
        if (r == 0 && end == rows) pieces = balanced_pieces(rows, pieces, group, kv_heads, at::get_num_threads());
        const int64_t size = (end - r + pieces - 1) / pieces;
        for (; r < end; r += size) first.push_back(r);
        r = end;
    }
    first.push_back(rows);
    const int64_t runs = static_cast<int64_t>(first.size()) - 1;
    at::parallel_for(0, runs * kv_heads, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scores, queries, acc(hd);
        std::vector<int64_t> keys;
        std::vector<float*> dst;
        for (int64_t task = begin; task < end; ++task) {
            const int64_t kvh = task / runs, r0 = first[task % runs], r1 = first[task % runs + 1];
            const int64_t M = (r1 - r0) * group;
            const int64_t base = slots[r0] * slot_stride + kvh * max_len * hd;
            queries.resize(M * hd);
            keys.resize(M);
            dst.resize(M);
            int64_t stride = 0;
            for (int64_t r = r0, m = 0; r < r1; ++r)
                for (int64_t g = 0; g < group; ++g, ++m) {
                    const int64_t h = kvh * group + g;
                    q(r, h, queries.data() + m * hd);
                    for (int64_t d = 0; d < hd; ++d) queries[m * hd + d] *= scale;
                    keys[m] = key_counts[r];
                    dst[m] = out + (r * heads + h) * hd;
                    stride = std::max(stride, keys[m]);
                }
            scores.resize(M * stride);
#ifdef __AVX512F__
            if (hd == 64 && M <= kMaxHeadsTogether) {
                attend_heads(queries.data(), keys.data(), static_cast<int>(M), kc + base, vc + base, scores.data(),
                             stride, dst.data());
                continue;
            }
#elif defined(__AVX2__) && defined(__FMA__)
            if (hd == 64 && M <= kMaxHeadsTogether) {
                attend_heads_avx2(queries.data(), keys.data(), static_cast<int>(M), kc + base, vc + base,
                                  scores.data(), stride, dst.data());
                continue;
            }
#endif
            for (int64_t m = 0; m < M; ++m)
                one_head(queries.data() + m * hd, kc + base, vc + base, keys[m], hd, scores.data(), acc.data(), dst[m]);
        }
    });
}

// x * cos + rotate_half(x) * sin for one head, the sign of rotate_half folded into signed_sin.
inline void rope(const float* x, const float* cos, const float* signed_sin, int64_t hd, float* out) {
    const int64_t half = hd / 2;
    // Two halves instead of one loop with (d + half) % hd: the same arithmetic, now vectorized.
    for (int64_t d = 0; d < half; ++d) out[d] = x[d] * cos[d] + x[d + half] * signed_sin[d];
    for (int64_t d = half; d < hd; ++d) out[d] = x[d] * cos[d] + x[d + half - hd] * signed_sin[d];
}

// Each new row's rotated k and its v into the row's slot at its position (before any row attends:
// a block's later rows read the earlier ones' keys). A row holds heads q heads, then kv_heads k
// heads and kv_heads v heads; rows lie row_stride floats apart (0: just that wide).
template <typename T>
void write_rows(const float* qkv, const float* cos, const float* signed_sin, T* kc, T* vc, const int64_t* slots,
                const int64_t* positions, int64_t rows, int64_t heads, int64_t kv_heads, int64_t hd,
                int64_t max_len, int64_t row_stride = 0) {
    const int64_t width = row_stride ? row_stride : (heads + 2 * kv_heads) * hd;
    std::vector<float> rotated(hd);  // a bf16 cache's key before its rounding
    for (int64_t r = 0; r < rows; ++r) {
        const float* row = qkv + r * width;
        const float* c = cos + r * hd;
        const float* sn = signed_sin + r * hd;
        for (int64_t h = 0; h < kv_heads; ++h) {
            const int64_t at = ((slots[r] * kv_heads + h) * max_len + positions[r]) * hd;
            const float* k = row + (heads + h) * hd;
            const float* v = row + (heads + kv_heads + h) * hd;
            if constexpr (std::is_same_v<T, float>) {
                rope(k, c, sn, hd, kc + at);
            } else {
                rope(k, c, sn, hd, rotated.data());
                for (int64_t d = 0; d < hd; ++d) kc[at + d] = static_cast<T>(rotated[d]);
            }
            for (int64_t d = 0; d < hd; ++d) vc[at + d] = static_cast<T>(v[d]);
        }
    }
}

}  // namespace

// What both attention entry points check: the caches' layout, and that every row's slot and
// position lie inside them (slots and positions contiguous int64, one per row).
void check_cache_rows(const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& slots,
                      const torch::Tensor& positions, int64_t rows) {
    TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                k_cache.scalar_type() == v_cache.scalar_type(), "k/v caches must be [slots, KV, L, hd], alike");
    TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "k/v caches must be contiguous");
    TORCH_CHECK(slots.scalar_type() == torch::kInt64 && positions.scalar_type() == torch::kInt64 &&
                slots.numel() == rows && positions.numel() == rows, "one int64 slot and position per row");
    const int64_t* slot = slots.data_ptr<int64_t>();
    const int64_t* position = positions.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r) {
        TORCH_CHECK(0 <= position[r] && position[r] < k_cache.size(2), "position outside the cache");
        TORCH_CHECK(0 <= slot[r] && slot[r] < k_cache.size(0), "slot outside the cache");
    }
}

// Causal attention: a row sees its own key and every earlier one.
std::vector<int64_t> causal_key_counts(const torch::Tensor& positions) {
    const int64_t* p = positions.data_ptr<int64_t>();
    std::vector<int64_t> counts(p, p + positions.numel());
    for (auto& c : counts) ++c;
    return counts;
}

// [rows, heads * hd] float32: each row's query heads (query(r, h, dst) fills one) over its cache's
// first key_counts[r] keys.
template <typename Query>
torch::Tensor attend(const Query& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                     const torch::Tensor& slots, const int64_t* key_count, int64_t rows, int64_t heads) {
    const int64_t kv_heads = k_cache.size(1), max_len = k_cache.size(2), hd = k_cache.size(3);
    auto out = torch::empty({rows, heads * hd}, k_cache.options().dtype(torch::kFloat32));
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    const int64_t* slot = slots.data_ptr<int64_t>();
    AT_DISPATCH_SWITCH(k_cache.scalar_type(), "attend",
        AT_DISPATCH_CASE(torch::kFloat32, [&] {
            attend_rows(query, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), slot, key_count,
                        out.data_ptr<float>(), rows, heads, kv_heads, hd, max_len, scale);
        })
        AT_DISPATCH_CASE(torch::kBFloat16, [&] {
            attend_rows(query, k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>(), slot,
                        key_count, out.data_ptr<float>(), rows, heads, kv_heads, hd, max_len, scale);
        }));
    return out;
}

// q [N, H, hd] float32; k_cache / v_cache [slots, KV, max_len, hd] float32 or bfloat16, already
// holding every new row's key and value; slots, positions [N] int64. Returns [N, H * hd] float32.
torch::Tensor cached_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor slots, torch::Tensor positions) {
    TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32, "q must be [N, H, hd] float32");
    q = q.contiguous();
    slots = slots.contiguous();
    positions = positions.contiguous();
    const int64_t rows = q.size(0), heads = q.size(1), hd = q.size(2);
    check_cache_rows(k_cache, v_cache, slots, positions, rows);
    TORCH_CHECK(k_cache.size(3) == hd && heads % k_cache.size(1) == 0, "head shapes of q and the cache differ");
    const float* qp = q.data_ptr<float>();
    auto query = [&](int64_t r, int64_t h, float* dst) {
        std::memcpy(dst, qp + (r * heads + h) * hd, hd * sizeof(float));
    };
    return attend(query, k_cache, v_cache, slots, causal_key_counts(positions).data(), rows, heads);
}

// The attention half of a layer after its fused q|k|v projection, in one call: rotate q and k,
// write every new row's k and v into its slot of the cache, then attend as cached_attention does.
// qkv [N, (H + 2 KV) * hd] float32; cos, signed_sin [N, hd] float32 (per row, from its position).
torch::Tensor rope_cache_attention(torch::Tensor qkv, torch::Tensor cos, torch::Tensor signed_sin,
                                   torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                                   torch::Tensor positions, int64_t heads, bool bf16_out,
                                   c10::optional<torch::Tensor> key_counts) {
    TORCH_CHECK(qkv.dim() == 2 && (qkv.scalar_type() == torch::kFloat32 || qkv.scalar_type() == torch::kBFloat16),
                "qkv must be [N, (H + 2 KV) hd] float32 or bfloat16");
    qkv = qkv.to(torch::kFloat32).contiguous();
    slots = slots.contiguous();
    positions = positions.contiguous();
    const int64_t rows = qkv.size(0);
    check_cache_rows(k_cache, v_cache, slots, positions, rows);
    const int64_t kv_heads = k_cache.size(1), max_len = k_cache.size(2), hd = k_cache.size(3);
    TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * hd && heads % kv_heads == 0, "qkv width and heads differ");
    TORCH_CHECK(cos.sizes() == signed_sin.sizes() && cos.size(0) == rows && cos.size(-1) == hd &&
                cos.scalar_type() == torch::kFloat32 && signed_sin.scalar_type() == torch::kFloat32,
                "cos and signed_sin must be [N, hd] float32");
    cos = cos.contiguous().view({rows, hd});
    signed_sin = signed_sin.contiguous().view({rows, hd});
    const float* x = qkv.data_ptr<float>();
    const float* c = cos.data_ptr<float>();
    const float* sn = signed_sin.data_ptr<float>();
    const int64_t* slot = slots.data_ptr<int64_t>();
    const int64_t* position = positions.data_ptr<int64_t>();
    AT_DISPATCH_SWITCH(k_cache.scalar_type(), "rope_cache_attention",
        AT_DISPATCH_CASE(torch::kFloat32, [&] {
            write_rows(x, c, sn, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), slot, position, rows,
                       heads, kv_heads, hd, max_len);
        })
        AT_DISPATCH_CASE(torch::kBFloat16, [&] {
            write_rows(x, c, sn, k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>(), slot,
                       position, rows, heads, kv_heads, hd, max_len);
        }));
    const int64_t width = qkv.size(1);
    auto query = [&](int64_t r, int64_t h, float* dst) {
        rope(x + r * width + h * hd, c + r * hd, sn + r * hd, hd, dst);
    };
    std::vector<int64_t> counts;
    if (key_counts.has_value()) {
        TORCH_CHECK(key_counts->scalar_type() == torch::kInt64 && key_counts->numel() == rows,
                    "key_counts must be one int64 a row");
        const auto given = key_counts->contiguous();
        counts.assign(given.data_ptr<int64_t>(), given.data_ptr<int64_t>() + rows);
        for (const int64_t c : counts) TORCH_CHECK(0 < c && c <= max_len, "a row's key count is outside the cache");
    } else {
        counts = causal_key_counts(positions);
    }
    auto out = attend(query, k_cache, v_cache, slots, counts.data(), rows, heads);
    return bf16_out ? out.to(torch::kBFloat16) : out;
}

// A parallel drafter's new context rows into its per-layer caches: kv [N, layers * 2 * KV * hd] float32,
// each layer's k heads then v heads (its fused k|v projection of the rows); every layer's k rotated and
// written with its v at the row's slot and position, as rope_cache_attention writes a layer's. One call
// for all layers instead of a rotation, a split and two copies a layer from Python.
void rope_cache_write(torch::Tensor kv, torch::Tensor cos, torch::Tensor signed_sin,
                      const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                      torch::Tensor slots, torch::Tensor positions) {
    TORCH_CHECK(kv.dim() == 2 && kv.scalar_type() == torch::kFloat32, "kv must be [N, layers * 2 * KV * hd] float32");
    TORCH_CHECK(!k_caches.empty() && k_caches.size() == v_caches.size(), "one key and one value cache a layer");
    kv = kv.contiguous();
    slots = slots.contiguous();
    positions = positions.contiguous();
    const int64_t rows = kv.size(0), layers = static_cast<int64_t>(k_caches.size());
    const int64_t kv_heads = k_caches[0].size(1), max_len = k_caches[0].size(2), hd = k_caches[0].size(3);
    const int64_t layer_width = 2 * kv_heads * hd;
    TORCH_CHECK(kv.size(1) == layers * layer_width, "kv width and the caches differ");
    TORCH_CHECK(cos.sizes() == signed_sin.sizes() && cos.size(0) == rows && cos.size(-1) == hd &&
                cos.scalar_type() == torch::kFloat32 && signed_sin.scalar_type() == torch::kFloat32,
                "cos and signed_sin must be [N, hd] float32");
    cos = cos.contiguous();
    signed_sin = signed_sin.contiguous();
    for (int64_t i = 0; i < layers; ++i) {
        const torch::Tensor& kc = k_caches[i];
        const torch::Tensor& vc = v_caches[i];
        check_cache_rows(kc, vc, slots, positions, rows);
        TORCH_CHECK(kc.scalar_type() == torch::kFloat32 && kc.size(1) == kv_heads && kc.size(2) == max_len &&
                    kc.size(3) == hd, "every layer's cache float32 and alike");
        write_rows(kv.data_ptr<float>() + i * layer_width, cos.data_ptr<float>(), signed_sin.data_ptr<float>(),
                   kc.data_ptr<float>(), vc.data_ptr<float>(), slots.data_ptr<int64_t>(),
                   positions.data_ptr<int64_t>(), rows, 0, kv_heads, hd, max_len, kv.size(1));
    }
}

// w * x / sqrt(mean(x^2) + eps) of one row, its sum of squares in a fixed lane order.
template <typename T>
inline void norm_row(const float* row, const float* w, int64_t d, float eps, T* out) {
    float acc[LANES] = {0.0f};
    int64_t i = 0;
    for (; i + LANES <= d; i += LANES)
        for (int l = 0; l < LANES; ++l) acc[l] += row[i + l] * row[i + l];
    for (int l = 0; i + l < d; ++l) acc[l] += row[i + l] * row[i + l];
    const float scale = 1.0f / std::sqrt(lane_sum(acc) / static_cast<float>(d) + eps);
    for (int64_t j = 0; j < d; ++j) out[j] = static_cast<T>(w[j] * (row[j] * scale));
}

// The residual stream's step between two matmuls: x += delta (in place, delta's rows in float32),
// then RMSNorm of x, returned in float32 or bfloat16 (what the next matmul reads). x [N, d] float32
// contiguous; delta [N, d] float32 or bfloat16, or None.
torch::Tensor add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> delta, torch::Tensor weight, double eps,
                           bool bf16_out) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
                "x must be [N, d] float32, contiguous");
    TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.numel() == x.size(1), "weight must be [d] float32");
    const int64_t rows = x.size(0), d = x.size(1);
    float* xs = x.data_ptr<float>();
    if (delta.has_value()) {
        auto dl = delta->contiguous();
        TORCH_CHECK(dl.dim() == 2 && dl.size(0) == rows && dl.size(1) == d, "delta must be [N, d]");
        if (dl.scalar_type() == torch::kBFloat16) {
            const c10::BFloat16* src = dl.data_ptr<c10::BFloat16>();
            for (int64_t i = 0; i < rows * d; ++i) xs[i] += static_cast<float>(src[i]);
        } else {
            TORCH_CHECK(dl.scalar_type() == torch::kFloat32, "delta must be float32 or bfloat16");
            const float* src = dl.data_ptr<float>();
            for (int64_t i = 0; i < rows * d; ++i) xs[i] += src[i];
        }
    }
    weight = weight.contiguous();
    const float* w = weight.data_ptr<float>();
    auto out = torch::empty({rows, d}, x.options().dtype(bf16_out ? torch::kBFloat16 : torch::kFloat32));
    // A row costs ~0.4 us, a parallel region ~2 us more and ~5 us when it wakes the other thread
    // (measured: 17 rows took 11.8 us on two threads, 16 on one 6.2 us): only prefills are split.
    at::parallel_for(0, rows, kNormRowsPerThread, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            if (bf16_out)
                norm_row(xs + r * d, w, d, static_cast<float>(eps), out.data_ptr<c10::BFloat16>() + r * d);
            else
                norm_row(xs + r * d, w, d, static_cast<float>(eps), out.data_ptr<float>() + r * d);
        }
    });
    return out;
}

// RMSNorm of each row of x [..., d] float32: add_rms_norm without a delta. One call where the
// composed torch ops were six, each a few microseconds at decode.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32, "rms_norm takes float32");
    return add_rms_norm(x.contiguous().view({-1, x.size(-1)}), c10::nullopt, weight, eps, false).view(x.sizes());
}

// SwiGLU's middle: silu(gate) * up for gate_up [N, 2h] (gate first), in float32, returned in
// float32 or bfloat16. sigmoid from exp(-|g|) <= 1, so the branch-free exp serves both signs.
inline float silu_times(float g, float up) {
    const float e = exp_nonpositive(-std::fabs(g));
    const float sigmoid = (g >= 0.0f ? 1.0f : e) / (1.0f + e);
    return g * sigmoid * up;
}

inline float load_float(const float* p) { return *p; }
inline float load_float(const c10::BFloat16* p) { return static_cast<float>(*p); }

template <typename In, typename Out>
void silu_mul_rows(const In* gu, Out* out, int64_t begin, int64_t end, int64_t h) {
    for (int64_t r = begin; r < end; ++r) {
        const In* gate = gu + r * 2 * h;
        const In* up = gate + h;
        int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
        // silu_times eight at a time, the same operations (with AVX-512 GCC vectorizes the loop
        // below itself, 16 lanes, faster than this: 4.7 against 7.6 us for 8 rows on a Zen 4)
        const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
        alignas(32) float g8[8], u8[8], y8[8];
        for (; j + 8 <= h; j += 8) {
            for (int l = 0; l < 8; ++l) g8[l] = load_float(gate + j + l), u8[l] = load_float(up + j + l);
            const __m256 g = _mm256_load_ps(g8);
            const __m256 e = exp_nonpositive8(_mm256_or_ps(g, sign));  // -|g|
            const __m256 top = _mm256_blendv_ps(e, one, _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_GE_OQ));
            const __m256 sigmoid = _mm256_div_ps(top, _mm256_add_ps(one, e));
            _mm256_store_ps(y8, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), _mm256_load_ps(u8)));
            for (int l = 0; l < 8; ++l) out[r * h + j + l] = static_cast<Out>(y8[l]);
        }
#endif
        for (; j < h; ++j) out[r * h + j] = static_cast<Out>(silu_times(load_float(gate + j), load_float(up + j)));
    }
}

torch::Tensor silu_mul(torch::Tensor gate_up, bool bf16_out) {
    TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [N, 2h]");
    gate_up = gate_up.contiguous();
    const int64_t rows = gate_up.size(0), h = gate_up.size(1) / 2;
    auto out = torch::empty({rows, h}, gate_up.options().dtype(bf16_out ? torch::kBFloat16 : torch::kFloat32));
    // A row of SmolLM2's MLP is ~0.6 us (Zen 4) to ~1 us (AVX2): calls of more than 16 rows (full batches and their
    // verified blocks) share them out; below that waking the other thread costs about what it saves.
    at::parallel_for(0, rows, kSiluRowsPerThread, [&](int64_t begin, int64_t end) {
        AT_DISPATCH_SWITCH(gate_up.scalar_type(), "silu_mul",
            AT_DISPATCH_CASE(torch::kFloat32, [&] {
                if (bf16_out) silu_mul_rows(gate_up.data_ptr<float>(), out.data_ptr<c10::BFloat16>(), begin, end, h);
                else silu_mul_rows(gate_up.data_ptr<float>(), out.data_ptr<float>(), begin, end, h);
            })
            AT_DISPATCH_CASE(torch::kBFloat16, [&] {
                if (bf16_out) silu_mul_rows(gate_up.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), begin, end, h);
                else silu_mul_rows(gate_up.data_ptr<c10::BFloat16>(), out.data_ptr<float>(), begin, end, h);
            }));
    });
    return out;
}

void register_gguf_matmul(pybind11::module& m);     // gguf_matmul.cpp
void register_gguf_q8_matmul(pybind11::module& m);  // gguf_q8_matmul.cpp
void register_int8_matmul(pybind11::module& m);     // int8_matmul.cpp
void register_draft_chain(pybind11::module& m);     // draft_chain.cpp
void register_layer_stack(pybind11::module& m);     // layer_stack.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("cached_attention", &cached_attention, kReleaseGil, "attention of new rows over their slot's KV cache");
    m.def("rms_norm", &rms_norm, kReleaseGil, "RMSNorm of each row (float32)");
    m.def("rope_cache_attention", &rope_cache_attention, kReleaseGil,
          "rotate q|k, write k and v into the cache, attend: a layer's attention after its q|k|v matmul. Each "
          "row attends to its slot's first key_counts[r] keys (default position + 1: causal; a draft block "
          "passes its end, so its rows see each other)",
          pybind11::arg("qkv"), pybind11::arg("cos"), pybind11::arg("signed_sin"), pybind11::arg("k_cache"),
          pybind11::arg("v_cache"), pybind11::arg("slots"), pybind11::arg("positions"), pybind11::arg("heads"),
          pybind11::arg("bf16_out"), pybind11::arg("key_counts") = pybind11::none());
    m.def("rope_cache_write", &rope_cache_write, kReleaseGil,
          "a parallel drafter's context rows: every layer's k rotated and written with its v into its cache");
    m.def("add_rms_norm", &add_rms_norm, kReleaseGil, "x += delta in place, then RMSNorm of x (float32 or bfloat16 out)");
    m.def("silu_mul", &silu_mul, kReleaseGil, "silu(gate) * up of a fused gate|up output");
    register_gguf_matmul(m);
    register_gguf_q8_matmul(m);
    register_int8_matmul(m);
    register_draft_chain(m);
    register_layer_stack(m);
}
