"""The CLIP vision tower (HF's CLIPVisionModel, as LLaVA uses it): patch embedding, pre-norm ViT encoder.

A plain float module (torch linears, SDPA over all patches of one image): it runs once per image, outside the paged
KV cache, and its output is cached by the model runner. HF parameter names, so checkpoints load as they are."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """CLIP's activation: x * sigmoid(1.702 x)."""
    return x * torch.sigmoid(1.702 * x)


VISION_ACTIVATIONS = {"quick_gelu": quick_gelu, "gelu": F.gelu,
                      "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class CLIPVisionEmbeddings(nn.Module):
    """Conv patch embedding, a class token, learned absolute positions."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        h = config.hidden_size
        self.class_embedding = nn.Parameter(torch.zeros(h))
        self.patch_embedding = nn.Conv2d(config.num_channels, h, config.patch_size, config.patch_size, bias=False)
        self.num_patches = (config.image_size // config.patch_size) ** 2
        self.position_embedding = nn.Embedding(self.num_patches + 1, h)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] -> [N, patches + 1, hidden]."""
        w = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(w.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPAttention(nn.Module):
    """Bidirectional multi-head attention over one image's patches."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = h // self.num_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(h, h) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(n, t, self.num_heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)),
                                             scale=self.head_dim ** -0.5)
        return self.out_proj(out.transpose(1, 2).reshape(n, t, -1))


class CLIPMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.act = VISION_ACTIVATIONS[config.hidden_act]
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.self_attn = CLIPAttention(config)
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = CLIPMLP(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, config: Any, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(config) for _ in range(num_layers))


class CLIPVisionTower(nn.Module):
    """CLIPVisionModel up to the deepest layer a consumer reads (HF's `hidden_states[i]`); the layers after it (and
    the post-norm, which LLaVA never reads) are not built, and their checkpoint tensors are skipped."""

    def __init__(self, config: Any, num_layers: int) -> None:
        super().__init__()
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)  # (HF's spelling)
        self.encoder = CLIPEncoder(config, num_layers)

    def holds(self, name: str) -> bool:
        """Whether a checkpoint tensor name (under `vision_tower.`) belongs to a built module."""
        parts = name.split(".")
        if parts[0] == "post_layernorm":
            return False
        if parts[0] == "encoder" and parts[1] == "layers":
            return int(parts[2]) < len(self.encoder.layers)
        return True

    def forward(self, pixel_values: torch.Tensor, layers: list[int]) -> list[torch.Tensor]:
        """HF's `hidden_states[i]` for each i in `layers` (0: the embeddings after the pre-norm)."""
        h = self.pre_layrnorm(self.embeddings(pixel_values))
        states = [h]
        for layer in self.encoder.layers:
            h = layer(h)
            states.append(h)
        return [states[i] for i in layers]
