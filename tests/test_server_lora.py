"""LoRA adapters as served models: `hf-paged serve BASE --lora NAME=PATH ...` loads peft
adapters saved to disk, lists each in /v1/models beside the base, and runs a request's `model`
with its adapter: greedy output equal to the offline Engine with that adapter (and to peft's own
generate), streaming and not, completions and chat; an unknown name is a 404 in OpenAI's shape;
a request of an adapter beyond max_loras waits for a seat; per-adapter counts in /metrics."""

from __future__ import annotations

import concurrent.futures
import sys
import urllib.request

import openai
import pytest
import torch

from hf_paged import Engine, SamplingParams
from hf_paged.entrypoints.api_server import build_app
from hf_paged.entrypoints.serve import build, build_parser, engine_options, load, main
from hf_paged.entrypoints.server_thread import ServerThread
from hf_paged.testing import check_served_idle, tiny_tokenizer

peft = pytest.importorskip("peft")

KEY = "k"
ADAPTERS = {"math": (4, ["q_proj", "v_proj"]), "code": (2, ["o_proj", "down_proj"])}
PROMPTS = ["hello world", "the quick brown fox"]


def _conftest():
    return sys.modules["tests.conftest"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The tiny Llama and its tokenizer in one folder, each adapter (random lora_B: peft starts
    it at zero, no effect) in a folder of its own, as save_pretrained writes them."""
    root = tmp_path_factory.mktemp("lora-serve")
    _conftest().build_model("llama").save_pretrained(root / "base")
    tiny_tokenizer().save_pretrained(root / "base")
    for seed, (name, (rank, targets)) in enumerate(ADAPTERS.items()):
        cfg = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets)
        model = peft.get_peft_model(_conftest().build_model("llama"), cfg)
        torch.manual_seed(seed)
        _conftest().randomize_lora_b(model)
        model.save_pretrained(root / name)
    return root


def _args(folders, *extra):
    argv = [str(folders / "base"), "--served-model-name", "base", "--api-key", KEY]
    for name in ADAPTERS:
        argv += ["--lora", f"{name}={folders / name}"]
    argv += ["--engine-option", "num_blocks=128", "--max-model-len", "128", *extra]
    return build_parser().parse_args(argv)


@pytest.fixture(scope="module", params=["thread", "process"])
def served(folders, request):
    """The command's server in both modes (--engine-process: the engine process loads the base
    model and its adapters from the folders)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    process = ["--engine-process"] if request.param == "process" else []
    args = _args(folders, "--engine-option", "max_loras=1", *process)  # two adapters, one slot
    engine, app = build(args, engine_options(args))
    try:
        with ServerThread(app) as server:
            yield engine, server, app.state.front
    finally:
        engine.close() if process else engine.shutdown()
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def offline(folders):
    """The same folders loaded as the command loads them, in an Engine of their own."""
    args = _args(folders)
    model, tokenizer = load(args)
    return Engine(model, tokenizer, **engine_options(args))


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[1].url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(autouse=True)
def nothing_left(request):
    yield
    if "served" not in request.fixturenames:
        return
    engine, _, front = request.getfixturevalue("served")
    check_served_idle(front)
    assert front.alive


def _offline(offline, prompts, adapter, max_tokens=10):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, adapter=adapter)
    return [o.text for o in offline.generate(prompts, params)]


def test_models_lists_base_and_adapters(client):
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == ["base", "math", "code"]
    assert cards["math"].parent == "base" and cards["code"].parent == "base"
    assert client.models.retrieve("code").id == "code"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("physics")
    assert err.value.body["code"] == "model_not_found"


def test_each_model_name_runs_its_adapter(client, offline, folders):
    want = {name: _offline(offline, PROMPTS, name) for name in ("math", "code")}
    want["base"] = _offline(offline, PROMPTS, None)
    assert len({tuple(w) for w in want.values()}) == 3  # the adapters change the output
    # peft's own generate with the adapter, on a copy no engine holds: the offline reference
    model, tok = load(_args(folders))
    model.set_adapter("math")
    ids = tok(PROMPTS[0], return_tensors="pt")["input_ids"]
    out = model.generate(input_ids=ids, max_new_tokens=10, do_sample=False)
    assert tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True) == want["math"][0]
    for name in ("math", "base", "code", "math"):  # one slot: each adapter in turn
        r = client.completions.create(model=name, prompt=PROMPTS, max_tokens=10, temperature=0)
        assert r.model == name
        assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == want[name]
        texts = {}
        for chunk in client.completions.create(
            model=name, prompt=PROMPTS, max_tokens=10, temperature=0, stream=True
        ):
            assert chunk.model == name
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
        assert [texts[i] for i in range(len(PROMPTS))] == want[name]


