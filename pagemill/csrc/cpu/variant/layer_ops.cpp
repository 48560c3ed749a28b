// Fused per-layer elementwise ops of a Llama block (vLLM's CPU layernorm / activation / pos_encoding +
// reshape_and_cache): each replaces 5-25 small torch ops, whose dispatch cost dominated small batches.
// All math is fp32; inputs and outputs may be fp32, fp16 or bf16 (the dtype the next matmul wants).
#include "simd.h"
#include "../kv_rows.h"

namespace pagemill {
namespace PAGEMILL_ISA {
namespace {

// Rows per thread range such that tiny batches run inline (no thread wake-up).
int64_t row_grain(int64_t row_elems) { return imax(1, 32768 / imax(1, row_elems)); }

// out = weight * (x * rsqrt(mean(x^2) + eps)), over one row of H.
template <typename O>
inline void norm_row(O* out, const float* x, const float* w, int64_t H, float eps) {
  vf acc = vzero();
  for (int64_t i = 0; i < H; i += W) {
    const vf v = vloadn(x + i, H - i);
    acc = vfma(v, v, acc);
  }
  const vf inv = vset(1.0f / sqrtf(vsum(acc) / float(H) + eps));
  for (int64_t i = 0; i < H; i += W)
    vstoren(out + i, vmul(vloadn(w + i, H - i), vmul(vloadn(x + i, H - i), inv)), H - i);
}

template <typename O, typename X>
inline void copy_row(O* out, const X* x, int64_t n) {
  for (int64_t i = 0; i < n; i += W) vstoren(out + i, vloadn(x + i, n - i), n - i);
}

// Calls f(xp, op): x and out as pointers to their element types.
template <typename F>
inline void with_io(DType x_dtype, const void* x, DType out_dtype, void* out, const F& f) {
  with_float_type(x_dtype, [&](auto xt) {
    with_float_type(out_dtype, [&](auto ot) {
      f(static_cast<const decltype(xt)*>(x), static_cast<decltype(ot)*>(out));
    });
  });
}

// g = silu(g) * u, vectorised (libmvec expf); the exponent capped as in gelu_tanh_and_mul below (else NaN at g < -88).
struct SiluMul {
  static inline void apply(float* __restrict g, const float* __restrict u, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) g[i] = g[i] / (1.0f + expf(fminf(-g[i], 80.0f))) * u[i];
  }
};

// g = gelu_tanh(g) * u (Gemma's GeGLU): 0.5 g (1 + tanh(y)) with y = sqrt(2 / pi) (g + 0.044715 g^3), written as
// g / (1 + exp(-2 y)), the same value with no cancellation, vectorised like silu (libmvec expf). The exponent is
// capped below expf's overflow: under -ffast-math, x / inf may become NaN (a reciprocal refined by Newton steps).
struct GeluTanhMul {
  static inline void apply(float* __restrict g, const float* __restrict u, int64_t n) {
    constexpr float k2Beta = 2.0f * 0.7978845608028654f, kKappa = 0.044715f;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float x = g[i];
      g[i] = x / (1.0f + expf(fminf(-k2Beta * (x + kKappa * x * x * x), 80.0f))) * u[i];
    }
  }
};

// HF's rotate_half RoPE on one head of D: out[i] = x[i] c[i] - x[i+h] s[i]; out[i+h] = x[i+h] c[i+h] + x[i] s[i+h].
template <typename X>
inline void rope_head(float* out, const X* x, const float* c, const float* s, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; i += W) {
    const int64_t n = half - i;
    const vf x1 = vloadn(x + i, n), x2 = vloadn(x + half + i, n);
    vstoren(out + i, vfnma(x2, vloadn(s + i, n), vmul(x1, vloadn(c + i, n))), n);
    vstoren(out + half + i, vfma(x1, vloadn(s + half + i, n), vmul(x2, vloadn(c + half + i, n))), n);
  }
}

}  // namespace

