// The CPU's counterpart of a CUDA graph: a decoder stack recorded once (its weights, KV caches and RoPE tables) and
// run for a small step in one call, norms, projections, RoPE + cache write, paged attention and the gated MLP of
// every layer back to back through the active variant's kernels. The module path calls the same kernels in the same
// order on the same inputs, so the result is bit for bit the same; what goes is ~10 us of Python per op
// (pagemill/worker/cpu_decoder_graph.py decides when a model and a step qualify).
#include "decoder_graph.h"

#include <ATen/Parallel.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "binding_utils.h"
#include "packing.h"

namespace pagemill {
namespace {

// One row segment of a linear layer, of one record kind: GGUF bit-plane records, int8 tiles (+ scales, mins), 16-bit
// tiles (fp16 / bf16, widened to fp32), or a dense float32 weight (at::linear, F.linear's own op).
struct Segment {
  bool int8_tiles = false, dense = false;
  at::ScalarType half = at::kFloat;  // kHalf / kBFloat16: 16-bit tiles in packed
  RecordFormat format = RecordFormat::Q4_1;
  torch::Tensor packed, scales, mins;  // records | int8 codes, scales, mins (undefined: none)
  int64_t start = 0, stop = 0, tiles = 0, Kp = 0, G = 0;
};

struct Linear {
  int64_t K = 0, N = 0;
  torch::Tensor bias;  // float32 [N] (undefined: none)
  bool int8_activations = false;
  std::vector<Segment> segments;
};

enum LinearSlot { kQKV = 0, kO = 1, kGateUp = 2, kDown = 3 };

struct Layer {
  // input / post-attention norms; with sandwich norms also pre- and post-feed-forward (HF's names)
  torch::Tensor norms[4];
  Linear linears[4];
  torch::Tensor cos, sin, k_cache, v_cache, q_norm, k_norm;
  KvQuant kv_quant = KvQuant::NONE;
  DType cache_dtype = DType::F32;  // of a float cache (F32 with a quantized one, as the bindings pass it)
  float qk_norm_eps = 0, scale = 1;
  int64_t Hq = 0, Hk = 0, D = 0, window = 0, group = 0;
};

// A KV cache group's step metadata, checked once per run (CpuAttentionMetadata's tensors).
struct GroupStep {
  const int64_t *slots, *block_tables, *query_start_loc, *context_lens;
  int64_t n_slots, B, MB;
  std::vector<int64_t> token_request;
};

const int64_t* int64_data(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous(), "DecoderGraph.run: ", what,
              " must be a contiguous int64 tensor");
  return t.data_ptr<int64_t>();
}

torch::Tensor float_vector(const torch::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n, "DecoderGraph: ", what,
              " must be a contiguous float32 tensor of ", n, " elements");
  return t;
}

class DecoderGraph {
 public:
  DecoderGraph(int64_t hidden, double eps, const std::string& activation, bool sandwich, torch::Tensor final_norm,
               int64_t max_rows)
      : H_(hidden), eps_(static_cast<float>(eps)), sandwich_(sandwich), max_rows_(max_rows) {
    TORCH_CHECK(activation == "silu" || activation == "gelu_tanh", "DecoderGraph: activation must be silu or "
                "gelu_tanh, got ", activation);
    TORCH_CHECK(max_rows > 0, "DecoderGraph: max_rows must be positive");
    gelu_ = activation == "gelu_tanh";
    final_norm_ = float_vector(final_norm, H_, "final_norm");
  }

