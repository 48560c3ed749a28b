"""Qwen2-VL's processor for images only (HF's Qwen2VLProcessor needs torchvision for its video processor even when
no video is given): the model's image processor, then each image placeholder expanded to (t * h * w) / merge^2
copies, as Qwen2VLProcessor.replace_image_token does."""

from __future__ import annotations

from typing import Any

import numpy as np


class Qwen2VLImageProcessorOnly:
    """tokenizer + Qwen2-VL image processor, called like the HF processor (text=[one prompt], images=[...])."""

    def __init__(self, tokenizer: Any, image_processor: Any, image_token: str = "<|image_pad|>") -> None:
        self.tokenizer, self.image_processor = tokenizer, image_processor
        self.image_token = getattr(tokenizer, "image_token", None) or image_token

    @classmethod
    def from_pretrained(cls, path: str) -> Qwen2VLImageProcessorOnly:
        """The tokenizer and image processor saved in a model directory."""
        from transformers import AutoImageProcessor, AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path), AutoImageProcessor.from_pretrained(path))

    def __call__(self, text: list[str], images: list[Any], return_tensors: str = "np",
                 add_special_tokens: bool = True) -> dict[str, Any]:
        """input_ids [1, T], pixel_values [patches, features] (every image's, in order), image_grid_thw [N, 3]."""
        out = self.image_processor(images=images, return_tensors="np")
        grids = np.asarray(out["image_grid_thw"])
        merge = self.image_processor.merge_size ** 2
        pieces = text[0].split(self.image_token)
        if len(pieces) - 1 != len(grids):
            raise ValueError(f"{len(pieces) - 1} image placeholders for {len(grids)} images.")
        expanded = pieces[0]
        for grid, piece in zip(grids, pieces[1:]):
            expanded += self.image_token * int(np.prod(grid) // merge) + piece
        ids = self.tokenizer.encode(expanded, add_special_tokens=add_special_tokens)
        return {"input_ids": np.asarray([ids]), "pixel_values": np.asarray(out["pixel_values"]),
                "image_grid_thw": grids}
