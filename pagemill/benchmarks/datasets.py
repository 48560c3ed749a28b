"""Benchmark request sets: random, synthetic ShareGPT/Alpaca, shared-prefix groups, custom JSONL, random text with
synthetic images (random-mm).

Every dataset returns `SampleRequest`s whose prompt is natural corpus text of an exact token
length (the token ids are kept too) and whose expected output length is drawn from the
dataset's distribution. All sampling is seeded.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagemill.benchmarks.lengths import (ALPACA_INPUT, ALPACA_OUTPUT, SHAREGPT_INPUT,
                                         SHAREGPT_OUTPUT, LogNormalSpec, sample_lognormal_lengths,
                                         sample_uniform_lengths)
from pagemill.benchmarks.prompts import PromptBuilder

DATASET_NAMES = ("random", "sharegpt", "alpaca", "prefix", "custom", "random-mm")


@dataclass(frozen=True)
class SampleRequest:
    """One benchmark request: prompt text and ids, prompt length and the output length to ask for; `images` (PIL) go
    with the text (prompt_len then counts the text's tokens only: the model's processor adds the placeholders)."""

    prompt: str
    prompt_len: int
    expected_output_len: int
    prompt_token_ids: list[int] | None = None
    images: tuple[Any, ...] = ()


def _sample(builder: PromptBuilder, input_len: int, output_len: int, rng: np.random.Generator,
            prefix_ids: list[int] | None = None) -> SampleRequest:
    text, ids = builder.build(input_len, rng, prefix_ids or ())
    return SampleRequest(prompt=text, prompt_len=len(ids), expected_output_len=output_len,
                         prompt_token_ids=ids)


def random_dataset(builder: PromptBuilder, num_prompts: int, input_len: int, output_len: int,
                   range_ratio: float = 0.0, prefix_len: int = 0, seed: int = 0,
                   output_range_ratio: float | None = None) -> list[SampleRequest]:
    """`vllm bench`'s random dataset: prompt = shared prefix (`prefix_len`) + input_len tokens."""
    rng = np.random.default_rng(seed)
    input_lens = sample_uniform_lengths(input_len, range_ratio, num_prompts, rng)
    out_ratio = range_ratio if output_range_ratio is None else output_range_ratio
    output_lens = sample_uniform_lengths(output_len, out_ratio, num_prompts, rng)
    prefix = builder.build(prefix_len, rng)[1] if prefix_len > 0 else []
    return [_sample(builder, prefix_len + max(1, i), max(1, o), rng, prefix)
            for i, o in zip(input_lens, output_lens)]


def lognormal_dataset(builder: PromptBuilder, num_prompts: int, input_spec: LogNormalSpec,
                      output_spec: LogNormalSpec, output_len: int | None = None,
                      seed: int = 0) -> list[SampleRequest]:
    """Synthetic trace with clipped-lognormal input/output lengths (`output_len` fixes outputs)."""
    rng = np.random.default_rng(seed)
    input_lens = sample_lognormal_lengths(input_spec, num_prompts, rng)
    output_lens = (sample_lognormal_lengths(output_spec, num_prompts, rng) if output_len is None
                   else [output_len] * num_prompts)
    return [_sample(builder, i, o, rng) for i, o in zip(input_lens, output_lens)]


def sharegpt_dataset(builder: PromptBuilder, num_prompts: int, output_len: int | None = None,
                     seed: int = 0) -> list[SampleRequest]:
    """ShareGPT-like lengths (mean input 161.31, output 337.99 tokens, heavy-tailed)."""
    return lognormal_dataset(builder, num_prompts, SHAREGPT_INPUT, SHAREGPT_OUTPUT, output_len, seed)


def alpaca_dataset(builder: PromptBuilder, num_prompts: int, output_len: int | None = None,
                   seed: int = 0) -> list[SampleRequest]:
    """Alpaca-like lengths (mean input 19.31, output 58.45 tokens)."""
    return lognormal_dataset(builder, num_prompts, ALPACA_INPUT, ALPACA_OUTPUT, output_len, seed)


def prefix_dataset(builder: PromptBuilder, num_prompts: int, prefix_len: int, suffix_len: int,
                   num_prefixes: int, output_len: int, seed: int = 0) -> list[SampleRequest]:
    """Groups of requests sharing a long prefix (`vllm bench`'s prefix_repetition), shuffled."""
    if num_prefixes < 1:
        raise ValueError(f"--prefix-repetition-num-prefixes must be >= 1, got {num_prefixes}")
    rng = np.random.default_rng(seed)
    prefixes = [builder.build(prefix_len, rng)[1] for _ in range(num_prefixes)]
    samples = [_sample(builder, prefix_len + suffix_len, output_len, rng, prefixes[k % num_prefixes])
               for k in range(num_prompts)]
    order = rng.permutation(num_prompts)
    return [samples[int(k)] for k in order]


