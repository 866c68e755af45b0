// y = x W^T + b with W int8 per output channel and each row of x quantized to int8 on its own scale,
// for a few rows at a time (decoding, verification, drafting): AVX-512 VNNI.
//
// Why by hand: FBGEMM's dynamic int8 linear reads the weights once for a decode step, but above a few
// rows it runs out of compute before memory (measured on a Zen 4: all of SmolLM2's linears, weights
// from DRAM, 11.2 ms at 1 row, 20.0 at 8, 58.9 at 32), so a verification pass of 8 rows cost 1.6x a
// decode step. Here one 64-byte weight load feeds a VPDPBUSD for every row of the call (up to 8 rows,
// 16 outputs x 4 inputs each), so the weights stream from memory once a call: the same linears 5.5 ms
// at 1 row, 11.0 at 8, 34.1 at 32 (docs/results.md, session 20).
//
// Layout: weights as unsigned bytes w + 128 in blocks of 16 outputs, 4 inputs innermost
// ([N / 16][K / 4][16][4]), the operand VPDPBUSD takes as unsigned; a row's int8 activations are the
// signed operand, 4 at a time broadcast from memory. sum((w + 128) q) - 128 sum(q) = sum(w q), exact.
//
// Batch invariance, which speculative verification needs: a row's int8 values and scale depend on
// that row alone, its integer sums are exact whatever the rows around it, and the epilogue
// (int -> float, times row scale times channel scale, plus bias) is the same few ops for every
// element; work is split across threads by output block only. A verified row gets the bits decoding
// it alone would have given.
//
// On CPUs with AMX-INT8, calls of kAmxMinRows rows or more run their integer sums on the tile unit
// (TDPBSUD: the signed activations times the same unsigned weight blocks, whose [K / 4][16][4] layout
// is the tile operand as it is): the same exact int32 sums, the same epilogue, so the same bits as the
// VNNI path, one weight load per 16 rows instead of per 8, and 16 x 16 x 64 products a
// multiply instead of 16 x 4.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "release_gil.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include <sys/syscall.h>
#include <unistd.h>
#define DSPARK_AMX 1
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>

namespace {

constexpr int64_t kOut = 16;   // outputs a block (one zmm of int32 sums)
constexpr int kMaxRows = 8;    // rows a pass over a weight tile: 8 x 2 sums + 2 weights + 1 broadcast registers
// Prefetch each weight stream 1 KB ahead into L1: all linears of SmolLM2 from DRAM, Zen 4, 2 threads,
// 8 rows 9.0 ms against 9.8 without (1 row 5.4 either way; 256 B and 4 KB ahead no better). And 4 KB
// ahead into L2, which keeps more lines in flight while 8 rows compute: 8 rows 5.84 -> 5.19 ms, 1 row
// 4.74 -> 4.45 (session 22, with the in-place accumulation below: 5.09 / 4.50).
constexpr int64_t kPrefetchBytes = 1024;
constexpr int64_t kPrefetchL2Bytes = 4096;
constexpr int kTileBlocks = 2;  // a tile's blocks (rows_of_tile<1> takes the odd last one)
constexpr int64_t kArgmaxTiles = 16;  // tiles int8_linear_argmax computes before it scans them

// Each row: q = round(x * 127 / max|x|) (nearest even) in [-127, 127], scale max|x| / 127, and
// 128 * sum(q), the offset the unsigned weights add. With x_scale, x is first multiplied by it, input
// by input (SmoothQuant: the weights were packed times 1 / x_scale, so the product is unchanged and a
// few outlier inputs no longer take most of a row's 8 bits).
struct Int8Rows {
    std::vector<int8_t> q;  // [rows][k_pad], zeros past k_len
    std::vector<float> scale;
    std::vector<int32_t> offset;

