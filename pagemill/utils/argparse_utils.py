"""FlexibleArgumentParser: vLLM's argparse parser, which takes `--max_num_seqs` as well as `--max-num-seqs`; and
flags whose value is a JSON object (`--speculative-config '{"method": "ngram"}'`), checked when parsed."""

from __future__ import annotations

import argparse
import difflib
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

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        """Parse; an unknown flag exits with an error that suggests the closest valid flag."""
        args = sys.argv[1:] if args is None else list(args)
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            spelled = {_dashed(a): a for a in args}  # name the flag as the user wrote it
            self.error(unknown_flags_message([spelled.get(e, e) for e in extras], self._flags_in_use(parsed)))
        return parsed

    def _flags_in_use(self, parsed: argparse.Namespace) -> list[str]:
        """The long flags of this parser and of the sub-command that was chosen."""
        flags = [f for f in self._option_string_actions if f.startswith("--")]
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(parsed, action.dest, None) or "")
                if chosen is not None:
                    flags += [f for f in chosen._option_string_actions if f.startswith("--")]
        return flags


def unknown_flags_message(extras: Sequence[str], flags: Sequence[str]) -> str:
    """'unrecognized arguments: ...', with the closest valid flag of each unknown one."""
    message = "unrecognized arguments: " + " ".join(extras)
    hints = []
    for arg in extras:
        if isinstance(arg, str) and arg.startswith("--"):
            flag = arg.partition("=")[0]
            close = difflib.get_close_matches(_dashed(flag), flags, n=1, cutoff=0.6)
            if close:
                hints.append(f"{flag}: did you mean {close[0]}?")
    return message + ("" if not hints else " (" + "; ".join(hints) + ")")


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
