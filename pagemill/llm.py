"""The offline LLM class: vLLM's `LLM` API (generate, chat) over the in-process engine."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from pagemill.engine.arg_utils import EngineArgs, structured_outputs_fields
from pagemill.engine.llm_engine import LLMEngine
from pagemill.engine.processor import PromptType
from pagemill.lora.request import LoRARequest
from pagemill.entrypoints.chat_utils import ChatRenderer, load_chat_template
from pagemill.metrics.stats import SchedulerStats
from pagemill.outputs import RequestOutput
from pagemill.pooling.llm_api import PoolingLLMMixin
from pagemill.sampling_params import SamplingParams

ChatMessages = list[dict[str, Any]]

if TYPE_CHECKING:
    from pagemill.beam_search import BeamSearchOutput, BeamSearchParams


class LLM(PoolingLLMMixin):
    """Generate text offline for a batch of prompts; `LLM()` runs the embedded SmolLM2-135M-Instruct."""

    def __init__(self, model: str | None = None, tokenizer: str | None = None, dtype: str = "auto",
                 seed: int = 0, max_model_len: int | None = None, max_num_seqs: int = 128,
                 max_num_batched_tokens: int | None = None, block_size: int = 16,
                 kv_cache_memory: int | str | None = None, enable_prefix_caching: bool = True,
                 **kwargs: Any) -> None:
        so_config = kwargs.get("structured_outputs_config")  # vLLM's: a dict or a StructuredOutputsConfig
        if so_config is not None and not isinstance(so_config, (dict, str)):
            kwargs["structured_outputs_config"] = structured_outputs_fields(so_config)
        known = set(EngineArgs.field_names())
        unknown = [k for k in kwargs if k not in known]
        if unknown:
            raise ValueError(f"Unknown LLM argument(s): {', '.join(unknown)}.")
        args = EngineArgs(model=model, tokenizer=tokenizer, dtype=dtype, seed=seed, max_model_len=max_model_len,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          block_size=block_size, kv_cache_memory=kv_cache_memory,
                          enable_prefix_caching=enable_prefix_caching, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(args)
        self._chat_renderer = ChatRenderer(self.llm_engine.tokenizer)

    def get_tokenizer(self) -> Any:
        """The model's tokenizer."""
        return self.llm_engine.tokenizer

    @property
    def model_config(self) -> Any:
        """The engine's ModelConfig, with vLLM's field names (model, tokenizer, dtype, max_model_len, seed,
        served_model_name, hf_config, runner_type, max_logprobs, skip_tokenizer_init, ...; get_vocab_size())."""
        return self.llm_engine.config.model_config

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's own defaults (its generation_config.json), else vLLM's defaults."""
        from pagemill.loader.generation_config import sampling_defaults

        return SamplingParams(**sampling_defaults(self.llm_engine.config.model_config.model))

    def get_stats(self) -> SchedulerStats:
        """Scheduler and KV cache statistics now: blocks free, prefix-cache hits, preemptions, swaps, ..."""
        return self.llm_engine.get_stats()

    def apply_model(self, func: Callable[[Any], Any]) -> list[Any]:
        """Run func(model) on the model of every worker and return the results (vLLM's `LLM.apply_model`)."""
        return self.llm_engine.apply_model(func)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter ahead of its requests (vLLM's `llm.llm_engine.add_lora`); True if newly loaded."""
        return self.llm_engine.add_lora(lora_request)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Drop cached prefixes; only possible while idle, unless `reset_running_requests` preempts the running
        requests first (they recompute their KV)."""
        return self.llm_engine.reset_prefix_cache(reset_running_requests)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest] | None = None,
                 priority: int | Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order. `lora_request`: one adapter for every
        prompt or one per prompt (None entries: the base model); `priority`: one for every prompt or one per
        prompt (with scheduling_policy="priority", lower values first)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) \
            else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts.")
        if isinstance(priority, bool) or (priority is not None and not isinstance(priority, int)
                                          and any(isinstance(p, bool) or not isinstance(p, int) for p in priority)):
            raise ValueError(f"priority must be an integer or a list of integers, got {priority!r}.")
        if isinstance(priority, int):
            priority = [priority] * len(prompts)
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompts)} prompts.")
        return self._run(prompts, params, use_tqdm, priority, self._lora_requests(lora_request, len(prompts)))

    @staticmethod
    def _lora_requests(lora_request: LoRARequest | Sequence[LoRARequest] | None, n: int) -> list[LoRARequest | None]:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return [lora_request] * n
        loras = list(lora_request)
        if len(loras) != n:
            raise ValueError(f"lora_request has {len(loras)} entries for {n} prompts.")
        return loras

    def beam_search(self, prompts: list[PromptType], params: "BeamSearchParams",
                    lora_request: LoRARequest | Sequence[LoRARequest] | None = None,
                    use_tqdm: bool = False) -> list["BeamSearchOutput"]:
        """Beam search for each prompt; returns the beam_width best sequences of each, best first."""
        from pagemill.beam_search import BeamSearcher

        tok = self.get_tokenizer()
        search = BeamSearcher([self.llm_engine.processor.tokenize_prompt(p)[1] for p in prompts], params,
                              tok.eos_token_id)
        loras = self._lora_requests(lora_request, len(prompts))
        bar = tqdm(total=params.max_tokens, desc="Beam search", disable=not use_tqdm, dynamic_ncols=True)
        while live := search.live():
            bar.update(1)
            outs = self.generate([{"prompt_token_ids": b.tokens} for _, b in live], search.step_params,
                                 use_tqdm=False, lora_request=[loras[i] for i, _ in live])
            search.advance(live, [out.outputs[0].logprobs[0] for out in outs])
        bar.close()
        return search.results(lambda tokens: tok.decode(tokens, skip_special_tokens=True))

    def chat(self, messages: ChatMessages | list[ChatMessages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest] | None = None,
             priority: int | Sequence[int] | None = None) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them and generate replies.

        `tools` (OpenAI function definitions) reach the template as its `tools` variable; `chat_template` is a
        template, a file, or a shipped template's name (e.g. "chatml_tools", ChatML with a tools branch).
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self._chat_prompt(c, chat_template, add_generation_prompt, continue_final_message, tools,
                                     chat_template_kwargs) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request, priority=priority)

    def _chat_prompt(self, conversation: ChatMessages, chat_template: str | None, add_generation_prompt: bool,
                     continue_final_message: bool, tools: list[dict[str, Any]] | None,
                     chat_template_kwargs: dict[str, Any] | None) -> dict[str, Any]:
        """The prompt of one conversation: its token ids, or (with image parts) its text and images."""
        from pagemill.multimodal.chat import has_images, load_images, take_images

        if not has_images(conversation):
            return {"prompt_token_ids": self.render_chat(conversation, chat_template, add_generation_prompt,
                                                         continue_final_message, tools, chat_template_kwargs)}
        mm = self.llm_engine.processor.mm_processor
        conversation, sources = take_images(conversation, mm.chat_image_text if mm is not None else None)
        text = self._chat_renderer.render_text(conversation, load_chat_template(chat_template), add_generation_prompt,
                                               continue_final_message, chat_template_kwargs, tools)
        images = load_images(sources, mm.allowed_local_media_path)
        return {"prompt": text, "multi_modal_data": {"image": images}, "add_special_tokens": False}

    def render_chat(self, conversation: ChatMessages, chat_template: str | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    tools: list[dict[str, Any]] | None = None,
                    chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of a conversation rendered with the model's (or the given) chat template."""
        return self._chat_renderer.render(conversation, load_chat_template(chat_template), add_generation_prompt,
                                          continue_final_message, chat_template_kwargs, tools)

    def _run(self, prompts: list[PromptType], params: list[SamplingParams], use_tqdm: bool,
             priority: list[int] | None, loras: list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        engine = self.llm_engine
        loras = loras or [None] * len(prompts)
        # Validate (and tokenize) everything before anything is scheduled; adapters load (and are checked) first.
        processed = [engine.processor.process(engine.next_request_id(), p, sp, priority=priority[i] if priority else 0,
                                              lora_request=loras[i])
                     for i, (p, sp) in enumerate(zip(prompts, params))]
        for lora in {lo.lora_int_id: lo for lo in loras if lo is not None}.values():
            engine.add_lora(lora)
        for text, req in processed:
            engine.add_processed_request(text, req)
        order = {req.request_id: i for i, (_, req) in enumerate(processed)}
        results: list[RequestOutput | None] = [None] * len(prompts)
        bar = tqdm(total=len(prompts), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[order[out.request_id]] = out
                        bar.update(1)
        finally:
            bar.close()
            if engine.has_unfinished_requests():  # interrupted: leave the engine clean
                engine.abort_request(list(order))
        return results  # type: ignore[return-value]
