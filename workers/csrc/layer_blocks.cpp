// A decoder layer as two native calls around attention, so the Python of a step is a few lines
// per layer instead of nine calls with views and wrappers between them (on a small model that
// glue was about a quarter of the forward pass):
//
//   attention_in_   x ─▶ qkv = x·W_qkv (+b) ─▶ rope(q, k), k/v into their cache slots ─▶ qkv
//   attention_out   attn ─▶ ·W_o ─(+h, norm)─▶ ·W_gate_up ─▶ silu·mul ─▶ ·W_down ─(+h, next norm)─▶ x
//
// A step where every sequence decodes one token, with the native paged kernel, runs the whole
// layer as one call, ``decode_layer``: attention_in_, paged_decode (paged_decode.cpp) on the q
// columns of qkv in place, attention_out. Same ops, same order, same bits as the three calls from
// Python; what it saves is the Python between them (slicing q, k and v out of qkv, the attention
// dispatch): at batch 1 on a 231M Llama that was about 1.5 ms of a 35 ms step. With fp32 packed
// weights the layer is also one parallel region (team.h) instead of one per matrix and op.
//
// Each step is the op of the same name in gemm.cpp / fused_ops.cpp, called directly. A weight is
// either packed for gemm.cpp ([ceil(N/16), K, 16], fp32) or a plain [N, K] tensor (other dtypes),
// which goes to at::linear.
#include <torch/extension.h>

#include "team.h"

void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void rope_and_cache_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor slot_mapping,
                     torch::Tensor k_cache, torch::Tensor v_cache, int64_t num_heads, int64_t num_kv_heads);
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias);
at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                        at::Tensor context_lens, double scale, int64_t partition);

namespace {

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, int64_t n, const c10::optional<torch::Tensor>& b) {
  if (w.dim() == 3) return packed_linear(x, w, n, b);
  TORCH_CHECK(w.dim() == 2 && w.size(0) == n, "a plain weight must be [", n, ", in_features]");
  return at::linear(x, w, b);
}

}  // namespace

torch::Tensor attention_in_(torch::Tensor x, torch::Tensor qkv_weight, int64_t qkv_features,
                            c10::optional<torch::Tensor> qkv_bias, torch::Tensor cos, torch::Tensor sin,
                            torch::Tensor slot_mapping, torch::Tensor k_cache, torch::Tensor v_cache, int64_t num_heads,
                            int64_t num_kv_heads) {
  auto qkv = linear(x, qkv_weight, qkv_features, qkv_bias);
  rope_and_cache_(qkv, cos, sin, slot_mapping, k_cache, v_cache, num_heads, num_kv_heads);
  return qkv;
}

// h is the residual stream, updated in place (h += attention output, then h += MLP output).
// Returns the next layer's normed input (next_norm given) or the MLP output not yet added to h.
torch::Tensor attention_out(torch::Tensor attn, torch::Tensor h, torch::Tensor o_weight, int64_t o_features,
                            torch::Tensor post_norm, torch::Tensor gate_up_weight, int64_t gate_up_features,
                            torch::Tensor down_weight, int64_t down_features, c10::optional<torch::Tensor> next_norm,
                            double eps) {
  auto x = linear(attn, o_weight, o_features, c10::nullopt);
  add_rms_norm_(x, h, post_norm, eps);
  auto y = linear(silu_mul(linear(x, gate_up_weight, gate_up_features, c10::nullopt)), down_weight, down_features,
                  c10::nullopt);
  if (next_norm.has_value() && next_norm->defined()) add_rms_norm_(y, h, *next_norm, eps);
  return y;
}

// One decode-only layer (see the top of the file). The weight arguments come first, in the order
// of the model's per-layer tuple; x is this layer's normed input, h the residual stream (in place).
torch::Tensor decode_layer(torch::Tensor x, torch::Tensor h, torch::Tensor qkv_weight, int64_t qkv_features,
                           c10::optional<torch::Tensor> qkv_bias, torch::Tensor o_weight, int64_t o_features,
                           torch::Tensor post_norm, torch::Tensor gate_up_weight, int64_t gate_up_features,
                           torch::Tensor down_weight, int64_t down_features, c10::optional<torch::Tensor> next_norm,
                           torch::Tensor cos, torch::Tensor sin, torch::Tensor slot_mapping, torch::Tensor k_cache,
                           torch::Tensor v_cache, int64_t num_heads, int64_t num_kv_heads, torch::Tensor block_tables,
                           torch::Tensor context_lens, double scale, int64_t partition, double eps) {
  const int64_t head_dim = k_cache.size(3);
  torch::Tensor y;
  auto layer = [&] {
    auto qkv = attention_in_(x, qkv_weight, qkv_features, qkv_bias, cos, sin, slot_mapping, k_cache, v_cache,
                             num_heads, num_kv_heads);
    auto q = qkv.narrow(1, 0, num_heads * head_dim).view({qkv.size(0), num_heads, head_dim});
    auto attn = paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, partition);
    y = attention_out(attn, h, o_weight, o_features, post_norm, gate_up_weight, gate_up_features, down_weight,
                      down_features, next_norm, eps);
  };
  // One parallel region for the whole layer (team.h) when every projection is the native GEMM; a
  // plain weight goes to at::linear, whose own threads a region around it would leave idle.
  const bool packed = qkv_weight.dim() == 3 && o_weight.dim() == 3 && gate_up_weight.dim() == 3 && down_weight.dim() == 3;
  if (packed) {
    thinkserve::Team::run(layer);
  } else {
    layer();
  }
  return y;
}

void bind_layer_blocks(pybind11::module_& m) {
  m.def("attention_in_", &attention_in_, "qkv projection, rope and the KV cache write of a layer (CPU)");
  m.def("attention_out", &attention_out, "o projection, residual, norm and the MLP of a layer (CPU)");
  m.def("decode_layer", &decode_layer, "attention_in_, paged_decode and attention_out of a decode-only step (CPU)");
}