def test_chat_with_an_adapter(client, offline):
    messages = [{"role": "user", "content": "hello there"}]
    tok = offline.tokenizer
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    (want,) = _offline(offline, [ids], "code", max_tokens=8)
    assert want != _offline(offline, [ids], None, max_tokens=8)[0]
    r = client.chat.completions.create(model="code", messages=messages, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == want and r.model == "code"


def test_unknown_model_is_a_404_and_serving_goes_on(client):
    for call in (
        lambda: client.completions.create(model="physics", prompt="hi", max_tokens=2),
        lambda: client.chat.completions.create(
            model="physics", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        ),
    ):
        with pytest.raises(openai.NotFoundError) as err:
            call()
        body = err.value.body
        assert body["param"] == "model" and "physics" in body["message"]
        assert body["code"] == "model_not_found"
    r = client.completions.create(model="math", prompt="hi", max_tokens=2)
    assert r.usage.completion_tokens >= 1


def test_an_adapter_beyond_the_slots_waits_for_a_seat(client):
    """max_loras=1: while a math request runs, a code request waits (vLLM's max_loras per
    step); math and base requests run beside it; the code request runs once math's has ended."""
    held = client.completions.create(
        model="math", prompt="hold", max_tokens=100, extra_body={"ignore_eos": True}, stream=True
    )
    chunks = iter(held)
    next(chunks)  # it runs
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(client.completions.create, model="code", prompt="hi", max_tokens=2)
        client.completions.create(model="math", prompt="hi", max_tokens=2)  # its own adapter runs
        client.completions.create(model="base", prompt="hi", max_tokens=2)  # so does the base
        for _ in range(5):
            next(chunks)
        assert not waiting.done()  # no seat while math's request runs
        held.close()  # math's request ends (aborted): code gets the slot
        assert waiting.result(timeout=60).usage.completion_tokens >= 1


def test_metrics_count_requests_per_adapter(client, served):
    _, server, _ = served
    for name in ("base", "math", "code"):  # (whatever ran before in this server)
        client.completions.create(model=name, prompt="count me", max_tokens=3)
    req = urllib.request.Request(
        server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}
    )
    text = urllib.request.urlopen(req).read().decode()
    for name in ("base", "math", "code"):
        assert f'model_name="{name}"' in text
    line = next(
        ln
        for ln in text.splitlines()
        if ln.startswith("hf_paged:request_success_total") and 'model_name="code"' in ln
    )
    assert float(line.split()[-1]) >= 1


def test_bad_lora_options(folders, served):
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--lora", "no-path"])
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--lora", "__base__=x"])
    args = parser.parse_args(["m", "--lora", "a=x", "--lora", "a=y"])
    with pytest.raises(ValueError, match="--lora"):
        engine_options(args)
    assert main(["serve", "m", "--lora", "a=x", "--lora", "a=y"]) == 2  # before any loading
    args = parser.parse_args(["m", "--served-model-name", "a", "--lora", "a=x"])
    with pytest.raises(ValueError, match="base model's served name"):
        engine_options(args)
    engine = served[0]
    with pytest.raises(ValueError, match="adapters: \\['physics'\\]"):
        build_app(engine, "base", adapters={"physics": "physics"})
    with pytest.raises(ValueError, match="adapters: 'math'"):
        build_app(engine, "math", adapters={"math": "math"})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_adapters_served_on_the_gpu(folders):
    """The engine's GPU defaults (Triton LoRA kernels, torch.compile, CUDA graphs), float32:
    each served name's greedy output equals the offline Engine's with its adapter, requests
    alone and many at once (adapters mixed in one batch)."""
    from concurrent.futures import ThreadPoolExecutor

    args = _args(folders, "--device-map", "cuda", "--dtype", "float32")
    options = engine_options(args)
    offline = Engine(*load(args), **options)
    prompts = [f"{p} {i}" for i in range(6) for p in PROMPTS]
    names = {"math": "math", "code": "code", "base": None}
    want = {name: _offline(offline, prompts, adapter) for name, adapter in names.items()}
    assert len({tuple(w) for w in want.values()}) == 3
    offline.shutdown()
    engine, app = build(args, options)
    with ServerThread(app) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)

        def one(name: str, prompt: str) -> str:
            r = client.completions.create(model=name, prompt=prompt, max_tokens=10, temperature=0)
            return r.choices[0].text

        for name in names:
            assert [one(name, p) for p in prompts[:2]] == want[name][:2]
        jobs = [(name, i) for i in range(len(prompts)) for name in names]
        with ThreadPoolExecutor(len(jobs)) as pool:
            got = list(pool.map(lambda job: one(job[0], prompts[job[1]]), jobs))
        assert got == [want[name][i] for name, i in jobs]
    engine.check_invariants()
    assert engine.kv.get_num_free_blocks() == engine.kv.num_blocks
    engine.shutdown()


def test_an_adapter_the_engine_cannot_run_is_refused_at_start_up(tmp_path, folders):
    """A DoRA adapter loads in peft, and the command stops with the engine's ValueError."""
    cfg = peft.LoraConfig(r=2, target_modules=["q_proj"], use_dora=True)
    peft.get_peft_model(_conftest().build_model("llama"), cfg).save_pretrained(tmp_path / "dora")
    args = build_parser().parse_args([str(folders / "base"), "--lora", f"dora={tmp_path / 'dora'}"])
    with pytest.raises(ValueError, match="DoRA"):
        build(args, engine_options(args))
