"""KVTransferConfig: a KV connector (disaggregated prefill, KV offload), the keys of --kv-transfer-config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagemill.utils.config_json import config_from_user

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
# Connectors by name (distributed/kv_transfer/factory.py maps them to their classes).
KV_CONNECTORS = ("SharedStorageConnector", "ZmqConnector")


@dataclass
class KVTransferConfig:
    """vLLM's KVTransferConfig fields that pagemill's connectors use.

    kv_producer saves the KV it computes, kv_consumer loads KV computed elsewhere instead of computing it, kv_both
    does both (a KV offload tier that is also read back on a prefix hit).
    """

    kv_connector: str | None = None
    kv_role: str | None = None
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_ip: str = "127.0.0.1"  # ZmqConnector: the producer serves its KV blocks here
    kv_port: int = 14579
    kv_buffer_size: float = 1e9  # ZmqConnector: bytes of KV blocks a producer keeps for consumers (LRU)
    engine_id: str | None = None

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_transfer_config.kv_connector must be one of {', '.join(KV_CONNECTORS)}, "
                             f"got {self.kv_connector!r}.")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}.")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_transfer_config.kv_connector_extra_config must be a JSON object.")
        if not isinstance(self.kv_port, int) or not 0 < self.kv_port < 65536:
            raise ValueError(f"kv_transfer_config.kv_port must be a TCP port in [1, 65535], got {self.kv_port!r}.")
        if not self.kv_buffer_size > 0:
            raise ValueError(f"kv_transfer_config.kv_buffer_size must be > 0, got {self.kv_buffer_size!r}.")

    @property
    def is_kv_producer(self) -> bool:
        """Whether this engine saves the KV it computes."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        """Whether this engine loads KV computed elsewhere."""
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_user(cls, value: dict[str, Any] | str | KVTransferConfig | None) -> KVTransferConfig | None:
        """Build from a dict, its JSON text (the CLI's --kv-transfer-config) or a config; None stays None.
        Unknown keys raise a ValueError naming them."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        return config_from_user(cls, value, "kv_transfer_config")
