"""Accuracy of int8 / int4 weight-only quantization against float32, teacher-forced over a fixed corpus.

Each quantized engine reads the same token sequences as the float32 engine (prompt logprobs, no sampling); per
position it reports whether its top-1 token is float32's, and |delta logprob| of float32's top-1 token. Prefills
run in chunks of at most `chunk` tokens, so the few-row paths (the GEMV records) compute them, as they compute
decode batches.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any

from pagemill.benchmarks.corpus import CORPUS_TEXT

TOP_K = 20  # prompt logprobs kept per position: float32's top-1 must be among the quantized model's top 20


@dataclass
class Agreement:
    """One variant (a quantization, a matmul dtype) against float32 over the corpus."""

    name: str  # the variant: int8, int4, ...
    positions: int
    top1_agreement: float  # fraction of positions whose top-1 token is float32's
    mean_abs_dlogprob: float  # mean |logprob_q(t) - logprob_f32(t)| of float32's top-1 token t
    max_abs_dlogprob: float
    missing: int  # positions where float32's top-1 was not in the quantized top TOP_K (left out of the means)


# Code and expository prose next to the corpus' fiction, so the positions are not all one register.
EXTRA_PARAGRAPHS = [
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"
    "    out = []\n    i = j = 0\n"
    "    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n"
    "        else:\n            out.append(b[j])\n            j += 1\n    out.extend(a[i:])\n    out.extend(b[j:])\n"
    "    return out\n\n\ndef binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n    while lo <= hi:\n"
    "        mid = (lo + hi) // 2\n        if items[mid] == target:\n            return mid\n"
    "        if items[mid] < target:\n            lo = mid + 1\n        else:\n"
    "            hi = mid - 1\n    return -1\n",
    "Photosynthesis is the process by which green plants, algae and some bacteria turn light into chemical energy. "
    "In the chloroplasts, chlorophyll absorbs mostly blue and red light, and that energy splits water molecules, "
    "releasing oxygen as a by-product. The hydrogen and the energy captured in ATP and NADPH then drive the Calvin "
    "cycle, which fixes carbon dioxide from the air into sugars. Nearly all the oxygen in the atmosphere and most "
    "of the food eaten on Earth can be traced back to this reaction, which is why ecologists call plants the "
    "primary producers of almost every ecosystem on land and in the sea.",
    "The heart is a muscular organ about the size of a closed fist that pumps blood through the body. It has four "
    "chambers: the two upper atria receive blood, and the two lower ventricles push it out. The right side sends "
    "blood to the lungs, where it picks up oxygen and releases carbon dioxide; the left side then pumps the "
    "oxygen-rich blood through the arteries to every organ. Valves between the chambers keep the blood flowing in "
    "one direction, and an electrical signal that starts in the sinoatrial node sets the rhythm of each beat, "
    "about seventy times a minute at rest.",
]


def corpus_paragraphs() -> list[str]:
    """The built-in public-domain corpus and EXTRA_PARAGRAPHS, one sequence per paragraph (~1.6k SmolLM2 tokens)."""
    return [p.strip() for p in CORPUS_TEXT.split("\n\n") if p.strip()] + EXTRA_PARAGRAPHS


# A GGUF type's grid: (inputs per group, steps across a group's range) of its dequantized values.
GGUF_GRIDS = {2: (32, 15), 3: (32, 15), 6: (32, 31), 7: (32, 31), 8: (32, 255), 10: (16, 3), 11: (16, 7),
              12: (32, 15), 13: (32, 31), 14: (16, 63)}  # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K .. Q6_K
Q4_1_GRID = GGUF_GRIDS[3]
# GGUF block names of a decoder layer's linears -> transformers' module names.
GGUF_LINEAR_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                     "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                     "ffn_down": "mlp.down_proj"}


def dither_(weight: Any, generator: Any, group: int = 32, levels: int = 15) -> None:
    """Add uniform noise of one grid step (per group of `group` inputs: (max - min) / levels) to a weight in place.

    A GGUF file's dequantized weights are already on its format's grid (Q4_1: 15 steps per group of 32), so
    re-quantization to that grid recovers them exactly; the noise makes a float weight whose rounding to the grid
    is (about) the stored one, as the original checkpoint's was, so int4 / int8 errors are those of quantizing real
    float weights.
    """
    import torch

    g = weight.view(weight.shape[0], -1, group)
    step = (g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / levels
    g.add_((torch.rand(g.shape, generator=generator) - 0.5) * step)


def gguf_grids(gguf_path: str) -> dict[str, tuple[int, int]]:
    """Each decoder linear's grid (GGUF_GRIDS) keyed by its transformers name suffix, `layers.{i}.{module}.weight`."""
    from pagemill.loader.gguf_file import open_gguf

    grids = {}
    for name, t in open_gguf(gguf_path).tensors.items():
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in GGUF_LINEAR_NAMES and t.ggml_type in GGUF_GRIDS:
            grids[f"layers.{parts[1]}.{GGUF_LINEAR_NAMES[parts[2]]}.weight"] = GGUF_GRIDS[t.ggml_type]
    return grids


