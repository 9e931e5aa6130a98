"""The start-up guard: one short paged forward against transformers' own, refused on a mismatch.

A model whose forward does more than the paged path implements (state that is not a KV cache,
two attention calls per layer, an additive mask the kernels never see, layers reused under one
layer_idx) would otherwise run and answer differently without a word. Engine construction (so
patch, pipelines and Engine alike) runs two short prompts through the runner as one flat batch,
a prefill and then one decode step each, and compares every position's logits with transformers'
forward of each prompt alone (the prompt, then the decode step over its cache, as generate
runs them), under the attention implementation the model had before it was patched.
verify_model=False skips it.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

from hf_paged.quantization.fp8_weights import weight_only
from hf_paged.quantization.kv_reference import fake_quantized_kv
from hf_paged.worker.forward_context import AttentionMetadata, ForwardContext, forward_context

# Largest |paged - transformers| over every compared logit, as a fraction of the largest
# |logit| (at least 1). Measured on the tiny test models (tests/conftest.py: 8 architectures,
# 2 layers, hidden 64, CPU): float32 at most 5.2e-7 (torch and Triton-interpreter backends),
# float16 1.6e-3, bfloat16 1.7e-2 (Gemma 2's softcaps; 5.6e-3 to 8.1e-3 for the others). Models
# that run and differ measure 0.1-0.8 (diffllama, doge, phimoe, moshi) and 7e-3 (hrm_text) in
# float32. float32 keeps 200x headroom over rounding; the half-precision bounds keep 6-12x for
# deeper real models, so small mismatches (hrm_text's) pass in bf16 and are caught in float32.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}
# With an FP8 KV cache the reference's attention sees K/V rounded as the cache stores them, but
# a value within float rounding of an FP8 rounding boundary can round the other way on each side
# (a 1/16 relative step for e4m3, 1/8 for e5m2), and deeper layers amplify those flips: measured
# on SmolLM2-135M (30 layers, float32) 7.5e-3 (e4m3) and 8.6e-6 (e5m2); the tiny 2-layer test
# models 3e-7-4e-7.
# Models that run and differ measure 0.1-0.8 (above), so 5e-2 still catches them.
FP8_KV_TOLERANCE = 5e-2
# A model can amplify float rounding past TOLERANCE on its own: Gemma 4 (attention unscaled,
# logits up to ~60, 30 layers) in float32 measures 5.0e-4 between transformers' own sdpa and
# eager forwards, each ~6e-4 from a float64 forward, and the paged path 6.9e-4 from sdpa (exact
# in float64). So a difference past TOLERANCE is measured against transformers' own spread: its
# forward under a second attention implementation on the same prompts. The paged path passes
# within SPREAD_FACTOR times that spread (two float32 forwards each off the exact one by about
# the spread differ from each other by up to twice it), and never past SPREAD_CAP. The models
# that run and differ (above) measure 0.1-0.8 against spreads at rounding level.
SPREAD_FACTOR = 4.0
SPREAD_CAP = {torch.float32: 1e-2, torch.float16: 5e-2, torch.bfloat16: 2e-1}
# one prompt over a 16-token block boundary, one inside a block; shorter when the KV cache is
# too small for these (see _prompt_lengths)
PROMPT_LENGTHS = ((19, 6), (11, 5), (7, 3), (3, 2))
# Windows up to this many tokens are checked with a prompt beyond them: 2048 covers Phi-3's
# 2047 and Gemma 3's 512/1024 while keeping the check's prompt short; longer windows (Mistral's
# 4096) are not exercised.
MAX_WINDOW = 2048
LIKELY_CAUSES = (
    "the model keeps state that is not a KV cache (SSM, convolution or linear-attention "
    "layers), calls attention more than once per layer or reuses a layer under one layer_idx, "
    "or relies on an attention mask, a sliding-window cache or attention arguments the paged "
    "kernels do not apply"
)


def verify_model(model: torch.nn.Module, runner, lease) -> float | None:
    """Raise ValueError unless the runner's forward gives transformers' logits on a short batch;
    return the measured relative error (None when no reference could be taken: the model's
    attention is held by another live Engine that did not verify these prompts). Touches no
    scheduler state; the KV blocks it writes are zeroed again, as allocated."""
    name = _model_name(model)
    lengths = _prompt_lengths(
        model, runner.num_blocks, runner.block_size, runner.config.max_model_len
    )
    if not lengths:
        return None
    vocab = model.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(0)
    # token ids from the upper half of the vocabulary: clear of the usual pad/bos/eos ids
    seqs = [torch.randint(vocab // 2, vocab, (n + 1,), generator=gen) for n in lengths]
    # FP8 weights weight-only on both sides: the paged batch and each prompt alone have row
    # counts on different sides of the activation-quantising path (quantization/fp8_weights.py)
    with weight_only():
        reference = _reference_logits(model, lease, seqs, runner)
    if reference is None:
        return None
    try:
        with weight_only():
            prefill, decode = _paged_logits(runner, seqs)
    except ValueError as exc:  # a refusal that names its cause (attention sinks, shapes, ...)
        raise ValueError(f"model: {name}: {exc}") from exc
    except Exception as exc:
        raise ValueError(
            f"model: {name} fails in a paged forward ({type(exc).__name__}: {exc}); its forward "
            "needs something engine steps do not give it (e.g. a sparse-attention indexer that "
            "reads the attention mask, which is None inside a step). Pass verify_model=False to "
            "skip this check (generate would then fail the same way)"
        ) from exc
    ref_prefill = torch.cat([r[:-1] for r in reference])
    ref_decode = torch.stack([r[-1] for r in reference])
    scale = max(1.0, float(torch.cat([ref_prefill, ref_decode]).abs().max()))
    err_prefill = float((prefill - ref_prefill).abs().max()) / scale
    err_decode = float((decode - ref_decode).abs().max()) / scale
    err = max(err_prefill, err_decode)
    dtype = next(model.parameters()).dtype
    tol = TOLERANCE.get(dtype, TOLERANCE[torch.bfloat16])
    if runner.kv_scales is not None:
        tol = max(tol, FP8_KV_TOLERANCE)
    if err <= tol:
        return err
    spread = _reference_spread(model, lease, seqs, runner, reference, scale)
    allowed = tol
    if spread is not None:
        allowed = max(tol, min(SPREAD_FACTOR * spread, SPREAD_CAP.get(dtype, tol)))
    if not err <= allowed:  # NaN fails too
        where = "already in the prompt forward" if not err_prefill <= tol else "at the decode step"
        own = (
            f"; transformers' own forward differs from itself under another attention "
            f"implementation by {spread:.3g}"
            if spread is not None
            else ""
        )
        raise ValueError(
            f"model: {name} computes different logits under paged attention than under "
            f"transformers' own forward, {where} (largest difference {err:.3g} of the largest "
            f"logit; the {dtype} tolerance is {tol:g}{own}), on a check of {len(seqs)} prompts "
            f"of {' and '.join(str(n) for n in lengths)} tokens and one decode step each. "
            f"Likely cause: {LIKELY_CAUSES}. Pass verify_model=False to run it anyway"
        )
    return err


def _reference_spread(model, lease, seqs, runner, reference, scale: float) -> float | None:
    """How far transformers' forward under a second attention implementation (eager, or sdpa
    where the reference ran eager) is from the reference, as a fraction of `scale`; None where
    no second implementation runs on this model."""
    second = "sdpa" if lease.previous == "eager" else "eager"
    try:
        other = _reference_logits(model, lease, seqs, runner, implementation=second)
    except (ValueError, ImportError):
        return None
    if other is None:
        return None
    return max(float((a - b).abs().max()) for a, b in zip(reference, other)) / scale


def _model_name(model: torch.nn.Module) -> str:
    model_type = getattr(model.config, "model_type", None) or "?"
    return f"{type(model).__name__} (model_type {model_type!r})"


def _prompt_lengths(
    model, num_blocks: int, block_size: int, max_model_len: int = 1 << 30
) -> tuple[int, ...]:
    """The first pair of prompt lengths whose sequences (prompt + one decoded token) fit the
    cache in separate blocks and max_model_len; else one prompt as long as the cache allows
    (none in one slot).
    With a sliding window of at most MAX_WINDOW, the first prompt is longer than the window:
    some models apply their window only through the mask (PhiMoE, Doge), which paged steps
    do not build, and agree with transformers on prompts shorter than it."""
    window = getattr(model.config.get_text_config(), "sliding_window", None)
    pairs = PROMPT_LENGTHS
    if isinstance(window, int) and 0 < window <= MAX_WINDOW:
        pairs = ((window + 4, 6), *pairs)
    for pair in pairs:
        fits = sum(-(-(n + 1) // block_size) for n in pair) <= num_blocks
        if fits and max(pair) < max_model_len:
            return pair
    longest = min(num_blocks * block_size, max_model_len) - 1
    longest = min(longest, PROMPT_LENGTHS[-1][0])
    return (longest,) if longest > 0 else ()


@torch.inference_mode()
def _reference_logits(
    model, lease, seqs: list[torch.Tensor], runner, implementation: str | None = None
) -> list[torch.Tensor] | None:
    """transformers' logits at every position of each sequence alone, under the attention
    implementation the model had before the engine, or `implementation` (kept on the lease for
    later Engines on the same model, which must not switch the attention under one that is
    stepping). With an FP8 KV cache, that attention sees K/V rounded as the cache stores them."""
    scales = runner.kv_scales
    implementation = implementation or lease.previous
    key = (tuple(tuple(s.tolist()) for s in seqs), runner.kv_spec.dtype, str(scales))
    key += (implementation,)
    cached = lease.references.get(key)
    if cached is not None:
        return cached
    if len(lease.owners) > 1:  # another live Engine holds the model's attention routing
        return None
    device = next(model.parameters()).device
    current = model.config._attn_implementation
    model.set_attn_implementation(implementation)
    # a PeftModel: the check compares the base model (the paged side runs no adapter either)
    base_only = model.disable_adapter() if lease.lora is not None else contextlib.nullcontext()
    try:
        # eager: layers the engine compiled in place would otherwise be traced again for this
        # one forward under another attention implementation and a cache object
        fp8 = fake_quantized_kv(model, runner.kv_spec.dtype, scales)
        with base_only, torch.compiler.set_stance("force_eager"), fp8:
            logits = [_cached_forward(model, s.to(device)) for s in seqs]
    except Exception as exc:
        raise ValueError(
            f"model: {_model_name(model)}: transformers' own forward fails on a short prompt "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    finally:
        model.set_attn_implementation(current)
    lease.references[key] = logits
    return logits


def _cached_forward(model, seq: torch.Tensor) -> torch.Tensor:
    """Logits at every position as generate computes them: the prompt, then the last token
    over transformers' cache. Some models apply their window only through that cache (Moshi)
    and agree with the paged path when run without it. A model that returns no cache, or whose
    cache a plain forward cannot continue (hybrids whose generate builds their cache), gets
    one forward of the whole sequence instead."""
    # transformers 5.24 renamed past_key_values to cache (the old name warns); 5.20 has the old
    params = inspect.signature(model.forward).parameters
    name = "cache" if "cache" in params else "past_key_values"
    # generate passes position ids 0.. where the forward takes them; a plain forward would build
    # others in some families (RoBERTa and its kin start at padding_idx + 1 from input_ids)
    n = len(seq) - 1
    pos = (
        {"position_ids": torch.arange(n + 1, device=seq.device)[None]}
        if "position_ids" in params
        else {}
    )
    first = {k: v[:, :n] for k, v in pos.items()}
    last = {k: v[:, n:] for k, v in pos.items()}
    try:
        prompt = model(input_ids=seq[None, :-1], use_cache=True, **first)
        step = model(input_ids=seq[None, -1:], use_cache=True, **{name: prompt[name]}, **last)
        return torch.cat([prompt.logits[0], step.logits[0, -1:]]).float()
    except Exception:
        return model(input_ids=seq[None], use_cache=False, **pos).logits[0].float()


@torch.inference_mode()
def _paged_logits(runner, seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every prompt position's logits from one flat prefill of all sequences but their last
    token, then the last tokens' logits from one decode step over the cache it wrote."""
    device, bs = runner.device, runner.block_size
    widths = [-(-len(s) // bs) for s in seqs]
    table = torch.zeros((len(seqs), max(widths)), dtype=torch.int32)
    first = 0
    for i, width in enumerate(widths):  # blocks 0.. in order: the engine holds none yet
        table[i, :width] = torch.arange(first, first + width)
        first += width
    used = first

    def slots(i: int, positions: torch.Tensor) -> torch.Tensor:
        return table[i, positions // bs].long() * bs + positions % bs

    def step(q_lens: list[int], seq_lens: list[int], ids, positions, slot_list, keep):
        meta = AttentionMetadata.from_lengths(q_lens, seq_lens, table.to(device))
        meta.slot_mapping = torch.cat(slot_list).to(device)
        ctx = ForwardContext(meta, runner.kv_caches, runner.backend, kv_scales=runner.kv_scales)
        with forward_context(ctx):
            out = runner.forward.eager(ids.to(device), positions.to(device), keep.to(device))
        return out.float()

    try:
        prompt_lens = [len(s) - 1 for s in seqs]
        pos = [torch.arange(n) for n in prompt_lens]
        prefill = step(
            prompt_lens,
            prompt_lens,
            torch.cat([s[:-1] for s in seqs]),
            torch.cat(pos),
            [slots(i, p) for i, p in enumerate(pos)],
            torch.arange(sum(prompt_lens)),
        )
        last = [torch.tensor([n]) for n in prompt_lens]
        decode = step(
            [1] * len(seqs),
            [n + 1 for n in prompt_lens],
            torch.stack([s[-1] for s in seqs]),
            torch.cat(last),
            [slots(i, p) for i, p in enumerate(last)],
            torch.arange(len(seqs)),
        )
    finally:  # the cache as allocated (zeros): the check leaves nothing in it
        for key_cache, value_cache in runner.kv_caches:
            key_cache[:used].zero_()
            value_cache[:used].zero_()
    return prefill, decode
