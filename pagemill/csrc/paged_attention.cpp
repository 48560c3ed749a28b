// Paged attention for CPUs: reads K/V straight from the cache blocks (no gather copy), threaded over
// (query token x KV head), AVX-512 over 16 keys at a time (K blocks stored transposed) and over head_dim for V.
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

constexpr int kMaxGroup = 8;  // query heads per KV head handled in registers at once

// Blocks sit anywhere in the cache, so the hardware prefetcher cannot see the next one coming: ask for it.
inline void prefetch_rows(const void* p, int64_t rows, int64_t row_bytes, int64_t stride_bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(c + r * stride_bytes + b, _MM_HINT_T0);
}

// Scores of G query heads (q: [G, D]) against the keys [c0, c0 + 16) of one block's K, stored transposed
// ([D, BS] for this head): each step loads 16 keys' d-th element and FMAs it with every head's q[d] —
// no horizontal reductions.
template <int G, typename C>
inline void qk_chunk(const float* __restrict q, const C* __restrict kt, int64_t D, int64_t BS, int64_t c0,
                     __mmask16 m, float scale, float* __restrict scores, int64_t n) {
  // U partial sums per head over interleaved d break the FMA latency chain (64 dependent FMAs otherwise).
  constexpr int U = G <= 4 ? 4 : 2;
  __m512 acc[G][U];
  for (int g = 0; g < G; ++g)
    for (int u = 0; u < U; ++u) acc[g][u] = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + U <= D; d += U)
    for (int u = 0; u < U; ++u) {
      const __m512 k = load16(kt + (d + u) * BS + c0, m);
      for (int g = 0; g < G; ++g) acc[g][u] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * D + d + u]), k, acc[g][u]);
    }
  for (; d < D; ++d) {
    const __m512 k = load16(kt + d * BS + c0, m);
    for (int g = 0; g < G; ++g) acc[g][0] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * D + d]), k, acc[g][0]);
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int g = 0; g < G; ++g) {
    __m512 sum = acc[g][0];
    for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, acc[g][u]);
    _mm512_mask_storeu_ps(scores + g * n, m, _mm512_mul_ps(sum, sc));
  }
}

// acc[g, d0:d0+64] += sum_j p[g, j] * V[j, d0:d0+64] over `count` keys whose rows start at v (stride vs); the
// (up to) four 16-lane chunks of each row are independent FMA chains.
template <int G, typename C>
inline void pv_chunk(const float* __restrict p, int64_t n, const C* __restrict v, int64_t vs, int64_t count,
                     int64_t d0, int64_t D, float* __restrict acc) {
  constexpr int U = 4;
  __mmask16 m[U];
  for (int u = 0; u < U; ++u) m[u] = d0 + 16 * u < D ? tail_mask(D - d0 - 16 * u) : __mmask16(0);
  __m512 a[G][U];
  for (int g = 0; g < G; ++g)
    for (int u = 0; u < U; ++u) a[g][u] = load16(acc + g * D + d0 + 16 * u, m[u]);
  for (int64_t j = 0; j < count; ++j) {
    const C* row = v + j * vs + d0;
    for (int u = 0; u < U; ++u) {
      const __m512 x = load16(row + 16 * u, m[u]);
      for (int g = 0; g < G; ++g) a[g][u] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * n + j]), x, a[g][u]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int u = 0; u < U; ++u) store16(acc + g * D + d0 + 16 * u, a[g][u], m[u]);
}

