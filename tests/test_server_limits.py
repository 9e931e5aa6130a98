"""The server's edges: the waiting-queue cap (429), text that streams byte-level tokens (partial
UTF-8), the incremental detokenizer on its own, and the `hf-paged serve` command."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
import torch

from hf_paged.engine.engine import Engine
from hf_paged.entrypoints.api_server import build_app
from hf_paged.entrypoints.detokenizer import IncrementalDetokenizer, final_text
from hf_paged.entrypoints.server_thread import ServerThread, free_port
from hf_paged.testing import tiny_tokenizer


def build_model(arch: str, **overrides):
    # the tests' seeded tiny models: conftest.py is loaded by pytest as tests.conftest
    return sys.modules["tests.conftest"].build_model(arch, **overrides)


def byte_tokenizer():
    """A byte-level tokenizer (GPT-2 style, no merges): 3 specials + 256 bytes. A random model
    over it writes arbitrary byte sequences: multi-byte characters split across tokens, and
    invalid UTF-8."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "</s>", "<s>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="</s>", bos_token="<s>"
    )


def wait_idle(engine, front, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.has_unfinished_requests() or front.num_in_flight:
        assert time.monotonic() < deadline, "requests left in the engine"
        time.sleep(0.01)


@pytest.mark.parametrize("tokenizer", ["byte", "metaspace"])
def test_detokenizer_pieces_equal_the_whole_text(tokenizer):
    tok = byte_tokenizer() if tokenizer == "byte" else tiny_tokenizer()
    rng = random.Random(0)
    multibyte = 0
    for trial in range(200):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
        if tokenizer == "byte" and trial % 2:  # real multi-byte characters, split anywhere
            ids = tok("héllo wörld 日本語 🙂 ok", add_special_tokens=False)["input_ids"]
        stop = [tok.decode(ids[3:5])] if trial % 3 == 0 and len(ids) > 6 else None
        stop = [s for s in stop or () if s] or None
        detok = IncrementalDetokenizer(tok, stop)
        pieces, i = [], 0
        while i < len(ids) and not detok.stopped:
            k = rng.randrange(1, 4)
            pieces.append(detok.add(ids[i : i + k], finished=i + k >= len(ids)))
            i += k
        if detok.stopped and i < len(ids):
            pieces.append(detok.add(ids[i:], finished=True))  # more tokens after the stop
        want, cut = final_text(tok, ids, stop)
        assert "".join(pieces) == want, (ids, stop)
        assert detok.stopped == cut
        multibyte += any(ord(ch) > 127 for ch in want)
    if tokenizer == "byte":
        assert multibyte > 50  # the test saw what it is about


def test_streamed_bytes_equal_the_whole_text():
    """A model writing random bytes: every streamed concatenation equals the non-streamed text."""
    tok = byte_tokenizer()
    engine = Engine(build_model("llama", vocab_size=len(tok)), tok, num_blocks=64)
    front = None
    with ServerThread(build_app(engine, "bytes")) as server:
        front = server.server.config.app.state.front
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        non_ascii = 0
        for seed in range(6):
            kwargs = dict(model="bytes", prompt="héllo", max_tokens=24, temperature=1.5)
            whole = client.completions.create(seed=seed, **kwargs).choices[0].text
            streamed = "".join(
                c.choices[0].text
                for c in client.completions.create(seed=seed, stream=True, **kwargs)
                if c.choices
            )
            assert streamed == whole, seed
            non_ascii += any(ord(ch) > 127 for ch in whole)
        assert non_ascii >= 3
    wait_idle(engine, front)


@contextlib.contextmanager
def _opens(gate: threading.Event):
    try:
        yield
    finally:
        gate.set()  # a failed assertion must not leave the engine loop waiting


def test_queue_full_is_429_and_the_server_recovers():
    engine = Engine(build_model("llama"), tiny_tokenizer(), num_blocks=64, max_num_seqs=2)
    gate = threading.Event()  # steps wait for it: the held requests cannot finish meanwhile
    step = engine.step
    engine.step = lambda: gate.wait() and step()
    with ServerThread(build_app(engine, "tiny", max_queued=1)) as server, _opens(gate):
        front = server.server.config.app.state.front
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        kwargs = dict(model="tiny", max_tokens=50, stream=True)
        # 3 = max_num_seqs + max_queued sequences in flight (a stream answers with its headers)
        held = [client.completions.create(prompt=f"hello {i}", **kwargs) for i in range(3)]
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model="tiny", prompt="one too many", max_tokens=4)
        assert info.value.status_code == 429 and info.value.body["code"] == "queue_full"
        assert front.num_in_flight == 3
        gate.set()
        for s in held:
            assert "".join(c.choices[0].text for c in s if c.choices)  # they run to the end
        wait_idle(engine, front)
        r = client.completions.create(model="tiny", prompt="room again", max_tokens=4, n=2)
        assert len(r.choices) == 2
        gate.clear()
        held = [client.completions.create(prompt=f"hi {i}", **kwargs) for i in range(2)]
        with pytest.raises(openai.RateLimitError):  # n counts: 2 + 2 sequences do not fit
            client.completions.create(model="tiny", prompt="x", max_tokens=4, n=2)
        for s in held:
            s.close()  # the server hears of it while no step can run: aborted at once
        deadline = time.monotonic() + 10
        while front.num_in_flight or engine.scheduler.requests:
            assert time.monotonic() < deadline, "the closed streams were not aborted"
            time.sleep(0.01)
        gate.set()
        wait_idle(engine, front)
    assert engine.kv.get_num_free_blocks() == engine.kv.num_blocks


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.parametrize("mode", [[], ["--engine-process"]], ids=["thread", "process"])
def test_serve_command(tmp_path, mode):
    """`python -m hf_paged.entrypoints.serve FOLDER`: a saved model folder served end to end;
    with --engine-process, the engine process is gone once the server stopped."""
    folder = tmp_path / "model"
    build_model("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    port = free_port()
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "hf_paged.entrypoints.serve", str(folder)]
    cmd += ["--port", str(port), "--api-key", "k", "--served-model-name", "tiny"]
    cmd += ["--engine-option", "num_blocks=64", "--log-level", "warning"]
    cmd += mode
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
            try:
                assert [m.id for m in client.models.list().data] == ["tiny"]
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, "the server did not come up"
                time.sleep(0.5)
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5
        )
        assert r.usage.completion_tokens >= 1
        children = _children(proc.pid)  # the engine process (and multiprocessing's tracker)
        assert bool(children) == bool(mode), children
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while not all(_gone(pid) for pid in children):
        assert time.monotonic() < deadline, "the engine process outlived the server"
        time.sleep(0.05)
    # uvicorn shuts down gracefully on SIGTERM, then re-raises the signal it caught
    assert proc.returncode in (0, -signal.SIGTERM), proc.stdout.read().decode()[-2000:]


def test_serve_command_refuses_bad_engine_options():
    from hf_paged.entrypoints.serve import main

    assert main(["serve", "no-such-model", "--engine-option", "num_blokcs=4"]) == 2


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
