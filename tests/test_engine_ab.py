"""evals/engine_ab.py: settings interleaved per round, every run's rates parsed, a summary last,
failures reported, not hidden (a stub stands in for engine_bench.py: no GPU here)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STUB = """
import os
v = os.environ["HF_X"]
if v == "2":
    raise SystemExit(3)
print(f"batch-1 decode (first run): 1,35{v} tok/s")
print(f"batch-1 decode (second run): 1,34{v} tok/s")
print("steady state, 1 running decodes: 0.75 ms/step wall, GPU busy 0.74 ms/step (99%)")
"""


def test_engine_ab_interleaves_settings_and_ends_with_a_summary(tmp_path):
    stub = tmp_path / "bench.py"
    stub.write_text(STUB)
    out = subprocess.run(
        [sys.executable, str(ROOT / "evals" / "engine_ab.py"), "HF_X=0,1,2", "rounds=2",
         f"bench={stub}"],  # fmt: skip
        capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    runs = [line.split(":")[0] for line in out if line.startswith("round")]
    assert runs == [f"round {r}, HF_X={v}" for r in (1, 2) for v in (0, 1, 2)]
    summary = out[out.index(next(x for x in out if x.startswith("summary"))) + 1 :]
    assert summary[0] == (
        "  HF_X=0: 1,350/1,340 tok/s, 0.75 ms wall, 0.74 ms GPU a step | "
        "1,350/1,340 tok/s, 0.75 ms wall, 0.74 ms GPU a step"
    )
    assert summary[1].startswith("  HF_X=1: 1,351/1,341 tok/s")
    assert summary[2] == "  HF_X=2: FAILED (rc 3) | FAILED (rc 3)"
