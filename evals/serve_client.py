"""The load generator's clients: a workload of token-id prompts sent as streaming
/v1/completions requests by N concurrent clients, each request's timings written as JSON.

Standard library only (asyncio streams, HTTP/1.1, chunked transfer, SSE), and run as its own
process by serve_bench.py: clients in the server's process would take the GIL from it.

  python evals/serve_client.py --url http://127.0.0.1:8000 --model NAME --workload W.json \
      --clients 256 --out timings.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
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


async def run(url: str, model: str, requests: list[dict], clients: int, api_key: str | None):
    parts = urlsplit(url)
    host, port = parts.hostname, parts.port or 80
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sem = asyncio.Semaphore(clients)
    t0 = time.perf_counter()

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
    args = p.parse_args(argv)
    requests = json.loads(open(args.workload).read())["requests"]
    timings, wall = asyncio.run(run(args.url, args.model, requests, args.clients, args.api_key))
    with open(args.out, "w") as f:
        json.dump({"timings": timings, "wall_s": wall}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
