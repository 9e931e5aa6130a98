"""The OpenAI-compatible server, driven by the real `openai` client on 127.0.0.1: results equal
to the offline Engine (and, greedy, to transformers), streaming equal to non-streaming, OpenAI's
errors, and no request or KV block left behind by any of it."""

from __future__ import annotations

import asyncio
import http.client
import json
import sys

import openai
import pytest
import torch

from hf_paged.engine.engine import Engine
from hf_paged.entrypoints.api_server import build_app
from hf_paged.entrypoints.serve import build, build_parser, engine_options
from hf_paged.entrypoints.server_thread import ServerThread
from hf_paged.sampling_params import SamplingParams
from hf_paged.testing import check_served_idle, engine_stats, tiny_tokenizer


def build_model(arch: str):
    # the tests' seeded tiny models: conftest.py is loaded by pytest as tests.conftest
    return sys.modules["tests.conftest"].build_model(arch)


KEY = "test-key"
MODEL = "tiny-llama"
OPTIONS = dict(num_blocks=256, max_num_seqs=64, max_model_len=128)
PROMPTS = ["hello world", "the quick brown fox", "a", "once upon a time there was"]


@pytest.fixture(scope="module", params=["thread", "process"])
def served(request, tmp_path_factory):
    """The server in both modes: the engine loop in a thread of the HTTP process, and the
    engine in a process of its own (--engine-process) that loads the same seeded weights from
    a folder. Yields (the server, its front)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: more threads only wait for the shared cores
    if request.param == "thread":
        engine = Engine(build_model("llama"), tiny_tokenizer(), **OPTIONS)
        app = build_app(engine, MODEL, api_key=KEY)
    else:
        folder = tmp_path_factory.mktemp("served")
        build_model("llama").save_pretrained(folder)
        tiny_tokenizer().save_pretrained(folder)
        argv = [str(folder), "--served-model-name", MODEL, "--api-key", KEY, "--engine-process"]
        argv += [f"--engine-option={k}={v}" for k, v in OPTIONS.items()]
        args = build_parser().parse_args(argv)
        engine, app = build(args, engine_options(args))
    try:
        with ServerThread(app) as server:
            yield server, app.state.front
    finally:
        if request.param == "process":
            engine.close()
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def offline():
    """The same weights (seeded build) in an engine of their own."""
    return Engine(build_model("llama"), tiny_tokenizer(), **OPTIONS)


@pytest.fixture
def client(served):
    server, _ = served
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(autouse=True)
def nothing_left(served):
    yield
    _, front = served
    check_served_idle(front)
    assert front.alive


def raw(server, method: str, path: str, body: bytes | None = None, auth: bool = True):
    """A raw request (bodies the openai client would never send): (status, body bytes)."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    headers = {"Content-Type": "application/json"}
    if auth:
        headers["Authorization"] = f"Bearer {KEY}"
    try:
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def offline_texts(engine, prompts, params) -> list[str]:
    return [out.text for out in engine.generate(prompts, params)]


