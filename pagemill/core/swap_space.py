"""Host swap space bookkeeping for preemption by swapping: which swap slots (block-sized) are free."""

from __future__ import annotations


class SwapSpace:
    """A free list of swap block ids; the tensor behind them belongs to the model runner."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    def allocate(self, n: int) -> list[int] | None:
        """n swap blocks, or None if there is not enough room (all or nothing)."""
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, ids: list[int]) -> None:
        """Return swap blocks."""
        self._free.extend(ids)

    @property
    def num_free(self) -> int:
        """Free swap blocks."""
        return len(self._free)
