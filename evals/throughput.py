"""Throughput benchmark: a workload through each backend, metrics, ratios, roofline, table."""

from __future__ import annotations

import gc
import statistics
from dataclasses import asdict

import torch

from .backends import BackendRun, run_backend
from .errors import EvalError
from .roofline import Hardware, model_costs, workload_bound
from .workloads import Workload


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100  # linear interpolation, numpy's default
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def metrics(run: BackendRun) -> dict:
    ts = run.timings
    out = sum(t.output_len for t in ts)
    total = out + sum(t.prompt_len for t in ts)
    ttft = [t.first_token - t.arrival for t in ts]
    # TPOT excludes the first token (it belongs to TTFT), as in vLLM's serving benchmark.
    tpot = [(t.finish - t.first_token) / (t.output_len - 1) for t in ts if t.output_len > 1]
    e2e = [t.finish - t.arrival for t in ts]
    ms = 1000.0
    return {
        "backend": run.backend,
        "concurrency": run.concurrency,
        "num_requests": len(ts),
        "wall_s": run.wall_s,
        "output_tok_s": out / run.wall_s,
        "total_tok_s": total / run.wall_s,
        "ttft_p50_ms": percentile(ttft, 50) * ms,
        "ttft_p99_ms": percentile(ttft, 99) * ms,
        "tpot_p50_ms": percentile(tpot, 50) * ms if tpot else None,
        "tpot_p99_ms": percentile(tpot, 99) * ms if tpot else None,
        "e2e_p50_ms": statistics.median(e2e) * ms,
        "peak_memory_gb": run.peak_memory_bytes / 1e9 if run.peak_memory_bytes else None,
        "memory_kind": run.memory_kind,
        "kv_usage": run.extra.get("kv_usage"),
        "prefix_cache_hit_rate": run.extra.get("prefix_cache_hit_rate"),
        "extra": run.extra,
    }


DEFAULT_CONCURRENCY = {"paged": 256, "hf": 64, "hf-cb": None}  # hf-cb: transformers' defaults


def run_throughput(
    loaded,
    wl: Workload,
    backends: list[str],
    concurrencies: list[int | None],
    hw: Hardware,
    progress: bool = True,
    engine_options: dict | None = None,
) -> dict:
    """Every backend at every concurrency (None = that backend's default) on one workload."""
    runs = []
    for conc in concurrencies:
        for name in backends:
            c = conc if conc is not None else DEFAULT_CONCURRENCY[name]
            run = run_backend(name, loaded.model, wl, c, progress, engine_options)
            runs.append({"metrics": metrics(run), "timings": [asdict(t) for t in run.timings]})
            # The engine's KV cache must be gone before the next backend sizes its own from
            # free memory (transformers' CB takes ~90% of what it finds).
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    paged_conc = next(
        (r["metrics"]["concurrency"] for r in runs if r["metrics"]["backend"] == "paged"), 256
    )
    bound = workload_bound(model_costs(loaded.model), wl, paged_conc, hw)
    return {
        "workload": {"name": wl.name, "summary": wl.summary(), "meta": wl.meta},
        "hardware": {"name": hw.name, "bandwidth": hw.bandwidth, "flops": hw.flops},
        "roofline": bound,
        "runs": runs,
        "ratios": ratios(runs),
    }


def merge_results(files: list[tuple[str, list[dict]]]) -> list[dict]:
    """Results of several invocations (say one backend each) as one result per workload: runs
    concatenated, ratios recomputed. The workload and hardware must match exactly."""
    merged: dict[str, dict] = {}
    for name, results in files:
        for res in results:
            key = res["workload"]["name"]
            if key not in merged:
                merged[key] = {**res, "runs": list(res["runs"])}
                continue
            have = merged[key]
            for field_ in ("workload", "hardware"):
                if res[field_] != have[field_]:
                    raise EvalError(
                        f"{name}: {field_} differs from the other results for {key!r} "
                        f"({res[field_]} vs {have[field_]})"
                    )
            have["runs"] += res["runs"]
            if any(r["metrics"]["backend"] == "paged" for r in res["runs"]):
                have["roofline"] = res["roofline"]  # the bound at the engine's concurrency
    for res in merged.values():
        res["ratios"] = ratios(res["runs"])
    return list(merged.values())


def ratios(runs: list[dict]) -> list[dict]:
    """paged vs each transformers backend at the same concurrency setting (or hf-cb vs hf)."""
    out = []
    by_backend: dict[str, list[dict]] = {}
    for r in runs:
        by_backend.setdefault(r["metrics"]["backend"], []).append(r["metrics"])
    ours = "paged" if "paged" in by_backend else "hf-cb"
    for base in ("hf", "hf-cb"):
        if base == ours or base not in by_backend or ours not in by_backend:
            continue
        for a, b in zip(by_backend[ours], by_backend[base]):
            out.append(
                {
                    "ours": ours,
                    "baseline": base,
                    "concurrency": a["concurrency"],
                    "baseline_concurrency": b["concurrency"],
                    "output_tok_s_ratio": a["output_tok_s"] / b["output_tok_s"],
                }
            )
    return out


