"""Qwen2-VL and Qwen2.5-VL (HF's Qwen2VLForConditionalGeneration / Qwen2_5_VLForConditionalGeneration): a ViT over (temporal x 14 x 14) patches with 2D rotary, a patch
merger (2x2 patches -> one token), and a Qwen2 decoder with M-RoPE (3-section rotary over temporal / height / width
position ids; text after an image continues from its largest position + 1, as transformers' get_rope_index).
Qwen2.5-VL's ViT: RMSNorm, SwiGLU MLP, window attention."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagemill.layers.context import LayerContext
from pagemill.layers.rotary import RotaryEmbedding
from pagemill.messages import MultiModalFeature
from pagemill.models.clip import VISION_ACTIVATIONS
from pagemill.models.decoder import DecoderForCausalLM, DecoderSpec

ACTIVATIONS = {**VISION_ACTIVATIONS, "silu": F.silu}


class MRotaryEmbedding(RotaryEmbedding):
    """M-RoPE: positions [3, T] (temporal, height, width); the rotary features split in `mrope_section` parts, part i
    rotated by position row i. Positions [T] (text only) are the plain RoPE."""

    def __init__(self, hf_config: Any, max_position: int, dtype: torch.dtype) -> None:
        super().__init__(hf_config, max_position, dtype)
        params = getattr(hf_config, "rope_parameters", None) or {}
        section = list(params.get("mrope_section") or getattr(hf_config, "rope_scaling", {}).get("mrope_section"))
        if sum(section) * 2 != self.rotary_dim:
            raise ValueError(f"mrope_section {section} does not cover the rotary dim {self.rotary_dim} / 2.")
        half = torch.cat([torch.full((n,), i % 3) for i, n in enumerate(section)])
        self.register_buffer("section_of", torch.cat((half, half)), persistent=False)  # [rotary_dim]: its row

    def _table(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if positions.dim() == 1:
            return table[positions]
        rows = table[positions]  # [3, T, D]
        return rows.gather(0, self.section_of.view(1, 1, -1).expand(1, rows.shape[1], -1)).squeeze(0)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self._table(self.cos, positions).unsqueeze(1)
        sin = self._table(self.sin, positions).unsqueeze(1)
        return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin


def mrope_prompt_positions(num_tokens: int, features: Sequence[MultiModalFeature], merge: int
                           ) -> tuple[np.ndarray, int]:
    """(M-RoPE position ids [3, num_tokens] of a prompt with images, the delta that later tokens add to their index)
    as transformers' get_rope_index: text counts on from the previous span, an image's tokens take (t, h, w) grid
    positions from where the text stopped, the next text starts at that start + max(h, w) / merge."""
    pos = np.empty((3, num_tokens), dtype=np.int64)
    cur = start = 0
    for f in sorted(features, key=lambda f: f.offset):
        n = f.offset - cur
        pos[:, cur:f.offset] = start + np.arange(n)
        start += n
        t, h, w = f.grid_thw
        lh, lw = h // merge, w // merge
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(lh), np.arange(lw), indexing="ij")
        span = np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + start
        if span.shape[1] != f.length:
            raise ValueError(f"an image of grid {f.grid_thw} has {f.length} placeholder tokens, not {span.shape[1]}.")
        pos[:, f.offset:f.offset + f.length] = span
        start += max(lh, lw)
        cur = f.offset + f.length
    pos[:, cur:] = start + np.arange(num_tokens - cur)
    return pos, int(pos.max()) + 1 - num_tokens


class VisionRMSNorm(nn.Module):
    """Qwen2.5-VL's RMSNorm (float32 statistics, eps 1e-6)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class VisionBlock(nn.Module):
    """Pre-norm ViT block: bidirectional attention with 2D rotary over one image's patches (or its windows), then
    the MLP. Qwen2-VL: LayerNorm and fc1 / act / fc2; Qwen2.5-VL (`v25`): RMSNorm and the gated SwiGLU MLP."""

    def __init__(self, vc: Any, v25: bool = False) -> None:
        super().__init__()
        dim = vc.hidden_size if v25 else vc.embed_dim
        self.heads, self.v25 = vc.num_heads, v25
        norm = VisionRMSNorm if v25 else (lambda d: nn.LayerNorm(d, eps=1e-6))
        self.norm1, self.norm2 = norm(dim), norm(dim)
        self.attn, self.mlp = nn.Module(), nn.Module()  # (HF's module names)
        self.attn.qkv, self.attn.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        if v25:
            hidden = vc.intermediate_size
            self.mlp.gate_proj, self.mlp.up_proj = nn.Linear(dim, hidden), nn.Linear(dim, hidden)
            self.mlp.down_proj = nn.Linear(hidden, dim)
        else:
            hidden = int(dim * vc.mlp_ratio)
            self.mlp.fc1, self.mlp.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.act = ACTIVATIONS[vc.hidden_act]

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        m = self.mlp
        if self.v25:
            return m.down_proj(self.act(m.gate_proj(x)) * m.up_proj(x))
        return m.fc2(self.act(m.fc1(x)))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [N images, P patches, dim]; cos / sin [P, head_dim] (every image of the batch has one grid); `mask`
        [P, P] (True: may attend; window attention) or None (the whole image)."""
        n, p, dim = x.shape
        q, k, v = self.attn.qkv(self.norm1(x)).view(n, p, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        q = (q.float() * cos + RotaryEmbedding._rotate_half(q.float()) * sin).to(v.dtype)
        k = (k.float() * cos + RotaryEmbedding._rotate_half(k.float()) * sin).to(v.dtype)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(n, p, dim)
        x = x + self.attn.proj(a)
        return x + self._mlp(self.norm2(x))


def window_order(grid: Sequence[int], merge: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2.5-VL's windows of one grid (transformers' get_vision_window_index): (the merged-token order that puts
    each window's tokens together, each patch's window id in that order)."""
    t, h, w = grid
    lh, lw = h // merge, w // merge
    index = torch.arange(t * lh * lw).reshape(t, lh, lw)
    pad_h, pad_w = window - lh % window, window - lw % window
    nh, nw = (lh + pad_h) // window, (lw + pad_w) // window
    padded = F.pad(index, (0, pad_w, 0, pad_h), "constant", -100)
    padded = padded.reshape(t, nh, window, nw, window).permute(0, 1, 3, 2, 4).reshape(t * nh * nw, window * window)
    wid = torch.arange(padded.shape[0])[:, None].expand_as(padded)
    keep = padded != -100
    order, ids = padded[keep], wid[keep]
    return order, ids.repeat_interleave(merge * merge)


