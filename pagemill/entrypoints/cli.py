"""The `pagemill` command: `serve`, `generate`, `chat`, `env` and (when installed) `bench`."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from pagemill.entrypoints.openai.cli_args import add_engine_args, add_serve_args, engine_args_from_namespace
from pagemill.utils.argparse_utils import FlexibleArgumentParser


def _add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--temperature", type=float, default=0.0, help="0 means greedy.")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0, help="0 or -1 means off.")
    group.add_argument("--max-tokens", type=int, default=max_tokens)
    group.add_argument("--n", type=int, default=1, help="Outputs per prompt.")


def _sampling_params(args: argparse.Namespace):
    """SamplingParams from the sampling flags (--seed seeds both the engine and the sampler)."""
    from pagemill.sampling_params import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_tokens=args.max_tokens, n=args.n, seed=args.seed)


def _make_llm(args: argparse.Namespace):
    """An offline LLM from the engine flags."""
    from pagemill import LLM

    engine_args = engine_args_from_namespace(args)
    return LLM(**{name: getattr(engine_args, name) for name in engine_args.field_names()})


def _print_outputs(outputs: list) -> None:
    texts = [(i, c.index, c.text) for i, out in enumerate(outputs) for c in out.outputs]
    if len(texts) == 1:
        print(texts[0][2])
        return
    for i, j, text in texts:
        print(f"=== prompt {i}, output {j} ===")
        print(text)


def cmd_generate(args: argparse.Namespace) -> None:
    """Generate offline for prompts given as arguments or in a file (one per line)."""
    prompts = list(args.prompts)
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        raise SystemExit("pagemill generate: give prompts as arguments or with --prompts-file.")
    llm = _make_llm(args)
    _print_outputs(llm.generate(prompts, _sampling_params(args), use_tqdm=False))


def cmd_chat(args: argparse.Namespace) -> None:
    """One-shot chat: print the assistant's reply to one message."""
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": args.message})
    llm = _make_llm(args)
    chat_template = None
    if args.chat_template:
        from pagemill.entrypoints.chat_utils import load_chat_template

        chat_template = load_chat_template(args.chat_template)
    _print_outputs(llm.chat(messages, _sampling_params(args), use_tqdm=False, chat_template=chat_template))


def cmd_serve(args: argparse.Namespace) -> None:
    """Run the OpenAI-compatible server."""
    from pagemill.entrypoints.openai.api_server import run_server

    run_server(args)


def cmd_disagg_proxy(args: argparse.Namespace) -> None:
    """Run the disaggregated prefill proxy."""
    from pagemill.distributed.kv_transfer.disagg_proxy import run_proxy

    run_proxy(args)


def cmd_env(args: argparse.Namespace) -> None:
    """Print the machine, ISA, kernel and library facts (like `vllm collect-env`), or the supported models."""
    if args.models:
        from pagemill.models.registry import format_supported_models

        print(format_supported_models())
        return
    from pagemill.env import main as env_main

    env_main(as_json=args.json)


def build_parser() -> argparse.ArgumentParser:
    """The full `pagemill` argument parser."""
    parser = FlexibleArgumentParser(prog="pagemill", description="pagemill: LLM inference and serving on CPUs.")
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{serve,generate,chat,env,disagg-proxy,bench}")
    fmt = argparse.ArgumentDefaultsHelpFormatter

    serve = sub.add_parser("serve", help="run the OpenAI-compatible server", formatter_class=fmt)
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="generate text for prompts (offline)", formatter_class=fmt)
    gen.add_argument("prompts", nargs="*", help="prompts")
    gen.add_argument("--prompts-file", default=None, help="file with one prompt per line")
    _add_sampling_args(gen, max_tokens=64)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="one-shot chat reply (offline)", formatter_class=fmt)
    chat.add_argument("message", help="the user message")
    chat.add_argument("--system", default=None, help="optional system message")
    chat.add_argument("--chat-template", default=None, help="chat template file (or inline Jinja template)")
    _add_sampling_args(chat, max_tokens=256)
    add_engine_args(chat)
    chat.set_defaults(func=cmd_chat)

    proxy = sub.add_parser("disagg-proxy", help="route requests through prefill then decode instances "
                           "(disaggregated prefill, --kv-transfer-config)", formatter_class=fmt)
    from pagemill.distributed.kv_transfer.disagg_proxy import add_proxy_args

    add_proxy_args(proxy)
    proxy.set_defaults(func=cmd_disagg_proxy)

    env = sub.add_parser("env", help="print the CPU, ISA flags, kernel variant and library versions")
    env.add_argument("--json", action="store_true", help="print JSON instead of text")
    env.add_argument("--models", action="store_true", help="list the supported model families instead")
    env.set_defaults(func=cmd_env)

    try:
        from pagemill.benchmarks.cli import register_bench_subcommands
    except ImportError:
        register_bench_subcommands = None
    if register_bench_subcommands is not None:
        register_bench_subcommands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the `pagemill` console script."""
    args = build_parser().parse_args(argv)
    if args.command in ("generate", "chat"):
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from pagemill.engine.core_client import EngineStartupError

    try:
        args.func(args)
    except (ValueError, EngineStartupError) as e:  # bad arguments: one clear line instead of a traceback
        raise SystemExit(f"pagemill {args.command}: {e}") from None


if __name__ == "__main__":
    main()
