"""What the two engine fronts (async_engine.AsyncEngine: the engine loop in a thread of this
process; engine_client.EngineProcess: the engine in a process of its own) share with the serving
layer and the command: their errors and the engine thread's default pacing. Torch-free, so the
API process of --engine-process imports no engine module."""

from __future__ import annotations

# the engine thread's pacing of hand-offs to the event loop: seconds per live stream (see
# async_engine's docstring)
STREAM_INTERVAL_S = 0.0005


class QueueFull(Exception):
    """More sequences asked for than the waiting queue holds (a 429)."""


class EngineDead(Exception):
    """The engine loop stopped on an exception: nothing can be served (a 503)."""