    // pad_rows >= rows: rows of zeros after the last (a tile unit reads whole tiles of 16 rows).
    // Rows are independent: a prefill's are shared out between the threads (the same bits on any number).
    Int8Rows(const float* x, const float* x_scale, int64_t rows, int64_t k_len, int64_t k_pad, int64_t pad_rows = 0)
        : q(std::max(rows, pad_rows) * k_pad, 0), scale(rows), offset(rows) {
        at::parallel_for(0, rows, kQuantizeGrain, [&](int64_t begin, int64_t end) {
            for (int64_t r = begin; r < end; ++r) {
                if (x_scale != nullptr) quantize_row<true>(x + r * k_len, x_scale, k_len, k_pad, r);
                else quantize_row<false>(x + r * k_len, nullptr, k_len, k_pad, r);
            }
        });
    }

private:
    static constexpr int64_t kQuantizeGrain = 128;  // rows a thread takes at least: fewer are not worth a hand-off

    // Inputs k..k+15 (input16) or k alone (input1) as quantized: times x_scale when there is one.
    template <bool Scaled>
    static inline __m512 input16(const float* v, const float* x_scale, int64_t k) {
        const __m512 value = _mm512_loadu_ps(v + k);
        if constexpr (Scaled) return _mm512_mul_ps(value, _mm512_loadu_ps(x_scale + k));
        return value;
    }

    template <bool Scaled>
    static inline float input1(const float* v, const float* x_scale, int64_t k) {
        if constexpr (Scaled) return v[k] * x_scale[k];
        return v[k];
    }

    template <bool Scaled>
    void quantize_row(const float* v, const float* x_scale, int64_t k_len, int64_t k_pad, int64_t r) {
        const __m512 sign_bit = _mm512_set1_ps(-0.f);
        __m512 amax = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k + 16 <= k_len; k += 16) amax = _mm512_max_ps(amax, _mm512_andnot_ps(sign_bit, input16<Scaled>(v, x_scale, k)));
        float top = _mm512_reduce_max_ps(amax);
        for (; k < k_len; ++k) top = std::max(top, std::abs(input1<Scaled>(v, x_scale, k)));
        const float inv = top > 0.f ? 127.f / top : 0.f;
        const __m512 inv16 = _mm512_set1_ps(inv);
        __m512i sum = _mm512_setzero_si512();
        int32_t tail_sum = 0;
        int8_t* out = q.data() + r * k_pad;
        for (k = 0; k + 16 <= k_len; k += 16) {
            const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(input16<Scaled>(v, x_scale, k), inv16));  // MXCSR: nearest even
            sum = _mm512_add_epi32(sum, qi);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k), _mm512_cvtsepi32_epi8(qi));
        }
        for (; k < k_len; ++k) {
            const int32_t qi = static_cast<int32_t>(std::nearbyint(input1<Scaled>(v, x_scale, k) * inv));
            out[k] = static_cast<int8_t>(std::min(127, std::max(-127, qi)));
            tail_sum += out[k];
        }
        scale[r] = top / 127.f;
        offset[r] = 128 * (_mm512_reduce_add_epi32(sum) + tail_sum);
    }
};

// acc += the 4-byte dot products of w (unsigned) and x (signed) in every lane, in place. Written out
// because GCC, given the intrinsic in the unrolled 8 x 2 tile, copied all 16 sums to other registers
// (and two through the stack) every step: 8 rows with the weights in cache took 3.1 ms where this
// takes 2.8-3.1, 16 rows 6.1-6.8 -> 5.4-5.6 (all of SmolLM2's linears, Zen 4, 2 threads).
inline __m512i dot_bytes(__m512i acc, __m512i w, __m512i x) {
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
    return acc;
}

// One row's 16 integer sums of block b (of `blocks`; the last has `valid` outputs) to floats in the
// row's outputs y_row: the only float math, the same for every path and row count. One explicit FMA
// (bias or zero), so the compiler has no mul + add to contract in some instantiations and not others.
inline void epilogue(const Int8Rows& x, int64_t row, int b, int blocks, int valid, __m512i sums,
                     const float* w_scale, const float* bias, float* y_row) {
    const int outputs = b + 1 < blocks ? int(kOut) : valid;
    const __mmask16 keep = outputs == kOut ? __mmask16(0xFFFF) : __mmask16((1u << outputs) - 1);
    const __m512 values = _mm512_cvtepi32_ps(_mm512_sub_epi32(sums, _mm512_set1_epi32(x.offset[row])));
    const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(x.scale[row]), _mm512_maskz_loadu_ps(keep, w_scale + b * kOut));
    const __m512 add = bias != nullptr ? _mm512_maskz_loadu_ps(keep, bias + b * kOut) : _mm512_setzero_ps();
    _mm512_mask_storeu_ps(y_row + b * kOut, keep, _mm512_fmadd_ps(values, scale, add));
}

