"""Block hashing for prefix caching: chained hashes of full blocks."""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

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
                        block_size: int, num_full_blocks: int, extra_keys: tuple | None,
                        mm_spans: Sequence[tuple[int, int, str]] | None = None) -> None:
    """Append hashes to `block_hashes` until it covers `num_full_blocks` blocks of `token_ids`.

    `mm_spans`: (offset, length, content hash) of each image's placeholder tokens. A block that overlaps a span also
    hashes the image's content (vLLM's multimodal extra keys): the placeholder token ids are the same for every
    image, so two prompts with the same text and different images must not share those blocks."""
    for i in range(len(block_hashes), num_full_blocks):
        parent = block_hashes[-1] if block_hashes else NONE_HASH
        keys, start, end = extra_keys, i * block_size, (i + 1) * block_size
        if mm_spans:
            images = tuple(h for off, n, h in mm_spans if off < end and start < off + n)
            if images:
                keys = (extra_keys, images)
        block_hashes.append(hash_block_tokens(hash_fn, parent, token_ids[start:end], keys))


def kv_cache_groups(windows: Sequence[int | None], max_model_len: int) -> list[tuple[int | None, list[int]]]:
    """Layers grouped by attention type (as vLLM's hybrid KV cache manager): (window or None, layer indices).

    A window that reaches max_model_len never drops a token, so its layers count as full attention. Every group
    has as many layers as the smallest type (the last group of a type may have fewer), so one physical KV tensor
    per position in a group serves one layer of every group and a block id belongs to one group at a time.
    """
    by_type: dict[int | None, list[int]] = {}
    for i, w in enumerate(windows):
        by_type.setdefault(w if w is not None and w < max_model_len else None, []).append(i)
    size = min(len(layers) for layers in by_type.values())
    return [(w, layers[i:i + size]) for w, layers in sorted(by_type.items(), key=lambda kv: kv[0] is not None)
            for i in range(0, len(layers), size)]


@dataclass(frozen=True)
class KVCacheConfig:
    """The KV cache the worker allocated: blocks (block 0 is the null block), host swap blocks, block size, and
    the sliding window of each KV cache group (None: full attention; one block table per group and request)."""

    num_blocks: int
    block_size: int
    num_swap_blocks: int = 0
    group_windows: tuple[int | None, ...] = (None,)
    block_bytes: int = field(default=0, compare=False)  # KV memory of one block (all the layers of its group)

    def __post_init__(self) -> None:
        object.__setattr__(self, "group_windows", tuple(self.group_windows))  # (a list after a JSON round trip)

    @property
    def usable_blocks(self) -> int:
        """Blocks requests can use: all but the reserved null block."""
        return self.num_blocks - 1

    @property
    def has_kv_cache(self) -> bool:
        """False for a model without KV-cache layers (encoder-only: no groups, no blocks allocated)."""
        return bool(self.group_windows)

    @property
    def usable_tokens(self) -> int:
        """Tokens the usable blocks hold if every group kept all of a sequence's blocks (a lower bound)."""
        return self.usable_blocks // max(len(self.group_windows), 1) * self.block_size

    def max_blocks_per_request(self, num_tokens: int, chunk: int) -> int:
        """Most blocks one request of `num_tokens` tokens holds at once when steps compute up to `chunk` tokens."""
        n = -(-num_tokens // self.block_size)
        return sum(n if w is None else min(n, -(-(w - 1 + chunk) // self.block_size) + 1)
                   for w in self.group_windows)
