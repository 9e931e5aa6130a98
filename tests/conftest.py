"""Shared fixtures: tiny random-weight models of several architectures, and engine invariants.

Without a GPU the Triton kernels run in Triton's CPU interpreter. Triton reads TRITON_INTERPRET
when it is imported and a @triton.jit function is decorated, so it is set here, before any test
module (or transformers, or hf_paged) can import triton.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":  # (tests/triton_interpreter.py says why)
    from tests.triton_interpreter import install as _install_interpreter_shortcut

    _install_interpreter_shortcut()

# pytest-xdist workers (`pytest -n N`) share the cores: intra-op threads per worker are
# divided among them, so N workers do not run N x cores threads
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // _WORKERS))

import pytest  # noqa: E402
import transformers  # noqa: E402

VOCAB = 256
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
    tie_word_embeddings=False,
)

# name -> (config class, model class, overrides). Each exercises something different.
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 24}),  # window < prompts
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),  # q/k/v biases
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {"head_dim": 32},
    ),  # q/k norms, head_dim != hidden/heads
    # logit softcapping, alternating sliding-window layers, query_pre_attn_scalar scaling
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "sliding_window": 20,
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 0.5,
            "final_logit_softcapping": 15.0,
        },
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"num_key_value_heads": 4}),  # fused qkv, MHA
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),  # norms after attention
    "gpt_neox": (  # partial rotary, fused qkv, no GQA
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        {"rotary_pct": 0.5, "num_key_value_heads": 4},
    ),
    # attention sinks (s_aux), alternating sliding-window layers, MoE
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": 20,
            "layer_types": ["sliding_attention", "full_attention"],
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
        },
    ),
    # MLA as transformers runs it (unabsorbed): keys of 24 (16 + 8 rotary), values of 16
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {
            "num_key_value_heads": 4,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "kv_lora_rank": 32,
            "q_lora_rank": None,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
        },
    ),
    # differential attention, two attention calls per layer: refused by the start-up check
    # (hf_paged/engine/verify.py), so not in the parity lists
    "diffllama": ("DiffLlamaConfig", "DiffLlamaForCausalLM", {}),
}


def build_model(arch: str, dtype=torch.float32, seed: int = 0, **overrides) -> torch.nn.Module:
    cfg_name, model_name, arch_overrides = ARCHITECTURES[arch]
    kwargs = {**COMMON, **arch_overrides, **overrides}
    torch.manual_seed(seed)
    config = getattr(transformers, cfg_name)(**kwargs)
    model = getattr(transformers, model_name)(config).to(dtype).eval()
    # Random init gives near-uniform logits where argmax ties are a coin flip between two
    # implementations; scaling the output head makes the greedy choice well separated.
    # Sharper attention (larger q/k) makes the tests sensitive to masking, windows and softcaps.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
        for name, param in model.named_parameters():
            if any(
                k in name
                for k in (
                    "q_proj.weight",
                    "k_proj.weight",
                    "qkv_proj.weight",
                    "query_key_value.weight",
                )
            ):
                param.mul_(4.0)
    return model


@pytest.fixture
def tiny_model():
    return build_model


# LoRA adapters of the tiny Llama: name -> (rank, target modules, rslora); different ranks (one
# not a power of two) and target sets, one with rank-stabilised scaling
LORA_ADAPTERS = {
    "math": (8, ["q_proj", "v_proj"], False),
    "chat": (4, ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
    "code": (3, ["o_proj", "down_proj"], False),
}


def build_peft_model(adapters=None, seed: int = 5):
    """A PeftModel on the tiny Llama with these adapters (lora_dropout on: inference ignores
    it), every lora_B drawn at random (peft starts it at zero: no effect)."""
    from peft import LoraConfig, get_peft_model

    model = None
    for name, (rank, targets, rslora) in (adapters or LORA_ADAPTERS).items():
        cfg = LoraConfig(
            r=rank,
            lora_alpha=2 * rank,
            target_modules=targets,
            lora_dropout=0.1,
            use_rslora=rslora,
        )
        if model is None:
            model = get_peft_model(build_model("llama"), cfg, adapter_name=name)
        else:
            model.add_adapter(name, cfg)
    torch.manual_seed(seed)
    randomize_lora_b(model)
    return model.eval()


def randomize_lora_b(model, name: str | None = None) -> None:
    for module in model.modules():
        if hasattr(module, "lora_B"):
            for adapter, lin in module.lora_B.items():
                if name is None or adapter == name:
                    torch.nn.init.normal_(lin.weight, std=0.5)


def peft_generate_alone(model, prompt: list[int], name: str | None, max_new: int) -> list[int]:
    """peft's own greedy generate of a PeftModel with one adapter (None: the base model): the
    reference a row running that adapter in a mixed batch must equal."""
    ids = torch.tensor([prompt])
    if name is None:
        with model.disable_adapter():
            out = model.generate(input_ids=ids, max_new_tokens=max_new, do_sample=False)
    else:
        model.set_adapter(name)
        out = model.generate(input_ids=ids, max_new_tokens=max_new, do_sample=False)
    return out[0, len(prompt) :].tolist()


def count_small_batch_rows(engine) -> list[int]:
    """Wrap the engine's small-batch forward so each call appends its token count to the list
    returned (the forwards the fused path ran, and their rows)."""
    fast = engine.runner.forward.small_batch
    seen: list[int] = []

    class Counting:
        max_rows = fast.max_rows

        def __call__(self, ids, pos, keep):
            seen.append(ids.shape[0])
            return fast(ids, pos, keep)

    engine.runner.forward.small_batch = Counting()
    return seen


@pytest.fixture
def peft_model():
    pytest.importorskip("peft")
    return build_peft_model


@pytest.fixture
def lora_b():
    return randomize_lora_b


def fold_lora_shrinks(monkeypatch, on: bool) -> None:
    """Every LoRA projection an Engine starts with folds its slots' A rows into its base GEMM
    (on), or none does: the tiny models' appended rows are beyond hf_paged.lora.fold's share,
    so by default they never fold (hf_paged/lora/fold.py)."""
    from hf_paged.lora import fold

    monkeypatch.setattr(fold, "MAX_EXTRA_ROWS", 1e9 if on else 0.0)


def left_padded_batch(lengths: list[int], vocab: int = VOCAB, pad: int = 0, seed: int = 0):
    """input_ids/attention_mask with left padding; tokens avoid pad/eos/bos ids."""
    g = torch.Generator().manual_seed(seed)
    longest = max(lengths)
    ids = torch.full((len(lengths), longest), pad, dtype=torch.long)
    mask = torch.zeros((len(lengths), longest), dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, longest - n :] = torch.randint(3, vocab, (n,), generator=g)
        mask[i, longest - n :] = 1
    return ids, mask


@pytest.fixture
def one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a loaded 2-core machine two torch
    threads per process make every small op wait for a core: long loops of tiny steps use one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def batch_factory():
    return left_padded_batch


@pytest.fixture(autouse=True)
def engine_invariants(monkeypatch):
    """After every test, every Engine it built must have consistent block accounting, and an
    engine with no unfinished requests must have every block free (no leaks)."""
    from hf_paged.engine import Engine

    built = []
    original_init = Engine.__init__

    def tracking_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(Engine, "__init__", tracking_init)
    yield
    for engine in built:
        engine.check_invariants()
