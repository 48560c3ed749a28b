"""A prompt with images -> (token ids with each image's placeholder expanded, one MultiModalFeature per image),
by the model's own HF processor (image processor + placeholder expansion), loaded from the model directory."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from pagemill.messages import MultiModalFeature
from pagemill.multimodal.image import MultiModalInputError, check_image

QWEN2_VL_TYPES = ("qwen2_vl", "qwen2_5_vl")  # without torchvision their HF processor does not load: images only
DEFAULT_IMAGE_LIMIT = 8  # images per prompt unless --limit-mm-per-prompt says otherwise


def image_hash(pixels: np.ndarray) -> str:
    """Content hash of an image's processed pixels (what the prefix cache keys its placeholder blocks by)."""
    h = hashlib.sha256(repr((pixels.dtype.str, pixels.shape)).encode())
    h.update(np.ascontiguousarray(pixels).data)
    return h.hexdigest()


def placeholder_spans(ids: list[int], token_id: int, num_images: int) -> list[tuple[int, int]]:
    """(offset, length) of each image's placeholder run: the runs of `token_id`, a run of k adjacent images split
    evenly (every image of a fixed-size family expands to as many tokens)."""
    arr = np.asarray(ids)
    is_ph = np.concatenate([[False], arr == token_id, [False]])
    edges = np.flatnonzero(is_ph[1:] != is_ph[:-1])
    runs = list(zip(edges[::2].tolist(), (edges[1::2] - edges[::2]).tolist()))
    if len(runs) == num_images:
        return runs
    total = sum(n for _, n in runs)
    if num_images and total % num_images == 0 and all(n % (total // num_images) == 0 for _, n in runs):
        per = total // num_images
        return [(off + k * per, per) for off, n in runs for k in range(n // per)]
    raise ValueError(f"multi_modal_data: the processed prompt has {len(runs)} image placeholder runs "
                     f"({total} tokens) for {num_images} images.")


class MultiModalProcessor:
    """Runs the model's HF processor over a prompt text and its images (in the front end, never the engine core)."""

    def __init__(self, model_config: Any) -> None:
        from transformers import AutoProcessor

        config = model_config.mm_hf_config
        qwen2_vl = getattr(config, "model_type", None) in QWEN2_VL_TYPES
        if qwen2_vl:
            # images only, placeholders expanded here: HF's processor needs torchvision for its video part, and
            # where it loads at all its behaviour then depends on what else is installed or patched
            from pagemill.multimodal.qwen2_vl_processor import Qwen2VLImageProcessorOnly

            self.hf_processor = Qwen2VLImageProcessorOnly.from_pretrained(model_config.model)
        else:
            self.hf_processor = AutoProcessor.from_pretrained(model_config.model)
        self.image_token_id = getattr(config, "image_token_id", None)
        if self.image_token_id is None:
            self.image_token_id = config.image_token_index
        if qwen2_vl:  # the pad token's text from its id: a tokenizer's own `image_token` attribute is not reliable
            self.hf_processor.image_token = self.hf_processor.tokenizer.convert_ids_to_tokens(self.image_token_id)
        self.image_token = getattr(self.hf_processor, "image_token", None) or "<image>"
        # what an image part of a chat becomes in its text (Qwen2-VL's chat template wraps the pad in start / end)
        self.chat_image_text = (f"<|vision_start|>{self.image_token}<|vision_end|>"
                                if getattr(config, "model_type", None) in QWEN2_VL_TYPES else self.image_token)
        self.image_limit = (model_config.limit_mm_per_prompt or {}).get("image", DEFAULT_IMAGE_LIMIT)
        self.allowed_local_media_path = model_config.allowed_local_media_path

    def check_images(self, images: Any, param: str = "multi_modal_data.image") -> list[Any]:
        """The images of a prompt as a list of RGB PIL images, within the per-prompt limit."""
        if not isinstance(images, (list, tuple)):
            images = [images]
        if len(images) > self.image_limit:
            raise MultiModalInputError(f"{len(images)} images in one prompt; at most {self.image_limit} are allowed "
                                       "(--limit-mm-per-prompt).", param)
        return [check_image(im, f"{param}[{i}]" if len(images) > 1 else param) for i, im in enumerate(images)]

    def process_chat(self, text: str, sources: list[tuple[str, Any, str]]
                     ) -> tuple[list[int], list[MultiModalFeature]]:
        """A rendered chat (its special tokens in the text) and its image parts (multimodal.chat.take_images):
        the images loaded, checked and processed (in the server's prompt worker, off the event loop)."""
        from pagemill.multimodal.chat import load_images

        if len(sources) > self.image_limit:
            raise MultiModalInputError(f"{len(sources)} images in one request; at most {self.image_limit} are "
                                       "allowed (--limit-mm-per-prompt).", sources[self.image_limit][2])
        return self.process(text, load_images(sources, self.allowed_local_media_path), add_special_tokens=False,
                            param="messages")

    def process(self, text: str, images: Any, add_special_tokens: bool = True,
                param: str = "multi_modal_data.image") -> tuple[list[int], list[MultiModalFeature]]:
        """(prompt token ids, the images' features); `text` holds one image placeholder (e.g. `<image>`) per image,
        in order."""
        images = self.check_images(images, param)
        if not isinstance(text, str) or not text:
            raise ValueError("prompt must be a non-empty string when multi_modal_data is given.")
        n = text.count(self.image_token)
        if n != len(images):
            raise MultiModalInputError(f"the prompt has {n} image placeholders ({self.image_token}) for "
                                       f"{len(images)} images.", param)
        if not images:
            return self.hf_processor.tokenizer.encode(text, add_special_tokens=add_special_tokens), []
        out = self.hf_processor(text=[text], images=images, return_tensors="np",
                                add_special_tokens=add_special_tokens)
        ids = [int(t) for t in out["input_ids"][0]]
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        grids: list[list[int] | None] = [None] * len(images)
        if "image_grid_thw" in out:  # the Qwen2-VL family: every image's patches, flattened one after another
            grids = [[int(v) for v in g] for g in np.asarray(out["image_grid_thw"])]
            ends = np.cumsum([int(np.prod(g)) for g in grids])
            pixels = np.split(pixels, ends[:-1])
        elif pixels.ndim == 5:  # Idefics3's tiles [1, tiles, C, H, W]: each tile its own feature (its own run)
            pixels = pixels[0]
            grids = [None] * len(pixels)
        spans = placeholder_spans(ids, self.image_token_id, len(grids))
        features = []
        for (offset, length), pv, grid in zip(spans, pixels, grids):
            pv = np.ascontiguousarray(pv)
            key = image_hash(pv) if grid is None else image_hash(pv) + "-" + "x".join(map(str, grid))
            features.append(MultiModalFeature(key, offset, length, pv.tobytes(), list(pv.shape), str(pv.dtype),
                                              grid_thw=grid))
        return ids, features
