"""One forward of the model over a flat token batch: eager, compiled, or the small-batch path.

Everything that runs the model goes through ModelForward: a step's forward, the start-up
profiling and warm-up forwards, and CUDA-graph capture. One calling convention for all of them
matters: the compiled frame guards on the keyword arguments, so a call with a different set would
compile the model again.
"""

from __future__ import annotations

import inspect
import time
import warnings

import torch

from hf_paged.config import EngineConfig
from hf_paged.worker.compilation import compile_model
from hf_paged.worker.forward_context import PendingTokens, get_forward_context


class ModelForward:
    """logits = forward(input_ids [T], positions [T], keep [K]) -> [K, V], the rows of `keep`."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig, backend_name: str) -> None:
        self.model = model
        self._logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._model_forward = model
        self._undo_compile = None
        self.compiled = bool(config.compile)
        self.compile_scope = config.compile_scope if self.compiled else None
        if self.compiled:  # worker/compilation.py: whole forward or one graph for every layer
            self._model_forward, self._undo_compile = compile_model(model, config.compile_scope)
        self._compile_ok = False
        # wall seconds of the first compiled forward: where dynamo and inductor compile (the
        # token dimension is dynamic, so later token counts reuse that graph); start-up reports it
        self.compile_seconds = 0.0
        try:
            self.small_batch = self._small_batch_forward(model, config, backend_name)
        except Exception:
            self.close()
            raise

    def _small_batch_forward(self, model, config: EngineConfig, backend_name: str):
        """The fused forward for steps of <= small_batch_rows tokens, where it applies;
        small_batch_status says which (reported by evals)."""
        from hf_paged.worker.small_batch_forward import SmallBatchForward, unsupported_reason

        if not config.small_batch_rows:
            reason = "small_batch_rows=0"
        elif backend_name != "triton":
            reason = f"attention backend {backend_name!r}, not 'triton'"
        elif config.kv_cache_dtype.startswith("fp8"):  # its fused RoPE + KV write is not FP8
            reason = f"kv_cache_dtype {config.kv_cache_dtype!r}"
        else:
            reason = unsupported_reason(model)
        if reason is not None:
            self.small_batch_status = f"off ({reason})"
            return None
        from hf_paged.kernels.fused_gemv import pdl_available

        pdl = pdl_available(next(model.parameters()).device)
        self.small_batch_status = (
            f"on (steps of <= {config.small_batch_rows} tokens{', PDL' if pdl else ''})"
        )
        return SmallBatchForward(model, config.small_batch_rows, pdl, config.max_model_len)

    def __call__(
        self, input_ids: torch.Tensor | PendingTokens, positions: torch.Tensor, keep: torch.Tensor
    ) -> torch.Tensor:
        if self.small_batch is not None and positions.shape[0] <= self.small_batch.max_rows:
            return self.small_batch(input_ids, positions, keep)  # no dynamo: Triton launches only
        if isinstance(input_ids, PendingTokens):
            input_ids = input_ids.resolve()
        if self.compiled and not self._compile_ok:  # the first compiled forward compiles
            t0 = time.perf_counter()
            try:
                out = self._dispatch(input_ids, positions, keep)
            except torch._dynamo.exc.TorchDynamoException as exc:
                self.compile_seconds += time.perf_counter() - t0  # the attempt counts too
                self._fall_back_to_eager(exc)
                return self._dispatch(input_ids, positions, keep)
            self.compile_seconds += time.perf_counter() - t0
            self._compile_ok = True
            return out
        return self._dispatch(input_ids, positions, keep)

    def eager(
        self, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor
    ) -> torch.Tensor:
        """The same forward without torch.compile, for the start-up check (engine/verify.py):
        compiling there would spend a compile on shapes no step runs, and would meet a model
        torch.compile cannot handle before the first step's fallback does."""
        if self.small_batch is not None and positions.shape[0] <= self.small_batch.max_rows:
            return self.small_batch(input_ids, positions, keep)
        with torch.compiler.set_stance("force_eager"):
            return self._call_model(self.model, input_ids, positions, keep)

    def _fall_back_to_eager(self, exc: Exception) -> None:
        """torch.compile could not compile this model: run it eagerly rather than not at all,
        and say so (compile=False skips the attempt)."""
        warnings.warn(
            f"hf_paged: torch.compile failed for {type(self.model).__name__} "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); running the model "
            "without compile. Pass compile=False to skip the attempt.",
            RuntimeWarning,
            stacklevel=3,
        )
        self._undo()
        self._model_forward = self.model
        self.compiled = False
        self.compile_scope = None

    def _dispatch(self, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor):
        model = self._model_forward
        if self.compiled:
            # Dynamo specialises a size of 1 and would compile the whole model again for it
            # (~35 s for 22 layers): a lone token runs eager (graphs pad batch 1 to 2, so only
            # a mixed step of one 1-token prompt gets here) and one kept row is kept twice.
            if input_ids.shape[0] == 1:
                if self.compile_scope == "layers":  # the layers are compiled in place
                    with torch.compiler.set_stance("force_eager"):
                        return self._call_model(self.model, input_ids, positions, keep)
                model = self.model
            elif keep.shape[0] == 1:
                return self._call_model(model, input_ids, positions, keep.repeat(2))[:1]
        return self._call_model(model, input_ids, positions, keep)

    def _call_model(self, model, ids: torch.Tensor, pos: torch.Tensor, keep: torch.Tensor):
        ctx = get_forward_context()
        if ctx is not None:  # for models whose forward takes no position_ids (step_positions)
            ctx.positions = pos
        if self._logits_to_keep:
            out = model(
                input_ids=ids[None], position_ids=pos[None], use_cache=False, logits_to_keep=keep
            )
            return out.logits[0]
        out = model(input_ids=ids[None], position_ids=pos[None], use_cache=False)
        return out.logits[0, keep]

    def _undo(self) -> None:
        if self._undo_compile is not None:
            self._undo_compile()
            self._undo_compile = None

    def close(self) -> None:
        """Give the model back as it came (compiled layers undone); drop the small-batch path,
        which holds the model's modules and its rotary tables."""
        self._undo()
        self.small_batch = None
