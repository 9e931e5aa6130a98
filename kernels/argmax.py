"""Row-wise argmax of logits: the greedy token of each row, as torch.argmax(dim=-1) picks it.

Why: at batch 1 the step's greedy argmax over a 32,000-entry row took 11.3-12.5 us on the H200
in torch's reduction kernel (one block walks the row; 1.1B shape, 2026-11-30), about
1.5% of the 0.78 ms step, while the row is 64 KB. Here one program takes a row in chunks of up
to 32K entries, each loaded in one go (for a 32,000 vocabulary: one load round trip and an
in-register reduction).

Same answer as torch.argmax: the first index of the maximum, and NaN counts as the maximum (the
first NaN's index), so a row of -inf (every token masked) gives 0 as torch does.

Options that serve the decode CUDA graph (hf_paged/worker/cuda_graphs.py), which takes its greedy
tokens inside the graph:

- scatter=(dst, rows): also dst[rows[i]] = token of row i, in the same kernel. With asynchronous
  scheduling the next step reads each row's token from the runner's last_tokens on the device;
  a separate index_copy_ took 1.8 us and the 1.3 us gap before it at batch 1 (H200 timeline).
  A row index outside [0, len(dst)) writes nothing: the graph pads its rows with -1.
- pdl=True (Hopper): programmatic dependent launch, as kernels/fused_gemv.py does it. The lm_head
  GEMV before it lets it launch early; it waits (griddepcontrol.wait) before loading the logits,
  so its launch and ramp overlap the GEMV's tail (with advance, also its loads of the graph's
  step inputs, below).
- host=(buf, slot): also buf[slot, i] = token of row i, buf being pinned host memory the kernel
  writes over the bus (Triton takes a pinned tensor's pointer). The host reads the tokens after
  an event, with no device-to-host copy behind the graph.
- advance=DecodeAdvance(...): also moves the graph's own inputs on by one token for each real
  row (position, sequence length, cache slot from the block table), so the next step of the
  same rows needs no copy from the host while it stays inside its blocks. H200, 1.1B batch 1,
  interleaved A/B over 3 rounds (2026-11-30): 1,387-1,391 tok/s with it against 1,384-1,388,
  a consistent ~0.2%. These inputs, rows and the host slot are the graph's step
  inputs, which no kernel of the step writes: with pdl they are read before the wait.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .fused_gemv import gdc_launch_dependents, gdc_wait, pdl_available
from .host_math import cdiv, next_power_of_2
from .kv_write import check_launchable

_MAX_BLOCK = 32768  # entries a program loads at once: 64 fp32 registers a thread at 16 warps


@triton.jit
def _argmax_rows_kernel(
    x_ptr,
    out_ptr,
    rows_ptr,
    dst_ptr,
    host_ptr,
    slot_ptr,
    pos_ptr,  # ADVANCE: int64 [M] positions, int32 [M] sequence lengths, int64 [M] cache slots
    seq_ptr,
    slot_map_ptr,
    table_ptr,  # int32 [M, W] block table rows
    sent_ptr,  # int64 [M]: the positions the host last sent
    ids_ptr,  # IDS: int64 [M] the rows' input tokens
    bits_ptr,  # ALLOWED: int32 [M, ceil(V / 32)] bitmask rows, a bit a token
    on_ptr,  # ALLOWED_ROWS: int32 [M], nonzero where the row's bitmask applies
    V,
    D,
    W,
    stride_xm,
    stride_host,
    stride_table,
    stride_bits,
    BLOCK: tl.constexpr,
    CHUNKS: tl.constexpr,
    SCATTER: tl.constexpr,
    HOST: tl.constexpr,
    ADVANCE: tl.constexpr,
    IDS: tl.constexpr,
    PAGE: tl.constexpr,
    PDL: tl.constexpr,
    ALLOWED: tl.constexpr,
    ALLOWED_ROWS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    if PDL:
        gdc_launch_dependents()
    if ADVANCE:
        # A decode graph's step inputs (the host's copy in front of the graph's first, ordinary
        # launch, or the previous replay's advance), which nothing in this step's PDL chain
        # writes: read before the wait, so that after the argmax only stores remain (read
        # after it, they were two dependent round trips, pos then the table, on the step's tail)
        d = tl.load(rows_ptr + row)
        real = d >= 0
        pos = tl.load(pos_ptr + row)
        # the host landing row alternates with every step since the host's last copy
        slot = (tl.load(slot_ptr) + pos - tl.load(sent_ptr + row)) % 2
        nxt = pos + 1
        page = tl.minimum(nxt // PAGE, W - 1)  # past the table: the host sends (never used)
        block = tl.load(table_ptr + row * stride_table + page, mask=real, other=0)
    if PDL:
        # x (and, without ADVANCE, rows) come from earlier kernels
        gdc_wait()
    offs = tl.arange(0, BLOCK)
    if ALLOWED_ROWS:  # a row whose bitmask does not apply takes every token
        free = tl.load(on_ptr + row) == 0
    best_val = float("-inf")
    best_idx = 0
    first_nan = V  # V: no NaN seen
    for c in tl.static_range(CHUNKS):
        idx = c * BLOCK + offs
        mask = idx < V
        x = tl.load(x_ptr + row * stride_xm + idx, mask=mask, other=float("-inf")).to(tl.float32)
        if ALLOWED:  # a token whose bit is 0 is -inf, as the grammar's masked logits have it
            words = tl.load(bits_ptr + row * stride_bits + idx // 32, mask=mask, other=-1)
            keep = ((words >> (idx % 32)) & 1) != 0
            if ALLOWED_ROWS:
                keep = keep | free
            x = tl.where(keep, x, float("-inf"))
        nan = x != x  # a row with a NaN answers its first NaN, whatever the maxima say
        first_nan = tl.minimum(first_nan, tl.min(tl.where(nan, idx, V), axis=0))
        m = tl.max(x, axis=0)
        i = tl.argmax(x, axis=0, tie_break_left=True) + c * BLOCK
        # strictly greater: an equal maximum in a later chunk keeps the earlier index
        better = m > best_val
        best_idx = tl.where(better, i, best_idx)
        best_val = tl.where(better, m, best_val)
    token = tl.where(first_nan < V, first_nan, best_idx).to(tl.int64)
    tl.store(out_ptr + row, token)
    if not ADVANCE:
        real = True  # a row of the batch, not graph padding
        if SCATTER:
            d = tl.load(rows_ptr + row)
            real = d >= 0
        if HOST:
            slot = tl.load(slot_ptr)
    if SCATTER:
        inside = real & (d < D)  # padding (-1) writes nothing
        tl.store(dst_ptr + tl.where(inside, d, 0), token, mask=inside)
    if HOST:  # pinned host memory, written over the bus: host[slot, row]
        tl.store(host_ptr + slot * stride_host + row, token, mask=real)
    if ADVANCE:
        # this row's inputs for its next decode step, should the host not send new ones
        tl.store(pos_ptr + row, nxt, mask=real)
        tl.store(seq_ptr + row, (nxt + 1).to(tl.int32), mask=real)
        tl.store(slot_map_ptr + row, block.to(tl.int64) * PAGE + nxt % PAGE, mask=real)
        if IDS:
            tl.store(ids_ptr + row, token, mask=real)


@dataclass(frozen=True)
class DecodeAdvance:
    """A decode CUDA graph's inputs that argmax_rows(advance=...) moves on by one token for
    each real row (rows[i] >= 0), so the next step of the same rows needs no copy from the
    host (hf_paged/worker/cuda_graphs.py): positions += 1, seq_lens += 1, slot_mapping from the
    block table at the new position. The host landing row then alternates from the host's slot with
    every step since the host last sent positions (sent_positions). input_ids: also the row's
    input token, set to the token drawn, so a row whose token came from the host (not read from
    the scattered tokens) feeds the drawn one to the next step too."""

    positions: torch.Tensor  # int64 [M]
    seq_lens: torch.Tensor  # int32 [M]
    slot_mapping: torch.Tensor  # int64 [M]
    block_table: torch.Tensor  # int32 [M, W]
    sent_positions: torch.Tensor  # int64 [M]
    page_size: int
    input_ids: torch.Tensor | None = None  # int64 [M]


def _check_advance(adv, m: int, device: torch.device) -> None:
    if not isinstance(adv, DecodeAdvance):
        raise ValueError(f"advance must be a DecodeAdvance, got {type(adv).__name__}")
    _check_index("advance.positions", adv.positions, m, device)
    _check_index("advance.slot_mapping", adv.slot_mapping, m, device)
    _check_index("advance.sent_positions", adv.sent_positions, m, device)
    _check_index("advance.seq_lens", adv.seq_lens, m, device, torch.int32)
    if adv.input_ids is not None:
        _check_index("advance.input_ids", adv.input_ids, m, device)
    t = adv.block_table
    if t.dtype != torch.int32 or t.dim() != 2 or t.shape[0] != m or t.stride(1) != 1:
        raise ValueError(f"advance.block_table must be int32 [{m}, W], got {t.dtype}")
    if t.device != device or t.shape[1] < 1:
        raise ValueError(f"advance.block_table must be on {device} with >= 1 column")
    if not isinstance(adv.page_size, int) or adv.page_size < 1:
        raise ValueError(f"advance.page_size must be a positive int, got {adv.page_size!r}")


def _check_allowed(allowed, m: int, v: int, device: torch.device):
    if not isinstance(allowed, (tuple, list)) or len(allowed) != 2:
        raise ValueError("allowed must be a pair (bitmask, rows or None)")
    bits, on = allowed
    width = cdiv(v, 32)
    if not isinstance(bits, torch.Tensor) or bits.dtype != torch.int32 or bits.dim() != 2:
        raise ValueError("allowed bitmask must be an int32 [rows, ceil(vocab / 32)] tensor")
    if bits.shape[0] != m or bits.shape[1] < width or bits.stride(1) != 1:
        raise ValueError(
            f"allowed bitmask must be [{m}, >= {width}] with contiguous rows, got "
            f"{list(bits.shape)} at strides {bits.stride()}"
        )
    if bits.device != device:
        raise ValueError(f"allowed bitmask is on {bits.device}, x on {device}")
    if on is not None:
        _check_index("allowed rows", on, m, device, torch.int32)
    return bits, on


def _check_index(
    name: str, t, length: int | None, device: torch.device, dtype: torch.dtype = torch.int64
) -> None:
    """A 1-d contiguous tensor of dtype on x's device (of `length` entries where given)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    want = f"[{length}]" if length is not None else "1-d"
    if t.dtype != dtype or t.dim() != 1 or (length is not None and t.shape[0] != length):
        kind = str(dtype).removeprefix("torch.")
        raise ValueError(f"{name} must be {kind} {want}, got {t.dtype} {list(t.shape)}")
    if t.stride(0) != 1 and t.shape[0] > 1:
        raise ValueError(f"{name} must be contiguous, strides {t.stride()}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, x on {device}")


