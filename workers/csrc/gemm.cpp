// fp32 linear layer (out = x · Wᵀ + b) for the row counts of decoding, on weights packed once at load.
//
// Why not torch: at 1-256 rows a projection of a small model is a few microseconds of arithmetic,
// and oneDNN's inner product (or MKL's sgemm) spends 15-40 µs a call around it creating or looking
// up its primitive, its scratchpad and its output (profiled: about 60% of the matmul time of the
// tiny-reasoner's decode steps). This is one pass with nothing around it.
//
// Packing: W [N, K] becomes panels of 16 output features, each panel K-major:
//     packed[p][k][j] = W[16p + j][k]        (N padded with zero rows to a multiple of 16)
// so the kernel reads each panel once, front to back, as whole 64-byte lines.
//
// Kernel: a block of up to 6 rows × 4 panels (64 outputs) keeps 24 AVX-512 accumulators; per k it
// loads 4 weight vectors, broadcasts 6 inputs and issues 24 FMAs. Work is split over threads by
// (row chunk, panel group) when it is big enough to pay for waking them.
//
// Numerics: every output is summed in blocks of 512 k: within a block in order, one fused
// multiply-add each from zero; the block sums added in order; then the bias. That is the order of
// oneDNN's fp32 inner product (what torch's mkldnn path and vLLM's CPU build run) on the peers'
// shapes (K 192-1024, N a multiple of 64, 1-64 rows), checked bit for bit; on greedy decoding another order
// flips a near-tied argmax now and then (1 of 24 requests at token 3,660 on the heavy peers
// workload, with one sequential sum over K = 1024). It does not depend on the batch: a row gets the
// same bits whatever other rows run with it (oneDNN picks its blocking by shape beyond that).
#include <torch/extension.h>
#include "team.h"

#include <immintrin.h>

namespace {

constexpr int64_t kPanel = 16;      // output features per packed panel (one zmm of fp32)
constexpr int64_t kGroup = 4;       // panels per kernel call (64 outputs)
constexpr int64_t kRows = 6;        // rows per kernel call
constexpr int64_t kRowChunk = 96;   // rows whose inputs stay in L2 while every panel passes over them
constexpr int64_t kSumBlock = 512;  // k per partial sum (the order oneDNN uses; see Numerics)
constexpr int64_t kMinThreadMacs = 1 << 18;  // multiply-adds per thread before splitting pays
// Up to this many rows a tile reads one panel at a time, as a single stream, instead of 4 panels at
// once (4 streams 64 KiB apart at K = 1024). In-process on this machine (512 MiB on huge pages, 1
// thread, 25 reps under the bench lock) one row read 30.2 GB/s one panel at a time against 28.2
// with 4 panels (torch's sum: 29.8); per output the order of the sums is the same either way.
constexpr int64_t kStreamRows = 1;
// Such a lone row's stream also prefetches this far ahead in software (one line per line read):
// a 231M model's 58 matrices read back to back took 0.94-0.95x the time of a plain AVX-512 sum
// over as many bytes with the hardware prefetcher alone, 0.86-0.88x prefetching 4-16 KiB ahead (a
// C++ probe over the model's layout on huge pages, 1 thread, 10 reps each at load 5); the batch-1
// step went from 50.2 to 47.5 ms in the same hold (the engine's own one-row probe sped up alike). It stops at the end of the thread's claim, but runs on into
// the next matrix from a claim that ends its own (the weights lie in the arena in the order a
// step reads them).
constexpr int64_t kPrefetchBytes = 8192;
// A claim of a lone row's panels holds at least this much weight (a panel is K × 64 bytes).
constexpr int64_t kMinClaimBytes = 64 << 10;
// Inside a program a lone row offers a helper this much of the next weight to read ahead (team.h):
// half of a core's 2 MiB L2 here.
constexpr int64_t kAheadBytes = 1 << 20;

#if defined(__AVX512F__)
// out[r][16g + j] (+)= sum_k x[r][k] * panel_g[k][j] for R rows and G panels.
// prefetch_end: a lone panel (R = G = 1) prefetches kPrefetchBytes ahead of each line it reads,
// below this address.
template <int R, int G>
inline void block_kernel(const float* x, int64_t x_stride, const float* w, int64_t K, float* out, int64_t out_stride,
                         const float* bias, int64_t n_valid, const char* prefetch_end = nullptr) {
  __mmask16 mask[G];
  for (int g = 0; g < G; ++g) {
    const int64_t valid = std::max<int64_t>(0, std::min<int64_t>(kPanel, n_valid - g * kPanel));
    mask[g] = valid == kPanel ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
  }
  const int64_t panel_stride = K * kPanel;
  for (int64_t k0 = 0; k0 < K; k0 += kSumBlock) {
    const int64_t k1 = std::min(K, k0 + kSumBlock);
    __m512 acc[R][G];
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
    if constexpr (R == 1 && G == 1) {
      const char* ahead = reinterpret_cast<const char*>(w + k0 * kPanel) + kPrefetchBytes;
      const int64_t lines = std::clamp<int64_t>((prefetch_end - ahead) / 64, 0, k1 - k0);
      for (int64_t k = k0; k < k0 + lines; ++k, ahead += 64) {
        _mm_prefetch(ahead, _MM_HINT_T0);
        acc[0][0] = _mm512_fmadd_ps(_mm512_set1_ps(x[k]), _mm512_loadu_ps(w + k * kPanel), acc[0][0]);
      }
      for (int64_t k = k0 + lines; k < k1; ++k)
        acc[0][0] = _mm512_fmadd_ps(_mm512_set1_ps(x[k]), _mm512_loadu_ps(w + k * kPanel), acc[0][0]);
    } else {
    for (int64_t k = k0; k < k1; ++k) {
      __m512 wv[G];
      for (int g = 0; g < G; ++g) wv[g] = _mm512_loadu_ps(w + g * panel_stride + k * kPanel);
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(x[r * x_stride + k]);
        for (int g = 0; g < G; ++g) acc[r][g] = _mm512_fmadd_ps(xv, wv[g], acc[r][g]);
      }
    }
    }
    const bool last = k1 == K;
    for (int g = 0; g < G; ++g) {
      const __m512 b = last && bias ? _mm512_maskz_loadu_ps(mask[g], bias + g * kPanel) : _mm512_setzero_ps();
      for (int r = 0; r < R; ++r) {
        float* o = out + r * out_stride + g * kPanel;
        // the sum so far (stored after the previous block; fp32 both ways, so exact) plus this block's
        __m512 v = k0 ? _mm512_add_ps(_mm512_maskz_loadu_ps(mask[g], o), acc[r][g]) : acc[r][g];
        if (last && bias) v = _mm512_add_ps(v, b);
        _mm512_mask_storeu_ps(o, mask[g], v);
      }
    }
  }
}