def load_gguf_as_hf(gguf_path: str) -> tuple[Any, Any]:
    """transformers' float32 model (dequantized) and tokenizer of a GGUF file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.split(os.path.abspath(gguf_path))
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(d, gguf_file=f)


def _grid_of(name: str, grids: dict[str, tuple[int, int]] | None) -> tuple[int, int]:
    """The grid of the parameter `name`: its entry in `grids` (by name suffix), else Q4_1's."""
    for suffix, grid in (grids or {}).items():
        if name.endswith(suffix):
            return grid
    return Q4_1_GRID


def save_hf_dir(model: Any, tokenizer: Any, out_dir: str, dither_seed: int | None = None,
                grids: dict[str, tuple[int, int]] | None = None) -> str:
    """A transformers model (e.g. loaded from GGUF) saved as a float32 safetensors HF directory with its tokenizer;
    with `dither_seed`, the decoder layers' linear weights are dithered off their grid (`dither_`: each tensor's
    entry in `grids`, see gguf_grids; Q4_1's where it has none)."""
    import torch
    from transformers import AutoModelForCausalLM

    # transformers refuses to save a model it loaded from GGUF: the same weights go into a fresh model first.
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(model.state_dict())
    if dither_seed is not None:
        generator = torch.Generator().manual_seed(dither_seed)
        with torch.no_grad():
            for name, p in fresh.named_parameters():
                group, levels = _grid_of(name, grids)
                if ".layers." in name and p.dim() == 2 and p.shape[1] % group == 0:
                    dither_(p.data, generator, group, levels)
    fresh.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


CALIBRATION_SEEDS = ("The", "In 1850,", "def ", "Once upon a time", "The capital of", "Water is", "import", "Dear")


def calibration_sequences(model: Any, tokenizer: Any, new_tokens: int = 96) -> list[list[int]]:
    """Token sequences for calibration, written by the float model itself (greedy continuations of a few seed
    words): independent of the corpus the accuracy is measured on."""
    import torch

    seqs = []
    with torch.no_grad():
        for seed in CALIBRATION_SEEDS:
            ids = torch.tensor([tokenizer.encode(seed)])
            out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
            seqs.append(out[0].tolist())
    return seqs


def _smoothing_pairs(model: Any) -> list[tuple[Any, list[Any]]]:
    """(RMSNorm, the linears that read its output) of each decoder layer: the attention input's norm and q / k / v,
    the MLP input's norm (Gemma 3's pre-feedforward norm) and gate / up."""
    pairs = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        pairs.append((layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj]))
        mlp_norm = getattr(layer, "pre_feedforward_layernorm", None) or layer.post_attention_layernorm
        pairs.append((mlp_norm, [mlp.gate_proj, mlp.up_proj]))
    return pairs


