"""Texts of mixed length for embedding benchmarks and tests, cut from the built-in corpus (seeded)."""

from __future__ import annotations

import numpy as np

from pagemill.benchmarks.corpus import CORPUS_TEXT


def mixed_length_texts(n: int, seed: int = 0, min_words: int = 2, max_words: int = 180) -> list[str]:
    """`n` corpus passages whose word counts are log-uniform in [min_words, max_words] (many short texts, a tail
    of long ones, as an embedding workload has)."""
    if not 1 <= min_words <= max_words:
        raise ValueError(f"need 1 <= min_words <= max_words, got {min_words} and {max_words}.")
    words = CORPUS_TEXT.split()
    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.uniform(np.log(min_words), np.log(max_words + 1), size=n)).astype(int)
    starts = rng.integers(len(words), size=n)
    return [" ".join(words[(s + i) % len(words)] for i in range(int(k))) for s, k in zip(starts, lengths)]
