"""transformers.pipeline(..., backend=...) once hf_paged is imported.

install() wraps transformers' `pipeline` function (as `transformers.pipeline` and
`transformers.pipelines.pipeline`): a call without `backend` goes to the original untouched;
backend="paged" or "hf" goes through hf_paged.pipeline. Code that bound `pipeline` before
importing hf_paged keeps the original (use hf_paged.pipeline there).
"""

from __future__ import annotations

import functools

_ORIGINAL = None


def original_pipeline():
    """transformers' own pipeline function, whether or not install() ran."""
    if _ORIGINAL is not None:
        return _ORIGINAL
    import transformers.pipelines

    return transformers.pipelines.pipeline


def install() -> None:
    global _ORIGINAL
    import transformers
    import transformers.pipelines

    current = transformers.pipelines.pipeline
    if getattr(current, "_hf_paged_wrapper", False):
        return
    _ORIGINAL = current

    @functools.wraps(current)
    def pipeline(*args, backend=None, **kwargs):
        if backend is None:
            return current(*args, **kwargs)
        from hf_paged.generation.pipelines import pipeline as paged_pipeline

        return paged_pipeline(*args, backend=backend, **kwargs)

    pipeline._hf_paged_wrapper = True
    transformers.pipelines.pipeline = pipeline
    transformers.pipeline = pipeline
