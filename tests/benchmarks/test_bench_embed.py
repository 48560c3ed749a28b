"""`bench embed`: flags, the texts, and one tiny real run of both backends (structure and agreement only; the
timings of a test run mean nothing)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pagemill.benchmarks.cli import build_parser
from pagemill.benchmarks.embed import run_embed
from pagemill.benchmarks.embed_texts import mixed_length_texts


def _parse(*argv: str):
    return build_parser().parse_args(["bench", "embed", *argv])


def test_flags_and_defaults():
    args = _parse()
    assert (args.model, args.num_texts, args.hf_batch_size, args.compare) == (None, 1000, 32, "hf")
    with pytest.raises(SystemExit):
        _parse("--compare", "sbert")


def test_texts_are_seeded_and_of_mixed_length():
    a, b = mixed_length_texts(200, seed=5), mixed_length_texts(200, seed=5)
    assert a == b and a != mixed_length_texts(200, seed=6)
    words = np.array([len(t.split()) for t in a])
    assert words.min() >= 2 and words.max() <= 180 and np.median(words) < words.mean()  # a long tail
    with pytest.raises(ValueError, match="min_words"):
        mixed_length_texts(3, min_words=10, max_words=5)


def test_tiny_run_agrees_with_hf(tmp_path):
    out = tmp_path / "embed.json"
    payload = run_embed(_parse("--num-texts", "12", "--num-iters", "1", "--num-iters-warmup", "0",
                               "--max-words", "40", "--save-result", str(out)))
    assert set(payload["results"]) == {"pagemill", "hf"}
    assert payload["agreement"]["min_cosine"] >= 0.99999
    assert payload["speedup"] > 0 and payload["num_texts"] == 12 and payload["num_tokens"] > 12
    saved = json.loads(out.read_text())
    assert saved["results"]["pagemill"]["embeddings_per_s"] > 0 and "environment" in saved
