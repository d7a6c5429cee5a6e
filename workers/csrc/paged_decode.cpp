// Paged decode attention for CPU: one query token per sequence, K/V read in place through the
// block table, each sequence costing its own context length (no padding to the batch's longest).
//
// Work is split flash-decoding style into items of at most `partition` keys of one sequence, so a
// 4k-token chain and sixty 30-token ones spread evenly over threads:
//
//   seq 0 (ctx 1100), partition 512:  [0..511] [512..1023] [1024..1099]   -> 3 items
//   seq 1 (ctx   30):                 [0..29]                             -> 1 item
//
// An item serves every head of its sequence: it walks each cache slot's whole row [Hkv, D] once,
// front to back through a block, so the reads are sequential within a block (the hardware
// prefetcher follows them) and the next block is prefetched while this one is computed. (Walking
// one kv head at a time touches one D-slice of every Hkv*D row: a strided read that ran at a
// third of the bandwidth.)
//
// Each item writes a partial (max m, sum l, unnormalised acc) per query head; a second pass merges
// a head's partials:  out = sum_i e^(m_i - M) acc_i / sum_i e^(m_i - M) l_i.  Scores and
// accumulation are in fp32 whatever the cache dtype.
//
// fp32 on AVX-512 (head_dim a multiple of 16) has its own inner loops (score_keys_avx512,
// weigh_values_avx512): per 16 keys and head one transposing reduction instead of a horizontal sum
// per key, and value accumulators held in registers across an item. Measured on the tiny reasoner's
// shape at one thread: 10.4 -> 11.5 GB/s of KV read from memory, which is about what a plain
// streaming sum reads on this machine (11.7 GB/s), so the kernel now waits on memory, not on
// arithmetic. (ATen headers only, not torch/extension.h: the first-use compile is shorter.)
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include "team.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

struct Item {
  int64_t seq, first, count;
};

template <typename scalar_t>
inline void prefetch_rows(const scalar_t* p, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 1);
}

// Calls fn(j, row) for the keys [first, first + count) of one sequence, j counting from 0 and row
// pointing at the slot's [Hkv, D] row in `cache`, walking the table block by block (no division
// per key: an int64 divide costs more than the dot product it would address). Row i of the next
// block is prefetched beside row i of this one: spread out, so the prefetches never queue up.
template <typename scalar_t, typename Fn>
inline void walk_rows(const scalar_t* cache, const int64_t* table, int64_t bs, int64_t tok_stride, int64_t first,
                      int64_t count, Fn&& fn) {
  const int64_t end = first + count;
  const int64_t row_bytes = tok_stride * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t pos = first; pos < end;) {
    const int64_t blk = pos / bs, off = pos % bs, n = std::min(bs - off, end - pos);
    const scalar_t* ahead = (blk + 1) * bs < end ? cache + table[blk + 1] * bs * tok_stride : nullptr;
    const scalar_t* row = cache + (table[blk] * bs + off) * tok_stride;
    for (int64_t i = 0; i < n; ++i, row += tok_stride) {
      if (ahead) prefetch_rows(ahead + (off + i) * tok_stride, row_bytes);
      fn(pos - first + i, row);
    }
    pos += n;
  }
}

// HD: the head dim as a compile-time constant (0: taken at run time), so the per-key dot product
// and value update unroll into a few vector instructions instead of a loop with a tail.

// rows[j] = the cache row of key first + j, for the count keys of an item
template <typename scalar_t>
inline void collect_rows(const scalar_t* cache, const int64_t* table, int64_t bs, int64_t tok_stride, int64_t first,
                         int64_t count, const scalar_t** rows) {
  const int64_t end = first + count;
  for (int64_t pos = first; pos < end;) {
    const int64_t blk = pos / bs, off = pos % bs, n = std::min(bs - off, end - pos);
    const scalar_t* row = cache + (table[blk] * bs + off) * tok_stride;
    for (int64_t i = 0; i < n; ++i, row += tok_stride) *rows++ = row;
    pos += n;
  }
}

