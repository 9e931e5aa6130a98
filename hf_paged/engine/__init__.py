"""The engine: requests in (input_processor), one scheduled step at a time (core), outputs out
(output_processor, stream), behind the thread-safe public API (engine.Engine)."""

from hf_paged.engine.engine import Engine

__all__ = ["Engine"]
