"""FlexibleArgumentParser: vLLM's argparse parser, which takes `--max_num_seqs` as well as `--max-num-seqs`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
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