def argmax_rows(
    x: torch.Tensor,
    *,
    scatter: tuple[torch.Tensor, torch.Tensor] | None = None,
    host: tuple[torch.Tensor, torch.Tensor] | None = None,
    advance: DecodeAdvance | None = None,
    pdl: bool = False,
    allowed: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """x: float [M, V] (rows may sit at a stride; entries contiguous) -> int64 [M], the index of
    each row's maximum as torch.argmax(x, dim=-1) returns it.

    scatter=(dst, rows): dst int64 [N], rows int64 [M]; also dst[rows[i]] = token i, skipping
    rows[i] outside [0, N) (padding). Rows must be distinct where they are written (as for
    index_copy_). host=(buf, slot): buf int64 [S, >= M] in host memory (pinned when x is on
    a GPU), slot int64 [1] on x's device; also buf[slot, i] = token i (with scatter: for rows
    >= 0 only). advance (needs scatter and host): DecodeAdvance; its tensors, rows and slot
    must not be written by the kernels in front of this one (they are read before the PDL
    wait: a decode graph's step inputs). pdl: launch with
    programmatic dependent launch where pdl_available(x.device), else as usual.
    allowed=(bitmask, rows): bitmask int32 [M, >= ceil(V / 32)] on x's device, token j of row i
    allowed where bit j % 32 of bitmask[i, j // 32] is set (xgrammar's layout); rows int32 [M]
    (nonzero: the row's bitmask applies) or None (every row's does). A disallowed entry counts
    as -inf: the argmax of the row with the grammar's mask applied, without writing the mask
    into x."""
    if x.dim() != 2:
        raise ValueError(f"x must be [rows, vocab], got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    check_launchable(x, "x")
    m, v = x.shape
    if v == 0:
        raise ValueError("x has no columns: argmax of an empty row")
    if v >= 2**31:
        raise ValueError(f"x has {v} columns: at most 2^31 - 1")
    if scatter is not None:
        if not isinstance(scatter, (tuple, list)) or len(scatter) != 2:
            raise ValueError("scatter must be a pair (dst, rows)")
        dst, rows = scatter
        _check_index("dst", dst, None, x.device)
        _check_index("rows", rows, m, x.device)
    if host is not None:
        if not isinstance(host, (tuple, list)) or len(host) != 2:
            raise ValueError("host must be a pair (buf, slot)")
        buf, slot = host
        if not isinstance(buf, torch.Tensor) or buf.dtype != torch.int64 or buf.dim() != 2:
            raise ValueError("host buf must be an int64 [slots, rows] tensor")
        if buf.shape[1] < m or buf.stride(1) != 1:
            raise ValueError(f"host buf must hold {m} contiguous entries a slot, got {buf.shape}")
        if buf.device.type != "cpu" or (x.device.type == "cuda" and not buf.is_pinned()):
            raise ValueError("host buf must be in host memory, pinned when x is on a GPU")
        _check_index("slot", slot, 1, x.device)
    if advance is not None:
        if scatter is None or host is None:
            raise ValueError("advance needs scatter (the rows) and host (the landing rows)")
        _check_advance(advance, m, x.device)
    if allowed is not None:
        bits, on = _check_allowed(allowed, m, v, x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(m, dtype=torch.int64, device=x.device)
    if m == 0:
        return out
    pdl = pdl and pdl_available(x.device)
    ids = advance.input_ids if advance is not None else None
    block = min(next_power_of_2(v), _MAX_BLOCK)
    _argmax_rows_kernel[(m,)](
        x,
        out,
        rows if scatter is not None else out,
        dst if scatter is not None else out,
        buf if host is not None else out,
        slot if host is not None else out,
        advance.positions if advance is not None else out,
        advance.seq_lens if advance is not None else out,
        advance.slot_mapping if advance is not None else out,
        advance.block_table if advance is not None else out,
        advance.sent_positions if advance is not None else out,
        ids if ids is not None else out,
        bits if allowed is not None else out,
        on if allowed is not None and on is not None else out,
        v,
        dst.shape[0] if scatter is not None else 0,
        advance.block_table.shape[1] if advance is not None else 1,
        x.stride(0),
        buf.stride(0) if host is not None else 0,
        advance.block_table.stride(0) if advance is not None else 0,
        bits.stride(0) if allowed is not None else 0,
        BLOCK=block,
        CHUNKS=cdiv(v, block),
        SCATTER=scatter is not None,
        HOST=host is not None,
        ADVANCE=advance is not None,
        IDS=ids is not None,
        PAGE=advance.page_size if advance is not None else 1,
        PDL=pdl,
        ALLOWED=allowed is not None,
        ALLOWED_ROWS=allowed is not None and on is not None,
        num_warps=16 if block >= 8192 else 4,
        **({"launch_pdl": True} if pdl else {}),
    )
    return out
