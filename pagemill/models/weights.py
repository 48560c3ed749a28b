"""Loading checkpoint tensors (HF names) into a model whose layers own their weight loaders."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from pagemill.layers.quantization.base import copy_into


def load_checkpoint_weights(model: nn.Module, weights: Iterable[tuple[str, Any]],
                            packed_modules_mapping: dict[str, tuple[str, Any]],
                            targets: Callable[[str], list[str]] = lambda name: [name]) -> None:
    """Route every checkpoint tensor to its module's `load_weight(param, tensor, shard_id)` (or copy it into the
    parameter), check that nothing the model needs is missing, then let each module prepare its weights.

    `packed_modules_mapping`: checkpoint module name -> (fused module name, shard id), e.g. q_proj -> (qkv_proj,
    "q"). `targets`: the model names a checkpoint name loads into ([] to skip it; two for a tied embedding).
    A tensor is a torch.Tensor or a lazy checkpoint weight (`shape`, `load_into`, ...: GGUF).
    """
    modules = dict(model.named_modules())
    loaded: set[tuple[str, str, Any]] = set()
    for name, tensor in weights:
        for target in targets(name):
            module_name, _, param = target.rpartition(".")
            parent, _, leaf = module_name.rpartition(".")
            shard = None
            if leaf in packed_modules_mapping and module_name not in modules:  # (a vision tower's q_proj: unfused)
                packed, shard = packed_modules_mapping[leaf]
                module_name = f"{parent}.{packed}" if parent else packed
            module = modules.get(module_name)
            if module is None or (not hasattr(module, "load_weight") and param not in module._parameters):
                raise ValueError(f"weight {name!r} does not fit the {type(model).__name__} model.")
            try:
                filled = None  # a loader may fill several shards from one tensor (it returns their ids)
                if hasattr(module, "load_weight"):
                    filled = module.load_weight(param, tensor, shard)
                else:
                    copy_into(module._parameters[param], tensor)
            except ValueError as e:
                raise ValueError(f"weight {name!r}: {e}") from e
            loaded |= {(module_name, param, s) for s in (filled or [shard])}
    missing = sorted(f"{m}.{p}" + (f" ({s})" if s is not None else "")
                     for m, p, s in _expected(modules) - loaded)
    if missing:
        raise ValueError(f"weights missing from the checkpoint: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    process_weights_after_loading(model)


def process_weights_after_loading(model: nn.Module) -> None:
    """Every layer turns its loaded weights into the form it computes with (prepacked copies, GEMV records)."""
    for module in model.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()


def _expected(modules: dict[str, nn.Module]) -> set[tuple[str, str, Any]]:
    """(module, param, shard) the checkpoint must provide: a layer's declared weights, else its own parameters."""
    out = set()
    for name, module in modules.items():
        if hasattr(module, "expected_weights"):
            out |= {(name, p, s) for p, s in module.expected_weights()}
        else:
            out |= {(name, p, None) for p, v in module._parameters.items() if v is not None}
    return out
