"""Front-end input processing: tokenize, validate, and build the EngineCoreRequest."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from pagemill.config import ModelConfig, StructuredOutputsConfig
from pagemill.loader.tokenizer import SKIP_TOKENIZER_MESSAGE, is_no_tokenizer
from pagemill.lora.request import LoRARequest
from pagemill.messages import EngineCoreRequest
from pagemill.pooling.processor import process_pooling
from pagemill.pooling_params import PoolingParams
from pagemill.sampling_params import INT64_MAX, INT64_MIN, RequestOutputKind, SamplingParams

PromptType = str | dict | list[int]


class Processor:
    """Validates user input against the model and turns it into engine requests."""

    def __init__(self, model_config: ModelConfig, tokenizer: Any,
                 structured_outputs_config: StructuredOutputsConfig | None = None) -> None:
        self.model_config = model_config
        self.structured_outputs_config = structured_outputs_config or StructuredOutputsConfig()
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.no_tokenizer = is_no_tokenizer(tokenizer)
        self.vocab_size = model_config.hf_config.vocab_size

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) from a string, {"prompt": ...}, {"prompt_token_ids": ...} or ids."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt dict must have a 'prompt' or 'prompt_token_ids' key.")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty.")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}.")

    @staticmethod
    def _without_text(params: SamplingParams) -> SamplingParams:
        """skip_tokenizer_init: refuse what needs text (ValueError naming the field); no detokenizing."""
        for name in ("stop", "bad_words"):
            if getattr(params, name, None):
                raise ValueError(f"{name}: {SKIP_TOKENIZER_MESSAGE}; use stop_token_ids.")
        if params.structured_outputs is not None:
            raise ValueError(f"structured_outputs: {SKIP_TOKENIZER_MESSAGE}.")
        return params.clone(detokenize=False) if params.detokenize else params

    def _check_structured_outputs(self, params: SamplingParams) -> SamplingParams:
        """Validate the output constraint (ValueError naming the field) and record its backend on a copy."""
        from pagemill.structured_output import prepare

        so = params.structured_outputs
        _, backend = prepare(so, self.structured_outputs_config)
        if so._backend == backend:
            return params
        return params.clone(structured_outputs=dataclasses.replace(so, _backend=backend))

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams,
                arrival_time: float | None = None, priority: int = 0,
                cache_salt: str | None = None,
                lora_request: LoRARequest | None = None,
                truncation_side: str = "left") -> tuple[str | None, EngineCoreRequest]:
        """Validate and build the request; raises ValueError naming the bad field."""
        if isinstance(params, PoolingParams):
            return process_pooling(self.model_config, self.tokenizer, request_id, prompt, params, arrival_time,
                                   priority)
        if self.model_config.runner_type == "pooling":
            raise ValueError("sampling_params: this is a pooling model (runner='pooling'): it embeds or scores "
                             "inputs and generates no text.")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}.")
        if truncation_side not in ("left", "right"):
            raise ValueError(f"truncation_side must be 'left' or 'right', got {truncation_side!r}.")
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}.")
        text, ids = self.tokenize_prompt(prompt)
        if not ids:
            raise ValueError("prompt must not be empty (it has no tokens).")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(f"prompt_token_ids must be in [0, {self.vocab_size}), got a token id out of range.")
        max_len = self.model_config.max_model_len
        if params.truncate_prompt_tokens is not None:
            keep = max_len - 1 if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            if len(ids) > keep:
                ids = ids[-keep:] if truncation_side == "left" else ids[:keep]
                text = None
        for name, tokens in (("allowed_token_ids", params.allowed_token_ids or []),
                             ("logprob_token_ids", params.logprob_token_ids or []),
                             ("logit_bias", params.logit_bias or {})):
            bad = [t for t in tokens if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{name} must be token ids in [0, {self.vocab_size}), got out-of-vocabulary "
                                 f"{'key' if name == 'logit_bias' else 'id'}{'s' if len(bad) > 1 else ''} "
                                 f"{', '.join(map(str, bad))}.")
        if len(ids) >= max_len:
            raise ValueError(
                f"prompt: this model's maximum context length is {max_len} tokens (max_model_len), but the prompt "
                f"has {len(ids)} tokens, leaving no room to generate. Please reduce the length of the prompt."
            )
        for field_name in ("logprobs", "prompt_logprobs"):
            n = getattr(params, field_name)
            limit = self.model_config.max_logprobs
            if n == -1:  # vLLM: the whole vocabulary, if max_logprobs allows it
                n = self.vocab_size
                if 0 <= limit < n:
                    raise ValueError(f"{field_name}=-1 asks for the whole vocabulary ({n} tokens), more than "
                                     f"max_logprobs ({limit}) allows; start the engine with max_logprobs=-1.")
                params = params.clone(**{field_name: n})
            if n is not None and 0 <= limit < n:
                raise ValueError(f"{field_name} must be at most {limit} (max_logprobs), got {n}.")
            if n is not None and n > self.vocab_size:
                raise ValueError(f"{field_name} must be at most the vocabulary size ({self.vocab_size}).")
        max_n = self.model_config.max_n
        if max(params.n, params.best_of or 0) > max_n:
            name = "best_of" if (params.best_of or 0) > params.n else "n"
            raise ValueError(f"{name} must be at most {max_n} (max_n), got {getattr(params, name)}.")
        if not INT64_MIN <= priority <= INT64_MAX:
            raise ValueError(f"priority must fit in a signed 64-bit integer, got {priority}.")
        if max(params.n, params.best_of or 0) > params.n and params.output_kind != RequestOutputKind.FINAL_ONLY:
            raise ValueError("best_of > n cannot be streamed: the best sequences are known only at the end.")
        if self.no_tokenizer:
            params = self._without_text(params)
        if params.structured_outputs is not None:
            params = self._check_structured_outputs(params)
        if params.max_tokens is None:  # a copy: the same SamplingParams may serve prompts of other lengths
            params = params.clone(max_tokens=max_len - len(ids))
        req = EngineCoreRequest(request_id=request_id, prompt_token_ids=ids, sampling_params=params,
                                eos_token_id=self.eos_token_id, arrival_time=arrival_time or time.monotonic(),
                                priority=priority, cache_salt=cache_salt, lora_request=lora_request)
        return text, req
