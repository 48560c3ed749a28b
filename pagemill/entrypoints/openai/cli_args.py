"""Command-line flags of `pagemill serve`: the server's own (vllm names) plus the engine flags (engine/arg_utils.py)."""

from __future__ import annotations

import argparse
import os

from pagemill.engine.arg_utils import EngineArgs, add_engine_args
from pagemill.entrypoints.chat_utils import BUILTIN_TEMPLATES
from pagemill.entrypoints.openai.cors import add_cors_args
from pagemill.entrypoints.openai.lora_modules import LoRAModulesAction
from pagemill.entrypoints.openai.server_limits import add_limit_args
from pagemill.entrypoints.openai.tool_parsers import tool_parser_names
from pagemill.loader.default_model import DEFAULT_MODEL_NAME

def engine_args_from_namespace(args: argparse.Namespace) -> EngineArgs:
    """EngineArgs from parsed flags (a positional MODEL wins over --model)."""
    values = {name: getattr(args, name) for name in EngineArgs.field_names() if hasattr(args, name)}
    if getattr(args, "model_tag", None):
        values["model"] = args.model_tag
    names = getattr(args, "served_model_name", None)
    values["served_model_name"] = names[0] if isinstance(names, list) else names
    return EngineArgs(**values)


def served_model_names(args: argparse.Namespace) -> list[str]:
    """--served-model-name, else SmolLM2-135M-Instruct for the default model, else the model path's basename."""
    if args.served_model_name:
        return list(args.served_model_name)
    model = getattr(args, "model_tag", None) or args.model
    if model is None:
        return [DEFAULT_MODEL_NAME]
    return [os.path.basename(os.path.normpath(model))]


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `pagemill serve` (named like `vllm serve`'s)."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help=EngineArgs.arg_help()["model"] + " Same as --model.")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="Address to listen on (0.0.0.0 for all interfaces).")
    server.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    server.add_argument("--api-key", nargs="+", default=None,
                        help="Require 'Authorization: Bearer KEY' with one of these keys.")
    server.add_argument("--served-model-name", nargs="+", default=None,
                        help="Model name(s) clients use in the `model` field (the first is reported).")
    server.add_argument("--chat-template", default=None,
                        help="Chat template file, inline Jinja template, or a shipped template's name: "
                             f"{', '.join(BUILTIN_TEMPLATES)} (ChatML with a tools branch, for SmolLM2).")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='Allow tool_choice="auto": the model decides, --tool-call-parser reads its calls.')
    server.add_argument("--tool-call-parser", default=None, choices=tool_parser_names(),
                        help="How to find tool calls in the model's text (for tool_choice=\"auto\").")
    server.add_argument("--lora-modules", nargs="+", action=LoRAModulesAction, default=None, metavar="NAME=PATH",
                        help="LoRA adapters served from start-up (needs --enable-lora): name=path or JSON "
                             "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; clients select one by "
                             "its name in `model`.")
    server.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                        help="Serve GET /tokenizer_info (the tokenizer's configuration and chat template, as vLLM).")
    server.add_argument("--serve-tokenizer-files", action=argparse.BooleanOptionalAction, default=True,
                        help="Serve the tokenizer's files (tokenizer.json, tokenizer_config.json, chat_template.jinja; "
                             "nothing else) by the Hugging Face Hub's protocol under the served model names, so that "
                             "clients load it with HF_ENDPOINT=http://HOST:PORT.")
    server.add_argument("--enable-force-include-usage", action="store_true",
                        help="Send usage at the end of every stream, even without stream_options.include_usage.")
    add_limit_args(server)
    add_cors_args(server)
    server.add_argument("--uvicorn-log-level", default="info",
                        choices=["debug", "info", "warning", "error", "critical", "trace"])
    server.add_argument("--disable-uvicorn-access-log", action="store_true", help="Do not log every request.")
    add_engine_args(parser)
    parser.set_defaults(disable_log_stats=False)  # a server logs its stats line unless told not to
