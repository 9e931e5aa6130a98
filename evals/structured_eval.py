"""`run.py structured`: structured output on a real model, in one continuous batch.

Every schema of structured_schemas.py (sampled at --temperature, one seed each), the regex and
choice constraints, and unconstrained greedy prompts go to the engine in one generate call. It
prints, per constraint, whether the output parses and validates (jsonschema) or matches, how it
finished and the grammar's compile time on the worker thread; then whether the unconstrained
rows' tokens equal a run of those prompts alone (greedy: they must be identical). Exit status 1
when any check fails.
"""

from __future__ import annotations

import json
import re
import time

from .errors import EvalError
from .structured_schemas import CHOICES, PLAIN, REGEXES, SCHEMAS


def add_parser(sub, common) -> None:
    p = sub.add_parser(
        "structured", help="JSON schema / regex / choice constraints on a real model, validated"
    )
    common(p, "smollm2", "float32")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--plain-tokens", type=int, default=48, help="unconstrained rows' tokens")
    p.set_defaults(run=cmd_structured)


def _chat(tok, text: str) -> str:
    messages = [{"role": "user", "content": text}]
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def cmd_structured(args, save) -> int:
    try:
        import jsonschema
    except ImportError as exc:
        raise EvalError("structured: needs jsonschema (pip install jsonschema)") from exc
    from hf_paged import Engine, SamplingParams, StructuredOutputs

    from .models import describe, load_model

    loaded = load_model(args.model, args.dtype, args.device)
    tok = loaded.tokenizer
    if tok is None:
        raise EvalError("structured: the model needs a tokenizer (use smollm2 or a folder)")
    print(describe(loaded))
    rows = []  # (kind, name, prompt, params, check)
    for i, (name, what, schema) in enumerate(SCHEMAS):
        prompt = _chat(tok, f"Reply with JSON describing {what}. Schema: {json.dumps(schema)}")
        check = _schema_check(jsonschema, schema)
        rows.append(("json", name, prompt, StructuredOutputs(json=schema), check, i))
    for i, (name, prompt, pattern) in enumerate(REGEXES):
        check = _regex_check(pattern)
        rows.append(("regex", name, _chat(tok, prompt), StructuredOutputs(regex=pattern), check, i))
    for i, (name, prompt, choices) in enumerate(CHOICES):
        check = _choice_check(choices)
        rows.append(
            ("choice", name, _chat(tok, prompt), StructuredOutputs(choice=choices), check, i)
        )
    plain_prompts = [_chat(tok, p) for p in PLAIN]
    plain_params = SamplingParams(max_tokens=args.plain_tokens, temperature=0)
    options = dict(max_num_seqs=64, num_blocks=2048, max_model_len=2048)

    reference = Engine(loaded.model, tok, **options)
    ref_tokens = [o.output_token_ids for o in reference.generate(plain_prompts, plain_params)]
    reference.shutdown()

    engine = Engine(loaded.model, tok, **options)
    prompts, params = [], []
    plain_at = []
    for k, (kind, name, prompt, constraint, _, i) in enumerate(rows):
        prompts.append(prompt)
        params.append(
            SamplingParams(
                max_tokens=args.max_new_tokens,
                temperature=args.temperature,
                seed=args.seed + k,
                structured=constraint,
            )
        )
        if k % 8 == 3 and len(plain_at) < len(plain_prompts):  # interleaved
            plain_at.append(len(prompts))
            prompts.append(plain_prompts[len(plain_at) - 1])
            params.append(plain_params)
    for p in plain_prompts[len(plain_at) :]:
        plain_at.append(len(prompts))
        prompts.append(p)
        params.append(plain_params)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    constrained = [o for k, o in enumerate(outs) if k not in set(plain_at)]
    service = engine.inputs.grammars

    lines = ["| kind | name | ok | finish | tokens | compile ms | output |", "|" + "---|" * 7]
    counts: dict[str, list[int]] = {}
    for (kind, name, _, constraint, check, _), out in zip(rows, constrained):
        text = tok.decode(out.output_token_ids, skip_special_tokens=True)
        ok = out.finish_reason == "stop" and check(text)
        counts.setdefault(kind, [0, 0])
        counts[kind][0] += ok
        counts[kind][1] += 1
        ms = service.submit(constraint).seconds * 1e3  # a cache hit: the first compile's time
        shown = text if len(text) <= 70 else text[:67] + "..."
        lines.append(
            f"| {kind} | {name} | {'yes' if ok else 'NO'} | {out.finish_reason} | "
            f"{len(out.output_token_ids)} | {ms:.1f} | `{shown}` |"
        )
    plain_out = [outs[k].output_token_ids for k in plain_at]
    same = sum(a == b for a, b in zip(plain_out, ref_tokens))
    summary = [
        f"{kind}: {ok}/{n} parse and validate" if kind == "json" else f"{kind}: {ok}/{n} match"
        for kind, (ok, n) in counts.items()
    ]
    summary.append(f"unconstrained greedy rows identical to a run without constrained rows: "
                   f"{same}/{len(ref_tokens)}")  # fmt: skip
    tokens = sum(len(o.output_token_ids) for o in outs)
    summary.append(
        f"one generate call: {len(outs)} requests ({len(rows)} constrained), {tokens} output "
        f"tokens in {wall:.1f} s, temperature {args.temperature}"
    )
    json_ms = [service.submit(r[3]).seconds * 1e3 for r in rows if r[0] == "json"]
    summary.append(
        f"JSON schema compile time: median {sorted(json_ms)[len(json_ms) // 2]:.1f} ms, "
        f"max {max(json_ms):.1f} ms ({len(json_ms)} schemas, worker thread)"
    )
    table = "\n".join(lines + [""] + summary)
    print(table)
    engine.check_invariants()
    engine.shutdown()
    payload = {
        "model": loaded.name,
        "counts": counts,
        "plain_identical": same,
        "plain_rows": len(ref_tokens),
        "compile_ms": dict(
            zip([r[1] for r in rows], [service.submit(r[3]).seconds * 1e3 for r in rows])
        ),  # fmt: skip
    }
    path = save(args.out, f"structured-{time.strftime('%Y%m%d-%H%M%S')}", payload, table)
    print(f"\nresults: {path}")
    failed = any(ok != n for ok, n in counts.values()) or same != len(ref_tokens)
    return 1 if failed else 0


def _schema_check(jsonschema, schema):
    def check(text: str) -> bool:
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True

    return check


def _regex_check(pattern: str):
    return lambda text: re.fullmatch(pattern, text) is not None


def _choice_check(choices: list[str]):
    return lambda text: text in choices
