"""Offline helpers for tests and examples: no hub access, no downloads."""

from __future__ import annotations

import string

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def tiny_tokenizer(vocab_size: int = 256):
    """A BPE tokenizer over exactly `vocab_size` ids, built in memory: <pad>=0, </s>=1, <s>=2,
    then characters and letter-pair merges, with a Metaspace pre-tokenizer and decoder (so any
    lowercase text round-trips) and a chat template. Matches the tests' tiny models' vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "</s>", "<s>"]
    chars = ["▁", *string.ascii_lowercase, *string.ascii_uppercase, *string.digits, *".,!?':"]
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
