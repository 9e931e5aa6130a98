"""Triton kernels for hf_paged (installed as hf_paged.kernels), each with a pure-torch *_ref.

Never import this directory as a top-level `kernels`: that name belongs to a PyPI package that
transformers probes for hub kernels.
"""

from .kv_write import write_kv_ref
from .paged_attention import paged_attention_ref

__all__ = ["paged_attention_ref", "write_kv_ref"]
