"""A request's structured-output state in the engine core: its grammar matcher, compiled in the background."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from collections.abc import Callable
from typing import Any

from pagemill.reasoning.token_gate import ReasoningGate
from pagemill.structured_output.grammar_spec import GrammarSpec

logger = logging.getLogger(__name__)


class StructuredOutputRequest:
    """The matcher of one sequence (each n > 1 sibling has its own), ready once its compile job finishes.

    The matcher follows the request's output tokens only, so preemption (recompute or swap) and prefix-cache hits,
    which recompute KV but never re-sample tokens, leave it correct.

    With a reasoning parser, `reasoning` follows the thinking first: the grammar sees only the tokens after its
    end marker (and a request with a thinking budget but no constraint has no grammar at all: spec None).
    """

    def __init__(self, request_id: str, spec: GrammarSpec | None, backend: str, future: Future,
                 on_free: Callable[[], None] | None = None, reasoning: ReasoningGate | None = None) -> None:
        """(See the class docstring.)"""
        self.reasoning = reasoning
        self.request_id = request_id
        self._on_free = on_free
        self.spec = spec
        self.backend = backend
        self._future = future
        self._grammar: Any = None
        self.num_rejected = 0

    def is_ready(self) -> bool:
        """True once the compile job finished (successfully or not)."""
        return self._grammar is not None or self._future.done()

    @property
    def error(self) -> BaseException | None:
        """The compile error, if the job failed."""
        return self._future.exception() if self._grammar is None and self._future.done() else None

    @property
    def grammar(self) -> Any:
        """The matcher (blocks until compiled)."""
        if self._grammar is None:
            self._grammar = self._future.result()
        return self._grammar

    @property
    def in_reasoning(self) -> bool:
        """True while the model is thinking (no grammar applies yet)."""
        return self.reasoning is not None and not self.reasoning.ended

    @property
    def constrains(self) -> bool:
        """True when the grammar applies to the next token (it exists and the thinking, if any, has ended)."""
        return self.spec is not None and not self.in_reasoning

    def forced_token(self) -> int | None:
        """The token a spent thinking budget forces next (None: none)."""
        return self.reasoning.forced_token() if self.reasoning is not None else None

    def accept_token(self, token: int) -> bool:
        """Advance the matcher by a sampled token; a rejected token (should not happen: it was masked) is logged."""
        if self.reasoning is not None and self.reasoning.accept(token):
            return True  # a thinking token (or its end marker): not the grammar's
        if self.spec is None:
            return True
        if self.grammar.accept_token(token):
            return True
        self.num_rejected += 1
        logger.warning("request %s: token %d rejected by its %s grammar", self.request_id, token, self.backend)
        return False

    def is_terminated(self) -> bool:
        """True once the grammar has ended: the request finishes with reason "stop"."""
        return self.constrains and self.grammar.is_terminated()

    def free(self) -> None:
        """Drop the matcher (finished or aborted request); idempotent."""
        if self._on_free is not None:
            self._on_free()
            self._on_free = None
        self._future.cancel()
        self._grammar = None
        self._future = _DONE

_DONE: Future = Future()
_DONE.set_result(None)
