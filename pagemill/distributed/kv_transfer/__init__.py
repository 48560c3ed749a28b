"""KV transfer between engines: the KV connector interface (vLLM's KVConnectorBase_V1) and its connectors.

Importing this package pulls in no torch: the scheduler side of a connector runs in the scheduler.
"""

from pagemill.config import KV_CONNECTORS, KV_ROLES, KVTransferConfig

__all__ = ["KV_CONNECTORS", "KV_ROLES", "KVTransferConfig"]
