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
#include <tuple>
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

// The confidence head's dot products: a few hundred terms a slot, summed in order.
float dot(const float* a, const float* b, int64_t n) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
    return sum;
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

// The whole greedy block of a Markov-head DSpark after its LM head, in one call: the chain above, then
// each slot's confidence logit z_k = (w_h . h_k + b) + w_p . W1[x_{k-1}] (W1 of the anchor given as
// prev_rows, of draft token i as token_rows[i]), the tokens as target ids (draft_vocab) and the greedy
// support: the token with probability 1, padded with draft id 0. In torch these were ~14 ops after the
// chain, each several times its warm cost right after a target pass has streamed the caches out
// (docs/results.md, session 46). hidden [R, g, d], prev_rows [R, r], token_rows [V, r], conf_weight
// [d + r] float32 (w_h then w_p): all or none of them (none: no confidence head).
std::tuple<torch::Tensor, c10::optional<torch::Tensor>, torch::Tensor, torch::Tensor> markov_greedy_block(
        torch::Tensor base, torch::Tensor first, torch::Tensor table, torch::Tensor draft_vocab, int64_t support,
        c10::optional<torch::Tensor> hidden, c10::optional<torch::Tensor> prev_rows,
        c10::optional<torch::Tensor> token_rows, c10::optional<torch::Tensor> conf_weight, double conf_bias) {
    torch::Tensor picks = markov_greedy_chain(base, first, table);
    const int64_t rows = picks.size(0), slots = picks.size(1), v = base.size(2);
    TORCH_CHECK(draft_vocab.dim() == 1 && draft_vocab.size(0) == v && draft_vocab.scalar_type() == torch::kInt64,
                "draft_vocab must be [V] int64");
    TORCH_CHECK(support >= 1, "support must be at least 1");
    draft_vocab = draft_vocab.contiguous();
    const int64_t* vocab = draft_vocab.data_ptr<int64_t>();
    const int64_t* pick = picks.data_ptr<int64_t>();
    auto tokens = torch::empty({rows, slots}, picks.options());
    auto support_ids = torch::full({rows, slots, support}, vocab[0], picks.options());
    auto support_probs = torch::zeros({rows, slots, support}, base.options());
    int64_t* token = tokens.data_ptr<int64_t>();
    int64_t* ids = support_ids.data_ptr<int64_t>();
    float* probs = support_probs.data_ptr<float>();
    for (int64_t i = 0; i < rows * slots; ++i) {
        token[i] = vocab[pick[i]];
        ids[i * support] = token[i];
        probs[i * support] = 1.0f;
    }
    c10::optional<torch::Tensor> conf;
    const bool scored = hidden.has_value();
    TORCH_CHECK(scored == prev_rows.has_value() && scored == token_rows.has_value() && scored == conf_weight.has_value(),
                "hidden, prev_rows, token_rows and conf_weight go together");
    if (scored) {
        const auto h = hidden->contiguous(), prev = prev_rows->contiguous(), table_rows = token_rows->contiguous();
        const auto w = conf_weight->contiguous();
        const int64_t d = h.size(-1), r = prev.size(-1);
        TORCH_CHECK(h.dim() == 3 && h.size(0) == rows && h.size(1) == slots && h.scalar_type() == torch::kFloat32,
                    "hidden must be [R, g, d] float32");
        TORCH_CHECK(prev.dim() == 2 && prev.size(0) == rows && prev.scalar_type() == torch::kFloat32,
                    "prev_rows must be [R, r] float32");
        TORCH_CHECK(table_rows.dim() == 2 && table_rows.size(0) == v && table_rows.size(1) == r &&
                    table_rows.scalar_type() == torch::kFloat32, "token_rows must be [V, r] float32");
        TORCH_CHECK(w.dim() == 1 && w.size(0) == d + r && w.scalar_type() == torch::kFloat32,
                    "conf_weight must be [d + r] float32");
        conf = torch::empty({rows, slots}, base.options());
        const float* hs = h.data_ptr<float>();
        const float* ws = w.data_ptr<float>();
        float* z = conf->data_ptr<float>();
        for (int64_t i = 0; i < rows; ++i)
            for (int64_t k = 0; k < slots; ++k) {
                const float* previous = k == 0 ? prev.data_ptr<float>() + i * r
                                               : table_rows.data_ptr<float>() + pick[i * slots + k - 1] * r;
                const float part = dot(hs + (i * slots + k) * d, ws, d) + static_cast<float>(conf_bias);
                z[i * slots + k] = part + dot(previous, ws + d, r);
            }
    }
    return {tokens, conf, support_ids, support_probs};
}

void register_draft_chain(pybind11::module& m) {
    m.def("markov_greedy_chain", &markov_greedy_chain, kReleaseGil,
          "DSpark's greedy block: x_k = argmax(U_k + B_k), B_1 given, B_k = table[x_{k-1}] (bf16)");
    m.def("markov_greedy_block", &markov_greedy_block, kReleaseGil,
          "markov_greedy_chain, then the block's confidence logits, target ids and greedy support",
          pybind11::arg("base"), pybind11::arg("first"), pybind11::arg("table"), pybind11::arg("draft_vocab"),
          pybind11::arg("support"), pybind11::arg("hidden") = pybind11::none(),
          pybind11::arg("prev_rows") = pybind11::none(), pybind11::arg("token_rows") = pybind11::none(),
          pybind11::arg("conf_weight") = pybind11::none(), pybind11::arg("conf_bias") = 0.0);
}
