// Paged attention for CPUs: reads K/V straight from the cache blocks (no gather copy), threaded over
// (query token x KV head), W keys per vector (K blocks stored transposed) and W head dims per vector for V.
#include "simd.h"

namespace pagemill {
namespace PAGEMILL_ISA {
namespace {

// Query heads per KV head handled in registers at once: G x U score accumulators must fit the register file.
constexpr int kMaxGroup = kVecRegs >= 32 ? 8 : 4;

// Blocks sit anywhere in the cache, so the hardware prefetcher cannot see the next one coming: ask for it.
inline void prefetch_rows(const void* p, int64_t rows, int64_t row_bytes, int64_t stride_bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < row_bytes; b += 64) prefetch_l1(c + r * stride_bytes + b);
}

// Scores of G query heads (q: [G, D]) against `nk` (<= W) keys from c0 of one block's K, stored transposed ([D, BS]
// for this head): each step loads W keys' d-th element and FMAs it with every head's q[d], so no horizontal sums.
template <int G, typename C>
inline void qk_chunk(const float* __restrict q, const C* __restrict kt, int64_t D, int64_t BS, int64_t c0,
                     int64_t nk, float scale, float* __restrict scores, int64_t n) {
  // U partial sums per head over interleaved d break the FMA latency chain (64 dependent FMAs otherwise).
  constexpr int U = G * 4 + 2 <= kVecRegs ? 4 : 2;
  vf acc[G][U];
  for (int g = 0; g < G; ++g)
    for (int u = 0; u < U; ++u) acc[g][u] = vzero();
  int64_t d = 0;
  for (; d + U <= D; d += U)
    for (int u = 0; u < U; ++u) {
      const vf k = vloadn(kt + (d + u) * BS + c0, nk);
      for (int g = 0; g < G; ++g) acc[g][u] = vfma(vset(q[g * D + d + u]), k, acc[g][u]);
    }
  for (; d < D; ++d) {
    const vf k = vloadn(kt + d * BS + c0, nk);
    for (int g = 0; g < G; ++g) acc[g][0] = vfma(vset(q[g * D + d]), k, acc[g][0]);
  }
  const vf sc = vset(scale);
  for (int g = 0; g < G; ++g) {
    vf sum = acc[g][0];
    for (int u = 1; u < U; ++u) sum = vadd(sum, acc[g][u]);
    vstoren(scores + g * n, vmul(sum, sc), nk);
  }
}

// acc[g, d0 : d0 + U W] += sum_j p[g, j] * V[j, d0 : d0 + U W] over `count` keys whose rows start at v (stride vs);
// the U W-lane chunks of each row are independent FMA chains.
template <int G, typename C>
inline void pv_chunk(const float* __restrict p, int64_t n, const C* __restrict v, int64_t vs, int64_t count,
                     int64_t d0, int64_t D, float* __restrict acc) {
  constexpr int U = G * 4 + 2 <= kVecRegs ? 4 : 2;
  int64_t len[U];
  for (int u = 0; u < U; ++u) len[u] = imax(0, D - d0 - W * u);
  vf a[G][U];
  for (int g = 0; g < G; ++g)
    for (int u = 0; u < U; ++u) a[g][u] = len[u] ? vloadn(acc + g * D + d0 + W * u, len[u]) : vzero();
  for (int64_t j = 0; j < count; ++j) {
    const C* row = v + j * vs + d0;
    for (int u = 0; u < U; ++u) {
      if (!len[u]) break;
      const vf x = vloadn(row + W * u, len[u]);
      for (int g = 0; g < G; ++g) a[g][u] = vfma(vset(p[g * n + j]), x, a[g][u]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int u = 0; u < U; ++u)
      if (len[u]) vstoren(acc + g * D + d0 + W * u, a[g][u], len[u]);
}

// One query token, one KV head: its G query heads attend to keys [lo, hi) of the request, read block by block in
// place. Scores are computed for whole chunks of min(W, BS) keys; the extra keys of a partial chunk are ignored.
template <typename C, typename O>
inline void attend_one(const float* __restrict q, O* __restrict out, const C* __restrict k_cache,
                       const C* __restrict v_cache, const int64_t* __restrict block_row, int64_t lo, int64_t hi,
                       int64_t G, int64_t D, int64_t Hk, int64_t h, int64_t BS, float scale, Scratch& score_buf,
                       Scratch& acc_buf) {
  // scores[g * n + i] is key first + i; n has room for whole chunks past hi
  const int64_t first = (lo / BS) * BS, n = round_up(hi - first, BS) + W;
  float* scores = score_buf.get(G * n);
  float* acc = acc_buf.get(G * D);
  for (int64_t i = 0; i < G * D; ++i) acc[i] = 0.0f;
  const int64_t block_elems = BS * Hk * D;
  for (int64_t b0 = first; b0 < hi; b0 += BS) {
    const C* kt = k_cache + block_row[b0 / BS] * block_elems + h * D * BS;
    if (b0 + BS < hi)
      prefetch_rows(k_cache + block_row[b0 / BS + 1] * block_elems + h * D * BS, 1, D * BS * int64_t(sizeof(C)), 0);
    else
      prefetch_rows(v_cache + block_row[first / BS] * block_elems + h * D, BS, D * int64_t(sizeof(C)),
                    Hk * D * int64_t(sizeof(C)));
    for (int64_t c0 = 0; c0 < BS && b0 + c0 < hi; c0 += W) {
      const int64_t nk = imin(W, BS - c0);
      for (int64_t g0 = 0; g0 < G; g0 += kMaxGroup)
        with_static_count<kMaxGroup>(int(imin(kMaxGroup, G - g0)), [&](auto g) {
          qk_chunk<decltype(g)::value>(q + g0 * D, kt, D, BS, c0, nk, scale, scores + g0 * n + (b0 + c0 - first), n);
        });
    }
  }
  // Softmax per query head over keys [lo, hi); the exp loop is vectorised (glibc's libmvec).
  const int64_t skip = lo - first, len = hi - lo;
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * n;
    for (int64_t i = 0; i < skip; ++i) s[i] = 0.0f;
    s += skip;
    float mx = -FLT_MAX;
#pragma omp simd reduction(max : mx)
    for (int64_t i = 0; i < len; ++i) mx = s[i] > mx ? s[i] : mx;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < len; ++i) {
      s[i] = expf(s[i] - mx);
      sum += s[i];
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) s[i] *= inv;
  }
  const int64_t vs = Hk * D;
  constexpr int64_t kPvDims = 4 * W;  // dims per pv_chunk pass (U = 4 at most)
  for (int64_t b0 = first; b0 < hi; b0 += BS) {
    const C* vb = v_cache + block_row[b0 / BS] * block_elems + h * D;
    if (b0 + BS < hi)
      prefetch_rows(v_cache + block_row[b0 / BS + 1] * block_elems + h * D, BS, D * int64_t(sizeof(C)),
                    Hk * D * int64_t(sizeof(C)));
    const int64_t count = imin(BS, hi - b0);
    for (int64_t g0 = 0; g0 < G; g0 += kMaxGroup)
      with_static_count<kMaxGroup>(int(imin(kMaxGroup, G - g0)), [&](auto g) {
        constexpr int Gc = decltype(g)::value;
        constexpr int64_t step = (Gc * 4 + 2 <= kVecRegs ? 4 : 2) * W;
        static_assert(step <= kPvDims, "pv_chunk covers at most 4 W dims");
        for (int64_t d0 = 0; d0 < D; d0 += step)
          pv_chunk<Gc>(scores + g0 * n + (b0 - first), n, vb, vs, count, d0, D, acc + g0 * D);
      });
  }
  for (int64_t i = 0; i < G * D; i += W) vstoren(out + i, vloadn(acc + i, G * D - i), G * D - i);
}

// Every (query token, KV head) pair, scheduled dynamically over the threads: an item's cost is its context length,
// which varies a lot within a batch (static halves left one thread idle while the other did the long sequences).
template <typename C, typename O>
void attend_all(const PagedAttentionArgs& a) {
  const float* qp = a.q;
  O* op = static_cast<O*>(a.out);
  const C* kc = static_cast<const C*>(a.k_cache);
  const C* vc = static_cast<const C*>(a.v_cache);
  const int64_t Hq = a.Hq, Hk = a.Hk, D = a.D, G = Hq / Hk, items = a.T * Hk;
#pragma omp parallel num_threads(a.num_threads) if (items > 1)
  {
    Scratch scores, acc;
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < items; ++w) {
      const int64_t t = w / Hk, h = w % Hk, r = a.token_request[t];
      const int64_t pos = a.context_lens[r] + t - a.query_start_loc[r];
      const int64_t lo = a.window > 0 ? imax(0, pos - a.window + 1) : 0;
      attend_one(qp + (t * Hq + h * G) * D, op + (t * Hq + h * G) * D, kc, vc, a.block_tables + r * a.MB, lo,
                 pos + 1, G, D, Hk, h, a.BS, a.scale, scores, acc);
    }
  }
}

}  // namespace

void paged_attention(const PagedAttentionArgs& a) {
  with_float_type(a.cache_dtype, [&](auto c) {
    with_float_type(a.out_dtype, [&](auto o) { attend_all<decltype(c), decltype(o)>(a); });
  });
}

}  // namespace PAGEMILL_ISA
}  // namespace pagemill
