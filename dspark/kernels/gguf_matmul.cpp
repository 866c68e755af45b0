// y = x W^T with W kept as the GGUF stores it (Q4_1 or Q8_0 blocks of 32 along the input dimension).
//
// Why: a decode step is bound by the bytes of weight it reads. The fp32 path reads 540 MB a token
// for SmolLM2-135M; its GGUF blocks are 96 MB. Each block is turned back into exactly the fp32
// values gguf.quants.dequantize gives (d * q + m, d * q: the products are exact in fp32, so fused
// or not they round once, the same way), so this is the fp32 model, read 5.6x smaller.
//
// Batch invariance, which speculative verification needs: output (i, n) is always one 8-lane fp32
// accumulator run over k in order, then the same fixed lane sum, whatever the row count, the rows
// around it or the threads (work is split by output column only). A verified row gets the bits
// decoding would have given it.
//
// Shape of the work: a tile of 4 weight rows is dequantized once into a buffer that stays in L1,
// then every input row is multiplied against it, two (AVX2) or four (AVX-512) at a time; the
// weights cross memory once per call, not once per row.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "release_gil.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>

namespace {

constexpr int64_t kBlock = 32;  // weights per GGUF block
constexpr int64_t kTile = 4;    // weight rows dequantized together
constexpr int64_t kQ4_1 = 3, kQ8_0 = 8;  // ggml type ids

inline float half_to_float(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

#ifdef __AVX512F__
// AVX-512: 16-lane accumulators and four input rows at a time (32 vector registers hold 4 x 4
// accumulators). Per output, still one accumulator run over k in order and one fixed lane sum,
// so the results are as batch-invariant as the AVX2 path's (not the same bits as AVX2's: the
// lanes split k differently). d * q is exact in fp32, so d * q + m fused rounds once, as before.
constexpr int64_t kRowGroup = 4;

// Q4_1 block: fp16 d, fp16 m, 16 bytes; byte j holds weight j (low nibble) and j + 16 (high).
void dequant_q4_1(const uint8_t* row, int64_t blocks, float* out) {
    const __m128i low4 = _mm_set1_epi8(0x0F);
    for (int64_t b = 0; b < blocks; ++b, row += 20, out += kBlock) {
        __m512 d = _mm512_set1_ps(half_to_float(row)), m = _mm512_set1_ps(half_to_float(row + 2));
        __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 4));
        __m128i lo = _mm_and_si128(qs, low4), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), low4);
        _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), d, m));
        _mm512_storeu_ps(out + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), d, m));
    }
}

// Q8_0 block: fp16 d, 32 signed bytes.
void dequant_q8_0(const uint8_t* row, int64_t blocks, float* out) {
    for (int64_t b = 0; b < blocks; ++b, row += 34, out += kBlock) {
        __m512 d = _mm512_set1_ps(half_to_float(row));
        for (int g = 0; g < 2; ++g) {
            __m128i q8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 + 16 * g));
            _mm512_storeu_ps(out + 16 * g, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q8)), d));
        }
    }
}

inline float lane_sum(__m512 acc) {  // one fixed order for every output
    __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(acc),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// R input rows x C weight rows of the tile; every accumulator sees the same k order.
template <int R, int C>
inline void dots(const float* const* x, const float* w, int64_t k_len, float* const* y) {
    __m512 acc[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < k_len; k += 16) {
        __m512 xv[R];
        for (int r = 0; r < R; ++r) xv[r] = _mm512_loadu_ps(x[r] + k);
        for (int c = 0; c < C; ++c) {
            __m512 wv = _mm512_loadu_ps(w + c * k_len + k);
            for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(xv[r], wv, acc[r][c]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) y[r][c] = lane_sum(acc[r][c]);
}

#else  // AVX2: 8-lane accumulators, two input rows at a time (16 vector registers)
constexpr int64_t kRowGroup = 2;

inline void store8(float* out, __m128i bytes8_u8, __m256 d, __m256 m) {
    __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8_u8));
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_mul_ps(q, d), m));
}

// Q4_1 block: fp16 d, fp16 m, 16 bytes; byte j holds weight j (low nibble) and j + 16 (high).
void dequant_q4_1(const uint8_t* row, int64_t blocks, float* out) {
    const __m128i low4 = _mm_set1_epi8(0x0F);
    for (int64_t b = 0; b < blocks; ++b, row += 20, out += kBlock) {
        __m256 d = _mm256_set1_ps(half_to_float(row)), m = _mm256_set1_ps(half_to_float(row + 2));
        __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 4));
        __m128i lo = _mm_and_si128(qs, low4), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), low4);
        store8(out, lo, d, m);
        store8(out + 8, _mm_srli_si128(lo, 8), d, m);
        store8(out + 16, hi, d, m);
        store8(out + 24, _mm_srli_si128(hi, 8), d, m);
    }
}

// Q8_0 block: fp16 d, 32 signed bytes.
void dequant_q8_0(const uint8_t* row, int64_t blocks, float* out) {
    for (int64_t b = 0; b < blocks; ++b, row += 34, out += kBlock) {
        __m256 d = _mm256_set1_ps(half_to_float(row));
        for (int g = 0; g < 4; ++g) {
            __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 2 + 8 * g));
            _mm256_storeu_ps(out + 8 * g, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)), d));
        }
    }
}

