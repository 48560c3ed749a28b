"""A transformers model config as plain JSON-able data, read back without importing transformers.

The engine only reads a config's attributes; transformers' configuration classes cost ~1.2 s to import (their
validators pull in most of transformers and `torch.distributed.tensor`). A `ConfigSnapshot` holds the attributes of
one config instance, so a saved config (`pagemill.loader.metadata_cache`) is read back with `json` alone.
"""

from __future__ import annotations

from typing import Any

import torch

FORMAT = 3  # of encode's output: part of the config cache's key
# transformers' PreTrainedConfig properties that only rename an attribute (num_labels is computed below)
_PROPERTY_ALIASES = {"rope_scaling": "rope_parameters", "torch_dtype": "dtype", "use_return_dict": "return_dict",
                     "name_or_path": "_name_or_path", "output_attentions": "_output_attentions"}


class UnsavableConfig(ValueError):
    """A config attribute has a type a snapshot cannot store: the caller keeps the transformers object."""


class ConfigSnapshot:
    """A transformers config's attributes, read as on the original (aliases included), without its class.

    `to_transformers()` rebuilds the original class (importing transformers) for code that needs its methods.
    """

    def __init__(self, attributes: dict[str, Any], aliases: dict[str, str], config_class: str,
                 source: dict[str, Any]) -> None:
        self.__dict__.update(attributes)
        self.__dict__["_snapshot"] = {"aliases": aliases, "config_class": config_class, "source": source}

    def __getattr__(self, name: str) -> Any:
        # only called for names not in __dict__: the class's attribute_map and PreTrainedConfig's renaming properties
        snapshot = self.__dict__.get("_snapshot")
        if snapshot is not None:
            target = snapshot["aliases"].get(name) or _PROPERTY_ALIASES.get(name)
            if target is not None and target in self.__dict__:
                return self.__dict__[target]
            if name == "num_labels" and "id2label" in self.__dict__:
                return len(self.__dict__["id2label"])
        raise AttributeError(f"{type(self).__name__} of {snapshot and snapshot['config_class']!r} has no "
                             f"attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        name = self.__dict__["_snapshot"]["aliases"].get(name, name)
        self.__dict__[name] = value

    def __repr__(self) -> str:
        return f"ConfigSnapshot({self._snapshot['config_class']}, model_type={self.__dict__.get('model_type')!r})"

    @property
    def config_class_name(self) -> str:
        """The name of the transformers class the snapshot was taken from (e.g. "LlamaConfig")."""
        return self._snapshot["config_class"]

    def get_text_config(self, decoder: bool | None = None, encoder: bool | None = None) -> Any:
        """The text sub-config (text_config / decoder / generator), else the config itself, as transformers does."""
        for name in ("text_config", "decoder", "generator"):
            sub = self.__dict__.get(name)
            if isinstance(sub, ConfigSnapshot):
                return sub
        return self

    def to_dict(self) -> dict[str, Any]:
        """The original's `to_dict()`, as saved."""
        return _decode(self._snapshot["source"])

    def to_transformers(self) -> Any:
        """The transformers config this snapshot was taken from, rebuilt from its `to_dict()` (imports transformers)."""
        from transformers import CONFIG_MAPPING

        return CONFIG_MAPPING[self.__dict__["model_type"]].from_dict(self.to_dict())

    @staticmethod
    def of(config: Any) -> ConfigSnapshot:
        """The snapshot of a transformers config (raises UnsavableConfig for attribute types JSON cannot hold)."""
        return ConfigSnapshot.decode(ConfigSnapshot.encode(config))

    @staticmethod
    def encode(config: Any) -> dict[str, Any]:
        """The JSON-able form of a transformers config: its attributes, its class's aliases, its to_dict()."""
        attributes = {"model_type": getattr(type(config), "model_type", None)}  # a class attribute unless loaded
        attributes.update({k: _encode(v) for k, v in vars(config).items()})
        return {"attributes": attributes,
                "aliases": dict(getattr(type(config), "attribute_map", {}) or {}),
                "config_class": type(config).__name__,
                "source": _encode(config.to_dict())}

    @staticmethod
    def decode(data: dict[str, Any]) -> ConfigSnapshot:
        """The snapshot of `encode`'s output."""
        return ConfigSnapshot({k: _decode(v) for k, v in data["attributes"].items()}, data["aliases"],
                              data["config_class"], data["source"])  # source: decoded by to_dict


def as_transformers_config(config: Any) -> Any:
    """`config` itself if it is a transformers config, else the one its snapshot was taken from."""
    return config.to_transformers() if isinstance(config, ConfigSnapshot) else config


def config_class_name(config: Any) -> str:
    """The name of a config's transformers class, for a snapshot too."""
    return config.config_class_name if isinstance(config, ConfigSnapshot) else type(config).__name__


def _encode(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v) for v in value]}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not any(k.startswith("__") for k in value):
            return {k: _encode(v) for k, v in value.items()}
        if all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in value):
            return {"__items__": [[k, _encode(v)] for k, v in value.items()]}
    elif hasattr(value, "to_json_string") and hasattr(value, "model_type"):  # a sub-config (text / vision)
        return {"__config__": ConfigSnapshot.encode(value)}
    raise UnsavableConfig(f"cannot save a config value of type {type(value).__name__}: {value!r:.80}")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__dtype__" in value:
        return getattr(torch, value["__dtype__"])
    if "__tuple__" in value:
        return tuple(_decode(v) for v in value["__tuple__"])
    if "__items__" in value:
        return {k: _decode(v) for k, v in value["__items__"]}
    if "__config__" in value:
        return ConfigSnapshot.decode(value["__config__"])
    return {k: _decode(v) for k, v in value.items()}
