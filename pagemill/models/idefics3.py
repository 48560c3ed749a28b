"""SmolVLM / Idefics3 (HF's Idefics3ForConditionalGeneration): a SigLIP-like tower over square tiles (the processor
splits an image into rows x cols tiles plus a downsized global one), a pixel-shuffle connector (scale_factor^2
neighbouring patches -> one token, then a linear map) and a Llama decoder.

Every tile is its own image feature here (its own placeholder run, encoder output and prefix-cache key): the
processor's tiles are all full squares, so HF's bucketed position ids are the plain patch order."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagemill.layers.context import LayerContext
from pagemill.models.decoder import DecoderForCausalLM
from pagemill.models.siglip import SiglipVisionTower
from pagemill.models.vision_language import VisionLanguageModel


def _bucketed_positions(per_side: int) -> torch.Tensor:
    """HF Idefics3VisionEmbeddings' position ids of a full tile (fractional coordinates bucketized, in float32)."""
    boundaries = torch.arange(1 / per_side, 1.0, 1 / per_side)
    frac = torch.clamp(torch.arange(per_side, dtype=torch.float32) * (1.0 / torch.tensor(per_side)), max=1.0 - 1e-6)
    bucket = torch.bucketize(frac, boundaries, right=True)
    return (bucket[:, None] * per_side + bucket[None, :]).reshape(-1)


class Idefics3VisionTower(SiglipVisionTower):
    """SigLIP over full tiles, its positions as HF buckets them."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.register_buffer("position_ids", _bucketed_positions(config.image_size // config.patch_size),
                             persistent=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] tiles -> [N, patches, hidden]."""
        emb = self.embeddings
        w = emb.patch_embedding.weight
        h = emb.patch_embedding(pixel_values.to(w.dtype)).flatten(2).transpose(1, 2)
        if h.shape[1] != emb.num_patches:
            raise ValueError(f"pixel_values: {h.shape[1]} patches for a tower of {emb.num_patches}.")
        h = h + emb.position_embedding(self.position_ids)
        for layer in self.encoder.layers:
            h = layer(h)
        return self.post_layernorm(h)


class Idefics3Connector(nn.Module):
    """Pixel shuffle (scale_factor x scale_factor patches into one token's features) -> modality_projection.proj."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.scale = config.scale_factor
        self.modality_projection = nn.Module()
        self.modality_projection.proj = nn.Linear(config.vision_config.hidden_size * self.scale ** 2,
                                                  config.text_config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[N, patches, hidden] -> [N, patches / scale^2, text hidden] (HF's pixel_shuffle, step by step)."""
        n, seq, d = x.shape
        side, s = int(seq ** 0.5), self.scale
        x = x.reshape(n, side, side // s, d * s).permute(0, 2, 1, 3)
        x = x.reshape(n, side // s, side // s, d * s * s).permute(0, 2, 1, 3)
        return self.modality_projection.proj(x.reshape(n, seq // (s * s), d * s * s))


def normalize_idefics3_name(name: str) -> str:
    """An Idefics3 checkpoint name in this model's names: `model.*` / `lm_head.*` (the decoder), `vision_tower.*`,
    `connector.*`."""
    for old, new in (("model.text_model.", "model."), ("model.vision_model.", "vision_tower."),
                     ("model.connector.", "connector.")):
        if name.startswith(old):
            return new + name[len(old):]
    return name


class Idefics3ForConditionalGeneration(VisionLanguageModel, DecoderForCausalLM):
    """SmolVLM-style: each tile -> SigLIP -> pixel shuffle + linear -> one embedding per `<image>` token of its run."""

    checkpoint_name = staticmethod(normalize_idefics3_name)

    def __init__(self, hf_config: Any, ctx: LayerContext) -> None:
        super().__init__(hf_config.text_config, ctx)
        self.config = hf_config
        self.vision_tower = Idefics3VisionTower(hf_config.vision_config).to(ctx.dtype)
        self.connector = Idefics3Connector(hf_config).to(ctx.dtype)
        self.image_token_id = hf_config.image_token_id
        self.num_encoder_calls = 0  # tiles encoded (tests check that none is encoded twice)

    def embed_multimodal(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """Placeholder embeddings of each tile of a batch [N, C, H, W]: N tensors [image_seq_len, hidden]."""
        self.num_encoder_calls += pixel_values.shape[0]
        return list(self.connector(self.vision_tower(pixel_values)).unbind(0))