// R rows x B blocks of outputs: every weight vector is loaded once and used by all R rows.
// `valid`: outputs of the last block that exist (the packed weights pad the output count to 16).
template <int R, int B>
inline void tile(const Int8Rows& x, int64_t row0, int64_t k_len, const uint8_t* w, int64_t block_bytes,
                 const float* w_scale, const float* bias, float* y, int64_t n_out, int valid) {
    // A flat array of sums and every loop fully unrolled keep the 8 x 2 sums in registers (8 x 3 sums,
    // 24 of the 32 registers, made GCC spill sums to the stack every step).
    __m512i acc[R * B];
#pragma GCC unroll 32
    for (int i = 0; i < R * B; ++i) acc[i] = _mm512_setzero_si512();
    const int8_t* xq = x.q.data() + row0 * k_len;
    for (int64_t k = 0; k < k_len; k += 4) {
        __m512i wv[B];
#pragma GCC unroll 4
        for (int b = 0; b < B; ++b) wv[b] = _mm512_loadu_si512(w + b * block_bytes + k * kOut);
#pragma GCC unroll 4
        for (int b = 0; b < B; ++b) {
            _mm_prefetch(reinterpret_cast<const char*>(w + b * block_bytes + k * kOut + kPrefetchBytes), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(w + b * block_bytes + k * kOut + kPrefetchL2Bytes), _MM_HINT_T1);
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const __m512i xb = _mm512_broadcastd_epi32(_mm_loadu_si32(xq + r * k_len + k));
#pragma GCC unroll 4
            for (int b = 0; b < B; ++b) acc[r * B + b] = dot_bytes(acc[r * B + b], wv[b], xb);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int b = 0; b < B; ++b)
            epilogue(x, row0 + r, b, B, valid, acc[r * B + b], w_scale, bias, y + (row0 + r) * n_out);
}

template <int B>
void rows_of_tile(const Int8Rows& x, int64_t rows, int64_t k_len, const uint8_t* w, int64_t block_bytes,
                  const float* w_scale, const float* bias, float* y, int64_t n_out, int valid) {
    int64_t r = 0;
    for (; r + kMaxRows <= rows; r += kMaxRows) tile<kMaxRows, B>(x, r, k_len, w, block_bytes, w_scale, bias, y, n_out, valid);
    switch (rows - r) {
        case 7: tile<7, B>(x, r, k_len, w, block_bytes, w_scale, bias, y, n_out, valid); break;
        case 6: tile<6, B>(x, r, k_len, w, block_bytes, w_scale, bias, y, n_out, valid); break;
        case 5: tile<5, B>(x, r, k_len, w, block_bytes, w_scale, bias, y, n_out, valid); break;
        case 4: tile<4, B>(x, r, k_len, w, block_bytes, w_scale, bias, y, n_out, valid); break;
        case 3: tile<3, B>(x, r, k_len, w, block_bytes, w_scale, bias, y, n_out, valid); break;
        case 2: tile<2, B>(x, r, k_len, w, block_bytes, w_scale, bias, y, n_out, valid); break;
        case 1: tile<1, B>(x, r, k_len, w, block_bytes, w_scale, bias, y, n_out, valid); break;
        default: break;
    }
}

#ifdef DSPARK_AMX
constexpr int64_t kAmxRows = 16;     // rows of a tile (activations, sums)
constexpr int64_t kAmxDepth = 64;    // input bytes a tile multiply takes
constexpr int64_t kAmxMinRows = 8;  // fewer rows stay on VNNI (measured: see docs/results.md, sessions 29 and 31)
// Weights streamed from memory: each block's next 4 KB requested while the tiles multiply (without it
// the tiles lost to VNNI below ~12 rows; docs/results.md, session 31).
constexpr int64_t kAmxPrefetch = 4 * kAmxDepth;

std::atomic<bool> amx_allowed{true};  // int8_use_amx(False): every call on VNNI (tests, benchmarks)

// Linux hands a process the tile registers' state only once it asks (arch_prctl, kernel 5.16+).
bool amx_granted() {
    static const bool granted = [] {
        constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
        return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
    }();
    return granted;
}

// Palette 1, all eight tiles 16 rows x 64 bytes: sums (16 x 16 int32), activations (16 rows x 64
// inputs), weights (16 groups of 4 inputs x 16 outputs x 4).
struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
    TileConfig() {
        for (int t = 0; t < 8; ++t) colsb[t] = 64, rows[t] = 16;
    }
};

