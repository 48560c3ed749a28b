"""ZmqConnector: a prefill (producer) engine serves the KV blocks it computed over ZMQ/TCP; a decode (consumer)
engine pulls them into its paged cache instead of recomputing the prompt.

The producer copies each completed prompt block into a host-memory LRU (kv_buffer_size bytes) that a thread serves
on tcp://kv_ip:kv_port; the consumer's scheduler asks it how many of a request's leading blocks it holds and the
consumer's worker fetches them before the forward. A producer that does not answer in time is a miss (the consumer
computes the prompt itself); blocks that disappear between lookup and fetch (evicted) fail the step loudly.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import zmq

from pagemill.distributed.kv_transfer.base import KVConnectorRole
from pagemill.distributed.kv_transfer.block_store_connector import BlockStoreConnector, KVBlockStore

if TYPE_CHECKING:
    import numpy as np

    from pagemill.config import EngineConfig

logger = logging.getLogger(__name__)

_HAS, _GET = b"has", b"get"
_OK, _MISSING = b"ok", b"missing"


def _pack_keys(keys: list[str]) -> bytes:
    return ",".join(keys).encode()


def _unpack_keys(data: bytes) -> list[str]:
    return data.decode().split(",") if data else []


class ZmqBlockStoreServer(KVBlockStore):
    """The producer's blocks in a host-memory LRU, served to consumers by a thread on a ROUTER socket."""

    def __init__(self, address: str, capacity_bytes: int) -> None:
        self.address, self.capacity_bytes = address, capacity_bytes
        self._blocks: OrderedDict[str, bytes] = OrderedDict()
        self._nbytes = 0
        self._lock = threading.Lock()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(address)
        except zmq.ZMQError as e:
            self._sock.close()
            raise ValueError(f"ZmqConnector: cannot serve KV blocks on {address} ({e}); choose another "
                             "kv_transfer_config.kv_port.") from None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="pagemill-kv-server", daemon=True)
        self._thread.start()
        logger.info("ZmqConnector: serving KV blocks on %s (%.0f MiB buffer)", address, capacity_bytes / 2**20)

    def _serve(self) -> None:
        sock = self._sock
        try:
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                frames = sock.recv_multipart()
                if len(frames) != 4:  # not a request of ours (a REQ envelope, op, keys): dropped
                    continue
                ident, empty, op, payload = frames
                keys = _unpack_keys(payload)
                if op == _HAS:
                    reply = [_OK, str(self.num_leading_present(keys)).encode()]
                else:
                    with self._lock:
                        blocks = [self._blocks.get(k) for k in keys]
                        for k, b in zip(keys, blocks):
                            if b is not None:
                                self._blocks.move_to_end(k)
                    reply = [_MISSING] if any(b is None for b in blocks) else [_OK, *blocks]
                sock.send_multipart([ident, empty, *reply], copy=False)
        finally:
            sock.close()

    def num_leading_present(self, keys: list[str]) -> int:
        """Leading keys held in the buffer."""
        with self._lock:
            for i, key in enumerate(keys):
                if key not in self._blocks:
                    return i
        return len(keys)

    def load(self, keys: list[str]) -> list[Any]:
        """(A producer loads nothing.)"""
        raise RuntimeError("ZmqConnector: a kv_producer does not load KV blocks.")

    def save(self, keys: list[str], blocks: np.ndarray) -> None:
        """Keep copies of the blocks, evicting the least recently used beyond the buffer's capacity."""
        with self._lock:
            for key, block in zip(keys, blocks):
                if key in self._blocks:
                    self._blocks.move_to_end(key)
                    continue
                data = block.tobytes()
                self._blocks[key] = data
                self._nbytes += len(data)
            while self._nbytes > self.capacity_bytes and len(self._blocks) > 1:
                _, old = self._blocks.popitem(last=False)
                self._nbytes -= len(old)

    def close(self) -> None:
        """Stop the serving thread."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._ctx.term()


class ZmqBlockStoreClient(KVBlockStore):
    """A consumer's view of a producer's blocks: one REQ socket, each call bounded by `timeout_s`."""

    def __init__(self, address: str, timeout_s: float) -> None:
        self.address, self.timeout_ms = address, int(timeout_s * 1000)
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None

    def _call(self, op: bytes, keys: list[str]) -> list[zmq.Frame]:
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.REQ)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.connect(self.address)
        self._sock.send_multipart([op, _pack_keys(keys)])
        if not self._sock.poll(self.timeout_ms):
            self._sock.close()  # a REQ socket without its reply cannot send again
            self._sock = None
            raise TimeoutError(f"ZmqConnector: the KV producer at {self.address} did not answer in "
                               f"{self.timeout_ms / 1000:g} s.")
        return self._sock.recv_multipart(copy=False)

    def num_leading_present(self, keys: list[str]) -> int:
        """Leading keys the producer holds (0 if it does not answer: the prompt is computed here)."""
        try:
            frames = self._call(_HAS, keys)
        except TimeoutError as e:
            logger.warning("%s Computing the prompt locally.", e)
            return 0
        return int(bytes(frames[1]))

    def load(self, keys: list[str]) -> list[Any]:
        """The blocks' bytes from the producer."""
        frames = self._call(_GET, keys)
        if frames[0].bytes != _OK:
            raise RuntimeError(f"ZmqConnector: the KV producer at {self.address} no longer holds blocks it "
                               "announced (evicted: raise its kv_transfer_config.kv_buffer_size).")
        return [f.buffer for f in frames[1:]]

    def save(self, keys: list[str], blocks: np.ndarray) -> None:
        """(A consumer saves nothing.)"""
        raise RuntimeError("ZmqConnector: a kv_consumer does not save KV blocks.")

    def close(self) -> None:
        """Close the socket."""
        if self._sock is not None:
            self._sock.close()
        self._ctx.term()


