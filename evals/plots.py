"""PNG plots of throughput results: throughput vs concurrency, latency CDFs.

python evals/run.py plots evals/results/throughput-*.json --out evals/results/
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import EvalError


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on CI or the GPU machine
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise EvalError("plots need matplotlib: pip install matplotlib") from exc
    return plt


def plot_throughput_vs_concurrency(result: dict, path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    series: dict[str, list[tuple[int, float]]] = {}
    for r in result["runs"]:
        m = r["metrics"]
        series.setdefault(m["backend"], []).append((m["concurrency"] or 0, m["output_tok_s"]))
    for name, pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    bound = result["roofline"].get("output_tok_s")
    if bound:
        ax.axhline(bound, color="gray", linestyle="--", label="roofline bound")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (max_num_seqs / batch size / max_requests_per_batch)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{result['workload']['name']} on {result['hardware']['name']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_latency_cdf(result: dict, path: Path) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for r in result["runs"]:
        m = r["metrics"]
        label = f"{m['backend']} (c={m['concurrency'] or 'auto'})"
        ttft = sorted(1000 * (t["first_token"] - t["arrival"]) for t in r["timings"])
        e2e = sorted(1000 * (t["finish"] - t["arrival"]) for t in r["timings"])
        frac = [0.0] + [(i + 1) / len(ttft) for i in range(len(ttft))]
        axes[0].step([0.0, *ttft], frac, where="post", label=label)
        axes[1].step([0.0, *e2e], frac, where="post", label=label)
    for ax, name in zip(axes, ("time to first token (ms)", "end-to-end latency (ms)")):
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['workload']['name']}: latency CDF", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_result(result: dict, out_dir: Path, stem: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        plot_throughput_vs_concurrency(result, out_dir / f"{stem}-throughput.png"),
        plot_latency_cdf(result, out_dir / f"{stem}-latency-cdf.png"),
    ]


def plot_file(path: str, out_dir: Path) -> list[Path]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise EvalError(f"cannot read results file {path}: {exc}") from exc
    results = data.get("results", [data])
    paths = []
    for i, res in enumerate(results):
        if "runs" not in res:
            raise EvalError(f"{path} holds no throughput results")
        paths += plot_result(res, out_dir, f"{Path(path).stem}-{i}")
    return paths
