// One extension module for every native CPU op (built and cached by workers/decode_kernels.py).
#include <torch/extension.h>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                           torch::Tensor context_lens, double scale, int64_t partition);
void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void rope_and_cache_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor slot_mapping,
                     torch::Tensor k_cache, torch::Tensor v_cache, int64_t num_heads, int64_t num_kv_heads);
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor pack_linear_weight(torch::Tensor weight, c10::optional<torch::Tensor> out);
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias);
// attention_in_, attention_out and decode_layers: bound where they are defined (layer_blocks.cpp).
void bind_layer_blocks(pybind11::module_& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention over a block table (CPU)");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x; x = rms_norm(residual) * weight, in place (CPU)");
  m.def("rope_and_cache_", &rope_and_cache_, "rotary embedding of q and k in qkv, and the KV cache write (CPU)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused [T, 2I] projection (CPU)");
  m.def("pack_linear_weight", &pack_linear_weight, "[N, K] float32 weight -> 16-feature K-major panels (CPU)",
        pybind11::arg("weight"), pybind11::arg("out") = pybind11::none());
  m.def("packed_linear", &packed_linear, "x · Wᵀ + b on a packed weight, fp32, batch-invariant (CPU)");
  bind_layer_blocks(m);
}
