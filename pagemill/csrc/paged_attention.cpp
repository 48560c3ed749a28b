// Paged attention for CPUs: reads K/V straight from the cache blocks (no gather copy),
// threaded over (query token x KV head), vectorised over head_dim (AVX-512).
#include "ops.h"
#include "vec.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using pagemill::load16;
using pagemill::store16;
using pagemill::tail_mask;

// One query token, one KV head: its G query heads attend to keys [lo, hi) of the request. The cache is read
// block by block in place; K/V may be stored in fp32, fp16 or bf16 (widened to fp32 in registers).
template <typename C, typename O>
inline void attend_one(const float* __restrict q, O* __restrict out, const C* __restrict k_cache,
                       const C* __restrict v_cache, const int64_t* __restrict block_row, int64_t lo, int64_t hi,
                       int64_t G, int64_t D, int64_t Hk, int64_t h, int64_t BS, float scale,
                       std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t n = hi - lo;
  scores.resize(G * n);
  acc.assign(G * D, 0.0f);
  const int64_t token_stride = Hk * D;
  for (int64_t j = lo; j < hi;) {
    const int64_t blk = block_row[j / BS], end = std::min(hi, (j / BS + 1) * BS);
    const C* base = k_cache + blk * BS * token_stride + h * D;
    for (; j < end; ++j) {
      const C* kp = base + (j % BS) * token_stride;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + g * D;
        __m512 dot = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 16) {
          const __mmask16 m = tail_mask(D - d);
          dot = _mm512_fmadd_ps(load16(qg + d, m), load16(kp + d, m), dot);
        }
        scores[g * n + (j - lo)] = _mm512_reduce_add_ps(dot) * scale;
      }
    }
  }
  // Softmax per query head; the exp loop is vectorised (glibc's libmvec) — scalar expf dominated before.
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores.data() + g * n;
    float m = std::numeric_limits<float>::lowest();
#pragma omp simd reduction(max : m)
    for (int64_t i = 0; i < n; ++i) m = std::max(m, s[i]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
      s[i] = std::exp(s[i] - m);
      sum += s[i];
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) s[i] *= inv;
  }
  for (int64_t j = lo; j < hi;) {
    const int64_t blk = block_row[j / BS], end = std::min(hi, (j / BS + 1) * BS);
    const C* base = v_cache + blk * BS * token_stride + h * D;
    for (; j < end; ++j) {
      const C* vp = base + (j % BS) * token_stride;
      for (int64_t d = 0; d < D; d += 16) {
        const __mmask16 m = tail_mask(D - d);
        const __m512 v = load16(vp + d, m);
        for (int64_t g = 0; g < G; ++g) {
          float* a = acc.data() + g * D + d;
          store16(a, _mm512_fmadd_ps(_mm512_set1_ps(scores[g * n + (j - lo)]), v, load16(a, m)), m);
        }
      }
    }
  }
  for (int64_t i = 0; i < G * D; i += 16) {
    const __mmask16 m = tail_mask(G * D - i);
    store16(out + i, load16(acc.data() + i, m), m);
  }
}

}  // namespace

// out, q: [T, Hq, D] (q fp32; out fp32, fp16 or bf16: the dtype o_proj wants); k_cache, v_cache:
// [num_blocks, block_size, Hk, D] (fp32, fp16 or bf16, contiguous); block_tables: [B, max_blocks] int64;
// query_start_loc: [B + 1]; context_lens: [B] tokens cached before this step. Token i of request r sits at
// position context_lens[r] + i - query_start_loc[r] and attends causally (and within `window` keys when
// window > 0).
void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                     torch::Tensor block_tables, torch::Tensor query_start_loc, torch::Tensor context_lens,
                     double scale, int64_t window) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32, "paged_attention: q must be float32");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "paged_attention: K and V caches differ in dtype");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(block_tables.is_contiguous() && block_tables.scalar_type() == torch::kInt64);
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), Hk = k_cache.size(2);
  const int64_t G = Hq / Hk, MB = block_tables.size(1), B = context_lens.size(0);
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* ctx = context_lens.data_ptr<int64_t>();
  std::vector<int64_t> tok_req(T);
  for (int64_t r = 0; r < B; ++r)
    for (int64_t t = qsl[r]; t < qsl[r + 1]; ++t) tok_req[t] = r;
  const float* qp = q.data_ptr<float>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);
  PAGEMILL_DISPATCH_FLOAT(k_cache.scalar_type(), C, [&] {
    PAGEMILL_DISPATCH_FLOAT(out.scalar_type(), O, [&] {
      const C* kc = k_cache.data_ptr<C>();
      const C* vc = v_cache.data_ptr<C>();
      O* op = out.data_ptr<O>();
      at::parallel_for(0, T * Hk, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scores, acc;
        for (int64_t w = begin; w < end; ++w) {
          const int64_t t = w / Hk, h = w % Hk, r = tok_req[t];
          const int64_t pos = ctx[r] + t - qsl[r];
          const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
          attend_one(qp + (t * Hq + h * G) * D, op + (t * Hq + h * G) * D, kc, vc, bt + r * MB, lo, pos + 1, G,
                     D, Hk, h, BS, sc, scores, acc);
        }
      });
    });
  });
}
