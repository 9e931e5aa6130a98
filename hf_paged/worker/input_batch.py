"""Persistent per-request state of the model runner, kept in arrays so that building a step's
inputs is a handful of vectorised numpy gathers instead of Python loops over tokens.

Each running request owns a row: its token ids (prompt + outputs) and its block ids. Rows are
filled once when a request starts running and then only appended to: a sampled token is written
into the row by the runner, a new KV block id by sync_blocks. Preemption, finish and abort release
the row.
"""

from __future__ import annotations

import numpy as np

from hf_paged.core.request import Request


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int) -> None:
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
        self.req_to_row: dict[str, int] = {}
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))

    def row_of(self, request: Request) -> int:
        row = self.req_to_row.get(request.request_id)
        if row is None:
            row = self._add(request)
        return row

    def _add(self, request: Request) -> int:
        if not self.free_rows:
            raise RuntimeError("more running requests than max_num_seqs rows")
        row = self.free_rows.pop()
        self.epoch[row] += 1
        tokens = request.all_token_ids
        self.token_ids[row, : len(tokens)] = tokens
        self.num_blocks[row] = 0
        self.req_to_row[request.request_id] = row
        return row

    def release(self, request_id: str) -> None:
        row = self.req_to_row.pop(request_id, None)
        if row is not None:
            self.num_blocks[row] = 0
            self.epoch[row] += 1
            self.free_rows.append(row)

    def sync_blocks(self, row: int, block_ids: list[int]) -> None:
        """Append block ids the KV manager allocated since the last step (usually zero or one)."""
        have = int(self.num_blocks[row])
        if len(block_ids) > have:
            self.block_table[row, have : len(block_ids)] = block_ids[have:]
            self.num_blocks[row] = len(block_ids)
