"""An Engine's start-up seconds by phase (worker/startup_times.py): every phase timed where it
runs, the first compiled forward counted as compile, logged once; the CUDA-only phases (kernel
warm-up, graph capture) driven on the CPU with stand-ins."""

from __future__ import annotations

import logging
import time
import types

import pytest
import torch

from hf_paged import Engine
from hf_paged.config import EngineConfig
from hf_paged.worker import startup
from hf_paged.worker.startup_times import PHASES, StartupTimes, format_startup

KEYS = {f"{name}_s" for name in PHASES} | {"total_s", "decode_graphs", "mixed_graphs"}


def _slowed(fn, seconds: float):
    def slow(*args, **kwargs):
        time.sleep(seconds)
        return fn(*args, **kwargs)

    return slow


def test_each_phase_lands_in_its_key_and_the_phases_add_up_to_the_total(
    tiny_model, monkeypatch, caplog
):
    from hf_paged.engine import engine as engine_module
    from hf_paged.worker import model_runner

    # each phase made slower by a known amount where it runs
    delays = {"fuse_projections": 0.05, "kv_sizing": 0.1, "verify_model": 0.15}
    for module, name, phase in (
        (engine_module, "fuse_projections", "fuse_projections"),
        (model_runner, "determine_num_blocks", "kv_sizing"),
        (engine_module, "verify_model", "verify_model"),
    ):
        monkeypatch.setattr(module, name, _slowed(getattr(module, name), delays[phase]))
    model = tiny_model("llama")
    # modules imported on first use (Triton's, ~0.3 s) land in "other": the first Engine of this
    # test process pays them, which depends on the order tests run in, so one runs untimed first
    Engine(tiny_model("llama"), verify_model=False).shutdown()
    t0 = time.perf_counter()
    with caplog.at_level(logging.INFO, logger="hf_paged"):
        engine = Engine(model)
    wall = time.perf_counter() - t0
    stats = engine.startup_stats
    assert set(stats) == KEYS
    assert all(stats[f"{name}_s"] >= 0 for name in PHASES)
    assert sum(stats[f"{name}_s"] for name in PHASES) == pytest.approx(stats["total_s"], abs=1e-6)
    assert wall - 0.05 < stats["total_s"] <= wall
    for phase, seconds in delays.items():
        assert seconds <= stats[f"{phase}_s"] < seconds + 0.5 * wall
    # the named phases cover the start-up: what none covers is small
    assert stats["other_s"] < 0.25 * stats["total_s"]
    assert stats["compile_s"] == 0 and stats["decode_graphs"] == stats["mixed_graphs"] == 0  # CPU
    logged = [r for r in caplog.records if "start-up" in r.getMessage()]
    assert len(logged) == 1 and logged[0].levelno == logging.INFO
    assert logged[0].getMessage() == f"hf_paged: {format_startup(stats)}"
    assert all(f"{phase.replace('_', ' ')} " in logged[0].getMessage() for phase in delays)


def test_compile_inside_a_phase_counts_as_compile():
    clock = StartupTimes()
    clock.forward = types.SimpleNamespace(compile_seconds=0.0)  # a ModelForward's counter
    with clock.phase("kv_sizing"):
        time.sleep(0.05)
        t0 = time.perf_counter()
        time.sleep(0.3)  # the first compiled forward
        clock.forward.compile_seconds += time.perf_counter() - t0
    stats = clock.finish()
    assert 0.3 <= stats["compile_s"] < 0.55
    assert 0.05 <= stats["kv_sizing_s"] < 0.3  # without the compile's 0.3 s
    with pytest.raises(ValueError, match="start-up phase"):
        with clock.phase("other"):  # the remainder is computed, never timed
            pass


def test_model_forward_times_its_first_compiled_forward_only(tiny_model, monkeypatch):
    engine = Engine(tiny_model("llama"), compile=False)
    forward = engine.runner.forward
    assert engine.runner.startup.forward is forward and forward.compile_seconds == 0
    forward.compiled, forward._compile_ok = True, False  # as a compiled forward not run yet
    monkeypatch.setattr(forward, "_dispatch", lambda *a: time.sleep(0.2) or torch.zeros(1, 8))
    ids, positions, keep = torch.zeros(4, dtype=torch.long), torch.arange(4), torch.tensor([3])
    forward(ids, positions, keep)  # compiles
    forward(ids, positions, keep)  # runs the compiled graph
    assert 0.2 <= forward.compile_seconds < 0.4  # the first call's 0.2 s, not the second's