#if defined(__AVX512F__)
// fp32 with AVX-512, head_dim a multiple of 16 known at compile time. Scores of 16 keys for one
// query head come out of 16 partial-product vectors by one transposing reduction (45 vector ops,
// ~3 per key) instead of a horizontal sum per key and head; the value pass keeps a chunk of heads'
// accumulators in registers across the item's keys instead of loading and storing them per key.

// out lane i = sum of the lanes of v[i]
inline __m512 transpose_sum16(const __m512* v) {
  __m512 s8[8], s4[4];
  for (int i = 0; i < 8; ++i)  // 128-bit lane: [a, b, a, b] partial sums of v[2i], v[2i+1]
    s8[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // 128-bit lane: [a, b, c, d]
    const __m512d x = _mm512_castps_pd(s8[2 * i]), y = _mm512_castps_pd(s8[2 * i + 1]);
    s4[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // fold the four 128-bit lanes: first pairwise within each vector pair, then across
  const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(s4[0], s4[1], 0x88), _mm512_shuffle_f32x4(s4[0], s4[1], 0xDD));
  const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(s4[2], s4[3], 0x88), _mm512_shuffle_f32x4(s4[2], s4[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0x88), _mm512_shuffle_f32x4(u0, u1, 0xDD));
}

// scores[h * partition + j] = q_h . key_j (q already scaled) for the n keys at rows[0..n)
template <int64_t D>
void score_keys_avx512(const float* qf, const float* const* rows, int64_t n, int64_t Hq, int64_t G, int64_t partition,
                       int64_t row_bytes, float* scores) {
  constexpr int64_t C = D / 16;
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - j0);
    for (int64_t t = j0 + 16; t < std::min(n, j0 + 32); ++t) prefetch_rows(rows[t], row_bytes);  // the next tile
    for (int64_t h = 0; h < Hq; ++h) {
      __m512 qv[C];
      for (int64_t c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(qf + h * D + 16 * c);
      const int64_t koff = (h / G) * D;
      __m512 v[16];
      for (int64_t t = 0; t < 16; ++t) {
        if (t < m) {
          const float* k = rows[j0 + t] + koff;
          __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
          for (int64_t c = 1; c < C; ++c) a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + 16 * c), a);
          v[t] = a;
        } else {
          v[t] = _mm512_setzero_ps();
        }
      }
      const __m512 s = transpose_sum16(v);
      _mm512_mask_storeu_ps(scores + h * partition + j0, static_cast<__mmask16>((1u << m) - 1u), s);
    }
  }
}

// acc[h - h0] += sum_j p[h][j] * value_j for the NH heads h0 .. h0 + NH
template <int64_t D, int64_t NH>
void weigh_values_chunk(const float* const* rows, int64_t n, int64_t h0, int64_t G, int64_t partition,
                        int64_t row_bytes, const float* scores, float* acc) {
  constexpr int64_t C = D / 16;
  __m512 a[NH][C];
  for (int64_t i = 0; i < NH; ++i)
    for (int64_t c = 0; c < C; ++c) a[i][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const float* row = rows[j];
    if (row_bytes && j + 8 < n) prefetch_rows(rows[j + 8], row_bytes);
    for (int64_t i = 0; i < NH; ++i) {
      const __m512 p = _mm512_set1_ps(scores[(h0 + i) * partition + j]);
      const float* val = row + ((h0 + i) / G) * D;
      for (int64_t c = 0; c < C; ++c) a[i][c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(val + 16 * c), a[i][c]);
    }
  }
  for (int64_t i = 0; i < NH; ++i)
    for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(acc + (h0 + i) * D + 16 * c, a[i][c]);
}

