"""Random-weight HF models built from a config, with a word-level tokenizer made on the spot: no hub, no SmolLM2
file (the GPU machine has neither). Used by the GPU parity checks and the throughput benchmark."""

from __future__ import annotations

import json
import os

import torch

# tiny models of each family (as tests/conftest._save_tiny, without SmolLM2's tokenizer)
TINY_COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.2,
                   tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
TINY_EXTRA = {"llama": dict(rope_theta=10000.0), "qwen2": dict(rope_theta=1e6),
              "mistral": dict(sliding_window=None, rope_theta=1e4),
              "qwen3": dict(rope_theta=1e6, head_dim=32, tie_word_embeddings=True),
              "gemma3_text": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8, tie_word_embeddings=True,
                                  layer_types=["sliding_attention", "full_attention"]),
              "phi3": dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})}
# Llama-3.2-1B's shape (random weights: speed does not depend on the values)
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
                tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0, head_dim=64)
LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
                tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0, head_dim=128)
SHAPES = {"llama-1b": LLAMA_1B, "llama-8b": LLAMA_8B}


def save_word_tokenizer(path: str, vocab_size: int) -> None:
    """A word-level tokenizer (ids 0/1/2/3 = pad/bos/eos/unk): the words of pagemill's benchmark corpus, so that
    `bench serve` prompts are varied text, then tokens t{i} up to `vocab_size`; saved as tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from pagemill.benchmarks.corpus import CORPUS_TEXT

    words = [f"t{i}" for i in range(4)]
    words += [w for w in dict.fromkeys(CORPUS_TEXT.split()) if w not in words][:vocab_size // 2]
    words += [f"t{i}" for i in range(len(words), vocab_size)]
    vocab = {w: i for i, w in enumerate(words[:vocab_size])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", bos_token="t1", eos_token="t2",
                                   unk_token="t3")
    fast.save_pretrained(path)


def build(kind: str, root: str, config_overrides: dict | None = None, dtype: torch.dtype = torch.float32,
          device: str = "cpu") -> str:
    """Save a random `kind` model (a tiny one, or "llama-1b" / "llama-8b") under `root`; returns its directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = os.path.join(root, f"{kind}-{str(dtype).removeprefix('torch.')}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(0)
    if kind in SHAPES:
        config = AutoConfig.for_model("llama", **SHAPES[kind], **(config_overrides or {}))
    else:
        config = AutoConfig.for_model(kind, **{**TINY_COMMON, **TINY_EXTRA[kind], **(config_overrides or {})})
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path)
    save_word_tokenizer(path, config.vocab_size)
    return path


def shape_counts(cfg) -> tuple[int, int, int]:
    """(parameters of one decoder layer's linears, the embedding table's parameters, KV elements per token over all
    layers) of a Llama-like config: the byte counts the roofline benchmarks read per step."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_layer = (cfg.hidden_size * head_dim * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
                 + cfg.num_attention_heads * head_dim * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size)
    return per_layer, cfg.vocab_size * cfg.hidden_size, cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim


def report(tag: str, row: dict, path: str | None) -> None:
    """Print the result row as `TAG {json}` and save it to `path` (run.sh's summary reads the file)."""
    print(f"{tag} " + json.dumps(row), flush=True)
    save(row, path)


def save(row: dict, path: str | None) -> None:
    """Write the result row as JSON to `path` (None: nowhere)."""
    if path:
        with open(path, "w") as f:
            json.dump(row, f)