void rms_norm(void* out, DType out_dtype, const void* x, DType x_dtype, const float* w, int64_t T, int64_t H,
              float eps, int num_threads) {
  with_io(x_dtype, x, out_dtype, out, [&](auto xp, auto op) {
    parallel_for(T, row_grain(H), num_threads, [&](int64_t b, int64_t e) {
      Scratch row;
      float* r = row.get(H);
      for (int64_t t = b; t < e; ++t) {
        copy_row(r, xp + t * H, H);
        norm_row(op + t * H, r, w, H, eps);
      }
    });
  });
}

void fused_add_rms_norm(void* out, DType out_dtype, const void* x, DType x_dtype, float* residual, const float* w,
                        int64_t T, int64_t H, float eps, int num_threads) {
  with_io(x_dtype, x, out_dtype, out, [&](auto xp, auto op) {
    parallel_for(T, row_grain(H), num_threads, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        float* r = residual + t * H;
        for (int64_t i = 0; i < H; i += W)
          vstoren(r + i, vadd(vloadn(r + i, H - i), vloadn(xp + t * H + i, H - i)), H - i);
        norm_row(op + t * H, r, w, H, eps);
      }
    });
  });
}

namespace {

// out[t] = act(x[t, :I]) * x[t, I:] for each of T rows.
template <class Act>
void act_and_mul(void* out, DType out_dtype, const void* x, DType x_dtype, int64_t T, int64_t I, int num_threads) {
  with_io(x_dtype, x, out_dtype, out, [&](auto xp, auto op) {
    parallel_for(T, row_grain(2 * I), num_threads, [&](int64_t b, int64_t e) {
      Scratch buf;
      float* gate = buf.get(2 * I);
      float* up = gate + I;
      for (int64_t t = b; t < e; ++t) {
        copy_row(gate, xp + t * 2 * I, 2 * I);
        Act::apply(gate, up, I);
        copy_row(op + t * I, gate, I);
      }
    });
  });
}

}  // namespace

void silu_and_mul(void* out, DType out_dtype, const void* x, DType x_dtype, int64_t T, int64_t I, int num_threads) {
  act_and_mul<SiluMul>(out, out_dtype, x, x_dtype, T, I, num_threads);
}

void gelu_tanh_and_mul(void* out, DType out_dtype, const void* x, DType x_dtype, int64_t T, int64_t I,
                       int num_threads) {
  act_and_mul<GeluTanhMul>(out, out_dtype, x, x_dtype, T, I, num_threads);
}

namespace {

// Token t's K and V rows (k_out / v_out) into a quantized cache: K codes transposed in their block ([Hk, D, BS], then
// the scales [Hk, S, BS]), V rows of D codes then S scales; k_out / v_out then hold the values as stored.
void write_quantized(const RopeCacheArgs& a, int64_t t) {
  const int64_t D = a.D, Hk = a.Hk, BS = a.BS, row = kv_row_width(a.kv_quant, D);
  const int64_t scale_bytes = a.kv_quant == KvQuant::INT8 ? 2 : 4, ns = (row - D) / scale_bytes;
  const int64_t slot = a.slot_mapping[t], off = slot % BS;
  uint8_t* kb = static_cast<uint8_t*>(a.k_cache) + slot / BS * BS * Hk * row;
  uint8_t* vr = static_cast<uint8_t*>(a.v_cache) + slot * Hk * row;
  for (int64_t h = 0; h < Hk; ++h) {
    float* k = a.k_out + (t * Hk + h) * D;
    float* v = a.v_out + (t * Hk + h) * D;
    uint8_t* k_scales = kb + Hk * D * BS + (h * ns * BS + off) * scale_bytes;
    quantize_kv_row(a.kv_quant, k, D, kb + h * D * BS + off, BS, k_scales, BS * scale_bytes, k);
    quantize_kv_row(a.kv_quant, v, D, vr + h * row, 1, vr + h * row + D, scale_bytes, v);
  }
}

}  // namespace

