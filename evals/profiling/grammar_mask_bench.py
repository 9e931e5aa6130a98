"""Structured output's host cost per decode step, by part: accept, fill, copy, apply.

    python evals/profiling/grammar_mask_bench.py [--rows 256] [--vocab 32000] [--steps 60]
        [--threads 1,2,auto] [--device cpu|cuda]

The rows all follow evals/structured_bench.py's LONG_SCHEMA over its in-memory byte-level BPE of
--vocab ids (the H200 benchmark's set-up). Each step is what the sampler hook does for every
constrained row: accept the row's last token (a Python loop of GrammarMatcher.accept_token,
against xgrammar's one batched call), fill the rows' bitmask (BatchGrammarMatcher, per
--threads), copy it to the logits' device (--device cuda only) and mask the logits
(apply_token_bitmask_inplace). The next tokens are the argmax of random logits under the mask, so
the matchers walk through varied valid JSON. Also measured: whether the batched fill releases the
GIL (a fill on another thread while this one runs Python): what lets it overlap the step loop's
own host work (hf_paged/structured_output/grammar_step.py).
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


def run(args) -> dict[str, list[float]]:
    xgr = import_xgrammar()
    dev = torch.device(args.device)
    loop_m = make_matchers(args.rows, args.vocab)  # accepted one at a time, in Python
    batch_m = [m.fork() for m in loop_m] if hasattr(loop_m[0], "fork") else None
    if batch_m is None:
        batch_m = make_matchers(args.rows, args.vocab)
    width = (args.vocab + 31) // 32
    pin = dev.type == "cuda"
    host = torch.empty((args.rows, width), dtype=torch.int32, pin_memory=pin)
    fillers = {t: xgr.BatchGrammarMatcher(max_threads=_threads(t)) for t in args.threads}
    times: dict[str, list[float]] = {"accept: Python loop": [], "accept: batch_accept_token": []}
    for t in args.threads:
        times[f"fill: batch, max_threads={t}"] = []
    times["fill: one matcher at a time"] = []
    times["copy host -> device"] = []
    times["apply_token_bitmask_inplace"] = []
    gen = torch.Generator().manual_seed(0)
    one = torch.empty_like(host)
    tokens = None
    for step in range(args.steps + args.warmup):
        record = step >= args.warmup
        if tokens is not None:
            t0 = time.perf_counter()
            for m, t in zip(loop_m, tokens):
                if not m.accept_token(t):
                    raise RuntimeError(f"token {t} refused: the walk left the grammar")
            t1 = time.perf_counter()
            ok = xgr.BatchGrammarMatcher.batch_accept_token(batch_m, tokens)
            t2 = time.perf_counter()
            if not all(ok):
                raise RuntimeError("batch_accept_token refused a token the loop accepted")
            if record:
                times["accept: Python loop"].append(t1 - t0)
                times["accept: batch_accept_token"].append(t2 - t1)
        # A matcher's first fill after an accept does the work (later fills of the same state
        # are cheaper): the ways take turns going first, and only the first is timed.
        ways = list(fillers) + ["loop"]
        first = ways[step % len(ways)]
        for way in ways[step % len(ways) :] + ways[: step % len(ways)]:
            t0 = time.perf_counter()
            if way == "loop":
                for i, m in enumerate(loop_m):
                    m.fill_next_token_bitmask(one, i)
            else:
                fillers[way].batch_fill_next_token_bitmask(batch_m, host)
            if record and way == first:
                key = (
                    "fill: one matcher at a time"
                    if way == "loop"
                    else f"fill: batch, max_threads={way}"
                )
                times[key].append(time.perf_counter() - t0)
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
    return {k: v for k, v in times.items() if v}, batch_m, fillers


def gil_check(matchers, filler, host, busy_s: float) -> tuple[float, float, float]:
    """(fill alone, Python work alone, both at once on two threads) in seconds: both at once
    close to the larger of the two means the fill ran without the GIL."""

    def python_work():
        end = time.perf_counter() + busy_s
        n = 0
        while time.perf_counter() < end:
            n += 1

    t0 = time.perf_counter()
    filler.batch_fill_next_token_bitmask(matchers, host)
    fill = time.perf_counter() - t0
    t0 = time.perf_counter()
    python_work()
    work = time.perf_counter() - t0
    th = threading.Thread(target=filler.batch_fill_next_token_bitmask, args=(matchers, host))
    t0 = time.perf_counter()
    th.start()
    python_work()
    th.join()
    both = time.perf_counter() - t0
    return fill, work, both


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
    fill, work, both = gil_check(matchers, filler, host, busy_s=0.02)
    print(
        f"GIL: fill (max_threads={args.threads[0]}) {1e3 * fill:.2f} ms, Python work "
        f"{1e3 * work:.2f} ms, both on two threads {1e3 * both:.2f} ms "
        f"({'overlapped' if both < 0.8 * (fill + work) else 'serialised'})"
    )


if __name__ == "__main__":
    main()
