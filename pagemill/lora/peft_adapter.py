"""Read a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) into per-module A/B pairs."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

from pagemill.lora.request import LoRARequest

_TENSOR_NAME = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.default)?\.weight$")
# What the engine cannot apply: an adapter that needs one of these is refused, not silently approximated.
_UNSUPPORTED = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out weights", "lora_bias": "LoRA biases",
                "use_qalora": "QA-LoRA"}


@dataclass
class LoRAModuleWeights:
    """One adapted module: A [r, in], B [out, r] and the scaling of B A (alpha / r, or alpha / sqrt(r) with rsLoRA)."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        """This module's rank."""
        return self.a.shape[0]


@dataclass
class LoRAAdapter:
    """A loaded adapter: its request (name, id, path) and weights keyed by checkpoint module path
    (e.g. "model.layers.0.self_attn.q_proj")."""

    request: LoRARequest
    modules: dict[str, LoRAModuleWeights]

    @property
    def rank(self) -> int:
        """The largest module rank."""
        return max(m.rank for m in self.modules.values())


def _pattern_value(patterns: dict, module: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the module name's tail."""
    for key, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default


def read_adapter_config(path: str, max_lora_rank: int) -> dict:
    """The adapter's config, checked: a PEFT LoRA adapter the engine can apply, of rank <= max_lora_rank."""
    if not path or not os.path.isdir(path):
        raise ValueError(f"lora_path: {path!r} is not a directory (a PEFT adapter directory is expected).")
    config_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"lora_path: {path!r} has no adapter_config.json.")
    try:
        with open(config_file) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"lora_path: adapter_config.json is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError("lora_path: adapter_config.json must hold a JSON object.")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"lora_path: peft_type {config.get('peft_type')!r} is not LORA.")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise ValueError(f"lora_path: the adapter uses {what} ({key}), which is not supported.")
    if config.get("bias", "none") != "none":
        raise ValueError(f"lora_path: the adapter trains biases (bias={config['bias']!r}), which is not supported.")
    if config.get("modules_to_save"):
        raise ValueError(f"lora_path: the adapter saves whole modules ({config['modules_to_save']}), which is not "
                         "supported.")
    ranks = [config.get("r", 8), *(config.get("rank_pattern") or {}).values()]
    if any(not isinstance(r, int) or r < 1 for r in ranks):
        raise ValueError(f"lora_path: adapter rank must be a positive integer, got {ranks}.")
    if max(ranks) > max_lora_rank:
        raise ValueError(f"lora_path: the adapter's rank {max(ranks)} is larger than max_lora_rank "
                         f"({max_lora_rank}).")
    return config


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(st):
        from safetensors.torch import load_file

        try:
            return load_file(st)
        except Exception as e:  # a truncated or corrupt file: the user's input, not an engine fault
            raise ValueError(f"lora_path: adapter_model.safetensors cannot be read: {e}") from None
    pt = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(pt):
        try:
            return torch.load(pt, map_location="cpu", weights_only=True)
        except Exception as e:
            raise ValueError(f"lora_path: adapter_model.bin cannot be read: {e}") from None
    raise ValueError(f"lora_path: {path!r} has no adapter_model.safetensors (or adapter_model.bin).")


def load_adapter(request: LoRARequest, max_lora_rank: int) -> LoRAAdapter:
    """Read and check the adapter of `request`: every tensor a LoRA A or B, pairs complete, shapes consistent."""
    config = read_adapter_config(request.lora_path, max_lora_rank)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in _read_tensors(request.lora_path).items():
        m = _TENSOR_NAME.match(name)
        if m is None:
            raise ValueError(f"lora_path: tensor {name!r} is not a LoRA A/B weight (embedding and other adapter "
                             "weights are not supported).")
        pairs.setdefault(m["module"], {})[m["which"]] = tensor
    if not pairs:
        raise ValueError("lora_path: the adapter has no LoRA weights.")
    alpha, use_rslora = config.get("lora_alpha", 8), bool(config.get("use_rslora"))
    modules = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"lora_path: module {module!r} has lora_{''.join(ab)} but not both A and B.")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"lora_path: module {module!r} has inconsistent shapes A {list(a.shape)}, "
                             f"B {list(b.shape)}.")
        rank = a.shape[0]
        if rank > max_lora_rank:
            raise ValueError(f"lora_path: module {module!r} has rank {rank}, larger than max_lora_rank "
                             f"({max_lora_rank}).")
        module_alpha = _pattern_value(config.get("alpha_pattern") or {}, module, alpha)
        scaling = module_alpha / (math.sqrt(rank) if use_rslora else rank)
        modules[module] = LoRAModuleWeights(a.float(), b.float(), float(scaling))
    return LoRAAdapter(request, modules)