// Tiles: sums 0-1 (one a block), activations 4, weights 6-7: 16 rows x B blocks a call. Two row tiles a
// call (all eight tile registers busy) ran 1.5x slower a row on an AMX Xeon than two calls of one
// (docs/results.md, session 31): the weights' second read comes from L1.
template <int B>
void amx_tile(const Int8Rows& x, int64_t row0, int64_t rows, int64_t k_pad, const uint8_t* w, int64_t block_bytes,
              const float* w_scale, const float* bias, float* y, int64_t n_out, int valid) {
    _tile_zero(0);
    if (B > 1) _tile_zero(1);
    const int8_t* xq = x.q.data() + row0 * k_pad;
    for (int64_t k = 0; k < k_pad; k += kAmxDepth) {
        if (k + kAmxPrefetch < k_pad)
            for (int b = 0; b < B; ++b)
                for (int64_t line = 0; line < kAmxDepth * kOut; line += 64)
                    _mm_prefetch(reinterpret_cast<const char*>(w + b * block_bytes + (k + kAmxPrefetch) * kOut) + line,
                                 _MM_HINT_T0);
        _tile_loadd(4, xq + k, k_pad);
        _tile_loadd(6, w + k * kOut, 64);
        if (B > 1) _tile_loadd(7, w + block_bytes + k * kOut, 64);
        _tile_dpbsud(0, 4, 6);
        if (B > 1) _tile_dpbsud(1, 4, 7);
    }
    alignas(64) int32_t sums[B][kAmxRows][kOut];
    _tile_stored(0, sums[0], 64);
    if (B > 1) _tile_stored(1, sums[B - 1], 64);
    for (int64_t r = 0; r < std::min<int64_t>(rows, kAmxRows); ++r)
        for (int b = 0; b < B; ++b)
            epilogue(x, row0 + r, b, B, valid, _mm512_load_si512(sums[b][r]), w_scale, bias, y + (row0 + r) * n_out);
}

template <int B>
void amx_rows(const Int8Rows& x, int64_t rows, int64_t k_pad, const uint8_t* w, int64_t block_bytes,
              const float* w_scale, const float* bias, float* y, int64_t n_out, int valid) {
    for (int64_t r = 0; r < rows; r += kAmxRows)
        amx_tile<B>(x, r, rows - r, k_pad, w, block_bytes, w_scale, bias, y, n_out, valid);
}
#endif

// What both entry points check and derive from their arguments, and one tile of outputs.
// x [rows, in] float32; packed [ceil(out / 16)][ceil(in / 4)][16][4] uint8 (w + 128, zero weights in the
// padding); w_scale [out]; bias [out] or none.
struct Int8Call {
    torch::Tensor x;
    int64_t rows, k_len, k_pad, blocks, n_out, block_bytes, tiles;
    int last_valid;
    const uint8_t* w;
    const float* w_scale;
    const float* bias = nullptr;
    const float* x_scale = nullptr;

