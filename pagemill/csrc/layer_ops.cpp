// Fused per-layer elementwise ops of a Llama block (vLLM's CPU layernorm / activation / pos_encoding +
// reshape_and_cache): each replaces 5-25 small torch ops, whose dispatch cost dominated small batches.
// All math is fp32; inputs and outputs may be fp32, fp16 or bf16 (the dtype the next matmul wants).
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "ops.h"
#include "vec.h"

using namespace pagemill;

namespace {

// Rows per thread chunk such that tiny batches run inline (no thread wake-up).
int64_t row_grain(int64_t row_elems) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elems)); }

// out = weight * (x * rsqrt(mean(x^2) + eps)), over one row of H.
template <typename O>
inline void norm_row(O* out, const float* x, const float* w, int64_t H, float eps) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < H; i += 16) {
    const __mmask16 m = tail_mask(H - i);
    const __m512 v = load16(x + i, m);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(H) + eps);
  const __m512 vinv = _mm512_set1_ps(inv);
  for (int64_t i = 0; i < H; i += 16) {
    const __mmask16 m = tail_mask(H - i);
    store16(out + i, _mm512_mul_ps(load16(w + i, m), _mm512_mul_ps(load16(x + i, m), vinv)), m);
  }
}

// g = silu(g) * u, vectorised (libmvec expf).
inline void silu_mul_inplace(float* __restrict g, const float* __restrict u, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

}  // namespace

void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && weight.is_contiguous());
  TORCH_CHECK(weight.scalar_type() == at::kFloat, "rms_norm: weight must be float32");
  const int64_t H = x.size(-1), T = x.numel() / H;
  const float* w = weight.data_ptr<float>();
  PAGEMILL_DISPATCH_FLOAT(x.scalar_type(), X, [&] {
    PAGEMILL_DISPATCH_FLOAT(out.scalar_type(), O, [&] {
      const X* xp = x.data_ptr<X>();
      O* op = out.data_ptr<O>();
      at::parallel_for(0, T, row_grain(H), [&](int64_t b, int64_t e) {
        std::vector<float> row(H);
        for (int64_t t = b; t < e; ++t) {
          for (int64_t i = 0; i < H; i += 16) store16(row.data() + i, load16(xp + t * H + i, tail_mask(H - i)), tail_mask(H - i));
          norm_row(op + t * H, row.data(), w, H, static_cast<float>(eps));
        }
      });
    });
  });
}

void fused_add_rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && residual.is_contiguous() && weight.is_contiguous());
  TORCH_CHECK(residual.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "fused_add_rms_norm: residual and weight must be float32");
  const int64_t H = x.size(-1), T = x.numel() / H;
  const float* w = weight.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  PAGEMILL_DISPATCH_FLOAT(x.scalar_type(), X, [&] {
    PAGEMILL_DISPATCH_FLOAT(out.scalar_type(), O, [&] {
      const X* xp = x.data_ptr<X>();
      O* op = out.data_ptr<O>();
      at::parallel_for(0, T, row_grain(H), [&](int64_t b, int64_t e) {
        for (int64_t t = b; t < e; ++t) {
          float* r = rp + t * H;
          for (int64_t i = 0; i < H; i += 16) {
            const __mmask16 m = tail_mask(H - i);
            store16(r + i, _mm512_add_ps(load16(r + i, m), load16(xp + t * H + i, m)), m);
          }
          norm_row(op + t * H, r, w, H, static_cast<float>(eps));
        }
      });
    });
  });
}

void silu_and_mul(torch::Tensor out, torch::Tensor x) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous());
  const int64_t I = out.size(-1), T = out.numel() / I;
  TORCH_CHECK(x.size(-1) == 2 * I, "silu_and_mul: input last dim must be 2 * output last dim");
  PAGEMILL_DISPATCH_FLOAT(x.scalar_type(), X, [&] {
    PAGEMILL_DISPATCH_FLOAT(out.scalar_type(), O, [&] {
      const X* xp = x.data_ptr<X>();
      O* op = out.data_ptr<O>();
      at::parallel_for(0, T, row_grain(2 * I), [&](int64_t b, int64_t e) {
        std::vector<float> gate(I), up(I);
        for (int64_t t = b; t < e; ++t) {
          const X* row = xp + t * 2 * I;
          for (int64_t i = 0; i < I; i += 16) {
            const __mmask16 m = tail_mask(I - i);
            store16(gate.data() + i, load16(row + i, m), m);
            store16(up.data() + i, load16(row + I + i, m), m);
          }
          float* g = gate.data();
          silu_mul_inplace(g, up.data(), I);
          for (int64_t i = 0; i < I; i += 16) store16(op + t * I + i, load16(g + i, tail_mask(I - i)), tail_mask(I - i));
        }
      });
    });
  });
}