template <int64_t D>
void weigh_values_avx512(const float* const* rows, int64_t n, int64_t Hq, int64_t G, int64_t partition,
                         int64_t row_bytes, const float* scores, float* acc) {
  constexpr int64_t kMaxHeads = std::max<int64_t>(1, 256 / D);  // 16 accumulator registers
  for (int64_t h0 = 0; h0 < Hq; h0 += kMaxHeads) {
    switch (std::min(kMaxHeads, Hq - h0)) {
#define THINKSERVE_CHUNK(k) \
  case k: if constexpr (k <= kMaxHeads) weigh_values_chunk<D, k>(rows, n, h0, G, partition, h0 ? 0 : row_bytes, scores, acc); break;
      THINKSERVE_CHUNK(1) THINKSERVE_CHUNK(2) THINKSERVE_CHUNK(3) THINKSERVE_CHUNK(4)
      THINKSERVE_CHUNK(5) THINKSERVE_CHUNK(6) THINKSERVE_CHUNK(7) THINKSERVE_CHUNK(8)
#undef THINKSERVE_CHUNK
    }
  }
}
#endif

template <typename scalar_t, int64_t HD>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
         int64_t partition, at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1);
  const int64_t D = HD ? HD : q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t G = Hq / Hkv;
  const int64_t q_stride = q.stride(0), table_stride = block_tables.stride(0);
  const int64_t tok_stride = Hkv * D;  // elements between consecutive slots of the cache
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = k_cache.data_ptr<scalar_t>();
  const scalar_t* vp = v_cache.data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* ctx = context_lens.data_ptr<int64_t>();
  scalar_t* op = out.data_ptr<scalar_t>();

  std::vector<Item> items;
  std::vector<int64_t> first_item(B + 1);
  const int64_t capacity = block_tables.size(1) * bs;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(ctx[b] >= 0 && ctx[b] <= capacity, "context length ", ctx[b], " of row ", b,
                " does not fit its block table (", capacity, " slots)");
    first_item[b] = static_cast<int64_t>(items.size());
    for (int64_t s = 0; s < ctx[b]; s += partition) items.push_back({b, s, std::min(partition, ctx[b] - s)});
  }
  first_item[B] = static_cast<int64_t>(items.size());
  const int64_t n_items = static_cast<int64_t>(items.size());
  // partial record per item: Hq maxima, Hq sums, Hq*D accumulators
  const int64_t rec = Hq * (D + 2);
  std::vector<float> partials(n_items * rec);
  const float fscale = static_cast<float>(scale);

#if defined(__AVX512F__)
  constexpr bool kAvx512 = std::is_same_v<scalar_t, float> && HD > 0 && HD % 16 == 0;
#else
  constexpr bool kAvx512 = false;
