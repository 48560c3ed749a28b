// Weight packing for the GEMV kernels (run once at load; compiled with baseline flags, like the bindings):
// fp16 and int8 tiles, and the Q4_1 records recovered from dequantized weights. Layouts: variant/gemv.cpp.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "packing.h"

namespace {

constexpr int64_t NT = 64;  // output channels per tile
constexpr int64_t Q4_DM = 4 * NT;
constexpr int64_t Q4_MAX_GROUP = 256;

int64_t q4_record_bytes(int64_t G) { return G / 2 * NT + Q4_DM; }

// [Np, Kp] -> [Np / NT, Kp, NT]
torch::Tensor to_tiles(const torch::Tensor& w) {
  return w.view({w.size(0) / NT, NT, w.size(1)}).transpose(1, 2).contiguous();
}

// Fits one group w[0, G) as d * q + m with fp16 d >= 0 and m: writes q and returns max |d * q + m - w|.
// First the standard Q4_1 fit (m = min, d = (max - min) / 15), which recovers any GGUF-quantized group (its
// codes span 0..15). A group of at most 16 distinct values whose codes do not (q in [o, o + j], j < 15) is then
// searched over (j, o): d = (max - min) / j, m = min - o * d, keeping the best fit (a wrong (j, o) can miss by
// little more than rounding when fp16(m) happens to land close).
float q4_fit_group(const float* w, int64_t G, uint8_t* q, at::Half& d_out, at::Half& m_out) {
  float lo = w[0], hi = w[0];
  for (int64_t k = 1; k < G; ++k) {
    lo = std::min(lo, w[k]);
    hi = std::max(hi, w[k]);
  }
  const float amax = std::max(std::fabs(lo), std::fabs(hi));
  if (!(amax <= 32768.0f)) {  // d or m would overflow fp16 (or w is not finite): not representable
    std::fill(q, q + G, 0);
    d_out = m_out = at::Half(0.0f);
    return std::numeric_limits<float>::max();
  }
  uint8_t cand[Q4_MAX_GROUP];
  auto fit = [&](int j, int o, uint8_t* qo, at::Half& dh, at::Half& mh) {
    dh = at::Half((hi - lo) / static_cast<float>(j));
    const float d = dh;
    mh = at::Half(lo - static_cast<float>(o) * d);
    const float m = mh;
    float err = 0.0f;
    for (int64_t k = 0; k < G; ++k) {
      const int qk = d > 0.0f ? std::min(15, std::max(0, static_cast<int>(std::nearbyint((w[k] - m) / d)))) : 0;
      qo[k] = static_cast<uint8_t>(qk);
      err = std::max(err, std::fabs(d * static_cast<float>(qk) + m - w[k]));
    }
    return err;
  };
  float best = fit(15, 0, q, d_out, m_out);
  if (best <= amax * 0x1p-22f) return best;  // the roundings of d * q + m (here and in the dequantization)
  float sorted[Q4_MAX_GROUP];
  std::copy(w, w + G, sorted);
  std::sort(sorted, sorted + G);
  if (std::unique(sorted, sorted + G) - sorted > 16) return best;
  for (int j = 15; j >= 1; --j) {
    for (int o = j == 15 ? 1 : 0; o + j <= 15; ++o) {
      at::Half dh, mh;
      const float err = fit(j, o, cand, dh, mh);
      if (err < best) {
        best = err;
        std::copy(cand, cand + G, q);
        d_out = dh;
        m_out = mh;
        if (best == 0.0f) return best;
      }
    }
  }
  return best;
}

// Fits every group of w (fp32 [N, K], contiguous); writes the packed layout when `packed` is not null.
// Returns max |d * q + m - w| / max |w|.
double q4_fit(const torch::Tensor& w, int64_t G, uint8_t* packed) {
  const int64_t N = w.size(0), K = w.size(1), ng = K / G, R = q4_record_bytes(G);
  const float* wp = w.data_ptr<float>();
  std::vector<float> row_err(N, 0.0f), row_max(N, 0.0f);
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    uint8_t q[Q4_MAX_GROUP];
    for (int64_t n = n0; n < n1; ++n) {
      const int64_t c = n % NT;
      for (int64_t g = 0; g < ng; ++g) {
        const float* wg = wp + n * K + g * G;
        at::Half d, m;
        row_err[n] = std::max(row_err[n], q4_fit_group(wg, G, q, d, m));
        for (int64_t k = 0; k < G; ++k) row_max[n] = std::max(row_max[n], std::fabs(wg[k]));
        if (!packed) continue;
        uint8_t* rec = packed + ((n / NT) * ng + g) * R;
        for (int64_t i = 0; i < G / 2; ++i) rec[i * NT + c] = static_cast<uint8_t>(q[2 * i] | q[2 * i + 1] << 4);
        at::Half* dm = reinterpret_cast<at::Half*>(rec + G / 2 * NT);
        dm[c] = d;
        dm[NT + c] = m;
      }
    }
  });
  const float err = *std::max_element(row_err.begin(), row_err.end());
  const float wmax = *std::max_element(row_max.begin(), row_max.end());
  if (err == std::numeric_limits<float>::max()) return std::numeric_limits<double>::infinity();
  return wmax > 0.0f ? static_cast<double>(err) / wmax : 0.0;
}

