// The small per-layer ops of a decoder step, fused so that each is one pass over its data and one
// call from Python instead of several torch ops (on a small model the step is per-op overhead):
//
//   add_rms_norm_   residual += x;  x = residual * rsqrt(mean(residual^2) + eps) * weight   (in place)
//   rope_and_cache_ rotate q and k inside the fused qkv rows (half-split "NeoX" rotation) and
//                   write k and v into their cache slots                                   (in place)
//   silu_mul        [T, 2I] gate|up  ->  [T, I] silu(gate) * up
//
// Arithmetic is fp32 whatever the storage dtype. Work is split over threads only when a call is
// big enough to pay for waking them (team.h's parallel_for runs inline below its grain size): at decode
// batch sizes of a small model a fork/join costs more than the op.
#include <torch/extension.h>
#include "team.h"

#include <cmath>

namespace {

constexpr int64_t kGrainElements = 1 << 15;  // elements per thread before splitting pays

int64_t row_grain(int64_t row_elements) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements)); }

template <typename scalar_t>
void add_rms_norm_rows(scalar_t* x, scalar_t* res, const scalar_t* w, int64_t T, int64_t H, int64_t x_stride,
                       int64_t res_stride, float eps) {
  thinkserve::Team::parallel_for(T, row_grain(H), [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      scalar_t* xr = x + t * x_stride;
      scalar_t* rr = res + t * res_stride;
      float ss = 0.f;
      for (int64_t i = 0; i < H; ++i) {
        // the sum is rounded to the storage dtype, as `residual + x` in torch would be
        const scalar_t s = static_cast<scalar_t>(static_cast<float>(rr[i]) + static_cast<float>(xr[i]));
        rr[i] = s;
        const float f = static_cast<float>(s);
        ss += f * f;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
      for (int64_t i = 0; i < H; ++i)
        xr[i] = static_cast<scalar_t>(static_cast<float>(rr[i]) * inv * static_cast<float>(w[i]));
    }
  });
}

template <typename scalar_t>
void rope_and_cache_rows(scalar_t* qkv, int64_t qkv_stride, const float* cos, const float* sin, const int64_t* slots,
                         scalar_t* k_cache, scalar_t* v_cache, int64_t T, int64_t Hq, int64_t Hkv, int64_t D) {
  const int64_t half = D / 2, kv = Hkv * D;
  thinkserve::Team::parallel_for(T, row_grain((Hq + 2 * Hkv) * D), [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      scalar_t* row = qkv + t * qkv_stride;
      const float* c = cos + t * half;
      const float* s = sin + t * half;
      //  x = [x1 | x2]:  out1 = x1·c - x2·s,  out2 = x2·c + x1·s   (q heads, then k heads)
      for (int64_t h = 0; h < Hq + Hkv; ++h) {
        scalar_t* x = row + h * D;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
          x[i] = static_cast<scalar_t>(x1 * c[i] - x2 * s[i]);
          x[i + half] = static_cast<scalar_t>(x2 * c[i] + x1 * s[i]);
        }
      }
      const int64_t slot = slots[t];
      std::copy(row + Hq * D, row + Hq * D + kv, k_cache + slot * kv);
      std::copy(row + Hq * D + kv, row + Hq * D + 2 * kv, v_cache + slot * kv);
    }
  });
}

template <typename scalar_t>
void silu_mul_rows(const scalar_t* gu, scalar_t* out, int64_t T, int64_t I, int64_t gu_stride) {
  thinkserve::Team::parallel_for(T, row_grain(I), [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const scalar_t* g = gu + t * gu_stride;
      const scalar_t* u = g + I;
      scalar_t* o = out + t * I;
      for (int64_t i = 0; i < I; ++i) {
        const float x = static_cast<float>(g[i]);
        o[i] = static_cast<scalar_t>(x / (1.f + std::exp(-x)) * static_cast<float>(u[i]));
      }
    }
  });
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-d with contiguous rows");
}

}  // namespace

void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual shapes differ");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight must be [hidden]");
  TORCH_CHECK(x.scalar_type() == residual.scalar_type() && x.scalar_type() == weight.scalar_type(),
              "x, residual and weight must share a dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm_", [&] {
    add_rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                                x.size(0), x.size(1), x.stride(0), residual.stride(0), static_cast<float>(eps));
  });
}

// qkv [T, (Hq + 2 Hkv) * D] (rows may be strided), cos / sin [T, D/2] float32, slot_mapping [T] int64,
// k_cache / v_cache contiguous [num_blocks, block_size, Hkv, D].
void rope_and_cache_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor slot_mapping,
                     torch::Tensor k_cache, torch::Tensor v_cache, int64_t num_heads, int64_t num_kv_heads) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache must be contiguous [num_blocks, block_size, Hkv, D] of one shape");
  const int64_t D = k_cache.size(3), T = qkv.size(0);
  TORCH_CHECK(k_cache.size(2) == num_kv_heads && D % 2 == 0, "cache heads or head_dim do not match");
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * D, "qkv width does not match the head counts");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.numel() == T * D / 2 && sin.numel() == T * D / 2,
              "cos and sin must be contiguous float32 [T, head_dim/2]");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == T,
              "slot_mapping must be [T] int64");
  TORCH_CHECK(qkv.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "qkv and the cache must share a dtype");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)  // checked before anything is written
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " of token ", t,
                " is outside the cache (", num_slots, " slots)");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_and_cache_", [&] {
    rope_and_cache_rows<scalar_t>(qkv.data_ptr<scalar_t>(), qkv.stride(0), cos.data_ptr<float>(),
                                  sin.data_ptr<float>(), slots, k_cache.data_ptr<scalar_t>(),
                                  v_cache.data_ptr<scalar_t>(), T, num_heads, num_kv_heads, D);
  });
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up width must be even");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({T, I}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    silu_mul_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), T, I, gate_up.stride(0));
  });
  return out;
}