#endif
  const int64_t row_bytes = tok_stride * static_cast<int64_t>(sizeof(scalar_t));
  thinkserve::Team::parallel_for(n_items, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> qf(Hq * D), scores(Hq * partition);
    std::vector<const scalar_t*> rows(kAvx512 ? partition : 0);
    for (int64_t it = lo; it < hi; ++it) {
      const Item w = items[it];
      const scalar_t* qrow = qp + w.seq * q_stride;
      for (int64_t i = 0; i < Hq * D; ++i) qf[i] = static_cast<float>(qrow[i]) * fscale;
      const int64_t* table = tables + w.seq * table_stride;
      // pass 1: scores of every key in the item for every head
#if defined(__AVX512F__)
      if constexpr (kAvx512) {
        collect_rows(kp, table, bs, tok_stride, w.first, w.count, rows.data());
        score_keys_avx512<HD>(qf.data(), rows.data(), w.count, Hq, G, partition, row_bytes, scores.data());
      } else
#endif
      walk_rows(kp, table, bs, tok_stride, w.first, w.count, [&](int64_t j, const scalar_t* row) {
        for (int64_t h = 0; h < Hq; ++h) {
          const float* qh = qf.data() + h * D;
          const scalar_t* key = row + (h / G) * D;
          float s = 0.f;
          for (int64_t d = 0; d < D; ++d) s += qh[d] * static_cast<float>(key[d]);
          scores[h * partition + j] = s;
        }
      });
      float* m = partials.data() + it * rec;
      float* l = m + Hq;
      float* acc = l + Hq;
      for (int64_t h = 0; h < Hq; ++h) {
        float* sh = scores.data() + h * partition;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < w.count; ++j) mx = std::max(mx, sh[j]);
        float sum = 0.f;
        for (int64_t j = 0; j < w.count; ++j) {
          sh[j] = std::exp(sh[j] - mx);
          sum += sh[j];
        }
        m[h] = mx;
        l[h] = sum;
      }
      // pass 2: probability-weighted values, the same walk over the value rows
#if defined(__AVX512F__)
      if constexpr (kAvx512) {
        collect_rows(vp, table, bs, tok_stride, w.first, w.count, rows.data());
        weigh_values_avx512<HD>(rows.data(), w.count, Hq, G, partition, row_bytes, scores.data(), acc);
        continue;
      }
#endif
      std::fill(acc, acc + Hq * D, 0.f);
      walk_rows(vp, table, bs, tok_stride, w.first, w.count, [&](int64_t j, const scalar_t* row) {
        for (int64_t h = 0; h < Hq; ++h) {
          const float p = scores[h * partition + j];
          const scalar_t* val = row + (h / G) * D;
          float* ah = acc + h * D;
          for (int64_t d = 0; d < D; ++d) ah[d] += p * static_cast<float>(val[d]);
        }
      });
    }
  });

  // merge the partials of each (sequence, query head)
  thinkserve::Team::parallel_for(B * Hq, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> o(D);
    for (int64_t pair = lo; pair < hi; ++pair) {
      const int64_t b = pair / Hq, h = pair % Hq;
      const int64_t i0 = first_item[b], i1 = first_item[b + 1];
      scalar_t* dst = op + b * Hq * D + h * D;
      if (i0 == i1) {  // empty context: defined as zeros (callers never send one)
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(0.f);
        continue;
      }
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t it = i0; it < i1; ++it) mx = std::max(mx, partials[it * rec + h]);
      float denom = 0.f;
      std::fill(o.begin(), o.end(), 0.f);
      for (int64_t it = i0; it < i1; ++it) {
        const float* r = partials.data() + it * rec;
        const float c = std::exp(r[h] - mx);
        denom += c * r[Hq + h];
        const float* a = r + 2 * Hq + h * D;
        for (int64_t d = 0; d < D; ++d) o[d] += c * a[d];
      }
      const float inv = 1.f / denom;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(o[d] * inv);
    }
  });
}

}  // namespace

// q [B, Hq, D] (rows may be strided), k_cache / v_cache [num_blocks, block_size, Hkv, D]
// contiguous, block_tables [B, max_blocks] int64, context_lens [B] int64 -> [B, Hq * D].
at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                           at::Tensor block_tables, at::Tensor context_lens, double scale,
                           int64_t partition) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q must be [B, Hq, D] with dense heads");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "k_cache and v_cache must be contiguous [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache shapes differ");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "q, k_cache and v_cache must share a dtype");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "head_dim must match and Hq must be a multiple of Hkv");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 &&
                  block_tables.stride(1) == 1 && block_tables.size(0) == q.size(0),
              "block_tables must be [B, max_blocks] int64 with unit column stride");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.is_contiguous() &&
                  context_lens.numel() == q.size(0),
              "context_lens must be [B] int64");
  TORCH_CHECK(partition > 0, "partition must be positive");
  auto out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    switch (q.size(2)) {
      case 32: run<scalar_t, 32>(q, k_cache, v_cache, block_tables, context_lens, scale, partition, out); break;
      case 64: run<scalar_t, 64>(q, k_cache, v_cache, block_tables, context_lens, scale, partition, out); break;
      case 128: run<scalar_t, 128>(q, k_cache, v_cache, block_tables, context_lens, scale, partition, out); break;
      default: run<scalar_t, 0>(q, k_cache, v_cache, block_tables, context_lens, scale, partition, out);
    }
  });
  return out;
}
