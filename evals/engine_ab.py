"""Interleaved A/B of environment switches on the engine's batch-1 decode, one table at the end.

    python evals/engine_ab.py HF_PAGED_ATTN_TRIGGER=0,1,2 [rounds=2] [shape=tinyllama-1.1b]

Runs `evals/engine_bench.py only=batch1 [shape=...]` once per setting per round, settings in
turn (A B C A B C: the H200's rate drifts by a few percent between calls and within one, so
settings are compared inside a round), and prints every run's two batch-1 rates and GPU step
time as it goes, then a summary table last (so a log's tail always holds it; session 13 lost
two results to a `tail` that cut them off). Several VAR=a,b switches multiply out.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

_RATE = re.compile(r"batch-1 decode \((first|second) run\): ([\d,]+) tok/s")
_STEP = re.compile(r"steady state, 1 running decodes: ([\d.]+) ms/step wall, GPU busy ([\d.]+)")


def main() -> None:
    switches, opts = {}, {"rounds": "2"}
    for arg in sys.argv[1:]:
        key, _, value = arg.partition("=")
        if key.isupper():
            switches[key] = value.split(",")
        else:
            opts[key] = value
    if not switches:
        sys.exit(__doc__)
    settings = [dict(zip(switches, combo)) for combo in itertools.product(*switches.values())]
    bench = opts.get("bench", Path(__file__).resolve().parent / "engine_bench.py")  # tests: a stub
    extra = [f"shape={opts['shape']}"] if "shape" in opts else []
    results: dict[str, list[str]] = {}
    for r in range(int(opts["rounds"])):
        for setting in settings:
            name = " ".join(f"{k}={v}" for k, v in setting.items())
            out = subprocess.run(
                [sys.executable, str(bench), "only=batch1", *extra],
                env={**os.environ, **setting},
                capture_output=True,
                text=True,
            )
            text = out.stdout + out.stderr
            rates = [m.group(2) for m in _RATE.finditer(text)]
            step = _STEP.search(text)
            row = f"{'/'.join(rates)} tok/s" if rates else f"FAILED (rc {out.returncode})"
            if step:
                row += f", {step.group(1)} ms wall, {step.group(2)} ms GPU a step"
            print(f"round {r + 1}, {name}: {row}", flush=True)
            if not rates:
                print(text[-3000:], flush=True)
            results.setdefault(name, []).append(row)
    print(f"summary ({opts['rounds']} rounds, interleaved; engine_bench only=batch1 {extra}):")
    for name, rows in results.items():
        print(f"  {name}: " + " | ".join(rows))


if __name__ == "__main__":
    main()
