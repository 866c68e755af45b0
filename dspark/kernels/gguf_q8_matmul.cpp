// y = x W^T with W in GGUF Q4_1 / Q8_0 blocks and x quantized to 8-bit blocks of 32 (llama.cpp's math).
//
// Why: gguf_matmul.cpp turns every weight back into fp32 and multiplies in fp32; on an AVX2 CPU that
// dequantization is most of a decode step (4-8 GMAC/s a core at one row), and fp32 FMAs do 8
// multiply-adds an instruction. Here each row of x becomes int8 blocks with one fp32 scale per 32
// values, weights stay 8-bit (Q4_1's nibbles as u8, Q8_0's bytes as they are), and one
// _mm256_maddubs_epi16 does 32 multiply-adds whose 16-bit pair sums cannot saturate (15 * 127 * 2
// and 128 * 127 * 2 are below 32767). The block sums are exact integers; only their scaling and the
// sum over blocks are fp32.
//
// Batch invariance, which speculative verification needs: a row's int8 blocks depend on that row
// alone, and output (i, n) is one 8-lane fp32 accumulator run over the blocks in order (plus, for
// Q4_1, one scalar sum of the min terms over the blocks in order), whatever the row count, the row
// grouping or the threads (work is split by output column only). A verified row gets the bits
// decoding it alone would have given. Weights whose columns come in eights run interleaved
// (gguf_linear_q8_interleaved, below: one fp32 lane per output, the blocks in order), 1.3-3.6x faster.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "release_gil.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kQ4_1 = 3, kQ8_0 = 8;

inline float half_to_float(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

// x as int8 blocks: q = round(x / d) (to nearest even), d = max |x| / 127 per block of 32;
// `sum_scaled` = d * sum(q) (Q4_1's min term multiplies it).
struct Q8Rows {
    std::vector<int8_t> q;
    std::vector<float> scale, sum_scaled;

    Q8Rows(const float* x, int64_t rows, int64_t k_len) : q(rows * k_len), scale(rows * k_len / kBlock),
                                                          sum_scaled(rows * k_len / kBlock) {
        const __m256 sign_bit = _mm256_set1_ps(-0.f);
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undo the packs' lane interleave
        for (int64_t b = 0; b < rows * k_len / kBlock; ++b) {
            const float* v = x + b * kBlock;
            __m256 part[4];
            __m256 amax = _mm256_setzero_ps();
            for (int g = 0; g < 4; ++g) {
                part[g] = _mm256_loadu_ps(v + 8 * g);
                amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, part[g]));
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            const float top = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
            const __m256 inv = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
            __m256i qi[4];
            for (int g = 0; g < 4; ++g) qi[g] = _mm256_cvtps_epi32(_mm256_mul_ps(part[g], inv));  // MXCSR: nearest even
            __m256i sum = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
            const __m256i bytes = _mm256_permutevar8x32_epi32(
                _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3])), order);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.data() + b * kBlock), bytes);
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
            scale[b] = top / 127.f;
            sum_scaled[b] = scale[b] * static_cast<float>(_mm_cvtsi128_si32(s4));
        }
    }
};

inline float lane_sum(__m256 acc) {  // one fixed order for every output
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// One weight block as maddubs' unsigned operand in x's order (Q4_1: nibble values 0..15, byte j
// holds weights j and j + 16; Q8_0: |w|, its signs to be moved onto x), and its scales.
template <bool kQ8>
inline __m256i unpack(const uint8_t* blk, __m256i& signs, float& d, float& m) {
    d = half_to_float(blk);
    if constexpr (kQ8) {
        m = 0.f;
        signs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
        return _mm256_abs_epi8(signs);
    } else {
        m = half_to_float(blk + 2);
        const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4)), low4 = _mm_set1_epi8(0x0F);
        return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), low4), _mm_and_si128(qs, low4));
    }
}

