"""`evals/run.py serve-bench`: the load generator runs end to end on a tiny model, server and
offline engine side by side, and every request's tokens reach the clients."""

from __future__ import annotations

import json
import re

from hf_paged.testing import load_evals

run = load_evals()


def test_serve_bench_tiny(tmp_path, capsys):
    argv = ["serve-bench", "--model", "tiny", "--dataset", "synthetic,batch1", "--limit", "6"]
    argv += ["--max-new-tokens", "5", "--clients", "4", "--out", str(tmp_path), "--no-progress"]
    assert run.main([*argv, "--stream-interval-ms", "0"]) == 0
    out = capsys.readouterr().out
    assert "server / offline" in out
    assert "- server: uvicorn on " in out  # which loop and HTTP parser it ran on
    (path,) = tmp_path.glob("serve-bench-*.json")
    results = json.loads(path.read_text())["results"]
    assert [r["clients"] for r in results] == [4, 1]  # batch1 runs one client
    for r in results:
        runs = {m["backend"]: m for m in r["metrics"]}
        assert set(runs) == {"offline", "server"}
        for m in runs.values():
            assert m["num_requests"] == 6
            assert m["output_tok_s"] > 0 and m["ttft_p50_ms"] > 0
        server = next(m for m in r["metrics"] if m["backend"] == "server")
        assert server["extra"]["engine_stats"]["num_running"] == 0
        # the engine loop's record: every token came out of a step, every step's outputs out
        # of a hand-off (0 ms pacing: one per step that made tokens, at most)
        steps = server["extra"]["num_steps"]
        assert steps >= 5 and 1 <= server["extra"]["num_handoffs"] <= steps
        assert server["extra"]["step_s"] >= server["extra"]["step_cpu_s"] > 0
        # where the host time went: the threads' CPU seconds, the steps while requests
        # arrived (a part of all of them), the collector's pauses on both sides
        assert server["extra"]["thread_cpu_s"]["engine"] >= server["extra"]["step_cpu_s"]
        assert server["extra"]["thread_cpu_s"]["loop"] > 0
        arrivals = server["extra"]["arrivals"]
        assert 0 <= arrivals["num_steps"] <= steps and arrivals["span_s"] >= 0
        assert 0 <= arrivals["step_cpu_s"] <= server["extra"]["step_cpu_s"]
        offline = runs["offline"]["extra"]
        assert offline["num_steps"] >= 5 and offline["cpu_s"] > 0
        for side in (offline, server["extra"]):
            assert set(side["gc"]) == {"by_thread", "full"}
    assert out.count("- engine: offline") == 2
    assert out.count("; GC pauses: offline ") == 2 and "; CPU s: engine thread " in out
    assert out.count("; load generator: 1 process, the busiest ") == 2
    assert all(len(r["metrics"][1]["extra"]["client_cpu_s"]) == 1 for r in results)


def test_serve_bench_clients_in_several_processes(tmp_path, capsys):
    """--client-processes 3: the requests and the clients split round-robin over three load
    generator processes starting together (batch 1's one client: one process); every request's
    row back in the workload's order (_check_lengths compares each row's prompt length), each
    process's CPU seconds reported."""
    argv = ["serve-bench", "--model", "tiny", "--dataset", "synthetic", "--limit", "7"]
    argv += ["--max-new-tokens", "4", "--clients", "4", "--out", str(tmp_path), "--no-progress"]
    assert run.main([*argv, "--client-processes", "3"]) == 0
    out = capsys.readouterr().out
    assert "; load generator: 3 processes, the busiest " in out
    (path,) = tmp_path.glob("serve-bench-*.json")
    (result,) = json.loads(path.read_text())["results"]
    server = {m["backend"]: m for m in result["metrics"]}["server"]
    assert server["num_requests"] == 7 and server["output_tok_s"] > 0
    cpu = server["extra"]["client_cpu_s"]
    assert len(cpu) == 3 and all(c > 0 for c in cpu)
    assert run.main([*argv, "--client-processes", "0"]) == 2
    assert "--client-processes must be >= 1" in capsys.readouterr().err


def test_serve_bench_bad_engine_option(tmp_path, capsys):
    argv = ["serve-bench", "--model", "tiny", "--engine-option", "nonsense", "--out", str(tmp_path)]
    assert run.main(argv) == 2
    assert "--engine-option" in capsys.readouterr().err


def test_serve_bench_engine_process(tmp_path, capsys):
    """--engine-process both: the engine-thread server and the engine-process server, each
    next to the offline engine, every token of every request at its client."""
    argv = ["serve-bench", "--model", "tiny", "--dataset", "synthetic", "--limit", "6"]
    argv += ["--max-new-tokens", "5", "--clients", "4", "--out", str(tmp_path), "--no-progress"]
    assert run.main([*argv, "--engine-process", "both"]) == 0
    out = capsys.readouterr().out
    assert "- server / offline" in out and "- server-proc / offline" in out
    (path,) = tmp_path.glob("serve-bench-*.json")
    (result,) = json.loads(path.read_text())["results"]
    runs = {m["backend"]: m for m in result["metrics"]}
    assert set(runs) == {"offline", "server", "server-proc"}
    proc = runs["server-proc"]
    assert proc["num_requests"] == 6 and proc["output_tok_s"] > 0
    extra = proc["extra"]
    assert extra["engine_process"] and extra["engine_stats"]["num_running"] == 0
    assert extra["engine_stats"]["free_blocks"] == extra["engine_stats"]["num_blocks"]
    # the child's loop: the clients' steps only (its warm-up left out), some output messages
    assert 5 <= extra["num_steps"] and 1 <= extra["num_handoffs"]
    assert extra["step_s"] >= extra["step_cpu_s"] > 0
    assert extra["thread_cpu_s"]["engine"] >= extra["step_cpu_s"] * 0.9
    # the run on the clients' clock: requests in, then the last step, then the last token read
    tl = extra["timeline"]
    assert 0 <= tl["first_in_s"] <= tl["last_in_s"] <= tl["last_step_s"] <= proc["wall_s"]
    assert 0 <= tl["outside_step_s"] < tl["last_step_s"] and tl["num_steps"] >= 5
    assert "first request in the engine at" in out


def test_serve_bench_cprofile_tables_for_both_sides(tmp_path, capsys):
    """--cprofile: step()'s functions per step offline and in the engine process, whose profile
    crosses back from the child when it exits."""
    argv = ["serve-bench", "--model", "tiny", "--dataset", "synthetic", "--limit", "6"]
    argv += ["--max-new-tokens", "5", "--clients", "4", "--out", str(tmp_path), "--no-progress"]
    assert run.main([*argv, "--engine-process", "on", "--cprofile"]) == 0
    out = capsys.readouterr().out
    for side in ("offline", "engine process"):
        head = re.search(rf"### step\(\) profile, {side}: (\d+) steps", out)
        assert head is not None, out[-3000:]
        assert int(head.group(1)) >= 5  # at least the 5 tokens' steps
        table = out[head.end() :].split("###")[0]
        rows = [ln for ln in table.splitlines() if ln.startswith("| ") and "`" in ln]
        assert len(rows) == 20, table  # step_profile.TOP functions by their own time
