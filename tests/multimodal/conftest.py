"""A tiny random LLaVA (CLIP vision tower + projector + Llama) with a locally assembled processor: SmolLM2's
tokenizer with an `<image>` token added, a CLIP image processor at 32x32 (16 placeholder tokens per image)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from pagemill.loader.default_model import default_model_path

TOKENS_PER_IMAGE = 16


def make_image(seed: int, size: tuple[int, int] = (48, 40)):
    """A random RGB image (PIL)."""
    from PIL import Image

    rng = np.random.RandomState(seed)
    return Image.fromarray(rng.randint(0, 256, (size[1], size[0], 3), dtype=np.uint8))


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory) -> str:
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    from pagemill.benchmarks.model_path import load_hf_tokenizer

    # a copy: the loader's tokenizer is cached per process, and the special tokens added here must not reach
    # the next fixture's model (its vocabulary, hence its random weights, would depend on the tests' order)
    tok = copy.deepcopy(load_hf_tokenizer(default_model_path()))
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    torch.manual_seed(0)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                              image_size=32, patch_size=8, projection_dim=32, initializer_range=0.2)
    # initializer_range 0.2: logits far apart, so greedy tokens do not hang on rounding
    text = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                       pad_token_id=2)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=tok.convert_tokens_to_ids("<image>"),
                         projector_hidden_act="gelu", image_seq_length=TOKENS_PER_IMAGE)
    model = LlavaForConditionalGeneration(config)
    with torch.no_grad():  # random images must move the logits: projector outputs on the scale of the embeddings
        for p in model.model.multi_modal_projector.parameters():
            p.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("tiny_llava")
    model.save_pretrained(path)
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    LlavaProcessor(image_processor=image_processor, tokenizer=tok, patch_size=8,
                   vision_feature_select_strategy="default", image_token="<image>",
                   num_additional_image_tokens=1).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def llava_hf(tiny_llava):
    """(HF model float32, HF processor) of the tiny LLaVA."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(tiny_llava, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(tiny_llava)


def hf_llava_greedy(llava_hf, prompt: str, images: list, max_new_tokens: int,
                    add_special_tokens: bool = True) -> tuple[list[int], list[int]]:
    """(prompt ids, HF greedy continuation) of a prompt with its images (none: text only)."""
    model, processor = llava_hf
    if images:
        inputs = processor(text=[prompt], images=images, return_tensors="pt", add_special_tokens=add_special_tokens)
    else:
        inputs = processor.tokenizer([prompt], return_tensors="pt", add_special_tokens=add_special_tokens)
    ids = inputs["input_ids"]
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             eos_token_id=None, pad_token_id=2)
    return ids[0].tolist(), out[0, ids.shape[1]:].tolist()


QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def _qwen2_vl_hf_processor(tok, image_processor):
    """HF's own Qwen2VLProcessor, built without a video processor (its class check needs torchvision, which this
    environment lacks; images never touch the video processor)."""
    from unittest import mock

    from transformers import ProcessorMixin, Qwen2VLProcessor

    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None):
        return Qwen2VLProcessor(image_processor=image_processor, tokenizer=tok, video_processor=None)


