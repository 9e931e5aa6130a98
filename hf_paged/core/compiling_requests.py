"""Structured output: the requests added before their grammar compiled. They wait in the
scheduler's queue, skipped by its waiting loop until the grammar is ready; the engine ends those
whose grammar fails (Scheduler.end_failed_grammars) and, when nothing could be scheduled, blocks
on them here rather than spinning."""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures

from hf_paged.core.request import Request


class CompilingRequests:
    def __init__(self) -> None:
        self.requests: list[Request] = []

    def __bool__(self) -> bool:
        return bool(self.requests)

    def add(self, request: Request) -> None:
        if request.grammar is not None and not request.grammar.ready:
            self.requests.append(request)

    def take_failed(self) -> list[Request]:
        """Forget the requests whose compile ended (or that ended); returns those whose grammar
        failed, the ValueError naming the field on request.error."""
        if not self.requests:
            return []
        done = [r for r in self.requests if r.status.finished or r.grammar.future.done()]
        if not done:
            return []
        self.requests = [r for r in self.requests if r not in done]
        failed = [r for r in done if not r.status.finished and r.grammar.failed]
        for r in failed:
            r.error = r.grammar.error
        return failed

    def wait(self, timeout: float = 0.05) -> None:
        """Block until a grammar compiles, or the timeout."""
        pending = [r.grammar.future for r in self.requests if not r.status.finished]
        if pending:
            wait_futures(pending, timeout=timeout, return_when=FIRST_COMPLETED)
