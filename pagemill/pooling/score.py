"""Scoring text pairs (LLM.score, /score, /rerank): pairing rules, cross-encoder inputs and embedding cosine."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pagemill.outputs import PoolingOutput


def score_pairs(data_1: Any, data_2: Any) -> list[tuple[Any, Any]]:
    """The (text_1, text_2) pairs to score, as vLLM pairs them: 1 x 1, 1 x N (text_1 repeated) or N x N (zipped)."""
    first = [data_1] if not isinstance(data_1, list) else data_1
    second = [data_2] if not isinstance(data_2, list) else data_2
    if not first:
        raise ValueError("text_1 must not be empty.")
    if not second:
        raise ValueError("text_2 must not be empty.")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(f"text_1 has {len(first)} items and text_2 {len(second)}: give one text_1, or as many as "
                         "text_2.")
    return list(zip(first, second))


def unique_inputs(pairs: list[tuple[Any, Any]]) -> tuple[list[Any], list[int]]:
    """(each distinct input once, the index in it of every pair member in order): a 1 x N query is embedded once."""
    index: dict[Any, int] = {}
    inputs, slots = [], []
    for x in (x for pair in pairs for x in pair):
        key = x if isinstance(x, str) else tuple(x) if isinstance(x, list) else id(x)
        if key not in index:
            index[key] = len(inputs)
            inputs.append(x)
        slots.append(index[key])
    return inputs, slots


def cross_encoder_prompt(tokenizer: Any, text_1: Any, text_2: Any, truncate_to: int | None) -> dict[str, Any]:
    """A cross-encoder's input for one pair: `[CLS] text_1 [SEP] text_2 [SEP]` with segment ids 0 then 1, as the
    model's tokenizer builds it (truncating the longer text first when `truncate_to` is given)."""
    if not isinstance(text_1, str) or not isinstance(text_2, str):
        raise ValueError("a cross-encoder scores pairs of texts: text_1 and text_2 must be strings.")
    if not text_1 or not text_2:
        raise ValueError("text_1 and text_2 must not be empty.")
    kw: dict[str, Any] = {"truncation": True, "max_length": truncate_to} if truncate_to is not None else {}
    enc = tokenizer(text_1, text_2, return_token_type_ids=True, **kw)
    return {"prompt": None, "prompt_token_ids": list(enc["input_ids"]), "token_type_ids": list(enc["token_type_ids"])}


def classifier_score(output: PoolingOutput) -> float:
    """The score a one-label cross-encoder gives a pair (its sigmoid, or its logit with activation off)."""
    if output.data.numel() != 1:
        raise ValueError(f"score needs a cross-encoder with one output label; this model has {output.data.numel()}.")
    return float(output.data[0])


def cosine_scores(first: list[torch.Tensor], second: list[torch.Tensor]) -> list[float]:
    """Cosine similarity of each pair of embeddings."""
    if not first:
        return []
    return F.cosine_similarity(torch.stack(first), torch.stack(second), dim=-1).tolist()
