"""`run.py spec`: speculative decoding against the same engine without it, in one invocation.

Two workloads:
- `--draft SHAPE` (GPU): a target and a draft model with random weights at real shapes. Random
  weights never agree, so the acceptance is controlled (ControlledAcceptance): the draft runs
  its real forwards, the target verifies as usual, and each proposal is then kept with
  probability alpha; the measured acceptance is printed next to alpha. Per batch size: the
  engine without speculation (the same Engine with k forced to 0: its async scheduling and
  graphs as usual), then with speculation at each alpha, k chosen by the
  engine; and transformers' assisted generate (assistant_model=) and plain generate at batch 1.
- `--prompt-lookup K` (CPU or GPU, real weights): SmolLM2-135M-Instruct repeats passages of
  Shakespeare given in its prompt (an input-grounded task, as code editing is), with and
  without prompt lookup; real acceptance, speedup, and a check that the tokens are identical.

Every request is greedy with EOS ignored; throughput is output tokens / wall time, all requests
submitted at once. The bound is bytes / 4.2 TB/s per decode step at batch 1 (the target's
weights), printed as tok/s.
"""

from __future__ import annotations

import random
import sys
import time

import torch

from .errors import EvalError
from .roofline import detect_hardware

PASSAGE_WORDS = 70


def add_parser(sub, common) -> None:
    p = sub.add_parser("spec", help="speculative decoding vs the same engine without it")
    common(p, "auto", "auto")
    p.add_argument("--draft", default=None, help="draft model shape (e.g. tinyllama-1.1b)")
    p.add_argument("--prompt-lookup", type=int, default=None, help="prompt lookup: tokens")
    p.add_argument("--batch-sizes", default="1,8,32,128", help="comma list")
    p.add_argument("--alphas", default="0.5,0.7,0.9", help="controlled acceptance, comma list")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=128, help="draft workload prompt tokens")
    p.add_argument("--num-speculative-tokens", type=int, default=5)
    p.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    p.add_argument(
        "--small-batch-rows",
        type=int,
        default=None,
        help="engine option: steps of up to this many tokens (1-8) run the fused small-batch "
        "forward; a batch-1 verify step has k + 1 tokens (default: the engine's, 2)",
    )
    p.set_defaults(run=cmd_spec)


def cmd_spec(args, save) -> int:
    if (args.draft is None) == (args.prompt_lookup is None):
        raise EvalError("spec: give --draft SHAPE or --prompt-lookup K")
    table, payload = _run_draft(args) if args.draft else _run_prompt_lookup(args)
    print(table)
    path = save(args.out, f"spec-{time.strftime('%Y%m%d-%H%M%S')}", payload, table)
    print(f"\nresults: {path}")
    return 0


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_run(engine, prompts, params, ids):
    """All prompts at once; returns (outputs by id, seconds, spec stats delta)."""
    before = engine.stats()
    _sync(engine.runner.device)
    t0 = time.perf_counter()
    for rid, prompt in zip(ids, prompts):
        engine.add_request(prompt, params, request_id=rid)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.output_token_ids
    _sync(engine.runner.device)
    seconds = time.perf_counter() - t0
    after = engine.stats()
    delta = {k: after[k] - before[k] for k in ("spec_num_proposed", "spec_num_accepted")}
    delta["verify_steps"] = after["spec_num_verify_steps"] - before["spec_num_verify_steps"]
    return outs, seconds, delta


class ControlledAcceptance:
    """The verify step keeps each proposal with probability alpha (until the first one it
    does not keep), whatever the target's logits say, then adds the target's token: every
    forward, draft step, rollback and KV write is what a real acceptance of alpha costs, but
    the tokens are not the target's greedy ones. Benchmark-only. (Replacing proposals by the
    target's precomputed greedy continuation does not work with random bf16 weights: near-tied
    logits make the greedy path differ between batch shapes and kernels, and the measured
    acceptance came out at 0.00-0.60 for alpha 0.8.)"""

    def __init__(self, alpha: float, seed: int, proposer) -> None:
        from hf_paged.worker import verify_step

        self.module, self.real = verify_step, verify_step.verify
        self.alpha, self.rng = alpha, random.Random(seed)
        # where the time goes: the draft's share of the run (its forwards end in a host read)
        self.proposer, self.real_propose = proposer, proposer.propose
        self.draft_seconds = 0.0

    def _timed_propose(self, *args):
        t0 = time.perf_counter()
        try:
            return self.real_propose(*args)
        finally:
            self.draft_seconds += time.perf_counter() - t0

    def __enter__(self):
        self.proposer.propose = self._timed_propose

        def verify(logits, rows, proposals):
            out = []
            for real, proposed in zip(self.real(logits, rows, proposals), proposals):
                n = 0
                while n < len(proposed) and self.rng.random() < self.alpha:
                    n += 1
                out.append(list(proposed[:n]) + [real[-1]])
            return out

        self.module.verify = verify
        return self

    def __exit__(self, *exc) -> None:
        self.module.verify = self.real
        self.proposer.propose = self.real_propose


