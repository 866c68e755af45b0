// A decoder's layers in one call on the int8 or gguf-q8 CPU path: the same kernels, in the same
// order, as the Python loop over DecoderLayer.fused_forward, so the same bits.
//
// Why: a decode pass of SmolLM2 is 30 layers of eight kernel calls, and each call from Python paid a
// frame, attribute lookups and pybind's conversion of every tensor argument and result; at one row
// that glue was ~1 ms of a ~7 ms pass (docs/results.md, session 22). Here the weights are taken once
// (add_layer, when the model is put on its kernels) and a pass is one call.
#include <torch/extension.h>
#include <pybind11/stl.h>

#include "release_gil.h"

#include <tuple>
#include <variant>
#include <vector>

// The kernels a layer runs (cpu_kernels.cpp, int8_matmul.cpp).
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor w_scale, c10::optional<torch::Tensor> bias,
                          c10::optional<torch::Tensor> x_scale);
torch::Tensor add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> delta, torch::Tensor weight, double eps,
                           bool bf16_out);
torch::Tensor rope_cache_attention(torch::Tensor qkv, torch::Tensor cos, torch::Tensor signed_sin,
                                   torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                                   torch::Tensor positions, int64_t heads, bool bf16_out,
                                   c10::optional<torch::Tensor> key_counts);
torch::Tensor silu_mul(torch::Tensor gate_up, bool bf16_out);
torch::Tensor gguf_linear_q8_interleaved(torch::Tensor x, torch::Tensor packed, int64_t qtype);  // gguf_q8_matmul.cpp

namespace {

// Int8Linear's kernel arguments: (packed, w_scale, bias, x_scale).
using Int8Args = std::tuple<torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>>;
// GgufLinear's on interleaved blocks: (blocks, qtype, bias).
using GgufArgs = std::tuple<torch::Tensor, int64_t, c10::optional<torch::Tensor>>;

using MatmulArgs = std::variant<Int8Args, GgufArgs>;

struct Matmul {
    MatmulArgs args;
    torch::Tensor operator()(const torch::Tensor& x) const {
        if (const auto* a = std::get_if<Int8Args>(&args))
            return int8_linear(x, std::get<0>(*a), std::get<1>(*a), std::get<2>(*a), std::get<3>(*a));
        const auto& [blocks, qtype, bias] = std::get<GgufArgs>(args);
        torch::Tensor y = gguf_linear_q8_interleaved(x, blocks, qtype);
        return bias ? y.add_(*bias) : y;  // as GgufLinear.forward: y += bias
    }
};

struct Layer {
    torch::Tensor norm1, norm2;
    double eps1, eps2;
    Matmul qkv, o, gate_up, down;
    int64_t heads;
};

class LayerStack {
public:
    void add_layer(torch::Tensor norm1, double eps1, const MatmulArgs& qkv, const MatmulArgs& o, torch::Tensor norm2,
                   double eps2, const MatmulArgs& gate_up, const MatmulArgs& down, int64_t heads) {
        layers_.push_back(Layer{norm1, norm2, eps1, eps2, {qkv}, {o}, {gate_up}, {down}, heads});
    }

    int64_t size() const { return static_cast<int64_t>(layers_.size()); }

    // x [N, d] float32, the residual stream: every layer but the last adds its output to it in place.
    // key_counts: keys each row attends to (rope_cache_attention's; none: causal).
    // Returns the last layer's MLP output (not yet added, as DecoderLayer.fused_forward returns it) and
    // x + that layer's output for each layer in `capture`, in capture's order.
    std::tuple<torch::Tensor, std::vector<torch::Tensor>> forward(
            torch::Tensor x, torch::Tensor cos, torch::Tensor signed_sin, const std::vector<torch::Tensor>& k_cache,
            const std::vector<torch::Tensor>& v_cache, torch::Tensor slots, torch::Tensor positions,
            const std::vector<int64_t>& capture, c10::optional<torch::Tensor> key_counts) const {
        const int64_t n_layers = size();
        TORCH_CHECK(static_cast<int64_t>(k_cache.size()) == n_layers && static_cast<int64_t>(v_cache.size()) == n_layers,
                    "one key and one value cache a layer");
        std::vector<torch::Tensor> captured(capture.size());
        c10::optional<torch::Tensor> delta;
        for (int64_t i = 0; i < n_layers; ++i) {
            const Layer& layer = layers_[i];
            torch::Tensor h = add_rms_norm(x, delta, layer.norm1, layer.eps1, false);
            h = rope_cache_attention(layer.qkv(h), cos, signed_sin, k_cache[i], v_cache[i], slots, positions,
                                     layer.heads, false, key_counts);
            h = add_rms_norm(x, layer.o(h), layer.norm2, layer.eps2, false);
            delta = layer.down(silu_mul(layer.gate_up(h), false));
            for (size_t j = 0; j < capture.size(); ++j)
                if (capture[j] == i) captured[j] = x + *delta;
        }
        for (size_t j = 0; j < capture.size(); ++j)
            TORCH_CHECK(captured[j].defined(), "capture layer ", capture[j], " is not one of the ", n_layers, " layers");
        TORCH_CHECK(delta.has_value(), "no layers");
        return {*delta, captured};
    }

private:
    std::vector<Layer> layers_;
};

}  // namespace

void register_layer_stack(pybind11::module& m) {
    pybind11::class_<LayerStack>(m, "LayerStack", "a decoder's layers on the int8 or gguf-q8 kernels, a pass in one call")
        .def(pybind11::init<>())
        .def("add_layer", &LayerStack::add_layer)
        .def("__len__", &LayerStack::size)
        .def("forward", &LayerStack::forward, kReleaseGil, pybind11::arg("x"), pybind11::arg("cos"),
             pybind11::arg("signed_sin"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("slots"),
             pybind11::arg("positions"), pybind11::arg("capture"), pybind11::arg("key_counts") = pybind11::none());
}
