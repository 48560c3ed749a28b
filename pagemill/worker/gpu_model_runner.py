"""The GPU model runner (vLLM's `GPUModelRunner`), written device-generically: the model, KV cache and step inputs
live on `config.device_config.device`; step inputs go through persistent buffers (pinned staging + non_blocking
copies on CUDA: step_buffers.py); layer ops and attention are pagemill's Triton kernels; sampling runs on the device with one
device-to-host copy of the sampled ids per step (seeded rows draw the same SplitMix64 uniforms as the CPU path:
sample/draws.py); decode batches replay CUDA graphs on CUDA (cuda_graphs.py; `enforce_eager` turns them off); with async scheduling a
step is launched before the previous one's tokens reach the host (launch_model, launched_step.py).

On `device="cpu"` with attention_backend="triton" the same step runs on the CPU through Triton's interpreter: that is
how CI tests this runner (tests/worker/test_gpu_runner.py). Nothing CUDA-specific runs unless the device is CUDA.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from pagemill.attention.kv_quant import resolve_kv_cache_dtype
from pagemill.attention.metadata import CommonAttentionMetadata
from pagemill.attention.selector import get_attn_backend
from pagemill.config import EngineConfig
from pagemill.core.kv_cache_utils import KVCacheConfig
from pagemill.core.sched_output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from pagemill.distributed.parallel_state import ParallelContext
from pagemill.kernels.ops import select_layer_ops
from pagemill.platforms.cuda import CudaPlatform
from pagemill.sample.metadata import SamplingMetadata
from pagemill.sample.sampler import Sampler
from pagemill.sampling_params import SamplingParams
from pagemill.utils.torch_utils import host_to_device
from pagemill.worker.launched_step import DeviceTokens, LaunchedStep, PendingTokens
from pagemill.worker.model_runner import ModelRunner, StepInputs
from pagemill.worker.step_buffers import StepBuffers, bucket_for, decode_buckets
from pagemill.worker.step_timer import StepTimer

logger = logging.getLogger(__name__)


class GpuModelRunner(ModelRunner):
    """ModelRunner on `config.device_config.device` with persistent step buffers, a device sampler and CUDA graphs
    (CUDA)."""

    kv_cache_layout = "paged"

    def __init__(self, config: EngineConfig, parallel: ParallelContext | None = None) -> None:
        self.config = config
        self.parallel = parallel or ParallelContext()
        mc, cc = config.model_config, config.cache_config
        if config.speculative_config is not None:
            raise ValueError("speculative_config: the GPU runner does not verify draft tokens yet.")
        if mc.is_multimodal:
            raise ValueError("multimodal models do not run on the GPU runner yet.")
        self.encoder_cache = None
        self.mrope = None  # multimodal models (M-RoPE) are refused on this runner
        if cc.kv_cache_layout != self.kv_cache_layout:
            raise ValueError(f"kv_cache_layout={cc.kv_cache_layout!r}: this runner runs {self.kv_cache_layout!r}.")
        self.device = torch.device(config.device_config.device)
        if self.device.type == "cuda" and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        # (the virtual layout reads its contiguous ranges through the paged kernel: one block per request)
        self.backend = get_attn_backend(config.attention_backend, config.batch_invariant, "paged")
        self.ops = select_layer_ops(self.backend.name, CudaPlatform)  # the CUDA table, also when run on the CPU
        self.vocab_size = mc.hf_config.vocab_size
        self.block_size = cc.block_size
        self.kv_dtype = resolve_kv_cache_dtype(cc.kv_cache_dtype, mc.dtype, self.backend)
        self.profiler = StepTimer(config.profile)
        self.graphs = None  # cuda_graphs.DecodeGraphs once captured (CUDA, not enforce_eager)
        # Async scheduling (launch_model): the last launched step's tokens on the device, the step they feed, the
        # step whose tokens are on their way to the host, and what the step being launched defers.
        self._device_tokens: DeviceTokens | None = None
        self._inputs_from: DeviceTokens | None = None
        self._in_flight: LaunchedStep | None = None
        self._deferred: PendingTokens | None = None
        self._launching = False

    @property
    def is_cuda(self) -> bool:
        """Whether the runner's device is a CUDA GPU."""
        return self.device.type == "cuda"

    def load_model(self) -> None:
        """Load (on the host), move to the device, route RoPE through the Triton kernel, no CPU-only extras."""
        super().load_model()
        self.model.to(self.device)
        self.head_screen = None  # (an int8 CPU kernel)
        self.sampler = Sampler(None)
        if self.ops.fused_rotary:
            from pagemill.layers.rotary import RotaryEmbedding

            for module in self.model.modules():
                if isinstance(module, RotaryEmbedding):
                    module.kernel_ops = self.ops

    def _allocate_kv_cache(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The KV tensor on the device (CUDA: allocated and zeroed at once; CPU: committed as written)."""
        if self.is_cuda:
            return torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        return super()._allocate_kv_cache(shape)

    def initialize_kv_cache(self, num_blocks: int) -> KVCacheConfig:
        """The base's KV cache and input batch, the swap space in pinned host memory (CUDA), the persistent step
        buffers, then (CUDA, not enforce_eager) the decode CUDA graphs."""
        kv = super().initialize_kv_cache(num_blocks)
        self._bind_layer_caches()
        if self.is_cuda and self.swap_cache is not None:
            self.swap_cache = self.swap_cache.pin_memory()
        sc = self.config.scheduler_config
        self.buffers = StepBuffers(self.device, max(sc.max_num_batched_tokens, sc.max_num_seqs), sc.max_num_seqs,
                                   self.input_batch.max_blocks, len(self.kv_groups))
        self.buckets = decode_buckets(sc.max_num_seqs)
        # two pinned landing buffers for sampled tokens: a launched step's copy never overwrites the one in flight
        self._host_tokens = [torch.empty(sc.max_num_seqs, dtype=torch.int64, pin_memory=self.is_cuda)
                             for _ in range(2)]
        self._host_flip = 0
        if self.is_cuda and not self.config.device_config.enforce_eager and not getattr(self, "_profiling", False):
            from pagemill.worker.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs.capture(self)
        return kv

    def _bind_layer_caches(self) -> None:
        """Where the attention layers read and write their KV (the paged layout: the base's views of the pool)."""

    def _kv_addresses(self, rows: np.ndarray, token_req: np.ndarray, positions: np.ndarray, tables: np.ndarray,
                      slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The block tables and slots the kernels address the layers' caches with (paged: the scheduler's)."""
        return tables, slots

    # ---- per step ----
    def attn_inputs(self, rows: np.ndarray, computed: np.ndarray, counts: np.ndarray, pad_to: int | None = None
                    ) -> tuple[list[CommonAttentionMetadata], torch.Tensor, torch.Tensor, np.ndarray]:
        """The base's arrays, staged into the persistent device buffers (padded to `pad_to` tokens for a decode
        graph); the metadata's slot mapping and Triton token tables are views of those buffers."""
        md, input_ids, positions, cu = super().attn_inputs(rows, computed, counts)
        if pad_to is None and self.graphs is not None and self._graphable(counts):
            pad_to = bucket_for(len(rows), self.buckets)
        token_req = np.repeat(np.arange(len(rows)), counts)
        tables = np.stack([m.block_table for m in md])
        slots = np.stack([m.slot_mapping.numpy() for m in md])
        tables, slots = self._kv_addresses(rows, token_req, positions.numpy(), tables, slots)
        buf = self.buffers
        tokens, _ = buf.stage(input_ids.numpy(), positions.numpy(), slots, token_req, tables, pad_to)
        for g, m in enumerate(md):
            slot_mapping, table, req, pos = buf.attn_tensors(g, tokens)
            m.slot_mapping = slot_mapping
            m.device_tensors = (table, req, pos)
            if tokens != m.num_actual_tokens:  # a graph bucket: the kernels run over the padded batch
                m.num_actual_tokens = tokens
        ids, pos = buf.views(tokens)
        self._padded_tokens = tokens
        if self._inputs_from is not None:  # launched behind a step whose tokens are still on the device only
            ib = self.input_batch
            waiting = np.nonzero(computed + counts > ib.num_tokens[rows])[0]
            if len(waiting):
                at, index = buf.stage_token_feed(cu[waiting] - 1, self._inputs_from.index_of(rows[waiting],
                                                                                             ib.row_epoch))
                ids[at] = self._inputs_from.tokens[index]
        return md, ids, pos, cu

    def _graphable(self, counts: np.ndarray) -> bool:
        """Whether a step's forward can replay a decode graph: one token per request, no LoRA rows, no KV connector,
        and a bucket for its size."""
        return (bool(len(counts)) and bool((counts == 1).all()) and self.lora_manager is None
                and self.kv_connector is None and bucket_for(len(counts), self.buckets) is not None)

    def _forward(self, step: StepInputs, metadata: list, embeds: torch.Tensor | None = None) -> torch.Tensor:
        """A captured decode graph where one fits the step, else the eager forward (over the padded tokens)."""
        n = len(step.counts) if step.counts is not None else 0
        if (self.graphs is not None and embeds is None and self._padded_tokens in self.graphs.graphs
                and self._graphable(step.counts)):
            return self.graphs.replay(self._padded_tokens)[:n]
        hidden = super()._forward(step, metadata, embeds)
        return hidden[:int(step.counts.sum())]

    # ---- async scheduling without a step thread ----
    def launch_model(self, so: SchedulerOutput) -> LaunchedStep:
        """Queue a step's work on the device and return before its sampled tokens reach the host: they stay on the
        device as the next launched step's inputs, and `result()` of the returned step records them."""
        self._inputs_from, self._device_tokens = self._device_tokens, None
        self._launching = True
        try:
            out = self._execute(so)
        finally:
            self._launching, self._inputs_from = False, None
        out.timings = self.profiler.take()
        pending, self._deferred = self._deferred, None
        if pending is None:
            return LaunchedStep(out, None)

        def finish(output: ModelRunnerOutput) -> None:
            if self._in_flight is step:
                self._in_flight = None
            self._finish_tokens(pending, output)

        step = LaunchedStep(out, finish)
        self._in_flight = step
        return step

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """One step, waited for (after recording a launched step's tokens, if one is in flight)."""
        self._settle_in_flight()
        self._device_tokens = None
        return super().execute_model(so)

    def _settle_in_flight(self) -> None:
        """Record the launched step's tokens now (its output keeps them for the engine)."""
        step, self._in_flight = self._in_flight, None
        if step is not None:
            try:
                step.result()
            except Exception:  # raised again when the engine takes the step's output
                pass
            self._inputs_from = None  # (every token is on the host now)

    def _prepare(self, so: SchedulerOutput) -> StepInputs:
        """The base's inputs; a request whose sampling reads its earlier outputs (penalties, seeds, min_tokens)
        first waits for the tokens in flight."""
        if self._in_flight is not None and self.input_batch.reads_history.any():
            self._settle_in_flight()
        return super()._prepare(so)

    def _record_sampled(self, out: ModelRunnerOutput, tokens: torch.Tensor, raw_lp: torch.Tensor | None,
                        sample_idx: np.ndarray, sample_rows: np.ndarray, req_ids: list[str]) -> None:
        """Launching: keep the tokens on the device for the next step and start their copy to the host; else the
        base's (wait for them)."""
        if not self._launching:
            return super()._record_sampled(out, tokens, raw_lp, sample_idx, sample_rows, req_ids)
        ib = self.input_batch
        index_of_row = np.full(ib.max_num_reqs, -1, dtype=np.int64)
        index_of_row[sample_rows] = np.arange(len(sample_rows))
        epochs = ib.row_epoch[sample_rows].copy()
        self._device_tokens = DeviceTokens(tokens, index_of_row, epochs)
        event = None
        host = tokens
        if self.is_cuda:
            host = self._host_tokens[self._host_flip][:len(tokens)]
            self._host_flip ^= 1
            host.copy_(tokens, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self._deferred = PendingTokens(tokens, host, event, raw_lp, sample_idx, sample_rows, epochs, req_ids)

    def _finish_tokens(self, pending: PendingTokens, out: ModelRunnerOutput) -> None:
        """A launched step's tokens on the host: into its output, and into the input-batch rows still held by the
        requests that sampled them (with their logprobs)."""
        with self.profiler.section("sample"):
            token_list = pending.wait()
            req_ids, sample_idx = pending.req_ids, pending.sample_idx
            out.sampled.update(zip([req_ids[i] for i in sample_idx.tolist()], [[t] for t in token_list]))
            ib = self.input_batch
            live = ib.row_epoch[pending.sample_rows] == pending.epochs
            tokens_np = np.asarray(token_list, dtype=np.int64)
            raw_lp, tokens = pending.raw_logprobs, pending.tokens
            if not live.all():
                keep = torch.from_numpy(live).to(tokens.device)
                tokens_np, sample_idx = tokens_np[live], sample_idx[live]
                tokens = tokens[keep]
                raw_lp = raw_lp[keep] if raw_lp is not None else None
            rows = pending.sample_rows[live]
            ib.append_tokens(rows, tokens_np)
            if raw_lp is not None and len(rows):
                self._sample_logprobs(out, raw_lp, tokens, sample_idx, rows, req_ids)
        for name, seconds in self.profiler.take().items():
            out.timings[name] = out.timings.get(name, 0.0) + seconds

    def _sampling_metadata(self, rows: np.ndarray, offsets: np.ndarray | None = None) -> SamplingMetadata:
        """The base's sampling tensors, on the device (seeded rows' uniforms stay host-made: the same draws)."""
        md = super()._sampling_metadata(rows, offsets)
        if self.device.type != "cpu":
            for name in ("temperature", "greedy_mask", "top_p", "top_k", "min_p", "presence_penalty",
                         "frequency_penalty", "repetition_penalty", "prompt_token_ids", "output_token_ids"):
                value = getattr(md, name)
                if value is not None:
                    setattr(md, name, host_to_device(value, self.device))
        return md

    # ---- KV sizing (GpuWorker.determine_num_available_blocks) ----
    def profile_run(self) -> int:
        """A forward of max_num_batched_tokens prompt tokens (as many requests as that takes, max_num_seqs at most)
        plus their sampling, on a temporary KV cache; returns that cache's bytes. Its state is dropped after."""
        sc, mc = self.config.scheduler_config, self.config.model_config
        total = sc.max_num_batched_tokens
        per_req = max(1, min(total, mc.max_model_len - 1))
        lengths = []
        while total > 0 and len(lengths) < sc.max_num_seqs:
            lengths.append(min(per_req, total))
            total -= lengths[-1]
        bs = self.block_size
        groups = len(self.kv_groups)
        need = sum(-(-(n + 1) // bs) for n in lengths)
        self._profiling = True
        try:
            self.initialize_kv_cache(need * groups + 1)
            params = SamplingParams(temperature=0.0, max_tokens=1)
            new, next_block = [], 1
            for i, n in enumerate(lengths):
                nb = -(-(n + 1) // bs)
                ids = [list(range(next_block + g * nb, next_block + (g + 1) * nb)) for g in range(groups)]
                next_block += nb * groups
                new.append(NewRequestData(f"profile-{i}", [1] * n, n, params, ids, 0))
            counts = {r.req_id: len(r.token_ids) for r in new}
            self.execute_model(SchedulerOutput(new, [], counts, sum(counts.values())))
            self.execute_model(SchedulerOutput([], [], {}, 0, finished_req_ids=set(counts)))
            kv_bytes = self.kv_cache.numel() * self.kv_cache.element_size()
        finally:
            self._profiling = False
        for layer in self.model.attention_layers():
            layer.kv_cache = None
        del self.kv_cache, self.kv_caches, self.buffers
        return kv_bytes


def kv_cache_bytes_from_profile(total: int, utilization: float, torch_peak: int, non_torch: int) -> int:
    """vLLM's sizing: the share `utilization` of the device's `total` memory, less the profiled forward's peak of
    torch allocations (weights, activations; not its temporary KV cache) and what is held outside torch (CUDA
    context, cuBLAS / NCCL workspaces). A ValueError names gpu_memory_utilization when nothing is left."""
    budget = int(total * utilization) - torch_peak - non_torch
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization={utilization}: the model and its activations need "
                         f"{(torch_peak + non_torch) / 2**30:.2f} GiB of the {total * utilization / 2**30:.2f} GiB "
                         "allowed; nothing is left for the KV cache (raise it, or lower max_num_batched_tokens).")
    return budget


def log_kv_sizing(total: int, utilization: float, torch_peak: int, non_torch: int, kv_bytes: int,
                  seconds: float) -> None:
    """One line: what the profile found and what the KV cache gets."""
    logger.info("GPU memory: %.2f GiB x %.2f; profiled forward peak %.2f GiB, non-torch %.2f GiB -> KV cache "
                "%.2f GiB (profile %.1fs)", total / 2**30, utilization, torch_peak / 2**30, non_torch / 2**30,
                kv_bytes / 2**30, seconds)

