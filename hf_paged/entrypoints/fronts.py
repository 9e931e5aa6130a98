"""What the two engine fronts (async_engine.AsyncEngine: the engine loop in a thread of this
process; engine_client.EngineProcess: the engine in a process of its own) share with the serving
layer and the command: their errors, the engine thread's default pacing, and the request handle's
waiting. Torch-free, so the API process of --engine-process imports no engine module."""

from __future__ import annotations

import asyncio

# the engine thread's pacing of hand-offs to the event loop: seconds per live stream (see
# async_engine's docstring)
STREAM_INTERVAL_S = 0.0005


class QueueFull(Exception):
    """More sequences asked for than the waiting queue holds (a 429)."""


class EngineDead(Exception):
    """The engine loop stopped on an exception: nothing can be served (a 503)."""


class StreamHandle:
    """One HTTP request's engine requests, as the serving layer reads them: their outputs in
    arrival order, batch by batch. A front's handle says where outputs come from (_poll)."""

    def __init__(self, front, request_ids: list[str], model_name: str | None) -> None:
        self.front = front
        self.model_name = model_name  # the served model the client asked for (metrics' label)
        self.request_ids = request_ids  # choice order: prompt by prompt, n each
        self.index = {rid: i for i, rid in enumerate(request_ids)}
        self._unfinished = set(request_ids)
        self._event = asyncio.Event()
        self.closed = False
        self.error: BaseException | None = None

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def _poll(self) -> list:
        """The outputs delivered since the last call."""
        raise NotImplementedError

    def _drop(self, request_ids: list[str]) -> None:
        """End these unfinished requests in the engine; nobody reads their outputs any more."""
        raise NotImplementedError

    def _abort_rest(self) -> None:
        """close(): end whatever of this handle the engine still runs."""
        self._drop(sorted(self._unfinished))

    def end_early(self, request_id: str) -> None:
        """This choice is done though the engine still runs it (a stop string the output side
        found first): free it now."""
        if request_id in self._unfinished:
            self._unfinished.discard(request_id)
            self._drop([request_id])
            if self.finished:
                self.front._release(self)

    def close(self) -> None:
        """Abort whatever is unfinished and forget the handle (idempotent)."""
        if self.closed:
            return
        self._take()  # requests that ended but were not read yet still count (metrics)
        self._abort_rest()
        self._unfinished.clear()
        self.front._release(self)

    def _take(self) -> list:
        """The outputs delivered so far; a finished one goes to the front's hooks (metrics)."""
        outs = self._poll()
        for out in outs:
            if out.finished:
                self._unfinished.discard(out.request_id)
                self.front._finished(out, self.model_name)
        return outs

    async def next_outputs(self) -> list:
        """Wait for outputs, then return every one delivered so far ([] once all finished)."""
        while True:
            outs = self._take()
            if outs:
                if self.finished:
                    self.front._release(self)
                return outs
            if self.finished:
                return []
            if self.error is not None:
                raise EngineDead(str(self.error)) from self.error
            self._event.clear()
            await self._event.wait()
