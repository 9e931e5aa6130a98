"""Offline helpers for tests and examples: no hub access, no downloads."""

from __future__ import annotations

import string

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def tiny_tokenizer(vocab_size: int = 256, extra_chars: str = ""):
    """A BPE tokenizer over exactly `vocab_size` ids, built in memory: <pad>=0, </s>=1, <s>=2,
    then characters and letter-pair merges, with a Metaspace pre-tokenizer and decoder (so any
    lowercase text round-trips) and a chat template. Matches the tests' tiny models' vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "</s>", "<s>"]
    chars = ["▁", *string.ascii_lowercase, *string.ascii_uppercase, *string.digits, *".,!?':"]
    chars += [c for c in extra_chars if c not in chars]  # e.g. JSON's brackets and quotes
    vocab = {t: i for i, t in enumerate(specials + chars)}
    merges = []
    pairs = [("▁", c) for c in string.ascii_lowercase]
    pairs += [(a, b) for a in string.ascii_lowercase for b in string.ascii_lowercase]
    for a, b in pairs:
        if len(vocab) >= vocab_size:
            break
        vocab[a + b] = len(vocab)
        merges.append((a, b))
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace()
    core.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="</s>",
        bos_token="<s>",
        chat_template=CHAT_TEMPLATE,
    )


def load_evals():
    """The repo's evals/run.py as a module, with evals/ importable as `hf_paged_evals` (for tests;
    needs the editable checkout, since evals/ is not installed)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "evals" / "run.py"
    spec = importlib.util.spec_from_file_location("hf_paged_evals_run", path)
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    run.load_package()
    return run


def evals_call(module: str, name: str, *args):
    """`hf_paged_evals.<module>.<name>(*args)`, evals/ loaded first as load_evals() does: how a
    spawned process (serve-bench's engine process) runs evals code, which is not installed
    (functools.partial(evals_call, ...) pickles; a function of hf_paged_evals does not)."""
    import importlib

    load_evals()
    return getattr(importlib.import_module(f"hf_paged_evals.{module}"), name)(*args)


def drive_engine(engine, ops: list) -> dict[str, list[int]]:
    """Replay an op list (("add", prompt, params, priority), ("step",), ("abort", index)) and
    run to the end, checking block accounting and the seat limit throughout; tokens of every
    request not aborted."""
    tokens: dict[str, list[int]] = {}
    ids: list[str] = []
    for op in ops:
        if op[0] == "add":
            ids.append(engine.add_request(op[1], op[2], priority=op[3]))
            tokens[ids[-1]] = []
        elif op[0] == "abort":
            rid = ids[op[1] % len(ids)]
            if rid in engine.scheduler.requests:
                engine.abort(rid)
                tokens.pop(rid)
        elif engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id in tokens:
                    tokens[out.request_id] += out.new_token_ids
        engine.check_invariants()
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id in tokens:
                tokens[out.request_id] += out.new_token_ids
        steps += 1
        assert steps < 2000, "no progress"
        assert len(engine.scheduler.running) <= engine.config.max_num_seqs
        engine.check_invariants()
    engine.check_invariants()
    return tokens


def check_served_idle(front, timeout: float = 20.0) -> None:
    """After a server test: wait until neither the engine nor the front (AsyncEngine, or
    EngineProcess for an engine process) holds a request, then check the engine's invariants
    and that every KV block is back in the pool."""
    front.check_idle(timeout)


def engine_stats(front) -> dict:
    """The engine's stats now (an engine process is asked, not read from its last push)."""
    return front.call("stats") if hasattr(front, "call") else front.stats()
