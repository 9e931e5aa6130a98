"""Structured output's host cost per decode step, by part: accept, fill, copy, apply.

    python evals/profiling/grammar_mask_bench.py [--rows 256] [--vocab 32000] [--steps 60]
        [--threads 1,2,auto] [--device cpu|cuda]

The rows all follow evals/structured_bench.py's LONG_SCHEMA over its in-memory byte-level BPE of
--vocab ids (the H200 benchmark's set-up). Each step is what the sampler hook does for every
constrained row: accept the row's last token (a Python loop of GrammarMatcher.accept_token,
against xgrammar's one batched call), fill the rows' bitmask (BatchGrammarMatcher, per
--threads), copy it to the logits' device (--device cuda only) and mask the logits
(apply_token_bitmask_inplace). The next tokens are the argmax of random logits under the mask, so
the matchers walk through varied valid JSON. Also measured: the batched calls on another thread
while this one runs Python. xgrammar releases the GIL inside them, but each hand-over of the GIL
back to the other thread waits for the running one's switch interval (5 ms), which is why the
engine's helper thread calls xgrammar's FFI functions on ready-made handles (BatchCalls, also
timed here) rather than the public batch calls.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import bench_setup  # noqa: F401  (loads the evals package)
import torch
from hf_paged_evals.structured_bench import LONG_SCHEMA, bench_tokenizer

from hf_paged import StructuredOutputs
from hf_paged.structured_output import batch_calls
from hf_paged.structured_output.batch_calls import BatchCalls
from hf_paged.structured_output.compiler import GrammarService
from hf_paged.structured_output.constraint import import_xgrammar


def _ms(samples: list[float]) -> str:
    return f"{1e3 * statistics.median(samples):7.3f} ms"


def make_matchers(rows: int, vocab: int):
    tok = bench_tokenizer(vocab)
    service = GrammarService(tok, vocab)
    t0 = time.perf_counter()
    compiled = service.submit(StructuredOutputs(json=LONG_SCHEMA)).compiled
    print(f"LONG_SCHEMA compile {1e3 * (time.perf_counter() - t0):.1f} ms, vocab {vocab}")
    service.shutdown()
    xgr = import_xgrammar()
    eos = [tok.eos_token_id]
    return [xgr.GrammarMatcher(compiled, override_stop_tokens=eos) for _ in range(rows)]


def run(args):
    xgr = import_xgrammar()
    dev = torch.device(args.device)
    matchers = make_matchers(args.rows, args.vocab)
    width = (args.vocab + 31) // 32
    pin = dev.type == "cuda"
    host = torch.empty((args.rows, width), dtype=torch.int32, pin_memory=pin)
    one = torch.empty_like(host)
    fillers = {t: xgr.BatchGrammarMatcher(max_threads=_threads(t)) for t in args.threads}
    accepts = ("Python loop", "batch_accept_token", "BatchCalls (FFI handles)")
    times: dict[str, list[float]] = {f"accept: {way}": [] for way in accepts}
    engine_calls = BatchCalls(1)
    handles = [batch_calls.handle(m) for m in matchers]
    for t in args.threads:
        times[f"fill: batch, max_threads={t}"] = []
    times["fill: one matcher at a time"] = []
    times["copy host -> device"] = []
    times["apply_token_bitmask_inplace"] = []
    gen = torch.Generator().manual_seed(0)
    tokens = None
    for step in range(args.steps + args.warmup):
        record = step >= args.warmup
        if tokens is not None:  # the three ways take turns, on the same matchers
            t0 = time.perf_counter()
            way = accepts[step % 3]
            if way == "batch_accept_token":
                ok = xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)
            elif way == "Python loop":
                ok = [m.accept_token(t) for m, t in zip(matchers, tokens)]
            else:  # the engine's: the result read with one call (every token accepted here)
                result = engine_calls.accept(handles, tokens)
                ok = [BatchCalls.all_accepted(result)]
            if record:
                times[f"accept: {way}"].append(time.perf_counter() - t0)
            if not all(ok):
                raise RuntimeError("a token was refused: the walk left the grammar")
        # A matcher's first fill after an accept does the work (a second fill of the same state
        # is cheaper): the ways take turns going first, and only the first is timed.
        ways = list(fillers) + ["loop"]
        k = step % len(ways)
        for n, way in enumerate(ways[k:] + ways[:k]):
            t0 = time.perf_counter()
            if way == "loop":
                for i, m in enumerate(matchers):
                    m.fill_next_token_bitmask(one, i)
            else:
                fillers[way].batch_fill_next_token_bitmask(matchers, host)
            if record and n == 0:
                key = "one matcher at a time" if way == "loop" else f"batch, max_threads={way}"
                times[f"fill: {key}"].append(time.perf_counter() - t0)
        if not torch.equal(one, host):
            raise RuntimeError("the loop's and the batch's bitmasks differ")
        logits = torch.randn(args.rows, args.vocab, generator=gen).to(dev)
        _sync(dev)
        t0 = time.perf_counter()
        mask = host.to(dev, non_blocking=True) if dev.type == "cuda" else host
        _sync(dev)
        t1 = time.perf_counter()
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=args.vocab)
        _sync(dev)
        t2 = time.perf_counter()
        if record:
            if dev.type == "cuda":
                times["copy host -> device"].append(t1 - t0)
            times["apply_token_bitmask_inplace"].append(t2 - t1)
        tokens = logits.argmax(dim=-1).tolist()
    return {k: v for k, v in times.items() if v}, matchers, fillers


def handover(matchers, filler, host, vocab: int, busy_s: float = 0.005) -> dict[str, tuple]:
    """Each batched call on a second thread: (ms until it is done with this thread idle, with
    this thread running busy_s of Python). The second is what a helper thread would cost."""
    xgr = import_xgrammar()
    filler.batch_fill_next_token_bitmask(matchers, host)
    logits = torch.randn(len(matchers), vocab)
    xgr.apply_token_bitmask_inplace(logits, host, vocab_size=vocab)
    tokens = logits.argmax(dim=-1).tolist()
    engine_calls = BatchCalls(1)
    # the engine's helper gets its handles ready-made (one fresh set per call: idle, busy)
    spare = [[batch_calls.handle(m.fork()) for m in matchers] for _ in range(2)]

    def python_work(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    def timed_on_thread(fn, busy: float) -> float:
        done = []
        th = threading.Thread(target=lambda: (fn(), done.append(time.perf_counter())))
        t0 = time.perf_counter()
        th.start()
        python_work(busy)
        th.join()
        return 1e3 * (done[0] - t0)

    calls = {
        "batch_accept_token": lambda: xgr.BatchGrammarMatcher.batch_accept_token(
            [m.fork() for m in matchers], tokens
        ),
        "BatchCalls accept": lambda: BatchCalls.all_accepted(
            engine_calls.accept(spare.pop(), tokens)
        ),
        "batch fill": lambda: filler.batch_fill_next_token_bitmask(matchers, host),
    }
    return {
        name: (timed_on_thread(fn, 0.0), timed_on_thread(fn, busy_s)) for name, fn in calls.items()
    }


def _threads(text: str):
    return "auto" if text == "auto" else int(text)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", default="1,2,auto", help="BatchGrammarMatcher max_threads list")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    args.threads = args.threads.split(",")
    times, matchers, fillers = run(args)
    print(f"{args.rows} rows, {args.steps} steps, medians per step:")
    for name, samples in times.items():
        print(f"  {name:40s} {_ms(samples)}  (max {1e3 * max(samples):.3f} ms)")
    host = torch.empty((args.rows, (args.vocab + 31) // 32), dtype=torch.int32)
    filler = fillers[args.threads[0]]
    print("on a second thread, done after:")
    for name, (idle, busy) in handover(matchers, filler, host, args.vocab).items():
        print(f"  {name:20s} {idle:7.2f} ms, {busy:7.2f} ms beside 5 ms of Python here")


if __name__ == "__main__":
    main()
