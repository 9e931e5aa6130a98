"""xgrammar's two batched matcher calls (accept a token a row, fill the rows' bitmask) with no
per-row Python around them.

Why: the grammar's work for a step runs on a helper thread beside the step loop, which holds the
GIL nearly all the time (logits_mask.GrammarJob). xgrammar's public batch calls wrap its FFI
functions in Python that walks the rows: a list of the matchers' handles going in, and for the
accept a list built from the result one FFI call an entry coming out. Each of those calls gives
the GIL up and waits to get it back, so on the helper these loops cost far more than the work
(256 rows of LONG_SCHEMA on a 2-core CPU, `grammar_mask_bench.py`: the public batch accept
1.23 ms a step against 0.81 ms here, alone; its result's conversion took 0.56 ms by itself and
5.5 ms beside a busy thread). Here the handles are taken once per matcher (on the step loop, as
the row is set up), the FFI functions are called with them directly, and the accept's result is
read with one call in the common case (every token accepted).

The FFI functions and the matchers' handles are xgrammar internals (xgrammar.base._core,
GrammarMatcher._handle, as its own batch calls use them); where they are missing (another
xgrammar version), the public calls run instead: the same results, slower.
"""

from __future__ import annotations

import functools

from hf_paged.structured_output.constraint import import_xgrammar


@functools.cache
def _core():
    """xgrammar's FFI module where this xgrammar has the internals used here, else None."""
    xgr = import_xgrammar()
    try:
        from xgrammar.base import _core as core
    except ImportError:
        return None
    batch = getattr(core, "BatchGrammarMatcher", None)
    if not hasattr(batch, "batch_accept_token") or not hasattr(xgr.GrammarMatcher, "_handle"):
        return None
    return core


def handle(matcher):
    """What the batch calls take for this matcher (RowMatcher keeps it)."""
    return matcher._handle if _core() is not None else matcher


class BatchCalls:
    """The accept and fill of a step's rows, on handles from handle()."""

    def __init__(self, max_threads: int) -> None:
        xgr = import_xgrammar()
        self._batch = xgr.BatchGrammarMatcher(max_threads=max_threads)
        self._core = _core()
        if self._core is None:
            self._accept, self._fill = xgr.BatchGrammarMatcher.batch_accept_token, None
        else:
            self._accept = self._core.BatchGrammarMatcher.batch_accept_token
            self._fill = self._batch._handle.batch_fill_next_token_bitmask

    def accept(self, handles: list, tokens: list[int]):
        """Accept tokens[i] on handles[i]; the result goes to all_accepted() / accepted()."""
        if self._core is None:
            return self._accept(handles, tokens)
        return self._accept(handles, tokens, False)

    @staticmethod
    def all_accepted(result) -> bool:
        """Whether every row took its token (one containment call on the FFI array)."""
        return 0 not in result

    @staticmethod
    def accepted(result) -> list[bool]:
        return [bool(ok) for ok in result]

    def fill(self, handles: list, bitmask, rows: list[int]) -> None:
        """Fill bitmask[rows[i]] with the tokens handles[i] allows next."""
        if self._core is None:
            self._batch.batch_fill_next_token_bitmask(handles, bitmask, rows)
        else:
            self._fill(handles, bitmask, rows, False)
