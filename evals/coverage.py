"""Architecture coverage: every causal-LM type the installed transformers maps, as a tiny random
float32 model, through transformers' greedy generate and through the patched engine.

Each type ends in one class: exact (same tokens, logits within float32 rounding), refused (a
ValueError at patch naming why), differs (runs, answers differently), crashed (anything raised
at generate, or a non-ValueError at patch), or skipped (no tiny text-only model to build: the
reason says why). The aim is 0 differs and 0 crashed.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import torch

from .errors import EvalError

# 2 layers, hidden 64, 4 heads / 2 KV heads, vocab 512, a 32-token window where a config takes
# one: small enough to build all ~200 types in minutes, with prompts longer than the window.
# Only keys the config already has are set (names differ: n_layer, n_embd, ... are mapped by
# the configs' attribute_map).
TINY = dict(
    num_hidden_layers=2,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
    sliding_window=32,
    max_position_embeddings=512,
    is_decoder=True,  # BERT-family LM heads are causal only so (transformers warns otherwise)
    pad_token_id=0,  # special ids inside the small vocabulary (configs validate them)
    bos_token_id=1,
    eos_token_id=2,
    # MoE families: few small experts, or the default expert counts dominate the build time
    moe_intermediate_size=64,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    # partial rotary (CodeGen, GPT-J); MLA keys 24 wide (16 + 8 rotary) and values 16, so the
    # K and V head sizes differ as DeepSeek-V3's 192 and 128 do
    rotary_dim=8,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    kv_lora_rank=32,
    q_lora_rank=32,
    index_head_dim=16,  # sparse-attention indexers (DeepSeek-V3.2 and its kin)
    index_n_heads=4,
    # Gemma 3n / 4 per-layer inputs
    vocab_size_per_layer_input=512,
    hidden_size_per_layer_input=16,
)
# Hybrid families place their attention layers by period and offset (Jamba: layer 4 of 8) or
# validate layer lists sized for the default depth: with 2 layers some have no attention layer
# and transformers' own generate fails. Those are built again at their default depth.
RETRY_WITHOUT = ("num_hidden_layers",)
# A default config whose size TINY does not reach (BLT's hash embeddings: 4.6B parameters) is
# skipped rather than built: the run stays minutes and within memory.
MAX_PARAMETERS = 200_000_000
PROMPT_LENGTHS = (5, 37, 90)
MAX_NEW_TOKENS = 16
LOGITS_TOLERANCE = 1e-4  # relative to the largest |logit|, as the engine's start-up check
# "rounding": the patched batch differs, and so does transformers' own generate under a second
# attention implementation (eager / sdpa) from its first: the model amplifies float32 rounding
# past the comparison here (Gemma 4: unscaled attention logits up to ~60), and the engine's
# start-up check measured the paged path within a few times that spread (engine/verify.py).
STATUSES = ("exact", "rounding", "refused", "differs", "crashed", "skipped")
# A part other than the text decoder makes the mapped class not a text-only model.
_OTHER_PARTS = ("vision_config", "audio_config", "speech_config")


class TooLarge(Exception):
    pass


@dataclass(slots=True)
class Row:
    model_type: str
    status: str
    detail: str = ""
    seconds: float = 0.0


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _first_line(exc: BaseException, width: int = 160) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"[:width]


def skip_reason(model_type: str) -> str | None:
    """Why a mapped type gets no tiny text-only model here, or None."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    if "Assistant" in name or "drafter" in model_type or "assistant" in model_type:
        return "drafter (needs the target model's hidden states)"
    try:
        config = AutoConfig.for_model(model_type)
    except Exception as exc:
        return f"no default config ({_first_line(exc, 80)})"
    parts = [p for p in _OTHER_PARTS if getattr(config, p, None) is not None]
    if parts:
        return f"multimodal/audio ({', '.join(parts)}); its text decoder is covered on its own"
    return None