void rope_and_cache(const RopeCacheArgs& a) {
  const int64_t T = a.T, Hq = a.Hq, Hk = a.Hk, D = a.D, BS = a.BS, Wd = (Hq + 2 * Hk) * D;
  with_float_type(a.cache_dtype, [&](auto ct) {
    with_float_type(a.qkv_dtype, [&](auto xt) {
      using C = decltype(ct);
      using X = decltype(xt);
      const X* xp = static_cast<const X*>(a.qkv);
      C* kc = static_cast<C*>(a.k_cache);
      C* vc = static_cast<C*>(a.v_cache);
      parallel_for(T, row_grain(Wd), a.num_threads, [&](int64_t b, int64_t e) {
        Scratch buf;
        float* normed = a.q_norm != nullptr ? buf.get(D) : nullptr;  // no allocation for layers without QK norm
        // RoPE of one head, after its RMSNorm when the layer has a QK norm (computed as the RMSNorm kernel does).
        auto rope = [&](float* out, const X* x, const float* norm_w, const float* c, const float* s) {
          if (norm_w == nullptr) return rope_head(out, x, c, s, D);
          copy_row(normed, x, D);
          norm_row(normed, normed, norm_w, D, a.norm_eps);
          rope_head(out, static_cast<const float*>(normed), c, s, D);
        };
        for (int64_t t = b; t < e; ++t) {
          const X* row = xp + t * Wd;
          const float* c = a.cos + a.positions[t] * D;
          const float* s = a.sin + a.positions[t] * D;
          for (int64_t h = 0; h < Hq; ++h) rope(a.q_out + (t * Hq + h) * D, row + h * D, a.q_norm, c, s);
          for (int64_t h = 0; h < Hk; ++h) {
            rope(a.k_out + (t * Hk + h) * D, row + (Hq + h) * D, a.k_norm, c, s);
            copy_row(a.v_out + (t * Hk + h) * D, row + (Hq + Hk + h) * D, D);
          }
          if (t < a.n_cached && a.kv_quant != KvQuant::NONE) {
            write_quantized(a, t);
          } else if (t < a.n_cached) {  // K blocks are stored transposed, [Hk, D, BS], for the attention kernel
            const int64_t slot = a.slot_mapping[t], blk = slot / BS, off = slot % BS;
            C* kb = kc + blk * BS * Hk * D + off;
            const float* kr = a.k_out + t * Hk * D;
            for (int64_t i = 0; i < Hk * D; ++i) from_f32(kb + i * BS, kr[i]);
            copy_row(vc + slot * Hk * D, a.v_out + t * Hk * D, Hk * D);
          }
        }
      });
    });
  });
}

// Structured output: logits[rows[r], t] = -inf where bit t % 32 of bitmask[r, t / 32] is 0 (tokens past the mask's
// W words too). Words with every bit set (the common case inside free text) are skipped.
void apply_token_bitmask(float* logits, int64_t V, const int32_t* bitmask, int64_t W, const int64_t* rows, int64_t R,
                         int num_threads) {
  const float neg_inf = -__builtin_inff();
  parallel_for(R, 1, num_threads, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      float* row = logits + rows[r] * V;
      const uint32_t* mask = reinterpret_cast<const uint32_t*>(bitmask + r * W);
      const int64_t words = imin(W, (V + 31) / 32);
      for (int64_t w = 0; w < words; ++w) {
        const uint32_t bits = mask[w];
        if (bits == 0xFFFFFFFFu) continue;
        float* x = row + w * 32;
        const int64_t n = imin(int64_t(32), V - w * 32);
        for (int64_t i = 0; i < n; ++i) x[i] = ((bits >> i) & 1u) ? x[i] : neg_inf;
      }
      for (int64_t t = words * 32; t < V; ++t) row[t] = neg_inf;
    }
  });
}

}  // namespace PAGEMILL_ISA
}  // namespace pagemill
