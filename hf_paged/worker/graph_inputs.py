"""The CUDA graphs' per-step inputs (hf_paged/worker/cuda_graphs.py): one device buffer that every
graph reads its inputs from, and the host's one copy into it per step.

Per step the host sends a graph's inputs in one copy, packed into one byte buffer
(`_packed_layout`: token ids, their rows, positions, slots, sequence lengths, the block table
rows, for mixed graphs query starts and kept rows, for decode graphs the greedy tokens' host
landing row) laid out per graph; a graph whose block table rows exceed PACKED_TABLE_BYTES gets
them in a second copy, only their used columns. Each graph reads its inputs from views of that
buffer at its own offsets, and takes a token sampled by the step before
(asynchronous scheduling) from the runner's last_tokens on the device, inside the graph. Before
this, a batch-1 step ran eleven copies and small kernels around its graph, ~2.5 us each with the
gaps between them (H200 timeline, evals/profiling/engine_bench.py --kernels).

A decode graph whose block table is packed moves its own inputs on by a token during its replay
(cuda_graphs.py); send_decode() then skips the next step's copy when its inputs are exactly
those (same rows, positions one further, same blocks). The host still builds the step's inputs,
and sends them unless they equal what the device holds. Why: the copy and the gaps around it
were ~4.7 us of a 0.73 ms step on the H200; skipping it measured ~0.2% at the 1.1B batch 1
(kernels/argmax.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hf_paged.worker.host_to_device import pinned

# A graph whose block table rows (sequences x max_blocks_per_seq int32) fit in this many bytes
# takes them inside its packed inputs, so a step sends one copy instead of two (each copy ~1 us
# plus ~2 us of gap at batch 1 on the H200); a larger table is sent on its own, only its used
# columns (the packed copy would send every column of every row).
PACKED_TABLE_BYTES = 16384

GraphKey = tuple[str, int]  # ("decode", batch bucket) or ("mixed", token bucket)


def _packed_layout(kind: str, tokens: int, seqs: int, table_width: int = 0, lora: bool = False):
    """A graph's packed per-step inputs: (name -> (byte offset, dtype, length), total bytes),
    every field 8-byte aligned. table_width > 0: the block table rows too ([seqs, width]);
    lora: each token's LoRA adapter slot too."""
    fields = [
        ("input_ids", torch.long, tokens),  # from the host (tokens it already has)
        # each token's entry of last_tokens (StepInputs.source): its InputBatch row, where a
        # decode graph also writes its greedy token; a draft's proposal past the rows
        ("rows", torch.long, tokens),
        ("positions", torch.long, tokens),
        ("slot_mapping", torch.long, tokens),
        ("seq_lens", torch.int32, seqs),
        ("pending", torch.bool, tokens),  # the token is read on the device: last_tokens[rows]
    ]
    if kind == "mixed":
        fields += [("keep", torch.long, seqs), ("query_start_loc", torch.int32, seqs + 1)]
    else:  # which of the two host landing rows the in-graph greedy tokens go to, and the
        # positions sent (the landing row alternates with every device-advanced step since)
        fields += [("host_slot", torch.long, 1), ("sent_pos", torch.long, tokens)]
    if table_width:
        fields += [("block_table", torch.int32, seqs * table_width)]
    if lora:  # -1: no adapter (hf_paged/lora/batch.py)
        fields += [("lora_slots", torch.int32, tokens)]
    layout, offset = {}, 0
    for name, dtype, length in fields:
        layout[name] = (offset, dtype, length)
        offset += -(-length * dtype.itemsize // 8) * 8
    return layout, offset


# what padded entries hold (capture and every step): padded tokens write no K/V (slot -1),
# padded decode rows attend to one key, and padded tokens belong to no InputBatch row (-1: the
# decode graph's greedy tokens are not written into last_tokens for them; they take no device
# token, pending False, so the embedding kernel never reads last_tokens[-1] and
# PendingTokens.resolve's torch gather, which wraps -1 to the last row, discards it);
# everything else 0 (keep row 0)
_PAD = {"slot_mapping": -1, "seq_lens": 1, "rows": -1, "lora_slots": -1}


def _views(buf: torch.Tensor, layout: dict, table_width: int) -> dict[str, torch.Tensor]:
    views = {name: buf[o : o + n * d.itemsize].view(d) for name, (o, d, n) in layout.items()}
    if "block_table" in views:
        views["block_table"] = views["block_table"].view(-1, table_width)
    return views


class PackedGraphInputs:
    """Every graph's static inputs on the device (`inputs[key]`: name -> view) and their per-step
    refill from the host. graphs: each graph's key -> its number of sequence rows; table_width:
    the block table's columns (max_blocks_per_seq); lora: the model has LoRA layers (each
    token's adapter slot is an input)."""

    def __init__(
        self,
        graphs: dict[GraphKey, int],
        table_width: int,
        device: torch.device,
        block_size: int,
        lora: bool = False,
    ) -> None:
        self.device = device
        self.block_size = block_size
        seqs = max(graphs.values())
        # the block tables too large for the packed copy: one buffer, sent on its own
        self._table = torch.zeros((seqs, table_width), dtype=torch.int32, device=device)
        self._rows = dict(graphs)
        packed = {}
        for (kind, size), rows in graphs.items():
            in_packed = rows * table_width * 4 <= PACKED_TABLE_BYTES
            packed[(kind, size)] = _packed_layout(
                kind, size, rows, table_width if in_packed else 0, lora
            )
        self.layouts = {key: layout for key, (layout, _) in packed.items()}
        self.nbytes = {key: nbytes for key, (_, nbytes) in packed.items()}
        nbytes = max(self.nbytes.values())
        # every graph's packed inputs start at byte 0 of one device buffer; the host fills one
        # of two alternating pinned twins (a step's copy may still be reading the other), through
        # numpy views made once here: a step only writes values into them
        self.packed = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self._views = {
            key: _views(self.packed, layout, table_width) for key, layout in self.layouts.items()
        }
        pin = device.type == "cuda"
        self._host = [torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        self._host_inputs = [
            {
                key: {name: t.numpy() for name, t in _views(buf, layout, table_width).items()}
                for key, layout in self.layouts.items()
            }
            for buf in self._host
        ]
        # recorded after each twin's copy: the host waits on it before refilling that twin
        self._host_done = [torch.cuda.Event() for _ in self._host] if pin else None
        self._flip = 0
        self._held: _Held | None = None  # what the device's packed inputs hold, if advanced
        self.sends_skipped = 0

    def __getitem__(self, key: GraphKey) -> dict[str, torch.Tensor]:
        """The graph's inputs on the device, by name (the views its capture reads)."""
        return self._views[key]

    def packs_table(self, key: GraphKey) -> bool:
        """Whether the graph's block table rows travel in its packed inputs."""
        return "block_table" in self._views[key]

    def block_table(self, key: GraphKey) -> torch.Tensor:
        """The block table rows the graph reads: packed, or the rows of the separate buffer."""
        return self._views[key].get("block_table", self._table[: self._rows[key]])

    def reset_padding(self, key: GraphKey) -> None:
        """Padding values everywhere: what capture runs on (nothing is written)."""
        for name, t in self._views[key].items():
            t.fill_(_PAD.get(name, 0))

    def send_decode(
        self, step, key: GraphKey, table: np.ndarray, host_slot: int, advances: bool
    ) -> None:
        """send() a decode step's inputs, unless the graph moves its inputs on (`advances`) and
        the device already holds this step's: then nothing is copied, and what the coming replay
        leaves is recorded for the next step."""
        if advances and self._device_holds(step, table):
            self.sends_skipped += 1
        else:
            self.send(step, key, len(step.rows), table, host_slot=host_slot)
        # what the replay leaves in the packed inputs: each row's input token is the greedy token
        # it drew (the advance writes it into input_ids, and last_tokens has it too)
        if advances:
            from_device = step.pending is not None and bool(step.pending.all())
            self._held = _Held(step.rows.copy(), step.positions + 1, table, from_device)

    def holds_run(self, step, n: int) -> bool:
        """True when the decode replay of `step` just left its inputs moved on (every input
        token read on the device) and n more replays stay within the block table columns it
        sent: replay j computes position positions + j, whose block must be in the table."""
        held = self._held
        return (
            held is not None
            and np.array_equal(step.rows, held.rows)
            and np.array_equal(step.positions + 1, held.positions)
            and bool((step.positions + n < held.table.shape[1] * self.block_size).all())
        )

    def moved_on(self, n: int) -> None:
        """n replays more moved the held inputs on n positions (CudaGraphRunner.decode_again)."""
        self._held.positions = self._held.positions + n

    def _device_holds(self, step, table: np.ndarray) -> bool:
        """True when the packed inputs on the device, as the last decode replay moved them on,
        are this decode step's: the same rows (so the same graph), every input a token sampled
        on the device (pending) in that replay's step and in this one, the positions one
        further, and the same block table (`table`, the step's rows and used columns) whose
        columns already hold the new positions (so the device's slots are the host's). Any
        send since that replay (another graph's inputs share the buffer) has cleared what it
        held. (A row whose token came from the host holds the greedy token it drew, which a
        sampler may have replaced in last_tokens since: such a step is sent.)"""
        held = self._held
        return (
            held is not None
            and held.from_device
            and step.pending is not None
            and bool(step.pending.all())
            and np.array_equal(step.rows, held.rows)
            and np.array_equal(step.positions, held.positions)
            and bool((step.positions < step.max_blocks * self.block_size).all())
            and np.array_equal(table, held.table)
        )

    def send(
        self, step, key: GraphKey, count: int, table: np.ndarray, keep=None, host_slot: int = 0
    ) -> None:
        """Fill the graph's packed inputs (padding included) on the host and send them in one
        copy (the block table rows in a second where they are not packed). count: the step's
        tokens; table: its block table rows (used columns); keep: a mixed graph's kept token
        indices; host_slot: a decode graph's landing row for its greedy tokens."""
        self._held = None  # send_decode records what a decode replay leaves, after this
        self._flip ^= 1
        if self._host_done is not None:
            self._host_done[self._flip].synchronize()  # its copy two steps ago: long finished
        h = self._host_inputs[self._flip][key]
        nbytes = self.nbytes[key]
        batch = len(step.rows)
        for name, values in (
            ("input_ids", step.input_ids),
            ("rows", step.source),
            ("positions", step.positions),
            ("slot_mapping", step.slot_mapping),
            ("pending", step.pending if step.pending is not None else False),
        ):
            h[name][:count] = values
            h[name][count:] = _PAD.get(name, 0)
        if "lora_slots" in h:
            h["lora_slots"][:count] = -1 if step.lora_slots is None else step.lora_slots
            h["lora_slots"][count:] = -1
        h["seq_lens"][:batch] = step.seq_lens
        h["seq_lens"][batch:] = _PAD["seq_lens"]
        packed_table = h.get("block_table")
        if packed_table is not None:
            packed_table[:batch, : step.max_blocks] = table
            # padded rows read one key of their first block: block 0, not whatever another
            # graph's layout left in these bytes of the twin
            packed_table[batch:, 0] = 0
        kind = key[0]
        if kind == "decode":
            h["host_slot"][0] = host_slot
            h["sent_pos"][:count] = step.positions
            h["sent_pos"][count:] = 0
        if kind == "mixed":
            # sequences past the real ones are empty: they start at the end of the real tokens
            h["query_start_loc"][:] = count
            h["query_start_loc"][: batch + 1] = step.qsl
            h["keep"][: len(keep)] = keep
            h["keep"][len(keep) :] = 0
        self.packed[:nbytes].copy_(self._host[self._flip][:nbytes], non_blocking=True)
        if self._host_done is not None:
            self._host_done[self._flip].record()
        if packed_table is None:
            self._table[:batch, : step.max_blocks].copy_(
                pinned(table, self.device), non_blocking=True
            )


@dataclass(slots=True)
class _Held:
    """A decode graph's packed inputs on the device after its replay moved them on a token."""

    rows: np.ndarray  # InputBatch rows, in order
    positions: np.ndarray  # the positions the next step must have
    table: np.ndarray  # the block table rows (used columns) the device holds
    # every row of the replayed step read its input token on the device (pending)
    from_device: bool
