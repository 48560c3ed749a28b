"""The model runner: turns a SchedulerOutput into one forward pass and sampled tokens."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagemill.attention.backend import batch_permutation
from pagemill.attention.kv_quant import resolve_kv_cache_dtype, row_width
from pagemill.attention.metadata import CommonAttentionMetadata
from pagemill.attention.selector import get_attn_backend
from pagemill.config import EngineConfig
from pagemill.core.kv_cache_utils import KVCacheConfig, kv_cache_groups
from pagemill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagemill.distributed.kv_transfer.base import ALL_LAYERS, KVConnectorRole
from pagemill.distributed.kv_transfer.factory import KVConnectorFactory
from pagemill.distributed.parallel_state import ParallelContext
from pagemill.forward_context import set_forward_context
from pagemill.kernels.ops import select_layer_ops
from pagemill.layers.batch_invariant import make_batch_invariant
from pagemill.layers.head_screen import GreedyHeadScreen
from pagemill.loader.model_loader import load_model
from pagemill.lora.layers import LoRAMapping
from pagemill.lora.model_manager import LoRAModelManager
from pagemill.messages import LogprobsLists
from pagemill.sample.metadata import SamplingMetadata
from pagemill.sample.rejection_sampler import rejection_sample
from pagemill.sample.sampler import Sampler, gather_logprobs
from pagemill.spec_decode.proposer import DraftProposer, DraftRequests
from pagemill.spec_decode.select import make_proposer
from pagemill.utils.memory import lazy_zeros
from pagemill.worker.cpu_decoder_graph import CpuDecoderGraph
from pagemill.worker.encoder_cache import EncoderCache
from pagemill.worker.mrope_state import MRopeState
from pagemill.worker.step_timer import StepTimer

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    """One step's flattened batch: model inputs plus the per-request arrays sampling needs."""

    attn_metadata: list[CommonAttentionMetadata]  # one per KV cache group
    input_ids: torch.Tensor
    positions: torch.Tensor
    req_ids: list[str]  # in batch order
    rows: np.ndarray  # input-batch row of each request
    counts: np.ndarray  # tokens scheduled per request
    computed: np.ndarray  # tokens cached before the step
    starts: np.ndarray  # first token index of each request
    cu: np.ndarray  # cumulative token counts
    seq_lens: np.ndarray  # tokens cached after the step