    Int8Call(const torch::Tensor& x_in, const torch::Tensor& packed, const torch::Tensor& scale,
             const c10::optional<torch::Tensor>& b, const c10::optional<torch::Tensor>& x_sc) {
        TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == torch::kFloat32, "x must be [rows, in] float32");
        TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
                    packed.size(2) == kOut && packed.size(3) == 4, "packed must be [out / 16, in / 4, 16, 4] uint8");
        x = x_in.contiguous();
        rows = x.size(0), k_len = x.size(1), k_pad = packed.size(1) * 4, blocks = packed.size(0);
        n_out = scale.numel();
        TORCH_CHECK(k_pad >= k_len && k_pad < k_len + 4, "packed weights take ", k_pad, " inputs, x has ", k_len);
        TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() && n_out <= blocks * kOut &&
                    n_out > (blocks - 1) * kOut, "w_scale must be [out] float32 for the packed blocks");
        if (b.has_value()) {
            TORCH_CHECK(b->scalar_type() == torch::kFloat32 && b->is_contiguous() && b->numel() == n_out,
                        "bias must be [out] float32");
            bias = b->data_ptr<float>();
        }
        if (x_sc.has_value()) {
            TORCH_CHECK(x_sc->scalar_type() == torch::kFloat32 && x_sc->is_contiguous() && x_sc->numel() == k_len,
                        "x_scale must be [in] float32");
            x_scale = x_sc->data_ptr<float>();
        }
        w = packed.data_ptr<uint8_t>();
        w_scale = scale.data_ptr<float>();
        block_bytes = k_pad * kOut, tiles = (blocks + kTileBlocks - 1) / kTileBlocks;
        last_valid = static_cast<int>(n_out - (blocks - 1) * kOut);
#ifdef DSPARK_AMX
        amx = rows >= kAmxMinRows && k_pad % kAmxDepth == 0 && amx_allowed.load() && amx_granted();
#endif
    }

    bool amx = false;  // the sums on the tile unit (same bits)

    // The rows quantized, padded to whole tiles where the tile unit reads them.
    Int8Rows quantized() const {
        int64_t pad = 0;
#ifdef DSPARK_AMX
        if (amx) pad = (rows + kAmxRows - 1) / kAmxRows * kAmxRows;  // amx_tile reads whole 16-row tiles
#endif
        return Int8Rows(x.data_ptr<float>(), x_scale, rows, k_len, k_pad, pad);
    }

    // Each thread loads its tile configuration before its first tile and releases it after.
    template <typename F>
    void with_tiles(F&& run) const {
#ifdef DSPARK_AMX
        if (amx) {
            const TileConfig config;
            _tile_loadconfig(&config);
            run();
            _tile_release();
            return;
        }
#endif
        run();
    }

    // Tile t's outputs (kTileBlocks blocks, fewer at the end) of every row into y, rows `stride` apart,
    // the tile's first output at y; returns (its first output, how many it has).
    std::pair<int64_t, int64_t> tile(const Int8Rows& xq, int64_t t, float* y, int64_t stride) const {
        const int64_t b0 = t * kTileBlocks, nb = std::min<int64_t>(kTileBlocks, blocks - b0);
        const int valid = b0 + nb == blocks ? last_valid : static_cast<int>(kOut);
        const uint8_t* wt = w + b0 * block_bytes;
        const float* bt = bias == nullptr ? nullptr : bias + b0 * kOut;
#ifdef DSPARK_AMX
        if (amx) {
            if (nb == kTileBlocks) amx_rows<kTileBlocks>(xq, rows, k_pad, wt, block_bytes, w_scale + b0 * kOut, bt, y, stride, valid);
            else amx_rows<1>(xq, rows, k_pad, wt, block_bytes, w_scale + b0 * kOut, bt, y, stride, valid);
            return {b0 * kOut, (nb - 1) * kOut + valid};
        }
#endif
        if (nb == kTileBlocks) rows_of_tile<kTileBlocks>(xq, rows, k_pad, wt, block_bytes, w_scale + b0 * kOut, bt, y, stride, valid);
        else rows_of_tile<1>(xq, rows, k_pad, wt, block_bytes, w_scale + b0 * kOut, bt, y, stride, valid);
        return {b0 * kOut, (nb - 1) * kOut + valid};
    }
};

}  // namespace

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor w_scale, c10::optional<torch::Tensor> bias,
                          c10::optional<torch::Tensor> x_scale) {
    const Int8Call call(x, packed, w_scale, bias, x_scale);
    auto y = torch::empty({call.rows, call.n_out}, call.x.options());
    if (call.rows == 0) return y;
    const Int8Rows xq = call.quantized();
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, call.tiles, 1, [&](int64_t begin, int64_t end) {
        call.with_tiles([&] {
            for (int64_t t = begin; t < end; ++t) call.tile(xq, t, yp + t * kTileBlocks * kOut, call.n_out);
        });
    });
    return y;
}