inline float lane_sum(__m256 acc) {  // one fixed order for every output
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// R input rows x C weight rows of the tile; every accumulator sees the same k order.
template <int R, int C>
inline void dots(const float* const* x, const float* w, int64_t k_len, float* const* y) {
    __m256 acc[R][C];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < k_len; k += 8) {
        __m256 xv[R];
        for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x[r] + k);
        for (int c = 0; c < C; ++c) {
            __m256 wv = _mm256_loadu_ps(w + c * k_len + k);
            for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(xv[r], wv, acc[r][c]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) y[r][c] = lane_sum(acc[r][c]);
}

#endif

template <int R, int C>
inline void rows_at(const float* x, int64_t i, int64_t k_len, const float* w, float* y, int64_t ldy) {
    const float* xs[R];
    float* ys[R];
    for (int r = 0; r < R; ++r) xs[r] = x + (i + r) * k_len, ys[r] = y + (i + r) * ldy;
    dots<R, C>(xs, w, k_len, ys);
}

template <int C>
void tile_rows(const float* x, int64_t rows, int64_t k_len, const float* w, float* y, int64_t ldy) {
    int64_t i = 0;
    for (; i + kRowGroup <= rows; i += kRowGroup) rows_at<kRowGroup, C>(x, i, k_len, w, y, ldy);
    for (; i + 2 <= rows; i += 2) rows_at<2, C>(x, i, k_len, w, y, ldy);
    if (i < rows) rows_at<1, C>(x, i, k_len, w, y, ldy);
}

}  // namespace

torch::Tensor gguf_linear(torch::Tensor x, torch::Tensor blocks, int64_t qtype) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be [rows, in] float32");
    TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == torch::kUInt8 && blocks.is_contiguous(),
                "blocks must be [out, row bytes] uint8, contiguous");
    TORCH_CHECK(qtype == kQ4_1 || qtype == kQ8_0, "unsupported GGUF block type ", qtype);
    x = x.contiguous();
    const int64_t rows = x.size(0), k_len = x.size(1), n_out = blocks.size(0);
    const int64_t block_bytes = qtype == kQ4_1 ? 20 : 34, n_blocks = k_len / kBlock;
    TORCH_CHECK(k_len % kBlock == 0 && blocks.size(1) == n_blocks * block_bytes,
                "blocks do not hold ", k_len, " inputs per row");
    auto y = torch::empty({rows, n_out}, x.options());
    const float* xp = x.data_ptr<float>();
    const uint8_t* wp = blocks.data_ptr<uint8_t>();
    float* yp = y.data_ptr<float>();
    const int64_t tiles = (n_out + kTile - 1) / kTile;
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> w(kTile * k_len);
        for (int64_t t = begin; t < end; ++t) {
            const int64_t n0 = t * kTile, cols = std::min(kTile, n_out - n0);
            for (int64_t c = 0; c < cols; ++c) {
                const uint8_t* row = wp + (n0 + c) * n_blocks * block_bytes;
                if (qtype == kQ4_1) dequant_q4_1(row, n_blocks, w.data() + c * k_len);
                else dequant_q8_0(row, n_blocks, w.data() + c * k_len);
            }
            if (cols == kTile) tile_rows<4>(xp, rows, k_len, w.data(), yp + n0, n_out);
            else
                for (int64_t c = 0; c < cols; ++c) tile_rows<1>(xp, rows, k_len, w.data() + c * k_len, yp + n0 + c, n_out);
        }
    });
    return y;
}

torch::Tensor gguf_dequantize(torch::Tensor blocks, int64_t qtype, int64_t k_len) {
    TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == torch::kUInt8 && blocks.is_contiguous(),
                "blocks must be [out, row bytes] uint8, contiguous");
    TORCH_CHECK(qtype == kQ4_1 || qtype == kQ8_0, "unsupported GGUF block type ", qtype);
    TORCH_CHECK(k_len % kBlock == 0, "in features must be a multiple of 32");
    auto out = torch::empty({blocks.size(0), k_len}, torch::kFloat32);
    for (int64_t n = 0; n < blocks.size(0); ++n) {
        const uint8_t* row = blocks.data_ptr<uint8_t>() + n * blocks.size(1);
        if (qtype == kQ4_1) dequant_q4_1(row, k_len / kBlock, out.data_ptr<float>() + n * k_len);
        else dequant_q8_0(row, k_len / kBlock, out.data_ptr<float>() + n * k_len);
    }
    return out;
}

#else  // no AVX2: precision.py does not offer the gguf precision here

torch::Tensor gguf_linear(torch::Tensor, torch::Tensor, int64_t) {
    TORCH_CHECK(false, "the gguf matmul needs AVX2");
}
torch::Tensor gguf_dequantize(torch::Tensor, int64_t, int64_t) {
    TORCH_CHECK(false, "the gguf matmul needs AVX2");
}

#endif

void register_gguf_matmul(pybind11::module& m) {
    m.def("gguf_linear", &gguf_linear, kReleaseGil, "x W^T with W in GGUF Q4_1 / Q8_0 blocks, batch-invariant fp32 math");
    m.def("gguf_dequantize", &gguf_dequantize, kReleaseGil, "the fp32 weights the blocks hold (what gguf_linear multiplies by)");
}
