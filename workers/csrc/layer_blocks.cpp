// A decoder layer as two native calls around attention, so the Python of a step is a few lines
// per layer instead of nine calls with views and wrappers between them (on a small model that
// glue was about a quarter of the forward pass):
//
//   attention_in_   x ─▶ qkv = x·W_qkv (+b) ─▶ rope(q, k), k/v into their cache slots ─▶ qkv
//   attention_out   attn ─▶ ·W_o ─(+h, norm)─▶ ·W_gate_up ─▶ silu·mul ─▶ ·W_down ─(+h, next norm)─▶ x
//
// A step where every sequence decodes one token, with the native paged kernel, runs all its
// layers as one call, ``decode_layers``: per layer attention_in_, paged_decode (paged_decode.cpp)
// on the q columns of qkv in place, attention_out. Same ops, same order, same bits as the three
// calls from Python; what it saves is the Python between them (slicing q, k and v out of qkv, the
// attention dispatch: at batch 1 on a 231M Llama about 1.5 ms of a 35 ms step) and, with fp32
// packed weights, every fork and join: the step is ONE program on the team of team.h instead of
// an OpenMP region per matrix and op (~60 at batch 1), each of which waited for the other thread
// at its end; the program waits only for work another thread has claimed and not finished.
//
// Each step is the op of the same name in gemm.cpp / fused_ops.cpp, called directly. A weight is
// either packed for gemm.cpp ([ceil(N/16), K, 16], fp32) or a plain [N, K] tensor (other dtypes),
// which goes to at::linear.
#include <torch/extension.h>

#include <tuple>
#include <vector>

#include "team.h"

void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void rope_and_cache_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor slot_mapping,
                     torch::Tensor k_cache, torch::Tensor v_cache, int64_t num_heads, int64_t num_kv_heads);
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor packed_linear_then(const torch::Tensor& x, const torch::Tensor& packed, int64_t N,
                                 const c10::optional<torch::Tensor>& bias, const torch::Tensor* next);
at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                        at::Tensor context_lens, double scale, int64_t partition);

namespace {

// `next`: the weight multiplied after this one (a helper reads its start ahead; gemm.cpp)
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, int64_t n, const c10::optional<torch::Tensor>& b,
                     const torch::Tensor* next = nullptr) {
  if (w.dim() == 3) return packed_linear_then(x, w, n, b, next);
  TORCH_CHECK(w.dim() == 2 && w.size(0) == n, "a plain weight must be [", n, ", in_features]");
  return at::linear(x, w, b);
}

}  // namespace

namespace {

// attention_in_ and attention_out below, each projection naming the weight after it (`next` as in
// linear; the qkv projection's is o_weight).
torch::Tensor attention_in_then(const torch::Tensor& x, const torch::Tensor& qkv_weight, int64_t qkv_features,
                           const c10::optional<torch::Tensor>& qkv_bias, const torch::Tensor& cos,
                           const torch::Tensor& sin, const torch::Tensor& slot_mapping, const torch::Tensor& k_cache,
                           const torch::Tensor& v_cache, int64_t num_heads, int64_t num_kv_heads,
                           const torch::Tensor* o_weight) {
  auto qkv = linear(x, qkv_weight, qkv_features, qkv_bias, o_weight);
  rope_and_cache_(qkv, cos, sin, slot_mapping, k_cache, v_cache, num_heads, num_kv_heads);
  return qkv;
}

torch::Tensor attention_out_then(const torch::Tensor& attn, const torch::Tensor& h, const torch::Tensor& o_weight,
                            int64_t o_features, const torch::Tensor& post_norm, const torch::Tensor& gate_up_weight,
                            int64_t gate_up_features, const torch::Tensor& down_weight, int64_t down_features,
                            const c10::optional<torch::Tensor>& next_norm, double eps, const torch::Tensor* next) {
  auto x = linear(attn, o_weight, o_features, c10::nullopt, &gate_up_weight);
  add_rms_norm_(x, h, post_norm, eps);
  auto y = linear(silu_mul(linear(x, gate_up_weight, gate_up_features, c10::nullopt, &down_weight)), down_weight,
                  down_features, c10::nullopt, next);
  if (next_norm.has_value() && next_norm->defined()) add_rms_norm_(y, h, *next_norm, eps);
  return y;
}

}  // namespace

