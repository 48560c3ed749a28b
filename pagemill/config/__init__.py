"""Engine configuration as plain dataclasses, one small module per part; they import nothing above the config layer.

`from pagemill.config import X` works for every name below. The user-facing arguments and their help text (the one
place each argument is documented) are EngineArgs' (pagemill/engine/arg_utils.py), which builds these.
"""

from pagemill.config.cache import BLOCK_SIZES, KV_CACHE_DTYPES, KV_CACHE_LAYOUTS, CacheConfig, parse_size
from pagemill.config.device import DEVICE_TYPES, DeviceConfig
from pagemill.config.engine import EngineConfig
from pagemill.config.kv_transfer import KV_CONNECTORS, KV_ROLES, KVTransferConfig
from pagemill.config.lora import LORA_RANKS, LoRAConfig
from pagemill.config.model import (CHECKPOINT_QUANTIZATIONS, LINEAR_DTYPES, QUANTIZATIONS, WEIGHT_ONLY_QUANTIZATIONS,
                                   ModelConfig, check_linear_options, resolve_quantization)
from pagemill.config.parallel import (DISTRIBUTED_EXECUTOR_BACKENDS, DP_ROUTING_POLICIES, DataParallelConfig,
                                      ParallelConfig)
from pagemill.config.pooling import POOLING_TYPES, RUNNERS, PoolerConfig
from pagemill.config.scheduler import PREEMPTION_MODES, SCHEDULING_POLICIES, SchedulerConfig
from pagemill.config.speculative import SPECULATIVE_METHODS, SpeculativeConfig
from pagemill.config.structured_output import STRUCTURED_OUTPUT_BACKENDS, StructuredOutputsConfig

__all__ = [
    "BLOCK_SIZES", "CHECKPOINT_QUANTIZATIONS", "DEVICE_TYPES", "DISTRIBUTED_EXECUTOR_BACKENDS", "DP_ROUTING_POLICIES",
    "KV_CACHE_DTYPES", "KV_CACHE_LAYOUTS", "KV_CONNECTORS", "KV_ROLES", "LINEAR_DTYPES", "LORA_RANKS",
    "POOLING_TYPES", "PREEMPTION_MODES", "QUANTIZATIONS", "RUNNERS", "SCHEDULING_POLICIES", "SPECULATIVE_METHODS",
    "STRUCTURED_OUTPUT_BACKENDS", "WEIGHT_ONLY_QUANTIZATIONS",
    "CacheConfig", "DataParallelConfig", "DeviceConfig", "EngineConfig", "KVTransferConfig", "LoRAConfig",
    "ModelConfig", "ParallelConfig", "PoolerConfig", "SchedulerConfig", "SpeculativeConfig",
    "StructuredOutputsConfig", "check_linear_options", "parse_size", "resolve_quantization",
]
