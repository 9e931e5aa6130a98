"""Prompt token ids in: the plain-int fast path and the general checks agree (InputProcessor)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_paged.engine.input_processor import InputProcessor


@pytest.fixture
def inputs():
    p = InputProcessor.__new__(InputProcessor)  # only what prompt_token_ids reads
    p.tokenizer, p.vocab_size = None, 100
    return p


def test_plain_ints_come_back_as_a_copy(inputs):
    prompt = [0, 5, 99, 7]
    ids = inputs.prompt_token_ids(prompt)
    assert ids == prompt and ids is not prompt
    assert inputs.prompt_token_ids((0, 5, 99)) == [0, 5, 99]
    assert inputs.prompt_token_ids([np.int64(3), 4]) == [3, 4]  # general path, same result
    assert inputs.prompt_token_ids(torch.tensor([1, 2])) == [1, 2]


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([5, 100], "outside the vocabulary"),
        ([-1, 5], "outside the vocabulary"),
        ([5, True], "must be integers"),
        ([5, 1.0], "must be integers"),
        ([], "prompt is empty"),
    ],
)
def test_bad_ids_are_refused_by_name(inputs, prompt, message):
    with pytest.raises(ValueError, match=message):
        inputs.prompt_token_ids(prompt)