def tiny_model(model_type: str, seed: int = 0, skip: tuple[str, ...] = ()) -> torch.nn.Module:
    """The type's model from its default config shrunk by TINY (less the keys in skip), random
    float32 weights, a sharpened output head (random init gives near-uniform logits whose
    argmax is a coin flip), EOS off (forced EOS too) so every prompt runs MAX_NEW_TOKENS."""
    from transformers import AutoConfig, AutoModelForCausalLM

    default = AutoConfig.for_model(model_type)
    text = default.get_text_config()
    overrides = {k: v for k, v in TINY.items() if k not in skip and _settable(text, k)}
    if "qk_rope_head_dim" in overrides:  # MLA: head_dim there is the rotary part's width
        overrides.pop("head_dim", None)
        # and every query head has its own K/V head (DeepSeek-V3: 128 and 128); transformers'
        # attention repeats K/V by heads / num_key_value_heads, so fewer would break its forward
        if "num_key_value_heads" in overrides:
            overrides["num_key_value_heads"] = overrides["num_attention_heads"]
    if text is default:
        config = AutoConfig.for_model(model_type, **overrides)
    else:  # a composite config: the text part takes the overrides
        config = AutoConfig.for_model(model_type, text_config={**text.to_dict(), **overrides})
    with torch.device("meta"):  # sized before any weight is allocated or initialised
        size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if size > MAX_PARAMETERS:
        raise TooLarge(f"{size / 1e6:.0f}M parameters after shrinking (parts TINY does not reach)")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    model.generation_config.eos_token_id = None
    # EOS forced at the last step (Bart's decoders' configs) is a generation option, not the
    # architecture this report is about (tests/test_model_families.py checks it on a Bart decoder)
    model.generation_config.forced_eos_token_id = None
    model.generation_config.pad_token_id = 0
    head = model.get_output_embeddings()
    if head is not None and getattr(head, "weight", None) is not None:
        with torch.no_grad():
            head.weight.mul_(8.0)
    return model


def _settable(config, key: str) -> bool:
    """The config has the key (directly or through its attribute_map) and it is not a
    read-only property (Falcon's head_dim); an attribute that raises (Gemma 4's per-layer
    head_dim) counts as absent."""
    prop = getattr(type(config), config.attribute_map.get(key, key), None)
    if isinstance(prop, property) and prop.fset is None:
        return False
    return _has(config, key)


def _has(config, key: str) -> bool:
    """hasattr, except that an attribute that raises (Gemma 4's per-layer head_dim) is absent."""
    try:
        getattr(config, key)
    except Exception:
        return False
    return True


def _prompts(vocab: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g) for n in PROMPT_LENGTHS]


@torch.inference_mode()
def _greedy(model, ids: torch.Tensor, mask: torch.Tensor):
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=MAX_NEW_TOKENS,
        output_logits=True,
        return_dict_in_generate=True,
    )
    new = out.sequences[:, ids.shape[1] :]
    logits = torch.stack(out.logits, 1).float()  # [rows, steps, vocab]
    return new, logits


def compare(ref_tokens, ref_logits, tokens, logits) -> str | None:
    """None when tokens agree and logits agree within LOGITS_TOLERANCE, else what differs."""
    for i, (rt, t) in enumerate(zip(ref_tokens, tokens)):
        if not torch.equal(rt, t):
            step = int((rt != t).nonzero()[0]) if rt.shape == t.shape else 0
            return f"prompt {i} ({PROMPT_LENGTHS[i]} tokens): first different token at step {step}"
    scale = max(1.0, float(ref_logits.abs().max()))
    err = float((ref_logits - logits).abs().max()) / scale
    if not err <= LOGITS_TOLERANCE:
        return f"same tokens, logits differ by {err:.2g} of the largest"
    return None


