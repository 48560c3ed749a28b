"""Front-end input processing: tokenize, validate, and build the EngineCoreRequest."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from pagemill.config import ModelConfig, StructuredOutputsConfig
from pagemill.loader.tokenizer import SKIP_TOKENIZER_MESSAGE, is_no_tokenizer
from pagemill.lora.request import LoRARequest
from pagemill.messages import EngineCoreRequest, MultiModalFeature
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
        self.mm_processor = None  # a vision-language model's HF processor (images -> pixels, placeholders expanded)
        if model_config.is_multimodal:
            from pagemill.multimodal.processing import MultiModalProcessor

            self.mm_processor = MultiModalProcessor(model_config)

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

    def process_multimodal(self, prompt: dict) -> tuple[str | None, list[int], list[MultiModalFeature]]:
        """(text, token ids, image features) of a prompt dict with `multi_modal_data` (processed here) or with
        `mm_features` (processed already, by the server's prompt worker)."""
        if "mm_features" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"]), list(prompt["mm_features"])
        data = prompt["multi_modal_data"]
        if self.mm_processor is None:
            raise ValueError(f"multi_modal_data: the model ({self.model_config.architecture}) takes no images.")
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ValueError("multi_modal_data must be a dict with an 'image' entry (a PIL image or a list of them); "
                             f"got {sorted(data) if isinstance(data, dict) else type(data).__name__}.")
        if "prompt" not in prompt:
            raise ValueError("prompt: multi_modal_data needs the prompt as text (one image placeholder per image).")
        ids, features = self.mm_processor.process(prompt["prompt"], data.get("image", []),
                                                  prompt.get("add_special_tokens", True))
        return prompt["prompt"], ids, features

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

    def _check_thinking_budget(self) -> None:
        """thinking_token_budget needs a reasoning parser whose thinking ends with a marker (ValueError naming it)."""
        from pagemill.reasoning.abs_reasoning_parsers import reasoning_parser_class

        so = self.structured_outputs_config
        if so.reasoning_parser is None or (so.reasoning_end_str is None
                                           and reasoning_parser_class(so.reasoning_parser).end_token is None):
            raise ValueError("thinking_token_budget needs a server started with --reasoning-parser (one whose "
                             "thinking ends with a marker, e.g. deepseek_r1 or qwen3).")

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
        mm_features = None
        if isinstance(prompt, dict) and ("multi_modal_data" in prompt or "mm_features" in prompt):
            text, ids, mm_features = self.process_multimodal(prompt)
        else:
            text, ids = self.tokenize_prompt(prompt)
        if self.mm_processor is not None and not mm_features and self.mm_processor.image_token_id in ids:
            raise ValueError("prompt: it holds image placeholder tokens but no image was given (multi_modal_data).")
        if not ids:
            raise ValueError("prompt must not be empty (it has no tokens).")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(f"prompt_token_ids must be in [0, {self.vocab_size}), got a token id out of range.")
        max_len = self.model_config.max_model_len
        if params.truncate_prompt_tokens is not None:
            keep = max_len - 1 if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            if len(ids) > keep and mm_features:
                raise ValueError("truncate_prompt_tokens cannot cut a prompt with images.")
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
        if params.thinking_token_budget is not None:
            self._check_thinking_budget()
            if params.structured_outputs is not None and self.structured_outputs_config.enable_in_reasoning:
                raise ValueError("thinking_token_budget cannot be combined with structured output on a server "
                                 "started with structured_outputs_config.enable_in_reasoning.")
        if params.max_tokens is None:  # a copy: the same SamplingParams may serve prompts of other lengths
            params = params.clone(max_tokens=max_len - len(ids))
        req = EngineCoreRequest(request_id=request_id, prompt_token_ids=ids, sampling_params=params,
                                eos_token_id=self.eos_token_id, arrival_time=arrival_time or time.monotonic(),
                                priority=priority, cache_salt=cache_salt, lora_request=lora_request,
                                mm_features=mm_features or None)
        return text, req