// Folds outputs y[0 .. n) (output indices first ..) into 16 lanes of (largest value, its first index):
// strictly larger only, and a lane's indices ascend, so it keeps its first maximum. Two accumulators
// take alternate vectors (not one dependent compare-and-move after another) and merge as (largest,
// then smallest index): the same result as one. nan: set where an output is NaN.
inline void scan_argmax(const float* y, int64_t n, int64_t first, float* best_v, int32_t* best_i, uint8_t& nan) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 bv[2] = {_mm512_loadu_ps(best_v), _mm512_set1_ps(-INFINITY)};
    __m512i bi[2] = {_mm512_loadu_si512(best_i), _mm512_set1_epi32(INT32_MAX)};
    __mmask16 unordered = 0;
    int64_t o = 0;
    for (; o + 2 * kOut <= n; o += 2 * kOut)
        for (int a = 0; a < 2; ++a) {
            const __m512 v = _mm512_loadu_ps(y + o + a * kOut);
            unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            const __mmask16 more = _mm512_cmp_ps_mask(v, bv[a], _CMP_GT_OQ);
            bv[a] = _mm512_mask_mov_ps(bv[a], more, v);
            bi[a] = _mm512_mask_mov_epi32(bi[a], more, _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(first + o + a * kOut)), lane));
        }
    for (; o < n; o += kOut) {
        const __mmask16 keep = n - o >= kOut ? __mmask16(0xFFFF) : __mmask16((1u << (n - o)) - 1);
        const __m512 v = _mm512_maskz_loadu_ps(keep, y + o);
        unordered |= _mm512_mask_cmp_ps_mask(keep, v, v, _CMP_UNORD_Q);
        const __mmask16 more = _mm512_mask_cmp_ps_mask(keep, v, bv[0], _CMP_GT_OQ);
        bv[0] = _mm512_mask_mov_ps(bv[0], more, v);
        bi[0] = _mm512_mask_mov_epi32(bi[0], more, _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(first + o)), lane));
    }
    const __mmask16 take = _mm512_cmp_ps_mask(bv[1], bv[0], _CMP_GT_OQ) |
                           (_mm512_cmp_ps_mask(bv[1], bv[0], _CMP_EQ_OQ) & _mm512_cmp_epi32_mask(bi[1], bi[0], _MM_CMPINT_LT));
    _mm512_storeu_ps(best_v, _mm512_mask_mov_ps(bv[0], take, bv[1]));
    _mm512_storeu_si512(best_i, _mm512_mask_mov_epi32(bi[0], take, bi[1]));
    if (unordered) nan = 1;
}

