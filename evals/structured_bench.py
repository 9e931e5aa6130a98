"""`run.py structured-bench`: W1 with 0% / 50% / 100% of its requests constrained to a JSON
schema, one engine, in one invocation (GPU; runs on the CPU with a small --limit too).

W1 as in the throughput harness: random prompts of 64-512 tokens, 256 greedy output tokens
each, all submitted at once. Unconstrained requests ignore EOS as W1 does; constrained ones
follow LONG_SCHEMA (an object with at least 64 records), which cannot be complete within 256
tokens, so they also run to 256 tokens and every fraction produces the same token count
(checked). Random-weight shapes have no tokenizer: one is built in memory at the model's exact
vocabulary size (a byte-level BPE whose merges spell letters, digits and JSON punctuation), so
the grammar's masks are over a realistic vocabulary. Prints output tok/s per fraction and
round, its ratio to 0% in the same round, and the schema's compile time.
"""

from __future__ import annotations

import time

import torch

from .errors import EvalError

LONG_SCHEMA = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array",
            "minItems": 64,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0},
                    "name": {"type": "string", "maxLength": 12},
                    "kind": {"enum": ["alpha", "beta", "gamma"]},
                    "score": {"type": "number"},
                },
                "required": ["id", "name", "kind", "score"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["records"],
    "additionalProperties": False,
}


def add_parser(sub, common) -> None:
    p = sub.add_parser(
        "structured-bench", help="W1 with 0/50/100%% of requests constrained to a JSON schema"
    )
    common(p, "auto", "auto")
    p.add_argument("--fractions", default="0,0.5,1", help="constrained fractions, comma list")
    p.add_argument("--rounds", type=int, default=2, help="rounds over the fractions (noise)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.set_defaults(run=cmd_structured_bench)


def bench_tokenizer(vocab_size: int):
    """A byte-level BPE over exactly vocab_size ids; the last one is the end-of-sequence token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    common = list("abcdefghijklmnopqrstuvwxyz0123456789") + list('Ġ":,{}[].-_')
    merges, frontier = [], common
    while len(vocab) < vocab_size - 1:
        grown = []
        for a in frontier:
            for b in common:
                if len(vocab) >= vocab_size - 1:
                    break
                if a + b not in vocab:
                    vocab[a + b] = len(vocab)
                    merges.append((a, b))
                    grown.append(a + b)
        frontier = grown
    vocab["<|end|>"] = vocab_size - 1
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|end|>")


def cmd_structured_bench(args, save) -> int:
    from hf_paged import Engine, SamplingParams, StructuredOutputs
    from hf_paged.gc_freeze import frozen_heap

    from .models import describe, load_model
    from .workloads import synthetic

    loaded = load_model(args.model, args.dtype, args.device)
    vocab = loaded.model.config.get_text_config().vocab_size
    tok = loaded.tokenizer if loaded.tokenizer is not None else bench_tokenizer(vocab)
    print(describe(loaded))
    fractions = [float(f) for f in args.fractions.split(",")]
    wl = synthetic(vocab, seed=args.seed).limited(args.limit)
    n = len(wl.requests)
    engine = Engine(loaded.model, tok, max_num_seqs=max(n, 1))
    constraint = StructuredOutputs(json=LONG_SCHEMA)
    eos = [tok.eos_token_id]
    t0 = time.perf_counter()
    handle = engine.inputs.make_requests([1, 2, 3], SamplingParams(structured=constraint))[0]
    handle = handle.grammar
    handle.future.result()
    first_ms = 1e3 * (time.perf_counter() - t0)
    print(f"LONG_SCHEMA: tokenizer info + parse + compile {first_ms:.1f} ms "
          f"(compile on the worker {1e3 * handle.seconds:.1f} ms)")  # fmt: skip
    plain = SamplingParams(max_tokens=args.max_new_tokens, temperature=0.0, ignore_eos=True)
    guided = SamplingParams(
        max_tokens=args.max_new_tokens, temperature=0.0, eos_token_id=eos, structured=constraint
    )
    warm = [r.prompt_token_ids for r in wl.requests[:8]]
    engine.generate(warm, [(plain, guided)[i % 2] for i in range(len(warm))])  # untimed
    rows, results = [], {}
    for rnd in range(args.rounds):
        base = None
        for f in fractions:
            # every k-th request constrained, spread over the batch
            flags = [int((i + 1) * f) > int(i * f) for i in range(n)]
            params = [guided if g else plain for g in flags]
            engine.reset_prefix_cache()
            _sync(loaded.model)
            t = time.perf_counter()
            with frozen_heap():
                outs = engine.generate([r.prompt_token_ids for r in wl.requests], params)
            _sync(loaded.model)
            wall = time.perf_counter() - t
            tokens = sum(len(o.output_token_ids) for o in outs)
            if tokens != n * args.max_new_tokens:
                raise EvalError(f"structured-bench: {tokens} tokens, expected every request full")
            rate = tokens / wall
            base = rate if f == 0 or base is None else base
            results.setdefault(str(f), []).append(rate)
            rows.append(
                f"| {rnd} | {f:.0%} | {sum(flags)} | {tokens} | {wall:.2f} | {rate:,.0f} | "
                f"{rate / base:.3f} |"
            )
            engine.check_invariants()
    head = [
        "| round | constrained | requests | tokens | s | output tok/s | vs 0% |",
        "|" + "---|" * 7,
    ]
    table = "\n".join(head + rows)
    print(table)
    payload = {"model": loaded.name, "requests": n, "rates": results,
               "compile_ms": 1e3 * handle.seconds}  # fmt: skip
    path = save(args.out, f"structured-bench-{time.strftime('%Y%m%d-%H%M%S')}", payload, table)
    print(f"\nresults: {path}")
    engine.shutdown()
    return 0


def _sync(model) -> None:
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
