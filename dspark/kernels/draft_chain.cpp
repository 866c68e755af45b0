// DSpark's greedy Markov chain over a drafted block in one call: x_k = argmax(U_k + B_k), B_1 the first
// slot's bias (W2 W1[anchor]), B_k = table[x_{k-1}] after it (the bias after every draft token, bf16).
//
// Why by hand: in torch each slot is a row lookup, an add and an argmax, ~10 us of dispatch apiece
// for ~8,000 additions, and the slots are sequential: 7 slots were ~0.25 ms of a ~1.2 ms draft.
// Same result as the torch ops: fp32 + bf16 adds in fp32 (bf16 widens exactly), the argmax is the
// first index of the maximum, or of the first NaN where there is one (torch.argmax's rule).
#include <torch/extension.h>

#include "release_gil.h"

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

#ifdef __AVX512F__
#include <immintrin.h>

inline __m512 widen16(const float* p, __mmask16 keep) { return _mm512_maskz_loadu_ps(keep, p); }
inline __m512 widen16(const c10::BFloat16* p, __mmask16 keep) {  // bf16 -> fp32 is a 16-bit shift: exact
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, p)), 16));
}
#endif

// Index of the maximum of u + b over v entries (b bf16 or fp32), torch.argmax's choice: the first
// index of the maximum, or of the first NaN where there is one. With AVX-512 sixteen lanes keep their
// largest sum and its first index (strictly larger only) and merge as (largest, then smallest index),
// the same index as the scalar scans below (which a NaN falls back to); those were ~20 us a slot over
// 8,192 entries, most of a 3-request greedy chain's 0.42 ms (AMX Xeon, session 43).
template <typename B>
int64_t argmax_sum(const float* u, const B* b, int64_t v, float* scratch) {
#ifdef __AVX512F__
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 best = _mm512_set1_ps(-INFINITY);
    __m512i index = _mm512_set1_epi32(INT32_MAX);
    __mmask16 unordered = 0;
    for (int64_t i = 0; i < v; i += 16) {
        const __mmask16 keep = v - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (v - i)) - 1);
        const __m512 s = _mm512_add_ps(widen16(u + i, keep), widen16(b + i, keep));
        unordered |= _mm512_mask_cmp_ps_mask(keep, s, s, _CMP_UNORD_Q);
        const __mmask16 more = _mm512_mask_cmp_ps_mask(keep, s, best, _CMP_GT_OQ);
        best = _mm512_mask_mov_ps(best, more, s);
        index = _mm512_mask_mov_epi32(index, more, _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(i)), lane));
    }
    if (!unordered) {
        alignas(64) float values[16];
        alignas(64) int32_t indices[16];
        _mm512_store_ps(values, best);
        _mm512_store_si512(indices, index);
        float top = -INFINITY;
        int64_t arg = INT32_MAX;
        for (int l = 0; l < 16; ++l)
            if (values[l] > top || (values[l] == top && indices[l] < arg)) top = values[l], arg = indices[l];
        return arg == INT32_MAX ? 0 : arg;  // every sum -inf: no lane took one, torch.argmax gives index 0
    }
#endif
    for (int64_t i = 0; i < v; ++i) scratch[i] = u[i] + static_cast<float>(b[i]);
    float best_value = scratch[0];
    for (int64_t i = 1; i < v; ++i) best_value = scratch[i] > best_value ? scratch[i] : best_value;
    for (int64_t i = 0; i < v; ++i)
        if (std::isnan(scratch[i])) return i;
    for (int64_t i = 0; i < v; ++i)
        if (scratch[i] == best_value) return i;
    return 0;
}

}  // namespace

// base [R, g, V] float32 (U_k of slots 1..g); first [R, V] float32 (B_1); table [V, V] bfloat16
// (row i: the bias after draft token i). Returns [R, g] int64 draft-vocabulary indices.
torch::Tensor markov_greedy_chain(torch::Tensor base, torch::Tensor first, torch::Tensor table) {
    TORCH_CHECK(base.dim() == 3 && base.scalar_type() == torch::kFloat32, "base must be [R, g, V] float32");
    const int64_t rows = base.size(0), slots = base.size(1), v = base.size(2);
    TORCH_CHECK(v > 0 && slots > 0, "an empty block");
    TORCH_CHECK(first.dim() == 2 && first.size(0) == rows && first.size(1) == v && first.scalar_type() == torch::kFloat32,
                "first must be [R, V] float32");
    TORCH_CHECK(table.dim() == 2 && table.size(0) == v && table.size(1) == v && table.scalar_type() == torch::kBFloat16,
                "table must be [V, V] bfloat16");
    base = base.contiguous();
    first = first.contiguous();
    table = table.contiguous();
    auto picks = torch::empty({rows, slots}, base.options().dtype(torch::kInt64));
    const float* u = base.data_ptr<float>();
    const c10::BFloat16* t = table.data_ptr<c10::BFloat16>();
    int64_t* out = picks.data_ptr<int64_t>();
    std::vector<float> scratch(v);
    for (int64_t r = 0; r < rows; ++r) {
        int64_t prev = argmax_sum(u + r * slots * v, first.data_ptr<float>() + r * v, v, scratch.data());
        out[r * slots] = prev;
        for (int64_t k = 1; k < slots; ++k) {
            prev = argmax_sum(u + (r * slots + k) * v, t + prev * v, v, scratch.data());
            out[r * slots + k] = prev;
        }
    }
    return picks;
}

void register_draft_chain(pybind11::module& m) {
    m.def("markov_greedy_chain", &markov_greedy_chain, kReleaseGil,
          "DSpark's greedy block: x_k = argmax(U_k + B_k), B_1 given, B_k = table[x_{k-1}] (bf16)");
}
