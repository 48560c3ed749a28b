"""LoRA fixtures: random PEFT adapters (B != 0) made with the `peft` package, and HF + PEFT greedy references."""

from __future__ import annotations

import os

import pytest
import torch

# Per family, the HF module names PEFT adapts (Phi-3's attention and MLP projections are fused in HF too).
TARGETS = {
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
}
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_path: str, out_dir: str, seed: int, rank: int = 8, targets: list[str] | None = None,
                 use_rslora: bool = False, alpha: int | None = None, std: float = 0.5) -> str:
    """Save a random LoRA adapter of the model at `base_path` (A and B both random, so it changes the output)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=targets or ALL_TARGETS,
                        init_lora_weights=False, use_rslora=use_rslora)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=std)
    peft_model.save_pretrained(out_dir)
    return out_dir


def hf_peft_greedy(base_path: str, adapter: str | None, prompt_ids: list[int], max_new_tokens: int,
                   **from_pretrained) -> list[int]:
    """HF transformers (+ PEFT when `adapter`) greedy continuation of one prompt in float32."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32, **from_pretrained)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="session")
def llama_adapters(tiny_models, tmp_path_factory) -> list[str]:
    """Three adapters of the tiny Llama: all targets rank 8; q/v rank 4 with rsLoRA; o/up/down rank 16."""
    root = tmp_path_factory.mktemp("llama_lora")
    base = tiny_models["llama"]
    return [make_adapter(base, os.path.join(root, "all8"), 1, 8),
            make_adapter(base, os.path.join(root, "qv4"), 2, 4, ["q_proj", "v_proj"], use_rslora=True, alpha=7),
            make_adapter(base, os.path.join(root, "oud16"), 3, 16, ["o_proj", "up_proj", "down_proj"])]