template <int R>
inline void rows_kernel(const float* x, int64_t x_stride, const float* w, int64_t K, float* out, int64_t out_stride,
                        const float* bias, int64_t n_valid, int64_t panels, const char* prefetch_end) {
  switch (panels) {
    case 4: block_kernel<R, 4>(x, x_stride, w, K, out, out_stride, bias, n_valid); break;
    case 3: block_kernel<R, 3>(x, x_stride, w, K, out, out_stride, bias, n_valid); break;
    case 2: block_kernel<R, 2>(x, x_stride, w, K, out, out_stride, bias, n_valid); break;
    default: block_kernel<R, 1>(x, x_stride, w, K, out, out_stride, bias, n_valid, prefetch_end); break;
  }
}
#endif

// Rows [r0, r1) × panels [p0, p1).
void gemm_tile(const float* x, int64_t x_stride, const float* packed, int64_t K, int64_t N, float* out,
               int64_t out_stride, const float* bias, int64_t r0, int64_t r1, int64_t p0, int64_t p1) {
  // A lone row reads its panels one after another: consecutive panels are adjacent in memory, so
  // a thread's share of the weight is one front-to-back stream (see kStreamRows).
  const int64_t group = r1 - r0 <= kStreamRows ? 1 : kGroup;
  // The stream's prefetches stay inside this tile's panels, or run on past the weight's end
  // (into the next matrix of the arena) when the tile ends the weight. Prefetching never faults.
  const int64_t P = (N + kPanel - 1) / kPanel;
  const char* prefetch_end = reinterpret_cast<const char*>(packed + p1 * K * kPanel) + (p1 == P ? kPrefetchBytes : 0);
  for (int64_t p = p0; p < p1; p += group) {
    const int64_t panels = std::min<int64_t>(group, p1 - p);
    const float* w = packed + p * K * kPanel;
    const int64_t col = p * kPanel, n_valid = N - col;
    const float* b = bias ? bias + col : nullptr;
    for (int64_t r = r0; r < r1; r += kRows) {
      const int64_t rows = std::min<int64_t>(kRows, r1 - r);
      const float* xr = x + r * x_stride;
      float* o = out + r * out_stride + col;
#if defined(__AVX512F__)
      switch (rows) {
        case 6: rows_kernel<6>(xr, x_stride, w, K, o, out_stride, b, n_valid, panels, prefetch_end); break;
        case 5: rows_kernel<5>(xr, x_stride, w, K, o, out_stride, b, n_valid, panels, prefetch_end); break;
        case 4: rows_kernel<4>(xr, x_stride, w, K, o, out_stride, b, n_valid, panels, prefetch_end); break;
        case 3: rows_kernel<3>(xr, x_stride, w, K, o, out_stride, b, n_valid, panels, prefetch_end); break;
        case 2: rows_kernel<2>(xr, x_stride, w, K, o, out_stride, b, n_valid, panels, prefetch_end); break;
        default: rows_kernel<1>(xr, x_stride, w, K, o, out_stride, b, n_valid, panels, prefetch_end); break;
      }
#else
      // Same order of operations per output (see the top of the file).
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < std::min<int64_t>(panels * kPanel, n_valid); ++j) {
          const float* wp = w + (j / kPanel) * K * kPanel + j % kPanel;
          float total = 0.f;
          for (int64_t k0 = 0; k0 < K; k0 += kSumBlock) {
            float acc = 0.f;
            for (int64_t k = k0; k < std::min(K, k0 + kSumBlock); ++k)
              acc = std::fma(xr[i * x_stride + k], wp[k * kPanel], acc);
            total = k0 ? total + acc : acc;
          }
          o[i * out_stride + j] = b ? total + b[j] : total;
        }
#endif
    }
  }
}

}  // namespace

