"""Block hashing for prefix caching: chained hashes of full blocks."""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass

NONE_HASH = 0x5EED  # parent hash of a request's first block


def _builtin_hash(obj: object) -> int:
    return hash(obj)


def _sha256_hash(obj: object) -> int:
    return int.from_bytes(hashlib.sha256(pickle.dumps(obj, protocol=5)).digest()[:8], "little")


def get_hash_fn(algo: str) -> Callable[[object], int]:
    """The hash function named by `--prefix-caching-hash-algo`."""
    return _sha256_hash if algo == "sha256" else _builtin_hash


def hash_block_tokens(hash_fn: Callable[[object], int], parent_hash: int, block_tokens: Sequence[int],
                      extra_keys: tuple | None = None) -> int:
    """Hash of one full block: depends on every token before it through `parent_hash`."""
    return hash_fn((parent_hash, tuple(block_tokens), extra_keys))


def extend_block_hashes(hash_fn: Callable[[object], int], block_hashes: list[int], token_ids: Sequence[int],
                        block_size: int, num_full_blocks: int, extra_keys: tuple | None) -> None:
    """Append hashes to `block_hashes` until it covers `num_full_blocks` blocks of `token_ids`."""
    for i in range(len(block_hashes), num_full_blocks):
        parent = block_hashes[-1] if block_hashes else NONE_HASH
        block_hashes.append(hash_block_tokens(hash_fn, parent, token_ids[i * block_size:(i + 1) * block_size],
                                              extra_keys))


@dataclass(frozen=True)
class KVCacheConfig:
    """The KV cache the worker allocated: blocks (block 0 is the null block), host swap blocks, block size."""

    num_blocks: int
    block_size: int
    num_swap_blocks: int = 0

    @property
    def usable_blocks(self) -> int:
        """Blocks requests can use: all but the reserved null block."""
        return self.num_blocks - 1

    @property
    def usable_tokens(self) -> int:
        """Tokens the usable blocks hold."""
        return self.usable_blocks * self.block_size
