"""Persistent per-request state of the model runner, kept in arrays so that building a step's
inputs is a handful of vectorised numpy gathers instead of Python loops over tokens.

Each running request owns a row: its token ids (prompt + outputs) and its block ids, and its
sampling state (a SamplingRow: parameters, generator, history, caches). Rows are filled once,
from the scheduler's NewRequestData, when the runner first gets a request, and then only
appended to: a sampled token is written into the row by the runner (add_token), a new KV block
id by sync_blocks. Whatever takes a request out of the running set (finish, abort, preemption,
a rewrite of its history) releases the row; a rewritten request comes back as new data.
"""

from __future__ import annotations

import numpy as np
import torch

from hf_paged.core.outputs import NewRequestData
from hf_paged.sample.logits_processing import TokenCountPool
from hf_paged.sample.metadata import SamplingRow
from hf_paged.structured_output.logits_mask import RowMatcher as row_matcher


def sampling_row(data: NewRequestData) -> SamplingRow:
    siblings = None
    if data.siblings:
        siblings = [sampling_row(s) for s in data.siblings]
    return SamplingRow(
        req_id=data.req_id,
        params=data.sampling_params,
        generator=data.generator,
        token_ids=data.token_ids,  # NewRequestData carries a copy, the row's own from now
        num_prompt_tokens=data.num_prompt_tokens,
        stop_token_ids=data.stop_token_ids,
        banned_token_ids=data.banned_token_ids,
        bad_word_prefixes=data.bad_word_prefixes,
        siblings=siblings,
        structured=row_matcher(data.grammar, data.stop_token_ids) if data.grammar else None,
    )


class InputBatch:
    def __init__(
        self, max_num_reqs: int, max_model_len: int, block_size: int, device: torch.device
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        # Plain numpy: each step gathers its rows with numpy fancy indexing (a new array), so
        # pinning this table would buy nothing.
        self.block_table = np.zeros((max_num_reqs, self.max_blocks_per_seq), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        # bumped whenever a row changes hands: a token that lands after its step (asynchronous
        # scheduling) is written only if the row still belongs to the request that sampled it
        self.epoch = np.zeros(max_num_reqs, dtype=np.int64)
        # tokens known on the host per row (a token past them is still on the device: async)
        self.num_known = np.zeros(max_num_reqs, dtype=np.int64)
        self.features = np.zeros(max_num_reqs, dtype=np.int64)  # SamplingParams.features
        self.prompt_logprobs = np.zeros(max_num_reqs, dtype=bool)
        self.needs_history = np.zeros(max_num_reqs, dtype=bool)  # SamplingRow.needs_history
        self.sampling: list[SamplingRow | None] = [None] * max_num_reqs
        self.adapter: list[str | None] = [None] * max_num_reqs  # LoRA adapter of each row
        self.max_total = np.zeros(max_num_reqs, dtype=np.int64)  # prompt + max new tokens
        # a PeftModel's engine: its hf_paged.lora.routing.LoraRouting, which gives each step's
        # adapters their slots
        self.lora = None
        self.penalty_counts = TokenCountPool(device)  # rows of requests with a penalty
        self.req_to_row: dict[str, int] = {}
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))

    def add(self, data: NewRequestData) -> int:
        if not self.free_rows:
            raise RuntimeError("more running requests than max_num_seqs rows")
        if data.req_id in self.req_to_row:
            raise RuntimeError(f"{data.req_id} already holds a row")
        row = self.free_rows.pop()
        self.epoch[row] += 1
        tokens = data.token_ids
        self.token_ids[row, : len(tokens)] = tokens
        self.num_known[row] = len(tokens)
        self.num_blocks[row] = 0
        state = sampling_row(data)
        self.sampling[row] = state
        self.features[row] = state.features
        self.prompt_logprobs[row] = bool(data.sampling_params.prompt_logprobs)
        self.needs_history[row] = state.needs_history
        self.adapter[row] = data.sampling_params.adapter
        self.max_total[row] = data.max_total_tokens or self.max_model_len
        self.req_to_row[data.req_id] = row
        return row

    def release(self, request_id: str) -> None:
        row = self.req_to_row.pop(request_id, None)
        if row is not None:
            self.num_blocks[row] = 0
            self.epoch[row] += 1
            self.sampling[row] = None
            self.free_rows.append(row)
            self.penalty_counts.release(request_id)

    def add_tokens(self, rows: np.ndarray, positions: np.ndarray, tokens: list[int]) -> None:
        """Sampled tokens known on the host: each is its row's next input, and the next entry
        of its sampling history (for the rows whose sampling reads it). Idempotent: a token
        already in a row's history (landed early for a grammar matcher) is not added again.
        A negative token is skipped: beam rows sample nothing (beam search rewrites them)."""
        if min(tokens) < 0:
            keep = np.asarray(tokens) >= 0
            rows, positions = rows[keep], positions[keep]
            tokens = [t for t in tokens if t >= 0]
            if not tokens:
                return
        self.token_ids[rows, positions] = tokens
        self.num_known[rows] = positions + 1
        history = self.needs_history[rows]
        if history.any():
            sampling = self.sampling
            for k in np.flatnonzero(history).tolist():
                ids = sampling[int(rows[k])].token_ids
                if len(ids) == positions[k]:
                    ids.append(tokens[k])

    def add_run(self, row: int, start: int, tokens: list[int]) -> None:
        """A verify step's tokens for one row (its accepted proposals and the target's token),
        known from position start on."""
        self.token_ids[row, start : start + len(tokens)] = tokens
        self.num_known[row] = start + len(tokens)
        if self.needs_history[row]:
            self.sampling[row].token_ids.extend(tokens)

    def sync_blocks(self, row: int, block_ids: list[int]) -> None:
        """Append block ids the KV manager allocated since the last step (usually zero or one)."""
        have = int(self.num_blocks[row])
        if len(block_ids) > have:
            self.block_table[row, have : len(block_ids)] = block_ids[have:]
            self.num_blocks[row] = len(block_ids)
