"""LLaVA (HF's LlavaForConditionalGeneration): a CLIP vision tower, a two-layer projector, a Llama-family decoder.

The decoder is the decoder kit's (paged attention, fused layers, its text config as it is); the runner asks
`embed_multimodal` for each image's placeholder embeddings once, caches them, and passes the merged input embeddings
to `forward` (HF merges them at the image-token positions the same way)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagemill.layers.context import LayerContext
from pagemill.models.clip import VISION_ACTIVATIONS, CLIPVisionTower
from pagemill.models.decoder import DecoderForCausalLM
from pagemill.models.vision_language import VisionLanguageModel


class LlavaMultiModalProjector(nn.Module):
    """linear_1 -> act -> linear_2: vision features to the decoder's hidden size."""

    def __init__(self, config: Any, in_features: int) -> None:
        super().__init__()
        bias = getattr(config, "multimodal_projector_bias", True)
        out = config.text_config.hidden_size
        self.linear_1 = nn.Linear(in_features, out, bias=bias)
        self.act = VISION_ACTIVATIONS[config.projector_hidden_act]
        self.linear_2 = nn.Linear(out, out, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def normalize_llava_name(name: str) -> str:
    """A LLaVA checkpoint name (legacy `language_model.model.*` or transformers 5's `model.language_model.*`) in this
    model's names: `model.*` / `lm_head.*` (the decoder), `vision_tower.*`, `multi_modal_projector.*`."""
    for old, new in (("model.language_model.", "model."), ("language_model.model.", "model."),
                     ("language_model.lm_head.", "lm_head."), ("model.vision_tower.", "vision_tower."),
                     ("model.multi_modal_projector.", "multi_modal_projector.")):
        if name.startswith(old):
            name = new + name[len(old):]
            break
    if name.startswith("vision_tower.vision_model."):
        name = "vision_tower." + name[len("vision_tower.vision_model."):]
    return name


class LlavaForConditionalGeneration(VisionLanguageModel, DecoderForCausalLM):
    """LLaVA 1.5-style: image -> CLIP hidden states of `vision_feature_layer` (CLS dropped with the "default"
    strategy) -> projector -> one embedding per placeholder token."""

    checkpoint_name = staticmethod(normalize_llava_name)

    def __init__(self, hf_config: Any, ctx: LayerContext) -> None:
        super().__init__(hf_config.text_config, ctx)  # the decoder kit reads the text config as it is
        self.config = hf_config
        vc = hf_config.vision_config
        n = vc.num_hidden_layers
        layer = hf_config.vision_feature_layer
        self.feature_layers = [(i + n + 1) if i < 0 else i for i in (layer if isinstance(layer, list) else [layer])]
        self.strategy = hf_config.vision_feature_select_strategy
        if self.strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {self.strategy!r} is not supported.")
        self.vision_tower = CLIPVisionTower(vc, max(self.feature_layers)).to(ctx.dtype)
        self.multi_modal_projector = LlavaMultiModalProjector(
            hf_config, vc.hidden_size * len(self.feature_layers)).to(ctx.dtype)
        self.image_token_id = hf_config.image_token_id
        self.num_encoder_calls = 0  # images encoded (tests check that none is encoded twice)

    def embed_multimodal(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """Placeholder embeddings of each image of a batch [N, C, H, W]: N tensors [tokens, hidden]."""
        self.num_encoder_calls += pixel_values.shape[0]
        states = self.vision_tower(pixel_values, self.feature_layers)
        if self.strategy == "default":
            states = [s[:, 1:] for s in states]
        features = self.multi_modal_projector(torch.cat(states, dim=-1))
        return list(features.unbind(0))