namespace {

// HF's rotate_half RoPE on one head of D: out[i] = x[i] c[i] - x[i+h] s[i]; out[i+h] = x[i+h] c[i+h] + x[i] s[i+h].
template <typename X>
inline void rope_head(float* out, const X* x, const float* c, const float* s, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 m = tail_mask(half - i);
    const __m512 x1 = load16(x + i, m), x2 = load16(x + half + i, m);
    store16(out + i, _mm512_fnmadd_ps(x2, load16(s + i, m), _mm512_mul_ps(x1, load16(c + i, m))), m);
    store16(out + half + i, _mm512_fmadd_ps(x1, load16(s + half + i, m), _mm512_mul_ps(x2, load16(c + half + i, m))), m);
  }
}

template <typename X>
inline void copy_head(float* out, const X* x, int64_t D) {
  for (int64_t i = 0; i < D; i += 16) store16(out + i, load16(x + i, tail_mask(D - i)), tail_mask(D - i));
}

template <typename C>
inline void copy_row(C* out, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) store16(out + i, load16(x + i, tail_mask(n - i)), tail_mask(n - i));
}

}  // namespace

void rope_and_cache(torch::Tensor q_out, torch::Tensor k_out, torch::Tensor v_out, torch::Tensor qkv,
                    torch::Tensor positions, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                    torch::Tensor v_cache, torch::Tensor slot_mapping) {
  TORCH_CHECK(qkv.is_contiguous() && q_out.is_contiguous() && k_out.is_contiguous() && v_out.is_contiguous());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && cos.is_contiguous() && sin.is_contiguous());
  TORCH_CHECK(q_out.scalar_type() == at::kFloat && k_out.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat,
              "rope_and_cache: q_out, k_out, v_out and cos/sin must be float32");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "rope_and_cache: K and V caches differ in dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong);
  const int64_t T = q_out.size(0), Hq = q_out.size(1), D = q_out.size(2), Hk = k_out.size(1);
  TORCH_CHECK(cos.size(1) == D && qkv.size(1) == (Hq + 2 * Hk) * D, "rope_and_cache: shape mismatch");
  const int64_t n_cached = slot_mapping.size(0), W = (Hq + 2 * Hk) * D, BS = k_cache.size(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* qo = q_out.data_ptr<float>();
  float* ko = k_out.data_ptr<float>();
  float* vo = v_out.data_ptr<float>();
  PAGEMILL_DISPATCH_FLOAT(k_cache.scalar_type(), C, [&] {
  PAGEMILL_DISPATCH_FLOAT(qkv.scalar_type(), X, [&] {
    const X* xp = qkv.data_ptr<X>();
    C* kc = k_cache.data_ptr<C>();
    C* vc = v_cache.data_ptr<C>();
    at::parallel_for(0, T, row_grain(W), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const X* row = xp + t * W;
        const float* c = cp + pos[t] * D;
        const float* s = sp + pos[t] * D;
        for (int64_t h = 0; h < Hq; ++h) rope_head(qo + (t * Hq + h) * D, row + h * D, c, s, D);
        for (int64_t h = 0; h < Hk; ++h) {
          rope_head(ko + (t * Hk + h) * D, row + (Hq + h) * D, c, s, D);
          copy_head(vo + (t * Hk + h) * D, row + (Hq + Hk + h) * D, D);
        }
        if (t < n_cached) {  // K blocks are stored transposed, [Hk, D, BS], for the attention kernel
          const int64_t blk = slots[t] / BS, off = slots[t] % BS;
          C* kb = kc + blk * BS * Hk * D + off;
          const float* kr = ko + t * Hk * D;
          for (int64_t i = 0; i < Hk * D; ++i) kb[i * BS] = static_cast<C>(kr[i]);
          copy_row(vc + slots[t] * Hk * D, vo + t * Hk * D, Hk * D);
        }
      }
    });
  });
  });
}
