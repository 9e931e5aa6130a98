"""`hf-paged serve --engine-process`: the engine in a spawned process of its own. What the
server tests (run in both modes) do not show: a child that cannot start is an error in the
parent, never a hang; a closed handle's abort reaches the child and frees its blocks; the queue
cap holds; the child does not outlive the API process, however that one ends; close() ends it
cleanly."""

from __future__ import annotations

import asyncio
import functools
import os
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request

import pytest
import torch

from hf_paged.entrypoints.core_messages import EngineSpec
from hf_paged.entrypoints.engine_client import EngineProcess, EngineStartError
from hf_paged.entrypoints.fronts import QueueFull
from hf_paged.entrypoints.serve import build_parser, engine_options, load, load_tokenizer
from hf_paged.sampling_params import SamplingParams
from hf_paged.testing import tiny_tokenizer

OPTIONS = ["--engine-option", "num_blocks=64", "--max-model-len", "64", "--max-num-seqs", "8"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-process")
    sys.modules["tests.conftest"].build_model("llama").save_pretrained(root)
    tiny_tokenizer().save_pretrained(root)
    return root


def _spec(folder) -> tuple[EngineSpec, object]:
    args = build_parser().parse_args([str(folder), *OPTIONS])
    return EngineSpec(functools.partial(load, args), engine_options(args)), load_tokenizer(args)


def test_start_up_failures_are_errors_in_the_parent(folder, tmp_path):
    # the child's exception, with its traceback
    (tmp_path / "no-model").mkdir()
    tiny_tokenizer().save_pretrained(tmp_path / "no-model")  # a tokenizer and no weights
    spec, tokenizer = _spec(tmp_path / "no-model")
    with pytest.raises(EngineStartError, match="failed to start:\n(.|\n)*Traceback"):
        EngineProcess(spec, tokenizer)
    # an Engine option only the built engine can refuse
    spec, tokenizer = _spec(folder)
    spec.options["max_model_len"] = 4096  # the model has 512 positions
    with pytest.raises(EngineStartError, match="max_position_embeddings"):
        EngineProcess(spec, tokenizer)
    # a child that dies without a word
    spec.load = functools.partial(os._exit, 3)
    with pytest.raises(EngineStartError, match="exited with code 3"):
        EngineProcess(spec, tokenizer)


def test_a_closed_handle_aborts_in_the_child_and_close_ends_it(folder):
    spec, tokenizer = _spec(folder)
    with EngineProcess(spec, tokenizer, max_queued=1) as front:

        async def run():
            front.start()
            params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
            handle = front.submit([[5, 6, 7], [8, 9]], params)
            await handle.admitted()
            outs = await handle.next_outputs()  # they run
            assert outs and not handle.finished
            handle.close()  # the client went away
            assert front.num_in_flight == 0
            # the child aborted them: every block back in the pool long before 50 steps
            await asyncio.to_thread(front.check_idle)
            assert (await asyncio.to_thread(front.call, "stats"))["num_steps"] < 40
            bad = front.submit([[5, 300]], SamplingParams(max_tokens=4))  # outside the vocab
            with pytest.raises(ValueError, match="vocabulary"):
                await bad.admitted()
            assert front.num_in_flight == 0 and front.alive
            # admission: max_num_seqs (8) + max_queued (1) sequences in flight, n counts
            held = front.submit([[5, 6], [7]], SamplingParams(max_tokens=50, n=4))
            with pytest.raises(QueueFull):
                front.submit([[5]], SamplingParams(max_tokens=4, n=2))
            await held.admitted()
            held.close()
            await asyncio.to_thread(front.check_idle)

        asyncio.run(run())
        front.shutdown()
    assert not front.process.is_alive() and front.process.exitcode == 0


_PARENT = """
import os, signal, sys, functools
from hf_paged.entrypoints.core_messages import EngineSpec
from hf_paged.entrypoints.engine_client import EngineProcess
from hf_paged.entrypoints.serve import build_parser, engine_options, load, load_tokenizer

if __name__ == "__main__":
    args = build_parser().parse_args([sys.argv[1], *sys.argv[3:]])
    spec = EngineSpec(functools.partial(load, args), engine_options(args))
    front = EngineProcess(spec, load_tokenizer(args))
    print(front.process.pid, flush=True)
    if sys.argv[2] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)  # no atexit, no close: only the pipe closes
    sys.exit(0)  # interpreter exit without close(): atexit ends the child
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.split()[1] == "Z" for line in f if line.startswith("State:"))
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("how", ["kill", "exit"])
def test_the_child_does_not_outlive_the_api_process(folder, tmp_path, how):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(_PARENT))
    done = subprocess.run(
        [sys.executable, str(script), str(folder), how, *OPTIONS],
        capture_output=True,
        text=True,
        timeout=120,
    )
    pid = int(done.stdout.split()[0])
    deadline = time.monotonic() + 30
    while not _gone(pid):
        assert time.monotonic() < deadline, f"the engine process {pid} outlived its parent"
        time.sleep(0.05)


def test_an_engine_process_that_dies_is_a_503_not_a_hang(folder):
    """The engine process killed under a live server: /health says so, a stream in progress
    ends with an error, new requests get 503, and the server itself keeps answering."""
    import signal

    import openai

    from hf_paged.entrypoints.api_server import build_app
    from hf_paged.entrypoints.server_thread import ServerThread

    spec, tokenizer = _spec(folder)
    with EngineProcess(spec, tokenizer) as front, ServerThread(build_app(front, "m")) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        stream = client.completions.create(
            model="m", prompt="hi", max_tokens=50, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(stream))  # it runs
        os.kill(front.process.pid, signal.SIGKILL)
        with pytest.raises(openai.APIError):
            for _ in stream:
                pass
        deadline = time.monotonic() + 10
        while front.alive:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(server.url + "/health")
        assert info.value.code == 503
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model="m", prompt="hi", max_tokens=2)
        assert info.value.status_code == 503


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_engine_process_on_the_gpu(folder):
    """`--engine-process` on CUDA with the engine's GPU defaults (torch.compile, CUDA graphs),
    float32: 32 concurrent streamed requests get the offline Engine's greedy text; every block
    is back in the pool after."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from hf_paged.engine.engine import Engine
    from hf_paged.entrypoints.serve import build
    from hf_paged.entrypoints.server_thread import ServerThread

    argv = [str(folder), "--device-map", "cuda", "--dtype", "float32", "--served-model-name", "m"]
    argv += ["--engine-option", "num_blocks=512", "--max-model-len", "128"]
    args = build_parser().parse_args(argv)
    options = engine_options(args)
    prompts = [f"request {i} says {'ab' * (i % 5)}" for i in range(32)]
    offline = Engine(*load(args), **options)
    want = [
        o.text for o in offline.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))
    ]
    offline.shutdown()
    args.engine_process = True
    front, app = build(args, options)
    try:
        with ServerThread(app) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

            def one(prompt: str) -> str:
                chunks = client.completions.create(
                    model="m", prompt=prompt, max_tokens=24, temperature=0, stream=True
                )
                return "".join(c.choices[0].text for c in chunks if c.choices)

            with ThreadPoolExecutor(len(prompts)) as pool:
                got = list(pool.map(one, prompts))
            assert got == want
            front.check_idle()
    finally:
        front.close()
