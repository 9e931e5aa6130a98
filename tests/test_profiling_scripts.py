"""evals/profiling/ scripts run as users run them (`python evals/profiling/NAME.py`): they import
their shared set-up, parse one CLI style, and host_overhead.py measures on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROFILING = Path(__file__).resolve().parents[1] / "evals" / "profiling"


def _run(*args: str, env: dict[str, str] | None = None) -> str:
    out = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=PROFILING, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.parametrize(
    "script",
    [
        "engine_bench.py",
        "kernel_bench.py",
        "lora_bench.py",
        "lora_kernel_bench.py",
        "fp8_gemv_bench.py",
        "gemm_rows_bench.py",
        "fp8_attention_bench.py",
        "structured_step_parts.py",
    ],
)
def test_gpu_scripts_parse_their_flags(script):
    text = _run(str(PROFILING / script), "--help")
    assert text.startswith("usage:")
    if script == "engine_bench.py":  # every engine option is a flag
        for flag in ("--small-batch-rows", "--compile", "--max-graph-tokens", "--shape"):
            assert flag in text


def test_kernel_sass_compiles_a_kernel_for_the_h200_without_a_gpu():
    script = str(PROFILING / "kernel_sass.py")
    # compiled, not interpreted: the tests' TRITON_INTERPRET=1 left out, and refused when set
    compiled = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    text = _run(script, "fp8_gemv:_fp8_gemv_reduce_kernel", "--const", "BLOCK=1024",
                "HAS_BIAS=False", "--type", "part_ptr=*fp32", env=compiled)  # fmt: skip
    assert "for sm_90" in text and "'REG':" in text
    assert "'LDG.E':" in text and "FADD" in text  # the float32 partial sums' loads and adds
    out = subprocess.run(
        [sys.executable, script, "fp8_gemv:_fp8_gemv_reduce_kernel", "--const", "BLOCK=1024"],
        capture_output=True, text=True, timeout=300, cwd=PROFILING, env=compiled,
    )  # fmt: skip
    assert out.returncode != 0 and "missing ['HAS_BIAS']" in out.stderr
    out = subprocess.run(
        [sys.executable, script, "fp8_gemv:_fp8_gemv_reduce_kernel"], capture_output=True,
        text=True, timeout=300, cwd=PROFILING, env={**compiled, "TRITON_INTERPRET": "1"},
    )  # fmt: skip
    assert out.returncode != 0 and "without TRITON_INTERPRET=1" in out.stderr


def test_host_overhead_measures_each_phase_on_the_cpu():
    # (with two LoRA adapters over the requests: the engine's multi-LoRA step on the host)
    args = ("--running", "4", "--steps", "3", "--adapters", "2")
    text = _run(str(PROFILING / "host_overhead.py"), *args)
    assert "4 running requests, 2 LoRA adapters" in text
    rows = {line[:34].strip(): line for line in text.splitlines()[1:] if line.strip()}
    assert {"step()", "schedule", "update", "slowest step"} <= set(rows)
    step_ms = float(rows["step()"].split()[-2])
    assert step_ms > 0


def test_concurrent_generate_compares_threads_with_one_thread_on_the_cpu():
    text = _run(
        str(PROFILING / "concurrent_generate.py"),
        *("--shape", "smollm2-135m", "--dtype", "float32", "--threads", "2", "--calls", "1"),
        *("--prompt-len", "8", "--new-tokens", "3"),
    )
    assert "| 2 threads at once |" in text and "ratio concurrent / one thread:" in text
    assert "outputs equal to the one-thread reference: 2/2; errors: 0" in text
    assert "after: rows held 0, all KV blocks free: True" in text


def test_serve_overhead_runs_offline_and_the_server_on_a_stubbed_forward():
    args = ["--clients", "4", "--new-tokens", "6", "--gpu-ms", "1", "--stream-interval-ms", "0,5"]
    args += ["--gpu-us-per-token", "5", "--prompt-len", "30,40"]
    text = _run(str(PROFILING / "serve_overhead.py"), *args)
    lines = text.splitlines()
    assert lines[0].startswith("4 streams x 6 tokens, forward stub 1.0 ms + 5.0 us/token")
    assert lines[1].startswith("offline") and "tok/s" in lines[1]
    servers = [line for line in lines if line.startswith("server")]
    assert len(servers) == 2 and all("TTFT p50" in line and "x)" in line for line in servers)
    engine = [line for line in lines if line.startswith("  engine: offline")]
    assert len(engine) == 2 and all("hand-offs" in e and "GC pauses" in e for e in engine)
    # the time in step() split: offline's, then each server run's
    waits = [line for line in lines if line.startswith("  in step() per step: ")]
    assert len(waits) == 3 and all("for the GIL" in w for w in waits)


def test_lora_bench_alternates_the_base_and_the_adapters_engines_on_the_cpu(tmp_path):
    # two 8-token prompts (a workload file): W1's 64-512-token prompts took 110 s of CI here
    workload = tmp_path / "tiny.json"
    requests = [{"prompt_token_ids": [5 + i] * 8, "max_new_tokens": 2} for i in range(2)]
    workload.write_text(json.dumps({"requests": requests}))
    args = ["--device", "cpu", "--dtype", "float32", "--shape", "smollm2-135m", "--compile", "0"]
    args += ["--layers", "2"]  # (the shape's 30 took ~15 s of building and forwards)
    args += ["--workload", str(workload), "--rounds", "2", "--hf-batch", "0"]
    args += ["--adapters", "2", "--rank", "4"]
    text = _run(str(PROFILING / "lora_bench.py"), *args)
    rounds = [line for line in text.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert len(rounds) == 2 and all(line.count("%") == 2 for line in rounds)
    for name in ("1 adapter", "2 adapters, uniform"):
        assert f"{name}: median " in text and "median of the rounds' ratios to the base" in text