def run_type(model_type: str) -> Row:
    """Build, generate with transformers one prompt at a time, then patched as one batch."""
    import hf_paged

    t0 = time.perf_counter()
    row = Row(model_type, "skipped")
    reason = skip_reason(model_type)
    if reason is not None:
        row.detail = reason
        return row
    for skip in ((), RETRY_WITHOUT):
        try:
            model = tiny_model(model_type, skip=skip)
        except TooLarge as exc:
            row.detail = f"too large to build ({exc})"
            continue
        except Exception as exc:
            row.detail = f"cannot build a tiny model ({_first_line(exc, 100)})"
            continue
        prompts = _prompts(model.config.get_text_config().vocab_size)
        try:
            refs = [_greedy(model, p[None], torch.ones_like(p)[None]) for p in prompts]
            break
        except Exception as exc:
            row.detail = f"transformers' own generate fails ({_first_line(exc, 100)})"
    else:
        return row
    row.detail = ""
    longest = max(PROMPT_LENGTHS)
    ids = torch.zeros((len(prompts), longest), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as a batch goes to generate
        ids[i, longest - len(p) :], mask[i, longest - len(p) :] = p, 1
    try:
        try:
            hf_paged.patch(model)
        except ValueError as exc:
            # no length limit in the config (Bloom's ALiBi): the user passes one, as told
            if not str(exc).startswith("max_model_len:"):
                raise
            hf_paged.patch(model, max_model_len=TINY["max_position_embeddings"])
            row.detail = f"with max_model_len={TINY['max_position_embeddings']}"
    except ValueError as exc:
        row.status, row.detail = "refused", _first_line(exc, 240)
        return _timed(row, t0)
    except Exception as exc:
        row.status, row.detail = "crashed", f"at patch: {_first_line(exc)}"
        return _timed(row, t0)
    try:
        tokens, logits = _greedy(model, ids, mask)
        diff = compare(
            [r[0][0] for r in refs], torch.cat([r[1] for r in refs]), list(tokens), logits
        )
        row.status, row.detail = ("exact", row.detail) if diff is None else ("differs", diff)
    except Exception as exc:
        row.status, row.detail = "crashed", f"at generate: {_first_line(exc)}"
    finally:
        hf_paged.unpatch(model)
    if row.status == "differs":
        own = _own_spread(model, prompts, refs)
        if own is not None:
            row.status = "rounding"
            row.detail = f"{row.detail}; transformers' own {own}"
    return _timed(row, t0)


def _own_spread(model, prompts, refs) -> str | None:
    """What transformers' own generate under a second attention implementation changes against
    the reference (compare's words, naming the implementation), or None when it changes
    nothing (or cannot run)."""
    current = model.config._attn_implementation
    second = "sdpa" if current == "eager" else "eager"
    try:
        model.set_attn_implementation(second)
        others = [_greedy(model, p[None], torch.ones_like(p)[None]) for p in prompts]
    except Exception:
        return None
    finally:
        model.set_attn_implementation(current)
    diff = compare(
        [r[0][0] for r in refs],
        torch.cat([r[1] for r in refs]),
        [o[0][0] for o in others],
        torch.cat([o[1] for o in others]),
    )
    return None if diff is None else f"{second} forward: {diff}"


def _timed(row: Row, t0: float) -> Row:
    row.seconds = time.perf_counter() - t0
    return row


def select_types(types: list[str] | None, limit: int | None) -> list[str]:
    known = causal_lm_types()
    if types:
        unknown = [t for t in types if t not in known]
        if unknown:
            raise EvalError(
                f"unknown model type(s) {unknown}: not in transformers' "
                "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"
            )
        known = types
    return known[:limit] if limit else known


def counts(rows: list[Row]) -> dict[str, int]:
    return {s: sum(r.status == s for r in rows) for s in STATUSES}


def format_table(rows: list[Row]) -> str:
    import transformers

    lines = [
        f"transformers {transformers.__version__}, {len(rows)} causal-LM types; tiny random "
        f"float32 models, greedy, prompts of {', '.join(map(str, PROMPT_LENGTHS))} tokens, "
        f"{MAX_NEW_TOKENS} new tokens: transformers one at a time vs hf_paged.patch on one "
        "left-padded batch",
        "",
        "| class | count |",
        "| --- | --- |",
        *(f"| {s} | {n} |" for s, n in counts(rows).items()),
        "",
        "| model_type | result | detail |",
        "| --- | --- | --- |",
    ]
    for r in rows:
        detail = short_detail(r.detail).replace("|", "\\|")
        lines.append(f"| {r.model_type} | {r.status} | {detail} |")
    return "\n".join(lines)


def short_detail(detail: str, width: int = 150) -> str:
    """A refusal's cause for the table: without the exception name and the "model: Class
    (model_type ...)" prefix the row already names, cut at a word boundary."""
    text = " ".join(detail.split())
    text = re.sub(r"^ValueError: ", "", text)
    text = re.sub(r"^model: \w+( \(model_type '[^']*'\))?:? ", "", text)
    if len(text) > width:
        text = text[:width].rsplit(" ", 1)[0] + " ..."
    return text


def run_coverage(types: list[str], progress: bool = True) -> list[Row]:
    import warnings

    rows = []
    for model_type in types:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                row = run_type(model_type)
            except Exception as exc:  # the harness itself must get through every type
                row = Row(model_type, "crashed", f"harness: {_first_line(exc)}")
        rows.append(row)
        if progress:
            print(f"{model_type}: {row.status} {row.detail[:120]}", flush=True)
    return rows
