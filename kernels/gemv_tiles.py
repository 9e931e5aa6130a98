"""How many weight rows and warps a small-batch GEMV program takes (fused_gemv.py and
qkv_rope.py), so that its weight tile(s) stay in registers and enough of the HBM stream is in
flight. Pure Python: the rules and the H200 measurements behind them.
"""

from __future__ import annotations

from .host_math import next_power_of_2

# Per-thread registers for the weight tile(s): at most this many elements.
ELEMS_PER_THREAD = 64
FP8_ELEMS_PER_THREAD = 256  # FP8 weights: 64 registers of 4 codes
MAX_WARPS = 16
# weights this large take at most 8 warps a program where a tile fits (tile_config says why)
LONG_GEMV_BYTES = 64 << 20


def tile_config(k: int, gated: bool, weight_bytes: int = 0, itemsize: int = 2) -> dict | None:
    """BLOCK_N and warps so a program's [BLOCK_N, K] weight tile(s) fit in registers (H200,
    2026-11-29: BLOCK_N 4 at K 2048); None if even one row does not (K above 32768, or 16384
    gated: no model the small-batch forward takes).

    Where the weights are LONG_GEMV_BYTES or more, fewer rows a program come before more warps
    (at most 8 warps where that fits). H200 (2026-11-30): a long launch streams
    K 14336 at 4.36 TB/s with BLOCK_N 1 x 8 warps against 3.82 with 2 x 16, and K 5632 at 4.31
    against 3.11; Llama-3-8B batch 1 (gate/up 235 MB, down 117 MB) 231 against 226 tok/s. But
    the 1.1B shape's 23 MB down projection, a short launch between PDL waits, is slower that way
    (1,271-1,277 against 1,300-1,304 tok/s): its wider tile stays.

    A short, un-gated GEMV with K in (4096, 8192] and 2-byte weights takes 8 rows x 8 warps
    instead, so that all of it is in flight at once. Compiled for sm_90, the 1.1B down
    projection's 4 rows x 16 warps (58 registers) runs 2 programs a SM, 88 KB of weights in
    flight a SM, so its 512 programs come in 2 waves, and HBM idles while the first wave
    computes and exits; 8 x 8 (128 registers, no spills) also runs 2 a SM but with 176 KB in
    flight: its 256 programs are one wave. H200 (2026-11-30): the 1.1B batch 1 1,347-1,354
    tok/s against 1,322-1,336, interleaved in one call; the profiler's critical path (gate/up
    + down) 18.6 us a layer against 19.9 (evals/profiling/engine_bench.py --kernels). (At 2-8
    rows both tiles run one program a SM, 88 against 44 KB in flight; fp32 weights would
    double the registers, hence 2-byte weights only.)"""
    if itemsize == 1:
        return fp8_tile_config(k, gated)
    if not gated and itemsize == 2 and 4096 < k <= 8192 and weight_bytes < LONG_GEMV_BYTES:
        return dict(BLOCK_N=8, num_warps=8)
    k_pad = next_power_of_2(k)
    caps = (MAX_WARPS,) if weight_bytes < LONG_GEMV_BYTES else (8, MAX_WARPS)
    for cap in caps:
        for block_n in (4, 2, 1):
            elems = block_n * k_pad * (2 if gated else 1)
            warps = max(4, elems // (32 * ELEMS_PER_THREAD))
            if warps <= cap:
                return dict(BLOCK_N=block_n, num_warps=warps)
    return None


def fp8_tile_config(k: int, gated: bool, rows_per_unit: int = 1) -> dict | None:
    """FP8 weights (kept float8 in registers: fused_gemv.load_weight_tile): FP8_ELEMS_PER_THREAD
    weights a thread, 4 warps a program, as many rows (in units of rows_per_unit) as that holds, at
    most 8; more warps only where one unit does not fit. H200, Llama-3-8B shape, batch 1
    (2026-12-03, a one-off sweep whose script and log are not kept; fused_gemv's
    load_weight_tile names the kept benchmark), us a product at this rule's tile against the
    best of 11 tiles swept: q/k/v
    8.7 / 8.6 (8 rows x 4 warps), o 6.1 / 6.0, gate/up 29.5 / 29.5 (4 x 4), down 18.4 / 18.4
    (2 x 4); 8 warps where 4 hold the same rows were as fast or slower, 16 always slower."""
    k_pad = next_power_of_2(k)
    per_row = k_pad * (2 if gated else 1)
    units = max(1, min(8, 4 * 32 * FP8_ELEMS_PER_THREAD // (per_row * rows_per_unit)))
    warps = max(4, units * rows_per_unit * per_row // (32 * FP8_ELEMS_PER_THREAD))
    if warps > MAX_WARPS:
        return None
    return dict(BLOCK_N=units, num_warps=warps)
