"""The engine under test: pagemill's offline `LLM` (vLLM API), fed token ids directly (text and images for an image
dataset)."""

from __future__ import annotations

import argparse
import ast
import gc
from typing import Any, Sequence

from pagemill.engine.arg_utils import config_flag


def parse_engine_args(items: Sequence[str] | None) -> dict[str, Any]:
    """Parse repeated `--engine-arg KEY=VALUE` (VALUE as a Python literal when it parses)."""
    kwargs: dict[str, Any] = {}
    for item in items or ():
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine-arg expects KEY=VALUE, got {item!r}")
        try:
            kwargs[key.replace("-", "_")] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            kwargs[key.replace("-", "_")] = raw
    return kwargs


def engine_kwargs(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """Keyword arguments for `LLM(...)`: the model plus every engine flag that was given."""
    kwargs: dict[str, Any] = {"model": model}
    for name in ("dtype", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size",
                 "kv_cache_memory", "enable_prefix_caching", "speculative_config"):
        value = getattr(args, name, None)
        if value is not None:
            kwargs[name] = value
    kwargs.update(parse_engine_args(getattr(args, "engine_arg", None)))
    return kwargs


class PagemillBackend:
    """Runs requests with `LLM.generate`, greedy, ignore_eos, exact output lengths."""

    name = "pagemill"

    def __init__(self, kwargs: dict[str, Any]) -> None:
        from pagemill import LLM
        from pagemill.layers.quantization.records_cache import wait_for_writes

        self.kwargs = kwargs
        self.llm = LLM(**kwargs)
        wait_for_writes()  # a first start's records cache is written before anything is timed
        self.reset_prefix_cache = False  # --reset-prefix-cache: each run finds only what it shares within itself

    def generate(self, prompts: Sequence[Sequence[int] | tuple[str, Sequence[Any]]], output_lens: Sequence[int],
                 use_tqdm: bool = False) -> list[list[int]]:
        """Output token ids per request, in input order; a prompt is token ids or (text, images)."""
        from pagemill import SamplingParams

        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
        if self.reset_prefix_cache:
            self.llm.reset_prefix_cache()
        outputs = self.llm.generate([self._engine_prompt(p) for p in prompts], params, use_tqdm=use_tqdm)
        self.last_prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)  # placeholders included
        return [list(o.outputs[0].token_ids) for o in outputs]

    def _engine_prompt(self, prompt: Sequence[int] | tuple[str, Sequence[Any]]) -> dict[str, Any]:
        """Token ids as they are; (text, images): one image placeholder per image (as a chat part would
        write it: Qwen2-VL's wrapped in vision start / end) before the text."""
        if not (isinstance(prompt, tuple) and len(prompt) == 2 and isinstance(prompt[0], str)):
            return {"prompt_token_ids": list(prompt)}
        text, images = prompt
        if not images:
            return {"prompt": text}
        mm = self.llm.llm_engine.processor.mm_processor
        if mm is None:
            raise ValueError(f"{self.kwargs['model']} takes no images (use a text dataset).")
        return {"prompt": mm.chat_image_text * len(images) + "\n" + text, "multi_modal_data": {"image": list(images)}}

    def spec_decoding(self) -> dict[str, Any] | None:
        """Speculative decoding counters and rates since the engine started (None when it does not speculate)."""
        from pagemill.metrics.spec_decode import spec_summary

        stats = self.llm.get_stats().spec_decoding
        return spec_summary(stats) if stats is not None else None

    def close(self) -> None:
        """Shut the engine down (if it supports it) and release its memory."""
        shutdown = getattr(self.llm, "shutdown", None)
        if callable(shutdown):
            shutdown()
        self.llm = None
        gc.collect()


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags passed through to `LLM(...)` when set (names as in `vllm`)."""
    g = parser.add_argument_group("pagemill engine")
    g.add_argument("--dtype", default=None, help="e.g. float32 (default: the engine's)")
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=None)
    g.add_argument("--kv-cache-memory", default=None, help="e.g. 2GiB")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--speculative-config", type=config_flag("speculative_config"), default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    g.add_argument("--engine-arg", action="append", default=None, metavar="KEY=VALUE",
                   help="any other LLM(...) keyword; repeatable")
