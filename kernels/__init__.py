"""Triton kernels for hf_paged (installed as hf_paged.kernels), each with a pure-torch *_ref.

Never import this directory as a top-level `kernels`: that name belongs to a PyPI package that
transformers probes for hub kernels.

Importing is cheap and needs no GPU: @triton.jit only records the functions; compilation happens
at the first launch. For CPU tests set TRITON_INTERPRET=1 before importing (Triton reads it when
the kernels are decorated).
"""

from .argmax import argmax_rows
from .decode_attention import decode_attention
from .embedding import embed_tokens, embed_tokens_ref
from .fused_gemm_rows import fused_gemm_rows
from .fused_gemv import ROW_SERIAL_ROWS, fused_gemv, fused_gemv_ref, tensor_core_rows
from .kv_write import write_kv, write_kv_ref
from .lora import (
    lora_expand,
    lora_expand_ref,
    lora_segments,
    lora_shrink,
    lora_shrink_ref,
)
from .lora_epilogue import LoraEpilogue, lora_rows_shrink
from .paged_attention import paged_attention, paged_attention_ref
from .qkv_rope import norm_qkv_rope, norm_qkv_rope_ref
from .residual_norm import residual_rms_norm, residual_rms_norm_ref
from .rope_kv import rope_write_kv, rope_write_kv_ref

__all__ = [
    "ROW_SERIAL_ROWS",
    "LoraEpilogue",
    "argmax_rows",
    "decode_attention",
    "embed_tokens",
    "embed_tokens_ref",
    "fused_gemm_rows",
    "fused_gemv",
    "fused_gemv_ref",
    "lora_expand",
    "lora_expand_ref",
    "lora_rows_shrink",
    "lora_segments",
    "lora_shrink",
    "lora_shrink_ref",
    "norm_qkv_rope",
    "norm_qkv_rope_ref",
    "paged_attention",
    "paged_attention_ref",
    "residual_rms_norm",
    "residual_rms_norm_ref",
    "rope_write_kv",
    "rope_write_kv_ref",
    "tensor_core_rows",
    "write_kv",
    "write_kv_ref",
]
