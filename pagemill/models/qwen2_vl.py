"""Qwen2-VL (HF's Qwen2VLForConditionalGeneration): a ViT over (temporal x 14 x 14) patches with 2D rotary, a patch
merger (2x2 patches -> one token), and a Qwen2 decoder with M-RoPE (3-section rotary over temporal / height / width
position ids; text after an image continues from its largest position + 1, as transformers' get_rope_index)."""

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


class VisionBlock(nn.Module):
    """Pre-LayerNorm ViT block: bidirectional attention with 2D rotary over one image's patches, then the MLP."""

    def __init__(self, vc: Any) -> None:
        super().__init__()
        dim, self.heads = vc.embed_dim, vc.num_heads
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6)
        self.attn, self.mlp = nn.Module(), nn.Module()  # (HF's module names)
        self.attn.qkv, self.attn.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        hidden = int(dim * vc.mlp_ratio)
        self.mlp.fc1, self.mlp.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.act = VISION_ACTIVATIONS[vc.hidden_act]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [N images, P patches, dim]; cos / sin [P, head_dim] (every image of the batch has one grid)."""
        n, p, dim = x.shape
        q, k, v = self.attn.qkv(self.norm1(x)).view(n, p, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        q = (q.float() * cos + RotaryEmbedding._rotate_half(q.float()) * sin).to(v.dtype)
        k = (k.float() * cos + RotaryEmbedding._rotate_half(k.float()) * sin).to(v.dtype)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, p, dim)
        x = x + self.attn.proj(a)
        return x + self.mlp.fc2(self.act(self.mlp.fc1(self.norm2(x))))


class Qwen2VisionTower(nn.Module):
    """Patch embed (Conv3d over temporal x patch x patch), ViT blocks with 2D rotary, patch merger."""

    def __init__(self, vc: Any) -> None:
        super().__init__()
        self.vc, self.merge = vc, vc.spatial_merge_size
        kernel = (vc.temporal_patch_size, vc.patch_size, vc.patch_size)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(vc.in_channels, vc.embed_dim, kernel, stride=kernel, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(vc) for _ in range(vc.depth))
        ctx_dim = vc.embed_dim * self.merge ** 2
        self.merger = nn.Module()
        self.merger.ln_q = nn.LayerNorm(vc.embed_dim, eps=1e-6)
        self.merger.mlp = nn.Sequential(nn.Linear(ctx_dim, ctx_dim), nn.GELU(), nn.Linear(ctx_dim, vc.hidden_size))
        head_dim = vc.embed_dim // vc.num_heads
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
        vc, w = self.vc, self.patch_embed.proj.weight
        x = pixels.reshape(n * p, vc.in_channels, vc.temporal_patch_size, vc.patch_size, vc.patch_size)
        x = self.patch_embed.proj(x.to(w.dtype)).view(n, p, vc.embed_dim)
        cos, sin = self.rotary(grid)
        for block in self.blocks:
            x = block(x, cos, sin)
        x = self.merger.ln_q(x).reshape(n, p // self.merge ** 2, -1)
        return self.merger.mlp(x)


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

    def __init__(self, hf_config: Any, ctx: LayerContext) -> None:
        super().__init__(hf_config.text_config, ctx)
        self.config = hf_config
        rope = MRotaryEmbedding(hf_config.text_config, ctx.max_position, ctx.dtype)
        for layer in self.model.layers[self.model.start_layer:self.model.end_layer]:
            layer.self_attn.attn.rotary = rope
            layer.self_attn.attn.fused = False  # the fused rope + cache write reads one position per token
        self.visual = Qwen2VisionTower(hf_config.vision_config).to(ctx.dtype)
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
