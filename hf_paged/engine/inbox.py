"""The engine's inbox: admissions and deferred aborts queued by any thread, run by the next step.

Adding a request never waits behind a step in progress: it validates in the caller's thread and
leaves an action here. The step runs the actions in order under its lock, at its start. Request
ids are reserved while queued, so no id can be added twice between the check and the admission.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Container


class Inbox:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._actions: list[Callable[[], None]] = []
        self.reserved: set[str] = set()  # request ids queued here, not admitted yet

    def submit(self, req_ids: list[str], action: Callable[[], None], live: Container) -> None:
        """Queue an admission, refusing ids already live or queued (checked under the inbox
        lock, which the step's admission holds too)."""
        with self._lock:
            for rid in req_ids:
                if rid in live or rid in self.reserved:
                    raise ValueError(f"request_id {rid!r} already exists")
            self.reserved.update(req_ids)
            self._actions.append(action)

    def defer(self, action: Callable[[], None]) -> None:
        """Queue an action (an abort that arrived while a step runs)."""
        with self._lock:
            self._actions.append(action)

    def knows(self, req_id: str, live: Container) -> bool:
        with self._lock:
            return req_id in live or req_id in self.reserved

    def run(self) -> None:
        """Run what is queued, in order (under the step lock, at the start of a step)."""
        if not self._actions:  # the usual step: nothing new (an empty inbox reserves no id)
            return
        with self._lock:
            actions, self._actions = self._actions, []
            for action in actions:
                action()
            self.reserved.clear()

    def __bool__(self) -> bool:
        return bool(self._actions)