// Output column n for R input rows from row0. Per block and row: 32 products summed exactly in
// int32 lanes, then acc += lanes * (d_w * d_x); Q4_1's min term sum(m * d_x * sum(q_x)) runs
// beside it in a scalar, in block order. The same instructions in the same order for a row
// whatever R is, so a row's output does not depend on the rows around it.
template <int R, bool kQ8>
inline void column(const Q8Rows& x, int64_t row0, const uint8_t* wrow, int64_t blocks, float* y, int64_t ldy) {
    constexpr int64_t kBytes = kQ8 ? 34 : 20;
    const int64_t k_len = blocks * kBlock;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[R];
    float mins[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), mins[r] = 0.f;
    const int8_t* xq = x.q.data() + row0 * k_len;
    const float* xd = x.scale.data() + row0 * blocks;
    const float* xs = x.sum_scaled.data() + row0 * blocks;
    for (int64_t b = 0; b < blocks; ++b) {
        __m256i signs;
        float d, m;
        const __m256i w = unpack<kQ8>(wrow + b * kBytes, signs, d, m);
        const __m256 wd = _mm256_set1_ps(d);
        for (int r = 0; r < R; ++r) {
            __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * k_len + b * kBlock));
            if constexpr (kQ8) q = _mm256_sign_epi8(q, signs);
            const __m256i lanes = _mm256_madd_epi16(_mm256_maddubs_epi16(w, q), ones);
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(lanes), wd), _mm256_broadcast_ss(xd + r * blocks + b), acc[r]);
            if constexpr (!kQ8) mins[r] += m * xs[r * blocks + b];
        }
    }
    for (int r = 0; r < R; ++r) y[(row0 + r) * ldy] = lane_sum(acc[r]) + mins[r];
}

template <bool kQ8>
void run(const Q8Rows& x, int64_t rows, const uint8_t* wp, int64_t n_out, int64_t blocks, float* yp) {
    const int64_t row_bytes = blocks * (kQ8 ? 34 : 20);
    at::parallel_for(0, n_out, 16, [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; ++n) {
            const uint8_t* wrow = wp + n * row_bytes;
            int64_t i = 0;
            for (; i + 4 <= rows; i += 4) column<4, kQ8>(x, i, wrow, blocks, yp + n, n_out);
            if (i + 2 <= rows) column<2, kQ8>(x, i, wrow, blocks, yp + n, n_out), i += 2;
            if (i < rows) column<1, kQ8>(x, i, wrow, blocks, yp + n, n_out);
        }
    });
}

// ---- Q4_1 with eight output columns interleaved (gguf_interleave) ----------------------
// Per group of 8 columns and block of 32 inputs, 160 bytes (as 8 GGUF blocks): the 8 columns' d
// (fp16), their m (fp16), then 4 vectors of 32 bytes; vector v holds inputs 8v..8v+7 of the block:
// byte 4c + t has column c's weight 8v + t in its low nibble and 8v + 4 + t in its high one. One
// maddubs of a vector's nibbles by 4 inputs of x broadcast to every lane gives each column two
// pair sums: the columns ride in the lanes, so no block is ever summed across lanes, and a block's
// eight maddubs add up in 16 bits (each lane at most 8 * 2 * 15 * 127 = 30,480 < 32,767) before
// one madd widens them. Per block and row that is 9 integer multiplies and one scaling for 8
// columns, where column() does 16 and 8.
constexpr int64_t kCols = 8, kPackedQ4Block = 160;

// Rows [row0, row0 + R) times column group g; y rows of n_out floats.
template <int R>
inline void column_group_q4(const Q8Rows& x, int64_t row0, const uint8_t* wg, int64_t blocks, float* y, int64_t n_out) {
    const int64_t k_len = blocks * kBlock;
    const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0F);
    __m256 acc[R], mins[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), mins[r] = _mm256_setzero_ps();
    const int8_t* xq = x.q.data() + row0 * k_len;
    const float* xd = x.scale.data() + row0 * blocks;
    const float* xs = x.sum_scaled.data() + row0 * blocks;
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* blk = wg + b * kPackedQ4Block;
        __m256i sums[R];
        for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) {
            const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 + 32 * v));
            const __m256i lo = _mm256_and_si256(packed, low4), hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
            for (int r = 0; r < R; ++r) {
                const int8_t* q = xq + r * k_len + b * kBlock + 8 * v;
                int32_t q_lo, q_hi;
                std::memcpy(&q_lo, q, 4);
                std::memcpy(&q_hi, q + 4, 4);
                sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(q_lo)));
                sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(q_hi)));
            }
        }
        const __m256 wd = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
        const __m256 wm = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16)));
        for (int r = 0; r < R; ++r) {
            const __m256i totals = _mm256_madd_epi16(sums[r], ones);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(totals), _mm256_mul_ps(wd, _mm256_set1_ps(xd[r * blocks + b])), acc[r]);
            mins[r] = _mm256_fmadd_ps(wm, _mm256_set1_ps(xs[r * blocks + b]), mins[r]);
        }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + (row0 + r) * n_out, _mm256_add_ps(acc[r], mins[r]));
}