class ModelRunner:
    """Owns the model, the paged KV cache and the persistent input batch: a step in, sampled tokens out.

    Built in the worker's steps (worker/cpu_worker.py): __init__ (attention backend, layer ops), `load_model`,
    `kv_block_bytes` / `cap_num_blocks` (the worker sizes the cache), `initialize_kv_cache(num_blocks)`."""

    def __init__(self, config: EngineConfig, parallel: ParallelContext | None = None) -> None:
        self.config = config
        self.parallel = parallel or ParallelContext()  # this worker's tensor / pipeline ranks
        mc, cc = config.model_config, config.cache_config
        self.backend = get_attn_backend(config.attention_backend, config.batch_invariant,
                                        config.cache_config.kv_cache_layout)
        # attention_backend="torch" selects the pure-torch reference for the fused layer ops too.
        self.ops = select_layer_ops(self.backend.name)  # the platform's table for this attention backend
        self.vocab_size = mc.hf_config.vocab_size
        self.block_size = cc.block_size
        self.kv_dtype = resolve_kv_cache_dtype(cc.kv_cache_dtype, mc.dtype, self.backend)
        self.profiler = StepTimer(config.profile)  # its timings go back in ModelRunnerOutput.timings
        # A multimodal model's image embeddings, encoded once per (request, image).
        self.encoder_cache = EncoderCache() if mc.is_multimodal else None
        self.mrope: MRopeState | None = None  # set in load_model for an M-RoPE model (Qwen2-VL family)
        self.decoder_graph: CpuDecoderGraph | None = None  # recorded once the KV cache is bound (CPU, small steps)
        self.image_spans = False  # set in load_model: the model's image tokens attend to their whole image

    def load_model(self) -> None:
        """Load the model (this rank's share), wrap it for batch invariance and LoRA, group its KV layers."""
        config, ops = self.config, self.ops
        mc = config.model_config
        self.model = load_model(mc, ops, self.backend, self.parallel)
        if getattr(self.model, "uses_mrope", False):
            self.mrope = MRopeState(self.model)
        self.image_spans = bool(getattr(self.model, "bidirectional_image_attention", False))
        if self.image_spans and not self.backend.capabilities.key_limits:
            raise ValueError(f"attention_backend: {type(self.model).__name__}'s image tokens attend to their whole "
                             f"image, which the {self.backend.name} backend cannot do (the cpu and torch ones can).")
        if config.batch_invariant:
            logger.info("Batch-invariant mode: %d linear layers on fixed-order kernels",
                        make_batch_invariant(self.model, ops))
        # LoRA: the model's linears wrapped with stacked adapter slots (before a draft model shares the layers).
        self.lora_manager = (LoRAModelManager(self.model, config.lora_config, ops)
                             if config.lora_config else None)
        layers = self.model.attention_layers()
        self.num_kv_heads = layers[0].num_kv_heads  # this rank's share (tensor parallelism)
        self.kv_groups = kv_cache_groups([layer.sliding_window for layer in layers], mc.max_model_len)
        # Layers per group: one KV tensor per position in a group serves one layer of every group.
        self.group_size = max(len(ids) for _, ids in self.kv_groups)
        if config.kv_transfer_config is not None and len(self.kv_groups) != 1:
            raise ValueError("kv_transfer_config: KV connectors move models with one KV cache group (no "
                             "sliding-window layers) yet.")
        # Speculative decoding: what proposes the next step's draft tokens (None: no speculation); a draft model is
        # loaded here, its KV tensors come with the target's (initialize_kv_cache).
        self.proposer: DraftProposer | None = (make_proposer(config.speculative_config, self)
                                               if config.speculative_config else None)
        self.sampler = Sampler(ops)
        self.head_screen = None
        if config.greedy_head_screen:
            self.head_screen = GreedyHeadScreen.for_head(getattr(self.model, "lm_head", None), ops)
            if self.head_screen is not None:
                logger.info("Greedy head screen: int8 copy of the LM head, %.1f MiB",
                            self.head_screen.nbytes / 2**20)

    def kv_block_bytes(self) -> int:
        """Bytes of one KV block over every layer position (K and V): what the worker divides its KV memory by."""
        mc = self.config.model_config
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()  # quantized: 1 byte, + its scale per row
        row = row_width(mc.head_dim, self.kv_dtype)
        return self.group_size * 2 * self.block_size * self.num_kv_heads * row * elem

    def cap_num_blocks(self, num_blocks: int) -> int:
        """The most of `num_blocks` this runner's KV layout can hold (the paged layout: all of them)."""
        return num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> KVCacheConfig:
        """Allocate `num_blocks` KV blocks (and the swap space, a draft model's KV), bind them to the layers, build the
        input batch and the KV connector's worker side; returns what the engine core schedules over."""
        config = self.config
        mc, cc = config.model_config, config.cache_config
        groups = self.kv_groups
        self.num_blocks = num_blocks
        shape = self.backend.kv_cache_shape(num_blocks, cc.block_size, self.num_kv_heads,
                                            row_width(mc.head_dim, self.kv_dtype))
        # One allocation for all layers, so a copy-on-write of blocks is one indexed copy for every layer.
        self.kv_cache = self._allocate_kv_cache((self.group_size, *shape))
        self.kv_caches = list(self.kv_cache.unbind(0))
        # Caches indexed by the same block ids (a draft model's): copy-on-write copies apply to them too.
        self.extra_kv_caches: list[torch.Tensor] = []
        per_block = self.kv_cache[:, :, 0].numel() * self.kv_cache.element_size()
        num_swap_blocks = int(cc.swap_space // per_block) if config.scheduler_config.preemption_mode == "swap" else 0
        # Host swap space for preempted requests' blocks (pages are only touched when used).
        swap_shape = (self.group_size, 2, num_swap_blocks, *shape[2:])
        self.swap_cache = torch.empty(swap_shape, dtype=self.kv_dtype) if num_swap_blocks else None
        # What the engine core builds the scheduler from (the config stays read-only).
        self.kv_cache_config = KVCacheConfig(num_blocks, cc.block_size, num_swap_blocks,
                                             tuple(w for w, _ in groups), block_bytes=per_block)
        logger.info("KV cache (%s): %d blocks of %d tokens x %d layers in %d groups (windows %s) = %d tokens "
                    "(%.2f GiB), %d swap blocks", cc.kv_cache_dtype if cc.kv_cache_dtype != "auto" else self.kv_dtype,
                    self.kv_cache_config.usable_blocks, cc.block_size, self.group_size,
                    len(groups), self.kv_cache_config.group_windows, self.kv_cache_config.usable_tokens,
                    num_blocks * per_block / 2**30, num_swap_blocks)
        layers = self.model.attention_layers()
        for g, (_, layer_ids) in enumerate(groups):
            for pos, i in enumerate(layer_ids):
                layers[i].kv_cache, layers[i].kv_cache_group = self.kv_caches[pos], g
        self.decoder_graph = self._record_decoder_graph()
        from pagemill.worker.input_batch import InputBatch

        self.input_batch = InputBatch(config.scheduler_config.max_num_seqs, mc.max_model_len, cc.block_size,
                                      len(groups))
        if self.proposer is not None:  # a draft model: its KV indexed by the same block ids
            self.proposer.initialize_kv_cache(num_blocks)
        # The worker side of a KV connector: loads external KV before the forward, saves computed KV after it.
        self.kv_connector = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER)
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(self.kv_cache)
        return self.kv_cache_config

    def _allocate_kv_cache(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The KV tensor of every layer position, [group_size, *backend shape] (committed page by page)."""
        return lazy_zeros(shape, self.kv_dtype)

    # ---- per step ----
    def _update_states(self, so: SchedulerOutput) -> None:
        ib = self.input_batch
        for rid in so.finished_req_ids:
            ib.remove_request(rid)
            if self.encoder_cache is not None:
                self.encoder_cache.free(rid)
            if self.mrope is not None:
                self.mrope.free(rid)
            if self.proposer is not None:
                self.proposer.remove_request(rid, finished=True)
        for rid in so.preempted_req_ids:
            ib.remove_request(rid)
            if self.proposer is not None:
                self.proposer.remove_request(rid, finished=False)
        for new in so.scheduled_new_reqs:
            ib.add_request(new)
            if self.encoder_cache is not None:
                self.encoder_cache.add_request(new.req_id, new.mm_features)
            if self.mrope is not None:
                self.mrope.add(new.req_id, new.num_prompt_tokens, new.mm_features)
        for c in so.scheduled_cached_reqs:
            row = ib.req_id_to_row[c.req_id]
            if c.num_blocks_kept is not None:
                ib.num_blocks[row] = c.num_blocks_kept
            if c.replaced_block_ids:
                for group, idx, block_id in c.replaced_block_ids:
                    ib.block_table[group, row, idx] = block_id
            ib.append_blocks(row, c.new_block_ids)
            ib.num_computed_tokens[row] = c.num_computed_tokens
        for rid, drafts in so.scheduled_spec_decode_tokens.items():  # inputs after the request's last token
            row = ib.req_id_to_row[rid]
            n = int(ib.num_tokens[row])
            ib.token_ids[row, n:n + len(drafts)] = drafts
        if so.blocks_to_swap_out:  # before anything can overwrite the freed blocks
            kv_ids, swap_ids = (torch.tensor(x) for x in zip(*so.blocks_to_swap_out))
            self.swap_cache[:, :, swap_ids] = self.kv_cache[:, :, kv_ids.to(self.kv_cache.device)].to(
                self.swap_cache.device)
        if so.blocks_to_swap_in:
            swap_ids, kv_ids = (torch.tensor(x) for x in zip(*so.blocks_to_swap_in))
            self.kv_cache[:, :, kv_ids.to(self.kv_cache.device)] = self.swap_cache[:, :, swap_ids].to(
                self.kv_cache.device, non_blocking=True)
        if so.blocks_to_copy:
            src, dst = (torch.tensor(x) for x in zip(*so.blocks_to_copy))
            for cache in (self.kv_cache, *self.extra_kv_caches):
                cache[:, :, dst] = cache[:, :, src]

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; the output carries the sampled tokens and this step's section timings."""
        out = self._execute(so)
        out.timings = self.profiler.take()
        return out

    @torch.inference_mode()
    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Build inputs from the persistent batch, forward, sample."""
        prof = self.profiler
        with prof.section("prepare"):
            self._update_states(so)
        connector = self.kv_connector if so.kv_connector_metadata is not None else None
        if connector is not None:  # the step's external KV into its blocks, before anything reads them
            with prof.section("kv_load"):
                connector.bind_connector_metadata(so.kv_connector_metadata)
                connector.start_load_kv()
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput({})
        with prof.section("prepare"):
            step = self._prepare(so)
        if self.encoder_cache and self.image_spans:  # image tokens that see their whole image
            limits = self.encoder_cache.key_limits(step.req_ids, step.computed, step.counts, step.starts)
            for md in step.attn_metadata:
                md.key_limits = limits
        metadata = [self.backend.build_metadata(md) for md in step.attn_metadata]
        start = time.perf_counter()
        if self.encoder_cache:  # the step's image placeholders: their embeddings merged into the inputs
            with prof.section("encode"):
                embeds = self._merged_embeddings(step)
        else:
            embeds = None
        with prof.section("forward"):
            hidden = self._forward(step, metadata, embeds)
        if connector is not None:  # (our models never see block tables: every layer is saved at once, after)
            with prof.section("kv_save"):
                connector.save_kv_layer(ALL_LAYERS, self.kv_cache)
                connector.wait_for_save()
                connector.clear_connector_metadata()
        if not self.parallel.is_last_stage:  # the hidden states went on to the next pipeline stage
            return ModelRunnerOutput({})
        out = self._sample(hidden, step, so)
        if self.proposer is not None:
            target = out.target_seconds = time.perf_counter() - start
        if so.num_spec_tokens_to_propose and self.proposer is not None:
            with prof.section("propose"):
                positions = self._propose(out, so.num_spec_tokens_to_propose)
            if positions:
                out.draft_cost = (time.perf_counter() - start - target) / (positions * target)
        return out

    def _forward(self, step: StepInputs, metadata: list, embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The model's forward over the step (the GPU runner replays a CUDA graph here where it can); `embeds`: the
        input embeddings with a multimodal step's image embeddings merged in (None: from the ids)."""
        positions = step.positions
        if self.mrope is not None:
            positions = self.mrope.positions(step.req_ids, positions.numpy(), step.computed, step.counts, step.starts)
        graph = self.decoder_graph
        if graph is not None and graph.applies(metadata, len(positions)):  # (never recorded for multimodal models)
            return graph.run(step.input_ids, positions, metadata)
        with set_forward_context(metadata, self.lora_mapping(step.rows, step.counts)):
            if embeds is None:
                return self.model(step.input_ids, positions)
            return self.model(step.input_ids, positions, inputs_embeds=embeds)

    def _record_decoder_graph(self) -> CpuDecoderGraph | None:
        """The CPU decoder graph of the model with its KV caches bound (None: steps run module by module): off with
        enforce_eager, LoRA, batch invariance or a multimodal model, and where the model does not qualify."""
        config = self.config
        if (config.device_config.enforce_eager or self.lora_manager is not None or config.batch_invariant
                or self.encoder_cache is not None or self.mrope is not None):
            return None
        return CpuDecoderGraph.build(self.model, self.ops)

    def _merged_embeddings(self, step: StepInputs) -> torch.Tensor | None:
        """The step's input embeddings with the image embeddings at their placeholder tokens (None: the step
        computes no placeholder token)."""
        mm = self.encoder_cache.gather(self.model, step.req_ids, step.computed, step.counts, step.starts)
        if mm is None:
            return None
        index, rows = mm
        embeds = self.model.embed_input_ids(step.input_ids)
        embeds[index] = rows.to(embeds.dtype)
        return embeds

    def apply_sampled(self, sampled: dict[str, list[int]], appended: bool) -> None:
        """The engine's tokens of the previous step, on a worker whose own are not the engine's (tensor / pipeline
        parallelism): written over the ones it sampled itself (`appended`), else appended."""
        ib = self.input_batch
        for rid, toks in sampled.items():
            row = ib.req_id_to_row.get(rid)
            if row is None:
                continue
            end = int(ib.num_tokens[row]) + (0 if appended else len(toks))
            ib.token_ids[row, end - len(toks):end] = toks
            ib.num_tokens[row] = end

    def _prepare(self, so: SchedulerOutput) -> StepInputs:
        """Flattened input ids, positions and attention metadata for the step (vectorised numpy)."""
        ib = self.input_batch
        req_ids = list(so.num_scheduled_tokens)
        counts = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))
        rows = np.fromiter((ib.req_id_to_row[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        order = batch_permutation(counts, ib.num_computed_tokens[rows], self.backend.batch_order,
                                  ib.lora_ids[rows] if self.lora_manager is not None else None)
        counts, rows = counts[order], rows[order]
        req_ids = [req_ids[i] for i in order]
        computed = ib.num_computed_tokens[rows]
        md, input_ids, positions, cu = self.attn_inputs(rows, computed, counts)
        seq_lens = computed + counts
        ib.num_computed_tokens[rows] = seq_lens
        return StepInputs(md, input_ids, positions, req_ids, rows, counts, computed, cu - counts, cu, seq_lens)

    def attn_inputs(self, rows: np.ndarray, computed: np.ndarray, counts: np.ndarray
                    ) -> tuple[list[CommonAttentionMetadata], torch.Tensor, torch.Tensor, np.ndarray]:
        """(attention metadata per KV cache group, input ids, positions, cumulative counts) for `counts[i]` tokens
        of input-batch row `rows[i]` from position `computed[i]` on, read from the batch's token ids (a draft
        model's steps use it too). Rows are in the backend's batch order."""
        ib = self.input_batch
        num_reqs = len(rows)
        cu = np.cumsum(counts)
        starts = cu - counts
        total = int(cu[-1])
        req_idx = np.repeat(np.arange(num_reqs), counts)
        positions = (computed[req_idx] + (np.arange(total) - starts[req_idx])).astype(np.int64, copy=False)
        token_rows = rows[req_idx]
        input_ids = ib.token_ids[token_rows, positions]
        bs = self.block_size
        # [groups, T]; C order, so each group's row is contiguous (numpy's fancy indexing may return it transposed)
        slot_mapping = np.ascontiguousarray(ib.block_table[:, token_rows, positions // bs] * bs + positions % bs)
        seq_lens = computed + counts
        max_blocks = int(ib.num_blocks[rows].max())
        tables = np.ascontiguousarray(ib.block_table[:, rows, :max_blocks])
        qsl, num_decodes = np.concatenate([[0], cu]), int((counts == 1).sum())
        md = [CommonAttentionMetadata(
            num_reqs=num_reqs, num_decodes=num_decodes, num_actual_tokens=total, query_start_loc=qsl,
            seq_lens=seq_lens, num_computed_tokens=computed, block_table=tables[g], block_size=bs,
            slot_mapping=torch.from_numpy(slot_mapping[g]), rows=rows) for g in range(len(tables))]
        return md, torch.from_numpy(input_ids), torch.from_numpy(positions), cu

    def lora_mapping(self, rows: np.ndarray, counts: np.ndarray) -> LoRAMapping | None:
        """The LoRA mapping of a forward over `counts[i]` tokens of input-batch row `rows[i]` (None: LoRA is off or
        no row uses an adapter)."""
        if self.lora_manager is None:
            return None
        ib = self.input_batch
        ids = ib.lora_ids[rows]
        if not ids.any():
            return None
        return self.lora_manager.mapping(np.repeat(ids, counts), ib.lora_requests)

    def _sample(self, hidden: torch.Tensor, step: StepInputs, so: SchedulerOutput) -> ModelRunnerOutput:
        """Logits for the requests that reached the end of their tokens, structured-output masks, sampling (or
        verification of draft tokens), logprobs."""
        ib = self.input_batch
        req_ids, rows, counts, computed, starts, cu, seq_lens = (step.req_ids, step.rows, step.counts, step.computed,
                                                                 step.starts, step.cu, step.seq_lens)
        out = ModelRunnerOutput({})
        prof = self.profiler
        grammar = so.grammar
        spec = so.scheduled_spec_decode_tokens
        with prof.section("logits"):  # model compute (LM head), not engine overhead
            self._prompt_logprobs(out, req_ids, rows, computed, counts, starts, hidden)
        sample_idx = np.nonzero(seq_lens >= ib.num_tokens[rows])[0]
        if len(sample_idx) == 0:
            return out
        self.sampler.bitmask_seconds = 0.0
        if spec:
            self._verify(out, hidden, step, sample_idx, spec, grammar)
        else:
            self._sample_one(out, hidden, step, sample_idx, grammar)
        if prof.enabled and self.sampler.bitmask_seconds:  # the mask's application counts as grammar, not sample
            prof.timings["sample"] -= self.sampler.bitmask_seconds
            prof.timings["grammar"] = prof.timings.get("grammar", 0.0) + self.sampler.bitmask_seconds
        return out

    def _sample_one(self, out: ModelRunnerOutput, hidden: torch.Tensor, step: StepInputs, sample_idx: np.ndarray,
                    grammar: Any = None) -> None:
        """A step without draft tokens: one token for each request that reached the end of its tokens."""
        prof = self.profiler
        req_ids, rows, cu = step.req_ids, step.rows, step.cu
        sample_rows = rows[sample_idx]
        first_row = {req_ids[i]: j for j, i in enumerate(sample_idx.tolist())} if grammar is not None else {}
        logits, tokens, mask = self._logits_and_mask(hidden[torch.from_numpy(cu[sample_idx] - 1)], sample_rows,
                                                     grammar, first_row)
        with prof.section("sample"):
            raw_lp = None
            if tokens is None:  # else every row needed only the (allowed tokens') argmax: the screen gave it
                smd = self._sampling_metadata(sample_rows)
                if mask is not None:
                    smd.token_bitmask, smd.bitmask_rows = mask
                tokens, raw_lp = self.sampler(logits, smd)
            self._record_sampled(out, tokens, raw_lp, sample_idx, sample_rows, req_ids)

    def _record_sampled(self, out: ModelRunnerOutput, tokens: torch.Tensor, raw_lp: torch.Tensor | None,
                        sample_idx: np.ndarray, sample_rows: np.ndarray, req_ids: list[str]) -> None:
        """The step's sampled tokens to the host: into the output and the input batch, with their logprobs."""
        token_list = tokens.cpu().tolist()  # (.cpu() waits for the device with the GIL released)
        out.sampled.update(zip([req_ids[i] for i in sample_idx.tolist()], [[t] for t in token_list]))
        self.input_batch.append_tokens(sample_rows, np.asarray(token_list, dtype=np.int64))
        if raw_lp is not None:
            self._sample_logprobs(out, raw_lp, tokens, sample_idx, sample_rows, req_ids)

    def _grammar_bitmask(self, grammar: Any, first_row: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Wait for the step's bitmask (filled during the forward): (bitmask, the logits row of each of its rows),
        given each constrained request's first logits row."""
        prof = self.profiler
        with prof.section("grammar"):
            bitmask = grammar.bitmask()
            rows = torch.tensor([first_row[r] + j for r, j in zip(grammar.req_ids, grammar.offsets)], dtype=torch.int64)
        if prof.enabled:
            prof.timings["grammar_fill"] = prof.timings.get("grammar_fill", 0.0) + grammar.fill_seconds
        return bitmask, rows

    def _verify(self, out: ModelRunnerOutput, hidden: torch.Tensor, step: StepInputs, sample_idx: np.ndarray,
                spec: dict[str, list[int]], grammar: Any = None) -> None:
        """A step with draft tokens: target logits at every draft position, the rejection sampler, logprobs.

        A request with k drafts has k + 1 logits rows (after its last token and after each draft); row j sees the
        first j drafts as outputs (penalties, min_tokens), so the full sampling pipeline applies at every position.
        A constrained request's rows take its grammar's masks after each draft (StructuredOutputManager._fill).
        """
        ib = self.input_batch
        prof = self.profiler
        req_ids, rows, cu = step.req_ids, step.rows, step.cu
        sample_rows = rows[sample_idx]
        drafts = [spec.get(req_ids[i], []) for i in sample_idx]
        num_rows = np.fromiter((len(d) + 1 for d in drafts), dtype=np.int64, count=len(drafts))
        row_start = np.cumsum(num_rows) - num_rows
        logit_req = np.repeat(np.arange(len(drafts)), num_rows)
        offsets = np.arange(int(num_rows.sum())) - row_start[logit_req]  # drafts before each logits row
        hidden_idx = cu[sample_idx][logit_req] - num_rows[logit_req] + offsets
        logit_rows = sample_rows[logit_req]
        logits, argmax, mask = self._logits_and_mask(
            hidden[torch.from_numpy(hidden_idx)], logit_rows, grammar,
            {req_ids[i]: int(row_start[j]) for j, i in enumerate(sample_idx)}, offsets)
        with prof.section("sample"):
            probs = raw_lp = None
            seeds = {}  # (argmax-only rows are greedy)
            if argmax is None:
                smd = self._sampling_metadata(logit_rows, offsets)
                if mask is not None:
                    smd.token_bitmask, smd.bitmask_rows = mask
                probs, argmax, raw_lp = self.sampler.target_probs(logits, smd)
                seeds = smd.seeds
            greedy = [ib.params[r].greedy for r in sample_rows]
            outputs = rejection_sample(drafts, probs, argmax, greedy, seeds)
            for j, i in enumerate(sample_idx):
                toks = outputs[j]
                out.sampled[req_ids[i]] = toks
                row = int(rows[i])
                n = int(ib.num_tokens[row])
                ib.token_ids[row, n:n + len(toks)] = toks  # (max_model_len bounds the drafts: no overflow)
                ib.num_tokens[row] = n + len(toks)
            if raw_lp is not None:
                self._verify_logprobs(out, raw_lp, outputs, row_start, sample_idx, sample_rows, req_ids)

    def _verify_logprobs(self, out: ModelRunnerOutput, raw_lp: torch.Tensor, outputs: list[list[int]],
                         row_start: np.ndarray, sample_idx: np.ndarray, sample_rows: np.ndarray,
                         req_ids: list[str]) -> None:
        """The target model's logprobs of each output token of a verification step (at the row that produced it)."""
        ib = self.input_batch
        want = [j for j, r in enumerate(sample_rows) if ib.params[r].logprobs is not None]
        if not want:
            return
        sel = np.concatenate([row_start[j] + np.arange(len(outputs[j])) for j in want])
        tokens = torch.tensor([t for j in want for t in outputs[j]], dtype=torch.int64)
        k = max(ib.params[sample_rows[j]].logprobs for j in want)
        ids, lps, ranks = (x.tolist() for x in gather_logprobs(raw_lp[torch.from_numpy(sel)], tokens, k))
        pos = 0
        for j in want:
            n, m = len(outputs[j]), ib.params[sample_rows[j]].logprobs
            out.logprobs[req_ids[sample_idx[j]]] = LogprobsLists([x[:m + 1] for x in ids[pos:pos + n]],
                                                                 [x[:m + 1] for x in lps[pos:pos + n]],
                                                                 ranks[pos:pos + n])
            pos += n

    def _propose(self, out: ModelRunnerOutput, wanted: dict[str, int]) -> int:
        """Draft tokens for the next step of each request the scheduler asked for, within its max_tokens and the
        context length (a request's last verification may end it at max_tokens exactly); returns the most draft
        positions asked of one request (a draft model's forwards run one per position)."""
        ib = self.input_batch
        max_len = self.config.model_config.max_model_len
        req_ids, rows, rooms = [], [], []
        for rid, k in wanted.items():
            if rid not in out.sampled:
                continue
            row = ib.req_id_to_row[rid]
            n, num_prompt = int(ib.num_tokens[row]), int(ib.num_prompt_tokens[row])
            max_tokens = ib.params[row].max_tokens
            room = min(k, max_len - n - 1)
            if max_tokens is not None:
                room = min(room, max_tokens - (n - num_prompt) - 1)
            if room > 0:
                req_ids.append(rid)
                rows.append(row)
                rooms.append(room)
        if not req_ids:
            return 0
        rows_ = np.array(rows, dtype=np.int64)
        drafts = self.proposer.propose(DraftRequests(req_ids, rows_, np.array(rooms, dtype=np.int64),
                                                     ib.num_tokens[rows_], ib.num_prompt_tokens[rows_], ib.token_ids))
        for rid, d in zip(req_ids, drafts):
            if d:
                out.draft_token_ids[rid] = d
        return max(rooms)

    def _logits_and_mask(self, hidden: torch.Tensor, rows: np.ndarray, grammar: Any, first_row: dict[str, int],
                         offsets: np.ndarray | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """The LM head over the logits rows of input-batch `rows` and the step's structured-output bitmask: (logits,
        their tokens when every row needs only the argmax else None, (bitmask, its logits rows) or None).

        The bitmask (filled while the model ran forward) is waited for before the head only when the greedy head
        screen takes a constrained row (the screen then takes the argmax over allowed tokens), else after it."""
        prof = self.profiler
        screened = self._screened_rows(rows, offsets)
        mask = None
        if grammar is not None and screened is not None:
            params = self.input_batch.params  # (a thinking budget can force a token: masked like a grammar)
            constrained = np.fromiter((params[r].structured_outputs is not None
                                       or params[r].thinking_token_budget is not None for r in rows),
                                      dtype=bool, count=len(rows))
            if (screened & constrained).any():
                mask = self._grammar_bitmask(grammar, first_row)
                has_mask = np.zeros(len(rows), dtype=bool)
                has_mask[mask[1].numpy()] = True
                screened &= ~constrained | has_mask  # (every constrained row that samples has a bitmask row)
                if screened.sum() < self.head_screen.min_rows:
                    screened = None
        with prof.section("logits"):  # model compute (LM head), not engine overhead
            logits, tokens = self._sample_logits(hidden, screened, mask)
        if grammar is not None and mask is None:
            mask = self._grammar_bitmask(grammar, first_row)
        return logits, tokens, mask

    def _screened_rows(self, rows: np.ndarray, offsets: np.ndarray | None = None) -> np.ndarray | None:
        """Which logits rows take the greedy head screen (those that need only the argmax), or None: the exact head
        for every row (no screen, or too few such rows for it to pay)."""
        if self.head_screen is None or len(rows) < self.head_screen.min_rows:
            return None
        argmax_only = self._argmax_only(rows, offsets)
        return argmax_only if argmax_only.sum() >= self.head_screen.min_rows else None

    def _sample_logits(self, hidden: torch.Tensor, screened: np.ndarray | None,
                       mask: tuple[torch.Tensor, torch.Tensor] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits of the rows to sample, their tokens when every row is `screened`, else None). Screened rows take
        the greedy head screen (exact token, approximate logits elsewhere; a constrained one's over its `mask` row's
        allowed tokens), the rest the exact head. `mask`: (bitmask, the logits row of each of its rows)."""
        if screened is None:
            return self.model.compute_logits(hidden), None
        bitmask = mask_rows = None
        if mask is not None:
            bitmask, bitmask_rows = mask
            index = torch.full((len(screened),), -1, dtype=torch.int64)
            index[bitmask_rows] = torch.arange(len(bitmask_rows))
            mask_rows = index if screened.all() else index[torch.from_numpy(screened)]
        if screened.all():
            return self.head_screen.logits(hidden, bitmask, mask_rows)
        rows = torch.from_numpy(screened)
        logits = torch.empty(len(screened), self.head_screen.table.shape[0], dtype=torch.float32)
        logits[rows] = self.head_screen.logits(hidden[rows], bitmask, mask_rows)[0]
        logits[~rows] = self.model.compute_logits(hidden[~rows]).float()
        return logits, None

    def _argmax_only(self, rows: np.ndarray, offsets: np.ndarray | None = None) -> np.ndarray:
        """Per row, whether sampling reads nothing but the argmax of the raw logits (over a grammar's allowed tokens
        for a constrained row): greedy, no logprobs, no penalties, no allowed-token list or bias, no min_tokens mask."""
        ib = self.input_batch
        num_out = ib.num_tokens[rows] - ib.num_prompt_tokens[rows] + (0 if offsets is None else offsets)
        return ib.argmax_sampling[rows] & (num_out >= ib.min_tokens_until[rows])

    def _sampling_metadata(self, rows: np.ndarray, offsets: np.ndarray | None = None) -> SamplingMetadata:
        """Sampling tensors for logits rows of input-batch `rows`; `offsets`: draft tokens (already written after
        each request's tokens) that count as outputs before each row (speculative decoding)."""
        ib = self.input_batch
        if self._argmax_only(rows, offsets).all():  # the common case at large batches: no per-row work
            n = len(rows)
            return SamplingMetadata(temperature=torch.ones(n), greedy_mask=torch.ones(n, dtype=torch.bool),
                                    all_greedy=True, top_p=None, top_k=None, min_p=None, seeds={})
        num_out = ib.num_tokens[rows] - ib.num_prompt_tokens[rows] + (0 if offsets is None else offsets)
        params = [ib.params[r] for r in rows]
        greedy = [p.greedy for p in params]
        temperature = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)])
        use_top_k = any(p.top_k > 0 for p in params)
        use_top_p = any(p.top_p < 1.0 for p in params)
        use_min_p = any(p.min_p > 0.0 for p in params)
        seeds = {j: (ib.seeds[r], int(num_out[j])) for j, r in enumerate(rows) if r in ib.seeds}
        lp = [p.logprobs for p in params if p.logprobs is not None]
        md = SamplingMetadata(
            temperature=temperature, greedy_mask=torch.tensor(greedy), all_greedy=all(greedy),
            top_p=torch.tensor([p.top_p for p in params]) if use_top_p else None,
            top_k=torch.tensor([p.top_k for p in params]) if use_top_k else None,
            min_p=torch.tensor([p.min_p for p in params]) if use_min_p else None,
            seeds=seeds, max_num_logprobs=max(lp) if lp else None)
        if any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in params):
            self._penalty_metadata(md, rows, params, num_out)
        blocks = []
        for j, (r, p) in enumerate(zip(rows, params)):
            # (a structured-output request ends where its grammar does: its mask alone decides when EOS may come)
            if p.min_tokens and p.structured_outputs is None and num_out[j] < p.min_tokens:
                ids = set(p.all_stop_token_ids)
                if ib.eos_token_id[r] is not None:
                    ids.add(ib.eos_token_id[r])
                blocks.append((j, sorted(ids)))
        md.min_tokens_blocks = blocks or None
        md.allowed_token_ids = [(j, p.allowed_token_ids) for j, p in enumerate(params)
                                if p.allowed_token_ids is not None] or None
        md.logit_bias = [(j, list(p.logit_bias), list(p.logit_bias.values())) for j, p in enumerate(params)
                         if p.logit_bias] or None
        return md

    def _penalty_metadata(self, md: SamplingMetadata, rows: np.ndarray, params: list, num_out: np.ndarray) -> None:
        ib = self.input_batch
        v = self.vocab_size
        prompts = [ib.token_ids[r, :ib.num_prompt_tokens[r]] for r in rows]
        outputs = [ib.token_ids[r, ib.num_prompt_tokens[r]:ib.num_prompt_tokens[r] + n] for r, n in zip(rows, num_out)]

        def padded(seqs: list[np.ndarray]) -> torch.Tensor:
            width = max(1, max(len(s) for s in seqs))
            m = np.full((len(seqs), width), v, dtype=np.int64)
            for j, s in enumerate(seqs):
                m[j, :len(s)] = s
            return torch.from_numpy(m)

        md.prompt_token_ids = padded(prompts)
        md.output_token_ids = padded(outputs)
        md.presence_penalty = torch.tensor([p.presence_penalty for p in params])
        md.frequency_penalty = torch.tensor([p.frequency_penalty for p in params])
        md.repetition_penalty = torch.tensor([p.repetition_penalty for p in params])

    def _sample_logprobs(self, out: ModelRunnerOutput, raw_lp: torch.Tensor, tokens: torch.Tensor,
                         sample_idx: np.ndarray, sample_rows: np.ndarray, req_ids: list[str]) -> None:
        ib = self.input_batch
        k = max(ib.params[r].logprobs or 0 for r in sample_rows)
        ids, lps, ranks = gather_logprobs(raw_lp, tokens, k)
        ids, lps, ranks = ids.tolist(), lps.tolist(), ranks.tolist()
        for j, (i, r) in enumerate(zip(sample_idx, sample_rows)):
            p = ib.params[r]
            n = p.logprobs
            if n is None:
                continue
            lists = LogprobsLists([ids[j][:n + 1]], [lps[j][:n + 1]], [ranks[j]])
            if p.logprob_token_ids:  # rare: per-row work only for the requests that ask
                wanted = torch.tensor(p.logprob_token_ids)
                row = raw_lp[j]
                extra_lp = row[wanted]
                extra_ranks = (row.unsqueeze(0) > extra_lp.unsqueeze(1)).sum(-1) + 1
                lists.token_ids[0] += p.logprob_token_ids
                lists.logprobs[0] += extra_lp.tolist()
                lists.extra_ranks = [extra_ranks.tolist()]
            out.logprobs[req_ids[i]] = lists

    def _prompt_logprobs(self, out: ModelRunnerOutput, req_ids: list[str], rows: np.ndarray, computed: np.ndarray,
                         counts: np.ndarray, starts: np.ndarray, hidden: torch.Tensor) -> None:
        ib = self.input_batch
        for i, r in enumerate(rows):
            k = ib.params[r].prompt_logprobs
            if k is None:
                continue
            last = int(ib.num_prompt_tokens[r]) - 1  # positions < last predict a prompt token
            first, end = int(computed[i]), min(int(computed[i] + counts[i]), last)
            if end <= first:
                continue
            h = hidden[int(starts[i]):int(starts[i]) + end - first]
            raw = self.model.compute_logits(h).float().log_softmax(dim=-1)
            targets = torch.from_numpy(ib.token_ids[r, first + 1:end + 1].copy())
            ids, lps, ranks = gather_logprobs(raw, targets, k)
            out.prompt_logprobs[req_ids[i]] = LogprobsLists(ids.tolist(), lps.tolist(), ranks.tolist())