// One query token, one KV head: its G query heads attend to keys [lo, hi) of the request, read block by block
// in place. Scores are computed for whole 16-key chunks (the extra keys of a partial chunk are ignored).
template <typename C, typename O>
inline void attend_one(const float* __restrict q, O* __restrict out, const C* __restrict k_cache,
                       const C* __restrict v_cache, const int64_t* __restrict block_row, int64_t lo, int64_t hi,
                       int64_t G, int64_t D, int64_t Hk, int64_t h, int64_t BS, float scale,
                       std::vector<float>& scores, std::vector<float>& acc) {
  // scores[g * n + i] is key first + i; n rounds up to whole 16-key chunks, which qk_chunk writes in full
  const int64_t first = (lo / BS) * BS, n = (hi - first + 15) / 16 * 16;
  scores.resize(G * n);
  acc.assign(G * D, 0.0f);
  const int64_t block_elems = BS * Hk * D;
  for (int64_t b0 = first; b0 < hi; b0 += BS) {
    const C* kt = k_cache + block_row[b0 / BS] * block_elems + h * D * BS;
    if (b0 + BS < hi) prefetch_rows(k_cache + block_row[b0 / BS + 1] * block_elems + h * D * BS, 1, D * BS * sizeof(C), 0);
    else prefetch_rows(v_cache + block_row[first / BS] * block_elems + h * D, BS, D * sizeof(C), Hk * D * sizeof(C));
    for (int64_t c0 = 0; c0 < BS && b0 + c0 < hi; c0 += 16) {
      const __mmask16 m = tail_mask(BS - c0);
      for (int64_t g0 = 0; g0 < G; g0 += kMaxGroup)
        pagemill::with_static_count<kMaxGroup>(int(std::min<int64_t>(kMaxGroup, G - g0)), [&](auto g) {
          qk_chunk<decltype(g)::value>(q + g0 * D, kt, D, BS, c0, m, scale,
                                       scores.data() + g0 * n + (b0 + c0 - first), n);
        });
    }
  }
  // Softmax per query head over keys [lo, hi); the exp loop is vectorised (glibc's libmvec).
  const int64_t skip = lo - first;
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores.data() + g * n;
    for (int64_t i = 0; i < skip; ++i) s[i] = 0.0f;
    s += skip;
    const int64_t len = hi - lo;
    float mx = std::numeric_limits<float>::lowest();
#pragma omp simd reduction(max : mx)
    for (int64_t i = 0; i < len; ++i) mx = std::max(mx, s[i]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < len; ++i) {
      s[i] = std::exp(s[i] - mx);
      sum += s[i];
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) s[i] *= inv;
  }
  const int64_t vs = Hk * D;
  for (int64_t b0 = first; b0 < hi; b0 += BS) {
    const C* vb = v_cache + block_row[b0 / BS] * block_elems + h * D;
    if (b0 + BS < hi)
      prefetch_rows(v_cache + block_row[b0 / BS + 1] * block_elems + h * D, BS, D * sizeof(C), Hk * D * sizeof(C));
    const int64_t count = std::min(BS, hi - b0);
    for (int64_t d0 = 0; d0 < D; d0 += 64)
      for (int64_t g0 = 0; g0 < G; g0 += kMaxGroup)
        pagemill::with_static_count<kMaxGroup>(int(std::min<int64_t>(kMaxGroup, G - g0)), [&](auto g) {
          pv_chunk<decltype(g)::value>(scores.data() + g0 * n + (b0 - first), n, vb, vs, count, d0, D,
                                       acc.data() + g0 * D);
        });
  }
  for (int64_t i = 0; i < G * D; i += 16) {
    const __mmask16 m = tail_mask(G * D - i);
    store16(out + i, load16(acc.data() + i, m), m);
  }
}

// Every (query token, KV head) pair, scheduled dynamically over the threads: an item's cost is its context
// length, which varies a lot within a batch (static halves left one thread idle while the other did the
// long sequences).
template <typename C, typename O>
void attend_all(const float* qp, O* op, const C* kc, const C* vc, const int64_t* bt, const int64_t* tok_req,
                const int64_t* qsl, const int64_t* ctx, int64_t T, int64_t Hq, int64_t Hk, int64_t D, int64_t BS,
                int64_t MB, float sc, int64_t window) {
  const int64_t G = Hq / Hk;
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> scores, acc;
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < T * Hk; ++w) {
      const int64_t t = w / Hk, h = w % Hk, r = tok_req[t];
      const int64_t pos = ctx[r] + t - qsl[r];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      attend_one(qp + (t * Hq + h * G) * D, op + (t * Hq + h * G) * D, kc, vc, bt + r * MB, lo, pos + 1, G, D,
                 Hk, h, BS, sc, scores, acc);
    }
  }
}

}  // namespace

// out, q: [T, Hq, D] (q fp32; out fp32, fp16 or bf16: the dtype o_proj wants). k_cache, v_cache: [num_blocks,
// block_size, Hk, D] extents (fp32, fp16 or bf16, contiguous); V blocks are [block_size, Hk, D], K blocks are
// stored transposed, [Hk, D, block_size] (rope_and_cache writes them so). block_tables: [B, max_blocks] int64;
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
  const float sc = static_cast<float>(scale);
  PAGEMILL_DISPATCH_FLOAT(k_cache.scalar_type(), C, [&] {
    PAGEMILL_DISPATCH_FLOAT(out.scalar_type(), O, [&] {
      attend_all(q.data_ptr<float>(), out.data_ptr<O>(), k_cache.data_ptr<C>(), v_cache.data_ptr<C>(),
                 block_tables.data_ptr<int64_t>(), tok_req.data(), qsl, ctx, T, Hq, Hk, D, BS, MB, sc, window);
    });
  });
}
