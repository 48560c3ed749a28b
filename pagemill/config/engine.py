"""EngineConfig: all the configuration of one engine, the parts above put together."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagemill.config.cache import CacheConfig
from pagemill.config.device import DeviceConfig
from pagemill.config.kv_transfer import KVTransferConfig
from pagemill.config.lora import LoRAConfig
from pagemill.config.model import ModelConfig
from pagemill.config.parallel import DataParallelConfig, ParallelConfig
from pagemill.config.scheduler import SchedulerConfig
from pagemill.config.speculative import SpeculativeConfig
from pagemill.config.structured_output import StructuredOutputsConfig


@dataclass
class EngineConfig:
    """All the configuration of one engine (built and checked by EngineArgs.create_engine_config)."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    num_threads: int | None = None
    log_stats: bool = False  # resolved: not disable_log_stats
    attention_backend: str = "auto"
    profile: bool = False
    greedy_head_screen: bool = True  # resolved: off with batch_invariant and for pooling models
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    speculative_config: SpeculativeConfig | None = None
    lora_config: LoRAConfig | None = None  # None: LoRA disabled
    batch_invariant: bool = False
    data_parallel_config: DataParallelConfig = field(default_factory=DataParallelConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    kv_transfer_config: KVTransferConfig | None = None
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
