"""A faster Triton interpreter for the CPU suite: nested @triton.jit calls skip a redundant patch.

Triton's interpreter swaps triton.language's builtins for interpreted ones while a kernel runs:
GridExecutor.__call__ (a launch) patches them, runs every program of the grid, and restores
them. But InterpretedFunction.__call__ (a @triton.jit helper called from inside a kernel)
patches them again on every call, in every program, and keeps no record to restore: the
launch's restore puts every attribute back anyway. Each of those patches walks four modules
with inspect.getmembers (~1 ms here), and a kernel whose programs call helpers pays it
hundreds of times a launch: a third of test_spec_decode's draft-graph tests was spent there
(cProfile, triton 3.x on this 2-core CPU).

install() makes a helper call inside a launch skip the patch when every triton.language module
the helper's globals see (what _patch_lang would patch) was patched in this launch already, by
the launch or by an earlier helper call (Triton's own helpers, tl.sum and the like, see
triton.language.core, which a kernel module importing triton.language does not), and run the
helper as the interpreter does otherwise. Outside a launch, or for a helper that sees a module
not patched yet in this launch, the interpreter's own path runs unchanged. Semantics are the
interpreter's: the builtins a helper calls are the patched ones either way.
"""

from __future__ import annotations

import inspect
import threading


def install() -> bool:
    """Install the shortcut (idempotent); False where this Triton lacks the parts it wraps."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except ImportError:
        return False
    grid_call = getattr(interp.GridExecutor, "__call__", None)
    fn_call = getattr(interp.InterpretedFunction, "__call__", None)
    if grid_call is None or fn_call is None or getattr(fn_call, "_hf_paged", False):
        return False
    if not all(hasattr(interp, n) for n in ("_patch_lang", "InterpreterError")):
        return False
    local = threading.local()  # the triton.language modules the running launch patched
    seen: dict = {}

    def lang_modules(fn) -> frozenset:
        """The modules _patch_lang(fn) patches: tl and tl.core where fn's globals hold them."""
        key = id(fn.__globals__)
        if key not in seen:
            seen[key] = frozenset(
                id(v)
                for v in list(fn.__globals__.values())
                if inspect.ismodule(v) and v in (tl, tl.core)
            )
        return seen[key]

    def launch(self, *args, **kwargs):
        outer = getattr(local, "patched", None)
        local.patched = lang_modules(self.fn)
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            local.patched = outer

    def helper(self, *args, **kwargs):
        patched = getattr(local, "patched", None)
        langs = lang_modules(self.fn)
        if patched is None or not langs <= patched:
            if patched is not None:  # the interpreter's call patches them (for good): once
                local.patched = patched | langs
            return fn_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interp.InterpreterError(repr(e)) from e

    helper._hf_paged = True
    interp.GridExecutor.__call__ = launch
    interp.InterpretedFunction.__call__ = helper
    return True
