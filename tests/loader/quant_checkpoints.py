"""Quantized checkpoint directories for tests: tiny random HF models whose linears are quantized and stored the way
each format's tool stores them (GPTQ: AutoGPTQ's packing; AWQ: AutoAWQ's GEMM packing with its interleaved nibble
order; FP8: e4m3 weights with per-tensor / per-channel / block scales; compressed-tensors: written by the
`compressed-tensors` package itself). Every writer leaves the HF model holding the dequantized weights: the float32
oracle the engine must match."""

from __future__ import annotations

import json
import os

import torch
from torch import nn

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
INPUT_ROLE = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "o_proj": "o", "gate_proj": "mlp",
              "up_proj": "mlp", "down_proj": "down"}  # shards of one fused layer share an input (and a GPTQ order)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def tiny_model(kind: str, seed: int = 0) -> tuple[nn.Module, object]:
    """A tiny random Llama or Qwen2 (hidden 128, MLP 256: whole groups of 128) with SmolLM2's tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pagemill.benchmarks.model_path import load_hf_tokenizer
    from pagemill.loader.default_model import default_model_path

    tok = load_hf_tokenizer(default_model_path())
    torch.manual_seed(seed)
    extra = {"llama": dict(rope_theta=10000.0), "qwen2": dict(rope_theta=1e6)}[kind]
    config = AutoConfig.for_model(kind, vocab_size=len(tok), hidden_size=128, intermediate_size=256,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=1024, initializer_range=0.2, tie_word_embeddings=False,
                                  **extra)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return model, tok


def quantized_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """(prefix, module) of every decoder linear (the LM head stays float, as the tools leave it)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in LINEARS]