def smooth_quant_(model: Any, calibration: list[list[int]], alpha: float = 0.5) -> int:
    """SmoothQuant (Xiao et al., 2023) in place, as llm-compressor's W8A8 recipe applies it before quantizing: for
    input channel j of the linears after each RMSNorm, s_j = max|X_j|^alpha / max|W[:, j]|^(1 - alpha) over the
    calibration tokens and those linears; the norm's output is divided by s and the linears' columns multiplied by
    it, so the float model computes the same function while per-token int8 activations lose less to outlier
    channels. Returns the number of (norm, linears) pairs smoothed."""
    import torch

    pairs = _smoothing_pairs(model)
    amax: dict[int, torch.Tensor] = {}

    def hook(i: int):
        def record(_module, _inputs, output):
            m = output.detach().abs().flatten(0, -2).amax(0).float()
            amax[i] = m if i not in amax else torch.maximum(amax[i], m)
        return record

    handles = [norm.register_forward_hook(hook(i)) for i, (norm, _) in enumerate(pairs)]
    try:
        with torch.no_grad():
            for ids in calibration:
                model(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    with torch.no_grad():
        for i, (norm, linears) in enumerate(pairs):
            wmax = torch.stack([lin.weight.abs().amax(0) for lin in linears]).amax(0).float()
            scale = (amax[i].clamp(min=1e-5) ** alpha / wmax.clamp(min=1e-5) ** (1 - alpha)).clamp(min=1e-5)
            if type(norm).__name__.startswith("Gemma"):  # Gemma's RMSNorm scales by (1 + weight)
                norm.weight.copy_((1.0 + norm.weight.float()) / scale - 1.0)
            else:
                norm.weight.div_(scale)
            for lin in linears:
                lin.weight.mul_(scale)
    return len(pairs)


def prompt_topk(model: str, token_lists: list[list[int]], chunk: int = 64,
                **llm_kwargs: Any) -> list[list[dict[int, float]]]:
    """Per sequence and position (from the second token on), the TOP_K tokens' logprobs of an engine built with
    `llm_kwargs` (quantization=..., linear_dtype=...)."""
    from pagemill import LLM, SamplingParams

    max_len = max(len(t) for t in token_lists) + 16
    llm = LLM(model, max_model_len=max_len, max_num_batched_tokens=chunk, kv_cache_memory="256MiB",
              enable_prefix_caching=False, **llm_kwargs)
    outs = llm.generate([{"prompt_token_ids": t} for t in token_lists],
                        SamplingParams(max_tokens=1, prompt_logprobs=TOP_K), use_tqdm=False)
    return [[{t: lp.logprob for t, lp in d.items() if lp.rank is not None and lp.rank <= TOP_K}
             for d in o.prompt_logprobs[1:]] for o in outs]


def compare(name: str, ref: list[list[dict[int, float]]], other: list[list[dict[int, float]]]) -> Agreement:
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
    return Agreement(name, positions, agree / positions, sum(errors) / max(len(errors), 1),
                     max(errors, default=0.0), missing)


DEFAULT_VARIANTS = {"int8": {"quantization": "int8"}, "int4": {"quantization": "int4"}}


def corpus_tokenizer(model: str) -> Any:
    """The model's tokenizer: an HF directory's, or the one pagemill builds from a GGUF file's metadata."""
    if model.endswith(".gguf"):
        from pagemill.loader.model_files import resolve_model
        from pagemill.loader.tokenizer import load_tokenizer

        resolved = resolve_model(model)
        return load_tokenizer(resolved.tokenizer_path, resolved.gguf_file, resolved.hf_config)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def measure(model: str, variants: dict[str, dict[str, Any]] | None = None, chunk: int = 64) -> list[Agreement]:
    """Each variant (name -> LLM kwargs; default int8 and int4) of an HF-directory model against its float32 self
    over the corpus paragraphs."""
    token_lists = [corpus_tokenizer(model).encode(p) for p in corpus_paragraphs()]
    ref = prompt_topk(model, token_lists, chunk)
    return [compare(name, ref, prompt_topk(model, token_lists, chunk, **kwargs))
            for name, kwargs in (variants or DEFAULT_VARIANTS).items()]


def measure_checkpoints(reference: str, checkpoints: dict[str, str], chunk: int = 64) -> list[Agreement]:
    """Each quantized checkpoint directory (name -> path: GPTQ, AWQ, compressed-tensors, ...) against the float32
    engine on the `reference` directory it was made from, over the corpus paragraphs."""
    token_lists = [corpus_tokenizer(reference).encode(p) for p in corpus_paragraphs()]
    ref = prompt_topk(reference, token_lists, chunk)
    return [compare(name, ref, prompt_topk(path, token_lists, chunk)) for name, path in checkpoints.items()]
