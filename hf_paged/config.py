"""Engine options, resolved against the model once at start-up."""

from __future__ import annotations

from dataclasses import dataclass, fields

# "auto": the model's dtype; "fp8_e4m3"/"fp8_e5m2": float8 with per-KV-head scales
# (hf_paged/quantization/kv_cache.py, docs/quantization.md)
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "float32", "fp8_e4m3", "fp8_e5m2")


@dataclass(slots=True)
class EngineConfig:
    """Every option `patch(model, **options)` and `Engine(model, **options)` accept."""

    block_size: int = 16
    # KV capacity: an explicit block count wins; else CUDA sizes it from free memory after a
    # profiling forward (gpu_memory_utilization) and CPU from cpu_kv_cache_bytes.
    num_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 1 << 30
    max_num_batched_tokens: int | None = None  # token budget per step; None: 8192 CUDA, 2048 CPU
    max_num_seqs: int = 256
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"  # or "priority": lower value first, then arrival
    attention_backend: str = "auto"  # "auto" (triton on CUDA, torch on CPU), "torch", "triton"
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype
    # FP8 KV cache: one scale for every layer's K and V (stored = K / scale); None: calibrated
    # per KV head of each layer at start-up (hf_paged/quantization/kv_cache.py)
    kv_cache_scale: float | None = None
    # "fp8": the model's linear layers (not lm_head) quantised to float8_e4m3 with a scale per
    # output row and 128 input columns at start-up, the originals released
    # (hf_paged/quantization/fp8_weights.py);
    # the model keeps them after the engine. None: the weights as loaded.
    quantization: str | None = None
    # CUDA only: capture the whole forward of pure-decode batches per batch-size bucket
    cuda_graphs: bool = True
    max_graph_batch_size: int = 512  # buckets 1, 2, 4, 8, 16, 32, 48, ... up to this
    # CUDA graphs also for mixed prefill/decode steps of up to this many tokens (buckets 32, 64,
    # 96, 128, 192, ... 512, 640, ... 1024, 1280, ...; capped by max_num_batched_tokens); larger
    # steps, and steps that need prompt log-probs, run op by op. 0: mixed steps never use graphs.
    max_graph_tokens: int = 2048
    # torch.compile (inductor) of the model forward; None: on for CUDA, off on CPU. Measured on
    # the H200 (TinyLlama-1.1B shape, W1, CUDA graphs, engine only, 2026-11-29): 42k output
    # tokens/s against 31k eager.
    compile: bool | None = None
    # "layers": each decoder layer compiled, all sharing one graph: start-up of one layer's
    # compile (H200, 1.1B shape, 2026-11-29: 12 s against 77 s for "model"), same W1 speed
    # (42.5k vs 42.7k tokens/s). "model": one graph for the whole forward. worker/compilation.py
    compile_scope: str = "layers"
    # Overlap: schedule and launch step n+1 before step n's tokens reach the host (they are read
    # on the device); stop checks run one step late, so a request that stops computes one token
    # more, which is dropped. Steps with a request whose sampling reads its token history on the
    # host (penalties, n-gram bans, bad-word prefixes, min_tokens, user processors, logprobs,
    # scores, n > 1, beams, prompt logprobs) run synchronously. H200, 1.1B shape: W1 42.5k ->
    # 57.6k tokens/s, batch-1 483 -> 575 tokens/s. Engine.step() then reports each step's
    # tokens on the following call.
    async_scheduling: bool = True
    # q/k/v and gate/up projections as one matmul each (integrations/fused_projections.py); the
    # model is put back by Engine.shutdown / unpatch, and state_dict() keeps the original names
    # meanwhile. H200, 1.1B shape: batch-1 GPU time per step 1.52 -> 1.22 ms.
    fuse_projections: bool = True
    # Steps of at most this many tokens (1-8) run worker/small_batch_forward.py: each decoder
    # layer as six fused Triton launches (RMSNorm in the GEMV, residual adds and SiLU-mul in its
    # epilogue, RoPE with the KV write) instead of transformers' forward, on models it supports
    # (Llama, Mistral, Qwen2 with fused projections and the Triton attention backend; others run
    # transformers' forward). 0: off. H200, 1.1B shape, 2026-11-29, decode ms/step fused vs
    # transformers' forward: batch 1 0.96 vs 1.38, 2: 1.34 vs 1.40, 4: 1.92 vs 1.41, 8: 3.12 vs
    # 1.44, when every GEMV walked the rows one by one. Steps of 3+ rows now take tensor cores
    # (kernels/fused_gemm_rows.py): H100, Llama-3-8B shape, 6 rows, the products of a layer
    # 185 us against 383 row by row and 170 for cuBLAS's (which leave the norms, gate and
    # residual to further kernels); a 6-token speculative verify step through it gains nothing
    # measurable (1.75x against 1.73x, evals/RESULTS.md). Hence still 2.
    small_batch_rows: int = 2
    # At start-up, one short paged forward (two prompts, then a decode step) against
    # transformers' own forward; a mismatch beyond the dtype's rounding, or a forward that
    # fails, is refused with a ValueError (hf_paged/engine/verify.py). The tiny test models on
    # CPU: 10-23 ms (torch backend); 0.4-2.8 s under the Triton interpreter.
    verify_model: bool = True
    # Speculative decoding with a draft model (hf_paged/spec_decode/): any causal LM sharing the
    # target's vocabulary. It proposes up to num_speculative_tokens tokens a step for every
    # request, the target verifies them in one forward (output exactly the target's), and the
    # engine picks k per step from the batch size and the measured acceptance (0: speculation
    # off for that step). Its KV cache shares the target's block table.
    draft_model: object | None = None
    num_speculative_tokens: int = 5  # the largest k (draft model and prompt lookup)
    # "auto": k per step from the batch size and measured acceptance (spec_decode/policy.py);
    # "fixed": always num_speculative_tokens (a request's own limits aside)
    speculative_policy: str = "auto"
    # Multi-LoRA (a PeftModel, hf_paged/lora): adapters are copied into this many slots of
    # stacked device buffers on first use; more distinct adapters among live requests than
    # slots is refused when a request is added (ValueError naming max_loras). docs/lora.md
    max_loras: int = 8
    # the largest adapter rank the slots hold (smaller ranks are zero-padded); None: the
    # largest rank among the model's adapters at start-up
    max_lora_rank: int | None = None
    # Tensor parallelism (hf_paged/distributed, docs/tensor_parallel.md): the model split over
    # this many devices of one host, one process each (rank 0 is the caller's). Steps then run
    # without CUDA graphs, torch.compile or the small-batch forward.
    tensor_parallel_size: int = 1
    # "auto": the model's device type; "cuda": ranks on cuda:0..N-1 (a model loaded on the CPU
    # streams its shards there); "cpu": gloo processes on the CPU
    tensor_parallel_device: str = "auto"

    def __post_init__(self) -> None:
        def positive(name: str, value) -> None:
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        for name in (
            "cuda_graphs",
            "enable_prefix_caching",
            "enable_chunked_prefill",
            "async_scheduling",
            "fuse_projections",
            "verify_model",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.compile is not None and not isinstance(self.compile, bool):
            raise ValueError(f"compile must be True, False or None (auto), got {self.compile!r}")
        if self.compile_scope not in ("model", "layers"):
            raise ValueError(
                f"compile_scope must be 'model' or 'layers', got {self.compile_scope!r}"
            )
        positive("block_size", self.block_size)
        positive("num_blocks", self.num_blocks)
        positive("max_num_batched_tokens", self.max_num_batched_tokens)
        positive("max_num_seqs", self.max_num_seqs)
        positive("max_model_len", self.max_model_len)
        positive("cpu_kv_cache_bytes", self.cpu_kv_cache_bytes)
        positive("max_graph_batch_size", self.max_graph_batch_size)
        positive("num_speculative_tokens", self.num_speculative_tokens)
        positive("tensor_parallel_size", self.tensor_parallel_size)
        if self.tensor_parallel_device not in ("auto", "cpu", "cuda"):
            raise ValueError(
                "tensor_parallel_device must be 'auto', 'cpu' or 'cuda', "
                f"got {self.tensor_parallel_device!r}"
            )
        if self.speculative_policy not in ("auto", "fixed"):
            raise ValueError(
                f"speculative_policy must be 'auto' or 'fixed', got {self.speculative_policy!r}"
            )
        if self.draft_model is not None and not hasattr(self.draft_model, "parameters"):
            raise ValueError(
                f"draft_model must be a transformers causal LM, got {type(self.draft_model)}"
            )
        positive("max_loras", self.max_loras if self.max_loras is not None else 0)
        positive("max_lora_rank", self.max_lora_rank)
        if (
            not isinstance(self.small_batch_rows, int)
            or isinstance(self.small_batch_rows, bool)
            or not 0 <= self.small_batch_rows <= 8
        ):
            raise ValueError(
                f"small_batch_rows must be an integer from 0 to 8, got {self.small_batch_rows!r}"
            )
        if (
            not isinstance(self.max_graph_tokens, int)
            or isinstance(self.max_graph_tokens, bool)
            or self.max_graph_tokens < 0
        ):
            raise ValueError(
                f"max_graph_tokens must be a non-negative integer, got {self.max_graph_tokens!r}"
            )
        if not isinstance(self.gpu_memory_utilization, (int, float)) or isinstance(
            self.gpu_memory_utilization, bool
        ):
            raise ValueError(
                f"gpu_memory_utilization must be a number, got {self.gpu_memory_utilization!r}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.kv_cache_scale is not None:
            s = self.kv_cache_scale
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 < s < float("inf"):
                raise ValueError(f"kv_cache_scale must be a positive finite float, got {s!r}")
            if not self.kv_cache_dtype.startswith("fp8"):
                raise ValueError(
                    f"kv_cache_scale applies to an FP8 KV cache only; kv_cache_dtype is "
                    f"{self.kv_cache_dtype!r}"
                )
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be None or 'fp8', got {self.quantization!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(
                f"attention_backend must be 'auto', 'torch' or 'triton', "
                f"got {self.attention_backend!r}"
            )

    @classmethod
    def from_options(cls, **options) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        return cls(**options)

    def resolve_for(self, model) -> None:
        """Fill the options left to the model and device (max_model_len from the model config;
        the token budget and compile from the device) and refuse what the model cannot do."""
        text = model.config.get_text_config()
        # MPT names it max_seq_len (the length its ALiBi table is built for)
        model_max = getattr(text, "max_position_embeddings", None) or getattr(
            text, "max_seq_len", None
        )
        if self.max_model_len is None:
            if model_max is None:
                raise ValueError(
                    "max_model_len: the model config has no max_position_embeddings (ALiBi "
                    "models such as Bloom have no length limit): pass max_model_len="
                )
            self.max_model_len = model_max
        elif model_max is not None and self.max_model_len > model_max:
            # positions past the trained range give wrong output, silently (as vLLM, refused)
            raise ValueError(
                f"max_model_len ({self.max_model_len}) exceeds the model's "
                f"max_position_embeddings ({model_max})"
            )
        on_cuda = next(model.parameters()).device.type == "cuda"
        if self.tensor_parallel_size > 1:
            on_cuda = self.tensor_parallel_device == "cuda" or (
                on_cuda and self.tensor_parallel_device == "auto"
            )
            if self.compile:  # collectives inside compiled graphs: not built yet
                raise ValueError("compile=True is not supported with tensor_parallel_size > 1")
            self.compile, self.cuda_graphs, self.small_batch_rows = False, False, 0
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 8192 if on_cuda else 2048
        if self.compile is None:  # CPU: inductor's C++ compile costs more than it saves
            self.compile = on_cuda
        if not self.enable_chunked_prefill:
            self.max_num_batched_tokens = max(self.max_num_batched_tokens, self.max_model_len)
