"""Model runners of pooling models: each step's requests are pooled (one vector each) instead of sampled.

- `EncoderModelRunner` (BERT): no KV cache at all. The scheduler gives each request its whole prompt in one step;
  the tokens of the step's requests are flattened and attend bidirectionally within their own request.
- `DecoderPoolingRunner` (a decoder used as an embedder): the generate runner's paged-KV forward, pooled instead
  of sampled. Chunked prefill stays on: the pooler adds up a request's chunks (MEAN) or keeps its first / last
  token (CLS / LAST), so a long prompt spans steps like any other. Prefix caching is off for pooling models
  (EngineArgs), so every token's hidden state is computed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pagemill.attention.selector import get_attn_backend
from pagemill.config import EngineConfig
from pagemill.core.kv_cache_utils import KVCacheConfig
from pagemill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagemill.distributed.parallel_state import ParallelContext
from pagemill.forward_context import set_forward_context
from pagemill.kernels.ops import select_layer_ops
from pagemill.layers.encoder_attention import EncoderAttentionMetadata
from pagemill.layers.pooler import PoolChunk, Pooler
from pagemill.loader.model_loader import load_model
from pagemill.pooling_params import PoolingParams
from pagemill.worker.model_runner import ModelRunner, StepInputs
from pagemill.worker.step_timer import StepTimer


def make_model_runner(config: EngineConfig, parallel: ParallelContext | None = None) -> Any:
    """The runner for the engine's model: generate, decoder pooling or encoder pooling; `parallel`: this worker's
    tensor / pipeline ranks (the config checks keep every runner but the generate one to a single rank)."""
    pooler_config = config.model_config.pooler_config
    if config.cache_config.kv_cache_layout == "virtual":
        if pooler_config is not None:
            raise ValueError("kv_cache_layout='virtual' applies to generating models, not to the pooling runner.")
        from pagemill.worker.virtual_kv_runner import VirtualKVModelRunner

        return VirtualKVModelRunner(config, parallel)
    if pooler_config is None:
        return ModelRunner(config, parallel)
    if pooler_config.encoder_only:
        return EncoderModelRunner(config, parallel)
    return DecoderPoolingRunner(config, parallel)


class DecoderPoolingRunner(ModelRunner):
    """A decoder model's hidden states (after its final norm) pooled per request, across its prefill chunks."""

    def __init__(self, config: EngineConfig, parallel: ParallelContext | None = None) -> None:
        super().__init__(config, parallel)
        self.pooler = Pooler(config.model_config.pooler_config)
        self._params: dict[str, PoolingParams] = {}

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in (*so.finished_req_ids, *so.preempted_req_ids):  # a preempted request restarts from token 0
            self.pooler.drop(rid)
            self._params.pop(rid, None)
        for new in so.scheduled_new_reqs:
            if new.pooling_params is None:
                raise ValueError(f"request {new.req_id!r} has no pooling_params: this engine only pools.")
            self._params[new.req_id] = new.pooling_params
        super()._update_states(so)

    def _sample(self, hidden: torch.Tensor, step: StepInputs, so: SchedulerOutput) -> ModelRunnerOutput:
        """Pool instead of sampling: the requests whose prompt ends in this step get their vector."""
        num_prompt = self.input_batch.num_prompt_tokens[step.rows]
        chunks = [PoolChunk(rid, int(step.starts[i]), int(step.counts[i]), bool(step.computed[i] == 0),
                            bool(step.seq_lens[i] >= num_prompt[i]), self._params[rid])
                  for i, rid in enumerate(step.req_ids)]
        with self.profiler.section("pool"):
            return ModelRunnerOutput({}, pooler_output=self.pooler(hidden, chunks))


class EncoderModelRunner:
    """Owns an encoder-only model and its pooler; no KV cache, no persistent batch (requests live one step)."""

    def __init__(self, config: EngineConfig, parallel: ParallelContext | None = None) -> None:
        self.config = config
        self.backend = get_attn_backend(config.attention_backend)  # (the layers' context names one; BERT's is its own)
        self.profiler = StepTimer(config.profile)
        self.lora_manager = None  # (LoRA is refused for pooling models)

    def load_model(self) -> None:
        """Load the encoder and its pooler (with the model's classifier head, if it has one)."""
        mc = self.config.model_config
        self.model = load_model(mc, select_layer_ops(self.backend.name), self.backend)
        if self.model.attention_layers():
            raise ValueError(f"{type(self.model).__name__} has KV-cache attention layers: not an encoder-only model.")
        classify: Callable[[torch.Tensor], torch.Tensor] | None = getattr(self.model, "classify", None)
        self.pooler = Pooler(mc.pooler_config, classify)

    def kv_block_bytes(self) -> int:
        """No KV cache: a block costs nothing."""
        return 0

    def cap_num_blocks(self, num_blocks: int) -> int:
        """No KV cache: only the null block."""
        return 1

    def initialize_kv_cache(self, num_blocks: int) -> KVCacheConfig:
        """No KV cache groups: the scheduler allocates no blocks (block 0, the null block, is all there is)."""
        self.kv_cache_config = KVCacheConfig(1, self.config.cache_config.block_size, 0, ())
        return self.kv_cache_config

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Forward the step's requests (each whole) and pool them; the section timings come back too."""
        out = self._execute(so)
        out.timings = self.profiler.take()
        return out

    @torch.inference_mode()
    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        reqs = so.scheduled_new_reqs
        if so.scheduled_cached_reqs or any(so.num_scheduled_tokens[r.req_id] != len(r.token_ids) for r in reqs):
            raise RuntimeError("an encoder-only step must compute whole prompts of new requests only.")
        if not reqs:
            return ModelRunnerOutput({})
        with self.profiler.section("prepare"):
            counts = np.fromiter((len(r.token_ids) for r in reqs), dtype=np.int64, count=len(reqs))
            starts = np.cumsum(counts) - counts
            total = int(counts.sum())
            input_ids = torch.from_numpy(np.concatenate([np.asarray(r.token_ids, dtype=np.int64) for r in reqs]))
            positions = torch.from_numpy(np.arange(total, dtype=np.int64) - np.repeat(starts, counts))
            token_type_ids = None
            if any(r.token_type_ids for r in reqs):
                token_type_ids = torch.from_numpy(np.concatenate([
                    np.asarray(r.token_type_ids, dtype=np.int64) if r.token_type_ids
                    else np.zeros(len(r.token_ids), dtype=np.int64) for r in reqs]))
            metadata = EncoderAttentionMetadata.build(counts)
        with self.profiler.section("forward"), set_forward_context([metadata]):
            hidden = self.model(input_ids, positions, token_type_ids)
        chunks = [PoolChunk(r.req_id, int(s), int(n), True, True, r.pooling_params)
                  for r, s, n in zip(reqs, starts, counts)]
        with self.profiler.section("pool"):
            return ModelRunnerOutput({}, pooler_output=self.pooler(hidden, chunks))
