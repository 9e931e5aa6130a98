"""Throughput workloads: lists of (prompt_token_ids, max_new_tokens), seeded and reproducible.

All workloads ignore EOS, so every backend generates exactly max_new_tokens per request and
the token counts (and so tokens/s) compare like for like, as in vLLM's benchmark_throughput.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import EvalError
from .sources import load_json_dataset


@dataclass(slots=True)
class WorkloadRequest:
    prompt_token_ids: list[int]
    max_new_tokens: int


@dataclass
class Workload:
    name: str
    requests: list[WorkloadRequest]
    description: str = ""
    max_concurrency: int | None = None  # 1 for the batch-1 latency workload
    meta: dict = field(default_factory=dict)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.max_new_tokens for r in self.requests)

    def summary(self) -> str:
        n = len(self.requests)
        lens = [len(r.prompt_token_ids) for r in self.requests]
        outs = [r.max_new_tokens for r in self.requests]
        return (
            f"{self.name}: {n} requests, prompt {min(lens)}-{max(lens)} "
            f"(mean {sum(lens) / n:.0f}) tokens, output {min(outs)}-{max(outs)} "
            f"(mean {sum(outs) / n:.0f}) tokens, EOS ignored"
            + (f", concurrency {self.max_concurrency}" if self.max_concurrency else "")
        )

    def limited(self, limit: int | None) -> Workload:
        if not limit or limit >= len(self.requests):
            return self
        return Workload(
            self.name,
            self.requests[:limit],
            self.description,
            self.max_concurrency,
            dict(self.meta, limit=limit),
        )

    def with_max_new_tokens(self, n: int | None) -> Workload:
        if not n:
            return self
        reqs = [WorkloadRequest(r.prompt_token_ids, n) for r in self.requests]
        return Workload(
            self.name,
            reqs,
            self.description,
            self.max_concurrency,
            dict(self.meta, max_new_tokens=n),
        )

    def save(self, path: str | Path) -> None:
        data = {
            "name": self.name,
            "description": self.description,
            "max_concurrency": self.max_concurrency,
            "meta": self.meta,
            "requests": [asdict(r) for r in self.requests],
        }
        Path(path).write_text(json.dumps(data))


def load_workload_file(path: str | Path, vocab_size: int | None = None) -> Workload:
    """A workload saved by `run.py export-workload` (the GPU machine cannot fetch ShareGPT)."""
    try:
        data = json.loads(Path(path).read_text())
        reqs = [
            WorkloadRequest(list(r["prompt_token_ids"]), int(r["max_new_tokens"]))
            for r in data["requests"]
        ]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise EvalError(f"cannot read workload file {path}: {exc}") from exc
    wl = Workload(
        data.get("name", Path(path).stem),
        reqs,
        data.get("description", ""),
        data.get("max_concurrency"),
        data.get("meta", {}),
    )
    return _fit_vocab(wl, vocab_size)


def _fit_vocab(wl: Workload, vocab_size: int | None) -> Workload:
    # Ids tokenized with SmolLM2 (vocab 49152) run on shapes with a smaller vocabulary
    # (TinyLlama: 32000); with random weights only the lengths matter, so fold them in.
    if vocab_size is None or all(max(r.prompt_token_ids) < vocab_size for r in wl.requests):
        return wl
    for r in wl.requests:
        r.prompt_token_ids = [t % vocab_size for t in r.prompt_token_ids]
    wl.meta["ids_folded_into_vocab"] = vocab_size
    return wl


def _random_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    # Skip the lowest ids: special tokens (BOS/EOS/pad) live there in most vocabularies.
    return [rng.randrange(16, vocab_size) for _ in range(n)]


def synthetic(
    vocab_size: int,
    num_requests: int = 256,
    min_prompt: int = 64,
    max_prompt: int = 512,
    output_len: int = 256,
    seed: int = 0,
) -> Workload:
    """W1: random prompts of 64-512 tokens, 256 output tokens each."""
    rng = random.Random(seed)
    reqs = [
        WorkloadRequest(
            _random_ids(rng, rng.randint(min_prompt, max_prompt), vocab_size), output_len
        )
        for _ in range(num_requests)
    ]
    return Workload(
        "synthetic", reqs, "W1: random tokens, prompt 64-512, output 256", meta={"seed": seed}
    )


def sharegpt(
    tokenizer,
    num_requests: int = 1000,
    max_model_len: int = 2048,
    seed: int = 0,
    vocab_size: int | None = None,
) -> Workload:
    """Real prompt and reply lengths from ShareGPT, sampled like vLLM's benchmark: the first
    human turn is the prompt, the first reply's token count is max_new_tokens; pairs with fewer
    than 4 tokens on either side, prompts over 1024 or totals over min(2048, model length) are
    skipped (vLLM's filter, capped by the model's max length)."""
    ds = load_json_dataset("sharegpt", ("prompt", "completion"))
    order = list(range(len(ds)))
    random.Random(seed).shuffle(order)
    cap = min(2048, max_model_len)
    reqs: list[WorkloadRequest] = []
    batch = 256  # tokenize in batches: one call per row is ~5x slower
    for start in range(0, len(order), batch):
        rows = ds.select(order[start : start + batch])
        prompts = tokenizer(list(rows["prompt"]), add_special_tokens=False)["input_ids"]
        replies = tokenizer(list(rows["completion"]), add_special_tokens=False)["input_ids"]
        for p, c in zip(prompts, replies):
            if len(p) < 4 or len(c) < 4 or len(p) > 1024 or len(p) + len(c) > cap:
                continue
            reqs.append(WorkloadRequest(p, len(c)))
            if len(reqs) == num_requests:
                wl = Workload(
                    "sharegpt",
                    reqs,
                    "ShareGPT real prompt/output lengths",
                    meta={"seed": seed, "max_model_len": cap},
                )
                return _fit_vocab(wl, vocab_size)
    raise EvalError(f"ShareGPT has only {len(reqs)} usable conversations, {num_requests} asked")


def shared_prefix(
    vocab_size: int,
    num_requests: int = 256,
    prefix_len: int = 1024,
    min_question: int = 16,
    max_question: int = 64,
    output_len: int = 64,
    seed: int = 0,
) -> Workload:
    """One 1k-token system prompt shared by all requests plus a short random question each:
    measures prefix caching (ideal hit rate ~ prefix_len / prompt_len after the first)."""
    rng = random.Random(seed)
    prefix = _random_ids(rng, prefix_len, vocab_size)
    reqs = [
        WorkloadRequest(
            prefix + _random_ids(rng, rng.randint(min_question, max_question), vocab_size),
            output_len,
        )
        for _ in range(num_requests)
    ]
    return Workload(
        "shared-prefix",
        reqs,
        f"{prefix_len}-token shared system prompt",
        meta={"seed": seed, "prefix_len": prefix_len},
    )


def batch1(
    vocab_size: int,
    num_requests: int = 8,
    prompt_len: int = 128,
    output_len: int = 128,
    seed: int = 0,
) -> Workload:
    """Latency at batch size 1: requests run one after another."""
    rng = random.Random(seed)
    reqs = [
        WorkloadRequest(_random_ids(rng, prompt_len, vocab_size), output_len)
        for _ in range(num_requests)
    ]
    return Workload("batch1", reqs, "batch-1 latency", max_concurrency=1, meta={"seed": seed})


def long_decode(
    vocab_size: int,
    num_requests: int = 256,
    prompt_len: int = 4096,
    output_len: int = 512,
    seed: int = 0,
) -> Workload:
    """Long contexts, decode-heavy: where the KV cache's bytes (its size and the attention's
    reads) bound throughput, as an FP8 cache is meant to relieve."""
    rng = random.Random(seed)
    reqs = [
        WorkloadRequest(_random_ids(rng, prompt_len, vocab_size), output_len)
        for _ in range(num_requests)
    ]
    desc = f"long decode: random tokens, prompt {prompt_len}, output {output_len}"
    return Workload("long-decode", reqs, desc, meta={"seed": seed})


WORKLOADS = ("synthetic", "sharegpt", "shared-prefix", "batch1", "long-decode")


def build_workload(
    name: str, vocab_size: int, tokenizer_fn, max_model_len: int, seed: int = 0
) -> Workload:
    """name: one of WORKLOADS or a workload JSON file. tokenizer_fn is called only when needed."""
    if name == "synthetic":
        return synthetic(vocab_size, seed=seed)
    if name == "sharegpt":
        return sharegpt(
            tokenizer_fn(), max_model_len=max_model_len, seed=seed, vocab_size=vocab_size
        )
    if name == "shared-prefix":
        return shared_prefix(vocab_size, seed=seed)
    if name == "batch1":
        return batch1(vocab_size, seed=seed)
    if name == "long-decode":
        return long_decode(vocab_size, seed=seed)
    check_workload_name(name)
    return load_workload_file(name, vocab_size)


def check_workload_name(name: str) -> None:
    if name in WORKLOADS:
        return
    if name.endswith(".json") or "/" in name:
        if not Path(name).is_file():
            raise EvalError(f"workload file not found: {name}")
        return
    raise EvalError(
        f"unknown dataset {name!r} for throughput: use one of "
        f"{', '.join(WORKLOADS)} or a workload .json file"
    )