def build_tiny_qwen_vl(path, v25: bool) -> str:
    """A tiny random Qwen2-VL (or Qwen2.5-VL: `v25`) saved under `path`: ViT (patch 4, merge 2; Qwen2.5-VL's windows
    2x2 merged tokens, block 1 of 3 full attention) + Qwen2 decoder with M-RoPE; images resized to 32..48 px a side
    (16..36 placeholder tokens, grids of unequal height and width)."""
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from pagemill.benchmarks.model_path import load_hf_tokenizer

    # a copy: the loader's tokenizer is cached per process, and the special tokens added here must not reach
    # the next fixture's model (its vocabulary, hence its random weights, would depend on the tests' order)
    tok = copy.deepcopy(load_hf_tokenizer(default_model_path()))
    names = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
    tok.add_special_tokens({"additional_special_tokens": names})
    ids = {t: tok.convert_tokens_to_ids(t) for t in names}
    torch.manual_seed(0)
    common = dict(patch_size=4, spatial_merge_size=2, temporal_patch_size=2, in_channels=3, initializer_range=0.2,
                  num_heads=4)
    if v25:
        vision = dict(depth=3, hidden_size=32, out_hidden_size=32, intermediate_size=48, hidden_act="silu",
                      window_size=16, fullatt_block_indexes=[1], **common)
    else:
        vision = dict(depth=2, embed_dim=32, hidden_size=32, mlp_ratio=2, **common)
    text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2,
                tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
    config_cls, model_cls = ((Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration) if v25
                             else (Qwen2VLConfig, Qwen2VLForConditionalGeneration))
    config = config_cls(vision_config=vision, text_config=text, image_token_id=ids["<|image_pad|>"],
                        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    model = model_cls(config)
    with torch.no_grad():  # random images must move the logits
        for p in model.model.visual.merger.parameters():
            p.normal_(0, 0.5)
    model.save_pretrained(path)
    Qwen2VLImageProcessorPil(min_pixels=32 * 32, max_pixels=48 * 48, patch_size=4, merge_size=2,
                             temporal_patch_size=2).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def load_qwen_vl_hf(path: str):
    """(HF model float32, HF Qwen2VLProcessor) of a tiny Qwen2-VL / Qwen2.5-VL directory."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return model, _qwen2_vl_hf_processor(AutoTokenizer.from_pretrained(path), AutoImageProcessor.from_pretrained(path))


GEMMA3_TOKENS_PER_IMAGE = 16
GEMMA3_IMAGE = "<start_of_image>"  # what a prompt holds per image (the processor expands it to 16 soft tokens + 4)


def build_tiny_gemma3(path) -> str:
    """A tiny random Gemma 3 with images saved under `path`: SigLIP (32x32 images, patch 4: 64 patches pooled 2x2
    to 16 tokens) + a 3-layer Gemma 3 decoder (sliding window 24 on layers 0 and 2); SmolLM2's tokenizer with
    Gemma's image tokens added (boi / image / eoi as the tokenizer's extra special tokens), HF's Gemma3Processor."""
    import json

    from transformers import (AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor,
                              Gemma3TextConfig, SiglipVisionConfig)
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from pagemill.benchmarks.model_path import load_hf_tokenizer

    # a copy: the loader's tokenizer is cached per process, and the special tokens added here must not reach
    # the next fixture's model (its vocabulary, hence its random weights, would depend on the tests' order)
    tok = copy.deepcopy(load_hf_tokenizer(default_model_path()))
    specials = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
    tok.add_special_tokens({"additional_special_tokens": list(specials.values())})
    tok.save_pretrained(path)
    with open(f"{path}/tokenizer_config.json") as f:
        tok_config = json.load(f)
    tok_config["extra_special_tokens"] = specials  # tokenizer.boi_token etc., which Gemma3Processor reads
    with open(f"{path}/tokenizer_config.json", "w") as f:
        json.dump(tok_config, f)
    tok = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                image_size=32, patch_size=4, vision_use_head=False)
    text = Gemma3TextConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=24,
                            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                            query_pre_attn_scalar=8, max_position_embeddings=512, initializer_range=0.2,
                            bos_token_id=1, eos_token_id=2, pad_token_id=2)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=GEMMA3_TOKENS_PER_IMAGE,
                          boi_token_index=tok.boi_token_id, eoi_token_index=tok.eoi_token_id,
                          image_token_index=tok.image_token_id, initializer_range=0.2)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # small decoder weights, large projector: greedy tokens vary and hang on the image mask
        for name, p in model.model.language_model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.03)
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.5)
    model.save_pretrained(path)
    Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 32, "width": 32}), tokenizer=tok,
                    image_seq_length=GEMMA3_TOKENS_PER_IMAGE).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory) -> str:
    return build_tiny_gemma3(tmp_path_factory.mktemp("tiny_gemma3"))


@pytest.fixture(scope="session")
def gemma3_hf(tiny_gemma3):
    """(HF model float32, HF Gemma3Processor) of the tiny Gemma 3."""
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(tiny_gemma3, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(tiny_gemma3)


IDEFICS3_TOKENS_PER_TILE = 16


def build_tiny_idefics3(path) -> str:
    """A tiny random SmolVLM / Idefics3 saved under `path`: SigLIP-like tower over 32x32 tiles (patch 4: 64 patches,
    pixel shuffle 2 -> 16 tokens a tile), a 2-layer Llama decoder; images resized to a longest edge of 64 and split
    into up to 2x2 tiles plus a global one (HF's Idefics3Processor, SmolLM2's tokenizer with the image tokens)."""
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor,
                              Idefics3VisionConfig, LlamaConfig)
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from pagemill.benchmarks.model_path import load_hf_tokenizer

    # a copy: the loader's tokenizer is cached per process, and the special tokens added here must not reach
    # the next fixture's model (its vocabulary, hence its random weights, would depend on the tests' order)
    tok = copy.deepcopy(load_hf_tokenizer(default_model_path()))
    tok.add_special_tokens({"additional_special_tokens": [
        "<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
        *(f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6))]})
    torch.manual_seed(0)
    vision = Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  image_size=32, patch_size=4, initializer_range=0.2)
    text = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                       initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                       pad_token_id=2)
    config = Idefics3Config(vision_config=vision, text_config=text, scale_factor=2,
                            image_token_id=tok.convert_tokens_to_ids("<image>"), tie_word_embeddings=False)
    model = Idefics3ForConditionalGeneration(config)
    with torch.no_grad():  # random images must move the logits
        model.model.connector.modality_projection.proj.weight.normal_(0, 0.5)
    model.save_pretrained(path)
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32},
                                                do_image_splitting=True)
    Idefics3Processor(image_processor=image_processor, tokenizer=tok,
                      image_seq_len=IDEFICS3_TOKENS_PER_TILE).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_idefics3(tmp_path_factory) -> str:
    return build_tiny_idefics3(tmp_path_factory.mktemp("tiny_idefics3"))


@pytest.fixture(scope="session")
def idefics3_hf(tiny_idefics3):
    """(HF model float32, HF Idefics3Processor) of the tiny Idefics3."""
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    model = Idefics3ForConditionalGeneration.from_pretrained(tiny_idefics3, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(tiny_idefics3)
