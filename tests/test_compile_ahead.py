"""worker/compile_ahead.py: start-up's Triton variants recorded without compiling or launching,
then compiled together. The hook logic with a stand-in for Triton's knobs (any machine); the
real path on a GPU (a fresh kernel, an empty Triton cache)."""

from __future__ import annotations

import threading
import types

import pytest
import torch
import triton.language as tl

from hf_paged.worker.compile_ahead import CompileAhead

ON_GPU = torch.cuda.is_available()


class _Kernel:
    """A JITFunction's preload, counted (fails for the spec "bad")."""

    def __init__(self) -> None:
        self.preloaded = []

    def preload(self, spec: str) -> None:
        if spec == "bad":
            raise RuntimeError("no such variant")
        self.preloaded.append(spec)


def _launch(runtime, kernel, spec: str):
    """What Triton's launch does with the hook: the hook's True means skip."""
    info = types.SimpleNamespace(jit_function=kernel)
    return runtime.jit_cache_hook(
        key=spec, repr=spec, fn=info, compile={"specialization_data": spec},
        is_manual_warmup=False, already_compiled=False,
    )  # fmt: skip


def test_records_and_skips_this_threads_launches_only_and_restores_the_hook():
    seen_by_previous = []

    def previous(**kwargs):
        seen_by_previous.append(kwargs["compile"]["specialization_data"])
        return None

    runtime = types.SimpleNamespace(jit_cache_hook=previous)
    ahead = CompileAhead(max_workers=2)
    ahead.runtime = runtime
    kernel = _Kernel()
    with ahead.recording():
        assert _launch(runtime, kernel, "a") is True  # skipped
        assert _launch(runtime, kernel, "a") is True  # the same variant, once
        assert _launch(runtime, kernel, "b") is True
        other = []
        t = threading.Thread(target=lambda: other.append(_launch(runtime, kernel, "c")))
        t.start()
        t.join()
        assert other == [None]  # another thread compiles and launches as usual
    assert runtime.jit_cache_hook is previous
    assert seen_by_previous == ["c"]
    assert sorted(ahead.variants) == ["a", "b"]
    assert ahead.compile() == 2
    assert sorted(kernel.preloaded) == ["a", "b"]
    assert ahead.variants == {} and ahead.compile() == 0


def test_a_variant_that_fails_ahead_is_left_to_its_launch():
    runtime = types.SimpleNamespace(jit_cache_hook=None)
    ahead = CompileAhead()
    ahead.runtime = runtime
    kernel = _Kernel()
    with ahead.recording():
        _launch(runtime, kernel, "bad")
        _launch(runtime, kernel, "ok")
    assert runtime.jit_cache_hook is None
    assert ahead.compile() == 1  # no exception: the launch compiles "bad" and raises there
    assert kernel.preloaded == ["ok"]


def test_without_triton_hooks_recording_changes_nothing():
    ahead = CompileAhead()
    ahead.runtime = None
    assert not ahead.available
    with ahead.recording():
        pass
    assert ahead.compile() == 0


def _add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1.0, mask=mask)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_recorded_launch_runs_nothing_and_is_compiled_before_it_runs_gpu(tmp_path, monkeypatch):
    import triton

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # cold: an empty on-disk cache
    kernel = triton.jit(_add_one)  # a fresh JITFunction: nothing compiled in memory
    x = torch.zeros(64, device="cuda")
    ahead = CompileAhead()
    assert ahead.available
    with ahead.recording():
        kernel[(1,)](x, 64, BLOCK=64)
    torch.cuda.synchronize()
    assert (x == 0).all()  # neither compiled nor launched
    assert len(ahead.variants) == 1
    assert ahead.compile() == 1
    compiles = []
    runtime = triton.knobs.runtime
    previous = runtime.jit_post_compile_hook
    runtime.jit_post_compile_hook = lambda **kw: compiles.append(kw["key"])
    try:
        kernel[(1,)](x, 64, BLOCK=64)
    finally:
        runtime.jit_post_compile_hook = previous
    torch.cuda.synchronize()
    assert (x == 1).all()
    assert compiles == []  # compiled ahead: the launch found it