class Qwen2VisionTower(nn.Module):
    """Patch embed (Conv3d over temporal x patch x patch), ViT blocks with 2D rotary, patch merger."""

    def __init__(self, vc: Any, v25: bool = False) -> None:
        super().__init__()
        self.vc, self.merge, self.v25 = vc, vc.spatial_merge_size, v25
        self.embed_dim = vc.hidden_size if v25 else vc.embed_dim
        out_dim = vc.out_hidden_size if v25 else vc.hidden_size
        kernel = (vc.temporal_patch_size, vc.patch_size, vc.patch_size)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(vc.in_channels, self.embed_dim, kernel, stride=kernel, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(vc, v25) for _ in range(vc.depth))
        self.full_blocks = set(getattr(vc, "fullatt_block_indexes", None) or range(vc.depth)) if v25 else None
        ctx_dim = self.embed_dim * self.merge ** 2
        self.merger = nn.Module()
        self.merger.ln_q = VisionRMSNorm(self.embed_dim) if v25 else nn.LayerNorm(self.embed_dim, eps=1e-6)
        self.merger.mlp = nn.Sequential(nn.Linear(ctx_dim, ctx_dim), nn.GELU(), nn.Linear(ctx_dim, out_dim))
        head_dim = self.embed_dim // vc.num_heads
        theta = (getattr(vc, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        spatial = head_dim // 2
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial),
                             persistent=False)

    def rotary(self, grid: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin [patches, head_dim] of one (t, h, w) grid, patches in merge-block order."""
        t, h, w = grid
        m = self.merge
        hp, wp = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        hp = hp.reshape(h // m, m, w // m, m).transpose(1, 2).flatten().repeat(t)
        wp = wp.reshape(h // m, m, w // m, m).transpose(1, 2).flatten().repeat(t)
        inv = self.inv_freq.to(hp.device)
        freqs = torch.cat((hp[:, None].float() * inv, wp[:, None].float() * inv), dim=-1)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, pixels: torch.Tensor, grid: Sequence[int]) -> torch.Tensor:
        """pixels [N, patches, C * tps * ps * ps] of N images of one grid -> [N, patches / merge^2, hidden]."""
        n, p, _ = pixels.shape
        vc, w, unit = self.vc, self.patch_embed.proj.weight, self.merge ** 2
        x = pixels.reshape(n * p, vc.in_channels, vc.temporal_patch_size, vc.patch_size, vc.patch_size)
        x = self.patch_embed.proj(x.to(w.dtype)).view(n, p, self.embed_dim)
        cos, sin = self.rotary(grid)
        order = mask = None
        if self.v25:  # patches regrouped window by window (whole merge units); window blocks see their window only
            order, ids = window_order(grid, self.merge, vc.window_size // self.merge // vc.patch_size)
            patch_order = (order[:, None] * unit + torch.arange(unit)).flatten()
            x, cos, sin = x[:, patch_order], cos[patch_order], sin[patch_order]
            mask = ids[:, None] == ids[None, :]
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, None if order is None or i in self.full_blocks else mask)
        x = self.merger.mlp(self.merger.ln_q(x).reshape(n, p // unit, -1))
        return x if order is None else x[:, torch.argsort(order)]


def normalize_qwen2_vl_name(name: str) -> str:
    """transformers 5's `model.language_model.*` / `model.visual.*` (or the legacy `model.*` / `visual.*`) names in
    this model's: `model.*` / `lm_head.*` (the decoder), `visual.*`."""
    for old, new in (("model.language_model.", "model."), ("model.visual.", "visual.")):
        if name.startswith(old):
            return new + name[len(old):]
    return name


class Qwen2VLForConditionalGeneration(DecoderForCausalLM):
    """Qwen2-VL: the vision tower's merged patches become the image placeholders' embeddings; the decoder's rotary
    is M-RoPE (the runner passes [3, T] position ids: `mrope_prompt_positions` for a prompt with images)."""

    supports_multimodal = True
    uses_mrope = True
    vision_v25 = False  # Qwen2.5-VL's tower (RMSNorm, SwiGLU MLP, window attention)

    def __init__(self, hf_config: Any, ctx: LayerContext) -> None:
        super().__init__(hf_config.text_config, ctx)
        self.config = hf_config
        rope = MRotaryEmbedding(hf_config.text_config, ctx.max_position, ctx.dtype)
        for layer in self.model.layers[self.model.start_layer:self.model.end_layer]:
            layer.self_attn.attn.rotary = rope
            layer.self_attn.attn.fused = False  # the fused rope + cache write reads one position per token
        self.visual = Qwen2VisionTower(hf_config.vision_config, self.vision_v25).to(ctx.dtype)
        self.spatial_merge_size = hf_config.vision_config.spatial_merge_size
        self.image_token_id = hf_config.image_token_id
        self.num_encoder_calls = 0

    @classmethod
    def decoder_spec(cls, hf_config: Any) -> DecoderSpec:
        """Qwen2's: Q/K/V biases."""
        return DecoderSpec.from_hf_config(hf_config, qkv_bias=True, o_bias=False)

    def mrope_prompt_positions(self, num_tokens: int, features: Sequence[MultiModalFeature]
                               ) -> tuple[np.ndarray, int]:
        """A prompt's M-RoPE positions [3, num_tokens] and its position delta (see `mrope_prompt_positions`)."""
        return mrope_prompt_positions(num_tokens, features, self.spatial_merge_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, hidden] (the placeholders' rows are overwritten by the runner)."""
        return self.model.embed_input_ids(input_ids)

    def embed_multimodal(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """Placeholder embeddings of N images of one grid (pixels [N, patches, features], grid_thw [N, 3])."""
        self.num_encoder_calls += pixel_values.shape[0]
        return list(self.visual(pixel_values, [int(v) for v in grid_thw[0]]).unbind(0))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds=inputs_embeds)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        super().load_weights((normalize_qwen2_vl_name(name), t) for name, t in weights)

    def checkpoint_targets(self, name: str) -> list[str]:
        if name.startswith("visual."):
            return [name]
        return super().checkpoint_targets(name)


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: Qwen2-VL with RMSNorm, a SwiGLU MLP and window attention (all but `fullatt_block_indexes`) in the
    ViT; the same M-RoPE decoder (an image's temporal ids are all 0, as for Qwen2-VL)."""

    vision_v25 = True
