"""The generated reference pages of the docs site: the engine arguments and the `pagemill` command line.

Both are rendered from the objects `--help` is built from (EngineArgs' fields and their help metadata, and the
argparse parser of `pagemill`), by the MkDocs hook docs/hooks/reference.py at every build, so they cannot drift
from the code.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

from pagemill.engine.arg_utils import EngineArgs

ENGINE_GROUP = "engine"


def _md(text: object) -> str:
    """Text for a Markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def _type_name(tp: object) -> str:
    return str(tp).replace("typing.", "") if not isinstance(tp, type) else tp.__name__


def _default(value: object) -> str:
    return "`None`" if value is None else f"`{value!r}`"


def _engine_flags() -> dict[str, list[str]]:
    """EngineArgs field -> its command-line flags, read from a parser built by add_cli_args."""
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser(add_help=False))
    flags = {action.dest: list(action.option_strings) for action in parser._actions}
    flags["served_model_name"] = ["--served-model-name"]  # declared by `pagemill serve` itself (several names)
    return flags


def engine_args_markdown() -> str:
    """docs/reference/engine_args.md: one row per EngineArgs field (its flags, type, default and help)."""
    hints = typing.get_type_hints(EngineArgs)
    helps = EngineArgs.arg_help()
    flags = _engine_flags()
    lines = [
        "# Engine arguments",
        "",
        "<!-- Generated from pagemill/engine/arg_utils.py (EngineArgs: each field's metadata help) at every docs "
        "build (docs/hooks/reference.py); edit the help there. -->",
        "",
        "The keyword arguments of `LLM(...)`, `EngineArgs(...)` and `AsyncLLM`, and the engine flags of `pagemill serve`, "
        "`generate`, `chat` and `bench`. Names follow vLLM's. Boolean flags also have a `--no-` form.",
        "",
        "| argument | flag | type | default | description |",
        "|---|---|---|---|---|",
    ]
    for f in dataclasses.fields(EngineArgs):
        default = f.default if f.default is not dataclasses.MISSING else None
        flag = ", ".join(f"`{x}`" for x in flags.get(f.name, []))
        lines.append(f"| `{f.name}` | {flag} | `{_md(_type_name(hints[f.name]))}` | {_md(_default(default))} | "
                     f"{_md(helps[f.name])} |")
    return "\n".join(lines) + "\n"


def _subcommands(parser: argparse.ArgumentParser, prefix: str) -> list[tuple[str, argparse.ArgumentParser]]:
    """(full command, parser) for a parser and every sub-command under it, depth first."""
    out = [(prefix, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += _subcommands(sub, f"{prefix} {name}")
    return out


def _flag_row(action: argparse.Action) -> str:
    names = ", ".join(f"`{x}`" for x in action.option_strings) or f"`{action.metavar or action.dest}`"
    if isinstance(action, argparse.BooleanOptionalAction):
        names = ", ".join(f"`{x}`" for x in action.option_strings)
    default = "" if action.default in (None, argparse.SUPPRESS) or action.required else _default(action.default)
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        choices = " Choices: " + ", ".join(f"`{c}`" for c in action.choices) + "."
    else:
        choices = ""
    return f"| {names} | {_md(default)} | {_md((action.help or '') + choices)} |"


def cli_markdown() -> str:
    """docs/reference/cli.md: every `pagemill` command with its flags, from the parser `pagemill --help` prints."""
    from pagemill.entrypoints.cli import build_parser

    lines = [
        "# Command line",
        "",
        "<!-- Generated from pagemill's argparse parser (pagemill/entrypoints/cli.py) at every docs build "
        "(docs/hooks/reference.py). -->",
        "",
        "Every command's `--help` shows the same. Commands that load a model also take the engine flags, listed once "
        "on the [engine arguments](engine_args.md) page.",
        "",
    ]
    for command, parser in _subcommands(build_parser(), "pagemill"):
        if command == "pagemill":
            continue
        lines += [f"## `{command}`", ""]
        if parser.description:
            lines += [parser.description, ""]
        engine = False
        for group in parser._action_groups:
            actions = [a for a in group._group_actions
                       if a.help != argparse.SUPPRESS and not isinstance(a, (argparse._HelpAction,
                                                                            argparse._SubParsersAction))]
            if group.title == ENGINE_GROUP:
                engine = bool(actions)
                continue
            if not actions:
                continue
            lines += [f"**{group.title}**", "", "| flag | default | description |", "|---|---|---|"]
            lines += [_flag_row(a) for a in actions]
            lines.append("")
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        for action in subs:
            lines += ["| sub-command | description |", "|---|---|"]
            lines += [f"| `{command} {c.dest}` | {_md(c.help or '')} |" for c in action._choices_actions]
            lines.append("")
        if engine:
            lines += ["Engine flags: all of [engine arguments](engine_args.md).", ""]
    return "\n".join(lines).rstrip() + "\n"


# Public classes beyond `pagemill.__all__` that users build directly.
EXTRA_API = ("pagemill.engine.async_llm.AsyncLLM",)


def api_markdown() -> str:
    """docs/reference/api.md: every name `pagemill` exports (its `__all__`), rendered from its docstrings by
    mkdocstrings, under the module that defines it."""
    import pagemill

    lines = [
        "# Python API",
        "",
        "<!-- Generated from pagemill.__all__ at every docs build (docs/hooks/reference.py). -->",
        "",
        "Everything `import pagemill` exports, with vLLM's names (`from pagemill import LLM, SamplingParams`).",
        "",
    ]
    paths, aliases = [], []
    for name in pagemill.__all__:
        obj = getattr(pagemill, name)
        if isinstance(obj, str):  # __version__
            continue
        path = f"{obj.__module__}.{obj.__qualname__}"
        if obj.__qualname__ != name:  # another name of an exported class (vLLM's older spelling)
            aliases.append(f"- `pagemill.{name}` is `{path}`.")
        elif path not in paths:
            paths.append(path)
    if aliases:
        lines += ["Other names:", "", *aliases, ""]
    for path in [*paths, *EXTRA_API]:
        lines += [f"::: {path}", "    options:", "      heading_level: 2", ""]
    return "\n".join(lines)
