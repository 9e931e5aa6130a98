"""The load generator's clients: a workload of token-id prompts sent as streaming
/v1/completions requests by N concurrent clients, each request's timings written as JSON.

Standard library only (asyncio streams, HTTP/1.1, chunked transfer, SSE), and run as its own
process by serve_bench.py: clients in the server's process would take the GIL from it.

  python evals/serve_client.py --url http://127.0.0.1:8000 --model NAME --workload W.json \
      --clients 256 --out timings.json [--processes 4]

One process reads every stream's events (a JSON parse each) and can become the bottleneck of a
fast server; --processes N splits the requests and the clients round-robin over N processes
that start together. The output says how much CPU each process used, so a saturated load
generator shows in the results rather than as a slower server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit


async def _read_chunks(reader: asyncio.StreamReader):
    """The body of a chunked HTTP/1.1 response, chunk by chunk."""
    while True:
        size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
        if size == 0:
            await reader.readline()
            return
        data = await reader.readexactly(size)
        await reader.readexactly(2)
        yield data


async def one_request(host, port, path, headers, body: dict, t0: float) -> dict:
    reader, writer = await asyncio.open_connection(host, port)
    payload = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    head += f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    arrival = time.perf_counter() - t0
    writer.write(head.encode() + payload)
    await writer.drain()
    status = (await reader.readline()).decode()
    chunked = False
    while (line := await reader.readline()) not in (b"\r\n", b""):
        chunked |= line.lower().startswith(b"transfer-encoding: chunked")
    if " 200 " not in status:
        error = (await reader.read()).decode(errors="replace")[:500]
        writer.close()
        raise RuntimeError(f"{status.strip()}: {error}")
    first = last = None
    usage = None
    buffer = b""
    source = _read_chunks(reader) if chunked else _iter_plain(reader)
    async for data in source:
        buffer += data
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            if not event.startswith(b"data: ") or event == b"data: [DONE]":
                continue
            message = json.loads(event[6:])
            now = time.perf_counter() - t0
            if message.get("choices"):
                if first is None:
                    first = now
                last = now
            if message.get("usage"):
                usage = message["usage"]
    writer.close()
    if usage is None or first is None:
        raise RuntimeError("the stream ended without tokens or usage")
    return {
        "prompt_len": usage["prompt_tokens"],
        "output_len": usage["completion_tokens"],
        "arrival": arrival,
        "first_token": first,
        "finish": last,
    }


async def _iter_plain(reader: asyncio.StreamReader):
    while data := await reader.read(65536):
        yield data


async def run(
    url: str, model: str, requests: list[dict], clients: int, api_key: str | None, t0: float
):
    """Every request through `clients` concurrent connections; times relative to t0 (a
    time.perf_counter() value: CLOCK_MONOTONIC on Linux, the same clock in every process)."""
    parts = urlsplit(url)
    host, port = parts.hostname, parts.port or 80
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sem = asyncio.Semaphore(clients)

    async def one(req: dict) -> dict:
        body = {
            "model": model,
            "prompt": req["prompt_token_ids"],
            "max_tokens": req["max_new_tokens"],
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with sem:
            return await one_request(host, port, "/v1/completions", headers, body, t0)

    timings = await asyncio.gather(*(one(r) for r in requests))
    return timings, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--workload", required=True, help="a workload .json (Workload.save)")
    p.add_argument("--clients", type=int, required=True)
    p.add_argument("--api-key", default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--processes", type=int, default=1, help="client processes (round-robin)")
    # one of --processes' workers: its share of the requests, and the common start time
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)  # "i/n"
    p.add_argument("--start-at", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.processes < 1 or args.processes > args.clients:
        p.error(f"--processes must be 1..--clients ({args.clients}), got {args.processes}")
    requests = json.loads(open(args.workload).read())["requests"]
    result = _split(args, requests) if args.processes > 1 else _one(args, requests)
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


def _one(args, requests: list[dict]) -> dict:
    if args.part is not None:
        i, n = map(int, args.part.split("/"))
        requests = requests[i::n]
        time.sleep(max(0.0, args.start_at - time.perf_counter()))
    t0 = args.start_at if args.start_at is not None else time.perf_counter()
    cpu0 = time.process_time()
    timings, wall = asyncio.run(run(args.url, args.model, requests, args.clients, args.api_key, t0))
    # t0: the clients' start on time.perf_counter()'s clock (CLOCK_MONOTONIC on Linux, the
    # server's clock too), for a timeline of the run against the engine's own timestamps
    return {"timings": timings, "wall_s": wall, "cpu_s": [time.process_time() - cpu0], "t0": t0}


def _split(args, requests: list[dict]) -> dict:
    """--processes N: N copies of this script, request i in process i % N with its share of the
    clients, all starting at one moment; their timings merged back in workload order."""
    n = args.processes
    start_at = time.perf_counter() + 2.0  # every process imported and waiting by then
    with tempfile.TemporaryDirectory() as tmp:
        outs = [str(Path(tmp) / f"part{i}.json") for i in range(n)]
        procs = []
        for i in range(n):
            cmd = [sys.executable, __file__, "--url", args.url, "--model", args.model]
            cmd += ["--workload", args.workload, "--out", outs[i]]
            cmd += ["--clients", str(args.clients // n + (i < args.clients % n))]
            cmd += ["--part", f"{i}/{n}", "--start-at", repr(start_at)]
            if args.api_key:
                cmd += ["--api-key", args.api_key]
            procs.append(subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True))
        errors = [proc.communicate()[1] for proc in procs]
        for proc, err in zip(procs, errors):
            if proc.returncode != 0:
                raise SystemExit(f"a client process failed:\n{err.strip()[-2000:]}")
        parts = [json.loads(Path(out).read_text()) for out in outs]
    timings: list = [None] * len(requests)
    for i, part in enumerate(parts):
        timings[i::n] = part["timings"]
    return {
        "timings": timings,
        "wall_s": max(part["wall_s"] for part in parts),
        "cpu_s": [c for part in parts for c in part["cpu_s"]],
        "t0": start_at,
    }


if __name__ == "__main__":
    sys.exit(main())
