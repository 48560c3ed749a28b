// Small-M linear layers (y = x W^T + b, M = 1..16 rows) for decode: the weights are streamed once from
// memory, so the kernels are "vertical" GEMVs over a packed layout that needs no horizontal reductions.
//
// Packed layout: W [N, K] -> [N/NT (rounded up), K, NT] with NT = 64 output channels per tile, so a tile is
// one contiguous stream and each k step is one row of NT weights, multiplied by the broadcast x[m][k] of
// each row m into register accumulators (fp32). Channels beyond N are zero padding.
//   fp16: packed [T, K, NT] float16.
//   int8: q [T, Kp, NT] int8 (K padded to a multiple of the group size G with zeros) and scales
//         [T, Kp / G, NT] float32, symmetric per (output channel, group of G along K): w = q * scale.
#include "ops.h"
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t NT = 64;      // output channels per tile (4 zmm)
constexpr int NV = NT / 16;     // zmm vectors per row of a tile
constexpr int MR_MAX = 6;       // rows per register block: 6 x 4 accumulators + 4 weights + 1 broadcast
constexpr int64_t KB = 256;     // k block when x has several row blocks: one tile block (32 KiB fp16) stays in L1

// Software prefetch across 4 KiB pages, which the hardware streamers do not cross: per core, it gives ~20% more
// DRAM bandwidth at M = 1. Distances are in bytes ahead of row k; measured on the per-token weight set.
struct F16W {
  const at::Half* w;
  inline __m512 load(int64_t k, int v) const {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * NT + v * 16)));
  }
  inline void prefetch(int64_t k) const {  // a row is 2 lines; an L1 prefetch as well measured slower
    const char* p = reinterpret_cast<const char*>(w + k * NT) + 8192;
    _mm_prefetch(p, _MM_HINT_T1);
    _mm_prefetch(p + 64, _MM_HINT_T1);
  }
};

struct I8W {
  const int8_t* w;
  inline __m512 load(int64_t k, int v) const {
    __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * NT + v * 16));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
  }
  inline void prefetch(int64_t k) const {  // a row is 1 line
    const char* p = reinterpret_cast<const char*>(w + k * NT);
    _mm_prefetch(p + 2048, _MM_HINT_T0);
    _mm_prefetch(p + 16384, _MM_HINT_T1);
  }
};

// acc[m][:] (+)= scale * sum_{k0<=k<k1} x[m][k] * W[k][:] for MR rows of x (row stride ldx) and one tile.
// scale == nullptr means 1; first == true overwrites acc instead of adding.
template <int MR, class W>
inline void block(const W& w, const float* x, int64_t ldx, int64_t k0, int64_t k1, float* acc,
                  const float* scale, bool first) {
  __m512 c[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) c[m][v] = _mm512_setzero_ps();
  for (int64_t k = k0; k < k1; ++k) {
    w.prefetch(k);
    __m512 b[NV];
    for (int v = 0; v < NV; ++v) b[v] = w.load(k, v);
    for (int m = 0; m < MR; ++m) {
      const __m512 xm = _mm512_set1_ps(x[m * ldx + k]);
      for (int v = 0; v < NV; ++v) c[m][v] = _mm512_fmadd_ps(b[v], xm, c[m][v]);
    }
  }
  for (int v = 0; v < NV; ++v) {
    const __m512 s = scale ? _mm512_loadu_ps(scale + v * 16) : _mm512_set1_ps(1.0f);
    for (int m = 0; m < MR; ++m) {
      float* a = acc + m * NT + v * 16;
      const __m512 prev = first ? _mm512_setzero_ps() : _mm512_loadu_ps(a);
      _mm512_storeu_ps(a, _mm512_fmadd_ps(c[m][v], s, prev));
    }
  }
}

