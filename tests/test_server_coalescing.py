"""Streams that fall behind: the tokens made while a stream's coroutine did not run go out as
one delta per choice, and the deltas still add up to exactly the non-streamed response (text,
logprobs' tokens, usage). Two ways of falling behind: the event loop blocked while the engine
steps on, and the engine's paced hand-offs (AsyncEngine's stream_interval_s)."""

from __future__ import annotations

import sys
import time

import openai
import pytest
import torch

from hf_paged.engine.engine import Engine
from hf_paged.entrypoints.api_server import build_app
from hf_paged.entrypoints.async_engine import AsyncEngine
from hf_paged.entrypoints.server_thread import ServerThread
from hf_paged.testing import check_served_idle, tiny_tokenizer

MODEL = "tiny"
OPTIONS = dict(num_blocks=128, max_num_seqs=8, max_model_len=128)
PROMPT = "once upon a time there was"
MAX_TOKENS = 40


def build_model(arch: str):
    return sys.modules["tests.conftest"].build_model(arch)


@pytest.fixture(scope="module")
def engine():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    eng = Engine(build_model("llama"), tiny_tokenizer(), **OPTIONS)
    yield eng
    eng.shutdown()
    torch.set_num_threads(threads)


def serve(engine, stream_interval_s: float) -> tuple[ServerThread, AsyncEngine]:
    app = build_app(engine, MODEL, stream_interval_s=stream_interval_s)
    return ServerThread(app), app.state.front


def whole(client, **kwargs):
    """The non-streamed response: (text per choice, tokens per choice, completion tokens)."""
    r = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, **kwargs)
    return [c.text for c in r.choices], [c.logprobs.tokens for c in r.choices], r.usage


def streamed(stream):
    """Per choice: its deltas' texts and their token counts; and the usage chunk."""
    texts: dict[int, list[str]] = {}
    counts: dict[int, list[int]] = {}
    tokens: dict[int, list[str]] = {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts.setdefault(c.index, []).append(c.text)
            counts.setdefault(c.index, []).append(len(c.logprobs.tokens))
            tokens.setdefault(c.index, []).extend(c.logprobs.tokens)
    return texts, counts, tokens, usage


KW = dict(max_tokens=MAX_TOKENS, logprobs=1, n=2, seed=5, extra_body={"ignore_eos": True})


def test_a_stream_behind_a_blocked_event_loop_gets_coalesced_deltas(engine):
    server, front = serve(engine, 0.0)
    with server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        want_texts, want_tokens, want_usage = whole(client, **KW)
        stream = client.completions.create(
            model=MODEL, prompt=PROMPT, temperature=0, stream=True,
            stream_options={"include_usage": True}, **KW,
        )  # fmt: skip
        # the response has started; hold the event loop while the engine makes every token
        front._loop.call_soon_threadsafe(time.sleep, 1.5)
        texts, counts, tokens, usage = streamed(stream)
        check_served_idle(front)
    for i in range(2):
        assert "".join(texts[i]) == want_texts[i]
        assert tokens[i] == want_tokens[i]
        assert sum(counts[i]) == MAX_TOKENS
        assert max(counts[i]) > 1, counts[i]  # the tokens made meanwhile came as one delta
        assert len(counts[i]) < MAX_TOKENS
    assert usage.completion_tokens == want_usage.completion_tokens == 2 * MAX_TOKENS


def test_paced_hand_offs_coalesce_and_equal_the_whole_response(engine):
    server, front = serve(engine, 0.05)
    with server:  # one live stream: a hand-off every 50 ms at most
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        want_texts, want_tokens, _ = whole(client, **KW)
        stream = client.completions.create(
            model=MODEL, prompt=PROMPT, temperature=0, stream=True, **KW
        )
        texts, counts, tokens, _ = streamed(stream)
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=MAX_TOKENS,
            temperature=0, extra_body={"ignore_eos": True},
        )  # fmt: skip
        deltas = [
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True},
                stream=True,
            )  # fmt: skip
            if c.choices
        ]
        check_served_idle(front)
    for i in range(2):
        assert "".join(texts[i]) == want_texts[i]
        assert tokens[i] == want_tokens[i]
        assert max(counts[i]) > 1, counts[i]
    assert "".join(deltas) == chat.choices[0].message.content
    assert len(deltas) < MAX_TOKENS  # the role delta, then coalesced content


def test_bad_stream_interval_is_refused(engine, capsys):
    from hf_paged.entrypoints.serve import main

    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="stream_interval_s"):
            AsyncEngine(engine, stream_interval_s=bad)
    assert main(["serve", "no-such-model", "--stream-interval-ms", "-1"]) == 2
    assert "--stream-interval-ms" in capsys.readouterr().err


def test_serving_shortens_the_switch_interval_and_restores_it(engine):
    before = sys.getswitchinterval()
    with serve(engine, 0.0)[0]:
        assert sys.getswitchinterval() < before
        with serve(engine, 0.0)[0]:  # a second server in the process, stopped first
            pass
        assert sys.getswitchinterval() < before  # the first still serves
    assert sys.getswitchinterval() == before


@pytest.mark.parametrize(
    "choice",
    [
        {"index": 0, "text": " hello", "logprobs": None, "finish_reason": None},
        {"index": 3, "text": 'q"u\\o\n\t\u00e9\u4e2d\U0001f600', "logprobs": None,
         "finish_reason": "stop"},
        {"index": 1, "text": "", "logprobs": None, "finish_reason": "length"},
        {"index": 0, "text": "x", "logprobs": {"tokens": ["x"], "token_logprobs": [-0.5]},
         "finish_reason": None},
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
         "finish_reason": None},
        {"index": 2, "delta": {"content": 'a\u00e9"b\\'}, "logprobs": None, "finish_reason": None},
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"},
        {"index": 0, "delta": {"content": "y"}, "logprobs": {"content": []}, "finish_reason": None},
    ],
)  # fmt: skip
def test_a_chunks_choice_is_written_as_the_json_encoder_writes_it(choice):
    # the per-token shapes take a hand-written path (serving.choice_json): the same bytes
    from hf_paged.entrypoints.serving import _dumps, choice_json

    assert choice_json(choice) == _dumps(choice)
