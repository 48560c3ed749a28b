"""The CPU's counterpart of CUDA graphs: a small step's decoder stack in one C++ call.

A decode step of a small model is bound by fixed costs, not bytes: SmolLM2-135M streams its layers' weights in
~1.7 ms, while the module path spends ~10 us of Python per op (9 ops x 30 layers). `CpuDecoderGraph` records the
stack once, after the KV cache is bound (each layer's norms, GEMV records, RoPE tables and KV cache), in the compiled
`DecoderGraph` (csrc/cpu/decoder_graph.cpp), which runs every layer's kernels back to back; the runner embeds the
tokens, runs it, and takes the final hidden states to the LM head as before. The kernels, their order and their
inputs are the module path's, so the hidden states are bit for bit the same.

It records models that are Llama-like decoders (`DecoderLayer` with a gated MLP, plain or sandwich norms) whose
linears hold GEMV records (GGUF, on-load int8 / int4, prequantized checkpoints, 16-bit tiles) or plain float32
weights (F.linear's own op, `at::linear`), on float32 activations, with the compiled paged attention, on one rank.
A step takes it when it has at most `GRAPH_MAX_ROWS` tokens and every request's attention runs in the paged kernel
(decodes and chunks with cached context: no fresh prefill, no image spans); `enforce_eager=True` turns it off, as it
turns off CUDA graphs.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

import torch

from pagemill.attention.backends.cpu_paged import CpuAttentionMetadata, CpuPagedAttention
from pagemill.layers.quantization.dense import UnquantizedLinearMethod
from pagemill.layers.quantization.records import HALF_TILE_KINDS, RecordsLinearMethod
from pagemill.layers.quantization.gguf_records import PLANE_LAYOUTS
from pagemill.models.decoder import DecoderAttention, DecoderForCausalLM, DecoderLayer, DecoderModel, GatedMLP

if TYPE_CHECKING:
    from pagemill.kernels.ops import TorchLayerOps

logger = logging.getLogger(__name__)

# Steps with more tokens take the module path (their matmuls dwarf the per-op overhead, and the graph's scratch
# buffers stay small: max rows x the widest layer).
GRAPH_MAX_ROWS = 64


def _graph_linear(linear: Any) -> str | None:
    """Why `linear` cannot be recorded (None: it can): GEMV records or a plain float32 F.linear, on float32 inputs,
    called straight through."""
    method = getattr(linear, "quant_method", None)
    records = isinstance(method, RecordsLinearMethod) and method.records_only(linear)
    if not records and type(method) is not UnquantizedLinearMethod:
        return f"{type(method).__name__} weights (the graph runs GEMV records and F.linear as they are)"
    if method.input_dtype != torch.float32:
        return f"{method.input_dtype} linear inputs"
    forward = linear.__dict__.get("forward")
    called_straight = isinstance(forward, functools.partial) and forward.func == method.apply
    if not called_straight or getattr(linear, "tp_size", 1) > 1:
        return f"{type(linear).__name__} wrapped or sharded"
    return None


def _layer_norms(layer: DecoderLayer) -> list[Any]:
    """The layer's norms in the graph's order: input, post-attention (and pre- / post-feed-forward when sandwiched)."""
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if layer.sandwich:
        norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
    return norms


def _unsupported(model: Any) -> str | None:
    """Why `model` cannot be recorded (None: it can)."""
    if not isinstance(model, DecoderForCausalLM) or type(model.model) is not DecoderModel:
        return f"{type(model).__name__} is not a plain decoder"
    inner = model.model
    if inner.parallel.pp_size > 1 or inner.parallel.tp_size > 1:
        return "tensor / pipeline parallel"
    if inner.dtype != torch.float32:
        return f"dtype {inner.dtype}"
    for layer in inner.layers:
        if type(layer) is not DecoderLayer or type(layer.mlp) is not GatedMLP or \
                type(layer.self_attn) is not DecoderAttention:
            return f"{type(layer).__name__} / {type(layer.mlp).__name__} blocks"
        attn = layer.self_attn.attn
        if type(attn.backend) is not CpuPagedAttention:
            return f"{attn.backend.name} attention (the graph runs the compiled paged kernel)"
        if not attn.fused:
            return "attention without the fused RoPE + cache-write kernel (partial RoPE)"
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            reason = _graph_linear(linear)
            if reason is not None:
                return reason
        if any(n.eps != inner.norm.eps for n in _layer_norms(layer)):
            return "layer norms with different eps"
    return None


class CpuDecoderGraph:
    """A model's decoder stack recorded in the compiled `DecoderGraph`; `run` computes a qualifying step's final
    hidden states in one call."""

    def __init__(self, model: DecoderForCausalLM, ops: TorchLayerOps) -> None:
        inner = model.model
        self.model, self.num_groups = model, 1
        first = inner.layers[0]
        self.graph = ops.decoder_graph(inner.hidden_size, inner.norm.eps, model.spec.activation, first.sandwich,
                                       inner.norm.weight.data, GRAPH_MAX_ROWS)
        for i, layer in enumerate(inner.layers):
            attn = layer.self_attn.attn
            qk = {}
            if attn.qk_norm is not None:
                q_norm, k_norm = attn.qk_norm
                qk = dict(q_norm=q_norm.weight.data, k_norm=k_norm.weight.data, qk_norm_eps=q_norm.eps)
            norms = [n.weight.data for n in _layer_norms(layer)]
            self.graph.add_layer(norms, attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale,
                                 attn.sliding_window or 0, attn.kv_cache_group, attn.rotary.cos, attn.rotary.sin,
                                 attn.kv_cache[0], attn.kv_cache[1], **qk)
            self.num_groups = max(self.num_groups, attn.kv_cache_group + 1)
            linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            for slot, linear in enumerate(linears):
                if type(linear.quant_method) is UnquantizedLinearMethod:
                    bias = None if linear.bias is None else linear.bias.data
                    self.graph.set_linear(i, slot, linear.input_size, linear.output_size, bias)
                    self.graph.add_segment(i, slot, "dense", [linear.weight.data], 0, linear.output_size)
                    continue
                self.graph.set_linear(i, slot, linear.input_size, linear.output_size, linear.gemv_bias,
                                      linear.quant_method.int8_activations)
                for seg in linear.gemv_segments:
                    if seg.kind == "int8":
                        self.graph.add_segment(i, slot, "int8", list(seg.records), seg.start, seg.stop)
                    elif seg.kind in HALF_TILE_KINDS:
                        self.graph.add_segment(i, slot, seg.kind, [seg.records], seg.start, seg.stop)
                    else:
                        self.graph.add_segment(i, slot, PLANE_LAYOUTS[seg.kind][3], [seg.records], seg.start,
                                               seg.stop)

    @classmethod
    def build(cls, model: Any, ops: TorchLayerOps) -> CpuDecoderGraph | None:
        """The model's graph, or None (logged: why) when it does not qualify."""
        reason = "the layer ops have no compiled kernels" if not ops.linear_kernels else _unsupported(model)
        if reason is not None:
            logger.info("Decoder graph: off (%s); steps run module by module", reason)
            return None
        graph = cls(model, ops)
        logger.info("Decoder graph: %d layers recorded; steps of up to %d tokens run in one call",
                    graph.graph.num_layers, GRAPH_MAX_ROWS)
        return graph

    def applies(self, metadata: list[Any], num_tokens: int) -> bool:
        """Whether this step's attention all runs in the paged kernel and it is small enough for the graph."""
        if num_tokens > GRAPH_MAX_ROWS or len(metadata) != self.num_groups:
            return False
        return all(isinstance(md, CpuAttentionMetadata) and md.num_kernel_reqs == md.common.num_reqs
                   and md.common.key_limits is None for md in metadata)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: list[CpuAttentionMetadata]
            ) -> torch.Tensor:
        """The final-normed hidden states [T, hidden] of the step's tokens."""
        h = self.model.model.embed_input_ids(input_ids).contiguous()
        return self.graph.run(h, positions, [md.common.slot_mapping for md in metadata],
                              [md.block_table for md in metadata], [md.query_start_loc for md in metadata],
                              [md.context_lens for md in metadata])