def quantize_groups(w: torch.Tensor, bits: int, group: int, sym: bool,
                    g_idx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ / AWQ's min-max grid: codes uint8 [N, K], fp16 scales [N, G], zeros int [N, G] (sym: 2^(b-1));
    w = s (q - z). With g_idx, column k belongs to group g_idx[k]."""
    n, k = w.shape
    g = k if group == -1 else group
    idx = torch.arange(k) // g if g_idx is None else g_idx
    perm = torch.argsort(idx, stable=True)
    wp = w[:, perm].view(n, k // g, g)
    maxq = (1 << bits) - 1
    if sym:
        amax = wp.abs().amax(-1).clamp_min(1e-6)
        scale = (2 * amax / maxq).half()
        zeros = torch.full_like(amax, (maxq + 1) // 2, dtype=torch.int32)
    else:
        lo, hi = wp.amin(-1).clamp(max=0), wp.amax(-1).clamp(min=0)
        scale = ((hi - lo).clamp_min(1e-6) / maxq).half()
        zeros = (-lo / scale.float()).round().clamp(0, maxq).to(torch.int32)
    qp = (wp / scale.float().unsqueeze(-1)).round() + zeros.unsqueeze(-1)
    codes = torch.empty(n, k, dtype=torch.uint8)
    codes[:, perm] = qp.clamp(0, maxq).to(torch.uint8).view(n, k)
    return codes, scale, zeros


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """s (q - z) in float32, column k in group g_idx[k]."""
    return scale.float()[:, g_idx] * (codes.float() - zeros.float()[:, g_idx])


def _to_int32(v: torch.Tensor) -> torch.Tensor:
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def pack_gptq(codes, scale, zeros, bits: int, g_idx: torch.Tensor, v1: bool = True) -> dict[str, torch.Tensor]:
    """AutoGPTQ's tensors: qweight [K / per, N], qzeros [G, N / per] (zero - 1 in v1), scales [G, N], g_idx [K]."""
    per = 32 // bits
    qweight = _pack_cols_first(codes.t(), bits)
    z = (zeros.t() - (1 if v1 else 0)) & ((1 << bits) - 1)  # [G, N]
    qzeros = _pack_cols_first(z.t(), bits).t().contiguous()
    assert qweight.shape == (codes.shape[1] // per, codes.shape[0])
    return {"qweight": qweight, "qzeros": qzeros, "scales": scale.t().contiguous(), "g_idx": g_idx.to(torch.int32)}


def _pack_cols_first(x: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """x int [R, C] packed along R: out[r, c] = sum_j x[r per + order[j], c] << (b j) (int32)."""
    per = 32 // bits
    x = x.to(torch.int64).reshape(-1, per, x.shape[1])
    if order is not None:
        x = x[:, list(order)]
    shifts = (torch.arange(per, dtype=torch.int64) * bits).view(1, per, 1)
    return _to_int32((x << shifts).sum(1))


def pack_awq(codes, scale, zeros) -> dict[str, torch.Tensor]:
    """AutoAWQ GEMM: qweight [K, N / 8] and qzeros [G, N / 8], nibble i of word c = column 8 c + AWQ_ORDER[i]."""
    qweight = _pack_cols_first(codes, 4, AWQ_ORDER).t().contiguous()  # pack along N (codes is [N, K])
    qzeros = _pack_cols_first(zeros.to(torch.int64), 4, AWQ_ORDER).t().contiguous()
    return {"qweight": qweight, "qzeros": qzeros, "scales": scale.t().contiguous()}


def _save(model: nn.Module, tok, out: str, tensors: dict[str, torch.Tensor], qconfig: dict) -> str:
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    model.config.save_pretrained(out)
    tok.save_pretrained(out)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qconfig
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    if getattr(model.config, "tie_word_embeddings", False):  # the head is the embedding (HF checkpoints omit it)
        tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, "model.safetensors"))
    return out


def write_gptq(model, tok, out: str, bits: int = 4, group: int = 32, sym: bool = True, desc_act: bool = False,
               v1: bool = True, seed: int = 0) -> str:
    """A GPTQ directory of the model (AutoGPTQ layout); the model keeps the dequantized weights."""
    gen = torch.Generator().manual_seed(seed)
    state = {k: v for k, v in model.state_dict().items()}
    orders: dict[str, torch.Tensor] = {}
    for prefix, lin in quantized_linears(model):
        k = lin.in_features
        g = k if group == -1 else group
        g_idx = torch.arange(k) // g
        if desc_act:  # GPTQ's act order: the same order for shards of one input (same Hessian)
            role = prefix.rsplit(".", 2)[0] + "." + INPUT_ROLE[prefix.rsplit(".", 1)[-1]]
            if role not in orders:
                perm = torch.randperm(k, generator=gen)
                orders[role] = torch.empty(k, dtype=torch.long)
                orders[role][perm] = torch.arange(k) // g
            g_idx = orders[role]
        codes, scale, zeros = quantize_groups(lin.weight.data, bits, group, sym, g_idx)
        del state[f"{prefix}.weight"]
        state.update({f"{prefix}.{n}": t for n, t in pack_gptq(codes, scale, zeros, bits, g_idx, v1).items()})
        lin.weight.data = dequantize(codes, scale, zeros, g_idx)
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym,
          "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    return _save(model, tok, out, state, qc)


def write_awq(model, tok, out: str, group: int = 128) -> str:
    """An AWQ (GEMM) directory of the model; the model keeps the dequantized weights."""
    state = dict(model.state_dict())
    for prefix, lin in quantized_linears(model):
        codes, scale, zeros = quantize_groups(lin.weight.data, 4, group, sym=False)
        del state[f"{prefix}.weight"]
        state.update({f"{prefix}.{n}": t for n, t in pack_awq(codes, scale, zeros).items()})
        lin.weight.data = dequantize(codes, scale, zeros, torch.arange(lin.in_features) // group)
    qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    return _save(model, tok, out, state, qc)


def write_fp8(model, tok, out: str, scheme: str = "block") -> str:
    """An FP8 (e4m3) directory: block (128 x 128 scales, weight_scale_inv), tensor or channel (weight_scale)."""
    state = dict(model.state_dict())
    for prefix, lin in quantized_linears(model):
        w = lin.weight.data
        n, k = w.shape
        if scheme == "block":
            b = w.view(-(-n // 128), 128, k // 128, 128) if n % 128 == 0 else None
            amax = torch.stack([torch.stack([w[i:i + 128, j:j + 128].abs().max() for j in range(0, k, 128)])
                                for i in range(0, n, 128)]) if b is None else b.abs().amax((1, 3))
            s = amax / 448
            full = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
            state[f"{prefix}.weight_scale_inv"] = s.float()
        else:
            s = w.abs().amax() / 448 if scheme == "tensor" else w.abs().amax(1, keepdim=True) / 448
            full = s
            state[f"{prefix}.weight_scale"] = s.float().reshape(1) if scheme == "tensor" else s.float()
        w8 = (w / full).to(torch.float8_e4m3fn)
        state[f"{prefix}.weight"] = w8
        lin.weight.data = w8.float() * full
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if scheme == "block":
        qc["weight_block_size"] = [128, 128]
    return _save(model, tok, out, state, qc)


def write_compressed_tensors(model, tok, out: str, preset: str, group: int | None = 32,
                             symmetric: bool = True) -> str:
    """A compressed-tensors directory written by the package (min-max scales per its calculate_qparams, then its
    ModelCompressor), and the model holding what its decompressor returns. preset: W4A16 | W8A16 (pack-quantized),
    W8A8 (int-quantized), FP8_DYNAMIC (float-quantized). The package works on a copy (its modules fake-quantize
    activations in forward); the model gets the copy's decompressed weights."""
    import copy

    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationStatus, apply_quantization_config,
                                                 preset_name_to_scheme)
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import save_file

    original, model = model, copy.deepcopy(model)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if group is not None and scheme.weights.strategy == "group":
        scheme.weights.group_size = group
    if not symmetric:
        scheme.weights.symmetric = False
    qc = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"],
                            quantization_status=QuantizationStatus.CALIBRATION)
    apply_quantization_config(model, qc)
    for _, lin in quantized_linears(model):
        w, args = lin.weight.data, scheme.weights
        if args.strategy == "group":
            v = w.view(w.shape[0], -1, args.group_size)
            lo, hi = v.amin(-1), v.amax(-1)
        elif args.strategy == "channel":
            lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        else:
            lo, hi = w.min().reshape(1), w.max().reshape(1)
        scale, zp = calculate_qparams(lo, hi, args)
        lin.weight_scale.data = scale.to(lin.weight_scale.dtype).reshape(lin.weight_scale.shape)
        if hasattr(lin, "weight_zero_point"):
            lin.weight_zero_point.data = zp.to(lin.weight_zero_point.dtype).reshape(lin.weight_zero_point.shape)
    fmt = {"W4A16": "pack-quantized", "W8A16": "pack-quantized", "W8A8": "int-quantized",
           "FP8_DYNAMIC": "float-quantized"}[preset]
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    os.makedirs(out, exist_ok=True)
    model.config.save_pretrained(out)
    tok.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(out, "model.safetensors"))
    compressor.update_config(out)
    compressor.decompress_model(model)  # the package's own dequantized weights: the oracle
    copies = dict(quantized_linears(model))
    for prefix, lin in quantized_linears(original):
        lin.weight.data = copies[prefix].weight.data.float().clone()
    return out
