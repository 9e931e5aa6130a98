"""Attention classes that call no interface and that no adapter here can run exactly: why.

Read from transformers' modelling code. A model holding one of these modules is refused at
patch() with the reason (what the class computes that paged attention over one K/V row per
token does not), rather than the generic "no adapter" message.
"""

from __future__ import annotations

import torch

# attention class name -> what it computes beyond causal softmax(Q K^T * scale) V
REASONS = {
    "BigBirdBlockSparseAttention": (
        "attention_type='block_sparse' (bidirectional block-sparse attention with random "
        "blocks); as a decoder BigBird runs 'original_full', which transformers' generate "
        "switches to itself: load it with attention_type='original_full' or call "
        "model.set_attention_type('original_full') before patching"
    ),
    "ProphetNetNgramSelfAttention": (
        "ProphetNet's n-gram self-attention: each token runs a main stream and `ngram` "
        "predicting streams, whose queries attend to the main stream's keys and to their own "
        "stream's key at the same position, with learned relative-position bucket biases "
        "(num_buckets, relative_max_distance) added to the scores; the paged cache holds one "
        "K/V row per token and the kernels add no learned bias"
    ),
    "CpmAntAttention": (
        "CPM-Ant's attention adds a learned bias from segment and relative-position buckets "
        "(CpmAntSegmentPositionEmbedding: segment_types, position_bias_num_buckets) to the "
        "scores, and the model prepends prompt_length prompt tokens to every row; the kernels "
        "add no learned bias"
    ),
    "RwkvSelfAttention": (
        "RWKV's time mixing is a recurrence (a per-layer state of numerator, denominator and "
        "maximum carried from token to token), not softmax attention over cached keys; the "
        "paged cache holds K/V rows"
    ),
    # its attention (MultiHeadAttention) is standard; the model around it is not
    "XLMModel": (
        "XLM zeroes the hidden states of a row's last n positions when n of its tokens equal "
        "pad_index (get_masks from `lengths`; its generate drops the attention mask), which in "
        "the engine's one flat row per step would hit other sequences' tokens; its attention "
        "is bidirectional unless causal=True"
    ),
}


def refusal_reason(model: torch.nn.Module) -> str | None:
    """Why the model's attention cannot be run exactly, where a class above says; else None."""
    for module in model.modules():
        cls = type(module)
        reason = REASONS.get(cls.__name__)
        if reason is not None and cls.__module__.startswith("transformers.models."):
            return f"{cls.__name__}: {reason}"
    return None
