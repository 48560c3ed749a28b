"""The SigLIP vision tower (HF's SiglipVisionModel without its pooling head, as Gemma 3 and Idefics3 use it): conv
patch embedding with learned positions (no class token), the pre-norm ViT layers CLIP has, a post-norm.

A plain float module run once per image outside the paged KV cache; HF parameter names (under `vision_tower.`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagemill.models.clip import CLIPEncoder


class SiglipVisionEmbeddings(nn.Module):
    """Conv patch embedding (with bias) plus one learned position per patch."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        h = config.hidden_size
        self.patch_embedding = nn.Conv2d(config.num_channels, h, config.patch_size, config.patch_size)
        self.num_patches = (config.image_size // config.patch_size) ** 2
        self.position_embedding = nn.Embedding(self.num_patches, h)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] (H = W = image_size) -> [N, patches, hidden]."""
        w = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(w.dtype)).flatten(2).transpose(1, 2)
        if patches.shape[1] != self.num_patches:
            raise ValueError(f"pixel_values: {patches.shape[1]} patches for a tower of {self.num_patches}.")
        return patches + self.position_embedding.weight


class SiglipVisionTower(nn.Module):
    """SiglipVisionModel's `last_hidden_state`: embeddings -> encoder layers -> post_layernorm."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embeddings = SiglipVisionEmbeddings(config)
        self.encoder = CLIPEncoder(config, config.num_hidden_layers)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    @staticmethod
    def holds(name: str) -> bool:
        """Whether a checkpoint tensor name (under `vision_tower.`) belongs to a built module (not the pooling
        head, which Gemma 3 never reads)."""
        return not name.startswith("head.")

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] -> [N, patches, hidden]."""
        h = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            h = layer(h)
        return self.post_layernorm(h)