  // A layer's norms (2, or 4 with sandwich norms), attention shape and tables; its linears follow by add_segment.
  void add_layer(std::vector<torch::Tensor> norms, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                 double scale, int64_t window, int64_t group, torch::Tensor cos, torch::Tensor sin,
                 torch::Tensor k_cache, torch::Tensor v_cache, c10::optional<torch::Tensor> q_norm,
                 c10::optional<torch::Tensor> k_norm, double qk_norm_eps) {
    TORCH_CHECK(norms.size() == (sandwich_ ? 4u : 2u), "DecoderGraph.add_layer: ", sandwich_ ? 4 : 2, " norms");
    Layer l;
    for (size_t i = 0; i < norms.size(); ++i) l.norms[i] = float_vector(norms[i], H_, "a layer norm");
    l.Hq = num_heads, l.Hk = num_kv_heads, l.D = head_dim, l.scale = static_cast<float>(scale);
    l.window = window, l.group = group, l.qk_norm_eps = static_cast<float>(qk_norm_eps);
    TORCH_CHECK(l.Hq % l.Hk == 0 && l.D % 2 == 0 && group >= 0, "DecoderGraph.add_layer: bad attention shape");
    for (const auto* t : {&cos, &sin})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(1) == l.D,
                  "DecoderGraph.add_layer: cos / sin must be contiguous float32 [max_position, head_dim]");
    l.cos = cos, l.sin = sin;
    TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && k_cache.is_contiguous() && v_cache.is_contiguous()
                    && k_cache.dim() == 4 && k_cache.size(2) == l.Hk &&
                    k_cache.size(3) == kv_row_width(kv_quant_of(k_cache), l.D),
                "DecoderGraph.add_layer: K / V caches must be contiguous [blocks, block_size, kv_heads, row width]");
    l.kv_quant = kv_quant_of(k_cache);
    l.cache_dtype = l.kv_quant == KvQuant::NONE ? dtype_of(k_cache, "DecoderGraph KV cache") : DType::F32;
    l.k_cache = k_cache, l.v_cache = v_cache;
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "DecoderGraph.add_layer: q_norm and k_norm go together");
    if (q_norm) l.q_norm = float_vector(*q_norm, l.D, "q_norm"), l.k_norm = float_vector(*k_norm, l.D, "k_norm");
    num_groups_ = std::max(num_groups_, group + 1);
    layers_.push_back(std::move(l));
    residual_.reset();  // the scratch buffers are sized again at the next run
  }

  // Layer `layer`'s linear `slot` (0 qkv, 1 o, 2 gate_up, 3 down): its shape, bias and activation mode.
  void set_linear(int64_t layer, int64_t slot, int64_t in_features, int64_t out_features,
                  c10::optional<torch::Tensor> bias, bool int8_activations) {
    Linear& lin = linear(layer, slot);
    lin.K = in_features, lin.N = out_features, lin.int8_activations = int8_activations;
    if (bias) lin.bias = float_vector(*bias, out_features, "bias");
  }

  // Rows [start, stop) of a linear: "int8" tiles (tensors q, scales[, mins]), "f16" / "bf16" tiles (one tensor
  // [tiles, in, 64]), "dense" (the float32 weight [rows, in], the linear's only segment) or records of `kind`
  // (tensor records).
  void add_segment(int64_t layer, int64_t slot, const std::string& kind, std::vector<torch::Tensor> tensors,
                   int64_t start, int64_t stop) {
    Linear& lin = linear(layer, slot);
    TORCH_CHECK(lin.K > 0 && 0 <= start && start < stop && stop <= lin.N, "DecoderGraph.add_segment: rows [", start,
                ", ", stop, ") outside the linear's ", lin.N, " (set_linear first)");
    Segment s;
    s.start = start, s.stop = stop;
    if (kind == "dense") {
      TORCH_CHECK(tensors.size() == 1 && tensors[0].dim() == 2 && tensors[0].scalar_type() == at::kFloat &&
                      tensors[0].is_contiguous() && tensors[0].size(0) == stop - start && tensors[0].size(1) == lin.K,
                  "DecoderGraph.add_segment: a dense weight is one contiguous float32 [rows, ", lin.K, "] tensor");
      TORCH_CHECK(start == 0 && stop == lin.N && lin.segments.empty(), "DecoderGraph.add_segment: a dense weight is "
                  "the linear's only segment");
      s.dense = true, s.packed = tensors[0], s.tiles = (stop - start + kGemvTile - 1) / kGemvTile;
    } else if (kind == "f16" || kind == "bf16") {
      s.half = kind == "f16" ? at::kHalf : at::kBFloat16;
      TORCH_CHECK(tensors.size() == 1 && tensors[0].dim() == 3 && tensors[0].scalar_type() == s.half &&
                      tensors[0].is_contiguous() && tensors[0].size(1) == lin.K && tensors[0].size(2) == kGemvTile,
                  "DecoderGraph.add_segment: ", kind, " tiles are one contiguous [tiles, ", lin.K, ", 64] tensor");
      s.packed = tensors[0], s.tiles = s.packed.size(0);
    } else if (kind == "int8") {
      TORCH_CHECK(tensors.size() == 2 || tensors.size() == 3, "DecoderGraph.add_segment: int8 tiles are (q, scales"
                  "[, mins])");
      s.int8_tiles = true, s.packed = tensors[0], s.scales = tensors[1];
      if (tensors.size() == 3) s.mins = tensors[2];
      TORCH_CHECK(s.packed.dim() == 3 && s.packed.scalar_type() == at::kChar && s.packed.is_contiguous() &&
                      s.packed.size(2) == kGemvTile && s.scales.dim() == 3 && s.scales.scalar_type() == at::kFloat &&
                      s.scales.is_contiguous() && s.scales.size(0) == s.packed.size(0) &&
                      s.packed.size(1) % s.scales.size(1) == 0,
                  "DecoderGraph.add_segment: int8 tiles must come from pack_gemv_weight_int8");
      s.tiles = s.packed.size(0), s.Kp = s.packed.size(1), s.G = s.Kp / s.scales.size(1);
      TORCH_CHECK(lin.K <= s.Kp && s.Kp - lin.K < s.G, "DecoderGraph.add_segment: int8 tiles of ", s.Kp,
                  " columns for ", lin.K, " inputs");
      TORCH_CHECK(!s.mins.defined() || (s.mins.sizes() == s.scales.sizes() && s.mins.scalar_type() == at::kFloat &&
                                        s.mins.is_contiguous() && 256 % s.G == 0),
                  "DecoderGraph.add_segment: mins must be shaped like scales, with a group size dividing 256");
    } else {
      TORCH_CHECK(tensors.size() == 1, "DecoderGraph.add_segment: records are one tensor");
      s.format = record_format(kind), s.packed = tensors[0];
      TORCH_CHECK(s.packed.dim() == 3 && s.packed.scalar_type() == at::kByte && s.packed.is_contiguous() &&
                      s.packed.size(2) == record_bytes(s.format) &&
                      s.packed.size(1) * record_length(s.format) == lin.K,
                  "DecoderGraph.add_segment: ", kind, " records [tiles, ", lin.K, " / ", record_length(s.format),
                  ", ", record_bytes(s.format), "] expected");
      s.tiles = s.packed.size(0);
    }
    TORCH_CHECK(stop - start <= s.tiles * kGemvTile, "DecoderGraph.add_segment: more rows than the packed weight");
    lin.segments.push_back(std::move(s));
    residual_.reset();
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // The final-normed hidden states [T, hidden] of embeddings h [T, hidden] (float32), with each KV cache group's
  // step metadata: slot_mapping [T], block_table [B, MB], query_start_loc [B + 1], context_lens [B] (every request
  // read by the paged kernel: decodes and chunks with cached context).
  torch::Tensor run(torch::Tensor h, torch::Tensor positions, std::vector<torch::Tensor> slot_mappings,
                    std::vector<torch::Tensor> block_tables, std::vector<torch::Tensor> query_start_locs,
                    std::vector<torch::Tensor> context_lens) {
    TORCH_CHECK(h.dim() == 2 && h.size(1) == H_ && h.scalar_type() == at::kFloat && h.is_contiguous(),
                "DecoderGraph.run: h must be contiguous float32 [T, ", H_, "]");
    const int64_t T = h.size(0);
    TORCH_CHECK(T >= 1 && T <= max_rows_, "DecoderGraph.run: ", T, " rows (1 to ", max_rows_, ")");
    const int64_t* pos = int64_data(positions, "positions");
    TORCH_CHECK(positions.numel() >= T, "DecoderGraph.run: fewer positions than rows");
    const size_t G = slot_mappings.size();
    TORCH_CHECK(block_tables.size() == G && query_start_locs.size() == G && context_lens.size() == G,
                "DecoderGraph.run: one slot mapping, block table, query_start_loc and context_lens per KV group");
    std::vector<GroupStep> groups(G);
    for (size_t g = 0; g < G; ++g) {
      GroupStep& s = groups[g];
      s.slots = int64_data(slot_mappings[g], "slot_mapping"), s.n_slots = slot_mappings[g].numel();
      s.block_tables = int64_data(block_tables[g], "block_table"), s.MB = block_tables[g].size(1);
      s.query_start_loc = int64_data(query_start_locs[g], "query_start_loc");
      s.context_lens = int64_data(context_lens[g], "context_lens"), s.B = context_lens[g].numel();
      TORCH_CHECK(block_tables[g].dim() == 2 && block_tables[g].size(0) >= s.B &&
                      query_start_locs[g].numel() == s.B + 1 && s.query_start_loc[s.B] == T && s.n_slots <= T,
                  "DecoderGraph.run: group ", g, "'s metadata does not cover the step's ", T, " rows");
      s.token_request.assign(T, 0);
      for (int64_t r = 0; r < s.B; ++r)
        for (int64_t t = s.query_start_loc[r]; t < s.query_start_loc[r + 1]; ++t) s.token_request[t] = r;
    }
    TORCH_CHECK(static_cast<int64_t>(G) >= num_groups_, "DecoderGraph.run: no metadata for KV group ", G);
    ensure_scratch();
    const KernelTable* k = active_kernel_table();
    const int nt = threads();
    float* res = residual_.data_ptr<float>();
    float* x = x_.data_ptr<float>();
    float* hb = h_.data_ptr<float>();
    float* hb2 = h2_.data_ptr<float>();
    std::memcpy(res, h.data_ptr<float>(), sizeof(float) * T * H_);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      if (i == 0)
        k->rms_norm(x, DType::F32, res, DType::F32, l.norms[0].data_ptr<float>(), T, H_, eps_, nt);
      else
        k->fused_add_rms_norm(x, DType::F32, hb, DType::F32, res, l.norms[0].data_ptr<float>(), T, H_, eps_, nt);
      run_linear(k, l.linears[kQKV], x, qkv_.data_ptr<float>(), T, nt);
      attend(k, l, groups[l.group], pos, T, nt);
      run_linear(k, l.linears[kO], attn_.data_ptr<float>(), hb, T, nt);
      if (sandwich_) {
        k->rms_norm(hb2, DType::F32, hb, DType::F32, l.norms[1].data_ptr<float>(), T, H_, eps_, nt);
        k->fused_add_rms_norm(x, DType::F32, hb2, DType::F32, res, l.norms[2].data_ptr<float>(), T, H_, eps_, nt);
      } else {
        k->fused_add_rms_norm(x, DType::F32, hb, DType::F32, res, l.norms[1].data_ptr<float>(), T, H_, eps_, nt);
      }
      const Linear& down = l.linears[kDown];
      run_linear(k, l.linears[kGateUp], x, gate_up_.data_ptr<float>(), T, nt);
      (gelu_ ? k->gelu_tanh_and_mul : k->silu_and_mul)(act_.data_ptr<float>(), DType::F32,
                                                      gate_up_.data_ptr<float>(), DType::F32, T, down.K, nt);
      if (sandwich_) {
        run_linear(k, down, act_.data_ptr<float>(), hb2, T, nt);
        k->rms_norm(hb, DType::F32, hb2, DType::F32, l.norms[3].data_ptr<float>(), T, H_, eps_, nt);
      } else {
        run_linear(k, down, act_.data_ptr<float>(), hb, T, nt);
      }
    }
    auto out = torch::empty({T, H_}, torch::kFloat32);
    if (layers_.empty()) {
      k->rms_norm(out.data_ptr<float>(), DType::F32, res, DType::F32, final_norm_.data_ptr<float>(), T, H_, eps_, nt);
    } else {
      k->fused_add_rms_norm(out.data_ptr<float>(), DType::F32, hb, DType::F32, res, final_norm_.data_ptr<float>(), T,
                            H_, eps_, nt);
    }
    return out;
  }

 private:
  Linear& linear(int64_t layer, int64_t slot) {
    TORCH_CHECK(layer >= 0 && layer < num_layers() && slot >= 0 && slot < 4, "DecoderGraph: no layer ", layer,
                " / linear ", slot);
    return layers_[layer].linears[slot];
  }

  // Persistent buffers for max_rows rows, sized for the widest layer.
  void ensure_scratch() {
    if (residual_.defined()) return;
    int64_t qkv = 1, attn = 1, gate_up = 1, inter = 1, part = 1, q = 1, kv = 1;
    for (const Layer& l : layers_) {
      TORCH_CHECK(l.linears[kQKV].N == (l.Hq + 2 * l.Hk) * l.D && l.linears[kO].K == l.Hq * l.D &&
                      l.linears[kO].N == H_ && l.linears[kQKV].K == H_ && l.linears[kGateUp].K == H_ &&
                      l.linears[kGateUp].N == 2 * l.linears[kDown].K && l.linears[kDown].N == H_,
                  "DecoderGraph: a layer's linear shapes do not chain");
      for (const Linear& lin : l.linears) {
        TORCH_CHECK(!lin.segments.empty(), "DecoderGraph: a linear without weights");
        int64_t covered = 0;
        for (const Segment& s : lin.segments) covered += s.stop - s.start, part = std::max(part, s.stop - s.start);
        TORCH_CHECK(covered == lin.N, "DecoderGraph: a linear's segments do not cover its rows");
      }
      qkv = std::max(qkv, l.linears[kQKV].N), attn = std::max(attn, l.Hq * l.D);
      gate_up = std::max(gate_up, l.linears[kGateUp].N), inter = std::max(inter, l.linears[kDown].K);
      q = std::max(q, l.Hq * l.D), kv = std::max(kv, l.Hk * l.D);
    }
    const int64_t R = max_rows_;
    auto buf = [R](int64_t n) { return torch::empty({R * n}, torch::kFloat32); };
    residual_ = buf(H_), x_ = buf(H_), h_ = buf(H_), h2_ = buf(H_), qkv_ = buf(qkv), attn_ = buf(attn);
    gate_up_ = buf(gate_up), act_ = buf(inter), part_ = buf(part), q_ = buf(q), k_ = buf(kv), v_ = buf(kv);
  }

  // out [M, N] = x [M, K] W^T + bias, one kernel call per segment; as RecordsLinearMethod.matmul does it.
  void run_linear(const KernelTable* k, const Linear& lin, const float* x, float* out, int64_t M, int nt) {
    const bool one = lin.segments.size() == 1;
    for (const Segment& s : lin.segments) {
      const int64_t n = s.stop - s.start;
      float* dst = one ? out : M == 1 ? out + s.start : part_.data_ptr<float>();
      if (s.dense) {  // (the only segment: dst is out)
        const auto xt = torch::from_blob(const_cast<float*>(x), {M, lin.K}, torch::kFloat32);
        const auto y = at::linear(xt, s.packed, lin.bias.defined() ? c10::optional<torch::Tensor>(lin.bias)
                                                                   : c10::optional<torch::Tensor>());
        std::memcpy(dst, y.contiguous().data_ptr<float>(), sizeof(float) * M * n);
        continue;
      }
      GemvArgs a;
      a.out = dst, a.out_dtype = DType::F32, a.x = x;
      a.bias = lin.bias.defined() ? lin.bias.data_ptr<float>() + s.start : nullptr;
      a.M = M, a.K = lin.K, a.N = n, a.tiles = s.tiles, a.num_threads = nt;
      a.direct_only = false, a.int8_activations = lin.int8_activations;
      if (s.half != at::kFloat)
        (s.half == at::kHalf ? k->gemv_f16 : k->gemv_bf16)(a, reinterpret_cast<const uint16_t*>(s.packed.data_ptr()));
      else if (s.int8_tiles)
        k->gemv_int8(a, s.packed.data_ptr<int8_t>(), s.scales.data_ptr<float>(),
                     s.mins.defined() ? s.mins.data_ptr<float>() : nullptr, s.Kp, s.G);
      else
        k->gemv_records(a, s.packed.data_ptr<uint8_t>(), s.format);
      if (!one && M > 1)
        for (int64_t m = 0; m < M; ++m) std::memcpy(out + m * lin.N + s.start, dst + m * n, sizeof(float) * n);
    }
  }

  // RoPE (after the optional QK norm) and the cache write from qkv_, then paged attention into attn_.
  void attend(const KernelTable* k, const Layer& l, const GroupStep& g, const int64_t* pos, int64_t T, int nt) {
    RopeCacheArgs r;
    r.q_out = q_.data_ptr<float>(), r.k_out = k_.data_ptr<float>(), r.v_out = v_.data_ptr<float>();
    r.qkv = qkv_.data_ptr<float>(), r.qkv_dtype = DType::F32, r.positions = pos;
    r.cos = l.cos.data_ptr<float>(), r.sin = l.sin.data_ptr<float>();
    r.k_cache = l.k_cache.data_ptr(), r.v_cache = l.v_cache.data_ptr(), r.cache_dtype = l.cache_dtype;
    r.kv_quant = l.kv_quant, r.slot_mapping = g.slots;
    r.q_norm = l.q_norm.defined() ? l.q_norm.data_ptr<float>() : nullptr;
    r.k_norm = l.k_norm.defined() ? l.k_norm.data_ptr<float>() : nullptr;
    r.norm_eps = l.qk_norm_eps;
    r.T = T, r.Hq = l.Hq, r.Hk = l.Hk, r.D = l.D, r.BS = l.k_cache.size(1), r.n_cached = g.n_slots;
    r.num_threads = nt;
    k->rope_and_cache(r);
    PagedAttentionArgs a;
    a.out = attn_.data_ptr<float>(), a.out_dtype = DType::F32, a.q = q_.data_ptr<float>();
    a.k_cache = l.k_cache.data_ptr(), a.v_cache = l.v_cache.data_ptr(), a.cache_dtype = l.cache_dtype;
    a.kv_quant = l.kv_quant, a.block_tables = g.block_tables, a.query_start_loc = g.query_start_loc;
    a.context_lens = g.context_lens, a.token_request = g.token_request.data();
    a.T = T, a.B = g.B, a.Hq = l.Hq, a.Hk = l.Hk, a.D = l.D, a.BS = l.k_cache.size(1), a.MB = g.MB;
    a.window = l.window, a.scale = l.scale, a.num_threads = nt;
    k->paged_attention(a);
  }

  int64_t H_;
  float eps_;
  bool sandwich_, gelu_ = false;
  int64_t max_rows_, num_groups_ = 0;
  torch::Tensor final_norm_;
  std::vector<Layer> layers_;
  torch::Tensor residual_, x_, h_, h2_, qkv_, attn_, gate_up_, act_, part_, q_, k_, v_;
};

}  // namespace

