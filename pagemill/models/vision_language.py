"""What every image-in model here shares: a vision tower beside a decoder (`self.model`), whose checkpoint names
are mapped into this model's by `checkpoint_name`; each family adds its tower, projector and `embed_multimodal`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class VisionLanguageModel:
    """Mixin before the decoder class (`class X(VisionLanguageModel, DecoderForCausalLM)`)."""

    supports_multimodal = True

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """A checkpoint tensor's name in this model's names (the family's mapping)."""
        return name

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, hidden] (the placeholders' rows are overwritten by the runner)."""
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds=inputs_embeds)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        super().load_weights((self.checkpoint_name(name), t) for name, t in weights)

    def checkpoint_targets(self, name: str) -> list[str]:
        if name.startswith("vision_tower."):
            return [name] if self.vision_tower.holds(name[len("vision_tower."):]) else []
        return super().checkpoint_targets(name)