def stream_text(client, **kwargs) -> tuple[dict[int, str], dict[int, str], object]:
    texts, reasons, usage = {}, {}, None
    for chunk in client.completions.create(stream=True, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage


def test_greedy_equals_offline_engine_and_transformers(served, offline, client):
    tok = tiny_tokenizer()
    params = SamplingParams(max_tokens=12, temperature=0.0)
    expected = offline_texts(offline, PROMPTS, params)
    model = build_model("llama")
    for prompt, want in zip(PROMPTS, expected):
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        hf = model.generate(ids, max_new_tokens=12, do_sample=False)
        assert tok.decode(hf[0, ids.shape[1] :], skip_special_tokens=True) == want
    r = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == expected
    texts, reasons, usage = stream_text(
        client,
        model=MODEL,
        prompt=PROMPTS,
        max_tokens=12,
        temperature=0,
        stream_options={"include_usage": True},
    )
    assert [texts[i] for i in range(len(PROMPTS))] == expected
    assert (
        usage.prompt_tokens
        == r.usage.prompt_tokens
        == sum(len(tok(p)["input_ids"]) for p in PROMPTS)
    )
    assert usage.completion_tokens == r.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert set(reasons) == set(range(len(PROMPTS)))


def test_token_id_prompts_and_usage(client):
    ids = [5, 17, 42, 99]
    r = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 7
    assert r.choices[0].finish_reason == "length"


def test_chat_uses_the_template_and_streams_the_same(served, offline, client):
    tok = tiny_tokenizer()
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello there"},
    ]
    ids = tok(
        tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )["input_ids"]
    want = offline.generate([ids], SamplingParams(max_tokens=10, temperature=0.0))[0]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=10, temperature=0
    )
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(want.output_token_ids)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_n_and_seed_equal_offline_engine(offline, client):
    kwargs = dict(model=MODEL, prompt="hello world", max_tokens=10, temperature=1.0, n=3)
    params = SamplingParams(max_tokens=10, temperature=1.0, n=3, seed=1234)
    expected = offline_texts(offline, ["hello world"], params)
    a = client.completions.create(seed=1234, **kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == expected
    texts, _, _ = stream_text(client, seed=1234, **kwargs)
    assert [texts[i] for i in range(3)] == expected
    others = [client.completions.create(seed=s, **kwargs).choices[0].text for s in (1, 2, 3)]
    assert len({expected[0], *others}) > 1, "the seed changes nothing"


def test_stop_strings_cut_the_text(offline, client):
    full = offline_texts(offline, ["hello world"], SamplingParams(max_tokens=16, temperature=0))
    full = full[0]
    stop = full[5:7]  # something the greedy text reaches mid-way
    assert len(full) > 8 and stop
    want = full[: full.index(stop)]
    r = client.completions.create(
        model=MODEL, prompt="hello world", max_tokens=16, temperature=0, stop=[stop, "QQQQ"]
    )
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == "stop"
    texts, reasons, _ = stream_text(
        client, model=MODEL, prompt="hello world", max_tokens=16, temperature=0, stop=stop
    )
    assert texts[0] == want and reasons[0] == "stop"


def test_logprobs(client):
    r = client.completions.create(
        model=MODEL, prompt="hello world", max_tokens=6, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and chosen == pytest.approx(max(top.values()))  # greedy: the best
    assert "".join(lp.tokens) == r.choices[0].text
    c = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob)


def test_models_health_metrics(served, client):
    server, _ = served
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert raw(server, "GET", "/health", auth=False)[0] == 200  # no key needed
    assert raw(server, "GET", "/metrics", auth=False)[0] == 401
    client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
    text = raw(server, "GET", "/metrics")[1].decode()
    for name in (
        "hf_paged:num_requests_running",
        "hf_paged:num_requests_waiting",
        "hf_paged:kv_cache_usage_perc",
        "hf_paged:prefix_cache_hit_rate",
        "hf_paged:time_to_first_token_seconds_bucket",
        "hf_paged:time_per_output_token_seconds_bucket",
    ):
        assert name in text
    generated = [ln for ln in text.splitlines() if ln.startswith("hf_paged:generation_tokens_t")]
    assert float(generated[0].split()[-1]) >= 3


def test_errors_are_openai_shaped_and_the_server_keeps_serving(served, client):
    server, _ = served
    bad = [
        # (kwargs, exception, param)
        (dict(extra_body={"logit_bias": {"5": 10}}), openai.BadRequestError, "logit_bias"),
        (dict(extra_body={"frobnicate": 1}), openai.BadRequestError, "frobnicate"),
        (dict(temperature=5.0), openai.BadRequestError, "temperature"),
        (dict(n=0), openai.BadRequestError, "n"),
        (dict(max_tokens=120), openai.BadRequestError, "max_tokens"),  # prompt + 120 > 128
        (dict(prompt="a b c d e " * 40), openai.BadRequestError, "prompt"),  # over 128 alone
        (dict(prompt=[5, 300]), openai.BadRequestError, "prompt"),  # outside the vocabulary
        (dict(model="gpt-4"), openai.NotFoundError, "model"),
    ]
    for kwargs, exc, param in bad:
        args = dict(model=MODEL, prompt="hello world", max_tokens=8) | kwargs
        with pytest.raises(exc) as info:
            client.completions.create(**args)
        error = info.value.body
        assert error["param"] == param, (kwargs, error)
        assert error["type"] and error["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            tools=[{"type": "function", "function": {"name": "f"}}],
        )
    assert info.value.body["param"] == "tools" and "tools" in info.value.body["message"]
    with pytest.raises(openai.AuthenticationError) as info:
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    status, body = raw(server, "POST", "/v1/completions", b'{"model": ')
    assert status == 400 and "JSON" in json.loads(body)["error"]["message"]
    big = b'{"model": "tiny-llama", "prompt": "' + b"a" * (5 << 20) + b'"}'
    status, body = raw(server, "POST", "/v1/completions", big)
    assert status == 413 and json.loads(body)["error"]["message"]
    status, body = raw(server, "POST", "/v1/nothing", b"{}")
    assert status == 404 and "error" in json.loads(body)
    # null and "off" values of unsupported fields ask for nothing: accepted
    ok = client.completions.create(
        model=MODEL, prompt="hello", max_tokens=3, extra_body={"logit_bias": None, "echo": False}
    )
    assert ok.usage.completion_tokens >= 1


def test_disconnect_aborts_and_frees_blocks(served, client):
    _, front = served
    steps0 = engine_stats(front)["num_steps"]
    streams = [
        client.completions.create(
            model=MODEL,
            prompt=p,
            max_tokens=100,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for p in PROMPTS
    ]
    for s in streams:
        next(iter(s))  # the request runs
    stats = engine_stats(front)
    assert stats["free_blocks"] < stats["num_blocks"]
    for s in streams:
        s.close()  # the client goes away mid-stream
    check_served_idle(front)  # every block back in the pool
    assert engine_stats(front)["num_steps"] - steps0 < 100, "ran to the end: not aborted"


def test_many_concurrent_streams_some_disconnecting(served, offline):
    """200 streaming clients at once, every fifth hanging up after its second chunk: the others
    get exactly the offline engine's greedy text; nothing is left behind."""
    server, front = served
    prompts = [f"request number {i} says {'ab' * (i % 7)}" for i in range(200)]
    expected = offline_texts(offline, prompts, SamplingParams(max_tokens=16, temperature=0))

    async def one(client, i: int):
        stream = await client.completions.create(
            model=MODEL, prompt=prompts[i], max_tokens=16, temperature=0, stream=True
        )
        text, chunks = "", 0
        async for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
            chunks += 1
            if i % 5 == 0 and chunks == 2:
                await stream.close()
                return None
        return text

    async def run():
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key=KEY, max_retries=0
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(200)))

    results = asyncio.run(run())
    for i, (got, want) in enumerate(zip(results, expected)):
        if i % 5:
            assert got == want, i
    check_served_idle(front)