def _fmt(v, nd: int = 1) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:,.{nd}f}"
    return str(v)


def format_table(result: dict, model_desc: str) -> str:
    wl, hw, bound = result["workload"], result["hardware"], result["roofline"]
    lines = [
        f"## throughput: {wl['name']}",
        "",
        f"- model: {model_desc}",
        f"- workload: {wl['summary']}",
        f"- hardware: {hw['name']}",
        "",
    ]
    cols = [
        "backend",
        "conc",
        "req",
        "out tok/s",
        "total tok/s",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "TPOT p50 ms",
        "TPOT p99 ms",
        "peak mem GB",
        "KV use",
        "prefix hit",
        "wall s",
    ]
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in result["runs"]:
        m = r["metrics"]

        def pct(x):
            return "n/a" if x is None else f"{100 * x:.0f}%"

        row = [
            m["backend"],
            _fmt(m["concurrency"] or "auto"),
            str(m["num_requests"]),
            _fmt(m["output_tok_s"]),
            _fmt(m["total_tok_s"]),
            _fmt(m["ttft_p50_ms"]),
            _fmt(m["ttft_p99_ms"]),
            _fmt(m["tpot_p50_ms"], 2),
            _fmt(m["tpot_p99_ms"], 2),
            _fmt(m["peak_memory_gb"], 2),
            pct(m["kv_usage"]),
            pct(m["prefix_cache_hit_rate"]),
            _fmt(m["wall_s"], 2),
        ]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    for r in result["ratios"]:
        lines.append(
            f"- ratio {r['ours']} (c={r['concurrency'] or 'auto'}) / {r['baseline']} "
            f"(c={r['baseline_concurrency'] or 'auto'}): "
            f"**{r['output_tok_s_ratio']:.2f}x** output tokens/s"
        )
    if bound.get("output_tok_s"):
        best = max(r["metrics"]["output_tok_s"] for r in result["runs"])
        lines.append(
            f"- roofline bound: {bound['output_tok_s']:,.0f} output tok/s "
            f"({bound['bound_by']}-bound: {bound['bytes'] / 1e9:,.1f} GB / "
            f"{hw['bandwidth'] / 1e12:.1f} TB/s = {bound['memory_s']:.3f} s, "
            f"{bound['flops'] / 1e12:,.1f} TFLOP / {hw['flops'] / 1e12:.0f} TFLOP/s = "
            f"{bound['compute_s']:.3f} s); best backend at "
            f"{100 * best / bound['output_tok_s']:.1f}%"
        )
    else:
        lines.append(
            f"- roofline bound: n/a on {hw['name']} (pass --bandwidth-gbs and --tflops "
            f"to compute it; workload moves {bound['bytes'] / 1e9:,.1f} GB and "
            f"{bound['flops'] / 1e12:,.2f} TFLOP)"
        )
    mem_kinds = {r["metrics"]["memory_kind"] for r in result["runs"]}
    lines.append(f"- peak memory: {', '.join(sorted(mem_kinds))}")
    for r in result["runs"]:
        eng = r["metrics"]["extra"].get("engine")
        if eng:  # start-up is outside the clock: say what it cost
            lines.append(
                f"- {r['metrics']['backend']} (c={r['metrics']['concurrency']}): torch.compile "
                f"{'on (' + str(eng.get('compile_scope')) + ')' if eng['compile'] else 'off'}, "
                "CUDA graphs "
                f"{_graphs_text(eng)}, async scheduling "
                f"{'on' if eng.get('async_scheduling') else 'off'}, fused projections "
                f"{'on' if eng.get('fuse_projections') else 'off'}, "
                # absent in results saved before the small-batch forward
                f"small-batch forward {eng.get('small_batch_forward', 'off')}, "
                f"engine start-up {eng['startup_s']:.1f} s"
                + (  # absent in results saved before it was recorded
                    f", KV cache {eng['kv_tokens']:,} tokens ({eng['kv_cache_dtype']})"
                    if "kv_tokens" in eng
                    else ""
                )
            )
            if eng.get("startup"):  # absent in results saved before the breakdown
                from hf_paged.worker.startup_times import format_startup

                lines.append(f"  - {format_startup(eng['startup'])}")
    return "\n".join(lines)


def _graphs_text(eng: dict) -> str:
    if not eng["cuda_graphs"]:
        return "off"
    mixed = eng.get("mixed_step_graphs")  # absent in results saved before mixed-step graphs
    if mixed is None:
        return "on"
    return f"on (decode and {mixed} mixed-step token buckets)" if mixed else "on (decode only)"