void register_decoder_graph(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<DecoderGraph>(m, "DecoderGraph", "A decoder stack recorded once and run for a small step in one call "
                           "(the CPU's counterpart of a CUDA graph; pagemill/worker/cpu_decoder_graph.py)")
      .def(py::init<int64_t, double, const std::string&, bool, torch::Tensor, int64_t>(), py::arg("hidden"),
           py::arg("eps"), py::arg("activation"), py::arg("sandwich"), py::arg("final_norm"), py::arg("max_rows"))
      .def("add_layer", &DecoderGraph::add_layer, py::arg("norms"), py::arg("num_heads"), py::arg("num_kv_heads"),
           py::arg("head_dim"), py::arg("scale"), py::arg("window"), py::arg("group"), py::arg("cos"), py::arg("sin"),
           py::arg("k_cache"), py::arg("v_cache"), py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none(),
           py::arg("qk_norm_eps") = 0.0)
      .def("set_linear", &DecoderGraph::set_linear, py::arg("layer"), py::arg("slot"), py::arg("in_features"),
           py::arg("out_features"), py::arg("bias") = py::none(), py::arg("int8_activations") = false)
      .def("add_segment", &DecoderGraph::add_segment, py::arg("layer"), py::arg("slot"), py::arg("kind"),
           py::arg("tensors"), py::arg("start"), py::arg("stop"))
      .def_property_readonly("num_layers", &DecoderGraph::num_layers)
      .def("run", &DecoderGraph::run, py::arg("h"), py::arg("positions"), py::arg("slot_mappings"),
           py::arg("block_tables"), py::arg("query_start_locs"), py::arg("context_lens"),
           py::call_guard<py::gil_scoped_release>());
}

}  // namespace pagemill
