"""A seeded random walk over the engine's operations, checked after every one.

Operations: add a request (greedy, n > 1, repetition penalty, a stop string, a user stopping
criterion that stops or raises), step, abort, and a whole model.generate call (greedy batch or
beam search) on the same engine, under preemption pressure (few KV blocks, few seats), with and
without asynchronous scheduling and prefix caching; from one thread, or from two (one walking,
one calling generate). After every operation Engine.check_invariants holds (no row, block,
penalty row or request without an owner; no finished request running). At the end every request
has exactly one final output, and its tokens are what a single-request run gives: transformers'
greedy generate on an unpatched twin of the model, cut where the request's own stop rules cut it
(an aborted request: a prefix of that).

CI runs a few thousand operations; a longer walk:
    python tests/test_engine_state_machine.py --ops 50000 --seed 1 [--threads 2]
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

import pytest
import torch
from transformers import StoppingCriteria
from transformers.generation.stopping_criteria import StopStringCriteria

import hf_paged
from hf_paged import SamplingParams
from hf_paged.testing import tiny_tokenizer

EOS = 1
MAX_TOKENS = 16  # references are computed once at this length; shorter requests take a prefix


class Raise(RuntimeError):
    pass


class AtLength(StoppingCriteria):
    """Stops (or raises) once the sequence has `length` tokens."""

    def __init__(self, length: int, raises: bool) -> None:
        self.length, self.raises = length, raises

    def __call__(self, input_ids, scores, **kwargs):
        hit = input_ids.shape[-1] >= self.length
        if hit and self.raises:
            raise Raise(f"user criterion raised at {input_ids.shape[-1]} tokens")
        return torch.full((input_ids.shape[0],), hit, dtype=torch.bool)


@dataclass
class Tracked:
    prompt: int  # index into the prompt pool
    penalty: float
    max_tokens: int
    n: int
    stop_string: str | None = None
    criterion: AtLength | None = None
    stream: object = None
    aborted: bool = False
    outputs: dict[str, list] = field(default_factory=dict)  # request id -> its outputs


class Walk:
    def __init__(self, model, twin, seed: int, threads: int) -> None:
        self.rnd = rnd = random.Random(seed)
        self.model, self.twin = model, twin
        self.tok = tiny_tokenizer()
        self.options = dict(
            max_num_seqs=rnd.choice([4, 6, 8]),
            block_size=4,
            num_blocks=rnd.choice([12, 16, 20]),
            max_num_batched_tokens=rnd.choice([8, 16, 64]),
            scheduling_policy=rnd.choice(["fcfs", "priority"]),
            async_scheduling=rnd.choice([True, False]),
            enable_prefix_caching=rnd.choice([True, False]),
        )
        hf_paged.patch(model, self.tok, **self.options)
        self.engine = hf_paged.get_engine(model)
        g = torch.Generator().manual_seed(seed)
        self.prompts = [
            torch.randint(3, 256, (int(rnd.randint(1, 18)),), generator=g).tolist()
            for _ in range(10)
        ]
        self.refs: dict[tuple, list[int]] = {}
        self.tracked: list[Tracked] = []
        self.active: list[Tracked] = []  # with a request that has no final output yet
        # the queue stays a few batches deep, so a long walk keeps exercising admission and
        # preemption instead of only growing its backlog
        self.max_live = 3 * self.options["max_num_seqs"]
        self.threads = threads
        self.ops = {"add": 0, "step": 0, "abort": 0, "generate": 0}

    # -- references ------------------------------------------------------------------------------

    def reference(self, prompt: int, penalty: float) -> list[int]:
        """transformers' greedy tokens for one prompt alone, up to and including EOS."""
        key = (prompt, penalty)
        if key not in self.refs:
            ids = torch.tensor([self.prompts[prompt]])
            out = self.twin.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
                repetition_penalty=penalty,
                pad_token_id=0,
            )[0, ids.shape[1] :].tolist()
            if EOS in out:
                out = out[: out.index(EOS) + 1]
            self.refs[key] = out
        return self.refs[key]

    def expected(self, t: Tracked) -> tuple[list[int], str]:
        """The tokens and finish reason a single-request run gives, checking stops in the
        engine's order: EOS, then the length, then stop strings and user criteria."""
        prompt = self.prompts[t.prompt]
        ref = self.reference(t.prompt, t.penalty)
        stop = StopStringCriteria(self.tok, [t.stop_string]) if t.stop_string else None
        for k in range(1, len(ref) + 1):
            if ref[k - 1] == EOS:
                return ref[:k], "stop"
            if k == t.max_tokens:
                return ref[:k], "length"
            if stop is not None and bool(stop(torch.tensor([prompt + ref[:k]]), None)[0]):
                return ref[:k], "stop"
            if t.criterion is not None and len(prompt) + k >= t.criterion.length:
                return ref[:k], "error" if t.criterion.raises else "stop"
        raise AssertionError("the reference is shorter than MAX_TOKENS without EOS")

    # -- operations ------------------------------------------------------------------------------

    def add(self) -> None:
        rnd = self.rnd
        t = Tracked(
            prompt=rnd.randrange(len(self.prompts)),
            penalty=rnd.choice([1.0, 1.0, 1.0, 1.3]),
            max_tokens=rnd.choice([1, 3, 8, MAX_TOKENS]),
            n=rnd.choice([1, 1, 1, 2, 3]),
        )
        kind = rnd.random()
        prompt = self.prompts[t.prompt]
        if kind < 0.15:  # a stop string taken from the reference text, so it does occur
            text = self.tok.decode(self.reference(t.prompt, t.penalty)[:-1] or [40])
            start = rnd.randrange(max(1, len(text) - 1))
            t.stop_string = text[start : start + 2] or "z"
        elif kind < 0.3:
            t.criterion = AtLength(len(prompt) + rnd.randint(1, 10), raises=rnd.random() < 0.6)
        params = SamplingParams(
            max_tokens=t.max_tokens,
            temperature=0.0,
            n=t.n,
            repetition_penalty=t.penalty,
            stop_strings=[t.stop_string] if t.stop_string else None,
            stopping_criteria=[t.criterion] if t.criterion else None,
        )
        t.stream = self.engine.stream([prompt], params)
        for rid in t.stream.request_ids:
            t.outputs[rid] = []
        self.tracked.append(t)
        self.active.append(t)

    def step(self) -> None:
        self.engine.step()

    def abort(self) -> None:
        live = [
            (t, rid)
            for t in self.active
            for rid in t.outputs
            if rid in self.engine.scheduler.requests
        ]
        if not live:
            return
        t, rid = self.rnd.choice(live)
        try:
            self.engine.abort(rid)
        except ValueError:  # another thread's step finished it in between
            assert self.threads > 1
            return
        t.aborted = True

    def generate(self, rnd: random.Random) -> None:
        """A whole generate call on the patched model: greedy or beams, against transformers."""
        rows = rnd.sample(range(len(self.prompts)), 2)
        longest = max(len(self.prompts[r]) for r in rows)
        ids = torch.zeros((2, longest), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            p = self.prompts[r]
            ids[i, longest - len(p) :] = torch.tensor(p)
            mask[i, longest - len(p) :] = 1
        kwargs = dict(max_new_tokens=rnd.choice([2, 5]), num_beams=rnd.choice([1, 2]))
        got = self.model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        want = self.twin.generate(input_ids=ids, attention_mask=mask, do_sample=False, **kwargs)
        assert torch.equal(got, want), (rows, kwargs)

    def poll(self) -> None:
        for t in list(self.active):
            for out in t.stream.poll():
                t.outputs[out.request_id].append(out)
            if all(outs and outs[-1].finished for outs in t.outputs.values()):
                self.active.remove(t)

    # -- the walk --------------------------------------------------------------------------------

    def run(self, num_ops: int) -> dict:
        stop = threading.Event()
        errors: list[BaseException] = []
        other = None
        if self.threads > 1:
            side = random.Random(self.rnd.random())

            def caller() -> None:
                try:
                    while not stop.is_set():
                        self.generate(side)
                        self.ops["generate"] += 1
                except BaseException as exc:  # reported by the walking thread
                    errors.append(exc)

            other = threading.Thread(target=caller)
            other.start()
        try:
            for _ in range(num_ops):
                x = self.rnd.random()
                if x < 0.3 and len(self.active) < self.max_live:
                    op = "add"
                    self.add()
                elif x < 0.85:
                    op = "step"
                    if self.engine.has_unfinished_requests():
                        self.step()
                elif x < 0.97:
                    op = "abort"
                    self.abort()
                else:
                    op = "generate"
                    if self.threads == 1:
                        self.generate(self.rnd)
                self.ops[op] += 1
                self.poll()
                self.engine.check_invariants()
                assert not errors, errors[0]
        finally:
            stop.set()
            if other is not None:
                other.join()
        assert not errors, errors[0]
        steps = 0
        while self.engine.has_unfinished_requests():
            self.engine.step()
            steps += 1
            assert steps < 10_000, "no progress"
        self.poll()
        self.engine.check_invariants()
        self.check_outputs()
        engine = self.engine
        assert engine.kv.get_num_free_blocks() == engine.kv.num_blocks
        assert not engine.runner.input_batch.req_to_row
        return {
            "ops": dict(self.ops),
            "requests": sum(len(t.outputs) for t in self.tracked),
            "preemptions": engine.scheduler.num_preemptions,
            "steps": engine.num_steps,
            "options": self.options,
        }

    def check_outputs(self) -> None:
        for t in self.tracked:
            want, reason = self.expected(t)
            for rid, outs in t.outputs.items():
                assert outs and outs[-1].finished, f"{rid}: no final output"
                assert sum(o.finished for o in outs) == 1, f"{rid}: more than one final output"
                final = outs[-1]
                got = final.output_token_ids
                assert [x for o in outs for x in o.new_token_ids] == got, f"{rid}: stream != final"
                if final.finish_reason == "abort":
                    assert t.aborted and got == want[: len(got)], rid
                    continue
                assert (got, final.finish_reason) == (want, reason), (rid, t)
                if reason == "error":
                    assert isinstance(final.error, Raise), rid


def _walk(tiny_model, seed: int, num_ops: int, threads: int) -> dict:
    model, twin = tiny_model("llama"), tiny_model("llama")
    walk = Walk(model, twin, seed, threads)
    try:
        return walk.run(num_ops)
    finally:
        hf_paged.unpatch(model)


# Seeds picked for their engine options: synchronous with prefix caching (4), asynchronous FCFS
# with 12 blocks (7), asynchronous with priorities and a second thread calling generate (6).
# 3 x 800 = 2,400 operations, ~10 s on 2 CPU cores.
@pytest.mark.parametrize("seed, threads", [(4, 1), (7, 1), (6, 2)])
def test_random_walk_keeps_invariants_and_matches_single_request_runs(
    tiny_model, one_torch_thread, seed, threads
):
    stats = _walk(tiny_model, seed, 800, threads)
    assert stats["ops"]["add"] > 100 and stats["ops"]["abort"] > 10
    assert stats["preemptions"] > 0  # the cache is small enough to force preemption


if __name__ == "__main__":
    import argparse
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import build_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=50_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, choices=[1, 2])
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the one_torch_thread fixture: tiny ops, no intra-op threads
    t0 = time.perf_counter()
    stats = _walk(build_model, args.seed, args.ops, args.threads)
    print(f"seed {args.seed}, {args.threads} thread(s), {time.perf_counter() - t0:.0f} s: {stats}")
