"""Grammar compilation off the step loop: one worker thread and a cache keyed by the constraint.

A request's constraint is parsed in the caller's thread (StructuredOutputs.grammar_object, so a
bad constraint raises there) and compiled against the tokenizer here, in the background: the
request gets a GrammarHandle at once, waits in the scheduler's queue until its handle is ready
(the rest of the batch keeps stepping), and a request whose compilation fails ends alone with
its error. Equal constraints share one compilation (and one CompiledGrammar) for the service's
lifetime.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from hf_paged.structured_output.constraint import StructuredOutputs, import_xgrammar


class GrammarHandle:
    """A request's compiled grammar, once the worker has it."""

    __slots__ = ("constraint", "future")

    def __init__(self, constraint: StructuredOutputs, future: Future) -> None:
        self.constraint = constraint
        self.future = future

    @property
    def ready(self) -> bool:
        """Compiled and usable (a failed compilation is done but never ready)."""
        return self.future.done() and self.future.exception() is None

    @property
    def failed(self) -> bool:
        return self.future.done() and self.future.exception() is not None

    @property
    def error(self) -> BaseException | None:
        return self.future.exception() if self.future.done() else None

    @property
    def compiled(self):
        return self.future.result()[0]

    @property
    def seconds(self) -> float:
        """Wall time its compilation took (0 for a cache hit on a finished compilation)."""
        return self.future.result()[1]


class GrammarService:
    """Compiles constraints for one tokenizer. vocab_size: the model's logits width (may exceed
    the tokenizer's: padded entries are never allowed)."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        xgr = import_xgrammar()
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # xgrammar parallelises one compilation internally; the worker keeps it off the caller
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=2)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_paged-grammar")
        self._cache: dict[tuple[str, str], Future] = {}
        self._lock = threading.Lock()

    def submit(self, constraint: StructuredOutputs) -> GrammarHandle:
        """Parse now (ValueError naming the field when the constraint is bad), compile in the
        background (a cache hit shares the earlier compilation)."""
        key = constraint.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not future.cancelled():
                return GrammarHandle(constraint, future)
        grammar = constraint.grammar_object()
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._pool.submit(self._compile, constraint, grammar)
                self._cache[key] = future
        return GrammarHandle(constraint, future)

    def _compile(self, constraint: StructuredOutputs, grammar):
        t0 = time.perf_counter()
        try:
            compiled = self._compiler.compile_grammar(grammar)
        except Exception as exc:
            with self._lock:  # a failure is not cached: a later request may retry
                self._cache.pop(constraint.key, None)
            raise ValueError(f"{constraint.field_name}: cannot compile: {exc}") from None
        return compiled, time.perf_counter() - t0

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
