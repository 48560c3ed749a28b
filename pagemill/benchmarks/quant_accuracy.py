"""Accuracy of int8 / int4 weight-only quantization against float32, teacher-forced over a fixed corpus.

Each quantized engine reads the same token sequences as the float32 engine (prompt logprobs, no sampling); per
position it reports whether its top-1 token is float32's, and |delta logprob| of float32's top-1 token. Prefills
run in chunks of at most `chunk` tokens, so the few-row paths (the GEMV records) compute them, as they compute
decode batches.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pagemill.benchmarks.corpus import CORPUS_TEXT

TOP_K = 20  # prompt logprobs kept per position: float32's top-1 must be among the quantized model's top 20


@dataclass
class Agreement:
    """One quantization against float32 over the corpus."""

    quantization: str
    positions: int
    top1_agreement: float  # fraction of positions whose top-1 token is float32's
    mean_abs_dlogprob: float  # mean |logprob_q(t) - logprob_f32(t)| of float32's top-1 token t
    max_abs_dlogprob: float
    missing: int  # positions where float32's top-1 was not in the quantized top TOP_K (left out of the means)


def corpus_paragraphs() -> list[str]:
    """The built-in public-domain corpus, one sequence per paragraph (about 1.7k SmolLM2 tokens in all)."""
    return [p.strip() for p in CORPUS_TEXT.split("\n\n") if p.strip()]


def save_hf_dir(gguf_path: str, out_dir: str) -> str:
    """A GGUF model as a float32 safetensors HF directory (transformers dequantizes it), tokenizer included."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.split(os.path.abspath(gguf_path))
    loaded = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    # transformers refuses to save a model it loaded from GGUF: the same weights go into a fresh model first.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(out_dir)
    return out_dir


def prompt_topk(model: str, quantization: str, token_lists: list[list[int]], chunk: int = 64,
                **llm_kwargs: object) -> list[list[dict[int, float]]]:
    """Per sequence and position (from the second token on), the TOP_K tokens' logprobs of the engine."""
    from pagemill import LLM, SamplingParams

    max_len = max(len(t) for t in token_lists) + 16
    llm = LLM(model, quantization=quantization, max_model_len=max_len, max_num_batched_tokens=chunk,
              kv_cache_memory="256MiB", enable_prefix_caching=False, **llm_kwargs)
    outs = llm.generate([{"prompt_token_ids": t} for t in token_lists],
                        SamplingParams(max_tokens=1, prompt_logprobs=TOP_K), use_tqdm=False)
    return [[{t: lp.logprob for t, lp in d.items() if lp.rank is not None and lp.rank <= TOP_K}
             for d in o.prompt_logprobs[1:]] for o in outs]


def compare(quantization: str, ref: list[list[dict[int, float]]], other: list[list[dict[int, float]]]) -> Agreement:
    """Top-1 agreement and |delta logprob| of the reference's top-1 token, over every position."""
    agree = missing = 0
    errors: list[float] = []
    for ref_seq, seq in zip(ref, other, strict=True):
        for r, o in zip(ref_seq, seq, strict=True):
            top = max(r, key=r.get)
            agree += int(max(o, key=o.get) == top)
            if top in o:
                errors.append(abs(o[top] - r[top]))
            else:
                missing += 1
    positions = sum(len(s) for s in ref)
    return Agreement(quantization, positions, agree / positions, sum(errors) / max(len(errors), 1),
                     max(errors, default=0.0), missing)


def measure(model: str, quantizations: tuple[str, ...] = ("int8", "int4"), chunk: int = 64,
            **llm_kwargs: object) -> list[Agreement]:
    """Each quantization of an HF-directory model against its float32 self over the corpus paragraphs."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    token_lists = [tok.encode(p) for p in corpus_paragraphs()]
    ref = prompt_topk(model, "none", token_lists, chunk, **llm_kwargs)
    return [compare(q, ref, prompt_topk(model, q, token_lists, chunk, **llm_kwargs)) for q in quantizations]
