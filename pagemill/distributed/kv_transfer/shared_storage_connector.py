"""SharedStorageConnector: KV blocks as files under a directory that producers and consumers share.

One file per full block, named by its prefix key and read back memory-mapped. Writes go to a temporary name and
are renamed into place, so a reader never sees half a block. With kv_role kv_both the directory is a KV offload
tier (on /dev/shm: host memory; on a disk: disk) that a later request's prefix hit reads back.
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING, Any

from pagemill.distributed.kv_transfer.base import KVConnectorRole
from pagemill.distributed.kv_transfer.block_store_connector import BlockStoreConnector, KVBlockStore

if TYPE_CHECKING:
    import numpy as np

    from pagemill.config import EngineConfig


class FileBlockStore(KVBlockStore):
    """Blocks as files `<root>/<key[:2]>/<key>.kv`."""

    def __init__(self, root: str) -> None:
        self.root = root
        os.makedirs(root, exist_ok=True)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key[:2], key + ".kv")

    def num_leading_present(self, keys: list[str]) -> int:
        """Leading keys whose file exists."""
        for i, key in enumerate(keys):
            if not os.path.exists(self._path(key)):
                return i
        return len(keys)

    def load(self, keys: list[str]) -> list[Any]:
        """Each block's file, memory-mapped read-only."""
        import numpy as np

        out = []
        for key in keys:
            try:
                out.append(np.memmap(self._path(key), dtype=np.uint8, mode="r"))
            except FileNotFoundError:
                raise RuntimeError(f"SharedStorageConnector: KV block {key} vanished from {self.root} between the "
                                   "scheduler's lookup and the load (was the directory cleaned?).") from None
        return out

    def save(self, keys: list[str], blocks: np.ndarray) -> None:
        """Write each block not yet stored (atomically: temporary file, then rename)."""
        for key, block in zip(keys, blocks):
            path = self._path(key)
            if os.path.exists(path):
                continue
            folder = os.path.dirname(path)
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(memoryview(block))
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise


class SharedStorageConnector(BlockStoreConnector):
    """vLLM's SharedStorageConnector: kv_connector_extra_config {"shared_storage_path": DIR} (default
    /tmp/pagemill_kv)."""

    def __init__(self, config: EngineConfig, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        path = self.kv_transfer_config.kv_connector_extra_config.get("shared_storage_path", "/tmp/pagemill_kv")
        if not isinstance(path, str) or not path:
            raise ValueError("kv_transfer_config.kv_connector_extra_config.shared_storage_path must be a directory.")
        self.store = FileBlockStore(path)
