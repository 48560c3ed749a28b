"""Async scheduling without a step thread (vLLM's async output): the GPU runner launches step N+1 on the device
before step N's sampled tokens reach the host. N's tokens stay on the device, where N+1's inputs take them
(`DeviceTokens`), and travel to the host through a pinned buffer behind a CUDA event (`PendingTokens`); the engine
collects them with `LaunchedStep.result()` while the device runs N+1. One thread, so no hand-over of the GIL between
the engine's scheduling and the step's launch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagemill.core.sched_output import ModelRunnerOutput


@dataclass
class DeviceTokens:
    """A launched step's sampled tokens on the device, and where each input-batch row's token is in them."""

    tokens: torch.Tensor  # [num sampled] on the device
    index_of_row: np.ndarray  # [max_num_reqs]: the row's index in `tokens`, -1 if it sampled nothing
    epochs: np.ndarray  # InputBatch.row_epoch of each sampled row when it sampled

    def index_of(self, rows: np.ndarray, row_epoch: np.ndarray) -> np.ndarray:
        """Where in `tokens` the tokens sampled for input-batch `rows` are (each row must have sampled in this step,
        for the request that still holds the row)."""
        idx = self.index_of_row[rows]
        if (idx < 0).any() or (self.epochs[np.maximum(idx, 0)] != row_epoch[rows]).any():
            raise RuntimeError("async scheduling: a step's input token was sampled by no step in flight")
        return idx


@dataclass
class PendingTokens:
    """A launched step's sampled tokens on their way to the host: what `finish` needs to record them."""

    tokens: torch.Tensor  # on the device
    host: torch.Tensor  # the pinned host copy (filled once `event` has passed; the tokens themselves on the CPU)
    event: torch.cuda.Event | None
    raw_logprobs: torch.Tensor | None
    sample_idx: np.ndarray  # step-order index of each sampling request
    sample_rows: np.ndarray  # their input-batch rows
    epochs: np.ndarray  # the rows' epochs when sampled
    req_ids: list[str]  # the step's request ids, in step order

    def wait(self) -> list[int]:
        """The tokens on the host (waits for the device to get there)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class LaunchedStep:
    """A step whose device work is queued; `result()` waits for its sampled tokens and records them (once)."""

    def __init__(self, output: ModelRunnerOutput, finish: Callable[[ModelRunnerOutput], None] | None) -> None:
        self._output, self._finish = output, finish
        self._error: BaseException | None = None

    def done(self) -> bool:
        """Whether the tokens are recorded (or recording them failed)."""
        return self._finish is None

    def result(self) -> ModelRunnerOutput:
        """The step's output, its sampled tokens recorded; an error from the device is raised here (every time)."""
        if self._finish is not None:
            finish, self._finish = self._finish, None
            try:
                finish(self._output)
            except BaseException as e:
                self._error = e
        if self._error is not None:
            raise self._error
        return self._output
