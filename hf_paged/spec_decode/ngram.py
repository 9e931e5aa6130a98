"""Prompt lookup (n-gram) proposals, with transformers' meaning of `prompt_lookup_num_tokens`
and `max_matching_ngram_size` (PromptLookupCandidateGenerator): for n from the largest size down
to 1, find the first earlier occurrence of the request's last n tokens in its own tokens (prompt
and output) that has a continuation, and propose up to k tokens that followed it.

The search is numpy over each request's token row (a sliding-window comparison), so a step costs a
few array operations per proposing request and nothing per token in Python.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: np.ndarray, max_ngram: int, k: int) -> list[int]:
    """tokens: int64 [L], a request's known tokens. Up to k proposed tokens (possibly none)."""
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), 0, -1):
        windows = sliding_window_view(tokens[: length - 1], n)  # starts 0 .. L-1-n
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if hits.size:
            # earliest match with a continuation (every window here ends before the last token)
            start = int(hits[0]) + n
            return tokens[start : min(start + k, length)].tolist()
    return []
