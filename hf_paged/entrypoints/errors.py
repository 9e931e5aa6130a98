"""What the engine fronts (async_engine.AsyncEngine, engine_client.EngineProcess) raise to the
serving layer: torch-free, so the API process of --engine-process needs no engine import."""

from __future__ import annotations


class QueueFull(Exception):
    """More sequences asked for than the waiting queue holds (a 429)."""


class EngineDead(Exception):
    """The engine loop stopped on an exception: nothing can be served (a 503)."""