def _run_draft(args):
    import hf_paged
    from hf_paged import SamplingParams

    from .models import describe, load_model

    target = load_model(args.model, args.dtype, args.device)
    draft = load_model(args.draft, args.dtype, args.device)
    device = next(target.model.parameters()).device
    hw = detect_hardware(device)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    alphas = [float(a) for a in args.alphas.split(",")]
    vocab = min(target.model.config.vocab_size, draft.model.config.vocab_size)
    rng = random.Random(args.seed)
    max_b = max(sizes)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(max_b)]
    params = SamplingParams(max_tokens=args.max_new_tokens, temperature=0.0, ignore_eos=True)
    total = args.prompt_len + args.max_new_tokens + args.num_speculative_tokens
    blocks = max_b * (-(-total // 16) + 1) + 64
    # a verify step keeps up to max_num_seqs logits rows and still replays a graph (the
    # policy proposes no more than that): room for k + 1 rows a request at the small batches
    max_seqs = max(max_b, 128)
    t0 = time.perf_counter()
    engine = hf_paged.Engine(
        target.model,
        draft_model=draft.model,
        num_speculative_tokens=args.num_speculative_tokens,
        **({} if args.small_batch_rows is None else {"small_batch_rows": args.small_batch_rows}),
        max_num_seqs=max_seqs,
        num_blocks=blocks,
        max_model_len=total + 16,
    )
    startup = time.perf_counter() - t0
    policy = engine.runner.spec.policy
    k_max = policy.max_k
    weight_bytes = sum(p.numel() * p.element_size() for p in target.model.parameters())
    bound_b1 = hw.bandwidth / weight_bytes if hw.known else None
    engine.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    rows = []
    for b in sizes:
        ids = [f"b{b}-{i}" for i in range(b)]
        policy.max_k = 0  # speculation off: the engine as it runs without a draft
        _timed_run(engine, prompts[:b], params, [f"w{i}" for i in ids])  # warm-up
        engine.reset_prefix_cache()
        _, secs, _ = _timed_run(engine, prompts[:b], params, ids)
        base = b * args.max_new_tokens / secs
        row = {"batch": b, "off_tok_s": base, "runs": []}
        policy.max_k = k_max
        # warm-up of the speculative path at this batch size (graphs of verify steps, the
        # draft's catch-up shapes), outside the clock
        with ControlledAcceptance(alphas[-1], args.seed, engine.runner.spec.draft):
            _timed_run(engine, prompts[:b], params, [f"ws{i}" for i in ids])
        for alpha in alphas:
            # each alpha measured afresh: the policy's rates and acceptance start over
            policy.buckets.clear()
            policy.acceptance = 0.7
            engine.reset_prefix_cache()
            control = ControlledAcceptance(alpha, args.seed, engine.runner.spec.draft)
            with control:
                _, secs, d = _timed_run(engine, prompts[:b], params, [f"a{alpha}-{r}" for r in ids])
            tok_s = b * args.max_new_tokens / secs
            acc = d["spec_num_accepted"] / d["spec_num_proposed"] if d["spec_num_proposed"] else 0
            row["runs"].append(
                {"alpha": alpha, "tok_s": tok_s, "ratio": tok_s / base, "acceptance": acc,
                 "proposed": d["spec_num_proposed"], "verify_steps": d["verify_steps"],
                 "draft_share": control.draft_seconds / secs}
            )  # fmt: skip
        rows.append(row)
        print(_draft_table(rows[-1:], alphas), flush=True)
    engine.shutdown()
    hf = {} if args.no_hf else _hf_batch1(target.model, draft.model, prompts[0], args)
    head = [
        "## speculative decoding: draft model, controlled acceptance",
        "",
        f"- target: {describe(target)}",
        f"- draft: {describe(draft)}",
        f"- hardware: {hw.name}; start-up {startup:.1f} s (target + draft)",
        f"- workload: B requests of {args.prompt_len} random tokens, {args.max_new_tokens} new "
        f"tokens each, greedy, EOS ignored; k chosen by the engine (max {k_max})",
    ]
    if bound_b1:
        head.append(f"- bound at batch 1 (target weights / 4.2 TB/s): {bound_b1:,.0f} tok/s")
    if hf:

        def fmt(v):
            return f"{v:,.1f} tok/s" if isinstance(v, float) else v

        head.append(
            f"- transformers batch 1: generate {fmt(hf['generate'])}, assisted generate "
            f"(assistant_model=draft, random weights: ~no acceptance) {fmt(hf['assisted'])}"
        )
    table = "\n".join(head) + "\n\n" + _draft_table(rows, alphas)
    payload = {"argv": sys.argv, "startup_s": startup, "rows": rows, "hf_batch1": hf}
    return table, payload


def _draft_table(rows, alphas) -> str:
    cols = ["batch", "no spec tok/s"]
    for a in alphas:
        cols += [f"a={a} tok/s", "x", "acc", "k/step", "draft %"]
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for r in rows:
        cells = [str(r["batch"]), f"{r['off_tok_s']:,.0f}"]
        for run in r["runs"]:
            k = run["proposed"] / max(run["verify_steps"], 1) / max(r["batch"], 1)
            cells += [f"{run['tok_s']:,.0f}", f"{run['ratio']:.2f}", f"{run['acceptance']:.2f}"]
            cells += [f"{k:.1f}", f"{100 * run['draft_share']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _hf_batch1(model, draft, prompt, args) -> dict:
    """transformers' own generate, plain and assisted, at batch 1 (the engine is shut down)."""
    ids = torch.tensor([prompt], device=next(model.parameters()).device)
    out = {}
    for name, extra in (("generate", {}), ("assisted", {"assistant_model": draft})):
        kwargs = dict(max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens)
        try:
            model.generate(ids, do_sample=False, max_new_tokens=8, **extra)  # warm-up
        except ValueError as exc:  # e.g. a draft with another vocabulary size
            out[name] = f"refused: {str(exc).splitlines()[0][:120]}"
            continue
        _sync(ids.device)
        t0 = time.perf_counter()
        model.generate(ids, do_sample=False, **kwargs, **extra)
        _sync(ids.device)
        out[name] = args.max_new_tokens / (time.perf_counter() - t0)
    return out


def _passages(n: int, seed: int) -> list[str]:
    from .sources import shakespeare_jsonl

    rng = random.Random(seed)
    import json

    texts = [json.loads(line)["text"] for line in shakespeare_jsonl().open()][:20]
    out = []
    while len(out) < n:
        words = rng.choice(texts).split()
        start = rng.randrange(2000, max(2001, len(words) - PASSAGE_WORDS))
        out.append(" ".join(words[start : start + PASSAGE_WORDS]))
    return out


def _run_prompt_lookup(args):
    import hf_paged
    from hf_paged import SamplingParams

    from .models import describe, load_model

    loaded = load_model(args.model if args.model != "auto" else "smollm2", args.dtype, args.device)
    tok = loaded.tokenizer
    if tok is None:
        raise EvalError("spec --prompt-lookup needs a model with a tokenizer (real weights)")
    device = next(loaded.model.parameters()).device
    if device.type == "cpu":
        torch.set_num_threads(1)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    passages = _passages(max(sizes), args.seed)
    prompts = []
    for p in passages:
        chat = [{"role": "user", "content": f"Repeat this passage word for word:\n\n{p}"}]
        ids = tok.apply_chat_template(chat, add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    engine = hf_paged.Engine(loaded.model, tok, max_num_seqs=max(sizes))
    rows = []
    for b in sizes:
        row = {"batch": b}
        for k in (0, args.prompt_lookup):
            params = SamplingParams(
                max_tokens=args.max_new_tokens, temperature=0.0, ignore_eos=True,
                prompt_lookup_num_tokens=k,
            )  # fmt: skip
            ids = [f"k{k}-b{b}-{i}" for i in range(b)]
            _timed_run(engine, prompts[:b], params, [f"w{i}" for i in ids])  # warm-up
            engine.reset_prefix_cache()
            outs, secs, d = _timed_run(engine, prompts[:b], params, ids)
            row[k] = {
                "tok_s": b * args.max_new_tokens / secs,
                "acceptance": d["spec_num_accepted"] / max(d["spec_num_proposed"], 1),
                "tokens": [outs[i] for i in ids],
            }
        row["same_tokens"] = row[0]["tokens"] == row[args.prompt_lookup]["tokens"]
        row["ratio"] = row[args.prompt_lookup]["tok_s"] / row[0]["tok_s"]
        rows.append(row)
    engine.shutdown()
    k = args.prompt_lookup
    lines = [
        "## speculative decoding: prompt lookup on real text",
        "",
        f"- model: {describe(loaded)}; hardware: {detect_hardware(device).name}",
        f"- task: repeat a {PASSAGE_WORDS}-word Shakespeare passage given in the prompt "
        f"(chat template), {args.max_new_tokens} new tokens, greedy, EOS ignored; "
        f"prompt_lookup_num_tokens={k}, max_matching_ngram_size=2",
        "",
        "| batch | no lookup tok/s | lookup tok/s | x | acceptance | same tokens |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r[0]['tok_s']:,.1f} | {r[k]['tok_s']:,.1f} | {r['ratio']:.2f} | "
            f"{r[k]['acceptance']:.2f} | {r['same_tokens']} |"
        )
    for r in rows:
        for n in (0, k):
            r[n].pop("tokens")
    return "\n".join(lines), {"argv": sys.argv, "rows": rows}