class _FakeGraphs:
    """CudaGraphRunner's start-up surface: its buckets and a capture taking 0.3 s."""

    def __init__(self, runner) -> None:
        self.buckets, self.token_buckets = [1, 2, 4], [32, 64]
        self.calls = []

    def forward_each_bucket(self) -> None:
        self.calls.append("forward_each_bucket")

    def capture(self) -> None:
        self.calls.append("capture")
        time.sleep(0.3)


def test_kernel_warm_up_and_graph_capture_are_timed_with_the_graph_counts(
    tiny_model, monkeypatch, tmp_path
):
    from hf_paged.worker import cuda_graphs

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # the compile-ahead marker goes here

    monkeypatch.setattr(startup, "warm_up_kernels", lambda *a, **k: time.sleep(0.05))
    monkeypatch.setattr(cuda_graphs, "CudaGraphRunner", _FakeGraphs)
    backend = types.SimpleNamespace(name="triton", graph_safe=True)
    runner = types.SimpleNamespace(
        device=torch.device("cuda"), backend=backend, model=tiny_model("llama"),
        forward=None, kv_caches=[], lora=False,
    )  # fmt: skip
    clock = StartupTimes()
    graphs = startup.capture_graphs(runner, EngineConfig(), clock)
    stats = clock.finish()
    assert isinstance(graphs, _FakeGraphs)
    assert 0.05 <= stats["kernel_warm_up_s"] < 0.3  # not the capture's 0.3 s too
    assert 0.3 <= stats["graph_capture_s"] < 0.55
    assert (stats["decode_graphs"], stats["mixed_graphs"]) == (3, 2)
    assert "5 CUDA graphs (3 decode + 2 mixed-step)" in format_startup(stats)
    # graphs off: the warm-up still runs, nothing is captured
    clock = StartupTimes()
    assert startup.capture_graphs(runner, EngineConfig(cuda_graphs=False), clock) is None
    stats = clock.finish()
    assert stats["kernel_warm_up_s"] >= 0.05 and stats["graph_capture_s"] == 0
    assert stats["decode_graphs"] == stats["mixed_graphs"] == 0


def test_compiles_ahead_while_the_cache_is_cold_only(tiny_model, monkeypatch, tmp_path):
    """A cold start records (a warm-up and each bucket's first forward), compiles ahead and
    leaves its marker; the next start-up of the same model and options finds it and runs the
    warm-up and the captures without recording; another model compiles ahead again."""
    from hf_paged.worker import compile_ahead, cuda_graphs

    if not compile_ahead.CompileAhead().available:
        pytest.skip("this Triton has no compile hooks")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    warm_ups = []
    monkeypatch.setattr(startup, "warm_up_kernels", lambda *a, **k: warm_ups.append(1))
    compiled = []
    monkeypatch.setattr(compile_ahead.CompileAhead, "compile", lambda self: compiled.append(1))
    monkeypatch.setattr(cuda_graphs, "CudaGraphRunner", _FakeGraphs)
    backend = types.SimpleNamespace(name="triton", graph_safe=True)

    def start(model):
        runner = types.SimpleNamespace(
            device=torch.device("cuda"), backend=backend, model=model, forward=None,
            kv_caches=[], lora=False,
        )  # fmt: skip
        warm_ups.clear(), compiled.clear()
        graphs = startup.capture_graphs(runner, EngineConfig(), StartupTimes())
        return graphs.calls, len(warm_ups), len(compiled)

    model = tiny_model("llama")
    assert start(model) == (["forward_each_bucket", "capture"], 2, 1)
    assert len(list((tmp_path / "hf_paged_compiled_ahead").iterdir())) == 1
    assert start(model) == (["capture"], 1, 0)
    assert start(tiny_model("qwen2")) == (["forward_each_bucket", "capture"], 2, 1)
