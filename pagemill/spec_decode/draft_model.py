"""Draft tokens from a draft model: a smaller model with the target's tokenizer, or the target's own first layers.

The draft runs through the runner's machinery: the input batch's token ids, its block tables and the attention
backend, one batched forward per draft position. Its KV cache is indexed by the target's block ids (the scheduler
allocates the slots of the tokens it drafts as lookahead slots), so it needs no block manager of its own:
- a separate draft model has its own KV tensors; it recomputes, on its next proposal, every position from the first
  one it has not computed for committed tokens (after a rejection, the positions of the rejected drafts);
- the target's first N layers (`draft_num_layers` without `model`) share the target's KV cache: the target wrote
  those layers' KV of every committed token, so the draft only computes the new ones. It writes KV only at positions
  past the committed tokens, which the target overwrites when it computes them.
Drafts are greedy (the draft's argmax): one-hot draft distributions, for which the rejection sampler is exact.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from pagemill.attention.backend import batch_permutation
from pagemill.attention.kv_quant import row_width
from pagemill.config import SpeculativeConfig
from pagemill.forward_context import set_forward_context
from pagemill.loader.model_loader import load_model
from pagemill.spec_decode.proposer import DraftRequests
from pagemill.utils.memory import lazy_zeros

logger = logging.getLogger(__name__)


class DraftModelProposer:
    """Proposes draft tokens with a draft model run batched over the requests that want them (a DraftProposer)."""

    def __init__(self, config: SpeculativeConfig, runner: Any) -> None:
        self.runner = runner
        target_layers = len(runner.model.attention_layers())
        if config.model is None:
            if config.draft_num_layers is None or config.draft_num_layers >= target_layers:
                raise ValueError("speculative_config with method 'draft_model' needs `model` (a smaller model with the "
                                 f"target's tokenizer) or `draft_num_layers` < the target's {target_layers} layers.")
            self.model = runner.model
            self.shares_target_kv = True
        else:
            self.model = self._load(config.model, runner)
            self.shares_target_kv = False
        self.num_layers = config.draft_num_layers
        if not hasattr(self.model, "model") or not hasattr(self.model.model, "layers"):
            raise ValueError(f"speculative_config: {type(self.model).__name__} cannot serve as a draft model.")
        self.computed: dict[str, int] = {}  # request -> committed positions whose draft KV is valid (own cache)
        logger.info("Draft model: %s, %s layers, %s KV cache", config.model or "the target",
                    self.num_layers or "all", "the target's" if self.shares_target_kv else "its own")

    def _load(self, model: str, runner: Any) -> torch.nn.Module:
        """Load a separate draft model (its KV tensors come with `initialize_kv_cache`)."""
        mc = runner.config.model_config
        # resolved with the engine's configuration (engine/arg_utils.py): its dtype and context length
        draft_config = runner.config.speculative_config.draft_model_config
        if draft_config is None:
            raise ValueError(f"speculative_config.model {model!r}: its draft_model_config is missing (build the engine "
                             "configuration with EngineArgs.create_engine_config, which resolves it).")
        if draft_config.hf_config.vocab_size != mc.hf_config.vocab_size:
            raise ValueError(f"speculative_config.model {model!r} has a vocabulary of "
                             f"{draft_config.hf_config.vocab_size} tokens, the target {mc.hf_config.vocab_size}: the "
                             "draft model must share the target's tokenizer.")
        if len(runner.kv_groups) != 1:
            raise ValueError("speculative_config.model: a separate draft model needs a target with one KV cache group "
                             "(no sliding-window layers); use draft_num_layers for this target.")
        draft = load_model(draft_config, runner.ops, runner.backend)
        if any(layer.sliding_window is not None for layer in draft.attention_layers()):
            raise ValueError(f"speculative_config.model {model!r} has sliding-window layers, which a draft model "
                             "may not have.")
        return draft

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """A separate draft model's KV tensors, `num_blocks` blocks indexed by the target's block ids (registered
        with the runner, so that copy-on-write copies apply to them too); the target's own when it shares them."""
        if self.shares_target_kv:
            return
        runner = self.runner
        draft_config = runner.config.speculative_config.draft_model_config
        layers = self.model.attention_layers()
        shape = runner.backend.kv_cache_shape(num_blocks, runner.block_size, draft_config.num_kv_heads,
                                              row_width(draft_config.head_dim, runner.kv_dtype))
        cache = lazy_zeros((len(layers), *shape), runner.kv_dtype)
        for layer, layer_cache in zip(layers, cache.unbind(0)):
            layer.kv_cache, layer.kv_cache_group = layer_cache, 0
        runner.extra_kv_caches.append(cache)

    def remove_request(self, req_id: str, finished: bool) -> None:
        """Forget the request's draft KV progress (after preemption its blocks are new: recompute from the start)."""
        self.computed.pop(req_id, None)

    def propose(self, requests: DraftRequests) -> list[list[int]]:
        """Up to max_tokens[i] greedy draft tokens for each request, one batched forward per position. Drafts are
        written into the batch's token ids after each request's tokens (scratch space until verified)."""
        req_ids, rows, rooms = requests.req_ids, requests.rows, requests.max_tokens
        num_tokens = requests.num_tokens.copy()
        if self.shares_target_kv:
            start = num_tokens - 1
        else:
            start = np.fromiter((self.computed.get(r, 0) for r in req_ids), dtype=np.int64, count=len(req_ids))
            for rid, n in zip(req_ids, num_tokens.tolist()):
                self.computed[rid] = n
        drafts: list[list[int]] = [[] for _ in req_ids]
        live = np.arange(len(req_ids))
        counts = num_tokens - start
        for j in range(int(rooms.max())):
            live = live[rooms[live] > j]
            if j > 0:
                start, counts = num_tokens[live] + j - 1, np.ones(len(live), dtype=np.int64)
            tokens = self._forward(rows[live], start, counts)
            requests.token_ids[rows[live], num_tokens[live] + j] = tokens
            for i, t in zip(live.tolist(), tokens.tolist()):
                drafts[i].append(t)
        return drafts

    def _forward(self, rows: np.ndarray, start: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """The draft's argmax after counts[i] tokens of row rows[i] from position start[i] (their KV written)."""
        runner = self.runner
        order = batch_permutation(counts, start, runner.backend.batch_order)
        md, input_ids, positions, cu = runner.attn_inputs(rows[order], start[order], counts[order])
        metadata = [runner.backend.build_metadata(m) for m in md]
        with set_forward_context(metadata, runner.lora_mapping(rows[order], counts[order])):
            hidden = self.model.model(input_ids, positions, self.num_layers)
        logits = self.model.compute_logits(hidden[torch.from_numpy(cu - 1)])
        tokens = np.empty(len(rows), dtype=np.int64)
        tokens[order] = logits.argmax(dim=-1).numpy()
        return tokens
