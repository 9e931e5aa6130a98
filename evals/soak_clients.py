"""The soak's clients: N concurrent loops, each sending one request after another for the
duration, drawn from a fixed mix, and checking what comes back.

- stream (60%): a streamed completion or chat read to [DONE]; the usage chunk must count every
  token asked for (EOS ignored) and every choice must end with a finish reason.
- full (15%): a non-streamed completion with n = 2; both choices, the same usage check.
- disconnect (15%): a stream closed by the client after its first chunks (the server must abort
  it and free its blocks).
- bad (10%): a request the server must refuse with OpenAI's error body and the right status:
  bad JSON, an unknown model, an over-long prompt, an out-of-range parameter, an unknown field.

Anything else (a connection error, a wrong status, a short stream) counts as an error, with
the first few messages kept. Standard library only (asyncio streams, HTTP/1.1).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

MIX = (("stream", 0.60), ("full", 0.15), ("disconnect", 0.15), ("bad", 0.10))


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)  # kind -> requests that went as expected
    errors: list[str] = field(default_factory=list)
    num_errors: int = 0
    output_tokens: int = 0

    def error(self, message: str) -> None:
        self.num_errors += 1
        if len(self.errors) < 20:
            self.errors.append(message)


async def _open(host: str, port: int, path: str, payload: bytes, headers: dict):
    reader, writer = await asyncio.open_connection(host, port)
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    head += f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    writer.write(head.encode() + payload)
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    chunked = False
    while (line := await reader.readline()) not in (b"\r\n", b""):
        chunked |= line.lower().startswith(b"transfer-encoding: chunked")
    return status, chunked, reader, writer


async def _body(reader: asyncio.StreamReader, chunked: bool) -> bytes:
    """The rest of a response with `Connection: close`, chunked encoding removed if present."""
    data = await reader.read()
    if chunked:  # size line, chunk, CRLF, ..., 0
        out, rest = b"", data
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0] or b"0", 16)
            if size == 0:
                break
            out, rest = out + rest[:size], rest[size + 2 :]
        data = out
    return data


def _events(data: bytes) -> list[dict | str]:
    """SSE events of a de-chunked body: payload dicts, and "[DONE]"."""
    events = []
    for block in data.split(b"\n\n"):
        if block.startswith(b"data: "):
            text = block[6:].decode()
            events.append(text if text == "[DONE]" else json.loads(text))
    return events


class SoakClients:
    """models: the served names; each request that runs picks one (the first: the base)."""

    def __init__(self, port: int, models, api_key: str, vocab: int, max_model_len: int, seed):
        self.host, self.port, self.models, self.model = "127.0.0.1", port, list(models), models[0]
        self.headers = {"Authorization": f"Bearer {api_key}"}
        self.vocab, self.max_model_len = vocab, max_model_len  # prompts' ids; the longest prompt
        self.rng = random.Random(seed)
        self.tally = Tally()

    def _prompt(self) -> list[int]:
        n = self.rng.randint(4, 40)
        return [self.rng.randrange(3, self.vocab) for _ in range(n)]

    def _sampling(self) -> dict:
        if self.rng.random() < 0.5:
            return {"temperature": 0}
        return {"temperature": 0.8, "top_p": 0.9, "seed": self.rng.randrange(1 << 30)}

    async def run(self, clients: int, seconds: float) -> Tally:
        deadline = time.monotonic() + seconds
        await asyncio.gather(*(self._loop(deadline) for _ in range(clients)))
        return self.tally

    async def _loop(self, deadline: float) -> None:
        kinds, weights = zip(*MIX)
        while time.monotonic() < deadline:
            kind = self.rng.choices(kinds, weights)[0]
            try:
                ok = await getattr(self, f"_{kind}")()
            except (OSError, asyncio.IncompleteReadError, ValueError, IndexError) as exc:
                ok = f"{type(exc).__name__}: {exc}"
            if ok is True:
                self.tally.outcomes[kind] += 1
            else:
                self.tally.error(f"{kind}: {ok}")

    async def _post(self, path: str, body: dict | bytes):
        payload = body if isinstance(body, bytes) else json.dumps(body).encode()
        return await _open(self.host, self.port, path, payload, self.headers)

    def _streamed_body(self, max_tokens: int) -> tuple[str, dict]:
        body = {"model": self.rng.choice(self.models), "max_tokens": max_tokens}
        body["ignore_eos"] = True
        body.update(self._sampling(), stream=True, stream_options={"include_usage": True})
        if self.rng.random() < 0.5:
            return "/v1/completions", {**body, "prompt": self._prompt()}
        words = " ".join(self.rng.choice(["hello", "world", "the", "cat", "a"]) for _ in range(6))
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": words}]}

    async def _stream(self):
        max_tokens = self.rng.randint(4, 24)
        path, body = self._streamed_body(max_tokens)
        status, chunked, reader, writer = await self._post(path, body)
        try:
            data = await _body(reader, chunked)
        finally:
            writer.close()
        if status != 200:
            return f"status {status}: {data[:200]!r}"
        events = _events(data)
        if not events or events[-1] != "[DONE]":
            return "the stream did not end with [DONE]"
        usage = events[-2].get("usage") if len(events) > 1 else None
        if not usage or usage["completion_tokens"] != max_tokens:
            return f"usage {usage} for max_tokens {max_tokens}"
        if not any(c.get("finish_reason") for e in events[:-1] for c in e.get("choices", [])):
            return "no choice ended with a finish reason"
        self.tally.output_tokens += max_tokens
        return True

    async def _full(self):
        max_tokens = self.rng.randint(4, 16)
        body = {"model": self.rng.choice(self.models), "prompt": self._prompt(), "n": 2}
        body["max_tokens"] = max_tokens
        body.update(self._sampling(), ignore_eos=True)
        status, chunked, reader, writer = await self._post("/v1/completions", body)
        try:
            data = await _body(reader, chunked)
        finally:
            writer.close()
        if status != 200:
            return f"status {status}: {data[:200]!r}"
        r = json.loads(data)
        if len(r["choices"]) != 2 or r["usage"]["completion_tokens"] != 2 * max_tokens:
            return f"choices {len(r['choices'])}, usage {r['usage']}"
        self.tally.output_tokens += 2 * max_tokens
        return True

    async def _disconnect(self):
        path, body = self._streamed_body(64)
        status, chunked, reader, writer = await self._post(path, body)
        try:
            if status != 200:
                return f"status {status}"
            await reader.readuntil(b"\n\n")  # the first event, then gone mid-stream
        finally:
            writer.close()
        return True

    async def _bad(self):
        too_long = [5] * (self.max_model_len + 8)
        cases = [
            (b'{"model": "x", "prompt": ', 400),
            ({"model": "no-such-model", "prompt": "hello"}, 404),
            ({"model": self.model, "prompt": too_long, "max_tokens": 4}, 400),
            ({"model": self.model, "prompt": "hello", "temperature": 7}, 400),
            ({"model": self.model, "prompt": "hello", "suffix": "x"}, 400),
        ]
        body, want = self.rng.choice(cases)
        status, chunked, reader, writer = await self._post("/v1/completions", body)
        try:
            data = await _body(reader, chunked)
        finally:
            writer.close()
        if status != want:
            return f"status {status}, expected {want}: {data[:200]!r}"
        error = json.loads(data).get("error")
        if not isinstance(error, dict) or not error.get("message"):
            return f"not OpenAI's error body: {data[:200]!r}"
        return True