template <class W>
inline void block_rows(int mr, const W& w, const float* x, int64_t ldx, int64_t k0, int64_t k1, float* acc,
                       const float* scale, bool first) {
  switch (mr) {
    case 1: return block<1>(w, x, ldx, k0, k1, acc, scale, first);
    case 2: return block<2>(w, x, ldx, k0, k1, acc, scale, first);
    case 3: return block<3>(w, x, ldx, k0, k1, acc, scale, first);
    case 4: return block<4>(w, x, ldx, k0, k1, acc, scale, first);
    case 5: return block<5>(w, x, ldx, k0, k1, acc, scale, first);
    default: return block<6>(w, x, ldx, k0, k1, acc, scale, first);
  }
}

// x as fp32 rows: a view of x if it already is, else a converted copy.
torch::Tensor as_f32(const torch::Tensor& x) {
  return x.scalar_type() == at::kFloat ? x : x.to(at::kFloat).contiguous();
}

void check_io(const torch::Tensor& out, const torch::Tensor& x, int64_t K, int64_t tiles, int64_t N,
              const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == K, "gemv: x must be contiguous [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf, "gemv: x must be float32 or float16");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == x.size(0), "gemv: out must be contiguous [M, N]");
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kHalf,
              "gemv: out must be float32 or float16");
  TORCH_CHECK(N <= tiles * NT, "gemv: out has more columns than the packed weight");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              "gemv: bias must be contiguous float32 [N]");
}

// Runs the tiles [t0, t1) of y = x W^T + b. `make(t)` gives tile t's weight stream; `scales(t, k)` the
// scales of the group holding k (nullptr for unscaled weights), constant over [k, next_group(k)).
template <class MakeW, class Scales, class NextGroup>
void run(torch::Tensor& out, const float* x, int64_t M, int64_t K, int64_t N, const float* bias, int64_t tiles,
         MakeW make, Scales scales, NextGroup next_group) {
  const bool half_out = out.scalar_type() == at::kHalf;
  float* out_f = half_out ? nullptr : out.data_ptr<float>();
  at::Half* out_h = half_out ? out.data_ptr<at::Half>() : nullptr;
  const int64_t nblk = (M + MR_MAX - 1) / MR_MAX;
  const int64_t mr = (M + nblk - 1) / nblk;  // balanced row blocks: 8 rows = 4 + 4, not 6 + 2
  const int64_t kb = nblk == 1 ? K : KB;     // one row block reads each weight once anyway
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    alignas(64) float acc[16 * NT];
    for (int64_t t = t0; t < t1; ++t) {
      const auto w = make(t);
      for (int64_t k0 = 0; k0 < K;) {
        const int64_t k1 = std::min({k0 + kb, K, next_group(k0)});
        for (int64_t m0 = 0; m0 < M; m0 += mr)
          block_rows(static_cast<int>(std::min(mr, M - m0)), w, x + m0 * K, K, k0, k1, acc + m0 * NT,
                     scales(t, k0), k0 == 0);
        k0 = k1;
      }
      const int64_t n0 = t * NT;
      const int64_t nn = std::min(NT, N - n0);
      const __mmask64 live = nn == 64 ? ~__mmask64(0) : (__mmask64(1) << nn) - 1;
      for (int v = 0; v < NV; ++v) {
        const __mmask16 mask = static_cast<__mmask16>(live >> (v * 16));
        if (!mask) break;
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0 + v * 16) : _mm512_setzero_ps();
        for (int64_t m = 0; m < M; ++m) {
          const __m512 y = _mm512_add_ps(_mm512_loadu_ps(acc + m * NT + v * 16), b);
          const int64_t o = m * N + n0 + v * 16;
          if (half_out)
            _mm256_mask_storeu_epi16(out_h + o, mask, _mm512_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT));
          else
            _mm512_mask_storeu_ps(out_f + o, mask, y);
        }
      }
    }
  });
}

// [Np, Kp] -> [Np / NT, Kp, NT]
torch::Tensor to_tiles(const torch::Tensor& w) {
  return w.view({w.size(0) / NT, NT, w.size(1)}).transpose(1, 2).contiguous();
}

}  // namespace