// W [N, K] float32 -> packed [ceil(N/16), K, 16] float32 (layout above), into ``out`` when given (a
// contiguous float32 tensor of that many elements, e.g. a slice of an arena on huge pages; no
// temporary copy of the matrix is made then).
torch::Tensor pack_linear_weight(torch::Tensor weight, c10::optional<torch::Tensor> out) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32, "weight must be a 2-d float32 [N, K]");
  auto w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = (N + kPanel - 1) / kPanel;
  torch::Tensor packed;
  if (out.has_value() && out->defined()) {
    TORCH_CHECK(out->is_contiguous() && out->scalar_type() == torch::kFloat32 && out->numel() == P * K * kPanel,
                "out must be a contiguous float32 tensor of ", P * K * kPanel, " elements");
    packed = out->view({P, K, kPanel});
  } else {
    packed = torch::empty({P, K, kPanel}, w.options());
  }
  // The loop below writes every element but the last panel's padding rows: zero only those.
  const int64_t last = N - (P - 1) * kPanel;
  if (P > 0 && last < kPanel) packed.select(0, P - 1).narrow(1, last, kPanel - last).zero_();
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) dst[(n / kPanel) * K * kPanel + k * kPanel + n % kPanel] = src[n * K + k];
  return packed;
}

// x [M, K] float32 (rows may be strided), packed from pack_linear_weight of a [N, K] weight, bias [N] or None.
// `next` (inside a Team program, e.g. decode_layers): the packed weight the program multiplies
// next; a lone row offers its first panels to a helper to read ahead (team.h, "Reading ahead").
torch::Tensor packed_linear_then(const torch::Tensor& x, const torch::Tensor& packed, int64_t N,
                                 const c10::optional<torch::Tensor>& bias, const torch::Tensor* next) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == torch::kFloat32,
              "x must be a 2-d float32 tensor with contiguous rows");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous() &&
                  packed.scalar_type() == torch::kFloat32,
              "packed must come from pack_linear_weight");
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "x has ", K, " features, the weight expects ", packed.size(1));
  TORCH_CHECK(N > (P - 1) * kPanel && N <= P * kPanel, "out_features ", N, " does not match the packed weight");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == N && bias->is_contiguous() &&
                    bias->scalar_type() == torch::kFloat32,
                "bias must be a contiguous float32 [out_features]");
    b = bias->data_ptr<float>();
  }
  auto out = torch::empty({M, N}, x.options());
  if (M == 0) return out;
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  if (M <= kStreamRows) {
    // Work items: single panels; a claim (a run of them, team.h) is one front-to-back stream.
    const int64_t grain = std::max<int64_t>(1, kMinClaimBytes / (K * kPanel * 4));
    thinkserve::Team::Ahead ahead;
    if (next != nullptr && next->dim() == 3 && next->size(2) == kPanel) {
      // a quarter of the next weight at most: the rest is claimed as usual
      const int64_t panel_bytes = next->size(1) * kPanel * 4, panels = next->size(0);
      ahead.items = std::min(panels / 4, kAheadBytes / panel_bytes);
      ahead.key = next->data_ptr();
      ahead.begin = static_cast<const char*>(next->data_ptr());
      ahead.bytes = ahead.items * panel_bytes;
    }
    thinkserve::Team::parallel_for(
        P, grain, [&](int64_t lo, int64_t hi) { gemm_tile(xp, x_stride, wp, K, N, op, N, b, 0, M, lo, hi); }, wp,
        ahead.items > 0 ? &ahead : nullptr);
    return out;
  }
  // Work items: (row chunk, group of 4 panels); a thread takes a run of them.
  const int64_t chunks = (M + kRowChunk - 1) / kRowChunk, groups = (P + kGroup - 1) / kGroup;
  const int64_t item_macs = std::min(M, kRowChunk) * K * kGroup * kPanel;
  const int64_t grain = std::max<int64_t>(1, kMinThreadMacs / std::max<int64_t>(1, item_macs));
  thinkserve::Team::parallel_for(chunks * groups, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t c = i / groups, g = i % groups;
      const int64_t r0 = c * kRowChunk, r1 = std::min(M, r0 + kRowChunk);
      gemm_tile(xp, x_stride, wp, K, N, op, N, b, r0, r1, g * kGroup, std::min(P, (g + 1) * kGroup));
    }
  });
  return out;
}

torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias) {
  return packed_linear_then(x, packed, N, bias, nullptr);
}
