"""One step's flat batch, built from the scheduler's ScheduledBatch and the runner's persistent
rows: token ids, positions, slots and sequence bounds on the host (numpy), then the attention
metadata and input ids on the device.

No padding: the step's tokens from every scheduled request are concatenated into one row of
input_ids/position_ids, and attention metadata tells each layer where each sequence starts and
which cache blocks it owns. One short loop over requests (row lookup, new block ids);
everything per token is vectorised.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hf_paged.core.outputs import ScheduledBatch
from hf_paged.lora.batch import LoraBatch, lora_batch
from hf_paged.worker.forward_context import AttentionMetadata, PendingTokens
from hf_paged.worker.host_to_device import to_device
from hf_paged.worker.input_batch import InputBatch


@dataclass(slots=True)
class StepInputs:
    """One step's flat batch on the host (numpy), before it is copied to the device."""

    rows: np.ndarray  # int64 [num_seqs], InputBatch rows
    starts: np.ndarray  # int64 [num_seqs], num_computed_tokens before the step
    num_sched: np.ndarray  # int64 [num_seqs]
    seq_lens: np.ndarray  # int64 [num_seqs]
    qsl: np.ndarray  # int64 [num_seqs + 1]
    total_tokens: np.ndarray  # int64 [num_seqs], known + pending tokens of each request
    positions: np.ndarray  # int64 [num_tokens]
    input_ids: np.ndarray  # int64 [num_tokens]
    slot_mapping: np.ndarray  # int64 [num_tokens]
    # tokens not on the host yet, read on the device from ModelRunner.last_tokens: sampled by
    # the previous step (asynchronous scheduling), or a draft's proposals (DeviceProposals);
    # None when there are none
    pending: np.ndarray | None  # bool [num_tokens]
    # each token's entry of last_tokens, read where it is pending: its InputBatch row, or a
    # draft proposal's entry past the rows
    source: np.ndarray  # int64 [num_tokens]
    max_blocks: int
    decode_only: bool
    any_logprobs: bool  # some request computes prompt log-probs in this step's tokens
    features: int  # every SamplingParams.features bit of the step's requests (0: plain greedy)
    # speculative decoding: proposals scheduled after each request's known tokens (the step
    # computes them too, and a request samples when it reaches the end of them); None: none
    num_spec: np.ndarray | None = None
    # a PeftModel's engine: each token's LoRA adapter slot (-1: none); None without LoRA
    lora_slots: np.ndarray | None = None  # int32 [num_tokens]


@dataclass(slots=True)
class DeviceProposals:
    """A draft model's proposals, queued on the device and not read by the host yet
    (spec_decode/draft_model.py): proposal j of the request in column c is
    ModelRunner.last_tokens[first + j * stride + c]. A verify step reads them there, so its
    host preparation and launch need not wait for the draft."""

    first: int
    stride: int
    column: dict[str, int]  # request id -> column