def custom_dataset(builder: PromptBuilder, path: str, num_prompts: int,
                   default_output_len: int) -> list[SampleRequest]:
    """Requests from a JSONL file of {"prompt": str, "output_len": int}; lines repeat if too few."""
    rows: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                row = json.loads(line)
                if not isinstance(row.get("prompt"), str):
                    raise ValueError(f"{path}:{lineno}: every line needs a string field 'prompt'")
                rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no requests found")
    samples = []
    for k in range(num_prompts):
        row = rows[k % len(rows)]
        ids = builder.encode(row["prompt"])
        output_len = int(row.get("output_len") or default_output_len)
        samples.append(SampleRequest(row["prompt"], len(ids), output_len, ids))
    return samples


def parse_image_size(spec: str) -> tuple[int, int]:
    """`WxH` (e.g. 640x480) as (width, height)."""
    w, sep, h = str(spec).lower().partition("x")
    if not sep or not w.isdigit() or not h.isdigit() or int(w) < 1 or int(h) < 1:
        raise ValueError(f"--image-size expects WxH with positive integers (e.g. 512x512), got {spec!r}")
    return int(w), int(h)


def random_image(size: tuple[int, int], rng: np.random.Generator) -> Any:
    """A random-noise RGB PIL image of (width, height) (noise: no two images share encoder or prefix-cache work)."""
    from PIL import Image

    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def random_mm_dataset(builder: PromptBuilder, num_prompts: int, input_len: int, output_len: int,
                      image_size: tuple[int, int], images_per_prompt: int, range_ratio: float = 0.0,
                      seed: int = 0) -> list[SampleRequest]:
    """The random dataset's text with `images_per_prompt` synthetic images of `image_size` per request (vLLM's
    random-mm with one fixed bucket), each image its own."""
    if images_per_prompt < 0:
        raise ValueError(f"--images-per-prompt must be >= 0, got {images_per_prompt}")
    samples = random_dataset(builder, num_prompts, input_len, output_len, range_ratio, 0, seed)
    rng = np.random.default_rng(seed + 1)
    return [SampleRequest(s.prompt, s.prompt_len, s.expected_output_len, s.prompt_token_ids,
                          tuple(random_image(image_size, rng) for _ in range(images_per_prompt)))
            for s in samples]


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    """Add the dataset flags (names as in `vllm bench`) to a sub-command parser."""
    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset-name", default="random",
                   choices=DATASET_NAMES + ("prefix_repetition",), help="request set to generate")
    g.add_argument("--dataset-path", default=None, help="JSONL file for --dataset-name custom")
    g.add_argument("--num-prompts", type=int, default=200, help="number of requests")
    g.add_argument("--seed", type=int, default=0, help="seed for lengths, prompts and arrivals")
    g.add_argument("--random-input-len", type=int, default=256)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly from [len*(1-r), len*(1+r)]")
    g.add_argument("--random-output-range-ratio", type=float, default=None,
                   help="range ratio of output lengths only (default: --random-range-ratio)")
    g.add_argument("--random-prefix-len", type=int, default=0,
                   help="tokens of a prefix shared by all random requests (added to the input len)")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="fixed output length for sharegpt/alpaca (default: drawn)")
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    g.add_argument("--prefix-repetition-output-len", type=int, default=128)
    g.add_argument("--custom-output-len", type=int, default=256,
                   help="output length for custom lines without 'output_len'")
    g.add_argument("--image-size", default="512x512",
                   help="WxH of each synthetic image of --dataset-name random-mm")
    g.add_argument("--images-per-prompt", type=int, default=1,
                   help="synthetic images per request of --dataset-name random-mm")


def get_samples(args: argparse.Namespace, tokenizer: Any) -> list[SampleRequest]:
    """Build the request set selected by `--dataset-name` with the model's tokenizer."""
    builder = PromptBuilder(tokenizer)
    name = "prefix" if args.dataset_name == "prefix_repetition" else args.dataset_name
    if name == "random":
        return random_dataset(builder, args.num_prompts, args.random_input_len,
                              args.random_output_len, args.random_range_ratio,
                              args.random_prefix_len, args.seed, args.random_output_range_ratio)
    if name == "sharegpt":
        return sharegpt_dataset(builder, args.num_prompts, args.sharegpt_output_len, args.seed)
    if name == "alpaca":
        return alpaca_dataset(builder, args.num_prompts, args.sharegpt_output_len, args.seed)
    if name == "prefix":
        return prefix_dataset(builder, args.num_prompts, args.prefix_repetition_prefix_len,
                              args.prefix_repetition_suffix_len,
                              args.prefix_repetition_num_prefixes,
                              args.prefix_repetition_output_len, args.seed)
    if name == "custom":
        if not args.dataset_path:
            raise ValueError("--dataset-path is required for --dataset-name custom")
        return custom_dataset(builder, args.dataset_path, args.num_prompts, args.custom_output_len)
    if name == "random-mm":
        return random_mm_dataset(builder, args.num_prompts, args.random_input_len, args.random_output_len,
                                 parse_image_size(args.image_size), args.images_per_prompt,
                                 args.random_range_ratio, args.seed)
    raise ValueError(f"unknown --dataset-name {args.dataset_name!r}")
