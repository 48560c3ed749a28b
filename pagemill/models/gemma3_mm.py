"""Gemma 3 with images (HF's Gemma3ForConditionalGeneration): a SigLIP tower, a projector (average pool to
`mm_tokens_per_image` tokens, (1 + w) RMSNorm, a linear map) and the Gemma 3 decoder. Image placeholder tokens attend
to each other bidirectionally within their own image (HF's token_type_ids mask): the model says so with
`bidirectional_image_attention`, the runner passes per-token key limits to the attention backend, and the scheduler
never splits an image's placeholder run over two steps (vLLM's disable_chunked_mm_input)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagemill.layers.context import LayerContext
from pagemill.models.gemma3 import Gemma3ForCausalLM
from pagemill.models.llava import normalize_llava_name
from pagemill.models.siglip import SiglipVisionTower
from pagemill.models.vision_language import VisionLanguageModel


class Gemma3MultiModalProjector(nn.Module):
    """Patch grid -> avg-pool to mm_tokens_per_image -> RMSNorm (1 + w, float32) -> @ mm_input_projection_weight."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vc = config.vision_config
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(vc.hidden_size, config.text_config.hidden_size))
        self.mm_soft_emb_norm = nn.Module()
        self.mm_soft_emb_norm.weight = nn.Parameter(torch.zeros(vc.hidden_size))
        self.eps = vc.layer_norm_eps
        self.patches_per_side = vc.image_size // vc.patch_size
        tokens_per_side = int(config.mm_tokens_per_image ** 0.5)
        if tokens_per_side ** 2 != config.mm_tokens_per_image or self.patches_per_side % tokens_per_side:
            raise ValueError(f"mm_tokens_per_image {config.mm_tokens_per_image} does not pool a "
                             f"{self.patches_per_side}x{self.patches_per_side} patch grid.")
        self.kernel = self.patches_per_side // tokens_per_side

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[N, patches, vision hidden] -> [N, mm_tokens_per_image, text hidden]."""
        n, _, h = x.shape
        grid = x.transpose(1, 2).reshape(n, h, self.patches_per_side, self.patches_per_side)
        pooled = nn.functional.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        p = pooled.float()
        p = p * torch.rsqrt(p.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.mm_soft_emb_norm.weight.float())
        return torch.matmul(p.to(x.dtype), self.mm_input_projection_weight).to(x.dtype)


class Gemma3ForConditionalGeneration(VisionLanguageModel, Gemma3ForCausalLM):
    """Gemma 3 4B / 12B / 27B-style: image -> SigLIP -> projector -> one embedding per `<image_soft_token>`."""

    checkpoint_name = staticmethod(normalize_llava_name)
    bidirectional_image_attention = True  # placeholder tokens see their whole image (HF's token_type_ids mask)

    def __init__(self, hf_config: Any, ctx: LayerContext) -> None:
        super().__init__(hf_config.text_config, ctx)
        self.config = hf_config
        self.vision_tower = SiglipVisionTower(hf_config.vision_config).to(ctx.dtype)
        self.multi_modal_projector = Gemma3MultiModalProjector(hf_config).to(ctx.dtype)
        self.image_token_id = hf_config.image_token_id
        self.num_encoder_calls = 0  # images encoded (tests check that none is encoded twice)

    def embed_multimodal(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """Placeholder embeddings of each image of a batch [N, C, H, W]: N tensors [mm_tokens_per_image, hidden]."""
        self.num_encoder_calls += pixel_values.shape[0]
        return list(self.multi_modal_projector(self.vision_tower(pixel_values)).unbind(0))
