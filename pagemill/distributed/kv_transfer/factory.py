"""KVConnectorFactory: the connector class named by kv_transfer_config.kv_connector."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from pagemill.distributed.kv_transfer.base import KVConnectorBase_V1, KVConnectorRole

if TYPE_CHECKING:
    from pagemill.config import EngineConfig

_REGISTRY = {
    "SharedStorageConnector": "pagemill.distributed.kv_transfer.shared_storage_connector",
    "ZmqConnector": "pagemill.distributed.kv_transfer.zmq_connector",
}


class KVConnectorFactory:
    """Builds a connector's scheduler or worker half (vLLM's KVConnectorFactory)."""

    @staticmethod
    def create_connector(config: EngineConfig, role: KVConnectorRole) -> KVConnectorBase_V1 | None:
        """The configured connector for `role`, or None when the engine has no kv_transfer_config."""
        tc = config.kv_transfer_config
        if tc is None:
            return None
        cls = getattr(importlib.import_module(_REGISTRY[tc.kv_connector]), tc.kv_connector)
        return cls(config, role)
