"""`--variant NAME="ENGINE FLAGS"` (repeatable) for `bench throughput` / `bench latency`: the same workload under each
named engine configuration, loaded side by side and timed in ABBA order, with every variant's ratio to the first.

    pagemill bench throughput --dataset-name prefix --num-iters 4 --reset-prefix-cache \\
        --variant cached="--enable-prefix-caching" --variant uncached="--no-enable-prefix-caching"

The flags are `pagemill serve`'s engine flags (the engine arguments reference lists them); they apply on top of the
command's own engine flags. Only public engine arguments can differ between variants.
"""

from __future__ import annotations

import argparse
import shlex
from typing import Any, Sequence

from pagemill.engine.arg_utils import EngineArgs

PREFIX = "variant:"


def _overrides_parser() -> argparse.ArgumentParser:
    """The engine flags, each defaulting to 'not given' (so only the flags a variant names are kept)."""
    parser = argparse.ArgumentParser(prog="--variant", add_help=False, argument_default=argparse.SUPPRESS,
                                     exit_on_error=False)
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--served-model-name", dest="served_model_name", default=argparse.SUPPRESS)
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return parser


def parse_variant(item: str) -> tuple[str, dict[str, Any]]:
    """`NAME=FLAGS` -> (NAME, the LLM(...) keywords the flags set); a ValueError names what is wrong."""
    name, sep, flags = item.partition("=")
    name = name.strip()
    if not sep or not name:
        raise ValueError(f'--variant expects NAME="ENGINE FLAGS", got {item!r}')
    try:
        namespace, rest = _overrides_parser().parse_known_args(shlex.split(flags))
    except argparse.ArgumentError as e:
        raise ValueError(f"--variant {name}: {e}") from None
    if rest:
        raise ValueError(f"--variant {name}: not engine flags: {' '.join(rest)}")
    return name, vars(namespace)


def parse_variants(items: Sequence[str] | None) -> dict[str, dict[str, Any]]:
    """Every `--variant`, in the order given (names must differ)."""
    variants: dict[str, dict[str, Any]] = {}
    for item in items or ():
        name, kwargs = parse_variant(item)
        if name in variants:
            raise ValueError(f"--variant {name} is given twice")
        variants[name] = kwargs
    return variants


def variant_backend_names(args: argparse.Namespace) -> list[str]:
    """Backend names of the variants (`variant:NAME`), in the order given."""
    return [PREFIX + name for name in parse_variants(getattr(args, "variant", None))]


def variant_kwargs(args: argparse.Namespace, backend_name: str) -> dict[str, Any]:
    """The engine keywords of backend `variant:NAME`."""
    return parse_variants(args.variant)[backend_name.removeprefix(PREFIX)]


def variant_label(args: argparse.Namespace, backend_name: str) -> str:
    """`NAME: FLAGS` as given on the command line."""
    name = backend_name.removeprefix(PREFIX)
    for item in args.variant:
        given, _, flags = item.partition("=")
        if given.strip() == name:
            return f"pagemill variant {name}: {flags.strip() or '(the command flags only)'}"
    return backend_name


def ratio_lines(results: dict[str, dict[str, Any]], metric: str, higher_is_better: bool, what: str) -> list[str]:
    """One line per backend after the first: its `metric` over the first's (> 1: faster than the first)."""
    names = list(results)
    if len(names) < 2:
        return []
    first = results[names[0]][metric]
    lines = []
    for name in names[1:]:
        value = results[name][metric]
        ratio = (value / first) if higher_is_better else (first / value)
        lines.append(f"{name} vs {names[0]}: {ratio:.3f}x {what} ({value:.4g} vs {first:.4g})")
    return lines


def add_variant_args(parser: argparse.ArgumentParser) -> None:
    """The repeatable `--variant` flag."""
    parser.add_argument("--variant", action="append", default=None, metavar='NAME="ENGINE FLAGS"',
                        help="run the workload under this named engine configuration too (repeatable; "
                             "e.g. fp16=\"--linear-dtype float16 --kv-cache-dtype float16\"); all variants are "
                             "loaded up front and timed in ABBA order, and each one's ratio to the first is printed")
    parser.add_argument("--reset-prefix-cache", action="store_true",
                        help="empty pagemill's prefix cache before every run, so that a run reuses only the "
                             "prefixes its own requests share (not the previous run's prompts)")