def prepare_inputs(
    batch: ScheduledBatch, ib: InputBatch, block_size: int, on_device: DeviceProposals | None = None
) -> StepInputs:
    num_seqs = len(batch.req_ids)
    req_to_row = ib.req_to_row
    row_list = [req_to_row[req_id] for req_id in batch.req_ids]
    rows = np.array(row_list, dtype=np.int64)
    # new block ids: a decode step's request gets one every block_size tokens, so only the
    # rows whose KV manager list grew are copied (a Python loop over every row cost ~10% of
    # a 256-row decode step's host time)
    block_ids = batch.block_ids
    lens = np.fromiter(map(len, block_ids), dtype=np.int64, count=num_seqs)
    for i in np.flatnonzero(lens > ib.num_blocks[rows]).tolist():
        ib.sync_blocks(row_list[i], block_ids[i])
    num_spec = None
    if batch.spec_token_ids:
        spec = batch.spec_token_ids
        num_spec = np.asarray([len(spec.get(r, ())) for r in batch.req_ids], dtype=np.int64)
        for i in np.flatnonzero(num_spec).tolist():  # the proposals are the step's inputs
            row, start = int(rows[i]), int(ib.num_known[rows[i]])
            ib.token_ids[row, start : start + num_spec[i]] = spec[batch.req_ids[i]]
    starts = np.asarray(batch.num_computed_tokens, dtype=np.int64)
    total_tokens = np.asarray(batch.num_tokens, dtype=np.int64)
    known = ib.num_known[rows]
    num_sched = np.asarray(batch.num_scheduled_tokens, dtype=np.int64)
    seq_lens = starts + num_sched
    qsl = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(num_sched, out=qsl[1:])
    num_tokens = int(qsl[-1])
    seq_of_token = np.repeat(np.arange(num_seqs), num_sched)
    positions = np.arange(num_tokens) - qsl[seq_of_token] + starts[seq_of_token]
    row_of_token = rows[seq_of_token]
    pending = positions >= known[seq_of_token] if bool((total_tokens > known).any()) else None
    source = row_of_token
    if on_device is not None and num_spec is not None:
        # the proposals are the step's tokens past each request's known ones (a verify step is
        # synchronous: no token of its own is pending); ib.token_ids holds placeholders there
        column = np.fromiter(
            (on_device.column.get(r, -1) for r in batch.req_ids), dtype=np.int64, count=num_seqs
        )[seq_of_token]
        ahead = positions - known[seq_of_token]
        drafted = (ahead >= 0) & (column >= 0)
        if drafted.any():
            entry = on_device.first + ahead * on_device.stride + column
            source = np.where(drafted, entry, row_of_token)
            pending = drafted if pending is None else pending | drafted
    return StepInputs(
        rows=rows,
        starts=starts,
        num_sched=num_sched,
        seq_lens=seq_lens,
        qsl=qsl,
        total_tokens=total_tokens,
        positions=positions,
        input_ids=ib.token_ids[row_of_token, positions],
        slot_mapping=ib.block_table[row_of_token, positions // block_size].astype(np.int64)
        * block_size
        + positions % block_size,
        pending=pending,
        source=source,
        max_blocks=int(ib.num_blocks[rows].max()),
        decode_only=num_tokens == num_seqs,
        any_logprobs=bool(ib.prompt_logprobs[rows].any()),
        features=int(np.bitwise_or.reduce(ib.features[rows])),
        num_spec=num_spec,
        lora_slots=None if ib.lora is None else _lora_slots(rows, num_sched, ib),
    )


def _lora_slots(rows: np.ndarray, num_sched: np.ndarray, ib: InputBatch) -> np.ndarray:
    """Each token's adapter slot, the step's adapters copied into slots where they are not
    (hf_paged.lora.routing.LoraRouting.slots_for)."""
    names = list(map(ib.adapter.__getitem__, rows.tolist()))  # (C-level loops: every step)
    used = set(names)
    used.discard(None)
    slot_of = ib.lora.slots_for(used) if used else {}
    slot_of[None] = -1
    seq_slots = np.fromiter(map(slot_of.__getitem__, names), dtype=np.int32, count=len(names))
    return np.repeat(seq_slots, num_sched)


def attention_metadata(
    step: StepInputs, ib: InputBatch, device: torch.device, host_lists: bool
) -> AttentionMetadata:
    # numpy fancy indexing: ~20 us here, where indexing the torch tensor took ~8 ms on CPU
    table = ib.block_table[step.rows, : step.max_blocks]
    return AttentionMetadata(
        query_start_loc=to_device(step.qsl.astype(np.int32), device),
        seq_lens=to_device(step.seq_lens.astype(np.int32), device),
        block_table=to_device(table, device),
        slot_mapping=to_device(step.slot_mapping, device),
        max_query_len=int(step.num_sched.max()),
        max_seq_len=int(step.seq_lens.max()),
        # host copies for the torch backend, which loops over them (the kernels read the
        # device tensors); min_query_len lets the Triton wrapper skip its decode launch when
        # a batch has no short queries
        query_start_loc_host=step.qsl.tolist() if host_lists else None,
        seq_lens_host=step.seq_lens.tolist() if host_lists else None,
        min_query_len=int(step.num_sched.min()),
    )


def device_input_ids(
    step: StepInputs, device: torch.device, last_tokens: torch.Tensor
) -> torch.Tensor | PendingTokens:
    if step.pending is None:
        return to_device(step.input_ids, device)
    # tokens only on the device (the previous step's, a draft's proposals): read from last_tokens
    source = to_device(step.source, device)
    if step.pending.all():  # the usual decode step: every input is the last sampled token
        return last_tokens[source]
    # some of each: the forward resolves them (in the small-batch forward's embedding kernel)
    pending = to_device(step.pending, device)
    return PendingTokens(to_device(step.input_ids, device), pending, source, last_tokens)


@dataclass(slots=True)
class KeptRows:
    """Which logits rows the forward computes: the last token of each request that samples
    (it reaches the end of its known + pending tokens), plus every prompt position of requests
    that asked for prompt log-probs."""

    sample_idx: np.ndarray  # int64: indices into the batch of the requests that sample
    keep: np.ndarray  # int64: token indices whose logits are computed
    # row of the logits (into keep) of each sampling request; None: they are all of keep, in order
    sample_keep: list[int] | None = None
    # prompt log-probs: (batch index, first position, count, offset into keep)
    logprob_spans: list[tuple[int, int, int, int]] | None = None
    # speculative decoding: each sampling request's first row in keep, and its row count (its
    # proposals + 1: the target's logits at its last known token and at each proposal)
    spec_first: np.ndarray | None = None
    spec_count: np.ndarray | None = None


def kept_rows(step: StepInputs, ib: InputBatch) -> KeptRows:
    qsl, starts, seq_lens = step.qsl, step.starts, step.seq_lens
    num_spec = step.num_spec
    if num_spec is not None and not step.any_logprobs:
        sample_idx = np.flatnonzero(seq_lens == step.total_tokens + num_spec)
        counts = num_spec[sample_idx] + 1
        first = np.cumsum(counts) - counts
        ends = qsl[sample_idx + 1]
        keep = (
            np.repeat(ends - counts, counts)
            + np.arange(int(counts.sum()))
            - np.repeat(first, counts)
        )
        out = KeptRows(sample_idx, keep, spec_first=first, spec_count=counts)
    elif not step.any_logprobs:  # the kept rows are exactly the sampling rows, in order
        sample_idx = np.flatnonzero(seq_lens == step.total_tokens)
        out = KeptRows(sample_idx, qsl[sample_idx + 1] - 1)
    else:
        sample_rows, sample_keep, kept, spans = [], [], [], []
        for i, row in enumerate(step.rows.tolist()):
            start, end = int(starts[i]), int(seq_lens[i])
            num_prompt = ib.sampling[row].num_prompt_tokens
            if ib.prompt_logprobs[row] and start < num_prompt - 1:
                last = min(end, num_prompt - 1)  # start..last-1 predict prompt tokens
                spans.append((i, start, last - start, len(kept)))
                kept.extend(range(int(qsl[i]), int(qsl[i]) + last - start))
            k = int(num_spec[i]) if num_spec is not None else 0
            if end == step.total_tokens[i] + k:
                sample_rows.append(i)
                sample_keep.append(len(kept))
                kept.extend(range(int(qsl[i + 1]) - 1 - k, int(qsl[i + 1])))
        out = KeptRows(
            np.asarray(sample_rows, dtype=np.int64),
            np.asarray(kept, dtype=np.int64),
            sample_keep,
            spans,
        )
        if num_spec is not None:
            out.spec_first = np.asarray(sample_keep, dtype=np.int64)
            out.spec_count = num_spec[out.sample_idx] + 1
    if not out.keep.size:  # the forward still writes K/V; its logits are unused
        out.keep = np.array([int(qsl[-1]) - 1], dtype=np.int64)
    return out


def lora_groups(step: StepInputs, ib: InputBatch, device: torch.device) -> LoraBatch | None:
    """The step's LoRA batch (hf_paged.lora): each token's adapter slot; None when no token of
    the step has an adapter."""
    if step.lora_slots is None or not (step.lora_slots >= 0).any():
        return None
    return lora_batch(step.lora_slots, ib.lora.max_loras, device)
