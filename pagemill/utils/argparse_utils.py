"""FlexibleArgumentParser: vLLM's argparse parser, which takes `--max_num_seqs` as well as `--max-num-seqs`; and
flags whose value is a JSON object (`--speculative-config '{"method": "ngram"}'`), checked when parsed."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose long options may be spelled with underscores (`--max_model_len=512`)."""

    def parse_known_args(self, args: Sequence[str] | None = None,
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        """Parse with each `--long_option` (up to an `=`) rewritten to `--long-option`."""
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args([_dashed(a) for a in args], namespace)


def _dashed(arg: Any) -> Any:
    if not isinstance(arg, str) or not arg.startswith("--") or arg == "--":
        return arg
    flag, eq, value = arg.partition("=")
    return flag.replace("_", "-") + eq + value


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
