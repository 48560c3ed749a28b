"""Flags whose value is a JSON object (`--speculative-config '{"method": "ngram"}'`), checked when parsed."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from pagemill.config import SpeculativeConfig
from pagemill.distributed.kv_transfer.kv_transfer_config import KVTransferConfig

# Config-object fields of EngineArgs and the check that builds their config (a ValueError names the field).
JSON_FIELD_VALIDATORS: dict[str, Callable[[dict[str, Any]], object]] = {
    "speculative_config": SpeculativeConfig.from_user,
    "kv_transfer_config": KVTransferConfig.from_user,
}


def json_dict_flag(name: str, validate: Callable[[dict[str, Any]], object] | None = None
                   ) -> Callable[[str], dict[str, Any]]:
    """An argparse `type` parsing a JSON object; bad JSON, a non-object or a failed `validate` give an error
    naming `name`."""

    def parse(text: str) -> dict[str, Any]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"{name} is not valid JSON ({e}): {text!r}") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"{name} must be a JSON object, got {text!r}")
        if validate is not None:
            try:
                validate(value)
            except (ValueError, TypeError) as e:
                raise argparse.ArgumentTypeError(str(e) if name in str(e) else f"{name}: {e}") from None
        return value

    parse.__name__ = name  # argparse names the type in some messages
    return parse


def config_flag(name: str) -> Callable[[str], dict[str, Any]]:
    """The argparse `type` of the EngineArgs field `name` (e.g. speculative_config), with its validation."""
    return json_dict_flag(name, JSON_FIELD_VALIDATORS.get(name))
