"""kernels/sampling.py and kernels/sampling_topk.py compiled, at real vocabularies (152k, 256k) and
128 rows: the distribution of each option against transformers' warpers (one row read by 65,536
programs, stratified uniforms: token i must come n * p_i times, +-2), the same token as
sample_rows_ref on cut rows, seeded rows through the Sampler, one compiled variant of each
kernel whatever the batch size, and faster than the paths they replaced."""

from __future__ import annotations

import pytest
import torch
from hf_paged.kernels.sampling import sample_rows, sample_rows_ref
from hf_paged.kernels.sampling_topk import sample_rows_topk
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hf_paged.sample.metadata import SamplingRow
from hf_paged.sample.sampler import Sampler
from hf_paged.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
DEV = torch.device("cuda")
CASES = {
    "t0.7_k50_p0.9": (dict(temperature=0.7, top_k=50, top_p=0.9), [
        TemperatureLogitsWarper(0.7), TopKLogitsWarper(50), TopPLogitsWarper(0.9)]),
    "p0.9": (dict(top_p=0.9), [TopPLogitsWarper(0.9)]),
    "min_p0.05": (dict(min_p=0.05), [MinPLogitsWarper(0.05)]),
    "t1.3_k1000_minp0.01": (dict(temperature=1.3, top_k=1000, min_p=0.01), [
        TemperatureLogitsWarper(1.3), TopKLogitsWarper(1000), MinPLogitsWarper(0.01)]),
}  # fmt: skip