// Q8_0 the same way (gguf_interleave): per group of 8 columns and block, 272 bytes: the 8
// columns' d (fp16), then 8 vectors of 32 bytes, vector g holding inputs 4g..4g+3 (byte 4c + t:
// column c's weight 4g + t). As in column(), |w| is maddubs' unsigned operand and w's signs move
// onto x; pair sums reach 2 * 128 * 127, so each of a block's 8 products is widened (madd) before
// they add up.
constexpr int64_t kPackedQ8Block = 272;

template <int R>
inline void column_group_q8(const Q8Rows& x, int64_t row0, const uint8_t* wg, int64_t blocks, float* y, int64_t n_out) {
    const int64_t k_len = blocks * kBlock;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const int8_t* xq = x.q.data() + row0 * k_len;
    const float* xd = x.scale.data() + row0 * blocks;
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* blk = wg + b * kPackedQ8Block;
        __m256i sums[R];
        for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int g = 0; g < 8; ++g) {
            const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 16 + 32 * g));
            const __m256i magnitude = _mm256_abs_epi8(w);
            for (int r = 0; r < R; ++r) {
                int32_t q4;
                std::memcpy(&q4, xq + r * k_len + b * kBlock + 4 * g, 4);
                const __m256i q = _mm256_sign_epi8(_mm256_set1_epi32(q4), w);
                sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, q), ones));
            }
        }
        const __m256 wd = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
        for (int r = 0; r < R; ++r)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_mul_ps(wd, _mm256_set1_ps(xd[r * blocks + b])), acc[r]);
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + (row0 + r) * n_out, acc[r]);
}

template <int R, bool kQ8>
inline void column_group(const Q8Rows& x, int64_t row0, const uint8_t* wg, int64_t blocks, float* y, int64_t n_out) {
    if constexpr (kQ8) column_group_q8<R>(x, row0, wg, blocks, y, n_out);
    else column_group_q4<R>(x, row0, wg, blocks, y, n_out);
}

// Every group of 8 columns, rows 4 at a time, then 2, then 1 (as run()).
template <bool kQ8>
void run_interleaved(const Q8Rows& x, int64_t rows, const uint8_t* wp, int64_t n_out, int64_t blocks, float* yp) {
    const int64_t group_bytes = blocks * (kQ8 ? kPackedQ8Block : kPackedQ4Block);
    at::parallel_for(0, n_out / kCols, 2, [&](int64_t begin, int64_t end) {
        for (int64_t g = begin; g < end; ++g) {
            const uint8_t* wg = wp + g * group_bytes;
            float* yg = yp + g * kCols;
            int64_t i = 0;
            for (; i + 4 <= rows; i += 4) column_group<4, kQ8>(x, i, wg, blocks, yg, n_out);
            if (i + 2 <= rows) column_group<2, kQ8>(x, i, wg, blocks, yg, n_out), i += 2;
            if (i < rows) column_group<1, kQ8>(x, i, wg, blocks, yg, n_out);
        }
    });
}

}  // namespace

torch::Tensor gguf_interleave(torch::Tensor blocks, int64_t qtype) {
    TORCH_CHECK(qtype == kQ4_1 || qtype == kQ8_0, "unsupported GGUF block type ", qtype);
    const int64_t bytes = qtype == kQ4_1 ? 20 : 34, packed_bytes = qtype == kQ4_1 ? kPackedQ4Block : kPackedQ8Block;
    TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == torch::kUInt8 && blocks.is_contiguous() &&
                blocks.size(0) % kCols == 0 && blocks.size(1) % bytes == 0,
                "blocks must be [out, row bytes] uint8, contiguous, out a multiple of 8");
    const int64_t n_out = blocks.size(0), nb = blocks.size(1) / bytes;
    auto packed = torch::empty({n_out / kCols, nb * packed_bytes}, blocks.options());
    const uint8_t* src = blocks.data_ptr<uint8_t>();
    uint8_t* dst = packed.data_ptr<uint8_t>();
    for (int64_t g = 0; g < n_out / kCols; ++g)
        for (int64_t b = 0; b < nb; ++b) {
            uint8_t* out = dst + (g * nb + b) * packed_bytes;
            for (int64_t c = 0; c < kCols; ++c) {
                const uint8_t* blk = src + (g * kCols + c) * nb * bytes + b * bytes;
                std::memcpy(out + 2 * c, blk, 2);
                if (qtype == kQ8_0) {
                    for (int k = 0; k < 32; ++k) out[16 + 32 * (k / 4) + 4 * c + k % 4] = blk[2 + k];
                    continue;
                }
                std::memcpy(out + 16 + 2 * c, blk + 2, 2);
                auto weight = [&](int k) { return k < 16 ? blk[4 + k] & 0x0F : blk[4 + k - 16] >> 4; };
                for (int v = 0; v < 4; ++v)
                    for (int t = 0; t < 4; ++t)
                        out[32 + 32 * v + 4 * c + t] = static_cast<uint8_t>(weight(8 * v + t) | (weight(8 * v + 4 + t) << 4));
            }
        }
    return packed;
}