torch::Tensor pack_gemv_weight_f16(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.is_floating_point(), "pack_gemv_weight_f16: w must be a float [N, K] matrix");
  const int64_t N = w.size(0), Np = (N + NT - 1) / NT * NT;
  auto wp = torch::constant_pad_nd(w.to(at::kHalf), {0, 0, 0, Np - N});
  return to_tiles(wp);
}

void gemv_f16(torch::Tensor out, torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == NT && packed.scalar_type() == at::kHalf && packed.is_contiguous(),
              "gemv_f16: packed must come from pack_gemv_weight_f16");
  const int64_t K = packed.size(1), tiles = packed.size(0), M = x.size(0), N = out.size(1);
  check_io(out, x, K, tiles, N, bias);
  TORCH_CHECK(M <= 16, "gemv_f16: at most 16 rows");
  if (M == 0 || N == 0) return;
  const auto xf = as_f32(x);
  const at::Half* wp = packed.data_ptr<at::Half>();
  run(out, xf.data_ptr<float>(), M, K, N, bias ? bias->data_ptr<float>() : nullptr, tiles,
      [&](int64_t t) { return F16W{wp + t * K * NT}; },
      [](int64_t, int64_t) -> const float* { return nullptr; }, [&](int64_t) { return K; });
}

std::vector<torch::Tensor> pack_gemv_weight_int8(torch::Tensor w, int64_t group_size) {
  TORCH_CHECK(w.dim() == 2 && w.is_floating_point(), "pack_gemv_weight_int8: w must be a float [N, K] matrix");
  TORCH_CHECK(group_size > 0, "pack_gemv_weight_int8: group_size must be positive");
  const int64_t N = w.size(0), K = w.size(1), Np = (N + NT - 1) / NT * NT;
  const int64_t G = std::min(group_size, K), Kp = (K + G - 1) / G * G;
  auto wf = torch::constant_pad_nd(w.to(at::kFloat), {0, Kp - K, 0, Np - N});
  auto groups = wf.view({Np, Kp / G, G});
  auto scale = groups.abs().amax(-1, /*keepdim=*/true) / 127.0;
  auto q = (groups / torch::where(scale > 0, scale, torch::ones_like(scale))).round().clamp(-127, 127);
  return {to_tiles(q.to(at::kChar).view({Np, Kp})), to_tiles(scale.view({Np, Kp / G}))};
}

void gemv_int8(torch::Tensor out, torch::Tensor x, torch::Tensor packed_q, torch::Tensor scales,
               c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(packed_q.dim() == 3 && packed_q.size(2) == NT && packed_q.scalar_type() == at::kChar &&
                  packed_q.is_contiguous(),
              "gemv_int8: packed_q must come from pack_gemv_weight_int8");
  const int64_t tiles = packed_q.size(0), Kp = packed_q.size(1), M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == tiles && scales.size(2) == NT && scales.size(1) > 0 &&
                  Kp % scales.size(1) == 0 && scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "gemv_int8: scales must come from pack_gemv_weight_int8");
  const int64_t ng = scales.size(1), G = Kp / ng;
  TORCH_CHECK(K <= Kp && Kp - K < G, "gemv_int8: x has ", K, " columns, the packed weight ", Kp, " (padded)");
  check_io(out, x, K, tiles, N, bias);
  TORCH_CHECK(M <= 16, "gemv_int8: at most 16 rows");
  if (M == 0 || N == 0) return;
  const auto xf = as_f32(x);
  const int8_t* qp = packed_q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  run(out, xf.data_ptr<float>(), M, K, N, bias ? bias->data_ptr<float>() : nullptr, tiles,
      [&](int64_t t) { return I8W{qp + t * Kp * NT}; },
      [&](int64_t t, int64_t k) { return sp + (t * ng + k / G) * NT; },
      [&](int64_t k) { return (k / G + 1) * G; });
}