torch::Tensor q4_check_weight(const torch::Tensor& w, int64_t G, const char* fn) {
  TORCH_CHECK(w.dim() == 2 && w.is_floating_point(), fn, ": w must be a float [N, K] matrix");
  TORCH_CHECK(G >= 2 && G % 2 == 0 && G <= Q4_MAX_GROUP, fn, ": group_size must be even, in [2, 256]");
  TORCH_CHECK(w.size(1) % G == 0, fn, ": K (", w.size(1), ") must be a multiple of group_size (", G, ")");
  return w.to(at::kFloat).contiguous();
}

}  // namespace

torch::Tensor pack_gemv_weight_f16(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.is_floating_point(), "pack_gemv_weight_f16: w must be a float [N, K] matrix");
  const int64_t N = w.size(0), Np = (N + NT - 1) / NT * NT;
  auto wp = torch::constant_pad_nd(w.to(at::kHalf), {0, 0, 0, Np - N});
  return to_tiles(wp);
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

std::vector<torch::Tensor> pack_gemv_weight_q4(torch::Tensor w, int64_t group_size) {
  const auto wf = q4_check_weight(w, group_size, "pack_gemv_weight_q4");
  const int64_t N = wf.size(0), K = wf.size(1), G = group_size;
  auto packed = torch::zeros({(N + NT - 1) / NT, K / G, q4_record_bytes(G)}, torch::dtype(at::kByte));
  const double err = q4_fit(wf, G, packed.data_ptr<uint8_t>());
  return {packed, torch::scalar_tensor(err, torch::dtype(at::kDouble))};
}

double q4_max_error(torch::Tensor w, int64_t group_size) {
  return q4_fit(q4_check_weight(w, group_size, "q4_max_error"), group_size, nullptr);
}


// The LM head's int8 screen (variant/head_screen.cpp): per channel and group of 32, s = max|w| / 127 and q = round(w / s)
// (exact for GGUF Q8_0 weights: s is the block's d), laid out as q [T, K / 4, 64, 4] (four consecutive k per channel),
// scales and offsets (-128 * the group's code sum) [T, K / 32, 64]; and each channel's |w - s q| and |s q| as
// bounds [T, 2, 64] (rounded up to float32; 0 for the padding channels of the last tile).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> pack_head_screen(torch::Tensor w) {
  constexpr int64_t QG = 32;
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(1) % QG == 0,
              "pack_head_screen: w must be a contiguous float32 [N, K] matrix with K a multiple of 32");
  const int64_t N = w.size(0), K = w.size(1), G = K / QG, T = (N + NT - 1) / NT;
  auto q = torch::zeros({T, K / 4, NT, 4}, torch::dtype(at::kChar));
  auto scales = torch::zeros({T, G, NT}, torch::dtype(at::kFloat));
  auto offsets = torch::zeros({T, G, NT}, torch::dtype(at::kInt));
  auto bounds = torch::zeros({T, 2, NT}, torch::dtype(at::kFloat));
  const float* wp = w.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scales.data_ptr<float>();
  int32_t* op = offsets.data_ptr<int32_t>();
  float* bp = bounds.data_ptr<float>();
  // A norm stored as float32 must not be below its double value: rounded up by one float32 ulp.
  auto up = [](double v) { return std::nextafter(static_cast<float>(v), std::numeric_limits<float>::infinity()); };
  bool finite = true;
  at::parallel_for(0, N, 256, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int64_t t = n / NT, c = n % NT;
      double e2 = 0.0, q2 = 0.0;
      for (int64_t g = 0; g < G; ++g) {
        const float* wg = wp + n * K + g * QG;
        float amax = 0.0f;
        for (int64_t i = 0; i < QG; ++i) amax = std::max(amax, std::fabs(wg[i]));
        if (!std::isfinite(amax)) finite = false;
        const float s = amax / 127.0f;
        int32_t sum = 0;
        for (int64_t i = 0; i < QG; ++i) {
          const int k = static_cast<int>(g * QG + i);
          const int qi = s > 0.0f ? std::min(127, std::max(-127, static_cast<int>(std::nearbyint(wg[i] / s)))) : 0;
          qp[((t * (K / 4) + k / 4) * NT + c) * 4 + k % 4] = static_cast<int8_t>(qi);
          sum += qi;
          const double approx = static_cast<double>(s) * qi;
          e2 += (wg[i] - approx) * (wg[i] - approx);
          q2 += approx * approx;
        }
        sp[(t * G + g) * NT + c] = s;
        op[(t * G + g) * NT + c] = -128 * sum;
      }
      bp[(t * 2) * NT + c] = e2 > 0.0 ? up(std::sqrt(e2)) : 0.0f;
      bp[(t * 2 + 1) * NT + c] = q2 > 0.0 ? up(std::sqrt(q2)) : 0.0f;
    }
  });
  TORCH_CHECK(finite, "pack_head_screen: the weight has non-finite values");
  return {q, scales, offsets, bounds};
}