class ZmqProducersClient(KVBlockStore):
    """A consumer fed by several producers (xPyD): a request's blocks come from the producer holding most of them."""

    def __init__(self, addresses: list[str], timeout_s: float) -> None:
        self.clients = [ZmqBlockStoreClient(a, timeout_s) for a in addresses]

    def num_leading_present(self, keys: list[str]) -> int:
        """The longest run of leading keys one producer holds."""
        return max(c.num_leading_present(keys) for c in self.clients)

    def load(self, keys: list[str]) -> list[Any]:
        """The blocks from the first producer that holds them all."""
        for client in self.clients:
            try:
                return client.load(keys)
            except (RuntimeError, TimeoutError):
                continue
        raise RuntimeError(f"ZmqConnector: none of the KV producers {[c.address for c in self.clients]} holds the "
                           "blocks announced (evicted: raise their kv_transfer_config.kv_buffer_size).")

    def save(self, keys: list[str], blocks: np.ndarray) -> None:
        """(A consumer saves nothing.)"""
        raise RuntimeError("ZmqConnector: a kv_consumer does not save KV blocks.")

    def close(self) -> None:
        """Close every client."""
        for c in self.clients:
            c.close()


class ZmqConnector(BlockStoreConnector):
    """Producer -> consumer KV over ZMQ/TCP. A producer serves on tcp://kv_ip:kv_port; a consumer reads from there,
    or from every address in kv_connector_extra_config "producers" (several prefill instances). "timeout_s"
    (default 10) bounds each request to a producer."""

    def __init__(self, config: EngineConfig, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        tc = self.kv_transfer_config
        if tc.kv_role == "kv_both":
            raise ValueError("kv_transfer_config.kv_role: ZmqConnector runs as kv_producer (prefill) or "
                             "kv_consumer (decode), not kv_both.")
        address = f"tcp://{tc.kv_ip}:{tc.kv_port}"
        extra = tc.kv_connector_extra_config
        timeout_s = float(extra.get("timeout_s", 10.0))
        producers = extra.get("producers", [address])
        if (not isinstance(producers, list) or not producers
                or not all(isinstance(p, str) and p.startswith("tcp://") for p in producers)):
            raise ValueError("kv_transfer_config.kv_connector_extra_config.producers must be a list of "
                             f"'tcp://host:port' addresses, got {producers!r}.")
        if self.is_producer and role == KVConnectorRole.WORKER:
            self.store = ZmqBlockStoreServer(address, int(tc.kv_buffer_size))
        elif self.is_consumer:
            self.store = (ZmqBlockStoreClient(producers[0], timeout_s) if len(producers) == 1
                          else ZmqProducersClient(producers, timeout_s))
