"""`--lora-modules` (vLLM's `name=path` and JSON forms), its start-up checks, and the runtime-update switch."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Either variable allows POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM reads the second).
RUNTIME_UPDATE_ENV_VARS = ("PAGEMILL_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")


@dataclass(frozen=True)
class LoRAModulePath:
    """An adapter to serve from start-up: the name clients put in `model`, its PEFT directory, and the served base
    model it belongs to (None: the first served name)."""

    name: str
    path: str
    base_model_name: str | None = None


def runtime_lora_updating_allowed(environ: Mapping[str, str] | None = None) -> bool:
    """True when PAGEMILL_ or VLLM_ALLOW_RUNTIME_LORA_UPDATING is 1 or true (any case)."""
    env = os.environ if environ is None else environ
    return any(env.get(var, "").strip().lower() in ("1", "true") for var in RUNTIME_UPDATE_ENV_VARS)


def _from_json(value: Any, item: str) -> LoRAModulePath:
    if not isinstance(value, dict):
        raise ValueError(f"--lora-modules: {item!r}: a JSON entry must be an object with name and path.")
    unknown = set(value) - {"name", "path", "base_model_name"}
    if unknown:
        raise ValueError(f"--lora-modules: {item!r}: unknown field(s) {', '.join(sorted(unknown))} "
                         "(expected name, path, base_model_name).")
    for key in ("name", "path"):
        if not isinstance(value.get(key), str) or not value[key]:
            raise ValueError(f"--lora-modules: {item!r}: {key} must be a non-empty string.")
    base = value.get("base_model_name")
    if base is not None and not isinstance(base, str):
        raise ValueError(f"--lora-modules: {item!r}: base_model_name must be a string.")
    return LoRAModulePath(value["name"], value["path"], base)


def parse_lora_module(item: str) -> list[LoRAModulePath]:
    """The adapters of one --lora-modules value: `name=path`, a JSON object `{"name", "path", "base_model_name"}`,
    or a JSON list of such objects; raises ValueError naming the bad value."""
    text = item.strip()
    if text.startswith(("{", "[")):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules: {item!r} is not valid JSON: {e}.") from None
        return [_from_json(v, item) for v in (value if isinstance(value, list) else [value])]
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules: {item!r} must be name=path or a JSON object with name and path.")
    return [LoRAModulePath(name, path)]


class LoRAModulesAction(argparse.Action):
    """Parses each --lora-modules value into LoRAModulePath entries, appended across repeated flags."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        modules = list(getattr(namespace, self.dest, None) or [])
        for item in [values] if isinstance(values, str) else list(values or []):
            try:
                modules.extend(parse_lora_module(item))
            except ValueError as e:
                parser.error(str(e))
        setattr(namespace, self.dest, modules)


def check_lora_modules(modules: list[LoRAModulePath], served_names: list[str], enable_lora: bool) -> None:
    """Start-up checks before the model loads: LoRA enabled, names unique and distinct from the served names, known
    base models; raises ValueError."""
    if not modules:
        return
    if not enable_lora:
        raise ValueError("--lora-modules needs --enable-lora (the engine serves no adapters without it).")
    seen: set[str] = set()
    for m in modules:
        if m.name in served_names:
            raise ValueError(f"--lora-modules: adapter name {m.name!r} is also a served model name.")
        if m.name in seen:
            raise ValueError(f"--lora-modules: adapter name {m.name!r} is given twice.")
        seen.add(m.name)
        if m.base_model_name is not None and m.base_model_name not in served_names:
            raise ValueError(f"--lora-modules: base_model_name {m.base_model_name!r} of adapter {m.name!r} is not a "
                             f"served model name ({', '.join(served_names)}).")