torch::Tensor attention_in_(torch::Tensor x, torch::Tensor qkv_weight, int64_t qkv_features,
                            c10::optional<torch::Tensor> qkv_bias, torch::Tensor cos, torch::Tensor sin,
                            torch::Tensor slot_mapping, torch::Tensor k_cache, torch::Tensor v_cache, int64_t num_heads,
                            int64_t num_kv_heads) {
  return attention_in_then(x, qkv_weight, qkv_features, qkv_bias, cos, sin, slot_mapping, k_cache, v_cache, num_heads,
                      num_kv_heads, nullptr);
}

// h is the residual stream, updated in place (h += attention output, then h += MLP output).
// Returns the next layer's normed input (next_norm given) or the MLP output not yet added to h.
torch::Tensor attention_out(torch::Tensor attn, torch::Tensor h, torch::Tensor o_weight, int64_t o_features,
                            torch::Tensor post_norm, torch::Tensor gate_up_weight, int64_t gate_up_features,
                            torch::Tensor down_weight, int64_t down_features, c10::optional<torch::Tensor> next_norm,
                            double eps) {
  return attention_out_then(attn, h, o_weight, o_features, post_norm, gate_up_weight, gate_up_features, down_weight,
                       down_features, next_norm, eps, nullptr);
}

namespace {

// One layer's weights as the model passes them, in its per-layer tuple's order:
// (qkv, qkv features, qkv bias, o, o features, post-attention norm, gate_up, gate_up features,
//  down, down features, next layer's input norm or None after the last layer)
using LayerWeights = std::tuple<torch::Tensor, int64_t, c10::optional<torch::Tensor>, torch::Tensor, int64_t,
                                torch::Tensor, torch::Tensor, int64_t, torch::Tensor, int64_t,
                                c10::optional<torch::Tensor>>;

}  // namespace

// Every layer of a decode-only step (see the top of the file), layer i on k_caches[i] / v_caches[i].
// x is the first layer's normed input, h the residual stream (in place); returns the last layer's
// MLP output, not yet added to h.
torch::Tensor decode_layers(torch::Tensor x, torch::Tensor h, const std::vector<LayerWeights>& layers,
                            const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                            torch::Tensor cos, torch::Tensor sin, torch::Tensor slot_mapping, int64_t num_heads,
                            int64_t num_kv_heads, torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                            int64_t partition, double eps) {
  TORCH_CHECK(!layers.empty() && k_caches.size() == layers.size() && v_caches.size() == layers.size(),
              "one k and one v cache per layer, and at least one layer");
  bool packed = true;  // every projection on the native GEMM
  for (const auto& w : layers)
    packed = packed && std::get<0>(w).dim() == 3 && std::get<3>(w).dim() == 3 && std::get<6>(w).dim() == 3 &&
             std::get<8>(w).dim() == 3;
  auto step = [&] {
    for (size_t i = 0; i < layers.size(); ++i) {
      const auto& [qkv_w, qkv_n, qkv_b, o_w, o_n, post_norm, gu_w, gu_n, down_w, down_n, next_norm] = layers[i];
      const auto &k_cache = k_caches[i], &v_cache = v_caches[i];
      const int64_t head_dim = k_cache.size(3);
      // each projection names the one after it, whose start a helper reads ahead meanwhile
      const torch::Tensor* next_qkv = i + 1 < layers.size() ? &std::get<0>(layers[i + 1]) : nullptr;
      auto qkv = attention_in_then(x, qkv_w, qkv_n, qkv_b, cos, sin, slot_mapping, k_cache, v_cache, num_heads,
                              num_kv_heads, &o_w);
      auto q = qkv.narrow(1, 0, num_heads * head_dim).view({qkv.size(0), num_heads, head_dim});
      auto attn = paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, partition);
      x = attention_out_then(attn, h, o_w, o_n, post_norm, gu_w, gu_n, down_w, down_n, next_norm, eps, next_qkv);
    }
  };
  // All layers as ONE program (team.h) when every projection is the native GEMM; a plain weight
  // goes to at::linear, which runs on torch's own threads and would leave the team idle.
  if (packed) {
    thinkserve::Team::run(step);
  } else {
    step();
  }
  return x;
}

void bind_layer_blocks(pybind11::module_& m) {
  m.def("attention_in_", &attention_in_, "qkv projection, rope and the KV cache write of a layer (CPU)");
  m.def("attention_out", &attention_out, "o projection, residual, norm and the MLP of a layer (CPU)");
  m.def("decode_layers", &decode_layers,
        "attention_in_, paged_decode and attention_out of every layer of a decode-only step (CPU)");
}