torch::Tensor gguf_linear_q8_interleaved(torch::Tensor x, torch::Tensor packed, int64_t qtype) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be [rows, in] float32");
    TORCH_CHECK(qtype == kQ4_1 || qtype == kQ8_0, "unsupported GGUF block type ", qtype);
    TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(),
                "packed must be gguf_interleave's output");
    x = x.contiguous();
    const int64_t packed_bytes = qtype == kQ4_1 ? kPackedQ4Block : kPackedQ8Block;
    const int64_t rows = x.size(0), k_len = x.size(1), blocks = k_len / kBlock, n_out = packed.size(0) * kCols;
    TORCH_CHECK(k_len % kBlock == 0 && packed.size(1) == blocks * packed_bytes, "packed blocks do not hold ", k_len,
                " inputs per row");
    auto y = torch::empty({rows, n_out}, x.options());
    const Q8Rows xq(x.data_ptr<float>(), rows, k_len);
    if (qtype == kQ4_1) run_interleaved<false>(xq, rows, packed.data_ptr<uint8_t>(), n_out, blocks, y.data_ptr<float>());
    else run_interleaved<true>(xq, rows, packed.data_ptr<uint8_t>(), n_out, blocks, y.data_ptr<float>());
    return y;
}

torch::Tensor gguf_linear_q8(torch::Tensor x, torch::Tensor blocks, int64_t qtype) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be [rows, in] float32");
    TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == torch::kUInt8 && blocks.is_contiguous(),
                "blocks must be [out, row bytes] uint8, contiguous");
    TORCH_CHECK(qtype == kQ4_1 || qtype == kQ8_0, "unsupported GGUF block type ", qtype);
    x = x.contiguous();
    const int64_t rows = x.size(0), k_len = x.size(1), n_out = blocks.size(0);
    TORCH_CHECK(k_len % kBlock == 0 && blocks.size(1) == k_len / kBlock * (qtype == kQ4_1 ? 20 : 34),
                "blocks do not hold ", k_len, " inputs per row");
    auto y = torch::empty({rows, n_out}, x.options());
    const Q8Rows xq(x.data_ptr<float>(), rows, k_len);
    if (qtype == kQ4_1) run<false>(xq, rows, blocks.data_ptr<uint8_t>(), n_out, k_len / kBlock, y.data_ptr<float>());
    else run<true>(xq, rows, blocks.data_ptr<uint8_t>(), n_out, k_len / kBlock, y.data_ptr<float>());
    return y;
}

#else  // no AVX2: precision.py does not offer gguf-q8 here

torch::Tensor gguf_interleave(torch::Tensor, int64_t) {
    TORCH_CHECK(false, "the gguf-q8 matmul needs AVX2, FMA and F16C");
}

torch::Tensor gguf_linear_q8_interleaved(torch::Tensor, torch::Tensor, int64_t) {
    TORCH_CHECK(false, "the gguf-q8 matmul needs AVX2, FMA and F16C");
}

torch::Tensor gguf_linear_q8(torch::Tensor, torch::Tensor, int64_t) {
    TORCH_CHECK(false, "the gguf-q8 matmul needs AVX2, FMA and F16C");
}

#endif

void register_gguf_q8_matmul(pybind11::module& m) {
    m.def("gguf_linear_q8", &gguf_linear_q8,
          kReleaseGil, "x W^T with W in GGUF Q4_1 / Q8_0 blocks and x as 8-bit blocks of 32, batch-invariant");
    m.def("gguf_interleave", &gguf_interleave, "GGUF Q4_1 / Q8_0 blocks [out, row bytes] -> eight columns interleaved");
    m.def("gguf_linear_q8_interleaved", &gguf_linear_q8_interleaved, kReleaseGil,
          "gguf_linear_q8 on blocks interleaved by gguf_interleave (out a multiple of 8)");
}
