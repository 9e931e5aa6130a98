"""Concurrent model.generate calls from many threads on one patched model, against one thread.

    python evals/profiling/concurrent_generate.py --threads 64 --calls 4 --new-tokens 64

Each thread makes --calls generate calls (one prompt each, random tokens, greedy, EOS ignored).
First every call runs in one thread, one after the other (the reference outputs and the
single-thread rate); then the same calls run from --threads threads at once, sharing the
engine's continuous batch. Prints the model shape, workload, device, both rates, their ratio,
whether every concurrent output equals its single-thread reference, what the engine still holds
afterwards, and the bandwidth bound of a decode step at the concurrent batch size.
"""

from __future__ import annotations

import argparse
import threading
import time

import bench_setup
import torch


def build(shape: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = bench_setup.build_model(shape, dtype, device)
    with torch.no_grad():  # well separated greedy choices: random logits are near-uniform
        model.get_output_embeddings().weight.mul_(8.0)
    model.generation_config.eos_token_id = None  # every call makes exactly --new-tokens
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="tinyllama-1.1b", choices=bench_setup.SHAPES)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=64)
    ap.add_argument("--calls", type=int, default=4, help="generate calls per thread")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    bench_setup.add_engine_options(ap)
    args = ap.parse_args()

    import hf_paged

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    model = build(args.shape, dtype, device)
    vocab = model.config.vocab_size
    t0 = time.perf_counter()
    hf_paged.patch(model, **bench_setup.engine_options(args))
    startup = time.perf_counter() - t0
    engine = hf_paged.get_engine(model)
    g = torch.Generator().manual_seed(1)
    n = args.threads * args.calls
    prompts = [torch.randint(3, vocab, (1, args.prompt_len), generator=g) for _ in range(n)]

    def call(i: int) -> torch.Tensor:
        ids = prompts[i].to(device)
        out = model.generate(input_ids=ids, max_new_tokens=args.new_tokens, do_sample=False)
        return out[0, args.prompt_len :].cpu()

    for i in range(min(8, n)):  # warm-up: first-use compiles out of both clocks
        call(i)
    t0 = time.perf_counter()
    reference = [call(i) for i in range(n)]
    single_s = time.perf_counter() - t0

    results: list[torch.Tensor | None] = [None] * n
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for c in range(args.calls):
                i = t * args.calls + c
                results[i] = call(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(args.threads)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    concurrent_s = time.perf_counter() - t0

    tokens = n * args.new_tokens
    single, concurrent = tokens / single_s, tokens / concurrent_s
    same = sum(r is not None and torch.equal(r, ref) for r, ref in zip(results, reference))
    engine.check_invariants()
    held_rows = len(engine.runner.input_batch.req_to_row)
    free = engine.kv.get_num_free_blocks() == engine.kv.num_blocks
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    batch = min(args.threads, engine.config.max_num_seqs)
    bound = batch * bench_setup.PEAK_BW / weight_bytes  # weights once per step; KV ignored
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"model: {args.shape} shape, {args.dtype}, random weights, {weight_bytes / 1e9:.2f} GB")
    print(
        f"workload: {args.threads} threads x {args.calls} generate calls, 1 prompt of "
        f"{args.prompt_len} random tokens each, {args.new_tokens} greedy tokens, EOS ignored"
    )
    print(f"device: {name}; patch() start-up {startup:.1f} s")
    print("| run | output tok/s | wall s |\n| --- | --- | --- |")
    print(f"| one thread, calls one after another (baseline) | {single:,.0f} | {single_s:.2f} |")
    print(f"| {args.threads} threads at once | {concurrent:,.0f} | {concurrent_s:.2f} |")
    print(f"ratio concurrent / one thread: {concurrent / single:.1f}x")
    print(
        f"bound at batch {batch} (weights read once a step at 4.2 TB/s, KV ignored): "
        f"{bound:,.0f} tok/s; concurrent at {concurrent / bound:.1%} of it"
    )
    print(f"outputs equal to the one-thread reference: {same}/{n}; errors: {len(errors)}")
    print(f"after: rows held {held_rows}, all KV blocks free: {free}")
    if errors:
        raise errors[0]


if __name__ == "__main__":
    main()