def _params(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    def full(v, dt=torch.float32):
        return torch.full((n,), v, dtype=dt, device=DEV)

    return full(temperature), full(top_k, torch.int32), full(top_p), full(min_p)


@pytest.mark.parametrize("vocab", [151936, 256000])
@pytest.mark.parametrize("name", list(CASES))
def test_distribution_at_real_vocab(vocab, name):
    g = torch.Generator(device=DEV).manual_seed(vocab)
    # float32 logits: no ties, where transformers' sort order and the kept-whole tie agree
    logits = torch.randn(1, vocab, device=DEV, generator=g) * 3
    kwargs, warpers = CASES[name]
    expected = LogitsProcessorList(warpers)(None, logits.clone()).double().softmax(-1)[0]
    n = 65536
    u = (torch.arange(n, device=DEV, dtype=torch.float64) + 0.5) / n
    draws = sample_rows(logits.expand(n, -1), *_params(n, **kwargs), u.float())
    counts = torch.bincount(draws, minlength=vocab).double()
    assert counts[expected == 0].sum() == 0  # never a filtered token
    assert (counts - n * expected).abs().max() <= 2.0


@pytest.mark.parametrize("vocab", [151936, 256000])
@pytest.mark.parametrize("name", ["t0.7_k50_p0.9", "t1.3_k1000_minp0.01"])
def test_topk_distribution_at_real_vocab(vocab, name):
    g = torch.Generator(device=DEV).manual_seed(vocab + 1)
    logits = torch.randn(1, vocab, device=DEV, generator=g) * 3
    kwargs, warpers = CASES[name]
    expected = LogitsProcessorList(warpers)(None, logits.clone()).double().softmax(-1)[0]
    n = 65536
    u = (torch.arange(n, device=DEV, dtype=torch.float64) + 0.5) / n
    draws = sample_rows_topk(
        logits.expand(n, -1), *_params(n, **kwargs), u.float(), kwargs["top_k"]
    )
    counts = torch.bincount(draws, minlength=vocab).double()
    assert counts[expected == 0].sum() == 0
    assert (counts - n * expected).abs().max() <= 2.0


@pytest.mark.parametrize("kernel", ["search", "topk"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [151936, 256000])
def test_same_token_as_reference_on_cut_rows(vocab, dtype, kernel):
    """128 rows, mixed per-row options; top-k <= 100 on every row, so the kept mass is summed
    over few tokens and the kernel's and torch's roundings cannot move a draw."""
    g = torch.Generator(device=DEV).manual_seed(1)
    n = 128
    x = (torch.randn(n, vocab, device=DEV, generator=g) * 3).to(dtype)  # bf16: many ties
    x[1, : vocab // 2] = float("-inf")
    temp = torch.rand(n, device=DEV, generator=g) + 0.3
    top_k = torch.randint(1, 101, (n,), device=DEV, generator=g, dtype=torch.int32)
    top_p = torch.where(torch.rand(n, device=DEV, generator=g) < 0.3, 1.0, 0.9)
    min_p = torch.where(torch.rand(n, device=DEV, generator=g) < 0.3, 0.05, 0.0)
    u = torch.rand(n, device=DEV, generator=g)
    if kernel == "search":
        got = sample_rows(x, temp, top_k, top_p, min_p, u)
    else:
        got = sample_rows_topk(x, temp, top_k, top_p, min_p, u, 100)
    assert torch.equal(got, sample_rows_ref(x, temp, top_k, top_p, min_p, u))


def _variants(jit_fn) -> int:
    return sum(len(cache[0]) for cache in jit_fn.device_caches.values())


def test_one_compiled_variant_whatever_the_batch_size():
    """Every batch size from 1 to 13 through the Sampler (top-k rows, top-p-only rows, with a
    repetition penalty) compiles each kernel once: a parameter row at an odd offset used to make
    Triton compile another variant (16-byte alignment) in the middle of a run."""
    from hf_paged.kernels.penalties import _penalties_kernel
    from hf_paged.kernels.sampling import _sample_rows_kernel
    from hf_paged.kernels.sampling_topk import _topk_rows_kernel

    from hf_paged.sample.token_counts import TokenCountPool

    vocab = 32000
    kinds = [
        SamplingParams(temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.1),
        SamplingParams(top_p=0.9, repetition_penalty=1.1),
    ]
    sampler, pool = Sampler(DEV), TokenCountPool(DEV)
    kernels = (_sample_rows_kernel, _topk_rows_kernel, _penalties_kernel)
    # other tests in this process compiled their own variants (vocabularies, dtypes): count
    # what this run adds
    before = [_variants(k) for k in kernels]
    counts = []
    for batch in range(1, 14):
        for params in kinds:
            rows = [SamplingRow(f"r{i}", params, None, [3, 4], 2) for i in range(batch)]
            x = torch.randn(batch, vocab, device=DEV).bfloat16()
            sampler(x, rows, pool).tokens.cpu()
            for r in rows:
                pool.release(r.req_id)
        counts.append([_variants(k) - b for k, b in zip(kernels, before)])
    # at most one new variant per kernel, all of it compiled at batch size 1
    assert counts[-1] == counts[0] and max(counts[0]) <= 1, (before, counts)


def test_seeded_rows_repeat_in_any_batch():
    vocab = 151936

    def run(seed, others):
        gen = torch.Generator(device=DEV).manual_seed(seed)
        row = SamplingRow("s", SamplingParams(temperature=0.8, top_k=40, top_p=0.95), gen, [3], 1)
        tokens = []
        for step in range(6):
            g = torch.Generator(device=DEV).manual_seed(step)
            x = torch.randn(others + 1, vocab, device=DEV, generator=g).bfloat16()
            x[-1] = torch.randn(vocab, device=DEV, generator=g.manual_seed(100 + step)) * 2
            batch = [SamplingRow("o", SamplingParams(top_p=0.5), None, [3], 1)] * others
            tokens.append(Sampler(DEV)(x, batch + [row]).tokens[-1].item())
        return tokens

    alone = run(7, 0)
    assert run(7, 127) == alone
    assert run(8, 0) != alone or run(9, 0) != alone


def test_faster_than_the_sort_path():
    from hf_paged.sample.logits_processing import apply_top_k, apply_top_p

    n, vocab = 128, 151936
    x = (torch.randn(n, vocab, device=DEV) * 3).bfloat16()
    temp, top_k, top_p, min_p = _params(n, temperature=0.7, top_k=50, top_p=0.9)

    def ours():
        sample_rows(x, temp, top_k, top_p, min_p, torch.rand(n, device=DEV))

    def sort_path():
        s = apply_top_p(apply_top_k(x.float() / temp[:, None], top_k.long()), top_p)
        p = s.softmax(-1)
        (p / torch.empty_like(p).exponential_()).argmax(-1)

    def ms(fn):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 10

    assert ms(ours) < ms(sort_path)

    def listed():
        sample_rows_topk(x, temp, top_k, top_p, min_p, torch.rand(n, device=DEV), 50)

    assert ms(listed) < ms(ours) / 2


def test_penalties_kernel_equals_torch_at_real_vocab():
    from hf_paged.kernels.penalties import apply_penalties

    from hf_paged.sample.logits_processing import TokenCountPool, _apply_penalties

    vocab, n = 151936, 128
    g = torch.Generator().manual_seed(5)
    params = SamplingParams(repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.1)
    reqs = [
        SamplingRow(
            f"r{i}", params, None, torch.randint(0, vocab, (300,), generator=g).tolist(), 200
        )
        for i in range(n)
    ]
    x = torch.randn(n, vocab, generator=g) * 3
    pool = TokenCountPool(torch.device("cpu"))
    want = _apply_penalties(x, reqs, list(range(n)), pool)  # torch, on the host
    slots = torch.tensor([r.penalty_slot for r in reqs], device=DEV)
    got = apply_penalties(
        x.to(DEV), torch.arange(n, device=DEV), slots, pool.output_counts.to(DEV),
        pool.prompt_mask.to(DEV), *(torch.full((n,), v, device=DEV) for v in (1.1, 0.2, 0.1)),
    )  # fmt: skip
    torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)
