"""Input processing of pooling requests: tokenize (or take ids and segment ids), truncate, validate, and build the
EngineCoreRequest that carries the PoolingParams."""

from __future__ import annotations

import time
from typing import Any

from pagemill.config import ModelConfig
from pagemill.messages import EngineCoreRequest
from pagemill.pooling_params import PoolingParams
from pagemill.sampling_params import SamplingParams

# What the core's Request needs of sampling; a pooling request samples nothing (it ends when its prompt is computed).
_NO_SAMPLING = SamplingParams(max_tokens=1, detokenize=False)


def truncation_length(params: PoolingParams, max_model_len: int) -> int | None:
    """The number of tokens an input is cut to (None: not truncated); -1 means max_model_len."""
    k = params.truncate_prompt_tokens
    if k is None:
        return None
    if k == -1:
        return max_model_len
    if k > max_model_len:
        raise ValueError(f"truncate_prompt_tokens ({k}) must be at most max_model_len ({max_model_len}).")
    return k


def tokenize_pooling_prompt(tokenizer: Any, prompt: Any, truncate_to: int | None
                            ) -> tuple[str | None, list[int], list[int] | None]:
    """(text or None, token ids, segment ids or None) of a string, {"prompt": text}, {"prompt_token_ids": ids,
    "token_type_ids": ...} or a list of ids. Text is truncated by the tokenizer (its side, special tokens kept);
    token ids keep their last `truncate_to` tokens, as vLLM does."""
    types = None
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            text, ids, types = prompt.get("prompt"), list(prompt["prompt_token_ids"]), prompt.get("token_type_ids")
            if types is not None and len(types) != len(ids):
                raise ValueError(f"token_type_ids has {len(types)} entries for {len(ids)} tokens.")
            if truncate_to is not None and len(ids) > truncate_to:
                ids = ids[-truncate_to:]
                types = None if types is None else list(types)[-truncate_to:]
            return text, ids, None if types is None else list(types)
        if "prompt" not in prompt:
            raise ValueError("prompt dict must have a 'prompt' or 'prompt_token_ids' key.")
        prompt = prompt["prompt"]
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty.")
        if truncate_to is None:
            return prompt, tokenizer.encode(prompt), None
        return prompt, tokenizer(prompt, truncation=True, max_length=truncate_to)["input_ids"], None
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        ids = list(prompt)
        return None, ids[-truncate_to:] if truncate_to is not None else ids, None
    raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}.")


def process_pooling(model_config: ModelConfig, tokenizer: Any, request_id: str, prompt: Any,
                    params: PoolingParams, arrival_time: float | None = None,
                    priority: int = 0) -> tuple[str | None, EngineCoreRequest]:
    """Validate a pooling request against the model and build it; ValueError naming the bad field."""
    pooler_config = model_config.pooler_config
    if pooler_config is None:
        raise ValueError("pooling_params: this model generates text (runner='generate'); embed, score and encode "
                         "need a pooling model (runner='pooling').")
    hf = model_config.hf_config
    params = params.verify(pooler_config, hf.hidden_size)
    max_len = model_config.max_model_len
    text, ids, types = tokenize_pooling_prompt(tokenizer, prompt, truncation_length(params, max_len))
    if not ids:
        raise ValueError("prompt must not be empty (it has no tokens).")
    if min(ids) < 0 or max(ids) >= hf.vocab_size:
        raise ValueError(f"prompt_token_ids must be in [0, {hf.vocab_size}), got a token id out of range.")
    if len(ids) > max_len:
        raise ValueError(f"This model's maximum context length is {max_len} tokens (max_model_len). However, you "
                         f"requested {len(ids)} tokens in the input for embedding generation. Please reduce the "
                         "length of the input, or set truncate_prompt_tokens.")
    if types is not None:
        num_types = getattr(hf, "type_vocab_size", 0) if pooler_config.encoder_only else 0
        if not num_types:
            raise ValueError("token_type_ids: this model has no token types.")
        if min(types) < 0 or max(types) >= num_types:
            raise ValueError(f"token_type_ids must be in [0, {num_types}).")
        if not any(types):
            types = None  # all zeros: the model's default
    req = EngineCoreRequest(request_id=request_id, prompt_token_ids=ids, sampling_params=_NO_SAMPLING,
                            eos_token_id=None, arrival_time=arrival_time or time.monotonic(), priority=priority,
                            pooling_params=params, token_type_ids=types)
    return text, req
