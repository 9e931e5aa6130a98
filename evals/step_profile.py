"""serve-bench --cprofile: Python's profile of Engine.step() alone, offline and in the server's
engine process, function by function per step (and the table startup --cprofile prints for one
Engine construction).

The engine process spends more time in step() per step than the offline engine on the same
workload (H200, W1: 4.18 against 3.76 ms; on its CPU clock too, so it is not only waiting), with
the same requests (the server's SamplingParams cost a step nothing more, measured with a stub
forward). Two tables from one run say which functions take the difference. cProfile slows every
call it sees alike: the tables are for comparing the two runs, not for absolute times.

Only the thread that calls step() is profiled (cProfile follows the thread that enables it), and
the warm-up's steps are counted in both.
"""

from __future__ import annotations

import atexit
import contextlib
import cProfile
import json
import pstats
from pathlib import Path

TOP = 20  # functions a table lists


class StepProfile:
    """cProfile switched on around each call of a step function only."""

    def __init__(self) -> None:
        self.profile = cProfile.Profile()
        self.steps = 0

    def wrap(self, step):
        def profiled(*args, **kwargs):
            self.steps += 1
            self.profile.enable()
            try:
                return step(*args, **kwargs)
            finally:
                self.profile.disable()

        return profiled

    def table(self, title: str) -> str:
        return table(title, pstats.Stats(self.profile), self.steps)

    def dump(self, path: str) -> None:
        """The stats to `path`, the number of steps to `path`.json."""
        self.profile.dump_stats(path)
        Path(path + ".json").write_text(json.dumps({"steps": self.steps}))


@contextlib.contextmanager
def profiled_engine_steps(profile: StepProfile | None):
    """Inside: every Engine's step() in this process profiled by `profile` (None: as is)."""
    from hf_paged.engine.engine import Engine

    if profile is None:
        yield
        return
    step = Engine.step
    Engine.step = profile.wrap(step)
    try:
        yield
    finally:
        Engine.step = step


def profile_in_engine_process(path: str, prompts: list[list[int]], engine) -> None:
    """EngineSpec's setup in the engine process: profile every later step() of this engine
    (its warm-up on `prompts` first, as serve_bench.warm_up), dumped to `path` at exit."""
    from .serve_bench import warm_up

    profile = StepProfile()
    engine.step = profile.wrap(engine.step)  # the step loop calls engine.step()
    atexit.register(profile.dump, path)
    warm_up(prompts, engine)


def table(
    title: str, profile: pstats.Stats | None, count: int, unit: str = "step", by: str = "own"
) -> str:
    """The TOP functions by their own time (by="own") or with their callees ("cumulative"):
    microseconds per `unit` (count of them: steps, or 1 for one start-up)."""
    if profile is None or not count:
        return f"### {title}: none (the process left no profile)"
    key = 2 if by == "own" else 3  # pstats: (primitive calls, calls, own s, cumulative s, ...)
    rows = sorted(profile.stats.items(), key=lambda kv: kv[1][key], reverse=True)[:TOP]
    total = sum(v[2] for v in profile.stats.values())
    lines = [
        f"### {title}: {count} {unit}{'s' if count != 1 else ''}, {1e6 * total / count:,.0f} us "
        f"a {unit} under cProfile",
        "",
        f"| own us/{unit} | with callees us/{unit} | calls/{unit} | function |",
        "|---|---|---|---|",
    ]
    for (file, line, name), (_, calls, own, cum, _) in rows:
        where = f"{Path(file).name}:{line}({name})" if line else name
        lines.append(
            f"| {1e6 * own / count:,.1f} | {1e6 * cum / count:,.1f} | {calls / count:.1f} "
            f"| `{where}` |"
        )
    return "\n".join(lines)


def load(path: str) -> tuple[pstats.Stats | None, int]:
    """What profile_in_engine_process left at `path` (None, 0 where nothing)."""
    if not Path(path).exists() or not Path(path + ".json").exists():
        return None, 0
    return pstats.Stats(path), json.loads(Path(path + ".json").read_text())["steps"]