// argmax over the outputs of int8_linear(x, ...) for each row, without writing them: the LM head of
// a greedy step, where only the argmax is wanted (8 rows x 49,152 floats written and then scanned by
// torch.argmax were 0.35 ms beside the head's 0.89, Zen 4). Each output is the value int8_linear gives
// (the same tile and epilogue, into a small buffer); every lane keeps its largest value and, on ties,
// its first index, and lanes and threads merge as (largest value, smallest index), so the result is
// torch.argmax's in any split. A row with a NaN output comes back as -1 (the caller takes torch's
// argmax of its logits, which NaN orders first).
torch::Tensor int8_linear_argmax(torch::Tensor x, torch::Tensor packed, torch::Tensor w_scale,
                                 c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> x_scale) {
    const Int8Call call(x, packed, w_scale, bias, x_scale);
    TORCH_CHECK(call.n_out > 0, "no outputs to take the argmax of");
    const int64_t rows = call.rows;
    auto out = torch::empty({rows}, call.x.options().dtype(torch::kLong));
    if (rows == 0) return out;
    const Int8Rows xq = call.quantized();
    constexpr int64_t width = kTileBlocks * kOut;  // outputs a tile
    const int threads = at::get_num_threads();
    // Per thread and row: 16 lanes of (largest value, its first index), and whether a NaN was seen.
    std::vector<float> lane_value(threads * rows * kOut, -INFINITY);
    std::vector<int32_t> lane_index(threads * rows * kOut, INT32_MAX);
    std::vector<uint8_t> nan_seen(threads * rows, 0);
    at::parallel_for(0, call.tiles, 1, [&](int64_t begin, int64_t end) {
        const int me = at::get_thread_num();
        // kArgmaxTiles tiles into the buffer, then each row's outputs scanned at once: a scan after every
        // tile (32 outputs) reloaded the row's lanes and waited on the last compare (16 rows: the head's
        // argmax 1.21 ms against 0.79 for its outputs alone, AMX Xeon, session 43).
        std::vector<float> y(rows * kArgmaxTiles * width);
        const int64_t stride = kArgmaxTiles * width;
        call.with_tiles([&] {
            for (int64_t c0 = begin; c0 < end; c0 += kArgmaxTiles) {
                const int64_t c1 = std::min<int64_t>(end, c0 + kArgmaxTiles);
                const int64_t first = c0 * width;  // tiles are consecutive runs of outputs
                int64_t outputs = 0;
                for (int64_t t = c0; t < c1; ++t) {
                    const auto [tile_first, tile_outputs] = call.tile(xq, t, y.data() + (t - c0) * width, stride);
                    outputs = tile_first + tile_outputs - first;
                }
                for (int64_t r = 0; r < rows; ++r)
                    scan_argmax(y.data() + r * stride, outputs, first, lane_value.data() + (me * rows + r) * kOut,
                                lane_index.data() + (me * rows + r) * kOut, nan_seen[me * rows + r]);
            }
        });
    });
    int64_t* o = out.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r) {
        float top = -INFINITY;
        int64_t arg = INT32_MAX;
        bool nan = false;
        for (int th = 0; th < threads; ++th) {
            nan = nan || nan_seen[th * rows + r];
            for (int64_t l = 0; l < kOut; ++l) {
                const float v = lane_value[(th * rows + r) * kOut + l];
                const int64_t i = lane_index[(th * rows + r) * kOut + l];
                if (v > top || (v == top && i < arg)) top = v, arg = i;
            }
        }
        // Every output -inf: torch.argmax gives the first, index 0.
        o[r] = nan ? -1 : (arg == INT32_MAX ? 0 : arg);
    }
    return out;
}

bool has_int8_linear() { return true; }

#ifdef DSPARK_AMX
bool has_int8_amx() { return amx_granted(); }
bool int8_use_amx(bool on) { return amx_allowed.exchange(on); }
#else
bool has_int8_amx() { return false; }
bool int8_use_amx(bool) { return false; }
#endif

#else  // no AVX-512 VNNI: Int8Linear stays on FBGEMM

torch::Tensor int8_linear(torch::Tensor, torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>,
                          c10::optional<torch::Tensor>) {
    TORCH_CHECK(false, "the int8 matmul needs AVX-512 F, BW and VNNI");
}

torch::Tensor int8_linear_argmax(torch::Tensor, torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>,
                                 c10::optional<torch::Tensor>) {
    TORCH_CHECK(false, "the int8 matmul needs AVX-512 F, BW and VNNI");
}

bool has_int8_linear() { return false; }
bool has_int8_amx() { return false; }
bool int8_use_amx(bool) { return false; }

#endif

void register_int8_matmul(pybind11::module& m) {
    m.def("int8_linear", &int8_linear, kReleaseGil, pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("w_scale"),
          pybind11::arg("bias"), pybind11::arg("x_scale") = pybind11::none(),
          "x W^T + b, W packed int8 per channel, x (times x_scale) int8 per row, AVX-512 VNNI, batch-invariant");
    m.def("int8_linear_argmax", &int8_linear_argmax, kReleaseGil, pybind11::arg("x"), pybind11::arg("packed"),
          pybind11::arg("w_scale"), pybind11::arg("bias"), pybind11::arg("x_scale") = pybind11::none(),
          "argmax over the outputs of int8_linear, row by row, without writing them (a greedy LM head)");
    m.def("has_int8_linear", &has_int8_linear, "whether int8_linear was built for this CPU");
    m.def("has_int8_amx", &has_int8_amx, "whether int8_linear runs calls of several rows on AMX tiles here");
    m.def("int8_use_amx", &int8_use_amx, "allow AMX tiles (True, the default) or keep every call on VNNI; returns "
          "the previous setting");
}
