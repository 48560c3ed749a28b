"""Steps in flight through a group of workers (vLLM's `execute_model(..., non_block=True)`): with pipeline
parallelism each stage works on its own micro-batch, so the engine core submits a step before the previous one's
output is back. Outputs come back in submission order; the tokens the driver rank sampled reach the other ranks with
the next step submitted after they are known (the scheduler holds a request back until its batch's output is in, so
a request never runs again before every rank has its tokens)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from pagemill.core.sched_output import ModelRunnerOutput


class StepFuture:
    """One submitted step; result() waits for the driver rank's output (after the steps submitted before it)."""

    def __init__(self, steps: InFlightSteps | None, wait: Callable[[], ModelRunnerOutput]) -> None:
        self._steps, self._wait = steps, wait
        self._output: ModelRunnerOutput | None = None
        self._error: BaseException | None = None

    @classmethod
    def completed(cls, output: ModelRunnerOutput) -> StepFuture:
        """A step that ran to the end in the caller's thread."""
        future = cls(None, lambda: output)
        future._output = output
        return future

    def done(self) -> bool:
        """Whether the output (or the error) is in."""
        return self._output is not None or self._error is not None

    def result(self) -> ModelRunnerOutput:
        """The step's output; the error that failed it (e.g. WorkerDiedError) is raised here."""
        if not self.done():
            assert self._steps is not None
            self._steps.resolve_through(self)
        if self._error is not None:
            raise self._error
        assert self._output is not None
        return self._output


class InFlightSteps:
    """The executor's steps not yet collected, in submission order, and the sampled tokens the non-driver ranks
    have not been sent yet."""

    def __init__(self) -> None:
        self._pending: deque[StepFuture] = deque()
        self._sampled: dict[str, list[int]] = {}
        self.max_in_flight = 0  # the most steps ever in flight at once (pipeline micro-batches)

    def submit(self, send: Callable[[dict[str, list[int]]], Callable[[], ModelRunnerOutput]]) -> StepFuture:
        """send(sampled tokens not yet sent) starts the step on the workers and returns what waits for its output."""
        sampled, self._sampled = self._sampled, {}
        future = StepFuture(self, send(sampled))
        self._pending.append(future)
        self.max_in_flight = max(self.max_in_flight, len(self._pending))
        return future

    def resolve_through(self, future: StepFuture) -> None:
        """Collect the outputs of the pending steps up to and including `future`, oldest first."""
        while not future.done():
            self._resolve_oldest()

    def drain(self) -> None:
        """Collect every pending step's output (before a call whose replies would queue behind them)."""
        while self._pending:
            self._resolve_oldest()

    def _resolve_oldest(self) -> None:
        step = self._pending.popleft()
        try:
            step._output = step._wait()
        except BaseException as e:  # the workers are gone: every later step fails the same way
            for s in (step, *self._pending):
                s._error = e
            self._pending.clear()
            return
        self._sampled.update(step._output.sampled)
